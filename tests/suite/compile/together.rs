//! Publishing the documents of one space together: one head move takes every attempt of the
//! space parked at `smoke_eval_passed` that no worker holds, every head a reader can see is
//! complete while several workers publish, and a worker killed in the middle of a publish
//! leaves a readable head.

use super::*;

/// Drives each attempt with one-step slices until all are at `smoke_eval_passed`, parked
/// between slices as a worker leaves them.
async fn all_ready_to_publish(fx: &Fx, engine: &kfs_worker::consumer::Engine, attempts: &[Uuid]) {
    for &a in attempts {
        fx.drive_to(engine, a, "smoke_eval_passed").await;
    }
}

/// Whether a publication serves a document with members of two generations, or a document
/// whose members are not those of its generation whole (its outline once, a projection of
/// each of its nodes). Returns what is wrong, empty when nothing is.
async fn incomplete(pool: &PgPool, publication: Uuid) -> Vec<String> {
    let rows: Vec<(Uuid, i64, i64, i64, i64)> = sqlx::query_as(
        "WITH m AS (SELECT * FROM projection_set_publication_members WHERE publication_id = $1), \
         d AS (SELECT document_asset_id AS doc, count(DISTINCT generation_id) AS generations, \
                 min(generation_id::text)::uuid AS generation, \
                 count(*) FILTER (WHERE component_type = 'document-outline') AS outlines, \
                 count(*) FILTER (WHERE component_type = 'index-projection') AS projections \
               FROM m WHERE document_asset_id IS NOT NULL GROUP BY 1) \
         SELECT d.doc, d.generations, d.outlines, d.projections, \
           (SELECT count(*) FROM index_projections p JOIN knowledge_nodes n ON n.id = p.node_id \
             WHERE p.publication_generation_id = d.generation AND n.document_asset_id = d.doc) \
         FROM d",
    )
    .bind(publication)
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter()
        .filter(|r| r.1 != 1 || r.2 != 1 || r.3 != r.4 || r.3 == 0)
        .map(|r| {
            format!(
                "document {}: {} generations, {} outlines, {} of {} projections",
                r.0, r.1, r.2, r.3, r.4
            )
        })
        .collect()
}

