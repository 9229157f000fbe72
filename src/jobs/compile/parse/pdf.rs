//! The local PDF parser: the text of a PDF's pages as Unstructured-style elements (`Title`,
//! `NarrativeText`, `ListItem`), each with its 1-based page number, rebuilt from where and how
//! large each character is drawn. Invariant: a pure function of the bytes (the same bytes always
//! give the same elements, in page and drawing order), and no input panics: garbage, a
//! truncated file or an unreadable font is [`ParseError::Corrupt`], a PDF that needs a password
//! is [`ParseError::Encrypted`], pages without any text (scans) are [`ParseError::Empty`].
//!
//! How the layout is read back:
//! - characters come from `pdf-extract` (on `lopdf`) through [`OutputDev`] with their baseline
//!   position and rendered font size; characters on one baseline, moving right, make a line,
//!   and a horizontal gap wider than a fifth of the font size is a space;
//! - consecutive lines make one block while the font size stays the same and the baseline step
//!   is no more than the document's usual line pitch for that size (a wider step is a paragraph
//!   break), and a line that opens with a bullet or an enumerator starts a new block;
//! - the most common font size (weighted by characters) is the body text; short blocks set
//!   clearly larger (at least 12% above the body) are headings, the largest size at depth 0,
//!   the next at depth 1, and so on; a bold heading at body size is not recognised;
//! - a block opening with a bullet glyph (•, ◦, ▪, -, *, ...) is a `ListItem` without its glyph;
//!   one opening with an enumerator ("1.", "2)", "a)", "(iv)") is a `ListItem` keeping it;
//! - running headers and footers are dropped: single short lines, no larger than body text, in
//!   the top or bottom 12% of a page that are a page number ("7", "Page 7", "7 of 20", "xiv")
//!   or recur, digits aside, in that band on two or more pages;
//! - tables are not detected: their cells come out as text lines.
//!
//! A PDF encrypted with an owner password only (printing or copying restrictions) opens with
//! the empty user password and is read like any other.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use lopdf::Document;
use pdf_extract::{MediaBox, OutputDev, OutputError, Transform};

use super::raw::RawElement;
use super::ParseError;

/// Parses a PDF's text into raw elements.
pub fn parse_pdf(bytes: &[u8]) -> Result<Vec<RawElement>, ParseError> {
    if bytes.is_empty() {
        return Err(ParseError::Corrupt("the PDF is an empty file".into()));
    }
    let doc = load(bytes)?;
    let mut collector = Collector::default();
    let run = catch_unwind(AssertUnwindSafe(|| {
        pdf_extract::output_doc(&doc, &mut collector)
    }));
    match run {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            return Err(ParseError::Corrupt(format!(
                "the PDF could not be read: {}{}",
                one_line(&e.to_string()),
                collector.at_page()
            )))
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "an internal error".to_owned());
            return Err(ParseError::Corrupt(format!(
                "the PDF could not be read: {}{}",
                one_line(&what),
                collector.at_page()
            )));
        }
    }
    let elements = layout(&collector.pages);
    if elements.is_empty() {
        return Err(ParseError::Empty(
            "the PDF has no extractable text; scanned pages need OCR, which the local parser does not do"
                .into(),
        ));
    }
    Ok(elements)
}

/// The most pages a PDF may have, as the platform's preflight allows.
pub const MAX_PAGES: usize = 10_000;

/// The platform's PDF preflight before a remote parse: the file opens without a password and
/// has at most [`MAX_PAGES`] pages. Returns its page count.
pub fn preflight(bytes: &[u8]) -> Result<usize, ParseError> {
    if bytes.is_empty() {
        return Err(ParseError::Corrupt("the PDF is an empty file".into()));
    }
    let pages = load(bytes)?.get_pages().len();
    if pages > MAX_PAGES {
        return Err(ParseError::Corrupt(format!(
            "the PDF has {pages} pages, more than the {MAX_PAGES} a document may have"
        )));
    }
    Ok(pages)
}

