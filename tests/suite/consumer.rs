//! The consumer (DESIGN.md, "The consumer: ack only after the commit") against a real
//! Postgres and, where a message is needed, a real RabbitMQ: decode, claim by the table's rules,
//! fenced steps, the four ends of a slice, heartbeats, fast takeover from dead workers, and the
//! same rules on the platform's own job tables.
//!
//! Deliveries are driven without a consumer loop: the outbox row is put out for delivery (by a
//! real relay round, or by SQL with a known delivery id) and the test calls
//! `Engine::process` / `Engine::process_ref` itself. Nothing sleeps to make time pass: leases,
//! retries and visibility windows are moved with SQL.

mod claim;
mod compile_attempts;
mod deletion_jobs;
mod fencing;
mod long_slices;
mod research_tasks;
mod slices;
mod step_failures;
mod takeover;
mod undecodable;
mod unusable_rows;

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
