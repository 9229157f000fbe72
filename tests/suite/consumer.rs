//! The consumer (DESIGN.md, "The consumer: ack only after the commit") against a real
//! Postgres and, where a message is needed, a real RabbitMQ: decode, claim by the table's rules,
//! fenced steps, the four ends of a slice, heartbeats, fast takeover from dead workers, and the
//! same rules on the platform's own job tables.
//!
//! Deliveries are driven without a consumer loop: the outbox row is put out for delivery (by a
//! real relay round, or by SQL with a known delivery id) and the test calls
//! `Engine::process` / `Engine::process_ref` itself. Nothing sleeps to make time pass: leases,
//! retries and visibility windows are moved with SQL.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kfs_worker::consumer::{ConsumerConfig, Engine, Handled};
use kfs_worker::engine::lease::{self, Claim, DeliveryRef, End, Statements};
use kfs_worker::engine::slice::Budget;
use kfs_worker::jobs::probe::{ProbeHandler, ProbeSpec};
use kfs_worker::jobs::{Handler, JobCtx, JobError, Kind, Policy, RetryPolicy, Step};
use kfs_worker::relay::{Relay, RelayConfig};
use lapin::message::Delivery;
use lapin::options::BasicGetOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgConnection, PgPool, Postgres};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::support::{self, dispatch, enqueue_one, job_text, TestEnv};

/// A bound on calls that must not block; a hang fails the test instead of stalling the suite.
/// Never a timing assertion: each call here ends in well under a second when it works.
const HANG: Duration = Duration::from_secs(30);

fn ack(claim: &'static str, end: Option<&'static str>) -> Handled {
    Handled::Ack { claim, end }
}

/// A config whose retries wait long enough that a `retry_at` is certainly still ahead when the
/// test looks at it (attempt 1 waits 30..60 s).
fn slow_retries() -> ConsumerConfig {
    let mut cfg = ConsumerConfig::default();
    for kind in [Kind::Compile, Kind::Deletion, Kind::Research, Kind::Probe] {
        let policy = Policy {
            retry: RetryPolicy {
                base: Duration::from_secs(60),
                max: Duration::from_secs(600),
            },
            ..kind.spec().policy
        };
        cfg.policies.insert(kind, policy);
    }
    cfg
}

fn probe_engine(env: &TestEnv, worker: &str, cfg: ConsumerConfig) -> Engine {
    Engine::new(env.pool.clone(), worker, vec![Arc::new(ProbeHandler)], cfg)
}

async fn process(engine: &Engine, d: &DeliveryRef) -> Handled {
    tokio::time::timeout(HANG, engine.process_ref(d, &CancellationToken::new()))
        .await
        .expect("process_ref hung")
}

