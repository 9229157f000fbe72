//! Outages in the middle of a run: RabbitMQ restarted, Postgres restarted. Workers keep running,
//! back off, reconnect, and finish every job with each effect applied once. Two tests restart
//! the machine's own services: each holds them alone (`TestEnv::alone`, see
//! `support::isolation`), so no other test of the suite runs beside it, and brings them back
//! even when it fails; where a service cannot be restarted from here they skip with a reason.
//! Do not run them on a machine whose services others are using. A worker started while
//! Postgres cannot be reached waits for it behind a TCP proxy that refuses connections (and
//! stops cleanly on SIGTERM meanwhile), and one whose credentials are refused exits at once;
//! those share the services like any other test.

use std::process::Command;
use std::time::{Duration, Instant};

use kfs_worker::jobs::probe::{self, ProbeSpec};

use crate::support::proxy;
use crate::support::{self, TestEnv};

fn run(cmd: &str, args: &[&str]) -> bool {
    Command::new(cmd)
        .args(args)
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn postgres_cluster() -> Option<String> {
    let versions = std::fs::read_dir("/etc/postgresql").ok()?;
    versions
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .max()
}

fn can_restart_rabbitmq() -> bool {
    run("rabbitmqctl", &["-q", "status"])
}

fn can_restart_postgres() -> bool {
    postgres_cluster().is_some_and(|v| run("pg_ctlcluster", &[&v, "main", "status"]))
}

/// Brings RabbitMQ's app back on drop, whatever happened.
struct RabbitBack;
impl Drop for RabbitBack {
    fn drop(&mut self) {
        run("rabbitmqctl", &["-q", "start_app"]);
    }
}

/// Brings Postgres back on drop, whatever happened.
struct PostgresBack(String);
impl Drop for PostgresBack {
    fn drop(&mut self) {
        run(
            "pg_ctlcluster",
            &["--skip-systemctl-redirect", &self.0, "main", "start"],
        );
    }
}

async fn done_count(env: &TestEnv) -> i64 {
    loop {
        match sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM kfs_probe_jobs WHERE run_state IN ('succeeded', 'failed')",
        )
        .fetch_one(&env.pool)
        .await
        {
            Ok(n) => return n,
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

async fn wait_all_done(env: &TestEnv, n: i64, timeout: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if done_count(env).await == n {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

async fn wait_progress(env: &TestEnv, at_least: i64) {
    let start = Instant::now();
    while done_count(env).await < at_least && start.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

const JOBS: i64 = 300;

fn worker_args(id: &str) -> Vec<String> {
    ["run", "--kinds", "probe", "--worker-id", id]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// Runs two workers over `JOBS` probe jobs, calls `outage` once a fifth is done, and checks
/// that the workers kept running, finished every job with each effect once, and stop cleanly.
/// The environment holds the services alone: `outage` stops one of them.
async fn survive(name: &str, outage: impl FnOnce()) {
    let env = TestEnv::alone().await;
    probe::enqueue_many(
        &env.pool,
        JOBS,
        &ProbeSpec {
            steps: 2,
            step_sleep: Duration::from_millis(20),
            ..ProbeSpec::default()
        },
    )
    .await
    .unwrap();
    let extra = [("KFS_RELAY_POLL", "200ms"), ("KFS_LEASES", "probe=20s")];
    let a = worker_args(&format!("{name}-a"));
    let b = worker_args(&format!("{name}-b"));
    let mut wa = env.spawn_worker(
        "a",
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
        &extra,
    );
    let mut wb = env.spawn_worker(
        "b",
        &b.iter().map(String::as_str).collect::<Vec<_>>(),
        &extra,
    );
    wait_progress(&env, JOBS / 5).await;

    outage();

    // The workers reconnect by themselves.
    let finished = wait_all_done(&env, JOBS, Duration::from_secs(150)).await;
    assert!(
        finished,
        "jobs: {:?}\nworker a:\n{}",
        support::probe_states(&env.pool).await,
        wa.log_text()
    );
    support::assert_probe_invariants(&env.pool).await;
    assert!(
        wa.wait_exit(Duration::ZERO).is_none() && wb.wait_exit(Duration::ZERO).is_none(),
        "workers kept running"
    );
    support::stop_cleanly([&mut wa, &mut wb], Duration::from_secs(60)).await;
    let log = wa.log_text() + &wb.log_text();
    assert!(
        log.contains("reconnecting") || log.contains("retrying") || log.contains("resynchronising"),
        "workers noticed the outage"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rabbitmq_restart_mid_run_loses_nothing() {
    if !can_restart_rabbitmq() {
        support::skip_or_fail(
            "rabbitmqctl cannot control the local broker here, so the broker cannot be restarted",
        );
        return;
    }
    survive("mq-outage", || {
        let _back = RabbitBack;
        let down = Instant::now();
        assert!(run("rabbitmqctl", &["-q", "stop_app"]), "stop RabbitMQ");
        std::thread::sleep(Duration::from_secs(5));
        assert!(run("rabbitmqctl", &["-q", "start_app"]), "start RabbitMQ");
        eprintln!("RabbitMQ was down for {:.1}s", down.elapsed().as_secs_f64());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_restart_mid_run_loses_nothing() {
    let Some(cluster) = postgres_cluster().filter(|_| can_restart_postgres()) else {
        support::skip_or_fail(
            "no pg_ctlcluster-managed Postgres here, so Postgres cannot be restarted",
        );
        return;
    };
    survive("pg-outage", || {
        let _back = PostgresBack(cluster.clone());
        let down = Instant::now();
        assert!(
            run(
                "pg_ctlcluster",
                &[
                    "--skip-systemctl-redirect",
                    &cluster,
                    "main",
                    "stop",
                    "-m",
                    "fast"
                ]
            ),
            "stop Postgres"
        );
        std::thread::sleep(Duration::from_secs(5));
        assert!(
            run(
                "pg_ctlcluster",
                &["--skip-systemctl-redirect", &cluster, "main", "start"]
            ),
            "start Postgres"
        );
        eprintln!("Postgres was down for {:.1}s", down.elapsed().as_secs_f64());
    })
    .await;
}

/// A probe worker whose Postgres connections go through a proxy that refuses them all until
/// the test lets them through.
async fn behind_a_refusing_proxy(
    env: &TestEnv,
    name: &str,
    worker_id: &str,
) -> (proxy::Proxy, support::Worker) {
    let (pg, through) = proxy::Proxy::before(&env.url).await;
    pg.set_refuse(true);
    let w = env.spawn_worker(
        name,
        &["run", "--kinds", "probe", "--worker-id", worker_id],
        &[
            ("DATABASE_URL", through.as_str()),
            ("KFS_CONNECT_TIMEOUT", "1s"),
        ],
    );
    (pg, w)
}

fn waiting_lines(log: &str) -> usize {
    log.lines()
        .filter(|l| l.contains("Postgres is not available yet"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_started_while_postgres_is_unreachable_waits_for_it_then_runs_the_jobs() {
    let env = TestEnv::new().await;
    let jobs = 20;
    probe::enqueue_many(&env.pool, jobs, &ProbeSpec::default())
        .await
        .unwrap();
    let (pg, mut w) = behind_a_refusing_proxy(&env, "waits", "starts-early").await;

    // It keeps trying, without exiting, and writes nothing meanwhile.
    let tried = env
        .wait_until(Duration::from_secs(60), || async {
            waiting_lines(&w.log_text()) >= 3
        })
        .await;
    assert!(tried, "worker log:\n{}", w.log_text());
    assert!(
        w.wait_exit(Duration::ZERO).is_none(),
        "the worker exited instead of waiting:\n{}",
        w.log_text()
    );
    assert_eq!(
        support::probe_states(&env.pool).await,
        vec![("dispatch_pending".to_owned(), jobs)]
    );
    assert!(
        !w.log_text().contains("kfs-worker running"),
        "it started without Postgres"
    );

    // Postgres becomes reachable: the worker starts by itself and runs every job once.
    pg.set_refuse(false);
    let finished = wait_all_done(&env, jobs, Duration::from_secs(120)).await;
    assert!(
        finished,
        "jobs: {:?}\nworker log:\n{}",
        support::probe_states(&env.pool).await,
        w.log_text()
    );
    support::assert_probe_invariants(&env.pool).await;
    support::stop_cleanly([&mut w], Duration::from_secs(60)).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_waiting_for_postgres_stops_cleanly_on_sigterm() {
    let env = TestEnv::new().await;
    let (_pg, mut w) = behind_a_refusing_proxy(&env, "stops", "stops-waiting").await;
    let waiting = env
        .wait_until(Duration::from_secs(60), || async {
            waiting_lines(&w.log_text()) >= 1
        })
        .await;
    assert!(waiting, "worker log:\n{}", w.log_text());
    support::stop_cleanly([&mut w], Duration::from_secs(30)).await;
    assert!(
        !w.log_text().contains("kfs-worker running"),
        "it started without Postgres"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_postgres_role_is_refused_exits_at_once_instead_of_waiting() {
    let env = TestEnv::new().await;
    let mut url = url::Url::parse(&env.url).unwrap();
    url.set_username("no_such_role").unwrap();
    url.set_password(Some("hunter2")).unwrap();
    let mut w = env.spawn_worker(
        "refused",
        &["run", "--kinds", "probe", "--worker-id", "refused"],
        &[("DATABASE_URL", url.as_str())],
    );
    let status = w.wait_exit(Duration::from_secs(60));
    let log = w.log_text();
    assert_eq!(status.and_then(|s| s.code()), Some(2), "{log}");
    assert!(
        log.contains("refused the credentials of user \"no_such_role\""),
        "{log}"
    );
    assert_eq!(waiting_lines(&log), 0, "it waited for a refusal: {log}");
    assert!(!log.contains("hunter2"), "a secret leaked: {log}");
    env.cleanup().await;
}
