//! Scenario 6, `scaleout`: the engine scenario with 1, 2, 4, … `kfs-worker run` child processes.
//! Invariant: each worker count runs in its own fresh environment, and every child is stopped
//! (SIGTERM, then SIGKILL) before its environment is removed.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use super::{probe_batch, Params};
use crate::config::Services;
use crate::jobs::Kind;
use crate::tools::bench::env::BenchEnv;
use crate::tools::bench::report::{Report, Run};

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

/// A `kfs-worker run` child process of this executable.
pub(super) struct WorkerProcess {
    child: Child,
    pub(super) log: std::path::PathBuf,
}

impl WorkerProcess {
    /// [`WorkerProcess::spawn`] with more environment variables.
    pub(super) fn spawn_with(
        services: &Services,
        id: &str,
        inflight: u16,
        batch_max: u16,
        extra: &[(&str, &str)],
    ) -> Result<WorkerProcess, String> {
        let exe = std::env::current_exe().map_err(|e| format!("own executable: {e}"))?;
        let log = std::env::temp_dir().join(format!("{id}-{}.log", uuid::Uuid::new_v4().simple()));
        let file = std::fs::File::create(&log).map_err(|e| format!("log file: {e}"))?;
        let child = Command::new(exe)
            .args(["run", "--kinds", "probe"])
            .env("DATABASE_URL", services.database_url.expose())
            .env("AMQP_URL", services.amqp_url.expose())
            .env("KFS_QUEUE_PREFIX", &services.queue_prefix)
            .env("KFS_WORKER_ID", id)
            .env("KFS_PREFETCH", inflight.to_string())
            .env("KFS_BATCH_MAX", batch_max.to_string())
            .env("KFS_HTTP_ADDR", "off")
            .envs(extra.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .map_err(|e| format!("start a worker process: {e}"))?;
        Ok(WorkerProcess { child, log })
    }

    /// SIGKILL, and reaped.
    pub(super) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, a clean exit within 30 s, or SIGKILL.
    pub(super) fn stop(&mut self) {
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
                workers.push(WorkerProcess::spawn_with(
                    &env.services,
                    &format!("kfs-bench-{}-w{i}", env.tag),
                    p.inflight,
                    p.batch_max,
                    &[("KFS_RELAY_WINDOW", &p.window_setting)],
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
        json!({"inflight_per_worker": p.inflight, "batch_max": p.batch_max, "workers": worker_counts(p.workers)}),
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
}
