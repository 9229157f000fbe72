//! The published runtime snapshot the platform freezes into a task's metadata at admission
//! (`__knowledgeFsPublishedRuntimeSnapshot`): the space's head publication, its retrieval profile
//! and, when it has one, its embedding profile with that profile's capability snapshot.
//! Invariant: a task reads the publication and vector space frozen when it was requested, never a
//! later one; a frozen snapshot that does not parse in the platform's strict shape, or names
//! another tenant or space, fails the task closed (`RESEARCH_TASK_RUNTIME_SNAPSHOT_INVALID`). A
//! task admitted while its space had no head (kfs-worker admits it; see `request`) freezes
//! nothing and reads the head current at its retrieving step.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::embed::Profile;

pub const METADATA_KEY: &str = "__knowledgeFsPublishedRuntimeSnapshot";
/// The platform's record of how an `auto` request was routed.
pub const AUTO_MODE_KEY: &str = "__knowledgeFsAutoRetrievalModeDecision";
pub const INVALID: &str = "RESEARCH_TASK_RUNTIME_SNAPSHOT_INVALID";

/// `projectionSnapshot`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProjectionSnapshot {
    pub fingerprint: String,
    pub head_revision: i32,
    pub knowledge_space_id: Uuid,
    pub projection_version: i32,
    pub publication_id: Uuid,
    pub tenant_id: String,
}

/// `embeddingProfile`: the profile revision's snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EmbeddingProfile {
    pub dimension: usize,
    pub model: String,
    pub plugin_id: String,
    pub provider: String,
    pub revision: i32,
    pub vector_space_id: String,
}

/// The frozen tuple.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RuntimeSnapshot {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding_capability_snapshot: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding_profile: Option<EmbeddingProfile>,
    pub projection_snapshot: ProjectionSnapshot,
    pub retrieval_capability_snapshot: Value,
    /// The active retrieval profile's snapshot; `null` for a space that has none (kfs-worker's
    /// fixtures and spaces of older writers), whose tasks use the platform's defaults.
    pub retrieval_profile: Value,
}

impl RuntimeSnapshot {
    /// `retrievalProfile.defaultMode`, when the profile names one.
    pub fn default_mode(&self) -> Option<&str> {
        self.retrieval_profile.get("defaultMode")?.as_str()
    }

    /// `retrievalProfile.topK`, when the profile names one.
    pub fn top_k(&self) -> Option<i32> {
        self.retrieval_profile
            .get("topK")?
            .as_i64()
            .and_then(|k| i32::try_from(k).ok())
    }
}

/// Parses a frozen snapshot and checks that it belongs to this tenant and space. Pure.
pub fn validate(v: &Value, tenant: &str, space: Uuid) -> Result<RuntimeSnapshot, String> {
    let s: RuntimeSnapshot = serde_json::from_value(v.clone())
        .map_err(|e| format!("the task's published runtime snapshot is malformed: {e}"))?;
    let p = &s.projection_snapshot;
    if p.tenant_id != tenant || p.knowledge_space_id != space {
        return Err("the task's published runtime snapshot names another tenant or space".into());
    }
    if p.head_revision < 1 || p.projection_version < 1 || p.fingerprint.is_empty() {
        return Err("the task's published runtime snapshot names no published head".into());
    }
    if s.embedding_profile.is_some() != s.embedding_capability_snapshot.is_some() {
        return Err(
            "the embedding profile and its capability snapshot must be frozen together".into(),
        );
    }
    if !s.retrieval_capability_snapshot.is_object()
        || s.embedding_capability_snapshot
            .as_ref()
            .is_some_and(|c| !c.is_object())
    {
        return Err("the task's frozen capability snapshots are not objects".into());
    }
    if !(s.retrieval_profile.is_null() || s.retrieval_profile.is_object()) {
        return Err("the task's frozen retrieval profile is not an object".into());
    }
    Ok(s)
}

/// The active profile revision of `kind`: (id, snapshot, capability snapshot).
async fn active_profile(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    kind: &str,
) -> Result<Option<(Uuid, Value, Value)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT r.id, r.snapshot, r.capability_snapshot FROM knowledge_space_profile_heads h \
         JOIN knowledge_space_profile_revisions r ON r.id = h.profile_revision_id AND r.tenant_id = h.tenant_id \
           AND r.knowledge_space_id = h.knowledge_space_id AND r.kind = h.kind AND r.revision = h.active_revision \
         WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2 AND h.kind = $3 AND r.state = 'active'",
    )
    .bind(tenant)
    .bind(space)
    .bind(kind)
    .fetch_optional(conn)
    .await
}

