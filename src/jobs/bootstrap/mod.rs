//! Legacy space publication bootstraps (`legacy_space_publication_bootstraps` and its items),
//! leased straight from Postgres. Invariant: the document set is frozen once, under the space
//! row's lock and only while no mutation lease is held (expired ones are reclaimed, live ones
//! wait); every frozen item is rebuilt by an ordinary compile attempt (requested through
//! [`compile::request`], run by the compile consumers); the head is verified to serve every item
//! and recorded before `run_state='succeeded'`, which is the space's query-readiness latch.
//! A failed bootstrap is retried in place, with the kind's backoff, up to its attempts; its
//! failed items are compiled again.
//!
//! Retry bookkeeping lives in `snapshot_metadata` (the table has no attempt or retry column):
//! `failures` counts failed runs (a takeover from a dead worker counts as one), and
//! `notBefore` (epoch milliseconds, database clock) is when the job may be claimed again.

pub mod walk;

use std::time::Duration;

use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::consumer::lease::{millis, End};
use crate::jobs::compile::{self, CompileError, RequestOptions};
use crate::jobs::leased::{Lease, LeasedKind};
use crate::jobs::{JobError, Policy, RetryPolicy, Step};
use crate::publication::{self, Member, Members};

use walk::{Checkpoint, Event, Items, Rebuilt, Verdict, Waits};

pub const TABLE: &str = "legacy_space_publication_bootstraps";
/// The idempotency key the platform's marker migration uses.
pub const IDEMPOTENCY_KEY: &str = "legacy-space-publication-bootstrap-v1";

/// The defaults: lease 60 s, 5 attempts, backoff from 5 s to 5 min.
pub const POLICY: Policy = Policy {
    lease: Duration::from_secs(60),
    max_attempts: 5,
    retry: RetryPolicy {
        base: Duration::from_secs(5),
        max: Duration::from_secs(300),
    },
};

/// The bootstrap kind.
#[derive(Clone, Debug)]
pub struct BootstrapKind {
    pub policy: Policy,
    pub waits: Waits,
    /// Compiles requested per step.
    pub page: i64,
}

impl Default for BootstrapKind {
    fn default() -> Self {
        Self {
            policy: POLICY,
            waits: Waits::default(),
            page: 32,
        }
    }
}

const NOW_MS: &str = "(extract(epoch from now()) * 1000)::bigint";
const FAILURES: &str = "coalesce((j.snapshot_metadata ->> 'failures')::int, 0)";
const LEASE_CLEAR: &str =
    "worker_id = NULL, lease_token = NULL, lease_expires_at = NULL, heartbeat_at = NULL";
const FENCE: &str = "id = $1 AND lease_token = $2 AND row_version = $3 AND run_state = 'running' \
                     AND lease_expires_at > clock_timestamp()";

