//! The compile steps after the candidate, inside the engine's fenced transaction: the smoke
//! evaluation (the platform's structural check of the candidate, read only) and the publish.
//! Invariant: publishing fences the attempt's authority and frozen profile tuple, promotes the
//! candidate's projections and page index to `ready`, marks the document `parsed`, binds the
//! publication to the verified profile tuple, moves the head by compare-and-swap and applies the
//! attempt's logical-document intents, all in the one transaction, or changes nothing; a
//! candidate given up (cancel, supersede, most failures) becomes `inactive`, one whose publish
//! was refused by a fence stays a candidate.
//!
//! Two deliberate differences from the platform's runtime, both so that the documents of a bulk
//! upload into one space all publish, in time that grows with their number and not with its
//! square:
//! - The candidate is completed over the head when it publishes, not composed over it before:
//!   an attempt's candidate holds its own members until then ([`super::compose`]), and each
//!   head move copies the space's members once. When another publication moved the head after
//!   the attempt's base, the platform fails the attempt; here the candidate follows the moved
//!   head (in place; where it cannot, a new candidate is composed over the head, the old one
//!   becomes `inactive` and the attempt is bound to the new one).
//! - One head move publishes every attempt of the space that is ready: the publishing attempt
//!   takes with it the attempts parked at `smoke_eval_passed` that no worker holds, each checked
//!   as its own publish checks it (authority, gate, snapshot, profile tuple) and left to publish
//!   on its own when it fails a check; they are bound to the one publication, their own
//!   candidates become `inactive`, and they end `succeeded` in the same transaction. While
//!   other attempts of the space are under way, a publish parks (a cooperative wait, no attempt
//!   used) until a spacing that grows with the space has passed since the head last moved, and
//!   a publish that finds the head held parks rather than queues, so that the next head move
//!   takes it along.

use std::collections::HashMap;
use std::time::Duration;

use sqlx::PgConnection;
use uuid::Uuid;

use super::compose::{
    already_served, bind, complete, compose, Compose, Composed, Joined, Rebased, Scope,
};
use super::intents;
use super::page_index::TOKENIZER_VERSION;
use super::profiles::{self, COMPILATION_FAILED};
use super::steps::{self, Attempt, Document};
use super::walk::{self, Checkpoint, Served};
use crate::access::Authority;
use crate::canonical::child_id;
use crate::jobs::{JobError, Step};
use crate::publication::{self, Head};

/// How long a publish queues for the space's head lock. One that does not get it at once is
/// better parked than queued: queued, it holds a connection of its kind (a handful per
/// process) that the compiles behind it need, and its step holds its own row, so the publish
/// holding the head could not take it along; parked (its slice ended with a cooperative wait,
/// no attempt used), the next head move publishes it.
const HEAD_LOCK_WAIT: Duration = Duration::from_millis(20);

/// The least a publish that found the head busy waits before it tries again. The publish holding
/// the head could not take it along (its step held its row); parked as long as the spacing (one
/// to two of it, by the attempt's stagger), the next head move takes it along, where trying
/// again and again while a long publish of a large space holds the head would only spend
/// slices.
const HEAD_BUSY_RETRY: Duration = Duration::from_millis(100);

/// How long a publish waits for a deletion of a document its candidate serves.
const DELETION_FENCE_WAIT: Duration = Duration::from_secs(1);

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

/// The spacing of a space's head moves while other attempts of it are being compiled: this much
/// per document the head serves (a head move copies the members of each), up to the longest.
/// Each head move then costs about the same share of the time whatever the space's size, and
/// the attempts that reach their publish meanwhile are published by the next one together; a
/// small space's head moves are cheap and hardly spaced at all.
const SPACING_PER_DOCUMENT: Duration = Duration::from_millis(1);
const SPACING_MAX: Duration = Duration::from_secs(5);

/// How many other attempts one publish takes with it at most (each costs a few lookups under
/// the head lock).
const JOIN_MAX: i64 = 256;

