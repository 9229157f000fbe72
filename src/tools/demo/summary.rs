//! What the demo's jobs left behind, read back and printed: research answers, the read model,
//! the deletion's items and the takeover. Invariant: it only reads, and only the demo's tenant.

use std::time::{Duration, Instant};

use sqlx::PgPool;
use uuid::Uuid;

use super::seed::Seed;
use super::workers::{Kill, Worker};
use super::TENANT;
use crate::status;

pub(super) async fn wait_research(
    pool: &PgPool,
    job: Uuid,
    timeout: Duration,
) -> Result<(String, serde_json::Value), String> {
    let start = Instant::now();
    loop {
        let (stage, result): (String, Option<serde_json::Value>) =
            // The answer is in the final partial result; what it cites, in `metadata.result`.
            sqlx::query_as(
                "SELECT j.stage, coalesce(j.metadata -> 'result', '{}'::jsonb) \
                   || jsonb_build_object('answer', p.answer) \
                 FROM research_task_jobs j \
                 LEFT JOIN research_task_partial_results p ON p.tenant_id = j.tenant_id \
                   AND p.research_task_job_id = j.id \
                   AND p.idempotency_key = 'research-task:' || j.id::text || ':final-evidence' \
                 WHERE j.id = $1 AND j.tenant_id = $2",
            )
                .bind(job)
                .bind(TENANT)
                .fetch_one(pool)
                .await
                .map_err(|e| e.to_string())?;
        if matches!(stage.as_str(), "completed" | "failed" | "canceled")
            || start.elapsed() > timeout
        {
            return Ok((stage, result.unwrap_or_default()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What the compiled documents look like in the platform's read model.
pub(super) struct ReadModel {
    head_revision: i32,
    documents: i64,
    nodes: i64,
    fts: i64,
    dense: i64,
    dimension: Option<i32>,
}

/// What the model-driven space's compile left: its semantic nodes and receipt, outline
/// summaries and graph, with a sample of each.
pub(super) struct Semantic {
    nodes: i64,
    receipts: i64,
    summaries: i64,
    entities: i64,
    relations: i64,
    projections: i64,
    summary: Option<String>,
    sample_entities: Vec<String>,
}

/// Reads the model-driven space's generation rows of its head's documents.
pub(super) async fn read_semantic(pool: &PgPool, space: Uuid) -> Result<Semantic, String> {
    let count = |sql: &'static str| async move {
        sqlx::query_scalar::<_, i64>(sql)
            .bind(space)
            .fetch_one(pool)
            .await
            .map_err(|e| e.to_string())
    };
    let nodes = count(
        "SELECT count(*) FROM knowledge_nodes WHERE knowledge_space_id = $1 \
           AND metadata -> 'semanticChunking' ->> 'strategy' = 'llm-semantic-v1'",
    )
    .await?;
    let receipts = count(
        "SELECT count(*) FROM knowledge_node_generation_receipts WHERE knowledge_space_id = $1",
    )
    .await?;
    let summaries = count(
        "SELECT count(*) FROM document_outline_summary_checkpoints WHERE knowledge_space_id = $1",
    )
    .await?;
    let entities =
        count("SELECT count(*) FROM graph_entities WHERE knowledge_space_id = $1").await?;
    let relations =
        count("SELECT count(*) FROM graph_relations WHERE knowledge_space_id = $1").await?;
    let projections = count(
        "SELECT (SELECT count(*) FROM graph_entity_semantic_projections WHERE knowledge_space_id = $1) \
           + (SELECT count(*) FROM graph_relation_semantic_projections WHERE knowledge_space_id = $1)",
    )
    .await?;
    let summary: Option<String> = sqlx::query_scalar(
        "SELECT n.summary FROM page_index_nodes n JOIN page_index_manifests m ON m.id = n.manifest_id \
         WHERE m.knowledge_space_id = $1 AND n.summary IS NOT NULL ORDER BY n.level, n.start_offset, n.id LIMIT 1",
    )
    .bind(space)
    .fetch_optional(pool)
    .await
    .map_err(|e| e.to_string())?;
    let sample_entities: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM graph_entities WHERE knowledge_space_id = $1 \
         ORDER BY jsonb_array_length(source_node_ids) DESC, name LIMIT 5",
    )
    .bind(space)
    .fetch_all(pool)
    .await
    .map_err(|e| e.to_string())?;
    Ok(Semantic {
        nodes,
        receipts,
        summaries,
        entities,
        relations,
        projections,
        summary,
        sample_entities,
    })
}

/// Reads the read model the way the platform's retrieval does: through the head's publication
/// and its members.
pub(super) async fn read_model(pool: &PgPool, space: Uuid) -> Result<ReadModel, String> {
    let row: (i32, i64, i64, i64, i64, Option<i32>) = sqlx::query_as(
        "SELECT h.head_revision, \
           (SELECT count(DISTINCT m.document_asset_id) FROM projection_set_publication_members m \
              WHERE m.publication_id = h.publication_id), \
           (SELECT count(DISTINCT p.node_id) FROM projection_set_publication_members m \
              JOIN index_projections p ON p.id = m.component_key WHERE m.publication_id = h.publication_id), \
           (SELECT count(*) FROM projection_set_publication_members m JOIN index_projections p ON p.id = m.component_key \
              WHERE m.publication_id = h.publication_id AND p.type = 'fts' AND p.status = 'ready'), \
           (SELECT count(*) FROM projection_set_publication_members m JOIN index_projections p ON p.id = m.component_key \
              WHERE m.publication_id = h.publication_id AND p.type = 'dense-vector' AND p.status = 'ready'), \
           (SELECT max(vector_dims(p.dense_vector)) FROM projection_set_publication_members m \
              JOIN index_projections p ON p.id = m.component_key WHERE m.publication_id = h.publication_id) \
         FROM projection_set_publication_heads h WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2",
    )
    .bind(TENANT)
    .bind(space)
    .fetch_one(pool)
    .await
    .map_err(|e| e.to_string())?;
    Ok(ReadModel {
        head_revision: row.0,
        documents: row.1,
        nodes: row.2,
        fts: row.3,
        dense: row.4,
        dimension: row.5,
    })
}

pub(super) struct Removed {
    pub(super) run_state: String,
    items: Vec<(String, i64, i64)>,
    documents_left: i64,
}

pub(super) async fn wait_deletion(
    pool: &PgPool,
    job: Uuid,
    timeout: Duration,
) -> Result<Removed, String> {
    let start = Instant::now();
    loop {
        let run_state: String = sqlx::query_scalar(
            "SELECT run_state FROM deletion_jobs WHERE id = $1 AND tenant_id = $2",
        )
        .bind(job)
        .bind(TENANT)
        .fetch_one(pool)
        .await
        .map_err(|e| e.to_string())?;
        if matches!(run_state.as_str(), "succeeded" | "failed" | "canceled")
            || start.elapsed() > timeout
        {
            let items: Vec<(String, i64, i64)> = sqlx::query_as(
                "SELECT kind::text, count(*), count(redacted_at) FROM deletion_job_items WHERE deletion_job_id = $1 \
                 GROUP BY 1 ORDER BY 1",
            )
            .bind(job)
            .fetch_all(pool)
            .await
            .map_err(|e| e.to_string())?;
            let documents_left: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM document_assets d JOIN deletion_jobs j \
                   ON j.knowledge_space_id = d.knowledge_space_id WHERE j.id = $1 AND j.tenant_id = $2",
            )
            .bind(job)
            .bind(TENANT)
            .fetch_one(pool)
            .await
            .map_err(|e| e.to_string())?;
            return Ok(Removed {
                run_state,
                items,
                documents_left,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn print_summary(
    before: &status::Status,
    after: &status::Status,
    model: &ReadModel,
    semantic: &Semantic,
    research: &[(String, serde_json::Value)],
    removed: &Removed,
    kill: &Kill,
    seed: &Seed,
    b: &Worker,
) {
    println!("\n== Summary");
    println!("jobs by kind and final state:");
    let line = |k: &status::KindStatus, note: &str| {
        let states: Vec<String> = k.jobs.iter().map(|(s, n)| format!("{s}={n}")).collect();
        println!("  {:<9} {}{note}", k.kind, states.join("  "));
    };
    for k in &before.kinds {
        line(
            k,
            "  (before the deletion, which removes them with the space's derived data)",
        );
    }
    for k in &after.kinds {
        line(k, "");
    }
    let not_done: i64 = before
        .kinds
        .iter()
        .chain(&after.kinds)
        .flat_map(|k| k.jobs.iter())
        .filter(|(s, _)| !matches!(s.as_str(), "succeeded" | "completed"))
        .map(|(_, n)| n)
        .sum();
    println!(
        "  {}",
        if not_done == 0 {
            "all jobs succeeded".to_owned()
        } else {
            format!("{not_done} job(s) did not succeed")
        }
    );
    println!(
        "read model: head revision {}, {} documents, {} nodes with {} ready fts and {} ready dense-vector \
         projections{}",
        model.head_revision,
        model.documents,
        model.nodes,
        model.fts,
        model.dense,
        model.dimension.map(|d| format!(" (dimension {d})")).unwrap_or_default()
    );
    println!(
        "model-driven space ({}, the offline reasoning model): {} semantic nodes with {} generation \
         receipt(s), {} outline summaries, {} graph entities and {} relations with {} semantic projections",
        super::seed::REASONING_MODEL,
        semantic.nodes,
        semantic.receipts,
        semantic.summaries,
        semantic.entities,
        semantic.relations,
        semantic.projections
    );
    if let Some(s) = &semantic.summary {
        println!(
            "  a section summary: {}",
            s.chars().take(160).collect::<String>()
        );
    }
    if !semantic.sample_entities.is_empty() {
        println!("  entities: {}", semantic.sample_entities.join(", "));
    }
    println!("research answers:");
    for (q, r) in research {
        println!("  Q: {q}");
        let answer = r.get("answer").and_then(|a| a.as_str()).unwrap_or("");
        println!("  A: {}", answer.replace('\n', " "));
        let mut cited: Vec<String> = r
            .get("citations")
            .and_then(|c| c.as_array())
            .map(|c| {
                c.iter()
                    .filter_map(|x| x.get("filename")?.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        cited.sort();
        cited.dedup();
        println!(
            "     cites: {}",
            if cited.is_empty() {
                "nothing".into()
            } else {
                cited.join(", ")
            }
        );
    }
    println!("deletion of source \"notes\" ({}):", removed.run_state);
    for (kind, n, redacted) in &removed.items {
        println!("  {kind:<17} {n} removed, {redacted} keys redacted");
    }
    println!(
        "  documents left in the space: {} of {}",
        removed.documents_left,
        seed.documents.len()
    );
    match kill.takeover {
        Some(t) => println!(
            "takeover: demo-a was killed holding {} job(s); demo-b took over in {:.0} ms",
            kill.held,
            t.as_secs_f64() * 1000.0
        ),
        None => println!(
            "takeover: demo-a was killed holding {} job(s); nothing to take over",
            kill.held
        ),
    }
    if b.http != "off" {
        println!("dashboard: http://{}/", b.http);
        println!("metrics:   http://{}/metrics", b.http);
        println!("health:    http://{}/healthz and /readyz", b.http);
    }
}
