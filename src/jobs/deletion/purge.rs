//! `deleting_derived_data`: the target's derived rows, in the platform's order, one bounded page
//! per step — retrieval leases, resource mounts, failed queries, agent workspaces, KnowledgeFS
//! leases and sessions, golden questions, research residue, the source product's workflow rows
//! (a source's or a space's runs with their outbox, previews and bulk items, sync policies; a
//! space's OAuth transactions and deleted connection secrets), the space's quality history,
//! historical publications with their members, profile bindings and migration runs (one that an
//! active compile attempt still builds on is waited for, not taken from under it), lifecycle
//! secrets, source paths, (a kept source's) document metadata, traces and evidence, a document's
//! derived residue (compile, page index, artifacts, paths, nodes with their projections and graph
//! rows, ledgers, outlines, manifests, staged commits, parse artifacts), a space's cascade residue
//! (children first, so RESTRICT keys hold: compile attempts, migration runs, bulk operations,
//! research tasks and traces before the permission snapshots and grants they bind, snapshots
//! before API keys, heads and bindings before publications), the target's overview rows, then the
//! cache prefixes. Invariant: every statement names the
//! job's tenant and space and touches at most one page; a step runs the parts in that fixed order
//! until one changes something, so it holds at most one page; a kept source's documents keep
//! every derived row.

use sqlx::PgConnection;

use super::ports::Ports;
use super::sql::{
    self, fs_lease_target, golden, in_space, items_ref, page_delete, page_delete_rows, scoped,
    semantic_path, OWNED,
};
use super::walk::Event;
use super::{cache_prefixes, derived, DeletionConfig, JobRow, Scope, INVALIDATION_REASON};
use crate::jobs::JobError;

/// One part of the derived-data order.
pub(super) enum Part {
    /// A page statement.
    Sql(String),
    /// Research tasks of the space with their outbox, partial results and progress.
    Research,
    /// Historical publications of the target's documents, with what references them.
    Historical,
    /// Answer traces citing the target, with their steps, failed queries and bundles.
    Traces,
    /// The target documents' knowledge nodes, with their graph rows and projections.
    Nodes,
}

/// The target's documents own a row of `t` through `t.document_asset_id`.
fn of_td(t: &str) -> String {
    format!("{t}.document_asset_id IN (SELECT id FROM td)")
}

/// A row of a child table (`t.{col}`) whose parent in `parent` (alias `q`) matches `filter`.
///
/// The parents are an uncorrelated set: the job's parameters are read from `p` by scalar
/// subqueries, not from the outer row's `p`. Correlated on the outer `p`, Postgres runs the
/// parent lookup once per candidate child row (a page of a document's page-index terms then
/// scanned every term of the space: 158 ms against 1.3 ms for 5,200 terms), and the
/// space-wide steps of a space's deletions run one at a time, so that cost is paid in series.
fn child_of(t: &str, col: &str, parent: &str, filter: &str) -> String {
    format!(
        "{t}.{col} IN (SELECT q.id FROM {parent} q WHERE {})",
        uncorrelated(filter)
    )
}

