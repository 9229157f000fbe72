//! deletion.job: durable, fenced, redacting deletion of spaces, sources, documents and logical
//! documents, on the platform's schema and in the order of the platform's own durable-deletion
//! runtime.
//!
//! Invariant: a deletion job touches only rows and objects of its own tenant and space (every
//! statement on platform data names both, and only object keys under the space's manifest prefix
//! `knowledge_space_manifests.object_key_prefix` are ever listed or erased); each step commits its
//! effects with its checkpoint, and repeating a step is harmless; the job completes only when a
//! residue check over every table the target can leave rows in, and a probe of the object store,
//! both in the completing transaction, find nothing of the target left, so it finishes having
//! erased everything it was asked to erase, or it fails keeping its active slot for a manual retry.
//! A job runs only on the authority it was requested with: a job bound to a capability grant has
//! the grant checked ([`crate::capability::check`]) in the transaction of every step, so a
//! revoked grant or a fenced space fails it closed (`CAPABILITY_REVOKED`, slot, tombstone and
//! target fences kept, outbox `dead`) before the step writes anything; a row that records a mix
//! of authorities fails the same way.
//!
//! Where kfs-worker differs from the platform here: the platform checks the grant when it claims a
//! job (failing it in the claim transaction, `execution_attempts` unchanged) and before completion
//! (where a failed check becomes a retry that the next claim turns into the failure). kfs-worker's
//! engine claims every kind generically, so the check runs at the start of each step instead:
//! the claim has then already counted an execution attempt, the completing transaction fails the
//! job at once rather than through a retry, and the outbox's `last_error` reads
//! `CAPABILITY_REVOKED: <message>` (the engine's format) where the platform stores the message.
//!
//! - [`walk`] — the checkpoint transitions, a pure function.
//! - `authority` — the grant fence of every step and the content-scope rule, pure decisions.
//! - [`request`], `retry` — the request and manual-retry writes (library functions on the
//!   caller's transaction); `authz` — who may make them; `fence` — what a request fences.
//! - [`ports`] — object store, secret store and retrieval cache ports.
//! - `quiesce` (cancel and drain), `inventory`, `head` — the `quiescing` checkpoint.
//! - `erase` — `deleting_objects`; `purge`, `derived` — `deleting_derived_data`;
//!   `primary`, `residue` — `deleting_primary_data` and completion; `sql` — shared predicates.
//! - [`cli`] — `kfs-worker delete ...`.

mod ask;
mod authority;
mod authz;
pub mod cli;
mod derived;
mod erase;
mod fence;
mod head;
mod inventory;
pub mod operate;
pub mod ports;
mod primary;
mod purge;
mod quiesce;
pub use quiesce::{FENCE_CODE, FENCE_MESSAGE};
pub mod request;
mod residue;
mod retry;
mod sql;
pub mod walk;

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgConnection;
use uuid::Uuid;

use super::{
    Clock, Deps, Handler, JobCtx, JobError, Kind, KindSpec, Policy, RetryPolicy, States, Step,
};
pub use authority::{CAPABILITY_REVOKED, CAPABILITY_REVOKED_MESSAGE};
pub use ports::{
    CachePage, ForgetSecrets, NoCache, ObjectEraser, PortError, Ports, RetrievalCache, SecretRef,
    SecretStore,
};
pub use request::{
    request_deletion, request_deletion_under_grant, retry_deletion, retry_deletion_under_grant,
    DeletionRequest, GrantDeletionRequest, GrantRetryRequest, RequestError, Requested, Retried,
    RetryAuthority, RetryRequest, SourceMode, Target,
};
use walk::{Checkpoint, Decision, Event};

/// `deletion_jobs.target_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TargetType {
    Space,
    Source,
    Document,
    /// A logical document (the platform's 0022 aggregate) with the assets only it references.
    LogicalDocument,
}

impl TargetType {
    pub fn as_str(self) -> &'static str {
        match self {
            TargetType::Space => "knowledge_space",
            TargetType::Source => "source",
            TargetType::Document => "document_asset",
            TargetType::LogicalDocument => "logical_document",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "knowledge_space" => Some(TargetType::Space),
            "source" => Some(TargetType::Source),
            "document_asset" => Some(TargetType::Document),
            "logical_document" => Some(TargetType::LogicalDocument),
            _ => None,
        }
    }
}

