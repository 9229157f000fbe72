//! The consumer's writes: claim, fence, heartbeat and end of slice. Invariant: every write to
//! a claimed job compares `lease_token`, `row_version` and an unexpired lease, and zero rows
//! changed means the lease is lost. Locks are always taken job row first, then outbox row, so
//! that claims, steps and heartbeats never deadlock each other.

use std::time::Duration;

use sqlx::{PgConnection, Postgres, Transaction};
use uuid::Uuid;

use super::kind::{Clock, Handler, JobCtx, KindSpec, States};
pub use crate::wire::DeliveryRef;

/// The prepared statement texts of one kind, rendered once.
#[derive(Debug)]
pub struct Statements {
    claim: String,
    diagnose: String,
    fence: String,
    ours: String,
    advance: String,
    heartbeat: String,
    end_succeed: String,
    end_fail: String,
    end_cancel: String,
    end_supersede: String,
    end_wait: String,
    end_continue: String,
    fail_exhausted: String,
    rearm_at_retry: String,
    rearm_at_lease: String,
    settle: super::settle::Statements,
    spec: &'static KindSpec,
}

const LEASE_CLEAR: &str =
    "worker_id = NULL, lease_token = NULL, lease_expires_at = NULL, heartbeat_at = NULL";

impl Statements {
    pub fn new(spec: &'static KindSpec) -> Self {
        let (claimable, running_set, live, terminal) = match spec.states {
            States::RunState { .. } => (
                "(j.run_state IN ('dispatch_pending', 'queued') \
                  OR (j.run_state = 'retry_wait' AND j.retry_at <= {now}) \
                  OR (j.run_state = 'running' AND (j.lease_expires_at <= {now} OR NOT kfs_worker_alive(j.worker_id))))",
                "run_state = 'running', retry_at = NULL, started_at = coalesce(j.started_at, now()),",
                "run_state = 'running'",
                "run_state IN ('succeeded', 'failed', 'canceled', 'superseded')",
            ),
            States::Stage => (
                "(j.stage NOT IN ('paused', 'completed', 'failed', 'canceled') \
                  AND (j.retry_at IS NULL OR j.retry_at <= {now}) \
                  AND (j.lease_token IS NULL OR j.lease_expires_at <= {now} OR NOT kfs_worker_alive(j.worker_id)))",
                "retry_at = NULL,",
                "stage NOT IN ('paused', 'completed', 'failed', 'canceled')",
                "stage IN ('completed', 'failed', 'canceled')",
            ),
        };
        // The lease is checked against the wall clock at each statement, not the transaction's
        // start: a worker paused mid-step must not commit after its lease ran out.
        let fence = format!("id = $1 AND lease_token = $2 AND row_version = $3 AND lease_expires_at > {{clock}} AND {live}");

        let (succeed, fail, cancel, wait, cont) = match spec.states {
            States::RunState { failed_keeps_slot } => (
                "run_state = 'succeeded', checkpoint = $5, active_slot = NULL, completed_at = now(), \
                 last_error_code = NULL, last_error_message = NULL"
                    .to_owned(),
                if failed_keeps_slot {
                    "run_state = 'failed', last_error_code = $5, last_error_message = $6".to_owned()
                } else {
                    "run_state = 'failed', active_slot = NULL, completed_at = now(), \
                     last_error_code = $5, last_error_message = $6"
                        .to_owned()
                },
                "run_state = 'canceled', active_slot = NULL, completed_at = now(), \
                 last_error_code = $5, last_error_message = $6"
                    .to_owned(),
                "run_state = 'retry_wait', retry_at = {now+$5}, last_error_code = $6, last_error_message = $7, \
                 execution_attempts = execution_attempts - $8"
                    .to_owned(),
                "run_state = 'queued', execution_attempts = execution_attempts - 1".to_owned(),
            ),
            States::Stage => (
                // $5 (the final stage) is always 'completed' for research.
                "stage = $5, completed_at = {now}, error = NULL".to_owned(),
                "stage = 'failed', completed_at = {now}, error = $5 || ': ' || $6".to_owned(),
                "stage = 'canceled', completed_at = {now}, error = $5 || ': ' || $6".to_owned(),
                "retry_at = {now+$5}, error = $6 || ': ' || $7, execution_attempts = execution_attempts - $8".to_owned(),
                "execution_attempts = execution_attempts - 1".to_owned(),
            ),
        };

        let end = |job_set: &str, outbox_set: &str| {
            spec.sql(&format!(
                "WITH j AS ( \
                   UPDATE {{job}} SET {job_set}, {LEASE_CLEAR}, row_version = row_version + 1, updated_at = {{now}} \
                   WHERE {fence} RETURNING retry_at \
                 ) \
                 UPDATE {{outbox}} AS o SET {outbox_set}, lock_token = NULL, locked_by = NULL, locked_until = NULL, \
                   updated_at = {{now}} \
                 FROM j WHERE o.id = $4 RETURNING o.id"
            ))
        };

        let exhausted_set = match spec.states {
            States::RunState { failed_keeps_slot: true } => {
                "run_state = 'failed', retry_at = NULL, last_error_code = 'attempts_exhausted', last_error_message = $3"
            }
            States::RunState { failed_keeps_slot: false } => {
                "run_state = 'failed', retry_at = NULL, active_slot = NULL, completed_at = now(), \
                 last_error_code = 'attempts_exhausted', last_error_message = $3"
            }
            States::Stage => "stage = 'failed', retry_at = NULL, completed_at = {now}, error = 'attempts_exhausted: ' || $3",
        };

        // Seconds from the previous holder's last heartbeat to now, in the table's clock.
        let silent_for = match spec.clock {
            Clock::Timestamptz => "extract(epoch FROM {now} - prev.heartbeat_at)::float8",
            Clock::EpochMillis => "(({now} - prev.heartbeat_at) / 1000.0)::float8",
        };
        Statements {
            // One statement, committed on its own: lock the job row (`prev`), then its outbox
            // row (`ob`), and only when both are still claimable write either. Locks are taken
            // job first, as everywhere else. `prev` reads the locked row before the update: a
            // lease still on it means its holder never ended the slice, so this is a takeover.
            claim: spec.sql(&format!(
                "WITH prev AS ( \
                   SELECT j.id, j.lease_token IS NOT NULL AS held, j.heartbeat_at FROM {{job}} j \
                   WHERE j.id = $1 AND {claimable} AND j.execution_attempts < j.max_execution_attempts \
                   FOR UPDATE OF j \
                 ), ob AS ( \
                   SELECT o.id FROM {{outbox}} o JOIN prev ON o.{{fk}} = prev.id \
                   WHERE o.id = $2 AND o.queue_job_id = $6 AND o.status IN ('dispatching', 'dispatched', 'leased') \
                   FOR UPDATE OF o \
                 ), claimed AS ( \
                   UPDATE {{job}} AS j SET {running_set} \
                     worker_id = $3, lease_token = $4, lease_expires_at = {{now+$5}}, heartbeat_at = {{now}}, \
                     execution_attempts = j.execution_attempts + 1, row_version = j.row_version + 1, updated_at = {{now}} \
                   FROM ob WHERE j.id = $1 \
                   RETURNING j.{{cp}}::text AS cp, j.row_version, j.execution_attempts, j.max_execution_attempts, \
                     j.lease_expires_at \
                 ), leased AS ( \
                   UPDATE {{outbox}} AS o SET status = 'leased', available_at = claimed.lease_expires_at, \
                     delivered_at = {{now}}, lock_token = NULL, locked_by = NULL, locked_until = NULL, updated_at = {{now}} \
                   FROM claimed WHERE o.id = $2 RETURNING 1 \
                 ) \
                 SELECT claimed.cp, claimed.row_version, claimed.execution_attempts, claimed.max_execution_attempts, \
                   prev.held, {silent_for} \
                 FROM claimed, prev"
            )),
            diagnose: spec.sql(&format!(
                "SELECT o.status::text, o.queue_job_id, o.{{fk}} = $1 AS same_job, \
                   j.row_version, ({terminal}) AS terminal, \
                   (j.{{cp}} = 'paused') AS paused, \
                   (j.lease_token IS NOT NULL AND j.lease_expires_at > {{now}} \
                     AND (kfs_worker_alive(j.worker_id) OR j.execution_attempts >= j.max_execution_attempts)) AS lease_live, \
                   (j.execution_attempts >= j.max_execution_attempts \
                     AND (j.lease_token IS NULL OR j.lease_expires_at <= {{now}})) AS exhausted, \
                   (j.retry_at IS NOT NULL AND j.retry_at > {{now}}) AS retry_later \
                 FROM {{outbox}} o LEFT JOIN {{job}} j ON j.id = o.{{fk}} WHERE o.id = $2"
            )),
            // A row lock, not a write: the lock keeps every other writer out until the step
            // commits or rolls back, and the step's one write (the checkpoint or the end) bumps
            // `row_version`. A step thus writes one job row version instead of two.
            // The job leased under this token by this worker, for this delivery: a claim of
            // ours that committed although its reply was lost.
            ours: spec.sql(&format!(
                "SELECT j.{{cp}}::text, j.row_version, j.execution_attempts, j.max_execution_attempts \
                 FROM {{job}} j JOIN {{outbox}} o ON o.{{fk}} = j.id \
                 WHERE j.id = $1 AND j.lease_token = $2 AND j.worker_id = $3 AND j.lease_expires_at > {{now}} \
                   AND {live} AND o.id = $4 AND o.queue_job_id = $5 AND o.status = 'leased'"
            )),
            fence: spec.sql(&format!(
                "SELECT row_version, set_config('idle_in_transaction_session_timeout', $4, true) \
                 FROM {{job}} WHERE {fence} FOR NO KEY UPDATE"
            )),
            advance: spec.sql(
                "UPDATE {job} SET {cp} = $2, row_version = row_version + 1, updated_at = {now} \
                 WHERE id = $1 AND lease_token = $3 AND lease_expires_at > {clock} RETURNING row_version",
            ),
            heartbeat: spec.sql(&format!(
                "WITH j AS ( \
                   UPDATE {{job}} SET lease_expires_at = {{clock+$3}}, heartbeat_at = {{clock}} \
                   WHERE id = $1 AND lease_token = $2 AND lease_expires_at > {{clock}} AND {live} \
                   RETURNING lease_expires_at \
                 ), o AS ( \
                   UPDATE {{outbox}} SET available_at = j.lease_expires_at FROM j \
                   WHERE {{outbox}}.id = $4 AND {{outbox}}.status = 'leased' AND {{outbox}}.queue_job_id = $5 \
                   RETURNING 1 \
                 ) SELECT count(*) FROM j"
            )),
            end_succeed: end(&succeed, "status = 'completed'"),
            end_fail: end(&fail, "status = 'dead', last_error = $5 || ': ' || $6"),
            end_cancel: end(&cancel, "status = 'canceled', last_error = $5 || ': ' || $6"),
            end_supersede: if spec.superseded_state {
                end(
                    "run_state = 'superseded', active_slot = NULL, completed_at = now(), \
                     last_error_code = 'superseded', last_error_message = $5",
                    "status = 'canceled', last_error = 'superseded: ' || $5",
                )
            } else {
                let canceled = match spec.states {
                    States::RunState { .. } => {
                        "run_state = 'canceled', active_slot = NULL, completed_at = now(), \
                         last_error_code = 'superseded', last_error_message = $5"
                    }
                    States::Stage => "stage = 'canceled', completed_at = {now}, error = 'superseded: ' || $5",
                };
                end(canceled, "status = 'canceled', last_error = 'superseded: ' || $5")
            },
            end_wait: end(&wait, "status = 'pending', available_at = j.retry_at, dispatch_attempts = 0, last_error = NULL"),
            end_continue: end(&cont, "status = 'pending', available_at = {now}, dispatch_attempts = 0, last_error = NULL"),
            fail_exhausted: spec.sql(&format!(
                "WITH j AS ( \
                   UPDATE {{job}} SET {exhausted_set}, {LEASE_CLEAR}, row_version = row_version + 1, updated_at = {{now}} \
                   WHERE id = $1 AND row_version = $2 \
                   RETURNING id, {{cp}}::text AS cp, row_version, execution_attempts, max_execution_attempts \
                 ) \
                 UPDATE {{outbox}} AS o SET status = 'dead', last_error = 'attempts_exhausted', lock_token = NULL, \
                   locked_by = NULL, locked_until = NULL, updated_at = {{now}} \
                 FROM j WHERE o.id = $4 \
                 RETURNING j.cp, j.row_version, j.execution_attempts, j.max_execution_attempts"
            )),
            rearm_at_lease: spec.sql(
                "UPDATE {outbox} AS o SET status = 'leased', available_at = j.lease_expires_at, \
                   lock_token = NULL, locked_by = NULL, locked_until = NULL, updated_at = {now} \
                 FROM {job} j WHERE o.id = $2 AND j.id = $1 AND o.{fk} = j.id AND o.queue_job_id = $3 \
                   AND o.status IN ('dispatching', 'dispatched', 'leased') AND j.lease_expires_at IS NOT NULL \
                   AND (o.status <> 'leased' OR o.available_at IS DISTINCT FROM j.lease_expires_at)",
            ),
            rearm_at_retry: spec.sql(
                "UPDATE {outbox} AS o SET status = 'pending', available_at = j.retry_at, dispatch_attempts = 0, \
                   lock_token = NULL, locked_by = NULL, locked_until = NULL, updated_at = {now} \
                 FROM {job} j WHERE o.id = $2 AND j.id = $1 AND o.{fk} = j.id AND o.queue_job_id = $3 \
                   AND o.status IN ('dispatching', 'dispatched', 'leased') AND j.retry_at IS NOT NULL",
            ),
            settle: super::settle::Statements::new(spec),
            spec,
        }
    }
}

