//! The end of `quiescing`: the published head stops serving the target. For a space, a document
//! or a cascaded source, a new `published` publication copies the head's members except the
//! target's: its documents' members, and graph members whose closure no longer holds (their
//! component row, their owning active document, and every source node with a ready projection
//! that is itself a member); a relation also needs both its entities among the new members. For
//! a kept source, the head is copied whole under metadata that records the source identity was
//! scrubbed. Invariant: the head moves only by compare-and-swap on its revision, the replaced
//! publication becomes `superseded` by the new fingerprint (the platform's
//! `durable-deletion-publication-v1` formula), the replaced head's activated profile binding is
//! copied to the new publication in the same transaction (a `content-publication` row: id = the
//! new publication's id, `changed_kind = 'content'`, the same profile tuple and vector space,
//! `created_at = activated_at = now()`), and a replay finds nothing left to exclude.
//!
//! Where kfs-worker differs: the platform refuses to move a head that has no activated binding
//! ("Durable deletion successor publication requires one activated profile binding"), which
//! blocks deleting anything from a space without profile heads; kfs-worker moves such a head
//! without a binding, as its spaces without a profile have none.

use sqlx::PgConnection;
use uuid::Uuid;

use super::sql::{self, with};
use super::{JobRow, Scope};
use crate::jobs::JobError;
use crate::publication::{self, Head};

/// `$6` is the old head's publication, `$7` the new one.
fn member_copy(scope: Scope, graph: Option<&str>) -> String {
    let exclusion = match scope {
        Scope::Space => "FALSE",
        _ => "(s.document_asset_id IS NULL OR s.document_asset_id NOT IN (SELECT id FROM td))",
    };
    let kind = match graph {
        None => "s.component_type NOT IN ('graph-entity', 'graph-relation')".to_owned(),
        Some(t) => {
            let (table, ty) = if t == "entity" {
                ("graph_entities", "graph-entity")
            } else {
                ("graph_relations", "graph-relation")
            };
            let endpoints = if t == "entity" {
                String::new()
            } else {
                " AND (SELECT count(*) FROM projection_set_publication_members e WHERE e.tenant_id = p.tenant \
                     AND e.knowledge_space_id = p.space AND e.publication_id = $7 AND e.component_type = 'graph-entity' \
                     AND e.component_key IN (g.subject_entity_id, g.object_entity_id)) \
                   = (CASE WHEN g.subject_entity_id = g.object_entity_id THEN 1 ELSE 2 END)"
                    .to_owned()
            };
            format!(
                "s.component_type = '{ty}' AND s.document_asset_id IS NOT NULL \
                 AND EXISTS (SELECT 1 FROM {table} g WHERE g.id = s.component_key AND g.knowledge_space_id = p.space \
                   AND g.publication_generation_id = s.generation_id \
                   AND EXISTS (SELECT 1 FROM document_assets d WHERE d.id = s.document_asset_id \
                     AND d.knowledge_space_id = p.space AND d.lifecycle_state = 'active') \
                   AND jsonb_typeof(g.source_node_ids) = 'array' AND jsonb_array_length(g.source_node_ids) > 0 \
                   AND NOT EXISTS (SELECT 1 FROM jsonb_array_elements(g.source_node_ids) sn(v) WHERE NOT EXISTS ( \
                     SELECT 1 FROM knowledge_nodes n \
                     JOIN index_projections ip ON ip.node_id = n.id AND ip.knowledge_space_id = p.space \
                       AND ip.status = 'ready' AND ip.publication_generation_id = s.generation_id \
                     JOIN projection_set_publication_members pm ON pm.tenant_id = p.tenant \
                       AND pm.knowledge_space_id = p.space AND pm.publication_id = $7 \
                       AND pm.component_type = 'index-projection' AND pm.component_key = ip.id \
                       AND pm.generation_id = s.generation_id AND pm.document_asset_id = s.document_asset_id \
                     WHERE jsonb_typeof(sn.v) = 'string' AND n.id::text = sn.v #>> '{{}}' \
                       AND n.knowledge_space_id = p.space AND n.publication_generation_id = s.generation_id \
                       AND n.document_asset_id = s.document_asset_id)){endpoints})"
            )
        }
    };
    format!(
        "{} INSERT INTO projection_set_publication_members (tenant_id, knowledge_space_id, publication_id, \
           component_type, component_key, generation_id, document_asset_id, created_at) \
         SELECT s.tenant_id, s.knowledge_space_id, $7, s.component_type, s.component_key, s.generation_id, \
           s.document_asset_id, s.created_at \
         FROM projection_set_publication_members s, p \
         WHERE s.tenant_id = p.tenant AND s.knowledge_space_id = p.space AND s.publication_id = $6 \
           AND {exclusion} AND {kind} \
         ON CONFLICT (publication_id, component_type, component_key) DO NOTHING",
        with(scope)
    )
}

