//! research.task: a question asked of a knowledge space is planned, answered from the space's
//! published knowledge, and reported with evidence.
//!
//! Invariant: each step does the work of the job's current stage and moves it exactly one stage
//! along the walk of [`walk::next_stage`], writing its effects (plan, evidence partials, answer,
//! cost) and exactly one progress event in the engine's fenced transaction; so a step commits
//! all of that together with the stage it returns, or none of it. Every step re-checks, fail
//! closed, that the space is live and the permission snapshot still grants access; retrieval
//! reads only nodes the space's current head publishes, always naming the job's tenant and
//! space.
//!
//! - [`request`] — request a task (library fn in the caller's transaction).
//! - [`control`] — pause, resume, cancel.
//! - [`follow`] — progress events as they commit.
//! - [`walk`] — the stages and every allowed move, as pure functions.
//! - [`plan`] — planning and ranking, as pure functions.
//! - [`generator`] — the answer: extractive (default) or an OpenAI-compatible service.
//! - [`access`], [`retrieve`], [`progress`] — the SQL around them.

pub mod access;
pub mod cli;
pub mod control;
pub mod follow;
pub mod generator;
pub mod plan;
pub mod progress;
pub mod request;
pub mod retrieve;
pub mod walk;

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::PgConnection;
use uuid::Uuid;

pub use control::{cancel, pause, resume, ControlError, Controlled};
pub use follow::{follow, Ended};
pub use generator::{Generator, GeneratorConfig};
pub use progress::ProgressEvent;
pub use request::{request, RequestError, Requested, ResearchRequest};
pub use walk::Stage;

use super::{Deps, Handler, JobCtx, JobError, Kind, Step};
use generator::{Generation, GenerationRequest};
use plan::{Bundle, Evidence, Plan};
use progress::{EventType, JobScope, NOW_MS};

/// What the task spent on generation, stored in `cost`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Cost {
    pub usd: f64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub calls: u64,
    /// Some usage was estimated from text length (the service reported none).
    pub estimated: bool,
}

impl Cost {
    pub fn add(&self, g: &Generation) -> Cost {
        let u = g.usage.unwrap_or_default();
        Cost {
            usd: self.usd + g.cost_usd,
            prompt_tokens: self.prompt_tokens + u.prompt_tokens,
            completion_tokens: self.completion_tokens + u.completion_tokens,
            calls: self.calls + u64::from(g.usage.is_some()),
            estimated: self.estimated || u.estimated,
        }
    }
}

/// Whether spending `usd` stays within `budget`. Pure.
pub fn within_budget(usd: f64, budget: Option<f64>) -> bool {
    budget.is_none_or(|b| usd <= b)
}

/// A partial result, as stored in `evidence_bundle`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum Partial {
    /// The hits of one sub-query.
    Retrieval(Bundle),
    /// The ranked, de-duplicated evidence the answer is generated from.
    Ranked { evidence: Vec<Evidence> },
    /// The answer and its citations.
    Answer(Generation),
}

/// The job row, as a step reads it.
#[derive(Clone, Debug, sqlx::FromRow)]
struct JobRow {
    tenant_id: String,
    knowledge_space_id: Uuid,
    subject_id: String,
    permission_snapshot_id: Uuid,
    permission_snapshot_revision: i32,
    access_channel: String,
    query: String,
    mode: Option<String>,
    top_k: Option<i32>,
    budget_usd: Option<f64>,
    limits: serde_json::Value,
    cost: serde_json::Value,
    stage: String,
}

pub struct ResearchHandler {
    generator: Arc<dyn Generator>,
}

impl ResearchHandler {
    /// Reads the generator settings from the environment (`KFS_GENERATOR`, `KFS_OPENAI_*`).
    pub fn new(_deps: Deps) -> Result<Self, crate::config::ConfigError> {
        let cfg = generator::generator_config(|k| std::env::var(k).ok())?;
        Ok(Self {
            generator: generator::build(&cfg)?,
        })
    }

    /// A handler with this generator.
    pub fn with_generator(generator: Arc<dyn Generator>) -> Self {
        Self { generator }
    }

    pub fn generator(&self) -> &Arc<dyn Generator> {
        &self.generator
    }
}

fn fatal_db(what: &str) -> impl FnOnce(serde_json::Error) -> JobError + '_ {
    move |e| JobError::fatal("bad_data", format!("{what}: {e}"))
}

impl JobRow {
    fn scope(&self, job_id: Uuid) -> JobScope {
        JobScope {
            job_id,
            tenant_id: self.tenant_id.clone(),
            space_id: self.knowledge_space_id,
        }
    }

