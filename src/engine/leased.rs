//! Jobs leased straight from Postgres, with no outbox and no queue: legacy space publication
//! bootstraps, profile backfills and page-index upgrade backfills. Invariant: the same
//! discipline as the outbox kinds — a claim takes a fresh lease token under `FOR UPDATE SKIP
//! LOCKED`, every step is one transaction fenced by lease token, row version and an unexpired
//! lease (wall clock), the heartbeat extends only a live lease, and zero rows changed means the
//! lease is lost and nothing more is written. How a slice goes on or ends is decided by the
//! engine's own [`after_step`], retries follow the kind's
//! [`RetryPolicy`](crate::jobs::RetryPolicy), and a running job whose worker lost its liveness
//! lock ([`crate::liveness`]) is claimable at once.

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::kind::{JobError, Policy, Step};
use super::lease::{millis, End};
use super::slice::{after_step, Budget, Next, Progress};

/// A job claimed from a leased table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub job_id: Uuid,
    pub lease_token: Uuid,
    /// The row version after the claim; every fenced write compares and bumps it.
    pub row_version: i32,
    /// The checkpoint (bootstrap) or the run state (kinds without a checkpoint).
    pub checkpoint: String,
    /// This run's attempt, counting from 1, and the most allowed.
    pub attempt: i32,
    pub max_attempts: i32,
    pub worker_id: String,
    /// The job was taken over from a worker that died or lost its lease.
    pub taken_over: bool,
}

/// One leased job kind: its table, its claim, its steps and how an end is written.
#[async_trait::async_trait]
pub trait LeasedKind: Send + Sync + 'static {
    /// Short name used on the command line, in status and in metrics.
    fn name(&self) -> &'static str;
    /// The job table; it has `id`, `run_state`, `row_version`, `updated_at` and the four
    /// lease columns.
    fn table(&self) -> &'static str;
    /// The table has a `checkpoint` column that [`advance`] moves; without one a step that goes
    /// on only re-checks the lease.
    fn has_checkpoint(&self) -> bool {
        true
    }
    fn policy(&self) -> &Policy;
    /// Claims the most overdue claimable job, in one committed transaction.
    async fn claim(
        &self,
        conn: &mut PgConnection,
        worker_id: &str,
    ) -> Result<Option<Lease>, sqlx::Error>;
    /// One step, inside the transaction that [`fence`] opened; its writes commit together with
    /// the checkpoint it returns, or not at all.
    async fn step(&self, tx: &mut PgConnection, job: &Lease) -> Result<Step, JobError>;
    /// Writes the end of a slice, fenced by lease token and row version. `false`: the lease was
    /// lost and nothing was written.
    async fn end(
        &self,
        conn: &mut PgConnection,
        job: &Lease,
        end: &End,
    ) -> Result<bool, sqlx::Error>;
    /// Ends the leases still recorded under `worker_id` (a dead predecessor's), so that a
    /// restart under the same id takes its jobs back at once.
    async fn release_own(
        &self,
        conn: &mut PgConnection,
        worker_id: &str,
    ) -> Result<u64, sqlx::Error>;
}

/// The fence of every write: our token, our row version, a live lease by the wall clock.
const FENCE: &str = "id = $1 AND lease_token = $2 AND row_version = $3 AND run_state = 'running' \
                     AND lease_expires_at > clock_timestamp()";

/// Locks the job row for one step and checks that the lease is still ours. Returns the new row
/// version, or `None` when the lease is lost.
///
/// Like the consumer's fence, it sets the transaction's `idle_in_transaction_session_timeout`
/// to the kind's `lease`.
pub async fn fence(
    tx: &mut PgConnection,
    table: &str,
    job: &Lease,
    lease: std::time::Duration,
) -> Result<Option<i32>, sqlx::Error> {
    let row: Option<(i32, String)> = sqlx::query_as(&format!(
        "UPDATE {table} SET row_version = row_version + 1, updated_at = now() WHERE {FENCE} \
         RETURNING row_version, set_config('idle_in_transaction_session_timeout', $4, true)"
    ))
    .bind(job.job_id)
    .bind(job.lease_token)
    .bind(job.row_version)
    .bind(super::lease::idle_timeout(lease))
    .fetch_optional(tx)
    .await?;
    Ok(row.map(|(rv, _)| rv))
}

