//! A document's candidate publication: its members, its fingerprint (the platform's, over
//! exactly those members) and its binding on the attempt. Invariant: a candidate holds this
//! document's own components of the attempt's generation, and either nothing else (an
//! *owner-only* candidate, what an attempt composes before it publishes: its metadata says so,
//! so the platform's coordinator refuses it as not the attempt's full candidate) or, for every
//! other document, the members of one head (its metadata's `baseHeadRevision`); completed over
//! a head at publish ([`complete`]) it takes what differs from that head (and the own members of
//! the attempts publishing with it) and the fingerprint of the result, or is left for a new
//! candidate when that fingerprint belongs to another publication. So an attempt writes its
//! own members once, and each head move copies the space's members once, whatever the number
//! of documents it publishes. A candidate of identical content that an ended attempt left is
//! taken over rather than duplicated (fingerprints are unique in a space).

use serde_json::json;
use sqlx::PgConnection;
use uuid::Uuid;

use super::candidate::{self, ProjectionConfig, SourceSnapshot};
use super::steps::Attempt;
use crate::canonical::child_id;
use crate::jobs::{JobError, Step};
use crate::publication::{
    self, Head, Member, DOCUMENT_OUTLINE, INDEX_PROJECTION, KNOWLEDGE_PATH, MULTIMODAL_MANIFEST,
};

/// The source snapshot of each document a publication `$1` of space `$2` holds (outline
/// members, `$3` = `document-outline`): a rebased candidate's, for its fingerprint.
///
/// Each outline's document and artifact are looked up from the outline, one row each. As
/// plain joins, the planner may start from every document of the space instead (it did on
/// tables not yet analysed, as a new space's are: a probe of every outline member for each
/// document, 5 ms of each publish under the head lock); the fenced subqueries keep the
/// lookups per outline whatever the statistics say.
pub const MEMBER_SNAPSHOTS_SQL: &str = "SELECT o.document_asset_id AS document, o.version, d.sha256, pa.artifact_hash \
         FROM projection_set_publication_members m \
         JOIN document_outlines o ON o.id = m.component_key AND o.knowledge_space_id = $2 \
         CROSS JOIN LATERAL (SELECT d.sha256 FROM document_assets d \
           WHERE d.id = o.document_asset_id AND d.knowledge_space_id = o.knowledge_space_id OFFSET 0) d \
         LEFT JOIN LATERAL (SELECT pa.artifact_hash FROM parse_artifacts pa \
           WHERE pa.document_asset_id = o.document_asset_id AND pa.version = o.version OFFSET 0) pa ON true \
         WHERE m.publication_id = $1 AND m.component_type = $3";

/// This document's own members of the attempt's generation.
async fn own_members(conn: &mut PgConnection, a: &Attempt) -> Result<Vec<Member>, sqlx::Error> {
    let rows: Vec<(String, Uuid)> = sqlx::query_as(
        "SELECT $5::text, o.id FROM document_outlines o \
           WHERE o.knowledge_space_id = $1 AND o.publication_generation_id = $2 AND o.document_asset_id = $3 \
             AND o.version = $4 \
         UNION ALL SELECT $6::text, mm.id FROM document_multimodal_manifests mm \
           WHERE mm.knowledge_space_id = $1 AND mm.publication_generation_id = $2 AND mm.document_asset_id = $3 \
             AND mm.version = $4 \
         UNION ALL SELECT $7::text, kp.id FROM knowledge_paths kp \
           WHERE kp.knowledge_space_id = $1 AND kp.publication_generation_id = $2 AND kp.resource_type = 'document' \
             AND kp.target_id = $3::text \
         UNION ALL SELECT $8::text, p.id FROM index_projections p \
           JOIN knowledge_nodes n ON n.id = p.node_id AND n.knowledge_space_id = p.knowledge_space_id \
             AND n.publication_generation_id = p.publication_generation_id \
           WHERE p.knowledge_space_id = $1 AND p.publication_generation_id = $2 AND n.document_asset_id = $3",
    )
    .bind(a.space)
    .bind(a.generation)
    .bind(a.document)
    .bind(a.version)
    .bind(DOCUMENT_OUTLINE)
    .bind(MULTIMODAL_MANIFEST)
    .bind(KNOWLEDGE_PATH)
    .bind(INDEX_PROJECTION)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(component_type, component_key)| Member {
            component_type,
            component_key,
            generation_id: a.generation,
            document_asset_id: Some(a.document),
        })
        .collect())
}

