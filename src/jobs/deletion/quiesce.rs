//! `quiescing`: invalidate agent workspaces, drain leases, build the inventory page by page,
//! and take the target out of the published head. Invariant: only expired leases are reclaimed;
//! the inventory is built from rows of the job's tenant and space only, is idempotent per item
//! (`(job, idempotency_key)`), and holds at most one page per step; the head swap happens in the
//! same transaction as the last drain check.

use std::collections::BTreeSet;
use std::time::Duration;

use sqlx::PgConnection;
use uuid::Uuid;

use super::request::sha256_hex;
use super::walk::Event;
use super::{
    cache_key_for_document, cache_key_for_space, clamp_wait, invalidation_reason, object_prefix,
    DeletionConfig, JobRow, Scope,
};
use crate::jobs::JobError;
use crate::publication;

/// Inventory phases, in order.
const PHASES: [&str; 3] = ["documents", "sources", "cache"];

/// `scan_phase` is `p<pass>:<phase>`; NULL is the first pass's first phase.
pub(crate) fn parse_phase(raw: Option<&str>) -> (i32, &str) {
    let Some(raw) = raw else {
        return (1, PHASES[0]);
    };
    match raw.split_once(':') {
        Some((p, phase)) => (p.trim_start_matches('p').parse().unwrap_or(1), phase),
        None => (1, raw),
    }
}

fn next_phase(phase: &str) -> Option<&'static str> {
    let i = PHASES.iter().position(|p| *p == phase)?;
    PHASES.get(i + 1).copied()
}

pub(super) async fn step(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
) -> Result<Event, JobError> {
    // Agent workspaces of the space cannot be attributed to documents: invalidate them all.
    let invalidated = sqlx::query(
        "UPDATE agent_workspace_snapshots SET invalidated_at = now(), invalidation_reason = $3 \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND id IN ( \
           SELECT id FROM agent_workspace_snapshots WHERE tenant_id = $1 AND knowledge_space_id = $2 \
             AND invalidated_at IS NULL LIMIT $4)",
    )
    .bind(&job.tenant)
    .bind(job.space)
    .bind(invalidation_reason(job.id))
    .bind(cfg.page_size)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if invalidated as i64 >= cfg.page_size {
        return Ok(Event::PageDone);
    }

    if let Some(retry_in) = drain(tx, job, cfg).await? {
        return Ok(Event::LeasesActive { retry_in });
    }

    if !job.inventory_complete {
        inventory_page(tx, job, cfg).await?;
        return Ok(Event::PageDone);
    }

    remove_from_head(tx, job).await?;
    Ok(Event::PhaseDone)
}

/// Reclaims expired leases of the space; returns how long to wait if live ones remain.
async fn drain(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
) -> Result<Option<Duration>, JobError> {
    sqlx::query(
        "UPDATE retrieval_execution_leases SET status = 'expired', row_version = row_version + 1, \
           updated_at = greatest(now(), acquired_at) \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND status = 'active' AND expires_at <= now()",
    )
    .bind(&job.tenant)
    .bind(job.space)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "DELETE FROM knowledge_space_mutation_leases \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND (expires_at IS NULL OR expires_at <= now())",
    )
    .bind(&job.tenant)
    .bind(job.space)
    .execute(&mut *tx)
    .await?;
    let live: (i64, Option<f64>) = sqlx::query_as(
        "SELECT count(*), (EXTRACT(EPOCH FROM (min(e) - now())) * 1000)::float8 FROM ( \
           SELECT expires_at AS e FROM retrieval_execution_leases \
             WHERE tenant_id = $1 AND knowledge_space_id = $2 AND status = 'active' AND expires_at > now() \
           UNION ALL \
           SELECT expires_at FROM knowledge_space_mutation_leases \
             WHERE tenant_id = $1 AND knowledge_space_id = $2 AND expires_at > now()) x",
    )
    .bind(&job.tenant)
    .bind(job.space)
    .fetch_one(&mut *tx)
    .await?;
    if live.0 == 0 {
        return Ok(None);
    }
    Ok(Some(clamp_wait(
        live.1,
        Duration::from_millis(100),
        cfg.max_wait,
    )))
}

