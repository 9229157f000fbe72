//! What the engine knows of a job kind: its identity, its tables' shape and time type, its
//! policy, and the one trait every kind's work implements. Invariant: the engine never names a
//! table, a time type or a kind itself; it asks the kind's [`KindSpec`] and [`Handler`], so
//! every kind shares one protocol and keeps its table's own rules, and a new kind is a value
//! of these types, not an edit here.

use std::fmt;
use std::time::{Duration, Instant};

use sqlx::PgConnection;
use uuid::Uuid;

pub use super::retry::RetryPolicy;

/// A job kind, by its short name (used on the command line, in status and in metrics). The
/// kinds that exist are the ones in the registry (`crate::jobs::registry`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Kind(&'static str);

impl Kind {
    pub const fn new(name: &'static str) -> Self {
        Kind(name)
    }

    /// Short name used on the command line and in metrics.
    pub fn name(self) -> &'static str {
        self.0
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl fmt::Debug for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

/// How a table stores time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clock {
    /// `TIMESTAMPTZ` columns.
    Timestamptz,
    /// `BIGINT` epoch milliseconds (the research tables).
    EpochMillis,
}

/// How a table models the life of a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum States {
    /// `run_state` + `checkpoint` + `active_slot`. `failed_keeps_slot`: a failed job keeps its
    /// active slot, waiting for a manual retry (deletion); otherwise failure frees it.
    RunState { failed_keeps_slot: bool },
    /// One `stage` column that is both checkpoint and state (research); "running" is a held
    /// lease, and `paused` stops the job.
    Stage,
}

/// Per-kind defaults; all configurable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    pub lease: Duration,
    pub max_attempts: i32,
    pub retry: RetryPolicy,
}

impl Policy {
    /// Heartbeats every lease/3: two can be lost before the lease runs out.
    pub fn heartbeat(&self) -> Duration {
        self.lease / 3
    }
}

/// Everything the engine needs to know about a kind's tables.
#[derive(Debug)]
pub struct KindSpec {
    pub kind: Kind,
    pub event_type: &'static str,
    pub job_table: &'static str,
    pub outbox_table: &'static str,
    /// The outbox column that references the job.
    pub outbox_fk: &'static str,
    /// The payload field that carries the job id.
    pub payload_id_field: &'static str,
    pub clock: Clock,
    pub states: States,
    /// Whether the outbox has `delivery_revision`.
    pub revisions: bool,
    /// Whether the job table has a `superseded` run state; without one a superseded job ends
    /// `canceled` with code `superseded`.
    pub superseded_state: bool,
    /// Whether the kind's step transactions plan each statement once per connection
    /// (`plan_cache_mode = force_generic_plan`, set by the fence for the rest of the
    /// transaction). Postgres' default plans a prepared statement anew at every execution
    /// whenever its generic plan looks costlier, which for the platform kinds' many-table joins
    /// keyed by ids cost more CPU than running them (a research task's retrieval: 2.7 ms of
    /// planning, 0.2–0.5 ms of execution).
    pub generic_plans: bool,
    /// How the relay shares the kind's new work between tenants; `None`: the job table has no
    /// tenant, and new rows are published in commit order.
    pub fairness: Option<Fairness>,
    /// The most connections the kind's own pool in a consumer process opens (`None`: what the
    /// process's division of connections gives it). A platform kind's steps are Postgres' CPU
    /// (retrieval, publish, deletion batches): past a few sessions per database core more of
    /// them only queue for the cores and locks, and each new session plans the kind's
    /// statements again (`BENCHMARKS.md`: 8 connections against 18 ran research's and
    /// deletion's backlogs about 1.3 × faster on 2 cores).
    pub max_connections: Option<u32>,
    pub policy: Policy,
    /// The kind's own record of a failure beyond its job and outbox rows, in the transaction
    /// that writes the failure (see [`failed`]); `None`: nothing more to record.
    pub record_failure: Option<RecordFailure>,
}

