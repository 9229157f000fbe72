//! Scenario 3c (`writes`): the row versions the delivery protocol commits for each one-step probe
//! job, written by the plainest statements that can write them, with no broker, no reads and no
//! fences. Invariant: every job gets exactly the protocol's committed writes, in the protocol's
//! commits and no fewer (the relay's claim, its mark with the job's move to `queued`, the
//! consumer's claim of job and outbox row, then the step's effect with the end of both), so this
//! CPU per job, with the raw publishes', bounds from below what any engine keeping the protocol
//! costs on these cores at the same batch sizes, and its ceiling bounds from above the ratio any
//! such engine can reach with those batches.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use futures_util::TryStreamExt;
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use super::{enqueue_probes, inflight_pool, Params};
use crate::relay::RelayConfig;
use crate::tools::bench::env::BenchEnv;
use crate::tools::bench::machine::CpuMeter;
use crate::tools::bench::report::{Progress, Report, Run};

// Every statement takes the same parameters: `$1` the batch's job ids, `$2` their outbox ids,
// `$3` the worker; one that needs fewer still names each, at no cost per row.

/// The relay's claim: `pending` → `dispatching` under one lock token for the round, committed
/// before anything is published.
const RELAY_CLAIM: &str = "UPDATE kfs_probe_outbox SET status = 'dispatching', \
    lock_token = (SELECT gen_random_uuid()), locked_by = $3, locked_until = now() + interval '30 seconds', \
    dispatch_attempts = dispatch_attempts + 1, queue_job_id = gen_random_uuid()::text, \
    updated_at = now() WHERE id = ANY($2) AND $1::uuid[] IS NOT NULL";

/// The relay's mark once the broker confirmed: outbox `dispatched`, job `dispatch_pending` →
/// `queued`.
const RELAY_MARK: &str = "WITH marked AS ( \
      UPDATE kfs_probe_outbox SET status = 'dispatched', lock_token = NULL, locked_by = NULL, \
        locked_until = NULL, available_at = now() + interval '5 minutes', last_error = NULL, \
        updated_at = now() WHERE id = ANY($2) RETURNING 1 \
    ) UPDATE kfs_probe_jobs SET run_state = 'queued', row_version = row_version + 1, \
      updated_at = now() WHERE id = ANY($1) AND $3::text IS NOT NULL";

/// The consumer's claim, committed before the step: job `running` under a fresh lease, outbox
/// `leased`.
const CLAIM: &str = "WITH claimed AS ( \
      UPDATE kfs_probe_jobs SET run_state = 'running', retry_at = NULL, \
        started_at = coalesce(started_at, now()), worker_id = $3, lease_token = gen_random_uuid(), \
        lease_expires_at = now() + interval '30 seconds', heartbeat_at = now(), \
        execution_attempts = execution_attempts + 1, row_version = row_version + 1, \
        updated_at = now() WHERE id = ANY($1) RETURNING 1 \
    ) UPDATE kfs_probe_outbox SET status = 'leased', available_at = now() + interval '30 seconds', \
      delivered_at = now(), updated_at = now() WHERE id = ANY($2)";

/// The step's effect and the end, in one commit: job `succeeded`, outbox `completed`.
const STEP_AND_END: &str = "WITH effect AS ( \
      INSERT INTO kfs_probe_effects (job_id, step, worker_id, lease_token) \
      SELECT id, 1, $3, lease_token FROM kfs_probe_jobs WHERE id = ANY($1) \
    ), ended AS ( \
      UPDATE kfs_probe_jobs SET run_state = 'succeeded', checkpoint = 'done', active_slot = NULL, \
        completed_at = now(), last_error_code = NULL, last_error_message = NULL, worker_id = NULL, \
        lease_token = NULL, lease_expires_at = NULL, heartbeat_at = NULL, \
        row_version = row_version + 1, updated_at = now() WHERE id = ANY($1) RETURNING 1 \
    ) UPDATE kfs_probe_outbox SET status = 'completed', updated_at = now() WHERE id = ANY($2)";

