//! Model-driven compile: what an attempt whose frozen retrieval profile names a reasoning model
//! gets inside the same checkpoints, as the platform's compile gives it since its migrations
//! 0038–0054 — semantic chunking over windows ([`plan`], [`answer`]; 0044 checkpoints), node
//! generation receipts ([`nodes`]; 0043), outline summaries ([`summaries`]; 0038 checkpoints),
//! and the graph extracted jointly with the chunks, with its semantic projections ([`graph`];
//! 0054).
//!
//! Invariant: every model call happens in [`prepare`], outside the step's transaction, under the
//! process's limits ([`crate::model::Models::call`]) and one per-run budget, and its validated
//! answer is checkpointed by itself the moment it arrives, keyed by the generation and the exact
//! input's fingerprint; a call whose checkpoint exists is never made again. The steps that
//! write the read model (`parsed → outline_built`, `outline_built → nodes_generated`) only read
//! checkpoints and never call a model, so they stay short and repeatable; one that finds a
//! checkpoint missing (a crash between the two) is retried and its prepare makes it.
//! An attempt is model-driven when the process has a reasoning model ([`crate::model`]) and the
//! attempt's frozen retrieval profile names one other than the extractive stand-in
//! ([`is_extractive`]); all others keep the deterministic pipeline.

pub mod answer;
pub mod graph;
pub mod nodes;
pub mod plan;
pub(crate) mod step;
pub mod summaries;

use std::collections::HashMap;
use std::sync::Mutex;

use futures_util::StreamExt;
use serde_json::{json, Value};
use sqlx::PgConnection;

use super::steps::{self, Artifact, Attempt};
use crate::jobs::JobError;
use crate::model::{Completion, Models};

/// Semantic windows asked for at once per document.
pub const WINDOW_CONCURRENCY: usize = 4;
/// Retries of a window whose answer was malformed JSON or broke the schema.
pub const OUTPUT_RETRIES: usize = 1;

/// The reasoning model a retrieval profile selects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    pub model: String,
    pub plugin_id: String,
    pub provider: String,
}

impl Selection {
    pub fn to_json(&self) -> Value {
        json!({ "model": self.model, "pluginId": self.plugin_id, "provider": self.provider })
    }
}

/// The extractive stand-in the fixtures and the demo select (provider `offline`, a model named
/// `…extractive`): a profile that selects it asks for no model.
pub fn is_extractive(s: &Selection) -> bool {
    s.provider == "offline" && s.model.ends_with("extractive")
}

/// The reasoning model the attempt's frozen retrieval profile selects, when the attempt is
/// model-driven in this process.
pub(crate) async fn selection(
    conn: &mut PgConnection,
    models: &Models,
    a: &Attempt,
) -> Result<Option<Selection>, JobError> {
    let (Some(_), Some(frozen)) = (models.reasoner(), a.profiles.as_ref()) else {
        return Ok(None);
    };
    let row: Option<(String, String, String)> = sqlx::query_as(
        "SELECT model::text, plugin_id::text, provider::text FROM knowledge_space_profile_revisions \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND id = $3 AND kind = 'retrieval'",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(frozen.retrieval.revision_id)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(row
        .map(|(model, plugin_id, provider)| Selection {
            model,
            plugin_id,
            provider,
        })
        .filter(|s| !is_extractive(s)))
}

/// A window's checkpoint by window id and input fingerprint: the model's fingerprint, its answer
/// and its completion record.
type Checkpoints = HashMap<(String, String), (String, String, Value)>;

async fn window_checkpoints(
    conn: &mut PgConnection,
    a: &Attempt,
) -> Result<Checkpoints, sqlx::Error> {
    let rows: Vec<(String, String, String, String, Value)> = sqlx::query_as(
        "SELECT window_id::text, input_fingerprint::text, model_fingerprint::text, response_text, completion \
         FROM document_semantic_window_checkpoints \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND publication_generation_id = $3",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.generation)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(w, i, m, r, c)| ((w, i), (m, r, c)))
        .collect())
}

