//! The profile backfill decision as pure functions, in the platform's order and with its codes.
//! Invariant: an initial profile head is installed only when the space is writable, its locked
//! manifest is still at the discovered version, the manifest's profile key still hashes to the
//! discovered digest (SHA-256 of `stableJson`), the profile parses strictly as the platform's
//! schema of its kind, its capability matches it (and an embedding profile's vector space id is
//! the one its selection, revision and capability give), and no head and no revision of that
//! revision number exist; a head that already points at exactly this snapshot and capability is
//! success without a write. Every refusal is final.
//!
//! The platform observes a model's capability over the network before it processes a backfill
//! (its preflight). kfs-worker cannot: the capability it checks here is the one
//! [`super::profile::derive_capability`] derives from the discovered profile itself.

use serde_json::{json, Value};

use super::profile::{integer, parse_embedding, parse_retrieval, vector_space_id, Selection};
use crate::canonical::stable_digest;
use crate::jobs::JobError;

/// The profile kinds and the manifest metadata key each is read from.
pub const KINDS: [(&str, &str); 2] = [
    ("embedding", "__knowledgeFsEmbeddingProfile"),
    ("retrieval", "__knowledgeFsRetrievalProfile"),
];

/// The platform's failure codes of a backfill; every other failure is recorded as the
/// platform's runtime records it, [`super::profile::CAPABILITY_INVALID`].
pub const CODES: [&str; 8] = [
    "KNOWLEDGE_SPACE_NOT_WRITABLE",
    "LEGACY_MANIFEST_NOT_FOUND",
    "LEGACY_PROFILE_SOURCE_CHANGED",
    "LEGACY_PROFILE_INVALID",
    "PROFILE_HEAD_ALREADY_EXISTS",
    "PROFILE_REVISION_ALREADY_EXISTS",
    "PROFILE_BACKFILL_CAPABILITY_INVALID",
    EXHAUSTED,
];

/// The code of a backfill that used up its execution attempts.
pub const EXHAUSTED: &str = "PROFILE_BACKFILL_ATTEMPTS_EXHAUSTED";

/// Who the platform records as the creator of a backfilled revision.
pub const SYSTEM_ACTOR: &str = "system:legacy-profile-backfill";

/// The manifest metadata key of a profile kind.
pub fn metadata_key(kind: &str) -> Option<&'static str> {
    KINDS.iter().find(|(k, _)| *k == kind).map(|(_, key)| *key)
}

/// The platform's digest of a profile snapshot: hex SHA-256 of its `stableJson`.
pub fn digest(v: &Value) -> String {
    stable_digest(v)
}

fn refuse(code: &str, message: impl Into<String>) -> JobError {
    JobError::fatal(code, message)
}

/// What the step found under the space's and the manifest's locks.
#[derive(Clone, Debug, PartialEq)]
pub struct SourceFacts {
    /// The space exists, is active, has no deletion job id and no active deletion job.
    pub space_writable: bool,
    /// The manifest's version and metadata, if the space has a manifest.
    pub manifest: Option<(i32, Value)>,
    pub kind: String,
    pub source_manifest_version: i32,
    pub recorded_digest: String,
}

/// Revalidates the discovered source. Returns the manifest's current profile of the kind.
pub fn check_source(f: &SourceFacts) -> Result<Value, JobError> {
    if !f.space_writable {
        return Err(refuse(
            "KNOWLEDGE_SPACE_NOT_WRITABLE",
            "Knowledge space is missing, deleting, or deletion-fenced",
        ));
    }
    let Some((version, metadata)) = &f.manifest else {
        return Err(refuse(
            "LEGACY_MANIFEST_NOT_FOUND",
            "Legacy knowledge-space manifest was not found",
        ));
    };
    let source = metadata_key(&f.kind).and_then(|k| metadata.get(k));
    match source {
        Some(s) if s.is_object() && *version == f.source_manifest_version && digest(s) == f.recorded_digest.trim() => {
            Ok(s.clone())
        }
        _ => Err(refuse(
            "LEGACY_PROFILE_SOURCE_CHANGED",
            "Legacy manifest profile changed after backfill discovery; stale snapshot was not activated",
        )),
    }
}

