//! Graph extraction of knowledge nodes that were not chunked by a model (platform migration
//! 0039): per node, an entity stage and then a relation stage, each asked of the reasoning
//! model and checkpointed in `document_semantic_extraction_checkpoints` under the exact input's
//! fingerprint. Invariant: the prompts, fingerprints and checkpoint results are pure functions
//! of the node, the stage's input and the model selection; a node with fewer than two entities
//! gets an empty relation result without a model call; items the model returns outside the
//! platform's types or confidence range are dropped, and at most fifty of each are kept, the
//! most confident first.

use serde_json::{json, Value};

use crate::canonical::stable_json;
use crate::model::{fingerprint, Prompt, Purpose};

pub const ENTITY_PROMPT_VERSION: &str = "entity-extraction-v1";
pub const RELATION_PROMPT_VERSION: &str = "relation-extraction-v1";
pub const MAX_PER_NODE: usize = 50;
pub const MAX_OUTPUT_TOKENS: u32 = 1500;
pub use crate::jobs::compile::semantic::plan::{ENTITY_TYPES, RELATION_TYPES};

/// A node as the extraction stages see it.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub id: uuid::Uuid,
    pub kind: String,
    pub text: String,
    pub start: i32,
    pub end: i32,
    pub artifact_hash: String,
    pub section_path: Vec<String>,
}

impl Node {
    fn identity(&self) -> Value {
        json!({ "artifactHash": self.artifact_hash, "endOffset": self.end, "id": self.id,
                "kind": self.kind, "startOffset": self.start, "text": self.text })
    }
}

/// The entity stage's input fingerprint.
pub fn entity_fingerprint(n: &Node, selection: &Value) -> String {
    fingerprint(&stable_json(&json!({
        "maxEntitiesPerNode": MAX_PER_NODE, "node": n.identity(), "promptVersion": ENTITY_PROMPT_VERSION,
        "selection": selection, "stage": "entity",
    })))
}

/// The relation stage's input fingerprint: the node and the entities found in it.
pub fn relation_fingerprint(n: &Node, entities: &[Value], selection: &Value) -> String {
    fingerprint(&stable_json(&json!({
        "entities": entities, "maxRelationsPerNode": MAX_PER_NODE, "node": n.identity(),
        "promptVersion": RELATION_PROMPT_VERSION, "selection": selection, "stage": "relation",
    })))
}

fn section(n: &Node) -> String {
    let s = n.section_path.join(" > ");
    if s.is_empty() {
        "Unknown section".into()
    } else {
        s
    }
}

pub fn entity_prompt(n: &Node) -> Prompt {
    let input = json!({ "kind": n.kind, "section": section(n), "text": n.text });
    Prompt {
        purpose: Purpose::Entity,
        system: format!(
            "You find the knowledge-graph entities a document passage names. Keep only named \
             things the text supports: people, organisations, products, dates, policies, domain \
             terms and metrics; never bare numbers, list ordinals, identifiers or generic words. \
             Allowed types: {}. Answer with strict JSON only: {{\"entities\":[{{\"text\":\"exact \
             words\",\"type\":\"term\",\"confidence\":0.9}}]}}, at most {MAX_PER_NODE} entities.",
            ENTITY_TYPES.join(", ")
        ),
        user: input.to_string(),
        input,
        max_output_tokens: MAX_OUTPUT_TOKENS,
    }
}

pub fn relation_prompt(n: &Node, entities: &[Value]) -> Prompt {
    let names: Vec<&str> = entities.iter().filter_map(|e| e["text"].as_str()).collect();
    let input = json!({ "entities": names, "kind": n.kind, "section": section(n), "text": n.text });
    Prompt {
        purpose: Purpose::Relation,
        system: format!(
            "You find the relations a document passage states between the entities listed with \
             it. Use the listed names exactly; relate only what the text supports. Allowed types: \
             {}. Answer with strict JSON only: {{\"relations\":[{{\"subject\":\"A\",\"type\":\
             \"references\",\"object\":\"B\",\"confidence\":0.9}}]}}, at most {MAX_PER_NODE} \
             relations.",
            RELATION_TYPES.join(", ")
        ),
        user: input.to_string(),
        input,
        max_output_tokens: MAX_OUTPUT_TOKENS,
    }
}

fn object_of(text: &str) -> Result<Value, String> {
    let t = text.trim();
    serde_json::from_str::<Value>(t)
        .ok()
        .or_else(|| {
            let (a, b) = (t.find('{')?, t.rfind('}')?);
            serde_json::from_str(t.get(a..=b)?).ok()
        })
        .filter(Value::is_object)
        .ok_or_else(|| "the extraction answer is not a JSON object".to_owned())
}

fn confidence(v: &Value) -> Option<f64> {
    v["confidence"].as_f64().filter(|c| (0.0..=1.0).contains(c))
}

