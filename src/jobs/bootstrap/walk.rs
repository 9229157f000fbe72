//! The legacy space bootstrap walk as pure functions. Invariant: the checkpoint only moves
//! forward, one phase at a time (`pending_snapshot → snapshot_captured → rebuilding → verifying
//! → published`), repeating the current phase is allowed, and `published` is reached only
//! together with `run_state='succeeded'`, after every frozen document was rebuilt and is served
//! by the head.

use std::collections::BTreeMap;
use std::time::Duration;

use uuid::Uuid;

use crate::jobs::{JobError, Step};
use crate::publication::{Member, Members};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Checkpoint {
    /// Waiting to freeze the document set (mutation leases may still be held).
    PendingSnapshot,
    /// The set is frozen; compiles are being admitted.
    SnapshotCaptured,
    /// Every item has a compile attempt; following them to their end.
    Rebuilding,
    /// Every item rebuilt; checking the head serves them, then publishing.
    Verifying,
    /// The head is published and recorded; the readiness latch is set.
    Published,
}

impl Checkpoint {
    pub const ALL: [Checkpoint; 5] = [
        Checkpoint::PendingSnapshot,
        Checkpoint::SnapshotCaptured,
        Checkpoint::Rebuilding,
        Checkpoint::Verifying,
        Checkpoint::Published,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Checkpoint::PendingSnapshot => "pending_snapshot",
            Checkpoint::SnapshotCaptured => "snapshot_captured",
            Checkpoint::Rebuilding => "rebuilding",
            Checkpoint::Verifying => "verifying",
            Checkpoint::Published => "published",
        }
    }

    pub fn parse(s: &str) -> Option<Checkpoint> {
        Self::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

/// Whether the walk may move from `from` to `to`: stay, or exactly one phase forward.
pub fn allowed(from: Checkpoint, to: Checkpoint) -> bool {
    let (f, t) = (from as u8, to as u8);
    t == f || t == f + 1
}

/// What one step of the current phase found (and did).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// pending_snapshot: live mutation leases remain after reclaiming expired ones; the
    /// earliest ends in `retry_in` (if it has an expiry).
    MutationLeased {
        live: i64,
        retry_in: Option<Duration>,
    },
    /// pending_snapshot: the set was frozen with this many documents.
    Captured { documents: i32 },
    /// snapshot_captured / rebuilding: what the items look like after this step's writes.
    Items(Items),
    /// verifying: what checking the head found.
    Verified(Verdict),
}

/// Item counts by status, and how many this step changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Items {
    /// Compiles requested in this step.
    pub admitted: usize,
    /// Items whose attempt ended in this step (status written).
    pub settled: usize,
    pub pending: usize,
    pub running: usize,
    pub succeeded: usize,
    pub failed: usize,
}

/// How long to wait between two looks at running compiles, and at most for a mutation lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waits {
    pub poll: Duration,
    pub max_lease_wait: Duration,
}

impl Default for Waits {
    fn default() -> Self {
        Self {
            poll: Duration::from_secs(1),
            max_lease_wait: Duration::from_secs(30),
        }
    }
}

/// The next step of the walk.
pub fn decide(cp: Checkpoint, ev: &Event, waits: Waits) -> Result<Step, JobError> {
    let to = |c: Checkpoint| Ok(Step::Advance(c.as_str().to_owned()));
    match (cp, ev) {
        (Checkpoint::PendingSnapshot, Event::MutationLeased { live, retry_in }) => Ok(Step::Wait {
            delay: retry_in
                .unwrap_or(waits.max_lease_wait)
                .clamp(Duration::from_millis(100), waits.max_lease_wait),
            reason: format!("{live} mutation lease(s) of the space are held; the snapshot waits"),
        }),
        (Checkpoint::PendingSnapshot, Event::Captured { .. }) => to(Checkpoint::SnapshotCaptured),
        (Checkpoint::SnapshotCaptured, Event::Items(i)) => {
            if i.pending > 0 {
                to(Checkpoint::SnapshotCaptured)
            } else {
                to(Checkpoint::Rebuilding)
            }
        }
        (Checkpoint::Rebuilding, Event::Items(i)) => {
            if i.admitted > 0 || i.settled > 0 || i.pending > 0 {
                // Commit what changed before anything else is decided, so that the statuses of
                // failed items survive the failure they cause.
                to(Checkpoint::Rebuilding)
            } else if i.failed > 0 {
                Err(JobError::retryable(
                    "document_compile_failed",
                    format!(
                        "{} document(s) of the snapshot did not compile; they are compiled again when the bootstrap is retried",
                        i.failed
                    ),
                ))
            } else if i.running > 0 {
                Ok(Step::Wait {
                    delay: waits.poll,
                    reason: format!("{} compile(s) still running", i.running),
                })
            } else {
                to(Checkpoint::Verifying)
            }
        }
        (Checkpoint::Verifying, Event::Verified(v)) => match v {
            Verdict::Served | Verdict::Publish(_) => {
                Ok(Step::Succeed(Checkpoint::Published.as_str().to_owned()))
            }
            Verdict::Unserved { document, why } => Err(JobError::fatal(
                "bootstrap_verify_failed",
                format!("document {document} of the snapshot is not served: {why}"),
            )),
        },
        (Checkpoint::Published, _) => Ok(Step::Succeed(Checkpoint::Published.as_str().to_owned())),
        (cp, ev) => Err(JobError::fatal(
            "bootstrap_invalid_event",
            format!("{ev:?} cannot happen at {}", cp.as_str()),
        )),
    }
}

