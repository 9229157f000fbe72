//! What the dashboard shows, read from Postgres and RabbitMQ: the overview (counts and rates
//! per kind, recent failures and jobs, dead letters), one job with its deliveries and history,
//! the defaults of a deletion retry, and the data types they return. Invariant: reads only,
//! never writes. Every SQL query the dashboard spells out is a `SELECT` in this file, except the
//! per-kind history `SELECT`s, which `kinds.rs` lists and this file runs; the dead-letter peek
//! ([`crate::dlq::list`]) leaves every message in its queue. The writes are the actions, which
//! `actions.rs` does through the library.

use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use super::kinds::{checkpoint_order, history_queries, job_actions, kind_actions};
use super::AppState;
use crate::dlq::DeadLetter;
use crate::jobs::{Clock, Kind, KindSpec, States};
use crate::status::KindStatus;

/// Rates are averaged over this window.
const RATE_WINDOW_MINUTES: i64 = 5;
/// Dead letters shown on the overview.
const DLQ_PEEK: usize = 20;

/// One kind's numbers, with rates.
#[derive(Clone, Debug, Serialize)]
pub struct KindOverview {
    #[serde(flatten)]
    pub status: KindStatus,
    /// Jobs that ended successfully per minute, averaged over the rate window.
    pub completed_per_minute: f64,
    /// Jobs that ended failed per minute, averaged over the rate window.
    pub failed_per_minute: f64,
    pub rate_window_minutes: i64,
    /// The actions this kind's jobs take.
    pub actions: Vec<&'static str>,
}

/// One job, as a list row.
#[derive(Clone, Debug, Serialize)]
pub struct JobRow {
    pub kind: String,
    pub id: Uuid,
    pub state: String,
    pub checkpoint: String,
    pub attempts: i32,
    pub max_attempts: i32,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    /// Seconds since the epoch.
    pub updated_at: f64,
    /// Actions that apply to the job in its current state.
    pub actions: Vec<&'static str>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Overview {
    /// Seconds since the epoch, by the database clock.
    pub generated_at: f64,
    pub actions_enabled: bool,
    pub kinds: Vec<KindOverview>,
    pub failures: Vec<JobRow>,
    pub recent: Vec<JobRow>,
    /// Messages in the dead-letter queue (None: RabbitMQ not reachable).
    pub dead_letters: Option<u32>,
    pub dead_letter_sample: Vec<DeadLetter>,
    /// The kinds leased straight from Postgres (bootstraps, profile backfills).
    pub leased: Vec<crate::status::LeasedStatus>,
}

fn state_column(spec: &KindSpec) -> &'static str {
    match spec.states {
        States::RunState { .. } => "run_state",
        States::Stage => "stage",
    }
}

fn success_state(spec: &KindSpec) -> &'static str {
    match spec.states {
        States::RunState { .. } => "succeeded",
        States::Stage => "completed",
    }
}

/// Epoch seconds of a time column of this kind's tables.
fn epoch(spec: &KindSpec, col: &str) -> String {
    match spec.clock {
        Clock::Timestamptz => format!("extract(epoch from {col})::float8"),
        Clock::EpochMillis => format!("({col})::float8 / 1000.0"),
    }
}

async fn rates(conn: &mut sqlx::PgConnection, kind: Kind) -> Result<(f64, f64), sqlx::Error> {
    let spec = kind.spec();
    let state = state_column(spec);
    let (ok, failed): (i64, i64) = sqlx::query_as(&spec.sql(&format!(
        "SELECT count(*) FILTER (WHERE {state} = $1), count(*) FILTER (WHERE {state} = 'failed') \
         FROM {{job}} WHERE completed_at >= {{now+$2}}"
    )))
    .bind(success_state(spec))
    .bind(-RATE_WINDOW_MINUTES * 60_000)
    .fetch_one(conn)
    .await?;
    let per = RATE_WINDOW_MINUTES as f64;
    Ok((ok as f64 / per, failed as f64 / per))
}