/// Keeps the `max` most confident items, the earlier first among equals.
fn most_confident(mut items: Vec<(f64, Value)>) -> Vec<Value> {
    items.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal));
    items
        .into_iter()
        .take(MAX_PER_NODE)
        .map(|(_, v)| v)
        .collect()
}

/// The entity stage's checkpoint result from an answer.
pub fn entity_result(answer: &str, model: &str, at: &str) -> Result<Value, String> {
    let v = object_of(answer)?;
    let items = v["entities"]
        .as_array()
        .ok_or("the entity answer has no entities array")?;
    let kept: Vec<(f64, Value)> = items
        .iter()
        .filter_map(|e| {
            let text = e["text"].as_str()?.trim();
            let kind = e["type"].as_str().filter(|t| ENTITY_TYPES.contains(t))?;
            let c = confidence(e)?;
            (!text.is_empty()).then(|| (c, json!({ "confidence": c, "text": text, "type": kind })))
        })
        .collect();
    let entities = most_confident(kept);
    Ok(json!({
        "entityExtraction": { "entityCount": entities.len(), "extractedAt": at, "model": model,
                              "promptVersion": ENTITY_PROMPT_VERSION },
        "extractedEntities": entities,
    }))
}

/// The relation stage's checkpoint result from an answer.
pub fn relation_result(answer: &str, model: &str, at: &str) -> Result<Value, String> {
    let v = object_of(answer)?;
    let items = v["relations"]
        .as_array()
        .ok_or("the relation answer has no relations array")?;
    let kept: Vec<(f64, Value)> = items
        .iter()
        .filter_map(|r| {
            let s = r["subject"].as_str()?.trim();
            let o = r["object"].as_str()?.trim();
            let kind = r["type"].as_str().filter(|t| RELATION_TYPES.contains(t))?;
            let c = confidence(r)?;
            (!s.is_empty() && !o.is_empty()).then(|| {
                (
                    c,
                    json!({ "confidence": c, "object": o, "subject": s, "type": kind }),
                )
            })
        })
        .collect();
    let relations = most_confident(kept);
    Ok(json!({
        "extractedRelations": relations,
        "relationExtraction": { "extractedAt": at, "model": model, "promptVersion": RELATION_PROMPT_VERSION,
                                "relationCount": relations.len() },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> Node {
        Node {
            id: uuid::Uuid::from_u128(7),
            kind: "chunk".into(),
            text: "Acme Corp adopted Policy A.".into(),
            start: 0,
            end: 27,
            artifact_hash: "a".repeat(64),
            section_path: vec!["Guide".into()],
        }
    }

    #[test]
    fn answers_become_the_platforms_checkpoint_results() {
        let r = entity_result(
            r#"{"entities":[{"text":" Acme Corp ","type":"organization","confidence":0.7},
               {"text":"x","type":"animal","confidence":0.9},{"text":"Policy A","type":"policy","confidence":0.95},
               {"text":"y","type":"term","confidence":1.5}]}"#,
            "m",
            "2026-01-01T00:00:00Z",
        )
        .unwrap();
        let texts: Vec<&str> = r["extractedEntities"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["text"].as_str().unwrap())
            .collect();
        assert_eq!(
            texts,
            ["Policy A", "Acme Corp"],
            "most confident first, bad items dropped"
        );
        assert_eq!(r["entityExtraction"]["entityCount"], 2);
        assert_eq!(
            r["entityExtraction"]["promptVersion"],
            ENTITY_PROMPT_VERSION
        );
        let r = relation_result(
            "ok: {\"relations\":[{\"subject\":\"Acme Corp\",\"object\":\"Policy A\",\"type\":\"references\",\"confidence\":0.9}]}",
            "m",
            "t",
        )
        .unwrap();
        assert_eq!(r["extractedRelations"][0]["type"], "references");
        assert!(entity_result("no", "m", "t").is_err());
        assert!(relation_result("{\"x\":1}", "m", "t").is_err());
    }

    #[test]
    fn fingerprints_follow_every_input() {
        let sel = json!({"model": "m", "pluginId": "p", "provider": "o"});
        let n = node();
        let base = entity_fingerprint(&n, &sel);
        assert!(base.starts_with("sha256:") && base.len() == 71);
        let mut m = n.clone();
        m.text.push('!');
        assert_ne!(base, entity_fingerprint(&m, &sel));
        assert_ne!(base, entity_fingerprint(&n, &json!({"model": "other"})));
        let e = [json!({"text": "Acme Corp"})];
        assert_ne!(
            relation_fingerprint(&n, &e, &sel),
            relation_fingerprint(&n, &[], &sel)
        );
        assert_eq!(
            relation_prompt(&n, &e).input["entities"],
            json!(["Acme Corp"])
        );
        assert_eq!(entity_prompt(&n).input["section"], "Guide");
    }
}
