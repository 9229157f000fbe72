//! The scenarios, one file per scenario group, and the harness they share. Invariant: each one
//! measures only its own fresh environment, counts what was actually finished (never what was
//! asked), and takes its times from one clock: the bench's monotonic clock for the bare loops,
//! Postgres' clock for jobs (created, claimed and completed timestamps of the rows themselves).

mod bulk;
mod claim;
mod documents;
mod engine;
mod fairness;
mod kinds;
mod limit;
mod peer;
mod relay;
mod scaleout;
mod takeover;
mod writes;

use std::future::Future;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::env::BenchEnv;
use super::machine::CpuMeter;
use super::report::{Progress, Run};
use crate::config;
use crate::consumer::ConsumerConfig;
use crate::db;
use crate::jobs::probe::{self, ProbeSpec};
use crate::jobs::Kind;
use crate::maintenance::MaintenanceConfig;
use crate::relay::{Relay, RelayConfig};
use crate::runtime::{self, RunOptions};

pub use bulk::bulk;
pub use claim::claim;
pub use documents::documents;
pub use engine::{engine, latency, statements};
pub use fairness::fairness;
pub use kinds::kinds;
pub use limit::limit;
pub use peer::peer;
pub use relay::relay;
pub use scaleout::scaleout;
pub use takeover::takeover;
pub use writes::writes;

/// How long a scenario waits without a single job finishing before it reports what it has.
const STALL: Duration = Duration::from_secs(60);

/// The knobs every scenario shares.
#[derive(Clone, Debug)]
pub struct Params {
    pub jobs: u64,
    pub workers: u32,
    pub inflight: u16,
    /// The engine's batch bound (at most `inflight`).
    pub batch_max: u16,
    pub latency_secs: u64,
    pub latency_rate: u32,
    pub kind_jobs: u32,
    /// The first tenant's backlog in the fairness scenario.
    pub fair_backlog: u32,
    /// The relay's window in the scenarios that run the worker (`--relay-window`), parsed and
    /// as given (for child processes).
    pub windows: crate::relay::window::Windows,
    pub window_setting: String,
    pub interactive: bool,
    /// The sizes of the bulk scenario's uploads.
    pub bulk_sizes: Vec<usize>,
}

/// The probe's pool in a `run` process of the probe alone at `prefetch` (see `runtime::plan`).
pub fn engine_pool_size(prefetch: u16) -> u32 {
    crate::runtime::kind_pool_size(prefetch, 1)
}

/// Publishes messages `1..=n`, each made by `message`, to `exchange` with `routing_key`,
/// mandatory, `batch` at a time, each batch's confirms awaited before the next (as the relay
/// does). Returns how many were confirmed: acked by the broker and not returned unroutable.
async fn publish_confirmed(
    ch: &lapin::Channel,
    exchange: &str,
    routing_key: &str,
    n: u64,
    batch: u64,
    progress: Option<&Progress>,
    mut message: impl FnMut(u64) -> (lapin::BasicProperties, Vec<u8>),
) -> Result<u64, String> {
    let mut confirmed = 0u64;
    let mut next = 1u64;
    while next <= n {
        let end = (next + batch - 1).min(n);
        let mut confirms = Vec::with_capacity(batch as usize);
        for id in next..=end {
            let (props, body) = message(id);
            let c = ch
                .basic_publish(
                    exchange.into(),
                    routing_key.into(),
                    lapin::options::BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &body,
                    props,
                )
                .await
                .map_err(|e| e.to_string())?;
            confirms.push(c);
        }
        for c in confirms {
            let c = c.await.map_err(|e| e.to_string())?;
            if c.is_ack() && c.take_message().is_none() {
                confirmed += 1;
            }
        }
        if let Some(p) = progress {
            p.set(end);
        }
        next = end + 1;
    }
    Ok(confirmed)
}

/// Polls `count` until it reaches `n`, or until nothing moved for [`STALL`].
async fn wait_for<F, Fut>(
    n: u64,
    progress: &Progress,
    poll: Duration,
    mut count: F,
) -> Result<u64, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<u64, String>>,
{
    let mut last = u64::MAX;
    let mut moved = Instant::now();
    loop {
        let c = count().await?;
        progress.set(c);
        if c >= n {
            return Ok(c);
        }
        if c != last {
            last = c;
            moved = Instant::now();
        } else if moved.elapsed() > STALL {
            return Ok(c);
        }
        tokio::time::sleep(poll).await;
    }
}

