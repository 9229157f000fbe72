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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kfs_worker::consumer::{ConsumerConfig, Engine, Handled};
use kfs_worker::engine::lease::{self, Claim, End, Statements};
use kfs_worker::jobs::research::generator::{
    ExtractiveGenerator, Generator, OpenAiConfig, OpenAiGenerator, NO_EVIDENCE_ANSWER,
};
use kfs_worker::jobs::research::{
    self, control, walk::Refusal, ControlError, RequestError, ResearchHandler, ResearchRequest,
};
use kfs_worker::jobs::{Handler, JobCtx, JobError, Kind, Policy, RetryPolicy, Step, RESEARCH};
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
// The whole walk

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_whole_walk_answers_from_published_knowledge_with_the_platforms_payloads() {
    let s = seed("walk").await;
    let pool = s.pool().clone();
    let id = request(&pool, &req(&s, QUESTION)).await;

    // As requested: queued, version 1, routed to research, top-k 10, the head frozen.
    let j = job(&pool, id).await;
    assert_eq!((j.stage.as_str(), j.row_version), ("queued", 1));
    type Admitted = (String, i32, i32, i32, Option<String>, Option<i32>);
    let (tenant, attempts, max, rev, mode, top_k): Admitted = sqlx::query_as(
        "SELECT tenant_id, execution_attempts, max_execution_attempts, permission_snapshot_revision, mode, top_k \
         FROM research_task_jobs WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (tenant.as_str(), attempts, max, rev, mode.as_deref(), top_k),
        (TENANT, 0, 5, 1, Some("research"), Some(10))
    );
    let head = s.head().await.unwrap();
    // The space's retrieval profile (every fixture space starts with the platform's initial one).
    let (profile, capability): (serde_json::Value, serde_json::Value) = sqlx::query_as(
        "SELECT snapshot, capability_snapshot FROM knowledge_space_profile_revisions \
         WHERE knowledge_space_id = $1 AND kind = 'retrieval' AND state = 'active'",
    )
    .bind(s.space)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        j.metadata["__knowledgeFsPublishedRuntimeSnapshot"],
        json!({
            "projectionSnapshot": {"fingerprint": head.fingerprint, "headRevision": head.revision,
              "knowledgeSpaceId": s.space, "projectionVersion": head.projection_version,
              "publicationId": head.publication_id, "tenantId": TENANT},
            "retrievalCapabilitySnapshot": capability, "retrievalProfile": profile
        })
    );
    assert_eq!(
        j.metadata["__knowledgeFsAutoRetrievalModeDecision"],
        json!({"degraded": true, "durationMs": 0, "errorClass": "AutoRetrievalModeResolverUnavailable",
               "requestedMode": "auto", "resolvedMode": "research", "resolver": "fallback"})
    );
    assert_eq!(j.cost, json!({"entries": [], "totalUsd": 0.0}));
    assert_eq!(
        outbox(&pool, id).await,
        vec![(
            1,
            "pending".into(),
            format!("research.task:{TENANT}:{}:{id}:1", s.space)
        )]
    );
    let payload: Value = sqlx::query_scalar(
        "SELECT payload FROM research_task_outbox WHERE research_task_job_id = $1",
    )
    .bind(id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(payload, json!({ "researchTaskJobId": id }));
    let evs = events(&pool, id).await;
    assert_eq!(
        shape(&evs),
        vec![("started".into(), "queued".into(), json!({}))]
    );
    assert_eq!(
        evs[0].3,
        format!("research-task-progress:{id}:1:research_task.started")
    );

    let e = engine(&pool, "w-walk", extractive());
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "completed", "{j:?}");
    assert_eq!(j.lease_token, None);
    let stored = answer(&pool, id)
        .await
        .expect("the answer in the final partial result");

    // Every event, exactly: the claim, then each stage with the runtime's details, the answer
    // as one delta (the extractive answer is made at once) before the completion.
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    let sc = |stage: &str, payload: Value| ("stage_changed".to_owned(), stage.to_owned(), payload);
    assert_eq!(
        shape(&evs),
        vec![
            ("started".into(), "queued".into(), json!({})),
            sc("queued", claim(1)),
            sc("planning", json!({"previousStage": "queued"})),
            sc(
                "retrieving",
                json!({"details": {"questions": [QUESTION, "How does fencing use the lease token",
                  "when does a lease expire"], "topK": 10}, "previousStage": "planning"})
            ),
            sc(
                "analyzing",
                json!({"details": {"results": [
                    {"chunkCount": 0, "question": QUESTION},
                    {"chunkCount": 1, "question": "How does fencing use the lease token"},
                    {"chunkCount": 1, "question": "when does a lease expire"}],
                  "retrievalCount": 2}, "previousStage": "retrieving"})
            ),
            sc(
                "generating",
                json!({"details": {"chunks": 2, "retrievalCount": 2}, "previousStage": "analyzing"})
            ),
            (
                "answer_delta".into(),
                "generating".into(),
                json!({"delta": stored, "executionAttempt": 1, "offset": 0})
            ),
            sc(
                "completed",
                json!({"details": {"chunks": 2, "documents": 2, "sources": 2}, "previousStage": "generating"})
            ),
        ]
    );
    // Keyed by the row version each transition wrote: the claim wrote 2, each step one more;
    // the delta by its attempt and offset.
    let rvs: Vec<&str> = evs.iter().map(|e| e.3.split(':').nth(2).unwrap()).collect();
    assert_eq!(rvs, vec!["1", "2", "3", "4", "5", "6", "attempt", "7"]);
    assert_eq!(
        evs[6].3,
        format!("research-task-progress:{id}:attempt:1:answer:0")
    );

    // The final evidence bundle, in the platform's shape.
    let b = bundle(&pool, id).await;
    assert_eq!(b["traceId"], json!(id.to_string()));
    assert_eq!(b["query"], json!(QUESTION));
    assert_eq!(b["state"], "answerable");
    assert_eq!(b["missingEvidence"], json!([]));
    let items = b["items"].as_array().unwrap();
    assert_eq!(items.len(), 2);
    for item in items {
        let c = &item["citations"][0];
        assert_eq!(c["documentVersion"], 1);
        assert!(c["artifactHash"].as_str().unwrap().len() > 8, "{c}");
        assert!(c["endOffset"].as_i64() > c["startOffset"].as_i64(), "{c}");
        assert_eq!(item["metadata"]["sources"], json!(["fts"]));
        assert_eq!(
            item["metadata"]["projectionIds"].as_array().unwrap().len(),
            1
        );
        assert_eq!(item["freshness"], json!({"status": "unknown"}));
        assert_eq!(item["scores"]["final"], item["score"]);
    }
    assert_eq!(cited_documents(&b), {
        let mut d = vec![s.docs[0], s.docs[1]];
        d.sort();
        d
    });
    let text = b.to_string();
    assert!(
        !text.contains("OTHER-TENANT-SECRET"),
        "another tenant leaked"
    );
    assert!(!text.contains("bread"), "irrelevant node retrieved: {text}");

    // The answer (in the final partial result, as the platform keeps it since its 0033) cites
    // what it quotes (metadata.result).
    assert!(
        stored.contains("Fencing will use the lease token"),
        "{stored}"
    );
    assert_eq!(stored, stored.trim());
    let result = &j.metadata["result"];
    assert!(result.get("answer").is_none(), "the answer is kept once");
    let cited: Vec<Uuid> = result["citations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Uuid::parse_str(c["documentId"].as_str().unwrap()).unwrap())
        .collect();
    assert!(
        cited.contains(&s.docs[0]) && cited.contains(&s.docs[1]),
        "{result}"
    );
    assert_eq!(result["generator"], "extractive");
    // One free call, reserved and settled in the platform's entry shape.
    let mut cost = j.cost.clone();
    assert!(cost["entries"][0]["recordedAt"].as_i64().unwrap() > 0);
    cost["entries"][0]["recordedAt"] = json!(0);
    assert_eq!(
        cost,
        json!({"entries": [{"costUsd": 0.0, "provider": "extractive", "recordedAt": 0, "step": "query.answer",
          "usage": {"completionTokens": 0, "estimated": false, "promptTokens": 0,
            "researchModelCallId": format!("attempt:1:query-answer:{id}:1:extractive"), "reserved": false,
            "status": "succeeded", "totalTokens": 0}}], "totalUsd": 0.0})
    );
    assert_eq!(outbox_states(&pool, id).await, vec!["completed"]);

    // A late duplicate of the finished job's delivery changes nothing.
    assert!(deliver(&s, &e).await.is_none(), "nothing is due any more");
    assert_eq!(events(&pool, id).await.len(), evs.len());
    assert_eq!(partials(&pool, id).await.len(), 1);
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tasks_claimed_together_take_each_stage_in_one_transaction_and_answer_as_alone() {
    let s = seed("group").await;
    let pool = s.pool().clone();
    let env = &s.env;
    // One task alone: the walk every member of the group must also have.
    let solo = request(&pool, &req(&s, QUESTION)).await;
    let alone = engine(&pool, "research-solo", extractive());
    assert_eq!(run_until_settled(&s, &alone, solo).await.stage, "completed");

    let ids = [
        request(&pool, &req(&s, QUESTION)).await,
        request(
            &pool,
            &req(&s, "When does a lease expire without a heartbeat?"),
        )
        .await,
        request(&pool, &req(&s, "What does fencing refuse?")).await,
    ];
    assert_eq!(relay_round(&s).await, 3);
    let ch = env.channel().await;
    let mut got = Vec::new();
    while let Some(m) = ch
        .basic_get(
            env.topology.queue(Kind::Research).as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
    {
        got.push(m.delivery);
    }
    assert_eq!(got.len(), 3);
    let items: Vec<(&lapin::BasicProperties, &[u8])> = got
        .iter()
        .map(|d| (&d.properties, d.data.as_slice()))
        .collect();
    let together = engine(&pool, "research-group", extractive());
    let handled = tokio::time::timeout(
        HANG,
        together.process_many(Kind::Research, &items, &CancellationToken::new()),
    )
    .await
    .expect("process_many hung");
    assert!(
        handled.iter().all(|h| matches!(
            h,
            Handled::Ack {
                end: Some("succeeded"),
                ..
            }
        )),
        "{handled:?}"
    );

    // The group's last step wrote every member's row in one transaction.
    let ends: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT xmin::text) FROM research_task_jobs WHERE id = ANY($1)",
    )
    .bind(&ids[..])
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(ends, 1, "the members ended in one commit");
    // And each member's own record is the one a task run alone leaves.
    let walk = types(&events(&pool, solo).await);
    for id in ids {
        let j = job(&pool, id).await;
        assert_eq!((j.stage.as_str(), j.lease_token), ("completed", None));
        let evs = events(&pool, id).await;
        assert_contiguous(id, &evs);
        assert_eq!(types(&evs), walk, "task {id}");
        assert_eq!(
            partials(&pool, id).await.len(),
            1,
            "task {id}: one final bundle"
        );
    }
    s.fx.cleanup().await;
}

/// Scans of `table` by this transaction so far.
async fn scans(tx: &mut PgConnection, table: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0) FROM pg_stat_xact_user_tables WHERE relname = $1",
    )
    .bind(table)
    .fetch_one(tx)
    .await
    .unwrap()
}

/// `(rows, distinct statements)` of `table`'s rows of `ids` (by `id_column`) that this
/// transaction wrote: rows written by one statement share its command id.
async fn written(tx: &mut PgConnection, table: &str, id_column: &str, ids: &[Uuid]) -> (i64, i64) {
    sqlx::query_as(&format!(
        "SELECT count(*), count(DISTINCT cmin::text) FROM {table} \
         WHERE {id_column} = ANY($1) AND xmin::text = pg_current_xact_id()::text"
    ))
    .bind(ids)
    .fetch_one(tx)
    .await
    .unwrap()
}

