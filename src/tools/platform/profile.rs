//! Active embedding and retrieval profiles, as the platform's profile activation leaves them.
//! Invariant: the manifest's profile key, the active profile revision and its head are written
//! together, and every digest is the platform's canonical digest of what is stored beside it; a
//! space's later activation of a kind supersedes its active revision of that kind and moves the
//! kind's one head to the next revision, so a space has at most one active revision per kind.

use chrono::Utc;
use serde_json::{json, Value};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::canonical::{sha256_hex, stable_digest};
use crate::embed::Profile;

/// The platform's vector space id of an embedding selection at a profile revision (the legacy
/// form, without an install identity).
pub fn vector_space_id(model: &str, plugin_id: &str, provider: &str, revision: i32) -> String {
    format!(
        "embedding-space-sha256:{}",
        stable_digest(
            &json!({ "model": model, "pluginId": plugin_id, "provider": provider,
                               "revision": revision, "schemaVersion": 1 })
        )
    )
}

/// One active profile revision as the platform's activation writes it.
struct ActiveProfile<'a> {
    kind: &'static str,
    /// The manifest metadata key that mirrors the active snapshot.
    manifest_key: &'static str,
    /// The next revision of the kind in the space ([`next_revision`]).
    revision: i32,
    snapshot: &'a Value,
    capability: &'a Value,
    plugin_id: &'a str,
    provider: &'a str,
    model: &'a str,
    vector_space_id: Option<&'a str>,
    dimension: Option<i32>,
}

/// The revision the space's next activation of `kind` gets: one past its highest.
async fn next_revision(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    kind: &str,
) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT coalesce(max(revision), 0) + 1 FROM knowledge_space_profile_revisions \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND kind = $3",
    )
    .bind(tenant)
    .bind(space)
    .bind(kind)
    .fetch_one(conn)
    .await
}

/// Writes the manifest's profile key (manifest version + 1), supersedes the kind's active
/// revision if there is one, writes the new active revision (created by the space's owner) and
/// points the kind's head at it (created, or moved with its row version + 1); returns the new
/// revision's id.
async fn write_active_profile(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    p: ActiveProfile<'_>,
) -> Result<Uuid, sqlx::Error> {
    sqlx::query(
        "UPDATE knowledge_space_manifests SET metadata = metadata || jsonb_build_object($3::text, $4::jsonb), \
           manifest_version = manifest_version + 1, updated_at = now() \
         WHERE tenant_id = $1 AND knowledge_space_id = $2",
    )
    .bind(tenant)
    .bind(space)
    .bind(p.manifest_key)
    .bind(p.snapshot)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "UPDATE knowledge_space_profile_revisions SET state = 'superseded', superseded_at = now(), updated_at = now() \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND kind = $3 AND state = 'active'",
    )
    .bind(tenant)
    .bind(space)
    .bind(p.kind)
    .execute(&mut *conn)
    .await?;
    let revision_id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO knowledge_space_profile_revisions (id, tenant_id, knowledge_space_id, kind, revision, state, snapshot, \
           snapshot_digest, capability_snapshot, capability_snapshot_digest, plugin_id, provider, model, vector_space_id, \
           dimension, created_by_subject_id, created_at, updated_at, activated_at) \
         SELECT $1, $2, $3, $4, $5, 'active', $6, $7, $8, $9, $10, $11, $12, $13, $14, p.owner_subject_id, \
           now(), now(), now() \
         FROM knowledge_space_access_policies p WHERE p.tenant_id = $2 AND p.knowledge_space_id = $3",
    )
    .bind(revision_id)
    .bind(tenant)
    .bind(space)
    .bind(p.kind)
    .bind(p.revision)
    .bind(p.snapshot)
    .bind(stable_digest(p.snapshot))
    .bind(p.capability)
    .bind(stable_digest(p.capability))
    .bind(p.plugin_id)
    .bind(p.provider)
    .bind(p.model)
    .bind(p.vector_space_id)
    .bind(p.dimension)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO knowledge_space_profile_heads (id, tenant_id, knowledge_space_id, kind, profile_revision_id, \
           active_revision, row_version, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, 1, now(), now()) \
         ON CONFLICT (tenant_id, knowledge_space_id, kind) DO UPDATE SET \
           profile_revision_id = EXCLUDED.profile_revision_id, active_revision = EXCLUDED.active_revision, \
           row_version = knowledge_space_profile_heads.row_version + 1, updated_at = now()",
    )
    .bind(Uuid::new_v4())
    .bind(tenant)
    .bind(space)
    .bind(p.kind)
    .bind(revision_id)
    .bind(p.revision)
    .execute(conn)
    .await?;
    Ok(revision_id)
}

