//! The planning half of the platform's LLM semantic chunker (`llm-semantic-v1`, prompt
//! `semantic-chunking-v6`): a document's elements become atomic units, the units become fixed-core
//! windows, and each window becomes one model request with its input and model fingerprints.
//! Invariant: everything here is pure: the same elements give the same units, windows, prompts
//! and fingerprints, byte for byte; every unit is a non-empty, non-overlapping, in-order UTF-8
//! byte range of the canonical text of at most [`MAX_CHUNK_GRAPHEMES`] graphemes; the windows'
//! cores tile the units exactly once, in order, and a window's look-ahead units are the next
//! window's core (read-only context, never answered for).

use std::ops::Range;

use serde_json::{json, Value};
use unicode_segmentation::UnicodeSegmentation;

use crate::canonical::{sha256_hex, stable_json};
use crate::jobs::compile::artifact::{spans, Element};
use crate::model::{Prompt, Purpose};

pub const PROMPT_VERSION: &str = "semantic-chunking-v6";
pub const STRATEGY: &str = "llm-semantic-v1";
pub const SCHEMA_VERSION: i32 = 1;
pub const PLANNING_VERSION: &str = "v6";
pub const MAX_CHUNK_GRAPHEMES: usize = 1200;
pub const MAX_WINDOW_GRAPHEMES: usize = 4800;
pub const MAX_CORE_UNITS: usize = 32;
pub const MAX_LOOK_AHEAD_UNITS: usize = 8;
pub const MAX_OUTPUT_TOKENS: u32 = 6000;
/// The most entities, and the most relations, one chunk may carry.
pub const MAX_ENTITIES_PER_CHUNK: usize = 100;
pub const MAX_WINDOWS: usize = 4096;
pub const ENTITY_TYPES: [&str; 7] = [
    "date",
    "metric",
    "organization",
    "person",
    "policy",
    "product",
    "term",
];
pub const RELATION_TYPES: [&str; 6] = [
    "mentions",
    "defines",
    "references",
    "depends_on",
    "supersedes",
    "contradicts",
];

/// One atomic unit: a sentence of a paragraph or list, or a whole other element, hard-split to
/// at most [`MAX_CHUNK_GRAPHEMES`] graphemes.
#[derive(Clone, Debug, PartialEq)]
pub struct Unit {
    /// `u-{elementIndex:06}-{atomicIndex:06}`; the element index counts skipped empty elements.
    pub id: String,
    /// Index into the elements.
    pub element: usize,
    pub element_id: String,
    pub element_type: String,
    pub section_path: Vec<String>,
    pub page_number: Option<i32>,
    /// The unit's text: a slice of the element's trimmed text.
    pub text: String,
    /// UTF-8 byte offsets in the canonical text, half-open.
    pub start: usize,
    pub end: usize,
    pub graphemes: usize,
    /// An image or table element: its units never share a chunk with another element's.
    pub isolated: bool,
}

/// The number of extended grapheme clusters of `s`.
pub fn graphemes(s: &str) -> usize {
    s.graphemes(true).count()
}

