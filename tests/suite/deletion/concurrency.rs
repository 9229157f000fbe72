//! A deletion waits for concurrent work in its space without using attempts: another
//! deletion's space-wide step, live writers and leases, a compile publishing over the document.

use super::*;

/// Another deletion's space-wide step in the same space holds the space's lock (taken here
/// the way that step takes it).
async fn hold_space_lock(pool: &PgPool, space: Uuid) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
        .bind(SPACE_LOCK_CLASS)
        .bind(space.to_string())
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_space_wide_step_queues_behind_another_deletions_step_then_runs_or_gives_its_slice_back()
{
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 0).await;
    let pool = fx.pool();
    let doc = fx
        .add("queued.md", "text/markdown", note(1, "queued").as_bytes())
        .await;
    fx.compile(doc).await;
    let job = request(
        pool,
        &target_request(&s, Target::Document { id: doc }, "queued"),
    )
    .await
    .unwrap();
    let patient = |wait: Duration| {
        Arc::new(handler(&fx).with_config(DeletionConfig {
            space_lock_wait: wait,
            ..fast_config()
        }))
    };

    // Held for longer than the step waits: the slice ends with a cooperative wait, using no
    // attempt, and its transaction (rolled back to before the lock) writes nothing else.
    let holder = hold_space_lock(pool, s.id).await;
    let short = Driver::new(&fx, patient(Duration::from_millis(300)), Budget::default()).await;
    for _ in 0..20 {
        short.turn().await;
        if job_state(pool, job).await.0 == "retry_wait" {
            break;
        }
    }
    let (state, cp, code, message, attempts): (String, String, Option<String>, Option<String>, i32) =
        sqlx::query_as(
            "SELECT run_state, checkpoint, last_error_code, last_error_message, execution_attempts              FROM deletion_jobs WHERE id = $1",
        )
        .bind(job)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!((state.as_str(), cp.as_str()), ("retry_wait", "quiescing"));
    assert_eq!(code.as_deref(), Some("waiting"));
    assert!(
        message
            .unwrap_or_default()
            .contains("another deletion in the space"),
        "the wait names why"
    );
    assert_eq!(attempts, 0, "a planned wait gives its attempt back");
    assert!(
        served(pool, &s).await.contains(&doc),
        "nothing of the quiescing step committed"
    );

    // Released while the next step queues for it: that step gets the lock and goes on.
    skip_wait(pool, job).await;
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        holder.commit().await.unwrap();
    });
    let queued = Driver::new(&fx, patient(Duration::from_secs(60)), Budget::default()).await;
    assert_eq!(queued.finish(job, true).await.0, "succeeded");
    release.await.unwrap();
    let (attempts, code): (i32, Option<String>) = sqlx::query_as(
        "SELECT execution_attempts, last_error_code FROM deletion_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        (attempts, code),
        (1, None),
        "one slice queued for the lock and ran to the end"
    );
    assert_finished_clean(pool, job).await;
    assert!(!served(pool, &s).await.contains(&doc));
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn live_writers_and_leases_hold_the_job_without_using_attempts_and_the_rest_is_canceled_or_reclaimed(
) {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 1, 2).await;
    let pool = fx.pool();
    let ms = "(extract(epoch from now()) * 1000)::bigint";
    let lease = |status: &'static str, expires: &'static str| {
        let pool = pool.clone();
        let s = s.clone();
        async move {
            let id = Uuid::now_v7();
            sqlx::query(&format!(
                "INSERT INTO retrieval_execution_leases (id, tenant_id, knowledge_space_id, subject_id, trace_id, \
                   lease_token, status, row_version, acquired_at, heartbeat_at, expires_at, updated_at) \
                 VALUES ($1, $2, $3, 'bob', gen_random_uuid(), 'tok', '{status}', 0, now() - interval '2 hours', \
                   now() - interval '2 hours', {expires}, now())"
            ))
            .bind(id)
            .bind(&s.tenant)
            .bind(s.id)
            .execute(&pool)
            .await
            .unwrap();
            id
        }
    };
    let live = lease("active", "now() + interval '1 hour'").await;
    let stale = lease("active", "now() - interval '1 hour'").await;
    // A compile attempt holding a live lease, and one still queued.
    let running = fx.request(s.docs[1], false).await.unwrap();
    sqlx::query(
        "UPDATE document_compilation_attempts SET run_state = 'running', worker_id = 'w-elsewhere', \
           lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 hour', heartbeat_at = now(), \
           execution_attempts = 1 WHERE id = $1",
    )
    .bind(running)
    .execute(pool)
    .await
    .unwrap();
    let queued = fx.request(s.docs[0], false).await.unwrap();
    // A research task holding a live lease, and one queued with its outbox.
    let (live_task, queued_task) = (Uuid::new_v4(), Uuid::new_v4());
    let session = Uuid::new_v4();
    sqlx::raw_sql(&format!(
        r#"
        INSERT INTO research_task_jobs (id, tenant_id, knowledge_space_id, subject_id, permission_snapshot_id,
          permission_snapshot_revision, access_channel, query, limits, metadata, cost, stage, row_version,
          execution_attempts, max_execution_attempts, worker_id, lease_token, lease_expires_at, heartbeat_at,
          created_at, updated_at)
        VALUES ('{live_task}', '{t}', '{sp}', '{OWNER}', '{snap}', 1, 'interactive', 'q', '{{}}', '{{}}', '{{}}',
          'retrieving', 2, 1, 5, 'w-elsewhere', gen_random_uuid(), {ms} + 3600000, {ms}, {ms}, {ms}),
               ('{queued_task}', '{t}', '{sp}', '{OWNER}', '{snap}', 1, 'interactive', 'q', '{{}}', '{{}}', '{{}}',
          'queued', 1, 0, 5, NULL, NULL, NULL, NULL, {ms}, {ms});
        INSERT INTO research_task_outbox (id, research_task_job_id, delivery_revision, event_type, schema_version,
          idempotency_key, payload, status, available_at, dispatch_attempts, created_at, updated_at)
        VALUES (gen_random_uuid(), '{queued_task}', 1, 'research.task', 1, 'research.task:{t}:{sp}:{queued_task}:1',
          '{{}}', 'pending', {ms}, 0, {ms}, {ms});
        INSERT INTO knowledge_fs_sessions (id, tenant_id, knowledge_space_id, subject, permission_snapshot, client_kind,
          client_version, consistency_class, metadata, created_at, updated_at, heartbeat_at, expires_at)
        VALUES ('{session}', '{t}', '{sp}', '{{}}', '{{}}', 'mcp', '1', 'path-consistent', '{{}}', now(), now(), now(),
          now() + interval '1 hour');
        INSERT INTO knowledge_fs_leases (id, tenant_id, knowledge_space_id, session_id, lease_type, target_type, target_id,
          virtual_path, status, metadata, acquired_at, heartbeat_at, expires_at, updated_at)
        VALUES ('{live_fs}', '{t}', '{sp}', '{session}', 'write', 'knowledge-space', '{sp}', '/', 'active', '{{}}',
          now(), now(), now() + interval '1 hour', now()),
               ('{stale_fs}', '{t}', '{sp}', '{session}', 'read', 'knowledge-space', '{sp}', '/', 'active', '{{}}',
          now() - interval '2 hours', now() - interval '2 hours', now() - interval '1 hour', now());
        INSERT INTO knowledge_space_mutation_leases (id, tenant_id, knowledge_space_id, operation, acquired_at,
          lease_token, heartbeat_at, expires_at)
        VALUES (gen_random_uuid(), '{t}', '{sp}', 'import', now() - interval '1 hour', gen_random_uuid(),
          now() - interval '1 hour', now() - interval '30 minutes');
        UPDATE source_credential_backfills SET run_state = 'queued', completed_at = NULL WHERE knowledge_space_id = '{sp}';
        UPDATE sources SET status = 'syncing' WHERE knowledge_space_id = '{sp}';
        "#,
        t = s.tenant,
        sp = s.id,
        snap = s.owner_snapshot,
        live_fs = Uuid::from_u128(1),
        stale_fs = Uuid::from_u128(2),
    ))
    .execute(pool)
    .await
    .unwrap();
    let objects = files_under(&fx.dir, &s.prefix);

    let job = request(pool, &space_request(&s, "drain")).await.unwrap();
    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    for _ in 0..3 {
        driver.turn().await;
        skip_wait(pool, job).await;
    }
    let row: (String, String, i32, Option<String>) = sqlx::query_as(
        "SELECT run_state, checkpoint, execution_attempts, last_error_code FROM deletion_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        row,
        (
            "retry_wait".into(),
            "quiescing".into(),
            0,
            Some("waiting".into())
        )
    );
    let one = |sql: &'static str, id: Uuid| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(sql)
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    const LEASE: &str = "SELECT status FROM retrieval_execution_leases WHERE id = $1";
    const FS: &str = "SELECT status FROM knowledge_fs_leases WHERE id = $1";
    const ATTEMPT: &str = "SELECT run_state FROM document_compilation_attempts WHERE id = $1";
    const TASK: &str = "SELECT stage FROM research_task_jobs WHERE id = $1";
    // What holds a live lease is only waited for.
    assert_eq!(
        one(LEASE, live).await,
        "active",
        "a live lease is never reclaimed"
    );
    assert_eq!(one(FS, Uuid::from_u128(1)).await, "active");
    assert_eq!(one(ATTEMPT, running).await, "running");
    assert_eq!(one(TASK, live_task).await, "retrieving");
    // What expired is reclaimed; what is only queued is canceled.
    assert_eq!(
        one(LEASE, stale).await,
        "expired",
        "an expired lease is reclaimed"
    );
    assert_eq!(one(FS, Uuid::from_u128(2)).await, "released");
    assert_eq!(one(ATTEMPT, queued).await, "canceled");
    assert_eq!(
        one(
            "SELECT status FROM document_compilation_outbox WHERE attempt_id = $1",
            queued
        )
        .await,
        "canceled"
    );
    assert_eq!(one(TASK, queued_task).await, "canceled");
    assert_eq!(
        one(
            "SELECT status FROM research_task_outbox WHERE research_task_job_id = $1",
            queued_task
        )
        .await,
        "canceled"
    );
    let (mutation, staged, backfill, syncing): (i64, i64, String, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM knowledge_space_mutation_leases WHERE knowledge_space_id = $1), \
                (SELECT count(*) FROM knowledge_space_staged_commits WHERE knowledge_space_id = $1 AND status <> 'canceled'), \
                (SELECT run_state || ':' || coalesce(last_error_code, '') FROM source_credential_backfills WHERE knowledge_space_id = $1), \
                (SELECT count(*) FROM sources WHERE knowledge_space_id = $1 AND status = 'syncing')",
    )
    .bind(s.id)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(mutation, 0, "the expired mutation lease is reclaimed");
    assert_eq!(staged, 0, "staged commits are canceled");
    assert_eq!(backfill, "failed:DURABLE_DELETION_FENCE");
    assert_eq!(syncing, 0, "syncing sources are disabled");
    // Nothing destructive happened while anything was live.
    assert_eq!(files_under(&fx.dir, &s.prefix), objects);
    let items: i64 =
        sqlx::query_scalar("SELECT count(*) FROM deletion_job_items WHERE deletion_job_id = $1")
            .bind(job)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(items, 0);

    // The holders finish or die: their leases end.
    sqlx::raw_sql(&format!(
        "UPDATE retrieval_execution_leases SET status = 'released', updated_at = now() WHERE id = '{live}'; \
         UPDATE knowledge_fs_leases SET status = 'released', updated_at = now() WHERE id = '{}'; \
         UPDATE document_compilation_attempts SET lease_expires_at = now() - interval '1 second' WHERE id = '{running}'; \
         UPDATE research_task_jobs SET lease_expires_at = {ms} - 1000 WHERE id = '{live_task}';",
        Uuid::from_u128(1)
    ))
    .execute(pool)
    .await
    .unwrap();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    let cat = catalog(pool).await;
    let left = cat.count_owned(pool, Some(s.id), &s.docs).await;
    assert!(left.is_empty(), "{left:?}");
    assert!(files_under(&fx.dir, &s.prefix).is_empty());
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_compile_building_on_a_publication_of_the_deleted_document_is_waited_for_not_deleted() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 0).await;
    let pool = fx.pool();
    let doc = fx
        .add("gone.md", "text/markdown", note(1, "gone").as_bytes())
        .await;
    fx.compile(doc).await;
    // Another document's compile has evaluated its candidate; it only has to publish.
    let other = fx
        .add("other.md", "text/markdown", note(2, "other").as_bytes())
        .await;
    let attempt = fx.request(other, false).await.unwrap();
    let step = fx.engine("w-step", 1);
    fx.drive_to(&step, attempt, "smoke_eval_passed").await;
    let candidate = fx.status(attempt).await.candidate_publication_id.unwrap();

    let job = request(
        pool,
        &target_request(&s, Target::Document { id: doc }, "held"),
    )
    .await
    .unwrap();
    // Its publish completes the candidate over the head that serves `doc`, finds the deletion
    // under way and waits for it: the candidate now holds `doc`'s members.
    assert_eq!(
        fx.slice(&step, attempt).await,
        kfs_worker::consumer::Handled::Ack {
            claim: "claimed",
            end: Some("wait")
        }
    );
    let mut c = conn(pool).await;
    let inherited = publication::members(&mut c, s.id, candidate).await.unwrap();
    drop(c);
    assert!(inherited.iter().any(|m| m.document_asset_id == Some(doc)));
    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    let mut held = false;
    for _ in 0..200 {
        driver.turn().await;
        let (state, cp, why): (String, String, Option<String>) = sqlx::query_as(
            "SELECT run_state, checkpoint, last_error_message FROM deletion_jobs WHERE id = $1",
        )
        .bind(job)
        .fetch_one(pool)
        .await
        .unwrap();
        assert_ne!(
            state, "succeeded",
            "the deletion did not wait for the compile"
        );
        assert_ne!(state, "failed");
        if state == "retry_wait" && cp == "deleting_derived_data" {
            assert!(why.unwrap_or_default().contains("active compile attempt"));
            held = true;
            break;
        }
        skip_wait(pool, job).await;
    }
    assert!(held, "the deletion waits at deleting_derived_data");
    let st = fx.status(attempt).await;
    assert_eq!(
        (st.active_slot, st.run_state.as_str()),
        (Some(1), "retry_wait"),
        "{st:?}"
    );

    // The compile goes on (its wait cut short): it rebases onto the head without `doc` and
    // publishes; then the deletion finishes, and the compile's attempt is still there.
    sqlx::query("UPDATE document_compilation_attempts SET retry_at = now() WHERE id = $1")
        .bind(attempt)
        .execute(pool)
        .await
        .unwrap();
    let st = fx.drive(&fx.engine("w-rest", 64), attempt).await;
    assert_eq!(st.run_state, "succeeded", "{st:?}");
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    assert_eq!(fx.status(attempt).await.run_state, "succeeded");
    assert_eq!(served(pool, &s).await, BTreeSet::from([other]));
    fx.cleanup().await;
}