/// The options of a `run` process that relays and consumes `kinds` in this environment.
fn run_options(
    env: &BenchEnv,
    kinds: Vec<Kind>,
    p: &Params,
    object_store: &str,
) -> Result<RunOptions, String> {
    Ok(RunOptions {
        services: env.services.clone(),
        object_store: config::object_store(object_store).map_err(|e| e.to_string())?,
        worker_id: format!("bench-{}", env.tag),
        kinds,
        relay: true,
        consumer: true,
        maintenance: false,
        leased: None,
        relay_cfg: RelayConfig {
            windows: p.windows.clone(),
            ..RelayConfig::default()
        },
        consumer_cfg: ConsumerConfig {
            prefetch: p.inflight,
            batch_max: p.batch_max,
            ..ConsumerConfig::default()
        },
        maintenance_cfg: MaintenanceConfig::default(),
        http_addr: None,
        admin_token: None,
        embedder: crate::embed::EmbedderConfig::Offline,
        // The offline reasoning model under the model limits the environment sets (the gate,
        // the per-document budget), so a run can show what they bound.
        reasoner: (
            crate::model::ReasonerConfig::Offline,
            crate::model::config(|k| std::env::var(k).ok())
                .map_err(|e| e.to_string())?
                .1,
        ),
        parser: Default::default(),
    })
}

/// Runs the real runtime in this process while `work` runs; stops it when `work` ends.
async fn with_runtime<T>(
    opts: RunOptions,
    work: impl Future<Output = Result<T, String>>,
) -> Result<T, String> {
    let shutdown = CancellationToken::new();
    let rt = runtime::run(opts, shutdown.clone());
    tokio::pin!(rt);
    tokio::pin!(work);
    tokio::select! {
        r = &mut rt => Err(match r {
            Ok(()) => "the runtime stopped before the scenario ended".to_owned(),
            Err(e) => format!("the runtime failed: {e:#}"),
        }),
        w = &mut work => {
            shutdown.cancel();
            if let Err(e) = (&mut rt).await {
                tracing::warn!(error = %e, "the runtime ended with an error");
            }
            w
        }
    }
}

/// Enqueues `n` one-step probe jobs in one commit.
async fn enqueue_probes(env: &BenchEnv, n: u64) -> Result<(), String> {
    probe::enqueue_many(&env.pool, n as i64, &ProbeSpec::default())
        .await
        .map(|_| ())
        .map_err(|e| format!("enqueue probe jobs: {e}"))
}

/// The real relay, with its default settings, over the probe kind of this scenario.
fn probe_relay(env: &BenchEnv) -> Relay {
    Relay::new(
        env.pool.clone(),
        env.topology.clone(),
        format!("bench-relay-{}", env.tag),
        RelayConfig::default(),
        &[Kind::Probe],
    )
}

/// Probe jobs in any of `states`.
async fn probe_jobs_in(pool: &PgPool, states: &[&str]) -> Result<u64, String> {
    sqlx::query_scalar::<_, i64>("SELECT count(*) FROM kfs_probe_jobs WHERE run_state = ANY($1)")
        .bind(states)
        .fetch_one(pool)
        .await
        .map(|c| c as u64)
        .map_err(|e| e.to_string())
}

/// Finished probe jobs (any terminal state).
async fn probe_finished(pool: &PgPool) -> Result<u64, String> {
    probe_jobs_in(pool, &["succeeded", "failed", "canceled"]).await
}

/// Enqueues `n` one-step probe jobs in one commit and waits until they are finished by whatever
/// workers run. Time: from Postgres' clock right after the enqueue committed to the last
/// job's `completed_at`.
async fn probe_batch(env: &BenchEnv, n: u64, label: &str, p: &Params) -> Result<Run, String> {
    enqueue_probes(env, n).await?;
    let t0 = env.db_now().await?;
    let cpu = CpuMeter::start();
    let progress = Progress::new(label, n, p.interactive);
    // The time comes from the jobs' own `completed_at`, not from this poll; polling once a
    // second keeps the observer's count over every job row from taking CPU from the run.
    let finished = wait_for(n, &progress, Duration::from_secs(1), || {
        probe_finished(&env.pool)
    })
    .await?;
    let busy = cpu.busy();
    progress.finish(finished);
    let (done, secs): (i64, Option<f64>) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE run_state = 'succeeded'), \
           extract(epoch FROM max(completed_at) - $1)::float8 FROM kfs_probe_jobs",
    )
    .bind(t0)
    .fetch_one(&env.pool)
    .await
    .map_err(|e| e.to_string())?;
    Ok(Run::new(
        label,
        n,
        done as u64,
        secs.unwrap_or(0.0).max(0.0),
        "jobs/s",
    )
    .with_cpu(busy))
}

/// A pool of `size` connections, and that size.
async fn inflight_pool(env: &BenchEnv, size: u32, name: &str) -> Result<(PgPool, u32), String> {
    let pool = db::connect(
        &env.services.database_url,
        name,
        size,
        env.services.connect_timeout,
    )
    .await
    .map_err(|e| e.to_string())?;
    Ok((pool, size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_size_follows_the_runtime_rule() {
        assert_eq!(engine_pool_size(16), 16);
        assert_eq!(engine_pool_size(1), 1);
        assert_eq!(engine_pool_size(64), 56);
    }
}
