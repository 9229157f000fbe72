//! The graph of a model-driven compile: the entities and relations the semantic chunker
//! extracted with each chunk, through the platform's quality control into `graph_entities` and
//! `graph_relations` of the generation, and their semantic projections (platform migration
//! 0054). Invariant: [`build`] is a pure function of the nodes: an item is kept only at
//! confidence ≥ 0.6, once per node and at most 50 per node; an entity's id is `child_id(space,
//! "publication-generation:<gen>:graph-entity:<type>:<canonical name, lower case>")` and a
//! relation's `child_id(space, "publication-generation:<gen>:graph-relation:<subject id>:<type>:
//! <object id>:1")`, so a replay writes the same rows once (`ON CONFLICT DO NOTHING`); a
//! projection's `content_hash` is the SHA-256 of its representation version and search text.

use std::collections::BTreeMap;

use serde_json::{json, Value};
use uuid::Uuid;

use crate::canonical::{child_id, locale_compare, sha256_hex};

pub const MIN_CONFIDENCE: f64 = 0.6;
pub const MAX_PER_NODE: usize = 50;
pub const EXTRACTION_VERSION: i32 = 1;
pub const REPRESENTATION_VERSION: &str = "graph-semantic-representation-v1";
pub const RELATION_CATALOG: &str = "graph-relations-v2";
/// Texts embedded per request.
pub const EMBED_BATCH: usize = 128;

/// What a node contributes to the graph.
#[derive(Clone, Debug)]
pub struct GraphNode<'a> {
    pub id: Uuid,
    pub text: &'a str,
    pub permission_scope: &'a Value,
    /// The node's `extractedEntities` and `extractedRelations`.
    pub entities: &'a [Value],
    pub relations: &'a [Value],
}

#[derive(Clone, Debug, PartialEq)]
pub struct EntityRow {
    pub id: Uuid,
    pub canonical_key: String,
    pub kind: String,
    pub name: String,
    pub aliases: Vec<String>,
    pub confidence: f64,
    pub metadata: Value,
    pub permission_scope: Vec<Value>,
    pub source_node_ids: Vec<Uuid>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct RelationRow {
    pub id: Uuid,
    pub subject: Uuid,
    pub object: Uuid,
    pub kind: String,
    pub confidence: f64,
    pub metadata: Value,
    pub permission_scope: Vec<Value>,
    pub source_node_ids: Vec<Uuid>,
}

fn lower(s: &str) -> String {
    s.trim().to_lowercase()
}

fn canonical_name(e: &Value) -> String {
    e["metadata"]["canonicalName"]
        .as_str()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map_or_else(
            || e["text"].as_str().unwrap_or("").trim().to_owned(),
            str::to_owned,
        )
}

/// The items of one node that pass quality control: confident enough, not repeated, within the
/// node's budget, in the node's order.
fn eligible(items: &[Value], key: impl Fn(&Value) -> String) -> Vec<&Value> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for item in items {
        let k = key(item);
        let fresh = seen.insert(k);
        let confident = item["confidence"].as_f64().unwrap_or(0.0) >= MIN_CONFIDENCE;
        if confident && fresh && out.len() < MAX_PER_NODE {
            out.push(item);
        }
    }
    out
}

fn union<T: PartialEq + Clone>(into: &mut Vec<T>, more: impl IntoIterator<Item = T>) {
    for m in more {
        if !into.contains(&m) {
            into.push(m);
        }
    }
}

fn scope_items(scope: &Value) -> Vec<Value> {
    scope.as_array().cloned().unwrap_or_default()
}

