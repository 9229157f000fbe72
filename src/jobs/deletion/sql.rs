//! SQL shared by the deletion statements: the parameter row `p`, the target's documents and
//! nodes, and the platform's predicates for "this row belongs to the target" (graph, traces,
//! evidence, golden questions, knowledge paths, KnowledgeFS leases, historical publications).
//! Invariant: every statement built here binds `$1` tenant, `$2` space, `$3` target, `$4` page
//! size, `$5` job, and every row set it names is confined to `p.space` of `p.tenant` (tables
//! without a tenant column are confined through the space row of the tenant).

use sqlx::PgConnection;

use super::{JobRow, Scope};
use crate::jobs::JobError;

/// The parameter row.
pub(super) const P: &str =
    "p AS (SELECT $1::varchar AS tenant, $2::uuid AS space, $3::uuid AS target, \
     $4::bigint AS lim, $5::uuid AS job)";

/// The space belongs to the tenant (for tables without a tenant column).
pub(super) const OWNED: &str =
    "EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = p.space AND k.tenant_id = p.tenant)";

/// `{a}` is a row of the job's tenant and space (a table with both columns).
pub(super) fn scoped(a: &str) -> String {
    format!("{a}.tenant_id = p.tenant AND {a}.knowledge_space_id = p.space")
}

/// `{a}` is a row of the job's space (a table with a space column only), of the job's tenant.
pub(super) fn in_space(a: &str) -> String {
    format!("{a}.knowledge_space_id = p.space AND {OWNED}")
}

/// The target's documents (`td`): the space's, the source's, the one document, or the assets a
/// logical document's request fenced with the job.
fn td(scope: Scope) -> String {
    let filter = match scope {
        Scope::Space => "TRUE",
        Scope::Document(_) => "d.id = p.target",
        Scope::LogicalDocument(_) => "d.deletion_job_id = p.job",
        Scope::SourceKeep(_) | Scope::SourceCascade(_) => "d.source_id = p.target",
    };
    format!(
        "td AS (SELECT d.id FROM document_assets d, p WHERE d.knowledge_space_id = p.space AND {filter} AND {OWNED})"
    )
}

/// `jsonb` array `expr`, or an empty one.
pub(super) fn arr(expr: &str) -> String {
    format!("(CASE WHEN jsonb_typeof({expr}) = 'array' THEN {expr} ELSE '[]'::jsonb END)")
}

/// Evidence items (`expr`, a JSON array) cite a target document or one of its nodes.
pub(super) fn items_ref(expr: &str) -> String {
    format!(
        "EXISTS (SELECT 1 FROM jsonb_array_elements({}) it WHERE jsonb_typeof(it) = 'object' AND ( \
           it->>'nodeId' IN (SELECT id::text FROM tn) \
           OR EXISTS (SELECT 1 FROM jsonb_array_elements({}) c WHERE jsonb_typeof(c) = 'object' \
             AND c->>'documentAssetId' IN (SELECT id::text FROM td))))",
        arr(expr),
        arr("it->'citations'")
    )
}

/// An answer trace (`t`) whose evidence (its bundle, or a step's bundle) cites the target.
fn trace_ref(t: &str) -> String {
    format!(
        "(EXISTS (SELECT 1 FROM evidence_bundles b WHERE b.tenant_id = p.tenant AND b.knowledge_space_id = p.space \
            AND (b.id = {t}.evidence_bundle_id OR b.trace_id = {t}.id) AND {}) \
          OR EXISTS (SELECT 1 FROM answer_trace_steps s WHERE s.trace_id = {t}.id AND {}))",
        items_ref("b.items"),
        items_ref("s.metadata->'evidenceBundle'->'items'")
    )
}

/// The `WITH` list of every statement: `p`, `td`, `tn` (the target documents' nodes), `tb`
/// (evidence bundles citing the target), `ttr` (traces citing it) and `tref` (every id a golden
/// question may use to point at the target). Unreferenced ones cost nothing.
pub(super) fn with(scope: Scope) -> String {
    let whole = scope == Scope::Space;
    let tb = if whole {
        "TRUE".to_owned()
    } else {
        items_ref("b.items")
    };
    let ttr = if whole {
        "TRUE".to_owned()
    } else {
        trace_ref("t")
    };
    format!(
        "WITH {P}, {}, \
         tn AS (SELECT n.id FROM knowledge_nodes n, p WHERE n.knowledge_space_id = p.space AND n.document_asset_id IN (SELECT id FROM td)), \
         tb AS (SELECT b.id FROM evidence_bundles b, p WHERE b.tenant_id = p.tenant AND b.knowledge_space_id = p.space AND {tb}), \
         ttr AS (SELECT t.id FROM answer_traces t, p WHERE t.knowledge_space_id = p.space AND {OWNED} AND {ttr}), \
         tref AS (SELECT id::text AS r FROM td UNION ALL SELECT id::text FROM tn \
                  UNION ALL SELECT id::text FROM tb UNION ALL SELECT id::text FROM ttr)",
        td(scope)
    )
}