/// Writes a bootstrap for a space (queued at `pending_snapshot`), as the platform's marker does.
/// Idempotent: the space's existing bootstrap is returned instead.
pub async fn enqueue(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<Uuid, sqlx::Error> {
    sqlx::query(
        "INSERT INTO legacy_space_publication_bootstraps \
           (id, tenant_id, knowledge_space_id, idempotency_key, checkpoint, run_state, total_documents, \
            completed_documents, row_version, snapshot_metadata, created_at, updated_at) \
         VALUES ($2, $1, $2, $3, 'pending_snapshot', 'queued', 0, 0, 0, \
            '{\"schemaVersion\":1,\"strategy\":\"full-generation-rebuild\",\"source\":\"kfs-worker\"}'::jsonb, now(), now()) \
         ON CONFLICT (tenant_id, knowledge_space_id) DO NOTHING",
    )
    .bind(tenant)
    .bind(space)
    .bind(IDEMPOTENCY_KEY)
    .execute(&mut *conn)
    .await?;
    sqlx::query_scalar(
        "SELECT id FROM legacy_space_publication_bootstraps WHERE tenant_id = $1 AND knowledge_space_id = $2",
    )
    .bind(tenant)
    .bind(space)
    .fetch_one(conn)
    .await
}

/// Whether strict published reads of a space may be served: no bootstrap, or one that
/// succeeded.
pub async fn ready(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<bool, sqlx::Error> {
    let state: Option<String> = sqlx::query_scalar(
        "SELECT run_state::text FROM legacy_space_publication_bootstraps WHERE tenant_id = $1 AND knowledge_space_id = $2",
    )
    .bind(tenant)
    .bind(space)
    .fetch_optional(conn)
    .await?;
    Ok(state.is_none_or(|s| s == "succeeded"))
}

/// The row as the job sees it in a step.
struct Row {
    tenant: String,
    space: Uuid,
    checkpoint: String,
    total: i32,
}

#[async_trait::async_trait]
impl LeasedKind for BootstrapKind {
    fn name(&self) -> &'static str {
        "bootstrap"
    }

    fn table(&self) -> &'static str {
        TABLE
    }

    fn policy(&self) -> &Policy {
        &self.policy
    }

    async fn claim(
        &self,
        conn: &mut PgConnection,
        worker_id: &str,
    ) -> Result<Option<Lease>, sqlx::Error> {
        let mut tx = conn.begin().await?;
        // A job that died under its worker as often as it may fail is not run again.
        sqlx::query(&format!(
            "UPDATE {TABLE} j SET run_state = 'failed', {LEASE_CLEAR}, completed_at = now(), \
               last_error_code = 'attempts_exhausted', \
               last_error_message = 'the bootstrap was taken over from dead workers too often', \
               row_version = j.row_version + 1, updated_at = now() \
             WHERE j.run_state = 'running' AND {FAILURES} >= $1 \
               AND (j.lease_expires_at <= now() OR NOT kfs_worker_alive(j.worker_id))"
        ))
        .bind(self.policy.max_attempts)
        .execute(&mut *tx)
        .await?;
        let token = Uuid::new_v4();
        let row: Option<(Uuid, String, i32, String, i32)> = sqlx::query_as(&format!(
            "WITH c AS ( \
               SELECT j.id, j.run_state::text AS was, \
                 {FAILURES} + CASE WHEN j.run_state = 'running' THEN 1 ELSE 0 END AS failures \
               FROM {TABLE} j \
               WHERE coalesce((j.snapshot_metadata ->> 'notBefore')::bigint, 0) <= {NOW_MS} \
                 AND (j.run_state = 'queued' \
                   OR (j.run_state = 'failed' AND {FAILURES} < $4) \
                   OR (j.run_state = 'running' AND {FAILURES} < $4 \
                       AND (j.lease_expires_at <= now() OR NOT kfs_worker_alive(j.worker_id)))) \
               ORDER BY j.updated_at, j.id LIMIT 1 FOR UPDATE OF j SKIP LOCKED \
             ) \
             UPDATE {TABLE} j SET run_state = 'running', worker_id = $1, lease_token = $2, \
               lease_expires_at = now() + $3::bigint * interval '1 millisecond', heartbeat_at = now(), \
               completed_at = NULL, \
               snapshot_metadata = (j.snapshot_metadata - 'notBefore') || jsonb_build_object('failures', c.failures), \
               row_version = j.row_version + 1, updated_at = now() \
             FROM c WHERE j.id = c.id \
             RETURNING j.id, j.checkpoint::text, j.row_version, c.was, c.failures"
        ))
        .bind(worker_id)
        .bind(token)
        .bind(millis(self.policy.lease))
        .bind(self.policy.max_attempts)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((id, checkpoint, row_version, was, failures)) = row else {
            tx.commit().await?;
            return Ok(None);
        };
        if was == "failed" {
            // Retried in place: the documents that did not compile are compiled again.
            sqlx::query(
                "UPDATE legacy_space_publication_bootstrap_items SET status = 'pending', updated_at = now() \
                 WHERE bootstrap_id = $1 AND status = 'failed'",
            )
            .bind(id)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(Some(Lease {
            job_id: id,
            lease_token: token,
            row_version,
            checkpoint,
            attempt: failures + 1,
            max_attempts: self.policy.max_attempts,
            worker_id: worker_id.to_owned(),
            taken_over: was == "running",
        }))
    }

    async fn step(&self, tx: &mut PgConnection, job: &Lease) -> Result<Step, JobError> {
        let (tenant, space, checkpoint, total): (String, Uuid, String, i32) = sqlx::query_as(&format!(
            "SELECT tenant_id::text, knowledge_space_id, checkpoint::text, total_documents FROM {TABLE} WHERE id = $1"
        ))
        .bind(job.job_id)
        .fetch_one(&mut *tx)
        .await?;
        let row = Row {
            tenant,
            space,
            checkpoint,
            total,
        };
        let cp = Checkpoint::parse(&row.checkpoint).ok_or_else(|| {
            JobError::fatal(
                "bootstrap_bad_checkpoint",
                format!("unknown checkpoint {}", row.checkpoint),
            )
        })?;
        let event = match cp {
            Checkpoint::PendingSnapshot => capture(tx, job, &row).await?,
            Checkpoint::SnapshotCaptured | Checkpoint::Rebuilding => {
                let admitted = admit(tx, job, self.page).await?;
                let settled = if cp == Checkpoint::Rebuilding {
                    follow(tx, job, &row).await?
                } else {
                    0
                };
                Event::Items(Items {
                    admitted,
                    settled,
                    ..counts(tx, job).await?
                })
            }
            Checkpoint::Verifying | Checkpoint::Published => {
                let verdict = check(tx, job, &row).await?;
                let step = walk::decide(cp, &Event::Verified(verdict.clone()), self.waits)?;
                record(tx, job, &row, verdict).await?;
                return Ok(step);
            }
        };
        walk::decide(cp, &event, self.waits)
    }

    async fn end(
        &self,
        conn: &mut PgConnection,
        job: &Lease,
        end: &End,
    ) -> Result<bool, sqlx::Error> {
        let set = match end {
            End::Succeed { .. } => {
                "run_state = 'succeeded', checkpoint = $4, completed_at = now(), last_error_code = NULL, \
                 last_error_message = NULL, snapshot_metadata = snapshot_metadata - 'notBefore'"
                    .to_owned()
            }
            End::Fail { .. } => "run_state = 'failed', completed_at = now(), last_error_code = left($4, 64), \
                 last_error_message = $5, snapshot_metadata = snapshot_metadata || jsonb_build_object('failures', $6::int)"
                .to_owned(),
            End::Wait { refund: false, .. } => format!(
                "run_state = 'failed', completed_at = now(), last_error_code = left($4, 64), last_error_message = $5, \
                 snapshot_metadata = snapshot_metadata || jsonb_build_object('failures', $6::int, 'notBefore', {NOW_MS} + $7::bigint)"
            ),
            End::Wait { refund: true, .. } => format!(
                "run_state = 'queued', snapshot_metadata = snapshot_metadata || jsonb_build_object('notBefore', {NOW_MS} + $7::bigint)"
            ),
            End::Continue => "run_state = 'queued', snapshot_metadata = snapshot_metadata - 'notBefore'".to_owned(),
            End::Cancel { .. } | End::Supersede { .. } => {
                "run_state = 'canceled', completed_at = now(), last_error_code = left($4, 64), last_error_message = $5"
                    .to_owned()
            }
        };
        let (a, b, failures, delay): (String, String, i32, Duration) = match end {
            End::Succeed { checkpoint } => (checkpoint.clone(), String::new(), 0, Duration::ZERO),
            End::Fail { code, message } => (
                code.clone(),
                message.clone(),
                self.policy.max_attempts,
                Duration::ZERO,
            ),
            End::Wait {
                delay,
                code,
                message,
                ..
            } => (code.clone(), message.clone(), job.attempt, *delay),
            End::Cancel { code, message } => (code.clone(), message.clone(), 0, Duration::ZERO),
            End::Supersede { message } => ("superseded".into(), message.clone(), 0, Duration::ZERO),
            End::Continue => (String::new(), String::new(), 0, Duration::ZERO),
        };
        let done = sqlx::query(&format!(
            "UPDATE {TABLE} SET {set}, {LEASE_CLEAR}, row_version = row_version + 1, updated_at = now() \
             WHERE {FENCE}"
        ))
        .bind(job.job_id)
        .bind(job.lease_token)
        .bind(job.row_version)
        .bind(a)
        .bind(b)
        .bind(failures)
        .bind(millis(delay))
        .execute(conn)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn release_own(
        &self,
        conn: &mut PgConnection,
        worker_id: &str,
    ) -> Result<u64, sqlx::Error> {
        // Not a failure of the job: the process that held it is gone, and this one replaces it.
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

/// pending_snapshot: under the space row's lock, reclaim expired mutation leases; wait while a
/// live one remains; otherwise freeze the space's active documents as items.
async fn capture(tx: &mut PgConnection, job: &Lease, row: &Row) -> Result<Event, JobError> {
    let locked: Option<Uuid> = sqlx::query_scalar(
        "SELECT id FROM knowledge_spaces WHERE tenant_id = $1 AND id = $2 FOR UPDATE",
    )
    .bind(&row.tenant)
    .bind(row.space)
    .fetch_optional(&mut *tx)
    .await?;
    if locked.is_none() {
        return Err(JobError::fatal(
            "space_missing",
            format!(
                "knowledge space {} of tenant {} does not exist",
                row.space, row.tenant
            ),
        ));
    }
    sqlx::query(
        "DELETE FROM knowledge_space_mutation_leases \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND expires_at <= now()",
    )
    .bind(&row.tenant)
    .bind(row.space)
    .execute(&mut *tx)
    .await?;
    // A lease without an expiry never ends by itself: it fails closed until an operator
    // removes it.
    let (live, next_ms): (i64, Option<f64>) = sqlx::query_as(
        "SELECT count(*), (EXTRACT(EPOCH FROM (min(expires_at) - now())) * 1000)::float8 \
         FROM knowledge_space_mutation_leases WHERE tenant_id = $1 AND knowledge_space_id = $2",
    )
    .bind(&row.tenant)
    .bind(row.space)
    .fetch_one(&mut *tx)
    .await?;
    if live > 0 {
        return Ok(Event::MutationLeased {
            live,
            retry_in: next_ms.map(|ms| Duration::from_millis(ms.max(0.0) as u64)),
        });
    }
    sqlx::query(
        "INSERT INTO legacy_space_publication_bootstrap_items \
           (bootstrap_id, document_asset_id, document_version, document_sha256, ordinal, compilation_attempt_id, \
            status, last_error, created_at, updated_at) \
         SELECT $1, d.id, d.version, d.sha256, (row_number() OVER (ORDER BY d.created_at, d.id) - 1)::int, NULL, \
            'pending', NULL, now(), now() \
         FROM document_assets d JOIN knowledge_spaces s ON s.id = d.knowledge_space_id \
         WHERE s.tenant_id = $2 AND d.knowledge_space_id = $3 AND d.lifecycle_state = 'active' \
         ON CONFLICT (bootstrap_id, document_asset_id) DO NOTHING",
    )
    .bind(job.job_id)
    .bind(&row.tenant)
    .bind(row.space)
    .execute(&mut *tx)
    .await?;
    let documents: i32 = sqlx::query_scalar(&format!(
        "UPDATE {TABLE} SET total_documents = (SELECT count(*) FROM legacy_space_publication_bootstrap_items WHERE bootstrap_id = $1), \
           snapshot_metadata = snapshot_metadata || jsonb_build_object('capturedAt', now()) \
         WHERE id = $1 RETURNING total_documents"
    ))
    .bind(job.job_id)
    .fetch_one(&mut *tx)
    .await?;
    Ok(Event::Captured { documents })
}

/// Requests compiles for a page of pending items; an active attempt of the same document
/// version is adopted instead. Returns how many were admitted.
async fn admit(tx: &mut PgConnection, job: &Lease, page: i64) -> Result<usize, JobError> {
    let pending: Vec<Uuid> = sqlx::query_scalar(
        "SELECT document_asset_id FROM legacy_space_publication_bootstrap_items \
         WHERE bootstrap_id = $1 AND status = 'pending' ORDER BY ordinal LIMIT $2",
    )
    .bind(job.job_id)
    .bind(page)
    .fetch_all(&mut *tx)
    .await?;
    for doc in &pending {
        let attempt = match compile::request(tx, *doc, RequestOptions::default()).await {
            Ok(a) => a,
            Err(CompileError::ActiveAttemptExists {
                attempt: Some(a), ..
            }) => a,
            Err(CompileError::ActiveAttemptExists { attempt: None, .. }) => {
                return Err(JobError::retryable(
                    "compile_request_conflict",
                    format!("document {doc}: another compile was requested at the same time"),
                ))
            }
            Err(
                e @ (CompileError::DocumentNotFound(_) | CompileError::DocumentDeleting { .. }),
            ) => {
                return Err(JobError::fatal(
                    "snapshot_document_unavailable",
                    e.to_string(),
                ))
            }
            Err(CompileError::Db(e)) => return Err(e.into()),
            Err(e) => return Err(JobError::fatal("compile_request_refused", e.to_string())),
        };
        sqlx::query(
            "UPDATE legacy_space_publication_bootstrap_items SET status = 'running', compilation_attempt_id = $3, \
               last_error = NULL, updated_at = now() \
             WHERE bootstrap_id = $1 AND document_asset_id = $2",
        )
        .bind(job.job_id)
        .bind(doc)
        .bind(attempt)
        .execute(&mut *tx)
        .await?;
    }
    Ok(pending.len())
}

/// Settles the running items whose compile attempt ended. Returns how many were settled.
async fn follow(tx: &mut PgConnection, job: &Lease, row: &Row) -> Result<usize, JobError> {
    let done = sqlx::query(
        "WITH s AS ( \
           SELECT i.document_asset_id, \
             CASE WHEN a.id IS NULL OR a.run_state IN ('succeeded', 'superseded') THEN 'succeeded' \
                  WHEN a.run_state IN ('failed', 'canceled') THEN 'failed' END AS status, \
             CASE WHEN a.run_state IN ('failed', 'canceled') \
                  THEN a.run_state || ' ' || coalesce(a.last_error_code, '') || ': ' || coalesce(a.last_error_message, '') END AS err \
           FROM legacy_space_publication_bootstrap_items i \
           LEFT JOIN document_compilation_attempts a ON a.id = i.compilation_attempt_id \
             AND a.tenant_id = $2 AND a.knowledge_space_id = $3 \
           WHERE i.bootstrap_id = $1 AND i.status = 'running' \
         ) \
         UPDATE legacy_space_publication_bootstrap_items i SET status = s.status, last_error = s.err, updated_at = now() \
         FROM s WHERE i.bootstrap_id = $1 AND i.document_asset_id = s.document_asset_id AND s.status IS NOT NULL",
    )
    .bind(job.job_id)
    .bind(&row.tenant)
    .bind(row.space)
    .execute(&mut *tx)
    .await?;
    sqlx::query(&format!(
        "UPDATE {TABLE} SET completed_documents = (SELECT count(*) FROM legacy_space_publication_bootstrap_items \
           WHERE bootstrap_id = $1 AND status = 'succeeded') WHERE id = $1"
    ))
    .bind(job.job_id)
    .execute(&mut *tx)
    .await?;
    Ok(done.rows_affected() as usize)
}

async fn counts(tx: &mut PgConnection, job: &Lease) -> Result<Items, JobError> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT status::text, count(*) FROM legacy_space_publication_bootstrap_items WHERE bootstrap_id = $1 GROUP BY 1",
    )
    .bind(job.job_id)
    .fetch_all(&mut *tx)
    .await?;
    let mut items = Items::default();
    for (status, n) in rows {
        let n = n as usize;
        match status.as_str() {
            "pending" => items.pending = n,
            "running" => items.running = n,
            "succeeded" => items.succeeded = n,
            _ => items.failed += n,
        }
    }
    Ok(items)
}

/// Checks the locked head against the frozen items.
async fn check(tx: &mut PgConnection, job: &Lease, row: &Row) -> Result<Verdict, JobError> {
    type ItemRow = (Uuid, i32, Option<Uuid>, Option<i32>, Option<String>);
    let items: Vec<ItemRow> = sqlx::query_as(
        "SELECT i.document_asset_id, i.document_version, a.publication_generation_id, a.document_version, a.run_state::text \
         FROM legacy_space_publication_bootstrap_items i \
         LEFT JOIN document_compilation_attempts a ON a.id = i.compilation_attempt_id \
           AND a.tenant_id = $2 AND a.knowledge_space_id = $3 \
         WHERE i.bootstrap_id = $1 ORDER BY i.ordinal",
    )
    .bind(job.job_id)
    .bind(&row.tenant)
    .bind(row.space)
    .fetch_all(&mut *tx)
    .await?;
    let rebuilt: Vec<Rebuilt> = items
        .into_iter()
        .map(
            |(document, version, generation, built_version, state)| Rebuilt {
                document,
                version,
                built: match (generation, built_version, state.as_deref()) {
                    (Some(generation), Some(version), Some("succeeded")) => Some(Member {
                        generation,
                        version,
                    }),
                    _ => None,
                },
            },
        )
        .collect();
    let head = publication::head(tx, &row.tenant, row.space, true).await?;
    let members = head.map(|h| h.members).unwrap_or_default();
    Ok(walk::verify(&rebuilt, &members))
}

/// Publishes what the head lacks (by compare-and-swap on its locked revision) and records the
/// head on the bootstrap row.
async fn record(
    tx: &mut PgConnection,
    job: &Lease,
    row: &Row,
    verdict: Verdict,
) -> Result<(), JobError> {
    let head = publication::head(tx, &row.tenant, row.space, true).await?;
    let (publication_id, revision) = match verdict {
        Verdict::Unserved { .. } => return Ok(()),
        Verdict::Served => match head {
            Some(h) => (h.publication_id, h.revision),
            None if row.total == 0 => return Ok(()),
            None => {
                return Err(JobError::fatal(
                    "bootstrap_verify_failed",
                    "the space has no published head",
                ))
            }
        },
        Verdict::Publish(missing) => {
            let (expected, mut members) =
                head.map_or((0, Members::new()), |h| (h.revision, h.members));
            members.extend(missing);
            let (id, _) = publication::create(
                tx,
                &row.tenant,
                row.space,
                &members,
                serde_json::json!({ "bootstrapId": job.job_id }),
            )
            .await?;
            match publication::swap_head(tx, &row.tenant, row.space, expected, id).await? {
                Ok(revision) => (id, revision),
                Err(moved) => {
                    return Err(JobError::retryable(
                        "head_moved",
                        format!(
                            "the head moved to revision {} while publishing",
                            moved.current
                        ),
                    ))
                }
            }
        }
    };
    let fingerprint: String = sqlx::query_scalar(
        "SELECT fingerprint FROM projection_set_publications WHERE id = $1 AND tenant_id = $2 AND knowledge_space_id = $3",
    )
    .bind(publication_id)
    .bind(&row.tenant)
    .bind(row.space)
    .fetch_one(&mut *tx)
    .await?;
    sqlx::query(&format!(
        "UPDATE {TABLE} SET published_publication_id = $2, published_fingerprint = $3, published_head_revision = $4, \
           completed_documents = total_documents WHERE id = $1"
    ))
    .bind(job.job_id)
    .bind(publication_id)
    .bind(fingerprint)
    .bind(revision)
    .execute(&mut *tx)
    .await?;
    Ok(())
}
