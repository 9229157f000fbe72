//! The platform's deterministic document outline (`document_outlines.nodes`), built from a parse
//! artifact's elements. Invariant: a pure function of the elements, the generation, document and
//! version: every section path prefix is one node, created in the order it first appears, with
//! id `child_id(generation, "document-outline:<doc>:<version>:<seq>")`; the outline's own id
//! takes the next sequence number; offsets are the canonical text's UTF-8 byte offsets, a
//! node's range covering its own spans and its children's.

use serde_json::{json, Map, Value};
use uuid::Uuid;

use super::artifact::{spans, Element};
use crate::canonical::child_id;

pub const OUTLINE_VERSION: &str = "document-outline-v1";
/// The longest node summary, in characters.
pub const MAX_SUMMARY_CHARS: usize = 2000;
/// Sections longer than this are flagged for subdivision in the outline's quality report.
pub const LARGE_SECTION_CHARS: usize = 12_000;

/// A built outline: its id, its root nodes (each with its children nested), and its metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct Outline {
    pub id: Uuid,
    pub nodes: Value,
    pub metadata: Value,
}

#[derive(Default)]
struct Draft {
    id: Uuid,
    level: usize,
    title: String,
    section_path: Vec<String>,
    from_heading: bool,
    children: Vec<usize>,
    /// (element id, start, end, text, is a heading)
    spans: Vec<(String, usize, usize, String, bool)>,
    title_location: Option<(usize, usize, String)>,
}

/// The section path an element belongs to.
fn path_of(e: &Element) -> Vec<String> {
    let path: Vec<String> = e
        .section_path
        .iter()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect();
    if !path.is_empty() {
        path
    } else if e.is_heading() {
        vec![e.trimmed().to_owned()]
    } else {
        vec!["Document".to_owned()]
    }
}

/// Builds the outline of a document version under `generation`.
pub fn build(
    generation: Uuid,
    document: Uuid,
    version: i32,
    elements: &[Element],
    parser: &str,
    parser_version: &str,
    content_type: &str,
) -> Outline {
    let seed = |seq: usize| {
        child_id(
            generation,
            &format!("document-outline:{document}:{version}:{seq}"),
        )
    };
    let mut drafts: Vec<Draft> = Vec::new();
    let mut roots: Vec<usize> = Vec::new();
    let all = spans(elements);
    for s in &all {
        let e = &elements[s.element];
        let path = path_of(e);
        let mut parent: Option<usize> = None;
        for depth in 1..=path.len() {
            let prefix = &path[..depth];
            let siblings = match parent {
                Some(p) => drafts[p].children.clone(),
                None => roots.clone(),
            };
            let found = siblings
                .into_iter()
                .find(|&i| drafts[i].section_path == prefix);
            let i = match found {
                Some(i) => i,
                None => {
                    let i = drafts.len();
                    drafts.push(Draft {
                        id: seed(i),
                        level: depth,
                        title: prefix[depth - 1].clone(),
                        section_path: prefix.to_vec(),
                        ..Draft::default()
                    });
                    match parent {
                        Some(p) => drafts[p].children.push(i),
                        None => roots.push(i),
                    }
                    i
                }
            };
            if depth == path.len() && e.is_heading() {
                drafts[i].from_heading = true;
                if drafts[i].title_location.is_none() {
                    drafts[i].title_location = Some((s.start, s.end, e.trimmed().to_owned()));
                }
            }
            parent = Some(i);
        }
        if let Some(p) = parent {
            drafts[p].spans.push((
                e.id.clone(),
                s.start,
                s.end,
                e.trimmed().to_owned(),
                e.is_heading(),
            ));
        }
    }
    if drafts.is_empty() {
        drafts.push(Draft {
            id: seed(0),
            level: 1,
            title: "Document".into(),
            section_path: vec!["Document".into()],
            ..Draft::default()
        });
        roots.push(0);
    }
    let outline_id = seed(drafts.len());
    let nodes: Vec<Value> = roots.iter().map(|&i| render(&drafts, i)).collect();
    let headings = drafts.iter().filter(|d| d.from_heading).count();
    let located = drafts.iter().filter(|d| d.title_location.is_some()).count();
    let fallback = drafts.len() - headings;
    let large: Vec<Value> = drafts
        .iter()
        .filter(|d| {
            d.spans.iter().map(|s| s.3.chars().count()).sum::<usize>() > LARGE_SECTION_CHARS
        })
        .take(100)
        .map(|d| json!(d.id))
        .collect();
    let ratio = |n: usize| (n as f64 / drafts.len() as f64 * 1000.0).round() / 1000.0;
    let mut warnings = Vec::new();
    if headings == 0 {
        warnings.push("outline-derived-from-fallback");
    }
    if !large.is_empty() {
        warnings.push("large-sections-need-recursive-subdivision");
    }
    if located < drafts.len() {
        warnings.push("some-title-locations-missing");
    }
    let metadata = json!({
        "builder": "deterministic-parse-artifact",
        "contentType": content_type,
        "elementSeparator": "\n",
        "offsetEncoding": "utf-8-bytes",
        "parser": parser,
        "parserVersion": parser_version,
        "quality": {
            "fallbackNodeCount": fallback,
            "headingCoverageRatio": ratio(headings),
            "largeSectionCandidates": large,
            "largeSectionChars": LARGE_SECTION_CHARS,
            "nodeCount": drafts.len(),
            "offsetRangeValid": true,
            "pageRangeValid": true,
            "titleLocationCoverageRatio": ratio(located),
            "warnings": warnings,
        },
        "sourceElementCount": elements.len(),
        "textNormalization": "unicode-whitespace-trim",
    });
    Outline {
        id: outline_id,
        nodes: Value::Array(nodes),
        metadata,
    }
}

