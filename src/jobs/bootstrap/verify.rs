//! What the bootstrap's verification reads, as the platform's `complete` reads it: the frozen
//! snapshot against the space's documents, and the locked head's publication against the frozen
//! documents. Invariant: every fact is read in the step's transaction after the space row and
//! the head row are locked, so the head [`record`] writes on the bootstrap row is the head the
//! facts were read from, and nothing here writes anything else.

use sqlx::PgConnection;
use uuid::Uuid;

use super::snapshot::{legacy_state, lock_space};
use super::walk::{PublishedHead, VerifyFacts};
use super::{Row, TABLE};
use crate::engine::leased::Lease;
use crate::jobs::compile::page_index::TOKENIZER_VERSION;
use crate::jobs::JobError;
use crate::publication;

const ITEMS: &str = "legacy_space_publication_bootstrap_items";
const MEMBERS: &str = "projection_set_publication_members";
/// `$2` tenant, `$3` space, `$4` publication: the head's members.
const OF_HEAD: &str = "pm.tenant_id = $2 AND pm.knowledge_space_id = $3 AND pm.publication_id = $4";

/// The first frozen document without an outline of its frozen version that has a ready,
/// complete page index, or without a ready full-text projection of its own generation.
fn missing_corpus_sql() -> String {
    format!(
        "SELECT bi.document_asset_id FROM {ITEMS} bi WHERE bi.bootstrap_id = $1 AND ( \
           NOT EXISTS (SELECT 1 FROM {MEMBERS} pm \
             JOIN document_outlines o ON o.id = pm.component_key AND o.knowledge_space_id = pm.knowledge_space_id \
               AND o.publication_generation_id = pm.generation_id AND o.document_asset_id = pm.document_asset_id \
               AND o.version = bi.document_version \
             JOIN page_index_manifests pi ON pi.knowledge_space_id = pm.knowledge_space_id \
               AND pi.publication_generation_id = pm.generation_id AND pi.document_asset_id = pm.document_asset_id \
               AND pi.document_outline_id = o.id AND pi.document_version = bi.document_version \
               AND pi.status = 'ready' AND pi.tokenizer_version = $5 AND pi.node_count > 0 AND pi.term_count > 0 \
               AND pi.checksum ~ '^[a-f0-9]{{64}}$' \
               AND pi.node_count = (SELECT count(*) FROM page_index_nodes n WHERE n.manifest_id = pi.id) \
               AND pi.term_count = (SELECT count(*) FROM page_index_terms t WHERE t.manifest_id = pi.id) \
               AND pi.term_count = (SELECT count(*) FROM page_index_terms t JOIN page_index_nodes tn \
                 ON tn.id = t.page_index_node_id AND tn.manifest_id = pi.id \
                 WHERE t.manifest_id = pi.id AND t.knowledge_space_id = pi.knowledge_space_id) \
             WHERE {OF_HEAD} AND pm.component_type = 'document-outline' \
               AND pm.document_asset_id = bi.document_asset_id) \
           OR NOT EXISTS (SELECT 1 FROM {MEMBERS} pm \
             JOIN index_projections ip ON ip.id = pm.component_key AND ip.knowledge_space_id = pm.knowledge_space_id \
               AND ip.publication_generation_id = pm.generation_id AND ip.type = 'fts' AND ip.status = 'ready' \
             JOIN knowledge_nodes node ON node.id = ip.node_id AND node.knowledge_space_id = pm.knowledge_space_id \
               AND node.publication_generation_id = pm.generation_id AND node.document_asset_id = pm.document_asset_id \
             WHERE {OF_HEAD} AND pm.component_type = 'index-projection' \
               AND pm.document_asset_id = bi.document_asset_id)) \
         ORDER BY bi.ordinal LIMIT 1"
    )
}

/// The first frozen document without a ready dense projection (of vector space `$5` when set).
fn missing_dense_sql() -> String {
    format!(
        "SELECT bi.document_asset_id FROM {ITEMS} bi WHERE bi.bootstrap_id = $1 AND NOT EXISTS ( \
           SELECT 1 FROM {MEMBERS} pm \
           JOIN index_projections dense ON dense.id = pm.component_key \
             AND dense.knowledge_space_id = pm.knowledge_space_id AND dense.publication_generation_id = pm.generation_id \
             AND dense.type = 'dense-vector' AND dense.status = 'ready' \
           JOIN knowledge_nodes node ON node.id = dense.node_id AND node.knowledge_space_id = pm.knowledge_space_id \
             AND node.publication_generation_id = pm.generation_id AND node.document_asset_id = pm.document_asset_id \
           WHERE {OF_HEAD} AND pm.component_type = 'index-projection' \
             AND pm.document_asset_id = bi.document_asset_id AND ($5::text IS NULL OR dense.model = $5)) \
         ORDER BY bi.ordinal LIMIT 1"
    )
}

