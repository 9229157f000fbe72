//! The delivery loop of one kind's queue: deliveries that have arrived together (up to the
//! batch bound, never waiting for more) are handled as one batch by [`Engine::process_many`],
//! taken when [`super::pace`] says so, and acked through the channel's ack window
//! ([`super::acks`]). Invariant: a delivery is settled with the broker (ack, reject or give
//! back) only after its verdict came back, and acked (alone or by a multiple ack) only after
//! the commit that decided it; an abandoned delivery is left unacked for redelivery and no
//! multiple ack covers it; a batch whose task panicked outside a step gives its deliveries back
//! to the broker (requeued), so no delivery stays unsettled; on shutdown, or when its session
//! stops it, the loop stops taking deliveries and gives the running ones the grace period to
//! end. The loop reports when its consumer starts and why it ended ([`Phase`]), so the session
//! can tell a kind without a consumer.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions};
use lapin::types::FieldTable;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::acks::{Ack, Window};
use super::pace::Pace;
use super::{Engine, Handled};
use crate::jobs::Kind;

/// Where one kind's delivery loop is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Setting up its channel's prefetch and consumer.
    Starting,
    /// Its consumer is registered with the broker.
    Consuming,
    /// It takes no more deliveries (the running ones may still be ending), for this reason.
    Ended(Ending),
}

/// Why a delivery loop stopped taking deliveries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ending {
    /// Shutdown, or its session asked it to stop.
    Stopped,
    /// The broker cancelled the consumer (its queue was deleted, say): the channel may live.
    Cancelled,
    /// The channel failed or was closed by the broker (a consumer timeout, say), or the
    /// consumer could not be set up on it.
    Failed,
    /// The broker stopped taking settlements: the connection itself is suspect.
    Stuck,
}

/// A decided delivery not yet acked: its acker and what its ack-log line says.
struct Unsettled {
    delivery: Delivery,
    claim: &'static str,
    end: Option<&'static str>,
}

/// How long one ack, reject or give-back may take to leave. They are settled in the delivery
/// loop, in order (a multiple ack must never precede an ack of a tag it covers); a connection
/// that died without closing its channel may never answer, and the loop must not wait for it.
const SEND: Duration = Duration::from_secs(5);

/// The broker did not take a settlement within [`SEND`]: the channel is gone.
#[derive(Debug)]
struct Stuck;

/// Sends one settlement, waiting at most [`SEND`]. The `settle` stall point (crash tests only)
/// plays a connection that never answers it, inside the bound.
async fn sent(
    f: impl std::future::Future<Output = lapin::Result<bool>>,
) -> Result<lapin::Result<bool>, Stuck> {
    #[cfg(feature = "crash-points")]
    let f = async {
        crate::crash::stall("settle").await;
        f.await
    };
    tokio::time::timeout(SEND, f).await.map_err(|_| Stuck)
}

/// Sleeps until `at`; never returns without one (the branch is disabled then).
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Settles a finished batch's deliveries with the broker: rejects and give-backs one by one,
/// acks through the window, so a multiple ack covers only deliveries whose commit happened.
async fn settle(
    kind: Kind,
    handled: Vec<(Delivery, Handled)>,
    window: &mut Window,
    unsettled: &mut HashMap<u64, Unsettled>,
) -> Result<(), Stuck> {
    let mut decided = Vec::new();
    let mut settled = Vec::new();
    let mut abandoned = Vec::new();
    if !handled.is_empty() {
        // Jobs ended or went back: a tenant held at its limit may have room again.
        crate::relay::window::freed();
    }
    for (delivery, h) in handled {
        let tag = delivery.delivery_tag;
        let sent = match h {
            Handled::Ack { claim, end } => {
                decided.push(tag);
                unsettled.insert(
                    tag,
                    Unsettled {
                        delivery,
                        claim,
                        end,
                    },
                );
                continue;
            }
            Handled::Reject(_) => {
                sent(delivery.reject(BasicRejectOptions { requeue: false })).await?
            }
            Handled::GiveBack => {
                sent(delivery.reject(BasicRejectOptions { requeue: true })).await?
            }
            Handled::Abandon => {
                abandoned.push(tag);
                continue;
            }
        };
        settled.push(tag);
        if let Err(e) = sent {
            tracing::warn!(error = %e, "could not settle a delivery with the broker");
        }
    }
    window.abandoned(&abandoned);
    let mut acks: Vec<Ack> = window.settled(&settled).into_iter().collect();
    acks.extend(window.decided(&decided, Instant::now()));
    for ack in acks {
        match ack {
            Ack::One(tag) => ack_alone(kind, &[tag], unsettled).await?,
            Ack::UpTo { tag, n } => {
                crate::crash::point("before-multi-ack");
                let covered: Vec<Unsettled> = {
                    let mut tags: Vec<u64> =
                        unsettled.keys().copied().filter(|&t| t <= tag).collect();
                    tags.sort_unstable();
                    tags.into_iter()
                        .filter_map(|t| unsettled.remove(&t))
                        .collect()
                };
                debug_assert_eq!(covered.len(), n);
                let Some(top) = covered.iter().find(|u| u.delivery.delivery_tag == tag) else {
                    continue;
                };
                let sent_at = micros_now();
                let result =
                    sent(top.delivery.acker.ack(BasicAckOptions { multiple: true })).await?;
                log_acks(kind, &covered, result, sent_at);
            }
        }
    }
    Ok(())
}

