//! The compile steps that build the document's read model, inside the engine's fenced
//! transaction: `parsed → outline_built` (outline, page index, knowledge paths, multimodal
//! manifest) and `outline_built → nodes_generated` (knowledge nodes and their projections).
//! Invariant: every row written is of the attempt's own space, document and publication
//! generation, has the platform's deterministic id and is inserted `ON CONFLICT DO NOTHING`, so
//! a step repeated after a crash writes its rows once; projections are written `building` and
//! only the publish promotes them.

use serde_json::{json, Value};
use sqlx::PgConnection;
use uuid::Uuid;

use super::chunk;
use super::multimodal;
use super::outline;
use super::page_index;
use super::paths;
use super::steps::{load_artifact, Artifact, Attempt, Document};
use crate::canonical::{child_id, normalize_fts_text};
use crate::embed::{Embedder, Input};
use crate::jobs::JobError;

pub const FTS_MODEL: &str = super::candidate::FTS_MODEL;

/// parsed → outline_built: the outline, its page index (`building`), the document's knowledge
/// paths and its multimodal manifest, all of this generation.
pub(crate) async fn outline_step(
    conn: &mut PgConnection,
    a: &Attempt,
    d: &Document,
    summarise: Option<&super::semantic::Selection>,
) -> Result<(), JobError> {
    let art = load_artifact(conn, a).await?;
    let mut o = outline::build(
        a.generation,
        a.document,
        a.version,
        &art.elements,
        &art.parser,
        &art.parser_version,
        &art.content_type,
    );
    if let Some(sel) = summarise {
        super::semantic::summarised(conn, a, sel, &art.elements, &mut o.nodes, &mut o.metadata)
            .await?;
    }
    sqlx::query(
        "INSERT INTO document_outlines (id, knowledge_space_id, publication_generation_id, document_asset_id, \
           parse_artifact_id, artifact_hash, outline_version, version, nodes, metadata, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, now()) ON CONFLICT DO NOTHING",
    )
    .bind(o.id)
    .bind(a.space)
    .bind(a.generation)
    .bind(a.document)
    .bind(art.id)
    .bind(&art.hash)
    .bind(outline::OUTLINE_VERSION)
    .bind(a.version)
    .bind(&o.nodes)
    .bind(&o.metadata)
    .execute(&mut *conn)
    .await?;
    write_page_index(
        conn,
        a.space,
        a.generation,
        a.document,
        a.version,
        o.id,
        &o.nodes,
    )
    .await?;
    let rows = paths::build(
        a.generation,
        &paths::Doc {
            tenant: &a.tenant,
            id: a.document,
            filename: &d.filename,
            mime_type: &d.mime_type,
            object_key: &d.object_key,
        },
        o.id,
        &o.nodes,
    );
    let ids: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
    let vpaths: Vec<String> = rows.iter().map(|r| r.virtual_path.clone()).collect();
    let metas: Vec<Value> = rows.iter().map(|r| r.metadata.clone()).collect();
    sqlx::query(
        "INSERT INTO knowledge_paths (id, knowledge_space_id, publication_generation_id, virtual_path, resource_type, \
           target_id, version, view_name, view_type, metadata) \
         SELECT t.id, $1, $2, t.path, 'document', $3, $4, 'docs', 'physical', t.meta \
         FROM unnest($5::uuid[], $6::text[], $7::jsonb[]) AS t(id, path, meta) \
         ON CONFLICT DO NOTHING",
    )
    .bind(a.space)
    .bind(a.generation)
    .bind(a.document.to_string())
    .bind(a.version)
    .bind(&ids)
    .bind(&vpaths)
    .bind(&metas)
    .execute(&mut *conn)
    .await?;
    let (items, meta) = multimodal::build(art.id, &art.elements);
    sqlx::query(
        "INSERT INTO document_multimodal_manifests (id, knowledge_space_id, publication_generation_id, \
           document_asset_id, parse_artifact_id, artifact_hash, manifest_version, version, items, metadata, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, now()) ON CONFLICT DO NOTHING",
    )
    .bind(multimodal::manifest_id(a.generation, a.document, a.version))
    .bind(a.space)
    .bind(a.generation)
    .bind(a.document)
    .bind(art.id)
    .bind(&art.hash)
    .bind(multimodal::MANIFEST_VERSION)
    .bind(a.version)
    .bind(items)
    .bind(meta)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Writes the page index of an outline, `building`, once: a manifest that exists already is left
/// as it is.
pub(crate) async fn write_page_index(
    conn: &mut PgConnection,
    space: Uuid,
    generation: Uuid,
    document: Uuid,
    version: i32,
    outline_id: Uuid,
    nodes: &Value,
) -> Result<(), JobError> {
    let pi = page_index::build(outline_id, generation, nodes)
        .map_err(|e| JobError::fatal("page_index_invalid", e))?;
    let created = sqlx::query(
        "INSERT INTO page_index_manifests (id, knowledge_space_id, publication_generation_id, document_asset_id, \
           document_outline_id, document_version, tokenizer_version, status, node_count, term_count, checksum, \
           created_at, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, 'building', $8, $9, $10, now(), now()) ON CONFLICT DO NOTHING",
    )
    .bind(pi.manifest_id)
    .bind(space)
    .bind(generation)
    .bind(document)
    .bind(outline_id)
    .bind(version)
    .bind(page_index::TOKENIZER_VERSION)
    .bind(i32::try_from(pi.nodes.len()).unwrap_or(i32::MAX))
    .bind(i32::try_from(pi.terms.len()).unwrap_or(i32::MAX))
    .bind(&pi.checksum)
    .execute(&mut *conn)
    .await?;
    if created.rows_affected() == 0 {
        return Ok(());
    }
    for chunk in pi.nodes.chunks(1000) {
        sqlx::query(
            "INSERT INTO page_index_nodes (id, manifest_id, outline_node_id, parent_outline_node_id, title, summary, \
               section_path, visited_node_ids, level, start_offset, end_offset, toc_source) \
             SELECT t.id, $1, t.node, t.parent, t.title, t.summary, t.path, t.visited, t.level, t.s, t.e, t.toc \
             FROM unnest($2::uuid[], $3::text[], $4::text[], $5::text[], $6::text[], $7::jsonb[], $8::jsonb[], \
               $9::int4[], $10::int4[], $11::int4[], $12::text[]) \
               AS t(id, node, parent, title, summary, path, visited, level, s, e, toc)",
        )
        .bind(pi.manifest_id)
        .bind(chunk.iter().map(|n| n.id).collect::<Vec<_>>())
        .bind(chunk.iter().map(|n| n.outline_node_id.clone()).collect::<Vec<_>>())
        .bind(chunk.iter().map(|n| n.parent_outline_node_id.clone()).collect::<Vec<_>>())
        .bind(chunk.iter().map(|n| n.title.clone()).collect::<Vec<_>>())
        .bind(chunk.iter().map(|n| n.summary.clone()).collect::<Vec<_>>())
        .bind(chunk.iter().map(|n| n.section_path.clone()).collect::<Vec<_>>())
        .bind(chunk.iter().map(|n| n.visited_node_ids.clone()).collect::<Vec<_>>())
        .bind(chunk.iter().map(|n| n.level).collect::<Vec<_>>())
        .bind(chunk.iter().map(|n| n.start_offset).collect::<Vec<_>>())
        .bind(chunk.iter().map(|n| n.end_offset).collect::<Vec<_>>())
        .bind(chunk.iter().map(|n| n.toc_source.clone()).collect::<Vec<_>>())
        .execute(&mut *conn)
        .await?;
    }
    for chunk in pi.terms.chunks(1000) {
        sqlx::query(
            "INSERT INTO page_index_terms (id, knowledge_space_id, manifest_id, page_index_node_id, term, field_mask) \
             SELECT t.id, $1, $2, t.node, t.term, t.mask \
             FROM unnest($3::uuid[], $4::uuid[], $5::text[], $6::int4[]) AS t(id, node, term, mask)",
        )
        .bind(space)
        .bind(pi.manifest_id)
        .bind(chunk.iter().map(|t| t.id).collect::<Vec<_>>())
        .bind(chunk.iter().map(|t| t.node).collect::<Vec<_>>())
        .bind(chunk.iter().map(|t| t.term.clone()).collect::<Vec<_>>())
        .bind(chunk.iter().map(|t| t.field_mask).collect::<Vec<_>>())
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// The text a node is indexed by: its section path and its text.
pub fn index_text(section_path: &[String], text: &str) -> String {
    let path = section_path
        .iter()
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join(" > ");
    [path.as_str(), text.trim()]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// outline_built → nodes_generated: the document's knowledge nodes of this generation, a
/// `building` full-text projection of each, and a `building` dense projection of each where the
/// space has an active embedding profile.
pub(crate) async fn nodes_step(
    conn: &mut PgConnection,
    embedder: &dyn Embedder,
    a: &Attempt,
    d: &Document,
) -> Result<usize, JobError> {
    let art = load_artifact(conn, a).await?;
    let drafts = chunk::chunk(&art.elements, art.id, &art.hash);
    if drafts.is_empty() {
        return Err(JobError::fatal(
            "empty_document",
            format!("{:?} has no text to compile", d.filename),
        ));
    }
    let ids: Vec<Uuid> = drafts
        .iter()
        .map(|n| child_id(a.generation, &format!("knowledge-node:{}", n.chunk_id)))
        .collect();
    write_nodes(conn, embedder, a, d, &art, &ids, &drafts).await?;
    Ok(drafts.len())
}

/// Writes the knowledge nodes `ids` (of `drafts`) of this generation, a `building` full-text
/// projection of each, and a `building` dense projection of each where the attempt froze an
/// embedding profile.
pub(crate) async fn write_nodes(
    conn: &mut PgConnection,
    embedder: &dyn Embedder,
    a: &Attempt,
    d: &Document,
    art: &Artifact,
    ids: &[Uuid],
    drafts: &[chunk::Draft],
) -> Result<(), JobError> {
    let int = |n: usize| i32::try_from(n).unwrap_or(i32::MAX);
    let locations: Vec<Value> = drafts
        .iter()
        .map(|n| {
            let mut v = json!({ "sectionPath": n.section_path, "startOffset": n.start, "endOffset": n.end });
            if let Some(p) = n.page_number {
                v["pageNumber"] = json!(p);
            }
            v
        })
        .collect();
    sqlx::query(
        "INSERT INTO knowledge_nodes (id, knowledge_space_id, publication_generation_id, document_asset_id, \
           parse_artifact_id, kind, text, start_offset, end_offset, source_location, permission_scope, artifact_hash, \
           metadata) \
         SELECT t.id, $1, $2, $3, $4, t.kind, t.text, t.s, t.e, t.loc, $5, $6, t.meta \
         FROM unnest($7::uuid[], $8::text[], $9::text[], $10::int4[], $11::int4[], $12::jsonb[], $13::jsonb[]) \
           AS t(id, kind, text, s, e, loc, meta) \
         ON CONFLICT DO NOTHING",
    )
    .bind(a.space)
    .bind(a.generation)
    .bind(a.document)
    .bind(art.id)
    .bind(&d.permission_scope)
    .bind(&art.hash)
    .bind(ids)
    .bind(drafts.iter().map(|n| n.kind).collect::<Vec<_>>())
    .bind(drafts.iter().map(|n| n.text.clone()).collect::<Vec<_>>())
    .bind(drafts.iter().map(|n| int(n.start)).collect::<Vec<_>>())
    .bind(drafts.iter().map(|n| int(n.end)).collect::<Vec<_>>())
    .bind(&locations)
    .bind(drafts.iter().map(|n| n.metadata.clone()).collect::<Vec<_>>())
    .execute(&mut *conn)
    .await?;
    let texts: Vec<String> = drafts
        .iter()
        .map(|n| index_text(&n.section_path, &n.text))
        .collect();
    let pv = a.version;
    let base_meta = || {
        json!({ "artifactHash": art.hash, "documentAssetId": a.document, "indexingStrategy": "section-context-v1",
                "parseArtifactId": art.id })
    };
    let fts_ids: Vec<Uuid> = ids
        .iter()
        .map(|id| {
            child_id(
                id,
                &format!(
                    "projection:fts:{pv}:{FTS_MODEL}:publication-generation:{}",
                    a.generation
                ),
            )
        })
        .collect();
    let fts_texts: Vec<String> = texts.iter().map(|t| normalize_fts_text(t)).collect();
    let fts_meta: Vec<Value> = fts_texts
        .iter()
        .map(|t| {
            let mut m = base_meta();
            m["ftsLanguageStrategy"] = json!("mixed-cjk-latin-v1");
            m["ftsText"] = json!(t);
            m["parser"] = json!("database-fts");
            m
        })
        .collect();
    sqlx::query(
        "INSERT INTO index_projections (id, knowledge_space_id, publication_generation_id, node_id, type, status, model, \
           projection_version, dense_vector, visual_vector, fts_document, metadata) \
         SELECT t.id, $1, $2, t.node, 'fts', 'building', $3, $4, NULL, NULL, to_tsvector('simple', t.text), t.meta \
         FROM unnest($5::uuid[], $6::uuid[], $7::text[], $8::jsonb[]) AS t(id, node, text, meta) \
         ON CONFLICT DO NOTHING",
    )
    .bind(a.space)
    .bind(a.generation)
    .bind(FTS_MODEL)
    .bind(pv)
    .bind(&fts_ids)
    .bind(ids)
    .bind(&fts_texts)
    .bind(&fts_meta)
    .execute(&mut *conn)
    .await?;
    if let Some((profile, _)) = a.embedding.clone() {
        let out = embedder
            .embed(&profile, &texts, Input::Document)
            .await
            .and_then(|e| crate::embed::check(&profile, texts.len(), &e).map(|()| e))
            .map_err(|e| match e {
                crate::embed::EmbedError::Unavailable(m) => {
                    JobError::retryable("embedder_unavailable", m)
                }
                crate::embed::EmbedError::Rejected(m) => JobError::fatal("embedder_rejected", m),
            })?;
        let vsid = &profile.vector_space_id;
        let dense_ids: Vec<Uuid> = ids
            .iter()
            .map(|id| {
                child_id(
                    id,
                    &format!(
                        "projection:dense:{pv}:{vsid}:publication-generation:{}",
                        a.generation
                    ),
                )
            })
            .collect();
        let vectors: Vec<String> = out
            .vectors
            .iter()
            .map(|v| serde_json::to_string(v).unwrap_or_else(|_| "[]".into()))
            .collect();
        let metas: Vec<Value> = out
            .vectors
            .iter()
            .map(|v| {
                let mut m = base_meta();
                m["denseVector"] = json!(v);
                m["dimension"] = json!(profile.dimension);
                m["embeddingModel"] = json!(out.model);
                m["embeddingProfile"] = json!({ "pluginId": profile.plugin_id, "provider": profile.provider,
                                                "revision": profile.revision });
                m["embeddingProvider"] = json!(embedder.name());
                m["modelVersion"] = json!(out.model);
                m["vectorSpaceId"] = json!(vsid);
                m
            })
            .collect();
        sqlx::query(
            "INSERT INTO index_projections (id, knowledge_space_id, publication_generation_id, node_id, type, status, \
               model, projection_version, dense_vector, visual_vector, fts_document, metadata) \
             SELECT t.id, $1, $2, t.node, 'dense-vector', 'building', $3, $4, t.vec::vector, NULL, NULL, t.meta \
             FROM unnest($5::uuid[], $6::uuid[], $7::text[], $8::jsonb[]) AS t(id, node, vec, meta) \
             ON CONFLICT DO NOTHING",
        )
        .bind(a.space)
        .bind(a.generation)
        .bind(vsid)
        .bind(pv)
        .bind(&dense_ids)
        .bind(ids)
        .bind(&vectors)
        .bind(&metas)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_are_indexed_by_path_and_text() {
        assert_eq!(
            index_text(&["Guide".into(), " Install ".into()], " Run it. "),
            "Guide > Install\n\nRun it."
        );
        assert_eq!(index_text(&[], "Alone"), "Alone");
        assert_eq!(index_text(&["Only".into()], "  "), "Only");
    }
}
