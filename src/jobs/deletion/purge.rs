//! `deleting_derived_data` and `deleting_primary_data`: bounded page deletes, then the residue
//! check and the target row, in the completing transaction. Invariant: every statement names the
//! job's tenant and space (the `p` parameters below), deletes at most one page, and each step
//! runs statements in a fixed order until one of them changes a row, so a step never holds more
//! than one page; a document row is deleted only once its inventoried objects and cache key are
//! erased ("covered"), so no object is orphaned; completion happens only when nothing of the
//! target is left, else the job goes back to `quiescing`.

use std::collections::HashSet;

use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use super::request::sha256_hex;

use super::walk::Event;
use super::{invalidation_reason, object_prefix, DeletionConfig, JobRow, Scope};
use crate::jobs::JobError;
use crate::publication;

/// The parameters of every statement: `$1` tenant, `$2` space, `$3` target id, `$4` page size,
/// `$5` job id, `$6` invalidation reason.
const P: &str = "WITH p AS (SELECT $1::varchar AS tenant, $2::uuid AS space, $3::uuid AS target, \
                   $4::bigint AS lim, $5::uuid AS job, $6::text AS reason)";

/// `k` names the tenant of a table without a tenant column, through its space.
fn tenant_of(alias: &str) -> String {
    format!(
        "EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = {alias}.knowledge_space_id AND k.tenant_id = p.tenant)"
    )
}

/// A page delete on a table with `id`, `tenant_id` and `knowledge_space_id`.
fn page_delete(table: &str, filter: &str) -> String {
    format!(
        "{P}, victims AS (SELECT t.id FROM {table} t, p WHERE t.tenant_id = p.tenant AND t.knowledge_space_id = p.space \
           AND ({filter}) LIMIT (SELECT lim FROM p)) \
         DELETE FROM {table} x USING p WHERE x.tenant_id = p.tenant AND x.knowledge_space_id = p.space \
           AND x.id IN (SELECT id FROM victims)"
    )
}

/// A page delete on a table with `id` and `knowledge_space_id` but no tenant column.
fn page_delete_untenanted(table: &str, filter: &str) -> String {
    format!(
        "{P}, victims AS (SELECT t.id FROM {table} t, p WHERE t.knowledge_space_id = p.space AND {} \
           AND ({filter}) LIMIT (SELECT lim FROM p)) \
         DELETE FROM {table} x USING p WHERE x.knowledge_space_id = p.space AND {} \
           AND x.id IN (SELECT id FROM victims)",
        tenant_of("t"),
        tenant_of("x")
    )
}

/// Per-document derived tables, children first.
const DOCUMENT_DERIVED: [&str; 7] = [
    "index_projections",
    "knowledge_nodes",
    "document_outlines",
    "document_multimodal_manifests",
    "page_index_manifests",
    "knowledge_paths",
    "document_compilation_attempts",
];

/// Space-wide derived tables (no document column), children first.
const SPACE_DERIVED: [&str; 7] = [
    "graph_relations",
    "graph_entities",
    "evidence_bundles",
    "research_task_progress_events",
    "research_task_partial_results",
    "research_task_jobs",
    "agent_workspace_snapshots",
];

/// Which rows of a per-document table (alias `t`) belong to the target.
fn document_filter(scope: Scope) -> Option<&'static str> {
    match scope {
        Scope::Space => Some("TRUE"),
        Scope::Document(_) => Some("t.document_asset_id = p.target"),
        Scope::SourceCascade(_) => Some(
            "t.document_asset_id IN (SELECT d.id FROM document_assets d \
               WHERE d.knowledge_space_id = p.space AND d.source_id = p.target)",
        ),
        Scope::SourceKeep(_) => None,
    }
}

fn derived_statements(scope: Scope) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(filter) = document_filter(scope) {
        for t in DOCUMENT_DERIVED {
            out.push(page_delete(t, filter));
        }
    }
    match scope {
        Scope::Space => {
            for t in SPACE_DERIVED {
                out.push(page_delete(t, "TRUE"));
            }
            out.push(page_delete_untenanted("answer_traces", "TRUE"));
        }
        _ => {
            // Workspaces this job invalidated cannot be attributed, so they go too.
            out.push(page_delete(
                "agent_workspace_snapshots",
                "t.invalidation_reason = p.reason",
            ));
        }
    }
    out
}