/// The spacing of head moves for a head serving `documents` documents.
pub fn spacing(documents: i64) -> Duration {
    let n = u32::try_from(documents.max(0)).unwrap_or(u32::MAX);
    SPACING_PER_DOCUMENT.saturating_mul(n).min(SPACING_MAX)
}

/// Whether a publish waits for the next head move instead of moving the head now, and how
/// long: only while other attempts of the space are still being compiled (someone to publish
/// with), and only when the spacing since the last head move has not passed. The next head
/// move is made by an attempt that reaches its publish after the spacing (the last one to be
/// compiled never parks) and takes the parked ones along; a parked attempt comes back on its
/// own only one to two spacings after that (`stagger`, 0..1, the attempt's own, spreads the
/// returns), in case none comes: come back any sooner, its message would find its row locked
/// by the publish taking it along and hold a connection until that commits.
pub fn park(
    moved_ago: Option<Duration>,
    spacing: Duration,
    others: bool,
    stagger: f64,
) -> Option<Duration> {
    let ago = moved_ago?;
    if !others || ago >= spacing {
        return None;
    }
    Some(spacing - ago + spacing.mul_f64(1.0 + stagger.clamp(0.0, 1.0)))
}

/// The attempt's own fraction in 0..1, to stagger its returns.
fn stagger(a: &Attempt) -> f64 {
    (a.id.as_u128() % 1000) as f64 / 1000.0
}

/// What the space's head and attempts say about pacing this publish: the time since the head
/// last moved (none without a head), the documents it serves, and whether other attempts of
/// the space are still being compiled (those ready to publish already are taken along now:
/// waiting would gain nothing).
async fn pace(
    conn: &mut PgConnection,
    a: &Attempt,
) -> Result<(Option<Duration>, i64, bool), JobError> {
    let (ago, documents, others): (Option<f64>, i64, bool) = sqlx::query_as(
        "SELECT (SELECT extract(epoch FROM clock_timestamp() - h.updated_at)::float8 \
                 FROM projection_set_publication_heads h WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2), \
           (SELECT count(*) FROM projection_set_publication_heads h \
              JOIN projection_set_publication_members m ON m.publication_id = h.publication_id \
             WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2 AND m.component_type = 'document-outline'), \
           EXISTS (SELECT 1 FROM document_compilation_attempts x WHERE x.tenant_id = $1 \
             AND x.knowledge_space_id = $2 AND x.active_slot = 1 AND x.id <> $3 \
             AND x.checkpoint <> 'smoke_eval_passed')",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.id)
    .fetch_one(&mut *conn)
    .await?;
    Ok((
        ago.map(|s| Duration::from_secs_f64(s.max(0.0))),
        documents,
        others,
    ))
}

/// Whether a deletion of the space, or of a document (or its source or logical document) that
/// `publication` serves, is under way.
async fn tombstoned(
    conn: &mut PgConnection,
    a: &Attempt,
    publication: Uuid,
) -> Result<bool, JobError> {
    Ok(sqlx::query_scalar(
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
    .bind(publication)
    .fetch_one(&mut *conn)
    .await?)
}

/// Whether the permission snapshot an attempt was requested under still lets its requester
/// write to the space (always, for other authorities).
async fn snapshot_allows(
    conn: &mut PgConnection,
    a: &Attempt,
) -> Result<Result<(), String>, JobError> {
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
        return Ok(match valid {
            Some(v) if v.revision == *revision && v.role != "viewer" => Ok(()),
            _ => Err(format!(
                "the requester's permission snapshot {snapshot} no longer allows {subject} to write to the space"
            )),
        });
    }
    Ok(Ok(()))
}

/// Marks the attempt's document `parsed` for its exact version, unless it changed or is being
/// deleted; whether it did.
async fn mark_parsed(conn: &mut PgConnection, a: &Attempt) -> Result<bool, JobError> {
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
    Ok(parsed.rows_affected() == 1)
}

