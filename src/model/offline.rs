//! The deterministic offline reasoner: answers every model request in process, from the
//! request's `input` alone, with no network and no randomness (tests, the demo, the bench).
//! Invariant: the same prompt always gets the same answer, and a chunking answer for a window
//! planned by [`crate::jobs::compile::semantic::plan`] is one that
//! [`crate::jobs::compile::semantic::answer::parse`] accepts: consecutive core units grouped in
//! order, never a look-ahead unit, each range within the grapheme limit (with
//! [`RANGE_SLACK`] graphemes left for whitespace between sentences), an isolated element alone
//! (unless the document is atomic: then one range), every entity an exact substring of its range
//! and every relation between two of its entities. An input it cannot read is
//! [`ModelError::Rejected`].

use serde_json::{json, Map, Value};
use unicode_segmentation::UnicodeSegmentation;

use super::{estimate_tokens, Completion, ModelError, Prompt, Purpose, Reasoner};

/// The most graphemes a chunk may have (the chunker's `MAX_CHUNK_GRAPHEMES`).
pub const RANGE_LIMIT: usize = 1200;
/// A range is closed once it reaches this many graphemes, so documents get several nodes.
pub const RANGE_TARGET: usize = 600;
/// Graphemes kept free under [`RANGE_LIMIT`] when a range takes a further unit: the units of a
/// range are counted joined by one `"\n"`, while the canonical text may hold more whitespace
/// between two sentences.
pub const RANGE_SLACK: usize = 100;
/// The most entities (and relations) of one chunk.
const CHUNK_ENTITIES: usize = 10;
/// The most entities (and relations) of an entity or relation answer.
const LIST_LIMIT: usize = 50;

/// The deterministic offline reasoning model.
#[derive(Clone, Copy, Debug, Default)]
pub struct Offline;

#[async_trait::async_trait]
impl Reasoner for Offline {
    fn name(&self) -> &'static str {
        "offline"
    }

    fn model_for(&self, selected: &str) -> String {
        selected.to_owned()
    }

    async fn complete(&self, model: &str, prompt: &Prompt) -> Result<Completion, ModelError> {
        let input = &prompt.input;
        let answer = match prompt.purpose {
            Purpose::Chunk => chunks(input),
            Purpose::Summary => summary(input),
            Purpose::Entity => entities(input),
            Purpose::Relation => relations(input),
            Purpose::Navigate => navigate(input),
        }
        .map_err(|why| {
            ModelError::Rejected(format!(
                "the offline reasoner cannot read this {} request: {why}",
                prompt.purpose.as_str()
            ))
        })?;
        let text = answer.to_string();
        Ok(Completion {
            model: model.to_owned(),
            prompt_tokens: Some(estimate_tokens(&prompt.system) + estimate_tokens(&prompt.user)),
            completion_tokens: Some(estimate_tokens(&text)),
            text,
        })
    }
}

fn graphemes(s: &str) -> usize {
    s.graphemes(true).count()
}

/// The first `n` characters of `s`, trimmed.
fn cut(s: &str, n: usize) -> String {
    s.chars().take(n).collect::<String>().trim().to_owned()
}

/// The trimmed non-empty sentences of `s` (UAX #29).
fn sentences(s: &str) -> impl Iterator<Item = &str> {
    s.split_sentence_bounds()
        .map(str::trim)
        .filter(|p| !p.is_empty())
}

fn text_of<'a>(input: &'a Value, key: &str) -> Result<&'a str, String> {
    input
        .get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("{key} is not a string"))
}

struct PromptUnit<'a> {
    id: &'a str,
    text: &'a str,
    path: Vec<&'a str>,
    /// The element of an isolated unit.
    isolation: Option<&'a str>,
    graphemes: usize,
}

