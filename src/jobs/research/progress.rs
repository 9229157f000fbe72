//! Progress events and partial results, with the platform's payloads and keys. Invariant: both
//! are appended with `sequence = max + 1` per job by one writer at a time, so sequences are
//! contiguous from 1: by a transaction that holds the job row's lock, or (an answer's deltas,
//! [`append_fenced`]) by the step that holds that lock, from a connection of its own, while it
//! writes nothing else of the job; and both are keyed, so writing the same event or partial
//! again (a replayed step, a repeated request) adds nothing. An event's key
//! (`research-task-progress:<jobId>:<rowVersion>:<type>`) names the `row_version` the job row
//! has when the writing transaction commits; only that transaction can create that version, so
//! the key is unique per transition and the same for any replay of it. An answer delta's key
//! (`research-task-progress:<jobId>:attempt:<n>:answer:<offset>`) names the execution attempt
//! and where in that attempt's answer it starts. The one partial is the final evidence bundle
//! with the answer, `research-task:<jobId>:final-evidence`.

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
    AnswerDelta,
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
            EventType::AnswerDelta => "research_task.answer_delta",
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

/// `research-task-progress:<jobId>:attempt:<attempt>:answer:<offset>`: an answer delta's key,
/// `offset` counting UTF-16 code units of the attempt's answer before it.
pub fn answer_delta_key(job_id: Uuid, attempt: i32, offset: usize) -> String {
    format!("research-task-progress:{job_id}:attempt:{attempt}:answer:{offset}")
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

    /// `research_task.answer_delta`: exactly these three keys.
    pub fn answer_delta(delta: &str, attempt: i32, offset: usize) -> Value {
        json!({ "delta": delta, "executionAttempt": attempt, "offset": offset })
    }
}

/// An event to append: [`append_events`] writes a step's events, and those of every task
/// stepped with it, in one statement.
#[derive(Clone, Debug, PartialEq)]
pub struct NewEvent {
    pub scope: JobScope,
    /// Its idempotency key (see the module's notes).
    pub key: String,
    pub event_type: EventType,
    pub stage: Stage,
    pub payload: Value,
}

impl NewEvent {
    /// An event keyed by the row version the writing transaction leaves the job at.
    pub fn at(
        scope: &JobScope,
        row_version: i32,
        event_type: EventType,
        stage: Stage,
        payload: Value,
    ) -> Self {
        Self {
            key: progress_key(scope.job_id, row_version, event_type),
            scope: scope.clone(),
            event_type,
            stage,
            payload,
        }
    }

    /// An answer delta of execution attempt `attempt`, starting at `offset` of its answer.
    pub fn answer_delta(
        scope: &JobScope,
        stage: Stage,
        attempt: i32,
        offset: usize,
        delta: &str,
    ) -> Self {
        Self {
            key: answer_delta_key(scope.job_id, attempt, offset),
            scope: scope.clone(),
            event_type: EventType::AnswerDelta,
            stage,
            payload: payload::answer_delta(delta, attempt, offset),
        }
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
    let event = NewEvent::at(scope, row_version, event_type, stage, payload);
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
    let sql = insert_events_sql("TRUE", "RETURNING sequence");
    let rows: Vec<(i32,)> = bind_events(&sql, events).fetch_all(conn).await?;
    Ok(rows.into_iter().map(|(s,)| s).collect())
}

/// The statement that inserts `$1..$8` (see [`bind_events`]) where `condition` holds, then
/// `returning`.
fn insert_events_sql(condition: &str, returning: &str) -> String {
    format!(
        "INSERT INTO research_task_progress_events (id, tenant_id, knowledge_space_id, research_task_job_id, \
           sequence, idempotency_key, event_type, stage, payload, created_at) \
         SELECT n.id, n.tenant_id, n.space_id, n.job_id, \
           coalesce((SELECT max(e.sequence) FROM research_task_progress_events e \
                     WHERE e.tenant_id = n.tenant_id AND e.research_task_job_id = n.job_id), 0) \
             + row_number() OVER (PARTITION BY n.job_id ORDER BY n.ord), \
           n.key, n.event_type, n.stage, n.payload, {NOW_MS} \
         FROM unnest($1::uuid[], $2::text[], $3::uuid[], $4::uuid[], $5::text[], $6::text[], $7::text[], $8::jsonb[]) \
           WITH ORDINALITY AS n(id, tenant_id, space_id, job_id, key, event_type, stage, payload, ord) \
         WHERE ({condition}) AND NOT EXISTS (SELECT 1 FROM research_task_progress_events x \
                           WHERE x.research_task_job_id = n.job_id AND x.idempotency_key = n.key) \
         ON CONFLICT (research_task_job_id, idempotency_key) DO NOTHING \
         {returning}"
    )
}

/// Binds `events` as `$1..$8` of [`insert_events_sql`].
fn bind_events<'q, O>(
    sql: &'q str,
    events: &'q [NewEvent],
) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>
where
    O: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>,
{
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
        keys.push(e.key.as_str());
        types.push(e.event_type.as_str());
        stages.push(e.stage.as_str());
        payloads.push(&e.payload);
    }
    sqlx::query_as(sql)
        .bind(ids)
        .bind(tenants)
        .bind(spaces)
        .bind(jobs)
        .bind(keys)
        .bind(types)
        .bind(stages)
        .bind(payloads)
}

/// What holds a task's events to the step writing them: its lease on the job, the row version
/// its step fenced, and (under a capability grant) the grant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseFence {
    pub scope: JobScope,
    pub lease_token: Uuid,
    pub row_version: i32,
    pub grant: Option<Uuid>,
}

