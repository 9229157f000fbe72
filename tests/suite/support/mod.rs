//! Test harness, declared once for the whole suite: a fresh database and unique broker names
//! per test, real services only. Invariant: every test gets its own database (migrated, probe
//! kind installed) and its own queue prefix, and both are removed when the `TestEnv` is
//! dropped; a `TestEnv` holds the shared services (`isolation`) until then.

pub mod isolation;
pub mod pki;
pub mod private;
pub mod proxy;
pub mod space;
pub mod unstructured;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kfs_worker::broker::Topology;
use kfs_worker::config::{self, Services};
use kfs_worker::jobs::Kind;
use sqlx::{Connection, PgConnection, PgPool};

pub fn admin_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| config::DEFAULT_AMQP_URL.into())
}

/// The admin URL with another database name.
pub fn url_for(db: &str) -> String {
    let mut u = url::Url::parse(&admin_url()).expect("DATABASE_URL");
    u.set_path(&format!("/{db}"));
    u.to_string()
}

pub struct TestEnv {
    pub db_name: String,
    pub url: String,
    pub pool: PgPool,
    pub prefix: String,
    pub topology: Topology,
    pub amqp: lapin::Connection,
    cleaned: bool,
    /// Released last, after the clean-up (the fields drop after `Drop::drop` ran).
    _services: isolation::Services,
}

impl TestEnv {
    /// A fresh migrated database with the probe kind installed, and a declared topology
    /// under a unique prefix; the services shared with the tests running beside this one.
    pub async fn new() -> TestEnv {
        TestEnv::holding(isolation::shared().await).await
    }

    /// [`TestEnv::new`] for a test that stops a shared service: no other test holds the
    /// services until this environment is dropped.
    pub async fn alone() -> TestEnv {
        TestEnv::holding(isolation::alone().await).await
    }

    async fn holding(services: isolation::Services) -> TestEnv {
        let tag = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let db_name = format!("kfs_t_{tag}");
        let mut admin = PgConnection::connect(&admin_url())
            .await
            .expect("connect to the admin database");
        sqlx::query(&format!("CREATE DATABASE \"{db_name}\""))
            .execute(&mut admin)
            .await
            .expect("create database");
        admin.close().await.ok();
        let url = url_for(&db_name);
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(20)
            .connect(&url)
            .await
            .expect("pool");
        kfs_worker::db::migrate(&pool).await.expect("migrate");
        kfs_worker::jobs::probe::install(&pool)
            .await
            .expect("install probe kind");
        let prefix = format!("t{tag}");
        let topology = Topology::new(&prefix);
        let amqp = lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
            .await
            .expect("connect to RabbitMQ");
        let ch = amqp.create_channel().await.expect("channel");
        topology
            .declare(&ch, &Kind::all())
            .await
            .expect("declare topology");
        TestEnv {
            db_name,
            url,
            pool,
            prefix,
            topology,
            amqp,
            cleaned: false,
            _services: services,
        }
    }

    pub fn services(&self) -> Services {
        Services {
            database_url: config::database_url(Some(&self.url)).unwrap(),
            amqp_url: config::amqp_url(&amqp_url()).unwrap(),
            queue_prefix: self.prefix.clone(),
            connect_timeout: Duration::from_secs(5),
        }
    }

    pub async fn channel(&self) -> lapin::Channel {
        self.amqp.create_channel().await.expect("channel")
    }

    /// A channel in confirm mode, as the relay uses.
    pub async fn confirm_channel(&self) -> lapin::Channel {
        let ch = self.channel().await;
        ch.confirm_select(lapin::options::ConfirmSelectOptions::default())
            .await
            .expect("confirm_select");
        ch
    }

    /// Messages waiting in a queue.
    pub async fn queue_depth(&self, queue: &str) -> u32 {
        self.queue_counts(queue).await.expect("passive declare").0
    }

    /// Consumers attached to a queue.
    pub async fn queue_consumers(&self, queue: &str) -> u32 {
        self.queue_counts(queue).await.expect("passive declare").1
    }