/// The head's publication and revision.
async fn head_of(pool: &PgPool, space: Uuid) -> Option<(Uuid, i32)> {
    sqlx::query_as(
        "SELECT publication_id, head_revision FROM projection_set_publication_heads \
         WHERE tenant_id = $1 AND knowledge_space_id = $2",
    )
    .bind(TENANT)
    .bind(space)
    .fetch_optional(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_publish_takes_every_parked_attempt_of_the_space_in_one_head_move() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-together", 1);
    let docs = request_generated(&fx, 4, "together").await;
    let attempts: Vec<Uuid> = docs.iter().map(|d| d.1).collect();
    all_ready_to_publish(&fx, &engine, &attempts).await;
    let own: Vec<Uuid> = {
        let mut v = Vec::new();
        for &a in &attempts {
            v.push(fx.status(a).await.candidate_publication_id.unwrap());
        }
        v
    };
    // The last attempt's step is under way elsewhere (its row held, as a worker's step holds
    // it): the publish does not wait for it and does not take it.
    let held = attempts[3];
    let mut hold = fx.pool().begin().await.unwrap();
    sqlx::query("SELECT 1 FROM document_compilation_attempts WHERE id = $1 FOR NO KEY UPDATE")
        .bind(held)
        .execute(&mut *hold)
        .await
        .unwrap();
    assert_eq!(
        fx.slice(&engine, attempts[0]).await,
        Handled::Ack {
            claim: "claimed",
            end: Some("succeeded")
        }
    );
    hold.rollback().await.unwrap();

    let (publication, revision) = head_of(fx.pool(), fx.space).await.unwrap();
    assert_eq!(revision, 1, "one head move");
    assert_eq!(
        publication, own[0],
        "the publishing attempt's own candidate"
    );
    for (i, &a) in attempts[..3].iter().enumerate() {
        let s = fx.status(a).await;
        assert_succeeded(&s);
        assert_eq!(s.checkpoint, "published");
        assert_eq!(
            s.candidate_publication_id,
            Some(publication),
            "attempt {i} bound to it"
        );
        let head = fx.head().await.unwrap();
        assert_eq!(
            s.candidate_fingerprint.as_deref(),
            Some(head.fingerprint.as_str())
        );
        assert_eq!(s.base_head_revision, 0, "the head it moved from");
        let outbox: String = sqlx::query_scalar(
            "SELECT status::text FROM document_compilation_outbox WHERE attempt_id = $1",
        )
        .bind(a)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert_eq!(outbox, "completed", "attempt {i}'s outbox row");
    }
    // Each joined attempt's logical-document revision became active with its chunks, as its own
    // publish would have made it.
    for (i, d) in docs[..3].iter().enumerate() {
        let (logical, revision, state, bound, activated) = fx.revision_of(d.0).await;
        assert_eq!(
            (state.as_str(), bound, activated),
            ("active", Some(d.1), true),
            "document {i}"
        );
        let (status, active, _) = fx.logical(logical).await;
        assert_eq!(
            (status.as_str(), active),
            ("ready", Some(revision)),
            "document {i}"
        );
        let chunks: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM document_revision_chunks WHERE document_id = $1 AND document_revision = $2",
        )
        .bind(logical)
        .bind(revision)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert_eq!(chunks, d.2, "document {i}: a chunk per node");
    }
    for c in &own[1..3] {
        assert_eq!(
            fx.publication_status(*c).await,
            "inactive",
            "a joined attempt's own candidate"
        );
    }
    let held_status = fx.status(held).await;
    assert_eq!(
        held_status.checkpoint, "smoke_eval_passed",
        "the held attempt was left alone"
    );
    assert_eq!(held_status.candidate_publication_id, Some(own[3]));
    let served = fx.served().await;
    assert_eq!(served.len(), 3, "{served:?}");
    assert!(incomplete(fx.pool(), publication).await.is_empty());
    let metadata: serde_json::Value = sqlx::query_scalar(
        "SELECT metadata -> 'documentCompilationCandidate' FROM projection_set_publications WHERE id = $1",
    )
    .bind(publication)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert!(
        metadata
            .get(kfs_worker::jobs::compile::OWNER_ONLY_KEY)
            .is_none(),
        "a published candidate is no longer marked owner-only: {metadata}"
    );

    // The held attempt publishes on its own, over the moved head.
    let s = fx.drive(&engine, held).await;
    assert_succeeded(&s);
    let (publication, revision) = head_of(fx.pool(), fx.space).await.unwrap();
    assert_eq!(
        (revision, Some(publication)),
        (2, s.candidate_publication_id)
    );
    assert_eq!(fx.served().await.len(), 4);
    assert!(incomplete(fx.pool(), publication).await.is_empty());
    assert_all_published(&fx, &docs).await;
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_attempt_whose_grant_was_revoked_is_not_published_by_another_attempts_publish() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-together-grant", 1);
    let a_doc = fx
        .add("a.md", "text/markdown", b"# Alpha\n\nAlpha walrus notes.")
        .await;
    let b_doc = fx
        .add("b.md", "text/markdown", b"# Beta\n\nBeta narwhal notes.")
        .await;
    let a = fx.request(a_doc, false).await.unwrap();
    let grant = fx.grant("agent-together").await;
    let b = fx.request_with(b_doc, by_grant(grant)).await.unwrap();
    all_ready_to_publish(&fx, &engine, &[a, b]).await;
    {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::revoke_capability_grant(&mut conn, TENANT, fx.space, grant)
            .await
            .unwrap();
    }
    assert_succeeded(&fx.drive(&engine, a).await);
    let served = fx.served().await;
    assert_eq!(
        served.keys().copied().collect::<Vec<_>>(),
        vec![a_doc],
        "only A is published"
    );
    let sb = fx.status(b).await;
    assert_eq!(
        sb.checkpoint, "smoke_eval_passed",
        "B was left to its own publish: {sb:?}"
    );
    let sb = fx.drive(&engine, b).await;
    assert_eq!(sb.run_state, "failed", "{sb:?}");
    assert_eq!(
        sb.last_error_message.as_deref(),
        Some(compile::CAPABILITY_FENCED)
    );
    assert_eq!(fx.served().await.len(), 1);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_attempt_whose_revision_no_longer_fits_is_left_to_fail_on_its_own() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-together-revision", 1);
    let docs = request_generated(&fx, 2, "revfence").await;
    let (a, b) = (docs[0].1, docs[1].1);
    all_ready_to_publish(&fx, &engine, &[a, b]).await;
    // B's logical document moves on meanwhile: its revision's fence no longer holds.
    let (logical, _, _, _, _) = fx.revision_of(docs[1].0).await;
    sqlx::query("UPDATE logical_documents SET row_version = row_version + 1 WHERE id = $1")
        .bind(logical)
        .execute(fx.pool())
        .await
        .unwrap();
    assert_succeeded(&fx.drive(&engine, a).await);
    assert_eq!(
        fx.served().await.keys().copied().collect::<Vec<_>>(),
        vec![docs[0].0],
        "only A is published"
    );
    let sb = fx.status(b).await;
    assert_eq!(
        sb.checkpoint, "smoke_eval_passed",
        "B was left to its own publish: {sb:?}"
    );
    assert_eq!(
        fx.revision_of(docs[1].0).await.2,
        "candidate",
        "nothing written for B"
    );
    let sb = fx.drive(&engine, b).await;
    assert_eq!(
        (sb.run_state.as_str(), sb.last_error_code.as_deref()),
        (
            "failed",
            Some(kfs_worker::jobs::compile::profiles::COMPILATION_FAILED)
        ),
        "{sb:?}"
    );
    assert_eq!(fx.served().await.len(), 1);
    fx.cleanup().await;
}

