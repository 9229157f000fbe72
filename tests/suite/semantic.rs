//! `document.semantic` against real Postgres: a queued enrichment job of a published generation
//! whose nodes were chunked without a model gets its graph from the reasoning model's entity and
//! relation answers (checkpointed per node and stage), with projections and the platform's
//! result; a generation not served yet waits with its attempt given back; a replaced one ends
//! `superseded` writing nothing; a generation chunked by the model needs no call. The crash run
//! kills a real worker after a checkpointed answer and counts what its successor asks.

use std::time::Duration;

use kfs_worker::engine::leased::{self, Outcome};
use kfs_worker::engine::slice::Budget;
use kfs_worker::jobs::semantic::SemanticKind;
use kfs_worker::jobs::Deps;
use kfs_worker::model::Models;
use kfs_worker::tools::platform;
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

use crate::support;
use crate::support::space::{SpaceFx, GUIDE_MD};

const TENANT: &str = "tenant-semantic";

/// Named things in two sections.
const HARBOUR_MD: &[u8] =
    b"# Harbour\n\nThe Harbour Authority hired Captain Morgan. Captain Morgan \
briefed the Pilot Service on the Tide Table.\n\n## Fees\n\nThe Harbour Authority sets Berth Fees \
with the Port Council and the Pilot Service.\n";

support::space::space_fixture!(
    /// A space with an embedding profile of 16 dimensions, whose retrieval profile selects the
    /// offline reasoning model or the extractive stand-in.
    Fx
);

impl Fx {
    async fn new(model: &str) -> Fx {
        let fx = Fx(SpaceFx::new(TENANT, "semantic", "Semantic enrichment").await);
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::activate_retrieval_profile(&mut conn, TENANT, fx.space, model, "offline")
            .await
            .unwrap();
        platform::activate_embedding_profile(&mut conn, TENANT, fx.space, "e", "openai", 16)
            .await
            .unwrap();
        drop(conn);
        fx
    }

    /// Compiles a document and queues its enrichment job as the platform's compile worker
    /// admits one: the attempt's generation, artifact and frozen retrieval profile.
    async fn compiled_with_job(&self, deps: Deps) -> (Uuid, Uuid) {
        let doc = self.add("harbour.md", "text/markdown", HARBOUR_MD).await;
        let attempt = self.request(doc, false).await.unwrap();
        let s = self
            .drive(&self.engine_with("w-compile", 64, deps), attempt)
            .await;
        assert_eq!(s.run_state, "succeeded", "{s:?}");
        (attempt, self.queue_job(attempt, None).await)
    }

    /// Queues an enrichment job of `attempt` (of `generation` instead of the attempt's, if
    /// given).
    async fn queue_job(&self, attempt: Uuid, generation: Option<Uuid>) -> Uuid {
        let job = Uuid::new_v4();
        sqlx::query(
            "INSERT INTO document_semantic_enrichment_jobs (id, compilation_attempt_id, tenant_id, knowledge_space_id, \
               document_asset_id, document_version, parse_artifact_id, publication_generation_id, base_head_revision, \
               retrieval_profile, run_state, max_execution_attempts, available_at, created_at, updated_at) \
             SELECT $1, a.id, a.tenant_id, a.knowledge_space_id, a.document_asset_id, a.document_version, p.id, \
               coalesce($3, a.publication_generation_id), a.base_head_revision, r.snapshot, 'queued', 5, now(), now(), now() \
             FROM document_compilation_attempts a \
             JOIN parse_artifacts p ON p.document_asset_id = a.document_asset_id AND p.version = a.document_version \
             JOIN knowledge_space_profile_revisions r ON r.id = a.retrieval_profile_revision_id \
             WHERE a.id = $2",
        )
        .bind(job)
        .bind(attempt)
        .bind(generation)
        .execute(self.pool())
        .await
        .unwrap();
        job
    }

    async fn cleanup(self) {
        self.0.cleanup().await;
    }
}

#[derive(Debug, sqlx::FromRow)]
struct Job {
    run_state: String,
    execution_attempts: i32,
    last_error_code: Option<String>,
    result: Value,
    publication_generation_id: Uuid,
}