fn prompt_unit(v: &Value) -> Result<PromptUnit<'_>, String> {
    let id = text_of(v, "id")?;
    let text = text_of(v, "text")?;
    let path = match v.get("sourceSectionPath") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|s| s.as_str().ok_or("sourceSectionPath holds a non-string"))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err("sourceSectionPath is not an array".into()),
    };
    let isolation =
        (v.get("boundaryPolicy").and_then(Value::as_str) == Some("isolated")).then(|| {
            v.get("sourceElementId")
                .and_then(Value::as_str)
                .unwrap_or(id)
        });
    Ok(PromptUnit {
        id,
        text,
        path,
        isolation,
        graphemes: graphemes(text),
    })
}

/// A chunking answer: see the module's invariant.
fn chunks(input: &Value) -> Result<Value, String> {
    let units = input
        .get("units")
        .and_then(Value::as_array)
        .ok_or("units is not an array")?
        .iter()
        .map(prompt_unit)
        .collect::<Result<Vec<_>, _>>()?;
    if units.is_empty() {
        return Err("units is empty".into());
    }
    let atomic = input.get("atomicDocument").and_then(Value::as_bool) == Some(true);
    let mut ranges: Vec<Vec<&PromptUnit>> = Vec::new();
    let mut size = 0usize;
    for (i, u) in units.iter().enumerate() {
        let close = match (ranges.last(), i.checked_sub(1).map(|p| &units[p])) {
            (Some(_), Some(prev)) if !atomic => {
                prev.path != u.path
                    || prev.isolation != u.isolation
                    || size >= RANGE_TARGET
                    || size + 1 + u.graphemes > RANGE_LIMIT - RANGE_SLACK
            }
            _ => ranges.is_empty(),
        };
        if close {
            ranges.push(Vec::new());
            size = 0;
        } else {
            size += 1;
        }
        size += u.graphemes;
        ranges.last_mut().expect("a range is open").push(u);
    }
    let chunks: Vec<Value> = ranges.iter().map(|r| chunk(r)).collect();
    Ok(json!({ "chunks": chunks }))
}

fn chunk(range: &[&PromptUnit]) -> Value {
    let text = range.iter().map(|u| u.text).collect::<Vec<_>>().join("\n");
    let mut c = Map::new();
    c.insert("startUnitId".into(), json!(range[0].id));
    c.insert("endUnitId".into(), json!(range[range.len() - 1].id));
    let mut prefix = range[0].path.clone();
    for u in &range[1..] {
        let same = prefix
            .iter()
            .zip(&u.path)
            .take_while(|(a, b)| a == b)
            .count();
        prefix.truncate(same);
    }
    // Only a path the response schema accepts; without one the chunker keeps the units' prefix.
    let fits = |s: &&str| (1..=160).contains(&s.trim().encode_utf16().count());
    if (1..=8).contains(&prefix.len()) && prefix.iter().all(fits) {
        c.insert("sectionPath".into(), json!(prefix));
    }
    if let Some(first) = sentences(&text).next() {
        let s = cut(first, 200);
        if !s.is_empty() {
            c.insert("sectionSummary".into(), json!(s));
        }
    }
    let runs = capitalised_runs(&text, CHUNK_ENTITIES);
    let entities: Vec<Value> = runs
        .iter()
        .enumerate()
        .map(|(i, (run, words))| {
            json!({"id": format!("e-{}", i + 1), "text": run, "type": kind(*words), "confidence": 0.8})
        })
        .collect();
    let relations: Vec<Value> = (1..runs.len())
        .take(CHUNK_ENTITIES)
        .map(|i| {
            json!({"subjectEntityId": format!("e-{i}"), "objectEntityId": format!("e-{}", i + 1),
                   "type": "mentions", "confidence": 0.7})
        })
        .collect();
    c.insert("entities".into(), Value::Array(entities));
    c.insert("relations".into(), Value::Array(relations));
    Value::Object(c)
}

fn kind(words: usize) -> &'static str {
    if words > 1 {
        "organization"
    } else {
        "term"
    }
}

