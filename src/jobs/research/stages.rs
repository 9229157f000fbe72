//! The work of each stage, inside the step's fenced transaction. Invariant: a stage reads what
//! the stages before it committed (`metadata.plan`, `metadata.retrieval`, `metadata.evidence`)
//! and writes its own result there, its progress event (the platform's `stage_changed` with the
//! runtime's details, keyed by the row version this step's transition writes) and, at the end,
//! the final evidence bundle with the trimmed answer in its `answer` (and `metadata.result`: what
//! the answer cites and which generator made it); the answer's deltas go out as it is made
//! ([`super::stream`]); a step replayed at the same row version writes the same rows, and a model
//! call is made only after its price was reserved within the budget, and once per execution
//! attempt. Under a capability grant, the grant is checked once more after the answer is made,
//! before the task completes.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::PgConnection;
use uuid::Uuid;

use super::access::{self, Authorized, Reads};
use super::budget::{self, Actual, Cost};
use super::evidence;
use super::generator::{AnswerSink, Generation, GenerationRequest, NO_EVIDENCE_ANSWER};
use super::plan::{self, Bundle, Evidence, Plan};
use super::progress::{self, payload, EventType, JobScope, NewEvent, NewPartial, NOW_MS};
use super::retrieve::{self, ReadModel};
use super::snapshot::{self, RuntimeSnapshot};
use super::stream::{self, Stream};
use super::walk::{self, Stage};
use super::{JobRow, ResearchHandler};
use crate::embed::{self, EmbedError, Input};
use crate::jobs::{JobCtx, JobError, Step};

/// What the steps that share one transaction read once and write together. Reads: the space's
/// deletions and the snapshot's revalidation (see [`Reads`]), and the transaction's clock. Writes:
/// each step's metadata and cost, its events and its partial result, collected in step order and
/// written by [`Group::flush`] in one statement per table, before the engine's transition.
#[derive(Default)]
pub(super) struct Group {
    pub reads: Reads,
    now_ms: Option<i64>,
    jobs: Vec<JobWrite>,
    events: Vec<NewEvent>,
    partials: Vec<NewPartial>,
}

/// A job row's writes: its metadata patch (merged key by key, as `||` does) and its new cost.
struct JobWrite {
    tenant_id: String,
    job_id: Uuid,
    patch: serde_json::Map<String, Value>,
    cost: Option<Value>,
}

impl Group {
    fn job(&mut self, scope: &JobScope) -> &mut JobWrite {
        let at = match self.jobs.iter().position(|w| w.job_id == scope.job_id) {
            Some(i) => i,
            None => {
                self.jobs.push(JobWrite {
                    tenant_id: scope.tenant_id.clone(),
                    job_id: scope.job_id,
                    patch: serde_json::Map::new(),
                    cost: None,
                });
                self.jobs.len() - 1
            }
        };
        &mut self.jobs[at]
    }

    pub(super) fn event(&mut self, event: NewEvent) {
        self.events.push(event);
    }

    /// The transaction's clock (`now()`: the same for every statement of it), read once.
    async fn now_ms(&mut self, tx: &mut PgConnection) -> Result<i64, sqlx::Error> {
        if let Some(ms) = self.now_ms {
            return Ok(ms);
        }
        let ms: i64 = sqlx::query_scalar(&format!("SELECT {NOW_MS}"))
            .fetch_one(&mut *tx)
            .await?;
        self.now_ms = Some(ms);
        Ok(ms)
    }

