//! Job kinds: what differs between `document.compile`, `deletion.job`, `research.task` and the
//! engine's probe kind, and the one trait every handler implements. Invariant: the engine
//! never names a table or a time type itself; it asks the kind's [`KindSpec`], so all kinds
//! share one protocol and each keeps its table's own rules.

pub mod backfill;
pub mod bootstrap;
pub mod compile;
pub mod deletion;
pub mod pageindex;
pub mod probe;
pub mod research;
pub mod retry;

use std::fmt;
use std::time::Duration;

use sqlx::PgConnection;
use uuid::Uuid;

pub use retry::RetryPolicy;

/// A job kind that travels through an outbox and a queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Compile,
    Deletion,
    Research,
    /// The engine's own test kind, with tables of the same shape (see [`probe`]).
    Probe,
}

impl Kind {
    /// The platform's job kinds, relayed and consumed by default.
    pub const PLATFORM: [Kind; 3] = [Kind::Compile, Kind::Deletion, Kind::Research];

    pub fn spec(self) -> &'static KindSpec {
        match self {
            Kind::Compile => &COMPILE,
            Kind::Deletion => &DELETION,
            Kind::Research => &RESEARCH,
            Kind::Probe => &PROBE,
        }
    }

    /// Short name used on the command line and in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Compile => "compile",
            Kind::Deletion => "deletion",
            Kind::Research => "research",
            Kind::Probe => "probe",
        }
    }

    pub fn event_type(self) -> &'static str {
        self.spec().event_type
    }

    pub fn from_event_type(s: &str) -> Option<Kind> {
        [Kind::Compile, Kind::Deletion, Kind::Research, Kind::Probe]
            .into_iter()
            .find(|k| k.event_type() == s)
    }

    /// Parses a comma-separated list such as `compile,deletion`.
    pub fn parse_list(raw: &str) -> Result<Vec<Kind>, String> {
        let mut kinds = Vec::new();
        for part in raw.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let kind = match part {
                "compile" | "document.compile" => Kind::Compile,
                "deletion" | "deletion.job" => Kind::Deletion,
                "research" | "research.task" => Kind::Research,
                "probe" | "probe.job" => Kind::Probe,
                other => {
                    return Err(format!(
                        "unknown job kind '{other}'; expected compile, deletion, research or probe"
                    ))
                }
            };
            if !kinds.contains(&kind) {
                kinds.push(kind);
            }
        }
        if kinds.is_empty() {
            return Err("names no job kind; expected e.g. compile,deletion,research".into());
        }
        Ok(kinds)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
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
    pub policy: Policy,
}

const MIN: u64 = 60;

pub static COMPILE: KindSpec = KindSpec {
    kind: Kind::Compile,
    event_type: "document.compile",
    job_table: "document_compilation_attempts",
    outbox_table: "document_compilation_outbox",
    outbox_fk: "attempt_id",
    payload_id_field: "attemptId",
    clock: Clock::Timestamptz,
    states: States::RunState {
        failed_keeps_slot: false,
    },
    revisions: false,
    policy: Policy {
        lease: Duration::from_secs(60),
        max_attempts: 5,
        retry: RetryPolicy {
            base: Duration::from_secs(5),
            max: Duration::from_secs(5 * MIN),
        },
    },
};

pub static DELETION: KindSpec = KindSpec {
    kind: Kind::Deletion,
    event_type: "deletion.job",
    job_table: "deletion_jobs",
    outbox_table: "deletion_outbox",
    outbox_fk: "deletion_job_id",
    payload_id_field: "deletionJobId",
    clock: Clock::Timestamptz,
    states: States::RunState {
        failed_keeps_slot: true,
    },
    revisions: true,
    policy: Policy {
        lease: Duration::from_secs(30),
        max_attempts: 10,
        retry: RetryPolicy {
            base: Duration::from_secs(5),
            max: Duration::from_secs(5 * MIN),
        },
    },
};

pub static RESEARCH: KindSpec = KindSpec {
    kind: Kind::Research,
    event_type: "research.task",
    job_table: "research_task_jobs",
    outbox_table: "research_task_outbox",
    outbox_fk: "research_task_job_id",
    payload_id_field: "researchTaskJobId",
    clock: Clock::EpochMillis,
    states: States::Stage,
    revisions: true,
    policy: Policy {
        lease: Duration::from_secs(30),
        max_attempts: 5,
        retry: RetryPolicy {
            base: Duration::from_secs(5),
            max: Duration::from_secs(5 * MIN),
        },
    },
};

pub static PROBE: KindSpec = KindSpec {
    kind: Kind::Probe,
    event_type: "probe.job",
    job_table: "kfs_probe_jobs",
    outbox_table: "kfs_probe_outbox",
    outbox_fk: "probe_job_id",
    payload_id_field: "probeJobId",
    clock: Clock::Timestamptz,
    states: States::RunState {
        failed_keeps_slot: false,
    },
    revisions: true,
    policy: Policy {
        lease: Duration::from_secs(30),
        max_attempts: 5,
        retry: RetryPolicy {
            base: Duration::from_secs(1),
            max: Duration::from_secs(5 * MIN),
        },
    },
};

