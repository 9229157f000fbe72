//! Writing compile jobs as the platform's API does: request, release of a deferred dispatch,
//! manual retry, and reading an attempt back. Invariant: each function runs in the caller's
//! transaction (inside a savepoint, so a refusal leaves that transaction usable), writes the
//! attempt and its one outbox row together or not at all, and refuses with a typed
//! [`CompileError`] (never a raw SQL error) when the document is deleting or disabled, another
//! attempt is already active for the same tenant, space, document and version, or the authority
//! given (one permission snapshot or one capability grant, never both) does not authorize it. A
//! request freezes the space's active profile heads onto the attempt and binds the document
//! version's unbound candidate revision to it; a retry restores the attempt's logical-document
//! intent with the attempt.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

use super::{intents, profiles};
use crate::capability;
use crate::jobs::COMPILE;

/// The `available_at` of an outbox row whose dispatch is deferred until released.
pub const DEFERRED_UNTIL: &str = "9999-12-31T23:59:59.999Z";

/// The unique index that allows one active attempt per tenant, space, document and version.
pub const ACTIVE_UNIQUE_INDEX: &str = "document_compilation_attempts_scope_version_active_uq";

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestOptions {
    /// Write the outbox row with `available_at` far in the future; [`release`] sends it.
    pub defer: bool,
    /// Who asks, under which permission snapshot: recorded on the attempt as the platform's
    /// requester binding (0016), all four columns, or none when `None`.
    pub requester: Option<Requester>,
    /// The capability grant that authorizes the request instead (0026): recorded alone, the four
    /// requester columns NULL. At most one of `requester` and `grant`.
    pub grant: Option<Uuid>,
}

/// The requester of a compilation and the permission snapshot that authorises it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Requester {
    pub subject: String,
    pub snapshot: Uuid,
}

#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error("no document {0}")]
    DocumentNotFound(Uuid),
    #[error("document {document} is being deleted ({what}); it cannot be compiled")]
    DocumentDeleting { document: Uuid, what: String },
    #[error(
        "document {document} version {version} already has an active compilation attempt{}",
        .attempt.map(|a| format!(" {a}")).unwrap_or_default()
    )]
    ActiveAttemptExists {
        document: Uuid,
        version: i32,
        attempt: Option<Uuid>,
    },
    #[error("no compilation attempt {0}")]
    AttemptNotFound(Uuid),
    #[error("attempt {attempt} is {run_state}; only a failed attempt can be retried")]
    NotRetryable { attempt: Uuid, run_state: String },
    #[error("attempt {attempt} is not waiting for release (run_state {run_state}, outbox {outbox_status}, not deferred)")]
    NotDeferred {
        attempt: Uuid,
        run_state: String,
        outbox_status: String,
    },
    #[error("attempt {attempt} compiles version {version}, but document {document} is now at version {current}; request a new compilation instead")]
    VersionMoved {
        attempt: Uuid,
        document: Uuid,
        version: i32,
        current: i32,
    },
    #[error("attempt {attempt} did not end within {waited:?} (run_state {run_state}, checkpoint {checkpoint})")]
    Timeout {
        attempt: Uuid,
        waited: Duration,
        run_state: String,
        checkpoint: String,
    },
    #[error("permission snapshot {snapshot} cannot authorise this request: {why}")]
    Snapshot { snapshot: Uuid, why: String },
    #[error("capability grant {grant} cannot authorise this request: {why}")]
    Grant { grant: Uuid, why: String },
    #[error(
        "a compilation is authorised by one permission snapshot or one capability grant, not both"
    )]
    TwoAuthorities,
    #[error("document {0} is disabled; it cannot be compiled")]
    DocumentDisabled(Uuid),
    #[error("the knowledge space's profiles cannot be frozen for a compilation: {0}")]
    Profiles(String),
    #[error("attempt {attempt} cannot be retried: {why}")]
    IntentGone { attempt: Uuid, why: String },
    #[error("database: {0}")]
    Db(sqlx::Error),
}

impl CompileError {
    /// A refusal of the request itself (bad input or state), as opposed to a failure to reach
    /// the database.
    pub fn is_refusal(&self) -> bool {
        !matches!(self, CompileError::Db(_) | CompileError::Timeout { .. })
    }
}

impl From<sqlx::Error> for CompileError {
    fn from(e: sqlx::Error) -> Self {
        CompileError::Db(e)
    }
}

