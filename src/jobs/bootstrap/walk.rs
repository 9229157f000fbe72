//! The legacy space bootstrap walk as pure functions, with the platform's refusals and codes.
//! Invariant: the checkpoint only moves forward (`pending_snapshot → snapshot_captured →
//! rebuilding → verifying → published`, one phase at a time, except that an empty snapshot goes
//! from `snapshot_captured` straight to `verifying` as the platform's does); repeating the
//! current phase is allowed; a document whose rebuild failed fails the bootstrap with
//! `DOCUMENT_COMPILATION_FAILED` once its status is recorded; every other refusal is
//! `BOOTSTRAP_PROCESSING_FAILED` with the platform's message; and `published` is reached only
//! together with `run_state='succeeded'`, when the frozen snapshot still matches the space's
//! documents and the published head serves exactly and completely the frozen documents (or,
//! for an empty snapshot, no legacy state is left).

use std::time::Duration;

use uuid::Uuid;

use crate::jobs::{JobError, Step};

/// A compile of a frozen document did not end published.
pub const COMPILATION_FAILED: &str = "DOCUMENT_COMPILATION_FAILED";
/// Every other failure of a bootstrap.
pub const PROCESSING_FAILED: &str = "BOOTSTRAP_PROCESSING_FAILED";

/// A refusal, recorded as the platform's runtime records any error of a bootstrap.
pub fn refuse(message: impl Into<String>) -> JobError {
    JobError::fatal(PROCESSING_FAILED, message)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Checkpoint {
    /// Waiting to freeze the document set.
    PendingSnapshot,
    /// The set is frozen; no compile is bound yet.
    SnapshotCaptured,
    /// Compiles are bound to items; following them to their end.
    Rebuilding,
    /// Every item rebuilt; checking the head.
    Verifying,
    /// The head is verified and recorded; the readiness latch is set.
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

/// Whether the walk may move from `from` to `to`: stay, one phase forward, or from
/// `snapshot_captured` to `verifying` (an empty snapshot has nothing to rebuild).
pub fn allowed(from: Checkpoint, to: Checkpoint) -> bool {
    let (f, t) = (from as u8, to as u8);
    t == f || t == f + 1 || (from == Checkpoint::SnapshotCaptured && to == Checkpoint::Verifying)
}

/// What the capture found under the space row's lock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CaptureFacts {
    /// The space exists, is active, has no deletion job id and no active deletion job.
    pub space_writable: bool,
    /// The row's counts are still 0 (no partial snapshot).
    pub counts_zero: bool,
    /// A mutation lease that has not expired (`expires_at > now`).
    pub live_mutation_lease: bool,
    pub head_exists: bool,
    /// A compile attempt of the space holds its active slot.
    pub active_compilation: bool,
    /// How many documents the space has (counted up to `max_documents + 1`).
    pub documents: usize,
    pub max_documents: usize,
}

/// Why the snapshot may not be taken, in the platform's order; `None`: take it.
pub fn capture_refusal(f: &CaptureFacts) -> Option<JobError> {
    let why = if !f.space_writable {
        "Legacy publication bootstrap knowledge space was not found in tenant scope".to_owned()
    } else if !f.counts_zero {
        "Pending bootstrap marker already contains a partial document snapshot".to_owned()
    } else if f.live_mutation_lease {
        "Knowledge space already has an active document mutation lease".to_owned()
    } else if f.head_exists {
        "Legacy publication bootstrap is not allowed after a publication head exists".to_owned()
    } else if f.active_compilation {
        "Legacy publication bootstrap requires all document compilation attempts to be idle"
            .to_owned()
    } else if f.documents > f.max_documents {
        format!(
            "Legacy publication bootstrap maxDocuments={} exceeded",
            f.max_documents
        )
    } else {
        return None;
    };
    Some(refuse(why))
}

/// What a rebuilding step found, after its own writes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Items {
    /// Compiles requested (or adopted) and bound in this step.
    pub admitted: usize,
    /// Items whose compile ended in this step (status written).
    pub settled: usize,
    pub pending: usize,
    pub running: usize,
    pub succeeded: usize,
    pub failed: usize,
    /// The error of the first failed item, in snapshot order.
    pub first_failure: Option<String>,
}

/// How long to wait between two looks at running compiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waits {
    pub poll: Duration,
}

impl Default for Waits {
    fn default() -> Self {
        Self {
            poll: Duration::from_secs(1),
        }
    }
}

