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
pub mod walk;

use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::engine::lease::{millis, End};
use crate::engine::leased::{Lease, LeasedKind};
use crate::jobs::{JobError, Policy, RetryPolicy, Step};

use closure::Status;
use walk::{Facts, HeadRef, Plan, Space};

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

const LEASE_CLEAR: &str =
    "worker_id = NULL, lease_token = NULL, lease_expires_at = NULL, heartbeat_at = NULL";
const FENCE: &str = "id = $1 AND lease_token = $2 AND row_version = $3 AND run_state = 'running' \
                     AND lease_expires_at > clock_timestamp()";

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

/// Locks the space row; `Space::Missing` when there is none.
async fn lock_space(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<Space, sqlx::Error> {
    let row: Option<(String, Option<Uuid>)> = sqlx::query_as(
        "SELECT lifecycle_state::text, deletion_job_id FROM knowledge_spaces WHERE tenant_id = $1 AND id = $2 FOR UPDATE",
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

/// Why an operator's request was refused.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("knowledge space {0} of this tenant was not found")]
    NoSpace(Uuid),
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl From<JobError> for RequestError {
    fn from(e: JobError) -> Self {
        match e {
            JobError::Fatal { message, .. } | JobError::Retryable { message, .. } => {
                RequestError::Refused(message)
            }
        }
    }
}

/// The platform's `start`: the current head's backfill, created if the head needs one. `None`:
/// the space has no published head, or its head's page index is complete.
pub async fn start(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<Option<Job>, RequestError> {
    let mut tx = conn.begin().await?;
    let job = async {
        if lock_space(&mut tx, tenant, space).await? == Space::Missing {
            return Err(RequestError::NoSpace(space));
        }
        Ok(match current_head(&mut tx, tenant, space, true).await? {
            Some(head) => ensure_head_job(&mut tx, tenant, space, &head, MAX_ITEMS).await?,
            None => None,
        })
    }
    .await;
    finish(tx, job).await
}

/// Commits what `result` did, or rolls it back at once on a refusal: a refused request must
/// not keep the space's lock until its connection is next used.
async fn finish<T>(
    tx: sqlx::Transaction<'_, sqlx::Postgres>,
    result: Result<T, RequestError>,
) -> Result<T, RequestError> {
    match result {
        Ok(v) => {
            tx.commit().await?;
            Ok(v)
        }
        Err(e) => {
            tx.rollback().await?;
            Err(e)
        }
    }
}

/// The platform's `retry`: the current head's failed backfill goes back to `queued` (its
/// succeeded items stay succeeded, `retry_count` + 1); a succeeded one is returned as it is; a
/// head without one gets one if it needs it.
pub async fn retry(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<Option<Job>, RequestError> {
    let mut tx = conn.begin().await?;
    let job = async {
        if lock_space(&mut tx, tenant, space).await? == Space::Missing {
            return Err(RequestError::NoSpace(space));
        }
        let Some(head) = current_head(&mut tx, tenant, space, true).await? else {
            return Ok(None);
        };
        Ok(match job_by_id(&mut tx, head.publication_id, true).await? {
            None => ensure_head_job(&mut tx, tenant, space, &head, MAX_ITEMS).await?,
            Some(job) if job.run_state == "succeeded" => Some(job),
            Some(job) if job.run_state != "failed" => {
                return Err(RequestError::Refused(format!(
                    "PageIndex upgrade cannot retry from state={}",
                    job.run_state
                )))
            }
            Some(job) => {
                sqlx::query(&format!(
                    "UPDATE {TABLE} SET run_state = 'queued', {LEASE_CLEAR}, completed_at = NULL, \
                       last_error_code = NULL, last_error_message = NULL, retry_count = retry_count + 1, \
                       row_version = row_version + 1, updated_at = now() WHERE id = $1"
                ))
                .bind(job.id)
                .execute(&mut *tx)
                .await?;
                job_by_id(&mut tx, job.id, false).await?
            }
        })
    }
    .await;
    finish(tx, job).await
}

/// The current head's backfill, if it has one.
pub async fn get(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<Option<Job>, sqlx::Error> {
    match current_head(conn, tenant, space, false).await? {
        Some(head) => job_by_id(conn, head.publication_id, false).await,
        None => Ok(None),
    }
}

/// The platform's research readiness gate: the space has a published head, and its backfill
/// succeeded, or it has none and every outline member has a `ready` manifest.
pub async fn query_ready(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<bool, sqlx::Error> {
    let Some(head) = current_head(conn, tenant, space, false).await? else {
        return Ok(false);
    };
    match job_by_id(conn, head.publication_id, false).await? {
        Some(job) => Ok(job.run_state == "succeeded"),
        None => {
            Ok(!closure::missing_ready_manifest(conn, tenant, space, head.publication_id).await?)
        }
    }
}

impl PageIndexKind {
    async fn process(&self, tx: &mut PgConnection, lease: &Lease) -> Result<Step, JobError> {
        let job = job_by_id(tx, lease.job_id, false).await?.ok_or_else(|| {
            JobError::fatal(
                walk::TRANSITION_CONFLICT,
                "PageIndex upgrade job was not found",
            )
        })?;
        let (tenant, space) = (job.tenant_id.as_str(), job.knowledge_space_id);
        let space_state = lock_space(tx, tenant, space).await?;
        type Item = (Uuid, Uuid, Uuid, i32, Value);
        let next: Option<Item> = sqlx::query_as(&format!(
            "SELECT item.document_outline_id, item.publication_generation_id, item.document_asset_id, \
               item.document_version, outline_row.nodes \
             FROM {ITEMS} item JOIN document_outlines outline_row ON outline_row.id = item.document_outline_id \
               AND outline_row.knowledge_space_id = $2 \
               AND outline_row.publication_generation_id = item.publication_generation_id \
               AND outline_row.document_asset_id = item.document_asset_id \
               AND outline_row.version = item.document_version \
             WHERE item.backfill_id = $1 AND item.status = 'pending' \
             ORDER BY item.ordinal, item.document_outline_id LIMIT 1 FOR UPDATE OF item"
        ))
        .bind(job.id)
        .bind(space)
        .fetch_optional(&mut *tx)
        .await?;
        let any_pending: bool = sqlx::query_scalar(&format!(
            "SELECT EXISTS (SELECT 1 FROM {ITEMS} WHERE backfill_id = $1 AND status = 'pending')"
        ))
        .bind(job.id)
        .fetch_one(&mut *tx)
        .await?;
        let mutation_lease_live: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM knowledge_space_mutation_leases \
               WHERE tenant_id = $1 AND knowledge_space_id = $2 AND expires_at > now())",
        )
        .bind(tenant)
        .bind(space)
        .fetch_one(&mut *tx)
        .await?;
        let plan = walk::plan(&Facts {
            space: space_state,
            next_item: next.as_ref().map(|i| i.0),
            any_pending,
            mutation_lease_live,
        })?;
        match plan {
            Plan::Fenced => Ok(Step::Cancel {
                code: crate::jobs::deletion::FENCE_CODE.into(),
                message: crate::jobs::deletion::FENCE_MESSAGE.into(),
            }),
            Plan::Wait(reason) => Ok(Step::Wait {
                delay: self.retry_after,
                reason: reason.into(),
            }),
            Plan::Build(_) => {
                let (outline, generation, document, version, nodes) =
                    next.expect("a planned build has its item");
                self.build(tx, &job, outline, generation, document, version, &nodes)
                    .await
            }
            Plan::Complete => self.complete(tx, &job).await,
        }
    }

    /// Builds one frozen outline's page index and marks its item succeeded.
    #[allow(clippy::too_many_arguments)]
    async fn build(
        &self,
        tx: &mut PgConnection,
        job: &Job,
        outline: Uuid,
        generation: Uuid,
        document: Uuid,
        version: i32,
        nodes: &Value,
    ) -> Result<Step, JobError> {
        let space = job.knowledge_space_id;
        crate::jobs::compile::build::write_page_index(
            tx, space, generation, document, version, outline, nodes,
        )
        .await?;
        if closure::invalid_for(
            tx,
            &job.tenant_id,
            space,
            job.publication_id,
            Some((outline, generation)),
            Status::Built,
        )
        .await?
        {
            return Err(JobError::fatal(
                walk::BUILD,
                "PageIndex materialization did not persist its exact child closure",
            ));
        }
        let marked = sqlx::query(&format!(
            "UPDATE {ITEMS} SET status = 'succeeded', updated_at = now() \
             WHERE backfill_id = $1 AND document_outline_id = $2 AND status = 'pending'"
        ))
        .bind(job.id)
        .bind(outline)
        .execute(&mut *tx)
        .await?;
        if marked.rows_affected() != 1 {
            return Err(JobError::fatal(
                walk::TRANSITION_CONFLICT,
                "Frozen backfill item changed before completion",
            ));
        }
        sqlx::query(&format!(
            "UPDATE {TABLE} SET completed_items = completed_items + 1 WHERE id = $1"
        ))
        .bind(job.id)
        .execute(&mut *tx)
        .await?;
        crate::crash::point("pageindex-before-commit");
        Ok(Step::Advance("running".into()))
    }

    /// Cuts over: verifies against the locked head and promotes the frozen manifests.
    async fn complete(&self, tx: &mut PgConnection, job: &Job) -> Result<Step, JobError> {
        let (tenant, space) = (job.tenant_id.as_str(), job.knowledge_space_id);
        let current = current_head(tx, tenant, space, true).await?;
        let frozen = HeadRef {
            publication_id: job.publication_id,
            fingerprint: job.publication_fingerprint.clone(),
            head_revision: job.head_revision,
        };
        if !walk::head_unchanged(&frozen, current.as_ref()) {
            if let Some(head) = &current {
                ensure_head_job(tx, tenant, space, head, self.max_items).await?;
            }
            return Ok(Step::Supersede {
                message: walk::HEAD_CHANGED_MESSAGE.into(),
            });
        }
        let (items, succeeded): (i64, i64) = sqlx::query_as(&format!(
            "SELECT count(*), count(*) FILTER (WHERE status = 'succeeded') FROM {ITEMS} WHERE backfill_id = $1"
        ))
        .bind(job.id)
        .fetch_one(&mut *tx)
        .await?;
        walk::check_counts(&walk::Counts {
            items,
            succeeded,
            completed_items: job.completed_items,
            total_items: job.total_items,
        })?;
        let verification = |message: &str| JobError::fatal(walk::VERIFICATION, message);
        if closure::items_drifted(tx, job.id, tenant, space, job.publication_id).await? {
            return Err(verification(
                "Frozen PageIndex item no longer matches its immutable publication closure",
            ));
        }
        if closure::invalid(tx, tenant, space, job.publication_id, Status::Built).await? {
            return Err(verification(
                "Frozen published head has an incomplete PageIndex closure",
            ));
        }
        closure::promote(tx, job.id, space).await?;
        if closure::invalid(tx, tenant, space, job.publication_id, Status::Ready).await? {
            return Err(verification(
                "PageIndex closure did not become fully ready atomically",
            ));
        }
        Ok(Step::Succeed("succeeded".into()))
    }
}

#[async_trait::async_trait]
impl LeasedKind for PageIndexKind {
    fn name(&self) -> &'static str {
        "pageindex"
    }

    fn table(&self) -> &'static str {
        TABLE
    }

    fn has_checkpoint(&self) -> bool {
        false
    }

    fn policy(&self) -> &Policy {
        &self.policy
    }

    async fn claim(
        &self,
        conn: &mut PgConnection,
        worker_id: &str,
    ) -> Result<Option<Lease>, sqlx::Error> {
        let token = Uuid::new_v4();
        let row: Option<(Uuid, i32, String)> = sqlx::query_as(&format!(
            "WITH c AS ( \
               SELECT j.id, j.run_state::text AS was FROM {TABLE} j \
               WHERE (j.run_state = 'queued' \
                      AND (j.last_error_code IS NULL OR j.updated_at + $4::bigint * interval '1 millisecond' <= now())) \
                  OR (j.run_state = 'running' \
                      AND (j.lease_expires_at <= now() OR NOT kfs_worker_alive(j.worker_id))) \
               ORDER BY j.updated_at, j.id LIMIT 1 FOR UPDATE OF j SKIP LOCKED \
             ) \
             UPDATE {TABLE} j SET run_state = 'running', worker_id = $1, lease_token = $2, \
               lease_expires_at = now() + $3::bigint * interval '1 millisecond', heartbeat_at = now(), \
               completed_at = NULL, row_version = j.row_version + 1, updated_at = now() \
             FROM c WHERE j.id = c.id \
             RETURNING j.id, j.row_version, c.was"
        ))
        .bind(worker_id)
        .bind(token)
        .bind(millis(self.policy.lease))
        .bind(millis(self.retry_after))
        .fetch_optional(conn)
        .await?;
        Ok(row.map(|(id, row_version, was)| Lease {
            job_id: id,
            lease_token: token,
            row_version,
            checkpoint: "running".into(),
            attempt: 1,
            max_attempts: self.policy.max_attempts,
            worker_id: worker_id.to_owned(),
            taken_over: was == "running",
        }))
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

    async fn end(
        &self,
        conn: &mut PgConnection,
        job: &Lease,
        end: &End,
    ) -> Result<bool, sqlx::Error> {
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
        let done = sqlx::query(&format!(
            "UPDATE {TABLE} SET run_state = '{state}', {set}, {LEASE_CLEAR}, row_version = row_version + 1, \
               updated_at = now() WHERE {FENCE}"
        ))
        .bind(job.job_id)
        .bind(job.lease_token)
        .bind(job.row_version)
        .bind(code)
        .bind(message)
        .execute(conn)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn release_own(
        &self,
        conn: &mut PgConnection,
        worker_id: &str,
    ) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(&format!(
            "UPDATE {TABLE} SET run_state = 'queued', {LEASE_CLEAR}, row_version = row_version + 1, updated_at = now() \
             WHERE worker_id = $1 AND run_state = 'running'"
        ))
        .bind(worker_id)
        .execute(conn)
        .await?;
        Ok(done.rows_affected())
    }
}