/// Whether `e` is the violation of the one-active-attempt index.
pub fn is_active_conflict(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            db.code().as_deref() == Some("23505") && db.constraint() == Some(ACTIVE_UNIQUE_INDEX)
        }
        _ => false,
    }
}

/// The scope of a document: its tenant, space, version and lifecycle.
struct DocScope {
    tenant: String,
    space: Uuid,
    version: i32,
    document_state: String,
    space_state: String,
}

async fn document_scope(
    conn: &mut PgConnection,
    document: Uuid,
) -> Result<Option<DocScope>, sqlx::Error> {
    // The document row is share-locked, so its version and lifecycle cannot change before the
    // caller's transaction commits.
    let row: Option<(String, Uuid, i32, String, String)> = sqlx::query_as(
        "SELECT s.tenant_id::text, d.knowledge_space_id, d.version, d.lifecycle_state::text, s.lifecycle_state::text \
         FROM document_assets d JOIN knowledge_spaces s ON s.id = d.knowledge_space_id \
         WHERE d.id = $1 FOR SHARE OF d",
    )
    .bind(document)
    .fetch_optional(conn)
    .await?;
    Ok(row.map(
        |(tenant, space, version, document_state, space_state)| DocScope {
            tenant,
            space,
            version,
            document_state,
            space_state,
        },
    ))
}

async fn active_attempt(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    document: Uuid,
    version: i32,
    except: Option<Uuid>,
) -> Result<Option<Uuid>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT id FROM document_compilation_attempts \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND document_asset_id = $3 AND document_version = $4 \
           AND active_slot = 1 AND ($5::uuid IS NULL OR id <> $5) LIMIT 1",
    )
    .bind(tenant)
    .bind(space)
    .bind(document)
    .bind(version)
    .bind(except)
    .fetch_optional(conn)
    .await
}

fn refuse_deleting(document: Uuid, d: &DocScope) -> Result<(), CompileError> {
    if d.space_state != "active" {
        return Err(CompileError::DocumentDeleting {
            document,
            what: format!("its knowledge space is {}", d.space_state),
        });
    }
    if d.document_state != "active" {
        return Err(CompileError::DocumentDeleting {
            document,
            what: format!("lifecycle_state {}", d.document_state),
        });
    }
    Ok(())
}

