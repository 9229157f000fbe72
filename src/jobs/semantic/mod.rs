//! `document.semantic`: the platform's semantic enrichment jobs (`document_semantic_enrichment_jobs`,
//! migration 0039), leased straight from Postgres. One job per published generation makes its
//! graph: the entities and relations its knowledge nodes carry (nodes chunked by a model), or
//! else those the reasoning model finds in each node ([`extract`], checkpointed per stage), through
//! the platform's quality control into `graph_entities` and `graph_relations`, with their semantic
//! projections. Invariant: a job runs only for the generation its compile attempt published —
//! a generation not yet served waits (`retry_wait`, attempt given back), one that was replaced
//! or given up ends `superseded` (`SEMANTIC_GENERATION_SUPERSEDED`) and writes nothing; model
//! calls happen only in [`SemanticKind::prepare`], outside the step's transaction, each answer
//! checkpointed at once and never asked again; the step reads checkpoints, writes the graph
//! rows once (deterministic ids, `ON CONFLICT DO NOTHING`) and the job's `result` in the fenced
//! transaction that ends it. A running job whose holder died with its attempts used up fails
//! instead of staying `running` (the platform's runtime never reclaims it).

pub mod extract;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::engine::lease::{millis, End};
use crate::engine::leased::{
    ClaimRule, EndWrite, Exhausted, Lease, LeasedKind, Param, HOLDER_GONE,
};
use crate::jobs::compile::semantic::graph::{self, GraphNode};
use crate::jobs::{JobError, Policy, RetryPolicy, Step};
use crate::model::Models;

pub const TABLE: &str = "document_semantic_enrichment_jobs";
pub const SUPERSEDED: &str = "SEMANTIC_GENERATION_SUPERSEDED";
pub const SUPERSEDED_MESSAGE: &str = "A newer document generation is published";
pub const FAILED: &str = "SEMANTIC_ENRICHMENT_FAILED";
pub const EXHAUSTED: &str = "EXECUTION_ATTEMPTS_EXHAUSTED";
/// The most nodes one job reads (the platform's `maxNodesPerArtifact`).
pub const MAX_NODES: i64 = 100;
/// How long a job whose generation is not served yet waits before it looks again.
pub const WAIT: Duration = Duration::from_secs(5);

/// The platform's defaults: lease 60 s, five attempts, retries after 5 s doubling to an hour.
pub const POLICY: Policy = Policy {
    lease: Duration::from_secs(60),
    max_attempts: 5,
    retry: RetryPolicy {
        base: Duration::from_secs(5),
        max: Duration::from_secs(3600),
    },
};

/// The leased kind, with the reasoning model and embedder it runs with.
#[derive(Debug)]
pub struct SemanticKind {
    models: Models,
    embedder: Arc<dyn crate::embed::Embedder>,
}

impl Default for SemanticKind {
    /// No model and no embedder: what status, metrics and the dashboard need of the kind.
    fn default() -> Self {
        Self::new(Models::none(), Arc::new(crate::embed::Unconfigured))
    }
}

impl SemanticKind {
    pub fn new(models: Models, embedder: Arc<dyn crate::embed::Embedder>) -> Self {
        Self { models, embedder }
    }
}

/// Where a job's generation stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Guard {
    /// The head serves the generation's outline: the job runs.
    Current,
    /// Not served yet and its attempt may still publish it: wait.
    Pending,
    /// Replaced, given up or never to be served: end without writing.
    Superseded,
}

/// What the guard decides from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Facts {
    /// The attempt's generation and run state, `None` when it is gone.
    pub attempt: Option<(Uuid, String)>,
    pub generation: Uuid,
    /// The head's revision, and whether its publication holds the generation's outline.
    pub head: Option<(i64, bool)>,
    pub base_head_revision: i64,
}

