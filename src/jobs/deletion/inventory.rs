//! The inventory: every object, secret reference and (never emitted, but accepted) cache key of
//! the target, paged into `deletion_job_items` as the platform pages it. Phases: `space_objects`
//! (everything listed under the space's prefix), `document_objects` (per document of the target —
//! for a logical document, each asset its request fenced with the job: its raw object, artifact
//! segment keys, staged-commit keys, multimodal manifest keys, and everything listed under its
//! folder), `lifecycle_secrets` (the 0014 lifecycle rows not yet deleted) and
//! `source_secrets` (credential references without a lifecycle row). Invariant: a page holds at
//! most `page_size` items and a bounded number of queries; every key is checked to lie under the
//! space's prefix before it becomes an item; items are idempotent per `(job, idempotency_key)`;
//! the cursor (`scan_cursor`, JSON) names where the next page starts, so a repeated page adds
//! nothing.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sqlx::PgConnection;
use uuid::Uuid;

use super::ports::Ports;
use super::{payload_digest, DeletionConfig, JobRow, Scope};
use crate::jobs::JobError;

/// Queries one page may run (a page of short scans moves on to the next scan in the same step).
const QUERY_BUDGET: u32 = 24;
/// The longest key an item may hold.
const MAX_KEY: usize = 1024;

/// Where the inventory stands (`deletion_jobs.scan_cursor`, the platform's field names, plus the
/// inventory pass this job is on).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Cursor {
    pub phase: String,
    #[serde(default = "first_pass")]
    pub pass: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_document_id: Option<Uuid>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub document_after: Option<Uuid>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub document_scan: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database_key_cursor: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object_cursor: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle_cursor: Option<Uuid>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_cursor: Option<Uuid>,
}

fn first_pass() -> i32 {
    1
}

/// The document scans, in the platform's order.
const SCANS: [&str; 5] = ["raw", "artifacts", "staged", "manifests", "storage"];

/// The first phase of a target's inventory.
fn start_phase(scope: Scope) -> &'static str {
    match scope {
        Scope::Space => "space_objects",
        Scope::SourceKeep(_) => "lifecycle_secrets",
        Scope::Document(_) | Scope::SourceCascade(_) | Scope::LogicalDocument(_) => {
            "document_objects"
        }
    }
}

impl Cursor {
    pub(crate) fn start(scope: Scope, pass: i32) -> Cursor {
        Cursor {
            phase: start_phase(scope).into(),
            pass,
            ..Cursor::default()
        }
    }

    /// The job's cursor; none (or one this version cannot read) starts at the beginning.
    pub(crate) fn of(job: &JobRow) -> Cursor {
        let pass = Self::pass_of(job);
        match job
            .scan_cursor
            .as_deref()
            .map(serde_json::from_str::<Cursor>)
        {
            Some(Ok(c)) if !c.phase.is_empty() => c,
            _ => Cursor::start(job.scope, pass),
        }
    }

    pub(crate) fn pass_of(job: &JobRow) -> i32 {
        job.scan_cursor
            .as_deref()
            .and_then(|c| serde_json::from_str::<serde_json::Value>(c).ok())
            .and_then(|v| v.get("pass").and_then(|p| p.as_i64()))
            .map_or(1, |p| i32::try_from(p).unwrap_or(1))
    }

    fn text(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// One item to insert.
struct NewItem {
    kind: &'static str,
    resource_id: Option<Uuid>,
    object_key: Option<String>,
    credential_ref: Option<String>,
    idempotency_key: String,
}

impl NewItem {
    fn object(resource: Option<Uuid>, key: String) -> Self {
        Self {
            kind: "object",
            resource_id: resource,
            idempotency_key: format!("object:{}", crate::canonical::sha256_hex(key.as_bytes())),
            object_key: Some(key),
            credential_ref: None,
        }
    }

    fn secret(source: Uuid, credential_ref: String) -> Self {
        Self {
            kind: "secret_ref",
            resource_id: Some(source),
            idempotency_key: format!(
                "secret:{}",
                crate::canonical::sha256_hex(credential_ref.as_bytes())
            ),
            object_key: None,
            credential_ref: Some(credential_ref),
        }
    }
}

/// A page being filled.
struct Page<'a> {
    job: &'a JobRow,
    prefix: String,
    items: BTreeMap<String, NewItem>,
    want: usize,
}

impl Page<'_> {
    fn room(&self) -> usize {
        self.want.saturating_sub(self.items.len())
    }

