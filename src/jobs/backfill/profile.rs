//! The platform's profile schemas and the capability snapshot kfs-worker derives in place of
//! the platform's network preflight, as pure functions. Invariant: a profile parses here exactly
//! when the platform's strict schema of its kind accepts it (identifiers trimmed, 1 to 256
//! UTF-16 units, no control characters; unknown keys refused), and the capability derived from
//! a profile and its discovery time is always the same value, in the platform's strict
//! `ModelCapabilitySnapshot` shape (it is derived, not observed: see [`model_capability`]).

use serde_json::{json, Map, Value};

use crate::canonical::stable_digest;
use crate::jobs::JobError;

/// The preflight failure code: a stored snapshot that is no profile of its kind.
pub const CAPABILITY_INVALID: &str = "PROFILE_BACKFILL_CAPABILITY_INVALID";

/// A model selection, identifiers trimmed as the platform's schema trims them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    pub model: String,
    pub plugin_id: String,
    pub provider: String,
}

impl Selection {
    pub fn to_json(&self) -> Value {
        json!({ "model": self.model, "pluginId": self.plugin_id, "provider": self.provider })
    }
}

/// The platform's `KnowledgeSpaceEmbeddingProfileSchema` (strict).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmbeddingProfile {
    pub selection: Selection,
    pub dimension: Option<i64>,
    pub revision: i64,
    pub vector_space_id: String,
}

/// The platform's `KnowledgeSpaceRetrievalProfileSchema` (strict): the parsed value, and what
/// the capability and the revision row need of it.
#[derive(Clone, Debug, PartialEq)]
pub struct RetrievalProfile {
    pub value: Value,
    pub reasoning: Selection,
    /// The rerank model when rerank is enabled.
    pub rerank: Option<Selection>,
    pub revision: i64,
}

fn object<'a>(v: &'a Value, path: &str, keys: &[&str]) -> Result<&'a Map<String, Value>, String> {
    let o = v
        .as_object()
        .ok_or_else(|| format!("{path}: expected an object"))?;
    let unknown: Vec<&str> = o
        .keys()
        .map(String::as_str)
        .filter(|k| !keys.contains(k))
        .collect();
    if !unknown.is_empty() {
        return Err(format!("{path}: unrecognized key(s) {unknown:?}"));
    }
    Ok(o)
}

fn identifier(o: &Map<String, Value>, key: &str, path: &str) -> Result<String, String> {
    let s = o
        .get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("{path}.{key}: expected a string"))?;
    let t = s.trim_matches(|c: char| c.is_whitespace() || c == '\u{feff}');
    let len = t.encode_utf16().count();
    if !(1..=256).contains(&len) {
        return Err(format!("{path}.{key}: must have 1 to 256 characters"));
    }
    if t.chars().any(|c| (c as u32) < 32 || c as u32 == 127) {
        return Err(format!(
            "{path}.{key}: embedding profile identifiers must not contain control characters"
        ));
    }
    Ok(t.to_owned())
}

pub(crate) fn integer(v: &Value) -> Option<i64> {
    v.as_i64().or_else(|| {
        v.as_f64()
            .filter(|f| f.fract() == 0.0 && f.abs() <= 9_007_199_254_740_991.0)
            .map(|f| f as i64)
    })
}

fn int_in(
    o: &Map<String, Value>,
    key: &str,
    path: &str,
    range: std::ops::RangeInclusive<i64>,
) -> Result<Option<i64>, String> {
    match o.get(key) {
        None => Ok(None),
        Some(v) => match integer(v) {
            Some(n) if range.contains(&n) => Ok(Some(n)),
            _ => Err(format!(
                "{path}.{key}: expected an integer from {} to {}",
                range.start(),
                range.end()
            )),
        },
    }
}

fn required<T>(v: Option<T>, path: &str, key: &str) -> Result<T, String> {
    v.ok_or_else(|| format!("{path}.{key}: required"))
}

fn selection(v: &Value, path: &str) -> Result<Selection, String> {
    let o = object(v, path, &["model", "pluginId", "provider"])?;
    Ok(Selection {
        model: identifier(o, "model", path)?,
        plugin_id: identifier(o, "pluginId", path)?,
        provider: identifier(o, "provider", path)?,
    })
}

