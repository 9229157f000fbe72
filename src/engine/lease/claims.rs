//! Claiming the job a delivery names. Invariant: the claim is one statement committed on its
//! own, taking the job row's lock before the outbox row's, and writes only when both are still
//! claimable and the delivery is the outbox row's current one; a delivery it does not claim is
//! diagnosed in a transaction of its own, and whatever the diagnosis writes (a settled outbox
//! row, an exhausted job failed with the kind's hook, a re-armed row) commits together.

use std::time::{Duration, Instant};

use sqlx::{PgConnection, Postgres, Transaction};
use uuid::Uuid;

use super::{millis, Claim, DeliveryRef, Statements};
use crate::engine::kind::{Handler, JobCtx};
use crate::engine::settle;

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
    let sent = Instant::now();
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
        record_claim(d, attempts, taken_over, silent_for);
        return Ok(Claim::Claimed(leased(
            d,
            token,
            worker_id,
            (checkpoint, row_version, attempts, max_attempts),
            sent,
        )));
    }
    let ours: Option<(String, i32, i32, i32)> = sqlx::query_as(&st.ours)
        .bind(d.job_id)
        .bind(token)
        .bind(worker_id)
        .bind(d.outbox_id)
        .bind(&d.delivery_id)
        .fetch_optional(&mut *conn)
        .await?;
    if let Some(row) = ours {
        // An earlier try committed this lease, at a time not known here: the first heartbeat
        // is due at once.
        let unknown = sent.checked_sub(lease).unwrap_or(sent);
        return Ok(Claim::Claimed(leased(d, token, worker_id, row, unknown)));
    }
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let verdict = diagnose(&mut tx, st, d, hook).await?;
    tx.commit().await?;
    Ok(verdict)
}

/// The job a claim leased under `token`, from its `(checkpoint, row version, attempts, max
/// attempts)` as the claim returned them; `renewed`: when the claim was sent.
pub(super) fn leased(
    d: &DeliveryRef,
    token: Uuid,
    worker_id: &str,
    (checkpoint, row_version, attempts, max_attempts): (String, i32, i32, i32),
    renewed: Instant,
) -> JobCtx {
    JobCtx {
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
        renewed,
    }
}

/// Counts a claim's attempt and, when the lease had a holder who never ended it, the takeover.
pub(super) fn record_claim(
    d: &DeliveryRef,
    attempts: i32,
    taken_over: bool,
    silent_for: Option<f64>,
) {
    crate::metrics::attempt(d.kind.name(), attempts);
    if taken_over {
        crate::metrics::takeover(
            d.kind.name(),
            silent_for.map(|s| Duration::from_secs_f64(s.max(0.0))),
        );
    }
}

/// Settles the outbox row an unusable message names (see [`crate::engine::settle`]), in a
/// transaction of its own on `conn`.
pub async fn settle_named(
    conn: &mut PgConnection,
    st: &Statements,
    hook: Option<&dyn Handler>,
    outbox_id: Uuid,
    delivery_id: &str,
) -> Result<settle::Settled, sqlx::Error> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let settled = settle::settle(&mut tx, &st.settle, hook, outbox_id, delivery_id).await?;
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
        let settled = settle::settle(tx, &st.settle, hook, d.outbox_id, &d.delivery_id).await?;
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
        let settled = settle::settle(tx, &st.settle, hook, d.outbox_id, &d.delivery_id).await?;
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
        crate::engine::kind::failed(tx, hook, st.spec, &job, "attempts_exhausted").await?;
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

pub(crate) fn log_settled(d: &DeliveryRef, settled: &settle::Settled) {
    match settled {
        settle::Settled::Left(why) => {
            tracing::debug!(kind = %d.kind, outbox_id = %d.outbox_id, delivery_id = %d.delivery_id, why, "outbox row left as it is");
        }
        settle::Settled::Dead { reason, job_failed } => {
            tracing::warn!(kind = %d.kind, outbox_id = %d.outbox_id, reason = %reason, job_failed, "no delivery can use this outbox row: dead");
        }
        settle::Settled::Matched(status) => {
            tracing::info!(kind = %d.kind, outbox_id = %d.outbox_id, status, "outbox row settled to match its terminal job");
        }
    }
}
