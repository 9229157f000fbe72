//! Starting a worker next to running steps: its start-up does not deadlock with a step
//! transaction that ends its slice.

use super::*;

/// Every `run` with the probe kind starts with `probe::install`, a multi-statement script that
/// Postgres runs as one implicit transaction; `CREATE INDEX IF NOT EXISTS` takes a SHARE lock
/// on its table even when the index exists, and keeps it to the end of that transaction. So a
/// starting worker holds SHARE on `kfs_probe_outbox` while it waits for SHARE on
/// `kfs_probe_effects`. A running step's transaction holds ROW EXCLUSIVE on the effects (its
/// insert) and then, when the step ends the slice, wants ROW EXCLUSIVE on the outbox: a
/// deadlock. The test plays that step transaction with the same two locks in the same order
/// (what `run_slice` does for a final step), so the interleaving is certain rather than lucky.
/// Seen unprovoked in the same-id 1,000-job run: a restarted worker exited 2 with
/// "deadlock detected".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_start_does_not_deadlock_with_running_steps() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new().await;
    // A step transaction that has inserted its effect row...
    let mut step = env.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE kfs_probe_effects IN ROW EXCLUSIVE MODE")
        .execute(&mut *step)
        .await
        .unwrap();
    let mut w = spawn(&env, "late", &[], &base_env("probe=10s"));
    let pool = env.pool.clone();
    let waiting = env
        .wait_until(Duration::from_secs(10), || {
            let pool = pool.clone();
            async move {
                count(
                    &pool,
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'kfs-worker late' AND wait_event_type = 'Lock'",
                )
                .await
                    > 0
            }
        })
        .await;
    let blocked: Vec<(Option<String>, Vec<i32>)> = sqlx::query_as(
        "SELECT left(query, 80), pg_blocking_pids(pid) FROM pg_stat_activity \
         WHERE application_name = 'kfs-worker late' AND wait_event_type = 'Lock'",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    // ...and now ends its slice: the outbox row update.
    let ended = tokio::time::timeout(
        Duration::from_secs(10),
        sqlx::query("LOCK TABLE kfs_probe_outbox IN ROW EXCLUSIVE MODE").execute(&mut *step),
    )
    .await;
    let step_result = match &ended {
        Ok(Ok(_)) => "committed".to_owned(),
        Ok(Err(e)) => format!("failed: {e}"),
        Err(_) => "still blocked after 10 s".to_owned(),
    };
    if matches!(ended, Ok(Ok(_))) {
        step.commit().await.unwrap();
    } else {
        drop(step);
    }
    let exit = w.exited(Duration::from_secs(3)).await;
    println!(
        "[startup vs step] worker start waited on a lock: {waiting} ({blocked:?}); the step transaction {step_result}; \
         worker exit: {exit:?}"
    );
    assert!(
        exit.is_none(),
        "the starting worker died ({exit:?}) while a step transaction ran\n{}",
        w.tail(10)
    );
    assert!(
        matches!(ended, Ok(Ok(_))),
        "the running step could not end its slice: {step_result}"
    );
    let mut workers = vec![w];
    support::stop_cleanly(&mut workers, Duration::from_secs(20)).await;
    env.cleanup().await;
}
