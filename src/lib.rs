//! kfs-worker: the background-job runtime of the knowledge platform.
//!
//! The platform's API commits a job row and an outbox row in one transaction; everything after
//! that commit happens here. Postgres is the source of truth, and a RabbitMQ message is only a
//! wake-up call that names an outbox row.
//!
//! - [`config`] — settings from the environment, validated once, secrets redacted.
//! - [`db`] — Postgres pools, migrations, error classification.
//! - [`broker`] — RabbitMQ connections, topology and message shape.
//! - [`relay`] — outbox rows to confirmed messages.
//! - [`consumer`] — deliveries to fenced, checkpointed steps; ack after commit.
//! - [`jobs`] — the job kinds, their policies and handlers.
//! - [`liveness`] — worker liveness for fast takeover.
//! - [`maintenance`] — early takeover sweeps and outbox retention.
//! - [`runtime`] — the `run` process: relay, consumers and maintenance under one shutdown.
//! - [`cli`] — the command line.
//! - [`telemetry`] — logging.
//! - [`crash`] — kill points for crash tests.
//!

pub mod broker;
pub mod cli;
pub mod config;
pub mod consumer;
pub mod crash;
pub mod db;
pub mod jobs;
pub mod liveness;
pub mod maintenance;
pub mod relay;
pub mod runtime;
pub mod telemetry;
