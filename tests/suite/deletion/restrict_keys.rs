//! The platform's ON DELETE RESTRICT keys (compile attempts' snapshots, source runs, sync
//! policies and connections, grants, profile bindings) do not stop a space or source deletion.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_space_whose_compile_attempts_bind_permission_snapshots_is_deleted_despite_the_restrict_key(
) {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let pool = fx.pool();
    let mut s = seed(&fx, "tenant-t", "main", "Docs", 0, 0).await;
    let restrict: String = sqlx::query_scalar(
        "SELECT confdeltype::text FROM pg_constraint WHERE conrelid = 'document_compilation_attempts'::regclass \
           AND confrelid = 'knowledge_space_permission_snapshots'::regclass",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(restrict, "r", "the 0016 binding is ON DELETE RESTRICT");
    for i in 0..2 {
        let doc = fx
            .add(
                &format!("bound-{i}.md"),
                "text/markdown",
                note(i, "bound").as_bytes(),
            )
            .await;
        let mut tx = pool.begin().await.unwrap();
        let attempt = compile::request(
            &mut tx,
            doc,
            RequestOptions {
                requester: Some(Requester {
                    subject: OWNER.into(),
                    snapshot: s.owner_snapshot,
                }),
                ..RequestOptions::default()
            },
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        let st = fx.drive(&fx.engine("w-bound", 64), attempt).await;
        assert_eq!(st.run_state, "succeeded", "{st:?}");
        s.docs.push(doc);
    }
    // Traces and research tasks bind the same snapshot.
    extras(&fx, &s).await;
    let bound: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM document_compilation_attempts WHERE permission_snapshot_id = $1",
    )
    .bind(s.owner_snapshot)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(bound, 2);
    let cat = catalog(pool).await;
    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    let job = request(pool, &space_request(&s, "bound")).await.unwrap();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    let left = cat.count_owned(pool, Some(s.id), &s.docs).await;
    assert!(left.is_empty(), "rows of the space left: {left:?}");
    assert!(files_under(&fx.dir, &s.prefix).is_empty());
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_source_with_workflow_runs_a_sync_policy_and_logical_documents_is_deleted_despite_the_restrict_keys(
) {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 1, 2).await;
    let pool = fx.pool();
    let source = s.sources[0];
    backfill_logical_documents(pool, &s.docs).await;
    let connection = connect_source(pool, &s, source, None).await;
    let run = source_run(pool, &s, source, None).await;
    let cat = catalog(pool).await;

    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    let job = request(
        pool,
        &target_request(
            &s,
            Target::Source {
                id: source,
                mode: SourceMode::Cascade,
            },
            "s1",
        ),
    )
    .await
    .unwrap();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    for (sql, id) in [
        ("SELECT count(*) FROM sources WHERE id = $1", source),
        (
            "SELECT count(*) FROM source_workflow_runs WHERE id = $1",
            run,
        ),
        (
            "SELECT count(*) FROM source_workflow_outbox WHERE run_id = $1",
            run,
        ),
        (
            "SELECT count(*) FROM source_sync_policies WHERE source_id = $1",
            source,
        ),
    ] {
        assert_eq!(count(pool, sql, id).await, 0, "{sql}");
    }
    let owned = cat.count_owned(pool, None, &s.docs).await;
    assert!(
        owned.is_empty(),
        "rows of the source's documents left: {owned:?}"
    );
    let logical: i64 =
        sqlx::query_scalar("SELECT count(*) FROM logical_documents WHERE id = ANY($1)")
            .bind(&s.docs)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(logical, 0, "the source's logical documents went with it");
    // The platform leaves the connection: the source named it, not the other way round.
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM source_connections WHERE id = $1",
            connection
        )
        .await,
        1
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_space_with_source_connections_bindings_and_a_capability_grant_is_deleted_under_that_grant(
) {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 1, 2).await;
    let c = seed(&fx, "tenant-u", "main", "Docs", 0, 1).await;
    let pool = fx.pool();
    let source = s.sources[0];
    backfill_logical_documents(pool, &s.docs).await;
    let grant = grant_for(&fx, &s, &["tenant:tenant-t"]).await;
    // Rows that name the grant or the publications by RESTRICT keys: a connection made under
    // the grant (the source uses it), a run and a sync policy under it, an OAuth transaction,
    // and the head's profile binding.
    let connection = connect_source(pool, &s, source, Some(grant)).await;
    source_run(pool, &s, source, Some(grant)).await;
    sqlx::query(
        "INSERT INTO source_oauth_transactions (id, tenant_id, knowledge_space_id, connection_id, access_channel, \
           permission_snapshot_id, permission_snapshot_revision, requested_by_subject_id, redirect_uri, state_hash, \
           status, verifier_ref, expires_at, created_at) \
         VALUES (gen_random_uuid(), $1, $2, $3, 'interactive', $4, 1, $5, 'https://app.example/cb', repeat('b', 64), \
           'pending', 'verifier:1', now() + interval '10 minutes', now())",
    )
    .bind(&s.tenant)
    .bind(s.id)
    .bind(connection)
    .bind(s.owner_snapshot)
    .bind(OWNER)
    .execute(pool)
    .await
    .unwrap();
    bind_head(pool, &s).await;
    let cat = catalog(pool).await;
    let before = untouched(&fx, &cat, &[&c]).await;

    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    let job = request_under_grant(
        pool,
        &grant_request(
            &s,
            Target::Space {
                confirm_name: s.name.clone(),
            },
            grant,
            "sp1",
        ),
    )
    .await
    .unwrap();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    let left = cat.count_owned(pool, Some(s.id), &s.docs).await;
    assert!(left.is_empty(), "rows of the space left: {left:?}");
    assert!(files_under(&fx.dir, &s.prefix).is_empty());
    assert_untouched(&fx, &cat, &[&c], &before).await;
    fx.cleanup().await;
}
