//! The probe kind: the engine's own job kind, used by its tests and benchmarks so that they do
//! not depend on the real handlers. Invariant: each step inserts exactly one effect row in the
//! step's transaction, so `count(*) per (job, step) = 1` proves each effect was applied once.

use std::time::{Duration, Instant};

use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use super::{
    Clock, Handler, JobCtx, JobError, Kind, KindSpec, Policy, RetryPolicy, States, Step, Until,
};

const SCHEMA: &str = include_str!("schema.sql");

/// Creates the probe tables (idempotent). Needs the project's migrations first.
pub async fn install(pool: &PgPool) -> Result<(), sqlx::Error> {
    // Even `CREATE INDEX IF NOT EXISTS` locks its table; where everything exists, touch nothing,
    // so that a worker starting next to running ones never waits on (or deadlocks with) them.
    let present: bool = sqlx::query_scalar(
        "SELECT to_regclass('kfs_probe_jobs') IS NOT NULL AND to_regclass('kfs_probe_outbox') IS NOT NULL \
           AND to_regclass('kfs_probe_effects') IS NOT NULL AND to_regclass('kfs_probe_effects_job_idx') IS NOT NULL \
           AND to_regclass('kfs_probe_outbox_urgent_idx') IS NOT NULL \
           AND EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'kfs_probe_outbox_kfs_notify')",
    )
    .fetch_one(pool)
    .await?;
    if !present {
        sqlx::raw_sql(SCHEMA).execute(pool).await?;
    }
    Ok(())
}

/// How a probe job behaves.
#[derive(Clone, Debug)]
pub struct ProbeSpec {
    pub steps: i32,
    pub step_sleep: Duration,
    /// `none`, `retry_once` (a retryable error on the first attempt), `fatal`, `retry_always`,
    /// `panic_once` (the step panics on the first attempt), `panic` (on every attempt).
    pub fail_mode: &'static str,
    pub max_attempts: i32,
}

impl Default for ProbeSpec {
    fn default() -> Self {
        Self {
            steps: 1,
            step_sleep: Duration::ZERO,
            fail_mode: "none",
            max_attempts: 5,
        }
    }
}

/// Writes a probe job and its outbox row, as the platform's API would: in the caller's
/// transaction, `dispatch_pending` with a pending outbox row.
pub async fn enqueue(tx: &mut PgConnection, spec: &ProbeSpec) -> Result<Uuid, sqlx::Error> {
    let id = Uuid::now_v7();
    enqueue_as(tx, id, spec).await?;
    Ok(id)
}

/// [`enqueue`] under an id the caller chose, so a caller whose statement failed without an
/// answer (the connection lost while it committed) can look the job up afterwards.
pub async fn enqueue_as(
    tx: &mut PgConnection,
    id: Uuid,
    spec: &ProbeSpec,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        r#"
        WITH j AS (
          INSERT INTO kfs_probe_jobs (id, checkpoint, run_state, active_slot, steps_total, step_sleep_ms, fail_mode,
            execution_attempts, max_execution_attempts, row_version, created_at, updated_at)
          VALUES ($1, 'queued', 'dispatch_pending', 1, $2, $3, $4, 0, $5, 1, now(), now())
          RETURNING id
        )
        INSERT INTO kfs_probe_outbox (id, probe_job_id, delivery_revision, event_type, schema_version,
          idempotency_key, payload, status, available_at, dispatch_attempts, created_at, updated_at)
        SELECT gen_random_uuid(), j.id, 1, 'probe.job', 1, 'probe.job:' || j.id || ':1',
          jsonb_build_object('probeJobId', j.id), 'pending', now(), 0, now(), now()
        FROM j
        "#,
    )
    .bind(id)
    .bind(spec.steps)
    .bind(i32::try_from(spec.step_sleep.as_millis()).unwrap_or(i32::MAX))
    .bind(spec.fail_mode)
    .bind(spec.max_attempts)
    .execute(tx)
    .await?;
    Ok(())
}

/// Enqueues `n` jobs in one statement; for benchmarks and large tests.
pub async fn enqueue_many(pool: &PgPool, n: i64, spec: &ProbeSpec) -> Result<(), sqlx::Error> {
    sqlx::query(
        r#"
        WITH j AS (
          INSERT INTO kfs_probe_jobs (id, checkpoint, run_state, active_slot, steps_total, step_sleep_ms, fail_mode,
            execution_attempts, max_execution_attempts, row_version, created_at, updated_at)
          SELECT gen_random_uuid(), 'queued', 'dispatch_pending', 1, $2, $3, $4, 0, $5, 1, now(), now()
          FROM generate_series(1, $1)
          RETURNING id
        )
        INSERT INTO kfs_probe_outbox (id, probe_job_id, delivery_revision, event_type, schema_version,
          idempotency_key, payload, status, available_at, dispatch_attempts, created_at, updated_at)
        SELECT gen_random_uuid(), j.id, 1, 'probe.job', 1, 'probe.job:' || j.id || ':1',
          jsonb_build_object('probeJobId', j.id), 'pending', now(), 0, now(), now()
        FROM j
        "#,
    )
    .bind(n)
    .bind(spec.steps)
    .bind(i32::try_from(spec.step_sleep.as_millis()).unwrap_or(i32::MAX))
    .bind(spec.fail_mode)
    .bind(spec.max_attempts)
    .execute(pool)
    .await?;
    Ok(())
}