/// Several worker processes publish one space's documents while a reader reads every head it
/// can see: each is complete (every document it serves has its generation's members whole,
/// once), none serves fewer documents than one read before it, and every attempt ends bound to
/// a publication that was a head and serves its generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_publishes_of_one_space_show_readers_only_complete_heads() {
    const DOCS: usize = 120;
    let fx = Fx::new().await;
    let spawn = |id: &'static str| {
        let e = [
            ("KFS_OBJECT_STORE", fx.store_url.clone()),
            ("KFS_KINDS", "compile".to_owned()),
            ("KFS_WORKER_ID", id.to_owned()),
            ("KFS_RELAY_POLL", "200ms".to_owned()),
        ];
        let e: Vec<(&str, &str)> = e.iter().map(|(k, v)| (*k, v.as_str())).collect();
        fx.env.spawn_worker(id, &["run"], &e)
    };
    let mut workers = [
        spawn("together-1"),
        spawn("together-2"),
        spawn("together-3"),
    ];
    let docs = request_generated(&fx, DOCS, "concur").await;
    let attempts: Vec<Uuid> = docs.iter().map(|d| d.1).collect();

    let stop = CancellationToken::new();
    let reader = {
        let pool = fx.pool().clone();
        let space = fx.space;
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut seen = std::collections::BTreeSet::new();
            let mut served_before = 0usize;
            let mut faults = Vec::new();
            while !stop.is_cancelled() {
                // One snapshot for the head and its members, as a reader's query sees them.
                let mut tx = pool.begin().await.unwrap();
                sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                let head: Option<(Uuid, i32)> = sqlx::query_as(
                    "SELECT publication_id, head_revision FROM projection_set_publication_heads \
                     WHERE tenant_id = $1 AND knowledge_space_id = $2",
                )
                .bind(TENANT)
                .bind(space)
                .fetch_optional(&mut *tx)
                .await
                .unwrap();
                if let Some((p, revision)) = head {
                    let served: i64 = sqlx::query_scalar(
                        "SELECT count(*) FROM projection_set_publication_members \
                         WHERE publication_id = $1 AND component_type = 'document-outline'",
                    )
                    .bind(p)
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
                    tx.commit().await.unwrap();
                    if seen.insert(revision) {
                        faults.extend(incomplete(&pool, p).await);
                        let served = usize::try_from(served).unwrap();
                        if served < served_before {
                            faults.push(format!(
                                "head {revision} serves {served} documents, one before it {served_before}"
                            ));
                        }
                        served_before = served;
                    }
                } else {
                    tx.commit().await.unwrap();
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (seen.len(), faults)
        })
    };
    let done = wait_terminal(&fx, &attempts, Duration::from_secs(300)).await;
    stop.cancel();
    let (heads_seen, faults) = reader.await.unwrap();
    assert!(
        done,
        "not every attempt ended: {:?}",
        states(fx.pool()).await
    );
    assert!(faults.is_empty(), "{faults:#?}");
    assert!(heads_seen > 0, "the reader saw no head");
    assert_all_published(&fx, &docs).await;

    // No attempt ended without its publication: each is bound to one that was a head and that
    // serves the attempt's generation of its document.
    let unbound: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT a.id, coalesce(p.status::text, 'none') FROM document_compilation_attempts a \
         LEFT JOIN projection_set_publications p ON p.id = a.candidate_publication_id \
         WHERE a.id = ANY($1) AND (p.status IS NULL OR p.status NOT IN ('published', 'superseded') \
           OR NOT EXISTS (SELECT 1 FROM projection_set_publication_members m \
             WHERE m.publication_id = p.id AND m.document_asset_id = a.document_asset_id \
               AND m.generation_id = a.publication_generation_id AND m.component_type = 'document-outline'))",
    )
    .bind(&attempts)
    .fetch_all(fx.pool())
    .await
    .unwrap();
    assert!(unbound.is_empty(), "{unbound:?}");
    // The head's attempts all moved it from the revision before it.
    let (publication, revision) = head_of(fx.pool(), fx.space).await.unwrap();
    let bases: Vec<i32> = sqlx::query_scalar(
        "SELECT DISTINCT base_head_revision FROM document_compilation_attempts WHERE candidate_publication_id = $1",
    )
    .bind(publication)
    .fetch_all(fx.pool())
    .await
    .unwrap();
    assert_eq!(bases, vec![revision - 1]);
    let moves: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM projection_set_publications WHERE tenant_id = $1 AND knowledge_space_id = $2 \
           AND status IN ('published', 'superseded')",
    )
    .bind(TENANT)
    .bind(fx.space)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert!(
        moves < DOCS as i64,
        "{DOCS} documents took {moves} head moves: none published another's"
    );
    support::stop_cleanly(&mut workers, Duration::from_secs(20)).await;
    fx.cleanup().await;
}