/// Loads the document, telling a password-protected one from a broken one.
fn load(bytes: &[u8]) -> Result<Document, ParseError> {
    let encrypted = || {
        ParseError::Encrypted(
            "the PDF is password-protected; it cannot be read without its password".into(),
        )
    };
    let doc = catch_unwind(|| Document::load_mem(bytes));
    let doc = match doc {
        Ok(Ok(doc)) => doc,
        Ok(Err(e)) => {
            // An encryption dictionary lopdf cannot use still means a password-protected file.
            if matches!(
                e,
                lopdf::Error::Decryption(_) | lopdf::Error::InvalidPassword
            ) {
                return Err(encrypted());
            }
            return Err(ParseError::Corrupt(format!(
                "the PDF could not be loaded: {}",
                one_line(&e.to_string())
            )));
        }
        Err(_) => {
            return Err(ParseError::Corrupt(
                "the PDF could not be loaded: its structure is malformed".into(),
            ))
        }
    };
    // lopdf decrypts with the empty user password when that works (owner-password-only files)
    // and removes `/Encrypt` from the trailer; it stays there when a user password is needed.
    if doc.trailer.get(b"Encrypt").is_ok() {
        return Err(encrypted());
    }
    if doc.get_pages().is_empty() {
        return Err(ParseError::Corrupt("the PDF has no pages".into()));
    }
    Ok(doc)
}

/// The first line of a message, bounded, so one error stays one line.
fn one_line(s: &str) -> String {
    let line = s.lines().next().unwrap_or("").trim();
    let mut out: String = line.chars().take(200).collect();
    if out.is_empty() {
        out.push_str("unknown cause");
    }
    out
}

/// One character as drawn: baseline position (y grows downwards), font size, advance.
#[derive(Clone, Debug)]
struct Glyph {
    x: f64,
    y: f64,
    size: f64,
    advance: f64,
    text: String,
}

/// A line of text on one baseline.
#[derive(Clone, Debug)]
struct Line {
    x0: f64,
    x1: f64,
    y: f64,
    /// The size most of its characters are set in.
    size: f64,
    text: String,
    /// Characters by size class, to find the body size.
    sizes: BTreeMap<i64, usize>,
}

#[derive(Debug, Default)]
struct Page {
    number: u32,
    height: f64,
    top: f64,
    lines: Vec<Line>,
}

/// Receives pdf-extract's characters page by page.
#[derive(Default)]
struct Collector {
    pages: Vec<Page>,
    glyphs: Vec<Glyph>,
    current: Option<(u32, MediaBox)>,
}

impl Collector {
    /// " (on page N)" while a page is open.
    fn at_page(&self) -> String {
        self.current
            .map(|(n, _)| format!(" (on page {n})"))
            .unwrap_or_default()
    }
}

impl OutputDev for Collector {
    fn begin_page(
        &mut self,
        page_num: u32,
        media_box: &MediaBox,
        _art_box: Option<(f64, f64, f64, f64)>,
    ) -> Result<(), OutputError> {
        self.current = Some((page_num, *media_box));
        self.glyphs.clear();
        Ok(())
    }

    fn end_page(&mut self) -> Result<(), OutputError> {
        if let Some((number, mb)) = self.current.take() {
            let height = (mb.ury - mb.lly).abs();
            let lines = build_lines(std::mem::take(&mut self.glyphs));
            self.pages.push(Page {
                number,
                height: if height.is_finite() { height } else { 0.0 },
                top: if mb.ury.is_finite() { mb.ury } else { 0.0 },
                lines,
            });
        }
        Ok(())
    }

    fn output_character(
        &mut self,
        trm: &Transform,
        width: f64,
        _spacing: f64,
        font_size: f64,
        char: &str,
    ) -> Result<(), OutputError> {
        // Rendered size: the font size scaled by the text-rendering matrix.
        let scale = (trm.m11 * trm.m22 - trm.m12 * trm.m21).abs().sqrt();
        let size = (font_size * scale).abs();
        let (x, y) = (trm.m31, -trm.m32);
        let advance = width * size;
        if ![size, x, y, advance].iter().all(|v| v.is_finite()) || size < 0.5 {
            return Ok(());
        }
        let text: String = char
            .chars()
            .filter(|c| !c.is_control() || c.is_whitespace())
            .collect();
        if text.is_empty() {
            return Ok(());
        }
        self.glyphs.push(Glyph {
            x,
            y,
            size,
            advance: advance.max(0.0),
            text,
        });
        Ok(())
    }

