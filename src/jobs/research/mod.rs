//! research.task: a question asked of a knowledge space is planned, answered from the space's
//! published knowledge, and reported with evidence, as the platform's research runtime does it
//! on the platform's own tables.
//!
//! Invariant: each step does the work of the job's current stage and moves it exactly one stage
//! along the walk of [`walk::next_stage`] (or ends it), writing its effects (plan, retrieval,
//! evidence, cost, the final evidence bundle with the answer) and its progress events in the
//! engine's fenced transaction; so a step commits all of that together with the stage it
//! returns, or none of it. The one exception is a model's answer, which streams: its
//! `research_task.answer_delta` events commit as it is made, each only while the task's lease
//! (and grant) still holds ([`stream`]). Every step first applies the deletion fence, then checks
//! the one authority the task's row records and fails closed: a permission snapshot revalidated
//! with the platform's statement (`RESEARCH_TASK_PERMISSION_SNAPSHOT_INVALID`), or a capability
//! grant through the platform's capability fence (`RESEARCH_TASK_CAPABILITY_REVOKED`), each
//! share-locked until the step commits; a row that records neither, or a mix, runs nothing.
//! Retrieval reads only the publication frozen into the task at admission, through its members,
//! and only content whose every permission scope is among the authority's (the snapshot's
//! permission scopes, or the grant's content scope), always naming the job's tenant and space.
//! Tasks stepped together in one transaction read each space's fence and each snapshot's
//! revalidation or grant's check once ([`access::Reads`]) and write each table in one
//! statement; a task alone goes the same way.
//!
//! Where kfs-worker differs from the platform's runtime (each also said where it is done):
//! - The engine's claim commits on its own, so the claim's `stage_changed`
//!   (`{"executionAttempt", "workerClaimed"}`) is written by the attempt's first step (or its
//!   failure, or before the first streamed delta), keyed by the row version the claim wrote.
//! - The platform checks a task's grant in its claim and, when that fails, throws: the claim
//!   rolls back and the task stays runnable, claimed and refused again at every tick. kfs-worker
//!   claims it and fails it closed at the first step after the claim, with
//!   `RESEARCH_TASK_CAPABILITY_REVOKED` and its `research_task.failed` event.
//! - The platform re-reads the grant, unlocked, before each read of the model's stream and
//!   again when it completes the task. kfs-worker's step share-locks it for the whole step (a
//!   revocation waits for the step), each streamed delta re-reads it, and the generating step
//!   checks it once more before it completes the task (`stages`).
//! - The platform writes the final partial result (evidence and answer) in a transaction of its
//!   own before completing the task, so it stays when the completion fails; kfs-worker writes it
//!   in the step that completes the task (`stages`).
//! - An answer made in-process (the extractive generator) is one delta written with the step,
//!   at stage `generating`: it takes no time, so there is nothing to stream ahead of the step.
//!   The platform streams it too, and writes the no-evidence answer's delta at `analyzing`.
//! - The deletion fence cancels a running task (`RESEARCH_TASK_DELETION_FENCE_ACTIVE`) when its
//!   space is being deleted; a deletion of a document or source in the space refuses new tasks
//!   but does not cancel running ones (the platform cancels those too): their documents are
//!   already never read (only `active`, parsed documents are), and kfs-worker's deletion does not
//!   wait for research tasks.
//! - Besides the platform's records, `metadata.result` keeps which evidence the answer cites and
//!   which generator and model made it (the answer itself is only in the final partial result's
//!   `answer`), for `research show` and replays of the answering step.
//!
//! - [`request`] — request a task (library fn in the caller's transaction).
//! - [`control`] — pause, resume, cancel.
//! - [`follow`] — progress events as they commit.
//! - [`walk`] — the stages and every allowed move, as pure functions.
//! - [`plan`], [`evidence`], [`budget`] — planning and ranking, the evidence bundle, the spend,
//!   as pure functions.
//! - [`generator`] — the answer: extractive (default) or an OpenAI-compatible service.
//! - [`stream`] — the answer's deltas as it is made (batching as a pure function).
//! - [`access`], [`snapshot`], [`retrieve`], [`progress`] — the SQL around them; `stages` does
//!   each stage's work.

