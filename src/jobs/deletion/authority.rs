//! The authority a deletion job runs on, re-checked at every step, and the content-scope rule a
//! request under a capability grant applies to a source. Invariant: fail closed — a step goes on
//! only for a job whose row records one whole authority and, when that is a capability grant,
//! whose grant the platform's fence ([`crate::capability::check`]) finds active in an unfenced
//! space, in the step's own transaction (share-locked until it commits); anything else is a fatal
//! error raised before the step writes a row. The decisions are pure functions.

use serde_json::Value;
use sqlx::PgConnection;

use super::JobRow;
use crate::access::Authority;
use crate::capability::{self, Verdict};
use crate::jobs::JobError;

/// The code a job fails with when its capability grant no longer authorizes it (the platform's).
pub const CAPABILITY_REVOKED: &str = "CAPABILITY_REVOKED";
/// Its message, stored as is (the platform's).
pub const CAPABILITY_REVOKED_MESSAGE: &str =
    "Durable deletion capability grant is no longer active";
/// The code a job fails with when its row records no coherent authority.
pub const AUTHORITY_INVALID: &str = "authority_invalid";

/// Checks the job's authority in the step's transaction; `Err` is fatal.
pub(super) async fn fence(tx: &mut PgConnection, job: &JobRow) -> Result<(), JobError> {
    let verdict = match &job.authority {
        Ok(Authority::Grant(grant)) => {
            Some(capability::check(tx, &job.tenant, job.space, *grant).await?)
        }
        _ => None,
    };
    decide(&job.authority, verdict.as_ref())
}

/// Whether a step may go on, given the job's recorded authority and, for a grant, what the fence
/// found. Pure.
fn decide(
    authority: &Result<Authority, String>,
    verdict: Option<&Verdict>,
) -> Result<(), JobError> {
    match (authority, verdict) {
        (Err(why), _) => Err(JobError::fatal(AUTHORITY_INVALID, why.clone())),
        (Ok(Authority::Snapshot { .. }), _) => Ok(()),
        (Ok(Authority::Internal), _) => Err(JobError::fatal(
            AUTHORITY_INVALID,
            "the job records neither a permission snapshot nor a capability grant",
        )),
        (Ok(Authority::Grant(_)), Some(Verdict::Active(_))) => Ok(()),
        (Ok(Authority::Grant(_)), _) => Err(JobError::fatal(
            CAPABILITY_REVOKED,
            CAPABILITY_REVOKED_MESSAGE,
        )),
    }
}

/// Whether content with permission scope `content` (a JSON array of tokens) may be touched under
/// a grant admitting `granted` (the grant's `content_scope_ids`): every scope of the content must
/// be granted (an empty scope is visible in the whole space); a malformed scope on either side
/// denies. The platform's candidate permission-scope rule. Pure.
pub(super) fn scope_allows(content: &Value, granted: &Value) -> bool {
    let Some(granted) = granted.as_array() else {
        return false;
    };
    let mut tokens = Vec::with_capacity(granted.len());
    for g in granted {
        match capability::scope_token(g) {
            Some(t) => tokens.push(t),
            None => return false,
        }
    }
    let Some(content) = content.as_array() else {
        return false;
    };
    content
        .iter()
        .all(|c| capability::scope_token(c).is_some_and(|t| tokens.contains(&t)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capability::Grant;
    use serde_json::json;
    use uuid::Uuid;

    #[test]
    fn a_step_goes_on_only_under_a_whole_snapshot_or_an_active_grant() {
        let snapshot = Ok(Authority::Snapshot {
            subject: "s".into(),
            snapshot: Uuid::nil(),
            revision: 1,
            channel: "interactive".into(),
        });
        let grant = Ok(Authority::Grant(Uuid::nil()));
        let active = Verdict::Active(Grant {
            subject_id: "s".into(),
            content_scope_ids: json!([]),
        });
        let revoked = Verdict::Revoked("capability grant x is revoked".into());
        // (authority, verdict, the code it fails with)
        type Case<'a> = (
            Result<Authority, String>,
            Option<&'a Verdict>,
            Option<&'a str>,
        );
        let table: Vec<Case> = vec![
            (snapshot.clone(), None, None),
            (grant.clone(), Some(&active), None),
            (grant.clone(), Some(&revoked), Some(CAPABILITY_REVOKED)),
            (
                grant.clone(),
                Some(&Verdict::Fenced),
                Some(CAPABILITY_REVOKED),
            ),
            (grant, None, Some(CAPABILITY_REVOKED)),
            (Ok(Authority::Internal), None, Some(AUTHORITY_INVALID)),
            (Err("a mix".into()), Some(&active), Some(AUTHORITY_INVALID)),
        ];
        for (authority, verdict, want) in table {
            let got = decide(&authority, verdict);
            match (want, got) {
                (None, Ok(())) => {}
                (Some(code), Err(JobError::Fatal { code: c, message })) => {
                    assert_eq!(c, code, "{authority:?} {verdict:?}");
                    if code == CAPABILITY_REVOKED {
                        assert_eq!(message, CAPABILITY_REVOKED_MESSAGE);
                    }
                }
                (want, got) => panic!("{authority:?} {verdict:?}: want {want:?}, got {got:?}"),
            }
        }
    }

    #[test]
    fn content_is_allowed_only_when_every_scope_is_granted_and_well_formed() {
        let g = json!(["tenant:t", "source:camera"]);
        let long = "x".repeat(513);
        let table = [
            (json!([]), g.clone(), true),
            (json!(["tenant:t"]), g.clone(), true),
            (json!(["tenant:t", "source:camera"]), g.clone(), true),
            (json!(["source:other"]), g.clone(), false),
            (json!(["tenant:t", "source:other"]), g.clone(), false),
            (json!([" tenant:t"]), g.clone(), false),
            (json!([""]), g.clone(), false),
            (json!([1]), g.clone(), false),
            (json!({}), g.clone(), false),
            (json!(null), g.clone(), false),
            (json!([long]), g.clone(), false),
            (json!([]), json!({}), false),
            (json!([]), json!(["ok", " padded"]), false),
            (json!([]), json!([]), true),
        ];
        for (content, granted, want) in table {
            assert_eq!(
                scope_allows(&content, &granted),
                want,
                "{content} under {granted}"
            );
        }
    }
}
