//! research.task against real Postgres and RabbitMQ: the whole walk, replayed steps, pause in
//! each stage, cancel, the budget, a revoked snapshot mid-run, tenant isolation, the HTTP
//! generator against a local stand-in, the command line, and workers killed at each kill point.
//!
//! Knowledge is seeded directly (nodes + projections under a generation, published by moving the
//! space's head with `publication::create` + `swap_head`), so these tests do not depend on the
//! compile handler. Jobs are driven in-process (a real relay round, the message taken off the
//! queue, `Engine::process`) or by hand through the engine's own lease API, or by spawned
//! workers.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::TestEnv;
use kfs_worker::consumer::lease::{self, Claim, DeliveryRef, End, Statements};
use kfs_worker::consumer::{ConsumerConfig, Engine, Handled};
use kfs_worker::jobs::research::generator::{
    ExtractiveGenerator, Generator, OpenAiConfig, OpenAiGenerator, NO_EVIDENCE_ANSWER,
};
use kfs_worker::jobs::research::{
    self, control, walk::Refusal, ControlError, RequestError, ResearchHandler, ResearchRequest,
};
use kfs_worker::jobs::{Handler, JobCtx, JobError, Kind, Step, RESEARCH};
use kfs_worker::publication::{self, Member, Members};
use kfs_worker::relay::{Relay, RelayConfig};
use lapin::options::BasicGetOptions;
use serde_json::{json, Value};
use sqlx::{PgConnection, PgPool};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const HANG: Duration = Duration::from_secs(60);
const TENANT: &str = "t-acme";
const OTHER_TENANT: &str = "t-other";
const SUBJECT: &str = "alice";
const QUESTION: &str = "How does fencing use the lease token, and when does a lease expire?";

// ---------------------------------------------------------------------------------------------
// Seeding

struct Seeded {
    space: Uuid,
    snapshot: Uuid,
    /// The documents published in the space: leases.md, fencing.md, cooking.md.
    docs: Vec<Uuid>,
    /// Nodes in the space whose generation is not published.
    unpublished_nodes: Vec<Uuid>,
    other_space: Uuid,
    other_nodes: Vec<Uuid>,
}

async fn insert_document(conn: &mut PgConnection, space: Uuid, filename: &str) -> Uuid {
    let id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO document_assets (id, knowledge_space_id, source_id, filename, mime_type, object_key, sha256, \
           size_bytes, version, parser_status, metadata, created_at, updated_at) \
         VALUES ($1, $2, NULL, $3, 'text/markdown', $4, repeat('0', 64), 0, 1, 'parsed', '{}'::jsonb, now(), now())",
    )
    .bind(id)
    .bind(space)
    .bind(filename)
    .bind(format!("spaces/{space}/documents/{id}/v1/{filename}"))
    .execute(conn)
    .await
    .unwrap();
    id
}

/// Writes nodes and their projections under `generation`. Returns the node ids.
async fn insert_nodes(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    doc: Uuid,
    generation: Uuid,
    contents: &[&str],
) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for (i, content) in contents.iter().enumerate() {
        let node = Uuid::now_v7();
        sqlx::query(
            "INSERT INTO knowledge_nodes (id, tenant_id, knowledge_space_id, document_asset_id, document_version, \
               publication_generation_id, ordinal, heading_path, content, content_sha256, token_count, metadata, created_at) \
             VALUES ($1, $2, $3, $4, 1, $5, $6, $7, $8, repeat('0', 64), 10, '{}'::jsonb, now())",
        )
        .bind(node)
        .bind(tenant)
        .bind(space)
        .bind(doc)
        .bind(generation)
        .bind(i32::try_from(i).unwrap())
        .bind(json!(["Section", i]))
        .bind(*content)
        .execute(&mut *conn)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO index_projections (id, tenant_id, knowledge_space_id, document_asset_id, \
               publication_generation_id, node_id, search_vector, created_at) \
             VALUES (gen_random_uuid(), $1, $2, $3, $4, $5, to_tsvector('english', $6), now())",
        )
        .bind(tenant)
        .bind(space)
        .bind(doc)
        .bind(generation)
        .bind(node)
        .bind(*content)
        .execute(&mut *conn)
        .await
        .unwrap();
        ids.push(node);
    }
    ids
}

async fn publish(conn: &mut PgConnection, tenant: &str, space: Uuid, members: Members) {
    let (publication_id, _) = publication::create(conn, tenant, space, &members, json!({}))
        .await
        .unwrap();
    publication::swap_head(conn, tenant, space, 0, publication_id)
        .await
        .unwrap()
        .expect("head moved");
}

