//! Requesting and retrying deletions, in the caller's transaction. Invariant: a request writes
//! the job, its active tombstone, the target's `deleting` fences and the first outbox revision
//! together or not at all (inside a savepoint of the caller's transaction); a retry writes the
//! new outbox revision, the re-armed items, the reset job and its audit row together or not at
//! all; a refused request or retry changes nothing.

use sha2::{Digest, Sha256};
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use super::TargetType;

/// Attempts a deletion job gets (the platform's default).
pub const MAX_EXECUTION_ATTEMPTS: i32 = 10;

/// What to delete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// The whole space (`knowledge_space_id` of the request). `confirm_name` must equal the
    /// space's name: the name challenge.
    Space { confirm_name: String },
    /// A source of the space. `keep` detaches its documents, `cascade` deletes them.
    Source { id: Uuid, mode: SourceMode },
    /// One document of the space.
    Document { id: Uuid },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceMode {
    Keep,
    Cascade,
}

impl SourceMode {
    pub fn as_str(self) -> &'static str {
        match self {
            SourceMode::Keep => "keep",
            SourceMode::Cascade => "cascade",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "keep" => Some(SourceMode::Keep),
            "cascade" => Some(SourceMode::Cascade),
            _ => None,
        }
    }
}

/// A deletion request, as the platform's API receives it.
#[derive(Clone, Debug)]
pub struct DeletionRequest {
    pub tenant_id: String,
    pub knowledge_space_id: Uuid,
    pub target: Target,
    /// The revision the caller saw (`knowledge_spaces.revision`, `sources.version`,
    /// `document_assets.row_version`); `None`: whatever is current.
    pub expected_revision: Option<i32>,
    pub requested_by_subject_id: String,
    pub permission_snapshot_id: Uuid,
    /// `interactive`, `service_api`, `mcp` or `agent`; must match the snapshot.
    pub access_channel: String,
    pub idempotency_key: String,
}

/// The job a request created or found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Requested {
    pub job_id: Uuid,
    pub outbox_id: Uuid,
    /// `false`: an earlier request with the same key and fingerprint made it.
    pub created: bool,
}

/// Who may retry a failed job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryAuthority {
    /// The subject that requested the deletion.
    OriginalRequester,
    /// A space owner, interactively (no API key), rescuing someone else's failed deletion.
    InteractiveOwnerRescue,
}

impl RetryAuthority {
    pub fn as_str(self) -> &'static str {
        match self {
            RetryAuthority::OriginalRequester => "original_requester",
            RetryAuthority::InteractiveOwnerRescue => "interactive_owner_rescue",
        }
    }
}

/// A manual retry of a failed deletion job.
#[derive(Clone, Debug)]
pub struct RetryRequest {
    pub job_id: Uuid,
    pub actor_subject_id: String,
    pub permission_snapshot_id: Uuid,
    pub access_channel: String,
    pub authority: RetryAuthority,
    /// Per retry; must differ from the original request's key.
    pub idempotency_key: String,
}

/// The outbox revision a retry created or found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retried {
    pub job_id: Uuid,
    pub outbox_id: Uuid,
    pub delivery_revision: i32,
    pub created: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{what} is at revision {current}, not the expected {expected}")]
    RevisionMismatch {
        what: String,
        expected: i32,
        current: i32,
    },
    #[error("the name challenge failed: the name given is not the space's name")]
    NameChallenge,
    #[error("permission refused: {0}")]
    Permission(String),
    #[error("idempotency key {key:?} was already used for a different request (job {job_id})")]
    IdempotencyConflict { key: String, job_id: Uuid },
    #[error("{what} already has a live deletion job{}", .job_id.map(|j| format!(" ({j})")).unwrap_or_default())]
    TargetBusy { what: String, job_id: Option<Uuid> },
    #[error("deletion job {job_id} cannot be retried: {why}")]
    NotRetryable { job_id: Uuid, why: String },
    #[error("retry refused: {0}")]
    RetryRefused(String),
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
}

pub(crate) fn sha256_hex(s: &str) -> String {
    hex::encode(Sha256::digest(s.as_bytes()))
}

const CHANNELS: [&str; 4] = ["interactive", "service_api", "mcp", "agent"];

