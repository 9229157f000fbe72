//! End to end through real Postgres and RabbitMQ: the whole protocol in one process.

use std::time::Duration;

use kfs_worker::consumer::ConsumerConfig;
use kfs_worker::jobs::probe::{self, ProbeSpec};
use kfs_worker::jobs::Kind;
use kfs_worker::maintenance::MaintenanceConfig;
use kfs_worker::relay::RelayConfig;
use kfs_worker::runtime::{self, RunOptions};
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use tokio_util::sync::CancellationToken;

use crate::support::{self, TestEnv};

/// A whole runtime of the probe kind for `env` (every role but the leased jobs).
pub(crate) fn options(env: &TestEnv, worker: &str) -> RunOptions {
    RunOptions {
        services: env.services(),
        object_store: kfs_worker::config::object_store("memory://").unwrap(),
        worker_id: worker.into(),
        kinds: vec![Kind::Probe],
        relay: true,
        consumer: true,
        maintenance: true,
        leased: None,
        relay_cfg: RelayConfig {
            poll: Duration::from_millis(200),
            ..RelayConfig::default()
        },
        consumer_cfg: ConsumerConfig::default(),
        maintenance_cfg: MaintenanceConfig::default(),
        http_addr: None,
        admin_token: None,
        embedder: kfs_worker::embed::EmbedderConfig::Offline,
        reasoner: Default::default(),
        parser: Default::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jobs_flow_from_outbox_to_success_and_poison_goes_to_the_dead_letter_queue() {
    let env = TestEnv::new().await;
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(runtime::run(options(&env, "engine-e2e"), shutdown.clone()));

    probe::enqueue_many(
        &env.pool,
        200,
        &ProbeSpec {
            steps: 3,
            ..ProbeSpec::default()
        },
    )
    .await
    .unwrap();

    // A flood of undecodable messages on the live queue, interleaved with the real jobs.
    let ch = env.channel().await;
    let queue = env.topology.queue(Kind::Probe);
    let outbox_before: i64 = sqlx::query_scalar("SELECT count(*) FROM kfs_probe_outbox")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    let bodies: [&[u8]; 4] = [b"not json", b"{}", b"[1]", br#"{"probeJobId":"nope"}"#];
    for i in 0..200 {
        let mut headers = FieldTable::default();
        if i % 2 == 0 {
            headers.insert("x-kfs-schema-version".into(), AMQPValue::LongInt(1));
        }
        ch.basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            bodies[i % bodies.len()],
            BasicProperties::default()
                .with_message_id(format!("poison-{i}").into())
                .with_headers(headers),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }

    let done = env.wait_probe_succeeded(200, Duration::from_secs(60)).await;
    assert!(done, "jobs: {:?}", support::probe_states(&env.pool).await);
    support::assert_probe_invariants(&env.pool).await;

    let dlq = env.topology.dead_letter_queue();
    let dead_lettered = env
        .wait_until(Duration::from_secs(10), || async {
            env.queue_depth(&dlq).await == 200
        })
        .await;
    assert!(
        dead_lettered,
        "dead-letter queue holds {} of 200",
        env.queue_depth(&dlq).await
    );
    // The poison touched nothing: no row appeared, and every job is in the state its own work left.
    let outbox_after: i64 = sqlx::query_scalar("SELECT count(*) FROM kfs_probe_outbox")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(outbox_after, outbox_before);
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM kfs_probe_jobs")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(jobs, 200);

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(20), worker)
        .await
        .expect("shutdown within bound")
        .unwrap()
        .unwrap();
    assert_eq!(env.queue_depth(&queue).await, 0, "queue drained");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_old_finished_outbox_rows_in_batches_and_keeps_dead_and_recent_ones() {
    let env = TestEnv::new().await;
    probe::enqueue_many(&env.pool, 8, &ProbeSpec::default())
        .await
        .unwrap();
    // Six finished long ago (four completed, two canceled), one dead long ago, one completed now.
    sqlx::query(
        "WITH o AS (SELECT id, row_number() OVER (ORDER BY id) AS n FROM kfs_probe_outbox) \
         UPDATE kfs_probe_outbox p SET \
           status = CASE WHEN o.n <= 4 THEN 'completed' WHEN o.n <= 6 THEN 'canceled' WHEN o.n = 7 THEN 'dead' ELSE 'completed' END, \
           updated_at = CASE WHEN o.n <= 7 THEN now() - interval '8 days' ELSE now() END \
         FROM o WHERE p.id = o.id",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    let week = Duration::from_secs(7 * 24 * 3600);
    let first = kfs_worker::maintenance::retention_once(&env.pool, Kind::Probe, week, 4)
        .await
        .unwrap();
    assert_eq!(first, 4, "one batch at a time");
    let second = kfs_worker::maintenance::retention_once(&env.pool, Kind::Probe, week, 4)
        .await
        .unwrap();
    assert_eq!(second, 2);
    let third = kfs_worker::maintenance::retention_once(&env.pool, Kind::Probe, week, 4)
        .await
        .unwrap();
    assert_eq!(third, 0);
    let left: Vec<(String,)> =
        sqlx::query_as("SELECT status FROM kfs_probe_outbox ORDER BY status")
            .fetch_all(&env.pool)
            .await
            .unwrap();
    assert_eq!(
        left,
        vec![("completed".to_owned(),), ("dead".to_owned(),)],
        "the recent row and the dead row stay"
    );
    env.cleanup().await;
}

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

/// A worker stopped by SIGTERM closes its channels and connections in order: an operator who
/// reads the log of a clean rolling restart should find no error in it. Each consumer channel
/// used to be closed in the background as it was dropped, racing the connection's close, and
/// lapin logged the lost race as a connection error in most stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stopped_by_sigterm_logs_no_error() {
    let env = TestEnv::new().await;
    probe::enqueue_many(&env.pool, 50, &ProbeSpec::default())
        .await
        .unwrap();
    let mut w = env.spawn_worker(
        "stop",
        &["run", "--kinds", "probe", "--worker-id", "stop"],
        &[],
    );
    let done = env.wait_probe_succeeded(50, Duration::from_secs(60)).await;
    assert!(done, "{}", w.tail(20));
    support::stop_cleanly([&mut w], Duration::from_secs(30)).await;
    let log = w.log_text();
    assert!(log.contains("shutdown requested"), "{}", w.tail(20));
    let errors: Vec<&str> = log.lines().filter(|l| l.contains(" ERROR ")).collect();
    assert!(
        errors.is_empty(),
        "errors in a clean stop:\n{}",
        errors.join("\n")
    );
    env.cleanup().await;
}

/// The relay's listener is set up beside its rounds, never before them. Its connection comes
/// from the pool, and past Postgres' connection limit the pool may wait up to its acquire
/// timeout for a session; meanwhile the relay must publish by polling. Here the listener's
/// setup never ends at all (a stall point), and the jobs enqueued after it began must still run.
#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_listener_never_comes_up_publishes_by_polling() {
    let env = TestEnv::new().await;
    let mut w = env.spawn_worker(
        "deaf",
        &["run", "--kinds", "probe", "--worker-id", "deaf"],
        &[("KFS_STALL_AT", "relay-listen")],
    );
    let stalled = env
        .wait_until(Duration::from_secs(30), || async {
            w.log_text().contains("stall point relay-listen reached")
        })
        .await;
    assert!(stalled, "the listener's setup never began:\n{}", w.tail(20));
    probe::enqueue_many(&env.pool, 20, &ProbeSpec::default())
        .await
        .unwrap();
    let done = env.wait_probe_succeeded(20, Duration::from_secs(60)).await;
    assert!(
        done,
        "jobs stayed unpublished while the listener was stalled: {:?}\n{}",
        support::probe_states(&env.pool).await,
        w.tail(20)
    );
    support::stop_cleanly([&mut w], Duration::from_secs(30)).await;
    support::assert_probe_invariants(&env.pool).await;
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

/// A log read from a file, journald or a container runtime must be plain text: colour codes
/// are for a terminal only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_logging_to_a_file_writes_no_colour_codes() {
    let env = TestEnv::new().await;
    let mut w = env.spawn_worker(
        "plain",
        &["run", "--kinds", "probe", "--worker-id", "plain"],
        &[],
    );
    let started = env
        .wait_until(Duration::from_secs(30), || async {
            w.log_text().contains("kfs-worker running")
        })
        .await;
    assert!(started, "{}", w.tail(20));
    support::stop_cleanly([&mut w], Duration::from_secs(30)).await;
    let log = w.log_text();
    assert!(log.contains(" INFO "), "{log}");
    assert!(
        !log.contains('\u{1b}'),
        "colour codes in a log file:\n{log}"
    );
    env.cleanup().await;
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

/// A kind defined outside the crate, registered the way the built-in kinds are (see the
/// README's "Adding a kind"): its identity and tables, its handler, its operator surface and
/// its migration, in one module, and one `register` call.
mod note {
    use std::sync::Arc;
    use std::time::Duration;

    use kfs_worker::jobs::operate::Operations;
    use kfs_worker::jobs::{
        Clock, Entry, Handler, JobCtx, JobError, Kind, KindSpec, Policy, RetryPolicy, States, Step,
    };
    use sqlx::{PgConnection, PgPool};

    pub const KIND: Kind = Kind::new("note");

    pub static SPEC: KindSpec = KindSpec {
        kind: KIND,
        event_type: "note.job",
        job_table: "kfs_note_jobs",
        outbox_table: "kfs_note_outbox",
        outbox_fk: "note_job_id",
        payload_id_field: "noteJobId",
        clock: Clock::Timestamptz,
        states: States::RunState {
            failed_keeps_slot: false,
        },
        superseded_state: false,
        // As research and deletion: each step transaction plans its statements once.
        generic_plans: true,
        fairness: None,
        revisions: true,
        max_connections: None,
        policy: Policy {
            lease: Duration::from_secs(30),
            max_attempts: 3,
            retry: RetryPolicy {
                base: Duration::from_secs(1),
                max: Duration::from_secs(10),
            },
        },
        record_failure: None,
    };

    pub static ENTRY: Entry = Entry {
        spec: &SPEC,
        default: false,
        handler: |_| Ok(Arc::new(NoteHandler)),
        ops: &Operations::NONE,
        prepare: Some(|pool| Box::pin(migrate(pool))),
    };

    /// Two steps, each recording its effect in the step's transaction, with the plan mode that
    /// transaction runs under.
    struct NoteHandler;

    #[async_trait::async_trait]
    impl Handler for NoteHandler {
        fn kind(&self) -> Kind {
            KIND
        }

        async fn step(&self, tx: &mut PgConnection, job: &JobCtx) -> Result<Step, JobError> {
            sqlx::query(
                "INSERT INTO kfs_note_effects (job_id, checkpoint, plans) \
                 VALUES ($1, $2, current_setting('plan_cache_mode'))",
            )
            .bind(job.job_id)
            .bind(&job.checkpoint)
            .execute(tx)
            .await?;
            Ok(match job.checkpoint.as_str() {
                "queued" => Step::Advance("written".into()),
                _ => Step::Succeed("done".into()),
            })
        }
    }

    /// The kind's migration: tables of the probe's shape, under its own names, in one
    /// transaction.
    async fn migrate(pool: &PgPool) -> Result<(), sqlx::Error> {
        let mut tx = pool.begin().await?;
        for ddl in [
            "CREATE TABLE IF NOT EXISTS kfs_note_jobs (LIKE kfs_probe_jobs INCLUDING DEFAULTS INCLUDING INDEXES)",
            "CREATE TABLE IF NOT EXISTS kfs_note_outbox (LIKE kfs_probe_outbox INCLUDING DEFAULTS INCLUDING INDEXES)",
            "DO $$ BEGIN ALTER TABLE kfs_note_outbox RENAME COLUMN probe_job_id TO note_job_id; \
             EXCEPTION WHEN undefined_column THEN NULL; END $$",
            "CREATE TABLE IF NOT EXISTS kfs_note_effects (job_id UUID NOT NULL, checkpoint TEXT NOT NULL, plans TEXT NOT NULL)",
        ] {
            sqlx::query(ddl).execute(&mut *tx).await?;
        }
        tx.commit().await
    }

    /// A note job and its outbox row, as the platform's API would write them.
    pub async fn enqueue(pool: &PgPool) -> uuid::Uuid {
        let id = uuid::Uuid::now_v7();
        sqlx::query(
            "WITH j AS ( \
               INSERT INTO kfs_note_jobs (id, checkpoint, run_state, active_slot, steps_total, \
                 execution_attempts, max_execution_attempts, row_version, created_at, updated_at) \
               VALUES ($1, 'queued', 'dispatch_pending', 1, 2, 0, 3, 1, now(), now()) RETURNING id) \
             INSERT INTO kfs_note_outbox (id, note_job_id, delivery_revision, event_type, schema_version, \
               idempotency_key, payload, status, available_at, dispatch_attempts, created_at, updated_at) \
             SELECT gen_random_uuid(), j.id, 1, 'note.job', 1, 'note.job:' || j.id || ':1', \
               jsonb_build_object('noteJobId', j.id), 'pending', now(), 0, now(), now() FROM j",
        )
        .bind(id)
        .execute(pool)
        .await
        .expect("enqueue a note job");
        id
    }
}

/// The registry is the process's, and the suite is one process: once this test ran, every
/// test after it sees the note kind too. Nothing there depends on it: a `TestEnv` declares and
/// deletes the note kind's queues with the others', workers serve only the kinds they are given
/// (the note kind is not a default one), and the decoding properties hold for every kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kind_registered_from_outside_runs_through_relay_and_consumer_like_a_built_in_one() {
    kfs_worker::jobs::register(&note::ENTRY).expect("the note kind registers");
    assert_eq!(
        kfs_worker::jobs::register(&note::ENTRY),
        Ok(()),
        "registering the same kind again does nothing"
    );
    assert_eq!(
        Kind::parse_list("note.job").unwrap(),
        vec![note::KIND],
        "--kinds knows it"
    );
    assert!(Kind::all().ends_with(&[note::KIND]), "{:?}", Kind::all());

    let env = TestEnv::new().await;
    let mut opts = options(&env, "note-worker");
    opts.kinds = vec![note::KIND];
    // The kind's migration runs when a worker that serves it starts.
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(runtime::run(opts, shutdown.clone()));
    let ready = env
        .wait_until(Duration::from_secs(30), || async {
            sqlx::query_scalar::<_, bool>("SELECT to_regclass('kfs_note_outbox') IS NOT NULL")
                .fetch_one(&env.pool)
                .await
                .unwrap()
        })
        .await;
    assert!(ready, "the kind's tables were prepared");
    let job = note::enqueue(&env.pool).await;
    let done = env
        .wait_until(Duration::from_secs(30), || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT run_state = 'succeeded' FROM kfs_note_jobs WHERE id = $1",
            )
            .bind(job)
            .fetch_one(&env.pool)
            .await
            .unwrap()
        })
        .await;
    assert!(done, "the note job succeeded");
    let effects: Vec<String> =
        sqlx::query_scalar("SELECT checkpoint FROM kfs_note_effects WHERE job_id = $1 ORDER BY 1")
            .bind(job)
            .fetch_all(&env.pool)
            .await
            .unwrap();
    assert_eq!(effects, vec!["queued", "written"], "each step once");
    let plans: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT plans FROM kfs_note_effects WHERE job_id = $1")
            .bind(job)
            .fetch_all(&env.pool)
            .await
            .unwrap();
    assert_eq!(
        plans,
        vec!["force_generic_plan"],
        "the steps ran under the plan mode the kind's spec asks for"
    );
    let outbox: String =
        sqlx::query_scalar("SELECT status FROM kfs_note_outbox WHERE note_job_id = $1")
            .bind(job)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(outbox, "completed");
    let status = kfs_worker::status::read(&env.pool, &[note::KIND])
        .await
        .unwrap();
    let text = serde_json::to_string(&status).unwrap();
    assert!(text.contains("note"), "status reports the kind: {text}");
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(30), worker).await;
    env.cleanup().await;
}

