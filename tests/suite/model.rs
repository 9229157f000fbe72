//! Model-driven compile against real Postgres (and, for the crash runs, RabbitMQ and real worker
//! processes): a space whose retrieval profile names a reasoning model gets semantic nodes with
//! their generation receipt, outline summaries, and the graph with its semantic projections,
//! through the deterministic offline model; a worker killed after a model answer was
//! checkpointed leaves a successor that never asks for that answer again (counted in its
//! `kfs_model_calls_total`).

use std::time::Duration;

use kfs_worker::canonical::{child_id, sha256_hex};
use kfs_worker::jobs::compile::semantic::graph;
use kfs_worker::jobs::Deps;
use kfs_worker::tools::platform;
use serde_json::Value;
use uuid::Uuid;

use crate::support;
use crate::support::space::SpaceFx;

const TENANT: &str = "tenant-model";

support::space::space_fixture!(
    /// A space whose retrieval profile names the offline reasoning model, with an embedding
    /// profile of 32 dimensions.
    Fx
);

/// Sections with named things in them, long enough for several semantic windows.
fn handbook() -> String {
    let mut s =
        String::from("# Harbour Handbook\n\nThe Harbour Authority runs the Northern Pier.\n\n");
    for (i, topic) in ["Mooring", "Fuel", "Weather", "Cargo", "Safety", "Fees"]
        .iter()
        .enumerate()
    {
        s.push_str(&format!("## {topic} Rules\n\n"));
        for j in 0..14 {
            s.push_str(&format!(
                "Rule {i}.{j}: Captain Morgan and the Pilot Service agree that {topic} Policy {j} \
                 applies at Berth {j} whenever the Tide Table says the water is low. "
            ));
            if j % 3 == 2 {
                s.push_str("\n\n");
            }
        }
        s.push_str("\n\n");
    }
    s
}

impl Fx {
    async fn new() -> Fx {
        let fx = Fx(SpaceFx::new(TENANT, "model", "Model-driven compile").await);
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::activate_retrieval_profile(
            &mut conn,
            TENANT,
            fx.space,
            "kfs-reasoner",
            "offline",
        )
        .await
        .unwrap();
        platform::activate_embedding_profile(&mut conn, TENANT, fx.space, "e-small", "openai", 32)
            .await
            .unwrap();
        drop(conn);
        fx
    }

    async fn count(&self, sql: &str, generation: Uuid) -> i64 {
        sqlx::query_scalar(sql)
            .bind(self.space)
            .bind(generation)
            .fetch_one(self.pool())
            .await
            .unwrap()
    }

    /// Window and summary checkpoints of a generation.
    async fn checkpoints(&self, generation: Uuid) -> (i64, i64) {
        (
            self.count(
                "SELECT count(*) FROM document_semantic_window_checkpoints \
                 WHERE knowledge_space_id = $1 AND publication_generation_id = $2",
                generation,
            )
            .await,
            self.count(
                "SELECT count(*) FROM document_outline_summary_checkpoints \
                 WHERE knowledge_space_id = $1 AND publication_generation_id = $2",
                generation,
            )
            .await,
        )
    }

