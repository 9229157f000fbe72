//! Retrieval over the platform's published read model, the way the platform's retrieval reads
//! it: the full-text leg ([`crate::publication::FTS_READ_SQL`]: `ready` `fts` projections whose
//! `fts_document` matches `plainto_tsquery('simple', <normalised query>)`) and, where the task's
//! embedding profile asks for it, the dense leg ([`crate::publication::DENSE_READ_SQL`]: `ready`
//! `dense-vector` projections of the profile's vector space), both through the members of one
//! publication, then fused by reciprocal rank (k = 60). Invariant: every statement names the
//! task's tenant, space and publication, reads only `index-projection` members of that
//! publication, only nodes of parsed, active documents whose source is not being deleted, and
//! only nodes whose every permission scope is among the reader's scopes (the snapshot's, or the
//! capability grant's content scope), and nothing at all when those are malformed; so another
//! tenant's or space's rows, unpublished generations, deleted documents and nodes the reader may
//! not see are never found.

use std::collections::BTreeMap;

use sqlx::PgConnection;
use uuid::Uuid;

use super::plan::Hit;
use crate::embed::Profile;

/// The platform's reciprocal-rank-fusion constant.
pub const RRF_K: f64 = 60.0;

/// The platform planner's per-leg and fusion limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FanOut {
    /// `ftsTopK` = `denseTopK`.
    pub leg: usize,
    /// `fusionLimit` (used by a reranker; without one a query keeps `topK`).
    pub fusion: usize,
    pub top_k: usize,
}

/// `min(topK × recall, 100)` per leg and `min(topK × fusion, 100)` for fusion, with the mode's
/// factors: fast ×1/×1, deep ×5/×3, research ×10/×5. Pure.
pub fn fan_out(mode: &str, top_k: usize) -> FanOut {
    let (recall, fusion) = match mode {
        "fast" => (1, 1),
        "deep" => (5, 3),
        _ => (10, 5),
    };
    let top_k = top_k.clamp(1, 100);
    FanOut {
        leg: (top_k * recall).min(100),
        fusion: (top_k * fusion).min(100),
        top_k,
    }
}

/// What a task reads: its publication, its reader scopes, and its embedding profile (if any).
#[derive(Clone, Debug, PartialEq)]
pub struct ReadModel {
    pub tenant_id: String,
    pub space_id: Uuid,
    pub publication_id: Uuid,
    /// The reader's scopes, normalized ([`super::access::reader_scopes`]: a JSON array of
    /// strings); `None`: they are malformed and nothing may be read.
    pub scopes: Option<serde_json::Value>,
    pub embedding: Option<Profile>,
}

/// One leg's row.
#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
pub struct LegRow {
    pub projection_id: Uuid,
    pub node_id: Uuid,
    pub document_asset_id: Uuid,
    pub document_version: i32,
    pub text: String,
    pub source_location: serde_json::Value,
    pub filename: String,
    pub score: f64,
    pub artifact_hash: String,
    pub start_offset: i32,
    pub end_offset: i32,
}

/// Reciprocal rank fusion, as the platform fuses: each leg is de-duplicated by node (the first,
/// best row stays), a node earns `1 / (k + rank + 1)` (0-based rank) from each leg that found
/// it, dense before full-text, and the result is sorted by score, then node id, and cut at
/// `limit`. Pure.
pub fn fuse(legs: &[(&str, &[LegRow])], limit: usize) -> Vec<Hit> {
    let mut by_node: BTreeMap<Uuid, Hit> = BTreeMap::new();
    for (name, rows) in legs {
        let mut seen = std::collections::BTreeSet::new();
        let mut rank = 0usize;
        for r in rows.iter() {
            if !seen.insert(r.node_id) {
                continue;
            }
            let add = 1.0 / (RRF_K + rank as f64 + 1.0);
            rank += 1;
            let h = by_node.entry(r.node_id).or_insert_with(|| Hit {
                node_id: r.node_id,
                document_id: r.document_asset_id,
                document_version: r.document_version,
                filename: r.filename.clone(),
                heading_path: r
                    .source_location
                    .get("sectionPath")
                    .cloned()
                    .unwrap_or_else(|| serde_json::json!([])),
                content: r.text.clone(),
                rank: 0.0,
                artifact_hash: r.artifact_hash.clone(),
                start_offset: r.start_offset,
                end_offset: r.end_offset,
                page_number: r.source_location.get("pageNumber").and_then(|p| p.as_i64()),
                projection_ids: Vec::new(),
                sources: Vec::new(),
            });
            h.rank += add;
            h.projection_ids.push(r.projection_id);
            h.sources.push((*name).to_owned());
        }
    }
    let mut all: Vec<Hit> = by_node.into_values().collect();
    all.sort_by(|a, b| b.rank.total_cmp(&a.rank).then(a.node_id.cmp(&b.node_id)));
    all.truncate(limit);
    all
}

/// The best possible fused score of one query over `legs` legs (first in each).
pub fn best_score(legs: usize) -> f64 {
    legs.max(1) as f64 / (RRF_K + 1.0)
}

const NODE_FIELDS: &str =
    "r.projection_id, r.node_id, r.document_asset_id, r.document_version, r.text, \
  r.source_location, r.filename, r.score, n.artifact_hash, n.start_offset, n.end_offset";

