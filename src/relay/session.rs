//! The relay's session: one broker channel in confirm mode and one Postgres listener. Invariant:
//! the listener is only a wake-up (polling every `poll` wakes every kind whatever happens);
//! after a failed round or a failed call of the session's own (the poll's passive declare) no new
//! round starts, the rounds in flight settle what they claimed, and the session reconnects after
//! a backoff that only a whole settled round resets. A kind whose window filled is looked at
//! again as soon as consumers of this process have taken half its window, and after
//! `window_poll` at the latest; a kind held back only by a tenant's limit, at any decided
//! delivery of this process or after a wait that doubles from `window_poll` up to `poll` while
//! its claims keep finding the tenant held, never every `window_poll` for as long as it is.

use std::collections::BTreeMap;
use std::time::Duration;

use lapin::options::ConfirmSelectOptions;
use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::lead::Lead;
use super::watch::{Call, Watcher, Watches};
use super::{Relay, Rounds, Settled};
use crate::broker::{self, Topology};
use crate::config::Services;
use crate::engine::backoff::{nap, reconnect_backoff};
use crate::jobs::Kind;

/// Publishes due outbox rows of every kind until shutdown: woken by notifications, with
/// polling as the fallback; reconnects with backoff.
pub(crate) async fn relay_loop(
    relay: Relay,
    ready: impl Fn(bool) + Send + Sync,
    services: Services,
    topology: Topology,
    shutdown: CancellationToken,
) {
    let kinds = relay.kinds();
    let mut backoff = reconnect_backoff();
    while !shutdown.is_cancelled() {
        // The node the session's connection went to, once it lost that connection.
        let mut lost = None;
        let session = async {
            let broker::Connected { conn, node } = broker::connect_node(
                &services.amqp_url,
                "kfs-worker relay",
                services.connect_timeout,
            )
            .await
            .map_err(|e| e.to_string())?;
            tracing::info!(node = %services.amqp_url.nodes()[node].endpoint(5672), "relay connected to RabbitMQ");
            let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
            topology
                .declare(&ch, &kinds)
                .await
                .map_err(|e| e.to_string())?;
            ch.confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(|e| e.to_string())?;
            // The listener is set up beside the rounds, never before them: its connection
            // comes from the pool, which past Postgres' connection limit may wait for a
            // session up to its acquire timeout, and polling publishes meanwhile.
            let mut listener: Option<PgListener> = None;
            let mut listen_backoff = reconnect_backoff();
            let mut setup = Some(Box::pin(listen(relay_pool(&relay), Duration::ZERO)));
            ready(true);
            let mut rounds = Rounds::new(&relay, &ch, &kinds);
            // With leads on, nothing is relayed until the first look says what this relay leads.
            let mut lead = relay.config().lead.then(|| {
                let mut l = Lead::new(relay_pool(&relay), &topology.prefix, kinds.clone());
                l.look();
                rounds.lead(&l.led());
                l
            });
            let mut lead_look = tokio::time::interval_at(
                tokio::time::Instant::now() + super::lead::LOOK,
                super::lead::LOOK,
            );
            lead_look.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // While this relay watches a kind, its writers do not notify (migration 0102).
            let mut watches = Watches::default();
            let mut watcher = Watcher::new(relay_pool(&relay));
            // The polling fallback: a fixed interval that wakes every kind whatever else
            // happens. Rows that come due with time (retries, re-arms, visibility republishes,
            // future `available_at`) never notify; a timer restarted by each notification or
            // settled round would let one busy kind starve the others' polls.
            let mut poll = tokio::time::interval_at(
                tokio::time::Instant::now() + relay.config().poll,
                relay.config().poll,
            );
            poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // Kinds whose window was full (or a tenant at its limit) when their round ended:
            // looked at again when a consumer of this process frees room, or after
            // `window_poll` for consumers elsewhere.
            let mut waiting_room: BTreeMap<Kind, tokio::time::Instant> = BTreeMap::new();
            // Per kind, how many claims in a row found a tenant held and the window not full.
            let mut held_looks: BTreeMap<Kind, u32> = BTreeMap::new();
            let mut freed = super::window::subscribe();
            count_consumers(&relay, &ch, &topology)
                .await
                .map_err(|e| e.to_string())?;
            // A broker call of the session itself that failed (the poll's passive declare): no
            // new round starts, the rounds in flight settle what they claimed, then it ends.
            let mut broken: Option<String> = None;
            loop {
                if !shutdown.is_cancelled() && broken.is_none() {
                    rounds.start();
                }
                if !rounds.in_flight()
                    && (rounds.has_failed() || broken.is_some() || shutdown.is_cancelled())
                {
                    break;
                }
                tokio::select! {
                    Some((kind, settled)) = rounds.settle(), if rounds.in_flight() => {
                        // Only a whole round proves both services back: resetting the backoff
                        // on the broker connection alone made a Postgres outage a reconnect
                        // loop. After a failed round the others settle what they claimed, then
                        // the session reconnects.
                        if let Settled::Round(r) = settled {
                            backoff = reconnect_backoff();
                            let looks = if relay.held_only(kind) {
                                let n = held_looks.entry(kind).or_default();
                                *n = n.saturating_add(1);
                                Some(*n - 1)
                            } else {
                                held_looks.remove(&kind);
                                None
                            };
                            if r.look_again {
                                let wait = looks.map_or(relay.config().window_poll, |n| {
                                    super::window::held_wait(
                                        n,
                                        relay.config().window_poll,
                                        relay.config().poll,
                                    )
                                });
                                waiting_room.insert(kind, tokio::time::Instant::now() + wait);
                            }
                            watcher.ask(watches.claimed(kind, r.claimed));
                            let_go_if_quiet([kind], &rounds, &mut watches, &mut watcher);
                        }
                    },
                    answer = watcher.answer() => {
                        match answer {
                            Ok((Call::Watch(k), got)) => {
                                if watches.watched(k, got) {
                                    rounds.wake([k]);
                                }
                            }
                            Ok((Call::Unwatch(k), let_go)) => {
                                if watches.unwatched(k, let_go, tokio::time::Instant::now()) {
                                    rounds.wake([k]);
                                }
                            }
                            Err(e) => {
                                // Every watch ended with the session: writers notify again.
                                tracing::warn!(error = %e, "relay lost its watch session; woken by every notification from now on");
                                rounds.wake(watches.lost());
                            }
                        }
                    }
                    led = lead_answer(&mut lead) => {
                        rounds.lead(&led);
                        // A watch of a kind another relay leads would keep its writers from
                        // notifying that relay: let go of it.
                        let others = kinds.iter().copied().filter(|k| !led.contains(k));
                        let_go_if_quiet(others, &rounds, &mut watches, &mut watcher);
                    }
                    _ = lead_look.tick(), if lead.is_some() => {
                        if let Some(l) = lead.as_mut() {
                            l.look();
                        }
                    }
                    () = look_again(watches.next_look()) => {
                        let due = watches.due(tokio::time::Instant::now());
                        rounds.wake(due.iter().copied());
                        let_go_if_quiet(due, &rounds, &mut watches, &mut watcher);
                    }
                    () = shutdown.cancelled(), if rounds.in_flight() || !rounds.has_failed() => {
                        // Rounds in flight still settle; no new one starts.
                        if !rounds.in_flight() {
                            break;
                        }
                        let _ = tokio::time::timeout(relay.config().confirm_timeout, async {
                            while rounds.settle().await.is_some() {}
                        })
                        .await;
                        break;
                    }
                    ready = async { setup.as_mut().expect("guarded").await }, if setup.is_some() => {
                        setup = None;
                        match ready {
                            Ok(l) => {
                                listener = Some(l);
                                // What was notified before LISTEN took effect is lost: look.
                                rounds.wake(kinds.clone());
                            }
                            Err(e) => {
                                let delay = listen_backoff.next().unwrap_or(Duration::from_secs(10));
                                tracing::warn!(error = %e, retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX), "relay cannot listen for outbox notifications; polling until it can");
                                setup = Some(Box::pin(listen(relay_pool(&relay), delay)));
                            }
                        }
                    }
                    _ = poll.tick(), if !rounds.has_failed() && broken.is_none() => {
                        // Ending the session here would drop the rounds in flight with the rows
                        // they claimed still `dispatching` under their lock: they settle first.
                        match count_consumers(&relay, &ch, &topology).await {
                            Ok(()) => rounds.wake(kinds.clone()),
                            Err(e) => broken = Some(e.to_string()),
                        }
                    }
                    changed = freed.changed(), if !waiting_room.is_empty() && !rounds.has_failed() => {
                        if changed.is_ok() {
                            freed.borrow_and_update();
                        }
                        // A kind refills when half its window has left, not at every claim.
                        let ready: Vec<Kind> = waiting_room
                            .keys()
                            .copied()
                            .filter(|&k| relay.worth_a_look(k))
                            .collect();
                        waiting_room.retain(|k, _| !ready.contains(k));
                        rounds.wake(ready);
                    }
                    () = look_again(waiting_room.values().min().copied()), if !rounds.has_failed() => {
                        let now = tokio::time::Instant::now();
                        let due: Vec<Kind> = waiting_room
                            .iter()
                            .filter(|(_, &at)| at <= now)
                            .map(|(&k, _)| k)
                            .collect();
                        waiting_room.retain(|k, _| !due.contains(k));
                        rounds.wake(due);
                    }
                    woken = wait_for_notification(&mut listener), if !rounds.has_failed() => {
                        match woken {
                            Ok(notified) => {
                                rounds.wake(notified.into_iter().filter(|k| kinds.contains(k)));
                            }
                            Err(e) => {
                                // Listen again after a pause; polling publishes meanwhile, and
                                // what was notified while no one listened is looked for.
                                listener = None;
                                let delay = listen_backoff.next().unwrap_or(Duration::from_secs(10));
                                tracing::warn!(error = %e, retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX), "relay lost its outbox notifications; polling until it listens again");
                                setup = Some(Box::pin(listen(relay_pool(&relay), delay)));
                                rounds.wake(kinds.clone());
                            }
                        }
                    }
                }
            }
            // Writers that skipped their notification while this relay watched are looked for
            // by another relay, which the watcher's last notifications wake.
            watcher.close(watches.held(), Duration::from_secs(1)).await;
            if !conn.status().connected() {
                lost = Some(node);
            }
            if let Some(e) = rounds.failed() {
                return Err(e.to_string());
            }
            if let Some(e) = broken {
                return Err(e);
            }
            // A connection the broker already dropped may never answer a close.
            let _ = tokio::time::timeout(Duration::from_secs(3), ch.close(200, "bye".into())).await;
            let _ =
                tokio::time::timeout(Duration::from_secs(3), conn.close(200, "bye".into())).await;
            Ok::<(), String>(())
        };
        let ended = session.await;
        ready(false);
        if let Some(node) = lost {
            // The next session starts at the next node: this one may be gone for a while.
            services.amqp_url.lost(node);
        }
        if let Err(e) = ended {
            tracing::warn!(error = %e, "relay lost a service; retrying");
        }
        let delay = backoff.next().unwrap_or(Duration::from_secs(10));
        if !nap(delay, &shutdown).await {
            return;
        }
    }
}

