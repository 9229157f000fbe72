//! `quiescing`: drain everything that may still write to or read from the target, build the
//! inventory page by page, and take the target out of the published head. Invariant: work that
//! is queued, pending or whose lease expired is canceled (compile attempts and their outbox,
//! research tasks and their outbox, staged commits, legacy bootstraps, page-index, full-text and
//! credential backfills, syncing sources, a source's or a space's source workflow runs and their
//! outbox; a space's pending OAuth transactions fail and its source connections are revoked, their
//! secret references retired) or reclaimed (retrieval, KnowledgeFS and mutation leases); work
//! holding a live lease is only waited for, never taken; the inventory advances
//! only while nothing is live, a writer seen after the inventory was complete resets it, and the
//! head swap happens in the same transaction as the last drain check.

use std::time::Duration;

use sqlx::PgConnection;

use super::ports::Ports;
use super::sql::{self, scoped, with, OWNED};
use super::walk::Event;
use super::{clamp_wait, head, inventory, DeletionConfig, JobRow, Scope};
use crate::engine::lease::LEASE_CLEAR;
use crate::jobs::JobError;

/// The platform's terminal staged-commit states.
const STAGED_TERMINAL: &str = "('published', 'failed-terminal', 'canceled', 'gc-complete')";

/// Epoch milliseconds now, for the research tables.
const NOW_MS: &str = "(extract(epoch from now()) * 1000)::bigint";

/// What quiescing writes on the jobs it ends.
pub const FENCE_CODE: &str = "DURABLE_DELETION_FENCE";
pub const FENCE_MESSAGE: &str = "Canceled by durable deletion";

pub(super) async fn step(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
    ports: &Ports,
) -> Result<Event, JobError> {
    if let Some(retry_in) = drain(tx, job, cfg).await? {
        if job.inventory_complete {
            inventory::reset_after_late_writer(tx, job).await?;
            return Ok(Event::LateWriter { retry_in });
        }
        return Ok(Event::LeasesActive { retry_in });
    }
    if !job.inventory_complete {
        if !inventory::page(tx, job, cfg, ports).await? {
            return Ok(Event::PageDone);
        }
        // Complete now: a writer that became active while it was built makes it stale.
        if let Some(retry_in) = drain(tx, job, cfg).await? {
            inventory::reset_after_late_writer(tx, job).await?;
            return Ok(Event::LateWriter { retry_in });
        }
    }
    head::exclude_target(tx, job).await?;
    Ok(Event::PhaseDone)
}

/// Cancels and reclaims what may be taken, then returns how long to wait if anything still
/// holds a live lease on the target.
pub(super) async fn drain(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
) -> Result<Option<Duration>, JobError> {
    for sql in cancel_statements(job.scope) {
        sql::run(tx, job, cfg.page_size, &sql).await?;
    }
    // Retrieval leases whose heartbeat expired, a bounded batch per look.
    sql::run(
        tx,
        job,
        1000,
        &format!(
            "{}, expired AS (SELECT r.id FROM retrieval_execution_leases r, p WHERE {} AND r.status = 'active' \
               AND r.expires_at <= now() ORDER BY r.expires_at, r.id LIMIT (SELECT lim FROM p) FOR UPDATE) \
             UPDATE retrieval_execution_leases x SET status = 'expired', row_version = x.row_version + 1, \
               updated_at = greatest(now(), x.acquired_at) \
             FROM p WHERE {} AND x.id IN (SELECT id FROM expired)",
            with(job.scope),
            scoped("r"),
            scoped("x"),
        ),
    )
    .await?;
    let (live, min_ms, untimed): (i64, Option<f64>, i64) = sqlx::query_as(&live_sql(job.scope))
        .bind(&job.tenant)
        .bind(job.space)
        .bind(job.target_id)
        .bind(1_i64)
        .bind(job.id)
        .fetch_one(&mut *tx)
        .await?;
    if live == 0 {
        return Ok(None);
    }
    let ms = if untimed > 0 {
        Some(min_ms.map_or(1000.0, |m| m.min(1000.0)))
    } else {
        min_ms
    };
    Ok(Some(clamp_wait(
        ms,
        Duration::from_millis(100),
        cfg.max_wait,
    )))
}

