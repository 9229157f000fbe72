//! Failed publishes: an unroutable row is released with backoff and dead after its last attempt,
//! failing the job; under a live lease it is released, not dead; going dead never waits for a
//! locked job row.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_publish_is_released_with_backoff_and_dead_after_the_last_attempt_failing_the_job(
) {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let topology = unroutable_topology(&env).await;
    let r = Relay::new(
        env.pool.clone(),
        topology.clone(),
        "relay-unroutable",
        RelayConfig {
            max_dispatch_attempts: 3,
            ..cfg()
        },
        &[Kind::Probe],
    );
    let ch = env.confirm_channel().await;

    for attempt in 1..=2 {
        assert_eq!(
            round(&r, &ch, Kind::Probe).await,
            Round {
                claimed: 1,
                dispatched: 0,
                released: 1,
                dead: 0,
                look_again: false
            },
            "attempt {attempt} released"
        );
        let row = outbox_state(&env.pool, outbox).await;
        assert_eq!(row.status, "pending");
        assert!(row.lock_cleared);
        assert_eq!(row.dispatch_attempts, attempt);
        assert!(!row.due, "released with a backoff into the future");
        // attempt n waits within [base·2^(n−1)/2, base·2^(n−1)], base = 600 s.
        let full = 600_000 * (1 << (attempt - 1));
        assert!(
            (full / 2..=full).contains(&row.available_after_update_ms),
            "backoff {} ms for attempt {attempt}",
            row.available_after_update_ms
        );
        assert!(
            row.last_error
                .as_deref()
                .unwrap_or_default()
                .contains("returned"),
            "last_error: {:?}",
            row.last_error
        );
        assert_eq!(
            job_state(&env.pool, job).await.0,
            "dispatch_pending",
            "the job waits"
        );
        // Not due yet: nothing is claimed.
        assert_eq!(round(&r, &ch, Kind::Probe).await, Round::default());
        sqlx::query(
            "UPDATE kfs_probe_outbox SET available_at = now() - interval '1 second' WHERE id = $1",
        )
        .bind(outbox)
        .execute(&env.pool)
        .await
        .unwrap();
    }

    assert_eq!(
        round(&r, &ch, Kind::Probe).await,
        Round {
            claimed: 1,
            dispatched: 0,
            released: 0,
            dead: 1,
            look_again: false
        }
    );
    let row = outbox_state(&env.pool, outbox).await;
    assert_eq!(row.status, "dead");
    assert!(row.lock_cleared);
    assert_eq!(row.dispatch_attempts, 3);
    assert!(row.last_error.unwrap().starts_with("dispatch_exhausted"));
    let (state, code, slot, completed): (String, Option<String>, Option<i32>, bool) = sqlx::query_as(
        "SELECT run_state, last_error_code, active_slot, completed_at IS NOT NULL FROM kfs_probe_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(state, "failed");
    assert_eq!(code.as_deref(), Some("dispatch_exhausted"));
    assert_eq!(slot, None, "a failed probe frees its slot");
    assert!(completed);
    // A dead row is never claimed again.
    sqlx::query(
        "UPDATE kfs_probe_outbox SET available_at = now() - interval '1 second' WHERE id = $1",
    )
    .bind(outbox)
    .execute(&env.pool)
    .await
    .unwrap();
    assert_eq!(round(&r, &ch, Kind::Probe).await, Round::default());
    delete_exchange(&env, &topology).await;
    env.cleanup().await;
}

/// A worker process holding a job under a long lease is killed; the sweep makes its row due
/// for takeover, and that republish cannot be routed on its last allowed dispatch attempt
/// (`KFS_MAX_DISPATCH_ATTEMPTS=1`). The job cannot be failed under the live lease, and a dead
/// row is never published again: so the row is released, not dead, and once routing returns
/// the job is published and runs to the end. Never `running` with a dead outbox row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_that_exhausts_its_dispatch_attempts_under_a_live_lease_is_released_not_dead() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let ch = env.confirm_channel().await;
    assert_eq!(
        round(&relay(&env, "relay-first", cfg()), &ch, Kind::Probe)
            .await
            .dispatched,
        1
    );
    // The holder dies right after its claim committed: the job is `running` under a lease of
    // ten minutes that nobody renews.
    let mut holder = env.spawn_worker(
        "holder",
        &[
            "run",
            "--kinds",
            "probe",
            "--worker-id",
            "holder",
            "--consumer",
        ],
        &[
            ("KFS_CRASH_AT", "after-claim-commit"),
            ("KFS_BATCH_MAX", "1"),
            ("KFS_LEASES", "probe=600s"),
        ],
    );
    let status = holder.exited(HANG).await;
    assert!(
        status.is_some_and(|s| std::os::unix::process::ExitStatusExt::signal(&s).is_some()),
        "the holder must die at its kill point: {status:?}\n{}",
        holder.tail(30)
    );
    assert_eq!(job_state(&env.pool, job).await.0, "running");
    // Nothing brings the message back but the relay: the broker's redelivery is gone.
    drain(&env).await;
    let pool = env.pool.clone();
    let rearmed = env
        .wait_until(HANG, || {
            let pool = pool.clone();
            async move {
                kfs_worker::maintenance::sweep_once(&pool, Kind::Probe)
                    .await
                    .unwrap()
                    == 1
            }
        })
        .await;
    assert!(rearmed, "the sweep never made the dead holder's row due");

    // The takeover's republish comes back unroutable, on its last allowed attempt.
    let topology = unroutable_topology(&env).await;
    let unroutable = Relay::new(
        env.pool.clone(),
        topology.clone(),
        "relay-unroutable",
        RelayConfig {
            max_dispatch_attempts: 1,
            ..cfg()
        },
        &[Kind::Probe],
    );
    let r = round(&unroutable, &ch, Kind::Probe).await;
    let row = outbox_state(&env.pool, outbox).await;
    let (state, _) = job_state(&env.pool, job).await;
    assert!(
        !(state == "running" && row.status == "dead"),
        "the job is left running with a dead outbox row: {r:?}, job {state}, outbox {row:?}"
    );
    assert_eq!(
        (r.dead, r.released, row.status.as_str(), state.as_str()),
        (0, 1, "pending", "running"),
        "released under the live lease: {row:?}"
    );

    // Routing returns: the row is published again and a live worker runs the job to the end.
    sqlx::query("UPDATE kfs_probe_outbox SET available_at = now() WHERE id = $1")
        .bind(outbox)
        .execute(&env.pool)
        .await
        .unwrap();
    let again = round(&relay(&env, "relay-back", cfg()), &ch, Kind::Probe).await;
    assert_eq!(again.dispatched, 1, "{again:?}");
    let mut taker = env.spawn_worker(
        "taker",
        &[
            "run",
            "--kinds",
            "probe",
            "--worker-id",
            "taker",
            "--consumer",
        ],
        &[("KFS_LEASES", "probe=600s")],
    );
    let done = env.wait_probe_succeeded(1, Duration::from_secs(60)).await;
    assert!(
        done,
        "the job never ran again: {}\n{}",
        job_text(&env.pool, job).await,
        taker.tail(30)
    );
    assert_eq!(outbox_state(&env.pool, outbox).await.status, "completed");
    taker.kill();
    delete_exchange(&env, &topology).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_going_dead_does_not_wait_for_its_locked_job_row() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let topology = unroutable_topology(&env).await;
    // A worker stopped in the middle of a step (SIGSTOP) keeps its step transaction, and with it
    // the job row lock, open.
    let mut stalled = PgConnection::connect(&env.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut stalled).await.unwrap();
    sqlx::query("SELECT 1 FROM kfs_probe_jobs WHERE id = $1 FOR UPDATE")
        .bind(job)
        .execute(&mut stalled)
        .await
        .unwrap();

    let r = Relay::new(
        env.pool.clone(),
        topology.clone(),
        "relay-dead-locked",
        RelayConfig {
            max_dispatch_attempts: 1,
            ..cfg()
        },
        &[Kind::Probe],
    );
    let ch = env.confirm_channel().await;
    let got = tokio::time::timeout(Duration::from_secs(10), r.relay_once(&ch, Kind::Probe)).await;
    sqlx::query("ROLLBACK").execute(&mut stalled).await.unwrap();
    let got = got
        .expect("relay_once waited for the job row lock held by a stalled transaction")
        .unwrap();
    assert_eq!(got.claimed, 1);
    // Not waited for: released for a short while instead, and dead on the next round.
    assert_eq!(outbox_state(&env.pool, outbox).await.status, "pending");
    sqlx::query("UPDATE kfs_probe_outbox SET available_at = now() WHERE id = $1")
        .bind(outbox)
        .execute(&env.pool)
        .await
        .unwrap();
    let again = r.relay_once(&ch, Kind::Probe).await.unwrap();
    assert_eq!(again.dead, 1, "{again:?}");
    assert_eq!(outbox_state(&env.pool, outbox).await.status, "dead");
    assert_eq!(job_state(&env.pool, job).await.0, "failed");
    delete_exchange(&env, &topology).await;
    env.cleanup().await;
}
