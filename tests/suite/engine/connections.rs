//! Connections: a worker warns when the workers may need more than Postgres accepts, goes on
//! past the limit with those it has, keeps each kind to its own pool and its heartbeats alive,
//! and leaks none when an acquire gives up under contention.

use super::*;

/// Worker pools grow on demand, so workers that together may open more connections than
/// Postgres accepts would show it only under load, as steps waiting for a connection. A worker
/// whose live peers and itself, each opening as many as it may, would pass the limit says so
/// when it starts, with the numbers and what to change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_warns_at_start_when_the_workers_may_need_more_connections_than_postgres_accepts()
{
    let env = TestEnv::new().await;
    let usable: i64 = sqlx::query_scalar(
        "SELECT current_setting('max_connections')::bigint \
           - current_setting('superuser_reserved_connections')::bigint",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    // At prefetch 60 the probe's pool is capped at 56 and the shared pool has 8; with the liveness
    // lock, the relay's lead and watch sessions and the two heartbeat connections a worker may
    // open 69. Enough workers that together they would pass the limit.
    let per_worker = 69;
    let needed = usable / per_worker + 1;
    let mut workers = Vec::new();
    let held = || async { kfs_worker::liveness::count_live(&env.pool).await.unwrap() };
    for i in 0..needed {
        let id = format!("cap-{i}");
        workers.push(env.spawn_worker(
            &id,
            &["run", "--kinds", "probe", "--worker-id", &id],
            &[("KFS_PREFETCH", "60")],
        ));
        // Each starts once the one before it holds its liveness lock, so the last sees them all.
        let want = i + 1;
        assert!(
            env.wait_until(Duration::from_secs(30), || async { held().await >= want })
                .await,
            "{}",
            workers.last().unwrap().tail(20)
        );
    }
    let last = workers.last().unwrap();
    let warned = env
        .wait_until(Duration::from_secs(10), || async {
            last.log_text()
                .contains("Postgres may run out of connections")
        })
        .await;
    let log = last.log_text();
    assert!(warned, "{}", last.tail(30));
    assert!(
        log.contains(&format!(
            "{needed} worker process(es) at up to {per_worker} connections each"
        )),
        "{log}"
    );
    assert!(log.contains(&format!("Postgres accepts {usable}")), "{log}");
    assert!(log.contains("Lower KFS_PREFETCH"), "{log}");
    support::stop_cleanly(&mut workers, Duration::from_secs(30)).await;
    env.cleanup().await;
}

/// Past Postgres' connection limit every new session is refused. A worker whose pool may grow
/// past it must go on with the connections it has: a delivery that finds none idle takes the
/// next one its pool gets back, instead of retrying a refused connect until the acquire
/// timeout (30 s) and logging a failed claim; and `/readyz`, asked meanwhile, must not call
/// Postgres unreachable because no new session is to be had. The limit here is a role's
/// `CONNECTION LIMIT`, so that the rest of the cluster, and the tests running beside this one,
/// keep theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_past_the_connection_limit_goes_on_with_the_connections_it_has_and_stays_ready() {
    let limit: i64 = 8;
    let (role, env, url) = capped_role(limit).await;
    let role = &role.name;
    let jobs = 300;
    probe::enqueue_many(
        &env.pool,
        jobs,
        &ProbeSpec {
            steps: 2,
            step_sleep: Duration::from_millis(10),
            ..ProbeSpec::default()
        },
    )
    .await
    .unwrap();
    // Prefetch 16: the probe's pool may open 16 sessions and the shared pool 8, three times what
    // the role is allowed.
    let addr = support::free_port();
    let mut w = env.spawn_worker(
        "capped",
        &["run", "--kinds", "probe", "--worker-id", "capped"],
        &[
            ("DATABASE_URL", url.as_str()),
            ("KFS_PREFETCH", "16"),
            ("KFS_HTTP_ADDR", &addr.to_string()),
        ],
    );
    let peak = std::sync::atomic::AtomicI64::new(0);
    let was_ready = std::sync::atomic::AtomicBool::new(false);
    let unready = std::sync::Mutex::new(Vec::new());
    let finished = env
        .wait_until(Duration::from_secs(120), || async {
            let (code, body) = support::http_get(addr, "/readyz").await;
            if code == 200 {
                was_ready.store(true, std::sync::atomic::Ordering::Relaxed);
            } else if was_ready.load(std::sync::atomic::Ordering::Relaxed) {
                unready.lock().unwrap().push(format!("{code}: {body}"));
            }
            let sessions: i64 =
                sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE usename = $1")
                    .bind(role)
                    .fetch_one(&env.pool)
                    .await
                    .unwrap();
            peak.fetch_max(sessions, std::sync::atomic::Ordering::Relaxed);
            support::probe_succeeded(&env.pool).await == jobs
        })
        .await;
    assert!(finished, "{}", w.tail(30));
    support::stop_cleanly([&mut w], Duration::from_secs(30)).await;
    let log = w.log_text();
    // The pool did reach the limit, so Postgres refused the sessions it tried to add.
    assert_eq!(
        peak.into_inner(),
        limit,
        "the worker never reached the role's connection limit"
    );
    // Only the deliveries must not wait. The relay's watch session is the one session that
    // asks for a connection of its own; past the limit it may find none within its call
    // timeout, and the relay then goes on being woken by notifications, as designed.
    let waited: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("timed out") || l.contains("claim failed"))
        .filter(|l| !l.contains("relay lost its watch session"))
        .collect();
    assert!(
        waited.is_empty(),
        "a delivery waited for a refused connection:\n{}",
        waited.join("\n")
    );
    assert_eq!(ran_again(&env.pool).await, 0, "every job ran once");
    assert!(
        was_ready.into_inner(),
        "/readyz never answered 200:\n{}",
        w.tail(30)
    );
    let unready = unready.into_inner().unwrap();
    assert!(
        unready.is_empty(),
        "/readyz went unready {} times while the worker ran; first: {}",
        unready.len(),
        unready[0]
    );
    support::assert_probe_invariants(&env.pool).await;
    env.cleanup().await;
}

