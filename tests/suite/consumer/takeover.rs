//! A job another worker holds: a live holder's lease makes the delivery a duplicate, a dead
//! holder's job (even one that dies just after the first look) or an expired lease is taken over,
//! and a job on its last attempt is neither taken over nor failed while its lease runs.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_leased_by_a_live_worker_is_a_duplicate_but_a_dead_workers_job_is_taken_over_before_its_lease_expires(
) {
    let env = TestEnv::new().await;
    let url = env.services().database_url;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    // "other-worker" is alive: it holds its liveness lock, and it leased the job.
    let liveness = kfs_worker::liveness::acquire(&url, "other-worker")
        .await
        .expect("liveness lock");
    let (_, conn, theirs) =
        claim_by_hand(&env.pool, &d, "other-worker", Duration::from_secs(600)).await;
    drop(conn);

    // The broker delivers the same message again, to us.
    let engine = probe_engine(&env, "worker-b", ConsumerConfig::default());
    let before = probe_snapshot(&env.pool).await;
    assert_eq!(process(&engine, &d).await, ack("duplicate", None));
    assert_eq!(
        probe_snapshot(&env.pool).await,
        before,
        "a duplicate changes nothing"
    );
    assert_eq!(engine.counters.duplicate.load(Ordering::Relaxed), 1);

    // The other worker's process dies: its session, and with it the lock, is gone.
    liveness.close().await.unwrap();
    let pool = env.pool.clone();
    let gone = env
        .wait_until(HANG, || {
            let pool = pool.clone();
            async move {
                !sqlx::query_scalar::<_, bool>("SELECT kfs_worker_alive('other-worker')")
                    .fetch_one(&pool)
                    .await
                    .unwrap()
            }
        })
        .await;
    assert!(gone, "the lock went away with the session");
    let j = probe_job(&env.pool, job).await;
    assert_eq!(
        (j.lease_live, j.lease_token),
        (Some(true), Some(theirs.lease_token)),
        "the lease itself has not expired"
    );

    assert_eq!(
        process(&engine, &d).await,
        ack("claimed", Some("succeeded")),
        "taken over at once"
    );
    let j = probe_job(&env.pool, job).await;
    assert_eq!(j.run_state, "succeeded");
    assert_eq!(j.execution_attempts, 2);
    let workers: Vec<String> =
        sqlx::query_scalar("SELECT worker_id FROM kfs_probe_effects WHERE job_id = $1")
            .bind(job)
            .fetch_all(&env.pool)
            .await
            .unwrap();
    assert_eq!(workers, vec!["worker-b".to_owned()]);
    env.cleanup().await;
}

/// When a worker process is killed, the broker hands its unacked deliveries to another worker
/// at once, often before Postgres has ended the killed process's liveness session: the first
/// look at the job finds its lease held by a holder that still looks alive. Acked as a
/// duplicate there, the job waited for the maintenance sweep (its grace and period, 2 to 3 s)
/// to be published again. The consumer looks again for `holder_settle` and takes the job over
/// once the holder is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_whose_holder_dies_just_after_the_first_look_is_taken_over_not_acked_as_a_duplicate(
) {
    let env = TestEnv::new().await;
    let url = env.services().database_url;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let holder = "dying-worker#0123abcd";
    let liveness = kfs_worker::liveness::acquire(&url, holder)
        .await
        .expect("liveness lock");
    let (_, conn, _) = claim_by_hand(&env.pool, &d, holder, Duration::from_secs(600)).await;
    drop(conn);

    let engine = probe_engine(
        &env,
        "worker-b",
        ConsumerConfig {
            holder_settle: HANG,
            ..ConsumerConfig::default()
        },
    );
    let delivery = d.clone();
    let mut task = tokio::spawn(async move { process(&engine, &delivery).await });
    // The holder still holds its lock: whatever the consumer decides now, it decides on a lease
    // that looks live.
    if let Ok(done) = tokio::time::timeout(Duration::from_millis(300), &mut task).await {
        panic!(
            "decided while the holder still looked alive: {:?}",
            done.expect("task")
        );
    }
    // The holder's process dies: its session, and with it the lock, is gone.
    liveness.close().await.unwrap();
    let handled = tokio::time::timeout(HANG, task)
        .await
        .expect("process hung")
        .expect("task");
    assert_eq!(handled, ack("claimed", Some("succeeded")), "taken over");
    let j = probe_job(&env.pool, job).await;
    assert_eq!(j.run_state, "succeeded");
    assert_eq!(j.execution_attempts, 2);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_on_its_last_attempt_is_neither_taken_over_nor_failed_while_its_lease_runs() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            max_attempts: 1,
            ..ProbeSpec::default()
        },
    )
    .await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    // The holder took its one attempt; its liveness session is down for a moment (nobody holds
    // its lock), while its lease has ten minutes to run.
    let (_, conn, theirs) =
        claim_by_hand(&env.pool, &d, "blipped-worker", Duration::from_secs(600)).await;
    drop(conn);
    let alive: bool = sqlx::query_scalar("SELECT kfs_worker_alive('blipped-worker')")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert!(!alive, "the holder looks gone");

    let engine = probe_engine(&env, "worker-other", ConsumerConfig::default());
    let before = probe_snapshot(&env.pool).await;
    assert_eq!(
        process(&engine, &d).await,
        ack("duplicate", None),
        "a holder that only looks gone keeps its last attempt"
    );
    assert_eq!(
        probe_snapshot(&env.pool).await,
        before,
        "neither taken over nor failed"
    );
    assert_eq!(
        probe_job(&env.pool, job).await.lease_token,
        Some(theirs.lease_token)
    );

    // Once the lease has run out, the attempt is used up for real.
    sqlx::query(
        "UPDATE kfs_probe_jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1",
    )
    .bind(job)
    .execute(&env.pool)
    .await
    .unwrap();
    assert_eq!(process(&engine, &d).await, ack("exhausted", None));
    let j = probe_job(&env.pool, job).await;
    assert_eq!(
        (j.run_state.as_str(), j.last_error_code.as_deref()),
        ("failed", Some("attempts_exhausted"))
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_is_taken_over_even_while_its_worker_lives() {
    let env = TestEnv::new().await;
    let url = env.services().database_url;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let liveness = kfs_worker::liveness::acquire(&url, "stuck-worker")
        .await
        .expect("liveness lock");
    let (_, conn, _) = claim_by_hand(&env.pool, &d, "stuck-worker", Duration::from_secs(600)).await;
    drop(conn);
    sqlx::query(
        "UPDATE kfs_probe_jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1",
    )
    .bind(job)
    .execute(&env.pool)
    .await
    .unwrap();

    let engine = probe_engine(&env, "worker-c", ConsumerConfig::default());
    assert_eq!(
        process(&engine, &d).await,
        ack("claimed", Some("succeeded"))
    );
    assert_eq!(support::probe_effects(&env.pool, job).await, vec![(1, 1)]);
    liveness.close().await.unwrap();
    env.cleanup().await;
}
