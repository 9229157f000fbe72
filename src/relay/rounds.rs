//! The relay's rounds on one channel. Invariant: once a round has failed no new one starts,
//! the rounds already in flight still settle what they claimed, and the first failure is kept.

use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use lapin::Channel;

use super::{schedule, Relay, RelayError, Round};
use crate::jobs::Kind;

/// How a round in flight ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settled {
    Round(Round),
    Failed,
}

type RoundFuture<'a> = futures_util::future::BoxFuture<'a, (Kind, Result<Round, RelayError>)>;

/// The relay's rounds on one channel, started as the [`schedule::Schedule`] allows. Invariant:
/// once a round has failed no new one starts, and the rounds already in flight still settle
/// what they claimed; the first failure is kept.
pub struct Rounds<'a> {
    relay: &'a Relay,
    channel: &'a Channel,
    batch: usize,
    schedule: schedule::Schedule,
    in_flight: FuturesUnordered<RoundFuture<'a>>,
    failed: Option<RelayError>,
}

impl<'a> Rounds<'a> {
    pub fn new(relay: &'a Relay, channel: &'a Channel, kinds: &[Kind]) -> Self {
        Self {
            relay,
            channel,
            batch: usize::try_from(relay.cfg.batch).unwrap_or(usize::MAX),
            schedule: schedule::Schedule::new(kinds, relay.cfg.depth),
            in_flight: FuturesUnordered::new(),
            failed: None,
        }
    }

    /// Rows of `kinds` may be due.
    pub fn wake(&mut self, kinds: impl IntoIterator<Item = Kind>) {
        self.schedule.wake(kinds);
    }

    /// The relay leads `led` from now on ([`schedule::Schedule::lead`]).
    pub fn lead(&mut self, led: &std::collections::BTreeSet<Kind>) {
        self.schedule.lead(led);
    }

    /// Starts the rounds the schedule allows, unless a round has failed.
    pub fn start(&mut self) {
        if self.failed.is_some() {
            return;
        }
        for kind in self.schedule.start() {
            let (relay, channel) = (self.relay, self.channel);
            self.in_flight.push(
                relay
                    .relay_once(channel, kind)
                    .map(move |r| (kind, r))
                    .boxed(),
            );
        }
    }

    /// Waits for the next round in flight to end, and says of which kind. `None`: none is in
    /// flight. A failed round is kept for [`Rounds::failed`].
    pub async fn settle(&mut self) -> Option<(Kind, Settled)> {
        let (kind, round) = self.in_flight.next().await?;
        Some((
            kind,
            match round {
                Ok(r) => {
                    self.schedule.finished(kind, r.claimed >= self.batch);
                    Settled::Round(r)
                }
                Err(e) => {
                    self.schedule.finished(kind, false);
                    self.failed.get_or_insert(e);
                    Settled::Failed
                }
            },
        ))
    }

    /// `kind` has no round in flight and none to start.
    pub fn quiet(&self, kind: Kind) -> bool {
        self.schedule.quiet(kind)
    }

    pub fn in_flight(&self) -> bool {
        !self.in_flight.is_empty()
    }

    pub fn has_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// The first round's failure, if any.
    pub fn failed(self) -> Option<RelayError> {
        self.failed
    }
}