fn check_text(what: &str, v: &str, max: usize) -> Result<(), RequestError> {
    if v.trim().is_empty() {
        return Err(RequestError::Invalid(format!("{what} is empty")));
    }
    if v.len() > max {
        return Err(RequestError::Invalid(format!(
            "{what} is longer than {max} bytes"
        )));
    }
    Ok(())
}

fn check_channel(c: &str) -> Result<(), RequestError> {
    if CHANNELS.contains(&c) {
        Ok(())
    } else {
        Err(RequestError::Invalid(format!(
            "access channel {c:?} is not one of interactive, service_api, mcp, agent"
        )))
    }
}

impl DeletionRequest {
    fn target_type(&self) -> TargetType {
        match self.target {
            Target::Space { .. } => TargetType::Space,
            Target::Source { .. } => TargetType::Source,
            Target::Document { .. } => TargetType::Document,
        }
    }

    fn target_id(&self) -> Uuid {
        match self.target {
            Target::Space { .. } => self.knowledge_space_id,
            Target::Source { id, .. } | Target::Document { id } => id,
        }
    }

    fn mode(&self) -> &'static str {
        match self.target {
            Target::Source { mode, .. } => mode.as_str(),
            _ => "cascade",
        }
    }

    fn name_digest(&self) -> Option<String> {
        match &self.target {
            Target::Space { confirm_name } => Some(sha256_hex(confirm_name)),
            _ => None,
        }
    }

    /// sha256 hex of the canonical request: every field that decides what gets deleted and
    /// under whose authority, in a fixed order, one per line.
    pub fn fingerprint(&self) -> String {
        let canonical = [
            "deletion.request.v1".to_owned(),
            self.tenant_id.clone(),
            self.knowledge_space_id.to_string(),
            self.target_type().as_str().to_owned(),
            self.target_id().to_string(),
            self.mode().to_owned(),
            self.expected_revision
                .map_or_else(|| "*".to_owned(), |r| r.to_string()),
            self.requested_by_subject_id.clone(),
            self.permission_snapshot_id.to_string(),
            self.access_channel.clone(),
            self.name_digest().unwrap_or_default(),
        ]
        .iter()
        .map(|f| format!("{}:{f}", f.len()))
        .collect::<Vec<_>>()
        .join("\n");
        sha256_hex(&canonical)
    }

    fn validate(&self) -> Result<(), RequestError> {
        check_text("tenant id", &self.tenant_id, 255)?;
        check_text("requesting subject", &self.requested_by_subject_id, 255)?;
        check_text("idempotency key", &self.idempotency_key, 512)?;
        check_channel(&self.access_channel)?;
        if let Target::Space { confirm_name } = &self.target {
            if confirm_name.is_empty() {
                return Err(RequestError::Invalid(
                    "deleting a space needs its name as a confirmation".into(),
                ));
            }
        }
        if matches!(self.expected_revision, Some(r) if r < 1) {
            return Err(RequestError::Invalid("a revision is at least 1".into()));
        }
        Ok(())
    }
}

impl RetryRequest {
    pub fn fingerprint(&self) -> String {
        let canonical = [
            "deletion.retry.v1".to_owned(),
            self.job_id.to_string(),
            self.authority.as_str().to_owned(),
            self.actor_subject_id.clone(),
            self.permission_snapshot_id.to_string(),
            self.access_channel.clone(),
        ]
        .iter()
        .map(|f| format!("{}:{f}", f.len()))
        .collect::<Vec<_>>()
        .join("\n");
        sha256_hex(&canonical)
    }
}

fn is_unique_violation(e: &sqlx::Error, constraint: &str) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("23505") && d.constraint() == Some(constraint))
}

/// A permission snapshot that is valid now.
struct Snapshot {
    revision: i32,
    api_key_id: Option<Uuid>,
    api_key_revision: Option<i32>,
    api_key_expires_at: Option<chrono::DateTime<chrono::Utc>>,
    owner: bool,
}