/// The next step of a capturing or rebuilding phase.
pub fn after_items(cp: Checkpoint, i: &Items, waits: Waits) -> Result<Step, JobError> {
    let to = |c: Checkpoint| Ok(Step::Advance(c.as_str().to_owned()));
    match cp {
        Checkpoint::SnapshotCaptured | Checkpoint::Rebuilding => {}
        other => {
            return Err(refuse(format!(
                "Legacy publication bootstrap cannot rebuild from checkpoint={}",
                other.as_str()
            )))
        }
    }
    if i.admitted > 0 || i.settled > 0 {
        // Commit what changed before anything else is decided, so that the status of a failed
        // item survives the failure it causes.
        to(Checkpoint::Rebuilding)
    } else if i.failed > 0 {
        Err(JobError::fatal(
            COMPILATION_FAILED,
            i.first_failure
                .clone()
                .unwrap_or_else(|| "Compilation ended as failed".to_owned()),
        ))
    } else if i.pending > 0 {
        to(Checkpoint::Rebuilding)
    } else if i.running > 0 {
        Ok(Step::Wait {
            delay: waits.poll,
            reason: format!("{} document compilation(s) still running", i.running),
        })
    } else {
        to(Checkpoint::Verifying)
    }
}

/// What a compile attempt bound to a running item has come to.
pub fn settle(run_state: &str, checkpoint: &str) -> Option<bool> {
    match run_state {
        "succeeded" if checkpoint == "published" => Some(true),
        "failed" | "canceled" | "superseded" => Some(false),
        _ => None,
    }
}

/// The head a verification found: the space's head, naming a `published` publication.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublishedHead {
    pub publication_id: Uuid,
    pub fingerprint: String,
    pub revision: i32,
}

/// What verification found under the space's and the head's locks. Each `Option<Uuid>` is
/// the first document (or member) that breaks the rule, if any.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerifyFacts {
    pub space_writable: bool,
    pub total: i32,
    /// Items with status `succeeded`.
    pub succeeded: i64,
    /// An item whose document row no longer has the frozen version and hash.
    pub changed: Option<Uuid>,
    /// A document of the space that has no item.
    pub unsnapshotted: Option<Uuid>,
    /// Null-generation rows of the space (checked for an empty snapshot).
    pub legacy_state: bool,
    pub head: Option<PublishedHead>,
    /// A frozen document without an outline of its frozen version with a ready, complete page
    /// index, or without a ready full-text projection of its generation.
    pub missing_corpus: Option<Uuid>,
    /// A frozen document without a ready dense projection (of the manifest's embedding vector
    /// space, when it names one).
    pub missing_dense: Option<Uuid>,
    /// A projection member whose node lacks a ready full-text or a ready dense sibling.
    pub unpaired: Option<Uuid>,
    /// A member that is ownerless, owned by a document outside the snapshot, missing, or of
    /// another generation.
    pub invalid_member: Option<Uuid>,
}

/// What verification decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// An empty snapshot and no legacy state: succeed without a head.
    Empty,
    /// The head serves the frozen documents: record it and succeed.
    Published(PublishedHead),
    /// Refused, with the platform's message.
    Refused(String),
}

/// The platform's `complete`: the snapshot checks, then the head checks.
pub fn verify(f: &VerifyFacts) -> Verdict {
    let no = |m: &str| Verdict::Refused(m.to_owned());
    if !f.space_writable {
        return no("Legacy publication bootstrap knowledge space was not found in tenant scope");
    }
    if f.succeeded != i64::from(f.total) {
        return no("Bootstrap item count no longer matches the frozen document snapshot");
    }
    if f.changed.is_some() {
        return no("Legacy publication bootstrap document snapshot changed");
    }
    if f.unsnapshotted.is_some() {
        return no("A document was added after the bootstrap snapshot was captured");
    }
    if f.total == 0 {
        return if f.legacy_state {
            no("Legacy null-generation derived state remains after rebuilding an empty document snapshot")
        } else {
            Verdict::Empty
        };
    }
    let Some(head) = &f.head else {
        return no("Bootstrap has no current published head after rebuilding documents");
    };
    if f.missing_corpus.is_some() {
        return no("Published head does not contain a generation-closed PageIndex and FTS corpus for every frozen document");
    }
    if f.missing_dense.is_some() {
        return no("Published head does not contain the selected ready dense vector space for every frozen document");
    }
    if f.unpaired.is_some() {
        return no("Published head contains a node without both ready FTS and active-vector-space projections");
    }
    if f.invalid_member.is_some() {
        return no("Published head contains a missing, cross-generation, or ownerless component");
    }
    Verdict::Published(head.clone())
}

