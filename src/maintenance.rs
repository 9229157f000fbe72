//! Maintenance: early takeover of dead workers' jobs, and retention of finished outbox rows.
//! Invariant: maintenance only ever makes a row due sooner or deletes rows that are finished
//! (`completed`, `canceled`) and old; it never decides who runs a job: the claim does.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::jobs::{Kind, States};

#[derive(Clone, Debug)]
pub struct MaintenanceConfig {
    pub sweep_every: Duration,
    pub retention: Duration,
    pub retention_batch: i64,
    pub retention_every: Duration,
}

impl Default for MaintenanceConfig {
    fn default() -> Self {
        Self {
            sweep_every: Duration::from_secs(1),
            retention: Duration::from_secs(7 * 24 * 3600),
            retention_batch: 500,
            retention_every: Duration::from_secs(60),
        }
    }
}

/// Makes the outbox rows of jobs leased by dead workers due now, so the relay publishes them
/// again and a live worker takes over long before the lease would expire.
pub async fn sweep_once(pool: &PgPool, kind: Kind) -> Result<u64, sqlx::Error> {
    let spec = kind.spec();
    let running = match spec.states {
        States::RunState { .. } => "j.run_state = 'running'",
        States::Stage => "j.lease_token IS NOT NULL",
    };
    let sql = spec.sql(&format!(
        "UPDATE {{outbox}} o SET available_at = {{now}} FROM {{job}} j \
         WHERE o.{{fk}} = j.id AND o.status = 'leased' AND o.available_at > {{now}} \
           AND {running} AND NOT kfs_worker_alive(j.worker_id)"
    ));
    Ok(sqlx::query(&sql).execute(pool).await?.rows_affected())
}

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
    let ms = -crate::consumer::lease::millis(older_than);
    Ok(sqlx::query(&sql)
        .bind(ms)
        .bind(batch)
        .execute(pool)
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
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(cfg.sweep_every) => {}
        }
        for &kind in &kinds {
            match sweep_once(&pool, kind).await {
                Ok(0) => {}
                Ok(n) => {
                    tracing::info!(kind = %kind, rows = n, "re-armed jobs of dead workers for takeover")
                }
                Err(e) => tracing::debug!(kind = %kind, error = %e, "sweep failed"),
            }
        }
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
