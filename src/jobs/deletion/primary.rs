//! `deleting_primary_data` and completion. A space's logical-document rows go in bounded pages
//! first, children first; then a space's or a cascaded source's document rows, in bounded pages
//! too (only rows nothing key-bearing refers to any more, no logical-document revision among
//! them); then the completing transaction locks the target row, runs the residue
//! check and the object probe, deletes the primary rows in a savepoint, probes again, and
//! completes the tombstone. The primary rows, in the platform's order, children before what
//! their RESTRICT keys name:
//! - a document asset: the logical documents whose active revision it is lose it (`failed`), the
//!   reindex attempts, chunk state changes and revision chunks of its revisions go, a logical
//!   document with no other (or activated) revision goes, then its revisions, then the asset;
//! - a logical document: its aggregate (reindex attempts, chunk state changes, revision chunks,
//!   settings heads and revisions, revisions, the document), then the assets its request fenced;
//! - a cascaded source: the aggregates of its logical documents (those naming it, and those whose
//!   every revision uses its assets, as 0022's backfill leaves them), the remaining revisions of
//!   its assets (as for one asset), its assets, the source; a kept source: its logical documents and revisions
//!   lose the source's identity, its assets are detached and reactivated, the source goes;
//! - a space: every logical-document aggregate, the documents, sources, OAuth transactions,
//!   source connections, profile migration runs, backfills, publication bindings, heads and
//!   revisions, the manifest and the space row.
//!
//! Invariant: anything left of the target (a row still referencing it included) rolls the
//! savepoint back and sends the job to `quiescing`; only a clean check completes the job, in the
//! same transaction as the check.

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
    AND NOT EXISTS (SELECT 1 FROM document_revisions x WHERE x.knowledge_space_id = d.knowledge_space_id \
      AND x.document_asset_id = d.id)";

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

