//! Which relay rounds to start, as a pure state machine. Invariant: at most `depth` rounds of one
//! kind are in flight; a kind gets a new round only when something may be due (a notification,
//! the poll, or its last round claimed a full batch), so an idle relay issues no claims, and only
//! while the relay leads it (`lead`); a kind it comes to lead is due at once. A kind with a
//! backlog (its last round was full) gets `depth` rounds at once.
//!
//! Keeping two rounds in flight lets the next batch be claimed and published while the broker
//! confirms the previous one. Each round claims under its own lock token with `SKIP LOCKED`, so
//! rounds never share a row, and each settles only the rows it claimed.

use std::collections::{BTreeMap, BTreeSet};

use crate::jobs::Kind;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    depth: usize,
    in_flight: BTreeMap<Kind, usize>,
    wanted: BTreeSet<Kind>,
    backlog: BTreeSet<Kind>,
    led: BTreeSet<Kind>,
}

impl Schedule {
    /// Every kind starts wanted (rows may have come due while no relay ran) and led.
    pub fn new(kinds: &[Kind], depth: usize) -> Self {
        Self {
            depth: depth.max(1),
            in_flight: kinds.iter().map(|&k| (k, 0)).collect(),
            wanted: kinds.iter().copied().collect(),
            backlog: BTreeSet::new(),
            led: kinds.iter().copied().collect(),
        }
    }

    /// The relay leads `led` from now on: no new round starts for any other kind, and a kind
    /// it did not lead before is due (its last leader may have left rows behind).
    pub fn lead(&mut self, led: &BTreeSet<Kind>) {
        for k in led.difference(&self.led) {
            if self.in_flight.contains_key(k) {
                self.wanted.insert(*k);
            }
        }
        self.led = led
            .iter()
            .copied()
            .filter(|k| self.in_flight.contains_key(k))
            .collect();
    }

    /// Rows of `kinds` may be due (a notification, or the poll for all kinds).
    pub fn wake(&mut self, kinds: impl IntoIterator<Item = Kind>) {
        for k in kinds {
            if self.in_flight.contains_key(&k) {
                self.wanted.insert(k);
            }
        }
    }

    /// A round of `kind` ended; `full`: it claimed a whole batch, so more rows may wait.
    pub fn finished(&mut self, kind: Kind, full: bool) {
        if let Some(n) = self.in_flight.get_mut(&kind) {
            *n = n.saturating_sub(1);
        }
        if full {
            self.wanted.insert(kind);
            self.backlog.insert(kind);
        } else {
            self.backlog.remove(&kind);
        }
    }

    /// The rounds to start now, counted as in flight from here on.
    pub fn start(&mut self) -> Vec<Kind> {
        let mut out = Vec::new();
        for (&kind, n) in &mut self.in_flight {
            if *n < self.depth && self.led.contains(&kind) && self.wanted.remove(&kind) {
                *n += 1;
                out.push(kind);
                while self.backlog.contains(&kind) && *n < self.depth {
                    *n += 1;
                    out.push(kind);
                }
            }
        }
        out
    }

    /// `kind` has no round in flight and none to start: none wanted, or it is not led.
    pub fn quiet(&self, kind: Kind) -> bool {
        self.in_flight.get(&kind).is_none_or(|&n| n == 0)
            && (!self.wanted.contains(&kind) || !self.led.contains(&kind))
    }