pub mod access;
pub mod budget;
pub mod cli;
pub mod control;
pub mod evidence;
pub mod follow;
pub mod generator;
pub mod operate;
pub mod plan;
pub mod progress;
pub mod request;
pub mod retrieve;
pub mod snapshot;
mod stages;
pub mod stream;
pub mod walk;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgConnection;
use uuid::Uuid;

pub use control::{cancel, pause, pause_with, resume, ControlError, Controlled};
pub use follow::{follow, Ended};
pub use generator::{Generator, GeneratorConfig};
pub use progress::ProgressEvent;
pub use request::{request, AskedBy, RequestError, Requested, ResearchRequest};
pub use walk::Stage;

use super::{
    Clock, Deps, Handler, JobCtx, JobError, Kind, KindSpec, Policy, RetryPolicy, States, Step,
    Until,
};
use crate::embed::Embedder;
use progress::{payload, EventType, JobScope};
use snapshot::RuntimeSnapshot;

/// The job row, as a step reads it.
#[derive(Clone, Debug, sqlx::FromRow)]
struct JobRow {
    tenant_id: String,
    knowledge_space_id: Uuid,
    capability_grant_id: Option<Uuid>,
    subject_id: Option<String>,
    permission_snapshot_id: Option<Uuid>,
    permission_snapshot_revision: Option<i32>,
    access_channel: Option<String>,
    query: String,
    mode: Option<String>,
    top_k: Option<i32>,
    budget_usd: Option<f64>,
    metadata: serde_json::Value,
    cost: serde_json::Value,
    stage: String,
}

impl JobRow {
    fn scope(&self, job_id: Uuid) -> JobScope {
        JobScope {
            job_id,
            tenant_id: self.tenant_id.clone(),
            space_id: self.knowledge_space_id,
        }
    }

    /// The authority the row records: a whole snapshot binding or a grant alone.
    fn authority(&self) -> Result<access::Authority, String> {
        access::Authority::from_columns(
            self.capability_grant_id,
            self.subject_id.clone(),
            self.permission_snapshot_id,
            self.permission_snapshot_revision,
            self.access_channel.clone(),
        )
    }

    /// The frozen runtime snapshot; `None` for a task admitted before its space had a head.
    fn frozen(&self) -> Result<Option<RuntimeSnapshot>, JobError> {
        match self.metadata.get(snapshot::METADATA_KEY) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => snapshot::validate(v, &self.tenant_id, self.knowledge_space_id)
                .map(Some)
                .map_err(|why| JobError::fatal(snapshot::INVALID, why)),
        }
    }

    /// `mode ?? retrievalProfile.defaultMode ?? 'research'`; an unrouted `auto` is invalid.
    fn mode(&self, frozen: Option<&RuntimeSnapshot>) -> Result<String, JobError> {
        let mode = self
            .mode
            .as_deref()
            .or(frozen.and_then(RuntimeSnapshot::default_mode))
            .unwrap_or("research");
        match mode {
            "fast" | "research" | "deep" => Ok(mode.to_owned()),
            other => Err(JobError::fatal(
                snapshot::INVALID,
                format!("the task's mode is '{other}'; a task runs in the mode it was routed to when requested"),
            )),
        }
    }

    /// `top_k ?? retrievalProfile.topK ?? 10`, within 1..=100.
    fn top_k(&self, frozen: Option<&RuntimeSnapshot>) -> usize {
        let k = self
            .top_k
            .or(frozen.and_then(RuntimeSnapshot::top_k))
            .unwrap_or(request::DEFAULT_TOP_K);
        usize::try_from(k.clamp(1, request::MAX_TOP_K)).unwrap_or(10)
    }
}

