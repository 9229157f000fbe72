//! The profile backfill decision as pure functions. Invariant: an initial profile head is
//! installed only when the space's manifest, locked, is still at the version the backfill was
//! discovered at, the stored snapshot still hashes to its recorded digest, the snapshot
//! describes a valid profile of the backfill's kind, and no head exists yet; a head that already
//! points at this very snapshot means the work was done (an uncertain commit repeated).

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::jobs::JobError;

/// The profile kinds.
pub const KINDS: [&str; 2] = ["embedding", "retrieval"];

/// What the step found under its locks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Facts {
    /// The highest manifest version of the space, locked; `None`: the space has no manifest.
    pub manifest_version: Option<i32>,
    pub source_manifest_version: i32,
    /// The digest of the stored snapshot, computed now.
    pub computed_digest: String,
    /// The digest recorded when the backfill was discovered.
    pub recorded_digest: String,
    pub head: Option<HeadFact>,
}

/// The profile head of the space and kind, if one exists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeadFact {
    /// It points at a revision of this very snapshot.
    Ours,
    /// It points at another revision.
    Other { revision: i32 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Create the revision and install the initial head.
    Install,
    /// Already installed: succeed without writing.
    AlreadyInstalled,
}

pub fn decide(f: &Facts) -> Result<Plan, JobError> {
    let Some(current) = f.manifest_version else {
        return Err(JobError::fatal(
            "manifest_missing",
            "the knowledge space has no manifest",
        ));
    };
    if current != f.source_manifest_version {
        return Err(JobError::fatal(
            "manifest_moved",
            format!(
                "the space's manifest is at version {current}, but the backfill was discovered at version {}",
                f.source_manifest_version
            ),
        ));
    }
    if f.computed_digest != f.recorded_digest.trim() {
        return Err(JobError::fatal(
            "snapshot_digest_mismatch",
            format!(
                "the source snapshot hashes to {}, but {} was recorded",
                f.computed_digest,
                f.recorded_digest.trim()
            ),
        ));
    }
    match f.head {
        None => Ok(Plan::Install),
        Some(HeadFact::Ours) => Ok(Plan::AlreadyInstalled),
        Some(HeadFact::Other { revision }) => Err(JobError::fatal(
            "profile_head_exists",
            format!("the space already has an active profile head at revision {revision}"),
        )),
    }
}

/// A profile as a source snapshot describes it.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Profile {
    pub plugin_id: String,
    pub provider: String,
    pub model: String,
    #[serde(default)]
    pub vector_space_id: Option<String>,
    #[serde(default)]
    pub dimension: Option<i32>,
    #[serde(default)]
    pub capabilities: Option<serde_json::Value>,
    #[serde(default)]
    pub created_by_subject_id: Option<String>,
}

/// Reads and checks the profile of a snapshot against the shape the revision table requires.
pub fn profile(kind: &str, snapshot: &serde_json::Value) -> Result<Profile, JobError> {
    let bad = |m: String| JobError::fatal("invalid_snapshot", m);
    if !KINDS.contains(&kind) {
        return Err(bad(format!("unknown profile kind '{kind}'")));
    }
    let p: Profile = serde_json::from_value(snapshot.clone())
        .map_err(|e| bad(format!("the source snapshot is not a profile: {e}")))?;
    for (field, value) in [
        ("pluginId", &p.plugin_id),
        ("provider", &p.provider),
        ("model", &p.model),
    ] {
        if value.trim().is_empty() || value.chars().count() > 256 {
            return Err(bad(format!("{field} must have 1 to 256 characters")));
        }
    }
    match (kind, &p.vector_space_id, p.dimension) {
        ("embedding", Some(v), Some(d)) => {
            if v.is_empty() || v.chars().count() > 87 {
                return Err(bad("vectorSpaceId must have 1 to 87 characters".into()));
            }
            if d < 1 {
                return Err(bad("dimension must be at least 1".into()));
            }
        }
        ("embedding", _, _) => {
            return Err(bad(
                "an embedding profile needs vectorSpaceId and dimension".into(),
            ))
        }
        (_, None, None) => {}
        _ => {
            return Err(bad(
                "a retrieval profile has no vectorSpaceId or dimension".into()
            ))
        }
    }
    if let Some(s) = &p.created_by_subject_id {
        if s.is_empty() || s.chars().count() > 255 {
            return Err(bad(
                "createdBySubjectId must have 1 to 255 characters".into()
            ));
        }
    }
    if p.capabilities.as_ref().is_some_and(|c| !c.is_object()) {
        return Err(bad("capabilities must be an object".into()));
    }
    Ok(p)
}