async fn job(pool: &PgPool, id: Uuid) -> Job {
    sqlx::query_as(
        "SELECT run_state::text AS run_state, execution_attempts, last_error_code::text AS last_error_code, result, \
           publication_generation_id FROM document_semantic_enrichment_jobs WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn count(pool: &PgPool, sql: &str, generation: Uuid) -> i64 {
    sqlx::query_scalar(sql)
        .bind(generation)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Runs slices until nothing is claimable; the outcomes in order.
async fn run_all(pool: &PgPool, kind: &SemanticKind) -> Vec<Outcome> {
    let mut out = Vec::new();
    for _ in 0..20 {
        match leased::run_once(pool, kind, "w-semantic", Budget::default())
            .await
            .unwrap()
        {
            Some((_, o)) => out.push(o),
            None => return out,
        }
    }
    panic!("the semantic jobs never ran out of work: {out:?}");
}

fn offline_kind() -> SemanticKind {
    SemanticKind::new(
        Models::offline(),
        std::sync::Arc::new(kfs_worker::embed::Offline),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_published_generation_chunked_without_a_model_gets_its_graph_from_checkpointed_answers() {
    let fx = Fx::new("kfs-reasoner").await;
    // Compiled by a process without a reasoning model: deterministic nodes, no graph.
    let (_, id) = fx.compiled_with_job(Deps::offline(fx.store.clone())).await;
    let pool = fx.pool();
    let outcomes = run_all(pool, &offline_kind()).await;
    assert_eq!(outcomes, [Outcome::Ended("succeeded")]);
    let j = job(pool, id).await;
    assert_eq!(
        (j.run_state.as_str(), j.execution_attempts),
        ("succeeded", 1)
    );
    let g = j.publication_generation_id;
    let nodes = count(
        pool,
        "SELECT count(*) FROM knowledge_nodes WHERE publication_generation_id = $1",
        g,
    )
    .await;
    let (entity_stage, relation_stage): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE stage = 'entity'), count(*) FILTER (WHERE stage = 'relation') \
         FROM document_semantic_extraction_checkpoints WHERE publication_generation_id = $1",
    )
    .bind(g)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        (entity_stage, relation_stage),
        (nodes, nodes),
        "one answer per node and stage"
    );
    let entities = count(
        pool,
        "SELECT count(*) FROM graph_entities WHERE publication_generation_id = $1",
        g,
    )
    .await;
    let relations = count(
        pool,
        "SELECT count(*) FROM graph_relations WHERE publication_generation_id = $1",
        g,
    )
    .await;
    assert!(
        entities > 0 && relations > 0,
        "{entities} entities, {relations} relations"
    );
    assert_eq!(j.result["graphEntitiesIndexed"], json!(entities));
    assert_eq!(j.result["graphRelationsIndexed"], json!(relations));
    assert_eq!(j.result["nodesScanned"], json!(nodes));
    assert_eq!(
        j.result["graphEntityIds"].as_array().unwrap().len() as i64,
        entities
    );
    let projected = count(
        pool,
        "SELECT (SELECT count(*) FROM graph_entity_semantic_projections WHERE publication_generation_id = $1) \
           + (SELECT count(*) FROM graph_relation_semantic_projections WHERE publication_generation_id = $1)",
        g,
    )
    .await;
    assert_eq!(projected, entities + relations);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_generation_the_model_chunked_needs_no_call_and_its_graph_is_written_once() {
    let fx = Fx::new("kfs-reasoner").await;
    let (_, id) = fx
        .compiled_with_job(Deps::offline_models(fx.store.clone()))
        .await;
    let pool = fx.pool();
    let g = job(pool, id).await.publication_generation_id;
    let before = count(
        pool,
        "SELECT count(*) FROM graph_entities WHERE publication_generation_id = $1",
        g,
    )
    .await;
    assert!(before > 0, "the model-driven compile wrote the graph");
    assert_eq!(
        run_all(pool, &offline_kind()).await,
        [Outcome::Ended("succeeded")]
    );
    let j = job(pool, id).await;
    assert_eq!(j.result["semanticProviderCalls"], 0);
    assert_eq!(j.result["graphEntitiesIndexed"], json!(before));
    let checkpoints = count(
        pool,
        "SELECT count(*) FROM document_semantic_extraction_checkpoints WHERE publication_generation_id = $1",
        g,
    )
    .await;
    assert_eq!(checkpoints, 0);
    let after = count(
        pool,
        "SELECT count(*) FROM graph_entities WHERE publication_generation_id = $1",
        g,
    )
    .await;
    assert_eq!(after, before);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unserved_generation_waits_with_its_attempt_given_back_and_a_replaced_one_is_superseded()
{
    let fx = Fx::new("kfs-reasoner").await;
    let pool = fx.pool();
    let kind = offline_kind();
    // The attempt is parsed but not published yet: its job waits, and the wait costs no attempt.
    let doc = fx.add("guide.md", "text/markdown", GUIDE_MD).await;
    let attempt = fx.request(doc, false).await.unwrap();
    let one_step = fx.engine_with("w-compile", 1, Deps::offline(fx.store.clone()));
    fx.drive_to(&one_step, attempt, "parsed").await;
    let id = fx.queue_job(attempt, None).await;
    let (_, o) = leased::run_once(pool, &kind, "w-semantic", Budget::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(o, Outcome::Ended("wait"));
    let j = job(pool, id).await;
    assert_eq!(
        (
            j.run_state.as_str(),
            j.execution_attempts,
            j.last_error_code
        ),
        ("retry_wait", 0, None)
    );
    // Once published, the same job runs.
    let s = fx.drive(&one_step, attempt).await;
    assert_eq!(s.run_state, "succeeded", "{s:?}");
    sqlx::query("UPDATE document_semantic_enrichment_jobs SET available_at = now() WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(run_all(pool, &kind).await, [Outcome::Ended("succeeded")]);
    assert_eq!(job(pool, id).await.execution_attempts, 1);
    // A job of a generation its attempt did not publish is superseded and writes nothing.
    let id = fx.queue_job(attempt, Some(Uuid::new_v4())).await;
    let (_, o) = leased::run_once(pool, &kind, "w-semantic", Budget::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(o, Outcome::Ended("superseded"));
    let j = job(pool, id).await;
    assert_eq!(j.run_state, "superseded");
    assert_eq!(
        j.last_error_code.as_deref(),
        Some("SEMANTIC_GENERATION_SUPERSEDED")
    );
    let written = count(
        pool,
        "SELECT count(*) FROM document_semantic_extraction_checkpoints WHERE publication_generation_id = $1",
        j.publication_generation_id,
    )
    .await;
    assert_eq!(written, 0);
    fx.cleanup().await;
}

#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_after_an_extraction_answer_never_asks_for_it_again() {
    let fx = Fx::new("kfs-reasoner").await;
    let (_, id) = fx.compiled_with_job(Deps::offline(fx.store.clone())).await;
    let pool = fx.pool();
    let g = job(pool, id).await.publication_generation_id;
    let answers = |pool: PgPool| async move {
        count(
            &pool,
            "SELECT count(*) FROM document_semantic_extraction_checkpoints WHERE publication_generation_id = $1 \
               AND (result ? 'entityExtraction' OR result ? 'relationExtraction')",
            g,
        )
        .await
    };
    let spawn = |id: &str, extra: &[(&str, String)]| {
        let mut e = vec![
            ("KFS_OBJECT_STORE", fx.store_url.clone()),
            ("KFS_WORKER_ID", id.to_owned()),
            ("KFS_LEASED_POLL", "100ms".to_owned()),
            ("KFS_REASONER", "offline".to_owned()),
            ("KFS_EMBEDDER", "offline".to_owned()),
        ];
        e.extend(extra.iter().map(|(k, v)| (*k, v.clone())));
        let e: Vec<(&str, &str)> = e.iter().map(|(k, v)| (*k, v.as_str())).collect();
        fx.env.spawn_worker(id, &["run", "--leased"], &e)
    };
    let mut a = spawn(
        "sem-a",
        &[("KFS_CRASH_AT", "semantic-after-model-checkpoint:3".into())],
    );
    let status = a.wait_exit(Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| !s.success()),
        "A did not die: {status:?}\n{}",
        a.log_text()
    );
    let at_death = answers(pool.clone()).await;
    assert!(at_death >= 1, "{at_death}");
    let addr = support::free_port();
    let mut b = spawn("sem-b", &[("KFS_HTTP_ADDR", addr.to_string())]);
    let p = pool.clone();
    let done = fx
        .env
        .wait_until(Duration::from_secs(90), || {
            let p = p.clone();
            async move { job(&p, id).await.run_state == "succeeded" }
        })
        .await;
    assert!(
        done,
        "B did not finish: {:?}\n{}",
        job(pool, id).await,
        b.log_text()
    );
    let (code, body) = support::http_get(addr, "/metrics").await;
    assert_eq!(code, 200);
    let calls: f64 = body
        .lines()
        .filter(|l| l.starts_with("kfs_model_calls_total") && l.contains("outcome=\"ok\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    let all = answers(pool.clone()).await;
    assert_eq!(
        calls,
        (all - at_death) as f64,
        "B asked {calls} times for {all} answers, {at_death} of them checkpointed when A died"
    );
    println!("[semantic crash] {at_death} of {all} answers checkpointed at the kill; B asked for {calls}");
    support::stop_cleanly([&mut b], Duration::from_secs(20)).await;
    drop(a);
    fx.cleanup().await;
}