async fn summary_checkpoints(
    conn: &mut PgConnection,
    a: &Attempt,
) -> Result<HashMap<(String, String), (String, Value)>, sqlx::Error> {
    let rows: Vec<(String, String, String, Value)> = sqlx::query_as(
        "SELECT outline_node_id::text, input_fingerprint::text, summary, metadata \
         FROM document_outline_summary_checkpoints \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND publication_generation_id = $3",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.generation)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(n, i, s, m)| ((n, i), (s, m)))
        .collect())
}

/// The planned windows of an artifact, with the canonical text and the units.
pub struct Planned {
    pub canonical: String,
    pub units: Vec<plan::Unit>,
    pub windows: Vec<plan::Window>,
}

pub(crate) fn planned(art: &Artifact) -> Result<Planned, JobError> {
    let canonical = plan::canonical_text(&art.elements);
    let units = plan::units(&art.elements);
    let windows = plan::windows(&canonical, &units)
        .map_err(|e| JobError::fatal(super::profiles::COMPILATION_FAILED, e))?;
    Ok(Planned {
        canonical,
        units,
        windows,
    })
}

/// What [`prepare`] did: model calls made and checkpoints found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Prepared {
    pub calls: usize,
    pub reused: usize,
}

/// Before `parsed → outline_built` and `outline_built → nodes_generated` of a model-driven
/// attempt, outside any transaction: every semantic window, then every outline summary, that
/// has no checkpoint yet is asked for and checkpointed. Returns what it did; an attempt that is
/// not model-driven, or that the step will end anyway (a revoked grant), is left alone.
pub(crate) async fn prepare(
    conn: &mut PgConnection,
    models: &Models,
    job: &crate::jobs::JobCtx,
) -> Result<Prepared, JobError> {
    let a = steps::load_attempt(conn, job.job_id).await?;
    if let Some(grant) = a.authority.grant() {
        let verdict = crate::capability::check(conn, &a.tenant, a.space, grant).await?;
        if verdict.into_result().is_err() {
            return Ok(Prepared::default());
        }
    }
    let Some(sel) = selection(conn, models, &a).await? else {
        return Ok(Prepared::default());
    };
    let art = steps::load_artifact(conn, &a).await?;
    let budget = Mutex::new(models.budget());
    let mut done = windows(conn, models, &budget, &a, &art, &sel).await?;
    let more = outline_summaries(
        conn,
        models,
        &budget,
        (&a, &art, &sel),
        "compile-after-model-checkpoint",
    )
    .await?;
    done.calls += more.calls;
    done.reused += more.reused;
    Ok(done)
}

/// One window's model call, retried while the answer breaks the JSON contract.
async fn ask_window(
    models: &Models,
    budget: &Mutex<crate::model::Budget>,
    sel: &Selection,
    p: &Planned,
    w: &plan::Window,
) -> Result<(Completion, usize), JobError> {
    let prompt = plan::prompt(&p.units, w);
    let mut tries = 0;
    loop {
        let c = models
            .call(budget, &sel.model, &prompt)
            .await
            .map_err(JobError::from)?;
        match answer::parse(&c.text, &p.canonical, &p.units, w) {
            Ok(_) => return Ok((c, tries + 1)),
            Err(e) if e.retryable() && tries < OUTPUT_RETRIES => tries += 1,
            Err(e) => {
                return Err(JobError::fatal(
                    super::profiles::COMPILATION_FAILED,
                    format!("window {}: {e}", w.id),
                ))
            }
        }
    }
}

