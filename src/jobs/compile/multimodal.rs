//! The platform's multimodal manifest of a document version (`document_multimodal_manifests`):
//! one item per code, image, table or page element of the parse artifact. Invariant: a pure
//! function of the artifact's elements; a document without such elements still has its manifest,
//! with no items, because every published document names one.

use serde_json::{json, Value};
use uuid::Uuid;

use super::artifact::{spans, Element};
use crate::canonical::child_id;

pub const MANIFEST_VERSION: &str = "document-multimodal-manifest-v1";
/// The longest text preview of an item, in characters.
pub const PREVIEW_CHARS: usize = 700;

/// The manifest's id in a generation.
pub fn manifest_id(generation: Uuid, document: Uuid, version: i32) -> Uuid {
    child_id(
        generation,
        &format!("document:{document}:{version}:multimodal-manifest:{MANIFEST_VERSION}"),
    )
}

/// The manifest's items and metadata.
pub fn build(artifact_id: Uuid, elements: &[Element]) -> (Value, Value) {
    let offsets: Vec<Option<(usize, usize)>> = {
        let mut v = vec![None; elements.len()];
        for s in spans(elements) {
            v[s.element] = Some((s.start, s.end));
        }
        v
    };
    let mut items = Vec::new();
    let (mut code, mut image, mut page, mut table) = (0, 0, 0, 0);
    for (i, e) in elements.iter().enumerate() {
        let modality = match e.kind.as_str() {
            "code" => {
                code += 1;
                "code"
            }
            "image" => {
                image += 1;
                "image"
            }
            "page-break" => {
                page += 1;
                "page"
            }
            "table" => {
                table += 1;
                "table"
            }
            _ => continue,
        };
        let mut item = json!({
            "enrichment": { "asset": "unsupported", "caption": "missing", "ocr": "unsupported",
                            "tableStructure": if modality == "table" { "missing" } else { "unsupported" },
                            "visualEmbedding": "unsupported" },
            "id": format!("{artifact_id}:{i}:{}", e.id),
            "modality": modality,
            "parseElementId": e.id,
            "sectionPath": e.section_path,
            "sourceMetadata": e.metadata,
        });
        if let Some((start, end)) = offsets[i] {
            item["startOffset"] = json!(start);
            item["endOffset"] = json!(end);
        }
        if let Some(p) = e.page_number {
            item["pageNumber"] = json!(p);
        }
        let preview: String = e.trimmed().chars().take(PREVIEW_CHARS).collect();
        if !preview.is_empty() {
            item["textPreview"] = json!(preview);
        }
        items.push(item);
    }
    let metadata = json!({
        "missingAssetCount": 0,
        "missingVisualEmbeddingCount": 0,
        "modalityCounts": { "code": code, "image": image, "page": page, "table": table },
        "source": "parse-artifact",
    });
    (Value::Array(items), metadata)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_blocks_are_items_and_prose_is_not() {
        let els = vec![
            Element {
                id: "a:element-1".into(),
                kind: "paragraph".into(),
                text: Some("Prose.".into()),
                section_path: vec![],
                page_number: None,
                metadata: json!({}),
            },
            Element {
                id: "a:element-2".into(),
                kind: "code".into(),
                text: Some("let x = 1;".into()),
                section_path: vec!["S".into()],
                page_number: None,
                metadata: json!({}),
            },
        ];
        let (items, meta) = build(Uuid::nil(), &els);
        assert_eq!(items.as_array().unwrap().len(), 1);
        assert_eq!(items[0]["modality"], "code");
        assert_eq!(items[0]["startOffset"], 7);
        assert_eq!(meta["modalityCounts"]["code"], 1);
        let (none, _) = build(Uuid::nil(), &els[..1]);
        assert_eq!(none, json!([]));
    }
}
