//! Scoring a published outline's findability against the space's golden questions
//! (`pageindex-layered-findability-v1`). Invariant: the verdict is a pure function of the
//! questions, their evidence ranges, the outline and each question's search result —
//! [`samples`] keeps only questions whose evidence lies in this outline, fewer than
//! [`MIN_QUESTIONS`] of them (or [`MAX_FAILURES`] searches failing in a row) give
//! `not-evaluated` with the route left `unchanged`, and otherwise recall, reciprocal rank and
//! path recall at [`TOP_K`] against the thresholds give `passed`/`layered` or `failed`/`hybrid`.

use std::collections::{BTreeSet, HashMap};

use serde_json::{json, Value};

use super::search::{self, Tree};

pub const EVALUATOR_VERSION: &str = "pageindex-layered-findability-v1";
pub const MIN_QUESTIONS: usize = 3;
pub const MAX_QUESTIONS: usize = 20;
pub const MAX_TREE_DEPTH: usize = 8;
pub const TOP_K: usize = 5;
pub const MIN_RECALL: f64 = 0.7;
pub const MIN_MRR: f64 = 0.5;
pub const MIN_PATH_RECALL: f64 = 0.8;
/// Searches failing in a row that end the evaluation as `not-evaluated`.
pub const MAX_FAILURES: usize = 3;
/// The most distinct evidence ids read for one evaluation.
pub const MAX_EVIDENCE_IDS: usize = 1_000;

/// A golden question, as its space keeps it.
#[derive(Clone, Debug, PartialEq)]
pub struct Question {
    pub id: String,
    pub question: String,
    pub evidence: Vec<String>,
}

/// Where a piece of expected evidence lies in the document (a knowledge node's offsets).
#[derive(Clone, Debug, PartialEq)]
pub struct Range {
    pub evidence: String,
    pub start: i64,
    pub end: i64,
}

/// The outline node holding each evidence range: the deepest, then narrowest, covering node.
pub fn evidence_nodes(tree: &Tree, ranges: &[Range]) -> HashMap<String, usize> {
    let mut out = HashMap::new();
    for r in ranges {
        if r.evidence.trim().is_empty() || r.start < 0 || r.end <= r.start {
            continue;
        }
        let best = tree
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| Some((i, n, n.start_offset?, n.end_offset?)))
            .filter(|(_, _, s, e)| *s <= r.start && *e >= r.end)
            .min_by(|a, b| {
                b.1.level
                    .cmp(&a.1.level)
                    .then((a.3 - a.2).cmp(&(b.3 - b.2)))
                    .then_with(|| a.1.id.cmp(&b.1.id))
            });
        if let Some((i, ..)) = best {
            out.insert(r.evidence.clone(), i);
        }
    }
    out
}

/// A question with the outline nodes its evidence lies in.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub question: Question,
    pub expected: BTreeSet<usize>,
}

/// The questions whose evidence lies in the outline, by question id, at most [`MAX_QUESTIONS`].
pub fn samples(questions: &[Question], nodes: &HashMap<String, usize>) -> Vec<Sample> {
    let mut out: Vec<Sample> = questions
        .iter()
        .map(|q| Sample {
            question: q.clone(),
            expected: q
                .evidence
                .iter()
                .filter_map(|e| nodes.get(e).copied())
                .collect(),
        })
        .filter(|s| !s.expected.is_empty())
        .collect();
    out.sort_by(|a, b| a.question.id.cmp(&b.question.id));
    out.truncate(MAX_QUESTIONS);
    out
}

/// The running score of an evaluation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tally {
    pub evaluated: usize,
    pub abstentions: usize,
    pub exact_hits: usize,
    pub path_hits: usize,
    pub reciprocal_ranks: f64,
    failures_in_a_row: usize,
    pub broken: bool,
}

impl Tally {
    /// Counts one question's search: the sections it found, best first, or a failed search
    /// (nothing found). Returns whether the evaluation goes on.
    pub fn record(&mut self, tree: &Tree, sample: &Sample, found: Option<&[usize]>) -> bool {
        if found.is_none() {
            self.failures_in_a_row += 1;
            if self.failures_in_a_row >= MAX_FAILURES {
                self.broken = true;
            }
        }
        self.evaluated += 1;
        let found = found.unwrap_or_default();
        if found.is_empty() {
            self.abstentions += 1;
            return !self.broken;
        }
        self.failures_in_a_row = 0;
        if let Some(rank) = found.iter().position(|n| sample.expected.contains(n)) {
            self.exact_hits += 1;
            self.reciprocal_ranks += 1.0 / (rank as f64 + 1.0);
        }
        if found
            .iter()
            .any(|f| sample.expected.iter().any(|e| tree.same_path(*f, *e)))
        {
            self.path_hits += 1;
        }
        true
    }
}

fn round(v: f64) -> f64 {
    (v * 1_000_000.0).round() / 1_000_000.0
}

/// An evaluation's outcome, as `page_index_findability_evaluations` keeps it.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    pub status: &'static str,
    pub route: &'static str,
    pub evaluation: Value,
}