/// The first projection member of a frozen document whose node lacks a ready full-text or a
/// ready dense sibling (of vector space `$5` when set) in the same generation.
fn unpaired_sql() -> String {
    let sibling = |ty: &str, extra: &str| {
        format!(
            "EXISTS (SELECT 1 FROM {MEMBERS} s JOIN index_projections sp ON sp.id = s.component_key \
               AND sp.knowledge_space_id = s.knowledge_space_id AND sp.publication_generation_id = s.generation_id \
               AND sp.node_id = ip.node_id AND sp.type = '{ty}' AND sp.status = 'ready' \
             WHERE s.tenant_id = pm.tenant_id AND s.knowledge_space_id = pm.knowledge_space_id \
               AND s.publication_id = pm.publication_id AND s.generation_id = pm.generation_id \
               AND s.document_asset_id = pm.document_asset_id AND s.component_type = 'index-projection'{extra})"
        )
    };
    format!(
        "SELECT pm.component_key FROM {ITEMS} bi \
         JOIN {MEMBERS} pm ON {OF_HEAD} AND pm.document_asset_id = bi.document_asset_id \
           AND pm.component_type = 'index-projection' \
         JOIN index_projections ip ON ip.id = pm.component_key AND ip.knowledge_space_id = pm.knowledge_space_id \
           AND ip.publication_generation_id = pm.generation_id \
         WHERE bi.bootstrap_id = $1 AND (NOT {} OR NOT {}) LIMIT 1",
        sibling("fts", ""),
        sibling("dense-vector", " AND ($5::text IS NULL OR sp.model = $5)")
    )
}

/// The first member of the head that is ownerless, owned by a document outside the snapshot,
/// missing, of another generation, or (graph rows) not closed over the document's projected
/// nodes.
fn invalid_member_sql() -> String {
    let exact = |a: &str| {
        format!(
            "{a}.id = pm.component_key AND {a}.knowledge_space_id = pm.knowledge_space_id \
             AND {a}.publication_generation_id = pm.generation_id"
        )
    };
    let closure = |a: &str| {
        format!(
            "jsonb_array_length({a}.source_node_ids) > 0 AND (SELECT count(*) FROM knowledge_nodes node \
               WHERE node.knowledge_space_id = {a}.knowledge_space_id AND node.publication_generation_id = pm.generation_id \
                 AND node.document_asset_id = pm.document_asset_id AND {a}.source_node_ids ? CAST(node.id AS text) \
                 AND EXISTS (SELECT 1 FROM {MEMBERS} spm JOIN index_projections sip ON sip.id = spm.component_key \
                   AND sip.node_id = node.id AND sip.knowledge_space_id = node.knowledge_space_id \
                   AND sip.publication_generation_id = node.publication_generation_id \
                   WHERE spm.tenant_id = pm.tenant_id AND spm.knowledge_space_id = pm.knowledge_space_id \
                     AND spm.publication_id = pm.publication_id AND spm.generation_id = pm.generation_id \
                     AND spm.document_asset_id = pm.document_asset_id AND spm.component_type = 'index-projection')) \
             = jsonb_array_length({a}.source_node_ids)"
        )
    };
    let endpoint = |col: &str| {
        format!(
            "EXISTS (SELECT 1 FROM {MEMBERS} epm WHERE epm.tenant_id = pm.tenant_id \
               AND epm.knowledge_space_id = pm.knowledge_space_id AND epm.publication_id = pm.publication_id \
               AND epm.component_type = 'graph-entity' AND epm.component_key = r.{col})"
        )
    };
    let valid = [
        format!(
            "(pm.component_type = 'index-projection' AND EXISTS (SELECT 1 FROM index_projections ip WHERE {} \
               AND ip.status = 'ready' AND EXISTS (SELECT 1 FROM knowledge_nodes node WHERE node.id = ip.node_id \
                 AND node.knowledge_space_id = pm.knowledge_space_id AND node.publication_generation_id = pm.generation_id \
                 AND node.document_asset_id = pm.document_asset_id)))",
            exact("ip")
        ),
        format!(
            "(pm.component_type = 'document-outline' AND EXISTS (SELECT 1 FROM document_outlines o WHERE {} \
               AND o.document_asset_id = pm.document_asset_id))",
            exact("o")
        ),
        format!(
            "(pm.component_type = 'multimodal-manifest' AND EXISTS (SELECT 1 FROM document_multimodal_manifests mm \
               WHERE {} AND mm.document_asset_id = pm.document_asset_id))",
            exact("mm")
        ),
        format!(
            "(pm.component_type = 'knowledge-path' AND EXISTS (SELECT 1 FROM knowledge_paths kp WHERE {} \
               AND kp.target_id = CAST(pm.document_asset_id AS text)))",
            exact("kp")
        ),
        format!(
            "(pm.component_type = 'graph-entity' AND EXISTS (SELECT 1 FROM graph_entities e WHERE {} AND {}))",
            exact("e"),
            closure("e")
        ),
        format!(
            "(pm.component_type = 'graph-relation' AND EXISTS (SELECT 1 FROM graph_relations r WHERE {} AND {} \
               AND {} AND {}))",
            exact("r"),
            closure("r"),
            endpoint("subject_entity_id"),
            endpoint("object_entity_id")
        ),
    ]
    .join(" OR ");
    format!(
        "SELECT pm.component_key FROM {MEMBERS} pm WHERE {OF_HEAD} AND (pm.document_asset_id IS NULL \
           OR NOT EXISTS (SELECT 1 FROM {ITEMS} bi WHERE bi.bootstrap_id = $1 \
             AND bi.document_asset_id = pm.document_asset_id) \
           OR NOT ({valid})) LIMIT 1"
    )
}