/// What a delivery found in the database.
#[derive(Clone, Debug)]
pub enum Claim {
    /// The job is ours until the lease runs out.
    Claimed(JobCtx),
    /// The delivery does not match the outbox row (an older or unknown delivery).
    Stale(&'static str),
    /// Another live worker holds the job.
    Duplicate,
    /// The job already ended.
    Terminal,
    /// The job used up its attempts; it was failed now.
    Exhausted,
}

impl Claim {
    pub fn outcome(&self) -> &'static str {
        match self {
            Claim::Claimed(_) => "claimed",
            Claim::Stale(_) => "stale",
            Claim::Duplicate => "duplicate",
            Claim::Terminal => "terminal",
            Claim::Exhausted => "exhausted",
        }
    }
}

/// Claims the job a delivery points at. The claim is one statement committed on its own; only
/// a delivery it does not claim is diagnosed, in a second transaction. A failure the diagnosis
/// writes is recorded with the kind's own hook (see [`claim_as`]).
pub async fn claim(
    conn: &mut PgConnection,
    st: &Statements,
    d: &DeliveryRef,
    worker_id: &str,
    lease: Duration,
) -> Result<Claim, sqlx::Error> {
    claim_as(conn, st, d, worker_id, lease, Uuid::new_v4(), None).await
}