/// JSON with object keys sorted at every level and no whitespace: the form digests are taken
/// over, so that the digest does not depend on how a store orders keys.
pub fn canonical_json(v: &serde_json::Value) -> String {
    fn write(v: &serde_json::Value, out: &mut String) {
        match v {
            serde_json::Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                out.push('{');
                for (i, k) in keys.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&serde_json::Value::String(k.clone()).to_string());
                    out.push(':');
                    write(&m[k], out);
                }
                out.push('}');
            }
            serde_json::Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write(x, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut out = String::new();
    write(v, &mut out);
    out
}

/// Hex SHA-256 of the canonical JSON.
pub fn digest(v: &serde_json::Value) -> String {
    hex::encode(Sha256::digest(canonical_json(v).as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn facts(manifest: Option<i32>, digest_ok: bool, head: Option<HeadFact>) -> Facts {
        Facts {
            manifest_version: manifest,
            source_manifest_version: 3,
            computed_digest: "a".repeat(64),
            recorded_digest: if digest_ok {
                "a".repeat(64)
            } else {
                "b".repeat(64)
            },
            head,
        }
    }

    #[test]
    fn decision_table() {
        let table: Vec<(Facts, Result<Plan, &str>)> = vec![
            (facts(Some(3), true, None), Ok(Plan::Install)),
            (
                facts(Some(3), true, Some(HeadFact::Ours)),
                Ok(Plan::AlreadyInstalled),
            ),
            (
                facts(Some(3), true, Some(HeadFact::Other { revision: 2 })),
                Err("profile_head_exists"),
            ),
            (facts(Some(4), true, None), Err("manifest_moved")),
            (facts(Some(2), true, None), Err("manifest_moved")),
            (facts(None, true, None), Err("manifest_missing")),
            (facts(Some(3), false, None), Err("snapshot_digest_mismatch")),
            // The manifest is checked first: a moved manifest wins over a bad digest.
            (facts(Some(4), false, None), Err("manifest_moved")),
        ];
        for (f, want) in table {
            let got = decide(&f).map_err(|e| e.code().to_owned());
            assert_eq!(got, want.map_err(str::to_owned), "{f:?}");
            if let Err(JobError::Retryable { .. }) = decide(&f) {
                panic!("backfill refusals are final: {f:?}");
            }
        }
    }

    #[test]
    fn profile_table() {
        let emb = json!({"pluginId": "p", "provider": "openai", "model": "m", "vectorSpaceId": "vs", "dimension": 8});
        let ret = json!({"pluginId": "p", "provider": "pg", "model": "bm25"});
        let table: Vec<(&str, serde_json::Value, bool)> = vec![
            ("embedding", emb.clone(), true),
            ("retrieval", ret.clone(), true),
            ("embedding", ret.clone(), false),
            ("retrieval", emb.clone(), false),
            ("vector", ret.clone(), false),
            (
                "embedding",
                json!({"pluginId": "p", "provider": "o", "model": "m", "vectorSpaceId": "vs", "dimension": 0}),
                false,
            ),
            (
                "embedding",
                json!({"pluginId": "p", "provider": "o", "model": "m", "vectorSpaceId": "x".repeat(88), "dimension": 8}),
                false,
            ),
            (
                "retrieval",
                json!({"pluginId": "", "provider": "pg", "model": "bm25"}),
                false,
            ),
            (
                "retrieval",
                json!({"provider": "pg", "model": "bm25"}),
                false,
            ),
            (
                "retrieval",
                json!({"pluginId": "p", "provider": "pg", "model": "bm25", "capabilities": [1]}),
                false,
            ),
            (
                "retrieval",
                json!({"pluginId": "p", "provider": "pg", "model": "bm25", "capabilities": {"rerank": true}}),
                true,
            ),
            ("retrieval", json!("not an object"), false),
        ];
        for (kind, snap, ok) in table {
            let got = profile(kind, &snap);
            assert_eq!(got.is_ok(), ok, "{kind} {snap}: {got:?}");
            if let Err(e) = got {
                assert_eq!(e.code(), "invalid_snapshot");
            }
        }
    }

    #[test]
    fn digests_ignore_key_order() {
        let a: serde_json::Value =
            serde_json::from_str(r#"{"b": 1, "a": {"y": [1, {"d": 2, "c": 3}], "x": "é"}}"#)
                .unwrap();
        let b: serde_json::Value =
            serde_json::from_str(r#"{"a": {"x": "é", "y": [1, {"c": 3, "d": 2}]}, "b": 1}"#)
                .unwrap();
        assert_eq!(
            canonical_json(&a),
            r#"{"a":{"x":"é","y":[1,{"c":3,"d":2}]},"b":1}"#
        );
        assert_eq!(digest(&a), digest(&b));
        assert_eq!(digest(&a).len(), 64);
        assert_ne!(digest(&a), digest(&json!({"b": 2})));
    }
}