    pub fn idle(&self) -> bool {
        self.in_flight.values().all(|&n| n == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug)]
    enum Ev {
        Wake(&'static [Kind]),
        Finished(Kind, bool),
        Lead(&'static [Kind]),
    }

    #[test]
    #[allow(non_upper_case_globals)]
    fn schedule_table() {
        const Compile: Kind = Kind::Compile;
        const Probe: Kind = Kind::Probe;
        const Research: Kind = Kind::Research;
        // (events applied in order, then the rounds `start` returns)
        // Every case starts after the first `start`, with one round of each kind in flight:
        // (events applied in order, then the rounds `start` returns).
        let cases: &[(&str, &[Ev], &[Kind])] = &[
            ("nothing happened: no new round", &[], &[]),
            (
                "a full batch means a backlog: rounds up to the depth at once",
                &[Ev::Finished(Probe, true)],
                &[Probe, Probe],
            ),
            (
                "a partial batch ends the backlog",
                &[
                    Ev::Finished(Probe, true),
                    Ev::Finished(Probe, false),
                    Ev::Wake(&[Probe]),
                ],
                &[Probe],
            ),
            (
                "a partial batch with nothing notified: no new round",
                &[Ev::Finished(Probe, false)],
                &[],
            ),
            (
                "a notification while a round is in flight starts a second one",
                &[Ev::Wake(&[Probe])],
                &[Probe],
            ),
            (
                "a notification of another kind wakes only that kind",
                &[Ev::Wake(&[Compile])],
                &[Compile],
            ),
            (
                "notifications of kinds this relay does not serve are ignored",
                &[Ev::Wake(&[Research])],
                &[],
            ),
            (
                "the poll wakes every kind",
                &[Ev::Wake(&[Compile, Probe, Research])],
                &[Compile, Probe],
            ),
            (
                "a kind another relay leads gets no round, woken or not",
                &[Ev::Lead(&[Compile]), Ev::Wake(&[Compile, Probe])],
                &[Compile],
            ),
            (
                "a backlog of a kind no longer led starts no round",
                &[Ev::Lead(&[Compile]), Ev::Finished(Probe, true)],
                &[],
            ),
            (
                "a kind it comes to lead is due at once, with no notification",
                &[
                    Ev::Lead(&[]),
                    Ev::Finished(Probe, false),
                    Ev::Lead(&[Probe]),
                ],
                &[Probe],
            ),
            (
                "a kind still led is not due again from leading it",
                &[Ev::Finished(Probe, false), Ev::Lead(&[Compile, Probe])],
                &[],
            ),
            (
                "leading a kind the relay does not serve starts nothing",
                &[Ev::Lead(&[Research])],
                &[],
            ),
        ];
        for (name, events, want) in cases {
            let mut s = Schedule::new(&[Compile, Probe], 2);
            assert_eq!(s.start(), vec![Compile, Probe], "{name}: the first start");
            for e in *events {
                match *e {
                    Ev::Wake(k) => s.wake(k.iter().copied()),
                    Ev::Finished(k, full) => s.finished(k, full),
                    Ev::Lead(k) => s.lead(&k.iter().copied().collect()),
                }
            }
            assert_eq!(&s.start(), want, "{name}");
        }
    }

    #[test]
    fn a_kind_is_quiet_only_with_no_round_in_flight_and_none_to_start() {
        let mut s = Schedule::new(&[Kind::Probe], 2);
        assert!(!s.quiet(Kind::Probe), "wanted from the start");
        s.start();
        assert!(!s.quiet(Kind::Probe), "in flight");
        s.finished(Kind::Probe, true);
        assert!(!s.quiet(Kind::Probe), "a full batch wants another round");
        s.start();
        s.finished(Kind::Probe, false);
        s.finished(Kind::Probe, false);
        assert!(
            s.quiet(Kind::Probe),
            "partial batches and nothing in flight"
        );
        s.wake([Kind::Probe]);
        assert!(!s.quiet(Kind::Probe), "woken");
        s.lead(&BTreeSet::new());
        assert!(s.quiet(Kind::Probe), "woken, but another relay leads it");
    }

    #[test]
    fn depth_caps_rounds_per_kind() {
        let mut s = Schedule::new(&[Kind::Probe], 2);
        assert_eq!(s.start(), vec![Kind::Probe]);
        s.wake([Kind::Probe]);
        assert_eq!(s.start(), vec![Kind::Probe]);
        s.wake([Kind::Probe]);
        assert_eq!(
            s.start(),
            Vec::<Kind>::new(),
            "two in flight: the third waits"
        );
        s.finished(Kind::Probe, false);
        assert_eq!(
            s.start(),
            vec![Kind::Probe],
            "the wake is kept until a slot frees"
        );
        s.finished(Kind::Probe, false);
        s.finished(Kind::Probe, false);
        assert!(s.idle());
        assert_eq!(s.start(), Vec::<Kind>::new(), "idle and nothing due");
    }
}