    async fn cleanup(self) {
        self.0.cleanup().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reasoning_profile_compiles_semantic_nodes_with_receipt_summaries_graph_and_projections()
{
    let fx = Fx::new().await;
    let doc = fx
        .add("handbook.md", "text/markdown", handbook().as_bytes())
        .await;
    let attempt = fx.request(doc, false).await.unwrap();
    let engine = fx.engine_with("w-model", 64, Deps::offline_models(fx.store.clone()));
    let s = fx.drive(&engine, attempt).await;
    assert_eq!(s.run_state, "succeeded", "{s:?}");
    let g = s.publication_generation_id;
    let (windows, summaries) = fx.checkpoints(g).await;
    assert!(
        windows >= 2,
        "a long document is asked for in several windows: {windows}"
    );

    // Semantic nodes: the platform's id, strategy marker and extracted graph facts.
    let nodes: Vec<(Uuid, Uuid, i32, i32, Value)> = sqlx::query_as(
        "SELECT id, parse_artifact_id, start_offset, end_offset, metadata FROM knowledge_nodes \
         WHERE knowledge_space_id = $1 AND publication_generation_id = $2 ORDER BY start_offset",
    )
    .bind(fx.space)
    .bind(g)
    .fetch_all(fx.pool())
    .await
    .unwrap();
    assert!(nodes.len() as i64 >= windows, "{} nodes", nodes.len());
    let hash: String =
        sqlx::query_scalar("SELECT artifact_hash FROM parse_artifacts WHERE id = $1")
            .bind(nodes[0].1)
            .fetch_one(fx.pool())
            .await
            .unwrap();
    for (i, (id, artifact, start, end, meta)) in nodes.iter().enumerate() {
        assert_eq!(
            *id,
            child_id(
                g,
                &format!("llm-semantic-v1:{artifact}:{hash}:{start}:{end}")
            ),
            "node {i}'s id"
        );
        assert_eq!(meta["chunkIndex"], i, "node {i}");
        assert_eq!(meta["semanticChunking"]["strategy"], "llm-semantic-v1");
        assert_eq!(
            meta["semanticChunking"]["modelSelection"]["model"],
            "kfs-reasoner"
        );
        assert_eq!(meta["offsetEncoding"], "utf-8-bytes");
    }
    // Every node is served, with its full-text and dense projections.
    let ready: i64 = fx
        .count(
            "SELECT count(*) FROM index_projections WHERE knowledge_space_id = $1 \
             AND publication_generation_id = $2 AND status = 'ready'",
            g,
        )
        .await;
    assert_eq!(ready, 2 * nodes.len() as i64);

    // The receipt counts the nodes and carries the platform's fingerprints.
    let (chunks, stored, req, resp, both, receipt): (i32, i32, String, String, String, Value) =
        sqlx::query_as(
            "SELECT document_chunk_count, stored_node_count, request_fingerprint, response_fingerprint, \
               prompt_response_fingerprint, receipt FROM knowledge_node_generation_receipts \
             WHERE knowledge_space_id = $1 AND publication_generation_id = $2",
        )
        .bind(fx.space)
        .bind(g)
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(
        (chunks as usize, stored as usize),
        (nodes.len(), nodes.len())
    );
    for f in [&req, &resp, &both] {
        assert!(f.starts_with("sha256:") && f.len() == 71, "{f}");
    }
    assert_eq!(receipt["requestFingerprint"], req.as_str());
    assert_eq!(
        receipt["windowManifest"].as_array().unwrap().len() as i64,
        windows
    );
    assert_eq!(
        both,
        format!(
            "sha256:{}",
            sha256_hex(
                kfs_worker::canonical::stable_json(
                    &serde_json::json!({"requestFingerprint": req, "responseFingerprint": resp})
                )
                .as_bytes()
            )
        )
    );

    // Outline summaries: one checkpoint per outline node, written into the outline and the
    // page index.
    let (outline_nodes, outline_meta): (Value, Value) = sqlx::query_as(
        "SELECT nodes, metadata FROM document_outlines WHERE knowledge_space_id = $1 AND publication_generation_id = $2",
    )
    .bind(fx.space)
    .bind(g)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    let mut flat = Vec::new();
    let mut stack: Vec<&Value> = outline_nodes.as_array().unwrap().iter().collect();
    while let Some(n) = stack.pop() {
        flat.push(n);
        stack.extend(n["children"].as_array().unwrap());
    }
    assert_eq!(flat.len() as i64, summaries, "one summary per outline node");
    for n in &flat {
        assert_eq!(n["metadata"]["summary"]["source"], "provider", "{n}");
        assert!(!n["summary"].as_str().unwrap().is_empty());
    }
    assert_eq!(
        outline_meta["summary"]["promptVersion"],
        "document-outline-summary-v2"
    );
    let summarised: i64 = fx
        .count(
            "SELECT count(*) FROM page_index_nodes n JOIN page_index_manifests m ON m.id = n.manifest_id \
             WHERE m.knowledge_space_id = $1 AND m.publication_generation_id = $2 AND n.summary IS NOT NULL",
            g,
        )
        .await;
    assert_eq!(summarised, summaries);

    // The graph: entities and relations of the generation, each with its projection.
    let entities: Vec<(Uuid, String, Value)> = sqlx::query_as(
        "SELECT id, canonical_key, source_node_ids FROM graph_entities \
         WHERE knowledge_space_id = $1 AND publication_generation_id = $2",
    )
    .bind(fx.space)
    .bind(g)
    .fetch_all(fx.pool())
    .await
    .unwrap();
    assert!(!entities.is_empty());
    for (id, key, _) in &entities {
        assert_eq!(
            *id,
            child_id(
                fx.space,
                &format!("publication-generation:{g}:graph-entity:{key}")
            )
        );
    }
    let relations = fx
        .count(
            "SELECT count(*) FROM graph_relations WHERE knowledge_space_id = $1 AND publication_generation_id = $2",
            g,
        )
        .await;
    assert!(relations > 0);
    let (entity_projections, bad_hashes): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE content_hash <> encode(sha256(convert_to( \
           representation_version || E'\\n' || search_text, 'UTF8')), 'hex') OR dimension <> 32) \
         FROM graph_entity_semantic_projections WHERE knowledge_space_id = $1 AND publication_generation_id = $2",
    )
    .bind(fx.space)
    .bind(g)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!((entity_projections, bad_hashes), (entities.len() as i64, 0));
    let relation_projections = fx
        .count(
            "SELECT count(*) FROM graph_relation_semantic_projections \
             WHERE knowledge_space_id = $1 AND publication_generation_id = $2 \
               AND representation_version = 'graph-semantic-representation-v1'",
            g,
        )
        .await;
    assert_eq!(
        graph::REPRESENTATION_VERSION,
        "graph-semantic-representation-v1"
    );
    assert_eq!(relation_projections, relations);
    fx.cleanup().await;
}