/// A composed candidate.
pub(crate) struct Composed {
    pub id: Uuid,
    pub fingerprint: String,
}

/// What became of composing a candidate.
pub(crate) enum Compose {
    Made(Composed),
    /// The head already serves exactly this content.
    Served,
    /// An owner-only candidate's fingerprint belongs to a publication that cannot become this
    /// attempt's (one the space once published with this document alone): compose it over the
    /// head instead.
    Taken,
}

/// Which members a composed candidate holds besides the document's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Only the document's own; the head's are added when it publishes.
    Owner,
    /// The head's members of every other document too.
    OverHead,
}

/// The key of the candidate metadata marking an owner-only candidate. The platform's
/// coordinator compares an attempt's candidate metadata with its own rendering of the attempt,
/// so a candidate carrying this key can never be published by it as it stands.
pub const OWNER_ONLY_KEY: &str = "kfsMembers";

/// Writes the candidate publication `id` for the head `head`: its row (`candidate`) and its
/// members (the head's, inherited, only in [`Scope::OverHead`]).
pub(crate) async fn compose(
    conn: &mut PgConnection,
    a: &Attempt,
    head: Option<&Head>,
    id: Uuid,
    scope: Scope,
) -> Result<Compose, JobError> {
    let own = own_members(conn, a).await?;
    if !own.iter().any(|m| m.component_type == DOCUMENT_OUTLINE) {
        return Err(JobError::fatal(
            "candidate_incomplete",
            "the attempt's generation has no outline to publish",
        ));
    }
    let mut members = own.clone();
    let inherit = head.filter(|_| scope == Scope::OverHead);
    if let Some(h) = inherit {
        let inherited = publication::members(conn, a.space, h.publication_id).await?;
        members.extend(
            inherited
                .into_iter()
                .filter(|m| m.document_asset_id != Some(a.document)),
        );
    }
    let keys = |ty: &str| -> Vec<Uuid> {
        members
            .iter()
            .filter(|m| m.component_type == ty)
            .map(|m| m.component_key)
            .collect()
    };
    let configs: Vec<ProjectionConfig> = sqlx::query_as(
        "SELECT DISTINCT type::text AS kind, model::text AS model, projection_version FROM index_projections \
         WHERE knowledge_space_id = $1 AND id = ANY($2)",
    )
    .bind(a.space)
    .bind(keys(INDEX_PROJECTION))
    .fetch_all(&mut *conn)
    .await?;
    let snapshots: Vec<SourceSnapshot> = sqlx::query_as(
        "SELECT o.document_asset_id AS document, o.version, d.sha256, pa.artifact_hash FROM document_outlines o \
         JOIN document_assets d ON d.id = o.document_asset_id AND d.knowledge_space_id = o.knowledge_space_id \
         LEFT JOIN parse_artifacts pa ON pa.document_asset_id = o.document_asset_id AND pa.version = o.version \
         WHERE o.knowledge_space_id = $1 AND o.id = ANY($2)",
    )
    .bind(a.space)
    .bind(keys(DOCUMENT_OUTLINE))
    .fetch_all(&mut *conn)
    .await?;
    let base = head.map_or(0, |h| h.revision);
    let Described {
        fingerprint,
        mut metadata,
        projection_version,
    } = describe(a, base, &configs, &snapshots)?;
    if scope == Scope::Owner {
        metadata["documentCompilationCandidate"][OWNER_ONLY_KEY] = json!("owner-only");
    }
    publication::insert(
        conn,
        id,
        &a.tenant,
        a.space,
        &fingerprint,
        projection_version,
        "candidate",
        &metadata,
    )
    .await?;
    let holder: Option<(Uuid, String, bool)> = sqlx::query_as(
        "SELECT p.id, p.status::text, EXISTS (SELECT 1 FROM document_compilation_attempts a \
             WHERE a.tenant_id = p.tenant_id AND a.knowledge_space_id = p.knowledge_space_id \
               AND a.candidate_publication_id = p.id AND a.active_slot = 1 AND a.id <> $4) \
         FROM projection_set_publications p \
         WHERE p.tenant_id = $1 AND p.knowledge_space_id = $2 AND p.fingerprint = $3",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(&fingerprint)
    .bind(a.id)
    .fetch_optional(&mut *conn)
    .await?;
    let id = match holder {
        Some((h, _, _)) if h == id => id,
        Some((h, _, _)) if head.is_some_and(|x| x.publication_id == h) => return Ok(Compose::Served),
        // A candidate of the same content that an ended attempt gave up (its row cannot be
        // duplicated: fingerprints are unique in a space) becomes this attempt's candidate.
        Some((h, status, false)) if status == "candidate" || status == "inactive" => {
            sqlx::query(
                "UPDATE projection_set_publications SET status = 'candidate', metadata = $4, \
                   projection_version = $5, updated_at = now() \
                 WHERE id = $3 AND tenant_id = $1 AND knowledge_space_id = $2",
            )
            .bind(&a.tenant)
            .bind(a.space)
            .bind(h)
            .bind(&metadata)
            .bind(projection_version)
            .execute(&mut *conn)
            .await?;
            h
        }
        Some(_) if scope == Scope::Owner => return Ok(Compose::Taken),
        Some((h, status, _)) => {
            return Err(JobError::fatal(
                "candidate_fingerprint_taken",
                format!(
                    "publication {h} ({status}) of this space already has the candidate's fingerprint {fingerprint}"
                ),
            ))
        }
        None => {
            return Err(JobError::fatal(
                "candidate_missing",
                format!("the candidate publication {id} was not written"),
            ))
        }
    };
    publication::set_members(
        conn,
        &a.tenant,
        a.space,
        id,
        inherit.map(|h| h.publication_id),
        Some(a.document),
        &own,
    )
    .await?;
    Ok(Compose::Made(Composed { id, fingerprint }))
}

/// A candidate's fingerprint and row, from the configs and snapshots of its members.
struct Described {
    fingerprint: String,
    metadata: serde_json::Value,
    projection_version: i32,
}

fn describe(
    a: &Attempt,
    base: i32,
    configs: &[ProjectionConfig],
    snapshots: &[SourceSnapshot],
) -> Result<Described, JobError> {
    let material = candidate::material(a.space, configs, snapshots);
    let fingerprint = candidate::fingerprint(&material);
    let mut meta_candidate = json!({
        "attemptId": a.id, "baseHeadRevision": base, "ownerDocumentAssetId": a.document,
        "ownerDocumentVersion": a.version, "publicationGenerationId": a.generation, "schemaVersion": 1,
    });
    if let Some((p, digest)) = &a.embedding {
        meta_candidate["embeddingProfile"] = json!({ "kind": "embedding", "revision": p.revision,
            "revisionId": p.revision_id, "snapshotDigest": digest });
    }
    Ok(Described {
        fingerprint,
        metadata: json!({ "documentCompilationCandidate": meta_candidate,
                          "projectionSetFingerprintMaterial": material }),
        projection_version: candidate::projection_version(configs),
    })
}

/// What became of completing a candidate in place.
pub(crate) enum Rebased {
    /// The candidate now stands over the head, under this fingerprint, and the attempt is bound
    /// to it there.
    Moved(Composed),
    /// The head already serves exactly this content.
    Served,
    /// Another publication holds the fingerprint, another attempt names the candidate, or it is
    /// no longer a candidate: compose a new one instead.
    Apart,
}

/// Another attempt whose document a candidate publishes too: the attempt, its document and
/// version, its generation and its own candidate (where its members are).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Joined {
    pub attempt: Uuid,
    pub document: Uuid,
    pub version: i32,
    pub generation: Uuid,
    pub candidate: Uuid,
}