/// Each kind a worker consumes takes its connections from a pool of its own, named for it in
/// `pg_stat_activity`: a burst of one kind holds at most its own pool (its prefetch, one job per
/// connection here), never the connections of another kind or those the relay and HTTP share.
/// The heartbeats' pool and the relay's own sessions carry names of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_one_kind_holds_only_the_connections_of_its_own_pool() {
    let env = TestEnv::new().await;
    let jobs = 24;
    probe::enqueue_many(
        &env.pool,
        jobs,
        &ProbeSpec {
            steps: 3,
            step_sleep: Duration::from_millis(100),
            ..ProbeSpec::default()
        },
    )
    .await
    .unwrap();
    let mut w = env.spawn_worker(
        "pools",
        &["run", "--kinds", "probe,compile", "--worker-id", "pools"],
        &[("KFS_PREFETCH", "4"), ("KFS_BATCH_MAX", "1")],
    );
    let peaks = std::sync::Mutex::new(std::collections::HashMap::<String, i64>::new());
    let finished = env
        .wait_until(Duration::from_secs(120), || async {
            let sessions: Vec<(String, i64)> = sqlx::query_as(
                "SELECT application_name, count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND application_name LIKE 'kfs-worker pools%' \
                 GROUP BY 1",
            )
            .fetch_all(&env.pool)
            .await
            .unwrap();
            {
                let mut peaks = peaks.lock().unwrap();
                for (name, n) in sessions {
                    let peak = peaks.entry(name).or_default();
                    *peak = (*peak).max(n);
                }
            }
            support::probe_succeeded(&env.pool).await == jobs
        })
        .await;
    assert!(finished, "{}", w.tail(30));
    support::stop_cleanly([&mut w], Duration::from_secs(30)).await;
    let peaks = peaks.into_inner().unwrap();
    assert_eq!(
        peaks.get("kfs-worker pools probe").copied(),
        Some(4),
        "the probe's slices did not run on a pool of their own, of its prefetch: {peaks:?}"
    );
    // Compile's pool keeps the one connection it opened at start, and no more.
    assert_eq!(
        peaks.get("kfs-worker pools compile").copied(),
        Some(1),
        "the probe's burst took connections of compile's pool: {peaks:?}"
    );
    // Every other session is named for what it serves, so the shared pool is counted alone.
    assert!(
        peaks.get("kfs-worker pools").is_some_and(|&n| n <= 8),
        "the relay's shared pool is missing or past its 8 connections: {peaks:?}"
    );
    assert_eq!(
        peaks.get("kfs-worker pools heartbeats").copied(),
        Some(2),
        "the heartbeats' two connections: {peaks:?}"
    );
    assert_eq!(
        peaks.get("kfs-worker pools relay lead").copied(),
        Some(1),
        "the relay's lead session: {peaks:?}"
    );
    assert!(
        peaks
            .get("kfs-worker pools relay watch")
            .is_none_or(|&n| n == 1),
        "at most one watch session: {peaks:?}"
    );
    support::assert_probe_invariants(&env.pool).await;
    env.cleanup().await;
}

