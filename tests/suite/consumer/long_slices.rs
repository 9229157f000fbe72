//! Slices that outlast a limit: heartbeats keep a long slice alive while the slices hold every pool
//! connection, and a step may stay outside the database for its kind's lease, not the session's
//! idle-in-transaction timeout.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_a_long_slice_alive_when_the_slices_hold_every_pool_connection() {
    let env = TestEnv::new().await;
    // Twelve steps of 300 ms under a 2 s lease: the slice outlives its first lease, and its one
    // pool connection is the pool's only one.
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            steps: 12,
            step_sleep: Duration::from_millis(300),
            ..ProbeSpec::default()
        },
    )
    .await;
    let url = kfs_worker::config::database_url(Some(&env.url)).unwrap();
    let options = kfs_worker::db::session_options(&url, "kfs-worker heartbeat test", None).unwrap();
    let slices = kfs_worker::db::lazy_pool(options.clone(), 1, Duration::from_secs(10));
    let heartbeats = kfs_worker::db::lazy_pool(options, 2, Duration::from_secs(10));
    let mut cfg = ConsumerConfig::default();
    cfg.policies.insert(
        Kind::Probe,
        Policy {
            lease: Duration::from_secs(2),
            ..Kind::Probe.spec().policy
        },
    );
    let engine = Engine::new(
        slices.clone(),
        "worker-hb",
        vec![Arc::new(ProbeHandler)],
        cfg,
    )
    .with_heartbeat_pool(heartbeats.clone());
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let handled = process(&engine, &d).await;
    let after = probe_job(&env.pool, job).await;
    assert_eq!(
        (handled, after.run_state.as_str()),
        (ack("claimed", Some("succeeded")), "succeeded"),
        "the lease ran out while its heartbeats waited for a connection: {after:?}"
    );
    assert_eq!(support::probe_effects(&env.pool, job).await.len(), 12);
    slices.close().await;
    heartbeats.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_may_stay_outside_the_database_for_its_kinds_lease_not_the_sessions_default() {
    let env = TestEnv::new().await;
    // Sessions end a transaction idle for 1 s (as a worker's would under a 1 s shortest lease);
    // this kind's lease is 10 s and its step sleeps 2.5 s with its transaction open.
    let url = kfs_worker::config::database_url(Some(&env.url)).unwrap();
    let pool = kfs_worker::db::connect_with(
        &url,
        "kfs-worker idle test",
        4,
        Duration::from_secs(10),
        Some(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            step_sleep: Duration::from_millis(2500),
            ..ProbeSpec::default()
        },
    )
    .await;
    let mut cfg = ConsumerConfig::default();
    cfg.policies.insert(
        Kind::Probe,
        Policy {
            lease: Duration::from_secs(10),
            ..Kind::Probe.spec().policy
        },
    );
    let engine = Engine::new(
        pool.clone(),
        "worker-idle",
        vec![Arc::new(ProbeHandler)],
        cfg,
    );
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let handled = process(&engine, &d).await;
    let after = probe_job(&env.pool, job).await;
    assert_eq!(
        (handled, after.run_state.as_str()),
        (ack("claimed", Some("succeeded")), "succeeded"),
        "the session's idle-in-transaction timeout ended the step: {after:?}"
    );
    assert_eq!(support::probe_effects(&env.pool, job).await.len(), 1);
    pool.close().await;
    env.cleanup().await;
}