/// [`claim`] under a lease token the caller chose, recording a failure the diagnosis writes
/// with `hook` (the consumer's handler). A caller that retries a claim whose outcome it does
/// not know (the commit happened, the reply was lost) retries with the same token, and a job
/// already leased under that token by this worker is its own claim, not a duplicate: minting a
/// new token each time orphaned the first claim's lease until it ran out.
pub async fn claim_as(
    conn: &mut PgConnection,
    st: &Statements,
    d: &DeliveryRef,
    worker_id: &str,
    lease: Duration,
    token: Uuid,
    hook: Option<&dyn Handler>,
) -> Result<Claim, sqlx::Error> {
    type Row = (String, i32, i32, i32, bool, Option<f64>);
    let row: Option<Row> = sqlx::query_as(&st.claim)
        .bind(d.job_id)
        .bind(d.outbox_id)
        .bind(worker_id)
        .bind(token)
        .bind(millis(lease))
        .bind(&d.delivery_id)
        .fetch_optional(&mut *conn)
        .await?;
    if let Some((checkpoint, row_version, attempts, max_attempts, taken_over, silent_for)) = row {
        crate::metrics::attempt(d.kind.name(), attempts);
        if taken_over {
            crate::metrics::takeover(
                d.kind.name(),
                silent_for.map(|s| Duration::from_secs_f64(s.max(0.0))),
            );
        }
        return Ok(Claim::Claimed(JobCtx {
            kind: d.kind,
            job_id: d.job_id,
            outbox_id: d.outbox_id,
            delivery_id: d.delivery_id.clone(),
            lease_token: token,
            row_version,
            checkpoint,
            execution_attempts: attempts,
            max_execution_attempts: max_attempts,
            worker_id: worker_id.to_owned(),
        }));
    }
    let ours: Option<(String, i32, i32, i32)> = sqlx::query_as(&st.ours)
        .bind(d.job_id)
        .bind(token)
        .bind(worker_id)
        .bind(d.outbox_id)
        .bind(&d.delivery_id)
        .fetch_optional(&mut *conn)
        .await?;
    if let Some((checkpoint, row_version, attempts, max_attempts)) = ours {
        return Ok(Claim::Claimed(JobCtx {
            kind: d.kind,
            job_id: d.job_id,
            outbox_id: d.outbox_id,
            delivery_id: d.delivery_id.clone(),
            lease_token: token,
            row_version,
            checkpoint,
            execution_attempts: attempts,
            max_execution_attempts: max_attempts,
            worker_id: worker_id.to_owned(),
        }));
    }
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let verdict = diagnose(&mut tx, st, d, hook).await?;
    tx.commit().await?;
    Ok(verdict)
}

