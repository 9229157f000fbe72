//! Pacing of retries: reconnects of the consumers' and the relay's sessions and start-up,
//! and database calls retried inside a claim or a slice. Invariant: a failed call is retried
//! after a growing, jittered delay (never in a busy loop), and a wait ends at once when
//! shutdown is requested.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use tokio_util::sync::CancellationToken;

/// Reconnect delays: 100 ms doubling to 10 s, with jitter, forever.
pub(crate) fn reconnect_backoff() -> impl Iterator<Item = Duration> {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(10))
        .with_jitter()
        .without_max_times()
        .build()
}

/// Sleeps `d` unless shutdown comes first. `false`: shutting down.
pub(crate) async fn nap(d: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        () = shutdown.cancelled() => false,
        () = tokio::time::sleep(d) => true,
    }
}

/// The pause before the `tries`-th retry of a database call: 100 ms doubling to 5 s, with
/// jitter (half to all of it), so that workers that lost Postgres together do not return in
/// step.
pub(crate) fn retry_pause(tries: u32) -> Duration {
    let base = backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .with_factor(2.0)
        .without_max_times();
    let ceiling = backon::BackoffBuilder::build(base)
        .nth(usize::try_from(tries.saturating_sub(1)).unwrap_or(usize::MAX))
        .unwrap_or(Duration::from_secs(5));
    ceiling.mul_f64(0.5 + rand::random::<f64>() * 0.5)
}

#[cfg(test)]
mod tests {
    use super::retry_pause;
    use std::time::Duration;

    #[test]
    fn retry_pauses_grow_to_a_ceiling_with_jitter() {
        // (try, lowest, highest): half to all of 100 ms × 2^(try-1), at most 5 s.
        let table = [
            (1, 50, 100),
            (2, 100, 200),
            (3, 200, 400),
            (6, 1600, 3200),
            (7, 2500, 5000),
            (50, 2500, 5000),
        ];
        for (tries, lo, hi) in table {
            for _ in 0..50 {
                let p = retry_pause(tries);
                assert!(
                    p >= Duration::from_millis(lo) && p <= Duration::from_millis(hi),
                    "try {tries}: {p:?} outside {lo}..={hi} ms"
                );
            }
        }
    }
}