    fn begin_word(&mut self) -> Result<(), OutputError> {
        Ok(())
    }

    fn end_word(&mut self) -> Result<(), OutputError> {
        Ok(())
    }

    fn end_line(&mut self) -> Result<(), OutputError> {
        Ok(())
    }
}

/// A font size in half points, the unit sizes are compared in.
fn size_class(size: f64) -> i64 {
    (size * 2.0).round() as i64
}

fn new_line(g: &Glyph) -> Line {
    Line {
        x0: g.x,
        x1: g.x,
        y: g.y,
        size: g.size,
        text: String::new(),
        sizes: BTreeMap::new(),
    }
}

fn push_glyph(line: &mut Line, g: &Glyph) {
    let visible = g.text.chars().filter(|c| !c.is_whitespace()).count();
    if !line.text.is_empty() && g.x - line.x1 > 0.2 * g.size.max(line.size) {
        line.text.push(' ');
    }
    line.text.push_str(&g.text);
    line.x1 = line.x1.max(g.x + g.advance);
    line.x0 = line.x0.min(g.x);
    if visible > 0 {
        *line.sizes.entry(size_class(g.size)).or_default() += visible;
    }
}

/// Sets a line's size to the size most of its characters have.
fn settle(mut line: Line) -> Line {
    if let Some((class, _)) = line
        .sizes
        .iter()
        .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
    {
        line.size = *class as f64 / 2.0;
    }
    line.text = collapse(&line.text);
    line
}

/// Groups glyphs, in drawing order, into lines; fragments drawn separately on one baseline
/// (a bullet and its text) are joined left to right.
fn build_lines(glyphs: Vec<Glyph>) -> Vec<Line> {
    let mut lines: Vec<Line> = Vec::new();
    let mut cur: Option<Line> = None;
    for g in &glyphs {
        let same = cur.as_ref().is_some_and(|l| {
            let tol = 0.35 * l.size.max(g.size);
            (g.y - l.y).abs() <= tol && g.x >= l.x1 - 0.5 * g.size.max(l.size)
        });
        if !same {
            if let Some(l) = cur.take() {
                lines.push(l);
            }
            cur = Some(new_line(g));
        }
        if let Some(l) = cur.as_mut() {
            if l.text.is_empty() {
                l.size = g.size;
            }
            push_glyph(l, g);
        }
    }
    if let Some(l) = cur.take() {
        lines.push(l);
    }
    // Join consecutive fragments on one baseline, in x order.
    let mut merged: Vec<Line> = Vec::new();
    for l in lines {
        let l = settle(l);
        if l.text.is_empty() {
            continue;
        }
        if let Some(prev) = merged.last_mut() {
            let tol = 0.35 * prev.size.max(l.size);
            if (prev.y - l.y).abs() <= tol {
                let (left, right) = if l.x0 < prev.x0 {
                    (l.clone(), prev.clone())
                } else {
                    (prev.clone(), l.clone())
                };
                let mut sizes = left.sizes.clone();
                for (k, v) in &right.sizes {
                    *sizes.entry(*k).or_default() += v;
                }
                *prev = settle(Line {
                    x0: left.x0.min(right.x0),
                    x1: left.x1.max(right.x1),
                    y: prev.y,
                    size: prev.size,
                    text: format!("{} {}", left.text, right.text),
                    sizes,
                });
                continue;
            }
        }
        merged.push(l);
    }
    merged
}