/// The rows of the jobs being stepped, by id, in one statement.
async fn load(tx: &mut PgConnection, ctxs: &[JobCtx]) -> Result<HashMap<Uuid, JobRow>, JobError> {
    let ids: Vec<Uuid> = ctxs.iter().map(|c| c.job_id).collect();
    let rows: Vec<(Uuid, JobRow)> = sqlx::query_as(
        "SELECT id, tenant_id, knowledge_space_id, capability_grant_id, subject_id, permission_snapshot_id, \
           permission_snapshot_revision, access_channel, query, mode, top_k, budget_usd, metadata, cost, stage \
         FROM research_task_jobs WHERE id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(tx)
    .await?
    .into_iter()
    .map(|r: IdRow| (r.id, r.row))
    .collect();
    Ok(rows.into_iter().collect())
}

#[derive(sqlx::FromRow)]
struct IdRow {
    id: Uuid,
    #[sqlx(flatten)]
    row: JobRow,
}

pub struct ResearchHandler {
    generator: Arc<dyn Generator>,
    embedder: Arc<dyn Embedder>,
    /// Where a streamed answer's deltas take their connections (see [`stream`]): the pool of
    /// the engine that runs this handler. Without one, deltas are written with the step.
    stream_pool: std::sync::Mutex<Option<sqlx::PgPool>>,
}

impl ResearchHandler {
    /// Reads the generator settings from the environment (`KFS_GENERATOR`, `KFS_OPENAI_*`); the
    /// query embedder is the process's.
    pub fn new(deps: Deps) -> Result<Self, crate::config::ConfigError> {
        let cfg = generator::generator_config(|k| std::env::var(k).ok())?;
        Ok(Self {
            generator: generator::build(&cfg)?,
            embedder: deps.embedder,
            stream_pool: std::sync::Mutex::new(None),
        })
    }

    /// A handler with this generator and the deterministic offline embedder.
    pub fn with_generator(generator: Arc<dyn Generator>) -> Self {
        Self {
            generator,
            embedder: Arc::new(crate::embed::Offline),
            stream_pool: std::sync::Mutex::new(None),
        }
    }

    /// The same handler embedding queries with `embedder`.
    pub fn with_embedder(mut self, embedder: Arc<dyn Embedder>) -> Self {
        self.embedder = embedder;
        self
    }

    pub fn generator(&self) -> &Arc<dyn Generator> {
        &self.generator
    }

    /// The pool a streamed answer writes its deltas through, when an engine gave one.
    fn stream_pool(&self) -> Option<sqlx::PgPool> {
        self.stream_pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// The scope and the stage a failure's or retry's hook records at, with the claim event of the
/// attempt written first when no step of it committed.
async fn hook_scope(
    tx: &mut PgConnection,
    ctx: &JobCtx,
) -> Result<Option<(JobScope, i32, Option<String>, Option<i64>, String)>, sqlx::Error> {
    let Some(scope) = progress::scope_of(tx, ctx.job_id).await? else {
        return Ok(None);
    };
    if ctx.leased() {
        // Only an attempt this worker claimed has a claim event to write; a failure the relay
        // or a delivery's diagnosis records claimed nothing.
        let claimed = Stage::parse(&ctx.checkpoint).unwrap_or(Stage::Queued);
        progress::ensure_claimed(tx, &scope, ctx.row_version, ctx.execution_attempts, claimed)
            .await?;
    }
    let (row_version, error, retry_at, stage): (i32, Option<String>, Option<i64>, String) =
        sqlx::query_as(
            "SELECT row_version, error, retry_at, stage FROM research_task_jobs WHERE id = $1 AND tenant_id = $2",
        )
        .bind(ctx.job_id)
        .bind(&scope.tenant_id)
        .fetch_one(&mut *tx)
        .await?;
    Ok(Some((scope, row_version, error, retry_at, stage)))
}

/// A failed task's `research_task.failed {"error": <code>}`, in the transaction that failed it,
/// keyed by the row version the failure wrote (see [`crate::jobs::failed`]).
pub(crate) async fn record_failure(
    tx: &mut PgConnection,
    ctx: &JobCtx,
    code: &str,
) -> Result<(), sqlx::Error> {
    let Some((scope, row_version, ..)) = hook_scope(tx, ctx).await? else {
        return Ok(());
    };
    progress::append_event(
        tx,
        &scope,
        row_version,
        EventType::Failed,
        Stage::Failed,
        payload::failed(code),
    )
    .await?;
    Ok(())
}

#[async_trait::async_trait]
impl Handler for ResearchHandler {
    fn kind(&self) -> Kind {
        KIND
    }

    /// A task's steps read and write only the database when its answers and query embeddings
    /// are made in this process (the extractive generator, the offline embedder): tasks
    /// claimed together then take each stage in one transaction. With a model or embedding
    /// service, each step keeps its own transaction.
    fn shares_transaction(&self) -> bool {
        self.generator.in_process() && self.embedder.in_process()
    }

    /// A model's answer streams through connections of the engine's pool, beside the step's
    /// transaction.
    fn attach(&self, pool: &sqlx::PgPool) {
        *self
            .stream_pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(pool.clone());
    }

    /// A scheduled retry gets its `stage_changed {"error", "retryAt", "retryScheduled": true}`
    /// at the job's stage, in the same transaction.
    async fn on_retry(
        &self,
        tx: &mut PgConnection,
        ctx: &JobCtx,
        code: &str,
    ) -> Result<(), sqlx::Error> {
        let Some((scope, row_version, error, retry_at, stage)) = hook_scope(tx, ctx).await? else {
            return Ok(());
        };
        let stage = Stage::parse(&stage).unwrap_or(Stage::Queued);
        progress::append_event(
            tx,
            &scope,
            row_version,
            EventType::StageChanged,
            stage,
            payload::retry(
                error.as_deref().unwrap_or(code),
                retry_at.unwrap_or_default(),
            ),
        )
        .await?;
        Ok(())
    }

    async fn step(&self, tx: &mut PgConnection, ctx: &JobCtx) -> Result<Step, JobError> {
        // One member: it is always stepped, whatever the deadline.
        let until = Until::new(std::time::Instant::now());
        let mut steps = self.step_many(tx, std::slice::from_ref(ctx), until).await?;
        steps
            .pop()
            .ok_or_else(|| JobError::fatal("job_missing", "the research task row is gone"))
    }

    /// The tasks' steps in one pass over the group: their rows loaded in one statement, each
    /// space's fence and each snapshot's revalidation read once ([`access::Reads`]), the claim
    /// events looked up in one statement, and every write collected and made in one statement
    /// per table ([`stages::Group`]). One task alone goes the same way. The pass steps every
    /// task, whatever `until` says: a stage here is a few short statements per task, and the
    /// pass has no point between tasks where it could stop.
    async fn step_many(
        &self,
        tx: &mut PgConnection,
        ctxs: &[JobCtx],
        _until: Until,
    ) -> Result<Vec<Step>, JobError> {
        let mut rows = load(tx, ctxs).await?;
        let scopes: Vec<JobScope> = ctxs
            .iter()
            .map(|ctx| match rows.get(&ctx.job_id) {
                Some(job) => Ok(job.scope(ctx.job_id)),
                None => Err(JobError::fatal(
                    "job_missing",
                    "the research task row is gone",
                )),
            })
            .collect::<Result<_, _>>()?;
        let attempts: Vec<(&JobScope, i32)> = scopes
            .iter()
            .zip(ctxs)
            .map(|(s, ctx)| (s, ctx.execution_attempts))
            .collect();
        let unclaimed: HashSet<Uuid> = progress::unclaimed(tx, &attempts)
            .await?
            .into_iter()
            .collect();
        let mut group = stages::Group::default();
        let mut steps = Vec::with_capacity(ctxs.len());
        for (ctx, scope) in ctxs.iter().zip(scopes) {
            let job = rows.remove(&ctx.job_id).ok_or_else(|| {
                JobError::fatal("bad_group", "the same research task is twice in one group")
            })?;
            let claim = unclaimed.contains(&ctx.job_id);
            steps.push(
                self.step_one(tx, &mut group, ctx, &job, scope, claim)
                    .await?,
            );
        }
        group.flush(tx).await?;
        Ok(steps)
    }
}

impl ResearchHandler {
    /// One task's step within `group`; `claim`: its attempt's claim event is still to write.
    async fn step_one(
        &self,
        tx: &mut PgConnection,
        group: &mut stages::Group,
        ctx: &JobCtx,
        job: &JobRow,
        scope: JobScope,
        claim: bool,
    ) -> Result<Step, JobError> {
        let stage = Stage::parse(&job.stage).ok_or_else(|| {
            JobError::fatal("bad_stage", format!("unknown stage '{}'", job.stage))
        })?;
        if walk::next_stage(stage).is_none() {
            return Err(JobError::fatal(
                "bad_stage",
                format!("a worker has nothing to do at stage '{stage}'"),
            ));
        }
        // The row version this step's transition writes.
        let next_rv = ctx.row_version + 1;
        let claimed = |group: &mut stages::Group| {
            if claim {
                group.event(progress::claimed_event(
                    &scope,
                    ctx.row_version,
                    ctx.execution_attempts,
                    stage,
                ));
            }
        };
        let deletions = group
            .reads
            .deletions(tx, &job.tenant_id, job.knowledge_space_id)
            .await?;
        if let Some(why) = access::running_fence(&deletions) {
            claimed(group);
            group.event(progress::NewEvent::at(
                &scope,
                next_rv,
                EventType::Canceled,
                Stage::Canceled,
                payload::because(Some(access::DELETION_FENCE_ACTIVE)),
            ));
            return Ok(Step::Cancel {
                code: access::DELETION_FENCE_ACTIVE.into(),
                message: why,
            });
        }
        let authority = job.authority();
        let authorized = group
            .reads
            .authorize(
                tx,
                &job.tenant_id,
                job.knowledge_space_id,
                authority.as_ref().map_err(String::as_str),
            )
            .await?
            .map_err(|d| JobError::fatal(d.code, d.why))?;
        claimed(group);
        // As on the platform, the frozen tuple is loaded once the task is planning.
        let (frozen, mode, top_k) = if stage == Stage::Queued {
            (None, String::new(), 0)
        } else {
            let frozen = job.frozen()?;
            let mode = job.mode(frozen.as_ref())?;
            let top_k = job.top_k(frozen.as_ref());
            (frozen, mode, top_k)
        };
        let run = stages::Run {
            handler: self,
            job,
            scope,
            ctx,
            next_rv,
            claim,
            authorized,
            frozen,
            mode,
            top_k,
        };
        run.stage(tx, group, stage).await
    }
}

// ---------------------------------------------------------------------------------------------
// Registration: this kind's identity, tables, policy and handler (one line in `jobs::registry`).
// ---------------------------------------------------------------------------------------------

pub const KIND: Kind = Kind::new("research");

pub static RESEARCH: KindSpec = KindSpec {
    kind: KIND,
    event_type: "research.task",
    job_table: "research_task_jobs",
    outbox_table: "research_task_outbox",
    outbox_fk: "research_task_job_id",
    payload_id_field: "researchTaskJobId",
    clock: Clock::EpochMillis,
    states: States::Stage,
    superseded_state: false,
    generic_plans: true,
    fairness: Some(super::Fairness {
        // No mark moves a research job; a job a consumer never claimed has no attempt yet.
        fresh: "j.stage = 'queued' AND j.execution_attempts = 0",
    }),
    revisions: true,
    max_connections: Some(super::PLATFORM_KIND_CONNECTIONS),
    policy: Policy {
        lease: Duration::from_secs(30),
        max_attempts: 5,
        retry: RetryPolicy {
            base: Duration::from_secs(5),
            max: Duration::from_secs(5 * 60),
        },
    },
    record_failure: Some(record_failure_boxed),
};

pub static ENTRY: super::Entry = super::Entry {
    ops: &operate::OPERATIONS,
    prepare: None,
    spec: &RESEARCH,
    default: true,
    handler: |deps| Ok(std::sync::Arc::new(ResearchHandler::new(deps.clone())?)),
};

fn record_failure_boxed<'a>(
    tx: &'a mut PgConnection,
    job: &'a JobCtx,
    code: &'a str,
) -> futures_util::future::BoxFuture<'a, Result<(), sqlx::Error>> {
    Box::pin(record_failure(tx, job, code))
}