/// A space whose profile selects the extractive stand-in keeps the deterministic pipeline, even
/// in a process with a reasoning model: no checkpoint, no receipt, no graph.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_profile_without_a_reasoning_model_keeps_the_deterministic_pipeline() {
    let fx = Fx(SpaceFx::new(TENANT, "plain", "Deterministic compile").await);
    let doc = fx
        .add("handbook.md", "text/markdown", handbook().as_bytes())
        .await;
    let attempt = fx.request(doc, false).await.unwrap();
    let engine = fx.engine_with("w-plain", 64, Deps::offline_models(fx.store.clone()));
    let s = fx.drive(&engine, attempt).await;
    assert_eq!(s.run_state, "succeeded", "{s:?}");
    let g = s.publication_generation_id;
    assert_eq!(fx.checkpoints(g).await, (0, 0));
    for table in ["knowledge_node_generation_receipts", "graph_entities"] {
        let n = fx
            .count(
                &format!("SELECT count(*) FROM {table} WHERE knowledge_space_id = $1 AND publication_generation_id = $2"),
                g,
            )
            .await;
        assert_eq!(n, 0, "{table}");
    }
    fx.cleanup().await;
}

#[cfg(feature = "crash-points")]
mod crash {
    use super::*;

    /// The sum of a counter's samples whose labels contain `filter`.
    fn counter(body: &str, metric: &str, filter: &str) -> f64 {
        body.lines()
            .filter(|l| l.starts_with(metric) && l.contains(filter))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Worker A is killed right after its `nth` model answer was checkpointed; worker B finishes
    /// the compile. B's calls are exactly the answers that had no checkpoint when A died.
    async fn killed_after_model_checkpoint(nth: &str) -> ((i64, i64), (i64, i64), f64) {
        let fx = Fx::new().await;
        let doc = fx
            .add("handbook.md", "text/markdown", handbook().as_bytes())
            .await;
        let attempt = fx.request(doc, false).await.unwrap();
        let g = fx.status(attempt).await.publication_generation_id;
        let spawn = |id: &str, extra: &[(&str, String)]| {
            let mut e = vec![
                ("KFS_OBJECT_STORE", fx.store_url.clone()),
                ("KFS_KINDS", "compile".to_owned()),
                ("KFS_WORKER_ID", id.to_owned()),
                ("KFS_RELAY_POLL", "200ms".to_owned()),
                ("KFS_REASONER", "offline".to_owned()),
                ("KFS_EMBEDDER", "offline".to_owned()),
                ("KFS_LEASES", "compile=60s".to_owned()),
            ];
            e.extend(extra.iter().map(|(k, v)| (*k, v.clone())));
            let e: Vec<(&str, &str)> = e.iter().map(|(k, v)| (*k, v.as_str())).collect();
            fx.env.spawn_worker(id, &["run"], &e)
        };
        let mut a = spawn(
            "a",
            &[(
                "KFS_CRASH_AT",
                format!("compile-after-model-checkpoint:{nth}"),
            )],
        );
        let status = a.wait_exit(Duration::from_secs(90));
        assert!(
            status.is_some_and(|s| !s.success()),
            "A did not die at its model checkpoint {nth}: {status:?}\n{}",
            a.log_text()
        );
        let dead = fx.checkpoints(g).await;
        let at_death = dead.0 + dead.1;
        assert!(
            at_death >= nth.parse::<i64>().unwrap(),
            "{at_death} checkpoints at A's death"
        );
        let addr = support::free_port();
        let mut b = spawn("b", &[("KFS_HTTP_ADDR", addr.to_string())]);
        let pool = fx.pool().clone();
        let done = fx
            .env
            .wait_until(Duration::from_secs(120), || {
                let pool = pool.clone();
                async move {
                    let state: String = sqlx::query_scalar(
                        "SELECT run_state::text FROM document_compilation_attempts WHERE id = $1",
                    )
                    .bind(attempt)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                    state == "succeeded"
                }
            })
            .await;
        assert!(
            done,
            "B did not finish the compile: {:?}\n{}",
            fx.status(attempt).await,
            b.log_text()
        );
        let (code, body) = support::http_get(addr, "/metrics").await;
        assert_eq!(code, 200);
        let calls = counter(&body, "kfs_model_calls_total", "outcome=\"ok\"");
        let end = fx.checkpoints(g).await;
        let all = end.0 + end.1;
        assert_eq!(
            calls,
            (all - at_death) as f64,
            "B made {calls} model calls for {all} answers of which {at_death} were checkpointed \
             when A died: a checkpointed call was repeated (or an answer was not checkpointed)"
        );
        println!("[model crash at checkpoint {nth}] {at_death} of {all} answers checkpointed at the kill; B asked for {calls}");
        support::stop_cleanly([&mut b], Duration::from_secs(20)).await;
        drop(a);
        fx.cleanup().await;
        (dead, end, calls)
    }

    /// Killed among the semantic windows.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_worker_killed_after_a_window_answer_never_asks_for_it_again() {
        let (dead, end, calls) = killed_after_model_checkpoint("1").await;
        assert!(
            dead.0 >= 1 && dead.0 < end.0,
            "A died among the windows: {dead:?} of {end:?}"
        );
        assert!(calls > 0.0);
    }

    /// Killed among the outline summaries (the handbook has fewer than seven windows and more
    /// than one outline section, so its seventh answer is a summary).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_worker_killed_after_a_summary_answer_never_asks_for_it_again() {
        let (dead, end, calls) = killed_after_model_checkpoint("7").await;
        assert_eq!(
            dead.0, end.0,
            "A died after every window was answered: {dead:?} of {end:?}"
        );
        assert!(
            dead.1 >= 1 && dead.1 < end.1,
            "A died among the summaries: {dead:?} of {end:?}"
        );
        assert!(calls > 0.0);
    }
}
