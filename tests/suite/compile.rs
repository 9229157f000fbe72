//! document.compile against real Postgres and RabbitMQ: request, the fenced walk, publication
//! by compare-and-swap, failures with clear codes, supersede, manual retry, deferred dispatch,
//! the command line, kill points (with `--features crash-points`) and 200 documents across two
//! worker processes.
//!
//! Most tests drive deliveries in-process: the outbox row is put out for delivery by SQL (as the
//! relay's mark leaves it) and `Engine::process_ref` runs the slice, so interleavings are exact.
//! Document bytes live in a temporary `file://` object store that the test and any spawned
//! worker share.

use std::time::{Duration, Instant};

use bytes::Bytes;
use kfs_worker::consumer::Handled;
use kfs_worker::jobs::compile::artifact;
use kfs_worker::jobs::compile::chunk::{self, MAX_CHUNK_GRAPHEMES};
use kfs_worker::jobs::compile::parse;
use kfs_worker::jobs::compile::{
    self, AttemptStatus, CompileError, CompileHandler, RequestOptions, Requester,
};
use kfs_worker::jobs::{Deps, Kind};
use kfs_worker::tools::platform;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::support;
use crate::support::space::{SpaceFx, GUIDE_MD, NOTES_TXT, PAGE_HTML};

const TENANT: &str = "tenant-compile";

support::space::space_fixture!(
    /// A test database and queues, a shared file object store, and one knowledge space.
    Fx
);

impl Fx {
    async fn new() -> Fx {
        Fx(SpaceFx::new(TENANT, "compile", "Compile tests").await)
    }

    /// Nodes of `doc` reachable from the head's publication through its projection members of `doc`.
    async fn served_nodes(&self, doc: Uuid) -> i64 {
        sqlx::query_scalar(
            "SELECT count(DISTINCT n.id) FROM projection_set_publication_heads h \
             JOIN projection_set_publication_members m ON m.tenant_id = h.tenant_id \
               AND m.knowledge_space_id = h.knowledge_space_id AND m.publication_id = h.publication_id \
               AND m.component_type = 'index-projection' AND m.document_asset_id = $3 \
             JOIN index_projections p ON p.id = m.component_key AND p.publication_generation_id = m.generation_id \
             JOIN knowledge_nodes n ON n.id = p.node_id AND n.publication_generation_id = p.publication_generation_id \
             WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2 AND n.document_asset_id = $3",
        )
        .bind(TENANT)
        .bind(self.space)
        .bind(doc)
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    async fn rows_of_generation(&self, table: &str, generation: Uuid) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {table} WHERE knowledge_space_id = $1 AND publication_generation_id = $2"
        ))
        .bind(self.space)
        .bind(generation)
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    async fn cleanup(self) {
        self.0.cleanup().await;
    }
}

/// The nodes a document must produce: the platform's chunker over its parse's elements (plain
/// text is parsed as Markdown).
fn expected_nodes(mime: &str, filename: &str, bytes: &[u8]) -> i64 {
    let f = match parse::detect(mime, filename).unwrap() {
        parse::Format::Text => parse::Format::Markdown,
        f => f,
    };
    let id = Uuid::new_v4();
    let els = artifact::elements(id, &parse::parse(f, bytes).unwrap());
    chunk::chunk(&els, id, "h").len() as i64
}

fn assert_succeeded(s: &AttemptStatus) {
    assert_eq!(s.run_state, "succeeded", "{s:?}");
    assert_eq!(s.checkpoint, "published", "{s:?}");
    assert_eq!(s.active_slot, None);
    assert_eq!(s.outbox_status.as_deref(), Some("completed"));
    assert!(s.candidate_publication_id.is_some() && s.candidate_fingerprint.is_some());
}

