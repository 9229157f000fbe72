//! The consumers' broker session. Invariant: every kind's consumer runs on one connection, on a
//! channel of its own; a kind whose consumer ends while the connection lives (the broker closed
//! its channel, or cancelled its consumer because its queue was deleted) gets a new channel,
//! its queue declared again and a new consumer at once, then with backoff while that fails,
//! and its old loop's running slices end beside the new one as `consume` lets them (commit,
//! then ack); the process reports ready only while every kind it serves has a consumer; a
//! session ends when its connection is lost or a settlement got stuck (the connection is
//! suspect), and only after all of its consumers have returned; the next one starts after a
//! backoff that only a session which got as far as consuming resets, and shutdown ends it
//! without a reconnect.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::consume::{self, Ending, Phase};
use super::Engine;
use crate::broker::{self, Topology};
use crate::config::Services;
use crate::engine::backoff::{nap, reconnect_backoff};
use crate::jobs::Kind;

/// What a kind's supervisor does once its delivery loop stopped taking deliveries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Next {
    /// Shutdown, or the session is ending: nothing more.
    Return,
    /// The connection is lost or suspect: end the session, every kind's consumer with it.
    EndSession,
    /// Only this kind's channel or consumer is gone: a new channel and consumer for it.
    Restart,
}

/// The decision, from why the loop ended, whether the session is stopping and whether the
/// connection still stands.
fn next(ending: Ending, stopping: bool, connected: bool) -> Next {
    if stopping {
        return Next::Return;
    }
    match ending {
        Ending::Stuck => Next::EndSession,
        Ending::Stopped | Ending::Cancelled | Ending::Failed if connected => Next::Restart,
        Ending::Stopped | Ending::Cancelled | Ending::Failed => Next::EndSession,
    }
}

/// Connects, declares the topology and consumes every kind until shutdown; restarts a kind
/// whose consumer ended, and reconnects with backoff when the broker goes away. `ready` says
/// whether every kind has a consumer.
pub(crate) async fn consumers(
    engine: Arc<Engine>,
    ready: impl Fn(bool) + Send + Sync,
    services: Services,
    topology: Topology,
    kinds: Vec<Kind>,
    prefetch: u16,
    shutdown: CancellationToken,
) {
    if kinds.is_empty() {
        return;
    }
    let mut backoff = reconnect_backoff();
    while !shutdown.is_cancelled() {
        // The node the session's connection went to, once it lost that connection.
        let mut lost = None;
        let session = async {
            let broker::Connected { conn, node } = broker::connect_node(
                &services.amqp_url,
                &format!("kfs-worker consumer {}", engine.worker_id()),
                services.connect_timeout,
            )
            .await
            .map_err(|e| e.to_string())?;
            tracing::info!(node = %services.amqp_url.nodes()[node].endpoint(5672), "consumers connected to RabbitMQ");
            let conn = Arc::new(conn);
            let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
            topology
                .declare(&ch, &kinds)
                .await
                .map_err(|e| e.to_string())?;
            // Closed now, not dropped at the end of the session: see `consumer::consume`.
            ch.close(200, "declared".into())
                .await
                .map_err(|e| e.to_string())?;
            crate::crash::delay("consumer-start", engine.worker_id()).await;
            // Cancelled by a kind that finds the connection lost or suspect, and by shutdown.
            let stop = shutdown.child_token();
            let (events, mut consuming_events) = mpsc::unbounded_channel();
            let mut running = JoinSet::new();
            for &kind in &kinds {
                running.spawn(serve(
                    engine.clone(),
                    conn.clone(),
                    services.connect_timeout,
                    topology.clone(),
                    kind,
                    prefetch,
                    events.clone(),
                    stop.clone(),
                    shutdown.clone(),
                ));
            }
            drop(events);
            let mut consuming = HashSet::new();
            let mut got_going = false;
            loop {
                tokio::select! {
                    Some((kind, up)) = consuming_events.recv() => {
                        let was = consuming.len() == kinds.len();
                        if up {
                            consuming.insert(kind);
                        } else {
                            consuming.remove(&kind);
                        }
                        let all = consuming.len() == kinds.len();
                        ready(all);
                        if all && !was {
                            got_going = true;
                            tracing::info!("consuming");
                        } else if was && !all && !stop.is_cancelled() {
                            tracing::warn!(kind = %kind, "a kind has no consumer; not ready");
                        }
                    }
                    done = running.join_next() => {
                        if done.is_none() {
                            break;
                        }
                    }
                }
            }
            ready(false);
            if !conn.status().connected() {
                lost = Some(node);
            }
            // A connection the broker already dropped may never answer a close.
            let _ =
                tokio::time::timeout(Duration::from_secs(3), conn.close(200, "bye".into())).await;
            Ok::<(bool, bool), String>((shutdown.is_cancelled(), got_going))
        };
        let ended = session.await;
        if let Some(node) = lost {
            // The next session starts at the next node: this one may be gone for a while.
            services.amqp_url.lost(node);
        }
        match ended {
            Ok((true, _)) => return,
            Ok((false, got_going)) => {
                if got_going {
                    backoff = reconnect_backoff();
                }
            }
            Err(e) => tracing::warn!(error = %e, "consumer cannot connect to RabbitMQ; retrying"),
        }
        let delay = backoff.next().unwrap_or(Duration::from_secs(10));
        if !nap(delay, &shutdown).await {
            return;
        }
    }
}

