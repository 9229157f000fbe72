//! `deleting_objects`: erase the inventoried objects, secret references and cache keys through
//! the ports, one batch of due items per step. Invariant: an item is completed only after its
//! port confirmed the erase (already gone counts), and completing it redacts its key in the same
//! statement; a failed item retries on its own schedule and is `dead` once its attempts are used
//! up, which fails the job at the next step (after the dead state has committed).

use std::time::Duration;

use futures_util::stream::{self, StreamExt};
use sqlx::PgConnection;
use uuid::Uuid;

use super::ports::{PortError, Ports};
use super::walk::Event;
use super::{clamp_wait, DeletionConfig, JobRow};
use crate::jobs::JobError;

const ERASABLE: &str = "kind IN ('object', 'secret_ref', 'cache_key')";

/// The item's own backoff after its `attempt`-th failure.
pub(crate) fn item_backoff(cfg: &DeletionConfig, attempt: i32) -> Duration {
    let exp = u32::try_from(attempt.saturating_sub(1))
        .unwrap_or(0)
        .min(20);
    cfg.item_retry_base
        .saturating_mul(1u32 << exp)
        .min(cfg.item_retry_max)
}

pub(super) async fn step(
    tx: &mut PgConnection,
    job: &JobRow,
    cfg: &DeletionConfig,
    ports: &Ports,
) -> Result<Event, JobError> {
    let dead: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM deletion_job_items WHERE deletion_job_id = $1 AND status = 'dead'",
    )
    .bind(job.id)
    .fetch_one(&mut *tx)
    .await?;
    if dead > 0 {
        return Ok(Event::ItemsDead { count: dead });
    }

    type Due = (
        Uuid,
        String,
        Option<String>,
        Option<String>,
        Option<String>,
        i32,
        i32,
    );
    let due: Vec<Due> = sqlx::query_as(&format!(
        "SELECT id, kind, object_key, credential_ref, cache_key, attempts, max_attempts FROM deletion_job_items \
         WHERE deletion_job_id = $1 AND {ERASABLE} \
           AND (status = 'pending' OR (status = 'retry_wait' AND next_attempt_at <= now())) \
         ORDER BY ordinal LIMIT $2 FOR UPDATE"
    ))
    .bind(job.id)
    .bind(cfg.item_batch)
    .fetch_all(&mut *tx)
    .await?;

    if due.is_empty() {
        let waiting: (i64, Option<f64>) = sqlx::query_as(&format!(
            "SELECT count(*), (EXTRACT(EPOCH FROM (min(next_attempt_at) - now())) * 1000)::float8 \
             FROM deletion_job_items WHERE deletion_job_id = $1 AND {ERASABLE} AND status IN ('pending', 'retry_wait')"
        ))
        .bind(job.id)
        .fetch_one(&mut *tx)
        .await?;
        return Ok(if waiting.0 == 0 {
            Event::PhaseDone
        } else {
            Event::ItemsNotDue {
                retry_in: clamp_wait(waiting.1, Duration::from_millis(20), cfg.max_wait),
            }
        });
    }

    let results: Vec<(Uuid, i32, i32, Result<(), PortError>)> = stream::iter(due)
        .map(
            |(id, kind, object_key, credential_ref, cache_key, attempts, max_attempts)| async move {
                let r = match (kind.as_str(), object_key, credential_ref, cache_key) {
                    ("object", Some(k), _, _) => ports.objects.delete_object(&k).await,
                    ("secret_ref", _, Some(c), _) => ports.secrets.delete_secret(&c).await,
                    ("cache_key", _, _, Some(k)) => ports.cache.evict(&k).await,
                    _ => Err(PortError::permanent(
                        "item_malformed",
                        format!("{kind} item without its key"),
                    )),
                };
                (id, attempts, max_attempts, r)
            },
        )
        .buffer_unordered(cfg.item_concurrency.max(1))
        .collect()
        .await;

    let done: Vec<Uuid> = results
        .iter()
        .filter(|r| r.3.is_ok())
        .map(|r| r.0)
        .collect();
    if !done.is_empty() {
        sqlx::query(
            "UPDATE deletion_job_items SET status = 'completed', object_key = NULL, credential_ref = NULL, \
               cache_key = NULL, redacted_at = now(), completed_at = now(), next_attempt_at = NULL, \
               attempts = least(attempts + 1, max_attempts), last_error_code = NULL, last_error_message = NULL, \
               row_version = row_version + 1, updated_at = now() \
             WHERE deletion_job_id = $1 AND id = ANY($2) AND status IN ('pending', 'retry_wait')",
        )
        .bind(job.id)
        .bind(&done)
        .execute(&mut *tx)
        .await?;
    }
    for (id, attempts, max_attempts, r) in &results {
        let Err(e) = r else { continue };
        let attempt = (attempts + 1).min(*max_attempts);
        let dead = !e.retryable || attempt >= *max_attempts;
        let delay = item_backoff(cfg, attempt);
        tracing::warn!(job_id = %job.id, item = %id, code = %e.code, attempt, dead, "deletion item failed");
        sqlx::query(
            "UPDATE deletion_job_items SET \
               status = CASE WHEN $3 THEN 'dead' ELSE 'retry_wait' END, \
               attempts = CASE WHEN $3 THEN max_attempts ELSE $4 END, \
               next_attempt_at = CASE WHEN $3 THEN NULL ELSE now() + $5::bigint * interval '1 millisecond' END, \
               completed_at = CASE WHEN $3 THEN now() ELSE NULL END, \
               last_error_code = $6, last_error_message = $7, row_version = row_version + 1, updated_at = now() \
             WHERE deletion_job_id = $1 AND id = $2",
        )
        .bind(job.id)
        .bind(id)
        .bind(dead)
        .bind(attempt)
        .bind(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX))
        .bind(truncate(&e.code, 64))
        .bind(truncate(&e.message, 2000))
        .execute(&mut *tx)
        .await?;
    }
    Ok(Event::PageDone)
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn item_backoff_doubles_up_to_the_cap() {
        let cfg = DeletionConfig {
            item_retry_base: Duration::from_secs(2),
            item_retry_max: Duration::from_secs(30),
            ..DeletionConfig::default()
        };
        let got: Vec<u64> = (1..=6).map(|a| item_backoff(&cfg, a).as_secs()).collect();
        assert_eq!(got, vec![2, 4, 8, 16, 30, 30]);
        assert_eq!(item_backoff(&cfg, 0).as_secs(), 2);
    }

    #[test]
    fn truncation_respects_char_boundaries() {
        assert_eq!(truncate("héllo", 2), "h");
        assert_eq!(truncate("abc", 5), "abc");
    }
}
