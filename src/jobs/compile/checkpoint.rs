//! The raw-parse checkpoint of a document version (`parse_artifact_checkpoints`, the platform's
//! 0047): the parse of a PDF or office document, kept between the parse (done before the
//! first step's fence, outside any transaction) and the step that stores it as the canonical
//! artifact. Invariant: a checkpoint is written only under a live lease of an attempt on that
//! document version, is reused only when its policy fingerprint is the one the route would
//! parse with now, and is deleted in the transaction that stores the canonical artifact and
//! moves the attempt to `parsed`.

use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use super::parse::route::Artifact;
use crate::engine::kind::JobCtx;

/// The checkpoint of `(asset, version)` when it was made under `fingerprint`.
pub async fn matching(
    conn: &mut PgConnection,
    asset: Uuid,
    version: i32,
    fingerprint: &str,
) -> Result<Option<Artifact>, sqlx::Error> {
    let row: Option<Value> = sqlx::query_scalar(
        "SELECT artifact FROM parse_artifact_checkpoints \
         WHERE document_asset_id = $1 AND version = $2 AND policy_fingerprint = $3",
    )
    .bind(asset)
    .bind(version)
    .bind(fingerprint)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(row.and_then(|a| Artifact::from_json(&a, asset, version)))
}

/// Writes (or replaces) the checkpoint of `(asset, version)` while `job`'s lease on its attempt
/// is live. `false`: the lease is not, and nothing was written.
pub async fn write(
    conn: &mut PgConnection,
    job: &JobCtx,
    asset: Uuid,
    version: i32,
    fingerprint: &str,
    artifact: &Value,
) -> Result<bool, sqlx::Error> {
    let n = sqlx::query(
        "INSERT INTO parse_artifact_checkpoints \
           (document_asset_id, version, policy_fingerprint, artifact, created_at, updated_at) \
         SELECT $1, $2, $3, $4, now(), now() \
         WHERE EXISTS (SELECT 1 FROM document_compilation_attempts a \
                       WHERE a.id = $5 AND a.lease_token = $6 AND a.run_state = 'running' \
                         AND a.lease_expires_at > now() AND a.document_asset_id = $1 \
                         AND a.document_version = $2) \
         ON CONFLICT (document_asset_id, version) DO UPDATE \
           SET policy_fingerprint = EXCLUDED.policy_fingerprint, artifact = EXCLUDED.artifact, \
               updated_at = now()",
    )
    .bind(asset)
    .bind(version)
    .bind(fingerprint)
    .bind(artifact)
    .bind(job.job_id)
    .bind(job.lease_token)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    Ok(n == 1)
}

/// Deletes the checkpoint of `(asset, version)` made under `fingerprint`, once its artifact is
/// stored.
pub async fn delete(
    tx: &mut PgConnection,
    asset: Uuid,
    version: i32,
    fingerprint: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "DELETE FROM parse_artifact_checkpoints \
         WHERE document_asset_id = $1 AND version = $2 AND policy_fingerprint = $3",
    )
    .bind(asset)
    .bind(version)
    .bind(fingerprint)
    .execute(tx)
    .await?;
    Ok(())
}
