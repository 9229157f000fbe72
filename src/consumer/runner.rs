//! A claimed delivery's slice, handed to the engine's one slice runner
//! ([`crate::engine::runner`]) with the outbox kinds' transitions, and a group of claimed
//! deliveries handed to the group runner ([`crate::engine::group`]). Invariant: a slice returns
//! how it ended only once that end has committed or the lease is proven lost, and `None` when
//! shutdown came first, so the delivery is acked only after its deciding commit.

use std::sync::atomic::Ordering;

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{Engine, Slot};
use crate::engine::group;
use crate::engine::lease::Delivered;
use crate::engine::runner::{self, CrashPoints, Env, LEASE_LOST};
use crate::jobs::{JobCtx, Kind, Policy};

/// The crash points a delivery's slice passes through.
static POINTS: CrashPoints = CrashPoints {
    after_step: "after-step-commit",
    after_end: Some("after-step-commit"),
    before_end: None,
};

impl Engine {
    fn transitions(&self, kind: Kind, policy: Policy) -> Delivered {
        Delivered {
            statements: self.statements[&kind].clone(),
            handler: self.handlers[&kind].clone(),
            policy,
        }
    }

    fn env<'a>(&'a self, kind: Kind, shutdown: &'a CancellationToken) -> Env<'a> {
        Env {
            pool: self.pool_for(kind),
            heartbeat_pool: &self.heartbeat_pool,
            budget: self.cfg.budget,
            shutdown,
            points: &POINTS,
            keep_connection: true,
        }
    }

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
        let kind = job.kind;
        let transitions = self.transitions(kind, policy);
        let end = runner::run_slice(&transitions, job, conn, self.env(kind, shutdown)).await;
        if end == Some(LEASE_LOST) {
            self.counters.lease_lost.fetch_add(1, Ordering::Relaxed);
        }
        end
    }

    /// Runs the slices of `jobs` (claimed, of one kind whose steps share a transaction)
    /// together; returns each job's end as [`Engine::run_slice`] would.
    pub(super) async fn run_group(
        &self,
        kind: Kind,
        jobs: Vec<JobCtx>,
        policy: Policy,
        conn: Slot,
        shutdown: &CancellationToken,
    ) -> Vec<(Uuid, Option<&'static str>)> {
        self.counters
            .slices
            .fetch_add(jobs.len() as u64, Ordering::Relaxed);
        let transitions = self.transitions(kind, policy);
        let ends = group::run_group(&transitions, jobs, conn, self.env(kind, shutdown)).await;
        let lost = ends.iter().filter(|(_, e)| *e == Some(LEASE_LOST)).count();
        self.counters
            .lease_lost
            .fetch_add(lost as u64, Ordering::Relaxed);
        ends
    }
}