/// The canonical text of the elements: trimmed non-empty texts joined by `"\n"`.
pub fn canonical_text(elements: &[Element]) -> String {
    elements
        .iter()
        .map(Element::trimmed)
        .filter(|t| !t.is_empty())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The atomic units of the elements, in canonical-text order. Paragraph and list elements are
/// split at UAX #29 sentence boundaries (each piece trimmed of surrounding whitespace; an
/// all-whitespace piece is dropped), every other element is one range; every range is then
/// hard-split into pieces of at most [`MAX_CHUNK_GRAPHEMES`] graphemes.
pub fn units(elements: &[Element]) -> Vec<Unit> {
    let mut out = Vec::new();
    for span in spans(elements) {
        let e = &elements[span.element];
        let text = e.trimmed();
        let ranges: Vec<Range<usize>> = if matches!(e.kind.as_str(), "paragraph" | "list") {
            text.split_sentence_bound_indices()
                .filter_map(|(at, piece)| {
                    let trimmed = piece.trim();
                    if trimmed.is_empty() {
                        return None;
                    }
                    let start = at + (piece.len() - piece.trim_start().len());
                    Some(start..start + trimmed.len())
                })
                .collect()
        } else {
            std::iter::once(0..text.len()).collect()
        };
        let mut atomic = 0usize;
        for range in ranges {
            for piece in hard_split(&text[range.clone()], MAX_CHUNK_GRAPHEMES) {
                let start = range.start + piece.start;
                let end = range.start + piece.end;
                let slice = &text[start..end];
                out.push(Unit {
                    id: format!("u-{:06}-{:06}", span.element, atomic),
                    element: span.element,
                    element_id: e.id.clone(),
                    element_type: e.kind.clone(),
                    section_path: e.section_path.clone(),
                    page_number: e.page_number,
                    text: slice.to_owned(),
                    start: span.start + start,
                    end: span.start + end,
                    graphemes: graphemes(slice),
                    isolated: matches!(e.kind.as_str(), "image" | "table"),
                });
                atomic += 1;
            }
        }
    }
    out
}

/// Byte ranges of `s` of at most `max` graphemes each, in order, covering `s`.
fn hard_split(s: &str, max: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0usize;
    let mut count = 0usize;
    for (at, _) in s.grapheme_indices(true) {
        if count == max {
            out.push(start..at);
            start = at;
            count = 0;
        }
        count += 1;
    }
    if count > 0 {
        out.push(start..s.len());
    }
    out
}

/// One model request's slice of the units.
#[derive(Clone, Debug, PartialEq)]
pub struct Window {
    pub index: usize,
    /// `window-{index:06}`.
    pub id: String,
    /// The unit indices the answer must cover.
    pub core: Range<usize>,
    /// The unit indices right after the core, shown as read-only context (may be empty).
    pub look_ahead: Range<usize>,
    /// The longest common prefix of the core units' section paths.
    pub section_path: Vec<String>,
    /// The platform's v6 `atomicDocument`: the whole document must come back as one chunk.
    pub atomic: bool,
}

/// Every window, planned up front (v6 fixed core). A core takes units while the canonical text
/// from its first unit's start to the candidate's end has at most [`MAX_WINDOW_GRAPHEMES`]
/// graphemes and it has fewer than [`MAX_CORE_UNITS`] units (its first unit always; v6's
/// numbered-list continuation past 32 units is not applied); the look-ahead takes up to
/// [`MAX_LOOK_AHEAD_UNITS`] following units while their span has at most
/// [`MAX_CHUNK_GRAPHEMES`] graphemes; the next core starts right after this one. Errs when the
/// document needs more than [`MAX_WINDOWS`] windows.
pub fn windows(canonical: &str, units: &[Unit]) -> Result<Vec<Window>, String> {
    let atomic = atomic_document(canonical, units);
    let span = |a: usize, b: usize| graphemes(&canonical[units[a].start..units[b].end]);
    let mut out = Vec::new();
    let mut start = 0usize;
    while start < units.len() {
        if out.len() == MAX_WINDOWS {
            return Err(format!(
                "LLM semantic chunking deterministic window count exceeds maxSemanticWindows={MAX_WINDOWS}"
            ));
        }
        let mut core_end = start + 1;
        while core_end < units.len()
            && core_end - start < MAX_CORE_UNITS
            && span(start, core_end) <= MAX_WINDOW_GRAPHEMES
        {
            core_end += 1;
        }
        let mut look_end = core_end;
        while look_end < units.len()
            && look_end - core_end < MAX_LOOK_AHEAD_UNITS
            && span(core_end, look_end) <= MAX_CHUNK_GRAPHEMES
        {
            look_end += 1;
        }
        let index = out.len();
        out.push(Window {
            index,
            id: format!("window-{index:06}"),
            core: start..core_end,
            look_ahead: core_end..look_end,
            section_path: common_prefix(units[start..core_end].iter().map(|u| &u.section_path)),
            atomic,
        });
        start = core_end;
    }
    Ok(out)
}

/// The platform's v6 `atomicDocument` rule: some units, at most [`MAX_CORE_UNITS`] of them,
/// exactly one table element (tables are not split into records here, so none has more than
/// one), at least one unit that is not an image or table, every unit on the same known page, and
/// the whole canonical text within [`MAX_CHUNK_GRAPHEMES`] graphemes.
fn atomic_document(canonical: &str, units: &[Unit]) -> bool {
    let Some(first) = units.first() else {
        return false;
    };
    let mut tables: Vec<usize> = units
        .iter()
        .filter(|u| u.element_type == "table")
        .map(|u| u.element)
        .collect();
    tables.dedup();
    units.len() <= MAX_CORE_UNITS
        && tables.len() == 1
        && units.iter().any(|u| !u.isolated)
        && first.page_number.is_some()
        && units.iter().all(|u| u.page_number == first.page_number)
        && graphemes(canonical) <= MAX_CHUNK_GRAPHEMES
}

/// The longest common prefix of some section paths (empty for none).
pub fn common_prefix<'a>(mut paths: impl Iterator<Item = &'a Vec<String>>) -> Vec<String> {
    let Some(first) = paths.next() else {
        return Vec::new();
    };
    let mut len = first.len();
    for p in paths {
        len = first[..len]
            .iter()
            .zip(p)
            .take_while(|(a, b)| a == b)
            .count();
    }
    first[..len].to_vec()
}