/// The job table's columns that let the relay publish new work round-robin between tenants
/// (see `relay::statements`).
#[derive(Debug)]
pub struct Fairness {
    /// The job rows never dispatched, over the job table as `j`. It must be the predicate of
    /// the kind's `fair` index (`db::indexes`, over `(tenant_id, created_at, id)`), so that a
    /// claim walks the tenants and each tenant's oldest jobs in that index, whatever the backlog.
    pub fresh: &'static str,
}

/// The fresh predicate of a job table with [`States::RunState`]: the relay's mark moves a job to
/// `queued`, so `dispatch_pending` is exactly "never dispatched".
pub const FRESH_RUN_STATE: Fairness = Fairness {
    fresh: "j.run_state = 'dispatch_pending'",
};

/// The connections a platform kind's own pool opens at most ([`KindSpec::max_connections`]).
pub const PLATFORM_KIND_CONNECTIONS: u32 = 8;

/// A kind's record of a failure: `(tx, job, code)`.
pub type RecordFailure = for<'a> fn(
    &'a mut PgConnection,
    &'a JobCtx,
    &'a str,
)
    -> futures_util::future::BoxFuture<'a, Result<(), sqlx::Error>>;

/// Every `status` an outbox row of any kind may have (the platform's CHECK on each outbox).
pub const OUTBOX_STATUSES: &[&str] = &[
    "pending",
    "dispatching",
    "dispatched",
    "leased",
    "completed",
    "canceled",
    "dead",
];

/// The `run_state`s of a job table with [`States::RunState`] (the platform's CHECK).
const RUN_STATES: &[&str] = &[
    "dispatch_pending",
    "queued",
    "running",
    "retry_wait",
    "succeeded",
    "failed",
    "canceled",
];

/// [`RUN_STATES`] of a table that also has `superseded`.
const RUN_STATES_SUPERSEDED: &[&str] = &[
    "dispatch_pending",
    "queued",
    "running",
    "retry_wait",
    "succeeded",
    "failed",
    "canceled",
    "superseded",
];

/// The `stage`s of a job table with [`States::Stage`] (the platform's research CHECK).
const STAGES: &[&str] = &[
    "queued",
    "planning",
    "retrieving",
    "analyzing",
    "generating",
    "paused",
    "completed",
    "failed",
    "canceled",
];