/// Loads the snapshot and checks that it belongs to tenant/space/subject/channel, is active,
/// not revoked, not expired, and (when bound to an API key) that the key is live too.
async fn valid_snapshot(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    snapshot: Uuid,
    subject: &str,
    channel: &str,
    need_scope: &str,
) -> Result<Snapshot, RequestError> {
    type Row = (
        String,
        String,
        i32,
        String,
        bool,
        bool,
        Option<Uuid>,
        Option<i32>,
        Option<chrono::DateTime<chrono::Utc>>,
        bool,
        bool,
        bool,
    );
    let row: Option<Row> = sqlx::query_as(
        r#"SELECT p.subject_id, p.access_channel, p.revision, p.status,
                  p.revoked_at IS NOT NULL,
                  p.expires_at IS NOT NULL AND p.expires_at <= now(),
                  p.api_key_id, p.api_key_revision, p.api_key_expires_at,
                  (p.api_key_id IS NULL OR EXISTS (
                     SELECT 1 FROM knowledge_space_api_keys k
                     WHERE k.tenant_id = p.tenant_id AND k.knowledge_space_id = p.knowledge_space_id
                       AND k.id = p.api_key_id AND k.revision = p.api_key_revision AND k.revoked_at IS NULL
                       AND (k.expires_at IS NULL OR k.expires_at > now()))),
                  (p.api_key_expires_at IS NOT NULL AND p.api_key_expires_at <= now()),
                  (jsonb_typeof(p.scopes) = 'array' AND p.scopes ? 'owner')
                    OR (jsonb_typeof(p.scopes) = 'array' AND p.scopes ? $4)
           FROM knowledge_space_permission_snapshots p
           WHERE p.tenant_id = $1 AND p.knowledge_space_id = $2 AND p.id = $3"#,
    )
    .bind(tenant)
    .bind(space)
    .bind(snapshot)
    .bind(need_scope)
    .fetch_optional(&mut *conn)
    .await?;
    let Some((
        p_subject,
        p_channel,
        revision,
        status,
        revoked,
        expired,
        api_key_id,
        api_key_revision,
        api_key_expires_at,
        key_live,
        key_expired,
        has_scope,
    )) = row
    else {
        return Err(RequestError::Permission(format!(
            "no permission snapshot {snapshot} in this tenant and space"
        )));
    };
    if p_subject != subject {
        return Err(RequestError::Permission(format!(
            "permission snapshot {snapshot} belongs to another subject"
        )));
    }
    if p_channel != channel {
        return Err(RequestError::Permission(format!(
            "permission snapshot {snapshot} was issued for the {p_channel} channel, not {channel}"
        )));
    }
    if status != "active" || revoked {
        return Err(RequestError::Permission(format!(
            "permission snapshot {snapshot} is revoked"
        )));
    }
    if expired || key_expired {
        return Err(RequestError::Permission(format!(
            "permission snapshot {snapshot} has expired"
        )));
    }
    if !key_live {
        return Err(RequestError::Permission(format!(
            "the API key of permission snapshot {snapshot} is revoked, expired or rotated"
        )));
    }
    if !has_scope {
        return Err(RequestError::Permission(format!(
            "permission snapshot {snapshot} does not grant '{need_scope}'"
        )));
    }
    let owner: bool = sqlx::query_scalar(
        "SELECT jsonb_typeof(scopes) = 'array' AND scopes ? 'owner' FROM knowledge_space_permission_snapshots \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND id = $3",
    )
    .bind(tenant)
    .bind(space)
    .bind(snapshot)
    .fetch_one(&mut *conn)
    .await?;
    Ok(Snapshot {
        revision,
        api_key_id,
        api_key_revision,
        api_key_expires_at,
        owner,
    })
}

/// Requests a deletion in the caller's transaction (a savepoint inside it; on a plain
/// connection, its own transaction). Same idempotency key + same fingerprint returns the
/// existing job; a different fingerprint is [`RequestError::IdempotencyConflict`]; a second
/// live job for the target is [`RequestError::TargetBusy`].
pub async fn request_deletion(
    conn: &mut PgConnection,
    req: &DeletionRequest,
) -> Result<Requested, RequestError> {
    req.validate()?;
    let fingerprint = req.fingerprint();
    let mut sp = conn.begin().await?;
    let written = write_request(&mut sp, req, &fingerprint).await;
    match written {
        Ok(r) => {
            sp.commit().await?;
            Ok(r)
        }
        Err(e) => {
            sp.rollback().await?;
            // A concurrent request with the same key won the race: answer as if it came first.
            if let RequestError::Db(db) = &e {
                if is_unique_violation(db, "deletion_jobs_idempotency_uq") {
                    if let Some(found) = existing_request(conn, req, &fingerprint).await? {
                        return Ok(found);
                    }
                }
                if is_unique_violation(db, "deletion_jobs_target_active_uq")
                    || is_unique_violation(db, "deletion_tombstones_target_uq")
                {
                    return Err(RequestError::TargetBusy {
                        what: format!("{} {}", req.target_type().as_str(), req.target_id()),
                        job_id: None,
                    });
                }
            }
            Err(e)
        }
    }
}