/// A profile ready to be written as an active revision.
#[derive(Clone, Debug, PartialEq)]
pub struct Normalized {
    pub snapshot: Value,
    pub capability: Value,
    pub revision: i32,
    pub plugin_id: String,
    pub provider: String,
    pub model: String,
    pub vector_space_id: Option<String>,
    pub dimension: Option<i32>,
}

fn same_selection(capability: &Value, sel: &Selection) -> bool {
    capability.get("selection") == Some(&sel.to_json())
}

/// The platform's `normalizeLegacyProfile`: the snapshot and capability to install, or
/// `LEGACY_PROFILE_INVALID`.
pub fn normalize(kind: &str, source: &Value, capability: &Value) -> Result<Normalized, JobError> {
    let invalid = |m: String| refuse("LEGACY_PROFILE_INVALID", m);
    if kind == "embedding" {
        let p = parse_embedding(source).map_err(invalid)?;
        let Some(dimension) = capability.get("dimension").and_then(integer) else {
            return Err(invalid(
                "Embedding capability snapshots require an observed dimension: the legacy embedding profile \
                 has no dimension, and kfs-worker cannot observe one without the model capability preflight"
                    .into(),
            ));
        };
        if capability.get("kind").and_then(Value::as_str) != Some("embedding")
            || capability
                .get("distanceMetric")
                .and_then(Value::as_str)
                .is_none()
            || !same_selection(capability, &p.selection)
        {
            return Err(invalid(
                "Legacy embedding capability does not match the frozen profile selection".into(),
            ));
        }
        let identity = json!({
            "capabilityDigest": capability["capabilityDigest"], "dimension": dimension,
            "distanceMetric": capability["distanceMetric"],
            "pluginUniqueIdentifier": capability["pluginUniqueIdentifier"],
            "schemaFingerprint": capability["schemaFingerprint"],
        });
        if p.vector_space_id != vector_space_id(&p.selection, p.revision, None)
            && p.vector_space_id != vector_space_id(&p.selection, p.revision, Some(&identity))
        {
            return Err(invalid(
                "Legacy embedding vector-space identity is not proven by the installed model capability".into(),
            ));
        }
        if p.dimension.is_some_and(|d| d != dimension) {
            return Err(invalid(
                "Legacy embedding dimension conflicts with the observed model dimension".into(),
            ));
        }
        let mut snapshot = p.selection.to_json();
        snapshot["dimension"] = json!(dimension);
        snapshot["revision"] = json!(p.revision);
        snapshot["vectorSpaceId"] = json!(p.vector_space_id);
        return Ok(Normalized {
            snapshot,
            capability: capability.clone(),
            revision: p.revision as i32,
            plugin_id: p.selection.plugin_id,
            provider: p.selection.provider,
            model: p.selection.model,
            vector_space_id: Some(p.vector_space_id),
            dimension: i32::try_from(dimension).ok(),
        });
    }
    let p = parse_retrieval(source).map_err(invalid)?;
    if capability.get("verification").and_then(Value::as_str) != Some("verified") {
        return Err(invalid(
            "Legacy retrieval capability snapshot was not verified".into(),
        ));
    }
    let reasoning = &capability["reasoning"];
    if reasoning.get("kind").and_then(Value::as_str) != Some("reasoning")
        || !same_selection(reasoning, &p.reasoning)
    {
        return Err(invalid(
            "Legacy reasoning capability does not match the frozen retrieval profile".into(),
        ));
    }
    let rerank = capability.get("rerank").filter(|r| !r.is_null());
    match (&p.rerank, rerank) {
        (Some(m), Some(r))
            if r.get("kind").and_then(Value::as_str) == Some("rerank") && same_selection(r, m) => {}
        (Some(_), _) => {
            return Err(invalid(
                "Legacy rerank capability does not match the frozen retrieval profile".into(),
            ))
        }
        (None, Some(_)) => {
            return Err(invalid(
                "Disabled legacy rerank profile contains a capability snapshot".into(),
            ))
        }
        (None, None) => {}
    }
    Ok(Normalized {
        snapshot: p.value.clone(),
        capability: json!({ "reasoning": reasoning, "rerank": rerank.cloned(), "verification": "verified" }),
        revision: p.revision as i32,
        plugin_id: p.reasoning.plugin_id,
        provider: p.reasoning.provider,
        model: p.reasoning.model,
        vector_space_id: None,
        dimension: None,
    })
}