impl KindSpec {
    /// Renders a statement template for this kind's tables:
    /// `{job}`, `{outbox}`, `{fk}`, `{cp}` (checkpoint column), `{now}` (transaction time),
    /// `{clock}` (the wall clock at the statement, for lease checks), and `{now+X}` and
    /// `{clock+X}` for "now plus X milliseconds" (X a parameter or column) in the table's own
    /// time type. Time always comes from the
    /// database clock, so workers never compare their own clocks.
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

/// The leased kinds this process runs.
pub fn leased_kinds() -> Vec<std::sync::Arc<dyn crate::engine::leased::LeasedKind>> {
    vec![
        std::sync::Arc::new(crate::jobs::bootstrap::BootstrapKind::default()),
        std::sync::Arc::new(crate::jobs::backfill::BackfillKind::default()),
        std::sync::Arc::new(crate::jobs::pageindex::PageIndexKind::default()),
    ]
}

/// What handlers need from the process: the object store, the embedder, and anything else
/// shared.
#[derive(Clone, Debug)]
pub struct Deps {
    pub store: crate::store::Store,
    pub embedder: std::sync::Arc<dyn crate::embed::Embedder>,
}

impl Deps {
    /// The object store with the deterministic offline embedder (tests, the demo, the bench).
    pub fn offline(store: crate::store::Store) -> Self {
        Self {
            store,
            embedder: std::sync::Arc::new(crate::embed::Offline),
        }
    }
}

/// The handlers of every kind, built from `deps`.
pub fn handlers(
    deps: &Deps,
) -> Result<Vec<std::sync::Arc<dyn Handler>>, crate::config::ConfigError> {
    Ok(vec![
        std::sync::Arc::new(compile::CompileHandler::new(deps.clone())?),
        std::sync::Arc::new(deletion::DeletionHandler::new(deps.clone())?),
        std::sync::Arc::new(research::ResearchHandler::new(deps.clone())?),
        std::sync::Arc::new(probe::ProbeHandler),
    ])
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
        }
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

    /// Called after a step's checkpoint has committed and before the next step's fence, with
    /// the job at its new checkpoint. Nothing is locked then: another writer (a pause, a
    /// cancel) that was waiting on the job row gets it before the next step can. The default
    /// does nothing.
    async fn after_step_commit(&self, _job: &JobCtx) {}
}

/// Records a job's failure beyond its job and outbox rows: the one function every way a job
/// fails goes through (a slice that ends failed, attempts used up, an outbox row the relay gave
/// up on or that no delivery can use). Runs in the transaction that wrote the failure, after
/// it, so all of it commits together: the kind's own record ([`kind_failed`]) always, then the
/// handler's [`Handler::on_fail`] when there is one. Writers that run no step (the relay) have
/// no handler; the kind's record does not need one.
pub async fn failed(
    tx: &mut PgConnection,
    hook: Option<&dyn Handler>,
    job: &JobCtx,
    code: &str,
) -> Result<(), sqlx::Error> {
    kind_failed(tx, job, code).await?;
    match hook {
        Some(h) => h.on_fail(tx, job, code).await,
        None => Ok(()),
    }
}

/// The kind's own record of a failure: compile deactivates its candidate (and marks an
/// unparseable document), research appends its `research_task.failed` event.
pub async fn kind_failed(
    tx: &mut PgConnection,
    job: &JobCtx,
    code: &str,
) -> Result<(), sqlx::Error> {
    match job.kind {
        Kind::Compile => compile::record_failure(tx, job, code).await,
        Kind::Research => research::record_failure(tx, job, code).await,
        Kind::Deletion | Kind::Probe => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_render_each_clock() {
        let t = "UPDATE {job} SET {cp} = $1, lease_expires_at = {now+$2} WHERE updated_at < {now}";
        assert_eq!(
            COMPILE.sql(t),
            "UPDATE document_compilation_attempts SET checkpoint = $1, lease_expires_at = (now() + $2::bigint * interval '1 millisecond') WHERE updated_at < now()"
        );
        assert_eq!(
            RESEARCH.sql(t),
            "UPDATE research_task_jobs SET stage = $1, lease_expires_at = ((extract(epoch from now()) * 1000)::bigint + $2::bigint) WHERE updated_at < (extract(epoch from now()) * 1000)::bigint"
        );
    }

    #[test]
    fn kind_lists() {
        assert_eq!(
            Kind::parse_list("compile, research").unwrap(),
            vec![Kind::Compile, Kind::Research]
        );
        assert_eq!(
            Kind::parse_list("deletion.job,deletion").unwrap(),
            vec![Kind::Deletion]
        );
        assert!(Kind::parse_list("compile,nope")
            .unwrap_err()
            .contains("nope"));
        assert!(Kind::parse_list(",").is_err());
        assert_eq!(Kind::from_event_type("research.task"), Some(Kind::Research));
        assert_eq!(Kind::from_event_type("x"), None);
    }

    #[test]
    fn heartbeat_is_a_third_of_the_lease() {
        assert_eq!(DELETION.policy.heartbeat(), Duration::from_secs(10));
    }
}
