//! Permission snapshots, issued and revoked as the platform does. Invariant: a snapshot copies
//! the current role, visibility and revisions of its subject's member row, the space's access
//! policy and its API access at the moment it is issued, so revalidation can tell when one changed.

use chrono::{DateTime, Duration, Utc};
use serde_json::json;
use sqlx::PgConnection;
use uuid::Uuid;

use super::space::add_member;

/// The platform's permission scopes of a subject in a space, sorted.
pub fn permission_scopes(
    tenant: &str,
    space: Uuid,
    subject: &str,
    role: &str,
    visibility: &str,
) -> Vec<String> {
    let mut scopes = vec![
        format!("tenant:{tenant}"),
        format!("knowledge-space:{space}"),
        format!("knowledge-space:{space}:member:{subject}"),
        format!("knowledge-space:{space}:role:{role}"),
        if visibility == "all_members" {
            format!("knowledge-space:{space}:visibility:all_members")
        } else {
            format!("knowledge-space:{space}:visibility:{visibility}:{subject}")
        },
    ];
    scopes.sort();
    scopes
}

/// A permission snapshot for `subject` on `channel`, as the platform issues one: the member's
/// role, the policy's visibility and the current revisions of member, policy and API access.
/// A subject that is not a member yet is added as an editor first. `expires_at` defaults to a
/// day from now.
pub async fn create_permission_snapshot(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    subject: &str,
    channel: &str,
    expires_at: Option<DateTime<Utc>>,
) -> Result<Uuid, sqlx::Error> {
    let role = add_member(conn, tenant, space, subject, "editor").await?;
    let visibility: String = sqlx::query_scalar(
        "SELECT visibility::text FROM knowledge_space_access_policies WHERE tenant_id = $1 AND knowledge_space_id = $2",
    )
    .bind(tenant)
    .bind(space)
    .fetch_one(&mut *conn)
    .await?;
    let id = Uuid::new_v4();
    let expires_at = expires_at.unwrap_or_else(|| Utc::now() + Duration::days(1));
    sqlx::query(
        "INSERT INTO knowledge_space_permission_snapshots (id, tenant_id, knowledge_space_id, subject_id, role, \
           visibility, access_channel, member_revision, access_policy_revision, api_access_revision, api_key_id, \
           api_key_revision, api_key_expires_at, permission_scopes, status, revision, expires_at, revoked_at, \
           created_at, updated_at) \
         SELECT $1, $2, $3, $4, m.role, p.visibility, $5, m.revision, p.revision, a.revision, NULL, NULL, NULL, $6, \
           'active', 1, $7, NULL, now(), now() \
         FROM knowledge_space_members m \
         JOIN knowledge_space_access_policies p ON p.tenant_id = m.tenant_id AND p.knowledge_space_id = m.knowledge_space_id \
         JOIN knowledge_space_api_access a ON a.tenant_id = m.tenant_id AND a.knowledge_space_id = m.knowledge_space_id \
         WHERE m.tenant_id = $2 AND m.knowledge_space_id = $3 AND m.subject_id = $4",
    )
    .bind(id)
    .bind(tenant)
    .bind(space)
    .bind(subject)
    .bind(channel)
    .bind(json!(permission_scopes(tenant, space, subject, &role, &visibility)))
    .bind(expires_at)
    .execute(conn)
    .await?;
    Ok(id)
}

/// Revokes a snapshot as the platform does (`revoked`, a new revision).
pub async fn revoke_permission_snapshot(
    conn: &mut PgConnection,
    tenant: &str,
    snapshot: Uuid,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE knowledge_space_permission_snapshots SET status = 'revoked', revision = revision + 1, \
           revoked_at = now(), updated_at = now() WHERE tenant_id = $1 AND id = $2",
    )
    .bind(tenant)
    .bind(snapshot)
    .execute(conn)
    .await?;
    Ok(())
}