    /// Writes what the steps collected: the job rows, then the events, then the partials.
    pub(super) async fn flush(self, tx: &mut PgConnection) -> Result<(), sqlx::Error> {
        if !self.jobs.is_empty() {
            let n = self.jobs.len();
            let (mut tenants, mut ids, mut patches, mut costs) = (
                Vec::with_capacity(n),
                Vec::with_capacity(n),
                Vec::with_capacity(n),
                Vec::with_capacity(n),
            );
            for w in self.jobs {
                tenants.push(w.tenant_id);
                ids.push(w.job_id);
                patches.push(Value::Object(w.patch));
                costs.push(w.cost);
            }
            sqlx::query(&format!(
                "UPDATE research_task_jobs j \
                 SET metadata = j.metadata || u.patch, cost = coalesce(u.cost, j.cost), updated_at = {NOW_MS} \
                 FROM unnest($1::text[], $2::uuid[], $3::jsonb[], $4::jsonb[]) AS u(tenant_id, id, patch, cost) \
                 WHERE j.tenant_id = u.tenant_id AND j.id = u.id"
            ))
            .bind(tenants)
            .bind(ids)
            .bind(patches)
            .bind(costs)
            .execute(&mut *tx)
            .await?;
        }
        progress::append_events(tx, &self.events).await?;
        progress::append_partials(tx, &self.partials).await
    }
}

/// One step of one task.
pub(super) struct Run<'a> {
    pub handler: &'a ResearchHandler,
    pub job: &'a JobRow,
    pub scope: JobScope,
    pub ctx: &'a JobCtx,
    /// The row version this step's transition writes (its events' key).
    pub next_rv: i32,
    /// This step is its attempt's first: the claim event is still to be written.
    pub claim: bool,
    pub authorized: Authorized,
    pub frozen: Option<RuntimeSnapshot>,
    pub mode: String,
    pub top_k: usize,
}

/// What the retrieving stage found (`metadata.retrieval`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Retrieved {
    /// The publication read; `None` when the space had published nothing.
    publication_id: Option<Uuid>,
    /// How many retrieval legs ran (full-text, and dense when the profile asks for it).
    legs: usize,
    /// Distinct nodes the legs found over all sub-queries.
    retrieval_count: usize,
    bundles: Vec<Bundle>,
}

fn bad(what: &str) -> impl FnOnce(serde_json::Error) -> JobError + '_ {
    move |e| JobError::fatal("bad_data", format!("{what}: {e}"))
}

fn embed_error(e: EmbedError) -> JobError {
    match e {
        EmbedError::Unavailable(m) => JobError::retryable("embedder_unavailable", m),
        EmbedError::Rejected(m) => JobError::fatal("embedder_rejected", m),
    }
}

