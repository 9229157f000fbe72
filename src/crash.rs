//! Kill and stall points for crash tests. Invariant: without the `crash-points` feature this
//! compiles to nothing; with it, `KFS_CRASH_AT=<point>[:<n>]` aborts the process at the n-th
//! (default first) pass through that point, the way SIGKILL would: no destructor, no flush, no
//! ack; `KFS_STALL_AT=<point>[:<n>]` makes the first n (default: every) passes through a stall
//! point wait forever and lets the later ones through, the way a connect to a host that never
//! answers, or a broker connection that never answers a settlement, does;
//! `KFS_DELAY_AT=<point>@<worker>=<ms>` makes that worker's passes through a delay point wait
//! that long, the way a slow start does; `KFS_LOSE_REPLY_AT=<statement>` makes the first
//! reply of that statement look lost; and `KFS_CLOSE_CHANNEL_FILE=<path>` makes the consumer of
//! the kind a file at `<path>` names, once that file appears, take it (remove it) and ack a
//! delivery tag its channel never had, so the broker closes that one channel (406
//! `PRECONDITION_FAILED`, "unknown delivery tag") while the connection and the other kinds'
//! channels stay, the way a broker-side channel error does. Each file is played once, by the
//! one delivery loop that removed it.

/// The points the engine passes through.
pub const POINTS: [&str; 8] = [
    "after-claim-commit",
    "after-step-commit",
    "before-ack",
    "after-group-claim-commit",
    "after-group-step-commit",
    "before-multi-ack",
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

/// The points that may stall: the relay's listener setup, and a delivery's settlement (ack,
/// multiple ack, reject, give-back) with the broker.
pub const STALL_POINTS: [&str; 2] = ["relay-listen", "settle"];

/// The statements whose reply can be lost once after their commit.
pub const LOST_REPLY_POINTS: [&str; 1] = ["claim"];

/// `KFS_LOSE_REPLY_AT=<statement>`: `true` at the first pass only, when the caller must act
/// as if that statement committed and its reply never came.
#[cfg(feature = "crash-points")]
pub fn lose_reply(name: &'static str) -> bool {
    use std::sync::atomic::{AtomicBool, Ordering};
    static DONE: AtomicBool = AtomicBool::new(false);
    if std::env::var("KFS_LOSE_REPLY_AT").is_ok_and(|p| p == name)
        && !DONE.swap(true, Ordering::SeqCst)
    {
        eprintln!("kfs-worker: reply of {name} lost after its commit");
        return true;
    }
    false
}

#[cfg(not(feature = "crash-points"))]
#[inline(always)]
pub fn lose_reply(_name: &'static str) -> bool {
    false
}

/// How often a delivery loop looks for the `KFS_CLOSE_CHANNEL_FILE` file.
#[cfg(feature = "crash-points")]
const CLOSE_CHANNEL_POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// `KFS_CLOSE_CHANNEL_FILE=<path>`: returns once a file at `<path>` names `kind` and this call
/// removed it, so that exactly one delivery loop of that kind plays the fault (its caller then
/// acks a delivery tag its channel never had); never returns otherwise. Create the future once
/// per loop and poll it across iterations: its polling pace must not restart with each event.
#[cfg(feature = "crash-points")]
pub async fn close_channel(kind: &str) {
    let Some(path) = std::env::var_os("KFS_CLOSE_CHANNEL_FILE") else {
        return std::future::pending().await;
    };
    let mut every = tokio::time::interval(CLOSE_CHANNEL_POLL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let named = std::fs::read_to_string(&path).is_ok_and(|s| s.trim() == kind);
        // Whoever removes the file plays it: another loop of the kind may have read it too.
        if named && std::fs::remove_file(&path).is_ok() {
            return;
        }
    }
}

#[cfg(not(feature = "crash-points"))]
pub async fn close_channel(_kind: &str) {
    std::future::pending().await
}

/// The points that may be delayed for one worker.
pub const DELAY_POINTS: [&str; 1] = ["consumer-start"];

#[cfg(feature = "crash-points")]
pub async fn delay(name: &'static str, worker: &str) {
    let Ok(raw) = std::env::var("KFS_DELAY_AT") else {
        return;
    };
    let parsed = raw.split_once('@').and_then(|(p, rest)| {
        let (w, ms) = rest.split_once('=')?;
        Some((p, w, ms.parse::<u64>().ok()?))
    });
    if let Some((p, w, ms)) = parsed {
        if p == name && w == worker {
            eprintln!("kfs-worker: delay point {name} reached, waiting {ms} ms");
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
    }
}

#[cfg(not(feature = "crash-points"))]
#[inline(always)]
pub async fn delay(_name: &'static str, _worker: &str) {}

/// Whether `spec` (`<point>[:<n>]`, as in `KFS_STALL_AT`) stalls the `pass`-th (from 1) pass
/// through `name`: every pass when no n is given, the first n otherwise.
#[cfg(feature = "crash-points")]
fn stalls(spec: &str, name: &str, pass: u64) -> bool {
    match spec.split_once(':') {
        None => spec == name,
        Some((p, n)) => p == name && n.parse::<u64>().is_ok_and(|n| pass <= n),
    }
}

#[cfg(feature = "crash-points")]
pub async fn stall(name: &'static str) {
    use std::sync::atomic::{AtomicU64, Ordering};
    // Passes through the one point `KFS_STALL_AT` names.
    static PASSES: AtomicU64 = AtomicU64::new(0);
    let Ok(spec) = std::env::var("KFS_STALL_AT") else {
        return;
    };
    if spec.split_once(':').map_or(spec.as_str(), |(p, _)| p) != name {
        return;
    }
    let pass = PASSES.fetch_add(1, Ordering::SeqCst) + 1;
    if stalls(&spec, name, pass) {
        eprintln!("kfs-worker: stall point {name} reached (pass {pass}), waiting forever");
        std::future::pending::<()>().await;
    }
}

#[cfg(not(feature = "crash-points"))]
#[inline(always)]
pub async fn stall(_name: &'static str) {}

#[cfg(all(test, feature = "crash-points"))]
mod tests {
    use super::stalls;

    #[test]
    fn a_stall_without_a_count_stalls_every_pass_of_its_point_only() {
        for pass in [1, 2, 1000] {
            assert!(stalls("relay-listen", "relay-listen", pass));
            assert!(!stalls("relay-listen", "settle", pass));
        }
    }

    #[test]
    fn a_stall_with_a_count_stalls_the_first_n_passes_only() {
        assert!(stalls("settle:1", "settle", 1));
        assert!(!stalls("settle:1", "settle", 2));
        assert!(stalls("settle:3", "settle", 3));
        assert!(!stalls("settle:3", "settle", 4));
        assert!(!stalls("settle:3", "relay-listen", 1));
        assert!(!stalls("settle:0", "settle", 1));
        assert!(!stalls("settle:x", "settle", 1));
    }
}