    fn top_k(&self) -> usize {
        let from_limits = self.limits.get("topK").and_then(serde_json::Value::as_u64);
        let k = from_limits
            .or(self.top_k.and_then(|k| u64::try_from(k).ok()))
            .unwrap_or(u64::try_from(request::DEFAULT_TOP_K).unwrap_or(8));
        usize::try_from(k.clamp(1, 100)).unwrap_or(8)
    }

    fn max_sub_queries(&self) -> usize {
        self.limits
            .get("maxSubQueries")
            .and_then(serde_json::Value::as_u64)
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or_else(|| plan::max_sub_queries(self.mode.as_deref().unwrap_or("auto")))
            .clamp(1, 16)
    }
}

async fn load(tx: &mut PgConnection, job_id: Uuid) -> Result<JobRow, JobError> {
    sqlx::query_as(
        "SELECT tenant_id, knowledge_space_id, subject_id, permission_snapshot_id, permission_snapshot_revision, \
           access_channel, query, mode, top_k, budget_usd, limits, cost, stage \
         FROM research_task_jobs WHERE id = $1",
    )
    .bind(job_id)
    .fetch_optional(tx)
    .await?
    .ok_or_else(|| JobError::fatal("job_missing", "the research task row is gone"))
}

/// Fails closed unless the space is live and the snapshot still grants access.
async fn check_access(tx: &mut PgConnection, job: &JobRow) -> Result<(), JobError> {
    if let Some(why) = access::space_denial(tx, &job.tenant_id, job.knowledge_space_id).await? {
        return Err(JobError::fatal("space_unavailable", why));
    }
    let snapshot = access::read_snapshot(tx, &job.tenant_id, job.permission_snapshot_id).await?;
    let want = access::Expected {
        tenant_id: &job.tenant_id,
        space_id: job.knowledge_space_id,
        subject_id: &job.subject_id,
        access_channel: &job.access_channel,
        revision: Some(job.permission_snapshot_revision),
    };
    match access::snapshot_denial(snapshot.as_ref(), &want) {
        Some(why) => Err(JobError::fatal("permission_revoked", why)),
        None => Ok(()),
    }
}

async fn merge_metadata(
    tx: &mut PgConnection,
    scope: &JobScope,
    patch: serde_json::Value,
) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "UPDATE research_task_jobs SET metadata = metadata || $3, updated_at = {NOW_MS} \
         WHERE tenant_id = $1 AND id = $2"
    ))
    .bind(&scope.tenant_id)
    .bind(scope.job_id)
    .bind(patch)
    .execute(tx)
    .await?;
    Ok(())
}

async fn read_partials(tx: &mut PgConnection, scope: &JobScope) -> Result<Vec<Partial>, JobError> {
    let rows: Vec<serde_json::Value> = sqlx::query_scalar(
        "SELECT evidence_bundle FROM research_task_partial_results \
         WHERE tenant_id = $1 AND research_task_job_id = $2 ORDER BY sequence",
    )
    .bind(&scope.tenant_id)
    .bind(scope.job_id)
    .fetch_all(tx)
    .await?;
    rows.into_iter()
        .map(|v| serde_json::from_value(v).map_err(fatal_db("a stored partial result")))
        .collect()
}

async fn stage_changed(
    tx: &mut PgConnection,
    scope: &JobScope,
    row_version: i32,
    from: Stage,
    to: Stage,
    extra: serde_json::Value,
) -> Result<(), sqlx::Error> {
    let mut payload = json!({ "from": from.as_str(), "to": to.as_str() });
    if let (Some(p), serde_json::Value::Object(e)) = (payload.as_object_mut(), extra) {
        p.extend(e);
    }
    progress::append_event(tx, scope, row_version, EventType::StageChanged, to, payload).await?;
    Ok(())
}

impl ResearchHandler {
    async fn plan(
        &self,
        tx: &mut PgConnection,
        job: &JobRow,
        scope: &JobScope,
    ) -> Result<serde_json::Value, JobError> {
        let plan = plan::plan(&job.query, job.max_sub_queries());
        let n = plan.sub_queries.len();
        merge_metadata(tx, scope, json!({ "plan": plan })).await?;
        Ok(json!({ "subQueries": n }))
    }

