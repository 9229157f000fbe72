//! Planning and analysis as pure functions: the research mode's sub-queries (the whole question,
//! then its clauses) and the ranking of what they found. Invariant: the same question and mode
//! always give the same plan, and the same evidence always ranks the same way (ties broken by
//! node id), so a replayed step writes exactly what the first run wrote.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Words that carry no meaning for retrieval.
const STOPWORDS: &[&str] = &[
    "a", "about", "after", "all", "also", "am", "an", "and", "any", "are", "as", "at", "be",
    "because", "been", "before", "being", "between", "both", "but", "by", "can", "could", "did",
    "do", "does", "doing", "during", "each", "else", "for", "from", "had", "has", "have", "having",
    "he", "her", "here", "him", "his", "how", "i", "if", "in", "into", "is", "it", "its", "just",
    "me", "more", "most", "my", "no", "nor", "not", "of", "off", "on", "once", "only", "or",
    "other", "our", "out", "over", "own", "same", "she", "should", "so", "some", "such", "than",
    "that", "the", "their", "them", "then", "there", "these", "they", "this", "those", "through",
    "to", "too", "under", "until", "up", "us", "very", "vs", "versus", "was", "we", "were", "what",
    "when", "where", "which", "while", "who", "whom", "why", "will", "with", "would", "you",
    "your", "tell", "explain", "describe", "please", "compare",
];

/// Most terms one sub-query searches for.
pub const MAX_TERMS: usize = 16;

/// One search the retrieving stage runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubQuery {
    pub text: String,
    pub terms: Vec<String>,
}

impl SubQuery {
    /// The search text of the full-text leg (`plainto_tsquery('simple', …)` of its normalised
    /// form): the meaningful terms, each of which a passage must contain. Terms hold only letters
    /// and digits, so the question cannot inject search syntax.
    pub fn search_text(&self) -> String {
        self.terms.join(" ")
    }
}

/// The stored plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Plan {
    pub sub_queries: Vec<SubQuery>,
}

/// How many sub-queries a mode plans at most (`auto` only for rows of older writers).
pub fn max_sub_queries(mode: &str) -> usize {
    match mode {
        "fast" => 1,
        "research" => 6,
        "deep" => 8,
        _ => 4,
    }
}

/// The meaningful words of a text: lower-cased runs of letters and digits, stopwords and
/// one-letter words dropped, each once, in order of appearance.
pub fn terms(text: &str) -> Vec<String> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for word in text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
    {
        let w = word.to_lowercase();
        if w.chars().count() < 2 && !w.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if STOPWORDS.contains(&w.as_str()) {
            continue;
        }
        if seen.insert(w.clone()) {
            out.push(w);
        }
        if out.len() == MAX_TERMS {
            break;
        }
    }
    out
}

fn normalize(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The clauses of a question: sentences (split at `?`, `!`, `;`, line breaks and `. `), then
/// each sentence split at ` and `, ` or `, ` versus `, ` vs ` and `, also ` when both sides keep
/// a meaningful word.
pub fn clauses(question: &str) -> Vec<String> {
    let mut sentences = Vec::new();
    let mut current = String::new();
    let chars: Vec<char> = question.chars().collect();
    for (i, &c) in chars.iter().enumerate() {
        let sentence_end = matches!(c, '?' | '!' | ';' | '\n' | '\r')
            || (c == '.' && chars.get(i + 1).is_none_or(|n| n.is_whitespace()));
        if sentence_end {
            sentences.push(std::mem::take(&mut current));
        } else {
            current.push(c);
        }
    }
    sentences.push(current);

    let mut out = Vec::new();
    for sentence in sentences
        .iter()
        .map(|s| normalize(s))
        .filter(|s| !s.is_empty())
    {
        let mut parts = vec![sentence];
        for sep in [
            ", and also ",
            ", and ",
            " and also ",
            " and ",
            " or ",
            " versus ",
            " vs. ",
            " vs ",
        ] {
            let mut next = Vec::new();
            for part in parts {
                let lower = part.to_lowercase();
                let pieces = split_keeping_case(&part, &lower, sep);
                if pieces.len() > 1 && pieces.iter().all(|p| !terms(p).is_empty()) {
                    next.extend(pieces);
                } else {
                    next.push(part);
                }
            }
            parts = next;
        }
        out.extend(
            parts
                .into_iter()
                .map(|p| normalize(p.trim_matches(|c: char| c == ',' || c.is_whitespace())))
                .filter(|p| !p.is_empty()),
        );
    }
    out
}

/// Splits `original` where `lower` (its lower-cased form) contains `sep`. Lower-casing can change
/// byte lengths outside ASCII; then the text is not split.
fn split_keeping_case(original: &str, lower: &str, sep: &str) -> Vec<String> {
    if original.len() != lower.len() {
        return vec![original.to_owned()];
    }
    let mut pieces = Vec::new();
    let mut start = 0;
    for (idx, _) in lower.match_indices(sep) {
        if idx < start {
            continue;
        }
        pieces.push(original[start..idx].to_owned());
        start = idx + sep.len();
    }
    pieces.push(original[start..].to_owned());
    pieces
}

/// Splits a question into sub-queries: the whole question first, then each clause that adds a
/// different set of terms, at most `max` in all. A question without a meaningful word plans
/// nothing (retrieval then finds nothing, and the answer says so).
pub fn plan(question: &str, max: usize) -> Plan {
    let mut sub_queries: Vec<SubQuery> = Vec::new();
    let mut seen: BTreeSet<Vec<String>> = BTreeSet::new();
    let whole = normalize(question);
    let candidates = std::iter::once(whole).chain(clauses(question));
    for text in candidates {
        if sub_queries.len() >= max {
            break;
        }
        let t = terms(&text);
        if t.is_empty() {
            continue;
        }
        let mut key = t.clone();
        key.sort();
        if seen.insert(key) {
            sub_queries.push(SubQuery { text, terms: t });
        }
    }
    Plan { sub_queries }
}

/// One search hit, as retrieved (after fusing the retrieval legs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hit {
    pub node_id: Uuid,
    pub document_id: Uuid,
    pub document_version: i32,
    pub filename: String,
    /// The node's `sectionPath`.
    pub heading_path: serde_json::Value,
    pub content: String,
    /// The fused (reciprocal rank) score.
    pub rank: f64,
    #[serde(default)]
    pub artifact_hash: String,
    #[serde(default)]
    pub start_offset: i32,
    #[serde(default)]
    pub end_offset: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_number: Option<i64>,
    /// The projections that found it.
    #[serde(default)]
    pub projection_ids: Vec<Uuid>,
    /// The legs that found it: `dense`, `fts`.
    #[serde(default)]
    pub sources: Vec<String>,
}

