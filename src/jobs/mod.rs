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
pub mod operate;
pub mod pageindex;
pub mod probe;
pub mod research;

use std::cmp::Ordering;
use std::sync::Arc;

pub use crate::engine::kind::{
    failed, Clock, Handler, JobCtx, JobError, Kind, KindSpec, Policy, RecordFailure, States, Step,
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

/// Every kind, in display order: one line per kind.
static REGISTRY: [&Entry; 4] = [
    &compile::ENTRY,
    &deletion::ENTRY,
    &research::ENTRY,
    &probe::ENTRY,
];

/// Every registered kind.
pub fn registry() -> &'static [&'static Entry] {
    &REGISTRY
}

fn position(kind: Kind) -> usize {
    REGISTRY
        .iter()
        .position(|e| e.spec.kind == kind)
        .unwrap_or(usize::MAX)
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
        REGISTRY.iter().map(|e| e.spec.kind).collect()
    }

    /// The platform's job kinds, relayed and consumed by default.
    pub fn platform() -> Vec<Kind> {
        REGISTRY
            .iter()
            .filter(|e| e.default)
            .map(|e| e.spec.kind)
            .collect()
    }

    /// The kind's registration. Every `Kind` value comes from a registered kind's folder.
    pub fn entry(self) -> &'static Entry {
        REGISTRY
            .iter()
            .find(|e| e.spec.kind == self)
            .unwrap_or_else(|| panic!("job kind {self} is not in jobs::registry()"))
    }

    pub fn spec(self) -> &'static KindSpec {
        self.entry().spec
    }

    pub fn event_type(self) -> &'static str {
        self.spec().event_type
    }

    pub fn from_event_type(s: &str) -> Option<Kind> {
        REGISTRY
            .iter()
            .find(|e| e.spec.event_type == s)
            .map(|e| e.spec.kind)
    }

    /// Parses a comma-separated list of kind names or event types, such as `compile,deletion`.
    pub fn parse_list(raw: &str) -> Result<Vec<Kind>, String> {
        let mut kinds = Vec::new();
        for part in raw.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some(kind) = REGISTRY
                .iter()
                .find(|e| e.spec.kind.name() == part || e.spec.event_type == part)
                .map(|e| e.spec.kind)
            else {
                let names: Vec<&str> = REGISTRY.iter().map(|e| e.spec.kind.name()).collect();
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

/// The leased kinds this process runs.
pub fn leased_kinds() -> Vec<Arc<dyn crate::engine::leased::LeasedKind>> {
    vec![
        Arc::new(crate::jobs::bootstrap::BootstrapKind::default()),
        Arc::new(crate::jobs::backfill::BackfillKind::default()),
        Arc::new(crate::jobs::pageindex::PageIndexKind::default()),
    ]
}

/// What handlers need from the process: the object store, the embedder, and anything else
/// shared.
#[derive(Clone, Debug)]
pub struct Deps {
    pub store: crate::store::Store,
    pub embedder: Arc<dyn crate::embed::Embedder>,
}

impl Deps {
    /// The object store with the deterministic offline embedder (tests, the demo, the bench).
    pub fn offline(store: crate::store::Store) -> Self {
        Self {
            store,
            embedder: Arc::new(crate::embed::Offline),
        }
    }
}

/// The handlers of every registered kind, built from `deps`.
pub fn handlers(deps: &Deps) -> Result<Vec<Arc<dyn Handler>>, crate::config::ConfigError> {
    REGISTRY.iter().map(|e| (e.handler)(deps)).collect()
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
    fn heartbeat_is_a_third_of_the_lease() {
        assert_eq!(DELETION.policy.heartbeat(), Duration::from_secs(10));
    }
}
