//! Metrics in Prometheus form. Invariant: metric names and labels are fixed here, and labels
//! never carry ids, payloads or anything secret — only kinds, outcomes and states. Every series
//! a process can export exists from [`register`] on, at zero, with each of its known label
//! values, and a point-in-time gauge whose state emptied reads zero, not its last value.

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide recorder once and returns the handle that renders it.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets(&[
                    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0,
                ])
                .expect("buckets")
                .set_buckets_for_metric(
                    Matcher::Full("kfs_attempt_number".into()),
                    &[1.0, 2.0, 3.0, 5.0, 10.0, 20.0],
                )
                .expect("attempt buckets")
                .build_recorder();
            let handle = recorder.handle();
            // In a process that already has a recorder (a test binary), keep that one.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}

/// How a delivery was decided: a claim's outcome (`Claim::outcome` in the engine),
/// or `poison` for one that could not be decoded.
pub const DELIVERY_OUTCOMES: &[&str] = &[
    "claimed",
    "stale",
    "duplicate",
    "terminal",
    "exhausted",
    "poison",
];

/// How a slice ended (`End::name` in the engine, and a lost lease).
pub const SLICE_ENDS: &[&str] = &[
    "succeeded",
    "failed",
    "canceled",
    "superseded",
    "wait",
    "continue",
    "lease_lost",
];

/// What became of the relay's messages.
pub const RELAY_RESULTS: &[&str] = &["confirmed", "released", "dead"];

/// What the process serves, for [`register`], as plain label values: the registry of kinds
/// (`crate::jobs::served`) fills it in, so this module knows no kind.
#[derive(Clone, Debug, Default)]
pub struct Served {
    /// The outbox kinds it relays or consumes, with their job states.
    pub kinds: Vec<(&'static str, &'static [&'static str])>,
    /// Every outbox status.
    pub outbox_statuses: &'static [&'static str],
    /// The leased kinds, with their states and checkpoints (their gauges are reported either
    /// way).
    pub leased: Vec<(
        &'static str,
        &'static [&'static str],
        &'static [&'static str],
    )>,
    /// Whether it runs the leased kinds.
    pub runs_leased: bool,
    /// The polled kinds, with their states (gauges only).
    pub polled: Vec<(&'static str, &'static [&'static str])>,
    /// What model calls are for, and how they end.
    pub model_purposes: Vec<&'static str>,
    pub model_outcomes: &'static [&'static str],
}

/// Describes every metric and creates each series this process can export at zero, with every
/// known label value, so that a fresh worker exports them all (Prometheus' `rate()` and alerts
/// on absent series need them before the first event). Idempotent.
pub fn register(served: &Served) {
    describe();
    let counters =
        |name: &'static str, kind: &'static str, label: &'static str, values: &[&'static str]| {
            for &v in values {
                metrics::counter!(name, "kind" => kind, label => v).increment(0);
            }
        };
    let per_kind = |kind: &'static str| {
        counters("kfs_slices_total", kind, "end", SLICE_ENDS);
        metrics::counter!("kfs_retries_total", "kind" => kind).increment(0);
        metrics::counter!("kfs_attempts_total", "kind" => kind).increment(0);
        metrics::counter!("kfs_takeovers_total", "kind" => kind).increment(0);
        let _ = metrics::histogram!("kfs_slice_duration_seconds", "kind" => kind);
        let _ = metrics::histogram!("kfs_attempt_number", "kind" => kind);
        let _ = metrics::histogram!("kfs_takeover_seconds", "kind" => kind);
    };
    for &(kind, job_states) in &served.kinds {
        per_kind(kind);
        counters("kfs_deliveries_total", kind, "outcome", DELIVERY_OUTCOMES);
        counters("kfs_relay_messages_total", kind, "result", RELAY_RESULTS);
        let _ = metrics::histogram!("kfs_relay_publish_seconds", "kind" => kind);
        let _ = metrics::histogram!("kfs_relay_confirm_seconds", "kind" => kind);
        zero_gauges("kfs_jobs", kind, "state", job_states);
        zero_gauges("kfs_outbox_rows", kind, "status", served.outbox_statuses);
        metrics::gauge!("kfs_relay_lag_seconds", "kind" => kind).set(0.0);
        metrics::gauge!("kfs_queue_messages", "kind" => kind).set(0.0);
        metrics::gauge!("kfs_backlog", "kind" => kind).set(0.0);
        metrics::gauge!("kfs_backlog_tenants", "kind" => kind).set(0.0);
        metrics::gauge!("kfs_backlog_top_tenant", "kind" => kind).set(0.0);
    }
    for &(kind, states, checkpoints) in &served.leased {
        if served.runs_leased {
            per_kind(kind);
        }
        zero_gauges("kfs_jobs", kind, "state", states);
        zero_gauges("kfs_leased_checkpoints", kind, "checkpoint", checkpoints);
    }
    for &(kind, states) in &served.polled {
        zero_gauges("kfs_jobs", kind, "state", states);
    }
    metrics::gauge!("kfs_dead_letters").set(0.0);
    for &p in &served.model_purposes {
        for &o in served.model_outcomes {
            metrics::counter!("kfs_model_calls_total", "purpose" => p, "outcome" => o).increment(0);
        }
        let _ = metrics::histogram!("kfs_model_call_seconds", "purpose" => p);
    }
    metrics::gauge!("kfs_model_calls_in_flight").set(0.0);
}

