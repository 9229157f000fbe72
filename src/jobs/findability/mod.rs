//! `quality.page-index-findability`: after a model-driven compile publishes, how well a layered
//! search over the published outline's titles and summaries finds the evidence of the space's
//! golden questions ([`evaluate`], [`search`]), written to `page_index_findability_evaluations`
//! (platform migration 0036) as the platform writes it, with a summary repair queued for the
//! document version when the outline fails and none was queued before.
//!
//! The platform hands this job from its publish to an in-memory or broker queue with no row of
//! its own, so a lost message loses the evaluation. Here Postgres says what is due: an attempt
//! that succeeded, whose outline the space's head serves, whose frozen retrieval profile names a
//! reasoning model, and that has no evaluation of this evaluator version yet.
//!
//! Invariant: one evaluation of an attempt runs at a time across every process — it holds the
//! session advisory lock `(7038591, hashtext(attempt id))` on a connection of its own, which
//! Postgres drops the moment the process or its connection dies — and it writes nothing but its
//! one upsert, in one transaction, keyed by (tenant, space, generation, evaluator version); a
//! crash before that commit leaves no row, and the next sweep evaluates the attempt again. A
//! failed evaluation is tried again after 5 s, then 10 s, and after three failures this process
//! leaves it, as the platform's job gives up.

pub mod evaluate;
pub mod search;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

use crate::jobs::compile::semantic::{self as model_compile, Selection};
use crate::jobs::compile::steps;
use crate::jobs::JobError;
use crate::model::{ModelError, Models};
use evaluate::{Question, Range, Tally, Verdict};
use search::{Search, SearchError, Tree};

/// The advisory-lock namespace of a running evaluation.
pub const LOCK_NAMESPACE: i32 = 7_038_591;
/// Evaluations started per sweep.
pub const BATCH: i64 = 8;
/// Tries of one evaluation in one process.
pub const MAX_TRIES: u32 = 3;
const RETRY_BASE: Duration = Duration::from_secs(5);
const RETRY_MAX: Duration = Duration::from_secs(10);

/// The findability kind of a process.
pub struct FindabilityKind {
    models: Models,
    /// Failed attempts of this process: tries and when the next may start.
    failed: Mutex<HashMap<Uuid, (u32, Instant)>>,
}

/// What one evaluation did.
#[derive(Clone, Debug, PartialEq)]
pub struct Evaluated {
    pub attempt: Uuid,
    pub status: String,
    pub route: String,
    pub summary_repair_state: String,
    pub evaluation: Value,
    /// Model calls made.
    pub calls: usize,
}

/// Why an evaluation did not write.
#[derive(Debug)]
pub enum Skipped {
    /// Another process holds the attempt, or it was evaluated meanwhile.
    Busy,
    Failed(JobError),
}

impl From<sqlx::Error> for Skipped {
    fn from(e: sqlx::Error) -> Self {
        Skipped::Failed(e.into())
    }
}

impl From<JobError> for Skipped {
    fn from(e: JobError) -> Self {
        Skipped::Failed(e)
    }
}

const DUE: &str = "SELECT a.id FROM document_compilation_attempts a \
     JOIN knowledge_space_profile_revisions r ON r.tenant_id = a.tenant_id \
       AND r.knowledge_space_id = a.knowledge_space_id AND r.id = a.retrieval_profile_revision_id \
       AND r.kind = 'retrieval' \
     JOIN projection_set_publication_heads h ON h.tenant_id = a.tenant_id \
       AND h.knowledge_space_id = a.knowledge_space_id \
     WHERE a.run_state = 'succeeded' AND a.checkpoint = 'published' \
       AND NOT (r.provider = 'offline' AND r.model LIKE '%extractive') \
       AND EXISTS (SELECT 1 FROM projection_set_publication_members m \
                   WHERE m.publication_id = h.publication_id AND m.component_type = 'document-outline' \
                     AND m.document_asset_id = a.document_asset_id \
                     AND m.generation_id = a.publication_generation_id) \
       AND NOT EXISTS (SELECT 1 FROM page_index_findability_evaluations e \
                       WHERE e.tenant_id = a.tenant_id AND e.knowledge_space_id = a.knowledge_space_id \
                         AND e.publication_generation_id = a.publication_generation_id \
                         AND e.evaluator_version = $1) \
       AND a.id <> ALL($2) \
     ORDER BY a.updated_at, a.id LIMIT $3";