/// Parses an embedding profile as the platform's schema does.
pub fn parse_embedding(v: &Value) -> Result<EmbeddingProfile, String> {
    let p = "embeddingProfile";
    let o = object(
        v,
        p,
        &[
            "model",
            "pluginId",
            "provider",
            "dimension",
            "revision",
            "vectorSpaceId",
        ],
    )?;
    let vsid = o
        .get("vectorSpaceId")
        .and_then(Value::as_str)
        .ok_or_else(|| format!("{p}.vectorSpaceId: expected a string"))?;
    let hex = vsid.strip_prefix("embedding-space-sha256:").unwrap_or("");
    if hex.len() != 64 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(format!(
            "{p}.vectorSpaceId: must match ^embedding-space-sha256:[a-f0-9]{{64}}$"
        ));
    }
    Ok(EmbeddingProfile {
        selection: Selection {
            model: identifier(o, "model", p)?,
            plugin_id: identifier(o, "pluginId", p)?,
            provider: identifier(o, "provider", p)?,
        },
        dimension: int_in(o, "dimension", p, 1..=i64::from(i32::MAX))?,
        revision: required(
            int_in(o, "revision", p, 1..=i64::from(i32::MAX))?,
            p,
            "revision",
        )?,
        vector_space_id: vsid.to_owned(),
    })
}

/// Parses a retrieval profile as the platform's schema does. `scoreThreshold` is optional here:
/// the 0018-era schema has none, the newer one requires it; either shape is accepted.
pub fn parse_retrieval(v: &Value) -> Result<RetrievalProfile, String> {
    let p = "retrievalProfile";
    let keys = [
        "defaultMode",
        "reasoningModel",
        "rerank",
        "scoreThreshold",
        "topK",
        "revision",
    ];
    let o = object(v, p, &keys)?;
    let mode = o.get("defaultMode").and_then(Value::as_str).unwrap_or("");
    if !matches!(mode, "fast" | "research" | "deep") {
        return Err(format!("{p}.defaultMode: expected fast, research or deep"));
    }
    let reasoning = selection(
        required(o.get("reasoningModel"), p, "reasoningModel")?,
        &format!("{p}.reasoningModel"),
    )?;
    let rp = format!("{p}.rerank");
    let r = object(
        required(o.get("rerank"), p, "rerank")?,
        &rp,
        &["enabled", "model"],
    )?;
    let enabled = r
        .get("enabled")
        .and_then(Value::as_bool)
        .ok_or_else(|| format!("{rp}.enabled: expected a boolean"))?;
    let rerank_model = r
        .get("model")
        .map(|m| selection(m, &format!("{rp}.model")))
        .transpose()?;
    if enabled && rerank_model.is_none() {
        return Err("Enabled rerank requires a model selection".into());
    }
    let mut rerank = json!({ "enabled": enabled });
    if let Some(m) = &rerank_model {
        rerank["model"] = m.to_json();
    }
    let mut value = json!({
        "defaultMode": mode, "reasoningModel": reasoning.to_json(), "rerank": rerank,
        "topK": required(int_in(o, "topK", p, 1..=100)?, p, "topK")?,
        "revision": required(int_in(o, "revision", p, 1..=i64::from(i32::MAX))?, p, "revision")?,
    });
    if let Some(t) = o.get("scoreThreshold") {
        let tp = format!("{p}.scoreThreshold");
        let t = object(t, &tp, &["enabled", "stage", "value"])?;
        let on = t
            .get("enabled")
            .and_then(Value::as_bool)
            .ok_or_else(|| format!("{tp}.enabled: expected a boolean"))?;
        let stage = t.get("stage").and_then(Value::as_str).unwrap_or("");
        if !matches!(stage, "mode-final" | "rerank") {
            return Err(format!("{tp}.stage: expected mode-final or rerank"));
        }
        let mut out = json!({ "enabled": on, "stage": stage });
        match t.get("value") {
            Some(x) if x.as_f64().is_some_and(|f| (0.0..=1.0).contains(&f)) => {
                out["value"] = x.clone()
            }
            Some(_) => return Err(format!("{tp}.value: expected a number from 0 to 1")),
            None if on => return Err("Enabled score threshold requires a value".into()),
            None => {}
        }
        if mode != "research" && on && !enabled {
            return Err("Fast/Deep mode-final score threshold requires the knowledge-space reranker to be enabled".into());
        }
        value["scoreThreshold"] = out;
    }
    let revision = value["revision"].as_i64().unwrap_or(0);
    Ok(RetrievalProfile {
        value,
        reasoning,
        rerank: rerank_model.filter(|_| enabled),
        revision,
    })
}