/// A document (alias `d`) is covered when its cache key and the object its row names now were
/// erased by this job (or the object lies outside the space's prefix and is not ours to erase).
fn covered(d: &str) -> String {
    format!(
        "(EXISTS (SELECT 1 FROM deletion_job_items i WHERE i.deletion_job_id = p.job AND i.kind = 'cache_key' \
            AND i.resource_id = {d}.id AND i.status = 'completed') \
          AND (left({d}.object_key, length('spaces/' || p.space::text || '/')) <> 'spaces/' || p.space::text || '/' \
            OR EXISTS (SELECT 1 FROM deletion_job_items i WHERE i.deletion_job_id = p.job AND i.kind = 'object' \
              AND i.resource_id = {d}.id AND i.status = 'completed' \
              AND i.payload_digest = encode(sha256(convert_to({d}.object_key, 'UTF8')), 'hex'))))"
    )
}

/// A source (alias `s`) is covered when it has no credential reference or this job erased it.
fn source_covered(s: &str) -> String {
    format!(
        "({s}.credential_ref IS NULL OR EXISTS (SELECT 1 FROM deletion_job_items i WHERE i.deletion_job_id = p.job \
           AND i.kind = 'secret_ref' AND i.resource_id = {s}.id AND i.status = 'completed' \
           AND i.payload_digest = encode(sha256(convert_to({s}.credential_ref, 'UTF8')), 'hex')))"
    )
}

fn primary_statements(scope: Scope) -> Vec<String> {
    let mut out = Vec::new();
    match scope {
        Scope::Space => {
            for t in [
                "knowledge_space_profile_heads",
                "knowledge_space_profile_backfills",
                "knowledge_space_profile_revisions",
                "legacy_space_publication_bootstraps",
                "projection_set_publication_heads",
                "projection_set_publications",
                "knowledge_space_manifests",
                "retrieval_execution_leases",
                "knowledge_space_mutation_leases",
            ] {
                out.push(page_delete(t, "TRUE"));
            }
            out.push(page_delete_untenanted("sources", &source_covered("t")));
        }
        Scope::SourceCascade(_) => {
            out.push(complete_document_items("document_cascade", "TRUE"));
        }
        Scope::SourceKeep(_) => {
            out.push(format!(
                "{P}, victims AS (SELECT d.id FROM deletion_job_items i JOIN document_assets d ON d.id = i.resource_id, p \
                   WHERE i.deletion_job_id = p.job AND i.kind = 'document_detach' AND i.status = 'pending' \
                     AND d.knowledge_space_id = p.space AND d.source_id = p.target AND {} LIMIT (SELECT lim FROM p)) \
                 UPDATE document_assets x SET source_id = NULL, row_version = x.row_version + 1, updated_at = now() \
                 FROM p WHERE x.knowledge_space_id = p.space AND x.source_id = p.target AND {} \
                   AND x.id IN (SELECT id FROM victims)",
                tenant_of("d"),
                tenant_of("x")
            ));
            out.push(complete_document_items(
                "document_detach",
                "d.source_id = p.target",
            ));
        }
        Scope::Document(_) => {}
    }
    out
}

/// Completes a page of pending document items whose document is gone, or (`still`) no longer
/// in the state the item changes.
fn complete_document_items(kind: &str, still: &str) -> String {
    format!(
        "{P}, done AS (SELECT i.id FROM deletion_job_items i, p WHERE i.deletion_job_id = p.job AND i.kind = '{kind}' \
           AND i.status = 'pending' AND NOT EXISTS (SELECT 1 FROM document_assets d WHERE d.id = i.resource_id \
             AND d.knowledge_space_id = p.space AND {} AND {still}) \
           LIMIT (SELECT lim FROM p)) \
         UPDATE deletion_job_items x SET status = 'completed', completed_at = now(), \
           attempts = least(x.attempts + 1, x.max_attempts), row_version = x.row_version + 1, updated_at = now() \
         FROM p WHERE x.deletion_job_id = p.job AND x.id IN (SELECT id FROM done)",
        tenant_of("d")
    )
}

