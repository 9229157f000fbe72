//! The writes of the outbox kinds' table shape (a job table and its outbox): claim, fence,
//! advance, heartbeat, end of slice and their [`Transitions`](super::runner::Transitions). Invariant: every write to
//! a claimed job compares `lease_token`, `row_version` and an unexpired lease, and zero rows
//! changed means the lease is lost. Locks are always taken job row first, then outbox row, so
//! that claims, steps and heartbeats never deadlock each other.

mod adopted;
mod batched;
mod claims;
mod delivered;
mod fenced;

pub use adopted::succeed_unleased;
pub use batched::{
    advance_many, claim_many, end_many, fence_many, heartbeat_many, Batched, GroupEnd,
};

pub(crate) use claims::log_settled;
pub use claims::{claim, claim_as, settle_named};
pub use delivered::Delivered;
pub use fenced::{advance, end, fence, heartbeat, idle_timeout, resync};

use std::time::Duration;

use super::kind::{Clock, JobCtx, KindSpec, States};
pub use crate::engine::wire::DeliveryRef;

/// The prepared statement texts of one kind, rendered once.
#[derive(Debug)]
pub struct Statements {
    claim: String,
    diagnose: String,
    fence: String,
    ours: String,
    resync: String,
    advance: String,
    heartbeat: String,
    end_succeed: String,
    end_fail: String,
    end_cancel: String,
    end_supersede: String,
    end_wait: String,
    end_continue: String,
    fail_exhausted: String,
    rearm_at_retry: String,
    rearm_at_lease: String,
    settle: super::settle::Statements,
    batched: Batched,
    spec: &'static KindSpec,
}

/// The columns an end or a release clears, in every table shape (kept where settling, the lowest
/// user, needs it).
pub use super::settle::LEASE_CLEAR;