/// A capability snapshot in the platform's `ModelCapabilitySnapshot` shape, derived rather than
/// observed: `pluginUniqueIdentifier` is the selection's plugin id, `schemaFingerprint` is the
/// SHA-256 of the kind and selection, `distanceMetric` (embedding) is the platform's default
/// `cosine`, `dimension` is the profile's own, `capabilityDigest` is the platform's formula over
/// these with an empty capability list, and `checkedAt` is when the snapshot was discovered (so
/// that repeating the step derives the same snapshot).
pub fn model_capability(
    kind: &str,
    sel: &Selection,
    dimension: Option<i64>,
    checked_at: &str,
) -> Value {
    let selection = sel.to_json();
    let fingerprint = format!(
        "sha256:{}",
        stable_digest(
            &json!({ "derivedFrom": "legacy-profile", "kind": kind, "selection": selection })
        )
    );
    let mut material = json!({ "capabilities": [], "kind": kind, "pluginUniqueIdentifier": sel.plugin_id,
                               "schemaFingerprint": fingerprint, "selection": selection });
    let mut snapshot = json!({ "checkedAt": checked_at, "kind": kind, "pluginUniqueIdentifier": sel.plugin_id,
                               "schemaFingerprint": fingerprint, "selection": selection });
    if kind == "embedding" {
        for v in [&mut material, &mut snapshot] {
            v["distanceMetric"] = json!("cosine");
            if let Some(d) = dimension {
                v["dimension"] = json!(d);
            }
        }
    }
    snapshot["capabilityDigest"] = json!(format!("sha256:{}", stable_digest(&material)));
    snapshot
}

/// Stands in for the platform's preflight: the capability snapshot of the backfill's stored
/// source snapshot. A snapshot that is no profile of its kind fails as the preflight does.
pub fn derive_capability(kind: &str, source: &Value, checked_at: &str) -> Result<Value, JobError> {
    let invalid = |_| {
        JobError::fatal(
            CAPABILITY_INVALID,
            "Legacy profile capability verification failed",
        )
    };
    match kind {
        "embedding" => {
            let p = parse_embedding(source).map_err(invalid)?;
            Ok(model_capability(
                kind,
                &p.selection,
                p.dimension,
                checked_at,
            ))
        }
        "retrieval" => {
            let p = parse_retrieval(source).map_err(invalid)?;
            Ok(json!({
                "reasoning": model_capability("reasoning", &p.reasoning, None, checked_at),
                "rerank": p.rerank.as_ref().map(|m| model_capability("rerank", m, None, checked_at)),
                "verification": "verified",
            }))
        }
        _ => Err(invalid(String::new())),
    }
}

/// The platform's `buildKnowledgeSpaceVectorSpaceId`, without (`identity: None`) or with the
/// install identity of a capability.
pub fn vector_space_id(sel: &Selection, revision: i64, identity: Option<&Value>) -> String {
    let mut material = json!({ "model": sel.model, "pluginId": sel.plugin_id, "provider": sel.provider,
                               "revision": revision, "schemaVersion": if identity.is_some() { 2 } else { 1 } });
    if let Some(id) = identity {
        material["installIdentity"] = id.clone();
    }
    format!("embedding-space-sha256:{}", stable_digest(&material))
}

#[cfg(test)]
pub(crate) mod fixtures {
    use super::*;

    pub(crate) const AT: &str = "2026-05-27T10:00:00.000Z";

    pub(crate) fn sel() -> Selection {
        Selection {
            model: "text-embedding-3-small".into(),
            plugin_id: "langgenius/openai".into(),
            provider: "openai".into(),
        }
    }