/// One real relay round for `kind`, then the one message it published, taken off the queue.
async fn relay_one(env: &TestEnv, kind: Kind) -> Delivery {
    let relay = Relay::new(
        env.pool.clone(),
        env.topology.clone(),
        "test-relay",
        RelayConfig::default(),
        &[kind],
    );
    let round = relay
        .relay_once(&env.confirm_channel().await, kind)
        .await
        .expect("relay round");
    assert_eq!(round.dispatched, 1, "{kind}: {round:?}");
    let ch = env.channel().await;
    let got = ch
        .basic_get(
            env.topology.queue(kind).as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
        .expect("the relayed message");
    got.delivery
}

/// Relays the kind's due row and hands the message to the engine, as a consumer would.
async fn deliver(env: &TestEnv, engine: &Engine, kind: Kind) -> Handled {
    let m = relay_one(env, kind).await;
    tokio::time::timeout(
        HANG,
        engine.process(kind, &m.properties, &m.data, &CancellationToken::new()),
    )
    .await
    .expect("process hung")
}

/// Every probe row, as text: "changes nothing" compares these.
async fn probe_snapshot(pool: &PgPool) -> String {
    sqlx::query_scalar(
        "SELECT concat_ws(E'\\n---\\n', \
           (SELECT string_agg(j::text, E'\\n' ORDER BY j.id) FROM kfs_probe_jobs j), \
           (SELECT string_agg(o::text, E'\\n' ORDER BY o.id) FROM kfs_probe_outbox o), \
           (SELECT string_agg(e::text, E'\\n' ORDER BY e.id) FROM kfs_probe_effects e))",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[derive(Debug, sqlx::FromRow)]
struct ProbeJob {
    run_state: String,
    checkpoint: String,
    active_slot: Option<i32>,
    execution_attempts: i32,
    row_version: i32,
    worker_id: Option<String>,
    lease_token: Option<Uuid>,
    lease_live: Option<bool>,
    /// `lease_expires_at - heartbeat_at` in ms (both are the same `now()` plus the lease).
    lease_ms: Option<i64>,
    heartbeat_set: bool,
    retry_at_future: Option<bool>,
    /// `retry_at - updated_at` in ms.
    retry_ms: Option<i64>,
    last_error_code: Option<String>,
    last_error_message: Option<String>,
    started: bool,
    completed: bool,
}

async fn probe_job(pool: &PgPool, job: Uuid) -> ProbeJob {
    sqlx::query_as(
        r#"
        SELECT run_state, checkpoint, active_slot, execution_attempts, row_version, worker_id, lease_token,
          lease_expires_at > now() AS lease_live,
          (extract(epoch FROM lease_expires_at - heartbeat_at) * 1000)::bigint AS lease_ms,
          heartbeat_at IS NOT NULL AS heartbeat_set,
          retry_at > now() AS retry_at_future,
          (extract(epoch FROM retry_at - updated_at) * 1000)::bigint AS retry_ms,
          last_error_code, last_error_message,
          started_at IS NOT NULL AS started, completed_at IS NOT NULL AS completed
        FROM kfs_probe_jobs WHERE id = $1
        "#,
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[derive(Debug, sqlx::FromRow)]
struct ProbeOutbox {
    status: String,
    queue_job_id: Option<String>,
    dispatch_attempts: i32,
    lock_cleared: bool,
    due: bool,
    /// available_at equals the job's lease_expires_at.
    at_lease_expiry: Option<bool>,
    /// available_at equals the job's retry_at.
    at_retry_at: Option<bool>,
    delivered: bool,
    last_error: Option<String>,
}

async fn probe_outbox(pool: &PgPool, outbox: Uuid) -> ProbeOutbox {
    sqlx::query_as(
        r#"
        SELECT o.status, o.queue_job_id, o.dispatch_attempts,
          (o.lock_token IS NULL AND o.locked_by IS NULL AND o.locked_until IS NULL) AS lock_cleared,
          o.available_at <= now() AS due,
          o.available_at = j.lease_expires_at AS at_lease_expiry,
          o.available_at = j.retry_at AS at_retry_at,
          o.delivered_at IS NOT NULL AS delivered,
          o.last_error
        FROM kfs_probe_outbox o JOIN kfs_probe_jobs j ON j.id = o.probe_job_id WHERE o.id = $1
        "#,
    )
    .bind(outbox)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Makes a waiting job due now: its retry time and its outbox row.
async fn make_retry_due(pool: &PgPool, job: Uuid, outbox: Uuid) {
    sqlx::query("UPDATE kfs_probe_jobs SET retry_at = now() - interval '1 second' WHERE id = $1")
        .bind(job)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE kfs_probe_outbox SET available_at = now() - interval '1 second' WHERE id = $1",
    )
    .bind(outbox)
    .execute(pool)
    .await
    .unwrap();
}

fn claimed(c: Claim) -> JobCtx {
    match c {
        Claim::Claimed(job) => job,
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// Claims the probe delivery `d` as `worker` on a connection of its own, as a consumer would.
/// The job must be claimable. Returns the statements, the connection and the claimed job.
async fn claim_by_hand(
    pool: &PgPool,
    d: &DeliveryRef,
    worker: &str,
    lease: Duration,
) -> (Statements, PoolConnection<Postgres>, JobCtx) {
    let st = Statements::new(Kind::Probe.spec());
    let mut conn = pool.acquire().await.unwrap();
    let ctx = claimed(
        lease::claim(&mut conn, &st, d, worker, lease)
            .await
            .unwrap(),
    );
    (st, conn, ctx)
}

// ---------------------------------------------------------------------------------------------
// Claim
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_takes_the_lease_counts_the_attempt_and_moves_the_outbox_row_to_leased() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let before = probe_job(&env.pool, job).await;
    let (_, _, ctx) = claim_by_hand(&env.pool, &d, "worker-claim", Duration::from_secs(30)).await;

    let after = probe_job(&env.pool, job).await;
    assert_eq!(after.run_state, "running");
    assert_eq!(after.worker_id.as_deref(), Some("worker-claim"));
    assert_eq!(
        after.lease_token,
        Some(ctx.lease_token),
        "a fresh lease token, the one the worker holds"
    );
    assert_eq!(after.lease_live, Some(true), "lease_expires_at > now");
    assert!(after.heartbeat_set);
    assert_eq!(
        after.lease_ms,
        Some(30_000),
        "lease_expires_at = heartbeat_at + lease"
    );
    assert_eq!(after.execution_attempts, before.execution_attempts + 1);
    assert_eq!(after.row_version, before.row_version + 1);
    assert!(after.started);
    assert_eq!(after.checkpoint, "queued", "the checkpoint is not touched");
    assert_eq!(
        (
            ctx.job_id,
            ctx.outbox_id,
            ctx.delivery_id.as_str(),
            ctx.row_version,
            ctx.execution_attempts,
            ctx.checkpoint.as_str()
        ),
        (
            job,
            outbox,
            d.delivery_id.as_str(),
            after.row_version,
            1,
            "queued"
        )
    );
    let o = probe_outbox(&env.pool, outbox).await;
    assert_eq!(o.status, "leased");
    assert_eq!(
        o.at_lease_expiry,
        Some(true),
        "outbox available_at = lease_expires_at"
    );
    assert_eq!(o.queue_job_id.as_deref(), Some(d.delivery_id.as_str()));
    assert!(o.lock_cleared);
    assert!(o.delivered);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_deliveries_are_acked_without_changing_anything() {
    let env = TestEnv::new().await;
    let engine = probe_engine(&env, "worker-stale", ConsumerConfig::default());
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let (_, other_outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    dispatch(&env.pool, Kind::Probe, other_outbox).await;

    let cases: Vec<(&str, DeliveryRef)> = vec![
        (
            "an older delivery id",
            DeliveryRef {
                delivery_id: "superseded".into(),
                ..d.clone()
            },
        ),
        (
            "an outbox row of another job",
            DeliveryRef {
                outbox_id: other_outbox,
                ..d.clone()
            },
        ),
        (
            "no such outbox row",
            DeliveryRef {
                outbox_id: Uuid::new_v4(),
                ..d.clone()
            },
        ),
    ];
    let mut expected_stale = 0;
    for (why, delivery) in cases {
        let before = probe_snapshot(&env.pool).await;
        assert_eq!(
            process(&engine, &delivery).await,
            ack("stale", None),
            "{why}"
        );
        assert_eq!(
            probe_snapshot(&env.pool).await,
            before,
            "{why}: nothing changed"
        );
        expected_stale += 1;
    }
    // The right delivery id, but the row is no longer out for delivery.
    for status in ["pending", "completed", "canceled", "dead"] {
        sqlx::query("UPDATE kfs_probe_outbox SET status = $2 WHERE id = $1")
            .bind(outbox)
            .bind(status)
            .execute(&env.pool)
            .await
            .unwrap();
        let before = probe_snapshot(&env.pool).await;
        assert_eq!(
            process(&engine, &d).await,
            ack("stale", None),
            "outbox {status}"
        );
        assert_eq!(
            probe_snapshot(&env.pool).await,
            before,
            "outbox {status}: nothing changed"
        );
        expected_stale += 1;
    }
    assert_eq!(
        engine.counters.stale.load(Ordering::Relaxed),
        expected_stale
    );
    assert_eq!(engine.counters.claimed.load(Ordering::Relaxed), 0);
    assert_eq!(
        engine.counters.slices.load(Ordering::Relaxed),
        0,
        "no slice ran"
    );
    assert!(support::probe_effects(&env.pool, job).await.is_empty());

    // Positive control: the same delivery is claimed once its row is out for delivery again.
    sqlx::query("UPDATE kfs_probe_outbox SET status = 'dispatched' WHERE id = $1")
        .bind(outbox)
        .execute(&env.pool)
        .await
        .unwrap();
    assert_eq!(
        process(&engine, &d).await,
        ack("claimed", Some("succeeded"))
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_leased_by_a_live_worker_is_a_duplicate_but_a_dead_workers_job_is_taken_over_before_its_lease_expires(
) {
    let env = TestEnv::new().await;
    let url = env.services().database_url;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    // "other-worker" is alive: it holds its liveness lock, and it leased the job.
    let liveness = kfs_worker::liveness::acquire(&url, "other-worker")
        .await
        .expect("liveness lock");
    let (_, conn, theirs) =
        claim_by_hand(&env.pool, &d, "other-worker", Duration::from_secs(600)).await;
    drop(conn);

    // The broker delivers the same message again, to us.
    let engine = probe_engine(&env, "worker-b", ConsumerConfig::default());
    let before = probe_snapshot(&env.pool).await;
    assert_eq!(process(&engine, &d).await, ack("duplicate", None));
    assert_eq!(
        probe_snapshot(&env.pool).await,
        before,
        "a duplicate changes nothing"
    );
    assert_eq!(engine.counters.duplicate.load(Ordering::Relaxed), 1);

    // The other worker's process dies: its session, and with it the lock, is gone.
    liveness.close().await.unwrap();
    let pool = env.pool.clone();
    let gone = env
        .wait_until(HANG, || {
            let pool = pool.clone();
            async move {
                !sqlx::query_scalar::<_, bool>("SELECT kfs_worker_alive('other-worker')")
                    .fetch_one(&pool)
                    .await
                    .unwrap()
            }
        })
        .await;
    assert!(gone, "the lock went away with the session");
    let j = probe_job(&env.pool, job).await;
    assert_eq!(
        (j.lease_live, j.lease_token),
        (Some(true), Some(theirs.lease_token)),
        "the lease itself has not expired"
    );

    assert_eq!(
        process(&engine, &d).await,
        ack("claimed", Some("succeeded")),
        "taken over at once"
    );
    let j = probe_job(&env.pool, job).await;
    assert_eq!(j.run_state, "succeeded");
    assert_eq!(j.execution_attempts, 2);
    let workers: Vec<String> =
        sqlx::query_scalar("SELECT worker_id FROM kfs_probe_effects WHERE job_id = $1")
            .bind(job)
            .fetch_all(&env.pool)
            .await
            .unwrap();
    assert_eq!(workers, vec!["worker-b".to_owned()]);
    env.cleanup().await;
}

/// When a worker process is killed, the broker hands its unacked deliveries to another worker
/// at once, often before Postgres has ended the killed process's liveness session: the first
/// look at the job finds its lease held by a holder that still looks alive. Acked as a
/// duplicate there, the job waited for the maintenance sweep (its grace and period, 2 to 3 s)
/// to be published again. The consumer looks again for `holder_settle` and takes the job over
/// once the holder is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_whose_holder_dies_just_after_the_first_look_is_taken_over_not_acked_as_a_duplicate(
) {
    let env = TestEnv::new().await;
    let url = env.services().database_url;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let holder = "dying-worker#0123abcd";
    let liveness = kfs_worker::liveness::acquire(&url, holder)
        .await
        .expect("liveness lock");
    let (_, conn, _) = claim_by_hand(&env.pool, &d, holder, Duration::from_secs(600)).await;
    drop(conn);

    let engine = probe_engine(
        &env,
        "worker-b",
        ConsumerConfig {
            holder_settle: HANG,
            ..ConsumerConfig::default()
        },
    );
    let delivery = d.clone();
    let mut task = tokio::spawn(async move { process(&engine, &delivery).await });
    // The holder still holds its lock: whatever the consumer decides now, it decides on a lease
    // that looks live.
    if let Ok(done) = tokio::time::timeout(Duration::from_millis(300), &mut task).await {
        panic!(
            "decided while the holder still looked alive: {:?}",
            done.expect("task")
        );
    }
    // The holder's process dies: its session, and with it the lock, is gone.
    liveness.close().await.unwrap();
    let handled = tokio::time::timeout(HANG, task)
        .await
        .expect("process hung")
        .expect("task");
    assert_eq!(handled, ack("claimed", Some("succeeded")), "taken over");
    let j = probe_job(&env.pool, job).await;
    assert_eq!(j.run_state, "succeeded");
    assert_eq!(j.execution_attempts, 2);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_on_its_last_attempt_is_neither_taken_over_nor_failed_while_its_lease_runs() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            max_attempts: 1,
            ..ProbeSpec::default()
        },
    )
    .await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    // The holder took its one attempt; its liveness session is down for a moment (nobody holds
    // its lock), while its lease has ten minutes to run.
    let (_, conn, theirs) =
        claim_by_hand(&env.pool, &d, "blipped-worker", Duration::from_secs(600)).await;
    drop(conn);
    let alive: bool = sqlx::query_scalar("SELECT kfs_worker_alive('blipped-worker')")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert!(!alive, "the holder looks gone");

    let engine = probe_engine(&env, "worker-other", ConsumerConfig::default());
    let before = probe_snapshot(&env.pool).await;
    assert_eq!(
        process(&engine, &d).await,
        ack("duplicate", None),
        "a holder that only looks gone keeps its last attempt"
    );
    assert_eq!(
        probe_snapshot(&env.pool).await,
        before,
        "neither taken over nor failed"
    );
    assert_eq!(
        probe_job(&env.pool, job).await.lease_token,
        Some(theirs.lease_token)
    );

    // Once the lease has run out, the attempt is used up for real.
    sqlx::query(
        "UPDATE kfs_probe_jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1",
    )
    .bind(job)
    .execute(&env.pool)
    .await
    .unwrap();
    assert_eq!(process(&engine, &d).await, ack("exhausted", None));
    let j = probe_job(&env.pool, job).await;
    assert_eq!(
        (j.run_state.as_str(), j.last_error_code.as_deref()),
        ("failed", Some("attempts_exhausted"))
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_cannot_reach_postgres_gives_its_delivery_back_after_its_patience() {
    let env = TestEnv::new().await;
    let (_, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let before = probe_snapshot(&env.pool).await;
    // Postgres out of reach: nothing listens on this port.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let away = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy(&format!("postgres://postgres@127.0.0.1:{port}/kfs"))
        .unwrap();
    let engine = Engine::new(
        away,
        "worker-away",
        vec![Arc::new(ProbeHandler)],
        ConsumerConfig {
            claim_patience: Duration::from_secs(2),
            ..ConsumerConfig::default()
        },
    );
    assert_eq!(
        process(&engine, &d).await,
        Handled::GiveBack,
        "handed back to the broker instead of holding its prefetch slot"
    );
    assert_eq!(probe_snapshot(&env.pool).await, before, "nothing written");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_is_taken_over_even_while_its_worker_lives() {
    let env = TestEnv::new().await;
    let url = env.services().database_url;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let liveness = kfs_worker::liveness::acquire(&url, "stuck-worker")
        .await
        .expect("liveness lock");
    let (_, conn, _) = claim_by_hand(&env.pool, &d, "stuck-worker", Duration::from_secs(600)).await;
    drop(conn);
    sqlx::query(
        "UPDATE kfs_probe_jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1",
    )
    .bind(job)
    .execute(&env.pool)
    .await
    .unwrap();

    let engine = probe_engine(&env, "worker-c", ConsumerConfig::default());
    assert_eq!(
        process(&engine, &d).await,
        ack("claimed", Some("succeeded"))
    );
    assert_eq!(support::probe_effects(&env.pool, job).await, vec![(1, 1)]);
    liveness.close().await.unwrap();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_for_a_terminal_job_is_acked_as_terminal_and_settles_its_row_to_match() {
    let env = TestEnv::new().await;
    let engine = probe_engine(&env, "worker-term", ConsumerConfig::default());
    for (state, settled) in [
        ("succeeded", "completed"),
        ("failed", "dead"),
        ("canceled", "canceled"),
    ] {
        let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
        let d = dispatch(&env.pool, Kind::Probe, outbox).await;
        sqlx::query(
            "UPDATE kfs_probe_jobs SET run_state = $2, active_slot = NULL, completed_at = now(), row_version = row_version + 1 \
             WHERE id = $1",
        )
        .bind(d.job_id)
        .bind(state)
        .execute(&env.pool)
        .await
        .unwrap();
        let job_before = job_text(&env.pool, job).await;
        assert_eq!(process(&engine, &d).await, ack("terminal", None), "{state}");
        assert_eq!(
            job_text(&env.pool, job).await,
            job_before,
            "{state}: the job is left as it is"
        );
        // The row is settled once, so the relay does not publish it again every window.
        let o = probe_outbox(&env.pool, outbox).await;
        assert_eq!(o.status, settled, "{state}");
        assert!(o.lock_cleared, "{state}");
        assert_eq!(
            o.last_error.is_some(),
            settled != "completed",
            "{state}: {o:?}"
        );
        let before = probe_snapshot(&env.pool).await;
        assert_eq!(
            process(&engine, &d).await,
            ack("stale", None),
            "{state}: again"
        );
        assert_eq!(
            probe_snapshot(&env.pool).await,
            before,
            "{state}: settled once"
        );
    }
    assert_eq!(engine.counters.terminal.load(Ordering::Relaxed), 3);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_attempts_are_used_up_is_failed_and_its_outbox_row_is_dead() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            max_attempts: 2,
            ..ProbeSpec::default()
        },
    )
    .await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    // A worker died during the last allowed attempt, and its lease ran out.
    let (_, conn, _) = claim_by_hand(&env.pool, &d, "dead-worker", Duration::from_secs(30)).await;
    drop(conn);
    sqlx::query(
        "UPDATE kfs_probe_jobs SET execution_attempts = max_execution_attempts, lease_expires_at = now() - interval '1 second' \
         WHERE id = $1",
    )
    .bind(job)
    .execute(&env.pool)
    .await
    .unwrap();
    let rv = probe_job(&env.pool, job).await.row_version;

    let engine = probe_engine(&env, "worker-ex", ConsumerConfig::default());
    assert_eq!(process(&engine, &d).await, ack("exhausted", None));
    let j = probe_job(&env.pool, job).await;
    assert_eq!(j.run_state, "failed");
    assert_eq!(j.last_error_code.as_deref(), Some("attempts_exhausted"));
    assert_eq!(j.active_slot, None);
    assert!(j.completed);
    assert_eq!(
        (j.worker_id, j.lease_token, j.lease_live),
        (None, None, None),
        "lease cleared"
    );
    assert_eq!(j.execution_attempts, 2, "no attempt beyond the maximum");
    assert_eq!(j.row_version, rv + 1);
    let o = probe_outbox(&env.pool, outbox).await;
    assert_eq!(o.status, "dead");
    assert!(o.lock_cleared);
    assert_eq!(o.last_error.as_deref(), Some("attempts_exhausted"));
    assert!(
        support::probe_effects(&env.pool, job).await.is_empty(),
        "nothing ran"
    );
    assert_eq!(engine.counters.exhausted.load(Ordering::Relaxed), 1);
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// Slices
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_step_job_completes_in_one_slice_from_a_relayed_message() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            steps: 3,
            ..ProbeSpec::default()
        },
    )
    .await;
    let engine = probe_engine(&env, "worker-3", ConsumerConfig::default());

    assert_eq!(
        deliver(&env, &engine, Kind::Probe).await,
        ack("claimed", Some("succeeded"))
    );
    let j = probe_job(&env.pool, job).await;
    assert_eq!(
        (j.run_state.as_str(), j.checkpoint.as_str()),
        ("succeeded", "done")
    );
    assert_eq!(j.active_slot, None);
    assert!(j.completed);
    assert_eq!(
        (j.worker_id, j.lease_token, j.lease_live, j.heartbeat_set),
        (None, None, None, false),
        "lease cleared"
    );
    assert_eq!((j.last_error_code, j.retry_ms), (None, None));
    assert_eq!(j.execution_attempts, 1);
    let o = probe_outbox(&env.pool, outbox).await;
    assert_eq!(o.status, "completed");
    assert!(o.lock_cleared);
    assert_eq!(
        support::probe_effects(&env.pool, job).await,
        vec![(1, 1), (2, 1), (3, 1)],
        "each step's effect exactly once"
    );
    let tokens: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT lease_token) FROM kfs_probe_effects WHERE job_id = $1",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(tokens, 1, "all under one lease");
    assert_eq!(engine.counters.slices.load(Ordering::Relaxed), 1);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_used_up_slice_budget_requeues_the_job_at_its_checkpoint_with_the_attempt_refunded() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            steps: 3,
            ..ProbeSpec::default()
        },
    )
    .await;
    let cfg = ConsumerConfig {
        budget: Budget {
            max_steps: 1,
            ..Budget::default()
        },
        ..ConsumerConfig::default()
    };
    let engine = probe_engine(&env, "worker-budget", cfg);
    let attempts_before = probe_job(&env.pool, job).await.execution_attempts;

    assert_eq!(
        deliver(&env, &engine, Kind::Probe).await,
        ack("claimed", Some("continue"))
    );
    let j = probe_job(&env.pool, job).await;
    assert_eq!(
        (j.run_state.as_str(), j.checkpoint.as_str()),
        ("queued", "step-1")
    );
    assert_eq!(
        (j.worker_id, j.lease_token, j.heartbeat_set),
        (None, None, false),
        "lease cleared"
    );
    assert_eq!(
        j.execution_attempts, attempts_before,
        "the attempt is refunded"
    );
    assert_eq!(j.active_slot, Some(1));
    let o = probe_outbox(&env.pool, outbox).await;
    assert_eq!(o.status, "pending");
    assert!(o.due, "claimable again at once");
    assert_eq!(o.dispatch_attempts, 0);
    assert!(o.lock_cleared);
    assert_eq!(support::probe_effects(&env.pool, job).await, vec![(1, 1)]);

    // The relay sends it again and the job goes on where it stopped.
    assert_eq!(
        deliver(&env, &engine, Kind::Probe).await,
        ack("claimed", Some("continue"))
    );
    assert_eq!(probe_job(&env.pool, job).await.checkpoint, "step-2");
    assert_eq!(
        deliver(&env, &engine, Kind::Probe).await,
        ack("claimed", Some("succeeded"))
    );
    assert_eq!(
        support::probe_effects(&env.pool, job).await,
        vec![(1, 1), (2, 1), (3, 1)]
    );
    assert_eq!(
        probe_job(&env.pool, job).await.execution_attempts,
        1,
        "three slices, one attempt"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retryable_error_waits_until_retry_at_and_an_early_delivery_only_rearms_the_outbox() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            fail_mode: "retry_once",
            ..ProbeSpec::default()
        },
    )
    .await;
    let engine = probe_engine(&env, "worker-retry", slow_retries());

    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    assert_eq!(process(&engine, &d).await, ack("claimed", Some("wait")));
    let j = probe_job(&env.pool, job).await;
    assert_eq!(j.run_state, "retry_wait");
    assert_eq!(j.retry_at_future, Some(true));
    let delay = j.retry_ms.expect("retry_at set");
    assert!(
        (30_000..=60_000).contains(&delay),
        "first retry waits base·2^0 with jitter: {delay} ms"
    );
    assert_eq!(j.last_error_code.as_deref(), Some("probe_retry"));
    assert_eq!(j.execution_attempts, 1, "a failed attempt is not refunded");
    assert_eq!((j.worker_id, j.lease_token), (None, None));
    assert_eq!(j.active_slot, Some(1));
    let o = probe_outbox(&env.pool, outbox).await;
    assert_eq!(o.status, "pending");
    assert_eq!(o.at_retry_at, Some(true), "outbox available_at = retry_at");
    assert_eq!(o.dispatch_attempts, 0);
    assert!(
        support::probe_effects(&env.pool, job).await.is_empty(),
        "the failed step's writes rolled back"
    );

    // A delivery before retry_at (say the row was republished early) does not run the job; it
    // puts the outbox row back to wait for retry_at.
    let early = dispatch(&env.pool, Kind::Probe, outbox).await;
    let job_before = job_text(&env.pool, job).await;
    assert_eq!(process(&engine, &early).await, ack("stale", None));
    assert_eq!(
        job_text(&env.pool, job).await,
        job_before,
        "the job is untouched"
    );
    let o = probe_outbox(&env.pool, outbox).await;
    assert_eq!(
        (o.status.as_str(), o.at_retry_at, o.dispatch_attempts, o.due),
        ("pending", Some(true), 0, false),
        "re-armed at retry_at"
    );
    assert!(o.lock_cleared);

    // retry_at comes: the next delivery runs and succeeds.
    make_retry_due(&env.pool, job, outbox).await;
    assert_eq!(
        deliver(&env, &engine, Kind::Probe).await,
        ack("claimed", Some("succeeded"))
    );
    let j = probe_job(&env.pool, job).await;
    assert_eq!(
        (j.run_state.as_str(), j.execution_attempts, j.retry_ms),
        ("succeeded", 2, None)
    );
    assert_eq!(j.last_error_code, None, "success clears the last error");
    assert_eq!(support::probe_effects(&env.pool, job).await, vec![(1, 1)]);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_error_fails_the_job_at_once_and_kills_its_outbox_row() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            fail_mode: "fatal",
            ..ProbeSpec::default()
        },
    )
    .await;
    let engine = probe_engine(&env, "worker-fatal", ConsumerConfig::default());
    assert_eq!(
        deliver(&env, &engine, Kind::Probe).await,
        ack("claimed", Some("failed"))
    );
    let j = probe_job(&env.pool, job).await;
    assert_eq!(j.run_state, "failed");
    assert_eq!(j.active_slot, None);
    assert!(j.completed);
    assert_eq!(j.last_error_code.as_deref(), Some("probe_fatal"));
    assert_eq!((j.worker_id, j.lease_token, j.retry_ms), (None, None, None));
    assert_eq!(j.execution_attempts, 1);
    let o = probe_outbox(&env.pool, outbox).await;
    assert_eq!(o.status, "dead");
    assert!(o.lock_cleared);
    assert!(o.last_error.unwrap_or_default().starts_with("probe_fatal"));
    assert!(support::probe_effects(&env.pool, job).await.is_empty());
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_always_hits_retryable_errors_fails_after_its_last_attempt() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            fail_mode: "retry_always",
            max_attempts: 2,
            ..ProbeSpec::default()
        },
    )
    .await;
    let engine = probe_engine(&env, "worker-always", slow_retries());

    assert_eq!(
        deliver(&env, &engine, Kind::Probe).await,
        ack("claimed", Some("wait"))
    );
    assert_eq!(probe_job(&env.pool, job).await.run_state, "retry_wait");
    make_retry_due(&env.pool, job, outbox).await;
    assert_eq!(
        deliver(&env, &engine, Kind::Probe).await,
        ack("claimed", Some("failed"))
    );
    let j = probe_job(&env.pool, job).await;
    assert_eq!(j.run_state, "failed");
    assert_eq!(j.execution_attempts, 2);
    assert_eq!(j.last_error_code.as_deref(), Some("probe_retry"));
    assert!(j
        .last_error_message
        .unwrap_or_default()
        .contains("no attempts left"));
    assert_eq!((j.active_slot, j.retry_ms), (None, None));
    assert!(j.completed);
    assert_eq!(probe_outbox(&env.pool, outbox).await.status, "dead");
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// Fencing and heartbeats
// ---------------------------------------------------------------------------------------------

/// Every kind of end a slice can write.
fn every_end() -> Vec<End> {
    vec![
        End::Succeed {
            checkpoint: "done".into(),
        },
        End::Fail {
            code: "x".into(),
            message: "y".into(),
        },
        End::Cancel {
            code: "x".into(),
            message: "y".into(),
        },
        End::Wait {
            delay: Duration::from_secs(5),
            code: "x".into(),
            message: "y".into(),
            refund: false,
        },
        End::Continue,
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_or_a_stale_row_version_refuses_every_write() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let (st, mut conn, ctx) =
        claim_by_hand(&env.pool, &d, "worker-paused", Duration::from_secs(30)).await;

    // The worker was paused past its lease.
    sqlx::query(
        "UPDATE kfs_probe_jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1",
    )
    .bind(job)
    .execute(&env.pool)
    .await
    .unwrap();
    let before = probe_snapshot(&env.pool).await;
    assert_eq!(
        lease::fence(&mut conn, &st, &ctx, Duration::from_secs(30))
            .await
            .unwrap(),
        None,
        "fence"
    );
    assert!(
        !lease::heartbeat(&mut conn, &st, &ctx, Duration::from_secs(30))
            .await
            .unwrap(),
        "heartbeat"
    );
    for end in every_end() {
        assert!(
            !lease::end(&mut conn, &st, &ctx, &end).await.unwrap(),
            "end {end:?}"
        );
    }
    assert_eq!(
        probe_snapshot(&env.pool).await,
        before,
        "an expired lease writes nothing"
    );

    // The lease is valid again, but someone else moved the row on (row_version bumped).
    sqlx::query("UPDATE kfs_probe_jobs SET lease_expires_at = now() + interval '1 minute', row_version = row_version + 1 WHERE id = $1")
        .bind(job)
        .execute(&env.pool)
        .await
        .unwrap();
    let before = probe_snapshot(&env.pool).await;
    assert_eq!(
        lease::fence(&mut conn, &st, &ctx, Duration::from_secs(30))
            .await
            .unwrap(),
        None,
        "fence with a stale row_version"
    );
    for end in every_end() {
        assert!(
            !lease::end(&mut conn, &st, &ctx, &end).await.unwrap(),
            "end {end:?} with a stale row_version"
        );
    }
    assert_eq!(
        probe_snapshot(&env.pool).await,
        before,
        "a stale row_version writes nothing"
    );

    // A wrong lease token is refused the same way.
    let impostor = JobCtx {
        lease_token: Uuid::new_v4(),
        row_version: ctx.row_version + 1,
        ..ctx.clone()
    };
    assert_eq!(
        lease::fence(&mut conn, &st, &impostor, Duration::from_secs(30))
            .await
            .unwrap(),
        None
    );
    assert!(
        !lease::heartbeat(&mut conn, &st, &impostor, Duration::from_secs(30))
            .await
            .unwrap()
    );
    assert_eq!(probe_snapshot(&env.pool).await, before);

    // Control: with the current row version and the live lease, the fence passes.
    let current = JobCtx {
        row_version: ctx.row_version + 1,
        ..ctx.clone()
    };
    assert_eq!(
        lease::fence(&mut conn, &st, &current, Duration::from_secs(30))
            .await
            .unwrap(),
        Some(ctx.row_version + 1)
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_extends_the_lease_and_the_outbox_visibility_without_bumping_row_version() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let (st, mut conn, ctx) =
        claim_by_hand(&env.pool, &d, "worker-hb", Duration::from_secs(10)).await;
    let expires = |pool: PgPool| async move {
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>(
            "SELECT lease_expires_at FROM kfs_probe_jobs WHERE id = $1",
        )
        .bind(job)
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let before = probe_job(&env.pool, job).await;
    let first_expiry = expires(env.pool.clone()).await;

    assert!(
        lease::heartbeat(&mut conn, &st, &ctx, Duration::from_secs(600))
            .await
            .unwrap()
    );
    let after = probe_job(&env.pool, job).await;
    assert_eq!(
        after.lease_ms,
        Some(600_000),
        "lease_expires_at = heartbeat_at + lease"
    );
    assert!(
        expires(env.pool.clone()).await > first_expiry,
        "the lease is longer"
    );
    assert_eq!(after.row_version, before.row_version, "no row_version bump");
    assert_eq!(after.lease_token, before.lease_token);
    let o = probe_outbox(&env.pool, outbox).await;
    assert_eq!(
        (o.status.as_str(), o.at_lease_expiry),
        ("leased", Some(true)),
        "outbox available_at follows the lease"
    );

    // The worker's own steps still pass the fence after any number of heartbeats.
    assert!(
        lease::heartbeat(&mut conn, &st, &ctx, Duration::from_secs(600))
            .await
            .unwrap()
    );
    assert_eq!(
        lease::fence(&mut conn, &st, &ctx, Duration::from_secs(30))
            .await
            .unwrap(),
        Some(ctx.row_version),
        "the fence passes and leaves the row version to the step's own write"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_step_fence_locks_the_job_row_until_the_step_commits_and_the_step_bumps_row_version_once(
) {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            steps: 3,
            ..ProbeSpec::default()
        },
    )
    .await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let (st, mut conn, ctx) =
        claim_by_hand(&env.pool, &d, "worker-fenced", Duration::from_secs(30)).await;
    let before = job_text(&env.pool, job).await;

    let mut tx = env.pool.begin().await.unwrap();
    assert_eq!(
        lease::fence(&mut tx, &st, &ctx, Duration::from_secs(30))
            .await
            .unwrap(),
        Some(ctx.row_version),
        "the fence passes"
    );
    assert_eq!(
        job_text(&env.pool, job).await,
        before,
        "the fence writes nothing"
    );

    // Any other writer (here: a takeover) must wait for the step.
    let mut other = env.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '300ms'")
        .execute(&mut *other)
        .await
        .unwrap();
    let blocked = sqlx::query(
        "UPDATE kfs_probe_jobs SET lease_token = gen_random_uuid(), row_version = row_version + 1 WHERE id = $1",
    )
    .bind(job)
    .execute(&mut *other)
    .await
    .expect_err("the row is locked by the step");
    assert_eq!(
        blocked
            .as_database_error()
            .and_then(|e| e.code())
            .as_deref(),
        Some("55P03"),
        "lock_not_available: {blocked}"
    );
    drop(other);

    let advanced = lease::advance(&mut tx, &st, &ctx, "step-1")
        .await
        .unwrap()
        .expect("the lease is ours");
    tx.commit().await.unwrap();
    assert_eq!(advanced, ctx.row_version + 1, "one bump per committed step");
    let after = probe_job(&env.pool, job).await;
    assert_eq!(
        (after.row_version, after.checkpoint.as_str()),
        (ctx.row_version + 1, "step-1")
    );

    // The old row version is now stale: a fence with it is refused.
    assert_eq!(
        lease::fence(&mut conn, &st, &ctx, Duration::from_secs(30))
            .await
            .unwrap(),
        None
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_lost_mid_slice_stops_the_slice_and_writes_nothing_after_the_takeover() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            steps: 20,
            step_sleep: Duration::from_millis(300),
            ..ProbeSpec::default()
        },
    )
    .await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let engine = Arc::new(probe_engine(&env, "worker-slow", ConsumerConfig::default()));
    let running = {
        let engine = engine.clone();
        let d = d.clone();
        tokio::spawn(async move { engine.process_ref(&d, &CancellationToken::new()).await })
    };
    // Wait for the first effect: the slice is running.
    let pool = env.pool.clone();
    let started = env
        .wait_until(HANG, || {
            let pool = pool.clone();
            async move {
                let n: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM kfs_probe_effects WHERE job_id = $1")
                        .bind(job)
                        .fetch_one(&pool)
                        .await
                        .unwrap();
                n >= 1
            }
        })
        .await;
    assert!(started);

    // Another session takes the job over: new lease token, row_version bumped. (It waits for
    // the step in flight, which holds the row lock, and commits right after it.)
    let taken: i64 = sqlx::query_scalar(
        "WITH t AS (UPDATE kfs_probe_jobs SET lease_token = gen_random_uuid(), worker_id = 'usurper', \
           row_version = row_version + 1 WHERE id = $1 AND run_state = 'running' RETURNING 1) SELECT count(*) FROM t",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(taken, 1, "the job was still running when taken over");
    let effects_at_takeover = support::probe_effects(&env.pool, job).await;
    let job_at_takeover = job_text(&env.pool, job).await;
    let outbox_at_takeover: String =
        sqlx::query_scalar("SELECT o::text FROM kfs_probe_outbox o WHERE id = $1")
            .bind(outbox)
            .fetch_one(&env.pool)
            .await
            .unwrap();

    let handled = tokio::time::timeout(HANG, running)
        .await
        .expect("the slice did not stop")
        .unwrap();
    assert_eq!(handled, ack("claimed", Some("lease_lost")));
    assert_eq!(
        support::probe_effects(&env.pool, job).await,
        effects_at_takeover,
        "no effect after the takeover"
    );
    assert!(effects_at_takeover.len() < 20);
    assert_eq!(
        job_text(&env.pool, job).await,
        job_at_takeover,
        "the job row is the usurper's"
    );
    let outbox_now: String =
        sqlx::query_scalar("SELECT o::text FROM kfs_probe_outbox o WHERE id = $1")
            .bind(outbox)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(
        outbox_now, outbox_at_takeover,
        "the outbox row is not touched either"
    );
    assert_eq!(engine.counters.lease_lost.load(Ordering::Relaxed), 1);
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// Undecodable deliveries
// ---------------------------------------------------------------------------------------------

fn props(
    message_id: Option<&str>,
    event_type: Option<&str>,
    schema: Option<i32>,
    outbox: Option<&str>,
) -> BasicProperties {
    let mut headers = FieldTable::default();
    if let Some(v) = schema {
        headers.insert("x-kfs-schema-version".into(), AMQPValue::LongInt(v));
    }
    if let Some(o) = outbox {
        headers.insert("x-kfs-outbox-id".into(), AMQPValue::LongString(o.into()));
    }
    let mut p = BasicProperties::default().with_headers(headers);
    if let Some(m) = message_id {
        p = p.with_message_id(m.into());
    }
    if let Some(t) = event_type {
        p = p.with_type(t.into());
    }
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_deliveries_are_rejected_counted_and_change_nothing() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let engine = probe_engine(&env, "worker-poison", ConsumerConfig::default());
    let ob = outbox.to_string();
    let body = serde_json::to_vec(&serde_json::json!({ "probeJobId": job })).unwrap();
    let id = Some(d.delivery_id.as_str());
    let good_type = Some("probe.job");
    let cases: Vec<(&str, BasicProperties, Vec<u8>)> = vec![
        (
            "not JSON",
            props(id, good_type, Some(1), Some(&ob)),
            b"not json".to_vec(),
        ),
        (
            "a JSON array",
            props(id, good_type, Some(1), Some(&ob)),
            b"[1]".to_vec(),
        ),
        (
            "no job id in the body",
            props(id, good_type, Some(1), Some(&ob)),
            b"{}".to_vec(),
        ),
        (
            "wrong schema version",
            props(id, good_type, Some(2), Some(&ob)),
            body.clone(),
        ),
        (
            "no schema version",
            props(id, good_type, None, Some(&ob)),
            body.clone(),
        ),
        (
            "no message_id",
            props(None, good_type, Some(1), Some(&ob)),
            body.clone(),
        ),
        (
            "no outbox id",
            props(id, good_type, Some(1), None),
            body.clone(),
        ),
        (
            "an outbox id that is no uuid",
            props(id, good_type, Some(1), Some("nope")),
            body.clone(),
        ),
        (
            "another kind's type",
            props(id, Some("document.compile"), Some(1), Some(&ob)),
            body.clone(),
        ),
        (
            "oversized",
            props(id, good_type, Some(1), Some(&ob)),
            vec![b' '; 64 * 1024 + 1],
        ),
    ];
    let n = cases.len() as u64;
    let before = probe_snapshot(&env.pool).await;
    for (why, p, b) in cases {
        let handled = tokio::time::timeout(
            HANG,
            engine.process(Kind::Probe, &p, &b, &CancellationToken::new()),
        )
        .await
        .unwrap();
        assert!(matches!(handled, Handled::Reject(_)), "{why}: {handled:?}");
    }
    assert_eq!(engine.counters.poison.load(Ordering::Relaxed), n);
    // The row itself is usable (its own message decodes): garbled messages that name it settle
    // nothing, and its next delivery is claimed. Rows whose own message is unusable are settled
    // (`rows_no_delivery_can_use_are_settled_once_and_dead_lettered_at_most_once`).
    assert_eq!(
        probe_snapshot(&env.pool).await,
        before,
        "nothing changed in Postgres"
    );
    assert_eq!(engine.counters.slices.load(Ordering::Relaxed), 0);

    // Control: the well-formed message is claimed.
    let handled = engine
        .process(
            Kind::Probe,
            &props(id, good_type, Some(1), Some(&ob)),
            &body,
            &CancellationToken::new(),
        )
        .await;
    assert_eq!(handled, ack("claimed", Some("succeeded")));
    assert_eq!(engine.counters.poison.load(Ordering::Relaxed), n);
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// A step that breaks an invariant of its table.
// ---------------------------------------------------------------------------------------------

/// A probe handler whose checkpoint does not fit the column: the checkpoint write fails with a
/// non-retryable error (22001) every time.
struct OverlongCheckpoint;

#[async_trait::async_trait]
impl Handler for OverlongCheckpoint {
    fn kind(&self) -> Kind {
        Kind::Probe
    }

    async fn step(&self, _tx: &mut PgConnection, _job: &JobCtx) -> Result<Step, JobError> {
        Ok(Step::Advance("x".repeat(40)))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_a_long_slice_alive_when_the_slices_hold_every_pool_connection() {
    let env = TestEnv::new().await;
    // Twelve steps of 300 ms under a 2 s lease: the slice outlives its first lease, and its one
    // pool connection is the pool's only one.
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            steps: 12,
            step_sleep: Duration::from_millis(300),
            ..ProbeSpec::default()
        },
    )
    .await;
    let url = kfs_worker::config::database_url(Some(&env.url)).unwrap();
    let options = kfs_worker::db::session_options(&url, "kfs-worker heartbeat test", None).unwrap();
    let slices = kfs_worker::db::lazy_pool(options.clone(), 1, Duration::from_secs(10));
    let heartbeats = kfs_worker::db::lazy_pool(options, 2, Duration::from_secs(10));
    let mut cfg = ConsumerConfig::default();
    cfg.policies.insert(
        Kind::Probe,
        Policy {
            lease: Duration::from_secs(2),
            ..Kind::Probe.spec().policy
        },
    );
    let engine = Engine::new(
        slices.clone(),
        "worker-hb",
        vec![Arc::new(ProbeHandler)],
        cfg,
    )
    .with_heartbeat_pool(heartbeats.clone());
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let handled = process(&engine, &d).await;
    let after = probe_job(&env.pool, job).await;
    assert_eq!(
        (handled, after.run_state.as_str()),
        (ack("claimed", Some("succeeded")), "succeeded"),
        "the lease ran out while its heartbeats waited for a connection: {after:?}"
    );
    assert_eq!(support::probe_effects(&env.pool, job).await.len(), 12);
    slices.close().await;
    heartbeats.close().await;
    env.cleanup().await;
}

/// A step the database refuses, whose failure record fails `failures_left` times first.
struct RefusedThenFailureFails {
    failures_left: std::sync::atomic::AtomicI32,
}

#[async_trait::async_trait]
impl Handler for RefusedThenFailureFails {
    fn kind(&self) -> Kind {
        Kind::Probe
    }

    async fn step(&self, _tx: &mut PgConnection, _job: &JobCtx) -> Result<Step, JobError> {
        Ok(Step::Advance("x".repeat(40)))
    }

    async fn on_fail(
        &self,
        _tx: &mut PgConnection,
        _job: &JobCtx,
        _code: &str,
    ) -> Result<(), sqlx::Error> {
        if self.failures_left.fetch_sub(1, Ordering::SeqCst) > 0 {
            return Err(sqlx::Error::Protocol(
                "the failure record was not written".into(),
            ));
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_that_cannot_be_written_at_once_is_retried_and_only_then_acked() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let engine = Engine::new(
        env.pool.clone(),
        "worker-failure-once",
        vec![Arc::new(RefusedThenFailureFails {
            failures_left: 1.into(),
        })],
        ConsumerConfig::default(),
    );
    let handled = process(&engine, &d).await;
    let after = probe_job(&env.pool, job).await;
    // The ack (the handled value) comes only with the failure committed.
    assert_eq!(
        (handled, after.run_state.as_str()),
        (ack("claimed", Some("failed")), "failed"),
        "{after:?}"
    );
    assert_eq!(probe_outbox(&env.pool, outbox).await.status, "dead");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_that_cannot_be_written_is_never_acked() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let engine = Engine::new(
        env.pool.clone(),
        "worker-failure-never",
        vec![Arc::new(RefusedThenFailureFails {
            failures_left: i32::MAX.into(),
        })],
        ConsumerConfig::default(),
    );
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { engine.process_ref(&d, &shutdown).await }
    });
    // While the failure cannot be written, the delivery is not settled.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!run.is_finished(), "settled without the failure's commit");
    shutdown.cancel();
    let handled = tokio::time::timeout(HANG, run)
        .await
        .expect("hung")
        .unwrap();
    assert_eq!(handled, Handled::Abandon, "left unacked for redelivery");
    assert_eq!(probe_job(&env.pool, job).await.run_state, "running");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_whose_checkpoint_write_breaks_a_constraint_fails_the_job_instead_of_looping() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            steps: 3,
            ..ProbeSpec::default()
        },
    )
    .await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let engine = Engine::new(
        env.pool.clone(),
        "worker-bad-step",
        vec![Arc::new(OverlongCheckpoint)],
        ConsumerConfig::default(),
    );
    let handled = tokio::time::timeout(
        Duration::from_secs(15),
        engine.process_ref(&d, &CancellationToken::new()),
    )
    .await;
    let handled = handled.expect(
        "the slice never ended: the failing step is re-run in a loop, the delivery is never acked",
    );
    assert_eq!(handled, ack("claimed", Some("failed")));
    assert_eq!(probe_job(&env.pool, job).await.run_state, "failed");
    assert_eq!(probe_outbox(&env.pool, outbox).await.status, "dead");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_statement_cancelled_mid_flight_is_retried_and_the_job_succeeds_once() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    // Hold the table the step writes, so that its statement is certainly in flight.
    let mut holder = env.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE kfs_probe_effects IN EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let engine = Arc::new(probe_engine(&env, "worker-cancelled", slow_retries()));
    let run = tokio::spawn({
        let engine = engine.clone();
        let d = d.clone();
        async move { engine.process_ref(&d, &CancellationToken::new()).await }
    });
    let mut cancelled = false;
    for _ in 0..200 {
        cancelled = sqlx::query_scalar(
            "SELECT coalesce(bool_or(pg_cancel_backend(pid)), false) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() \
               AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO kfs_probe_effects%'",
        )
        .fetch_one(&env.pool)
        .await
        .unwrap();
        if cancelled {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(cancelled, "the step's statement never waited on the lock");
    holder.rollback().await.unwrap();
    let handled = tokio::time::timeout(HANG, run)
        .await
        .expect("slice hung")
        .unwrap();
    let after = probe_job(&env.pool, job).await;
    assert_eq!(
        (
            handled,
            after.run_state.as_str(),
            after.last_error_code.as_deref()
        ),
        (
            ack("claimed", Some("wait")),
            "retry_wait",
            Some("db_unavailable")
        ),
        "a cancelled statement (57014) is retried, not a refusal of the step: {after:?}"
    );
    make_retry_due(&env.pool, job, outbox).await;
    let again = dispatch(&env.pool, Kind::Probe, outbox).await;
    assert_eq!(
        process(&engine, &again).await,
        ack("claimed", Some("succeeded"))
    );
    assert_eq!(probe_job(&env.pool, job).await.run_state, "succeeded");
    assert_eq!(
        support::probe_effects(&env.pool, job).await.len(),
        1,
        "the step's effect, once"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_may_stay_outside_the_database_for_its_kinds_lease_not_the_sessions_default() {
    let env = TestEnv::new().await;
    // Sessions end a transaction idle for 1 s (as a worker's would under a 1 s shortest lease);
    // this kind's lease is 10 s and its step sleeps 2.5 s with its transaction open.
    let url = kfs_worker::config::database_url(Some(&env.url)).unwrap();
    let pool = kfs_worker::db::connect_with(
        &url,
        "kfs-worker idle test",
        4,
        Duration::from_secs(10),
        Some(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            step_sleep: Duration::from_millis(2500),
            ..ProbeSpec::default()
        },
    )
    .await;
    let mut cfg = ConsumerConfig::default();
    cfg.policies.insert(
        Kind::Probe,
        Policy {
            lease: Duration::from_secs(10),
            ..Kind::Probe.spec().policy
        },
    );
    let engine = Engine::new(
        pool.clone(),
        "worker-idle",
        vec![Arc::new(ProbeHandler)],
        cfg,
    );
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let handled = process(&engine, &d).await;
    let after = probe_job(&env.pool, job).await;
    assert_eq!(
        (handled, after.run_state.as_str()),
        (ack("claimed", Some("succeeded")), "succeeded"),
        "the session's idle-in-transaction timeout ended the step: {after:?}"
    );
    assert_eq!(support::probe_effects(&env.pool, job).await.len(), 1);
    pool.close().await;
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// The platform's tables: compile, deletion, research.
// ---------------------------------------------------------------------------------------------

const TENANT: &str = "tenant-consumer";

/// Writes a knowledge space (owned by `user-1`); returns its id.
async fn space(pool: &PgPool) -> Uuid {
    let mut conn = pool.acquire().await.unwrap();
    kfs_worker::tools::platform::create_space(
        &mut conn,
        TENANT,
        &format!("space-{}", Uuid::new_v4()),
        "Consumer space",
        "user-1",
    )
    .await
    .unwrap()
}

/// Writes a document (version 1) in a space; returns its id.
async fn document(pool: &PgPool, space: Uuid) -> Uuid {
    let id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO document_assets (id, knowledge_space_id, source_id, filename, mime_type, object_key, sha256, \
           size_bytes, version, parser_status, metadata, created_at) \
         VALUES ($1, $2, NULL, 'a.pdf', 'application/pdf', 'objects/' || $1::text, repeat('0', 64), 10, 1, 'pending', \
           '{\"permissionScope\": []}', now())",
    )
    .bind(id)
    .bind(space)
    .execute(pool)
    .await
    .unwrap();
    id
}

/// A compile attempt and its outbox row, as the platform writes them. Returns (attempt, outbox).
async fn insert_compile(pool: &PgPool, space: Uuid) -> (Uuid, Uuid) {
    let doc = document(pool, space).await;
    let (attempt, outbox) = (Uuid::new_v4(), Uuid::new_v4());
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO document_compilation_attempts (id, tenant_id, knowledge_space_id, document_asset_id, document_version, \
           publication_generation_id, base_head_revision, checkpoint, run_state, active_slot, execution_attempts, \
           max_execution_attempts, row_version, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, 1, gen_random_uuid(), 0, 'queued', 'dispatch_pending', 1, 0, 5, 0, now(), now())",
    )
    .bind(attempt)
    .bind(TENANT)
    .bind(space)
    .bind(doc)
    .execute(&mut *tx)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO document_compilation_outbox (id, attempt_id, event_type, schema_version, payload, idempotency_key, \
           status, dispatch_attempts, available_at, created_at, updated_at) \
         VALUES ($2, $1, 'document.compile', 1, jsonb_build_object('attemptId', $1::text), 'document.compile:' || $1::text, \
           'pending', 0, now(), now(), now())",
    )
    .bind(attempt)
    .bind(outbox)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    (attempt, outbox)
}

/// A deletion job for one document: the job, its active tombstone, the document marked
/// deleting, and the outbox row (revision 1). Returns (job, outbox, document).
async fn insert_deletion(pool: &PgPool, space: Uuid) -> (Uuid, Uuid, Uuid) {
    let doc = document(pool, space).await;
    let (job, outbox) = (Uuid::new_v4(), Uuid::new_v4());
    let mut tx = pool.begin().await.unwrap();
    for sql in [
        "INSERT INTO deletion_jobs (id, tenant_id, knowledge_space_id, target_type, target_id, target_revision, delete_mode, \
           requested_by_subject_id, permission_snapshot_id, permission_snapshot_revision, access_channel, idempotency_key, \
           request_fingerprint, checkpoint, inventory_complete, run_state, active_slot, execution_attempts, \
           max_execution_attempts, row_version, created_at, updated_at) \
         VALUES ($1, $3, $4, 'document_asset', $5, 1, 'cascade', 'user-1', gen_random_uuid(), 1, 'interactive', \
           'req-' || $1::text, repeat('a', 64), 'requested', false, 'dispatch_pending', 1, 0, 10, 1, now(), now())",
        "INSERT INTO deletion_tombstones (id, deletion_job_id, tenant_id, knowledge_space_id, target_type, target_id, \
           target_revision, state, row_version, created_at) \
         VALUES (gen_random_uuid(), $1, $3, $4, 'document_asset', $5, 1, 'active', 1, now())",
        "UPDATE document_assets SET lifecycle_state = 'deleting', deletion_job_id = $1, deleting_at = now() \
         WHERE id = $5 AND knowledge_space_id = $4",
        "INSERT INTO deletion_outbox (id, deletion_job_id, delivery_revision, event_type, schema_version, idempotency_key, \
           request_idempotency_key, request_fingerprint, payload, status, available_at, dispatch_attempts, created_at, updated_at) \
         VALUES ($2, $1, 1, 'deletion.job', 1, 'deletion:' || $1::text || ':1', 'req-' || $1::text, repeat('a', 64), \
           jsonb_build_object('deletionJobId', $1::text), 'pending', now(), 0, now(), now())",
    ] {
        sqlx::query(sql)
            .bind(job)
            .bind(outbox)
            .bind(TENANT)
            .bind(space)
            .bind(doc)
            .execute(&mut *tx)
            .await
            .unwrap_or_else(|e| panic!("{e}: {sql}"));
    }
    tx.commit().await.unwrap();
    (job, outbox, doc)
}

/// A research task: its permission snapshot, the job, the `started` progress event and the
/// outbox row (revision 1). Returns (job, outbox).
async fn insert_research(pool: &PgPool, space: Uuid) -> (Uuid, Uuid) {
    let (job, outbox) = (Uuid::new_v4(), Uuid::new_v4());
    let snapshot = {
        let mut conn = pool.acquire().await.unwrap();
        kfs_worker::tools::platform::create_permission_snapshot(
            &mut conn,
            TENANT,
            space,
            "user-1",
            "interactive",
            None,
        )
        .await
        .unwrap()
    };
    let mut tx = pool.begin().await.unwrap();
    for sql in [
        "INSERT INTO research_task_jobs (id, tenant_id, knowledge_space_id, subject_id, permission_snapshot_id, \
           permission_snapshot_revision, access_channel, query, limits, metadata, cost, stage, row_version, \
           execution_attempts, max_execution_attempts, created_at, updated_at) \
         VALUES ($1, $4, $5, 'user-1', $3, 1, 'interactive', 'why?', '{}', '{}', '{}', 'queued', 1, 0, 5, \
           (extract(epoch FROM now()) * 1000)::bigint, (extract(epoch FROM now()) * 1000)::bigint)",
        "INSERT INTO research_task_progress_events (id, tenant_id, knowledge_space_id, research_task_job_id, sequence, \
           idempotency_key, event_type, stage, payload, created_at) \
         VALUES (gen_random_uuid(), $4, $5, $1, 1, 'research-task-progress:' || $1::text || ':1:research_task.started', \
           'research_task.started', 'queued', '{}', (extract(epoch FROM now()) * 1000)::bigint)",
        "INSERT INTO research_task_outbox (id, research_task_job_id, delivery_revision, event_type, schema_version, \
           idempotency_key, payload, status, available_at, dispatch_attempts, created_at, updated_at) \
         VALUES ($2, $1, 1, 'research.task', 1, 'research.task:' || $4 || ':' || $5::text || ':' || $1::text || ':1', \
           jsonb_build_object('researchTaskJobId', $1::text), 'pending', (extract(epoch FROM now()) * 1000)::bigint, 0, \
           (extract(epoch FROM now()) * 1000)::bigint, (extract(epoch FROM now()) * 1000)::bigint)",
    ] {
        sqlx::query(sql)
            .bind(job)
            .bind(outbox)
            .bind(snapshot)
            .bind(TENANT)
            .bind(space)
            .execute(&mut *tx)
            .await
            .unwrap_or_else(|e| panic!("{e}: {sql}"));
    }
    tx.commit().await.unwrap();
    (job, outbox)
}

/// The next checkpoint of a walk, and whether it is the last.
fn next_in(walk: &[&'static str], at: &str) -> Result<(&'static str, bool), JobError> {
    let i = walk
        .iter()
        .position(|c| *c == at)
        .ok_or_else(|| JobError::fatal("bad_checkpoint", format!("unknown checkpoint '{at}'")))?;
    let next = walk
        .get(i + 1)
        .ok_or_else(|| JobError::fatal("bad_checkpoint", format!("'{at}' is the end")))?;
    Ok((next, i + 2 == walk.len()))
}

/// Walks a compile attempt through its checkpoints without compiling anything. At
/// `projection_built` it binds a candidate publication; at `published` it creates the space's
/// publication head from `base_head_revision`. `fail_at`: the checkpoint whose step fails.
struct CompileWalk {
    fail_at: Option<&'static str>,
}

const COMPILE_WALK: [&str; 7] = [
    "queued",
    "parsed",
    "outline_built",
    "nodes_generated",
    "projection_built",
    "smoke_eval_passed",
    "published",
];

#[async_trait::async_trait]
impl Handler for CompileWalk {
    fn kind(&self) -> Kind {
        Kind::Compile
    }

    async fn step(&self, tx: &mut PgConnection, job: &JobCtx) -> Result<Step, JobError> {
        if self.fail_at == Some(job.checkpoint.as_str()) {
            return Err(JobError::fatal(
                "compile_broken",
                format!("cannot leave {}", job.checkpoint),
            ));
        }
        let (next, last) = next_in(&COMPILE_WALK, &job.checkpoint)?;
        if next == "projection_built" {
            let publication = Uuid::new_v4();
            sqlx::query(
                "INSERT INTO projection_set_publications (id, tenant_id, knowledge_space_id, fingerprint, projection_version, \
                   status, superseded_by_fingerprint, metadata, created_at, updated_at) \
                 SELECT $2, tenant_id, knowledge_space_id, 'fp-' || $2::text, 1, 'candidate', NULL, '{}', now(), now() \
                 FROM document_compilation_attempts WHERE id = $1",
            )
            .bind(job.job_id)
            .bind(publication)
            .execute(&mut *tx)
            .await?;
            sqlx::query(
                "UPDATE document_compilation_attempts SET candidate_publication_id = $2, candidate_fingerprint = 'fp-' || $2::text \
                 WHERE id = $1",
            )
            .bind(job.job_id)
            .bind(publication)
            .execute(&mut *tx)
            .await?;
        }
        if last {
            sqlx::query(
                "INSERT INTO projection_set_publication_heads (id, tenant_id, knowledge_space_id, publication_id, head_revision, \
                   created_at, updated_at) \
                 SELECT gen_random_uuid(), tenant_id, knowledge_space_id, candidate_publication_id, base_head_revision + 1, now(), now() \
                 FROM document_compilation_attempts WHERE id = $1",
            )
            .bind(job.job_id)
            .execute(&mut *tx)
            .await?;
            return Ok(Step::Succeed(next.into()));
        }
        Ok(Step::Advance(next.into()))
    }
}

/// Walks a deletion job through its checkpoints. Marks the inventory complete when quiescing
/// ends; on the last step deletes the document and completes the tombstone, in the same
/// transaction as the job's completion.
struct DeletionWalk {
    fail_at: Option<&'static str>,
}

const DELETION_WALK: [&str; 6] = [
    "requested",
    "quiescing",
    "deleting_objects",
    "deleting_derived_data",
    "deleting_primary_data",
    "completed",
];

#[async_trait::async_trait]
impl Handler for DeletionWalk {
    fn kind(&self) -> Kind {
        Kind::Deletion
    }

    async fn step(&self, tx: &mut PgConnection, job: &JobCtx) -> Result<Step, JobError> {
        if self.fail_at == Some(job.checkpoint.as_str()) {
            return Err(JobError::fatal(
                "deletion_broken",
                format!("cannot leave {}", job.checkpoint),
            ));
        }
        let (next, last) = next_in(&DELETION_WALK, &job.checkpoint)?;
        if next == "deleting_objects" {
            sqlx::query("UPDATE deletion_jobs SET inventory_complete = true WHERE id = $1")
                .bind(job.job_id)
                .execute(&mut *tx)
                .await?;
        }
        if last {
            sqlx::query(
                "DELETE FROM document_assets d USING deletion_jobs j \
                 WHERE j.id = $1 AND d.id = j.target_id AND d.knowledge_space_id = j.knowledge_space_id",
            )
            .bind(job.job_id)
            .execute(&mut *tx)
            .await?;
            sqlx::query("UPDATE deletion_tombstones SET state = 'completed', completed_at = now() WHERE deletion_job_id = $1")
                .bind(job.job_id)
                .execute(&mut *tx)
                .await?;
            return Ok(Step::Succeed(next.into()));
        }
        Ok(Step::Advance(next.into()))
    }
}

/// Walks a research task through its stages, appending a `stage_changed` progress event per
/// step (contiguous sequence, key by row version). `retry_once_at`: a retryable error at that
/// stage on the first attempt; `fail_at`: a fatal error at that stage.
struct ResearchWalk {
    retry_once_at: Option<&'static str>,
    fail_at: Option<&'static str>,
}

const RESEARCH_WALK: [&str; 6] = [
    "queued",
    "planning",
    "retrieving",
    "analyzing",
    "generating",
    "completed",
];

#[async_trait::async_trait]
impl Handler for ResearchWalk {
    fn kind(&self) -> Kind {
        Kind::Research
    }

    async fn step(&self, tx: &mut PgConnection, job: &JobCtx) -> Result<Step, JobError> {
        if self.fail_at == Some(job.checkpoint.as_str()) {
            return Err(JobError::fatal(
                "research_broken",
                format!("cannot leave {}", job.checkpoint),
            ));
        }
        if self.retry_once_at == Some(job.checkpoint.as_str()) && job.execution_attempts == 1 {
            return Err(JobError::retryable(
                "retrieval_unavailable",
                "try again later",
            ));
        }
        let (next, last) = next_in(&RESEARCH_WALK, &job.checkpoint)?;
        sqlx::query(
            "INSERT INTO research_task_progress_events (id, tenant_id, knowledge_space_id, research_task_job_id, sequence, \
               idempotency_key, event_type, stage, payload, created_at) \
             SELECT gen_random_uuid(), j.tenant_id, j.knowledge_space_id, j.id, \
               (SELECT coalesce(max(sequence), 0) + 1 FROM research_task_progress_events WHERE research_task_job_id = j.id), \
               'research-task-progress:' || j.id::text || ':' || $2::text || ':research_task.stage_changed', \
               'research_task.stage_changed', $3, jsonb_build_object('from', j.stage, 'to', $3::text), \
               (extract(epoch FROM now()) * 1000)::bigint \
             FROM research_task_jobs j WHERE j.id = $1",
        )
        .bind(job.job_id)
        .bind(job.row_version)
        .bind(next)
        .execute(&mut *tx)
        .await?;
        Ok(if last {
            Step::Succeed(next.into())
        } else {
            Step::Advance(next.into())
        })
    }
}

fn platform_engine(
    env: &TestEnv,
    worker: &str,
    fail_at: Option<&'static str>,
    cfg: ConsumerConfig,
) -> Engine {
    Engine::new(
        env.pool.clone(),
        worker,
        vec![
            Arc::new(CompileWalk { fail_at }),
            Arc::new(DeletionWalk { fail_at }),
            Arc::new(ResearchWalk {
                retry_once_at: None,
                fail_at,
            }),
        ],
        cfg,
    )
}

#[derive(Debug, PartialEq, Eq, sqlx::FromRow)]
struct RunStateRow {
    run_state: String,
    checkpoint: String,
    active_slot: Option<i32>,
    completed: bool,
    lease_cleared: bool,
    retry_at: Option<bool>,
    last_error_code: Option<String>,
    execution_attempts: i32,
}

async fn run_state_row(pool: &PgPool, kind: Kind, job: Uuid) -> RunStateRow {
    sqlx::query_as(&kind.spec().sql(
        "SELECT run_state, checkpoint, active_slot, completed_at IS NOT NULL AS completed, \
           (worker_id IS NULL AND lease_token IS NULL AND lease_expires_at IS NULL AND heartbeat_at IS NULL) AS lease_cleared, \
           retry_at IS NOT NULL AS retry_at, last_error_code, execution_attempts \
         FROM {job} WHERE id = $1",
    ))
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn outbox_status(pool: &PgPool, kind: Kind, outbox: Uuid) -> (String, bool) {
    sqlx::query_as(&kind.spec().sql(
        "SELECT status, (lock_token IS NULL AND locked_by IS NULL AND locked_until IS NULL) FROM {outbox} WHERE id = $1",
    ))
    .bind(outbox)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compile_attempt_walks_to_published_and_success_frees_its_slot() {
    let env = TestEnv::new().await;
    let space = space(&env.pool).await;
    let (attempt, outbox) = insert_compile(&env.pool, space).await;
    let engine = platform_engine(&env, "worker-compile", None, ConsumerConfig::default());

    assert_eq!(
        deliver(&env, &engine, Kind::Compile).await,
        ack("claimed", Some("succeeded"))
    );
    assert_eq!(
        run_state_row(&env.pool, Kind::Compile, attempt).await,
        RunStateRow {
            run_state: "succeeded".into(),
            checkpoint: "published".into(),
            active_slot: None,
            completed: true,
            lease_cleared: true,
            retry_at: Some(false),
            last_error_code: None,
            execution_attempts: 1,
        }
    );
    assert_eq!(
        outbox_status(&env.pool, Kind::Compile, outbox).await,
        ("completed".into(), true)
    );
    // The handler's writes committed with the steps: a bound candidate and a published head.
    let (bound, head_revision): (bool, i32) = sqlx::query_as(
        "SELECT a.candidate_publication_id IS NOT NULL, h.head_revision FROM document_compilation_attempts a \
         JOIN projection_set_publication_heads h ON h.publication_id = a.candidate_publication_id WHERE a.id = $1",
    )
    .bind(attempt)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!((bound, head_revision), (true, 1));
    // row_version: 0 written by the platform, +1 relay mark, +1 claim, +1 per checkpoint advance
    // (5), +1 end (the sixth step's write). The step fence locks the row and writes nothing.
    let rv: i32 =
        sqlx::query_scalar("SELECT row_version FROM document_compilation_attempts WHERE id = $1")
            .bind(attempt)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(rv, 8);

    // A second attempt for the same document version can take the freed slot.
    let doc: Uuid = sqlx::query_scalar(
        "SELECT document_asset_id FROM document_compilation_attempts WHERE id = $1",
    )
    .bind(attempt)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO document_compilation_attempts (id, tenant_id, knowledge_space_id, document_asset_id, document_version, \
           publication_generation_id, base_head_revision, checkpoint, run_state, active_slot, execution_attempts, \
           max_execution_attempts, row_version, created_at, updated_at) \
         VALUES (gen_random_uuid(), $1, $2, $3, 1, gen_random_uuid(), 1, 'queued', 'dispatch_pending', 1, 0, 5, 0, now(), now())",
    )
    .bind(TENANT)
    .bind(space)
    .bind(doc)
    .execute(&env.pool)
    .await
    .expect("the active slot is free again");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_compile_attempt_frees_its_slot_and_is_complete() {
    let env = TestEnv::new().await;
    let space = space(&env.pool).await;
    let (attempt, outbox) = insert_compile(&env.pool, space).await;
    let engine = platform_engine(
        &env,
        "worker-compile-fail",
        Some("outline_built"),
        ConsumerConfig::default(),
    );

    assert_eq!(
        deliver(&env, &engine, Kind::Compile).await,
        ack("claimed", Some("failed"))
    );
    assert_eq!(
        run_state_row(&env.pool, Kind::Compile, attempt).await,
        RunStateRow {
            run_state: "failed".into(),
            checkpoint: "outline_built".into(),
            active_slot: None,
            completed: true,
            lease_cleared: true,
            retry_at: Some(false),
            last_error_code: Some("compile_broken".into()),
            execution_attempts: 1,
        }
    );
    assert_eq!(
        outbox_status(&env.pool, Kind::Compile, outbox).await,
        ("dead".into(), true)
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_job_walks_to_completed_and_completes_its_tombstone() {
    let env = TestEnv::new().await;
    let space = space(&env.pool).await;
    let (job, outbox, doc) = insert_deletion(&env.pool, space).await;
    let engine = platform_engine(&env, "worker-deletion", None, ConsumerConfig::default());

    assert_eq!(
        deliver(&env, &engine, Kind::Deletion).await,
        ack("claimed", Some("succeeded"))
    );
    assert_eq!(
        run_state_row(&env.pool, Kind::Deletion, job).await,
        RunStateRow {
            run_state: "succeeded".into(),
            checkpoint: "completed".into(),
            active_slot: None,
            completed: true,
            lease_cleared: true,
            retry_at: Some(false),
            last_error_code: None,
            execution_attempts: 1,
        }
    );
    assert_eq!(
        outbox_status(&env.pool, Kind::Deletion, outbox).await,
        ("completed".into(), true)
    );
    let (tombstone, inventory, docs): (String, bool, i64) = sqlx::query_as(
        "SELECT t.state, j.inventory_complete, (SELECT count(*) FROM document_assets WHERE id = $2) \
         FROM deletion_jobs j JOIN deletion_tombstones t ON t.deletion_job_id = j.id WHERE j.id = $1",
    )
    .bind(job)
    .bind(doc)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        (tombstone.as_str(), inventory, docs),
        ("completed", true, 0)
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_deletion_job_keeps_its_slot_and_stays_incomplete_for_a_manual_retry() {
    let env = TestEnv::new().await;
    let space = space(&env.pool).await;
    let (job, outbox, doc) = insert_deletion(&env.pool, space).await;
    let engine = platform_engine(
        &env,
        "worker-deletion-fail",
        Some("deleting_objects"),
        ConsumerConfig::default(),
    );

    assert_eq!(
        deliver(&env, &engine, Kind::Deletion).await,
        ack("claimed", Some("failed"))
    );
    assert_eq!(
        run_state_row(&env.pool, Kind::Deletion, job).await,
        RunStateRow {
            run_state: "failed".into(),
            checkpoint: "deleting_objects".into(),
            active_slot: Some(1),
            completed: false,
            lease_cleared: true,
            retry_at: Some(false),
            last_error_code: Some("deletion_broken".into()),
            execution_attempts: 1,
        }
    );
    assert_eq!(
        outbox_status(&env.pool, Kind::Deletion, outbox).await,
        ("dead".into(), true)
    );
    let (tombstone, docs): (String, i64) = sqlx::query_as(
        "SELECT t.state, (SELECT count(*) FROM document_assets WHERE id = $2) FROM deletion_tombstones t WHERE t.deletion_job_id = $1",
    )
    .bind(job)
    .bind(doc)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        (tombstone.as_str(), docs),
        ("active", 1),
        "the target stays fenced, nothing half-deleted"
    );
    // The kept slot still blocks a second active deletion of the same target.
    let dup = sqlx::query(
        "INSERT INTO deletion_jobs (id, tenant_id, knowledge_space_id, target_type, target_id, target_revision, delete_mode, \
           requested_by_subject_id, permission_snapshot_id, permission_snapshot_revision, access_channel, idempotency_key, \
           request_fingerprint, checkpoint, inventory_complete, run_state, active_slot, execution_attempts, \
           max_execution_attempts, row_version, created_at, updated_at) \
         VALUES (gen_random_uuid(), $1, $2, 'document_asset', $3, 1, 'cascade', 'user-1', gen_random_uuid(), 1, 'interactive', \
           'req-second', repeat('a', 64), 'requested', false, 'dispatch_pending', 1, 0, 10, 1, now(), now())",
    )
    .bind(TENANT)
    .bind(space)
    .bind(doc)
    .execute(&env.pool)
    .await;
    let err = dup
        .expect_err("the failed job still holds the target's active slot")
        .to_string();
    assert!(err.contains("deletion_jobs_target_active_uq"), "{err}");
    env.cleanup().await;
}

#[derive(Debug, sqlx::FromRow)]
struct ResearchRow {
    stage: String,
    row_version: i32,
    execution_attempts: i32,
    lease_token: Option<Uuid>,
    worker_id: Option<String>,
    lease_expires_at: Option<i64>,
    heartbeat_at: Option<i64>,
    retry_at: Option<i64>,
    completed_at: Option<i64>,
    created_at: i64,
    updated_at: i64,
    error: Option<String>,
    now_ms: i64,
}

async fn research_row(pool: &PgPool, job: Uuid) -> ResearchRow {
    sqlx::query_as(
        "SELECT stage, row_version, execution_attempts, lease_token, worker_id, lease_expires_at, heartbeat_at, retry_at, \
           completed_at, created_at, updated_at, error, (extract(epoch FROM now()) * 1000)::bigint AS now_ms \
         FROM research_task_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// (status, available_at) of a research outbox row.
async fn research_outbox(pool: &PgPool, outbox: Uuid) -> (String, i64) {
    sqlx::query_as("SELECT status, available_at FROM research_task_outbox WHERE id = $1")
        .bind(outbox)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Epoch milliseconds, not seconds or microseconds.
fn assert_epoch_ms(what: &str, v: i64) {
    assert!(
        (1_000_000_000_000..100_000_000_000_000).contains(&v),
        "{what} = {v} is not epoch milliseconds"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_research_task_keeps_bigint_millisecond_times_through_lease_retry_and_completion() {
    let env = TestEnv::new().await;
    let space = space(&env.pool).await;
    let (job, outbox) = insert_research(&env.pool, space).await;
    let st = Statements::new(Kind::Research.spec());

    // Claim: the lease in epoch ms, the stage unchanged.
    let d = dispatch(&env.pool, Kind::Research, outbox).await;
    let mut conn = env.pool.acquire().await.unwrap();
    let ctx = claimed(
        lease::claim(
            &mut conn,
            &st,
            &d,
            "worker-research-claim",
            Duration::from_secs(30),
        )
        .await
        .unwrap(),
    );
    let r = research_row(&env.pool, job).await;
    assert_eq!(
        (r.stage.as_str(), r.execution_attempts, r.row_version),
        ("queued", 1, 2)
    );
    assert_eq!(r.lease_token, Some(ctx.lease_token));
    let (expires, beat) = (r.lease_expires_at.unwrap(), r.heartbeat_at.unwrap());
    assert_epoch_ms("lease_expires_at", expires);
    assert_eq!(expires - beat, 30_000, "a 30 s lease in milliseconds");
    assert!(expires > r.now_ms);
    assert_eq!(
        research_outbox(&env.pool, outbox).await,
        ("leased".into(), expires),
        "outbox available_at = lease_expires_at"
    );
    // Heartbeat: both move by the lease, in ms, without a row_version bump.
    assert!(
        lease::heartbeat(&mut conn, &st, &ctx, Duration::from_secs(600))
            .await
            .unwrap()
    );
    let r = research_row(&env.pool, job).await;
    assert_eq!(
        r.lease_expires_at.unwrap() - r.heartbeat_at.unwrap(),
        600_000
    );
    assert_eq!(r.row_version, 2);
    assert_eq!(
        research_outbox(&env.pool, outbox).await.1,
        r.lease_expires_at.unwrap()
    );
    // Give the job back (as a used-up slice budget would): the attempt is refunded.
    assert!(lease::end(&mut conn, &st, &ctx, &End::Continue)
        .await
        .unwrap());
    drop(conn);
    let r = research_row(&env.pool, job).await;
    assert_eq!(
        (
            r.stage.as_str(),
            r.execution_attempts,
            r.lease_token,
            r.worker_id,
            r.lease_expires_at,
            r.heartbeat_at
        ),
        ("queued", 0, None, None, None, None)
    );

    // A retryable error on the first attempt: retry_at in ms, the outbox waits for it.
    let engine = Engine::new(
        env.pool.clone(),
        "worker-research",
        vec![Arc::new(ResearchWalk {
            retry_once_at: Some("retrieving"),
            fail_at: None,
        })],
        slow_retries(),
    );
    assert_eq!(
        deliver(&env, &engine, Kind::Research).await,
        ack("claimed", Some("wait"))
    );
    let r = research_row(&env.pool, job).await;
    assert_eq!(
        r.stage, "retrieving",
        "the stage is the checkpoint; it stays where the error hit"
    );
    let retry_at = r.retry_at.expect("retry_at");
    assert_epoch_ms("retry_at", retry_at);
    assert!(
        (30_000..=60_000).contains(&(retry_at - r.updated_at)),
        "first retry after 30..60 s: {} ms",
        retry_at - r.updated_at
    );
    assert!(retry_at > r.now_ms);
    assert_eq!(r.lease_token, None);
    assert!(r
        .error
        .unwrap_or_default()
        .starts_with("retrieval_unavailable"));
    assert_eq!(
        research_outbox(&env.pool, outbox).await,
        ("pending".into(), retry_at),
        "outbox available_at = retry_at"
    );

    // retry_at comes.
    let past = r.now_ms - 1_000;
    sqlx::query("UPDATE research_task_jobs SET retry_at = $2 WHERE id = $1")
        .bind(job)
        .bind(past)
        .execute(&env.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE research_task_outbox SET available_at = $2 WHERE id = $1")
        .bind(outbox)
        .bind(past)
        .execute(&env.pool)
        .await
        .unwrap();
    assert_eq!(
        deliver(&env, &engine, Kind::Research).await,
        ack("claimed", Some("succeeded"))
    );
    let r = research_row(&env.pool, job).await;
    assert_eq!(r.stage, "completed");
    assert_eq!(r.execution_attempts, 2);
    let completed_at = r.completed_at.expect("completed_at");
    assert_epoch_ms("completed_at", completed_at);
    assert!(r.created_at <= completed_at && completed_at <= r.now_ms);
    assert_eq!(
        (
            r.lease_token,
            r.worker_id,
            r.lease_expires_at,
            r.heartbeat_at,
            r.retry_at
        ),
        (None, None, None, None, None)
    );
    assert_eq!(r.error, None);
    assert_eq!(research_outbox(&env.pool, outbox).await.0, "completed");
    // One progress event per stage change, sequences contiguous from the `started` event.
    let events: Vec<(i32, String, String)> = sqlx::query_as(
        "SELECT sequence, event_type, stage FROM research_task_progress_events WHERE research_task_job_id = $1 ORDER BY sequence",
    )
    .bind(job)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let stages: Vec<&str> = events.iter().map(|e| e.2.as_str()).collect();
    assert_eq!(
        stages,
        [
            "queued",
            "planning",
            "retrieving",
            "analyzing",
            "generating",
            "completed"
        ]
    );
    assert!(
        events.iter().enumerate().all(|(i, e)| e.0 == i as i32 + 1),
        "contiguous: {events:?}"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_research_task_ends_failed_with_a_millisecond_completion_time() {
    let env = TestEnv::new().await;
    let space = space(&env.pool).await;
    let (job, outbox) = insert_research(&env.pool, space).await;
    let engine = platform_engine(
        &env,
        "worker-research-fail",
        Some("analyzing"),
        ConsumerConfig::default(),
    );

    assert_eq!(
        deliver(&env, &engine, Kind::Research).await,
        ack("claimed", Some("failed"))
    );
    let r = research_row(&env.pool, job).await;
    assert_eq!(r.stage, "failed");
    let completed_at = r.completed_at.expect("completed_at");
    assert_epoch_ms("completed_at", completed_at);
    assert!(r.created_at <= completed_at && completed_at <= r.now_ms);
    assert_eq!((r.lease_token, r.lease_expires_at), (None, None));
    assert!(r.error.unwrap_or_default().starts_with("research_broken: "));
    assert_eq!(research_outbox(&env.pool, outbox).await.0, "dead");
    // The stages it went through before failing are recorded, then the failure itself.
    let last: Vec<(String, String, serde_json::Value)> = sqlx::query_as(
        "SELECT event_type, stage, payload FROM research_task_progress_events WHERE research_task_job_id = $1 \
         ORDER BY sequence DESC LIMIT 2",
    )
    .bind(job)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(last[1].1, "analyzing", "{last:?}");
    assert_eq!(
        last[0],
        (
            "research_task.failed".to_owned(),
            "failed".to_owned(),
            serde_json::json!({"error": "research_broken"})
        )
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_research_task_is_not_run_and_a_terminal_one_is_acked_as_terminal() {
    let env = TestEnv::new().await;
    let space = space(&env.pool).await;
    let engine = platform_engine(
        &env,
        "worker-research-pause",
        None,
        ConsumerConfig::default(),
    );
    let snapshot = |pool: PgPool| async move {
        sqlx::query_scalar::<_, String>(
            "SELECT concat_ws(E'\\n', (SELECT string_agg(j::text, E'\\n' ORDER BY id) FROM research_task_jobs j), \
               (SELECT string_agg(o::text, E'\\n' ORDER BY id) FROM research_task_outbox o), \
               (SELECT string_agg(e::text, E'\\n' ORDER BY id) FROM research_task_progress_events e))",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };

    let (paused, paused_outbox) = insert_research(&env.pool, space).await;
    let d = dispatch(&env.pool, Kind::Research, paused_outbox).await;
    sqlx::query("UPDATE research_task_jobs SET stage = 'paused', paused_from_stage = 'queued', row_version = row_version + 1 WHERE id = $1")
        .bind(paused)
        .execute(&env.pool)
        .await
        .unwrap();
    let before = snapshot(env.pool.clone()).await;
    assert_eq!(process(&engine, &d).await, ack("stale", None), "paused");
    assert_eq!(snapshot(env.pool.clone()).await, before);

    let (done, done_outbox) = insert_research(&env.pool, space).await;
    let d = dispatch(&env.pool, Kind::Research, done_outbox).await;
    sqlx::query(
        "UPDATE research_task_jobs SET stage = 'canceled', completed_at = (extract(epoch FROM now()) * 1000)::bigint, \
           row_version = row_version + 1 WHERE id = $1",
    )
    .bind(done)
    .execute(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        process(&engine, &d).await,
        ack("terminal", None),
        "canceled"
    );
    // Its row, still out for delivery, is settled to match, and nothing else changes.
    assert_eq!(research_outbox(&env.pool, done_outbox).await.0, "canceled");
    let before = snapshot(env.pool.clone()).await;
    assert_eq!(process(&engine, &d).await, ack("stale", None), "again");
    assert_eq!(snapshot(env.pool.clone()).await, before);
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// Rows no delivery can use
// ---------------------------------------------------------------------------------------------

/// Every message on the dead-letter queue, taken off it: the outbox id each names.
async fn dead_lettered(env: &TestEnv) -> Vec<Option<Uuid>> {
    let ch = env.channel().await;
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(
            env.topology.dead_letter_queue().as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
    {
        let outbox = m
            .delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|h| kfs_worker::wire::str_header(h, "x-kfs-outbox-id"))
            .and_then(|s| Uuid::parse_str(s).ok());
        out.push(outbox);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_no_delivery_can_use_are_settled_once_and_dead_lettered_at_most_once() {
    let env = TestEnv::new().await;
    let url = env.services().database_url;
    let terminal = |state: &'static str| {
        format!(
            "UPDATE kfs_probe_jobs SET run_state = '{state}', active_slot = NULL, completed_at = now(), \
               row_version = row_version + 1 WHERE id = $1"
        )
    };
    let (succeeded_job, _) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    // (what, the row's change, the job's change, outbox status, job state, most copies in the DLQ)
    type Case = (
        &'static str,
        String,
        Option<String>,
        &'static str,
        &'static str,
        usize,
    );
    let cases: Vec<Case> = vec![
        (
            "a payload that is no JSON object",
            "UPDATE kfs_probe_outbox SET payload = '[1, 2, 3]' WHERE id = $1".into(),
            None,
            "dead",
            "failed",
            1,
        ),
        (
            "a schema version no consumer reads",
            "UPDATE kfs_probe_outbox SET schema_version = 2 WHERE id = $1".into(),
            None,
            "dead",
            "failed",
            1,
        ),
        (
            "an id of another kind's job",
            "UPDATE kfs_probe_outbox SET payload = jsonb_build_object('attemptId', probe_job_id::text) WHERE id = $1"
                .into(),
            None,
            "dead",
            "failed",
            1,
        ),
        (
            "a job id that names no job",
            "UPDATE kfs_probe_outbox SET payload = jsonb_build_object('probeJobId', gen_random_uuid()::text) WHERE id = $1"
                .into(),
            None,
            "dead",
            "failed",
            0,
        ),
        (
            "another job's id",
            format!(
                "UPDATE kfs_probe_outbox SET payload = jsonb_build_object('probeJobId', '{succeeded_job}') WHERE id = $1"
            ),
            None,
            "dead",
            "failed",
            0,
        ),
        (
            "a job that succeeded",
            "SELECT $1::uuid".into(),
            Some(terminal("succeeded")),
            "completed",
            "succeeded",
            0,
        ),
        (
            "a job that failed",
            "SELECT $1::uuid".into(),
            Some(terminal("failed")),
            "dead",
            "failed",
            0,
        ),
        (
            "a job that was canceled",
            "SELECT $1::uuid".into(),
            Some(terminal("canceled")),
            "canceled",
            "canceled",
            0,
        ),
        (
            "a healthy row (control)",
            "SELECT $1::uuid".into(),
            None,
            "completed",
            "succeeded",
            0,
        ),
    ];
    let mut rows = Vec::new();
    for (what, row_sql, job_sql, ..) in &cases {
        let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
        sqlx::query(row_sql)
            .bind(outbox)
            .execute(&env.pool)
            .await
            .unwrap();
        if let Some(sql) = job_sql {
            sqlx::query(sql).bind(job).execute(&env.pool).await.unwrap();
        }
        rows.push((*what, job, outbox));
    }
    // The row of `succeeded_job` itself is put out of the way: only the job is needed.
    sqlx::query("DELETE FROM kfs_probe_outbox WHERE probe_job_id = $1")
        .bind(succeeded_job)
        .execute(&env.pool)
        .await
        .unwrap();
    sqlx::query(&terminal("succeeded"))
        .bind(succeeded_job)
        .execute(&env.pool)
        .await
        .unwrap();

    // A live worker leases a healthy job for long: its duplicates are legitimate.
    let (live_job, live_outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let live = dispatch(&env.pool, Kind::Probe, live_outbox).await;
    let liveness = kfs_worker::liveness::acquire(&url, "live-worker")
        .await
        .expect("liveness lock");
    let (_, conn, _) =
        claim_by_hand(&env.pool, &live, "live-worker", Duration::from_secs(600)).await;
    drop(conn);
    let live_before = (
        job_text(&env.pool, live_job).await,
        support::outbox_text(&env.pool, live_outbox).await,
    );

    // A relay with a short visibility window and a consumer, for many windows. The window is
    // far longer than a delivery takes to be decided, even on a loaded machine: a row settled
    // by its first delivery is never due again.
    let window = Duration::from_millis(1500);
    let relay = Relay::new(
        env.pool.clone(),
        env.topology.clone(),
        "relay-settle",
        RelayConfig {
            visibility: window,
            ..RelayConfig::default()
        },
        &[Kind::Probe],
    );
    let engine = Arc::new(probe_engine(
        &env,
        "worker-settle",
        ConsumerConfig::default(),
    ));
    let shutdown = CancellationToken::new();
    let consumer = tokio::spawn(kfs_worker::consumer::consume(
        engine.clone(),
        env.channel().await,
        env.topology.queue(Kind::Probe),
        Kind::Probe,
        8,
        shutdown.clone(),
    ));
    let ch = env.confirm_channel().await;
    let started = std::time::Instant::now();
    while started.elapsed() < window * 6 {
        relay
            .relay_once(&ch, Kind::Probe)
            .await
            .expect("relay round");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Every delivery in flight is decided, then the consumer stops.
    tokio::time::sleep(window * 2).await;
    shutdown.cancel();
    tokio::time::timeout(HANG, consumer)
        .await
        .expect("consumer stopped")
        .unwrap()
        .unwrap();
    let copies = dead_lettered(&env).await;

    // (case, outbox status, job state, whether the dead-lettered copies are within the bound)
    let mut got = Vec::new();
    let mut want = Vec::new();
    let mut counted = Vec::new();
    for ((what, job, outbox), (_, _, job_sql, status, state, most)) in rows.iter().zip(&cases) {
        let o = probe_outbox(&env.pool, *outbox).await;
        let j = probe_job(&env.pool, *job).await;
        let n = copies.iter().filter(|c| **c == Some(*outbox)).count();
        counted.push((*what, n, o.dispatch_attempts));
        got.push((*what, o.status.clone(), j.run_state.clone(), n <= *most));
        want.push((*what, (*status).to_owned(), (*state).to_owned(), true));
        if o.status == "dead" {
            assert!(
                o.last_error.as_deref().is_some_and(|e| !e.is_empty()),
                "{what}: the reason is kept: {:?}",
                o.last_error
            );
        }
        if *status == "dead" && job_sql.is_none() && j.run_state == "failed" {
            // The job of a row no delivery can use fails with a recorded error code.
            assert_eq!(
                j.last_error_code.as_deref(),
                Some("undeliverable"),
                "{what}"
            );
            assert!(j.completed, "{what}");
            assert_eq!(j.active_slot, None, "{what}");
        }
        assert!(o.lock_cleared, "{what}");
    }
    assert_eq!(
        got, want,
        "(case, outbox, job, dead-lettered at most as allowed); (case, copies, dispatches): {counted:?}"
    );
    assert_eq!(
        copies.iter().filter(|c| c.is_none()).count(),
        0,
        "every dead-lettered copy names its row"
    );

    // The live worker's job: not published again, and neither a stale duplicate of it nor a
    // garbled message naming it settles anything.
    assert_eq!(process(&engine, &live).await, ack("duplicate", None));
    let garbled = tokio::time::timeout(
        HANG,
        engine.process(
            Kind::Probe,
            &props(
                Some(live.delivery_id.as_str()),
                Some("probe.job"),
                Some(1),
                Some(&live_outbox.to_string()),
            ),
            b"not json",
            &CancellationToken::new(),
        ),
    )
    .await
    .unwrap();
    assert!(matches!(garbled, Handled::Reject(_)), "{garbled:?}");
    assert_eq!(
        (
            job_text(&env.pool, live_job).await,
            support::outbox_text(&env.pool, live_outbox).await,
        ),
        live_before,
        "a live worker's job and row are left as they are"
    );
    liveness.close().await.unwrap();
    env.cleanup().await;
}
