//! Progress events and partial results, with the platform's payloads and keys. Invariant: both
//! are appended only by a transaction that holds the job row's lock, with `sequence = max + 1`
//! per job, so sequences are contiguous from 1; and both are keyed, so writing the same event or
//! partial again (a replayed step, a repeated request) adds nothing. An event's key
//! (`research-task-progress:<jobId>:<rowVersion>:<type>`) names the `row_version` the job row
//! has when the writing transaction commits; only that transaction can create that version, so
//! the key is unique per transition and the same for any replay of it. The one partial is the
//! final evidence bundle, `research-task:<jobId>:final-evidence`.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::PgConnection;
use uuid::Uuid;

use super::walk::Stage;

/// "Now" as epoch milliseconds, from the database clock (the research tables store BIGINT ms).
pub const NOW_MS: &str = "(extract(epoch from now()) * 1000)::bigint";

/// The tenant and space a job belongs to: every statement names them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobScope {
    pub job_id: Uuid,
    pub tenant_id: String,
    pub space_id: Uuid,
}

/// The progress event types the schema allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    Started,
    StageChanged,
    Paused,
    Resumed,
    Canceled,
    Failed,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Started => "research_task.started",
            EventType::StageChanged => "research_task.stage_changed",
            EventType::Paused => "research_task.paused",
            EventType::Resumed => "research_task.resumed",
            EventType::Canceled => "research_task.canceled",
            EventType::Failed => "research_task.failed",
        }
    }
}

/// `research-task-progress:<jobId>:<rowVersion>:<type>`.
pub fn progress_key(job_id: Uuid, row_version: i32, event_type: EventType) -> String {
    format!(
        "research-task-progress:{job_id}:{row_version}:{}",
        event_type.as_str()
    )
}

/// `research-task:<jobId>:final-evidence`: the platform's key of a task's final evidence.
pub fn final_evidence_key(job_id: Uuid) -> String {
    format!("research-task:{job_id}:final-evidence")
}

/// The platform's event payloads, as pure functions.
pub mod payload {
    use super::*;

    /// `research_task.started`.
    pub fn started() -> Value {
        json!({})
    }

    /// The claim of an execution attempt (a `stage_changed` at the current stage).
    pub fn claimed(attempt: i32) -> Value {
        json!({ "executionAttempt": attempt, "workerClaimed": true })
    }

    /// A stage advance, with the runtime's details of what the stage did.
    pub fn advanced(previous: Stage, details: Option<Value>) -> Value {
        let mut p = json!({ "previousStage": previous.as_str() });
        if let Some(d) = details {
            p["details"] = d;
        }
        p
    }

    /// A retry scheduled (a `stage_changed` at the current stage).
    pub fn retry(error: &str, retry_at: i64) -> Value {
        json!({ "error": error, "retryAt": retry_at, "retryScheduled": true })
    }

    /// `research_task.failed`.
    pub fn failed(error: &str) -> Value {
        json!({ "error": error })
    }

    /// `research_task.canceled` and `research_task.paused`: `{"reason"}`, or `{}` without one.
    pub fn because(reason: Option<&str>) -> Value {
        match reason {
            Some(r) => json!({ "reason": r }),
            None => json!({}),
        }
    }

    /// `research_task.resumed`.
    pub fn resumed() -> Value {
        json!({ "resumedFrom": "paused" })
    }
}

/// Appends an event unless its key exists. Returns its sequence when it was added. The caller
/// holds the job row's lock.
pub async fn append_event(
    conn: &mut PgConnection,
    scope: &JobScope,
    row_version: i32,
    event_type: EventType,
    stage: Stage,
    payload: serde_json::Value,
) -> Result<Option<i32>, sqlx::Error> {
    sqlx::query_scalar(&format!(
        "INSERT INTO research_task_progress_events (id, tenant_id, knowledge_space_id, research_task_job_id, \
           sequence, idempotency_key, event_type, stage, payload, created_at) \
         SELECT $1, $2, $3, $4, coalesce(max(e.sequence), 0) + 1, $5, $6, $7, $8, {NOW_MS} \
         FROM research_task_progress_events e \
         WHERE e.tenant_id = $2 AND e.research_task_job_id = $4 \
         ON CONFLICT (research_task_job_id, idempotency_key) DO NOTHING \
         RETURNING sequence"
    ))
    .bind(Uuid::now_v7())
    .bind(&scope.tenant_id)
    .bind(scope.space_id)
    .bind(scope.job_id)
    .bind(progress_key(scope.job_id, row_version, event_type))
    .bind(event_type.as_str())
    .bind(stage.as_str())
    .bind(payload)
    .fetch_optional(conn)
    .await
}