/// The platform's `semanticPromptUnit` (keys sorted, as serde_json writes them).
fn prompt_unit(u: &Unit) -> Value {
    let mut v = json!({
        "graphemeLength": u.graphemes,
        "id": u.id,
        "sourceElementId": u.element_id,
        "sourceSectionPath": u.section_path,
        "text": u.text,
        "type": u.element_type,
    });
    if u.isolated {
        v["boundaryPolicy"] = json!("isolated");
    }
    v
}

fn prompt_units(units: &[Unit], r: &Range<usize>) -> Value {
    Value::Array(units[r.clone()].iter().map(prompt_unit).collect())
}

/// The request's user JSON: `{atomicDocument, features, fixedCoreBoundary, lookAheadUnits,
/// sectionPath, tableSchemas, units, windowId}`.
pub fn prompt_input(units: &[Unit], w: &Window) -> Value {
    json!({
        "atomicDocument": w.atomic,
        "features": {"enableGraph": true, "enablePageIndex": true},
        "fixedCoreBoundary": true,
        "lookAheadUnits": prompt_units(units, &w.look_ahead),
        "sectionPath": w.section_path,
        "tableSchemas": [],
        "units": prompt_units(units, &w.core),
        "windowId": w.id,
    })
}

/// The window's checkpoint key: `sha256:` of the platform's `JSON.stringify` of
/// `{atomicDocument, lookAheadUnits, planningVersion, sectionPath, tableSchemas, units,
/// windowId}` (its literal key order is the sorted order serde_json writes).
pub fn input_fingerprint(units: &[Unit], w: &Window) -> String {
    let source = json!({
        "atomicDocument": w.atomic,
        "lookAheadUnits": prompt_units(units, &w.look_ahead),
        "planningVersion": PLANNING_VERSION,
        "sectionPath": w.section_path,
        "tableSchemas": [],
        "units": prompt_units(units, &w.core),
        "windowId": w.id,
    });
    let text = serde_json::to_string(&source).expect("a JSON value serializes");
    format!("sha256:{}", sha256_hex(text.as_bytes()))
}

