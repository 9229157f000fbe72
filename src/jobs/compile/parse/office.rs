//! The local parsers of Office Open XML documents: Word (`.docx`) and PowerPoint (`.pptx`)
//! into Unstructured-style elements (`Title`, `NarrativeText`, `ListItem`, `Table`), read
//! straight from the zip package's XML parts. Invariant: a pure function of the bytes (the same
//! bytes always give the same elements, in document order) and no input panics: a file that is
//! not a zip, lacks its main part, holds malformed XML or exceeds the zip-bomb limits
//! ([`MAX_ENTRIES`], [`MAX_UNPACKED`]) is [`ParseError::Corrupt`]; a password-protected file
//! (an OLE compound file, which is how Office stores encrypted `.docx`/`.pptx`) is
//! [`ParseError::Encrypted`]; a legacy binary `.doc`/`.ppt` is [`ParseError::Unsupported`];
//! one without any text is [`ParseError::Empty`].
//!
//! Word: the paragraphs (`w:p`) of the main part, in order, including those in text boxes and
//! content controls (headers, footers, footnotes and comments are other parts and are left
//! out; deleted revisions are skipped, inserted ones kept). A paragraph is a `Title` when its
//! style is a heading: the style's name (`w:name`, always English, so a German `berschrift1` id
//! still resolves through `word/styles.xml`) is `Title` (depth 0) or `heading N` (depth N-1), or
//! the style or paragraph has an outline level N (depth N), following `w:basedOn`. It is a
//! `ListItem` (depth = its `w:ilvl`) when it has numbering (`w:numPr`, on itself or its style)
//! or a list style (`List Bullet`, `List Number`, `List Paragraph`, trailing digit = depth + 1).
//! A table (`w:tbl`) is one `Table` of its rows, a cell's text its paragraphs joined by a space
//! (a nested table's text goes into the cell that holds it). Pages: Word records where it last
//! broke pages (`w:lastRenderedPageBreak`); when a file has those marks, an element's page is
//! one more than the marks before its first text, else pages are unknown (`None`), since
//! without a renderer they cannot be known.
//!
//! PowerPoint: slides in presentation order (`p:sldIdLst` through the presentation's
//! relationships; the numeric order of `ppt/slides/slideN.xml` when that list is unusable),
//! `page_number` = the slide's 1-based position. On a slide, the title placeholder (`title`,
//! `ctrTitle`) is a depth-0 `Title` and comes first; date, footer and slide-number placeholders
//! are dropped; tables (`a:tbl`) are `Table`s; other paragraphs (`a:p`) are `ListItem`s (depth =
//! `lvl`) when they have an explicit bullet (`a:buChar`, `a:buAutoNum`) or sit in a body
//! placeholder (`type="body"`/`"obj"` or an `idx` without a type, which bullet by default) that
//! holds more than one paragraph or indents them (`lvl` > 0), and `NarrativeText` otherwise (or
//! with `a:buNone`). Speaker notes are not read.

use std::collections::{BTreeMap, HashMap};
use std::io::{Cursor, Read};

use quick_xml::events::{BytesStart, Event};
use quick_xml::Reader;

use super::raw::RawElement;
use super::ParseError;

/// Most zip entries a package may have.
pub const MAX_ENTRIES: usize = 4096;
/// Most bytes a package's entries may unpack to, all together (64 MiB).
pub const MAX_UNPACKED: u64 = 64 * 1024 * 1024;

/// The signature of an OLE compound file (legacy Office files, and encrypted OOXML).
const OLE_MAGIC: [u8; 8] = [0xD0, 0xCF, 0x11, 0xE0, 0xA1, 0xB1, 0x1A, 0xE1];

/// Parses a Word `.docx` into raw elements.
pub fn parse_docx(bytes: &[u8]) -> Result<Vec<RawElement>, ParseError> {
    let mut pkg = Package::open(bytes, Kind::Docx)?;
    let main = pkg.main_part("word/document.xml")?;
    let xml = pkg.read(&main)?.ok_or_else(|| {
        ParseError::Corrupt(format!(
            "the .docx has no main document part ({main}); it is not a Word document"
        ))
    })?;
    let styles_path = pkg
        .rels(&main)?
        .into_iter()
        .find(|r| r.kind.ends_with("/styles"))
        .map(|r| r.target)
        .unwrap_or_else(|| sibling(&main, "styles.xml"));
    let styles = match pkg.read(&styles_path)? {
        Some(s) => Styles::parse(&s)?,
        None => Styles::default(),
    };
    let elements = docx_body(&xml, &styles)?;
    if elements.is_empty() {
        return Err(ParseError::Empty("the .docx has no text".into()));
    }
    Ok(elements)
}

/// Parses a PowerPoint `.pptx` into raw elements.
pub fn parse_pptx(bytes: &[u8]) -> Result<Vec<RawElement>, ParseError> {
    let mut pkg = Package::open(bytes, Kind::Pptx)?;
    let main = pkg.main_part("ppt/presentation.xml")?;
    let presentation = pkg.read(&main)?.ok_or_else(|| {
        ParseError::Corrupt(format!(
            "the .pptx has no main presentation part ({main}); it is not a PowerPoint file"
        ))
    })?;
    let slides = slide_order(&mut pkg, &main, &presentation)?;
    let mut elements = Vec::new();
    for (i, path) in slides.iter().enumerate() {
        let Some(xml) = pkg.read(path)? else {
            continue;
        };
        let number = i32::try_from(i + 1).ok();
        elements.extend(pptx_slide(&xml, number)?);
    }
    if elements.is_empty() {
        return Err(ParseError::Empty(
            "the .pptx has no text on its slides".into(),
        ));
    }
    Ok(elements)
}

// -- the zip package ---------------------------------------------------------------------------

#[derive(Clone, Copy)]
enum Kind {
    Docx,
    Pptx,
}

impl Kind {
    fn ext(self) -> &'static str {
        match self {
            Kind::Docx => ".docx",
            Kind::Pptx => ".pptx",
        }
    }

    /// The OLE stream that names a legacy binary file of this kind.
    fn legacy_stream(self) -> &'static str {
        match self {
            Kind::Docx => "WordDocument",
            Kind::Pptx => "PowerPoint Document",
        }
    }
}

/// A relationship of a part: its type URI and its target's path in the zip.
struct Rel {
    id: String,
    kind: String,
    target: String,
}

struct Package<'a> {
    zip: zip::ZipArchive<Cursor<&'a [u8]>>,
    kind: Kind,
    /// Bytes still allowed to unpack.
    budget: u64,
}