/// Epoch milliseconds as the platform's ISO timestamps.
fn iso(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// What `metadata.result` keeps of an answer: what it cites and what made it (the answer itself
/// is in the final partial result).
fn result_of(g: &Generation) -> Value {
    json!({ "citations": g.citations, "generator": g.generator, "model": g.model })
}

/// An answer made (or found made) by the generating step.
struct Made {
    /// The answer as generated (`None`: a replay found none stored).
    answer: Option<String>,
    /// `metadata.result`, when this step made the answer.
    result: Option<Value>,
    /// Deltas to write with the step's writes.
    deltas: Vec<NewEvent>,
}

impl Run<'_> {
    pub(super) async fn stage(
        &self,
        tx: &mut PgConnection,
        g: &mut Group,
        stage: Stage,
    ) -> Result<Step, JobError> {
        match stage {
            Stage::Queued => self.advance(g, Stage::Queued, None),
            Stage::Planning => self.plan(g),
            Stage::Retrieving => self.retrieve(tx, g).await,
            Stage::Analyzing => self.analyze(g),
            Stage::Generating => self.generate(tx, g).await,
            other => Err(JobError::fatal(
                "bad_stage",
                format!("a worker has nothing to do at stage '{other}'"),
            )),
        }
    }

    /// Appends the stage change and returns the move.
    fn advance(
        &self,
        g: &mut Group,
        from: Stage,
        details: Option<Value>,
    ) -> Result<Step, JobError> {
        let to = walk::next_stage(from)
            .ok_or_else(|| JobError::fatal("bad_stage", format!("no stage follows {from}")))?;
        g.event(NewEvent::at(
            &self.scope,
            self.next_rv,
            EventType::StageChanged,
            to,
            payload::advanced(from, details),
        ));
        Ok(if to == Stage::Completed {
            Step::Succeed(to.as_str().into())
        } else {
            Step::Advance(to.as_str().into())
        })
    }

    /// `metadata = metadata || {key: value}`, written at the flush.
    fn merge(&self, g: &mut Group, key: &str, value: Value) {
        g.job(&self.scope).patch.insert(key.to_owned(), value);
    }

    fn meta<T: serde::de::DeserializeOwned>(&self, key: &str) -> Result<Option<T>, JobError> {
        match self.job.metadata.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => serde_json::from_value(v.clone())
                .map(Some)
                .map_err(bad(key)),
        }
    }

    fn planned(&self) -> Result<Plan, JobError> {
        Ok(self
            .meta("plan")?
            .unwrap_or_else(|| plan::plan(&self.job.query, plan::max_sub_queries(&self.mode))))
    }

    fn plan(&self, g: &mut Group) -> Result<Step, JobError> {
        let plan = plan::plan(&self.job.query, plan::max_sub_queries(&self.mode));
        let questions: Vec<&str> = plan.sub_queries.iter().map(|q| q.text.as_str()).collect();
        let details = json!({ "questions": questions, "topK": self.top_k });
        let value = serde_json::to_value(&plan).map_err(bad("the plan"))?;
        self.merge(g, "plan", value);
        self.advance(g, Stage::Planning, Some(details))
    }

    /// The publication and vector space this task reads: the frozen ones, or (for a task
    /// admitted before its space had a head) the current head and active profile.
    async fn read_model(&self, tx: &mut PgConnection) -> Result<Option<ReadModel>, JobError> {
        let (tenant, space) = (&self.scope.tenant_id, self.scope.space_id);
        let (publication, embedding) = match &self.frozen {
            Some(s) => {
                let embedding = match &s.embedding_profile {
                    Some(p) => Some(snapshot::profile_of(tx, tenant, space, p).await?),
                    None => None,
                };
                (Some(s.projection_snapshot.publication_id), embedding)
            }
            None => {
                let head = crate::publication::head(tx, tenant, space, false).await?;
                let embedding = crate::jobs::compile::steps::embedding_profile(tx, tenant, space)
                    .await?
                    .map(|(p, _)| p);
                (head.map(|h| h.publication_id), embedding)
            }
        };
        Ok(publication.map(|publication_id| ReadModel {
            tenant_id: tenant.clone(),
            space_id: space,
            publication_id,
            scopes: access::reader_scopes(&self.authorized.scopes),
            embedding,
        }))
    }

    async fn embed_query(
        &self,
        profile: &embed::Profile,
        text: &str,
    ) -> Result<Vec<f32>, JobError> {
        let out = self
            .handler
            .embedder
            .embed(profile, &[text.to_owned()], Input::Query)
            .await
            .map_err(embed_error)?;
        embed::check(profile, 1, &out).map_err(embed_error)?;
        Ok(out.vectors.into_iter().next().unwrap_or_default())
    }

    async fn retrieve(&self, tx: &mut PgConnection, g: &mut Group) -> Result<Step, JobError> {
        let plan = self.planned()?;
        let read = self.read_model(tx).await?;
        let fan = retrieve::fan_out(&self.mode, self.top_k);
        let legs = 1 + usize::from(read.as_ref().is_some_and(|r| r.embedding.is_some()));
        let mut found = BTreeSet::new();
        let mut bundles = Vec::with_capacity(plan.sub_queries.len());
        for (i, sq) in plan.sub_queries.iter().enumerate() {
            let hits = match &read {
                // No publication, or reader scopes that let nothing be read.
                None => Vec::new(),
                Some(r) if r.scopes.is_none() => Vec::new(),
                Some(r) => {
                    let fts = retrieve::fts(tx, r, &sq.search_text(), fan.leg).await?;
                    let dense = match &r.embedding {
                        Some(p) => {
                            let v = self.embed_query(p, &sq.text).await?;
                            retrieve::dense(tx, r, p, &v, fan.leg).await?
                        }
                        None => Vec::new(),
                    };
                    found.extend(fts.iter().chain(&dense).map(|h| h.node_id));
                    retrieve::fuse(&[("dense", &dense), ("fts", &fts)], fan.top_k)
                }
            };
            bundles.push(Bundle {
                sub_query_index: i,
                sub_query: sq.clone(),
                hits,
            });
        }
        let results: Vec<Value> = bundles
            .iter()
            .map(|b| json!({ "chunkCount": b.hits.len(), "question": b.sub_query.text }))
            .collect();
        let retrieved = Retrieved {
            publication_id: read.map(|r| r.publication_id),
            legs,
            retrieval_count: found.len(),
            bundles,
        };
        let details = json!({ "results": results, "retrievalCount": retrieved.retrieval_count });
        let value = serde_json::to_value(&retrieved).map_err(bad("the retrieval"))?;
        self.merge(g, "retrieval", value);
        self.advance(g, Stage::Retrieving, Some(details))
    }

    fn retrieved(&self) -> Result<Retrieved, JobError> {
        self.meta("retrieval")?.ok_or_else(|| {
            JobError::fatal(
                "retrieval_missing",
                "nothing was retrieved before this stage",
            )
        })
    }

    fn analyze(&self, g: &mut Group) -> Result<Step, JobError> {
        let r = self.retrieved()?;
        let evidence = plan::rank(&r.bundles, self.top_k);
        let details = json!({
            "chunks": evidence.len().min(evidence::MAX_ITEMS),
            "retrievalCount": r.retrieval_count,
        });
        let value = serde_json::to_value(&evidence).map_err(bad("the evidence"))?;
        self.merge(g, "evidence", value);
        self.advance(g, Stage::Analyzing, Some(details))
    }

    fn cancel_for_budget(&self, g: &mut Group, message: String) -> Step {
        g.event(NewEvent::at(
            &self.scope,
            self.next_rv,
            EventType::Canceled,
            Stage::Canceled,
            payload::because(Some(budget::BUDGET_EXHAUSTED)),
        ));
        Step::Cancel {
            code: budget::BUDGET_EXHAUSTED.into(),
            message,
        }
    }

    /// `cost = <cost>`, written at the flush.
    fn write_cost(&self, g: &mut Group, cost: &Cost) {
        g.job(&self.scope).cost = Some(cost.to_json());
    }

    /// Where this step's answer goes as it is made: streamed on connections of its own when a
    /// service makes it and an engine gave a pool; else with the step's writes.
    fn stream(&self, in_process: bool) -> Stream {
        let target = match self.handler.stream_pool() {
            Some(pool) if !in_process => stream::Target::Own {
                pool,
                fence: progress::LeaseFence {
                    scope: self.scope.clone(),
                    lease_token: self.ctx.lease_token,
                    row_version: self.ctx.row_version,
                    grant: self.authorized.grant,
                },
                claim: self.claim.then(|| {
                    progress::claimed_event(
                        &self.scope,
                        self.ctx.row_version,
                        self.ctx.execution_attempts,
                        Stage::Generating,
                    )
                }),
            },
            _ => stream::Target::Step(Vec::new()),
        };
        Stream::new(self.scope.clone(), self.ctx.execution_attempts, target)
    }

    /// The answer: no call without evidence; else the call reserved, made (its deltas going out
    /// as it is made), and settled. `Err(step)`: the budget canceled the task.
    async fn answer(
        &self,
        tx: &mut PgConnection,
        w: &mut Group,
        evidence: &[Evidence],
        now_ms: i64,
    ) -> Result<Result<Made, Step>, JobError> {
        let gen = self.handler.generator.as_ref();
        if evidence.is_empty() {
            let mut out = self.stream(gen.in_process());
            out.text(NO_EVIDENCE_ANSWER).await?;
            let deltas = out.finish().await?;
            let made = Generation {
                answer: NO_EVIDENCE_ANSWER.into(),
                citations: Vec::new(),
                generator: gen.name().into(),
                model: None,
                usage: None,
                cost_usd: 0.0,
            };
            return Ok(Ok(Made {
                result: Some(result_of(&made)),
                answer: Some(made.answer),
                deltas,
            }));
        }
        let mut cost = Cost::parse(&self.job.cost, self.job.budget_usd);
        let call =
            budget::answer_call_id(self.scope.job_id, self.ctx.execution_attempts, gen.name());
        if let (Some(e), Some(_)) = (cost.entry(&call), self.job.metadata.get("result")) {
            if e.usage.status != "reserved" {
                // A replay of this attempt's answer: it was made, paid for and stored.
                let answer = progress::final_answer(tx, &self.scope).await?.flatten();
                return Ok(Ok(Made {
                    answer,
                    result: None,
                    deltas: Vec::new(),
                }));
            }
        }
        let req = GenerationRequest {
            question: &self.job.query,
            evidence,
        };
        if let Err(x) = cost.reserve(
            &call,
            gen.estimate(&req),
            gen.name(),
            "query.answer",
            now_ms,
        ) {
            let message = format!(
                "the answer would cost up to ${:.6} (spent ${:.6}), over the budget of ${:.6}",
                x.needed_usd, x.spent_usd, x.budget_usd
            );
            return Ok(Err(self.cancel_for_budget(w, message)));
        }
        let mut out = self.stream(gen.in_process());
        let g = gen.generate(&req, &mut out).await?;
        let deltas = out.finish().await?;
        let u = g.usage.unwrap_or_default();
        let actual = Actual {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            estimated: u.estimated,
            usd: g.cost_usd,
        };
        let over = cost.settle(&call, actual, true);
        self.write_cost(w, &cost);
        if over {
            let message = format!(
                "generation cost ${:.6} ({} prompt + {} completion tokens), over the budget of ${:.6}",
                cost.total_usd,
                u.prompt_tokens,
                u.completion_tokens,
                cost.budget_usd.unwrap_or_default()
            );
            return Ok(Err(self.cancel_for_budget(w, message)));
        }
        Ok(Ok(Made {
            result: Some(result_of(&g)),
            answer: Some(g.answer),
            deltas,
        }))
    }

    async fn generate(&self, tx: &mut PgConnection, g: &mut Group) -> Result<Step, JobError> {
        let evidence: Vec<Evidence> = self.meta("evidence")?.ok_or_else(|| {
            JobError::fatal(
                "evidence_missing",
                "no evidence was stored before generating",
            )
        })?;
        let legs = self.retrieved().map_or(1, |r| r.legs);
        let now_ms = g.now_ms(tx).await?;
        let made = match self.answer(tx, g, &evidence, now_ms).await? {
            Ok(made) => made,
            Err(canceled) => return Ok(canceled),
        };
        if let Some(grant) = self.authorized.grant {
            // As the platform checks the grant when it completes a task: the answer took time,
            // and a fence put on the space meanwhile is seen only by a new read.
            access::recheck_grant(tx, &self.scope.tenant_id, self.scope.space_id, grant)
                .await?
                .map_err(|d| JobError::fatal(d.code, d.why))?;
        }
        for delta in made.deltas {
            g.event(delta);
        }
        if let Some(result) = made.result {
            self.merge(g, "result", result);
        }
        let bundle = evidence::assemble(
            Uuid::new_v4(),
            self.scope.job_id,
            &self.job.query,
            &iso(now_ms),
            &evidence,
            legs,
        );
        let documents: BTreeSet<Uuid> = bundle
            .items
            .iter()
            .flat_map(|i| i.citations.iter().map(|c| c.document_asset_id))
            .collect();
        let details = json!({
            "chunks": bundle.items.len(), "documents": documents.len(), "sources": documents.len(),
        });
        let value = serde_json::to_value(&bundle).map_err(bad("the evidence bundle"))?;
        g.partials.push(NewPartial {
            scope: self.scope.clone(),
            key: progress::final_evidence_key(self.scope.job_id),
            bundle: value,
            answer: made
                .answer
                .map(|a| a.trim().to_owned())
                .filter(|a| !a.is_empty()),
        });
        self.advance(g, Stage::Generating, Some(details))
    }
}