/// Deletes one page of covered documents of a space or cascaded source. The page is chosen by
/// key and coverage is decided here from the job's completed items (index lookups by id), so the
/// cost of a page does not depend on the planner's statistics of freshly filled tables.
/// Uncovered documents are left for the residue check.
async fn delete_covered_documents(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
) -> Result<u64, JobError> {
    let candidates: Vec<(Uuid, String)> = match job.scope {
        Scope::Space => {
            sqlx::query_as(
                "SELECT d.id, d.object_key FROM document_assets d \
                 WHERE d.knowledge_space_id = $2 \
                   AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = d.knowledge_space_id AND k.tenant_id = $1) \
                 ORDER BY d.id LIMIT $3",
            )
            .bind(&job.tenant)
            .bind(job.space)
            .bind(cfg.page_size)
            .fetch_all(&mut *tx)
            .await?
        }
        Scope::SourceCascade(_) => {
            let ids: Vec<Uuid> = sqlx::query_scalar(
                "SELECT resource_id FROM deletion_job_items \
                 WHERE deletion_job_id = $1 AND kind = 'document_cascade' AND status = 'pending' \
                 ORDER BY resource_id LIMIT $2",
            )
            .bind(job.id)
            .bind(cfg.page_size)
            .fetch_all(&mut *tx)
            .await?;
            sqlx::query_as(
                "SELECT d.id, d.object_key FROM document_assets d \
                 WHERE d.knowledge_space_id = $2 AND d.id = ANY($3) \
                   AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = d.knowledge_space_id AND k.tenant_id = $1)",
            )
            .bind(&job.tenant)
            .bind(job.space)
            .bind(&ids)
            .fetch_all(&mut *tx)
            .await?
        }
        Scope::Document(_) | Scope::SourceKeep(_) => return Ok(0),
    };
    if candidates.is_empty() {
        return Ok(0);
    }
    let ids: Vec<Uuid> = candidates.iter().map(|c| c.0).collect();
    let done: Vec<(Uuid, String, String)> = sqlx::query_as(
        "SELECT resource_id, kind, payload_digest::text FROM deletion_job_items \
         WHERE deletion_job_id = $1 AND kind IN ('cache_key', 'object') AND status = 'completed' \
           AND resource_id = ANY($2)",
    )
    .bind(job.id)
    .bind(&ids)
    .fetch_all(&mut *tx)
    .await?;
    let erased: HashSet<(Uuid, &str, &str)> = done
        .iter()
        .map(|(r, k, d)| (*r, k.as_str(), d.as_str()))
        .collect();
    let prefix = object_prefix(job.space);
    let covered: Vec<Uuid> = candidates
        .iter()
        .filter(|(doc, key)| {
            let cache = done.iter().any(|(r, k, _)| r == doc && k == "cache_key");
            let object = !key.starts_with(&prefix)
                || erased.contains(&(*doc, "object", sha256_hex(key).as_str()));
            cache && object
        })
        .map(|c| c.0)
        .collect();
    if covered.is_empty() {
        return Ok(0);
    }
    let n = sqlx::query(
        "DELETE FROM document_assets d WHERE d.knowledge_space_id = $2 AND d.id = ANY($3) \
           AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = d.knowledge_space_id AND k.tenant_id = $1)",
    )
    .bind(&job.tenant)
    .bind(job.space)
    .bind(&covered)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    Ok(n)
}

/// Runs `statements` in order until one changes rows. `true`: a page was done.
async fn one_page(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
    statements: &[String],
) -> Result<bool, JobError> {
    let reason = invalidation_reason(job.id);
    for sql in statements {
        let n = sqlx::query(sql)
            .bind(&job.tenant)
            .bind(job.space)
            .bind(job.target_id)
            .bind(cfg.page_size)
            .bind(job.id)
            .bind(&reason)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if n > 0 {
            return Ok(true);
        }
    }
    Ok(false)
}

pub(super) async fn derived_step(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
) -> Result<Event, JobError> {
    Ok(
        if one_page(tx, job, cfg, &derived_statements(job.scope)).await? {
            Event::PageDone
        } else {
            Event::PhaseDone
        },
    )
}