    fn object(&mut self, resource: Option<Uuid>, key: String) -> Result<(), JobError> {
        if !key.starts_with(&format!("{}/", self.prefix)) || key.len() > MAX_KEY {
            return Err(JobError::retryable(
                "object_key_outside_prefix",
                format!(
                    "an object key of the target escapes the immutable space prefix (job {})",
                    self.job.id
                ),
            ));
        }
        let item = NewItem::object(resource, key);
        self.items
            .entry(item.idempotency_key.clone())
            .or_insert(item);
        Ok(())
    }
}

/// One inventory page. Returns whether the inventory is now complete.
pub(super) async fn page(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
    ports: &Ports,
) -> Result<bool, JobError> {
    let limit = usize::try_from(cfg.page_size.max(1)).unwrap_or(500);
    let mut cur = Cursor::of(job);
    let mut page = Page {
        job,
        prefix: job.prefix(tx).await?,
        items: BTreeMap::new(),
        want: limit,
    };
    let mut complete = false;
    let mut queries = 0;
    while page.room() > 0 && queries < QUERY_BUDGET && !complete {
        queries += 1;
        match cur.phase.as_str() {
            "space_objects" => {
                let room = page.room();
                let keys = ports
                    .objects
                    .list_objects(
                        &format!("{}/", page.prefix),
                        cur.object_cursor.as_deref(),
                        room,
                    )
                    .await
                    .map_err(|e| JobError::retryable(e.code, e.message))?;
                let short = keys.len() < room;
                cur.object_cursor = keys.last().cloned().or(cur.object_cursor.take());
                for k in keys {
                    page.object(None, k)?;
                }
                if short {
                    cur.phase = "lifecycle_secrets".into();
                    cur.object_cursor = None;
                }
            }
            "document_objects" => {
                let doc = match cur.active_document_id {
                    Some(d) => Some(d),
                    None => next_document(tx, job, cur.document_after).await?,
                };
                let Some(doc) = doc else {
                    match job.scope {
                        Scope::Document(_) | Scope::LogicalDocument(_) => complete = true,
                        _ => cur.phase = "lifecycle_secrets".into(),
                    }
                    cur.active_document_id = None;
                    continue;
                };
                cur.active_document_id = Some(doc);
                let scan = cur.document_scan.clone().unwrap_or_else(|| SCANS[0].into());
                let room = page.room();
                let (keys, from_store) = if scan == "storage" {
                    let keys = ports
                        .objects
                        .list_objects(
                            &format!("{}/documents/{doc}/", page.prefix),
                            cur.object_cursor.as_deref(),
                            room,
                        )
                        .await
                        .map_err(|e| JobError::retryable(e.code, e.message))?;
                    (keys, true)
                } else {
                    let keys = database_keys(
                        tx,
                        job,
                        doc,
                        &scan,
                        cur.database_key_cursor.as_deref(),
                        room,
                    )
                    .await?;
                    (keys, false)
                };
                let short = keys.len() < room;
                if let Some(last) = keys.last() {
                    if from_store {
                        cur.object_cursor = Some(last.clone());
                    } else {
                        cur.database_key_cursor = Some(last.clone());
                    }
                }
                for k in keys {
                    page.object(Some(doc), k)?;
                }
                if short {
                    cur.database_key_cursor = None;
                    cur.object_cursor = None;
                    let next = SCANS.iter().position(|s| *s == scan).map(|i| i + 1);
                    match next.and_then(|i| SCANS.get(i)) {
                        Some(s) => cur.document_scan = Some((*s).into()),
                        None => {
                            cur.document_scan = None;
                            cur.active_document_id = None;
                            cur.document_after = Some(doc);
                        }
                    }
                }
            }
            "lifecycle_secrets" => {
                let room = page.room();
                let rows: Vec<(Uuid, Uuid, String)> = sqlx::query_as(
                    "SELECT l.id, l.source_id, l.credential_ref FROM source_secret_lifecycle_refs l \
                     WHERE l.tenant_id = $1 AND l.knowledge_space_id = $2 AND l.state <> 'deleted' \
                       AND ($3::uuid IS NULL OR l.id > $3) AND ($5::uuid IS NULL OR l.source_id = $5) \
                     ORDER BY l.id LIMIT $4",
                )
                .bind(&job.tenant)
                .bind(job.space)
                .bind(cur.lifecycle_cursor)
                .bind(room as i64)
                .bind(source_of(job.scope))
                .fetch_all(&mut *tx)
                .await?;
                let short = rows.len() < room;
                cur.lifecycle_cursor = rows.last().map(|r| r.0).or(cur.lifecycle_cursor);
                for (_, source, cred) in rows {
                    let item = NewItem::secret(source, cred);
                    page.items
                        .entry(item.idempotency_key.clone())
                        .or_insert(item);
                }
                if short {
                    cur.phase = "source_secrets".into();
                    cur.lifecycle_cursor = None;
                }
            }
            "source_secrets" => {
                let room = page.room();
                let rows: Vec<(Uuid, String)> = sqlx::query_as(
                    "SELECT s.id, s.credential_ref FROM sources s \
                     WHERE s.knowledge_space_id = $2 AND s.credential_ref IS NOT NULL \
                       AND ($3::uuid IS NULL OR s.id > $3) AND ($5::uuid IS NULL OR s.id = $5) \
                       AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = s.knowledge_space_id AND k.tenant_id = $1) \
                       AND NOT EXISTS (SELECT 1 FROM source_secret_lifecycle_refs l WHERE l.tenant_id = $1 \
                         AND l.knowledge_space_id = $2 AND l.source_id = s.id AND l.credential_ref = s.credential_ref) \
                     ORDER BY s.id LIMIT $4",
                )
                .bind(&job.tenant)
                .bind(job.space)
                .bind(cur.source_cursor)
                .bind(room as i64)
                .bind(source_of(job.scope))
                .fetch_all(&mut *tx)
                .await?;
                let short = rows.len() < room;
                cur.source_cursor = rows.last().map(|r| r.0).or(cur.source_cursor);
                for (source, cred) in rows {
                    let item = NewItem::secret(source, cred);
                    page.items
                        .entry(item.idempotency_key.clone())
                        .or_insert(item);
                }
                if short {
                    complete = true;
                }
            }
            other => {
                return Err(JobError::fatal(
                    "bad_scan_phase",
                    format!("unknown inventory phase '{other}'"),
                ));
            }
        }
    }
    let items: Vec<NewItem> = page.items.into_values().collect();
    let next_ordinal = insert_items(tx, job, &items, cfg.item_max_attempts).await?;
    let scan_phase = if complete && matches!(job.scope, Scope::Document(_)) {
        format!("document_objects:{next_ordinal}")
    } else {
        cur.phase.clone()
    };
    if complete {
        cur = Cursor {
            phase: cur.phase.clone(),
            pass: cur.pass,
            ..Cursor::default()
        };
    }
    sqlx::query(
        "UPDATE deletion_jobs SET scan_phase = $2, scan_cursor = $3, inventory_complete = $4, updated_at = now() \
         WHERE id = $1",
    )
    .bind(job.id)
    .bind(scan_phase)
    .bind(cur.text())
    .bind(complete)
    .execute(&mut *tx)
    .await?;
    Ok(complete)
}

