//! The deletion walk as a pure function: checkpoint + what the step found → what the engine
//! commits. Invariant: the only forward path is
//! `requested → quiescing → deleting_objects → deleting_derived_data → deleting_primary_data →
//! completed`; a checkpoint may repeat itself (paged work), residue found at the end goes back to
//! `quiescing` with a fresh inventory, a dead item fails the job, and nothing else moves it; every
//! wait (writers still draining, a writer that came back after the inventory, items not due) is
//! a planned wait that uses up no attempt.

use std::fmt;
use std::time::Duration;

/// A deletion job's checkpoint (`deletion_jobs.checkpoint`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Checkpoint {
    Requested,
    Quiescing,
    DeletingObjects,
    DeletingDerivedData,
    DeletingPrimaryData,
    Completed,
}

impl Checkpoint {
    pub const ALL: [Checkpoint; 6] = [
        Checkpoint::Requested,
        Checkpoint::Quiescing,
        Checkpoint::DeletingObjects,
        Checkpoint::DeletingDerivedData,
        Checkpoint::DeletingPrimaryData,
        Checkpoint::Completed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Checkpoint::Requested => "requested",
            Checkpoint::Quiescing => "quiescing",
            Checkpoint::DeletingObjects => "deleting_objects",
            Checkpoint::DeletingDerivedData => "deleting_derived_data",
            Checkpoint::DeletingPrimaryData => "deleting_primary_data",
            Checkpoint::Completed => "completed",
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

/// What one step found at its checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The job was picked up (`requested`).
    Started,
    /// Work that may still read or write the target holds a live lease; look again after
    /// `retry_in`.
    LeasesActive { retry_in: Duration },
    /// A writer became active after the inventory was complete: the inventory was reset and
    /// starts again once it drains.
    LateWriter { retry_in: Duration },
    /// One page (or batch) of this checkpoint's work committed; more may remain.
    PageDone,
    /// This checkpoint's work is finished.
    PhaseDone,
    /// Items remain but none is due before `retry_in`.
    ItemsNotDue { retry_in: Duration },
    /// Items ran out of attempts.
    ItemsDead { count: i64 },
    /// The residue check found target data left.
    ResidueFound { what: String },
    /// The residue check passed and the target row is gone.
    Clean,
}

/// What the engine commits for a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Move to (or stay at) this checkpoint.
    Advance(Checkpoint),
    /// Go back to `quiescing` and rebuild the inventory from scratch.
    Restart { reason: String },
    /// Planned wait that uses up no attempt.
    Wait { delay: Duration, reason: String },
    /// Finished: tombstone completed, job succeeded.
    Succeed,
    /// Failed; the job keeps its active slot for a manual retry.
    Fail { code: &'static str, message: String },
}

/// The event cannot happen at this checkpoint: a bug or a corrupt row.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("event {event:?} is not valid at checkpoint {checkpoint}")]
pub struct Invalid {
    pub checkpoint: Checkpoint,
    pub event: Event,
}

/// The transition table.
pub fn transition(cp: Checkpoint, event: Event) -> Result<Decision, Invalid> {
    use Checkpoint as C;
    use Event as E;
    let d = match (cp, &event) {
        (C::Requested, E::Started) => Decision::Advance(C::Quiescing),
        (C::Quiescing, E::LeasesActive { retry_in }) => Decision::Wait {
            delay: *retry_in,
            reason: "work on the target still holds a live lease".into(),
        },
        (C::Quiescing, E::LateWriter { retry_in }) => Decision::Wait {
            delay: *retry_in,
            reason: "a writer became active after the inventory; the inventory starts again".into(),
        },
        (C::Quiescing, E::PageDone) => Decision::Advance(C::Quiescing),
        (C::Quiescing, E::PhaseDone) => Decision::Advance(C::DeletingObjects),
        (C::DeletingObjects, E::PageDone) => Decision::Advance(C::DeletingObjects),
        (C::DeletingObjects, E::ItemsNotDue { retry_in }) => Decision::Wait {
            delay: *retry_in,
            reason: "deletion items are waiting for their next attempt".into(),
        },
        (C::DeletingObjects, E::ItemsDead { count }) => Decision::Fail {
            code: "item_dead",
            message: format!(
                "{count} deletion item(s) used up their attempts; a manual retry re-arms them"
            ),
        },
        (C::DeletingObjects, E::PhaseDone) => Decision::Advance(C::DeletingDerivedData),
        (C::DeletingDerivedData, E::PageDone) => Decision::Advance(C::DeletingDerivedData),
        (C::DeletingDerivedData, E::LeasesActive { retry_in }) => Decision::Wait {
            delay: *retry_in,
            reason: "an active compile attempt still builds on a publication of the target".into(),
        },
        (C::DeletingDerivedData, E::PhaseDone) => Decision::Advance(C::DeletingPrimaryData),
        (C::DeletingPrimaryData, E::PageDone) => Decision::Advance(C::DeletingPrimaryData),
        (C::DeletingPrimaryData, E::ResidueFound { what }) => Decision::Restart {
            reason: what.clone(),
        },
        (C::DeletingPrimaryData, E::Clean) => Decision::Succeed,
        _ => {
            return Err(Invalid {
                checkpoint: cp,
                event,
            })
        }
    };
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Checkpoint as C;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn checkpoints_round_trip() {
        for c in Checkpoint::ALL {
            assert_eq!(Checkpoint::parse(c.as_str()), Some(c));
        }
        assert_eq!(Checkpoint::parse("published"), None);
    }

    #[test]
    fn transition_table() {
        let valid: Vec<(Checkpoint, Event, Decision)> = vec![
            (
                C::Requested,
                Event::Started,
                Decision::Advance(C::Quiescing),
            ),
            (
                C::Quiescing,
                Event::LeasesActive { retry_in: ms(500) },
                Decision::Wait {
                    delay: ms(500),
                    reason: "work on the target still holds a live lease".into(),
                },
            ),
            (
                C::Quiescing,
                Event::LateWriter { retry_in: ms(700) },
                Decision::Wait {
                    delay: ms(700),
                    reason:
                        "a writer became active after the inventory; the inventory starts again"
                            .into(),
                },
            ),
            (
                C::Quiescing,
                Event::PageDone,
                Decision::Advance(C::Quiescing),
            ),
            (
                C::Quiescing,
                Event::PhaseDone,
                Decision::Advance(C::DeletingObjects),
            ),
            (
                C::DeletingObjects,
                Event::PageDone,
                Decision::Advance(C::DeletingObjects),
            ),
            (
                C::DeletingObjects,
                Event::ItemsNotDue { retry_in: ms(90) },
                Decision::Wait {
                    delay: ms(90),
                    reason: "deletion items are waiting for their next attempt".into(),
                },
            ),
            (
                C::DeletingObjects,
                Event::ItemsDead { count: 2 },
                Decision::Fail {
                    code: "item_dead",
                    message:
                        "2 deletion item(s) used up their attempts; a manual retry re-arms them"
                            .into(),
                },
            ),
            (
                C::DeletingObjects,
                Event::PhaseDone,
                Decision::Advance(C::DeletingDerivedData),
            ),
            (
                C::DeletingDerivedData,
                Event::PageDone,
                Decision::Advance(C::DeletingDerivedData),
            ),
            (
                C::DeletingDerivedData,
                Event::LeasesActive { retry_in: ms(300) },
                Decision::Wait {
                    delay: ms(300),
                    reason: "an active compile attempt still builds on a publication of the target"
                        .into(),
                },
            ),
            (
                C::DeletingDerivedData,
                Event::PhaseDone,
                Decision::Advance(C::DeletingPrimaryData),
            ),
            (
                C::DeletingPrimaryData,
                Event::PageDone,
                Decision::Advance(C::DeletingPrimaryData),
            ),
            (
                C::DeletingPrimaryData,
                Event::ResidueFound {
                    what: "documents".into(),
                },
                Decision::Restart {
                    reason: "documents".into(),
                },
            ),
            (C::DeletingPrimaryData, Event::Clean, Decision::Succeed),
        ];
        for (i, (cp, ev, want)) in valid.iter().cloned().enumerate() {
            assert_eq!(transition(cp, ev), Ok(want), "row {i}");
        }
        // Everything not in the table is refused, including any event at `completed`.
        let events = [
            Event::Started,
            Event::LeasesActive { retry_in: ms(1) },
            Event::LateWriter { retry_in: ms(1) },
            Event::PageDone,
            Event::PhaseDone,
            Event::ItemsNotDue { retry_in: ms(1) },
            Event::ItemsDead { count: 1 },
            Event::ResidueFound { what: "x".into() },
            Event::Clean,
        ];
        for cp in Checkpoint::ALL {
            for ev in &events {
                let listed = valid.iter().any(|(c, e, _)| {
                    *c == cp && std::mem::discriminant(e) == std::mem::discriminant(ev)
                });
                assert_eq!(transition(cp, ev.clone()).is_ok(), listed, "{cp} on {ev:?}");
            }
        }
    }

    #[test]
    fn the_forward_path_visits_every_checkpoint_once() {
        let mut cp = C::Requested;
        let mut seen = vec![cp];
        let script = [
            Event::Started,
            Event::PhaseDone,
            Event::PhaseDone,
            Event::PhaseDone,
        ];
        for ev in script {
            match transition(cp, ev).unwrap() {
                Decision::Advance(next) => cp = next,
                other => panic!("unexpected {other:?}"),
            }
            seen.push(cp);
        }
        assert_eq!(transition(cp, Event::Clean), Ok(Decision::Succeed));
        seen.push(C::Completed);
        assert_eq!(seen, Checkpoint::ALL.to_vec());
    }
}
