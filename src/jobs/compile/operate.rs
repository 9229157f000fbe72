//! What operators see of compile attempts and do to them (see [`crate::jobs::operate`]).
//! Invariant: `retry` writes only through [`super::request::retry`], the CLI's function.

use futures_util::future::BoxFuture;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::jobs::operate::{Action, ActionArgs, ActionError, Operations};

pub static OPERATIONS: Operations = Operations {
    checkpoints: &[
        "queued",
        "parsed",
        "outline_built",
        "nodes_generated",
        "projection_built",
        "smoke_eval_passed",
        "published",
    ],
    history: &[(
        "Attempts of this document",
        "SELECT a.id, a.document_version, a.checkpoint, a.run_state, a.execution_attempts, \
           a.last_error_code, a.created_at, a.completed_at \
         FROM document_compilation_attempts a \
         JOIN document_compilation_attempts me ON me.id = $1 \
           AND a.tenant_id = me.tenant_id AND a.document_asset_id = me.document_asset_id \
         ORDER BY a.created_at",
    )],
    actions: &[Action {
        name: "retry",
        applies: |state| state == "failed",
        inputs: &[],
        run: retry,
    }],
    failure_list_action: Some("retry"),
};

/// `retry`: the attempt runs again from its checkpoint.
fn retry<'a>(
    conn: &'a mut PgConnection,
    id: Uuid,
    _args: &'a ActionArgs,
) -> BoxFuture<'a, Result<String, ActionError>> {
    Box::pin(async move {
        super::request::retry(conn, id).await.map_err(|e| {
            if e.is_refusal() {
                ActionError::Refused(e.to_string())
            } else {
                ActionError::Failed(e.to_string())
            }
        })?;
        Ok(format!(
            "compile attempt {id} is retrying from its checkpoint"
        ))
    })
}