#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_in_the_middle_of_a_publish_leaves_a_readable_head() {
    const DOCS: usize = 24;
    let fx = Fx::new().await;
    let spawn = |id: &'static str, crash: bool| {
        let mut e = vec![
            ("KFS_OBJECT_STORE", fx.store_url.clone()),
            ("KFS_KINDS", "compile".to_owned()),
            ("KFS_WORKER_ID", id.to_owned()),
            ("KFS_RELAY_POLL", "200ms".to_owned()),
            ("KFS_LEASES", "compile=60s".to_owned()),
        ];
        if crash {
            // The second publish: a head exists, and the publish in flight is moving it on.
            e.push(("KFS_CRASH_AT", "compile-publish-before-commit:2".to_owned()));
        }
        let e: Vec<(&str, &str)> = e.iter().map(|(k, v)| (*k, v.as_str())).collect();
        fx.env.spawn_worker(id, &["run"], &e)
    };
    let docs = request_generated(&fx, DOCS, "killpub").await;
    let attempts: Vec<Uuid> = docs.iter().map(|d| d.1).collect();
    let mut a = spawn("killpub-a", true);
    let status = a.wait_exit(Duration::from_secs(120));
    let log = a.log_text();
    assert!(
        status.is_some_and(|s| !s.success()),
        "A did not abort: {status:?}\n{log}"
    );
    assert!(
        log.contains("crash point compile-publish-before-commit reached"),
        "{log}"
    );
    // The head the crash left is the first publish's, whole; the publish in flight left nothing.
    let (publication, revision) = head_of(fx.pool(), fx.space).await.expect("a head");
    assert_eq!(revision, 1, "the killed publish did not move the head");
    assert!(incomplete(fx.pool(), publication).await.is_empty());
    let served = fx.served().await;
    assert!(!served.is_empty());
    for doc in served.keys() {
        let (_, attempt, _, marker) = docs.iter().find(|d| d.0 == *doc).unwrap();
        assert_succeeded(&fx.status(*attempt).await);
        assert!(!fx.search(marker).await.is_empty(), "{marker} readable");
    }
    let succeeded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM document_compilation_attempts WHERE id = ANY($1) AND run_state = 'succeeded'",
    )
    .bind(&attempts)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(
        succeeded as usize,
        served.len(),
        "an attempt succeeded exactly when the head serves it"
    );

    let mut b = [spawn("killpub-b", false)];
    let done = wait_terminal(&fx, &attempts, Duration::from_secs(180)).await;
    assert!(
        done,
        "not every attempt ended: {:?}\n{}",
        states(fx.pool()).await,
        b[0].tail(40)
    );
    assert_all_published(&fx, &docs).await;
    support::stop_cleanly(&mut b, Duration::from_secs(20)).await;
    fx.cleanup().await;
}
