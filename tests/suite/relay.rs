//! The outbox relay (DESIGN.md, "The relay" and "RabbitMQ topology") against a real Postgres
//! and a real RabbitMQ: claim with `SKIP LOCKED` and a new delivery id committed before the
//! publish, persistent mandatory publishes with confirms, mark fenced by lock token and status,
//! release with backoff, and `dead` after the last allowed dispatch attempt.
//!
//! Every test has its own database and queue prefix (`support::TestEnv`). Nothing sleeps to make
//! a row due: rows are made due by moving `available_at` / `locked_until` with SQL, and a relay
//! is held between its publish and its mark by a test-only trigger that waits on an advisory
//! lock the test holds.

use std::collections::HashSet;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use kfs_worker::broker::Topology;
use kfs_worker::consumer::{ConsumerConfig, Engine, Handled};
use kfs_worker::jobs::probe::{self, ProbeHandler, ProbeSpec};
use kfs_worker::jobs::{Kind, RetryPolicy};
use kfs_worker::relay::{Relay, RelayConfig, RelayError, Round};
use kfs_worker::wire::{int_header, str_header};
use lapin::message::Delivery;
use lapin::options::{BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions};
use lapin::types::FieldTable;
use lapin::ExchangeKind;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::support::{self, enqueue_one, job_text, outbox_text, TestEnv};

/// A bound on calls that must not block; a hang fails the test instead of stalling the suite.
/// Never a timing assertion: every call here finishes in milliseconds when it works.
const HANG: Duration = Duration::from_secs(30);

/// The defaults, with a release backoff long enough that a released row is certainly not due
/// again during the test.
fn cfg() -> RelayConfig {
    RelayConfig {
        release: RetryPolicy {
            base: Duration::from_secs(600),
            max: Duration::from_secs(3600),
        },
        ..RelayConfig::default()
    }
}

fn relay(env: &TestEnv, id: &str, cfg: RelayConfig) -> Relay {
    Relay::new(
        env.pool.clone(),
        env.topology.clone(),
        id,
        cfg,
        &[Kind::Probe],
    )
}

async fn round(relay: &Relay, channel: &lapin::Channel, kind: Kind) -> Round {
    tokio::time::timeout(HANG, relay.relay_once(channel, kind))
        .await
        .expect("relay_once hung")
        .expect("relay_once failed")
}

#[derive(Debug, sqlx::FromRow)]
struct OutboxState {
    status: String,
    queue_job_id: Option<String>,
    dispatch_attempts: i32,
    lock_cleared: bool,
    last_error: Option<String>,
    /// `available_at - updated_at` in milliseconds: both come from the same `now()`.
    available_after_update_ms: i64,
    due: bool,
}