/// Whether `haystack` holds `name` as UTF-16LE (how OLE directory entries are named).
fn has_utf16(haystack: &[u8], name: &str) -> bool {
    let needle: Vec<u8> = name.encode_utf16().flat_map(|u| u.to_le_bytes()).collect();
    !needle.is_empty()
        && haystack
            .windows(needle.len())
            .any(|w| w == needle.as_slice())
}

impl<'a> Package<'a> {
    fn open(bytes: &'a [u8], kind: Kind) -> Result<Self, ParseError> {
        let ext = kind.ext();
        if bytes.starts_with(&OLE_MAGIC) {
            if !has_utf16(bytes, "EncryptedPackage") && has_utf16(bytes, kind.legacy_stream()) {
                return Err(ParseError::Unsupported(format!(
                    "a legacy binary Office file (OLE), not a {ext}; save it as {ext} to parse it"
                )));
            }
            return Err(ParseError::Encrypted(format!(
                "the {ext} is password-protected (Office stores encrypted files as OLE compound files); \
                 it cannot be read without its password"
            )));
        }
        let mut zip = zip::ZipArchive::new(Cursor::new(bytes)).map_err(|e| {
            ParseError::Corrupt(format!(
                "the {ext} is not a valid zip package: {}",
                one_line(&e.to_string())
            ))
        })?;
        if zip.len() > MAX_ENTRIES {
            return Err(ParseError::Corrupt(format!(
                "the {ext} has {} zip entries, more than the limit of {MAX_ENTRIES}",
                zip.len()
            )));
        }
        let mut total: u64 = 0;
        for i in 0..zip.len() {
            let size = zip.by_index_raw(i).map_err(|e| zip_error(ext, &e))?.size();
            total = total.saturating_add(size);
        }
        if total > MAX_UNPACKED {
            return Err(ParseError::Corrupt(format!(
                "the {ext} unpacks to {total} bytes, more than the limit of {MAX_UNPACKED} bytes (64 MiB)"
            )));
        }
        Ok(Self {
            zip,
            kind,
            budget: MAX_UNPACKED,
        })
    }

    /// A part's text, `None` when the package has no such part; reading stops at the unpack
    /// budget whatever sizes the zip directory claims.
    fn read(&mut self, path: &str) -> Result<Option<String>, ParseError> {
        let ext = self.kind.ext();
        let Some(index) = self.zip.index_for_name(path) else {
            return Ok(None);
        };
        let file = self.zip.by_index(index).map_err(|e| zip_error(ext, &e))?;
        let mut buf = Vec::new();
        file.take(self.budget.saturating_add(1))
            .read_to_end(&mut buf)
            .map_err(|e| {
                ParseError::Corrupt(format!(
                    "the {ext}'s part {path} could not be unpacked: {}",
                    one_line(&e.to_string())
                ))
            })?;
        let len = u64::try_from(buf.len()).unwrap_or(u64::MAX);
        if len > self.budget {
            return Err(ParseError::Corrupt(format!(
                "the {ext} unpacks to more than the limit of {MAX_UNPACKED} bytes (64 MiB)"
            )));
        }
        self.budget -= len;
        Ok(Some(decode_xml(&buf)))
    }

    /// The path of the main part, from the package relationships (`_rels/.rels`).
    fn main_part(&mut self, default: &str) -> Result<String, ParseError> {
        Ok(self
            .rels("")?
            .into_iter()
            .find(|r| r.kind.ends_with("/officeDocument"))
            .map(|r| r.target)
            .filter(|t| self.zip.index_for_name(t).is_some())
            .unwrap_or_else(|| default.to_owned()))
    }

    /// The relationships of `part` ("" for the package itself).
    fn rels(&mut self, part: &str) -> Result<Vec<Rel>, ParseError> {
        let (dir, file) = match part.rsplit_once('/') {
            Some((d, f)) => (d, f),
            None => ("", part),
        };
        let rels_path = if dir.is_empty() {
            format!("_rels/{file}.rels")
        } else {
            format!("{dir}/_rels/{file}.rels")
        };
        let Some(xml) = self.read(&rels_path)? else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        let mut reader = Reader::from_str(&xml);
        loop {
            match reader.read_event() {
                Ok(Event::Start(e) | Event::Empty(e))
                    if e.local_name().as_ref() == b"Relationship" =>
                {
                    if attr(&e, b"TargetMode").is_some_and(|m| m.eq_ignore_ascii_case("external")) {
                        continue;
                    }
                    let (Some(id), Some(kind), Some(target)) =
                        (attr(&e, b"Id"), attr(&e, b"Type"), attr(&e, b"Target"))
                    else {
                        continue;
                    };
                    out.push(Rel {
                        id,
                        kind,
                        target: resolve(dir, &target),
                    });
                }
                Ok(Event::Eof) => break,
                Ok(_) => {}
                Err(e) => return Err(xml_error(self.kind.ext(), &rels_path, &e)),
            }
        }
        Ok(out)
    }
}

fn zip_error(ext: &str, e: &zip::result::ZipError) -> ParseError {
    match e {
        zip::result::ZipError::UnsupportedArchive(m)
            if *m == zip::result::ZipError::PASSWORD_REQUIRED =>
        {
            ParseError::Encrypted(format!("the {ext}'s zip entries are password-protected"))
        }
        zip::result::ZipError::InvalidPassword => {
            ParseError::Encrypted(format!("the {ext}'s zip entries are password-protected"))
        }
        _ => ParseError::Corrupt(format!(
            "the {ext} is not a valid zip package: {}",
            one_line(&e.to_string())
        )),
    }
}

fn xml_error(ext: &str, part: &str, e: &quick_xml::Error) -> ParseError {
    ParseError::Corrupt(format!(
        "the {ext}'s part {part} is not well-formed XML: {}",
        one_line(&e.to_string())
    ))
}

/// The first line of a message, bounded.
fn one_line(s: &str) -> String {
    let line = s.lines().next().unwrap_or("").trim();
    let out: String = line.chars().take(200).collect();
    if out.is_empty() {
        "unknown cause".to_owned()
    } else {
        out
    }
}

/// XML bytes as text: UTF-8 (BOM dropped), or UTF-16 with a BOM; bad sequences become U+FFFD.
fn decode_xml(buf: &[u8]) -> String {
    let utf16 = |le: bool, body: &[u8]| {
        let units: Vec<u16> = body
            .chunks_exact(2)
            .map(|c| match c {
                [a, b] if le => u16::from_le_bytes([*a, *b]),
                [a, b] => u16::from_be_bytes([*a, *b]),
                _ => 0xfffd,
            })
            .collect();
        String::from_utf16_lossy(&units)
    };
    if let Some(body) = buf.strip_prefix(&[0xff, 0xfe]) {
        utf16(true, body)
    } else if let Some(body) = buf.strip_prefix(&[0xfe, 0xff]) {
        utf16(false, body)
    } else {
        let body = buf.strip_prefix(&[0xef, 0xbb, 0xbf]).unwrap_or(buf);
        String::from_utf8_lossy(body).into_owned()
    }
}

