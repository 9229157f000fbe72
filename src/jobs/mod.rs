//! Job kinds: what differs between `document.compile`, `deletion.job`, `research.task` and the
//! engine's probe kind, and the one trait every handler implements. Invariant: the engine
//! never names a table or a time type itself; it asks the kind's [`KindSpec`], so all kinds
//! share one protocol and each keeps its table's own rules.

//! The registry of job kinds: [`registry`] is the only list of the kinds that travel through an
//! outbox and a queue. Invariant: every fact about a kind (its identity, tables, time type,
//! policy, handler and failure record) is in its own folder, registered by one line here; code
//! that serves every kind (the intakes, status, the dead-letter tools, the bench, the
//! dashboard) reads this list and never names a kind itself. The protocol types are the
//! engine's ([`crate::engine::kind`]), re-exported here for the kinds.

pub mod backfill;
pub mod bootstrap;
pub mod compile;
pub mod deletion;
pub mod findability;
pub mod operate;
pub mod pageindex;
pub mod probe;
pub mod repair;
pub mod research;
pub mod semantic;

use std::cmp::Ordering;
use std::sync::{Arc, RwLock};

pub use crate::engine::kind::{
    failed, Clock, Fairness, Handler, JobCtx, JobError, Kind, KindSpec, Policy, RecordFailure,
    States, Step, Until, FRESH_RUN_STATE, PLATFORM_KIND_CONNECTIONS,
};
pub use crate::engine::retry::{self, RetryPolicy};
pub use compile::COMPILE;
pub use deletion::DELETION;
pub use probe::PROBE;
pub use research::RESEARCH;

/// One registered kind.
#[derive(Debug)]
pub struct Entry {
    pub spec: &'static KindSpec,
    /// Relayed and consumed when no `--kinds` is given (the platform's own kinds).
    pub default: bool,
    /// Builds the kind's handler from what the process shares.
    pub handler: fn(&Deps) -> Result<Arc<dyn Handler>, crate::config::ConfigError>,
    /// What operators see of its jobs and may do to them.
    pub ops: &'static operate::Operations,
    /// Makes the kind's tables ready when a worker that runs it starts, for a kind whose
    /// tables no migration creates (idempotent; touches nothing where all is in place).
    pub prepare: Option<Prepare>,
}

/// A kind's preparation of its tables: see [`Entry::prepare`].
pub type Prepare =
    for<'a> fn(&'a sqlx::PgPool) -> futures_util::future::BoxFuture<'a, Result<(), sqlx::Error>>;

/// The kinds built into this crate, in display order: one line per kind.
static BUILT_IN: [&Entry; 4] = [
    &compile::ENTRY,
    &deletion::ENTRY,
    &research::ENTRY,
    &probe::ENTRY,
];

/// Kinds registered at run time by code outside this crate (an embedding binary, a test),
/// after the built-in ones.
static REGISTERED: RwLock<Vec<&'static Entry>> = RwLock::new(Vec::new());

fn registered() -> std::sync::RwLockReadGuard<'static, Vec<&'static Entry>> {
    REGISTERED
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Every kind: the built-in ones, then the registered ones.
pub fn registry() -> Vec<&'static Entry> {
    BUILT_IN
        .iter()
        .copied()
        .chain(registered().iter().copied())
        .collect()
}

/// Registers a kind defined outside this crate, the same way a built-in kind is listed in
/// [`registry`]: from then on every part of the process (intakes, relay, status, the
/// dead-letter tools, the dashboard, `--kinds`) serves it. Refuses a kind whose name, event
/// type or tables are already taken; registering the same entry again does nothing.
pub fn register(entry: &'static Entry) -> Result<(), String> {
    let mut all = REGISTERED
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if all.iter().any(|e| std::ptr::eq(*e, entry)) {
        return Ok(());
    }
    let s = entry.spec;
    for e in BUILT_IN.iter().chain(all.iter()) {
        let t = e.spec;
        if t.kind == s.kind
            || t.event_type == s.event_type
            || t.job_table == s.job_table
            || t.outbox_table == s.outbox_table
        {
            return Err(format!(
                "job kind {} ({}, tables {} and {}) clashes with the registered kind {}",
                s.kind, s.event_type, s.job_table, s.outbox_table, t.kind
            ));
        }
    }
    all.push(entry);
    Ok(())
}

