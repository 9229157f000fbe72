//! deletion.job: durable, fenced, redacting deletion of spaces, sources and documents.
//!
//! Invariant: a deletion job touches only rows and objects of its own tenant and space (every
//! statement on platform data names both, and only object keys under the space's own prefix
//! `spaces/<space>/` are ever erased); each step commits its effects with its checkpoint, and
//! repeating a step is harmless; the job completes only when a residue check, in the completing
//! transaction, finds nothing of the target left, so it finishes having erased everything it was
//! asked to erase, or it fails keeping its active slot for a manual retry.
//!
//! - [`walk`] — the checkpoint transitions, a pure function.
//! - [`request`] — the request and manual-retry writes (library functions on the caller's
//!   transaction).
//! - [`ports`] — object store, secret store and retrieval cache ports.
//! - `quiesce`, `erase`, `purge` — the I/O of each checkpoint.
//! - [`cli`] — `kfs-worker delete ...`.

pub mod cli;
mod erase;
pub mod ports;
mod purge;
mod quiesce;
pub mod request;
pub mod walk;

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgConnection;
use uuid::Uuid;

use super::{Deps, Handler, JobCtx, JobError, Kind, Step};
pub use ports::{
    ForgetSecrets, NoCache, ObjectEraser, PortError, Ports, RetrievalCache, SecretStore,
};
pub use request::{
    request_deletion, retry_deletion, DeletionRequest, RequestError, Requested, Retried,
    RetryAuthority, RetryRequest, SourceMode, Target,
};
use walk::{Checkpoint, Decision, Event};

/// `deletion_jobs.target_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TargetType {
    Space,
    Source,
    Document,
}

impl TargetType {
    pub fn as_str(self) -> &'static str {
        match self {
            TargetType::Space => "knowledge_space",
            TargetType::Source => "source",
            TargetType::Document => "document_asset",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "knowledge_space" => Some(TargetType::Space),
            "source" => Some(TargetType::Source),
            "document_asset" => Some(TargetType::Document),
            _ => None,
        }
    }
}

/// The retrieval-cache key of one document's cached answers and chunks.
pub fn cache_key_for_document(tenant: &str, space: Uuid, document: Uuid) -> String {
    format!("kfs:retrieval:{tenant}:{space}:{document}")
}

/// The retrieval-cache key (a prefix) of everything a space has cached.
pub fn cache_key_for_space(tenant: &str, space: Uuid) -> String {
    format!("kfs:retrieval:{tenant}:{space}")
}

/// The only object keys a job for `space` may erase.
pub fn object_prefix(space: Uuid) -> String {
    format!("spaces/{space}/")
}

/// `agent_workspace_snapshots.invalidation_reason` written by a job.
pub fn invalidation_reason(job: Uuid) -> String {
    format!("deletion_job:{job}")
}

/// Tuning; the defaults suit production, tests shrink them.
#[derive(Clone, Debug)]
pub struct DeletionConfig {
    /// Rows per inventory page and per derived/primary delete statement.
    pub page_size: i64,
    /// Items erased per step.
    pub item_batch: i64,
    /// Port calls in flight at once within a step.
    pub item_concurrency: usize,
    /// Attempts per item before it is dead.
    pub item_max_attempts: i32,
    pub item_retry_base: Duration,
    pub item_retry_max: Duration,
    /// Longest planned wait while leases drain or items wait.
    pub max_wait: Duration,
    /// Inventory passes (residue restarts + 1) before the job fails as `residue_persists`.
    pub max_passes: i32,
}

impl Default for DeletionConfig {
    fn default() -> Self {
        Self {
            page_size: 500,
            item_batch: 200,
            item_concurrency: 16,
            item_max_attempts: 5,
            item_retry_base: Duration::from_secs(2),
            item_retry_max: Duration::from_secs(300),
            max_wait: Duration::from_secs(5),
            max_passes: 20,
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
    pub scan_phase: Option<String>,
    pub scan_cursor: Option<String>,
    pub inventory_complete: bool,
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
            Option<String>,
            bool,
        );
        let row: Option<Row> = sqlx::query_as(
            "SELECT tenant_id, knowledge_space_id, target_type, target_id, delete_mode, checkpoint, scan_phase, \
               scan_cursor, inventory_complete FROM deletion_jobs WHERE id = $1",
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
            scan_phase,
            scan_cursor,
            inventory_complete,
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
            scan_phase,
            scan_cursor,
            inventory_complete,
        })
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
            Checkpoint::Quiescing => quiesce::step(tx, job, &self.cfg).await,
            Checkpoint::DeletingObjects => erase::step(tx, job, &self.cfg, &self.ports).await,
            Checkpoint::DeletingDerivedData => purge::derived_step(tx, job, &self.cfg).await,
            Checkpoint::DeletingPrimaryData => purge::primary_step(tx, job, &self.cfg).await,
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
        Kind::Deletion
    }

    async fn step(&self, tx: &mut PgConnection, ctx: &JobCtx) -> Result<Step, JobError> {
        let job = JobRow::load(tx, ctx.job_id).await?;
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
                quiesce::restart(tx, &job, &self.cfg, &reason).await?;
                Ok(Step::Advance(Checkpoint::Quiescing.as_str().to_owned()))
            }
            Decision::Succeed => Ok(Step::Succeed(Checkpoint::Completed.as_str().to_owned())),
            Decision::Fail { code, message } => Err(JobError::fatal(code, message)),
        }
    }
}

/// Milliseconds as a wait, clamped to `[min, max]`.
pub(crate) fn clamp_wait(ms: Option<f64>, min: Duration, max: Duration) -> Duration {
    let d = ms
        .filter(|m| m.is_finite() && *m > 0.0)
        .map_or(min, |m| Duration::from_millis(m.ceil() as u64));
    d.clamp(min, max.max(min))
}