async fn outbox_state(pool: &PgPool, outbox: Uuid) -> OutboxState {
    sqlx::query_as(
        r#"
        SELECT status, queue_job_id, dispatch_attempts,
          (lock_token IS NULL AND locked_by IS NULL AND locked_until IS NULL) AS lock_cleared,
          last_error,
          (extract(epoch FROM available_at - updated_at) * 1000)::bigint AS available_after_update_ms,
          available_at <= now() AS due
        FROM kfs_probe_outbox WHERE id = $1
        "#,
    )
    .bind(outbox)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Makes the relay's lock on an outbox row run out.
async fn expire_lock(pool: &PgPool, outbox: Uuid) {
    sqlx::query(
        "UPDATE kfs_probe_outbox SET locked_until = now() - interval '1 second' WHERE id = $1",
    )
    .bind(outbox)
    .execute(pool)
    .await
    .unwrap();
}

async fn job_state(pool: &PgPool, job: Uuid) -> (String, i32) {
    sqlx::query_as("SELECT run_state, row_version FROM kfs_probe_jobs WHERE id = $1")
        .bind(job)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Takes every message out of a queue.
async fn drain_queue(env: &TestEnv, queue: &str) -> Vec<Delivery> {
    let ch = env.channel().await;
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic_get")
    {
        out.push(m.delivery);
    }
    out
}

async fn drain(env: &TestEnv) -> Vec<Delivery> {
    drain_queue(env, &env.topology.queue(Kind::Probe)).await
}

fn message_id(d: &Delivery) -> String {
    d.properties
        .message_id()
        .as_ref()
        .expect("message_id")
        .to_string()
}

fn outbox_header(d: &Delivery) -> Uuid {
    let h = d.properties.headers().as_ref().expect("headers");
    Uuid::parse_str(str_header(h, "x-kfs-outbox-id").expect("x-kfs-outbox-id"))
        .expect("outbox id header is a uuid")
}

/// A topology whose exchange exists but has no queue bound to it: every mandatory publish
/// comes back unroutable.
async fn unroutable_topology(env: &TestEnv) -> Topology {
    let topology = Topology::new(format!("{}-noqueue", env.prefix));
    env.channel()
        .await
        .exchange_declare(
            topology.exchange().as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare the exchange alone");
    topology
}

async fn delete_exchange(env: &TestEnv, topology: &Topology) {
    let _ = env
        .channel()
        .await
        .exchange_delete(
            topology.exchange().as_str().into(),
            ExchangeDeleteOptions::default(),
        )
        .await;
}

// ---------------------------------------------------------------------------------------------
// Gates between publish and mark.
//
// A statement-level BEFORE UPDATE trigger on the probe outbox makes the relay's
// mark-dispatched statement wait on an advisory lock when its session's application name holds
// `kfs-test-gate-`; the lock is keyed by that name. The test holds the lock, so a relay on
// a pool with that application name (or a worker whose id holds it: its sessions are named
// `kfs-worker <worker id>`) claims, publishes, gets its confirms and then stops just
// before its mark, until the test opens its gate. The trigger fires before any row is locked,
// so everyone else can write the rows meanwhile; the mark then runs on whatever it finds.
// ---------------------------------------------------------------------------------------------

struct Gate {
    app: &'static str,
    holder: PgConnection,
}

impl Gate {
    async fn install(env: &TestEnv) {
        sqlx::raw_sql(
            r#"
            CREATE FUNCTION kfs_test_mark_gate() RETURNS trigger LANGUAGE plpgsql AS $g$
            BEGIN
              IF current_setting('application_name') LIKE '%kfs-test-gate-%'
                 AND current_query() LIKE '%SET status = ''dispatched''%' THEN
                PERFORM pg_advisory_lock_shared(hashtext(current_setting('application_name'))::bigint);
                PERFORM pg_advisory_unlock_shared(hashtext(current_setting('application_name'))::bigint);
              END IF;
              RETURN NULL;
            END
            $g$;
            CREATE TRIGGER kfs_test_mark_gate BEFORE UPDATE ON kfs_probe_outbox
              FOR EACH STATEMENT EXECUTE FUNCTION kfs_test_mark_gate();
            "#,
        )
        .execute(&env.pool)
        .await
        .expect("install the gate trigger");
    }

    /// Closes the gate named `app` (which must hold `kfs-test-gate-`).
    async fn close(env: &TestEnv, app: &'static str) -> Gate {
        let mut holder = PgConnection::connect(&env.url).await.unwrap();
        sqlx::query("SELECT pg_advisory_lock(hashtext($1)::bigint)")
            .bind(app)
            .execute(&mut holder)
            .await
            .unwrap();
        Gate { app, holder }
    }

    /// A pool whose sessions this gate stops.
    async fn pool(&self, env: &TestEnv) -> PgPool {
        let opts = PgConnectOptions::from_str(&env.url)
            .unwrap()
            .application_name(self.app);
        PgPoolOptions::new()
            .max_connections(4)
            .connect_with(opts)
            .await
            .unwrap()
    }

    /// Waits until a session of this gate is stopped at it, i.e. its relay is about to mark.
    async fn wait_until_held(&self, env: &TestEnv) {
        let pool = env.pool.clone();
        let app = self.app;
        let held = env
            .wait_until(HANG, || {
                let pool = pool.clone();
                async move {
                    let n: i64 = sqlx::query_scalar(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                         AND application_name = $1 AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
                    )
                    .bind(app)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                    n > 0
                }
            })
            .await;
        assert!(held, "the relay behind gate {app} never reached its mark");
    }

    /// Starts one relay round on this gate's sessions and waits until it stops before its mark
    /// (claimed, published, confirmed). Returns the round and the relay's pool.
    async fn hold_a_round(
        &self,
        env: &TestEnv,
        relay_id: &str,
    ) -> (tokio::task::JoinHandle<Result<Round, RelayError>>, PgPool) {
        let pool = self.pool(env).await;
        let r = Relay::new(
            pool.clone(),
            env.topology.clone(),
            relay_id,
            cfg(),
            &[Kind::Probe],
        );
        let ch = env.confirm_channel().await;
        let round = tokio::spawn(async move { r.relay_once(&ch, Kind::Probe).await });
        self.wait_until_held(env).await;
        (round, pool)
    }

    async fn open(mut self) {
        sqlx::query("SELECT pg_advisory_unlock(hashtext($1)::bigint)")
            .bind(self.app)
            .execute(&mut self.holder)
            .await
            .unwrap();
        self.holder.close().await.ok();
    }
}

// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_due_pending_row_is_published_once_with_every_property_and_marked_dispatched() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let payload: serde_json::Value =
        sqlx::query_scalar("SELECT payload FROM kfs_probe_outbox WHERE id = $1")
            .bind(outbox)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    let (_, rv_before) = job_state(&env.pool, job).await;
    let r = relay(&env, "relay-props", cfg());
    let ch = env.confirm_channel().await;

    let got = round(&r, &ch, Kind::Probe).await;
    assert_eq!(
        got,
        Round {
            claimed: 1,
            dispatched: 1,
            released: 0,
            dead: 0,
            look_again: false
        }
    );

    let row = outbox_state(&env.pool, outbox).await;
    assert_eq!(row.status, "dispatched");
    assert!(row.lock_cleared, "lock fields cleared: {row:?}");
    assert_eq!(row.dispatch_attempts, 1);
    assert_eq!(row.last_error, None);
    assert_eq!(
        row.available_after_update_ms, 300_000,
        "available_at = now + visibility (300 s)"
    );
    let delivery_id = row.queue_job_id.clone().expect("queue_job_id written");
    assert_eq!(
        job_state(&env.pool, job).await,
        ("queued".to_owned(), rv_before + 1),
        "dispatch_pending -> queued, fenced by row_version"
    );

    let msgs = drain(&env).await;
    assert_eq!(msgs.len(), 1, "published exactly once");
    let m = &msgs[0];
    let p = &m.properties;
    assert_eq!(
        p.message_id().as_ref().map(|s| s.to_string()),
        Some(delivery_id),
        "message_id = queue_job_id"
    );
    assert_eq!(
        p.correlation_id().as_ref().map(|s| s.to_string()),
        Some(job.to_string()),
        "correlation_id = job id"
    );
    assert_eq!(
        p.kind().as_ref().map(|s| s.to_string()).as_deref(),
        Some("probe.job")
    );
    assert_eq!(
        p.content_type().as_ref().map(|s| s.to_string()).as_deref(),
        Some("application/json")
    );
    assert_eq!(*p.delivery_mode(), Some(2), "persistent");
    let h = p.headers().as_ref().expect("headers");
    assert_eq!(
        str_header(h, "x-kfs-outbox-id"),
        Some(outbox.to_string().as_str())
    );
    assert_eq!(int_header(h, "x-kfs-delivery-revision"), Some(1));
    assert_eq!(int_header(h, "x-kfs-schema-version"), Some(1));
    assert_eq!(
        str_header(h, "traceparent"),
        None,
        "no traceparent when the payload has none"
    );
    let body: serde_json::Value = serde_json::from_slice(&m.data).expect("body is JSON");
    assert_eq!(body, payload, "body = payload");
    assert_eq!(m.routing_key.as_str(), "probe.job", "routed by event type");
    assert_eq!(
        m.exchange.as_str(),
        env.topology.exchange(),
        "through the job exchange"
    );

    // Published once: a second round finds nothing due.
    assert_eq!(round(&r, &ch, Kind::Probe).await, Round::default());
    assert!(drain(&env).await.is_empty());
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_claim_writes_a_new_delivery_id_and_a_republish_carries_it() {
    let env = TestEnv::new().await;
    let (_, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let r = relay(&env, "relay-ids", cfg());
    let ch = env.confirm_channel().await;

    round(&r, &ch, Kind::Probe).await;
    let first = outbox_state(&env.pool, outbox).await.queue_job_id.unwrap();
    // The visibility window passed without a consumer: republish.
    sqlx::query(
        "UPDATE kfs_probe_outbox SET available_at = now() - interval '1 second' WHERE id = $1",
    )
    .bind(outbox)
    .execute(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        round(&r, &ch, Kind::Probe).await,
        Round {
            claimed: 1,
            dispatched: 1,
            released: 0,
            dead: 0,
            look_again: false
        }
    );
    let second = outbox_state(&env.pool, outbox).await;
    let second_id = second.queue_job_id.clone().unwrap();
    assert_ne!(first, second_id, "a new delivery id per claim");
    assert_eq!(second.dispatch_attempts, 2);

    let ids: Vec<String> = drain(&env).await.iter().map(message_id).collect();
    assert_eq!(
        ids,
        vec![first, second_id],
        "each publish carries the id its claim wrote"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_delivery_id_is_committed_before_publishing_so_a_consumer_may_win_the_race_against_the_mark(
) {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    Gate::install(&env).await;
    let gate = Gate::close(&env, "kfs-test-gate-relay").await;
    let (relaying, gated) = gate.hold_a_round(&env, "relay-gated").await;

    // Published and confirmed, not yet marked: the claim with the delivery id is committed.
    let row = outbox_state(&env.pool, outbox).await;
    assert_eq!(row.status, "dispatching");
    let msgs = drain(&env).await;
    assert_eq!(msgs.len(), 1);
    assert_eq!(
        Some(message_id(&msgs[0])),
        row.queue_job_id,
        "the message carries the committed delivery id"
    );

    // A consumer takes the message now and runs the job to its end.
    let engine = Engine::new(
        env.pool.clone(),
        "consumer-fast",
        vec![Arc::new(ProbeHandler)],
        ConsumerConfig::default(),
    );
    let handled = engine
        .process(
            Kind::Probe,
            &msgs[0].properties,
            &msgs[0].data,
            &CancellationToken::new(),
        )
        .await;
    assert_eq!(
        handled,
        Handled::Ack {
            claim: "claimed",
            end: Some("succeeded")
        }
    );
    let outbox_after_consumer = outbox_text(&env.pool, outbox).await;
    let job_after_consumer = job_text(&env.pool, job).await;

    // The mark finds the row no longer 'dispatching' and changes nothing.
    gate.open().await;
    let got = tokio::time::timeout(HANG, relaying)
        .await
        .expect("relay hung")
        .unwrap()
        .unwrap();
    assert_eq!(
        got,
        Round {
            claimed: 1,
            dispatched: 0,
            released: 0,
            dead: 0,
            look_again: false
        }
    );
    assert_eq!(
        outbox_text(&env.pool, outbox).await,
        outbox_after_consumer,
        "mark is fenced by status"
    );
    assert_eq!(
        job_text(&env.pool, job).await,
        job_after_consumer,
        "the job is not moved back to queued"
    );
    assert_eq!(outbox_state(&env.pool, outbox).await.status, "completed");
    gated.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mark_dispatched_is_fenced_by_the_lock_token_when_another_relay_reclaimed_the_row() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    Gate::install(&env).await;

    // Relay A claims and publishes, then stops before its mark.
    let gate_a = Gate::close(&env, "kfs-test-gate-a").await;
    let (relaying_a, pool_a) = gate_a.hold_a_round(&env, "relay-a").await;
    let first_id = outbox_state(&env.pool, outbox).await.queue_job_id.unwrap();

    // A's lock runs out; relay B reclaims the row under its own token and stops before its mark.
    expire_lock(&env.pool, outbox).await;
    let gate_b = Gate::close(&env, "kfs-test-gate-b").await;
    let (relaying_b, pool_b) = gate_b.hold_a_round(&env, "relay-b").await;
    let reclaimed = outbox_state(&env.pool, outbox).await;
    let second_id = reclaimed.queue_job_id.clone().unwrap();
    assert_ne!(first_id, second_id, "B's claim wrote a new delivery id");
    assert_eq!(
        (reclaimed.status.as_str(), reclaimed.dispatch_attempts),
        ("dispatching", 2)
    );
    let outbox_before = outbox_text(&env.pool, outbox).await;
    let job_before = job_text(&env.pool, job).await;

    // A marks now: the row is 'dispatching', but under B's token. A changes nothing.
    gate_a.open().await;
    let got = tokio::time::timeout(HANG, relaying_a)
        .await
        .expect("relay A hung")
        .unwrap()
        .unwrap();
    assert_eq!(
        got,
        Round {
            claimed: 1,
            dispatched: 0,
            released: 0,
            dead: 0,
            look_again: false
        },
        "a stale lock token marks nothing"
    );
    assert_eq!(
        outbox_text(&env.pool, outbox).await,
        outbox_before,
        "B's claim is intact"
    );
    assert_eq!(
        job_text(&env.pool, job).await,
        job_before,
        "the job is not moved by A"
    );

    // B marks its own claim.
    gate_b.open().await;
    let got = tokio::time::timeout(HANG, relaying_b)
        .await
        .expect("relay B hung")
        .unwrap()
        .unwrap();
    assert_eq!(
        got,
        Round {
            claimed: 1,
            dispatched: 1,
            released: 0,
            dead: 0,
            look_again: false
        }
    );
    let row = outbox_state(&env.pool, outbox).await;
    assert_eq!(
        (row.status.as_str(), row.queue_job_id.as_deref()),
        ("dispatched", Some(second_id.as_str()))
    );
    assert_eq!(job_state(&env.pool, job).await.0, "queued");
    // Both messages went out; only the second names the current delivery.
    let ids: HashSet<String> = drain(&env).await.iter().map(message_id).collect();
    assert_eq!(ids, HashSet::from([first_id, second_id]));
    pool_a.close().await;
    pool_b.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_whose_available_at_is_in_the_future_are_not_claimed() {
    let env = TestEnv::new().await;
    let (_, deferred) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let (_, later) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let (_, due) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    sqlx::query(
        "UPDATE kfs_probe_outbox SET available_at = '9999-12-31T23:59:59.999Z' WHERE id = $1",
    )
    .bind(deferred)
    .execute(&env.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE kfs_probe_outbox SET available_at = now() + interval '1 hour' WHERE id = $1",
    )
    .bind(later)
    .execute(&env.pool)
    .await
    .unwrap();
    let deferred_before = outbox_text(&env.pool, deferred).await;
    let later_before = outbox_text(&env.pool, later).await;
    let r = relay(&env, "relay-deferred", cfg());
    let ch = env.confirm_channel().await;

    assert_eq!(
        round(&r, &ch, Kind::Probe).await,
        Round {
            claimed: 1,
            dispatched: 1,
            released: 0,
            dead: 0,
            look_again: false
        }
    );
    assert_eq!(outbox_state(&env.pool, due).await.status, "dispatched");
    assert_eq!(outbox_text(&env.pool, deferred).await, deferred_before);
    assert_eq!(outbox_text(&env.pool, later).await, later_before);
    let published: Vec<Uuid> = drain(&env).await.iter().map(outbox_header).collect();
    assert_eq!(published, vec![due]);

    // Releasing the deferred row (available_at = now) is all it takes.
    sqlx::query("UPDATE kfs_probe_outbox SET available_at = now() WHERE id = $1")
        .bind(deferred)
        .execute(&env.pool)
        .await
        .unwrap();
    assert_eq!(
        round(&r, &ch, Kind::Probe).await,
        Round {
            claimed: 1,
            dispatched: 1,
            released: 0,
            dead: 0,
            look_again: false
        }
    );
    let published: Vec<Uuid> = drain(&env).await.iter().map(outbox_header).collect();
    assert_eq!(published, vec![deferred]);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatching_row_is_reclaimed_only_after_its_lock_expired() {
    let env = TestEnv::new().await;
    let (_, expired) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let (_, held) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    // A relay died mid-publish on `expired`; another one is still publishing `held`.
    sqlx::query(
        "UPDATE kfs_probe_outbox SET status = 'dispatching', lock_token = gen_random_uuid(), locked_by = 'dead-relay', \
           locked_until = CASE WHEN id = $1 THEN now() - interval '1 second' ELSE now() + interval '1 hour' END, \
           queue_job_id = 'old-' || id, dispatch_attempts = 1 \
         WHERE id IN ($1, $2)",
    )
    .bind(expired)
    .bind(held)
    .execute(&env.pool)
    .await
    .unwrap();
    let held_before = outbox_text(&env.pool, held).await;
    let r = relay(&env, "relay-reclaim", cfg());
    let ch = env.confirm_channel().await;

    assert_eq!(
        round(&r, &ch, Kind::Probe).await,
        Round {
            claimed: 1,
            dispatched: 1,
            released: 0,
            dead: 0,
            look_again: false
        }
    );
    let row = outbox_state(&env.pool, expired).await;
    assert_eq!(row.status, "dispatched");
    assert!(row.lock_cleared);
    assert_eq!(row.dispatch_attempts, 2);
    let new_id = row.queue_job_id.unwrap();
    assert_ne!(
        new_id,
        format!("old-{expired}"),
        "reclaimed under a new delivery id"
    );
    assert_eq!(
        outbox_text(&env.pool, held).await,
        held_before,
        "a live lock is not taken"
    );
    let msgs = drain(&env).await;
    assert_eq!(msgs.len(), 1);
    assert_eq!(outbox_header(&msgs[0]), expired);
    assert_eq!(message_id(&msgs[0]), new_id);
    env.cleanup().await;
}

/// A worker process's relay locks the rows it claims under its liveness holder
/// (`<id>#<8 hex>`). Once that holder is dead to `kfs_worker_alive` (the process was killed
/// between its claim and its mark), its rows are taken again at once, not after `lock_ttl`
/// (30 s): the jobs behind them would otherwise wait that long for their first message. A live
/// holder's rows, and rows locked under a name that is not a holder (a relay without a liveness
/// session), still wait for their lock to run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatching_row_of_a_dead_relay_process_is_reclaimed_before_its_lock_expires() {
    let env = TestEnv::new().await;
    let url = env.services().database_url;
    let live_holder = "relay-live#89abcdef";
    let _alive = kfs_worker::liveness::acquire(&url, live_holder)
        .await
        .expect("liveness lock");
    let dead_holder = "relay-killed#0123abcd";
    let mut rows = Vec::new();
    for locked_by in [dead_holder, live_holder, "relay-without-liveness"] {
        let (_, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
        // Claimed an hour of lock ago, by a relay that has not marked it.
        sqlx::query(
            "UPDATE kfs_probe_outbox SET status = 'dispatching', lock_token = gen_random_uuid(), \
               locked_by = $2, locked_until = now() + interval '1 hour', queue_job_id = 'old-' || id, \
               dispatch_attempts = 1 \
             WHERE id = $1",
        )
        .bind(outbox)
        .bind(locked_by)
        .execute(&env.pool)
        .await
        .unwrap();
        rows.push((locked_by, outbox, outbox_text(&env.pool, outbox).await));
    }
    let r = relay(&env, "relay-survivor#fedcba98", cfg());
    let ch = env.confirm_channel().await;

    assert_eq!(
        round(&r, &ch, Kind::Probe).await,
        Round {
            claimed: 1,
            dispatched: 1,
            released: 0,
            dead: 0,
            look_again: false
        },
        "only the dead holder's row is taken"
    );
    let (_, dead_row, _) = &rows[0];
    let row = outbox_state(&env.pool, *dead_row).await;
    assert_eq!(row.status, "dispatched");
    assert!(row.lock_cleared);
    assert_eq!(row.dispatch_attempts, 2);
    let new_id = row.queue_job_id.unwrap();
    assert_ne!(new_id, format!("old-{dead_row}"), "under a new delivery id");
    for (locked_by, outbox, before) in &rows[1..] {
        assert_eq!(
            &outbox_text(&env.pool, *outbox).await,
            before,
            "the row locked by {locked_by} is not taken before its lock runs out"
        );
    }
    let msgs = drain(&env).await;
    assert_eq!(msgs.len(), 1);
    assert_eq!(outbox_header(&msgs[0]), *dead_row);
    assert_eq!(message_id(&msgs[0]), new_id);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatched_and_leased_rows_are_republished_with_a_new_delivery_id_once_their_visibility_passed(
) {
    let env = TestEnv::new().await;
    let mut rows = Vec::new();
    for (status, due) in [
        ("dispatched", true),
        ("leased", true),
        ("dispatched", false),
        ("leased", false),
    ] {
        let (_, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
        sqlx::query(
            "UPDATE kfs_probe_outbox SET status = $2, queue_job_id = 'old-' || id, dispatch_attempts = 1, \
               available_at = CASE WHEN $3 THEN now() - interval '1 second' ELSE now() + interval '1 hour' END \
             WHERE id = $1",
        )
        .bind(outbox)
        .bind(status)
        .bind(due)
        .execute(&env.pool)
        .await
        .unwrap();
        rows.push((outbox, status, due, outbox_text(&env.pool, outbox).await));
    }
    let r = relay(&env, "relay-visibility", cfg());
    let ch = env.confirm_channel().await;

    assert_eq!(
        round(&r, &ch, Kind::Probe).await,
        Round {
            claimed: 2,
            dispatched: 2,
            released: 0,
            dead: 0,
            look_again: false
        }
    );
    let msgs = drain(&env).await;
    let mut expected = HashSet::new();
    for (outbox, status, due, before) in &rows {
        if *due {
            let row = outbox_state(&env.pool, *outbox).await;
            assert_eq!(row.status, "dispatched", "{status} row republished");
            assert_eq!(row.dispatch_attempts, 2);
            let id = row.queue_job_id.unwrap();
            assert_ne!(
                id,
                format!("old-{outbox}"),
                "{status} row gets a new delivery id"
            );
            expected.insert((*outbox, id));
        } else {
            assert_eq!(
                &outbox_text(&env.pool, *outbox).await,
                before,
                "{status} row inside its window untouched"
            );
        }
    }
    let got: HashSet<(Uuid, String)> = msgs
        .iter()
        .map(|m| (outbox_header(m), message_id(m)))
        .collect();
    assert_eq!(msgs.len(), 2);
    assert_eq!(got, expected);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traceparent_in_the_payload_travels_as_the_traceparent_header() {
    let env = TestEnv::new().await;
    let (_, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    sqlx::query("UPDATE kfs_probe_outbox SET payload = payload || jsonb_build_object('traceparent', $2::text) WHERE id = $1")
        .bind(outbox)
        .bind(tp)
        .execute(&env.pool)
        .await
        .unwrap();
    let r = relay(&env, "relay-trace", cfg());
    round(&r, &env.confirm_channel().await, Kind::Probe).await;
    let msgs = drain(&env).await;
    assert_eq!(msgs.len(), 1);
    let h = msgs[0].properties.headers().as_ref().expect("headers");
    assert_eq!(str_header(h, "traceparent"), Some(tp));
    let body: serde_json::Value = serde_json::from_slice(&msgs[0].data).unwrap();
    assert_eq!(
        body["traceparent"], tp,
        "the body is still the whole payload"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_publish_is_released_with_backoff_and_dead_after_the_last_attempt_failing_the_job(
) {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let topology = unroutable_topology(&env).await;
    let r = Relay::new(
        env.pool.clone(),
        topology.clone(),
        "relay-unroutable",
        RelayConfig {
            max_dispatch_attempts: 3,
            ..cfg()
        },
        &[Kind::Probe],
    );
    let ch = env.confirm_channel().await;

    for attempt in 1..=2 {
        assert_eq!(
            round(&r, &ch, Kind::Probe).await,
            Round {
                claimed: 1,
                dispatched: 0,
                released: 1,
                dead: 0,
                look_again: false
            },
            "attempt {attempt} released"
        );
        let row = outbox_state(&env.pool, outbox).await;
        assert_eq!(row.status, "pending");
        assert!(row.lock_cleared);
        assert_eq!(row.dispatch_attempts, attempt);
        assert!(!row.due, "released with a backoff into the future");
        // attempt n waits within [base·2^(n−1)/2, base·2^(n−1)], base = 600 s.
        let full = 600_000 * (1 << (attempt - 1));
        assert!(
            (full / 2..=full).contains(&row.available_after_update_ms),
            "backoff {} ms for attempt {attempt}",
            row.available_after_update_ms
        );
        assert!(
            row.last_error
                .as_deref()
                .unwrap_or_default()
                .contains("returned"),
            "last_error: {:?}",
            row.last_error
        );
        assert_eq!(
            job_state(&env.pool, job).await.0,
            "dispatch_pending",
            "the job waits"
        );
        // Not due yet: nothing is claimed.
        assert_eq!(round(&r, &ch, Kind::Probe).await, Round::default());
        sqlx::query(
            "UPDATE kfs_probe_outbox SET available_at = now() - interval '1 second' WHERE id = $1",
        )
        .bind(outbox)
        .execute(&env.pool)
        .await
        .unwrap();
    }

    assert_eq!(
        round(&r, &ch, Kind::Probe).await,
        Round {
            claimed: 1,
            dispatched: 0,
            released: 0,
            dead: 1,
            look_again: false
        }
    );
    let row = outbox_state(&env.pool, outbox).await;
    assert_eq!(row.status, "dead");
    assert!(row.lock_cleared);
    assert_eq!(row.dispatch_attempts, 3);
    assert!(row.last_error.unwrap().starts_with("dispatch_exhausted"));
    let (state, code, slot, completed): (String, Option<String>, Option<i32>, bool) = sqlx::query_as(
        "SELECT run_state, last_error_code, active_slot, completed_at IS NOT NULL FROM kfs_probe_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(state, "failed");
    assert_eq!(code.as_deref(), Some("dispatch_exhausted"));
    assert_eq!(slot, None, "a failed probe frees its slot");
    assert!(completed);
    // A dead row is never claimed again.
    sqlx::query(
        "UPDATE kfs_probe_outbox SET available_at = now() - interval '1 second' WHERE id = $1",
    )
    .bind(outbox)
    .execute(&env.pool)
    .await
    .unwrap();
    assert_eq!(round(&r, &ch, Kind::Probe).await, Round::default());
    delete_exchange(&env, &topology).await;
    env.cleanup().await;
}

/// A worker process holding a job under a long lease is killed; the sweep makes its row due
/// for takeover, and that republish cannot be routed on its last allowed dispatch attempt
/// (`KFS_MAX_DISPATCH_ATTEMPTS=1`). The job cannot be failed under the live lease, and a dead
/// row is never published again: so the row is released, not dead, and once routing returns
/// the job is published and runs to the end. Never `running` with a dead outbox row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_that_exhausts_its_dispatch_attempts_under_a_live_lease_is_released_not_dead() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let ch = env.confirm_channel().await;
    assert_eq!(
        round(&relay(&env, "relay-first", cfg()), &ch, Kind::Probe)
            .await
            .dispatched,
        1
    );
    // The holder dies right after its claim committed: the job is `running` under a lease of
    // ten minutes that nobody renews.
    let mut holder = env.spawn_worker(
        "holder",
        &[
            "run",
            "--kinds",
            "probe",
            "--worker-id",
            "holder",
            "--consumer",
        ],
        &[
            ("KFS_CRASH_AT", "after-claim-commit"),
            ("KFS_BATCH_MAX", "1"),
            ("KFS_LEASES", "probe=600s"),
        ],
    );
    let status = holder.exited(HANG).await;
    assert!(
        status.is_some_and(|s| std::os::unix::process::ExitStatusExt::signal(&s).is_some()),
        "the holder must die at its kill point: {status:?}\n{}",
        holder.tail(30)
    );
    assert_eq!(job_state(&env.pool, job).await.0, "running");
    // Nothing brings the message back but the relay: the broker's redelivery is gone.
    drain(&env).await;
    let pool = env.pool.clone();
    let rearmed = env
        .wait_until(HANG, || {
            let pool = pool.clone();
            async move {
                kfs_worker::maintenance::sweep_once(&pool, Kind::Probe)
                    .await
                    .unwrap()
                    == 1
            }
        })
        .await;
    assert!(rearmed, "the sweep never made the dead holder's row due");

    // The takeover's republish comes back unroutable, on its last allowed attempt.
    let topology = unroutable_topology(&env).await;
    let unroutable = Relay::new(
        env.pool.clone(),
        topology.clone(),
        "relay-unroutable",
        RelayConfig {
            max_dispatch_attempts: 1,
            ..cfg()
        },
        &[Kind::Probe],
    );
    let r = round(&unroutable, &ch, Kind::Probe).await;
    let row = outbox_state(&env.pool, outbox).await;
    let (state, _) = job_state(&env.pool, job).await;
    assert!(
        !(state == "running" && row.status == "dead"),
        "the job is left running with a dead outbox row: {r:?}, job {state}, outbox {row:?}"
    );
    assert_eq!(
        (r.dead, r.released, row.status.as_str(), state.as_str()),
        (0, 1, "pending", "running"),
        "released under the live lease: {row:?}"
    );

    // Routing returns: the row is published again and a live worker runs the job to the end.
    sqlx::query("UPDATE kfs_probe_outbox SET available_at = now() WHERE id = $1")
        .bind(outbox)
        .execute(&env.pool)
        .await
        .unwrap();
    let again = round(&relay(&env, "relay-back", cfg()), &ch, Kind::Probe).await;
    assert_eq!(again.dispatched, 1, "{again:?}");
    let mut taker = env.spawn_worker(
        "taker",
        &[
            "run",
            "--kinds",
            "probe",
            "--worker-id",
            "taker",
            "--consumer",
        ],
        &[("KFS_LEASES", "probe=600s")],
    );
    let done = env.wait_probe_succeeded(1, Duration::from_secs(60)).await;
    assert!(
        done,
        "the job never ran again: {}\n{}",
        job_text(&env.pool, job).await,
        taker.tail(30)
    );
    assert_eq!(outbox_state(&env.pool, outbox).await.status, "completed");
    taker.kill();
    delete_exchange(&env, &topology).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_side_by_side_publish_each_of_500_rows_exactly_once() {
    let env = TestEnv::new().await;
    probe::enqueue_many(&env.pool, 500, &ProbeSpec::default())
        .await
        .unwrap();
    let a = relay(&env, "relay-a", RelayConfig { batch: 20, ..cfg() });
    let b = relay(&env, "relay-b", RelayConfig { batch: 20, ..cfg() });
    let (ch_a, ch_b) = (env.confirm_channel().await, env.confirm_channel().await);

    async fn run(r: &Relay, ch: &lapin::Channel) -> (usize, usize, usize) {
        let (mut claimed, mut dispatched, mut rounds) = (0, 0, 0);
        loop {
            let got = round(r, ch, Kind::Probe).await;
            assert_eq!(got.released + got.dead, 0, "{got:?}");
            if got.claimed == 0 {
                return (claimed, dispatched, rounds);
            }
            claimed += got.claimed;
            dispatched += got.dispatched;
            rounds += 1;
        }
    }
    let ((ca, da, ra), (cb, db, rb)) = tokio::join!(run(&a, &ch_a), run(&b, &ch_b));
    assert_eq!(
        ca + cb,
        500,
        "claimed in total (a: {ca} in {ra} rounds, b: {cb} in {rb} rounds)"
    );
    assert_eq!(da + db, 500);

    let msgs = drain(&env).await;
    assert_eq!(msgs.len(), 500, "messages in the queue");
    let ids: HashSet<String> = msgs.iter().map(message_id).collect();
    assert_eq!(ids.len(), 500, "distinct delivery ids");
    let outboxes: HashSet<Uuid> = msgs.iter().map(outbox_header).collect();
    assert_eq!(outboxes.len(), 500, "distinct outbox rows");
    let (rows, once, matching): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE status = 'dispatched' AND dispatch_attempts = 1), \
           count(*) FILTER (WHERE queue_job_id = ANY($1)) FROM kfs_probe_outbox",
    )
    .bind(ids.into_iter().collect::<Vec<_>>())
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        (rows, once, matching),
        (500, 500, 500),
        "every row claimed once, each message names its row's delivery"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_or_locked_rows_do_not_block_the_others() {
    let env = TestEnv::new().await;
    let mut healthy = Vec::new();
    for _ in 0..4 {
        healthy.push(enqueue_one(&env.pool, &ProbeSpec::default()).await);
    }
    // A 200 KB payload: no consumer accepts it, so the relay does not publish it; the row is
    // dead at once and its job failed, instead of being republished forever.
    let (_, huge) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    sqlx::query("UPDATE kfs_probe_outbox SET payload = payload || jsonb_build_object('padding', repeat('x', 200000)) WHERE id = $1")
        .bind(huge)
        .execute(&env.pool)
        .await
        .unwrap();
    // A payload that is not an object at all, and a non-string traceparent elsewhere.
    let (_, array) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    sqlx::query("UPDATE kfs_probe_outbox SET payload = '[1, 2, 3]' WHERE id = $1")
        .bind(array)
        .execute(&env.pool)
        .await
        .unwrap();
    let (_, odd_trace) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    sqlx::query(
        "UPDATE kfs_probe_outbox SET payload = payload || '{\"traceparent\": 42}' WHERE id = $1",
    )
    .bind(odd_trace)
    .execute(&env.pool)
    .await
    .unwrap();
    // A row whose job already failed.
    let (failed_job, failed) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    sqlx::query(
        "UPDATE kfs_probe_jobs SET run_state = 'failed', active_slot = NULL, completed_at = now(), \
           last_error_code = 'x', row_version = row_version + 1 WHERE id = $1",
    )
    .bind(failed_job)
    .execute(&env.pool)
    .await
    .unwrap();
    let failed_job_before = job_text(&env.pool, failed_job).await;
    // A row whose job row another transaction holds locked, and a row whose outbox row is.
    let (locked_job, locked_job_outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let (_, locked_outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let mut blocker = PgConnection::connect(&env.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut blocker).await.unwrap();
    sqlx::query("SELECT 1 FROM kfs_probe_jobs WHERE id = $1 FOR UPDATE")
        .bind(locked_job)
        .execute(&mut blocker)
        .await
        .unwrap();
    sqlx::query("SELECT 1 FROM kfs_probe_outbox WHERE id = $1 FOR UPDATE")
        .bind(locked_outbox)
        .execute(&mut blocker)
        .await
        .unwrap();

    let r = relay(&env, "relay-poison", cfg());
    let ch = env.confirm_channel().await;
    assert_eq!(
        round(&r, &ch, Kind::Probe).await,
        Round {
            claimed: 9,
            dispatched: 8,
            released: 0,
            dead: 1,
            look_again: false
        }
    );
    assert_eq!(outbox_state(&env.pool, huge).await.status, "dead");
    for (job, outbox) in &healthy {
        assert_eq!(outbox_state(&env.pool, *outbox).await.status, "dispatched");
        assert_eq!(job_state(&env.pool, *job).await.0, "queued");
    }
    for outbox in [array, odd_trace, failed, locked_job_outbox] {
        assert_eq!(
            outbox_state(&env.pool, outbox).await.status,
            "dispatched",
            "{outbox}"
        );
    }
    assert_eq!(
        job_text(&env.pool, failed_job).await,
        failed_job_before,
        "a failed job is not moved to queued"
    );
    assert_eq!(
        outbox_state(&env.pool, locked_outbox).await.status,
        "pending",
        "a locked outbox row is skipped"
    );
    let msgs = drain(&env).await;
    assert_eq!(msgs.len(), 8);
    assert!(
        msgs.iter().all(|m| outbox_header(m) != huge),
        "the oversized row was not published"
    );
    let arr = msgs
        .iter()
        .find(|m| outbox_header(m) == array)
        .expect("the array row was published");
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&arr.data).unwrap(),
        serde_json::json!([1, 2, 3])
    );
    let odd = msgs.iter().find(|m| outbox_header(m) == odd_trace).unwrap();
    assert_eq!(
        str_header(odd.properties.headers().as_ref().unwrap(), "traceparent"),
        None
    );

    // The lock ends: the skipped row goes out, and the skipped job transition is harmless
    // (the consumer accepts dispatch_pending as well as queued).
    sqlx::query("ROLLBACK").execute(&mut blocker).await.unwrap();
    assert_eq!(
        job_state(&env.pool, locked_job).await.0,
        "dispatch_pending",
        "mark skipped the locked job row"
    );
    assert_eq!(
        round(&r, &ch, Kind::Probe).await,
        Round {
            claimed: 1,
            dispatched: 1,
            released: 0,
            dead: 0,
            look_again: false
        }
    );
    let later = drain(&env).await;
    assert_eq!(
        later.iter().map(outbox_header).collect::<Vec<_>>(),
        vec![locked_outbox]
    );

    // A consumer settles every row: those no delivery can use at once (the array payload dead,
    // the failed job's row dead to match it), instead of leaving them to be published again
    // every visibility window; the others by running their jobs.
    let engine = Engine::new(
        env.pool.clone(),
        "worker-odd",
        vec![Arc::new(ProbeHandler)],
        ConsumerConfig::default(),
    );
    for m in msgs.iter().chain(&later) {
        tokio::time::timeout(
            HANG,
            engine.process(
                Kind::Probe,
                &m.properties,
                &m.data,
                &CancellationToken::new(),
            ),
        )
        .await
        .expect("process hung");
    }
    let mut settled = Vec::new();
    for outbox in [
        huge,
        array,
        failed,
        odd_trace,
        locked_job_outbox,
        locked_outbox,
    ] {
        settled.push(outbox_state(&env.pool, outbox).await.status);
    }
    assert_eq!(
        settled,
        [
            "dead",
            "dead",
            "dead",
            "completed",
            "completed",
            "completed"
        ],
        "huge, array, failed, odd_trace, locked_job_outbox, locked_outbox"
    );
    for (job, outbox) in &healthy {
        assert_eq!(outbox_state(&env.pool, *outbox).await.status, "completed");
        assert_eq!(job_state(&env.pool, *job).await.0, "succeeded");
    }
    assert_eq!(
        job_text(&env.pool, failed_job).await,
        failed_job_before,
        "settling its row leaves a failed job as it is"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traceparent_larger_than_a_frame_does_not_take_the_rest_of_the_batch_down() {
    let env = TestEnv::new().await;
    // The poison row comes first in claim order (available_at, id).
    let (_, poison) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    sqlx::query(
        "UPDATE kfs_probe_outbox SET available_at = now() - interval '1 minute', \
           payload = payload || jsonb_build_object('traceparent', repeat('0', 200000)) WHERE id = $1",
    )
    .bind(poison)
    .execute(&env.pool)
    .await
    .unwrap();
    let mut healthy = Vec::new();
    for _ in 0..4 {
        healthy.push(enqueue_one(&env.pool, &ProbeSpec::default()).await.1);
    }
    // Its own connection: the broker may close it.
    let conn =
        lapin::Connection::connect(&support::amqp_url(), lapin::ConnectionProperties::default())
            .await
            .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await
        .unwrap();
    let r = relay(
        &env,
        "relay-big-header",
        RelayConfig {
            confirm_timeout: Duration::from_secs(10),
            ..cfg()
        },
    );
    let _ = tokio::time::timeout(HANG, r.relay_once(&ch, Kind::Probe))
        .await
        .expect("relay_once hung");

    for outbox in &healthy {
        assert_eq!(
            outbox_state(&env.pool, *outbox).await.status,
            "dispatched",
            "a healthy row in the poison's batch"
        );
    }
    let published: HashSet<Uuid> = drain(&env).await.iter().map(outbox_header).collect();
    assert!(
        healthy.iter().all(|o| published.contains(o)),
        "healthy rows published"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_going_dead_does_not_wait_for_its_locked_job_row() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let topology = unroutable_topology(&env).await;
    // A worker stopped in the middle of a step (SIGSTOP) keeps its step transaction, and with it
    // the job row lock, open.
    let mut stalled = PgConnection::connect(&env.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut stalled).await.unwrap();
    sqlx::query("SELECT 1 FROM kfs_probe_jobs WHERE id = $1 FOR UPDATE")
        .bind(job)
        .execute(&mut stalled)
        .await
        .unwrap();

    let r = Relay::new(
        env.pool.clone(),
        topology.clone(),
        "relay-dead-locked",
        RelayConfig {
            max_dispatch_attempts: 1,
            ..cfg()
        },
        &[Kind::Probe],
    );
    let ch = env.confirm_channel().await;
    let got = tokio::time::timeout(Duration::from_secs(10), r.relay_once(&ch, Kind::Probe)).await;
    sqlx::query("ROLLBACK").execute(&mut stalled).await.unwrap();
    let got = got
        .expect("relay_once waited for the job row lock held by a stalled transaction")
        .unwrap();
    assert_eq!(got.claimed, 1);
    // Not waited for: released for a short while instead, and dead on the next round.
    assert_eq!(outbox_state(&env.pool, outbox).await.status, "pending");
    sqlx::query("UPDATE kfs_probe_outbox SET available_at = now() WHERE id = $1")
        .bind(outbox)
        .execute(&env.pool)
        .await
        .unwrap();
    let again = r.relay_once(&ch, Kind::Probe).await.unwrap();
    assert_eq!(again.dead, 1, "{again:?}");
    assert_eq!(outbox_state(&env.pool, outbox).await.status, "dead");
    assert_eq!(job_state(&env.pool, job).await.0, "failed");
    delete_exchange(&env, &topology).await;
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// The platform's own tables.
// ---------------------------------------------------------------------------------------------

const TENANT: &str = "tenant-relay";

/// The FK targets every platform job needs: a space (owned by `user-1`) and one document.
async fn platform_space(pool: &PgPool) -> (Uuid, Uuid) {
    let mut conn = pool.acquire().await.unwrap();
    let space = kfs_worker::tools::platform::create_space(
        &mut conn,
        TENANT,
        &format!("space-{}", Uuid::new_v4()),
        "Relay space",
        "user-1",
    )
    .await
    .unwrap();
    let doc = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO document_assets (id, knowledge_space_id, source_id, filename, mime_type, object_key, sha256, \
           size_bytes, version, parser_status, metadata, created_at) \
         VALUES ($1, $2, NULL, 'a.pdf', 'application/pdf', 'objects/a.pdf', repeat('0', 64), 10, 1, 'pending', \
           '{\"permissionScope\": []}', now())",
    )
    .bind(doc)
    .bind(space)
    .execute(&mut *conn)
    .await
    .unwrap();
    (space, doc)
}

/// Writes one job of each platform kind, as DESIGN.md "How the platform writes jobs" says.
/// Returns (compile attempt, deletion job, research job).
async fn platform_jobs(pool: &PgPool) -> (Uuid, Uuid, Uuid) {
    let (space, doc) = platform_space(pool).await;
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
    let (attempt, deletion, research) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    let mut tx = pool.begin().await.unwrap();
    let statements: [&str; 6] = [
        "INSERT INTO document_compilation_attempts (id, tenant_id, knowledge_space_id, document_asset_id, document_version, \
           publication_generation_id, base_head_revision, checkpoint, run_state, active_slot, execution_attempts, \
           max_execution_attempts, row_version, created_at, updated_at) \
         VALUES ($1, $5, $6, $7, 1, gen_random_uuid(), 0, 'queued', 'dispatch_pending', 1, 0, 5, 0, now(), now())",
        "INSERT INTO document_compilation_outbox (id, attempt_id, event_type, schema_version, payload, idempotency_key, \
           status, dispatch_attempts, available_at, created_at, updated_at) \
         VALUES (gen_random_uuid(), $1, 'document.compile', 1, jsonb_build_object('attemptId', $1::text), \
           'document.compile:' || $1::text, 'pending', 0, now(), now(), now())",
        "INSERT INTO deletion_jobs (id, tenant_id, knowledge_space_id, target_type, target_id, target_revision, delete_mode, \
           requested_by_subject_id, permission_snapshot_id, permission_snapshot_revision, access_channel, idempotency_key, \
           request_fingerprint, checkpoint, inventory_complete, run_state, active_slot, execution_attempts, \
           max_execution_attempts, row_version, created_at, updated_at) \
         VALUES ($2, $5, $6, 'document_asset', $7, 1, 'cascade', 'user-1', $4, 1, 'interactive', 'req-' || $2::text, \
           repeat('a', 64), 'requested', false, 'dispatch_pending', 1, 0, 10, 1, now(), now())",
        "INSERT INTO deletion_outbox (id, deletion_job_id, delivery_revision, event_type, schema_version, idempotency_key, \
           request_idempotency_key, request_fingerprint, payload, status, available_at, dispatch_attempts, created_at, updated_at) \
         VALUES (gen_random_uuid(), $2, 1, 'deletion.job', 1, 'deletion:' || $2::text || ':1', 'req-' || $2::text, \
           repeat('a', 64), jsonb_build_object('deletionJobId', $2::text), 'pending', now(), 0, now(), now())",
        "INSERT INTO research_task_jobs (id, tenant_id, knowledge_space_id, subject_id, permission_snapshot_id, \
           permission_snapshot_revision, access_channel, query, limits, metadata, cost, stage, row_version, \
           execution_attempts, max_execution_attempts, created_at, updated_at) \
         VALUES ($3, $5, $6, 'user-1', $4, 1, 'interactive', 'why?', '{}', '{}', '{}', 'queued', 1, 0, 5, \
           (extract(epoch FROM now()) * 1000)::bigint, (extract(epoch FROM now()) * 1000)::bigint)",
        "INSERT INTO research_task_outbox (id, research_task_job_id, delivery_revision, event_type, schema_version, \
           idempotency_key, payload, status, available_at, dispatch_attempts, created_at, updated_at) \
         VALUES (gen_random_uuid(), $3, 1, 'research.task', 1, \
           'research.task:' || $5 || ':' || $6::text || ':' || $3::text || ':1', \
           jsonb_build_object('researchTaskJobId', $3::text), 'pending', (extract(epoch FROM now()) * 1000)::bigint, 0, \
           (extract(epoch FROM now()) * 1000)::bigint, (extract(epoch FROM now()) * 1000)::bigint)",
    ];
    for sql in statements {
        sqlx::query(sql)
            .bind(attempt)
            .bind(deletion)
            .bind(research)
            .bind(snapshot)
            .bind(TENANT)
            .bind(space)
            .bind(doc)
            .execute(&mut *tx)
            .await
            .unwrap_or_else(|e| panic!("{e}: {sql}"));
    }
    tx.commit().await.unwrap();
    (attempt, deletion, research)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn platform_rows_are_relayed_in_their_own_time_type_and_state_model() {
    let env = TestEnv::new().await;
    let (attempt, deletion, research) = platform_jobs(&env.pool).await;
    let r = Relay::new(
        env.pool.clone(),
        env.topology.clone(),
        "relay-platform",
        cfg(),
        &Kind::platform(),
    );
    let ch = env.confirm_channel().await;
    for kind in Kind::platform() {
        assert_eq!(
            round(&r, &ch, kind).await,
            Round {
                claimed: 1,
                dispatched: 1,
                released: 0,
                dead: 0,
                look_again: false
            },
            "{kind}"
        );
    }

    for (kind, job) in [(Kind::Compile, attempt), (Kind::Deletion, deletion)] {
        let spec = kind.spec();
        let (state, rv): (String, i32) =
            sqlx::query_as(&spec.sql("SELECT run_state, row_version FROM {job} WHERE id = $1"))
                .bind(job)
                .fetch_one(&env.pool)
                .await
                .unwrap();
        let start = if kind == Kind::Compile { 0 } else { 1 };
        assert_eq!(
            (state.as_str(), rv),
            ("queued", start + 1),
            "{kind}: dispatch_pending -> queued"
        );
        let (status, window): (String, f64) = sqlx::query_as(&spec.sql(
            "SELECT status, extract(epoch FROM available_at - updated_at)::float8 FROM {outbox} WHERE {fk} = $1",
        ))
        .bind(job)
        .fetch_one(&env.pool)
        .await
        .unwrap();
        assert_eq!((status.as_str(), window), ("dispatched", 300.0), "{kind}");
    }
    // Research: no run_state; the stage stays, the row version too; times are epoch ms.
    let (stage, rv): (String, i32) =
        sqlx::query_as("SELECT stage, row_version FROM research_task_jobs WHERE id = $1")
            .bind(research)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!((stage.as_str(), rv), ("queued", 1));
    let (status, window, available_at): (String, i64, i64) = sqlx::query_as(
        "SELECT status, available_at - updated_at, available_at FROM research_task_outbox WHERE research_task_job_id = $1",
    )
    .bind(research)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        (status.as_str(), window),
        ("dispatched", 300_000),
        "visibility in milliseconds"
    );
    assert!(
        (1_000_000_000_000..100_000_000_000_000).contains(&available_at),
        "epoch milliseconds: {available_at}"
    );

    for (kind, job, field) in [
        (Kind::Compile, attempt, "attemptId"),
        (Kind::Deletion, deletion, "deletionJobId"),
        (Kind::Research, research, "researchTaskJobId"),
    ] {
        let msgs = drain_queue(&env, &env.topology.queue(kind)).await;
        assert_eq!(msgs.len(), 1, "{kind}");
        let p = &msgs[0].properties;
        assert_eq!(
            p.kind().as_ref().map(|s| s.to_string()).as_deref(),
            Some(kind.event_type())
        );
        assert_eq!(
            p.correlation_id().as_ref().map(|s| s.to_string()),
            Some(job.to_string())
        );
        let h = p.headers().as_ref().unwrap();
        assert_eq!(int_header(h, "x-kfs-delivery-revision"), Some(1));
        let body: serde_json::Value = serde_json::from_slice(&msgs[0].data).unwrap();
        assert_eq!(body[field], job.to_string());
    }
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatch_exhaustion_fails_each_platform_job_by_its_tables_rules() {
    let env = TestEnv::new().await;
    let (attempt, deletion, research) = platform_jobs(&env.pool).await;
    let topology = unroutable_topology(&env).await;
    let r = Relay::new(
        env.pool.clone(),
        topology.clone(),
        "relay-platform-dead",
        RelayConfig {
            max_dispatch_attempts: 1,
            ..cfg()
        },
        &Kind::platform(),
    );
    let ch = env.confirm_channel().await;
    for kind in Kind::platform() {
        assert_eq!(
            round(&r, &ch, kind).await,
            Round {
                claimed: 1,
                dispatched: 0,
                released: 0,
                dead: 1,
                look_again: false
            },
            "{kind}"
        );
        let status: String = sqlx::query_scalar(&kind.spec().sql("SELECT status FROM {outbox}"))
            .fetch_one(&env.pool)
            .await
            .unwrap();
        assert_eq!(status, "dead", "{kind}");
    }

    // A failed compile attempt frees its slot and is complete.
    let row: (String, Option<i32>, bool, Option<String>, bool) = sqlx::query_as(
        "SELECT run_state, active_slot, completed_at IS NOT NULL, last_error_code, lease_token IS NULL \
         FROM document_compilation_attempts WHERE id = $1",
    )
    .bind(attempt)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        row,
        (
            "failed".into(),
            None,
            true,
            Some("dispatch_exhausted".into()),
            true
        )
    );
    // A failed deletion keeps its slot and is not complete: it waits for a manual retry.
    let row: (String, Option<i32>, bool, Option<String>, String) = sqlx::query_as(
        "SELECT run_state, active_slot, completed_at IS NULL, last_error_code, checkpoint FROM deletion_jobs WHERE id = $1",
    )
    .bind(deletion)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        row,
        (
            "failed".into(),
            Some(1),
            true,
            Some("dispatch_exhausted".into()),
            "requested".into()
        )
    );
    // A failed research task: stage failed, completed_at in epoch ms, the code in `error`.
    let (stage, completed_at, error, now_ms): (String, Option<i64>, Option<String>, i64) = sqlx::query_as(
        "SELECT stage, completed_at, error, (extract(epoch FROM now()) * 1000)::bigint FROM research_task_jobs WHERE id = $1",
    )
    .bind(research)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(stage, "failed");
    let completed_at = completed_at.expect("completed_at set");
    assert!(
        completed_at <= now_ms && completed_at > now_ms - 3_600_000,
        "completed_at {completed_at} is epoch ms near {now_ms}"
    );
    assert!(error.unwrap_or_default().starts_with("dispatch_exhausted"));
    // As every failure, the relay's records the kind's failure: research's failed event.
    let events: Vec<(String, String, serde_json::Value)> = sqlx::query_as(
        "SELECT event_type, stage, payload FROM research_task_progress_events \
         WHERE research_task_job_id = $1 ORDER BY sequence",
    )
    .bind(research)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        events,
        vec![(
            "research_task.failed".to_owned(),
            "failed".to_owned(),
            serde_json::json!({"error": "dispatch_exhausted"})
        )],
        "the failed event, and no claim event: nothing claimed the task"
    );
    delete_exchange(&env, &topology).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_coming_due_is_polled_while_another_kind_has_steady_traffic() {
    let env = TestEnv::new().await;
    let (attempt, deletion, research) = platform_jobs(&env.pool).await;
    // Only the research row matters: it comes due 2 s from now, and nothing notifies then.
    for (table, fk, id) in [
        ("document_compilation_outbox", "attempt_id", attempt),
        ("deletion_outbox", "deletion_job_id", deletion),
    ] {
        sqlx::query(&format!("DELETE FROM {table} WHERE {fk} = $1"))
            .bind(id)
            .execute(&env.pool)
            .await
            .unwrap();
    }
    let due_ms: i64 = sqlx::query_scalar(
        "UPDATE research_task_outbox SET available_at = (extract(epoch FROM now()) * 1000)::bigint + 2000 \
         WHERE research_task_job_id = $1 RETURNING available_at",
    )
    .bind(research)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    let poll_ms = 1000_i64;
    let mut relay = env.spawn_worker(
        "relay-poll",
        &["run", "--relay"],
        &[("KFS_KINDS", "probe,research"), ("KFS_RELAY_POLL", "1s")],
    );
    // Probe rows arrive every 300 ms, each notifying, until 5 poll periods after the due time.
    let mut dispatched: Option<i64> = None;
    loop {
        enqueue_one(&env.pool, &ProbeSpec::default()).await;
        let (status, at, now): (String, i64, i64) = sqlx::query_as(
            "SELECT status::text, updated_at, (extract(epoch FROM now()) * 1000)::bigint \
             FROM research_task_outbox WHERE research_task_job_id = $1",
        )
        .bind(research)
        .fetch_one(&env.pool)
        .await
        .unwrap();
        if status == "dispatched" {
            dispatched = Some(at);
            break;
        }
        if now > due_ms + 5 * poll_ms {
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let published = env
        .queue_depth(env.topology.queue(Kind::Probe).as_str())
        .await;
    relay.kill();
    let Some(at) = dispatched else {
        panic!(
            "the research row due at {due_ms} was not published within 5 poll periods while probe \
             traffic went on ({published} probe messages published meanwhile)\n{}",
            relay.tail(30)
        );
    };
    println!("[relay poll] published {} ms after coming due", at - due_ms);
    assert!(published > 0, "the probe traffic was relayed");
    assert!(
        at - due_ms <= 3 * poll_ms,
        "published {} ms after coming due: the poll is a fixed {poll_ms} ms interval",
        at - due_ms
    );
    env.cleanup().await;
}

/// Calls the relay's watch function `f` (`kfs_outbox_watch` or `kfs_outbox_unwatch`) for the
/// probe outbox on `conn`.
async fn watch(conn: &mut PgConnection, f: &str) -> bool {
    sqlx::query_scalar::<_, bool>(&format!("SELECT {f}($1)"))
        .bind(Kind::Probe.spec().outbox_table)
        .fetch_one(conn)
        .await
        .unwrap()
}

/// The next notification on `listener`, if one comes within `within`.
async fn notified_within(
    listener: &mut sqlx::postgres::PgListener,
    within: Duration,
) -> Option<String> {
    tokio::time::timeout(within, listener.recv())
        .await
        .ok()
        .map(|n| n.expect("listener").payload().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_skip_their_notification_only_while_a_relay_watches_and_it_lets_go_only_after_they_end(
) {
    let env = TestEnv::new().await;
    let mut listener = sqlx::postgres::PgListener::connect_with(&env.pool)
        .await
        .unwrap();
    listener.listen("kfs_outbox").await.unwrap();
    let mut relay_a = PgConnection::connect(&env.url).await.unwrap();
    let mut relay_b = PgConnection::connect(&env.url).await.unwrap();

    // No watcher: every writer notifies, as before.
    enqueue_one(&env.pool, &ProbeSpec::default()).await;
    assert_eq!(
        notified_within(&mut listener, HANG).await.as_deref(),
        Some(Kind::Probe.event_type()),
        "a writer with no relay watching notifies"
    );

    assert!(watch(&mut relay_a, "kfs_outbox_watch").await, "A watches");
    assert!(
        !watch(&mut relay_b, "kfs_outbox_watch").await,
        "one watcher per outbox"
    );

    // A writer while A watches: no notification, and A cannot let go while it is in flight.
    let mut writer = env.pool.begin().await.unwrap();
    probe::enqueue(&mut writer, &ProbeSpec::default())
        .await
        .unwrap();
    assert!(
        !watch(&mut relay_a, "kfs_outbox_unwatch").await,
        "a writer that skipped its notification is still in flight: A keeps watching"
    );
    writer.commit().await.unwrap();
    assert_eq!(
        notified_within(&mut listener, Duration::from_millis(500)).await,
        None,
        "the writer did not notify: A looks for its row itself"
    );
    assert!(
        watch(&mut relay_a, "kfs_outbox_unwatch").await,
        "its writer ended: A lets go"
    );

    // After A let go, writers notify again, and another relay may watch.
    enqueue_one(&env.pool, &ProbeSpec::default()).await;
    assert_eq!(
        notified_within(&mut listener, HANG).await.as_deref(),
        Some(Kind::Probe.event_type()),
        "a writer after the watcher let go notifies"
    );
    assert!(watch(&mut relay_b, "kfs_outbox_watch").await, "B watches");
    // A watch ends with its session, whatever happens to the relay.
    drop(relay_b);
    let mut relay_c = PgConnection::connect(&env.url).await.unwrap();
    assert!(
        env.wait_until(HANG, || {
            let url = env.url.clone();
            async move {
                let mut c = PgConnection::connect(&url).await.unwrap();
                watch(&mut c, "kfs_outbox_watch").await
            }
        })
        .await,
        "the watch of a closed session is free"
    );
    assert!(
        watch(&mut relay_c, "kfs_outbox_unwatch").await,
        "letting go of a watch not held is harmless"
    );
    drop(relay_c);
    drop(relay_a);
    env.cleanup().await;
}

/// How many probe outbox rows are `dispatched`.
async fn dispatched_probes(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM kfs_probe_outbox WHERE status = 'dispatched'")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A relay process of the probe kind whose poll is an hour away, so that only wake-ups and its
/// own looks publish; returned once it is up and listening, which its publishing a first row
/// shows. No consumer runs, so its window is set wider than every row these tests write.
async fn relay_polling_hourly(env: &TestEnv, name: &str) -> support::Worker {
    let relay = env.spawn_worker(
        name,
        &["run", "--relay"],
        &[
            ("KFS_KINDS", "probe"),
            ("KFS_RELAY_POLL", "60m"),
            ("KFS_RELAY_WINDOW", "100000"),
        ],
    );
    enqueue_one(&env.pool, &ProbeSpec::default()).await;
    assert!(
        env.wait_until(HANG, || async { dispatched_probes(&env.pool).await == 1 })
            .await,
        "the relay never published a first row\n{}",
        relay.tail(30)
    );
    relay
}

/// Samples `pg_locks` of the test's database until `stop`: whether any session held the probe
/// outbox's watch (migration 0102) meanwhile.
fn sample_watch(pool: PgPool, stop: CancellationToken) -> tokio::task::JoinHandle<bool> {
    tokio::spawn(async move {
        let mut conn = pool.acquire().await.unwrap();
        while !stop.is_cancelled() {
            let held: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
                   AND mode = 'ExclusiveLock' AND granted AND classid = 7038583 \
                   AND objid = hashtext('kfs_probe_outbox')::oid AND objsubid = 2 \
                   AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))",
            )
            .fetch_one(&mut *conn)
            .await
            .unwrap();
            if held {
                return true;
            }
        }
        false
    })
}

/// A relay takes the watch only in a burst: lone jobs, each committed after the last was
/// published, are published on their notifications and never make it watch (which would cost
/// each of them two more calls).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lone_jobs_are_published_on_their_notifications_without_a_watch() {
    let env = TestEnv::new().await;
    let mut relay = relay_polling_hourly(&env, "relay-lone").await;
    let dispatched = || dispatched_probes(&env.pool);
    let stop = CancellationToken::new();
    let sampler = sample_watch(env.pool.clone(), stop.clone());
    for n in 2..=30 {
        enqueue_one(&env.pool, &ProbeSpec::default()).await;
        assert!(
            env.wait_until(HANG, || async { dispatched().await == n })
                .await,
            "lone job {n} was not published on its notification\n{}",
            relay.tail(30)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.cancel();
    let watched = sampler.await.unwrap();
    relay.kill();
    assert!(!watched, "a lone job made the relay watch");
    env.cleanup().await;
}

/// With the poll out of the way (an hour away), every row is published on wake-ups and the relay's
/// own looks alone: writers in bursts, some keeping their transaction open after the insert,
/// while the relay watches and lets go again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_row_waits_for_the_poll_while_writers_come_and_go_around_the_watch() {
    let env = TestEnv::new().await;
    let mut relay = relay_polling_hourly(&env, "relay-watch").await;
    let dispatched = || dispatched_probes(&env.pool);
    const WRITERS: usize = 8;
    const EACH: usize = 40;
    let stop = CancellationToken::new();
    let sampler = sample_watch(env.pool.clone(), stop.clone());
    let mut writers = tokio::task::JoinSet::new();
    for w in 0..WRITERS {
        let pool = env.pool.clone();
        writers.spawn(async move {
            for i in 0..EACH {
                let mut tx = pool.begin().await.unwrap();
                probe::enqueue(&mut tx, &ProbeSpec::default())
                    .await
                    .unwrap();
                // Some keep their transaction open a while after the insert; some pause
                // between requests long enough for the relay to let go.
                if (w + i) % 3 == 0 {
                    tokio::time::sleep(Duration::from_millis(((w * 7 + i) % 5) as u64 * 10)).await;
                }
                tx.commit().await.unwrap();
                if (w * 3 + i) % 7 == 0 {
                    tokio::time::sleep(Duration::from_millis(((w + i) % 11) as u64 * 3)).await;
                }
            }
        });
    }
    while let Some(r) = writers.join_next().await {
        r.unwrap();
    }
    let total = (WRITERS * EACH) as i64 + 1;
    let all_out = env
        .wait_until(HANG, || async { dispatched().await == total })
        .await;
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM kfs_probe_outbox WHERE status = 'pending'")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    stop.cancel();
    let watched = sampler.await.unwrap();
    relay.kill();
    assert!(
        all_out,
        "{left} of {total} rows still pending with the poll an hour away: a wake-up was lost\n{}",
        relay.tail(30)
    );
    assert!(watched, "the writers' bursts never made the relay watch");
    env.cleanup().await;
}

/// The sequential scans of `table` counted so far, read afresh.
/// Waits until no session named `application` is left in `env`'s database (a session that ends
/// reports its table counters first); `false` if one still is after [`HANG`].
async fn ended(env: &TestEnv, application: &str) -> bool {
    env.wait_until(HANG, || async {
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
                .bind(application)
                .fetch_one(&env.pool)
                .await
                .unwrap();
        left == 0
    })
    .await
}

async fn seq_scans(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar("SELECT seq_scan FROM pg_stat_user_tables WHERE relid = $1::regclass")
        .bind(table)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A connection keeps the plans it made of a statement at its first executions. The relay's
/// claim and mark were planned while the outbox held a handful of rows and no analyse had run,
/// so they counted the window, updated the claimed rows and found the marked jobs by reading
/// the whole outbox and job table; as both grew, every lone job's claim read more (2.7 ms
/// after 6,000 jobs). Planned for the indexes, neither statement reads a table through.
///
/// Counted with `pg_stat_user_tables.seq_scan` over rounds that only the relay's own
/// connection runs: the relay planned its statements on 8 rows, then relays 12 more one at a
/// time over 5,000 rows.
#[tokio::test]
async fn the_claim_and_the_mark_planned_on_a_nearly_empty_outbox_never_read_the_whole_of_it_later()
{
    let env = TestEnv::new().await;
    for table in ["kfs_probe_outbox", "kfs_probe_jobs"] {
        sqlx::query(&format!(
            "ALTER TABLE {table} SET (autovacuum_enabled = false)"
        ))
        .execute(&env.pool)
        .await
        .unwrap();
    }
    // One connection, so every claim and mark runs on the connection that planned them.
    let own = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(
            PgConnectOptions::from_str(&env.url)
                .unwrap()
                .application_name("relay-plans"),
        )
        .await
        .unwrap();
    let r = Relay::new(
        own.clone(),
        env.topology.clone(),
        "relay-plans",
        RelayConfig { batch: 1, ..cfg() },
        &[Kind::Probe],
    );
    let ch = env.confirm_channel().await;
    let one_at_a_time = |n: usize| {
        let (r, ch) = (&r, &ch);
        async move {
            for _ in 0..n {
                let got = round(r, ch, Kind::Probe).await;
                assert_eq!((got.claimed, got.dispatched), (1, 1), "{got:?}");
            }
        }
    };
    probe::enqueue_many(&env.pool, 8, &ProbeSpec::default())
        .await
        .unwrap();
    one_at_a_time(8).await;
    // The outbox and the jobs grow; nothing analyses them. On a session of its own, which ends
    // (and reports its counters, among them the update's read of the whole outbox) before the
    // counting starts: a busy server may report an idle session's counters seconds late.
    let setup = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(
            PgConnectOptions::from_str(&env.url)
                .unwrap()
                .application_name("relay-plans-setup"),
        )
        .await
        .unwrap();
    probe::enqueue_many(&setup, 5_000, &ProbeSpec::default())
        .await
        .unwrap();
    sqlx::query("UPDATE kfs_probe_outbox SET status = 'canceled' WHERE status = 'pending'")
        .execute(&setup)
        .await
        .unwrap();
    probe::enqueue_many(&setup, 12, &ProbeSpec::default())
        .await
        .unwrap();
    setup.close().await;
    let setup_gone = ended(&env, "relay-plans-setup").await;
    assert!(setup_gone, "the setup's session did not end");
    let analysed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_user_tables WHERE relname IN ('kfs_probe_outbox', 'kfs_probe_jobs') \
           AND (last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL)",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(analysed, 0, "the tables must have no statistics");
    // Sessions report their table counters within a second of going idle: wait until every
    // other session's scans are in, then count from zero.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    for table in ["kfs_probe_outbox", "kfs_probe_jobs"] {
        sqlx::query("SELECT pg_stat_reset_single_table_counters($1::regclass)")
            .bind(table)
            .execute(&env.pool)
            .await
            .unwrap();
    }

    // Rounds counted, one lone job each.
    const ROUNDS: usize = 12;
    one_at_a_time(ROUNDS).await;

    // A session that ends reports its counters first.
    own.close().await;
    let gone = ended(&env, "relay-plans").await;
    assert!(gone, "the relay's session did not end");
    let (outbox, jobs) = (
        seq_scans(&env.pool, "kfs_probe_outbox").await,
        seq_scans(&env.pool, "kfs_probe_jobs").await,
    );
    // The counters are the database's, and a session reports what it scanned when it can. On a
    // loaded server this once counted 5 reads of the outbox: as many as the migration builds
    // indexes on it (each build counts as a read of the table), most likely reported late by
    // the migration's session. A connection keeps its plan, so a statement planned to read a
    // table through reads it at every round: fewer reads than rounds proves neither was.
    let rounds = ROUNDS as i64;
    assert!(
        outbox < rounds && jobs < rounds,
        "{ROUNDS} lone claims and marks read the whole outbox {outbox} times and the whole job table {jobs} times"
    );
    env.cleanup().await;
}

/// The mark never waits for a row a consumer's claim holds: that claim leases the row itself.
/// Waiting, the mark held the rows it had already locked until the claim ended, and the claims
/// and ends of those rows queued behind it. The skipped row stays `dispatching` under the
/// relay's lock; if its claim does not commit, the row is published again once that lock has
/// expired, with a new delivery id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mark_skips_a_row_a_claim_holds_and_marks_the_others_without_waiting() {
    let env = TestEnv::new().await;
    let mut rows = Vec::new();
    for _ in 0..3 {
        rows.push(enqueue_one(&env.pool, &ProbeSpec::default()).await.1);
    }
    rows.sort();
    let held = rows[1];
    Gate::install(&env).await;
    let gate = Gate::close(&env, "kfs-test-gate-skip").await;
    let (relaying, gated) = gate.hold_a_round(&env, "relay-skip").await;
    let first = outbox_state(&env.pool, held).await;
    assert_eq!(first.status, "dispatching");

    // A consumer's claim of the middle row is in flight, holding its outbox row.
    let mut claim = env.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM kfs_probe_outbox WHERE id = $1 FOR UPDATE")
        .bind(held)
        .execute(&mut *claim)
        .await
        .unwrap();
    gate.open().await;
    let got = tokio::time::timeout(HANG, relaying)
        .await
        .expect("the mark waited for the row the claim holds")
        .unwrap()
        .unwrap();
    assert_eq!((got.claimed, got.dispatched), (3, 2), "{got:?}");
    for id in [rows[0], rows[2]] {
        assert_eq!(outbox_state(&env.pool, id).await.status, "dispatched");
    }

    // The claim does not commit: the row is still the relay's, and once its lock has expired
    // it is published again under a new delivery id.
    claim.rollback().await.unwrap();
    let skipped = outbox_state(&env.pool, held).await;
    assert_eq!(skipped.status, "dispatching");
    assert!(!skipped.lock_cleared, "{skipped:?}");
    expire_lock(&env.pool, held).await;
    drain(&env).await;
    let again = round(
        &relay(&env, "relay-after", cfg()),
        &env.confirm_channel().await,
        Kind::Probe,
    )
    .await;
    assert_eq!((again.claimed, again.dispatched), (1, 1), "{again:?}");
    let republished = outbox_state(&env.pool, held).await;
    assert_eq!(republished.status, "dispatched");
    assert_ne!(republished.queue_job_id, first.queue_job_id);
    let msgs = drain(&env).await;
    assert_eq!(msgs.len(), 1);
    assert_eq!(Some(message_id(&msgs[0])), republished.queue_job_id);
    gated.close().await;
    env.cleanup().await;
}

/// Whether `queue` exists (a passive declare, on a channel of its own: a failed one closes it).
async fn queue_exists(env: &TestEnv, queue: &str) -> bool {
    env.channel()
        .await
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .is_ok()
}

/// A relay session whose poll finds its kind's queue gone (the passive declare that counts an
/// `auto` window's consumers fails) starts no new round, but its rounds in flight still settle
/// what they claimed before the session ends with the error: a round held before its mark
/// while the declare fails marks its rows once it goes on. Ended at once, the session dropped
/// that round and left its rows `dispatching` until their lock ran out, ten minutes here.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_declare_at_the_poll_lets_the_rounds_in_flight_settle_what_they_claimed() {
    let env = TestEnv::new().await;
    let mut rows = Vec::new();
    for _ in 0..3 {
        rows.push(enqueue_one(&env.pool, &ProbeSpec::default()).await.1);
    }
    Gate::install(&env).await;
    // The worker's sessions are named `kfs-worker <worker id>`.
    let gate = Gate::close(&env, "kfs-worker kfs-test-gate-declare").await;
    let poll = Duration::from_millis(50);
    let opts = kfs_worker::runtime::RunOptions {
        worker_id: "kfs-test-gate-declare".into(),
        consumer: false,
        maintenance: false,
        relay_cfg: RelayConfig {
            lock_ttl: Duration::from_secs(600),
            poll,
            // One round in flight: the one the gate holds.
            depth: 1,
            // An `auto` window: the poll counts the queue's consumers with a passive declare.
            windows: kfs_worker::relay::window::Windows {
                default: kfs_worker::relay::window::Size::Auto { per_consumer: 64 },
                per_kind: std::collections::BTreeMap::new(),
            },
            ..cfg()
        },
        ..crate::engine::options(&env, "kfs-test-gate-declare")
    };
    let stop = CancellationToken::new();
    let worker = tokio::spawn(kfs_worker::runtime::run(opts, stop.clone()));

    // The round claimed the three rows, published them and got its confirms; it waits to mark.
    gate.wait_until_held(&env).await;
    for &id in &rows {
        let row = outbox_state(&env.pool, id).await;
        assert_eq!(row.status, "dispatching", "{row:?}");
    }
    let queue = env.topology.queue(Kind::Probe);
    assert_eq!(env.queue_depth(&queue).await, 3, "the held round published");

    // The queue goes; the session's next poll fails its passive declare while the round waits.
    // Nothing outside the relay shows that poll, so twenty of its periods pass before the gate
    // opens (too few, and the round would settle before the poll, whatever the session does).
    env.channel()
        .await
        .queue_delete(
            queue.as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await
        .expect("delete the probe queue");
    tokio::time::sleep(poll * 20).await;

    gate.open().await;
    let states = || async {
        let mut out = Vec::new();
        for &id in &rows {
            let row = outbox_state(&env.pool, id).await;
            out.push((row.status, row.lock_cleared));
        }
        out
    };
    let settled = env
        .wait_until(HANG, || async {
            states().await.iter().all(|(s, _)| s != "dispatching")
        })
        .await;
    assert!(
        settled,
        "the rows the held round claimed are still dispatching under its lock: {:?}",
        states().await
    );
    assert_eq!(
        states().await,
        vec![("dispatched".to_owned(), true); 3],
        "the round marked what the broker had confirmed"
    );
    // Then the session ended with the error, and the next one declared the queue again.
    assert!(
        env.wait_until(HANG, || queue_exists(&env, &queue)).await,
        "the relay never declared the probe queue again"
    );

    stop.cancel();
    tokio::time::timeout(HANG, worker)
        .await
        .expect("the worker stopped")
        .unwrap()
        .unwrap();
    env.cleanup().await;
}
