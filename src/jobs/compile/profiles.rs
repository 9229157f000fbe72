//! The profile tuple of a compile attempt (the platform's 0019): the space's active embedding and
//! retrieval profile revisions, frozen into the attempt's eight `*_profile_*` columns when it is
//! requested (or, for an attempt written without them, when its first step runs), used by every
//! later step, and fenced again in the publishing transaction. Invariant: an attempt compiles
//! only under a frozen retrieval profile, builds with the frozen embedding profile (or none), and
//! publishes only while the space's profile heads are still exactly that tuple — the retrieval
//! head at the frozen revision with the same digest, active; the embedding head likewise with a
//! vector space, or no embedding head at all when none was frozen. The decisions are the pure
//! functions [`freeze`], [`ready`] and [`fence`].

use sqlx::PgConnection;
use uuid::Uuid;

use crate::publication::binding::{Embedding, ProfileRef, Tuple};

/// The code of a compilation that fails without a more specific one (the platform's default
/// classification of a publish-time refusal).
pub const COMPILATION_FAILED: &str = "DOCUMENT_COMPILATION_FAILED";
/// A space without a retrieval profile cannot compile.
pub const CONFIGURATION_REQUIRED: &str = "KNOWLEDGE_SPACE_MODEL_CONFIGURATION_REQUIRED";
/// A fast or deep retrieval profile without the embedding profile it needs.
pub const ACTIVATION_INCOMPLETE: &str = "MODEL_PROFILE_ACTIVATION_INCOMPLETE";
/// The attempt's frozen profiles are missing or no longer stored.
pub const SNAPSHOT_INVALID: &str = "DOCUMENT_COMPILATION_PROFILE_SNAPSHOT_INVALID";
/// The frozen profiles could not be written onto the attempt.
pub const BIND_FAILED: &str = "MODEL_PROFILE_BIND_FAILED";

/// The profile references an attempt froze.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frozen {
    pub retrieval: ProfileRef,
    pub embedding: Option<ProfileRef>,
}

/// A profile head of the space, with the revision it names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Head {
    /// `embedding` or `retrieval`.
    pub kind: String,
    /// The head's revision id and number, and that revision's snapshot digest.
    pub profile: ProfileRef,
    /// The named revision's state.
    pub state: String,
    pub vector_space_id: Option<String>,
    /// A retrieval revision's `defaultMode` (`research`, `fast`, `deep`).
    pub default_mode: Option<String>,
}

/// What the space's profile heads freeze into a new attempt, the platform's way: no active
/// heads, or an embedding head alone (the initial activation's intermediate state), freeze
/// nothing; an active retrieval head freezes with the active embedding head if there is one.
/// `Err` for any other set. Pure.
pub fn freeze(heads: &[Head]) -> Result<Option<Frozen>, String> {
    let active: Vec<&Head> = heads.iter().filter(|h| h.state == "active").collect();
    let of = |kind: &str| -> Result<Option<&Head>, String> {
        let mut it = active.iter().filter(|h| h.kind == kind);
        let first = it.next().copied();
        if it.next().is_some() {
            return Err(format!(
                "the space has more than one active {kind} profile head"
            ));
        }
        Ok(first)
    };
    let (embedding, retrieval) = (of("embedding")?, of("retrieval")?);
    if active
        .iter()
        .any(|h| h.kind != "embedding" && h.kind != "retrieval")
    {
        return Err("the space has a profile head of an unknown kind".into());
    }
    match (retrieval, embedding) {
        (None, _) => Ok(None),
        (Some(r), e) => Ok(Some(Frozen {
            retrieval: r.profile.clone(),
            embedding: e.map(|e| e.profile.clone()),
        })),
    }
}

/// What the first step does about the attempt's profiles.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ready {
    /// The attempt froze its profiles when it was requested.
    Keep,
    /// Write the space's current tuple onto the attempt (the platform's `bindInitialProfiles`).
    Bind(Frozen),
    /// The attempt fails, not to be retried.
    Fail { code: &'static str, message: String },
}