/// The platform's generation guard. Pure.
pub fn guard(f: &Facts) -> Guard {
    let Some((generation, state)) = &f.attempt else {
        return Guard::Superseded;
    };
    if *generation != f.generation || matches!(state.as_str(), "failed" | "canceled" | "superseded")
    {
        return Guard::Superseded;
    }
    if f.head
        .is_some_and(|(rev, served)| rev > f.base_head_revision && served)
    {
        return Guard::Current;
    }
    if state == "succeeded" {
        Guard::Superseded
    } else {
        Guard::Pending
    }
}

#[derive(sqlx::FromRow)]
struct JobRow {
    compilation_attempt_id: Uuid,
    tenant_id: String,
    knowledge_space_id: Uuid,
    document_asset_id: Uuid,
    document_version: i32,
    parse_artifact_id: Uuid,
    publication_generation_id: Uuid,
    base_head_revision: i64,
    retrieval_profile: Value,
}

async fn load(conn: &mut PgConnection, id: Uuid) -> Result<JobRow, JobError> {
    sqlx::query_as(
        "SELECT compilation_attempt_id, tenant_id::text AS tenant_id, knowledge_space_id, document_asset_id, \
           document_version, parse_artifact_id, publication_generation_id, base_head_revision, retrieval_profile \
         FROM document_semantic_enrichment_jobs WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(conn)
    .await?
    .ok_or_else(|| JobError::fatal(FAILED, format!("no semantic enrichment job {id}")))
}

async fn facts(conn: &mut PgConnection, j: &JobRow) -> Result<Facts, sqlx::Error> {
    let attempt: Option<(Uuid, String)> = sqlx::query_as(
        "SELECT publication_generation_id, run_state::text FROM document_compilation_attempts WHERE id = $1",
    )
    .bind(j.compilation_attempt_id)
    .fetch_optional(&mut *conn)
    .await?;
    let head: Option<(i64, bool)> = sqlx::query_as(
        "SELECT h.head_revision::bigint, EXISTS (SELECT 1 FROM projection_set_publication_members m \
             WHERE m.publication_id = h.publication_id AND m.component_type = 'document-outline' \
               AND m.document_asset_id = $3 AND m.generation_id = $4) \
         FROM projection_set_publication_heads h WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2",
    )
    .bind(&j.tenant_id)
    .bind(j.knowledge_space_id)
    .bind(j.document_asset_id)
    .bind(j.publication_generation_id)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(Facts {
        attempt,
        generation: j.publication_generation_id,
        head,
        base_head_revision: j.base_head_revision,
    })
}

/// The reasoning model the job's frozen retrieval profile selects.
fn selection(j: &JobRow) -> Option<Value> {
    let s = &j.retrieval_profile["reasoningModel"];
    (s["model"].is_string() && s["pluginId"].is_string() && s["provider"].is_string()).then(
        || json!({ "model": s["model"], "pluginId": s["pluginId"], "provider": s["provider"] }),
    )
}

/// The generation's nodes of the job's parse artifact, with their metadata.
async fn nodes(
    conn: &mut PgConnection,
    j: &JobRow,
) -> Result<Vec<(extract::Node, Value, Value)>, JobError> {
    type Row = (Uuid, String, String, i32, i32, String, Value, Value, Value);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT id, kind::text, text, start_offset, end_offset, artifact_hash::text, source_location, metadata, \
           permission_scope FROM knowledge_nodes \
         WHERE knowledge_space_id = $1 AND publication_generation_id = $2 AND parse_artifact_id = $3 \
         ORDER BY start_offset, id LIMIT $4",
    )
    .bind(j.knowledge_space_id)
    .bind(j.publication_generation_id)
    .bind(j.parse_artifact_id)
    .bind(MAX_NODES + 1)
    .fetch_all(conn)
    .await?;
    if rows.len() as i64 > MAX_NODES {
        return Err(JobError::fatal(
            FAILED,
            format!(
                "Document semantic enrichment node count exceeds maxNodesPerArtifact={MAX_NODES}"
            ),
        ));
    }
    Ok(rows
        .into_iter()
        .map(|(id, kind, text, start, end, hash, loc, meta, scope)| {
            let section_path = loc["sectionPath"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            (
                extract::Node {
                    id,
                    kind,
                    text,
                    start,
                    end,
                    artifact_hash: hash,
                    section_path,
                },
                meta,
                scope,
            )
        })
        .collect())
}

/// A node the semantic chunker made carries its graph facts already.
fn jointly_extracted(meta: &Value) -> bool {
    meta["semanticChunking"]["completed"] == json!(true)
        && meta["semanticChunking"]["strategy"] == json!("llm-semantic-v1")
}

type Stored = HashMap<(Uuid, String, String), Value>;

async fn checkpoints(conn: &mut PgConnection, j: &JobRow) -> Result<Stored, sqlx::Error> {
    let rows: Vec<(Uuid, String, String, Value)> = sqlx::query_as(
        "SELECT node_id, stage::text, input_fingerprint::text, result FROM document_semantic_extraction_checkpoints \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND publication_generation_id = $3",
    )
    .bind(&j.tenant_id)
    .bind(j.knowledge_space_id)
    .bind(j.publication_generation_id)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(n, s, f, r)| ((n, s, f), r))
        .collect())
}