/// Collapses runs of whitespace to one space and trims.
fn collapse(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Bullet glyphs that open a list item (stripped from its text). `-`, `*`, `–` need a space
/// after them; `\u{f0b7}` is the Symbol-font bullet Word writes into PDFs.
const BULLETS: &[char] = &[
    '•', '◦', '▪', '▫', '‣', '⁃', '●', '○', '■', '□', '►', '▸', '▹', '➢', '✓', '✔', '·',
    '\u{f0b7}', '\u{f0a7}', '\u{f076}', '\u{f0d8}',
];
const DASHES: &[char] = &['-', '*', '–', '—'];

/// The text of a list item without its bullet, when `text` opens with one.
fn strip_bullet(text: &str) -> Option<String> {
    let mut chars = text.chars();
    let first = chars.next()?;
    let rest = chars.as_str();
    if BULLETS.contains(&first) || (DASHES.contains(&first) && rest.starts_with(' ')) {
        let rest = rest.trim_start();
        return (!rest.is_empty()).then(|| rest.to_owned());
    }
    None
}

/// Whether `text` opens with an enumerator: `1.`, `12)`, `(3)`, `a.`, `b)`, `(c)`, `iv.`,
/// `(ii)`, followed by a space and more text.
fn is_enumerated(text: &str) -> bool {
    let Some((head, rest)) = text.split_once(' ') else {
        return false;
    };
    if rest.trim().is_empty() {
        return false;
    }
    let inner = if let Some(s) = head.strip_prefix('(') {
        match s.strip_suffix(')') {
            Some(s) => s,
            None => return false,
        }
    } else if let Some(s) = head.strip_suffix('.').or_else(|| head.strip_suffix(')')) {
        s
    } else {
        return false;
    };
    let digits = !inner.is_empty()
        && inner.len() <= 3
        && !inner.starts_with('0')
        && inner.chars().all(|c| c.is_ascii_digit());
    let letter = inner.len() == 1 && inner.chars().all(|c| c.is_ascii_lowercase());
    let roman = !inner.is_empty()
        && inner.len() <= 5
        && inner.chars().all(|c| matches!(c, 'i' | 'v' | 'x'));
    digits || letter || roman
}

fn opens_item(text: &str) -> bool {
    strip_bullet(text).is_some() || is_enumerated(text)
}

/// A run of lines read as one paragraph, heading or list item.
struct Block<'a> {
    page: &'a Page,
    lines: Vec<&'a Line>,
}

impl Block<'_> {
    fn size(&self) -> f64 {
        self.lines.first().map(|l| l.size).unwrap_or(0.0)
    }

    fn text(&self) -> String {
        let mut out = String::new();
        for l in &self.lines {
            // A word broken over lines with a hyphen is joined without a space.
            let hyphen_break = out.ends_with('-')
                && out.chars().rev().nth(1).is_some_and(|c| c.is_alphabetic())
                && l.text.chars().next().is_some_and(|c| c.is_lowercase());
            if !out.is_empty() && !hyphen_break {
                out.push(' ');
            }
            out.push_str(&l.text);
        }
        collapse(&out)
    }
}

/// The usual baseline step between lines of one paragraph, per size class: the most common
/// step between consecutive lines of that size (ties to the smaller step).
fn line_pitches(pages: &[Page]) -> BTreeMap<i64, f64> {
    let mut steps: BTreeMap<i64, BTreeMap<i64, usize>> = BTreeMap::new();
    for p in pages {
        for w in p.lines.windows(2) {
            let [a, b] = w else { continue };
            let dy = b.y - a.y;
            if size_class(a.size) == size_class(b.size) && dy > 0.0 && dy < 3.0 * a.size {
                *steps
                    .entry(size_class(a.size))
                    .or_default()
                    .entry((dy * 2.0).round() as i64)
                    .or_default() += 1;
            }
        }
    }
    steps
        .into_iter()
        .filter_map(|(class, counts)| {
            counts
                .into_iter()
                .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
                .map(|(step, _)| (class, step as f64 / 2.0))
        })
        .collect()
}

