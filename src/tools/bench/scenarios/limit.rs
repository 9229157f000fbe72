//! Scenario 1, `limit`: the bare loop the engine is compared with: confirmed persistent publishes
//! to a quorum queue, one autocommitted UPDATE per delivery, then the ack. Invariant: it gets the
//! same in-flight count and pool size as the engine, and its count of done messages is the least of
//! those confirmed, updated and acked.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use serde_json::json;

use super::{inflight_pool, publish_confirmed, Params, STALL};
use crate::relay::RelayConfig;
use crate::tools::bench::env::BenchEnv;
use crate::tools::bench::machine::CpuMeter;
use crate::tools::bench::report::{Progress, Report, Run};

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
    let (pool, pool_size) = inflight_pool(
        env,
        (u32::from(p.inflight) + 8).min(64),
        "kfs-worker bench limit",
    )
    .await?;
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
            let confirmed =
                publish_confirmed(&publisher, "", &queue, n, batch as u64, None, |id| {
                    (
                        lapin::BasicProperties::default().with_delivery_mode(2),
                        id.to_string().into_bytes(),
                    )
                })
                .await?;
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