impl FindabilityKind {
    pub fn new(models: Models) -> Self {
        Self {
            models,
            failed: Mutex::new(HashMap::new()),
        }
    }

    fn waiting(&self) -> Vec<Uuid> {
        let now = Instant::now();
        let failed = self.failed.lock().expect("findability failures");
        failed
            .iter()
            .filter(|(_, (tries, next))| *tries >= MAX_TRIES || *next > now)
            .map(|(id, _)| *id)
            .collect()
    }

    /// The attempts due for an evaluation, oldest first.
    pub async fn due(&self, pool: &PgPool) -> Result<Vec<Uuid>, sqlx::Error> {
        sqlx::query_scalar(DUE)
            .bind(evaluate::EVALUATOR_VERSION)
            .bind(self.waiting())
            .bind(BATCH)
            .fetch_all(pool)
            .await
    }

    /// One sweep: evaluates what is due. Returns the evaluations written.
    pub async fn sweep(&self, pool: &PgPool) -> Result<Vec<Evaluated>, sqlx::Error> {
        if self.models.reasoner().is_none() {
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        for attempt in self.due(pool).await? {
            match self.evaluate(pool, attempt).await {
                Ok(e) => {
                    self.failed
                        .lock()
                        .expect("findability failures")
                        .remove(&attempt);
                    tracing::info!(attempt = %attempt, status = %e.status, route = %e.route,
                                   repair = %e.summary_repair_state, calls = e.calls,
                                   "page-index findability evaluated");
                    out.push(e);
                }
                Err(Skipped::Busy) => {}
                Err(Skipped::Failed(e)) => {
                    let mut failed = self.failed.lock().expect("findability failures");
                    let tries = failed.get(&attempt).map_or(0, |f| f.0) + 1;
                    let delay = RETRY_BASE
                        .saturating_mul(2u32.saturating_pow(tries - 1))
                        .min(RETRY_MAX);
                    failed.insert(attempt, (tries, Instant::now() + delay));
                    tracing::warn!(attempt = %attempt, tries, code = %e.code(), error = %e.message(),
                                   gives_up = tries >= MAX_TRIES,
                                   "page-index findability evaluation failed");
                }
            }
        }
        Ok(out)
    }

    /// Evaluates one attempt under its advisory lock and writes the result.
    pub async fn evaluate(&self, pool: &PgPool, attempt: Uuid) -> Result<Evaluated, Skipped> {
        // A connection of its own: closing it (or the process dying) ends the lock.
        let mut conn = pool.acquire().await?.detach();
        let locked: bool =
            sqlx::query_scalar("SELECT pg_try_advisory_lock($1, hashtext($2::text))")
                .bind(LOCK_NAMESPACE)
                .bind(attempt)
                .fetch_one(&mut conn)
                .await?;
        if !locked {
            let _ = conn.close().await;
            return Err(Skipped::Busy);
        }
        let r = self.evaluate_locked(&mut conn, attempt).await;
        let _ = conn.close().await;
        r
    }

    async fn evaluate_locked(
        &self,
        conn: &mut PgConnection,
        attempt: Uuid,
    ) -> Result<Evaluated, Skipped> {
        let a = steps::load_attempt(conn, attempt).await?;
        let done: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM page_index_findability_evaluations WHERE tenant_id = $1 \
               AND knowledge_space_id = $2 AND publication_generation_id = $3 AND evaluator_version = $4)",
        )
        .bind(&a.tenant)
        .bind(a.space)
        .bind(a.generation)
        .bind(evaluate::EVALUATOR_VERSION)
        .fetch_one(&mut *conn)
        .await?;
        if done {
            return Err(Skipped::Busy);
        }
        let Some(sel) = model_compile::selection(conn, &self.models, &a).await? else {
            return Err(JobError::fatal(
                "FINDABILITY_UNAVAILABLE",
                "the attempt's frozen retrieval profile names no reasoning model this process has",
            )
            .into());
        };
        let outline: Option<(Uuid, Value)> = sqlx::query_as(
            "SELECT id, nodes FROM document_outlines WHERE knowledge_space_id = $1 \
               AND document_asset_id = $2 AND version = $3 AND publication_generation_id = $4",
        )
        .bind(a.space)
        .bind(a.document)
        .bind(a.version)
        .bind(a.generation)
        .fetch_optional(&mut *conn)
        .await?;
        let Some((outline_id, nodes)) = outline else {
            return Err(JobError::fatal(
                "FINDABILITY_OUTLINE_MISSING",
                "the exact outline generation of the attempt is unavailable",
            )
            .into());
        };
        // The publication that first served this generation's outline: the attempt's own.
        let fingerprint: Option<String> = sqlx::query_scalar(
            "SELECT p.fingerprint::text FROM projection_set_publication_members m \
             JOIN projection_set_publications p ON p.id = m.publication_id \
             WHERE p.tenant_id = $1 AND p.knowledge_space_id = $2 AND m.component_type = 'document-outline' \
               AND m.document_asset_id = $3 AND m.generation_id = $4 \
             ORDER BY p.created_at, p.id LIMIT 1",
        )
        .bind(&a.tenant)
        .bind(a.space)
        .bind(a.document)
        .bind(a.generation)
        .fetch_optional(&mut *conn)
        .await?;
        let Some(fingerprint) = fingerprint else {
            return Err(JobError::fatal(
                "FINDABILITY_PUBLICATION_MISSING",
                "no publication serves the attempt's outline",
            )
            .into());
        };
        let tree = Tree::parse(&nodes).map_err(|e| {
            JobError::fatal("FINDABILITY_OUTLINE_INVALID", format!("the outline: {e}"))
        })?;
        let questions = questions(conn, a.space).await?;
        let ranges = evidence(conn, &a, &questions).await?;
        let samples = evaluate::samples(&questions, &evaluate::evidence_nodes(&tree, &ranges));
        let (verdict, calls) = if samples.len() < evaluate::MIN_QUESTIONS {
            (evaluate::verdict(&sel.to_json(), samples.len(), None), 0)
        } else {
            self.search_all(&tree, &samples, &sel, a.document, outline_id)
                .await?
        };
        let state = persist(conn, &a, outline_id, &fingerprint, &verdict).await?;
        let mut evaluation = verdict.evaluation;
        evaluation["summaryRepairRequested"] = Value::Bool(state.1);
        Ok(Evaluated {
            attempt,
            status: verdict.status.into(),
            route: verdict.route.into(),
            summary_repair_state: state.0,
            evaluation,
            calls,
        })
    }

    /// The layered search of every sample; an integrity failure ends the evaluation.
    async fn search_all(
        &self,
        tree: &Tree,
        samples: &[evaluate::Sample],
        sel: &Selection,
        document: Uuid,
        outline: Uuid,
    ) -> Result<(Verdict, usize), JobError> {
        let budget = Mutex::new(self.models.budget());
        let (document, outline) = (document.to_string(), outline.to_string());
        let mut tally = Tally::default();
        let mut calls = 0;
        for sample in samples {
            let found = match self
                .search_one(
                    tree,
                    &sample.question.question,
                    sel,
                    &budget,
                    &document,
                    &outline,
                    &mut calls,
                )
                .await
            {
                Ok(found) => Some(found),
                Err(SearchError::Integrity(m)) => {
                    return Err(JobError::fatal("FINDABILITY_INTEGRITY", m))
                }
                Err(SearchError::Recoverable(m)) => {
                    tracing::debug!(question = %sample.question.id, error = %m, "findability search failed");
                    None
                }
            };
            if !tally.record(tree, sample, found.as_deref()) {
                break;
            }
        }
        Ok((
            evaluate::verdict(&sel.to_json(), samples.len(), Some(&tally)),
            calls,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    async fn search_one(
        &self,
        tree: &Tree,
        query: &str,
        sel: &Selection,
        budget: &Mutex<crate::model::Budget>,
        document: &str,
        outline: &str,
        calls: &mut usize,
    ) -> Result<Vec<usize>, SearchError> {
        let mut s = Search::start(tree, query)?;
        while !s.completed && s.depth < evaluate::MAX_TREE_DEPTH {
            let Some((prompt, shown)) = s.next(tree, document, outline)? else {
                break;
            };
            *calls += 1;
            let c = self
                .models
                .call(budget, &sel.model, &prompt)
                .await
                .map_err(|e: ModelError| SearchError::Recoverable(e.to_string()))?;
            crate::crash::point("findability-after-model-call");
            let decisions = search::parse(&c.text, tree, &shown)?;
            s.apply(tree, &shown, &decisions);
        }
        Ok(s.top(evaluate::TOP_K))
    }
}

/// The space's golden questions, oldest first, at most [`evaluate::MAX_QUESTIONS`].
async fn questions(conn: &mut PgConnection, space: Uuid) -> Result<Vec<Question>, JobError> {
    let rows: Vec<(Uuid, String, Value)> = sqlx::query_as(
        "SELECT id, question, expected_evidence_ids FROM golden_questions \
         WHERE knowledge_space_id = $1 ORDER BY created_at, id LIMIT $2",
    )
    .bind(space)
    .bind(evaluate::MAX_QUESTIONS as i64)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, question, ids)| Question {
            id: id.to_string(),
            question,
            evidence: ids
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect(),
        })
        .collect())
}

