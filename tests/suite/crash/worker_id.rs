//! One worker id, one live process: a restart under the id is a new incarnation whose dead
//! predecessor is waited for and taken over at once, and a second live process is refused.

use super::*;

/// (job run_state, lease_expires_at, outbox status, outbox available_at)
type JobAndOutbox = (String, Option<DateTime<Utc>>, String, DateTime<Utc>);

/// A process restarted under the same worker id is another incarnation: the leases its
/// killed predecessor held name a holder whose liveness lock died with it, so they are taken over
/// at once, by the successor or anyone, and never mistaken for the successor's own. Under a
/// 300 s lease the jobs can only finish within the wait through that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_under_the_same_id_is_a_new_incarnation_and_its_predecessor_counts_as_dead() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new().await;
    install_claim_log(&env.pool).await;
    probe::enqueue_many(&env.pool, 4, &probe_spec(2, 3000))
        .await
        .unwrap();
    let e = base_env("probe=300s");
    let mut workers = vec![
        spawn(&env, "r", &["--relay", "--maintenance"], &e),
        spawn(&env, "w1", &["--consumer"], &e),
    ];
    let pool = env.pool.clone();
    let held = env
        .wait_until(Duration::from_secs(15), || {
            let pool = pool.clone();
            async move { count(&pool, "SELECT count(*) FROM kfs_probe_jobs WHERE run_state = 'running' AND split_part(worker_id, '#', 1) = 'w1'").await == 4 }
        })
        .await;
    assert!(held, "w1 never held the 4 jobs\n{}", workers[1].tail(20));
    let before: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT worker_id FROM kfs_probe_jobs WHERE run_state = 'running'",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(before.len(), 1, "one process holds them: {before:?}");
    let predecessor = before[0].clone();
    assert!(
        predecessor.starts_with("w1#") && predecessor.len() == "w1#".len() + 8,
        "a holder names the worker id and its incarnation: {predecessor}"
    );
    let alive = |holder: String| {
        let pool = env.pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>("SELECT kfs_worker_alive($1)")
                .bind(holder)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert!(alive(predecessor.clone()).await);

    workers[1].kill();
    workers[1] = spawn(&env, "w1", &["--consumer"], &e);
    let done = wait_all_terminal(&env, Duration::from_secs(60)).await;
    assert!(
        done,
        "the predecessor's jobs wait for their 300 s leases: {:?}\n{}",
        support::probe_states(&env.pool).await,
        workers[1].tail(20)
    );
    let successors: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT worker_id FROM crash_claims WHERE worker_id <> $1")
            .bind(&predecessor)
            .fetch_all(&env.pool)
            .await
            .unwrap();
    assert_eq!(successors.len(), 1, "{successors:?}");
    let successor = successors[0].clone();
    assert!(successor.starts_with("w1#"), "{successor}");
    assert!(
        alive(successor.clone()).await,
        "the restarted w1 ({successor}) is alive"
    );
    assert!(
        !alive(predecessor.clone()).await,
        "its predecessor ({predecessor}) is dead, though both run under the id w1"
    );
    support::stop_cleanly(&mut workers, Duration::from_secs(20)).await;
    assert_history(&env.pool).await;
    env.cleanup().await;
}

/// The id lock of `id` held by a session of the test, as a predecessor's session that Postgres
/// has not yet seen die holds it.
async fn hold_id_lock(env: &TestEnv, id: &str) -> sqlx::PgConnection {
    use sqlx::Connection as _;
    let mut conn = sqlx::PgConnection::connect(&env.url).await.unwrap();
    let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, hashtext($2))")
        .bind(kfs_worker::liveness::ID_NAMESPACE)
        .bind(id)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert!(got);
    conn
}

/// A process restarted the moment its predecessor died may find the predecessor's session not
/// yet gone, still holding the worker id's lock. It waits for it (up to the connect timeout)
/// instead of exiting, so a crash-restart is not refused and its predecessor's jobs are taken
/// over at once rather than after a crash-loop backoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_waits_for_its_dead_predecessors_session_instead_of_failing() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new().await;
    let predecessor = hold_id_lock(&env, "w1").await;
    let mut w = spawn(&env, "w1", &["--consumer"], &base_env("probe=10s"));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        w.child.try_wait().unwrap().is_none(),
        "the restart gave up while its predecessor's session lingered\n{}",
        w.tail(20)
    );
    sqlx::Connection::close(predecessor).await.ok();
    let live = env
        .wait_until(Duration::from_secs(15), || async {
            kfs_worker::liveness::count_live(&env.pool).await.unwrap() == 1
        })
        .await;
    assert!(
        live,
        "w1 never took its id once it was free\n{}",
        w.tail(20)
    );
    support::stop_cleanly([&mut w], Duration::from_secs(20)).await;
    env.cleanup().await;
}