/// A leased kind defined here, on a table of its own: one step that records its effect, the
/// first time with its own session terminated before the engine writes the end.
mod flaky {
    use std::sync::atomic::{AtomicBool, Ordering};

    use kfs_worker::engine::lease::End;
    use kfs_worker::engine::leased::{ClaimRule, EndWrite, Lease, LeasedKind, Param};
    use kfs_worker::jobs::{JobError, Policy, RetryPolicy, Step};
    use sqlx::{PgConnection, PgPool};

    pub const TABLE: &str = "kfs_flaky_jobs";

    pub const SCHEMA: &str = "
        CREATE TABLE kfs_flaky_jobs (
          id uuid PRIMARY KEY, run_state text NOT NULL DEFAULT 'queued', checkpoint text NOT NULL DEFAULT 'start',
          row_version int NOT NULL DEFAULT 1, updated_at timestamptz NOT NULL DEFAULT now(),
          completed_at timestamptz, last_error_code text, last_error_message text,
          worker_id text, lease_token uuid, lease_expires_at timestamptz, heartbeat_at timestamptz);
        CREATE TABLE kfs_flaky_effects (job_id uuid NOT NULL, at timestamptz NOT NULL DEFAULT now());";

    /// Three attempts under `lease`, retried after 1 to 5 s.
    fn policy(lease: std::time::Duration) -> Policy {
        Policy {
            lease,
            max_attempts: 3,
            retry: RetryPolicy {
                base: std::time::Duration::from_secs(1),
                max: std::time::Duration::from_secs(5),
            },
        }
    }

