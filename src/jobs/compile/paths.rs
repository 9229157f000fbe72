//! The platform's knowledge paths of a compiled document (`knowledge_paths`): the virtual files a
//! reader browses under `/knowledge/docs/<segment>`. Invariant: a pure function of the document
//! row and its outline: the document, its `multimodal.json`, its `outline.json` and one section
//! file per outline node in pre-order, each path's id derived from the generation and the path.

use serde_json::{json, Value};
use uuid::Uuid;

use super::outline::preorder;
use crate::canonical::child_id;

/// The longest virtual path.
pub const MAX_PATH_CHARS: usize = 384;

/// One `knowledge_paths` row of the document.
#[derive(Clone, Debug, PartialEq)]
pub struct PathRow {
    pub id: Uuid,
    pub virtual_path: String,
    pub metadata: Value,
}

/// The platform's path segment normalisation: trimmed, slashes and whitespace runs become `-`,
/// runs of `-` collapse, no `-` at either end.
pub fn normalize(s: &str) -> String {
    let mut out = String::new();
    for c in s.trim().chars() {
        let c = if c == '/' || c == '\\' || c.is_whitespace() {
            '-'
        } else {
            c
        };
        if c == '-' && out.ends_with('-') {
            continue;
        }
        out.push(c);
    }
    out.trim_matches('-').to_owned()
}

/// `<normalized filename>--<first 8 hex of the document id>`.
pub fn document_segment(filename: &str, document: Uuid) -> String {
    let name = normalize(filename);
    let name = if name.is_empty() {
        "document".to_owned()
    } else {
        name
    };
    format!("{name}--{}", &document.simple().to_string()[..8])
}

pub struct Doc<'a> {
    pub tenant: &'a str,
    pub id: Uuid,
    pub filename: &'a str,
    pub mime_type: &'a str,
    pub object_key: &'a str,
}

/// Every path of the document under `generation`.
pub fn build(
    generation: Uuid,
    doc: &Doc<'_>,
    outline_id: Uuid,
    outline_nodes: &Value,
) -> Vec<PathRow> {
    let root = format!("/knowledge/docs/{}", document_segment(doc.filename, doc.id));
    let mut out = Vec::new();
    let mut push = |path: String, metadata: Value| {
        out.push(PathRow {
            id: child_id(generation, &format!("knowledge-path:{path}")),
            virtual_path: path,
            metadata,
        });
    };
    push(
        root.clone(),
        json!({ "filename": doc.filename, "mimeType": doc.mime_type, "objectKey": doc.object_key,
                "tenantId": doc.tenant }),
    );
    push(
        format!("{root}/multimodal.json"),
        json!({ "contentKind": "document-multimodal-manifest", "filename": "multimodal.json",
                "mimeType": "application/json", "tenantId": doc.tenant }),
    );
    push(
        format!("{root}/outline.json"),
        json!({ "contentKind": "document-outline", "filename": "outline.json",
                "mimeType": "application/json", "tenantId": doc.tenant }),
    );
    for (node, _, _) in preorder(outline_nodes) {
        let node_id = node["id"].as_str().unwrap_or_default();
        let path: Vec<String> = node["sectionPath"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(normalize))
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default();
        let slug = if path.is_empty() {
            "section".to_owned()
        } else {
            path.join("--")
        };
        let suffix = format!(
            "--{}.md",
            &node_id.replace('-', "")[..8.min(node_id.replace('-', "").len())]
        );
        let prefix = format!("{root}/sections/");
        let room = MAX_PATH_CHARS.saturating_sub(prefix.chars().count() + suffix.chars().count());
        let slug: String = slug.chars().take(room.max(1)).collect();
        let filename = format!("{slug}{suffix}");
        push(
            format!("{prefix}{filename}"),
            json!({ "contentKind": "document-section", "filename": filename, "mimeType": "text/markdown",
                    "outlineId": outline_id, "outlineNodeId": node_id, "sectionPath": node["sectionPath"],
                    "tenantId": doc.tenant, "title": node["title"] }),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_normalized() {
        assert_eq!(normalize("  a / b\\\\c  d--e- "), "a-b-c-d-e");
        let d = Uuid::parse_str("0123abcd-0000-4000-8000-000000000000").unwrap();
        assert_eq!(document_segment("My Notes.md", d), "My-Notes.md--0123abcd");
        assert_eq!(document_segment(" / ", d), "document--0123abcd");
    }

    #[test]
    fn a_document_has_its_three_paths_and_one_per_section() {
        let nodes = json!([{"id": "11111111-2222-5333-8444-555555555555", "sectionPath": ["Guide"], "title": "Guide",
                            "children": [{"id": "aaaaaaaa-2222-5333-8444-555555555555",
                                          "sectionPath": ["Guide", "Set up"], "title": "Set up", "children": []}]}]);
        let doc = Doc {
            tenant: "t",
            id: Uuid::nil(),
            filename: "g.md",
            mime_type: "text/markdown",
            object_key: "k",
        };
        let rows = build(Uuid::from_u128(3), &doc, Uuid::from_u128(4), &nodes);
        let paths: Vec<&str> = rows.iter().map(|r| r.virtual_path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/knowledge/docs/g.md--00000000",
                "/knowledge/docs/g.md--00000000/multimodal.json",
                "/knowledge/docs/g.md--00000000/outline.json",
                "/knowledge/docs/g.md--00000000/sections/Guide--11111111.md",
                "/knowledge/docs/g.md--00000000/sections/Guide--Set-up--aaaaaaaa.md",
            ]
        );
        assert!(rows.iter().all(|r| r.metadata["tenantId"] == "t"));
        assert_eq!(
            rows[0].id,
            child_id(
                Uuid::from_u128(3),
                "knowledge-path:/knowledge/docs/g.md--00000000"
            )
        );
    }
}
