//! The checking half of the platform's LLM semantic chunker: a model's answer for one window is
//! parsed, held to the strict response schema, then validated against the window. Invariant:
//! [`parse`] is pure and returns chunks only when they cover the window's core exactly once, in
//! order, contiguously, never a look-ahead unit, each within [`MAX_CHUNK_GRAPHEMES`] graphemes of
//! canonical text, an isolated (table or image) element alone, with at most
//! [`MAX_ENTITIES_PER_CHUNK`] entities and relations whose every entity text is a substring of
//! its chunk's text and every relation joins two of its chunk's kept entities; any other answer
//! is an [`AnswerError`], and only [`AnswerError::retryable`] ones are worth asking again.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use serde_json::{Map, Value};

use super::plan::{
    common_prefix, graphemes, Unit, Window, ENTITY_TYPES, MAX_CHUNK_GRAPHEMES,
    MAX_ENTITIES_PER_CHUNK, RELATION_TYPES,
};

/// A grounded entity of a chunk.
#[derive(Clone, Debug, PartialEq)]
pub struct Entity {
    /// The response-local id.
    pub id: String,
    /// The trimmed text, a substring of the chunk's text.
    pub text: String,
    /// One of [`ENTITY_TYPES`].
    pub kind: String,
    pub confidence: f64,
    pub canonical_name: Option<String>,
    pub aliases: Vec<String>,
}

/// A relation between two entities of the same chunk.
#[derive(Clone, Debug, PartialEq)]
pub struct Relation {
    /// The subject's entity id.
    pub subject: String,
    /// The object's entity id.
    pub object: String,
    /// One of [`RELATION_TYPES`].
    pub kind: String,
    pub confidence: f64,
}

/// One validated chunk of a window.
#[derive(Clone, Debug, PartialEq)]
pub struct Chunk {
    /// Unit indices, exclusive end.
    pub units: Range<usize>,
    /// The resolved section path (it starts with the units' common section path).
    pub section_path: Vec<String>,
    pub summary: Option<String>,
    pub entities: Vec<Entity>,
    pub relations: Vec<Relation>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AnswerError {
    #[error("LLM semantic chunking provider returned non-JSON output")]
    NotJson,
    #[error("LLM semantic chunking provider returned invalid JSON")]
    InvalidJson,
    #[error("LLM semantic chunking provider returned an invalid response schema: {0}")]
    Schema(String),
    #[error("LLM semantic chunking output is invalid: {0}")]
    Invalid(String),
}

impl AnswerError {
    /// Whether asking the model again may help: the platform retries invalid JSON and schema
    /// errors only.
    pub fn retryable(&self) -> bool {
        matches!(self, AnswerError::InvalidJson | AnswerError::Schema(_))
    }
}

/// Parses a model's answer for window `w` and validates it (see the module's invariant).
/// `canonical` is the document's canonical text and `units` all of its units.
pub fn parse(
    text: &str,
    canonical: &str,
    units: &[Unit],
    w: &Window,
) -> Result<Vec<Chunk>, AnswerError> {
    let value = json(text)?;
    let raw = schema(&value).map_err(AnswerError::Schema)?;
    validate(raw, canonical, units, w).map_err(AnswerError::Invalid)
}

/// `JSON.parse` of the trimmed text, else of the slice from its first `{` to its last `}`.
fn json(text: &str) -> Result<Value, AnswerError> {
    let trimmed = text.trim();
    if let Ok(v) = serde_json::from_str(trimmed) {
        return Ok(v);
    }
    let (Some(a), Some(b)) = (trimmed.find('{'), trimmed.rfind('}')) else {
        return Err(AnswerError::NotJson);
    };
    if b < a {
        return Err(AnswerError::NotJson);
    }
    serde_json::from_str(&trimmed[a..=b]).map_err(|_| AnswerError::InvalidJson)
}

// ----------------------------------------------------------------------------------------------
// The strict schema.
// ----------------------------------------------------------------------------------------------

struct RawChunk {
    start: String,
    end: String,
    section_path: Option<Vec<String>>,
    summary: Option<String>,
    entities: Vec<Entity>,
    relations: Vec<Relation>,
}

/// The string's length as JavaScript counts it (UTF-16 code units).
fn js_len(s: &str) -> usize {
    s.encode_utf16().count()
}

fn object<'a>(
    v: &'a Value,
    at: &str,
    required: &[&str],
    optional: &[&str],
) -> Result<&'a Map<String, Value>, String> {
    let Value::Object(map) = v else {
        return Err(format!("{at}: expected an object"));
    };
    if let Some(k) = map
        .keys()
        .find(|k| !required.contains(&k.as_str()) && !optional.contains(&k.as_str()))
    {
        return Err(format!("{at}: unknown key {k:?}"));
    }
    if let Some(k) = required.iter().find(|k| !map.contains_key(**k)) {
        return Err(format!("{at}.{k}: required"));
    }
    Ok(map)
}

