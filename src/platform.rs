//! The platform API's own rows that jobs work on: spaces (with their manifest and access
//! control), sources (with their secret lifecycle), uploaded documents, permission snapshots and
//! embedding profiles, written the way the platform's API writes them. kfs-worker writes these
//! only for its demo, its tests, its bench and its command line. Invariant: every row is written
//! complete and consistent with the platform's constraints, scoped to its tenant and space; a
//! document's bytes reach the object store before the row that names them commits.
//!
//! Where these fixtures choose differently from the platform's defaults, they say so: a space is
//! shared with all its members and open to API channels (the platform starts a space as the
//! owner's only, API access off), so that tests can issue snapshots for several subjects and
//! channels; a snapshot lasts a day unless told otherwise (the platform's last an hour).

use bytes::Bytes;
use chrono::{DateTime, Duration, Utc};
use serde_json::{json, Value};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::canonical::stable_digest;
use crate::embed::Profile;
use crate::store::{Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum PlatformError {
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("{0}")]
    NotFound(String),
}

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

/// A space owned by `owner`: the space row, its manifest and its access-control rows (owner
/// member, access policy, API access), as the platform's API creates a space.
pub async fn create_space(
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

pub fn sha256_hex(bytes: &[u8]) -> String {
    crate::canonical::sha256_hex(bytes)
}

/// The platform's upload file-name sanitising: the base name, lower case, runs of other
/// characters as `-`, no leading dots, `upload` when nothing is left.
pub fn sanitize_filename(filename: &str) -> String {
    let base = filename
        .rsplit(['/', '\\'])
        .next()
        .unwrap_or("")
        .trim()
        .to_lowercase();
    let base = base.trim_start_matches('.');
    let mut out = String::new();
    for c in base.chars() {
        if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
            out.push(c);
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    let out = out.trim_matches('-');
    if out.is_empty() {
        "upload".into()
    } else {
        out.to_owned()
    }
}

/// The object key of a document version: the platform's upload key for version 1, a
/// version folder under the same document prefix for later ones.
pub fn document_key(
    tenant: &str,
    space: Uuid,
    document: Uuid,
    version: i32,
    filename: &str,
) -> String {
    let name = sanitize_filename(filename);
    if version <= 1 {
        format!("{tenant}/spaces/{space}/documents/{document}/{name}")
    } else {
        format!("{tenant}/spaces/{space}/documents/{document}/v{version}/{name}")
    }
}

/// What the platform's upload records about a document's readers.
#[derive(Clone, Debug, Default)]
pub struct Upload<'a> {
    /// The document's permission scope (`[]`: everyone who may read the space).
    pub permission_scope: Vec<String>,
    /// The uploading subject (the space's owner when `None`).
    pub uploaded_by: Option<&'a str>,
}

async fn space_facts(
    conn: &mut PgConnection,
    space: Uuid,
) -> Result<(String, String), PlatformError> {
    let row: Option<(String, String)> = sqlx::query_as(
        "SELECT s.tenant_id::text, p.owner_subject_id::text FROM knowledge_spaces s \
         JOIN knowledge_space_access_policies p ON p.tenant_id = s.tenant_id AND p.knowledge_space_id = s.id \
         WHERE s.id = $1",
    )
    .bind(space)
    .fetch_optional(&mut *conn)
    .await?;
    row.ok_or_else(|| PlatformError::NotFound(format!("no knowledge space {space}")))
}

/// Uploads the bytes, then writes what the platform's upload writes: the document row (version
/// 1, `pending`), its staged commit (`metadata-prepared`) and the document's root knowledge path.
#[allow(clippy::too_many_arguments)]
pub async fn add_document(
    conn: &mut PgConnection,
    store: &Store,
    space: Uuid,
    source: Option<Uuid>,
    filename: &str,
    mime_type: &str,
    bytes: Bytes,
) -> Result<Uuid, PlatformError> {
    upload(
        conn,
        store,
        space,
        source,
        filename,
        mime_type,
        bytes,
        &Upload::default(),
    )
    .await
}

/// [`add_document`] with the upload's reader facts.
#[allow(clippy::too_many_arguments)]
pub async fn upload(
    conn: &mut PgConnection,
    store: &Store,
    space: Uuid,
    source: Option<Uuid>,
    filename: &str,
    mime_type: &str,
    bytes: Bytes,
    how: &Upload<'_>,
) -> Result<Uuid, PlatformError> {
    let (tenant, owner) = space_facts(conn, space).await?;
    let id = Uuid::new_v4();
    let key = document_key(&tenant, space, id, 1, filename);
    let sha = sha256_hex(&bytes);
    let size = i32::try_from(bytes.len()).unwrap_or(i32::MAX);
    store.put(&key, bytes).await?;
    let uploaded_by = how.uploaded_by.unwrap_or(&owner);
    sqlx::query(
        "INSERT INTO document_assets (id, knowledge_space_id, source_id, filename, mime_type, object_key, sha256, \
           size_bytes, metadata, parser_status, version, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'pending', 1, now())",
    )
    .bind(id)
    .bind(space)
    .bind(source)
    .bind(filename)
    .bind(mime_type)
    .bind(&key)
    .bind(&sha)
    .bind(size)
    .bind(json!({ "permissionScope": how.permission_scope, "tenantId": tenant,
                  "traceId": Uuid::new_v4(), "uploadedBy": uploaded_by }))
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO knowledge_space_staged_commits (id, tenant_id, knowledge_space_id, operation_type, idempotency_key, \
           status, raw_object_key, published_object_key, document_asset_id, checksum, size_bytes, created_at, updated_at) \
         VALUES ($1, $2, $3, 'document-upload', $4, 'metadata-prepared', $5, $5, $1, $6, $7, now(), now())",
    )
    .bind(id)
    .bind(&tenant)
    .bind(space)
    .bind(format!("document-upload:{id}"))
    .bind(&key)
    .bind(&sha)
    .bind(size)
    .execute(&mut *conn)
    .await?;
    let root = format!(
        "/knowledge/docs/{}",
        crate::jobs::compile::paths::document_segment(filename, id)
    );
    sqlx::query(
        "INSERT INTO knowledge_paths (id, knowledge_space_id, publication_generation_id, virtual_path, resource_type, \
           target_id, version, view_name, view_type, metadata) \
         VALUES ($1, $2, NULL, $3, 'document', $4, 1, 'docs', 'physical', $5) \
         ON CONFLICT DO NOTHING",
    )
    .bind(Uuid::new_v4())
    .bind(space)
    .bind(&root)
    .bind(id.to_string())
    .bind(json!({ "filename": filename, "mimeType": mime_type, "objectKey": key, "tenantId": tenant }))
    .execute(&mut *conn)
    .await?;
    Ok(id)
}