async fn existing_request(
    conn: &mut PgConnection,
    req: &DeletionRequest,
    fingerprint: &str,
) -> Result<Option<Requested>, RequestError> {
    let row: Option<(Uuid, String, Option<Uuid>)> = sqlx::query_as(
        "SELECT j.id, j.request_fingerprint, \
           (SELECT o.id FROM deletion_outbox o WHERE o.deletion_job_id = j.id ORDER BY o.delivery_revision LIMIT 1) \
         FROM deletion_jobs j WHERE j.tenant_id = $1 AND j.idempotency_key = $2",
    )
    .bind(&req.tenant_id)
    .bind(&req.idempotency_key)
    .fetch_optional(&mut *conn)
    .await?;
    match row {
        None => Ok(None),
        Some((job_id, fp, outbox)) if fp == fingerprint => Ok(Some(Requested {
            job_id,
            outbox_id: outbox.unwrap_or_default(),
            created: false,
        })),
        Some((job_id, _, _)) => Err(RequestError::IdempotencyConflict {
            key: req.idempotency_key.clone(),
            job_id,
        }),
    }
}

async fn write_request(
    conn: &mut PgConnection,
    req: &DeletionRequest,
    fingerprint: &str,
) -> Result<Requested, RequestError> {
    if let Some(found) = existing_request(conn, req, fingerprint).await? {
        return Ok(found);
    }
    let tenant = req.tenant_id.as_str();
    let space = req.knowledge_space_id;
    let target_id = req.target_id();
    let target_type = req.target_type();

    // The space, locked: every target lives in it, and a space being deleted takes no new job.
    let space_row: Option<(i32, String, Option<Uuid>, String)> = sqlx::query_as(
        "SELECT revision, lifecycle_state, deletion_job_id, name FROM knowledge_spaces \
         WHERE tenant_id = $1 AND id = $2 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .fetch_optional(&mut *conn)
    .await?;
    let Some((space_revision, space_state, space_job, space_name)) = space_row else {
        return Err(RequestError::NotFound(format!(
            "no knowledge space {space} in tenant {tenant}"
        )));
    };
    if space_state == "deleting" {
        return Err(RequestError::TargetBusy {
            what: format!("knowledge space {space}"),
            job_id: space_job,
        });
    }

    let check_revision = |what: String, current: i32| -> Result<(), RequestError> {
        match req.expected_revision {
            Some(expected) if expected != current => Err(RequestError::RevisionMismatch {
                what,
                expected,
                current,
            }),
            _ => Ok(()),
        }
    };

    let target_revision = match &req.target {
        Target::Space { confirm_name } => {
            if confirm_name != &space_name {
                return Err(RequestError::NameChallenge);
            }
            check_revision(format!("knowledge space {space}"), space_revision)?;
            space_revision
        }
        Target::Source { id, mode } => {
            let row: Option<(i32, String, Option<Uuid>)> = sqlx::query_as(
                "SELECT s.version, s.status, s.deletion_job_id FROM sources s \
                 WHERE s.id = $3 AND s.knowledge_space_id = $2 \
                   AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = s.knowledge_space_id AND k.tenant_id = $1) \
                 FOR UPDATE",
            )
            .bind(tenant)
            .bind(space)
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
            let Some((version, status, job)) = row else {
                return Err(RequestError::NotFound(format!(
                    "no source {id} in knowledge space {space}"
                )));
            };
            if status == "deleting" {
                return Err(RequestError::TargetBusy {
                    what: format!("source {id}"),
                    job_id: job,
                });
            }
            check_revision(format!("source {id}"), version)?;
            if *mode == SourceMode::Cascade {
                let busy: Option<(Uuid, Option<Uuid>)> = sqlx::query_as(
                    "SELECT d.id, d.deletion_job_id FROM document_assets d \
                     WHERE d.knowledge_space_id = $2 AND d.source_id = $3 AND d.lifecycle_state = 'deleting' \
                       AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = d.knowledge_space_id AND k.tenant_id = $1) \
                     LIMIT 1",
                )
                .bind(tenant)
                .bind(space)
                .bind(id)
                .fetch_optional(&mut *conn)
                .await?;
                if let Some((doc, job)) = busy {
                    return Err(RequestError::TargetBusy {
                        what: format!("document {doc} of source {id}"),
                        job_id: job,
                    });
                }
            }
            version
        }
        Target::Document { id } => {
            type DocRow = (i32, String, Option<Uuid>, Option<String>, Option<Uuid>);
            let row: Option<DocRow> = sqlx::query_as(
                "SELECT d.row_version, d.lifecycle_state, d.deletion_job_id, s.status, s.deletion_job_id \
                 FROM document_assets d LEFT JOIN sources s ON s.id = d.source_id AND s.knowledge_space_id = d.knowledge_space_id \
                 WHERE d.id = $3 AND d.knowledge_space_id = $2 \
                   AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = d.knowledge_space_id AND k.tenant_id = $1) \
                 FOR UPDATE OF d",
            )
            .bind(tenant)
            .bind(space)
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
            let Some((row_version, state, job, source_status, source_job)) = row else {
                return Err(RequestError::NotFound(format!(
                    "no document {id} in knowledge space {space}"
                )));
            };
            if state == "deleting" {
                return Err(RequestError::TargetBusy {
                    what: format!("document {id}"),
                    job_id: job,
                });
            }
            if source_status.as_deref() == Some("deleting") {
                return Err(RequestError::TargetBusy {
                    what: format!("the source of document {id}"),
                    job_id: source_job,
                });
            }
            check_revision(format!("document {id}"), row_version)?;
            row_version
        }
    };

    let snap = valid_snapshot(
        conn,
        tenant,
        space,
        req.permission_snapshot_id,
        &req.requested_by_subject_id,
        &req.access_channel,
        "delete",
    )
    .await?;

    let job_id = Uuid::now_v7();
    sqlx::query(
        r#"INSERT INTO deletion_jobs (id, tenant_id, knowledge_space_id, target_type, target_id, target_revision,
             delete_mode, requested_by_subject_id, permission_snapshot_id, permission_snapshot_revision, access_channel,
             api_key_id, api_key_revision, api_key_expires_at, idempotency_key, request_fingerprint, name_challenge_digest,
             checkpoint, scan_phase, scan_cursor, inventory_complete, run_state, active_slot, execution_attempts,
             max_execution_attempts, row_version, created_at, updated_at)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17,
             'requested', NULL, NULL, false, 'dispatch_pending', 1, 0, $18, 1, now(), now())"#,
    )
    .bind(job_id)
    .bind(tenant)
    .bind(space)
    .bind(target_type.as_str())
    .bind(target_id)
    .bind(target_revision)
    .bind(req.mode())
    .bind(&req.requested_by_subject_id)
    .bind(req.permission_snapshot_id)
    .bind(snap.revision)
    .bind(&req.access_channel)
    .bind(snap.api_key_id)
    .bind(snap.api_key_revision)
    .bind(snap.api_key_expires_at)
    .bind(&req.idempotency_key)
    .bind(fingerprint)
    .bind(req.name_digest())
    .bind(MAX_EXECUTION_ATTEMPTS)
    .execute(&mut *conn)
    .await?;

    sqlx::query(
        r#"INSERT INTO deletion_tombstones (id, deletion_job_id, tenant_id, knowledge_space_id, target_type, target_id,
             target_revision, state, row_version, created_at, completed_at)
           VALUES ($1, $2, $3, $4, $5, $6, $7, 'active', 1, now(), NULL)"#,
    )
    .bind(Uuid::now_v7())
    .bind(job_id)
    .bind(tenant)
    .bind(space)
    .bind(target_type.as_str())
    .bind(target_id)
    .bind(target_revision)
    .execute(&mut *conn)
    .await?;

    // The fences: the target says `deleting` and names its job; writers that honour the fence
    // stop touching it from this commit on.
    let fenced = match &req.target {
        Target::Space { .. } => sqlx::query(
            "UPDATE knowledge_spaces SET lifecycle_state = 'deleting', deletion_job_id = $3, deleting_at = now(), \
               revision = revision + 1, updated_at = now() \
             WHERE tenant_id = $1 AND id = $2 AND revision = $4 AND lifecycle_state = 'active'",
        )
        .bind(tenant)
        .bind(space)
        .bind(job_id)
        .bind(target_revision)
        .execute(&mut *conn)
        .await?
        .rows_affected(),
        Target::Source { id, mode } => {
            let n = sqlx::query(
                "UPDATE sources s SET status = 'deleting', deletion_job_id = $4, deleting_at = now(), \
                   version = version + 1, updated_at = now() \
                 WHERE s.id = $3 AND s.knowledge_space_id = $2 AND s.version = $5 AND s.status <> 'deleting' \
                   AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = s.knowledge_space_id AND k.tenant_id = $1)",
            )
            .bind(tenant)
            .bind(space)
            .bind(id)
            .bind(job_id)
            .bind(target_revision)
            .execute(&mut *conn)
            .await?
            .rows_affected();
            if *mode == SourceMode::Cascade {
                sqlx::query(
                    "UPDATE document_assets d SET lifecycle_state = 'deleting', deletion_job_id = $4, deleting_at = now(), \
                       row_version = row_version + 1, updated_at = now() \
                     WHERE d.knowledge_space_id = $2 AND d.source_id = $3 AND d.lifecycle_state = 'active' \
                       AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = d.knowledge_space_id AND k.tenant_id = $1)",
                )
                .bind(tenant)
                .bind(space)
                .bind(id)
                .bind(job_id)
                .execute(&mut *conn)
                .await?;
            }
            n
        }
        Target::Document { id } => sqlx::query(
            "UPDATE document_assets d SET lifecycle_state = 'deleting', deletion_job_id = $4, deleting_at = now(), \
               row_version = row_version + 1, updated_at = now() \
             WHERE d.id = $3 AND d.knowledge_space_id = $2 AND d.row_version = $5 AND d.lifecycle_state = 'active' \
               AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = d.knowledge_space_id AND k.tenant_id = $1)",
        )
        .bind(tenant)
        .bind(space)
        .bind(id)
        .bind(job_id)
        .bind(target_revision)
        .execute(&mut *conn)
        .await?
        .rows_affected(),
    };
    if fenced != 1 {
        // The row is locked above, so this means it changed under a writer that ignores locks.
        return Err(RequestError::TargetBusy {
            what: format!("{} {target_id}", target_type.as_str()),
            job_id: None,
        });
    }

    let outbox_id = Uuid::now_v7();
    insert_outbox(
        conn,
        outbox_id,
        job_id,
        1,
        &req.idempotency_key,
        fingerprint,
    )
    .await?;
    Ok(Requested {
        job_id,
        outbox_id,
        created: true,
    })
}

