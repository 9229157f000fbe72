//! The operator's requests (`start`, `retry`, `get`) and the research readiness gate.
//! Invariant: `start` and `retry` hold the space row's lock and the head row's for their whole
//! transaction, which commits what they did or, on a refusal, rolls back at once; they only
//! create or requeue the job of the space's current published head.

use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use super::closure;
use super::walk::Space;
use super::{
    current_head, ensure_head_job, job_by_id, lock_space, Job, LEASE_CLEAR, MAX_ITEMS, TABLE,
};
use crate::jobs::JobError;

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