/// The full-text leg: at most `limit` rows, best first. An empty normalised query finds nothing.
pub async fn fts(
    conn: &mut PgConnection,
    read: &ReadModel,
    text: &str,
    limit: usize,
) -> Result<Vec<LegRow>, sqlx::Error> {
    let q = crate::canonical::normalize_fts_text(text);
    let Some(scopes) = &read.scopes else {
        return Ok(Vec::new());
    };
    if q.is_empty() {
        return Ok(Vec::new());
    }
    let sql = format!(
        "SELECT {NODE_FIELDS} FROM ({} LIMIT $6) r \
         JOIN knowledge_nodes n ON n.id = r.node_id AND n.knowledge_space_id = $1 \
         ORDER BY r.score DESC, r.node_id",
        crate::publication::FTS_READ_SQL
    );
    sqlx::query_as::<_, LegRow>(&sql)
        .bind(read.space_id)
        .bind(q)
        .bind(&read.tenant_id)
        .bind(read.publication_id)
        .bind(scopes)
        .bind(i64::try_from(limit).unwrap_or(100))
        .fetch_all(conn)
        .await
}

/// The query vector as pgvector's text form.
pub fn vector_text(v: &[f32]) -> String {
    let parts: Vec<String> = v.iter().map(|x| format!("{x}")).collect();
    format!("[{}]", parts.join(","))
}

/// The dense leg for an embedded query: at most `limit` rows of the profile's vector space,
/// nearest first.
pub async fn dense(
    conn: &mut PgConnection,
    read: &ReadModel,
    profile: &Profile,
    vector: &[f32],
    limit: usize,
) -> Result<Vec<LegRow>, sqlx::Error> {
    let Some(scopes) = &read.scopes else {
        return Ok(Vec::new());
    };
    let sql = format!(
        "SELECT {NODE_FIELDS} FROM ({} LIMIT $8) r \
         JOIN knowledge_nodes n ON n.id = r.node_id AND n.knowledge_space_id = $1 \
         ORDER BY r.score DESC, r.node_id",
        crate::publication::DENSE_READ_SQL
    );
    sqlx::query_as::<_, LegRow>(&sql)
        .bind(read.space_id)
        .bind(vector_text(vector))
        .bind(&read.tenant_id)
        .bind(read.publication_id)
        .bind(i32::try_from(profile.dimension).unwrap_or(i32::MAX))
        .bind(&profile.vector_space_id)
        .bind(scopes)
        .bind(i64::try_from(limit).unwrap_or(100))
        .fetch_all(conn)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(node: u128, projection: u128) -> LegRow {
        LegRow {
            projection_id: Uuid::from_u128(projection),
            node_id: Uuid::from_u128(node),
            document_asset_id: Uuid::from_u128(100),
            document_version: 1,
            text: format!("node {node}"),
            source_location: serde_json::json!({"sectionPath": ["A"], "pageNumber": 3}),
            filename: "a.md".into(),
            score: 0.5,
            artifact_hash: "h".into(),
            start_offset: 0,
            end_offset: 4,
        }
    }

    #[test]
    fn fan_out_follows_the_mode() {
        let f = |mode, k| {
            let o = fan_out(mode, k);
            (o.leg, o.fusion, o.top_k)
        };
        assert_eq!(f("fast", 10), (10, 10, 10));
        assert_eq!(f("deep", 10), (50, 30, 10));
        assert_eq!(f("research", 10), (100, 50, 10));
        assert_eq!(f("research", 37), (100, 100, 37));
        assert_eq!(f("fast", 0), (1, 1, 1));
    }

    #[test]
    fn fusion_table() {
        let dense = [row(1, 11), row(2, 12), row(1, 13)];
        let fts = [row(2, 22), row(3, 23)];
        let got = fuse(&[("dense", &dense), ("fts", &fts)], 10);
        let ids: Vec<u128> = got.iter().map(|h| h.node_id.as_u128()).collect();
        // Node 2: 1/62 + 1/61 beats node 1 (1/61) and node 3 (1/62).
        assert_eq!(ids, vec![2, 1, 3]);
        assert!((got[0].rank - (1.0 / 62.0 + 1.0 / 61.0)).abs() < 1e-12);
        assert_eq!(got[0].sources, vec!["dense", "fts"]);
        assert_eq!(
            got[0].projection_ids,
            vec![Uuid::from_u128(12), Uuid::from_u128(22)]
        );
        // A repeated node in one leg counts once, at its best rank.
        assert_eq!(got[1].projection_ids, vec![Uuid::from_u128(11)]);
        assert_eq!(got[1].heading_path, serde_json::json!(["A"]));
        assert_eq!(got[1].page_number, Some(3));
        // Ties by node id; the limit cuts.
        let a = [row(9, 1)];
        let b = [row(4, 2)];
        let tie = fuse(&[("dense", &a), ("fts", &b)], 1);
        assert_eq!(tie.len(), 1);
        assert_eq!(tie[0].node_id, Uuid::from_u128(4));
        assert!(fuse(&[("fts", &[])], 5).is_empty());
        assert!((best_score(2) - 2.0 / 61.0).abs() < 1e-12);
    }

    #[test]
    fn vectors_as_text() {
        assert_eq!(vector_text(&[0.5, -1.0, 0.25]), "[0.5,-1,0.25]");
        assert_eq!(vector_text(&[]), "[]");
    }
}