/// A node's summary: its own text (headings aside), else its children's, else its title.
fn summary(drafts: &[Draft], i: usize) -> String {
    let d = &drafts[i];
    let own: Vec<&str> = d
        .spans
        .iter()
        .filter(|s| !s.4)
        .map(|s| s.3.as_str())
        .collect();
    let text = if !own.is_empty() {
        own.join(" ")
    } else {
        let kids: Vec<String> = d
            .children
            .iter()
            .map(|&c| summary(drafts, c))
            .filter(|s| !s.is_empty())
            .collect();
        if kids.is_empty() {
            d.title.clone()
        } else {
            kids.join(" ")
        }
    };
    let collapsed = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if collapsed.chars().count() > MAX_SUMMARY_CHARS {
        let cut: String = collapsed.chars().take(MAX_SUMMARY_CHARS - 3).collect();
        format!("{cut}...")
    } else {
        collapsed
    }
}

fn range(drafts: &[Draft], i: usize) -> Option<(usize, usize)> {
    let d = &drafts[i];
    let own = d.spans.iter().map(|s| (s.1, s.2));
    let kids = d.children.iter().filter_map(|&c| range(drafts, c));
    own.chain(kids)
        .reduce(|(a, b), (c, e)| (a.min(c), b.max(e)))
}

fn render(drafts: &[Draft], i: usize) -> Value {
    let d = &drafts[i];
    let mut node = Map::new();
    let children: Vec<Value> = d.children.iter().map(|&c| render(drafts, c)).collect();
    node.insert(
        "childNodeIds".into(),
        json!(d.children.iter().map(|&c| drafts[c].id).collect::<Vec<_>>()),
    );
    node.insert("children".into(), Value::Array(children));
    let r = range(drafts, i);
    if let Some((_, end)) = r {
        node.insert("endOffset".into(), json!(end));
    }
    node.insert("id".into(), json!(d.id));
    node.insert("level".into(), json!(d.level));
    node.insert(
        "metadata".into(),
        json!({ "canonicalCharacterCount": d.spans.iter().map(|s| s.3.chars().count()).sum::<usize>() }),
    );
    node.insert("sectionPath".into(), json!(d.section_path));
    node.insert(
        "sourceElementIds".into(),
        json!(d.spans.iter().map(|s| s.0.clone()).collect::<Vec<_>>()),
    );
    node.insert("sourceNodeIds".into(), json!([]));
    if let Some((start, _)) = r {
        node.insert("startOffset".into(), json!(start));
    }
    node.insert("summary".into(), json!(summary(drafts, i)));
    node.insert("title".into(), json!(d.title));
    if let Some((start, end, text)) = &d.title_location {
        node.insert(
            "titleLocation".into(),
            json!({ "confidence": 1, "endOffset": end, "matchedText": text, "source": "parser-heading",
                    "startOffset": start }),
        );
    }
    node.insert(
        "tocSource".into(),
        json!(if d.from_heading {
            "parser-heading"
        } else {
            "fallback"
        }),
    );
    Value::Object(node)
}

