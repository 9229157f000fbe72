//! The identity of a candidate publication: the platform's projection-set fingerprint material
//! and fingerprint, and the candidate's metadata. Invariant: the fingerprint is
//! `projection-set-sha256:` and the SHA-256 of the canonical JSON of the material, the material
//! lists every distinct projection configuration and one source snapshot per document of the
//! publication, each list in the platform's collation order, so two publications of the same
//! content have the same fingerprint.

use std::cmp::Ordering;

use serde_json::{json, Value};
use uuid::Uuid;

use crate::canonical::{locale_compare, stable_digest};

pub const FTS_MODEL: &str = "database-fts@1";
pub const FINGERPRINT_PREFIX: &str = "projection-set-sha256:";

/// One distinct projection configuration of a publication (a row `kind, model,
/// projection_version`).
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct ProjectionConfig {
    pub kind: String,
    pub model: Option<String>,
    pub projection_version: i32,
}

impl ProjectionConfig {
    fn strategy(&self) -> (&'static str, &'static str) {
        match self.kind.as_str() {
            "fts" => ("database-fts-v1", "mixed-cjk-latin-fts-v1"),
            "dense-vector" => ("plugin-daemon-embedding-v1", "text-dense-v1"),
            _ => ("visual-embedding-v1", "visual-dense-v1"),
        }
    }

    fn to_json(&self) -> Value {
        let (index_version, strategy) = self.strategy();
        json!({ "indexVersion": index_version, "model": self.model, "projectionVersion": self.projection_version,
                "strategy": strategy, "type": self.kind })
    }
}

/// What a publication holds of one document (a row `document, version, sha256,
/// artifact_hash`).
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct SourceSnapshot {
    pub document: Uuid,
    pub version: i32,
    pub sha256: String,
    pub artifact_hash: Option<String>,
}

fn cmp_str(a: &str, b: &str) -> Ordering {
    locale_compare(a, b).then_with(|| a.cmp(b))
}

/// The fingerprint material of a publication of `space`.
pub fn material(space: Uuid, configs: &[ProjectionConfig], snapshots: &[SourceSnapshot]) -> Value {
    let mut configs: Vec<&ProjectionConfig> = configs.iter().collect();
    configs.sort_by(|a, b| {
        let (ai, astrat) = a.strategy();
        let (bi, bstrat) = b.strategy();
        cmp_str(&a.kind, &b.kind)
            .then_with(|| {
                cmp_str(
                    a.model.as_deref().unwrap_or(""),
                    b.model.as_deref().unwrap_or(""),
                )
            })
            .then_with(|| cmp_str(astrat, bstrat))
            .then_with(|| cmp_str(ai, bi))
            .then_with(|| a.projection_version.cmp(&b.projection_version))
    });
    configs.dedup();
    let mut snapshots: Vec<&SourceSnapshot> = snapshots.iter().collect();
    snapshots.sort_by(|a, b| {
        cmp_str(&a.document.to_string(), &b.document.to_string())
            .then_with(|| a.version.cmp(&b.version))
            .then_with(|| cmp_str(&a.sha256, &b.sha256))
            .then_with(|| {
                cmp_str(
                    a.artifact_hash.as_deref().unwrap_or(""),
                    b.artifact_hash.as_deref().unwrap_or(""),
                )
            })
    });
    snapshots.dedup();
    json!({
        "chunkerVersion": "knowledge-compute-chunker-v1",
        "indexVersion": "knowledge-index-v1",
        "knowledgeSpaceId": space,
        "nodeSchemaVersion": 1,
        "parserPolicyVersion": "configured-parser-v1",
        "projectionSetVersion": "projection-set-v1",
        "projections": configs.iter().map(|c| c.to_json()).collect::<Vec<_>>(),
        "sourceSnapshots": snapshots.iter().map(|s| json!({
            "artifactHash": s.artifact_hash, "documentAssetId": s.document, "sha256": s.sha256, "version": s.version,
        })).collect::<Vec<_>>(),
    })
}

/// `projection-set-sha256:<hex>`, 86 characters.
pub fn fingerprint(material: &Value) -> String {
    format!("{FINGERPRINT_PREFIX}{}", stable_digest(material))
}

/// The publication's `projection_version`: the highest of its projections'.
pub fn projection_version(configs: &[ProjectionConfig]) -> i32 {
    configs
        .iter()
        .map(|c| c.projection_version)
        .max()
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fingerprint_is_a_function_of_the_content_not_its_order() {
        let fts = |v| ProjectionConfig {
            kind: "fts".into(),
            model: Some(FTS_MODEL.into()),
            projection_version: v,
        };
        let snap = |d: u128, v| SourceSnapshot {
            document: Uuid::from_u128(d),
            version: v,
            sha256: "ab".into(),
            artifact_hash: Some("cd".into()),
        };
        let space = Uuid::from_u128(42);
        let a = material(space, &[fts(1), fts(2), fts(1)], &[snap(1, 1), snap(2, 2)]);
        let b = material(space, &[fts(2), fts(1)], &[snap(2, 2), snap(1, 1)]);
        assert_eq!(a, b);
        assert_eq!(a["projections"].as_array().unwrap().len(), 2);
        let fp = fingerprint(&a);
        assert_eq!(fp.len(), 86);
        assert!(fp.starts_with(FINGERPRINT_PREFIX));
        assert_ne!(fp, fingerprint(&material(space, &[fts(1)], &[snap(1, 2)])));
        assert_eq!(projection_version(&[fts(1), fts(3)]), 3);
    }
}
