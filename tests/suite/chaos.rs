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

mod cluster;
mod platform;

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

/// Observers installed in the run's database. They record, they never change what the engine
/// does: every new lease (claim) with the database clock, every end of a lease (its token
/// cleared) with the session that wrote it, every checkpoint change, and every outbox write but
/// a heartbeat's (a change of status, delivery id or `updated_at`) with its session. Trigger rows
/// commit with the transaction that caused them, so a row exists exactly when that transaction
/// committed, and rows with the same `tx` were written by one transaction: a claim's lease and
/// the delivery it claimed for, a lease's end and the outbox status it wrote.
const OBSERVERS: &str = r#"
CREATE FUNCTION chaos_us(xid) RETURNS bigint LANGUAGE sql STABLE AS
  $f$ SELECT (extract(epoch FROM pg_xact_commit_timestamp($1)) * 1000000)::bigint $f$;
CREATE TABLE chaos_claims (
  id BIGSERIAL PRIMARY KEY, job_id UUID NOT NULL, worker_id TEXT NOT NULL, lease_token UUID NOT NULL,
  at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(), tx BIGINT NOT NULL DEFAULT txid_current());
CREATE INDEX chaos_claims_job ON chaos_claims (job_id, id);
CREATE INDEX chaos_claims_lease ON chaos_claims (job_id, lease_token);
CREATE INDEX chaos_claims_tx ON chaos_claims (tx, job_id);
CREATE FUNCTION chaos_claim() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
  INSERT INTO chaos_claims (job_id, worker_id, lease_token) VALUES (NEW.id, NEW.worker_id, NEW.lease_token);
  RETURN NULL;
END $f$;
CREATE TRIGGER chaos_claim AFTER UPDATE OF lease_token ON kfs_probe_jobs FOR EACH ROW
  WHEN (NEW.lease_token IS NOT NULL AND NEW.lease_token IS DISTINCT FROM OLD.lease_token)
  EXECUTE FUNCTION chaos_claim();
CREATE TABLE chaos_ends (
  id BIGSERIAL PRIMARY KEY, job_id UUID NOT NULL, lease_token UUID NOT NULL, writer TEXT NOT NULL,
  tx BIGINT NOT NULL DEFAULT txid_current());
CREATE INDEX chaos_ends_lease ON chaos_ends (job_id, lease_token);
CREATE FUNCTION chaos_end() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
  INSERT INTO chaos_ends (job_id, lease_token, writer)
  VALUES (NEW.id, OLD.lease_token, current_setting('application_name'));
  RETURN NULL;
END $f$;
CREATE TRIGGER chaos_end AFTER UPDATE OF lease_token ON kfs_probe_jobs FOR EACH ROW
  WHEN (OLD.lease_token IS NOT NULL AND NEW.lease_token IS NULL) EXECUTE FUNCTION chaos_end();
