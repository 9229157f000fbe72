//! The `run` process: relay, consumers and maintenance under one shutdown token. Invariant: on
//! SIGTERM/SIGINT consumers stop taking deliveries, running slices end with their commits and
//! acks, and the process exits within the grace period; a lost broker or database connection
//! is retried with backoff, never in a busy loop, and never loses a job.

use std::sync::Arc;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use lapin::options::ConfirmSelectOptions;
use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::broker::{self, Topology};
use crate::config::Services;
use crate::consumer::{self, ConsumerConfig, Engine};
use crate::jobs::{self, Handler, Kind};
use crate::maintenance::{self, MaintenanceConfig};
use crate::relay::{Relay, RelayConfig, Rounds, Settled};
use crate::{db, liveness};

#[derive(Clone, Debug)]
pub struct RunOptions {
    pub services: Services,
    pub object_store: crate::config::SecretUrl,
    pub worker_id: String,
    pub kinds: Vec<Kind>,
    pub relay: bool,
    pub consumer: bool,
    pub maintenance: bool,
    /// The jobs leased straight from Postgres (bootstraps, profile backfills); `None`: off.
    pub leased: Option<crate::poller::LeasedConfig>,
    pub relay_cfg: RelayConfig,
    pub consumer_cfg: ConsumerConfig,
    pub maintenance_cfg: MaintenanceConfig,
    /// Where `/healthz`, `/readyz` and `/metrics` listen; `None` turns the HTTP server off.
    pub http_addr: Option<std::net::SocketAddr>,
    /// Authorises the dashboard's actions; `None` refuses them all.
    pub admin_token: Option<crate::config::AdminToken>,
    /// The embedding port compile and research use for spaces with an embedding profile.
    pub embedder: crate::embed::EmbedderConfig,
}

/// Reconnect delays: 100 ms doubling to 10 s, with jitter, forever.
fn reconnect_backoff() -> impl Iterator<Item = Duration> {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(10))
        .with_jitter()
        .without_max_times()
        .build()
}

/// Sleeps `d` unless shutdown comes first. `false`: shutting down.
async fn nap(d: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        () = shutdown.cancelled() => false,
        () = tokio::time::sleep(d) => true,
    }
}

/// The most connections the process's pool may open. A consumer keeps one per delivery in
/// flight (`prefetch` per kind), plus some for the relay's rounds and listener, heartbeats and
/// maintenance. A relay-only process needs one per round in flight (`depth` per kind) and a
/// few besides, and should not hold a consumer's share of Postgres' connection limit.
/// Connections of the heartbeat pool. A heartbeat is one short statement every lease/3, so
/// two serve every lease a worker holds.
const HEARTBEAT_CONNECTIONS: u32 = 2;

fn pool_size(consumer: bool, prefetch: u16, kinds: usize, depth: usize) -> u32 {
    let kinds = u32::try_from(kinds).unwrap_or(u32::MAX);
    if consumer {
        u32::from(prefetch)
            .saturating_mul(kinds)
            .saturating_add(8)
            .clamp(8, 64)
    } else {
        let depth = u32::try_from(depth).unwrap_or(u32::MAX);
        depth.saturating_mul(kinds).saturating_add(4).clamp(4, 64)
    }
}

