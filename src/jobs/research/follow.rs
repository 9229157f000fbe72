//! Following a task's progress. Invariant: events are reported in sequence order, each once, and
//! only after they committed (a streamed answer's deltas as each commits, before the task ends);
//! because sequences are assigned by one writer of the job at a time (see [`super::progress`]),
//! polling "after the last sequence seen" never skips one. Following ends once the job is terminal and
//! every event committed up to then was reported.

use std::io::IsTerminal;
use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

use super::progress::{self, ProgressEvent};
use super::walk::Stage;

/// How a followed task ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ended {
    pub stage: Stage,
    pub error: Option<String>,
    /// The last sequence reported.
    pub last_sequence: i32,
}

#[derive(Debug, thiserror::Error)]
pub enum FollowError {
    #[error("no research task {0}")]
    NotFound(Uuid),
    #[error("research task {0} has an unknown stage '{1}'")]
    Corrupt(Uuid, String),
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
}

/// Calls `on_event` for every progress event of the job, as they commit, polling every `poll`,
/// until the job reaches a terminal stage.
pub async fn follow(
    pool: &PgPool,
    job_id: Uuid,
    poll: Duration,
    mut on_event: impl FnMut(&ProgressEvent),
) -> Result<Ended, FollowError> {
    let mut conn = pool.acquire().await?;
    let scope = progress::scope_of(&mut conn, job_id)
        .await?
        .ok_or(FollowError::NotFound(job_id))?;
    drop(conn);
    let mut last = 0;
    loop {
        let mut conn = pool.acquire().await?;
        // The stage first: every event of the transition that made it terminal committed with it.
        let (stage_s, error): (String, Option<String>) = sqlx::query_as(
            "SELECT stage, error FROM research_task_jobs WHERE tenant_id = $1 AND id = $2",
        )
        .bind(&scope.tenant_id)
        .bind(job_id)
        .fetch_optional(&mut *conn)
        .await?
        .ok_or(FollowError::NotFound(job_id))?;
        let stage = Stage::parse(&stage_s).ok_or(FollowError::Corrupt(job_id, stage_s))?;
        for e in progress::events_after(&mut conn, &scope, last).await? {
            last = e.sequence;
            on_event(&e);
        }
        drop(conn);
        if stage.is_terminal() {
            return Ok(Ended {
                stage,
                error,
                last_sequence: last,
            });
        }
        tokio::time::sleep(poll).await;
    }
}

/// Whether stdout is a terminal (then lines are formatted for people).
pub fn stdout_is_terminal() -> bool {
    std::io::stdout().is_terminal()
}

/// One line per event. Plain: `sequence<TAB>created_at_ms<TAB>event_type<TAB>stage<TAB>payload`,
/// stable for scripts. Pretty: a short human summary.
pub fn format_event(e: &ProgressEvent, pretty: bool) -> String {
    if !pretty {
        return format!(
            "{}\t{}\t{}\t{}\t{}",
            e.sequence, e.created_at, e.event_type, e.stage, e.payload
        );
    }
    let time = chrono::DateTime::from_timestamp_millis(e.created_at).map_or_else(
        || e.created_at.to_string(),
        |t| t.format("%H:%M:%S%.3f").to_string(),
    );
    let short = e.event_type.trim_start_matches("research_task.");
    let p = &e.payload;
    let s = |k: &str| p.get(k).and_then(|v| v.as_str()).map(str::to_owned);
    let detail = match short {
        "started" => "requested".to_owned(),
        "stage_changed" if p.get("workerClaimed").is_some() => format!(
            "claimed at {} (attempt {})",
            e.stage,
            p.get("executionAttempt")
                .unwrap_or(&serde_json::Value::Null)
        ),
        "stage_changed" if p.get("retryScheduled").is_some() => format!(
            "retry at {}: {}",
            p.get("retryAt")
                .and_then(serde_json::Value::as_i64)
                .and_then(chrono::DateTime::from_timestamp_millis)
                .map_or_else(|| "?".into(), |t| t.format("%H:%M:%S%.3f").to_string()),
            s("error").unwrap_or_default()
        ),
        "stage_changed" => {
            let mut d = format!(
                "{} → {}",
                s("previousStage").unwrap_or_else(|| "?".into()),
                e.stage
            );
            let details = p.get("details");
            let n = |k: &str| details.and_then(|d| d.get(k)).map(|v| format!("{k}={v}"));
            let mut extra: Vec<String> = ["chunks", "documents", "retrievalCount", "topK"]
                .iter()
                .filter_map(|k| n(k))
                .collect();
            if let Some(q) = details
                .and_then(|d| d.get("questions"))
                .and_then(|q| q.as_array())
            {
                extra.insert(0, format!("questions={}", q.len()));
            }
            if !extra.is_empty() {
                d.push_str(&format!(" ({})", extra.join(", ")));
            }
            d
        }
        "paused" | "canceled" => s("reason").unwrap_or_else(|| short.to_owned()),
        "resumed" => format!("resumed at {}", e.stage),
        "failed" => s("error").unwrap_or_else(|| "failed".into()),
        "answer_delta" => format!(
            "+{:?} (attempt {}, at {})",
            s("delta").unwrap_or_default(),
            p.get("executionAttempt")
                .unwrap_or(&serde_json::Value::Null),
            p.get("offset").unwrap_or(&serde_json::Value::Null)
        ),
        _ => p.to_string(),
    };
    format!("#{:<3} {time}  {short:<13} {detail}", e.sequence)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn lines() {
        let e = ProgressEvent {
            sequence: 3,
            event_type: "research_task.stage_changed".into(),
            stage: "retrieving".into(),
            payload: json!({ "details": {"questions": ["a", "b"], "topK": 10}, "previousStage": "planning" }),
            created_at: 0,
        };
        let plain = format_event(&e, false);
        let fields: Vec<&str> = plain.split('\t').collect();
        assert_eq!(
            fields[..4],
            ["3", "0", "research_task.stage_changed", "retrieving"]
        );
        let payload: serde_json::Value = serde_json::from_str(fields[4]).unwrap();
        assert_eq!(payload, e.payload);
        let pretty = format_event(&e, true);
        assert!(
            pretty.contains("planning → retrieving (questions=2, topK=10)"),
            "{pretty}"
        );
        assert!(!pretty.contains('\n'));
        let claimed = ProgressEvent {
            event_type: "research_task.stage_changed".into(),
            payload: json!({ "executionAttempt": 2, "workerClaimed": true }),
            ..e.clone()
        };
        assert!(format_event(&claimed, true).contains("claimed at retrieving (attempt 2)"));
        let failed = ProgressEvent {
            event_type: "research_task.failed".into(),
            stage: "failed".into(),
            payload: json!({ "error": "RESEARCH_TASK_PERMISSION_SNAPSHOT_INVALID" }),
            ..e.clone()
        };
        assert!(format_event(&failed, true).contains("RESEARCH_TASK_PERMISSION_SNAPSHOT_INVALID"));
        let delta = ProgressEvent {
            event_type: "research_task.answer_delta".into(),
            stage: "generating".into(),
            payload: json!({ "delta": "Fencing \"uses\"\nthe token", "executionAttempt": 1, "offset": 0 }),
            ..e
        };
        let line = format_event(&delta, true);
        assert!(
            line.contains(r#"+"Fencing \"uses\"\nthe token" (attempt 1, at 0)"#),
            "{line}"
        );
        assert!(!line.contains('\n'));
    }
}
