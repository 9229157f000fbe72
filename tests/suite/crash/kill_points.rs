//! One test per kill point of the engine: a worker aborted there is taken over at once (long
//! before its lease ends), no job is lost, and the history holds.

use std::os::unix::process::ExitStatusExt;

use super::*;

/// Long on purpose: finishing within seconds proves the takeover did not wait for the lease.
const LONG_LEASE: &str = "probe=60s";
/// Every job A held is taken over within this of its death: half the lease, so a takeover that
/// waited for the lease (renewed by A's heartbeats until it died) could not meet it.
const TAKEOVER_BOUND: Duration = Duration::from_secs(30);

/// Kills worker A at `point`, lets a fresh worker B finish the work, and checks the history.
///
/// Consumer points: A runs every role and aborts at the point; B (every role) starts after A
/// is dead. Relay points: A runs only the relay and aborts at the point while consumer C runs
/// beside it without kill points; B replaces the relay (with maintenance) after A is dead.
///
/// Takeover time printed:
/// - consumer points: for each job A held a live lease on when it died (read from
///   `kfs_probe_jobs` right after A's exit was seen, nobody else running), the time from A's
///   death (database clock, read as soon as the test saw the exit, 20 ms polling) to B's claim
///   of that job (the claim log, database clock). It includes B's process start, since B only
///   starts once A is dead.
/// - relay points: the outbox rows A left `dispatching` under its lock; the time from A's death
///   to the next claim of each of their jobs (by C, from the messages A published before it
///   died, or after B republished them).
async fn kill_point(point: &'static str) {
    let _serial = SERIAL.lock().await;
    let relay_point = matches!(
        point,
        "after-publish-before-mark" | "after-mark-before-confirm-wait"
    );
    let env = TestEnv::new().await;
    install_claim_log(&env.pool).await;
    let spec = probe_spec(3, 50);
    probe::enqueue_many(&env.pool, JOBS, &spec).await.unwrap();

    let mut crash_env = base_env(LONG_LEASE);
    crash_env.push(("KFS_CRASH_AT", point));
    // These points are on the one-delivery path; batches of one keep every delivery on it
    // (the group path has its own points).
    if matches!(point, "after-claim-commit" | "before-ack") {
        crash_env.push(("KFS_BATCH_MAX", "1"));
    }
    let mut others: Vec<Worker> = Vec::new();
    let mut a = if relay_point {
        others.push(spawn(&env, "c", &["--consumer"], &base_env(LONG_LEASE)));
        spawn(&env, "a", &["--relay"], &crash_env)
    } else {
        spawn(&env, "a", &[], &crash_env)
    };

    // Wait for A to abort. A point that needs a particular interleaving (two confirm chunks in
    // one relay round) may take more than one round: keep feeding jobs until it fires.
    let started = Instant::now();
    let mut jobs = JOBS;
    let status = loop {
        if let Some(s) = a.exited(Duration::from_millis(1500)).await {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "A never reached {point}\n{}",
            a.tail(30)
        );
        probe::enqueue_many(&env.pool, JOBS, &spec).await.unwrap();
        jobs += JOBS;
    };
    let death = db_now(&env.pool).await;
    let log = a.log_text();
    assert!(
        status.signal().is_some(),
        "A must die by a signal (abort), got {status:?}\n{}",
        a.tail(30)
    );
    assert!(
        log.contains(&format!("crash point {point} reached")),
        "A's log lacks the crash point\n{}",
        a.tail(30)
    );

    // What A left behind. Consumer points: nothing else runs, so this is the state at A's
    // death. Relay points: the rows still `dispatching` under A's lock (C keeps consuming).
    let held: Vec<Uuid> = if relay_point {
        sqlx::query_scalar("SELECT probe_job_id FROM kfs_probe_outbox WHERE status = 'dispatching' AND locked_by = 'a'")
            .fetch_all(&env.pool)
            .await
            .unwrap()
    } else {
        held_by(&env.pool, "a", death)
            .await
            .into_iter()
            .map(|(j, _)| j)
            .collect()
    };
    let effects_by_a = count(
        &env.pool,
        "SELECT count(*) FROM kfs_probe_effects WHERE split_part(worker_id, '#', 1) = 'a'",
    )
    .await;

    let b = if relay_point {
        spawn(
            &env,
            "b",
            &["--relay", "--maintenance"],
            &base_env(LONG_LEASE),
        )
    } else {
        spawn(&env, "b", &[], &base_env(LONG_LEASE))
    };
    others.push(b);
    let done = wait_all_terminal(&env, Duration::from_secs(90)).await;
    let finished_ms = ms(db_now(&env.pool).await - death);
    let logs: String = others
        .iter()
        .map(|w| w.tail(40))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        done,
        "not every job is terminal 90 s after A died: {:?}\n{logs}",
        support::probe_states(&env.pool).await
    );

    let depths = wait_queues_drained(&env, Duration::from_secs(15)).await;
    support::stop_cleanly(&mut others, Duration::from_secs(20)).await;
    assert_eq!(
        depths,
        (0, 0),
        "probe queue / dead-letter queue not drained while B ran"
    );
    let depths = wait_queues_drained(&env, Duration::from_secs(5)).await;
    assert_eq!(
        depths,
        (0, 0),
        "messages came back to the queues after the workers stopped"
    );

    assert_history(&env.pool).await;
    assert_no_overlap(&env.pool, "a", "b").await;
    let n = count(
        &env.pool,
        "SELECT count(*) FROM kfs_probe_jobs WHERE run_state = 'succeeded'",
    )
    .await;
    assert_eq!(n, jobs, "jobs lost");

    // Consumer points: nobody else ran before A died, so the next claim is the first after the
    // death. Relay points: C consumes while A dies, and a claim C made just before the death
    // may commit only after the rows were read; such a job's one claim counts as 0 ms.
    let since = if relay_point {
        death - chrono::TimeDelta::seconds(3600)
    } else {
        death
    };
    let mut takeovers: Vec<f64> = next_claims(&env.pool, &held, since)
        .await
        .into_iter()
        .map(|t| t.expect("a held job was never claimed again"))
        .map(|t| {
            if relay_point {
                (t - ms(death - since)).max(0.0)
            } else {
                t
            }
        })
        .collect();
    let taken = takeovers.len();
    let (med, max) = (
        median(&mut takeovers),
        takeovers.iter().copied().fold(f64::NAN, f64::max),
    );
    println!(
        "[crash {point}] jobs={jobs} a_effects={effects_by_a} held_at_death={taken} \
         takeover_ms(median={med:.0}, max={max:.0}) all_terminal_after_ms={finished_ms:.0} (lease {LONG_LEASE})"
    );
    let late: Vec<f64> = takeovers
        .iter()
        .copied()
        .filter(|t| *t >= TAKEOVER_BOUND.as_secs_f64() * 1000.0)
        .collect();
    assert!(
        late.is_empty(),
        "[crash {point}] {} of {taken} jobs A held were taken over only {late:?} ms after its \
         death, not within {TAKEOVER_BOUND:?}: as if the takeover waited for the lease ({LONG_LEASE})",
        late.len()
    );
    drop(a);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_claim_commit() {
    kill_point("after-claim-commit").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_step_commit() {
    kill_point("after-step-commit").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_before_ack() {
    kill_point("before-ack").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_a_group_claim_commit() {
    kill_point("after-group-claim-commit").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_a_group_step_commit() {
    kill_point("after-group-step-commit").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_before_a_multiple_ack() {
    kill_point("before-multi-ack").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_publish_before_mark() {
    kill_point("after-publish-before-mark").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_mark_before_confirm_wait() {
    kill_point("after-mark-before-confirm-wait").await;
}
