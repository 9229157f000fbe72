//! The raw parse of a binary document (PDF, office files): the typed elements a parser returns,
//! in the element vocabulary of Unstructured-compatible parser services, before they become the
//! canonical parse artifact. Invariant: the local parsers and the remote parser adapter return
//! this same shape, so one conversion makes the artifact whichever parsed, and it is what the
//! raw-parse checkpoint (`parse_artifact_checkpoints.artifact`) holds.

use serde::{Deserialize, Serialize};

/// One element of a raw parse (`type`, `text`, `metadata`, as the parser service returns it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RawElement {
    /// The element's category: `Title`, `NarrativeText`, `ListItem`, `Table`, `Header`,
    /// `Footer`, `PageBreak`, `Image`, `FigureCaption`, `Formula`, `UncategorizedText`, ...
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: String,
    #[serde(default)]
    pub metadata: RawMetadata,
}

/// The metadata of a raw element that the conversion reads; anything else the parser returns
/// is dropped.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RawMetadata {
    /// 1-based page (PDF page, slide) the element is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_number: Option<i32>,
    /// Heading depth of a `Title` (0 is the top level), or nesting of a `ListItem`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub category_depth: Option<i32>,
    /// A table's HTML.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_as_html: Option<String>,
    /// An image block's bytes, base64, when image blocks were asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_base64: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_mime_type: Option<String>,
    /// The element's own id as the parser service gave it (Unstructured's top-level
    /// `element_id`), so that a `parent_id` can be resolved; local parsers leave it empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub element_id: Option<String>,
    /// The `element_id` of the element this one sits under (a heading's parent heading).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_id: Option<String>,
    /// The languages the parser detected (ISO 639-3, e.g. `eng`, `zho`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub languages: Option<Vec<String>>,
}

impl RawElement {
    pub fn new(kind: &str, text: impl Into<String>, page: Option<i32>) -> Self {
        Self {
            kind: kind.to_owned(),
            text: text.into(),
            metadata: RawMetadata {
                page_number: page,
                ..RawMetadata::default()
            },
        }
    }

    /// A heading at `depth` (0 = top level).
    pub fn title(text: impl Into<String>, depth: i32, page: Option<i32>) -> Self {
        let mut e = Self::new("Title", text, page);
        e.metadata.category_depth = Some(depth);
        e
    }

    /// A table: its cells as text rows (`a | b`) and as HTML.
    pub fn table(rows: &[Vec<String>], page: Option<i32>) -> Self {
        let text = rows
            .iter()
            .map(|r| r.join(" | "))
            .collect::<Vec<_>>()
            .join("\n");
        let mut html = String::from("<table>");
        for r in rows {
            html.push_str("<tr>");
            for c in r {
                html.push_str("<td>");
                html.push_str(&escape_html(c));
                html.push_str("</td>");
            }
            html.push_str("</tr>");
        }
        html.push_str("</table>");
        let mut e = Self::new("Table", text, page);
        e.metadata.text_as_html = Some(html);
        e
    }
}

fn escape_html(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The platform's element type of a raw element: the first of these its lower-cased category
/// contains, else `paragraph`.
pub fn element_type(category: &str) -> &'static str {
    let c = category.to_ascii_lowercase();
    if c.contains("title") {
        "title"
    } else if c.contains("heading") {
        "heading"
    } else if c.contains("table") {
        "table"
    } else if c.contains("list") {
        "list"
    } else if c.contains("image") {
        "image"
    } else if c.contains("code") {
        "code"
    } else if c.contains("pagebreak") || c.contains("page break") {
        "page-break"
    } else {
        "paragraph"
    }
}

/// The rows of a table's HTML, each a list of cell texts (`td` and `th` alike).
fn html_rows(html: &str) -> Vec<Vec<String>> {
    let doc = scraper::Html::parse_fragment(html);
    let (Ok(tr), Ok(cell)) = (
        scraper::Selector::parse("tr"),
        scraper::Selector::parse("td, th"),
    ) else {
        return Vec::new();
    };
    doc.select(&tr)
        .map(|r| {
            r.select(&cell)
                .map(|c| collapse(&c.text().collect::<String>()))
                .collect::<Vec<_>>()
        })
        .filter(|r: &Vec<String>| r.iter().any(|c| !c.is_empty()))
        .collect()
}

/// A table's text as the platform projects it: the first row names the columns, and every
/// other row is one line of `column: value` pairs joined by ` | `.
pub fn table_text(html: &str) -> Option<String> {
    let rows = html_rows(html);
    let (head, body) = rows.split_first()?;
    if body.is_empty() {
        return Some(head.join(" | "));
    }
    let lines: Vec<String> = body
        .iter()
        .map(|r| {
            r.iter()
                .enumerate()
                .map(|(i, v)| match head.get(i).filter(|h| !h.is_empty()) {
                    Some(h) => format!("{h}: {v}"),
                    None => v.clone(),
                })
                .collect::<Vec<_>>()
                .join(" | ")
        })
        .collect();
    Some(lines.join("\n"))
}