/// Completes the attempt's candidate `candidate` over `head`, in place, for publishing: for
/// every document neither this attempt nor one of `joined` publishes, the head's members
/// (only those it lacks are copied, those no longer in the head deleted: an owner-only
/// candidate takes them all, one composed over an older head the difference); each of `joined`
/// its own members, copied from its candidate; this document's own members stay as the smoke
/// evaluation found them. Then its fingerprint and metadata follow, and the attempt's binding.
pub(crate) async fn complete(
    conn: &mut PgConnection,
    a: &Attempt,
    head: Option<&Head>,
    candidate: Uuid,
    joined: &[Joined],
) -> Result<Rebased, JobError> {
    let mut documents: Vec<Uuid> = joined.iter().map(|j| j.document).collect();
    documents.push(a.document);
    // The members are looked up by publication alone: it names one space, and the unique index
    // it leads serves the lookups whatever the table's statistics say. The deletions (a data-
    // modifying `WITH` runs whether read or not) and the copies touch disjoint members.
    if let Some(h) = head {
        sqlx::query(
            "WITH gone AS ( \
               DELETE FROM projection_set_publication_members c \
               WHERE c.publication_id = $1 AND c.document_asset_id IS DISTINCT FROM $3 \
                 AND (c.document_asset_id = ANY($4) OR NOT EXISTS ( \
                   SELECT 1 FROM projection_set_publication_members h \
                   WHERE h.publication_id = $2 AND h.component_type = c.component_type \
                     AND h.component_key = c.component_key)) \
               RETURNING 1) \
             INSERT INTO projection_set_publication_members (tenant_id, knowledge_space_id, publication_id, \
               component_type, component_key, generation_id, document_asset_id, created_at) \
             SELECT h.tenant_id, h.knowledge_space_id, $1, h.component_type, h.component_key, h.generation_id, \
               h.document_asset_id, now() \
             FROM projection_set_publication_members h \
             WHERE h.publication_id = $2 \
               AND (h.document_asset_id IS NULL OR h.document_asset_id <> ALL($4)) \
               AND NOT EXISTS (SELECT 1 FROM projection_set_publication_members c \
                 WHERE c.publication_id = $1 AND c.component_type = h.component_type \
                   AND c.component_key = h.component_key)",
        )
        .bind(candidate)
        .bind(h.publication_id)
        .bind(a.document)
        .bind(&documents)
        .execute(&mut *conn)
        .await?;
    }
    if !joined.is_empty() {
        let docs: Vec<Uuid> = joined.iter().map(|j| j.document).collect();
        let gens: Vec<Uuid> = joined.iter().map(|j| j.generation).collect();
        let from: Vec<Uuid> = joined.iter().map(|j| j.candidate).collect();
        if head.is_none() {
            // No head: what the candidate holds of the joined documents is at most theirs.
            sqlx::query(
                "DELETE FROM projection_set_publication_members \
                 WHERE publication_id = $1 AND document_asset_id = ANY($2)",
            )
            .bind(candidate)
            .bind(&docs)
            .execute(&mut *conn)
            .await?;
        }
        sqlx::query(
            "INSERT INTO projection_set_publication_members (tenant_id, knowledge_space_id, publication_id, \
               component_type, component_key, generation_id, document_asset_id, created_at) \
             SELECT m.tenant_id, m.knowledge_space_id, $1, m.component_type, m.component_key, m.generation_id, \
               m.document_asset_id, now() \
             FROM unnest($2::uuid[], $3::uuid[], $4::uuid[]) AS j(publication, document, generation) \
             JOIN projection_set_publication_members m ON m.publication_id = j.publication \
               AND m.document_asset_id = j.document AND m.generation_id = j.generation \
             WHERE m.knowledge_space_id = $5 \
             ON CONFLICT (publication_id, component_type, component_key) DO NOTHING",
        )
        .bind(candidate)
        .bind(&from)
        .bind(&docs)
        .bind(&gens)
        .bind(a.space)
        .execute(&mut *conn)
        .await?;
    }
    let configs: Vec<ProjectionConfig> = sqlx::query_as(
        "SELECT DISTINCT p.type::text AS kind, p.model::text AS model, p.projection_version \
         FROM projection_set_publication_members m \
         JOIN index_projections p ON p.id = m.component_key AND p.knowledge_space_id = $2 \
         WHERE m.publication_id = $1 AND m.component_type = $3",
    )
    .bind(candidate)
    .bind(a.space)
    .bind(INDEX_PROJECTION)
    .fetch_all(&mut *conn)
    .await?;
    let snapshots: Vec<SourceSnapshot> = sqlx::query_as(MEMBER_SNAPSHOTS_SQL)
        .bind(candidate)
        .bind(a.space)
        .bind(DOCUMENT_OUTLINE)
        .fetch_all(&mut *conn)
        .await?;
    let revision = head.map_or(0, |h| h.revision);
    let Described {
        fingerprint,
        metadata,
        projection_version,
    } = describe(a, revision, &configs, &snapshots)?;
    // The fingerprint is unique in a space: the row moves only when no other publication holds
    // it, and a new fingerprint only while no other attempt (one that ended and left it) names
    // the row: its reference names the fingerprint. The attempt's binding moves in the same
    // statement, and the constraint is checked once the statement has written both.
    let rows: Vec<(Uuid, bool)> = sqlx::query_as(
        "WITH other AS ( \
           SELECT id FROM projection_set_publications \
           WHERE tenant_id = $1 AND knowledge_space_id = $2 AND fingerprint = $4 AND id <> $3), \
         moved AS ( \
           UPDATE projection_set_publications SET fingerprint = $4, metadata = $5, projection_version = $6, \
             updated_at = now() \
           WHERE id = $3 AND tenant_id = $1 AND knowledge_space_id = $2 \
             AND status IN ('candidate', 'validating') AND NOT EXISTS (SELECT 1 FROM other) \
             AND (fingerprint = $4 OR NOT EXISTS (SELECT 1 FROM document_compilation_attempts x \
               WHERE x.tenant_id = $1 AND x.knowledge_space_id = $2 AND x.candidate_publication_id = $3 \
                 AND x.id <> $7)) \
           RETURNING id), \
         bound AS ( \
           UPDATE document_compilation_attempts SET candidate_fingerprint = $4, base_head_revision = $8, \
             updated_at = now() \
           WHERE id = $7 AND tenant_id = $1 AND knowledge_space_id = $2 AND candidate_publication_id = $3 \
             AND EXISTS (SELECT 1 FROM moved) \
           RETURNING id) \
         SELECT m.id, true FROM moved m JOIN bound b ON true UNION ALL SELECT id, false FROM other",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(candidate)
    .bind(&fingerprint)
    .bind(&metadata)
    .bind(projection_version)
    .bind(a.id)
    .bind(revision)
    .fetch_all(&mut *conn)
    .await?;
    Ok(match rows.first() {
        Some(&(_, true)) => Rebased::Moved(Composed {
            id: candidate,
            fingerprint,
        }),
        Some(&(other, false)) if head.is_some_and(|h| other == h.publication_id) => Rebased::Served,
        _ => Rebased::Apart,
    })
}

/// Binds (or, after a rebase, re-binds) the attempt to its candidate.
pub(crate) async fn bind(
    conn: &mut PgConnection,
    a: &Attempt,
    c: &Composed,
    base: i32,
) -> Result<(), JobError> {
    let bound = sqlx::query(
        "UPDATE document_compilation_attempts SET candidate_publication_id = $2, candidate_fingerprint = $3, \
           base_head_revision = $4, updated_at = now() \
         WHERE id = $1 AND tenant_id = $5 AND knowledge_space_id = $6 \
           AND candidate_publication_id IS NOT DISTINCT FROM $7",
    )
    .bind(a.id)
    .bind(c.id)
    .bind(&c.fingerprint)
    .bind(base)
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.candidate.as_ref().map(|(id, _)| *id))
    .execute(&mut *conn)
    .await?;
    if bound.rows_affected() != 1 {
        return Err(JobError::fatal(
            "candidate_conflict",
            "the candidate publication was bound concurrently",
        ));
    }
    Ok(())
}

