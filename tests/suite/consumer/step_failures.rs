//! Steps the database refuses: a failure is acked only once it is written, a checkpoint write that
//! breaks a constraint fails the job instead of looping, and a statement cancelled mid-flight is
//! retried and the job succeeds once.

use super::*;

/// A probe handler whose checkpoint does not fit the column: the checkpoint write fails with a
/// non-retryable error (22001) every time.
struct OverlongCheckpoint;

#[async_trait::async_trait]
impl Handler for OverlongCheckpoint {
    fn kind(&self) -> Kind {
        Kind::Probe
    }

    async fn step(&self, _tx: &mut PgConnection, _job: &JobCtx) -> Result<Step, JobError> {
        Ok(Step::Advance("x".repeat(40)))
    }
}

/// A step the database refuses, whose failure record fails `failures_left` times first.
struct RefusedThenFailureFails {
    failures_left: std::sync::atomic::AtomicI32,
}

#[async_trait::async_trait]
impl Handler for RefusedThenFailureFails {
    fn kind(&self) -> Kind {
        Kind::Probe
    }

    async fn step(&self, _tx: &mut PgConnection, _job: &JobCtx) -> Result<Step, JobError> {
        Ok(Step::Advance("x".repeat(40)))
    }

    async fn on_fail(
        &self,
        _tx: &mut PgConnection,
        _job: &JobCtx,
        _code: &str,
    ) -> Result<(), sqlx::Error> {
        if self.failures_left.fetch_sub(1, Ordering::SeqCst) > 0 {
            return Err(sqlx::Error::Protocol(
                "the failure record was not written".into(),
            ));
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_that_cannot_be_written_at_once_is_retried_and_only_then_acked() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let engine = Engine::new(
        env.pool.clone(),
        "worker-failure-once",
        vec![Arc::new(RefusedThenFailureFails {
            failures_left: 1.into(),
        })],
        ConsumerConfig::default(),
    );
    let handled = process(&engine, &d).await;
    let after = probe_job(&env.pool, job).await;
    // The ack (the handled value) comes only with the failure committed.
    assert_eq!(
        (handled, after.run_state.as_str()),
        (ack("claimed", Some("failed")), "failed"),
        "{after:?}"
    );
    assert_eq!(probe_outbox(&env.pool, outbox).await.status, "dead");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_that_cannot_be_written_is_never_acked() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let engine = Engine::new(
        env.pool.clone(),
        "worker-failure-never",
        vec![Arc::new(RefusedThenFailureFails {
            failures_left: i32::MAX.into(),
        })],
        ConsumerConfig::default(),
    );
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { engine.process_ref(&d, &shutdown).await }
    });
    // While the failure cannot be written, the delivery is not settled.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!run.is_finished(), "settled without the failure's commit");
    shutdown.cancel();
    let handled = tokio::time::timeout(HANG, run)
        .await
        .expect("hung")
        .unwrap();
    assert_eq!(handled, Handled::Abandon, "left unacked for redelivery");
    assert_eq!(probe_job(&env.pool, job).await.run_state, "running");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_whose_checkpoint_write_breaks_a_constraint_fails_the_job_instead_of_looping() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            steps: 3,
            ..ProbeSpec::default()
        },
    )
    .await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let engine = Engine::new(
        env.pool.clone(),
        "worker-bad-step",
        vec![Arc::new(OverlongCheckpoint)],
        ConsumerConfig::default(),
    );
    let handled = tokio::time::timeout(
        Duration::from_secs(15),
        engine.process_ref(&d, &CancellationToken::new()),
    )
    .await;
    let handled = handled.expect(
        "the slice never ended: the failing step is re-run in a loop, the delivery is never acked",
    );
    assert_eq!(handled, ack("claimed", Some("failed")));
    assert_eq!(probe_job(&env.pool, job).await.run_state, "failed");
    assert_eq!(probe_outbox(&env.pool, outbox).await.status, "dead");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_statement_cancelled_mid_flight_is_retried_and_the_job_succeeds_once() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    // Hold the table the step writes, so that its statement is certainly in flight.
    let mut holder = env.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE kfs_probe_effects IN EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let engine = Arc::new(probe_engine(&env, "worker-cancelled", slow_retries()));
    let run = tokio::spawn({
        let engine = engine.clone();
        let d = d.clone();
        async move { engine.process_ref(&d, &CancellationToken::new()).await }
    });
    let mut cancelled = false;
    for _ in 0..200 {
        cancelled = sqlx::query_scalar(
            "SELECT coalesce(bool_or(pg_cancel_backend(pid)), false) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() \
               AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO kfs_probe_effects%'",
        )
        .fetch_one(&env.pool)
        .await
        .unwrap();
        if cancelled {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(cancelled, "the step's statement never waited on the lock");
    holder.rollback().await.unwrap();
    let handled = tokio::time::timeout(HANG, run)
        .await
        .expect("slice hung")
        .unwrap();
    let after = probe_job(&env.pool, job).await;
    assert_eq!(
        (
            handled,
            after.run_state.as_str(),
            after.last_error_code.as_deref()
        ),
        (
            ack("claimed", Some("wait")),
            "retry_wait",
            Some("db_unavailable")
        ),
        "a cancelled statement (57014) is retried, not a refusal of the step: {after:?}"
    );
    make_retry_due(&env.pool, job, outbox).await;
    let again = dispatch(&env.pool, Kind::Probe, outbox).await;
    assert_eq!(
        process(&engine, &again).await,
        ack("claimed", Some("succeeded"))
    );
    assert_eq!(probe_job(&env.pool, job).await.run_state, "succeeded");
    assert_eq!(
        support::probe_effects(&env.pool, job).await.len(),
        1,
        "the step's effect, once"
    );
    env.cleanup().await;
}