/// The verdict of a tally (`None`: too few samples to search).
pub fn verdict(model: &Value, samples: usize, tally: Option<&Tally>) -> Verdict {
    let base = |status: &'static str, route: &'static str, n: usize, m: [f64; 4]| Verdict {
        status,
        route,
        evaluation: json!({
            "abstentionRate": round(m[0]), "evaluatorVersion": EVALUATOR_VERSION,
            "meanReciprocalRank": round(m[1]), "model": model, "pathRecallAtK": round(m[2]),
            "promptVersion": search::PROMPT_VERSION, "recallAtK": round(m[3]),
            "recommendedRoute": route, "sampleCount": n, "status": status,
            "summaryRepairRequested": false, "topK": TOP_K,
        }),
    };
    let Some(t) = tally else {
        return base("not-evaluated", "unchanged", samples, [0.0; 4]);
    };
    let n = t.evaluated as f64;
    if t.broken {
        let abstention = if t.evaluated == 0 {
            0.0
        } else {
            t.abstentions as f64 / n
        };
        return base(
            "not-evaluated",
            "unchanged",
            t.evaluated,
            [abstention, 0.0, 0.0, 0.0],
        );
    }
    let (recall, mrr, path) = (
        t.exact_hits as f64 / n,
        t.reciprocal_ranks / n,
        t.path_hits as f64 / n,
    );
    let passed = recall >= MIN_RECALL && mrr >= MIN_MRR && path >= MIN_PATH_RECALL;
    let (status, route) = if passed {
        ("passed", "layered")
    } else {
        ("failed", "hybrid")
    };
    base(
        status,
        route,
        t.evaluated,
        [t.abstentions as f64 / n, mrr, path, recall],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree() -> Tree {
        Tree::parse(&json!([
            { "id": "doc", "title": "Doc", "level": 1, "startOffset": 0, "endOffset": 100, "children": [
                { "id": "s1", "title": "One", "level": 2, "startOffset": 0, "endOffset": 50, "children": [] },
                { "id": "s2", "title": "Two", "level": 2, "startOffset": 50, "endOffset": 100, "children": [] },
            ]},
        ]))
        .unwrap()
    }

    fn q(id: &str, evidence: &[&str]) -> Question {
        Question {
            id: id.into(),
            question: format!("question {id}"),
            evidence: evidence.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    #[test]
    fn evidence_goes_to_the_deepest_covering_section() {
        let t = tree();
        let ranges = [
            Range {
                evidence: "e1".into(),
                start: 10,
                end: 20,
            },
            Range {
                evidence: "e2".into(),
                start: 40,
                end: 60,
            },
            Range {
                evidence: "e3".into(),
                start: 60,
                end: 60,
            },
            Range {
                evidence: "e4".into(),
                start: 90,
                end: 200,
            },
        ];
        let m = evidence_nodes(&t, &ranges);
        assert_eq!(m.get("e1"), t.get("s1").as_ref());
        assert_eq!(m.get("e2"), t.get("doc").as_ref(), "spans two sections");
        assert!(!m.contains_key("e3") && !m.contains_key("e4"));
        let s = samples(
            &[q("b", &["e2"]), q("a", &["e1", "zz"]), q("c", &["zz"])],
            &m,
        );
        assert_eq!(
            s.iter().map(|s| s.question.id.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
    }

    #[test]
    fn verdicts_follow_the_thresholds() {
        let t = tree();
        let (doc, s1, s2) = (
            t.get("doc").unwrap(),
            t.get("s1").unwrap(),
            t.get("s2").unwrap(),
        );
        let sample = |e: usize| Sample {
            question: q("x", &[]),
            expected: [e].into(),
        };
        let model = json!({"model": "m", "pluginId": "p", "provider": "offline"});
        // (found per question, status, recall, mrr, path recall)
        type Row<'a> = (Vec<Option<Vec<usize>>>, &'a str, f64, f64, f64);
        let table: Vec<Row> = vec![
            (
                vec![Some(vec![s1]), Some(vec![s1]), Some(vec![s1])],
                "passed",
                1.0,
                1.0,
                1.0,
            ),
            (
                vec![Some(vec![s2, s1]), Some(vec![s2, s1]), Some(vec![s1])],
                "passed",
                1.0,
                0.666667,
                1.0,
            ),
            (
                vec![Some(vec![s2]), Some(vec![s1]), Some(vec![s1])],
                "failed",
                0.666667,
                0.666667,
                0.666667,
            ),
            (
                vec![Some(vec![doc]), Some(vec![doc]), Some(vec![doc])],
                "failed",
                0.0,
                0.0,
                1.0,
            ),
            (
                vec![Some(vec![]), Some(vec![s1]), Some(vec![s1])],
                "failed",
                0.666667,
                0.666667,
                0.666667,
            ),
            (vec![None, None, None], "not-evaluated", 0.0, 0.0, 0.0),
            (
                vec![None, Some(vec![s1]), None, None],
                "failed",
                0.25,
                0.25,
                0.25,
            ),
        ];
        for (found, status, recall, mrr, path) in table {
            let mut tally = Tally::default();
            for f in &found {
                if !tally.record(&t, &sample(s1), f.as_deref()) {
                    break;
                }
            }
            let v = verdict(&model, found.len(), Some(&tally));
            assert_eq!(v.status, status, "{found:?}");
            assert_eq!(v.evaluation["recallAtK"], recall, "{found:?}");
            assert_eq!(v.evaluation["meanReciprocalRank"], mrr, "{found:?}");
            assert_eq!(v.evaluation["pathRecallAtK"], path, "{found:?}");
            let route = match status {
                "passed" => "layered",
                "failed" => "hybrid",
                _ => "unchanged",
            };
            assert_eq!(v.route, route);
            assert_eq!(v.evaluation["recommendedRoute"], route);
        }
        let none = verdict(&model, 2, None);
        assert_eq!((none.status, none.route), ("not-evaluated", "unchanged"));
        assert_eq!(none.evaluation["sampleCount"], 2);
        assert_eq!(none.evaluation["evaluatorVersion"], EVALUATOR_VERSION);
        assert_eq!(none.evaluation["promptVersion"], search::PROMPT_VERSION);
    }
}