/// Requests the compilation of a document's current version, in the caller's transaction:
/// the attempt (`dispatch_pending`, checkpoint `queued`, `active_slot` 1, `row_version` 0, a
/// fresh publication generation, `base_head_revision` = the space's head revision or 0, the
/// authority given — a requester binding, a capability grant alone, or none — and the space's
/// frozen profile tuple) and its one pending outbox row; the version's unbound candidate
/// revision is bound to it. Returns the attempt id.
pub async fn request(
    conn: &mut PgConnection,
    document_id: Uuid,
    opts: RequestOptions,
) -> Result<Uuid, CompileError> {
    if opts.requester.is_some() && opts.grant.is_some() {
        return Err(CompileError::TwoAuthorities);
    }
    let mut tx = conn.begin().await?;
    let d = document_scope(&mut tx, document_id)
        .await?
        .ok_or(CompileError::DocumentNotFound(document_id))?;
    refuse_deleting(document_id, &d)?;
    if intents::disabled(&mut tx, &d.tenant, d.space, document_id).await? {
        return Err(CompileError::DocumentDisabled(document_id));
    }
    if let Some(existing) =
        active_attempt(&mut tx, &d.tenant, d.space, document_id, d.version, None).await?
    {
        return Err(CompileError::ActiveAttemptExists {
            document: document_id,
            version: d.version,
            attempt: Some(existing),
        });
    }
    let base: i32 = sqlx::query_scalar(
        "SELECT head_revision FROM projection_set_publication_heads WHERE tenant_id = $1 AND knowledge_space_id = $2",
    )
    .bind(&d.tenant)
    .bind(d.space)
    .fetch_optional(&mut *tx)
    .await?
    .unwrap_or(0);
    // The platform's start: the active profile heads, locked, frozen onto the attempt (none,
    // or an embedding head alone, freeze nothing; the first step then binds or refuses).
    let frozen = profiles::freeze(&profiles::heads(&mut tx, &d.tenant, d.space).await?)
        .map_err(CompileError::Profiles)?;
    let binding = match &opts.requester {
        None => None,
        Some(r) => Some(requester_binding(&mut tx, &d, r).await?),
    };
    if let Some(grant) = opts.grant {
        capability::check(&mut tx, &d.tenant, d.space, grant)
            .await?
            .into_result()
            .map_err(|why| CompileError::Grant { grant, why })?;
    }
    let e = frozen.as_ref().and_then(|f| f.embedding.as_ref());
    let r = frozen.as_ref().map(|f| &f.retrieval);
    let attempt = Uuid::new_v4();
    let generation = Uuid::new_v4();
    // A concurrent request for the same version loses here without aborting the transaction.
    let inserted: Option<Uuid> = sqlx::query_scalar(
        "INSERT INTO document_compilation_attempts \
           (id, tenant_id, knowledge_space_id, document_asset_id, document_version, publication_generation_id, \
            base_head_revision, candidate_publication_id, candidate_fingerprint, checkpoint, run_state, active_slot, \
            execution_attempts, max_execution_attempts, queue_job_id, external_job_id, worker_id, lease_token, \
            lease_expires_at, heartbeat_at, retry_at, last_error_code, last_error_message, row_version, \
            created_at, updated_at, started_at, completed_at, requested_by_subject_id, permission_snapshot_id, \
            permission_snapshot_revision, access_channel, capability_grant_id, embedding_profile_kind, \
            embedding_profile_revision_id, embedding_profile_revision, embedding_profile_snapshot_digest, \
            retrieval_profile_kind, retrieval_profile_revision_id, retrieval_profile_revision, \
            retrieval_profile_snapshot_digest) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, NULL, NULL, 'queued', 'dispatch_pending', 1, 0, $8, NULL, NULL, NULL, \
            NULL, NULL, NULL, NULL, NULL, NULL, 0, now(), now(), NULL, NULL, $9, $10, $11, $12, $13, $14, $15, $16, \
            $17, $18, $19, $20, $21) \
         ON CONFLICT (tenant_id, knowledge_space_id, document_asset_id, document_version, active_slot) DO NOTHING \
         RETURNING id",
    )
    .bind(attempt)
    .bind(&d.tenant)
    .bind(d.space)
    .bind(document_id)
    .bind(d.version)
    .bind(generation)
    .bind(base)
    .bind(COMPILE.policy.max_attempts)
    .bind(binding.as_ref().map(|b| b.0.clone()))
    .bind(binding.as_ref().map(|b| b.1))
    .bind(binding.as_ref().map(|b| b.2))
    .bind(binding.as_ref().map(|b| b.3.clone()))
    .bind(opts.grant)
    .bind(e.map(|_| "embedding"))
    .bind(e.map(|e| e.revision_id))
    .bind(e.map(|e| e.revision))
    .bind(e.map(|e| e.digest.clone()))
    .bind(r.map(|_| "retrieval"))
    .bind(r.map(|r| r.revision_id))
    .bind(r.map(|r| r.revision))
    .bind(r.map(|r| r.digest.clone()))
    .fetch_optional(&mut *tx)
    .await
    .map_err(|e| conflict_or(e, document_id, d.version))?;
    if inserted.is_none() {
        let existing =
            active_attempt(&mut tx, &d.tenant, d.space, document_id, d.version, None).await?;
        return Err(CompileError::ActiveAttemptExists {
            document: document_id,
            version: d.version,
            attempt: existing,
        });
    }
    sqlx::query(
        "INSERT INTO document_compilation_outbox \
           (id, attempt_id, event_type, schema_version, payload, idempotency_key, status, dispatch_attempts, \
            available_at, locked_by, lock_token, locked_until, queue_job_id, external_job_id, delivered_at, \
            last_error, created_at, updated_at) \
         VALUES ($1, $2, 'document.compile', 1, jsonb_build_object('attemptId', $2::text), \
            'document.compile:' || $2::text, 'pending', 0, \
            CASE WHEN $3 THEN $4::timestamptz ELSE now() END, \
            NULL, NULL, NULL, NULL, NULL, NULL, NULL, now(), now())",
    )
    .bind(Uuid::new_v4())
    .bind(attempt)
    .bind(opts.defer)
    .bind(DEFERRED_UNTIL)
    .execute(&mut *tx)
    .await?;
    // The upload's candidate revision of this version is handed to this attempt.
    intents::bind(&mut tx, &d.tenant, d.space, document_id, d.version, attempt).await?;
    tx.commit().await?;
    Ok(attempt)
}

