//! research.task on the platform's real schema (at its migration 0054), against real Postgres and
//! RabbitMQ: the whole walk with the platform's progress payloads, final evidence bundle and
//! answer, the answer's deltas (streamed from a model before the task completes, stopped when
//! the lease is lost, restarted by a retry), replayed steps, pause in each stage, cancel, the
//! budget (reserved before each call, in the platform's `cost.entries`), a retry, a permission
//! snapshot revoked, expired or outdated mid-run, tasks authorized by a capability grant (its
//! content scope, a revoked grant, a fenced space), another tenant's space, unpublished
//! generations, permission scopes, a document deleted and a space being deleted mid-task, the
//! dense leg of a space with an embedding profile, the HTTP generator against a local stand-in,
//! the command line, and workers killed at each kill point.
//!
//! Knowledge is seeded by really compiling documents (`SpaceFx::compile` runs the compile
//! handler in-process through the engine), so every row retrieval reads is one the worker wrote.
//! Research jobs are driven in-process (a real relay round, the message taken off the queue,
//! `Engine::process`), by hand through the engine's own lease API, or by spawned workers.

mod command_line;
mod controls;
mod failures;
mod grants;
mod groups;
mod http_generator;
mod refusals;
mod retrieval;
mod streaming;
mod walk;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kfs_worker::consumer::{ConsumerConfig, Engine, Handled};
use kfs_worker::engine::lease::{self, Claim, End, Statements};
use kfs_worker::jobs::research::generator::{
    ExtractiveGenerator, Generator, OpenAiConfig, OpenAiGenerator, NO_EVIDENCE_ANSWER,
};
use kfs_worker::jobs::research::{self, control, RequestError, ResearchHandler, ResearchRequest};
use kfs_worker::jobs::{Handler, JobCtx, JobError, Kind, Policy, Step, RESEARCH};
use kfs_worker::relay::{Relay, RelayConfig};
use kfs_worker::tools::platform::{self, Upload};
use lapin::options::BasicGetOptions;
use serde_json::{json, Value};
use sqlx::{PgConnection, PgPool};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::support;
use crate::support::space::SpaceFx;

const HANG: Duration = Duration::from_secs(60);
const TENANT: &str = "t-acme";
const OTHER_TENANT: &str = "t-other";
const SUBJECT: &str = "alice";
const QUESTION: &str = "How does fencing use the lease token, and when does a lease expire?";
const INVALID: &str = "RESEARCH_TASK_PERMISSION_SNAPSHOT_INVALID";
const REVOKED: &str = "RESEARCH_TASK_CAPABILITY_REVOKED";

const LEASES: &str = "# Leases\n\nWorkers hold a lease on each job. A lease will expire after thirty \
seconds unless a heartbeat extends it.\n\n## Heartbeats\n\nThe heartbeat runs every ten seconds while \
the worker is alive.\n";
const FENCING: &str = "# Fencing\n\nFencing will use the lease token and the row version on every \
write. A worker whose lease was lost finds every write refused.\n";
const COOKING: &str = "# Bread\n\nBake the bread at two hundred degrees for forty minutes.\n";
const SECRET: &str =
    "# Fencing\n\nOTHER-TENANT-SECRET: fencing will use the lease token; a lease will \
expire; the quokka sleeps here.\n";

// ---------------------------------------------------------------------------------------------
// Seeding

struct Seeded {
    fx: SpaceFx,
    snapshot: Uuid,
    /// leases.md, fencing.md, cooking.md: compiled and published.
    docs: Vec<Uuid>,
    other_space: Uuid,
    other_doc: Uuid,
}

impl std::ops::Deref for Seeded {
    type Target = SpaceFx;

    fn deref(&self) -> &SpaceFx {
        &self.fx
    }
}

async fn upload(fx: &SpaceFx, space: Uuid, name: &str, text: &str, scope: Vec<String>) -> Uuid {
    let mut conn = fx.pool().acquire().await.unwrap();
    let how = Upload {
        permission_scope: scope,
        uploaded_by: None,
    };
    let bytes = Bytes::copy_from_slice(text.as_bytes());
    platform::upload(
        &mut conn,
        &fx.store,
        space,
        None,
        name,
        "text/markdown",
        bytes,
        &how,
    )
    .await
    .unwrap()
}