/// Moves the checkpoint right after [`fence`] in the same transaction, checking once more that
/// the lease has not run out meanwhile. `false`: it has; roll back.
pub async fn advance(
    tx: &mut PgConnection,
    kind: &dyn LeasedKind,
    job: &Lease,
    checkpoint: &str,
) -> Result<bool, sqlx::Error> {
    let table = kind.table();
    let sql = if kind.has_checkpoint() {
        format!("UPDATE {table} SET checkpoint = $4 WHERE {FENCE} AND checkpoint IS NOT NULL")
    } else {
        format!("UPDATE {table} SET updated_at = updated_at WHERE {FENCE} AND $4::text IS NOT NULL")
    };
    let done = sqlx::query(&sql)
        .bind(job.job_id)
        .bind(job.lease_token)
        .bind(job.row_version)
        .bind(checkpoint)
        .execute(tx)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// Extends the lease. Does not bump `row_version`, so it never races the worker's own steps.
/// `false`: the lease is lost.
pub async fn heartbeat(
    conn: &mut PgConnection,
    table: &str,
    job: &Lease,
    lease: Duration,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(&format!(
        "UPDATE {table} SET lease_expires_at = now() + $3::bigint * interval '1 millisecond', \
           heartbeat_at = now() \
         WHERE id = $1 AND lease_token = $2 AND run_state = 'running' AND lease_expires_at > clock_timestamp()"
    ))
    .bind(job.job_id)
    .bind(job.lease_token)
    .bind(millis(lease))
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// How one slice ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The end was written (its name: succeeded, failed, wait, continue, ...).
    Ended(&'static str),
    /// The lease was lost; nothing more was written.
    LeaseLost,
    /// The database could not be reached; the lease runs out by itself.
    Interrupted(String),
}

/// Claims one job of `kind` and runs one slice of it. `None`: nothing was claimable.
pub async fn run_once(
    pool: &PgPool,
    kind: &dyn LeasedKind,
    worker_id: &str,
    budget: Budget,
) -> Result<Option<(Lease, Outcome)>, sqlx::Error> {
    let claimed = {
        let mut conn = crate::db::acquire(pool).await?;
        kind.claim(&mut conn, worker_id).await?
    };
    let Some(job) = claimed else {
        return Ok(None);
    };
    crate::crash::point("leased-after-claim-commit");
    if job.taken_over {
        crate::metrics::takeover(kind.name(), None);
    }
    let outcome = run_slice(pool, kind, job.clone(), budget).await;
    Ok(Some((job, outcome)))
}

/// Runs steps of a claimed job until its slice ends, with a heartbeat alongside.
pub async fn run_slice(
    pool: &PgPool,
    kind: &dyn LeasedKind,
    job: Lease,
    budget: Budget,
) -> Outcome {
    let started = Instant::now();
    let lost = CancellationToken::new();
    let beat = {
        let (pool, table, lease, job, lost) = (
            pool.clone(),
            kind.table(),
            kind.policy().lease,
            job.clone(),
            lost.clone(),
        );
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = lost.cancelled() => return,
                    () = tokio::time::sleep(lease / 3) => {}
                }
                let ok = match crate::db::acquire(&pool).await {
                    Ok(mut c) => heartbeat(&mut c, table, &job, lease).await,
                    Err(e) => Err(e),
                };
                match ok {
                    Ok(true) => {}
                    Ok(false) => {
                        lost.cancel();
                        return;
                    }
                    // A missed heartbeat is not a lost lease: two more may come in time.
                    Err(e) => tracing::warn!(error = %e, "leased heartbeat failed"),
                }
            }
        })
    };
    let outcome = steps(pool, kind, job, budget, &lost, started).await;
    lost.cancel();
    let _ = beat.await;
    match outcome {
        Outcome::Ended(end) => crate::metrics::slice(kind.name(), end, started.elapsed()),
        Outcome::LeaseLost => crate::metrics::lease_lost(kind.name()),
        Outcome::Interrupted(ref e) => {
            tracing::warn!(kind = kind.name(), error = %e, "leased slice interrupted; its lease runs out by itself");
        }
    }
    outcome
}

