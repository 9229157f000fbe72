//! Logging and tracing setup. Invariant: logs go to stderr (stdout belongs to command output),
//! human readable by default, one JSON object per line with `KFS_LOG_FORMAT=json`; spans are
//! exported over OTLP only when `OTEL_EXPORTER_OTLP_ENDPOINT` (or its traces variant) is set,
//! and a W3C `traceparent` crosses the broker so one trace shows API → relay → worker.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{fmt, Layer};

static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Keeps the span exporter alive; dropping it flushes what is buffered.
#[must_use = "dropping the guard stops the span export"]
pub struct Guard {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            if let Err(e) = p.shutdown() {
                eprintln!("kfs-worker: flushing spans to the OTLP endpoint failed: {e}");
            }
        }
    }
}

/// Whether the environment asks for OTLP export.
pub fn otlp_configured() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|v| std::env::var(v).is_ok_and(|s| !s.trim().is_empty()))
}

/// Checks the logging settings before anything is logged: `KFS_LOG_FORMAT` is `text` or
/// `json` (or unset), and `RUST_LOG`, when set, is a filter `tracing` understands.
pub fn check_env() -> Result<(), crate::config::ConfigError> {
    check_settings(
        std::env::var("KFS_LOG_FORMAT").ok().as_deref(),
        std::env::var("RUST_LOG").ok().as_deref(),
    )
}

fn check_settings(
    format: Option<&str>,
    filter: Option<&str>,
) -> Result<(), crate::config::ConfigError> {
    use crate::config::ConfigError;
    if let Some(f) = format.map(str::trim).filter(|f| !f.is_empty()) {
        if !f.eq_ignore_ascii_case("json") && !f.eq_ignore_ascii_case("text") {
            let shown: String = f.chars().take(40).collect();
            return Err(ConfigError::new(
                "KFS_LOG_FORMAT",
                format!("must be 'text' or 'json', got '{shown}'"),
            ));
        }
    }
    if let Some(f) = filter.filter(|f| !f.trim().is_empty()) {
        if let Err(e) = EnvFilter::try_new(f) {
            return Err(ConfigError::new(
                "RUST_LOG",
                format!("is not a log filter ({e}), e.g. 'info' or 'kfs_worker=debug,info'"),
            ));
        }
    }
    Ok(())
}

/// Sets up logging, and span export when configured. `default_filter` applies to the logs
/// when `RUST_LOG` is unset; exported spans are the worker's own at info and above,
/// whatever the log filter.
pub fn init(default_filter: &str) -> Guard {
    let filter =
        EnvFilter::try_from_env("RUST_LOG").unwrap_or_else(|_| EnvFilter::new(default_filter));
    let json = std::env::var("KFS_LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let logs = if json {
        fmt::layer()
            .json()
            .flatten_event(true)
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed()
    } else {
        // Colours only on a terminal: a log file, journald or a container log gets plain text.
        fmt::layer()
            .compact()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed()
    };
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let provider = if otlp_configured() {
        match exporter() {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("kfs-worker: OTLP span export is off: {e}");
                None
            }
        }
    } else {
        None
    };
    let spans = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("kfs-worker"))
            .with_filter(
                Targets::new()
                    .with_target("kfs_worker", LevelFilter::INFO)
                    .with_default(LevelFilter::OFF),
            )
    });
    let installed = tracing_subscriber::registry()
        .with(logs)
        .with(spans)
        .try_init()
        .is_ok();
    EXPORTING.store(installed && provider.is_some(), Ordering::Relaxed);
    Guard { provider }
}

fn exporter() -> Result<SdkTracerProvider, opentelemetry_otlp::ExporterBuildError> {
    // Endpoint, headers, timeout and batch sizes come from the standard OTEL_* variables.
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(
            std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "kfs-worker".to_owned()),
        )
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

/// Makes `span` a child of the remote span a W3C `traceparent` names. Without one (or with a
/// malformed one) the span stays a root.
pub fn set_remote_parent(span: &Span, traceparent: Option<&str>) {
    let Some(tp) = traceparent else { return };
    let carrier = HashMap::from([("traceparent".to_owned(), tp.to_owned())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    let _ = span.set_parent(cx);
}

/// Links `span` to the remote span a `traceparent` names: a batch of deliveries has one span,
/// linked to each message's publish.
pub fn add_remote_link(span: &Span, traceparent: Option<&str>) {
    use opentelemetry::trace::TraceContextExt;
    let Some(tp) = traceparent else { return };
    let carrier = HashMap::from([("traceparent".to_owned(), tp.to_owned())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    span.add_link(cx.span().span_context().clone());
}

/// The `traceparent` that names `span`, when spans are being exported; otherwise `None`.
pub fn traceparent_of(span: &Span) -> Option<String> {
    if !EXPORTING.load(Ordering::Relaxed) {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
    carrier.remove("traceparent")
}

#[cfg(test)]
mod settings_tests {
    use super::check_settings;

    #[test]
    fn log_settings_table() {
        for (format, filter, err) in [
            (None, None, None),
            (Some("json"), None, None),
            (Some("JSON"), Some("info,sqlx=warn"), None),
            (Some("text"), Some("kfs_worker=debug"), None),
            (Some(""), Some(""), None),
            (
                Some("xml"),
                None,
                Some("KFS_LOG_FORMAT: must be 'text' or 'json', got 'xml'"),
            ),
            (
                None,
                Some("info,=[{"),
                Some("RUST_LOG: is not a log filter"),
            ),
        ] {
            let got = check_settings(format, filter).err().map(|e| e.to_string());
            match (err, got) {
                (None, None) => {}
                (Some(want), Some(got)) => assert!(got.starts_with(want), "{got}"),
                (want, got) => panic!("{format:?} {filter:?}: want {want:?}, got {got:?}"),
            }
        }
    }
}
