//! Maintenance: early takeover of dead workers' jobs, and retention of finished outbox rows.
//! Invariant: maintenance only ever makes a row due sooner or deletes rows that are finished
//! (`completed`, `canceled`) and old; it never decides who runs a job: the claim does. The
//! sweep, which every process runs every second, reads a job table only through indexes that
//! hold its running rows (see [`running`]), never the finished rows that make up nearly all of it.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::jobs::{Kind, States};

#[derive(Clone, Debug)]
pub struct MaintenanceConfig {
    pub sweep_every: Duration,
    /// How long a dead worker's job waits for the broker's own redelivery before the sweep
    /// publishes it again.
    pub sweep_grace: Duration,
    pub retention: Duration,
    pub retention_batch: i64,
    pub retention_every: Duration,
}

impl Default for MaintenanceConfig {
    fn default() -> Self {
        Self {
            sweep_every: Duration::from_secs(1),
            sweep_grace: Duration::from_secs(2),
            retention: Duration::from_secs(7 * 24 * 3600),
            retention_batch: 500,
            retention_every: Duration::from_secs(60),
        }
    }
}

/// Jobs leased by workers that are no longer alive, whose `leased` outbox rows wait for a later
/// time.
/// Every worker sweeps every kind each second, and almost always every holder is alive, so
/// the sweep first asks each distinct holder's liveness once (each question reads
/// `pg_locks`) and looks at outbox rows only when some holder is dead. Joining the outbox
/// first walked every dispatched row of a backlog (100 ms at 20,000) on every sweep.
pub async fn dead_leases(pool: &PgPool, kind: Kind) -> Result<Vec<uuid::Uuid>, sqlx::Error> {
    let sql = dead_leases_sql(kind);
    let mut conn = crate::db::acquire(pool).await?;
    sqlx::query_scalar(&sql).fetch_all(&mut *conn).await
}

/// The statement of [`dead_leases`]. It reads the job table only through an index on its
/// running rows (see [`running`]).
pub fn dead_leases_sql(kind: Kind) -> String {
    let running = running(kind);
    // `EXISTS (… dead)` gates the join, so no dead holder means no outbox scan.
    kind.spec().sql(&format!(
        "WITH {} \
         SELECT j.id FROM dead JOIN {{job}} j ON j.worker_id = dead.worker_id \
         JOIN {{outbox}} o ON o.{{fk}} = j.id \
         WHERE EXISTS (SELECT 1 FROM dead) AND {running} \
           AND o.status = 'leased' AND o.available_at > {{now}}",
        dead_holders(running)
    ))
}

/// Makes the outbox rows of `jobs` due now, if they are still leased by a dead worker, so the
/// relay publishes them again and a live worker takes over long before the lease would expire.
/// Only a `leased` row is re-armed: once published again it is `dispatched`, a message for it is
/// on its way, and its visibility window covers a lost one. Re-arming that row at every sweep
/// until a consumer reached the message (behind a backlog) published a stale copy per sweep,
/// each using a dispatch attempt, until the job failed for dispatch exhaustion.
/// Liveness is asked once per distinct holder, as in [`dead_leases`], not once per job.
pub async fn rearm(pool: &PgPool, kind: Kind, jobs: &[uuid::Uuid]) -> Result<u64, sqlx::Error> {
    let sql = rearm_sql(kind);
    let mut conn = crate::db::acquire(pool).await?;
    Ok(sqlx::query(&sql)
        .bind(jobs)
        .execute(&mut *conn)
        .await?
        .rows_affected())
}

/// The statement of [`rearm`]; `$1` is the jobs (`uuid[]`). It reads the job table by id.
pub fn rearm_sql(kind: Kind) -> String {
    let running = running(kind);
    kind.spec().sql(&format!(
        "WITH {} \
         UPDATE {{outbox}} o SET available_at = {{now}} FROM {{job}} j \
         WHERE j.id = ANY($1) AND o.{{fk}} = j.id AND o.status = 'leased' \
           AND o.available_at > {{now}} AND {running} \
           AND j.worker_id IN (SELECT worker_id FROM dead)",
        dead_holders(&format!("j.id = ANY($1) AND {running}"))
    ))
}

/// One sweep: what [`dead_leases`] finds, re-armed at once (no grace). Tests call this.
pub async fn sweep_once(pool: &PgPool, kind: Kind) -> Result<u64, sqlx::Error> {
    let jobs = dead_leases(pool, kind).await?;
    if jobs.is_empty() {
        return Ok(0);
    }
    rearm(pool, kind, &jobs).await
}

