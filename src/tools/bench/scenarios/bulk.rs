//! Scenario `bulk`: a bulk upload into one knowledge space. For each size N (`--bulk-sizes`),
//! N small documents of one tenant's space are requested in one transaction while the worker
//! runs, and right after it a second tenant's five; the run ends when every attempt ended.
//! Invariant: times come from Postgres' clock (each commit's `now()` and the attempts'
//! `completed_at`); a document counts only when its attempt succeeded; the publication counts
//! are read from the space's own rows at the end, the head-lock waits from this process's
//! counter before and after.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use super::{run_options, wait_for, with_runtime, Params};
use crate::config;
use crate::jobs::{compile, Kind};
use crate::store::Store;
use crate::tools::bench::env::BenchEnv;
use crate::tools::bench::report::{Progress, Report, Run};
use crate::tools::platform;

const SUBJECT: &str = "bench-user";
/// The second tenant's documents, committed right after the bulk.
const SMALL: usize = 5;

/// Requests a compile of each document in one transaction; returns the attempts and the
/// commit's time on Postgres' clock.
async fn request_at_once(
    pool: &PgPool,
    docs: &[Uuid],
) -> Result<(Vec<Uuid>, DateTime<Utc>), String> {
    let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
    let mut ids = Vec::with_capacity(docs.len());
    for d in docs {
        ids.push(
            compile::request::request(&mut tx, *d, compile::request::RequestOptions::default())
                .await
                .map_err(|e| format!("compile request: {e}"))?,
        );
    }
    tx.commit().await.map_err(|e| e.to_string())?;
    // The commit's moment: the first statement after it, on Postgres' clock.
    let at: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(pool)
        .await
        .map_err(|e| e.to_string())?;
    Ok((ids, at))
}

/// `(succeeded, ended, seconds from `from` to the last completed_at)` of `ids`.
async fn outcome(
    pool: &PgPool,
    ids: &[Uuid],
    from: DateTime<Utc>,
) -> Result<(u64, u64, f64), String> {
    let (ok, ended, last): (i64, i64, Option<DateTime<Utc>>) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE run_state = 'succeeded'), \
           count(*) FILTER (WHERE run_state IN ('succeeded', 'failed', 'canceled', 'superseded')), \
           max(completed_at) FROM document_compilation_attempts WHERE id = ANY($1)",
    )
    .bind(ids)
    .fetch_one(pool)
    .await
    .map_err(|e| e.to_string())?;
    let secs = last.map_or(0.0, |l| {
        (l - from).num_microseconds().unwrap_or(0) as f64 / 1e6
    });
    Ok((ok as u64, ended as u64, secs))
}

/// What the space's publications say: head moves (publications that were a head), all
/// publications composed, those given up, and member rows written in all.
async fn publications(pool: &PgPool, space: Uuid) -> Result<serde_json::Value, String> {
    let (heads, composed, given_up, members): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status IN ('published', 'superseded')), count(*), \
           count(*) FILTER (WHERE status IN ('inactive', 'candidate')), \
           (SELECT count(*) FROM projection_set_publication_members m WHERE m.knowledge_space_id = $1) \
         FROM projection_set_publications WHERE knowledge_space_id = $1",
    )
    .bind(space)
    .fetch_one(pool)
    .await
    .map_err(|e| e.to_string())?;
    Ok(json!({
        "head_moves": heads,
        "candidates_composed": composed,
        "candidates_given_up": given_up,
        "member_rows": members,
        "member_rows_per_publication": if composed > 0 { members as f64 / composed as f64 } else { 0.0 },
        "member_rows_per_head_move": if heads > 0 { members as f64 / heads as f64 } else { 0.0 },
    }))
}

/// The value of the counter `name` (all label sets added) in this process's metrics.
fn counter(name: &str) -> f64 {
    crate::metrics::install()
        .render()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The bulk scenario.
pub async fn bulk(env: &BenchEnv, p: &Params) -> Result<Report, String> {
    let dir = std::env::temp_dir().join(format!("kfs-bench-{}", env.tag));
    std::fs::create_dir_all(&dir).map_err(|e| format!("object store directory: {e}"))?;
    let store_url = format!("file://{}", dir.display());
    let store = Store::open(&config::object_store(&store_url).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let opts = run_options(env, vec![Kind::Compile], p, &store_url)?;
    let queue = env.topology.queue(Kind::Compile);
    let sizes = p.bulk_sizes.clone();
    let result = with_runtime(opts, async {
        env.wait_consumers(&queue, 1, Duration::from_secs(60))
            .await?;
        let mut runs = Vec::new();
        let mut details = serde_json::Map::new();
        for (i, &n) in sizes.iter().enumerate() {
            let (big, small) = {
                let mut tx = env.pool.begin().await.map_err(|e| e.to_string())?;
                let big = platform::create_notes_space(
                    &mut tx,
                    &store,
                    &format!("kfs-bench-bulk-{i}"),
                    SUBJECT,
                    &format!("bulk-{n}"),
                    n,
                )
                .await
                .map_err(|e| e.to_string())?;
                let small = platform::create_notes_space(
                    &mut tx,
                    &store,
                    &format!("kfs-bench-small-{i}"),
                    SUBJECT,
                    &format!("small-{n}"),
                    SMALL,
                )
                .await
                .map_err(|e| e.to_string())?;
                tx.commit().await.map_err(|e| e.to_string())?;
                (big, small)
            };
            let waits_before = counter("kfs_publish_head_waits_total");
            let rebases_before = counter("kfs_publish_rebases_total");
            let parks_before = counter("kfs_publish_parks_total");
            let joined_before = counter("kfs_publish_joined_total");
            let started = Instant::now();
            let (attempts, committed) = request_at_once(&env.pool, &big.documents).await?;
            let (others, others_committed) = request_at_once(&env.pool, &small.documents).await?;
            let all: Vec<Uuid> = attempts.iter().chain(&others).copied().collect();
            let total = all.len() as u64;
            let progress = Progress::new(format!("bulk {n}"), total, p.interactive);
            let finished = wait_for(total, &progress, Duration::from_millis(100), || async {
                outcome(&env.pool, &all, committed).await.map(|o| o.1)
            })
            .await?;
            progress.finish(finished);
            let wall = started.elapsed().as_secs_f64();
            let (ok, _, secs) = outcome(&env.pool, &attempts, committed).await?;
            let (small_ok, _, small_secs) = outcome(&env.pool, &others, others_committed).await?;
            let mut d = publications(&env.pool, big.space).await?;
            d["head_lock_waits"] = json!(counter("kfs_publish_head_waits_total") - waits_before);
            d["rebases"] = json!(counter("kfs_publish_rebases_total") - rebases_before);
            d["parks"] = json!(counter("kfs_publish_parks_total") - parks_before);
            d["published_by_another_attempt"] =
                json!(counter("kfs_publish_joined_total") - joined_before);
            d["second_tenant"] = json!({
                "documents": SMALL, "succeeded": small_ok, "last_done_secs": small_secs,
            });
            d["wall_secs"] = json!(wall);
            details.insert(n.to_string(), d);
            runs.push(Run::new(
                format!("{n} documents into one space"),
                n as u64,
                ok,
                secs,
                "docs/s",
            ));
            runs.push(Run::new(
                format!("a second tenant's {SMALL} meanwhile"),
                SMALL as u64,
                small_ok,
                small_secs,
                "docs/s",
            ));
        }
        Ok((runs, details))
    })
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    let (runs, details) = result?;
    Ok(Report::of_runs(
        "bulk",
        "docs/s",
        runs,
        json!({ "sizes": sizes, "by_size": details }),
    ))
}
