//! The protocol, with no AMQP and no HTTP in it: the vocabulary of a job kind ([`kind`]), the
//! one slice runner ([`runner`]), the group runner that steps several claimed jobs of a kind in
//! one transaction ([`group`]), and the fenced transitions of a job (claim, fence, advance,
//! heartbeat, end, release), written once per table shape: the outbox kinds' in [`lease`], the
//! leased kinds' in [`leased`]. It imports nothing above it: no intake, no kind, no registry.
//! Invariant: every write to a claimed job compares its lease token and row version against an
//! unexpired lease by the database's wall clock, zero rows changed means the lease is lost and
//! nothing more is written, and how a slice goes on or ends is decided by
//! [`slice::after_step`] alone. The intakes (the broker's deliveries in [`crate::consumer`],
//! polled leases in [`crate::poller`]) feed the runner; [`backoff`] paces their retries and the
//! relay's reconnects.

pub(crate) mod backoff;
pub mod group;
pub mod kind;
pub mod lease;
pub mod leased;
pub mod polled;
pub mod retry;
pub mod runner;
pub mod settle;
pub mod slice;
pub mod unwind;
pub mod wire;