/// Runs of capitalised words (an uppercase letter then at least one more letter) separated by
/// single spaces, as exact substrings of `text` with their word counts, first occurrence order,
/// deduplicated, at most `max`. A single word that begins a sentence is not a run.
fn capitalised_runs(text: &str, max: usize) -> Vec<(&str, usize)> {
    // (start, end, capitalised) of every maximal run of letters.
    let mut words: Vec<(usize, usize, bool)> = Vec::new();
    let mut open: Option<usize> = None;
    for (at, ch) in text.char_indices().chain([(text.len(), ' ')]) {
        match (open, ch.is_alphabetic()) {
            (None, true) => open = Some(at),
            (Some(start), false) => {
                let w = &text[start..at];
                let mut chars = w.chars();
                let capitalised = chars.next().is_some_and(char::is_uppercase)
                    && chars.next().is_some()
                    && w.chars().all(char::is_alphabetic);
                words.push((start, at, capitalised));
                open = None;
            }
            _ => {}
        }
    }
    let sentence_start = |start: usize| {
        let before = &text[..start];
        let kept = before.trim_end();
        kept.is_empty()
            || kept.ends_with(['.', '!', '?', ':', ';'])
            || before[kept.len()..].contains('\n')
    };
    let mut out: Vec<(&str, usize)> = Vec::new();
    let mut i = 0;
    while i < words.len() && out.len() < max {
        if !words[i].2 {
            i += 1;
            continue;
        }
        let mut j = i;
        while j + 1 < words.len() && words[j + 1].2 && &text[words[j].1..words[j + 1].0] == " " {
            j += 1;
        }
        let count = j - i + 1;
        let run = &text[words[i].0..words[j].1];
        if (count > 1 || !sentence_start(words[i].0)) && !out.iter().any(|(r, _)| *r == run) {
            out.push((run, count));
        }
        i = j + 1;
    }
    out
}

/// `{"summary"}`: the text's first two sentences, at most 400 characters (else the title's).
fn summary(input: &Value) -> Result<Value, String> {
    let text = text_of(input, "text")?;
    let mut s = cut(&sentences(text).take(2).collect::<Vec<_>>().join(" "), 400);
    if s.is_empty() {
        s = cut(
            input.get("title").and_then(Value::as_str).unwrap_or(""),
            400,
        );
    }
    Ok(json!({ "summary": s }))
}

/// `{"entities":[{text, type, confidence}]}`: the text's capitalised runs, at most 50.
fn entities(input: &Value) -> Result<Value, String> {
    let text = text_of(input, "text")?;
    let list: Vec<Value> = capitalised_runs(text, LIST_LIMIT)
        .into_iter()
        .map(|(name, words)| json!({"text": name, "type": kind(words), "confidence": 0.8}))
        .collect();
    Ok(json!({ "entities": list }))
}

/// `{"relations":[{subject, object, type, confidence}]}`: `mentions` between consecutive
/// entities, at most 50.
fn relations(input: &Value) -> Result<Value, String> {
    let names: Vec<&str> = input
        .get("entities")
        .and_then(Value::as_array)
        .ok_or("entities is not an array")?
        .iter()
        .map(|n| n.as_str().ok_or("entities holds a non-string"))
        .collect::<Result<_, _>>()?;
    let list: Vec<Value> = names
        .windows(2)
        .take(LIST_LIMIT)
        .map(|p| json!({"subject": p[0], "object": p[1], "type": "mentions", "confidence": 0.7}))
        .collect();
    Ok(json!({ "relations": list }))
}

/// The lower-cased words of three or more letters or digits in `s`.
fn words(s: &str) -> std::collections::BTreeSet<String> {
    s.split(|c: char| !c.is_alphanumeric())
        .filter(|w| w.chars().count() >= 3)
        .map(str::to_lowercase)
        .collect()
}

