//! The bootstrap's snapshot and rebuild steps against the platform's tables, inside the
//! engine's fenced transaction. Invariant: items are written only by the capture, all at once
//! (document id order, ordinal = position, `pending`), under the space row's lock and only when
//! [`walk::capture_refusal`] finds nothing against it; an item goes `pending → running` only
//! together with the compile attempt of its frozen version bound to it, and `running →
//! succeeded | failed` only from what that attempt ended as ([`walk::settle`]);
//! `completed_documents` is always the number of succeeded items.

use uuid::Uuid;

use sqlx::PgConnection;

use super::walk::{self, CaptureFacts, Items};
use super::Row;
use crate::engine::leased::Lease;
use crate::jobs::compile::{self, CompileError, RequestOptions};
use crate::jobs::JobError;

/// The platform's `lockKnowledgeSpaceForDeletionAdmission`: locks the space row; whether the
/// space is active, not deletion-fenced, and has no active deletion job.
pub(crate) async fn lock_space(
    tx: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<bool, sqlx::Error> {
    let row: Option<(String, Option<Uuid>)> = sqlx::query_as(
        "SELECT lifecycle_state::text, deletion_job_id FROM knowledge_spaces \
         WHERE tenant_id = $1 AND id = $2 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .fetch_optional(&mut *tx)
    .await?;
    if !matches!(&row, Some((state, None)) if state == "active") {
        return Ok(false);
    }
    let deleting: Option<Uuid> = sqlx::query_scalar(
        "SELECT id FROM deletion_jobs WHERE tenant_id = $1 AND knowledge_space_id = $2 AND active_slot = 1 \
         LIMIT 1 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .fetch_optional(tx)
    .await?;
    Ok(deleting.is_none())
}

/// Whether the space has legacy null-generation rows (the platform's seven tables).
pub(crate) async fn legacy_state(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<bool, sqlx::Error> {
    let tables = [
        "knowledge_nodes",
        "index_projections",
        "document_outlines",
        "document_multimodal_manifests",
        "knowledge_paths",
        "graph_entities",
        "graph_relations",
    ];
    let any = tables
        .iter()
        .map(|t| {
            format!(
                "EXISTS (SELECT 1 FROM {t} legacy WHERE legacy.knowledge_space_id = space.id \
                 AND legacy.publication_generation_id IS NULL)"
            )
        })
        .collect::<Vec<_>>()
        .join(" OR ");
    sqlx::query_scalar(&format!(
        "SELECT EXISTS (SELECT 1 FROM knowledge_spaces space WHERE space.tenant_id = $1 AND space.id = $2 \
           AND ({any}))"
    ))
    .bind(tenant)
    .bind(space)
    .fetch_one(conn)
    .await
}

/// pending_snapshot → snapshot_captured: the platform's `captureSnapshot`.
pub(crate) async fn capture(
    tx: &mut PgConnection,
    job: &Lease,
    row: &Row,
    max_documents: usize,
) -> Result<(), JobError> {
    let space_writable = lock_space(tx, &row.tenant, row.space).await?;
    let live_lease: Option<Uuid> = sqlx::query_scalar(
        "SELECT id FROM knowledge_space_mutation_leases WHERE tenant_id = $1 AND knowledge_space_id = $2 \
           AND expires_at > now() LIMIT 1 FOR UPDATE",
    )
    .bind(&row.tenant)
    .bind(row.space)
    .fetch_optional(&mut *tx)
    .await?;
    let head: Option<Uuid> = sqlx::query_scalar(
        "SELECT publication_id FROM projection_set_publication_heads WHERE tenant_id = $1 \
           AND knowledge_space_id = $2 LIMIT 1 FOR UPDATE",
    )
    .bind(&row.tenant)
    .bind(row.space)
    .fetch_optional(&mut *tx)
    .await?;
    let active: Option<Uuid> = sqlx::query_scalar(
        "SELECT id FROM document_compilation_attempts WHERE tenant_id = $1 AND knowledge_space_id = $2 \
           AND active_slot = 1 LIMIT 1 FOR UPDATE",
    )
    .bind(&row.tenant)
    .bind(row.space)
    .fetch_optional(&mut *tx)
    .await?;
    let documents: Vec<(Uuid, i32, String)> = sqlx::query_as(
        "SELECT id, version, sha256::text FROM document_assets WHERE knowledge_space_id = $1 \
         ORDER BY id LIMIT $2 FOR UPDATE",
    )
    .bind(row.space)
    .bind(i64::try_from(max_documents).unwrap_or(i64::MAX - 1) + 1)
    .fetch_all(&mut *tx)
    .await?;
    if let Some(refused) = walk::capture_refusal(&CaptureFacts {
        space_writable,
        counts_zero: row.total == 0 && row.completed == 0,
        live_mutation_lease: live_lease.is_some(),
        head_exists: head.is_some(),
        active_compilation: active.is_some(),
        documents: documents.len(),
        max_documents,
    }) {
        return Err(refused);
    }
    let ids: Vec<Uuid> = documents.iter().map(|d| d.0).collect();
    let versions: Vec<i32> = documents.iter().map(|d| d.1).collect();
    let hashes: Vec<String> = documents.iter().map(|d| d.2.to_lowercase()).collect();
    sqlx::query(
        "INSERT INTO legacy_space_publication_bootstrap_items \
           (bootstrap_id, document_asset_id, document_version, document_sha256, ordinal, compilation_attempt_id, \
            status, last_error, created_at, updated_at) \
         SELECT $1, d.id, d.version, d.sha256, (d.ord - 1)::int, NULL, 'pending', NULL, now(), now() \
         FROM unnest($2::uuid[], $3::int[], $4::text[]) WITH ORDINALITY AS d(id, version, sha256, ord)",
    )
    .bind(job.job_id)
    .bind(&ids)
    .bind(&versions)
    .bind(&hashes)
    .execute(&mut *tx)
    .await?;
    sqlx::query(&format!(
        "UPDATE {} SET total_documents = $2, snapshot_metadata = snapshot_metadata || jsonb_build_object( \
           'capturedAt', to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'), \
           'directLegacyAdoption', false, 'documentCount', $2, \
           'reason', 'legacy graph ownership and immutable generation cannot be proven', \
           'schemaVersion', 1, 'strategy', 'full-generation-rebuild') \
         WHERE id = $1",
        super::TABLE
    ))
    .bind(job.job_id)
    .bind(i32::try_from(documents.len()).unwrap_or(i32::MAX))
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Requests the compile of a page of pending items, each of its frozen version (an active
/// attempt of that version is adopted, as the platform's start returns it), and binds it.
/// Returns how many items were bound.
pub(crate) async fn admit(
    tx: &mut PgConnection,
    job: &Lease,
    row: &Row,
    page: i64,
) -> Result<usize, JobError> {
    type Pending = (Uuid, i32, String, Option<i32>, Option<String>);
    let pending: Vec<Pending> = sqlx::query_as(
        "SELECT i.document_asset_id, i.document_version, i.document_sha256::text, d.version, d.sha256::text \
         FROM legacy_space_publication_bootstrap_items i \
         LEFT JOIN document_assets d ON d.id = i.document_asset_id AND d.knowledge_space_id = $2 \
         WHERE i.bootstrap_id = $1 AND i.status = 'pending' \
         ORDER BY i.ordinal, i.document_asset_id LIMIT $3 FOR UPDATE OF i",
    )
    .bind(job.job_id)
    .bind(row.space)
    .bind(page)
    .fetch_all(&mut *tx)
    .await?;
    for (doc, version, sha, current, current_sha) in &pending {
        if *current != Some(*version) || current_sha.as_deref() != Some(sha.as_str()) {
            return Err(walk::refuse(
                "Legacy publication bootstrap document snapshot changed",
            ));
        }
        let attempt = match compile::request(tx, *doc, RequestOptions::default()).await {
            Ok(a) => a,
            Err(CompileError::ActiveAttemptExists {
                attempt: Some(a), ..
            }) => a,
            // Another request for the same version is committing right now: look again.
            Err(CompileError::ActiveAttemptExists { attempt: None, .. }) => {
                return Err(JobError::retryable(
                    "compile_request_conflict",
                    format!("document {doc}: another compile was requested at the same time"),
                ))
            }
            Err(CompileError::Db(e)) => return Err(e.into()),
            Err(e) => return Err(walk::refuse(e.to_string())),
        };
        sqlx::query(
            "UPDATE legacy_space_publication_bootstrap_items SET status = 'running', compilation_attempt_id = $3, \
               updated_at = now() \
             WHERE bootstrap_id = $1 AND document_asset_id = $2 AND status = 'pending'",
        )
        .bind(job.job_id)
        .bind(doc)
        .bind(attempt)
        .execute(&mut *tx)
        .await?;
    }
    Ok(pending.len())
}

/// Settles the running items whose compile ended: published → `succeeded`; failed, canceled or
/// superseded → `failed` with the compile's error. Returns how many were settled.
pub(crate) async fn follow(
    tx: &mut PgConnection,
    job: &Lease,
    row: &Row,
) -> Result<usize, JobError> {
    type Running = (
        Uuid,
        Option<Uuid>,
        Option<String>,
        Option<String>,
        Option<String>,
    );
    let running: Vec<Running> = sqlx::query_as(
        "SELECT i.document_asset_id, i.compilation_attempt_id, a.run_state::text, a.checkpoint::text, \
           a.last_error_message \
         FROM legacy_space_publication_bootstrap_items i \
         LEFT JOIN document_compilation_attempts a ON a.id = i.compilation_attempt_id \
           AND a.tenant_id = $2 AND a.knowledge_space_id = $3 \
         WHERE i.bootstrap_id = $1 AND i.status = 'running' ORDER BY i.ordinal FOR UPDATE OF i",
    )
    .bind(job.job_id)
    .bind(&row.tenant)
    .bind(row.space)
    .fetch_all(&mut *tx)
    .await?;
    let mut settled = 0;
    for (doc, attempt, state, checkpoint, error) in running {
        let (Some(state), Some(checkpoint)) = (state, checkpoint) else {
            return Err(walk::refuse(format!(
                "Bootstrap compilation attempt {} was not found",
                attempt.map(|a| a.to_string()).unwrap_or_default()
            )));
        };
        let Some(ok) = walk::settle(&state, &checkpoint) else {
            continue;
        };
        let last_error =
            (!ok).then(|| error.unwrap_or_else(|| format!("Compilation ended as {state}")));
        sqlx::query(
            "UPDATE legacy_space_publication_bootstrap_items SET status = $3, last_error = $4, updated_at = now() \
             WHERE bootstrap_id = $1 AND document_asset_id = $2",
        )
        .bind(job.job_id)
        .bind(doc)
        .bind(if ok { "succeeded" } else { "failed" })
        .bind(last_error)
        .execute(&mut *tx)
        .await?;
        settled += 1;
    }
    sqlx::query(&format!(
        "UPDATE {} SET completed_documents = (SELECT count(*) FROM legacy_space_publication_bootstrap_items \
           WHERE bootstrap_id = $1 AND status = 'succeeded') WHERE id = $1",
        super::TABLE
    ))
    .bind(job.job_id)
    .execute(&mut *tx)
    .await?;
    Ok(settled)
}

/// The items by status, and the error of the first failed one.
pub(crate) async fn counts(tx: &mut PgConnection, job: &Lease) -> Result<Items, JobError> {
    let rows: Vec<(String, i64, Option<String>)> = sqlx::query_as(
        "SELECT status::text, count(*), (array_agg(last_error ORDER BY ordinal))[1] \
         FROM legacy_space_publication_bootstrap_items WHERE bootstrap_id = $1 GROUP BY 1",
    )
    .bind(job.job_id)
    .fetch_all(&mut *tx)
    .await?;
    let mut items = Items::default();
    for (status, n, first) in rows {
        let n = usize::try_from(n).unwrap_or(0);
        match status.as_str() {
            "pending" => items.pending = n,
            "running" => items.running = n,
            "succeeded" => items.succeeded = n,
            _ => {
                items.failed += n;
                items.first_failure = first;
            }
        }
    }
    Ok(items)
}
