//! Crash tests: real `kfs-worker` processes killed at the engine's kill points, stopped with
//! SIGSTOP, SIGKILLed at random, sent an ack the broker never answers, and with one channel
//! closed by the broker under a running consumer, against the real
//! Postgres and RabbitMQ. Invariant under test: whatever dies or hangs when, every job ends
//! succeeded, each step's effect exists exactly once, checkpoints never go backwards, and no
//! lease writes after a newer lease of its job began.
//!
//! Only built with `--features crash-points` (the kill points compile to nothing without it):
//!
//! ```text
//! cargo test --all-features --test suite crash:: -- --nocapture
//! ```
//!
//! Instrumentation: each test installs, in its own throwaway database, a trigger that records
//! every claim (every change of `kfs_probe_jobs.lease_token` to a new value) with the database
//! clock in `crash_claims`, and every status or delivery-id change of an outbox row in
//! `crash_outbox_log` (for failure diagnostics). They observe, they never change what the
//! engine does; they turn "when did a new lease of this job begin" into a query instead of a
//! race with a poller.

mod closed_channel;
mod half_open_link;
mod kill_points;
mod lost_claim_reply;
mod paused_worker;
mod random_kills;
mod stalled_settlement;
mod startup_deadlock;
mod worker_id;

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use kfs_worker::jobs::probe::{self, ProbeSpec};
use kfs_worker::jobs::Kind;
use sqlx::PgPool;
use uuid::Uuid;

use crate::support::{self, TestEnv, Worker};

// Row shapes of the diagnostic queries.
/// (job, step, writer, written at, newer lease's worker, claimed at)
type LateEffect = (Uuid, i32, String, DateTime<Utc>, String, DateTime<Utc>);

/// The machine has two cores: the tests of this module run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const CLAIM_LOG: &str = r#"
CREATE TABLE IF NOT EXISTS crash_claims (
  id BIGSERIAL PRIMARY KEY,
  job_id UUID NOT NULL,
  worker_id TEXT NOT NULL,
  lease_token UUID NOT NULL,
  attempt INTEGER NOT NULL,
  at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
);
CREATE OR REPLACE FUNCTION crash_record_claim() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
  INSERT INTO crash_claims (job_id, worker_id, lease_token, attempt)
  VALUES (NEW.id, NEW.worker_id, NEW.lease_token, NEW.execution_attempts);
  RETURN NULL;
END
$f$;
CREATE TRIGGER crash_record_claim AFTER UPDATE OF lease_token ON kfs_probe_jobs FOR EACH ROW
  WHEN (NEW.lease_token IS NOT NULL AND NEW.lease_token IS DISTINCT FROM OLD.lease_token)
  EXECUTE FUNCTION crash_record_claim();
CREATE TABLE IF NOT EXISTS crash_outbox_log (
  id BIGSERIAL PRIMARY KEY,
  job_id UUID NOT NULL,
  status TEXT NOT NULL,
  locked_by TEXT,
  queue_job_id TEXT,
  available_at TIMESTAMPTZ NOT NULL,
  at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
);
CREATE OR REPLACE FUNCTION crash_record_outbox() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
  INSERT INTO crash_outbox_log (job_id, status, locked_by, queue_job_id, available_at)
  VALUES (NEW.probe_job_id, NEW.status, NEW.locked_by, NEW.queue_job_id, NEW.available_at);
  RETURN NULL;
END
$f$;
CREATE TRIGGER crash_record_outbox AFTER UPDATE ON kfs_probe_outbox FOR EACH ROW
  WHEN (NEW.status IS DISTINCT FROM OLD.status OR NEW.queue_job_id IS DISTINCT FROM OLD.queue_job_id)
  EXECUTE FUNCTION crash_record_outbox();
"#;

async fn install_claim_log(pool: &PgPool) {
    sqlx::raw_sql(CLAIM_LOG)
        .execute(pool)
        .await
        .expect("install the claim log");
}

// ---------------------------------------------------------------------------------------------
// Processes

/// Spawns `kfs-worker run --kinds probe --worker-id <id> [roles...]` with `extra` variables.
fn spawn(env: &TestEnv, id: &str, roles: &[&str], extra: &[(&str, &str)]) -> Worker {
    let mut args = vec!["run", "--kinds", "probe", "--worker-id", id];
    args.extend_from_slice(roles);
    env.spawn_worker(id, &args, extra)
}

// ---------------------------------------------------------------------------------------------
// Database views

async fn db_now(pool: &PgPool) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await
        .unwrap()
}