impl KindSpec {
    /// Every state its job table allows (`run_state`, or `stage`): the label values of the
    /// job gauges, exported at zero from the start so that alerts and `rate()` see every series.
    pub fn job_states(&self) -> &'static [&'static str] {
        match (self.states, self.superseded_state) {
            (States::RunState { .. }, true) => RUN_STATES_SUPERSEDED,
            (States::RunState { .. }, false) => RUN_STATES,
            (States::Stage, _) => STAGES,
        }
    }

    /// Renders a statement template for this kind's tables:
    /// `{job}`, `{outbox}`, `{fk}`, `{cp}` (checkpoint column), `{now}` (transaction time),
    /// `{clock}` (the wall clock at the statement, for lease checks), and `{now+X}` and
    /// `{clock+X}` for "now plus X milliseconds" (X a parameter or column) in the table's own
    /// time type. Time always comes from the
    /// database clock, so workers never compare their own clocks.
    /// What a fence selects besides the row: the transaction's settings (see
    /// [`KindSpec::generic_plans`]), as one text column.
    pub fn step_settings(&self) -> &'static str {
        if self.generic_plans {
            "set_config('idle_in_transaction_session_timeout', $4, true) \
             || set_config('plan_cache_mode', 'force_generic_plan', true)"
        } else {
            "set_config('idle_in_transaction_session_timeout', $4, true)"
        }
    }

    pub fn sql(&self, template: &str) -> String {
        let now = match self.clock {
            Clock::Timestamptz => "now()",
            Clock::EpochMillis => "(extract(epoch from now()) * 1000)::bigint",
        };
        let mut out = template
            .replace("{job}", self.job_table)
            .replace("{outbox}", self.outbox_table)
            .replace("{fk}", self.outbox_fk)
            .replace("{cp}", self.checkpoint_column());
        while let Some(start) = out.find("{now+") {
            let end = start + out[start..].find('}').expect("unterminated {now+...}");
            let param = &out[start + 5..end];
            let expr = match self.clock {
                Clock::Timestamptz => {
                    format!("(now() + {param}::bigint * interval '1 millisecond')")
                }
                Clock::EpochMillis => format!("({now} + {param}::bigint)"),
            };
            out.replace_range(start..=end, &expr);
        }
        let clock = match self.clock {
            Clock::Timestamptz => "clock_timestamp()",
            Clock::EpochMillis => "(extract(epoch from clock_timestamp()) * 1000)::bigint",
        };
        while let Some(start) = out.find("{clock+") {
            let end = start + out[start..].find('}').expect("unterminated {clock+...}");
            let param = &out[start + 7..end];
            let expr = match self.clock {
                Clock::Timestamptz => {
                    format!("(clock_timestamp() + {param}::bigint * interval '1 millisecond')")
                }
                Clock::EpochMillis => format!("({clock} + {param}::bigint)"),
            };
            out.replace_range(start..=end, &expr);
        }
        out.replace("{now}", now).replace("{clock}", clock)
    }

    pub fn checkpoint_column(&self) -> &'static str {
        match self.states {
            States::RunState { .. } => "checkpoint",
            States::Stage => "stage",
        }
    }

    /// Routing key and queue suffix.
    pub fn queue_name(&self, prefix: &str) -> String {
        format!("{prefix}.{}", self.event_type)
    }
}

/// What a claimed job looks like to its handler.
#[derive(Clone, Debug)]
pub struct JobCtx {
    pub kind: Kind,
    pub job_id: Uuid,
    pub outbox_id: Uuid,
    pub delivery_id: String,
    /// The lease this worker holds; nil when no lease holder writes (a failure recorded by the
    /// relay or by the diagnosis of a delivery, see [`JobCtx::unleased`]).
    pub lease_token: Uuid,
    /// The row version the worker last wrote; every fenced write compares it, and the
    /// checkpoint and end writes bump it.
    pub row_version: i32,
    pub checkpoint: String,
    pub execution_attempts: i32,
    pub max_execution_attempts: i32,
    pub worker_id: String,
    /// When this worker last renewed the lease (claimed or extended it), on this process's
    /// clock, read before the renewing statement was sent, so never later than the renewal
    /// itself. Heartbeats count their interval from here, not from when a slice began: a job
    /// that goes on in another slice runner of the same worker (a group's member going on
    /// alone) is never left a whole interval without one.
    pub renewed: Instant,
}

impl JobCtx {
    /// A job as a writer that holds no lease on it sees it: for recording a failure that the
    /// relay or the diagnosis of a delivery wrote.
    pub fn unleased(
        kind: Kind,
        job_id: Uuid,
        outbox_id: Uuid,
        row_version: i32,
        checkpoint: String,
        execution_attempts: i32,
        max_execution_attempts: i32,
    ) -> Self {
        Self {
            kind,
            job_id,
            outbox_id,
            delivery_id: String::new(),
            lease_token: Uuid::nil(),
            row_version,
            checkpoint,
            execution_attempts,
            max_execution_attempts,
            worker_id: String::new(),
            renewed: Instant::now(),
        }
    }

    /// When the next heartbeat is due: one `interval` after the last renewal.
    pub fn beat_due(&self, interval: Duration) -> Instant {
        self.renewed + interval
    }

    /// Whether a lease holder writes for this job.
    pub fn leased(&self) -> bool {
        !self.lease_token.is_nil()
    }
}

