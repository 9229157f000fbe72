//! kfs-worker: the background-job runtime of the knowledge platform.
//!
//! The platform's API commits a job row and an outbox row in one transaction; everything after
//! that commit happens here. Postgres is the source of truth, and a RabbitMQ message is only a
//! wake-up call that names an outbox row.
//!
//! - [`canonical`] — the platform's canonical JSON, ids, full-text normalisation and terms.
//! - [`access`] — the platform's revalidation of a permission snapshot.
//! - [`config`] — settings from the environment, validated once, secrets redacted.
//! - [`db`] — Postgres pools, migrations, error classification.
//! - [`command`] — what every command shares: connection flags and the failure it ends with.
//! - [`wire`] — the message format shared by relay and consumer: headers, body limit,
//!   traceparent, decoding.
//! - [`broker`] — RabbitMQ connections and topology.
//! - [`publication`] — which document generations a space serves; head moves by CAS.
//! - [`relay`] — outbox rows to confirmed messages.
//! - [`engine`] — the protocol: the kind vocabulary, fenced transitions, slice decisions.
//! - [`consumer`] — the broker intake: deliveries to fenced, checkpointed steps; ack after commit.
//! - [`poller`] — the polled intake: leased kinds claimed straight from Postgres.
//! - [`jobs`] — the registry of job kinds and one folder per kind.
//! - [`embed`] — the embedding port: offline and OpenAI-compatible adapters.
//! - [`model`] — the reasoning-model port of model-driven compiles, under the platform's limits
//!   (FIFO gate, per-document budget, breaker): offline and OpenAI-compatible adapters.
//! - [`store`] — the object store port (local directory, S3, GCS, Azure).
//! - [`liveness`] — worker liveness for fast takeover.
//! - [`maintenance`] — early takeover sweeps and outbox retention.
//! - [`runtime`] — the `run` process: relay, consumers and maintenance under one shutdown.
//! - [`http`] — health, readiness, metrics and the operator dashboard over HTTP.
//! - [`metrics`] — metric names and the Prometheus recorder.
//! - [`status`] — what the job tables and queues hold right now.
//! - [`dlq`] — peek at the dead-letter queue and requeue one message.
//! - [`tools`] — dev tools the runtime never imports: [`tools::demo`] (the main job end to end,
//!   for newcomers), [`tools::bench`] (throughput and latency next to the bare loop the machine
//!   allows) and [`tools::platform`] (writers of the platform's own rows — spaces, sources,
//!   documents — for demo, bench and tests).
//! - [`cli`] — the command line.
//! - [`telemetry`] — logging.
//! - [`crash`] — kill points for crash tests.
//!

pub mod access;
pub mod broker;
pub mod canonical;
pub mod capability;
pub mod cli;
pub mod command;
pub mod config;
pub mod consumer;
pub mod crash;
pub mod db;
pub mod dlq;
pub mod embed;
pub mod engine;
pub mod http;
pub mod jobs;
pub mod liveness;
pub mod maintenance;
pub mod metrics;
pub mod model;
pub mod poller;
pub mod progress;
pub mod publication;
pub mod relay;
pub mod runtime;
pub mod status;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod tools;
/// The wire format lives in the engine; kept at this path for the tools and tests.
pub use engine::wire;
