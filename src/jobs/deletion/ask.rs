//! What a deletion request asks and how it is refused — the vocabulary every request path (a
//! request, a retry, the fence that admits them) shares — and the two writes a request and a
//! retry both make. Invariant: it depends on no request path, so those paths import it and never
//! one another.

use sqlx::PgConnection;
use uuid::Uuid;

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
    /// One document of the space (a document asset).
    Document { id: Uuid },
    /// A logical document of the space, with the assets only its revisions reference. Its
    /// revision is the document's `row_version`, which may be 0.
    LogicalDocument { id: Uuid },
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

/// A deletion request under a capability grant (the platform's capability provenance): the job
/// records the grant and no subject, snapshot, channel or API key.
#[derive(Clone, Debug)]
pub struct GrantDeletionRequest {
    pub tenant_id: String,
    pub knowledge_space_id: Uuid,
    pub target: Target,
    /// As [`DeletionRequest::expected_revision`].
    pub expected_revision: Option<i32>,
    pub capability_grant_id: Uuid,
    pub idempotency_key: String,
}

/// Who asks: a subject under a permission snapshot on a channel, or a capability grant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Asker {
    Snapshot {
        subject: String,
        snapshot: Uuid,
        channel: String,
    },
    Grant(Uuid),
}

/// A request as the write path sees it, whatever its authority.
#[derive(Clone, Debug)]
pub(super) struct Ask {
    pub tenant_id: String,
    pub knowledge_space_id: Uuid,
    pub target: Target,
    pub expected_revision: Option<i32>,
    pub asker: Asker,
    pub idempotency_key: String,
}

impl From<&DeletionRequest> for Ask {
    fn from(r: &DeletionRequest) -> Self {
        Ask {
            tenant_id: r.tenant_id.clone(),
            knowledge_space_id: r.knowledge_space_id,
            target: r.target.clone(),
            expected_revision: r.expected_revision,
            asker: Asker::Snapshot {
                subject: r.requested_by_subject_id.clone(),
                snapshot: r.permission_snapshot_id,
                channel: r.access_channel.clone(),
            },
            idempotency_key: r.idempotency_key.clone(),
        }
    }
}

impl From<&GrantDeletionRequest> for Ask {
    fn from(r: &GrantDeletionRequest) -> Self {
        Ask {
            tenant_id: r.tenant_id.clone(),
            knowledge_space_id: r.knowledge_space_id,
            target: r.target.clone(),
            expected_revision: r.expected_revision,
            asker: Asker::Grant(r.capability_grant_id),
            idempotency_key: r.idempotency_key.clone(),
        }
    }
}

/// The job a request created or found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Requested {
    pub job_id: Uuid,
    pub outbox_id: Uuid,
    /// `false`: an earlier request with the same key and fingerprint made it.
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

/// The grant, if the platform's fence finds it active in an unfenced space (share-locked for
/// the rest of the caller's transaction); else the refusal, naming why.
pub(super) async fn active_grant(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    grant: Uuid,
) -> Result<crate::capability::Grant, RequestError> {
    crate::capability::check(conn, tenant, space, grant)
        .await?
        .into_result()
        .map_err(|why| RequestError::Permission(format!("capability grant refused: {why}")))
}

pub(super) async fn insert_outbox(
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
