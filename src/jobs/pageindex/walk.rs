//! The page-index upgrade backfill's decisions as pure functions, with the platform's codes and
//! messages. Invariant: an item is built only in a writable space with no live document
//! mutation lease; a job completes only against the very head it froze (publication,
//! fingerprint, head revision) and only once every frozen item succeeded and the counts agree;
//! a moved head supersedes the job; a pending item whose outline no longer joins is a
//! verification failure, never mistaken for an empty job.

use uuid::Uuid;

use crate::jobs::JobError;

/// The code of a lost fence or a transition that found the row moved on.
pub const TRANSITION_CONFLICT: &str = "TRANSITION_CONFLICT";
/// The code of a frozen closure that does not verify.
pub const VERIFICATION: &str = "PageIndexUpgradeBackfillVerificationError";
/// The code of a build that did not leave its exact rows.
pub const BUILD: &str = "Error";
/// The code of a job whose head moved before cutover.
pub const HEAD_CHANGED: &str = "HEAD_CHANGED";
pub const HEAD_CHANGED_MESSAGE: &str = "Published head changed before PageIndex upgrade cutover";
/// What the platform records for any other failure.
pub const FAILED: &str = "BACKFILL_FAILED";

/// The codes the kind records as they are; every other failure is recorded as [`FAILED`].
pub const CODES: [&str; 4] = [TRANSITION_CONFLICT, VERIFICATION, BUILD, HEAD_CHANGED];

/// The space, as the step finds it under its lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Space {
    Missing,
    /// Being deleted (`deletion_job_id` set, or not `active`).
    Deleting,
    Writable,
}

/// What one step found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Facts {
    pub space: Space,
    /// The first pending item whose outline joins, by ordinal.
    pub next_item: Option<Uuid>,
    /// Some item is still pending (joinable or not).
    pub any_pending: bool,
    /// Another holder's document mutation lease on the space has not expired.
    pub mutation_lease_live: bool,
}

/// What the step does.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// Build the page index of this outline item.
    Build(Uuid),
    /// Nothing pending: verify against the head and cut over.
    Complete,
    /// Come back later, without failing.
    Wait(&'static str),
    /// The space is being deleted: the job ends superseded, as the deletion's quiescing ends it.
    Fenced,
}

pub fn plan(f: &Facts) -> Result<Plan, JobError> {
    match f.space {
        Space::Missing => {
            return Err(JobError::fatal(
                TRANSITION_CONFLICT,
                "Knowledge space was not found",
            ))
        }
        Space::Deleting => return Ok(Plan::Fenced),
        Space::Writable => {}
    }
    match (f.next_item, f.any_pending) {
        (Some(_), _) if f.mutation_lease_live => {
            Ok(Plan::Wait("a document mutation lease on the space is live"))
        }
        (Some(item), _) => Ok(Plan::Build(item)),
        (None, true) => Err(JobError::fatal(
            VERIFICATION,
            "Frozen PageIndex backfill outline closure is missing",
        )),
        (None, false) => Ok(Plan::Complete),
    }
}

/// The head a job froze, or the space's current head: publication, fingerprint, revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeadRef {
    pub publication_id: Uuid,
    pub fingerprint: String,
    pub head_revision: i32,
}

/// Completion goes on only against the frozen head; otherwise the job is superseded.
pub fn head_unchanged(frozen: &HeadRef, current: Option<&HeadRef>) -> bool {
    current == Some(frozen)
}

/// The item counts at completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counts {
    pub items: i64,
    pub succeeded: i64,
    pub completed_items: i32,
    pub total_items: i32,
}

/// Every frozen item succeeded and the job's counters agree with its ledger.
pub fn check_counts(c: &Counts) -> Result<(), JobError> {
    let total = i64::from(c.total_items);
    if c.items != total || c.succeeded != total || c.completed_items != c.total_items {
        return Err(JobError::fatal(
            VERIFICATION,
            "PageIndex upgrade cannot complete before every frozen item succeeds",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(r: Result<Plan, JobError>) -> String {
        match r {
            Ok(p) => format!("{p:?}"),
            Err(JobError::Fatal { code, .. } | JobError::Retryable { code, .. }) => code,
        }
    }

    #[test]
    fn plans_follow_the_space_the_items_and_the_mutation_lease() {
        let item = Uuid::from_u128(7);
        let f = |space, next_item, any_pending, mutation_lease_live| Facts {
            space,
            next_item,
            any_pending,
            mutation_lease_live,
        };
        let cases = [
            (
                f(Space::Missing, Some(item), true, false),
                TRANSITION_CONFLICT.to_owned(),
            ),
            (
                f(Space::Deleting, Some(item), true, true),
                "Fenced".to_owned(),
            ),
            (
                f(Space::Writable, Some(item), true, false),
                format!("Build({item})"),
            ),
            (
                f(Space::Writable, Some(item), true, true),
                "Wait(\"a document mutation lease on the space is live\")".to_owned(),
            ),
            (
                f(Space::Writable, None, true, false),
                VERIFICATION.to_owned(),
            ),
            (
                f(Space::Writable, None, true, true),
                VERIFICATION.to_owned(),
            ),
            (f(Space::Writable, None, false, true), "Complete".to_owned()),
            (
                f(Space::Writable, None, false, false),
                "Complete".to_owned(),
            ),
        ];
        for (facts, want) in cases {
            assert_eq!(code(plan(&facts)), want, "{facts:?}");
        }
    }

    #[test]
    fn only_the_frozen_head_lets_a_job_complete() {
        let frozen = HeadRef {
            publication_id: Uuid::from_u128(1),
            fingerprint: "sha256:a".into(),
            head_revision: 3,
        };
        let moved = |f: fn(&mut HeadRef)| {
            let mut h = frozen.clone();
            f(&mut h);
            h
        };
        assert!(head_unchanged(&frozen, Some(&frozen.clone())));
        assert!(!head_unchanged(&frozen, None));
        assert!(!head_unchanged(
            &frozen,
            Some(&moved(|h| h.head_revision = 4))
        ));
        assert!(!head_unchanged(
            &frozen,
            Some(&moved(|h| h.fingerprint = "sha256:b".into()))
        ));
        assert!(!head_unchanged(
            &frozen,
            Some(&moved(|h| h.publication_id = Uuid::from_u128(2)))
        ));
    }

    #[test]
    fn completion_needs_every_frozen_item_and_agreeing_counters() {
        let c = |items, succeeded, completed_items, total_items| Counts {
            items,
            succeeded,
            completed_items,
            total_items,
        };
        assert!(check_counts(&c(3, 3, 3, 3)).is_ok());
        assert!(check_counts(&c(0, 0, 0, 0)).is_ok());
        for bad in [
            c(3, 2, 3, 3), // an item still pending
            c(2, 2, 2, 3), // a member without an outline got no item
            c(3, 3, 2, 3), // the counter lags the ledger
            c(4, 4, 3, 3), // more items than frozen
        ] {
            assert!(
                matches!(check_counts(&bad), Err(JobError::Fatal { ref code, .. }) if code == VERIFICATION),
                "{bad:?}"
            );
        }
    }
}