    /// `(messages waiting, consumers)` of a queue, from a passive declare; `None` when the
    /// queue does not exist.
    pub async fn queue_counts(&self, queue: &str) -> Option<(u32, u32)> {
        let ch = self.channel().await;
        let q = ch
            .queue_declare(
                queue.into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .ok()?;
        let _ = ch.close(200, "counted".into()).await;
        Some((q.message_count(), q.consumer_count()))
    }

    /// Polls `f` until it returns true or `timeout` passes. Returns whether it became true.
    pub async fn wait_until<F, Fut>(&self, timeout: Duration, mut f: F) -> bool
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if f().await {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        f().await
    }

    /// Waits until `n` probe jobs succeeded, at most `timeout`. Returns whether they did.
    pub async fn wait_probe_succeeded(&self, n: i64, timeout: Duration) -> bool {
        self.wait_until(timeout, || async { probe_succeeded(&self.pool).await == n })
            .await
    }

    /// Environment for a worker process bound to this test's database and queues.
    pub fn worker_env(&self) -> Vec<(String, String)> {
        vec![
            ("DATABASE_URL".into(), self.url.clone()),
            ("AMQP_URL".into(), amqp_url()),
            ("KFS_QUEUE_PREFIX".into(), self.prefix.clone()),
            ("KFS_HTTP_ADDR".into(), "127.0.0.1:0".into()),
            (
                "RUST_LOG".into(),
                "info,kfs_worker=debug,sqlx=warn,lapin=warn".into(),
            ),
        ]
    }

    /// Spawns `kfs-worker` with `args`, this test's environment and `extra` variables.
    pub fn spawn_worker(&self, name: &str, args: &[&str], extra: &[(&str, &str)]) -> Worker {
        let log = std::env::temp_dir().join(format!(
            "{}-{name}-{}.log",
            self.db_name,
            uuid::Uuid::new_v4().simple()
        ));
        let file = std::fs::File::create(&log).expect("log file");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kfs-worker"));
        cmd.args(args).stdout(Stdio::null()).stderr(file);
        for (k, v) in self.worker_env() {
            cmd.env(k, v);
        }
        for (k, v) in extra {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawn kfs-worker");
        Worker {
            child,
            log,
            name: name.to_owned(),
        }
    }

    /// Drops the queues and the database now.
    pub async fn cleanup(mut self) {
        self.cleaned = true;
        cleanup(&self.db_name, &self.topology, &self.pool).await;
    }
}

/// Each part is bounded: a test's clean-up must never hang the suite. The database is dropped
/// with `FORCE` whatever the pool and the broker did.
async fn cleanup(db_name: &str, topology: &Topology, pool: &PgPool) {
    if tokio::time::timeout(Duration::from_secs(10), pool.close())
        .await
        .is_err()
    {
        eprintln!(
            "clean-up of {db_name}: the pool did not close within 10 s ({} connections, {} idle)",
            pool.size(),
            pool.num_idle()
        );
    }
    let queues = async {
        if let Ok(conn) =
            lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default()).await
        {
            if let Ok(ch) = conn.create_channel().await {
                let _ = topology.delete(&ch, &Kind::all()).await;
                // Closed before the connection, as the worker does (`consumer::consume`).
                let _ = ch.close(200, "bye".into()).await;
            }
            let _ = conn.close(200, "bye".into()).await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(15), queues)
        .await
        .is_err()
    {
        eprintln!("clean-up of {db_name}: RabbitMQ did not answer within 15 s");
    }
    if let Ok(mut admin) = PgConnection::connect(&admin_url()).await {
        let _ = sqlx::query(&format!(
            "DROP DATABASE IF EXISTS \"{db_name}\" WITH (FORCE)"
        ))
        .execute(&mut admin)
        .await;
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        if self.cleaned {
            return;
        }
        // A failed test still removes its database and queues.
        let db = self.db_name.clone();
        let topology = self.topology.clone();
        let pool = self.pool.clone();
        block_on_aside(async move { cleanup(&db, &topology, &pool).await });
    }
}

/// Runs `work` to its end on a runtime of its own, on a thread of its own: for clean-ups in
/// `Drop`, which may run inside a test's runtime, where blocking on it is not allowed.
pub fn block_on_aside<F>(work: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let _ = std::thread::spawn(move || {
        if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            rt.block_on(work);
        }
    })
    .join();
}

/// A `kfs-worker` child process.
pub struct Worker {
    pub child: Child,
    pub log: PathBuf,
    pub name: String,
}

impl Worker {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status();
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the process to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Waits for the process to exit, without blocking the runtime.
    pub async fn exited(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if start.elapsed() >= timeout {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `n` lines of the log, named, for failure messages.
    pub fn tail(&self, n: usize) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(n);
        format!(
            "--- {} ({}) ---\n{}",
            self.name,
            self.log.display(),
            lines[from..].join("\n")
        )
    }
}

/// Sends SIGTERM to every worker at once, then asserts that each exits 0 within `timeout`.
pub async fn stop_cleanly<'a>(
    workers: impl IntoIterator<Item = &'a mut Worker>,
    timeout: Duration,
) {
    let workers: Vec<&mut Worker> = workers.into_iter().collect();
    for w in &workers {
        w.signal("TERM");
    }
    for w in workers {
        let status = w.exited(timeout).await;
        assert_eq!(
            status.and_then(|s| s.code()),
            Some(0),
            "{} did not exit 0 on SIGTERM ({status:?})\n{}",
            w.name,
            w.tail(30)
        );
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// How many probe jobs succeeded.
pub async fn probe_succeeded(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM kfs_probe_jobs WHERE run_state = 'succeeded'")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Counts of probe jobs by run_state.
pub async fn probe_states(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT run_state, count(*) FROM kfs_probe_jobs GROUP BY 1 ORDER BY 1")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Every probe job succeeded and each of its steps' effects exists exactly once.
pub async fn assert_probe_invariants(pool: &PgPool) {
    let not_done: i64 =
        sqlx::query_scalar("SELECT count(*) FROM kfs_probe_jobs WHERE run_state <> 'succeeded'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(
        not_done,
        0,
        "jobs not succeeded: {:?}",
        probe_states(pool).await
    );
    let bad: Vec<(uuid::Uuid, i32, i64)> = sqlx::query_as(
        "SELECT j.id, s.step, count(e.id) FROM kfs_probe_jobs j \
         CROSS JOIN LATERAL generate_series(1, j.steps_total) AS s(step) \
         LEFT JOIN kfs_probe_effects e ON e.job_id = j.id AND e.step = s.step \
         GROUP BY 1, 2 HAVING count(e.id) <> 1 LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(
        bad.is_empty(),
        "effects not applied exactly once (job, step, count): {bad:?}"
    );
    let outbox: i64 =
        sqlx::query_scalar("SELECT count(*) FROM kfs_probe_outbox WHERE status <> 'completed'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(outbox, 0, "outbox rows not completed");
}

/// Enqueues one probe job as the platform would; returns (job id, outbox id).
pub async fn enqueue_one(
    pool: &PgPool,
    spec: &kfs_worker::jobs::probe::ProbeSpec,
) -> (uuid::Uuid, uuid::Uuid) {
    let mut conn = pool.acquire().await.unwrap();
    let job = kfs_worker::jobs::probe::enqueue(&mut conn, spec)
        .await
        .unwrap();
    let outbox: uuid::Uuid =
        sqlx::query_scalar("SELECT id FROM kfs_probe_outbox WHERE probe_job_id = $1")
            .bind(job)
            .fetch_one(pool)
            .await
            .unwrap();
    (job, outbox)
}

/// `(step, times written)` of a probe job's effect rows, by step.
pub async fn probe_effects(pool: &PgPool, job: uuid::Uuid) -> Vec<(i32, i64)> {
    sqlx::query_as(
        "SELECT step, count(*) FROM kfs_probe_effects WHERE job_id = $1 GROUP BY step ORDER BY step",
    )
    .bind(job)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Puts an outbox row out for delivery the way the relay's mark leaves it: `dispatched` under a
/// fresh delivery id, visible again in 5 minutes. Returns the delivery.
pub async fn dispatch(
    pool: &PgPool,
    kind: Kind,
    outbox: uuid::Uuid,
) -> kfs_worker::engine::lease::DeliveryRef {
    let spec = kind.spec();
    let (job_id, delivery_id): (uuid::Uuid, String) = sqlx::query_as(&spec.sql(
        "UPDATE {outbox} SET status = 'dispatched', queue_job_id = gen_random_uuid()::text, \
           dispatch_attempts = dispatch_attempts + 1, available_at = {now+$2}, lock_token = NULL, locked_by = NULL, \
           locked_until = NULL, updated_at = {now} \
         WHERE id = $1 RETURNING {fk}, queue_job_id",
    ))
    .bind(outbox)
    .bind(300_000_i64)
    .fetch_one(pool)
    .await
    .unwrap();
    kfs_worker::engine::lease::DeliveryRef {
        kind,
        job_id,
        outbox_id: outbox,
        delivery_id,
    }
}

/// `sql` prepared on `conn` as `name` with parameter `types`, then its execution with `args`
/// explained with `options` (say `ANALYZE, FORMAT JSON`): the plan as JSON. The statement runs
/// as the worker runs it, a prepared statement, so the plan is the one its parameters get.
pub async fn explain_prepared(
    conn: &mut sqlx::PgConnection,
    options: &str,
    name: &str,
    types: &str,
    sql: &str,
    args: &str,
) -> serde_json::Value {
    sqlx::query(&format!("PREPARE {name} {types} AS {sql}"))
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query_scalar(&format!("EXPLAIN ({options}) EXECUTE {name}({args})"))
        .fetch_one(&mut *conn)
        .await
        .unwrap()
}

/// The whole probe job row as text: "changes nothing" compares these.
pub async fn job_text(pool: &PgPool, job: uuid::Uuid) -> String {
    sqlx::query_scalar("SELECT j::text FROM kfs_probe_jobs j WHERE id = $1")
        .bind(job)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The whole probe outbox row as text.
pub async fn outbox_text(pool: &PgPool, outbox: uuid::Uuid) -> String {
    sqlx::query_scalar("SELECT o::text FROM kfs_probe_outbox o WHERE id = $1")
        .bind(outbox)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A plain HTTP/1.1 GET: the status code (0 when nothing listens) and the body.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
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

/// An address of 127.0.0.1 that nothing listens on right now.
pub fn free_port() -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// A test whose prerequisite is missing: under `CI=true` (where every prerequisite is
/// provided) it fails naming what is missing; elsewhere it says SKIPPED and why, and the caller
/// returns.
pub fn skip_or_fail(why: &str) {
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "prerequisite missing under CI=true: {why}"
    );
    eprintln!("SKIPPED: {why}");
}
