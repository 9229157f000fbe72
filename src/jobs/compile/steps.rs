//! What every compile step reads, and the first step, inside the engine's fenced transaction:
//! the attempt (with the authority and profile tuple it was requested under) and its document
//! (share-locked), the go/no-go facts, the space's embedding profile, the document's
//! hash-checked bytes and its parse artifact, and `queued → parsed`.
//! Invariant: a step writes only rows of its attempt's own tenant, space, document and
//! publication generation (the parse artifact is the document version's, its first id kept), so
//! a step repeated after a crash writes its rows once; later steps read what earlier ones
//! committed (the parse artifact), never a parse held in memory.

use serde_json::{json, Value};
use sqlx::PgConnection;
use uuid::Uuid;

use super::artifact::{self, Element};
use super::checkpoint;
use super::media;
use super::parse::{
    self,
    route::{self, Parsers, Source},
};
use super::profiles::{self, Frozen};
use super::walk::{Facts, Gate, Served};
use crate::access::Authority;
use crate::embed::Profile;
use crate::jobs::{JobError, Step};
use crate::store::{Store, StoreError};

/// The attempt being worked on, read from its (already fenced and locked) row.
#[derive(Clone, Debug)]
pub(crate) struct Attempt {
    pub id: Uuid,
    pub tenant: String,
    pub space: Uuid,
    pub document: Uuid,
    pub version: i32,
    pub generation: Uuid,
    pub base_head_revision: i32,
    pub candidate: Option<(Uuid, String)>,
    pub created_at: chrono::DateTime<chrono::Utc>,
    /// What the attempt was requested under (0016 requester binding, 0026 capability grant).
    pub authority: Authority,
    /// The profile tuple it froze (0019), if any.
    pub profiles: Option<Frozen>,
    /// The frozen embedding profile and its digest, for the steps that build with it (read by
    /// the handler from the stored revision; `None` until then and without one).
    pub embedding: Option<(Profile, String)>,
}

/// The attempt's document, share-locked for the rest of the step.
#[derive(Clone, Debug)]
pub(crate) struct Document {
    pub version: i32,
    pub active: bool,
    pub space_active: bool,
    pub filename: String,
    pub mime_type: String,
    pub object_key: String,
    pub sha256: String,
    pub permission_scope: Value,
    /// The document's metadata (the parser hints: `language`, `layoutComplexity`, ...).
    pub metadata: Value,
}

#[derive(sqlx::FromRow)]
struct AttemptRow {
    id: Uuid,
    tenant_id: String,
    knowledge_space_id: Uuid,
    document_asset_id: Uuid,
    document_version: i32,
    publication_generation_id: Uuid,
    base_head_revision: i32,
    candidate_publication_id: Option<Uuid>,
    candidate_fingerprint: Option<String>,
    created_at: chrono::DateTime<chrono::Utc>,
    requested_by_subject_id: Option<String>,
    permission_snapshot_id: Option<Uuid>,
    permission_snapshot_revision: Option<i32>,
    access_channel: Option<String>,
    capability_grant_id: Option<Uuid>,
    embedding_profile_kind: Option<String>,
    embedding_profile_revision_id: Option<Uuid>,
    embedding_profile_revision: Option<i32>,
    embedding_profile_snapshot_digest: Option<String>,
    retrieval_profile_kind: Option<String>,
    retrieval_profile_revision_id: Option<Uuid>,
    retrieval_profile_revision: Option<i32>,
    retrieval_profile_snapshot_digest: Option<String>,
}

/// Loads the attempt. A row that binds a mix of authorities fails closed
/// (`DOCUMENT_COMPILATION_FAILED`), as the platform's publish fence refuses one.
pub(crate) async fn load_attempt(conn: &mut PgConnection, id: Uuid) -> Result<Attempt, JobError> {
    let r: AttemptRow = sqlx::query_as(&format!("{ATTEMPT_SQL} WHERE id = $1"))
        .bind(id)
        .fetch_optional(&mut *conn)
        .await?
        .ok_or_else(|| JobError::fatal("attempt_missing", format!("no attempt {id}")))?;
    attempt_of(r)
}