async fn insert_outbox(
    conn: &mut PgConnection,
    outbox_id: Uuid,
    job_id: Uuid,
    revision: i32,
    request_key: &str,
    fingerprint: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        r#"INSERT INTO deletion_outbox (id, deletion_job_id, delivery_revision, event_type, schema_version,
             idempotency_key, request_idempotency_key, request_fingerprint, payload, status, available_at,
             dispatch_attempts, created_at, updated_at)
           VALUES ($1, $2, $3, 'deletion.job', 1, 'deletion:' || $2::text || ':' || $3::text, $4, $5,
             jsonb_build_object('deletionJobId', $2::text), 'pending', now(), 0, now(), now())"#,
    )
    .bind(outbox_id)
    .bind(job_id)
    .bind(revision)
    .bind(request_key)
    .bind(fingerprint)
    .execute(conn)
    .await?;
    Ok(())
}

/// Retries a failed deletion job in the caller's transaction: a new outbox revision, dead items
/// re-armed with one more attempt, the job back to `dispatch_pending`, and an audit row. The
/// actor is either the original requester or an interactive owner rescue (channel
/// `interactive`, no API key, a snapshot with the `owner` scope); anything else is refused.
/// Idempotent per `idempotency_key`.
pub async fn retry_deletion(
    conn: &mut PgConnection,
    req: &RetryRequest,
) -> Result<Retried, RequestError> {
    check_text("acting subject", &req.actor_subject_id, 255)?;
    check_text("idempotency key", &req.idempotency_key, 512)?;
    check_channel(&req.access_channel)?;
    let fingerprint = req.fingerprint();
    let mut sp = conn.begin().await?;
    let written = write_retry(&mut sp, req, &fingerprint).await;
    match written {
        Ok(r) => {
            sp.commit().await?;
            Ok(r)
        }
        Err(e) => {
            sp.rollback().await?;
            if let RequestError::Db(db) = &e {
                if is_unique_violation(db, "deletion_retry_audits_job_request_uq")
                    || is_unique_violation(db, "deletion_outbox_job_request_uq")
                {
                    if let Some(found) = existing_retry(conn, req, &fingerprint).await? {
                        return Ok(found);
                    }
                    return Err(RequestError::IdempotencyConflict {
                        key: req.idempotency_key.clone(),
                        job_id: req.job_id,
                    });
                }
            }
            Err(e)
        }
    }
}