/// The cache prefixes a deletion of anything in the space drains, in the platform's order: the
/// legacy prefixes (global: they carry no tenant or space), then the space's own v2 prefixes.
pub fn cache_prefixes(tenant: &str, space: Uuid) -> Vec<String> {
    let t = crate::canonical::sha256_hex(tenant.as_bytes());
    let mut out: Vec<String> = [
        "contextual-enrichment:",
        "evidence-bundle:",
        "knowledge-path:",
        "query-normalization:",
        "session-context:",
    ]
    .iter()
    .map(|p| (*p).to_owned())
    .collect();
    // A UUID is its own URI component.
    out.push(format!(
        "space-cache:v2:contextual-enrichment:space:{space}:"
    ));
    out.push(format!("space-cache:v2:evidence-bundle:space:{space}:"));
    out.push(format!(
        "space-cache:v2:knowledge-path:tenant:{t}:space:{space}:"
    ));
    out.push(format!(
        "space-cache:v2:session-context:tenant:{t}:space:{space}:"
    ));
    out
}

/// Whether `prefix` is a well-formed manifest prefix: `/`-separated segments of
/// `[A-Za-z0-9._=-]`, no `..`, at most 512 characters.
pub fn valid_prefix(prefix: &str) -> bool {
    !prefix.is_empty()
        && prefix.len() <= 512
        && !prefix.contains("..")
        && prefix.split('/').all(|seg| {
            !seg.is_empty()
                && seg
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '=' | '-'))
        })
}

/// `agent_workspace_snapshots.invalidation_reason` written when a deletion is requested.
pub fn request_invalidation_reason(target: TargetType) -> String {
    format!("durable-deletion:{}", target.as_str())
}

/// `agent_workspace_snapshots.invalidation_reason` written by the derived-data step.
pub const INVALIDATION_REASON: &str = "durable-deletion";

/// The digest of an inventory item (`payload_digest`): SHA-256 over the platform's framed
/// fields (each prefixed by its byte length), with the job's idempotency key as the operation key
/// and the item's canonical JSON as the value.
pub(crate) fn payload_digest(
    tenant: &str,
    space: Uuid,
    job_key: &str,
    kind: &str,
    resource: Option<Uuid>,
    object_key: Option<&str>,
    credential_ref: Option<&str>,
) -> String {
    let value = serde_json::json!({
        "cacheKey": null,
        "credentialRef": credential_ref,
        "kind": kind,
        "objectKey": object_key,
        "resourceId": resource.map(|r| r.to_string()),
    });
    let mut framed = Vec::new();
    for field in [
        "knowledge-fs/durable-deletion/v1",
        "inventory_payload",
        tenant,
        &space.to_string(),
        job_key,
        &value.to_string(),
    ] {
        framed.extend_from_slice(&(field.len() as u32).to_be_bytes());
        framed.extend_from_slice(field.as_bytes());
    }
    crate::canonical::sha256_hex(&framed)
}

/// Tuning; the defaults suit production, tests shrink them.
#[derive(Clone, Debug)]
pub struct DeletionConfig {
    /// Rows (or keys) per inventory page and per derived/primary delete statement.
    pub page_size: i64,
    /// Items erased per step.
    pub item_batch: i64,
    /// Port calls in flight at once within a step.
    pub item_concurrency: usize,
    /// Attempts per item before it is dead (the platform: the job's attempts, 10).
    pub item_max_attempts: i32,
    pub item_retry_base: Duration,
    pub item_retry_max: Duration,
    /// Longest planned wait while leases drain or items wait.
    pub max_wait: Duration,
    /// Inventory passes (residue restarts + 1) before the job fails as `residue_persists`.
    pub max_passes: i32,
    /// How long a space-wide step queues behind another deletion's step in the same space
    /// before it gives its slice back (a cooperative wait: no attempt used).
    pub space_lock_wait: Duration,
}

impl Default for DeletionConfig {
    fn default() -> Self {
        Self {
            page_size: 500,
            item_batch: 200,
            item_concurrency: 16,
            item_max_attempts: request::MAX_EXECUTION_ATTEMPTS,
            item_retry_base: Duration::from_secs(1),
            item_retry_max: Duration::from_secs(300),
            max_wait: Duration::from_secs(5),
            max_passes: 20,
            space_lock_wait: Duration::from_secs(10),
        }
    }
}