impl Statements {
    pub fn new(spec: &'static KindSpec) -> Self {
        let (claimable, running_set, live, terminal) = match spec.states {
            States::RunState { .. } => (
                "(j.run_state IN ('dispatch_pending', 'queued') \
                  OR (j.run_state = 'retry_wait' AND j.retry_at <= {now}) \
                  OR (j.run_state = 'running' AND (j.lease_expires_at <= {now} OR NOT kfs_worker_alive(j.worker_id))))",
                "run_state = 'running', retry_at = NULL, started_at = coalesce(j.started_at, now()),",
                "run_state = 'running'",
                "run_state IN ('succeeded', 'failed', 'canceled', 'superseded')",
            ),
            States::Stage => (
                "(j.stage NOT IN ('paused', 'completed', 'failed', 'canceled') \
                  AND (j.retry_at IS NULL OR j.retry_at <= {now}) \
                  AND (j.lease_token IS NULL OR j.lease_expires_at <= {now} OR NOT kfs_worker_alive(j.worker_id)))",
                "retry_at = NULL,",
                "stage NOT IN ('paused', 'completed', 'failed', 'canceled')",
                "stage IN ('completed', 'failed', 'canceled')",
            ),
        };
        // The lease is checked against the wall clock at each statement, not the transaction's
        // start: a worker paused mid-step must not commit after its lease ran out.
        let fence = format!("id = $1 AND lease_token = $2 AND row_version = $3 AND lease_expires_at > {{clock}} AND {live}");

        let (succeed, fail, cancel, wait, cont) = match spec.states {
            States::RunState { failed_keeps_slot } => (
                "run_state = 'succeeded', checkpoint = $5, active_slot = NULL, completed_at = now(), \
                 last_error_code = NULL, last_error_message = NULL"
                    .to_owned(),
                if failed_keeps_slot {
                    "run_state = 'failed', last_error_code = $5, last_error_message = $6".to_owned()
                } else {
                    "run_state = 'failed', active_slot = NULL, completed_at = now(), \
                     last_error_code = $5, last_error_message = $6"
                        .to_owned()
                },
                "run_state = 'canceled', active_slot = NULL, completed_at = now(), \
                 last_error_code = $5, last_error_message = $6"
                    .to_owned(),
                "run_state = 'retry_wait', retry_at = {now+$5}, last_error_code = $6, last_error_message = $7, \
                 execution_attempts = execution_attempts - $8"
                    .to_owned(),
                "run_state = 'queued', execution_attempts = execution_attempts - 1".to_owned(),
            ),
            States::Stage => (
                // $5 (the final stage) is always 'completed' for research.
                "stage = $5, completed_at = {now}, error = NULL".to_owned(),
                "stage = 'failed', completed_at = {now}, error = $5 || ': ' || $6".to_owned(),
                "stage = 'canceled', completed_at = {now}, error = $5 || ': ' || $6".to_owned(),
                "retry_at = {now+$5}, error = $6 || ': ' || $7, execution_attempts = execution_attempts - $8".to_owned(),
                "execution_attempts = execution_attempts - 1".to_owned(),
            ),
        };

        let end = |job_set: &str, outbox_set: &str| {
            spec.sql(&format!(
                "WITH j AS ( \
                   UPDATE {{job}} SET {job_set}, {LEASE_CLEAR}, row_version = row_version + 1, updated_at = {{now}} \
                   WHERE {fence} RETURNING retry_at \
                 ) \
                 UPDATE {{outbox}} AS o SET {outbox_set}, lock_token = NULL, locked_by = NULL, locked_until = NULL, \
                   updated_at = {{now}} \
                 FROM j WHERE o.id = $4 RETURNING o.id"
            ))
        };

        let exhausted_set = match spec.states {
            States::RunState { failed_keeps_slot: true } => {
                "run_state = 'failed', retry_at = NULL, last_error_code = 'attempts_exhausted', last_error_message = $3"
            }
            States::RunState { failed_keeps_slot: false } => {
                "run_state = 'failed', retry_at = NULL, active_slot = NULL, completed_at = now(), \
                 last_error_code = 'attempts_exhausted', last_error_message = $3"
            }
            States::Stage => "stage = 'failed', retry_at = NULL, completed_at = {now}, error = 'attempts_exhausted: ' || $3",
        };

        // Seconds from the previous holder's last heartbeat to now, in the table's clock.
        let silent_for = match spec.clock {
            Clock::Timestamptz => "extract(epoch FROM {now} - prev.heartbeat_at)::float8",
            Clock::EpochMillis => "(({now} - prev.heartbeat_at) / 1000.0)::float8",
        };
        Statements {
            // One statement, committed on its own: lock the job row (`prev`), then its outbox
            // row (`ob`), and only when both are still claimable write either. Locks are taken
            // job first, as everywhere else. `prev` reads the locked row before the update: a
            // lease still on it means its holder never ended the slice, so this is a takeover.
            claim: spec.sql(&format!(
                "WITH prev AS ( \
                   SELECT j.id, j.lease_token IS NOT NULL AS held, j.heartbeat_at FROM {{job}} j \
                   WHERE j.id = $1 AND {claimable} AND j.execution_attempts < j.max_execution_attempts \
                   FOR UPDATE OF j \
                 ), ob AS ( \
                   SELECT o.id FROM {{outbox}} o JOIN prev ON o.{{fk}} = prev.id \
                   WHERE o.id = $2 AND o.queue_job_id = $6 AND o.status IN ('dispatching', 'dispatched', 'leased') \
                   FOR UPDATE OF o \
                 ), claimed AS ( \
                   UPDATE {{job}} AS j SET {running_set} \
                     worker_id = $3, lease_token = $4, lease_expires_at = {{now+$5}}, heartbeat_at = {{now}}, \
                     execution_attempts = j.execution_attempts + 1, row_version = j.row_version + 1, updated_at = {{now}} \
                   FROM ob WHERE j.id = $1 \
                   RETURNING j.{{cp}}::text AS cp, j.row_version, j.execution_attempts, j.max_execution_attempts, \
                     j.lease_expires_at \
                 ), leased AS ( \
                   UPDATE {{outbox}} AS o SET status = 'leased', available_at = claimed.lease_expires_at, \
                     delivered_at = {{now}}, lock_token = NULL, locked_by = NULL, locked_until = NULL, updated_at = {{now}} \
                   FROM claimed WHERE o.id = $2 RETURNING 1 \
                 ) \
                 SELECT claimed.cp, claimed.row_version, claimed.execution_attempts, claimed.max_execution_attempts, \
                   prev.held, {silent_for} \
                 FROM claimed, prev"
            )),
            diagnose: spec.sql(&format!(
                "SELECT o.status::text, o.queue_job_id, o.{{fk}} = $1 AS same_job, \
                   j.row_version, ({terminal}) AS terminal, \
                   (j.{{cp}} = 'paused') AS paused, \
                   (j.lease_token IS NOT NULL AND j.lease_expires_at > {{now}} \
                     AND (kfs_worker_alive(j.worker_id) OR j.execution_attempts >= j.max_execution_attempts)) AS lease_live, \
                   (j.execution_attempts >= j.max_execution_attempts \
                     AND (j.lease_token IS NULL OR j.lease_expires_at <= {{now}})) AS exhausted, \
                   (j.retry_at IS NOT NULL AND j.retry_at > {{now}}) AS retry_later \
                 FROM {{outbox}} o LEFT JOIN {{job}} j ON j.id = o.{{fk}} WHERE o.id = $2"
            )),
            // A row lock, not a write: the lock keeps every other writer out until the step
            // commits or rolls back, and the step's one write (the checkpoint or the end) bumps
            // `row_version`. A step thus writes one job row version instead of two.
            // The job leased under this token by this worker, for this delivery: a claim of
            // ours that committed although its reply was lost.
            ours: spec.sql(&format!(
                "SELECT j.{{cp}}::text, j.row_version, j.execution_attempts, j.max_execution_attempts \
                 FROM {{job}} j JOIN {{outbox}} o ON o.{{fk}} = j.id \
                 WHERE j.id = $1 AND j.lease_token = $2 AND j.worker_id = $3 AND j.lease_expires_at > {{now}} \
                   AND {live} AND o.id = $4 AND o.queue_job_id = $5 AND o.status = 'leased'"
            )),
            // The row read back after a step whose commit is in doubt: found only while our
            // lease is on a live row, which no one else can have written meanwhile.
            resync: spec.sql(&format!(
                "SELECT row_version, {{cp}}::text FROM {{job}} \
                 WHERE id = $1 AND lease_token = $2 AND lease_expires_at > {{now}} AND {live}"
            )),
            fence: spec.sql(&format!(
                "SELECT row_version, {} FROM {{job}} WHERE {fence} FOR NO KEY UPDATE",
                spec.step_settings()
            )),
            advance: spec.sql(
                "UPDATE {job} SET {cp} = $2, row_version = row_version + 1, updated_at = {now} \
                 WHERE id = $1 AND lease_token = $3 AND lease_expires_at > {clock} RETURNING row_version",
            ),
            heartbeat: spec.sql(&format!(
                "WITH j AS ( \
                   UPDATE {{job}} SET lease_expires_at = {{clock+$3}}, heartbeat_at = {{clock}} \
                   WHERE id = $1 AND lease_token = $2 AND lease_expires_at > {{clock}} AND {live} \
                   RETURNING lease_expires_at \
                 ), o AS ( \
                   UPDATE {{outbox}} SET available_at = j.lease_expires_at FROM j \
                   WHERE {{outbox}}.id = $4 AND {{outbox}}.status = 'leased' AND {{outbox}}.queue_job_id = $5 \
                   RETURNING 1 \
                 ) SELECT count(*) FROM j"
            )),
            end_succeed: end(&succeed, "status = 'completed'"),
            end_fail: end(&fail, "status = 'dead', last_error = $5 || ': ' || $6"),
            end_cancel: end(&cancel, "status = 'canceled', last_error = $5 || ': ' || $6"),
            end_supersede: if spec.superseded_state {
                end(
                    "run_state = 'superseded', active_slot = NULL, completed_at = now(), \
                     last_error_code = 'superseded', last_error_message = $5",
                    "status = 'canceled', last_error = 'superseded: ' || $5",
                )
            } else {
                let canceled = match spec.states {
                    States::RunState { .. } => {
                        "run_state = 'canceled', active_slot = NULL, completed_at = now(), \
                         last_error_code = 'superseded', last_error_message = $5"
                    }
                    States::Stage => "stage = 'canceled', completed_at = {now}, error = 'superseded: ' || $5",
                };
                end(canceled, "status = 'canceled', last_error = 'superseded: ' || $5")
            },
            end_wait: end(&wait, "status = 'pending', available_at = j.retry_at, dispatch_attempts = 0, last_error = NULL"),
            end_continue: end(&cont, "status = 'pending', available_at = {now}, dispatch_attempts = 0, last_error = NULL"),
            fail_exhausted: spec.sql(&format!(
                "WITH j AS ( \
                   UPDATE {{job}} SET {exhausted_set}, {LEASE_CLEAR}, row_version = row_version + 1, updated_at = {{now}} \
                   WHERE id = $1 AND row_version = $2 \
                   RETURNING id, {{cp}}::text AS cp, row_version, execution_attempts, max_execution_attempts \
                 ) \
                 UPDATE {{outbox}} AS o SET status = 'dead', last_error = 'attempts_exhausted', lock_token = NULL, \
                   locked_by = NULL, locked_until = NULL, updated_at = {{now}} \
                 FROM j WHERE o.id = $4 \
                 RETURNING j.cp, j.row_version, j.execution_attempts, j.max_execution_attempts"
            )),
            rearm_at_lease: spec.sql(
                "UPDATE {outbox} AS o SET status = 'leased', available_at = j.lease_expires_at, \
                   lock_token = NULL, locked_by = NULL, locked_until = NULL, updated_at = {now} \
                 FROM {job} j WHERE o.id = $2 AND j.id = $1 AND o.{fk} = j.id AND o.queue_job_id = $3 \
                   AND o.status IN ('dispatching', 'dispatched', 'leased') AND j.lease_expires_at IS NOT NULL \
                   AND (o.status <> 'leased' OR o.available_at IS DISTINCT FROM j.lease_expires_at)",
            ),
            rearm_at_retry: spec.sql(
                "UPDATE {outbox} AS o SET status = 'pending', available_at = j.retry_at, dispatch_attempts = 0, \
                   lock_token = NULL, locked_by = NULL, locked_until = NULL, updated_at = {now} \
                 FROM {job} j WHERE o.id = $2 AND j.id = $1 AND o.{fk} = j.id AND o.queue_job_id = $3 \
                   AND o.status IN ('dispatching', 'dispatched', 'leased') AND j.retry_at IS NOT NULL",
            ),
            settle: super::settle::Statements::new(spec),
            batched: Batched::new(
                spec,
                &batched::Fragments {
                    claimable,
                    running_set,
                    live,
                    succeed: &succeed,
                    cont: &cont,
                    silent_for,
                    brief: match spec.states {
                        // `queued` too: after waiting for the relay's mark, the row is
                        // checked again as the mark left it.
                        States::RunState { .. } => {
                            Some("j.run_state IN ('dispatch_pending', 'queued')")
                        }
                        States::Stage => None,
                    },
                },
            ),
            spec,
        }
    }
}

