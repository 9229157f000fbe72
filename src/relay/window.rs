//! The relay's broker window and tenant limits: their settings, and the wake-up a consumer
//! sends when it frees room. Invariant: a kind's window is never below 1 message; `auto` is one
//! claim batch waiting per live consumer (consumers of the kind's queue × `KFS_BATCH_MAX`, at
//! least one consumer's worth): enough that a consumer whose slot frees finds a message at once
//! while the relay refills, and no more, since every message waiting in the queue is one that a
//! takeover, a retry or another tenant's job waits behind; a tenant limit is at least 1; a bad
//! setting is one error naming the variable and the item; a relay held back only by a tenant's
//! limit waits longer after each claim that finds it still held, up to the poll.

use std::collections::{BTreeMap, HashMap};
use std::sync::LazyLock;

use tokio::sync::watch;

use crate::jobs::Kind;

/// How much work an `auto` window keeps waiting in the queue, in time at the kind's current
/// rate: a second tenant's first job waits behind about this much of a first tenant's backlog.
pub const QUEUE_TIME: std::time::Duration = std::time::Duration::from_millis(100);

/// The most an `auto` window grows to, in claim batches per consumer.
pub const AUTO_CAP_BATCHES: i64 = 32;

/// How many messages of one kind may be published and not yet claimed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Size {
    /// Consumers of the kind's queue × this many messages each (at least one consumer's worth).
    Auto {
        per_consumer: u16,
    },
    Fixed(u32),
    /// No window: every due row is published (the relay alone, as in its benchmark).
    Unbounded,
}

impl Size {
    /// The window, given how many consumers the kind's queue has now and how many messages
    /// per second its consumers have been taking out of the window. `auto`: a claim batch per
    /// consumer, and more while the consumers take more than that in [`QUEUE_TIME`] (up to
    /// [`AUTO_CAP_BATCHES`] batches each), so a fast kind's consumers never wait for the relay
    /// and a slow kind's queue never holds more than a batch per consumer. Pure.
    pub fn messages(self, consumers: u32, rate: f64) -> i64 {
        match self {
            Size::Auto { per_consumer } => {
                let base = i64::from(consumers.max(1)) * i64::from(per_consumer.max(1));
                let wanted = (rate.max(0.0) * QUEUE_TIME.as_secs_f64()).ceil() as i64;
                wanted.clamp(base, base * AUTO_CAP_BATCHES)
            }
            Size::Fixed(n) => i64::from(n.max(1)),
            Size::Unbounded => i64::MAX / 4,
        }
    }
}

/// Each kind's window: `default`, unless the kind has its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Windows {
    pub default: Size,
    pub per_kind: BTreeMap<Kind, Size>,
}

impl Windows {
    pub fn unbounded() -> Self {
        Self {
            default: Size::Unbounded,
            per_kind: BTreeMap::new(),
        }
    }

    pub fn of(&self, kind: Kind) -> Size {
        self.per_kind.get(&kind).copied().unwrap_or(self.default)
    }

