//! Scenario `takeover`: under a backlog, SIGKILL a `kfs-worker run` process that holds jobs and
//! measure, for each job it held, the time from the kill until another lease runs it; then the
//! same after a restart under the same worker id (the case of a container that crashes and
//! keeps its pod name). Invariant: the jobs counted are exactly those the killed process held
//! (running under one of its incarnations) right after the kill; a job's time ends at the claim
//! that took it over (the new lease's first `heartbeat_at`, Postgres' clock, as the kill's);
//! every child is stopped before the environment is removed.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use super::scaleout::WorkerProcess;
use super::Params;
use crate::config::Services;
use crate::jobs::probe::{self, ProbeSpec};
use crate::jobs::Kind;
use crate::tools::bench::env::BenchEnv;
use crate::tools::bench::report::{Report, Run};
use crate::tools::bench::stats::{summarize, Summary};

/// A lease long enough that a takeover waiting for it would show.
const LEASE: &str = "probe=10s";
const STEP: Duration = Duration::from_millis(250);
const STEPS: i32 = 4;
/// The fewest jobs in the backlog: enough that both kills find the victim holding jobs.
const AT_LEAST: u32 = 300;
/// How long a held job may wait to run again before the scenario stops waiting for it.
const GIVE_UP: Duration = Duration::from_secs(60);

/// A job's id, lease token, last heartbeat and completion.
type LeaseRow = (
    Uuid,
    Option<Uuid>,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
);

fn spawn(env: &BenchEnv, id: &str, p: &Params) -> Result<WorkerProcess, String> {
    WorkerProcess::spawn_with(
        &env.services,
        id,
        p.inflight,
        p.batch_max,
        &[
            ("KFS_LEASES", LEASE),
            ("KFS_RELAY_WINDOW", &p.window_setting),
        ],
    )
}

/// Jobs running under any incarnation of `id`, with their lease tokens.
async fn held_by(pool: &PgPool, id: &str) -> Result<HashMap<Uuid, Uuid>, String> {
    let rows: Vec<(Uuid, Uuid)> = sqlx::query_as(
        "SELECT id, lease_token FROM kfs_probe_jobs \
         WHERE run_state = 'running' AND split_part(worker_id, '#', 1) = $1",
    )
    .bind(id)
    .fetch_all(pool)
    .await
    .map_err(|e| e.to_string())?;
    Ok(rows.into_iter().collect())
}

/// Waits until `id` holds jobs.
async fn wait_holding(pool: &PgPool, id: &str) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while held_by(pool, id).await?.is_empty() {
        if tokio::time::Instant::now() > deadline {
            return Err(format!("{id} never held a job"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// SIGKILLs `victim` (restarting it under the same id when `restart`) and returns, for each
/// job it held, the seconds from the kill until another lease claimed it (`None`: not within
/// [`GIVE_UP`]).
async fn kill_and_time(
    env: &BenchEnv,
    p: &Params,
    victim: &mut WorkerProcess,
    id: &str,
    restart: bool,
) -> Result<Vec<Option<f64>>, String> {
    wait_holding(&env.pool, id).await?;
    victim.kill();
    let killed_at = env.db_now().await?;
    let held = held_by(&env.pool, id).await?;
    if restart {
        *victim = spawn(env, id, p)?;
    }
    let ids: Vec<Uuid> = held.keys().copied().collect();
    let mut taken: HashMap<Uuid, f64> = HashMap::new();
    let deadline = tokio::time::Instant::now() + GIVE_UP;
    while taken.len() < held.len() && tokio::time::Instant::now() < deadline {
        // A new lease token means another claim; its heartbeat_at is that claim's time until
        // its first heartbeat (a third of the lease later), which this 20 ms poll sees first.
        // A job already ended again ran under a new lease too: its completion bounds the time.
        let rows: Vec<LeaseRow> =
            sqlx::query_as(
                "SELECT id, lease_token, heartbeat_at, completed_at FROM kfs_probe_jobs WHERE id = ANY($1)",
            )
            .bind(&ids)
            .fetch_all(&env.pool)
            .await
            .map_err(|e| e.to_string())?;
        for (job, token, beat, done) in rows {
            if taken.contains_key(&job) {
                continue;
            }
            let again = match (token, beat, done) {
                (Some(t), Some(at), _) if Some(&t) != held.get(&job) => Some(at),
                (None, _, Some(at)) => Some(at),
                _ => None,
            };
            if let Some(at) = again {
                taken.insert(
                    job,
                    (at - killed_at).num_microseconds().unwrap_or(0) as f64 / 1e6,
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(ids.iter().map(|j| taken.get(j).copied()).collect())
}

fn summary(times: &[Option<f64>]) -> (Summary, usize) {
    let ms: Vec<f64> = times.iter().flatten().map(|s| s * 1000.0).collect();
    (
        summarize(&ms).unwrap_or_default(),
        times.iter().filter(|t| t.is_none()).count(),
    )
}

/// Takeover after a SIGKILL, and after a SIGKILL and a restart under the same worker id.
pub async fn takeover(base: &Services, p: &Params) -> Result<Report, String> {
    let env = BenchEnv::new(base, "takeover").await?;
    let result = async {
        probe::enqueue_many(
            &env.pool,
            i64::from(p.fair_backlog.max(AT_LEAST)),
            &ProbeSpec {
                steps: STEPS,
                step_sleep: STEP,
                ..ProbeSpec::default()
            },
        )
        .await
        .map_err(|e| format!("enqueue probe jobs: {e}"))?;
        let (a, b) = (
            format!("kfs-bench-{}-a", env.tag),
            format!("kfs-bench-{}-b", env.tag),
        );
        let mut victim = spawn(&env, &a, p)?;
        let mut other = spawn(&env, &b, p)?;
        let queue = env.topology.queue(Kind::Probe);
        env.wait_consumers(&queue, 2, Duration::from_secs(60))
            .await?;

        // 1. SIGKILL: the other process takes the jobs over.
        let killed = kill_and_time(&env, p, &mut victim, &a, false).await?;
        // 2. The killed process restarts under its id and holds jobs; SIGKILLed again, it is
        //    restarted at once under the same id, now alone: its predecessor's jobs must not
        //    wait for their leases.
        victim = spawn(&env, &a, p)?;
        other.stop();
        let restarted = kill_and_time(&env, p, &mut victim, &a, true).await?;
        victim.stop();
        Ok::<_, String>((killed, restarted))
    }
    .await;
    env.cleanup().await;
    let (killed, restarted) = result?;
    let run = |label: &str, times: &[Option<f64>]| {
        let (s, _) = summary(times);
        Run::new(
            label,
            times.len() as u64,
            times.iter().flatten().count() as u64,
            s.max / 1000.0,
            "jobs/s",
        )
    };
    let (k, k_never) = summary(&killed);
    let (r, r_never) = summary(&restarted);
    let runs = vec![
        run("SIGKILL: held jobs run again (max s)", &killed),
        run("SIGKILL + restart under the same id (max s)", &restarted),
    ];
    let settings = json!({
        "backlog": p.fair_backlog.max(AT_LEAST),
        "inflight": p.inflight,
        "lease": LEASE,
        "steps": STEPS,
        "step_ms": STEP.as_millis() as u64,
        "killed_held": killed.len(),
        "killed_ms": k,
        "killed_never": k_never,
        "restart_held": restarted.len(),
        "restart_ms": r,
        "restart_never": r_never,
        "target_ms": 3000,
    });
    Ok(Report::of_runs("takeover", "jobs/s", runs, settings))
}
