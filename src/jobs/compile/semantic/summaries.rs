//! Outline summaries by the reasoning model (platform migration 0038): every outline node, deepest
//! level first so that a parent is summarised with its children's summaries. Invariant: a
//! node's input (its section's text, its title and path, its children's summaries) and the model
//! decide its `input_fingerprint`; a summary is asked for only when no checkpoint of that exact
//! input exists for the generation, and is checkpointed (`document_outline_summary_checkpoints`)
//! the moment it arrives, so a crash never asks for it again; the outline step only reads
//! checkpoints ([`apply`]) and never calls the model.

use std::collections::HashMap;

use serde_json::{json, Value};

use crate::jobs::compile::artifact::Element;
use crate::model::{fingerprint, Prompt, Purpose};

pub const PROMPT_VERSION: &str = "document-outline-summary-v2";
/// The longest section text sent, in characters.
pub const MAX_INPUT_CHARS: usize = 12_000;
/// The longest summary kept, in characters.
pub const MAX_SUMMARY_CHARS: usize = 2_000;
/// Summaries asked for at once within one level.
pub const CONCURRENCY: usize = 8;
pub const MAX_OUTPUT_TOKENS: u32 = 1024;

/// One outline node to summarise.
#[derive(Clone, Debug, PartialEq)]
pub struct Section {
    pub id: String,
    pub depth: usize,
    pub title: String,
    pub section_path: Vec<String>,
    /// The section's text: every element under its path, joined by blank lines, cut to
    /// [`MAX_INPUT_CHARS`].
    pub text: String,
    pub children: Vec<String>,
}

/// `t` cut to `max` characters, the last three replaced by `...` when cut.
pub fn truncate(t: &str, max: usize) -> String {
    if t.chars().count() <= max {
        return t.to_owned();
    }
    if max <= 3 {
        return t.chars().take(max).collect();
    }
    let mut s: String = t.chars().take(max - 3).collect();
    s.push_str("...");
    s
}