fn source_of(scope: Scope) -> Option<Uuid> {
    match scope {
        Scope::SourceKeep(s) | Scope::SourceCascade(s) => Some(s),
        _ => None,
    }
}

/// The next document of the target after `after` (a logical document's: the assets its
/// request fenced with the job).
async fn next_document(
    tx: &mut PgConnection,
    job: &JobRow,
    after: Option<Uuid>,
) -> Result<Option<Uuid>, JobError> {
    let (doc, source, fenced) = match job.scope {
        Scope::Document(d) => (Some(d), None, None),
        Scope::SourceCascade(s) | Scope::SourceKeep(s) => (None, Some(s), None),
        Scope::LogicalDocument(_) => (None, None, Some(job.id)),
        Scope::Space => (None, None, None),
    };
    Ok(sqlx::query_scalar(
        "SELECT d.id FROM document_assets d WHERE d.knowledge_space_id = $2 \
           AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = d.knowledge_space_id AND k.tenant_id = $1) \
           AND ($3::uuid IS NULL OR d.id > $3) AND ($4::uuid IS NULL OR d.id = $4) \
           AND ($5::uuid IS NULL OR d.source_id = $5) AND ($6::uuid IS NULL OR d.deletion_job_id = $6) \
         ORDER BY d.id LIMIT 1",
    )
    .bind(&job.tenant)
    .bind(job.space)
    .bind(after)
    .bind(doc)
    .bind(source)
    .bind(fenced)
    .fetch_optional(&mut *tx)
    .await?)
}

