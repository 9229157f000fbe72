//! The scenarios. Invariant: each one measures only its own fresh environment, counts what was
//! actually finished (never what was asked), and takes its times from one clock: the bench's
//! monotonic clock for the bare loops, Postgres' clock for jobs (created, claimed and completed
//! timestamps of the rows themselves).

use std::future::Future;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::env::BenchEnv;
use super::machine::CpuMeter;
use super::report::{Progress, Report, Run};
use super::stats;
use crate::config::{self, Services};
use crate::consumer::{ConsumerConfig, Engine};
use crate::engine::lease::DeliveryRef;
use crate::jobs::probe::{self, ProbeSpec};
use crate::jobs::{compile, deletion, research, Kind};
use crate::maintenance::MaintenanceConfig;
use crate::relay::{Relay, RelayConfig};
use crate::runtime::{self, RunOptions};
use crate::wire::OutboundMessage;
use crate::{db, platform, store::Store};

/// How long a scenario waits without a single job finishing before it reports what it has.
const STALL: Duration = Duration::from_secs(60);

/// The knobs every scenario shares.
#[derive(Clone, Debug)]
pub struct Params {
    pub jobs: u64,
    pub workers: u32,
    pub inflight: u16,
    pub latency_secs: u64,
    pub latency_rate: u32,
    pub kind_jobs: u32,
    pub interactive: bool,
}

/// The pool a `run` process gives itself for `kinds` kinds at `prefetch` (see `runtime::run`).
pub fn engine_pool_size(prefetch: u16, kinds: usize) -> u32 {
    (u32::from(prefetch) * kinds as u32 + 8).clamp(8, 64)
}

