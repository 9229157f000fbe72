//! The page-index closure of a publication, as the platform's upgrade backfill checks it.
//! Invariant: a publication's page index is complete only when every `document-outline` member
//! has a non-zero generation, its outline row, and a manifest of the current tokenizer for that
//! outline, generation, document and outline version, in the wanted status, whose checksum is
//! 64 hex digits, whose counts are positive and equal its node and term rows, and whose every
//! term is of the member's space and names a node of the same manifest.

use sqlx::PgConnection;
use uuid::Uuid;

use crate::jobs::compile::page_index::TOKENIZER_VERSION;

/// Which manifest statuses count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// `building` or `ready`: what a build leaves before cutover.
    Built,
    /// `ready` only: what readers may use.
    Ready,
}

/// The first outline member of publication `$3` (tenant `$1`, space `$2`) whose page index is
/// not complete; `$4`/`$5`, when not NULL, restrict the check to one outline and generation.
fn invalid_sql(status: Status) -> String {
    let status = match status {
        Status::Built => "manifest.status IN ('building', 'ready')",
        Status::Ready => "manifest.status = 'ready'",
    };
    format!(
        "SELECT pm.component_key FROM projection_set_publication_members pm \
         LEFT JOIN document_outlines outline_row ON outline_row.id = pm.component_key \
           AND outline_row.knowledge_space_id = pm.knowledge_space_id \
           AND outline_row.publication_generation_id = pm.generation_id \
           AND outline_row.document_asset_id = pm.document_asset_id \
         LEFT JOIN page_index_manifests manifest ON manifest.knowledge_space_id = pm.knowledge_space_id \
           AND manifest.document_outline_id = pm.component_key \
           AND manifest.publication_generation_id = pm.generation_id \
           AND manifest.document_asset_id = pm.document_asset_id \
           AND manifest.document_version = outline_row.version \
           AND manifest.tokenizer_version = '{TOKENIZER_VERSION}' AND {status} \
         WHERE pm.tenant_id = $1 AND pm.knowledge_space_id = $2 AND pm.publication_id = $3 \
           AND pm.component_type = 'document-outline' \
           AND ($4::uuid IS NULL OR pm.component_key = $4) \
           AND ($5::uuid IS NULL OR pm.generation_id = $5) \
           AND (pm.generation_id = '00000000-0000-0000-0000-000000000000' OR outline_row.id IS NULL \
             OR manifest.id IS NULL OR NOT (manifest.checksum ~ '^[0-9a-f]{{64}}$') \
             OR manifest.node_count <= 0 OR manifest.term_count <= 0 \
             OR manifest.node_count <> (SELECT count(*) FROM page_index_nodes n WHERE n.manifest_id = manifest.id) \
             OR manifest.term_count <> (SELECT count(*) FROM page_index_terms t WHERE t.manifest_id = manifest.id) \
             OR EXISTS (SELECT 1 FROM page_index_terms t \
               LEFT JOIN page_index_nodes n ON n.id = t.page_index_node_id AND n.manifest_id = t.manifest_id \
               WHERE t.manifest_id = manifest.id \
                 AND (t.knowledge_space_id <> pm.knowledge_space_id OR n.id IS NULL))) \
         LIMIT 1"
    )
}

/// The publication's page index is not complete in `status`.
pub async fn invalid(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    publication: Uuid,
    status: Status,
) -> Result<bool, sqlx::Error> {
    invalid_for(conn, tenant, space, publication, None, status).await
}

/// As [`invalid`], for one outline member (`Some((outline, generation))`) or all of them.
pub async fn invalid_for(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    publication: Uuid,
    outline: Option<(Uuid, Uuid)>,
    status: Status,
) -> Result<bool, sqlx::Error> {
    let found: Option<Uuid> = sqlx::query_scalar(&invalid_sql(status))
        .bind(tenant)
        .bind(space)
        .bind(publication)
        .bind(outline.map(|o| o.0))
        .bind(outline.map(|o| o.1))
        .fetch_optional(conn)
        .await?;
    Ok(found.is_some())
}

