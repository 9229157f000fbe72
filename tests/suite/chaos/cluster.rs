//! Node loss on a three-node RabbitMQ cluster (`ops/cluster`): jobs of every kind flow through
//! two consumers and a relay, each started on another node, with `AMQP_URL` listing all three
//! nodes' TLS listeners (the script's CA, a client certificate).
//! The node leading the probe queue is killed with SIGKILL and later restarted; then the node
//! holding the most processes (the relay counting twice) is stopped cleanly. Invariant under test: every process becomes
//! ready on a node still up after each loss, and the run keeps every promise the chaos run
//! checks (every job terminal, none lost, each effect once, nothing acked before its commit,
//! outbox settled, queues drained). The report gives each process's time to resume.
//!
//! ```text
//! cargo test --all-features --test suite chaos::cluster:: -- --nocapture   # about 3 minutes
//! ops/chaos --cluster [--minutes N] [--report FILE]                        # longer phases
//! ```
//!
//! `KFS_CHAOS_SECONDS` sets the phases to a quarter of it each (default 60: 15 s of work before
//! the kill, the node down for 15 s, then 15 s before and 15 s after the clean stop).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use chrono::Utc;
use kfs_worker::broker::Topology;
use kfs_worker::jobs::Kind;
use uuid::Uuid;

use super::{
    check_invariants, drain, enqueue_probe_jobs, platform, queue_depths, run_database,
    settle_in_doubt, supervise_unarmed, worker_settings, Cluster, Record, Role, RunDatabase,
    Settings, DB, KINDS,
};
use crate::support::private::PrivatePostgres;
use crate::support::{self, http_get};

const OPS_CLUSTER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/ops/cluster");

/// A cluster `ops/cluster` started in a directory of its own, stopped and removed when dropped.
struct RabbitCluster {
    dir: PathBuf,
    /// The plain AMQP URL of each node, in node order (1, 2, 3), for the test's own calls.
    urls: Vec<String>,
    /// The AMQPS URL of each node, which the worker processes use.
    tls_urls: Vec<String>,
    /// `KFS_AMQP_TLS_CA`, `_CERT` and `_KEY`: the CA the script made and a client certificate.
    tls_env: Vec<(String, String)>,
}

