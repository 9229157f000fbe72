//! Chaos run: a stream of probe jobs, and the platform's document compiles, research tasks and
//! deletions (`chaos/platform.rs`), through several `kfs-worker` consumer and relay processes
//! while a seeded driver injects faults: SIGKILL, kill points, SIGSTOP/SIGCONT past the lease,
//! RabbitMQ and Postgres restarts, `pg_terminate_backend` of worker sessions, network faults
//! (latency, cut connections, half-open connections) through a TCP proxy, and one kind's
//! consumer channel closed by the broker under a live process and connection. Invariant under
//! test: whatever fails when, every job ends in the state its behaviour calls for, none is lost,
//! each step's effect exists exactly once and in order, checkpoints never go backwards, no write
//! lands from a fenced-out lease, every ack follows the commit of its own delivery's decision,
//! a kind whose channel closed is consumed again at once on the same connection, and the
//! queues drain.
//!
//! It runs against its OWN Postgres cluster and RabbitMQ node (started in a temporary
//! directory, on their own ports), never the shared services. Only built with `crash-points`.
//!
//! ```text
//! cargo test --all-features --test suite chaos:: -- --nocapture   # short form (about 90 s)
//! ops/chaos --minutes 10 --seed 7 [--outages]                     # full form, with a soak report
//! ```
//!
//! The short form is also part of every run of the whole suite. The run has the machine to
//! itself there (`support::isolation::alone`), as it did when it was a test binary of its own:
//! its five workers and private services load every core, and timings under faults are what
//! it checks.
//!
//! Settings (environment): `KFS_CHAOS_SECONDS` (length of the faulty phase, default 60),
//! `KFS_CHAOS_SEED` (default: from the clock, printed), `KFS_CHAOS_OUTAGES=1` (add a 60 s
//! RabbitMQ and a 30 s Postgres outage and check the workers' CPU time while they last),
//! `KFS_CHAOS_REPORT` (also write the report to this file).

mod acks;
mod channel_close;
mod close_before_consuming;
mod cluster;
mod database;
mod driver;
mod platform;
mod processes;
mod record;
mod report;
mod verdicts;
mod workload;

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::private::{PrivatePostgres, PrivateRabbit};
use chrono::{DateTime, Utc};
use kfs_worker::broker::Topology;
use kfs_worker::jobs::probe::{self, ProbeSpec};
use kfs_worker::jobs::Kind;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::{Connection, PgPool};
use uuid::Uuid;

use crate::support::proxy::Proxy;
use crate::support::{self, Worker};

use self::channel_close::{consuming_again, CLOSE_PLAYED};
use self::database::{run_database, RunDatabase};
use self::driver::{drain, inject, outage, queue_depths, sample, supervise, supervise_unarmed};
use self::processes::{worker_settings, Cluster, Role};
use self::record::Record;
use self::report::report;
use self::verdicts::{check, check_invariants, settle_in_doubt, Check};
use self::workload::enqueue_probe_jobs;

const DB: &str = "kfs_chaos";
const LEASE: &str = "probe=4s,compile=4s,deletion=4s,research=4s";
/// Every kind the workers run: the engine's probe and the platform's three.
const KINDS: [Kind; 4] = [Kind::Probe, Kind::Compile, Kind::Deletion, Kind::Research];
const CONSUMER_POINTS: [&str; 6] = [
    "after-claim-commit",
    "after-step-commit",
    "before-ack",
    "after-group-claim-commit",
    "after-group-step-commit",
    "before-multi-ack",
];
const RELAY_POINTS: [&str; 2] = [
    "after-publish-before-mark",
    "after-mark-before-confirm-wait",
];

// ---------------------------------------------------------------------------------------------
// Settings

struct Settings {
    seconds: u64,
    seed: u64,
    outages: bool,
    report: Option<String>,
}