async fn first(
    tx: &mut PgConnection,
    sql: &str,
    job: &Lease,
    row: &Row,
    head: Uuid,
    extra: Option<Option<&str>>,
) -> Result<Option<Uuid>, sqlx::Error> {
    let q = sqlx::query_scalar(sql)
        .bind(job.job_id)
        .bind(&row.tenant)
        .bind(row.space)
        .bind(head);
    match extra {
        Some(x) => q.bind(x).fetch_optional(tx).await,
        None => q.fetch_optional(tx).await,
    }
}

/// Everything [`super::walk::verify`] decides on.
pub(crate) async fn facts(
    tx: &mut PgConnection,
    job: &Lease,
    row: &Row,
) -> Result<VerifyFacts, JobError> {
    let space_writable = lock_space(tx, &row.tenant, row.space).await?;
    let succeeded: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {ITEMS} WHERE bootstrap_id = $1 AND status = 'succeeded'"
    ))
    .bind(job.job_id)
    .fetch_one(&mut *tx)
    .await?;
    let changed: Option<Uuid> = sqlx::query_scalar(&format!(
        "SELECT bi.document_asset_id FROM {ITEMS} bi LEFT JOIN document_assets da \
           ON da.knowledge_space_id = $2 AND da.id = bi.document_asset_id AND da.version = bi.document_version \
           AND da.sha256 = bi.document_sha256 \
         WHERE bi.bootstrap_id = $1 AND da.id IS NULL ORDER BY bi.ordinal LIMIT 1"
    ))
    .bind(job.job_id)
    .bind(row.space)
    .fetch_optional(&mut *tx)
    .await?;
    let unsnapshotted: Option<Uuid> = sqlx::query_scalar(&format!(
        "SELECT da.id FROM document_assets da LEFT JOIN {ITEMS} bi ON bi.bootstrap_id = $1 \
           AND bi.document_asset_id = da.id \
         WHERE da.knowledge_space_id = $2 AND bi.document_asset_id IS NULL LIMIT 1"
    ))
    .bind(job.job_id)
    .bind(row.space)
    .fetch_optional(&mut *tx)
    .await?;
    let mut f = VerifyFacts {
        space_writable,
        total: row.total,
        succeeded,
        changed,
        unsnapshotted,
        legacy_state: row.total == 0 && legacy_state(tx, &row.tenant, row.space).await?,
        ..VerifyFacts::default()
    };
    let head = publication::head(tx, &row.tenant, row.space, true)
        .await?
        .filter(|h| h.status == "published");
    let Some(head) = head else {
        return Ok(f);
    };
    let vector_space: Option<String> = sqlx::query_scalar(
        "SELECT metadata -> '__knowledgeFsEmbeddingProfile' ->> 'vectorSpaceId' FROM knowledge_space_manifests \
         WHERE tenant_id = $1 AND knowledge_space_id = $2",
    )
    .bind(&row.tenant)
    .bind(row.space)
    .fetch_optional(&mut *tx)
    .await?
    .flatten();
    let p = head.publication_id;
    let vs = Some(vector_space.as_deref());
    f.missing_corpus = first(
        tx,
        &missing_corpus_sql(),
        job,
        row,
        p,
        Some(Some(TOKENIZER_VERSION)),
    )
    .await?;
    f.missing_dense = first(tx, &missing_dense_sql(), job, row, p, vs).await?;
    f.unpaired = first(tx, &unpaired_sql(), job, row, p, vs).await?;
    f.invalid_member = first(tx, &invalid_member_sql(), job, row, p, None).await?;
    f.head = Some(PublishedHead {
        publication_id: p,
        fingerprint: head.fingerprint,
        revision: head.revision,
    });
    Ok(f)
}

/// Records the verified head on the bootstrap row.
pub(crate) async fn record(
    tx: &mut PgConnection,
    job: &Lease,
    head: &PublishedHead,
) -> Result<(), JobError> {
    sqlx::query(&format!(
        "UPDATE {TABLE} SET published_publication_id = $2, published_fingerprint = $3, published_head_revision = $4 \
         WHERE id = $1"
    ))
    .bind(job.job_id)
    .bind(head.publication_id)
    .bind(&head.fingerprint)
    .bind(head.revision)
    .execute(tx)
    .await?;
    Ok(())
}
