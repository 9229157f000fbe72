//! The heartbeat of a running slice. Invariant: while its guard lives the lease is extended
//! every lease/3 on connections of the heartbeat pool; a heartbeat the database refuses (the
//! lease is lost) cancels `lost` and ends the heartbeat; dropping the guard stops it.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::engine::lease::{self, Statements};
use crate::jobs::{JobCtx, Policy};

/// Extends the lease every lease/3 while the slice runs; stops when dropped. A refused
/// heartbeat cancels `lost`, so the slice stops at its next step.
pub(super) struct HeartbeatGuard {
    stop: CancellationToken,
}

impl HeartbeatGuard {
    pub(super) fn start(
        pool: PgPool,
        job: JobCtx,
        policy: Policy,
        lost: CancellationToken,
        statements: Arc<Statements>,
    ) -> Self {
        let stop = CancellationToken::new();
        let stop2 = stop.clone();
        tokio::spawn(async move {
            let every = policy.heartbeat().max(Duration::from_millis(100));
            loop {
                tokio::select! {
                    () = stop2.cancelled() => return,
                    () = tokio::time::sleep(every) => {}
                }
                let beat = async {
                    let mut conn = crate::db::acquire(&pool).await?;
                    lease::heartbeat(&mut conn, &statements, &job, policy.lease).await
                };
                match beat.await {
                    Ok(true) => {}
                    Ok(false) => {
                        lost.cancel();
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(job_id = %job.job_id, error = %e, "heartbeat failed; will try again")
                    }
                }
            }
        });
        Self { stop }
    }
}

impl Drop for HeartbeatGuard {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