    /// One row per run of a step, in the step's transaction.
    async fn record_effect(tx: &mut PgConnection, job: &Lease) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO kfs_flaky_effects (job_id) VALUES ($1)")
            .bind(job.job_id)
            .execute(tx)
            .await
            .map(|_| ())
    }

    /// Claims any queued row.
    pub fn rule() -> ClaimRule {
        ClaimRule {
            claimable: "j.run_state = 'queued' AND $4::int IS NOT NULL".into(),
            select: String::new(),
            set: String::new(),
            attempt: "1",
            max_attempts: None,
            param: Param::Int(0),
            exhausted: None,
        }
    }

    /// What each end writes on the test table.
    pub fn end_write(end: &End) -> EndWrite {
        let set = match end {
            End::Succeed { .. } => "run_state = 'succeeded', checkpoint = $4, completed_at = now()",
            End::Fail { .. } | End::Cancel { .. } | End::Supersede { .. } => {
                "run_state = 'failed', completed_at = now(), last_error_code = $4, last_error_message = $5"
            }
            End::Wait { .. } | End::Continue => "run_state = 'queued'",
        };
        let (text4, text5) = match end {
            End::Succeed { checkpoint } => (Some(checkpoint.clone()), None),
            End::Fail { code, message } | End::Cancel { code, message } => {
                (Some(code.clone()), Some(message.clone()))
            }
            _ => (None, None),
        };
        EndWrite {
            set: set.into(),
            text4,
            text5,
            ..EndWrite::default()
        }
    }

    pub struct Flaky {
        pub admin: PgPool,
        pub broken_once: AtomicBool,
        pub policy: Policy,
    }

    impl Flaky {
        pub fn new(admin: PgPool) -> Self {
            Flaky {
                admin,
                broken_once: AtomicBool::new(false),
                policy: policy(std::time::Duration::from_secs(30)),
            }
        }
    }

    #[async_trait::async_trait]
    impl LeasedKind for Flaky {
        fn name(&self) -> &'static str {
            "flaky"
        }
        fn table(&self) -> &'static str {
            TABLE
        }
        fn states(&self) -> &'static [&'static str] {
            &["queued", "running", "succeeded", "failed"]
        }
        fn policy(&self) -> &Policy {
            &self.policy
        }
        fn claim_rule(&self) -> ClaimRule {
            rule()
        }
        async fn step(&self, tx: &mut PgConnection, job: &Lease) -> Result<Step, JobError> {
            record_effect(tx, job).await?;
            if !self.broken_once.swap(true, Ordering::SeqCst) {
                // The step's own session dies before the engine writes the end: the end's
                // statement fails, and the step's effect is rolled back with it.
                let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                    .fetch_one(&mut *tx)
                    .await?;
                let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 5000)")
                    .bind(pid)
                    .fetch_one(&self.admin)
                    .await
                    .expect("terminate the step's session");
                assert!(killed, "the step's session was terminated");
            }
            Ok(Step::Succeed("done".into()))
        }
        fn end_write(&self, _job: &Lease, end: &End) -> EndWrite {
            end_write(end)
        }
    }

    /// Ten steps of 300 ms each inside their transactions, under a 1.5 s lease: the slice
    /// outlives its lease unless heartbeats extend it between steps.
    pub struct Steady {
        pub policy: Policy,
    }

    impl Steady {
        pub fn new() -> Self {
            Steady {
                policy: policy(std::time::Duration::from_millis(1500)),
            }
        }
    }

    #[async_trait::async_trait]
    impl LeasedKind for Steady {
        fn name(&self) -> &'static str {
            "steady"
        }
        fn table(&self) -> &'static str {
            TABLE
        }
        fn states(&self) -> &'static [&'static str] {
            &["queued", "running", "succeeded", "failed"]
        }
        fn policy(&self) -> &Policy {
            &self.policy
        }
        fn claim_rule(&self) -> ClaimRule {
            rule()
        }
        async fn step(&self, tx: &mut PgConnection, job: &Lease) -> Result<Step, JobError> {
            record_effect(tx, job).await?;
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            let n: i32 = job
                .checkpoint
                .strip_prefix("step-")
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
                + 1;
            Ok(if n >= 10 {
                Step::Succeed("done".into())
            } else {
                Step::Advance(format!("step-{n}"))
            })
        }
        fn end_write(&self, _job: &Lease, end: &End) -> EndWrite {
            end_write(end)
        }
    }
}