/// The generation's entities and relations from its nodes, each sorted by key.
pub fn build(
    space: Uuid,
    generation: Uuid,
    nodes: &[GraphNode<'_>],
) -> (Vec<EntityRow>, Vec<RelationRow>) {
    let mut entities: BTreeMap<String, EntityRow> = BTreeMap::new();
    let mut relations: BTreeMap<String, RelationRow> = BTreeMap::new();
    for n in nodes {
        let kept = eligible(n.entities, |e| {
            format!(
                "{}:{}",
                e["type"].as_str().unwrap_or(""),
                lower(e["text"].as_str().unwrap_or(""))
            )
        });
        for e in &kept {
            let kind = e["type"].as_str().unwrap_or("term").to_owned();
            let name = canonical_name(e);
            let key = format!("{kind}:{}", lower(&name));
            let text = e["text"].as_str().unwrap_or("").trim().to_owned();
            let confidence = e["confidence"].as_f64().unwrap_or(0.0);
            let row = entities.entry(key.clone()).or_insert_with(|| EntityRow {
                id: child_id(
                    space,
                    &format!("publication-generation:{generation}:graph-entity:{key}"),
                ),
                canonical_key: key.clone(),
                kind,
                name: name.clone(),
                aliases: Vec::new(),
                confidence,
                metadata: json!({}),
                permission_scope: Vec::new(),
                source_node_ids: Vec::new(),
            });
            union(&mut row.aliases, [text]);
            row.confidence = row.confidence.max(confidence);
            if let (Some(into), Some(more)) =
                (row.metadata.as_object_mut(), e["metadata"].as_object())
            {
                for (k, v) in more {
                    if k != "responseEntityId" {
                        into.insert(k.clone(), v.clone());
                    }
                }
            }
            union(&mut row.permission_scope, scope_items(n.permission_scope));
            union(&mut row.source_node_ids, [n.id]);
        }
        // A mention resolves to the node's kept entity it names, then to that entity's row.
        let resolve = |mention: &str| -> Option<Uuid> {
            let m = lower(mention);
            kept.iter().find_map(|e| {
                let text = lower(e["text"].as_str().unwrap_or(""));
                let name = lower(&canonical_name(e));
                if text != m && name != m {
                    return None;
                }
                let kind = e["type"].as_str().unwrap_or("");
                entities
                    .get(&format!("{kind}:{name}"))
                    .or_else(|| entities.get(&format!("{kind}:{m}")))
                    .map(|r| r.id)
            })
        };
        let kept_relations = eligible(n.relations, |r| {
            format!(
                "{}:{}:{}",
                r["type"].as_str().unwrap_or(""),
                lower(r["subject"].as_str().unwrap_or("")),
                lower(r["object"].as_str().unwrap_or(""))
            )
        });
        for r in kept_relations {
            let (Some(subject), Some(object)) = (
                resolve(r["subject"].as_str().unwrap_or("")),
                resolve(r["object"].as_str().unwrap_or("")),
            ) else {
                continue;
            };
            let kind = r["type"].as_str().unwrap_or("mentions").to_owned();
            let key = format!("{subject}:{kind}:{object}:{EXTRACTION_VERSION}");
            let confidence = r["confidence"].as_f64().unwrap_or(0.0);
            let row = relations.entry(key.clone()).or_insert_with(|| RelationRow {
                id: child_id(
                    space,
                    &format!("publication-generation:{generation}:graph-relation:{key}"),
                ),
                subject,
                object,
                kind,
                confidence,
                metadata: json!({}),
                permission_scope: Vec::new(),
                source_node_ids: Vec::new(),
            });
            row.confidence = row.confidence.max(confidence);
            union(&mut row.permission_scope, scope_items(n.permission_scope));
            union(&mut row.source_node_ids, [n.id]);
        }
    }
    let mut e: Vec<EntityRow> = entities.into_values().collect();
    e.sort_by(|a, b| locale_compare(&a.canonical_key, &b.canonical_key));
    (e, relations.into_values().collect())
}

/// What each relation type means, in the relation projections' search text.
pub fn definition(kind: &str) -> &'static str {
    match kind {
        "mentions" => "The subject refers to the object without saying more about it.",
        "defines" => "The subject states what the object is or means.",
        "references" => "The subject points to the object as a source or a related item.",
        "depends_on" => "The subject needs the object to hold, work or apply.",
        "supersedes" => "The subject replaces the object, which no longer applies.",
        "contradicts" => "The subject states the opposite of the object.",
        _ => "A relation between two entities.",
    }
}

/// An entity's search text: its name, type and aliases, then the start of up to two of its
/// source nodes (by id), at most 2000 characters.
pub fn entity_text(e: &EntityRow, node_text: impl Fn(Uuid) -> Option<String>) -> String {
    let mut aliases = e.aliases.clone();
    aliases.sort();
    aliases.dedup();
    let mut lines = vec![
        format!("Entity: {}", e.name),
        format!("Type: {}", e.kind),
        format!(
            "Aliases: {}",
            aliases.join("; ").chars().take(500).collect::<String>()
        ),
    ];
    let mut sources = e.source_node_ids.clone();
    sources.sort_by_key(ToString::to_string);
    for id in sources.iter().take(2) {
        if let Some(t) = node_text(*id) {
            lines.push(t.chars().take(500).collect());
        }
    }
    lines
        .into_iter()
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("\n")
        .chars()
        .take(2000)
        .collect()
}

/// A relation's search text: its type and what the type means.
pub fn relation_text(kind: &str) -> String {
    format!("{RELATION_CATALOG}\n{kind}\n{}", definition(kind))
}

