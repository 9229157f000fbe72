//! Scenario 5, `kinds`: the platform's kinds (compile, research, deletion) on a notes space of the
//! bench's own tenant. Invariant: each kind's jobs are all requested at once (by eight
//! requesters, each request its own transaction) and timed from the first request to the last
//! finished job, and a job counts as done only when its row says it succeeded.

use std::future::Future;
use std::time::{Duration, Instant};

use futures_util::{StreamExt, TryStreamExt};

use serde_json::json;
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};
use uuid::Uuid;

use super::{run_options, wait_for, with_runtime, Params};
use crate::config;
use crate::jobs::{compile, deletion, research, Kind};
use crate::store::Store;
use crate::tools::bench::env::BenchEnv;
use crate::tools::bench::report::{Progress, Report, Run};
use crate::tools::platform;

const TENANT: &str = "kfs-bench";
const SUBJECT: &str = "bench-user";

/// Requests made at once, as the platform's API makes them for many callers.
const REQUESTERS: usize = 8;

/// Makes one request per item, [`REQUESTERS`] at a time, each in its own transaction on its
/// own connection; returns the job ids in the items' order. Made one after another on one
/// connection, the requests themselves took most of a kind's time (research: 15 ms each, the
/// last task done 66 ms after the last request), and the scenario measured the bench.
async fn request_all<I, F, Fut>(
    pool: &PgPool,
    items: Vec<I>,
    request: F,
) -> Result<Vec<Uuid>, String>
where
    F: Fn(PoolConnection<Postgres>, I) -> Fut,
    Fut: Future<Output = Result<Uuid, String>>,
{
    futures_util::stream::iter(items)
        .map(|item| async {
            let conn = pool.acquire().await.map_err(|e| e.to_string())?;
            request(conn, item).await
        })
        .buffered(REQUESTERS)
        .try_collect()
        .await
}

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
    let opts = run_options(env, kinds.clone(), p, &store_url)?;
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
        let started = Instant::now();
        let attempts = request_all(&env.pool, docs.clone(), |mut conn, doc| async move {
            compile::request::request(&mut conn, doc, compile::request::RequestOptions::default())
                .await
                .map_err(|e| format!("compile request: {e}"))
        })
        .await?;
        let compile_requests = started.elapsed().as_secs_f64();
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
        let tasks = request_all(&env.pool, (0..k).collect(), |mut conn, i| async move {
            let req = research::request::ResearchRequest::new(
                space,
                format!("How does note {i} describe leases and fencing of workers?"),
                SUBJECT,
                snapshot,
            );
            research::request::request(&mut conn, &req)
                .await
                .map(|r| r.job_id)
                .map_err(|e| format!("research request: {e}"))
        })
        .await?;
        let research_requests = started.elapsed().as_secs_f64();
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
        let deletions = request_all(&env.pool, docs.clone(), |mut conn, doc| async move {
            let req = deletion::request::DeletionRequest {
                tenant_id: TENANT.into(),
                knowledge_space_id: space,
                target: deletion::request::Target::Document { id: doc },
                expected_revision: None,
                requested_by_subject_id: SUBJECT.into(),
                permission_snapshot_id: snapshot,
                access_channel: "interactive".into(),
                idempotency_key: format!("bench-delete-{doc}"),
            };
            deletion::request::request_deletion(&mut conn, &req)
                .await
                .map(|r| r.job_id)
                .map_err(|e| format!("deletion request: {e}"))
        })
        .await?;
        let deletion_requests = started.elapsed().as_secs_f64();
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
        let requests = json!({
            "compile": compile_requests,
            "research": research_requests,
            "deletion": deletion_requests,
        });
        Ok((vec![compiled, researched, deleted], requests))
    })
    .await;
    let (runs, requests) = match runs {
        Ok((r, q)) => (Ok(r), q),
        Err(e) => (Err(e), serde_json::Value::Null),
    };
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Report::of_runs(
        "kinds",
        "jobs/s",
        runs?,
        // How long each kind's requests took, of its time: the platform's API's share.
        json!({"documents": k, "inflight": p.inflight, "requests_secs": requests}),
    ))
}
