//! Scenarios 3, 3b and 4 (`engine`, `statements`, `latency`): probe jobs through the engine in this
//! process: the whole protocol in one `run` runtime, the engine's Postgres work alone, and latency
//! at a steady offered rate. Invariant: a job counts as done only when its row says `succeeded`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::QueuePurgeOptions;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{
    engine_pool_size, enqueue_probes, inflight_pool, probe_batch, probe_finished, probe_jobs_in,
    probe_relay, run_options, wait_for, with_runtime, Params,
};
use crate::consumer::{ConsumerConfig, Engine};
use crate::engine::lease::DeliveryRef;
use crate::jobs::probe::{self, ProbeSpec};
use crate::jobs::Kind;
use crate::relay::RelayConfig;
use crate::tools::bench::env::BenchEnv;
use crate::tools::bench::machine::CpuMeter;
use crate::tools::bench::report::{Progress, Report, Run};
use crate::tools::bench::stats;

/// 3. `n` one-step probe jobs through the whole protocol in one `run` runtime in this process.
pub async fn engine(env: &BenchEnv, p: &Params, limit: Option<f64>) -> Result<Report, String> {
    let opts = run_options(env, vec![Kind::Probe], p, "memory://")?;
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
        json!({"inflight": p.inflight, "batch_max": p.batch_max, "pool": engine_pool_size(p.inflight), "relay_batch": RelayConfig::default().batch}),
    );
    r.against(limit.unwrap_or(0.0), "limit");
    Ok(r)
}

/// 3b. The engine's Postgres work alone, as a ceiling for the engine in this run. The same `n`
///     one-step probe jobs are published by the real relay (its messages are then purged), and
///     the jobs are claimed and run through `Engine::process_refs`, the consumer's own code, in
///     batches as the consumer forms them, `inflight` at a time, with no broker in the loop. The
///     engine does all of this plus the relay's statements and the broker's publish, delivery
///     and ack on the same cores, so this CPU per job, with the relay's, gives the engine's
///     ceiling in the same run (`SameRun::engine_ceiling` in the bench's `mod.rs`).
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

    let (pool, size) = inflight_pool(
        env,
        engine_pool_size(p.inflight),
        "kfs-worker bench statements",
    )
    .await?;
    let engine = Engine::new(
        pool.clone(),
        format!("bench-{}", env.tag),
        vec![Arc::new(probe::ProbeHandler)],
        ConsumerConfig {
            prefetch: p.inflight,
            batch_max: p.batch_max,
            ..ConsumerConfig::default()
        },
    );
    let shutdown = CancellationToken::new();
    let progress = Progress::new("statements", n, p.interactive);
    let handled = AtomicU64::new(0);
    let cpu = CpuMeter::start();
    let started = Instant::now();
    // As the consumer takes them: batches of up to `batch_max`, `inflight` deliveries at once.
    let batch = usize::from(p.batch_max.max(1));
    let batches: Vec<Vec<DeliveryRef>> = refs
        .chunks(batch)
        .map(|c| {
            c.iter()
                .map(|(job_id, outbox_id, delivery_id)| DeliveryRef {
                    kind: Kind::Probe,
                    job_id: *job_id,
                    outbox_id: *outbox_id,
                    delivery_id: delivery_id.clone(),
                })
                .collect()
        })
        .collect();
    futures_util::stream::iter(batches)
        .for_each_concurrent((usize::from(p.inflight) / batch).max(1), |refs| {
            let (engine, shutdown, handled, progress) = (&engine, &shutdown, &handled, &progress);
            async move {
                engine.process_refs(&refs, shutdown).await;
                progress.set(
                    handled.fetch_add(refs.len() as u64, Ordering::Relaxed) + refs.len() as u64,
                );
            }
        })
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
        json!({"inflight": p.inflight, "batch_max": p.batch_max, "pool": size}),
    );
    r.against(limit.unwrap_or(0.0), "limit");
    Ok(r)
}

/// 4. Jobs created one per commit at a steady rate; latency from the creating transaction to
///    the claim and to completion, from the job rows' own timestamps.
pub async fn latency(env: &BenchEnv, p: &Params) -> Result<Report, String> {
    let total = p.latency_secs * u64::from(p.latency_rate);
    let opts = run_options(env, vec![Kind::Probe], p, "memory://")?;
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