/// The documents whose compile work a target stops (alias `a`, a table with
/// `document_asset_id`).
fn target_documents(scope: Scope, a: &str) -> String {
    match scope {
        Scope::Space => "TRUE".into(),
        _ => format!("{a}.document_asset_id IN (SELECT id FROM td)"),
    }
}

/// The sources whose syncs and credential backfills a target stops (alias `a`, its source
/// column `col`).
fn target_sources(scope: Scope, a: &str, col: &str) -> String {
    match scope {
        Scope::Space => "TRUE".into(),
        Scope::SourceKeep(_) | Scope::SourceCascade(_) => format!("{a}.{col} = p.target"),
        Scope::Document(_) => format!(
            "{a}.{col} IN (SELECT d.source_id FROM document_assets d WHERE d.knowledge_space_id = p.space \
               AND d.id = p.target AND d.source_id IS NOT NULL)"
        ),
        // The document's own source, and its fenced assets' sources.
        Scope::LogicalDocument(_) => format!(
            "({a}.{col} IN (SELECT l.source_id FROM logical_documents l WHERE l.tenant_id = p.tenant \
               AND l.knowledge_space_id = p.space AND l.id = p.target AND l.source_id IS NOT NULL) \
             OR {a}.{col} IN (SELECT d.source_id FROM document_assets d WHERE d.knowledge_space_id = p.space \
               AND d.deletion_job_id = p.job AND d.source_id IS NOT NULL))"
        ),
    }
}

