//! Whether a permission snapshot still grants what it granted: the platform's revalidation of a
//! snapshot against the space's current members, access policy, API access and API key.
//! Invariant: fail closed — a snapshot is valid only if this one statement finds it active,
//! unexpired, unrevoked, issued for this tenant, space, subject and channel, and every revision it
//! recorded (member, policy, API access, API key) is still the current one; the rows it reads are
//! share-locked, so a revocation waits for the transaction that relies on the snapshot.
//! [`Authority`] reads which authority a job row records: a snapshot, a capability grant (see
//! [`crate::capability`]), or (compile only) none, and refuses a row that records a mix.

use sqlx::PgConnection;
use uuid::Uuid;

/// A snapshot that revalidated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Valid {
    pub revision: i32,
    pub role: String,
    pub permission_scopes: serde_json::Value,
}

/// The platform's revalidation statement. `$1` tenant, `$2` space, `$3` snapshot, `$4` subject,
/// `$5` channel.
pub const REVALIDATE_SQL: &str = r#"
SELECT s.revision, s.role::text, s.permission_scopes
FROM knowledge_space_permission_snapshots s
JOIN knowledge_space_members m ON m.tenant_id = s.tenant_id AND m.knowledge_space_id = s.knowledge_space_id
     AND m.subject_id = s.subject_id
JOIN knowledge_space_access_policies policy ON policy.tenant_id = s.tenant_id
     AND policy.knowledge_space_id = s.knowledge_space_id
JOIN knowledge_space_api_access api ON api.tenant_id = s.tenant_id AND api.knowledge_space_id = s.knowledge_space_id
LEFT JOIN knowledge_space_api_keys api_key ON api_key.tenant_id = s.tenant_id
     AND api_key.knowledge_space_id = s.knowledge_space_id AND api_key.id = s.api_key_id
WHERE s.tenant_id = $1 AND s.knowledge_space_id = $2 AND s.id = $3 AND s.subject_id = $4 AND s.access_channel = $5
  AND s.status = 'active' AND s.revoked_at IS NULL AND s.expires_at > now()
  AND s.member_revision = m.revision AND s.access_policy_revision = policy.revision
  AND s.api_access_revision = api.revision
  AND s.role = m.role AND s.visibility = policy.visibility
  AND (s.access_channel = 'interactive' OR api.enabled = TRUE)
  AND ((s.api_key_id IS NULL AND s.api_key_revision IS NULL AND s.api_key_expires_at IS NULL)
    OR (s.api_key_id IS NOT NULL AND s.api_key_revision = api_key.revision AND s.access_channel = 'service_api'
        AND api_key.status = 'active' AND api_key.revoked_at IS NULL AND api_key.principal_subject_id = s.subject_id
        AND ((s.api_key_expires_at IS NULL AND api_key.expires_at IS NULL) OR s.api_key_expires_at = api_key.expires_at)
        AND (api_key.expires_at IS NULL OR api_key.expires_at > now())))
  AND ((policy.visibility = 'only_me' AND policy.owner_subject_id = s.subject_id)
    OR policy.visibility = 'all_members'
    OR (policy.visibility = 'partial_members' AND EXISTS (
         SELECT 1 FROM knowledge_space_access_policy_members t
         WHERE t.tenant_id = s.tenant_id AND t.knowledge_space_id = s.knowledge_space_id
           AND t.access_policy_id = policy.id AND t.subject_id = s.subject_id)))
FOR SHARE OF s, m, policy, api
"#;

/// Revalidates a snapshot; `None` when it no longer grants anything.
pub async fn revalidate(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    snapshot: Uuid,
    subject: &str,
    channel: &str,
) -> Result<Option<Valid>, sqlx::Error> {
    let row: Option<(i32, String, serde_json::Value)> = sqlx::query_as(REVALIDATE_SQL)
        .bind(tenant)
        .bind(space)
        .bind(snapshot)
        .bind(subject)
        .bind(channel)
        .fetch_optional(conn)
        .await?;
    Ok(row.map(|(revision, role, permission_scopes)| Valid {
        revision,
        role,
        permission_scopes,
    }))
}

/// The authority a job was requested under, as its row records it (the platform's authorization
/// binding since its migration 0026): a permission snapshot, or a capability grant, or, for an
/// internal or legacy compile attempt, neither.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Authority {
    Snapshot {
        subject: String,
        snapshot: Uuid,
        revision: i32,
        channel: String,
    },
    Grant(Uuid),
    Internal,
}

impl Authority {
    /// The authority a row's columns bind: a grant with no snapshot column set, or every
    /// snapshot column set and no grant, or nothing at all; `Err` names a row that binds a mix,
    /// which the platform's CHECKs forbid and a job must never run on. Pure.
    pub fn from_columns(
        grant: Option<Uuid>,
        subject: Option<String>,
        snapshot: Option<Uuid>,
        revision: Option<i32>,
        channel: Option<String>,
    ) -> Result<Self, String> {
        match (grant, subject, snapshot, revision, channel) {
            (Some(g), None, None, None, None) => Ok(Authority::Grant(g)),
            (None, Some(subject), Some(snapshot), Some(revision), Some(channel)) => {
                Ok(Authority::Snapshot {
                    subject,
                    snapshot,
                    revision,
                    channel,
                })
            }
            (None, None, None, None, None) => Ok(Authority::Internal),
            _ => Err(
                "the job records neither one whole permission snapshot binding nor one \
                      capability grant alone"
                    .into(),
            ),
        }
    }

    /// The capability grant, if that is the authority.
    pub fn grant(&self) -> Option<Uuid> {
        match self {
            Authority::Grant(g) => Some(*g),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_row_binds_a_whole_snapshot_or_a_grant_alone_or_nothing() {
        let g = Some(Uuid::from_u128(1));
        let s = Some(Uuid::from_u128(2));
        let who = || Some("subject".to_owned());
        let ch = || Some("interactive".to_owned());
        let snapshot = Authority::Snapshot {
            subject: "subject".into(),
            snapshot: Uuid::from_u128(2),
            revision: 3,
            channel: "interactive".into(),
        };
        let table = [
            (
                (g, None, None, None, None),
                Ok(Authority::Grant(Uuid::from_u128(1))),
            ),
            ((None, who(), s, Some(3), ch()), Ok(snapshot)),
            ((None, None, None, None, None), Ok(Authority::Internal)),
            ((g, who(), None, None, None), Err(())),
            ((g, who(), s, Some(3), ch()), Err(())),
            ((None, who(), s, None, ch()), Err(())),
            ((None, None, s, Some(3), None), Err(())),
        ];
        for ((grant, subject, snap, rev, channel), want) in table {
            let got = Authority::from_columns(grant, subject, snap, rev, channel).map_err(|_| ());
            assert_eq!(got, want);
        }
    }
}
