//! A dead worker's jobs are made due by the sweep, once, and a live worker's left alone; a
//! blip of a healthy worker's liveness session neither steals nor fails its job.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_makes_a_dead_workers_jobs_due_and_leaves_a_live_workers_alone() {
    let env = TestEnv::new().await;
    probe::enqueue_many(&env.pool, 2, &ProbeSpec::default())
        .await
        .unwrap();
    // Both jobs leased for ten minutes: one by a live worker (it holds its liveness lock), one
    // by a worker whose process is gone.
    sqlx::query(
        "WITH j AS (SELECT id, row_number() OVER (ORDER BY id) AS n FROM kfs_probe_jobs) \
         UPDATE kfs_probe_jobs p SET run_state = 'running', worker_id = CASE WHEN j.n = 1 THEN 'alive' ELSE 'gone' END, \
           lease_token = gen_random_uuid(), lease_expires_at = now() + interval '10 minutes', heartbeat_at = now() \
         FROM j WHERE p.id = j.id",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE kfs_probe_outbox SET status = 'leased', queue_job_id = 'd-' || id, \
           available_at = now() + interval '10 minutes'",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    let _alive = kfs_worker::liveness::acquire(&env.services().database_url, "alive")
        .await
        .unwrap();

    assert_eq!(
        kfs_worker::maintenance::sweep_once(&env.pool, Kind::Probe)
            .await
            .unwrap(),
        1
    );
    let due: Vec<(String, bool)> = sqlx::query_as(
        "SELECT j.worker_id, o.available_at <= now() FROM kfs_probe_jobs j \
         JOIN kfs_probe_outbox o ON o.probe_job_id = j.id ORDER BY j.worker_id",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        due,
        vec![("alive".to_owned(), false), ("gone".to_owned(), true)]
    );
    // Nothing else changed: the sweep never decides who runs a job, the claim does.
    let running: i64 =
        sqlx::query_scalar("SELECT count(*) FROM kfs_probe_jobs WHERE run_state = 'running'")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(running, 2);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_rearms_a_dead_workers_job_once_not_every_sweep_until_it_is_claimed() {
    let env = TestEnv::new().await;
    probe::enqueue_many(&env.pool, 1, &ProbeSpec::default())
        .await
        .unwrap();
    sqlx::query(
        "UPDATE kfs_probe_jobs SET run_state = 'running', worker_id = 'gone', lease_token = gen_random_uuid(), \
           lease_expires_at = now() + interval '10 minutes', heartbeat_at = now()",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE kfs_probe_outbox SET status = 'leased', queue_job_id = 'd-' || id, \
           available_at = now() + interval '10 minutes'",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    let sweep = || kfs_worker::maintenance::sweep_once(&env.pool, Kind::Probe);
    assert_eq!(
        sweep().await.unwrap(),
        1,
        "the dead worker's row is made due"
    );
    // The relay publishes it again: `dispatched` under a new delivery id, visible again later.
    sqlx::query(
        "UPDATE kfs_probe_outbox SET status = 'dispatched', queue_job_id = gen_random_uuid()::text, \
           dispatch_attempts = dispatch_attempts + 1, available_at = now() + interval '20 seconds'",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    // Until a consumer reaches that message (behind a backlog, say), later sweeps must not
    // publish it again and again: each copy would be stale when consumed, and each would use a
    // dispatch attempt until the job failed for dispatch exhaustion.
    for _ in 0..3 {
        assert_eq!(
            sweep().await.unwrap(),
            0,
            "a republished row is left to its message"
        );
    }
    let (status, attempts, later): (String, i32, bool) = sqlx::query_as(
        "SELECT status::text, dispatch_attempts, available_at > now() FROM kfs_probe_outbox",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), attempts, later), ("dispatched", 1, true));
    env.cleanup().await;
}

/// A healthy worker never loses a job, or its last attempt, to a blip of its own liveness
/// session: the job's message published again while that session is gone finds the job its
/// holder's, and the holder finishes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_liveness_blip_neither_steals_nor_fails_a_job_on_its_last_attempt() {
    let env = TestEnv::new().await;
    // One job on its only attempt, and one with an attempt left that a takeover could use.
    let mut jobs = Vec::new();
    for max_attempts in [1, 2] {
        let (job, outbox) = support::enqueue_one(
            &env.pool,
            &ProbeSpec {
                steps: 3,
                step_sleep: Duration::from_millis(1500),
                max_attempts,
                ..ProbeSpec::default()
            },
        )
        .await;
        jobs.push((max_attempts, job, outbox));
    }
    let mut w = env.spawn_worker(
        "blip",
        &["run", "--kinds", "probe", "--worker-id", "blip"],
        &[("KFS_RELAY_POLL", "100ms")],
    );
    let ids: Vec<uuid::Uuid> = jobs.iter().map(|j| j.1).collect();
    let running = env
        .wait_until(Duration::from_secs(20), || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT bool_and(run_state = 'running' AND split_part(worker_id, '#', 1) = 'blip') FROM kfs_probe_jobs WHERE id = ANY($1)",
            )
            .bind(&ids)
            .fetch_one(&env.pool)
            .await
            .unwrap()
        })
        .await;
    assert!(running, "{}", w.tail(20));
    // The liveness session only, then at once the jobs' messages again.
    let ended: i64 = sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = current_database() \
           AND (application_name = 'kfs-worker liveness blip' OR application_name LIKE 'kfs-worker liveness blip on %')",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(ended, 1, "the liveness session was found");
    let outboxes: Vec<uuid::Uuid> = jobs.iter().map(|j| j.2).collect();
    sqlx::query("UPDATE kfs_probe_outbox SET available_at = now() WHERE id = ANY($1)")
        .bind(&outboxes)
        .execute(&env.pool)
        .await
        .unwrap();
    let done = env
        .wait_until(Duration::from_secs(30), || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT bool_and(run_state IN ('succeeded', 'failed')) FROM kfs_probe_jobs WHERE id = ANY($1)",
            )
            .bind(&ids)
            .fetch_one(&env.pool)
            .await
            .unwrap()
        })
        .await;
    let log = w.log_text();
    w.kill();
    assert!(done, "{log}");
    for (max_attempts, job, _) in jobs {
        let (state, attempts, code): (String, i32, Option<String>) = sqlx::query_as(
            "SELECT run_state::text, execution_attempts, last_error_code FROM kfs_probe_jobs WHERE id = $1",
        )
        .bind(job)
        .fetch_one(&env.pool)
        .await
        .unwrap();
        assert_eq!(
            (state.as_str(), attempts, code.as_deref()),
            ("succeeded", 1, None),
            "max_execution_attempts = {max_attempts}\n{log}"
        );
        let effects: Vec<(String, i64)> = sqlx::query_as(
            "SELECT split_part(worker_id, '#', 1), count(*) FROM kfs_probe_effects WHERE job_id = $1 GROUP BY 1",
        )
        .bind(job)
        .fetch_all(&env.pool)
        .await
        .unwrap();
        assert_eq!(
            effects,
            vec![("blip".to_owned(), 3)],
            "max_execution_attempts = {max_attempts}: each step once, by its holder"
        );
    }
    assert!(
        !log.contains("lease lost"),
        "the holder kept its leases\n{log}"
    );
    env.cleanup().await;
}
