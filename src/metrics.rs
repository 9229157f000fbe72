//! Metrics in Prometheus form. Invariant: metric names and labels are fixed here, and labels
//! never carry ids, payloads or anything secret — only kinds, outcomes and states.

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

/// Point-in-time numbers read from the database at scrape time.
pub fn record_status(status: &crate::status::Status) {
    for k in &status.kinds {
        for (state, n) in &k.jobs {
            metrics::gauge!("kfs_jobs", "kind" => k.kind.clone(), "state" => state.clone())
                .set(*n as f64);
        }
        for (st, n) in &k.outbox {
            metrics::gauge!("kfs_outbox_rows", "kind" => k.kind.clone(), "status" => st.clone())
                .set(*n as f64);
        }
        metrics::gauge!("kfs_relay_lag_seconds", "kind" => k.kind.clone())
            .set(k.oldest_due_seconds.unwrap_or(0.0));
        if let Some(q) = k.queued_messages {
            metrics::gauge!("kfs_queue_messages", "kind" => k.kind.clone()).set(f64::from(q));
        }
    }
    for k in &status.leased {
        for (state, n) in &k.jobs {
            metrics::gauge!("kfs_jobs", "kind" => k.kind.clone(), "state" => state.clone())
                .set(*n as f64);
        }
        for (cp, n) in &k.checkpoints {
            metrics::gauge!("kfs_leased_checkpoints", "kind" => k.kind.clone(), "checkpoint" => cp.clone())
                .set(*n as f64);
        }
    }
    if let Some(d) = status.dead_letters {
        metrics::gauge!("kfs_dead_letters").set(f64::from(d));
    }
}