/// A capability check's time stamp as the platform writes it (UTC, milliseconds).
fn checked_at() -> String {
    Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Gives the space an active embedding profile at its next revision (1 for a space without
/// one): the manifest's profile key (manifest version + 1), the active profile revision and its
/// head, as the platform's profile activation leaves them; an earlier revision is superseded.
pub async fn activate_embedding_profile(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    model: &str,
    provider: &str,
    dimension: usize,
) -> Result<Profile, sqlx::Error> {
    let plugin_id = format!("langgenius/{provider}");
    let revision = next_revision(conn, tenant, space, "embedding").await?;
    let vsid = vector_space_id(model, &plugin_id, provider, revision);
    let snapshot = json!({ "dimension": dimension, "model": model, "pluginId": plugin_id, "provider": provider,
                           "revision": revision, "vectorSpaceId": vsid });
    let capability = json!({
        "capabilityDigest": format!("sha256:{}", stable_digest(&json!({"dimension": dimension, "kind": "embedding",
            "model": model}))),
        "checkedAt": checked_at(),
        "dimension": dimension, "distanceMetric": "cosine", "kind": "embedding",
        "pluginUniqueIdentifier": format!("{plugin_id}:0.0.1"),
        "schemaFingerprint": format!("sha256:{}", sha256_hex(model.as_bytes())),
        "selection": { "model": model, "pluginId": plugin_id, "provider": provider },
    });
    let revision_id = write_active_profile(
        conn,
        tenant,
        space,
        ActiveProfile {
            kind: "embedding",
            manifest_key: "__knowledgeFsEmbeddingProfile",
            revision,
            snapshot: &snapshot,
            capability: &capability,
            plugin_id: &plugin_id,
            provider,
            model,
            vector_space_id: Some(&vsid),
            dimension: Some(i32::try_from(dimension).unwrap_or(i32::MAX)),
        },
    )
    .await?;
    Ok(Profile {
        revision_id,
        revision,
        model: model.into(),
        plugin_id,
        provider: provider.into(),
        vector_space_id: vsid,
        dimension,
    })
}

/// Gives the space an active retrieval profile at its next revision (manifest key, revision,
/// head), as the platform's activation writes it; an earlier revision is superseded. `research`
/// mode, ten results, no reranking.
pub async fn activate_retrieval_profile(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    model: &str,
    provider: &str,
) -> Result<Uuid, sqlx::Error> {
    let plugin_id = format!("langgenius/{provider}");
    let revision = next_revision(conn, tenant, space, "retrieval").await?;
    let selection = json!({ "model": model, "pluginId": plugin_id, "provider": provider });
    let snapshot = json!({ "defaultMode": "research", "reasoningModel": selection,
                           "rerank": { "enabled": false }, "revision": revision, "topK": 10 });
    let reasoning = json!({
        "capabilityDigest": format!("sha256:{}", stable_digest(&json!({"kind": "reasoning", "selection": selection}))),
        "checkedAt": checked_at(),
        "kind": "reasoning", "pluginUniqueIdentifier": format!("{plugin_id}:0.0.1"),
        "schemaFingerprint": format!("sha256:{}", sha256_hex(model.as_bytes())),
        "selection": selection,
    });
    let capability = json!({ "reasoning": reasoning, "rerank": null, "verification": "verified" });
    write_active_profile(
        conn,
        tenant,
        space,
        ActiveProfile {
            kind: "retrieval",
            manifest_key: "__knowledgeFsRetrievalProfile",
            revision,
            snapshot: &snapshot,
            capability: &capability,
            plugin_id: &plugin_id,
            provider,
            model,
            vector_space_id: None,
            dimension: None,
        },
    )
    .await
}
