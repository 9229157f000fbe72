//! Scenario `peer`: a Celery 5 worker doing the bare loop's work the way Celery users do it —
//! `acks_late`, prefetch multiplier 1, Celery's default concurrency (one process per core), one
//! UPDATE and its commit per task — on the same RabbitMQ and Postgres, measured in the same run
//! as the engine. Invariant: Celery comes from PyPI into the bench's own virtualenv (never the
//! system's Python), the count is of rows the tasks really updated, the time runs from the first
//! task's commit to the last one's by Postgres' clock, and where Python or its `venv` module is
//! missing the row says so and is skipped; no secret reaches the command line or the output.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldArray, FieldTable};
use serde_json::json;
use tokio::process::Command;

use super::{publish_confirmed, wait_for, Params};
use crate::tools::bench::env::BenchEnv;
use crate::tools::bench::machine::CpuMeter;
use crate::tools::bench::report::{Progress, Report, Run};

/// The Celery app the peer runs; written into the virtualenv before each run.
const APP: &str = include_str!("../peer/bench_peer.py");

/// What the virtualenv installs from PyPI.
const REQUIREMENTS: [&str; 2] = ["celery>=5.3,<6", "psycopg[binary]>=3.1,<4"];

/// Messages published per batch of confirms, as the relay does.
const PUBLISH_BATCH: u64 = 256;

/// Runs the peer. `limit` is the bare loop's rate from the same run, when it ran.
pub async fn peer(env: &BenchEnv, p: &Params, limit: Option<f64>) -> Result<Report, String> {
    let n = p.jobs;
    let venv = match prepare_venv(p).await {
        Ok(v) => v,
        Err(Skip(why)) => return Ok(Report::skipped("peer", n, why)),
    };
    sqlx::raw_sql(
        "CREATE TABLE bench_peer (id BIGINT PRIMARY KEY, hits INTEGER NOT NULL DEFAULT 0, done_at TIMESTAMPTZ)",
    )
    .execute(&env.pool)
    .await
    .map_err(|e| e.to_string())?;
    sqlx::query("INSERT INTO bench_peer (id) SELECT generate_series(1, $1::bigint)")
        .bind(n as i64)
        .execute(&env.pool)
        .await
        .map_err(|e| e.to_string())?;
    let queue = format!("{}.peer", env.topology.prefix);
    publish(env, &queue, n, p).await?;

    let concurrency = std::thread::available_parallelism().map_or(1, |c| c.get());
    let log = venv.join("worker.log");
    let worker = std::cell::RefCell::new(start_worker(env, &venv, &queue, concurrency, &log)?);
    let progress = Progress::new("peer (celery)", n, p.interactive);
    let count = || async {
        let exited = worker.borrow_mut().try_wait();
        if let Ok(Some(status)) = exited {
            return Err(format!(
                "the Celery worker exited ({status}) before its work was done; its log: {}",
                tail(&log)
            ));
        }
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM bench_peer WHERE hits > 0")
            .fetch_one(&env.pool)
            .await
            .map(|c| c as u64)
            .map_err(|e| e.to_string())
    };
    // The CPU is measured from the first task's commit on, so Python's start-up is not
    // counted as the cost of the tasks.
    let first = wait_for(1, &progress, Duration::from_millis(50), count).await;
    let cpu = CpuMeter::start();
    let counted = match first {
        Ok(first) => wait_for(n, &progress, Duration::from_millis(500), count)
            .await
            .map(|c| (first, c)),
        Err(e) => Err(e),
    };
    let busy = cpu.busy();
    stop_worker(&mut worker.into_inner()).await;
    let (first, counted) = counted?;
    progress.finish(counted);
    let (done, secs): (i64, Option<f64>) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE hits = 1), extract(epoch FROM max(done_at) - min(done_at))::float8 \
         FROM bench_peer WHERE hits > 0",
    )
    .fetch_one(&env.pool)
    .await
    .map_err(|e| e.to_string())?;
    if let Ok(ch) = env.channel().await {
        let _ = ch
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let mut run = Run::new("peer", n, done as u64, secs.unwrap_or(0.0), "tasks/s");
    run.cpu_ms = busy
        .zip(counted.checked_sub(first).filter(|d| *d > 0))
        .map(|(b, d)| b * 1000.0 / d as f64);
    let mut report = Report::single(
        "peer",
        run,
        json!({
            "peer": format!("celery {}", celery_version(&venv).await),
            "concurrency": concurrency,
            "prefetch_multiplier": 1,
            "acks_late": true,
            "pool": "prefork",
        }),
    );
    if let Some(limit) = limit {
        report.against(limit, "limit");
    }
    Ok(report)
}

