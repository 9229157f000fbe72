//! Spaces, their members and their sources, written as the platform's API creates them.
//! Invariant: a space is never written without its manifest and its access-control rows (owner
//! member, access policy, API access), a space made by [`create_space`] never without its
//! initial active retrieval profile, and a source with a credential reference never without its
//! active secret-lifecycle row.

use serde_json::{json, Value};
use sqlx::PgConnection;
use uuid::Uuid;

/// The platform's object-key prefix of a space: the tenant with unsafe characters replaced,
/// then `/spaces/<space>`.
pub fn object_key_prefix(tenant: &str, space: Uuid) -> String {
    let mut t = String::new();
    for c in tenant.chars() {
        if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '=' | '-') {
            t.push(c);
        } else if !t.ends_with('-') {
            t.push('-');
        }
    }
    let t = t.trim_matches('-');
    let t = if t.is_empty() { "tenant" } else { t };
    format!("{t}/spaces/{space}")
}

/// The default manifest policies of a new space.
fn manifest_policies() -> [Value; 4] {
    [
        json!({"artifactVersionsToKeep": 3, "failedCommitRetentionDays": 14, "traceRetentionDays": 30}),
        json!({"maxActiveJobCount": null, "maxActiveSessionCount": null, "maxArtifactBytes": null,
               "maxGraphEntityCount": null, "maxGraphRelationCount": null, "maxNodeCount": null,
               "maxProjectionCount": null, "maxRawDocumentBytes": null, "maxSegmentCount": null,
               "maxTraceBytes": null, "providerBudgets": {"maxEmbeddingTokensPerDay": null,
               "maxLlmTokensPerDay": null, "maxParserPagesPerDay": null, "maxRerankRequestsPerDay": null}}),
        json!({"defaultClass": "path-consistent", "snapshotTtlSeconds": 3600}),
        json!({"strategy": "provider-managed"}),
    ]
}

/// The reasoning model and provider of the retrieval profile every [`create_space`] space starts
/// with (the fixtures' choice; on the platform the space's creator picks them).
pub const INITIAL_RETRIEVAL_MODEL: (&str, &str) = ("kfs-extractive", "offline");

/// A space owned by `owner` that can compile documents: [`create_bare_space`] and the platform's
/// initial activation of a retrieval profile (revision 1, `research` mode, no embedding profile),
/// so the space has the profile heads the platform's compile requires.
pub async fn create_space(
    conn: &mut PgConnection,
    tenant: &str,
    slug: &str,
    name: &str,
    owner: &str,
) -> Result<Uuid, sqlx::Error> {
    let id = create_bare_space(conn, tenant, slug, name, owner).await?;
    let (model, provider) = INITIAL_RETRIEVAL_MODEL;
    super::profile::activate_retrieval_profile(conn, tenant, id, model, provider).await?;
    Ok(id)
}

/// A space owned by `owner` before any model configuration: the space row, its manifest and its
/// access-control rows (owner member, access policy, API access), as the platform's API creates a
/// space, and no profile heads (its documents cannot compile until a retrieval profile is
/// activated).
pub async fn create_bare_space(
    conn: &mut PgConnection,
    tenant: &str,
    slug: &str,
    name: &str,
    owner: &str,
) -> Result<Uuid, sqlx::Error> {
    let id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO knowledge_spaces (id, tenant_id, slug, name, description, revision, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, NULL, 1, now(), now())",
    )
    .bind(id)
    .bind(tenant)
    .bind(slug)
    .bind(name)
    .execute(&mut *conn)
    .await?;
    let [retention, quota, consistency, encryption] = manifest_policies();
    sqlx::query(
        "INSERT INTO knowledge_space_manifests (id, tenant_id, knowledge_space_id, manifest_version, storage_provider, \
           object_key_prefix, metadata_dialect, parser_policy_version, node_schema_version, projection_set_version, \
           min_client_version, retention_policy, quota_policy, consistency_policy, encryption_policy, metadata, \
           created_at, updated_at) \
         VALUES ($1, $2, $3, 1, 'dify', $4, 'portable', 'default-v1', 1, 'default-v1', '0.0.0', $5, $6, $7, $8, \
           '{}'::jsonb, now(), now())",
    )
    .bind(Uuid::new_v4())
    .bind(tenant)
    .bind(id)
    .bind(object_key_prefix(tenant, id))
    .bind(retention)
    .bind(quota)
    .bind(consistency)
    .bind(encryption)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO knowledge_space_members (id, tenant_id, knowledge_space_id, subject_id, role, revision, \
           created_by_subject_id, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, 'owner', 1, $4, now(), now())",
    )
    .bind(Uuid::new_v4())
    .bind(tenant)
    .bind(id)
    .bind(owner)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO knowledge_space_access_policies (id, tenant_id, knowledge_space_id, visibility, owner_subject_id, \
           revision, updated_by_subject_id, created_at, updated_at) \
         VALUES ($1, $2, $3, 'all_members', $4, 1, $4, now(), now())",
    )
    .bind(Uuid::new_v4())
    .bind(tenant)
    .bind(id)
    .bind(owner)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO knowledge_space_api_access (id, tenant_id, knowledge_space_id, enabled, disabled_at, revision, \
           updated_by_subject_id, created_at, updated_at) \
         VALUES ($1, $2, $3, TRUE, NULL, 1, $4, now(), now())",
    )
    .bind(Uuid::new_v4())
    .bind(tenant)
    .bind(id)
    .bind(owner)
    .execute(&mut *conn)
    .await?;
    Ok(id)
}

