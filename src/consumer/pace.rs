//! When a consumer takes its next deliveries. Deliveries that arrive while a kind's batches run
//! wait in the prefetch buffer and join the next batch, so under load batches grow and a
//! group's one commit covers more jobs. Invariant: the consumer holds deliveries back only
//! while all of these hold: the kind's steps share a transaction, its recent batches were
//! short (an average below [`SHORT`], from at least one finished batch), and at least
//! `most_young` of its batches started less than [`YOUNG`] ago are still running. So a kind
//! with long steps (whose members would step one after another in a big group), a kind whose
//! batches have not been timed yet, and a consumer whose batches are all stuck on a lock are
//! never held back, and none is held back for longer than [`YOUNG`]. Pure.

use std::time::{Duration, Instant};

/// A batch at least this long on average means members should not be made to wait for
/// company: they would gain a shared commit and lose more in waiting.
pub const SHORT: Duration = Duration::from_millis(50);

/// Only batches started less than this long ago hold the next ones back.
pub const YOUNG: Duration = Duration::from_millis(200);

/// The weight of a new batch's length in the running average (1/8).
const WEIGHT: u32 = 8;

/// One consumer's pacing state for one kind.
#[derive(Debug, Clone)]
pub struct Pace {
    groups: bool,
    most_young: usize,
    /// The running average of batch lengths; `None` until a batch finished.
    average: Option<Duration>,
    /// When each running batch started, oldest first.
    running: Vec<Instant>,
}

impl Pace {
    /// `groups`: whether the kind's claimed jobs share a transaction; `most_young`: how many
    /// young batches may run before the next deliveries wait (at least one).
    pub fn new(groups: bool, most_young: usize) -> Self {
        Self {
            groups,
            most_young: most_young.max(1),
            average: None,
            running: Vec::new(),
        }
    }

    /// A batch started at `at`.
    pub fn started(&mut self, at: Instant) {
        let i = self.running.partition_point(|s| *s <= at);
        self.running.insert(i, at);
    }

    /// The batch started at `at` finished at `now`.
    pub fn finished(&mut self, at: Instant, now: Instant) {
        if let Some(i) = self.running.iter().position(|s| *s == at) {
            self.running.remove(i);
        }
        let took = now.saturating_duration_since(at);
        self.average = Some(match self.average {
            None => took,
            Some(avg) => (avg * (WEIGHT - 1) + took) / WEIGHT,
        });
    }

    /// Whether the consumer takes its next deliveries now.
    pub fn may_take(&self, now: Instant) -> bool {
        if !self.groups || self.average.is_none_or(|a| a >= SHORT) {
            return true;
        }
        self.young(now) < self.most_young
    }

    /// When a running batch stops being young, if holding back depends on it: the consumer
    /// looks again then.
    pub fn look_again_at(&self, now: Instant) -> Option<Instant> {
        if self.may_take(now) {
            return None;
        }
        self.running
            .iter()
            .map(|s| *s + YOUNG)
            .find(|&end| end > now)
    }

    fn young(&self, now: Instant) -> usize {
        self.running
            .iter()
            .filter(|s| now.saturating_duration_since(**s) < YOUNG)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// groups, finished batch lengths, running batch ages, most_young → may take now, why.
    type Case = (
        bool,
        &'static [u64],
        &'static [u64],
        usize,
        bool,
        &'static str,
    );

    #[test]
    fn when_the_next_deliveries_are_taken() {
        let cases: &[Case] = &[
            (
                false,
                &[1, 1],
                &[0, 0, 0, 0],
                2,
                true,
                "kinds that do not group never wait",
            ),
            (true, &[], &[0, 0, 0], 2, true, "no batch timed yet"),
            (
                true,
                &[2, 2],
                &[0],
                2,
                true,
                "one young batch of two allowed",
            ),
            (
                true,
                &[2, 2],
                &[0, 1],
                2,
                false,
                "two young short batches hold the next back",
            ),
            (
                true,
                &[2, 2],
                &[250, 300],
                2,
                true,
                "old batches (stuck) do not hold it back",
            ),
            (true, &[2, 2], &[250, 1], 2, true, "one young, one old"),
            (
                true,
                &[300],
                &[0, 1, 2],
                2,
                true,
                "long batches never hold it back",
            ),
            (
                true,
                &[2, 2],
                &[],
                0,
                true,
                "a bound of 0 still lets one batch run",
            ),
            (
                true,
                &[2, 2],
                &[0],
                0,
                false,
                "…and holds a second young one back",
            ),
        ];
        for (groups, lengths, ages, most, want, why) in cases {
            let t0 = Instant::now();
            let now = t0 + ms(1000);
            let mut p = Pace::new(*groups, *most);
            for l in *lengths {
                p.started(t0);
                p.finished(t0, t0 + ms(*l));
            }
            for a in *ages {
                p.started(now - ms(*a));
            }
            assert_eq!(p.may_take(now), *want, "{why}");
        }
    }

    #[test]
    fn the_average_follows_recent_batches() {
        let t0 = Instant::now();
        let mut p = Pace::new(true, 1);
        p.started(t0);
        p.finished(t0, t0 + ms(400));
        assert!(p.may_take(t0), "a long first batch");
        // Short batches bring the average under the bound after a while.
        let mut short = 0;
        while p.average.unwrap() >= SHORT {
            p.started(t0);
            p.finished(t0, t0 + ms(1));
            short += 1;
            assert!(short < 100);
        }
        assert!(
            short > 5,
            "one short batch does not outweigh a long history"
        );
        p.started(t0);
        assert!(!p.may_take(t0));
    }

    #[test]
    fn the_consumer_looks_again_when_the_oldest_young_batch_ages() {
        let t0 = Instant::now();
        let mut p = Pace::new(true, 2);
        p.started(t0);
        p.finished(t0, t0 + ms(1));
        let now = t0 + ms(100);
        p.started(now - ms(10));
        p.started(now - ms(30));
        assert!(!p.may_take(now));
        assert_eq!(p.look_again_at(now), Some(now - ms(30) + YOUNG));
        assert!(p.may_take(now - ms(30) + YOUNG));
        p.finished(now - ms(30), now);
        assert!(p.may_take(now));
        assert_eq!(p.look_again_at(now), None);
    }
}