/// Settles the outbox row an unusable message names (see [`super::settle`]), in a transaction
/// of its own on `conn`.
pub async fn settle_named(
    conn: &mut PgConnection,
    st: &Statements,
    hook: Option<&dyn Handler>,
    outbox_id: Uuid,
    delivery_id: &str,
) -> Result<super::settle::Settled, sqlx::Error> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let settled = super::settle::settle(&mut tx, &st.settle, hook, outbox_id, delivery_id).await?;
    tx.commit().await?;
    Ok(settled)
}

async fn diagnose(
    tx: &mut Transaction<'_, Postgres>,
    st: &Statements,
    d: &DeliveryRef,
    hook: Option<&dyn Handler>,
) -> Result<Claim, sqlx::Error> {
    type Row = (
        String,
        Option<String>,
        bool,
        Option<i32>,
        Option<bool>,
        Option<bool>,
        Option<bool>,
        Option<bool>,
        Option<bool>,
    );
    let row: Option<Row> = sqlx::query_as(&st.diagnose)
        .bind(d.job_id)
        .bind(d.outbox_id)
        .fetch_optional(&mut **tx)
        .await?;
    let Some((
        status,
        queue_job_id,
        same_job,
        row_version,
        terminal,
        paused,
        lease_live,
        exhausted,
        retry_later,
    )) = row
    else {
        return Ok(Claim::Stale("no such outbox row"));
    };
    if !same_job {
        // The message names another job than its row's. When it is the row's current delivery
        // the row's own payload says so, and no delivery of it can ever be used.
        let settled =
            super::settle::settle(tx, &st.settle, hook, d.outbox_id, &d.delivery_id).await?;
        log_settled(d, &settled);
        return Ok(Claim::Stale("outbox row belongs to another job"));
    }
    if queue_job_id.as_deref() != Some(d.delivery_id.as_str()) {
        return Ok(Claim::Stale("a newer delivery replaced this one"));
    }
    if !matches!(status.as_str(), "dispatching" | "dispatched" | "leased") {
        return Ok(Claim::Stale("outbox row is no longer out for delivery"));
    }
    let Some(row_version) = row_version else {
        return Ok(Claim::Stale("no such job"));
    };
    if terminal == Some(true) {
        // The job ended while its row was still out for delivery: settle the row to match, so
        // the relay stops publishing it.
        let settled =
            super::settle::settle(tx, &st.settle, hook, d.outbox_id, &d.delivery_id).await?;
        log_settled(d, &settled);
        return Ok(Claim::Terminal);
    }
    if paused == Some(true) {
        return Ok(Claim::Stale("job is paused"));
    }
    if lease_live == Some(true) {
        // Another live worker runs it (or its holder only looks gone, a blip of its liveness
        // session, and no attempt is left to take it over with: only the lease's end decides
        // that the job used its last attempt). Keep the outbox row due when that lease would run out,
        // so the job is published again if that worker stops heartbeating, whatever the
        // visibility window of this delivery was.
        sqlx::query(&st.rearm_at_lease)
            .bind(d.job_id)
            .bind(d.outbox_id)
            .bind(&d.delivery_id)
            .execute(&mut **tx)
            .await?;
        return Ok(Claim::Duplicate);
    }
    if exhausted == Some(true) {
        let done: Option<(String, i32, i32, i32)> = sqlx::query_as(&st.fail_exhausted)
            .bind(d.job_id)
            .bind(row_version)
            .bind("the job used up its execution attempts")
            .bind(d.outbox_id)
            .fetch_optional(&mut **tx)
            .await?;
        let Some((checkpoint, row_version, attempts, max_attempts)) = done else {
            return Ok(Claim::Duplicate);
        };
        // The kind's record of the failure commits with it, as for every failure.
        let job = JobCtx::unleased(
            d.kind,
            d.job_id,
            d.outbox_id,
            row_version,
            checkpoint,
            attempts,
            max_attempts,
        );
        super::kind::failed(tx, hook, st.spec, &job, "attempts_exhausted").await?;
        return Ok(Claim::Exhausted);
    }
    if retry_later == Some(true) {
        // Delivered before its retry time: put the outbox row back so the relay sends it then.
        sqlx::query(&st.rearm_at_retry)
            .bind(d.job_id)
            .bind(d.outbox_id)
            .bind(&d.delivery_id)
            .execute(&mut **tx)
            .await?;
        return Ok(Claim::Stale("delivered before the job's retry time"));
    }
    Ok(Claim::Stale("job is not claimable"))
}

