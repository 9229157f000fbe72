//! Knowledge nodes from semantic chunks, and the node generation receipt (platform migration
//! 0043). Invariant: pure functions of the planned windows, their validated chunks and the
//! attempt's identity: a node's id is `child_id(generation, "llm-semantic-v1:<artifact>:<hash>:
//! <start>:<end>")`, its text the canonical text between its first unit's start and its last
//! unit's end (UTF-8 bytes), and the receipt's fingerprints are the platform's `sha256:` digests
//! of stable JSON, so a replay of the same checkpoints gives the same rows byte for byte.

use serde_json::{json, Value};
use uuid::Uuid;

use super::answer::Chunk;
use super::plan::{self, Unit};
use super::Planned;
use crate::canonical::{child_id, stable_json};
use crate::jobs::compile::chunk::Draft;

/// `sha256:` of the stable JSON of `v`.
pub fn digest(v: &Value) -> String {
    crate::model::fingerprint(&stable_json(v))
}

/// One semantic node: its id and what the node writer needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub id: Uuid,
    pub draft: Draft,
    pub window: usize,
}

/// What the nodes are made under.
pub struct Identity<'a> {
    pub space: Uuid,
    pub document: Uuid,
    pub generation: Uuid,
    pub artifact: Uuid,
    pub hash: &'a str,
    pub selection: &'a Value,
    pub permission_scope: &'a Value,
}

fn kind_of(units: &[Unit]) -> &'static str {
    let first = &units[0];
    if units.iter().all(|u| u.element == first.element) {
        match first.element_type.as_str() {
            "image" => return "image",
            "table" => return "table",
            _ => {}
        }
    }
    "chunk"
}