/// The platform's `cancelScopedWork`, in its order.
fn cancel_statements(scope: Scope) -> Vec<String> {
    let w = with(scope);
    let mut out = vec![
        // Expired KnowledgeFS leases of the space are released.
        format!(
            "{w} UPDATE knowledge_fs_leases l SET status = 'released', updated_at = now() FROM p \
             WHERE {} AND l.status = 'active' AND l.expires_at <= now()",
            scoped("l")
        ),
        // Research tasks without a live lease are canceled, with their outbox.
        format!(
            "{w} UPDATE research_task_jobs j SET stage = 'canceled', {LEASE_CLEAR}, retry_at = NULL, completed_at = {NOW_MS}, \
               updated_at = {NOW_MS}, row_version = j.row_version + 1 FROM p \
             WHERE {} AND j.stage NOT IN ('completed', 'failed', 'canceled') \
               AND (j.lease_token IS NULL OR j.lease_expires_at <= {NOW_MS})",
            scoped("j")
        ),
        format!(
            "{w} UPDATE research_task_outbox o SET status = 'canceled', lock_token = NULL, locked_by = NULL, \
               locked_until = NULL, updated_at = {NOW_MS} FROM p \
             WHERE o.research_task_job_id IN (SELECT j.id FROM research_task_jobs j WHERE {} AND j.stage = 'canceled') \
               AND o.status NOT IN ('completed', 'canceled', 'dead')",
            scoped("j")
        ),
        // Staged commits of the space that are not final are canceled.
        format!(
            "{w} UPDATE knowledge_space_staged_commits sc SET status = 'canceled', updated_at = now() FROM p \
             WHERE {} AND sc.status NOT IN {STAGED_TERMINAL}",
            scoped("sc")
        ),
        // Mutation leases that expired or never had an expiry are gone.
        format!(
            "{w} DELETE FROM knowledge_space_mutation_leases m USING p \
             WHERE {} AND (m.expires_at IS NULL OR m.expires_at <= now())",
            scoped("m")
        ),
    ];
    let backfill = format!(
        "{w} UPDATE source_credential_backfills b SET run_state = 'failed', {LEASE_CLEAR}, completed_at = now(), updated_at = now(), \
           last_error_code = '{FENCE_CODE}', last_error_message = '{FENCE_MESSAGE}', row_version = b.row_version + 1 \
         FROM p WHERE {} AND {} AND (b.run_state = 'queued' OR (b.run_state = 'running' AND b.lease_expires_at <= now()))",
        scoped("b"),
        target_sources(scope, "b", "source_id")
    );
    let syncing = format!(
        "{w} UPDATE sources s SET status = 'disabled', updated_at = now(), version = s.version + 1 FROM p \
         WHERE s.knowledge_space_id = p.space AND {OWNED} AND {} AND s.status = 'syncing'",
        target_sources(scope, "s", "id")
    );
    if let Some(runs) = sql::source_runs(scope, "r") {
        out.push(format!(
            "{w} UPDATE source_workflow_runs r SET run_state = 'canceled', active_slot = NULL, completed_at = now(), \
               canceled_at = now(), worker_id = NULL, lease_token = NULL, lease_expires_at = NULL, \
               last_error_code = '{FENCE_CODE}', last_error_message = '{FENCE_MESSAGE}', row_version = r.row_version + 1, \
               updated_at = now() FROM p \
             WHERE {runs} AND (r.run_state IN ('queued', 'preview_ready') \
               OR (r.run_state IN ('running', 'crawling', 'importing', 'syncing') AND r.lease_expires_at <= now()))"
        ));
        out.push(format!(
            "{w} UPDATE source_workflow_outbox o SET status = 'canceled', lock_token = NULL, locked_by = NULL, \
               locked_until = NULL, updated_at = now() FROM p \
             WHERE o.run_id IN (SELECT r.id FROM source_workflow_runs r WHERE {runs} AND r.run_state = 'canceled') \
               AND o.status IN ('pending', 'leased')"
        ));
    }
    if scope == Scope::Space {
        out.push(format!(
            "{w} UPDATE source_oauth_transactions t SET status = 'failed', consumed_at = coalesce(t.consumed_at, now()) \
             FROM p WHERE {} AND t.status IN ('pending', 'exchanging')",
            scoped("t")
        ));
        out.push(format!(
            "{w} UPDATE source_connection_secret_refs t SET state = 'retired', row_version = t.row_version + 1, \
               updated_at = now() FROM p WHERE {} AND t.state IN ('staged', 'active')",
            scoped("t")
        ));
        out.push(format!(
            "{w} UPDATE source_connections t SET status = 'revoked', credential_ref = NULL, version = t.version + 1, \
               updated_at = now() FROM p WHERE {} AND t.status <> 'revoked'",
            scoped("t")
        ));
    }
    if let Scope::SourceKeep(_) = scope {
        // Keep retains the documents: their compile work and the space's workers go on.
        out.push(syncing);
        out.push(backfill);
        return out;
    }
    out.push(format!(
        "{w} UPDATE document_compilation_attempts a SET run_state = 'canceled', active_slot = NULL, {LEASE_CLEAR}, retry_at = NULL, completed_at = now(), \
           updated_at = now(), row_version = a.row_version + 1 FROM p \
         WHERE {} AND {} AND (a.run_state IN ('dispatch_pending', 'queued', 'retry_wait') \
           OR (a.run_state = 'running' AND a.lease_expires_at <= now()))",
        scoped("a"),
        target_documents(scope, "a")
    ));
    out.push(format!(
        "{w} UPDATE document_compilation_outbox o SET status = 'canceled', lock_token = NULL, locked_by = NULL, \
           locked_until = NULL, updated_at = now() FROM p \
         WHERE o.attempt_id IN (SELECT a.id FROM document_compilation_attempts a WHERE {} AND {} \
             AND a.run_state = 'canceled') \
           AND o.status NOT IN ('completed', 'canceled', 'dead')",
        scoped("a"),
        target_documents(scope, "a")
    ));
    out.push(syncing);
    for (table, terminal) in [
        ("legacy_space_publication_bootstraps", "canceled"),
        ("page_index_upgrade_backfills", "superseded"),
        ("tidb_fts_posting_backfills", "failed"),
    ] {
        out.push(format!(
            "{w} UPDATE {table} b SET run_state = '{terminal}', {LEASE_CLEAR}, completed_at = now(), updated_at = now(), \
               last_error_code = '{FENCE_CODE}', last_error_message = '{FENCE_MESSAGE}', row_version = b.row_version + 1 \
             FROM p WHERE {} AND (b.run_state = 'queued' OR (b.run_state = 'running' AND b.lease_expires_at <= now()))",
            scoped("b")
        ));
    }
    out.push(backfill);
    out
}

