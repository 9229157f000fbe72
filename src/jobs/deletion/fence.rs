//! The fences a deletion request writes, in the request's transaction, as the platform's API
//! does: the target row says `deleting` and names its job (a source's active documents too, in
//! either mode; a logical document's active assets that no other logical document's revision
//! references), the space's agent workspaces are invalidated, and a document's raw object becomes
//! the job's ordinal-0 item. Invariant: the target row was locked by the caller and is fenced
//! exactly once, or the request is refused as busy and nothing of it commits.

use sqlx::PgConnection;
use uuid::Uuid;

use super::ask::{Ask, RequestError, Target, MAX_EXECUTION_ATTEMPTS};

/// Writes the fences of job `job_id` on the request's target (at `target_revision`).
pub(super) async fn fence(
    conn: &mut PgConnection,
    req: &Ask,
    job_id: Uuid,
    target_revision: i32,
) -> Result<(), RequestError> {
    let tenant = req.tenant_id.as_str();
    let space = req.knowledge_space_id;
    let target_type = req.target_type();
    let target_id = req.target_id();
    // The fences: the target says `deleting` and names its job; writers that honour the fence
    // stop touching it from this commit on.
    let fenced = match &req.target {
        Target::Space { .. } => sqlx::query(
            "UPDATE knowledge_spaces SET lifecycle_state = 'deleting', deletion_job_id = $3, deleting_at = now(), \
               revision = revision + 1, updated_at = now() \
             WHERE tenant_id = $1 AND id = $2 AND revision = $4 AND lifecycle_state = 'active'",
        )
        .bind(tenant)
        .bind(space)
        .bind(job_id)
        .bind(target_revision)
        .execute(&mut *conn)
        .await?
        .rows_affected(),
        Target::Source { id, .. } => {
            let n = sqlx::query(
                "UPDATE sources s SET status = 'deleting', deletion_job_id = $4, deleting_at = now(), \
                   version = version + 1, updated_at = now() \
                 WHERE s.id = $3 AND s.knowledge_space_id = $2 AND s.version = $5 AND s.status <> 'deleting' \
                   AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = s.knowledge_space_id AND k.tenant_id = $1)",
            )
            .bind(tenant)
            .bind(space)
            .bind(id)
            .bind(job_id)
            .bind(target_revision)
            .execute(&mut *conn)
            .await?
            .rows_affected();
            // Both modes fence the source's documents (keep reactivates them at the end).
            sqlx::query(
                "UPDATE document_assets d SET lifecycle_state = 'deleting', deletion_job_id = $4, deleting_at = now(), \
                   row_version = row_version + 1, updated_at = now() \
                 WHERE d.knowledge_space_id = $2 AND d.source_id = $3 AND d.lifecycle_state = 'active' \
                   AND d.deletion_job_id IS NULL \
                   AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = d.knowledge_space_id AND k.tenant_id = $1)",
            )
            .bind(tenant)
            .bind(space)
            .bind(id)
            .bind(job_id)
            .execute(&mut *conn)
            .await?;
            n
        }
        Target::Document { id } => sqlx::query(
            "UPDATE document_assets d SET lifecycle_state = 'deleting', deletion_job_id = $4, deleting_at = now(), \
               row_version = row_version + 1, updated_at = now() \
             WHERE d.id = $3 AND d.knowledge_space_id = $2 AND d.row_version = $5 AND d.lifecycle_state = 'active' \
               AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = d.knowledge_space_id AND k.tenant_id = $1)",
        )
        .bind(tenant)
        .bind(space)
        .bind(id)
        .bind(job_id)
        .bind(target_revision)
        .execute(&mut *conn)
        .await?
        .rows_affected(),
        Target::LogicalDocument { id } => {
            let n = sqlx::query(
                "UPDATE logical_documents SET status = 'deleting', deletion_job_id = $4, deleting_at = now(), \
                   row_version = row_version + 1, updated_at = now() \
                 WHERE tenant_id = $1 AND knowledge_space_id = $2 AND id = $3 AND row_version = $5 \
                   AND status <> 'deleting' AND deletion_job_id IS NULL",
            )
            .bind(tenant)
            .bind(space)
            .bind(id)
            .bind(job_id)
            .bind(target_revision)
            .execute(&mut *conn)
            .await?
            .rows_affected();
            if n == 1 {
                // Only the assets this document alone references: an asset another document's
                // revision still uses stays, with its derived rows, for that document.
                sqlx::query(
                    "UPDATE document_assets d SET lifecycle_state = 'deleting', deletion_job_id = $4, deleting_at = now(), \
                       row_version = d.row_version + 1, updated_at = now() \
                     WHERE d.knowledge_space_id = $2 AND d.lifecycle_state = 'active' AND d.deletion_job_id IS NULL \
                       AND EXISTS (SELECT 1 FROM document_revisions r WHERE r.tenant_id = $1 \
                         AND r.knowledge_space_id = $2 AND r.document_id = $3 AND r.document_asset_id = d.id) \
                       AND NOT EXISTS (SELECT 1 FROM document_revisions r WHERE r.tenant_id = $1 \
                         AND r.knowledge_space_id = $2 AND r.document_id <> $3 AND r.document_asset_id = d.id)",
                )
                .bind(tenant)
                .bind(space)
                .bind(id)
                .bind(job_id)
                .execute(&mut *conn)
                .await?;
            }
            n
        }
    };
    if fenced != 1 {
        // The row is locked above, so this means it changed under a writer that ignores locks.
        return Err(RequestError::TargetBusy {
            what: format!("{} {target_id}", target_type.as_str()),
            job_id: None,
        });
    }

    // Agent workspaces of the space were built from what is going away.
    sqlx::query(
        "UPDATE agent_workspace_snapshots SET invalidated_at = now(), invalidation_reason = $3 \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND invalidated_at IS NULL",
    )
    .bind(tenant)
    .bind(space)
    .bind(super::request_invalidation_reason(target_type))
    .execute(&mut *conn)
    .await?;
    // A document's raw object is the job's first item (ordinal 0).
    if let Target::Document { id } = &req.target {
        let key: String = sqlx::query_scalar(
            "SELECT object_key FROM document_assets WHERE id = $1 AND knowledge_space_id = $2",
        )
        .bind(id)
        .bind(space)
        .fetch_one(&mut *conn)
        .await?;
        let digest = super::payload_digest(
            tenant,
            space,
            &req.idempotency_key,
            "object",
            Some(*id),
            Some(&key),
            None,
        );
        sqlx::query(
            r#"INSERT INTO deletion_job_items (id, deletion_job_id, ordinal, kind, resource_id, object_key,
                 payload_digest, idempotency_key, status, attempts, max_attempts, row_version, created_at, updated_at)
               VALUES ($1, $2, 0, 'object', $3, $4, $5, 'raw-object:' || $5, 'pending', 0, $6, 1, now(), now())"#,
        )
        .bind(Uuid::now_v7())
        .bind(job_id)
        .bind(id)
        .bind(&key)
        .bind(&digest)
        .bind(MAX_EXECUTION_ATTEMPTS)
        .execute(&mut *conn)
        .await?;
    }

    Ok(())
}
