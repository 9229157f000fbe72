//! Parsing: a pure function of a document's bytes and format into sections of typed blocks
//! (the elements of its parse artifact, see [`super::artifact`]). Invariant: the same bytes and
//! format always give the same sections, and no input makes these functions panic: bad input
//! is a [`ParseError`].

pub mod office;
pub mod pdf;
pub mod raw;
pub mod remote;
pub mod route;

/// What the local parsers' tests share: the committed fixtures and a readable dump.
#[cfg(test)]
pub(crate) mod test_support {
    use super::raw::RawElement;

    pub(crate) fn fixture(name: &str) -> Vec<u8> {
        let path = format!(
            "{}/tests/fixtures/documents/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    pub(crate) fn dump(els: &[RawElement]) -> String {
        els.iter()
            .map(|e| {
                format!(
                    "{:?} p{:?} d{:?}: {}\n",
                    e.kind, e.metadata.page_number, e.metadata.category_depth, e.text
                )
            })
            .collect()
    }
}

use pulldown_cmark::{Event, HeadingLevel, Options, Parser, Tag, TagEnd};
use serde::Serialize;

/// A format the compiler understands. Text, Markdown and HTML are parsed here; the others are
/// the platform's parser-service family (PDF and office files), parsed through the configured
/// parser route ([`route`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Text,
    Markdown,
    Html,
    Pdf,
    Docx,
    Pptx,
    Xlsx,
    Doc,
    Ppt,
    Xls,
    Odt,
    Rtf,
    Epub,
    Eml,
    Msg,
}

/// The parser-service family: extension and MIME type of each.
const DOCUMENTS: [(Format, &str, &str); 12] = [
    (Format::Pdf, "pdf", "application/pdf"),
    (
        Format::Docx,
        "docx",
        "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
    ),
    (
        Format::Pptx,
        "pptx",
        "application/vnd.openxmlformats-officedocument.presentationml.presentation",
    ),
    (
        Format::Xlsx,
        "xlsx",
        "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
    ),
    (Format::Doc, "doc", "application/msword"),
    (Format::Ppt, "ppt", "application/vnd.ms-powerpoint"),
    (Format::Xls, "xls", "application/vnd.ms-excel"),
    (
        Format::Odt,
        "odt",
        "application/vnd.oasis.opendocument.text",
    ),
    (Format::Rtf, "rtf", "application/rtf"),
    (Format::Epub, "epub", "application/epub+zip"),
    (Format::Eml, "eml", "message/rfc822"),
    (Format::Msg, "msg", "application/vnd.ms-outlook"),
];

impl Format {
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Text => "text",
            Format::Markdown => "markdown",
            Format::Html => "html",
            other => DOCUMENTS
                .iter()
                .find(|(f, _, _)| *f == other)
                .map_or("document", |(_, ext, _)| ext),
        }
    }

    /// A format of the parser-service family, parsed through the parser route rather than
    /// here.
    pub fn is_document(self) -> bool {
        !matches!(self, Format::Text | Format::Markdown | Format::Html)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("unsupported format: {0}")]
    Unsupported(String),
    #[error("corrupt document: {0}")]
    Corrupt(String),
    #[error("encrypted document: {0}")]
    Encrypted(String),
    #[error("empty document: {0}")]
    Empty(String),
}

impl ParseError {
    /// The attempt's `last_error_code`.
    pub fn code(&self) -> &'static str {
        match self {
            ParseError::Unsupported(_) => "unsupported_format",
            ParseError::Corrupt(_) => "corrupt_document",
            ParseError::Encrypted(_) => "encrypted_document",
            ParseError::Empty(_) => "empty_document",
        }
    }
}

/// The format of a document from its MIME type, falling back on the file extension when the
/// MIME type is missing or generic.
pub fn detect(mime_type: &str, filename: &str) -> Result<Format, ParseError> {
    let essence = mime_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let ext = filename
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    // As on the platform, a document extension wins over the MIME type.
    if let Some((f, _, _)) = DOCUMENTS.iter().find(|(_, e, _)| *e == ext) {
        return Ok(*f);
    }
    if let Some((f, _, _)) = DOCUMENTS.iter().find(|(_, _, m)| *m == essence) {
        return Ok(*f);
    }
    match essence.as_str() {
        "text/rtf" => return Ok(Format::Rtf),
        "text/plain" => return Ok(Format::Text),
        "text/markdown" | "text/x-markdown" => return Ok(Format::Markdown),
        "text/html" | "application/xhtml+xml" => return Ok(Format::Html),
        "" | "application/octet-stream" | "binary/octet-stream" => {}
        other => {
            return Err(ParseError::Unsupported(format!(
            "MIME type {other:?} of {filename:?} (supported: text/plain, text/markdown, text/html, \
             application/pdf and the office formats)"
        )))
        }
    }
    match ext.as_str() {
        "txt" | "text" => Ok(Format::Text),
        "md" | "markdown" => Ok(Format::Markdown),
        "html" | "htm" | "xhtml" => Ok(Format::Html),
        _ => Err(ParseError::Unsupported(format!(
            "{filename:?} has no supported MIME type or extension (.txt, .md, .html, .pdf, \
             .docx, .pptx, ...)"
        ))),
    }
}