    async fn retrieve(
        &self,
        tx: &mut PgConnection,
        job: &JobRow,
        scope: &JobScope,
    ) -> Result<serde_json::Value, JobError> {
        let stored: Option<serde_json::Value> = sqlx::query_scalar(
            "SELECT metadata -> 'plan' FROM research_task_jobs WHERE tenant_id = $1 AND id = $2",
        )
        .bind(&scope.tenant_id)
        .bind(scope.job_id)
        .fetch_one(&mut *tx)
        .await?;
        let plan: Plan = match stored {
            Some(v) if !v.is_null() => {
                serde_json::from_value(v).map_err(fatal_db("the stored plan"))?
            }
            // Resumed from an older writer without a plan: plan again (a pure function).
            _ => plan::plan(&job.query, job.max_sub_queries()),
        };
        let top_k = job.top_k();
        let mut hits = 0usize;
        for (i, sq) in plan.sub_queries.iter().enumerate() {
            let found = retrieve::search(tx, &scope.tenant_id, scope.space_id, sq, top_k).await?;
            hits += found.len();
            let bundle = Partial::Retrieval(Bundle {
                sub_query_index: i,
                sub_query: sq.clone(),
                hits: found,
            });
            let value = serde_json::to_value(&bundle).map_err(fatal_db("an evidence bundle"))?;
            progress::append_partial(
                tx,
                scope,
                &progress::partial_key(scope.job_id, &format!("retrieval:{i}")),
                value,
            )
            .await?;
        }
        Ok(json!({ "subQueries": plan.sub_queries.len(), "hits": hits }))
    }

    async fn analyze(
        &self,
        tx: &mut PgConnection,
        job: &JobRow,
        scope: &JobScope,
    ) -> Result<serde_json::Value, JobError> {
        let bundles: Vec<Bundle> = read_partials(tx, scope)
            .await?
            .into_iter()
            .filter_map(|p| match p {
                Partial::Retrieval(b) => Some(b),
                _ => None,
            })
            .collect();
        let evidence = plan::rank(&bundles, job.top_k());
        let n = evidence.len();
        let documents: std::collections::BTreeSet<Uuid> =
            evidence.iter().map(|e| e.document_id).collect();
        let value = serde_json::to_value(Partial::Ranked { evidence })
            .map_err(fatal_db("ranked evidence"))?;
        progress::append_partial(
            tx,
            scope,
            &progress::partial_key(scope.job_id, "ranked"),
            value,
        )
        .await?;
        merge_metadata(
            tx,
            scope,
            json!({ "evidenceCount": n, "evidenceDocuments": documents.len() }),
        )
        .await?;
        Ok(json!({ "evidence": n, "documents": documents.len() }))
    }

    /// Generates the answer. `Err(Step::Cancel)`-like outcomes come back as `Ok(Some(step))`.
    async fn generate(
        &self,
        tx: &mut PgConnection,
        job: &JobRow,
        scope: &JobScope,
        row_version: i32,
    ) -> Result<Result<serde_json::Value, Step>, JobError> {
        let evidence = read_partials(tx, scope)
            .await?
            .into_iter()
            .rev()
            .find_map(|p| match p {
                Partial::Ranked { evidence } => Some(evidence),
                _ => None,
            })
            .ok_or_else(|| {
                JobError::fatal(
                    "evidence_missing",
                    "no ranked evidence was stored before generating",
                )
            })?;
        let spent: Cost = serde_json::from_value(job.cost.clone()).unwrap_or_default();
        let req = GenerationRequest {
            question: &job.query,
            evidence: &evidence,
        };
        let estimate = self.generator.estimate_usd(&req);
        if !within_budget(spent.usd + estimate, job.budget_usd) {
            let message = format!(
                "the answer would cost at least ${:.6} (spent ${:.6}), over the budget of ${:.6}",
                estimate,
                spent.usd,
                job.budget_usd.unwrap_or_default()
            );
            return Ok(Err(self
                .cancel_for_budget(tx, scope, row_version, &spent, message)
                .await?));
        }
        let generation = self.generator.generate(&req).await?;
        let cost = spent.add(&generation);
        sqlx::query(&format!(
            "UPDATE research_task_jobs SET cost = $3, updated_at = {NOW_MS} WHERE tenant_id = $1 AND id = $2"
        ))
        .bind(&scope.tenant_id)
        .bind(scope.job_id)
        .bind(serde_json::to_value(&cost).map_err(fatal_db("cost"))?)
        .execute(&mut *tx)
        .await?;
        if !within_budget(cost.usd, job.budget_usd) {
            let message = format!(
                "generation cost ${:.6} ({} prompt + {} completion tokens), over the budget of ${:.6}",
                cost.usd,
                cost.prompt_tokens,
                cost.completion_tokens,
                job.budget_usd.unwrap_or_default()
            );
            return Ok(Err(self
                .cancel_for_budget(tx, scope, row_version, &cost, message)
                .await?));
        }
        let citations = generation.citations.len();
        merge_metadata(
            tx,
            scope,
            json!({ "result": {
                "answer": generation.answer,
                "citations": generation.citations,
                "generator": generation.generator,
                "model": generation.model,
            }}),
        )
        .await?;
        let value =
            serde_json::to_value(Partial::Answer(generation)).map_err(fatal_db("the answer"))?;
        progress::append_partial(
            tx,
            scope,
            &progress::partial_key(scope.job_id, "answer"),
            value,
        )
        .await?;
        Ok(Ok(json!({ "citations": citations, "costUsd": cost.usd })))
    }