/// One item to inventory.
struct NewItem {
    kind: &'static str,
    resource_id: Option<Uuid>,
    object_key: Option<String>,
    credential_ref: Option<String>,
    cache_key: Option<String>,
    digest: String,
    idempotency_key: String,
}

impl NewItem {
    fn object(doc: Uuid, key: String) -> Self {
        let digest = sha256_hex(&key);
        Self {
            kind: "object",
            resource_id: Some(doc),
            idempotency_key: format!("object:{doc}:{digest}"),
            object_key: Some(key),
            credential_ref: None,
            cache_key: None,
            digest,
        }
    }

    fn secret(source: Uuid, credential_ref: String) -> Self {
        let digest = sha256_hex(&credential_ref);
        Self {
            kind: "secret_ref",
            resource_id: Some(source),
            idempotency_key: format!("secret:{source}:{digest}"),
            object_key: None,
            credential_ref: Some(credential_ref),
            cache_key: None,
            digest,
        }
    }

    fn cache(resource: Uuid, key: String) -> Self {
        let digest = sha256_hex(&key);
        Self {
            kind: "cache_key",
            resource_id: Some(resource),
            idempotency_key: format!("cache:{resource}"),
            object_key: None,
            credential_ref: None,
            cache_key: Some(key),
            digest,
        }
    }

    fn document(kind: &'static str, doc: Uuid) -> Self {
        Self {
            kind,
            resource_id: Some(doc),
            idempotency_key: format!("{kind}:{doc}"),
            object_key: None,
            credential_ref: None,
            cache_key: None,
            digest: sha256_hex(&doc.to_string()),
        }
    }
}

/// Older versions' objects are named by the platform's key scheme; at most this many are listed.
const MAX_VERSIONS: i32 = 1000;

