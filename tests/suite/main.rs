//! The integration tests: one test binary, so the crate is linked once for all of them instead
//! of once per file. Each module is one area, run against the real services (`ops/services`);
//! `support` is the harness they share (a fresh database and queue prefix per test, worker
//! processes, the space fixtures, the fault proxy), and `support::isolation` lets a test that
//! stops Postgres or RabbitMQ run alone while the others run in parallel beside each other.
//!
//! ```text
//! cargo test --all-features --test suite                                # everything
//! cargo test --all-features --test suite relay::                        # one module
//! cargo test --all-features --test suite -- --skip restart_mid_run      # no service restarts
//! cargo test --all-features --test suite chaos:: -- --nocapture         # the chaos run alone
//! ```
//!
//! `crash` and `chaos` need the kill points of the `crash-points` feature and are only built
//! with it.

mod support;

mod batch;
mod bench;
#[cfg(feature = "crash-points")]
mod chaos;
mod cli;
mod compile;
mod consumer;
#[cfg(feature = "crash-points")]
mod crash;
mod dashboard;
mod deletion;
mod demo;
mod deploy;
mod documents;
mod engine;
mod fairness;
mod findability;
mod http;
mod lead;
mod leased;
mod maintenance;
mod malformed;
mod model;
mod nodes;
mod outage;
mod pageindex;
mod parser_remote;
mod publication;
mod relay;
mod research;
mod schema;
mod semantic;
mod session;
mod statistics;
mod status;
mod tls;
mod tracing;
