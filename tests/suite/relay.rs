//! The outbox relay (DESIGN.md, "The relay" and "RabbitMQ topology") against a real Postgres
//! and a real RabbitMQ: claim with `SKIP LOCKED` and a new delivery id committed before the
//! publish, persistent mandatory publishes with confirms, mark fenced by lock token and status,
//! release with backoff, and `dead` after the last allowed dispatch attempt.
//!
//! Every test has its own database and queue prefix (`support::TestEnv`). Nothing sleeps to make
//! a row due: rows are made due by moving `available_at` / `locked_until` with SQL, and a relay
//! is held between its publish and its mark by a test-only trigger that waits on an advisory
//! lock the test holds.

mod claim;
mod mark;
mod notifications;
mod odd_rows;
mod platform;
mod polling;
mod publish;
mod query_plans;
mod release;
mod republish;

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