pub(super) async fn primary_step(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
) -> Result<Event, JobError> {
    if delete_covered_documents(tx, job, cfg).await? > 0 {
        return Ok(Event::PageDone);
    }
    if one_page(tx, job, cfg, &primary_statements(job.scope)).await? {
        return Ok(Event::PageDone);
    }
    if let Some(what) = residue(tx, job).await? {
        return Ok(Event::ResidueFound { what });
    }
    // The target row itself, in a savepoint: a row that appeared since the residue check and
    // still references it sends the job back to quiescing instead of failing it.
    let mut sp = tx.begin().await?;
    match delete_target(&mut sp, job).await {
        Ok(()) => sp.commit().await?,
        Err(sqlx::Error::Database(d)) if d.code().as_deref() == Some("23503") => {
            let what = format!(
                "rows still reference the target ({})",
                d.constraint().unwrap_or("a foreign key")
            );
            sp.rollback().await?;
            return Ok(Event::ResidueFound { what });
        }
        Err(e) => return Err(e.into()),
    }
    let n = sqlx::query(
        "UPDATE deletion_tombstones SET state = 'completed', completed_at = now(), row_version = row_version + 1 \
         WHERE deletion_job_id = $1 AND tenant_id = $2 AND knowledge_space_id = $3 AND state = 'active'",
    )
    .bind(job.id)
    .bind(&job.tenant)
    .bind(job.space)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if n != 1 {
        return Err(JobError::fatal(
            "tombstone_missing",
            "the job's active tombstone is missing",
        ));
    }
    Ok(Event::Clean)
}

/// Anything of the target left? Returns what, first found.
async fn residue(tx: &mut PgConnection, job: &JobRow) -> Result<Option<String>, JobError> {
    let mut checks: Vec<(String, String)> = vec![(
        "deletion items not completed".into(),
        "SELECT 1 FROM deletion_job_items i, p WHERE i.deletion_job_id = p.job AND i.status <> 'completed'".into(),
    )];
    let derived_rows = |filter: &str| -> Vec<(String, String)> {
        DOCUMENT_DERIVED
            .iter()
            .map(|t| {
                (
                    format!("{t} rows"),
                    format!(
                        "SELECT 1 FROM {t} t, p WHERE t.tenant_id = p.tenant AND t.knowledge_space_id = p.space AND ({filter})"
                    ),
                )
            })
            .collect()
    };
    match job.scope {
        Scope::Space => {
            checks.push((
                "documents".into(),
                format!("SELECT 1 FROM document_assets t, p WHERE t.knowledge_space_id = p.space AND {}", tenant_of("t")),
            ));
            checks.push((
                "sources".into(),
                format!(
                    "SELECT 1 FROM sources t, p WHERE t.knowledge_space_id = p.space AND {}",
                    tenant_of("t")
                ),
            ));
            checks.extend(derived_rows("TRUE"));
            for t in SPACE_DERIVED {
                checks.push((
                    format!("{t} rows"),
                    format!("SELECT 1 FROM {t} t, p WHERE t.tenant_id = p.tenant AND t.knowledge_space_id = p.space"),
                ));
            }
            checks.push((
                "answer_traces rows".into(),
                format!(
                    "SELECT 1 FROM answer_traces t, p WHERE t.knowledge_space_id = p.space AND {}",
                    tenant_of("t")
                ),
            ));
        }
        Scope::Document(_) => {
            checks.extend(derived_rows("t.document_asset_id = p.target"));
            checks.push((
                "the document's current objects are not erased".into(),
                format!(
                    "SELECT 1 FROM document_assets d, p WHERE d.id = p.target AND d.knowledge_space_id = p.space \
                       AND {} AND NOT {}",
                    tenant_of("d"),
                    covered("d")
                ),
            ));
        }
        Scope::SourceCascade(_) | Scope::SourceKeep(_) => {
            checks.push((
                "documents still attached to the source".into(),
                format!(
                    "SELECT 1 FROM document_assets t, p WHERE t.knowledge_space_id = p.space AND t.source_id = p.target AND {}",
                    tenant_of("t")
                ),
            ));
            checks.push((
                "the source's credential is not erased".into(),
                format!(
                    "SELECT 1 FROM sources s, p WHERE s.id = p.target AND s.knowledge_space_id = p.space AND {} AND NOT {}",
                    tenant_of("s"),
                    source_covered("s")
                ),
            ));
        }
    }
    let reason = invalidation_reason(job.id);
    for (what, sql) in checks {
        let found: bool = sqlx::query_scalar(&format!("{P} SELECT EXISTS ({sql})"))
            .bind(&job.tenant)
            .bind(job.space)
            .bind(job.target_id)
            .bind(1_i64)
            .bind(job.id)
            .bind(&reason)
            .fetch_one(&mut *tx)
            .await?;
        if found {
            return Ok(Some(what));
        }
    }
    // The published head must not serve the target any more.
    if !matches!(job.scope, Scope::Space | Scope::SourceKeep(_)) {
        if let Some(head) = publication::head(tx, &job.tenant, job.space, false).await? {
            let served: bool = match job.scope {
                Scope::Document(doc) => head.members.contains_key(&doc),
                _ => {
                    let ids: Vec<uuid::Uuid> = sqlx::query_scalar(
                        "SELECT resource_id FROM deletion_job_items WHERE deletion_job_id = $1 AND kind = 'document_cascade'",
                    )
                    .bind(job.id)
                    .fetch_all(&mut *tx)
                    .await?;
                    ids.iter().any(|d| head.members.contains_key(d))
                }
            };
            if served {
                return Ok(Some("the published head still serves the target".into()));
            }
        }
    }
    Ok(None)
}

