//! The compile steps after the candidate, inside the engine's fenced transaction: the smoke
//! evaluation (the platform's structural check of the candidate, read only) and the publish.
//! Invariant: publishing fences the attempt's authority and frozen profile tuple, promotes the
//! candidate's projections and page index to `ready`, marks the document `parsed`, binds the
//! publication to the verified profile tuple, moves the head by compare-and-swap and applies the
//! attempt's logical-document intents, all in the one transaction, or changes nothing; a
//! candidate given up (cancel, supersede, most failures) becomes `inactive`, one whose publish
//! was refused by a fence stays a candidate.
//!
//! One deliberate difference from the platform's runtime: when another document's publication
//! moved the head after this attempt's base, the platform fails the attempt; here the candidate
//! is rebased over the moved head, so that documents compiled side by side in one space all
//! publish. It moves in place (the members that differ between the two heads, then its
//! fingerprint, metadata and the attempt's binding), which keeps the publishes of a space,
//! serialized on its head, short; where it cannot, a new candidate is composed over the head
//! (the old one becomes `inactive`, the attempt is bound to the new one).

use sqlx::PgConnection;
use uuid::Uuid;

use super::compose::{already_served, bind, compose, rebase, Compose, Rebased};
use super::intents;
use super::page_index::TOKENIZER_VERSION;
use super::profiles::{self, COMPILATION_FAILED};
use super::steps::{self, Attempt, Document};
use super::walk::{self, Checkpoint, Served};
use crate::access::Authority;
use crate::canonical::child_id;
use crate::jobs::{JobError, Step};
use crate::publication::{self, Head};

/// How long a publish queues for the space's head lock. The step's transaction holds the job
/// row meanwhile, which the heartbeat also needs, so the wait stays far below the heartbeat
/// interval; a publish that does not get the lock in time ends its slice with a cooperative
/// wait (no attempt used) and queues again when its message comes back.
const HEAD_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// When a publish that found the head busy tries again.
const HEAD_BUSY_RETRY: std::time::Duration = std::time::Duration::from_millis(200);

/// How long a publish waits for a deletion of a document its candidate serves.
const DELETION_FENCE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The smoke evaluation's counts for document `$5` in publication `$2` of tenant `$6`, space
/// `$1` (`$3` the page index's tokenizer version, `$4` the embedding profile's vector space or
/// NULL).
///
/// The members are found by publication and document only, so that the one index led by
/// the publication serves them and no more than the publication's members are read. Named
/// by tenant and space as well, two of the platform's indexes, (tenant, space, generation,
/// publication, …) and (tenant, space, publication, document, …), cost the same while the
/// table has no statistics, as a new space's has not, and the planner took the first: a
/// scan of the members of every publication the space ever had, 2–10 ms a smoke step. The
/// tenant and space are checked on the rows found.
///
/// Exactly one outline member, its outline row, a complete page index, and full-text (and,
/// with a profile, dense) projections that are members of this generation: one row, none
/// when the candidate has no member of the document.
pub const SMOKE_COUNTS_SQL: &str = "WITH found AS MATERIALIZED (SELECT * FROM projection_set_publication_members \
                    WHERE publication_id = $2 AND document_asset_id = $5), \
         m AS (SELECT * FROM found WHERE tenant_id = $6 AND knowledge_space_id = $1), \
         outlines AS ( \
           SELECT m.document_asset_id AS doc, count(*) AS n, \
             count(*) FILTER (WHERE pim.status IN ('building', 'ready') AND pim.tokenizer_version = $3 \
               AND pim.node_count > 0 AND pim.term_count > 0 \
               AND pim.node_count = (SELECT count(*) FROM page_index_nodes x WHERE x.manifest_id = pim.id) \
               AND pim.term_count = (SELECT count(*) FROM page_index_terms x WHERE x.manifest_id = pim.id)) AS indexed \
           FROM m \
           LEFT JOIN document_outlines o ON o.id = m.component_key AND o.knowledge_space_id = m.knowledge_space_id \
             AND o.publication_generation_id = m.generation_id AND o.document_asset_id = m.document_asset_id \
           LEFT JOIN page_index_manifests pim ON pim.knowledge_space_id = m.knowledge_space_id \
             AND pim.document_outline_id = m.component_key AND pim.publication_generation_id = m.generation_id \
             AND pim.document_asset_id = m.document_asset_id AND pim.document_version = o.version \
           WHERE m.component_type = 'document-outline' GROUP BY 1), \
         projections AS ( \
           SELECT m.document_asset_id AS doc, \
             count(*) FILTER (WHERE p.id IS NULL OR p.status NOT IN ('building', 'ready') \
               OR p.metadata ->> 'documentAssetId' IS DISTINCT FROM m.document_asset_id::text) AS broken, \
             count(*) FILTER (WHERE p.type = 'fts') AS fts, \
             count(*) FILTER (WHERE p.type = 'dense-vector' AND p.model = $4) AS dense \
           FROM m LEFT JOIN index_projections p ON p.id = m.component_key \
             AND p.knowledge_space_id = m.knowledge_space_id AND p.publication_generation_id = m.generation_id \
           WHERE m.component_type = 'index-projection' GROUP BY 1) \
         SELECT d.doc, coalesce(o.n, 0), coalesce(o.indexed, 0), coalesce(p.broken, 0), coalesce(p.fts, 0), \
           coalesce(p.dense, 0) \
         FROM (SELECT DISTINCT document_asset_id AS doc FROM m) d \
         LEFT JOIN outlines o ON o.doc = d.doc LEFT JOIN projections p ON p.doc = d.doc";