/// The other attempts of the space this publish may take with it, locked with their outbox rows:
/// at `smoke_eval_passed`, held by no worker (parked between slices), with no message out (the
/// outbox row `pending`: a delivery of one taken along would wait for this publish to commit,
/// holding a connection all the while, only to find it ended), and with no intent that names
/// the publication (a running reindex or a candidate chunk change: those publish on their own).
/// Rows a step or the relay holds are skipped, not waited for; the outbox rows locked, the
/// relay cannot send a message of them before this publish has ended them.
async fn waiting(conn: &mut PgConnection, a: &Attempt) -> Result<Vec<Uuid>, JobError> {
    Ok(sqlx::query_scalar(
        "SELECT x.id FROM document_compilation_attempts x \
         JOIN document_compilation_outbox o ON o.attempt_id = x.id AND o.status = 'pending' \
         WHERE x.tenant_id = $1 AND x.knowledge_space_id = $2 AND x.id <> $3 AND x.document_asset_id <> $4 \
           AND x.active_slot = 1 AND x.checkpoint = 'smoke_eval_passed' \
           AND x.run_state IN ('dispatch_pending', 'queued', 'retry_wait') AND x.lease_token IS NULL \
           AND x.candidate_publication_id IS NOT NULL \
           AND NOT EXISTS (SELECT 1 FROM document_reindex_attempts r WHERE r.tenant_id = x.tenant_id \
             AND r.knowledge_space_id = x.knowledge_space_id AND r.compilation_attempt_id = x.id \
             AND r.state = 'running') \
           AND NOT EXISTS (SELECT 1 FROM document_chunk_state_changes c WHERE c.tenant_id = x.tenant_id \
             AND c.knowledge_space_id = x.knowledge_space_id AND c.compilation_attempt_id = x.id \
             AND c.state = 'candidate') \
         ORDER BY x.created_at, x.id LIMIT $5 \
         FOR NO KEY UPDATE OF x, o SKIP LOCKED",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.id)
    .bind(a.document)
    .bind(JOIN_MAX)
    .fetch_all(&mut *conn)
    .await?)
}