/// A relationship target resolved against the directory of its source part.
fn resolve(dir: &str, target: &str) -> String {
    let mut parts: Vec<&str> = if target.starts_with('/') {
        Vec::new()
    } else {
        dir.split('/').filter(|s| !s.is_empty()).collect()
    };
    for seg in target.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            s => parts.push(s),
        }
    }
    parts.join("/")
}

/// `name` in the directory of `part`.
fn sibling(part: &str, name: &str) -> String {
    match part.rsplit_once('/') {
        Some((dir, _)) => format!("{dir}/{name}"),
        None => name.to_owned(),
    }
}

/// An attribute's value by local name (prefix ignored), entities resolved.
fn attr(e: &BytesStart<'_>, local: &[u8]) -> Option<String> {
    e.attributes().flatten().find_map(|a| {
        (a.key.local_name().as_ref() == local).then(|| {
            a.normalized_value(quick_xml::XmlVersion::Implicit1_0)
                .map(|v| v.into_owned())
                .unwrap_or_else(|_| String::from_utf8_lossy(&a.value).into_owned())
        })
    })
}

/// Collapses runs of whitespace to one space and trims.
fn collapse(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Text of a text event, or of an entity or character reference, appended to `out`.
fn push_text(out: &mut String, ev: &Event<'_>) {
    match ev {
        Event::Text(t) => {
            if let Ok(s) = t.xml10_content() {
                out.push_str(&s);
            }
        }
        Event::CData(t) => {
            if let Ok(s) = t.decode() {
                out.push_str(&s);
            }
        }
        Event::GeneralRef(r) => {
            if let Ok(Some(c)) = r.resolve_char_ref() {
                out.push(c);
            } else if let Ok(name) = r.decode() {
                if let Some(s) = quick_xml::escape::resolve_predefined_entity(&name) {
                    out.push_str(s);
                }
            }
        }
        _ => {}
    }
}

/// Skips an element's whole subtree (its start was just read).
fn skip(reader: &mut Reader<&[u8]>, e: &BytesStart<'_>) -> Result<(), quick_xml::Error> {
    reader.read_to_end(e.name()).map(|_| ())
}

fn table(rows: Vec<Vec<String>>, page: Option<i32>) -> Option<RawElement> {
    let rows: Vec<Vec<String>> = rows
        .into_iter()
        .filter(|r| r.iter().any(|c| !c.is_empty()))
        .collect();
    (!rows.is_empty()).then(|| RawElement::table(&rows, page))
}

fn list_item(text: String, depth: i32, page: Option<i32>) -> RawElement {
    let mut e = RawElement::new("ListItem", text, page);
    e.metadata.category_depth = Some(depth);
    e
}

// -- Word ----------------------------------------------------------------------------------------

/// What a paragraph style says about its paragraphs.
#[derive(Clone, Debug, Default)]
struct Style {
    name: String,
    based_on: Option<String>,
    outline: Option<i32>,
    /// `Some(ilvl)` when the style numbers its paragraphs (`w:numPr`).
    numbered: Option<i32>,
    /// The style switches numbering off (`w:numId` 0).
    numbering_off: bool,
}

#[derive(Default)]
struct Styles {
    by_id: HashMap<String, Style>,
}

/// How a paragraph reads.
#[derive(Clone, Copy, Debug, PartialEq)]
enum ParaKind {
    Heading(i32),
    List(i32),
    Text,
}

/// Heading depth of a built-in style name or id (`heading 2`, `Heading2`, `Title`).
fn heading_of_name(name: &str) -> Option<i32> {
    let n = name.trim().to_ascii_lowercase();
    if n == "title" {
        return Some(0);
    }
    let rest = n.strip_prefix("heading")?.trim_start();
    let level: i32 = rest.parse().ok()?;
    (1..=9).contains(&level).then_some(level - 1)
}

/// List depth of a list style name or id (`List Bullet 2`, `ListNumber`, `List Paragraph`).
fn list_of_name(name: &str) -> Option<i32> {
    let n: String = name
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect::<String>()
        .to_ascii_lowercase();
    for prefix in ["listbullet", "listnumber", "listparagraph"] {
        if let Some(rest) = n.strip_prefix(prefix) {
            if rest.is_empty() {
                return Some(0);
            }
            let level: i32 = rest.parse().ok()?;
            return (1..=9).contains(&level).then_some(level - 1);
        }
    }
    None
}

impl Styles {
    fn parse(xml: &str) -> Result<Self, ParseError> {
        let mut by_id = HashMap::new();
        let mut reader = Reader::from_str(xml);
        let mut cur: Option<(String, Style)> = None;
        loop {
            let ev = reader
                .read_event()
                .map_err(|e| xml_error(".docx", "word/styles.xml", &e))?;
            match &ev {
                Event::Start(e) | Event::Empty(e) => match e.local_name().as_ref() {
                    b"style" => {
                        let paragraph = attr(e, b"type").is_none_or(|t| t == "paragraph");
                        if let (true, Some(id)) = (paragraph, attr(e, b"styleId")) {
                            cur = Some((id, Style::default()));
                        }
                        if matches!(ev, Event::Empty(_)) {
                            if let Some((id, s)) = cur.take() {
                                by_id.insert(id, s);
                            }
                        }
                    }
                    b"name" => {
                        if let (Some((_, s)), Some(v)) = (cur.as_mut(), attr(e, b"val")) {
                            s.name = v;
                        }
                    }
                    b"basedOn" => {
                        if let (Some((_, s)), Some(v)) = (cur.as_mut(), attr(e, b"val")) {
                            s.based_on = Some(v);
                        }
                    }
                    b"outlineLvl" => {
                        if let (Some((_, s)), Some(v)) = (cur.as_mut(), attr(e, b"val")) {
                            s.outline = v.parse().ok().filter(|l| (0..9).contains(l));
                        }
                    }
                    b"numId" => {
                        if let (Some((_, s)), Some(v)) = (cur.as_mut(), attr(e, b"val")) {
                            if v.trim() == "0" {
                                s.numbering_off = true;
                            } else {
                                s.numbered = Some(s.numbered.unwrap_or(0));
                            }
                        }
                    }
                    b"ilvl" => {
                        if let (Some((_, s)), Some(v)) = (cur.as_mut(), attr(e, b"val")) {
                            s.numbered = v.parse().ok().filter(|l| (0..9).contains(l));
                        }
                    }
                    _ => {}
                },
                Event::End(e) if e.local_name().as_ref() == b"style" => {
                    if let Some((id, s)) = cur.take() {
                        by_id.insert(id, s);
                    }
                }
                Event::Eof => break,
                _ => {}
            }
        }
        Ok(Self { by_id })
    }

    /// What a style makes of its paragraphs, following `basedOn` (at most 16 steps, so a
    /// cycle ends).
    fn kind(&self, id: &str) -> ParaKind {
        let mut id = id.to_owned();
        for _ in 0..16 {
            let style = self.by_id.get(&id);
            let name = style.map(|s| s.name.as_str()).unwrap_or("");
            if let Some(d) = heading_of_name(name).or_else(|| heading_of_name(&id)) {
                return ParaKind::Heading(d);
            }
            if let Some(d) = style.and_then(|s| s.outline) {
                return ParaKind::Heading(d);
            }
            if style.is_some_and(|s| s.numbering_off) {
                return ParaKind::Text;
            }
            if let Some(d) = style.and_then(|s| s.numbered) {
                return ParaKind::List(d);
            }
            if let Some(d) = list_of_name(name).or_else(|| list_of_name(&id)) {
                return ParaKind::List(d);
            }
            match style.and_then(|s| s.based_on.clone()) {
                Some(next) if next != id => id = next,
                _ => break,
            }
        }
        ParaKind::Text
    }
}

/// A paragraph being read.
#[derive(Default)]
struct Para {
    text: String,
    style: Option<String>,
    outline: Option<i32>,
    /// `Some(Some(ilvl))` numbered, `Some(None)` numbering switched off (`numId` 0).
    numbering: Option<Option<i32>>,
    ilvl: Option<i32>,
    /// The page of its first text.
    page: Option<i32>,
}

impl Para {
    fn kind(&self, styles: &Styles) -> ParaKind {
        if let Some(d) = self.outline {
            return ParaKind::Heading(d);
        }
        let by_style = self
            .style
            .as_deref()
            .map(|s| styles.kind(s))
            .unwrap_or(ParaKind::Text);
        match (by_style, self.numbering) {
            (ParaKind::Heading(d), _) => ParaKind::Heading(d),
            (_, Some(None)) => ParaKind::Text,
            (_, Some(Some(_))) => ParaKind::List(self.ilvl.unwrap_or(0)),
            (ParaKind::List(d), None) => ParaKind::List(self.ilvl.unwrap_or(d)),
            (k, None) => k,
        }
    }
}

/// A table being read: its rows, the current row and cell, and the page it starts on.
struct Table {
    rows: Vec<Vec<String>>,
    row: Option<Vec<String>>,
    cell: Option<String>,
    page: Option<i32>,
}

fn docx_body(xml: &str, styles: &Styles) -> Result<Vec<RawElement>, ParseError> {
    let has_pages = xml.contains("lastRenderedPageBreak");
    let mut breaks: i32 = 0;
    let page = |breaks: i32| has_pages.then(|| breaks.saturating_add(1));
    let mut out = Vec::new();
    let mut reader = Reader::from_str(xml);
    let mut paras: Vec<Para> = Vec::new();
    let mut tables: Vec<Table> = Vec::new();
    // Depths of the elements whose text or markers count: runs, text, paragraph properties.
    let mut in_run = 0usize;
    let mut in_text = 0usize;
    let mut in_ppr = 0usize;
    let err = |e: quick_xml::Error| xml_error(".docx", "word/document.xml", &e);
    loop {
        let ev = reader.read_event().map_err(err)?;
        match &ev {
            Event::Start(e) => match e.local_name().as_ref() {
                // Fallback copies of alternate content would repeat the text; deleted or
                // moved-away text and field instructions are no content; the former properties
                // of a tracked formatting change would override the current ones.
                b"Fallback" | b"del" | b"moveFrom" | b"instrText" | b"delText" | b"pPrChange"
                | b"rPrChange" | b"numberingChange" => {
                    skip(&mut reader, e).map_err(err)?;
                }
                b"p" => paras.push(Para::default()),
                b"pPr" => in_ppr += 1,
                b"r" => in_run += 1,
                b"t" if in_run > 0 => in_text += 1,
                b"tbl" => tables.push(Table {
                    rows: Vec::new(),
                    row: None,
                    cell: None,
                    page: page(breaks),
                }),
                b"tr" => {
                    if let Some(t) = tables.last_mut() {
                        t.row = Some(Vec::new());
                    }
                }
                b"tc" => {
                    if let Some(t) = tables.last_mut() {
                        t.cell = Some(String::new());
                    }
                }
                _ => docx_marker(e, &mut paras, in_run, in_ppr, &mut breaks),
            },
            Event::Empty(e) => docx_marker(e, &mut paras, in_run, in_ppr, &mut breaks),
            Event::Text(_) | Event::CData(_) | Event::GeneralRef(_) if in_text > 0 => {
                if let Some(p) = paras.last_mut() {
                    if p.page.is_none() {
                        p.page = page(breaks);
                    }
                    push_text(&mut p.text, &ev);
                }
            }
            Event::End(e) => match e.local_name().as_ref() {
                b"pPr" => in_ppr = in_ppr.saturating_sub(1),
                b"r" => in_run = in_run.saturating_sub(1),
                b"t" => in_text = in_text.saturating_sub(1),
                b"p" => {
                    let Some(p) = paras.pop() else { continue };
                    let text = collapse(&p.text);
                    if text.is_empty() {
                        continue;
                    }
                    // A paragraph in a table cell (or a text box in one) is cell text.
                    if let Some(cell) = tables.last_mut().and_then(|t| t.cell.as_mut()) {
                        if !cell.is_empty() {
                            cell.push(' ');
                        }
                        cell.push_str(&text);
                        continue;
                    }
                    out.push(match p.kind(styles) {
                        ParaKind::Heading(d) => RawElement::title(text, d, p.page),
                        ParaKind::List(d) => list_item(text, d, p.page),
                        ParaKind::Text => RawElement::new("NarrativeText", text, p.page),
                    });
                }
                b"tc" => {
                    if let Some(t) = tables.last_mut() {
                        if let (Some(cell), Some(row)) = (t.cell.take(), t.row.as_mut()) {
                            row.push(cell);
                        }
                    }
                }
                b"tr" => {
                    if let Some(t) = tables.last_mut() {
                        if let Some(row) = t.row.take() {
                            t.rows.push(row);
                        }
                    }
                }
                b"tbl" => {
                    let Some(t) = tables.pop() else { continue };
                    if let Some(outer) = tables.last_mut().and_then(|o| o.cell.as_mut()) {
                        // A nested table's text belongs to the cell that holds it.
                        let text = collapse(
                            &t.rows
                                .iter()
                                .flatten()
                                .map(String::as_str)
                                .collect::<Vec<_>>()
                                .join(" "),
                        );
                        if !text.is_empty() {
                            if !outer.is_empty() {
                                outer.push(' ');
                            }
                            outer.push_str(&text);
                        }
                    } else if let Some(e) = table(t.rows, t.page) {
                        out.push(e);
                    }
                }
                _ => {}
            },
            Event::Eof => break,
            _ => {}
        }
    }
    Ok(out)
}

/// Paragraph properties and in-run markers (tabs, breaks) of a docx element.
fn docx_marker(
    e: &BytesStart<'_>,
    paras: &mut [Para],
    in_run: usize,
    in_ppr: usize,
    breaks: &mut i32,
) {
    let name = e.local_name();
    if name.as_ref() == b"lastRenderedPageBreak" {
        *breaks = breaks.saturating_add(1);
        return;
    }
    let Some(p) = paras.last_mut() else { return };
    match name.as_ref() {
        b"pStyle" if in_ppr > 0 => p.style = attr(e, b"val"),
        b"outlineLvl" if in_ppr > 0 => {
            p.outline = attr(e, b"val")
                .and_then(|v| v.parse().ok())
                .filter(|l| (0..9).contains(l));
        }
        b"numId" if in_ppr > 0 => {
            let on = attr(e, b"val").is_some_and(|v| v.trim() != "0");
            p.numbering = Some(on.then_some(0));
        }
        b"ilvl" if in_ppr > 0 => {
            p.ilvl = attr(e, b"val")
                .and_then(|v| v.parse().ok())
                .filter(|l| (0..9).contains(l));
        }
        b"tab" | b"br" | b"cr" if in_run > 0 => p.text.push(' '),
        b"noBreakHyphen" if in_run > 0 => p.text.push('-'),
        _ => {}
    }
}

// -- PowerPoint --------------------------------------------------------------------------------

/// The slide parts in presentation order.
fn slide_order(
    pkg: &mut Package<'_>,
    main: &str,
    presentation: &str,
) -> Result<Vec<String>, ParseError> {
    let rels: BTreeMap<String, String> = pkg
        .rels(main)?
        .into_iter()
        .filter(|r| r.kind.ends_with("/slide"))
        .map(|r| (r.id, r.target))
        .collect();
    let mut ordered = Vec::new();
    let mut reader = Reader::from_str(presentation);
    loop {
        match reader.read_event() {
            Ok(Event::Start(e) | Event::Empty(e)) if e.local_name().as_ref() == b"sldId" => {
                if let Some(target) = rel_id(&e).and_then(|id| rels.get(&id)) {
                    if !ordered.contains(target) {
                        ordered.push(target.clone());
                    }
                }
            }
            Ok(Event::Eof) => break,
            Ok(_) => {}
            Err(e) => return Err(xml_error(".pptx", main, &e)),
        }
    }
    if ordered.iter().any(|p| pkg.zip.index_for_name(p).is_some()) {
        return Ok(ordered);
    }
    // No usable list: the slide parts by number.
    let mut numbered: Vec<(u64, String)> = pkg
        .zip
        .file_names()
        .filter_map(|n| {
            let num = n
                .strip_prefix("ppt/slides/slide")?
                .strip_suffix(".xml")?
                .parse()
                .ok()?;
            Some((num, n.to_owned()))
        })
        .collect();
    numbered.sort();
    Ok(numbered.into_iter().map(|(_, n)| n).collect())
}

/// The `r:id` of an element (the relationship-namespaced `id`).
fn rel_id(e: &BytesStart<'_>) -> Option<String> {
    e.attributes().flatten().find_map(|a| {
        let key = a.key.as_ref();
        (a.key.local_name().as_ref() == b"id" && key.contains(&b':'))
            .then(|| String::from_utf8_lossy(&a.value).into_owned())
    })
}

/// A paragraph of a slide.
struct SlidePara {
    text: String,
    lvl: i32,
    /// `Some(true)` explicit bullet, `Some(false)` `a:buNone`, `None` inherited.
    bullet: Option<bool>,
}

/// A shape being read.
#[derive(Default)]
struct Shape {
    /// The placeholder type, `Some("")` for a placeholder without one.
    ph: Option<String>,
    paras: Vec<SlidePara>,
}

enum Role {
    Title,
    Body,
    Dropped,
    Other,
}

impl Shape {
    fn role(&self) -> Role {
        match self.ph.as_deref() {
            Some("title" | "ctrTitle") => Role::Title,
            Some("body" | "obj" | "") => Role::Body,
            Some("dt" | "ftr" | "sldNum" | "hdr") => Role::Dropped,
            _ => Role::Other,
        }
    }
}

fn pptx_slide(xml: &str, page: Option<i32>) -> Result<Vec<RawElement>, ParseError> {
    let mut titles = Vec::new();
    let mut rest = Vec::new();
    let mut reader = Reader::from_str(xml);
    let mut shapes: Vec<Shape> = Vec::new();
    let mut para: Option<SlidePara> = None;
    let mut tables: Vec<Table> = Vec::new();
    let mut in_text = 0usize;
    let err = |e: quick_xml::Error| xml_error(".pptx", "a slide", &e);
    loop {
        let ev = reader.read_event().map_err(err)?;
        let empty = matches!(ev, Event::Empty(_));
        match &ev {
            Event::Start(e) | Event::Empty(e) => match e.local_name().as_ref() {
                b"Fallback" if !empty => skip(&mut reader, e).map_err(err)?,
                b"sp" if !empty => shapes.push(Shape::default()),
                b"ph" => {
                    if let Some(s) = shapes.last_mut() {
                        s.ph = Some(attr(e, b"type").unwrap_or_default());
                    }
                }
                b"p" if !empty => {
                    para = Some(SlidePara {
                        text: String::new(),
                        lvl: 0,
                        bullet: None,
                    })
                }
                b"pPr" => {
                    if let Some(p) = para.as_mut() {
                        p.lvl = attr(e, b"lvl")
                            .and_then(|v| v.parse().ok())
                            .filter(|l| (0..9).contains(l))
                            .unwrap_or(0);
                    }
                }
                b"buChar" | b"buAutoNum" | b"buBlip" => {
                    if let Some(p) = para.as_mut() {
                        p.bullet = Some(true);
                    }
                }
                b"buNone" => {
                    if let Some(p) = para.as_mut() {
                        p.bullet = Some(false);
                    }
                }
                b"br" => {
                    if let Some(p) = para.as_mut() {
                        p.text.push(' ');
                    }
                }
                b"t" if !empty => in_text += 1,
                b"tbl" if !empty => tables.push(Table {
                    rows: Vec::new(),
                    row: None,
                    cell: None,
                    page,
                }),
                b"tr" if !empty => {
                    if let Some(t) = tables.last_mut() {
                        t.row = Some(Vec::new());
                    }
                }
                b"tc" => {
                    if let Some(t) = tables.last_mut() {
                        if empty {
                            if let Some(row) = t.row.as_mut() {
                                row.push(String::new());
                            }
                        } else {
                            t.cell = Some(String::new());
                        }
                    }
                }
                _ => {}
            },
            Event::Text(_) | Event::CData(_) | Event::GeneralRef(_) if in_text > 0 => {
                if let Some(p) = para.as_mut() {
                    push_text(&mut p.text, &ev);
                }
            }
            Event::End(e) => match e.local_name().as_ref() {
                b"t" => in_text = in_text.saturating_sub(1),
                b"p" => {
                    let Some(p) = para.take() else { continue };
                    let text = collapse(&p.text);
                    if text.is_empty() {
                        continue;
                    }
                    if let Some(cell) = tables.last_mut().and_then(|t| t.cell.as_mut()) {
                        if !cell.is_empty() {
                            cell.push(' ');
                        }
                        cell.push_str(&text);
                    } else if let Some(s) = shapes.last_mut() {
                        s.paras.push(SlidePara { text, ..p });
                    }
                }
                b"tc" => {
                    if let Some(t) = tables.last_mut() {
                        if let (Some(cell), Some(row)) = (t.cell.take(), t.row.as_mut()) {
                            row.push(cell);
                        }
                    }
                }
                b"tr" => {
                    if let Some(t) = tables.last_mut() {
                        if let Some(row) = t.row.take() {
                            t.rows.push(row);
                        }
                    }
                }
                b"tbl" => {
                    if let Some(e) = tables.pop().and_then(|t| table(t.rows, t.page)) {
                        rest.push(e);
                    }
                }
                b"sp" => {
                    let Some(s) = shapes.pop() else { continue };
                    match s.role() {
                        Role::Dropped => {}
                        Role::Title => {
                            let text = collapse(
                                &s.paras
                                    .iter()
                                    .map(|p| p.text.as_str())
                                    .collect::<Vec<_>>()
                                    .join(" "),
                            );
                            if !text.is_empty() {
                                titles.push(RawElement::title(text, 0, page));
                            }
                        }
                        Role::Body => {
                            let many = s.paras.len() > 1 || s.paras.iter().any(|p| p.lvl > 0);
                            for p in s.paras {
                                let bulleted = p.bullet.unwrap_or(many);
                                rest.push(if bulleted {
                                    list_item(p.text, p.lvl, page)
                                } else {
                                    RawElement::new("NarrativeText", p.text, page)
                                });
                            }
                        }
                        Role::Other => {
                            for p in s.paras {
                                rest.push(if p.bullet == Some(true) {
                                    list_item(p.text, p.lvl, page)
                                } else {
                                    RawElement::new("NarrativeText", p.text, page)
                                });
                            }
                        }
                    }
                }
                _ => {}
            },
            Event::Eof => break,
            _ => {}
        }
    }
    titles.extend(rest);
    Ok(titles)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    use super::super::test_support::{dump, fixture};

    /// A zip of the given parts, stored uncompressed.
    fn zip_of(parts: &[(&str, &str)]) -> Vec<u8> {
        let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored);
        for (name, body) in parts {
            w.start_file(*name, opts).unwrap();
            w.write_all(body.as_bytes()).unwrap();
        }
        w.finish().unwrap().into_inner()
    }

    const W: &str = r#"xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main""#;

    #[test]
    fn guide_docx_headings_lists_table() {
        let els = parse_docx(&fixture("guide.docx")).unwrap();
        let all = dump(&els);
        let titles: Vec<(&str, Option<i32>)> = els
            .iter()
            .filter(|e| e.kind == "Title")
            .map(|e| (e.text.as_str(), e.metadata.category_depth))
            .collect();
        assert_eq!(
            titles,
            vec![
                ("A Guide to Living Cells", Some(0)),
                ("Energy in the Cell", Some(0)),
                ("Parts to Remember", Some(1)),
                ("Comparison", Some(0)),
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
                "The nucleus holds the genome",
                "Ribosomes build proteins",
                "The membrane keeps the inside in"
            ],
            "{all}"
        );
        let tables: Vec<&RawElement> = els.iter().filter(|e| e.kind == "Table").collect();
        assert_eq!(tables.len(), 1, "{all}");
        assert_eq!(tables[0].text.lines().count(), 3);
        assert_eq!(
            tables[0].text.lines().nth(2),
            Some("Mitochondrion | respiration | plants & animals")
        );
        let html = tables[0].metadata.text_as_html.as_deref().unwrap();
        assert_eq!(html.matches("<tr>").count(), 3);
        assert!(html.contains("<td>plants &amp; animals</td>"), "{html}");
        for term in ["photosynthesis", "mitochondria"] {
            assert!(
                els.iter()
                    .any(|e| e.kind == "NarrativeText" && e.text.to_lowercase().contains(term)),
                "{term}: {all}"
            );
        }
        // Tabs are spaces, runs join.
        assert!(
            els.iter()
                .any(|e| e.text == "A run with a tab and a bold part"),
            "{all}"
        );
        // python-docx writes no rendered page breaks: pages are unknown.
        assert!(els.iter().all(|e| e.metadata.page_number.is_none()));
    }

    #[test]
    fn docx_styles_resolve_through_names_and_numbering() {
        let styles = format!(
            r#"<w:styles {W}>
              <w:style w:type="paragraph" w:styleId="berschrift1"><w:name w:val="heading 1"/></w:style>
              <w:style w:type="paragraph" w:styleId="berschrift2"><w:name w:val="heading 2"/></w:style>
              <w:style w:type="paragraph" w:styleId="Mine"><w:name w:val="My Heading"/><w:basedOn w:val="berschrift2"/></w:style>
              <w:style w:type="paragraph" w:styleId="Listenabsatz"><w:name w:val="List Paragraph"/></w:style>
            </w:styles>"#
        );
        let doc = format!(
            r#"<?xml version="1.0" encoding="UTF-8"?><w:document {W}><w:body>
              <w:p><w:pPr><w:pStyle w:val="berschrift1"/></w:pPr><w:r><w:t>Einleitung</w:t></w:r></w:p>
              <w:p><w:pPr><w:pStyle w:val="Mine"/></w:pPr><w:r><w:t>Unterteil</w:t></w:r></w:p>
              <w:p><w:r><w:lastRenderedPageBreak/><w:t xml:space="preserve">Erste   Seite &amp; </w:t><w:t>mehr</w:t></w:r></w:p>
              <w:p><w:pPr><w:numPr><w:ilvl w:val="1"/><w:numId w:val="3"/></w:numPr></w:pPr><w:r><w:t>Punkt</w:t></w:r></w:p>
              <w:p><w:pPr><w:pStyle w:val="Listenabsatz"/></w:pPr><w:r><w:t>Absatz</w:t></w:r></w:p>
              <w:p><w:pPr><w:outlineLvl w:val="2"/></w:pPr><w:r><w:t>Gliederung</w:t></w:r></w:p>
              <w:p><w:del><w:r><w:delText>weg</w:delText></w:r></w:del><w:r><w:br w:type="page"/><w:lastRenderedPageBreak/><w:t>Zweite</w:t></w:r></w:p>
              <w:p/><w:p><w:r><w:t>   </w:t></w:r></w:p>
              <w:p><w:pPr><w:pStyle w:val="berschrift2"/><w:pPrChange><w:pPr><w:pStyle w:val="Normal"/></w:pPr></w:pPrChange></w:pPr><w:r><w:t>Neu</w:t></w:r></w:p>
              <w:tbl><w:tr><w:tc><w:p><w:r><w:t>a</w:t></w:r></w:p><w:p><w:r><w:t>b</w:t></w:r></w:p></w:tc>
                <w:tc><w:tbl><w:tr><w:tc><w:p><w:r><w:t>inner</w:t></w:r></w:p></w:tc></w:tr></w:tbl></w:tc></w:tr>
                <w:tr><w:tc><w:p/></w:tc><w:tc><w:p/></w:tc></w:tr></w:tbl>
            </w:body></w:document>"#
        );
        let bytes = zip_of(&[("word/document.xml", &doc), ("word/styles.xml", &styles)]);
        let els = parse_docx(&bytes).unwrap();
        let got: Vec<(&str, &str, Option<i32>, Option<i32>)> = els
            .iter()
            .map(|e| {
                (
                    e.kind.as_str(),
                    e.text.as_str(),
                    e.metadata.category_depth,
                    e.metadata.page_number,
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("Title", "Einleitung", Some(0), Some(1)),
                ("Title", "Unterteil", Some(1), Some(1)),
                ("NarrativeText", "Erste Seite & mehr", None, Some(2)),
                ("ListItem", "Punkt", Some(1), Some(2)),
                ("ListItem", "Absatz", Some(0), Some(2)),
                ("Title", "Gliederung", Some(2), Some(2)),
                ("NarrativeText", "Zweite", None, Some(3)),
                ("Title", "Neu", Some(1), Some(3)),
                ("Table", "a b | inner", None, Some(3)),
            ]
        );
    }

    #[test]
    fn pptx_order_placeholders_and_bullets() {
        const NS: &str = r#"xmlns:a="http://schemas.openxmlformats.org/drawingml/2006/main" xmlns:p="http://schemas.openxmlformats.org/presentationml/2006/main" xmlns:r="http://schemas.openxmlformats.org/officeDocument/2006/relationships""#;
        let sp = |ph: &str, paras: &str| {
            format!(
                "<p:sp><p:nvSpPr><p:cNvPr id=\"2\" name=\"x\"/><p:cNvSpPr/><p:nvPr>{ph}</p:nvPr></p:nvSpPr><p:txBody>{paras}</p:txBody></p:sp>"
            )
        };
        let para = |t: &str| format!("<a:p><a:r><a:t>{t}</a:t></a:r></a:p>");
        let slide = |shapes: String| {
            format!("<p:sld {NS}><p:cSld><p:spTree>{shapes}</p:spTree></p:cSld></p:sld>")
        };
        // The body comes before the title in the tree; one body paragraph is prose.
        let first = slide(
            sp(r#"<p:ph idx="1"/>"#, &para("Only one line"))
                + &sp(
                    r#"<p:ph type="ctrTitle"/>"#,
                    &(para("Opening") + &para("words")),
                )
                + &sp(r#"<p:ph type="subTitle" idx="1"/>"#, &para("A subtitle"))
                + &sp(r#"<p:ph type="sldNum" idx="12"/>"#, &para("1"))
                + &sp(
                    "",
                    r#"<a:p><a:pPr><a:buChar char="-"/></a:pPr><a:r><a:t>dash</a:t></a:r></a:p>"#,
                ),
        );
        let second = slide(sp(
            r#"<p:ph type="body" idx="1"/>"#,
            &(para("one")
                + r#"<a:p><a:pPr><a:buNone/></a:pPr><a:r><a:t>plain</a:t></a:r></a:p>"#
                + &para("two")),
        ));
        let pres = format!(
            r#"<p:presentation {NS}><p:sldIdLst><p:sldId id="257" r:id="rB"/><p:sldId id="256" r:id="rA"/><p:sldId id="258" r:id="rMissing"/></p:sldIdLst></p:presentation>"#
        );
        let rels = r#"<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships"><Relationship Id="rA" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/slide" Target="slides/slide1.xml"/><Relationship Id="rB" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/slide" Target="/ppt/slides/slide2.xml"/></Relationships>"#;
        let bytes = zip_of(&[
            ("ppt/presentation.xml", &pres),
            ("ppt/_rels/presentation.xml.rels", rels),
            ("ppt/slides/slide1.xml", &first),
            ("ppt/slides/slide2.xml", &second),
        ]);
        let got: Vec<(String, String, Option<i32>)> = parse_pptx(&bytes)
            .unwrap()
            .into_iter()
            .map(|e| (e.kind, e.text, e.metadata.page_number))
            .collect();
        let want: Vec<(String, String, Option<i32>)> = [
            ("ListItem", "one", 1),
            ("NarrativeText", "plain", 1),
            ("ListItem", "two", 1),
            ("Title", "Opening words", 2),
            ("NarrativeText", "Only one line", 2),
            ("NarrativeText", "A subtitle", 2),
            ("ListItem", "dash", 2),
        ]
        .into_iter()
        .map(|(k, t, p)| (k.to_owned(), t.to_owned(), Some(p)))
        .collect();
        assert_eq!(got, want);
        // Without a presentation list the slides go by number.
        let bytes = zip_of(&[
            ("ppt/presentation.xml", &format!("<p:presentation {NS}/>")),
            ("ppt/slides/slide10.xml", &second),
            ("ppt/slides/slide9.xml", &first),
        ]);
        let els = parse_pptx(&bytes).unwrap();
        assert_eq!(els[0].text, "Opening words");
        assert_eq!(els.last().map(|e| e.metadata.page_number), Some(Some(2)));
    }

    #[test]
    fn deck_pptx_slides_titles_lists_table() {
        let els = parse_pptx(&fixture("deck.pptx")).unwrap();
        let all = dump(&els);
        let titles: Vec<(&str, Option<i32>, Option<i32>)> = els
            .iter()
            .filter(|e| e.kind == "Title")
            .map(|e| {
                (
                    e.text.as_str(),
                    e.metadata.page_number,
                    e.metadata.category_depth,
                )
            })
            .collect();
        assert_eq!(
            titles,
            vec![
                ("Running Containers", Some(1), Some(0)),
                ("Infrastructure as Code", Some(2), Some(0)),
                ("Monitoring Stack", Some(3), Some(0)),
            ],
            "{all}"
        );
        let items: Vec<(&str, Option<i32>, Option<i32>)> = els
            .iter()
            .filter(|e| e.kind == "ListItem")
            .map(|e| {
                (
                    e.text.as_str(),
                    e.metadata.page_number,
                    e.metadata.category_depth,
                )
            })
            .collect();
        assert_eq!(
            items,
            vec![
                (
                    "Kubernetes schedules containers onto nodes",
                    Some(1),
                    Some(0)
                ),
                ("Pods are the smallest unit", Some(1), Some(0)),
                ("Services give pods a stable address", Some(1), Some(0)),
                (
                    "Terraform describes infrastructure in files",
                    Some(2),
                    Some(0)
                ),
                (
                    "Plans show the change before it is applied",
                    Some(2),
                    Some(1)
                ),
                ("State records what exists", Some(2), Some(0)),
            ],
            "{all}"
        );
        assert!(
            els.iter().any(|e| e.kind == "NarrativeText"
                && e.text == "Speaker aside: keep state remote."
                && e.metadata.page_number == Some(2)),
            "{all}"
        );
        let tables: Vec<&RawElement> = els.iter().filter(|e| e.kind == "Table").collect();
        assert_eq!(tables.len(), 1, "{all}");
        assert_eq!(tables[0].metadata.page_number, Some(3));
        assert_eq!(
            tables[0].text,
            "Tool | Purpose | Since\nPrometheus | metrics | 2012\nGrafana | dashboards | 2014"
        );
        assert!(tables[0].metadata.text_as_html.is_some());
        // Each slide's title comes first on it.
        assert_eq!(els[0].kind, "Title");
    }

    #[test]
    fn broken_packages_are_corrupt_encrypted_or_unsupported() {
        let no_main = zip_of(&[("word/other.xml", "<x/>")]);
        assert!(matches!(parse_docx(&no_main), Err(ParseError::Corrupt(m)) if m.contains("main")));
        let no_pres = zip_of(&[("ppt/slides/slide1.xml", "<x/>")]);
        assert!(matches!(parse_pptx(&no_pres), Err(ParseError::Corrupt(_))));
        for f in [parse_docx, parse_pptx] {
            assert!(matches!(f(b""), Err(ParseError::Corrupt(_))));
            assert!(matches!(
                f(b"PK\x03\x04 not really"),
                Err(ParseError::Corrupt(_))
            ));
            let mut ole = OLE_MAGIC.to_vec();
            ole.extend_from_slice(&[0u8; 504]);
            assert!(matches!(f(&ole), Err(ParseError::Encrypted(_))));
        }
        // A legacy binary .doc is an OLE file too, with a WordDocument stream.
        let mut doc = OLE_MAGIC.to_vec();
        doc.extend_from_slice(&[0u8; 100]);
        doc.extend("WordDocument".encode_utf16().flat_map(|u| u.to_le_bytes()));
        assert!(matches!(parse_docx(&doc), Err(ParseError::Unsupported(_))));
        // Malformed XML in the main part.
        let bad = zip_of(&[("word/document.xml", "<w:document><w:body><w:p></w:body>")]);
        assert!(matches!(parse_docx(&bad), Err(ParseError::Corrupt(_))));
        // No text at all.
        let empty = zip_of(&[(
            "word/document.xml",
            &format!("<w:document {W}><w:body><w:p/></w:body></w:document>"),
        )]);
        assert!(matches!(parse_docx(&empty), Err(ParseError::Empty(_))));
    }

    #[test]
    fn zip_bombs_are_refused() {
        let names: Vec<String> = (0..=MAX_ENTRIES).map(|i| format!("f{i}")).collect();
        let parts: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), "")).collect();
        let many = zip_of(&parts);
        assert!(matches!(parse_docx(&many), Err(ParseError::Corrupt(m)) if m.contains("4096")));
        // 65 MiB of spaces deflate to a small file.
        let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored);
        w.start_file("word/document.xml", opts).unwrap();
        let chunk = vec![b' '; 1 << 20];
        for _ in 0..65 {
            w.write_all(&chunk).unwrap();
        }
        let big = w.finish().unwrap().into_inner();
        assert!(matches!(parse_docx(&big), Err(ParseError::Corrupt(m)) if m.contains("64 MiB")));
    }

    #[test]
    fn garbage_never_panics() {
        let good = fixture("guide.docx");
        let deck = fixture("deck.pptx");
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        for (i, base) in [&good, &deck].iter().enumerate() {
            for round in 0..40 {
                let mut bytes = (*base).clone();
                // Flip a handful of bytes, or truncate.
                for _ in 0..8 {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let at = usize::try_from(state % bytes.len() as u64).unwrap();
                    bytes[at] ^= (state >> 32) as u8 | 1;
                }
                if round % 3 == 0 {
                    bytes.truncate(bytes.len() * round / 40);
                }
                let _ = if i == 0 {
                    parse_docx(&bytes)
                } else {
                    parse_pptx(&bytes)
                };
            }
        }
    }

    #[test]
    fn parsing_is_deterministic() {
        let docx = fixture("guide.docx");
        assert_eq!(parse_docx(&docx).unwrap(), parse_docx(&docx).unwrap());
        let pptx = fixture("deck.pptx");
        assert_eq!(parse_pptx(&pptx).unwrap(), parse_pptx(&pptx).unwrap());
    }

    #[test]
    fn relationship_targets_resolve() {
        assert_eq!(resolve("ppt", "slides/slide1.xml"), "ppt/slides/slide1.xml");
        assert_eq!(resolve("ppt/slides", "../media/a.png"), "ppt/media/a.png");
        assert_eq!(resolve("ppt", "/ppt/slides/s.xml"), "ppt/slides/s.xml");
        assert_eq!(resolve("", "word/document.xml"), "word/document.xml");
    }
}