pub async fn run(opts: RunOptions, shutdown: CancellationToken) -> anyhow::Result<()> {
    let s = &opts.services;
    let pool_size = pool_size(
        opts.consumer,
        opts.consumer_cfg.prefetch,
        opts.kinds.len(),
        opts.relay_cfg.depth,
    );
    // The shortest lease of the kinds this process runs: a step idle in its transaction for
    // longer than that is as good as dead.
    let idle = opts
        .kinds
        .iter()
        .filter_map(|k| opts.consumer_cfg.policies.get(k).map(|p| p.lease))
        .min();
    let options = db::session_options(
        &s.database_url,
        &format!("kfs-worker {}", opts.worker_id),
        idle,
    )?;
    let pool = db::lazy_pool(options.clone(), pool_size, s.connect_timeout);
    // Heartbeats have connections of their own: the slices hold theirs for a whole slice.
    let heartbeat_pool = db::lazy_pool(options.clone(), HEARTBEAT_CONNECTIONS, s.connect_timeout);
    let topology = Topology::new(&s.queue_prefix);
    let mut tasks = JoinSet::new();
    let health = Arc::new(crate::http::Health::new(opts.relay, opts.consumer));
    if let Some(addr) = opts.http_addr {
        let listener = crate::http::bind(addr).await?;
        let bound = listener.local_addr()?;
        let state = crate::http::AppState {
            pool: pool.clone(),
            health: health.clone(),
            kinds: opts.kinds.clone(),
            services: s.clone(),
            topology: topology.clone(),
            metrics: crate::metrics::install(),
            admin_token: opts.admin_token.clone(),
        };
        let shutdown = shutdown.clone();
        tasks.spawn(async move {
            if let Err(e) = crate::http::serve(listener, state, shutdown).await {
                tracing::error!(error = %e, "HTTP server failed");
            }
        });
        tracing::info!(addr = %bound, "serving the dashboard, /healthz, /readyz and /metrics");
    }

    // A worker may well start before Postgres does (a machine booting, a database restarting):
    // it waits for it, with backoff, instead of exiting. Only what waiting cannot fix ends it.
    let mut lock = None;
    let mut backoff = reconnect_backoff();
    loop {
        match prepare_database(&opts, &options, &pool, &mut lock).await {
            Ok(()) => break,
            Err(Blocked::Fail(e)) => {
                shutdown.cancel();
                while tasks.join_next().await.is_some() {}
                return Err(e);
            }
            Err(Blocked::Wait(reason)) => {
                let delay = backoff.next().unwrap_or(Duration::from_secs(10));
                tracing::warn!(%reason, retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX), "Postgres is not available yet; starting once it is");
                if !nap(delay, &shutdown).await {
                    while tasks.join_next().await.is_some() {}
                    return Ok(());
                }
            }
        }
    }
    // Every worker's pool grows on demand, so too many of them for Postgres' connection limit
    // show up only under load, as steps waiting for connections. Say so at start.
    // The pool (the relay's listener keeps one of its connections), the liveness lock and the
    // heartbeat connections.
    let per_worker = pool_size
        + u32::from(lock.is_some())
        + if opts.consumer {
            HEARTBEAT_CONNECTIONS
        } else {
            0
        };
    match db::capacity(&pool, lock.is_some()).await {
        Ok(cap) => {
            if let Some(warning) = db::over_capacity(per_worker, cap) {
                tracing::warn!(
                    per_worker,
                    workers = cap.workers,
                    usable = cap.usable,
                    "{warning}"
                );
            }
        }
        Err(e) => tracing::debug!(error = %e, "cannot read Postgres' connection limit"),
    }
    if let Some(lock) = lock {
        tasks.spawn(liveness::hold(
            s.database_url.clone(),
            opts.worker_id.clone(),
            lock,
            shutdown.clone(),
        ));
    }
    if let Some(cfg) = opts.leased.clone() {
        tasks.spawn(crate::poller::run(
            pool.clone(),
            jobs::leased_kinds(),
            opts.worker_id.clone(),
            cfg,
            shutdown.clone(),
        ));
    }
    if opts.consumer {
        let deps = jobs::Deps {
            store: crate::store::Store::open(&opts.object_store)?,
            embedder: crate::embed::build(&opts.embedder)?,
        };
        let handlers: Vec<Arc<dyn Handler>> = jobs::handlers(&deps)?
            .into_iter()
            .filter(|h| opts.kinds.contains(&h.kind()))
            .collect();
        let with = opts.kinds.clone();
        let engine = Arc::new(
            Engine::new(
                pool.clone(),
                opts.worker_id.clone(),
                handlers,
                opts.consumer_cfg.clone(),
            )
            .with_heartbeat_pool(heartbeat_pool.clone()),
        );
        tasks.spawn(consumers(
            engine,
            health.clone(),
            s.clone(),
            topology.clone(),
            with,
            opts.consumer_cfg.prefetch,
            shutdown.clone(),
        ));
    }
    if opts.relay {
        let relay = Relay::new(
            pool.clone(),
            topology.clone(),
            opts.worker_id.clone(),
            opts.relay_cfg.clone(),
            &opts.kinds,
        );
        tasks.spawn(relay_loop(
            relay,
            health.clone(),
            s.clone(),
            topology.clone(),
            shutdown.clone(),
        ));
    }
    if opts.maintenance {
        tasks.spawn(maintenance::run(
            pool.clone(),
            opts.kinds.clone(),
            opts.maintenance_cfg.clone(),
            shutdown.clone(),
        ));
    }
    tracing::info!(
        worker_id = %opts.worker_id,
        kinds = ?opts.kinds.iter().map(|k| k.name()).collect::<Vec<_>>(),
        relay = opts.relay, consumer = opts.consumer, leased = opts.leased.is_some(),
        "kfs-worker running"
    );
    // After shutdown is requested, running slices get the grace period to commit and ack; then
    // the process exits whatever is still waiting (it left nothing acked before its commit).
    let bound = opts.consumer_cfg.shutdown_grace + Duration::from_secs(10);
    let mut deadline: Option<tokio::time::Instant> = None;
    loop {
        if deadline.is_none() && shutdown.is_cancelled() {
            deadline = Some(tokio::time::Instant::now() + bound);
        }
        let until =
            deadline.unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(3600));
        tokio::select! {
            done = tasks.join_next() => match done {
                None => break,
                Some(Err(e)) => {
                    tracing::error!(error = %e, "a task panicked; shutting down");
                    shutdown.cancel();
                }
                Some(Ok(())) => {}
            },
            () = shutdown.cancelled(), if deadline.is_none() => {}
            () = tokio::time::sleep_until(until) => {
                tracing::warn!("parts still running after the shutdown bound; exiting anyway");
                tasks.abort_all();
                break;
            }
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(3), pool.close()).await;
    Ok(())
}