async fn steps(
    pool: &PgPool,
    kind: &dyn LeasedKind,
    mut job: Lease,
    budget: Budget,
    lost: &CancellationToken,
    started: Instant,
) -> Outcome {
    let table = kind.table();
    let mut steps_done = 0u32;
    loop {
        if lost.is_cancelled() {
            return Outcome::LeaseLost;
        }
        let mut conn = match crate::db::acquire(pool).await {
            Ok(c) => c,
            Err(e) => return Outcome::Interrupted(e.to_string()),
        };
        let mut tx = match conn.begin().await {
            Ok(t) => t,
            Err(e) => return Outcome::Interrupted(e.to_string()),
        };
        let fenced = match fence(&mut tx, table, &job, kind.policy().lease).await {
            Ok(Some(v)) => v,
            Ok(None) => return Outcome::LeaseLost,
            Err(e) => return Outcome::Interrupted(e.to_string()),
        };
        let mut inside = job.clone();
        inside.row_version = fenced;
        let result = kind.step(&mut tx, &inside).await;
        steps_done += 1;
        let next = after_step(
            result,
            Progress {
                steps_done,
                elapsed: started.elapsed(),
                attempts: job.attempt,
                max_attempts: job.max_attempts,
            },
            budget,
            kind.policy().retry,
            rand::random::<f64>(),
        );
        match next {
            Next::Step(cp) => {
                match advance(&mut tx, kind, &inside, &cp).await {
                    Ok(true) => {}
                    Ok(false) => return Outcome::LeaseLost,
                    Err(e) => return Outcome::Interrupted(e.to_string()),
                }
                if let Err(e) = tx.commit().await {
                    return Outcome::Interrupted(e.to_string());
                }
                crate::crash::point("leased-after-step-commit");
                job = Lease {
                    checkpoint: cp,
                    ..inside
                };
            }
            Next::End { checkpoint, end } => {
                if let Some(cp) = &checkpoint {
                    match advance(&mut tx, kind, &inside, cp).await {
                        Ok(true) => {}
                        Ok(false) => return Outcome::LeaseLost,
                        Err(e) => return Outcome::Interrupted(e.to_string()),
                    }
                }
                match kind.end(&mut tx, &inside, &end).await {
                    Ok(true) => {}
                    Ok(false) => return Outcome::LeaseLost,
                    Err(e) => return Outcome::Interrupted(e.to_string()),
                }
                crate::crash::point("leased-before-end-commit");
                if let Err(e) = tx.commit().await {
                    return Outcome::Interrupted(e.to_string());
                }
                return Outcome::Ended(end.name());
            }
            Next::Abort(end) => {
                let _ = tx.rollback().await;
                if let End::Wait { code, message, .. } | End::Fail { code, message } = &end {
                    tracing::warn!(kind = kind.name(), job = %job.job_id, code, message, "leased step failed");
                    if matches!(end, End::Wait { .. }) {
                        crate::metrics::retry(kind.name());
                    }
                }
                return match kind.end(&mut conn, &job, &end).await {
                    Ok(true) => Outcome::Ended(end.name()),
                    Ok(false) => Outcome::LeaseLost,
                    Err(e) => Outcome::Interrupted(e.to_string()),
                };
            }
        }
    }
}
