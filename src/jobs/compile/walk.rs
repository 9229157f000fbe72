//! The compile walk as pure functions, with no I/O. Invariant: the checkpoints form one chain,
//! `queued → parsed → outline_built → nodes_generated → projection_built → smoke_eval_passed →
//! published`, every step advances exactly one link (the last one succeeds the attempt), and
//! whether an attempt may go on at all (document still active, no newer version, no later
//! attempt already serving this version) is decided here from plain facts read by the I/O layer.

use std::fmt;

/// A checkpoint of `document_compilation_attempts.checkpoint`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Checkpoint {
    Queued,
    Parsed,
    OutlineBuilt,
    NodesGenerated,
    ProjectionBuilt,
    SmokeEvalPassed,
    Published,
}

impl Checkpoint {
    pub const ALL: [Checkpoint; 7] = [
        Checkpoint::Queued,
        Checkpoint::Parsed,
        Checkpoint::OutlineBuilt,
        Checkpoint::NodesGenerated,
        Checkpoint::ProjectionBuilt,
        Checkpoint::SmokeEvalPassed,
        Checkpoint::Published,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Checkpoint::Queued => "queued",
            Checkpoint::Parsed => "parsed",
            Checkpoint::OutlineBuilt => "outline_built",
            Checkpoint::NodesGenerated => "nodes_generated",
            Checkpoint::ProjectionBuilt => "projection_built",
            Checkpoint::SmokeEvalPassed => "smoke_eval_passed",
            Checkpoint::Published => "published",
        }
    }

    pub fn parse(s: &str) -> Option<Checkpoint> {
        Checkpoint::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

impl fmt::Display for Checkpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The checkpoint the work done at `cp` leads to; `None` at the end of the walk.
pub fn next(cp: Checkpoint) -> Option<Checkpoint> {
    match cp {
        Checkpoint::Queued => Some(Checkpoint::Parsed),
        Checkpoint::Parsed => Some(Checkpoint::OutlineBuilt),
        Checkpoint::OutlineBuilt => Some(Checkpoint::NodesGenerated),
        Checkpoint::NodesGenerated => Some(Checkpoint::ProjectionBuilt),
        Checkpoint::ProjectionBuilt => Some(Checkpoint::SmokeEvalPassed),
        Checkpoint::SmokeEvalPassed => Some(Checkpoint::Published),
        Checkpoint::Published => None,
    }
}

/// How a step that did its work at `cp` reports to the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Commit this checkpoint and go on.
    Advance(Checkpoint),
    /// Commit this checkpoint as the final one.
    Succeed(Checkpoint),
}

/// The engine outcome of finishing the work of `cp`: advance one link, or succeed on the last.
/// At `published` (nothing left to do) the attempt simply succeeds again.
pub fn outcome(cp: Checkpoint) -> Outcome {
    match next(cp) {
        Some(Checkpoint::Published) | None => Outcome::Succeed(Checkpoint::Published),
        Some(n) => Outcome::Advance(n),
    }
}

/// What the head serves for the attempt's document.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Served {
    pub version: i32,
    /// The served generation is this attempt's own.
    pub ours: bool,
    /// The served generation was produced by an attempt created after this one.
    pub by_later_attempt: bool,
}

/// Everything the go/no-go decision of a step needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Facts {
    /// The document version this attempt compiles.
    pub version: i32,
    /// The document's current version.
    pub document_version: i32,
    pub document_active: bool,
    pub space_active: bool,
    /// The highest version with another active attempt for this document.
    pub newest_other_active: Option<i32>,
    /// Only known (and only relevant) at publish time.
    pub served: Option<Served>,
}

/// Whether a step may run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Gate {
    Go,
    /// A newer version (or a later attempt of the same version) wins; this attempt ends
    /// `superseded` and publishes nothing.
    Supersede(String),
    /// The document or its space is being deleted: the attempt is canceled.
    Deleting(String),
    /// The attempt's version is newer than the document's: the rows contradict each other.
    Invalid(String),
}

