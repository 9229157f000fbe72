//! `page-index.repair`: the summary repair a failed findability evaluation queues, leased from
//! its own row of `page_index_findability_evaluations` (platform migration 0036) as the
//! platform leases it: `summary_repair_state` `queued → leased → dispatched`, or back to
//! `queued` after 5 s and then 10 s, or `failed` after the third attempt. The work is the
//! platform's: the evaluated outline's summaries are made again through
//! [`crate::jobs::compile::semantic::resummarise`] — every one whose checkpoint exists is reused,
//! only a missing one is asked of the model — and nothing is published.
//!
//! Invariant: a claim takes a fresh `lock_token` under `FOR UPDATE SKIP LOCKED` and counts the
//! attempt; a leased row is claimable again once its lease ran out or its holder lost its
//! liveness lock ([`crate::liveness`]), and one whose holder died on its last attempt is failed
//! instead; the heartbeat, the end and the retry are written only under the claim's token on a
//! row still `leased` with a live lease, so a holder that lost its lease writes nothing.

use std::time::Duration;

use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::jobs::compile::semantic as model_compile;
use crate::jobs::JobError;
use crate::model::Models;

/// The lease of a claim; the heartbeat renews it every third of it.
pub const LEASE: Duration = Duration::from_secs(60);
/// Attempts of one repair.
pub const MAX_ATTEMPTS: i32 = 3;
const RETRY_BASE_SECS: i64 = 5;
const RETRY_MAX_SECS: i64 = 10;
/// Repairs claimed per tick.
pub const BATCH: i64 = 4;
pub const EXHAUSTED: &str = "PageIndex summary repair attempts exhausted after its holder died";
const NOT_READY: &str = "PageIndex summary repair waits for the source compilation to complete";

/// A claimed repair.
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct Claimed {
    pub id: Uuid,
    pub lock_token: Uuid,
    pub compilation_attempt_id: Uuid,
    pub outline_id: Uuid,
    pub publication_generation_id: Uuid,
    pub document_asset_id: Uuid,
    pub document_version: i64,
    pub summary_repair_attempts: i32,
}

/// How one repair ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Repaired {
    pub id: Uuid,
    /// `dispatched`, `queued` (to try again) or `failed`; `lost` when the lease was gone.
    pub state: String,
    pub calls: usize,
    pub reused: usize,
    pub error: Option<String>,
}

/// The delay before attempt `attempts + 1` of a repair, or `None` when it may not run again.
pub fn retry_after(attempts: i32) -> Option<i64> {
    (attempts < MAX_ATTEMPTS)
        .then(|| (RETRY_BASE_SECS << (attempts - 1).clamp(0, 20)).min(RETRY_MAX_SECS))
}

/// The summary-repair kind of a process.
pub struct RepairKind {
    models: Models,
}

impl RepairKind {
    pub fn new(models: Models) -> Self {
        Self { models }
    }

    /// Fails the rows whose holder died on their last attempt, then claims up to `limit` due
    /// repairs for `holder`, in one committed transaction.
    pub async fn claim(
        conn: &mut PgConnection,
        holder: &str,
        limit: i64,
    ) -> Result<Vec<Claimed>, sqlx::Error> {
        sqlx::query(
            "UPDATE page_index_findability_evaluations SET summary_repair_state = 'failed', \
               summary_repair_error = $1, available_at = NULL, lock_token = NULL, locked_by = NULL, \
               lease_expires_at = NULL, updated_at = now() \
             WHERE summary_repair_state = 'leased' AND summary_repair_attempts >= $2 \
               AND (lease_expires_at <= now() OR NOT kfs_worker_alive(locked_by))",
        )
        .bind(EXHAUSTED)
        .bind(MAX_ATTEMPTS)
        .execute(&mut *conn)
        .await?;
        sqlx::query_as(
            "WITH c AS (SELECT id FROM page_index_findability_evaluations \
               WHERE (summary_repair_state = 'queued' AND (available_at IS NULL OR available_at <= now())) \
                  OR (summary_repair_state = 'leased' \
                      AND (lease_expires_at <= now() OR NOT kfs_worker_alive(locked_by))) \
               ORDER BY updated_at, id LIMIT $3 FOR UPDATE SKIP LOCKED) \
             UPDATE page_index_findability_evaluations e SET summary_repair_state = 'leased', \
               summary_repair_attempts = e.summary_repair_attempts + 1, available_at = NULL, \
               lock_token = gen_random_uuid(), locked_by = $1, \
               lease_expires_at = now() + make_interval(secs => $2), updated_at = now() \
             FROM c WHERE e.id = c.id \
             RETURNING e.id, e.lock_token, e.compilation_attempt_id, e.outline_id, \
               e.publication_generation_id, e.document_asset_id, e.document_version, \
               e.summary_repair_attempts",
        )
        .bind(holder)
        .bind(LEASE.as_secs_f64())
        .bind(limit)
        .fetch_all(&mut *conn)
        .await
    }

    /// One tick: claims what is due and runs each claim to its end.
    pub async fn run_due(&self, pool: &PgPool, holder: &str) -> Result<Vec<Repaired>, sqlx::Error> {
        if self.models.reasoner().is_none() {
            return Ok(Vec::new());
        }
        let claimed = {
            let mut conn = crate::db::acquire(pool).await?;
            Self::claim(&mut conn, holder, BATCH).await?
        };
        let mut out = Vec::with_capacity(claimed.len());
        for c in claimed {
            crate::crash::point("repair-after-claim-commit");
            out.push(self.run(pool, c).await?);
        }
        Ok(out)
    }