/// 1, 2, 4, … up to `max`, and `max` itself.
pub fn worker_counts(max: u32) -> Vec<u32> {
    let mut v: Vec<u32> = std::iter::successors(Some(1u32), |k| k.checked_mul(2))
        .take_while(|k| *k <= max)
        .collect();
    if max >= 1 && v.last() != Some(&max) {
        v.push(max);
    }
    v
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
    inflight: u16,
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
        relay_cfg: RelayConfig::default(),
        consumer_cfg: ConsumerConfig {
            prefetch: inflight,
            ..ConsumerConfig::default()
        },
        maintenance_cfg: MaintenanceConfig::default(),
        http_addr: None,
        admin_token: None,
        embedder: crate::embed::EmbedderConfig::Offline,
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

/// A pool of the size a one-kind worker gives itself at this in-flight count, and that size.
async fn inflight_pool(env: &BenchEnv, p: &Params, name: &str) -> Result<(PgPool, u32), String> {
    let size = engine_pool_size(p.inflight, 1);
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

/// 1. The bare loop: confirmed persistent publishes to a quorum queue, one autocommitted UPDATE
///    per delivery, then the ack; the same in-flight count and pool size as the engine.
pub async fn limit(env: &BenchEnv, p: &Params) -> Result<Report, String> {
    let n = p.jobs;
    let batch = RelayConfig::default().batch as usize;
    sqlx::raw_sql(
        "CREATE TABLE bench_limit (id BIGINT PRIMARY KEY, hits INTEGER NOT NULL DEFAULT 0)",
    )
    .execute(&env.pool)
    .await
    .map_err(|e| e.to_string())?;
    sqlx::query("INSERT INTO bench_limit (id) SELECT generate_series(1, $1::bigint)")
        .bind(n as i64)
        .execute(&env.pool)
        .await
        .map_err(|e| e.to_string())?;
    let (pool, pool_size) = inflight_pool(env, p, "kfs-worker bench limit").await?;
    let queue = format!("{}.limit", env.topology.prefix);
    let ch = env.channel().await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .map_err(|e| e.to_string())?;
    ch.basic_qos(p.inflight, BasicQosOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let mut consumer = ch
        .basic_consume(
            queue.as_str().into(),
            "bench-limit".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
    let acked = Arc::new(AtomicU64::new(0));
    let consuming = {
        let acked = acked.clone();
        let pool = pool.clone();
        tokio::spawn(async move {
            while let Some(Ok(d)) = consumer.next().await {
                let pool = pool.clone();
                let acked = acked.clone();
                tokio::spawn(async move {
                    let id: i64 = std::str::from_utf8(&d.data)
                        .ok()
                        .and_then(|s| s.parse().ok())
                        .unwrap_or(0);
                    loop {
                        let updated =
                            sqlx::query("UPDATE bench_limit SET hits = hits + 1 WHERE id = $1")
                                .bind(id)
                                .execute(&pool)
                                .await;
                        match updated {
                            Ok(_) => break,
                            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                        }
                    }
                    if d.ack(BasicAckOptions::default()).await.is_ok() {
                        acked.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        })
    };

    let publisher = env.confirm_channel().await?;
    let progress = Progress::new("limit", n, p.interactive);
    let cpu = CpuMeter::start();
    let started = Instant::now();
    let publishing = {
        let queue = queue.clone();
        async move {
            let mut confirmed = 0u64;
            let mut next = 1u64;
            while next <= n {
                let end = (next + batch as u64 - 1).min(n);
                let mut confirms = Vec::with_capacity(batch);
                for id in next..=end {
                    let c = publisher
                        .basic_publish(
                            "".into(),
                            queue.as_str().into(),
                            BasicPublishOptions {
                                mandatory: true,
                                ..Default::default()
                            },
                            id.to_string().as_bytes(),
                            lapin::BasicProperties::default().with_delivery_mode(2),
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
                next = end + 1;
            }
            let _ = publisher.close(200, "published".into()).await;
            Ok::<u64, String>(confirmed)
        }
    };
    let waiting = async {
        let mut last = 0;
        let mut moved = Instant::now();
        loop {
            let c = acked.load(Ordering::Relaxed);
            if c >= n {
                return started.elapsed();
            }
            if c != last {
                last = c;
                moved = Instant::now();
                progress.set(c);
            } else if moved.elapsed() > STALL {
                return started.elapsed();
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    let (published, elapsed) = tokio::join!(publishing, waiting);
    let busy = cpu.busy();
    let published = published?;
    let done = acked.load(Ordering::Relaxed);
    progress.finish(done);
    consuming.abort();
    let _ = ch.close(200, "done".into()).await;
    let updated: i64 = sqlx::query_scalar("SELECT count(*) FROM bench_limit WHERE hits > 0")
        .fetch_one(&env.pool)
        .await
        .map_err(|e| e.to_string())?;
    pool.close().await;
    let done = done.min(updated as u64).min(published);
    Ok(Report::single(
        "limit",
        Run::new("limit", n, done, elapsed.as_secs_f64(), "msg/s").with_cpu(busy),
        json!({"inflight": p.inflight, "pool": pool_size, "publish_batch": batch}),
    ))
}

/// Confirmed publishes of `n` messages shaped like the relay's, `batch` at a time.
async fn raw_publishes(
    env: &BenchEnv,
    ch: &lapin::Channel,
    n: u64,
    batch: usize,
    progress: &Progress,
) -> Result<u64, String> {
    let exchange = env.topology.exchange();
    let mut confirmed = 0u64;
    let mut sent = 0u64;
    while sent < n {
        let take = (n - sent).min(batch as u64);
        let mut confirms = Vec::with_capacity(batch);
        for _ in 0..take {
            let job = Uuid::now_v7();
            let msg = OutboundMessage {
                kind: Kind::Probe,
                outbox_id: Uuid::new_v4(),
                job_id: job,
                delivery_id: Uuid::new_v4().to_string(),
                revision: 1,
                schema_version: 1,
                traceparent: None,
                body: serde_json::to_vec(&json!({ "probeJobId": job })).unwrap_or_default(),
            };
            let c = ch
                .basic_publish(
                    exchange.as_str().into(),
                    Kind::Probe.event_type().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &msg.body,
                    msg.properties(),
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
        sent += take;
        progress.set(sent);
    }
    Ok(confirmed)
}

/// 2. The real relay over `n` pending outbox rows, then `n` raw confirmed publishes of the same
///    shape and batch size on the same channel.
pub async fn relay(env: &BenchEnv, p: &Params) -> Result<Report, String> {
    let n = p.jobs;
    enqueue_probes(env, n).await?;
    let relay = probe_relay(env);
    let batch = relay.config().batch;
    let ch = env.confirm_channel().await?;
    let queue = env.topology.queue(Kind::Probe);

    // The raw publisher runs before and after the relay, and the faster of the two is the
    // yardstick: the broker's speed drifts while its quorum queue compacts, and the ratio
    // should not flatter the relay when it does.
    let raw_before = raw_run(env, &ch, n, batch as usize, p, &queue).await?;

    let progress = Progress::new("relay", n, p.interactive);
    let cpu = CpuMeter::start();
    let started = Instant::now();
    let dispatched = relay
        .drain(&ch, Kind::Probe)
        .await
        .map_err(|e| format!("relay: {e}"))?
        .dispatched as u64;
    let relay_secs = started.elapsed().as_secs_f64();
    let relay_cpu = cpu.busy();
    progress.finish(dispatched);
    ch.queue_purge(queue.as_str().into(), QueuePurgeOptions::default())
        .await
        .map_err(|e| e.to_string())?;

    let raw_after = raw_run(env, &ch, n, batch as usize, p, &queue).await?;
    let _ = ch.close(200, "done".into()).await;
    let alone = relay_statements(env, &relay, n, p).await?;

    let raw = if raw_after.rate >= raw_before.rate {
        raw_after.clone()
    } else {
        raw_before.clone()
    };
    let mut r = Report::single(
        "relay",
        Run::new("relay", n, dispatched, relay_secs, "rows/s").with_cpu(relay_cpu),
        json!({
            "batch": batch,
            "depth": relay.config().depth,
            "raw_before": raw_before.rate,
            "raw_after": raw_after.rate,
        }),
    );
    r.ratio = (raw.rate > 0.0).then(|| r.rate / raw.rate);
    r.ratio_to = Some("raw".into());
    r.ratio_ceiling = cpu_ceiling(&[alone.cpu_ms, raw.cpu_ms])
        .filter(|_| raw.rate > 0.0)
        .map(|c| c / raw.rate);
    r.runs.push(Run {
        label: "raw publishes (best of 2)".into(),
        ..raw
    });
    r.runs.push(alone);
    Ok(r)
}

/// The relay's Postgres work alone, as a ceiling for the relay in this run: `n` more pending
/// rows claimed and marked dispatched by the same statements, `depth` rounds at once, with
/// nothing published. The relay does this and the publishing on the same cores.
async fn relay_statements(
    env: &BenchEnv,
    relay: &Relay,
    n: u64,
    p: &Params,
) -> Result<Run, String> {
    enqueue_probes(env, n).await?;
    let cfg = relay.config();
    let progress = Progress::new("relay statements", n, p.interactive);
    let marked = AtomicU64::new(0);
    let cpu = CpuMeter::start();
    let started = Instant::now();
    let rounds = (0..cfg.depth.max(1)).map(|_| async {
        loop {
            let m = relay
                .claim_and_mark_without_publishing(Kind::Probe)
                .await
                .map_err(|e| format!("relay statements: {e}"))?;
            progress.set(marked.fetch_add(m as u64, Ordering::Relaxed) + m as u64);
            if m < cfg.batch as usize {
                return Ok::<(), String>(());
            }
        }
    });
    futures_util::future::try_join_all(rounds).await?;
    let secs = started.elapsed().as_secs_f64();
    let busy = cpu.busy();
    let done = marked.load(Ordering::Relaxed);
    progress.finish(done);
    Ok(Run::new(
        "relay statements alone (no broker)",
        n,
        done,
        secs,
        "rows/s",
    )
    .with_cpu(busy))
}

/// `n` raw confirmed publishes of the relay's messages, then a purge.
async fn raw_run(
    env: &BenchEnv,
    ch: &lapin::Channel,
    n: u64,
    batch: usize,
    p: &Params,
    queue: &str,
) -> Result<Run, String> {
    let progress = Progress::new("raw publishes", n, p.interactive);
    let cpu = CpuMeter::start();
    let started = Instant::now();
    let raw = raw_publishes(env, ch, n, batch, &progress).await?;
    let raw_secs = started.elapsed().as_secs_f64();
    let busy = cpu.busy();
    progress.finish(raw);
    ch.queue_purge(queue.into(), QueuePurgeOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    Ok(Run::new("raw confirmed publishes", n, raw, raw_secs, "msg/s").with_cpu(busy))
}

/// 3. `n` one-step probe jobs through the whole protocol in one `run` runtime in this process.
pub async fn engine(env: &BenchEnv, p: &Params, limit: Option<f64>) -> Result<Report, String> {
    let opts = run_options(env, vec![Kind::Probe], p.inflight, "memory://")?;
    let queue = env.topology.queue(Kind::Probe);
    let run = with_runtime(opts, async {
        env.wait_consumers(&queue, 1, Duration::from_secs(60))
            .await?;
        probe_batch(env, p.jobs, "engine", p).await
    })
    .await?;
    let mut r = Report::single(
        "engine",
        run,
        json!({"inflight": p.inflight, "pool": engine_pool_size(p.inflight, 1), "relay_batch": RelayConfig::default().batch}),
    );
    r.against(limit.unwrap_or(0.0), "limit");
    Ok(r)
}

/// 3b. The engine's Postgres work alone, as a ceiling for the engine in this run. The same `n`
///     one-step probe jobs are published by the real relay (its messages are then purged), and
///     each is claimed and run through `Engine::process_ref`, the consumer's own code on its own
///     connection, `inflight` at a time, with no broker in the loop. The engine does all of this
///     plus the relay's statements and the broker's publish, delivery and ack on the same cores,
///     so it cannot go faster than this; its ratio to `limit` bounds the engine's.
pub async fn statements(env: &BenchEnv, p: &Params, limit: Option<f64>) -> Result<Report, String> {
    let n = p.jobs;
    enqueue_probes(env, n).await?;
    let relay = probe_relay(env);
    let ch = env.confirm_channel().await?;
    relay
        .drain(&ch, Kind::Probe)
        .await
        .map_err(|e| format!("relay: {e}"))?;
    ch.queue_purge(
        env.topology.queue(Kind::Probe).as_str().into(),
        QueuePurgeOptions::default(),
    )
    .await
    .map_err(|e| e.to_string())?;
    let _ = ch.close(200, "done".into()).await;
    // What each message would have carried: the job, its outbox row and the delivery id.
    let refs: Vec<(Uuid, Uuid, String)> = sqlx::query_as(
        "SELECT probe_job_id, id, queue_job_id FROM kfs_probe_outbox \
         WHERE status = 'dispatched' ORDER BY available_at, id",
    )
    .fetch_all(&env.pool)
    .await
    .map_err(|e| e.to_string())?;

    let (pool, size) = inflight_pool(env, p, "kfs-worker bench statements").await?;
    let engine = Engine::new(
        pool.clone(),
        format!("bench-{}", env.tag),
        vec![Arc::new(probe::ProbeHandler)],
        ConsumerConfig {
            prefetch: p.inflight,
            ..ConsumerConfig::default()
        },
    );
    let shutdown = CancellationToken::new();
    let progress = Progress::new("statements", n, p.interactive);
    let handled = AtomicU64::new(0);
    let cpu = CpuMeter::start();
    let started = Instant::now();
    futures_util::stream::iter(refs)
        .for_each_concurrent(
            usize::from(p.inflight),
            |(job_id, outbox_id, delivery_id)| {
                let (engine, shutdown, handled, progress) =
                    (&engine, &shutdown, &handled, &progress);
                async move {
                    let d = DeliveryRef {
                        kind: Kind::Probe,
                        job_id,
                        outbox_id,
                        delivery_id,
                    };
                    engine.process_ref(&d, shutdown).await;
                    progress.set(handled.fetch_add(1, Ordering::Relaxed) + 1);
                }
            },
        )
        .await;
    let secs = started.elapsed().as_secs_f64();
    let busy = cpu.busy();
    pool.close().await;
    // Counted from the rows, not from what the engine answered.
    let done = probe_jobs_in(&env.pool, &["succeeded"]).await?;
    progress.finish(done);
    let mut r = Report::single(
        "statements",
        Run::new("statements", n, done, secs, "jobs/s").with_cpu(busy),
        json!({"inflight": p.inflight, "pool": size}),
    );
    r.against(limit.unwrap_or(0.0), "limit");
    Ok(r)
}

/// The most items per second the machine's cores allow for work that needs each of `parts`
/// (busy CPU milliseconds per item, measured in this run) done once per item: every core busy
/// all the time, and no part any cheaper than when it ran on its own.
fn cpu_ceiling(parts: &[Option<f64>]) -> Option<f64> {
    let cores = std::thread::available_parallelism().ok()?.get() as f64;
    let per_item_ms: f64 = parts.iter().copied().sum::<Option<f64>>()?;
    (per_item_ms > 0.0).then(|| cores * 1000.0 / per_item_ms)
}

/// 4. Jobs created one per commit at a steady rate; latency from the creating transaction to
///    the claim and to completion, from the job rows' own timestamps.
pub async fn latency(env: &BenchEnv, p: &Params) -> Result<Report, String> {
    let total = p.latency_secs * u64::from(p.latency_rate);
    let opts = run_options(env, vec![Kind::Probe], p.inflight, "memory://")?;
    let queue = env.topology.queue(Kind::Probe);
    let (offered_secs, finished) = with_runtime(opts, async {
        env.wait_consumers(&queue, 1, Duration::from_secs(60))
            .await?;
        let progress = Progress::new("latency", total, p.interactive);
        let mut tick =
            tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(p.latency_rate)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        // Each job is its own commit, started on its tick whether or not the previous commit
        // has returned: the offered rate does not depend on how fast one connection commits.
        let mut creating = tokio::task::JoinSet::new();
        let started = Instant::now();
        for i in 0..total {
            tick.tick().await;
            let pool = env.pool.clone();
            creating.spawn(async move {
                let mut conn = pool.acquire().await?;
                probe::enqueue(&mut conn, &ProbeSpec::default()).await
            });
            while let Some(done) = creating.try_join_next() {
                done.map_err(|e| e.to_string())?
                    .map_err(|e| format!("enqueue: {e}"))?;
            }
            if i % 50 == 0 {
                progress.set(i);
            }
        }
        while let Some(done) = creating.join_next().await {
            done.map_err(|e| e.to_string())?
                .map_err(|e| format!("enqueue: {e}"))?;
        }
        let offered = started.elapsed().as_secs_f64();
        let finished = wait_for(total, &progress, Duration::from_millis(100), || {
            probe_finished(&env.pool)
        })
        .await?;
        progress.finish(finished);
        Ok((offered, finished))
    })
    .await?;
    let samples: Vec<(f64, f64)> = sqlx::query_as(
        "SELECT (extract(epoch FROM started_at - created_at) * 1000)::float8, \
           (extract(epoch FROM completed_at - created_at) * 1000)::float8 \
         FROM kfs_probe_jobs WHERE run_state = 'succeeded'",
    )
    .fetch_all(&env.pool)
    .await
    .map_err(|e| e.to_string())?;
    let claim: Vec<f64> = samples.iter().map(|s| s.0).collect();
    let done: Vec<f64> = samples.iter().map(|s| s.1).collect();
    let mut r = Report::single(
        "latency",
        Run::new(
            "latency",
            total,
            samples.len() as u64,
            offered_secs,
            "jobs/s",
        ),
        json!({"target_rate": p.latency_rate, "secs": p.latency_secs, "inflight": p.inflight, "finished": finished}),
    );
    r.to_claim_ms = stats::summarize(&claim);
    r.to_done_ms = stats::summarize(&done);
    Ok(r)
}

const TENANT: &str = "kfs-bench";
const SUBJECT: &str = "bench-user";

/// Counts `(succeeded, finished)` of `ids` in a job table.
async fn kind_progress(pool: &PgPool, sql: &str, ids: &[Uuid]) -> Result<(u64, u64), String> {
    let (ok, fin): (i64, i64) = sqlx::query_as(sql)
        .bind(ids)
        .fetch_one(pool)
        .await
        .map_err(|e| e.to_string())?;
    Ok((ok as u64, fin as u64))
}

async fn wait_kind(
    env: &BenchEnv,
    label: &'static str,
    sql: &str,
    ids: &[Uuid],
    started: Instant,
    p: &Params,
) -> Result<Run, String> {
    let n = ids.len() as u64;
    let progress = Progress::new(label, n, p.interactive);
    let finished = wait_for(n, &progress, Duration::from_millis(20), || async {
        kind_progress(&env.pool, sql, ids).await.map(|c| c.1)
    })
    .await?;
    let secs = started.elapsed().as_secs_f64();
    progress.finish(finished);
    let (ok, _) = kind_progress(&env.pool, sql, ids).await?;
    Ok(Run::new(label, n, ok, secs, "jobs/s"))
}

/// 5. The platform's kinds: compiles of small Markdown documents, research tasks over the
///    compiled space, and deletions of single documents, each requested at once and timed
///    from the first request to the last finished job.
pub async fn kinds(env: &BenchEnv, p: &Params) -> Result<Report, String> {
    let k = p.kind_jobs;
    let dir = std::env::temp_dir().join(format!("kfs-bench-{}", env.tag));
    std::fs::create_dir_all(&dir).map_err(|e| format!("object store directory: {e}"))?;
    let store_url = format!("file://{}", dir.display());
    let store = Store::open(&config::object_store(&store_url).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let kinds = Kind::platform();
    let opts = run_options(env, kinds.clone(), p.inflight, &store_url)?;
    let queues: Vec<String> = kinds.iter().map(|k| env.topology.queue(*k)).collect();

    let (space, snapshot, docs) = {
        let mut tx = env.pool.begin().await.map_err(|e| e.to_string())?;
        let notes =
            platform::create_notes_space(&mut tx, &store, TENANT, SUBJECT, "bench", k as usize)
                .await
                .map_err(|e| e.to_string())?;
        tx.commit().await.map_err(|e| e.to_string())?;
        (notes.space, notes.snapshot, notes.documents)
    };

    let runs = with_runtime(opts, async {
        for q in &queues {
            env.wait_consumers(q, 1, Duration::from_secs(60)).await?;
        }
        let mut conn = env.pool.acquire().await.map_err(|e| e.to_string())?;

        let started = Instant::now();
        let mut attempts = Vec::new();
        for doc in &docs {
            let id = compile::request::request(
                &mut conn,
                *doc,
                compile::request::RequestOptions::default(),
            )
            .await
            .map_err(|e| format!("compile request: {e}"))?;
            attempts.push(id);
        }
        let compiled = wait_kind(
            env,
            "compile",
            "SELECT count(*) FILTER (WHERE run_state = 'succeeded'), \
               count(*) FILTER (WHERE run_state IN ('succeeded', 'failed', 'canceled', 'superseded')) \
             FROM document_compilation_attempts WHERE id = ANY($1)",
            &attempts,
            started,
            p,
        )
        .await?;

        let started = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..k {
            let req = research::request::ResearchRequest::new(
                space,
                format!("How does note {i} describe leases and fencing of workers?"),
                SUBJECT,
                snapshot,
            );
            let r = research::request::request(&mut conn, &req)
                .await
                .map_err(|e| format!("research request: {e}"))?;
            tasks.push(r.job_id);
        }
        let researched = wait_kind(
            env,
            "research",
            "SELECT count(*) FILTER (WHERE stage = 'completed'), \
               count(*) FILTER (WHERE stage IN ('completed', 'failed', 'canceled')) \
             FROM research_task_jobs WHERE id = ANY($1)",
            &tasks,
            started,
            p,
        )
        .await?;

        let started = Instant::now();
        let mut deletions = Vec::new();
        for doc in &docs {
            let req = deletion::request::DeletionRequest {
                tenant_id: TENANT.into(),
                knowledge_space_id: space,
                target: deletion::request::Target::Document { id: *doc },
                expected_revision: None,
                requested_by_subject_id: SUBJECT.into(),
                permission_snapshot_id: snapshot,
                access_channel: "interactive".into(),
                idempotency_key: format!("bench-delete-{doc}"),
            };
            let r = deletion::request::request_deletion(&mut conn, &req)
                .await
                .map_err(|e| format!("deletion request: {e}"))?;
            deletions.push(r.job_id);
        }
        let deleted = wait_kind(
            env,
            "deletion",
            "SELECT count(*) FILTER (WHERE run_state = 'succeeded'), \
               count(*) FILTER (WHERE run_state IN ('succeeded', 'failed', 'canceled')) \
             FROM deletion_jobs WHERE id = ANY($1)",
            &deletions,
            started,
            p,
        )
        .await?;
        Ok(vec![compiled, researched, deleted])
    })
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Report::of_runs(
        "kinds",
        "jobs/s",
        runs?,
        json!({"documents": k, "inflight": p.inflight}),
    ))
}

/// A `kfs-worker run` child process of this executable.
struct WorkerProcess {
    child: Child,
    log: std::path::PathBuf,
}

impl WorkerProcess {
    fn spawn(services: &Services, id: &str, inflight: u16) -> Result<WorkerProcess, String> {
        let exe = std::env::current_exe().map_err(|e| format!("own executable: {e}"))?;
        let log = std::env::temp_dir().join(format!("{id}.log"));
        let file = std::fs::File::create(&log).map_err(|e| format!("log file: {e}"))?;
        let child = Command::new(exe)
            .args(["run", "--kinds", "probe"])
            .env("DATABASE_URL", services.database_url.expose())
            .env("AMQP_URL", services.amqp_url.expose())
            .env("KFS_QUEUE_PREFIX", &services.queue_prefix)
            .env("KFS_WORKER_ID", id)
            .env("KFS_PREFETCH", inflight.to_string())
            .env("KFS_HTTP_ADDR", "off")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .map_err(|e| format!("start a worker process: {e}"))?;
        Ok(WorkerProcess { child, log })
    }

    /// SIGTERM, a clean exit within 30 s, or SIGKILL.
    fn stop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                let _ = std::fs::remove_file(&self.log);
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.stop();
        }
    }
}

/// 6. The engine scenario with 1, 2, 4, … worker processes, each a fresh environment.
pub async fn scaleout(base: &Services, p: &Params) -> Result<Report, String> {
    let mut runs = Vec::new();
    for k in worker_counts(p.workers) {
        let env = BenchEnv::new(base, "scaleout").await?;
        let result = async {
            let mut workers = Vec::new();
            for i in 0..k {
                workers.push(WorkerProcess::spawn(
                    &env.services,
                    &format!("kfs-bench-{}-w{i}", env.tag),
                    p.inflight,
                )?);
            }
            let queue = env.topology.queue(Kind::Probe);
            if let Err(e) = env.wait_consumers(&queue, k, Duration::from_secs(60)).await {
                let logs: Vec<String> = workers
                    .iter()
                    .map(|w| w.log.display().to_string())
                    .collect();
                return Err(format!("{e} (worker logs: {})", logs.join(", ")));
            }
            let label = format!("{k} worker{}", if k == 1 { "" } else { "s" });
            let run = probe_batch(&env, p.jobs, &label, p).await;
            for w in &mut workers {
                w.stop();
            }
            run
        }
        .await;
        env.cleanup().await;
        runs.push(result?);
    }
    let first = runs.first().map_or(0.0, |r| r.rate);
    let last = runs.last().cloned().unwrap_or_default();
    let mut r = Report::single(
        "scaleout",
        Run::new("scaleout", last.n, last.done, last.secs, "jobs/s"),
        json!({"inflight_per_worker": p.inflight, "workers": worker_counts(p.workers)}),
    );
    if runs.len() > 1 {
        r.against(first, "1 worker");
    }
    r.n = runs.iter().map(|x| x.n).sum();
    r.done = runs.iter().map(|x| x.done).sum();
    r.runs = runs;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_ceiling_spreads_the_parts_over_every_core() {
        let cores = std::thread::available_parallelism().unwrap().get() as f64;
        // 0.5 ms + 1.5 ms of CPU per item: each core does 500 items a second.
        assert_eq!(cpu_ceiling(&[Some(0.5), Some(1.5)]), Some(cores * 500.0));
        assert_eq!(cpu_ceiling(&[Some(0.5), None]), None, "a part not measured");
        assert_eq!(cpu_ceiling(&[Some(0.0)]), None, "no CPU measured");
    }

    #[test]
    fn worker_counts_table() {
        for (max, want) in [
            (1, vec![1]),
            (2, vec![1, 2]),
            (3, vec![1, 2, 3]),
            (4, vec![1, 2, 4]),
            (6, vec![1, 2, 4, 6]),
            (8, vec![1, 2, 4, 8]),
            (0, vec![]),
        ] {
            assert_eq!(worker_counts(max), want, "max {max}");
        }
    }

    #[test]
    fn pool_size_follows_the_runtime_rule() {
        assert_eq!(engine_pool_size(16, 1), 24);
        assert_eq!(engine_pool_size(1, 1), 9);
        assert_eq!(engine_pool_size(64, 3), 64);
    }
}
