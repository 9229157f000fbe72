//! Pause, resume and cancel. Invariant: each control locks the job row first and then its outbox
//! rows (the engine's lock order), decides the move with the pure [`walk::control`], bumps
//! `row_version` (which fences out any worker still running the job: its next fenced write
//! matches no row) and writes its progress event, all in one transaction. A paused or canceled
//! job has no live outbox row and holds no lease; a resumed job has exactly one new pending
//! outbox revision.

use serde_json::json;
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use super::progress::{self, EventType, JobScope, NOW_MS};
use super::request::insert_outbox;
use super::walk::{self, Control, ControlMove, Refusal, Stage};

const LEASE_CLEAR: &str =
    "worker_id = NULL, lease_token = NULL, lease_expires_at = NULL, heartbeat_at = NULL";

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

/// Pauses a task: `paused`, remembering the stage to resume; cancels the live outbox row.
pub async fn pause(conn: &mut PgConnection, job_id: Uuid) -> Result<Controlled, ControlError> {
    apply(conn, job_id, Control::Pause, None).await
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
async fn cancel_outbox(
    conn: &mut PgConnection,
    job_id: Uuid,
    why: &str,
) -> Result<u64, sqlx::Error> {
    Ok(sqlx::query(&format!(
        "UPDATE research_task_outbox SET status = 'canceled', lock_token = NULL, locked_by = NULL, \
           locked_until = NULL, last_error = $2, updated_at = {NOW_MS} \
         WHERE research_task_job_id = $1 AND status IN ('pending', 'dispatching', 'dispatched', 'leased')"
    ))
    .bind(job_id)
    .bind(why)
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
    let (set, event, payload) = match action {
        Control::Pause => (
            format!("stage = 'paused', paused_from_stage = $3, paused_at = {NOW_MS}, {LEASE_CLEAR}"),
            EventType::Paused,
            json!({ "from": stage.as_str() }),
        ),
        Control::Resume => (
            format!(
                "stage = $2, paused_from_stage = NULL, paused_at = NULL, resume_after = NULL, retry_at = NULL, \
                 {LEASE_CLEAR}"
            ),
            EventType::Resumed,
            json!({ "to": to.as_str() }),
        ),
        Control::Cancel => (
            format!(
                "stage = 'canceled', completed_at = {NOW_MS}, retry_at = NULL, error = 'canceled: ' || $4, \
                 {LEASE_CLEAR}"
            ),
            EventType::Canceled,
            json!({ "from": stage.as_str(), "code": "canceled", "reason": reason.unwrap_or("canceled by request") }),
        ),
    };
    let new_version: i32 = sqlx::query_scalar(&format!(
        "UPDATE research_task_jobs SET {set}, row_version = row_version + 1, updated_at = {NOW_MS} \
         WHERE id = $1 AND row_version = $5 RETURNING row_version"
    ))
    .bind(job_id)
    .bind(to.as_str())
    .bind(paused_from.map(Stage::as_str))
    .bind(reason.unwrap_or("canceled by request"))
    .bind(row_version)
    .fetch_one(&mut *tx)
    .await?;
    match action {
        Control::Pause => {
            cancel_outbox(&mut tx, job_id, "paused").await?;
        }
        Control::Cancel => {
            cancel_outbox(&mut tx, job_id, "canceled").await?;
        }
        Control::Resume => {
            // A paused job has no live row; cancel any left over so that only the new one runs.
            cancel_outbox(&mut tx, job_id, "superseded by a resume").await?;
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
    }
    let event_sequence =
        progress::append_event(&mut tx, &scope, new_version, event, to, payload).await?;
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
