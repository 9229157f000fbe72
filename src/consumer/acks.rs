//! Which deliveries of one channel may be acked, and how: a pure state machine over delivery
//! tags. Invariant: an ack with `multiple = true` is asked for only up to a tag at or below which
//! every delivery still on the channel has had its deciding commit, so it never settles a
//! delivery that is still running or was abandoned; a decided delivery that a lower, undecided
//! one blocks is held at most [`HOLD`], then acked on its own.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How long a decided delivery waits for the lower ones before it is acked on its own: long
/// enough for a group that finished a moment later to be covered by one ack, short next to a
/// step.
pub const HOLD: Duration = Duration::from_millis(5);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tag {
    /// Received, no decision yet.
    Running,
    /// Its deciding commit happened at this time; not acked yet.
    Decided(Instant),
    /// Left unacked for redelivery (shutdown): never covered by a multiple ack.
    Abandoned,
}

/// An ack to send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ack {
    /// This delivery alone.
    One(u64),
    /// Every delivery up to and including this tag (`multiple = true`); `n` of them.
    UpTo { tag: u64, n: usize },
}

/// The deliveries of one channel not yet settled with the broker.
#[derive(Debug, Default)]
pub struct Window {
    tags: BTreeMap<u64, Tag>,
}

impl Window {
    pub fn received(&mut self, tag: u64) {
        self.tags.insert(tag, Tag::Running);
    }

    /// `tags` had their deciding commit at `now`. Returns the ack that covers every delivery
    /// now decided from the lowest unsettled one up, if any.
    pub fn decided(&mut self, tags: &[u64], now: Instant) -> Option<Ack> {
        for t in tags {
            if let Some(s) = self.tags.get_mut(t) {
                *s = Tag::Decided(now);
            }
        }
        self.front()
    }

    /// `tags` were settled otherwise (rejected, given back): they block nothing any more.
    pub fn settled(&mut self, tags: &[u64]) -> Option<Ack> {
        for t in tags {
            self.tags.remove(t);
        }
        self.front()
    }

    /// `tags` are left for redelivery: no multiple ack may cover them.
    pub fn abandoned(&mut self, tags: &[u64]) {
        for t in tags {
            if let Some(s) = self.tags.get_mut(t) {
                *s = Tag::Abandoned;
            }
        }
    }

    /// When the oldest held delivery is due to be acked on its own.
    pub fn flush_at(&self) -> Option<Instant> {
        self.tags
            .values()
            .filter_map(|s| match s {
                Tag::Decided(at) => Some(*at + HOLD),
                _ => None,
            })
            .min()
    }

    /// The held deliveries due by `now` (all of them with `force`), to ack one by one.
    pub fn flush(&mut self, now: Instant, force: bool) -> Vec<u64> {
        let due: Vec<u64> = self
            .tags
            .iter()
            .filter(|(_, s)| matches!(s, Tag::Decided(at) if force || *at + HOLD <= now))
            .map(|(t, _)| *t)
            .collect();
        for t in &due {
            self.tags.remove(t);
        }
        due
    }

    /// Pops the decided run at the front of the window.
    fn front(&mut self) -> Option<Ack> {
        let mut last = None;
        let mut n = 0;
        while let Some((&t, Tag::Decided(_))) = self.tags.first_key_value() {
            self.tags.remove(&t);
            last = Some(t);
            n += 1;
        }
        match (last, n) {
            (Some(t), 1) => Some(Ack::One(t)),
            (Some(tag), n) => Some(Ack::UpTo { tag, n }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An event on the window, and the ack it must produce.
    enum Ev {
        Recv(&'static [u64]),
        Decide(&'static [u64], Option<Ack>),
        Settle(&'static [u64], Option<Ack>),
        Abandon(&'static [u64]),
        /// Flush after this many ms past the decisions; these are acked alone.
        Flush(u64, &'static [u64]),
    }

    #[test]
    fn acks_cover_only_deliveries_whose_commit_happened() {
        use Ev::*;
        let cases: Vec<(&str, Vec<Ev>)> = vec![
            (
                "a group decided together is one multiple ack",
                vec![
                    Recv(&[1, 2, 3]),
                    Decide(&[1, 2, 3], Some(Ack::UpTo { tag: 3, n: 3 })),
                ],
            ),
            (
                "a lone delivery is acked alone",
                vec![Recv(&[1]), Decide(&[1], Some(Ack::One(1)))],
            ),
            (
                "a running lower delivery holds the higher ones",
                vec![
                    Recv(&[1, 2, 3]),
                    Decide(&[2, 3], None),
                    Decide(&[1], Some(Ack::UpTo { tag: 3, n: 3 })),
                ],
            ),
            (
                "the ack stops below a running delivery",
                vec![
                    Recv(&[1, 2, 3, 4]),
                    Decide(&[1, 2, 4], Some(Ack::UpTo { tag: 2, n: 2 })),
                    Decide(&[3], Some(Ack::UpTo { tag: 4, n: 2 })),
                ],
            ),
            (
                "a rejected delivery no longer blocks",
                vec![
                    Recv(&[1, 2, 3]),
                    Decide(&[2, 3], None),
                    Settle(&[1], Some(Ack::UpTo { tag: 3, n: 2 })),
                ],
            ),
            (
                "an abandoned delivery is never covered; the ones above it go alone",
                vec![
                    Recv(&[1, 2, 3]),
                    Abandon(&[1]),
                    Decide(&[2, 3], None),
                    Flush(1, &[]),
                    Flush(5, &[2, 3]),
                ],
            ),
            (
                "held deliveries acked alone are not counted again",
                vec![
                    Recv(&[1, 2, 3]),
                    Decide(&[2], None),
                    Flush(5, &[2]),
                    Decide(&[3], None),
                    Decide(&[1], Some(Ack::UpTo { tag: 3, n: 2 })),
                ],
            ),
        ];
        for (name, events) in cases {
            let mut w = Window::default();
            let t0 = Instant::now();
            for (i, ev) in events.into_iter().enumerate() {
                match ev {
                    Recv(t) => t.iter().for_each(|&t| w.received(t)),
                    Decide(t, want) => assert_eq!(w.decided(t, t0), want, "{name}: event {i}"),
                    Settle(t, want) => assert_eq!(w.settled(t), want, "{name}: event {i}"),
                    Abandon(t) => w.abandoned(t),
                    Flush(ms, want) => assert_eq!(
                        w.flush(t0 + Duration::from_millis(ms), false),
                        want,
                        "{name}: event {i}"
                    ),
                }
            }
        }
    }

    #[test]
    fn a_forced_flush_takes_every_held_delivery_and_the_due_time_is_the_oldest() {
        let mut w = Window::default();
        let t0 = Instant::now();
        [1, 2, 3].iter().for_each(|&t| w.received(t));
        assert_eq!(w.decided(&[2], t0), None);
        assert_eq!(w.decided(&[3], t0 + HOLD), None);
        assert_eq!(w.flush_at(), Some(t0 + HOLD));
        assert_eq!(w.flush(t0, true), vec![2, 3]);
        assert_eq!(w.flush_at(), None);
    }
}
