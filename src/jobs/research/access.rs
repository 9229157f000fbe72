//! Whether a task may read its space, decided the platform's way. Invariant: fail closed. A task
//! acts on the one authority its row records ([`crate::access::Authority`]), and a request and
//! every step check it in the same transaction as the work it guards, with what they read
//! share-locked so that a revocation waits for that transaction and is seen by the next one:
//! a permission snapshot is revalidated with the platform's own statement
//! ([`crate::access::revalidate`]: active, unrevoked, unexpired, and still matching the space's
//! member, access policy, API access and API key), and a step also requires the revision the
//! task was requested under (`RESEARCH_TASK_PERMISSION_SNAPSHOT_INVALID`); a capability grant
//! goes through the platform's capability fence ([`crate::capability::check`]: active in the
//! task's tenant and space, the space not fenced; `RESEARCH_TASK_CAPABILITY_REVOKED`). A row
//! that records no authority, or a mix, authorizes nothing. What a task may read is what its
//! authority's scopes cover ([`reader_scopes`]), and the subject it acts for is the snapshot's
//! or the grant's. A snapshot denial is explained from the snapshot row, but only revalidation
//! grants. The deletion fence is read in the same way: a space being deleted stops every task in
//! it. Tasks stepped in one transaction share these reads ([`Reads`]): the locks make a second
//! read return what the first did.

use std::collections::HashMap;

use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

pub use crate::access::{Authority, Valid};
use crate::capability::{self, Verdict};

/// The platform's error of a task whose snapshot no longer grants access.
pub const SNAPSHOT_INVALID: &str = "RESEARCH_TASK_PERMISSION_SNAPSHOT_INVALID";
/// The platform's error of a task whose capability grant no longer authorizes it.
pub const CAPABILITY_REVOKED: &str = "RESEARCH_TASK_CAPABILITY_REVOKED";
pub use crate::capability::MAX_SCOPE_UNITS;

/// What a task's authority lets a step do: act for `subject_id` and read content whose every
/// permission scope is among `scopes`.
#[derive(Clone, Debug, PartialEq)]
pub struct Authorized {
    pub subject_id: String,
    /// The snapshot's `permission_scopes` or the grant's `content_scope_ids`, as stored.
    pub scopes: Value,
    /// The grant, when that is the authority.
    pub grant: Option<Uuid>,
}

/// Why a task's authority no longer stands: the platform's code, and what was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denial {
    pub code: &'static str,
    pub why: String,
}

impl Denial {
    fn snapshot(why: impl Into<String>) -> Self {
        Self {
            code: SNAPSHOT_INVALID,
            why: why.into(),
        }
    }

    fn capability(why: impl Into<String>) -> Self {
        Self {
            code: CAPABILITY_REVOKED,
            why: why.into(),
        }
    }
}

/// What the capability fence's verdict lets a task do. Pure.
pub fn granted_by(grant: Uuid, verdict: Verdict) -> Result<Authorized, Denial> {
    match verdict {
        Verdict::Active(g) => Ok(Authorized {
            subject_id: g.subject_id,
            scopes: g.content_scope_ids,
            grant: Some(grant),
        }),
        other => Err(Denial::capability(
            other.into_result().err().unwrap_or_default(),
        )),
    }
}

/// The reader's scopes as the platform normalizes them before matching content: an array of
/// strings, each 1 to [`MAX_SCOPE_UNITS`] long and without surrounding whitespace, deduplicated.
/// `None` for anything else: then, as on the platform, no content at all may be read. With
/// well-formed reader scopes, matching "every scope of the content is among them" by JSON
/// containment refuses content with a malformed scope, as the platform does. Pure.
pub fn reader_scopes(scopes: &Value) -> Option<Value> {
    let mut out: Vec<&str> = Vec::new();
    for s in scopes.as_array()? {
        let s = capability::scope_token(s)?;
        if !out.contains(&s) {
            out.push(s);
        }
    }
    Some(Value::from(out))
}
/// The platform's cancel reason of a task whose space is being deleted.
pub const DELETION_FENCE_ACTIVE: &str = "RESEARCH_TASK_DELETION_FENCE_ACTIVE";

/// The fields of a permission snapshot that explain a denial.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotRow {
    pub tenant_id: String,
    pub space_id: Uuid,
    pub subject_id: String,
    pub access_channel: String,
    pub revision: i32,
    pub status: String,
    pub revoked: bool,
    pub expired: bool,
}