/// A golden question (`g`) of the target: every question of the space for a space or a kept
/// source; else one whose expected evidence, evidence context or trace names the target.
pub(super) fn golden(scope: Scope, g: &str) -> String {
    let base = in_space(g);
    if matches!(scope, Scope::Space | Scope::SourceKeep(_)) {
        return base;
    }
    let ctx = format!("{g}.metadata->'evidenceContext'");
    format!(
        "{base} AND ( \
           {ids} ?| ARRAY(SELECT r FROM tref) \
           OR {ctx_ids} ?| ARRAY(SELECT r FROM tref) \
           OR EXISTS (SELECT 1 FROM jsonb_array_elements({missing}) me WHERE jsonb_typeof(me) = 'object' \
                AND me->>'expectedEvidenceId' IN (SELECT r FROM tref)) \
           OR {items} \
           OR {g}.metadata->>'traceId' IN (SELECT id::text FROM ttr) \
           OR {g}.metadata->>'answerTraceId' IN (SELECT id::text FROM ttr) \
           OR {ctx}->>'traceId' IN (SELECT id::text FROM ttr))",
        ids = arr(&format!("{g}.expected_evidence_ids")),
        ctx_ids = arr(&format!("{ctx}->'expectedEvidenceIds'")),
        missing = arr(&format!("{ctx}->'missingEvidence'")),
        items = items_ref(&format!("{ctx}->'items'")),
    )
}

/// A knowledge path (`kp`) of the target's documents (the platform's "semantic" paths): a
/// document path, or one whose metadata lists a target document or node, or a community path of
/// a community that a target document belongs to. Every path of the space for a space.
pub(super) fn semantic_path(scope: Scope, kp: &str) -> String {
    let base = in_space(kp);
    if scope == Scope::Space {
        return base;
    }
    format!(
        "{base} AND ( \
           ({kp}.resource_type = 'document' AND {kp}.target_id IN (SELECT id::text FROM td)) \
           OR {docs} ?| ARRAY(SELECT id::text FROM td) \
           OR {nodes} ?| ARRAY(SELECT id::text FROM tn) \
           OR ({kp}.view_name = 'by-community' AND {kp}.metadata ? 'communityId' AND {kp}.metadata->>'communityId' IN ( \
                SELECT c.metadata->>'communityId' FROM knowledge_paths c WHERE c.knowledge_space_id = p.space \
                  AND c.view_name = 'by-community' AND {cdocs} ?| ARRAY(SELECT id::text FROM td))))",
        docs = arr(&format!("{kp}.metadata->'documentAssetIds'")),
        nodes = arr(&format!("{kp}.metadata->'sourceSummaryNodeIds'")),
        cdocs = arr("c.metadata->'documentAssetIds'"),
    )
}

/// A KnowledgeFS lease (`l`) on the target: any lease of the space for a space; else one on the
/// space itself, a target document (by id, path or metadata), its parse artifacts, projections,
/// knowledge paths or staged commits.
pub(super) fn fs_lease_target(scope: Scope, l: &str) -> String {
    let base = scoped(l);
    if scope == Scope::Space {
        return base;
    }
    format!(
        "{base} AND ( \
           ({l}.target_type = 'knowledge-space' AND {l}.target_id = p.space::text) \
           OR ({l}.target_type = 'document-asset' AND {l}.target_id IN (SELECT id::text FROM td)) \
           OR {l}.virtual_path IN (SELECT '/sources/documents/' || id::text FROM td) \
           OR {l}.metadata->>'documentAssetId' IN (SELECT id::text FROM td) \
           OR ({l}.target_type = 'parse-artifact' AND {l}.target_id IN ( \
                SELECT pa.id::text FROM parse_artifacts pa WHERE pa.document_asset_id IN (SELECT id FROM td))) \
           OR ({l}.target_type = 'projection' AND {l}.target_id IN ( \
                SELECT ip.id::text FROM index_projections ip WHERE ip.knowledge_space_id = p.space \
                  AND ip.node_id IN (SELECT id FROM tn))) \
           OR ({l}.target_type = 'knowledge-path' AND ({l}.target_id IN ( \
                SELECT kp.id::text FROM knowledge_paths kp WHERE {sem}) OR {l}.target_id IN ( \
                SELECT kp.virtual_path FROM knowledge_paths kp WHERE {sem}))) \
           OR ({l}.target_type = 'staged-commit' AND {l}.target_id IN ( \
                SELECT x FROM knowledge_space_staged_commits sc, \
                  LATERAL (VALUES (sc.id::text), (sc.raw_object_key), (sc.published_object_key)) v(x) \
                WHERE sc.tenant_id = p.tenant AND sc.knowledge_space_id = p.space \
                  AND sc.document_asset_id IN (SELECT id FROM td) AND x IS NOT NULL)))",
        sem = semantic_path(scope, "kp"),
    )
}