/// What is being deleted, with its mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scope {
    Space,
    Document(Uuid),
    SourceKeep(Uuid),
    SourceCascade(Uuid),
    /// A logical document: its documents are the assets the request fenced with this job.
    LogicalDocument(Uuid),
}

impl Scope {
    pub fn is_source(self) -> bool {
        matches!(self, Scope::SourceKeep(_) | Scope::SourceCascade(_))
    }
}

/// The job row as a step sees it (locked by the engine's fence).
#[derive(Clone, Debug)]
pub(crate) struct JobRow {
    pub id: Uuid,
    pub tenant: String,
    pub space: Uuid,
    pub target_id: Uuid,
    pub scope: Scope,
    pub checkpoint: Checkpoint,
    pub scan_cursor: Option<String>,
    pub inventory_complete: bool,
    pub idempotency_key: String,
    /// The authority the job was requested under, or why its row records none coherently.
    pub authority: Result<crate::access::Authority, String>,
}

impl JobRow {
    async fn load(tx: &mut PgConnection, id: Uuid) -> Result<JobRow, JobError> {
        type Row = (
            String,
            Uuid,
            String,
            Uuid,
            String,
            String,
            Option<String>,
            bool,
            String,
            Option<Uuid>,
            Option<String>,
            Option<Uuid>,
            Option<i32>,
            Option<String>,
        );
        let row: Option<Row> = sqlx::query_as(
            "SELECT tenant_id, knowledge_space_id, target_type, target_id, delete_mode, checkpoint, scan_cursor, \
               inventory_complete, idempotency_key, capability_grant_id, requested_by_subject_id, \
               permission_snapshot_id, permission_snapshot_revision, access_channel \
             FROM deletion_jobs WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((
            tenant,
            space,
            target_type,
            target_id,
            mode,
            cp,
            scan_cursor,
            complete,
            key,
            grant,
            subject,
            snapshot,
            revision,
            channel,
        )) = row
        else {
            return Err(JobError::fatal(
                "job_missing",
                format!("no deletion job {id}"),
            ));
        };
        let scope = match (TargetType::parse(&target_type), mode.as_str()) {
            (Some(TargetType::Space), _) => Scope::Space,
            (Some(TargetType::Document), _) => Scope::Document(target_id),
            (Some(TargetType::LogicalDocument), _) => Scope::LogicalDocument(target_id),
            (Some(TargetType::Source), "keep") => Scope::SourceKeep(target_id),
            (Some(TargetType::Source), "cascade") => Scope::SourceCascade(target_id),
            _ => {
                return Err(JobError::fatal(
                    "bad_target",
                    format!("unknown target {target_type}/{mode}"),
                ))
            }
        };
        let checkpoint = Checkpoint::parse(&cp).ok_or_else(|| {
            JobError::fatal("bad_checkpoint", format!("unknown checkpoint '{cp}'"))
        })?;
        Ok(JobRow {
            id,
            tenant,
            space,
            target_id,
            scope,
            checkpoint,
            scan_cursor,
            inventory_complete: complete,
            idempotency_key: key,
            authority: crate::access::Authority::from_columns(
                grant, subject, snapshot, revision, channel,
            ),
        })
    }

    /// The space's object-key prefix from its manifest, validated. A space without a manifest
    /// has no prefix a deletion could stay inside: that is an error, never "everything".
    pub(crate) async fn prefix(&self, tx: &mut PgConnection) -> Result<String, JobError> {
        let prefix: Option<String> = sqlx::query_scalar(
            "SELECT object_key_prefix::text FROM knowledge_space_manifests \
             WHERE tenant_id = $1 AND knowledge_space_id = $2 ORDER BY manifest_version DESC LIMIT 1",
        )
        .bind(&self.tenant)
        .bind(self.space)
        .fetch_optional(&mut *tx)
        .await?;
        match prefix {
            Some(p) if valid_prefix(&p) => Ok(p),
            Some(_) => Err(JobError::retryable(
                "object_prefix_invalid",
                "the space's manifest names an invalid object key prefix",
            )),
            None => Err(JobError::retryable(
                "manifest_missing",
                "the space has no manifest, so no object key prefix to delete under",
            )),
        }
    }
}