fn string(v: &Value, at: &str, min: usize, max: usize) -> Result<String, String> {
    let Value::String(s) = v else {
        return Err(format!("{at}: expected a string"));
    };
    let n = js_len(s);
    if n < min || n > max {
        return Err(format!("{at}: length must be {min}..{max}"));
    }
    Ok(s.clone())
}

/// A string trimmed first, then held to the lengths (zod's `.trim().min().max()`).
fn trimmed_string(v: &Value, at: &str, min: usize, max: usize) -> Result<String, String> {
    let s = string(v, at, 0, usize::MAX)?;
    string(&Value::String(s.trim().to_owned()), at, min, max)
}

fn array<'a>(v: &'a Value, at: &str, min: usize, max: usize) -> Result<&'a Vec<Value>, String> {
    let Value::Array(items) = v else {
        return Err(format!("{at}: expected an array"));
    };
    if items.len() < min || items.len() > max {
        return Err(format!("{at}: must have {min}..{max} items"));
    }
    Ok(items)
}

fn confidence(v: &Value, at: &str) -> Result<f64, String> {
    match v.as_f64() {
        Some(c) if (0.0..=1.0).contains(&c) => Ok(c),
        Some(_) => Err(format!("{at}: must be between 0 and 1")),
        None => Err(format!("{at}: expected a number")),
    }
}

fn one_of(v: &Value, at: &str, allowed: &[&str]) -> Result<String, String> {
    match v.as_str() {
        Some(s) if allowed.contains(&s) => Ok(s.to_owned()),
        _ => Err(format!("{at}: must be one of {}", allowed.join(", "))),
    }
}