/// The slice runner is the same for leased kinds as for delivered ones: when the step's
/// connection dies before the end commits, the slice reads the row back, finds its lease still
/// live and runs the step again on a fresh connection, instead of leaving the job held until
/// its lease runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_slice_whose_connection_dies_resynchronises_and_finishes_once() {
    use kfs_worker::engine::leased::{self, Outcome};
    use kfs_worker::engine::slice::Budget;

    let env = TestEnv::new().await;
    sqlx::raw_sql(flaky::SCHEMA)
        .execute(&env.pool)
        .await
        .unwrap();
    let job = uuid::Uuid::new_v4();
    sqlx::query("INSERT INTO kfs_flaky_jobs (id) VALUES ($1)")
        .bind(job)
        .execute(&env.pool)
        .await
        .unwrap();
    let kind = flaky::Flaky::new(env.pool.clone());
    let ran = tokio::time::timeout(
        Duration::from_secs(60),
        leased::run_once(&env.pool, &kind, "w-flaky", Budget::default()),
    )
    .await
    .expect("the slice ended")
    .unwrap();
    let (_, outcome) = ran.expect("the job was claimed");
    assert!(
        kind.broken_once.load(std::sync::atomic::Ordering::SeqCst),
        "the step's session was terminated once"
    );
    assert_eq!(outcome, Outcome::Ended("succeeded"));
    let (state, token): (String, Option<uuid::Uuid>) =
        sqlx::query_as("SELECT run_state, lease_token FROM kfs_flaky_jobs WHERE id = $1")
            .bind(job)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!((state.as_str(), token), ("succeeded", None));
    let effects: i64 =
        sqlx::query_scalar("SELECT count(*) FROM kfs_flaky_effects WHERE job_id = $1")
            .bind(job)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(effects, 1, "the step's effect committed exactly once");
    env.cleanup().await;
}