/// The deletion.job handler.
pub struct DeletionHandler {
    ports: Ports,
    cfg: DeletionConfig,
}

impl DeletionHandler {
    /// Erases objects through `deps.store`, with the default secret store and cache.
    pub fn new(deps: Deps) -> Result<Self, crate::config::ConfigError> {
        Ok(Self::with_ports(
            deps,
            Arc::new(ForgetSecrets),
            Arc::new(NoCache),
        ))
    }

    /// With a custom secret store and cache.
    pub fn with_ports(
        deps: Deps,
        secrets: Arc<dyn SecretStore>,
        cache: Arc<dyn RetrievalCache>,
    ) -> Self {
        Self {
            ports: Ports {
                objects: Arc::new(deps.store),
                secrets,
                cache,
            },
            cfg: DeletionConfig::default(),
        }
    }

    /// Replaces the object port (e.g. a failing one in tests).
    pub fn with_objects(mut self, objects: Arc<dyn ObjectEraser>) -> Self {
        self.ports.objects = objects;
        self
    }

    pub fn with_config(mut self, cfg: DeletionConfig) -> Self {
        self.cfg = cfg;
        self
    }

    pub fn config(&self) -> &DeletionConfig {
        &self.cfg
    }

    async fn event(&self, tx: &mut PgConnection, job: &JobRow) -> Result<Event, JobError> {
        match job.checkpoint {
            Checkpoint::Requested => Ok(Event::Started),
            Checkpoint::Quiescing => quiesce::step(tx, job, &self.cfg, &self.ports).await,
            Checkpoint::DeletingObjects => erase::step(tx, job, &self.cfg, &self.ports).await,
            Checkpoint::DeletingDerivedData => {
                purge::derived_step(tx, job, &self.cfg, &self.ports).await
            }
            Checkpoint::DeletingPrimaryData => primary::step(tx, job, &self.cfg, &self.ports).await,
            Checkpoint::Completed => Err(JobError::fatal(
                "already_completed",
                "the job is already at its final checkpoint",
            )),
        }
    }
}

#[async_trait::async_trait]
impl Handler for DeletionHandler {
    fn kind(&self) -> Kind {
        KIND
    }

    async fn step(&self, tx: &mut PgConnection, ctx: &JobCtx) -> Result<Step, JobError> {
        let job = JobRow::load(tx, ctx.job_id).await?;
        if space_wide(job.checkpoint)
            && !lock_space(tx, job.space, self.cfg.space_lock_wait).await?
        {
            return Ok(Step::Wait {
                delay: SPACE_LOCK_RETRY,
                reason: "another deletion in the space is taking a step".into(),
            });
        }
        // The job's authority, before anything of the step is written: a revoked grant or a
        // fenced space fails the job here, whatever the checkpoint (the claim's first step, each
        // checkpoint after it, and the completing transaction alike).
        authority::fence(tx, &job).await?;
        let event = self.event(tx, &job).await?;
        let decision = walk::transition(job.checkpoint, event)
            .map_err(|e| JobError::fatal("bad_transition", e.to_string()))?;
        tracing::debug!(job_id = %job.id, checkpoint = %job.checkpoint, ?decision, "deletion step");
        match decision {
            Decision::Advance(cp) => Ok(Step::Advance(cp.as_str().to_owned())),
            Decision::Wait { delay, reason } => Ok(Step::Wait {
                delay: delay.max(Duration::from_millis(50)),
                reason,
            }),
            Decision::Restart { reason } => {
                inventory::restart(tx, &job, &self.cfg, &reason).await?;
                Ok(Step::Advance(Checkpoint::Quiescing.as_str().to_owned()))
            }
            Decision::Succeed => Ok(Step::Succeed(Checkpoint::Completed.as_str().to_owned())),
            Decision::Fail { code, message } => Err(JobError::fatal(code, message)),
        }
    }
}

/// The advisory-lock class of the space-wide steps of deletions (the liveness locks use 7038579).
pub const SPACE_LOCK_CLASS: i32 = 7_038_580;
const SPACE_LOCK_RETRY: Duration = Duration::from_millis(500);

