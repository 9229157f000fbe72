//! The platform's deterministic chunker: a parse artifact's elements become knowledge-node
//! drafts. Invariant: a pure function of the elements, the artifact id and hash; a node never
//! spans two section paths, holds at most [`MAX_CHUNK_GRAPHEMES`] grapheme clusters, and its
//! offsets are UTF-8 byte offsets into the artifact's canonical text; an element longer than a
//! chunk is cut into windows that overlap by [`OVERLAP_GRAPHEMES`].

use serde_json::{json, Value};
use unicode_segmentation::UnicodeSegmentation;
use uuid::Uuid;

use super::artifact::{spans, Element};

/// The largest chunk, in grapheme clusters.
pub const MAX_CHUNK_GRAPHEMES: usize = 1200;
/// How much of a cut element each window repeats from the one before.
pub const OVERLAP_GRAPHEMES: usize = 120;

/// One knowledge node before it is given its generation's id.
#[derive(Clone, Debug, PartialEq)]
pub struct Draft {
    /// The chunker's id: UUID v5 of `<artifactHash>:<chunkIndex>` in the artifact's namespace.
    pub chunk_id: Uuid,
    pub kind: &'static str,
    pub text: String,
    pub start: usize,
    pub end: usize,
    pub section_path: Vec<String>,
    pub page_number: Option<i32>,
    pub metadata: Value,
}

struct Segment<'a> {
    element: &'a Element,
    text: &'a str,
    start: usize,
    end: usize,
    graphemes: usize,
}

/// The elements' nodes, in document order.
pub fn chunk(elements: &[Element], artifact_id: Uuid, artifact_hash: &str) -> Vec<Draft> {
    let segments: Vec<Segment<'_>> = spans(elements)
        .into_iter()
        .map(|s| {
            let e = &elements[s.element];
            let text = e.trimmed();
            Segment {
                element: e,
                text,
                start: s.start,
                end: s.end,
                graphemes: text.graphemes(true).count(),
            }
        })
        .collect();
    let mut out = Chunker {
        artifact_id,
        artifact_hash,
        drafts: Vec::new(),
    };
    let mut group: Vec<&Segment<'_>> = Vec::new();
    let mut group_graphemes = 0usize;
    for seg in &segments {
        let standalone = matches!(seg.element.kind.as_str(), "image" | "table");
        let path_changed = group
            .first()
            .is_some_and(|g| g.element.section_path != seg.element.section_path);
        if standalone || path_changed || seg.graphemes > MAX_CHUNK_GRAPHEMES {
            out.flush(&mut group);
            group_graphemes = 0;
        }
        if standalone {
            out.windows(
                seg,
                if seg.element.kind == "image" {
                    "image"
                } else {
                    "table"
                },
            );
            continue;
        }
        if seg.graphemes > MAX_CHUNK_GRAPHEMES {
            out.windows(seg, "chunk");
            continue;
        }
        // Separators count: one "\n" between the segments of a group.
        if !group.is_empty() && group_graphemes + group.len() + seg.graphemes > MAX_CHUNK_GRAPHEMES
        {
            out.flush(&mut group);
            group_graphemes = 0;
        }
        group.push(seg);
        group_graphemes += seg.graphemes;
    }
    out.flush(&mut group);
    out.drafts
}

struct Chunker<'h> {
    artifact_id: Uuid,
    artifact_hash: &'h str,
    drafts: Vec<Draft>,
}

