//! document.compile: a document version becomes the platform's compiled read model — its parse
//! artifact, outline, page index, knowledge paths, multimodal manifest, knowledge nodes and index
//! projections under the attempt's own publication generation — and is published by moving the
//! space's head to a publication whose members include it. Invariant: each step does the work of
//! exactly one checkpoint ([`walk::next`]), commits it together with the checkpoint in the
//! engine's fenced transaction, and is idempotent when repeated (deterministic ids, `ON CONFLICT
//! DO NOTHING`); readers only ever see what a head's publication lists, so a crashed, failed or
//! superseded attempt leaves nothing served.
//!
//! The walk: `queued → parsed → outline_built → nodes_generated → projection_built →
//! smoke_eval_passed → published`.
//! - **parsed**: the bytes are read from the object store, checked against the document's
//!   SHA-256 (`hash_mismatch`) and parsed by MIME type or extension: Markdown and plain text with
//!   the Markdown parser, HTML (`unsupported_format`, `corrupt_document` otherwise); the elements
//!   go to `parse_artifacts`.
//! - **outline_built**: `document_outlines`, the page index (`page_index_manifests`, `_nodes`,
//!   `_terms`, status `building`), `knowledge_paths` and `document_multimodal_manifests`.
//! - **nodes_generated**: `knowledge_nodes` from the platform's chunker, an `fts` projection of
//!   each (`to_tsvector('simple', …)` of its normalised path and text), and a `dense-vector`
//!   projection of each where the attempt froze an embedding profile, through the
//!   [`crate::embed`] port; all `building`.
//! - **projection_built**: a `candidate` publication (the platform's fingerprint) of this
//!   document's components only (owner-only: the head's other documents are added when it
//!   publishes), bound to the attempt.
//! - **smoke_eval_passed**: the platform's structural check of the candidate.
//! - **published**: in one transaction, the profile fence, projections and page index `ready`,
//!   the document `parsed`, the candidate (completed over the head) `validating` then
//!   `published`, the old head's publication `superseded`, the publication's profile binding,
//!   the head moved by compare-and-swap, then the attempt's logical-document intents applied;
//!   the same head move publishes the space's other attempts parked at `smoke_eval_passed`
//!   (see [`publish`]).
//!
//! A model-driven attempt (its frozen retrieval profile selects a reasoning model and the process
//! has one) does the same walk with the platform's semantic chunking, generation receipt,
//! outline summaries and graph: see [`semantic`].
//!
//! Every step first re-checks the authority the attempt was requested under when it is a
//! capability grant ([`crate::capability::check`], share-locking the grant and the space's
//! fence): a revoked grant or a fenced space fails the attempt closed as the platform does
//! (`DOCUMENT_COMPILATION_FAILED`, "Capability publication is fenced", not retried, nothing else
//! written); a permission snapshot is revalidated at publish. Then it checks that the attempt
//! may still go on ([`walk::gate`]): a document or space being deleted cancels it
//! (`document_deleting`); a newer version of the document, an active attempt for a newer
//! version, or (at publish) a head serving a newer version or a later attempt's generation of
//! this version supersedes it: the attempt ends `superseded`, its slot freed, its outbox row
//! canceled and its candidate `inactive`. The first step also fails an attempt whose logical
//! document is disabled (`DOCUMENT_DISABLED`, [`intents`]) and makes sure the attempt has a
//! frozen profile tuple ([`profiles`]); the later ones build with its frozen embedding profile,
//! and the publish fences the tuple against the space's profile heads, binds the publication to
//! it and applies the attempt's logical-document intents.

pub mod artifact;
pub(crate) mod build;
pub mod candidate;
pub mod checkpoint;
pub mod chunk;
pub mod cli;
pub(crate) mod compose;
pub mod element;
pub(crate) mod frozen;
pub mod intents;
pub mod media;
pub mod multimodal;
pub mod operate;
pub mod outline;
pub mod page_index;
pub mod parse;
pub mod paths;
pub mod profiles;
pub(crate) mod publish;
pub mod request;
pub mod semantic;
pub(crate) mod steps;
pub mod walk;

use std::time::Duration;

use sqlx::PgConnection;

use super::{
    Clock, Deps, Handler, JobCtx, JobError, Kind, KindSpec, Policy, RetryPolicy, States, Step,
};
pub use compose::{MEMBER_SNAPSHOTS_SQL, OWNER_ONLY_KEY};
pub use publish::SMOKE_COUNTS_SQL;
pub use request::{
    release, request, retry, search_published, show, wait, AttemptStatus, CompileError, Hit,
    RequestOptions, Requester,
};
use walk::{Checkpoint, Outcome};

/// The message of an attempt failed because its capability grant no longer authorizes it (the
/// platform's `CapabilityPublicationFencedError`).
pub const CAPABILITY_FENCED: &str = "Capability publication is fenced";