#[tokio::test]
async fn tasks_stepped_together_read_their_space_and_snapshot_once_and_write_each_table_once() {
    let s = seed("group-reads").await;
    let pool = s.pool().clone();
    let handler = extractive();
    let questions = [
        QUESTION,
        "When does a lease expire without a heartbeat?",
        "What does fencing refuse?",
    ];
    let mut ids = Vec::new();
    for q in questions {
        ids.push(request(&pool, &req(&s, q)).await);
    }
    ids.sort();
    let mut ctxs = Vec::new();
    for id in &ids {
        ctxs.push(claim_by_hand(&pool, *id, "research-group-reads").await);
    }
    let st = Statements::new(&RESEARCH);
    for advance in ADVANCES {
        let mut tx = pool.begin().await.unwrap();
        for ctx in ctxs.iter_mut() {
            ctx.row_version = lease::fence(&mut tx, &st, ctx, Duration::from_secs(30))
                .await
                .unwrap()
                .expect("ours");
        }
        let fences_before = scans(&mut tx, "deletion_jobs").await;
        let policies_before = scans(&mut tx, "knowledge_space_access_policies").await;
        let until = kfs_worker::jobs::Until::after(Duration::from_secs(3600));
        let steps = handler.step_many(&mut tx, &ctxs, until).await.unwrap();
        assert_eq!(
            scans(&mut tx, "deletion_jobs").await - fences_before,
            1,
            "step to {advance}: the space's deletion fence is read once for the three tasks"
        );
        assert_eq!(
            scans(&mut tx, "knowledge_space_access_policies").await - policies_before,
            1,
            "step to {advance}: the snapshot is revalidated once for the three tasks"
        );
        let (events, statements) = written(
            &mut tx,
            "research_task_progress_events",
            "research_task_job_id",
            &ids,
        )
        .await;
        assert!(events >= 3, "step to {advance}: {events} events");
        assert_eq!(
            statements, 1,
            "step to {advance}: the events in one statement"
        );
        if advance != "planning" {
            // Every stage after the first writes the task's metadata.
            assert_eq!(
                written(&mut tx, "research_task_jobs", "id", &ids).await,
                (3, 1),
                "step to {advance}: the job rows in one statement"
            );
        }
        if advance == "completed" {
            assert_eq!(
                written(
                    &mut tx,
                    "research_task_partial_results",
                    "research_task_job_id",
                    &ids
                )
                .await,
                (3, 1),
                "the final bundles in one statement"
            );
        }
        for (ctx, step) in ctxs.iter_mut().zip(&steps) {
            commit_step(&mut tx, &st, ctx, step).await;
        }
        tx.commit().await.unwrap();
    }
    // The walk each task took is the one a task stepped alone takes.
    let solo = request(&pool, &req(&s, QUESTION)).await;
    let mut ctx = claim_by_hand(&pool, solo, "research-solo").await;
    while let Some(step) = step_by_hand(&pool, handler.as_ref(), &mut ctx)
        .await
        .unwrap()
    {
        if !matches!(step, Step::Advance(_)) {
            break;
        }
    }
    let walk = types(&events(&pool, solo).await);
    for id in &ids {
        let j = job(&pool, *id).await;
        assert_eq!(j.stage, "completed", "task {id}");
        let evs = events(&pool, *id).await;
        assert_contiguous(*id, &evs);
        assert_eq!(types(&evs), walk, "task {id}");
        assert_eq!(partials(&pool, *id).await.len(), 1, "task {id}");
    }
    s.fx.cleanup().await;
}

