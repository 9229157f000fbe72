//! The polled intake: leased kinds claimed straight from Postgres, with no outbox and no
//! queue. Invariant: a runner claims only while it has a free slot, every claimed job runs
//! through the engine's one slice runner (by [`run_slice`]), an idle runner sleeps its
//! poll interval, and on start it ends the leases a dead predecessor left under its worker id,
//! so a restart under the same id takes its jobs back at once.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::engine::leased::{run_slice, LeasedKind};
use crate::engine::slice::Budget;

pub use crate::engine::polled::PolledKind;

/// Runs `kinds` until shutdown, each in a loop of its own.
pub async fn run_polled(
    pool: PgPool,
    kinds: Vec<Arc<dyn PolledKind>>,
    holder: String,
    poll: Duration,
    shutdown: CancellationToken,
) {
    let mut loops = JoinSet::new();
    for kind in kinds {
        let (pool, holder, shutdown) = (pool.clone(), holder.clone(), shutdown.clone());
        loops.spawn(async move {
            while !shutdown.is_cancelled() {
                // A round runs to its end: its claims end with their own writes.
                match kind.tick(&pool, &holder).await {
                    Ok(n) if n > 0 => continue,
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(kind = kind.name(), error = %e, "polled kind failed a round")
                    }
                }
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(poll) => {}
                }
            }
        });
    }
    while loops.join_next().await.is_some() {}
}

/// How the leased runner behaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeasedConfig {
    /// How often an idle runner looks for claimable jobs.
    pub poll: Duration,
    /// Jobs run at once per kind.
    pub concurrency: usize,
    pub budget: Budget,
}

impl Default for LeasedConfig {
    fn default() -> Self {
        Self {
            poll: Duration::from_secs(1),
            concurrency: 4,
            budget: Budget::default(),
        }
    }
}

/// Runs `kinds` until shutdown: claims while slots are free, sleeps `poll` when nothing is
/// claimable. Ends the leases a dead predecessor left under this worker id first.
pub async fn run(
    pool: PgPool,
    kinds: Vec<Arc<dyn LeasedKind>>,
    worker_id: String,
    cfg: LeasedConfig,
    shutdown: CancellationToken,
) {
    let mut loops = JoinSet::new();
    for kind in kinds {
        let (pool, worker_id, cfg, shutdown) = (
            pool.clone(),
            worker_id.clone(),
            cfg.clone(),
            shutdown.clone(),
        );
        loops.spawn(async move { kind_loop(pool, kind, worker_id, cfg, shutdown).await });
    }
    while loops.join_next().await.is_some() {}
}

async fn kind_loop(
    pool: PgPool,
    kind: Arc<dyn LeasedKind>,
    worker_id: String,
    cfg: LeasedConfig,
    shutdown: CancellationToken,
) {
    if let Ok(mut conn) = crate::db::acquire(&pool).await {
        match kind.release_own(&mut conn, &worker_id).await {
            Ok(n) if n > 0 => tracing::info!(
                kind = kind.name(),
                rows = n,
                "released the leases of a dead process that ran under this worker id"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(kind = kind.name(), error = %e, "cannot release own leases"),
        }
    }
    let mut running = JoinSet::new();
    while !shutdown.is_cancelled() {
        let mut claimed_any = false;
        while running.len() < cfg.concurrency.max(1) && !shutdown.is_cancelled() {
            let claimed = match crate::db::acquire(&pool).await {
                Ok(mut conn) => kind.claim(&mut conn, &worker_id).await,
                Err(e) => Err(e),
            };
            match claimed {
                Ok(Some(job)) => {
                    claimed_any = true;
                    crate::crash::point("leased-after-claim-commit");
                    if job.taken_over {
                        crate::metrics::takeover(kind.name(), None);
                    }
                    tracing::debug!(kind = kind.name(), job = %job.job_id, checkpoint = %job.checkpoint, "leased job claimed");
                    let (pool, kind, budget, shutdown) =
                        (pool.clone(), kind.clone(), cfg.budget, shutdown.clone());
                    running.spawn(async move {
                        let id = job.job_id;
                        let outcome = run_slice(&pool, kind.as_ref(), job, budget, &shutdown).await;
                        tracing::debug!(kind = kind.name(), job = %id, ?outcome, "leased slice ended");
                    });
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(kind = kind.name(), error = %e, "cannot claim leased jobs");
                    break;
                }
            }
        }
        if claimed_any {
            continue;
        }
        tokio::select! {
            () = shutdown.cancelled() => break,
            Some(_) = running.join_next(), if !running.is_empty() => {}
            () = tokio::time::sleep(cfg.poll) => {}
        }
    }
    // Running slices end with their own commits (or, waiting out database trouble, at
    // shutdown); a step never outlives its lease.
    while running.join_next().await.is_some() {}
}
