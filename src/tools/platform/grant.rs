//! Capability grants and the space's capability fence, admitted and revoked as the platform's
//! capability provenance writes them (its migration 0025). Invariant: a grant is written whole
//! (digests in the platform's `sha256:` form, an object for its authorization revision, an array
//! of permission-scope tokens for its content scope), `active` until revoked, and a revocation or
//! a space fence only ever moves forward (`highest_revoke_sequence` grows).

use chrono::{Duration, Utc};
use serde_json::json;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::canonical::sha256_hex;

/// Admits a grant for `subject` in the space that may read content whose permission scopes are
/// all among `content_scopes` (the platform's content-scope tokens, such as `tenant:<t>` or
/// `knowledge-space:<id>`). It expires in an hour, as the platform's capability tokens do.
pub async fn create_capability_grant(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    subject: &str,
    content_scopes: &[String],
) -> Result<Uuid, sqlx::Error> {
    let id = Uuid::new_v4();
    let now = Utc::now();
    sqlx::query(
        "INSERT INTO capability_grants (tenant_id, knowledge_space_id, grant_id, subject_id, actor_id, caller_kind, \
           action, resource_type, resource_id, resource_parent_id, content_scope_ids, content_policy_revision, \
           authz_revision, claims_digest, jti_hash, trace_id, revision, state, highest_revoke_sequence, issued_at, \
           expires_at, admitted_at, updated_at) \
         VALUES ($1, $2, $3, $4, $4, 'host-app', 'knowledge.use', 'knowledge_space', $2::text, NULL, $5, 1, \
           '{\"membership\": 1}'::jsonb, $6, $7, $8, 1, 'active', 0, $9, $10, $9, $9)",
    )
    .bind(tenant)
    .bind(space)
    .bind(id)
    .bind(subject)
    .bind(json!(content_scopes))
    .bind(format!("sha256:{}", sha256_hex(format!("claims:{id}").as_bytes())))
    .bind(format!("sha256:{}", sha256_hex(format!("jti:{id}").as_bytes())))
    .bind(format!("trace-{}", id.simple()))
    .bind(now)
    .bind(now + Duration::hours(1))
    .execute(conn)
    .await?;
    Ok(id)
}

/// Revokes a grant, as the platform's revocation handler does: `state = 'revoked'` with its
/// reason, and a higher revoke sequence.
pub async fn revoke_capability_grant(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    grant: Uuid,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE capability_grants SET state = 'revoked', revoked_at = now(), revoke_reason_code = 'revoked', \
           highest_revoke_sequence = highest_revoke_sequence + 1, updated_at = now() \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND grant_id = $3",
    )
    .bind(tenant)
    .bind(space)
    .bind(grant)
    .execute(conn)
    .await?;
    Ok(())
}

/// Tombstones the space's capability fence: from then on no grant of the space authorizes
/// anything, as after the platform's space-wide revocation.
pub async fn fence_capability_space(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO capability_space_fences (tenant_id, knowledge_space_id, highest_revoke_sequence, reason_code, \
           revision, tombstoned, updated_at) \
         VALUES ($1, $2, 1, 'space_revoked', 1, TRUE, now()) \
         ON CONFLICT (tenant_id, knowledge_space_id) DO UPDATE SET tombstoned = TRUE, \
           highest_revoke_sequence = capability_space_fences.highest_revoke_sequence + 1, \
           revision = capability_space_fences.revision + 1, updated_at = now()",
    )
    .bind(tenant)
    .bind(space)
    .execute(conn)
    .await?;
    Ok(())
}
