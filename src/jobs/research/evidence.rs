//! The evidence bundle, in the platform's shape: what a task answered from, stored as its final
//! partial result (`research-task:<jobId>:final-evidence`). Invariant: pure; a bundle holds at
//! most [`MAX_ITEMS`] items, each citing the document, version, artifact and offsets its node
//! came from, in the ranked order of the evidence; its `traceId` is the job id and its `state`
//! follows the platform's rule (no item, or no item scoring 0.5, is `not-enough-evidence`).

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use uuid::Uuid;

use super::plan::Evidence;
use super::retrieve;

/// The platform's limit on bundle items.
pub const MAX_ITEMS: usize = 20;

/// An `EvidenceBundle`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Bundle {
    pub created_at: String,
    pub id: Uuid,
    pub items: Vec<Item>,
    pub missing_evidence: Vec<Value>,
    pub query: String,
    /// `answerable`, `partial`, `not-enough-evidence`, `conflict` or `permission-limited`.
    pub state: String,
    pub trace_id: String,
}

/// One bundle item.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Item {
    pub citations: Vec<Citation>,
    pub conflicts: Vec<Value>,
    pub freshness: Value,
    pub metadata: Value,
    pub node_id: Uuid,
    pub score: f64,
    pub scores: Value,
    pub text: String,
}

/// Where an item's text is in its document.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Citation {
    pub artifact_hash: String,
    pub document_asset_id: Uuid,
    pub document_version: i32,
    pub section_path: Value,
    pub start_offset: i32,
    pub end_offset: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_number: Option<i64>,
}

/// The final score of a ranked piece of evidence: its fused score relative to the best one query
/// over `legs` retrieval legs can give (first in every leg), at most 1. kfs-worker's choice: the
/// platform's assembler scores after its reranker, which a 0018 space does not configure.
pub fn final_score(score: f64, legs: usize) -> f64 {
    let s = score / retrieve::best_score(legs);
    if s.is_finite() {
        (s.clamp(0.0, 1.0) * 1_000_000.0).round() / 1_000_000.0
    } else {
        0.0
    }
}

/// The platform's state rule for what kfs-worker can know (it reports no conflicts, no missing
/// evidence and no permission filtering).
pub fn state(items: &[Item]) -> &'static str {
    if items.is_empty() || items.iter().all(|i| i.score < 0.5) {
        "not-enough-evidence"
    } else {
        "answerable"
    }
}

/// The bundle of `evidence` (ranked) for `query`. Pure.
pub fn assemble(
    id: Uuid,
    job_id: Uuid,
    query: &str,
    created_at: &str,
    evidence: &[Evidence],
    legs: usize,
) -> Bundle {
    let items: Vec<Item> = evidence
        .iter()
        .take(MAX_ITEMS)
        .map(|e| {
            let fin = final_score(e.score, legs);
            Item {
                citations: vec![Citation {
                    artifact_hash: e.artifact_hash.clone(),
                    document_asset_id: e.document_id,
                    document_version: e.document_version,
                    section_path: e.heading_path.clone(),
                    start_offset: e.start_offset,
                    end_offset: e.end_offset,
                    page_number: e.page_number,
                }],
                conflicts: Vec::new(),
                freshness: json!({ "status": "unknown" }),
                metadata: json!({ "projectionIds": e.projection_ids, "sources": e.sources }),
                node_id: e.node_id,
                score: fin,
                scores: json!({ "final": fin, "retrieval": e.score }),
                text: e.content.clone(),
            }
        })
        .collect();
    let state = state(&items).to_owned();
    Bundle {
        created_at: created_at.to_owned(),
        id,
        items,
        missing_evidence: Vec::new(),
        query: query.trim().to_owned(),
        state,
        trace_id: job_id.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(node: u128, score: f64) -> Evidence {
        Evidence {
            node_id: Uuid::from_u128(node),
            document_id: Uuid::from_u128(7),
            document_version: 2,
            filename: "a.md".into(),
            heading_path: json!(["Guide"]),
            content: format!("text {node}"),
            score,
            sub_queries: vec![0],
            artifact_hash: "abc".into(),
            start_offset: 3,
            end_offset: 9,
            page_number: None,
            projection_ids: vec![Uuid::from_u128(100 + node)],
            sources: vec!["fts".into()],
        }
    }

    #[test]
    fn the_platform_shape() {
        let job = Uuid::from_u128(1);
        let b = assemble(
            Uuid::from_u128(2),
            job,
            " q? ",
            "2026-01-01T00:00:00.000Z",
            &[ev(5, 1.0 / 61.0)],
            1,
        );
        assert_eq!(
            serde_json::to_value(&b).unwrap(),
            json!({
                "createdAt": "2026-01-01T00:00:00.000Z", "id": Uuid::from_u128(2), "missingEvidence": [],
                "query": "q?", "state": "answerable", "traceId": job.to_string(),
                "items": [{
                    "citations": [{"artifactHash": "abc", "documentAssetId": Uuid::from_u128(7), "documentVersion": 2,
                                   "sectionPath": ["Guide"], "startOffset": 3, "endOffset": 9}],
                    "conflicts": [], "freshness": {"status": "unknown"},
                    "metadata": {"projectionIds": [Uuid::from_u128(105)], "sources": ["fts"]},
                    "nodeId": Uuid::from_u128(5), "score": 1.0,
                    "scores": {"final": 1.0, "retrieval": 1.0 / 61.0}, "text": "text 5"
                }]
            })
        );
    }

    #[test]
    fn state_and_score_table() {
        let table: Vec<(Vec<f64>, usize, &str)> = vec![
            (vec![], 1, "not-enough-evidence"),
            (vec![1.0 / 61.0], 1, "answerable"),
            // First in one of two legs only: 0.5.
            (vec![1.0 / 61.0], 2, "answerable"),
            (vec![1.0 / 62.0], 2, "not-enough-evidence"),
            (vec![1.0 / 70.0, 1.0 / 61.0], 1, "answerable"),
        ];
        for (scores, legs, want) in table {
            let evidence: Vec<Evidence> = scores
                .iter()
                .enumerate()
                .map(|(i, s)| ev(i as u128, *s))
                .collect();
            let b = assemble(Uuid::nil(), Uuid::nil(), "q", "t", &evidence, legs);
            assert_eq!(b.state, want, "{scores:?} over {legs} legs");
        }
        // Summed over several sub-queries, still at most 1.
        assert_eq!(final_score(3.0 / 61.0, 1), 1.0);
        let many: Vec<Evidence> = (0..30).map(|i| ev(i, 0.01)).collect();
        assert_eq!(
            assemble(Uuid::nil(), Uuid::nil(), "q", "t", &many, 1)
                .items
                .len(),
            MAX_ITEMS
        );
    }
}