/// The model identity a checkpoint was answered under: `sha256:` of the stable JSON of
/// `{enableGraph, enablePageIndex, promptVersion, selection}`, `selection` being the retrieval
/// profile's `reasoningModel` (`{model, pluginId, provider}`).
pub fn model_fingerprint(selection: &Value) -> String {
    let v = json!({
        "enableGraph": true,
        "enablePageIndex": true,
        "promptVersion": PROMPT_VERSION,
        "selection": selection,
    });
    format!("sha256:{}", sha256_hex(stable_json(&v).as_bytes()))
}

const OUTPUT_SHAPE: &str = r#"{"chunks":[{"startUnitId":"u-000001-000000","endUnitId":"u-000003-000001","sectionPath":["Policy","Eligibility"],"sectionSummary":"Who is eligible and under what conditions.","entities":[{"id":"e-1","text":"Acme","type":"organization","confidence":0.95,"canonicalName":"Acme Corp","aliases":["Acme"]},{"id":"e-2","text":"Policy A","type":"policy","confidence":0.9}],"relations":[{"subjectEntityId":"e-1","objectEntityId":"e-2","type":"references","confidence":0.9}]}]}"#;

/// The system message of a window's request.
fn system(w: &Window) -> String {
    let mut lines = vec![
        "You split one window of a document into semantically complete chunks, in a single pass.".to_owned(),
        "Graph extraction is on: while you choose the boundaries, list the entities each chunk names and the relations between them, grounded in its text.".to_owned(),
        "PageIndex is on: give every chunk a short semantic sectionPath and a one-sentence sectionSummary.".to_owned(),
        "Answer with strict JSON only, no prose and no code fences. Never return, rewrite, correct, summarize or repeat the source text itself.".to_owned(),
        "The units array is the core. Cover every core unit exactly once, in order, with contiguous inclusive ranges from startUnitId to endUnitId.".to_owned(),
        "lookAheadUnits are read-only context owned by another request: never put a look-ahead unit in any range.".to_owned(),
        "The last range must end at the last unit of units, so that windows can be answered independently.".to_owned(),
        "Ranges may be shorter than the limit; prefer natural topic boundaries to full chunks.".to_owned(),
        "Keep a numbered or bulleted list together with its heading when the whole list fits in one chunk.".to_owned(),
        format!("A range may hold at most {MAX_CHUNK_GRAPHEMES} Unicode graphemes, counting the separators between units."),
        format!("Give at most {MAX_ENTITIES_PER_CHUNK} entities and {MAX_ENTITIES_PER_CHUNK} relations per chunk."),
        format!("Entity types allowed: {}.", ENTITY_TYPES.join(", ")),
        format!("Relation types allowed: {}.", RELATION_TYPES.join(", ")),
        "An entity's text must be an exact substring of the source. Give each entity an id unique within the response.".to_owned(),
        "A relation names its ends by the ids of entities of the same chunk (subjectEntityId, objectEntityId), never by their names.".to_owned(),
        "Each unit carries the sourceSectionPath the parser gave it: provenance, not a required boundary. Prefer source-section boundaries, but adjacent short sections may share a chunk when together they state one fact or record.".to_owned(),
    ];
    if w.atomic {
        lines.push("atomicDocument is true: the whole document is one record; answer exactly one chunk covering every core unit.".to_owned());
    } else {
        lines.push("A unit with boundaryPolicy \"isolated\" must be in a chunk holding only units of that same table or image element.".to_owned());
    }
    lines.push("Keep the longest common sourceSectionPath prefix of a chunk's units as the start of its sectionPath and add only meaningful child levels.".to_owned());
    lines.push("Output shape:".to_owned());
    lines.push(OUTPUT_SHAPE.to_owned());
    lines.join("\n")
}