/// What the snapshot must be.
#[derive(Clone, Copy, Debug)]
pub struct Expected<'a> {
    pub tenant_id: &'a str,
    pub space_id: Uuid,
    pub snapshot_id: Uuid,
    pub subject_id: &'a str,
    pub access_channel: &'a str,
    /// The revision the job was requested under; `None` at request time.
    pub revision: Option<i32>,
}

/// Why a snapshot row does not grant `want`, as far as the row itself tells; `None` when the row
/// looks valid (then what changed is the space's members, policy, API access or key). Pure.
pub fn snapshot_denial(row: Option<&SnapshotRow>, want: &Expected<'_>) -> Option<String> {
    let Some(s) = row else {
        return Some("the permission snapshot does not exist in this tenant".into());
    };
    if s.tenant_id != want.tenant_id {
        return Some("the permission snapshot does not exist in this tenant".into());
    }
    if s.space_id != want.space_id {
        return Some("the permission snapshot belongs to another knowledge space".into());
    }
    if s.subject_id != want.subject_id {
        return Some("the permission snapshot was issued to another subject".into());
    }
    if s.access_channel != want.access_channel {
        return Some(format!(
            "the permission snapshot is for the {} channel, not {}",
            s.access_channel, want.access_channel
        ));
    }
    if s.revoked || s.status == "revoked" {
        return Some("the permission snapshot is revoked".into());
    }
    if s.expired || s.status == "expired" {
        return Some("the permission snapshot has expired".into());
    }
    if s.status != "active" {
        return Some(format!(
            "the permission snapshot is {}, not active",
            s.status
        ));
    }
    if let Some(r) = want.revision {
        if s.revision != r {
            return Some(format!(
                "the permission snapshot changed (revision {} now, {r} when the task was requested)",
                s.revision
            ));
        }
    }
    None
}

/// Whether a revalidated snapshot grants `want`: the platform's revalidation found it, at the
/// revision the task was requested under. Pure.
pub fn granted(valid: Option<&Valid>, want: &Expected<'_>) -> bool {
    valid.is_some_and(|v| want.revision.is_none_or(|r| r == v.revision))
}

/// Reads a snapshot by id within a tenant (to explain a denial).
pub async fn read_snapshot(
    conn: &mut PgConnection,
    tenant_id: &str,
    snapshot_id: Uuid,
) -> Result<Option<SnapshotRow>, sqlx::Error> {
    type Row = (String, Uuid, String, String, i32, String, bool, bool);
    let row: Option<Row> = sqlx::query_as(
        "SELECT tenant_id, knowledge_space_id, subject_id, access_channel, revision, status, \
           revoked_at IS NOT NULL, expires_at <= now() \
         FROM knowledge_space_permission_snapshots WHERE tenant_id = $1 AND id = $2",
    )
    .bind(tenant_id)
    .bind(snapshot_id)
    .fetch_optional(conn)
    .await?;
    Ok(row.map(
        |(tenant_id, space_id, subject_id, access_channel, revision, status, revoked, expired)| {
            SnapshotRow {
                tenant_id,
                space_id,
                subject_id,
                access_channel,
                revision,
                status,
                revoked,
                expired,
            }
        },
    ))
}

/// Revalidates the snapshot; `Err` explains the denial.
pub async fn revalidate(
    conn: &mut PgConnection,
    want: &Expected<'_>,
) -> Result<Result<Valid, String>, sqlx::Error> {
    let valid = platform_revalidate(conn, want).await?;
    decide(conn, valid, want).await
}

/// The platform's revalidation statement for `want`.
async fn platform_revalidate(
    conn: &mut PgConnection,
    want: &Expected<'_>,
) -> Result<Option<Valid>, sqlx::Error> {
    crate::access::revalidate(
        conn,
        want.tenant_id,
        want.space_id,
        want.snapshot_id,
        want.subject_id,
        want.access_channel,
    )
    .await
}

/// Grants what the platform's revalidation found, or explains the denial from the snapshot row.
async fn decide(
    conn: &mut PgConnection,
    valid: Option<Valid>,
    want: &Expected<'_>,
) -> Result<Result<Valid, String>, sqlx::Error> {
    if granted(valid.as_ref(), want) {
        return Ok(Ok(valid.expect("granted implies a row")));
    }
    let row = read_snapshot(conn, want.tenant_id, want.snapshot_id).await?;
    Ok(Err(snapshot_denial(row.as_ref(), want).unwrap_or_else(|| {
        "the permission snapshot no longer matches the space's members, access policy, API access or API key"
            .into()
    })))
}