/// `filter` with every job parameter (`p.space`, `p.tenant`, `p.target`, `p.job`) read from
/// the `p` CTE by a scalar subquery.
fn uncorrelated(filter: &str) -> String {
    let mut out = String::with_capacity(filter.len() + 64);
    let mut rest = filter;
    while let Some(i) = rest.find("p.") {
        let boundary = i == 0 || {
            let c = rest.as_bytes()[i - 1];
            !(c.is_ascii_alphanumeric() || c == b'_' || c == b'.')
        };
        let after = &rest[i + 2..];
        let field = ["space", "tenant", "target", "job"].into_iter().find(|f| {
            after.starts_with(f)
                && !after[f.len()..]
                    .bytes()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_')
        });
        match field {
            Some(f) if boundary => {
                out.push_str(&rest[..i]);
                out.push_str(&format!("(SELECT {f} FROM p)"));
                rest = &after[f.len()..];
            }
            _ => {
                out.push_str(&rest[..i + 2]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// The space's cascade residue tables, in the platform's explicit order (0018 subset), and
/// whether each has a tenant column.
pub(super) const SPACE_TABLES: [(&str, bool); 42] = [
    ("research_task_partial_results", true),
    ("research_task_progress_events", true),
    ("research_task_jobs", true),
    ("document_compilation_attempts", true),
    ("knowledge_space_profile_migration_runs", true),
    ("bulk_operations", true),
    ("legacy_space_publication_bootstraps", true),
    ("page_index_upgrade_backfills", true),
    ("page_index_terms", false),
    ("page_index_manifests", false),
    ("document_outlines", false),
    ("index_projection_fts_postings", false),
    ("projection_set_publication_heads", true),
    ("graph_relations", false),
    ("graph_entities", false),
    ("index_projections", false),
    ("knowledge_nodes", false),
    ("artifact_segments", false),
    ("document_multimodal_manifests", false),
    ("knowledge_space_staged_commits", true),
    ("knowledge_paths", false),
    ("answer_traces", false),
    ("evidence_bundles", true),
    ("golden_questions", false),
    ("failed_queries", false),
    ("agent_workspace_snapshots", true),
    ("knowledge_fs_leases", true),
    ("knowledge_fs_sessions", true),
    ("retrieval_execution_leases", true),
    ("tidb_fts_posting_backfills", true),
    ("knowledge_space_mutation_leases", true),
    ("source_credential_backfills", true),
    ("source_secret_lifecycle_refs", true),
    ("resource_mounts", true),
    ("knowledge_space_access_policy_members", true),
    ("knowledge_space_access_policies", true),
    ("knowledge_space_permission_snapshots", true),
    ("knowledge_space_api_keys", true),
    ("knowledge_space_api_access", true),
    ("knowledge_space_members", true),
    ("knowledge_space_profile_publication_bindings", true),
    ("projection_set_publications", true),
];

/// A row of a space table (alias `t`), with or without a tenant column.
pub(super) fn space_row(tenant: bool) -> String {
    if tenant {
        scoped("t")
    } else {
        in_space("t")
    }
}

/// The FK children of the target documents' rows (the platform's first document residue group).
pub(super) fn document_children() -> Vec<(&'static str, String)> {
    vec![
        (
            "document_compilation_outbox",
            child_of(
                "t",
                "attempt_id",
                "document_compilation_attempts",
                &format!(
                    "q.tenant_id = p.tenant AND q.knowledge_space_id = p.space AND {}",
                    of_td("q")
                ),
            ),
        ),
        (
            "page_index_terms",
            format!(
                "{} AND {}",
                in_space("t"),
                child_of(
                    "t",
                    "manifest_id",
                    "page_index_manifests",
                    &format!("q.knowledge_space_id = p.space AND {}", of_td("q"))
                )
            ),
        ),
        (
            "page_index_nodes",
            child_of(
                "t",
                "manifest_id",
                "page_index_manifests",
                &format!(
                    "q.knowledge_space_id = p.space AND {OWNED} AND {}",
                    of_td("q")
                ),
            ),
        ),
        (
            "document_compilation_attempts",
            format!("{} AND {}", scoped("t"), of_td("t")),
        ),
        (
            "artifact_segments",
            format!("{} AND {}", in_space("t"), of_td("t")),
        ),
    ]
}

/// The target documents' ledgers (composite keys) and their last per-document rows.
pub(super) fn document_tail() -> Vec<(&'static str, String, bool)> {
    vec![
        (
            "page_index_upgrade_backfill_items",
            format!(
                "{} AND {}",
                child_of(
                    "t",
                    "backfill_id",
                    "page_index_upgrade_backfills",
                    &scoped("q")
                ),
                of_td("t")
            ),
            true,
        ),
        (
            "legacy_space_publication_bootstrap_items",
            format!(
                "{} AND {}",
                child_of(
                    "t",
                    "bootstrap_id",
                    "legacy_space_publication_bootstraps",
                    &scoped("q")
                ),
                of_td("t")
            ),
            true,
        ),
        (
            "page_index_manifests",
            format!("{} AND {}", in_space("t"), of_td("t")),
            false,
        ),
        (
            "document_outlines",
            format!("{} AND {}", in_space("t"), of_td("t")),
            false,
        ),
        // No FK ties an evaluation (and the repair queued in it) to its document; it goes with
        // the document all the same, so nothing names the document afterwards.
        (
            "page_index_findability_evaluations",
            format!("{} AND {}", scoped("t"), of_td("t")),
            false,
        ),
        (
            "document_multimodal_manifests",
            format!("{} AND {}", in_space("t"), of_td("t")),
            false,
        ),
        (
            "knowledge_space_staged_commits",
            format!("{} AND {}", scoped("t"), of_td("t")),
            false,
        ),
        (
            "parse_artifacts",
            format!("{OWNED} AND {}", of_td("t")),
            false,
        ),
    ]
}

/// The space's indirect children and ledgers (before the explicit tables).
pub(super) fn space_children() -> Vec<(&'static str, String, bool)> {
    vec![
        (
            "document_compilation_outbox",
            child_of(
                "t",
                "attempt_id",
                "document_compilation_attempts",
                &scoped("q"),
            ),
            false,
        ),
        (
            "answer_trace_steps",
            child_of(
                "t",
                "trace_id",
                "answer_traces",
                &format!("q.knowledge_space_id = p.space AND {OWNED}"),
            ),
            false,
        ),
        (
            "page_index_nodes",
            child_of(
                "t",
                "manifest_id",
                "page_index_manifests",
                &format!("q.knowledge_space_id = p.space AND {OWNED}"),
            ),
            false,
        ),
        (
            "research_task_outbox",
            child_of(
                "t",
                "research_task_job_id",
                "research_task_jobs",
                &scoped("q"),
            ),
            false,
        ),
        (
            "legacy_space_publication_bootstrap_items",
            child_of(
                "t",
                "bootstrap_id",
                "legacy_space_publication_bootstraps",
                &scoped("q"),
            ),
            true,
        ),
        (
            "page_index_upgrade_backfill_items",
            child_of(
                "t",
                "backfill_id",
                "page_index_upgrade_backfills",
                &scoped("q"),
            ),
            true,
        ),
        ("projection_set_publication_members", scoped("t"), true),
    ]
}

/// The source product's workflow rows the target takes (a source's or a space's), children
/// first: run outbox and previews, bulk items (a space's all; a source's those whose child run
/// goes), the runs (their bulk items go with them), sync policies; a space's OAuth transactions
/// and deleted connection secrets. None for a document.
pub(super) fn source_product(scope: Scope) -> Vec<(&'static str, String, bool)> {
    let Some(runs) = sql::source_runs(scope, "q") else {
        return Vec::new();
    };
    let in_runs = |t: &str, col: &str| child_of(t, col, "source_workflow_runs", &runs);
    let mut out = vec![
        ("source_workflow_outbox", in_runs("t", "run_id"), false),
        ("source_crawl_preview_pages", in_runs("t", "run_id"), true),
    ];
    let (bulk, policies) = if scope == Scope::Space {
        (scoped("t"), scoped("t"))
    } else {
        (
            format!("{} AND {}", scoped("t"), in_runs("t", "child_run_id")),
            format!("{} AND t.source_id = p.target", scoped("t")),
        )
    };
    out.push(("source_bulk_workflow_items", bulk, false));
    out.push((
        "source_workflow_runs",
        sql::source_runs(scope, "t").unwrap_or_default(),
        false,
    ));
    out.push(("source_sync_policies", policies, false));
    if scope == Scope::Space {
        out.push(("source_oauth_transactions", scoped("t"), false));
        out.push((
            "source_connection_secret_refs",
            format!("{} AND t.state = 'deleted'", scoped("t")),
            false,
        ));
    }
    out
}

/// The space's quality history, children first (the platform drains it whole for every target:
/// replays freeze a whole publication and may cite anything of it).
pub(super) fn quality() -> Vec<(&'static str, String, bool)> {
    let runs = |t: &str| child_of(t, "run_id", "quality_replay_runs", &scoped("q"));
    vec![
        ("quality_resource_history", scoped("t"), false),
        ("quality_bad_cases", scoped("t"), false),
        ("quality_missing_evidence_reviews", scoped("t"), false),
        ("quality_replay_items", runs("t"), false),
        ("quality_replay_outbox", runs("t"), false),
        ("quality_replay_runs", scoped("t"), false),
    ]
}

/// The target's overview rows (attention states, then activity events): a source's (and a
/// cascaded source's logical documents'), a logical document's, or those of the logical
/// documents whose revisions use a document asset. A space's go with the space.
pub(super) fn overview(scope: Scope) -> Vec<(&'static str, String, bool)> {
    let docs_of_source = "SELECT l.id::text FROM logical_documents l WHERE l.tenant_id = p.tenant \
        AND l.knowledge_space_id = p.space AND l.source_id = p.target";
    let target = match scope {
        Scope::Space => return Vec::new(),
        Scope::SourceKeep(_) => {
            "(t.resource_type = 'source' AND t.resource_id = p.target::text)".to_owned()
        }
        Scope::SourceCascade(_) => format!(
            "((t.resource_type = 'source' AND t.resource_id = p.target::text) \
              OR (t.resource_type = 'document' AND t.resource_id IN ({docs_of_source})))"
        ),
        Scope::LogicalDocument(_) => {
            "(t.resource_type = 'document' AND t.resource_id = p.target::text)".to_owned()
        }
        Scope::Document(_) => "(t.resource_type = 'document' AND t.resource_id IN ( \
            SELECT r.document_id::text FROM document_revisions r WHERE r.tenant_id = p.tenant \
              AND r.knowledge_space_id = p.space AND r.document_asset_id = p.target))"
            .to_owned(),
    };
    [
        "knowledge_space_attention_states",
        "knowledge_space_activity_events",
    ]
    .into_iter()
    .map(|table| (table, format!("{} AND {target}", scoped("t")), false))
    .collect()
}

fn delete(scope: Scope, table: &str, filter: &str, by_row: bool) -> Part {
    Part::Sql(if by_row {
        page_delete_rows(scope, table, filter)
    } else {
        page_delete(scope, table, filter)
    })
}

/// The derived-data order of a target.
pub(super) fn parts(scope: Scope) -> Vec<Part> {
    let w = sql::with(scope);
    let keep = matches!(scope, Scope::SourceKeep(_));
    let mut out = vec![
        delete(
            scope,
            "retrieval_execution_leases",
            &format!("{} AND (t.status <> 'active' OR t.expires_at <= now())", scoped("t")),
            false,
        ),
        delete(scope, "resource_mounts", &scoped("t"), false),
        delete(scope, "failed_queries", &in_space("t"), false),
        Part::Sql(format!(
            "{w}, v AS (SELECT t.id FROM agent_workspace_snapshots t, p WHERE {} AND t.invalidated_at IS NULL \
               ORDER BY t.id LIMIT (SELECT lim FROM p)) \
             UPDATE agent_workspace_snapshots x SET invalidated_at = now(), invalidation_reason = '{INVALIDATION_REASON}' \
             WHERE x.id IN (SELECT id FROM v)",
            scoped("t")
        )),
        delete(
            scope,
            "agent_workspace_snapshots",
            &format!("{} AND t.invalidated_at IS NOT NULL", scoped("t")),
            false,
        ),
        delete(
            scope,
            "knowledge_fs_leases",
            &format!("{} AND (t.status <> 'active' OR t.expires_at <= now())", fs_lease_target(scope, "t")),
            false,
        ),
        delete(
            scope,
            "knowledge_fs_leases",
            &format!("{} AND (t.status <> 'active' OR t.expires_at <= now())", scoped("t")),
            false,
        ),
        // Sessions only once no lease of the space is left (a live one sends the job back).
        delete(
            scope,
            "knowledge_fs_sessions",
            &format!(
                "{} AND NOT EXISTS (SELECT 1 FROM knowledge_fs_leases l WHERE {})",
                scoped("t"),
                scoped("l")
            ),
            false,
        ),
        delete(scope, "golden_questions", &golden(scope, "t"), false),
        Part::Research,
        delete(
            scope,
            "research_task_partial_results",
            &format!(
                "{} AND NOT EXISTS (SELECT 1 FROM research_task_jobs j WHERE j.id = t.research_task_job_id)",
                scoped("t")
            ),
            false,
        ),
        delete(
            scope,
            "research_task_progress_events",
            &format!(
                "{} AND NOT EXISTS (SELECT 1 FROM research_task_jobs j WHERE j.id = t.research_task_job_id)",
                scoped("t")
            ),
            false,
        ),
    ];
    for (table, filter, by_row) in source_product(scope).into_iter().chain(quality()) {
        out.push(delete(scope, table, &filter, by_row));
    }
    if scope != Scope::Space {
        out.push(Part::Historical);
    }
    if scope == Scope::Space || scope.is_source() {
        let of_source = if scope.is_source() {
            " AND t.source_id = p.target"
        } else {
            ""
        };
        out.push(delete(
            scope,
            "source_secret_lifecycle_refs",
            &format!("{} AND t.state = 'deleted'{of_source}", scoped("t")),
            false,
        ));
    }
    if scope.is_source() {
        out.push(delete(
            scope,
            "knowledge_paths",
            &format!(
                "{} AND ((t.resource_type = 'source' AND t.target_id = p.target::text) \
                   OR t.virtual_path = '/sources/' || p.target::text)",
                in_space("t")
            ),
            false,
        ));
    }
    if keep {
        out.push(Part::Sql(format!(
            "{w}, v AS (SELECT t.id FROM document_assets t, p WHERE {} AND t.source_id = p.target AND {} \
               ORDER BY t.id LIMIT (SELECT lim FROM p)) \
             UPDATE document_assets x SET metadata = x.metadata - 'sourceId' - 'credentialRef' \
               #- '{{fingerprintMaterial,sourceId}}' #- '{{projectionSetFingerprintMaterial,sourceId}}' \
               #- '{{provenance,sourceId}}' #- '{{provenance,providerItemId}}' #- '{{provenance,remoteDeletionPolicy}}', \
               row_version = x.row_version + 1, updated_at = now() \
             WHERE x.id IN (SELECT id FROM v)",
            in_space("t"),
            source_identity("t")
        )));
    } else {
        out.push(Part::Traces);
        out.push(delete(
            scope,
            "evidence_bundles",
            &format!(
                "{} AND t.id IN (SELECT id FROM tb) AND NOT EXISTS (SELECT 1 FROM answer_traces a \
                   WHERE a.evidence_bundle_id = t.id OR a.id = t.trace_id)",
                scoped("t")
            ),
            false,
        ));
        let partial = if scope == Scope::Space {
            scoped("t")
        } else {
            format!(
                "{} AND {}",
                scoped("t"),
                items_ref("t.evidence_bundle->'items'")
            )
        };
        out.push(delete(
            scope,
            "research_task_partial_results",
            &partial,
            false,
        ));
    }
    if matches!(
        scope,
        Scope::Document(_) | Scope::SourceCascade(_) | Scope::LogicalDocument(_)
    ) {
        for (table, filter) in document_children() {
            out.push(delete(scope, table, &filter, false));
        }
        out.push(delete(
            scope,
            "knowledge_paths",
            &semantic_path(scope, "t"),
            false,
        ));
        out.push(Part::Nodes);
        for (table, filter, by_row) in document_tail() {
            out.push(delete(scope, table, &filter, by_row));
        }
    }
    if scope == Scope::Space {
        for (table, filter, by_row) in space_children() {
            out.push(delete(scope, table, &filter, by_row));
        }
        for (table, tenant) in SPACE_TABLES {
            out.push(delete(scope, table, &space_row(tenant), false));
        }
        out.push(delete(
            scope,
            "parse_artifacts",
            &format!("{OWNED} AND {}", of_td("t")),
            false,
        ));
    }
    for (table, filter, by_row) in overview(scope) {
        out.push(delete(scope, table, &filter, by_row));
    }
    out
}

/// A document row (`t`) whose metadata still names its source.
pub(super) fn source_identity(t: &str) -> String {
    format!(
        "({t}.metadata ? 'sourceId' OR {t}.metadata ? 'credentialRef' \
           OR coalesce({t}.metadata->'fingerprintMaterial' ? 'sourceId', false) \
           OR coalesce({t}.metadata->'projectionSetFingerprintMaterial' ? 'sourceId', false) \
           OR coalesce({t}.metadata->'provenance' ? 'sourceId', false) \
           OR coalesce({t}.metadata->'provenance' ? 'providerItemId', false))"
    )
}

/// Whether a publication's metadata (`expr`) still carries a source identity.
pub(super) fn publication_source_identity(expr: &str) -> String {
    let has = |e: String| {
        format!(
            "(coalesce({e} ? 'sourceId', false) OR coalesce({e} ? 'credentialRef', false) \
               OR coalesce({e} ? 'sourceSnapshots', false) \
               OR coalesce({e}->'provenance' ? 'sourceId', false) \
               OR coalesce({e}->'provenance' ? 'providerItemId', false))"
        )
    };
    format!(
        "({} OR {} OR {})",
        has(expr.to_owned()),
        has(format!("{expr}->'fingerprintMaterial'")),
        has(format!("{expr}->'projectionSetFingerprintMaterial'"))
    )
}

pub(super) async fn derived_step(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
    ports: &Ports,
) -> Result<Event, JobError> {
    // One page per step, shared by the parts in their order: a part that leaves room in the
    // page lets the next one use the rest, so a small document's rows go in a few steps.
    let page = u64::try_from(cfg.page_size.max(1)).unwrap_or(1);
    let mut done = 0u64;
    for part in parts(job.scope) {
        let left = page - done;
        let part_cfg = DeletionConfig {
            page_size: i64::try_from(left).unwrap_or(i64::MAX),
            ..cfg.clone()
        };
        let n = match part {
            Part::Sql(sql) => sql::run(tx, job, part_cfg.page_size, &sql).await?,
            Part::Research => derived::research(tx, job, &part_cfg).await?,
            Part::Historical => derived::historical(tx, job, &part_cfg).await?,
            Part::Traces => derived::traces(tx, job, &part_cfg).await?,
            Part::Nodes => derived::nodes(tx, job, &part_cfg).await?,
        };
        done += n;
        if done >= page {
            break;
        }
    }
    if done > 0 {
        return Ok(Event::PageDone);
    }
    // A compile attempt of another document may still build on a historical publication of the
    // target: wait for it to rebase or end rather than delete it from under it.
    if job.scope != Scope::Space && derived::historical_held(tx, job).await? {
        return Ok(Event::LeasesActive {
            retry_in: cfg.max_wait.min(std::time::Duration::from_secs(1)),
        });
    }
    // The caches last, prefix by prefix.
    let limit = usize::try_from(cfg.page_size.max(1)).unwrap_or(500);
    for prefix in cache_prefixes(&job.tenant, job.space) {
        let page = ports
            .cache
            .delete_prefix(&prefix, limit)
            .await
            .map_err(|e| JobError::retryable(e.code, e.message))?;
        if page.more && page.deleted == 0 {
            return Err(JobError::retryable(
                "cache_no_progress",
                "the retrieval cache reported more keys but deleted none",
            ));
        }
        if page.deleted > 0 || page.more {
            return Ok(Event::PageDone);
        }
    }
    Ok(Event::PhaseDone)
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    #[test]
    fn every_statement_names_tenant_and_space_and_holds_one_page() {
        for scope in [
            Scope::Space,
            Scope::Document(Uuid::nil()),
            Scope::SourceKeep(Uuid::nil()),
            Scope::SourceCascade(Uuid::nil()),
        ] {
            for part in parts(scope) {
                let Part::Sql(sql) = part else { continue };
                assert!(sql.contains("p.tenant"), "{scope:?}: {sql}");
                assert!(sql.contains("p.space"), "{scope:?}: {sql}");
                assert!(
                    sql.contains("LIMIT (SELECT lim FROM p)"),
                    "{scope:?}: {sql}"
                );
            }
        }
    }

    #[test]
    fn a_kept_source_keeps_its_documents_derived_rows() {
        for part in parts(Scope::SourceKeep(Uuid::nil())) {
            let sql = match part {
                Part::Sql(sql) => sql,
                Part::Research | Part::Historical => continue,
                Part::Traces | Part::Nodes => panic!("keep runs no document part"),
            };
            for t in [
                "knowledge_nodes",
                "document_outlines",
                "parse_artifacts",
                "index_projections",
                "document_assets",
            ] {
                assert!(!sql.contains(&format!("DELETE FROM {t}")), "{sql}");
            }
        }
    }

    #[test]
    fn permission_snapshots_go_after_everything_that_binds_them() {
        let pos = |t: &str| SPACE_TABLES.iter().position(|(n, _)| *n == t).unwrap();
        let snapshots = pos("knowledge_space_permission_snapshots");
        for binder in [
            "document_compilation_attempts",
            "research_task_jobs",
            "answer_traces",
        ] {
            assert!(pos(binder) < snapshots, "{binder}");
        }
        assert!(snapshots < pos("knowledge_space_api_keys"));
        assert!(pos("knowledge_space_access_policies") < pos("knowledge_space_members"));
        assert!(pos("projection_set_publication_heads") < pos("projection_set_publications"));
        assert!(pos("document_compilation_attempts") < pos("projection_set_publications"));
        // The 0019..0054 RESTRICT keys: migration runs and bulk operations bind snapshots and
        // grants, bindings and migration runs name publications.
        for binder in ["knowledge_space_profile_migration_runs", "bulk_operations"] {
            assert!(pos(binder) < snapshots, "{binder}");
        }
        for binder in [
            "knowledge_space_profile_migration_runs",
            "knowledge_space_profile_publication_bindings",
        ] {
            assert!(pos(binder) < pos("projection_set_publications"), "{binder}");
        }
    }

    #[test]
    fn a_child_page_reads_its_parents_as_an_uncorrelated_set() {
        let cases = [
            (
                "q.knowledge_space_id = p.space AND q.tenant_id = p.tenant",
                "q.knowledge_space_id = (SELECT space FROM p) AND q.tenant_id = (SELECT tenant FROM p)",
            ),
            ("q.id = p.target OR q.job_id = p.job", "q.id = (SELECT target FROM p) OR q.job_id = (SELECT job FROM p)"),
            // Other aliases, other columns and longer names are left alone.
            ("ip.space = 1 AND p.spaces = 2 AND p.lim = 3", "ip.space = 1 AND p.spaces = 2 AND p.lim = 3"),
            ("x.p.space", "x.p.space"),
        ];
        for (filter, want) in cases {
            assert_eq!(uncorrelated(filter), want, "{filter}");
        }
        for (_, filter) in document_children() {
            if let Some((_, parents)) = filter.split_once("IN (SELECT q.id") {
                assert!(!parents.contains("= p."), "{filter}");
            }
        }
    }
}