/// A polled lease gives its connection back to the pool between steps, so its heartbeats get
/// one even from a pool of one: a slice longer than its lease keeps it and finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_slice_longer_than_its_lease_is_kept_alive_by_heartbeats_from_a_pool_of_one() {
    use kfs_worker::engine::leased::{self, Outcome};
    use kfs_worker::engine::slice::Budget;

    let env = TestEnv::new().await;
    sqlx::raw_sql(flaky::SCHEMA)
        .execute(&env.pool)
        .await
        .unwrap();
    let job = uuid::Uuid::new_v4();
    sqlx::query("INSERT INTO kfs_flaky_jobs (id) VALUES ($1)")
        .bind(job)
        .execute(&env.pool)
        .await
        .unwrap();
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&env.url)
        .await
        .unwrap();
    let kind = flaky::Steady::new();
    let (_, outcome) = tokio::time::timeout(
        Duration::from_secs(60),
        leased::run_once(&one, &kind, "w-steady", Budget::default()),
    )
    .await
    .expect("the slice ended")
    .unwrap()
    .expect("the job was claimed");
    assert_eq!(
        outcome,
        Outcome::Ended("succeeded"),
        "3 s of steps under a 1.5 s lease"
    );
    let effects: i64 =
        sqlx::query_scalar("SELECT count(*) FROM kfs_flaky_effects WHERE job_id = $1")
            .bind(job)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(effects, 10, "each of the ten steps once");
    one.close().await;
    env.cleanup().await;
}