/// Some outline member of the publication has no outline row or no `ready` manifest: the cheap
/// readiness test of a head without a backfill row.
pub async fn missing_ready_manifest(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    publication: Uuid,
) -> Result<bool, sqlx::Error> {
    let found: Option<Uuid> = sqlx::query_scalar(&format!(
        "SELECT pm.component_key FROM projection_set_publication_members pm \
         LEFT JOIN document_outlines outline_row ON outline_row.id = pm.component_key \
           AND outline_row.knowledge_space_id = pm.knowledge_space_id \
           AND outline_row.publication_generation_id = pm.generation_id \
           AND outline_row.document_asset_id = pm.document_asset_id \
         LEFT JOIN page_index_manifests manifest ON manifest.knowledge_space_id = pm.knowledge_space_id \
           AND manifest.document_outline_id = pm.component_key \
           AND manifest.publication_generation_id = pm.generation_id \
           AND manifest.document_asset_id = pm.document_asset_id \
           AND manifest.document_version = outline_row.version \
           AND manifest.tokenizer_version = '{TOKENIZER_VERSION}' AND manifest.status = 'ready' \
         WHERE pm.tenant_id = $1 AND pm.knowledge_space_id = $2 AND pm.publication_id = $3 \
           AND pm.component_type = 'document-outline' AND (outline_row.id IS NULL OR manifest.id IS NULL) \
         LIMIT 1"
    ))
    .bind(tenant)
    .bind(space)
    .bind(publication)
    .fetch_optional(conn)
    .await?;
    Ok(found.is_some())
}

/// A frozen item no longer matches an outline member of the job's publication or its outline.
pub async fn items_drifted(
    conn: &mut PgConnection,
    job: Uuid,
    tenant: &str,
    space: Uuid,
    publication: Uuid,
) -> Result<bool, sqlx::Error> {
    let found: Option<Uuid> = sqlx::query_scalar(
        "SELECT item.document_outline_id FROM page_index_upgrade_backfill_items item \
         LEFT JOIN projection_set_publication_members pm ON pm.tenant_id = $2 AND pm.knowledge_space_id = $3 \
           AND pm.publication_id = $4 AND pm.component_type = 'document-outline' \
           AND pm.component_key = item.document_outline_id AND pm.generation_id = item.publication_generation_id \
           AND pm.document_asset_id = item.document_asset_id \
         LEFT JOIN document_outlines outline_row ON outline_row.id = item.document_outline_id \
           AND outline_row.knowledge_space_id = $3 \
           AND outline_row.publication_generation_id = item.publication_generation_id \
           AND outline_row.document_asset_id = item.document_asset_id \
           AND outline_row.version = item.document_version \
         WHERE item.backfill_id = $1 AND (pm.component_key IS NULL OR outline_row.id IS NULL) LIMIT 1",
    )
    .bind(job)
    .bind(tenant)
    .bind(space)
    .bind(publication)
    .fetch_optional(conn)
    .await?;
    Ok(found.is_some())
}

/// Promotes the job's `building` manifests to `ready`.
pub async fn promote(conn: &mut PgConnection, job: Uuid, space: Uuid) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE page_index_manifests SET status = 'ready', updated_at = now() \
         WHERE knowledge_space_id = $2 AND status = 'building' AND id IN ( \
           SELECT manifest.id FROM page_index_upgrade_backfill_items item \
           JOIN page_index_manifests manifest ON manifest.knowledge_space_id = $2 \
             AND manifest.document_outline_id = item.document_outline_id \
             AND manifest.publication_generation_id = item.publication_generation_id \
             AND manifest.document_asset_id = item.document_asset_id \
             AND manifest.document_version = item.document_version \
           WHERE item.backfill_id = $1)",
    )
    .bind(job)
    .bind(space)
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}
