//! The operator actions: a kind's job actions (as its registration lists them, see
//! [`crate::jobs::operate`]) and requeueing a dead letter. Invariant: every action is refused
//! without the admin token: each action path takes an [`Authorized`], which only [`authorize`]
//! makes, after comparing the token in constant time ([`crate::config::AdminToken::matches`]).
//! Every write is done by the library function the CLI calls (the kind's action function, or
//! `dlq::requeue`), each job action in its own transaction.

use axum::http::StatusCode;
use uuid::Uuid;

use super::gate::{ActError, ActionForm, Authorized, Outcome};
use super::kinds::{self, kind_actions};
use super::AppState;
use crate::jobs::Kind;

/// Runs `action` on the job `id` of `kind` and says how it went; `back` is the page to return to.
pub(super) async fn job_action(
    auth: &Authorized,
    st: &AppState,
    kind: Kind,
    id: Uuid,
    action: &str,
    form: &ActionForm,
    back: String,
) -> Outcome {
    let outcome = act(auth, st, kind, id, action, form).await;
    let (code, message) = match outcome {
        Ok(m) => (StatusCode::OK, m),
        Err(e) => e,
    };
    if code.is_success() {
        tracing::info!(kind = %kind, job = %id, action = %action, "dashboard action done");
    }
    Outcome::new(code, message, back)
}

fn failed(e: impl std::fmt::Display) -> ActError {
    (StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

/// Runs one action through the library function the CLI uses, in its own transaction.
async fn act(
    auth: &Authorized,
    st: &AppState,
    kind: Kind,
    id: Uuid,
    action: &str,
    form: &ActionForm,
) -> Result<String, ActError> {
    if !kind_actions(kind).contains(&action) {
        let allowed = kind_actions(kind);
        return Err((
            StatusCode::BAD_REQUEST,
            if allowed.is_empty() {
                format!("{kind} jobs take no action")
            } else {
                format!(
                    "{kind} jobs take no action '{action}'; they take {}",
                    allowed.join(", ")
                )
            },
        ));
    }
    let mut tx = crate::db::begin(&st.pool).await.map_err(failed)?;
    let message = kinds::run_action(auth, &mut tx, kind, id, action, form).await?;
    tx.commit().await.map_err(failed)?;
    Ok(message)
}

/// Requeues the dead letter `id` to its kind's queue, by [`crate::dlq::requeue`].
pub(super) async fn requeue_dead_letter(_auth: &Authorized, st: &AppState, id: &str) -> Outcome {
    let conn = match crate::broker::connect(
        &st.services.amqp_url,
        "kfs-worker dashboard",
        st.services.connect_timeout,
    )
    .await
    {
        Ok(c) => c,
        Err(e) => return Outcome::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string(), "/"),
    };
    let result = crate::dlq::requeue(&conn, &st.topology, id).await;
    let _ = conn.close(200, "dashboard".into()).await;
    match result {
        Ok(r) => {
            tracing::info!(id = %r.id, kind = %r.kind, "dashboard requeued a dead letter");
            Outcome::new(
                StatusCode::OK,
                format!(
                    "requeued {} to its {} queue (exchange {}, routing key {})",
                    r.id, r.kind, r.exchange, r.routing_key
                ),
                "/#dead-letters",
            )
        }
        Err(e @ crate::dlq::DlqError::NotFound(_)) => {
            Outcome::new(StatusCode::NOT_FOUND, e.to_string(), "/#dead-letters")
        }
        Err(e) if e.is_refusal() => {
            Outcome::new(StatusCode::CONFLICT, e.to_string(), "/#dead-letters")
        }
        Err(e) => Outcome::new(StatusCode::BAD_GATEWAY, e.to_string(), "/#dead-letters"),
    }
}