fn ms(d: chrono::TimeDelta) -> f64 {
    d.num_microseconds().unwrap_or(i64::MAX) as f64 / 1000.0
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

async fn all_terminal(pool: &PgPool) -> bool {
    count(pool, "SELECT count(*) FROM kfs_probe_jobs WHERE run_state NOT IN ('succeeded', 'failed', 'canceled')").await == 0
}

/// Waits until every probe job is terminal; false after `timeout`.
async fn wait_all_terminal(env: &TestEnv, timeout: Duration) -> bool {
    let pool = env.pool.clone();
    env.wait_until(timeout, || {
        let pool = pool.clone();
        async move { all_terminal(&pool).await }
    })
    .await
}

/// Waits until neither the probe queue nor the dead-letter queue holds a message.
async fn wait_queues_drained(env: &TestEnv, timeout: Duration) -> (u32, u32) {
    let queue = env.topology.queue(Kind::Probe);
    let dlq = env.topology.dead_letter_queue();
    let start = Instant::now();
    loop {
        let depths = (env.queue_depth(&queue).await, env.queue_depth(&dlq).await);
        if depths == (0, 0) || start.elapsed() >= timeout {
            return depths;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The history checks every test ends with:
/// - every job succeeded, each (job, step) effect exists exactly once, the outbox is completed
///   (`assert_probe_invariants`);
/// - checkpoints never went backwards: for each job, the effects in insertion (id) order are
///   steps 1, 2, 3, ... (with exactly-once this is "strictly increasing");
/// - every effect was written under a lease that a claim really handed out;
/// - no effect was written by a lease after a newer lease of the same job began: for each
///   effect, no later claim of its job (by claim order) happened before the effect's insert.
async fn assert_history(pool: &PgPool) {
    support::assert_probe_invariants(pool).await;
    let backwards: Vec<(Uuid, i32, i64)> = sqlx::query_as(
        "SELECT job_id, step, rn FROM ( \
           SELECT job_id, step, row_number() OVER (PARTITION BY job_id ORDER BY id) AS rn FROM kfs_probe_effects \
         ) x WHERE step <> rn LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(
        backwards.is_empty(),
        "checkpoints went backwards (job, step, position): {backwards:?}"
    );
    let unclaimed: Vec<(Uuid, i32, String)> = sqlx::query_as(
        "SELECT e.job_id, e.step, e.worker_id FROM kfs_probe_effects e \
         WHERE NOT EXISTS (SELECT 1 FROM crash_claims c WHERE c.job_id = e.job_id AND c.lease_token = e.lease_token) \
         LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(
        unclaimed.is_empty(),
        "effects under a lease no claim handed out: {unclaimed:?}"
    );
    let late: Vec<LateEffect> = sqlx::query_as(
        "SELECT e.job_id, e.step, e.worker_id, e.created_at, c2.worker_id, c2.at \
         FROM kfs_probe_effects e \
         JOIN crash_claims c1 ON c1.job_id = e.job_id AND c1.lease_token = e.lease_token \
         JOIN crash_claims c2 ON c2.job_id = e.job_id AND c2.id > c1.id AND c2.at <= e.created_at \
         LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(
        late.is_empty(),
        "effects written by a lease after a newer lease of the job began \
         (job, step, writer, written at, newer lease's worker, claimed at): {late:?}"
    );
}

/// For jobs that `worker` ran before `other` took them: every effect of `worker` has a lower
/// id than the first effect of `other` on that job.
async fn assert_no_overlap(pool: &PgPool, worker: &str, other: &str) {
    let bad: Vec<(Uuid, i64, i64)> = sqlx::query_as(
        "SELECT job_id, max(id) FILTER (WHERE split_part(worker_id, '#', 1) = $1), min(id) FILTER (WHERE split_part(worker_id, '#', 1) = $2) \
         FROM kfs_probe_effects GROUP BY job_id \
         HAVING max(id) FILTER (WHERE split_part(worker_id, '#', 1) = $1) > min(id) FILTER (WHERE split_part(worker_id, '#', 1) = $2) LIMIT 10",
    )
    .bind(worker)
    .bind(other)
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(bad.is_empty(), "{worker} wrote effects after {other} took over (job, last of {worker}, first of {other}): {bad:?}");
}

/// Jobs a dead worker held a live lease on: running under its id, lease not expired at `at`.
async fn held_by(pool: &PgPool, worker: &str, at: DateTime<Utc>) -> Vec<(Uuid, Uuid)> {
    sqlx::query_as(
        "SELECT id, lease_token FROM kfs_probe_jobs \
         WHERE run_state = 'running' AND split_part(worker_id, '#', 1) = $1 AND lease_expires_at > $2",
    )
    .bind(worker)
    .bind(at)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// For each job, the time from `since` to the first claim of it after `since` (None: never).
async fn next_claims(pool: &PgPool, jobs: &[Uuid], since: DateTime<Utc>) -> Vec<Option<f64>> {
    let rows: Vec<(Uuid, Option<DateTime<Utc>>)> = sqlx::query_as(
        "SELECT j, (SELECT min(c.at) FROM crash_claims c WHERE c.job_id = j AND c.at > $2) FROM unnest($1::uuid[]) AS j",
    )
    .bind(jobs)
    .bind(since)
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(_, at)| at.map(|at| ms(at - since)))
        .collect()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

fn probe_spec(steps: i32, step_sleep_ms: u64) -> ProbeSpec {
    ProbeSpec {
        steps,
        step_sleep: Duration::from_millis(step_sleep_ms),
        ..ProbeSpec::default()
    }
}

const JOBS: i64 = 20;

fn base_env(lease: &'static str) -> Vec<(&'static str, &'static str)> {
    vec![
        ("KFS_LEASES", lease),
        ("KFS_RELAY_POLL", "200ms"),
        ("KFS_SHUTDOWN_GRACE", "5s"),
    ]
}
