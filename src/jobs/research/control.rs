//! Pause, resume and cancel, as the platform's research task state machine does them.
//! Invariant: each control locks the job row first and then its outbox rows (the engine's lock
//! order), decides the move with the pure [`walk::control`], bumps `row_version` (which fences
//! out any worker still running the job: its next fenced write matches no row, and a paused or
//! terminal job's heartbeat is refused) and writes its progress event, all in one transaction.
//! A paused or canceled job has no live outbox row; a resumed job has exactly one new pending
//! outbox revision and no lease. As on the platform, a pause keeps the lease columns (only a
//! terminal stage or a resume clears them) and records its reason as the job's `error`.

use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::engine::lease::LEASE_CLEAR;

use super::progress::{self, payload, EventType, JobScope, NOW_MS};
use super::request::insert_outbox;
use super::walk::{self, Control, ControlMove, Refusal, Stage};

/// What a control did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Controlled {
    pub job_id: Uuid,
    pub action: Control,
    /// The stage before.
    pub from: Stage,
    /// The stage after.
    pub to: Stage,
    /// `false`: the job already was where the request wanted it; nothing was written.
    pub changed: bool,
    pub row_version: i32,
    /// The outbox revision a resume inserted.
    pub outbox_revision: Option<i32>,
    /// The sequence of the progress event written.
    pub event_sequence: Option<i32>,
}

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("no research task {0}")]
    NotFound(Uuid),
    #[error("research task {0}: {1}")]
    Refused(Uuid, Refusal),
    #[error("research task {0} has an unknown stage '{1}'")]
    Corrupt(Uuid, String),
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
}

impl ControlError {
    /// A refusal (exit code 2), as opposed to a failing database.
    pub fn is_refusal(&self) -> bool {
        !matches!(self, ControlError::Db(_))
    }
}

/// Pauses a task: `paused`, remembering the stage to resume; cancels the live outbox rows.
pub async fn pause(conn: &mut PgConnection, job_id: Uuid) -> Result<Controlled, ControlError> {
    apply(conn, job_id, Control::Pause, None).await
}

/// [`pause`] with a reason, recorded in the job's error and the event.
pub async fn pause_with(
    conn: &mut PgConnection,
    job_id: Uuid,
    reason: Option<&str>,
) -> Result<Controlled, ControlError> {
    apply(conn, job_id, Control::Pause, reason).await
}

/// Resumes a paused task at the stage it was paused in, with a new outbox revision.
pub async fn resume(conn: &mut PgConnection, job_id: Uuid) -> Result<Controlled, ControlError> {
    apply(conn, job_id, Control::Resume, None).await
}

/// Cancels a task for good. `reason` is recorded in the job's error and the event.
pub async fn cancel(
    conn: &mut PgConnection,
    job_id: Uuid,
    reason: Option<&str>,
) -> Result<Controlled, ControlError> {
    apply(conn, job_id, Control::Cancel, reason).await
}

/// Cancels every outbox row of the job that is still out for delivery.
async fn cancel_outbox(conn: &mut PgConnection, job_id: Uuid) -> Result<u64, sqlx::Error> {
    Ok(sqlx::query(&format!(
        "UPDATE research_task_outbox SET status = 'canceled', lock_token = NULL, locked_by = NULL, \
           locked_until = NULL, updated_at = {NOW_MS} \
         WHERE research_task_job_id = $1 AND status IN ('pending', 'dispatching', 'dispatched', 'leased')"
    ))
    .bind(job_id)
    .execute(conn)
    .await?
    .rows_affected())
}

async fn apply(
    conn: &mut PgConnection,
    job_id: Uuid,
    action: Control,
    reason: Option<&str>,
) -> Result<Controlled, ControlError> {
    let mut tx = conn.begin().await?;
    let row: Option<(String, Uuid, String, Option<String>, i32)> = sqlx::query_as(
        "SELECT tenant_id, knowledge_space_id, stage, paused_from_stage, row_version \
         FROM research_task_jobs WHERE id = $1 FOR UPDATE",
    )
    .bind(job_id)
    .fetch_optional(&mut *tx)
    .await?;
    let (tenant_id, space_id, stage_s, paused_from_s, row_version) =
        row.ok_or(ControlError::NotFound(job_id))?;
    let stage = Stage::parse(&stage_s).ok_or_else(|| ControlError::Corrupt(job_id, stage_s))?;
    let paused_from = paused_from_s.as_deref().and_then(Stage::parse);
    let scope = JobScope {
        job_id,
        tenant_id,
        space_id,
    };
    let mv =
        walk::control(stage, paused_from, action).map_err(|r| ControlError::Refused(job_id, r))?;
    let ControlMove::Apply { to, paused_from } = mv else {
        tx.commit().await?;
        return Ok(Controlled {
            job_id,
            action,
            from: stage,
            to: stage,
            changed: false,
            row_version,
            outbox_revision: None,
            event_sequence: None,
        });
    };

    let mut outbox_revision = None;
    let (set, event, body) = match action {
        Control::Pause => (
            format!("stage = 'paused', paused_from_stage = $3, paused_at = {NOW_MS}, error = $4"),
            EventType::Paused,
            payload::because(reason),
        ),
        Control::Resume => (
            format!(
                "stage = $2, paused_from_stage = NULL, paused_at = NULL, resume_after = NULL, retry_at = NULL, \
                 error = NULL, queue_job_id = NULL, {LEASE_CLEAR}"
            ),
            EventType::Resumed,
            payload::resumed(),
        ),
        Control::Cancel => (
            format!(
                "stage = 'canceled', completed_at = {NOW_MS}, retry_at = NULL, error = coalesce($4, error), \
                 {LEASE_CLEAR}"
            ),
            EventType::Canceled,
            payload::because(reason),
        ),
    };
    let new_version: i32 = sqlx::query_scalar(&format!(
        "UPDATE research_task_jobs SET {set}, row_version = row_version + 1, updated_at = {NOW_MS} \
         WHERE id = $1 AND row_version = $5 RETURNING row_version"
    ))
    .bind(job_id)
    .bind(to.as_str())
    .bind(paused_from.map(Stage::as_str))
    .bind(reason)
    .bind(row_version)
    .fetch_one(&mut *tx)
    .await?;
    cancel_outbox(&mut tx, job_id).await?;
    if action == Control::Resume {
        let next: i32 = sqlx::query_scalar(
            "SELECT coalesce(max(delivery_revision), 0) + 1 FROM research_task_outbox \
             WHERE research_task_job_id = $1",
        )
        .bind(job_id)
        .fetch_one(&mut *tx)
        .await?;
        insert_outbox(&mut tx, &scope, next).await?;
        outbox_revision = Some(next);
    }
    let event_sequence =
        progress::append_event(&mut tx, &scope, new_version, event, to, body).await?;
    tx.commit().await?;
    Ok(Controlled {
        job_id,
        action,
        from: stage,
        to,
        changed: true,
        row_version: new_version,
        outbox_revision,
        event_sequence,
    })
}