/// Adds `subject` to the space as a member with `role` (`owner`, `editor` or `viewer`), unless it
/// is one already. Returns its role.
pub async fn add_member(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    subject: &str,
    role: &str,
) -> Result<String, sqlx::Error> {
    sqlx::query(
        "INSERT INTO knowledge_space_members (id, tenant_id, knowledge_space_id, subject_id, role, revision, \
           created_by_subject_id, created_at, updated_at) \
         SELECT $1, $2, $3, $4, $5, 1, p.owner_subject_id, now(), now() \
         FROM knowledge_space_access_policies p WHERE p.tenant_id = $2 AND p.knowledge_space_id = $3 \
         ON CONFLICT DO NOTHING",
    )
    .bind(Uuid::new_v4())
    .bind(tenant)
    .bind(space)
    .bind(subject)
    .bind(role)
    .execute(&mut *conn)
    .await?;
    sqlx::query_scalar(
        "SELECT role::text FROM knowledge_space_members WHERE tenant_id = $1 AND knowledge_space_id = $2 AND subject_id = $3",
    )
    .bind(tenant)
    .bind(space)
    .bind(subject)
    .fetch_one(conn)
    .await
}

/// A source of the space. With a credential reference, the secret's lifecycle row is written
/// active with it, as the platform's credential service leaves a created source.
pub async fn create_source(
    conn: &mut PgConnection,
    space: Uuid,
    name: &str,
    kind: &str,
    credential_ref: Option<&str>,
) -> Result<Uuid, sqlx::Error> {
    let id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO sources (id, knowledge_space_id, credential_ref, name, type, status, uri, permission_scope, \
           metadata, version, created_at, updated_at) \
         SELECT $1, s.id, $2, $3, $4, 'active', $5, '[]'::jsonb, jsonb_build_object('tenantId', s.tenant_id), 1, \
           now(), now() \
         FROM knowledge_spaces s WHERE s.id = $6",
    )
    .bind(id)
    .bind(credential_ref)
    .bind(name)
    .bind(kind)
    .bind(format!("{kind}://{name}"))
    .bind(space)
    .execute(&mut *conn)
    .await?;
    if let Some(reference) = credential_ref {
        sqlx::query(
            "INSERT INTO source_secret_lifecycle_refs (id, tenant_id, knowledge_space_id, source_id, credential_ref, \
               operation_id, purpose, state, source_version, recover_after, delete_attempts, row_version, \
               created_at, updated_at) \
             SELECT $1, s.tenant_id, s.id, $2, $3, $4, 'create', 'active', 1, now() + interval '5 minutes', 0, 1, \
               now(), now() \
             FROM knowledge_spaces s WHERE s.id = $5",
        )
        .bind(Uuid::new_v4())
        .bind(id)
        .bind(reference)
        .bind(Uuid::new_v4().to_string())
        .bind(space)
        .execute(&mut *conn)
        .await?;
    }
    Ok(id)
}

/// A fresh credential reference in the platform's format.
pub fn new_credential_ref() -> String {
    format!("source-secret:v1:{}", Uuid::new_v4())
}