/// Uploads new bytes for a document and bumps its version. Returns the new version.
pub async fn replace_document(
    conn: &mut PgConnection,
    store: &Store,
    document: Uuid,
    bytes: Bytes,
) -> Result<i32, PlatformError> {
    let row: Option<(Uuid, String, i32, String)> = sqlx::query_as(
        "SELECT d.knowledge_space_id, d.filename, d.version, s.tenant_id::text FROM document_assets d \
         JOIN knowledge_spaces s ON s.id = d.knowledge_space_id WHERE d.id = $1 FOR UPDATE OF d",
    )
    .bind(document)
    .fetch_optional(&mut *conn)
    .await?;
    let (space, filename, version, tenant) =
        row.ok_or_else(|| PlatformError::NotFound(format!("no document {document}")))?;
    let next = version + 1;
    let key = document_key(&tenant, space, document, next, &filename);
    store.put(&key, bytes.clone()).await?;
    sqlx::query(
        "UPDATE document_assets SET version = $2, object_key = $3, sha256 = $4, size_bytes = $5, \
           parser_status = 'pending', row_version = row_version + 1, updated_at = now() \
         WHERE id = $1",
    )
    .bind(document)
    .bind(next)
    .bind(&key)
    .bind(sha256_hex(&bytes))
    .bind(i32::try_from(bytes.len()).unwrap_or(i32::MAX))
    .execute(conn)
    .await?;
    Ok(next)
}

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

/// The platform's vector space id of an embedding selection at a profile revision (the legacy
/// form, without an install identity).
pub fn vector_space_id(model: &str, plugin_id: &str, provider: &str, revision: i32) -> String {
    format!(
        "embedding-space-sha256:{}",
        stable_digest(
            &json!({ "model": model, "pluginId": plugin_id, "provider": provider,
                               "revision": revision, "schemaVersion": 1 })
        )
    )
}

/// One active profile revision as the platform's activation writes it.
struct ActiveProfile<'a> {
    kind: &'static str,
    /// The manifest metadata key that mirrors the active snapshot.
    manifest_key: &'static str,
    revision: i32,
    snapshot: &'a Value,
    capability: &'a Value,
    plugin_id: &'a str,
    provider: &'a str,
    model: &'a str,
    vector_space_id: Option<&'a str>,
    dimension: Option<i32>,
}