/// The offsets of the questions' evidence that lies in this attempt's generation of its
/// document.
async fn evidence(
    conn: &mut PgConnection,
    a: &steps::Attempt,
    questions: &[Question],
) -> Result<Vec<Range>, JobError> {
    let mut ids: Vec<&String> = questions.iter().flat_map(|q| &q.evidence).collect();
    ids.sort();
    ids.dedup();
    if ids.len() > evaluate::MAX_EVIDENCE_IDS {
        return Err(JobError::fatal(
            "FINDABILITY_EVIDENCE_LIMIT",
            format!(
                "the golden questions name more than {} evidence ids",
                evaluate::MAX_EVIDENCE_IDS
            ),
        ));
    }
    let uuids: Vec<Uuid> = ids.iter().filter_map(|s| Uuid::parse_str(s).ok()).collect();
    if uuids.is_empty() {
        return Ok(Vec::new());
    }
    let rows: Vec<(Uuid, i32, i32)> = sqlx::query_as(
        "SELECT id, start_offset, end_offset FROM knowledge_nodes WHERE knowledge_space_id = $1 \
           AND id = ANY($2) AND document_asset_id = $3 AND publication_generation_id = $4",
    )
    .bind(a.space)
    .bind(&uuids)
    .bind(a.document)
    .bind(a.generation)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, start, end)| Range {
            evidence: id.to_string(),
            start: start.into(),
            end: end.into(),
        })
        .collect())
}