/// The first registered kind that `pred` accepts: the built-in ones, then the registered ones,
/// without building the list (the relay looks kinds up per notification).
fn find(pred: impl Fn(&KindSpec) -> bool) -> Option<&'static Entry> {
    if let Some(e) = BUILT_IN.iter().find(|e| pred(e.spec)) {
        return Some(e);
    }
    registered().iter().find(|e| pred(e.spec)).copied()
}

fn position(kind: Kind) -> usize {
    if let Some(i) = BUILT_IN.iter().position(|e| e.spec.kind == kind) {
        return i;
    }
    registered()
        .iter()
        .position(|e| e.spec.kind == kind)
        .map_or(usize::MAX, |i| BUILT_IN.len() + i)
}

/// Names for the kinds the engine's own code and tests use often.
#[allow(non_upper_case_globals)]
impl Kind {
    pub const Compile: Kind = compile::KIND;
    pub const Deletion: Kind = deletion::KIND;
    pub const Research: Kind = research::KIND;
    /// The engine's own test kind, with tables of the same shape (see [`probe`]).
    pub const Probe: Kind = probe::KIND;

    /// Every registered kind, in registry order.
    pub fn all() -> Vec<Kind> {
        registry().iter().map(|e| e.spec.kind).collect()
    }

    /// The platform's job kinds, relayed and consumed by default.
    pub fn platform() -> Vec<Kind> {
        registry()
            .iter()
            .filter(|e| e.default)
            .map(|e| e.spec.kind)
            .collect()
    }

