//! Reconnect pacing shared by the consumers' and the relay's sessions and by start-up.
//! Invariant: a lost connection is retried after a growing, jittered delay (never in a busy
//! loop), and a wait ends at once when shutdown is requested.

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
