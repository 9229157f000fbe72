//! Scenario `fairness`: one tenant commits a backlog of document compiles, then a second tenant
//! commits five; how long the second tenant's five take from their commit to done, next to how
//! long the backlog takes. Run twice in the same run: with the relay's window
//! (`--relay-window`, by default `auto`, as `kfs-worker run`) and with no window (every due row
//! published at once, as a relay that hands its backlog to the broker's FIFO queue does).
//! Invariant: each variant runs in a fresh database of its own; times come from Postgres' clock
//! (the commit and the attempts' `completed_at`); a job counts as done only when its row says
//! it succeeded.

use std::time::Duration;

use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use super::{run_options, wait_for, with_runtime, Params};
use crate::config;
use crate::jobs::{compile, Kind};
use crate::relay::window::Windows;
use crate::store::Store;
use crate::tools::bench::env::BenchEnv;
use crate::tools::bench::report::{Progress, Report, Run};
use crate::tools::platform;

const SUBJECT: &str = "bench-user";
/// The second tenant's jobs.
const SECOND: usize = 5;

/// Requests the compilation of `docs` in one transaction; returns the attempts and Postgres'
/// clock right after the commit.
async fn commit_compiles(
    pool: &PgPool,
    docs: &[Uuid],
) -> Result<(Vec<Uuid>, chrono::DateTime<chrono::Utc>), String> {
    let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
    let mut ids = Vec::with_capacity(docs.len());
    for &doc in docs {
        ids.push(
            compile::request::request(&mut tx, doc, compile::request::RequestOptions::default())
                .await
                .map_err(|e| format!("compile request: {e}"))?,
        );
    }
    tx.commit().await.map_err(|e| e.to_string())?;
    let now: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await
        .map_err(|e| e.to_string())?;
    Ok((ids, now))
}

/// `(succeeded, finished, seconds from `since` to the last completion)` of `ids`.
async fn finished(
    pool: &PgPool,
    ids: &[Uuid],
    since: chrono::DateTime<chrono::Utc>,
) -> Result<(u64, u64, f64), String> {
    let (ok, fin, secs): (i64, i64, Option<f64>) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE run_state = 'succeeded'), \
           count(*) FILTER (WHERE run_state IN ('succeeded', 'failed', 'canceled', 'superseded')), \
           extract(epoch FROM max(completed_at) - $2)::float8 \
         FROM document_compilation_attempts WHERE id = ANY($1)",
    )
    .bind(ids)
    .bind(since)
    .fetch_one(pool)
    .await
    .map_err(|e| e.to_string())?;
    Ok((ok as u64, fin as u64, secs.unwrap_or(0.0).max(0.0)))
}

/// Waits until `ids` are finished (polling every `poll`) and reports them from `since`.
async fn until_done(
    env: &BenchEnv,
    p: &Params,
    ids: &[Uuid],
    since: chrono::DateTime<chrono::Utc>,
    poll: Duration,
    label: String,
) -> Result<Run, String> {
    let n = ids.len() as u64;
    let progress = Progress::new(format!("fairness: {label}"), n, p.interactive);
    let got = wait_for(n, &progress, poll, || async {
        finished(&env.pool, ids, since).await.map(|f| f.1)
    })
    .await?;
    progress.finish(got);
    let (ok, _, secs) = finished(&env.pool, ids, since).await?;
    Ok(Run::new(label, n, ok, secs, "jobs/s"))
}

/// One variant in a database and an object store of its own. In one database, the variant run
/// second found the tables grown and analysed by the first, and ran its 600 compiles in 35-45 s
/// where the same variant run first took 89 s: the comparison measured the order, not the
/// window.
async fn in_fresh_database(
    services: &config::Services,
    p: &Params,
    name: &str,
    windows: Windows,
) -> Result<(Run, Run, i64), String> {
    let env = BenchEnv::new(services, "fairness").await?;
    let dir = std::env::temp_dir().join(format!("kfs-bench-{}", env.tag));
    let result = async {
        std::fs::create_dir_all(&dir).map_err(|e| format!("object store directory: {e}"))?;
        let store_url = format!("file://{}", dir.display());
        let store = Store::open(&config::object_store(&store_url).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
        variant(&env, p, &store, &store_url, name, windows).await
    }
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    env.cleanup().await;
    result
}

/// One variant: the backlog, then the second tenant's five, with `windows`.
async fn variant(
    env: &BenchEnv,
    p: &Params,
    store: &Store,
    store_url: &str,
    name: &str,
    windows: Windows,
) -> Result<(Run, Run, i64), String> {
    let backlog = p.fair_backlog as usize;
    let (bulk, second) = {
        let mut tx = env.pool.begin().await.map_err(|e| e.to_string())?;
        let bulk = platform::create_notes_space(
            &mut tx,
            store,
            &format!("bench-bulk-{name}"),
            SUBJECT,
            &format!("bulk-{name}"),
            backlog,
        )
        .await
        .map_err(|e| e.to_string())?;
        let second = platform::create_notes_space(
            &mut tx,
            store,
            &format!("bench-second-{name}"),
            SUBJECT,
            &format!("second-{name}"),
            SECOND,
        )
        .await
        .map_err(|e| e.to_string())?;
        tx.commit().await.map_err(|e| e.to_string())?;
        (bulk.documents, second.documents)
    };
    let mut opts = run_options(env, vec![Kind::Compile], p, store_url)?;
    opts.relay_cfg.windows = windows;
    let window = opts.relay_cfg.windows.of(Kind::Compile).messages(1, 0.0);
    let queue = env.topology.queue(Kind::Compile);
    let (small, big) = with_runtime(opts, async {
        env.wait_consumers(&queue, 1, Duration::from_secs(60))
            .await?;
        let (big_ids, big_at) = commit_compiles(&env.pool, &bulk).await?;
        let (small_ids, small_at) = commit_compiles(&env.pool, &second).await?;
        let small = until_done(
            env,
            p,
            &small_ids,
            small_at,
            Duration::from_millis(20),
            format!("second tenant's {SECOND}, commit to done ({name})"),
        )
        .await?;
        let big = until_done(
            env,
            p,
            &big_ids,
            big_at,
            Duration::from_millis(100),
            format!("first tenant's backlog of {backlog} ({name})"),
        )
        .await?;
        Ok((small, big))
    })
    .await?;
    Ok((small, big, window))
}

/// The second tenant's jobs behind a first tenant's backlog, with the window and without.
pub async fn fairness(services: &config::Services, p: &Params) -> Result<Report, String> {
    let with = in_fresh_database(services, p, "window", p.windows.clone()).await;
    let without = match &with {
        Ok(_) => in_fresh_database(services, p, "no window", Windows::unbounded()).await,
        Err(e) => Err(e.clone()),
    };
    let (small, big, window) = with?;
    let (small_fifo, big_fifo, _) = without?;
    let settings = json!({
        "backlog": p.fair_backlog,
        "second": SECOND,
        "inflight": p.inflight,
        "window": window,
        "second_secs": small.secs,
        "second_secs_without_window": small_fifo.secs,
        "backlog_secs": big.secs,
        "backlog_secs_without_window": big_fifo.secs,
        "target_second_secs": 5,
    });
    Ok(Report::of_runs(
        "fairness",
        "jobs/s",
        vec![small, big, small_fifo, big_fifo],
        settings,
    ))
}