/// The projection's `content_hash`.
pub fn content_hash(text: &str) -> String {
    sha256_hex(format!("{REPRESENTATION_VERSION}\n{text}").as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ent(text: &str, kind: &str, confidence: f64, canonical: Option<&str>) -> Value {
        let mut m = json!({ "source": "llm-semantic-chunking", "responseEntityId": "e-1" });
        if let Some(c) = canonical {
            m["canonicalName"] = json!(c);
        }
        json!({ "text": text, "type": kind, "confidence": confidence, "metadata": m })
    }

    fn rel(s: &str, o: &str, confidence: f64) -> Value {
        json!({ "subject": s, "object": o, "type": "mentions", "confidence": confidence })
    }

    #[test]
    fn quality_control_merging_and_ids() {
        let (space, generation) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let scope_a = json!(["group:a"]);
        let scope_b = json!(["group:b"]);
        let e1 = [
            ent("Acme", "organization", 0.9, Some("Acme Corp")),
            ent("Policy A", "policy", 0.95, None),
            ent("acme", "organization", 0.99, None), // same node, same key: a duplicate
            ent("Vague", "term", 0.5, None),         // below the threshold
        ];
        let r1 = [
            rel("Acme Corp", "Policy A", 0.9),
            rel("Acme Corp", "Vague", 0.9),
        ];
        let e2 = [ent("ACME CORP", "organization", 0.7, None)];
        let nodes = [
            GraphNode {
                id: Uuid::from_u128(10),
                text: "Acme has Policy A.",
                permission_scope: &scope_a,
                entities: &e1,
                relations: &r1,
            },
            GraphNode {
                id: Uuid::from_u128(11),
                text: "ACME CORP again.",
                permission_scope: &scope_b,
                entities: &e2,
                relations: &[],
            },
        ];
        let (entities, relations) = build(space, generation, &nodes);
        let keys: Vec<&str> = entities.iter().map(|e| e.canonical_key.as_str()).collect();
        assert_eq!(keys, ["organization:acme corp", "policy:policy a"]);
        let acme = &entities[0];
        assert_eq!(acme.name, "Acme Corp");
        assert_eq!(acme.aliases, ["Acme", "ACME CORP"]);
        assert_eq!(acme.confidence, 0.9);
        assert_eq!(
            acme.source_node_ids,
            [Uuid::from_u128(10), Uuid::from_u128(11)]
        );
        assert_eq!(acme.permission_scope, [json!("group:a"), json!("group:b")]);
        assert_eq!(
            acme.id,
            child_id(
                space,
                &format!("publication-generation:{generation}:graph-entity:organization:acme corp")
            )
        );
        assert!(acme.metadata.get("responseEntityId").is_none());
        // The relation to the dropped entity does not resolve.
        assert_eq!(relations.len(), 1);
        assert_eq!(
            (relations[0].subject, relations[0].object),
            (acme.id, entities[1].id)
        );
        // Replaying gives the same rows.
        assert_eq!(build(space, generation, &nodes), (entities, relations));
    }

    #[test]
    fn at_most_fifty_per_node() {
        let many: Vec<Value> = (0..60)
            .map(|i| ent(&format!("T{i}"), "term", 0.9, None))
            .collect();
        let scope = json!([]);
        let nodes = [GraphNode {
            id: Uuid::nil(),
            text: "",
            permission_scope: &scope,
            entities: &many,
            relations: &[],
        }];
        assert_eq!(
            build(Uuid::nil(), Uuid::from_u128(1), &nodes).0.len(),
            MAX_PER_NODE
        );
    }

    #[test]
    fn search_texts_and_hashes() {
        let e = EntityRow {
            id: Uuid::nil(),
            canonical_key: "term:x".into(),
            kind: "term".into(),
            name: "X".into(),
            aliases: vec!["x".into(), "X".into(), "x".into()],
            confidence: 1.0,
            metadata: json!({}),
            permission_scope: vec![],
            source_node_ids: vec![Uuid::from_u128(2), Uuid::from_u128(1)],
        };
        let t = entity_text(&e, |id| Some(format!("node {}", id.as_u128())));
        assert_eq!(t, "Entity: X\nType: term\nAliases: X; x\nnode 1\nnode 2");
        assert_eq!(
            relation_text("defines").lines().next(),
            Some(RELATION_CATALOG)
        );
        assert_eq!(content_hash("a").len(), 64);
        assert_ne!(content_hash("a"), content_hash("b"));
    }
}
