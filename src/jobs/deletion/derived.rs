//! The derived-data parts that take more than one statement: research residue, historical
//! publications, traces with their evidence, and knowledge nodes with their graph rows and
//! projections. Invariant: each picks one page of ids under the job's tenant and space, then
//! deletes only rows reached from those ids, children before parents, so every foreign key holds
//! (RESTRICT ones included) and a repeated part finds what is left.

use sqlx::PgConnection;
use uuid::Uuid;

use super::sql::{self, in_space, scoped, with, OWNED};
use super::{DeletionConfig, JobRow};
use crate::jobs::JobError;

/// A page of research tasks of the space with their outbox, partial results and progress.
pub(super) async fn research(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
) -> Result<u64, JobError> {
    let w = with(job.scope);
    let jobs = sql::ids(
        tx,
        job,
        cfg.page_size,
        &format!(
            "{w} SELECT t.id FROM research_task_jobs t, p WHERE {} ORDER BY t.id LIMIT (SELECT lim FROM p) FOR UPDATE OF t",
            scoped("t")
        ),
    )
    .await?;
    if jobs.is_empty() {
        return Ok(0);
    }
    let mut n = 0;
    for sql in [
        format!(
            "{w} DELETE FROM research_task_outbox x USING p WHERE x.research_task_job_id = ANY($6) \
               AND EXISTS (SELECT 1 FROM research_task_jobs j WHERE j.id = x.research_task_job_id AND {})",
            scoped("j")
        ),
        format!("{w} DELETE FROM research_task_partial_results x USING p WHERE {} AND x.research_task_job_id = ANY($6)", scoped("x")),
        format!("{w} DELETE FROM research_task_progress_events x USING p WHERE {} AND x.research_task_job_id = ANY($6)", scoped("x")),
        format!("{w} DELETE FROM research_task_jobs x USING p WHERE {} AND x.id = ANY($6)", scoped("x")),
    ] {
        n += sql::run_ids(tx, job, cfg.page_size, &sql, &jobs).await?;
    }
    Ok(n)
}

/// Historical publications an active compile attempt (of another document) still has as its
/// candidate: it rebases onto the head when it publishes, and its old candidate becomes
/// deletable then.
const HELD: &str = "EXISTS (SELECT 1 FROM document_compilation_attempts a WHERE a.tenant_id = p.tenant \
    AND a.knowledge_space_id = p.space AND a.candidate_publication_id = t.id AND a.active_slot = 1)";

/// Whether historical publications of the target are left that active attempts hold.
pub(super) async fn historical_held(tx: &mut PgConnection, job: &JobRow) -> Result<bool, JobError> {
    sql::found(
        tx,
        job,
        &sql::exists(
            job.scope,
            "projection_set_publications",
            &format!("{} AND {HELD}", sql::historical_publication("t")),
        ),
    )
    .await
}

/// A page of historical publications of the target's documents (never the head's, never an
/// active attempt's candidate), with the finished compile attempts, bootstraps, page-index
/// backfills and profile bindings that reference them and their members.
pub(super) async fn historical(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
) -> Result<u64, JobError> {
    let w = with(job.scope);
    // The head is locked first, so it cannot come to point at a publication of the page.
    sqlx::query(
        "SELECT publication_id FROM projection_set_publication_heads \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 FOR UPDATE",
    )
    .bind(&job.tenant)
    .bind(job.space)
    .fetch_optional(&mut *tx)
    .await?;
    let page = sql::ids(
        tx,
        job,
        cfg.page_size,
        &format!(
            "{w} SELECT t.id FROM projection_set_publications t, p WHERE {} AND NOT {HELD} ORDER BY t.id \
               LIMIT (SELECT lim FROM p) FOR UPDATE OF t",
            sql::historical_publication("t")
        ),
    )
    .await?;
    if page.is_empty() {
        return Ok(0);
    }
    let mut n = 0;
    for sql in [
        format!(
            "{w} DELETE FROM document_compilation_attempts x USING p WHERE {} AND x.candidate_publication_id = ANY($6) \
               AND x.active_slot IS NULL",
            scoped("x")
        ),
        format!("{w} DELETE FROM legacy_space_publication_bootstraps x USING p WHERE {} AND x.published_publication_id = ANY($6)", scoped("x")),
        format!("{w} DELETE FROM page_index_upgrade_backfills x USING p WHERE {} AND x.publication_id = ANY($6)", scoped("x")),
        format!("{w} DELETE FROM projection_set_publication_members x USING p WHERE {} AND x.publication_id = ANY($6)", scoped("x")),
        // The profile bindings of the page's publications go first (their key is RESTRICT).
        format!("{w} DELETE FROM knowledge_space_profile_publication_bindings x USING p WHERE {} AND x.publication_id = ANY($6)", scoped("x")),
        format!(
            "{w} DELETE FROM projection_set_publications x USING p WHERE {} AND x.id = ANY($6) \
               AND NOT EXISTS (SELECT 1 FROM projection_set_publication_heads h WHERE h.tenant_id = p.tenant \
                 AND h.knowledge_space_id = p.space AND h.publication_id = x.id)",
            scoped("x")
        ),
    ] {
        n += sql::run_ids(tx, job, cfg.page_size, &sql, &page).await?;
    }
    Ok(n)
}

