//! The fault driver: supervises the processes (replacing the dead, arming kill points), injects
//! one fault at a time, plays the long outages, samples the soak measures and drains the run.

use super::channel_close::close_a_channel;
use super::database::{count, db_now, held_by, terminate_worker_sessions};
use super::record::{clock_ticks, cpu_ticks, rss_kb, Sample, Takeover};
use super::*;

/// Waits, replacing dead processes, until every job is terminal (at most 240 s): whether they
/// all were, and how long it took in seconds.
pub(super) async fn drain(cluster: &mut Cluster, rec: &mut Record, pool: &PgPool) -> (bool, f64) {
    let drain_start = Instant::now();
    while drain_start.elapsed() < Duration::from_secs(240) {
        supervise_unarmed(cluster, rec, pool).await;
        let open = count(pool, "SELECT count(*) FROM kfs_probe_jobs WHERE run_state NOT IN ('succeeded', 'failed', 'canceled')").await
            + platform::open(pool).await;
        if open == 0 {
            return (true, drain_start.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    (false, drain_start.elapsed().as_secs_f64())
}

pub(super) async fn queue_depths(amqp_url: &str, topology: &Topology) -> (u32, u32) {
    let Ok(conn) =
        lapin::Connection::connect(amqp_url, lapin::ConnectionProperties::default()).await
    else {
        return (u32::MAX, u32::MAX);
    };
    // (every job queue summed, the dead letters); a queue that cannot be read counts as full.
    let mut out = [0u32; 2];
    let queues = KINDS
        .iter()
        .map(|k| (0, topology.queue(*k)))
        .chain([(1, topology.dead_letter_queue())]);
    for (i, q) in queues {
        let mut depth = u32::MAX;
        if let Ok(ch) = conn.create_channel().await {
            if let Ok(q) = ch
                .queue_declare(
                    q.as_str().into(),
                    lapin::options::QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    lapin::types::FieldTable::default(),
                )
                .await
            {
                depth = q.message_count();
            }
        }
        out[i] = out[i].saturating_add(depth);
    }
    let _ = conn.close(200, "bye".into()).await;
    (out[0], out[1])
}

pub(super) async fn sample(
    cluster: &Cluster,
    pool: &PgPool,
    mq: &Arc<PrivateRabbit>,
    pg_proxy: &Proxy,
    mq_proxy: &Proxy,
    since: Instant,
) -> Sample {
    let mq2 = mq.clone();
    let mq_connections = tokio::task::spawn_blocking(move || mq2.connections())
        .await
        .unwrap();
    Sample {
        mq_connections,
        accepted: (pg_proxy.accepted(), mq_proxy.accepted()),
        at_s: since.elapsed().as_secs(),
        rss_kb: cluster
            .slots
            .iter()
            .filter(|s| s.witness)
            .map(|s| (s.worker_id.clone(), rss_kb(s.worker.pid()).unwrap_or(0)))
            .collect(),
        pg_sessions: sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name LIKE 'kfs-worker%'",
        )
        .bind(DB)
        .fetch_one(pool)
        .await
        .unwrap_or(-1),
        pg_proxy_open: pg_proxy.open_connections(),
        mq_proxy_open: mq_proxy.open_connections(),
    }
}

/// Notices dead processes, records why they died and what they held, and replaces them; the
/// new generation is armed at a random kill point half of the time (never the witnesses).
pub(super) async fn supervise(
    cluster: &mut Cluster,
    rec: &mut Record,
    pool: &PgPool,
    rng: &mut StdRng,
) {
    for i in 0..cluster.slots.len() {
        if !reap(cluster, rec, pool, i).await {
            continue;
        }
        let s = &cluster.slots[i];
        let armed = (!s.witness && rng.random_bool(0.5)).then(|| {
            let points: &[&str] = match s.role {
                Role::Consumer => &CONSUMER_POINTS,
                Role::Relay => &RELAY_POINTS,
            };
            format!(
                "{}:{}",
                points[rng.random_range(0..points.len())],
                rng.random_range(1..=15)
            )
        });
        cluster.respawn(i, armed);
    }
}

/// As [`supervise`], with nothing armed: the recovery phase.
pub(super) async fn supervise_unarmed(cluster: &mut Cluster, rec: &mut Record, pool: &PgPool) {
    for i in 0..cluster.slots.len() {
        if reap(cluster, rec, pool, i).await {
            cluster.respawn(i, None);
        }
    }
}

/// Whether slot `i`'s process has died (and is now accounted for).
async fn reap(cluster: &mut Cluster, rec: &mut Record, pool: &PgPool, i: usize) -> bool {
    let s = &mut cluster.slots[i];
    let Ok(Some(_)) = s.worker.child.try_wait() else {
        return false;
    };
    cluster
        .ended
        .entry(s.worker_id.clone())
        .or_insert_with(Utc::now);
    if s.killed {
        return true;
    }
    let log = s.worker.log_text();
    let point = s.armed.as_ref().and_then(|a| a.split(':').next());
    match point {
        Some(point) if log.contains(&format!("crash point {point} reached")) => {
            *rec.crash_points.entry(point.to_owned()).or_default() += 1;
            rec.fault("kill point (abort)");
        }
        _ => {
            rec.fault("process exited by itself");
            let status = s.worker.child.try_wait().ok().flatten();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(3)..].join(" | ");
            rec.notes.push(format!(
                "{} exited by itself ({status:?}): {tail}",
                s.worker_id
            ));
        }
    }
    if let Some((at, jobs)) = held_by(pool, &s.worker_id).await {
        if !jobs.is_empty() {
            rec.takeovers.push(Takeover { at, jobs });
        }
    }
    true
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn inject(
    cluster: &mut Cluster,
    rec: &mut Record,
    pool: &PgPool,
    pg: &Arc<PrivatePostgres>,
    mq: &Arc<PrivateRabbit>,
    pg_proxy: &Proxy,
    mq_proxy: &Proxy,
    rng: &mut StdRng,
) {
    let victims: Vec<usize> = (0..cluster.slots.len())
        .filter(|&i| !cluster.slots[i].witness)
        .collect();
    let roll = rng.random_range(0..110);
    match roll {
        100.. => close_a_channel(cluster, rec, rng).await,
        0..=24 => {
            let i = victims[rng.random_range(0..victims.len())];
            let s = &mut cluster.slots[i];
            let held = held_by(pool, &s.worker_id).await;
            s.worker.kill();
            s.killed = true;
            cluster.ended.insert(s.worker_id.clone(), Utc::now());
            rec.fault(match s.role {
                Role::Consumer => "SIGKILL consumer",
                Role::Relay => "SIGKILL relay",
            });
            if let Some((at, jobs)) = held {
                if !jobs.is_empty() {
                    rec.takeovers.push(Takeover { at, jobs });
                }
            }
        }
        25..=37 => {
            // Paused past its lease: others take its jobs; when it wakes it must be fenced out.
            let consumers: Vec<usize> = victims
                .iter()
                .copied()
                .filter(|&i| cluster.slots[i].role == Role::Consumer)
                .collect();
            let i = consumers[rng.random_range(0..consumers.len())];
            let held = held_by(pool, &cluster.slots[i].worker_id).await;
            cluster.slots[i].worker.signal("STOP");
            cluster.slots[i].stopped = true;
            rec.fault("SIGSTOP past the lease, then SIGCONT");
            if let Some((at, jobs)) = held {
                if !jobs.is_empty() {
                    rec.takeovers.push(Takeover { at, jobs });
                }
            }
            tokio::time::sleep(Duration::from_millis(rng.random_range(5000..=8000))).await;
            cluster.slots[i].worker.signal("CONT");
            cluster.slots[i].stopped = false;
        }
        38..=47 => {
            let n = terminate_worker_sessions(pool).await;
            rec.fault("pg_terminate_backend of worker sessions");
            let _ = n;
        }
        48..=57 => {
            let ms = rng.random_range(50..=400);
            let target = if rng.random_bool(0.5) {
                (pg_proxy, "postgres")
            } else {
                (mq_proxy, "rabbitmq")
            };
            target.0.set_latency(ms);
            rec.fault(&format!("latency ({})", target.1));
            tokio::time::sleep(Duration::from_millis(rng.random_range(2000..=5000))).await;
            target.0.set_latency(0);
        }
        58..=67 => {
            let target = if rng.random_bool(0.5) {
                (pg_proxy, "postgres")
            } else {
                (mq_proxy, "rabbitmq")
            };
            target.0.cut_all();
            rec.fault(&format!("connections cut ({})", target.1));
        }
        68..=77 => {
            let target = if rng.random_bool(0.5) {
                (pg_proxy, "postgres")
            } else {
                (mq_proxy, "rabbitmq")
            };
            target.0.set_hold(true);
            rec.fault(&format!("half-open connections ({})", target.1));
            tokio::time::sleep(Duration::from_millis(rng.random_range(3000..=8000))).await;
            if rng.random_bool(0.5) {
                target.0.cut_all();
            }
            target.0.set_hold(false);
        }
        78..=88 => {
            let down = Duration::from_millis(rng.random_range(1000..=5000));
            let mq2 = mq.clone();
            tokio::task::spawn_blocking(move || {
                mq2.stop_app();
                std::thread::sleep(down);
                mq2.start_app();
            })
            .await
            .unwrap();
            rec.fault("RabbitMQ restart");
            if let Some(at) = db_now(pool).await {
                rec.recoveries.push(("RabbitMQ restart".into(), at));
            }
        }
        _ => {
            let down = Duration::from_millis(rng.random_range(1000..=5000));
            let pg2 = pg.clone();
            tokio::task::spawn_blocking(move || {
                pg2.crash();
                std::thread::sleep(down);
                pg2.up();
            })
            .await
            .unwrap();
            rec.fault("Postgres crash-restart");
            if let Some(at) = db_now(pool).await {
                rec.recoveries.push(("Postgres crash-restart".into(), at));
            }
        }
    }
}

/// A long outage of one service; checks that the workers idle (no busy loop) meanwhile.
pub(super) async fn outage(
    which: &str,
    cluster: &mut Cluster,
    rec: &mut Record,
    pool: &PgPool,
    pg: &Arc<PrivatePostgres>,
    mq: &Arc<PrivateRabbit>,
) {
    let (label, down) = match which {
        "rabbitmq" => ("RabbitMQ down 60 s", Duration::from_secs(60)),
        _ => ("Postgres down 30 s", Duration::from_secs(30)),
    };
    println!("chaos: {label}");
    let ticks = clock_ticks();
    let pg2 = pg.clone();
    let mq2 = mq.clone();
    let is_mq = which == "rabbitmq";
    tokio::task::spawn_blocking(move || if is_mq { mq2.stop_app() } else { pg2.crash() })
        .await
        .unwrap();
    // Let the reconnect attempts settle into their backoff before measuring.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let before: Vec<(String, i32, Option<u64>)> = cluster
        .slots
        .iter()
        .map(|s| {
            (
                s.worker_id.clone(),
                s.worker.pid(),
                cpu_ticks(s.worker.pid()),
            )
        })
        .collect();
    let t0 = Instant::now();
    tokio::time::sleep(down - Duration::from_secs(5)).await;
    let wall = t0.elapsed().as_secs_f64();
    for (id, pid, b) in before {
        let (Some(b), Some(a)) = (b, cpu_ticks(pid)) else {
            continue;
        };
        let cpu_s = (a - b) as f64 / ticks as f64;
        let share = cpu_s / wall;
        // A reconnect loop with backoff uses well under a tenth of a core; a busy loop uses all.
        if share > 0.25 {
            rec.outage_cpu_ok = false;
        }
        rec.outage_cpu.push(format!(
            "{label}: {id} used {cpu_s:.2} s CPU in {wall:.0} s ({:.1} %)",
            share * 100.0
        ));
    }
    let mut alive = 0;
    for s in &mut cluster.slots {
        if matches!(s.worker.child.try_wait(), Ok(None)) {
            alive += 1;
        }
    }
    rec.outage_cpu.push(format!(
        "{label}: {alive} of {} processes still running at the end of the outage",
        cluster.slots.len()
    ));
    let pg2 = pg.clone();
    let mq2 = mq.clone();
    tokio::task::spawn_blocking(move || if is_mq { mq2.start_app() } else { pg2.up() })
        .await
        .unwrap();
    rec.fault(label);
    if let Some(at) = db_now(pool).await {
        rec.recoveries.push((label.to_owned(), at));
    }
}
