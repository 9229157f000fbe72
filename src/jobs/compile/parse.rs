//! Parsing, outlines, chunks and smoke-probe words: pure functions of a document's bytes.
//! Invariant: the same bytes and format always give the same sections, outline and chunks (so
//! any step may regenerate them after a crash or on another worker), every chunk holds at most
//! [`MAX_CHUNK_CHARS`] characters and never spans two sections, and no input makes these
//! functions panic: bad input is an [`ParseError`].

use pulldown_cmark::{Event, HeadingLevel, Options, Parser, Tag, TagEnd};
use serde::Serialize;

/// The largest chunk, in characters.
pub const MAX_CHUNK_CHARS: usize = 1200;

/// A format the compiler understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Text,
    Markdown,
    Html,
}

impl Format {
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Text => "text",
            Format::Markdown => "markdown",
            Format::Html => "html",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("unsupported format: {0}")]
    Unsupported(String),
    #[error("corrupt document: {0}")]
    Corrupt(String),
}

impl ParseError {
    /// The attempt's `last_error_code`.
    pub fn code(&self) -> &'static str {
        match self {
            ParseError::Unsupported(_) => "unsupported_format",
            ParseError::Corrupt(_) => "corrupt_document",
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
    match essence.as_str() {
        "text/plain" => return Ok(Format::Text),
        "text/markdown" | "text/x-markdown" => return Ok(Format::Markdown),
        "text/html" | "application/xhtml+xml" => return Ok(Format::Html),
        "" | "application/octet-stream" | "binary/octet-stream" => {}
        other => {
            return Err(ParseError::Unsupported(format!(
            "MIME type {other:?} of {filename:?} (supported: text/plain, text/markdown, text/html)"
        )))
        }
    }
    let ext = filename
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "txt" | "text" => Ok(Format::Text),
        "md" | "markdown" => Ok(Format::Markdown),
        "html" | "htm" | "xhtml" => Ok(Format::Html),
        _ => Err(ParseError::Unsupported(format!(
            "{filename:?} has no supported MIME type or extension (.txt, .md, .html)"
        ))),
    }
}

/// A run of blocks under one heading (or before the first heading).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Section {
    /// 0 before the first heading, else the heading level 1..=6.
    pub level: u8,
    /// The headings from the top down to this section's own.
    pub heading_path: Vec<String>,
    /// Paragraphs, list items, code blocks, table rows: the text of each block.
    pub blocks: Vec<String>,
}

/// A parsed document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parsed {
    pub format: Format,
    pub title: Option<String>,
    pub sections: Vec<Section>,
}

