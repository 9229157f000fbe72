//! The channel-close fault: a consumer made to have the broker close one kind's channel, and
//! the reading of its log that finds the restart that followed each play.

use super::record::ChannelClose;
use super::*;

/// How often a consumer's play of a channel close appears in its log.
fn plays(log: &str) -> usize {
    log.matches(CLOSE_PLAYED).count()
}

/// What a consumer logs when it plays the fault (`src/consumer/consume.rs`).
pub(super) const CLOSE_PLAYED: &str =
    "fault injection: acking a delivery tag this channel never had";

/// Has the broker close one kind's channel in one consumer process while the process and its
/// connection stay up: the process acks a delivery tag that channel never had (a crash-points
/// fault, `KFS_CLOSE_CHANNEL_FILE`), the broker closes the channel with 406 and puts its unacked
/// deliveries back in the queue, and the process must consume that kind again at once. Only a
/// running, unpaused consumer that is armed at no kill point is chosen (the witness always
/// qualifies), so that the process lives to show its restart. Waits until the process played
/// it and consumes every kind again (or 15 s), so that no other fault mixes into it.
pub(super) async fn close_a_channel(cluster: &mut Cluster, rec: &mut Record, rng: &mut StdRng) {
    let mut able = Vec::new();
    for (i, s) in cluster.slots.iter_mut().enumerate() {
        if s.role == Role::Consumer
            && !s.stopped
            && s.armed.is_none()
            && matches!(s.worker.child.try_wait(), Ok(None))
        {
            able.push(i);
        }
    }
    if able.is_empty() {
        return;
    }
    let i = able[rng.random_range(0..able.len())];
    let kind = KINDS[rng.random_range(0..KINDS.len())].name();
    let (process, log) = {
        let s = &cluster.slots[i];
        (s.worker_id.clone(), s.worker.log.clone())
    };
    let file = cluster.close_file(&process);
    let before = plays(&std::fs::read_to_string(&log).unwrap_or_default());
    // Written whole, then moved into place: the worker never reads half of it.
    let partial = file.with_extension("partial");
    std::fs::write(&partial, kind).expect("write the channel-close file");
    std::fs::rename(&partial, &file).expect("place the channel-close file");
    let asked = Instant::now();
    let mut close = ChannelClose {
        process,
        log,
        kind,
        played: None,
    };
    while asked.elapsed() < Duration::from_secs(15) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let text = std::fs::read_to_string(&close.log).unwrap_or_default();
        if close.played.is_none() {
            if plays(&text) > before {
                close.played = Some(before + 1);
            } else if asked.elapsed() > Duration::from_secs(5)
                && std::fs::remove_file(&file).is_ok()
            {
                // Taken back before the process took it (no consumer of the kind meanwhile).
                break;
            }
        }
        if close
            .played
            .is_some_and(|n| consuming_again(&text, n).is_some())
        {
            break;
        }
    }
    rec.fault(if close.played.is_some() {
        "consumer channel closed by the broker"
    } else {
        "consumer channel close not played (no consumer of the kind in time)"
    });
    rec.channel_closes.push(close);
}

/// What a consumer's log shows after its `n`-th play of a channel close.
pub(super) struct Restart {
    /// The kind whose channel was closed (from the play line).
    pub(super) kind: String,
    /// The session restarted that kind on a new channel (before any reconnect).
    pub(super) restarted: bool,
    /// The session ended instead (the connection lost or given up).
    pub(super) reconnected: bool,
    /// From the play to every kind consuming again, by the log's clock.
    pub(super) back_ms: f64,
    /// When every kind consumed again, in µs since the epoch.
    pub(super) back_at_us: i64,
}

/// The restart that followed the `n`-th play of a channel close in `log`, once every kind of
/// the process consumes again: `None` while it has not (or the process stopped logging first).
pub(super) fn consuming_again(log: &str, n: usize) -> Option<Restart> {
    let mut lines = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok());
    let field = |v: &serde_json::Value, k: &str| {
        v.get(k)
            .and_then(|x| x.as_str())
            .unwrap_or_default()
            .to_owned()
    };
    let at = |v: &serde_json::Value| {
        DateTime::parse_from_rfc3339(&field(v, "timestamp"))
            .map(|t| t.timestamp_micros())
            .ok()
    };
    let play = lines
        .by_ref()
        .filter(|v| field(v, "message").starts_with(CLOSE_PLAYED))
        .nth(n - 1)?;
    let kind = field(&play, "kind");
    let played_at = at(&play)?;
    let mut restarted = false;
    let mut reconnected = false;
    for v in lines {
        let message = field(&v, "message");
        if message == "a consumer stopped; consuming its queue again on a new channel"
            && field(&v, "kind") == kind
        {
            restarted = true;
        } else if message == "a consumer stopped; reconnecting"
            || message.starts_with("consumer cannot connect")
        {
            reconnected = true;
        } else if message == "consuming" && (restarted || reconnected) {
            // A process can play the close as it starts, before its session has said it
            // consumes: that first "consuming" is the session's own, not the way back.
            let back_at_us = at(&v)?;
            return Some(Restart {
                kind,
                restarted,
                reconnected,
                back_ms: (back_at_us - played_at) as f64 / 1000.0,
                back_at_us,
            });
        }
    }
    None
}