/// The step number a checkpoint stands for: `queued` is 0, `step-3` is 3.
pub fn step_of(checkpoint: &str) -> Option<i32> {
    match checkpoint {
        "queued" => Some(0),
        other => other.strip_prefix("step-")?.parse().ok(),
    }
}

pub struct ProbeHandler;

#[async_trait::async_trait]
impl Handler for ProbeHandler {
    fn kind(&self) -> Kind {
        KIND
    }

    /// A probe step is one statement on the database (or a sleep the test asked for).
    fn shares_transaction(&self) -> bool {
        true
    }

    async fn step(&self, tx: &mut PgConnection, job: &JobCtx) -> Result<Step, JobError> {
        let step = next_step(job)?;
        // One round trip for the common case: the statement that reads the job's spec also
        // writes the effect when the spec lets the step run straight through (no failure to
        // play, no sleep). Otherwise the effect is written by `slow_step`, after the sleep.
        let (steps_total, sleep_ms, fail_mode, written): (i32, i32, String, bool) = sqlx::query_as(
            "WITH spec AS ( \
               SELECT steps_total, step_sleep_ms, fail_mode FROM kfs_probe_jobs WHERE id = $1 \
             ), effect AS ( \
               INSERT INTO kfs_probe_effects (job_id, step, worker_id, lease_token) \
               SELECT $1, $2, $3, $4 FROM spec \
               WHERE spec.step_sleep_ms = 0 AND (spec.fail_mode = 'none' OR (spec.fail_mode = 'retry_once' AND $5 > 1)) \
               RETURNING 1 \
             ) \
             SELECT steps_total, step_sleep_ms, fail_mode, EXISTS (SELECT 1 FROM effect) FROM spec",
        )
        .bind(job.job_id)
        .bind(step)
        .bind(&job.worker_id)
        .bind(job.lease_token)
        .bind(job.execution_attempts)
        .fetch_one(&mut *tx)
        .await?;
        if !written {
            slow_step(tx, job, step, sleep_ms, &fail_mode).await?;
        }
        Ok(outcome(step, steps_total))
    }

    /// The same as stepping each job in turn, with the straight-through steps before the
    /// first one that is not (a sleep, a failure to play) written by one statement. From that
    /// one on, each member steps in turn while `until` says a step like the last still fits.
    async fn step_many(
        &self,
        tx: &mut PgConnection,
        jobs: &[JobCtx],
        until: Until,
    ) -> Result<Vec<Step>, JobError> {
        let steps = jobs
            .iter()
            .map(next_step)
            .collect::<Result<Vec<i32>, _>>()?;
        let ids: Vec<Uuid> = jobs.iter().map(|j| j.job_id).collect();
        let tokens: Vec<Uuid> = jobs.iter().map(|j| j.lease_token).collect();
        let workers: Vec<&str> = jobs.iter().map(|j| j.worker_id.as_str()).collect();
        let attempts: Vec<i32> = jobs.iter().map(|j| j.execution_attempts).collect();
        let rows: Vec<(Uuid, i32, i32, String, bool)> = sqlx::query_as(
            "WITH m AS ( \
               SELECT * FROM unnest($1::uuid[], $2::int[], $3::text[], $4::uuid[], $5::int[]) \
                 WITH ORDINALITY AS m(id, step, worker_id, token, attempts, ord) \
             ), spec AS ( \
               SELECT m.*, j.steps_total, j.step_sleep_ms, j.fail_mode, \
                 j.step_sleep_ms = 0 AND (j.fail_mode = 'none' OR (j.fail_mode = 'retry_once' AND m.attempts > 1)) \
                   AS straight \
               FROM m JOIN kfs_probe_jobs j ON j.id = m.id \
             ), effect AS ( \
               INSERT INTO kfs_probe_effects (job_id, step, worker_id, lease_token) \
               SELECT id, step, worker_id, token FROM spec \
               WHERE straight AND ord < coalesce((SELECT min(ord) FROM spec WHERE NOT straight), ord + 1) \
               RETURNING job_id \
             ) \
             SELECT spec.id, spec.steps_total, spec.step_sleep_ms, spec.fail_mode, \
               EXISTS (SELECT 1 FROM effect WHERE effect.job_id = spec.id) FROM spec",
        )
        .bind(&ids)
        .bind(&steps)
        .bind(&workers)
        .bind(&tokens)
        .bind(&attempts)
        .fetch_all(&mut *tx)
        .await?;
        let mut out = Vec::with_capacity(jobs.len());
        let mut last = Duration::ZERO;
        for (job, step) in jobs.iter().zip(steps) {
            let Some((_, steps_total, sleep_ms, fail_mode, written)) =
                rows.iter().find(|r| r.0 == job.job_id)
            else {
                return Err(JobError::fatal(
                    "no_such_job",
                    format!("probe job {} is gone", job.job_id),
                ));
            };
            if !written {
                // Every member from here on is unwritten: stopping leaves them untouched.
                if !out.is_empty() && !until.fits(Instant::now(), last) {
                    break;
                }
                let began = Instant::now();
                slow_step(tx, job, step, *sleep_ms, fail_mode).await?;
                last = began.elapsed();
            }
            out.push(outcome(step, *steps_total));
        }
        Ok(out)
    }
}