/// The first structural fault of the attempt's document in a candidate, or `None`. The
/// candidate's other documents are the head's, each checked as its own attempt's document.
async fn fault(
    conn: &mut PgConnection,
    a: &Attempt,
    candidate: Uuid,
) -> Result<Option<String>, JobError> {
    let vsid = a.embedding.as_ref().map(|(p, _)| p.vector_space_id.clone());
    let counts: Option<(Uuid, i64, i64, i64, i64, i64)> = sqlx::query_as(SMOKE_COUNTS_SQL)
        .bind(a.space)
        .bind(candidate)
        .bind(TOKENIZER_VERSION)
        .bind(&vsid)
        .bind(a.document)
        .bind(&a.tenant)
        .fetch_optional(&mut *conn)
        .await?;
    let Some((doc, outlines, indexed, broken, fts, dense)) = counts else {
        return Ok(Some(format!(
            "the candidate has no members of document {}",
            a.document
        )));
    };
    if outlines != 1 {
        return Ok(Some(format!(
            "document {doc} has {outlines} outline members, not 1"
        )));
    }
    if indexed != 1 {
        return Ok(Some(format!("document {doc} has no complete page index")));
    }
    if broken > 0 {
        return Ok(Some(format!(
            "document {doc} has {broken} missing or foreign projection members"
        )));
    }
    if fts == 0 {
        return Ok(Some(format!("document {doc} has no full-text projection")));
    }
    if vsid.is_some() && dense == 0 {
        return Ok(Some(format!(
            "document {doc} has no dense projection of the space's embedding profile"
        )));
    }
    // Every node of this document's generation is reachable through a member projection.
    let (nodes, unreachable): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE NOT EXISTS ( \
             SELECT 1 FROM index_projections p JOIN projection_set_publication_members m \
               ON m.component_key = p.id AND m.knowledge_space_id = p.knowledge_space_id \
              AND m.publication_id = $4 AND m.component_type = 'index-projection' \
             WHERE p.node_id = n.id AND p.type = 'fts' AND p.fts_document IS NOT NULL) \
           OR ($5::text IS NOT NULL AND NOT EXISTS ( \
             SELECT 1 FROM index_projections p JOIN projection_set_publication_members m \
               ON m.component_key = p.id AND m.knowledge_space_id = p.knowledge_space_id \
              AND m.publication_id = $4 AND m.component_type = 'index-projection' \
             WHERE p.node_id = n.id AND p.type = 'dense-vector' AND p.model = $5 AND p.dense_vector IS NOT NULL))) \
         FROM knowledge_nodes n \
         WHERE n.knowledge_space_id = $1 AND n.publication_generation_id = $2 AND n.document_asset_id = $3",
    )
    .bind(a.space)
    .bind(a.generation)
    .bind(a.document)
    .bind(candidate)
    .bind(&vsid)
    .fetch_one(&mut *conn)
    .await?;
    if nodes == 0 {
        return Ok(Some("the document has no knowledge nodes".into()));
    }
    if unreachable > 0 {
        return Ok(Some(format!(
            "{unreachable} of {nodes} nodes have no member projection"
        )));
    }
    Ok(None)
}