/// What one step decided. The engine commits it together with the step's own writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// The job moved to this checkpoint and goes on.
    Advance(String),
    /// The job finished at this checkpoint.
    Succeed(String),
    /// Nothing to do until later (e.g. leases still draining). Does not use up an attempt.
    Wait { delay: Duration, reason: String },
    /// The job was canceled (e.g. a budget ran out).
    Cancel { code: String, message: String },
    /// A newer version of the job's target made it pointless (compile: `superseded`; kinds
    /// without that state end canceled with code `superseded`).
    Supersede { message: String },
}

/// A step that could not finish. Classified at the boundary: retryable or fatal.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("{code}: {message}")]
    Retryable { code: String, message: String },
    #[error("{code}: {message}")]
    Fatal { code: String, message: String },
}

impl JobError {
    pub fn retryable(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Retryable {
            code: code.into(),
            message: message.into(),
        }
    }

    pub fn fatal(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Fatal {
            code: code.into(),
            message: message.into(),
        }
    }

    pub fn code(&self) -> &str {
        match self {
            Self::Retryable { code, .. } | Self::Fatal { code, .. } => code,
        }
    }

    pub fn message(&self) -> &str {
        match self {
            Self::Retryable { message, .. } | Self::Fatal { message, .. } => message,
        }
    }
}

impl From<sqlx::Error> for JobError {
    fn from(e: sqlx::Error) -> Self {
        if crate::db::is_retryable(&e) {
            JobError::retryable("db_unavailable", e.to_string())
        } else {
            JobError::fatal("db_error", e.to_string())
        }
    }
}

/// How long the members of a group may go on stepping in its one transaction: until a step
/// like the last one would end past a deadline. The group sets the deadline a heartbeat
/// interval after its step began, so its transaction ends while every member's lease still has
/// a third of its length left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Until {
    deadline: Instant,
}

impl Until {
    pub fn new(deadline: Instant) -> Self {
        Self { deadline }
    }

    /// A deadline `period` from now.
    pub fn after(period: Duration) -> Self {
        Self::new(Instant::now() + period)
    }

    /// Whether another member's step, taking as long as `last` did, ends by the deadline when
    /// it begins at `now`.
    pub fn fits(&self, now: Instant, last: Duration) -> bool {
        now.checked_add(last)
            .is_some_and(|end| end <= self.deadline)
    }
}