impl RabbitCluster {
    fn start() -> RabbitCluster {
        let dir =
            std::env::temp_dir().join(format!("kfschaos-cluster-{}", Uuid::new_v4().simple()));
        let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
        let base = (0..200)
            .map(|_| rand::random_range(44000u16..45400))
            .find(|&p| (0..3).all(|i| free(p + i) && free(p + 10 + i) && free(p + 20000 + i)))
            .expect("free ports for the cluster");
        let out = Command::new(OPS_CLUSTER)
            .args(["start", "--base-port", &base.to_string(), "--dir"])
            .arg(&dir)
            .output()
            .expect("run ops/cluster start");
        assert!(
            out.status.success(),
            "ops/cluster start failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let env = std::fs::read_to_string(dir.join("env")).expect("the cluster's env file");
        let value = |key: &str| -> String {
            env.lines()
                .find_map(|l| l.strip_prefix(&format!("{key}=")))
                .unwrap_or_else(|| panic!("{key} in the cluster's env file"))
                .trim_matches(|c| c == '"' || c == '\'')
                .to_owned()
        };
        let list = |key: &str| value(key).split(',').map(str::to_owned).collect();
        RabbitCluster {
            urls: list("AMQP_URL"),
            tls_urls: list("AMQPS_URL"),
            tls_env: ["KFS_AMQP_TLS_CA", "KFS_AMQP_TLS_CERT", "KFS_AMQP_TLS_KEY"]
                .into_iter()
                .map(|k| (k.to_owned(), value(k)))
                .collect(),
            dir,
        }
    }

    fn ctl(&self, args: &[&str]) -> String {
        let out = Command::new(OPS_CLUSTER)
            .args(args)
            .arg("--dir")
            .arg(&self.dir)
            .output()
            .expect("run ops/cluster");
        assert!(
            out.status.success(),
            "ops/cluster {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// `host:port` of node `n` (1-based) as a process on it reports it: its TLS listener.
    fn endpoint(&self, n: usize) -> String {
        let u = url::Url::parse(&self.tls_urls[n - 1]).unwrap();
        format!("{}:{}", u.host_str().unwrap(), u.port().unwrap())
    }

    fn node_of(&self, endpoint: &str) -> Option<usize> {
        (1..=3).find(|&n| self.endpoint(n) == endpoint)
    }

    /// `AMQP_URL` for a process that starts at node `first` and moves on in order: the nodes'
    /// TLS listeners.
    fn list_from(&self, first: usize) -> String {
        (0..3)
            .map(|k| self.tls_urls[(first - 1 + k) % 3].clone())
            .collect::<Vec<_>>()
            .join(",")
    }
}

impl Drop for RabbitCluster {
    fn drop(&mut self) {
        let _ = Command::new(OPS_CLUSTER)
            .args(["stop", "--dir"])
            .arg(&self.dir)
            .output();
    }
}

/// One process's answer to `/readyz`: ready or not, and the node it says it is on.
async fn readiness(addr: std::net::SocketAddr) -> (bool, Option<String>) {
    let (code, body) = http_get(addr, "/readyz").await;
    let node = body.split("on node ").nth(1).map(|rest| {
        rest.split([')', '\n'])
            .next()
            .unwrap_or("")
            .trim()
            .to_owned()
    });
    (code == 200, node)
}

/// How one process came through a node loss.
struct Resume {
    process: String,
    before: Option<String>,
    after: Option<String>,
    /// From the loss until it was ready on a node still up; `None`: never within the watch.
    took: Option<Duration>,
    /// Whether it was unready at any moment of the watch.
    went_unready: bool,
}

/// Watches every process from the moment of a loss of node `lost` until each is ready on
/// another node (at most `within`), polling `/readyz` every 100 ms.
async fn watch_resume(
    processes: &[(String, std::net::SocketAddr)],
    before: &BTreeMap<String, Option<String>>,
    lost: &str,
    since: Instant,
    within: Duration,
) -> Vec<Resume> {
    let mut out: Vec<Resume> = processes
        .iter()
        .map(|(p, _)| Resume {
            process: p.clone(),
            before: before.get(p).cloned().flatten(),
            after: None,
            took: None,
            went_unready: false,
        })
        .collect();
    while since.elapsed() < within && out.iter().any(|r| r.took.is_none()) {
        for (i, (_, addr)) in processes.iter().enumerate() {
            if out[i].took.is_some() {
                continue;
            }
            let (ready, node) = readiness(*addr).await;
            if !ready {
                out[i].went_unready = true;
            } else if node.as_deref().is_some_and(|n| n != lost) {
                out[i].took = Some(since.elapsed());
                out[i].after = node;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    out
}

fn render_resumes(s: &mut String, resumes: &[Resume]) {
    for r in resumes {
        let was = r.before.as_deref().unwrap_or("no node");
        let _ = match (r.took, &r.after) {
            (Some(t), Some(after)) if r.went_unready || r.before.as_deref() != Some(after) => {
                writeln!(
                    s,
                    "  {:<4} was on {was}: ready on {after} after {:.2} s",
                    r.process,
                    t.as_secs_f64()
                )
            }
            (Some(_), Some(after)) => writeln!(
                s,
                "  {:<4} was on {was}: stayed ready on {after}",
                r.process
            ),
            _ => writeln!(
                s,
                "  {:<4} was on {was}: NOT ready on another node",
                r.process
            ),
        };
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn losing_rabbitmq_nodes_loses_no_job_and_each_process_resumes_on_another_node() {
    let _alone = support::isolation::alone().await;
    let settings = Settings::from_env();
    let seed = settings.seed;
    let phase = Duration::from_secs(settings.seconds.max(8) / 4);
    println!("node loss: seed {seed}, phases of {} s", phase.as_secs());
    let started = Instant::now();

    let pg = tokio::task::spawn_blocking(PrivatePostgres::start)
        .await
        .unwrap();
    let mq = tokio::task::spawn_blocking(RabbitCluster::start)
        .await
        .unwrap();
    println!(
        "node loss: Postgres and a three-node cluster up ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
    let RunDatabase {
        pool,
        store_dir,
        store_url,
        space,
    } = run_database(&pg, seed).await;
    let prefix = "chaosnodes".to_owned();
    let topology = Topology::new(&prefix);
    {
        let conn = lapin::Connection::connect(&mq.urls[0], lapin::ConnectionProperties::default())
            .await
            .expect("connect to node 1");
        let ch = conn.create_channel().await.unwrap();
        topology
            .declare(&ch, &KINDS)
            .await
            .expect("declare topology");
        let _ = conn.close(200, "bye".into()).await;
    }

    let logs =
        std::env::temp_dir().join(format!("kfschaos-nodes-{seed}-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&logs).unwrap();
    let mut env: Vec<(String, String)> = vec![
        ("DATABASE_URL".into(), pg.url(DB)),
        ("KFS_QUEUE_PREFIX".into(), prefix.clone()),
        ("KFS_OBJECT_STORE".into(), store_url.clone()),
        ("KFS_AMQP_NODE_ORDER".into(), "listed".into()),
    ];
    env.extend(worker_settings());
    // Spread over the nodes: each process starts at another one.
    let plan: [(&'static str, Role, usize); 3] = [
        ("c1", Role::Consumer, 1),
        ("c2", Role::Consumer, 2),
        ("r1", Role::Relay, 3),
    ];
    let mut extra = BTreeMap::new();
    let mut processes = Vec::new();
    for (name, _, first) in plan {
        let addr = support::free_port();
        extra.insert(
            name,
            vec![
                ("AMQP_URL".to_owned(), mq.list_from(first)),
                ("KFS_HTTP_ADDR".to_owned(), addr.to_string()),
            ],
        );
        processes.push((name.to_owned(), addr));
    }
    // Over TLS, with the CA the script made and a client certificate: the cluster's listeners
    // ask for one.
    env.extend(mq.tls_env.iter().cloned());
    let mut cluster = Cluster {
        env,
        extra,
        logs: logs.clone(),
        slots: Vec::new(),
        all_logs: Vec::new(),
        ended: BTreeMap::new(),
    };
    for (name, role, _) in plan {
        cluster.add(name, role, false);
    }
    let mut rec = Record::default();

    // Every process ready on its own node before anything fails.
    let placed = Instant::now();
    let mut before = BTreeMap::new();
    while placed.elapsed() < Duration::from_secs(60) {
        before.clear();
        for (p, addr) in &processes {
            let (ready, node) = readiness(*addr).await;
            if ready {
                before.insert(p.clone(), node);
            }
        }
        if before.len() == processes.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        before.len(),
        processes.len(),
        "not every process became ready: {before:?}"
    );

    // The workload, as in the chaos run.
    let stop_enqueue = tokio_util::sync::CancellationToken::new();
    let enqueuer = enqueue_probe_jobs(pool.clone(), stop_enqueue.clone(), seed);
    let platform_requests = tokio::spawn(platform::drive(
        pool.clone(),
        space,
        stop_enqueue.clone(),
        seed,
    ));
    let mut report = String::new();
    let _ =
        writeln!(
        report,
        "node-loss run: seed {seed}, nodes {} (amqps, with a client certificate), processes c1 (consumer), c2 (consumer), r1 (relay)",
        (1..=3).map(|n| mq.endpoint(n)).collect::<Vec<_>>().join(", ")
    );
    let watch = Duration::from_secs(90);
    tokio::time::sleep(phase).await;

    // 1. The leader of the probe queue dies without a word.
    let leader: usize = mq
        .ctl(&["leader", &topology.queue(Kind::Probe)])
        .parse()
        .expect("a leader index");
    let lost = mq.endpoint(leader);
    let before_kill = current_nodes(&processes).await;
    let t0 = Instant::now();
    mq.ctl(&["kill", &leader.to_string()]);
    let first = watch_resume(&processes, &before_kill, &lost, t0, watch).await;
    let _ = writeln!(
        report,
        "loss 1: node {leader} ({lost}), leader of {}, killed with SIGKILL; restarted {} s later",
        topology.queue(Kind::Probe),
        phase.as_secs()
    );
    render_resumes(&mut report, &first);
    supervise_unarmed(&mut cluster, &mut rec, &pool).await;
    tokio::time::sleep(phase.saturating_sub(t0.elapsed())).await;
    mq.ctl(&["restart", &leader.to_string()]);
    tokio::time::sleep(phase).await;

    // 2. The node holding the most processes now is stopped cleanly, the relay counting twice
    // (its unconfirmed publishes are the other half of what a lost node puts at risk).
    let before_stop = current_nodes(&processes).await;
    let mut load: BTreeMap<usize, (usize, bool)> = BTreeMap::new();
    for (p, node) in &before_stop {
        if let Some(n) = node.as_deref().and_then(|node| mq.node_of(node)) {
            let relay = p.starts_with('r');
            let e = load.entry(n).or_default();
            e.0 += if relay { 2 } else { 1 };
            e.1 |= relay;
        }
    }
    let stopped = load
        .iter()
        .max_by_key(|(_, weight)| **weight)
        .map_or(if leader == 1 { 2 } else { 1 }, |(n, _)| *n);
    let lost = mq.endpoint(stopped);
    let t1 = Instant::now();
    mq.ctl(&["stop-node", &stopped.to_string()]);
    let second = watch_resume(&processes, &before_stop, &lost, t1, watch).await;
    let _ = writeln!(
        report,
        "loss 2: node {stopped} ({lost}) stopped cleanly (rabbitmqctl stop)"
    );
    render_resumes(&mut report, &second);
    supervise_unarmed(&mut cluster, &mut rec, &pool).await;
    tokio::time::sleep(phase).await;

    // Recovery: no new jobs; everything must finish on the two nodes left.
    rec.faults_ended = Some(Utc::now());
    stop_enqueue.cancel();
    let (jobs, in_doubt) = enqueuer.await.unwrap();
    rec.jobs = jobs;
    rec.in_doubt = in_doubt;
    rec.platform = platform_requests.await.unwrap();
    let (drained, drain_s) = drain(&mut cluster, &mut rec, &pool).await;
    let up = (1..=3).find(|&n| n != stopped).unwrap();
    let mut depths = (u32::MAX, u32::MAX);
    for _ in 0..60 {
        depths = queue_depths(&mq.urls[up - 1], &topology).await;
        if depths == (0, 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for s in &cluster.slots {
        s.worker.signal("TERM");
    }
    for s in &mut cluster.slots {
        let _ = s.worker.wait_exit(Duration::from_secs(20));
    }
    settle_in_doubt(&pool, &mut rec).await;
    let mut checks = check_invariants(&pool, &rec, &cluster, drained, depths).await;
    for (loss, resumes) in [("1 (SIGKILL)", &first), ("2 (clean stop)", &second)] {
        let stuck: Vec<&str> = resumes
            .iter()
            .filter(|r| r.took.is_none())
            .map(|r| r.process.as_str())
            .collect();
        checks.push(super::check(
            if loss.starts_with('1') {
                "every process ready on a node still up after loss 1"
            } else {
                "every process ready on a node still up after loss 2"
            },
            stuck.is_empty(),
            format!(
                "loss {loss}: not ready within {} s: {stuck:?}",
                watch.as_secs()
            ),
        ));
    }
    let _ = writeln!(
        report,
        "work: {} probe jobs, {}; drained {drain_s:.1} s after the last request; {} jobs in doubt ({} had committed)",
        rec.jobs.len(),
        platform::summary(&rec.platform),
        rec.in_doubt.len(),
        rec.in_doubt_committed
    );
    let processes_exited: u64 = rec.faults.values().sum();
    let _ = writeln!(
        report,
        "processes that exited by themselves: {processes_exited}"
    );
    for n in &rec.notes {
        let _ = writeln!(report, "  note: {n}");
    }
    for c in &checks {
        let _ = writeln!(
            report,
            "{} {}: {}",
            if c.ok { "ok  " } else { "FAIL" },
            c.name,
            c.detail
        );
    }
    let _ = writeln!(report, "run took {:.0} s", started.elapsed().as_secs_f64());
    println!("{report}");
    if let Some(path) = &settings.report {
        std::fs::write(path, &report).expect("write the report");
    }
    pool.close().await;
    let failed: Vec<_> = checks.iter().filter(|c| !c.ok).collect();
    assert!(
        failed.is_empty(),
        "node loss broke a promise (seed {seed}, logs in {}):\n{report}",
        logs.display()
    );
    let _ = std::fs::remove_dir_all(&logs);
    let _ = std::fs::remove_dir_all(&store_dir);
}

/// The node each process says it is on now.
async fn current_nodes(
    processes: &[(String, std::net::SocketAddr)],
) -> BTreeMap<String, Option<String>> {
    let mut out = BTreeMap::new();
    for (p, addr) in processes {
        out.insert(p.clone(), readiness(*addr).await.1);
    }
    out
}