    /// The kind's registration. Every `Kind` value comes from a registered kind's folder.
    pub fn entry(self) -> &'static Entry {
        find(|s| s.kind == self)
            .unwrap_or_else(|| panic!("job kind {self} is not in jobs::registry()"))
    }

    pub fn spec(self) -> &'static KindSpec {
        self.entry().spec
    }

    pub fn event_type(self) -> &'static str {
        self.spec().event_type
    }

    pub fn from_event_type(s: &str) -> Option<Kind> {
        find(|spec| spec.event_type == s).map(|e| e.spec.kind)
    }

    /// The registered kind whose short name is exactly `name`.
    pub fn named(name: &str) -> Option<Kind> {
        find(|spec| spec.kind.name() == name).map(|e| e.spec.kind)
    }

    /// Parses a comma-separated list of kind names or event types, such as `compile,deletion`.
    pub fn parse_list(raw: &str) -> Result<Vec<Kind>, String> {
        let mut kinds = Vec::new();
        for part in raw.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some(kind) =
                find(|s| s.kind.name() == part || s.event_type == part).map(|e| e.spec.kind)
            else {
                let names: Vec<&str> = registry().iter().map(|e| e.spec.kind.name()).collect();
                let (last, rest) = names.split_last().expect("the registry is not empty");
                return Err(format!(
                    "unknown job kind '{part}'; expected {} or {last}",
                    rest.join(", ")
                ));
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

/// Kinds sort in registry order.
impl PartialOrd for Kind {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Kind {
    fn cmp(&self, other: &Self) -> Ordering {
        position(*self)
            .cmp(&position(*other))
            .then_with(|| self.name().cmp(other.name()))
    }
}

/// The metric series a process serving `kinds` (and the leased kinds, when `leased`) exports,
/// as plain label values for [`crate::metrics::register`].
pub fn served(kinds: &[Kind], leased: bool) -> crate::metrics::Served {
    crate::metrics::Served {
        kinds: kinds
            .iter()
            .map(|k| (k.name(), k.spec().job_states()))
            .collect(),
        outbox_statuses: crate::engine::kind::OUTBOX_STATUSES,
        leased: leased_kinds()
            .iter()
            .map(|l| (l.name(), l.states(), l.checkpoints()))
            .collect(),
        runs_leased: leased,
        polled: polled_kinds(crate::model::Models::none())
            .iter()
            .map(|p| (p.name(), p.states()))
            .collect(),
        model_purposes: crate::model::Purpose::ALL
            .iter()
            .map(|p| p.as_str())
            .collect(),
        model_outcomes: crate::model::OUTCOMES,
    }
}

/// The job error a step fails with when a model call does not answer: an unavailable model is
/// retried; a refusal or a spent budget is not. A spent budget is recorded as the platform's
/// compile records it: [`crate::model::BUDGET_EXCEEDED`], with the budget's message.
impl From<crate::model::ModelError> for JobError {
    fn from(e: crate::model::ModelError) -> Self {
        use crate::model::ModelError;
        match e {
            ModelError::Unavailable(m) => JobError::retryable("model_unavailable", m),
            ModelError::Rejected(m) => JobError::fatal("model_rejected", m),
            ModelError::Budget(m) => JobError::fatal(crate::model::BUDGET_EXCEEDED, m),
        }
    }
}

impl crate::broker::Routed for Kind {
    fn queue_name(&self, prefix: &str) -> String {
        self.spec().queue_name(prefix)
    }

    fn routing_key(&self) -> &'static str {
        self.event_type()
    }
}

/// The leased kinds, as status, metrics and the dashboard know them (no model, no embedder).
pub fn leased_kinds() -> Vec<Arc<dyn crate::engine::leased::LeasedKind>> {
    leased_kinds_with(
        crate::model::Models::none(),
        Arc::new(crate::embed::Unconfigured),
    )
}

/// The leased kinds this process runs, with its reasoning model and embedder: one line per
/// kind.
pub fn leased_kinds_with(
    models: crate::model::Models,
    embedder: Arc<dyn crate::embed::Embedder>,
) -> Vec<Arc<dyn crate::engine::leased::LeasedKind>> {
    vec![
        Arc::new(crate::jobs::bootstrap::BootstrapKind::default()),
        Arc::new(crate::jobs::backfill::BackfillKind::default()),
        Arc::new(crate::jobs::pageindex::PageIndexKind::default()),
        Arc::new(crate::jobs::semantic::SemanticKind::new(models, embedder)),
    ]
}

/// The kinds that follow a model-driven publish, polled with their own claims because their
/// rows are not job rows (see [`crate::engine::polled::PolledKind`]): one line per kind.
pub fn polled_kinds(
    models: crate::model::Models,
) -> Vec<Arc<dyn crate::engine::polled::PolledKind>> {
    vec![
        Arc::new(crate::jobs::findability::FindabilityKind::new(
            models.clone(),
        )),
        Arc::new(crate::jobs::repair::RepairKind::new(models)),
    ]
}

/// What handlers need from the process: the object store, the embedder, and anything else
/// shared.
#[derive(Clone, Debug)]
pub struct Deps {
    pub store: crate::store::Store,
    pub embedder: Arc<dyn crate::embed::Embedder>,
    /// How PDF and office documents are parsed.
    pub parsers: Arc<compile::parse::route::Parsers>,
    /// The reasoning model and its limits, for model-driven compiles.
    pub models: crate::model::Models,
}

impl Deps {
    /// The object store with the deterministic offline embedder (tests, the demo, the bench).
    pub fn offline(store: crate::store::Store) -> Self {
        Self {
            store,
            embedder: Arc::new(crate::embed::Offline),
            parsers: Arc::new(compile::parse::route::Parsers::local()),
            models: crate::model::Models::none(),
        }
    }

    /// The same with the deterministic offline reasoning model.
    pub fn offline_models(store: crate::store::Store) -> Self {
        Self {
            models: crate::model::Models::offline(),
            ..Self::offline(store)
        }
    }
}

/// The handlers of every registered kind, built from `deps`.
pub fn handlers(deps: &Deps) -> Result<Vec<Arc<dyn Handler>>, crate::config::ConfigError> {
    registry().iter().map(|e| (e.handler)(deps)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
    fn a_model_error_becomes_the_platforms_job_error() {
        use crate::model::ModelError;
        let table = [
            (
                ModelError::Unavailable("u".into()),
                "model_unavailable",
                false,
            ),
            (ModelError::Rejected("r".into()), "model_rejected", true),
            (
                ModelError::Budget("b".into()),
                "DOCUMENT_COMPILATION_FAILED",
                true,
            ),
        ];
        for (e, code, fatal) in table {
            let j = JobError::from(e);
            assert_eq!(j.code(), code);
            assert_eq!(matches!(j, JobError::Fatal { .. }), fatal, "{code}");
        }
    }

    #[test]
    fn heartbeat_is_a_third_of_the_lease() {
        assert_eq!(DELETION.policy.heartbeat(), Duration::from_secs(10));
    }
}
