//! Publication by compare-and-swap: what a compile publishes is found through the platform's read
//! path and superseded by the next, a candidate over a moved head is rebased in place or replaced,
//! and the smoke evaluation judges only the attempt's own document.

use super::*;

/// Two documents whose candidates both passed their smoke evaluation over the empty head, and
/// the first of them published: the second now finds the head moved. Returns the documents and
/// the attempts.
async fn second_candidate_over_a_moved_head(
    fx: &Fx,
    engine: &kfs_worker::consumer::Engine,
) -> (Uuid, Uuid, Uuid, Uuid) {
    let a_doc = fx
        .add(
            "a.md",
            "text/markdown",
            b"# Alpha\n\nAlbatross gliding over waves.",
        )
        .await;
    let b_doc = fx
        .add(
            "b.md",
            "text/markdown",
            b"# Beta\n\nBuffalo grazing the prairie.",
        )
        .await;
    let a = fx.request(a_doc, false).await.unwrap();
    let b = fx.request(b_doc, false).await.unwrap();
    // Interleave one-step slices: both build their candidates against the empty head.
    loop {
        let (sa, sb) = (fx.status(a).await, fx.status(b).await);
        if sa.checkpoint == "smoke_eval_passed" && sb.checkpoint == "smoke_eval_passed" {
            break;
        }
        for (x, s) in [(a, sa), (b, sb)] {
            if s.checkpoint != "smoke_eval_passed" {
                assert_eq!(
                    fx.slice(engine, x).await,
                    Handled::Ack {
                        claim: "claimed",
                        end: Some("continue")
                    }
                );
            }
        }
    }
    let (sa, sb) = (fx.status(a).await, fx.status(b).await);
    assert_eq!((sa.base_head_revision, sb.base_head_revision), (0, 0));
    // A publishes first, while B's row is held (as a worker's step holds it), so that A does
    // not publish B with it; B then finds the head moved from 0 to 1.
    let mut hold = fx.pool().begin().await.unwrap();
    sqlx::query("SELECT 1 FROM document_compilation_attempts WHERE id = $1 FOR NO KEY UPDATE")
        .bind(b)
        .execute(&mut *hold)
        .await
        .unwrap();
    assert_succeeded(&fx.drive(engine, a).await);
    hold.rollback().await.unwrap();
    assert_eq!(fx.head().await.unwrap().revision, 1);
    (a_doc, b_doc, a, b)
}

/// The members of a publication, as (type, key, document).
async fn members_of(fx: &Fx, publication: Uuid) -> Vec<(String, Uuid, Option<Uuid>)> {
    sqlx::query_as(
        "SELECT component_type::text, component_key, document_asset_id FROM projection_set_publication_members \
         WHERE publication_id = $1 ORDER BY 1, 2",
    )
    .bind(publication)
    .fetch_all(fx.pool())
    .await
    .unwrap()
}

/// The statuses of the space's publications: id → (status, superseded by).
async fn publication_states(fx: &Fx) -> Vec<(Uuid, String, Option<String>)> {
    sqlx::query_as(
        "SELECT id, status::text, superseded_by_fingerprint::text FROM projection_set_publications \
         WHERE tenant_id = $1 AND knowledge_space_id = $2",
    )
    .bind(TENANT)
    .bind(fx.space)
    .fetch_all(fx.pool())
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_head_that_moved_during_publish_is_taken_into_the_candidate_in_place() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-interleave", 1);
    let (a_doc, b_doc, a, b) = second_candidate_over_a_moved_head(&fx, &engine).await;
    let sa = fx.status(a).await;
    let before = fx.status(b).await;
    let b_first = before.candidate_publication_id.unwrap();
    let b_own = members_of(&fx, b_first).await;
    assert!(
        b_own.iter().all(|m| m.2 == Some(b_doc)),
        "over the empty head B's candidate is its own"
    );
    let a_members = members_of(&fx, sa.candidate_publication_id.unwrap()).await;

    let sb = fx.drive(&engine, b).await;
    assert_succeeded(&sb);
    assert_eq!(sb.base_head_revision, 1, "rebased on the moved head");
    assert_eq!(
        sb.candidate_publication_id,
        Some(b_first),
        "the candidate moved in place, no new one"
    );
    assert_ne!(
        sb.candidate_fingerprint, before.candidate_fingerprint,
        "the fingerprint follows the members"
    );
    let head = fx.head().await.unwrap();
    assert_eq!((head.revision, head.publication_id), (2, b_first));
    assert_eq!(
        sb.candidate_fingerprint.as_deref(),
        Some(head.fingerprint.as_str())
    );
    let mut expected: Vec<_> = a_members.into_iter().chain(b_own).collect();
    expected.sort();
    assert_eq!(
        members_of(&fx, b_first).await,
        expected,
        "A's published members and B's own, nothing else"
    );
    let (base, material): (Option<String>, String) = sqlx::query_as(
        "SELECT metadata -> 'documentCompilationCandidate' ->> 'baseHeadRevision', \
           (metadata -> 'projectionSetFingerprintMaterial')::text \
         FROM projection_set_publications WHERE id = $1",
    )
    .bind(b_first)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(base.as_deref(), Some("1"));
    assert!(
        material.contains(&a_doc.to_string()) && material.contains(&b_doc.to_string()),
        "the fingerprint material covers both documents: {material}"
    );
    let mut served: Vec<Uuid> = fx.served().await.keys().copied().collect();
    served.sort();
    let mut both = vec![a_doc, b_doc];
    both.sort();
    assert_eq!(served, both, "the rebased publication keeps A and adds B");
    assert_eq!(fx.search("albatross").await.len(), 1);
    assert_eq!(fx.search("buffalo").await.len(), 1);
    let states = publication_states(&fx).await;
    let status_of = |id: Uuid| states.iter().find(|s| s.0 == id).unwrap().clone();
    assert_eq!(status_of(b_first).1, "published");
    let a_pub = status_of(sa.candidate_publication_id.unwrap());
    assert_eq!(
        (a_pub.1.as_str(), a_pub.2.as_deref()),
        ("superseded", Some(head.fingerprint.as_str())),
        "A's publication is superseded by B's fingerprint"
    );
    assert_eq!(states.len(), 2);
    fx.cleanup().await;
}