fn zero_gauges(
    name: &'static str,
    kind: &'static str,
    label: &'static str,
    values: &[&'static str],
) {
    for &v in values {
        metrics::gauge!(name, "kind" => kind, label => v).set(0.0);
    }
}

/// The `# HELP` lines.
fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        "kfs_deliveries_total",
        "Deliveries taken from the broker, by how the database decided them"
    );
    describe_counter!("kfs_slices_total", "Job slices run, by how each ended");
    describe_counter!(
        "kfs_model_calls_total",
        "Reasoning-model calls, by purpose and outcome (refused ones included)"
    );
    describe_histogram!(
        "kfs_model_call_seconds",
        Unit::Seconds,
        "How long reasoning-model calls took, gate wait included"
    );
    describe_gauge!(
        "kfs_model_calls_in_flight",
        "Reasoning-model calls in flight in the process"
    );
    describe_counter!(
        "kfs_relay_claims_total",
        "Claims the relay ran on the outbox, per kind"
    );
    describe_histogram!(
        "kfs_slice_duration_seconds",
        Unit::Seconds,
        "How long a slice ran, from its claim to its end's commit"
    );
    describe_counter!("kfs_retries_total", "Slices that ended in a retryable wait");
    describe_counter!(
        "kfs_attempts_total",
        "Claims, each an execution attempt of a job"
    );
    describe_histogram!("kfs_attempt_number", "The execution attempt a claim began");
    describe_counter!(
        "kfs_takeovers_total",
        "Claims that took a job over from a holder that never ended its slice"
    );
    describe_histogram!(
        "kfs_takeover_seconds",
        Unit::Seconds,
        "From the previous holder's last heartbeat to the takeover"
    );
    describe_counter!(
        "kfs_relay_messages_total",
        "Outbox rows the relay published, released or gave up"
    );
    describe_histogram!(
        "kfs_relay_publish_seconds",
        Unit::Seconds,
        "From claiming outbox rows to the last of them handed to the broker"
    );
    describe_histogram!(
        "kfs_relay_confirm_seconds",
        Unit::Seconds,
        "From the publish to the broker's confirm"
    );
    describe_gauge!(
        "kfs_jobs",
        "Jobs by state, read from the job tables at scrape time"
    );
    describe_gauge!(
        "kfs_outbox_rows",
        "Outbox rows by status, read at scrape time"
    );
    describe_gauge!(
        "kfs_relay_lag_seconds",
        Unit::Seconds,
        "Age of the oldest due outbox row not yet out for delivery"
    );
    describe_gauge!("kfs_queue_messages", "Messages waiting in the kind's queue");
    describe_gauge!(
        "kfs_backlog",
        "Work not yet claimed: due outbox rows waiting in Postgres plus messages published and not yet claimed"
    );
    describe_gauge!(
        "kfs_backlog_tenants",
        "Tenants with work in the kind's backlog"
    );
    describe_gauge!(
        "kfs_backlog_top_tenant",
        "The backlog of the tenant with the most work waiting (the dashboard and status name the top tenants)"
    );
    describe_gauge!(
        "kfs_leased_checkpoints",
        "Leased jobs by checkpoint, read at scrape time"
    );
    describe_gauge!("kfs_dead_letters", "Messages in the dead-letter queue");
    describe_counter!(
        "kfs_document_parses_total",
        "Documents (PDF, office files) run through a parser, by route, format and outcome"
    );
    describe_histogram!(
        "kfs_document_parse_seconds",
        Unit::Seconds,
        "How long one parse of a document took, by route and format"
    );
    describe_counter!(
        "kfs_publish_head_waits_total",
        "Publishes that found the space's publication head held past their wait and queued again"
    );
    describe_counter!(
        "kfs_publish_parks_total",
        "Publishes that parked until the space's next head move, to be published together with it"
    );
    describe_counter!(
        "kfs_publish_joined_total",
        "Attempts published by another attempt's head move of their space"
    );
    describe_counter!(
        "kfs_publish_rebases_total",
        "Publishes whose head had moved since their candidate was composed, by how the candidate followed"
    );
    describe_counter!(
        "kfs_parse_checkpoints_total",
        "Raw-parse checkpoints written after a parse, and reused instead of parsing again"
    );
}

