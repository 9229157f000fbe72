//! `outline_built → nodes_generated` of a model-driven attempt, inside the engine's fenced
//! transaction: the semantic nodes from the checkpointed windows with their full-text and dense
//! projections, the generation's receipt, its graph, and the graph's semantic projections.
//! Invariant: no model is called here (only the embedder, as for every node); every row is of
//! the attempt's own space and generation with a deterministic key, inserted `ON CONFLICT DO
//! NOTHING` (projections, keyed by owner and vector space, are rewritten to the same values), so
//! a step repeated after a crash writes the same rows once.

use std::collections::HashMap;

use serde_json::{json, Value};
use sqlx::PgConnection;
use uuid::Uuid;

use super::graph::{self, GraphNode};
use super::nodes::{self, Identity};
use super::{chunks, planned, Selection};
use crate::embed::{Embedder, Input};
use crate::jobs::compile::build;
use crate::jobs::compile::steps::{load_artifact, Attempt, Document};
use crate::jobs::JobError;

/// What the step wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Written {
    pub nodes: usize,
    pub entities: usize,
    pub relations: usize,
}

pub(crate) async fn nodes_step(
    conn: &mut PgConnection,
    embedder: &dyn Embedder,
    a: &Attempt,
    d: &Document,
    sel: &Selection,
) -> Result<Written, JobError> {
    let art = load_artifact(conn, a).await?;
    let p = planned(&art)?;
    let chunks = chunks(conn, a, sel, &p).await?;
    if chunks.is_empty() {
        return Err(JobError::fatal(
            "empty_document",
            format!("{:?} has no text to compile", d.filename),
        ));
    }
    let selection = sel.to_json();
    let id = Identity {
        space: a.space,
        document: a.document,
        generation: a.generation,
        artifact: art.id,
        hash: &art.hash,
        selection: &selection,
        permission_scope: &d.permission_scope,
    };
    let built = nodes::build(&id, &p, &chunks, &sel.model);
    let ids: Vec<Uuid> = built.iter().map(|n| n.id).collect();
    let drafts: Vec<_> = built.iter().map(|n| n.draft.clone()).collect();
    build::write_nodes(conn, embedder, a, d, &art, &ids, &drafts).await?;
    let r = nodes::receipt(&id, &p, &built, &chunks);
    sqlx::query(
        "INSERT INTO knowledge_node_generation_receipts (knowledge_space_id, publication_generation_id, \
           parse_artifact_id, document_asset_id, artifact_hash, document_chunk_count, stored_node_count, \
           request_fingerprint, response_fingerprint, prompt_response_fingerprint, receipt) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT DO NOTHING",
    )
    .bind(a.space)
    .bind(a.generation)
    .bind(art.id)
    .bind(a.document)
    .bind(&art.hash)
    .bind(r.chunk_count)
    .bind(r.stored_count)
    .bind(&r.request_fingerprint)
    .bind(&r.response_fingerprint)
    .bind(&r.prompt_response_fingerprint)
    .bind(&r.receipt)
    .execute(&mut *conn)
    .await?;
    let empty: Vec<Value> = Vec::new();
    let graph_nodes: Vec<GraphNode<'_>> = built
        .iter()
        .map(|n| GraphNode {
            id: n.id,
            text: &n.draft.text,
            permission_scope: &d.permission_scope,
            entities: n.draft.metadata["extractedEntities"]
                .as_array()
                .map_or(&empty[..], Vec::as_slice),
            relations: n.draft.metadata["extractedRelations"]
                .as_array()
                .map_or(&empty[..], Vec::as_slice),
        })
        .collect();
    let (entities, relations) = graph::build(a.space, a.generation, &graph_nodes);
    write_graph(conn, a, &entities, &relations).await?;
    if let Some((profile, _)) = a.embedding.clone() {
        let texts: HashMap<Uuid, &str> = built
            .iter()
            .map(|n| (n.id, n.draft.text.as_str()))
            .collect();
        let entity_texts: Vec<(Uuid, String)> = entities
            .iter()
            .map(|e| {
                (
                    e.id,
                    graph::entity_text(e, |id| texts.get(&id).map(|t| (*t).to_owned())),
                )
            })
            .collect();
        project(
            conn,
            embedder,
            &profile,
            a,
            "graph_entity_semantic_projections",
            &entity_texts,
        )
        .await?;
        let relation_texts: Vec<(Uuid, String)> = relations
            .iter()
            .map(|r| (r.id, graph::relation_text(&r.kind)))
            .collect();
        project(
            conn,
            embedder,
            &profile,
            a,
            "graph_relation_semantic_projections",
            &relation_texts,
        )
        .await?;
    }
    Ok(Written {
        nodes: built.len(),
        entities: entities.len(),
        relations: relations.len(),
    })
}

