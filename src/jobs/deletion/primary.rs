//! `deleting_primary_data` and completion. A space's logical-document rows, then a space's or a
//! cascaded source's document rows, go in bounded pages first (only rows nothing key-bearing
//! refers to any more, logical-document revisions included); then the completing transaction
//! locks the target row, runs the residue check and the object probe, deletes the primary rows
//! (the document; the source's documents and the source; a kept source's documents detached and
//! reactivated, then the source; the space's documents, sources, profiles, manifest and the space
//! row — a deleted document's logical-document rows before it, as the platform's primary phase
//! orders them) in a savepoint, probes again, and completes the tombstone. Invariant: anything
//! left of the target rolls the savepoint back and sends the job to `quiescing`; only a clean
//! check completes the job, in the same transaction as the check.

use sqlx::{Connection, PgConnection};

use super::ports::Ports;
use super::purge::SPACE_TABLES;
use super::walk::Event;
use super::{residue, DeletionConfig, JobRow, Scope};
use crate::jobs::JobError;

/// A document (`d`) nothing that names its objects or its derived rows refers to any more.
const UNREFERENCED: &str = "NOT EXISTS (SELECT 1 FROM parse_artifacts x WHERE x.document_asset_id = d.id) \
    AND NOT EXISTS (SELECT 1 FROM artifact_segments x WHERE x.document_asset_id = d.id) \
    AND NOT EXISTS (SELECT 1 FROM knowledge_space_staged_commits x WHERE x.document_asset_id = d.id) \
    AND NOT EXISTS (SELECT 1 FROM document_multimodal_manifests x WHERE x.document_asset_id = d.id) \
    AND NOT EXISTS (SELECT 1 FROM knowledge_nodes x WHERE x.document_asset_id = d.id) \
    AND NOT EXISTS (SELECT 1 FROM document_compilation_attempts x WHERE x.document_asset_id = d.id) \
    AND NOT EXISTS (SELECT 1 FROM document_revisions x WHERE x.tenant_id = $1 AND x.knowledge_space_id = $2 \
      AND x.document_asset_id = d.id)";

/// The logical-document rows of the assets `assets` (a predicate on a revision `r`, with `$1`
/// tenant, `$2` space, `$3` target, `$4` job) before those assets are deleted, in the platform's
/// order: a document whose active revision is of them loses it (and is `failed`); the reindex
/// attempts, chunk state changes and chunks of their revisions go; a document never published
/// whose every revision is one of theirs, a candidate or failed, goes with its settings; then
/// their revisions.
fn logical_cleanup(assets: &str) -> Vec<String> {
    let of = |t: &str, rev: &str| {
        format!(
            "EXISTS (SELECT 1 FROM document_revisions r WHERE r.tenant_id = {t}.tenant_id \
               AND r.knowledge_space_id = {t}.knowledge_space_id AND r.document_id = {t}.document_id \
               AND r.revision = {t}.{rev} AND {assets})"
        )
    };
    let doomed = format!(
        "l.tenant_id = $1 AND l.knowledge_space_id = $2 AND l.active_revision IS NULL AND l.status <> 'deleting' \
           AND EXISTS (SELECT 1 FROM document_revisions r WHERE r.tenant_id = l.tenant_id \
             AND r.knowledge_space_id = l.knowledge_space_id AND r.document_id = l.id AND {assets}) \
           AND NOT EXISTS (SELECT 1 FROM document_revisions r WHERE r.tenant_id = l.tenant_id \
             AND r.knowledge_space_id = l.knowledge_space_id AND r.document_id = l.id \
             AND (NOT ({assets}) OR r.state NOT IN ('candidate', 'failed')))"
    );
    vec![
        format!(
            "UPDATE logical_documents l SET active_revision = NULL, \
               status = CASE WHEN l.status = 'deleting' THEN l.status ELSE 'failed' END, updated_at = now() \
             WHERE l.tenant_id = $1 AND l.knowledge_space_id = $2 AND EXISTS (SELECT 1 FROM document_revisions r \
               WHERE r.tenant_id = l.tenant_id AND r.knowledge_space_id = l.knowledge_space_id \
                 AND r.document_id = l.id AND r.revision = l.active_revision AND {assets})"
        ),
        format!(
            "DELETE FROM document_reindex_attempts x WHERE x.tenant_id = $1 AND x.knowledge_space_id = $2 AND {}",
            of("x", "document_revision")
        ),
        format!(
            "DELETE FROM document_chunk_state_changes x WHERE x.tenant_id = $1 AND x.knowledge_space_id = $2 AND {}",
            of("x", "document_revision")
        ),
        format!(
            "DELETE FROM document_revision_chunks x WHERE x.tenant_id = $1 AND x.knowledge_space_id = $2 AND {}",
            of("x", "document_revision")
        ),
        format!(
            "DELETE FROM document_reindex_attempts x USING logical_documents l WHERE x.tenant_id = l.tenant_id \
               AND x.knowledge_space_id = l.knowledge_space_id AND x.document_id = l.id AND {doomed}"
        ),
        format!(
            "DELETE FROM document_settings_heads x USING logical_documents l WHERE x.tenant_id = l.tenant_id \
               AND x.knowledge_space_id = l.knowledge_space_id AND x.document_id = l.id AND {doomed}"
        ),
        format!(
            "DELETE FROM document_settings_revisions x USING logical_documents l WHERE x.tenant_id = l.tenant_id \
               AND x.knowledge_space_id = l.knowledge_space_id AND x.document_id = l.id AND {doomed}"
        ),
        format!("DELETE FROM logical_documents l WHERE {doomed}"),
        format!(
            "DELETE FROM document_revisions r WHERE r.tenant_id = $1 AND r.knowledge_space_id = $2 AND {assets}"
        ),
    ]
}

