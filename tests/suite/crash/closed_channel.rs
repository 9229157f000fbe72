//! A channel the broker closes under a running consumer is consumed again on the same
//! connection, its refused acks are reported, and every job ends once.

use super::*;

/// The broker closes one kind's channel while its deliveries run (`KFS_CLOSE_CHANNEL_FILE`: the
/// consumer acks a tag its channel never had). The kind is consumed again on a new channel of the
/// same connection, at once; the slices that were running end with their commits, and their
/// acks, which the closed channel can no longer take, are reported as not acked (before, the ack
/// log said `acked` for them: lapin answers `Ok(false)` for a closed channel's delivery); their
/// redelivered copies are recognised as decided; every job ends once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_the_broker_closes_is_consumed_again_on_the_same_connection() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new().await;
    install_claim_log(&env.pool).await;
    let fault = std::env::temp_dir().join(format!("{}-close-channel", env.db_name));
    let fault_path = fault.to_string_lossy().into_owned();
    let mut extra = base_env("probe=10s");
    extra.push(("KFS_CLOSE_CHANNEL_FILE", fault_path.as_str()));
    extra.push(("KFS_PREFETCH", "8"));
    // The closed channel's running slices get this long to end with their commits and report
    // their refused acks: on a loaded machine 5 s was not always enough, and slices past the
    // grace are left to redelivery without an ack to report.
    extra.push(("KFS_SHUTDOWN_GRACE", "30s"));
    extra.push(("KFS_LOG_FORMAT", "json"));
    let mut w = spawn(&env, "closed-channel", &[], &extra);
    // Slow steps: slices are running when the channel goes.
    let spec = probe_spec(4, 250);
    probe::enqueue_many(&env.pool, JOBS, &spec).await.unwrap();
    let running = env
        .wait_until(Duration::from_secs(30), || async {
            count(
                &env.pool,
                "SELECT count(*) FROM kfs_probe_jobs WHERE run_state = 'running'",
            )
            .await
                >= 3
        })
        .await;
    assert!(running, "no slices running\n{}", w.tail(30));
    std::fs::write(&fault, "probe").unwrap();
    let restarted = env
        .wait_until(Duration::from_secs(15), || async {
            w.log_text()
                .contains("a consumer stopped; consuming its queue again on a new channel")
        })
        .await;
    assert!(
        restarted,
        "the kind was not consumed again after its channel closed\n{}",
        w.tail(30)
    );
    let done = env
        .wait_probe_succeeded(JOBS, Duration::from_secs(60))
        .await;
    assert!(
        done,
        "the jobs did not all succeed after the channel closed: {:?}\n{}",
        support::probe_states(&env.pool).await,
        w.tail(30)
    );
    let depths = wait_queues_drained(&env, Duration::from_secs(15)).await;
    assert_eq!(depths, (0, 0), "queues not drained\n{}", w.tail(30));
    let queue = env.topology.queue(Kind::Probe);
    assert_eq!(env.queue_consumers(&queue).await, 1, "{}", w.tail(30));
    support::stop_cleanly([&mut w], Duration::from_secs(30)).await;

    let log = w.log_text();
    assert!(!fault.exists(), "the fault was never taken");
    assert_eq!(
        log.matches("fault injection: acking a delivery tag")
            .count(),
        1,
        "the fault is played once\n{}",
        w.tail(30)
    );
    assert!(
        !log.contains("a consumer stopped; reconnecting"),
        "the connection was given up for one channel\n{}",
        w.tail(30)
    );
    assert!(
        log.contains("not acked: the channel is gone"),
        "no slice that ran across the close had its ack refused (the log claims them acked)\n{}",
        w.tail(30)
    );
    assert_history(&env.pool).await;
    let _ = std::fs::remove_file(&fault);
    env.cleanup().await;
}
