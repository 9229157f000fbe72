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

/// An event to append: [`append_events`] writes a step's events, and those of every task
/// stepped with it, in one statement.
#[derive(Clone, Debug, PartialEq)]
pub struct NewEvent {
    pub scope: JobScope,
    /// The row version its key names (see the module's notes).
    pub row_version: i32,
    pub event_type: EventType,
    pub stage: Stage,
    pub payload: Value,
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
    let event = NewEvent {
        scope: scope.clone(),
        row_version,
        event_type,
        stage,
        payload,
    };
    Ok(append_events(conn, std::slice::from_ref(&event))
        .await?
        .first()
        .copied())
}

/// Appends `events` in one statement, each unless its key exists, in the order given: a job's
/// events get the sequences after its last one, in that order, with no gap for one that
/// existed. Returns the sequences of those added. The caller holds every job row's lock.
pub async fn append_events(
    conn: &mut PgConnection,
    events: &[NewEvent],
) -> Result<Vec<i32>, sqlx::Error> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let n = events.len();
    let (mut ids, mut tenants, mut spaces, mut jobs) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let (mut keys, mut types, mut stages, mut payloads) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for e in events {
        ids.push(Uuid::now_v7());
        tenants.push(e.scope.tenant_id.as_str());
        spaces.push(e.scope.space_id);
        jobs.push(e.scope.job_id);
        keys.push(progress_key(e.scope.job_id, e.row_version, e.event_type));
        types.push(e.event_type.as_str());
        stages.push(e.stage.as_str());
        payloads.push(&e.payload);
    }
    sqlx::query_scalar(&format!(
        "INSERT INTO research_task_progress_events (id, tenant_id, knowledge_space_id, research_task_job_id, \
           sequence, idempotency_key, event_type, stage, payload, created_at) \
         SELECT n.id, n.tenant_id, n.space_id, n.job_id, \
           coalesce((SELECT max(e.sequence) FROM research_task_progress_events e \
                     WHERE e.tenant_id = n.tenant_id AND e.research_task_job_id = n.job_id), 0) \
             + row_number() OVER (PARTITION BY n.job_id ORDER BY n.ord), \
           n.key, n.event_type, n.stage, n.payload, {NOW_MS} \
         FROM unnest($1::uuid[], $2::text[], $3::uuid[], $4::uuid[], $5::text[], $6::text[], $7::text[], $8::jsonb[]) \
           WITH ORDINALITY AS n(id, tenant_id, space_id, job_id, key, event_type, stage, payload, ord) \
         WHERE NOT EXISTS (SELECT 1 FROM research_task_progress_events x \
                           WHERE x.research_task_job_id = n.job_id AND x.idempotency_key = n.key) \
         ON CONFLICT (research_task_job_id, idempotency_key) DO NOTHING \
         RETURNING sequence"
    ))
    .bind(ids)
    .bind(tenants)
    .bind(spaces)
    .bind(jobs)
    .bind(keys)
    .bind(types)
    .bind(stages)
    .bind(payloads)
    .fetch_all(conn)
    .await
}

/// Of `(scope, execution attempt)`, the jobs whose attempt has no claim event yet, in one
/// statement.
pub async fn unclaimed(
    conn: &mut PgConnection,
    jobs: &[(&JobScope, i32)],
) -> Result<Vec<Uuid>, sqlx::Error> {
    let tenants: Vec<&str> = jobs.iter().map(|(s, _)| s.tenant_id.as_str()).collect();
    let ids: Vec<Uuid> = jobs.iter().map(|(s, _)| s.job_id).collect();
    let attempts: Vec<i32> = jobs.iter().map(|(_, a)| *a).collect();
    sqlx::query_scalar(
        "SELECT u.job_id FROM unnest($1::text[], $2::uuid[], $3::int[]) AS u(tenant_id, job_id, attempt) \
         WHERE NOT EXISTS (SELECT 1 FROM research_task_progress_events e \
           WHERE e.tenant_id = u.tenant_id AND e.research_task_job_id = u.job_id \
             AND e.event_type = 'research_task.stage_changed' \
             AND e.payload @> jsonb_build_object('executionAttempt', u.attempt, 'workerClaimed', true))",
    )
    .bind(tenants)
    .bind(ids)
    .bind(attempts)
    .fetch_all(conn)
    .await
}

