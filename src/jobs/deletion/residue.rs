//! The residue check of the completing transaction: the platform's `hasForbiddenDerivedResidue`
//! over every table the target can leave derived rows in (the source product's workflow rows,
//! the space's quality history and the target's overview rows included), plus the published head
//! (it must not serve the target) and a probe of the object store under the target's prefix (a
//! logical document's: under each asset its request fenced). Its primary rows (a logical
//! document's aggregate among them) are probed again after they are deleted, in `primary`. Invariant: the check reads
//! only rows of the job's tenant and space and objects under the space's manifest prefix, and any
//! hit names what it found; the completing transaction deletes primary rows only when nothing is
//! found.

use sqlx::PgConnection;

use super::ports::Ports;
use super::purge::{
    document_children, document_tail, overview, publication_source_identity, quality,
    source_identity, source_product, space_children, space_row, SPACE_TABLES,
};
use super::sql::{
    self, exists, fs_lease_target, golden, in_space, items_ref, scoped, semantic_path, OWNED,
};
use super::{head, JobRow, Scope};
use crate::jobs::JobError;

/// `(what, SELECT EXISTS ...)`, in the platform's order.
pub(super) fn checks(scope: Scope) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = vec![(
        "deletion items not completed".into(),
        format!(
            "{} SELECT EXISTS (SELECT 1 FROM deletion_job_items i, p WHERE i.deletion_job_id = p.job \
               AND i.status <> 'completed' AND p.tenant IS NOT NULL AND p.space IS NOT NULL)",
            sql::with(scope)
        ),
    )];
    let mut add = |what: &str, table: &str, filter: String| {
        out.push((what.to_owned(), exists(scope, table, &filter)));
    };
    add(
        "retrieval leases",
        "retrieval_execution_leases",
        scoped("t"),
    );
    add("resource mounts", "resource_mounts", scoped("t"));
    add("failed queries", "failed_queries", in_space("t"));
    add("agent workspaces", "agent_workspace_snapshots", scoped("t"));
    add(
        "KnowledgeFS leases on the target",
        "knowledge_fs_leases",
        fs_lease_target(scope, "t"),
    );
    add("KnowledgeFS leases", "knowledge_fs_leases", scoped("t"));
    add("KnowledgeFS sessions", "knowledge_fs_sessions", scoped("t"));
    add("golden questions", "golden_questions", golden(scope, "t"));
    add("research tasks", "research_task_jobs", scoped("t"));
    add(
        "research partial results",
        "research_task_partial_results",
        scoped("t"),
    );
    add(
        "research progress events",
        "research_task_progress_events",
        scoped("t"),
    );
    for (table, filter, _) in source_product(scope)
        .into_iter()
        .chain(quality())
        .chain(overview(scope))
    {
        add(table, table, filter);
    }
    if scope != Scope::Space {
        add(
            "historical publications of the target",
            "projection_set_publications",
            sql::historical_publication("t"),
        );
    }
    if scope == Scope::Space || scope.is_source() {
        let of_source = if scope.is_source() {
            " AND t.source_id = p.target"
        } else {
            ""
        };
        add(
            "source secrets not deleted",
            "source_secret_lifecycle_refs",
            format!("{} AND t.state <> 'deleted'{of_source}", scoped("t")),
        );
    }
    if scope.is_source() {
        add(
            "knowledge paths of the source",
            "knowledge_paths",
            format!(
                "{} AND ((t.resource_type = 'source' AND t.target_id = p.target::text) \
                   OR t.virtual_path = '/sources/' || p.target::text)",
                in_space("t")
            ),
        );
    }
    if let Scope::SourceKeep(_) = scope {
        add(
            "kept documents still naming the source",
            "document_assets",
            format!(
                "{} AND t.source_id = p.target AND {}",
                in_space("t"),
                source_identity("t")
            ),
        );
        add(
            "the published head still names the source",
            "projection_set_publications",
            format!(
                "{} AND t.id IN (SELECT h.publication_id FROM projection_set_publication_heads h \
                   WHERE h.tenant_id = p.tenant AND h.knowledge_space_id = p.space) AND {}",
                scoped("t"),
                publication_source_identity("t.metadata")
            ),
        );
        return out;
    }
    add(
        "answer traces of the target",
        "answer_traces",
        format!("{} AND t.id IN (SELECT id FROM ttr)", in_space("t")),
    );
    add(
        "evidence bundles of the target",
        "evidence_bundles",
        format!("{} AND t.id IN (SELECT id FROM tb)", scoped("t")),
    );
    let partial = if scope == Scope::Space {
        scoped("t")
    } else {
        format!(
            "{} AND {}",
            scoped("t"),
            items_ref("t.evidence_bundle->'items'")
        )
    };
    add(
        "research evidence of the target",
        "research_task_partial_results",
        partial,
    );
    if scope == Scope::Space {
        for (table, filter, _) in space_children() {
            add(table, table, filter);
        }
        for (table, tenant) in SPACE_TABLES {
            add(table, table, space_row(tenant));
        }
        add(
            "parse artifacts",
            "parse_artifacts",
            format!("{OWNED} AND t.document_asset_id IN (SELECT id FROM td)"),
        );
        return out;
    }
    for (table, filter) in document_children() {
        add(table, table, filter);
    }
    add(
        "full-text postings",
        "index_projection_fts_postings",
        format!(
            "{} AND t.projection_id IN (SELECT ip.id FROM index_projections ip WHERE ip.knowledge_space_id = p.space \
               AND ip.node_id IN (SELECT id FROM tn))",
            in_space("t")
        ),
    );
    add(
        "knowledge paths of the target",
        "knowledge_paths",
        semantic_path(scope, "t"),
    );
    add(
        "knowledge nodes",
        "knowledge_nodes",
        format!(
            "{} AND t.document_asset_id IN (SELECT id FROM td)",
            in_space("t")
        ),
    );
    for (table, filter, _) in document_tail() {
        add(table, table, filter);
    }
    out
}

