//! Kill and stall points for crash tests. Invariant: without the `crash-points` feature this
//! compiles to nothing; with it, `KFS_CRASH_AT=<point>[:<n>]` aborts the process at the n-th
//! (default first) pass through that point, the way SIGKILL would: no destructor, no flush, no
//! ack; and `KFS_STALL_AT=<point>` makes every pass through a stall point wait forever, the way
//! a connect to a host that never answers does.

/// The points the engine passes through.
pub const POINTS: [&str; 5] = [
    "after-claim-commit",
    "after-step-commit",
    "before-ack",
    "after-publish-before-mark",
    "after-mark-before-confirm-wait",
];

/// The points the leased jobs (bootstraps, profile and page-index backfills) pass through.
pub const LEASED_POINTS: [&str; 5] = [
    "leased-after-claim-commit",
    "leased-after-step-commit",
    "leased-before-end-commit",
    "backfill-before-commit",
    "pageindex-before-commit",
];

#[cfg(feature = "crash-points")]
pub fn point(name: &'static str) {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static TARGET: OnceLock<Option<(String, u64)>> = OnceLock::new();
    static SEEN: AtomicU64 = AtomicU64::new(0);
    let target = TARGET.get_or_init(|| {
        let raw = std::env::var("KFS_CRASH_AT").ok()?;
        let (p, n) = raw
            .split_once(':')
            .map_or((raw.as_str(), 1), |(p, n)| (p, n.parse().unwrap_or(1)));
        Some((p.to_owned(), n))
    });
    if let Some((p, n)) = target {
        if p == name && SEEN.fetch_add(1, Ordering::SeqCst) + 1 >= *n {
            eprintln!("kfs-worker: crash point {name} reached, aborting");
            std::process::abort();
        }
    }
}

#[cfg(not(feature = "crash-points"))]
#[inline(always)]
pub fn point(_name: &'static str) {}

/// The points that may stall.
pub const STALL_POINTS: [&str; 1] = ["relay-listen"];

#[cfg(feature = "crash-points")]
pub async fn stall(name: &'static str) {
    if std::env::var("KFS_STALL_AT").is_ok_and(|p| p == name) {
        eprintln!("kfs-worker: stall point {name} reached, waiting forever");
        std::future::pending::<()>().await;
    }
}

#[cfg(not(feature = "crash-points"))]
#[inline(always)]
pub async fn stall(_name: &'static str) {}