/// The step of the verifying phase.
pub fn after_verify(v: &Verdict) -> Result<Step, JobError> {
    match v {
        Verdict::Empty | Verdict::Published(_) => {
            Ok(Step::Succeed(Checkpoint::Published.as_str().to_owned()))
        }
        Verdict::Refused(why) => Err(refuse(why.clone())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Checkpoint::*;

    fn flat(r: Result<Step, JobError>) -> Result<Step, String> {
        r.map_err(|e| {
            assert!(matches!(e, JobError::Fatal { .. }), "{e:?}");
            e.code().to_owned()
        })
    }

    fn adv(c: Checkpoint) -> Result<Step, String> {
        Ok(Step::Advance(c.as_str().into()))
    }

    fn items(admitted: usize, settled: usize, p: usize, r: usize, s: usize, f: usize) -> Items {
        Items {
            admitted,
            settled,
            pending: p,
            running: r,
            succeeded: s,
            failed: f,
            first_failure: (f > 0).then(|| "hash mismatch".to_owned()),
        }
    }

    #[test]
    fn capture_table() {
        let ok = CaptureFacts {
            space_writable: true,
            counts_zero: true,
            documents: 3,
            max_documents: 3,
            ..CaptureFacts::default()
        };
        let with = |change: fn(&mut CaptureFacts)| {
            let mut f = ok;
            change(&mut f);
            f
        };
        let table: Vec<(CaptureFacts, Option<&str>)> = vec![
            (ok, None),
            (with(|f| f.documents = 0), None),
            (
                with(|f| (f.space_writable, f.live_mutation_lease) = (false, true)),
                Some("not found in tenant scope"),
            ),
            (
                with(|f| f.counts_zero = false),
                Some("partial document snapshot"),
            ),
            (
                with(|f| (f.live_mutation_lease, f.head_exists) = (true, true)),
                Some("active document mutation lease"),
            ),
            (
                with(|f| (f.head_exists, f.active_compilation) = (true, true)),
                Some("after a publication head exists"),
            ),
            (
                with(|f| f.active_compilation = true),
                Some("attempts to be idle"),
            ),
            (with(|f| f.documents = 4), Some("maxDocuments=3 exceeded")),
        ];
        for (f, want) in table {
            let got = capture_refusal(&f);
            match (got, want) {
                (None, None) => {}
                (Some(e), Some(w)) => {
                    assert_eq!(e.code(), PROCESSING_FAILED);
                    assert!(e.message().contains(w), "{f:?}: {}", e.message());
                }
                (got, want) => panic!("{f:?}: {got:?} vs {want:?}"),
            }
        }
    }

    #[test]
    fn items_table() {
        let w = Waits {
            poll: Duration::from_millis(500),
        };
        let failed = || Err(COMPILATION_FAILED.to_owned());
        let refused = || Err(PROCESSING_FAILED.to_owned());
        let table: Vec<(Checkpoint, Items, Result<Step, String>)> = vec![
            (SnapshotCaptured, items(3, 0, 0, 3, 0, 0), adv(Rebuilding)),
            (SnapshotCaptured, items(32, 0, 5, 32, 0, 0), adv(Rebuilding)),
            // An empty snapshot goes to verification directly.
            (SnapshotCaptured, items(0, 0, 0, 0, 0, 0), adv(Verifying)),
            (Rebuilding, items(0, 2, 0, 1, 2, 0), adv(Rebuilding)),
            (Rebuilding, items(0, 1, 0, 0, 2, 1), adv(Rebuilding)),
            (Rebuilding, items(2, 0, 0, 2, 1, 0), adv(Rebuilding)),
            (Rebuilding, items(0, 0, 0, 2, 1, 1), failed()),
            (Rebuilding, items(0, 0, 0, 0, 2, 1), failed()),
            (
                Rebuilding,
                items(0, 0, 0, 3, 2, 0),
                Ok(Step::Wait {
                    delay: Duration::from_millis(500),
                    reason: "3 document compilation(s) still running".into(),
                }),
            ),
            (Rebuilding, items(0, 0, 0, 0, 5, 0), adv(Verifying)),
            (PendingSnapshot, items(0, 0, 0, 0, 0, 0), refused()),
            (Verifying, items(0, 0, 0, 0, 1, 0), refused()),
        ];
        for (cp, i, want) in table {
            assert_eq!(flat(after_items(cp, &i, w)), want, "{cp:?} {i:?}");
        }
        let e = after_items(Rebuilding, &items(0, 0, 0, 0, 1, 1), w).unwrap_err();
        assert_eq!(
            e.message(),
            "hash mismatch",
            "the compile's own error is the message"
        );
    }

    #[test]
    fn settle_table() {
        for (state, cp, want) in [
            ("succeeded", "published", Some(true)),
            ("succeeded", "smoke_eval_passed", None),
            ("failed", "parsed", Some(false)),
            ("canceled", "queued", Some(false)),
            ("superseded", "nodes_generated", Some(false)),
            ("running", "parsed", None),
            ("retry_wait", "parsed", None),
            ("dispatch_pending", "queued", None),
        ] {
            assert_eq!(settle(state, cp), want, "{state} {cp}");
        }
    }

    #[test]
    fn verification_table() {
        let head = PublishedHead {
            publication_id: Uuid::from_u128(1),
            fingerprint: "projection-set-sha256:x".into(),
            revision: 3,
        };
        let d = Some(Uuid::from_u128(9));
        let ok = VerifyFacts {
            space_writable: true,
            total: 2,
            succeeded: 2,
            head: Some(head.clone()),
            ..VerifyFacts::default()
        };
        let empty = VerifyFacts {
            total: 0,
            succeeded: 0,
            head: None,
            ..ok.clone()
        };
        let table: Vec<(VerifyFacts, Result<Verdict, &str>)> = vec![
            (ok.clone(), Ok(Verdict::Published(head.clone()))),
            (empty.clone(), Ok(Verdict::Empty)),
            (
                VerifyFacts {
                    legacy_state: true,
                    ..empty.clone()
                },
                Err("null-generation"),
            ),
            (
                VerifyFacts {
                    unsnapshotted: d,
                    ..empty
                },
                Err("added after the bootstrap snapshot"),
            ),
            (
                VerifyFacts {
                    space_writable: false,
                    ..ok.clone()
                },
                Err("tenant scope"),
            ),
            (
                VerifyFacts {
                    succeeded: 1,
                    ..ok.clone()
                },
                Err("item count"),
            ),
            (
                VerifyFacts {
                    changed: d,
                    ..ok.clone()
                },
                Err("snapshot changed"),
            ),
            (
                VerifyFacts {
                    head: None,
                    ..ok.clone()
                },
                Err("no current published head"),
            ),
            (
                VerifyFacts {
                    missing_corpus: d,
                    missing_dense: d,
                    ..ok.clone()
                },
                Err("PageIndex and FTS corpus"),
            ),
            (
                VerifyFacts {
                    missing_dense: d,
                    ..ok.clone()
                },
                Err("dense vector space"),
            ),
            (
                VerifyFacts {
                    unpaired: d,
                    ..ok.clone()
                },
                Err("without both ready FTS"),
            ),
            (
                VerifyFacts {
                    invalid_member: d,
                    ..ok
                },
                Err("ownerless component"),
            ),
        ];
        for (f, want) in table {
            let v = verify(&f);
            match want {
                Ok(w) => assert_eq!(v, w, "{f:?}"),
                Err(w) => match &v {
                    Verdict::Refused(m) => assert!(m.contains(w), "{f:?}: {m}"),
                    other => panic!("{f:?}: {other:?}"),
                },
            }
            match (after_verify(&v), &v) {
                (Ok(Step::Succeed(cp)), Verdict::Empty | Verdict::Published(_)) => {
                    assert_eq!(cp, "published")
                }
                (Err(e), Verdict::Refused(m)) => {
                    assert_eq!((e.code(), e.message()), (PROCESSING_FAILED, m.as_str()))
                }
                other => panic!("{other:?}"),
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
            (SnapshotCaptured, Verifying, true),
            (SnapshotCaptured, Published, false),
            (Rebuilding, Verifying, true),
            (Rebuilding, SnapshotCaptured, false),
            (Verifying, Published, true),
            (Verifying, Rebuilding, false),
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
    fn every_decision_is_an_allowed_move() {
        let events = [
            items(1, 0, 1, 0, 0, 0),
            items(0, 0, 0, 0, 0, 0),
            items(0, 0, 0, 0, 1, 0),
            items(0, 1, 0, 0, 1, 0),
        ];
        for cp in [SnapshotCaptured, Rebuilding] {
            for ev in &events {
                if let Ok(Step::Advance(to) | Step::Succeed(to)) =
                    after_items(cp, ev, Waits::default())
                {
                    let to = Checkpoint::parse(&to).unwrap();
                    assert!(allowed(cp, to), "{cp:?} -> {to:?}");
                }
            }
        }
        assert!(allowed(Verifying, Checkpoint::parse("published").unwrap()));
    }
}