/// The stop of a step that found its content already served.
pub(crate) fn already_served(a: &Attempt) -> Step {
    Step::Supersede {
        message: format!(
            "the space already serves an identical build of document {} version {}",
            a.document, a.version
        ),
    }
}

/// nodes_generated → projection_built: the attempt's owner-only candidate, bound once.
pub(crate) async fn candidate_step(
    conn: &mut PgConnection,
    a: &Attempt,
) -> Result<Option<Step>, JobError> {
    if a.candidate.is_some() {
        return Ok(None);
    }
    // No lock: the candidate holds the document's own members only, and is completed over
    // whatever head there is when it publishes.
    let head = publication::head(conn, &a.tenant, a.space, false).await?;
    let id = child_id(a.id, "projection-publication-candidate");
    let mut made = compose(conn, a, head.as_ref(), id, Scope::Owner).await?;
    if let Compose::Taken = made {
        made = compose(conn, a, head.as_ref(), id, Scope::OverHead).await?;
    }
    match made {
        Compose::Served => Ok(Some(already_served(a))),
        Compose::Made(c) => {
            bind(conn, a, &c, head.map_or(0, |h| h.revision)).await?;
            Ok(None)
        }
        Compose::Taken => Err(JobError::fatal(
            "candidate_fingerprint_taken",
            "another publication of this space already has the candidate's fingerprint",
        )),
    }
}