/// Why the peer row is skipped.
struct Skip(String);

/// The bench's virtualenv with Celery in it, created on first use under the user's cache
/// directory (or `KFS_BENCH_PEER_VENV`), with the peer's app written into it.
async fn prepare_venv(p: &Params) -> Result<PathBuf, Skip> {
    let python = std::env::var("KFS_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let venv = venv_dir();
    if !venv.join("bin/celery").exists() {
        let found = Command::new(&python).arg("--version").output().await;
        if !found.is_ok_and(|o| o.status.success()) {
            return Err(Skip(format!(
                "skipped: no {python} to run the Celery peer (install Python 3, or set KFS_BENCH_PYTHON)"
            )));
        }
        let progress = Progress::new(
            "peer: installing Celery into a virtualenv",
            1,
            p.interactive,
        );
        let made = run(Command::new(&python).arg("-m").arg("venv").arg(&venv)).await;
        if let Err(e) = made {
            return Err(Skip(format!(
                "skipped: {python} cannot make a virtualenv (on Debian: apt-get install python3-venv): {e}"
            )));
        }
        let pip = venv.join("bin/pip");
        let installed = run(Command::new(&pip)
            .args(["install", "--quiet", "--disable-pip-version-check"])
            .args(REQUIREMENTS))
        .await;
        if let Err(e) = installed {
            // A half-made virtualenv would look ready next time.
            let _ = std::fs::remove_dir_all(&venv);
            return Err(Skip(format!(
                "skipped: cannot install {} from PyPI: {e}",
                REQUIREMENTS.join(" and ")
            )));
        }
        progress.finish(1);
    }
    std::fs::write(venv.join("bench_peer.py"), APP)
        .map_err(|e| Skip(format!("skipped: cannot write the peer's app: {e}")))?;
    Ok(venv)
}

fn venv_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("KFS_BENCH_PEER_VENV") {
        return PathBuf::from(dir);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    cache.join("kfs-worker").join("bench-peer")
}

/// Runs a setup command; its output is kept for the error only.
async fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().rev().find(|l| !l.trim().is_empty());
    Err(format!("{} ({})", last.unwrap_or("failed"), out.status))
}

/// Publishes `n` Celery task messages (protocol 2, JSON) for rows 1..=n to a durable queue, in
/// batches of confirms, before the worker starts, so the worker's rate is its own.
async fn publish(env: &BenchEnv, queue: &str, n: u64, p: &Params) -> Result<(), String> {
    let ch = env.confirm_channel().await?;
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .map_err(|e| e.to_string())?;
    let progress = Progress::new("peer: publishing Celery tasks", n, p.interactive);
    let confirmed = publish_confirmed(
        &ch,
        "",
        queue,
        n,
        PUBLISH_BATCH,
        Some(&progress),
        task_message,
    )
    .await?;
    if confirmed < n {
        return Err(format!(
            "RabbitMQ refused {} of {n} peer task messages",
            n - confirmed
        ));
    }
    progress.finish(n);
    let _ = ch.close(200, "published".into()).await;
    Ok(())
}