fn schema(v: &Value) -> Result<Vec<RawChunk>, String> {
    let root = object(v, "$", &["chunks"], &[])?;
    let mut out = Vec::new();
    for (i, c) in array(&root["chunks"], "chunks", 0, usize::MAX)?
        .iter()
        .enumerate()
    {
        let at = format!("chunks[{i}]");
        let c = object(
            c,
            &at,
            &["startUnitId", "endUnitId", "entities", "relations"],
            &["sectionPath", "sectionSummary"],
        )?;
        let start = string(
            &c["startUnitId"],
            &format!("{at}.startUnitId"),
            1,
            usize::MAX,
        )?;
        let end = string(&c["endUnitId"], &format!("{at}.endUnitId"), 1, usize::MAX)?;
        let section_path = match c.get("sectionPath") {
            None => None,
            Some(p) => {
                let p_at = format!("{at}.sectionPath");
                Some(
                    array(p, &p_at, 1, 8)?
                        .iter()
                        .enumerate()
                        .map(|(j, s)| trimmed_string(s, &format!("{p_at}[{j}]"), 1, 160))
                        .collect::<Result<Vec<_>, _>>()?,
                )
            }
        };
        let summary = c
            .get("sectionSummary")
            .map(|s| trimmed_string(s, &format!("{at}.sectionSummary"), 1, 2000))
            .transpose()?;
        let mut entities = Vec::new();
        for (j, e) in array(&c["entities"], &format!("{at}.entities"), 0, usize::MAX)?
            .iter()
            .enumerate()
        {
            let at = format!("{at}.entities[{j}]");
            let e = object(
                e,
                &at,
                &["id", "text", "type", "confidence"],
                &["canonicalName", "aliases"],
            )?;
            entities.push(Entity {
                id: string(&e["id"], &format!("{at}.id"), 1, 128)?,
                text: string(&e["text"], &format!("{at}.text"), 1, usize::MAX)?,
                kind: one_of(&e["type"], &format!("{at}.type"), &ENTITY_TYPES)?,
                confidence: confidence(&e["confidence"], &format!("{at}.confidence"))?,
                canonical_name: e
                    .get("canonicalName")
                    .map(|s| string(s, &format!("{at}.canonicalName"), 0, usize::MAX))
                    .transpose()?,
                aliases: match e.get("aliases") {
                    None => Vec::new(),
                    Some(a) => array(a, &format!("{at}.aliases"), 0, 12)?
                        .iter()
                        .enumerate()
                        .map(|(k, s)| string(s, &format!("{at}.aliases[{k}]"), 0, usize::MAX))
                        .collect::<Result<_, _>>()?,
                },
            });
        }
        let mut relations = Vec::new();
        for (j, r) in array(&c["relations"], &format!("{at}.relations"), 0, usize::MAX)?
            .iter()
            .enumerate()
        {
            let at = format!("{at}.relations[{j}]");
            let r = object(
                r,
                &at,
                &["subjectEntityId", "objectEntityId", "type", "confidence"],
                &[],
            )?;
            relations.push(Relation {
                subject: string(
                    &r["subjectEntityId"],
                    &format!("{at}.subjectEntityId"),
                    1,
                    128,
                )?,
                object: string(
                    &r["objectEntityId"],
                    &format!("{at}.objectEntityId"),
                    1,
                    128,
                )?,
                kind: one_of(&r["type"], &format!("{at}.type"), &RELATION_TYPES)?,
                confidence: confidence(&r["confidence"], &format!("{at}.confidence"))?,
            });
        }
        out.push(RawChunk {
            start,
            end,
            section_path,
            summary,
            entities,
            relations,
        });
    }
    Ok(out)
}

// ----------------------------------------------------------------------------------------------
// Validation against the window.
// ----------------------------------------------------------------------------------------------