fn blocks(pages: &[Page]) -> Vec<Block<'_>> {
    let pitches = line_pitches(pages);
    let mut out: Vec<Block<'_>> = Vec::new();
    for page in pages {
        let mut cur: Option<Block<'_>> = None;
        for line in &page.lines {
            let joins = cur.as_ref().is_some_and(|b| {
                let Some(prev) = b.lines.last() else {
                    return false;
                };
                if size_class(prev.size) != size_class(line.size) {
                    return false;
                }
                let pitch = pitches
                    .get(&size_class(line.size))
                    .copied()
                    .unwrap_or(1.25 * line.size)
                    .max(line.size);
                let dy = line.y - prev.y;
                dy > 0.0 && dy <= pitch * 1.2 + 0.5 && !opens_item(&line.text)
            });
            if joins {
                if let Some(b) = cur.as_mut() {
                    b.lines.push(line);
                }
            } else {
                if let Some(b) = cur.take() {
                    out.push(b);
                }
                cur = Some(Block {
                    page,
                    lines: vec![line],
                });
            }
        }
        if let Some(b) = cur.take() {
            out.push(b);
        }
    }
    out
}

/// The key of a block that may be a running header or footer: one short line, no larger than
/// body text, in the top or bottom 12% of its page; digits are masked so "Page 3" and "Page 4"
/// share a key.
fn margin_key(b: &Block<'_>, body: f64) -> Option<String> {
    let [line] = b.lines.as_slice() else {
        return None;
    };
    let h = b.page.height;
    if h <= 0.0 || line.size > body * 1.05 || line.text.chars().count() > 100 {
        return None;
    }
    // Baseline distance from the top edge (`y` is the negated PDF y).
    let from_top = b.page.top + line.y;
    if from_top >= 0.12 * h && from_top <= 0.88 * h {
        return None;
    }
    let mut key = String::new();
    for c in line.text.chars() {
        if c.is_ascii_digit() {
            if !key.ends_with('#') {
                key.push('#');
            }
        } else {
            key.extend(c.to_lowercase());
        }
    }
    Some(key)
}

/// Whether a line is only a page number: `7`, `- 7 -`, `Page 7`, `7 of 20`, `7/20`, `xiv`.
fn is_page_number(text: &str) -> bool {
    let t = text.to_lowercase();
    let t = t.trim_matches(|c: char| c.is_whitespace() || matches!(c, '-' | '–' | '—' | '|'));
    let t = t.strip_prefix("page").unwrap_or(t).trim();
    let digits = |s: &str| !s.is_empty() && s.len() <= 5 && s.chars().all(|c| c.is_ascii_digit());
    let roman = |s: &str| {
        !s.is_empty() && s.len() <= 6 && s.chars().all(|c| matches!(c, 'i' | 'v' | 'x' | 'l' | 'c'))
    };
    if digits(t) || roman(t) {
        return true;
    }
    for sep in [" of ", "/"] {
        if let Some((a, b)) = t.split_once(sep) {
            return digits(a.trim()) && digits(b.trim());
        }
    }
    false
}