/// What a delivery found in the database.
#[derive(Clone, Debug)]
pub enum Claim {
    /// The job is ours until the lease runs out.
    Claimed(JobCtx),
    /// The delivery does not match the outbox row (an older or unknown delivery).
    Stale(&'static str),
    /// Another live worker holds the job.
    Duplicate,
    /// The job already ended.
    Terminal,
    /// The job used up its attempts; it was failed now.
    Exhausted,
}

impl Claim {
    pub fn outcome(&self) -> &'static str {
        match self {
            Claim::Claimed(_) => "claimed",
            Claim::Stale(_) => "stale",
            Claim::Duplicate => "duplicate",
            Claim::Terminal => "terminal",
            Claim::Exhausted => "exhausted",
        }
    }
}

/// How a slice ends, as written to the database.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum End {
    Succeed {
        checkpoint: String,
    },
    Fail {
        code: String,
        message: String,
    },
    Cancel {
        code: String,
        message: String,
    },
    Supersede {
        message: String,
    },
    /// `retry_wait` until `delay` from now. `refund`: give the attempt back (a planned wait,
    /// not a failure).
    Wait {
        delay: Duration,
        code: String,
        message: String,
        refund: bool,
    },
    /// The slice budget ran out: claimable again at once.
    Continue,
}

impl End {
    pub fn name(&self) -> &'static str {
        match self {
            End::Succeed { .. } => "succeeded",
            End::Fail { .. } => "failed",
            End::Cancel { .. } => "canceled",
            End::Supersede { .. } => "superseded",
            End::Wait { .. } => "wait",
            End::Continue => "continue",
        }
    }
}

pub fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