/// What deletion is doing in a space.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Deletions {
    pub space_exists: bool,
    /// The space is marked `deleting`, or a live deletion job targets it.
    pub space_deleting: bool,
    /// A live deletion job (`active_slot = 1`) of any target in the space.
    pub active_job: Option<Uuid>,
}

/// What stops a task from going on, given the space's deletions: the platform's deletion fence
/// as kfs-worker applies it to a running task (see the module's notes in `mod.rs`). Pure.
pub fn running_fence(d: &Deletions) -> Option<String> {
    if !d.space_exists {
        return Some("the knowledge space no longer exists".into());
    }
    d.space_deleting
        .then(|| "the knowledge space is being deleted".into())
}

/// Why a new task may not be admitted, given the space's deletions. Pure.
pub fn admission_fence(d: &Deletions) -> Option<String> {
    if let Some(why) = running_fence(d) {
        return Some(why);
    }
    d.active_job
        .map(|j| format!("a deletion (job {j}) is in progress in the knowledge space"))
}

/// Reads the space's deletions, the space row share-locked.
pub async fn deletions(
    conn: &mut PgConnection,
    tenant_id: &str,
    space_id: Uuid,
) -> Result<Deletions, sqlx::Error> {
    let state: Option<String> = sqlx::query_scalar(
        "SELECT lifecycle_state::text FROM knowledge_spaces WHERE tenant_id = $1 AND id = $2 FOR SHARE",
    )
    .bind(tenant_id)
    .bind(space_id)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(state) = state else {
        return Ok(Deletions::default());
    };
    let jobs: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT id, target_type::text FROM deletion_jobs \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND active_slot = 1 ORDER BY id",
    )
    .bind(tenant_id)
    .bind(space_id)
    .fetch_all(conn)
    .await?;
    Ok(Deletions {
        space_exists: true,
        space_deleting: state == "deleting" || jobs.iter().any(|(_, t)| t == "knowledge_space"),
        active_job: jobs.first().map(|(id, _)| *id),
    })
}

/// The deletions, revalidations and capability checks one transaction has read, so that tasks stepped together in
/// it read each space's fence, each snapshot and each grant once. Sound because the first read
/// share-locks what it read until the transaction ends (the space row; the snapshot and the rows
/// its revalidation joins; the grant and the space's capability fence), and a space's deletion
/// starts by updating that space row: nothing read can change before the commit, so a second
/// read would return the same. Lives no longer than its transaction.
#[derive(Default)]
pub struct Reads {
    deletions: HashMap<(String, Uuid), Deletions>,
    /// By `(tenant, space, snapshot, subject, channel)`: what the platform's revalidation found.
    valid: HashMap<(String, Uuid, Uuid, String, String), Option<Valid>>,
    /// By `(tenant, space, grant)`: what the capability fence found.
    grants: HashMap<(String, Uuid, Uuid), Verdict>,
}

impl Reads {
    /// [`deletions`], read once per space.
    pub async fn deletions(
        &mut self,
        conn: &mut PgConnection,
        tenant_id: &str,
        space_id: Uuid,
    ) -> Result<Deletions, sqlx::Error> {
        let key = (tenant_id.to_owned(), space_id);
        if let Some(d) = self.deletions.get(&key) {
            return Ok(d.clone());
        }
        let d = deletions(conn, tenant_id, space_id).await?;
        self.deletions.insert(key, d.clone());
        Ok(d)
    }

    /// [`revalidate`], with the platform's statement run once per snapshot.
    pub async fn revalidate(
        &mut self,
        conn: &mut PgConnection,
        want: &Expected<'_>,
    ) -> Result<Result<Valid, String>, sqlx::Error> {
        let key = (
            want.tenant_id.to_owned(),
            want.space_id,
            want.snapshot_id,
            want.subject_id.to_owned(),
            want.access_channel.to_owned(),
        );
        let valid = match self.valid.get(&key) {
            Some(v) => v.clone(),
            None => {
                let v = platform_revalidate(conn, want).await?;
                self.valid.insert(key, v.clone());
                v
            }
        };
        decide(conn, valid, want).await
    }