/// Turns the pages' lines into elements.
fn layout(pages: &[Page]) -> Vec<RawElement> {
    // Body size: the size class that most characters are set in (ties to the smaller).
    let mut chars_by_size: BTreeMap<i64, usize> = BTreeMap::new();
    for p in pages {
        for l in &p.lines {
            for (k, v) in &l.sizes {
                *chars_by_size.entry(*k).or_default() += v;
            }
        }
    }
    let Some(body_class) = chars_by_size
        .iter()
        .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
        .map(|(k, _)| *k)
    else {
        return Vec::new();
    };
    let body = body_class as f64 / 2.0;
    let blocks = blocks(pages);
    let is_heading = |b: &Block<'_>| {
        b.size() >= body * 1.12 && b.lines.len() <= 3 && b.text().chars().count() <= 200
    };
    // Heading sizes, largest first: their index is the depth.
    let mut heading_classes: Vec<i64> = blocks
        .iter()
        .filter(|b| is_heading(b))
        .map(|b| size_class(b.size()))
        .collect();
    heading_classes.sort_unstable_by(|a, b| b.cmp(a));
    heading_classes.dedup();
    // Running headers and footers: margin lines that are page numbers or recur on two or
    // more pages.
    let keys: Vec<Option<String>> = blocks.iter().map(|b| margin_key(b, body)).collect();
    let mut recurring: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for (b, key) in blocks.iter().zip(&keys) {
        if let Some(k) = key {
            let pages = recurring.entry(k.as_str()).or_default();
            if !pages.contains(&b.page.number) {
                pages.push(b.page.number);
            }
        }
    }
    let mut out = Vec::new();
    for (b, key) in blocks.iter().zip(&keys) {
        let text = b.text();
        let margin = key.as_deref().is_some_and(|k| {
            is_page_number(&text) || recurring.get(k).is_some_and(|p| p.len() >= 2)
        });
        if text.is_empty() || margin {
            continue;
        }
        let page = i32::try_from(b.page.number).ok();
        if is_heading(b) {
            let depth = heading_classes
                .iter()
                .position(|c| *c == size_class(b.size()))
                .unwrap_or(0);
            out.push(RawElement::title(
                text,
                i32::try_from(depth).unwrap_or(0),
                page,
            ));
        } else if let Some(item) = strip_bullet(&text) {
            out.push(RawElement::new("ListItem", item, page));
        } else if is_enumerated(&text) {
            out.push(RawElement::new("ListItem", text, page));
        } else {
            out.push(RawElement::new("NarrativeText", text, page));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::test_support::{dump, fixture};

    #[test]
    fn handbook_headings_lists_and_pages() {
        let els = parse_pdf(&fixture("handbook.pdf")).unwrap();
        let all = dump(&els);
        let titles: Vec<(&str, Option<i32>, Option<i32>)> = els
            .iter()
            .filter(|e| e.kind == "Title")
            .map(|e| {
                (
                    e.text.as_str(),
                    e.metadata.category_depth,
                    e.metadata.page_number,
                )
            })
            .collect();
        assert_eq!(
            titles,
            vec![
                ("The Field Handbook of Curious Things", Some(0), Some(1)),
                ("Turning Things in Space", Some(1), Some(2)),
                ("Baking at Home", Some(1), Some(3)),
                ("Feeding Schedule", Some(2), Some(3)),
            ],
            "{all}"
        );
        let items: Vec<&str> = els
            .iter()
            .filter(|e| e.kind == "ListItem")
            .map(|e| e.text.as_str())
            .collect();
        assert_eq!(
            items,
            vec![
                "A thermos of hot tea and a warm hat",
                "A tripod and a camera with a wide lens",
                "A red torch that keeps your eyes used to the dark",
            ],
            "{all}"
        );
        for (term, page) in [
            ("aurora borealis", 1),
            ("quaternion rotation", 2),
            ("sourdough starter", 3),
        ] {
            let hits: Vec<&RawElement> = els.iter().filter(|e| e.text.contains(term)).collect();
            assert_eq!(hits.len(), 1, "{term}: {all}");
            assert_eq!(hits[0].kind, "NarrativeText", "{all}");
            assert_eq!(hits[0].metadata.page_number, Some(page), "{all}");
        }
        // Paragraphs come out whole: the first one's wrapped lines are one element.
        assert!(
            els.iter().any(|e| e.kind == "NarrativeText"
                && e.text.starts_with("This handbook gathers notes")
                && e.text.ends_with("away from towns.")),
            "{all}"
        );
        // The "Page N" footers are dropped; every element has a page.
        assert!(!all.contains("Page 1"), "{all}");
        assert!(els
            .iter()
            .all(|e| matches!(e.metadata.page_number, Some(1..=3))));
    }

    #[test]
    fn encrypted_corrupt_and_scanned_are_told_apart() {
        let err = parse_pdf(&fixture("handbook-encrypted.pdf")).unwrap_err();
        assert!(matches!(err, ParseError::Encrypted(_)), "{err:?}");
        let err = parse_pdf(&fixture("handbook-corrupt.pdf")).unwrap_err();
        assert!(matches!(err, ParseError::Corrupt(_)), "{err:?}");
        let err = parse_pdf(&fixture("scanned.pdf")).unwrap_err();
        assert!(matches!(err, ParseError::Empty(_)), "{err:?}");
    }

    #[test]
    fn garbage_is_corrupt_never_a_panic() {
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut random = vec![0u8; 4096];
        for b in random.iter_mut() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            *b = (state >> 24) as u8;
        }
        let handbook = fixture("handbook.pdf");
        let mut inputs: Vec<Vec<u8>> = vec![
            Vec::new(),
            random.clone(),
            b"%PDF-1.7\n".to_vec(),
            [b"%PDF-1.4\n".as_slice(), &random].concat(),
        ];
        // Truncations and a flipped byte in the middle of a real file.
        for cut in [10, 200, 1000, handbook.len() / 2, handbook.len() - 10] {
            inputs.push(handbook[..cut.min(handbook.len())].to_vec());
        }
        let mut flipped = handbook.clone();
        let mid = flipped.len() / 2;
        flipped[mid] ^= 0xff;
        inputs.push(flipped);
        for input in &inputs {
            match parse_pdf(input) {
                Ok(_) => {}
                Err(ParseError::Corrupt(msg)) | Err(ParseError::Empty(msg)) => {
                    assert!(!msg.contains('\n'), "{msg}")
                }
                Err(e) => panic!("unexpected {e:?}"),
            }
        }
        for input in [&[][..], &random] {
            assert!(matches!(parse_pdf(input), Err(ParseError::Corrupt(_))));
        }
    }

    #[test]
    fn parsing_is_deterministic() {
        let bytes = fixture("handbook.pdf");
        assert_eq!(parse_pdf(&bytes).unwrap(), parse_pdf(&bytes).unwrap());
    }

    #[test]
    fn corpus_parses_with_a_heading_per_page() {
        let dir = format!(
            "{}/tests/fixtures/documents/corpus",
            env!("CARGO_MANIFEST_DIR")
        );
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "pdf"))
            .collect();
        names.sort();
        assert_eq!(names.len(), 12);
        let mut pages = 0;
        let started = std::time::Instant::now();
        for path in &names {
            let els = parse_pdf(&std::fs::read(path).unwrap()).unwrap();
            let last = els
                .iter()
                .filter_map(|e| e.metadata.page_number)
                .max()
                .unwrap();
            // Every page opens with its numbered heading, one level under the document title.
            for page in 1..=last {
                assert!(
                    els.iter().any(|e| e.kind == "Title"
                        && e.metadata.page_number == Some(page)
                        && e.metadata.category_depth == Some(1)
                        && e.text.starts_with(&format!("{page}. "))),
                    "{path:?} page {page}: {}",
                    dump(&els)
                );
            }
            pages += last;
        }
        assert_eq!(pages, 200);
        eprintln!("corpus: 200 pages in {:?}", started.elapsed());
    }

    #[test]
    fn enumerators_and_bullets() {
        for t in ["1. First", "12) x", "(3) y", "a) z", "(iv) w", "ii. v"] {
            assert!(is_enumerated(t), "{t}");
        }
        for t in [
            "2024. A year",
            "A. Smith",
            "e.g. this",
            "1.",
            "word. next",
            "0. zero",
        ] {
            assert!(!is_enumerated(t), "{t}");
        }
        assert_eq!(strip_bullet("• item").as_deref(), Some("item"));
        assert_eq!(strip_bullet("- item").as_deref(), Some("item"));
        assert_eq!(strip_bullet("-5 degrees"), None);
        assert_eq!(strip_bullet("•"), None);
        for t in ["7", "- 7 -", "Page 12", "3 of 20", "3/20", "xiv", "| 4 |"] {
            assert!(is_page_number(t), "{t}");
        }
        for t in ["Chapter 4", "7 apples", "Summary", "2024-01-01"] {
            assert!(!is_page_number(t), "{t}");
        }
    }
}