/// The nodes of the chunks, in document order (`chunkIndex` from 0).
pub fn build(
    id: &Identity<'_>,
    p: &Planned,
    chunks: &[(usize, Chunk, Value)],
    model: &str,
) -> Vec<Node> {
    let count = chunks.len();
    chunks
        .iter()
        .enumerate()
        .map(|(index, (wi, c, completion))| {
            let units = &p.units[c.units.clone()];
            let (first, last) = (&units[0], &units[units.len() - 1]);
            let (start, end) = (first.start, last.end);
            let text = p.canonical.get(start..end).unwrap_or_default().to_owned();
            let page = first
                .page_number
                .filter(|pg| units.iter().all(|u| u.page_number == Some(*pg)));
            let w = &p.windows[*wi];
            let entities: Vec<Value> = c
                .entities
                .iter()
                .map(|e| {
                    let mut meta = json!({ "responseEntityId": e.id, "source": "llm-semantic-chunking" });
                    if let Some(n) = &e.canonical_name {
                        meta["canonicalName"] = json!(n);
                    }
                    if !e.aliases.is_empty() {
                        meta["aliases"] = json!(e.aliases);
                    }
                    json!({ "confidence": e.confidence, "metadata": meta, "text": e.text, "type": e.kind })
                })
                .collect();
            let name_of = |eid: &str| {
                c.entities
                    .iter()
                    .find(|e| e.id == eid)
                    .map(|e| e.canonical_name.clone().unwrap_or_else(|| e.text.clone()))
                    .unwrap_or_default()
            };
            let relations: Vec<Value> = c
                .relations
                .iter()
                .map(|r| {
                    json!({ "confidence": r.confidence,
                            "metadata": { "objectEntityId": r.object, "source": "llm-semantic-chunking",
                                          "subjectEntityId": r.subject },
                            "object": name_of(&r.object), "subject": name_of(&r.subject), "type": r.kind })
                })
                .collect();
            let mut element_ids: Vec<String> = Vec::new();
            let mut element_types: Vec<String> = Vec::new();
            for u in units {
                if !element_ids.contains(&u.element_id) {
                    element_ids.push(u.element_id.clone());
                    element_types.push(u.element_type.clone());
                }
            }
            let mut section = json!({ "path": c.section_path });
            if let Some(s) = &c.summary {
                section["summary"] = json!(s);
            }
            let unit_range = |r: &std::ops::Range<usize>| {
                json!({ "startUnitId": p.units[r.start].id, "endUnitId": p.units[r.end - 1].id })
            };
            let mut marker = json!({
                "completed": true,
                "completion": { "actual": completion, "requested": id.selection },
                "documentChunkCount": count,
                "inputFingerprint": plan::input_fingerprint(&p.units, w),
                "maxChunkChars": plan::MAX_CHUNK_GRAPHEMES,
                "model": model,
                "modelSelection": id.selection,
                "overlapApplied": false,
                "overlapPolicy": "non-overlapping-semantic-output",
                "promptVersion": plan::PROMPT_VERSION,
                "requestedOverlapChars": 0,
                "schemaVersion": plan::SCHEMA_VERSION,
                "section": section,
                "sourceSpans": units.iter().map(|u| json!({ "elementId": u.element_id, "elementType": u.element_type,
                    "endOffset": u.end, "sectionPath": u.section_path, "startOffset": u.start })).collect::<Vec<_>>(),
                "strategy": plan::STRATEGY,
                "unitRange": unit_range(&c.units),
                "windowCoreUnitRange": unit_range(&w.core),
                "windowId": w.id,
                "windowPlanning": { "atomicDocument": w.atomic, "version": plan::PLANNING_VERSION },
            });
            if !w.look_ahead.is_empty() {
                marker["windowLookAheadUnitRange"] = unit_range(&w.look_ahead);
            }
            let extraction = |count_key: &str, n: usize| {
                json!({ "completed": true, count_key: n, "model": model,
                        "promptVersion": plan::PROMPT_VERSION, "source": plan::STRATEGY })
            };
            let metadata = json!({
                "chunkIndex": index,
                "elementIds": element_ids,
                "elementSeparator": "\n",
                "elementTypes": element_types,
                "entityExtraction": extraction("entityCount", entities.len()),
                "extractedEntities": entities,
                "extractedRelations": relations,
                "offsetEncoding": "utf-8-bytes",
                "relationExtraction": extraction("relationCount", relations.len()),
                "semanticChunking": marker,
                "textNormalization": "unicode-whitespace-trim",
            });
            let node_id = child_id(
                id.generation,
                &format!("llm-semantic-v1:{}:{}:{start}:{end}", id.artifact, id.hash),
            );
            Node {
                id: node_id,
                window: *wi,
                draft: Draft {
                    chunk_id: node_id,
                    kind: kind_of(units),
                    text,
                    start,
                    end,
                    section_path: c.section_path.clone(),
                    page_number: page,
                    metadata,
                },
            }
        })
        .collect()
}

/// A node as the receipt's response fingerprints see it.
fn payload(n: &Node) -> Value {
    let m = &n.draft.metadata;
    let mut loc = json!({ "endOffset": n.draft.end, "sectionPath": n.draft.section_path,
                          "startOffset": n.draft.start });
    if let Some(p) = n.draft.page_number {
        loc["pageNumber"] = json!(p);
    }
    json!({ "chunkIndex": m["chunkIndex"], "endOffset": n.draft.end, "entityExtraction": m["entityExtraction"],
            "extractedEntities": m["extractedEntities"], "extractedRelations": m["extractedRelations"],
            "id": n.id, "kind": n.draft.kind, "relationExtraction": m["relationExtraction"],
            "semanticChunking": m["semanticChunking"], "sourceLocation": loc, "startOffset": n.draft.start,
            "text": n.draft.text })
}

/// The receipt row's values.
#[derive(Clone, Debug, PartialEq)]
pub struct Receipt {
    pub request_fingerprint: String,
    pub response_fingerprint: String,
    pub prompt_response_fingerprint: String,
    pub chunk_count: i32,
    pub stored_count: i32,
    pub receipt: Value,
}