    /// Parses `KFS_RELAY_WINDOW`: comma-separated items, each `auto`, `none` (no window), a
    /// number of messages (the default of every kind) or `KIND=auto|none|N`; `auto` is `per_consumer` messages per consumer.
    /// Pure.
    pub fn parse(text: &str, per_consumer: u16) -> Result<Self, String> {
        let mut out = Self {
            default: Size::Auto { per_consumer },
            per_kind: BTreeMap::new(),
        };
        let size = |v: &str| -> Result<Size, String> {
            match v.trim() {
                "auto" => Ok(Size::Auto { per_consumer }),
                "none" => Ok(Size::Unbounded),
                n => match n.parse::<u32>() {
                    Ok(0) => Err("a window must be at least 1 message".into()),
                    Ok(n) => Ok(Size::Fixed(n)),
                    Err(_) => Err(format!(
                        "\"{n}\" is not a number of messages, \"auto\" or \"none\"; expected e.g. auto, 64 or compile=64,deletion=8"
                    )),
                },
            }
        };
        for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            match item.split_once('=') {
                None => out.default = size(item)?,
                Some((k, v)) => {
                    let kind = one_kind(k)?;
                    if out.per_kind.insert(kind, size(v)?).is_some() {
                        return Err(format!("{kind} is given twice"));
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Parses `KFS_TENANT_LIMITS`: comma-separated `KIND=N`, the most jobs of that kind one tenant
/// may have published and not claimed, or running. Pure.
pub fn parse_limits(text: &str) -> Result<BTreeMap<Kind, u32>, String> {
    let mut out = BTreeMap::new();
    for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (k, v) = item.split_once('=').ok_or_else(|| {
            format!("\"{item}\" is not KIND=N; expected e.g. compile=8,deletion=2")
        })?;
        let kind = one_kind(k)?;
        let n = match v.trim().parse::<u32>() {
            Ok(0) => return Err(format!("the limit of {kind} must be at least 1")),
            Ok(n) => n,
            Err(_) => return Err(format!("\"{}\" is not a number of jobs", v.trim())),
        };
        if out.insert(kind, n).is_some() {
            return Err(format!("{kind} is given twice"));
        }
    }
    Ok(out)
}

fn one_kind(text: &str) -> Result<Kind, String> {
    let kinds = Kind::parse_list(text.trim())?;
    match kinds.as_slice() {
        [k] => Ok(*k),
        _ => Err(format!("\"{}\" is not one kind", text.trim())),
    }
}

/// Counts consumer-side events that may free room in a window or under a tenant limit: a claim
/// (a message left the window) or a decided delivery (a job ended or went back). Relays in this
/// process wait on it instead of polling; relays elsewhere poll every `window_poll`.
static FREED: LazyLock<watch::Sender<u64>> = LazyLock::new(|| watch::channel(0).0);

/// Per kind, what a relay of this process knows of the kind's consumers here.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Local {
    /// The messages this process's consumers have claimed so far: what left the kind's window,
    /// for a relay to tell how much room its last claim left has grown.
    pub claimed: u64,
    /// The consumers of the kind's queue this process runs now.
    pub consumers: u32,
}

static LOCAL: LazyLock<std::sync::Mutex<HashMap<Kind, Local>>> =
    LazyLock::new(|| std::sync::Mutex::new(HashMap::new()));

fn with_local<T>(kind: Kind, f: impl FnOnce(&mut Local) -> T) -> T {
    let mut all = LOCAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    f(all.entry(kind).or_default())
}

/// Jobs ended or went back: a tenant held at its limit may have room again. Wakes every relay
/// of this process that waits for room.
pub fn freed() {
    FREED.send_modify(|n| *n = n.wrapping_add(1));
}

/// Consumers of this process claimed `n` messages of `kind`: they left its window.
pub fn claimed(kind: Kind, n: u64) {
    with_local(kind, |l| l.claimed = l.claimed.wrapping_add(n));
    freed();
}

/// What this process's consumers of `kind` have claimed so far, and how many there are now.
pub fn local(kind: Kind) -> Local {
    with_local(kind, |l| *l)
}

/// This process consumes `kind`'s queue while the value lives (one per consumer).
pub struct Consuming(Kind);

/// Registers one of this process's consumers of `kind`, until the value is dropped.
pub fn consuming(kind: Kind) -> Consuming {
    with_local(kind, |l| l.consumers += 1);
    Consuming(kind)
}

impl Drop for Consuming {
    fn drop(&mut self) {
        with_local(self.0, |l| l.consumers = l.consumers.saturating_sub(1));
    }
}

/// What `claims` by this process's `own` consumers stand for across all `consumers` of the
/// queue: the broker shares a backlog between consumers of equal prefetch evenly, and a relay
/// hears only of its own process's claims, so with two processes it would otherwise see half
/// the drain, keep half the window it means to and refill it late. With no consumer of its own
/// (a relay-only process), the claims stand for themselves. Pure.
pub fn across(claims: u64, own: u32, consumers: u32) -> u64 {
    if own == 0 {
        return claims;
    }
    let all = u64::from(consumers.max(own));
    claims.saturating_mul(all) / u64::from(own)
}

/// A receiver of [`freed`] and [`claimed`] events.
pub fn subscribe() -> watch::Receiver<u64> {
    FREED.subscribe()
}

/// Whether a relay waiting for room in a window should claim again now: when a tenant was held
/// (any ended job may let it in), or when what its last claim left in the window, less what
/// consumers claimed since (this process's claims [`across`] the queue), is down to half the
/// window. Refilling at half
/// rather than at every claim keeps a fast kind's claims a half window each instead of a
/// consumer's batch each, and the half still waiting covers the refill. Pure.
pub fn worth_a_look(in_window: i64, left_since: u64, window: i64, held: bool) -> bool {
    held || in_window.saturating_sub(i64::try_from(left_since).unwrap_or(i64::MAX)) <= window / 2
}

/// How long a relay whose claims found a tenant at its limit, with room left in the window,
/// waits before it claims again when no decided delivery of this process wakes it first: `first`
/// after the first such claim, doubling with each claim in a row that finds the same, up to
/// `most`. Only a job of the held tenant ending lets more in, and a relay hears of those in
/// other processes only by looking; claiming every `first` for as long as the tenant stays held
/// cost a claim every 50 ms for nothing. Pure.
pub fn held_wait(
    looks: u32,
    first: std::time::Duration,
    most: std::time::Duration,
) -> std::time::Duration {
    first
        .checked_mul(1u32.checked_shl(looks).unwrap_or(u32::MAX))
        .unwrap_or(most)
        .min(most)
        .max(first.min(most))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_held_relay_waits_twice_as_long_after_each_claim_that_found_the_tenant_held_table() {
        use std::time::Duration;
        let ms = Duration::from_millis;
        // (claims in a row that found it held before this one, first, most, wait)
        for (looks, first, most, wait) in [
            (0, ms(50), ms(1000), ms(50)),
            (1, ms(50), ms(1000), ms(100)),
            (2, ms(50), ms(1000), ms(200)),
            (4, ms(50), ms(1000), ms(800)),
            (5, ms(50), ms(1000), ms(1000)),
            (40, ms(50), ms(1000), ms(1000)),
            (u32::MAX, ms(50), ms(1000), ms(1000)),
            // A poll shorter than the first wait: the poll.
            (0, ms(50), ms(20), ms(20)),
        ] {
            assert_eq!(
                super::held_wait(looks, first, most),
                wait,
                "{looks} looks, from {first:?} up to {most:?}"
            );
        }
    }

    use super::*;

    #[test]
    fn window_settings_table() {
        let compile = Kind::new("compile");
        let deletion = Kind::new("deletion");
        // (setting, default, compile's, deletion's) or the error's words
        let ok: &[(&str, Size, Size, Size)] = &[
            (
                "",
                Size::Auto { per_consumer: 16 },
                Size::Auto { per_consumer: 16 },
                Size::Auto { per_consumer: 16 },
            ),
            ("64", Size::Fixed(64), Size::Fixed(64), Size::Fixed(64)),
            ("none", Size::Unbounded, Size::Unbounded, Size::Unbounded),
            (
                "compile=8",
                Size::Auto { per_consumer: 16 },
                Size::Fixed(8),
                Size::Auto { per_consumer: 16 },
            ),
            (
                "32, deletion = auto",
                Size::Fixed(32),
                Size::Fixed(32),
                Size::Auto { per_consumer: 16 },
            ),
        ];
        for (text, default, c, d) in ok {
            let w = Windows::parse(text, 16).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(w.default, *default, "{text}");
            assert_eq!(w.of(compile), *c, "{text}");
            assert_eq!(w.of(deletion), *d, "{text}");
        }
        let bad: &[(&str, &str)] = &[
            ("0", "at least 1"),
            ("many", "\"many\" is not a number"),
            ("compile=0", "at least 1"),
            ("nosuch=4", "nosuch"),
            ("compile=4,compile=5", "given twice"),
        ];
        for (text, words) in bad {
            let e = Windows::parse(text, 16).expect_err(text);
            assert!(e.contains(words), "{text}: {e}");
        }
    }

    #[test]
    fn auto_is_a_batch_per_consumer_growing_with_the_rate_up_to_its_cap() {
        let auto = Size::Auto { per_consumer: 16 };
        // (consumers of the queue, messages/s taken, window)
        for (consumers, rate, window) in [
            (0, 0.0, 16),
            (1, 0.0, 16),
            (3, 0.0, 48),
            (1, 8.0, 16),         // a slow kind: a batch per consumer
            (1, 2_000.0, 200),    // 100 ms of a fast kind's work
            (1, 40.0, 16),        // a compile's rate: the floor
            (2, 100_000.0, 1024), // capped at 32 batches per consumer
            (1, -5.0, 16),
        ] {
            assert_eq!(
                auto.messages(consumers, rate),
                window,
                "{consumers} consumers at {rate}/s"
            );
        }
        assert_eq!(Size::Fixed(5).messages(9, 1e6), 5);
    }

    #[test]
    fn a_waiting_relay_claims_again_at_half_the_window_or_when_a_tenant_was_held() {
        // (in the window after the last claim, claimed since, window, held, look)
        for (in_window, left, window, held, look) in [
            (200, 0, 200, false, false),  // just filled
            (200, 16, 200, false, false), // a consumer's batch left: not yet
            (200, 100, 200, false, true), // half left: refill half a window
            (200, 150, 200, false, true), // more than half left
            (200, 300, 200, false, true), // more left than counted (claims raced the count)
            (16, 8, 16, false, true),     // a slow kind's window of one batch
            (16, 7, 16, false, false),
            (1, 0, 1, false, false), // a window of one message: not before it left
            (1, 1, 1, false, true),
            (200, 0, 200, true, true), // a tenant held: any ended job may let it in
            (200, 0, 400, false, true), // the window grew to twice what it holds
            (200, 0, 100, false, false), // the window shrank: wait for more to leave
        ] {
            assert_eq!(
                worth_a_look(in_window, left, window, held),
                look,
                "{in_window} in a window of {window}, {left} left, held {held}"
            );
        }
    }

    #[test]
    fn claims_stand_for_the_whole_queue_in_the_share_of_this_process_table() {
        // (claims, own consumers, consumers of the queue, what they stand for)
        let cases: &[(u64, u32, u32, u64)] = &[
            (100, 1, 1, 100),
            (100, 1, 2, 200),
            (100, 2, 4, 200),
            (90, 1, 3, 270),
            // A relay-only process: its claims, none, stand for themselves.
            (0, 0, 4, 0),
            (7, 0, 2, 7),
            // The broker's count lags a consumer this process just started.
            (50, 2, 1, 50),
            (50, 2, 0, 50),
            (u64::MAX, 1, 2, u64::MAX),
        ];
        for &(claims, own, consumers, want) in cases {
            assert_eq!(
                across(claims, own, consumers),
                want,
                "{claims} claims, {own} of {consumers} consumers"
            );
        }
    }

    #[test]
    fn a_consumer_counts_for_its_process_while_it_lives() {
        let kind = Kind::new("probe-own-consumers");
        assert_eq!(local(kind).consumers, 0);
        let a = consuming(kind);
        let b = consuming(kind);
        assert_eq!(local(kind).consumers, 2);
        drop(a);
        assert_eq!(local(kind).consumers, 1);
        drop(b);
        assert_eq!(local(kind).consumers, 0);
    }

    #[test]
    fn tenant_limit_settings_table() {
        let limits = parse_limits("compile=8, deletion=2").unwrap();
        assert_eq!(limits.get(&Kind::new("compile")), Some(&8));
        assert_eq!(limits.get(&Kind::new("deletion")), Some(&2));
        assert!(parse_limits("").unwrap().is_empty());
        let bad: &[(&str, &str)] = &[
            ("compile", "not KIND=N"),
            ("compile=0", "at least 1"),
            ("compile=x", "\"x\" is not a number"),
            ("compile=1,compile=2", "given twice"),
            ("nosuch=3", "nosuch"),
        ];
        for (text, words) in bad {
            let e = parse_limits(text).expect_err(text);
            assert!(e.contains(words), "{text}: {e}");
        }
    }
}