pub(crate) fn log_settled(d: &DeliveryRef, settled: &super::settle::Settled) {
    match settled {
        super::settle::Settled::Left(why) => {
            tracing::debug!(kind = %d.kind, outbox_id = %d.outbox_id, delivery_id = %d.delivery_id, why, "outbox row left as it is");
        }
        super::settle::Settled::Dead { reason, job_failed } => {
            tracing::warn!(kind = %d.kind, outbox_id = %d.outbox_id, reason = %reason, job_failed, "no delivery can use this outbox row: dead");
        }
        super::settle::Settled::Matched(status) => {
            tracing::info!(kind = %d.kind, outbox_id = %d.outbox_id, status, "outbox row settled to match its terminal job");
        }
    }
}

/// Locks the job row for one step and checks that the lease is still ours. Returns the row
/// version (unchanged: the step's own write bumps it), or `None` when the lease is lost.
///
/// The same statement sets the transaction's `idle_in_transaction_session_timeout` to the
/// kind's `lease`: a step may spend up to its lease outside the database with its transaction
/// open (a model call), and a worker frozen mid-step releases its locks once that has passed.
pub async fn fence(
    tx: &mut PgConnection,
    st: &Statements,
    job: &JobCtx,
    lease: Duration,
) -> Result<Option<i32>, sqlx::Error> {
    let row: Option<(i32, String)> = sqlx::query_as(&st.fence)
        .bind(job.job_id)
        .bind(job.lease_token)
        .bind(job.row_version)
        .bind(idle_timeout(lease))
        .fetch_optional(tx)
        .await?;
    Ok(row.map(|(rv, _)| rv))
}