#[test]
fn tasks_that_call_a_model_keep_a_transaction_per_step() {
    assert!(
        ResearchHandler::with_generator(Arc::new(ExtractiveGenerator::new())).shares_transaction()
    );
    let with_model = ResearchHandler::with_generator(openai("http://127.0.0.1:9/v1", 0.0, 0.0));
    assert!(!with_model.shares_transaction());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn another_tenants_space_and_unpublished_generations_are_never_searched() {
    let s = seed("iso").await;
    let pool = s.pool().clone();
    // A draft compiled up to its candidate publication, never published.
    let draft = s
        .add(
            "draft.md",
            "text/markdown",
            b"# Draft\n\nThe quokka draft was never published.\n",
        )
        .await;
    let attempt = s.request(draft, false).await.unwrap();
    s.drive_to(&s.engine("w-draft", 1), attempt, "projection_built")
        .await;
    // Only the other tenant's space and our unpublished draft have "quokka".
    let id = request(&pool, &req(&s, "Where is the quokka?")).await;
    let e = engine(&pool, "w-iso", extractive());
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "completed", "{j:?}");
    let b = bundle(&pool, id).await;
    assert_eq!(b["items"], json!([]));
    assert_eq!(b["state"], "not-enough-evidence");
    assert_eq!(answer(&pool, id).await.as_deref(), Some(NO_EVIDENCE_ANSWER));
    assert_eq!(j.metadata["result"]["citations"], json!([]));
    assert_eq!(reassemble(&events(&pool, id).await, 1), NO_EVIDENCE_ANSWER);
    assert_eq!(j.cost["entries"], json!([]), "no evidence, no model call");
    let all = format!("{} {}", j.metadata, b);
    assert!(!all.contains(&s.other_doc.to_string()));
    assert!(!all.contains(&s.other_space.to_string()));
    assert!(!all.contains(&draft.to_string()));
    let evs = events(&pool, id).await;
    assert_eq!(
        evs.last().unwrap().4,
        json!({"details": {"chunks": 0, "documents": 0, "sources": 0}, "previousStage": "generating"})
    );

    // And the words both spaces share find only ours.
    let id = request(&pool, &req(&s, "fencing lease token")).await;
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "completed");
    let b = bundle(&pool, id).await;
    assert_eq!(cited_documents(&b), vec![s.docs[1]]);
    assert!(!b.to_string().contains("OTHER-TENANT-SECRET"));
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_document_the_snapshot_does_not_cover_is_never_cited() {
    let s = seed("scope").await;
    let pool = s.pool().clone();
    let carols = vec![format!("knowledge-space:{}:member:carol", s.space)];
    let alices = vec![format!("knowledge-space:{}:member:{SUBJECT}", s.space)];
    let zebra = upload(
        &s,
        s.space,
        "zebra.md",
        "# Zebra\n\nThe zebra stripes are carol's notes.\n",
        carols,
    )
    .await;
    let giraffe = upload(
        &s,
        s.space,
        "giraffe.md",
        "# Giraffe\n\nThe giraffe neck is alice's.\n",
        alices,
    )
    .await;
    s.compile(zebra).await;
    s.compile(giraffe).await;
    let e = engine(&pool, "w-scope", extractive());

    // Alice: her own scoped document, never carol's.
    let id = request(&pool, &req(&s, "zebra stripes")).await;
    assert_eq!(run_until_settled(&s, &e, id).await.stage, "completed");
    assert_eq!(bundle(&pool, id).await["items"], json!([]));
    let id = request(&pool, &req(&s, "giraffe neck")).await;
    assert_eq!(run_until_settled(&s, &e, id).await.stage, "completed");
    assert_eq!(cited_documents(&bundle(&pool, id).await), vec![giraffe]);

    // Carol's snapshot covers carol's document (and unscoped ones), not alice's.
    let carol = s.snapshot("carol").await;
    for (question, want) in [("zebra stripes", vec![zebra]), ("giraffe neck", vec![])] {
        let r = ResearchRequest::new(s.space, question, "carol", carol);
        let id = request(&pool, &r).await;
        assert_eq!(run_until_settled(&s, &e, id).await.stage, "completed");
        assert_eq!(
            cited_documents(&bundle(&pool, id).await),
            want,
            "{question}"
        );
    }
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_space_with_an_embedding_profile_is_searched_by_its_dense_leg_too() {
    let fx = SpaceFx::new(TENANT, "dense", "Dense").await;
    let pool = fx.pool().clone();
    let profile = {
        let mut conn = pool.acquire().await.unwrap();
        platform::activate_embedding_profile(
            &mut conn,
            TENANT,
            fx.space,
            "embed-small",
            "openai",
            256,
        )
        .await
        .unwrap()
    };
    let mut docs = Vec::new();
    for (name, text) in [("leases.md", LEASES), ("cooking.md", COOKING)] {
        let d = fx.add(name, "text/markdown", text.as_bytes()).await;
        fx.compile(d).await;
        docs.push(d);
    }
    let question = "Is the heartbeat alive every ten seconds tomorrow?";
    // No passage has every word: the full-text leg alone finds nothing.
    assert!(fx
        .search("heartbeat alive every ten seconds tomorrow")
        .await
        .is_empty());
    let snapshot = fx.snapshot(SUBJECT).await;
    let id = request(
        &pool,
        &ResearchRequest::new(fx.space, question, SUBJECT, snapshot),
    )
    .await;
    let frozen = &job(&pool, id).await.metadata["__knowledgeFsPublishedRuntimeSnapshot"];
    assert_eq!(
        frozen["embeddingProfile"],
        json!({"dimension": 256, "model": "embed-small", "pluginId": "langgenius/openai", "provider": "openai",
               "revision": 1, "vectorSpaceId": profile.vector_space_id})
    );
    assert_eq!(frozen["embeddingCapabilitySnapshot"]["kind"], "embedding");

    let e = engine(&pool, "w-dense", extractive());
    let j = run_until_settled(&fx, &e, id).await;
    assert_eq!(j.stage, "completed", "{j:?}");
    let b = bundle(&pool, id).await;
    let first = &b["items"][0];
    assert!(
        first["text"].as_str().unwrap().contains("heartbeat runs"),
        "{b}"
    );
    assert_eq!(first["metadata"]["sources"], json!(["dense"]));
    assert_eq!(first["citations"][0]["documentAssetId"], json!(docs[0]));
    // Nearest first over two legs: 1/61 of the best 2/61.
    assert_eq!(first["scores"]["final"], json!(0.5));
    assert!(answer(&pool, id)
        .await
        .unwrap()
        .contains("The heartbeat runs every ten seconds"));
    fx.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// Replays

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replayed_step_adds_no_event_and_no_partial() {
    let s = seed("replay").await;
    let pool = s.pool().clone();
    let id = request(&pool, &req(&s, QUESTION)).await;
    let handler = extractive();
    let st = Statements::new(&RESEARCH);
    let mut ctx = claim_by_hand(&pool, id, "w-replay").await;
    loop {
        // First run: effects commit, but (as if the process died) the stage does not move.
        let mut tx = pool.begin().await.unwrap();
        ctx.row_version = lease::fence(&mut tx, &st, &ctx, std::time::Duration::from_secs(30))
            .await
            .unwrap()
            .expect("ours");
        let first = handler.step(&mut tx, &ctx).await.unwrap();
        tx.commit().await.unwrap();
        let counts = (
            events(&pool, id).await.len(),
            partials(&pool, id).await.len(),
            job(&pool, id).await.cost,
        );

        // The replay, with the same row version, then the stage moves with it.
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM research_task_jobs WHERE id = $1 FOR UPDATE")
            .bind(id)
            .execute(&mut *tx)
            .await
            .unwrap();
        let again = handler.step(&mut tx, &ctx).await.unwrap();
        assert_eq!(first, again, "a replay decides the same");
        commit_step(&mut tx, &st, &mut ctx, &again).await;
        tx.commit().await.unwrap();
        assert_eq!(
            counts,
            (
                events(&pool, id).await.len(),
                partials(&pool, id).await.len(),
                job(&pool, id).await.cost,
            ),
            "the replay of the step at {} added rows or spent again",
            ctx.checkpoint
        );
        if matches!(again, Step::Succeed(_)) {
            break;
        }
    }
    assert_eq!(job(&pool, id).await.stage, "completed");
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    assert_eq!(advances(&evs), ADVANCES.to_vec());
    assert_eq!(evs.iter().filter(|e| is_claim(e)).count(), 1);
    assert_eq!(partials(&pool, id).await.len(), 1);
    s.fx.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// Pause, resume, cancel

/// Pauses its job from another connection while the step at `stage` runs: the pause waits for
/// the step's row lock. When the step's checkpoint has committed, `after_step_commit` waits for
/// the pause to finish, so it commits before the worker's next fence, every time.
struct PauseDuring {
    inner: Arc<dyn Handler>,
    stage: String,
    pool: PgPool,
    fired: AtomicBool,
    pause: Mutex<Option<tokio::task::JoinHandle<Result<control::Controlled, ControlError>>>>,
    /// The pause's outcome, once `after_step_commit` has waited for it.
    paused: Mutex<Option<Result<control::Controlled, ControlError>>>,
}

impl PauseDuring {
    /// The pause's outcome: waited for between two steps, or (when the step at `stage` ended
    /// the slice) now.
    async fn outcome(&self) -> Result<control::Controlled, ControlError> {
        if let Some(done) = self.paused.lock().unwrap().take() {
            return done;
        }
        let pending = self.pause.lock().unwrap().take().expect("pause fired");
        pending.await.unwrap()
    }
}

#[async_trait::async_trait]
impl Handler for PauseDuring {
    fn kind(&self) -> Kind {
        Kind::Research
    }

    async fn step(&self, tx: &mut PgConnection, ctx: &JobCtx) -> Result<Step, JobError> {
        if ctx.checkpoint == self.stage && !self.fired.swap(true, Ordering::SeqCst) {
            let pool = self.pool.clone();
            let id = ctx.job_id;
            let handle = tokio::spawn(async move {
                let mut c = pool.acquire().await.unwrap();
                control::pause(&mut c, id).await
            });
            *self.pause.lock().unwrap() = Some(handle);
            // Until the pause waits on our row lock.
            let mut waiting = false;
            for _ in 0..200 {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                     AND wait_event_type = 'Lock' AND query LIKE '%FOR UPDATE%'",
                )
                .fetch_one(&self.pool)
                .await
                .unwrap();
                if n > 0 {
                    waiting = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(waiting, "the pause never waited on the job row");
        }
        self.inner.step(tx, ctx).await
    }

    async fn after_step_commit(&self, _job: &JobCtx) {
        let pending = self.pause.lock().unwrap().take();
        if let Some(pending) = pending {
            let done = pending.await.unwrap();
            *self.paused.lock().unwrap() = Some(done);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pause_in_each_stage_fences_the_running_worker_and_resume_finishes_the_walk() {
    let s = seed("pause").await;
    let pool = s.pool().clone();
    for stage in ["planning", "retrieving", "analyzing", "generating"] {
        let id = request(&pool, &req(&s, QUESTION)).await;
        let pauser = Arc::new(PauseDuring {
            inner: extractive(),
            stage: stage.into(),
            pool: pool.clone(),
            fired: AtomicBool::new(false),
            pause: Mutex::new(None),
            paused: Mutex::new(None),
        });
        let e = Engine::new(
            pool.clone(),
            format!("w-pause-{stage}"),
            vec![pauser.clone() as Arc<dyn Handler>],
            ConsumerConfig::default(),
        );
        // Up to the stage: the walk goes queued → planning → ... in one slice, and the pause
        // lands between the step at `stage` and the next one.
        let handled = deliver(&s, &e).await.expect("a delivery");
        let paused = pauser.outcome().await;
        let next = research::walk::next_stage(research::Stage::parse(stage).unwrap()).unwrap();
        if next == research::Stage::Completed {
            // The step at generating completes the job in its own transaction: too late to pause.
            assert_eq!(
                handled,
                Handled::Ack {
                    claim: "claimed",
                    end: Some("succeeded")
                }
            );
            assert!(
                matches!(
                    paused,
                    Err(ControlError::Refused(
                        _,
                        Refusal::Terminal(research::Stage::Completed, _)
                    ))
                ),
                "{paused:?}"
            );
            assert_eq!(job(&pool, id).await.stage, "completed");
            assert_contiguous(id, &events(&pool, id).await);
            continue;
        }
        let paused = paused.unwrap();
        assert!(paused.changed);
        assert_eq!(paused.from, next, "paused right after the step at {stage}");
        // The worker's next write was refused: its slice ended with the lease lost.
        assert_eq!(
            handled,
            Handled::Ack {
                claim: "claimed",
                end: Some("lease_lost")
            },
            "at {stage}"
        );
        assert_eq!(e.counters.lease_lost.load(Ordering::Relaxed), 1);

        let j = job(&pool, id).await;
        assert_eq!(j.stage, "paused");
        assert_eq!(j.paused_from.as_deref(), Some(next.as_str()));
        assert_eq!(j.error, None, "a pause without a reason records none");
        assert!(
            j.lease_token.is_some(),
            "as on the platform, a pause keeps the lease columns"
        );
        assert_eq!(outbox_states(&pool, id).await, vec!["canceled"]);
        // Nothing is due while paused.
        assert!(deliver(&s, &e).await.is_none());

        let resumed = control::resume(&mut pool.acquire().await.unwrap(), id)
            .await
            .unwrap();
        assert_eq!(
            (resumed.from, resumed.to, resumed.outbox_revision),
            (research::Stage::Paused, next, Some(2))
        );
        assert_eq!(job(&pool, id).await.lease_token, None);
        let ob = outbox(&pool, id).await;
        assert_eq!(
            ob[1],
            (
                2,
                "pending".into(),
                format!("research.task:{TENANT}:{}:{id}:2", s.space)
            )
        );
        let j = run_until_settled(&s, &e, id).await;
        assert_eq!(j.stage, "completed", "after a pause at {stage}: {j:?}");
        let evs = events(&pool, id).await;
        assert_contiguous(id, &evs);
        assert_eq!(advances(&evs), ADVANCES.to_vec());
        let sh = shape(&evs);
        let p = sh.iter().position(|t| t.0 == "paused").unwrap();
        assert_eq!(sh[p], ("paused".into(), "paused".into(), json!({})));
        assert_eq!(
            sh[p + 1],
            (
                "resumed".into(),
                next.as_str().into(),
                json!({"resumedFrom": "paused"})
            )
        );
        // The resumed run is a new execution attempt, and says so.
        assert_eq!(
            sh[p + 2],
            ("stage_changed".into(), next.as_str().into(), claim(2))
        );
        assert_eq!(partials(&pool, id).await.len(), 1, "no partial twice");
    }
    s.fx.cleanup().await;
}

/// The same at the lease level, deterministically, for every runnable stage: a worker holds the
/// job at `stage`, the task is paused, and every write the worker tries is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_holding_the_job_at_any_stage_is_fenced_out_by_a_pause() {
    let s = seed("hold").await;
    let pool = s.pool().clone();
    let handler = extractive();
    let st = Statements::new(&RESEARCH);
    let walk = [
        "queued",
        "planning",
        "retrieving",
        "analyzing",
        "generating",
    ];
    for (steps, stage) in walk.iter().enumerate() {
        let id = request(&pool, &req(&s, QUESTION)).await;
        let mut ctx = claim_by_hand(&pool, id, &format!("w-{stage}")).await;
        for _ in 0..steps {
            step_by_hand(&pool, handler.as_ref(), &mut ctx)
                .await
                .unwrap()
                .unwrap();
        }
        assert_eq!(ctx.checkpoint, *stage);
        let mut conn = pool.acquire().await.unwrap();
        let p = control::pause(&mut conn, id).await.unwrap();
        assert_eq!(p.from.as_str(), *stage);
        let j = job(&pool, id).await;
        assert_eq!(
            (j.stage.as_str(), j.paused_from.as_deref()),
            ("paused", Some(*stage))
        );
        let before = (
            events(&pool, id).await.len(),
            partials(&pool, id).await.len(),
        );
        assert_eq!(
            step_by_hand(&pool, handler.as_ref(), &mut ctx)
                .await
                .unwrap(),
            None,
            "at {stage}"
        );
        assert!(
            !lease::heartbeat(&mut conn, &st, &ctx, Duration::from_secs(30))
                .await
                .unwrap()
        );
        let done = End::Succeed {
            checkpoint: "completed".into(),
        };
        assert!(!lease::end(&mut conn, &st, &ctx, &done).await.unwrap());
        assert_eq!(
            before,
            (
                events(&pool, id).await.len(),
                partials(&pool, id).await.len()
            )
        );
        let r = control::resume(&mut conn, id).await.unwrap();
        assert_eq!(r.to.as_str(), *stage);
        drop(conn);
        let e = engine(&pool, &format!("w-finish-{stage}"), extractive());
        assert_eq!(
            run_until_settled(&s, &e, id).await.stage,
            "completed",
            "at {stage}"
        );
        let evs = events(&pool, id).await;
        assert_contiguous(id, &evs);
        let ts = types(&evs);
        let at = ts.iter().position(|t| t == "paused").unwrap();
        // started, then (when a step ran) the claim and one advance per step.
        let want = if steps == 0 { 1 } else { steps + 2 };
        assert_eq!(at, want, "{ts:?}");
        assert_eq!(ts[at + 1], "resumed");
        assert_eq!(advances(&evs), ADVANCES.to_vec());
        assert_eq!(partials(&pool, id).await.len(), 1);
    }
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_worker_finds_every_write_refused_and_controls_are_idempotent() {
    let s = seed("idem").await;
    let pool = s.pool().clone();
    let id = request(&pool, &req(&s, QUESTION)).await;

    // Paused while queued, before any worker: nothing runs until resumed.
    let p = control::pause(&mut pool.acquire().await.unwrap(), id)
        .await
        .unwrap();
    assert_eq!(
        (p.from, p.to, p.changed),
        (research::Stage::Queued, research::Stage::Paused, true)
    );
    let again = control::pause(&mut pool.acquire().await.unwrap(), id)
        .await
        .unwrap();
    assert!(!again.changed, "a repeated pause changes nothing");
    control::resume(&mut pool.acquire().await.unwrap(), id)
        .await
        .unwrap();

    // A worker holds the job at retrieving; a pause (with a reason) fences it out of every write.
    let handler = extractive();
    let mut ctx = claim_by_hand(&pool, id, "w-hand").await;
    for _ in 0..2 {
        step_by_hand(&pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(ctx.checkpoint, "retrieving");
    let p = control::pause_with(&mut pool.acquire().await.unwrap(), id, Some("lunch"))
        .await
        .unwrap();
    assert_eq!(p.from, research::Stage::Retrieving);
    assert_eq!(job(&pool, id).await.error.as_deref(), Some("lunch"));
    let before = (events(&pool, id).await, partials(&pool, id).await.len());
    assert_eq!(
        step_by_hand(&pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap(),
        None
    );
    let st = Statements::new(&RESEARCH);
    let mut conn = pool.acquire().await.unwrap();
    assert!(
        !lease::heartbeat(&mut conn, &st, &ctx, Duration::from_secs(30))
            .await
            .unwrap()
    );
    assert!(!lease::end(&mut conn, &st, &ctx, &End::Continue)
        .await
        .unwrap());
    assert_eq!(
        before,
        (events(&pool, id).await, partials(&pool, id).await.len())
    );

    // Resume: back to retrieving, a new revision, the error cleared; the old worker stays out.
    let r = control::resume(&mut conn, id).await.unwrap();
    assert_eq!(
        (r.to, r.outbox_revision),
        (research::Stage::Retrieving, Some(3))
    );
    assert_eq!(job(&pool, id).await.error, None);
    assert_eq!(
        step_by_hand(&pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap(),
        None
    );
    let again = control::resume(&mut conn, id).await.unwrap();
    assert!(!again.changed, "resuming a running task changes nothing");
    let ob = outbox(&pool, id).await;
    assert_eq!(
        ob.iter().map(|o| (o.0, o.1.as_str())).collect::<Vec<_>>(),
        vec![(1, "canceled"), (2, "canceled"), (3, "pending")]
    );
    let e = engine(&pool, "w-after", extractive());
    assert_eq!(run_until_settled(&s, &e, id).await.stage, "completed");
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    let sh: Vec<(String, String, Value)> = shape(&evs)
        .into_iter()
        .map(|(t, st, mut p)| {
            // The details are asserted in the whole-walk test.
            if let Some(o) = p.as_object_mut() {
                o.remove("details");
            }
            (t, st, p)
        })
        .collect();
    let ev = |t: &str, stage: &str, p: Value| (t.to_owned(), stage.to_owned(), p);
    assert_eq!(
        sh,
        vec![
            ev("started", "queued", json!({})),
            ev("paused", "paused", json!({})),
            ev("resumed", "queued", json!({"resumedFrom": "paused"})),
            ev("stage_changed", "queued", claim(1)),
            ev(
                "stage_changed",
                "planning",
                json!({"previousStage": "queued"})
            ),
            ev(
                "stage_changed",
                "retrieving",
                json!({"previousStage": "planning"})
            ),
            ev("paused", "paused", json!({"reason": "lunch"})),
            ev("resumed", "retrieving", json!({"resumedFrom": "paused"})),
            ev("stage_changed", "retrieving", claim(2)),
            ev(
                "stage_changed",
                "analyzing",
                json!({"previousStage": "retrieving"})
            ),
            ev(
                "stage_changed",
                "generating",
                json!({"previousStage": "analyzing"})
            ),
            ev(
                "answer_delta",
                "generating",
                json!({"delta": answer(&pool, id).await.unwrap(), "executionAttempt": 2, "offset": 0})
            ),
            ev(
                "stage_changed",
                "completed",
                json!({"previousStage": "generating"})
            ),
        ]
    );
    // A finished task can be neither paused nor resumed nor canceled.
    for r in [
        control::pause(&mut conn, id).await,
        control::resume(&mut conn, id).await,
        control::cancel(&mut conn, id, None).await,
    ] {
        assert!(
            matches!(r, Err(ControlError::Refused(_, Refusal::Terminal(..)))),
            "{r:?}"
        );
    }
    assert!(matches!(
        control::pause(&mut conn, Uuid::now_v7()).await,
        Err(ControlError::NotFound(_))
    ));
    drop(conn);
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancel_ends_the_task_for_good() {
    let s = seed("cancel").await;
    let pool = s.pool().clone();
    let id = request(&pool, &req(&s, QUESTION)).await;
    let handler = extractive();
    let mut ctx = claim_by_hand(&pool, id, "w-cancel").await;
    step_by_hand(&pool, handler.as_ref(), &mut ctx)
        .await
        .unwrap()
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let c = control::cancel(&mut conn, id, Some("the user lost interest"))
        .await
        .unwrap();
    assert_eq!(
        (c.from, c.to),
        (research::Stage::Planning, research::Stage::Canceled)
    );
    let j = job(&pool, id).await;
    assert_eq!(j.stage, "canceled");
    assert_eq!(j.error.as_deref(), Some("the user lost interest"));
    assert_eq!(j.lease_token, None);
    let completed_at: Option<i64> =
        sqlx::query_scalar("SELECT completed_at FROM research_task_jobs WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(completed_at.is_some());
    assert_eq!(outbox_states(&pool, id).await, vec!["canceled"]);
    // The worker is fenced out; the task stays canceled.
    assert_eq!(
        step_by_hand(&pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap(),
        None
    );
    assert!(!control::cancel(&mut conn, id, None).await.unwrap().changed);
    assert!(matches!(
        control::resume(&mut conn, id).await,
        Err(ControlError::Refused(
            _,
            Refusal::Terminal(research::Stage::Canceled, _)
        ))
    ));
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    assert_eq!(
        shape(&evs),
        vec![
            ("started".into(), "queued".into(), json!({})),
            ("stage_changed".into(), "queued".into(), claim(1)),
            (
                "stage_changed".into(),
                "planning".into(),
                json!({"previousStage": "queued"})
            ),
            (
                "canceled".into(),
                "canceled".into(),
                json!({"reason": "the user lost interest"})
            ),
        ]
    );
    let e = engine(&pool, "w-x", extractive());
    assert!(deliver(&s, &e).await.is_none(), "nothing is due");
    drop(conn);
    s.fx.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// Permission, deletion, refusals

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_snapshot_revoked_expired_or_outdated_mid_run_fails_the_task_closed() {
    let s = seed("revoke").await;
    let pool = s.pool().clone();
    let handler = extractive();
    for change in ["revoke", "expire", "revision", "member"] {
        let snapshot = s.snapshot(SUBJECT).await;
        let r = ResearchRequest::new(s.space, QUESTION, SUBJECT, snapshot);
        let id = request(&pool, &r).await;
        let mut ctx = claim_by_hand(&pool, id, "w-revoke").await;
        for _ in 0..2 {
            step_by_hand(&pool, handler.as_ref(), &mut ctx)
                .await
                .unwrap()
                .unwrap();
        }
        assert_eq!(ctx.checkpoint, "retrieving");
        let mut conn = pool.acquire().await.unwrap();
        let sql = match change {
            "revoke" => {
                platform::revoke_permission_snapshot(&mut conn, TENANT, snapshot)
                    .await
                    .unwrap();
                None
            }
            "expire" => Some(
                "UPDATE knowledge_space_permission_snapshots SET expires_at = now() - interval '1 second' WHERE id = $1",
            ),
            "revision" => Some(
                "UPDATE knowledge_space_permission_snapshots SET revision = revision + 1 WHERE id = $1",
            ),
            // The member's role changed: the snapshot's member revision is no longer current.
            _ => Some(
                "UPDATE knowledge_space_members m SET revision = m.revision + 1 \
                 FROM knowledge_space_permission_snapshots s \
                 WHERE s.id = $1 AND m.tenant_id = s.tenant_id AND m.knowledge_space_id = s.knowledge_space_id \
                   AND m.subject_id = s.subject_id",
            ),
        };
        if let Some(sql) = sql {
            sqlx::query(sql)
                .bind(snapshot)
                .execute(&mut *conn)
                .await
                .unwrap();
        }
        drop(conn);
        let err = step_by_hand(&pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, JobError::Fatal { code, .. } if code == INVALID),
            "{change}: {err:?}"
        );

        // Through the engine: the task fails, with nothing retrieved.
        expire(&pool, id).await;
        let e = engine(&pool, "w-revoke-engine", extractive());
        let j = run_until_settled(&s, &e, id).await;
        assert_eq!(j.stage, "failed", "{j:?}");
        assert!(
            j.error
                .as_deref()
                .unwrap()
                .starts_with(&format!("{INVALID}: ")),
            "{j:?}"
        );
        assert!(
            j.metadata.get("retrieval").is_none(),
            "{change}: nothing retrieved"
        );
        assert!(partials(&pool, id).await.is_empty());
        let evs = events(&pool, id).await;
        assert_contiguous(id, &evs);
        // The failure's own attempt is claimed, then the failure is the last event.
        let sh = shape(&evs);
        assert_eq!(
            sh[sh.len() - 2..],
            [
                ("stage_changed".into(), "retrieving".into(), claim(2)),
                ("failed".into(), "failed".into(), json!({"error": INVALID})),
            ]
        );
        assert_eq!(outbox_states(&pool, id).await, vec!["dead"]);
    }
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_task_whose_attempts_are_used_up_ends_failed_with_its_failed_event() {
    let s = seed("exhausted").await;
    let pool = s.pool().clone();
    let id = request(&pool, &req(&s, QUESTION)).await;
    // A worker claims the last allowed attempt, takes one step, and dies holding the lease.
    let handler = extractive();
    let mut ctx = claim_by_hand(&pool, id, "w-gone").await;
    step_by_hand(&pool, handler.as_ref(), &mut ctx)
        .await
        .unwrap()
        .unwrap();
    sqlx::query(
        "UPDATE research_task_jobs SET max_execution_attempts = execution_attempts WHERE id = $1",
    )
    .bind(id)
    .execute(&pool)
    .await
    .unwrap();
    expire(&pool, id).await;

    // The next delivery finds the attempts used up: the task fails, as every failure does, with
    // its `research_task.failed` event in the same transaction.
    let e = engine(&pool, "w-after", extractive());
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "failed", "{j:?}");
    assert!(
        j.error
            .as_deref()
            .unwrap_or_default()
            .starts_with("attempts_exhausted"),
        "{j:?}"
    );
    assert_eq!(
        e.counters
            .exhausted
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    let sh = shape(&evs);
    assert_eq!(
        sh.last(),
        Some(&(
            "failed".into(),
            "failed".into(),
            json!({"error": "attempts_exhausted"})
        )),
        "{sh:#?}"
    );
    // Keyed by the row version the failure wrote.
    assert_eq!(
        evs.last().unwrap().3,
        format!(
            "research-task-progress:{id}:{}:research_task.failed",
            j.row_version
        )
    );
    assert_eq!(
        types(&evs).iter().filter(|t| *t == "failed").count(),
        1,
        "{sh:#?}"
    );
    assert_eq!(outbox_states(&pool, id).await, vec!["dead"]);
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_document_deleted_or_a_space_being_deleted_mid_task_is_never_read() {
    let s = seed("deleted").await;
    let pool = s.pool().clone();
    let handler = extractive();
    let id = request(&pool, &req(&s, QUESTION)).await;
    let frozen = s.head().await.unwrap();
    let mut ctx = claim_by_hand(&pool, id, "w-del").await;
    for _ in 0..2 {
        step_by_hand(&pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(ctx.checkpoint, "retrieving");
    // fencing.md is deleted while the task runs: marked deleting, as a deletion request marks its
    // target, and taken out of the head, as its quiescing does.
    let fencing = s.docs[1];
    let deletion = Uuid::new_v4();
    sqlx::query(
        "UPDATE document_assets SET lifecycle_state = 'deleting', deletion_job_id = $2, deleting_at = now(), \
           row_version = row_version + 1 WHERE id = $1",
    )
    .bind(fencing)
    .bind(deletion)
    .execute(&pool)
    .await
    .unwrap();
    {
        let mut conn = pool.acquire().await.unwrap();
        let moved = kfs_worker::publication::publish_excluding(
            &mut conn,
            TENANT,
            s.space,
            deletion,
            Some(&[fencing][..]),
            &json!({}),
        )
        .await
        .unwrap();
        assert!(matches!(moved, Some(Ok(_))), "{moved:?}");
    }
    assert_ne!(
        s.head().await.unwrap().publication_id,
        frozen.publication_id
    );
    let e = engine(&pool, "w-del-engine", extractive());
    expire(&pool, id).await;
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "completed", "{j:?}");
    // The task read its frozen publication (now superseded) and found only what is still live.
    let retrieval = &j.metadata["retrieval"];
    assert_eq!(retrieval["publicationId"], json!(frozen.publication_id));
    let b = bundle(&pool, id).await;
    assert_eq!(cited_documents(&b), vec![s.docs[0]]);
    assert!(!b.to_string().contains("Fencing will use"), "{b}");
    assert!(!j.metadata["result"]
        .to_string()
        .contains(&fencing.to_string()));
    assert!(!answer(&pool, id)
        .await
        .unwrap()
        .contains("Fencing will use"));

    // A space being deleted stops a running task at its next step.
    let id = request(&pool, &req(&s, "lease expire")).await;
    let mut ctx = claim_by_hand(&pool, id, "w-space").await;
    step_by_hand(&pool, handler.as_ref(), &mut ctx)
        .await
        .unwrap()
        .unwrap();
    sqlx::query(
        "UPDATE knowledge_spaces SET lifecycle_state = 'deleting', deletion_job_id = gen_random_uuid(), \
           deleting_at = now() WHERE id = $1",
    )
    .bind(s.space)
    .execute(&pool)
    .await
    .unwrap();
    let step = step_by_hand(&pool, handler.as_ref(), &mut ctx)
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(&step, Step::Cancel { code, .. } if code == "RESEARCH_TASK_DELETION_FENCE_ACTIVE"),
        "{step:?}"
    );
    let j = job(&pool, id).await;
    assert_eq!(j.stage, "canceled");
    assert!(j
        .error
        .unwrap()
        .starts_with("RESEARCH_TASK_DELETION_FENCE_ACTIVE: "));
    assert!(
        j.metadata.get("plan").is_none(),
        "the planning step did nothing"
    );
    assert_eq!(
        shape(&events(&pool, id).await).last().unwrap(),
        &(
            "canceled".into(),
            "canceled".into(),
            json!({"reason": "RESEARCH_TASK_DELETION_FENCE_ACTIVE"})
        )
    );
    assert_eq!(outbox_states(&pool, id).await, vec!["canceled"]);
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_are_refused_clearly_and_write_nothing() {
    let s = seed("refuse").await;
    let pool = s.pool().clone();
    let mut conn = pool.acquire().await.unwrap();
    let c = &mut *conn;
    let snap = |subject: &str, channel: &str, space: Uuid, tenant: &str| {
        let (subject, channel, tenant) =
            (subject.to_owned(), channel.to_owned(), tenant.to_owned());
        let pool = pool.clone();
        async move {
            platform::create_permission_snapshot(
                &mut pool.acquire().await.unwrap(),
                &tenant,
                space,
                &subject,
                &channel,
                None,
            )
            .await
            .unwrap()
        }
    };
    let revoked = snap(SUBJECT, "interactive", s.space, TENANT).await;
    platform::revoke_permission_snapshot(c, TENANT, revoked)
        .await
        .unwrap();
    let expired = snap(SUBJECT, "interactive", s.space, TENANT).await;
    sqlx::query("UPDATE knowledge_space_permission_snapshots SET expires_at = now() - interval '1 minute' WHERE id = $1")
        .bind(expired)
        .execute(&mut *c)
        .await
        .unwrap();
    let bobs = snap("bob", "interactive", s.space, TENANT).await;
    let mcp = snap(SUBJECT, "mcp", s.space, TENANT).await;
    let second_space = platform::create_space(c, TENANT, "second", "Second", "owner-2")
        .await
        .unwrap();
    let elsewhere = snap(SUBJECT, "interactive", second_space, TENANT).await;
    let other_tenant = snap(SUBJECT, "interactive", s.other_space, OTHER_TENANT).await;

    let cases: Vec<(ResearchRequest, &str)> = vec![
        (
            ResearchRequest::new(s.space, QUESTION, SUBJECT, revoked),
            "revoked",
        ),
        (
            ResearchRequest::new(s.space, QUESTION, SUBJECT, expired),
            "expired",
        ),
        (
            ResearchRequest::new(s.space, QUESTION, SUBJECT, bobs),
            "another subject",
        ),
        (
            ResearchRequest::new(s.space, QUESTION, SUBJECT, mcp),
            "mcp channel",
        ),
        (
            ResearchRequest::new(s.space, QUESTION, SUBJECT, elsewhere),
            "another knowledge space",
        ),
        (
            ResearchRequest::new(s.space, QUESTION, SUBJECT, other_tenant),
            "does not exist",
        ),
        (
            ResearchRequest::new(s.space, QUESTION, SUBJECT, Uuid::now_v7()),
            "does not exist",
        ),
        (
            ResearchRequest::new(Uuid::now_v7(), QUESTION, SUBJECT, s.snapshot),
            "no knowledge space",
        ),
        (
            ResearchRequest {
                top_k: Some(0),
                ..req(&s, QUESTION)
            },
            "top-k",
        ),
        (
            ResearchRequest::new(s.space, "   ", SUBJECT, s.snapshot),
            "empty",
        ),
        // Fast and deep retrieval need the space's embedding profile.
        (
            ResearchRequest {
                mode: "fast".into(),
                ..req(&s, QUESTION)
            },
            "needs an embedding profile",
        ),
    ];
    for (r, needle) in cases {
        let err = research::request(c, &r).await.unwrap_err();
        assert!(err.is_refusal());
        assert!(
            err.to_string().contains(needle),
            "{err} should say {needle:?}"
        );
    }
    // A space being deleted.
    sqlx::query(
        "UPDATE knowledge_spaces SET lifecycle_state = 'deleting', deletion_job_id = gen_random_uuid(), deleting_at = now() \
         WHERE id = $1",
    )
    .bind(second_space)
    .execute(&mut *c)
    .await
    .unwrap();
    let err = research::request(
        c,
        &ResearchRequest::new(second_space, QUESTION, SUBJECT, elsewhere),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, RequestError::SpaceUnavailable { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("being deleted"), "{err}");
    for table in [
        "research_task_jobs",
        "research_task_outbox",
        "research_task_progress_events",
    ] {
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(&mut *c)
            .await
            .unwrap();
        assert_eq!(n, 0, "{table} written by a refused request");
    }

    // Idempotency: the same key and request return the first job; another request conflicts.
    let keyed = ResearchRequest {
        idempotency_key: Some("k-1".into()),
        ..req(&s, QUESTION)
    };
    let first = research::request(c, &keyed).await.unwrap();
    let second = research::request(c, &keyed).await.unwrap();
    assert!(first.created && !second.created);
    assert_eq!(
        (first.job_id, first.outbox_id),
        (second.job_id, second.outbox_id)
    );
    let err = research::request(
        c,
        &ResearchRequest {
            top_k: Some(3),
            ..keyed.clone()
        },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, RequestError::Conflict(j) if j == first.job_id),
        "{err}"
    );

    // While a deletion of one of its documents is in progress, the space admits no new task.
    let deletion = kfs_worker::jobs::deletion::request::DeletionRequest {
        tenant_id: TENANT.into(),
        knowledge_space_id: s.space,
        target: kfs_worker::jobs::deletion::request::Target::Document { id: s.docs[2] },
        expected_revision: None,
        requested_by_subject_id: SUBJECT.into(),
        permission_snapshot_id: s.snapshot,
        access_channel: "interactive".into(),
        idempotency_key: "delete-cooking".into(),
    };
    kfs_worker::jobs::deletion::request::request_deletion(c, &deletion)
        .await
        .unwrap();
    let err = research::request(c, &req(&s, "bread")).await.unwrap_err();
    assert!(err.to_string().contains("a deletion (job"), "{err}");
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM research_task_jobs")
        .fetch_one(&mut *c)
        .await
        .unwrap();
    assert_eq!(n, 1);
    drop(conn);
    s.fx.cleanup().await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_grant_authorized_task_runs_and_cites_only_content_within_the_grants_scope() {
    let s = seed("grant-scope").await;
    let pool = s.pool().clone();
    let zebra = upload(
        &s,
        s.space,
        "zebra.md",
        "# Zebra\n\nThe zebra stripes are carol's notes.\n",
        vec!["source:carol".into()],
    )
    .await;
    let giraffe = upload(
        &s,
        s.space,
        "giraffe.md",
        "# Giraffe\n\nThe giraffe neck is in the app's scope.\n",
        vec!["source:app".into()],
    )
    .await;
    // Every scope of content must be in the grant's: one of two is not enough.
    let okapi = upload(
        &s,
        s.space,
        "okapi.md",
        "# Okapi\n\nThe okapi neck belongs to the app and to carol.\n",
        vec!["source:app".into(), "source:carol".into()],
    )
    .await;
    for d in [zebra, giraffe, okapi] {
        s.compile(d).await;
    }
    let g = grant(&s, s.space, "app-user-7", &["source:app"]).await;
    let e = engine(&pool, "w-grant", extractive());

    let id = request(
        &pool,
        &ResearchRequest::under_grant(
            s.space,
            "Where are the zebra stripes, and where is the giraffe neck?",
            g,
        ),
    )
    .await;
    // Written as the platform's API writes a grant's task: the grant, and no snapshot binding.
    assert_eq!(binding(&pool, id).await, (Some(g), None, None, None, None));
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "completed", "{j:?}");
    let b = bundle(&pool, id).await;
    assert_eq!(cited_documents(&b), vec![giraffe], "{b}");
    assert!(!b["items"].to_string().contains("carol"), "{b}");
    let stored = answer(&pool, id).await.unwrap();
    assert!(stored.contains("giraffe neck"), "{stored}");
    assert!(!stored.contains("zebra"), "{stored}");
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    assert_eq!(advances(&evs), ADVANCES.to_vec());
    assert_eq!(reassemble(&evs, 1), stored);

    // Content scoped to the app and carol is not the app's to read.
    let id = request(
        &pool,
        &ResearchRequest::under_grant(s.space, "okapi neck", g),
    )
    .await;
    assert_eq!(run_until_settled(&s, &e, id).await.stage, "completed");
    assert_eq!(bundle(&pool, id).await["items"], json!([]));
    assert_eq!(answer(&pool, id).await.as_deref(), Some(NO_EVIDENCE_ANSWER));

    // Unscoped content is visible within the space, to a grant of any scope.
    let id = request(
        &pool,
        &ResearchRequest::under_grant(s.space, "fencing lease token", g),
    )
    .await;
    assert_eq!(run_until_settled(&s, &e, id).await.stage, "completed");
    assert_eq!(cited_documents(&bundle(&pool, id).await), vec![s.docs[1]]);
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_revoked_grant_or_a_fenced_space_fails_the_task_closed_with_capability_revoked() {
    let s = seed("grant-revoke").await;
    let pool = s.pool().clone();
    let handler = extractive();
    // (what happens to the grant, how many steps the task took before)
    for (change, steps) in [("revoke", 4), ("revoke", 0), ("fence", 2)] {
        let g = grant(&s, s.space, "app-user-7", &[]).await;
        let id = request(&pool, &ResearchRequest::under_grant(s.space, QUESTION, g)).await;
        let mut ctx = claim_by_hand(&pool, id, "w-grant-revoke").await;
        for _ in 0..steps {
            step_by_hand(&pool, handler.as_ref(), &mut ctx)
                .await
                .unwrap()
                .unwrap();
        }
        let at = ctx.checkpoint.clone();
        let mut conn = pool.acquire().await.unwrap();
        match change {
            "revoke" => platform::revoke_capability_grant(&mut conn, TENANT, s.space, g)
                .await
                .unwrap(),
            _ => platform::fence_capability_space(&mut conn, TENANT, s.space)
                .await
                .unwrap(),
        }
        drop(conn);
        let before = events(&pool, id).await;
        let err = step_by_hand(&pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, JobError::Fatal { code, .. } if code == REVOKED),
            "{change} at {at}: {err:?}"
        );

        // Through the engine: the task fails with the platform's code and its failed event, and
        // nothing else is written: no further stage, no answer, no partial result.
        expire(&pool, id).await;
        let e = engine(&pool, "w-grant-revoke-engine", extractive());
        let j = run_until_settled(&s, &e, id).await;
        assert_eq!(j.stage, "failed", "{change} at {at}: {j:?}");
        let error = j.error.unwrap();
        assert!(error.starts_with(&format!("{REVOKED}: ")), "{error}");
        assert!(partials(&pool, id).await.is_empty(), "{change} at {at}");
        let evs = events(&pool, id).await;
        assert_contiguous(id, &evs);
        assert_eq!(
            shape(&evs[before.len()..]),
            [
                ("stage_changed".into(), at.clone(), claim(2)),
                ("failed".into(), "failed".into(), json!({"error": REVOKED})),
            ],
            "{change} at {at}"
        );
        assert!(deltas_of(&evs, 2).is_empty());
        // What the failing step would have written is not there.
        let would_write = match at.as_str() {
            "planning" => "plan",
            "retrieving" => "retrieval",
            "analyzing" => "evidence",
            "generating" => "result",
            _ => "nothing",
        };
        assert!(j.metadata.get(would_write).is_none(), "{change} at {at}");
        let stages_reached = advances(&evs).len();
        assert_eq!(stages_reached, steps, "{change} at {at}: no stage after");
        assert_eq!(outbox_states(&pool, id).await, vec!["dead"]);
    }
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_under_a_revoked_foreign_or_fenced_grant_is_refused_and_writes_nothing() {
    let fx = SpaceFx::new(TENANT, "grant-refuse", "Docs").await;
    let pool = fx.pool().clone();
    let mut conn = pool.acquire().await.unwrap();
    let c = &mut *conn;
    let revoked = grant(&fx, fx.space, "app-user-7", &[]).await;
    platform::revoke_capability_grant(c, TENANT, fx.space, revoked)
        .await
        .unwrap();
    let second = platform::create_space(c, TENANT, "second", "Second", "owner-2")
        .await
        .unwrap();
    let foreign = grant(&fx, second, "app-user-7", &[]).await;
    let fenced_space = platform::create_space(c, TENANT, "fenced", "Fenced", "owner-3")
        .await
        .unwrap();
    let fenced = grant(&fx, fenced_space, "app-user-7", &[]).await;
    platform::fence_capability_space(c, TENANT, fenced_space)
        .await
        .unwrap();
    let cases = [
        (fx.space, revoked, "is revoked"),
        (
            fx.space,
            foreign,
            "does not exist in this tenant and knowledge space",
        ),
        (fx.space, Uuid::now_v7(), "does not exist"),
        (fenced_space, fenced, "capability fence is tombstoned"),
    ];
    for (space, g, says) in cases {
        let err = research::request(c, &ResearchRequest::under_grant(space, QUESTION, g))
            .await
            .unwrap_err();
        assert!(
            matches!(err, RequestError::PermissionDenied(_)),
            "{says}: {err}"
        );
        assert!(err.to_string().contains(says), "{err} should say {says:?}");
    }
    for table in [
        "research_task_jobs",
        "research_task_outbox",
        "research_task_progress_events",
    ] {
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(&mut *c)
            .await
            .unwrap();
        assert_eq!(n, 0, "{table} written by a refused request");
    }

    // An active grant is admitted, idempotently: the same key and request give the same job,
    // the same key under another grant is another request.
    let g = grant(&fx, fx.space, "app-user-7", &["source:app"]).await;
    let keyed = ResearchRequest {
        idempotency_key: Some("k-grant".into()),
        ..ResearchRequest::under_grant(fx.space, QUESTION, g)
    };
    let first = research::request(c, &keyed).await.unwrap();
    let again = research::request(c, &keyed).await.unwrap();
    assert!(first.created && !again.created);
    assert_eq!(first.job_id, again.job_id);
    assert_eq!(
        binding(&pool, first.job_id).await,
        (Some(g), None, None, None, None)
    );
    let other = grant(&fx, fx.space, "app-user-7", &["source:app"]).await;
    let err = research::request(
        c,
        &ResearchRequest {
            asked_by: research::AskedBy::Grant(other),
            ..keyed.clone()
        },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, RequestError::Conflict(j) if j == first.job_id),
        "{err}"
    );
    let evs = events(&pool, first.job_id).await;
    assert_eq!(
        shape(&evs),
        vec![("started".into(), "queued".into(), json!({}))]
    );
    assert_eq!(
        outbox(&pool, first.job_id).await,
        vec![(
            1,
            "pending".into(),
            format!("research.task:{TENANT}:{}:{}:1", fx.space, first.job_id)
        )]
    );
    drop(conn);
    fx.cleanup().await;
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

/// A tiny OpenAI-compatible stand-in on 127.0.0.1 that answers the n-th request with the n-th
/// reply (the last one from then on).
async fn stand_in(replies: Vec<(u16, Value)>) -> (String, Arc<Mutex<Vec<Captured>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let seen = seen2.clone();
            let replies = replies.clone();
            tokio::spawn(async move {
                let Some(captured) = read_request(&mut sock).await else {
                    return;
                };
                let n = {
                    let mut seen = seen.lock().unwrap();
                    seen.push(captured);
                    seen.len()
                };
                let (status, reply) = replies[(n - 1).min(replies.len() - 1)].clone();
                let reply = reply.to_string();
                let resp = format!(
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}",
                    reply.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    (format!("http://{addr}/v1"), seen)
}

/// One step of a streamed reply.
#[derive(Clone)]
enum Sse {
    /// A chunk carrying this piece of the answer.
    Piece(String),
    /// Waits until the test opens the gate.
    Gate(Arc<tokio::sync::Notify>),
    /// The last choice chunk, the usage chunk and `[DONE]`.
    End {
        prompt_tokens: u64,
        completion_tokens: u64,
    },
}

fn piece(text: &str) -> Sse {
    Sse::Piece(text.to_owned())
}

/// A stand-in that streams its n-th reply (the last one from then on) as server-sent events,
/// sending each event as it comes to it.
async fn sse_stand_in(replies: Vec<Vec<Sse>>) -> (String, Arc<Mutex<Vec<Captured>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let seen = seen2.clone();
            let replies = replies.clone();
            tokio::spawn(async move {
                let Some(captured) = read_request(&mut sock).await else {
                    return;
                };
                let n = {
                    let mut seen = seen.lock().unwrap();
                    seen.push(captured);
                    seen.len()
                };
                let script = replies[(n - 1).min(replies.len() - 1)].clone();
                let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n";
                if sock.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = |choices: Value, usage: Value| {
                    let c = json!({"id": "chatcmpl-s", "object": "chat.completion.chunk", "model": "stand-in-1",
                                   "choices": choices, "usage": usage});
                    format!("data: {c}\n\n")
                };
                for step in script {
                    let out = match step {
                        Sse::Piece(p) => chunk(
                            json!([{"index": 0, "delta": {"content": p}, "finish_reason": null}]),
                            Value::Null,
                        ),
                        Sse::Gate(g) => {
                            g.notified().await;
                            continue;
                        }
                        Sse::End {
                            prompt_tokens,
                            completion_tokens,
                        } => {
                            let stop = chunk(
                                json!([{"index": 0, "delta": {}, "finish_reason": "stop"}]),
                                Value::Null,
                            );
                            let usage = chunk(
                                json!([]),
                                json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                       "total_tokens": prompt_tokens + completion_tokens}),
                            );
                            format!("{stop}{usage}data: [DONE]\n\n")
                        }
                    };
                    if sock.write_all(out.as_bytes()).await.is_err() {
                        return;
                    }
                    let _ = sock.flush().await;
                }
                let _ = sock.shutdown().await;
            });
        }
    });
    (format!("http://{addr}/v1"), seen)
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

fn completion(content: &str, prompt_tokens: u64, completion_tokens: u64) -> Value {
    json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "stand-in-1",
        "choices": [{ "index": 0, "message": { "role": "assistant", "content": content }, "finish_reason": "stop" }],
        "usage": { "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens }
    })
}

/// An engine whose research retries come due at once.
fn quick_retry_engine(pool: &PgPool, worker: &str, handler: Arc<dyn Handler>) -> Engine {
    let mut cfg = ConsumerConfig::default();
    cfg.policies.insert(
        Kind::Research,
        Policy {
            retry: RetryPolicy {
                base: Duration::from_millis(10),
                max: Duration::from_millis(10),
            },
            ..RESEARCH.policy
        },
    );
    Engine::new(pool.clone(), worker, vec![handler], cfg)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_http_generator_answers_through_a_local_stand_in_and_records_its_cost() {
    let s = seed("http").await;
    let pool = s.pool().clone();
    let said = "Fencing will use the lease token on every write [1]; a lease will expire after thirty seconds [2].";
    let ok = completion(said, 1200, 40);
    // The first call finds the service overloaded: a retry, then the answer.
    let (base, seen) = stand_in(vec![(503, json!({"error": "busy"})), (200, ok)]).await;
    let handler = Arc::new(ResearchHandler::with_generator(openai(&base, 0.5, 1.5)));
    let id = request(
        &pool,
        &ResearchRequest {
            budget_usd: Some(1.0),
            ..req(&s, QUESTION)
        },
    )
    .await;
    let e = quick_retry_engine(&pool, "w-http", handler);
    deliver(&s, &e).await.expect("a delivery");
    let j = job(&pool, id).await;
    assert_eq!(j.stage, "generating", "{j:?}");
    let (retry_at, error): (i64, String) =
        sqlx::query_as("SELECT retry_at, error FROM research_task_jobs WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(error.starts_with("generator_unavailable: "), "{error}");
    assert!(!error.contains("sk-test-secret"));
    let retried = events(&pool, id).await;
    assert_eq!(
        shape(&retried).last().unwrap(),
        &(
            "stage_changed".into(),
            "generating".into(),
            json!({"error": error, "retryAt": retry_at, "retryScheduled": true})
        )
    );
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "completed", "{j:?}");

    let calls = seen.lock().unwrap().clone();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[1].request_line, "POST /v1/chat/completions HTTP/1.1");
    assert_eq!(
        calls[1].authorization.as_deref(),
        Some("Bearer sk-test-secret")
    );
    assert_eq!(calls[1].body["model"], "stand-in-1");
    assert_eq!(calls[1].body["max_tokens"], 100);
    let user = calls[1].body["messages"][1]["content"].as_str().unwrap();
    assert!(
        user.contains(QUESTION) && user.contains("[1]") && user.contains("Fencing will use"),
        "{user}"
    );
    assert!(!user.contains("OTHER-TENANT-SECRET"));

    // The stream was asked for; this service answered with one JSON completion instead, so the
    // answer is one delta, of the attempt that made it.
    assert_eq!(calls[1].body["stream"], true);
    assert_eq!(answer(&pool, id).await.as_deref(), Some(said));
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    assert_eq!(reassemble(&evs, 2), said);
    assert!(
        deltas_of(&evs, 1).is_empty(),
        "the failed call streamed nothing"
    );
    let result = &j.metadata["result"];
    assert_eq!(result["generator"], "openai");
    assert_eq!(result["model"], "stand-in-1");
    let indices: Vec<u64> = result["citations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indices, vec![1, 2]);
    // The failed attempt's reservation went with its step; the second attempt's call is the one
    // entry, settled with what the service billed.
    let mut cost = j.cost.clone();
    cost["entries"][0]["recordedAt"] = json!(0);
    assert_eq!(
        cost,
        json!({"budgetUsd": 1.0, "entries": [{"costUsd": 0.66, "provider": "openai", "recordedAt": 0,
          "step": "query.answer", "usage": {"completionTokens": 40, "estimated": false, "promptTokens": 1200,
            "researchModelCallId": format!("attempt:2:query-answer:{id}:2:openai"), "reserved": false,
            "status": "succeeded", "totalTokens": 1240}}], "totalUsd": 0.66})
    );
    // The key is nowhere in the database.
    let dump: String = sqlx::query_scalar(
        "SELECT concat((SELECT string_agg(j::text, '') FROM research_task_jobs j), \
           (SELECT string_agg(e::text, '') FROM research_task_progress_events e), \
           (SELECT string_agg(p::text, '') FROM research_task_partial_results p))",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(!dump.contains("sk-test-secret"));
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_budget_overrun_cancels_the_task_with_the_platforms_reason() {
    let s = seed("budget").await;
    let pool = s.pool().clone();
    let (base, seen) = stand_in(vec![(
        200,
        completion("A very long answer [1].", 1000, 500_000),
    )])
    .await;
    let handler = Arc::new(ResearchHandler::with_generator(openai(&base, 0.001, 0.01)));
    let id = request(
        &pool,
        &ResearchRequest {
            budget_usd: Some(1.0),
            ..req(&s, QUESTION)
        },
    )
    .await;
    let e = engine(&pool, "w-budget", handler);
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "canceled", "{j:?}");
    assert_eq!(
        seen.lock().unwrap().len(),
        1,
        "the reservation fit; the call was made"
    );
    let error = j.error.unwrap();
    assert!(
        error.starts_with("RESEARCH_TASK_BUDGET_EXHAUSTED: "),
        "{error}"
    );
    assert!(error.contains("over the budget of $1.0"), "{error}");
    assert_eq!(j.cost["budgetExceeded"], true);
    let usd = j.cost["totalUsd"].as_f64().unwrap();
    assert!(
        (usd - 5.001).abs() < 1e-9,
        "the spend is recorded: {}",
        j.cost
    );
    assert_eq!(j.cost["entries"][0]["usage"]["status"], "succeeded");
    assert!(j.metadata.get("result").is_none(), "no answer over budget");
    assert!(partials(&pool, id).await.is_empty());
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    assert_eq!(advances(&evs), ADVANCES[..4].to_vec());
    assert_eq!(
        shape(&evs).last().unwrap(),
        &(
            "canceled".into(),
            "canceled".into(),
            json!({"reason": "RESEARCH_TASK_BUDGET_EXHAUSTED"})
        )
    );
    assert_eq!(outbox_states(&pool, id).await, vec!["canceled"]);

    // A budget the reservation alone exceeds cancels before any call, and spends nothing.
    let id = request(
        &pool,
        &ResearchRequest {
            budget_usd: Some(0.0),
            ..req(&s, QUESTION)
        },
    )
    .await;
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "canceled");
    assert!(j.error.unwrap().contains("would cost up to"));
    assert_eq!(
        j.cost,
        json!({"budgetUsd": 0.0, "entries": [], "totalUsd": 0.0})
    );
    assert_eq!(seen.lock().unwrap().len(), 1, "no second call");
    s.fx.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// The answer, streamed

/// Waits (up to a minute) until the job has an answer delta; then returns its events, stage and
/// partial results as they were.
async fn first_delta(pool: &PgPool, id: Uuid) -> (Vec<Event>, String, usize) {
    for _ in 0..600 {
        let evs = events(pool, id).await;
        if evs.iter().any(|e| e.1 == "research_task.answer_delta") {
            let stage = job(pool, id).await.stage;
            let partials = partials(pool, id).await.len();
            return (evs, stage, partials);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no answer delta of {id} appeared");
}

/// The attempt of the last claim among `evs`.
fn last_attempt(evs: &[Event]) -> i64 {
    evs.iter()
        .rev()
        .filter(|e| is_claim(e))
        .find_map(|e| e.4["executionAttempt"].as_i64())
        .expect("a claim")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_models_answer_streams_deltas_readers_see_before_completion_that_reassemble_the_stored_answer(
) {
    let s = seed("stream").await;
    let pool = s.pool().clone();
    let gate = Arc::new(tokio::sync::Notify::new());
    // Text past the first batch: accented and astral characters count in UTF-16 units.
    let long = " on every write; a worker whose lease was lost finds every write refused, \
        and the row version moves with each step (é, 🔒) so that a stale worker can never \
        commit a step twice";
    let (base, seen) = sse_stand_in(vec![vec![
        piece("Fencing"),
        piece(" will use the lease token"),
        Sse::Gate(gate.clone()),
        piece(long),
        piece(" [1]."),
        Sse::End {
            prompt_tokens: 900,
            completion_tokens: 60,
        },
    ]])
    .await;
    let handler = Arc::new(ResearchHandler::with_generator(openai(&base, 0.5, 1.5)));
    let id = request(&pool, &req(&s, QUESTION)).await;
    let e = engine(&pool, "w-stream", handler);
    let watch = async {
        let seen_then = first_delta(&pool, id).await;
        gate.notify_one();
        seen_then
    };
    let (j, (then, stage_then, partials_then)) = tokio::join!(run_until_settled(&s, &e, id), watch);
    assert_eq!(j.stage, "completed", "{j:?}");

    // While the model was still answering, a reader saw the first delta: committed on its own,
    // after the attempt's claim, with the task still generating and no result yet.
    assert_eq!((stage_then.as_str(), partials_then), ("generating", 0));
    let first = then.last().unwrap();
    assert_eq!(first.1, "research_task.answer_delta");
    assert_eq!(first.4["delta"], "Fencing");
    assert_eq!(first.4["offset"], 0);
    assert!(then.iter().any(is_claim));

    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    assert_eq!(advances(&evs), ADVANCES.to_vec());
    let attempt = last_attempt(&evs);
    let stored = answer(&pool, id).await.unwrap();
    let said = format!("Fencing will use the lease token{long} [1].");
    assert_eq!(stored, said);
    assert_eq!(reassemble(&evs, attempt), stored);
    // The first piece at once, then a batch of at least 128 units, then the rest at the end.
    let ds = deltas_of(&evs, attempt);
    let texts: Vec<&str> = ds.iter().map(|e| e.4["delta"].as_str().unwrap()).collect();
    assert_eq!(texts.len(), 3, "{texts:?}");
    assert_eq!(texts[0], "Fencing");
    assert!(texts[1].encode_utf16().count() >= 128, "{texts:?}");
    assert_eq!(texts[2], " [1].");
    for d in &ds {
        assert_eq!(
            d.3,
            format!(
                "research-task-progress:{id}:attempt:{attempt}:answer:{}",
                d.4["offset"]
            )
        );
    }
    // All of them before the completion, which is the last event.
    let completed = evs.iter().position(|e| e.2 == "completed").unwrap();
    assert_eq!(completed, evs.len() - 1);
    assert!(ds.iter().all(|d| d.0 < evs[completed].0));
    // The usage the stream reported is what the call cost.
    assert_eq!(seen.lock().unwrap()[0].body["stream"], true);
    assert_eq!(j.cost["entries"][0]["usage"]["promptTokens"], 900);
    assert_eq!(j.cost["entries"][0]["usage"]["estimated"], false);
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delta_that_finds_its_fence_gone_stops_the_answer_and_a_retry_streams_again_from_offset_0(
) {
    let s = seed("stream-fence").await;
    let pool = s.pool().clone();
    let gate = Arc::new(tokio::sync::Notify::new());
    let long = " on every write, and a worker whose lease was lost finds every write refused, \
        because the fence compares the lease token and the row version each time it writes";
    let (base, seen) = sse_stand_in(vec![
        vec![
            piece("Fencing"),
            Sse::Gate(gate.clone()),
            piece(long),
            piece(" [1]."),
            Sse::End {
                prompt_tokens: 900,
                completion_tokens: 60,
            },
        ],
        vec![
            piece("A lease"),
            piece(" will expire after thirty seconds [2]."),
            Sse::End {
                prompt_tokens: 900,
                completion_tokens: 12,
            },
        ],
    ])
    .await;
    let handler: Arc<dyn Handler> =
        Arc::new(ResearchHandler::with_generator(openai(&base, 0.0, 0.0)));
    // Walked to `generating` by hand (attempt 1), then let go.
    let id = request(&pool, &req(&s, QUESTION)).await;
    let mut ctx = claim_by_hand(&pool, id, "w-hand").await;
    for _ in 0..4 {
        step_by_hand(&pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(ctx.checkpoint, "generating");
    expire(&pool, id).await;

    // A worker with a one-second lease claims it (attempt 2) and streams the first delta. Its
    // step's transaction idles past the lease and is ended by Postgres, which lets a pause in;
    // then the model goes on, and the next delta finds the task paused.
    let mut cfg = ConsumerConfig::default();
    cfg.policies.insert(
        Kind::Research,
        Policy {
            lease: Duration::from_secs(1),
            ..RESEARCH.policy
        },
    );
    let short = Engine::new(pool.clone(), "w-short", vec![handler.clone()], cfg);
    let pause_then_go = async {
        let (evs, stage, _) = first_delta(&pool, id).await;
        assert_eq!(stage, "generating");
        let mut conn = pool.acquire().await.unwrap();
        let paused = control::pause(&mut conn, id).await.unwrap();
        assert!(paused.changed);
        gate.notify_one();
        evs
    };
    let (handled, then) = tokio::join!(deliver(&s, &short), pause_then_go);
    assert!(handled.is_some());
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    let cut = last_attempt(&then);
    assert_eq!(cut, 2);
    let ds = deltas_of(&evs, cut);
    assert_eq!(ds.len(), 1, "nothing after the fence was lost: {ds:#?}");
    assert_eq!(
        (ds[0].4["delta"].as_str(), ds[0].4["offset"].as_i64()),
        (Some("Fencing"), Some(0))
    );
    assert!(partials(&pool, id).await.is_empty(), "no answer stored");
    let j = job(&pool, id).await;
    assert_eq!(j.stage, "paused", "{j:?}");
    assert!(j.metadata.get("result").is_none());
    assert_eq!(advances(&evs), ADVANCES[..4].to_vec(), "no completion");

    // Resumed, the next attempt streams its own answer from offset 0, under its own number; the
    // cut attempt's delta stays, told apart by its attempt.
    let mut conn = pool.acquire().await.unwrap();
    control::resume(&mut conn, id).await.unwrap();
    drop(conn);
    let e = engine(&pool, "w-after", handler);
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "completed", "{j:?}");
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    let attempt = last_attempt(&evs);
    assert!(attempt > cut, "{attempt}");
    let stored = answer(&pool, id).await.unwrap();
    assert_eq!(stored, "A lease will expire after thirty seconds [2].");
    assert_eq!(reassemble(&evs, attempt), stored);
    assert_eq!(deltas_of(&evs, attempt)[0].4["offset"], 0);
    assert_eq!(reassemble(&evs, cut), "Fencing");
    assert_eq!(seen.lock().unwrap().len(), 2);
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_space_fenced_while_a_model_answers_fails_the_task_with_capability_revoked() {
    let s = seed("stream-grant").await;
    let pool = s.pool().clone();
    let long = " on every write, and a worker whose lease was lost finds every write refused, \
        because the fence compares the lease token and the row version each time it writes";
    // (what the model says after the fence: more text, which its next delta carries; or
    // nothing, so that only the check before completing sees the fence)
    for more in [Some(long), None] {
        let gate = Arc::new(tokio::sync::Notify::new());
        let mut script = vec![piece("Fencing [1]."), Sse::Gate(gate.clone())];
        script.extend(more.map(piece));
        script.push(Sse::End {
            prompt_tokens: 900,
            completion_tokens: 60,
        });
        let (base, _) = sse_stand_in(vec![script]).await;
        let handler = Arc::new(ResearchHandler::with_generator(openai(&base, 0.0, 0.0)));
        let g = grant(&s, s.space, "app-user-7", &[]).await;
        let id = request(&pool, &ResearchRequest::under_grant(s.space, QUESTION, g)).await;
        let e = engine(&pool, "w-stream-grant", handler);
        let fence_then_go = async {
            first_delta(&pool, id).await;
            // No fence row yet: putting one on the space does not wait for the step.
            let mut conn = pool.acquire().await.unwrap();
            platform::fence_capability_space(&mut conn, TENANT, s.space)
                .await
                .unwrap();
            gate.notify_one();
        };
        let (j, ()) = tokio::join!(run_until_settled(&s, &e, id), fence_then_go);
        assert_eq!(j.stage, "failed", "{more:?}: {j:?}");
        assert!(
            j.error
                .as_deref()
                .unwrap()
                .starts_with(&format!("{REVOKED}: ")),
            "{j:?}"
        );
        assert!(partials(&pool, id).await.is_empty());
        let evs = events(&pool, id).await;
        assert_contiguous(id, &evs);
        let sh = shape(&evs);
        assert_eq!(
            sh.last().unwrap(),
            &("failed".into(), "failed".into(), json!({"error": REVOKED}))
        );
        assert_eq!(advances(&evs), ADVANCES[..4].to_vec(), "no completion");
        // Only what was streamed before the fence.
        assert_eq!(reassemble(&evs, last_attempt(&evs)), "Fencing [1].");
        sqlx::query("DELETE FROM capability_space_fences WHERE knowledge_space_id = $1")
            .bind(s.space)
            .execute(&pool)
            .await
            .unwrap();
    }
    s.fx.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// The command line

fn kfs(fx: &SpaceFx, args: &[&str], extra: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"));
    cmd.args(args);
    for (k, v) in fx.env.worker_env() {
        cmd.env(k, v);
    }
    cmd.env_remove("RUST_LOG");
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd.output().expect("run kfs-worker")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_command_line_requests_controls_and_follows_a_task() {
    let s = seed("cli").await;
    let pool = s.pool().clone();
    let (space, snapshot) = (s.space.to_string(), s.snapshot.to_string());
    let out = kfs(
        &s,
        &[
            "research",
            &space,
            QUESTION,
            "--subject",
            SUBJECT,
            "--snapshot",
            &snapshot,
            "--top-k",
            "5",
            "--mode",
            "research",
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id =
        Uuid::parse_str(String::from_utf8_lossy(&out.stdout).trim()).expect("the job id alone");
    let (top_k, mode): (Option<i32>, Option<String>) =
        sqlx::query_as("SELECT top_k, mode FROM research_task_jobs WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((top_k, mode.as_deref()), (Some(5), Some("research")));

    let id_s = id.to_string();
    for (args, stage) in [
        (
            vec!["research", "pause", &id_s, "--reason", "coffee"],
            "paused",
        ),
        (vec!["research", "resume", &id_s], "queued"),
    ] {
        let out = kfs(&s, &args, &[]);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(job(&pool, id).await.stage, stage);
    }
    assert_eq!(events(&pool, id).await[1].4, json!({"reason": "coffee"}));

    // Follow while a worker runs it: every event, in order, one plain line each, then exit.
    let follower = {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"));
        cmd.args(["research", "follow", &id_s, "--poll", "50ms"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        for (k, v) in s.env.worker_env() {
            cmd.env(k, v);
        }
        cmd.spawn().unwrap()
    };
    let e = engine(&pool, "w-cli", extractive());
    assert_eq!(run_until_settled(&s, &e, id).await.stage, "completed");
    let out = tokio::task::spawn_blocking(move || follower.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    let evs = events(&pool, id).await;
    assert_eq!(lines.len(), evs.len(), "{stdout}");
    for (line, ev) in lines.iter().zip(&evs) {
        let f: Vec<&str> = line.split('\t').collect();
        assert_eq!(f[0], ev.0.to_string());
        assert_eq!(f[2], ev.1);
        assert_eq!(f[3], ev.2);
        assert_eq!(serde_json::from_str::<Value>(f[4]).unwrap(), ev.4);
    }

    let out = kfs(&s, &["research", "show", &id_s], &[]);
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["stage"], "completed");
    assert_eq!(shown["answer"].as_str(), answer(&pool, id).await.as_deref());
    assert!(shown["answer"].is_string());
    assert_eq!(shown["evidence"]["traceId"], json!(id_s));
    assert_eq!(shown["publication"]["tenantId"], TENANT);

    // Bad input and refusals: one error line, exit 2, nothing written.
    let jobs_before: i64 = sqlx::query_scalar("SELECT count(*) FROM research_task_jobs")
        .fetch_one(&pool)
        .await
        .unwrap();
    let bad: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "research",
                "not-a-uuid",
                QUESTION,
                "--subject",
                SUBJECT,
                "--snapshot",
                &snapshot,
            ],
            "space id",
        ),
        (
            vec!["research", &space, QUESTION, "--snapshot", &snapshot],
            "--subject",
        ),
        (
            vec![
                "research",
                &space,
                QUESTION,
                "--subject",
                SUBJECT,
                "--snapshot",
                &snapshot,
                "--budget-usd",
                "lots",
            ],
            "--budget-usd",
        ),
        (
            vec![
                "research",
                &space,
                QUESTION,
                "--subject",
                "mallory",
                "--snapshot",
                &snapshot,
            ],
            "another subject",
        ),
        (vec!["research", "cancel", &id_s], "already ended"),
        (vec!["research", "pause", "nope"], "job id"),
    ];
    for (args, needle) in bad {
        let out = kfs(&s, &args, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.starts_with("error: ") && err.contains(needle),
            "{args:?}: {err}"
        );
    }
    let jobs_after: i64 = sqlx::query_scalar("SELECT count(*) FROM research_task_jobs")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(jobs_before, jobs_after);

    // A malformed generator setting stops a worker at start, naming the variable.
    let out = kfs(
        &s,
        &["run", "--kinds", "research"],
        &[
            ("KFS_GENERATOR", "openai"),
            ("KFS_OPENAI_API_KEY", "sk-never-printed"),
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("KFS_OPENAI_MODEL"), "{err}");
    assert!(!err.contains("sk-never-printed"), "{err}");
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_command_line_asks_under_a_grant_and_refuses_both_or_neither_authority() {
    let fx = SpaceFx::new(TENANT, "cli-grant", "Docs").await;
    let pool = fx.pool().clone();
    let snapshot = fx.snapshot(SUBJECT).await.to_string();
    let g = grant(&fx, fx.space, "app-user-7", &[]).await;
    let (space, g_s) = (fx.space.to_string(), g.to_string());
    let out = kfs(&fx, &["research", &space, QUESTION, "--grant", &g_s], &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id =
        Uuid::parse_str(String::from_utf8_lossy(&out.stdout).trim()).expect("the job id alone");
    assert_eq!(binding(&pool, id).await, (Some(g), None, None, None, None));
    let shown: Value =
        serde_json::from_slice(&kfs(&fx, &["research", "show", &id.to_string()], &[]).stdout)
            .unwrap();
    assert_eq!(shown["capabilityGrantId"], json!(g));
    assert_eq!(shown["subjectId"], Value::Null);

    let revoked = grant(&fx, fx.space, "app-user-7", &[]).await;
    let mut conn = pool.acquire().await.unwrap();
    platform::revoke_capability_grant(&mut conn, TENANT, fx.space, revoked)
        .await
        .unwrap();
    drop(conn);
    let revoked = revoked.to_string();
    let bad: Vec<(Vec<&str>, &str)> =
        vec![
        (
            vec![
                "research", &space, QUESTION, "--grant", &g_s, "--subject", SUBJECT, "--snapshot",
                &snapshot,
            ],
            "exactly one authority: --subject <s> --snapshot <id>, or --grant <id>; --grant cannot",
        ),
        (
            vec!["research", &space, QUESTION],
            "exactly one authority: --subject <s> --snapshot <id>, or --grant <id>; none",
        ),
        (
            vec!["research", &space, QUESTION, "--grant", &g_s, "--channel", "mcp"],
            "--channel",
        ),
        (vec!["research", &space, QUESTION, "--grant", "g-1"], "--grant must be a UUID"),
        (vec!["research", &space, QUESTION, "--grant", &revoked], "is revoked"),
    ];
    for (args, needle) in bad {
        let out = kfs(&fx, &args, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.starts_with("error: ") && err.contains(needle),
            "{args:?}: {err}"
        );
    }
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM research_task_jobs")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(jobs, 1, "refusals wrote nothing");
    fx.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// Workers killed at each kill point

#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_at_each_kill_point_leaves_a_walk_another_finishes() {
    let s = seed("kill").await;
    let pool = s.pool().clone();
    let env = &s.env;
    let common_env = [
        ("KFS_RELAY_POLL", "100ms"),
        ("KFS_SLICE_STEPS", "1"),
        ("KFS_GENERATOR", "extractive"),
    ];
    for point in ["after-claim-commit", "after-step-commit:2", "before-ack:2"] {
        let id = request(&pool, &req(&s, QUESTION)).await;
        let mut extra = common_env.to_vec();
        extra.push(("KFS_CRASH_AT", point));
        let mut doomed = env.spawn_worker(
            "doomed",
            &[
                "run",
                "--kinds",
                "research",
                "--worker-id",
                &format!("doomed-{point}"),
            ],
            &extra,
        );
        let (status, doomed) = tokio::task::spawn_blocking(move || {
            let s = doomed.wait_exit(Duration::from_secs(60));
            (s, doomed)
        })
        .await
        .unwrap();
        let status =
            status.unwrap_or_else(|| panic!("did not crash at {point}:\n{}", doomed.log_text()));
        assert!(!status.success(), "{point}: {status:?}");
        assert!(
            doomed.log_text().contains("crash point"),
            "{}",
            doomed.log_text()
        );
        let mid = job(&pool, id).await;
        assert_ne!(
            mid.stage, "completed",
            "{point}: crashed too late to matter"
        );

        let mut rescuer = env.spawn_worker(
            "rescuer",
            &[
                "run",
                "--kinds",
                "research",
                "--worker-id",
                &format!("rescuer-{point}"),
            ],
            &common_env,
        );
        let p = pool.clone();
        let done = env
            .wait_until(Duration::from_secs(60), || {
                let p = p.clone();
                async move { job(&p, id).await.stage == "completed" }
            })
            .await;
        assert!(
            done,
            "{point}: {:?}\n{}",
            job(&pool, id).await,
            rescuer.log_text()
        );
        support::stop_cleanly([&mut rescuer], Duration::from_secs(20)).await;

        let evs = events(&pool, id).await;
        assert_contiguous(id, &evs);
        assert_eq!(advances(&evs), ADVANCES.to_vec(), "{point}");
        // One claim event per execution attempt, in order.
        let attempts: Vec<i64> = evs
            .iter()
            .filter(|e| is_claim(e))
            .map(|e| e.4["executionAttempt"].as_i64().unwrap())
            .collect();
        assert!(
            !attempts.is_empty() && attempts.windows(2).all(|w| w[0] < w[1]),
            "{point}: {attempts:?}"
        );
        bundle(&pool, id).await;
        assert!(answer(&pool, id).await.is_some());
    }
    s.fx.cleanup().await;
}