/// Why start-up cannot go on yet.
enum Blocked {
    /// Postgres cannot be used for now (down, starting, restarting, full): wait and try again.
    Wait(String),
    /// Nothing that waiting can fix: refused credentials, a missing database, a worker id
    /// already in use, a statement Postgres rejects.
    Fail(anyhow::Error),
}

impl From<db::ConnectError> for Blocked {
    fn from(e: db::ConnectError) -> Self {
        if e.is_transient() {
            Blocked::Wait(e.to_string())
        } else {
            Blocked::Fail(e.into())
        }
    }
}

impl From<sqlx::Error> for Blocked {
    fn from(e: sqlx::Error) -> Self {
        if db::is_retryable(&e) {
            Blocked::Wait(e.to_string())
        } else {
            Blocked::Fail(e.into())
        }
    }
}

impl From<liveness::LivenessError> for Blocked {
    fn from(e: liveness::LivenessError) -> Self {
        match e {
            liveness::LivenessError::Db(e) => e.into(),
            in_use => Blocked::Fail(in_use.into()),
        }
    }
}

/// Everything start-up needs from Postgres: a connection, the probe kind's tables where it
/// runs, this worker's liveness lock (kept in `lock` across attempts while its session lives),
/// and the release of leases a dead predecessor left under this worker id.
async fn prepare_database(
    opts: &RunOptions,
    options: &sqlx::postgres::PgConnectOptions,
    pool: &PgPool,
    lock: &mut Option<sqlx::PgConnection>,
) -> Result<(), Blocked> {
    let s = &opts.services;
    db::probe(&s.database_url, options, s.connect_timeout).await?;
    for kind in &opts.kinds {
        if let Some(prepare) = kind.entry().prepare {
            prepare(pool).await?;
        }
    }
    if opts.consumer || opts.leased.is_some() {
        if let Some(held) = lock.as_mut() {
            if sqlx::Connection::ping(held).await.is_err() {
                *lock = None;
            }
        }
        if lock.is_none() {
            let taken = tokio::time::timeout(
                s.connect_timeout,
                liveness::acquire(&s.database_url, &opts.worker_id),
            )
            .await
            .map_err(|_| {
                Blocked::Wait(format!(
                    "no answer within {}s while taking the liveness lock",
                    s.connect_timeout.as_secs()
                ))
            })??;
            *lock = Some(taken);
        }
    }
    if opts.consumer {
        for &kind in &opts.kinds {
            let n = maintenance::release_own_leases(pool, kind, &opts.worker_id).await?;
            if n > 0 {
                tracing::info!(kind = %kind, rows = n, "released the leases of a dead process that ran under this worker id");
            }
        }
    }
    Ok(())
}

/// Connects, declares the topology and consumes every kind until shutdown; reconnects with
/// backoff when the broker goes away.
async fn consumers(
    engine: Arc<Engine>,
    health: Arc<crate::http::Health>,
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
        let session = async {
            let conn = broker::connect(
                &services.amqp_url,
                &format!("kfs-worker consumer {}", engine.worker_id()),
                services.connect_timeout,
            )
            .await
            .map_err(|e| e.to_string())?;
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
            let mut running = JoinSet::new();
            for &kind in &kinds {
                let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
                running.spawn(consumer::consume(
                    engine.clone(),
                    ch,
                    topology.queue(kind),
                    kind,
                    prefetch,
                    shutdown.clone(),
                ));
            }
            health.set_consumer(true);
            tracing::info!("consuming");
            // One consumer failing means the connection is in trouble: rebuild all of them.
            let first = running.join_next().await;
            let session_shutdown = shutdown.is_cancelled();
            if !session_shutdown {
                tracing::warn!(result = ?first.map(|r| r.map(|x| x.map_err(|e| e.to_string()))), "a consumer stopped; reconnecting");
            }
            while running.join_next().await.is_some() {}
            // A connection the broker already dropped may never answer a close.
            let _ =
                tokio::time::timeout(Duration::from_secs(3), conn.close(200, "bye".into())).await;
            health.set_consumer(false);
            Ok::<bool, String>(session_shutdown)
        };
        match session.await {
            Ok(true) => return,
            Ok(false) => {
                backoff = reconnect_backoff();
            }
            Err(e) => tracing::warn!(error = %e, "consumer cannot connect to RabbitMQ; retrying"),
        }
        let delay = backoff.next().unwrap_or(Duration::from_secs(10));
        if !nap(delay, &shutdown).await {
            return;
        }
    }
}