/// Appends the claim event of execution attempt `attempt` unless it exists, keyed by the row
/// version the claim wrote (`row_version`) and at the stage the job was claimed at. The engine's
/// claim commits on its own; the first transaction of the attempt that the kind writes (its
/// first step, or the end of a failed one) records it.
pub async fn ensure_claimed(
    conn: &mut PgConnection,
    scope: &JobScope,
    row_version: i32,
    attempt: i32,
    stage: Stage,
) -> Result<(), sqlx::Error> {
    let seen: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM research_task_progress_events \
           WHERE tenant_id = $1 AND research_task_job_id = $2 AND event_type = 'research_task.stage_changed' \
             AND payload @> $3)",
    )
    .bind(&scope.tenant_id)
    .bind(scope.job_id)
    .bind(payload::claimed(attempt))
    .fetch_one(&mut *conn)
    .await?;
    if !seen {
        append_event(
            conn,
            scope,
            row_version,
            EventType::StageChanged,
            stage,
            payload::claimed(attempt),
        )
        .await?;
    }
    Ok(())
}

/// Appends a partial result unless its key exists. Returns its sequence when it was added. The
/// caller holds the job row's lock.
pub async fn append_partial(
    conn: &mut PgConnection,
    scope: &JobScope,
    key: &str,
    bundle: serde_json::Value,
) -> Result<Option<i32>, sqlx::Error> {
    sqlx::query_scalar(&format!(
        "INSERT INTO research_task_partial_results (id, tenant_id, knowledge_space_id, research_task_job_id, \
           sequence, idempotency_key, evidence_bundle, created_at) \
         SELECT $1, $2, $3, $4, coalesce(max(p.sequence), 0) + 1, $5, $6, {NOW_MS} \
         FROM research_task_partial_results p \
         WHERE p.tenant_id = $2 AND p.research_task_job_id = $4 \
         ON CONFLICT (research_task_job_id, idempotency_key) DO NOTHING \
         RETURNING sequence"
    ))
    .bind(Uuid::now_v7())
    .bind(&scope.tenant_id)
    .bind(scope.space_id)
    .bind(scope.job_id)
    .bind(key)
    .bind(bundle)
    .fetch_optional(conn)
    .await
}

/// One committed progress event.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, sqlx::FromRow)]
#[serde(rename_all = "camelCase")]
pub struct ProgressEvent {
    pub sequence: i32,
    pub event_type: String,
    pub stage: String,
    pub payload: serde_json::Value,
    /// Epoch milliseconds.
    pub created_at: i64,
}

/// The events of a job after `after`, in sequence order.
pub async fn events_after(
    conn: &mut PgConnection,
    scope: &JobScope,
    after: i32,
) -> Result<Vec<ProgressEvent>, sqlx::Error> {
    sqlx::query_as(
        "SELECT sequence, event_type, stage, payload, created_at FROM research_task_progress_events \
         WHERE tenant_id = $1 AND research_task_job_id = $2 AND sequence > $3 ORDER BY sequence",
    )
    .bind(&scope.tenant_id)
    .bind(scope.job_id)
    .bind(after)
    .fetch_all(conn)
    .await
}

/// The scope of a job, by id. `None`: no such job.
pub async fn scope_of(
    conn: &mut PgConnection,
    job_id: Uuid,
) -> Result<Option<JobScope>, sqlx::Error> {
    let row: Option<(String, Uuid)> = sqlx::query_as(
        "SELECT tenant_id, knowledge_space_id FROM research_task_jobs WHERE id = $1",
    )
    .bind(job_id)
    .fetch_optional(conn)
    .await?;
    Ok(row.map(|(tenant_id, space_id)| JobScope {
        job_id,
        tenant_id,
        space_id,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        let id = Uuid::from_u128(7);
        assert_eq!(
            progress_key(id, 3, EventType::StageChanged),
            format!("research-task-progress:{id}:3:research_task.stage_changed")
        );
        assert_eq!(
            final_evidence_key(id),
            format!("research-task:{id}:final-evidence")
        );
    }

    #[test]
    fn payloads() {
        use payload::*;
        assert_eq!(started(), json!({}));
        assert_eq!(
            claimed(2),
            json!({"executionAttempt": 2, "workerClaimed": true})
        );
        assert_eq!(
            advanced(Stage::Queued, None),
            json!({"previousStage": "queued"})
        );
        assert_eq!(
            advanced(
                Stage::Planning,
                Some(json!({"questions": ["q"], "topK": 10}))
            ),
            json!({"details": {"questions": ["q"], "topK": 10}, "previousStage": "planning"})
        );
        assert_eq!(
            retry("e", 5),
            json!({"error": "e", "retryAt": 5, "retryScheduled": true})
        );
        assert_eq!(failed("X"), json!({"error": "X"}));
        assert_eq!(because(Some("r")), json!({"reason": "r"}));
        assert_eq!(because(None), json!({}));
        assert_eq!(resumed(), json!({"resumedFrom": "paused"}));
    }
}