/// What [`append_fenced`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fenced {
    /// The lease held and the authority stood: the events are there (added now or before).
    Written,
    /// The lease is no longer ours on a live job (expired, taken over, paused or ended, or its
    /// row version moved): nothing was written.
    LeaseLost,
    /// The task's capability grant is no longer active or its space is fenced: nothing was
    /// written.
    Revoked,
}

/// Appends `events` of one job in one statement that commits on its own, only while `fence`
/// holds: the job still leased under its token at its row version, its lease unexpired by the
/// database's wall clock, the job neither paused nor ended, and (under a grant) the grant active
/// in the job's space and the space not fenced. The job row is not locked: the caller is the
/// step that holds it, which writes no event of the job in its own transaction before this
/// commits.
pub async fn append_fenced(
    conn: &mut PgConnection,
    fence: &LeaseFence,
    events: &[NewEvent],
) -> Result<Fenced, sqlx::Error> {
    let clock = "(extract(epoch from clock_timestamp()) * 1000)::bigint";
    let sql = format!(
        "WITH live AS ( \
           SELECT (j.lease_token = $11 AND j.row_version = $12 AND j.lease_expires_at > {clock} \
                   AND j.stage NOT IN ('paused', 'completed', 'failed', 'canceled')) AS leased, \
                  ($13::uuid IS NULL OR EXISTS ( \
                    SELECT 1 FROM capability_grants g \
                    WHERE g.tenant_id = j.tenant_id AND g.knowledge_space_id = j.knowledge_space_id \
                      AND g.grant_id = $13 AND g.state = 'active' \
                      AND NOT coalesce((SELECT f.tombstoned FROM capability_space_fences f \
                                        WHERE f.tenant_id = g.tenant_id \
                                          AND f.knowledge_space_id = g.knowledge_space_id), false))) AS granted \
           FROM research_task_jobs j WHERE j.tenant_id = $9 AND j.id = $10 \
         ), added AS ({}) \
         SELECT CASE WHEN NOT coalesce((SELECT leased FROM live), false) THEN 0 \
                     WHEN NOT (SELECT granted FROM live) THEN 1 ELSE 2 END, \
                (SELECT count(*)::int FROM added)",
        insert_events_sql(
            "(SELECT leased AND granted FROM live)",
            "RETURNING sequence"
        )
    );
    let (state, _added): (i32, i32) = bind_events(&sql, events)
        .bind(&fence.scope.tenant_id)
        .bind(fence.scope.job_id)
        .bind(fence.lease_token)
        .bind(fence.row_version)
        .bind(fence.grant)
        .fetch_one(conn)
        .await?;
    Ok(match state {
        2 => Fenced::Written,
        1 => Fenced::Revoked,
        _ => Fenced::LeaseLost,
    })
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
    NewEvent::at(
        scope,
        row_version,
        EventType::StageChanged,
        stage,
        payload::claimed(attempt),
    )
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
    /// The final answer (`answer`, since the platform's 0033), trimmed; `None` for none.
    pub answer: Option<String>,
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
    let answers: Vec<Option<&str>> = partials.iter().map(|p| p.answer.as_deref()).collect();
    sqlx::query(&format!(
        "INSERT INTO research_task_partial_results (id, tenant_id, knowledge_space_id, research_task_job_id, \
           sequence, idempotency_key, evidence_bundle, answer, created_at) \
         SELECT n.id, n.tenant_id, n.space_id, n.job_id, \
           coalesce((SELECT max(p.sequence) FROM research_task_partial_results p \
                     WHERE p.tenant_id = n.tenant_id AND p.research_task_job_id = n.job_id), 0) \
             + row_number() OVER (PARTITION BY n.job_id ORDER BY n.ord), \
           n.key, n.bundle, n.answer, {NOW_MS} \
         FROM unnest($1::uuid[], $2::text[], $3::uuid[], $4::uuid[], $5::text[], $6::jsonb[], $7::text[]) \
           WITH ORDINALITY AS n(id, tenant_id, space_id, job_id, key, bundle, answer, ord) \
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
    .bind(answers)
    .execute(conn)
    .await?;
    Ok(())
}

/// The answer the task's final partial result carries: `None` when there is no final partial
/// yet, `Some(None)` when it carries none.
pub async fn final_answer(
    conn: &mut PgConnection,
    scope: &JobScope,
) -> Result<Option<Option<String>>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT answer FROM research_task_partial_results \
         WHERE tenant_id = $1 AND research_task_job_id = $2 AND idempotency_key = $3",
    )
    .bind(&scope.tenant_id)
    .bind(scope.job_id)
    .bind(final_evidence_key(scope.job_id))
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
        assert_eq!(
            answer_delta_key(id, 2, 129),
            format!("research-task-progress:{id}:attempt:2:answer:129")
        );
        let scope = JobScope {
            job_id: id,
            tenant_id: "t".into(),
            space_id: Uuid::from_u128(8),
        };
        let delta = NewEvent::answer_delta(&scope, Stage::Generating, 2, 129, "x");
        assert_eq!(delta.key, answer_delta_key(id, 2, 129));
        assert_eq!(delta.event_type.as_str(), "research_task.answer_delta");
        assert_eq!(
            NewEvent::at(&scope, 4, EventType::Failed, Stage::Failed, json!({})).key,
            progress_key(id, 4, EventType::Failed)
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
        assert_eq!(
            answer_delta("The", 1, 0),
            json!({"delta": "The", "executionAttempt": 1, "offset": 0})
        );
    }
}
