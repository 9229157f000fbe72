//! Logical documents around a compile: its candidate revision is published and superseded by the
//! next, a disabled document fails, a retry restores a failed revision, and reindex and chunk
//! intents bound to an attempt are applied by its publish.

use super::*;

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