/// A space with three compiled documents and an interactive snapshot of alice, and another
/// tenant's space in the same database with the same words, also compiled.
async fn seed(slug: &str) -> Seeded {
    let fx = SpaceFx::new(TENANT, slug, "Docs").await;
    let snapshot = fx.snapshot(SUBJECT).await;
    let mut docs = Vec::new();
    for (name, text) in [
        ("leases.md", LEASES),
        ("fencing.md", FENCING),
        ("cooking.md", COOKING),
    ] {
        let d = fx.add(name, "text/markdown", text.as_bytes()).await;
        fx.compile(d).await;
        docs.push(d);
    }
    let other_space = {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::create_space(&mut conn, OTHER_TENANT, slug, "Docs", support::space::OWNER)
            .await
            .unwrap()
    };
    let other_doc = upload(&fx, other_space, "secret.md", SECRET, vec![]).await;
    fx.compile(other_doc).await;
    Seeded {
        fx,
        snapshot,
        docs,
        other_space,
        other_doc,
    }
}

fn req(s: &Seeded, question: &str) -> ResearchRequest {
    ResearchRequest::new(s.space, question, SUBJECT, s.snapshot)
}

async fn request(pool: &PgPool, r: &ResearchRequest) -> Uuid {
    let mut tx = pool.begin().await.unwrap();
    let done = research::request(&mut tx, r).await.unwrap();
    tx.commit().await.unwrap();
    assert!(done.created);
    done.job_id
}

// ---------------------------------------------------------------------------------------------
// Reading state

#[derive(Debug)]
struct JobState {
    stage: String,
    paused_from: Option<String>,
    error: Option<String>,
    row_version: i32,
    lease_token: Option<Uuid>,
    metadata: Value,
    cost: Value,
}

async fn job(pool: &PgPool, id: Uuid) -> JobState {
    type Row = (
        String,
        Option<String>,
        Option<String>,
        i32,
        Option<Uuid>,
        Value,
        Value,
    );
    let (stage, paused_from, error, row_version, lease_token, metadata, cost): Row =
        sqlx::query_as(
            "SELECT stage, paused_from_stage, error, row_version, lease_token, metadata, cost \
             FROM research_task_jobs WHERE id = $1",
        )
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap();
    JobState {
        stage,
        paused_from,
        error,
        row_version,
        lease_token,
        metadata,
        cost,
    }
}

type Event = (i32, String, String, String, Value);

/// (sequence, event_type, stage, idempotency_key, payload)
async fn events(pool: &PgPool, id: Uuid) -> Vec<Event> {
    sqlx::query_as(
        "SELECT sequence, event_type, stage, idempotency_key, payload FROM research_task_progress_events \
         WHERE research_task_job_id = $1 ORDER BY sequence",
    )
    .bind(id)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The answer the final partial result carries.
async fn answer(pool: &PgPool, id: Uuid) -> Option<String> {
    sqlx::query_scalar(
        "SELECT answer FROM research_task_partial_results \
         WHERE research_task_job_id = $1 AND idempotency_key = $2",
    )
    .bind(id)
    .bind(format!("research-task:{id}:final-evidence"))
    .fetch_optional(pool)
    .await
    .unwrap()
    .flatten()
}

/// The answer deltas of execution attempt `attempt`, in sequence order.
fn deltas_of(evs: &[Event], attempt: i64) -> Vec<&Event> {
    evs.iter()
        .filter(|e| {
            e.1 == "research_task.answer_delta" && e.4["executionAttempt"].as_i64() == Some(attempt)
        })
        .collect()
}

/// The deltas of `attempt`: in order, at stage `generating`, with exactly the platform's three
/// payload keys, each at the UTF-16 offset where the one before it ended; their text together.
fn reassemble(evs: &[Event], attempt: i64) -> String {
    let mut text = String::new();
    let mut units = 0usize;
    for e in deltas_of(evs, attempt) {
        assert_eq!(e.2, "generating", "{e:?}");
        let keys: Vec<&String> = e.4.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["delta", "executionAttempt", "offset"], "{e:?}");
        assert_eq!(e.4["offset"].as_u64(), Some(units as u64), "{e:?}");
        let d = e.4["delta"].as_str().unwrap();
        units += d.encode_utf16().count();
        text.push_str(d);
    }
    text
}