fn validate(
    raw: Vec<RawChunk>,
    canonical: &str,
    units: &[Unit],
    w: &Window,
) -> Result<Vec<Chunk>, String> {
    if raw.is_empty() {
        return Err(format!("{} returned no chunks", w.id));
    }
    if w.atomic && raw.len() != 1 {
        return Err(format!(
            "{} is an atomic document and must return exactly one chunk, not {}",
            w.id,
            raw.len()
        ));
    }
    // The units a window's answer may name: its core and its look-ahead.
    let known: HashMap<&str, usize> = (w.core.start..w.look_ahead.end.max(w.core.end))
        .map(|i| (units[i].id.as_str(), i))
        .collect();
    let index = |id: &str| {
        known
            .get(id)
            .copied()
            .ok_or_else(|| format!("{} returned unknown unit id {id:?}", w.id))
    };
    let mut expected = w.core.start;
    let mut out = Vec::with_capacity(raw.len());
    for (n, c) in raw.into_iter().enumerate() {
        let (s, e) = (index(&c.start)?, index(&c.end)?);
        if s != expected || e < s {
            return Err(format!(
                "{} chunk {n} ({}..{}) is not contiguous: it must start at {}",
                w.id,
                c.start,
                c.end,
                units[expected.min(units.len() - 1)].id
            ));
        }
        if e >= w.core.end {
            return Err(format!(
                "{} chunk {n} ends at {} beyond the fixed core, which ends at {}",
                w.id,
                c.end,
                units[w.core.end - 1].id
            ));
        }
        let members = &units[s..=e];
        let text = &canonical[units[s].start..units[e].end];
        let size = graphemes(text);
        if size > MAX_CHUNK_GRAPHEMES {
            return Err(format!(
                "{} chunk {n} has {size} graphemes, more than {MAX_CHUNK_GRAPHEMES}",
                w.id
            ));
        }
        if !w.atomic
            && members.iter().any(|u| u.isolated)
            && members.iter().any(|u| u.element != members[0].element)
        {
            return Err(format!(
                "{} chunk {n} mixes an isolated table or image element with other elements",
                w.id
            ));
        }
        if c.entities.len() > MAX_ENTITIES_PER_CHUNK || c.relations.len() > MAX_ENTITIES_PER_CHUNK {
            return Err(format!(
                "{} chunk {n} has more than {MAX_ENTITIES_PER_CHUNK} entities or relations",
                w.id
            ));
        }
        let mut declared = HashSet::new();
        for ent in &c.entities {
            if !declared.insert(ent.id.as_str()) {
                return Err(format!("{} chunk {n} repeats entity id {:?}", w.id, ent.id));
            }
        }
        if let Some(r) = c.relations.iter().find(|r| {
            !declared.contains(r.subject.as_str()) || !declared.contains(r.object.as_str())
        }) {
            return Err(format!(
                "{} chunk {n} has a relation between undeclared entity ids {:?} and {:?}",
                w.id, r.subject, r.object
            ));
        }
        // Lenient: ungrounded entities (and their relations) are dropped.
        let mut dropped = HashSet::new();
        let entities: Vec<Entity> = c
            .entities
            .into_iter()
            .filter_map(|mut ent| {
                let t = ent.text.trim();
                if t.is_empty() || !text.contains(t) {
                    dropped.insert(ent.id);
                    return None;
                }
                ent.text = t.to_owned();
                Some(ent)
            })
            .collect();
        let relations = c
            .relations
            .into_iter()
            .filter(|r| !dropped.contains(&r.subject) && !dropped.contains(&r.object))
            .collect();
        // Lenient: a section path must keep the units' trusted common prefix.
        let trusted = common_prefix(members.iter().map(|u| &u.section_path));
        let section_path = match c.section_path {
            Some(p) if p.starts_with(&trusted) => p,
            _ => trusted,
        };
        out.push(Chunk {
            units: s..e + 1,
            section_path,
            summary: c.summary,
            entities,
            relations,
        });
        expected = e + 1;
    }
    if expected != w.core.end {
        return Err(format!(
            "{} did not cover its core: the last chunk must end at {}",
            w.id,
            units[w.core.end - 1].id
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::plan::{canonical_text, units as plan_units, windows};
    use super::*;
    use crate::jobs::compile::artifact::{test_element, Element};
    use serde_json::json;

    /// A heading, 3 sentences and a code element in the core of window 0 (units 0..5), the image
    /// (unit 5) its look-ahead.
    fn doc() -> (String, Vec<Unit>, Window) {
        let elements: Vec<Element> = vec![
            test_element(1, "heading", "Policy", &["Policy"]),
            test_element(
                2,
                "paragraph",
                "Acme Corp sets Policy A. It applies to staff. Bob signs it.",
                &["Policy", "Scope"],
            ),
            test_element(3, "code", "x = 1", &["Policy"]),
            test_element(4, "image", "A chart", &["Policy"]),
        ];
        let canonical = canonical_text(&elements);
        let us = plan_units(&elements);
        let mut w = windows(&canonical, &us).unwrap().remove(0);
        // Make the image a look-ahead unit to exercise the fixed core.
        assert_eq!(w.core, 0..us.len());
        w.core = 0..5;
        w.look_ahead = 5..6;
        (canonical, us, w)
    }

    fn chunk(start: &str, end: &str) -> Value {
        json!({"startUnitId": start, "endUnitId": end, "entities": [], "relations": []})
    }

    fn answer(chunks: Vec<Value>) -> String {
        json!({ "chunks": chunks }).to_string()
    }

    const U0: &str = "u-000000-000000";
    const U1: &str = "u-000001-000000";
    const U2: &str = "u-000001-000001";
    const U3: &str = "u-000001-000002";
    const U4: &str = "u-000002-000000";
    const U5: &str = "u-000003-000000";

    #[test]
    fn a_valid_answer_gives_chunks_covering_the_core() {
        let (canonical, us, w) = doc();
        let text = answer(vec![
            json!({"startUnitId": U0, "endUnitId": U3, "sectionPath": [" Policy ", "Acme"],
                   "sectionSummary": " Acme's policy. ",
                   "entities": [
                       {"id": "e-1", "text": " Acme Corp", "type": "organization", "confidence": 0.9,
                        "canonicalName": "Acme Corporation", "aliases": ["Acme"]},
                       {"id": "e-2", "text": "Policy A", "type": "policy", "confidence": 1},
                       {"id": "e-3", "text": "Globex", "type": "organization", "confidence": 0.5}],
                   "relations": [
                       {"subjectEntityId": "e-1", "objectEntityId": "e-2", "type": "defines", "confidence": 0.8},
                       {"subjectEntityId": "e-3", "objectEntityId": "e-2", "type": "mentions", "confidence": 0.8}]}),
            chunk(U4, U4),
        ]);
        let got = parse(
            &format!("Here you go:\n```json\n{text}\n```"),
            &canonical,
            &us,
            &w,
        )
        .unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].units.clone(), got[1].units.clone()), (0..4, 4..5));
        assert_eq!(got[0].section_path, vec!["Policy", "Acme"]);
        assert_eq!(got[0].summary.as_deref(), Some("Acme's policy."));
        // "Globex" is not in the text: dropped with its relation.
        assert_eq!(
            got[0]
                .entities
                .iter()
                .map(|e| e.text.as_str())
                .collect::<Vec<_>>(),
            vec!["Acme Corp", "Policy A"]
        );
        assert_eq!(
            got[0].entities[0].canonical_name.as_deref(),
            Some("Acme Corporation")
        );
        assert_eq!(got[0].entities[0].aliases, vec!["Acme"]);
        assert_eq!(
            got[0].relations,
            vec![Relation {
                subject: "e-1".into(),
                object: "e-2".into(),
                kind: "defines".into(),
                confidence: 0.8
            }]
        );
        // No section path: the trusted prefix.
        assert_eq!(got[1].section_path, vec!["Policy"]);
        assert_eq!(got[1].summary, None);
    }

    #[test]
    fn a_section_path_off_the_trusted_prefix_is_replaced() {
        let (canonical, us, w) = doc();
        let text = answer(vec![
            json!({"startUnitId": U0, "endUnitId": U0, "sectionPath": ["Other"],
                   "entities": [], "relations": []}),
            json!({"startUnitId": U1, "endUnitId": U3, "sectionPath": ["Policy"],
                   "entities": [], "relations": []}),
            chunk(U4, U4),
        ]);
        let got = parse(&text, &canonical, &us, &w).unwrap();
        assert_eq!(got[0].section_path, vec!["Policy"]);
        assert_eq!(got[1].section_path, vec!["Policy", "Scope"]);
    }

    #[test]
    fn broken_json_is_told_apart() {
        let (canonical, us, w) = doc();
        // (answer, error)
        let cases = [
            ("", AnswerError::NotJson),
            ("no json here", AnswerError::NotJson),
            ("} backwards {", AnswerError::NotJson),
            ("{\"chunks\": [}", AnswerError::InvalidJson),
            ("text {\"chunks\": [} end", AnswerError::InvalidJson),
        ];
        for (text, want) in cases {
            assert_eq!(
                parse(text, &canonical, &us, &w).unwrap_err(),
                want,
                "{text}"
            );
        }
        assert!(!AnswerError::NotJson.retryable());
        assert!(AnswerError::InvalidJson.retryable());
        assert!(AnswerError::Schema(String::new()).retryable());
        assert!(!AnswerError::Invalid(String::new()).retryable());
        assert_eq!(
            AnswerError::InvalidJson.to_string(),
            "LLM semantic chunking provider returned invalid JSON"
        );
    }

    #[test]
    fn schema_violations_are_schema_errors() {
        let (canonical, us, w) = doc();
        let ok_entity = json!({"id": "e-1", "text": "Acme", "type": "term", "confidence": 0.5});
        let with = |f: &dyn Fn(&mut Value)| {
            let mut c = json!({"startUnitId": U0, "endUnitId": U4, "entities": [ok_entity.clone()],
                               "relations": [{"subjectEntityId": "e-1", "objectEntityId": "e-1",
                                              "type": "mentions", "confidence": 0.5}]});
            f(&mut c);
            answer(vec![c])
        };
        // (answer, a fragment of the message)
        let cases: Vec<(String, &str)> = vec![
            (json!([]).to_string(), "$: expected an object"),
            (
                json!({"chunks": [], "extra": 1}).to_string(),
                "unknown key \"extra\"",
            ),
            (json!({}).to_string(), "chunks: required"),
            (with(&|c| c["extra"] = json!(1)), "chunks[0]: unknown key"),
            (
                with(&|c| c["startUnitId"] = json!("")),
                "startUnitId: length",
            ),
            (
                with(&|c| c["endUnitId"] = json!(3)),
                "endUnitId: expected a string",
            ),
            (
                with(&|c| {
                    c.as_object_mut().unwrap().remove("relations");
                }),
                "relations: required",
            ),
            (
                with(&|c| c["sectionPath"] = json!([])),
                "sectionPath: must have 1..8",
            ),
            (
                with(&|c| c["sectionPath"] = json!(vec!["a"; 9])),
                "sectionPath: must have 1..8",
            ),
            (
                with(&|c| c["sectionPath"] = json!(["  "])),
                "sectionPath[0]: length",
            ),
            (
                with(&|c| c["sectionPath"] = json!(["x".repeat(161)])),
                "sectionPath[0]: length",
            ),
            (
                with(&|c| c["sectionPath"] = Value::Null),
                "sectionPath: expected an array",
            ),
            (
                with(&|c| c["sectionSummary"] = json!(" ")),
                "sectionSummary: length",
            ),
            (
                with(&|c| c["entities"][0]["type"] = json!("thing")),
                "entities[0].type: must be one of",
            ),
            (
                with(&|c| c["entities"][0]["confidence"] = json!(1.5)),
                "between 0 and 1",
            ),
            (
                with(&|c| c["entities"][0]["id"] = json!("x".repeat(129))),
                "entities[0].id: length",
            ),
            (
                with(&|c| c["entities"][0]["text"] = json!("")),
                "entities[0].text: length",
            ),
            (
                with(&|c| c["entities"][0]["aliases"] = json!(vec!["a"; 13])),
                "aliases: must have 0..12",
            ),
            (
                with(&|c| c["entities"][0]["bogus"] = json!(1)),
                "unknown key \"bogus\"",
            ),
            (
                with(&|c| c["relations"][0]["type"] = json!("likes")),
                "relations[0].type",
            ),
            (
                with(&|c| c["relations"][0]["subjectEntityId"] = json!("")),
                "subjectEntityId: length",
            ),
        ];
        for (text, fragment) in cases {
            match parse(&text, &canonical, &us, &w) {
                Err(AnswerError::Schema(m)) => assert!(m.contains(fragment), "{m} !~ {fragment}"),
                other => panic!("{text}: {other:?}"),
            }
        }
        // The base answer itself is valid.
        assert!(parse(&with(&|_| {}), &canonical, &us, &w).is_ok());
    }

    #[test]
    fn answers_that_do_not_fit_the_window_are_invalid() {
        let (canonical, us, w) = doc();
        let e = |n: usize| {
            let ents: Vec<Value> = (0..n)
                .map(|i| json!({"id": format!("e-{i}"), "text": "Acme", "type": "term", "confidence": 0.5}))
                .collect();
            ents
        };
        // (chunks, a fragment of the message)
        let cases: Vec<(Vec<Value>, &str)> = vec![
            (vec![], "returned no chunks"),
            (vec![chunk("u-9", U4)], "unknown unit id"),
            (vec![chunk(U0, U0), chunk(U2, U4)], "not contiguous"),
            (vec![chunk(U1, U4)], "not contiguous"),
            (vec![chunk(U0, U2), chunk(U2, U4)], "not contiguous"),
            (vec![chunk(U2, U1)], "not contiguous"),
            (vec![chunk(U0, U5)], "beyond the fixed core"),
            (vec![chunk(U0, U3)], "did not cover its core"),
            (
                vec![
                    json!({"startUnitId": U0, "endUnitId": U4, "entities": e(101), "relations": []}),
                ],
                "more than 100",
            ),
            (
                vec![
                    json!({"startUnitId": U0, "endUnitId": U4, "entities": [e(1)[0].clone(), e(1)[0].clone()], "relations": []}),
                ],
                "repeats entity id",
            ),
            (
                vec![
                    json!({"startUnitId": U0, "endUnitId": U4, "entities": e(1), "relations": [
                    {"subjectEntityId": "e-0", "objectEntityId": "Acme", "type": "mentions", "confidence": 0.5}]}),
                ],
                "undeclared entity ids",
            ),
        ];
        for (chunks, fragment) in cases {
            match parse(&answer(chunks.clone()), &canonical, &us, &w) {
                Err(AnswerError::Invalid(m)) => assert!(m.contains(fragment), "{m} !~ {fragment}"),
                other => panic!("{chunks:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn isolated_elements_and_long_chunks_are_refused() {
        let elements = vec![
            test_element(1, "paragraph", &"word ".repeat(200), &[]),
            test_element(2, "paragraph", &"more ".repeat(100), &[]),
            test_element(3, "table", "a | b", &[]),
        ];
        let canonical = canonical_text(&elements);
        let us = plan_units(&elements);
        let w = windows(&canonical, &us).unwrap().remove(0);
        assert_eq!((w.core.clone(), w.atomic), (0..3, false));
        let ids: Vec<&str> = us.iter().map(|u| u.id.as_str()).collect();
        let text = answer(vec![chunk(ids[0], ids[1]), chunk(ids[2], ids[2])]);
        match parse(&text, &canonical, &us, &w) {
            Err(AnswerError::Invalid(m)) => assert!(m.contains("1499 graphemes"), "{m}"),
            other => panic!("{other:?}"),
        }
        let text = answer(vec![chunk(ids[0], ids[0]), chunk(ids[1], ids[2])]);
        match parse(&text, &canonical, &us, &w) {
            Err(AnswerError::Invalid(m)) => assert!(m.contains("isolated"), "{m}"),
            other => panic!("{other:?}"),
        }
        let text = answer(vec![
            chunk(ids[0], ids[0]),
            chunk(ids[1], ids[1]),
            chunk(ids[2], ids[2]),
        ]);
        assert_eq!(parse(&text, &canonical, &us, &w).unwrap().len(), 3);
    }

    #[test]
    fn an_atomic_document_is_one_chunk() {
        let mut elements = vec![
            test_element(1, "heading", "Prices", &["Prices"]),
            test_element(2, "table", "a | b", &["Prices"]),
        ];
        for e in &mut elements {
            e.page_number = Some(3);
        }
        let canonical = canonical_text(&elements);
        let us = plan_units(&elements);
        let w = windows(&canonical, &us).unwrap().remove(0);
        assert!(w.atomic);
        let ids: Vec<&str> = us.iter().map(|u| u.id.as_str()).collect();
        let two = answer(vec![chunk(ids[0], ids[0]), chunk(ids[1], ids[1])]);
        match parse(&two, &canonical, &us, &w) {
            Err(AnswerError::Invalid(m)) => assert!(m.contains("exactly one chunk"), "{m}"),
            other => panic!("{other:?}"),
        }
        // Mixing the table with the heading is what an atomic document asks for.
        let one = answer(vec![chunk(ids[0], ids[1])]);
        assert_eq!(parse(&one, &canonical, &us, &w).unwrap()[0].units, 0..2);
    }
}