/// A page of answer traces citing the target (every trace of a space), with their failed
/// queries, steps and the evidence bundles they own.
pub(super) async fn traces(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
) -> Result<u64, JobError> {
    let w = with(job.scope);
    let rows: Vec<(Uuid, Option<Uuid>)> = sqlx::query_as(&format!(
        "{w} SELECT t.id, t.evidence_bundle_id FROM answer_traces t, p WHERE {} AND t.id IN (SELECT id FROM ttr) \
           ORDER BY t.id LIMIT (SELECT lim FROM p) FOR UPDATE OF t",
        in_space("t")
    ))
    .bind(&job.tenant)
    .bind(job.space)
    .bind(job.target_id)
    .bind(cfg.page_size)
    .bind(job.id)
    .fetch_all(&mut *tx)
    .await?;
    if rows.is_empty() {
        return Ok(0);
    }
    let traces: Vec<Uuid> = rows.iter().map(|r| r.0).collect();
    let direct: Vec<Uuid> = rows.iter().filter_map(|r| r.1).collect();
    let bundles: Vec<Uuid> = sqlx::query_scalar(&format!(
        "{w} SELECT b.id FROM evidence_bundles b, p WHERE {} AND (b.id = ANY($6) OR b.trace_id = ANY($7)) \
           ORDER BY b.id LIMIT (SELECT lim FROM p) + 1",
        scoped("b")
    ))
    .bind(&job.tenant)
    .bind(job.space)
    .bind(job.target_id)
    .bind(cfg.page_size)
    .bind(job.id)
    .bind(&direct)
    .bind(&traces)
    .fetch_all(&mut *tx)
    .await?;
    if bundles.len() as i64 > cfg.page_size {
        return Err(JobError::retryable(
            "evidence_page_overflow",
            "the traces of one page own more evidence bundles than a page holds",
        ));
    }
    let mut n = 0;
    for sql in [
        format!("{w} DELETE FROM failed_queries x USING p WHERE {} AND x.answer_trace_id = ANY($6)", in_space("x")),
        format!(
            "{w} DELETE FROM answer_trace_steps x USING p WHERE x.trace_id = ANY($6) \
               AND EXISTS (SELECT 1 FROM answer_traces t WHERE t.id = x.trace_id AND t.knowledge_space_id = p.space AND {OWNED})"
        ),
        format!("{w} DELETE FROM answer_traces x USING p WHERE {} AND x.id = ANY($6)", in_space("x")),
    ] {
        n += sql::run_ids(tx, job, cfg.page_size, &sql, &traces).await?;
    }
    sqlx::query(&format!(
        "{w} UPDATE evidence_bundles x SET trace_id = NULL FROM p WHERE {} AND x.id = ANY($6) AND x.trace_id = ANY($7)",
        scoped("x")
    ))
    .bind(&job.tenant)
    .bind(job.space)
    .bind(job.target_id)
    .bind(cfg.page_size)
    .bind(job.id)
    .bind(&bundles)
    .bind(&traces)
    .execute(&mut *tx)
    .await?;
    n += sql::run_ids(
        tx,
        job,
        cfg.page_size,
        &format!(
            "{w} DELETE FROM evidence_bundles x USING p WHERE {} AND x.id = ANY($6) \
               AND NOT EXISTS (SELECT 1 FROM answer_traces t WHERE t.evidence_bundle_id = x.id)",
            scoped("x")
        ),
        &bundles,
    )
    .await?;
    Ok(n)
}