    /// [`capability::check`], run once per grant.
    pub async fn capability(
        &mut self,
        conn: &mut PgConnection,
        tenant_id: &str,
        space_id: Uuid,
        grant: Uuid,
    ) -> Result<Verdict, sqlx::Error> {
        let key = (tenant_id.to_owned(), space_id, grant);
        if let Some(v) = self.grants.get(&key) {
            return Ok(v.clone());
        }
        let v = capability::check(conn, tenant_id, space_id, grant).await?;
        self.grants.insert(key, v.clone());
        Ok(v)
    }

    /// Checks the authority a task's row records (`Err`: the row records none, or a mix):
    /// what it lets the step do, or why it no longer stands.
    pub async fn authorize(
        &mut self,
        conn: &mut PgConnection,
        tenant_id: &str,
        space_id: Uuid,
        authority: Result<&Authority, &str>,
    ) -> Result<Result<Authorized, Denial>, sqlx::Error> {
        match authority {
            Err(why) => Ok(Err(Denial::snapshot(why))),
            Ok(Authority::Internal) => Ok(Err(Denial::snapshot(
                "the task records neither a permission snapshot nor a capability grant",
            ))),
            Ok(Authority::Grant(grant)) => {
                let verdict = self.capability(conn, tenant_id, space_id, *grant).await?;
                Ok(granted_by(*grant, verdict))
            }
            Ok(Authority::Snapshot {
                subject,
                snapshot,
                revision,
                channel,
            }) => {
                let want = Expected {
                    tenant_id,
                    space_id,
                    snapshot_id: *snapshot,
                    subject_id: subject,
                    access_channel: channel,
                    revision: Some(*revision),
                };
                Ok(self
                    .revalidate(conn, &want)
                    .await?
                    .map(|valid| Authorized {
                        subject_id: subject.clone(),
                        scopes: valid.permission_scopes,
                        grant: None,
                    })
                    .map_err(Denial::snapshot))
            }
        }
    }
}