/// The claim event of execution attempt `attempt`, keyed by the row version the claim wrote
/// (`row_version`) and at the stage the job was claimed at. The engine's claim commits on its
/// own; the first transaction of the attempt that the kind writes (its first step, or the end
/// of a failed one) records it, when [`unclaimed`] says it is not there yet.
pub fn claimed_event(scope: &JobScope, row_version: i32, attempt: i32, stage: Stage) -> NewEvent {
    NewEvent {
        scope: scope.clone(),
        row_version,
        event_type: EventType::StageChanged,
        stage,
        payload: payload::claimed(attempt),
    }
}

/// Appends the claim event of execution attempt `attempt` unless it exists (see
/// [`claimed_event`]).
pub async fn ensure_claimed(
    conn: &mut PgConnection,
    scope: &JobScope,
    row_version: i32,
    attempt: i32,
    stage: Stage,
) -> Result<(), sqlx::Error> {
    if unclaimed(conn, &[(scope, attempt)]).await?.is_empty() {
        return Ok(());
    }
    append_events(conn, &[claimed_event(scope, row_version, attempt, stage)]).await?;
    Ok(())
}

/// A partial result to append (see [`append_partials`]).
#[derive(Clone, Debug, PartialEq)]
pub struct NewPartial {
    pub scope: JobScope,
    pub key: String,
    pub bundle: Value,
}

/// Appends `partials` in one statement, each unless its key exists, with the same sequences as
/// [`append_events`] gives events. The caller holds every job row's lock.
pub async fn append_partials(
    conn: &mut PgConnection,
    partials: &[NewPartial],
) -> Result<(), sqlx::Error> {
    if partials.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = partials.iter().map(|_| Uuid::now_v7()).collect();
    let tenants: Vec<&str> = partials
        .iter()
        .map(|p| p.scope.tenant_id.as_str())
        .collect();
    let spaces: Vec<Uuid> = partials.iter().map(|p| p.scope.space_id).collect();
    let jobs: Vec<Uuid> = partials.iter().map(|p| p.scope.job_id).collect();
    let keys: Vec<&str> = partials.iter().map(|p| p.key.as_str()).collect();
    let bundles: Vec<&Value> = partials.iter().map(|p| &p.bundle).collect();
    sqlx::query(&format!(
        "INSERT INTO research_task_partial_results (id, tenant_id, knowledge_space_id, research_task_job_id, \
           sequence, idempotency_key, evidence_bundle, created_at) \
         SELECT n.id, n.tenant_id, n.space_id, n.job_id, \
           coalesce((SELECT max(p.sequence) FROM research_task_partial_results p \
                     WHERE p.tenant_id = n.tenant_id AND p.research_task_job_id = n.job_id), 0) \
             + row_number() OVER (PARTITION BY n.job_id ORDER BY n.ord), \
           n.key, n.bundle, {NOW_MS} \
         FROM unnest($1::uuid[], $2::text[], $3::uuid[], $4::uuid[], $5::text[], $6::jsonb[]) \
           WITH ORDINALITY AS n(id, tenant_id, space_id, job_id, key, bundle, ord) \
         WHERE NOT EXISTS (SELECT 1 FROM research_task_partial_results x \
                           WHERE x.research_task_job_id = n.job_id AND x.idempotency_key = n.key) \
         ON CONFLICT (research_task_job_id, idempotency_key) DO NOTHING"
    ))
    .bind(ids)
    .bind(tenants)
    .bind(spaces)
    .bind(jobs)
    .bind(keys)
    .bind(bundles)
    .execute(conn)
    .await?;
    Ok(())
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
