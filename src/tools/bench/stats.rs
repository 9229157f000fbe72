//! Percentiles of measured latencies. Invariant: pure functions over the samples they are given;
//! a percentile is the smallest sample with at least that share of samples at or below it
//! (nearest rank), so every reported number is one that was actually measured.

use serde::Serialize;

/// p50, p99 and max of one set of samples, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

/// The nearest-rank percentile `p` (0 < p ≤ 100) of `sorted`, which must be sorted ascending.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() || !(p > 0.0 && p <= 100.0) {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

/// Summarises `samples` (any order); `None` when there are none.
pub fn summarize(samples: &[f64]) -> Option<Summary> {
    let mut sorted: Vec<f64> = samples.iter().copied().filter(|s| s.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    Some(Summary {
        p50: percentile(&sorted, 50.0)?,
        p99: percentile(&sorted, 99.0)?,
        max: *sorted.last()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_table() {
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        for (samples, p, want) in [
            (&hundred[..], 50.0, Some(50.0)),
            (&hundred[..], 99.0, Some(99.0)),
            (&hundred[..], 100.0, Some(100.0)),
            (&hundred[..], 1.0, Some(1.0)),
            (&[7.0][..], 50.0, Some(7.0)),
            (&[7.0][..], 99.0, Some(7.0)),
            (&[1.0, 2.0][..], 50.0, Some(1.0)),
            (&[1.0, 2.0][..], 99.0, Some(2.0)),
            (&[][..], 50.0, None),
            (&hundred[..], 0.0, None),
            (&hundred[..], 101.0, None),
        ] {
            assert_eq!(
                percentile(samples, p),
                want,
                "p{p} of {} samples",
                samples.len()
            );
        }
    }

    #[test]
    fn summary_sorts_and_ignores_non_finite_samples() {
        let s = summarize(&[5.0, f64::NAN, 1.0, 3.0, f64::INFINITY]).unwrap();
        assert_eq!(
            s,
            Summary {
                p50: 3.0,
                p99: 5.0,
                max: 5.0
            }
        );
        assert_eq!(summarize(&[]), None);
        assert_eq!(summarize(&[f64::NAN]), None);
    }
}