/// The platform's `ensureReady`: an attempt with a frozen retrieval profile goes on; one without
/// gets the space's current tuple, if the space has one (a fast or deep retrieval profile needs
/// an embedding profile beside it); a space without a retrieval profile cannot compile. Pure.
pub fn ready(attempt: Option<&Frozen>, heads: &[Head]) -> Ready {
    if attempt.is_some() {
        return Ready::Keep;
    }
    match freeze(heads) {
        Ok(Some(f)) => {
            let mode = heads
                .iter()
                .find(|h| h.kind == "retrieval" && h.state == "active")
                .and_then(|h| h.default_mode.as_deref());
            if f.embedding.is_none() && matches!(mode, Some("fast" | "deep")) {
                Ready::Fail {
                    code: ACTIVATION_INCOMPLETE,
                    message: format!(
                        "the space's {} retrieval profile needs an embedding profile, and it has none",
                        mode.unwrap_or_default()
                    ),
                }
            } else {
                Ready::Bind(f)
            }
        }
        Ok(None) => Ready::Fail {
            code: CONFIGURATION_REQUIRED,
            message: "the knowledge space has no active retrieval profile; configure its models \
                      before compiling documents"
                .into(),
        },
        Err(why) => Ready::Fail {
            code: CONFIGURATION_REQUIRED,
            message: why,
        },
    }
}

/// The platform's publish-time profile fence: the verified tuple to bind the publication to, or
/// why the attempt lost its frozen profiles. Pure.
pub fn fence(frozen: Option<&Frozen>, heads: &[Head]) -> Result<Tuple, String> {
    let f = frozen.ok_or("the attempt froze no retrieval profile")?;
    let head = |kind: &str| heads.iter().find(|h| h.kind == kind);
    let matches = |h: &Head, r: &ProfileRef| h.profile == *r && h.state == "active";
    match head("retrieval") {
        Some(h) if matches(h, &f.retrieval) => {}
        Some(h) => {
            return Err(format!(
            "the space's retrieval profile is now revision {} ({}), the attempt froze revision {}",
            h.profile.revision, h.state, f.retrieval.revision
        ))
        }
        None => return Err("the space no longer has a retrieval profile".into()),
    }
    let embedding = match (&f.embedding, head("embedding")) {
        (None, None) => None,
        (None, Some(h)) => {
            return Err(format!(
                "the space gained embedding profile revision {} after the attempt froze none",
                h.profile.revision
            ))
        }
        (Some(_), None) => return Err("the space no longer has an embedding profile".into()),
        (Some(e), Some(h)) if matches(h, e) => match &h.vector_space_id {
            Some(vsid) => Some(Embedding {
                profile: e.clone(),
                vector_space_id: vsid.clone(),
            }),
            None => return Err("the embedding profile revision has no vector space".into()),
        },
        (Some(e), Some(h)) => {
            return Err(format!(
            "the space's embedding profile is now revision {} ({}), the attempt froze revision {}",
            h.profile.revision, h.state, e.revision
        ))
        }
    };
    Ok(Tuple {
        retrieval: f.retrieval.clone(),
        embedding,
    })
}

/// The space's profile heads joined to the revisions they name, locked: the heads `FOR UPDATE`
/// in kind order, as the platform locks them; the revisions they name only `FOR SHARE`, which
/// keeps them as they are and still lets the foreign-key checks of other attempts' writes
/// (`FOR KEY SHARE` of the revisions their profile columns name) through. (Locked `FOR UPDATE`
/// too, every write to another attempt of the space that checks its profile keys waited for the
/// whole of a publish: two thirds of a bulk upload's database time.)
pub async fn heads(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<Vec<Head>, sqlx::Error> {
    type Row = (
        String,
        Uuid,
        i32,
        String,
        String,
        Option<String>,
        Option<String>,
    );
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT h.kind::text, h.profile_revision_id, h.active_revision, r.snapshot_digest::text, r.state::text, \
           r.vector_space_id::text, r.snapshot ->> 'defaultMode' \
         FROM knowledge_space_profile_heads h \
         JOIN knowledge_space_profile_revisions r ON r.tenant_id = h.tenant_id \
           AND r.knowledge_space_id = h.knowledge_space_id AND r.kind = h.kind AND r.id = h.profile_revision_id \
           AND r.revision = h.active_revision \
         WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2 AND h.kind IN ('embedding', 'retrieval') \
         ORDER BY h.kind FOR UPDATE OF h FOR SHARE OF r",
    )
    .bind(tenant)
    .bind(space)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(
            |(kind, revision_id, revision, digest, state, vector_space_id, default_mode)| Head {
                kind,
                profile: ProfileRef {
                    revision_id,
                    revision,
                    digest,
                },
                state,
                vector_space_id,
                default_mode,
            },
        )
        .collect())
}