/// The requester binding of a request: the snapshot must be this space's, issued to the
/// requester, and still valid for writing (the platform's revalidation, a role that may write).
async fn requester_binding(
    conn: &mut PgConnection,
    d: &DocScope,
    r: &Requester,
) -> Result<(String, Uuid, i32, String), CompileError> {
    let channel: Option<String> = sqlx::query_scalar(
        "SELECT access_channel::text FROM knowledge_space_permission_snapshots \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND id = $3 AND subject_id = $4",
    )
    .bind(&d.tenant)
    .bind(d.space)
    .bind(r.snapshot)
    .bind(&r.subject)
    .fetch_optional(&mut *conn)
    .await?;
    let refuse = |why: &str| CompileError::Snapshot {
        snapshot: r.snapshot,
        why: why.to_owned(),
    };
    let channel = channel.ok_or_else(|| {
        refuse("it is not a snapshot of this knowledge space issued to that subject")
    })?;
    let valid =
        crate::access::revalidate(conn, &d.tenant, d.space, r.snapshot, &r.subject, &channel)
            .await?
            .ok_or_else(|| {
                refuse("it is revoked, expired, or no longer matches the space's access")
            })?;
    if valid.role == "viewer" {
        return Err(refuse("a viewer may not compile documents"));
    }
    Ok((r.subject.clone(), r.snapshot, valid.revision, channel))
}

fn conflict_or(e: sqlx::Error, document: Uuid, version: i32) -> CompileError {
    if is_active_conflict(&e) {
        CompileError::ActiveAttemptExists {
            document,
            version,
            attempt: None,
        }
    } else {
        CompileError::Db(e)
    }
}

/// The attempt's scope, locked for update.
struct AttemptRow {
    tenant: String,
    space: Uuid,
    document: Uuid,
    version: i32,
    run_state: String,
    grant: Option<Uuid>,
}

async fn lock_attempt(conn: &mut PgConnection, attempt: Uuid) -> Result<AttemptRow, CompileError> {
    let row: Option<(String, Uuid, Uuid, i32, String, Option<Uuid>)> = sqlx::query_as(
        "SELECT tenant_id::text, knowledge_space_id, document_asset_id, document_version, run_state::text, \
           capability_grant_id \
         FROM document_compilation_attempts WHERE id = $1 FOR UPDATE",
    )
    .bind(attempt)
    .fetch_optional(conn)
    .await?;
    let (tenant, space, document, version, run_state, grant) =
        row.ok_or(CompileError::AttemptNotFound(attempt))?;
    Ok(AttemptRow {
        tenant,
        space,
        document,
        version,
        run_state,
        grant,
    })
}

/// Releases a deferred dispatch: the outbox row becomes due now, so the relay sends it.
pub async fn release(conn: &mut PgConnection, attempt_id: Uuid) -> Result<(), CompileError> {
    let mut tx = conn.begin().await?;
    let a = lock_attempt(&mut tx, attempt_id).await?;
    let released = sqlx::query(
        "UPDATE document_compilation_outbox o SET available_at = now(), updated_at = now() \
         FROM document_compilation_attempts a \
         WHERE o.attempt_id = $1 AND a.id = o.attempt_id AND a.tenant_id = $2 AND a.knowledge_space_id = $3 \
           AND a.run_state = 'dispatch_pending' AND o.status = 'pending' AND o.available_at >= $4::timestamptz",
    )
    .bind(attempt_id)
    .bind(&a.tenant)
    .bind(a.space)
    .bind(DEFERRED_UNTIL)
    .execute(&mut *tx)
    .await?;
    if released.rows_affected() != 1 {
        let outbox_status: String = sqlx::query_scalar(
            "SELECT status::text FROM document_compilation_outbox WHERE attempt_id = $1",
        )
        .bind(attempt_id)
        .fetch_optional(&mut *tx)
        .await?
        .unwrap_or_else(|| "missing".into());
        return Err(CompileError::NotDeferred {
            attempt: attempt_id,
            run_state: a.run_state,
            outbox_status,
        });
    }
    tx.commit().await?;
    Ok(())
}