async fn existing_retry(
    conn: &mut PgConnection,
    req: &RetryRequest,
    fingerprint: &str,
) -> Result<Option<Retried>, RequestError> {
    let row: Option<(Uuid, String, i32)> = sqlx::query_as(
        "SELECT a.outbox_id, a.request_fingerprint, o.delivery_revision \
         FROM deletion_retry_audits a JOIN deletion_outbox o ON o.id = a.outbox_id AND o.deletion_job_id = a.deletion_job_id \
         WHERE a.deletion_job_id = $1 AND a.request_idempotency_key = $2",
    )
    .bind(req.job_id)
    .bind(&req.idempotency_key)
    .fetch_optional(&mut *conn)
    .await?;
    match row {
        None => Ok(None),
        Some((outbox_id, fp, rev)) if fp == fingerprint => Ok(Some(Retried {
            job_id: req.job_id,
            outbox_id,
            delivery_revision: rev,
            created: false,
        })),
        Some(_) => Err(RequestError::IdempotencyConflict {
            key: req.idempotency_key.clone(),
            job_id: req.job_id,
        }),
    }
}

async fn write_retry(
    conn: &mut PgConnection,
    req: &RetryRequest,
    fingerprint: &str,
) -> Result<Retried, RequestError> {
    if let Some(found) = existing_retry(conn, req, fingerprint).await? {
        return Ok(found);
    }
    let row: Option<(String, Uuid, String, String, String)> = sqlx::query_as(
        "SELECT tenant_id, knowledge_space_id, requested_by_subject_id, run_state, idempotency_key \
         FROM deletion_jobs WHERE id = $1 FOR UPDATE",
    )
    .bind(req.job_id)
    .fetch_optional(&mut *conn)
    .await?;
    let Some((tenant, space, requester, run_state, original_key)) = row else {
        return Err(RequestError::NotFound(format!(
            "no deletion job {}",
            req.job_id
        )));
    };
    if run_state != "failed" {
        return Err(RequestError::NotRetryable {
            job_id: req.job_id,
            why: format!("it is {run_state}; only a failed job can be retried"),
        });
    }
    if req.idempotency_key == original_key {
        return Err(RequestError::Invalid(
            "a retry needs its own idempotency key, not the original request's".into(),
        ));
    }
    match req.authority {
        RetryAuthority::OriginalRequester => {
            if req.actor_subject_id != requester {
                return Err(RequestError::RetryRefused(format!(
                    "{} is not the subject that requested this deletion; only the requester or an interactive owner rescue may retry it",
                    req.actor_subject_id
                )));
            }
        }
        RetryAuthority::InteractiveOwnerRescue => {
            if req.access_channel != "interactive" {
                return Err(RequestError::RetryRefused(
                    "an owner rescue must come from the interactive channel".into(),
                ));
            }
        }
    }
    let snap = valid_snapshot(
        conn,
        &tenant,
        space,
        req.permission_snapshot_id,
        &req.actor_subject_id,
        &req.access_channel,
        "delete",
    )
    .await
    .map_err(|e| match e {
        RequestError::Permission(m) => RequestError::RetryRefused(m),
        other => other,
    })?;
    if req.authority == RetryAuthority::InteractiveOwnerRescue {
        if snap.api_key_id.is_some() {
            return Err(RequestError::RetryRefused(
                "an owner rescue cannot use an API key".into(),
            ));
        }
        if !snap.owner {
            return Err(RequestError::RetryRefused(format!(
                "{} is not an owner of the space (the permission snapshot lacks the 'owner' scope)",
                req.actor_subject_id
            )));
        }
    }

    let revision: i32 = sqlx::query_scalar(
        "SELECT coalesce(max(delivery_revision), 0) + 1 FROM deletion_outbox WHERE deletion_job_id = $1",
    )
    .bind(req.job_id)
    .fetch_one(&mut *conn)
    .await?;
    // Close any outbox row still out for delivery: the new revision is the only live one.
    sqlx::query(
        "UPDATE deletion_outbox SET status = 'dead', lock_token = NULL, locked_by = NULL, locked_until = NULL, \
           last_error = coalesce(last_error, 'superseded by a manual retry'), updated_at = now() \
         WHERE deletion_job_id = $1 AND status IN ('pending', 'dispatching', 'dispatched', 'leased')",
    )
    .bind(req.job_id)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "UPDATE deletion_job_items SET status = 'pending', max_attempts = max_attempts + 1, completed_at = NULL, \
           next_attempt_at = NULL, row_version = row_version + 1, updated_at = now() \
         WHERE deletion_job_id = $1 AND status = 'dead'",
    )
    .bind(req.job_id)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "UPDATE deletion_jobs SET run_state = 'dispatch_pending', execution_attempts = 0, retry_at = NULL, \
           last_error_code = NULL, last_error_message = NULL, row_version = row_version + 1, updated_at = now() \
         WHERE id = $1 AND run_state = 'failed'",
    )
    .bind(req.job_id)
    .execute(&mut *conn)
    .await?;
    let outbox_id = Uuid::now_v7();
    insert_outbox(
        conn,
        outbox_id,
        req.job_id,
        revision,
        &req.idempotency_key,
        fingerprint,
    )
    .await?;
    sqlx::query(
        r#"INSERT INTO deletion_retry_audits (id, deletion_job_id, outbox_id, tenant_id, knowledge_space_id,
             retry_authority, actor_subject_id, permission_snapshot_id, permission_snapshot_revision, access_channel,
             api_key_id, api_key_revision, api_key_expires_at, request_idempotency_key, request_fingerprint, created_at)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, now())"#,
    )
    .bind(Uuid::now_v7())
    .bind(req.job_id)
    .bind(outbox_id)
    .bind(&tenant)
    .bind(space)
    .bind(req.authority.as_str())
    .bind(&req.actor_subject_id)
    .bind(req.permission_snapshot_id)
    .bind(snap.revision)
    .bind(&req.access_channel)
    .bind(snap.api_key_id)
    .bind(snap.api_key_revision)
    .bind(snap.api_key_expires_at)
    .bind(&req.idempotency_key)
    .bind(fingerprint)
    .execute(&mut *conn)
    .await?;
    Ok(Retried {
        job_id: req.job_id,
        outbox_id,
        delivery_revision: revision,
        created: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> DeletionRequest {
        DeletionRequest {
            tenant_id: "t1".into(),
            knowledge_space_id: Uuid::from_u128(1),
            target: Target::Document {
                id: Uuid::from_u128(2),
            },
            expected_revision: None,
            requested_by_subject_id: "alice".into(),
            permission_snapshot_id: Uuid::from_u128(3),
            access_channel: "interactive".into(),
            idempotency_key: "k".into(),
        }
    }

    #[test]
    fn fingerprint_covers_what_is_deleted_and_by_whom_but_not_the_key() {
        let a = req();
        let same = DeletionRequest {
            idempotency_key: "other".into(),
            ..req()
        };
        assert_eq!(a.fingerprint(), same.fingerprint());
        assert_eq!(a.fingerprint().len(), 64);
        for other in [
            DeletionRequest {
                requested_by_subject_id: "bob".into(),
                ..req()
            },
            DeletionRequest {
                expected_revision: Some(1),
                ..req()
            },
            DeletionRequest {
                target: Target::Source {
                    id: Uuid::from_u128(2),
                    mode: SourceMode::Keep,
                },
                ..req()
            },
            DeletionRequest {
                target: Target::Source {
                    id: Uuid::from_u128(2),
                    mode: SourceMode::Cascade,
                },
                ..req()
            },
        ] {
            assert_ne!(a.fingerprint(), other.fingerprint());
        }
    }

    #[test]
    fn bad_input_is_refused_before_any_query() {
        let bad = [
            DeletionRequest {
                access_channel: "web".into(),
                ..req()
            },
            DeletionRequest {
                idempotency_key: " ".into(),
                ..req()
            },
            DeletionRequest {
                target: Target::Space {
                    confirm_name: String::new(),
                },
                ..req()
            },
            DeletionRequest {
                expected_revision: Some(0),
                ..req()
            },
        ];
        for r in bad {
            assert!(
                matches!(r.validate(), Err(RequestError::Invalid(_))),
                "{r:?}"
            );
        }
    }
}