/// Writes the evaluation as the platform does, in one transaction under the space's row lock:
/// the row of (tenant, space, generation, evaluator version) is inserted or updated; a failed
/// evaluation queues a summary repair unless another evaluation of the same document version
/// already asked for one, or this row's repair has gone past `queued`. Returns the row's repair
/// state and whether it asked for a repair.
async fn persist(
    conn: &mut PgConnection,
    a: &steps::Attempt,
    outline: Uuid,
    fingerprint: &str,
    v: &Verdict,
) -> Result<(String, bool), JobError> {
    let mut tx = conn.begin().await?;
    let space: Option<Uuid> = sqlx::query_scalar(
        "SELECT id FROM knowledge_spaces WHERE tenant_id = $1 AND id = $2 FOR UPDATE",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .fetch_optional(&mut *tx)
    .await?;
    if space.is_none() {
        return Err(JobError::fatal(
            "FINDABILITY_SPACE_MISSING",
            "the knowledge space of the evaluation is gone",
        ));
    }
    let existing: Option<(Uuid, String, Value)> = sqlx::query_as(
        "SELECT id, summary_repair_state::text, evaluation FROM page_index_findability_evaluations \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND publication_generation_id = $3 \
           AND evaluator_version = $4 FOR UPDATE",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.generation)
    .bind(evaluate::EVALUATOR_VERSION)
    .fetch_optional(&mut *tx)
    .await?;
    let prior: Option<Uuid> = sqlx::query_scalar(
        "SELECT id FROM page_index_findability_evaluations WHERE tenant_id = $1 \
           AND knowledge_space_id = $2 AND document_asset_id = $3 AND document_version = $4 \
           AND summary_repair_state <> 'not-requested' AND id IS DISTINCT FROM $5 LIMIT 1 FOR UPDATE",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.document)
    .bind(i64::from(a.version))
    .bind(existing.as_ref().map(|e| e.0))
    .fetch_optional(&mut *tx)
    .await?;
    let queue = v.status == "failed"
        && prior.is_none()
        && existing
            .as_ref()
            .is_none_or(|e| e.1 == "not-requested" || e.1 == "queued");
    let requested = queue
        || existing
            .as_ref()
            .is_some_and(|e| e.2["summaryRepairRequested"] == Value::Bool(true));
    let state = if queue {
        "queued".to_owned()
    } else {
        existing
            .as_ref()
            .map_or_else(|| "not-requested".to_owned(), |e| e.1.clone())
    };
    let mut evaluation = v.evaluation.clone();
    evaluation["summaryRepairRequested"] = Value::Bool(requested);
    sqlx::query(
        "INSERT INTO page_index_findability_evaluations (id, tenant_id, knowledge_space_id, \
           document_asset_id, document_version, outline_id, publication_generation_id, \
           publication_fingerprint, compilation_attempt_id, evaluator_version, status, \
           recommended_route, evaluation, summary_repair_state, summary_repair_attempts, \
           evaluated_at, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, 0, now(), now()) \
         ON CONFLICT (tenant_id, knowledge_space_id, publication_generation_id, evaluator_version) \
         DO UPDATE SET document_asset_id = EXCLUDED.document_asset_id, \
           document_version = EXCLUDED.document_version, outline_id = EXCLUDED.outline_id, \
           publication_fingerprint = EXCLUDED.publication_fingerprint, \
           compilation_attempt_id = EXCLUDED.compilation_attempt_id, status = EXCLUDED.status, \
           recommended_route = EXCLUDED.recommended_route, evaluation = EXCLUDED.evaluation, \
           summary_repair_state = EXCLUDED.summary_repair_state, evaluated_at = EXCLUDED.evaluated_at, \
           updated_at = EXCLUDED.updated_at",
    )
    .bind(existing.as_ref().map_or_else(Uuid::new_v4, |e| e.0))
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.document)
    .bind(i64::from(a.version))
    .bind(outline)
    .bind(a.generation)
    .bind(fingerprint)
    .bind(a.id)
    .bind(evaluate::EVALUATOR_VERSION)
    .bind(v.status)
    .bind(v.route)
    .bind(&evaluation)
    .bind(&state)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok((state, requested))
}

#[async_trait::async_trait]
impl crate::engine::polled::PolledKind for FindabilityKind {
    fn name(&self) -> &'static str {
        "findability"
    }

    fn states(&self) -> &'static [&'static str] {
        &["failed", "not-evaluated", "passed"]
    }

    fn counts_sql(&self) -> &'static str {
        "SELECT status::text, count(*) FROM page_index_findability_evaluations GROUP BY 1"
    }

    async fn tick(&self, pool: &PgPool, _holder: &str) -> Result<usize, sqlx::Error> {
        Ok(self.sweep(pool).await?.len())
    }
}