/// Rows of `kind`'s jobs matching `filter` (a constant SQL condition on `{state}`), newest first.
async fn job_rows(
    conn: &mut sqlx::PgConnection,
    kind: Kind,
    filter: &str,
    limit: i64,
) -> Result<Vec<JobRow>, sqlx::Error> {
    let spec = kind.spec();
    let state = state_column(spec);
    let filter = filter.replace("{state}", state);
    let rows: Vec<(Uuid, String, String, i32, i32, Value, f64)> = sqlx::query_as(&spec.sql(&format!(
        "SELECT j.id, j.{state}::text, j.{{cp}}::text, j.execution_attempts, j.max_execution_attempts, \
           jsonb_build_object('code', to_jsonb(j)->'last_error_code', 'message', to_jsonb(j)->'last_error_message', \
             'error', to_jsonb(j)->'error'), {} \
         FROM {{job}} j WHERE {filter} ORDER BY j.updated_at DESC LIMIT $1",
        epoch(spec, "j.updated_at")
    )))
    .bind(limit)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, st, cp, attempts, max, err, updated)| {
            let (code, message) = error_of(&err);
            JobRow {
                kind: kind.name().to_owned(),
                actions: job_actions(kind, &st),
                id,
                state: st,
                checkpoint: cp,
                attempts,
                max_attempts: max,
                error_code: code,
                error_message: message,
                updated_at: updated,
            }
        })
        .collect())
}

/// A job's error code and message: `last_error_code`/`last_error_message` columns, or one
/// `error` column written as `code: message`.
pub(super) fn error_of(v: &Value) -> (Option<String>, Option<String>) {
    let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    match (s("code"), s("message"), s("error")) {
        (None, None, Some(e)) => match e.split_once(": ") {
            Some((c, m)) if !c.contains(' ') => (Some(c.to_owned()), Some(m.to_owned())),
            _ => (None, Some(e)),
        },
        (c, m, _) => (c, m),
    }
}

/// Reads everything the overview shows. Dead letters need RabbitMQ; without it they are `None`.
pub async fn overview(st: &AppState) -> Result<Overview, sqlx::Error> {
    let mut status = crate::status::read(&st.pool, &st.kinds).await?;
    let amqp = tokio::time::timeout(
        Duration::from_secs(2),
        crate::broker::connect(
            &st.services.amqp_url,
            "kfs-worker dashboard",
            Duration::from_secs(2),
        ),
    )
    .await;
    let mut sample = Vec::new();
    if let Ok(Ok(conn)) = amqp {
        crate::status::add_queue_depths(&mut status, &conn, &st.topology, &st.kinds).await;
        if status.dead_letters.unwrap_or(0) > 0 {
            if let Ok(Ok(letters)) = tokio::time::timeout(
                Duration::from_secs(2),
                crate::dlq::list(&conn, &st.topology, DLQ_PEEK),
            )
            .await
            {
                sample = letters;
            }
        }
        let _ = conn.close(200, "dashboard".into()).await;
    }
    let leased = std::mem::take(&mut status.leased);
    let mut conn = crate::db::acquire(&st.pool).await?;
    let mut kinds = Vec::new();
    let mut failures = Vec::new();
    let mut recent = Vec::new();
    for (ks, &kind) in status.kinds.into_iter().zip(&st.kinds) {
        let (completed, failed) = rates(&mut conn, kind).await?;
        kinds.push(KindOverview {
            status: ks,
            completed_per_minute: completed,
            failed_per_minute: failed,
            rate_window_minutes: RATE_WINDOW_MINUTES,
            actions: kind_actions(kind),
        });
        failures
            .extend(job_rows(&mut conn, kind, "j.{state} IN ('failed', 'retry_wait')", 20).await?);
        recent.extend(job_rows(&mut conn, kind, "true", 20).await?);
    }
    let newest_first = |a: &JobRow, b: &JobRow| b.updated_at.total_cmp(&a.updated_at);
    failures.sort_by(newest_first);
    failures.truncate(20);
    recent.sort_by(newest_first);
    recent.truncate(20);
    let generated_at: f64 = sqlx::query_scalar("SELECT extract(epoch from now())::float8")
        .fetch_one(&mut *conn)
        .await?;
    Ok(Overview {
        generated_at,
        actions_enabled: st.admin_token.is_some(),
        kinds,
        failures,
        recent,
        dead_letters: status.dead_letters,
        dead_letter_sample: sample,
        leased,
    })
}