/// Which of the waiting attempts `ids` may publish now, checked as their own publishes would
/// check them, in a few reads for all of them: the capability grant, the gate against the head
/// (document and space, newer versions, what the head serves), the permission snapshot, the
/// frozen profile tuple against the one this publish binds; then their logical-document
/// revisions are activated (those that no longer fit are left out), their documents marked
/// parsed and their components ready. Those left out publish on their own later and meet
/// there whatever stopped them here; nothing is written for them.
async fn joinable(
    conn: &mut PgConnection,
    a: &Attempt,
    ids: &[Uuid],
    head: Option<&Head>,
    tuple: &crate::publication::binding::Tuple,
    heads: &[profiles::Head],
) -> Result<Vec<Joined>, JobError> {
    let mut attempts = steps::load_attempts(conn, ids).await?;
    // One attempt per document, and none of this attempt's.
    let mut count: HashMap<Uuid, usize> = HashMap::new();
    for b in &attempts {
        *count.entry(b.document).or_default() += 1;
    }
    attempts
        .retain(|b| b.document != a.document && count[&b.document] == 1 && b.candidate.is_some());
    let docs: Vec<Uuid> = attempts.iter().map(|b| b.document).collect();
    let documents = steps::load_documents(conn, &a.tenant, a.space, &docs).await?;
    let mut except: Vec<Uuid> = ids.to_vec();
    except.push(a.id);
    let newest = steps::newest_other_active_many(conn, &a.tenant, a.space, &docs, &except).await?;
    let in_head: HashMap<Uuid, Uuid> = match head {
        Some(h) => sqlx::query_as::<_, (Uuid, Uuid)>(
            "SELECT document_asset_id, generation_id FROM projection_set_publication_members \
             WHERE publication_id = $1 AND knowledge_space_id = $2 AND document_asset_id = ANY($3) \
               AND component_type = 'document-outline'",
        )
        .bind(h.publication_id)
        .bind(a.space)
        .bind(&docs)
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .collect(),
        None => HashMap::new(),
    };
    let mut grants: HashMap<Uuid, bool> = HashMap::new();
    let mut snapshots: HashMap<String, bool> = HashMap::new();
    let mut ready: Vec<&Attempt> = Vec::new();
    for b in &attempts {
        if let Some(grant) = b.authority.grant() {
            let ok = match grants.get(&grant) {
                Some(&ok) => ok,
                None => {
                    let verdict = crate::capability::check(conn, &b.tenant, b.space, grant).await?;
                    let ok = verdict.into_result().is_ok();
                    grants.insert(grant, ok);
                    ok
                }
            };
            if !ok {
                continue;
            }
        }
        let Some(d) = documents.get(&b.document) else {
            continue;
        };
        let served_now = match in_head.get(&b.document) {
            None => None,
            // Served by another generation (a document compiled again): the full lookup.
            Some(_) => served(conn, b, head).await?,
        };
        let facts = steps::facts(b, d, newest.get(&b.document).copied(), served_now);
        if steps::stop(walk::gate(&facts)).is_some() || served_now.is_some_and(|s| s.ours) {
            continue;
        }
        if let Authority::Snapshot { .. } = &b.authority {
            let key = format!("{:?}", b.authority);
            let ok = match snapshots.get(&key) {
                Some(&ok) => ok,
                None => {
                    let ok = snapshot_allows(conn, b).await?.is_ok();
                    snapshots.insert(key, ok);
                    ok
                }
            };
            if !ok {
                continue;
            }
        }
        if !profiles::fence(b.profiles.as_ref(), heads).is_ok_and(|t| &t == tuple) {
            continue;
        }
        ready.push(b);
    }
    if ready.is_empty() {
        return Ok(Vec::new());
    }
    let activated = intents::activate_many(conn, &a.tenant, a.space, &ready).await?;
    ready.retain(|b| activated.contains(&b.id));
    if ready.is_empty() {
        return Ok(Vec::new());
    }
    let joined: Vec<Joined> = ready
        .iter()
        .map(|b| Joined {
            document: b.document,
            version: b.version,
            generation: b.generation,
            candidate: b.candidate.as_ref().map(|c| c.0).unwrap_or_default(),
            attempt: b.id,
        })
        .collect();
    let parsed = mark_parsed_many(conn, a, &joined).await?;
    if parsed != joined.len() as u64 {
        return Err(JobError::retryable(
            "document_changed",
            "a document publishing with this one changed while it was being published",
        ));
    }
    promote_many(conn, a, &joined).await?;
    Ok(joined)
}

/// Marks the joined attempts' documents `parsed` for their exact versions; how many were.
async fn mark_parsed_many(
    conn: &mut PgConnection,
    a: &Attempt,
    joined: &[Joined],
) -> Result<u64, JobError> {
    Ok(sqlx::query(
        "UPDATE document_assets d SET parser_status = 'parsed', updated_at = now() \
         FROM unnest($2::uuid[], $3::int4[]) AS x(id, version) \
         WHERE d.id = x.id AND d.knowledge_space_id = $1 AND d.version = x.version \
           AND d.lifecycle_state = 'active' AND d.deletion_job_id IS NULL",
    )
    .bind(a.space)
    .bind(joined.iter().map(|j| j.document).collect::<Vec<Uuid>>())
    .bind(joined.iter().map(|j| j.version).collect::<Vec<i32>>())
    .execute(&mut *conn)
    .await?
    .rows_affected())
}