/// (sequence, idempotency_key, evidence_bundle)
async fn partials(pool: &PgPool, id: Uuid) -> Vec<(i32, String, Value)> {
    sqlx::query_as(
        "SELECT sequence, idempotency_key, evidence_bundle FROM research_task_partial_results \
         WHERE research_task_job_id = $1 ORDER BY sequence",
    )
    .bind(id)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The final evidence bundle: the one partial, under the platform's key.
async fn bundle(pool: &PgPool, id: Uuid) -> Value {
    let ps = partials(pool, id).await;
    assert_eq!(ps.len(), 1, "one partial: {ps:#?}");
    assert_eq!(ps[0].0, 1);
    assert_eq!(ps[0].1, format!("research-task:{id}:final-evidence"));
    ps[0].2.clone()
}

/// (delivery_revision, status, idempotency_key)
async fn outbox(pool: &PgPool, id: Uuid) -> Vec<(i32, String, String)> {
    sqlx::query_as(
        "SELECT delivery_revision, status, idempotency_key FROM research_task_outbox \
         WHERE research_task_job_id = $1 ORDER BY delivery_revision",
    )
    .bind(id)
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn outbox_states(pool: &PgPool, id: Uuid) -> Vec<String> {
    outbox(pool, id).await.into_iter().map(|o| o.1).collect()
}

/// Sequences 1..n, keys `research-task-progress:<jobId>:<rowVersion>:<type>` (an answer delta's
/// `research-task-progress:<jobId>:attempt:<n>:answer:<offset>`), one event per key.
fn assert_contiguous(id: Uuid, evs: &[Event]) {
    for (i, (seq, ty, _, key, payload)) in evs.iter().enumerate() {
        assert_eq!(*seq, i32::try_from(i).unwrap() + 1, "sequences: {evs:#?}");
        let rest = key
            .strip_prefix(&format!("research-task-progress:{id}:"))
            .unwrap_or_else(|| panic!("{key}"));
        if ty == "research_task.answer_delta" {
            assert_eq!(
                rest,
                format!(
                    "attempt:{}:answer:{}",
                    payload["executionAttempt"], payload["offset"]
                ),
                "{key}"
            );
            continue;
        }
        let (rv, t) = rest.split_once(':').unwrap();
        assert!(rv.parse::<i32>().unwrap() >= 1, "{key}");
        assert_eq!(t, ty, "{key}");
    }
    let mut keys: Vec<&String> = evs.iter().map(|e| &e.3).collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), evs.len(), "a key repeats: {evs:#?}");
}

/// (type without its prefix, stage, payload)
fn shape(evs: &[Event]) -> Vec<(String, String, Value)> {
    evs.iter()
        .map(|e| {
            (
                e.1.trim_start_matches("research_task.").to_owned(),
                e.2.clone(),
                e.4.clone(),
            )
        })
        .collect()
}

fn types(evs: &[Event]) -> Vec<String> {
    shape(evs).into_iter().map(|e| e.0).collect()
}

fn is_claim(e: &Event) -> bool {
    e.4.get("workerClaimed") == Some(&json!(true))
}

/// The stage advances (stage changes that are neither claims nor retries), by their stage.
fn advances(evs: &[Event]) -> Vec<&str> {
    evs.iter()
        .filter(|e| e.1 == "research_task.stage_changed" && e.4.get("previousStage").is_some())
        .map(|e| e.2.as_str())
        .collect()
}

fn claim(attempt: i32) -> Value {
    json!({ "executionAttempt": attempt, "workerClaimed": true })
}