/// One page of a space's logical-document rows, before its documents go, so that its documents
/// are unreferenced and go in pages too (a cascaded source's and a document's logical-document
/// rows go in the completing transaction).
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
        Scope::Document(_) | Scope::SourceKeep(_) | Scope::LogicalDocument(_) => return Ok(0),
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
        Scope::LogicalDocument(_) => {
            "SELECT deletion_job_id FROM logical_documents WHERE tenant_id = $1 AND knowledge_space_id = $2 \
               AND id = $3 FOR UPDATE"
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

/// The logical-document aggregate rows (`$1` tenant, `$2` space), children first, of the
/// documents `docs` names (a predicate on a document id column, `{col}`): the platform's
/// aggregate cleanup. The active revision is cut first, so no deferred key is left dangling.
fn aggregate_statements(docs: &str) -> Vec<String> {
    let of = |col: &str| docs.replace("{col}", col);
    let mut out = vec![format!(
        "UPDATE logical_documents SET active_revision = NULL WHERE tenant_id = $1 AND knowledge_space_id = $2 \
           AND {} AND active_revision IS NOT NULL",
        of("id")
    )];
    for table in [
        "document_reindex_attempts",
        "document_chunk_state_changes",
        "document_revision_chunks",
        "document_settings_heads",
        "document_settings_revisions",
        "document_revisions",
    ] {
        out.push(format!(
            "DELETE FROM {table} WHERE tenant_id = $1 AND knowledge_space_id = $2 AND {}",
            of("document_id")
        ));
    }
    out.push(format!(
        "DELETE FROM logical_documents WHERE tenant_id = $1 AND knowledge_space_id = $2 AND {}",
        of("id")
    ));
    out
}

/// What the deletion of document assets (`assets`, a predicate on an asset id column `{col}`)
/// does to the logical documents whose revisions use them (`$1` tenant, `$2` space): the
/// platform's cleanup for a document-asset target. A document whose active revision is one of
/// them loses it and is `failed`; the reindex attempts, chunk state changes and revision chunks
/// of those revisions go; a document that only ever had candidate or failed revisions of these
/// assets goes; then the revisions themselves.
fn asset_revision_statements(assets: &str) -> Vec<String> {
    let of = |col: &str| assets.replace("{col}", col);
    let revisions = format!(
        "(document_id, document_revision) IN (SELECT r.document_id, r.revision FROM document_revisions r \
           WHERE r.tenant_id = $1 AND r.knowledge_space_id = $2 AND {})",
        of("r.document_asset_id")
    );
    let mut out = vec![format!(
        "UPDATE logical_documents l SET active_revision = NULL, \
           status = CASE WHEN l.status = 'deleting' THEN l.status ELSE 'failed' END, \
           row_version = l.row_version + 1, updated_at = now() \
         WHERE l.tenant_id = $1 AND l.knowledge_space_id = $2 AND EXISTS (SELECT 1 FROM document_revisions r \
           WHERE r.tenant_id = $1 AND r.knowledge_space_id = $2 AND r.document_id = l.id \
             AND r.revision = l.active_revision AND {})",
        of("r.document_asset_id")
    )];
    for table in [
        "document_reindex_attempts",
        "document_chunk_state_changes",
        "document_revision_chunks",
    ] {
        out.push(format!(
            "DELETE FROM {table} WHERE tenant_id = $1 AND knowledge_space_id = $2 AND {revisions}"
        ));
    }
    out.push(format!(
        "DELETE FROM logical_documents l WHERE l.tenant_id = $1 AND l.knowledge_space_id = $2 \
           AND l.active_revision IS NULL \
           AND EXISTS (SELECT 1 FROM document_revisions r WHERE r.tenant_id = $1 AND r.knowledge_space_id = $2 \
             AND r.document_id = l.id AND {}) \
           AND NOT EXISTS (SELECT 1 FROM document_revisions r WHERE r.tenant_id = $1 AND r.knowledge_space_id = $2 \
             AND r.document_id = l.id AND (NOT ({}) OR r.state NOT IN ('candidate', 'failed') \
               OR r.activated_at IS NOT NULL))",
        of("r.document_asset_id"),
        of("r.document_asset_id")
    ));
    out.push(format!(
        "DELETE FROM document_revisions r WHERE r.tenant_id = $1 AND r.knowledge_space_id = $2 AND {}",
        of("r.document_asset_id")
    ));
    out
}

/// The metadata keys that name a source, removed from a kept source's logical documents and
/// revisions (as from its documents' metadata).
const SCRUB_SOURCE: &str = "- 'sourceId' - 'credentialRef' #- '{fingerprintMaterial,sourceId}' \
    #- '{projectionSetFingerprintMaterial,sourceId}' #- '{provenance,sourceId}' \
    #- '{provenance,providerItemId}' #- '{provenance,remoteDeletionPolicy}'";

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
            for sql in asset_revision_statements("{col} = $3") {
                exec(tx, job, &format!("{sql} AND $4::uuid IS NOT NULL")).await?;
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
            if any(tx, job, "SELECT 1 FROM document_revisions WHERE tenant_id = $1 AND knowledge_space_id = $2 AND document_asset_id = $3 AND $4::uuid IS NOT NULL").await? {
                return Ok(Some("logical-document revisions of the document".into()));
            }
        }
        Scope::LogicalDocument(_) => {
            for sql in aggregate_statements("{col} = $3") {
                exec(tx, job, &format!("{sql} AND $4::uuid IS NOT NULL")).await?;
            }
            exec(
                tx,
                job,
                &format!(
                    "DELETE FROM document_assets d WHERE d.knowledge_space_id = $2 AND d.deletion_job_id = $4 \
                       AND {OWNED} AND $3::uuid IS NOT NULL"
                ),
            )
            .await?;
            let mut probe: Vec<String> = [
                "document_reindex_attempts",
                "document_chunk_state_changes",
                "document_revision_chunks",
                "document_settings_heads",
                "document_settings_revisions",
                "document_revisions",
            ]
            .iter()
            .map(|t| {
                format!(
                    "SELECT 1 FROM {t} WHERE tenant_id = $1 AND knowledge_space_id = $2 AND document_id = $3"
                )
            })
            .collect();
            probe.push(
                "SELECT 1 FROM logical_documents WHERE tenant_id = $1 AND knowledge_space_id = $2 AND id = $3"
                    .into(),
            );
            probe.push(
                "SELECT 1 FROM document_assets WHERE knowledge_space_id = $2 AND deletion_job_id = $4".into(),
            );
            if any(tx, job, &probe.join(" UNION ALL ")).await? {
                return Ok(Some(
                    "the logical document, its aggregate rows or its assets".into(),
                ));
            }
        }
        Scope::SourceKeep(_) | Scope::SourceCascade(_) => {
            if let Scope::SourceCascade(_) = job.scope {
                // The source's logical documents: those naming it, and (kfs-worker's addition)
                // those whose every revision uses one of its assets, as 0022's backfill leaves
                // them (without a source). Fixed before the first delete changes the answer.
                let docs: Vec<uuid::Uuid> = sqlx::query_scalar(&format!(
                    "SELECT l.id FROM logical_documents l WHERE l.tenant_id = $1 AND l.knowledge_space_id = $2 \
                       AND (l.source_id = $3 OR (EXISTS (SELECT 1 FROM document_revisions r \
                           WHERE r.tenant_id = $1 AND r.knowledge_space_id = $2 AND r.document_id = l.id) \
                         AND NOT EXISTS (SELECT 1 FROM document_revisions r WHERE r.tenant_id = $1 \
                           AND r.knowledge_space_id = $2 AND r.document_id = l.id AND r.document_asset_id NOT IN ( \
                             SELECT a.id FROM document_assets a WHERE a.knowledge_space_id = $2 AND a.source_id = $3)))) \
                       AND {OWNED} AND $4::uuid IS NOT NULL"
                ))
                .bind(&job.tenant)
                .bind(job.space)
                .bind(job.target_id)
                .bind(job.id)
                .fetch_all(&mut *tx)
                .await?;
                for sql in aggregate_statements("{col} = ANY($5)") {
                    sqlx::query(&format!(
                        "{sql} AND $3::uuid IS NOT NULL AND $4::uuid IS NOT NULL"
                    ))
                    .bind(&job.tenant)
                    .bind(job.space)
                    .bind(job.target_id)
                    .bind(job.id)
                    .bind(&docs)
                    .execute(&mut *tx)
                    .await?;
                }
                // Revisions of other logical documents (0022 backfills them with no source)
                // that use the source's assets.
                let assets = "{col} IN (SELECT a.id FROM document_assets a WHERE a.knowledge_space_id = $2 \
                                AND a.source_id = $3 AND (a.deletion_job_id IS NULL OR a.deletion_job_id = $4))";
                for sql in asset_revision_statements(assets) {
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
                        "UPDATE document_revisions SET system_metadata = system_metadata {SCRUB_SOURCE} \
                         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND document_id IN (SELECT l.id \
                           FROM logical_documents l WHERE l.tenant_id = $1 AND l.knowledge_space_id = $2 \
                             AND l.source_id = $3) AND $4::uuid IS NOT NULL"
                    ),
                )
                .await?;
                exec(
                    tx,
                    job,
                    &format!(
                        "UPDATE logical_documents SET source_id = NULL, provider_item_id = NULL, \
                           provider_item_digest = NULL, system_metadata = system_metadata {SCRUB_SOURCE}, \
                           row_version = row_version + 1, updated_at = now() \
                         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND source_id = $3 AND $4::uuid IS NOT NULL"
                    ),
                )
                .await?;
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
            let mut statements: Vec<String> = aggregate_statements("TRUE")
                .into_iter()
                .map(|sql| format!("{sql} AND $3::uuid = $2"))
                .collect();
            let space_row = "tenant_id = $1 AND knowledge_space_id = $2";
            statements.extend([
                format!("DELETE FROM document_assets WHERE knowledge_space_id = $2 AND {OWNED}"),
                format!("DELETE FROM sources WHERE knowledge_space_id = $2 AND {OWNED}"),
                format!("DELETE FROM source_oauth_transactions WHERE {space_row}"),
                format!("DELETE FROM source_connections WHERE {space_row}"),
                format!("DELETE FROM knowledge_space_profile_migration_runs WHERE {space_row}"),
                format!("DELETE FROM knowledge_space_profile_backfills WHERE {space_row}"),
                format!("DELETE FROM knowledge_space_profile_publication_bindings WHERE {space_row}"),
                format!("DELETE FROM knowledge_space_profile_heads WHERE {space_row}"),
                format!("DELETE FROM knowledge_space_profile_revisions WHERE {space_row}"),
                format!("DELETE FROM knowledge_space_manifests WHERE {space_row}"),
                "DELETE FROM knowledge_spaces WHERE tenant_id = $1 AND id = $2 AND id = $3 AND deletion_job_id = $4".into(),
            ]);
            for sql in statements {
                exec(tx, job, &sql).await?;
            }
            if any(tx, job, "SELECT 1 FROM knowledge_spaces WHERE tenant_id = $1 AND id = $2 AND $3::uuid IS NOT NULL AND $4::uuid IS NOT NULL").await? {
                return Ok(Some("the space row".into()));
            }
            // Nothing of the space may outlive its row, whatever its foreign keys say.
            let primary: [(&str, bool); 15] = [
                ("document_assets", false),
                ("sources", false),
                ("logical_documents", true),
                ("document_revisions", true),
                ("document_settings_revisions", true),
                ("source_connections", true),
                ("source_oauth_transactions", true),
                ("source_workflow_runs", true),
                ("source_sync_policies", true),
                ("capability_grants", true),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aggregates_go_children_first_and_stay_in_the_space() {
        let agg = aggregate_statements("{col} = $3");
        let pos = |t: &str| {
            agg.iter()
                .position(|s| s.contains(&format!(" {t} ")))
                .unwrap()
        };
        assert!(agg[0].starts_with("UPDATE logical_documents SET active_revision = NULL"));
        assert!(pos("document_reindex_attempts") < pos("document_revisions"));
        assert!(pos("document_settings_heads") < pos("document_settings_revisions"));
        assert!(pos("document_revisions") < agg.len() - 1);
        assert!(agg
            .last()
            .unwrap()
            .starts_with("DELETE FROM logical_documents"));
        for sql in agg
            .iter()
            .chain(asset_revision_statements("{col} = $3").iter())
        {
            assert!(
                sql.contains("tenant_id = $1") && sql.contains("knowledge_space_id = $2"),
                "{sql}"
            );
            assert!(!sql.contains("{col}"), "{sql}");
        }
        let assets = asset_revision_statements("{col} = $3");
        assert!(assets[0].contains("status = CASE WHEN l.status = 'deleting'"));
        assert!(assets
            .last()
            .unwrap()
            .starts_with("DELETE FROM document_revisions"));
    }
}