/// Acks each of `tags` on its own.
async fn ack_alone(
    kind: Kind,
    tags: &[u64],
    unsettled: &mut HashMap<u64, Unsettled>,
) -> Result<(), Stuck> {
    for tag in tags {
        let Some(u) = unsettled.remove(tag) else {
            continue;
        };
        let sent_at = micros_now();
        let result = sent(u.delivery.ack(BasicAckOptions::default())).await?;
        log_acks(kind, std::slice::from_ref(&u), result, sent_at);
    }
    Ok(())
}

/// When an ack left, in microseconds since the epoch: the ack log lets each ack be compared
/// with the commit that decided it.
fn micros_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The ack log: one line per delivery an ack covered, each following the commit that decided
/// it, so each can be checked against the database.
fn log_acks(kind: Kind, covered: &[Unsettled], sent: lapin::Result<bool>, sent_at: u64) {
    match sent {
        Ok(true) => {
            for u in covered {
                let delivery_id = u
                    .delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map_or("", |s| s.as_str());
                tracing::debug!(target: "kfs_worker::ack", kind = %kind, delivery_id, claim = u.claim, end = u.end.unwrap_or("none"), sent_at, multiple = covered.len() > 1, "acked");
            }
        }
        // Not sent: the channel was closed (by the broker, say) before the ack, and its
        // deliveries went back to the queue. The decision is committed; the claim sees it.
        Ok(false) => {
            tracing::warn!(kind = %kind, deliveries = covered.len(), "not acked: the channel is gone; the broker redelivers");
        }
        // The decision is committed; the broker redelivers and the claim sees it.
        Err(e) => {
            tracing::warn!(error = %e, deliveries = covered.len(), "could not ack with the broker")
        }
    }
}

/// Consumes one kind's queue on `channel` until shutdown or until the channel fails.
pub async fn consume(
    engine: Arc<Engine>,
    channel: lapin::Channel,
    queue: String,
    kind: Kind,
    prefetch: u16,
    shutdown: CancellationToken,
) -> Result<(), lapin::Error> {
    let (phase, _) = watch::channel(Phase::Starting);
    run(
        engine,
        channel,
        queue,
        kind,
        prefetch,
        phase,
        shutdown.clone(),
        shutdown,
    )
    .await
}