/// Steps that read and write rows of the whole space (its leases, research residue, head,
/// historical publications, residue): deletions of the same space take them one at a time, so
/// that they never deadlock on each other's rows. Erasing objects is per job.
fn space_wide(cp: Checkpoint) -> bool {
    matches!(
        cp,
        Checkpoint::Quiescing | Checkpoint::DeletingDerivedData | Checkpoint::DeletingPrimaryData
    )
}

/// Takes the space's deletion lock for the rest of the transaction, queueing for it up to
/// `wait`. `false`: another deletion held it all that time (the transaction is as it was).
///
/// The wait is Postgres' own lock queue (`lock_timeout` for this statement alone), not a
/// polling loop: waiters get the lock in the order they asked, the moment its holder commits.
/// With polling, every hand-over lost a nap of up to 100 ms while the lock stood free, and the
/// space-wide steps of a space's deletions run only one at a time.
async fn lock_space(
    tx: &mut PgConnection,
    space: uuid::Uuid,
    wait: Duration,
) -> Result<bool, sqlx::Error> {
    let lock_wait = crate::db::LockWait::begin(tx, wait).await?;
    let locked = sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
        .bind(SPACE_LOCK_CLASS)
        .bind(space.to_string())
        .execute(&mut *tx)
        .await;
    Ok(lock_wait.end(tx, locked).await?.is_some())
}

/// Milliseconds as a wait, clamped to `[min, max]`.
pub(crate) fn clamp_wait(ms: Option<f64>, min: Duration, max: Duration) -> Duration {
    let d = ms
        .filter(|m| m.is_finite() && *m > 0.0)
        .map_or(min, |m| Duration::from_millis(m.ceil() as u64));
    d.clamp(min, max.max(min))
}

// ---------------------------------------------------------------------------------------------
// Registration: this kind's identity, tables, policy and handler (one line in `jobs::registry`).
// ---------------------------------------------------------------------------------------------

pub const KIND: Kind = Kind::new("deletion");

pub static DELETION: KindSpec = KindSpec {
    kind: KIND,
    event_type: "deletion.job",
    job_table: "deletion_jobs",
    outbox_table: "deletion_outbox",
    outbox_fk: "deletion_job_id",
    payload_id_field: "deletionJobId",
    clock: Clock::Timestamptz,
    states: States::RunState {
        failed_keeps_slot: true,
    },
    superseded_state: false,
    generic_plans: true,
    fairness: Some(super::FRESH_RUN_STATE),
    revisions: true,
    max_connections: Some(super::PLATFORM_KIND_CONNECTIONS),
    policy: Policy {
        lease: Duration::from_secs(30),
        max_attempts: 10,
        retry: RetryPolicy {
            base: Duration::from_secs(5),
            max: Duration::from_secs(5 * 60),
        },
    },
    record_failure: None,
};

pub static ENTRY: super::Entry = super::Entry {
    ops: &operate::OPERATIONS,
    prepare: None,
    spec: &DELETION,
    default: true,
    handler: |deps| Ok(std::sync::Arc::new(DeletionHandler::new(deps.clone())?)),
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_follow_the_platform() {
        assert!(valid_prefix(
            "tenant-a/spaces/0198c6a0-0000-7000-8000-000000000001"
        ));
        for bad in ["", "/a", "a/", "a//b", "a/../b", "a b", "a/ü"] {
            assert!(!valid_prefix(bad), "{bad}");
        }
        let p = cache_prefixes("t", Uuid::nil());
        assert_eq!(p.len(), 9);
        assert_eq!(p[0], "contextual-enrichment:");
        assert!(p[8].starts_with("space-cache:v2:session-context:tenant:"));
        assert!(p[8].ends_with(&format!(":space:{}:", Uuid::nil())));
    }

    #[test]
    fn item_digests_cover_the_job_and_the_payload() {
        let d = |key: &str, obj: &str| {
            payload_digest("t", Uuid::nil(), key, "object", None, Some(obj), None)
        };
        assert_eq!(d("k", "a").len(), 64);
        assert_eq!(d("k", "a"), d("k", "a"));
        assert_ne!(d("k", "a"), d("k2", "a"));
        assert_ne!(d("k", "a"), d("k", "b"));
    }
}