/// [`promote`] for the joined attempts: their own components (those of their candidates, of
/// their generations) become `ready`.
async fn promote_many(
    conn: &mut PgConnection,
    a: &Attempt,
    joined: &[Joined],
) -> Result<(), sqlx::Error> {
    let candidates: Vec<Uuid> = joined.iter().map(|j| j.candidate).collect();
    let generations: Vec<Uuid> = joined.iter().map(|j| j.generation).collect();
    sqlx::query(
        "UPDATE index_projections ip SET status = 'ready', updated_at = now() \
         FROM unnest($3::uuid[], $4::uuid[]) AS x(publication, generation) \
         JOIN projection_set_publication_members pm ON pm.publication_id = x.publication \
           AND pm.generation_id = x.generation \
         WHERE pm.tenant_id = $1 AND pm.knowledge_space_id = $2 AND pm.component_type = 'index-projection' \
           AND ip.id = pm.component_key AND ip.knowledge_space_id = pm.knowledge_space_id \
           AND ip.publication_generation_id = pm.generation_id AND ip.status = 'building'",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(&candidates)
    .bind(&generations)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "UPDATE page_index_manifests pim SET status = 'ready', updated_at = now() \
         FROM unnest($3::uuid[], $4::uuid[]) AS x(publication, generation) \
         JOIN projection_set_publication_members pm ON pm.publication_id = x.publication \
           AND pm.generation_id = x.generation \
         JOIN document_outlines o ON o.id = pm.component_key AND o.knowledge_space_id = pm.knowledge_space_id \
           AND o.publication_generation_id = pm.generation_id \
         WHERE pm.tenant_id = $1 AND pm.knowledge_space_id = $2 AND pm.component_type = 'document-outline' \
           AND pim.knowledge_space_id = pm.knowledge_space_id AND pim.document_outline_id = pm.component_key \
           AND pim.publication_generation_id = pm.generation_id AND pim.document_asset_id = pm.document_asset_id \
           AND pim.document_version = o.version AND pim.status = 'building'",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(&candidates)
    .bind(&generations)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// The candidate completed for publishing together with the waiting attempts that may publish
/// now (rebound to it, their own candidates `inactive`), or `None` when none may or the
/// candidate cannot take them (then nothing of this was written).
async fn join(
    conn: &mut PgConnection,
    a: &Attempt,
    head: Option<&Head>,
    candidate: Uuid,
    tuple: &crate::publication::binding::Tuple,
    heads: &[profiles::Head],
) -> Result<Option<(Composed, Vec<Uuid>)>, JobError> {
    let mut sp = sqlx::Connection::begin(&mut *conn).await?;
    match join_in(&mut sp, a, head, candidate, tuple, heads).await {
        Ok(Some(joined)) => {
            sp.commit().await?;
            Ok(Some(joined))
        }
        Ok(None) => {
            sp.rollback().await?;
            Ok(None)
        }
        Err(e) => {
            sp.rollback().await?;
            tracing::warn!(attempt = %a.id, error = %e.message(), "publishing alone: the waiting attempts could not be taken");
            Ok(None)
        }
    }
}

async fn join_in(
    conn: &mut PgConnection,
    a: &Attempt,
    head: Option<&Head>,
    candidate: Uuid,
    tuple: &crate::publication::binding::Tuple,
    heads: &[profiles::Head],
) -> Result<Option<(Composed, Vec<Uuid>)>, JobError> {
    let waiting = waiting(conn, a).await?;
    if waiting.is_empty() {
        return Ok(None);
    }
    let joined = joinable(conn, a, &waiting, head, tuple, heads).await?;
    if joined.is_empty() {
        return Ok(None);
    }
    let ids: Vec<Uuid> = joined.iter().map(|j| j.attempt).collect();
    let Rebased::Moved(c) = complete(conn, a, head, candidate, &joined).await? else {
        return Ok(None);
    };
    let from: Vec<Uuid> = joined.iter().map(|j| j.candidate).collect();
    let rebound = sqlx::query(
        "UPDATE document_compilation_attempts SET candidate_publication_id = $3, candidate_fingerprint = $4, \
           base_head_revision = $5, updated_at = now() \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND id = ANY($6)",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(c.id)
    .bind(&c.fingerprint)
    .bind(head.map_or(0, |h| h.revision))
    .bind(&ids)
    .execute(&mut *conn)
    .await?;
    if rebound.rows_affected() != ids.len() as u64 {
        return Ok(None);
    }
    sqlx::query(
        "UPDATE projection_set_publications SET status = 'inactive', updated_at = now() \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND id = ANY($3) AND id <> $4 \
           AND status IN ('candidate', 'validating')",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(&from)
    .bind(c.id)
    .execute(&mut *conn)
    .await?;
    if tombstoned(conn, a, c.id).await? {
        return Ok(None);
    }
    Ok(Some((c, ids)))
}

/// smoke_eval_passed → published: the platform's publish transaction, for this attempt and the
/// attempts of the space waiting to publish.
pub(crate) async fn publish_step(
    conn: &mut PgConnection,
    a: &Attempt,
    d: &Document,
) -> Result<Step, JobError> {
    let (candidate, _) = bound(a)?;
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
    if let Err(why) = snapshot_allows(conn, a).await? {
        return Err(JobError::fatal("permission_snapshot_invalid", why));
    }
    let (moved_ago, documents, others) = pace(conn, a).await?;
    let spaced = spacing(documents);
    if let Some(delay) = park(moved_ago, spaced, others, stagger(a)) {
        crate::metrics::publish_park();
        return Ok(Step::Wait {
            delay,
            reason: "the space's head moved a moment ago; publishing with the next head move"
                .into(),
        });
    }
    let head = match publication::lock_head_within(conn, &a.tenant, a.space, HEAD_LOCK_WAIT).await?
    {
        publication::Locked::Held(head) => head,
        publication::Locked::Busy => {
            crate::metrics::publish_head_wait();
            return Ok(Step::Wait {
                delay: spaced.max(HEAD_BUSY_RETRY).mul_f64(1.0 + stagger(a)),
                reason: "another publish of the space holds its publication head".into(),
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
    let joined = join(conn, a, head.as_ref(), candidate, &tuple, &current_profiles).await?;
    let (candidate, fingerprint, others) = match joined {
        Some((c, ids)) => (c.id, c.fingerprint, ids),
        None => {
            let Some((c, f)) = alone(conn, a, head.as_ref(), candidate).await? else {
                deactivate(conn, a.id).await?;
                return Ok(already_served(a));
            };
            if tombstoned(conn, a, c).await? {
                // The platform refuses to publish over a deletion in progress. The deletion
                // takes its target out of the head at the end of its quiescing; this attempt
                // then finds the head moved and completes its candidate again without it.
                // Waiting uses no attempt.
                return Ok(Step::Wait {
                    delay: DELETION_FENCE_WAIT,
                    reason:
                        "a deletion of the space or of a document the candidate serves is under way"
                            .into(),
                });
            }
            (c, f, Vec::new())
        }
    };
    promote(conn, a, candidate).await?;
    if !mark_parsed(conn, a).await? {
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
            if !others.is_empty() {
                let ended = crate::engine::lease::succeed_unleased(
                    conn,
                    &super::COMPILE,
                    &others,
                    Checkpoint::SmokeEvalPassed.as_str(),
                    Checkpoint::Published.as_str(),
                )
                .await?;
                if ended.len() != others.len() {
                    return Err(JobError::retryable(
                        "publish_joined_changed",
                        "an attempt publishing with this one changed during publish",
                    ));
                }
                crate::metrics::publish_joined(others.len());
            }
            crate::crash::point("compile-publish-before-commit");
            tracing::debug!(attempt = %a.id, revision, joined = others.len(), "published");
            Ok(Step::Succeed(Checkpoint::Published.as_str().into()))
        }
        Err(publication::Refused::Moved(moved)) => Err(JobError::retryable(
            "head_contended",
            format!(
                "the publication head appeared at revision {} during publish",
                moved.current
            ),
        )),
        Err(publication::Refused::NotCandidate(status)) => Err(JobError::fatal(
            "candidate_not_publishable",
            format!(
                "the candidate publication is {} and cannot be published",
                status.as_deref().unwrap_or("missing")
            ),
        )),
        Err(publication::Refused::Binding(_)) => Err(JobError::fatal(
            COMPILATION_FAILED,
            "the publication has a conflicting activated profile binding",
        )),
    }
}

/// The attempt's candidate completed over the head for publishing alone: in place where it can
/// be, else a new one composed over the head (the old one `inactive`, the attempt bound to the
/// new one, evaluated again): its id and fingerprint, or `None` when the head already serves
/// exactly this content.
async fn alone(
    conn: &mut PgConnection,
    a: &Attempt,
    head: Option<&Head>,
    candidate: Uuid,
) -> Result<Option<(Uuid, String)>, JobError> {
    let current = head.map_or(0, |h| h.revision);
    match complete(conn, a, head, candidate, &[]).await? {
        Rebased::Moved(c) => {
            if current != a.base_head_revision {
                tracing::debug!(attempt = %a.id, from = a.base_head_revision, to = current, "head moved; candidate rebased in place");
                crate::metrics::publish_rebase("in_place");
            }
            return Ok(Some((c.id, c.fingerprint)));
        }
        Rebased::Served => return Ok(None),
        Rebased::Apart => {}
    }
    let id = child_id(
        a.id,
        &format!("projection-publication-candidate:rebase:{current}"),
    );
    let c = match compose(conn, a, head, id, Scope::OverHead).await? {
        Compose::Served => return Ok(None),
        Compose::Made(c) => c,
        Compose::Taken => unreachable!("only an owner-only candidate is refused its fingerprint"),
    };
    if c.id != candidate {
        // The candidate given up; not when composing took the same one over again.
        deactivate(conn, a.id).await?;
    }
    bind(conn, a, &c, current).await?;
    if let Some(why) = fault(conn, a, c.id).await? {
        return Err(JobError::fatal(
            "smoke_eval_failed",
            format!("the candidate rebased over head revision {current} failed evaluation: {why}"),
        ));
    }
    tracing::debug!(attempt = %a.id, from = a.base_head_revision, to = current, "head moved; candidate recomposed");
    crate::metrics::publish_rebase("recomposed");
    Ok(Some((c.id, c.fingerprint)))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn spacing_grows_with_the_space_between_its_bounds() {
        let table = [
            (-3, ms(0)),
            (0, ms(0)),
            (5, ms(5)),
            (1_500, ms(1_500)),
            (4_999, ms(4_999)),
            (5_000, SPACING_MAX),
            (10_000_000, SPACING_MAX),
        ];
        for (documents, want) in table {
            assert_eq!(spacing(documents), want, "{documents} documents");
        }
    }

    #[test]
    fn a_publish_parks_only_with_others_under_way_and_a_head_moved_within_the_spacing() {
        let s = ms(400);
        let table = [
            // (moved ago, others under way, stagger, parks for)
            (None, true, 0.0, None),
            (Some(ms(100)), false, 0.0, None),
            (Some(ms(400)), true, 0.0, None),
            (Some(ms(900)), true, 0.5, None),
            (Some(ms(100)), true, 0.0, Some(ms(700))),
            (Some(ms(0)), true, 1.0, Some(ms(1_200))),
            (Some(ms(300)), true, 0.5, Some(ms(700))),
            (Some(ms(300)), true, 7.0, Some(ms(900))),
        ];
        for (ago, others, stagger, want) in table {
            assert_eq!(
                park(ago, s, others, stagger),
                want,
                "{ago:?} {others} {stagger}"
            );
        }
    }
}