impl Settings {
    fn from_env() -> Settings {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Settings {
            seconds: var("KFS_CHAOS_SECONDS").map_or(60, |v| {
                v.parse()
                    .expect("KFS_CHAOS_SECONDS must be a whole number of seconds")
            }),
            seed: var("KFS_CHAOS_SEED").map_or_else(
                || {
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap()
                        .as_secs()
                },
                |v| v.parse().expect("KFS_CHAOS_SEED must be a number"),
            ),
            outages: var("KFS_CHAOS_OUTAGES").is_some_and(|v| v == "1" || v == "true"),
            report: var("KFS_CHAOS_REPORT"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The run

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_run_keeps_every_promise() {
    let _alone = support::isolation::alone().await;
    let settings = Settings::from_env();
    let seed = settings.seed;
    println!(
        "chaos: seed {seed}, {} s of faults, outages {}",
        settings.seconds, settings.outages
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let started = Instant::now();

    // Private services, and proxies the workers reach them through.
    let pg = Arc::new(
        tokio::task::spawn_blocking(PrivatePostgres::start)
            .await
            .unwrap(),
    );
    let mq = Arc::new(
        tokio::task::spawn_blocking(PrivateRabbit::start)
            .await
            .unwrap(),
    );
    let RunDatabase {
        pool,
        store_dir,
        store_url,
        space,
    } = run_database(&pg, seed).await;
    let prefix = "chaos".to_owned();
    let topology = Topology::new(&prefix);
    {
        let conn = lapin::Connection::connect(&mq.url(), lapin::ConnectionProperties::default())
            .await
            .expect("connect to the private RabbitMQ");
        let ch = conn.create_channel().await.unwrap();
        topology
            .declare(&ch, &KINDS)
            .await
            .expect("declare topology");
        let _ = conn.close(200, "bye".into()).await;
    }
    let pg_proxy = Proxy::start(pg.addr()).await;
    let mq_proxy = Proxy::start(mq.addr()).await;

    let logs =
        std::env::temp_dir().join(format!("kfschaos-logs-{seed}-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&logs).unwrap();
    let mut env: Vec<(String, String)> = vec![
        (
            "DATABASE_URL".into(),
            format!("postgres://postgres@{}/{DB}", pg_proxy.addr),
        ),
        (
            "AMQP_URL".into(),
            format!("amqp://guest:guest@{}/%2f", mq_proxy.addr),
        ),
        ("KFS_QUEUE_PREFIX".into(), prefix.clone()),
        ("KFS_OBJECT_STORE".into(), store_url.clone()),
        ("KFS_HTTP_ADDR".into(), "off".into()),
    ];
    env.extend(worker_settings());
    let mut cluster = Cluster {
        env,
        extra: BTreeMap::new(),
        logs: logs.clone(),
        slots: Vec::new(),
        all_logs: Vec::new(),
        ended: BTreeMap::new(),
    };
    cluster.add("c1", Role::Consumer, true);
    cluster.add("c2", Role::Consumer, false);
    cluster.add("c3", Role::Consumer, false);
    cluster.add("r1", Role::Relay, true);
    cluster.add("r2", Role::Relay, false);
    println!(
        "chaos: services up, 5 workers started ({:.1} s); logs in {}",
        started.elapsed().as_secs_f64(),
        logs.display()
    );

    let mut rec = Record {
        outage_cpu_ok: true,
        ..Record::default()
    };

    // The workload: jobs enqueued as the platform would, through the direct pool.
    let stop_enqueue = tokio_util::sync::CancellationToken::new();
    let enqueuer = enqueue_probe_jobs(pool.clone(), stop_enqueue.clone(), seed);

    let platform_requests = tokio::spawn(platform::drive(
        pool.clone(),
        space,
        stop_enqueue.clone(),
        seed,
    ));

    // The fault schedule.
    let faulty = Duration::from_secs(settings.seconds);
    let fault_start = Instant::now();
    let outage_times = if settings.outages {
        vec![faulty / 3, faulty * 2 / 3]
    } else {
        vec![]
    };
    let mut outages_done = 0usize;
    let mut next_sample = Instant::now();
    let sample_every = Duration::from_secs(if settings.seconds > 300 { 30 } else { 10 });
    while fault_start.elapsed() < faulty {
        supervise(&mut cluster, &mut rec, &pool, &mut rng).await;
        if Instant::now() >= next_sample {
            rec.samples
                .push(sample(&cluster, &pool, &mq, &pg_proxy, &mq_proxy, fault_start).await);
            next_sample += sample_every;
        }
        if outages_done < outage_times.len() && fault_start.elapsed() >= outage_times[outages_done]
        {
            let which = if outages_done == 0 {
                "rabbitmq"
            } else {
                "postgres"
            };
            outage(which, &mut cluster, &mut rec, &pool, &pg, &mq).await;
            outages_done += 1;
            continue;
        }
        let gap = Duration::from_millis(rng.random_range(500..=2000));
        tokio::time::sleep(gap).await;
        supervise(&mut cluster, &mut rec, &pool, &mut rng).await;
        inject(
            &mut cluster,
            &mut rec,
            &pool,
            &pg,
            &mq,
            &pg_proxy,
            &mq_proxy,
            &mut rng,
        )
        .await;
    }

    // Recovery: no more faults, no more new jobs; everything must finish.
    rec.faults_ended = Some(Utc::now());
    stop_enqueue.cancel();
    let (jobs, in_doubt) = enqueuer.await.unwrap();
    rec.jobs = jobs;
    rec.in_doubt = in_doubt;
    rec.platform = platform_requests.await.unwrap();
    pg_proxy.heal();
    mq_proxy.heal();
    for s in &mut cluster.slots {
        if s.stopped {
            s.worker.signal("CONT");
            s.stopped = false;
        }
    }
    let (drained, drain_s) = drain(&mut cluster, &mut rec, &pool).await;
    rec.samples
        .push(sample(&cluster, &pool, &mq, &pg_proxy, &mq_proxy, fault_start).await);
    let mut depths = (u32::MAX, u32::MAX);
    for _ in 0..60 {
        depths = queue_depths(&mq.url(), &topology).await;
        if depths == (0, 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let mut exit_codes = Vec::new();
    for s in &cluster.slots {
        s.worker.signal("TERM");
    }
    for s in &mut cluster.slots {
        let status = s.worker.wait_exit(Duration::from_secs(20));
        exit_codes.push((s.worker.name.clone(), status.and_then(|st| st.code())));
    }

    // The verdicts.
    settle_in_doubt(&pool, &mut rec).await;
    let checks = check_invariants(&pool, &rec, &cluster, drained, depths).await;
    let report = report(
        &settings,
        &rec,
        &pool,
        &cluster,
        &checks,
        drain_s,
        &exit_codes,
        started,
    )
    .await;
    println!("{report}");
    if let Some(path) = &settings.report {
        std::fs::write(path, &report).expect("write the report");
    }
    pool.close().await;
    let failed: Vec<&Check> = checks.iter().filter(|c| !c.ok).collect();
    if !failed.is_empty() {
        // The private database goes with the run: keep a dump next to the logs for diagnosis.
        let _ = std::process::Command::new("/usr/lib/postgresql/15/bin/pg_dump")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &pg.port.to_string(),
                "-U",
                "postgres",
                "-f",
            ])
            .arg(logs.join("kfs_chaos.sql"))
            .arg(DB)
            .status();
    }
    assert!(
        failed.is_empty(),
        "invariants broken (seed {seed}, logs in {}):\n{}",
        logs.display(),
        failed
            .iter()
            .map(|c| format!("- {}: {}", c.name, c.detail))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let _ = std::fs::remove_dir_all(&logs);
    let _ = std::fs::remove_dir_all(&store_dir);
}