async fn put(
    conn: &mut PgConnection,
    j: &JobRow,
    node: Uuid,
    stage: &str,
    input: &str,
    result: &Value,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO document_semantic_extraction_checkpoints (tenant_id, knowledge_space_id, document_asset_id, \
           document_version, publication_generation_id, node_id, stage, input_fingerprint, result, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, now()) ON CONFLICT DO NOTHING",
    )
    .bind(&j.tenant_id)
    .bind(j.knowledge_space_id)
    .bind(j.document_asset_id)
    .bind(j.document_version)
    .bind(j.publication_generation_id)
    .bind(node)
    .bind(stage)
    .bind(input)
    .bind(result)
    .execute(conn)
    .await?;
    Ok(())
}

fn entities_of(result: &Value) -> Vec<Value> {
    result["extractedEntities"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn now_text() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

impl SemanticKind {
    /// Every stage answer the job's nodes still lack, asked and checkpointed one by one.
    async fn extract(&self, conn: &mut PgConnection, job: &Lease) -> Result<u32, JobError> {
        let j = load(conn, job.job_id).await?;
        let Some(sel) = selection(&j) else {
            return Ok(0);
        };
        if guard(&facts(conn, &j).await?) != Guard::Current {
            return Ok(0);
        }
        let nodes = nodes(conn, &j).await?;
        if nodes.iter().all(|(_, meta, _)| jointly_extracted(meta)) {
            return Ok(0);
        }
        let model = sel["model"].as_str().unwrap_or_default().to_owned();
        let budget = Mutex::new(self.models.budget());
        let mut stored = checkpoints(conn, &j).await?;
        let mut calls = 0;
        for (n, _, _) in &nodes {
            let input = extract::entity_fingerprint(n, &sel);
            let key = (n.id, "entity".to_owned(), input.clone());
            let entities = match stored.get(&key) {
                Some(r) => entities_of(r),
                None => {
                    let c = self
                        .models
                        .call(&budget, &model, &extract::entity_prompt(n))
                        .await
                        .map_err(JobError::from)?;
                    calls += 1;
                    let r = extract::entity_result(&c.text, &model, &now_text())
                        .map_err(|e| JobError::retryable("model_bad_answer", e))?;
                    put(conn, &j, n.id, "entity", &input, &r).await?;
                    crate::crash::point("semantic-after-model-checkpoint");
                    let e = entities_of(&r);
                    stored.insert(key, r);
                    e
                }
            };
            let input = extract::relation_fingerprint(n, &entities, &sel);
            if stored.contains_key(&(n.id, "relation".to_owned(), input.clone())) {
                continue;
            }
            let r = if entities.len() < 2 {
                json!({ "extractedRelations": [] })
            } else {
                let c = self
                    .models
                    .call(&budget, &model, &extract::relation_prompt(n, &entities))
                    .await
                    .map_err(JobError::from)?;
                calls += 1;
                extract::relation_result(&c.text, &model, &now_text())
                    .map_err(|e| JobError::retryable("model_bad_answer", e))?
            };
            put(conn, &j, n.id, "relation", &input, &r).await?;
            crate::crash::point("semantic-after-model-checkpoint");
        }
        Ok(calls)
    }

    /// The job's one step: the guard, then the graph from the nodes or their checkpoints.
    async fn process(&self, tx: &mut PgConnection, job: &Lease) -> Result<Step, JobError> {
        let j = load(tx, job.job_id).await?;
        match guard(&facts(tx, &j).await?) {
            Guard::Superseded => {
                return Ok(Step::Supersede {
                    message: SUPERSEDED_MESSAGE.into(),
                })
            }
            Guard::Pending => {
                return Ok(Step::Wait {
                    delay: WAIT,
                    reason: "the generation is not published yet".into(),
                })
            }
            Guard::Current => {}
        }
        let nodes = nodes(tx, &j).await?;
        let mut result = json!({ "entitiesExtracted": 0, "graphEntityIds": [], "graphEntitiesIndexed": 0,
            "graphRelationIds": [], "graphRelationsIndexed": 0, "nodesScanned": nodes.len(),
            "semanticProviderCalls": 0, "semanticProviderCallsMaximum": 0 });
        if !nodes.is_empty() {
            let sel = selection(&j).ok_or_else(|| {
                JobError::fatal(
                    FAILED,
                    "the job's retrieval profile selects no reasoning model",
                )
            })?;
            let joint = nodes.iter().all(|(_, meta, _)| jointly_extracted(meta));
            let stored = if joint {
                Stored::new()
            } else {
                checkpoints(tx, &j).await?
            };
            let mut facts: Vec<(Vec<Value>, Vec<Value>)> = Vec::with_capacity(nodes.len());
            let mut eligible_for_relations = 0;
            for (n, meta, _) in &nodes {
                if joint {
                    facts.push((
                        entities_of(meta),
                        meta["extractedRelations"]
                            .as_array()
                            .cloned()
                            .unwrap_or_default(),
                    ));
                    continue;
                }
                let missing = || {
                    JobError::retryable(
                        "model_checkpoint_missing",
                        format!(
                            "node {} has no extraction checkpoint yet; the next run asks for it",
                            n.id
                        ),
                    )
                };
                let e = stored
                    .get(&(n.id, "entity".into(), extract::entity_fingerprint(n, &sel)))
                    .ok_or_else(missing)?;
                let entities = entities_of(e);
                if entities.len() >= 2 {
                    eligible_for_relations += 1;
                }
                let r = stored
                    .get(&(
                        n.id,
                        "relation".into(),
                        extract::relation_fingerprint(n, &entities, &sel),
                    ))
                    .ok_or_else(missing)?;
                facts.push((
                    entities,
                    r["extractedRelations"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default(),
                ));
            }
            let graph_nodes: Vec<GraphNode<'_>> = nodes
                .iter()
                .zip(&facts)
                .map(|((n, _, scope), (e, r))| GraphNode {
                    id: n.id,
                    text: &n.text,
                    permission_scope: scope,
                    entities: e,
                    relations: r,
                })
                .collect();
            let (entities, relations) = graph::build(
                j.knowledge_space_id,
                j.publication_generation_id,
                &graph_nodes,
            );
            let attempt =
                crate::jobs::compile::steps::load_attempt(tx, j.compilation_attempt_id).await?;
            crate::jobs::compile::semantic::step::write_graph(tx, &attempt, &entities, &relations)
                .await?;
            if let Some((profile, _)) =
                crate::jobs::compile::frozen::frozen_embedding(tx, &attempt).await?
            {
                let texts: HashMap<Uuid, &str> = nodes
                    .iter()
                    .map(|(n, _, _)| (n.id, n.text.as_str()))
                    .collect();
                let owners: Vec<(Uuid, String)> = entities
                    .iter()
                    .map(|e| {
                        (
                            e.id,
                            graph::entity_text(e, |id| texts.get(&id).map(|t| (*t).to_owned())),
                        )
                    })
                    .collect();
                let embedder = self.embedder.as_ref();
                crate::jobs::compile::semantic::step::project(
                    tx,
                    embedder,
                    &profile,
                    &attempt,
                    "graph_entity_semantic_projections",
                    &owners,
                )
                .await?;
                let owners: Vec<(Uuid, String)> = relations
                    .iter()
                    .map(|r| (r.id, graph::relation_text(&r.kind)))
                    .collect();
                crate::jobs::compile::semantic::step::project(
                    tx,
                    embedder,
                    &profile,
                    &attempt,
                    "graph_relation_semantic_projections",
                    &owners,
                )
                .await?;
            }
            let n = nodes.len();
            let maximum = if joint { 0 } else { n + eligible_for_relations };
            result = json!({
                "entitiesExtracted": facts.iter().map(|(e, _)| e.len()).sum::<usize>(),
                "graphEntityIds": entities.iter().map(|e| e.id).collect::<Vec<_>>(),
                "graphEntitiesIndexed": entities.len(),
                "graphRelationIds": relations.iter().map(|r| r.id).collect::<Vec<_>>(),
                "graphRelationsIndexed": relations.len(),
                "nodesScanned": n,
                "semanticProviderCalls": if joint { 0 } else { stored.len() },
                "semanticProviderCallsMaximum": maximum,
            });
        }
        sqlx::query("UPDATE document_semantic_enrichment_jobs SET result = $2 WHERE id = $1")
            .bind(job.job_id)
            .bind(&result)
            .execute(&mut *tx)
            .await?;
        Ok(Step::Succeed("succeeded".into()))
    }
}

#[async_trait::async_trait]
impl LeasedKind for SemanticKind {
    fn name(&self) -> &'static str {
        "semantic"
    }

    fn table(&self) -> &'static str {
        TABLE
    }

    fn has_checkpoint(&self) -> bool {
        false
    }

    fn states(&self) -> &'static [&'static str] {
        &[
            "queued",
            "running",
            "retry_wait",
            "succeeded",
            "failed",
            "superseded",
        ]
    }

    fn policy(&self) -> &Policy {
        &POLICY
    }

    fn claim_rule(&self) -> ClaimRule {
        ClaimRule {
            claimable: format!(
                "j.execution_attempts < j.max_execution_attempts \
                 AND (j.run_state = 'queued' OR (j.run_state = 'retry_wait' AND j.available_at <= now()) \
                      OR (j.run_state = 'running' AND {HOLDER_GONE})) AND $4::int IS NOT NULL"
            ),
            select: String::new(),
            set: ", execution_attempts = j.execution_attempts + 1, completed_at = NULL".into(),
            attempt: "j.execution_attempts",
            max_attempts: Some("j.max_execution_attempts"),
            param: Param::Int(0),
            exhausted: Some(Exhausted {
                rows: format!(
                    "j.execution_attempts >= j.max_execution_attempts AND j.run_state = 'running' \
                     AND {HOLDER_GONE} AND $3::int IS NOT NULL"
                ),
                code: EXHAUSTED,
                message: "the job's worker died during its last attempt",
            }),
        }
    }

    fn prepares(&self, _job: &Lease) -> bool {
        self.models.reasoner().is_some()
    }

    async fn prepare(&self, conn: &mut PgConnection, job: &Lease) -> Result<(), JobError> {
        self.extract(conn, job).await.map(|_| ())
    }

    async fn step(&self, tx: &mut PgConnection, job: &Lease) -> Result<Step, JobError> {
        self.process(tx, job).await
    }

    fn end_write(&self, _job: &Lease, end: &End) -> EndWrite {
        let ended = "completed_at = now(), available_at = now(), last_error_code = left($4, 128), \
                     last_error_message = left($5, 2000)";
        let (set, code, message, refund, delay) = match end {
            End::Succeed { .. } => (
                "run_state = 'succeeded', completed_at = now(), last_error_code = NULL, last_error_message = NULL"
                    .to_owned(),
                None,
                None,
                0,
                0,
            ),
            End::Fail { code, message } | End::Cancel { code, message } => (
                format!("run_state = 'failed', {ended}"),
                Some(code.clone()),
                Some(message.clone()),
                0,
                0,
            ),
            End::Supersede { message } => (
                format!("run_state = 'superseded', {ended}"),
                Some(SUPERSEDED.to_owned()),
                Some(message.clone()),
                0,
                0,
            ),
            // A planned wait gives its attempt back and records no error, as the platform's
            // "waiting" release does; a retry after a failure keeps the failure's code.
            End::Wait { delay, code, message, refund } => (
                "run_state = 'retry_wait', available_at = now() + $7::bigint * interval '1 millisecond', \
                 execution_attempts = greatest(0, execution_attempts - $6), last_error_code = left($4, 128), \
                 last_error_message = left($5, 2000)"
                    .to_owned(),
                (!refund).then(|| code.clone()),
                (!refund).then(|| message.clone()),
                i32::from(*refund),
                millis(*delay),
            ),
            End::Continue => (
                "run_state = 'queued', execution_attempts = greatest(0, execution_attempts - $6)".to_owned(),
                None,
                None,
                1,
                0,
            ),
        };
        EndWrite {
            set,
            text4: code,
            text5: message,
            int6: refund,
            bigint7: delay,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generation_guard_table() {
        let g = Uuid::from_u128(1);
        let other = Uuid::from_u128(2);
        let f = |attempt: Option<(Uuid, &str)>, head: Option<(i64, bool)>| Facts {
            attempt: attempt.map(|(g, s)| (g, s.to_owned())),
            generation: g,
            head,
            base_head_revision: 3,
        };
        let cases = [
            (f(None, Some((4, true))), Guard::Superseded),
            (
                f(Some((other, "succeeded")), Some((4, true))),
                Guard::Superseded,
            ),
            (f(Some((g, "failed")), Some((4, true))), Guard::Superseded),
            (f(Some((g, "canceled")), None), Guard::Superseded),
            (f(Some((g, "superseded")), None), Guard::Superseded),
            (f(Some((g, "succeeded")), Some((4, true))), Guard::Current),
            (f(Some((g, "running")), Some((4, true))), Guard::Current),
            (
                f(Some((g, "succeeded")), Some((3, true))),
                Guard::Superseded,
            ),
            (
                f(Some((g, "succeeded")), Some((5, false))),
                Guard::Superseded,
            ),
            (f(Some((g, "running")), Some((5, false))), Guard::Pending),
            (f(Some((g, "running")), None), Guard::Pending),
        ];
        for (facts, want) in cases {
            assert_eq!(guard(&facts), want, "{facts:?}");
        }
    }

    #[test]
    fn a_planned_wait_gives_its_attempt_back_and_a_retry_keeps_its_code() {
        let k = SemanticKind::default();
        let job = Lease {
            job_id: Uuid::nil(),
            lease_token: Uuid::nil(),
            row_version: 1,
            checkpoint: "running".into(),
            attempt: 1,
            max_attempts: 5,
            worker_id: "w".into(),
            taken_over: false,
        };
        let wait = |refund| End::Wait {
            delay: Duration::from_secs(5),
            code: "model_unavailable".into(),
            message: "down".into(),
            refund,
        };
        let w = k.end_write(&job, &wait(true));
        assert_eq!((w.int6, w.text4.as_deref(), w.bigint7), (1, None, 5000));
        let w = k.end_write(&job, &wait(false));
        assert_eq!((w.int6, w.text4.as_deref()), (0, Some("model_unavailable")));
        let w = k.end_write(
            &job,
            &End::Supersede {
                message: SUPERSEDED_MESSAGE.into(),
            },
        );
        assert_eq!(w.text4.as_deref(), Some(SUPERSEDED));
        assert!(w.set.contains("'superseded'"));
    }
}
