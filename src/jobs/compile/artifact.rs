//! The canonical parse of a document version, as the platform stores it in `parse_artifacts`:
//! a list of typed elements, each with its text and section path. Invariant: the elements are a
//! pure function of the document's bytes and format, their ids are `<artifactId>:element-<n>`
//! (1-based), and the canonical text every later offset counts in is the trimmed non-empty
//! element texts joined by one `\n`, offsets in UTF-8 bytes.

use serde_json::{json, Value};
use uuid::Uuid;

use super::parse::{BlockKind, Format, Parsed};

pub use super::element::{content_type_of, Element};

/// An element for unit tests: id `a:element-<n>`, no page, no metadata.
#[cfg(test)]
pub(crate) fn test_element(n: usize, kind: &str, text: &str, path: &[&str]) -> Element {
    Element {
        id: format!("a:element-{n}"),
        kind: kind.into(),
        text: Some(text.into()),
        section_path: path.iter().map(|s| (*s).to_owned()).collect(),
        page_number: None,
        metadata: serde_json::json!({}),
    }
}

/// The platform's parser for a format and its version string (part of the artifact hash). Plain
/// text goes to the Markdown parser, as on the platform.
pub fn parser_of(format: Format) -> (&'static str, &'static str) {
    match format {
        Format::Markdown | Format::Text => ("native-markdown", "native-markdown@1"),
        Format::Html => ("native-html", "native-html@1"),
        _ => ("unstructured", super::parse::route::PARSER_VERSION),
    }
}

/// The platform's artifact hash: SHA-256 over the parser version, a newline, and the bytes.
pub fn artifact_hash(parser_version: &str, bytes: &[u8]) -> String {
    let mut input = Vec::with_capacity(parser_version.len() + 1 + bytes.len());
    input.extend_from_slice(parser_version.as_bytes());
    input.push(b'\n');
    input.extend_from_slice(bytes);
    crate::canonical::sha256_hex(&input)
}

/// The elements of a parsed document: each heading (its section path ends with itself), then
/// the section's blocks under that path; the items of one list are one `list` element, one item
/// per line, as the platform's parsers make them.
pub fn elements(artifact_id: Uuid, p: &Parsed) -> Vec<Element> {
    let mut out: Vec<Element> = Vec::new();
    let mut push = |kind: &str, text: &str, path: &[String], metadata: Value| {
        let n = out.len() + 1;
        out.push(Element {
            id: format!("{artifact_id}:element-{n}"),
            kind: kind.to_owned(),
            text: Some(text.to_owned()),
            section_path: path.to_vec(),
            page_number: None,
            metadata,
        });
    };
    for s in &p.sections {
        if s.level > 0 {
            if let Some(title) = s.heading_path.last() {
                push(
                    "heading",
                    title,
                    &s.heading_path,
                    json!({ "depth": s.level }),
                );
            }
        }
        let mut i = 0;
        while i < s.blocks.len() {
            let (kind, text) = &s.blocks[i];
            match kind {
                BlockKind::List => {
                    let mut items = vec![text.as_str()];
                    while let Some((BlockKind::List, next)) = s.blocks.get(i + 1) {
                        items.push(next);
                        i += 1;
                    }
                    push("list", &items.join("\n"), &s.heading_path, json!({}));
                }
                BlockKind::Paragraph => push("paragraph", text, &s.heading_path, json!({})),
                BlockKind::Code => push("code", text, &s.heading_path, json!({})),
            }
            i += 1;
        }
    }
    out
}

/// An element's place in the canonical text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Index into the element list.
    pub element: usize,
    pub start: usize,
    pub end: usize,
}

/// The spans of every element with text, in order, offsets in bytes of the canonical text.
pub fn spans(elements: &[Element]) -> Vec<Span> {
    let mut out = Vec::new();
    let mut at = 0usize;
    for (i, e) in elements.iter().enumerate() {
        let t = e.trimmed();
        if t.is_empty() {
            continue;
        }
        if !out.is_empty() {
            at += 1; // the "\n" between two elements
        }
        out.push(Span {
            element: i,
            start: at,
            end: at + t.len(),
        });
        at += t.len();
    }
    out
}

/// The artifact's `metadata` column, with the routing facts the platform's parser router adds.
pub fn metadata(filename: &str, mime_type: &str, parser: &str, parser_version: &str) -> Value {
    json!({ "filename": filename, "mimeType": mime_type, "parserVersion": parser_version,
            "routeReason": "native-file-type", "routedParser": parser })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jobs::compile::parse;

    #[test]
    fn elements_carry_headings_blocks_and_paths() {
        let p = parse::parse(
            Format::Markdown,
            b"Intro text.\n\n# Leases\n\nA lease.\n\n- one\n- two\n\n```\ncode\n```\n",
        )
        .unwrap();
        let id = Uuid::from_u128(7);
        let els = elements(id, &p);
        let kinds: Vec<&str> = els.iter().map(|e| e.kind.as_str()).collect();
        assert_eq!(kinds, ["paragraph", "heading", "paragraph", "list", "code"]);
        assert_eq!(
            els[3].text.as_deref(),
            Some("one\ntwo"),
            "one element per list"
        );
        assert_eq!(content_type_of(&els), "mixed");
        assert_eq!(content_type_of(&els[..3]), "text");
        assert_eq!(els[0].id, format!("{id}:element-1"));
        assert!(els[0].section_path.is_empty());
        assert_eq!(els[1].section_path, ["Leases"]);
        assert_eq!(els[1].metadata, json!({"depth": 1}));
        assert_eq!(els[2].section_path, ["Leases"]);
        let s = spans(&els);
        assert_eq!(
            s[0],
            Span {
                element: 0,
                start: 0,
                end: 11
            }
        );
        assert_eq!(s[1].start, 12, "one newline between elements");
        let round: Vec<Element> =
            serde_json::from_value(serde_json::to_value(&els).unwrap()).unwrap();
        assert_eq!(round, els);
    }

    #[test]
    fn the_artifact_hash_covers_parser_version_and_bytes() {
        assert_eq!(
            artifact_hash("v1", b"abc"),
            crate::canonical::sha256_hex(b"v1\nabc")
        );
        assert_ne!(artifact_hash("v1", b"abc"), artifact_hash("v2", b"abc"));
    }
}