async fn windows(
    conn: &mut PgConnection,
    models: &Models,
    budget: &Mutex<crate::model::Budget>,
    a: &Attempt,
    art: &Artifact,
    sel: &Selection,
) -> Result<Prepared, JobError> {
    let p = planned(art)?;
    let model_fp = plan::model_fingerprint(&sel.to_json());
    let stored = window_checkpoints(conn, a).await?;
    let mut out = Prepared::default();
    let mut missing = Vec::new();
    for w in &p.windows {
        let input = plan::input_fingerprint(&p.units, w);
        match stored.get(&(w.id.clone(), input.clone())) {
            Some((m, _, _)) if *m != model_fp => {
                return Err(JobError::fatal(
                    super::profiles::COMPILATION_FAILED,
                    "Semantic window checkpoint model fingerprint changed",
                ))
            }
            Some(_) => out.reused += 1,
            None => missing.push((w, input)),
        }
    }
    let p = &p;
    let mut calls = Vec::with_capacity(missing.len());
    for (w, input) in missing {
        calls.push(async move { (w, input, ask_window(models, budget, sel, p, w).await) });
    }
    let mut asked = futures_util::stream::iter(calls).buffered(WINDOW_CONCURRENCY);
    while let Some((w, input, result)) = asked.next().await {
        let (c, tries) = result?;
        out.calls += tries;
        let mut completion = json!({ "actualModel": c.model });
        if let Some(r) = models.reasoner() {
            completion["actualProvider"] = json!(r.name());
        }
        sqlx::query(
            "INSERT INTO document_semantic_window_checkpoints (tenant_id, knowledge_space_id, document_asset_id, \
               document_version, publication_generation_id, window_id, input_fingerprint, model_fingerprint, \
               response_text, completion, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, now()) ON CONFLICT DO NOTHING",
        )
        .bind(&a.tenant)
        .bind(a.space)
        .bind(a.document)
        .bind(a.version)
        .bind(a.generation)
        .bind(&w.id)
        .bind(&input)
        .bind(&model_fp)
        .bind(c.text.trim())
        .bind(&completion)
        .execute(&mut *conn)
        .await?;
        crate::crash::point("compile-after-model-checkpoint");
    }
    Ok(out)
}

/// A summary repair (`page-index.repair`) of a published model-driven attempt, outside any
/// transaction: every outline summary of its generation is made again as the compile made it —
/// one whose checkpoint exists is reused, a missing one is asked for and checkpointed. Nothing
/// is published. An attempt whose capability grant was revoked, or whose profile names no
/// reasoning model this process has, is refused.
pub(crate) async fn resummarise(
    conn: &mut PgConnection,
    models: &Models,
    attempt: uuid::Uuid,
) -> Result<Prepared, JobError> {
    let a = steps::load_attempt(conn, attempt).await?;
    if let Some(grant) = a.authority.grant() {
        let verdict = crate::capability::check(conn, &a.tenant, a.space, grant).await?;
        if let Err(why) = verdict.into_result() {
            return Err(JobError::fatal("CAPABILITY_REVOKED", why));
        }
    }
    let Some(sel) = selection(conn, models, &a).await? else {
        return Err(JobError::fatal(
            "PAGE_INDEX_SUMMARY_REPAIR_UNAVAILABLE",
            "PageIndex summary component repair requires the reasoning model of the attempt's profile",
        ));
    };
    let art = steps::load_artifact(conn, &a).await?;
    let budget = Mutex::new(models.budget());
    outline_summaries(
        conn,
        models,
        &budget,
        (&a, &art, &sel),
        "repair-after-model-checkpoint",
    )
    .await
}

