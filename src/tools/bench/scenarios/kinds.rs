//! Scenario 5, `kinds`: the platform's kinds (compile, research, deletion) on a notes space of the
//! bench's own tenant. Invariant: each kind's jobs are requested in one transaction while the
//! worker runs, and timed from that commit to the last finished job, so a phase measures the
//! worker draining a backlog of the kind and nothing of the requests' own cost; a job counts as
//! done only when its row says it succeeded.

use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use serde_json::json;
use sqlx::{PgConnection, PgPool};
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

/// Makes one request per item, each in a savepoint of one transaction, and commits them
/// together; returns the job ids in the items' order and the moment of the commit.
///
/// The requests are the platform API's work, not the worker's. Made as the API makes them, each
/// its own transaction while the worker ran, they took much of a phase (research: 0.49 s of
/// 0.93 s, on the same two cores) and a kind's rate was partly theirs. Committed at once, the
/// phase is the worker's alone: its intake, its claims and its steps over a backlog of the
/// kind, as when a platform's burst has queued up.
async fn request_all<I, F>(
    pool: &PgPool,
    items: Vec<I>,
    request: F,
) -> Result<(Vec<Uuid>, Instant, f64), String>
where
    F: for<'c> Fn(&'c mut PgConnection, I) -> BoxFuture<'c, Result<Uuid, String>>,
{
    let began = Instant::now();
    let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
    let mut ids = Vec::with_capacity(items.len());
    for item in items {
        ids.push(request(&mut tx, item).await?);
    }
    tx.commit().await.map_err(|e| e.to_string())?;
    let committed = Instant::now();
    Ok((ids, committed, (committed - began).as_secs_f64()))
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
///    compiled space, and deletions of single documents, each kind's jobs committed at once
///    and timed from that commit to the last finished job.
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
        let (attempts, started, compile_requests) =
            request_all(&env.pool, docs.clone(), |conn, doc| {
                Box::pin(async move {
                    compile::request::request(conn, doc, compile::request::RequestOptions::default())
                        .await
                        .map_err(|e| format!("compile request: {e}"))
                })
            })
            .await?;
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

        let (tasks, started, research_requests) =
            request_all(&env.pool, (0..k).collect(), |conn, i| {
                Box::pin(async move {
                    let req = research::request::ResearchRequest::new(
                        space,
                        format!("How does note {i} describe leases and fencing of workers?"),
                        SUBJECT,
                        snapshot,
                    );
                    research::request::request(conn, &req)
                        .await
                        .map(|r| r.job_id)
                        .map_err(|e| format!("research request: {e}"))
                })
            })
            .await?;
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

        let (deletions, started, deletion_requests) =
            request_all(&env.pool, docs.clone(), |conn, doc| {
                Box::pin(async move {
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
                    deletion::request::request_deletion(conn, &req)
                        .await
                        .map(|r| r.job_id)
                        .map_err(|e| format!("deletion request: {e}"))
                })
            })
            .await?;
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
        // How long each kind's requests took to make and commit, before its phase began.
        json!({"documents": k, "inflight": p.inflight, "requests_secs": requests}),
    ))
}
