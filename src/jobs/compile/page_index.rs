//! The platform's flattened page index of an outline (`page_index_manifests`, `page_index_nodes`,
//! `page_index_terms`). Invariant: a pure function of the outline row: one index node per outline
//! node in pre-order, the terms of its title (mask 1), summary (2) and section path (4) OR-ed per
//! term and ordered by collation, ids derived from the manifest's deterministic id, and a checksum
//! over exactly what the rows say, so the same outline always indexes to the same rows.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};
use uuid::Uuid;

use super::outline::preorder;
use crate::canonical::{child_id, locale_compare, page_index_terms, stable_digest};

pub const TOKENIZER_VERSION: &str = "pageindex-nfkc-exact-v1";

#[derive(Clone, Debug, PartialEq)]
pub struct IndexNode {
    pub id: Uuid,
    pub outline_node_id: String,
    pub parent_outline_node_id: Option<String>,
    pub title: String,
    pub summary: Option<String>,
    pub section_path: Value,
    pub visited_node_ids: Value,
    pub level: i32,
    pub start_offset: Option<i32>,
    pub end_offset: Option<i32>,
    pub toc_source: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Term {
    pub id: Uuid,
    pub node: Uuid,
    pub term: String,
    pub field_mask: i32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct PageIndex {
    pub manifest_id: Uuid,
    pub nodes: Vec<IndexNode>,
    pub terms: Vec<Term>,
    pub checksum: String,
}

/// The manifest id of an outline's page index in a generation.
pub fn manifest_id(outline: Uuid, generation: Uuid) -> Uuid {
    child_id(
        outline,
        &format!("page-index:{generation}:{TOKENIZER_VERSION}"),
    )
}

fn int(v: &Value) -> Option<i32> {
    v.as_i64().and_then(|n| i32::try_from(n).ok())
}

/// Builds the page index of the outline `outline` (its id and `nodes` column) in `generation`.
pub fn build(outline: Uuid, generation: Uuid, nodes: &Value) -> Result<PageIndex, String> {
    let manifest = manifest_id(outline, generation);
    let mut rows = Vec::new();
    let mut terms = Vec::new();
    for (n, parent, visited) in preorder(nodes) {
        let outline_node_id = n["id"].as_str().unwrap_or_default().to_owned();
        let id = child_id(manifest, &format!("node:{outline_node_id}"));
        let title = n["title"].as_str().unwrap_or_default().to_owned();
        let summary = n["summary"].as_str().map(str::to_owned);
        let path: Vec<String> = n["sectionPath"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let mut masks: BTreeMap<String, i32> = BTreeMap::new();
        for (text, mask) in [
            (title.clone(), 1),
            (summary.clone().unwrap_or_default(), 2),
            (path.join(" "), 4),
        ] {
            for t in page_index_terms(&text)? {
                *masks.entry(t).or_default() |= mask;
            }
        }
        let mut own: Vec<(String, i32)> = masks.into_iter().collect();
        own.sort_by(|a, b| locale_compare(&a.0, &b.0).then_with(|| a.0.cmp(&b.0)));
        for (term, field_mask) in own {
            terms.push(Term {
                id: child_id(id, &format!("term:{term}")),
                node: id,
                term,
                field_mask,
            });
        }
        rows.push(IndexNode {
            id,
            outline_node_id,
            parent_outline_node_id: parent.map(str::to_owned),
            title,
            summary,
            section_path: json!(path),
            visited_node_ids: json!(visited),
            level: int(&n["level"]).unwrap_or(1),
            start_offset: int(&n["startOffset"]),
            end_offset: int(&n["endOffset"]),
            toc_source: n["tocSource"].as_str().unwrap_or("fallback").to_owned(),
        });
    }
    if rows.is_empty() || terms.is_empty() {
        return Err("the outline has no node or no term to index".into());
    }
    let checksum = checksum(&rows, &terms);
    Ok(PageIndex {
        manifest_id: manifest,
        nodes: rows,
        terms,
        checksum,
    })
}

/// SHA-256 of the canonical JSON of the rows without their ids.
pub fn checksum(nodes: &[IndexNode], terms: &[Term]) -> String {
    let nodes: Vec<Value> = nodes
        .iter()
        .map(|n| {
            let mut m = Map::new();
            if let Some(e) = n.end_offset {
                m.insert("endOffset".into(), json!(e));
            }
            m.insert("level".into(), json!(n.level));
            m.insert("outlineNodeId".into(), json!(n.outline_node_id));
            if let Some(p) = &n.parent_outline_node_id {
                m.insert("parentOutlineNodeId".into(), json!(p));
            }
            m.insert("sectionPath".into(), n.section_path.clone());
            if let Some(s) = n.start_offset {
                m.insert("startOffset".into(), json!(s));
            }
            if let Some(s) = &n.summary {
                m.insert("summary".into(), json!(s));
            }
            m.insert("title".into(), json!(n.title));
            m.insert("tocSource".into(), json!(n.toc_source));
            m.insert("visitedNodeIds".into(), n.visited_node_ids.clone());
            Value::Object(m)
        })
        .collect();
    let terms: Vec<Value> = terms
        .iter()
        .map(|t| json!({ "fieldMask": t.field_mask, "term": t.term }))
        .collect();
    stable_digest(&json!({ "nodes": nodes, "terms": terms, "tokenizerVersion": TOKENIZER_VERSION }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jobs::compile::artifact::test_element as el;
    use crate::jobs::compile::outline;

    #[test]
    fn an_outline_indexes_to_nodes_and_masked_terms() {
        let els = vec![
            el(1, "heading", "Leases", &["Leases"]),
            el(2, "paragraph", "A lease fences writers.", &["Leases"]),
            el(3, "heading", "Expiry", &["Leases", "Expiry"]),
            el(4, "paragraph", "Leases expire.", &["Leases", "Expiry"]),
        ];
        let g = Uuid::from_u128(5);
        let o = outline::build(
            g,
            Uuid::from_u128(6),
            1,
            &els,
            "markdown",
            "v1",
            "text/markdown",
        );
        let pi = build(o.id, g, &o.nodes).unwrap();
        assert_eq!(pi.nodes.len(), 2);
        assert_eq!(
            pi.nodes[1].parent_outline_node_id.as_deref(),
            o.nodes[0]["id"].as_str()
        );
        assert_eq!(pi.nodes[1].visited_node_ids.as_array().unwrap().len(), 2);
        let leases = pi
            .terms
            .iter()
            .find(|t| t.node == pi.nodes[0].id && t.term == "leases")
            .unwrap();
        assert_eq!(leases.field_mask, 1 | 4);
        let fences = pi.terms.iter().find(|t| t.term == "fences").unwrap();
        assert_eq!(fences.field_mask, 2);
        let own: Vec<&str> = pi
            .terms
            .iter()
            .filter(|t| t.node == pi.nodes[0].id)
            .map(|t| t.term.as_str())
            .collect();
        let mut sorted = own.clone();
        sorted.sort_by(|a, b| locale_compare(a, b));
        assert_eq!(own, sorted);
        assert_eq!(pi.checksum.len(), 64);
        assert_eq!(pi, build(o.id, g, &o.nodes).unwrap());
        assert_eq!(pi.manifest_id, manifest_id(o.id, g));
    }
}
