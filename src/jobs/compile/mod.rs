//! document.compile: a document version becomes an outline, knowledge nodes and a full-text
//! projection under the attempt's own publication generation, and is published by moving the
//! space's head. Invariant: each step does the work of exactly one checkpoint
//! ([`walk::next`]), commits it together with the checkpoint in the engine's fenced
//! transaction, and is idempotent when repeated; readers only ever see the generation a head
//! publishes, so a crashed, failed or superseded attempt leaves nothing served.
//!
//! The walk: `queued → parsed → outline_built → nodes_generated → projection_built →
//! smoke_eval_passed → published`.
//! - **parsed**: the bytes are read from the object store, checked against the document's
//!   SHA-256 (`hash_mismatch`) and parsed by MIME type or extension: text, Markdown, HTML
//!   (`unsupported_format`, `corrupt_document` otherwise). `document_assets.parser_status`
//!   becomes `parsed`, or `failed` when the attempt fails on the document's bytes.
//! - **outline_built**: the heading tree goes to `document_outlines`.
//! - **nodes_generated**: chunks of at most [`parse::MAX_CHUNK_CHARS`] characters, following
//!   sections and paragraphs, go to `knowledge_nodes`.
//! - **projection_built**: `to_tsvector('english', content)` per node goes to
//!   `index_projections`; the candidate publication (head members + this document) is created
//!   and bound to the attempt, once.
//! - **smoke_eval_passed**: every node is found by `plainto_tsquery` of a few of its own words
//!   (`smoke_eval_failed` with the numbers otherwise).
//! - **published**: compare-and-swap of the head from `base_head_revision` to the candidate; if
//!   the head moved, a new publication of the moved head's members plus this document, swapped
//!   against the new revision.
//!
//! No parse survives a step in memory: steps after `parsed` regenerate it from the hash-checked
//! bytes (parsing is deterministic and cheap), so any worker can run any step.
//!
//! Every step first checks that the attempt may still go on ([`walk::gate`]): a document or
//! space being deleted cancels it (`document_deleting`); a newer version of the document, an
//! active attempt for a newer version, or (at publish) a head serving a newer version or a
//! later attempt's generation of this version supersedes it: the attempt ends `superseded`,
//! its slot freed and its outbox row canceled.

pub mod cli;
pub mod parse;
pub mod request;
mod steps;
pub mod walk;

use sqlx::PgConnection;

use super::{Deps, Handler, JobCtx, JobError, Kind, Step};
pub use request::{
    release, request, retry, search_published, show, wait, AttemptStatus, CompileError, Hit,
    RequestOptions,
};
use walk::{Checkpoint, Outcome};

pub struct CompileHandler {
    deps: Deps,
}

impl CompileHandler {
    pub fn new(deps: Deps) -> Result<Self, crate::config::ConfigError> {
        Ok(Self { deps })
    }
}

#[async_trait::async_trait]
impl Handler for CompileHandler {
    fn kind(&self) -> Kind {
        Kind::Compile
    }

    async fn on_fail(
        &self,
        tx: &mut PgConnection,
        job: &JobCtx,
        code: &str,
    ) -> Result<(), sqlx::Error> {
        if !matches!(
            code,
            "hash_mismatch" | "unsupported_format" | "corrupt_document" | "object_missing"
        ) {
            return Ok(());
        }
        // The document's own record says its bytes could not be parsed; scoped to the
        // attempt's tenant, space and version.
        sqlx::query(
            "UPDATE document_assets d SET parser_status = 'failed', updated_at = now() \
             FROM document_compilation_attempts a JOIN knowledge_spaces s \
               ON s.id = a.knowledge_space_id AND s.tenant_id = a.tenant_id \
             WHERE a.id = $1 AND d.knowledge_space_id = a.knowledge_space_id \
               AND d.id = a.document_asset_id AND d.version = a.document_version",
        )
        .bind(job.job_id)
        .execute(tx)
        .await?;
        Ok(())
    }

    async fn step(&self, tx: &mut PgConnection, job: &JobCtx) -> Result<Step, JobError> {
        let cp = Checkpoint::parse(&job.checkpoint).ok_or_else(|| {
            JobError::fatal(
                "bad_checkpoint",
                format!("unknown checkpoint {:?}", job.checkpoint),
            )
        })?;
        if cp == Checkpoint::Published {
            return Ok(Step::Succeed(cp.as_str().into()));
        }
        let attempt = steps::load_attempt(tx, job.job_id).await?;
        let doc = steps::load_document(tx, &attempt).await?;
        let newest = steps::newest_other_active(tx, &attempt).await?;
        if let Some(stopped) = steps::stop(walk::gate(&steps::facts(&attempt, &doc, newest, None)))
        {
            return stopped;
        }
        let store = &self.deps.store;
        match cp {
            Checkpoint::Queued => steps::parse_step(tx, store, &attempt, &doc).await?,
            Checkpoint::Parsed => steps::outline_step(tx, store, &attempt, &doc).await?,
            Checkpoint::OutlineBuilt => {
                steps::nodes_step(tx, store, &attempt, &doc).await?;
            }
            Checkpoint::NodesGenerated => steps::projection_step(tx, &attempt).await?,
            Checkpoint::ProjectionBuilt => steps::smoke_step(tx, &attempt).await?,
            Checkpoint::SmokeEvalPassed => {
                return steps::publish_step(tx, &attempt, &doc).await;
            }
            Checkpoint::Published => {}
        }
        Ok(match walk::outcome(cp) {
            Outcome::Advance(next) => Step::Advance(next.as_str().into()),
            Outcome::Succeed(last) => Step::Succeed(last.as_str().into()),
        })
    }
}