/// The space's current head of the kind, with its revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeadFact {
    pub snapshot_digest: String,
    pub capability_digest: String,
    pub state: String,
    pub active_revision: i32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Write the active revision and the initial head.
    Install,
    /// The head already is exactly this profile: succeed without writing.
    AlreadyActive,
}

/// Whether to install, given the head of the kind and whether a revision with the profile's
/// revision number exists already.
pub fn decide(
    n: &Normalized,
    head: Option<&HeadFact>,
    revision_taken: bool,
) -> Result<Plan, JobError> {
    match head {
        Some(h)
            if h.snapshot_digest.trim() == digest(&n.snapshot)
                && h.capability_digest.trim() == digest(&n.capability)
                && h.state == "active"
                && h.active_revision == n.revision =>
        {
            Ok(Plan::AlreadyActive)
        }
        Some(_) => Err(refuse(
            "PROFILE_HEAD_ALREADY_EXISTS",
            "A different versioned profile head already exists; legacy data was not activated",
        )),
        None if revision_taken => Err(refuse(
            "PROFILE_REVISION_ALREADY_EXISTS",
            "A profile revision exists without the expected head; legacy data was not activated",
        )),
        None => Ok(Plan::Install),
    }
}

#[cfg(test)]
mod tests {
    use super::super::profile::fixtures::*;
    use super::super::profile::{derive_capability, model_capability, Selection};
    use super::*;

    fn facts(writable: bool, manifest: Option<(i32, Value)>) -> SourceFacts {
        SourceFacts {
            space_writable: writable,
            manifest,
            kind: "embedding".into(),
            source_manifest_version: 2,
            recorded_digest: digest(&embedding(Some(8))),
        }
    }

    #[test]
    fn source_table() {
        let meta = |v: Value| json!({ "__knowledgeFsEmbeddingProfile": v, "other": 1 });
        let table: Vec<(SourceFacts, Result<Value, &str>)> = vec![
            (
                facts(true, Some((2, meta(embedding(Some(8)))))),
                Ok(embedding(Some(8))),
            ),
            (
                facts(false, Some((2, meta(embedding(Some(8)))))),
                Err("KNOWLEDGE_SPACE_NOT_WRITABLE"),
            ),
            (facts(true, None), Err("LEGACY_MANIFEST_NOT_FOUND")),
            (
                facts(true, Some((3, meta(embedding(Some(8)))))),
                Err("LEGACY_PROFILE_SOURCE_CHANGED"),
            ),
            (
                facts(true, Some((2, meta(embedding(Some(9)))))),
                Err("LEGACY_PROFILE_SOURCE_CHANGED"),
            ),
            (
                facts(true, Some((2, json!({})))),
                Err("LEGACY_PROFILE_SOURCE_CHANGED"),
            ),
            (
                facts(true, Some((2, meta(json!("x"))))),
                Err("LEGACY_PROFILE_SOURCE_CHANGED"),
            ),
        ];
        for (f, want) in table {
            assert_eq!(code(check_source(&f)), want.map_err(str::to_owned), "{f:?}");
        }
    }

