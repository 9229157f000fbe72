//! Retry schedules as a pure function. Invariant: the delay never exceeds the cap, never goes
//! below half the uncapped exponential step (or half the cap), and grows with the attempt.

use std::time::Duration;

/// Exponential backoff with jitter: `min(max, base·2^(n−1))`, scaled into `[0.5, 1.0]` of itself
/// by the jitter factor so that many jobs failing together do not come back together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    pub base: Duration,
    pub max: Duration,
}

impl RetryPolicy {
    /// `attempt` counts from 1; `jitter` is in `[0, 1]` (0 keeps the full delay).
    pub fn delay(&self, attempt: u32, jitter: f64) -> Duration {
        let exp = attempt.saturating_sub(1).min(32);
        let raw = self.base.saturating_mul(1u32 << exp.min(31));
        let capped = raw.min(self.max);
        let factor = 1.0 - 0.5 * jitter.clamp(0.0, 1.0);
        capped.mul_f64(factor)
    }

    /// [`Self::delay`] with a random jitter.
    pub fn delay_jittered(&self, attempt: u32) -> Duration {
        self.delay(attempt, rand::random::<f64>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn schedule_table() {
        let p = RetryPolicy {
            base: S(5),
            max: S(300),
        };
        // (attempt, jitter, expected)
        let table = [
            (1, 0.0, S(5)),
            (2, 0.0, S(10)),
            (3, 0.0, S(20)),
            (4, 0.0, S(40)),
            (6, 0.0, S(160)),
            (7, 0.0, S(300)),
            (50, 0.0, S(300)),
            (1, 1.0, Duration::from_millis(2500)),
            (7, 1.0, S(150)),
            (3, 0.5, S(15)),
            (0, 0.0, S(5)),
        ];
        for (attempt, jitter, want) in table {
            assert_eq!(
                p.delay(attempt, jitter),
                want,
                "attempt {attempt} jitter {jitter}"
            );
        }
    }

    #[test]
    fn jittered_delay_stays_in_bounds() {
        let p = RetryPolicy {
            base: S(5),
            max: S(300),
        };
        for attempt in 1..40 {
            let d = p.delay_jittered(attempt);
            assert!(d <= S(300));
            assert!(d >= p.delay(attempt, 1.0));
        }
    }

    #[test]
    fn huge_base_saturates_at_cap() {
        let p = RetryPolicy {
            base: Duration::MAX / 2,
            max: S(60),
        };
        assert_eq!(p.delay(10, 0.0), S(60));
    }
}