/// The `idle_in_transaction_session_timeout` value of a step transaction under `lease`.
pub fn idle_timeout(lease: Duration) -> String {
    format!("{}ms", lease.as_millis().max(1000))
}

/// Moves the checkpoint, after [`fence`] in the same transaction, checking once more that the
/// lease has not run out meanwhile. Returns the new row version, or `None` when it has: roll
/// back.
pub async fn advance(
    tx: &mut PgConnection,
    st: &Statements,
    job: &JobCtx,
    checkpoint: &str,
) -> Result<Option<i32>, sqlx::Error> {
    sqlx::query_scalar(&st.advance)
        .bind(job.job_id)
        .bind(checkpoint)
        .bind(job.lease_token)
        .fetch_optional(tx)
        .await
}

/// Extends the lease and the outbox visibility. `false`: the lease is lost.
pub async fn heartbeat(
    conn: &mut PgConnection,
    st: &Statements,
    job: &JobCtx,
    lease: Duration,
) -> Result<bool, sqlx::Error> {
    let n: i64 = sqlx::query_scalar(&st.heartbeat)
        .bind(job.job_id)
        .bind(job.lease_token)
        .bind(millis(lease))
        .bind(job.outbox_id)
        .bind(&job.delivery_id)
        .fetch_one(conn)
        .await?;
    Ok(n == 1)
}