/// Checks a grant again, bypassing [`Reads`]: for a step that made its answer over some time,
/// before it completes the task.
pub async fn recheck_grant(
    conn: &mut PgConnection,
    tenant_id: &str,
    space_id: Uuid,
    grant: Uuid,
) -> Result<Result<(), Denial>, sqlx::Error> {
    let verdict = capability::check(conn, tenant_id, space_id, grant).await?;
    Ok(granted_by(grant, verdict).map(|_| ()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> SnapshotRow {
        SnapshotRow {
            tenant_id: "t1".into(),
            space_id: Uuid::from_u128(1),
            subject_id: "alice".into(),
            access_channel: "interactive".into(),
            revision: 2,
            status: "active".into(),
            revoked: false,
            expired: false,
        }
    }

    fn want() -> Expected<'static> {
        Expected {
            tenant_id: "t1",
            space_id: Uuid::from_u128(1),
            snapshot_id: Uuid::from_u128(5),
            subject_id: "alice",
            access_channel: "interactive",
            revision: Some(2),
        }
    }

    #[test]
    fn snapshot_table() {
        let want = want();
        let table: Vec<(Option<SnapshotRow>, Option<&str>)> = vec![
            (Some(row()), None),
            (None, Some("does not exist")),
            (
                Some(SnapshotRow {
                    tenant_id: "t2".into(),
                    ..row()
                }),
                Some("does not exist"),
            ),
            (
                Some(SnapshotRow {
                    space_id: Uuid::from_u128(2),
                    ..row()
                }),
                Some("another knowledge space"),
            ),
            (
                Some(SnapshotRow {
                    subject_id: "bob".into(),
                    ..row()
                }),
                Some("another subject"),
            ),
            (
                Some(SnapshotRow {
                    access_channel: "mcp".into(),
                    ..row()
                }),
                Some("mcp channel"),
            ),
            (
                Some(SnapshotRow {
                    revoked: true,
                    ..row()
                }),
                Some("revoked"),
            ),
            (
                Some(SnapshotRow {
                    status: "revoked".into(),
                    ..row()
                }),
                Some("revoked"),
            ),
            (
                Some(SnapshotRow {
                    expired: true,
                    ..row()
                }),
                Some("expired"),
            ),
            (
                Some(SnapshotRow {
                    status: "suspended".into(),
                    ..row()
                }),
                Some("suspended, not active"),
            ),
            (
                Some(SnapshotRow {
                    revision: 3,
                    ..row()
                }),
                Some("changed (revision 3 now, 2"),
            ),
        ];
        for (r, want_msg) in table {
            let got = snapshot_denial(r.as_ref(), &want);
            match (want_msg, &got) {
                (None, None) => {}
                (Some(m), Some(g)) => assert!(g.contains(m), "{g:?} should contain {m:?}"),
                _ => panic!("{r:?}: got {got:?}, want {want_msg:?}"),
            }
        }
        // At request time any revision will do.
        let any = Expected {
            revision: None,
            ..want
        };
        assert_eq!(
            snapshot_denial(
                Some(&SnapshotRow {
                    revision: 9,
                    ..row()
                }),
                &any
            ),
            None
        );
    }

    #[test]
    fn grants_need_revalidation_at_the_requested_revision() {
        let v = |revision| Valid {
            revision,
            role: "editor".into(),
            permission_scopes: serde_json::json!([]),
        };
        let want = want();
        assert!(granted(Some(&v(2)), &want));
        assert!(!granted(Some(&v(3)), &want));
        assert!(!granted(None, &want));
        assert!(granted(
            Some(&v(7)),
            &Expected {
                revision: None,
                ..want
            }
        ));
    }

    #[test]
    fn reader_scopes_are_normalized_as_the_platform_does_or_refused_whole() {
        use serde_json::json;
        let long = "s".repeat(MAX_SCOPE_UNITS);
        let too_long = "s".repeat(MAX_SCOPE_UNITS + 1);
        // 256 astral characters: 512 UTF-16 units, the most allowed.
        let astral = "😀".repeat(256);
        let astral_too_long = "😀".repeat(257);
        let table: Vec<(Value, Option<Value>)> = vec![
            (json!([]), Some(json!([]))),
            (
                json!(["tenant:t", "source:a", "tenant:t"]),
                Some(json!(["tenant:t", "source:a"])),
            ),
            (json!([long]), Some(json!([long]))),
            (json!([astral]), Some(json!([astral]))),
            (json!([too_long]), None),
            (json!([astral_too_long]), None),
            (json!(["tenant:t", ""]), None),
            (json!([" tenant:t"]), None),
            (json!(["tenant:t\n"]), None),
            (json!(["tenant:t", 5]), None),
            (json!([["tenant:t"]]), None),
            (json!("tenant:t"), None),
            (json!({"tenant": "t"}), None),
            (Value::Null, None),
        ];
        for (input, want) in table {
            assert_eq!(reader_scopes(&input), want, "{input}");
        }
    }

    #[test]
    fn only_an_active_grant_authorizes_and_a_refusal_is_capability_revoked() {
        use crate::capability::Grant;
        use serde_json::json;
        let id = Uuid::from_u128(9);
        assert_eq!(
            granted_by(
                id,
                Verdict::Active(Grant {
                    subject_id: "app-user".into(),
                    content_scope_ids: json!(["tenant:t"]),
                })
            ),
            Ok(Authorized {
                subject_id: "app-user".into(),
                scopes: json!(["tenant:t"]),
                grant: Some(id),
            })
        );
        for (verdict, says) in [
            (Verdict::Revoked("grant x is revoked".into()), "is revoked"),
            (Verdict::Fenced, "fence is tombstoned"),
        ] {
            let d = granted_by(id, verdict).unwrap_err();
            assert_eq!(d.code, CAPABILITY_REVOKED);
            assert!(d.why.contains(says), "{d:?}");
        }
    }

    #[test]
    fn fence_table() {
        let live = Deletions {
            space_exists: true,
            ..Deletions::default()
        };
        let doc_job = Deletions {
            active_job: Some(Uuid::from_u128(3)),
            ..live.clone()
        };
        let space_job = Deletions {
            space_deleting: true,
            ..doc_job.clone()
        };
        let table: Vec<(Deletions, Option<&str>, Option<&str>)> = vec![
            (live.clone(), None, None),
            (
                Deletions::default(),
                Some("no longer exists"),
                Some("no longer exists"),
            ),
            (doc_job, None, Some("a deletion (job")),
            (space_job, Some("being deleted"), Some("being deleted")),
        ];
        for (d, running, admission) in table {
            let r = running_fence(&d);
            let a = admission_fence(&d);
            assert_eq!(r.is_some(), running.is_some(), "{d:?}: {r:?}");
            assert_eq!(a.is_some(), admission.is_some(), "{d:?}: {a:?}");
            if let (Some(g), Some(w)) = (r, running) {
                assert!(g.contains(w), "{g}");
            }
            if let (Some(g), Some(w)) = (a, admission) {
                assert!(g.contains(w), "{g}");
            }
        }
    }
}