/// The sections of an outline, deepest first.
pub fn sections(nodes: &Value, elements: &[Element]) -> Vec<Section> {
    fn walk(n: &Value, depth: usize, elements: &[Element], out: &mut Vec<Section>) {
        let path: Vec<String> = n["sectionPath"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let document = path == ["Document"];
        let text = elements
            .iter()
            .filter(|e| {
                e.section_path.starts_with(&path) || (document && e.section_path.is_empty())
            })
            .map(Element::trimmed)
            .filter(|t| !t.is_empty())
            .collect::<Vec<_>>()
            .join("\n\n");
        let children = n["children"].as_array().cloned().unwrap_or_default();
        out.push(Section {
            id: n["id"].as_str().unwrap_or_default().to_owned(),
            depth,
            title: n["title"].as_str().unwrap_or_default().to_owned(),
            section_path: path,
            text: truncate(&text, MAX_INPUT_CHARS),
            children: children
                .iter()
                .filter_map(|c| c["id"].as_str().map(str::to_owned))
                .collect(),
        });
        for c in &children {
            walk(c, depth + 1, elements, out);
        }
    }
    let mut out = Vec::new();
    for r in nodes.as_array().into_iter().flatten() {
        walk(r, 0, elements, &mut out);
    }
    // Deepest level first; document order within a level.
    out.sort_by_key(|s| std::cmp::Reverse(s.depth));
    out
}

/// The levels of `sections` (already deepest first), as index ranges.
pub fn levels(sections: &[Section]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=sections.len() {
        if i == sections.len() || sections[i].depth != sections[start].depth {
            out.push(start..i);
            start = i;
        }
    }
    out
}

/// The children's summaries of a section, in child order.
pub fn child_summaries(s: &Section, done: &HashMap<String, String>) -> Option<Vec<String>> {
    s.children
        .iter()
        .map(|c| done.get(c).map(|t| t.trim().to_owned()))
        .collect()
}

/// The input's fingerprint: the section's whole input, the summary bound, the model and the
/// prompt version.
pub fn input_fingerprint(s: &Section, child_summaries: &[String], model: &str) -> String {
    fingerprint(
        &json!({
            "childSummaries": child_summaries, "maxSummaryChars": MAX_SUMMARY_CHARS, "model": model,
            "outlineNodeId": s.id, "promptVersion": PROMPT_VERSION, "sectionPath": s.section_path,
            "text": s.text, "title": s.title,
        })
        .to_string(),
    )
}

const SYSTEM: &str = "You summarize one section of a document for retrieval by section. Keep the \
concrete entities, specifications, constraints and conclusions; leave out everything else. Answer \
with strict JSON only: {\"summary\":\"the concise summary\"}.";

pub fn prompt(s: &Section, child_summaries: &[String]) -> Prompt {
    let input = json!({ "childSummaries": child_summaries, "sectionPath": s.section_path,
                        "text": s.text, "title": s.title });
    Prompt {
        purpose: Purpose::Summary,
        system: SYSTEM.into(),
        user: input.to_string(),
        input,
        max_output_tokens: MAX_OUTPUT_TOKENS,
    }
}

/// The summary in a model's answer: `{"summary": "..."}` (the JSON object may be wrapped in
/// other text), non-empty.
pub fn parse(text: &str) -> Result<String, String> {
    let t = text.trim();
    let v: Value = serde_json::from_str(t)
        .ok()
        .or_else(|| {
            let (a, b) = (t.find('{')?, t.rfind('}')?);
            serde_json::from_str(t.get(a..=b)?).ok()
        })
        .ok_or("the outline summary answer is not a JSON object")?;
    let s = v["summary"]
        .as_str()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .ok_or("the outline summary answer has no summary")?;
    if s.chars().count() > MAX_SUMMARY_CHARS * 4 {
        return Err(format!(
            "the outline summary answer exceeds {} characters",
            MAX_SUMMARY_CHARS * 4
        ));
    }
    Ok(s.to_owned())
}

/// Writes checkpointed summaries into the outline: each node's `summary` (cut to
/// [`MAX_SUMMARY_CHARS`]) and `metadata.summary`, and the outline's `metadata.summary`.
pub fn apply(
    nodes: &mut Value,
    metadata: &mut Value,
    summaries: &HashMap<String, (String, Value)>,
    model: &str,
) {
    fn walk(n: &mut Value, summaries: &HashMap<String, (String, Value)>, model: &str) {
        let id = n["id"].as_str().unwrap_or_default().to_owned();
        if let Some((summary, meta)) = summaries.get(&id) {
            n["summary"] = json!(truncate(summary.trim(), MAX_SUMMARY_CHARS));
            if !n["metadata"].is_object() {
                n["metadata"] = json!({});
            }
            n["metadata"]["summary"] = json!({ "metadata": meta, "model": model,
                                               "promptVersion": PROMPT_VERSION, "source": "provider" });
        }
        if let Some(children) = n["children"].as_array_mut() {
            for c in children {
                walk(c, summaries, model);
            }
        }
    }
    for r in nodes.as_array_mut().into_iter().flatten() {
        walk(r, summaries, model);
    }
    if metadata.is_object() {
        metadata["summary"] =
            json!({ "model": model, "promptVersion": PROMPT_VERSION, "source": "provider" });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jobs::compile::artifact::test_element as el;

    fn outline() -> Value {
        json!([{ "id": "r", "title": "Guide", "sectionPath": ["Guide"], "children": [
            { "id": "a", "title": "Install", "sectionPath": ["Guide", "Install"], "children": [] },
            { "id": "b", "title": "Use", "sectionPath": ["Guide", "Use"], "children": [] }]}])
    }

    #[test]
    fn sections_are_deepest_first_with_their_subtree_text() {
        let els = [
            el(1, "heading", "Guide", &["Guide"]),
            el(2, "paragraph", "Intro.", &["Guide"]),
            el(3, "paragraph", "Run it.", &["Guide", "Install"]),
            el(4, "paragraph", "Use it.", &["Guide", "Use"]),
        ];
        let s = sections(&outline(), &els);
        let ids: Vec<&str> = s.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(ids, ["a", "b", "r"]);
        assert_eq!(s[0].text, "Run it.");
        assert_eq!(s[2].text, "Guide\n\nIntro.\n\nRun it.\n\nUse it.");
        assert_eq!(s[2].children, ["a", "b"]);
        assert_eq!(levels(&s), vec![0..2, 2..3]);
    }

    #[test]
    fn truncation_table() {
        for (t, max, out) in [
            ("abc", 3, "abc"),
            ("abcdef", 5, "ab..."),
            ("abcdef", 2, "ab"),
            ("ééééé", 4, "é..."),
        ] {
            assert_eq!(truncate(t, max), out, "{t:?} {max}");
        }
    }

    #[test]
    fn the_fingerprint_changes_with_every_part_of_the_input() {
        let s = Section {
            id: "a".into(),
            depth: 1,
            title: "Install".into(),
            section_path: vec!["Guide".into(), "Install".into()],
            text: "Run it.".into(),
            children: vec![],
        };
        let base = input_fingerprint(&s, &[], "m");
        assert!(base.starts_with("sha256:") && base.len() == 71);
        assert_ne!(base, input_fingerprint(&s, &["x".into()], "m"));
        assert_ne!(base, input_fingerprint(&s, &[], "n"));
        let mut t = s.clone();
        t.text = "Run it twice.".into();
        assert_ne!(base, input_fingerprint(&t, &[], "m"));
    }

    #[test]
    fn answers_are_parsed_and_applied() {
        assert_eq!(parse(r#"{"summary":" Short. "}"#).unwrap(), "Short.");
        assert_eq!(parse("here: {\"summary\":\"x\"} ok").unwrap(), "x");
        assert!(parse("no json").is_err());
        assert!(parse(r#"{"summary":""}"#).is_err());
        let mut nodes = outline();
        let mut meta = json!({});
        let done = HashMap::from([(
            "a".to_owned(),
            ("Run.".to_owned(), json!({"provider": "offline"})),
        )]);
        apply(&mut nodes, &mut meta, &done, "m");
        assert_eq!(nodes[0]["children"][0]["summary"], "Run.");
        assert_eq!(
            nodes[0]["children"][0]["metadata"]["summary"]["source"],
            "provider"
        );
        assert!(nodes[0]["children"][1].get("summary").is_none());
        assert_eq!(meta["summary"]["promptVersion"], PROMPT_VERSION);
    }
}