/// The evidence of one sub-query: one partial result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Bundle {
    pub sub_query_index: usize,
    pub sub_query: SubQuery,
    pub hits: Vec<Hit>,
}

/// Ranked, de-duplicated evidence.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Evidence {
    pub node_id: Uuid,
    pub document_id: Uuid,
    pub document_version: i32,
    pub filename: String,
    pub heading_path: serde_json::Value,
    pub content: String,
    pub score: f64,
    /// The sub-queries (by index) that found it.
    pub sub_queries: Vec<usize>,
    #[serde(default)]
    pub artifact_hash: String,
    #[serde(default)]
    pub start_offset: i32,
    #[serde(default)]
    pub end_offset: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_number: Option<i64>,
    #[serde(default)]
    pub projection_ids: Vec<Uuid>,
    #[serde(default)]
    pub sources: Vec<String>,
}

fn content_key(content: &str) -> String {
    normalize(&content.to_lowercase())
}

/// Ranks evidence: one entry per node (score = the sum of its ranks over the sub-queries that
/// found it, so nodes that answer several parts rise), then one entry per distinct content
/// (the copy with the higher score stays, and inherits the other's sub-queries), best first,
/// ties by node id, at most `top_k`.
pub fn rank(bundles: &[Bundle], top_k: usize) -> Vec<Evidence> {
    let mut by_node: BTreeMap<Uuid, Evidence> = BTreeMap::new();
    for b in bundles {
        for h in &b.hits {
            let e = by_node.entry(h.node_id).or_insert_with(|| Evidence {
                node_id: h.node_id,
                document_id: h.document_id,
                document_version: h.document_version,
                filename: h.filename.clone(),
                heading_path: h.heading_path.clone(),
                content: h.content.clone(),
                score: 0.0,
                sub_queries: Vec::new(),
                artifact_hash: h.artifact_hash.clone(),
                start_offset: h.start_offset,
                end_offset: h.end_offset,
                page_number: h.page_number,
                projection_ids: Vec::new(),
                sources: Vec::new(),
            });
            for p in &h.projection_ids {
                if !e.projection_ids.contains(p) {
                    e.projection_ids.push(*p);
                }
            }
            for s in &h.sources {
                if !e.sources.contains(s) {
                    e.sources.push(s.clone());
                }
            }
            if !e.sub_queries.contains(&b.sub_query_index) {
                e.sub_queries.push(b.sub_query_index);
                e.score += h.rank.max(0.0);
            }
        }
    }
    let mut all: Vec<Evidence> = by_node.into_values().collect();
    sort(&mut all);
    let mut kept: Vec<Evidence> = Vec::new();
    let mut index_of: BTreeMap<String, usize> = BTreeMap::new();
    for e in all {
        match index_of.get(&content_key(&e.content)) {
            Some(&i) => {
                for q in e.sub_queries {
                    if !kept[i].sub_queries.contains(&q) {
                        kept[i].sub_queries.push(q);
                    }
                }
            }
            None => {
                index_of.insert(content_key(&e.content), kept.len());
                kept.push(e);
            }
        }
    }
    for e in &mut kept {
        e.sub_queries.sort_unstable();
        e.projection_ids.sort_unstable();
        e.sources.sort();
    }
    kept.truncate(top_k);
    kept
}

