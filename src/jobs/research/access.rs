//! Whether a task may read its space. Invariant: fail closed. A request and every step re-check,
//! in the same transaction as the work they guard, that the space is live (not being deleted)
//! and that the permission snapshot is active, unrevoked, unexpired, at the job's revision and
//! issued for this tenant, space, subject and channel; the rows are read `FOR SHARE`, so a
//! revocation or a deletion mark waits for the step and is seen by the next one.

use sqlx::PgConnection;
use uuid::Uuid;

/// The fields of a permission snapshot that decide access.
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
    pub subject_id: &'a str,
    pub access_channel: &'a str,
    /// The revision the job was requested under; `None` at request time.
    pub revision: Option<i32>,
}

/// Why access is denied, or `None` when it is granted. Pure.
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

/// Reads a snapshot by id within a tenant, `FOR SHARE`.
pub async fn read_snapshot(
    conn: &mut PgConnection,
    tenant_id: &str,
    snapshot_id: Uuid,
) -> Result<Option<SnapshotRow>, sqlx::Error> {
    type Row = (String, Uuid, String, String, i32, String, bool, bool);
    let row: Option<Row> = sqlx::query_as(
        "SELECT tenant_id, knowledge_space_id, subject_id, access_channel, revision, status, \
           revoked_at IS NOT NULL, (expires_at IS NOT NULL AND expires_at <= now()) \
         FROM knowledge_space_permission_snapshots WHERE tenant_id = $1 AND id = $2 FOR SHARE",
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

/// Why the space cannot be researched now, or `None`. Reads the space `FOR SHARE`.
pub async fn space_denial(
    conn: &mut PgConnection,
    tenant_id: &str,
    space_id: Uuid,
) -> Result<Option<String>, sqlx::Error> {
    let state: Option<String> = sqlx::query_scalar(
        "SELECT lifecycle_state FROM knowledge_spaces WHERE tenant_id = $1 AND id = $2 FOR SHARE",
    )
    .bind(tenant_id)
    .bind(space_id)
    .fetch_optional(&mut *conn)
    .await?;
    match state.as_deref() {
        None => return Ok(Some("the knowledge space no longer exists".into())),
        Some("deleting") => return Ok(Some("the knowledge space is being deleted".into())),
        _ => {}
    }
    let deleting: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM deletion_jobs WHERE tenant_id = $1 AND knowledge_space_id = $2 \
           AND target_type = 'knowledge_space' AND target_id = $2 AND active_slot = 1)",
    )
    .bind(tenant_id)
    .bind(space_id)
    .fetch_one(conn)
    .await?;
    Ok(deleting.then(|| "the knowledge space has a live deletion job".into()))
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

    #[test]
    fn snapshot_table() {
        let want = Expected {
            tenant_id: "t1",
            space_id: Uuid::from_u128(1),
            subject_id: "alice",
            access_channel: "interactive",
            revision: Some(2),
        };
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
}