/// Writes the manifest's profile key (manifest version + 1), the active profile revision
/// (created by the space's owner) and its head; returns the revision's id.
async fn write_active_profile(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    p: ActiveProfile<'_>,
) -> Result<Uuid, sqlx::Error> {
    sqlx::query(
        "UPDATE knowledge_space_manifests SET metadata = metadata || jsonb_build_object($3::text, $4::jsonb), \
           manifest_version = manifest_version + 1, updated_at = now() \
         WHERE tenant_id = $1 AND knowledge_space_id = $2",
    )
    .bind(tenant)
    .bind(space)
    .bind(p.manifest_key)
    .bind(p.snapshot)
    .execute(&mut *conn)
    .await?;
    let revision_id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO knowledge_space_profile_revisions (id, tenant_id, knowledge_space_id, kind, revision, state, snapshot, \
           snapshot_digest, capability_snapshot, capability_snapshot_digest, plugin_id, provider, model, vector_space_id, \
           dimension, created_by_subject_id, created_at, updated_at, activated_at) \
         SELECT $1, $2, $3, $4, $5, 'active', $6, $7, $8, $9, $10, $11, $12, $13, $14, p.owner_subject_id, \
           now(), now(), now() \
         FROM knowledge_space_access_policies p WHERE p.tenant_id = $2 AND p.knowledge_space_id = $3",
    )
    .bind(revision_id)
    .bind(tenant)
    .bind(space)
    .bind(p.kind)
    .bind(p.revision)
    .bind(p.snapshot)
    .bind(stable_digest(p.snapshot))
    .bind(p.capability)
    .bind(stable_digest(p.capability))
    .bind(p.plugin_id)
    .bind(p.provider)
    .bind(p.model)
    .bind(p.vector_space_id)
    .bind(p.dimension)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO knowledge_space_profile_heads (id, tenant_id, knowledge_space_id, kind, profile_revision_id, \
           active_revision, row_version, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, 1, now(), now())",
    )
    .bind(Uuid::new_v4())
    .bind(tenant)
    .bind(space)
    .bind(p.kind)
    .bind(revision_id)
    .bind(p.revision)
    .execute(conn)
    .await?;
    Ok(revision_id)
}