/// One parse of a document through the parser route: `outcome` is `parsed`, `failed` (the
/// document cannot be parsed) or `retry` (the parser could not answer).
pub fn document_parse(
    route: &'static str,
    format: &'static str,
    outcome: &'static str,
    took: Duration,
) {
    metrics::counter!("kfs_document_parses_total", "route" => route, "format" => format, "outcome" => outcome)
        .increment(1);
    metrics::histogram!("kfs_document_parse_seconds", "route" => route, "format" => format)
        .record(took.as_secs_f64());
}

/// A publish that found the space's head held past its wait.
pub fn publish_head_wait() {
    metrics::counter!("kfs_publish_head_waits_total").increment(1);
}

/// A publish that parked until the space's next head move.
pub fn publish_park() {
    metrics::counter!("kfs_publish_parks_total").increment(1);
}

/// Attempts published by another attempt's head move.
pub fn publish_joined(n: usize) {
    metrics::counter!("kfs_publish_joined_total").increment(n as u64);
}

/// A publish whose head had moved: its candidate rebased `in_place` or `recomposed`.
pub fn publish_rebase(how: &'static str) {
    metrics::counter!("kfs_publish_rebases_total", "how" => how).increment(1);
}

/// One reasoning-model call, by purpose and outcome (`ok`, `failed`, or refused: `budget`,
/// `circuit_open`); a call that was made is also timed.
pub fn model_call(purpose: &'static str, outcome: &'static str, took: Duration) {
    metrics::counter!("kfs_model_calls_total", "purpose" => purpose, "outcome" => outcome)
        .increment(1);
    if matches!(outcome, "ok" | "failed") {
        metrics::histogram!("kfs_model_call_seconds", "purpose" => purpose)
            .record(took.as_secs_f64());
    }
}

/// Reasoning-model calls in flight in the process (inside the gate).
pub fn model_in_flight(n: usize) {
    metrics::gauge!("kfs_model_calls_in_flight").set(n as f64);
}

/// A raw-parse checkpoint `written` after a parse, or `reused` instead of one.
pub fn parse_checkpoint(outcome: &'static str) {
    metrics::counter!("kfs_parse_checkpoints_total", "outcome" => outcome).increment(1);
}

pub fn delivery(kind: &'static str, outcome: &'static str) {
    metrics::counter!("kfs_deliveries_total", "kind" => kind, "outcome" => outcome).increment(1);
}

pub fn slice(kind: &'static str, end: &'static str, took: Duration) {
    metrics::counter!("kfs_slices_total", "kind" => kind, "end" => end).increment(1);
    metrics::histogram!("kfs_slice_duration_seconds", "kind" => kind).record(took.as_secs_f64());
}

pub fn lease_lost(kind: &'static str) {
    metrics::counter!("kfs_slices_total", "kind" => kind, "end" => "lease_lost").increment(1);
}

pub fn retry(kind: &'static str) {
    metrics::counter!("kfs_retries_total", "kind" => kind).increment(1);
}

/// A claim's execution attempt: the counter moves once per claim, the histogram shows how
/// many attempts jobs need.
pub fn attempt(kind: &'static str, number: i32) {
    metrics::counter!("kfs_attempts_total", "kind" => kind).increment(1);
    metrics::histogram!("kfs_attempt_number", "kind" => kind).record(f64::from(number));
}

/// A claim that took a job from a holder who never ended its slice. `silent_for`: from that
/// holder's last heartbeat to the claim.
pub fn takeover(kind: &'static str, silent_for: Option<Duration>) {
    metrics::counter!("kfs_takeovers_total", "kind" => kind).increment(1);
    if let Some(d) = silent_for {
        metrics::histogram!("kfs_takeover_seconds", "kind" => kind).record(d.as_secs_f64());
    }
}

