//! The dashboard's view of the kinds: each kind's checkpoints, history queries and actions come
//! from its registration ([`crate::jobs::registry`], [`crate::jobs::operate::Operations`]).
//! Invariant: nothing in the dashboard matches on a [`Kind`] or a kind's name; a new kind shows
//! up, with its actions, by its registration alone, and every action runs the kind's own
//! function (the CLI's) only after [`Authorized`] proved the admin token.

use axum::http::StatusCode;
use sqlx::PgConnection;
use uuid::Uuid;

use super::gate::{field, ActError, ActionForm, Authorized};
use crate::jobs::operate::{ActionArgs, ActionError, Input};
use crate::jobs::Kind;

/// The actions a kind's jobs take.
pub fn kind_actions(kind: Kind) -> Vec<&'static str> {
    kind.entry().ops.action_names()
}

/// The actions that apply to a job of `kind` in `state`.
pub fn job_actions(kind: Kind, state: &str) -> Vec<&'static str> {
    kind.entry().ops.actions_in(state)
}

/// The checkpoints a kind walks through, in order, for the progress strip of a job page.
pub fn checkpoint_order(kind: Kind) -> &'static [&'static str] {
    kind.entry().ops.checkpoints
}

/// Kind-specific history queries: each takes the job id as `$1`. Each is a `SELECT`; the job
/// page runs them (see `queries::job_detail`).
pub(super) fn history_queries(kind: Kind) -> Vec<(&'static str, &'static str)> {
    kind.entry().ops.history.to_vec()
}

/// Runs `action` on the job `id` of `kind` in `conn` (the action's transaction), by the kind's
/// own action function. `action` is one of [`kind_actions`]`(kind)`: `actions::act` checks.
pub(super) async fn run_action(
    _auth: &Authorized,
    conn: &mut PgConnection,
    kind: Kind,
    id: Uuid,
    action: &str,
    form: &ActionForm,
) -> Result<String, ActError> {
    let Some(a) = kind.entry().ops.action(action) else {
        unreachable!("act checks the action against kind_actions first")
    };
    let args = ActionArgs {
        subject: field(&form.subject).map(str::to_owned),
        snapshot: field(&form.snapshot).map(str::to_owned),
        channel: field(&form.channel).map(str::to_owned),
        owner_rescue: field(&form.owner_rescue).is_some(),
        reason: field(&form.reason).map(str::to_owned),
    };
    (a.run)(conn, id, &args).await.map_err(|e| {
        let code = match e {
            ActionError::NotFound(_) => StatusCode::NOT_FOUND,
            ActionError::BadInput(_) => StatusCode::BAD_REQUEST,
            ActionError::Refused(_) => StatusCode::CONFLICT,
            ActionError::Failed(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        (code, e.to_string())
    })
}

/// The inputs of `action`'s form on the page of a job of the kind named `kind`.
pub(super) fn action_inputs(kind: &str, action: &str) -> &'static [Input] {
    Kind::named(kind)
        .and_then(|k| k.entry().ops.action(action))
        .map_or(&[], |a| a.inputs)
}

/// The action the failures list of the overview offers as a button of its own, for a job of
/// the kind named `kind` that takes it; the actions of other kinds are on the job page.
pub(super) fn failure_list_action(kind: &str) -> Option<&'static str> {
    Kind::named(kind)?.entry().ops.failure_list_action
}