fn bound(a: &Attempt) -> Result<(Uuid, String), JobError> {
    a.candidate.clone().ok_or_else(|| {
        JobError::fatal(
            "candidate_missing",
            "no candidate publication is bound to the attempt",
        )
    })
}

/// projection_built → smoke_eval_passed: the platform's structural check of the candidate's
/// replacement of the attempt's document. The members it inherits are the head's, which each
/// passed this check as their own document's replacement when they were published; checking
/// them again made every publish of a space cost as much as the space is large.
pub(crate) async fn smoke_step(conn: &mut PgConnection, a: &Attempt) -> Result<(), JobError> {
    let (candidate, _) = bound(a)?;
    if let Some(why) = fault(conn, a, candidate).await? {
        return Err(JobError::fatal(
            "smoke_eval_failed",
            format!("document compilation candidate evaluation failed: {why}"),
        ));
    }
    Ok(())
}

/// Marks the attempt's candidate `inactive` if it was never published: on failure, cancel or
/// supersede, as the platform deactivates a candidate it gives up.
pub(crate) async fn deactivate(conn: &mut PgConnection, attempt: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE projection_set_publications p SET status = 'inactive', updated_at = now() \
         FROM document_compilation_attempts a \
         WHERE a.id = $1 AND p.id = a.candidate_publication_id AND p.tenant_id = a.tenant_id \
           AND p.knowledge_space_id = a.knowledge_space_id AND p.status IN ('candidate', 'validating')",
    )
    .bind(attempt)
    .execute(conn)
    .await?;
    Ok(())
}

/// What the head serves of the attempt's document.
async fn served(
    conn: &mut PgConnection,
    a: &Attempt,
    head: Option<&Head>,
) -> Result<Option<Served>, JobError> {
    let Some(h) = head else { return Ok(None) };
    let generation: Option<Uuid> = sqlx::query_scalar(
        "SELECT generation_id FROM projection_set_publication_members \
         WHERE publication_id = $1 AND knowledge_space_id = $2 AND document_asset_id = $3 \
           AND component_type = 'document-outline' LIMIT 1",
    )
    .bind(h.publication_id)
    .bind(a.space)
    .bind(a.document)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(g) = generation else { return Ok(None) };
    if g == a.generation {
        return Ok(Some(Served {
            version: a.version,
            ours: true,
            by_later_attempt: false,
        }));
    }
    let other: Option<(i32, bool)> = sqlx::query_as(
        "SELECT document_version, (created_at, id) > ($5, $6) FROM document_compilation_attempts \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND document_asset_id = $3 AND publication_generation_id = $4",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.document)
    .bind(g)
    .bind(a.created_at)
    .bind(a.id)
    .fetch_optional(&mut *conn)
    .await?;
    let version: Option<i32> = match other {
        Some((v, _)) => Some(v),
        None => sqlx::query_scalar(
            "SELECT version FROM document_outlines WHERE knowledge_space_id = $1 AND publication_generation_id = $2 \
               AND document_asset_id = $3 LIMIT 1",
        )
        .bind(a.space)
        .bind(g)
        .bind(a.document)
        .fetch_optional(&mut *conn)
        .await?,
    };
    Ok(version.map(|v| Served {
        version: v,
        ours: false,
        by_later_attempt: other.is_some_and(|(_, later)| later),
    }))
}