fn assert_failed(s: &AttemptStatus, code: &str) {
    assert_eq!(s.run_state, "failed", "{s:?}");
    assert_eq!(s.last_error_code.as_deref(), Some(code), "{s:?}");
    assert_eq!(s.active_slot, None, "a failed attempt frees its slot");
    assert!(s.completed_at.is_some());
    assert_eq!(s.outbox_status.as_deref(), Some("dead"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_format_is_compiled_published_and_searchable() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-formats", 64);
    let docs = [
        (
            "guide.md",
            "text/markdown",
            GUIDE_MD,
            "zeppelin mooring",
            "superheat",
        ),
        (
            "page.html",
            "text/html; charset=utf-8",
            PAGE_HTML,
            "fresnel lens",
            "diaphones",
        ),
        (
            "notes.txt",
            "text/plain",
            NOTES_TXT,
            "varroa mites",
            "carniolan",
        ),
    ];
    let mut revision = 0;
    for (name, mime, bytes, query, word) in docs {
        let doc = fx.add(name, mime, bytes).await;
        let attempt = fx.request(doc, false).await.unwrap();
        let created = fx.status(attempt).await;
        assert_eq!(
            (
                created.run_state.as_str(),
                created.checkpoint.as_str(),
                created.active_slot,
                created.row_version,
                created.execution_attempts,
                created.max_execution_attempts,
                created.base_head_revision,
            ),
            ("dispatch_pending", "queued", Some(1), 0, 0, 5, revision)
        );
        assert_eq!(created.tenant_id, TENANT);
        assert_ne!(created.publication_generation_id, Uuid::nil());
        let (payload, key, event, schema, dispatch_attempts): (
            serde_json::Value,
            String,
            String,
            i32,
            i32,
        ) = sqlx::query_as(
            "SELECT payload, idempotency_key, event_type, schema_version, dispatch_attempts \
                 FROM document_compilation_outbox WHERE attempt_id = $1",
        )
        .bind(attempt)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert_eq!(
            payload,
            serde_json::json!({ "attemptId": attempt.to_string() })
        );
        assert_eq!(key, format!("document.compile:{attempt}"));
        assert_eq!(
            (event.as_str(), schema, dispatch_attempts),
            ("document.compile", 1, 0)
        );

        let done = fx.drive(&engine, attempt).await;
        assert_succeeded(&done);
        revision += 1;
        let head = fx.head().await.unwrap();
        assert_eq!(head.revision, revision);
        assert_eq!(head.status, "published");
        assert_eq!(
            Some(head.publication_id),
            done.candidate_publication_id,
            "the attempt's own candidate is what the head publishes"
        );
        let served = fx.served().await;
        assert_eq!(served[&doc].generation, done.publication_generation_id);
        assert_eq!(served[&doc].version, 1);

        let expected = expected_nodes(mime, name, bytes);
        assert!(expected >= 1, "{name}");
        assert_eq!(fx.served_nodes(doc).await, expected, "{name}");
        let g = done.publication_generation_id;
        assert_eq!(fx.rows_of_generation("knowledge_nodes", g).await, expected);
        assert_eq!(
            fx.rows_of_generation("index_projections", g).await,
            expected,
            "one fts projection per node, no dense one without an embedding profile"
        );
        assert_eq!(fx.rows_of_generation("document_outlines", g).await, 1);
        assert_eq!(
            fx.rows_of_generation("document_multimodal_manifests", g)
                .await,
            1
        );
        assert!(fx.rows_of_generation("knowledge_paths", g).await >= 3);
        let (ready, building): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE status = 'ready'), count(*) FILTER (WHERE status <> 'ready') \
             FROM index_projections WHERE publication_generation_id = $1 AND type = 'fts' \
               AND model = 'database-fts@1' AND projection_version = 1 AND fts_document IS NOT NULL",
        )
        .bind(g)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert_eq!((ready, building), (expected, 0), "promoted at publish");
        let (status, nodes, terms, actual_nodes): (String, i32, i32, i64) = sqlx::query_as(
            "SELECT m.status, m.node_count, m.term_count, (SELECT count(*) FROM page_index_nodes n WHERE n.manifest_id = m.id) \
             FROM page_index_manifests m WHERE m.publication_generation_id = $1",
        )
        .bind(g)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert_eq!(status, "ready");
        assert!(nodes > 0 && terms > 0);
        assert_eq!(i64::from(nodes), actual_nodes);
        let longest: i32 = sqlx::query_scalar(
            "SELECT max(char_length(text)) FROM knowledge_nodes WHERE publication_generation_id = $1",
        )
        .bind(g)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert!(longest as usize <= MAX_CHUNK_GRAPHEMES);
        let (parser_status, artifacts): (String, i64) = sqlx::query_as(
            "SELECT d.parser_status, (SELECT count(*) FROM parse_artifacts a WHERE a.document_asset_id = d.id AND a.version = 1) \
             FROM document_assets d WHERE d.id = $1",
        )
        .bind(doc)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert_eq!((parser_status.as_str(), artifacts), ("parsed", 1));

        for q in [query, word] {
            let hits = fx.search(q).await;
            assert!(!hits.is_empty(), "{name}: no hit for {q:?}");
            assert!(
                hits.iter().all(|h| h.document_asset_id == doc),
                "{name}: {hits:?}"
            );
        }
    }
    // Markdown: headings made the outline tree, the long section was split, front matter and
    // code fences kept their place.
    let nodes: serde_json::Value = sqlx::query_scalar(
        "SELECT o.nodes FROM document_outlines o JOIN document_assets d ON d.id = o.document_asset_id \
         WHERE d.filename = 'guide.md'",
    )
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(nodes[0]["title"], "Zeppelin Field Guide");
    assert_eq!(nodes[0]["tocSource"], "parser-heading");
    let h2: Vec<&str> = nodes[0]["children"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["title"].as_str().unwrap())
        .collect();
    assert_eq!(h2, ["Mooring", "Ballast", "Navigation"]);
    assert_eq!(nodes[0]["children"][1]["children"][0]["title"], "Weigh-off");
    let weigh = fx.search("static heaviness").await;
    assert_eq!(weigh.len(), 1);
    assert_eq!(
        weigh[0].source_location["sectionPath"],
        serde_json::json!(["Zeppelin Field Guide", "Ballast", "Weigh-off"])
    );
    // HTML: scripts and styles are not content.
    assert!(fx.search("telemetry indexed").await.is_empty());
    assert_eq!(fx.served().await.len(), 3, "every document is a member");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_fails_with_a_clear_code_frees_the_slot_and_publishes_nothing() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-bad", 64);

    let corrupt = fx
        .add(
            "broken.md",
            "text/markdown",
            b"# Title\n\nok \xff\xfe bytes",
        )
        .await;
    let mismatched = fx
        .add("tampered.txt", "text/plain", b"original words")
        .await;
    let key: String = sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
        .bind(mismatched)
        .fetch_one(fx.pool())
        .await
        .unwrap();
    fx.store
        .put(&key, Bytes::from_static(b"tampered words"))
        .await
        .unwrap();
    let unsupported = fx.add("photo.bmp", "image/bmp", b"BM6 ...").await;
    let missing = fx.add("gone.txt", "text/plain", b"soon gone").await;
    let key: String = sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
        .bind(missing)
        .fetch_one(fx.pool())
        .await
        .unwrap();
    fx.store.delete(&key).await.unwrap();

    for (doc, code) in [
        (corrupt, "corrupt_document"),
        (mismatched, "hash_mismatch"),
        (unsupported, "unsupported_format"),
        (missing, "object_missing"),
    ] {
        let attempt = fx.request(doc, false).await.unwrap();
        let s = fx.drive(&engine, attempt).await;
        assert_failed(&s, code);
        assert_eq!(s.checkpoint, "queued", "nothing advanced");
        assert!(s
            .last_error_message
            .as_deref()
            .is_some_and(|m| !m.is_empty()));
        assert_eq!(fx.served_nodes(doc).await, 0);
        let parser_status: String =
            sqlx::query_scalar("SELECT parser_status FROM document_assets WHERE id = $1")
                .bind(doc)
                .fetch_one(fx.pool())
                .await
                .unwrap();
        assert_eq!(
            parser_status, "failed",
            "the document records that its bytes failed"
        );
        assert_eq!(
            fx.rows_of_generation("knowledge_nodes", s.publication_generation_id)
                .await,
            0
        );
        // The slot is free: the same version can be requested again.
        let again = fx.request(doc, true).await.unwrap();
        assert_ne!(again, attempt);
    }
    assert!(fx.head().await.is_none(), "nothing was published");
    fx.cleanup().await;
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_an_embedding_profile_every_node_has_a_dense_projection_of_its_vector_space() {
    let fx = Fx::new().await;
    let profile = {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::activate_embedding_profile(
            &mut conn,
            TENANT,
            fx.space,
            "text-embedding-3-small",
            "openai",
            48,
        )
        .await
        .unwrap()
    };
    let doc = fx.add("guide.md", "text/markdown", GUIDE_MD).await;
    let done = fx.compile(doc).await;
    let g = done.publication_generation_id;
    let nodes = fx.rows_of_generation("knowledge_nodes", g).await;
    let (dense, dims, models, ready): (i64, Vec<i32>, Vec<String>, i64) = sqlx::query_as(
        "SELECT count(*), array_agg(DISTINCT vector_dims(dense_vector)), array_agg(DISTINCT model::text), \
           count(*) FILTER (WHERE status = 'ready') \
         FROM index_projections WHERE publication_generation_id = $1 AND type = 'dense-vector'",
    )
    .bind(g)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(dense, nodes, "one dense projection per node");
    assert_eq!(dims, [48], "the profile's dimension");
    assert_eq!(models, std::slice::from_ref(&profile.vector_space_id));
    assert_eq!(ready, nodes);
    let meta: serde_json::Value = sqlx::query_scalar(
        "SELECT metadata FROM index_projections WHERE publication_generation_id = $1 AND type = 'dense-vector' LIMIT 1",
    )
    .bind(g)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(meta["vectorSpaceId"], profile.vector_space_id.as_str());
    assert_eq!(meta["dimension"], 48);
    assert_eq!(meta["embeddingProfile"]["revision"], 1);
    // The platform's dense read path finds the node of the query's words first.
    let query = kfs_worker::embed::Offline::vector("static heaviness weigh-off", 48);
    let head = fx.head().await.unwrap();
    let best: (Uuid, String, f64) = sqlx::query_as(&format!(
        "SELECT x.node_id, x.text, x.score FROM ({}) x LIMIT 1",
        kfs_worker::publication::DENSE_READ_SQL
    ))
    .bind(fx.space)
    .bind(serde_json::to_string(&query).unwrap())
    .bind(TENANT)
    .bind(head.publication_id)
    .bind(48)
    .bind(&profile.vector_space_id)
    .bind(serde_json::json!([]))
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert!(best.1.contains("static heaviness"), "{best:?}");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_requester_binding_is_recorded_whole_and_checked_at_publish() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-binding", 64);
    let snap = fx.snapshot("editor-1").await;
    let doc = fx
        .add(
            "b.md",
            "text/markdown",
            b"# Binding\n\nWalruses haul out on ice.",
        )
        .await;
    let mut tx = fx.pool().begin().await.unwrap();
    let attempt = compile::request(
        &mut tx,
        doc,
        RequestOptions {
            defer: false,
            requester: Some(Requester {
                subject: "editor-1".into(),
                snapshot: snap,
            }),
            grant: None,
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let s = fx.status(attempt).await;
    assert_eq!(
        (
            s.requested_by_subject_id.as_deref(),
            s.permission_snapshot_id,
            s.permission_snapshot_revision,
            s.access_channel.as_deref()
        ),
        (Some("editor-1"), Some(snap), Some(1), Some("interactive"))
    );
    assert_succeeded(&fx.drive(&engine, attempt).await);

    // Refused before anything is written: a snapshot of another subject, or a revoked one.
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM document_compilation_attempts")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    let other = fx
        .add("o.md", "text/markdown", b"# Other\n\nNarwhals.")
        .await;
    let mut tx = fx.pool().begin().await.unwrap();
    let e = compile::request(
        &mut tx,
        other,
        RequestOptions {
            defer: false,
            requester: Some(Requester {
                subject: "someone-else".into(),
                snapshot: snap,
            }),
            grant: None,
        },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(e, CompileError::Snapshot { .. }) && e.is_refusal(),
        "{e}"
    );
    tx.commit().await.unwrap();
    // A snapshot revoked after the request: the publish refuses, nothing is served.
    let late = fx
        .add("l.md", "text/markdown", b"# Late\n\nBelugas sing.")
        .await;
    let mut tx = fx.pool().begin().await.unwrap();
    let attempt = compile::request(
        &mut tx,
        late,
        RequestOptions {
            defer: false,
            requester: Some(Requester {
                subject: "editor-1".into(),
                snapshot: snap,
            }),
            grant: None,
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM document_compilation_attempts")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(after, before + 1, "the refused request wrote nothing");
    let one_step = fx.engine("w-binding-1", 1);
    fx.drive_to(&one_step, attempt, "smoke_eval_passed").await;
    {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::revoke_permission_snapshot(&mut conn, TENANT, snap)
            .await
            .unwrap();
    }
    let s = fx.drive(&engine, attempt).await;
    assert_failed(&s, "permission_snapshot_invalid");
    assert!(fx.search("belugas").await.is_empty());
    let cand: String =
        sqlx::query_scalar("SELECT status::text FROM projection_set_publications WHERE id = $1")
            .bind(s.candidate_publication_id.unwrap())
            .fetch_one(fx.pool())
            .await
            .unwrap();
    assert_eq!(cand, "inactive", "the candidate is given up");

    // The command line records the binding too, and refuses half of it.
    let fresh = fx.snapshot("editor-2").await;
    let doc3 = fx
        .add("c.md", "text/markdown", b"# CLI\n\nManatees graze.")
        .await;
    let out = kfs(
        &fx,
        &[
            "compile",
            &doc3.to_string(),
            "--as",
            "editor-2",
            "--snapshot",
            &fresh.to_string(),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let attempt: Uuid = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let s = fx.status(attempt).await;
    assert_eq!(s.permission_snapshot_id, Some(fresh));
    assert_eq!(s.requested_by_subject_id.as_deref(), Some("editor-2"));
    let out = kfs(&fx, &["compile", &doc3.to_string(), "--as", "editor-2"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publish_over_a_document_being_deleted_waits_for_the_deletion_and_then_publishes() {
    use kfs_worker::jobs::deletion::request::{self as del, DeletionRequest, Target};
    let fx = Fx::new().await;
    let gone = fx
        .add(
            "gone.md",
            "text/markdown",
            b"# Gone\n\nGannets dive for fish.",
        )
        .await;
    fx.compile(gone).await;
    let kept = fx
        .add(
            "kept.md",
            "text/markdown",
            b"# Kept\n\nKittiwakes nest on cliffs.",
        )
        .await;
    let one_step = fx.engine("w-fence", 1);
    let attempt = fx.request(kept, false).await.unwrap();
    fx.drive_to(&one_step, attempt, "smoke_eval_passed").await;
    // The document the candidate inherits is being deleted (tombstone written, head not yet
    // changed): the publish waits, using no attempt, and publishes nothing.
    let owner = fx.snapshot(support::space::OWNER).await;
    let mut tx = fx.pool().begin().await.unwrap();
    let job = del::request_deletion(
        &mut tx,
        &DeletionRequest {
            tenant_id: TENANT.into(),
            knowledge_space_id: fx.space,
            target: Target::Document { id: gone },
            expected_revision: None,
            requested_by_subject_id: support::space::OWNER.into(),
            permission_snapshot_id: owner,
            access_channel: "interactive".into(),
            idempotency_key: "fence-test".into(),
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let before = fx.status(attempt).await;
    assert_eq!(
        fx.slice(&one_step, attempt).await,
        Handled::Ack {
            claim: "claimed",
            end: Some("wait")
        }
    );
    let waited = fx.status(attempt).await;
    assert_eq!(waited.run_state, "retry_wait", "{waited:?}");
    assert_eq!(
        waited.execution_attempts, before.execution_attempts,
        "no attempt used"
    );
    assert_eq!(fx.head().await.unwrap().revision, 1, "nothing published");
    // The deletion takes its target out of the head; the attempt then publishes over it.
    {
        let mut conn = fx.pool().acquire().await.unwrap();
        kfs_worker::publication::publish_excluding(
            &mut conn,
            TENANT,
            fx.space,
            job.job_id,
            Some(&[gone][..]),
            &serde_json::json!({}),
        )
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    }
    sqlx::query("UPDATE document_compilation_attempts SET retry_at = now() WHERE id = $1")
        .bind(attempt)
        .execute(fx.pool())
        .await
        .unwrap();
    let done = fx.drive(&one_step, attempt).await;
    assert_succeeded(&done);
    let served = fx.served().await;
    assert!(
        served.contains_key(&kept) && !served.contains_key(&gone),
        "{served:?}"
    );
    assert_eq!(fx.head().await.unwrap().revision, 3);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publish_behind_a_long_held_head_lock_waits_without_holding_its_job_row() {
    let fx = Fx::new().await;
    let first = fx
        .add("first.md", "text/markdown", b"# First\n\nPuffins burrow.")
        .await;
    fx.compile(first).await;
    let second = fx
        .add(
            "second.md",
            "text/markdown",
            b"# Second\n\nShags dry their wings.",
        )
        .await;
    let one_step = fx.engine("w-head", 1);
    let attempt = fx.request(second, false).await.unwrap();
    fx.drive_to(&one_step, attempt, "smoke_eval_passed").await;
    // Another publisher holds the head far longer than a publish may queue for it.
    let mut holder = fx.pool().begin().await.unwrap();
    sqlx::query(
        "SELECT 1 FROM projection_set_publication_heads WHERE tenant_id = $1 AND knowledge_space_id = $2 FOR UPDATE",
    )
    .bind(TENANT)
    .bind(fx.space)
    .execute(&mut *holder)
    .await
    .unwrap();
    let before = fx.status(attempt).await;
    // The slice ends with a cooperative wait while the head is still held: its transaction
    // (and so the job row the heartbeat needs) is released, no attempt is used.
    let handled = tokio::time::timeout(Duration::from_secs(30), fx.slice(&one_step, attempt))
        .await
        .expect("the publish slice ended while another transaction held the head");
    assert_eq!(
        handled,
        Handled::Ack {
            claim: "claimed",
            end: Some("wait")
        }
    );
    let waited = fx.status(attempt).await;
    assert_eq!(waited.run_state, "retry_wait", "{waited:?}");
    assert_eq!(
        waited.execution_attempts, before.execution_attempts,
        "no attempt used"
    );
    let free: Uuid = sqlx::query_scalar(
        "SELECT id FROM document_compilation_attempts WHERE id = $1 FOR UPDATE NOWAIT",
    )
    .bind(attempt)
    .fetch_one(fx.pool())
    .await
    .expect("the job row is free while the head is held");
    assert_eq!(free, attempt);
    holder.rollback().await.unwrap();
    sqlx::query("UPDATE document_compilation_attempts SET retry_at = now() WHERE id = $1")
        .bind(attempt)
        .execute(fx.pool())
        .await
        .unwrap();
    let done = fx.drive(&one_step, attempt).await;
    assert_succeeded(&done);
    let served = fx.served().await;
    assert!(
        served.contains_key(&first) && served.contains_key(&second),
        "{served:?}"
    );
    fx.cleanup().await;
}

/// An OpenAI-compatible `/embeddings` stand-in on 127.0.0.1: answers the n-th request with the
/// n-th status (the last from then on), `dimension`-wide vectors made from each input's length,
/// and records each request's authorization and body.
async fn embedding_stand_in(
    statuses: Vec<u16>,
    dimension: usize,
) -> (
    String,
    std::sync::Arc<std::sync::Mutex<Vec<(Option<String>, serde_json::Value)>>>,
) {
    use axum::http::{HeaderMap, StatusCode};
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    let app = axum::Router::new().route(
        "/v1/embeddings",
        axum::routing::post(move |headers: HeaderMap, body: String| {
            let seen = seen2.clone();
            let statuses = statuses.clone();
            async move {
                let body: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                let auth = headers
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                let n = {
                    let mut seen = seen.lock().unwrap();
                    seen.push((auth, body.clone()));
                    seen.len()
                };
                let status = statuses[(n - 1).min(statuses.len() - 1)];
                let inputs = body["input"].as_array().cloned().unwrap_or_default();
                // Reversed on purpose: the adapter must order by `index`.
                let data: Vec<serde_json::Value> = inputs
                    .iter()
                    .enumerate()
                    .rev()
                    .map(|(i, t)| {
                        let len = t.as_str().unwrap_or("").len() as f32;
                        let v: Vec<f32> = (0..dimension).map(|d| len + d as f32).collect();
                        serde_json::json!({"object": "embedding", "index": i, "embedding": v})
                    })
                    .collect();
                (
                    StatusCode::from_u16(status).unwrap(),
                    serde_json::json!({"object": "list", "data": data, "model": body["model"]})
                        .to_string(),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}/v1"), seen)
}

fn http_engine(fx: &Fx, base: &str, key: &str) -> kfs_worker::consumer::Engine {
    use kfs_worker::embed::{OpenAiCompatible, OpenAiConfig};
    let embedder = OpenAiCompatible::new(OpenAiConfig {
        base_url: url::Url::parse(base).unwrap(),
        api_key: Some(kfs_worker::jobs::research::generator::ApiKey::new(key)),
        model: None,
        timeout: Duration::from_secs(10),
        batch: 2,
    })
    .unwrap();
    let handler = CompileHandler::new(Deps {
        store: fx.store.clone(),
        embedder: std::sync::Arc::new(embedder),
        parsers: std::sync::Arc::new(kfs_worker::jobs::compile::parse::route::Parsers::local()),
        models: kfs_worker::model::Models::none(),
    })
    .unwrap();
    kfs_worker::consumer::Engine::new(
        fx.pool().clone(),
        "w-http-embedder",
        vec![std::sync::Arc::new(handler)],
        kfs_worker::consumer::ConsumerConfig::default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_http_embedder_sends_the_profiles_model_and_stores_its_vectors() {
    const KEY: &str = "sk-embedding-secret-42";
    let fx = Fx::new().await;
    {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::activate_embedding_profile(
            &mut conn,
            TENANT,
            fx.space,
            "embed-small",
            "openai",
            4,
        )
        .await
        .unwrap();
    }
    let doc = fx.add("guide.md", "text/markdown", GUIDE_MD).await;
    let (base, seen) = embedding_stand_in(vec![503, 200], 4).await;
    let engine = http_engine(&fx, &base, KEY);
    let attempt = fx.request(doc, false).await.unwrap();
    // The service is down at first: a retryable failure, then the next slice embeds.
    let mut retried = false;
    for _ in 0..20 {
        let s = fx.status(attempt).await;
        if s.is_terminal() {
            break;
        }
        if s.run_state == "retry_wait" {
            assert_eq!(s.last_error_code.as_deref(), Some("embedder_unavailable"));
            assert!(!s.last_error_message.unwrap_or_default().contains(KEY));
            retried = true;
            sqlx::query("UPDATE document_compilation_attempts SET retry_at = now() WHERE id = $1")
                .bind(attempt)
                .execute(fx.pool())
                .await
                .unwrap();
        }
        fx.slice(&engine, attempt).await;
    }
    assert!(retried, "the 503 was retried");
    let done = fx.status(attempt).await;
    assert_succeeded(&done);
    let requests = seen.lock().unwrap().clone();
    let nodes = fx
        .rows_of_generation("knowledge_nodes", done.publication_generation_id)
        .await;
    assert!(requests.len() >= 2);
    for (auth, body) in &requests {
        assert_eq!(auth.as_deref(), Some(format!("Bearer {KEY}").as_str()));
        assert_eq!(body["model"], "embed-small", "the profile's model");
        assert!(body["input"].as_array().unwrap().len() <= 2, "batches of 2");
    }
    // Every node's dense vector is the one the service returned for its text, in order.
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT p.dense_vector::text, p.metadata ->> 'embeddingProvider' FROM index_projections p \
         WHERE p.publication_generation_id = $1 AND p.type = 'dense-vector'",
    )
    .bind(done.publication_generation_id)
    .fetch_all(fx.pool())
    .await
    .unwrap();
    assert_eq!(rows.len() as i64, nodes);
    let sent: Vec<String> = requests
        .iter()
        .skip(1)
        .flat_map(|(_, b)| {
            b["input"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    for (v, provider) in &rows {
        assert_eq!(provider, "openai-compatible");
        let first: f32 = v
            .trim_start_matches('[')
            .split(',')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            sent.iter().any(|t| t.len() as f32 == first),
            "{v} matches no input"
        );
    }
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_embedder_answering_the_wrong_dimension_fails_the_attempt_with_a_clear_code() {
    let fx = Fx::new().await;
    {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::activate_embedding_profile(
            &mut conn,
            TENANT,
            fx.space,
            "embed-small",
            "openai",
            8,
        )
        .await
        .unwrap();
    }
    let doc = fx
        .add("n.md", "text/markdown", b"# N\n\nNautilus shells.")
        .await;
    let (base, _) = embedding_stand_in(vec![200], 3).await;
    let engine = http_engine(&fx, &base, "sk-other-secret");
    let attempt = fx.request(doc, false).await.unwrap();
    let s = fx.drive(&engine, attempt).await;
    assert_failed(&s, "embedder_rejected");
    let msg = s.last_error_message.unwrap_or_default();
    assert!(
        msg.contains("dimension 3") && msg.contains("has 8"),
        "{msg}"
    );
    assert!(!msg.contains("sk-other-secret"));
    assert!(fx.head().await.is_none());
    // Without any embedder configured, a space with a profile is refused the same way.
    let unconfigured = CompileHandler::new(Deps {
        store: fx.store.clone(),
        embedder: std::sync::Arc::new(kfs_worker::embed::Unconfigured),
        parsers: std::sync::Arc::new(kfs_worker::jobs::compile::parse::route::Parsers::local()),
        models: kfs_worker::model::Models::none(),
    })
    .unwrap();
    let engine = kfs_worker::consumer::Engine::new(
        fx.pool().clone(),
        "w-none",
        vec![std::sync::Arc::new(unconfigured)],
        kfs_worker::consumer::ConsumerConfig::default(),
    );
    let doc = fx.add("m.md", "text/markdown", b"# M\n\nMarlins.").await;
    let attempt = fx.request(doc, false).await.unwrap();
    let s = fx.drive(&engine, attempt).await;
    assert_failed(&s, "embedder_rejected");
    assert!(s
        .last_error_message
        .unwrap_or_default()
        .contains("KFS_EMBEDDER"));
    fx.cleanup().await;
}

/// Marks an attempt failed exactly as the engine's fatal end does.
async fn fail_like_the_engine(pool: &PgPool, attempt: Uuid) {
    let done = sqlx::query(
        "WITH j AS (UPDATE document_compilation_attempts SET run_state = 'failed', active_slot = NULL, \
           completed_at = now(), last_error_code = 'test_failure', last_error_message = 'failed by the test', \
           retry_at = NULL, row_version = row_version + 1, updated_at = now() \
         WHERE id = $1 AND run_state IN ('queued', 'dispatch_pending') RETURNING id) \
         UPDATE document_compilation_outbox o SET status = 'dead', last_error = 'test_failure' FROM j WHERE o.attempt_id = j.id",
    )
    .bind(attempt)
    .execute(pool)
    .await
    .unwrap();
    assert_eq!(done.rows_affected(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_older_attempt_is_superseded_by_a_later_publication_of_its_version() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-supersede", 1);
    let doc = fx
        .add(
            "s.md",
            "text/markdown",
            b"# Seal\n\nSeals basking on rocks.",
        )
        .await;
    let old = fx.request(doc, false).await.unwrap();
    fx.drive_to(&engine, old, "smoke_eval_passed").await;
    fail_like_the_engine(fx.pool(), old).await;

    let new = fx.request(doc, false).await.unwrap();
    let sn = fx.drive(&engine, new).await;
    assert_succeeded(&sn);

    // The old attempt comes back by manual retry and reaches publish after the newer one won.
    {
        let mut tx = fx.pool().begin().await.unwrap();
        compile::retry(&mut tx, old).await.unwrap();
        tx.commit().await.unwrap();
    }
    let so = fx.drive(&engine, old).await;
    assert!(so.is_superseded(), "{so:?}");
    assert_eq!(so.active_slot, None);
    assert_eq!(so.checkpoint, "smoke_eval_passed", "it never published");
    let head = fx.head().await.unwrap();
    assert_eq!(head.revision, 1, "the head did not move");
    assert_eq!(
        fx.served().await[&doc].generation,
        sn.publication_generation_id
    );
    // Both attempts built the same content, so they share one fingerprint: the newer attempt
    // took over the candidate the old one had left, and published it.
    assert_eq!(so.candidate_publication_id, Some(head.publication_id));
    assert_eq!(sn.candidate_publication_id, Some(head.publication_id));
    assert_eq!(fx.search("basking").await.len(), 1);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn manual_retry_rearms_the_same_attempt_and_outbox_row() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-retry", 64);
    let good = b"Otters juggle pebbles in the kelp forest.";
    let doc = fx.add("otters.txt", "text/plain", good).await;
    let key: String = sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
        .bind(doc)
        .fetch_one(fx.pool())
        .await
        .unwrap();
    fx.store
        .put(&key, Bytes::from_static(b"garbled"))
        .await
        .unwrap();
    let attempt = fx.request(doc, false).await.unwrap();
    let failed = fx.drive(&engine, attempt).await;
    assert_failed(&failed, "hash_mismatch");
    let outbox_before: Uuid =
        sqlx::query_scalar("SELECT id FROM document_compilation_outbox WHERE attempt_id = $1")
            .bind(attempt)
            .fetch_one(fx.pool())
            .await
            .unwrap();

    // Refusals: a retry of a live attempt, and of a failed one while another is active.
    let other = fx.request(doc, true).await.unwrap();
    let mut tx = fx.pool().begin().await.unwrap();
    let e = compile::retry(&mut tx, other).await.unwrap_err();
    assert!(matches!(e, CompileError::NotRetryable { .. }), "{e}");
    let e = compile::retry(&mut tx, attempt).await.unwrap_err();
    assert!(
        matches!(e, CompileError::ActiveAttemptExists { attempt: Some(a), .. } if a == other),
        "{e}"
    );
    assert!(e
        .to_string()
        .contains("already has an active compilation attempt"));
    // The caller's transaction is still usable after the refusals.
    tx.commit().await.unwrap();
    let mut conn = fx.pool().acquire().await.unwrap();
    sqlx::query("DELETE FROM document_compilation_attempts WHERE id = $1")
        .bind(other)
        .execute(&mut *conn)
        .await
        .unwrap();

    fx.store.put(&key, Bytes::from_static(good)).await.unwrap();
    compile::retry(&mut conn, attempt).await.unwrap();
    drop(conn);
    let rearmed = fx.status(attempt).await;
    assert_eq!(rearmed.run_state, "dispatch_pending");
    assert_eq!(rearmed.active_slot, Some(1));
    assert_eq!(rearmed.execution_attempts, 0);
    assert_eq!(rearmed.completed_at, None);
    assert_eq!(rearmed.last_error_code, None);
    assert_eq!(rearmed.row_version, failed.row_version + 1);
    let (outbox_after, status, attempts, queue_job, last_error): (Uuid, String, i32, Option<String>, Option<String>) =
        sqlx::query_as(
            "SELECT id, status, dispatch_attempts, queue_job_id, last_error FROM document_compilation_outbox \
             WHERE attempt_id = $1 AND available_at <= now()",
        )
        .bind(attempt)
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(outbox_after, outbox_before, "the same outbox row");
    assert_eq!(
        (status.as_str(), attempts, queue_job, last_error),
        ("pending", 0, None, None)
    );

    let done = fx.drive(&engine, attempt).await;
    assert_succeeded(&done);
    assert_eq!(fx.search("otters kelp").await.len(), 1);
    let mut conn = fx.pool().acquire().await.unwrap();
    let e = compile::retry(&mut conn, attempt).await.unwrap_err();
    assert!(matches!(e, CompileError::NotRetryable { .. }), "{e}");
    let e = compile::retry(&mut conn, Uuid::now_v7()).await.unwrap_err();
    assert!(matches!(e, CompileError::AttemptNotFound(_)), "{e}");
    drop(conn);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deferred_dispatch_is_not_sent_until_released() {
    use kfs_worker::relay::{Relay, RelayConfig};
    use lapin::options::{BasicAckOptions, BasicGetOptions};

    let fx = Fx::new().await;
    let engine = fx.engine("w-defer", 64);
    let doc = fx
        .add(
            "d.md",
            "text/markdown",
            b"Dormice hibernate in hazel hedges.",
        )
        .await;
    let attempt = fx.request(doc, true).await.unwrap();
    let s = fx.status(attempt).await;
    assert_eq!(s.outbox_status.as_deref(), Some("pending"));
    assert_eq!(
        s.outbox_available_at
            .unwrap()
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        "9999-12-31T23:59:59.999Z"
    );
    let relay = Relay::new(
        fx.pool().clone(),
        fx.env.topology.clone(),
        "test-relay",
        RelayConfig::default(),
        &[Kind::Compile],
    );
    let ch = fx.env.confirm_channel().await;
    let round = relay.relay_once(&ch, Kind::Compile).await.unwrap();
    assert_eq!(round.dispatched, 0, "deferred: not sent");
    assert_eq!(
        fx.env
            .queue_depth(&fx.env.topology.queue(Kind::Compile))
            .await,
        0
    );

    let mut conn = fx.pool().acquire().await.unwrap();
    compile::release(&mut conn, attempt).await.unwrap();
    let e = compile::release(&mut conn, attempt).await.unwrap_err();
    assert!(matches!(e, CompileError::NotDeferred { .. }), "{e}");
    drop(conn);
    let round = relay.relay_once(&ch, Kind::Compile).await.unwrap();
    assert_eq!(round.dispatched, 1, "released: sent");

    // The real message runs the attempt.
    let get = fx.env.channel().await;
    let msg = get
        .basic_get(
            fx.env.topology.queue(Kind::Compile).as_str().into(),
            BasicGetOptions::default(),
        )
        .await
        .unwrap()
        .expect("a message");
    let handled = engine
        .process(
            Kind::Compile,
            &msg.properties,
            &msg.data,
            &CancellationToken::new(),
        )
        .await;
    assert_eq!(
        handled,
        Handled::Ack {
            claim: "claimed",
            end: Some("succeeded")
        }
    );
    msg.ack(BasicAckOptions::default()).await.unwrap();
    assert_succeeded(&fx.status(attempt).await);
    assert_eq!(fx.search("dormice").await.len(), 1);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_active_attempt_and_a_deleting_document_are_refused() {
    let fx = Fx::new().await;
    let doc = fx
        .add("x.txt", "text/plain", b"Xerus squirrels dig burrows.")
        .await;
    let mut tx = fx.pool().begin().await.unwrap();
    let first = compile::request(&mut tx, doc, RequestOptions::default())
        .await
        .unwrap();
    let e = compile::request(&mut tx, doc, RequestOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(e, CompileError::ActiveAttemptExists { attempt: Some(a), version: 1, .. } if a == first),
        "{e}"
    );
    assert!(e.is_refusal());
    tx.commit().await.unwrap();
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM document_compilation_attempts WHERE document_asset_id = $1",
    )
    .bind(doc)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(n, 1);
    let outbox: i64 = sqlx::query_scalar("SELECT count(*) FROM document_compilation_outbox")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(outbox, 1);

    // Two concurrent requests: exactly one wins, the other gets the typed refusal.
    let doc2 = fx.add("y.txt", "text/plain", b"Yaks carry salt.").await;
    let (mut t1, mut t2) = (
        fx.pool().begin().await.unwrap(),
        fx.pool().begin().await.unwrap(),
    );
    let r1 = compile::request(&mut t1, doc2, RequestOptions::default()).await;
    let pending = tokio::spawn(async move {
        let r = compile::request(&mut t2, doc2, RequestOptions::default()).await;
        t2.commit().await.unwrap();
        r
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    t1.commit().await.unwrap();
    let r2 = pending.await.unwrap();
    assert!(r1.is_ok());
    assert!(
        matches!(r2, Err(CompileError::ActiveAttemptExists { .. })),
        "{r2:?}"
    );

    let doc3 = fx.add("z.txt", "text/plain", b"Zebras.").await;
    sqlx::query(
        "UPDATE document_assets SET lifecycle_state = 'deleting', deletion_job_id = gen_random_uuid(), deleting_at = now() \
         WHERE id = $1",
    )
    .bind(doc3)
    .execute(fx.pool())
    .await
    .unwrap();
    let e = fx.request(doc3, false).await.unwrap_err();
    assert!(matches!(e, CompileError::DocumentDeleting { .. }), "{e}");
    let e = fx.request(Uuid::now_v7(), false).await.unwrap_err();
    assert!(matches!(e, CompileError::DocumentNotFound(_)), "{e}");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_document_marked_deleting_mid_compile_is_canceled_without_publishing() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-deleting", 1);
    let doc = fx
        .add("q.md", "text/markdown", b"Quolls hunt at night.")
        .await;
    let attempt = fx.request(doc, false).await.unwrap();
    fx.drive_to(&engine, attempt, "nodes_generated").await;
    sqlx::query(
        "UPDATE document_assets SET lifecycle_state = 'deleting', deletion_job_id = gen_random_uuid(), deleting_at = now() \
         WHERE id = $1",
    )
    .bind(doc)
    .execute(fx.pool())
    .await
    .unwrap();
    let s = fx.drive(&engine, attempt).await;
    assert_eq!(s.run_state, "canceled");
    assert_eq!(s.last_error_code.as_deref(), Some("document_deleting"));
    assert_eq!(s.active_slot, None);
    assert!(fx.head().await.is_none());
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn repeating_every_step_yields_the_same_rows_once() {
    // A step that ran but did not commit (a crash before its commit) is simply run again: here
    // each step's transaction is run and rolled back once before the real run.
    use kfs_worker::jobs::{Handler, JobCtx};
    let fx = Fx::new().await;
    let doc = fx.add("guide.md", "text/markdown", GUIDE_MD).await;
    let attempt = fx.request(doc, false).await.unwrap();
    let handler = CompileHandler::new(Deps::offline(fx.store.clone())).unwrap();
    let mut cp = "queued".to_owned();
    let mut steps = 0;
    loop {
        let ctx = JobCtx {
            kind: Kind::Compile,
            job_id: attempt,
            outbox_id: Uuid::nil(),
            delivery_id: "d".into(),
            lease_token: Uuid::new_v4(),
            row_version: 0,
            checkpoint: cp.clone(),
            execution_attempts: 1,
            max_execution_attempts: 5,
            worker_id: "w".into(),
            renewed: std::time::Instant::now(),
        };
        let mut tx = fx.pool().begin().await.unwrap();
        let first = handler.step(&mut tx, &ctx).await.unwrap();
        tx.rollback().await.unwrap();
        let mut tx = fx.pool().begin().await.unwrap();
        let second = handler.step(&mut tx, &ctx).await.unwrap();
        // Run the committed step twice too: the second run finds its rows and adds none.
        let third = handler.step(&mut tx, &ctx).await.unwrap();
        assert_eq!(first, second);
        assert_eq!(second, third);
        match second {
            kfs_worker::jobs::Step::Advance(next) => {
                sqlx::query(
                    "UPDATE document_compilation_attempts SET checkpoint = $2 WHERE id = $1",
                )
                .bind(attempt)
                .bind(&next)
                .execute(&mut *tx)
                .await
                .unwrap();
                tx.commit().await.unwrap();
                cp = next;
            }
            kfs_worker::jobs::Step::Succeed(last) => {
                assert_eq!(last, "published");
                tx.commit().await.unwrap();
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
        steps += 1;
        assert!(steps < 10);
    }
    assert_eq!(steps, 5, "five advances, then the publish");
    let g = fx.status(attempt).await.publication_generation_id;
    let expected = expected_nodes("text/markdown", "guide.md", GUIDE_MD);
    assert!(expected >= 4, "the guide spans several nodes: {expected}");
    assert_eq!(fx.rows_of_generation("knowledge_nodes", g).await, expected);
    assert_eq!(
        fx.rows_of_generation("index_projections", g).await,
        expected
    );
    assert_eq!(fx.rows_of_generation("document_outlines", g).await, 1);
    assert_eq!(fx.rows_of_generation("page_index_manifests", g).await, 1);
    assert_eq!(
        fx.rows_of_generation("document_multimodal_manifests", g)
            .await,
        1
    );
    assert_eq!(fx.served_nodes(doc).await, expected);
    let members: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM projection_set_publication_members WHERE tenant_id = $1 AND knowledge_space_id = $2",
    )
    .bind(TENANT)
    .bind(fx.space)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    let paths = fx.rows_of_generation("knowledge_paths", g).await;
    assert_eq!(
        members,
        expected + 2 + paths,
        "projections, outline, manifest and paths, once each"
    );
    let candidates: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM projection_set_publications WHERE tenant_id = $1 AND knowledge_space_id = $2",
    )
    .bind(TENANT)
    .bind(fx.space)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(candidates, 1, "the candidate was created once");
    fx.cleanup().await;
}

fn kfs(fx: &Fx, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"))
        .args(args)
        .env("DATABASE_URL", &fx.env.url)
        .env("KFS_OBJECT_STORE", &fx.store_url)
        .env_remove("RUST_LOG")
        .output()
        .expect("run kfs-worker")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_command_line_requests_releases_retries_and_shows() {
    let fx = Fx::new().await;
    let doc = fx
        .add("c.txt", "text/plain", b"Capybaras relax in hot springs.")
        .await;
    let out = kfs(&fx, &["compile", &doc.to_string(), "--defer"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let attempt: Uuid = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert_eq!(fx.status(attempt).await.run_state, "dispatch_pending");

    let refused = |o: &std::process::Output, needle: &str| {
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.starts_with("error: ") && err.contains(needle), "{err}");
    };
    refused(
        &kfs(&fx, &["compile", &doc.to_string()]),
        "already has an active compilation attempt",
    );
    refused(&kfs(&fx, &["compile", "not-a-uuid"]), "is not a UUID");
    refused(
        &kfs(&fx, &["compile", "retry", &attempt.to_string()]),
        "only a failed attempt",
    );
    refused(
        &kfs(&fx, &["compile", "release", &Uuid::now_v7().to_string()]),
        "no compilation attempt",
    );
    refused(&kfs(&fx, &["compile"]), "needs a document id");

    let out = kfs(&fx, &["compile", "show", &attempt.to_string()]);
    assert!(out.status.success());
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["runState"], "dispatch_pending");
    assert_eq!(shown["outboxStatus"], "pending");

    let out = kfs(&fx, &["compile", "release", &attempt.to_string()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(fx.status(attempt).await.outbox_available_at.unwrap() <= chrono::Utc::now());
    refused(
        &kfs(&fx, &["compile", "release", &attempt.to_string()]),
        "not waiting for release",
    );

    // Fail it, then retry from the command line, then let the engine finish and `wait` see it.
    fail_like_the_engine(fx.pool(), attempt).await;
    let out = kfs(&fx, &["compile", "retry", &attempt.to_string()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let engine = fx.engine("w-cli", 64);
    assert_succeeded(&fx.drive(&engine, attempt).await);
    let out = kfs(
        &fx,
        &["compile", "wait", &attempt.to_string(), "--timeout", "5s"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["runState"], "succeeded");
    fx.cleanup().await;
}

/// Lowercase letters only, so that each marker is one plain full-text word.
fn letters(mut i: usize) -> String {
    let mut s = String::new();
    loop {
        s.push((b'a' + (i % 26) as u8) as char);
        i /= 26;
        if i == 0 {
            break;
        }
    }
    s
}

/// A document of the given format carrying the unique word `marker`.
fn generated(i: usize, marker: &str) -> (String, &'static str, Vec<u8>) {
    let filler =
        "Sediment layers record floods, droughts and the slow drift of river channels. ".repeat(12);
    match i % 3 {
        0 => (
            format!("doc{i}.md"),
            "text/markdown",
            format!("# Report {marker}\n\nThe {marker} survey opens here.\n\n## Details\n\n{filler}\n\nClosing {marker} remarks.")
                .into_bytes(),
        ),
        1 => (
            format!("doc{i}.html"),
            "text/html",
            format!("<html><body><h1>Page</h1><p>The {marker} page.</p><h2>More</h2><p>{filler}</p></body></html>")
                .into_bytes(),
        ),
        _ => (
            format!("doc{i}.txt"),
            "text/plain",
            format!("Notes on {marker}.\n\n{filler}\n").into_bytes(),
        ),
    }
}

async fn wait_terminal(fx: &Fx, attempts: &[Uuid], timeout: Duration) -> bool {
    let pool = fx.pool().clone();
    let ids = attempts.to_vec();
    fx.env
        .wait_until(timeout, || {
            let pool = pool.clone();
            let ids = ids.clone();
            async move {
                let open: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM document_compilation_attempts WHERE id = ANY($1) \
                     AND run_state NOT IN ('succeeded', 'failed', 'canceled', 'superseded')",
                )
                .bind(&ids)
                .fetch_one(&pool)
                .await
                .unwrap();
                open == 0
            }
        })
        .await
}

async fn states(pool: &PgPool) -> Vec<(String, String, Option<String>, i64)> {
    sqlx::query_as(
        "SELECT run_state::text, checkpoint::text, last_error_code::text, count(*) FROM document_compilation_attempts \
         GROUP BY 1, 2, 3 ORDER BY 1, 2",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Every attempt succeeded, each document serves exactly its own generation's nodes, and those
/// are the nodes its bytes produce, once.
async fn assert_all_published(fx: &Fx, docs: &[(Uuid, Uuid, i64, String)]) {
    let served = fx.served().await;
    for (doc, attempt, expected, marker) in docs {
        let s = fx.status(*attempt).await;
        assert_succeeded(&s);
        let g = s.publication_generation_id;
        assert_eq!(
            served[doc].generation, g,
            "head serves the attempt's generation"
        );
        assert_eq!(
            fx.served_nodes(*doc).await,
            *expected,
            "served nodes of {doc}"
        );
        assert_eq!(
            fx.rows_of_generation("knowledge_nodes", g).await,
            *expected,
            "nodes of the generation, once"
        );
        assert_eq!(
            fx.rows_of_generation("index_projections", g).await,
            *expected
        );
        let all: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM knowledge_nodes WHERE knowledge_space_id = $1 AND document_asset_id = $2",
        )
        .bind(fx.space)
        .bind(doc)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert_eq!(all, *expected, "no nodes of any other generation exist");
        let hits = fx.search(marker).await;
        assert!(!hits.is_empty(), "{marker} not searchable");
        assert!(
            hits.iter().all(|h| h.document_asset_id == *doc),
            "{marker}: {hits:?}"
        );
    }
}

/// Adds and requests `n` generated documents; returns (doc, attempt, expected nodes, marker).
async fn request_generated(fx: &Fx, n: usize, tag: &str) -> Vec<(Uuid, Uuid, i64, String)> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // A consonant tail keeps the English stemmer from folding two markers together.
        let marker = format!("{tag}{}qk", letters(i));
        let (name, mime, bytes) = generated(i, &marker);
        let doc = fx.add(&name, mime, &bytes).await;
        let attempt = fx.request(doc, false).await.unwrap();
        out.push((doc, attempt, expected_nodes(mime, &name, &bytes), marker));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_documents_across_two_worker_processes() {
    const DOCS: usize = 200;
    let fx = Fx::new().await;
    let extra = |id: &'static str| {
        vec![
            ("KFS_OBJECT_STORE", fx.store_url.clone()),
            ("KFS_KINDS", "compile".to_owned()),
            ("KFS_WORKER_ID", id.to_owned()),
            ("KFS_RELAY_POLL", "200ms".to_owned()),
            ("RUST_LOG", "info,kfs_worker=info".to_owned()),
        ]
    };
    let spawn = |id: &'static str| {
        let e = extra(id);
        let e: Vec<(&str, &str)> = e.iter().map(|(k, v)| (*k, v.as_str())).collect();
        fx.env.spawn_worker(id, &["run"], &e)
    };
    let mut workers = [spawn("bulk-1"), spawn("bulk-2")];
    let started = Instant::now();
    let docs = request_generated(&fx, DOCS, "bulkmark").await;
    let requested = started.elapsed();
    let attempts: Vec<Uuid> = docs.iter().map(|d| d.1).collect();
    let done = wait_terminal(&fx, &attempts, Duration::from_secs(240)).await;
    let elapsed = started.elapsed();
    let logs: String = workers
        .iter()
        .map(|w| {
            let t = w.log_text();
            let tail: Vec<&str> = t.lines().rev().take(20).collect();
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        })
        .collect::<Vec<_>>()
        .join("\n---\n");
    assert!(
        done,
        "not every attempt ended: {:?}\n{logs}",
        states(fx.pool()).await
    );
    println!(
        "[compile bulk] {DOCS} documents across 2 workers: {:.2}s in all, {:.1} documents/s \
         ({:.2}s to add and request them while the workers ran)",
        elapsed.as_secs_f64(),
        DOCS as f64 / elapsed.as_secs_f64(),
        requested.as_secs_f64()
    );
    assert_all_published(&fx, &docs).await;
    assert_eq!(fx.served().await.len(), DOCS);
    support::stop_cleanly(&mut workers, Duration::from_secs(20)).await;
    fx.cleanup().await;
}

mod together;

#[cfg(feature = "crash-points")]
mod crash {
    use super::*;

    /// Every attempt A held is taken over within this of its death: half the lease, so a
    /// takeover that waited for the lease (renewed by A's heartbeats until it died) could not.
    const TAKEOVER_BOUND: Duration = Duration::from_secs(30);

    /// Worker A dies at `point` mid-compile; worker B finishes; every document is published
    /// exactly once with exactly its own nodes.
    async fn kill_point(point: &'static str) {
        const DOCS: usize = 8;
        let fx = Fx::new().await;
        let base = |id: &'static str| {
            vec![
                ("KFS_OBJECT_STORE", fx.store_url.clone()),
                ("KFS_KINDS", "compile".to_owned()),
                ("KFS_WORKER_ID", id.to_owned()),
                ("KFS_RELAY_POLL", "200ms".to_owned()),
                // Slices end mid-walk, so every kill point falls inside a compilation.
                ("KFS_SLICE_STEPS", "2".to_owned()),
                // Long on purpose: finishing fast proves the takeover did not wait for it.
                ("KFS_LEASES", "compile=60s".to_owned()),
                ("KFS_SHUTDOWN_GRACE", "5s".to_owned()),
            ]
        };
        let spawn = |id: &'static str, crash: Option<&'static str>| {
            let mut e = base(id);
            if let Some(c) = crash {
                e.push(("KFS_CRASH_AT", c.to_owned()));
            }
            let e: Vec<(&str, &str)> = e.iter().map(|(k, v)| (*k, v.as_str())).collect();
            fx.env.spawn_worker(id, &["run"], &e)
        };
        let docs = request_generated(&fx, DOCS, "crashmark").await;
        let target = match point {
            "after-step-commit" => "after-step-commit:3",
            other => other,
        };
        let mut a = spawn("a", Some(target));
        let status = a.wait_exit(Duration::from_secs(60));
        let death = Instant::now();
        let log = a.log_text();
        assert!(
            status.is_some_and(|s| !s.success()),
            "A did not abort at {point}: {status:?}\n{log}"
        );
        assert!(
            log.contains(&format!("crash point {point} reached")),
            "{log}"
        );
        let mid: Vec<(String, String, Option<String>, i64)> = states(fx.pool()).await;
        // The attempts A held a lease on when it died, and their lease tokens.
        let (held, tokens): (Vec<Uuid>, Vec<Uuid>) = sqlx::query_as::<_, (Uuid, Uuid)>(
            "SELECT id, lease_token FROM document_compilation_attempts \
             WHERE run_state = 'running' AND split_part(worker_id, '#', 1) = 'a'",
        )
        .fetch_all(fx.pool())
        .await
        .unwrap()
        .into_iter()
        .unzip();
        let started = Instant::now();
        let mut b = spawn("b", None);
        // Taken over: no held attempt still runs under A's lease.
        let pool = fx.pool().clone();
        let taken = fx
            .env
            .wait_until(TAKEOVER_BOUND, || {
                let (pool, held, tokens) = (pool.clone(), held.clone(), tokens.clone());
                async move {
                    let still: i64 = sqlx::query_scalar(
                        "SELECT count(*) FROM unnest($1::uuid[], $2::uuid[]) AS h(id, token) \
                         JOIN document_compilation_attempts c ON c.id = h.id AND c.lease_token = h.token",
                    )
                    .bind(&held)
                    .bind(&tokens)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                    still == 0
                }
            })
            .await;
        let takeover = death.elapsed();
        assert!(
            taken,
            "the {} attempts A held at its death ({point}) were not taken over within \
             {TAKEOVER_BOUND:?} of it: as if the takeover waited for the 60 s lease\n{}",
            held.len(),
            b.log_text()
        );
        let attempts: Vec<Uuid> = docs.iter().map(|d| d.1).collect();
        let done = wait_terminal(&fx, &attempts, Duration::from_secs(90)).await;
        assert!(
            done,
            "not every attempt ended after A died at {point}: {:?}\n{}",
            states(fx.pool()).await,
            b.log_text()
        );
        println!(
            "[compile crash {point}] at death: {mid:?}; {} held attempts taken over within \
             {:.2}s of the kill; B finished in {:.2}s (lease 60s)",
            held.len(),
            takeover.as_secs_f64(),
            started.elapsed().as_secs_f64()
        );
        assert_all_published(&fx, &docs).await;
        support::stop_cleanly([&mut b], Duration::from_secs(20)).await;
        drop(a);
        fx.cleanup().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn compile_survives_a_crash_after_claim_commit() {
        kill_point("after-claim-commit").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn compile_survives_a_crash_after_step_commit() {
        kill_point("after-step-commit").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn compile_survives_a_crash_before_ack() {
        kill_point("before-ack").await;
    }
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

/// The indexes a bitmap heap scan reads, from its bitmap index scans.
fn bitmap_indexes(plan: &serde_json::Value, out: &mut Vec<String>) {
    if let Some(index) = plan["Index Name"].as_str() {
        out.push(index.to_owned());
    }
    for child in plan["Plans"].as_array().into_iter().flatten() {
        bitmap_indexes(child, out);
    }
}

/// Every scan node of an `EXPLAIN (ANALYZE, FORMAT JSON)` plan: (relation, how it is read: an
/// index, the indexes of a bitmap scan, or `Seq Scan`, and the rows it produced and its
/// filters removed, over all its loops).
fn scans(plan: &serde_json::Value, out: &mut Vec<(String, String, f64)>) {
    let n = |k: &str| plan[k].as_f64().unwrap_or(0.0);
    if let Some(relation) = plan["Relation Name"].as_str() {
        let read = match (plan["Index Name"].as_str(), plan["Node Type"].as_str()) {
            (Some(index), _) => index.to_owned(),
            (None, Some("Bitmap Heap Scan")) => {
                let mut indexes = Vec::new();
                bitmap_indexes(plan, &mut indexes);
                indexes.join(" + ")
            }
            (None, t) => t.unwrap_or("").to_owned(),
        };
        let rows = (n("Actual Rows") + n("Rows Removed by Filter")) * n("Actual Loops");
        out.push((relation.to_owned(), read, rows));
    }
    for child in plan["Plans"].as_array().into_iter().flatten() {
        scans(child, out);
    }
}

/// Runs `sql` with `args` (as `PREPARE name types`) under `EXPLAIN ANALYZE`; returns its scans.
async fn explained_scans(
    pool: &PgPool,
    name: &str,
    types: &str,
    sql: &str,
    args: &str,
) -> Vec<(String, String, f64)> {
    let mut c = pool.acquire().await.unwrap();
    let explained =
        support::explain_prepared(&mut c, "ANALYZE, FORMAT JSON", name, types, sql, args).await;
    let mut out = Vec::new();
    scans(&explained[0]["Plan"], &mut out);
    assert!(!out.is_empty(), "{name}: no scans in {explained}");
    out
}

/// A new space's tables have no statistics yet. There, the publish path's reads stay within
/// their publication: the rebased candidate's snapshot read looks up each of its outlines'
/// documents once, and the smoke evaluation reads its publication's members, never those of
/// every publication the space has had. With plain joins, the snapshot read started from the
/// space's documents and probed every outline member for each (rows read grew with the square
/// of the documents, 5 ms of each publish under the head lock at 100 documents); with the
/// tenant and space in the member lookup, the smoke evaluation took the index led by (tenant,
/// space, generation) and walked the members of every publication of the space.
#[tokio::test]
async fn the_publish_reads_stay_within_their_publication_on_tables_without_statistics() {
    const DOCS: usize = 24;
    let fx = Fx::new().await;
    // No statistics, as in a new space's first minutes: autovacuum may not analyse them.
    for table in [
        "projection_set_publication_members",
        "document_assets",
        "document_outlines",
        "parse_artifacts",
    ] {
        sqlx::query(&format!(
            "ALTER TABLE {table} SET (autovacuum_enabled = false)"
        ))
        .execute(fx.pool())
        .await
        .unwrap();
    }
    let mut docs = Vec::new();
    for i in 0..DOCS {
        let (name, mime, bytes) = generated(i, &format!("stat{}qk", letters(i)));
        let doc = fx.add(&name, mime, &bytes).await;
        fx.compile(doc).await;
        docs.push(doc);
    }
    let analysed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_user_tables WHERE relname IN ('projection_set_publication_members', \
           'document_assets', 'document_outlines', 'parse_artifacts') \
           AND (last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL)",
    )
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(analysed, 0, "the tables must have no statistics");
    let head = fx.head().await.unwrap();
    let members: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM projection_set_publication_members WHERE publication_id = $1",
    )
    .bind(head.publication_id)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    let space = fx.space;
    let publication = head.publication_id;

    let snapshots = explained_scans(
        fx.pool(),
        "snapshots",
        "(uuid, uuid, text)",
        compile::MEMBER_SNAPSHOTS_SQL,
        &format!("'{publication}', '{space}', 'document-outline'"),
    )
    .await;
    // One outline member, its outline, its document and its artifact per document.
    let read: f64 = snapshots.iter().map(|s| s.2).sum();
    assert!(
        read <= (4 * DOCS) as f64,
        "the snapshot read looked at {read} rows for {DOCS} documents: {snapshots:?}"
    );

    let doc = docs[DOCS / 2];
    let smoke = explained_scans(
        fx.pool(),
        "smoke",
        "(uuid, uuid, text, text, uuid, varchar)",
        compile::SMOKE_COUNTS_SQL,
        &format!("'{space}', '{publication}', 'x', NULL, '{doc}', '{TENANT}'"),
    )
    .await;
    let of_members: Vec<_> = smoke
        .iter()
        .filter(|s| s.0 == "projection_set_publication_members")
        .collect();
    assert!(!of_members.is_empty(), "{smoke:?}");
    for (_, index, rows) in &of_members {
        assert!(
            *index == "projection_set_publication_members_component_uq"
                || *index == "projection_set_publication_members_document_idx",
            "the smoke evaluation read members through {index:?}, which is not bounded by the publication: {smoke:?}"
        );
        assert!(
            *rows <= members as f64,
            "{rows} rows of {members}: {smoke:?}"
        );
    }
    fx.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// The platform's 0019–0041 rows around a compile: capability grants, the frozen profile tuple and
// its fence, the publication's profile binding, and the logical-document intents.
// ---------------------------------------------------------------------------------------------

impl Fx {
    /// Requests `doc` under `opts` in a transaction of its own.
    async fn request_with(&self, doc: Uuid, opts: RequestOptions) -> Result<Uuid, CompileError> {
        let mut tx = self.pool().begin().await.unwrap();
        let r = compile::request(&mut tx, doc, opts).await;
        tx.commit().await.unwrap();
        r
    }

    /// A capability grant of `subject` in this space for every content scope.
    async fn grant(&self, subject: &str) -> Uuid {
        let mut conn = self.pool().acquire().await.unwrap();
        platform::create_capability_grant(&mut conn, TENANT, self.space, subject, &[])
            .await
            .unwrap()
    }

    /// The space's profile binding rows.
    async fn bindings(&self) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM knowledge_space_profile_publication_bindings WHERE knowledge_space_id = $1",
        )
        .bind(self.space)
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    /// A publication's status.
    async fn publication_status(&self, id: Uuid) -> String {
        sqlx::query_scalar("SELECT status::text FROM projection_set_publications WHERE id = $1")
            .bind(id)
            .fetch_one(self.pool())
            .await
            .unwrap()
    }

    /// The revision of asset `asset`: (logical document, revision, state, bound attempt,
    /// activated).
    async fn revision_of(&self, asset: Uuid) -> (Uuid, i32, String, Option<Uuid>, bool) {
        sqlx::query_as(
            "SELECT document_id, revision, state::text, compilation_attempt_id, activated_at IS NOT NULL \
             FROM document_revisions WHERE document_asset_id = $1",
        )
        .bind(asset)
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    /// A logical document: (status, active revision, row version).
    async fn logical(&self, id: Uuid) -> (String, Option<i32>, i32) {
        sqlx::query_as(
            "SELECT status::text, active_revision, row_version FROM logical_documents WHERE id = $1",
        )
        .bind(id)
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    /// The space's active profile heads: (kind, revision id, revision, digest), in kind order.
    async fn active_heads(&self) -> Vec<(String, Uuid, i32, String)> {
        sqlx::query_as(
            "SELECT h.kind::text, r.id, r.revision, r.snapshot_digest::text FROM knowledge_space_profile_heads h \
             JOIN knowledge_space_profile_revisions r ON r.id = h.profile_revision_id AND r.revision = h.active_revision \
             WHERE h.knowledge_space_id = $1 AND r.state = 'active' ORDER BY h.kind",
        )
        .bind(self.space)
        .fetch_all(self.pool())
        .await
        .unwrap()
    }
}

fn by_grant(grant: Uuid) -> RequestOptions {
    RequestOptions {
        grant: Some(grant),
        ..RequestOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_grant_authorized_compile_records_the_grant_alone_and_publishes() {
    let fx = Fx::new().await;
    let grant = fx.grant("app-1").await;
    let doc = fx
        .add(
            "g.md",
            "text/markdown",
            b"# Grant\n\nPuffins nest in burrows.",
        )
        .await;
    let attempt = fx.request_with(doc, by_grant(grant)).await.unwrap();
    let s = fx.status(attempt).await;
    assert_eq!(s.capability_grant_id, Some(grant));
    assert_eq!(
        (
            s.requested_by_subject_id.as_deref(),
            s.permission_snapshot_id,
            s.permission_snapshot_revision,
            s.access_channel.as_deref()
        ),
        (None, None, None, None),
        "a grant is recorded alone"
    );
    let done = fx.drive(&fx.engine("w-grant", 64), attempt).await;
    assert_succeeded(&done);
    assert_eq!(fx.search("puffins burrows").await.len(), 1);

    // The command line takes --grant in place of --as/--snapshot, and refuses both at once.
    let doc2 = fx
        .add("g2.md", "text/markdown", b"# CLI grant\n\nGannets dive.")
        .await;
    let out = kfs(
        &fx,
        &["compile", &doc2.to_string(), "--grant", &grant.to_string()],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let by_cli: Uuid = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert_eq!(fx.status(by_cli).await.capability_grant_id, Some(grant));
    let snap = fx.snapshot("editor-1").await;
    let doc3 = fx.add("g3.md", "text/markdown", b"# Both\n\nTerns.").await;
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM document_compilation_attempts")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    let out = kfs(
        &fx,
        &[
            "compile",
            &doc3.to_string(),
            "--grant",
            &grant.to_string(),
            "--as",
            "editor-1",
            "--snapshot",
            &snap.to_string(),
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    let e = fx
        .request_with(
            doc3,
            RequestOptions {
                requester: Some(Requester {
                    subject: "editor-1".into(),
                    snapshot: snap,
                }),
                grant: Some(grant),
                ..RequestOptions::default()
            },
        )
        .await
        .unwrap_err();
    assert!(
        matches!(e, CompileError::TwoAuthorities) && e.is_refusal(),
        "{e}"
    );
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM document_compilation_attempts")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(after, before, "two authorities wrote nothing");
    fx.cleanup().await;
}

/// Drives a grant-authorized compile of a new document to `smoke_eval_passed`, then lets
/// `fence` end the grant's authority, and runs the publish: the attempt fails closed as the
/// platform fails it, and nothing but the attempt's failure is written.
async fn grant_fenced_at_publish(fx: &Fx, name: &str, fence: impl AsyncFnOnce(Uuid)) {
    let grant = fx.grant("app-2").await;
    let doc = fx
        .add(name, "text/markdown", b"# Fenced\n\nKittiwakes on cliffs.")
        .await;
    let attempt = fx.request_with(doc, by_grant(grant)).await.unwrap();
    fx.drive_to(&fx.engine("w-fence-1", 1), attempt, "smoke_eval_passed")
        .await;
    let head_before = fx.head().await;
    let bindings_before = fx.bindings().await;
    let candidate = fx.status(attempt).await.candidate_publication_id.unwrap();
    fence(grant).await;
    let s = fx.drive(&fx.engine("w-fence", 64), attempt).await;
    assert_failed(&s, "DOCUMENT_COMPILATION_FAILED");
    assert_eq!(
        s.last_error_message.as_deref(),
        Some("Capability publication is fenced")
    );
    assert_eq!(s.checkpoint, "smoke_eval_passed", "the checkpoint is kept");
    assert_eq!(fx.head().await, head_before, "the head is untouched");
    assert_eq!(fx.bindings().await, bindings_before, "no binding");
    assert_eq!(fx.publication_status(candidate).await, "candidate");
    let (logical, _, state, bound, _) = fx.revision_of(doc).await;
    assert_eq!((state.as_str(), bound), ("candidate", Some(attempt)));
    assert_eq!(fx.logical(logical).await, ("pending".into(), None, 0));
    assert!(fx.search("kittiwakes").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_revoked_grant_or_a_fenced_space_fails_the_attempt_closed_and_writes_nothing_else() {
    let fx = Fx::new().await;
    // A head to stay untouched.
    let base = fx.add("base.md", "text/markdown", b"# Base\n\nAuks.").await;
    fx.compile(base).await;
    grant_fenced_at_publish(&fx, "revoked.md", async |grant| {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::revoke_capability_grant(&mut conn, TENANT, fx.space, grant)
            .await
            .unwrap();
    })
    .await;
    // A request under a revoked grant is refused with nothing written.
    let revoked = fx.grant("app-3").await;
    {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::revoke_capability_grant(&mut conn, TENANT, fx.space, revoked)
            .await
            .unwrap();
    }
    let doc = fx
        .add("late.md", "text/markdown", b"# Late\n\nMurres.")
        .await;
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM document_compilation_attempts")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    let e = fx.request_with(doc, by_grant(revoked)).await.unwrap_err();
    assert!(
        matches!(e, CompileError::Grant { grant, .. } if grant == revoked) && e.is_refusal(),
        "{e}"
    );
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM document_compilation_attempts")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(after, before);
    assert_eq!(
        fx.revision_of(doc).await.3,
        None,
        "the revision stays unbound"
    );
    // A fenced space: every grant of it stops authorizing.
    grant_fenced_at_publish(&fx, "fenced.md", async |_| {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::fence_capability_space(&mut conn, TENANT, fx.space)
            .await
            .unwrap();
    })
    .await;
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_attempt_carries_the_frozen_profile_tuple() {
    let fx = Fx::new().await;
    let retrieval_only = fx.add("r.md", "text/markdown", b"# R\n\nSkuas.").await;
    let a1 = fx.request(retrieval_only, false).await.unwrap();
    let heads = fx.active_heads().await;
    assert_eq!(heads.len(), 1, "a new space has its retrieval profile");
    let s1 = fx.status(a1).await;
    let (_, rid, rrev, rdigest) = &heads[0];
    assert_eq!(
        (
            s1.retrieval_profile_kind.as_deref(),
            s1.retrieval_profile_revision_id,
            s1.retrieval_profile_revision,
            s1.retrieval_profile_snapshot_digest.as_deref()
        ),
        (
            Some("retrieval"),
            Some(*rid),
            Some(*rrev),
            Some(rdigest.as_str())
        )
    );
    assert_eq!(
        (
            s1.embedding_profile_kind,
            s1.embedding_profile_revision_id,
            s1.embedding_profile_revision,
            s1.embedding_profile_snapshot_digest
        ),
        (None, None, None, None)
    );
    {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::activate_embedding_profile(&mut conn, TENANT, fx.space, "e-small", "openai", 16)
            .await
            .unwrap();
    }
    let both = fx
        .add("e.md", "text/markdown", b"# E\n\nShearwaters.")
        .await;
    let a2 = fx.request(both, false).await.unwrap();
    let s2 = fx.status(a2).await;
    let heads = fx.active_heads().await;
    let (ekind, eid, erev, edigest) = &heads[0];
    assert_eq!(ekind, "embedding");
    assert_eq!(
        (
            s2.embedding_profile_kind.as_deref(),
            s2.embedding_profile_revision_id,
            s2.embedding_profile_revision,
            s2.embedding_profile_snapshot_digest.as_deref()
        ),
        (
            Some("embedding"),
            Some(*eid),
            Some(*erev),
            Some(edigest.as_str())
        )
    );
    assert_eq!(
        s2.retrieval_profile_revision_id,
        s1.retrieval_profile_revision_id
    );
    // The attempt builds with its frozen embedding profile and publishes under the tuple.
    assert_succeeded(&fx.drive(&fx.engine("w-tuple", 64), a2).await);
    let dense: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM index_projections WHERE publication_generation_id = $1 AND type = 'dense-vector'",
    )
    .bind(s2.publication_generation_id)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert!(dense > 0);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_profile_changed_between_request_and_publish_fails_the_fence_with_nothing_published() {
    let fx = Fx::new().await;
    let one_step = fx.engine("w-profile-1", 1);
    let engine = fx.engine("w-profile", 64);
    // (what changes the space's profiles after the attempt froze them)
    for (name, change) in [("retrieval.md", "retrieval"), ("embedding.md", "embedding")] {
        let doc = fx
            .add(name, "text/markdown", b"# Profiles\n\nPetrels glide.")
            .await;
        let attempt = fx.request(doc, false).await.unwrap();
        fx.drive_to(&one_step, attempt, "smoke_eval_passed").await;
        let candidate = fx.status(attempt).await.candidate_publication_id.unwrap();
        let head_before = fx.head().await;
        {
            let mut conn = fx.pool().acquire().await.unwrap();
            if change == "retrieval" {
                platform::activate_retrieval_profile(&mut conn, TENANT, fx.space, "r2", "offline")
                    .await
                    .unwrap();
            } else {
                platform::activate_embedding_profile(&mut conn, TENANT, fx.space, "e", "openai", 8)
                    .await
                    .map(|_| ())
                    .unwrap();
            }
        }
        let s = fx.drive(&engine, attempt).await;
        assert_failed(&s, "DOCUMENT_COMPILATION_FAILED");
        assert!(
            s.last_error_message
                .as_deref()
                .is_some_and(|m| m.contains("profile fence")),
            "{change}: {s:?}"
        );
        assert_eq!(fx.head().await, head_before, "{change}: nothing published");
        assert_eq!(fx.bindings().await, 0);
        assert_eq!(
            fx.publication_status(candidate).await,
            "candidate",
            "{change}: the candidate stays a candidate"
        );
        assert!(fx.search("petrels").await.is_empty());
    }
    // An attempt requested after the change freezes the new tuple and publishes.
    let doc = fx
        .add("after.md", "text/markdown", b"# After\n\nFulmars.")
        .await;
    assert_succeeded(
        &fx.drive(&engine, fx.request(doc, false).await.unwrap())
            .await,
    );
    assert_eq!(fx.bindings().await, 1);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_attempt_without_profiles_binds_the_current_heads_and_a_space_without_retrieval_cannot_compile(
) {
    let fx = Fx::new().await;
    let engine = fx.engine("w-bare", 64);
    let fxr = &fx;
    let bare = |slug: &'static str| async move {
        let fx = fxr;
        let mut conn = fx.pool().acquire().await.unwrap();
        let space = platform::create_bare_space(&mut conn, TENANT, slug, slug, "owner-1")
            .await
            .unwrap();
        let doc = platform::add_document(
            &mut conn,
            &fx.store,
            space,
            None,
            "b.md",
            "text/markdown",
            Bytes::from_static(b"# Bare\n\nGuillemots."),
        )
        .await
        .unwrap();
        (space, doc)
    };
    // No retrieval profile: the attempt is written with no tuple and fails at its first step.
    let (_, doc) = bare("no-profiles").await;
    let attempt = fx.request(doc, false).await.unwrap();
    assert_eq!(fx.status(attempt).await.retrieval_profile_revision_id, None);
    let s = fx.drive(&engine, attempt).await;
    assert_failed(&s, "KNOWLEDGE_SPACE_MODEL_CONFIGURATION_REQUIRED");
    assert_eq!(s.checkpoint, "queued");
    let parsed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM parse_artifacts WHERE document_asset_id = $1")
            .bind(doc)
            .fetch_one(fx.pool())
            .await
            .unwrap();
    assert_eq!(parsed, 0, "nothing else written");
    // Profiles configured after the request: the first step binds the current heads.
    let (space, doc) = bare("later-profiles").await;
    let attempt = fx.request(doc, false).await.unwrap();
    let rid = {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::activate_retrieval_profile(&mut conn, TENANT, space, "r", "offline")
            .await
            .unwrap()
    };
    let s = fx.drive(&engine, attempt).await;
    assert_succeeded(&s);
    assert_eq!(
        (
            s.retrieval_profile_revision_id,
            s.retrieval_profile_revision
        ),
        (Some(rid), Some(1))
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_compile_publishes_the_documents_candidate_revision_and_a_new_revision_supersedes_it() {
    let fx = Fx::new().await;
    let doc = fx
        .add(
            "rev.md",
            "text/markdown",
            b"# Revisions\n\nAlbatross glide far.",
        )
        .await;
    let (logical, revision, state, bound, _) = fx.revision_of(doc).await;
    assert_eq!((revision, state.as_str(), bound), (1, "candidate", None));
    assert_eq!(fx.logical(logical).await, ("pending".into(), None, 0));
    let done = fx.compile(doc).await;
    let (_, _, state, bound, activated) = fx.revision_of(doc).await;
    assert_eq!(
        (state.as_str(), bound, activated),
        ("active", Some(done.id), true)
    );
    assert_eq!(fx.logical(logical).await, ("ready".into(), Some(1), 1));
    // The revision's chunks are the candidate's nodes, each chunk's id its node's.
    let (chunks, same_ids, ordinals): (i64, i64, Vec<i32>) = sqlx::query_as(
        "SELECT count(*), count(n.id), array_agg(c.ordinal ORDER BY c.ordinal) FROM document_revision_chunks c \
         LEFT JOIN knowledge_nodes n ON n.id = c.id AND n.publication_generation_id = $3 \
         WHERE c.document_id = $1 AND c.document_revision = $2",
    )
    .bind(logical)
    .bind(1)
    .bind(done.publication_generation_id)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(
        chunks,
        fx.rows_of_generation("knowledge_nodes", done.publication_generation_id)
            .await
    );
    assert_eq!(same_ids, chunks);
    assert_eq!(ordinals, (0..chunks as i32).collect::<Vec<_>>());

    // A new revision of the document, uploaded as a new asset, supersedes the first.
    let next = {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::add_revision(
            &mut conn,
            &fx.store,
            logical,
            "rev.md",
            "text/markdown",
            Bytes::from_static(b"# Revisions\n\nAlbatross glide farther."),
        )
        .await
        .unwrap()
    };
    let (same_doc, revision, state, _, _) = fx.revision_of(next).await;
    assert_eq!(
        (same_doc, revision, state.as_str()),
        (logical, 2, "candidate")
    );
    fx.compile(next).await;
    assert_eq!(fx.revision_of(next).await.2, "active");
    let (_, _, old_state, _, still_activated) = fx.revision_of(doc).await;
    assert_eq!((old_state.as_str(), still_activated), ("superseded", true));
    assert_eq!(fx.logical(logical).await, ("ready".into(), Some(2), 2));
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_disabled_document_fails_with_document_disabled_and_writes_nothing_else() {
    let fx = Fx::new().await;
    let doc = fx
        .add(
            "off.md",
            "text/markdown",
            b"# Off\n\nCormorants dry their wings.",
        )
        .await;
    let attempt = fx.request(doc, false).await.unwrap();
    let (logical, ..) = fx.revision_of(doc).await;
    let disable = sqlx::query(
        "UPDATE logical_documents SET enabled = false, disabled_at = now(), disabled_by_subject_id = 'owner-1' \
         WHERE id = $1",
    )
    .bind(logical);
    disable.execute(fx.pool()).await.unwrap();
    let s = fx.drive(&fx.engine("w-disabled", 64), attempt).await;
    assert_failed(&s, "DOCUMENT_DISABLED");
    assert_eq!(s.checkpoint, "queued");
    assert_eq!(s.candidate_publication_id, None);
    let parsed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM parse_artifacts WHERE document_asset_id = $1")
            .bind(doc)
            .fetch_one(fx.pool())
            .await
            .unwrap();
    assert_eq!(parsed, 0, "nothing else written");
    assert_eq!(fx.revision_of(doc).await.2, "candidate");
    assert_eq!(fx.logical(logical).await, ("pending".into(), None, 0));
    assert!(fx.head().await.is_none());
    // A new request of a disabled document is refused.
    let e = fx.request(doc, false).await.unwrap_err();
    assert!(
        matches!(e, CompileError::DocumentDisabled(d) if d == doc) && e.is_refusal(),
        "{e}"
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retry_restores_a_failed_revision_to_candidate_and_publishes_it() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-restore", 64);
    let good = b"Gulls follow the ferry.";
    let doc = fx.add("gulls.txt", "text/plain", good).await;
    let key: String = sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
        .bind(doc)
        .fetch_one(fx.pool())
        .await
        .unwrap();
    fx.store
        .put(&key, Bytes::from_static(b"garbled"))
        .await
        .unwrap();
    let attempt = fx.request(doc, false).await.unwrap();
    assert_failed(&fx.drive(&engine, attempt).await, "hash_mismatch");
    // The platform's reconcile sweep fails the bound revision and its never-ready document.
    let (logical, ..) = fx.revision_of(doc).await;
    sqlx::query("UPDATE document_revisions SET state = 'failed' WHERE compilation_attempt_id = $1")
        .bind(attempt)
        .execute(fx.pool())
        .await
        .unwrap();
    sqlx::query("UPDATE logical_documents SET status = 'failed' WHERE id = $1")
        .bind(logical)
        .execute(fx.pool())
        .await
        .unwrap();
    fx.store.put(&key, Bytes::from_static(good)).await.unwrap();
    {
        let mut conn = fx.pool().acquire().await.unwrap();
        compile::retry(&mut conn, attempt).await.unwrap();
    }
    let (_, _, state, bound, _) = fx.revision_of(doc).await;
    assert_eq!((state.as_str(), bound), ("candidate", Some(attempt)));
    assert_eq!(fx.logical(logical).await, ("pending".into(), None, 0));
    assert_succeeded(&fx.drive(&engine, attempt).await);
    assert_eq!(fx.revision_of(doc).await.2, "active");
    assert_eq!(fx.logical(logical).await, ("ready".into(), Some(1), 1));
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reindex_and_a_chunk_change_bound_to_an_attempt_are_applied_by_its_publish() {
    let fx = Fx::new().await;
    let doc = fx
        .add(
            "intents.md",
            "text/markdown",
            b"# Intents\n\nOystercatchers probe.",
        )
        .await;
    fx.compile(doc).await;
    let (logical, ..) = fx.revision_of(doc).await;
    // Each rebuild below runs under a new embedding profile revision, so it is not the build
    // the head already serves (kfs-worker builds no document settings into the projections; an
    // identical rebuild would end superseded).
    let new_embedding = || async {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::activate_embedding_profile(&mut conn, TENANT, fx.space, "e", "openai", 8)
            .await
            .unwrap();
    };
    // A settings reindex of the active revision: its settings at revision 1 (active, the head),
    // a candidate revision 2 and a running reindex bound to a new compile attempt, as the
    // platform's settings update writes them.
    new_embedding().await;
    let reindex = fx.request(doc, false).await.unwrap();
    sqlx::query(
        "INSERT INTO document_settings_revisions (tenant_id, knowledge_space_id, document_id, revision, settings, \
           state, created_by_subject_id, created_at, activated_at) \
         VALUES ($1, $2, $3, 1, '{}', 'active', 'owner-1', now(), now()), \
                ($1, $2, $3, 2, '{\"language\": \"en\"}', 'candidate', 'owner-1', now(), NULL)",
    )
    .bind(TENANT)
    .bind(fx.space)
    .bind(logical)
    .execute(fx.pool())
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO document_settings_heads (tenant_id, knowledge_space_id, document_id, active_revision, \
           row_version, updated_at) VALUES ($1, $2, $3, 1, 0, now())",
    )
    .bind(TENANT)
    .bind(fx.space)
    .bind(logical)
    .execute(fx.pool())
    .await
    .unwrap();
    let reindex_id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO document_reindex_attempts (id, tenant_id, knowledge_space_id, document_id, document_revision, \
           settings_revision, expected_settings_head_revision, compilation_attempt_id, state, active_slot, \
           row_version, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, 1, 2, 1, $5, 'running', 1, 0, now(), now())",
    )
    .bind(reindex_id)
    .bind(TENANT)
    .bind(fx.space)
    .bind(logical)
    .bind(reindex)
    .execute(fx.pool())
    .await
    .unwrap();
    let done = fx.drive(&fx.engine("w-intents", 64), reindex).await;
    assert_succeeded(&done);
    let (state, slot, publication): (String, Option<i32>, Option<Uuid>) = sqlx::query_as(
        "SELECT state::text, active_slot, candidate_publication_id FROM document_reindex_attempts WHERE id = $1",
    )
    .bind(reindex_id)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(
        (state.as_str(), slot, publication),
        ("succeeded", None, done.candidate_publication_id)
    );
    let (settings, head): (Vec<String>, i32) = sqlx::query_as(
        "SELECT array_agg(r.state::text ORDER BY r.revision), max(h.active_revision) \
         FROM document_settings_revisions r JOIN document_settings_heads h ON h.document_id = r.document_id \
         WHERE r.document_id = $1",
    )
    .bind(logical)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(
        (settings, head),
        (vec!["superseded".to_owned(), "active".to_owned()], 2)
    );

    // A chunk disabled: a candidate chunk state change bound to another attempt.
    let chunk: Uuid = sqlx::query_scalar(
        "SELECT id FROM document_revision_chunks WHERE document_id = $1 AND document_revision = 1 \
         ORDER BY ordinal LIMIT 1",
    )
    .bind(logical)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    new_embedding().await;
    let change = fx.request(doc, false).await.unwrap();
    sqlx::query(
        "INSERT INTO document_chunk_state_changes (id, tenant_id, knowledge_space_id, document_id, document_revision, \
           chunk_id, compilation_attempt_id, enabled, state, created_at) \
         VALUES ($1, $2, $3, $4, 1, $5, $6, false, 'candidate', now())",
    )
    .bind(Uuid::new_v4())
    .bind(TENANT)
    .bind(fx.space)
    .bind(logical)
    .bind(chunk)
    .bind(change)
    .execute(fx.pool())
    .await
    .unwrap();
    let done = fx.drive(&fx.engine("w-intents", 64), change).await;
    assert_succeeded(&done);
    let (state, publication): (String, Option<Uuid>) = sqlx::query_as(
        "SELECT state::text, candidate_publication_id FROM document_chunk_state_changes \
         WHERE compilation_attempt_id = $1",
    )
    .bind(change)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(
        (state.as_str(), publication),
        ("active", done.candidate_publication_id)
    );
    // The document stays at its revision: neither intent is a new revision.
    assert_eq!(fx.logical(logical).await, ("ready".into(), Some(1), 1));
    fx.cleanup().await;
}
