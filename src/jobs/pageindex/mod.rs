//! Page-index upgrade backfills (`page_index_upgrade_backfills` and its items, platform
//! migration 0010), leased straight from Postgres. Invariant: a job is bound for good to one
//! published head (publication id — also the job's id —, fingerprint, head revision) and to the
//! outline items frozen with it; each step, fenced by lease token and row version and holding
//! the space row's lock, builds one frozen outline's page index create-once (`building`, the
//! same deterministic rows a compile writes), checks that exact closure, and marks the item
//! succeeded in the same transaction; the manifests become `ready` only in the transaction that
//! finds the locked head still the frozen one, every frozen item succeeded and matching its
//! member and outline, and the whole closure complete before and after the promotion. A head
//! that moved supersedes the job (`HEAD_CHANGED`) and queues one for the new head if that head's
//! page index is incomplete. Nothing here creates a publication or changes a member.
//!
//! Where kfs-worker differs from the platform's runtime: a live document mutation lease makes
//! the step wait and come back instead of failing the job; a failure to reach the database is
//! retried after [`PageIndexKind::retry_after`] instead of failing the row (the table has no
//! attempt counter, so such retries are not counted; the job's `last_error_code` says why it
//! waits); the outline's page index is rebuilt even when its document has a newer version than
//! the outline the head still serves; the job ends `superseded` when it finds its space being
//! deleted (the deletion's own quiescing ends queued jobs the same way).

pub mod cli;
pub mod closure;
mod requests;
mod step;
pub mod walk;

pub use requests::{get, query_ready, retry, start, RequestError};

use std::time::Duration;

use serde::Serialize;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::engine::lease::{millis, End};
use crate::engine::leased::{ClaimRule, EndWrite, Lease, LeasedKind, Param, HOLDER_GONE};
use crate::jobs::{JobError, Policy, RetryPolicy, Step};

use closure::Status;
use walk::{HeadRef, Space};

pub const TABLE: &str = "page_index_upgrade_backfills";
pub const ITEMS: &str = "page_index_upgrade_backfill_items";
/// The document mutation lease operation the platform names this work by.
pub const OPERATION: &str = "page-index-upgrade";

/// The defaults: lease 30 s. The attempt numbers only shape the engine's retry decision: the
/// table counts no attempts.
pub const POLICY: Policy = Policy {
    lease: Duration::from_secs(30),
    max_attempts: 2,
    retry: RetryPolicy {
        base: Duration::from_secs(2),
        max: Duration::from_secs(60),
    },
};

/// The most outline members one job freezes, as the platform's default bounds it.
pub const MAX_ITEMS: usize = 10_000;

/// The page-index upgrade kind.
#[derive(Clone, Debug)]
pub struct PageIndexKind {
    pub policy: Policy,
    /// How long a job that waited (a live mutation lease, an unreachable database) stays queued
    /// before it is claimable again.
    pub retry_after: Duration,
    pub max_items: usize,
}

impl Default for PageIndexKind {
    fn default() -> Self {
        Self {
            policy: POLICY,
            retry_after: Duration::from_secs(1),
            max_items: MAX_ITEMS,
        }
    }
}

pub(crate) use crate::engine::lease::LEASE_CLEAR;

/// A backfill row, as the platform's API shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, sqlx::FromRow)]
#[serde(rename_all = "camelCase")]
pub struct Job {
    pub id: Uuid,
    pub tenant_id: String,
    pub knowledge_space_id: Uuid,
    pub publication_id: Uuid,
    pub publication_fingerprint: String,
    pub head_revision: i32,
    pub run_state: String,
    pub total_items: i32,
    pub completed_items: i32,
    pub retry_count: i32,
    pub row_version: i32,
    pub worker_id: Option<String>,
    pub last_error_code: Option<String>,
    pub last_error_message: Option<String>,
}

const JOB_COLUMNS: &str = "id, tenant_id::text, knowledge_space_id, publication_id, publication_fingerprint::text, \
     head_revision, run_state::text, total_items, completed_items, retry_count, row_version, worker_id::text, \
     last_error_code::text, last_error_message";

