//! Uploaded documents and their new versions, keyed and named as the platform's upload does.
//! Invariant: a document's bytes reach the object store before the row that names them is
//! written, and the row records the key, checksum and size of exactly those bytes.

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