/// A candidate that can no longer move in place (here: given up meanwhile) is replaced by a new
/// one composed over the moved head, and the attempt is bound to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_candidate_that_cannot_move_in_place_is_replaced_by_one_composed_over_the_moved_head() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-interleave", 1);
    let (a_doc, b_doc, a, b) = second_candidate_over_a_moved_head(&fx, &engine).await;
    let sa = fx.status(a).await;
    let b_first = fx.status(b).await.candidate_publication_id.unwrap();
    sqlx::query("UPDATE projection_set_publications SET status = 'inactive' WHERE id = $1")
        .bind(b_first)
        .execute(fx.pool())
        .await
        .unwrap();

    let sb = fx.drive(&engine, b).await;
    assert_succeeded(&sb);
    assert_eq!(sb.base_head_revision, 1, "rebased on the moved head");
    let b_rebased = sb.candidate_publication_id.unwrap();
    assert_ne!(b_rebased, b_first, "bound to a new candidate");
    let head = fx.head().await.unwrap();
    assert_eq!((head.revision, head.publication_id), (2, b_rebased));
    assert_eq!(
        sb.candidate_fingerprint.as_deref(),
        Some(head.fingerprint.as_str())
    );
    let mut served: Vec<Uuid> = fx.served().await.keys().copied().collect();
    served.sort();
    let mut both = vec![a_doc, b_doc];
    both.sort();
    assert_eq!(served, both, "the new candidate keeps A and adds B");
    let states = publication_states(&fx).await;
    let status_of = |id: Uuid| states.iter().find(|s| s.0 == id).unwrap().clone();
    assert_eq!(status_of(b_first).1, "inactive");
    assert_eq!(status_of(b_rebased).1, "published");
    assert_eq!(
        status_of(sa.candidate_publication_id.unwrap()).1,
        "superseded"
    );
    assert_eq!(states.len(), 3);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_compiled_document_is_found_through_the_platforms_read_path_and_a_second_compile_supersedes_the_first(
) {
    let fx = Fx::new().await;
    let first = fx
        .add(
            "kelp.md",
            "text/markdown",
            b"# Kelp\n\nKelp forests shelter sea otters.",
        )
        .await;
    let one = fx.compile(first).await;
    let head1 = fx.head().await.unwrap();
    assert_eq!(head1.revision, 1);
    assert_eq!(head1.publication_id, one.candidate_publication_id.unwrap());
    // The first head takes the space's id as its own.
    let head_id: Uuid = sqlx::query_scalar(
        "SELECT id FROM projection_set_publication_heads WHERE tenant_id = $1 AND knowledge_space_id = $2",
    )
    .bind(TENANT)
    .bind(fx.space)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(head_id, fx.space);

    // The platform's retrieval, written out step by step: the head's publication, its
    // index-projection members, a node of a published generation and its ready fts projection.
    let found: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT n.id, n.text FROM projection_set_publication_heads h \
         JOIN projection_set_publications p ON p.id = h.publication_id AND p.tenant_id = h.tenant_id \
           AND p.knowledge_space_id = h.knowledge_space_id AND p.status = 'published' \
         JOIN projection_set_publication_members m ON m.tenant_id = p.tenant_id \
           AND m.knowledge_space_id = p.knowledge_space_id AND m.publication_id = p.id \
           AND m.component_type = 'index-projection' \
         JOIN index_projections ip ON ip.id = m.component_key AND ip.publication_generation_id = m.generation_id \
           AND ip.type = 'fts' AND ip.status = 'ready' \
         JOIN knowledge_nodes n ON n.id = ip.node_id AND n.publication_generation_id = m.generation_id \
         WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2 \
           AND ip.fts_document @@ plainto_tsquery('simple', 'otters')",
    )
    .bind(TENANT)
    .bind(fx.space)
    .fetch_all(fx.pool())
    .await
    .unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].1.contains("sea otters"));
    assert_eq!(
        fx.search("otters").await.len(),
        1,
        "the read path of publication.rs agrees"
    );

    let second = fx
        .add(
            "reef.md",
            "text/markdown",
            b"# Reef\n\nCoral reefs host parrotfish.",
        )
        .await;
    let two = fx.compile(second).await;
    let head2 = fx.head().await.unwrap();
    assert_eq!(head2.revision, 2);
    assert_eq!(head2.publication_id, two.candidate_publication_id.unwrap());
    let (status, by): (String, Option<String>) = sqlx::query_as(
        "SELECT status::text, superseded_by_fingerprint::text FROM projection_set_publications WHERE id = $1",
    )
    .bind(head1.publication_id)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(status, "superseded");
    assert_eq!(by.as_deref(), Some(head2.fingerprint.as_str()));
    assert_eq!(head2.fingerprint.len(), 86);
    assert!(head2.fingerprint.starts_with("projection-set-sha256:"));
    // The new publication inherits the first document's members unchanged.
    let inherited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM projection_set_publication_members a JOIN projection_set_publication_members b \
           ON b.component_type = a.component_type AND b.component_key = a.component_key \
          AND b.generation_id = a.generation_id \
         WHERE a.publication_id = $1 AND b.publication_id = $2 AND a.document_asset_id = $3",
    )
    .bind(head1.publication_id)
    .bind(head2.publication_id)
    .bind(first)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    let of_first: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM projection_set_publication_members WHERE publication_id = $1",
    )
    .bind(head1.publication_id)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(inherited, of_first);
    assert_eq!(fx.search("otters").await.len(), 1);
    assert_eq!(fx.search("parrotfish").await.len(), 1);
    fx.cleanup().await;
}