/// A page of the target documents' knowledge nodes: first the graph rows built from them (in
/// every generation), then their projections (postings first), then the nodes.
pub(super) async fn nodes(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
) -> Result<u64, JobError> {
    let w = with(job.scope);
    let nodes = sql::ids(
        tx,
        job,
        cfg.page_size,
        &format!(
            "{w} SELECT t.id FROM knowledge_nodes t, p WHERE {} AND t.document_asset_id IN (SELECT id FROM td) \
               ORDER BY t.id LIMIT (SELECT lim FROM p)",
            in_space("t")
        ),
    )
    .await?;
    if nodes.is_empty() {
        return Ok(0);
    }
    const N: &str = "ARRAY(SELECT x::text FROM unnest($6::uuid[]) x)";
    let overlaps = |a: &str| {
        format!("(jsonb_typeof({a}.source_node_ids) = 'array' AND {a}.source_node_ids ?| {N})")
    };
    let mut n = 0;
    n += sql::run_ids(
        tx,
        job,
        cfg.page_size,
        &format!(
            "{w} DELETE FROM graph_relations r USING p WHERE {} AND ({} OR EXISTS (SELECT 1 FROM graph_entities e \
               WHERE e.knowledge_space_id = p.space \
                 AND e.publication_generation_id IS NOT DISTINCT FROM r.publication_generation_id \
                 AND e.id IN (r.subject_entity_id, r.object_entity_id) AND {}))",
            in_space("r"),
            overlaps("r"),
            overlaps("e")
        ),
        &nodes,
    )
    .await?;
    n += sql::run_ids(
        tx,
        job,
        cfg.page_size,
        &format!(
            "{w} DELETE FROM graph_entities e USING p WHERE {} AND {}",
            in_space("e"),
            overlaps("e")
        ),
        &nodes,
    )
    .await?;
    let projections = sql::ids(
        tx,
        job,
        cfg.page_size,
        &format!(
            "{w} SELECT t.id FROM index_projections t, p WHERE {} AND t.node_id IN ( \
               SELECT n.id FROM knowledge_nodes n WHERE n.knowledge_space_id = p.space \
                 AND n.document_asset_id IN (SELECT id FROM td) ORDER BY n.id LIMIT (SELECT lim FROM p)) \
             ORDER BY t.id LIMIT (SELECT lim FROM p)",
            in_space("t")
        ),
    )
    .await?;
    if !projections.is_empty() {
        let postings = sql::run_ids(
            tx,
            job,
            cfg.page_size,
            &format!(
                "{w} DELETE FROM index_projection_fts_postings x WHERE x.ctid = ANY(ARRAY( \
                   SELECT t.ctid FROM index_projection_fts_postings t, p WHERE {} AND t.projection_id = ANY($6) \
                   LIMIT (SELECT lim FROM p)))",
                in_space("t")
            ),
            &projections,
        )
        .await?;
        if postings > 0 {
            return Ok(n + postings);
        }
        return Ok(n + sql::run_ids(
            tx,
            job,
            cfg.page_size,
            &format!(
                "{w} DELETE FROM index_projections x USING p WHERE {} AND x.id = ANY($6)",
                in_space("x")
            ),
            &projections,
        )
        .await?);
    }
    let still_referenced: bool = sqlx::query_scalar(&format!(
        "{w} SELECT EXISTS (SELECT 1 FROM graph_entities e, p WHERE {} AND {}) \
           OR EXISTS (SELECT 1 FROM graph_relations r, p WHERE {} AND {})",
        in_space("e"),
        overlaps("e"),
        in_space("r"),
        overlaps("r")
    ))
    .bind(&job.tenant)
    .bind(job.space)
    .bind(job.target_id)
    .bind(cfg.page_size)
    .bind(job.id)
    .bind(&nodes)
    .fetch_one(&mut *tx)
    .await?;
    if still_referenced {
        return Err(JobError::retryable(
            "graph_still_references_nodes",
            "graph rows still reference knowledge nodes of the target",
        ));
    }
    Ok(n + sql::run_ids(
        tx,
        job,
        cfg.page_size,
        &format!(
            "{w} DELETE FROM knowledge_nodes x USING p WHERE {} AND x.id = ANY($6)",
            in_space("x")
        ),
        &nodes,
    )
    .await?)
}
