//! Following a task's progress. Invariant: events are reported in sequence order, each once, and
//! only after they committed; because sequences are assigned under the job row's lock, polling
//! "after the last sequence seen" never skips one. Following ends once the job is terminal and
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
    let s = |k: &str| p.get(k).and_then(|v| v.as_str()).unwrap_or("?").to_owned();
    let detail = match short {
        "started" => format!("“{}”", s("query")),
        "stage_changed" => {
            let mut d = format!("{} → {}", s("from"), s("to"));
            let extra: Vec<String> = ["subQueries", "hits", "evidence", "documents", "citations"]
                .iter()
                .filter_map(|k| p.get(*k).map(|v| format!("{k}={v}")))
                .collect();
            if !extra.is_empty() {
                d.push_str(&format!(" ({})", extra.join(", ")));
            }
            d
        }
        "paused" => format!("paused at {}", s("from")),
        "resumed" => format!("resumed at {}", s("to")),
        "canceled" => format!("{}: {}", s("code"), s("reason")),
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
            payload: json!({ "from": "planning", "to": "retrieving", "subQueries": 2 }),
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
            pretty.contains("planning → retrieving (subQueries=2)"),
            "{pretty}"
        );
        assert!(!pretty.contains('\n'));
    }
}