async fn outline_summaries(
    conn: &mut PgConnection,
    models: &Models,
    budget: &Mutex<crate::model::Budget>,
    (a, art, sel): (&Attempt, &Artifact, &Selection),
    crash_point: &'static str,
) -> Result<Prepared, JobError> {
    let o = super::outline::build(
        a.generation,
        a.document,
        a.version,
        &art.elements,
        &art.parser,
        &art.parser_version,
        &art.content_type,
    );
    let sections = summaries::sections(&o.nodes, &art.elements);
    let stored = summary_checkpoints(conn, a).await?;
    let mut done: HashMap<String, String> = HashMap::new();
    let mut out = Prepared::default();
    for level in summaries::levels(&sections) {
        let mut missing = Vec::new();
        for s in &sections[level] {
            let children = summaries::child_summaries(s, &done).unwrap_or_default();
            let input = summaries::input_fingerprint(s, &children, &sel.model);
            match stored.get(&(s.id.clone(), input.clone())) {
                Some((summary, _)) => {
                    out.reused += 1;
                    done.insert(s.id.clone(), summary.clone());
                }
                None => missing.push((s, children, input)),
            }
        }
        let mut calls = Vec::with_capacity(missing.len());
        for (s, children, input) in missing {
            calls.push(async move {
                let prompt = summaries::prompt(s, &children);
                let r = models.call(budget, &sel.model, &prompt).await;
                (s, input, r)
            });
        }
        let mut asked = futures_util::stream::iter(calls).buffered(summaries::CONCURRENCY);
        while let Some((s, input, r)) = asked.next().await {
            let c = r.map_err(JobError::from)?;
            out.calls += 1;
            let summary = summaries::parse(&c.text)
                .map_err(|e| JobError::fatal(super::profiles::COMPILATION_FAILED, e))?;
            let mut meta = json!({ "model": c.model });
            if let Some(r) = models.reasoner() {
                meta["provider"] = json!(r.name());
            }
            sqlx::query(
                "INSERT INTO document_outline_summary_checkpoints (tenant_id, knowledge_space_id, document_asset_id, \
                   document_version, publication_generation_id, outline_node_id, input_fingerprint, summary, metadata, \
                   created_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, now()) ON CONFLICT DO NOTHING",
            )
            .bind(&a.tenant)
            .bind(a.space)
            .bind(a.document)
            .bind(a.version)
            .bind(a.generation)
            .bind(&s.id)
            .bind(&input)
            .bind(&summary)
            .bind(&meta)
            .execute(&mut *conn)
            .await?;
            crate::crash::point(crash_point);
            done.insert(s.id.clone(), summary);
        }
    }
    Ok(out)
}

/// `parsed → outline_built` of a model-driven attempt: the checkpointed summaries of the
/// outline's nodes, written into it (see [`summaries::apply`]). A summary whose checkpoint is
/// missing makes the step retry.
pub(crate) async fn summarised(
    conn: &mut PgConnection,
    a: &Attempt,
    sel: &Selection,
    elements: &[super::artifact::Element],
    nodes: &mut Value,
    metadata: &mut Value,
) -> Result<(), JobError> {
    let sections = summaries::sections(nodes, elements);
    let stored = summary_checkpoints(conn, a).await?;
    let mut done: HashMap<String, String> = HashMap::new();
    let mut applied: HashMap<String, (String, Value)> = HashMap::new();
    for s in &sections {
        let children = summaries::child_summaries(s, &done).unwrap_or_default();
        let input = summaries::input_fingerprint(s, &children, &sel.model);
        let Some((summary, meta)) = stored.get(&(s.id.clone(), input)) else {
            return Err(missing_checkpoint("outline summary", &s.id));
        };
        done.insert(s.id.clone(), summary.clone());
        applied.insert(s.id.clone(), (summary.clone(), meta.clone()));
    }
    summaries::apply(nodes, metadata, &applied, &sel.model);
    Ok(())
}

fn missing_checkpoint(what: &str, id: &str) -> JobError {
    JobError::retryable(
        "model_checkpoint_missing",
        format!("the {what} of {id} has no checkpoint yet; the next run asks for it"),
    )
}

/// The chunks of every window, from their checkpoints, in document order. A window whose
/// checkpoint is missing makes the step retry.
pub(crate) async fn chunks(
    conn: &mut PgConnection,
    a: &Attempt,
    sel: &Selection,
    p: &Planned,
) -> Result<Vec<(usize, answer::Chunk, Value)>, JobError> {
    let stored = window_checkpoints(conn, a).await?;
    let model_fp = plan::model_fingerprint(&sel.to_json());
    let mut out = Vec::new();
    for (i, w) in p.windows.iter().enumerate() {
        let input = plan::input_fingerprint(&p.units, w);
        let Some((m, text, completion)) = stored.get(&(w.id.clone(), input)) else {
            return Err(missing_checkpoint("semantic window", &w.id));
        };
        if *m != model_fp {
            return Err(JobError::fatal(
                super::profiles::COMPILATION_FAILED,
                "Semantic window checkpoint model fingerprint changed",
            ));
        }
        for c in answer::parse(text, &p.canonical, &p.units, w).map_err(|e| {
            JobError::fatal(
                super::profiles::COMPILATION_FAILED,
                format!("window {}: {e}", w.id),
            )
        })? {
            out.push((i, c, completion.clone()));
        }
    }
    Ok(out)
}