/// `{"decisions":[{action, nodeId, score, reason}]}`: every visible candidate that shares a word
/// with the query, scored by the share of the query's words its title, path and summary hold;
/// one with children is expanded, a leaf opened; at most 8, best first. No shared word: no
/// decision (the search abstains).
fn navigate(input: &Value) -> Result<Value, String> {
    let query = words(text_of(input, "query")?);
    if query.is_empty() {
        return Ok(json!({ "decisions": [] }));
    }
    let candidates = input
        .get("candidates")
        .and_then(Value::as_array)
        .ok_or("candidates is not an array")?;
    let mut scored = Vec::new();
    for c in candidates {
        let id = c
            .get("nodeId")
            .and_then(Value::as_str)
            .ok_or("a candidate has no nodeId")?;
        let mut text = String::new();
        for key in ["title", "summary"] {
            text.push_str(c.get(key).and_then(Value::as_str).unwrap_or(""));
            text.push(' ');
        }
        for p in c
            .get("path")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            text.push_str(p.as_str().unwrap_or(""));
            text.push(' ');
        }
        let shared: Vec<String> = query.intersection(&words(&text)).cloned().collect();
        if shared.is_empty() {
            continue;
        }
        let score = shared.len() as f64 / query.len() as f64;
        let expand = c.get("childCount").and_then(Value::as_u64).unwrap_or(0) > 0;
        scored.push((score, id.to_owned(), expand, shared));
    }
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    let decisions: Vec<Value> = scored
        .into_iter()
        .take(8)
        .map(|(score, id, expand, shared)| {
            json!({ "action": if expand { "expand" } else { "open" }, "nodeId": id,
                    "score": (score * 1e6).round() / 1e6,
                    "reason": format!("shares {}", shared.join(", ")) })
        })
        .collect();
    Ok(json!({ "decisions": decisions }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jobs::compile::artifact::{test_element, Element};
    use crate::jobs::compile::semantic::{answer, plan};

    fn prompt(purpose: Purpose, input: Value) -> Prompt {
        Prompt {
            purpose,
            system: "s".into(),
            user: input.to_string(),
            input,
            max_output_tokens: 10,
        }
    }

    async fn ask(purpose: Purpose, input: Value) -> Result<Value, ModelError> {
        let c = Offline.complete("m-1", &prompt(purpose, input)).await?;
        assert_eq!(c.model, "m-1");
        assert!(c.prompt_tokens.is_some() && c.completion_tokens.is_some());
        Ok(serde_json::from_str(&c.text).unwrap())
    }

    /// Plans, asks and parses every window; returns the chunks' unit ranges.
    async fn chunk_document(elements: &[Element]) -> Vec<answer::Chunk> {
        let canonical = plan::canonical_text(elements);
        let units = plan::units(elements);
        let mut all = Vec::new();
        for w in plan::windows(&canonical, &units).unwrap() {
            let p = plan::prompt(&units, &w);
            let c = Offline.complete("m", &p).await.unwrap();
            let again = Offline.complete("m", &p).await.unwrap();
            assert_eq!(c, again, "deterministic");
            let chunks = answer::parse(&c.text, &canonical, &units, &w)
                .unwrap_or_else(|e| panic!("{}: {e}\n{}", w.id, c.text));
            assert_eq!(chunks.first().unwrap().units.start, w.core.start);
            assert_eq!(chunks.last().unwrap().units.end, w.core.end);
            for pair in chunks.windows(2) {
                assert_eq!(pair[0].units.end, pair[1].units.start);
            }
            all.extend(chunks);
        }
        let covered: usize = all.iter().map(|c| c.units.len()).sum();
        assert_eq!(covered, units.len());
        all
    }

    fn markdownish() -> Vec<Element> {
        vec![
            test_element(1, "heading", "Travel Policy", &["Travel Policy"]),
            test_element(
                2,
                "paragraph",
                "Acme Corp pays for travel. Employees of Globex Inc may also claim.  Claims go to Finance within 30 days.",
                &["Travel Policy"],
            ),
            test_element(3, "heading", "Limits", &["Travel Policy", "Limits"]),
            test_element(
                4,
                "list",
                "1. Hotels up to 200 EUR.\n2. Trains in second class.\n3. Flights need approval by Jane Doe.",
                &["Travel Policy", "Limits"],
            ),
            test_element(5, "table", "City | Cap\nParis | 250\nBerlin | 180", &["Travel Policy", "Limits"]),
            test_element(6, "image", "A map of the offices", &["Travel Policy", "Limits"]),
            test_element(7, "heading", "Contacts", &["Contacts"]),
            test_element(8, "paragraph", "Write to Mary Smith at the Help Desk.", &["Contacts"]),
        ]
    }

    #[tokio::test]
    async fn the_offline_answer_passes_the_chunkers_validation() {
        let chunks = chunk_document(&markdownish()).await;
        let ranges: Vec<_> = chunks.iter().map(|c| c.units.clone()).collect();
        // Heading + paragraph (3 sentences); heading + list (UAX #29 ends a sentence after
        // "1." before a capital: 6 units); the table; the image; the contacts section.
        assert_eq!(ranges, vec![0..4, 4..11, 11..12, 12..13, 13..15]);
        assert_eq!(chunks[0].section_path, vec!["Travel Policy"]);
        assert_eq!(chunks[1].section_path, vec!["Travel Policy", "Limits"]);
        assert_eq!(chunks[0].summary.as_deref(), Some("Travel Policy"));
        let names = |c: &answer::Chunk| {
            c.entities
                .iter()
                .map(|e| e.text.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            names(&chunks[0]),
            vec!["Travel Policy", "Acme Corp", "Globex Inc", "Finance"]
        );
        // "Employees" and "Claims" are single words that begin a sentence.
        assert_eq!(chunks[0].relations.len(), 3);
        assert_eq!(chunks[0].relations[0].subject, "e-1");
        assert_eq!(chunks[0].relations[0].object, "e-2");
        assert_eq!(names(&chunks[4]), vec!["Mary Smith", "Help Desk"]);
    }

    #[tokio::test]
    async fn long_documents_get_several_windows_and_bounded_chunks() {
        let mut elements = Vec::new();
        for i in 0..60 {
            elements.push(test_element(
                2 * i + 1,
                "heading",
                &format!("Part {i}"),
                &[&format!("Part {i}")],
            ));
            let body =
                format!("Section {i} of the Handbook explains things.   ").repeat(12 + i % 7);
            elements.push(test_element(
                2 * i + 2,
                "paragraph",
                &body,
                &[&format!("Part {i}")],
            ));
        }
        elements.push(test_element(200, "code", &"long ".repeat(600), &["Tail"]));
        let chunks = chunk_document(&elements).await;
        assert!(chunks.len() > 60, "{}", chunks.len());
    }

    #[tokio::test]
    async fn an_atomic_document_is_answered_with_one_range() {
        let mut elements = vec![
            test_element(1, "heading", "Prices", &["Prices"]),
            test_element(2, "table", "a | b", &["Prices"]),
        ];
        for e in &mut elements {
            e.page_number = Some(1);
        }
        let chunks = chunk_document(&elements).await;
        assert_eq!(chunks.len(), 1);
    }

    #[test]
    fn capitalised_runs_follow_the_rule() {
        // (text, expected runs)
        let cases: Vec<(&str, Vec<(&str, usize)>)> = vec![
            ("", vec![]),
            ("The cat sat.", vec![]),
            (
                "The Big Cat sat with Tom.",
                vec![("The Big Cat", 3), ("Tom", 1)],
            ),
            ("see Tom and Tom, then I and A.", vec![("Tom", 1)]),
            ("Hello. Paris is big. We like Paris", vec![("Paris", 1)]),
            (
                "line\nParis\nin Rome-Italy",
                vec![("Rome", 1), ("Italy", 1)],
            ),
            (
                "an ACME product and McDonald",
                vec![("ACME", 1), ("McDonald", 1)],
            ),
            ("Acme  Corp", vec![("Corp", 1)]),
            ("x Élan Vital", vec![("Élan Vital", 2)]),
        ];
        for (text, want) in cases {
            assert_eq!(capitalised_runs(text, 10), want, "{text}");
        }
        let many = (0..30)
            .map(|i| format!("x Name{i}"))
            .collect::<Vec<_>>()
            .join(" ");
        // Digits end a word: every "Name{i}" is the run "Name", kept once.
        assert_eq!(capitalised_runs(&many, 10), vec![("Name", 1)]);
        let many = [
            "Aa", "Bb", "Cc", "Dd", "Ee", "Ff", "Gg", "Hh", "Ii", "Jj", "Kk", "Ll",
        ]
        .map(|w| format!("x {w}"))
        .join(" ");
        assert_eq!(capitalised_runs(&many, 10).len(), 10);
    }

    #[tokio::test]
    async fn the_other_purposes_answer_from_their_input() {
        let s = ask(
            Purpose::Summary,
            json!({"title": "T", "text": "One fact. Two facts! Three facts."}),
        )
        .await
        .unwrap();
        assert_eq!(s, json!({"summary": "One fact. Two facts!"}));
        let s = ask(Purpose::Summary, json!({"title": "T", "text": " "}))
            .await
            .unwrap();
        assert_eq!(s, json!({"summary": "T"}));
        let long = ask(Purpose::Summary, json!({"text": "a".repeat(500)}))
            .await
            .unwrap();
        assert_eq!(long["summary"].as_str().unwrap().len(), 400);
        let e = ask(Purpose::Entity, json!({"text": "Acme Corp hired Bob."}))
            .await
            .unwrap();
        assert_eq!(
            e,
            json!({"entities": [
                {"text": "Acme Corp", "type": "organization", "confidence": 0.8},
                {"text": "Bob", "type": "term", "confidence": 0.8}]})
        );
        let r = ask(
            Purpose::Relation,
            json!({"entities": ["A", "B", "C"], "text": "A B C"}),
        )
        .await
        .unwrap();
        assert_eq!(
            r,
            json!({"relations": [
                {"subject": "A", "object": "B", "type": "mentions", "confidence": 0.7},
                {"subject": "B", "object": "C", "type": "mentions", "confidence": 0.7}]})
        );
    }

    #[tokio::test]
    async fn unreadable_input_is_rejected() {
        let cases = [
            (Purpose::Chunk, json!({})),
            (Purpose::Chunk, json!({"units": []})),
            (Purpose::Chunk, json!({"units": [{"id": "u"}]})),
            (
                Purpose::Chunk,
                json!({"units": [{"id": "u", "text": "t", "sourceSectionPath": "x"}]}),
            ),
            (Purpose::Summary, json!({"text": 1})),
            (Purpose::Entity, json!(null)),
            (Purpose::Relation, json!({"entities": [1]})),
        ];
        for (purpose, input) in cases {
            match ask(purpose, input.clone()).await {
                Err(ModelError::Rejected(m)) => assert!(m.contains("offline reasoner"), "{m}"),
                other => panic!("{input}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_limits_are_the_chunkers() {
        assert_eq!(RANGE_LIMIT, plan::MAX_CHUNK_GRAPHEMES);
        assert_eq!(
            CHUNK_ENTITIES.min(plan::MAX_ENTITIES_PER_CHUNK),
            CHUNK_ENTITIES
        );
    }

    mod property {
        use super::*;
        use proptest::prelude::*;

        fn element() -> impl Strategy<Value = (String, String, Vec<String>)> {
            (
                prop::sample::select(vec![
                    "heading",
                    "paragraph",
                    "list",
                    "table",
                    "image",
                    "code",
                ]),
                prop::collection::vec(
                    prop::sample::select(vec![
                        "Acme", "Corp", "word", "the", "Paris", ".", "!", " ", "  ", "\n", "é",
                        "漢字", "1.", "e\u{301}", "Ω",
                    ]),
                    0..400,
                ),
                prop::collection::vec(prop::sample::select(vec!["A", "B", " ", ""]), 0..3),
            )
                .prop_map(|(k, words, path)| {
                    (
                        k.to_owned(),
                        words.join(" "),
                        path.into_iter().map(str::to_owned).collect(),
                    )
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
            #[test]
            fn every_offline_answer_is_valid(els in prop::collection::vec(element(), 1..40)) {
                let elements: Vec<Element> = els
                    .iter()
                    .enumerate()
                    .map(|(i, (k, t, p))| {
                        let p: Vec<&str> = p.iter().map(String::as_str).collect();
                        test_element(i + 1, k, t, &p)
                    })
                    .collect();
                let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
                rt.block_on(chunk_document(&elements));
            }
        }
    }
}