/// One page of a document's keys named by database rows, in key order after `after`.
async fn database_keys(
    tx: &mut PgConnection,
    job: &JobRow,
    doc: Uuid,
    scan: &str,
    after: Option<&str>,
    limit: usize,
) -> Result<Vec<String>, JobError> {
    let sql = match scan {
        // Every document target scans its raw object, whether or not its request seeded an item.
        "raw" => {
            "SELECT d.object_key AS k FROM document_assets d WHERE d.id = $3 AND d.knowledge_space_id = $2 \
               AND EXISTS (SELECT 1 FROM knowledge_spaces s WHERE s.id = $2 AND s.tenant_id = $1)"
        }
        "artifacts" => {
            "SELECT DISTINCT a.object_key AS k FROM artifact_segments a WHERE a.document_asset_id = $3 \
               AND a.knowledge_space_id = $2 AND a.object_key IS NOT NULL \
               AND EXISTS (SELECT 1 FROM knowledge_spaces s WHERE s.id = $2 AND s.tenant_id = $1)"
        }
        "staged" => {
            "SELECT k FROM knowledge_space_staged_commits c, \
               LATERAL (VALUES (c.raw_object_key), (c.published_object_key)) v(k) \
             WHERE c.tenant_id = $1 AND c.knowledge_space_id = $2 AND c.document_asset_id = $3 AND k IS NOT NULL"
        }
        "manifests" => {
            "SELECT k FROM document_multimodal_manifests m \
               CROSS JOIN LATERAL jsonb_array_elements(CASE WHEN jsonb_typeof(m.items) = 'array' THEN m.items ELSE '[]'::jsonb END) it \
               CROSS JOIN LATERAL (SELECT it->'assetRef'->>'objectKey' \
                 UNION ALL SELECT v->>'objectKey' FROM jsonb_each(CASE WHEN jsonb_typeof(it->'assetRef'->'variants') = 'object' \
                   THEN it->'assetRef'->'variants' ELSE '{}'::jsonb END) e(n, v)) x(k) \
             WHERE m.knowledge_space_id = $2 AND m.document_asset_id = $3 AND k IS NOT NULL \
               AND EXISTS (SELECT 1 FROM knowledge_spaces s WHERE s.id = $2 AND s.tenant_id = $1)"
        }
        other => {
            return Err(JobError::fatal(
                "bad_scan_phase",
                format!("unknown document scan '{other}'"),
            ))
        }
    };
    Ok(sqlx::query_scalar(&format!(
        "SELECT k FROM (SELECT DISTINCT k FROM ({sql}) keys) u WHERE ($4::text IS NULL OR k COLLATE \"C\" > $4) \
         ORDER BY k COLLATE \"C\" LIMIT $5"
    ))
    .bind(&job.tenant)
    .bind(job.space)
    .bind(doc)
    .bind(after)
    .bind(limit as i64)
    .fetch_all(&mut *tx)
    .await?)
}

/// Inserts the page's items after the job's last ordinal; returns the next free ordinal.
async fn insert_items(
    tx: &mut PgConnection,
    job: &JobRow,
    items: &[NewItem],
    max_attempts: i32,
) -> Result<i64, JobError> {
    let base: i64 = sqlx::query_scalar(
        "SELECT greatest(coalesce(max(ordinal), 0) + 1, 1) FROM deletion_job_items WHERE deletion_job_id = $1",
    )
    .bind(job.id)
    .fetch_one(&mut *tx)
    .await?;
    if items.is_empty() {
        return Ok(base);
    }
    let kinds: Vec<&str> = items.iter().map(|i| i.kind).collect();
    let rids: Vec<Option<Uuid>> = items.iter().map(|i| i.resource_id).collect();
    let okeys: Vec<Option<String>> = items.iter().map(|i| i.object_key.clone()).collect();
    let crefs: Vec<Option<String>> = items.iter().map(|i| i.credential_ref.clone()).collect();
    let digests: Vec<String> = items
        .iter()
        .map(|i| {
            payload_digest(
                &job.tenant,
                job.space,
                &job.idempotency_key,
                i.kind,
                i.resource_id,
                i.object_key.as_deref(),
                i.credential_ref.as_deref(),
            )
        })
        .collect();
    let ikeys: Vec<&str> = items.iter().map(|i| i.idempotency_key.as_str()).collect();
    sqlx::query(
        r#"INSERT INTO deletion_job_items (id, deletion_job_id, ordinal, kind, resource_id, object_key, credential_ref,
             cache_key, payload_digest, idempotency_key, status, attempts, max_attempts, row_version, created_at, updated_at)
           SELECT gen_random_uuid(), $1, $2 + u.ord - 1, u.kind, u.rid, u.okey, u.cref, NULL, u.digest, u.ikey,
             'pending', 0, $3, 1, now(), now()
           FROM UNNEST($4::text[], $5::uuid[], $6::text[], $7::text[], $8::text[], $9::text[])
             WITH ORDINALITY AS u(kind, rid, okey, cref, digest, ikey, ord)
           ON CONFLICT (deletion_job_id, idempotency_key) DO NOTHING"#,
    )
    .bind(job.id)
    .bind(base)
    .bind(max_attempts)
    .bind(kinds)
    .bind(rids)
    .bind(okeys)
    .bind(crefs)
    .bind(digests)
    .bind(ikeys)
    .execute(&mut *tx)
    .await?;
    Ok(base + items.len() as i64)
}

