//! The `run` process: relay, consumers and maintenance under one shutdown token. Invariant: on
//! SIGTERM/SIGINT consumers stop taking deliveries, running slices end with their commits and
//! acks, and the process exits within the grace period; a lost broker or database connection
//! is retried with backoff, never in a busy loop, and never loses a job.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::broker::Topology;
use crate::config::Services;
use crate::consumer::{self, ConsumerConfig, Engine};
use crate::engine::backoff::{nap, reconnect_backoff};
use crate::jobs::{self, Handler, Kind};
use crate::maintenance::{self, MaintenanceConfig};
use crate::relay::{self, Relay, RelayConfig};
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
    /// The reasoning model and the model limits (`KFS_REASONER`, see [`crate::model::config`]).
    pub reasoner: (crate::model::ReasonerConfig, crate::model::Limits),
    /// How PDF and office documents are parsed.
    pub parser: crate::jobs::compile::parse::route::ParserConfig,
}

/// Connections of the heartbeat pool. A heartbeat is one short statement every lease/3, so
/// two serve every lease a worker holds.
pub const HEARTBEAT_CONNECTIONS: u32 = 2;

/// The most connections one process's pools open together (the heartbeat pool and the
/// liveness lock aside).
const PROCESS_CONNECTIONS: u32 = 64;

/// What the shared pool keeps for everything but the consumers' slices: the relay's rounds and
/// listener, maintenance, the leased kinds' poller, the HTTP server, undecodable deliveries.
const SHARED_CONNECTIONS: u32 = 8;

/// Connections the shared pool keeps open: the relay's listener holds one for good, and the
/// relay's rounds, `/readyz` and maintenance need at least one more.
const SHARED_FLOOR: u32 = 2;

/// Connections each kind's own pool keeps open, so that past the connection limit its claims
/// and slices wait for its own connections rather than for sessions held by other pools.
const KIND_POOL_FLOOR: u32 = 1;

/// The fewest connections a kind's own pool is given when the process's connections are
/// divided.
const KIND_FLOOR: u32 = 4;

/// How a process divides its connections between its pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PoolPlan {
    /// The relay, maintenance, the poller, HTTP; in a relay-only process, everything.
    shared: u32,
    /// Each consumed kind's own pool, for its claims and slices (0 without consumers).
    per_kind: u32,
    /// How many kinds have a pool of their own.
    kinds: u32,
}

/// The connections of each kind's own pool in a consumer process of `kinds` kinds at
/// `prefetch` (see [`plan`]); what the bench's engine scenarios mirror.
pub fn kind_pool_size(prefetch: u16, kinds: usize) -> u32 {
    plan(true, prefetch, kinds, 0).per_kind
}

/// Divides a process's connections between its pools. Each consumed kind has a pool of its
/// own: a kind's statements are prepared and planned once per connection, and Postgres loads
/// its catalog caches once per session, so a connection that serves one kind stays warm for
/// it, where one shared pool handed every kind connections last used by another (sqlx gives
/// out the oldest idle one). A kind's pool may open one connection per delivery in flight (its
/// prefetch): a kind whose jobs step as groups opens about one per group, since a pool opens a
/// connection only when none is idle, and the rest when a group goes apart and its members run
/// alone. When the kinds together would pass [`PROCESS_CONNECTIONS`], they share what the
/// shared pool leaves in equal parts, at least [`KIND_FLOOR`] each. A relay-only process needs
/// one connection per round in flight (`depth` per kind) and a few besides.
fn plan(consumer: bool, prefetch: u16, kinds: usize, depth: usize) -> PoolPlan {
    let n = u32::try_from(kinds).unwrap_or(u32::MAX);
    if !consumer {
        let depth = u32::try_from(depth).unwrap_or(u32::MAX);
        return PoolPlan {
            shared: depth
                .saturating_mul(n)
                .saturating_add(4)
                .clamp(4, PROCESS_CONNECTIONS),
            per_kind: 0,
            kinds: 0,
        };
    }
    let room = PROCESS_CONNECTIONS - SHARED_CONNECTIONS;
    PoolPlan {
        shared: SHARED_CONNECTIONS,
        per_kind: u32::from(prefetch)
            .max(1)
            .min((room / n.max(1)).max(KIND_FLOOR)),
        kinds: n,
    }
}

/// A kind's own pool: what the process's division gives it, at most the kind's own bound.
fn pool_of(per_kind: u32, max_connections: Option<u32>) -> u32 {
    max_connections.map_or(per_kind, |m| per_kind.min(m.max(1)))
}