/// The model request for a window.
pub fn prompt(units: &[Unit], w: &Window) -> Prompt {
    let input = prompt_input(units, w);
    Prompt {
        purpose: Purpose::Chunk,
        system: system(w),
        user: serde_json::to_string(&input).expect("a JSON value serializes"),
        input,
        max_output_tokens: MAX_OUTPUT_TOKENS,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jobs::compile::artifact::test_element;

    fn el(n: usize, kind: &str, text: &str, path: &[&str]) -> Element {
        test_element(n, kind, text, path)
    }

    fn ranges(canonical: &str, us: &[Unit]) -> Vec<(String, String)> {
        us.iter()
            .map(|u| (u.id.clone(), canonical[u.start..u.end].to_owned()))
            .collect()
    }

    #[test]
    fn units_split_paragraphs_into_trimmed_sentences_and_keep_other_elements_whole() {
        // (elements, expected (id, canonical slice))
        type Case = (Vec<Element>, Vec<(&'static str, &'static str)>);
        let cases: Vec<Case> = vec![
            (vec![], vec![]),
            (
                vec![
                    el(1, "heading", "  Intro ", &["Intro"]),
                    el(2, "paragraph", "One fact.  Two facts! Three?", &["Intro"]),
                ],
                vec![
                    ("u-000000-000000", "Intro"),
                    ("u-000001-000000", "One fact."),
                    ("u-000001-000001", "Two facts!"),
                    ("u-000001-000002", "Three?"),
                ],
            ),
            (
                // The empty element is skipped but still counts in the element index.
                vec![
                    el(1, "paragraph", "   ", &[]),
                    el(2, "code", "a. b. c.", &[]),
                    el(3, "list", "- first.\n- second.", &[]),
                ],
                vec![
                    ("u-000001-000000", "a. b. c."),
                    ("u-000002-000000", "- first."),
                    ("u-000002-000001", "- second."),
                ],
            ),
        ];
        for (elements, want) in cases {
            let canonical = canonical_text(&elements);
            let us = units(&elements);
            let got = ranges(&canonical, &us);
            let want: Vec<(String, String)> = want
                .into_iter()
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .collect();
            assert_eq!(got, want, "{elements:?}");
            for u in &us {
                assert_eq!(u.text, &canonical[u.start..u.end]);
                assert_eq!(u.graphemes, graphemes(&u.text));
            }
        }
    }

    #[test]
    fn long_ranges_are_hard_split_by_graphemes() {
        // 1500 "é" written as e + combining acute: one grapheme, three bytes each.
        let long = "e\u{301}".repeat(1500);
        let elements = vec![el(1, "table", &long, &["T"])];
        let us = units(&elements);
        assert_eq!(
            us.iter().map(|u| u.graphemes).collect::<Vec<_>>(),
            vec![1200, 300]
        );
        assert_eq!((us[0].start, us[0].end, us[1].end), (0, 3600, 4500));
        assert!(us.iter().all(|u| u.isolated));
        assert_eq!(us[1].id, "u-000000-000001");
    }

    #[test]
    fn canonical_text_joins_trimmed_nonempty_texts() {
        let elements = vec![
            el(1, "heading", " A ", &[]),
            el(2, "paragraph", "\n", &[]),
            el(3, "paragraph", "b c", &[]),
        ];
        assert_eq!(canonical_text(&elements), "A\nb c");
    }

    fn sized(n: usize, each: usize) -> Vec<Element> {
        (0..n)
            .map(|i| {
                el(
                    i + 1,
                    "code",
                    &"x".repeat(each),
                    &["S", &format!("{}", i / 3)],
                )
            })
            .collect()
    }

    #[test]
    fn windows_tile_the_units_with_fixed_cores() {
        // (element count, graphemes each, expected cores, expected look-aheads)
        type Case = (usize, usize, Vec<Range<usize>>, Vec<Range<usize>>);
        let cases: Vec<Case> = vec![
            (0, 10, vec![], vec![]),
            (
                1,
                10,
                std::iter::once(0..1).collect(),
                std::iter::once(1..1).collect(),
            ),
            // 40 tiny units: 32 in the first core, 8 look-ahead, then the rest.
            (40, 10, vec![0..32, 32..40], vec![32..40, 40..40]),
            // 1000-grapheme units: 4 fit 4800 (with 3 separators 4003), 5 do not.
            (6, 1000, vec![0..4, 4..6], vec![4..5, 6..6]),
            // 5000 graphemes are hard-split into 1200-pieces: 4 make 4800 of one element.
            (1, 5000, vec![0..4, 4..5], vec![4..5, 5..5]),
        ];
        for (n, each, cores, looks) in cases {
            let elements = sized(n, each);
            let canonical = canonical_text(&elements);
            let us = units(&elements);
            let ws = windows(&canonical, &us).unwrap();
            assert_eq!(ws.iter().map(|w| w.core.clone()).collect::<Vec<_>>(), cores);
            assert_eq!(
                ws.iter().map(|w| w.look_ahead.clone()).collect::<Vec<_>>(),
                looks
            );
            for (i, w) in ws.iter().enumerate() {
                assert_eq!(w.index, i);
                assert_eq!(w.id, format!("window-{i:06}"));
                assert!(!w.atomic);
            }
        }
    }

    #[test]
    fn a_window_section_path_is_the_common_prefix_of_its_core() {
        let elements = vec![
            el(1, "paragraph", "a.", &["A", "B", "C"]),
            el(2, "paragraph", "b.", &["A", "B"]),
            el(3, "paragraph", "c.", &["A", "B", "D"]),
        ];
        let canonical = canonical_text(&elements);
        let ws = windows(&canonical, &units(&elements)).unwrap();
        assert_eq!(ws[0].section_path, vec!["A", "B"]);
        let paths = [vec!["x".to_owned()], vec!["y".to_owned()]];
        assert!(common_prefix(paths.iter()).is_empty());
        assert!(common_prefix(std::iter::empty()).is_empty());
    }

    #[test]
    fn atomic_document_follows_the_v6_rule() {
        let paged = |mut e: Element, page: Option<i32>| {
            e.page_number = page;
            e
        };
        // (elements, atomic)
        let cases = vec![
            (
                vec![
                    paged(el(1, "heading", "Price list", &[]), Some(1)),
                    paged(el(2, "table", "a | b", &[]), Some(1)),
                ],
                true,
            ),
            // No table.
            (
                vec![paged(el(1, "paragraph", "Only text.", &[]), Some(1))],
                false,
            ),
            // Only a table.
            (vec![paged(el(1, "table", "a | b", &[]), Some(1))], false),
            // Two pages.
            (
                vec![
                    paged(el(1, "heading", "Price list", &[]), Some(1)),
                    paged(el(2, "table", "a | b", &[]), Some(2)),
                ],
                false,
            ),
            // No page.
            (
                vec![
                    paged(el(1, "heading", "Price list", &[]), None),
                    paged(el(2, "table", "a | b", &[]), None),
                ],
                false,
            ),
            // Too long.
            (
                vec![
                    paged(el(1, "heading", &"h".repeat(1200), &[]), Some(1)),
                    paged(el(2, "table", "a | b", &[]), Some(1)),
                ],
                false,
            ),
        ];
        for (elements, atomic) in cases {
            let canonical = canonical_text(&elements);
            let ws = windows(&canonical, &units(&elements)).unwrap();
            assert!(ws.iter().all(|w| w.atomic == atomic), "{elements:?}");
        }
    }

    #[test]
    fn too_many_windows_is_an_error() {
        // One-grapheme units: 32 to a core, so 4097 windows need 32 * 4096 + 1 units.
        let n = MAX_CORE_UNITS * MAX_WINDOWS + 1;
        let us: Vec<Unit> = (0..n)
            .map(|i| Unit {
                id: format!("u-{i:06}-000000"),
                element: i,
                element_id: format!("a:element-{}", i + 1),
                element_type: "code".into(),
                section_path: vec![],
                page_number: None,
                text: "x".into(),
                start: 2 * i,
                end: 2 * i + 1,
                graphemes: 1,
                isolated: false,
            })
            .collect();
        let canonical = vec!["x"; n].join("\n");
        let e = windows(&canonical, &us).unwrap_err();
        assert!(e.contains("maxSemanticWindows=4096"), "{e}");
        let ws = windows(&canonical[..2 * (n - 1) - 1], &us[..n - 1]).unwrap();
        assert_eq!(ws.len(), MAX_WINDOWS);
        assert_eq!(ws.last().unwrap().core.end, n - 1);
    }

    fn small() -> (Vec<Unit>, Window) {
        let elements = vec![
            el(1, "heading", "Intro", &["Intro"]),
            el(2, "image", "A chart", &["Intro"]),
        ];
        let canonical = canonical_text(&elements);
        let us = units(&elements);
        let w = windows(&canonical, &us).unwrap().remove(0);
        (us, w)
    }

    #[test]
    fn prompt_input_has_the_platforms_shape() {
        let (us, w) = small();
        let v = prompt_input(&us, &w);
        assert_eq!(
            serde_json::to_string(&v).unwrap(),
            concat!(
                r#"{"atomicDocument":false,"features":{"enableGraph":true,"enablePageIndex":true},"#,
                r#""fixedCoreBoundary":true,"lookAheadUnits":[],"sectionPath":["Intro"],"tableSchemas":[],"#,
                r#""units":[{"graphemeLength":5,"id":"u-000000-000000","sourceElementId":"a:element-1","#,
                r#""sourceSectionPath":["Intro"],"text":"Intro","type":"heading"},"#,
                r#"{"boundaryPolicy":"isolated","graphemeLength":7,"id":"u-000001-000000","#,
                r#""sourceElementId":"a:element-2","sourceSectionPath":["Intro"],"text":"A chart","type":"image"}],"#,
                r#""windowId":"window-000000"}"#
            )
        );
        let p = prompt(&us, &w);
        assert_eq!(p.purpose, Purpose::Chunk);
        assert_eq!(p.user, serde_json::to_string(&v).unwrap());
        assert_eq!(p.input, v);
        assert_eq!(p.max_output_tokens, MAX_OUTPUT_TOKENS);
        assert!(p.system.contains("boundaryPolicy"));
        assert!(p.system.contains(OUTPUT_SHAPE));
    }

    #[test]
    fn fingerprints_are_sha256_of_the_documented_json() {
        let (us, w) = small();
        let f = input_fingerprint(&us, &w);
        let source = concat!(
            r#"{"atomicDocument":false,"lookAheadUnits":[],"planningVersion":"v6","sectionPath":["Intro"],"#,
            r#""tableSchemas":[],"units":[{"graphemeLength":5,"id":"u-000000-000000","sourceElementId":"a:element-1","#,
            r#""sourceSectionPath":["Intro"],"text":"Intro","type":"heading"},"#,
            r#"{"boundaryPolicy":"isolated","graphemeLength":7,"id":"u-000001-000000","#,
            r#""sourceElementId":"a:element-2","sourceSectionPath":["Intro"],"text":"A chart","type":"image"}],"#,
            r#""windowId":"window-000000"}"#
        );
        assert_eq!(f, format!("sha256:{}", sha256_hex(source.as_bytes())));
        let sel = json!({"provider": "openai", "pluginId": "p", "model": "m"});
        let m = model_fingerprint(&sel);
        let source = r#"{"enableGraph":true,"enablePageIndex":true,"promptVersion":"semantic-chunking-v6","selection":{"model":"m","pluginId":"p","provider":"openai"}}"#;
        assert_eq!(m, format!("sha256:{}", sha256_hex(source.as_bytes())));
        for f in [f, m] {
            assert_eq!(f.len(), 71);
            assert!(f[7..]
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        }
    }
}