/// Whether publication `$6` still has a member of the target: any member for a space; else a
/// member of a target document, or a graph member built from a target document's nodes.
fn serves_target(scope: Scope) -> String {
    let target = match scope {
        Scope::Space => "TRUE".to_owned(),
        _ => "(m.document_asset_id IN (SELECT id FROM td) \
              OR (m.component_type = 'graph-entity' AND EXISTS (SELECT 1 FROM graph_entities g \
                   WHERE g.id = m.component_key AND g.knowledge_space_id = p.space \
                     AND g.publication_generation_id = m.generation_id \
                     AND jsonb_typeof(g.source_node_ids) = 'array' \
                     AND g.source_node_ids ?| ARRAY(SELECT id::text FROM tn))) \
              OR (m.component_type = 'graph-relation' AND EXISTS (SELECT 1 FROM graph_relations g \
                   WHERE g.id = m.component_key AND g.knowledge_space_id = p.space \
                     AND g.publication_generation_id = m.generation_id \
                     AND jsonb_typeof(g.source_node_ids) = 'array' \
                     AND g.source_node_ids ?| ARRAY(SELECT id::text FROM tn))))"
            .to_owned(),
    };
    format!(
        "{} SELECT EXISTS (SELECT 1 FROM projection_set_publication_members m, p WHERE m.tenant_id = p.tenant \
           AND m.knowledge_space_id = p.space AND m.publication_id = $6 AND {target})",
        with(scope)
    )
}

async fn run7(
    tx: &mut PgConnection,
    job: &JobRow,
    sql: &str,
    old: Uuid,
    new: Uuid,
) -> Result<u64, JobError> {
    Ok(sqlx::query(sql)
        .bind(&job.tenant)
        .bind(job.space)
        .bind(job.target_id)
        .bind(1_i64)
        .bind(job.id)
        .bind(old)
        .bind(new)
        .execute(&mut *tx)
        .await?
        .rows_affected())
}

async fn serves(tx: &mut PgConnection, job: &JobRow, publication: Uuid) -> Result<bool, JobError> {
    Ok(sqlx::query_scalar(&serves_target(job.scope))
        .bind(&job.tenant)
        .bind(job.space)
        .bind(job.target_id)
        .bind(1_i64)
        .bind(job.id)
        .bind(publication)
        .fetch_one(&mut *tx)
        .await?)
}

/// Whether the published head still serves the target (for the residue check).
pub(super) async fn head_serves_target(
    tx: &mut PgConnection,
    job: &JobRow,
) -> Result<bool, JobError> {
    if matches!(job.scope, Scope::SourceKeep(_)) {
        return Ok(false);
    }
    match publication::head(tx, &job.tenant, job.space, false).await? {
        Some(h) => serves(tx, job, h.publication_id).await,
        None => Ok(false),
    }
}

/// Takes the target out of the head (a kept source: scrubs the head's source identity).
pub(super) async fn exclude_target(tx: &mut PgConnection, job: &JobRow) -> Result<(), JobError> {
    let Some(head) = publication::head(tx, &job.tenant, job.space, true).await? else {
        return Ok(());
    };
    if let Scope::SourceKeep(_) = job.scope {
        return scrub_source_identity(tx, job, &head).await;
    }
    if !serves(tx, job, head.publication_id).await? {
        return Ok(());
    }
    let metadata = serde_json::json!({ "deletionJobId": job.id, "excludesTarget": true });
    let new = replace_head(tx, job, &head, &metadata, true).await?;
    if serves(tx, job, new).await? {
        return Err(JobError::fatal(
            "head_exclusion_failed",
            "the publication that excludes the target still serves it",
        ));
    }
    Ok(())
}