/// Keeps one kind consumed on `conn` until `stop`: a channel and a consumer, and new ones
/// whenever they end while the connection stands. Reports on `events` when the kind gains or
/// loses its consumer; cancels `stop` when the connection is lost or suspect. Returns once
/// every delivery loop it started has ended.
#[allow(clippy::too_many_arguments)]
async fn serve(
    engine: Arc<Engine>,
    conn: Arc<lapin::Connection>,
    open_timeout: Duration,
    topology: Topology,
    kind: Kind,
    prefetch: u16,
    events: mpsc::UnboundedSender<(Kind, bool)>,
    stop: CancellationToken,
    shutdown: CancellationToken,
) {
    // Loops that stopped taking deliveries, their running slices still ending.
    let mut loops = JoinSet::new();
    let mut backoff = reconnect_backoff();
    // The session declared every kind's queue; a restart declares this one again.
    let mut restart = false;
    while !stop.is_cancelled() {
        let channel = async {
            let ch = tokio::time::timeout(open_timeout, conn.create_channel())
                .await
                .map_err(|_| "no answer to a channel open".to_owned())?
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(ch)
        }
        .await;
        let ch = match channel {
            Ok(ch) => ch,
            Err(e) => {
                tracing::warn!(kind = %kind, error = %e, "cannot open a consumer channel; reconnecting");
                stop.cancel();
                break;
            }
        };
        if restart {
            let declared = tokio::time::timeout(open_timeout, topology.declare(&ch, &[kind])).await;
            if !matches!(declared, Ok(Ok(()))) {
                let error = match declared {
                    Ok(Err(e)) => e.to_string(),
                    _ => "no answer".to_owned(),
                };
                tracing::warn!(kind = %kind, error, "cannot declare the kind's queue again; retrying");
                let _ =
                    tokio::time::timeout(Duration::from_secs(3), ch.close(200, "bye".into())).await;
                if !conn.status().connected() {
                    stop.cancel();
                    break;
                }
                let delay = backoff.next().unwrap_or(Duration::from_secs(10));
                if !nap(delay, &stop).await {
                    break;
                }
                continue;
            }
        }
        let (phase, mut phases) = watch::channel(Phase::Starting);
        loops.spawn(consume::run(
            engine.clone(),
            ch,
            topology.queue(kind),
            kind,
            prefetch,
            phase,
            stop.clone(),
            shutdown.clone(),
        ));
        let mut got_going = false;
        let ending = loop {
            let changed = phases.changed().await;
            let phase = *phases.borrow_and_update();
            match phase {
                Phase::Ended(ending) => break ending,
                Phase::Consuming if !got_going => {
                    got_going = true;
                    let _ = events.send((kind, true));
                }
                _ => {}
            }
            // The loop returned without saying why (it panicked): its channel is gone.
            if changed.is_err() {
                break Ending::Failed;
            }
        };
        if got_going {
            let _ = events.send((kind, false));
            backoff = reconnect_backoff();
        }
        match next(ending, stop.is_cancelled(), conn.status().connected()) {
            Next::Return => break,
            Next::EndSession => {
                tracing::warn!(kind = %kind, ?ending, "a consumer stopped; reconnecting");
                stop.cancel();
                break;
            }
            Next::Restart => {
                tracing::warn!(kind = %kind, ?ending, "a consumer stopped; consuming its queue again on a new channel");
                restart = true;
                if !got_going {
                    // It could not even start: do not retry in a busy loop.
                    let delay = backoff.next().unwrap_or(Duration::from_secs(10));
                    if !nap(delay, &stop).await {
                        break;
                    }
                }
            }
        }
    }
    while let Some(ended) = loops.join_next().await {
        if let Ok(Err(e)) = ended {
            tracing::debug!(kind = %kind, error = %e, "a delivery loop ended with a channel error");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kind_that_lost_its_consumer_is_restarted_unless_the_connection_is_in_doubt() {
        use Ending::*;
        use Next::*;
        // (why the loop ended, session stopping, connection standing, what follows)
        let table = [
            (Cancelled, false, true, Restart),
            (Failed, false, true, Restart),
            (Stopped, false, true, Restart),
            (Cancelled, false, false, EndSession),
            (Failed, false, false, EndSession),
            (Stopped, false, false, EndSession),
            (Stuck, false, true, EndSession),
            (Stuck, false, false, EndSession),
            (Stopped, true, true, Return),
            (Failed, true, false, Return),
            (Stuck, true, true, Return),
            (Cancelled, true, true, Return),
        ];
        for (ending, stopping, connected, want) in table {
            assert_eq!(
                next(ending, stopping, connected),
                want,
                "{ending:?}, stopping {stopping}, connected {connected}"
            );
        }
    }
}