/// The step a job at its checkpoint runs next.
fn next_step(job: &JobCtx) -> Result<i32, JobError> {
    let done = step_of(&job.checkpoint).ok_or_else(|| {
        JobError::fatal(
            "bad_checkpoint",
            format!("unknown checkpoint '{}'", job.checkpoint),
        )
    })?;
    Ok(done + 1)
}

fn outcome(step: i32, steps_total: i32) -> Step {
    if step >= steps_total {
        Step::Succeed("done".into())
    } else {
        Step::Advance(format!("step-{step}"))
    }
}

/// A step that does not run straight through: the failure it was told to play, or its sleep
/// and then its effect.
async fn slow_step(
    tx: &mut PgConnection,
    job: &JobCtx,
    step: i32,
    sleep_ms: i32,
    fail_mode: &str,
) -> Result<(), JobError> {
    match fail_mode {
        "fatal" => return Err(JobError::fatal("probe_fatal", "the probe was told to fail")),
        "retry_always" => {
            return Err(JobError::retryable(
                "probe_retry",
                "the probe was told to retry",
            ))
        }
        "retry_once" if job.execution_attempts == 1 => {
            return Err(JobError::retryable(
                "probe_retry",
                "the probe fails its first attempt",
            ))
        }
        "panic" => panic!("the probe was told to panic"),
        "panic_once" if job.execution_attempts == 1 => {
            panic!("the probe panics on its first attempt")
        }
        _ => {}
    }
    if sleep_ms > 0 {
        tokio::time::sleep(Duration::from_millis(u64::try_from(sleep_ms).unwrap_or(0))).await;
    }
    sqlx::query("INSERT INTO kfs_probe_effects (job_id, step, worker_id, lease_token) VALUES ($1, $2, $3, $4)")
        .bind(job.job_id)
        .bind(step)
        .bind(&job.worker_id)
        .bind(job.lease_token)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Registration: this kind's identity, tables, policy and handler (one line in `jobs::registry`).
// ---------------------------------------------------------------------------------------------

pub const KIND: Kind = Kind::new("probe");

pub static PROBE: KindSpec = KindSpec {
    kind: KIND,
    event_type: "probe.job",
    job_table: "kfs_probe_jobs",
    outbox_table: "kfs_probe_outbox",
    outbox_fk: "probe_job_id",
    payload_id_field: "probeJobId",
    clock: Clock::Timestamptz,
    states: States::RunState {
        failed_keeps_slot: false,
    },
    superseded_state: false,
    generic_plans: false,
    fairness: None,
    revisions: true,
    max_connections: None,
    policy: Policy {
        lease: Duration::from_secs(30),
        max_attempts: 5,
        retry: RetryPolicy {
            base: Duration::from_secs(1),
            max: Duration::from_secs(5 * 60),
        },
    },
    record_failure: None,
};

pub static OPERATIONS: super::operate::Operations = super::operate::Operations {
    history: &[(
        "Step effects",
        "SELECT step, worker_id, created_at FROM kfs_probe_effects WHERE job_id = $1 ORDER BY step, id",
    )],
    ..super::operate::Operations::NONE
};

pub static ENTRY: super::Entry = super::Entry {
    ops: &OPERATIONS,
    prepare: Some(|pool| Box::pin(install(pool))),
    spec: &PROBE,
    default: false,
    handler: |_deps| Ok(std::sync::Arc::new(ProbeHandler)),
};

#[cfg(test)]
mod tests {
    use super::step_of;

    #[test]
    fn checkpoints_map_to_steps() {
        assert_eq!(step_of("queued"), Some(0));
        assert_eq!(step_of("step-7"), Some(7));
        assert_eq!(step_of("done"), None);
        assert_eq!(step_of("step-x"), None);
    }
}