const ADVANCES: [&str; 5] = [
    "planning",
    "retrieving",
    "analyzing",
    "generating",
    "completed",
];

/// The documents the bundle's items cite.
fn cited_documents(bundle: &Value) -> Vec<Uuid> {
    let mut out: Vec<Uuid> = bundle["items"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|i| i["citations"].as_array().unwrap().clone())
        .map(|c| Uuid::parse_str(c["documentAssetId"].as_str().unwrap()).unwrap())
        .collect();
    out.sort();
    out.dedup();
    out
}

// ---------------------------------------------------------------------------------------------
// Driving

fn engine(pool: &PgPool, worker: &str, handler: Arc<dyn Handler>) -> Engine {
    Engine::new(
        pool.clone(),
        worker,
        vec![handler],
        ConsumerConfig::default(),
    )
}

fn extractive() -> Arc<dyn Handler> {
    Arc::new(ResearchHandler::with_generator(Arc::new(
        ExtractiveGenerator::new(),
    )))
}

/// One real relay round: how many messages it published.
async fn relay_round(fx: &SpaceFx) -> usize {
    let env = &fx.env;
    let relay = Relay::new(
        env.pool.clone(),
        env.topology.clone(),
        "test-relay",
        RelayConfig::default(),
        &[Kind::Research],
    );
    relay
        .relay_once(&env.confirm_channel().await, Kind::Research)
        .await
        .expect("relay round")
        .dispatched
}