async fn delete_target(tx: &mut PgConnection, job: &JobRow) -> Result<(), sqlx::Error> {
    match job.scope {
        Scope::Space => {
            // Explicitly, in foreign-key order: snapshots are RESTRICT-referenced by traces and
            // research jobs (gone by now) and reference API keys with RESTRICT themselves.
            sqlx::query("DELETE FROM knowledge_space_permission_snapshots WHERE tenant_id = $1 AND knowledge_space_id = $2")
                .bind(&job.tenant)
                .bind(job.space)
                .execute(&mut *tx)
                .await?;
            sqlx::query("DELETE FROM knowledge_space_api_keys WHERE tenant_id = $1 AND knowledge_space_id = $2")
                .bind(&job.tenant)
                .bind(job.space)
                .execute(&mut *tx)
                .await?;
            sqlx::query("DELETE FROM knowledge_spaces WHERE tenant_id = $1 AND id = $2 AND deletion_job_id = $3")
                .bind(&job.tenant)
                .bind(job.space)
                .bind(job.id)
                .execute(&mut *tx)
                .await?;
        }
        Scope::SourceKeep(source) | Scope::SourceCascade(source) => {
            sqlx::query(
                "DELETE FROM sources s WHERE s.id = $3 AND s.knowledge_space_id = $2 AND s.deletion_job_id = $4 \
                   AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = s.knowledge_space_id AND k.tenant_id = $1)",
            )
            .bind(&job.tenant)
            .bind(job.space)
            .bind(source)
            .bind(job.id)
            .execute(&mut *tx)
            .await?;
        }
        Scope::Document(doc) => {
            sqlx::query(
                "DELETE FROM document_assets d WHERE d.id = $3 AND d.knowledge_space_id = $2 AND d.deletion_job_id = $4 \
                   AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = d.knowledge_space_id AND k.tenant_id = $1)",
            )
            .bind(&job.tenant)
            .bind(job.space)
            .bind(doc)
            .bind(job.id)
            .execute(&mut *tx)
            .await?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_statement_names_tenant_and_space() {
        let scopes = [
            Scope::Space,
            Scope::Document(uuid::Uuid::nil()),
            Scope::SourceKeep(uuid::Uuid::nil()),
            Scope::SourceCascade(uuid::Uuid::nil()),
        ];
        for scope in scopes {
            for sql in derived_statements(scope)
                .iter()
                .chain(primary_statements(scope).iter())
            {
                assert!(sql.contains("p.tenant"), "{scope:?}: {sql}");
                assert!(sql.contains("p.space"), "{scope:?}: {sql}");
                assert!(
                    sql.contains("LIMIT (SELECT lim FROM p)"),
                    "{scope:?}: {sql}"
                );
            }
        }
        // Keep mode deletes no derived data of the documents it keeps.
        assert_eq!(
            derived_statements(Scope::SourceKeep(uuid::Uuid::nil())).len(),
            1
        );
    }
}