/// Manually retries a failed attempt: the same attempt and the same outbox row are re-armed
/// (attempt `dispatch_pending` with its slot back, attempts counted from 0, error cleared,
/// `row_version` bumped; outbox `pending` now), its logical-document intent restored
/// ([`intents::restore`]) and, under a capability grant, the grant checked again. The checkpoint
/// and the frozen profiles are kept: the walk goes on from where it failed, and every step is
/// idempotent.
pub async fn retry(conn: &mut PgConnection, attempt_id: Uuid) -> Result<(), CompileError> {
    let mut tx = conn.begin().await?;
    let a = lock_attempt(&mut tx, attempt_id).await?;
    if a.run_state != "failed" {
        return Err(CompileError::NotRetryable {
            attempt: attempt_id,
            run_state: a.run_state,
        });
    }
    let d = document_scope(&mut tx, a.document)
        .await?
        .ok_or(CompileError::DocumentNotFound(a.document))?;
    refuse_deleting(a.document, &d)?;
    if d.version != a.version {
        return Err(CompileError::VersionMoved {
            attempt: attempt_id,
            document: a.document,
            version: a.version,
            current: d.version,
        });
    }
    if let Some(other) = active_attempt(
        &mut tx,
        &a.tenant,
        a.space,
        a.document,
        a.version,
        Some(attempt_id),
    )
    .await?
    {
        return Err(CompileError::ActiveAttemptExists {
            document: a.document,
            version: a.version,
            attempt: Some(other),
        });
    }
    if let Some(grant) = a.grant {
        capability::check(&mut tx, &a.tenant, a.space, grant)
            .await?
            .into_result()
            .map_err(|why| CompileError::Grant { grant, why })?;
    }
    if let Err(why) = intents::restore(&mut tx, &a.tenant, a.space, attempt_id).await? {
        return Err(CompileError::IntentGone {
            attempt: attempt_id,
            why,
        });
    }
    sqlx::query(
        "UPDATE document_compilation_attempts SET run_state = 'dispatch_pending', active_slot = 1, completed_at = NULL, \
           execution_attempts = 0, retry_at = NULL, last_error_code = NULL, last_error_message = NULL, \
           row_version = row_version + 1, updated_at = now() \
         WHERE id = $1 AND tenant_id = $2 AND knowledge_space_id = $3 AND run_state = 'failed'",
    )
    .bind(attempt_id)
    .bind(&a.tenant)
    .bind(a.space)
    .execute(&mut *tx)
    .await
    .map_err(|e| conflict_or(e, a.document, a.version))?;
    sqlx::query(
        "UPDATE document_compilation_outbox SET status = 'pending', available_at = now(), dispatch_attempts = 0, \
           queue_job_id = NULL, last_error = NULL, lock_token = NULL, locked_by = NULL, locked_until = NULL, \
           updated_at = now() \
         WHERE attempt_id = $1",
    )
    .bind(attempt_id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// An attempt and its outbox row, as `compile show` prints them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, sqlx::FromRow)]
#[serde(rename_all = "camelCase")]
pub struct AttemptStatus {
    pub id: Uuid,
    pub tenant_id: String,
    pub knowledge_space_id: Uuid,
    pub document_asset_id: Uuid,
    pub document_version: i32,
    pub publication_generation_id: Uuid,
    pub base_head_revision: i32,
    pub candidate_publication_id: Option<Uuid>,
    pub candidate_fingerprint: Option<String>,
    pub checkpoint: String,
    pub run_state: String,
    pub active_slot: Option<i32>,
    pub execution_attempts: i32,
    pub max_execution_attempts: i32,
    pub last_error_code: Option<String>,
    pub last_error_message: Option<String>,
    pub row_version: i32,
    pub created_at: DateTime<Utc>,
    pub completed_at: Option<DateTime<Utc>>,
    pub outbox_status: Option<String>,
    pub outbox_available_at: Option<DateTime<Utc>>,
    pub dispatch_attempts: Option<i32>,
    pub requested_by_subject_id: Option<String>,
    pub permission_snapshot_id: Option<Uuid>,
    pub permission_snapshot_revision: Option<i32>,
    pub access_channel: Option<String>,
    pub capability_grant_id: Option<Uuid>,
    pub embedding_profile_kind: Option<String>,
    pub embedding_profile_revision_id: Option<Uuid>,
    pub embedding_profile_revision: Option<i32>,
    pub embedding_profile_snapshot_digest: Option<String>,
    pub retrieval_profile_kind: Option<String>,
    pub retrieval_profile_revision_id: Option<Uuid>,
    pub retrieval_profile_revision: Option<i32>,
    pub retrieval_profile_snapshot_digest: Option<String>,
}

impl AttemptStatus {
    /// Ended: succeeded, failed, canceled or superseded.
    pub fn is_terminal(&self) -> bool {
        matches!(
            self.run_state.as_str(),
            "succeeded" | "failed" | "canceled" | "superseded"
        )
    }

    /// Ended without publishing because something newer won.
    pub fn is_superseded(&self) -> bool {
        self.run_state == "superseded"
    }
}

/// Reads an attempt and its outbox row.
pub async fn show(
    conn: &mut PgConnection,
    attempt_id: Uuid,
) -> Result<AttemptStatus, CompileError> {
    sqlx::query_as::<_, AttemptStatus>(
        "SELECT a.id, a.tenant_id::text AS tenant_id, a.knowledge_space_id, a.document_asset_id, a.document_version, \
           a.publication_generation_id, a.base_head_revision, a.candidate_publication_id, \
           a.candidate_fingerprint::text AS candidate_fingerprint, a.checkpoint::text AS checkpoint, \
           a.run_state::text AS run_state, a.active_slot, a.execution_attempts, a.max_execution_attempts, \
           a.last_error_code::text AS last_error_code, a.last_error_message, a.row_version, a.created_at, \
           a.completed_at, o.status::text AS outbox_status, o.available_at AS outbox_available_at, \
           o.dispatch_attempts, a.requested_by_subject_id::text AS requested_by_subject_id, \
           a.permission_snapshot_id, a.permission_snapshot_revision, a.access_channel::text AS access_channel, \
           a.capability_grant_id, a.embedding_profile_kind::text AS embedding_profile_kind, \
           a.embedding_profile_revision_id, a.embedding_profile_revision, \
           a.embedding_profile_snapshot_digest::text AS embedding_profile_snapshot_digest, \
           a.retrieval_profile_kind::text AS retrieval_profile_kind, a.retrieval_profile_revision_id, \
           a.retrieval_profile_revision, a.retrieval_profile_snapshot_digest::text AS retrieval_profile_snapshot_digest \
         FROM document_compilation_attempts a \
         LEFT JOIN document_compilation_outbox o ON o.attempt_id = a.id AND o.event_type = 'document.compile' \
         WHERE a.id = $1",
    )
    .bind(attempt_id)
    .fetch_optional(conn)
    .await?
    .ok_or(CompileError::AttemptNotFound(attempt_id))
}

/// Polls until the attempt has ended (succeeded, failed, canceled or superseded), or `timeout`.
pub async fn wait(
    pool: &PgPool,
    attempt_id: Uuid,
    timeout: Duration,
) -> Result<AttemptStatus, CompileError> {
    let started = std::time::Instant::now();
    loop {
        let status = {
            let mut conn = pool.acquire().await?;
            show(&mut conn, attempt_id).await?
        };
        if status.is_terminal() {
            return Ok(status);
        }
        if started.elapsed() >= timeout {
            return Err(CompileError::Timeout {
                attempt: attempt_id,
                waited: timeout,
                run_state: status.run_state,
                checkpoint: status.checkpoint,
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One full-text hit among the nodes the space's head serves, found the way the platform's
/// retrieval finds them ([`crate::publication::FTS_READ_SQL`]).
#[derive(Clone, Debug, PartialEq, Serialize, sqlx::FromRow)]
#[serde(rename_all = "camelCase")]
pub struct Hit {
    pub projection_id: Uuid,
    pub node_id: Uuid,
    pub document_asset_id: Uuid,
    pub document_version: i32,
    pub text: String,
    pub source_location: serde_json::Value,
    pub filename: String,
    pub score: f64,
}

/// Full-text search over what the space's head publishes, for a reader whose permission scopes
/// are `scopes` (nodes without a scope are visible to every reader), best first.
pub async fn search_published(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    query: &str,
    scopes: &[String],
    limit: i64,
) -> Result<Vec<Hit>, sqlx::Error> {
    let q = crate::canonical::normalize_fts_text(query);
    if q.is_empty() {
        return Ok(Vec::new());
    }
    let Some(head) = crate::publication::head(conn, tenant, space, false).await? else {
        return Ok(Vec::new());
    };
    let sql = format!("{} LIMIT $6", crate::publication::FTS_READ_SQL);
    sqlx::query_as::<_, Hit>(&sql)
        .bind(space)
        .bind(q)
        .bind(tenant)
        .bind(head.publication_id)
        .bind(serde_json::json!(scopes))
        .bind(limit)
        .fetch_all(conn)
        .await
}
