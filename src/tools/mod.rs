//! The dev tools beside the runtime: the `bench` and `demo` commands and the platform's request
//! helpers (`platform`) that they and the tests use to write the platform's own rows.
//! Invariant: the runtime — engine, intakes, relay, jobs, http — never imports tools; tools
//! import the runtime, never the other way round, so a tool can change without touching what
//! runs in production.

pub mod bench;
pub mod demo;
pub mod platform;
