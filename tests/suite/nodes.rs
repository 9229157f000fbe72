//! `AMQP_URL` as a list of nodes: `check` checks each and names those it cannot reach; a
//! process whose node is dead or lost becomes ready on the next one, and says where it is in
//! `/readyz` and in `kfs-worker status`.

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use kfs_worker::jobs::probe::ProbeSpec;

use crate::support::private::PrivateRabbit;
use crate::support::{self, free_port, http_get, TestEnv};

/// The shared node's URL, and `host:port` as a process reports it.
fn shared_node() -> (String, String) {
    let url = support::amqp_url();
    let parsed = url::Url::parse(&url).expect("AMQP_URL");
    let endpoint = format!(
        "{}:{}",
        parsed.host_str().unwrap_or("localhost"),
        parsed.port().unwrap_or(5672)
    );
    (url, endpoint)
}

/// Waits until `/readyz` answers 200 saying it is on `node`; the last answer otherwise.
async fn ready_on(
    env: &TestEnv,
    addr: SocketAddr,
    node: &str,
    within: Duration,
) -> Result<(), String> {
    let want = format!("on node {node}");
    let ok = env
        .wait_until(within, || async {
            let (code, body) = http_get(addr, "/readyz").await;
            code == 200 && body.contains(&want)
        })
        .await;
    if ok {
        Ok(())
    } else {
        Err(format!("{:?}", http_get(addr, "/readyz").await))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_checks_every_node_and_names_the_ones_it_cannot_reach() {
    let env = TestEnv::new().await;
    let (shared, endpoint) = shared_node();
    let dead = free_port();
    let list = format!("amqp://guest:hunter2@{dead}/%2f,{shared}");
    let o = Command::new(env!("CARGO_BIN_EXE_kfs-worker"))
        .arg("check")
        .env_remove("RUST_LOG")
        .env("DATABASE_URL", &env.url)
        .env("AMQP_URL", &list)
        .output()
        .expect("run kfs-worker check");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert_eq!(o.status.code(), Some(2), "{stdout}{stderr}");
    assert!(
        stdout.contains(&format!(
            "rabbitmq: node 2 of 2 ok at amqp://guest:***@{endpoint}"
        )),
        "{stdout}"
    );
    assert_eq!(
        stderr.lines().count(),
        1,
        "one line for the one node down: {stderr}"
    );
    assert!(
        stderr.starts_with(&format!(
            "error: rabbitmq node 1 of 2 cannot be used: cannot reach RabbitMQ at {dead}"
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2") && !stdout.contains("hunter2"));
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_first_listed_node_is_dead_becomes_ready_on_the_next() {
    let env = TestEnv::new().await;
    let (shared, endpoint) = shared_node();
    let list = format!("amqp://guest:guest@{}/%2f,{shared}", free_port());
    let addr = free_port();
    let mut w = env.spawn_worker(
        "dead-first",
        &["run", "--kinds", "probe", "--worker-id", "dead-first"],
        &[
            ("AMQP_URL", &list),
            ("KFS_AMQP_NODE_ORDER", "listed"),
            ("KFS_HTTP_ADDR", &addr.to_string()),
        ],
    );
    if let Err(last) = ready_on(&env, addr, &endpoint, Duration::from_secs(60)).await {
        panic!("not ready on the second node: {last}\n{}", w.tail(30));
    }
    // Work flows through it.
    let (job, _) = support::enqueue_one(&env.pool, &ProbeSpec::default()).await;
    assert!(
        env.wait_probe_succeeded(1, Duration::from_secs(60)).await,
        "job {job} did not succeed:\n{}",
        w.tail(30)
    );
    // `status` says where every process is (its liveness session is named anew every half
    // second).
    let want = format!("processes: 1 live\n  dead-first  on {endpoint}\n");
    let mut text = String::new();
    for _ in 0..20 {
        let o = Command::new(env!("CARGO_BIN_EXE_kfs-worker"))
            .args(["status", "--kinds", "compile"])
            .env_remove("RUST_LOG")
            .env("DATABASE_URL", &env.url)
            .env("AMQP_URL", &shared)
            .output()
            .expect("run kfs-worker status");
        text = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(
            o.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        if text.contains(&want) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(text.contains(&want), "{text}");
    w.kill();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_moves_to_the_next_node_when_its_node_is_lost() {
    if !std::path::Path::new("/usr/sbin/rabbitmq-server").exists()
        && Command::new("rabbitmq-server")
            .arg("--help")
            .output()
            .is_err()
    {
        support::skip_or_fail("rabbitmq-server (ops/services installs it)");
        return;
    }
    let env = TestEnv::new().await;
    let mq = PrivateRabbit::start();
    let (shared, endpoint) = shared_node();
    let list = format!("{},{shared}", mq.url());
    let addr = free_port();
    let mut w = env.spawn_worker(
        "moves-on",
        &["run", "--kinds", "probe", "--worker-id", "moves-on"],
        &[
            ("AMQP_URL", &list),
            ("KFS_AMQP_NODE_ORDER", "listed"),
            ("KFS_HTTP_ADDR", &addr.to_string()),
        ],
    );
    let private = format!("127.0.0.1:{}", mq.port);
    if let Err(last) = ready_on(&env, addr, &private, Duration::from_secs(60)).await {
        panic!("not ready on the first node: {last}\n{}", w.tail(30));
    }
    // The node goes away and stays away: the process goes on on the next one.
    mq.stop_app();
    if let Err(last) = ready_on(&env, addr, &endpoint, Duration::from_secs(60)).await {
        panic!(
            "not ready on the second node after the first was lost: {last}\n{}",
            w.tail(30)
        );
    }
    let (job, _) = support::enqueue_one(&env.pool, &ProbeSpec::default()).await;
    assert!(
        env.wait_probe_succeeded(1, Duration::from_secs(60)).await,
        "job {job} did not succeed on the second node:\n{}",
        w.tail(30)
    );
    w.kill();
    env.cleanup().await;
}
