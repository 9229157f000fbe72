//! Scenario 2, `relay`: the real relay next to raw confirmed publishes of the same messages, and
//! the relay's Postgres work alone. Invariant: the relay and its yardsticks publish the same shape,
//! batch size and count on the same channel, and the yardstick is the faster of the raw runs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use lapin::options::QueuePurgeOptions;
use serde_json::json;
use uuid::Uuid;

use super::{enqueue_probes, probe_relay, publish_confirmed, Params};
use crate::engine::wire::OutboundMessage;
use crate::jobs::Kind;
use crate::relay::Relay;
use crate::tools::bench::env::BenchEnv;
use crate::tools::bench::machine::CpuMeter;
use crate::tools::bench::report::{cpu_ceiling, Progress, Report, Run};

/// Confirmed publishes of `n` messages shaped like the relay's, `batch` at a time.
async fn raw_publishes(
    env: &BenchEnv,
    ch: &lapin::Channel,
    n: u64,
    batch: usize,
    progress: &Progress,
) -> Result<u64, String> {
    let exchange = env.topology.exchange();
    let route = Kind::Probe.event_type();
    publish_confirmed(
        ch,
        &exchange,
        route,
        n,
        batch as u64,
        Some(progress),
        |_| {
            let job = Uuid::now_v7();
            let msg = OutboundMessage {
                kind: Kind::Probe,
                event_type: route,
                outbox_id: Uuid::new_v4(),
                job_id: job,
                delivery_id: Uuid::new_v4().to_string(),
                revision: 1,
                schema_version: 1,
                traceparent: None,
                body: serde_json::to_vec(&json!({ "probeJobId": job })).unwrap_or_default(),
            };
            (msg.properties(), msg.body)
        },
    )
    .await
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
    r.floor_cpu_ms = [alone.cpu_ms, raw.cpu_ms].into_iter().sum();
    r.ratio_ceiling = cpu_ceiling(&[r.floor_cpu_ms])
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