/// One job with everything recorded about it.
#[derive(Clone, Debug, Serialize)]
pub struct JobDetail {
    pub kind: String,
    pub id: Uuid,
    pub state: String,
    pub checkpoint: String,
    /// The checkpoints of the kind in order (empty when the kind has no fixed order).
    pub checkpoints: Vec<&'static str>,
    pub actions: Vec<&'static str>,
    /// Every action the kind takes, in any state.
    pub kind_actions: Vec<&'static str>,
    pub actions_enabled: bool,
    /// The job row, column by column.
    pub job: Value,
    /// Its outbox rows: one per delivery revision, with dispatch attempts and errors.
    pub deliveries: Vec<Value>,
    /// Kind-specific history (progress events, other attempts, items, retries, effects).
    pub history: Vec<Section>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Section {
    pub title: &'static str,
    pub rows: Vec<Value>,
}

/// Reads one job; `None` when there is no such job of that kind.
pub async fn job_detail(
    st: &AppState,
    kind: Kind,
    id: Uuid,
) -> Result<Option<JobDetail>, sqlx::Error> {
    let spec = kind.spec();
    let mut conn = crate::db::acquire(&st.pool).await?;
    let Some(job): Option<Value> =
        sqlx::query_scalar(&spec.sql("SELECT to_jsonb(j) FROM {job} j WHERE j.id = $1"))
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?
    else {
        return Ok(None);
    };
    let deliveries: Value = sqlx::query_scalar(&spec.sql(
        "SELECT coalesce(jsonb_agg(to_jsonb(o) - 'payload' - 'lock_token' ORDER BY o.created_at, o.id), '[]'::jsonb) \
         FROM {outbox} o WHERE o.{fk} = $1",
    ))
    .bind(id)
    .fetch_one(&mut *conn)
    .await?;
    let mut history = Vec::new();
    for (title, q) in history_queries(kind) {
        let rows: Value = sqlx::query_scalar(&format!(
            "SELECT coalesce(jsonb_agg(to_jsonb(x)), '[]'::jsonb) FROM ({q}) x"
        ))
        .bind(id)
        .fetch_one(&mut *conn)
        .await?;
        history.push(Section {
            title,
            rows: rows.as_array().cloned().unwrap_or_default(),
        });
    }
    let text = |k: &str| {
        job.get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let state = text(state_column(spec));
    Ok(Some(JobDetail {
        kind: kind.name().to_owned(),
        id,
        checkpoint: text(spec.checkpoint_column()),
        checkpoints: checkpoint_order(kind).to_vec(),
        actions: job_actions(kind, &state),
        kind_actions: kind_actions(kind),
        actions_enabled: st.admin_token.is_some(),
        state,
        job,
        deliveries: deliveries.as_array().cloned().unwrap_or_default(),
        history,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_come_from_columns_or_a_code_message_text() {
        let e = |v: Value| error_of(&v);
        assert_eq!(
            e(
                serde_json::json!({"code": "hash_mismatch", "message": "bytes differ", "error": null})
            ),
            (Some("hash_mismatch".into()), Some("bytes differ".into()))
        );
        assert_eq!(
            e(
                serde_json::json!({"code": null, "message": null, "error": "budget_exceeded: spent 2.1"})
            ),
            (Some("budget_exceeded".into()), Some("spent 2.1".into()))
        );
        assert_eq!(
            e(serde_json::json!({"error": "something went wrong: badly"})),
            (None, Some("something went wrong: badly".into()))
        );
        assert_eq!(e(serde_json::json!({})), (None, None));
    }
}