    async fn cancel_for_budget(
        &self,
        tx: &mut PgConnection,
        scope: &JobScope,
        row_version: i32,
        cost: &Cost,
        message: String,
    ) -> Result<Step, JobError> {
        progress::append_event(
            tx,
            scope,
            row_version,
            EventType::Canceled,
            Stage::Canceled,
            json!({ "from": Stage::Generating.as_str(), "code": "budget_exceeded", "reason": message, "cost": cost }),
        )
        .await?;
        Ok(Step::Cancel {
            code: "budget_exceeded".into(),
            message,
        })
    }
}

#[async_trait::async_trait]
impl Handler for ResearchHandler {
    fn kind(&self) -> Kind {
        Kind::Research
    }

    /// A task the engine fails gets its `research_task.failed` event in the same transaction,
    /// keyed by the row version the failure wrote, so a follower sees how it ended.
    async fn on_fail(
        &self,
        tx: &mut PgConnection,
        ctx: &JobCtx,
        code: &str,
    ) -> Result<(), sqlx::Error> {
        let Some(scope) = progress::scope_of(tx, ctx.job_id).await? else {
            return Ok(());
        };
        let (row_version, error): (i32, Option<String>) = sqlx::query_as(
            "SELECT row_version, error FROM research_task_jobs WHERE id = $1 AND tenant_id = $2",
        )
        .bind(ctx.job_id)
        .bind(&scope.tenant_id)
        .fetch_one(&mut *tx)
        .await?;
        progress::append_event(
            tx,
            &scope,
            row_version,
            EventType::Failed,
            walk::Stage::Failed,
            json!({ "code": code, "error": error }),
        )
        .await?;
        Ok(())
    }

    async fn step(&self, tx: &mut PgConnection, ctx: &JobCtx) -> Result<Step, JobError> {
        let job = load(tx, ctx.job_id).await?;
        let stage = Stage::parse(&job.stage).ok_or_else(|| {
            JobError::fatal("bad_stage", format!("unknown stage '{}'", job.stage))
        })?;
        let next = walk::next_stage(stage).ok_or_else(|| {
            JobError::fatal(
                "bad_stage",
                format!("a worker has nothing to do at stage '{stage}'"),
            )
        })?;
        check_access(tx, &job).await?;
        let scope = job.scope(ctx.job_id);
        let summary = match stage {
            Stage::Queued => json!({}),
            Stage::Planning => self.plan(tx, &job, &scope).await?,
            Stage::Retrieving => self.retrieve(tx, &job, &scope).await?,
            Stage::Analyzing => self.analyze(tx, &job, &scope).await?,
            Stage::Generating => match self.generate(tx, &job, &scope, ctx.row_version).await? {
                Ok(summary) => summary,
                Err(cancel) => return Ok(cancel),
            },
            _ => unreachable!("next_stage is None for every other stage"),
        };
        stage_changed(tx, &scope, ctx.row_version, stage, next, summary).await?;
        Ok(if next == Stage::Completed {
            Step::Succeed(next.as_str().into())
        } else {
            Step::Advance(next.as_str().into())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_table() {
        let table = [
            (0.0, None, true),
            (5.0, None, true),
            (0.5, Some(1.0), true),
            (1.0, Some(1.0), true),
            (1.000_001, Some(1.0), false),
            (0.0, Some(0.0), true),
            (0.1, Some(0.0), false),
        ];
        for (usd, budget, ok) in table {
            assert_eq!(within_budget(usd, budget), ok, "{usd} of {budget:?}");
        }
    }

    #[test]
    fn partials_are_tagged() {
        let v = serde_json::to_value(Partial::Ranked { evidence: vec![] }).unwrap();
        assert_eq!(v, json!({ "kind": "ranked", "evidence": [] }));
        let back: Partial = serde_json::from_value(v).unwrap();
        assert_eq!(back, Partial::Ranked { evidence: vec![] });
    }
}