/// What a block of text is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    /// A paragraph, a table row, a quote.
    Paragraph,
    /// A list item.
    List,
    /// Preformatted code, line breaks kept.
    Code,
}

/// A run of blocks under one heading (or before the first heading).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Section {
    /// 0 before the first heading, else the heading level 1..=6.
    pub level: u8,
    /// The headings from the top down to this section's own.
    pub heading_path: Vec<String>,
    /// Paragraphs, list items, code blocks, table rows: the kind and text of each block.
    pub blocks: Vec<(BlockKind, String)>,
}

/// A parsed document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parsed {
    pub format: Format,
    pub title: Option<String>,
    pub sections: Vec<Section>,
}

/// Decodes and parses `bytes` as `format`, one of text, Markdown and HTML.
pub fn parse(format: Format, bytes: &[u8]) -> Result<Parsed, ParseError> {
    if format.is_document() {
        return Err(ParseError::Unsupported(format!(
            "{} is parsed through the parser route",
            format.as_str()
        )));
    }
    let text = std::str::from_utf8(bytes).map_err(|e| {
        ParseError::Corrupt(format!(
            "not valid UTF-8 (first bad byte at offset {})",
            e.valid_up_to()
        ))
    })?;
    if let Some(at) = text.find('\0') {
        return Err(ParseError::Corrupt(format!(
            "contains a NUL character at offset {at}"
        )));
    }
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let text = text.replace("\r\n", "\n").replace('\r', "\n");
    Ok(match format {
        Format::Markdown => parse_markdown(&text),
        Format::Html => parse_html(&text),
        // Plain text (documents were refused above).
        _ => parse_text(&text),
    })
}