/// What is still live: `(count, earliest expiry in ms from now, rows without an expiry)`.
fn live_sql(scope: Scope) -> String {
    let ms = |expr: &str| format!("(EXTRACT(EPOCH FROM ({expr} - now())) * 1000)::float8");
    let running = |table: &str| {
        format!(
            "SELECT {} FROM {table} b, p WHERE {} AND b.run_state = 'running' AND b.lease_expires_at > now()",
            ms("b.lease_expires_at"),
            scoped("b")
        )
    };
    let mut parts = vec![
        // Active retrieval leases, live or expired beyond this look's batch.
        format!(
            "SELECT {} FROM retrieval_execution_leases r, p WHERE {} AND r.status = 'active'",
            ms("r.expires_at"),
            scoped("r")
        ),
        format!(
            "SELECT (j.lease_expires_at - {NOW_MS})::float8 FROM research_task_jobs j, p WHERE {} \
               AND j.lease_token IS NOT NULL AND j.lease_expires_at > {NOW_MS}",
            scoped("j")
        ),
        format!(
            "SELECT {} FROM knowledge_fs_leases l, p WHERE {} AND l.status = 'active' AND l.expires_at > now()",
            ms("l.expires_at"),
            sql::fs_lease_target(scope, "l")
        ),
        format!(
            "SELECT {} FROM knowledge_fs_leases l, p WHERE {} AND l.status = 'active' AND l.expires_at > now()",
            ms("l.expires_at"),
            scoped("l")
        ),
        format!(
            "SELECT {} FROM knowledge_space_mutation_leases m, p WHERE {} AND m.expires_at > now()",
            ms("m.expires_at"),
            scoped("m")
        ),
        format!(
            "SELECT NULL::float8 FROM knowledge_space_staged_commits sc, p WHERE {} AND {} \
               AND sc.status NOT IN {STAGED_TERMINAL}",
            scoped("sc"),
            target_documents(scope, "sc")
        ),
        format!(
            "{} AND {}",
            running("source_credential_backfills"),
            target_sources(scope, "b", "source_id")
        ),
        format!(
            "SELECT NULL::float8 FROM sources s, p WHERE s.knowledge_space_id = p.space AND {OWNED} AND {} \
               AND s.status = 'syncing'",
            target_sources(scope, "s", "id")
        ),
    ];
    if let Some(runs) = sql::source_runs(scope, "r") {
        parts.push(format!(
            "SELECT {} FROM source_workflow_runs r, p WHERE {runs} \
               AND r.run_state IN ('running', 'crawling', 'importing', 'syncing') AND r.lease_expires_at > now()",
            ms("r.lease_expires_at")
        ));
    }
    if !matches!(scope, Scope::SourceKeep(_)) {
        parts.push(format!(
            "{} AND {}",
            running("document_compilation_attempts"),
            target_documents(scope, "b")
        ));
        for t in [
            "legacy_space_publication_bootstraps",
            "page_index_upgrade_backfills",
            "tidb_fts_posting_backfills",
        ] {
            parts.push(running(t));
        }
    }
    format!(
        "{} SELECT count(*), min(ms), count(*) FILTER (WHERE ms IS NULL) FROM ({}) AS live(ms)",
        with(scope),
        parts.join(" UNION ALL ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    #[test]
    fn every_cancel_and_probe_names_tenant_and_space() {
        for scope in [
            Scope::Space,
            Scope::Document(Uuid::nil()),
            Scope::SourceKeep(Uuid::nil()),
            Scope::SourceCascade(Uuid::nil()),
        ] {
            let stmts = cancel_statements(scope);
            for sql in stmts.iter().chain(std::iter::once(&live_sql(scope))) {
                assert!(sql.contains("p.tenant"), "{scope:?}: {sql}");
                assert!(sql.contains("p.space"), "{scope:?}: {sql}");
            }
            let compile = stmts
                .iter()
                .any(|s| s.contains("UPDATE document_compilation_attempts"));
            // Keep retains its documents, so their compile work goes on.
            assert_eq!(compile, !matches!(scope, Scope::SourceKeep(_)), "{scope:?}");
        }
    }
}
