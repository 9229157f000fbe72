//! The HTTP surface of a running worker: health, readiness and metrics that move when their
//! events happen.

mod common;

use std::time::Duration;

use common::TestEnv;
use kfs_worker::consumer::ConsumerConfig;
use kfs_worker::jobs::probe::{self, ProbeSpec};
use kfs_worker::jobs::Kind;
use kfs_worker::maintenance::MaintenanceConfig;
use kfs_worker::relay::RelayConfig;
use kfs_worker::runtime::{self, RunOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return (0, String::new());
    };
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.unwrap();
    let code = buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = buf
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (code, body)
}

fn free_port() -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// The value of the first sample line of `metric` whose labels contain all of `labels`.
fn sample(body: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    body.lines()
        .filter(|l| l.starts_with(metric) && !l.starts_with('#'))
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn health_readiness_and_metrics_follow_the_work() {
    let env = TestEnv::new().await;
    let addr = free_port();
    let shutdown = CancellationToken::new();
    let opts = RunOptions {
        services: env.services(),
        object_store: kfs_worker::config::object_store("memory://").unwrap(),
        worker_id: "http-test".into(),
        kinds: vec![Kind::Probe],
        relay: true,
        consumer: true,
        maintenance: true,
        relay_cfg: RelayConfig {
            poll: Duration::from_millis(200),
            ..RelayConfig::default()
        },
        consumer_cfg: ConsumerConfig::default(),
        maintenance_cfg: MaintenanceConfig::default(),
        http_addr: Some(addr),
        admin_token: None,
    };
    let worker = tokio::spawn(runtime::run(opts, shutdown.clone()));

    let ready = env
        .wait_until(Duration::from_secs(20), || async {
            get(addr, "/readyz").await.0 == 200
        })
        .await;
    assert!(ready, "readyz: {:?}", get(addr, "/readyz").await);
    assert_eq!(get(addr, "/healthz").await, (200, "ok\n".to_owned()));
    let (_, ready_body) = get(addr, "/readyz").await;
    assert!(
        ready_body.contains("postgres: ok") && ready_body.contains("rabbitmq: ok"),
        "{ready_body}"
    );

    let (_, before) = get(addr, "/metrics").await;
    let claimed_before = sample(
        &before,
        "kfs_deliveries_total",
        &["kind=\"probe\"", "outcome=\"claimed\""],
    )
    .unwrap_or(0.0);

    probe::enqueue_many(
        &env.pool,
        20,
        &ProbeSpec {
            steps: 2,
            ..ProbeSpec::default()
        },
    )
    .await
    .unwrap();
    let pool = env.pool.clone();
    let done = env
        .wait_until(Duration::from_secs(30), || {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM kfs_probe_jobs WHERE run_state = 'succeeded'",
                )
                .fetch_one(&pool)
                .await
                .unwrap()
                    == 20
            }
        })
        .await;
    assert!(done);

    let (code, after) = get(addr, "/metrics").await;
    assert_eq!(code, 200);
    let claimed = sample(
        &after,
        "kfs_deliveries_total",
        &["kind=\"probe\"", "outcome=\"claimed\""],
    )
    .unwrap_or(0.0);
    assert!(
        claimed >= claimed_before + 20.0,
        "claimed {claimed_before} -> {claimed}\n{after}"
    );
    assert!(
        sample(
            &after,
            "kfs_slices_total",
            &["kind=\"probe\"", "end=\"succeeded\""]
        )
        .unwrap_or(0.0)
            >= 20.0
    );
    assert!(
        sample(
            &after,
            "kfs_relay_messages_total",
            &["kind=\"probe\"", "result=\"confirmed\""]
        )
        .unwrap_or(0.0)
            >= 20.0
    );
    assert_eq!(
        sample(
            &after,
            "kfs_jobs",
            &["kind=\"probe\"", "state=\"succeeded\""]
        ),
        Some(20.0),
        "{after}"
    );
    assert_eq!(
        sample(
            &after,
            "kfs_outbox_rows",
            &["kind=\"probe\"", "status=\"completed\""]
        ),
        Some(20.0)
    );
    assert!(
        after.contains("kfs_slice_duration_seconds_bucket"),
        "histogram present"
    );
    assert!(
        after.contains("kfs_relay_lag_seconds{kind=\"probe\"} 0"),
        "{after}"
    );
    assert!(!after.contains("guest"), "no credentials in metrics");

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(20), worker)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    env.cleanup().await;
}