async fn inventory_page(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
) -> Result<(), JobError> {
    let (pass, phase) = parse_phase(job.scan_phase.as_deref());
    let cursor: Option<Uuid> = job.scan_cursor.as_deref().and_then(|c| c.parse().ok());
    let prefix = object_prefix(job.space);
    let mut items: Vec<NewItem> = Vec::new();
    let mut last: Option<Uuid> = None;
    let mut full = false;
    match phase {
        "documents" => {
            let filter = match job.scope {
                Scope::Space => "d.knowledge_space_id = $5",
                Scope::Document(_) => "d.id = $5",
                Scope::SourceKeep(_) | Scope::SourceCascade(_) => "d.source_id = $5",
            };
            let rows: Vec<(Uuid, String, i32, String)> = sqlx::query_as(&format!(
                "SELECT d.id, d.object_key, d.version, d.filename FROM document_assets d \
                 WHERE d.knowledge_space_id = $2 \
                   AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = d.knowledge_space_id AND k.tenant_id = $1) \
                   AND ($3::uuid IS NULL OR d.id > $3) AND {filter} \
                 ORDER BY d.id LIMIT $4"
            ))
            .bind(&job.tenant)
            .bind(job.space)
            .bind(cursor)
            .bind(cfg.page_size)
            .bind(job.target_id)
            .fetch_all(&mut *tx)
            .await?;
            full = rows.len() as i64 >= cfg.page_size;
            for (doc, key, version, filename) in rows {
                last = Some(doc);
                if let Scope::SourceKeep(_) = job.scope {
                    items.push(NewItem::document("document_detach", doc));
                    continue;
                }
                let mut keys = BTreeSet::new();
                keys.insert(key);
                for v in (version - MAX_VERSIONS + 1).max(1)..version {
                    keys.insert(crate::platform::document_key(job.space, doc, v, &filename));
                }
                for k in keys {
                    if k.starts_with(&prefix) {
                        items.push(NewItem::object(doc, k));
                    } else {
                        // Never erase outside the space's own prefix: the key may be another
                        // space's object. The row itself is still deleted.
                        tracing::warn!(job_id = %job.id, document = %doc, "object key outside the space's prefix; not erasing it");
                    }
                }
                items.push(NewItem::cache(
                    doc,
                    cache_key_for_document(&job.tenant, job.space, doc),
                ));
                if let Scope::SourceCascade(_) = job.scope {
                    items.push(NewItem::document("document_cascade", doc));
                }
            }
        }
        "sources" => {
            let filter = match job.scope {
                Scope::Space => Some("s.knowledge_space_id = $5"),
                Scope::SourceKeep(_) | Scope::SourceCascade(_) => Some("s.id = $5"),
                Scope::Document(_) => None,
            };
            if let Some(filter) = filter {
                let rows: Vec<(Uuid, String)> = sqlx::query_as(&format!(
                    "SELECT s.id, s.credential_ref FROM sources s \
                     WHERE s.knowledge_space_id = $2 \
                       AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = s.knowledge_space_id AND k.tenant_id = $1) \
                       AND ($3::uuid IS NULL OR s.id > $3) AND s.credential_ref IS NOT NULL AND {filter} \
                     ORDER BY s.id LIMIT $4"
                ))
                .bind(&job.tenant)
                .bind(job.space)
                .bind(cursor)
                .bind(cfg.page_size)
                .bind(job.target_id)
                .fetch_all(&mut *tx)
                .await?;
                full = rows.len() as i64 >= cfg.page_size;
                for (source, cred) in rows {
                    last = Some(source);
                    items.push(NewItem::secret(source, cred));
                }
            }
        }
        "cache" => {
            if job.scope == Scope::Space {
                items.push(NewItem::cache(
                    job.space,
                    cache_key_for_space(&job.tenant, job.space),
                ));
            }
        }
        other => {
            return Err(JobError::fatal(
                "bad_scan_phase",
                format!("unknown inventory phase '{other}'"),
            ));
        }
    }
    insert_items(tx, job.id, &items, cfg.item_max_attempts).await?;

    let (scan_phase, scan_cursor, complete) = if full {
        (
            Some(format!("p{pass}:{phase}")),
            last.map(|l| l.to_string()),
            false,
        )
    } else {
        match next_phase(phase) {
            Some(next) => (Some(format!("p{pass}:{next}")), None, false),
            None => (Some(format!("p{pass}:complete")), None, true),
        }
    };
    sqlx::query("UPDATE deletion_jobs SET scan_phase = $2, scan_cursor = $3, inventory_complete = $4 WHERE id = $1")
        .bind(job.id)
        .bind(scan_phase)
        .bind(scan_cursor)
        .bind(complete)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

async fn insert_items(
    tx: &mut PgConnection,
    job: Uuid,
    items: &[NewItem],
    max_attempts: i32,
) -> Result<(), JobError> {
    if items.is_empty() {
        return Ok(());
    }
    let base: i64 = sqlx::query_scalar(
        "SELECT coalesce(max(ordinal), -1) + 1 FROM deletion_job_items WHERE deletion_job_id = $1",
    )
    .bind(job)
    .fetch_one(&mut *tx)
    .await?;
    let kinds: Vec<&str> = items.iter().map(|i| i.kind).collect();
    let rids: Vec<Option<Uuid>> = items.iter().map(|i| i.resource_id).collect();
    let okeys: Vec<Option<String>> = items.iter().map(|i| i.object_key.clone()).collect();
    let crefs: Vec<Option<String>> = items.iter().map(|i| i.credential_ref.clone()).collect();
    let ckeys: Vec<Option<String>> = items.iter().map(|i| i.cache_key.clone()).collect();
    let digests: Vec<&str> = items.iter().map(|i| i.digest.as_str()).collect();
    let ikeys: Vec<&str> = items.iter().map(|i| i.idempotency_key.as_str()).collect();
    sqlx::query(
        r#"INSERT INTO deletion_job_items (id, deletion_job_id, ordinal, kind, resource_id, object_key, credential_ref,
             cache_key, payload_digest, idempotency_key, status, attempts, max_attempts, row_version, created_at, updated_at)
           SELECT gen_random_uuid(), $1, $2 + u.ord - 1, u.kind, u.rid, u.okey, u.cref, u.ckey, u.digest, u.ikey,
             'pending', 0, $3, 1, now(), now()
           FROM UNNEST($4::text[], $5::uuid[], $6::text[], $7::text[], $8::text[], $9::text[], $10::text[])
             WITH ORDINALITY AS u(kind, rid, okey, cref, ckey, digest, ikey, ord)
           ON CONFLICT (deletion_job_id, idempotency_key) DO NOTHING"#,
    )
    .bind(job)
    .bind(base)
    .bind(max_attempts)
    .bind(kinds)
    .bind(rids)
    .bind(okeys)
    .bind(crefs)
    .bind(ckeys)
    .bind(digests)
    .bind(ikeys)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// The documents whose membership in the published head must end.
async fn target_documents(
    tx: &mut PgConnection,
    job: &JobRow,
) -> Result<Option<BTreeSet<Uuid>>, JobError> {
    Ok(match job.scope {
        // None: every member.
        Scope::Space => None,
        Scope::Document(doc) => Some(BTreeSet::from([doc])),
        Scope::SourceKeep(_) => Some(BTreeSet::new()),
        Scope::SourceCascade(_) => {
            let ids: Vec<Uuid> = sqlx::query_scalar(
                "SELECT resource_id FROM deletion_job_items WHERE deletion_job_id = $1 AND kind = 'document_cascade'",
            )
            .bind(job.id)
            .fetch_all(&mut *tx)
            .await?;
            Some(ids.into_iter().collect())
        }
    })
}

/// Publishes the head without the target's documents (compare-and-swap on its revision).
pub(super) async fn remove_from_head(
    tx: &mut PgConnection,
    job: &JobRow,
) -> Result<bool, JobError> {
    let Some(head) = publication::head(tx, &job.tenant, job.space, true).await? else {
        return Ok(false);
    };
    let targets = target_documents(tx, job).await?;
    let keep: publication::Members = head
        .members
        .iter()
        .filter(|(doc, _)| targets.as_ref().is_some_and(|t| !t.contains(doc)))
        .map(|(d, m)| (*d, *m))
        .collect();
    if keep.len() == head.members.len() {
        return Ok(false);
    }
    let (publication_id, _) = publication::create(
        tx,
        &job.tenant,
        job.space,
        &keep,
        serde_json::json!({ "reason": "deletion", "deletionJobId": job.id }),
    )
    .await?;
    match publication::swap_head(tx, &job.tenant, job.space, head.revision, publication_id).await? {
        Ok(_) => Ok(true),
        Err(moved) => Err(JobError::retryable(
            "head_moved",
            format!(
                "the publication head moved to revision {} during the swap",
                moved.current
            ),
        )),
    }
}

/// Back to `quiescing` with a fresh inventory pass.
pub(super) async fn restart(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
    reason: &str,
) -> Result<(), JobError> {
    let (pass, _) = parse_phase(job.scan_phase.as_deref());
    if pass >= cfg.max_passes {
        return Err(JobError::fatal(
            "residue_persists",
            format!("target data keeps reappearing after {pass} inventory passes ({reason})"),
        ));
    }
    tracing::info!(job_id = %job.id, pass = pass + 1, reason, "residue found; rebuilding the inventory");
    sqlx::query(
        "UPDATE deletion_jobs SET scan_phase = $2, scan_cursor = NULL, inventory_complete = false, \
           last_error_code = 'residue', last_error_message = $3 WHERE id = $1",
    )
    .bind(job.id)
    .bind(format!("p{}:{}", pass + 1, PHASES[0]))
    .bind(format!("residue: {reason}"))
    .execute(&mut *tx)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_phases_carry_the_pass() {
        assert_eq!(parse_phase(None), (1, "documents"));
        assert_eq!(parse_phase(Some("p3:sources")), (3, "sources"));
        assert_eq!(parse_phase(Some("cache")), (1, "cache"));
        assert_eq!(next_phase("documents"), Some("sources"));
        assert_eq!(next_phase("sources"), Some("cache"));
        assert_eq!(next_phase("cache"), None);
    }
}