/// Loads several attempts in one read; those whose rows bind no valid authority or profile
/// tuple (see [`load_attempt`]) are left out.
pub(crate) async fn load_attempts(
    conn: &mut PgConnection,
    ids: &[Uuid],
) -> Result<Vec<Attempt>, JobError> {
    let rows: Vec<AttemptRow> = sqlx::query_as(&format!(
        "{ATTEMPT_SQL} WHERE id = ANY($1) ORDER BY created_at, id"
    ))
    .bind(ids)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|r| attempt_of(r).ok())
        .collect())
}

const ATTEMPT_SQL: &str = "SELECT id, tenant_id::text AS tenant_id, knowledge_space_id, document_asset_id, document_version, \
           publication_generation_id, base_head_revision, candidate_publication_id, \
           candidate_fingerprint::text AS candidate_fingerprint, created_at, \
           requested_by_subject_id::text AS requested_by_subject_id, permission_snapshot_id, \
           permission_snapshot_revision, access_channel::text AS access_channel, capability_grant_id, \
           embedding_profile_kind::text AS embedding_profile_kind, embedding_profile_revision_id, \
           embedding_profile_revision, embedding_profile_snapshot_digest::text AS embedding_profile_snapshot_digest, \
           retrieval_profile_kind::text AS retrieval_profile_kind, retrieval_profile_revision_id, \
           retrieval_profile_revision, retrieval_profile_snapshot_digest::text AS retrieval_profile_snapshot_digest \
         FROM document_compilation_attempts";

fn attempt_of(r: AttemptRow) -> Result<Attempt, JobError> {
    let authority = Authority::from_columns(
        r.capability_grant_id,
        r.requested_by_subject_id,
        r.permission_snapshot_id,
        r.permission_snapshot_revision,
        r.access_channel,
    )
    .map_err(|why| JobError::fatal(profiles::COMPILATION_FAILED, why))?;
    let profiles = profiles::from_columns(
        (
            r.embedding_profile_kind,
            r.embedding_profile_revision_id,
            r.embedding_profile_revision,
            r.embedding_profile_snapshot_digest,
        ),
        (
            r.retrieval_profile_kind,
            r.retrieval_profile_revision_id,
            r.retrieval_profile_revision,
            r.retrieval_profile_snapshot_digest,
        ),
    )
    .map_err(|why| JobError::fatal(profiles::SNAPSHOT_INVALID, why))?;
    Ok(Attempt {
        id: r.id,
        tenant: r.tenant_id,
        space: r.knowledge_space_id,
        document: r.document_asset_id,
        version: r.document_version,
        generation: r.publication_generation_id,
        base_head_revision: r.base_head_revision,
        candidate: r.candidate_publication_id.zip(r.candidate_fingerprint),
        created_at: r.created_at,
        authority,
        profiles,
        embedding: None,
    })
}

pub(crate) async fn load_document(
    conn: &mut PgConnection,
    a: &Attempt,
) -> Result<Document, JobError> {
    let row: Option<DocumentRow> =
        sqlx::query_as(&format!("{DOCUMENT_SQL} AND d.id = $3 FOR SHARE OF d"))
            .bind(&a.tenant)
            .bind(a.space)
            .bind(a.document)
            .fetch_optional(&mut *conn)
            .await?;
    row.map(|r| document_of(r).1).ok_or_else(|| {
        JobError::fatal(
            "document_missing",
            format!(
                "document {} is not in space {} of tenant {}",
                a.document, a.space, a.tenant
            ),
        )
    })
}

