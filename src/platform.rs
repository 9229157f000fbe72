//! The platform's own rows that jobs work on: spaces, sources, documents and permission
//! snapshots. The platform's API writes these; kfs-worker writes them only for its demo, its
//! tests and its command line. Invariant: every row is written complete (the schema has no
//! defaults to lean on) and scoped to its tenant and space; document bytes go to the object
//! store before the row that names them commits.

use bytes::Bytes;
use sha2::{Digest, Sha256};
use sqlx::PgConnection;
use uuid::Uuid;

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

pub async fn create_space(
    conn: &mut PgConnection,
    tenant: &str,
    slug: &str,
    name: &str,
) -> Result<Uuid, sqlx::Error> {
    let id = Uuid::now_v7();
    sqlx::query(
        r#"INSERT INTO knowledge_spaces (id, tenant_id, slug, name, description, created_at, updated_at)
           VALUES ($1, $2, $3, $4, NULL, now(), now())"#,
    )
    .bind(id)
    .bind(tenant)
    .bind(slug)
    .bind(name)
    .execute(conn)
    .await?;
    Ok(id)
}

pub async fn create_source(
    conn: &mut PgConnection,
    space: Uuid,
    name: &str,
    kind: &str,
    credential_ref: Option<&str>,
) -> Result<Uuid, sqlx::Error> {
    let id = Uuid::now_v7();
    sqlx::query(
        r#"INSERT INTO sources (id, knowledge_space_id, type, status, name, uri, metadata, permission_scope, version,
             credential_ref, created_at, updated_at)
           VALUES ($1, $2, $3, 'active', $4, NULL, '{}'::jsonb, '{}'::jsonb, 1, $5, now(), now())"#,
    )
    .bind(id)
    .bind(space)
    .bind(kind)
    .bind(name)
    .bind(credential_ref)
    .execute(conn)
    .await?;
    Ok(id)
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The object key of a document version.
pub fn document_key(space: Uuid, document: Uuid, version: i32, filename: &str) -> String {
    let safe: String = filename
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("spaces/{space}/documents/{document}/v{version}/{safe}")
}

/// Uploads the bytes, then writes the document row (version 1).
pub async fn add_document(
    conn: &mut PgConnection,
    store: &Store,
    space: Uuid,
    source: Option<Uuid>,
    filename: &str,
    mime_type: &str,
    bytes: Bytes,
) -> Result<Uuid, PlatformError> {
    let id = Uuid::now_v7();
    let key = document_key(space, id, 1, filename);
    store.put(&key, bytes.clone()).await?;
    sqlx::query(
        r#"INSERT INTO document_assets (id, knowledge_space_id, source_id, filename, mime_type, object_key, sha256,
             size_bytes, version, parser_status, metadata, created_at, updated_at)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 1, 'pending', '{}'::jsonb, now(), now())"#,
    )
    .bind(id)
    .bind(space)
    .bind(source)
    .bind(filename)
    .bind(mime_type)
    .bind(&key)
    .bind(sha256_hex(&bytes))
    .bind(i64::try_from(bytes.len()).unwrap_or(i64::MAX))
    .execute(conn)
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
    let row: Option<(Uuid, String, i32)> =
        sqlx::query_as("SELECT knowledge_space_id, filename, version FROM document_assets WHERE id = $1 FOR UPDATE")
            .bind(document)
            .fetch_optional(&mut *conn)
            .await?;
    let (space, filename, version) =
        row.ok_or_else(|| PlatformError::NotFound(format!("no document {document}")))?;
    let next = version + 1;
    let key = document_key(space, document, next, &filename);
    store.put(&key, bytes.clone()).await?;
    sqlx::query(
        r#"UPDATE document_assets SET version = $2, object_key = $3, sha256 = $4, size_bytes = $5,
             parser_status = 'pending', row_version = row_version + 1, updated_at = now()
           WHERE id = $1"#,
    )
    .bind(document)
    .bind(next)
    .bind(&key)
    .bind(sha256_hex(&bytes))
    .bind(i64::try_from(bytes.len()).unwrap_or(i64::MAX))
    .execute(conn)
    .await?;
    Ok(next)
}

/// A permission snapshot for `subject` on `channel`, valid until `expires_at` (None: no expiry).
pub async fn create_permission_snapshot(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    subject: &str,
    channel: &str,
    expires_at: Option<chrono::DateTime<chrono::Utc>>,
) -> Result<Uuid, sqlx::Error> {
    let id = Uuid::now_v7();
    sqlx::query(
        r#"INSERT INTO knowledge_space_permission_snapshots (id, tenant_id, knowledge_space_id, subject_id,
             access_channel, revision, status, expires_at, revoked_at, scopes, created_at)
           VALUES ($1, $2, $3, $4, $5, 1, 'active', $6, NULL, '["read", "write", "delete"]'::jsonb, now())"#,
    )
    .bind(id)
    .bind(tenant)
    .bind(space)
    .bind(subject)
    .bind(channel)
    .bind(expires_at)
    .execute(conn)
    .await?;
    Ok(id)
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

/// Creates a space with an upload source, an interactive permission snapshot for `subject`
/// and `n` sample notes (`note-<i>.md`), in the caller's transaction.
pub async fn create_notes_space(
    conn: &mut PgConnection,
    store: &Store,
    tenant: &str,
    subject: &str,
    slug: &str,
    n: usize,
) -> Result<NotesSpace, PlatformError> {
    let space = create_space(conn, tenant, slug, &format!("{slug} notes")).await?;
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
