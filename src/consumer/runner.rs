//! A claimed delivery's slice, handed to the engine's one slice runner
//! ([`crate::engine::runner`]) with the outbox kinds' transitions. Invariant: the slice returns
//! how it ended only once that end has committed or the lease is proven lost, and `None` when
//! shutdown came first, so the delivery is acked only after its deciding commit.

use std::sync::atomic::Ordering;

use tokio_util::sync::CancellationToken;

use super::{Engine, Slot};
use crate::engine::lease::Delivered;
use crate::engine::runner::{self, CrashPoints, Env, LEASE_LOST};
use crate::jobs::{JobCtx, Policy};

/// The crash points a delivery's slice passes through.
static POINTS: CrashPoints = CrashPoints {
    after_step: "after-step-commit",
    after_end: Some("after-step-commit"),
    before_end: None,
};

impl Engine {
    /// Runs steps until the slice ends. Returns how it ended (`"lease_lost"` when fenced out),
    /// or `None` when shutdown interrupted it before its end committed.
    pub(super) async fn run_slice(
        &self,
        job: JobCtx,
        policy: Policy,
        conn: Slot,
        shutdown: &CancellationToken,
    ) -> Option<&'static str> {
        self.counters.slices.fetch_add(1, Ordering::Relaxed);
        let transitions = Delivered {
            statements: self.statements[&job.kind].clone(),
            handler: self.handlers[&job.kind].clone(),
            policy,
        };
        let env = Env {
            pool: &self.pool,
            heartbeat_pool: &self.heartbeat_pool,
            budget: self.cfg.budget,
            shutdown,
            points: &POINTS,
            keep_connection: true,
        };
        let end = runner::run_slice(&transitions, job, conn, env).await;
        if end == Some(LEASE_LOST) {
            self.counters.lease_lost.fetch_add(1, Ordering::Relaxed);
        }
        end
    }
}