fn collapse(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The canonical elements of a raw parse, as the platform maps a parser service's elements:
/// each typed by [`element_type`], its text's whitespace collapsed (a table's text from its
/// HTML, see [`table_text`]), its page from `page_number`; elements with neither text nor
/// anything to show are dropped; a heading's section path is the open path cut to its depth
/// plus itself, and every element carries the path open where it stands. Ids are
/// `<artifactId>:element-<n>`, 1-based, in order.
pub fn to_elements(
    artifact_id: uuid::Uuid,
    raw: &[RawElement],
) -> Vec<super::super::element::Element> {
    use serde_json::{json, Map, Value};
    let mut out = Vec::with_capacity(raw.len());
    let mut path: Vec<String> = Vec::new();
    for r in raw {
        let kind = element_type(&r.kind);
        let html = r
            .metadata
            .text_as_html
            .as_deref()
            .filter(|h| !h.trim().is_empty());
        let text = match (kind, html) {
            ("table", Some(h)) => table_text(h).unwrap_or_else(|| collapse(&r.text)),
            _ => collapse(&r.text),
        };
        let image = r.metadata.image_base64.as_deref().filter(|b| !b.is_empty());
        let visual = matches!(kind, "image" | "table" | "page-break") || html.is_some();
        if text.is_empty() && !visual {
            continue;
        }
        if matches!(kind, "title" | "heading") && !text.is_empty() {
            let depth = r.metadata.category_depth.unwrap_or(0).max(0) as usize;
            if depth <= path.len() {
                path.truncate(depth);
                path.push(text.clone());
            } else {
                path = vec![text.clone()];
            }
        }
        let mut metadata = Map::new();
        metadata.insert("unstructuredType".into(), json!(r.kind));
        if let Some(d) = r.metadata.category_depth {
            metadata.insert("categoryDepth".into(), json!(d));
        }
        if let Some(h) = html {
            metadata.insert("textAsHtml".into(), json!(h));
            if kind == "table" {
                metadata.insert("table".into(), json!({ "html": h }));
            }
        }
        if let Some(b) = image {
            let mime = r.metadata.image_mime_type.as_deref().unwrap_or("image/png");
            metadata.insert(
                "assetRef".into(),
                json!({ "contentType": mime, "uri": format!("data:{mime};base64,{b}") }),
            );
        }
        if kind == "title" {
            metadata.insert("title".into(), json!(text));
        }
        let n = out.len() + 1;
        out.push(super::super::element::Element {
            id: format!("{artifact_id}:element-{n}"),
            kind: kind.to_owned(),
            text: (!text.is_empty()).then_some(text),
            section_path: path.clone(),
            page_number: r.metadata.page_number.filter(|p| *p > 0),
            metadata: Value::Object(metadata),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn categories_map_to_the_platforms_element_types() {
        for (category, ty) in [
            ("Title", "title"),
            ("Header", "paragraph"),
            ("NarrativeText", "paragraph"),
            ("ListItem", "list"),
            ("Table", "table"),
            ("Image", "image"),
            ("FigureCaption", "paragraph"),
            ("CodeSnippet", "code"),
            ("PageBreak", "page-break"),
            ("UncategorizedText", "paragraph"),
        ] {
            assert_eq!(element_type(category), ty, "{category}");
        }
    }

    #[test]
    fn headings_open_paths_by_depth_and_every_element_carries_the_open_path() {
        let raw = vec![
            RawElement::title("Guide", 0, Some(1)),
            RawElement::new("NarrativeText", "  intro   text ", Some(1)),
            RawElement::title("Setup", 1, Some(2)),
            RawElement::new("ListItem", "install", Some(2)),
            RawElement::title("Usage", 1, Some(3)),
            RawElement::title("Deep", 5, Some(3)),
            RawElement::new("NarrativeText", "   ", Some(3)),
        ];
        let id = uuid::Uuid::nil();
        let e = to_elements(id, &raw);
        let got: Vec<(&str, &str, Vec<&str>, Option<i32>)> = e
            .iter()
            .map(|e| {
                (
                    e.kind.as_str(),
                    e.trimmed(),
                    e.section_path.iter().map(String::as_str).collect(),
                    e.page_number,
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("title", "Guide", vec!["Guide"], Some(1)),
                ("paragraph", "intro text", vec!["Guide"], Some(1)),
                ("title", "Setup", vec!["Guide", "Setup"], Some(2)),
                ("list", "install", vec!["Guide", "Setup"], Some(2)),
                ("title", "Usage", vec!["Guide", "Usage"], Some(3)),
                ("title", "Deep", vec!["Deep"], Some(3)),
            ]
        );
        assert_eq!(e[1].id, format!("{id}:element-2"));
    }

    #[test]
    fn a_table_reads_as_column_value_lines() {
        let t = RawElement::table(
            &[
                vec!["Name".into(), "Role".into()],
                vec!["Ada".into(), "engineer".into()],
                vec!["Bo".into(), "pilot".into()],
            ],
            Some(4),
        );
        let e = to_elements(uuid::Uuid::nil(), &[t]);
        assert_eq!(e[0].kind, "table");
        assert_eq!(
            e[0].trimmed(),
            "Name: Ada | Role: engineer\nName: Bo | Role: pilot"
        );
        assert!(e[0].metadata["table"]["html"]
            .as_str()
            .unwrap()
            .starts_with("<table>"));
    }
}
