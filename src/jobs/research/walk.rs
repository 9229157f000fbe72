//! The research walk as pure functions. Invariant: a step only ever moves a job one stage
//! forward along `queued → planning → retrieving → analyzing → generating → completed` (or ends
//! it: failed, or canceled by a budget or a deletion fence); pause, resume and cancel are the
//! only other moves, a terminal stage never changes again, and every move is decided here, never
//! in SQL, so that the table tests below cover all of them.

use std::fmt;

/// The `stage` column: both the job's state and its checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    Queued,
    Planning,
    Retrieving,
    Analyzing,
    Generating,
    Paused,
    Completed,
    Failed,
    Canceled,
}

impl Stage {
    pub const ALL: [Stage; 9] = [
        Stage::Queued,
        Stage::Planning,
        Stage::Retrieving,
        Stage::Analyzing,
        Stage::Generating,
        Stage::Paused,
        Stage::Completed,
        Stage::Failed,
        Stage::Canceled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Queued => "queued",
            Stage::Planning => "planning",
            Stage::Retrieving => "retrieving",
            Stage::Analyzing => "analyzing",
            Stage::Generating => "generating",
            Stage::Paused => "paused",
            Stage::Completed => "completed",
            Stage::Failed => "failed",
            Stage::Canceled => "canceled",
        }
    }

    pub fn parse(s: &str) -> Option<Stage> {
        Stage::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// `completed`, `failed` or `canceled`: nothing changes the job any more.
    pub fn is_terminal(self) -> bool {
        matches!(self, Stage::Completed | Stage::Failed | Stage::Canceled)
    }

    /// A stage a worker runs (the walk before `completed`).
    pub fn is_runnable(self) -> bool {
        matches!(
            self,
            Stage::Queued
                | Stage::Planning
                | Stage::Retrieving
                | Stage::Analyzing
                | Stage::Generating
        )
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where one step at `stage` leads. `None`: a worker has nothing to do at this stage.
pub fn next_stage(stage: Stage) -> Option<Stage> {
    match stage {
        Stage::Queued => Some(Stage::Planning),
        Stage::Planning => Some(Stage::Retrieving),
        Stage::Retrieving => Some(Stage::Analyzing),
        Stage::Analyzing => Some(Stage::Generating),
        Stage::Generating => Some(Stage::Completed),
        Stage::Paused | Stage::Completed | Stage::Failed | Stage::Canceled => None,
    }
}

/// An operator's control request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Pause,
    Resume,
    Cancel,
}

impl Control {
    pub fn name(self) -> &'static str {
        match self {
            Control::Pause => "pause",
            Control::Resume => "resume",
            Control::Cancel => "cancel",
        }
    }
}

/// What a control request does to a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ControlMove {
    /// Write this transition: the new stage, and `paused_from_stage` afterwards.
    Apply {
        to: Stage,
        paused_from: Option<Stage>,
    },
    /// The job is already where the request wants it (a repeated request): change nothing.
    AlreadyDone,
}

/// Why a control request is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the task already ended ({0}); it can no longer be {1}")]
    Terminal(Stage, &'static str),
    #[error("the task is paused at {0}, which is not a stage to resume; cancel it instead")]
    NothingToResume(Stage),
}