/// A link that goes silent without closing (a half-open connection: a NAT or a failed peer
/// dropped it) answers no call. Every call is bounded: a claim on such a link fails within
/// the claim patience and gives its delivery back to the broker, and a slice whose connection
/// goes silent mid-step drops it and goes on on a fresh one, each step committed once.
#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_on_a_link_gone_silent_are_bounded_so_claims_give_back_and_slices_go_on() {
    use std::sync::Arc;

    use kfs_worker::consumer::{Engine, Handled};
    use kfs_worker::jobs::probe::ProbeHandler;
    use kfs_worker::jobs::Policy;

    let env = TestEnv::new().await;
    let (link, through) = crate::support::proxy::Proxy::before(&env.url).await;
    let url = kfs_worker::config::database_url(Some(through.as_str())).unwrap();
    let options =
        kfs_worker::db::session_options(&url, "kfs-worker silent link test", None).unwrap();
    let pool = kfs_worker::db::lazy_pool(options, 4, Duration::from_secs(2));
    let mut cfg = ConsumerConfig {
        claim_patience: Duration::from_secs(3),
        ..ConsumerConfig::default()
    };
    cfg.policies.insert(
        Kind::Probe,
        Policy {
            lease: Duration::from_secs(4),
            ..Kind::Probe.spec().policy
        },
    );
    let engine = Arc::new(Engine::new(
        pool.clone(),
        "worker-silent-link",
        vec![Arc::new(ProbeHandler)],
        cfg,
    ));
    let shutdown = CancellationToken::new();
    // Whatever a call does, the test goes on: a hang is a failure, not a stalled suite.
    const HANG: Duration = Duration::from_secs(60);

    // A claim: the connection it would use is open, then the whole link goes silent.
    let (job, outbox) = support::enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = support::dispatch(&env.pool, Kind::Probe, outbox).await;
    sqlx::query("SELECT 1").execute(&pool).await.unwrap();
    // Back in the pool, idle, so the claim runs its statement on it (not on a connection
    // still being opened: opening one is bounded by the pool's own timeout).
    let idle = env
        .wait_until(Duration::from_secs(10), || async { pool.num_idle() == 1 })
        .await;
    assert!(idle, "the pool's connection never came back idle");
    link.set_hold(true);
    let handled = tokio::time::timeout(HANG, engine.process_ref(&d, &shutdown)).await;
    assert_eq!(
        handled.ok(),
        Some(Handled::GiveBack),
        "a claim on a silent link must give its delivery back within its patience"
    );
    link.heal();
    let untouched: (i32, bool) = sqlx::query_as(
        "SELECT execution_attempts, lease_token IS NULL FROM kfs_probe_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(untouched, (0, true), "nothing was claimed");

    // A slice: its connection goes silent after the first step; new connections pass.
    let spec = ProbeSpec {
        steps: 3,
        step_sleep: Duration::from_millis(1500),
        ..ProbeSpec::default()
    };
    let (job, outbox) = support::enqueue_one(&env.pool, &spec).await;
    let d = support::dispatch(&env.pool, Kind::Probe, outbox).await;
    let running = {
        let (engine, d, shutdown) = (engine.clone(), d.clone(), shutdown.clone());
        tokio::spawn(async move { engine.process_ref(&d, &shutdown).await })
    };
    let first = env
        .wait_until(Duration::from_secs(30), || async {
            !support::probe_effects(&env.pool, job).await.is_empty()
        })
        .await;
    assert!(first, "the first step never committed");
    link.freeze_open();
    let handled = tokio::time::timeout(HANG, running)
        .await
        .expect("a slice whose connection went silent never ended")
        .unwrap();
    let Handled::Ack { claim, end } = handled.clone() else {
        panic!("the slice ended without a decision: {handled:?}");
    };
    assert_eq!(claim, "claimed");
    if end == Some("lease_lost") {
        // Its lease ran out while it found out: the next delivery takes the job over.
        let again = support::dispatch(&env.pool, Kind::Probe, outbox).await;
        let handled = tokio::time::timeout(HANG, engine.process_ref(&again, &shutdown))
            .await
            .expect("the takeover hung");
        assert!(
            matches!(
                handled,
                Handled::Ack {
                    end: Some("succeeded"),
                    ..
                }
            ),
            "{handled:?}"
        );
    } else {
        assert_eq!(end, Some("succeeded"), "{handled:?}");
    }
    assert_eq!(
        support::probe_effects(&env.pool, job).await,
        vec![(1, 1), (2, 1), (3, 1)],
        "each step committed once"
    );
    link.heal();
    env.cleanup().await;
}
