//! `deleting_objects`: erase the inventoried objects and secret references through the ports,
//! one batch of due items per step. Invariant: an object is erased only if its key lies under the
//! space's manifest prefix; an item is completed only after its port confirmed the erase (already
//! gone counts), and completing it redacts its key in the same statement; an erased secret's 0014
//! lifecycle row is marked `deleted` in the step that completes its item; a failed item retries on
//! its own schedule and is `dead` once its attempts are used up, which fails the job at the next
//! step (after the dead state has committed). Dead items keep their key for a manual retry.

use std::time::Duration;

use futures_util::stream::{self, StreamExt};
use sqlx::PgConnection;
use uuid::Uuid;

use super::ports::{PortError, Ports, SecretRef};
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
        Option<Uuid>,
        Option<String>,
        Option<String>,
        Option<String>,
        i32,
        i32,
    );
    let due: Vec<Due> = sqlx::query_as(&format!(
        "SELECT id, kind, resource_id, object_key, credential_ref, cache_key, attempts, max_attempts \
         FROM deletion_job_items \
         WHERE deletion_job_id = $1 AND {ERASABLE} \
           AND (status = 'pending' OR (status = 'retry_wait' AND next_attempt_at <= now())) \
         ORDER BY ordinal, id LIMIT $2 FOR UPDATE SKIP LOCKED"
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

    // Re-read for every batch: an object outside the space's prefix is never erased.
    let prefix = format!("{}/", job.prefix(tx).await?);
    let prefix = &prefix;
    type Erased = (
        Uuid,
        Option<(Option<Uuid>, String)>,
        i32,
        i32,
        Result<(), PortError>,
    );
    let results: Vec<Erased> = stream::iter(due)
        .map(
            |(
                id,
                kind,
                resource,
                object_key,
                credential_ref,
                cache_key,
                attempts,
                max_attempts,
            )| async move {
                let mut secret = None;
                let r = match (kind.as_str(), object_key, credential_ref, cache_key) {
                    ("object", Some(k), _, _) if k.starts_with(prefix) => {
                        ports.objects.delete_object(&k).await
                    }
                    ("object", Some(_), _, _) => Err(PortError::retryable(
                        "object_key_outside_prefix",
                        "the object key escapes the immutable space prefix",
                    )),
                    ("secret_ref", _, Some(c), _) => {
                        let r = ports
                            .secrets
                            .delete_secret(&SecretRef {
                                tenant: &job.tenant,
                                space: job.space,
                                source: resource,
                                credential_ref: &c,
                            })
                            .await;
                        secret = Some((resource, c));
                        r
                    }
                    ("cache_key", _, _, Some(k)) => drain_cache(ports, &k).await,
                    _ => Err(PortError::permanent(
                        "item_malformed",
                        format!("{kind} item without its key"),
                    )),
                };
                (id, secret, attempts, max_attempts, r)
            },
        )
        .buffer_unordered(cfg.item_concurrency.max(1))
        .collect()
        .await;

    let done: Vec<Uuid> = results
        .iter()
        .filter(|r| r.4.is_ok())
        .map(|r| r.0)
        .collect();
    // Erased secrets: their lifecycle rows are deleted as the platform records it.
    for (_, secret, _, _, r) in &results {
        let (Some((source, cred)), Ok(())) = (secret, r) else {
            continue;
        };
        sqlx::query(
            "UPDATE source_secret_lifecycle_refs SET state = 'deleted', worker_id = NULL, lease_token = NULL, \
               lease_expires_at = NULL, heartbeat_at = NULL, next_delete_at = NULL, deleted_at = now(), \
               updated_at = now(), row_version = row_version + 1 \
             WHERE tenant_id = $1 AND knowledge_space_id = $2 AND ($3::uuid IS NULL OR source_id = $3) \
               AND credential_ref = $4 AND state <> 'deleted'",
        )
        .bind(&job.tenant)
        .bind(job.space)
        .bind(*source)
        .bind(cred)
        .execute(&mut *tx)
        .await?;
    }
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
    for (id, _, attempts, max_attempts, r) in &results {
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

/// A cache item names a key prefix (the platform's cache port deletes by prefix): all of it goes.
async fn drain_cache(ports: &Ports, key: &str) -> Result<(), PortError> {
    for _ in 0..1000 {
        let page = ports.cache.delete_prefix(key, 1000).await?;
        if !page.more {
            return Ok(());
        }
        if page.deleted == 0 {
            return Err(PortError::retryable(
                "cache_no_progress",
                "the retrieval cache reported more keys but deleted none",
            ));
        }
    }
    Err(PortError::retryable(
        "cache_not_drained",
        "the cache prefix still holds keys after 1000 pages",
    ))
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