/// A writer became active after the inventory was complete: the inventory starts over (the
/// request's ordinal-0 item stays), in the same pass.
pub(super) async fn reset_after_late_writer(
    tx: &mut PgConnection,
    job: &JobRow,
) -> Result<(), JobError> {
    sqlx::query("DELETE FROM deletion_job_items WHERE deletion_job_id = $1 AND ordinal >= 1")
        .bind(job.id)
        .execute(&mut *tx)
        .await?;
    let cursor = Cursor::start(job.scope, Cursor::pass_of(job));
    sqlx::query(
        "UPDATE deletion_jobs SET inventory_complete = false, scan_phase = 'restart-after-late-writer', \
           scan_cursor = $2, updated_at = now() WHERE id = $1",
    )
    .bind(job.id)
    .bind(cursor.text())
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Residue at the end: every item goes and the inventory is rebuilt from scratch in a new pass
/// (the platform's `reconcileDirtyPrimary`), unless the passes are used up.
pub(super) async fn restart(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
    reason: &str,
) -> Result<(), JobError> {
    let pass = Cursor::pass_of(job);
    if pass >= cfg.max_passes {
        return Err(JobError::fatal(
            "residue_persists",
            format!("target data keeps reappearing after {pass} inventory passes ({reason})"),
        ));
    }
    tracing::info!(job_id = %job.id, pass = pass + 1, reason, "residue found; rebuilding the inventory");
    sqlx::query("DELETE FROM deletion_job_items WHERE deletion_job_id = $1")
        .bind(job.id)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "UPDATE deletion_jobs SET scan_phase = 'reconcile-after-dirty-primary', scan_cursor = $2, \
           inventory_complete = false, last_error_code = 'residue', last_error_message = $3, updated_at = now() \
         WHERE id = $1",
    )
    .bind(job.id)
    .bind(Cursor::start(job.scope, pass + 1).text())
    .bind(format!("residue: {reason}"))
    .execute(&mut *tx)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_start_by_target() {
        let c = Cursor {
            phase: "document_objects".into(),
            pass: 3,
            active_document_id: Some(Uuid::nil()),
            document_scan: Some("staged".into()),
            database_key_cursor: Some("t/spaces/x/documents/y/a.md".into()),
            ..Cursor::default()
        };
        let text = c.text();
        assert!(text.contains("\"activeDocumentId\""), "{text}");
        assert!(!text.contains("objectCursor"), "{text}");
        assert_eq!(serde_json::from_str::<Cursor>(&text).unwrap(), c);
        assert_eq!(Cursor::start(Scope::Space, 1).phase, "space_objects");
        assert_eq!(
            Cursor::start(Scope::SourceKeep(Uuid::nil()), 1).phase,
            "lifecycle_secrets"
        );
        assert_eq!(
            Cursor::start(Scope::Document(Uuid::nil()), 1).phase,
            "document_objects"
        );
        assert_eq!(Cursor::start(Scope::SourceCascade(Uuid::nil()), 2).pass, 2);
        // An old cursor without a pass is on the first.
        let old: Cursor = serde_json::from_str(r#"{"phase":"source_secrets"}"#).unwrap();
        assert_eq!(old.pass, 1);
    }

    #[test]
    fn item_keys_follow_the_platform() {
        let o = NewItem::object(None, "t/spaces/s/a".into());
        assert_eq!(
            o.idempotency_key,
            format!("object:{}", crate::canonical::sha256_hex(b"t/spaces/s/a"))
        );
        let s = NewItem::secret(Uuid::nil(), "source-secret:v1:x".into());
        assert!(s.idempotency_key.starts_with("secret:"));
        assert_eq!(s.resource_id, Some(Uuid::nil()));
    }
}