/// The nodes of an outline in pre-order, each with its parent's id: what the page index and the
/// knowledge paths walk.
pub fn preorder(nodes: &Value) -> Vec<(&Value, Option<&str>, Vec<String>)> {
    fn walk<'a>(
        n: &'a Value,
        parent: Option<&'a str>,
        ancestors: &[String],
        out: &mut Vec<(&'a Value, Option<&'a str>, Vec<String>)>,
    ) {
        let id = n["id"].as_str().unwrap_or_default();
        let mut visited = ancestors.to_vec();
        visited.push(id.to_owned());
        out.push((n, parent, visited.clone()));
        if let Some(children) = n["children"].as_array() {
            for c in children {
                walk(c, Some(id), &visited, out);
            }
        }
    }
    let mut out = Vec::new();
    if let Some(roots) = nodes.as_array() {
        for r in roots {
            walk(r, None, &[], &mut out);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::jobs::compile::artifact::test_element as el;

    #[test]
    fn headings_become_a_tree_with_ranges_and_summaries() {
        let els = vec![
            el(1, "paragraph", "Preface.", &[]),
            el(2, "heading", "Guide", &["Guide"]),
            el(3, "paragraph", "Read this.", &["Guide"]),
            el(4, "heading", "Install", &["Guide", "Install"]),
            el(5, "list", "one", &["Guide", "Install"]),
        ];
        let (g, d) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let o = build(g, d, 3, &els, "markdown", "v1", "text/markdown");
        let roots = o.nodes.as_array().unwrap();
        assert_eq!(roots.len(), 2);
        assert_eq!(roots[0]["title"], "Document");
        assert_eq!(roots[0]["tocSource"], "fallback");
        assert_eq!(roots[1]["title"], "Guide");
        assert_eq!(roots[1]["tocSource"], "parser-heading");
        assert_eq!(roots[1]["summary"], "Read this.");
        let install = &roots[1]["children"][0];
        assert_eq!(install["sectionPath"], json!(["Guide", "Install"]));
        assert_eq!(install["level"], 2);
        assert_eq!(roots[1]["childNodeIds"][0], install["id"]);
        assert_eq!(roots[1]["startOffset"], 9);
        assert_eq!(roots[1]["endOffset"], install["endOffset"]);
        assert_eq!(
            install["id"],
            json!(child_id(g, &format!("document-outline:{d}:3:2")))
        );
        assert_eq!(o.id, child_id(g, &format!("document-outline:{d}:3:3")));
        assert_eq!(preorder(&o.nodes).len(), 3);
        assert_eq!(o.metadata["quality"]["nodeCount"], 3);
        assert_eq!(o, build(g, d, 3, &els, "markdown", "v1", "text/markdown"));
    }

    #[test]
    fn a_document_without_text_has_one_fallback_node() {
        let o = build(Uuid::nil(), Uuid::nil(), 1, &[], "text", "v1", "text/plain");
        assert_eq!(o.nodes.as_array().unwrap().len(), 1);
        assert_eq!(o.nodes[0]["title"], "Document");
        assert!(o.nodes[0].get("startOffset").is_none());
    }
}