/// One frozen item as verification sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rebuilt {
    pub document: Uuid,
    /// The version frozen in the snapshot.
    pub version: i32,
    /// The generation and version the item's compile attempt built, if it succeeded.
    pub built: Option<Member>,
}

/// What checking the head against the frozen items found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The head serves every item at its frozen version or newer.
    Served,
    /// These members must be added to the head (their compiles succeeded, but the head does
    /// not serve them, e.g. another publication replaced it meanwhile).
    Publish(Members),
    /// An item is neither served nor rebuilt.
    Unserved { document: Uuid, why: String },
}

/// Checks `items` against the head's members.
pub fn verify(items: &[Rebuilt], head: &Members) -> Verdict {
    let mut missing = BTreeMap::new();
    for it in items {
        match head.get(&it.document) {
            Some(m) if m.version >= it.version => {}
            served => match it.built {
                Some(b) if b.version >= it.version => {
                    missing.insert(it.document, b);
                }
                _ => {
                    return Verdict::Unserved {
                        document: it.document,
                        why: match served {
                            Some(m) => format!(
                                "the head serves version {} but the snapshot froze version {}",
                                m.version, it.version
                            ),
                            None => "the head does not serve it and no compile of it succeeded"
                                .to_owned(),
                        },
                    }
                }
            },
        }
    }
    if missing.is_empty() {
        Verdict::Served
    } else {
        Verdict::Publish(missing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Checkpoint::*;

    fn items(admitted: usize, settled: usize, p: usize, r: usize, s: usize, f: usize) -> Event {
        Event::Items(Items {
            admitted,
            settled,
            pending: p,
            running: r,
            succeeded: s,
            failed: f,
        })
    }

    fn adv(c: Checkpoint) -> Result<Step, String> {
        Ok(Step::Advance(c.as_str().into()))
    }

    fn flat(r: Result<Step, JobError>) -> Result<Step, String> {
        r.map_err(|e| e.code().to_owned())
    }

    #[test]
    fn decision_table() {
        let w = Waits {
            poll: Duration::from_millis(500),
            max_lease_wait: Duration::from_secs(10),
        };
        let doc = Uuid::from_u128(7);
        let table: Vec<(Checkpoint, Event, Result<Step, String>)> = vec![
            (
                PendingSnapshot,
                Event::MutationLeased {
                    live: 1,
                    retry_in: Some(Duration::from_secs(3)),
                },
                Ok(Step::Wait {
                    delay: Duration::from_secs(3),
                    reason: "1 mutation lease(s) of the space are held; the snapshot waits".into(),
                }),
            ),
            (
                PendingSnapshot,
                Event::Captured { documents: 3 },
                adv(SnapshotCaptured),
            ),
            (
                PendingSnapshot,
                Event::Captured { documents: 0 },
                adv(SnapshotCaptured),
            ),
            (
                SnapshotCaptured,
                items(32, 0, 5, 32, 0, 0),
                adv(SnapshotCaptured),
            ),
            (SnapshotCaptured, items(5, 0, 0, 37, 0, 0), adv(Rebuilding)),
            (SnapshotCaptured, items(0, 0, 0, 0, 0, 0), adv(Rebuilding)),
            (Rebuilding, items(0, 2, 0, 3, 2, 0), adv(Rebuilding)),
            (Rebuilding, items(0, 1, 0, 0, 4, 1), adv(Rebuilding)),
            (Rebuilding, items(2, 0, 0, 2, 3, 0), adv(Rebuilding)),
            (
                Rebuilding,
                items(0, 0, 0, 3, 2, 0),
                Ok(Step::Wait {
                    delay: Duration::from_millis(500),
                    reason: "3 compile(s) still running".into(),
                }),
            ),
            (
                Rebuilding,
                items(0, 0, 0, 0, 4, 1),
                Err("document_compile_failed".into()),
            ),
            (Rebuilding, items(0, 0, 0, 0, 5, 0), adv(Verifying)),
            (
                Verifying,
                Event::Verified(Verdict::Served),
                Ok(Step::Succeed("published".into())),
            ),
            (
                Verifying,
                Event::Verified(Verdict::Publish(Members::new())),
                Ok(Step::Succeed("published".into())),
            ),
            (
                Verifying,
                Event::Verified(Verdict::Unserved {
                    document: doc,
                    why: "x".into(),
                }),
                Err("bootstrap_verify_failed".into()),
            ),
            (
                Published,
                Event::Verified(Verdict::Served),
                Ok(Step::Succeed("published".into())),
            ),
            // Events of another phase are refused.
            (
                PendingSnapshot,
                items(0, 0, 0, 0, 0, 0),
                Err("bootstrap_invalid_event".into()),
            ),
            (
                Rebuilding,
                Event::Captured { documents: 1 },
                Err("bootstrap_invalid_event".into()),
            ),
            (
                Verifying,
                items(0, 0, 0, 0, 1, 0),
                Err("bootstrap_invalid_event".into()),
            ),
        ];
        for (cp, ev, want) in table {
            assert_eq!(flat(decide(cp, &ev, w)), want, "{cp:?} {ev:?}");
        }
    }

    #[test]
    fn lease_waits_are_clamped() {
        let w = Waits {
            poll: Duration::from_secs(1),
            max_lease_wait: Duration::from_secs(10),
        };
        for (retry_in, want) in [
            (Some(Duration::from_millis(1)), Duration::from_millis(100)),
            (Some(Duration::from_secs(60)), Duration::from_secs(10)),
            (None, Duration::from_secs(10)),
        ] {
            let ev = Event::MutationLeased { live: 2, retry_in };
            match decide(PendingSnapshot, &ev, w).unwrap() {
                Step::Wait { delay, .. } => assert_eq!(delay, want),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn every_decision_is_an_allowed_move() {
        let w = Waits::default();
        let events = [
            Event::Captured { documents: 1 },
            items(1, 0, 1, 0, 0, 0),
            items(0, 0, 0, 0, 1, 0),
            Event::Verified(Verdict::Served),
        ];
        for cp in Checkpoint::ALL {
            for ev in &events {
                if let Ok(Step::Advance(to) | Step::Succeed(to)) = decide(cp, ev, w) {
                    let to = Checkpoint::parse(&to).unwrap();
                    assert!(allowed(cp, to), "{cp:?} -> {to:?}");
                }
            }
        }
    }

    #[test]
    fn transitions_table() {
        let table = [
            (PendingSnapshot, PendingSnapshot, true),
            (PendingSnapshot, SnapshotCaptured, true),
            (PendingSnapshot, Rebuilding, false),
            (PendingSnapshot, Published, false),
            (SnapshotCaptured, Rebuilding, true),
            (Rebuilding, Verifying, true),
            (Rebuilding, SnapshotCaptured, false),
            (Verifying, Published, true),
            (Published, Verifying, false),
            (Published, Published, true),
        ];
        for (from, to, ok) in table {
            assert_eq!(allowed(from, to), ok, "{from:?} -> {to:?}");
        }
        for c in Checkpoint::ALL {
            assert_eq!(Checkpoint::parse(c.as_str()), Some(c));
        }
        assert_eq!(Checkpoint::parse("queued"), None);
    }

    #[test]
    fn verification_table() {
        let (a, b) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let m = |g: u128, v: i32| Member {
            generation: Uuid::from_u128(g),
            version: v,
        };
        let head: Members = [(a, m(10, 1)), (b, m(20, 2))].into_iter().collect();
        let it = |d, v, built| Rebuilt {
            document: d,
            version: v,
            built,
        };
        // Served at the frozen version, or newer.
        assert_eq!(
            verify(&[it(a, 1, Some(m(10, 1))), it(b, 1, None)], &head),
            Verdict::Served
        );
        // Not served but rebuilt: publish it.
        let c = Uuid::from_u128(3);
        assert_eq!(
            verify(&[it(c, 1, Some(m(30, 1)))], &head),
            Verdict::Publish([(c, m(30, 1))].into_iter().collect())
        );
        // Served at an older version and not rebuilt: refused.
        assert!(matches!(
            verify(&[it(b, 3, None)], &head),
            Verdict::Unserved { document, .. } if document == b
        ));
        // Neither served nor rebuilt.
        assert!(matches!(
            verify(&[it(c, 1, None)], &Members::new()),
            Verdict::Unserved { .. }
        ));
        // Nothing frozen: nothing to serve.
        assert_eq!(verify(&[], &Members::new()), Verdict::Served);
    }
}
