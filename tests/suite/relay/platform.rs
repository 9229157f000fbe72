//! The platform's own tables are relayed in their own time type and state model, and dispatch
//! exhaustion fails each platform job by its table's rules.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn platform_rows_are_relayed_in_their_own_time_type_and_state_model() {
    let env = TestEnv::new().await;
    let (attempt, deletion, research) = platform_jobs(&env.pool).await;
    let r = Relay::new(
        env.pool.clone(),
        env.topology.clone(),
        "relay-platform",
        cfg(),
        &Kind::platform(),
    );
    let ch = env.confirm_channel().await;
    for kind in Kind::platform() {
        assert_eq!(
            round(&r, &ch, kind).await,
            Round {
                claimed: 1,
                dispatched: 1,
                released: 0,
                dead: 0,
                look_again: false
            },
            "{kind}"
        );
    }

    for (kind, job) in [(Kind::Compile, attempt), (Kind::Deletion, deletion)] {
        let spec = kind.spec();
        let (state, rv): (String, i32) =
            sqlx::query_as(&spec.sql("SELECT run_state, row_version FROM {job} WHERE id = $1"))
                .bind(job)
                .fetch_one(&env.pool)
                .await
                .unwrap();
        let start = if kind == Kind::Compile { 0 } else { 1 };
        assert_eq!(
            (state.as_str(), rv),
            ("queued", start + 1),
            "{kind}: dispatch_pending -> queued"
        );
        let (status, window): (String, f64) = sqlx::query_as(&spec.sql(
            "SELECT status, extract(epoch FROM available_at - updated_at)::float8 FROM {outbox} WHERE {fk} = $1",
        ))
        .bind(job)
        .fetch_one(&env.pool)
        .await
        .unwrap();
        assert_eq!((status.as_str(), window), ("dispatched", 300.0), "{kind}");
    }
    // Research: no run_state; the stage stays, the row version too; times are epoch ms.
    let (stage, rv): (String, i32) =
        sqlx::query_as("SELECT stage, row_version FROM research_task_jobs WHERE id = $1")
            .bind(research)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!((stage.as_str(), rv), ("queued", 1));
    let (status, window, available_at): (String, i64, i64) = sqlx::query_as(
        "SELECT status, available_at - updated_at, available_at FROM research_task_outbox WHERE research_task_job_id = $1",
    )
    .bind(research)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        (status.as_str(), window),
        ("dispatched", 300_000),
        "visibility in milliseconds"
    );
    assert!(
        (1_000_000_000_000..100_000_000_000_000).contains(&available_at),
        "epoch milliseconds: {available_at}"
    );

    for (kind, job, field) in [
        (Kind::Compile, attempt, "attemptId"),
        (Kind::Deletion, deletion, "deletionJobId"),
        (Kind::Research, research, "researchTaskJobId"),
    ] {
        let msgs = drain_queue(&env, &env.topology.queue(kind)).await;
        assert_eq!(msgs.len(), 1, "{kind}");
        let p = &msgs[0].properties;
        assert_eq!(
            p.kind().as_ref().map(|s| s.to_string()).as_deref(),
            Some(kind.event_type())
        );
        assert_eq!(
            p.correlation_id().as_ref().map(|s| s.to_string()),
            Some(job.to_string())
        );
        let h = p.headers().as_ref().unwrap();
        assert_eq!(int_header(h, "x-kfs-delivery-revision"), Some(1));
        let body: serde_json::Value = serde_json::from_slice(&msgs[0].data).unwrap();
        assert_eq!(body[field], job.to_string());
    }
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatch_exhaustion_fails_each_platform_job_by_its_tables_rules() {
    let env = TestEnv::new().await;
    let (attempt, deletion, research) = platform_jobs(&env.pool).await;
    let topology = unroutable_topology(&env).await;
    let r = Relay::new(
        env.pool.clone(),
        topology.clone(),
        "relay-platform-dead",
        RelayConfig {
            max_dispatch_attempts: 1,
            ..cfg()
        },
        &Kind::platform(),
    );
    let ch = env.confirm_channel().await;
    for kind in Kind::platform() {
        assert_eq!(
            round(&r, &ch, kind).await,
            Round {
                claimed: 1,
                dispatched: 0,
                released: 0,
                dead: 1,
                look_again: false
            },
            "{kind}"
        );
        let status: String = sqlx::query_scalar(&kind.spec().sql("SELECT status FROM {outbox}"))
            .fetch_one(&env.pool)
            .await
            .unwrap();
        assert_eq!(status, "dead", "{kind}");
    }

    // A failed compile attempt frees its slot and is complete.
    let row: (String, Option<i32>, bool, Option<String>, bool) = sqlx::query_as(
        "SELECT run_state, active_slot, completed_at IS NOT NULL, last_error_code, lease_token IS NULL \
         FROM document_compilation_attempts WHERE id = $1",
    )
    .bind(attempt)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        row,
        (
            "failed".into(),
            None,
            true,
            Some("dispatch_exhausted".into()),
            true
        )
    );
    // A failed deletion keeps its slot and is not complete: it waits for a manual retry.
    let row: (String, Option<i32>, bool, Option<String>, String) = sqlx::query_as(
        "SELECT run_state, active_slot, completed_at IS NULL, last_error_code, checkpoint FROM deletion_jobs WHERE id = $1",
    )
    .bind(deletion)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        row,
        (
            "failed".into(),
            Some(1),
            true,
            Some("dispatch_exhausted".into()),
            "requested".into()
        )
    );
    // A failed research task: stage failed, completed_at in epoch ms, the code in `error`.
    let (stage, completed_at, error, now_ms): (String, Option<i64>, Option<String>, i64) = sqlx::query_as(
        "SELECT stage, completed_at, error, (extract(epoch FROM now()) * 1000)::bigint FROM research_task_jobs WHERE id = $1",
    )
    .bind(research)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(stage, "failed");
    let completed_at = completed_at.expect("completed_at set");
    assert!(
        completed_at <= now_ms && completed_at > now_ms - 3_600_000,
        "completed_at {completed_at} is epoch ms near {now_ms}"
    );
    assert!(error.unwrap_or_default().starts_with("dispatch_exhausted"));
    // As every failure, the relay's records the kind's failure: research's failed event.
    let events: Vec<(String, String, serde_json::Value)> = sqlx::query_as(
        "SELECT event_type, stage, payload FROM research_task_progress_events \
         WHERE research_task_job_id = $1 ORDER BY sequence",
    )
    .bind(research)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        events,
        vec![(
            "research_task.failed".to_owned(),
            "failed".to_owned(),
            serde_json::json!({"error": "dispatch_exhausted"})
        )],
        "the failed event, and no claim event: nothing claimed the task"
    );
    delete_exchange(&env, &topology).await;
    env.cleanup().await;
}