/// smoke_eval_passed → published: the platform's publish transaction.
pub(crate) async fn publish_step(
    conn: &mut PgConnection,
    a: &Attempt,
    d: &Document,
) -> Result<Step, JobError> {
    let (candidate, fingerprint) = bound(a)?;
    let space: Option<(String, Option<Uuid>)> = sqlx::query_as(
        "SELECT lifecycle_state::text, deletion_job_id FROM knowledge_spaces WHERE tenant_id = $1 AND id = $2 FOR SHARE",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .fetch_optional(&mut *conn)
    .await?;
    if !matches!(&space, Some((state, None)) if state == "active") {
        deactivate(conn, a.id).await?;
        return Ok(Step::Cancel {
            code: "document_deleting".into(),
            message: "the knowledge space is being deleted".into(),
        });
    }
    if let Authority::Snapshot {
        subject,
        snapshot,
        revision,
        channel,
    } = &a.authority
    {
        let valid =
            crate::access::revalidate(conn, &a.tenant, a.space, *snapshot, subject, channel)
                .await?;
        match valid {
            Some(v) if v.revision == *revision && v.role != "viewer" => {}
            _ => {
                return Err(JobError::fatal(
                    "permission_snapshot_invalid",
                    format!(
                        "the requester's permission snapshot {snapshot} no longer allows {subject} to write to the space"
                    ),
                ))
            }
        }
    }
    let head = match publication::lock_head_within(conn, &a.tenant, a.space, HEAD_LOCK_WAIT).await?
    {
        publication::Locked::Held(head) => head,
        publication::Locked::Busy => {
            crate::metrics::publish_head_wait();
            return Ok(Step::Wait {
                delay: HEAD_BUSY_RETRY,
                reason: "other publishes of the space hold its publication head".into(),
            });
        }
    };
    let newest = steps::newest_other_active(conn, a).await?;
    let served_now = served(conn, a, head.as_ref()).await?;
    if let Some(stopped) = steps::stop(walk::gate(&steps::facts(a, d, newest, served_now))) {
        deactivate(conn, a.id).await?;
        return stopped;
    }
    if served_now.is_some_and(|s| s.ours) {
        // Already published (a repeated step after an uncertain commit).
        return Ok(Step::Succeed(Checkpoint::Published.as_str().into()));
    }
    // The platform's profile fence: the space's profile heads must still be the tuple the
    // attempt froze. A refusal fails the attempt with nothing published.
    let current_profiles = profiles::heads(conn, &a.tenant, a.space).await?;
    let tuple = profiles::fence(a.profiles.as_ref(), &current_profiles).map_err(|why| {
        JobError::fatal(
            COMPILATION_FAILED,
            format!("the publication lost its frozen knowledge-space profile fence: {why}"),
        )
    })?;
    let current = head.as_ref().map_or(0, |h| h.revision);
    let rebased = match head.as_ref() {
        Some(h) if current != a.base_head_revision => rebase(conn, a, h, candidate).await?,
        _ => Rebased::Apart,
    };
    let (candidate, fingerprint) = if current == a.base_head_revision {
        (candidate, fingerprint)
    } else if let Rebased::Moved(c) = rebased {
        // The document's own members are those the smoke evaluation passed; the rest are the
        // head's, published already.
        tracing::debug!(attempt = %a.id, from = a.base_head_revision, to = current, "head moved; candidate rebased in place");
        crate::metrics::publish_rebase("in_place");
        (c.id, c.fingerprint)
    } else if let Rebased::Served = rebased {
        deactivate(conn, a.id).await?;
        return Ok(already_served(a));
    } else {
        let id = child_id(
            a.id,
            &format!("projection-publication-candidate:rebase:{current}"),
        );
        let c = match compose(conn, a, head.as_ref(), id).await? {
            Compose::Served => {
                deactivate(conn, a.id).await?;
                return Ok(already_served(a));
            }
            Compose::Made(c) => c,
        };
        deactivate(conn, a.id).await?;
        bind(conn, a, &c, current).await?;
        if let Some(why) = fault(conn, a, c.id).await? {
            return Err(JobError::fatal(
                "smoke_eval_failed",
                format!(
                    "the candidate rebased over head revision {current} failed evaluation: {why}"
                ),
            ));
        }
        tracing::debug!(attempt = %a.id, from = a.base_head_revision, to = current, "head moved; candidate rebased");
        crate::metrics::publish_rebase("recomposed");
        (c.id, c.fingerprint)
    };
    let tombstoned: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM deletion_tombstones t WHERE t.tenant_id = $1 AND t.knowledge_space_id = $2 \
           AND ((t.target_type = 'knowledge_space' AND t.target_id = $2) \
             OR (t.target_type = 'document_asset' AND t.target_id IN \
                  (SELECT m.document_asset_id FROM projection_set_publication_members m \
                   WHERE m.tenant_id = $1 AND m.knowledge_space_id = $2 AND m.publication_id = $3)) \
             OR (t.target_type = 'source' AND t.target_id IN \
                  (SELECT d.source_id FROM document_assets d JOIN projection_set_publication_members m \
                     ON m.document_asset_id = d.id \
                   WHERE m.tenant_id = $1 AND m.knowledge_space_id = $2 AND m.publication_id = $3)) \
             OR (t.target_type = 'logical_document' AND t.target_id IN \
                  (SELECT r.document_id FROM document_revisions r JOIN projection_set_publication_members m \
                     ON m.tenant_id = r.tenant_id AND m.knowledge_space_id = r.knowledge_space_id \
                    AND m.document_asset_id = r.document_asset_id \
                   WHERE m.tenant_id = $1 AND m.knowledge_space_id = $2 AND m.publication_id = $3))))",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(candidate)
    .fetch_one(&mut *conn)
    .await?;
    if tombstoned {
        // The platform refuses to publish over a deletion in progress. The deletion takes its
        // target out of the head at the end of its quiescing; this attempt then finds the head
        // moved and composes its candidate again without it. Waiting uses no attempt.
        return Ok(Step::Wait {
            delay: DELETION_FENCE_WAIT,
            reason: "a deletion of the space or of a document the candidate serves is under way"
                .into(),
        });
    }
    promote(conn, a, candidate).await?;
    let parsed = sqlx::query(
        "UPDATE document_assets SET parser_status = 'parsed', updated_at = now() \
         WHERE id = $1 AND knowledge_space_id = $2 AND version = $3 AND lifecycle_state = 'active' \
           AND deletion_job_id IS NULL",
    )
    .bind(a.document)
    .bind(a.space)
    .bind(a.version)
    .execute(&mut *conn)
    .await?;
    if parsed.rows_affected() != 1 {
        return Err(JobError::retryable(
            "document_changed",
            "the document changed while its compilation was being published",
        ));
    }
    match publication::publish(
        conn,
        &a.tenant,
        a.space,
        current,
        candidate,
        &fingerprint,
        Some(&tuple),
    )
    .await?
    {
        Ok(revision) => {
            intents::publish(conn, a, candidate, &fingerprint).await?;
            tracing::debug!(attempt = %a.id, revision, "published");
            Ok(Step::Succeed(Checkpoint::Published.as_str().into()))
        }
        Err(publication::Refused::Moved(moved)) => Err(JobError::retryable(
            "head_contended",
            format!(
                "the publication head appeared at revision {} during publish",
                moved.current
            ),
        )),
        Err(publication::Refused::Binding(_)) => Err(JobError::fatal(
            COMPILATION_FAILED,
            "the publication has a conflicting activated profile binding",
        )),
    }
}