async fn scrub_source_identity(
    tx: &mut PgConnection,
    job: &JobRow,
    head: &Head,
) -> Result<(), JobError> {
    let done: bool = sqlx::query_scalar(
        "SELECT coalesce(metadata->>'deletionJobId' = $3::text AND metadata->>'sourceIdentityScrubbed' = 'true', false) \
         FROM projection_set_publications WHERE tenant_id = $1 AND knowledge_space_id = $2 AND id = $4",
    )
    .bind(&job.tenant)
    .bind(job.space)
    .bind(job.id)
    .bind(head.publication_id)
    .fetch_optional(&mut *tx)
    .await?
    .unwrap_or(false);
    if done {
        return Ok(());
    }
    let metadata = serde_json::json!({ "deletionJobId": job.id, "retainedDocuments": true,
                                      "sourceIdentityScrubbed": true });
    replace_head(tx, job, head, &metadata, false).await?;
    Ok(())
}

/// A new published publication from the head's members (all of them, or those that survive the
/// exclusion), the old one superseded, the head swapped. Returns the new publication.
async fn replace_head(
    tx: &mut PgConnection,
    job: &JobRow,
    head: &Head,
    metadata: &serde_json::Value,
    exclude: bool,
) -> Result<Uuid, JobError> {
    let new = Uuid::new_v4();
    let fingerprint = publication::deletion_fingerprint(job.id, head.publication_id);
    let inserted = publication::insert(
        tx,
        new,
        &job.tenant,
        job.space,
        &fingerprint,
        head.projection_version,
        "published",
        metadata,
    )
    .await?;
    if !inserted {
        return Err(JobError::retryable(
            "publication_exists",
            "a publication with this deletion's fingerprint already exists",
        ));
    }
    // Readers serve a head only through its activated binding: the new head keeps the old one's.
    publication::binding::carry(
        &mut *tx,
        &job.tenant,
        job.space,
        head.publication_id,
        new,
        &fingerprint,
    )
    .await?;
    if exclude {
        for graph in [None, Some("entity"), Some("relation")] {
            run7(
                tx,
                job,
                &member_copy(job.scope, graph),
                head.publication_id,
                new,
            )
            .await?;
        }
    } else {
        sql::run(
            tx,
            job,
            1,
            &format!(
                "{} INSERT INTO projection_set_publication_members (tenant_id, knowledge_space_id, publication_id, \
                   component_type, component_key, generation_id, document_asset_id, created_at) \
                 SELECT s.tenant_id, s.knowledge_space_id, '{new}'::uuid, s.component_type, s.component_key, \
                   s.generation_id, s.document_asset_id, s.created_at \
                 FROM projection_set_publication_members s, p \
                 WHERE s.tenant_id = p.tenant AND s.knowledge_space_id = p.space \
                   AND s.publication_id = '{}'::uuid",
                with(job.scope),
                head.publication_id
            ),
        )
        .await?;
    }
    publication::transition(
        tx,
        &job.tenant,
        job.space,
        head.publication_id,
        "published",
        "superseded",
        Some(&fingerprint),
    )
    .await?;
    match publication::swap_head(tx, &job.tenant, job.space, head.revision, new).await? {
        Ok(_) => Ok(new),
        Err(moved) => Err(JobError::retryable(
            "head_moved",
            format!(
                "the publication head moved to revision {} during the swap",
                moved.current
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_confined_to_the_space_and_exclude_by_target() {
        for scope in [
            Scope::Space,
            Scope::Document(Uuid::nil()),
            Scope::SourceCascade(Uuid::nil()),
        ] {
            for graph in [None, Some("entity"), Some("relation")] {
                let sql = member_copy(scope, graph);
                assert!(sql.contains("s.tenant_id = p.tenant AND s.knowledge_space_id = p.space"));
                assert_eq!(sql.contains("FALSE"), scope == Scope::Space, "{scope:?}");
            }
        }
        assert!(member_copy(Scope::Document(Uuid::nil()), Some("relation"))
            .contains("subject_entity_id"));
    }
}