/// How a slice ends, as written to the database.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum End {
    Succeed {
        checkpoint: String,
    },
    Fail {
        code: String,
        message: String,
    },
    Cancel {
        code: String,
        message: String,
    },
    Supersede {
        message: String,
    },
    /// `retry_wait` until `delay` from now. `refund`: give the attempt back (a planned wait,
    /// not a failure).
    Wait {
        delay: Duration,
        code: String,
        message: String,
        refund: bool,
    },
    /// The slice budget ran out: claimable again at once.
    Continue,
}

impl End {
    pub fn name(&self) -> &'static str {
        match self {
            End::Succeed { .. } => "succeeded",
            End::Fail { .. } => "failed",
            End::Cancel { .. } => "canceled",
            End::Supersede { .. } => "superseded",
            End::Wait { .. } => "wait",
            End::Continue => "continue",
        }
    }
}

/// Ends the slice. `false`: the lease was lost and nothing was written.
pub async fn end(
    conn: &mut PgConnection,
    st: &Statements,
    job: &JobCtx,
    how: &End,
) -> Result<bool, sqlx::Error> {
    fn base<'q>(
        sql: &'q str,
        job: &JobCtx,
    ) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
        sqlx::query(sql)
            .bind(job.job_id)
            .bind(job.lease_token)
            .bind(job.row_version)
            .bind(job.outbox_id)
    }
    let done = match how {
        End::Succeed { checkpoint } => {
            base(&st.end_succeed, job)
                .bind(checkpoint)
                .execute(conn)
                .await?
        }
        End::Fail { code, message } => {
            base(&st.end_fail, job)
                .bind(code)
                .bind(message)
                .execute(conn)
                .await?
        }
        End::Supersede { message } => {
            base(&st.end_supersede, job)
                .bind(message)
                .execute(conn)
                .await?
        }
        End::Cancel { code, message } => {
            base(&st.end_cancel, job)
                .bind(code)
                .bind(message)
                .execute(conn)
                .await?
        }
        End::Wait {
            delay,
            code,
            message,
            refund,
        } => {
            base(&st.end_wait, job)
                .bind(millis(*delay))
                .bind(code)
                .bind(message)
                .bind(i32::from(*refund))
                .execute(conn)
                .await?
        }
        End::Continue => base(&st.end_continue, job).execute(conn).await?,
    };
    Ok(done.rows_affected() == 1)
}

pub fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
