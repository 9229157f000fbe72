//! What operators see of research tasks and do to them (see [`crate::jobs::operate`]).
//! Invariant: `pause`, `resume` and `cancel` write only through [`super::control`], the CLI's
//! functions (`pause` is the CLI's `pause_with` without a reason).

use futures_util::future::BoxFuture;
use sqlx::PgConnection;
use uuid::Uuid;

use super::control::{self, ControlError, Controlled};
use crate::jobs::operate::{Action, ActionArgs, ActionError, Input, Operations};

fn live(state: &str) -> bool {
    !matches!(state, "completed" | "failed" | "canceled")
}

pub static OPERATIONS: Operations = Operations {
    checkpoints: &[
        "queued",
        "planning",
        "retrieving",
        "analyzing",
        "generating",
        "completed",
    ],
    history: &[
        (
            "Progress events",
            "SELECT sequence, event_type, stage, payload, created_at \
             FROM research_task_progress_events WHERE research_task_job_id = $1 ORDER BY sequence",
        ),
        (
            "Partial results",
            "SELECT sequence, created_at, pg_column_size(evidence_bundle) AS bytes \
             FROM research_task_partial_results WHERE research_task_job_id = $1 ORDER BY sequence",
        ),
    ],
    actions: &[
        Action {
            name: "pause",
            applies: |state| live(state) && state != "paused",
            inputs: &[],
            run: pause,
        },
        Action {
            name: "resume",
            applies: |state| state == "paused",
            inputs: &[],
            run: resume,
        },
        Action {
            name: "cancel",
            applies: live,
            inputs: &[Input::Text {
                label: "reason",
                name: "reason",
                size: None,
                prefill: None,
                placeholder: Some("optional"),
            }],
            run: cancel,
        },
    ],
    failure_list_action: None,
};

fn pause<'a>(
    conn: &'a mut PgConnection,
    id: Uuid,
    _args: &'a ActionArgs,
) -> BoxFuture<'a, Result<String, ActionError>> {
    Box::pin(async move { said(id, "pause", control::pause(conn, id).await) })
}

fn resume<'a>(
    conn: &'a mut PgConnection,
    id: Uuid,
    _args: &'a ActionArgs,
) -> BoxFuture<'a, Result<String, ActionError>> {
    Box::pin(async move { said(id, "resume", control::resume(conn, id).await) })
}

fn cancel<'a>(
    conn: &'a mut PgConnection,
    id: Uuid,
    args: &'a ActionArgs,
) -> BoxFuture<'a, Result<String, ActionError>> {
    Box::pin(async move {
        said(
            id,
            "cancel",
            control::cancel(conn, id, args.reason.as_deref()).await,
        )
    })
}

fn said(
    id: Uuid,
    action: &str,
    r: Result<Controlled, ControlError>,
) -> Result<String, ActionError> {
    let r = r.map_err(|e| {
        if matches!(e, ControlError::NotFound(_)) {
            ActionError::NotFound(e.to_string())
        } else if e.is_refusal() {
            ActionError::Refused(e.to_string())
        } else {
            ActionError::Failed(e.to_string())
        }
    })?;
    Ok(if r.changed {
        format!(
            "research task {id}: {action} done ({} → {})",
            r.from.as_str(),
            r.to.as_str()
        )
    } else {
        format!(
            "research task {id} already was {}; nothing changed",
            r.to.as_str()
        )
    })
}