async fn seed(pool: &PgPool) -> Seeded {
    let mut conn = pool.acquire().await.unwrap();
    let c = &mut *conn;
    let space = kfs_worker::platform::create_space(c, TENANT, "docs", "Docs")
        .await
        .unwrap();
    let snapshot = kfs_worker::platform::create_permission_snapshot(
        c,
        TENANT,
        space,
        SUBJECT,
        "interactive",
        None,
    )
    .await
    .unwrap();

    let leases = insert_document(c, space, "leases.md").await;
    let fencing = insert_document(c, space, "fencing.md").await;
    let cooking = insert_document(c, space, "cooking.md").await;
    let (g1, g2, g3, g_old) = (
        Uuid::now_v7(),
        Uuid::now_v7(),
        Uuid::now_v7(),
        Uuid::now_v7(),
    );
    insert_nodes(
        c,
        TENANT,
        space,
        leases,
        g1,
        &[
            "Workers hold a lease on each job. A lease expires after thirty seconds unless a heartbeat extends it.",
            "The heartbeat runs every ten seconds while the worker is alive.",
        ],
    )
    .await;
    insert_nodes(
        c,
        TENANT,
        space,
        fencing,
        g2,
        &["Fencing compares the lease token and the row version on every write. A worker whose lease was lost finds every write refused."],
    )
    .await;
    insert_nodes(
        c,
        TENANT,
        space,
        cooking,
        g3,
        &["Bake the bread at two hundred degrees for forty minutes."],
    )
    .await;
    // An older generation of fencing.md, never published: it must never be found.
    let unpublished_nodes = insert_nodes(
        c,
        TENANT,
        space,
        fencing,
        g_old,
        &["Outdated fencing notes: the lease token quokka was once ignored."],
    )
    .await;
    let members: Members = [
        (
            leases,
            Member {
                generation: g1,
                version: 1,
            },
        ),
        (
            fencing,
            Member {
                generation: g2,
                version: 1,
            },
        ),
        (
            cooking,
            Member {
                generation: g3,
                version: 1,
            },
        ),
    ]
    .into_iter()
    .collect();
    publish(c, TENANT, space, members).await;

    // Another tenant's space with the very same words (and a word only it has), published.
    let other_space = kfs_worker::platform::create_space(c, OTHER_TENANT, "docs", "Docs")
        .await
        .unwrap();
    let other_doc = insert_document(c, other_space, "secret.md").await;
    let g_other = Uuid::now_v7();
    let other_nodes = insert_nodes(
        c,
        OTHER_TENANT,
        other_space,
        other_doc,
        g_other,
        &["OTHER-TENANT-SECRET: fencing compares the lease token; a lease expires; the quokka knows."],
    )
    .await;
    publish(
        c,
        OTHER_TENANT,
        other_space,
        [(
            other_doc,
            Member {
                generation: g_other,
                version: 1,
            },
        )]
        .into_iter()
        .collect(),
    )
    .await;

    Seeded {
        space,
        snapshot,
        docs: vec![leases, fencing, cooking],
        unpublished_nodes,
        other_space,
        other_nodes,
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
    let (stage, paused_from, error, row_version, lease_token, metadata, cost): (
        String,
        Option<String>,
        Option<String>,
        i32,
        Option<Uuid>,
        Value,
        Value,
    ) = sqlx::query_as(
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

/// (sequence, event_type, stage, idempotency_key, payload)
async fn events(pool: &PgPool, id: Uuid) -> Vec<(i32, String, String, String, Value)> {
    sqlx::query_as(
        "SELECT sequence, event_type, stage, idempotency_key, payload FROM research_task_progress_events \
         WHERE research_task_job_id = $1 ORDER BY sequence",
    )
    .bind(id)
    .fetch_all(pool)
    .await
    .unwrap()
}

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

/// Sequences 1..n, keys of the documented shape, one event per key.
fn assert_contiguous(id: Uuid, evs: &[(i32, String, String, String, Value)]) {
    for (i, (seq, ty, _, key, _)) in evs.iter().enumerate() {
        assert_eq!(*seq, i32::try_from(i).unwrap() + 1, "sequences: {evs:#?}");
        let prefix = format!("research-task-progress:{id}:");
        assert!(
            key.starts_with(&prefix) && key.ends_with(&format!(":{ty}")),
            "{key}"
        );
    }
    let mut keys: Vec<&String> = evs.iter().map(|e| &e.3).collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), evs.len(), "a key repeats: {evs:#?}");
}

fn types(evs: &[(i32, String, String, String, Value)]) -> Vec<String> {
    evs.iter()
        .map(|e| e.1.trim_start_matches("research_task.").to_owned())
        .collect()
}

fn stages(evs: &[(i32, String, String, String, Value)]) -> Vec<&str> {
    evs.iter().map(|e| e.2.as_str()).collect()
}

const WALK: [&str; 6] = [
    "queued",
    "planning",
    "retrieving",
    "analyzing",
    "generating",
    "completed",
];

// ---------------------------------------------------------------------------------------------
// Driving

fn engine(env: &TestEnv, worker: &str, handler: Arc<dyn Handler>) -> Engine {
    Engine::new(
        env.pool.clone(),
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

/// One real relay round; the published message taken off the queue and handed to the engine.
/// `None`: nothing was due.
async fn deliver(env: &TestEnv, engine: &Engine) -> Option<Handled> {
    let relay = Relay::new(
        env.pool.clone(),
        env.topology.clone(),
        "test-relay",
        RelayConfig::default(),
        &[Kind::Research],
    );
    let round = relay
        .relay_once(&env.confirm_channel().await, Kind::Research)
        .await
        .expect("relay round");
    if round.dispatched == 0 {
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
async fn run_until_settled(env: &TestEnv, engine: &Engine, id: Uuid) -> JobState {
    for _ in 0..40 {
        let j = job(&env.pool, id).await;
        if matches!(
            j.stage.as_str(),
            "completed" | "failed" | "canceled" | "paused"
        ) {
            return j;
        }
        if deliver(env, engine).await.is_none() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    panic!("job {id} did not settle: {:?}", job(&env.pool, id).await);
}

/// Puts the job's live outbox row out for delivery as the relay's mark would, and claims it
/// with the engine's own claim. The context a worker holds.
async fn claim(env: &TestEnv, id: Uuid, worker: &str) -> JobCtx {
    let (outbox_id, delivery_id): (Uuid, String) = sqlx::query_as(
        "UPDATE research_task_outbox SET status = 'dispatched', queue_job_id = gen_random_uuid()::text, \
           dispatch_attempts = dispatch_attempts + 1, \
           available_at = (extract(epoch from now()) * 1000)::bigint + 300000, updated_at = (extract(epoch from now()) * 1000)::bigint \
         WHERE research_task_job_id = $1 AND status = 'pending' RETURNING id, queue_job_id",
    )
    .bind(id)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    let d = DeliveryRef {
        kind: Kind::Research,
        job_id: id,
        outbox_id,
        delivery_id,
    };
    let mut conn = env.pool.acquire().await.unwrap();
    match lease::claim(
        &mut conn,
        &Statements::new(&RESEARCH),
        &d,
        worker,
        Duration::from_secs(30),
    )
    .await
    .unwrap()
    {
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
    let Some(rv) = lease::fence(&mut tx, &st, ctx).await.unwrap() else {
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
    match &step {
        Step::Advance(cp) => {
            ctx.row_version = lease::advance(&mut tx, &st, ctx, cp)
                .await
                .unwrap()
                .expect("ours");
            ctx.checkpoint = cp.clone();
        }
        Step::Succeed(cp) => {
            assert!(lease::end(
                &mut tx,
                &st,
                ctx,
                &End::Succeed {
                    checkpoint: cp.clone()
                }
            )
            .await
            .unwrap());
        }
        Step::Cancel { code, message } => {
            assert!(lease::end(
                &mut tx,
                &st,
                ctx,
                &End::Cancel {
                    code: code.clone(),
                    message: message.clone()
                }
            )
            .await
            .unwrap());
        }
        other => panic!("research never returns {other:?}"),
    }
    tx.commit().await.unwrap();
    Ok(Some(step))
}

// ---------------------------------------------------------------------------------------------
// The whole walk

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_whole_walk_answers_from_published_knowledge_with_ordered_events() {
    let env = TestEnv::new().await;
    let s = seed(&env.pool).await;
    let id = request(&env.pool, &req(&s, QUESTION)).await;

    // As requested: queued, version 1, no attempt yet, revision 1 pending, the started event.
    let j = job(&env.pool, id).await;
    assert_eq!((j.stage.as_str(), j.row_version), ("queued", 1));
    let (tenant, attempts, max, rev): (String, i32, i32, i32) = sqlx::query_as(
        "SELECT tenant_id, execution_attempts, max_execution_attempts, permission_snapshot_revision \
         FROM research_task_jobs WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!((tenant.as_str(), attempts, max, rev), (TENANT, 0, 5, 1));
    assert_eq!(
        outbox(&env.pool, id).await,
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
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(payload, json!({ "researchTaskJobId": id }));
    let evs = events(&env.pool, id).await;
    assert_eq!(types(&evs), vec!["started"]);
    assert_eq!(
        evs[0].3,
        format!("research-task-progress:{id}:1:research_task.started")
    );

    let e = engine(&env, "w-walk", extractive());
    let j = run_until_settled(&env, &e, id).await;
    assert_eq!(j.stage, "completed", "{j:?}");
    assert_eq!(j.lease_token, None);

    let evs = events(&env.pool, id).await;
    assert_contiguous(id, &evs);
    assert_eq!(
        types(&evs),
        vec![
            "started",
            "stage_changed",
            "stage_changed",
            "stage_changed",
            "stage_changed",
            "stage_changed"
        ]
    );
    assert_eq!(stages(&evs), WALK.to_vec());
    for w in evs.windows(2).skip(1) {
        assert_eq!(w[1].4["from"], json!(w[0].2), "from/to chain: {evs:#?}");
    }

    // The plan: the whole question and its two clauses.
    let plan = &j.metadata["plan"]["subQueries"];
    assert_eq!(plan.as_array().unwrap().len(), 3, "{plan}");

    // Evidence partials: one per sub-query, then the ranked set, then the answer; contiguous.
    let ps = partials(&env.pool, id).await;
    let kinds: Vec<&str> = ps.iter().map(|p| p.2["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        vec!["retrieval", "retrieval", "retrieval", "ranked", "answer"]
    );
    for (i, p) in ps.iter().enumerate() {
        assert_eq!(p.0, i32::try_from(i).unwrap() + 1);
        assert!(p.1.starts_with(&format!("research-task-partial:{id}:")));
    }
    let ranked = ps[3].2["evidence"].as_array().unwrap();
    assert!(!ranked.is_empty());
    let all_text = serde_json::to_string(&ps).unwrap();
    assert!(
        !all_text.contains("OTHER-TENANT-SECRET"),
        "another tenant's text leaked"
    );
    assert!(
        !all_text.contains("quokka"),
        "an unpublished generation leaked"
    );
    assert!(
        !all_text.contains("bread"),
        "irrelevant node retrieved: {all_text}"
    );

    // The answer cites the seeded documents it quotes.
    let result = &j.metadata["result"];
    let answer = result["answer"].as_str().unwrap();
    assert!(
        answer.contains("Fencing compares the lease token"),
        "{answer}"
    );
    assert!(answer.contains('['), "{answer}");
    let cited: Vec<Uuid> = result["citations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Uuid::parse_str(c["documentId"].as_str().unwrap()).unwrap())
        .collect();
    assert!(cited.contains(&s.docs[1]), "fencing.md cited: {result}");
    assert!(cited.contains(&s.docs[0]), "leases.md cited: {result}");
    assert!(!cited.contains(&s.docs[2]));
    assert_eq!(result["generator"], "extractive");
    assert_eq!(j.cost["usd"], json!(0.0));
    assert_eq!(
        outbox(&env.pool, id)
            .await
            .iter()
            .map(|o| o.1.as_str())
            .collect::<Vec<_>>(),
        vec!["completed"]
    );

    // A late duplicate of the finished job's delivery changes nothing.
    let before = (
        events(&env.pool, id).await.len(),
        partials(&env.pool, id).await.len(),
    );
    assert!(deliver(&env, &e).await.is_none(), "nothing is due any more");
    assert_eq!(
        before,
        (
            events(&env.pool, id).await.len(),
            partials(&env.pool, id).await.len()
        )
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn another_tenants_space_and_unpublished_generations_are_never_searched() {
    let env = TestEnv::new().await;
    let s = seed(&env.pool).await;
    // Only the other tenant's space and our unpublished generation have "quokka".
    let id = request(&env.pool, &req(&s, "What does the quokka know?")).await;
    let e = engine(&env, "w-iso", extractive());
    let j = run_until_settled(&env, &e, id).await;
    assert_eq!(j.stage, "completed", "{j:?}");
    let ps = partials(&env.pool, id).await;
    for p in &ps {
        if p.2["kind"] == "retrieval" {
            assert_eq!(p.2["hits"], json!([]), "found: {}", p.2);
        }
    }
    let text = serde_json::to_string(&ps).unwrap();
    for n in s.other_nodes.iter().chain(&s.unpublished_nodes) {
        assert!(!text.contains(&n.to_string()));
    }
    assert!(!text.contains(&s.other_space.to_string()));
    assert_eq!(j.metadata["result"]["answer"], NO_EVIDENCE_ANSWER);
    assert_eq!(j.metadata["result"]["citations"], json!([]));

    // And the words both spaces share find only ours.
    let id = request(&env.pool, &req(&s, "fencing lease token")).await;
    let j = run_until_settled(&env, &e, id).await;
    assert_eq!(j.stage, "completed");
    let text = serde_json::to_string(&partials(&env.pool, id).await).unwrap();
    assert!(text.contains("Fencing compares"));
    assert!(!text.contains("OTHER-TENANT-SECRET"));
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// Replays

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replayed_step_adds_no_event_and_no_partial() {
    let env = TestEnv::new().await;
    let s = seed(&env.pool).await;
    let id = request(&env.pool, &req(&s, QUESTION)).await;
    let handler = extractive();
    let st = Statements::new(&RESEARCH);
    let mut ctx = claim(&env, id, "w-replay").await;
    loop {
        // First run: effects commit, but (as if the process died) the stage does not move.
        let mut tx = env.pool.begin().await.unwrap();
        let rv = lease::fence(&mut tx, &st, &ctx)
            .await
            .unwrap()
            .expect("ours");
        ctx.row_version = rv;
        let first = handler.step(&mut tx, &ctx).await.unwrap();
        tx.commit().await.unwrap();
        let counts = (
            events(&env.pool, id).await.len(),
            partials(&env.pool, id).await.len(),
        );

        // The replay, with the same row version, then the stage moves with it.
        let mut tx = env.pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM research_task_jobs WHERE id = $1 FOR UPDATE")
            .bind(id)
            .execute(&mut *tx)
            .await
            .unwrap();
        let again = handler.step(&mut tx, &ctx).await.unwrap();
        assert_eq!(first, again, "a replay decides the same");
        match &again {
            Step::Advance(cp) => {
                ctx.row_version = lease::advance(&mut tx, &st, &ctx, cp)
                    .await
                    .unwrap()
                    .expect("ours");
                ctx.checkpoint = cp.clone();
            }
            Step::Succeed(cp) => {
                assert!(lease::end(
                    &mut tx,
                    &st,
                    &ctx,
                    &End::Succeed {
                        checkpoint: cp.clone()
                    }
                )
                .await
                .unwrap());
            }
            other => panic!("unexpected {other:?}"),
        }
        tx.commit().await.unwrap();
        assert_eq!(
            counts,
            (
                events(&env.pool, id).await.len(),
                partials(&env.pool, id).await.len()
            ),
            "the replay of the step at {} added rows",
            ctx.checkpoint
        );
        if matches!(again, Step::Succeed(_)) {
            break;
        }
    }
    assert_eq!(job(&env.pool, id).await.stage, "completed");
    let evs = events(&env.pool, id).await;
    assert_contiguous(id, &evs);
    assert_eq!(stages(&evs), WALK.to_vec());
    assert_eq!(partials(&env.pool, id).await.len(), 5);
    env.cleanup().await;
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
    let env = TestEnv::new().await;
    let s = seed(&env.pool).await;
    for stage in ["planning", "retrieving", "analyzing", "generating"] {
        let id = request(&env.pool, &req(&s, QUESTION)).await;
        let pauser = Arc::new(PauseDuring {
            inner: extractive(),
            stage: stage.into(),
            pool: env.pool.clone(),
            fired: AtomicBool::new(false),
            pause: Mutex::new(None),
            paused: Mutex::new(None),
        });
        let e = Engine::new(
            env.pool.clone(),
            format!("w-pause-{stage}"),
            vec![pauser.clone() as Arc<dyn Handler>],
            ConsumerConfig::default(),
        );
        // Up to the stage: the walk goes queued → planning → ... in one slice, and the pause
        // lands between the step at `stage` and the next one.
        let handled = deliver(&env, &e).await.expect("a delivery");
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
            assert_eq!(job(&env.pool, id).await.stage, "completed");
            assert_contiguous(id, &events(&env.pool, id).await);
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

        let j = job(&env.pool, id).await;
        assert_eq!(j.stage, "paused");
        assert_eq!(j.paused_from.as_deref(), Some(next.as_str()));
        assert_eq!(j.lease_token, None);
        assert_eq!(
            outbox(&env.pool, id)
                .await
                .iter()
                .map(|o| o.1.as_str())
                .collect::<Vec<_>>(),
            vec!["canceled"]
        );
        // Nothing is due while paused.
        assert!(deliver(&env, &e).await.is_none());

        let resumed = control::resume(&mut env.pool.acquire().await.unwrap(), id)
            .await
            .unwrap();
        assert_eq!(
            (resumed.from, resumed.to, resumed.outbox_revision),
            (research::Stage::Paused, next, Some(2))
        );
        let ob = outbox(&env.pool, id).await;
        assert_eq!(
            ob[1],
            (
                2,
                "pending".into(),
                format!("research.task:{TENANT}:{}:{id}:2", s.space)
            )
        );
        let j = run_until_settled(&env, &e, id).await;
        assert_eq!(j.stage, "completed", "after a pause at {stage}: {j:?}");
        let evs = events(&env.pool, id).await;
        assert_contiguous(id, &evs);
        let ts = types(&evs);
        assert_eq!(
            ts.iter().filter(|t| *t == "stage_changed").count(),
            5,
            "{ts:?}"
        );
        let p = ts.iter().position(|t| t == "paused").unwrap();
        assert_eq!(ts[p + 1], "resumed");
        assert_eq!(evs[p].2, "paused");
        assert_eq!(evs[p + 1].2, next.as_str());
        assert_eq!(partials(&env.pool, id).await.len(), 5, "no partial twice");
    }
    env.cleanup().await;
}

/// The same at the lease level, deterministically, for every runnable stage: a worker holds the
/// job at `stage`, the task is paused, and every write the worker tries is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_holding_the_job_at_any_stage_is_fenced_out_by_a_pause() {
    let env = TestEnv::new().await;
    let s = seed(&env.pool).await;
    let handler = extractive();
    let st = Statements::new(&RESEARCH);
    for (steps, stage) in WALK[..5].iter().enumerate() {
        let id = request(&env.pool, &req(&s, QUESTION)).await;
        let mut ctx = claim(&env, id, &format!("w-{stage}")).await;
        for _ in 0..steps {
            step_by_hand(&env.pool, handler.as_ref(), &mut ctx)
                .await
                .unwrap()
                .unwrap();
        }
        assert_eq!(ctx.checkpoint, *stage);
        let mut conn = env.pool.acquire().await.unwrap();
        let p = control::pause(&mut conn, id).await.unwrap();
        assert_eq!(p.from.as_str(), *stage);
        let j = job(&env.pool, id).await;
        assert_eq!(
            (j.stage.as_str(), j.paused_from.as_deref()),
            ("paused", Some(*stage))
        );
        let before = (
            events(&env.pool, id).await.len(),
            partials(&env.pool, id).await.len(),
        );
        assert_eq!(
            step_by_hand(&env.pool, handler.as_ref(), &mut ctx)
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
        assert!(!lease::end(
            &mut conn,
            &st,
            &ctx,
            &End::Succeed {
                checkpoint: "completed".into()
            }
        )
        .await
        .unwrap());
        assert_eq!(
            before,
            (
                events(&env.pool, id).await.len(),
                partials(&env.pool, id).await.len()
            )
        );
        let r = control::resume(&mut conn, id).await.unwrap();
        assert_eq!(r.to.as_str(), *stage);
        drop(conn);
        let e = engine(&env, &format!("w-finish-{stage}"), extractive());
        assert_eq!(
            run_until_settled(&env, &e, id).await.stage,
            "completed",
            "at {stage}"
        );
        let evs = events(&env.pool, id).await;
        assert_contiguous(id, &evs);
        let ts = types(&evs);
        let at = ts.iter().position(|t| t == "paused").unwrap();
        assert_eq!(at, steps + 1, "{ts:?}");
        assert_eq!(ts[at + 1], "resumed");
        assert_eq!(ts.iter().filter(|t| *t == "stage_changed").count(), 5);
        assert_eq!(partials(&env.pool, id).await.len(), 5);
    }
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_worker_finds_every_write_refused_and_controls_are_idempotent() {
    let env = TestEnv::new().await;
    let s = seed(&env.pool).await;
    let id = request(&env.pool, &req(&s, QUESTION)).await;

    // Paused while queued, before any worker: nothing runs until resumed.
    let p = control::pause(&mut env.pool.acquire().await.unwrap(), id)
        .await
        .unwrap();
    assert_eq!(
        (p.from, p.to, p.changed),
        (research::Stage::Queued, research::Stage::Paused, true)
    );
    let again = control::pause(&mut env.pool.acquire().await.unwrap(), id)
        .await
        .unwrap();
    assert!(!again.changed, "a repeated pause changes nothing");
    control::resume(&mut env.pool.acquire().await.unwrap(), id)
        .await
        .unwrap();

    // A worker holds the job at retrieving; a pause fences it out of every write.
    let handler = extractive();
    let mut ctx = claim(&env, id, "w-hand").await;
    for _ in 0..2 {
        step_by_hand(&env.pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(ctx.checkpoint, "retrieving");
    let p = control::pause(&mut env.pool.acquire().await.unwrap(), id)
        .await
        .unwrap();
    assert_eq!(p.from, research::Stage::Retrieving);
    let before = (
        events(&env.pool, id).await,
        partials(&env.pool, id).await.len(),
    );
    assert_eq!(
        step_by_hand(&env.pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap(),
        None
    );
    let st = Statements::new(&RESEARCH);
    let mut conn = env.pool.acquire().await.unwrap();
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
        (
            events(&env.pool, id).await,
            partials(&env.pool, id).await.len()
        )
    );

    // Resume: back to retrieving, a new revision; the old worker stays fenced out.
    let r = control::resume(&mut conn, id).await.unwrap();
    assert_eq!(
        (r.to, r.outbox_revision),
        (research::Stage::Retrieving, Some(3))
    );
    assert_eq!(
        step_by_hand(&env.pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap(),
        None
    );
    let again = control::resume(&mut conn, id).await.unwrap();
    assert!(!again.changed, "resuming a running task changes nothing");
    let ob = outbox(&env.pool, id).await;
    assert_eq!(
        ob.iter().map(|o| (o.0, o.1.as_str())).collect::<Vec<_>>(),
        vec![(1, "canceled"), (2, "canceled"), (3, "pending")]
    );
    let e = engine(&env, "w-after", extractive());
    assert_eq!(run_until_settled(&env, &e, id).await.stage, "completed");
    let evs = events(&env.pool, id).await;
    assert_contiguous(id, &evs);
    assert_eq!(
        types(&evs),
        vec![
            "started",
            "paused",
            "resumed",
            "stage_changed",
            "stage_changed",
            "paused",
            "resumed",
            "stage_changed",
            "stage_changed",
            "stage_changed"
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
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancel_ends_the_task_for_good() {
    let env = TestEnv::new().await;
    let s = seed(&env.pool).await;
    let id = request(&env.pool, &req(&s, QUESTION)).await;
    let handler = extractive();
    let mut ctx = claim(&env, id, "w-cancel").await;
    step_by_hand(&env.pool, handler.as_ref(), &mut ctx)
        .await
        .unwrap()
        .unwrap();
    let mut conn = env.pool.acquire().await.unwrap();
    let c = control::cancel(&mut conn, id, Some("the user lost interest"))
        .await
        .unwrap();
    assert_eq!(
        (c.from, c.to),
        (research::Stage::Planning, research::Stage::Canceled)
    );
    let j = job(&env.pool, id).await;
    assert_eq!(j.stage, "canceled");
    assert_eq!(j.error.as_deref(), Some("canceled: the user lost interest"));
    assert_eq!(j.lease_token, None);
    let completed_at: Option<i64> =
        sqlx::query_scalar("SELECT completed_at FROM research_task_jobs WHERE id = $1")
            .bind(id)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert!(completed_at.is_some());
    assert_eq!(
        outbox(&env.pool, id)
            .await
            .iter()
            .map(|o| o.1.as_str())
            .collect::<Vec<_>>(),
        vec!["canceled"]
    );
    // The worker is fenced out; the task stays canceled.
    assert_eq!(
        step_by_hand(&env.pool, handler.as_ref(), &mut ctx)
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
    let evs = events(&env.pool, id).await;
    assert_contiguous(id, &evs);
    assert_eq!(types(&evs), vec!["started", "stage_changed", "canceled"]);
    assert_eq!(evs[2].4["reason"], "the user lost interest");
    let e = engine(&env, "w-x", extractive());
    assert!(deliver(&env, &e).await.is_none(), "nothing is due");
    drop(conn);
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// Permission, refusals

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_snapshot_revoked_or_expired_mid_run_fails_the_task_closed() {
    let env = TestEnv::new().await;
    let s = seed(&env.pool).await;
    let handler = extractive();
    for change in [
        "status = 'revoked', revoked_at = now()",
        "expires_at = now() - interval '1 second'",
        "revision = revision + 1",
    ] {
        let snapshot = kfs_worker::platform::create_permission_snapshot(
            &mut env.pool.acquire().await.unwrap(),
            TENANT,
            s.space,
            SUBJECT,
            "interactive",
            None,
        )
        .await
        .unwrap();
        let r = ResearchRequest::new(s.space, QUESTION, SUBJECT, snapshot);
        let id = request(&env.pool, &r).await;
        let mut ctx = claim(&env, id, "w-revoke").await;
        for _ in 0..2 {
            step_by_hand(&env.pool, handler.as_ref(), &mut ctx)
                .await
                .unwrap()
                .unwrap();
        }
        assert_eq!(ctx.checkpoint, "retrieving");
        sqlx::query(&format!(
            "UPDATE knowledge_space_permission_snapshots SET {change} WHERE id = $1"
        ))
        .bind(snapshot)
        .execute(&env.pool)
        .await
        .unwrap();
        let err = step_by_hand(&env.pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, JobError::Fatal { code, .. } if code == "permission_revoked"),
            "{err:?}"
        );
        assert!(
            partials(&env.pool, id).await.is_empty(),
            "no evidence after {change}"
        );

        // Through the engine: the task fails, with nothing retrieved.
        let mut conn = env.pool.acquire().await.unwrap();
        sqlx::query("UPDATE research_task_jobs SET lease_expires_at = 0 WHERE id = $1")
            .bind(id)
            .execute(&mut *conn)
            .await
            .unwrap();
        sqlx::query(
            "UPDATE research_task_outbox SET status = 'pending', available_at = 0 WHERE research_task_job_id = $1",
        )
        .bind(id)
        .execute(&mut *conn)
        .await
        .unwrap();
        drop(conn);
        let e = engine(&env, "w-revoke-engine", extractive());
        let j = run_until_settled(&env, &e, id).await;
        assert_eq!(j.stage, "failed", "{j:?}");
        assert!(
            j.error
                .as_deref()
                .unwrap()
                .starts_with("permission_revoked: "),
            "{j:?}"
        );
        assert!(partials(&env.pool, id).await.is_empty());
        let evs = events(&env.pool, id).await;
        assert_contiguous(id, &evs);
        // The failure itself is the last event, so a follower sees how the task ended.
        assert_eq!(
            stages(&evs),
            vec!["queued", "planning", "retrieving", "failed"]
        );
        assert_eq!(
            evs.last().map(|e| e.1.as_str()),
            Some("research_task.failed")
        );
    }
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_are_refused_clearly_and_write_nothing() {
    let env = TestEnv::new().await;
    let s = seed(&env.pool).await;
    let mut conn = env.pool.acquire().await.unwrap();
    let c = &mut *conn;
    let snap = |subject: &str, channel: &str, space: Uuid, tenant: &str| {
        let (subject, channel, tenant) =
            (subject.to_owned(), channel.to_owned(), tenant.to_owned());
        let pool = env.pool.clone();
        async move {
            kfs_worker::platform::create_permission_snapshot(
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
    sqlx::query("UPDATE knowledge_space_permission_snapshots SET status = 'revoked', revoked_at = now() WHERE id = $1")
        .bind(revoked)
        .execute(&mut *c)
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
    let second_space = kfs_worker::platform::create_space(c, TENANT, "second", "Second")
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
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM research_task_jobs")
        .fetch_one(&mut *c)
        .await
        .unwrap();
    assert_eq!(n, 1);
    drop(conn);
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// The HTTP generator, against a local stand-in

#[derive(Clone, Debug, Default)]
struct Captured {
    request_line: String,
    authorization: Option<String>,
    body: Value,
}

/// A tiny OpenAI-compatible stand-in on 127.0.0.1 that answers every request with `reply`.
async fn stand_in(reply: Value) -> (String, Arc<Mutex<Vec<Captured>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let reply = reply.to_string();
            let seen = seen2.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let (head_end, content_length) = loop {
                    let n = sock.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
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
                seen.lock().unwrap().push(Captured {
                    request_line: head.lines().next().unwrap_or_default().to_owned(),
                    authorization,
                    body: serde_json::from_slice(&buf[head_end..]).unwrap_or(Value::Null),
                });
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}",
                    reply.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_http_generator_answers_through_a_local_stand_in_and_records_its_cost() {
    let env = TestEnv::new().await;
    let s = seed(&env.pool).await;
    let (base, seen) = stand_in(completion(
        "Fencing compares the lease token on every write [1]; a lease expires after thirty seconds [2].",
        1200,
        40,
    ))
    .await;
    let handler = Arc::new(ResearchHandler::with_generator(openai(&base, 0.5, 1.5)));
    let id = request(
        &env.pool,
        &ResearchRequest {
            budget_usd: Some(1.0),
            ..req(&s, QUESTION)
        },
    )
    .await;
    let e = engine(&env, "w-http", handler);
    let j = run_until_settled(&env, &e, id).await;
    assert_eq!(j.stage, "completed", "{j:?}");

    let calls = seen.lock().unwrap().clone();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].request_line, "POST /v1/chat/completions HTTP/1.1");
    assert_eq!(
        calls[0].authorization.as_deref(),
        Some("Bearer sk-test-secret")
    );
    assert_eq!(calls[0].body["model"], "stand-in-1");
    let user = calls[0].body["messages"][1]["content"].as_str().unwrap();
    assert!(
        user.contains(QUESTION) && user.contains("[1]") && user.contains("Fencing compares"),
        "{user}"
    );
    assert!(!user.contains("OTHER-TENANT-SECRET"));

    let result = &j.metadata["result"];
    assert_eq!(result["generator"], "openai");
    assert_eq!(result["model"], "stand-in-1");
    assert_eq!(
        result["citations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["index"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        vec![1, 2]
    );
    assert_eq!(j.cost["promptTokens"], 1200);
    assert_eq!(j.cost["completionTokens"], 40);
    assert_eq!(j.cost["calls"], 1);
    let usd = j.cost["usd"].as_f64().unwrap();
    assert!((usd - (1.2 * 0.5 + 0.04 * 1.5)).abs() < 1e-9, "{usd}");
    // The key is nowhere in the database.
    let dump: String = sqlx::query_scalar(
        "SELECT concat((SELECT string_agg(j::text, '') FROM research_task_jobs j), \
           (SELECT string_agg(e::text, '') FROM research_task_progress_events e), \
           (SELECT string_agg(p::text, '') FROM research_task_partial_results p))",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert!(!dump.contains("sk-test-secret"));
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_budget_overrun_cancels_the_task_with_its_reason() {
    let env = TestEnv::new().await;
    let s = seed(&env.pool).await;
    let (base, seen) = stand_in(completion("A very long answer [1].", 1000, 500_000)).await;
    let handler = Arc::new(ResearchHandler::with_generator(openai(&base, 0.001, 0.01)));
    let id = request(
        &env.pool,
        &ResearchRequest {
            budget_usd: Some(1.0),
            ..req(&s, QUESTION)
        },
    )
    .await;
    let e = engine(&env, "w-budget", handler);
    let j = run_until_settled(&env, &e, id).await;
    assert_eq!(j.stage, "canceled", "{j:?}");
    assert_eq!(seen.lock().unwrap().len(), 1);
    let error = j.error.unwrap();
    assert!(error.starts_with("budget_exceeded: "), "{error}");
    assert!(error.contains("over the budget of $1.0"), "{error}");
    let usd = j.cost["usd"].as_f64().unwrap();
    assert!(
        (usd - 5.001).abs() < 1e-9,
        "the spend is recorded: {}",
        j.cost
    );
    assert!(j.metadata.get("result").is_none(), "no answer over budget");
    let evs = events(&env.pool, id).await;
    assert_contiguous(id, &evs);
    assert_eq!(
        stages(&evs),
        vec![
            "queued",
            "planning",
            "retrieving",
            "analyzing",
            "generating",
            "canceled"
        ]
    );
    let last = &evs.last().unwrap().4;
    assert_eq!(last["code"], "budget_exceeded");
    assert_eq!(
        outbox(&env.pool, id)
            .await
            .iter()
            .map(|o| o.1.as_str())
            .collect::<Vec<_>>(),
        vec!["canceled"]
    );

    // A budget the prompt alone exceeds cancels before any call.
    let id = request(
        &env.pool,
        &ResearchRequest {
            budget_usd: Some(0.0),
            ..req(&s, QUESTION)
        },
    )
    .await;
    let j = run_until_settled(&env, &e, id).await;
    assert_eq!(j.stage, "canceled");
    assert!(j.error.unwrap().contains("would cost at least"));
    assert_eq!(seen.lock().unwrap().len(), 1, "no second call");
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// The command line

fn kfs(env: &TestEnv, args: &[&str], extra: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"));
    cmd.args(args);
    for (k, v) in env.worker_env() {
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
    let env = TestEnv::new().await;
    let s = seed(&env.pool).await;
    let (space, snapshot) = (s.space.to_string(), s.snapshot.to_string());
    let out = kfs(
        &env,
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
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!((top_k, mode.as_deref()), (Some(5), Some("research")));

    for (action, stage) in [("pause", "paused"), ("resume", "queued")] {
        let out = kfs(&env, &["research", action, &id.to_string()], &[]);
        assert!(
            out.status.success(),
            "{action}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(job(&env.pool, id).await.stage, stage);
    }

    // Follow while a worker runs it: every event, in order, one plain line each, then exit.
    let follower = {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"));
        cmd.args(["research", "follow", &id.to_string(), "--poll", "50ms"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        for (k, v) in env.worker_env() {
            cmd.env(k, v);
        }
        cmd.spawn().unwrap()
    };
    let e = engine(&env, "w-cli", extractive());
    assert_eq!(run_until_settled(&env, &e, id).await.stage, "completed");
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
    let evs = events(&env.pool, id).await;
    assert_eq!(lines.len(), evs.len(), "{stdout}");
    for (line, ev) in lines.iter().zip(&evs) {
        let f: Vec<&str> = line.split('\t').collect();
        assert_eq!(f[0], ev.0.to_string());
        assert_eq!(f[2], ev.1);
        assert_eq!(f[3], ev.2);
    }

    let out = kfs(&env, &["research", "show", &id.to_string()], &[]);
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["stage"], "completed");
    assert!(shown["result"]["answer"].is_string());

    // Bad input and refusals: one error line, exit 2, nothing written.
    let jobs_before: i64 = sqlx::query_scalar("SELECT count(*) FROM research_task_jobs")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    let id_s = id.to_string();
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
        let out = kfs(&env, &args, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.starts_with("error: ") && err.contains(needle),
            "{args:?}: {err}"
        );
    }
    let jobs_after: i64 = sqlx::query_scalar("SELECT count(*) FROM research_task_jobs")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(jobs_before, jobs_after);

    // A malformed generator setting stops a worker at start, naming the variable.
    let out = kfs(
        &env,
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
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// Workers killed at each kill point

#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_at_each_kill_point_leaves_a_walk_another_finishes() {
    let env = TestEnv::new().await;
    let s = seed(&env.pool).await;
    let common_env = [
        ("KFS_RELAY_POLL", "100ms"),
        ("KFS_SLICE_STEPS", "1"),
        ("KFS_GENERATOR", "extractive"),
    ];
    for point in ["after-claim-commit", "after-step-commit:2", "before-ack:2"] {
        let id = request(&env.pool, &req(&s, QUESTION)).await;
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
        let status = tokio::task::spawn_blocking(move || {
            let s = doomed.wait_exit(Duration::from_secs(60));
            (s, doomed)
        })
        .await
        .unwrap();
        let (status, doomed) = status;
        let status =
            status.unwrap_or_else(|| panic!("did not crash at {point}:\n{}", doomed.log_text()));
        assert!(!status.success(), "{point}: {status:?}");
        assert!(
            doomed.log_text().contains("crash point"),
            "{}",
            doomed.log_text()
        );
        let mid = job(&env.pool, id).await;
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
        let pool = env.pool.clone();
        let done = env
            .wait_until(Duration::from_secs(60), || {
                let pool = pool.clone();
                async move { job(&pool, id).await.stage == "completed" }
            })
            .await;
        assert!(
            done,
            "{point}: {:?}\n{}",
            job(&env.pool, id).await,
            rescuer.log_text()
        );
        common::stop_cleanly([&mut rescuer], Duration::from_secs(20)).await;

        let evs = events(&env.pool, id).await;
        assert_contiguous(id, &evs);
        assert_eq!(stages(&evs), WALK.to_vec(), "{point}");
        let ps = partials(&env.pool, id).await;
        assert_eq!(ps.len(), 5, "{point}: {ps:#?}");
        let j = job(&env.pool, id).await;
        assert!(j.metadata["result"]["answer"].is_string());
    }
    env.cleanup().await;
}
