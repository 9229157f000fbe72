//! Logical documents: deleted at revision zero without a trace, keeping a shared asset, and a
//! 0022-backfilled one deleted with its document despite the RESTRICT key.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_logical_document_deleted_at_revision_zero_leaves_nothing_of_it_and_keeps_a_shared_asset()
{
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 1).await;
    let pool = fx.pool();
    // Logical document `ld`, as uploads and compiles write it: uploaded as `shared.md`
    // (revision 1), then a new revision uploaded as `owned.md` (revision 2, its own asset);
    // compiling that activates it and supersedes revision 1, each with its chunks.
    let shared = fx
        .add("shared.md", "text/markdown", note(2, "shared").as_bytes())
        .await;
    fx.compile(shared).await;
    let mut c = conn(pool).await;
    let ld = platform::logical_document_of(&mut c, shared)
        .await
        .unwrap()
        .unwrap();
    let owned = platform::add_revision(
        &mut c,
        &fx.store,
        ld,
        "owned.md",
        "text/markdown",
        Bytes::from(note(1, "owned")),
    )
    .await
    .unwrap();
    drop(c);
    fx.compile(owned).await;
    let revisions: Vec<(i32, Uuid, String)> = sqlx::query_as(
        "SELECT revision, document_asset_id, state FROM document_revisions WHERE document_id = $1 ORDER BY revision",
    )
    .bind(ld)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        revisions,
        vec![
            (1, shared, "superseded".into()),
            (2, owned, "active".into())
        ]
    );
    let chunk: Uuid = sqlx::query_scalar(
        "SELECT id FROM document_revision_chunks WHERE document_id = $1 AND document_revision = 2 \
         ORDER BY ordinal LIMIT 1",
    )
    .bind(ld)
    .fetch_one(pool)
    .await
    .unwrap();
    // Beside it: a chunk state change, settings and a reindex attempt of revision 2, and an
    // activity event; `keeper`, another document, has its active revision on the shared asset.
    // The request fences the document's row_version, which the platform lets be 0 (as an upload
    // leaves it): `ld` is put back at 0 to be asked for at revision zero.
    let keeper = Uuid::new_v4();
    let (t, sp) = (&s.tenant, s.id);
    let attempt = Uuid::new_v4();
    sqlx::raw_sql(&format!(
        r#"
        BEGIN;
        INSERT INTO logical_documents (id, tenant_id, knowledge_space_id, title, status, active_revision, row_version,
          system_metadata, user_metadata, created_at, updated_at)
        VALUES ('{keeper}', '{t}', '{sp}', 'Keeper', 'ready', 1, 0, '{{}}', '{{}}', now(), now());
        {k1}
        COMMIT;
        UPDATE logical_documents SET row_version = 0 WHERE id = '{ld}';
        INSERT INTO document_chunk_state_changes (id, tenant_id, knowledge_space_id, document_id, document_revision, chunk_id,
          compilation_attempt_id, enabled, state, created_at, activated_at)
        VALUES (gen_random_uuid(), '{t}', '{sp}', '{ld}', 2, '{chunk}', '{attempt}', false, 'active', now(), now());
        INSERT INTO document_settings_revisions (tenant_id, knowledge_space_id, document_id, revision, settings, state,
          created_by_subject_id, created_at, activated_at)
        VALUES ('{t}', '{sp}', '{ld}', 1, '{{}}', 'active', '{OWNER}', now(), now());
        INSERT INTO document_settings_heads (tenant_id, knowledge_space_id, document_id, active_revision, row_version, updated_at)
        VALUES ('{t}', '{sp}', '{ld}', 1, 0, now());
        INSERT INTO document_reindex_attempts (id, tenant_id, knowledge_space_id, document_id, document_revision,
          settings_revision, expected_settings_head_revision, compilation_attempt_id, state, active_slot, row_version,
          created_at, updated_at, completed_at)
        VALUES (gen_random_uuid(), '{t}', '{sp}', '{ld}', 2, 1, 1, '{attempt}', 'succeeded', NULL, 1, now(), now(), now());
        INSERT INTO knowledge_space_activity_events (id, tenant_id, knowledge_space_id, action, actor_type, details,
          occurred_at, required_permission_scope, resource_id, resource_type, result)
        VALUES (gen_random_uuid(), '{t}', '{sp}', 'document.published', 'system', '{{}}', now(), '[]', '{ld}', 'document', 'success');
        "#,
        k1 = revision_sql(&s, keeper, 1, shared, "active"),
    ))
    .execute(pool)
    .await
    .unwrap();
    let cat = catalog(pool).await;
    let mut needles = needles_of(&fx, &s, owned).await;
    needles.push(ld.to_string());

    // Requested on the command line, at the document's row_version 0.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"))
        .args([
            "delete",
            "logical-document",
            &ld.to_string(),
            "--space",
            &s.id.to_string(),
            "--tenant",
            &s.tenant,
            "--revision",
            "0",
            "--as",
            OWNER,
            "--snapshot",
            &s.owner_snapshot.to_string(),
        ])
        .env("DATABASE_URL", &fx.env.url)
        .env("KFS_OBJECT_STORE", &fx.store_url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let job: Uuid = v["jobId"].as_str().unwrap().parse().unwrap();
    let fenced: (String, i32, String, i32) = sqlx::query_as(
        "SELECT j.target_type, j.target_revision, l.status, l.row_version FROM deletion_jobs j \
         JOIN logical_documents l ON l.id = j.target_id WHERE j.id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(fenced, ("logical_document".into(), 0, "deleting".into(), 1));
    // Only the asset it alone references is fenced.
    let states: Vec<(Uuid, String, Option<Uuid>)> = sqlx::query_as(
        "SELECT id, lifecycle_state, deletion_job_id FROM document_assets WHERE id = ANY($1) ORDER BY id = $2 DESC",
    )
    .bind(vec![owned, shared])
    .bind(owned)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        states,
        vec![
            (owned, "deleting".into(), Some(job)),
            (shared, "active".into(), None)
        ]
    );

    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    for table in [
        "document_reindex_attempts",
        "document_chunk_state_changes",
        "document_revision_chunks",
        "document_settings_heads",
        "document_settings_revisions",
        "document_revisions",
    ] {
        let n = count(
            pool,
            &format!("SELECT count(*) FROM {table} WHERE document_id = $1"),
            ld,
        )
        .await;
        assert_eq!(n, 0, "{table}");
    }
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM logical_documents WHERE id = $1",
            ld
        )
        .await,
        0
    );
    assert_documents_gone(&fx, &cat, &s, &[owned], &needles).await;
    // The shared asset and the other document are as they were, still served.
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM document_revisions WHERE document_id = $1 AND state = 'active'",
            keeper
        )
        .await,
        1
    );
    let served = served(pool, &s).await;
    assert!(
        served.contains(&shared) && !served.contains(&owned),
        "{served:?}"
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_document_with_its_0022_logical_document_is_deleted_despite_the_restrict_key_then_the_logical_document_too(
) {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 2).await;
    let pool = fx.pool();
    backfill_logical_documents(pool, &s.docs).await;
    let doc = s.docs[1];
    // An unpublished logical document whose only revision is a candidate of the same asset, as
    // the API leaves an upload that never compiled.
    let pending = Uuid::new_v4();
    sqlx::raw_sql(&format!(
        "INSERT INTO logical_documents (id, tenant_id, knowledge_space_id, title, status, active_revision, row_version, \
           system_metadata, user_metadata, created_at, updated_at) \
         VALUES ('{pending}', '{}', '{}', 'Pending', 'pending', NULL, 0, '{{}}', '{{}}', now(), now()); {}",
        s.tenant,
        s.id,
        revision_sql(&s, pending, 1, doc, "candidate")
    ))
    .execute(pool)
    .await
    .unwrap();
    let restrict: String = sqlx::query_scalar(
        "SELECT confdeltype::text FROM pg_constraint WHERE conrelid = 'document_revisions'::regclass \
           AND confrelid = 'document_assets'::regclass",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(restrict, "r", "the 0022 key is ON DELETE RESTRICT");
    let cat = catalog(pool).await;
    let needles = needles_of(&fx, &s, doc).await;

    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    let job = request(
        pool,
        &target_request(&s, Target::Document { id: doc }, "a1"),
    )
    .await
    .unwrap();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    let owned = cat.count_owned(pool, None, &[doc]).await;
    assert!(owned.is_empty(), "rows of the document left: {owned:?}");
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM logical_documents WHERE id = $1",
            pending
        )
        .await,
        0
    );
    // As the platform does, the logical document whose active revision it was stays, failed and
    // without a revision, for a logical-document deletion; the other document is untouched.
    let left: (String, Option<i32>, i32) = sqlx::query_as(
        "SELECT status, active_revision, row_version FROM logical_documents WHERE id = $1",
    )
    .bind(doc)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((left.0.as_str(), left.1), ("failed", None));
    assert_eq!(
        count(pool, "SELECT count(*) FROM logical_documents WHERE id = $1 AND status = 'ready' AND active_revision IS NOT NULL", s.docs[0]).await,
        1
    );

    let job = request(
        pool,
        &DeletionRequest {
            expected_revision: Some(left.2),
            ..target_request(&s, Target::LogicalDocument { id: doc }, "a2")
        },
    )
    .await
    .unwrap();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    assert_documents_gone(&fx, &cat, &s, &[doc], &needles).await;
    fx.cleanup().await;
}