/// A source workflow run (`r`) the target takes with it: every run of the space; for a source,
/// its own runs and the bulk runs with an item for it that does not remove it (a bulk remove
/// run observes this very deletion and stays). `None`: the target takes no run.
pub(super) fn source_runs(scope: Scope, r: &str) -> Option<String> {
    match scope {
        Scope::Space => Some(scoped(r)),
        Scope::SourceKeep(_) | Scope::SourceCascade(_) => Some(format!(
            "{} AND ({r}.source_id = p.target OR EXISTS (SELECT 1 FROM source_bulk_workflow_items sb \
               WHERE sb.run_id = {r}.id AND sb.tenant_id = p.tenant AND sb.knowledge_space_id = p.space \
                 AND sb.source_id = p.target AND sb.action <> 'remove'))",
            scoped(r)
        )),
        Scope::Document(_) | Scope::LogicalDocument(_) => None,
    }
}

/// A publication (`pb`) of the space other than the head's that serves a target document or
/// names one in its fingerprint material: the platform's "historical" publications.
pub(super) fn historical_publication(pb: &str) -> String {
    let snap = |expr: &str| {
        format!(
            "EXISTS (SELECT 1 FROM jsonb_array_elements({}) s WHERE jsonb_typeof(s) = 'object' \
               AND s->>'documentAssetId' IN (SELECT id::text FROM td))",
            arr(expr)
        )
    };
    format!(
        "{} AND NOT EXISTS (SELECT 1 FROM projection_set_publication_heads h WHERE h.tenant_id = p.tenant \
             AND h.knowledge_space_id = p.space AND h.publication_id = {pb}.id) \
         AND (EXISTS (SELECT 1 FROM projection_set_publication_members m WHERE m.tenant_id = p.tenant \
                AND m.knowledge_space_id = p.space AND m.publication_id = {pb}.id \
                AND m.document_asset_id IN (SELECT id FROM td)) \
              OR {} OR {} OR {})",
        scoped(pb),
        snap(&format!("{pb}.metadata->'sourceSnapshots'")),
        snap(&format!("{pb}.metadata->'fingerprintMaterial'->'sourceSnapshots'")),
        snap(&format!("{pb}.metadata->'projectionSetFingerprintMaterial'->'sourceSnapshots'")),
    )
}

/// A page delete: up to one page of `table` rows (alias `t`) matching `filter`, by primary key
/// `id`, in key order.
pub(super) fn page_delete(scope: Scope, table: &str, filter: &str) -> String {
    format!(
        "{}, victims AS (SELECT t.id FROM {table} t, p WHERE {filter} ORDER BY t.id LIMIT (SELECT lim FROM p)) \
         DELETE FROM {table} x WHERE x.id IN (SELECT id FROM victims)",
        with(scope)
    )
}

/// A page delete of a table without a single-column key, by row address.
pub(super) fn page_delete_rows(scope: Scope, table: &str, filter: &str) -> String {
    format!(
        "{} DELETE FROM {table} x WHERE x.ctid = ANY(ARRAY( \
           SELECT t.ctid FROM {table} t, p WHERE {filter} LIMIT (SELECT lim FROM p)))",
        with(scope)
    )
}

/// `SELECT EXISTS` of one row of `table` (alias `t`) matching `filter`.
pub(super) fn exists(scope: Scope, table: &str, filter: &str) -> String {
    format!(
        "{} SELECT EXISTS (SELECT 1 FROM {table} t, p WHERE {filter})",
        with(scope)
    )
}

/// Runs a statement built here with the job's parameters; rows changed.
pub(super) async fn run(
    tx: &mut PgConnection,
    job: &JobRow,
    limit: i64,
    sql: &str,
) -> Result<u64, JobError> {
    Ok(sqlx::query(sql)
        .bind(&job.tenant)
        .bind(job.space)
        .bind(job.target_id)
        .bind(limit)
        .bind(job.id)
        .execute(&mut *tx)
        .await?
        .rows_affected())
}

/// Runs a `SELECT EXISTS` built here with the job's parameters.
pub(super) async fn found(
    tx: &mut PgConnection,
    job: &JobRow,
    sql: &str,
) -> Result<bool, JobError> {
    Ok(sqlx::query_scalar(sql)
        .bind(&job.tenant)
        .bind(job.space)
        .bind(job.target_id)
        .bind(1_i64)
        .bind(job.id)
        .fetch_one(&mut *tx)
        .await?)
}

/// Ids returned by a statement built here (a page of them).
pub(super) async fn ids(
    tx: &mut PgConnection,
    job: &JobRow,
    limit: i64,
    sql: &str,
) -> Result<Vec<uuid::Uuid>, JobError> {
    Ok(sqlx::query_scalar(sql)
        .bind(&job.tenant)
        .bind(job.space)
        .bind(job.target_id)
        .bind(limit)
        .bind(job.id)
        .fetch_all(&mut *tx)
        .await?)
}

/// Runs a statement built here with the job's parameters and `$6` a `uuid[]`; rows changed.
pub(super) async fn run_ids(
    tx: &mut PgConnection,
    job: &JobRow,
    limit: i64,
    sql: &str,
    ids: &[uuid::Uuid],
) -> Result<u64, JobError> {
    Ok(sqlx::query(sql)
        .bind(&job.tenant)
        .bind(job.space)
        .bind(job.target_id)
        .bind(limit)
        .bind(job.id)
        .bind(ids)
        .execute(&mut *tx)
        .await?
        .rows_affected())
}