/// A failed attempt's record on the kind's own rows (see [`crate::jobs::failed`]): its candidate
/// publication is given up, and a document whose bytes could not be parsed says so. An attempt
/// failed `DOCUMENT_COMPILATION_FAILED` (a capability or profile fence, a logical-document
/// conflict at publish) keeps its candidate a candidate, as the platform leaves it.
pub(crate) async fn record_failure(
    tx: &mut PgConnection,
    job: &JobCtx,
    code: &str,
) -> Result<(), sqlx::Error> {
    if code != profiles::COMPILATION_FAILED {
        publish::deactivate(tx, job.job_id).await?;
    }
    if !matches!(
        code,
        "hash_mismatch"
            | "unsupported_format"
            | "corrupt_document"
            | "object_missing"
            | parse::route::INPUT_INVALID
            | parse::route::UNSUPPORTED_TYPE
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
        KIND
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
        let mut attempt = steps::load_attempt(tx, job.job_id).await?;
        if let Some(grant) = attempt.authority.grant() {
            let verdict =
                crate::capability::check(tx, &attempt.tenant, attempt.space, grant).await?;
            if let Err(why) = verdict.into_result() {
                tracing::debug!(attempt = %attempt.id, %grant, why, "capability grant no longer authorizes");
                return Err(JobError::fatal(
                    profiles::COMPILATION_FAILED,
                    CAPABILITY_FENCED,
                ));
            }
        }
        let doc = steps::load_document(tx, &attempt).await?;
        let newest = steps::newest_other_active(tx, &attempt).await?;
        if let Some(stopped) = steps::stop(walk::gate(&steps::facts(&attempt, &doc, newest, None)))
        {
            publish::deactivate(tx, attempt.id).await?;
            return stopped;
        }
        if cp == Checkpoint::Queued {
            intents::refuse_disabled(tx, &attempt).await?;
            frozen::ensure_ready(tx, &mut attempt).await?;
        } else {
            attempt.embedding = frozen::frozen_embedding(tx, &attempt).await?;
        }
        let store = &self.deps.store;
        match cp {
            Checkpoint::Queued => {
                steps::parse_step(tx, store, &self.deps.parsers, &attempt, &doc).await?;
            }
            Checkpoint::Parsed => {
                let sel = semantic::selection(tx, &self.deps.models, &attempt).await?;
                build::outline_step(tx, &attempt, &doc, sel.as_ref()).await?;
            }
            Checkpoint::OutlineBuilt => {
                let embedder = self.deps.embedder.as_ref();
                match semantic::selection(tx, &self.deps.models, &attempt).await? {
                    Some(sel) => {
                        semantic::step::nodes_step(tx, embedder, &attempt, &doc, &sel).await?;
                    }
                    None => {
                        build::nodes_step(tx, embedder, &attempt, &doc).await?;
                    }
                }
            }
            Checkpoint::NodesGenerated => {
                if let Some(stopped) = compose::candidate_step(tx, &attempt).await? {
                    return Ok(stopped);
                }
            }
            Checkpoint::ProjectionBuilt => publish::smoke_step(tx, &attempt).await?,
            Checkpoint::SmokeEvalPassed => {
                return publish::publish_step(tx, &attempt, &doc).await;
            }
            Checkpoint::Published => {}
        }
        Ok(match walk::outcome(cp) {
            Outcome::Advance(next) => Step::Advance(next.as_str().into()),
            Outcome::Succeed(last) => Step::Succeed(last.as_str().into()),
        })
    }

    /// A PDF or office document is parsed (or its raw-parse checkpoint found) before the
    /// first step, outside its transaction: a remote parse may take many minutes.
    ///
    /// Before `parsed → outline_built` and `outline_built → nodes_generated` of a model-driven
    /// attempt, the model's work ([`semantic::prepare`]): only where the process has a reasoning
    /// model.
    async fn prepare(&self, conn: &mut PgConnection, job: &JobCtx) -> Result<(), JobError> {
        if job.checkpoint == Checkpoint::Queued.as_str() {
            return steps::prepare_parse(conn, &self.deps.store, &self.deps.parsers, job).await;
        }
        semantic::prepare(conn, &self.deps.models, job)
            .await
            .map(|_| ())
    }

    fn prepares(&self, job: &JobCtx) -> bool {
        job.checkpoint == Checkpoint::Queued.as_str()
            || (self.deps.models.reasoner().is_some()
                && (job.checkpoint == Checkpoint::Parsed.as_str()
                    || job.checkpoint == Checkpoint::OutlineBuilt.as_str()))
    }
}

// ---------------------------------------------------------------------------------------------
// Registration: this kind's identity, tables, policy and handler (one line in `jobs::registry`).
// ---------------------------------------------------------------------------------------------

pub const KIND: Kind = Kind::new("compile");

pub static COMPILE: KindSpec = KindSpec {
    kind: KIND,
    event_type: "document.compile",
    job_table: "document_compilation_attempts",
    outbox_table: "document_compilation_outbox",
    outbox_fk: "attempt_id",
    payload_id_field: "attemptId",
    clock: Clock::Timestamptz,
    states: States::RunState {
        failed_keeps_slot: false,
    },
    superseded_state: true,
    generic_plans: false,
    fairness: Some(super::FRESH_RUN_STATE),
    revisions: false,
    max_connections: Some(super::PLATFORM_KIND_CONNECTIONS),
    policy: Policy {
        lease: Duration::from_secs(60),
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
    spec: &COMPILE,
    default: true,
    handler: |deps| Ok(std::sync::Arc::new(CompileHandler::new(deps.clone())?)),
};

fn record_failure_boxed<'a>(
    tx: &'a mut PgConnection,
    job: &'a JobCtx,
    code: &'a str,
) -> futures_util::future::BoxFuture<'a, Result<(), sqlx::Error>> {
    Box::pin(record_failure(tx, job, code))
}