/// The smoke evaluation judges the attempt's own document: a fault there fails the attempt,
/// while a fault in a document the candidate inherits from the head (published by an earlier
/// attempt) does not fail every later upload to the space.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_smoke_evaluation_fails_the_attempts_own_document_and_not_what_its_candidate_inherits()
{
    let fx = Fx::new().await;
    let first = fx
        .add("first.md", "text/markdown", b"# First\n\nPuffins burrow.")
        .await;
    fx.compile(first).await;
    // The published document's full-text projections go bad after its publish.
    let broken = sqlx::query(
        "UPDATE index_projections SET status = 'failed' \
         WHERE knowledge_space_id = $1 AND type = 'fts' AND metadata ->> 'documentAssetId' = $2",
    )
    .bind(fx.space)
    .bind(first.to_string())
    .execute(fx.pool())
    .await
    .unwrap();
    assert!(broken.rows_affected() > 0);

    // Another upload still compiles and publishes over that head.
    let second = fx
        .add(
            "second.md",
            "text/markdown",
            b"# Second\n\nRazorbills fly low.",
        )
        .await;
    let s = fx.compile(second).await;
    assert_succeeded(&s);
    assert!(fx.served().await.contains_key(&second));

    // A document whose own projection is missing fails its smoke evaluation.
    let third = fx
        .add(
            "third.md",
            "text/markdown",
            b"# Third\n\nShags dry their wings.",
        )
        .await;
    let one_step = fx.engine("w-smoke", 1);
    let attempt = fx.request(third, false).await.unwrap();
    fx.drive_to(&one_step, attempt, "projection_built").await;
    let gone = sqlx::query(
        "DELETE FROM projection_set_publication_members m USING index_projections p \
         WHERE m.publication_id = $1 AND m.component_type = 'index-projection' \
           AND p.id = m.component_key AND p.type = 'fts' AND p.metadata ->> 'documentAssetId' = $2",
    )
    .bind(fx.status(attempt).await.candidate_publication_id.unwrap())
    .bind(third.to_string())
    .execute(fx.pool())
    .await
    .unwrap();
    assert!(gone.rows_affected() > 0);
    let s = fx.drive(&one_step, attempt).await;
    assert_failed(&s, "smoke_eval_failed");
    assert!(s
        .last_error_message
        .as_deref()
        .is_some_and(|m| m.contains(&third.to_string())));
    assert!(!fx.served().await.contains_key(&third));
    fx.cleanup().await;
}
