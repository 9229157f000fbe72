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
//! - [`broker`] — RabbitMQ connections, topology and message shape.
//! - [`platform`] — writers of the platform's own rows (spaces, sources, documents), for demo and tests.
//! - [`publication`] — which document generations a space serves; head moves by CAS.
//! - [`relay`] — outbox rows to confirmed messages.
//! - [`consumer`] — deliveries to fenced, checkpointed steps; ack after commit.
//! - [`jobs`] — the job kinds, their policies and handlers.
//! - [`embed`] — the embedding port: offline and OpenAI-compatible adapters.
//! - [`store`] — the object store port (local directory, S3, GCS, Azure).
//! - [`liveness`] — worker liveness for fast takeover.
//! - [`maintenance`] — early takeover sweeps and outbox retention.
//! - [`runtime`] — the `run` process: relay, consumers and maintenance under one shutdown.
//! - [`http`] — health, readiness, metrics and the operator dashboard over HTTP.
//! - [`metrics`] — metric names and the Prometheus recorder.
//! - [`status`] — what the job tables and queues hold right now.
//! - [`dlq`] — peek at the dead-letter queue and requeue one message.
//! - [`demo`] — the main job end to end, for newcomers.
//! - [`bench`] — throughput and latency next to the bare loop the machine allows.
//! - [`cli`] — the command line.
//! - [`telemetry`] — logging.
//! - [`crash`] — kill points for crash tests.
//!

pub mod access;
pub mod bench;
pub mod broker;
pub mod canonical;
pub mod cli;
pub mod config;
pub mod consumer;
pub mod crash;
pub mod db;
pub mod demo;
pub mod dlq;
pub mod embed;
pub mod engine;
pub mod http;
pub mod jobs;
pub mod liveness;
pub mod maintenance;
pub mod metrics;
pub mod platform;
pub mod poller;
pub mod progress;
pub mod publication;
pub mod relay;
pub mod runtime;
pub mod status;
pub mod store;
pub mod telemetry;
pub mod wire;