/// Several documents of one space in one read, share-locked like [`load_document`]'s: id →
/// document (those not in the space are missing).
pub(crate) async fn load_documents(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    ids: &[Uuid],
) -> Result<std::collections::HashMap<Uuid, Document>, JobError> {
    let rows: Vec<DocumentRow> = sqlx::query_as(&format!(
        "{DOCUMENT_SQL} AND d.id = ANY($3) ORDER BY d.id FOR SHARE OF d"
    ))
    .bind(tenant)
    .bind(space)
    .bind(ids)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows.into_iter().map(document_of).collect())
}

type DocumentRow = (
    Uuid,
    i32,
    String,
    String,
    String,
    String,
    String,
    String,
    Value,
);

const DOCUMENT_SQL: &str =
    "SELECT d.id, d.version, d.lifecycle_state::text, s.lifecycle_state::text, d.filename, \
       d.mime_type, d.object_key, d.sha256, d.metadata \
     FROM document_assets d JOIN knowledge_spaces s ON s.id = d.knowledge_space_id \
     WHERE s.tenant_id = $1 AND d.knowledge_space_id = $2";

fn document_of(r: DocumentRow) -> (Uuid, Document) {
    let (id, version, doc_state, space_state, filename, mime_type, object_key, sha256, metadata) =
        r;
    let permission_scope = match metadata.get("permissionScope") {
        Some(v @ Value::Array(_)) => v.clone(),
        _ => json!([]),
    };
    (
        id,
        Document {
            version,
            active: doc_state == "active",
            space_active: space_state == "active",
            filename,
            mime_type,
            object_key,
            sha256,
            permission_scope,
            metadata,
        },
    )
}

/// For each of `documents`, the highest version with an active attempt other than `except`.
pub(crate) async fn newest_other_active_many(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    documents: &[Uuid],
    except: &[Uuid],
) -> Result<std::collections::HashMap<Uuid, i32>, JobError> {
    let rows: Vec<(Uuid, i32)> = sqlx::query_as(
        "SELECT document_asset_id, max(document_version) FROM document_compilation_attempts \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND document_asset_id = ANY($3) AND active_slot = 1 \
           AND id <> ALL($4) GROUP BY 1",
    )
    .bind(tenant)
    .bind(space)
    .bind(documents)
    .bind(except)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows.into_iter().collect())
}

/// The highest version of this document with another active attempt.
pub(crate) async fn newest_other_active(
    conn: &mut PgConnection,
    a: &Attempt,
) -> Result<Option<i32>, JobError> {
    Ok(sqlx::query_scalar(
        "SELECT max(document_version) FROM document_compilation_attempts \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND document_asset_id = $3 AND active_slot = 1 AND id <> $4",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.document)
    .bind(a.id)
    .fetch_one(&mut *conn)
    .await?)
}

pub(crate) fn facts(
    a: &Attempt,
    d: &Document,
    newest: Option<i32>,
    served: Option<Served>,
) -> Facts {
    Facts {
        version: a.version,
        document_version: d.version,
        document_active: d.active,
        space_active: d.space_active,
        newest_other_active: newest,
        served,
    }
}

/// What a closed gate makes of the step; `None` when the gate is open.
pub(crate) fn stop(gate: Gate) -> Option<Result<Step, JobError>> {
    Some(match gate {
        Gate::Go => return None,
        Gate::Supersede(message) => Ok(Step::Supersede { message }),
        Gate::Deleting(message) => Ok(Step::Cancel {
            code: "document_deleting".into(),
            message,
        }),
        Gate::Invalid(message) => Err(JobError::fatal("version_mismatch", message)),
    })
}