/// One job kind's work. `step` runs inside the engine's transaction, after the engine has
/// fenced the job row (lease token, row version, live lease) and locked it; its writes commit
/// together with the checkpoint it returns, or not at all.
#[async_trait::async_trait]
pub trait Handler: Send + Sync + 'static {
    fn kind(&self) -> Kind;

    async fn step(&self, tx: &mut PgConnection, job: &JobCtx) -> Result<Step, JobError>;

    /// Called when the job fails, in the transaction that records the failure (after the
    /// failure and the kind's own record of it, [`kind_failed`], were written), for anything a
    /// handler records besides. Never called directly: every way a job fails goes through
    /// [`failed`]. The default does nothing.
    async fn on_fail(
        &self,
        _tx: &mut PgConnection,
        _job: &JobCtx,
        _code: &str,
    ) -> Result<(), sqlx::Error> {
        Ok(())
    }

    /// Called when a retryable failure schedules the job's retry, in the transaction that
    /// records it (after the fenced end was written), so the kind can record it on its own rows
    /// too. The default does nothing.
    async fn on_retry(
        &self,
        _tx: &mut PgConnection,
        _job: &JobCtx,
        _code: &str,
    ) -> Result<(), sqlx::Error> {
        Ok(())
    }

    /// Work a step needs that may take longer than one transaction may stay open (a remote
    /// parse of a long document), done before the step's fence, outside any transaction, on
    /// the slice's connection, while the heartbeat keeps extending the lease. Its result must
    /// be left where the step finds it, by fenced writes only; the step must still be right if
    /// it finds nothing (a crash between the two). An error ends the slice as the step's
    /// would. Runs only where [`Handler::prepares`] says so. The default does nothing.
    async fn prepare(&self, _conn: &mut PgConnection, _job: &JobCtx) -> Result<(), JobError> {
        Ok(())
    }

    /// Whether [`Handler::prepare`] has work before this step (a cheap look at the job, no
    /// I/O). The default: no.
    fn prepares(&self, _job: &JobCtx) -> bool {
        false
    }

    /// Called after a step's checkpoint has committed and before the next step's fence, with
    /// the job at its new checkpoint. Nothing is locked then: another writer (a pause, a
    /// cancel) that was waiting on the job row gets it before the next step can. The default
    /// does nothing.
    async fn after_step_commit(&self, _job: &JobCtx) {}

    /// The steps of several jobs that share one transaction (see
    /// [`Handler::shares_transaction`]), in the order given: what calling [`Handler::step`] on
    /// each in turn would do, and the default does just that. A kind may write them in fewer
    /// statements. Returns the steps of a prefix of `jobs`, at least the first: before each
    /// further member whose step takes time, it stops once [`Until::fits`] says a step like
    /// the last one no longer fits, and it writes nothing for the members it did not step.
    /// (The group's transaction holds every member's row, so no heartbeat can extend their
    /// leases until it ends.) Any error means the group's transaction is rolled back and each
    /// job is stepped alone.
    async fn step_many(
        &self,
        tx: &mut PgConnection,
        jobs: &[JobCtx],
        until: Until,
    ) -> Result<Vec<Step>, JobError> {
        let mut steps = Vec::with_capacity(jobs.len());
        let mut last = Duration::ZERO;
        for job in jobs {
            if !steps.is_empty() && !until.fits(Instant::now(), last) {
                break;
            }
            let began = Instant::now();
            steps.push(self.step(tx, job).await?);
            last = began.elapsed();
        }
        Ok(steps)
    }

    /// Whether the steps of several jobs of this kind may share one transaction (see
    /// [`crate::engine::group`]): only for short steps that touch nothing but the database. A
    /// step that calls an object store or a model keeps a transaction of its own. The default
    /// is `false`.
    fn shares_transaction(&self) -> bool {
        false
    }

    /// Called by an engine that runs this handler, with the engine's pool, for writes a step
    /// commits on their own beside its transaction (research streams its answer this way).
    /// The default ignores it.
    fn attach(&self, _pool: &sqlx::PgPool) {}
}

/// Records a job's failure beyond its job and outbox rows: the one function every way a job
/// fails goes through (a slice that ends failed, attempts used up, an outbox row the relay gave
/// up on or that no delivery can use). Runs in the transaction that wrote the failure, after
/// it, so all of it commits together: the kind's own record ([`KindSpec::record_failure`])
/// always, then the handler's [`Handler::on_fail`] when there is one. Writers that run no step
/// (the relay) have no handler; the kind's record does not need one.
pub async fn failed(
    tx: &mut PgConnection,
    hook: Option<&dyn Handler>,
    spec: &KindSpec,
    job: &JobCtx,
    code: &str,
) -> Result<(), sqlx::Error> {
    if let Some(record) = spec.record_failure {
        record(tx, job, code).await?;
    }
    match hook {
        Some(h) => h.on_fail(tx, job, code).await,
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_member_steps_only_when_a_step_like_the_last_ends_by_the_deadline() {
        let start = Instant::now();
        let until = Until::new(start + Duration::from_secs(3));
        let s = Duration::from_secs;
        // (seconds since the group step began, the last member's step) → another fits
        let table = [
            (s(0), s(0), true),
            (s(1), s(1), true),
            (s(1), s(2), true),
            (s(1), s(3), false),
            (s(3), s(0), true),
            (s(3), Duration::from_millis(1), false),
            (s(4), s(0), false),
        ];
        for (at, last, fits) in table {
            assert_eq!(
                until.fits(start + at, last),
                fits,
                "at {at:?}, last step {last:?}"
            );
        }
    }
}
