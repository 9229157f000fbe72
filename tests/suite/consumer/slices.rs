//! The ends of a slice: a job completes in one slice, a used-up budget requeues it at its
//! checkpoint with the attempt refunded, a retryable error waits for `retry_at`, a fatal one fails
//! the job at once, and retryable errors fail it after its last attempt.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_step_job_completes_in_one_slice_from_a_relayed_message() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            steps: 3,
            ..ProbeSpec::default()
        },
    )
    .await;
    let engine = probe_engine(&env, "worker-3", ConsumerConfig::default());

    assert_eq!(
        deliver(&env, &engine, Kind::Probe).await,
        ack("claimed", Some("succeeded"))
    );
    let j = probe_job(&env.pool, job).await;
    assert_eq!(
        (j.run_state.as_str(), j.checkpoint.as_str()),
        ("succeeded", "done")
    );
    assert_eq!(j.active_slot, None);
    assert!(j.completed);
    assert_eq!(
        (j.worker_id, j.lease_token, j.lease_live, j.heartbeat_set),
        (None, None, None, false),
        "lease cleared"
    );
    assert_eq!((j.last_error_code, j.retry_ms), (None, None));
    assert_eq!(j.execution_attempts, 1);
    let o = probe_outbox(&env.pool, outbox).await;
    assert_eq!(o.status, "completed");
    assert!(o.lock_cleared);
    assert_eq!(
        support::probe_effects(&env.pool, job).await,
        vec![(1, 1), (2, 1), (3, 1)],
        "each step's effect exactly once"
    );
    let tokens: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT lease_token) FROM kfs_probe_effects WHERE job_id = $1",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(tokens, 1, "all under one lease");
    assert_eq!(engine.counters.slices.load(Ordering::Relaxed), 1);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_used_up_slice_budget_requeues_the_job_at_its_checkpoint_with_the_attempt_refunded() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            steps: 3,
            ..ProbeSpec::default()
        },
    )
    .await;
    let cfg = ConsumerConfig {
        budget: Budget {
            max_steps: 1,
            ..Budget::default()
        },
        ..ConsumerConfig::default()
    };
    let engine = probe_engine(&env, "worker-budget", cfg);
    let attempts_before = probe_job(&env.pool, job).await.execution_attempts;

    assert_eq!(
        deliver(&env, &engine, Kind::Probe).await,
        ack("claimed", Some("continue"))
    );
    let j = probe_job(&env.pool, job).await;
    assert_eq!(
        (j.run_state.as_str(), j.checkpoint.as_str()),
        ("queued", "step-1")
    );
    assert_eq!(
        (j.worker_id, j.lease_token, j.heartbeat_set),
        (None, None, false),
        "lease cleared"
    );
    assert_eq!(
        j.execution_attempts, attempts_before,
        "the attempt is refunded"
    );
    assert_eq!(j.active_slot, Some(1));
    let o = probe_outbox(&env.pool, outbox).await;
    assert_eq!(o.status, "pending");
    assert!(o.due, "claimable again at once");
    assert_eq!(o.dispatch_attempts, 0);
    assert!(o.lock_cleared);
    assert_eq!(support::probe_effects(&env.pool, job).await, vec![(1, 1)]);

    // The relay sends it again and the job goes on where it stopped.
    assert_eq!(
        deliver(&env, &engine, Kind::Probe).await,
        ack("claimed", Some("continue"))
    );
    assert_eq!(probe_job(&env.pool, job).await.checkpoint, "step-2");
    assert_eq!(
        deliver(&env, &engine, Kind::Probe).await,
        ack("claimed", Some("succeeded"))
    );
    assert_eq!(
        support::probe_effects(&env.pool, job).await,
        vec![(1, 1), (2, 1), (3, 1)]
    );
    assert_eq!(
        probe_job(&env.pool, job).await.execution_attempts,
        1,
        "three slices, one attempt"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retryable_error_waits_until_retry_at_and_an_early_delivery_only_rearms_the_outbox() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            fail_mode: "retry_once",
            ..ProbeSpec::default()
        },
    )
    .await;
    let engine = probe_engine(&env, "worker-retry", slow_retries());

    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    assert_eq!(process(&engine, &d).await, ack("claimed", Some("wait")));
    let j = probe_job(&env.pool, job).await;
    assert_eq!(j.run_state, "retry_wait");
    assert_eq!(j.retry_at_future, Some(true));
    let delay = j.retry_ms.expect("retry_at set");
    assert!(
        (30_000..=60_000).contains(&delay),
        "first retry waits base·2^0 with jitter: {delay} ms"
    );
    assert_eq!(j.last_error_code.as_deref(), Some("probe_retry"));
    assert_eq!(j.execution_attempts, 1, "a failed attempt is not refunded");
    assert_eq!((j.worker_id, j.lease_token), (None, None));
    assert_eq!(j.active_slot, Some(1));
    let o = probe_outbox(&env.pool, outbox).await;
    assert_eq!(o.status, "pending");
    assert_eq!(o.at_retry_at, Some(true), "outbox available_at = retry_at");
    assert_eq!(o.dispatch_attempts, 0);
    assert!(
        support::probe_effects(&env.pool, job).await.is_empty(),
        "the failed step's writes rolled back"
    );

    // A delivery before retry_at (say the row was republished early) does not run the job; it
    // puts the outbox row back to wait for retry_at.
    let early = dispatch(&env.pool, Kind::Probe, outbox).await;
    let job_before = job_text(&env.pool, job).await;
    assert_eq!(process(&engine, &early).await, ack("stale", None));
    assert_eq!(
        job_text(&env.pool, job).await,
        job_before,
        "the job is untouched"
    );
    let o = probe_outbox(&env.pool, outbox).await;
    assert_eq!(
        (o.status.as_str(), o.at_retry_at, o.dispatch_attempts, o.due),
        ("pending", Some(true), 0, false),
        "re-armed at retry_at"
    );
    assert!(o.lock_cleared);

    // retry_at comes: the next delivery runs and succeeds.
    make_retry_due(&env.pool, job, outbox).await;
    assert_eq!(
        deliver(&env, &engine, Kind::Probe).await,
        ack("claimed", Some("succeeded"))
    );
    let j = probe_job(&env.pool, job).await;
    assert_eq!(
        (j.run_state.as_str(), j.execution_attempts, j.retry_ms),
        ("succeeded", 2, None)
    );
    assert_eq!(j.last_error_code, None, "success clears the last error");
    assert_eq!(support::probe_effects(&env.pool, job).await, vec![(1, 1)]);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_error_fails_the_job_at_once_and_kills_its_outbox_row() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            fail_mode: "fatal",
            ..ProbeSpec::default()
        },
    )
    .await;
    let engine = probe_engine(&env, "worker-fatal", ConsumerConfig::default());
    assert_eq!(
        deliver(&env, &engine, Kind::Probe).await,
        ack("claimed", Some("failed"))
    );
    let j = probe_job(&env.pool, job).await;
    assert_eq!(j.run_state, "failed");
    assert_eq!(j.active_slot, None);
    assert!(j.completed);
    assert_eq!(j.last_error_code.as_deref(), Some("probe_fatal"));
    assert_eq!((j.worker_id, j.lease_token, j.retry_ms), (None, None, None));
    assert_eq!(j.execution_attempts, 1);
    let o = probe_outbox(&env.pool, outbox).await;
    assert_eq!(o.status, "dead");
    assert!(o.lock_cleared);
    assert!(o.last_error.unwrap_or_default().starts_with("probe_fatal"));
    assert!(support::probe_effects(&env.pool, job).await.is_empty());
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_always_hits_retryable_errors_fails_after_its_last_attempt() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            fail_mode: "retry_always",
            max_attempts: 2,
            ..ProbeSpec::default()
        },
    )
    .await;
    let engine = probe_engine(&env, "worker-always", slow_retries());

    assert_eq!(
        deliver(&env, &engine, Kind::Probe).await,
        ack("claimed", Some("wait"))
    );
    assert_eq!(probe_job(&env.pool, job).await.run_state, "retry_wait");
    make_retry_due(&env.pool, job, outbox).await;
    assert_eq!(
        deliver(&env, &engine, Kind::Probe).await,
        ack("claimed", Some("failed"))
    );
    let j = probe_job(&env.pool, job).await;
    assert_eq!(j.run_state, "failed");
    assert_eq!(j.execution_attempts, 2);
    assert_eq!(j.last_error_code.as_deref(), Some("probe_retry"));
    assert!(j
        .last_error_message
        .unwrap_or_default()
        .contains("no attempts left"));
    assert_eq!((j.active_slot, j.retry_ms), (None, None));
    assert!(j.completed);
    assert_eq!(probe_outbox(&env.pool, outbox).await.status, "dead");
    env.cleanup().await;
}