/// Two live processes never share a worker id: the second one waits the connect timeout for
/// the id, then exits with one error that names the id, and the first runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_live_process_under_the_same_id_is_refused_with_one_clear_error() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new().await;
    let e = base_env("probe=10s");
    let mut first = spawn(&env, "w1", &["--consumer"], &e);
    let live = env
        .wait_until(Duration::from_secs(15), || async {
            kfs_worker::liveness::count_live(&env.pool).await.unwrap() == 1
        })
        .await;
    assert!(live, "w1 never started\n{}", first.tail(20));
    let mut second = spawn(
        &env,
        "w1",
        &["--consumer"],
        &[("KFS_CONNECT_TIMEOUT", "2s")],
    );
    let status = second.exited(Duration::from_secs(30)).await;
    assert!(
        status.is_some_and(|s| !s.success()),
        "a second live w1 was not refused: {status:?}\n{}",
        second.tail(20)
    );
    let log = second.log_text();
    assert!(
        log.contains("worker id \"w1\" is already in use by a live process"),
        "{log}"
    );
    assert_eq!(
        kfs_worker::liveness::count_live(&env.pool).await.unwrap(),
        1
    );
    support::stop_cleanly([&mut first], Duration::from_secs(20)).await;
    env.cleanup().await;
}

/// The focused reproduction of what stalls the same-id run. Worker w1 (consumer only) holds 4
/// long jobs under a 10 s lease; R runs the relay and maintenance, no consumer. w1 is
/// SIGKILLed; R's sweeper sees w1 dead and re-arms its leased outbox rows, and R's relay
/// publishes them again. Then w1 restarts under the same id and receives those deliveries:
/// with its liveness lock back, the predecessor's unexpired leases count as live, the claim
/// says Duplicate and commits nothing, and the relay has already marked the rows `dispatched`
/// until now + visibility (300 s). The heartbeat that would have moved them belongs to the
/// dead process, and the sweeper only looks at `leased` rows, so when the old leases expire
/// nothing publishes the jobs again. Expected: they finish within a lease or so (30 s bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_under_the_same_worker_id_strands_the_old_leases() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new().await;
    install_claim_log(&env.pool).await;
    probe::enqueue_many(&env.pool, 4, &probe_spec(2, 3000))
        .await
        .unwrap();
    let e = base_env("probe=10s");
    let mut workers = vec![
        spawn(&env, "r", &["--relay", "--maintenance"], &e),
        spawn(&env, "w1", &["--consumer"], &e),
    ];
    let pool = env.pool.clone();
    let running = env
        .wait_until(Duration::from_secs(15), || {
            let pool = pool.clone();
            async move { count(&pool, "SELECT count(*) FROM kfs_probe_jobs WHERE run_state = 'running' AND split_part(worker_id, '#', 1) = 'w1'").await == 4 }
        })
        .await;
    assert!(
        running,
        "w1 never held the 4 jobs: {:?}\n{}",
        support::probe_states(&env.pool).await,
        workers[1].tail(20)
    );
    workers[1].kill();
    let killed_at = db_now(&env.pool).await;
    let pool = env.pool.clone();
    let republished = env
        .wait_until(Duration::from_secs(10), || {
            let pool = pool.clone();
            async move {
                count(&pool, "SELECT count(*) FROM kfs_probe_outbox WHERE dispatch_attempts >= 2 AND status = 'dispatched'").await == 4
            }
        })
        .await;
    assert!(
        republished,
        "the sweeper and relay did not publish w1's jobs again\n{}",
        workers[0].tail(20)
    );
    workers[1] = spawn(&env, "w1", &["--consumer"], &e);
    let done = wait_all_terminal(&env, Duration::from_secs(30)).await;
    let rows: Vec<JobAndOutbox> = sqlx::query_as(
        "SELECT j.run_state, j.lease_expires_at, o.status, o.available_at FROM kfs_probe_jobs j \
         JOIN kfs_probe_outbox o ON o.probe_job_id = j.id ORDER BY j.id",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    println!("[same-id restart] killed at {killed_at}; (job state, lease expires, outbox status, outbox available at): {rows:?}");
    assert!(
        done,
        "jobs stranded 30 s after the restart (lease 10 s): {rows:#?}\n{}",
        workers[1].tail(20)
    );
    support::stop_cleanly(&mut workers, Duration::from_secs(20)).await;
    assert_history(&env.pool).await;
    env.cleanup().await;
}