/// How many probe jobs were claimed more than once.
async fn ran_again(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM kfs_probe_jobs WHERE execution_attempts <> 1")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A role that may open at most `limit` sessions, a `TestEnv`, and the env's URL as that role.
async fn capped_role(limit: i64) -> (DropRole, TestEnv, url::Url) {
    let role = DropRole {
        name: format!("kfs_capped_{}", uuid::Uuid::new_v4().simple()),
        _services: support::isolation::shared().await,
    };
    let env = TestEnv::new().await;
    let name = &role.name;
    for sql in [
        format!("CREATE ROLE \"{name}\" LOGIN NOSUPERUSER CONNECTION LIMIT {limit}"),
        format!("GRANT pg_read_all_data, pg_write_all_data TO \"{name}\""),
    ] {
        sqlx::query(&sql).execute(&env.pool).await.unwrap();
    }
    let mut url = url::Url::parse(&env.url).unwrap();
    url.set_username(name).unwrap();
    url.set_password(None).unwrap();
    (role, env, url)
}

/// Past the connection limit, the slices of one kind must not take the sessions the worker's
/// other duties need: the heartbeats above all, without which every slice longer than a lease
/// loses it. Eight lone slices of 4 s under a 3 s lease, with a role allowed 8 sessions: the
/// kind's pool may open 16, so it takes every session left once they start; a heartbeat pool
/// that opened its connections only when the first heartbeat fell due found none, and the
/// jobs lost their leases and ran again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_at_the_connection_limit_keeps_heartbeating_while_its_slices_hold_every_other_session(
) {
    let (role, env, url) = capped_role(8).await;
    let jobs = 8;
    probe::enqueue_many(
        &env.pool,
        jobs,
        &ProbeSpec {
            steps: 10,
            step_sleep: Duration::from_millis(400),
            ..ProbeSpec::default()
        },
    )
    .await
    .unwrap();
    let mut w = env.spawn_worker(
        "capped-beats",
        &["run", "--kinds", "probe", "--worker-id", "capped-beats"],
        &[
            ("DATABASE_URL", url.as_str()),
            ("KFS_PREFETCH", "16"),
            ("KFS_BATCH_MAX", "1"),
            ("KFS_RELAY_WINDOW", "64"),
            ("KFS_LEASES", "probe=3s"),
        ],
    );
    let finished = env
        .wait_until(Duration::from_secs(120), || async {
            support::probe_succeeded(&env.pool).await == jobs
        })
        .await;
    assert!(finished, "{}", w.tail(30));
    support::stop_cleanly([&mut w], Duration::from_secs(30)).await;
    let log = w.log_text();
    assert!(
        !log.contains("lease lost") && !log.contains("heartbeat failed"),
        "a slice went without its heartbeats:\n{}",
        w.tail(40)
    );
    assert_eq!(ran_again(&env.pool).await, 0, "every job ran once");
    support::assert_probe_invariants(&env.pool).await;
    env.cleanup().await;
    drop(role);
}

/// Drops a role created by a test when the test ends, passed or failed; after the test's
/// database is gone, since the role holds privileges there. It holds the shared services
/// until then, as the test's `TestEnv` no longer does.
struct DropRole {
    name: String,
    _services: support::isolation::Services,
}

impl Drop for DropRole {
    fn drop(&mut self) {
        let sql = format!("DROP ROLE IF EXISTS \"{}\"", self.name);
        support::block_on_aside(async move {
            use sqlx::Connection;
            if let Ok(mut admin) = sqlx::PgConnection::connect(&support::admin_url()).await {
                let _ = sqlx::query(&sql).execute(&mut admin).await;
                let _ = admin.close().await;
            }
        });
    }
}

/// `db::acquire` gives up on sqlx's own acquire when one of the pool's connections comes back
/// first, and drops it, sometimes in the middle of a connect or a ping. Under contention that
/// must leak nothing: afterwards every connection the pool counts is idle, and the pool closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acquiring_past_the_patience_under_contention_leaks_no_connection() {
    let env = TestEnv::new().await;
    // As the tests' own pools are: a ping before each checkout, a few connections.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(3)
        .connect(&env.url)
        .await
        .unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..24u64 {
        let pool = pool.clone();
        tasks.spawn(async move {
            for j in 0..15u64 {
                let mut conn = kfs_worker::db::acquire(&pool).await.expect("acquire");
                sqlx::query("SELECT pg_sleep($1)")
                    .bind(((i * 7 + j * 3) % 5) as f64 / 100.0)
                    .execute(&mut *conn)
                    .await
                    .unwrap();
            }
        });
    }
    let all = tokio::time::timeout(Duration::from_secs(120), async {
        while let Some(done) = tasks.join_next().await {
            done.unwrap();
        }
    })
    .await;
    assert!(all.is_ok(), "the tasks did not finish");
    // Returned connections go back to the pool in the background.
    let settled = env
        .wait_until(Duration::from_secs(10), || async {
            pool.num_idle() as u32 == pool.size()
        })
        .await;
    assert!(
        settled,
        "{} connections counted, {} idle",
        pool.size(),
        pool.num_idle()
    );
    assert!(pool.size() <= 3);
    let closed = tokio::time::timeout(Duration::from_secs(10), pool.close()).await;
    assert!(
        closed.is_ok(),
        "the pool did not close: a connection was never returned"
    );
    env.cleanup().await;
}