/// The generation's receipt: what was asked (the request), what each window answered (the
/// manifest and the completion catalog), and the nodes stored.
pub fn receipt(
    id: &Identity<'_>,
    p: &Planned,
    nodes: &[Node],
    chunks: &[(usize, Chunk, Value)],
) -> Receipt {
    let semantic_config = json!({ "maxChunkChars": plan::MAX_CHUNK_GRAPHEMES, "maxNodes": 20_000,
        "maxWindowChars": plan::MAX_WINDOW_GRAPHEMES, "overlapChars": 0, "promptVersion": plan::PROMPT_VERSION });
    let request = json!({ "artifactHash": id.hash, "documentAssetId": id.document, "excludedNodeOrdinals": [],
        "knowledgeSpaceId": id.space, "modelSelection": id.selection, "parseArtifactId": id.artifact,
        "permissionScope": id.permission_scope, "publicationGenerationId": id.generation,
        "semanticConfig": semantic_config });
    let request_fingerprint = digest(&request);
    let mut catalog: Vec<Value> = Vec::new();
    let mut manifest = Vec::new();
    for (wi, w) in p.windows.iter().enumerate() {
        let mine: Vec<usize> = (0..nodes.len())
            .filter(|&i| nodes[i].window == wi)
            .collect();
        let completion = mine
            .first()
            .map(|&i| chunks[i].2.clone())
            .unwrap_or_else(|| json!({}));
        let mut entry = completion.clone();
        entry["fingerprint"] = json!(digest(&completion));
        let index = catalog.iter().position(|c| *c == entry).unwrap_or_else(|| {
            catalog.push(entry);
            catalog.len() - 1
        });
        let range =
            |r: &std::ops::Range<usize>| json!([p.units[r.start].id, p.units[r.end - 1].id]);
        let mut m = json!({
            "chunkRanges": mine.iter().map(|&i| range(&chunks[i].1.units)).collect::<Vec<_>>(),
            "committedUnitRange": range(&w.core),
            "completionIndex": index,
            "coreUnitRange": range(&w.core),
            "firstChunkIndex": mine.first().copied().unwrap_or(0),
            "inputFingerprint": plan::input_fingerprint(&p.units, w),
            "responseFingerprint": digest(&Value::Array(mine.iter().map(|&i| payload(&nodes[i])).collect())),
            "windowId": w.id,
        });
        if !w.look_ahead.is_empty() {
            m["lookAheadUnitRange"] = range(&w.look_ahead);
        }
        manifest.push(m);
    }
    let response_fingerprint =
        digest(&json!({ "completionCatalog": catalog, "windowManifest": manifest }));
    let prompt_response_fingerprint = digest(&json!({ "requestFingerprint": request_fingerprint,
                                                      "responseFingerprint": response_fingerprint }));
    let stored = digest(&Value::Array(nodes.iter().map(payload).collect()));
    let count = i32::try_from(nodes.len()).unwrap_or(i32::MAX);
    let receipt = json!({
        "artifactHash": id.hash, "completionCatalog": catalog, "documentAssetId": id.document,
        "documentChunkCount": count, "excludedNodeOrdinals": [], "knowledgeSpaceId": id.space,
        "modelSelection": id.selection, "parseArtifactId": id.artifact, "permissionScope": id.permission_scope,
        "promptResponseFingerprint": prompt_response_fingerprint, "publicationGenerationId": id.generation,
        "requestFingerprint": request_fingerprint, "responseFingerprint": response_fingerprint,
        "schemaVersion": 1, "semanticConfig": semantic_config, "storedNodeCount": count,
        "storedResponseFingerprint": stored, "windowManifest": manifest,
    });
    Receipt {
        request_fingerprint,
        response_fingerprint,
        prompt_response_fingerprint,
        chunk_count: count,
        stored_count: count,
        receipt,
    }
}