/// The space's active embedding profile, if it has one (research's reads; a compile builds with
/// its attempt's frozen one, [`profiles::frozen_embedding`]).
pub(crate) async fn embedding_profile(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<Option<(Profile, String)>, sqlx::Error> {
    type Row = (
        Uuid,
        i32,
        String,
        String,
        String,
        Option<String>,
        Option<i32>,
        String,
    );
    let row: Option<Row> = sqlx::query_as(
        "SELECT r.id, r.revision, r.model::text, r.plugin_id::text, r.provider::text, r.vector_space_id::text, \
           r.dimension, r.snapshot_digest::text \
         FROM knowledge_space_profile_heads h \
         JOIN knowledge_space_profile_revisions r ON r.id = h.profile_revision_id AND r.tenant_id = h.tenant_id \
           AND r.knowledge_space_id = h.knowledge_space_id AND r.kind = h.kind AND r.revision = h.active_revision \
         WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2 AND h.kind = 'embedding' AND r.state = 'active'",
    )
    .bind(tenant)
    .bind(space)
    .fetch_optional(conn)
    .await?;
    Ok(row.and_then(
        |(id, revision, model, plugin_id, provider, vsid, dim, digest)| {
            Some((
                Profile {
                    revision_id: id,
                    revision,
                    model,
                    plugin_id,
                    provider,
                    vector_space_id: vsid?,
                    dimension: usize::try_from(dim?).ok()?,
                },
                digest,
            ))
        },
    ))
}

/// Reads the document's bytes and checks them against the recorded SHA-256.
pub(crate) async fn read_bytes(store: &Store, d: &Document) -> Result<bytes::Bytes, JobError> {
    let bytes = store.get(&d.object_key).await.map_err(|e| match e {
        StoreError::Other(m) => JobError::retryable("store_unavailable", m),
        StoreError::NotFound(_) => JobError::fatal(
            "object_missing",
            format!("the bytes of {:?} are not in the object store", d.filename),
        ),
        StoreError::BadKey(_) => JobError::fatal(
            "object_missing",
            format!("the object key of {:?} is not a valid key", d.filename),
        ),
    })?;
    let actual = crate::canonical::sha256_hex(&bytes);
    if !actual.eq_ignore_ascii_case(d.sha256.trim()) {
        return Err(JobError::fatal(
            "hash_mismatch",
            format!(
                "the stored bytes of {:?} hash to {actual}, the document records {}",
                d.filename, d.sha256
            ),
        ));
    }
    Ok(bytes)
}

/// The document version's parse artifact.
#[derive(Clone, Debug)]
pub(crate) struct Artifact {
    pub id: Uuid,
    pub hash: String,
    pub parser: String,
    pub parser_version: String,
    pub content_type: String,
    pub elements: Vec<Element>,
}

pub(crate) async fn load_artifact(
    conn: &mut PgConnection,
    a: &Attempt,
) -> Result<Artifact, JobError> {
    let row: Option<(Uuid, String, String, String, Value, Value)> = sqlx::query_as(
        "SELECT id, artifact_hash, parser, content_type, elements, metadata FROM parse_artifacts \
         WHERE document_asset_id = $1 AND version = $2",
    )
    .bind(a.document)
    .bind(a.version)
    .fetch_optional(&mut *conn)
    .await?;
    let (id, hash, parser, content_type, elements, metadata) = row.ok_or_else(|| {
        JobError::fatal(
            "artifact_missing",
            format!(
                "document {} version {} has no parse artifact",
                a.document, a.version
            ),
        )
    })?;
    let elements: Vec<Element> = serde_json::from_value(elements).map_err(|e| {
        JobError::fatal(
            "artifact_invalid",
            format!("the parse artifact's elements cannot be read: {e}"),
        )
    })?;
    Ok(Artifact {
        id,
        hash,
        parser,
        parser_version: metadata["parserVersion"].as_str().unwrap_or("").to_owned(),
        content_type,
        elements,
    })
}

/// Before `queued → parsed` of a PDF or office document, outside any transaction (see
/// [`crate::jobs::Handler::prepare`]): the bytes are read and checked, and unless a raw-parse
/// checkpoint made under the route's current policy is there, parsed through the route and
/// checkpointed under the attempt's lease. An attempt its grant no longer authorizes, or whose
/// document is gone or not a document, is left to the step, which ends it as it would anyway.
pub(crate) async fn prepare_parse(
    conn: &mut PgConnection,
    store: &Store,
    parsers: &Parsers,
    job: &crate::jobs::JobCtx,
) -> Result<(), JobError> {
    // Most documents are text: one read tells, and they go straight to the step.
    let named: Option<(String, String)> = sqlx::query_as(
        "SELECT d.mime_type, d.filename FROM document_compilation_attempts a \
         JOIN document_assets d ON d.id = a.document_asset_id WHERE a.id = $1",
    )
    .bind(job.job_id)
    .fetch_optional(&mut *conn)
    .await?;
    if !named.is_some_and(|(mime, name)| {
        parse::detect(&mime, &name).is_ok_and(parse::Format::is_document)
    }) {
        return Ok(());
    }
    let a = load_attempt(conn, job.job_id).await?;
    if let Some(grant) = a.authority.grant() {
        let verdict = crate::capability::check(conn, &a.tenant, a.space, grant).await?;
        if verdict.into_result().is_err() {
            return Ok(());
        }
    }
    let Ok(d) = load_document(conn, &a).await else {
        return Ok(());
    };
    let Ok(format) = parse::detect(&d.mime_type, &d.filename) else {
        return Ok(());
    };
    if !format.is_document() || !d.active || !d.space_active || d.version != a.version {
        return Ok(());
    }
    let bytes = read_bytes(store, &d).await?;
    let src = source(&a, &d, format, &bytes);
    let fingerprint = parsers.policy_fingerprint(&src);
    if checkpoint::matching(conn, a.document, a.version, &fingerprint)
        .await?
        .is_some()
    {
        crate::metrics::parse_checkpoint("reused");
        tracing::debug!(attempt = %a.id, "raw-parse checkpoint reused");
        return Ok(());
    }
    let id = artifact_id_of(conn, &a).await?;
    let parsed = parsers.parse(&src, id).await?;
    let json = parsed.to_json(a.document, a.version);
    if checkpoint::write(conn, job, a.document, a.version, &fingerprint, &json).await? {
        crate::metrics::parse_checkpoint("written");
        tracing::debug!(attempt = %a.id, elements = parsed.elements.len(), "raw-parse checkpoint written");
        crate::crash::point("compile-after-parse-checkpoint");
    }
    Ok(())
}

fn source<'a>(a: &Attempt, d: &'a Document, format: parse::Format, bytes: &'a [u8]) -> Source<'a> {
    Source {
        asset: a.document,
        version: a.version,
        format,
        bytes,
        filename: &d.filename,
        mime_type: &d.mime_type,
        metadata: &d.metadata,
    }
}

/// The document version's artifact id: the one it has, else the platform's deterministic one.
async fn artifact_id_of(conn: &mut PgConnection, a: &Attempt) -> Result<Uuid, JobError> {
    Ok(existing_artifact_id(conn, a)
        .await?
        .unwrap_or_else(|| route::artifact_id(a.document, a.version)))
}

/// The id of the document version's parse artifact, when it has one (the first id is kept).
async fn existing_artifact_id(
    conn: &mut PgConnection,
    a: &Attempt,
) -> Result<Option<Uuid>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT id FROM parse_artifacts WHERE document_asset_id = $1 AND version = $2",
    )
    .bind(a.document)
    .bind(a.version)
    .fetch_optional(&mut *conn)
    .await
}

