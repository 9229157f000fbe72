//! A worker's log: no error in a clean stop by SIGTERM, no colour codes in a file.

use super::*;

/// A worker stopped by SIGTERM closes its channels and connections in order: an operator who
/// reads the log of a clean rolling restart should find no error in it. Each consumer channel
/// used to be closed in the background as it was dropped, racing the connection's close, and
/// lapin logged the lost race as a connection error in most stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stopped_by_sigterm_logs_no_error() {
    let env = TestEnv::new().await;
    probe::enqueue_many(&env.pool, 50, &ProbeSpec::default())
        .await
        .unwrap();
    let mut w = env.spawn_worker(
        "stop",
        &["run", "--kinds", "probe", "--worker-id", "stop"],
        &[],
    );
    let done = env.wait_probe_succeeded(50, Duration::from_secs(60)).await;
    assert!(done, "{}", w.tail(20));
    support::stop_cleanly([&mut w], Duration::from_secs(30)).await;
    let log = w.log_text();
    assert!(log.contains("shutdown requested"), "{}", w.tail(20));
    let errors: Vec<&str> = log.lines().filter(|l| l.contains(" ERROR ")).collect();
    assert!(
        errors.is_empty(),
        "errors in a clean stop:\n{}",
        errors.join("\n")
    );
    env.cleanup().await;
}

/// A log read from a file, journald or a container runtime must be plain text: colour codes
/// are for a terminal only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_logging_to_a_file_writes_no_colour_codes() {
    let env = TestEnv::new().await;
    let mut w = env.spawn_worker(
        "plain",
        &["run", "--kinds", "probe", "--worker-id", "plain"],
        &[],
    );
    let started = env
        .wait_until(Duration::from_secs(30), || async {
            w.log_text().contains("kfs-worker running")
        })
        .await;
    assert!(started, "{}", w.tail(20));
    support::stop_cleanly([&mut w], Duration::from_secs(30)).await;
    let log = w.log_text();
    assert!(log.contains(" INFO "), "{log}");
    assert!(
        !log.contains('\u{1b}'),
        "colour codes in a log file:\n{log}"
    );
    env.cleanup().await;
}
