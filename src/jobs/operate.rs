//! What operators see of a kind's jobs and what they may do to them, as data each kind
//! registers ([`Operations`]): the checkpoints it walks through, its history queries, and its
//! actions with the states they apply to, the inputs their forms carry and the library
//! function that does each. Invariant: every action writes through the same library function
//! as the CLI, in the caller's transaction, and never checks who asks (the dashboard does that
//! before it calls); every history query is a `SELECT` that takes the job id as `$1`.

use futures_util::future::BoxFuture;
use sqlx::PgConnection;
use uuid::Uuid;

/// A kind's operator surface.
#[derive(Debug)]
pub struct Operations {
    /// The checkpoints a job walks through, in order, for the progress strip of its page.
    pub checkpoints: &'static [&'static str],
    /// `(title, SELECT … WHERE … = $1)`: the job's history beyond its own row.
    pub history: &'static [(&'static str, &'static str)],
    pub actions: &'static [Action],
    /// The action the overview's failures list offers as a button of its own.
    pub failure_list_action: Option<&'static str>,
}

impl Operations {
    /// Nothing to show beyond the job row, nothing to do.
    pub const NONE: Operations = Operations {
        checkpoints: &[],
        history: &[],
        actions: &[],
        failure_list_action: None,
    };

    /// The names of every action the kind takes.
    pub fn action_names(&self) -> Vec<&'static str> {
        self.actions.iter().map(|a| a.name).collect()
    }

    /// The actions that apply to a job in `state`.
    pub fn actions_in(&self, state: &str) -> Vec<&'static str> {
        self.actions
            .iter()
            .filter(|a| (a.applies)(state))
            .map(|a| a.name)
            .collect()
    }

    pub fn action(&self, name: &str) -> Option<&'static Action> {
        self.actions.iter().find(|a| a.name == name)
    }
}

/// One operator action on a job.
pub struct Action {
    pub name: &'static str,
    /// Whether it applies to a job in this state.
    pub applies: fn(&str) -> bool,
    /// The inputs its form carries besides the admin token.
    pub inputs: &'static [Input],
    pub run: ActionFn,
}

impl std::fmt::Debug for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Action").field("name", &self.name).finish()
    }
}

/// Runs an action on the job with this id, in the caller's transaction; says what was done.
pub type ActionFn = for<'a> fn(
    &'a mut PgConnection,
    Uuid,
    &'a ActionArgs,
) -> BoxFuture<'a, Result<String, ActionError>>;

/// What an action's form sent, each field trimmed and `None` when blank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ActionArgs {
    /// Deletion retry: the acting subject, its permission snapshot, its channel.
    pub subject: Option<String>,
    pub snapshot: Option<String>,
    pub channel: Option<String>,
    /// Deletion retry: an owner rescue rather than the original requester.
    pub owner_rescue: bool,
    /// Research cancel: the reason recorded.
    pub reason: Option<String>,
}

/// Why an action did nothing.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ActionError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    BadInput(String),
    /// The job's state does not allow it; nothing changed.
    #[error("{0}")]
    Refused(String),
    /// The database failed.
    #[error("{0}")]
    Failed(String),
}

/// An input an action's form carries besides the admin token; its `name` is a field of
/// [`ActionArgs`].
#[derive(Debug)]
pub enum Input {
    /// A text box: `size` characters wide, prefilled from the job row's column `prefill`
    /// (empty when the column is missing), or showing `placeholder`.
    Text {
        label: &'static str,
        name: &'static str,
        size: Option<u32>,
        prefill: Option<&'static str>,
        placeholder: Option<&'static str>,
    },
    /// A checkbox that sends `1` when ticked.
    Checkbox {
        label: &'static str,
        name: &'static str,
    },
}

#[cfg(test)]
mod tests {
    use crate::jobs::Kind;

    #[test]
    fn actions_follow_kind_and_state() {
        let table: [(Kind, &str, &[&str]); 9] = [
            (Kind::Compile, "failed", &["retry"]),
            (Kind::Compile, "running", &[]),
            (Kind::Deletion, "failed", &["retry"]),
            (Kind::Deletion, "succeeded", &[]),
            (Kind::Research, "retrieving", &["pause", "cancel"]),
            (Kind::Research, "paused", &["resume", "cancel"]),
            (Kind::Research, "completed", &[]),
            (Kind::Research, "canceled", &[]),
            (Kind::Probe, "failed", &[]),
        ];
        for (kind, state, want) in table {
            assert_eq!(kind.entry().ops.actions_in(state), want, "{kind} {state}");
            for a in kind.entry().ops.actions_in(state) {
                assert!(kind.entry().ops.action_names().contains(&a), "{kind} {a}");
            }
        }
    }
}