/// A capability check's time stamp as the platform writes it (UTC, milliseconds).
fn checked_at() -> String {
    Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Gives the space an active embedding profile at revision 1: the manifest's profile key
/// (manifest version + 1), the active profile revision and its head, as the platform's profile
/// activation leaves them.
pub async fn activate_embedding_profile(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    model: &str,
    provider: &str,
    dimension: usize,
) -> Result<Profile, sqlx::Error> {
    let plugin_id = format!("langgenius/{provider}");
    let revision = 1;
    let vsid = vector_space_id(model, &plugin_id, provider, revision);
    let snapshot = json!({ "dimension": dimension, "model": model, "pluginId": plugin_id, "provider": provider,
                           "revision": revision, "vectorSpaceId": vsid });
    let capability = json!({
        "capabilityDigest": format!("sha256:{}", stable_digest(&json!({"dimension": dimension, "kind": "embedding",
            "model": model}))),
        "checkedAt": checked_at(),
        "dimension": dimension, "distanceMetric": "cosine", "kind": "embedding",
        "pluginUniqueIdentifier": format!("{plugin_id}:0.0.1"),
        "schemaFingerprint": format!("sha256:{}", sha256_hex(model.as_bytes())),
        "selection": { "model": model, "pluginId": plugin_id, "provider": provider },
    });
    let revision_id = write_active_profile(
        conn,
        tenant,
        space,
        ActiveProfile {
            kind: "embedding",
            manifest_key: "__knowledgeFsEmbeddingProfile",
            revision,
            snapshot: &snapshot,
            capability: &capability,
            plugin_id: &plugin_id,
            provider,
            model,
            vector_space_id: Some(&vsid),
            dimension: Some(i32::try_from(dimension).unwrap_or(i32::MAX)),
        },
    )
    .await?;
    Ok(Profile {
        revision_id,
        revision,
        model: model.into(),
        plugin_id,
        provider: provider.into(),
        vector_space_id: vsid,
        dimension,
    })
}

/// Gives the space an active retrieval profile at revision 1 (manifest key, revision, head), as
/// the platform's initial activation writes it beside the embedding profile. `research` mode,
/// ten results, no reranking.
pub async fn activate_retrieval_profile(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    model: &str,
    provider: &str,
) -> Result<Uuid, sqlx::Error> {
    let plugin_id = format!("langgenius/{provider}");
    let selection = json!({ "model": model, "pluginId": plugin_id, "provider": provider });
    let snapshot = json!({ "defaultMode": "research", "reasoningModel": selection,
                           "rerank": { "enabled": false }, "revision": 1, "topK": 10 });
    let reasoning = json!({
        "capabilityDigest": format!("sha256:{}", stable_digest(&json!({"kind": "reasoning", "selection": selection}))),
        "checkedAt": checked_at(),
        "kind": "reasoning", "pluginUniqueIdentifier": format!("{plugin_id}:0.0.1"),
        "schemaFingerprint": format!("sha256:{}", sha256_hex(model.as_bytes())),
        "selection": selection,
    });
    let capability = json!({ "reasoning": reasoning, "rerank": null, "verification": "verified" });
    write_active_profile(
        conn,
        tenant,
        space,
        ActiveProfile {
            kind: "retrieval",
            manifest_key: "__knowledgeFsRetrievalProfile",
            revision: 1,
            snapshot: &snapshot,
            capability: &capability,
            plugin_id: &plugin_id,
            provider,
            model,
            vector_space_id: None,
            dimension: None,
        },
    )
    .await
}

/// A space set up for the platform's jobs to run on, as the bench and the chaos run use it.
#[derive(Clone, Debug)]
pub struct NotesSpace {
    pub space: Uuid,
    /// An interactive permission snapshot of the subject that requests research and deletions.
    pub snapshot: Uuid,
    pub documents: Vec<Uuid>,
}

/// A small Markdown note about leases and fencing, different for each `i`.
pub fn sample_note(i: usize) -> String {
    format!(
        "# Note {i}\n\nThe relay publishes outbox row {i} with publisher confirms, and a consumer \
         claims job {i} under a lease before it runs a step.\n\n## Fencing\n\nA worker whose lease \
         expired is fenced out by the row version; checkpoint {i} commits together with its step.\n\n\
         - retries back off exponentially\n- deletions quiesce the document first\n- research cites \
         note {i}\n"
    )
}

/// Creates a space owned by `subject` with an upload source, an interactive permission snapshot
/// for `subject` and `n` sample notes (`note-<i>.md`), in the caller's transaction.
pub async fn create_notes_space(
    conn: &mut PgConnection,
    store: &Store,
    tenant: &str,
    subject: &str,
    slug: &str,
    n: usize,
) -> Result<NotesSpace, PlatformError> {
    let space = create_space(conn, tenant, slug, &format!("{slug} notes"), subject).await?;
    let source = create_source(conn, space, "notes", "upload", None).await?;
    let snapshot =
        create_permission_snapshot(conn, tenant, space, subject, "interactive", None).await?;
    let mut documents = Vec::with_capacity(n);
    for i in 0..n {
        let id = add_document(
            conn,
            store,
            space,
            Some(source),
            &format!("note-{i}.md"),
            "text/markdown",
            Bytes::from(sample_note(i)),
        )
        .await?;
        documents.push(id);
    }
    Ok(NotesSpace {
        space,
        snapshot,
        documents,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_names_follow_the_platform() {
        assert_eq!(
            object_key_prefix("acme corp/eu", Uuid::nil()),
            format!("acme-corp-eu/spaces/{}", Uuid::nil())
        );
        assert_eq!(
            object_key_prefix("//", Uuid::nil()),
            format!("tenant/spaces/{}", Uuid::nil())
        );
        assert_eq!(
            sanitize_filename("dir/My Report (v2).PDF"),
            "my-report-v2-.pdf"
        );
        assert_eq!(sanitize_filename("..."), "upload");
        assert_eq!(
            vector_space_id("text-embedding-3-small", "langgenius/openai", "openai", 1),
            "embedding-space-sha256:dee54439e74d6aa00be2145649df55d567e0587ee48bd89a7b27a9b10a846fa1"
        );
        let scopes = permission_scopes("t", Uuid::nil(), "u", "owner", "only_me");
        assert_eq!(scopes.len(), 5);
        assert!(scopes.windows(2).all(|w| w[0] < w[1]));
        assert!(scopes.contains(&format!(
            "knowledge-space:{}:visibility:only_me:u",
            Uuid::nil()
        )));
    }
}