/// Collapses every run of whitespace into one space and trims.
fn collapse(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Builds sections from a stream of headings and blocks.
struct Builder {
    sections: Vec<Section>,
    stack: Vec<(u8, String)>,
    title: Option<String>,
}

impl Builder {
    fn new() -> Self {
        Self {
            sections: vec![Section {
                level: 0,
                heading_path: Vec::new(),
                blocks: Vec::new(),
            }],
            stack: Vec::new(),
            title: None,
        }
    }

    fn heading(&mut self, level: u8, text: &str) {
        let text = collapse(text);
        if text.is_empty() {
            return;
        }
        if self.title.is_none() {
            self.title = Some(text.clone());
        }
        while self.stack.last().is_some_and(|(l, _)| *l >= level) {
            self.stack.pop();
        }
        self.stack.push((level, text));
        self.sections.push(Section {
            level,
            heading_path: self.stack.iter().map(|(_, t)| t.clone()).collect(),
            blocks: Vec::new(),
        });
    }

    /// Adds a block; code keeps its line breaks.
    fn block(&mut self, text: &str, kind: BlockKind) {
        let text = if kind == BlockKind::Code {
            text.trim_matches('\n').trim_end().to_owned()
        } else {
            collapse(text)
        };
        if text.trim().is_empty() {
            return;
        }
        if let Some(s) = self.sections.last_mut() {
            s.blocks.push((kind, text));
        }
    }

    fn finish(mut self, format: Format, title: Option<String>) -> Parsed {
        // The empty preamble carries nothing.
        if self.sections.first().is_some_and(|s| s.blocks.is_empty()) {
            self.sections.remove(0);
        }
        Parsed {
            format,
            title: title.or(self.title),
            sections: self.sections,
        }
    }
}

fn parse_text(text: &str) -> Parsed {
    let mut b = Builder::new();
    let mut para = String::new();
    for line in text.lines() {
        if line.trim().is_empty() {
            b.block(&para, BlockKind::Paragraph);
            para.clear();
        } else {
            para.push_str(line);
            para.push('\n');
        }
    }
    b.block(&para, BlockKind::Paragraph);
    b.finish(Format::Text, None)
}

fn level_of(l: HeadingLevel) -> u8 {
    match l {
        HeadingLevel::H1 => 1,
        HeadingLevel::H2 => 2,
        HeadingLevel::H3 => 3,
        HeadingLevel::H4 => 4,
        HeadingLevel::H5 => 5,
        HeadingLevel::H6 => 6,
    }
}

fn parse_markdown(text: &str) -> Parsed {
    let options = Options::ENABLE_TABLES
        | Options::ENABLE_STRIKETHROUGH
        | Options::ENABLE_TASKLISTS
        | Options::ENABLE_FOOTNOTES
        | Options::ENABLE_YAML_STYLE_METADATA_BLOCKS;
    let mut b = Builder::new();
    let mut buf = String::new();
    let mut heading: Option<(u8, String)> = None;
    let mut in_code = false;
    let mut in_metadata = false;
    // List items open around the text being read.
    let mut items = 0usize;
    let kind = |items: usize| {
        if items > 0 {
            BlockKind::List
        } else {
            BlockKind::Paragraph
        }
    };
    for event in Parser::new_ext(text, options) {
        match event {
            Event::Start(Tag::Heading { level, .. }) => {
                b.block(&buf, kind(items));
                buf.clear();
                heading = Some((level_of(level), String::new()));
            }
            Event::End(TagEnd::Heading(_)) => {
                if let Some((level, t)) = heading.take() {
                    b.heading(level, &t);
                }
            }
            Event::Start(Tag::MetadataBlock(_)) => in_metadata = true,
            Event::End(TagEnd::MetadataBlock(_)) => in_metadata = false,
            Event::Start(Tag::CodeBlock(_)) => {
                b.block(&buf, kind(items));
                buf.clear();
                in_code = true;
            }
            Event::End(TagEnd::CodeBlock) => {
                b.block(&buf, BlockKind::Code);
                buf.clear();
                in_code = false;
            }
            Event::Start(Tag::Item) => {
                b.block(&buf, kind(items));
                buf.clear();
                items += 1;
            }
            Event::End(TagEnd::Item) => {
                b.block(&buf, kind(items));
                buf.clear();
                items = items.saturating_sub(1);
            }
            Event::Start(
                Tag::Paragraph
                | Tag::List(_)
                | Tag::BlockQuote(_)
                | Tag::Table(_)
                | Tag::TableHead
                | Tag::TableRow
                | Tag::FootnoteDefinition(_)
                | Tag::DefinitionListTitle
                | Tag::DefinitionListDefinition,
            )
            | Event::End(
                TagEnd::Paragraph
                | TagEnd::List(_)
                | TagEnd::BlockQuote(_)
                | TagEnd::Table
                | TagEnd::TableHead
                | TagEnd::TableRow
                | TagEnd::FootnoteDefinition
                | TagEnd::DefinitionListTitle
                | TagEnd::DefinitionListDefinition
                | TagEnd::HtmlBlock,
            )
            | Event::Rule => {
                b.block(&buf, kind(items));
                buf.clear();
            }
            Event::End(TagEnd::TableCell) => buf.push_str(" | "),
            Event::Text(t) | Event::Code(t) | Event::InlineMath(t) | Event::DisplayMath(t) => {
                if in_metadata {
                    continue;
                }
                match heading.as_mut() {
                    Some((_, h)) => h.push_str(&t),
                    None => buf.push_str(&t),
                }
            }
            Event::SoftBreak | Event::HardBreak => match heading.as_mut() {
                Some((_, h)) => h.push(' '),
                None => buf.push(if in_code { '\n' } else { ' ' }),
            },
            // Raw HTML in Markdown is markup, not content.
            _ => {}
        }
    }
    b.block(
        &buf,
        if in_code {
            BlockKind::Code
        } else {
            kind(items)
        },
    );
    b.finish(Format::Markdown, None)
}

/// Elements whose content is never document text.
const HTML_SKIP: &[&str] = &[
    "head", "script", "style", "noscript", "template", "svg", "math", "iframe", "object", "canvas",
    "select", "button",
];

/// Elements that start and end a block of text.
const HTML_BLOCKS: &[&str] = &[
    "html",
    "body",
    "p",
    "div",
    "section",
    "article",
    "main",
    "header",
    "footer",
    "nav",
    "aside",
    "ul",
    "ol",
    "li",
    "dl",
    "dt",
    "dd",
    "pre",
    "blockquote",
    "table",
    "thead",
    "tbody",
    "tfoot",
    "tr",
    "caption",
    "figure",
    "figcaption",
    "hr",
    "address",
    "details",
    "summary",
    "form",
    "fieldset",
    "legend",
];

fn html_heading(name: &str) -> Option<u8> {
    match name {
        "h1" => Some(1),
        "h2" => Some(2),
        "h3" => Some(3),
        "h4" => Some(4),
        "h5" => Some(5),
        "h6" => Some(6),
        _ => None,
    }
}

fn parse_html(text: &str) -> Parsed {
    use ego_tree::iter::Edge;
    use scraper::{Html, Node};

    let doc = Html::parse_document(text);
    let title = scraper::Selector::parse("title")
        .ok()
        .and_then(|sel| {
            doc.select(&sel)
                .next()
                .map(|t| collapse(&t.text().collect::<String>()))
        })
        .filter(|t| !t.is_empty());
    let mut b = Builder::new();
    let mut buf = String::new();
    let mut heading: Option<(u8, String)> = None;
    let mut skip = 0usize;
    let mut pre = 0usize;
    // List items (li, dt, dd) open around the text being read.
    let mut items = 0usize;
    let kind = |pre: usize, items: usize| {
        if pre > 0 {
            BlockKind::Code
        } else if items > 0 {
            BlockKind::List
        } else {
            BlockKind::Paragraph
        }
    };
    // Iterative traversal: nesting depth never grows the stack.
    for edge in doc.tree.root().traverse() {
        match edge {
            Edge::Open(node) => match node.value() {
                Node::Element(e) => {
                    let name = e.name();
                    if skip > 0 || HTML_SKIP.contains(&name) {
                        skip += 1;
                    } else if let Some(level) = html_heading(name) {
                        b.block(&buf, kind(pre, items));
                        buf.clear();
                        heading = Some((level, String::new()));
                    } else if name == "pre" {
                        b.block(&buf, kind(pre, items));
                        buf.clear();
                        pre += 1;
                    } else if HTML_BLOCKS.contains(&name) {
                        b.block(&buf, kind(pre, items));
                        buf.clear();
                        if matches!(name, "li" | "dt" | "dd") {
                            items += 1;
                        }
                    } else if matches!(name, "br" | "td" | "th" | "img") {
                        buf.push(if pre > 0 { '\n' } else { ' ' });
                        if name == "img" {
                            if let Some(alt) = e.attr("alt") {
                                buf.push_str(alt);
                                buf.push(' ');
                            }
                        }
                    }
                }
                Node::Text(t) if skip == 0 => match heading.as_mut() {
                    Some((_, h)) => h.push_str(t),
                    None => buf.push_str(t),
                },
                _ => {}
            },
            Edge::Close(node) => {
                if let Node::Element(e) = node.value() {
                    let name = e.name();
                    if skip > 0 {
                        skip -= 1;
                    } else if html_heading(name).is_some() {
                        if let Some((level, t)) = heading.take() {
                            b.heading(level, &t);
                        }
                    } else if name == "pre" {
                        b.block(&buf, BlockKind::Code);
                        buf.clear();
                        pre = pre.saturating_sub(1);
                    } else if HTML_BLOCKS.contains(&name) {
                        b.block(&buf, kind(pre, items));
                        buf.clear();
                        if matches!(name, "li" | "dt" | "dd") {
                            items = items.saturating_sub(1);
                        }
                    }
                }
            }
        }
    }
    b.block(&buf, kind(pre, items));
    b.finish(Format::Html, title)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_are_detected_by_mime_type_then_extension() {
        assert_eq!(detect("text/markdown", "x"), Ok(Format::Markdown));
        assert_eq!(
            detect("text/html; charset=utf-8", "x.bin"),
            Ok(Format::Html)
        );
        assert_eq!(detect("TEXT/PLAIN", "a.md"), Ok(Format::Text));
        assert_eq!(
            detect("application/octet-stream", "notes.MD"),
            Ok(Format::Markdown)
        );
        assert_eq!(detect("", "page.htm"), Ok(Format::Html));
        assert_eq!(detect("application/pdf", "a.pdf"), Ok(Format::Pdf));
        // As on the platform, a document extension wins over the MIME type.
        assert_eq!(detect("text/plain", "deck.PPTX"), Ok(Format::Pptx));
        assert_eq!(
            detect(
                "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
                "upload"
            ),
            Ok(Format::Docx)
        );
        assert_eq!(detect("", "letter.rtf"), Ok(Format::Rtf));
        assert!(Format::Pdf.is_document() && !Format::Markdown.is_document());
        assert_eq!(
            detect("image/bmp", "a.bmp").unwrap_err().code(),
            "unsupported_format"
        );
        assert_eq!(
            detect("", "archive.zip").unwrap_err().code(),
            "unsupported_format"
        );
    }

    #[test]
    fn bad_bytes_are_corrupt_not_a_panic() {
        for bytes in [&b"\xff\xfe\x00abc"[..], b"ok then \xc3", b"nul\0inside"] {
            for f in [Format::Text, Format::Markdown, Format::Html] {
                assert_eq!(parse(f, bytes).unwrap_err().code(), "corrupt_document");
            }
        }
        // Odd but valid input parses.
        for f in [Format::Text, Format::Markdown, Format::Html] {
            for s in [
                "",
                "\u{feff}",
                "<<<>>>",
                "# ",
                "<h1></h1>",
                &"<div>".repeat(5000),
            ] {
                parse(f, s.as_bytes()).unwrap();
            }
        }
    }

    #[test]
    fn markdown_sections_follow_headings() {
        let md = "---\ntitle: x\n---\nIntro text.\n\n# Guide\n\nFirst *para*.\n\n## Install\n\n- one\n- two\n\n```\ncode  line\nnext\n```\n\n# Other\n\nEnd.";
        let p = parse(Format::Markdown, md.as_bytes()).unwrap();
        assert_eq!(p.title.as_deref(), Some("Guide"));
        let got: Vec<(u8, Vec<&str>, Vec<&str>)> = p
            .sections
            .iter()
            .map(|s| {
                (
                    s.level,
                    s.heading_path.iter().map(String::as_str).collect(),
                    s.blocks.iter().map(|(_, t)| t.as_str()).collect(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (0, vec![], vec!["Intro text."]),
                (1, vec!["Guide"], vec!["First para."]),
                (
                    2,
                    vec!["Guide", "Install"],
                    vec!["one", "two", "code  line\nnext"]
                ),
                (1, vec!["Other"], vec!["End."]),
            ]
        );
        let kinds: Vec<BlockKind> = p.sections[2].blocks.iter().map(|(k, _)| *k).collect();
        assert_eq!(kinds, [BlockKind::List, BlockKind::List, BlockKind::Code]);
        assert_eq!(p.sections[1].blocks[0].0, BlockKind::Paragraph);
    }

    #[test]
    fn html_skips_scripts_and_keeps_structure() {
        let html = "<html><head><title>T</title><style>x{}</style></head><body>\
            <h1>Top</h1><p>Alpha <b>beta</b></p><script>evil()</script>\
            <h3>Deep</h3><ul><li>item one</li><li>item two</li></ul>\
            <h2>Mid</h2><pre>a\n  b</pre><table><tr><td>c1</td><td>c2</td></tr></table></body></html>";
        let p = parse(Format::Html, html.as_bytes()).unwrap();
        assert_eq!(p.title.as_deref(), Some("T"));
        let paths: Vec<Vec<String>> = p.sections.iter().map(|s| s.heading_path.clone()).collect();
        assert_eq!(
            paths,
            vec![
                vec!["Top".to_owned()],
                vec!["Top".to_owned(), "Deep".to_owned()],
                vec!["Top".to_owned(), "Mid".to_owned()],
            ]
        );
        let texts = |i: usize| -> Vec<(BlockKind, &str)> {
            p.sections[i]
                .blocks
                .iter()
                .map(|(k, t)| (*k, t.as_str()))
                .collect()
        };
        assert_eq!(texts(0), vec![(BlockKind::Paragraph, "Alpha beta")]);
        assert_eq!(
            texts(1),
            vec![(BlockKind::List, "item one"), (BlockKind::List, "item two")]
        );
        assert_eq!(
            texts(2),
            vec![(BlockKind::Code, "a\n  b"), (BlockKind::Paragraph, "c1 c2")]
        );
        let all: String = p
            .sections
            .iter()
            .flat_map(|s| s.blocks.iter().map(|(_, t)| t.clone()))
            .collect();
        assert!(!all.contains("evil") && !all.contains("x{}"));
    }

    #[test]
    fn text_paragraphs_split_on_blank_lines() {
        let p = parse(Format::Text, b"one\r\ntwo\r\n\r\n\r\nthree\n").unwrap();
        assert_eq!(p.sections.len(), 1);
        assert_eq!(
            p.sections[0].blocks,
            vec![
                (BlockKind::Paragraph, "one two".to_owned()),
                (BlockKind::Paragraph, "three".to_owned())
            ]
        );
    }
}