/// Every logical-document row of the space, before its documents go (the platform's
/// `cleanupLogicalDocumentAggregateRows` over the space).
const SPACE_LOGICAL: [&str; 8] = [
    "UPDATE logical_documents SET active_revision = NULL WHERE tenant_id = $1 AND knowledge_space_id = $2 \
       AND active_revision IS NOT NULL",
    "DELETE FROM document_reindex_attempts WHERE tenant_id = $1 AND knowledge_space_id = $2",
    "DELETE FROM document_chunk_state_changes WHERE tenant_id = $1 AND knowledge_space_id = $2",
    "DELETE FROM document_revision_chunks WHERE tenant_id = $1 AND knowledge_space_id = $2",
    "DELETE FROM document_settings_heads WHERE tenant_id = $1 AND knowledge_space_id = $2",
    "DELETE FROM document_settings_revisions WHERE tenant_id = $1 AND knowledge_space_id = $2",
    "DELETE FROM document_revisions WHERE tenant_id = $1 AND knowledge_space_id = $2",
    "DELETE FROM logical_documents WHERE tenant_id = $1 AND knowledge_space_id = $2",
];

pub(super) async fn step(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
    ports: &Ports,
) -> Result<Event, JobError> {
    if delete_logical_page(tx, job, cfg).await? > 0 || delete_document_page(tx, job, cfg).await? > 0
    {
        return Ok(Event::PageDone);
    }
    lock_target(tx, job).await?;
    if let Some(what) = residue::find(tx, job, ports).await? {
        return Ok(Event::ResidueFound { what });
    }
    let mut sp = tx.begin().await?;
    let dirty = match delete_primary(&mut sp, job).await {
        Ok(None) => None,
        Ok(Some(what)) => Some(what),
        Err(sqlx::Error::Database(d)) if d.code().as_deref() == Some("23503") => Some(format!(
            "rows still reference the target ({})",
            d.constraint().unwrap_or("a foreign key")
        )),
        Err(e) => return Err(e.into()),
    };
    if let Some(what) = dirty {
        sp.rollback().await?;
        return Ok(Event::ResidueFound { what });
    }
    sp.commit().await?;
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

/// A space's logical-document rows, children first, one bounded page per statement (`$1`
/// tenant, `$2` space, `$3` page size): active revisions unset, then chunks, chunk state
/// changes, reindex attempts, settings heads and revisions, revisions, documents.
const SPACE_LOGICAL_PAGES: [&str; 8] = [
    "UPDATE logical_documents SET active_revision = NULL, updated_at = now() WHERE id IN (SELECT id \
       FROM logical_documents WHERE tenant_id = $1 AND knowledge_space_id = $2 AND active_revision IS NOT NULL LIMIT $3)",
    "DELETE FROM document_revision_chunks WHERE id IN (SELECT id FROM document_revision_chunks \
       WHERE tenant_id = $1 AND knowledge_space_id = $2 LIMIT $3)",
    "DELETE FROM document_chunk_state_changes WHERE id IN (SELECT id FROM document_chunk_state_changes \
       WHERE tenant_id = $1 AND knowledge_space_id = $2 LIMIT $3)",
    "DELETE FROM document_reindex_attempts WHERE id IN (SELECT id FROM document_reindex_attempts \
       WHERE tenant_id = $1 AND knowledge_space_id = $2 LIMIT $3)",
    "DELETE FROM document_settings_heads WHERE tenant_id = $1 AND knowledge_space_id = $2 AND document_id IN \
       (SELECT document_id FROM document_settings_heads WHERE tenant_id = $1 AND knowledge_space_id = $2 LIMIT $3)",
    "DELETE FROM document_settings_revisions WHERE tenant_id = $1 AND knowledge_space_id = $2 \
       AND (document_id, revision) IN (SELECT document_id, revision FROM document_settings_revisions \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 LIMIT $3)",
    "DELETE FROM document_revisions WHERE tenant_id = $1 AND knowledge_space_id = $2 \
       AND (document_id, revision) IN (SELECT document_id, revision FROM document_revisions \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 LIMIT $3)",
    "DELETE FROM logical_documents WHERE id IN (SELECT id FROM logical_documents \
       WHERE tenant_id = $1 AND knowledge_space_id = $2 LIMIT $3)",
];

/// One page of a space's logical-document rows, before its documents go (a cascaded source's
/// and a document's go in the completing transaction, [`logical_cleanup`]).
async fn delete_logical_page(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
) -> Result<u64, JobError> {
    if !matches!(job.scope, Scope::Space) {
        return Ok(0);
    }
    for sql in SPACE_LOGICAL_PAGES {
        let n = sqlx::query(sql)
            .bind(&job.tenant)
            .bind(job.space)
            .bind(cfg.page_size)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if n > 0 {
            return Ok(n);
        }
    }
    Ok(0)
}

/// One page of a space's (or a cascaded source's) document rows that nothing refers to.
async fn delete_document_page(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
) -> Result<u64, JobError> {
    let filter = match job.scope {
        Scope::Space => "TRUE",
        Scope::SourceCascade(_) => {
            "d.source_id = $3 AND (d.deletion_job_id IS NULL OR d.deletion_job_id = $5)"
        }
        Scope::Document(_) | Scope::SourceKeep(_) => return Ok(0),
    };
    Ok(sqlx::query(&format!(
        "DELETE FROM document_assets x WHERE x.knowledge_space_id = $2 AND x.id IN ( \
           SELECT d.id FROM document_assets d WHERE d.knowledge_space_id = $2 AND {filter} \
             AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = $2 AND k.tenant_id = $1) \
             AND {UNREFERENCED} ORDER BY d.id LIMIT $4)"
    ))
    .bind(&job.tenant)
    .bind(job.space)
    .bind(job.target_id)
    .bind(cfg.page_size)
    .bind(job.id)
    .execute(&mut *tx)
    .await?
    .rows_affected())
}

/// Locks the target row; if it is still there it must be fenced by this job.
async fn lock_target(tx: &mut PgConnection, job: &JobRow) -> Result<(), JobError> {
    let sql = match job.scope {
        Scope::Space => {
            "SELECT deletion_job_id FROM knowledge_spaces WHERE tenant_id = $1 AND id = $2 AND $3::uuid = $2 FOR UPDATE"
        }
        Scope::SourceKeep(_) | Scope::SourceCascade(_) => {
            "SELECT s.deletion_job_id FROM sources s WHERE s.knowledge_space_id = $2 AND s.id = $3 \
               AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = $2 AND k.tenant_id = $1) FOR UPDATE OF s"
        }
        Scope::Document(_) => {
            "SELECT d.deletion_job_id FROM document_assets d WHERE d.knowledge_space_id = $2 AND d.id = $3 \
               AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = $2 AND k.tenant_id = $1) FOR UPDATE OF d"
        }
    };
    let fence: Option<Option<uuid::Uuid>> = sqlx::query_scalar(sql)
        .bind(&job.tenant)
        .bind(job.space)
        .bind(job.target_id)
        .fetch_optional(&mut *tx)
        .await?;
    match fence {
        Some(f) if f != Some(job.id) => Err(JobError::fatal(
            "target_fence_mismatch",
            "the target is not fenced by this deletion job",
        )),
        _ => Ok(()),
    }
}

async fn exec(tx: &mut PgConnection, job: &JobRow, sql: &str) -> Result<u64, sqlx::Error> {
    Ok(sqlx::query(sql)
        .bind(&job.tenant)
        .bind(job.space)
        .bind(job.target_id)
        .bind(job.id)
        .execute(&mut *tx)
        .await?
        .rows_affected())
}

async fn any(tx: &mut PgConnection, job: &JobRow, sql: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(&format!("SELECT EXISTS ({sql})"))
        .bind(&job.tenant)
        .bind(job.space)
        .bind(job.target_id)
        .bind(job.id)
        .fetch_one(&mut *tx)
        .await
}

/// The primary deletes of the completing transaction (`$1` tenant, `$2` space, `$3` target,
/// `$4` job). Returns what is still left, if anything.
async fn delete_primary(
    tx: &mut PgConnection,
    job: &JobRow,
) -> Result<Option<String>, sqlx::Error> {
    const OWNED: &str =
        "EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = $2 AND k.tenant_id = $1)";
    match job.scope {
        Scope::Document(_) => {
            for sql in logical_cleanup(
                "r.document_asset_id = $3 AND EXISTS (SELECT 1 FROM document_assets d WHERE d.id = $3 \
                   AND d.knowledge_space_id = $2 AND d.deletion_job_id = $4)",
            ) {
                exec(tx, job, &sql).await?;
            }
            exec(
                tx,
                job,
                &format!(
                    "DELETE FROM document_assets d WHERE d.id = $3 AND d.knowledge_space_id = $2 \
                       AND d.deletion_job_id = $4 AND {OWNED}"
                ),
            )
            .await?;
            if any(tx, job, "SELECT 1 FROM document_assets WHERE id = $3 AND knowledge_space_id = $2 AND $1::text IS NOT NULL AND $4::uuid IS NOT NULL").await? {
                return Ok(Some("the document row".into()));
            }
        }
        Scope::SourceKeep(_) | Scope::SourceCascade(_) => {
            if let Scope::SourceCascade(_) = job.scope {
                for sql in logical_cleanup(
                    "r.document_asset_id IN (SELECT d.id FROM document_assets d WHERE d.knowledge_space_id = $2 \
                       AND d.source_id = $3 AND (d.deletion_job_id IS NULL OR d.deletion_job_id = $4))",
                ) {
                    exec(tx, job, &sql).await?;
                }
                exec(
                    tx,
                    job,
                    &format!(
                        "DELETE FROM document_assets d WHERE d.knowledge_space_id = $2 AND d.source_id = $3 \
                           AND (d.deletion_job_id IS NULL OR d.deletion_job_id = $4) AND {OWNED}"
                    ),
                )
                .await?;
            } else {
                exec(
                    tx,
                    job,
                    &format!(
                        "UPDATE document_assets d SET source_id = NULL, lifecycle_state = 'active', deletion_job_id = NULL, \
                           deleting_at = NULL, row_version = d.row_version + 1, updated_at = now() \
                         WHERE d.knowledge_space_id = $2 AND d.source_id = $3 AND d.deletion_job_id = $4 AND {OWNED}"
                    ),
                )
                .await?;
                exec(
                    tx,
                    job,
                    &format!(
                        "UPDATE document_assets d SET source_id = NULL, row_version = d.row_version + 1, updated_at = now() \
                         WHERE d.knowledge_space_id = $2 AND d.source_id = $3 AND d.deletion_job_id IS NULL AND {OWNED} \
                           AND $4::uuid IS NOT NULL"
                    ),
                )
                .await?;
            }
            if any(
                tx,
                job,
                &format!("SELECT 1 FROM document_assets d WHERE d.knowledge_space_id = $2 AND d.source_id = $3 AND {OWNED} AND $4::uuid IS NOT NULL"),
            )
            .await?
            {
                return Ok(Some("documents still attached to the source".into()));
            }
            exec(
                tx,
                job,
                &format!(
                    "DELETE FROM sources s WHERE s.id = $3 AND s.knowledge_space_id = $2 AND s.deletion_job_id = $4 AND {OWNED}"
                ),
            )
            .await?;
            if any(tx, job, "SELECT 1 FROM sources WHERE id = $3 AND knowledge_space_id = $2 AND $1::text IS NOT NULL AND $4::uuid IS NOT NULL").await? {
                return Ok(Some("the source row".into()));
            }
        }
        Scope::Space => {
            for sql in SPACE_LOGICAL {
                exec(
                    tx,
                    job,
                    &format!("{sql} AND $3::uuid IS NOT NULL AND $4::uuid IS NOT NULL"),
                )
                .await?;
            }
            for sql in [
                format!("DELETE FROM document_assets WHERE knowledge_space_id = $2 AND {OWNED}"),
                format!("DELETE FROM sources WHERE knowledge_space_id = $2 AND {OWNED}"),
                "DELETE FROM knowledge_space_profile_backfills WHERE tenant_id = $1 AND knowledge_space_id = $2".into(),
                "DELETE FROM knowledge_space_profile_heads WHERE tenant_id = $1 AND knowledge_space_id = $2".into(),
                "DELETE FROM knowledge_space_profile_revisions WHERE tenant_id = $1 AND knowledge_space_id = $2".into(),
                "DELETE FROM knowledge_space_manifests WHERE tenant_id = $1 AND knowledge_space_id = $2".into(),
                "DELETE FROM knowledge_spaces WHERE tenant_id = $1 AND id = $2 AND id = $3 AND deletion_job_id = $4".into(),
            ] {
                exec(tx, job, &sql).await?;
            }
            if any(tx, job, "SELECT 1 FROM knowledge_spaces WHERE tenant_id = $1 AND id = $2 AND $3::uuid IS NOT NULL AND $4::uuid IS NOT NULL").await? {
                return Ok(Some("the space row".into()));
            }
            // Nothing of the space may outlive its row, whatever its foreign keys say.
            let primary: [(&str, bool); 14] = [
                ("logical_documents", true),
                ("document_revisions", true),
                ("document_revision_chunks", true),
                ("document_chunk_state_changes", true),
                ("document_reindex_attempts", true),
                ("document_settings_heads", true),
                ("document_settings_revisions", true),
                ("document_assets", false),
                ("sources", false),
                ("knowledge_space_manifests", true),
                ("knowledge_space_profile_backfills", true),
                ("knowledge_space_profile_heads", true),
                ("knowledge_space_profile_revisions", true),
                ("projection_set_publication_members", true),
            ];
            for (table, tenant) in SPACE_TABLES.iter().copied().chain(primary) {
                let tenant = if tenant {
                    "tenant_id = $1"
                } else {
                    "$1::text IS NOT NULL"
                };
                let sql = format!(
                    "SELECT 1 FROM {table} WHERE knowledge_space_id = $2 AND {tenant} AND $3::uuid IS NOT NULL \
                       AND $4::uuid IS NOT NULL"
                );
                if any(tx, job, &sql).await? {
                    return Ok(Some(format!("{table} rows outlived the space")));
                }
            }
        }
    }
    Ok(None)
}