fn sort(v: &mut [Evidence]) {
    v.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then_with(|| a.node_id.cmp(&b.node_id))
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(p: &Plan) -> Vec<&str> {
        p.sub_queries.iter().map(|q| q.text.as_str()).collect()
    }

    #[test]
    fn terms_drop_stopwords_and_repeats() {
        assert_eq!(
            terms("What is the lease TTL, and is the lease renewed?"),
            vec!["lease", "ttl", "renewed"]
        );
        assert_eq!(terms("What is it?"), Vec::<String>::new());
        assert_eq!(terms("Version 2 of x"), vec!["version", "2"]);
        assert_eq!(
            terms("Qu'est-ce que Ünïcode"),
            vec!["qu", "est", "ce", "que", "ünïcode"]
        );
    }

    #[test]
    fn planning_table() {
        let table: Vec<(&str, usize, Vec<&str>)> = vec![
            ("How does fencing work?", 4, vec!["How does fencing work?"]),
            (
                "What is the lease TTL and how does fencing work?",
                4,
                vec![
                    "What is the lease TTL and how does fencing work?",
                    "What is the lease TTL",
                    "how does fencing work",
                ],
            ),
            (
                "Compare retries versus dead letters; what happens on poison?",
                4,
                vec![
                    "Compare retries versus dead letters; what happens on poison?",
                    "Compare retries",
                    "dead letters",
                    "what happens on poison",
                ],
            ),
            (
                "What is the lease TTL and how does fencing work?",
                1,
                vec!["What is the lease TTL and how does fencing work?"],
            ),
            // "and" between words that carry no meaning does not split.
            (
                "Salt and pepper",
                4,
                vec!["Salt and pepper", "Salt", "pepper"],
            ),
            ("What is this and that?", 4, vec![]),
            ("   ", 4, vec![]),
            (
                "Explain v1.2 upgrades. Then rollback!",
                4,
                vec![
                    "Explain v1.2 upgrades. Then rollback!",
                    "Explain v1.2 upgrades",
                    "Then rollback",
                ],
            ),
        ];
        for (question, max, want) in table {
            let p = plan(question, max);
            assert_eq!(texts(&p), want, "{question:?} (max {max})");
            assert_eq!(p, plan(question, max), "deterministic");
            assert!(p.sub_queries.iter().all(|q| !q.terms.is_empty()));
        }
    }

    #[test]
    fn search_text_is_the_terms() {
        let p = plan("Lease TTL -- \"quoted\" OR tricks & !x", 4);
        assert_eq!(p.sub_queries[0].search_text(), "lease ttl quoted tricks");
    }

    #[test]
    fn modes_bound_the_plan() {
        assert_eq!(max_sub_queries("fast"), 1);
        assert_eq!(max_sub_queries("auto"), 4);
        assert_eq!(max_sub_queries("research"), 6);
        assert_eq!(max_sub_queries("deep"), 8);
    }

    fn hit(node: u128, content: &str, rank: f64) -> Hit {
        Hit {
            node_id: Uuid::from_u128(node),
            document_id: Uuid::from_u128(100 + node),
            document_version: 1,
            filename: format!("doc{node}.md"),
            heading_path: serde_json::json!([]),
            content: content.into(),
            rank,
            artifact_hash: "h".into(),
            start_offset: 0,
            end_offset: 1,
            page_number: None,
            projection_ids: vec![Uuid::from_u128(1000 + node)],
            sources: vec!["fts".into()],
        }
    }

    fn bundle(i: usize, hits: Vec<Hit>) -> Bundle {
        Bundle {
            sub_query_index: i,
            sub_query: SubQuery {
                text: format!("q{i}"),
                terms: vec![format!("q{i}")],
            },
            hits,
        }
    }

    #[test]
    fn ranking_table() {
        let ids = |v: &[Evidence]| v.iter().map(|e| e.node_id.as_u128()).collect::<Vec<_>>();
        // Found by two sub-queries beats a single better hit.
        let r = rank(
            &[
                bundle(0, vec![hit(1, "alpha", 0.5), hit(2, "beta", 0.4)]),
                bundle(1, vec![hit(2, "beta", 0.3)]),
            ],
            10,
        );
        assert_eq!(ids(&r), vec![2, 1]);
        assert!((r[0].score - 0.7).abs() < 1e-9);
        assert_eq!(r[0].sub_queries, vec![0, 1]);
        // The same content under two nodes is kept once, the better one, with both sub-queries.
        let r = rank(
            &[
                bundle(0, vec![hit(3, "Same  text", 0.2)]),
                bundle(1, vec![hit(4, "same text", 0.6)]),
            ],
            10,
        );
        assert_eq!(ids(&r), vec![4]);
        assert_eq!(r[0].sub_queries, vec![0, 1]);
        // Ties by node id; top_k truncates.
        let r = rank(
            &[bundle(
                0,
                vec![hit(9, "x", 0.1), hit(5, "y", 0.1), hit(7, "z", 0.1)],
            )],
            2,
        );
        assert_eq!(ids(&r), vec![5, 7]);
        // A sub-query listing the same node twice counts it once.
        let r = rank(&[bundle(0, vec![hit(1, "a", 0.1), hit(1, "a", 0.1)])], 5);
        assert!((r[0].score - 0.1).abs() < 1e-9);
        assert!(rank(&[], 5).is_empty());
    }
}