    async fn run(&self, pool: &PgPool, c: Claimed) -> Result<Repaired, sqlx::Error> {
        let beat = {
            let (pool, id, token) = (pool.clone(), c.id, c.lock_token);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(LEASE / 3).await;
                    let _ = sqlx::query(
                        "UPDATE page_index_findability_evaluations \
                         SET lease_expires_at = now() + make_interval(secs => $3) \
                         WHERE id = $1 AND lock_token = $2 AND summary_repair_state = 'leased' \
                           AND lease_expires_at > clock_timestamp()",
                    )
                    .bind(id)
                    .bind(token)
                    .bind(LEASE.as_secs_f64())
                    .execute(&pool)
                    .await;
                }
            })
        };
        let work = async {
            let mut conn = crate::db::acquire(pool).await?;
            self.repair(&mut conn, &c).await
        }
        .await;
        beat.abort();
        let mut conn = crate::db::acquire(pool).await?;
        let (state, done, error) = match work {
            Ok(done) => ("dispatched", done, None),
            Err(e) => {
                let retry = retry_after(c.summary_repair_attempts);
                let state = if retry.is_some() { "queued" } else { "failed" };
                tracing::warn!(repair = %c.id, attempt = c.summary_repair_attempts, code = %e.code(),
                               error = %e.message(), state, "page-index summary repair failed");
                (
                    state,
                    Default::default(),
                    Some((e.message().to_owned(), retry)),
                )
            }
        };
        let (message, retry) = error.clone().unzip();
        let ended = sqlx::query(
            "UPDATE page_index_findability_evaluations SET summary_repair_state = $3, \
               summary_repair_error = left($4, 2000), \
               available_at = CASE WHEN $5::bigint IS NULL THEN NULL ELSE now() + make_interval(secs => $5::bigint) END, \
               lock_token = NULL, locked_by = NULL, lease_expires_at = NULL, updated_at = now() \
             WHERE id = $1 AND lock_token = $2 AND summary_repair_state = 'leased' \
               AND lease_expires_at > clock_timestamp()",
        )
        .bind(c.id)
        .bind(c.lock_token)
        .bind(state)
        .bind(message)
        .bind(retry.flatten())
        .execute(&mut *conn)
        .await?
        .rows_affected();
        Ok(Repaired {
            id: c.id,
            state: if ended == 1 {
                state.into()
            } else {
                "lost".into()
            },
            calls: done.calls,
            reused: done.reused,
            error: error.map(|e| e.0),
        })
    }

    /// The repair itself: the source attempt must have published this outline, still on the
    /// authority it was requested with; then every outline summary without a checkpoint is
    /// asked for.
    async fn repair(
        &self,
        conn: &mut PgConnection,
        c: &Claimed,
    ) -> Result<model_compile::Prepared, JobError> {
        let source: Option<(String, String)> = sqlx::query_as(
            "SELECT run_state::text, checkpoint::text FROM document_compilation_attempts WHERE id = $1",
        )
        .bind(c.compilation_attempt_id)
        .fetch_optional(&mut *conn)
        .await?;
        if source
            .as_ref()
            .is_none_or(|(r, k)| r != "succeeded" || k != "published")
        {
            return Err(JobError::retryable(
                "PAGE_INDEX_SUMMARY_REPAIR_NOT_READY",
                NOT_READY,
            ));
        }
        let outline: Option<(Uuid, Uuid, i32)> = sqlx::query_as(
            "SELECT publication_generation_id, document_asset_id, version FROM document_outlines WHERE id = $1",
        )
        .bind(c.outline_id)
        .fetch_optional(&mut *conn)
        .await?;
        if outline
            != Some((
                c.publication_generation_id,
                c.document_asset_id,
                i32::try_from(c.document_version).unwrap_or(-1),
            ))
        {
            return Err(JobError::fatal(
                "PAGE_INDEX_SUMMARY_REPAIR_SOURCE_CHANGED",
                "PageIndex summary component repair source identity changed",
            ));
        }
        model_compile::resummarise(conn, &self.models, c.compilation_attempt_id).await
    }
}

#[async_trait::async_trait]
impl crate::engine::polled::PolledKind for RepairKind {
    fn name(&self) -> &'static str {
        "repair"
    }

    fn states(&self) -> &'static [&'static str] {
        &["queued", "leased", "dispatched", "failed"]
    }

    fn counts_sql(&self) -> &'static str {
        "SELECT summary_repair_state::text, count(*) FROM page_index_findability_evaluations \
         WHERE summary_repair_state <> 'not-requested' GROUP BY 1"
    }

    async fn tick(&self, pool: &PgPool, holder: &str) -> Result<usize, sqlx::Error> {
        Ok(self.run_due(pool, holder).await?.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_wait_five_then_ten_seconds_and_stop_at_the_third_attempt() {
        let table = [(1, Some(5)), (2, Some(10)), (3, None), (4, None)];
        for (attempts, after) in table {
            assert_eq!(retry_after(attempts), after, "after attempt {attempts}");
        }
    }
}