/// `queued → parsed` of a PDF or office document: the raw-parse checkpoint the preparation
/// left becomes the canonical artifact, and the checkpoint is deleted, in the step's
/// transaction. Without one (another attempt took it meanwhile) the step is tried again.
async fn store_checkpointed(
    conn: &mut PgConnection,
    store: &Store,
    parsers: &Parsers,
    a: &Attempt,
    d: &Document,
    format: parse::Format,
    bytes: &[u8],
) -> Result<(), JobError> {
    let fingerprint = parsers.policy_fingerprint(&source(a, d, format, bytes));
    let Some(mut parsed) = checkpoint::matching(conn, a.document, a.version, &fingerprint).await?
    else {
        return Err(JobError::retryable(
            "DOCUMENT_COMPILATION_RETRYABLE",
            format!(
                "the raw parse of {:?} is no longer checkpointed; parsing it again",
                d.filename
            ),
        ));
    };
    // Inline images go to the object store, under the document's prefix and this attempt.
    let marker = format!("/documents/{}", a.document);
    let prefix = match d.object_key.find(&marker) {
        Some(at) => d.object_key[..at + marker.len()].to_owned(),
        None => format!("{}/spaces/{}{marker}", a.tenant, a.space),
    };
    let extracted = media::extract(store, &prefix, a.id, &mut parsed.elements).await?;
    if let (Some(m), Some(obj)) = (media::metadata(&extracted), parsed.metadata.as_object_mut()) {
        obj.insert("multimodalAssets".into(), m);
    }
    sqlx::query(
        "INSERT INTO parse_artifacts (id, document_asset_id, version, parser, content_type, artifact_hash, elements, \
           metadata, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, now()) \
         ON CONFLICT (document_asset_id, version) DO UPDATE SET parser = EXCLUDED.parser, \
           content_type = EXCLUDED.content_type, artifact_hash = EXCLUDED.artifact_hash, \
           elements = EXCLUDED.elements, metadata = EXCLUDED.metadata, updated_at = now()",
    )
    .bind(parsed.id)
    .bind(a.document)
    .bind(a.version)
    .bind(route::PARSER)
    .bind(artifact::content_type_of(&parsed.elements))
    .bind(&parsed.hash)
    .bind(serde_json::to_value(&parsed.elements).unwrap_or_else(|_| json!([])))
    .bind(&parsed.metadata)
    .execute(&mut *conn)
    .await?;
    checkpoint::delete(conn, a.document, a.version, &fingerprint).await?;
    Ok(())
}