CREATE TABLE chaos_checkpoints (
  id BIGSERIAL PRIMARY KEY, job_id UUID NOT NULL, old_cp TEXT NOT NULL, new_cp TEXT NOT NULL,
  at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION chaos_checkpoint() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
  INSERT INTO chaos_checkpoints (job_id, old_cp, new_cp) VALUES (NEW.id, OLD.checkpoint, NEW.checkpoint);
  RETURN NULL;
END $f$;
CREATE TRIGGER chaos_checkpoint AFTER UPDATE OF checkpoint ON kfs_probe_jobs FOR EACH ROW
  WHEN (NEW.checkpoint IS DISTINCT FROM OLD.checkpoint) EXECUTE FUNCTION chaos_checkpoint();
CREATE TABLE chaos_outbox (
  id BIGSERIAL PRIMARY KEY, job_id UUID NOT NULL, old_status TEXT NOT NULL, status TEXT NOT NULL,
  queue_job_id TEXT, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
  writer TEXT NOT NULL DEFAULT current_setting('application_name'),
  tx BIGINT NOT NULL DEFAULT txid_current());
CREATE INDEX chaos_outbox_delivery ON chaos_outbox (queue_job_id);
CREATE INDEX chaos_outbox_job ON chaos_outbox (job_id, id);
CREATE INDEX chaos_outbox_tx ON chaos_outbox (tx, job_id);
CREATE FUNCTION chaos_outbox() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
  INSERT INTO chaos_outbox (job_id, old_status, status, queue_job_id)
  VALUES (NEW.probe_job_id, OLD.status, NEW.status, NEW.queue_job_id);
  RETURN NULL;
END $f$;
CREATE TRIGGER chaos_outbox AFTER UPDATE ON kfs_probe_outbox FOR EACH ROW
  WHEN (NEW.status IS DISTINCT FROM OLD.status OR NEW.queue_job_id IS DISTINCT FROM OLD.queue_job_id
        OR NEW.updated_at IS DISTINCT FROM OLD.updated_at)
  EXECUTE FUNCTION chaos_outbox();
"#;

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
// Processes

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Role {
    Consumer,
    Relay,
}

/// One supervised process position: when its process dies, a new generation replaces it.
struct Slot {
    name: &'static str,
    role: Role,
    /// Never killed or stopped: its memory and connections are the soak's measure.
    witness: bool,
    generation: u32,
    worker: Worker,
    worker_id: String,
    armed: Option<String>,
    stopped: bool,
    /// SIGKILLed by the driver (its fault and takeover are already recorded).
    killed: bool,
}

struct Cluster {
    env: Vec<(String, String)>,
    /// More variables for the processes of one slot (by its name), after `env`.
    extra: BTreeMap<&'static str, Vec<(String, String)>>,
    logs: std::path::PathBuf,
    slots: Vec<Slot>,
    /// Every log file ever written, for the final analysis.
    all_logs: Vec<std::path::PathBuf>,
    /// When each process (by worker id) was seen dead or was killed.
    ended: BTreeMap<String, DateTime<Utc>>,
}

impl Cluster {
    fn spawn(
        &mut self,
        name: &'static str,
        role: Role,
        generation: u32,
        armed: Option<String>,
    ) -> (Worker, String) {
        let id = format!("{name}-g{generation}");
        let log = self.logs.join(format!("{id}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"));
        let role_args: &[&str] = match role {
            Role::Consumer => &["--consumer"],
            Role::Relay => &["--relay", "--maintenance"],
        };
        cmd.args([
            "run",
            "--kinds",
            "probe,compile,deletion,research",
            "--worker-id",
            &id,
        ])
        .args(role_args)
        .stdout(std::process::Stdio::null())
        .stderr(file);
        for (k, v) in self
            .env
            .iter()
            .chain(self.extra.get(name).into_iter().flatten())
        {
            cmd.env(k, v);
        }
        if let Some(point) = &armed {
            cmd.env("KFS_CRASH_AT", point);
        }
        if role == Role::Consumer {
            cmd.env("KFS_CLOSE_CHANNEL_FILE", self.close_file(&id));
        }
        let child = cmd.spawn().expect("spawn kfs-worker");
        self.all_logs.push(log.clone());
        (
            Worker {
                child,
                log,
                name: id.clone(),
            },
            id,
        )
    }

    fn add(&mut self, name: &'static str, role: Role, witness: bool) {
        let (worker, worker_id) = self.spawn(name, role, 0, None);
        self.slots.push(Slot {
            name,
            role,
            witness,
            generation: 0,
            worker,
            worker_id,
            armed: None,
            stopped: false,
            killed: false,
        });
    }

    /// The file whose appearance makes consumer `id` close one kind's channel (see
    /// [`close_a_channel`]).
    fn close_file(&self, id: &str) -> std::path::PathBuf {
        self.logs.join(format!("{id}.close"))
    }

    /// Replaces the process of slot `i` with a new generation, armed at a kill point or not.
    fn respawn(&mut self, i: usize, armed: Option<String>) {
        let (name, role, generation) = {
            let s = &self.slots[i];
            (s.name, s.role, s.generation + 1)
        };
        let (worker, worker_id) = self.spawn(name, role, generation, armed.clone());
        let s = &mut self.slots[i];
        s.generation = generation;
        s.worker = worker;
        s.worker_id = worker_id;
        s.armed = armed;
        s.stopped = false;
        s.killed = false;
    }
}

// ---------------------------------------------------------------------------------------------
// Measures

/// A process death or pause whose jobs others must take over.
struct Takeover {
    at: DateTime<Utc>,
    jobs: Vec<Uuid>,
}

#[derive(Default)]
struct Record {
    faults: BTreeMap<String, u64>,
    crash_points: BTreeMap<String, u64>,
    takeovers: Vec<Takeover>,
    /// Service back at (database clock), for "time to the first effect after recovery".
    recoveries: Vec<(String, DateTime<Utc>)>,
    outage_cpu: Vec<String>,
    outage_cpu_ok: bool,
    samples: Vec<Sample>,
    jobs: Vec<(Uuid, &'static str)>,
    /// Enqueues that failed, each committed or not: [`settle_in_doubt`] finds out which.
    in_doubt: Vec<(Uuid, &'static str)>,
    /// How many of them had committed.
    in_doubt_committed: usize,
    /// The platform's jobs requested during the run.
    platform: platform::Requested,
    /// Consumer channels the broker was made to close.
    channel_closes: Vec<ChannelClose>,
    /// When the faulty phase ended (no new probe jobs after it).
    faults_ended: Option<DateTime<Utc>>,
    /// Unexpected events worth reading in the report.
    notes: Vec<String>,
}

/// One request to a consumer process to have the broker close one kind's channel.
struct ChannelClose {
    /// The process (its worker id) and its log.
    process: String,
    log: std::path::PathBuf,
    kind: &'static str,
    /// Which of the process's plays this is (1 for its first), once it played it.
    played: Option<usize>,
}

impl Record {
    fn fault(&mut self, kind: &str) {
        *self.faults.entry(kind.to_owned()).or_default() += 1;
    }
}

struct Sample {
    at_s: u64,
    rss_kb: Vec<(String, u64)>,
    pg_sessions: i64,
    pg_proxy_open: usize,
    mq_proxy_open: usize,
    mq_connections: Option<usize>,
    accepted: (u64, u64),
}

fn rss_kb(pid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// utime + stime of a process, in clock ticks.
fn cpu_ticks(pid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces; fields after it start past the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

fn clock_ticks() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

// ---------------------------------------------------------------------------------------------
// Database helpers (all through the direct pool, never the proxy)

async fn db_now(pool: &PgPool) -> Option<DateTime<Utc>> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await
        .ok()
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Jobs a process of worker id `worker` (any incarnation) holds a live lease on at `at`.
async fn held_by(pool: &PgPool, worker: &str) -> Option<(DateTime<Utc>, Vec<Uuid>)> {
    let at = db_now(pool).await?;
    let jobs = sqlx::query_scalar(
        "SELECT id FROM kfs_probe_jobs WHERE run_state = 'running' AND left(worker_id, length($1) + 1) = $1 || '#' AND lease_expires_at > $2",
    )
    .bind(worker)
    .bind(at)
    .fetch_all(pool)
    .await
    .ok()?;
    Some((at, jobs))
}

async fn terminate_worker_sessions(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = $1 AND pid <> pg_backend_pid() AND application_name LIKE 'kfs-worker%'",
    )
    .bind(DB)
    .fetch_one(pool)
    .await
    .unwrap_or(0)
}

/// Probe behaviours of the workload and the final state each must reach.
fn workload_spec(rng: &mut StdRng) -> (ProbeSpec, &'static str) {
    let roll: f64 = rng.random();
    let (fail_mode, want) = if roll < 0.05 {
        ("fatal", "failed")
    } else if roll < 0.15 {
        ("retry_once", "succeeded")
    } else {
        ("none", "succeeded")
    };
    let spec = ProbeSpec {
        steps: rng.random_range(1..=10),
        step_sleep: Duration::from_millis(if rng.random_bool(0.3) {
            rng.random_range(50..=300)
        } else {
            rng.random_range(0..=20)
        }),
        fail_mode,
        max_attempts: 100,
    };
    (spec, want)
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

/// A run's database and object store.
struct RunDatabase {
    pool: PgPool,
    store_dir: std::path::PathBuf,
    store_url: String,
    space: kfs_worker::tools::platform::NotesSpace,
}

/// Creates database [`DB`] on `pg`, migrated, with the probe kind and the observers of both
/// the probe's and the platform's tables, and the platform's space seeded in an object store
/// of its own.
async fn run_database(pg: &PrivatePostgres, seed: u64) -> RunDatabase {
    {
        let mut admin = sqlx::PgConnection::connect_with(&pg.url("postgres").parse().unwrap())
            .await
            .expect("connect to the private Postgres");
        sqlx::Executor::execute(&mut admin, format!("CREATE DATABASE {DB}").as_str())
            .await
            .unwrap();
    }
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&pg.url(DB))
        .await
        .unwrap();
    kfs_worker::db::migrate(&pool).await.expect("migrate");
    probe::install(&pool).await.expect("install probe kind");
    sqlx::raw_sql(OBSERVERS)
        .execute(&pool)
        .await
        .expect("observers");
    sqlx::raw_sql(platform::OBSERVERS)
        .execute(&pool)
        .await
        .expect("observers of the platform's tables");
    let store_dir =
        std::env::temp_dir().join(format!("kfschaos-store-{seed}-{}", Uuid::new_v4().simple()));
    let store_url = format!("file://{}", store_dir.display());
    let store = kfs_worker::store::Store::open(
        &kfs_worker::config::object_store(&store_url).expect("object store URL"),
    )
    .expect("object store");
    let space = platform::seed(&pool, &store).await;
    RunDatabase {
        pool,
        store_dir,
        store_url,
        space,
    }
}

/// The worker settings of every run, beside where the services and the store are.
fn worker_settings() -> Vec<(String, String)> {
    [
        ("KFS_LOG_FORMAT", "json"),
        (
            "RUST_LOG",
            "info,kfs_worker::ack=debug,sqlx=warn,lapin=error",
        ),
        ("KFS_LEASES", LEASE),
        ("KFS_SLICE_STEPS", "4"),
        ("KFS_RETRY_BASE", "200ms"),
        ("KFS_RETRY_MAX", "2s"),
        ("KFS_RELAY_POLL", "250ms"),
        ("KFS_VISIBILITY", "20s"),
        ("KFS_SHUTDOWN_GRACE", "5s"),
        ("KFS_CONNECT_TIMEOUT", "2s"),
        ("KFS_PREFETCH", "8"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// The probe jobs enqueued, and those in doubt (see [`settle_in_doubt`]).
type Enqueued = (Vec<(Uuid, &'static str)>, Vec<(Uuid, &'static str)>);

/// Enqueues probe jobs as the platform would, through the direct pool, until `stop`.
fn enqueue_probe_jobs(
    pool: PgPool,
    stop: tokio_util::sync::CancellationToken,
    seed: u64,
) -> tokio::task::JoinHandle<Enqueued> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    tokio::spawn(async move {
        let mut jobs: Vec<(Uuid, &'static str)> = Vec::new();
        let mut in_doubt: Vec<(Uuid, &'static str)> = Vec::new();
        while !stop.is_cancelled() {
            let (spec, want) = workload_spec(&mut rng);
            let id = Uuid::now_v7();
            let made = async {
                let mut conn = pool.acquire().await?;
                probe::enqueue_as(&mut conn, id, &spec).await
            }
            .await;
            // With Postgres down the platform's API fails too; the next one is tried later.
            // A failed insert may still have committed (Postgres crashed after its commit
            // and before its answer): it is in doubt until the table says, after recovery.
            match made {
                Ok(()) => jobs.push((id, want)),
                Err(_) => in_doubt.push((id, want)),
            }
            tokio::time::sleep(Duration::from_millis(rng.random_range(20..=120))).await;
        }
        (jobs, in_doubt)
    })
}

/// Waits, replacing dead processes, until every job is terminal (at most 240 s): whether they
/// all were, and how long it took in seconds.
async fn drain(cluster: &mut Cluster, rec: &mut Record, pool: &PgPool) -> (bool, f64) {
    let drain_start = Instant::now();
    while drain_start.elapsed() < Duration::from_secs(240) {
        supervise_unarmed(cluster, rec, pool).await;
        let open = count(pool, "SELECT count(*) FROM kfs_probe_jobs WHERE run_state NOT IN ('succeeded', 'failed', 'canceled')").await
            + platform::open(pool).await;
        if open == 0 {
            return (true, drain_start.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    (false, drain_start.elapsed().as_secs_f64())
}

async fn queue_depths(amqp_url: &str, topology: &Topology) -> (u32, u32) {
    let Ok(conn) =
        lapin::Connection::connect(amqp_url, lapin::ConnectionProperties::default()).await
    else {
        return (u32::MAX, u32::MAX);
    };
    // (every job queue summed, the dead letters); a queue that cannot be read counts as full.
    let mut out = [0u32; 2];
    let queues = KINDS
        .iter()
        .map(|k| (0, topology.queue(*k)))
        .chain([(1, topology.dead_letter_queue())]);
    for (i, q) in queues {
        let mut depth = u32::MAX;
        if let Ok(ch) = conn.create_channel().await {
            if let Ok(q) = ch
                .queue_declare(
                    q.as_str().into(),
                    lapin::options::QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    lapin::types::FieldTable::default(),
                )
                .await
            {
                depth = q.message_count();
            }
        }
        out[i] = out[i].saturating_add(depth);
    }
    let _ = conn.close(200, "bye".into()).await;
    (out[0], out[1])
}

async fn sample(
    cluster: &Cluster,
    pool: &PgPool,
    mq: &Arc<PrivateRabbit>,
    pg_proxy: &Proxy,
    mq_proxy: &Proxy,
    since: Instant,
) -> Sample {
    let mq2 = mq.clone();
    let mq_connections = tokio::task::spawn_blocking(move || mq2.connections())
        .await
        .unwrap();
    Sample {
        mq_connections,
        accepted: (pg_proxy.accepted(), mq_proxy.accepted()),
        at_s: since.elapsed().as_secs(),
        rss_kb: cluster
            .slots
            .iter()
            .filter(|s| s.witness)
            .map(|s| (s.worker_id.clone(), rss_kb(s.worker.pid()).unwrap_or(0)))
            .collect(),
        pg_sessions: sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name LIKE 'kfs-worker%'",
        )
        .bind(DB)
        .fetch_one(pool)
        .await
        .unwrap_or(-1),
        pg_proxy_open: pg_proxy.open_connections(),
        mq_proxy_open: mq_proxy.open_connections(),
    }
}

/// Notices dead processes, records why they died and what they held, and replaces them; the
/// new generation is armed at a random kill point half of the time (never the witnesses).
async fn supervise(cluster: &mut Cluster, rec: &mut Record, pool: &PgPool, rng: &mut StdRng) {
    for i in 0..cluster.slots.len() {
        if !reap(cluster, rec, pool, i).await {
            continue;
        }
        let s = &cluster.slots[i];
        let armed = (!s.witness && rng.random_bool(0.5)).then(|| {
            let points: &[&str] = match s.role {
                Role::Consumer => &CONSUMER_POINTS,
                Role::Relay => &RELAY_POINTS,
            };
            format!(
                "{}:{}",
                points[rng.random_range(0..points.len())],
                rng.random_range(1..=15)
            )
        });
        cluster.respawn(i, armed);
    }
}

/// As [`supervise`], with nothing armed: the recovery phase.
async fn supervise_unarmed(cluster: &mut Cluster, rec: &mut Record, pool: &PgPool) {
    for i in 0..cluster.slots.len() {
        if reap(cluster, rec, pool, i).await {
            cluster.respawn(i, None);
        }
    }
}

/// Whether slot `i`'s process has died (and is now accounted for).
async fn reap(cluster: &mut Cluster, rec: &mut Record, pool: &PgPool, i: usize) -> bool {
    let s = &mut cluster.slots[i];
    let Ok(Some(_)) = s.worker.child.try_wait() else {
        return false;
    };
    cluster
        .ended
        .entry(s.worker_id.clone())
        .or_insert_with(Utc::now);
    if s.killed {
        return true;
    }
    let log = s.worker.log_text();
    let point = s.armed.as_ref().and_then(|a| a.split(':').next());
    match point {
        Some(point) if log.contains(&format!("crash point {point} reached")) => {
            *rec.crash_points.entry(point.to_owned()).or_default() += 1;
            rec.fault("kill point (abort)");
        }
        _ => {
            rec.fault("process exited by itself");
            let status = s.worker.child.try_wait().ok().flatten();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(3)..].join(" | ");
            rec.notes.push(format!(
                "{} exited by itself ({status:?}): {tail}",
                s.worker_id
            ));
        }
    }
    if let Some((at, jobs)) = held_by(pool, &s.worker_id).await {
        if !jobs.is_empty() {
            rec.takeovers.push(Takeover { at, jobs });
        }
    }
    true
}

#[allow(clippy::too_many_arguments)]
async fn inject(
    cluster: &mut Cluster,
    rec: &mut Record,
    pool: &PgPool,
    pg: &Arc<PrivatePostgres>,
    mq: &Arc<PrivateRabbit>,
    pg_proxy: &Proxy,
    mq_proxy: &Proxy,
    rng: &mut StdRng,
) {
    let victims: Vec<usize> = (0..cluster.slots.len())
        .filter(|&i| !cluster.slots[i].witness)
        .collect();
    let roll = rng.random_range(0..110);
    match roll {
        100.. => close_a_channel(cluster, rec, rng).await,
        0..=24 => {
            let i = victims[rng.random_range(0..victims.len())];
            let s = &mut cluster.slots[i];
            let held = held_by(pool, &s.worker_id).await;
            s.worker.kill();
            s.killed = true;
            cluster.ended.insert(s.worker_id.clone(), Utc::now());
            rec.fault(match s.role {
                Role::Consumer => "SIGKILL consumer",
                Role::Relay => "SIGKILL relay",
            });
            if let Some((at, jobs)) = held {
                if !jobs.is_empty() {
                    rec.takeovers.push(Takeover { at, jobs });
                }
            }
        }
        25..=37 => {
            // Paused past its lease: others take its jobs; when it wakes it must be fenced out.
            let consumers: Vec<usize> = victims
                .iter()
                .copied()
                .filter(|&i| cluster.slots[i].role == Role::Consumer)
                .collect();
            let i = consumers[rng.random_range(0..consumers.len())];
            let held = held_by(pool, &cluster.slots[i].worker_id).await;
            cluster.slots[i].worker.signal("STOP");
            cluster.slots[i].stopped = true;
            rec.fault("SIGSTOP past the lease, then SIGCONT");
            if let Some((at, jobs)) = held {
                if !jobs.is_empty() {
                    rec.takeovers.push(Takeover { at, jobs });
                }
            }
            tokio::time::sleep(Duration::from_millis(rng.random_range(5000..=8000))).await;
            cluster.slots[i].worker.signal("CONT");
            cluster.slots[i].stopped = false;
        }
        38..=47 => {
            let n = terminate_worker_sessions(pool).await;
            rec.fault("pg_terminate_backend of worker sessions");
            let _ = n;
        }
        48..=57 => {
            let ms = rng.random_range(50..=400);
            let target = if rng.random_bool(0.5) {
                (pg_proxy, "postgres")
            } else {
                (mq_proxy, "rabbitmq")
            };
            target.0.set_latency(ms);
            rec.fault(&format!("latency ({})", target.1));
            tokio::time::sleep(Duration::from_millis(rng.random_range(2000..=5000))).await;
            target.0.set_latency(0);
        }
        58..=67 => {
            let target = if rng.random_bool(0.5) {
                (pg_proxy, "postgres")
            } else {
                (mq_proxy, "rabbitmq")
            };
            target.0.cut_all();
            rec.fault(&format!("connections cut ({})", target.1));
        }
        68..=77 => {
            let target = if rng.random_bool(0.5) {
                (pg_proxy, "postgres")
            } else {
                (mq_proxy, "rabbitmq")
            };
            target.0.set_hold(true);
            rec.fault(&format!("half-open connections ({})", target.1));
            tokio::time::sleep(Duration::from_millis(rng.random_range(3000..=8000))).await;
            if rng.random_bool(0.5) {
                target.0.cut_all();
            }
            target.0.set_hold(false);
        }
        78..=88 => {
            let down = Duration::from_millis(rng.random_range(1000..=5000));
            let mq2 = mq.clone();
            tokio::task::spawn_blocking(move || {
                mq2.stop_app();
                std::thread::sleep(down);
                mq2.start_app();
            })
            .await
            .unwrap();
            rec.fault("RabbitMQ restart");
            if let Some(at) = db_now(pool).await {
                rec.recoveries.push(("RabbitMQ restart".into(), at));
            }
        }
        _ => {
            let down = Duration::from_millis(rng.random_range(1000..=5000));
            let pg2 = pg.clone();
            tokio::task::spawn_blocking(move || {
                pg2.crash();
                std::thread::sleep(down);
                pg2.up();
            })
            .await
            .unwrap();
            rec.fault("Postgres crash-restart");
            if let Some(at) = db_now(pool).await {
                rec.recoveries.push(("Postgres crash-restart".into(), at));
            }
        }
    }
}

/// How often a consumer's play of a channel close appears in its log.
fn plays(log: &str) -> usize {
    log.matches(CLOSE_PLAYED).count()
}

/// What a consumer logs when it plays the fault (`src/consumer/consume.rs`).
const CLOSE_PLAYED: &str = "fault injection: acking a delivery tag this channel never had";

/// Has the broker close one kind's channel in one consumer process while the process and its
/// connection stay up: the process acks a delivery tag that channel never had (a crash-points
/// fault, `KFS_CLOSE_CHANNEL_FILE`), the broker closes the channel with 406 and puts its unacked
/// deliveries back in the queue, and the process must consume that kind again at once. Only a
/// running, unpaused consumer that is armed at no kill point is chosen (the witness always
/// qualifies), so that the process lives to show its restart. Waits until the process played
/// it and consumes every kind again (or 15 s), so that no other fault mixes into it.
async fn close_a_channel(cluster: &mut Cluster, rec: &mut Record, rng: &mut StdRng) {
    let mut able = Vec::new();
    for (i, s) in cluster.slots.iter_mut().enumerate() {
        if s.role == Role::Consumer
            && !s.stopped
            && s.armed.is_none()
            && matches!(s.worker.child.try_wait(), Ok(None))
        {
            able.push(i);
        }
    }
    if able.is_empty() {
        return;
    }
    let i = able[rng.random_range(0..able.len())];
    let kind = KINDS[rng.random_range(0..KINDS.len())].name();
    let (process, log) = {
        let s = &cluster.slots[i];
        (s.worker_id.clone(), s.worker.log.clone())
    };
    let file = cluster.close_file(&process);
    let before = plays(&std::fs::read_to_string(&log).unwrap_or_default());
    // Written whole, then moved into place: the worker never reads half of it.
    let partial = file.with_extension("partial");
    std::fs::write(&partial, kind).expect("write the channel-close file");
    std::fs::rename(&partial, &file).expect("place the channel-close file");
    let asked = Instant::now();
    let mut close = ChannelClose {
        process,
        log,
        kind,
        played: None,
    };
    while asked.elapsed() < Duration::from_secs(15) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let text = std::fs::read_to_string(&close.log).unwrap_or_default();
        if close.played.is_none() {
            if plays(&text) > before {
                close.played = Some(before + 1);
            } else if asked.elapsed() > Duration::from_secs(5)
                && std::fs::remove_file(&file).is_ok()
            {
                // Taken back before the process took it (no consumer of the kind meanwhile).
                break;
            }
        }
        if close
            .played
            .is_some_and(|n| consuming_again(&text, n).is_some())
        {
            break;
        }
    }
    rec.fault(if close.played.is_some() {
        "consumer channel closed by the broker"
    } else {
        "consumer channel close not played (no consumer of the kind in time)"
    });
    rec.channel_closes.push(close);
}

/// What a consumer's log shows after its `n`-th play of a channel close.
struct Restart {
    /// The kind whose channel was closed (from the play line).
    kind: String,
    /// The session restarted that kind on a new channel (before any reconnect).
    restarted: bool,
    /// The session ended instead (the connection lost or given up).
    reconnected: bool,
    /// From the play to every kind consuming again, by the log's clock.
    back_ms: f64,
    /// When every kind consumed again, in µs since the epoch.
    back_at_us: i64,
}

/// The restart that followed the `n`-th play of a channel close in `log`, once every kind of
/// the process consumes again: `None` while it has not (or the process stopped logging first).
fn consuming_again(log: &str, n: usize) -> Option<Restart> {
    let mut lines = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok());
    let field = |v: &serde_json::Value, k: &str| {
        v.get(k)
            .and_then(|x| x.as_str())
            .unwrap_or_default()
            .to_owned()
    };
    let at = |v: &serde_json::Value| {
        DateTime::parse_from_rfc3339(&field(v, "timestamp"))
            .map(|t| t.timestamp_micros())
            .ok()
    };
    let play = lines
        .by_ref()
        .filter(|v| field(v, "message").starts_with(CLOSE_PLAYED))
        .nth(n - 1)?;
    let kind = field(&play, "kind");
    let played_at = at(&play)?;
    let mut restarted = false;
    let mut reconnected = false;
    for v in lines {
        let message = field(&v, "message");
        if message == "a consumer stopped; consuming its queue again on a new channel"
            && field(&v, "kind") == kind
        {
            restarted = true;
        } else if message == "a consumer stopped; reconnecting"
            || message.starts_with("consumer cannot connect")
        {
            reconnected = true;
        } else if message == "consuming" && (restarted || reconnected) {
            // A process can play the close as it starts, before its session has said it
            // consumes: that first "consuming" is the session's own, not the way back.
            let back_at_us = at(&v)?;
            return Some(Restart {
                kind,
                restarted,
                reconnected,
                back_ms: (back_at_us - played_at) as f64 / 1000.0,
                back_at_us,
            });
        }
    }
    None
}

/// A long outage of one service; checks that the workers idle (no busy loop) meanwhile.
async fn outage(
    which: &str,
    cluster: &mut Cluster,
    rec: &mut Record,
    pool: &PgPool,
    pg: &Arc<PrivatePostgres>,
    mq: &Arc<PrivateRabbit>,
) {
    let (label, down) = match which {
        "rabbitmq" => ("RabbitMQ down 60 s", Duration::from_secs(60)),
        _ => ("Postgres down 30 s", Duration::from_secs(30)),
    };
    println!("chaos: {label}");
    let ticks = clock_ticks();
    let pg2 = pg.clone();
    let mq2 = mq.clone();
    let is_mq = which == "rabbitmq";
    tokio::task::spawn_blocking(move || if is_mq { mq2.stop_app() } else { pg2.crash() })
        .await
        .unwrap();
    // Let the reconnect attempts settle into their backoff before measuring.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let before: Vec<(String, i32, Option<u64>)> = cluster
        .slots
        .iter()
        .map(|s| {
            (
                s.worker_id.clone(),
                s.worker.pid(),
                cpu_ticks(s.worker.pid()),
            )
        })
        .collect();
    let t0 = Instant::now();
    tokio::time::sleep(down - Duration::from_secs(5)).await;
    let wall = t0.elapsed().as_secs_f64();
    for (id, pid, b) in before {
        let (Some(b), Some(a)) = (b, cpu_ticks(pid)) else {
            continue;
        };
        let cpu_s = (a - b) as f64 / ticks as f64;
        let share = cpu_s / wall;
        // A reconnect loop with backoff uses well under a tenth of a core; a busy loop uses all.
        if share > 0.25 {
            rec.outage_cpu_ok = false;
        }
        rec.outage_cpu.push(format!(
            "{label}: {id} used {cpu_s:.2} s CPU in {wall:.0} s ({:.1} %)",
            share * 100.0
        ));
    }
    let mut alive = 0;
    for s in &mut cluster.slots {
        if matches!(s.worker.child.try_wait(), Ok(None)) {
            alive += 1;
        }
    }
    rec.outage_cpu.push(format!(
        "{label}: {alive} of {} processes still running at the end of the outage",
        cluster.slots.len()
    ));
    let pg2 = pg.clone();
    let mq2 = mq.clone();
    tokio::task::spawn_blocking(move || if is_mq { mq2.start_app() } else { pg2.up() })
        .await
        .unwrap();
    rec.fault(label);
    if let Some(at) = db_now(pool).await {
        rec.recoveries.push((label.to_owned(), at));
    }
}

// ---------------------------------------------------------------------------------------------
// Verdicts

struct Check {
    name: &'static str,
    ok: bool,
    detail: String,
}

fn check(name: &'static str, ok: bool, detail: impl Into<String>) -> Check {
    Check {
        name,
        ok,
        detail: detail.into(),
    }
}

/// An `acked` line of a worker's ack log.
struct Ack {
    /// The process that acked (its worker id, from its log's name).
    process: String,
    kind: String,
    delivery_id: String,
    claim: String,
    end: String,
    /// When the ack left the worker, in microseconds since the epoch.
    sent_at: i64,
}

fn read_logs(cluster: &Cluster) -> (Vec<Ack>, BTreeMap<String, u64>) {
    let mut acks = Vec::new();
    let mut warnings: BTreeMap<String, u64> = BTreeMap::new();
    for path in &cluster.all_logs {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let process = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let field = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or("").to_owned();
            if field("message") == "acked" {
                acks.push(Ack {
                    process: process.clone(),
                    kind: field("kind"),
                    delivery_id: field("delivery_id"),
                    claim: field("claim"),
                    end: field("end"),
                    sent_at: v
                        .get("sent_at")
                        .and_then(serde_json::Value::as_i64)
                        .unwrap_or(0),
                });
            } else if matches!(field("level").as_str(), "WARN" | "ERROR") {
                *warnings.entry(field("message")).or_default() += 1;
            }
        }
    }
    (acks, warnings)
}

/// Moves each enqueue in doubt that did commit into the jobs the run must account for; one
/// that did not is as a request the platform's API refused.
async fn settle_in_doubt(pool: &PgPool, rec: &mut Record) {
    let ids: Vec<Uuid> = rec.in_doubt.iter().map(|(id, _)| *id).collect();
    let committed: HashSet<Uuid> =
        sqlx::query_scalar("SELECT id FROM kfs_probe_jobs WHERE id = ANY($1)")
            .bind(&ids)
            .fetch_all(pool)
            .await
            .expect("look up the enqueues in doubt")
            .into_iter()
            .collect();
    rec.in_doubt_committed = committed.len();
    let found = rec.in_doubt.iter().filter(|(id, _)| committed.contains(id));
    rec.jobs.extend(found.copied());
}

/// The outbox status the end of a slice writes, in the end's own transaction (`end_*` in
/// `src/engine/lease.rs`, and the group ends of `src/engine/lease/batched.rs`).
fn outbox_status_of_end(end: &str) -> Option<&'static str> {
    Some(match end {
        "succeeded" => "completed",
        "failed" => "dead",
        "canceled" | "superseded" => "canceled",
        "wait" | "continue" => "pending",
        _ => return None,
    })
}

/// Per ack: (its index, delivery id given to its row at (µs), the deciding commit found (µs),
/// whether that commit carries the delivery's own id, a newer id given to the row at (µs)).
type AckVerdict = (i64, Option<i64>, Option<i64>, Option<bool>, Option<i64>);

/// "No message acked before its commit", ack by ack, from the ack log and the observers. Commit
/// times come from `track_commit_timestamp` (on in this cluster); `sent_at` is when the ack
/// left the worker. What each ack must follow:
///
/// - Every ack, whatever its outcome: the relay's claim that gave the row this delivery id
///   (`dispatching` under it). It committed before the message was published; the run sends
///   no foreign messages.
/// - `claimed` with an end that decides the slice (succeeded, failed, canceled, superseded,
///   wait, continue): the commit that ended the very lease this delivery's claim issued. The
///   claim is found by the delivery id (its `leased` outbox write) and the lease token written
///   in the same transaction, by a holder of the acking process; the end is the transaction that
///   cleared that token, written by a session of the acking process, whose outbox write has the
///   status the end names (completed, dead, canceled, pending). That write carries the
///   delivery's own id, except when the relay published the row again while the slice ran (its
///   worker looked dead for a moment): the end then writes under the newer id, and the lease
///   is what ties it to this delivery (counted in the detail).
/// - `claimed` / `lease_lost`: no commit of its own: the slice was fenced out and wrote nothing
///   more; the job belongs to whoever holds it now. It must follow its claim (by the process).
/// - `exhausted`: the diagnosis failed the job in its own transaction, writing the row `dead`
///   (`fail_exhausted`): that write, by a session of the acking process, before the ack.
/// - `terminal`: the diagnosis settled the row of a job already ended (`settle`, `completed` /
///   `dead` / `canceled` under this delivery's id), or another copy of the same delivery did
///   first (the broker redelivers a delivery whose channel closed before its ack): a settling
///   write under this id before the ack. Exception: the diagnosis reads without locks, so the
///   relay may give the row a newer id between the diagnosis and the settle, which then writes
///   nothing; then that newer id, given before the ack, is what must be found.
/// - `duplicate`: no commit of its own (the diagnosis saw another live lease; re-arming the
///   row's due time writes only when it differs): a claim of the job before the ack.
/// - `stale`: no commit of its own (the delivery was replaced, its row settled or its job not
///   claimable; a re-arm at the retry time writes only sometimes): only the first rule.
async fn acks_after_their_commits(pool: &PgPool, acks: &[Ack]) -> Check {
    let name = "no message acked before its commit";
    let want: Vec<String> = acks
        .iter()
        .map(|a| match a.claim.as_str() {
            "claimed" => outbox_status_of_end(&a.end).map_or(a.end.clone(), str::to_owned),
            _ => String::new(),
        })
        .collect();
    let verdicts: Vec<AckVerdict> = sqlx::query_as(
        "WITH a AS (SELECT (i - 1)::bigint AS i, p, d, claim, want, sent FROM \
           unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[]) WITH ORDINALITY \
           AS a(p, d, claim, want, sent, i)), \
         x AS (SELECT a.*, g.job, g.given_id, g.given_us FROM a LEFT JOIN LATERAL ( \
             SELECT r.job_id AS job, r.id AS given_id, chaos_us(r.xmin) AS given_us \
             FROM chaos_outbox r WHERE r.queue_job_id = a.d AND r.status = 'dispatching' \
             ORDER BY r.id LIMIT 1) g ON true) \
         SELECT x.i, x.given_us, v.committed, v.own, n.newer FROM x \
         LEFT JOIN LATERAL ( \
           SELECT chaos_us(o.xmin) AS committed, o.queue_job_id = x.d AS own \
           FROM chaos_outbox oc \
           JOIN chaos_claims c ON c.tx = oc.tx AND c.job_id = oc.job_id \
           JOIN chaos_ends e ON e.job_id = c.job_id AND e.lease_token = c.lease_token \
           JOIN chaos_outbox o ON o.tx = e.tx AND o.job_id = e.job_id \
           WHERE x.claim = 'claimed' AND x.want IN ('completed', 'dead', 'canceled', 'pending') \
             AND oc.queue_job_id = x.d AND oc.status = 'leased' \
             AND left(c.worker_id, length(x.p) + 1) = x.p || '#' \
             AND (e.writer = 'kfs-worker ' || x.p \
               OR left(e.writer, length(x.p) + 12) = 'kfs-worker ' || x.p || ' ') \
             AND o.status = x.want \
           UNION ALL \
           SELECT chaos_us(c.xmin), true FROM chaos_outbox oc \
           JOIN chaos_claims c ON c.tx = oc.tx AND c.job_id = oc.job_id \
           WHERE x.claim = 'claimed' AND x.want = 'lease_lost' \
             AND oc.queue_job_id = x.d AND oc.status = 'leased' \
             AND left(c.worker_id, length(x.p) + 1) = x.p || '#' \
           UNION ALL \
           SELECT chaos_us(o.xmin), o.queue_job_id = x.d FROM chaos_outbox o \
           WHERE x.claim = 'exhausted' AND o.job_id = x.job \
             AND o.status = 'dead' AND o.old_status <> 'dead' \
             AND (o.writer = 'kfs-worker ' || x.p \
               OR left(o.writer, length(x.p) + 12) = 'kfs-worker ' || x.p || ' ') \
           UNION ALL \
           SELECT chaos_us(o.xmin), true FROM chaos_outbox o \
           WHERE x.claim = 'terminal' AND o.job_id = x.job AND o.queue_job_id = x.d \
             AND o.status IN ('completed', 'dead', 'canceled') AND o.old_status <> o.status \
           UNION ALL \
           SELECT chaos_us(c.xmin), false FROM chaos_claims c \
           WHERE x.claim = 'duplicate' AND c.job_id = x.job \
           ORDER BY 1 LIMIT 1) v ON true \
         LEFT JOIN LATERAL ( \
           SELECT min(chaos_us(o.xmin)) AS newer FROM chaos_outbox o \
           WHERE x.claim = 'terminal' AND o.job_id = x.job AND o.status = 'dispatching' \
             AND o.id > x.given_id AND o.queue_job_id <> x.d) n ON true \
         ORDER BY x.i",
    )
    .bind(acks.iter().map(|a| a.process.clone()).collect::<Vec<_>>())
    .bind(
        acks.iter()
            .map(|a| a.delivery_id.clone())
            .collect::<Vec<_>>(),
    )
    .bind(acks.iter().map(|a| a.claim.clone()).collect::<Vec<_>>())
    .bind(&want)
    .bind(acks.iter().map(|a| a.sent_at).collect::<Vec<_>>())
    .fetch_all(pool)
    .await
    .unwrap();
    let mut bad = Vec::new();
    let mut by: BTreeMap<String, u64> = BTreeMap::new();
    let mut newer_id = 0u64;
    let mut terminal_raced = 0u64;
    for (i, given, committed, own, newer) in verdicts {
        let a = &acks[usize::try_from(i).expect("an index")];
        let before = |t: Option<i64>| t.is_some_and(|t| t <= a.sent_at);
        let decided = a.claim == "claimed" && outbox_status_of_end(&a.end).is_some();
        let ok = before(given)
            && a.sent_at > 0
            && match a.claim.as_str() {
                "claimed" if decided || a.end == "lease_lost" => before(committed),
                "exhausted" | "duplicate" => before(committed),
                "terminal" if before(committed) => true,
                "terminal" if before(newer) => {
                    terminal_raced += 1;
                    true
                }
                "stale" => true,
                _ => false,
            };
        if !ok {
            bad.push(format!(
                "{} {} {}/{} sent {} given {given:?} committed {committed:?}",
                a.process, a.delivery_id, a.claim, a.end, a.sent_at
            ));
            continue;
        }
        if decided && own == Some(false) {
            newer_id += 1;
        }
        let class = if decided {
            "decided a slice"
        } else {
            a.claim.as_str()
        };
        let class = if a.end == "lease_lost" {
            "lease_lost"
        } else {
            class
        };
        *by.entry(class.to_owned()).or_default() += 1;
    }
    let decided = by.get("decided a slice").copied().unwrap_or(0);
    let shown: Vec<&String> = bad.iter().take(10).collect();
    check(
        name,
        bad.is_empty() && decided > 0,
        format!(
            "{} acks logged, each after the commit it rests on ({by:?}): each that decided a slice \
             after the commit that ended the lease its own claim issued, by its process, with the \
             outbox status its end names ({newer_id} of them under a newer delivery id, the row \
             published again while the slice ran); each lease_lost after its claim, exhausted after \
             its dead row, terminal after its row settled under its id ({terminal_raced} after a \
             newer id instead), duplicate after a claim of its job; every delivery id given by a \
             relay before its ack. Not so ({} acks, the first 10: process, delivery, claim/end, \
             sent, id given, commit found, in µs): {shown:?}",
            acks.len(),
            bad.len()
        ),
    )
}

/// Every channel close a consumer played: the process restarted that kind's consumer on a new
/// channel of the same connection (no reconnect in between) and consumed every kind again; and,
/// for the probe kind, whose jobs arrive all the time, it acked probe deliveries after that,
/// unless it died within 10 s or the run stopped enqueuing within 10 s.
fn channels_consumed_again(rec: &Record, cluster: &Cluster, acks: &[Ack]) -> Check {
    let mut bad = Vec::new();
    let mut played: BTreeMap<&str, u64> = BTreeMap::new();
    let mut acked_after = 0;
    let mut times: Vec<f64> = Vec::new();
    let margin = chrono::TimeDelta::seconds(10);
    for c in &rec.channel_closes {
        let Some(n) = c.played else { continue };
        *played.entry(c.kind).or_default() += 1;
        let text = std::fs::read_to_string(&c.log).unwrap_or_default();
        let Some(r) = consuming_again(&text, n) else {
            bad.push(format!("{} {}: never consuming again", c.process, c.kind));
            continue;
        };
        times.push(r.back_ms);
        if r.kind != c.kind || !r.restarted || r.reconnected {
            bad.push(format!(
                "{} {} (played on {}): restarted on the connection {}, reconnected {}",
                c.process, c.kind, r.kind, r.restarted, r.reconnected
            ));
            continue;
        }
        let back = DateTime::from_timestamp_micros(r.back_at_us).unwrap_or_default();
        let lived = cluster
            .ended
            .get(&c.process)
            .is_none_or(|end| *end > back + margin);
        let fed = rec.faults_ended.is_none_or(|end| end > back + margin);
        let after = acks
            .iter()
            .filter(|a| a.process == c.process && a.kind == c.kind && a.sent_at > r.back_at_us)
            .count();
        if after > 0 {
            acked_after += 1;
        } else if c.kind == Kind::Probe.name() && lived && fed {
            bad.push(format!(
                "{} {}: no ack of the kind after it consumed again",
                c.process, c.kind
            ));
        }
    }
    times.sort_by(f64::total_cmp);
    check(
        "a channel the broker closed is consumed again at once, on the same connection",
        bad.is_empty(),
        format!(
            "{} closes played ({} asked; by kind {played:?}), each kind consumed again on a new channel after \
             p50 {:.0} ms, max {:.0} ms; {acked_after} of them with acks of that kind after; \
             not so: {bad:?}",
            played.values().sum::<u64>(),
            rec.channel_closes.len(),
            percentile(&times, 0.5),
            times.last().copied().unwrap_or(f64::NAN)
        ),
    )
}

async fn check_invariants(
    pool: &PgPool,
    rec: &Record,
    cluster: &Cluster,
    drained: bool,
    depths: (u32, u32),
) -> Vec<Check> {
    let mut out = Vec::new();
    let open = count(pool, "SELECT count(*) FROM kfs_probe_jobs WHERE run_state NOT IN ('succeeded', 'failed', 'canceled')").await;
    out.push(check(
        "all jobs terminal",
        drained && open == 0,
        format!("{open} not terminal"),
    ));

    let ids: Vec<Uuid> = rec.jobs.iter().map(|(id, _)| *id).collect();
    let wants: Vec<String> = rec.jobs.iter().map(|(_, w)| (*w).to_owned()).collect();
    let wrong: Vec<(Uuid, String, Option<String>)> = sqlx::query_as(
        "SELECT x.id, x.want, j.run_state::text FROM unnest($1::uuid[], $2::text[]) AS x(id, want) \
         LEFT JOIN kfs_probe_jobs j ON j.id = x.id WHERE j.run_state IS DISTINCT FROM x.want LIMIT 10",
    )
    .bind(&ids)
    .bind(&wants)
    .fetch_all(pool)
    .await
    .unwrap();
    let total = count(pool, "SELECT count(*) FROM kfs_probe_jobs").await;
    out.push(check(
        "no job lost; each ended as its behaviour calls for",
        wrong.is_empty() && total == ids.len() as i64,
        format!(
            "{} enqueued ({} of {} enqueues in doubt had committed), {total} in the database; \
             wrong or missing (job, want, got): {wrong:?}",
            ids.len(),
            rec.in_doubt_committed,
            rec.in_doubt.len()
        ),
    ));

    let bad: Vec<(Uuid, i32, i64)> = sqlx::query_as(
        "SELECT j.id, s.step, count(e.id) FROM kfs_probe_jobs j \
         CROSS JOIN LATERAL generate_series(1, j.steps_total) AS s(step) \
         LEFT JOIN kfs_probe_effects e ON e.job_id = j.id AND e.step = s.step \
         WHERE j.run_state = 'succeeded' GROUP BY 1, 2 HAVING count(e.id) <> 1 LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let stray = count(pool, "SELECT count(*) FROM kfs_probe_effects e JOIN kfs_probe_jobs j ON j.id = e.job_id WHERE j.run_state <> 'succeeded' OR e.step > j.steps_total").await;
    out.push(check(
        "each effect applied exactly once",
        bad.is_empty() && stray == 0,
        format!("(job, step, count) ≠ 1: {bad:?}; effects of failed jobs or past the last step: {stray}"),
    ));

    let gaps: Vec<(Uuid, i32, i64)> = sqlx::query_as(
        "SELECT job_id, step, rn FROM (SELECT job_id, step, row_number() OVER (PARTITION BY job_id ORDER BY id) AS rn \
         FROM kfs_probe_effects) x WHERE step <> rn LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    out.push(check(
        "progress sequences contiguous (effects 1, 2, 3, … in commit order)",
        gaps.is_empty(),
        format!("(job, step, position): {gaps:?}"),
    ));

    let back: Vec<(Uuid, String, String)> = sqlx::query_as(
        "SELECT job_id, old_cp, new_cp FROM chaos_checkpoints WHERE \
         (CASE WHEN old_cp = 'queued' THEN 0 WHEN old_cp = 'done' THEN 1000000 \
               WHEN old_cp ~ '^step-[0-9]+$' THEN substr(old_cp, 6)::int END) > \
         (CASE WHEN new_cp = 'queued' THEN 0 WHEN new_cp = 'done' THEN 1000000 \
               WHEN new_cp ~ '^step-[0-9]+$' THEN substr(new_cp, 6)::int ELSE -1 END) LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let changes = count(pool, "SELECT count(*) FROM chaos_checkpoints").await;
    out.push(check(
        "checkpoints never regressed",
        back.is_empty(),
        format!("{changes} checkpoint changes; backwards (job, from, to): {back:?}"),
    ));

    let unclaimed = count(
        pool,
        "SELECT count(*) FROM kfs_probe_effects e WHERE NOT EXISTS \
         (SELECT 1 FROM chaos_claims c WHERE c.job_id = e.job_id AND c.lease_token = e.lease_token)",
    )
    .await;
    let late: Vec<(Uuid, i32, String, String)> = sqlx::query_as(
        "SELECT e.job_id, e.step, e.worker_id, c2.worker_id FROM kfs_probe_effects e \
         JOIN chaos_claims c1 ON c1.job_id = e.job_id AND c1.lease_token = e.lease_token \
         JOIN chaos_claims c2 ON c2.job_id = e.job_id AND c2.id > c1.id AND c2.at <= e.created_at LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    out.push(check(
        "no write accepted from a fenced-out lease",
        unclaimed == 0 && late.is_empty(),
        format!("effects under a lease no claim issued: {unclaimed}; written after a newer lease began (job, step, writer, newer): {late:?}"),
    ));

    let (acks, _) = read_logs(cluster);
    out.push(acks_after_their_commits(pool, &acks).await);
    out.push(channels_consumed_again(rec, cluster, &acks));

    let outbox_open = count(pool, "SELECT count(*) FROM kfs_probe_outbox WHERE status NOT IN ('completed', 'dead', 'canceled')").await
        + platform::outbox_open(pool).await;
    out.push(check(
        "outbox settled",
        outbox_open == 0,
        format!("{outbox_open} outbox rows not settled"),
    ));
    out.push(check(
        "queues drained (job queue, dead letters)",
        depths == (0, 0),
        format!("depths {depths:?}"),
    ));
    for (name, ok, detail) in platform::checks(pool, &rec.platform).await {
        out.push(check(name, ok, detail));
    }
    if !rec.outage_cpu.is_empty() {
        out.push(check(
            "no busy loop during outages (each process < 25 % of a core)",
            rec.outage_cpu_ok,
            rec.outage_cpu.join("; "),
        ));
    }
    out
}

#[allow(clippy::too_many_arguments)]
async fn report(
    settings: &Settings,
    rec: &Record,
    pool: &PgPool,
    cluster: &Cluster,
    checks: &[Check],
    drain_s: f64,
    exit_codes: &[(String, Option<i32>)],
    started: Instant,
) -> String {
    let mut r = String::new();
    let _ = writeln!(r, "== chaos report ==");
    let _ = writeln!(
        r,
        "seed {}, {} s of faults{}, total {:.0} s; recovery phase {drain_s:.1} s",
        settings.seed,
        settings.seconds,
        if settings.outages {
            " with the long outages"
        } else {
            ""
        },
        started.elapsed().as_secs_f64()
    );
    let _ = writeln!(r, "processes: 3 consumers (c1 a witness, never killed), 2 relays with maintenance (r1 a witness); lease {LEASE}, slices of 4 steps");
    let _ = writeln!(r, "\nfaults injected:");
    let total: u64 = rec.faults.values().sum();
    for (k, n) in &rec.faults {
        let _ = writeln!(r, "  {n:>5}  {k}");
    }
    let _ = writeln!(r, "  {total:>5}  total");
    let _ = writeln!(r, "kill points reached:");
    for p in CONSUMER_POINTS.iter().chain(RELAY_POINTS.iter()) {
        let _ = writeln!(
            r,
            "  {:>5}  {p}",
            rec.crash_points.get(*p).copied().unwrap_or(0)
        );
    }

    let states: Vec<(String, i64)> = sqlx::query_as(
        "SELECT run_state::text, count(*) FROM kfs_probe_jobs GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    let steps = count(pool, "SELECT count(*) FROM kfs_probe_effects").await;
    let claims = count(pool, "SELECT count(*) FROM chaos_claims").await;
    let reclaims = count(
        pool,
        "SELECT count(*) - count(DISTINCT job_id) FROM chaos_claims",
    )
    .await;
    let _ = writeln!(
        r,
        "\njobs: {} enqueued; by final state {states:?}; {steps} step effects",
        rec.jobs.len()
    );
    let _ = writeln!(r, "platform jobs: {}", platform::summary(&rec.platform));
    let _ = writeln!(r, "claims: {claims} (of which {reclaims} after the job's first claim: new slices, retries and takeovers)");
    let (acks, warnings) = read_logs(cluster);
    let mut by_claim: BTreeMap<String, u64> = BTreeMap::new();
    for a in &acks {
        *by_claim
            .entry(format!("{}/{}", a.claim, a.end))
            .or_default() += 1;
    }
    let _ = writeln!(r, "acks by claim/end: {by_claim:?}");
    let lease_lost = warnings
        .get("lease lost; stopping the slice and writing nothing more")
        .copied()
        .unwrap_or(0);
    let _ = writeln!(r, "slices stopped by fencing (lease lost): {lease_lost}");

    // Takeovers: from a death or pause to the next claim of each job it held.
    let mut times: Vec<f64> = Vec::new();
    let mut never = 0usize;
    for t in &rec.takeovers {
        let rows: Vec<(Uuid, Option<DateTime<Utc>>)> = sqlx::query_as(
            "SELECT j, (SELECT min(c.at) FROM chaos_claims c WHERE c.job_id = j AND c.at > $2) FROM unnest($1::uuid[]) AS j",
        )
        .bind(&t.jobs)
        .bind(t.at)
        .fetch_all(pool)
        .await
        .unwrap_or_default();
        for (_, at) in rows {
            match at {
                Some(at) => times.push((at - t.at).num_milliseconds() as f64 / 1000.0),
                None => never += 1,
            }
        }
    }
    times.sort_by(f64::total_cmp);
    let _ = writeln!(
        r,
        "takeovers: {} jobs held by killed, aborted or paused processes; time to the next claim p50 {:.2} s, p90 {:.2} s, p99 {:.2} s, max {:.2} s; {never} never claimed again (finished by their holder after SIGCONT, or ended)",
        times.len() + never,
        percentile(&times, 0.5),
        percentile(&times, 0.9),
        percentile(&times, 0.99),
        times.last().copied().unwrap_or(f64::NAN)
    );
    let mut rec_times: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for (label, at) in &rec.recoveries {
        let first: Option<DateTime<Utc>> = sqlx::query_scalar(
            "SELECT min(created_at) FROM kfs_probe_effects WHERE created_at > $1",
        )
        .bind(at)
        .fetch_one(pool)
        .await
        .unwrap_or(None);
        if let Some(first) = first {
            rec_times
                .entry(label.clone())
                .or_default()
                .push((first - *at).num_milliseconds() as f64 / 1000.0);
        }
    }
    for (label, mut v) in rec_times {
        v.sort_by(f64::total_cmp);
        let _ = writeln!(
            r,
            "recovery after {label} (service back → first step committed): n {}, p50 {:.2} s, p90 {:.2} s, max {:.2} s",
            v.len(),
            percentile(&v, 0.5),
            percentile(&v, 0.9),
            v.last().copied().unwrap_or(f64::NAN)
        );
    }
    for line in &rec.outage_cpu {
        let _ = writeln!(r, "{line}");
    }

    let _ = writeln!(r, "\nsoak samples (s since the faults began: witness RSS kB; worker sessions in Postgres; AMQP connections in RabbitMQ; open via the proxies pg/mq; accepted by the proxies so far pg/mq):");
    for s in &rec.samples {
        let rss: Vec<String> = s
            .rss_kb
            .iter()
            .map(|(id, kb)| format!("{id} {kb}"))
            .collect();
        let mq = s.mq_connections.map_or("-".to_owned(), |n| n.to_string());
        let _ = writeln!(
            r,
            "  {:>5} s: {}; pg sessions {}; mq connections {mq}; open {}/{}; accepted {}/{}",
            s.at_s,
            rss.join(", "),
            s.pg_sessions,
            s.pg_proxy_open,
            s.mq_proxy_open,
            s.accepted.0,
            s.accepted.1
        );
    }
    if let (Some(first), Some(last)) = (
        rec.samples.iter().find(|s| s.at_s >= 10),
        rec.samples.last(),
    ) {
        for ((id, a), (_, b)) in first.rss_kb.iter().zip(last.rss_kb.iter()) {
            let _ = writeln!(
                r,
                "  RSS growth of {id}: {a} kB → {b} kB ({:+.1} %)",
                (*b as f64 - *a as f64) * 100.0 / (*a).max(1) as f64
            );
        }
        let _ = writeln!(
            r,
            "  Postgres sessions: {} → {}",
            first.pg_sessions, last.pg_sessions
        );
    }
    let _ = writeln!(r, "\nworker warnings (message: count):");
    let mut w: Vec<(&String, &u64)> = warnings.iter().collect();
    w.sort_by(|a, b| b.1.cmp(a.1));
    for (m, n) in w.iter().take(12) {
        let _ = writeln!(r, "  {n:>6}  {m}");
    }
    let _ = writeln!(r, "exit codes on SIGTERM at the end: {exit_codes:?}");
    for n in &rec.notes {
        let _ = writeln!(r, "note: {n}");
    }
    let _ = writeln!(r, "\ninvariants:");
    for c in checks {
        let _ = writeln!(
            r,
            "  [{}] {} — {}",
            if c.ok { "ok" } else { "FAIL" },
            c.name,
            c.detail
        );
    }
    r
}

/// A process that plays a channel close as it starts, before its session logs "consuming",
/// comes back at the "consuming" after its restart, not at the session's first one.
#[test]
fn a_close_played_before_the_session_consumed_is_judged_by_its_restart() {
    let log = [
        format!(r#"{{"timestamp":"2026-12-07T06:58:30.909656Z","message":"{CLOSE_PLAYED} x","kind":"compile"}}"#),
        r#"{"timestamp":"2026-12-07T06:58:30.911500Z","message":"consuming"}"#.to_owned(),
        r#"{"timestamp":"2026-12-07T06:58:30.914009Z","message":"a consumer stopped; consuming its queue again on a new channel","kind":"compile"}"#.to_owned(),
        r#"{"timestamp":"2026-12-07T06:58:30.929695Z","message":"consuming"}"#.to_owned(),
    ]
    .join("\n");
    let r = consuming_again(&log, 1).expect("consuming again");
    assert!(
        r.restarted && !r.reconnected,
        "{:?}",
        (r.restarted, r.reconnected)
    );
    assert_eq!(r.kind, "compile");
    assert!((r.back_ms - 20.039).abs() < 0.01, "{}", r.back_ms);
}