/// One `bench_peer.touch(id)` message as Celery's own client writes it (message protocol 2).
fn task_message(id: u64) -> (lapin::BasicProperties, Vec<u8>) {
    let task_id = uuid::Uuid::new_v4().to_string();
    let s = |v: &str| AMQPValue::LongString(v.into());
    let mut headers = FieldTable::default();
    headers.insert("lang".into(), s("py"));
    headers.insert("task".into(), s("bench_peer.touch"));
    headers.insert("id".into(), s(&task_id));
    headers.insert("root_id".into(), s(&task_id));
    headers.insert("parent_id".into(), AMQPValue::Void);
    headers.insert("group".into(), AMQPValue::Void);
    headers.insert("retries".into(), AMQPValue::LongInt(0));
    headers.insert("eta".into(), AMQPValue::Void);
    headers.insert("expires".into(), AMQPValue::Void);
    headers.insert(
        "timelimit".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::Void, AMQPValue::Void])),
    );
    headers.insert("argsrepr".into(), s(&format!("({id},)")));
    headers.insert("kwargsrepr".into(), s("{}"));
    headers.insert("origin".into(), s("kfs-worker-bench"));
    headers.insert("ignore_result".into(), AMQPValue::Boolean(true));
    let body =
        json!([[id], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]);
    let props = lapin::BasicProperties::default()
        .with_content_type("application/json".into())
        .with_content_encoding("utf-8".into())
        .with_correlation_id(task_id.as_str().into())
        .with_delivery_mode(2)
        .with_headers(headers);
    (props, body.to_string().into_bytes())
}

/// Starts `celery worker` on `queue`. The URLs reach it through the environment, never its
/// command line, so they do not show in a process list.
fn start_worker(
    env: &BenchEnv,
    venv: &Path,
    queue: &str,
    concurrency: usize,
    log: &Path,
) -> Result<tokio::process::Child, String> {
    let out = std::fs::File::create(log).map_err(|e| e.to_string())?;
    let err = out.try_clone().map_err(|e| e.to_string())?;
    Command::new(venv.join("bin/celery"))
        .current_dir(venv)
        .args(["-A", "bench_peer", "worker", "-Q", queue, "-P", "prefork"])
        .arg(format!("--concurrency={concurrency}"))
        .args([
            "--prefetch-multiplier=1",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel=WARNING",
        ])
        .env("KFS_PEER_BROKER", env.services.amqp_url.nodes()[0].expose())
        .env("KFS_PEER_DSN", env.services.database_url.expose())
        .env("KFS_PEER_QUEUE", queue)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start the Celery worker: {e}"))
}

/// Warm shutdown (SIGTERM: the pool's processes finish their task and exit), then SIGKILL
/// after 15 s.
async fn stop_worker(worker: &mut tokio::process::Child) {
    if let Some(pid) = worker.id() {
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .await;
    }
    if tokio::time::timeout(Duration::from_secs(15), worker.wait())
        .await
        .is_err()
    {
        let _ = worker.kill().await;
    }
}

async fn celery_version(venv: &Path) -> String {
    Command::new(venv.join("bin/python"))
        .args(["-c", "import celery; print(celery.__version__)"])
        .output()
        .await
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "5".into())
}

/// The last lines of the worker's log, for an error.
fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" / ")
}

#[cfg(test)]
mod tests {
    use super::task_message;

    #[test]
    fn a_task_message_is_celerys_protocol_2_in_json() {
        let (props, body) = task_message(7);
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body[0], serde_json::json!([7]), "args");
        assert_eq!(body[1], serde_json::json!({}), "kwargs");
        assert!(body[2]["chord"].is_null(), "embed");
        let headers = props.headers().as_ref().unwrap().inner();
        assert_eq!(
            headers.get("task"),
            Some(&lapin::types::AMQPValue::LongString(
                "bench_peer.touch".into()
            ))
        );
        let id = match headers.get("id") {
            Some(lapin::types::AMQPValue::LongString(s)) => s.to_string(),
            other => panic!("id header: {other:?}"),
        };
        assert_eq!(
            props.correlation_id().as_ref().map(|c| c.to_string()),
            Some(id)
        );
        assert_eq!(
            props.content_type().as_ref().map(|c| c.to_string()),
            Some("application/json".into())
        );
    }
}
