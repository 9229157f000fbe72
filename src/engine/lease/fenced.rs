//! The fenced statements of a claimed job: fence, advance, heartbeat and end of slice. Invariant:
//! each compares the lease token against a lease unexpired by the database's wall clock (fence
//! and end compare the row version too; advance follows a fence in the same transaction), and
//! zero rows changed means the lease is lost.

use std::time::Duration;

use sqlx::{PgConnection, Postgres};

use super::{millis, End, Statements};
use crate::engine::kind::JobCtx;

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

/// Reads the job row back: `Some((row version, checkpoint))` while our lease is on it and live.
pub async fn resync(
    conn: &mut PgConnection,
    st: &Statements,
    job: &JobCtx,
) -> Result<Option<(i32, String)>, sqlx::Error> {
    sqlx::query_as(&st.resync)
        .bind(job.job_id)
        .bind(job.lease_token)
        .fetch_optional(conn)
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