/// The CTE `dead`: the distinct holders of the jobs `j` matching `jobs` that are not alive.
/// `OFFSET 0` keeps the liveness filter above the `DISTINCT`, so each holder's liveness (a read
/// of `pg_locks`) is asked once, not once per job.
fn dead_holders(jobs: &str) -> String {
    format!(
        "dead AS MATERIALIZED ( \
           SELECT w.worker_id FROM (SELECT DISTINCT j.worker_id FROM {{job}} j WHERE {jobs} OFFSET 0) w \
           WHERE NOT kfs_worker_alive(w.worker_id) \
         )"
    )
}

/// A kind's running jobs `j`: the rows a sweep reads, each kind through an index whose leading
/// column or partial predicate is this condition, so that the finished rows, nearly all of a
/// table, are never read: `run_state` leads the run-state kinds' platform indexes (the compile's
/// lease recovery index, the deletion's claim index), and the stage kinds have their own
/// partial index over their leased rows ([`crate::db::indexes::OWN_INDEXES`]).
pub fn running(kind: Kind) -> &'static str {
    match kind.spec().states {
        States::RunState { .. } => "j.run_state = 'running'",
        States::Stage => "j.lease_token IS NOT NULL",
    }
}

/// The leases of earlier incarnations of a worker id: kept by [`crate::liveness`], the lowest
/// room that needs it.
pub use crate::liveness::EARLIER_INCARNATIONS;

/// Deletes up to `batch` finished outbox rows older than `older_than`. Dead rows stay: they are
/// the record of a failure and the handle of a manual retry.
pub async fn retention_once(
    pool: &PgPool,
    kind: Kind,
    older_than: Duration,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    let spec = kind.spec();
    let sql = spec.sql(
        "DELETE FROM {outbox} WHERE id IN ( \
           SELECT id FROM {outbox} WHERE status IN ('completed', 'canceled') AND updated_at < {now+$1} \
           LIMIT $2 FOR UPDATE SKIP LOCKED)",
    );
    let ms = -crate::engine::lease::millis(older_than);
    let mut conn = crate::db::acquire(pool).await?;
    Ok(sqlx::query(&sql)
        .bind(ms)
        .bind(batch)
        .execute(&mut *conn)
        .await?
        .rows_affected())
}

pub async fn run(
    pool: PgPool,
    kinds: Vec<Kind>,
    cfg: MaintenanceConfig,
    shutdown: CancellationToken,
) {
    let mut last_retention = tokio::time::Instant::now();
    // A dead worker's unacked deliveries come back from the broker at once, and usually win;
    // only jobs still held by a dead worker after a grace period are published again.
    let mut seen: std::collections::HashMap<(Kind, uuid::Uuid), tokio::time::Instant> =
        Default::default();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(cfg.sweep_every) => {}
        }
        let now = tokio::time::Instant::now();
        let mut still = std::collections::HashMap::new();
        for &kind in &kinds {
            let found = match dead_leases(&pool, kind).await {
                Ok(f) => f,
                Err(e) => {
                    tracing::debug!(kind = %kind, error = %e, "sweep failed");
                    continue;
                }
            };
            let mut due = Vec::new();
            for job in found {
                let first = *seen.get(&(kind, job)).unwrap_or(&now);
                if now.duration_since(first) >= cfg.sweep_grace {
                    due.push(job);
                }
                still.insert((kind, job), first);
            }
            if !due.is_empty() {
                match rearm(&pool, kind, &due).await {
                    Ok(0) => {}
                    Ok(n) => {
                        tracing::info!(kind = %kind, rows = n, "re-armed jobs of dead workers for takeover")
                    }
                    Err(e) => tracing::debug!(kind = %kind, error = %e, "re-arm failed"),
                }
            }
        }
        seen = still;
        if last_retention.elapsed() >= cfg.retention_every {
            last_retention = tokio::time::Instant::now();
            for &kind in &kinds {
                if let Err(e) =
                    retention_once(&pool, kind, cfg.retention, cfg.retention_batch).await
                {
                    tracing::debug!(kind = %kind, error = %e, "retention failed");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kind whose running rows no platform index leads with has a partial index of its own
    /// over exactly those rows, so that the sweep never reads its finished ones.
    #[test]
    fn every_stage_kind_has_an_index_over_its_running_rows() {
        for kind in Kind::all() {
            if !matches!(kind.spec().states, States::Stage) {
                continue;
            }
            let table = kind.spec().job_table;
            let predicate = format!("WHERE {}", running(kind).replace("j.", ""));
            assert!(
                crate::db::indexes::OWN_INDEXES
                    .iter()
                    .any(|i| i.table == table && i.definition.ends_with(&predicate)),
                "{kind}: no index of {table} {predicate}"
            );
        }
    }
}