/// Reads how many consumers each kind with an `auto` window has on its queue (a passive
/// declare, which the broker answers from memory).
async fn count_consumers(
    relay: &Relay,
    channel: &lapin::Channel,
    topology: &Topology,
) -> Result<(), lapin::Error> {
    for kind in relay.auto_kinds() {
        let q = channel
            .queue_declare(
                topology.queue(kind).as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await?;
        relay.set_consumers(kind, q.consumer_count());
    }
    Ok(())
}

fn relay_pool(relay: &Relay) -> PgPool {
    relay.pool()
}

/// Waits `after`, then listens on the outbox's notification channel with a connection of
/// `pool`.
async fn listen(pool: PgPool, after: Duration) -> Result<PgListener, sqlx::Error> {
    tokio::time::sleep(after).await;
    crate::crash::stall("relay-listen").await;
    let mut listener = PgListener::connect_with(&pool).await?;
    listener.listen("kfs_outbox").await?;
    Ok(listener)
}

/// Asks the watcher to let go of each of `kinds` that has no round in flight and none to start
/// (one another relay leads included).
fn let_go_if_quiet(
    kinds: impl IntoIterator<Item = Kind>,
    rounds: &Rounds<'_>,
    watches: &mut Watches,
    watcher: &mut Watcher,
) {
    for k in kinds {
        if rounds.quiet(k) {
            watcher.ask(watches.quiet(k));
        }
    }
}

/// What the relay leads once its lead session answers; never returns without one.
async fn lead_answer(lead: &mut Option<Lead>) -> std::collections::BTreeSet<Kind> {
    match lead {
        Some(l) => l.answer().await,
        None => std::future::pending().await,
    }
}

/// Waits until `at`; never returns without one.
async fn look_again(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Returns the kinds notified; never returns while there is no listener (the poll interval
/// covers that time).
async fn wait_for_notification(
    listener: &mut Option<PgListener>,
) -> Result<Vec<Kind>, sqlx::Error> {
    let Some(l) = listener else {
        return std::future::pending().await;
    };
    let first = l.recv().await?;
    // Drain what else is buffered so that a burst costs one round.
    let mut kinds: Vec<Kind> = Kind::from_event_type(first.payload()).into_iter().collect();
    while let Some(n) = l.next_buffered() {
        kinds.extend(Kind::from_event_type(n.payload()));
    }
    Ok(kinds)
}