/// One real relay round; the published message taken off the queue and handed to the engine.
/// `None`: nothing was due.
async fn deliver(fx: &SpaceFx, engine: &Engine) -> Option<Handled> {
    let env = &fx.env;
    if relay_round(fx).await == 0 {
        return None;
    }
    let ch = env.channel().await;
    let got = ch
        .basic_get(
            env.topology.queue(Kind::Research).as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
        .expect("the relayed message");
    Some(
        tokio::time::timeout(
            HANG,
            engine.process(
                Kind::Research,
                &got.delivery.properties,
                &got.delivery.data,
                &CancellationToken::new(),
            ),
        )
        .await
        .expect("process hung"),
    )
}

/// Delivers until the job is terminal (or paused).
async fn run_until_settled(fx: &SpaceFx, engine: &Engine, id: Uuid) -> JobState {
    for _ in 0..40 {
        let j = job(fx.pool(), id).await;
        if matches!(
            j.stage.as_str(),
            "completed" | "failed" | "canceled" | "paused"
        ) {
            return j;
        }
        if deliver(fx, engine).await.is_none() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    panic!("job {id} did not settle: {:?}", job(fx.pool(), id).await);
}

/// Puts the job's live outbox row out for delivery as the relay's mark would, and claims it
/// with the engine's own claim. The context a worker holds.
async fn claim_by_hand(pool: &PgPool, id: Uuid, worker: &str) -> JobCtx {
    let outbox: Uuid = sqlx::query_scalar(
        "SELECT id FROM research_task_outbox WHERE research_task_job_id = $1 AND status = 'pending'",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap();
    let d = support::dispatch(pool, Kind::Research, outbox).await;
    let mut conn = pool.acquire().await.unwrap();
    let claimed = lease::claim(
        &mut conn,
        &Statements::new(&RESEARCH),
        &d,
        worker,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    match claimed {
        Claim::Claimed(ctx) => ctx,
        other => panic!("not claimed: {other:?}"),
    }
}

/// One step the way the engine runs it: fence, step, commit the stage (or the end) together.
/// `Ok(None)`: fenced out, nothing written.
async fn step_by_hand(
    pool: &PgPool,
    handler: &dyn Handler,
    ctx: &mut JobCtx,
) -> Result<Option<Step>, JobError> {
    let st = Statements::new(&RESEARCH);
    let mut tx = pool.begin().await.unwrap();
    let Some(rv) = lease::fence(&mut tx, &st, ctx, std::time::Duration::from_secs(30))
        .await
        .unwrap()
    else {
        return Ok(None);
    };
    ctx.row_version = rv;
    let step = match handler.step(&mut tx, ctx).await {
        Ok(s) => s,
        Err(e) => {
            tx.rollback().await.unwrap();
            return Err(e);
        }
    };
    commit_step(&mut tx, &st, ctx, &step).await;
    tx.commit().await.unwrap();
    Ok(Some(step))
}

async fn commit_step(tx: &mut PgConnection, st: &Statements, ctx: &mut JobCtx, step: &Step) {
    let end = match step {
        Step::Advance(cp) => {
            ctx.row_version = lease::advance(tx, st, ctx, cp)
                .await
                .unwrap()
                .expect("ours");
            ctx.checkpoint = cp.clone();
            return;
        }
        Step::Succeed(cp) => End::Succeed {
            checkpoint: cp.clone(),
        },
        Step::Cancel { code, message } => End::Cancel {
            code: code.clone(),
            message: message.clone(),
        },
        other => panic!("research never returns {other:?}"),
    };
    assert!(lease::end(tx, st, ctx, &end).await.unwrap());
}

/// Makes a job a worker holds claimable again at once (its lease run out, its outbox due).
async fn expire(pool: &PgPool, id: Uuid) {
    sqlx::query("UPDATE research_task_jobs SET lease_expires_at = 0 WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE research_task_outbox SET status = 'pending', available_at = 0 \
         WHERE research_task_job_id = $1 AND status IN ('dispatched', 'leased')",
    )
    .bind(id)
    .execute(pool)
    .await
    .unwrap();
}

// ---------------------------------------------------------------------------------------------
// Capability grants

async fn grant(s: &SpaceFx, space: Uuid, subject: &str, scopes: &[&str]) -> Uuid {
    let scopes: Vec<String> = scopes.iter().map(|x| (*x).to_owned()).collect();
    let mut conn = s.pool().acquire().await.unwrap();
    platform::create_capability_grant(&mut conn, TENANT, space, subject, &scopes)
        .await
        .unwrap()
}

/// The authority columns of a job: (grant, subject, snapshot, revision, channel).
type Binding = (
    Option<Uuid>,
    Option<String>,
    Option<Uuid>,
    Option<i32>,
    Option<String>,
);

async fn binding(pool: &PgPool, id: Uuid) -> Binding {
    sqlx::query_as(
        "SELECT capability_grant_id, subject_id, permission_snapshot_id, permission_snapshot_revision, \
           access_channel FROM research_task_jobs WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

// ---------------------------------------------------------------------------------------------
// The HTTP generator, against a local stand-in

#[derive(Clone, Debug, Default)]
struct Captured {
    request_line: String,
    authorization: Option<String>,
    body: Value,
}

/// Reads one HTTP request off `sock`. `None`: the peer went away first.
async fn read_request(sock: &mut tokio::net::TcpStream) -> Option<Captured> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let (head_end, content_length) = loop {
        let n = sock.read(&mut chunk).await.unwrap_or(0);
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..pos]).to_string();
            let len = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            break (pos + 4, len);
        }
    };
    while buf.len() < head_end + content_length {
        let n = sock.read(&mut chunk).await.unwrap_or(0);
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let authorization = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("authorization")
            .then(|| v.trim().to_owned())
    });
    Some(Captured {
        request_line: head.lines().next().unwrap_or_default().to_owned(),
        authorization,
        body: serde_json::from_slice(&buf[head_end..]).unwrap_or(Value::Null),
    })
}

fn openai(base: &str, price_in: f64, price_out: f64) -> Arc<dyn Generator> {
    Arc::new(
        OpenAiGenerator::new(OpenAiConfig {
            base_url: url::Url::parse(base).unwrap(),
            api_key: Some(kfs_worker::jobs::research::generator::ApiKey::new(
                "sk-test-secret",
            )),
            model: "stand-in-1".into(),
            price_per_1k_input: price_in,
            price_per_1k_output: price_out,
            timeout: Duration::from_secs(10),
            max_output_tokens: 100,
        })
        .unwrap(),
    )
}