async fn job_by_id(
    conn: &mut PgConnection,
    id: Uuid,
    lock: bool,
) -> Result<Option<Job>, sqlx::Error> {
    let lock = if lock { " FOR UPDATE" } else { "" };
    sqlx::query_as(&format!(
        "SELECT {JOB_COLUMNS} FROM {TABLE} WHERE id = $1{lock}"
    ))
    .bind(id)
    .fetch_optional(conn)
    .await
}

/// Locks the space row against its deletion (`FOR NO KEY UPDATE`: inserts that reference the
/// space are not held up); `Space::Missing` when there is none.
async fn lock_space(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<Space, sqlx::Error> {
    let row: Option<(String, Option<Uuid>)> = sqlx::query_as(
        "SELECT lifecycle_state::text, deletion_job_id FROM knowledge_spaces WHERE tenant_id = $1 AND id = $2 FOR NO KEY UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .fetch_optional(conn)
    .await?;
    Ok(match row {
        None => Space::Missing,
        Some((state, None)) if state == "active" => Space::Writable,
        Some(_) => Space::Deleting,
    })
}

/// The space's current head, if its publication is `published`.
async fn current_head(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    lock: bool,
) -> Result<Option<HeadRef>, sqlx::Error> {
    let lock = if lock { " FOR UPDATE OF h" } else { "" };
    let row: Option<(Uuid, String, i32)> = sqlx::query_as(&format!(
        "SELECT h.publication_id, p.fingerprint::text, h.head_revision \
         FROM projection_set_publication_heads h \
         JOIN projection_set_publications p ON p.tenant_id = h.tenant_id \
           AND p.knowledge_space_id = h.knowledge_space_id AND p.id = h.publication_id AND p.status = 'published' \
         WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2 LIMIT 1{lock}"
    ))
    .bind(tenant)
    .bind(space)
    .fetch_optional(conn)
    .await?;
    Ok(
        row.map(|(publication_id, fingerprint, head_revision)| HeadRef {
            publication_id,
            fingerprint,
            head_revision,
        }),
    )
}

/// The head's backfill, created when the head has none and its page index is incomplete: the
/// job (id = the publication's id, `queued`, row version 0) and one pending item per outline
/// member that has its outline row, ordinals in member order. `None`: the head is complete.
async fn ensure_head_job(
    tx: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    head: &HeadRef,
    max_items: usize,
) -> Result<Option<Job>, JobError> {
    if let Some(job) = job_by_id(tx, head.publication_id, true).await? {
        return Ok(Some(job));
    }
    if !closure::invalid(tx, tenant, space, head.publication_id, Status::Ready).await? {
        return Ok(None);
    }
    let members: Vec<(Uuid, Uuid, Option<Uuid>, Option<i32>)> = sqlx::query_as(
        "SELECT pm.component_key, pm.generation_id, pm.document_asset_id, outline_row.version \
         FROM projection_set_publication_members pm \
         LEFT JOIN document_outlines outline_row ON outline_row.id = pm.component_key \
           AND outline_row.knowledge_space_id = pm.knowledge_space_id \
           AND outline_row.publication_generation_id = pm.generation_id \
           AND outline_row.document_asset_id = pm.document_asset_id \
         WHERE pm.tenant_id = $1 AND pm.knowledge_space_id = $2 AND pm.publication_id = $3 \
           AND pm.component_type = 'document-outline' \
         ORDER BY pm.component_key, pm.generation_id LIMIT $4",
    )
    .bind(tenant)
    .bind(space)
    .bind(head.publication_id)
    .bind(
        i64::try_from(max_items)
            .unwrap_or(i64::MAX)
            .saturating_add(1),
    )
    .fetch_all(&mut *tx)
    .await?;
    if members.len() > max_items {
        return Err(JobError::fatal(
            walk::VERIFICATION,
            format!("PageIndex upgrade exceeds maxItemsPerJob={max_items}"),
        ));
    }
    sqlx::query(&format!(
        "INSERT INTO {TABLE} (id, tenant_id, knowledge_space_id, publication_id, publication_fingerprint, \
           head_revision, run_state, total_items, completed_items, retry_count, row_version, created_at, updated_at) \
         VALUES ($1, $2, $3, $1, $4, $5, 'queued', $6, 0, 0, 0, now(), now())"
    ))
    .bind(head.publication_id)
    .bind(tenant)
    .bind(space)
    .bind(&head.fingerprint)
    .bind(head.head_revision)
    .bind(i32::try_from(members.len()).unwrap_or(i32::MAX))
    .execute(&mut *tx)
    .await?;
    // Ordinals count every member, as the platform's runtime numbers them; members without an
    // outline row get no item, so the job can never complete and fails at verification.
    let items: Vec<(i32, Uuid, Uuid, Uuid, i32)> = members
        .iter()
        .enumerate()
        .filter_map(|(i, (outline, generation, asset, version))| {
            Some((
                i32::try_from(i).ok()?,
                *outline,
                *generation,
                (*asset)?,
                (*version)?,
            ))
        })
        .collect();
    sqlx::query(&format!(
        "INSERT INTO {ITEMS} (backfill_id, document_outline_id, publication_generation_id, document_asset_id, \
           document_version, ordinal, status, created_at, updated_at) \
         SELECT $1, t.outline, t.generation, t.asset, t.version, t.ordinal, 'pending', now(), now() \
         FROM unnest($2::int4[], $3::uuid[], $4::uuid[], $5::uuid[], $6::int4[]) \
           AS t(ordinal, outline, generation, asset, version)"
    ))
    .bind(head.publication_id)
    .bind(items.iter().map(|i| i.0).collect::<Vec<_>>())
    .bind(items.iter().map(|i| i.1).collect::<Vec<_>>())
    .bind(items.iter().map(|i| i.2).collect::<Vec<_>>())
    .bind(items.iter().map(|i| i.3).collect::<Vec<_>>())
    .bind(items.iter().map(|i| i.4).collect::<Vec<_>>())
    .execute(&mut *tx)
    .await?;
    Ok(job_by_id(tx, head.publication_id, false).await?)
}
#[async_trait::async_trait]
impl LeasedKind for PageIndexKind {
    fn name(&self) -> &'static str {
        "pageindex"
    }

    fn table(&self) -> &'static str {
        TABLE
    }
    fn states(&self) -> &'static [&'static str] {
        &["queued", "running", "succeeded", "failed", "superseded"]
    }

    fn has_checkpoint(&self) -> bool {
        false
    }

    fn policy(&self) -> &Policy {
        &self.policy
    }

    fn claim_rule(&self) -> ClaimRule {
        ClaimRule {
            claimable: format!(
                "(j.run_state = 'queued' \
                  AND (j.last_error_code IS NULL OR j.updated_at + $4::bigint * interval '1 millisecond' <= now())) \
                 OR (j.run_state = 'running' AND {HOLDER_GONE})"
            ),
            select: String::new(),
            set: ", completed_at = NULL".into(),
            attempt: "1",
            max_attempts: None,
            param: Param::BigInt(millis(self.retry_after)),
            exhausted: None,
        }
    }

    async fn step(&self, tx: &mut PgConnection, job: &Lease) -> Result<Step, JobError> {
        match self.process(tx, job).await {
            Err(JobError::Fatal { code, message }) if !walk::CODES.contains(&code.as_str()) => {
                tracing::warn!(job = %job.job_id, code, message, "page-index upgrade failed");
                Err(JobError::fatal(walk::FAILED, message))
            }
            other => other,
        }
    }

    fn end_write(&self, _job: &Lease, end: &End) -> EndWrite {
        let terminal = "completed_at = now(), last_error_code = left($4, 64), last_error_message = left($5, 16384)";
        let (state, code, message) = match end {
            End::Succeed { .. } => ("succeeded", None, None),
            End::Fail { code, message } => ("failed", Some(code.clone()), Some(message.clone())),
            End::Cancel { code, message } => {
                ("superseded", Some(code.clone()), Some(message.clone()))
            }
            End::Supersede { message } => (
                "superseded",
                Some(walk::HEAD_CHANGED.to_owned()),
                Some(message.clone()),
            ),
            End::Wait { code, message, .. } => {
                ("queued", Some(code.clone()), Some(message.clone()))
            }
            End::Continue => ("queued", None, None),
        };
        let set = if state == "queued" {
            "last_error_code = left($4, 64), last_error_message = left($5, 16384)"
        } else {
            terminal
        };
        EndWrite {
            set: format!("run_state = '{state}', {set}"),
            text4: code,
            text5: message,
            ..EndWrite::default()
        }
    }
}