pub fn published(kind: &'static str, result: &'static str, n: u64) {
    if n > 0 {
        metrics::counter!("kfs_relay_messages_total", "kind" => kind, "result" => result)
            .increment(n);
    }
}

/// From claiming a batch of outbox rows to the last of them handed to the broker.
pub fn publish_latency(kind: &'static str, took: Duration) {
    metrics::histogram!("kfs_relay_publish_seconds", "kind" => kind).record(took.as_secs_f64());
}

pub fn confirm_latency(kind: &'static str, took: Duration) {
    metrics::histogram!("kfs_relay_confirm_seconds", "kind" => kind).record(took.as_secs_f64());
}

/// Point-in-time numbers of one outbox kind, read from the database at scrape time.
#[derive(Clone, Copy, Debug)]
pub struct KindNumbers<'a> {
    pub kind: &'a str,
    /// Jobs by state, and every state the kind has (a known state without rows reads zero).
    pub jobs: &'a BTreeMap<String, i64>,
    pub job_states: &'a [&'a str],
    /// Outbox rows by status, and every status.
    pub outbox: &'a BTreeMap<String, i64>,
    pub outbox_statuses: &'a [&'a str],
    pub oldest_due_seconds: Option<f64>,
    pub backlog: i64,
    pub backlog_tenants: i64,
    pub top_tenant: Option<i64>,
    pub queued_messages: Option<u32>,
}

/// Records one outbox kind's point-in-time numbers.
pub fn record_kind(k: &KindNumbers<'_>) {
    let kind = k.kind.to_owned();
    for (state, n) in with_zeros(k.jobs, k.job_states) {
        metrics::gauge!("kfs_jobs", "kind" => kind.clone(), "state" => state).set(n as f64);
    }
    for (st, n) in with_zeros(k.outbox, k.outbox_statuses) {
        metrics::gauge!("kfs_outbox_rows", "kind" => kind.clone(), "status" => st).set(n as f64);
    }
    metrics::gauge!("kfs_relay_lag_seconds", "kind" => kind.clone())
        .set(k.oldest_due_seconds.unwrap_or(0.0));
    metrics::gauge!("kfs_backlog", "kind" => kind.clone()).set(k.backlog as f64);
    metrics::gauge!("kfs_backlog_tenants", "kind" => kind.clone()).set(k.backlog_tenants as f64);
    metrics::gauge!("kfs_backlog_top_tenant", "kind" => kind.clone())
        .set(k.top_tenant.unwrap_or(0) as f64);
    if let Some(q) = k.queued_messages {
        metrics::gauge!("kfs_queue_messages", "kind" => kind).set(f64::from(q));
    }
}

/// Records a leased (or polled) kind's jobs by state and by checkpoint, every known value
/// without rows at zero.
pub fn record_leased(
    kind: &str,
    jobs: &BTreeMap<String, i64>,
    states: &[&str],
    checkpoints: &BTreeMap<String, i64>,
    known_checkpoints: &[&str],
) {
    for (state, n) in with_zeros(jobs, states) {
        metrics::gauge!("kfs_jobs", "kind" => kind.to_owned(), "state" => state).set(n as f64);
    }
    for (cp, n) in with_zeros(checkpoints, known_checkpoints) {
        metrics::gauge!("kfs_leased_checkpoints", "kind" => kind.to_owned(), "checkpoint" => cp)
            .set(n as f64);
    }
}

/// Records the messages in the dead-letter queue.
pub fn record_dead_letters(n: u32) {
    metrics::gauge!("kfs_dead_letters").set(f64::from(n));
}

/// `counts` with every `known` label value that has no count, at zero: a gauge whose state
/// emptied must read zero, not the last count it had.
fn with_zeros(counts: &BTreeMap<String, i64>, known: &[&str]) -> Vec<(String, i64)> {
    let mut out: BTreeMap<String, i64> = known.iter().map(|s| ((*s).to_owned(), 0)).collect();
    out.extend(counts.iter().map(|(s, n)| (s.clone(), *n)));
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_without_rows_reads_zero_and_an_unknown_one_is_kept() {
        let counts = [("running".to_owned(), 3), ("mystery".to_owned(), 1)]
            .into_iter()
            .collect();
        let got = with_zeros(&counts, &["queued", "running", "succeeded"]);
        assert_eq!(
            got,
            vec![
                ("mystery".to_owned(), 1),
                ("queued".to_owned(), 0),
                ("running".to_owned(), 3),
                ("succeeded".to_owned(), 0),
            ]
        );
    }
}
