//! The token gate of the operator actions, below both the actions and the kinds' view that run
//! them. Invariant: an [`Authorized`] is made only by [`authorize`], after the admin token was
//! compared in constant time ([`crate::config::AdminToken::matches`]), so every action path that
//! takes one ran behind the gate.

use axum::http::{HeaderMap, StatusCode};
use serde::Deserialize;

use super::AppState;

/// Proof that a request carried the admin token: made only by [`authorize`].
pub(super) struct Authorized(());

/// The fields an action form may carry.
#[derive(Debug, Default, Deserialize)]
pub struct ActionForm {
    pub token: Option<String>,
    /// Deletion retry: the acting subject, its permission snapshot, its channel, and whether
    /// it is an owner rescue.
    pub subject: Option<String>,
    pub snapshot: Option<String>,
    pub channel: Option<String>,
    pub owner_rescue: Option<String>,
    /// Research cancel: the reason recorded.
    pub reason: Option<String>,
    /// DLQ requeue: the message id.
    pub id: Option<String>,
}

/// The outcome of an action: its status, what to tell the operator, and where to go back to.
pub(super) struct Outcome {
    pub(super) code: StatusCode,
    pub(super) message: String,
    pub(super) back: String,
}

impl Outcome {
    pub(super) fn new(
        code: StatusCode,
        message: impl Into<String>,
        back: impl Into<String>,
    ) -> Self {
        Self {
            code,
            message: message.into(),
            back: back.into(),
        }
    }
}

/// The token gate: [`Authorized`] when the request may act, else the refusal.
pub(super) fn authorize(
    st: &AppState,
    headers: &HeaderMap,
    form: &ActionForm,
    back: &str,
) -> Result<Authorized, Outcome> {
    let Some(expected) = &st.admin_token else {
        return Err(Outcome::new(
            StatusCode::FORBIDDEN,
            "actions are disabled on this worker: it was started without KFS_ADMIN_TOKEN",
            back,
        ));
    };
    let bearer = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let given = bearer
        .or(form.token.as_deref())
        .map(str::trim)
        .filter(|t| !t.is_empty());
    match given {
        None => Err(Outcome::new(
            StatusCode::UNAUTHORIZED,
            "this action needs the admin token (KFS_ADMIN_TOKEN): enter it at the top of the page",
            back,
        )),
        Some(t) if !expected.matches(t) => Err(Outcome::new(
            StatusCode::FORBIDDEN,
            "the admin token is wrong; nothing was changed",
            back,
        )),
        Some(_) => Ok(Authorized(())),
    }
}

/// A form field, trimmed; `None` when missing or blank.
pub(super) fn field(v: &Option<String>) -> Option<&str> {
    v.as_deref().map(str::trim).filter(|s| !s.is_empty())
}

pub(super) type ActError = (StatusCode, String);