pub fn gate(f: &Facts) -> Gate {
    if !f.space_active {
        return Gate::Deleting("the knowledge space is being deleted".into());
    }
    if !f.document_active {
        return Gate::Deleting("the document is being deleted".into());
    }
    if f.document_version > f.version {
        return Gate::Supersede(format!(
            "the document is now at version {}; this attempt compiles version {}",
            f.document_version, f.version
        ));
    }
    if f.document_version < f.version {
        return Gate::Invalid(format!(
            "the attempt compiles version {} but the document is at version {}",
            f.version, f.document_version
        ));
    }
    if let Some(v) = f.newest_other_active.filter(|&v| v > f.version) {
        return Gate::Supersede(format!(
            "an active attempt compiles the newer version {v}; this attempt compiles version {}",
            f.version
        ));
    }
    if let Some(s) = f.served {
        if s.version > f.version {
            return Gate::Supersede(format!(
                "the head already serves version {}; this attempt compiles version {}",
                s.version, f.version
            ));
        }
        if s.version == f.version && !s.ours && s.by_later_attempt {
            return Gate::Supersede(format!(
                "a later attempt already published version {}",
                f.version
            ));
        }
    }
    Gate::Go
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transition_table() {
        use Checkpoint::*;
        let table = [
            (Queued, Some(Parsed), Outcome::Advance(Parsed)),
            (Parsed, Some(OutlineBuilt), Outcome::Advance(OutlineBuilt)),
            (
                OutlineBuilt,
                Some(NodesGenerated),
                Outcome::Advance(NodesGenerated),
            ),
            (
                NodesGenerated,
                Some(ProjectionBuilt),
                Outcome::Advance(ProjectionBuilt),
            ),
            (
                ProjectionBuilt,
                Some(SmokeEvalPassed),
                Outcome::Advance(SmokeEvalPassed),
            ),
            (
                SmokeEvalPassed,
                Some(Published),
                Outcome::Succeed(Published),
            ),
            (Published, None, Outcome::Succeed(Published)),
        ];
        for (cp, want_next, want_outcome) in table {
            assert_eq!(next(cp), want_next, "{cp}");
            assert_eq!(outcome(cp), want_outcome, "{cp}");
            assert_eq!(Checkpoint::parse(cp.as_str()), Some(cp));
        }
        assert_eq!(Checkpoint::parse("done"), None);
        // One chain: walking from queued visits every checkpoint once, in order.
        let mut walked = vec![Queued];
        while let Some(n) = next(*walked.last().unwrap()) {
            walked.push(n);
        }
        assert_eq!(walked, Checkpoint::ALL.to_vec());
    }

    #[test]
    fn gate_table() {
        let base = Facts {
            version: 2,
            document_version: 2,
            document_active: true,
            space_active: true,
            newest_other_active: None,
            served: None,
        };
        let served = |version, ours, by_later_attempt| {
            Some(Served {
                version,
                ours,
                by_later_attempt,
            })
        };
        let go = |f: Facts| gate(&f) == Gate::Go;
        let sup = |f: Facts| matches!(gate(&f), Gate::Supersede(_));
        assert!(go(base));
        assert!(go(Facts {
            newest_other_active: Some(2),
            ..base
        }));
        assert!(go(Facts {
            newest_other_active: Some(1),
            ..base
        }));
        assert!(go(Facts {
            served: served(1, false, true),
            ..base
        }));
        assert!(go(Facts {
            served: served(2, false, false),
            ..base
        }));
        assert!(go(Facts {
            served: served(2, true, false),
            ..base
        }));
        assert!(sup(Facts {
            document_version: 3,
            ..base
        }));
        assert!(sup(Facts {
            newest_other_active: Some(3),
            ..base
        }));
        assert!(sup(Facts {
            served: served(3, false, false),
            ..base
        }));
        assert!(sup(Facts {
            served: served(2, false, true),
            ..base
        }));
        assert!(matches!(
            gate(&Facts {
                document_active: false,
                document_version: 3,
                ..base
            }),
            Gate::Deleting(_)
        ));
        assert!(matches!(
            gate(&Facts {
                space_active: false,
                ..base
            }),
            Gate::Deleting(_)
        ));
        assert!(matches!(
            gate(&Facts {
                document_version: 1,
                ..base
            }),
            Gate::Invalid(_)
        ));
    }
}
