//! Uploaded documents and their new versions, keyed and named as the platform's upload does.
//! Invariant: a document's bytes reach the object store before the row that names them is
//! written, and the row records the key, checksum and size of exactly those bytes; every asset
//! version written here has its logical document's `candidate` revision beside it (expecting the
//! document's active revision and row version at the time), which a compile request binds to its
//! attempt and the compile's publish activates.

use bytes::Bytes;
use serde_json::json;
use sqlx::PgConnection;
use uuid::Uuid;

use super::PlatformError;
use crate::canonical::sha256_hex;
use crate::store::Store;

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
    // The platform's upload: a new logical document (pending, row version 0, titled by the file)
    // and its first revision, a candidate.
    let logical = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO logical_documents (id, tenant_id, knowledge_space_id, source_id, provider_item_id, \
           provider_item_digest, title, status, active_revision, row_version, system_metadata, user_metadata, \
           created_at, updated_at) \
         VALUES ($1, $2, $3, NULL, NULL, NULL, $4, 'pending', NULL, 0, '{}'::jsonb, '{}'::jsonb, now(), now())",
    )
    .bind(logical)
    .bind(&tenant)
    .bind(space)
    .bind(filename)
    .execute(&mut *conn)
    .await?;
    candidate_revision(conn, &tenant, space, logical, id, 1).await?;
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

/// Writes logical document `document`'s next revision for version `version` of `asset`, a
/// `candidate` expecting the document's current active revision and row version (the
/// platform's `createCandidateRevision`): content hash, MIME type and size are the asset's.
/// Returns the revision number.
async fn candidate_revision(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    document: Uuid,
    asset: Uuid,
    version: i32,
) -> Result<i32, PlatformError> {
    sqlx::query_scalar(
        "INSERT INTO document_revisions (tenant_id, knowledge_space_id, document_id, revision, document_asset_id, \
           document_asset_version, expected_active_revision, expected_document_row_version, content_hash, mime_type, \
           size_bytes, state, system_metadata, created_at, activated_at) \
         SELECT l.tenant_id, l.knowledge_space_id, l.id, \
           (SELECT coalesce(max(r.revision), 0) + 1 FROM document_revisions r \
             WHERE r.tenant_id = l.tenant_id AND r.knowledge_space_id = l.knowledge_space_id AND r.document_id = l.id), \
           d.id, d.version, l.active_revision, l.row_version, lower(d.sha256), d.mime_type, d.size_bytes, 'candidate', \
           '{}'::jsonb, now(), NULL \
         FROM logical_documents l JOIN document_assets d ON d.knowledge_space_id = l.knowledge_space_id \
         WHERE l.tenant_id = $1 AND l.knowledge_space_id = $2 AND l.id = $3 AND d.id = $4 AND d.version = $5 \
         RETURNING revision",
    )
    .bind(tenant)
    .bind(space)
    .bind(document)
    .bind(asset)
    .bind(version)
    .fetch_optional(conn)
    .await?
    .ok_or_else(|| {
        PlatformError::NotFound(format!(
            "no logical document {document} with asset {asset} version {version} in space {space}"
        ))
    })
}

/// The logical document an asset was uploaded as: the one with a revision of it.
pub async fn logical_document_of(
    conn: &mut PgConnection,
    asset: Uuid,
) -> Result<Option<Uuid>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT document_id FROM document_revisions WHERE document_asset_id = $1 \
         ORDER BY document_asset_version DESC, revision DESC LIMIT 1",
    )
    .bind(asset)
    .fetch_optional(conn)
    .await
}

/// Uploads a new revision of logical document `document` as a new asset, as the platform's
/// upload to an existing document does: the asset (version 1, `pending`) with its staged commit,
/// and the document's next revision, a `candidate` expecting its active revision. Returns the new
/// asset's id; compiling it activates the revision and supersedes the one active before.
pub async fn add_revision(
    conn: &mut PgConnection,
    store: &Store,
    document: Uuid,
    filename: &str,
    mime_type: &str,
    bytes: Bytes,
) -> Result<Uuid, PlatformError> {
    let row: Option<(Uuid, String, String)> = sqlx::query_as(
        "SELECT l.knowledge_space_id, l.tenant_id::text, p.owner_subject_id::text FROM logical_documents l \
         JOIN knowledge_space_access_policies p ON p.tenant_id = l.tenant_id AND p.knowledge_space_id = l.knowledge_space_id \
         WHERE l.id = $1 FOR UPDATE OF l",
    )
    .bind(document)
    .fetch_optional(&mut *conn)
    .await?;
    let (space, tenant, owner) =
        row.ok_or_else(|| PlatformError::NotFound(format!("no logical document {document}")))?;
    let id = Uuid::new_v4();
    let key = document_key(&tenant, space, id, 1, filename);
    let sha = sha256_hex(&bytes);
    let size = i32::try_from(bytes.len()).unwrap_or(i32::MAX);
    store.put(&key, bytes).await?;
    sqlx::query(
        "INSERT INTO document_assets (id, knowledge_space_id, source_id, filename, mime_type, object_key, sha256, \
           size_bytes, metadata, parser_status, version, created_at) \
         VALUES ($1, $2, NULL, $3, $4, $5, $6, $7, $8, 'pending', 1, now())",
    )
    .bind(id)
    .bind(space)
    .bind(filename)
    .bind(mime_type)
    .bind(&key)
    .bind(&sha)
    .bind(size)
    .bind(json!({ "permissionScope": [], "tenantId": tenant, "traceId": Uuid::new_v4(), "uploadedBy": owner }))
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
    candidate_revision(conn, &tenant, space, document, id, 1).await?;
    Ok(id)
}

/// Uploads new bytes for a document and bumps its version in place. Returns the new version.
///
/// The version an asset's revisions and compile attempts name cannot change under them (their
/// foreign keys), so this is for a document not yet handed to a compilation: its unbound
/// candidate revision of the old version is discarded (the platform's `discardUnboundCandidate`)
/// and a candidate of the new version written. A document already compiled gets a new revision
/// through [`add_revision`] instead.
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
    let logical = logical_document_of(conn, document).await?;
    sqlx::query(
        "DELETE FROM document_revisions WHERE tenant_id = $1 AND knowledge_space_id = $2 \
           AND document_asset_id = $3 AND document_asset_version = $4 AND state = 'candidate' \
           AND compilation_attempt_id IS NULL",
    )
    .bind(&tenant)
    .bind(space)
    .bind(document)
    .bind(version)
    .execute(&mut *conn)
    .await?;
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
    .execute(&mut *conn)
    .await?;
    if let Some(logical) = logical {
        candidate_revision(conn, &tenant, space, logical, document, next).await?;
    }
    Ok(next)
}