/// queued → parsed: the bytes are there, match their hash and parse; the canonical parse goes to
/// `parse_artifacts` (one per document version, its first id kept).
pub(crate) async fn parse_step(
    conn: &mut PgConnection,
    store: &Store,
    parsers: &Parsers,
    a: &Attempt,
    d: &Document,
) -> Result<(), JobError> {
    let bytes = read_bytes(store, d).await?;
    let format = parse::detect(&d.mime_type, &d.filename)
        .map_err(|e| JobError::fatal(e.code(), e.to_string()))?;
    if format.is_document() {
        return store_checkpointed(conn, store, parsers, a, d, format, &bytes).await;
    }
    // The platform parses plain text as Markdown.
    let as_format = if format == parse::Format::Text {
        parse::Format::Markdown
    } else {
        format
    };
    let parsed =
        parse::parse(as_format, &bytes).map_err(|e| JobError::fatal(e.code(), e.to_string()))?;
    let id = existing_artifact_id(conn, a)
        .await?
        .unwrap_or_else(Uuid::new_v4);
    let elements = artifact::elements(id, &parsed);
    let (parser, parser_version) = artifact::parser_of(format);
    tracing::debug!(attempt = %a.id, elements = elements.len(), parser, "parsed");
    sqlx::query(
        "INSERT INTO parse_artifacts (id, document_asset_id, version, parser, content_type, artifact_hash, elements, \
           metadata, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, now()) \
         ON CONFLICT (document_asset_id, version) DO UPDATE SET parser = EXCLUDED.parser, \
           content_type = EXCLUDED.content_type, artifact_hash = EXCLUDED.artifact_hash, \
           elements = EXCLUDED.elements, metadata = EXCLUDED.metadata",
    )
    .bind(id)
    .bind(a.document)
    .bind(a.version)
    .bind(parser)
    .bind(artifact::content_type_of(&elements))
    .bind(artifact::artifact_hash(parser_version, &bytes))
    .bind(serde_json::to_value(&elements).unwrap_or_else(|_| json!([])))
    .bind(artifact::metadata(
        &d.filename,
        &d.mime_type,
        parser,
        parser_version,
    ))
    .execute(&mut *conn)
    .await?;
    Ok(())
}