/// [`consume`], reporting its [`Phase`] on `phase`; stops taking deliveries when `stop` is
/// cancelled (shutdown cancels it too), while the running slices end unless `shutdown` is.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run(
    engine: Arc<Engine>,
    channel: lapin::Channel,
    queue: String,
    kind: Kind,
    prefetch: u16,
    phase: watch::Sender<Phase>,
    stop: CancellationToken,
    shutdown: CancellationToken,
) -> Result<(), lapin::Error> {
    let tag = format!("{}:{}", engine.worker_id(), kind);
    let started = async {
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await?;
        channel
            .basic_consume(
                queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
    }
    .await;
    let mut consumer = match started {
        Ok(c) => c,
        Err(e) => {
            phase.send_replace(Phase::Ended(Ending::Failed));
            let _ = tokio::time::timeout(
                Duration::from_secs(3),
                channel.close(200, "consumer not started".into()),
            )
            .await;
            return Err(e);
        }
    };
    phase.send_replace(Phase::Consuming);
    // The relay of this process sizes and refills the kind's window from these consumers.
    let _consuming = crate::relay::window::consuming(kind);
    let mut running: JoinSet<(Instant, Vec<(Delivery, Handled)>)> = JoinSet::new();
    let mut window = Window::default();
    let mut unsettled: HashMap<u64, Unsettled> = HashMap::new();
    let batch_max = usize::from(engine.cfg.batch_max.max(1));
    let mut pace = Pace::new(
        engine.groups(kind),
        (usize::from(prefetch.max(1)) / batch_max).max(2),
    );
    // Set when the broker stopped taking settlements: the session is rebuilt.
    let mut stuck = false;
    let mut ending = Ending::Stopped;
    // Fault injection (crash-points builds; pending for ever otherwise): a broker-side close of
    // this channel alone. Made once, so its polling survives the loop's iterations.
    let close_asked = crate::crash::close_channel(kind.name());
    tokio::pin!(close_asked);
    let mut close_played = false;
    let result = loop {
        let flush_at = window.flush_at();
        let now = Instant::now();
        let take = pace.may_take(now);
        let look_again = pace.look_again_at(now);
        tokio::select! {
            () = stop.cancelled() => break Ok(()),
            Some(done) = running.join_next(), if !running.is_empty() => {
                let settled = match done {
                    Ok((started, handled)) => {
                        pace.finished(started, Instant::now());
                        settle(kind, handled, &mut window, &mut unsettled).await
                    }
                    // Never a panic (each batch catches its own); only an abort.
                    Err(e) => {
                        tracing::error!(kind = %kind, error = %e, "delivery task ended without its verdicts");
                        Ok(())
                    }
                };
                if settled.is_err() {
                    stuck = true;
                    ending = Ending::Stuck;
                    break Ok(());
                }
            }
            () = sleep_until(flush_at), if flush_at.is_some() => {
                let due = window.flush(Instant::now(), false);
                if ack_alone(kind, &due, &mut unsettled).await.is_err() {
                    stuck = true;
                    ending = Ending::Stuck;
                    break Ok(());
                }
            }
            () = sleep_until(look_again), if look_again.is_some() => {}
            () = &mut close_asked, if !close_played => {
                close_played = true;
                // No delivery of this channel has this tag, so no delivery is settled by it:
                // the broker answers with a channel error, and the consumer ends below.
                tracing::warn!(kind = %kind, "fault injection: acking a delivery tag this channel never had, so the broker closes it");
                let _ = tokio::time::timeout(
                    SEND,
                    channel.basic_ack(u64::MAX, BasicAckOptions::default()),
                )
                .await;
            }
            next = consumer.next(), if take => {
                let first = match next {
                    Some(Ok(d)) => d,
                    Some(Err(e)) => {
                        ending = Ending::Failed;
                        break Err(e);
                    }
                    None => {
                        ending = Ending::Cancelled;
                        break Ok(());
                    }
                };
                // Whatever else has arrived joins it; nothing waits for more.
                let mut batch = vec![first];
                let mut failed = None;
                while batch.len() < batch_max {
                    match consumer.next().now_or_never() {
                        Some(Some(Ok(d))) => batch.push(d),
                        Some(Some(Err(e))) => {
                            failed = Some(e);
                            break;
                        }
                        _ => break,
                    }
                }
                for d in &batch {
                    window.received(d.delivery_tag);
                }
                let engine = engine.clone();
                let shutdown = shutdown.clone();
                let started = Instant::now();
                pace.started(started);
                running.spawn(async move {
                    let handled = {
                        let items: Vec<(&lapin::BasicProperties, &[u8])> =
                            batch.iter().map(|d| (&d.properties, d.data.as_slice())).collect();
                        AssertUnwindSafe(engine.process_many(kind, &items, &shutdown))
                            .catch_unwind()
                            .await
                    };
                    let handled = handled.unwrap_or_else(|panic| {
                        // A step's panic is its failure and never gets here; this one came
                        // from around the steps. No decision is known: give them back.
                        let panic = crate::engine::unwind::message(panic.as_ref());
                        tracing::error!(kind = %kind, panic, deliveries = batch.len(), "a delivery batch panicked; giving its deliveries back to the broker");
                        vec![Handled::GiveBack; batch.len()]
                    });
                    (started, batch.into_iter().zip(handled).collect())
                });
                if let Some(e) = failed {
                    ending = Ending::Failed;
                    break Err(e);
                }
            }
        }
    };
    phase.send_replace(Phase::Ended(ending));
    // Stop taking deliveries, then let the running slices end with their commits and acks.
    // A channel the broker already dropped may never answer.
    let _ = tokio::time::timeout(
        Duration::from_secs(3),
        channel.basic_cancel(
            tag.as_str().into(),
            lapin::options::BasicCancelOptions::default(),
        ),
    )
    .await;
    let grace = engine.cfg.shutdown_grace;
    let drained = tokio::time::timeout(grace, async {
        while let Some(done) = running.join_next().await {
            if let Ok((_, handled)) = done {
                if !stuck
                    && settle(kind, handled, &mut window, &mut unsettled)
                        .await
                        .is_err()
                {
                    stuck = true;
                }
            }
        }
    })
    .await;
    // Decided deliveries a lower, unsettled one still holds are acked one by one.
    let held = window.flush(Instant::now(), true);
    if !stuck && ack_alone(kind, &held, &mut unsettled).await.is_err() {
        stuck = true;
    }
    if stuck {
        // Their decisions are committed: the broker redelivers them and each claim sees it.
        tracing::warn!(kind = %kind, "the broker stopped taking acks; the deliveries left unsettled are redelivered");
    }
    if drained.is_err() {
        tracing::warn!(kind = %kind, "slices still running after the shutdown grace period; leaving them to redelivery");
        running.abort_all();
    }
    // Closed and answered before the connection closes: a channel merely dropped is closed in
    // the background, and a connection closed meanwhile fails that close with an error log.
    let _ = tokio::time::timeout(
        Duration::from_secs(3),
        channel.close(200, "consumer done".into()),
    )
    .await;
    result
}