/// Decides a control request from the job's stage and `paused_from_stage`. A paused job that
/// records no stage resumes at `queued`, as the platform's resume does.
pub fn control(
    stage: Stage,
    paused_from: Option<Stage>,
    action: Control,
) -> Result<ControlMove, Refusal> {
    match (action, stage) {
        (Control::Cancel, Stage::Canceled) => Ok(ControlMove::AlreadyDone),
        (Control::Cancel, s) if s.is_terminal() => Err(Refusal::Terminal(s, "canceled")),
        (Control::Cancel, _) => Ok(ControlMove::Apply {
            to: Stage::Canceled,
            paused_from: None,
        }),
        (Control::Pause, Stage::Paused) => Ok(ControlMove::AlreadyDone),
        (Control::Pause, s) if s.is_terminal() => Err(Refusal::Terminal(s, "paused")),
        (Control::Pause, s) => Ok(ControlMove::Apply {
            to: Stage::Paused,
            paused_from: Some(s),
        }),
        (Control::Resume, Stage::Paused) => match paused_from.unwrap_or(Stage::Queued) {
            from if from.is_runnable() => Ok(ControlMove::Apply {
                to: from,
                paused_from: None,
            }),
            other => Err(Refusal::NothingToResume(other)),
        },
        (Control::Resume, s) if s.is_terminal() => Err(Refusal::Terminal(s, "resumed")),
        (Control::Resume, _) => Ok(ControlMove::AlreadyDone),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_round_trip() {
        for s in Stage::ALL {
            assert_eq!(Stage::parse(s.as_str()), Some(s));
        }
        assert_eq!(Stage::parse("running"), None);
    }

    #[test]
    fn the_walk_table() {
        use Stage::*;
        let table = [
            (Queued, Some(Planning)),
            (Planning, Some(Retrieving)),
            (Retrieving, Some(Analyzing)),
            (Analyzing, Some(Generating)),
            (Generating, Some(Completed)),
            (Paused, None),
            (Completed, None),
            (Failed, None),
            (Canceled, None),
        ];
        for (from, to) in table {
            assert_eq!(next_stage(from), to, "from {from}");
        }
        // Following the walk from queued visits every runnable stage once and ends completed.
        let mut s = Queued;
        let mut seen = vec![s];
        while let Some(n) = next_stage(s) {
            seen.push(n);
            s = n;
        }
        assert_eq!(
            seen,
            vec![Queued, Planning, Retrieving, Analyzing, Generating, Completed]
        );
    }

    #[test]
    fn the_control_table() {
        use Control::*;
        use Stage::*;
        let apply = |to, paused_from| Ok(ControlMove::Apply { to, paused_from });
        let done = Ok(ControlMove::AlreadyDone);
        type Row = (Stage, Option<Stage>, Control, Result<ControlMove, Refusal>);
        let table: Vec<Row> = vec![
            (Queued, None, Pause, apply(Paused, Some(Queued))),
            (Planning, None, Pause, apply(Paused, Some(Planning))),
            (Retrieving, None, Pause, apply(Paused, Some(Retrieving))),
            (Analyzing, None, Pause, apply(Paused, Some(Analyzing))),
            (Generating, None, Pause, apply(Paused, Some(Generating))),
            (Paused, Some(Planning), Pause, done.clone()),
            (
                Completed,
                None,
                Pause,
                Err(Refusal::Terminal(Completed, "paused")),
            ),
            (
                Failed,
                None,
                Pause,
                Err(Refusal::Terminal(Failed, "paused")),
            ),
            (
                Canceled,
                None,
                Pause,
                Err(Refusal::Terminal(Canceled, "paused")),
            ),
            (Paused, Some(Retrieving), Resume, apply(Retrieving, None)),
            (Paused, Some(Queued), Resume, apply(Queued, None)),
            (Paused, None, Resume, apply(Queued, None)),
            (
                Paused,
                Some(Completed),
                Resume,
                Err(Refusal::NothingToResume(Completed)),
            ),
            (Analyzing, None, Resume, done.clone()),
            (
                Completed,
                None,
                Resume,
                Err(Refusal::Terminal(Completed, "resumed")),
            ),
            (Queued, None, Cancel, apply(Canceled, None)),
            (Generating, None, Cancel, apply(Canceled, None)),
            (Paused, Some(Analyzing), Cancel, apply(Canceled, None)),
            (Canceled, None, Cancel, done.clone()),
            (
                Completed,
                None,
                Cancel,
                Err(Refusal::Terminal(Completed, "canceled")),
            ),
            (
                Failed,
                None,
                Cancel,
                Err(Refusal::Terminal(Failed, "canceled")),
            ),
        ];
        for (stage, from, action, want) in table {
            assert_eq!(
                control(stage, from, action),
                want,
                "{} at {stage} (paused from {from:?})",
                action.name()
            );
        }
    }
}