/// Decodes and parses `bytes` as `format`.
pub fn parse(format: Format, bytes: &[u8]) -> Result<Parsed, ParseError> {
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
        Format::Text => parse_text(&text),
        Format::Markdown => parse_markdown(&text),
        Format::Html => parse_html(&text),
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

    /// Adds a block; `raw` keeps its line breaks (code).
    fn block(&mut self, text: &str, raw: bool) {
        let text = if raw {
            text.trim_matches('\n').trim_end().to_owned()
        } else {
            collapse(text)
        };
        if text.trim().is_empty() {
            return;
        }
        if let Some(s) = self.sections.last_mut() {
            s.blocks.push(text);
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
            b.block(&para, false);
            para.clear();
        } else {
            para.push_str(line);
            para.push('\n');
        }
    }
    b.block(&para, false);
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
    for event in Parser::new_ext(text, options) {
        match event {
            Event::Start(Tag::Heading { level, .. }) => {
                b.block(&buf, in_code);
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
                b.block(&buf, false);
                buf.clear();
                in_code = true;
            }
            Event::End(TagEnd::CodeBlock) => {
                b.block(&buf, true);
                buf.clear();
                in_code = false;
            }
            Event::Start(
                Tag::Paragraph
                | Tag::Item
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
                | TagEnd::Item
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
                b.block(&buf, false);
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
    b.block(&buf, in_code);
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
    // Iterative traversal: nesting depth never grows the stack.
    for edge in doc.tree.root().traverse() {
        match edge {
            Edge::Open(node) => match node.value() {
                Node::Element(e) => {
                    let name = e.name();
                    if skip > 0 || HTML_SKIP.contains(&name) {
                        skip += 1;
                    } else if let Some(level) = html_heading(name) {
                        b.block(&buf, false);
                        buf.clear();
                        heading = Some((level, String::new()));
                    } else if name == "pre" {
                        b.block(&buf, false);
                        buf.clear();
                        pre += 1;
                    } else if HTML_BLOCKS.contains(&name) {
                        b.block(&buf, pre > 0);
                        buf.clear();
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
                        b.block(&buf, true);
                        buf.clear();
                        pre = pre.saturating_sub(1);
                    } else if HTML_BLOCKS.contains(&name) {
                        b.block(&buf, pre > 0);
                        buf.clear();
                    }
                }
            }
        }
    }
    b.block(&buf, false);
    b.finish(Format::Html, title)
}

/// One heading of the outline tree.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OutlineNode {
    pub level: u8,
    pub text: String,
    /// The index of this heading's section among the document's sections.
    pub section: usize,
    pub children: Vec<OutlineNode>,
}

/// The heading tree of a parsed document, as stored in `document_outlines.outline`.
pub fn outline(p: &Parsed) -> serde_json::Value {
    let mut roots: Vec<OutlineNode> = Vec::new();
    // Open headings, outermost first; each is attached to its parent when it closes.
    let mut open: Vec<OutlineNode> = Vec::new();
    fn close(open: &mut Vec<OutlineNode>, roots: &mut Vec<OutlineNode>) {
        if let Some(done) = open.pop() {
            match open.last_mut() {
                Some(parent) => parent.children.push(done),
                None => roots.push(done),
            }
        }
    }
    for (i, s) in p.sections.iter().enumerate() {
        if s.level == 0 {
            continue;
        }
        while open.last().is_some_and(|o| o.level >= s.level) {
            close(&mut open, &mut roots);
        }
        open.push(OutlineNode {
            level: s.level,
            text: s.heading_path.last().cloned().unwrap_or_default(),
            section: i,
            children: Vec::new(),
        });
    }
    while !open.is_empty() {
        close(&mut open, &mut roots);
    }
    serde_json::json!({
        "schema": 1,
        "format": p.format,
        "title": p.title,
        "sections": p.sections.len(),
        "headings": roots,
    })
}

/// A piece of a section, the content of one knowledge node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub heading_path: Vec<String>,
    pub content: String,
}

impl Chunk {
    /// Whitespace-separated words.
    pub fn token_count(&self) -> i32 {
        i32::try_from(self.content.split_whitespace().count()).unwrap_or(i32::MAX)
    }
}

/// Splits the document into chunks of at most `max_chars` characters, following sections and
/// then blocks; a block longer than `max_chars` is cut at a sentence end or a space. Chunks
/// without any letter or digit are dropped.
pub fn chunks(p: &Parsed, max_chars: usize) -> Vec<Chunk> {
    let max_chars = max_chars.max(16);
    let mut out = Vec::new();
    for s in &p.sections {
        let mut cur = String::new();
        let mut cur_len = 0usize;
        let mut emit = |text: &mut String, len: &mut usize| {
            if text.chars().any(char::is_alphanumeric) {
                out.push(Chunk {
                    heading_path: s.heading_path.clone(),
                    content: std::mem::take(text),
                });
            } else {
                text.clear();
            }
            *len = 0;
        };
        for block in &s.blocks {
            for piece in split_long(block, max_chars) {
                let n = piece.chars().count();
                if cur_len > 0 && cur_len + 2 + n > max_chars {
                    emit(&mut cur, &mut cur_len);
                }
                if cur_len > 0 {
                    cur.push_str("\n\n");
                    cur_len += 2;
                }
                cur.push_str(&piece);
                cur_len += n;
            }
        }
        if cur_len > 0 {
            emit(&mut cur, &mut cur_len);
        }
    }
    out
}

/// Cuts `text` into pieces of at most `max` characters, preferring sentence ends, then spaces,
/// in the second half of each window.
fn split_long(text: &str, max: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text.trim();
    while rest.chars().count() > max {
        // Byte offset just past the max-th character.
        let window_end = rest.char_indices().nth(max).map_or(rest.len(), |(i, _)| i);
        let window = &rest[..window_end];
        let half = window.char_indices().nth(max / 2).map_or(0, |(i, _)| i);
        let sentence = window[half..]
            .rmatch_indices(['.', '!', '?', '\n'])
            .map(|(i, m)| half + i + m.len())
            .find(|&end| window[end..].starts_with(char::is_whitespace) || end == window.len());
        let space = || {
            window[half..]
                .rfind(char::is_whitespace)
                .map(|i| half + i)
                .filter(|&i| i > 0)
        };
        let cut = sentence.or_else(space).unwrap_or(window_end);
        let (head, tail) = rest.split_at(cut);
        let head = head.trim();
        if !head.is_empty() {
            out.push(head.to_owned());
        }
        rest = tail.trim_start();
    }
    if !rest.is_empty() {
        out.push(rest.to_owned());
    }
    out
}

/// Common English words that make poor probes (Postgres drops most of them anyway).
const STOP: &[&str] = &[
    "about",
    "above",
    "after",
    "again",
    "against",
    "also",
    "because",
    "been",
    "before",
    "being",
    "below",
    "between",
    "both",
    "could",
    "does",
    "doing",
    "down",
    "during",
    "each",
    "from",
    "further",
    "have",
    "having",
    "here",
    "into",
    "itself",
    "just",
    "more",
    "most",
    "myself",
    "once",
    "only",
    "other",
    "ourselves",
    "over",
    "same",
    "should",
    "some",
    "such",
    "than",
    "that",
    "their",
    "theirs",
    "them",
    "themselves",
    "then",
    "there",
    "these",
    "they",
    "this",
    "those",
    "through",
    "under",
    "until",
    "very",
    "were",
    "what",
    "when",
    "where",
    "which",
    "while",
    "whom",
    "will",
    "with",
    "would",
    "your",
    "yours",
    "yourself",
    "yourselves",
];

/// How many words a smoke probe uses.
pub const PROBE_WORDS: usize = 4;

/// A few distinctive words of `content`, for a `plainto_tsquery` probe: the longest plain
/// alphabetic words (never parts of URLs, e-mail addresses, paths or hyphenated compounds,
/// which the full-text parser keeps whole), without common words. Empty when the content has
/// no such word.
pub fn probe_words(content: &str) -> String {
    let mut words: Vec<(usize, usize, String)> = Vec::new();
    for (pos, raw) in content.split_whitespace().enumerate() {
        let w = raw
            .trim_start_matches(['(', '[', '{', '"', '\'', '*', '_'])
            .trim_end_matches([
                '.', ',', ';', ':', '!', '?', ')', ']', '}', '"', '\'', '*', '_',
            ]);
        if w.chars().count() < 3 || !w.chars().all(char::is_alphabetic) {
            continue;
        }
        let lower = w.to_lowercase();
        if STOP.contains(&lower.as_str()) || words.iter().any(|(_, _, x)| *x == lower) {
            continue;
        }
        words.push((lower.chars().count(), pos, lower));
    }
    words.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    words.truncate(PROBE_WORDS);
    words.sort_by_key(|w| w.1);
    words
        .into_iter()
        .map(|(_, _, w)| w)
        .collect::<Vec<_>>()
        .join(" ")
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
        assert_eq!(
            detect("application/pdf", "a.pdf").unwrap_err().code(),
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
                    s.blocks.iter().map(String::as_str).collect(),
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
        let o = outline(&p);
        assert_eq!(o["headings"][0]["text"], "Guide");
        assert_eq!(o["headings"][0]["children"][0]["text"], "Install");
        assert_eq!(o["headings"][1]["text"], "Other");
        assert_eq!(o["format"], "markdown");
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
        assert_eq!(p.sections[0].blocks, vec!["Alpha beta"]);
        assert_eq!(p.sections[1].blocks, vec!["item one", "item two"]);
        assert_eq!(p.sections[2].blocks, vec!["a\n  b", "c1 c2"]);
        let all: String = p.sections.iter().flat_map(|s| s.blocks.clone()).collect();
        assert!(!all.contains("evil") && !all.contains("x{}"));
    }

    #[test]
    fn text_paragraphs_split_on_blank_lines() {
        let p = parse(Format::Text, b"one\r\ntwo\r\n\r\n\r\nthree\n").unwrap();
        assert_eq!(p.sections.len(), 1);
        assert_eq!(p.sections[0].blocks, vec!["one two", "three"]);
        assert_eq!(outline(&p)["headings"], serde_json::json!([]));
    }

    #[test]
    fn chunks_are_bounded_and_deterministic() {
        let sentence = "The quick brown fox jumps over the lazy dog. ";
        let long_para = sentence.repeat(80);
        let word_soup = "x".repeat(3000);
        let md = format!("# A\n\n{long_para}\n\nshort\n\n# B\n\n{word_soup}\n\n# C\n\n---\n\n");
        let p = parse(Format::Markdown, md.as_bytes()).unwrap();
        let c = chunks(&p, MAX_CHUNK_CHARS);
        assert!(c
            .iter()
            .all(|c| c.content.chars().count() <= MAX_CHUNK_CHARS));
        assert!(c.iter().all(|c| !c.content.trim().is_empty()));
        let a: Vec<&Chunk> = c.iter().filter(|c| c.heading_path == ["A"]).collect();
        assert!(a.len() >= 3, "{}", a.len());
        assert!(a
            .iter()
            .all(|c| c.content.ends_with('.') || c.content.ends_with("short")));
        let joined: String = a
            .iter()
            .map(|c| c.content.replace("\n\n", " "))
            .collect::<Vec<_>>()
            .join(" ");
        assert_eq!(collapse(&joined), collapse(&format!("{long_para} short")));
        let b: Vec<&Chunk> = c.iter().filter(|c| c.heading_path == ["B"]).collect();
        assert_eq!(b.iter().map(|c| c.content.len()).sum::<usize>(), 3000);
        assert!(c.iter().all(|c| c.heading_path != ["C"]));
        assert_eq!(
            c,
            chunks(
                &parse(Format::Markdown, md.as_bytes()).unwrap(),
                MAX_CHUNK_CHARS
            )
        );
        // Multi-byte characters are counted as characters and never cut in half.
        let wide = "ü".repeat(5000);
        let p = parse(Format::Text, wide.as_bytes()).unwrap();
        let c = chunks(&p, 100);
        assert_eq!(c.len(), 50);
        assert!(c.iter().all(|c| c.content.chars().count() == 100));
    }

    #[test]
    fn probe_words_pick_long_plain_words() {
        assert_eq!(
            probe_words("The configuration of kubernetes clusters (see https://x.io/a) requires patience, it's said."),
            "configuration kubernetes clusters requires"
        );
        assert_eq!(probe_words("a b c -- 12 34"), "");
        assert_eq!(probe_words("mail me@example.com e-mail"), "mail");
        assert_eq!(probe_words("Über straße"), "über straße");
    }
}