/// The space's runtime tuple now: `None` when it has no published head.
pub async fn capture(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<Option<RuntimeSnapshot>, sqlx::Error> {
    let Some(head) = crate::publication::head(conn, tenant, space, false).await? else {
        return Ok(None);
    };
    let (embedding_profile, embedding_capability_snapshot) =
        match active_profile(conn, tenant, space, "embedding").await? {
            Some((_, snap, cap)) => match serde_json::from_value::<EmbeddingProfile>(snap) {
                Ok(p) => (Some(p), Some(cap)),
                Err(_) => (None, None),
            },
            None => (None, None),
        };
    let (retrieval_profile, retrieval_capability_snapshot) =
        match active_profile(conn, tenant, space, "retrieval").await? {
            Some((_, snap, cap)) => (snap, cap),
            None => (Value::Null, serde_json::json!({})),
        };
    Ok(Some(RuntimeSnapshot {
        embedding_capability_snapshot,
        embedding_profile,
        projection_snapshot: ProjectionSnapshot {
            fingerprint: head.fingerprint,
            head_revision: head.revision,
            knowledge_space_id: space,
            projection_version: head.projection_version,
            publication_id: head.publication_id,
            tenant_id: tenant.to_owned(),
        },
        retrieval_capability_snapshot,
        retrieval_profile,
    }))
}

/// The embedder's view of a frozen embedding profile (the revision row's id when it still
/// exists).
pub async fn profile_of(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    p: &EmbeddingProfile,
) -> Result<Profile, sqlx::Error> {
    let id: Option<Uuid> = sqlx::query_scalar(
        "SELECT id FROM knowledge_space_profile_revisions \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND kind = 'embedding' AND revision = $3",
    )
    .bind(tenant)
    .bind(space)
    .bind(p.revision)
    .fetch_optional(conn)
    .await?;
    Ok(Profile {
        revision_id: id.unwrap_or_default(),
        revision: p.revision,
        model: p.model.clone(),
        plugin_id: p.plugin_id.clone(),
        provider: p.provider.clone(),
        vector_space_id: p.vector_space_id.clone(),
        dimension: p.dimension,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn good(space: Uuid) -> Value {
        json!({
            "projectionSnapshot": {"fingerprint": "projection-set-sha256:ab", "headRevision": 2,
              "knowledgeSpaceId": space, "projectionVersion": 1, "publicationId": Uuid::from_u128(9),
              "tenantId": "t1"},
            "retrievalCapabilitySnapshot": {}, "retrievalProfile": null
        })
    }

    #[test]
    fn validation_table() {
        let space = Uuid::from_u128(1);
        let s = validate(&good(space), "t1", space).unwrap();
        assert_eq!(s.projection_snapshot.publication_id, Uuid::from_u128(9));
        assert_eq!(serde_json::to_value(&s).unwrap(), good(space), "round trip");
        let with = |f: &dyn Fn(&mut Value)| {
            let mut v = good(space);
            f(&mut v);
            validate(&v, "t1", space).unwrap_err()
        };
        let table: Vec<(String, &str)> = vec![
            (
                validate(&good(space), "t2", space).unwrap_err(),
                "another tenant",
            ),
            (
                validate(&good(space), "t1", Uuid::nil()).unwrap_err(),
                "another tenant or space",
            ),
            (
                with(&|v| v["projectionSnapshot"]["headRevision"] = json!(0)),
                "no published head",
            ),
            (
                with(&|v| v["projectionSnapshot"]["extra"] = json!(1)),
                "malformed",
            ),
            (
                with(&|v| v["attackerControlled"] = json!(true)),
                "malformed",
            ),
            (
                with(&|v| v["embeddingCapabilitySnapshot"] = json!({})),
                "frozen together",
            ),
            (
                with(&|v| v["retrievalCapabilitySnapshot"] = json!([])),
                "not objects",
            ),
            (
                with(&|v| v["retrievalProfile"] = json!("deep")),
                "not an object",
            ),
            (
                with(&|v| *v = json!({"attackerControlled": true})),
                "malformed",
            ),
        ];
        for (err, needle) in table {
            assert!(err.contains(needle), "{err:?} should say {needle:?}");
        }
        let mut v = good(space);
        v["retrievalProfile"] = json!({"defaultMode": "deep", "topK": 37});
        let s = validate(&v, "t1", space).unwrap();
        assert_eq!((s.default_mode(), s.top_k()), (Some("deep"), Some(37)));
    }
}