    #[test]
    fn normalization_table() {
        let cap = |s: &Value| derive_capability("embedding", s, AT).unwrap();
        let other_vsid = {
            let mut v = embedding(Some(8));
            v["vectorSpaceId"] = json!(format!("embedding-space-sha256:{}", "a".repeat(64)));
            v
        };
        let foreign_cap = model_capability(
            "embedding",
            &Selection {
                model: "other".into(),
                ..sel()
            },
            Some(8),
            AT,
        );
        let table: Vec<(&str, Value, Value, Result<(), &str>)> = vec![
            (
                "embedding",
                embedding(Some(8)),
                cap(&embedding(Some(8))),
                Ok(()),
            ),
            (
                "embedding",
                embedding(None),
                cap(&embedding(None)),
                Err("LEGACY_PROFILE_INVALID"),
            ),
            (
                "embedding",
                other_vsid.clone(),
                cap(&other_vsid),
                Err("LEGACY_PROFILE_INVALID"),
            ),
            (
                "embedding",
                embedding(Some(8)),
                foreign_cap,
                Err("LEGACY_PROFILE_INVALID"),
            ),
            (
                "embedding",
                embedding(Some(8)),
                cap(&embedding(Some(9))),
                Err("LEGACY_PROFILE_INVALID"),
            ),
            (
                "retrieval",
                retrieval(false),
                derive_capability("retrieval", &retrieval(false), AT).unwrap(),
                Ok(()),
            ),
            (
                "retrieval",
                retrieval(true),
                derive_capability("retrieval", &retrieval(true), AT).unwrap(),
                Ok(()),
            ),
            (
                "retrieval",
                retrieval(false),
                derive_capability("retrieval", &retrieval(true), AT).unwrap(),
                Err("LEGACY_PROFILE_INVALID"),
            ),
            (
                "retrieval",
                retrieval(true),
                derive_capability("retrieval", &retrieval(false), AT).unwrap(),
                Err("LEGACY_PROFILE_INVALID"),
            ),
        ];
        for (kind, source, capability, want) in table {
            let got = code(normalize(kind, &source, &capability)).map(|_| ());
            assert_eq!(got, want.map_err(str::to_owned), "{kind} {source}");
        }
        let n = normalize("embedding", &embedding(Some(8)), &cap(&embedding(Some(8)))).unwrap();
        assert_eq!(n.snapshot, embedding(Some(8)));
        assert_eq!((n.dimension, n.revision), (Some(8), 1));
        assert_eq!(
            n.vector_space_id.as_deref(),
            embedding(None)["vectorSpaceId"].as_str()
        );
        let r = normalize(
            "retrieval",
            &retrieval(true),
            &derive_capability("retrieval", &retrieval(true), AT).unwrap(),
        )
        .unwrap();
        assert_eq!(
            (r.model.as_str(), r.vector_space_id, r.dimension),
            ("gpt-4o-mini", None, None)
        );
        assert_eq!(r.snapshot, retrieval(true));
    }

    #[test]
    fn decision_table() {
        let n = normalize(
            "embedding",
            &embedding(Some(8)),
            &derive_capability("embedding", &embedding(Some(8)), AT).unwrap(),
        )
        .unwrap();
        let same = HeadFact {
            snapshot_digest: digest(&n.snapshot),
            capability_digest: digest(&n.capability),
            state: "active".into(),
            active_revision: 1,
        };
        let table: Vec<(Option<HeadFact>, bool, Result<Plan, &str>)> = vec![
            (None, false, Ok(Plan::Install)),
            (None, true, Err("PROFILE_REVISION_ALREADY_EXISTS")),
            (Some(same.clone()), false, Ok(Plan::AlreadyActive)),
            (
                Some(HeadFact {
                    capability_digest: "0".repeat(64),
                    ..same.clone()
                }),
                false,
                Err("PROFILE_HEAD_ALREADY_EXISTS"),
            ),
            (
                Some(HeadFact {
                    snapshot_digest: "0".repeat(64),
                    ..same.clone()
                }),
                false,
                Err("PROFILE_HEAD_ALREADY_EXISTS"),
            ),
            (
                Some(HeadFact {
                    state: "superseded".into(),
                    ..same.clone()
                }),
                false,
                Err("PROFILE_HEAD_ALREADY_EXISTS"),
            ),
            (
                Some(HeadFact {
                    active_revision: 2,
                    ..same
                }),
                true,
                Err("PROFILE_HEAD_ALREADY_EXISTS"),
            ),
        ];
        for (head, taken, want) in table {
            assert_eq!(
                code(decide(&n, head.as_ref(), taken)),
                want.map_err(str::to_owned),
                "{head:?}"
            );
        }
    }
}