impl Chunker<'_> {
    fn next_id(&self) -> Uuid {
        crate::canonical::uuid_v5(
            self.artifact_id,
            &format!("{}:{}", self.artifact_hash, self.drafts.len()),
        )
    }

    fn flush(&mut self, group: &mut Vec<&Segment<'_>>) {
        if group.is_empty() {
            return;
        }
        let first = group[0];
        let last = group[group.len() - 1];
        let text = group.iter().map(|s| s.text).collect::<Vec<_>>().join("\n");
        let page = first
            .element
            .page_number
            .filter(|p| group.iter().all(|s| s.element.page_number == Some(*p)));
        let mut metadata = base_metadata(self.drafts.len(), group.iter().map(|s| s.element));
        if group.len() == 1 {
            copy_element_metadata(&mut metadata, first.element);
        }
        self.drafts.push(Draft {
            chunk_id: self.next_id(),
            kind: "chunk",
            text,
            start: first.start,
            end: last.end,
            section_path: first.element.section_path.clone(),
            page_number: page,
            metadata,
        });
        group.clear();
    }

    /// Sliding windows over one element's graphemes.
    fn windows(&mut self, seg: &Segment<'_>, kind: &'static str) {
        let bounds: Vec<usize> = seg
            .text
            .grapheme_indices(true)
            .map(|(i, _)| i)
            .chain(std::iter::once(seg.text.len()))
            .collect();
        let n = bounds.len() - 1;
        let mut from = 0usize;
        loop {
            let to = (from + MAX_CHUNK_GRAPHEMES).min(n);
            let (a, b) = (bounds[from], bounds[to]);
            let mut metadata = base_metadata(self.drafts.len(), std::iter::once(seg.element));
            copy_element_metadata(&mut metadata, seg.element);
            self.drafts.push(Draft {
                chunk_id: self.next_id(),
                kind,
                text: seg.text[a..b].to_owned(),
                start: seg.start + a,
                end: seg.start + b,
                section_path: seg.element.section_path.clone(),
                page_number: seg.element.page_number,
                metadata,
            });
            if to == n {
                break;
            }
            from = to - OVERLAP_GRAPHEMES;
            // The rest fits in the overlap: it is already in this window.
            if n - from <= OVERLAP_GRAPHEMES {
                break;
            }
        }
    }
}

fn base_metadata<'a>(index: usize, elements: impl Iterator<Item = &'a Element>) -> Value {
    let (ids, types): (Vec<&str>, Vec<&str>) =
        elements.map(|e| (e.id.as_str(), e.kind.as_str())).unzip();
    json!({
        "chunkIndex": index,
        "elementIds": ids,
        "elementSeparator": "\n",
        "elementTypes": types,
        "offsetEncoding": "utf-8-bytes",
        "textNormalization": "unicode-whitespace-trim",
    })
}

/// The element metadata a single-element node carries over.
fn copy_element_metadata(metadata: &mut Value, e: &Element) {
    for key in [
        "assetRef",
        "boundingBox",
        "caption",
        "ocrText",
        "table",
        "textAsHtml",
        "title",
    ] {
        if let Some(v) = e.metadata.get(key) {
            metadata[key] = v.clone();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::jobs::compile::artifact::test_element as el;

    #[test]
    fn nodes_follow_sections_and_stay_bounded() {
        let long = "word ".repeat(700); // 3500 graphemes, trimmed 3499
        let els = vec![
            el(1, "heading", "Guide", &["Guide"]),
            el(2, "paragraph", "Short one.", &["Guide"]),
            el(3, "heading", "Install", &["Guide", "Install"]),
            el(4, "paragraph", &long, &["Guide", "Install"]),
            el(5, "paragraph", "After.", &["Guide", "Install"]),
        ];
        let id = Uuid::from_u128(9);
        let d = chunk(&els, id, "h");
        assert_eq!(d[0].text, "Guide\nShort one.");
        assert_eq!((d[0].start, d[0].end), (0, 16));
        assert_eq!(d[0].section_path, ["Guide"]);
        assert_eq!(d[1].text, "Install");
        // The long paragraph: windows of 1200 graphemes overlapping by 120.
        let windows: Vec<&Draft> = d.iter().filter(|x| x.text.len() >= 1000).collect();
        assert_eq!(windows.len(), 3);
        assert!(d
            .iter()
            .all(|x| x.text.graphemes(true).count() <= MAX_CHUNK_GRAPHEMES));
        assert_eq!(windows[1].start, windows[0].start + 1080);
        assert_eq!(d.last().unwrap().text, "After.");
        for (i, x) in d.iter().enumerate() {
            assert_eq!(x.metadata["chunkIndex"], i);
            assert_eq!(x.chunk_id, crate::canonical::uuid_v5(id, &format!("h:{i}")));
        }
        assert_eq!(d, chunk(&els, id, "h"), "deterministic");
    }

    #[test]
    fn graphemes_are_never_cut() {
        let wide = "👍🏽".repeat(1300);
        let d = chunk(&[el(1, "paragraph", &wide, &[])], Uuid::nil(), "h");
        assert!(d.iter().all(|x| x.text.graphemes(true).count() <= 1200));
        assert!(d
            .iter()
            .all(|x| wide.is_char_boundary(x.start) && wide.is_char_boundary(x.end)));
    }
}