pub async fn run(opts: RunOptions, shutdown: CancellationToken) -> anyhow::Result<()> {
    let s = &opts.services;
    let plan = plan(
        opts.consumer,
        opts.consumer_cfg.prefetch,
        opts.kinds.len(),
        opts.relay_cfg.depth,
    );
    // What this process's leases record in `worker_id`: the worker id and this incarnation.
    let holder = liveness::holder(&opts.worker_id);
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
    let pool = db::lazy_pool_with_floor(
        options.clone(),
        plan.shared,
        SHARED_FLOOR,
        s.connect_timeout,
    );
    let kind_pools: HashMap<Kind, PgPool> = if opts.consumer {
        opts.kinds
            .iter()
            .map(|&k| {
                // Named for the kind, so `pg_stat_activity` shows which kind a session serves.
                let named = options
                    .clone()
                    .application_name(&format!("kfs-worker {} {k}", opts.worker_id));
                let size = pool_of(plan.per_kind, k.spec().max_connections);
                (
                    k,
                    db::lazy_pool_with_floor(named, size, KIND_POOL_FLOOR, s.connect_timeout),
                )
            })
            .collect()
    } else {
        HashMap::new()
    };
    // Heartbeats have connections of their own: the slices hold theirs for a whole slice. A
    // consumer keeps them open from its start, so that past the connection limit its slices,
    // which may take every other session, never leave a lease without its heartbeat.
    let heartbeat_pool = db::lazy_pool_with_floor(
        options
            .clone()
            .application_name(&format!("kfs-worker {} heartbeats", opts.worker_id)),
        HEARTBEAT_CONNECTIONS,
        if opts.consumer {
            HEARTBEAT_CONNECTIONS
        } else {
            0
        },
        s.connect_timeout,
    );
    let topology = Topology::new(&s.queue_prefix);
    let mut tasks = JoinSet::new();
    let health = Arc::new(crate::http::Health::new(opts.relay, opts.consumer));
    crate::metrics::install();
    crate::metrics::register(&jobs::served(&opts.kinds, opts.leased.is_some()));
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
        match prepare_database(&opts, &holder, &options, &pool, &mut lock).await {
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
    // Each pool's floor, before the relay and the consumers start: once they run, a burst of
    // one kind may take every session Postgres still allows.
    let floors = std::iter::once(("shared", &pool))
        .chain(kind_pools.iter().map(|(k, p)| (k.name(), p)))
        .chain(std::iter::once(("heartbeat", &heartbeat_pool)))
        .map(|(name, p)| async move {
            if let Err(e) = db::open_floor(p, s.connect_timeout).await {
                tracing::warn!(pool = name, error = %e, "cannot open the connections this pool keeps; it opens them when it can");
            }
        });
    futures_util::future::join_all(floors).await;
    // Every worker's pool grows on demand, so too many of them for Postgres' connection limit
    // show up only under load, as steps waiting for connections. Say so at start.
    // The pool (the relay's listener keeps one of its connections), the liveness lock, the
    // relay's own sessions and the heartbeat connections.
    let kinds_own: u32 = if opts.consumer {
        opts.kinds
            .iter()
            .map(|k| pool_of(plan.per_kind, k.spec().max_connections))
            .sum()
    } else {
        0
    };
    let per_worker = plan.shared
        + kinds_own
        + u32::from(lock.is_some())
        + if opts.relay {
            crate::relay::own_sessions(&opts.relay_cfg)
        } else {
            0
        }
        + if opts.consumer {
            HEARTBEAT_CONNECTIONS
        } else {
            0
        };
    // The live workers hold a liveness lock; this one is counted whether or not it holds one.
    let workers = crate::liveness::count_live(&pool)
        .await
        .map(|n| n + i64::from(lock.is_none()));
    match async { db::capacity(&pool, workers?).await }.await {
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
    // A process that lost its identity (its worker id taken while its liveness session was
    // gone) has shut down by then; it ends with that error.
    let (lost_tx, mut lost) = tokio::sync::oneshot::channel();
    if let Some(lock) = lock {
        let held = liveness::hold(
            s.database_url.clone(),
            holder.clone(),
            lock,
            shutdown.clone(),
            Some(s.amqp_url.clone()),
        );
        tasks.spawn(async move {
            if let Err(e) = held.await {
                let _ = lost_tx.send(e);
            }
        });
    }
    // One set of model limits (gate, breaker) for the whole process.
    let models = crate::model::build(&opts.reasoner.0, opts.reasoner.1)?;
    if let (Some(cfg), Some(_)) = (opts.leased.clone(), models.reasoner()) {
        tasks.spawn(crate::poller::run_polled(
            pool.clone(),
            jobs::polled_kinds(models.clone()),
            holder.clone(),
            cfg.poll,
            shutdown.clone(),
        ));
    }
    if let Some(cfg) = opts.leased.clone() {
        tasks.spawn(crate::poller::run(
            pool.clone(),
            jobs::leased_kinds_with(models.clone(), crate::embed::build(&opts.embedder)?),
            holder.clone(),
            cfg,
            shutdown.clone(),
        ));
    }
    if opts.consumer {
        let deps = jobs::Deps {
            store: crate::store::Store::open(&opts.object_store)?,
            embedder: crate::embed::build(&opts.embedder)?,
            parsers: Arc::new(jobs::compile::parse::route::Parsers::new(&opts.parser)?),
            models: models.clone(),
        };
        let handlers: Vec<Arc<dyn Handler>> = jobs::handlers(&deps)?
            .into_iter()
            .filter(|h| opts.kinds.contains(&h.kind()))
            .collect();
        let with = opts.kinds.clone();
        let engine = Arc::new(
            Engine::new(
                pool.clone(),
                holder.clone(),
                handlers,
                opts.consumer_cfg.clone(),
            )
            .with_kind_pools(kind_pools.clone())
            .with_heartbeat_pool(heartbeat_pool.clone()),
        );
        let health = health.clone();
        tasks.spawn(consumer::consumers(
            engine,
            move |up| health.set_consumer(up),
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
            holder.clone(),
            opts.relay_cfg.clone(),
            &opts.kinds,
        );
        let health = health.clone();
        tasks.spawn(relay::relay_loop(
            relay,
            move |up| health.set_relay(up),
            s.clone(),
            topology.clone(),
            shutdown.clone(),
        ));
    }
    if opts.consumer {
        tasks.spawn(db::statistics::run(
            pool.clone(),
            db::statistics::EVERY,
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
        holder = %holder,
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
    let closing = kind_pools.values().chain([&pool]).map(PgPool::close);
    let _ = tokio::time::timeout(
        Duration::from_secs(3),
        futures_util::future::join_all(closing),
    )
    .await;
    match lost.try_recv() {
        Ok(e) => Err(e.into()),
        Err(_) => Ok(()),
    }
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
/// runs, and this process's liveness locks (kept in `lock` across attempts while its session
/// lives): its holder's, and its worker id's, which a live process of the same id still holds.
async fn prepare_database(
    opts: &RunOptions,
    holder: &str,
    options: &sqlx::postgres::PgConnectOptions,
    pool: &PgPool,
    lock: &mut Option<sqlx::PgConnection>,
) -> Result<(), Blocked> {
    let s = &opts.services;
    db::probe(&s.database_url, options, s.connect_timeout).await?;
    // A build runs only on the schema its migrations made: a database not migrated for it, or
    // one the platform has taken past what it knows, would fail its jobs one by one.
    if let Err(why) = db::migrate::current(&mut *pool.acquire().await?).await? {
        return Err(Blocked::Fail(anyhow::anyhow!(why)));
    }
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
            // A process restarted under its id right after a crash may find its predecessor's
            // session not gone yet (Postgres notices a dead client within moments): it waits
            // for the id up to the connect timeout, so a restart is not refused for that; a
            // live process under the same id still refuses it.
            let patience = tokio::time::Instant::now() + s.connect_timeout;
            let taken = loop {
                let tried = tokio::time::timeout(
                    s.connect_timeout,
                    liveness::acquire_process(&s.database_url, holder),
                )
                .await
                .map_err(|_| {
                    Blocked::Wait(format!(
                        "no answer within {}s while taking the liveness lock",
                        s.connect_timeout.as_secs()
                    ))
                })?;
                match tried {
                    Err(liveness::LivenessError::InUse(_))
                        if tokio::time::Instant::now() < patience =>
                    {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    other => break other?,
                }
            };
            *lock = Some(taken);
        }
    }
    Ok(())
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
    use super::{plan, pool_of, PoolPlan};

    #[test]
    fn a_platform_kinds_pool_is_bounded_by_its_own_limit() {
        use crate::jobs::Kind;
        // One kind at prefetch 64: 56 connections from the division.
        let per_kind = plan(true, 64, 1, 4).per_kind;
        assert_eq!(per_kind, 56);
        for (kind, size) in [
            (Kind::new("compile"), 8),
            (Kind::new("research"), 8),
            (Kind::new("deletion"), 8),
            (Kind::Probe, 56),
        ] {
            assert_eq!(
                pool_of(per_kind, kind.spec().max_connections),
                size,
                "{kind}"
            );
        }
        // Below the bound the division decides; a bound of 0 still leaves one connection.
        assert_eq!(pool_of(4, Some(8)), 4);
        assert_eq!(pool_of(4, Some(0)), 1);
    }

    #[test]
    fn pool_plan_table() {
        // (consumer, prefetch, kinds, depth) → (shared, each kind's pool)
        let table = [
            // Each kind gets its prefetch while they fit.
            ((true, 16, 3, 4), (8, 16)),
            ((true, 16, 1, 4), (8, 16)),
            ((true, 1, 2, 4), (8, 1)),
            // Past the process's 64, the kinds share what the shared pool leaves.
            ((true, 64, 3, 4), (8, 18)),
            ((true, 64, 1, 4), (8, 56)),
            ((true, 40, 4, 4), (8, 14)),
            // Never below the floor, even past the process's connections.
            ((true, 64, 15, 4), (8, 4)),
            // A relay-only process: one connection per round in flight, and a few.
            ((false, 16, 0, 4), (4, 0)),
            ((false, 16, 3, 4), (16, 0)),
            ((false, 16, 1, 1), (5, 0)),
            ((false, 16, 3, 100), (64, 0)),
        ];
        for ((consumer, prefetch, kinds, depth), (shared, per_kind)) in table {
            let want = PoolPlan {
                shared,
                per_kind,
                kinds: if consumer { kinds as u32 } else { 0 },
            };
            assert_eq!(
                plan(consumer, prefetch, kinds, depth),
                want,
                "consumer {consumer}, prefetch {prefetch}, kinds {kinds}, depth {depth}"
            );
        }
    }
}
