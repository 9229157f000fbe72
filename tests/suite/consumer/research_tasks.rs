//! Research tasks on the platform's table: bigint millisecond times through lease, retry,
//! completion and failure; a paused task is not run, and a terminal one is acked as terminal.

use super::*;

#[derive(Debug, sqlx::FromRow)]
struct ResearchRow {
    stage: String,
    row_version: i32,
    execution_attempts: i32,
    lease_token: Option<Uuid>,
    worker_id: Option<String>,
    lease_expires_at: Option<i64>,
    heartbeat_at: Option<i64>,
    retry_at: Option<i64>,
    completed_at: Option<i64>,
    created_at: i64,
    updated_at: i64,
    error: Option<String>,
    now_ms: i64,
}

async fn research_row(pool: &PgPool, job: Uuid) -> ResearchRow {
    sqlx::query_as(
        "SELECT stage, row_version, execution_attempts, lease_token, worker_id, lease_expires_at, heartbeat_at, retry_at, \
           completed_at, created_at, updated_at, error, (extract(epoch FROM now()) * 1000)::bigint AS now_ms \
         FROM research_task_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// (status, available_at) of a research outbox row.
async fn research_outbox(pool: &PgPool, outbox: Uuid) -> (String, i64) {
    sqlx::query_as("SELECT status, available_at FROM research_task_outbox WHERE id = $1")
        .bind(outbox)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Epoch milliseconds, not seconds or microseconds.
fn assert_epoch_ms(what: &str, v: i64) {
    assert!(
        (1_000_000_000_000..100_000_000_000_000).contains(&v),
        "{what} = {v} is not epoch milliseconds"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_research_task_keeps_bigint_millisecond_times_through_lease_retry_and_completion() {
    let env = TestEnv::new().await;
    let space = space(&env.pool).await;
    let (job, outbox) = insert_research(&env.pool, space).await;
    let st = Statements::new(Kind::Research.spec());

    // Claim: the lease in epoch ms, the stage unchanged.
    let d = dispatch(&env.pool, Kind::Research, outbox).await;
    let mut conn = env.pool.acquire().await.unwrap();
    let ctx = claimed(
        lease::claim(
            &mut conn,
            &st,
            &d,
            "worker-research-claim",
            Duration::from_secs(30),
        )
        .await
        .unwrap(),
    );
    let r = research_row(&env.pool, job).await;
    assert_eq!(
        (r.stage.as_str(), r.execution_attempts, r.row_version),
        ("queued", 1, 2)
    );
    assert_eq!(r.lease_token, Some(ctx.lease_token));
    let (expires, beat) = (r.lease_expires_at.unwrap(), r.heartbeat_at.unwrap());
    assert_epoch_ms("lease_expires_at", expires);
    assert_eq!(expires - beat, 30_000, "a 30 s lease in milliseconds");
    assert!(expires > r.now_ms);
    assert_eq!(
        research_outbox(&env.pool, outbox).await,
        ("leased".into(), expires),
        "outbox available_at = lease_expires_at"
    );
    // Heartbeat: both move by the lease, in ms, without a row_version bump.
    assert!(
        lease::heartbeat(&mut conn, &st, &ctx, Duration::from_secs(600))
            .await
            .unwrap()
    );
    let r = research_row(&env.pool, job).await;
    assert_eq!(
        r.lease_expires_at.unwrap() - r.heartbeat_at.unwrap(),
        600_000
    );
    assert_eq!(r.row_version, 2);
    assert_eq!(
        research_outbox(&env.pool, outbox).await.1,
        r.lease_expires_at.unwrap()
    );
    // Give the job back (as a used-up slice budget would): the attempt is refunded.
    assert!(lease::end(&mut conn, &st, &ctx, &End::Continue)
        .await
        .unwrap());
    drop(conn);
    let r = research_row(&env.pool, job).await;
    assert_eq!(
        (
            r.stage.as_str(),
            r.execution_attempts,
            r.lease_token,
            r.worker_id,
            r.lease_expires_at,
            r.heartbeat_at
        ),
        ("queued", 0, None, None, None, None)
    );

    // A retryable error on the first attempt: retry_at in ms, the outbox waits for it.
    let engine = Engine::new(
        env.pool.clone(),
        "worker-research",
        vec![Arc::new(ResearchWalk {
            retry_once_at: Some("retrieving"),
            fail_at: None,
        })],
        slow_retries(),
    );
    assert_eq!(
        deliver(&env, &engine, Kind::Research).await,
        ack("claimed", Some("wait"))
    );
    let r = research_row(&env.pool, job).await;
    assert_eq!(
        r.stage, "retrieving",
        "the stage is the checkpoint; it stays where the error hit"
    );
    let retry_at = r.retry_at.expect("retry_at");
    assert_epoch_ms("retry_at", retry_at);
    assert!(
        (30_000..=60_000).contains(&(retry_at - r.updated_at)),
        "first retry after 30..60 s: {} ms",
        retry_at - r.updated_at
    );
    assert!(retry_at > r.now_ms);
    assert_eq!(r.lease_token, None);
    assert!(r
        .error
        .unwrap_or_default()
        .starts_with("retrieval_unavailable"));
    assert_eq!(
        research_outbox(&env.pool, outbox).await,
        ("pending".into(), retry_at),
        "outbox available_at = retry_at"
    );

    // retry_at comes.
    let past = r.now_ms - 1_000;
    sqlx::query("UPDATE research_task_jobs SET retry_at = $2 WHERE id = $1")
        .bind(job)
        .bind(past)
        .execute(&env.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE research_task_outbox SET available_at = $2 WHERE id = $1")
        .bind(outbox)
        .bind(past)
        .execute(&env.pool)
        .await
        .unwrap();
    assert_eq!(
        deliver(&env, &engine, Kind::Research).await,
        ack("claimed", Some("succeeded"))
    );
    let r = research_row(&env.pool, job).await;
    assert_eq!(r.stage, "completed");
    assert_eq!(r.execution_attempts, 2);
    let completed_at = r.completed_at.expect("completed_at");
    assert_epoch_ms("completed_at", completed_at);
    assert!(r.created_at <= completed_at && completed_at <= r.now_ms);
    assert_eq!(
        (
            r.lease_token,
            r.worker_id,
            r.lease_expires_at,
            r.heartbeat_at,
            r.retry_at
        ),
        (None, None, None, None, None)
    );
    assert_eq!(r.error, None);
    assert_eq!(research_outbox(&env.pool, outbox).await.0, "completed");
    // One progress event per stage change, sequences contiguous from the `started` event.
    let events: Vec<(i32, String, String)> = sqlx::query_as(
        "SELECT sequence, event_type, stage FROM research_task_progress_events WHERE research_task_job_id = $1 ORDER BY sequence",
    )
    .bind(job)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let stages: Vec<&str> = events.iter().map(|e| e.2.as_str()).collect();
    assert_eq!(
        stages,
        [
            "queued",
            "planning",
            "retrieving",
            "analyzing",
            "generating",
            "completed"
        ]
    );
    assert!(
        events.iter().enumerate().all(|(i, e)| e.0 == i as i32 + 1),
        "contiguous: {events:?}"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_research_task_ends_failed_with_a_millisecond_completion_time() {
    let env = TestEnv::new().await;
    let space = space(&env.pool).await;
    let (job, outbox) = insert_research(&env.pool, space).await;
    let engine = platform_engine(
        &env,
        "worker-research-fail",
        Some("analyzing"),
        ConsumerConfig::default(),
    );

    assert_eq!(
        deliver(&env, &engine, Kind::Research).await,
        ack("claimed", Some("failed"))
    );
    let r = research_row(&env.pool, job).await;
    assert_eq!(r.stage, "failed");
    let completed_at = r.completed_at.expect("completed_at");
    assert_epoch_ms("completed_at", completed_at);
    assert!(r.created_at <= completed_at && completed_at <= r.now_ms);
    assert_eq!((r.lease_token, r.lease_expires_at), (None, None));
    assert!(r.error.unwrap_or_default().starts_with("research_broken: "));
    assert_eq!(research_outbox(&env.pool, outbox).await.0, "dead");
    // The stages it went through before failing are recorded, then the failure itself.
    let last: Vec<(String, String, serde_json::Value)> = sqlx::query_as(
        "SELECT event_type, stage, payload FROM research_task_progress_events WHERE research_task_job_id = $1 \
         ORDER BY sequence DESC LIMIT 2",
    )
    .bind(job)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(last[1].1, "analyzing", "{last:?}");
    assert_eq!(
        last[0],
        (
            "research_task.failed".to_owned(),
            "failed".to_owned(),
            serde_json::json!({"error": "research_broken"})
        )
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_research_task_is_not_run_and_a_terminal_one_is_acked_as_terminal() {
    let env = TestEnv::new().await;
    let space = space(&env.pool).await;
    let engine = platform_engine(
        &env,
        "worker-research-pause",
        None,
        ConsumerConfig::default(),
    );
    let snapshot = |pool: PgPool| async move {
        sqlx::query_scalar::<_, String>(
            "SELECT concat_ws(E'\\n', (SELECT string_agg(j::text, E'\\n' ORDER BY id) FROM research_task_jobs j), \
               (SELECT string_agg(o::text, E'\\n' ORDER BY id) FROM research_task_outbox o), \
               (SELECT string_agg(e::text, E'\\n' ORDER BY id) FROM research_task_progress_events e))",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };

    let (paused, paused_outbox) = insert_research(&env.pool, space).await;
    let d = dispatch(&env.pool, Kind::Research, paused_outbox).await;
    sqlx::query("UPDATE research_task_jobs SET stage = 'paused', paused_from_stage = 'queued', row_version = row_version + 1 WHERE id = $1")
        .bind(paused)
        .execute(&env.pool)
        .await
        .unwrap();
    let before = snapshot(env.pool.clone()).await;
    assert_eq!(process(&engine, &d).await, ack("stale", None), "paused");
    assert_eq!(snapshot(env.pool.clone()).await, before);

    let (done, done_outbox) = insert_research(&env.pool, space).await;
    let d = dispatch(&env.pool, Kind::Research, done_outbox).await;
    sqlx::query(
        "UPDATE research_task_jobs SET stage = 'canceled', completed_at = (extract(epoch FROM now()) * 1000)::bigint, \
           row_version = row_version + 1 WHERE id = $1",
    )
    .bind(done)
    .execute(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        process(&engine, &d).await,
        ack("terminal", None),
        "canceled"
    );
    // Its row, still out for delivery, is settled to match, and nothing else changes.
    assert_eq!(research_outbox(&env.pool, done_outbox).await.0, "canceled");
    let before = snapshot(env.pool.clone()).await;
    assert_eq!(process(&engine, &d).await, ack("stale", None), "again");
    assert_eq!(snapshot(env.pool.clone()).await, before);
    env.cleanup().await;
}