/// Publishes due outbox rows of every kind until shutdown: woken by notifications, with
/// polling as the fallback; reconnects with backoff.
async fn relay_loop(
    relay: Relay,
    health: Arc<crate::http::Health>,
    services: Services,
    topology: Topology,
    shutdown: CancellationToken,
) {
    let kinds = relay.kinds();
    let mut backoff = reconnect_backoff();
    while !shutdown.is_cancelled() {
        let session = async {
            let conn = broker::connect(
                &services.amqp_url,
                "kfs-worker relay",
                services.connect_timeout,
            )
            .await
            .map_err(|e| e.to_string())?;
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
            health.set_relay(true);
            let mut rounds = Rounds::new(&relay, &ch, &kinds);
            // The polling fallback: a fixed interval that wakes every kind whatever else
            // happens. Rows that come due with time (retries, re-arms, visibility republishes,
            // future `available_at`) never notify; a timer restarted by each notification or
            // settled round would let one busy kind starve the others' polls.
            let mut poll = tokio::time::interval_at(
                tokio::time::Instant::now() + relay.config().poll,
                relay.config().poll,
            );
            poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                if !shutdown.is_cancelled() {
                    rounds.start();
                }
                if !rounds.in_flight() && (rounds.has_failed() || shutdown.is_cancelled()) {
                    break;
                }
                tokio::select! {
                    Some(settled) = rounds.settle(), if rounds.in_flight() => {
                        // Only a whole round proves both services back: resetting the backoff
                        // on the broker connection alone made a Postgres outage a reconnect
                        // loop. After a failed round the others settle what they claimed, then
                        // the session reconnects.
                        if let Settled::Round(_) = settled {
                            backoff = reconnect_backoff();
                        }
                    },
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
                    _ = poll.tick(), if !rounds.has_failed() => {
                        rounds.wake(kinds.clone());
                    }
                    woken = wait_for_notification(&mut listener), if !rounds.has_failed() => {
                        match woken {
                            Ok(notified) => rounds.wake(notified),
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
            if let Some(e) = rounds.failed() {
                return Err(e.to_string());
            }
            // A connection the broker already dropped may never answer a close.
            let _ = tokio::time::timeout(Duration::from_secs(3), ch.close(200, "bye".into())).await;
            let _ =
                tokio::time::timeout(Duration::from_secs(3), conn.close(200, "bye".into())).await;
            Ok::<(), String>(())
        };
        let ended = session.await;
        health.set_relay(false);
        if let Err(e) = ended {
            tracing::warn!(error = %e, "relay lost a service; retrying");
        }
        let delay = backoff.next().unwrap_or(Duration::from_secs(10));
        if !nap(delay, &shutdown).await {
            return;
        }
    }
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

/// Waits for SIGTERM or SIGINT, then cancels `shutdown`.
pub async fn signals(shutdown: CancellationToken) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
    tracing::info!("shutdown requested; finishing running slices");
    shutdown.cancel();
}

#[cfg(test)]
mod tests {
    use super::pool_size;

    #[test]
    fn pool_size_table() {
        // (consumer, prefetch, kinds, depth) → connections
        let table = [
            ((true, 16, 1, 4), 24),
            ((true, 16, 3, 4), 56),
            ((true, 60, 3, 4), 64),
            ((true, 1, 1, 4), 9),
            ((false, 16, 3, 4), 16),
            ((false, 16, 1, 4), 8),
            ((false, 16, 1, 1), 5),
            ((false, 16, 3, 100), 64),
        ];
        for ((consumer, prefetch, kinds, depth), want) in table {
            assert_eq!(
                pool_size(consumer, prefetch, kinds, depth),
                want,
                "consumer {consumer}, prefetch {prefetch}, kinds {kinds}, depth {depth}"
            );
        }
    }
}