    pub(crate) fn embedding(dimension: Option<i64>) -> Value {
        let mut v = sel().to_json();
        v["revision"] = json!(1);
        v["vectorSpaceId"] = json!(vector_space_id(&sel(), 1, None));
        if let Some(d) = dimension {
            v["dimension"] = json!(d);
        }
        v
    }

    pub(crate) fn retrieval(rerank: bool) -> Value {
        let m =
            json!({"model": "gpt-4o-mini", "pluginId": "langgenius/openai", "provider": "openai"});
        let mut r = json!({"enabled": rerank});
        if rerank {
            r["model"] = json!({"model": "rerank-v3", "pluginId": "langgenius/cohere", "provider": "cohere"});
        }
        json!({"defaultMode": "research", "reasoningModel": m, "rerank": r, "topK": 8, "revision": 1})
    }

    pub(crate) fn code<T: std::fmt::Debug>(r: Result<T, JobError>) -> Result<T, String> {
        r.map_err(|e| {
            assert!(
                matches!(e, JobError::Fatal { .. }),
                "refusals are final: {e:?}"
            );
            e.code().to_owned()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::*;
    use super::*;

    #[test]
    fn the_legacy_vector_space_id_is_the_platforms() {
        assert_eq!(
            vector_space_id(&sel(), 1, None),
            "embedding-space-sha256:dee54439e74d6aa00be2145649df55d567e0587ee48bd89a7b27a9b10a846fa1"
        );
        assert_ne!(
            vector_space_id(&sel(), 1, Some(&json!({"x": 1}))),
            vector_space_id(&sel(), 1, None)
        );
    }

    #[test]
    fn preflight_stand_in_table() {
        let mut extra = embedding(Some(8));
        extra["capabilities"] = json!({});
        let mut padded = embedding(Some(8));
        padded["model"] = json!("  text-embedding-3-small ");
        let mut threshold = retrieval(false);
        threshold["scoreThreshold"] = json!({"enabled": true, "stage": "mode-final", "value": 0.5});
        let mut fast_threshold = threshold.clone();
        fast_threshold["defaultMode"] = json!("fast");
        let mut no_model = retrieval(false);
        no_model["rerank"] = json!({"enabled": true});
        let table: Vec<(&str, Value, bool)> = vec![
            ("embedding", embedding(Some(8)), true),
            // Shape is the schema's; the dimension is needed only later, by normalization.
            ("embedding", embedding(None), true),
            ("embedding", padded, true),
            ("embedding", extra, false),
            (
                "embedding",
                json!({"model": "m", "pluginId": "p", "provider": "o", "revision": 1,
                                 "vectorSpaceId": "openai:m:8"}),
                false,
            ),
            ("embedding", retrieval(false), false),
            ("retrieval", retrieval(false), true),
            ("retrieval", retrieval(true), true),
            ("retrieval", threshold, true),
            ("retrieval", fast_threshold, false),
            ("retrieval", no_model, false),
            ("retrieval", embedding(Some(8)), false),
            ("retrieval", json!("not an object"), false),
            ("vector", retrieval(false), false),
        ];
        for (kind, snap, ok) in table {
            let got = code(derive_capability(kind, &snap, AT));
            assert_eq!(got.is_ok(), ok, "{kind} {snap}: {got:?}");
            if let Err(c) = got {
                assert_eq!(c, CAPABILITY_INVALID);
            }
        }
        // Derivation is deterministic and has the platform's shape.
        let cap = derive_capability("embedding", &embedding(Some(8)), AT).unwrap();
        assert_eq!(
            cap,
            derive_capability("embedding", &embedding(Some(8)), AT).unwrap()
        );
        let mut keys: Vec<&str> = cap
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "capabilityDigest",
                "checkedAt",
                "dimension",
                "distanceMetric",
                "kind",
                "pluginUniqueIdentifier",
                "schemaFingerprint",
                "selection"
            ]
        );
        assert!(cap["capabilityDigest"]
            .as_str()
            .unwrap()
            .starts_with("sha256:"));
        let r = derive_capability("retrieval", &retrieval(false), AT).unwrap();
        assert_eq!(r["rerank"], Value::Null);
        assert_eq!(r["verification"], "verified");
        assert!(r["reasoning"].get("dimension").is_none());
    }
}