/// The attempt's frozen references from its eight columns; `Err` when they are not one whole
/// retrieval reference with at most one whole embedding reference (the platform's CHECKs). Pure.
#[allow(clippy::type_complexity)]
pub fn from_columns(
    embedding: (Option<String>, Option<Uuid>, Option<i32>, Option<String>),
    retrieval: (Option<String>, Option<Uuid>, Option<i32>, Option<String>),
) -> Result<Option<Frozen>, String> {
    let one =
        |kind: &str,
         (k, id, rev, digest): (Option<String>, Option<Uuid>, Option<i32>, Option<String>)|
         -> Result<Option<ProfileRef>, String> {
            match (k, id, rev, digest) {
                (None, None, None, None) => Ok(None),
                (Some(k), Some(revision_id), Some(revision), Some(digest)) if k == kind => {
                    Ok(Some(ProfileRef {
                        revision_id,
                        revision,
                        digest,
                    }))
                }
                _ => Err(format!(
                    "the attempt's {kind} profile reference is incomplete"
                )),
            }
        };
    match (one("retrieval", retrieval)?, one("embedding", embedding)?) {
        (None, None) => Ok(None),
        (Some(retrieval), embedding) => Ok(Some(Frozen {
            retrieval,
            embedding,
        })),
        (None, Some(_)) => {
            Err("the attempt froze an embedding profile without a retrieval one".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(n: u128, revision: i32) -> ProfileRef {
        ProfileRef {
            revision_id: Uuid::from_u128(n),
            revision,
            digest: format!("{n:064x}"),
        }
    }

    fn head(kind: &str, p: ProfileRef, state: &str) -> Head {
        Head {
            kind: kind.into(),
            profile: p,
            state: state.into(),
            vector_space_id: (kind == "embedding").then(|| "embedding-space-sha256:v".into()),
            default_mode: (kind == "retrieval").then(|| "research".into()),
        }
    }

    #[test]
    fn a_retrieval_head_freezes_with_the_embedding_head_and_nothing_else_freezes() {
        let e = head("embedding", r(1, 1), "active");
        let ret = head("retrieval", r(2, 1), "active");
        let both = Frozen {
            retrieval: r(2, 1),
            embedding: Some(r(1, 1)),
        };
        let only_r = Frozen {
            retrieval: r(2, 1),
            embedding: None,
        };
        type Case = (Vec<Head>, Result<Option<Frozen>, ()>);
        let table: Vec<Case> = vec![
            (vec![], Ok(None)),
            (vec![e.clone()], Ok(None)),
            (vec![ret.clone()], Ok(Some(only_r.clone()))),
            (vec![e.clone(), ret.clone()], Ok(Some(both))),
            (
                vec![head("embedding", r(1, 1), "superseded"), ret.clone()],
                Ok(Some(only_r)),
            ),
            (vec![head("retrieval", r(2, 1), "candidate")], Ok(None)),
            (vec![ret.clone(), ret.clone()], Err(())),
        ];
        for (heads, want) in table {
            assert_eq!(freeze(&heads).map_err(|_| ()), want, "{heads:?}");
        }
    }

    #[test]
    fn the_first_step_binds_the_current_heads_or_fails_a_space_without_retrieval() {
        let frozen = Frozen {
            retrieval: r(2, 1),
            embedding: None,
        };
        let ret = head("retrieval", r(2, 1), "active");
        let mut fast = ret.clone();
        fast.default_mode = Some("fast".into());
        let e = head("embedding", r(1, 1), "active");
        assert_eq!(ready(Some(&frozen), &[]), Ready::Keep);
        assert_eq!(
            ready(None, std::slice::from_ref(&ret)),
            Ready::Bind(frozen.clone())
        );
        assert_eq!(
            ready(None, &[e.clone(), fast.clone()]),
            Ready::Bind(Frozen {
                retrieval: r(2, 1),
                embedding: Some(r(1, 1)),
            })
        );
        for (heads, code) in [
            (vec![], CONFIGURATION_REQUIRED),
            (vec![e], CONFIGURATION_REQUIRED),
            (vec![fast], ACTIVATION_INCOMPLETE),
        ] {
            match ready(None, &heads) {
                Ready::Fail { code: c, .. } => assert_eq!(c, code, "{heads:?}"),
                other => panic!("{heads:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_publish_fence_holds_only_for_the_exact_frozen_tuple() {
        let ret = head("retrieval", r(2, 1), "active");
        let emb = head("embedding", r(1, 1), "active");
        let f_r = Frozen {
            retrieval: r(2, 1),
            embedding: None,
        };
        let f_re = Frozen {
            retrieval: r(2, 1),
            embedding: Some(r(1, 1)),
        };
        let mut no_vs = emb.clone();
        no_vs.vector_space_id = None;
        let mut other_digest = ret.clone();
        other_digest.profile.digest = "f".repeat(64);
        // (frozen, heads now, fence holds)
        let table: Vec<(Option<&Frozen>, Vec<Head>, bool)> = vec![
            (Some(&f_r), vec![ret.clone()], true),
            (Some(&f_re), vec![emb.clone(), ret.clone()], true),
            (None, vec![ret.clone()], false),
            (Some(&f_r), vec![], false),
            (
                Some(&f_r),
                vec![head("retrieval", r(3, 2), "active")],
                false,
            ),
            (
                Some(&f_r),
                vec![head("retrieval", r(2, 1), "superseded")],
                false,
            ),
            (Some(&f_r), vec![other_digest], false),
            (Some(&f_r), vec![emb.clone(), ret.clone()], false),
            (Some(&f_re), vec![ret.clone()], false),
            (
                Some(&f_re),
                vec![head("embedding", r(4, 2), "active"), ret.clone()],
                false,
            ),
            (Some(&f_re), vec![no_vs, ret.clone()], false),
        ];
        for (frozen, heads, holds) in table {
            let got = fence(frozen, &heads);
            assert_eq!(got.is_ok(), holds, "{frozen:?} {heads:?}: {got:?}");
        }
        let t = fence(Some(&f_re), &[emb, ret]).unwrap();
        assert_eq!(
            t.embedding.unwrap().vector_space_id,
            "embedding-space-sha256:v"
        );
    }

    #[test]
    fn attempt_columns_bind_one_whole_tuple_or_none() {
        let none = (None, None, None, None);
        let e = (
            Some("embedding".to_owned()),
            Some(Uuid::from_u128(1)),
            Some(1),
            Some("d".to_owned()),
        );
        let ret = (
            Some("retrieval".to_owned()),
            Some(Uuid::from_u128(2)),
            Some(1),
            Some("d".to_owned()),
        );
        assert_eq!(from_columns(none.clone(), none.clone()), Ok(None));
        assert!(from_columns(none.clone(), ret.clone()).unwrap().is_some());
        assert!(from_columns(e.clone(), ret.clone())
            .unwrap()
            .unwrap()
            .embedding
            .is_some());
        assert!(from_columns(e.clone(), none.clone()).is_err());
        assert!(from_columns(none.clone(), (ret.0.clone(), None, Some(1), None)).is_err());
        assert!(from_columns(ret.clone(), e.clone()).is_err());
    }
}