/// What of the target is left, if anything: rows first, then the head, then objects.
pub(super) async fn find(
    tx: &mut PgConnection,
    job: &JobRow,
    ports: &Ports,
) -> Result<Option<String>, JobError> {
    for (what, sql) in checks(job.scope) {
        if sql::found(tx, job, &sql).await? {
            return Ok(Some(what));
        }
    }
    if head::head_serves_target(tx, job).await? {
        return Ok(Some("the published head still serves the target".into()));
    }
    // The object store: nothing under the space's prefix, or under the document's folder (and
    // its raw object). A source's documents were each inventoried by their rows and folders.
    let prefix = job.prefix(tx).await?;
    let port = |e: super::PortError| JobError::retryable(e.code, e.message);
    match job.scope {
        Scope::Space => {
            let left = ports
                .objects
                .list_objects(&format!("{prefix}/"), None, 1)
                .await
                .map_err(port)?;
            if !left.is_empty() {
                return Ok(Some("objects under the space's prefix".into()));
            }
        }
        Scope::Document(doc) => {
            let left = ports
                .objects
                .list_objects(&format!("{prefix}/documents/{doc}/"), None, 1)
                .await
                .map_err(port)?;
            if !left.is_empty() {
                return Ok(Some("objects under the document's folder".into()));
            }
            let raw: Option<String> = sqlx::query_scalar(
                "SELECT d.object_key FROM document_assets d WHERE d.id = $3 AND d.knowledge_space_id = $2 \
                   AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = $2 AND k.tenant_id = $1)",
            )
            .bind(&job.tenant)
            .bind(job.space)
            .bind(doc)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(raw) = raw.filter(|k| k.starts_with(&format!("{prefix}/"))) {
                if ports.objects.object_exists(&raw).await.map_err(port)? {
                    return Ok(Some("the document's raw object".into()));
                }
            }
        }
        Scope::LogicalDocument(_) => {
            let assets: Vec<(uuid::Uuid, String)> = sqlx::query_as(
                "SELECT d.id, d.object_key FROM document_assets d WHERE d.knowledge_space_id = $2 \
                   AND d.deletion_job_id = $3 \
                   AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = $2 AND k.tenant_id = $1) \
                 ORDER BY d.id",
            )
            .bind(&job.tenant)
            .bind(job.space)
            .bind(job.id)
            .fetch_all(&mut *tx)
            .await?;
            for (doc, raw) in assets {
                let left = ports
                    .objects
                    .list_objects(&format!("{prefix}/documents/{doc}/"), None, 1)
                    .await
                    .map_err(port)?;
                if !left.is_empty() {
                    return Ok(Some(
                        "objects under a folder of the logical document".into(),
                    ));
                }
                if raw.starts_with(&format!("{prefix}/"))
                    && ports.objects.object_exists(&raw).await.map_err(port)?
                {
                    return Ok(Some("a raw object of the logical document".into()));
                }
            }
        }
        Scope::SourceKeep(_) | Scope::SourceCascade(_) => {}
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    #[test]
    fn residue_checks_are_confined_and_cover_the_derived_order() {
        for scope in [
            Scope::Space,
            Scope::Document(Uuid::nil()),
            Scope::SourceKeep(Uuid::nil()),
            Scope::SourceCascade(Uuid::nil()),
            Scope::LogicalDocument(Uuid::nil()),
        ] {
            let checks = checks(scope);
            for (what, sql) in &checks {
                assert!(
                    sql.contains("p.tenant") && sql.contains("p.space"),
                    "{scope:?} {what}: {sql}"
                );
            }
            let names: Vec<&str> = checks.iter().map(|c| c.0.as_str()).collect();
            if scope == Scope::Space {
                for (t, _) in SPACE_TABLES {
                    assert!(names.contains(&t), "{t}");
                }
            }
            if scope.is_source() || scope == Scope::Space {
                for t in ["source_workflow_runs", "source_sync_policies"] {
                    assert!(names.contains(&t), "{scope:?} {t}");
                }
            }
            if let Scope::Document(_) | Scope::LogicalDocument(_) = scope {
                for t in [
                    "knowledge nodes",
                    "parse_artifacts",
                    "artifact_segments",
                    "knowledge_space_staged_commits",
                ] {
                    assert!(names.contains(&t), "{t}: {names:?}");
                }
            }
        }
    }
}