/// 3c. `n` one-step probe jobs, enqueued as the platform does, then given the protocol's writes:
///     first the relay's, in its rounds (its batch, its depth at once), then the consumer's, in
///     batches of `batch_max` (`inflight` deliveries at once), each side measured on its own
///     so that it compares with the relay's statements alone and with the statements scenario.
pub async fn writes(env: &BenchEnv, p: &Params) -> Result<Report, String> {
    let n = p.jobs;
    enqueue_probes(env, n).await?;
    let rows: Vec<(Uuid, Uuid)> =
        sqlx::query_as("SELECT probe_job_id, id FROM kfs_probe_outbox ORDER BY available_at, id")
            .fetch_all(&env.pool)
            .await
            .map_err(|e| e.to_string())?;
    let (jobs, outbox): (Vec<Uuid>, Vec<Uuid>) = rows.into_iter().unzip();
    let relay = RelayConfig::default();
    let round = usize::try_from(relay.batch.max(1)).unwrap_or(256);
    let batch = usize::from(p.batch_max.max(1));
    let consumers = (usize::from(p.inflight) / batch).max(1);
    let (pool, size) = inflight_pool(
        env,
        u32::try_from(relay.depth.max(consumers)).unwrap_or(4),
        "kfs-worker bench writes",
    )
    .await?;
    let worker = format!("bench-{}", env.tag);
    let progress = Progress::new("writes", n, p.interactive);
    let phase = Phase {
        pool: &pool,
        worker: &worker,
        jobs: &jobs,
        outbox: &outbox,
    };
    // The consumer's side starts only once the relay's has written every row.
    let runs = async {
        let relay_run = phase
            .run(
                "the relay's writes",
                round,
                relay.depth.max(1),
                &[RELAY_CLAIM, RELAY_MARK],
                None,
            )
            .await?;
        let consumer_run = phase
            .run(
                "the consumer's writes",
                batch,
                consumers,
                &[CLAIM, STEP_AND_END],
                Some(&progress),
            )
            .await?;
        Ok::<_, String>((relay_run, consumer_run))
    }
    .await;
    pool.close().await;
    let (relay_run, consumer_run) = runs?;
    let done = given_the_protocol(&env.pool).await?;
    progress.finish(done);
    let secs = relay_run.secs + consumer_run.secs;
    let mut main = Run::new("writes", n, done, secs, "jobs/s");
    main.cpu_ms = [relay_run.cpu_ms, consumer_run.cpu_ms].into_iter().sum();
    let mut r = Report::single(
        "writes",
        main,
        json!({"relay_batch": relay.batch, "rounds": relay.depth, "batch_max": p.batch_max, "consumers": consumers, "pool": size}),
    );
    r.ratio_to = Some("limit".into());
    r.runs = vec![relay_run, consumer_run];
    Ok(r)
}

/// The jobs, their outbox rows, and where the writes go.
struct Phase<'a> {
    pool: &'a PgPool,
    worker: &'a str,
    jobs: &'a [Uuid],
    outbox: &'a [Uuid],
}

impl Phase<'_> {
    /// Every job given `statements` (each its own commit, with `$1` the batch's job ids, `$2`
    /// their outbox ids, `$3` the worker), `size` jobs a batch, `at_once` batches at a time.
    async fn run(
        &self,
        label: &str,
        size: usize,
        at_once: usize,
        statements: &[&str],
        progress: Option<&Progress>,
    ) -> Result<Run, String> {
        let handled = AtomicU64::new(0);
        let cpu = CpuMeter::start();
        let started = Instant::now();
        let written = futures_util::stream::iter(
            self.jobs.chunks(size).zip(self.outbox.chunks(size)).map(Ok),
        )
        .try_for_each_concurrent(at_once, |(jobs, outbox)| {
            let handled = &handled;
            async move {
                for statement in statements {
                    sqlx::query(statement)
                        .bind(jobs)
                        .bind(outbox)
                        .bind(self.worker)
                        .execute(self.pool)
                        .await?;
                }
                let now = handled.fetch_add(jobs.len() as u64, Ordering::Relaxed);
                if let Some(progress) = progress {
                    progress.set(now + jobs.len() as u64);
                }
                Ok::<(), sqlx::Error>(())
            }
        })
        .await;
        let secs = started.elapsed().as_secs_f64();
        let busy = cpu.busy();
        written.map_err(|e| format!("{label}: {e}"))?;
        let n = self.jobs.len() as u64;
        Ok(Run::new(label, n, n, secs, "jobs/s").with_cpu(busy))
    }
}

/// Jobs whose rows hold exactly the protocol's writes, counted from the rows: succeeded at row
/// version 4 (created 1, queued, claimed, ended) after one attempt, one effect, and an outbox row
/// completed after one dispatch.
async fn given_the_protocol(pool: &PgPool) -> Result<u64, String> {
    sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM kfs_probe_jobs j JOIN kfs_probe_outbox o ON o.probe_job_id = j.id \
         WHERE j.run_state = 'succeeded' AND j.row_version = 4 AND j.execution_attempts = 1 \
           AND o.status = 'completed' AND o.dispatch_attempts = 1 AND o.delivered_at IS NOT NULL \
           AND (SELECT count(*) FROM kfs_probe_effects e WHERE e.job_id = j.id) = 1",
    )
    .fetch_one(pool)
    .await
    .map(|c| c as u64)
    .map_err(|e| e.to_string())
}