/// The candidate's own projections and page index become `ready` (what it inherited from the
/// head is `ready` already; restricting to the attempt's generation keeps this off the head's
/// other members, which grow with the space).
async fn promote(conn: &mut PgConnection, a: &Attempt, candidate: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE index_projections ip SET status = 'ready', updated_at = now() \
         FROM projection_set_publication_members pm \
         WHERE pm.tenant_id = $1 AND pm.knowledge_space_id = $2 AND pm.publication_id = $3 \
           AND pm.generation_id = $4 \
           AND pm.component_type = 'index-projection' AND ip.id = pm.component_key \
           AND ip.knowledge_space_id = pm.knowledge_space_id AND ip.publication_generation_id = pm.generation_id \
           AND ip.status = 'building'",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(candidate)
    .bind(a.generation)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "UPDATE page_index_manifests pim SET status = 'ready', updated_at = now() \
         FROM projection_set_publication_members pm \
         JOIN document_outlines o ON o.id = pm.component_key AND o.knowledge_space_id = pm.knowledge_space_id \
           AND o.publication_generation_id = pm.generation_id \
         WHERE pm.tenant_id = $1 AND pm.knowledge_space_id = $2 AND pm.publication_id = $3 \
           AND pm.generation_id = $4 \
           AND pm.component_type = 'document-outline' AND pim.knowledge_space_id = pm.knowledge_space_id \
           AND pim.document_outline_id = pm.component_key AND pim.publication_generation_id = pm.generation_id \
           AND pim.document_asset_id = pm.document_asset_id AND pim.document_version = o.version \
           AND pim.status = 'building'",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(candidate)
    .bind(a.generation)
    .execute(conn)
    .await?;
    Ok(())
}
