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
use crate::relay::{Relay, RelayConfig};
use crate::{db, liveness};

#[derive(Clone, Debug)]
pub struct RunOptions {
    pub services: Services,
    pub worker_id: String,
    pub kinds: Vec<Kind>,
    pub relay: bool,
    pub consumer: bool,
    pub maintenance: bool,
    pub relay_cfg: RelayConfig,
    pub consumer_cfg: ConsumerConfig,
    pub maintenance_cfg: MaintenanceConfig,
}

/// The handlers this build has.
pub fn handlers() -> Vec<Arc<dyn Handler>> {
    vec![Arc::new(jobs::probe::ProbeHandler)]
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

pub async fn run(opts: RunOptions, shutdown: CancellationToken) -> anyhow::Result<()> {
    let s = &opts.services;
    let pool_size =
        (u32::from(opts.consumer_cfg.prefetch) * opts.kinds.len() as u32 + 8).clamp(8, 64);
    let pool = db::connect(
        &s.database_url,
        &format!("kfs-worker {}", opts.worker_id),
        pool_size,
        s.connect_timeout,
    )
    .await?;
    if opts.kinds.contains(&Kind::Probe) {
        jobs::probe::install(&pool).await?;
    }
    let topology = Topology::new(&s.queue_prefix);
    let mut tasks = JoinSet::new();

    if opts.consumer {
        let lock = liveness::acquire(&s.database_url, &opts.worker_id).await?;
        tasks.spawn(liveness::hold(
            s.database_url.clone(),
            opts.worker_id.clone(),
            lock,
            shutdown.clone(),
        ));
        let available = handlers();
        let (with, without): (Vec<Kind>, Vec<Kind>) = opts
            .kinds
            .iter()
            .partition(|k| available.iter().any(|h| h.kind() == **k));
        for k in &without {
            tracing::warn!(kind = %k, "this build has no handler for the kind; its messages stay queued for a worker that has one");
        }
        let handlers: Vec<Arc<dyn Handler>> = available
            .into_iter()
            .filter(|h| with.contains(&h.kind()))
            .collect();
        let engine = Arc::new(Engine::new(
            pool.clone(),
            opts.worker_id.clone(),
            handlers,
            opts.consumer_cfg.clone(),
        ));
        tasks.spawn(consumers(
            engine,
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
        relay = opts.relay, consumer = opts.consumer,
        "kfs-worker running"
    );
    while let Some(done) = tasks.join_next().await {
        if let Err(e) = done {
            tracing::error!(error = %e, "a task panicked; shutting down");
            shutdown.cancel();
        }
    }
    pool.close().await;
    Ok(())
}

/// Connects, declares the topology and consumes every kind until shutdown; reconnects with
/// backoff when the broker goes away.
async fn consumers(
    engine: Arc<Engine>,
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
            tracing::info!("consuming");
            // One consumer failing means the connection is in trouble: rebuild all of them.
            let first = running.join_next().await;
            let session_shutdown = shutdown.is_cancelled();
            if !session_shutdown {
                tracing::warn!(result = ?first.map(|r| r.map(|x| x.map_err(|e| e.to_string()))), "a consumer stopped; reconnecting");
            }
            while running.join_next().await.is_some() {}
            let _ = conn.close(200, "bye".into()).await;
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
            let mut listener = listen(relay_pool(&relay)).await;
            backoff = reconnect_backoff();
            loop {
                let mut busy = false;
                for &kind in &kinds {
                    let round = relay
                        .relay_once(&ch, kind)
                        .await
                        .map_err(|e| e.to_string())?;
                    busy |= round.claimed as i64 >= relay.config().batch;
                }
                if busy {
                    if shutdown.is_cancelled() {
                        break;
                    }
                    continue;
                }
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = wait_for_notification(&mut listener, relay.config().poll) => {}
                }
            }
            let _ = conn.close(200, "bye".into()).await;
            Ok::<(), String>(())
        };
        if let Err(e) = session.await {
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

async fn listen(pool: PgPool) -> Option<PgListener> {
    let mut listener = PgListener::connect_with(&pool).await.ok()?;
    listener.listen("kfs_outbox").await.ok()?;
    Some(listener)
}

/// Returns on a notification or after `poll`, whichever comes first.
async fn wait_for_notification(listener: &mut Option<PgListener>, poll: Duration) {
    match listener {
        Some(l) => {
            let _ = tokio::time::timeout(poll, l.recv()).await;
            // Drain what else is buffered so that a burst costs one round.
            while l.next_buffered().is_some() {}
        }
        None => tokio::time::sleep(poll).await,
    }
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