pub(crate) async fn write_graph(
    conn: &mut PgConnection,
    a: &Attempt,
    entities: &[graph::EntityRow],
    relations: &[graph::RelationRow],
) -> Result<(), JobError> {
    let created: chrono::DateTime<chrono::Utc> = a.created_at;
    if !entities.is_empty() {
        sqlx::query(
            "INSERT INTO graph_entities (id, knowledge_space_id, publication_generation_id, canonical_key, type, name, \
               aliases, confidence, source_node_ids, permission_scope, metadata, extraction_version, created_at, updated_at) \
             SELECT t.id, $1, $2, t.key, t.type, t.name, t.aliases, t.confidence, t.sources, t.scope, t.meta, $3, $4, $4 \
             FROM unnest($5::uuid[], $6::text[], $7::text[], $8::text[], $9::jsonb[], $10::float8[], $11::jsonb[], \
               $12::jsonb[], $13::jsonb[]) AS t(id, key, type, name, aliases, confidence, sources, scope, meta) \
             ON CONFLICT DO NOTHING",
        )
        .bind(a.space)
        .bind(a.generation)
        .bind(graph::EXTRACTION_VERSION)
        .bind(created)
        .bind(entities.iter().map(|e| e.id).collect::<Vec<_>>())
        .bind(entities.iter().map(|e| e.canonical_key.clone()).collect::<Vec<_>>())
        .bind(entities.iter().map(|e| e.kind.clone()).collect::<Vec<_>>())
        .bind(entities.iter().map(|e| e.name.clone()).collect::<Vec<_>>())
        .bind(entities.iter().map(|e| json!(e.aliases)).collect::<Vec<_>>())
        .bind(entities.iter().map(|e| e.confidence).collect::<Vec<_>>())
        .bind(entities.iter().map(|e| json!(e.source_node_ids)).collect::<Vec<_>>())
        .bind(entities.iter().map(|e| json!(e.permission_scope)).collect::<Vec<_>>())
        .bind(entities.iter().map(|e| e.metadata.clone()).collect::<Vec<_>>())
        .execute(&mut *conn)
        .await?;
    }
    if !relations.is_empty() {
        sqlx::query(
            "INSERT INTO graph_relations (id, knowledge_space_id, publication_generation_id, subject_entity_id, \
               object_entity_id, type, confidence, source_node_ids, permission_scope, metadata, extraction_version, \
               created_at, updated_at) \
             SELECT t.id, $1, $2, t.subject, t.object, t.type, t.confidence, t.sources, t.scope, t.meta, $3, $4, $4 \
             FROM unnest($5::uuid[], $6::uuid[], $7::uuid[], $8::text[], $9::float8[], $10::jsonb[], $11::jsonb[], \
               $12::jsonb[]) AS t(id, subject, object, type, confidence, sources, scope, meta) \
             ON CONFLICT DO NOTHING",
        )
        .bind(a.space)
        .bind(a.generation)
        .bind(graph::EXTRACTION_VERSION)
        .bind(created)
        .bind(relations.iter().map(|r| r.id).collect::<Vec<_>>())
        .bind(relations.iter().map(|r| r.subject).collect::<Vec<_>>())
        .bind(relations.iter().map(|r| r.object).collect::<Vec<_>>())
        .bind(relations.iter().map(|r| r.kind.clone()).collect::<Vec<_>>())
        .bind(relations.iter().map(|r| r.confidence).collect::<Vec<_>>())
        .bind(relations.iter().map(|r| json!(r.source_node_ids)).collect::<Vec<_>>())
        .bind(relations.iter().map(|r| json!(r.permission_scope)).collect::<Vec<_>>())
        .bind(relations.iter().map(|r| r.metadata.clone()).collect::<Vec<_>>())
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// The semantic projections of graph owners in `table`: each distinct text embedded once, in
/// batches of [`graph::EMBED_BATCH`].
pub(crate) async fn project(
    conn: &mut PgConnection,
    embedder: &dyn Embedder,
    profile: &crate::embed::Profile,
    a: &Attempt,
    table: &str,
    owners: &[(Uuid, String)],
) -> Result<(), JobError> {
    let mut distinct: Vec<String> = owners.iter().map(|(_, t)| t.clone()).collect();
    distinct.sort();
    distinct.dedup();
    let mut vectors: HashMap<String, String> = HashMap::new();
    for batch in distinct.chunks(graph::EMBED_BATCH) {
        let out = embedder
            .embed(profile, batch, Input::Document)
            .await
            .and_then(|e| crate::embed::check(profile, batch.len(), &e).map(|()| e))
            .map_err(|e| match e {
                crate::embed::EmbedError::Unavailable(m) => {
                    JobError::retryable("embedder_unavailable", m)
                }
                crate::embed::EmbedError::Rejected(m) => JobError::fatal("embedder_rejected", m),
            })?;
        for (t, v) in batch.iter().zip(out.vectors) {
            vectors.insert(
                t.clone(),
                serde_json::to_string(&v).unwrap_or_else(|_| "[]".into()),
            );
        }
    }
    let dim = i32::try_from(profile.dimension).unwrap_or(i32::MAX);
    sqlx::query(&format!(
        "INSERT INTO {table} (owner_id, knowledge_space_id, publication_generation_id, vector_space_id, dimension, \
           representation_version, content_hash, search_text, vector, created_at) \
         SELECT t.owner, $1, $2, $3, $4, $5, t.hash, t.text, t.vec::vector, now() \
         FROM unnest($6::uuid[], $7::text[], $8::text[], $9::text[]) AS t(owner, hash, text, vec) \
         ON CONFLICT (owner_id, vector_space_id) DO UPDATE SET dimension = EXCLUDED.dimension, \
           representation_version = EXCLUDED.representation_version, content_hash = EXCLUDED.content_hash, \
           search_text = EXCLUDED.search_text, vector = EXCLUDED.vector \
         WHERE {table}.content_hash IS DISTINCT FROM EXCLUDED.content_hash"
    ))
    .bind(a.space)
    .bind(a.generation)
    .bind(&profile.vector_space_id)
    .bind(dim)
    .bind(graph::REPRESENTATION_VERSION)
    .bind(owners.iter().map(|(id, _)| *id).collect::<Vec<_>>())
    .bind(owners.iter().map(|(_, t)| graph::content_hash(t)).collect::<Vec<_>>())
    .bind(owners.iter().map(|(_, t)| t.clone()).collect::<Vec<_>>())
    .bind(owners.iter().map(|(_, t)| vectors.get(t).cloned().unwrap_or_default()).collect::<Vec<_>>())
    .execute(&mut *conn)
    .await?;
    Ok(())
}
