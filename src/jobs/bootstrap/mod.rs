//! Legacy space publication bootstraps (`legacy_space_publication_bootstraps` and its items,
//! platform migration 0009), leased straight from Postgres. Invariant: the document set is
//! frozen once, under the space row's lock, only while the space is writable, holds no live
//! mutation lease, no publication head and no active compile; every frozen item is rebuilt by an
//! ordinary compile attempt (requested through [`compile::request`], run by the compile
//! consumers, which publish it); the bootstrap succeeds — `run_state='succeeded'` at
//! `published`, the space's query-readiness latch ([`ready`]) — only in the transaction that
//! finds the frozen set unchanged and the locked head serving exactly the frozen documents, each
//! at its frozen version with a ready page index, ready full-text projections and, for every
//! node, a ready dense sibling (of the manifest's embedding vector space when it names one; the
//! platform requires one even when it names none), and records that head. A head that lacks a
//! rebuilt document is refused, never repaired: kfs-worker publishes nothing itself. A failure is
//! final (`DOCUMENT_COMPILATION_FAILED` for a document that did not compile, otherwise
//! `BOOTSTRAP_PROCESSING_FAILED` with the platform's message) until an operator's [`retry`]
//! queues it again in place, its failed items pending once more.
//!
//! Where kfs-worker differs from the platform's runtime: compiles are requested a page at a
//! time instead of one document at a time (kfs-worker's compile rebases its candidate over a
//! head another document moved, so they publish side by side); a failure to reach the database,
//! or a takeover from a dead worker, is retried with the kind's backoff instead of failing the
//! row. The table has no attempt or retry column, so `snapshot_metadata` carries `failures`
//! (those retried runs) and `notBefore` (epoch ms, database clock: when the row may be claimed
//! again); a row out of attempts fails with `BOOTSTRAP_ATTEMPTS_EXHAUSTED`.

mod snapshot;
mod verify;
pub mod walk;

use std::time::Duration;

use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::engine::lease::{millis, End};
use crate::engine::leased::{
    ClaimRule, EndWrite, Exhausted, Lease, LeasedKind, Param, HOLDER_GONE,
};
use crate::jobs::{JobError, Policy, RetryPolicy, Step};

use walk::{Checkpoint, Waits};

pub const TABLE: &str = "legacy_space_publication_bootstraps";
/// The idempotency key the platform's marker migration uses.
pub const IDEMPOTENCY_KEY: &str = "legacy-space-publication-bootstrap-v1";
/// The code of a bootstrap whose retried runs used up its attempts.
pub const EXHAUSTED: &str = "BOOTSTRAP_ATTEMPTS_EXHAUSTED";

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
    /// The most documents a snapshot may freeze.
    pub max_documents: usize,
}

impl Default for BootstrapKind {
    fn default() -> Self {
        Self {
            policy: POLICY,
            waits: Waits::default(),
            page: 32,
            max_documents: 10_000,
        }
    }
}

const NOW_MS: &str = "(extract(epoch from now()) * 1000)::bigint";
const FAILURES: &str = "coalesce((j.snapshot_metadata ->> 'failures')::int, 0)";

/// Writes the bootstrap marker of a space as the platform's migration 0009 writes it (id = the
/// space's id, queued at `pending_snapshot`). Idempotent: the space's existing bootstrap is
/// returned instead.
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
            '{\"schemaVersion\":1,\"strategy\":\"full-generation-rebuild\",\"source\":\"migration-marker\"}'::jsonb, \
            now(), now()) \
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

/// The platform's `isQueryReady`: with a bootstrap, whether it succeeded; without one, whether
/// the space is free of legacy null-generation state (a space with a publication head is).
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
    .fetch_optional(&mut *conn)
    .await?;
    if let Some(s) = state {
        return Ok(s == "succeeded");
    }
    let headed: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM projection_set_publication_heads WHERE tenant_id = $1 AND knowledge_space_id = $2)",
    )
    .bind(tenant)
    .bind(space)
    .fetch_one(&mut *conn)
    .await?;
    Ok(headed || !snapshot::legacy_state(conn, tenant, space).await?)
}

/// The operator's retry, as the platform's: a failed bootstrap goes back to `queued` in place
/// (same row, same snapshot), its failed items `pending` with no compile attempt, its errors
/// cleared; its retried runs start over. Returns false when the space's bootstrap is not
/// failed (or there is none).
pub async fn retry(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<bool, sqlx::Error> {
    let mut tx = conn.begin().await?;
    let id: Option<Uuid> = sqlx::query_scalar(&format!(
        "UPDATE {TABLE} SET run_state = 'queued', last_error_code = NULL, last_error_message = NULL, \
           completed_at = NULL, snapshot_metadata = snapshot_metadata - 'failures' - 'notBefore', \
           row_version = row_version + 1, updated_at = now() \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND run_state = 'failed' RETURNING id"
    ))
    .bind(tenant)
    .bind(space)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(id) = id else {
        return Ok(false);
    };
    sqlx::query(
        "UPDATE legacy_space_publication_bootstrap_items SET status = 'pending', compilation_attempt_id = NULL, \
           last_error = NULL, updated_at = now() \
         WHERE bootstrap_id = $1 AND status = 'failed'",
    )
    .bind(id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(true)
}

/// The row as the job sees it in a step.
pub(crate) struct Row {
    pub tenant: String,
    pub space: Uuid,
    pub checkpoint: String,
    pub total: i32,
    pub completed: i32,
}

impl BootstrapKind {
    async fn walk(&self, tx: &mut PgConnection, job: &Lease) -> Result<Step, JobError> {
        let (tenant, space, checkpoint, total, completed): (String, Uuid, String, i32, i32) =
            sqlx::query_as(&format!(
                "SELECT tenant_id::text, knowledge_space_id, checkpoint::text, total_documents, completed_documents \
                 FROM {TABLE} WHERE id = $1"
            ))
            .bind(job.job_id)
            .fetch_one(&mut *tx)
            .await?;
        let row = Row {
            tenant,
            space,
            checkpoint,
            total,
            completed,
        };
        let cp = Checkpoint::parse(&row.checkpoint).ok_or_else(|| {
            walk::refuse(format!("unknown bootstrap checkpoint {}", row.checkpoint))
        })?;
        match cp {
            Checkpoint::PendingSnapshot => {
                snapshot::capture(tx, job, &row, self.max_documents).await?;
                Ok(Step::Advance(Checkpoint::SnapshotCaptured.as_str().into()))
            }
            Checkpoint::SnapshotCaptured | Checkpoint::Rebuilding => {
                let admitted = snapshot::admit(tx, job, &row, self.page).await?;
                let settled = snapshot::follow(tx, job, &row).await?;
                let items = walk::Items {
                    admitted,
                    settled,
                    ..snapshot::counts(tx, job).await?
                };
                walk::after_items(cp, &items, self.waits)
            }
            Checkpoint::Verifying | Checkpoint::Published => {
                let verdict = walk::verify(&verify::facts(tx, job, &row).await?);
                let step = walk::after_verify(&verdict)?;
                if let walk::Verdict::Published(head) = &verdict {
                    verify::record(tx, job, head).await?;
                }
                Ok(step)
            }
        }
    }
}

#[async_trait::async_trait]
impl LeasedKind for BootstrapKind {
    fn name(&self) -> &'static str {
        "bootstrap"
    }

    fn table(&self) -> &'static str {
        TABLE
    }
    fn states(&self) -> &'static [&'static str] {
        &["queued", "running", "succeeded", "failed", "canceled"]
    }
    fn checkpoints(&self) -> &'static [&'static str] {
        &[
            "pending_snapshot",
            "snapshot_captured",
            "rebuilding",
            "verifying",
            "published",
        ]
    }

    fn policy(&self) -> &Policy {
        &self.policy
    }

    fn claim_rule(&self) -> ClaimRule {
        let dead = HOLDER_GONE;
        ClaimRule {
            claimable: format!(
                "(j.run_state = 'queued' \
                  AND coalesce((j.snapshot_metadata ->> 'notBefore')::bigint, 0) <= {NOW_MS}) \
                 OR (j.run_state = 'running' AND {FAILURES} < $4 AND {dead})"
            ),
            // A takeover counts as a failure of the run it took over.
            select: format!(
                ", {FAILURES} + CASE WHEN j.run_state = 'running' THEN 1 ELSE 0 END AS failures"
            ),
            set: ", snapshot_metadata = (j.snapshot_metadata - 'notBefore') \
                  || jsonb_build_object('failures', c.failures)"
                .into(),
            attempt: "c.failures + 1",
            max_attempts: None,
            param: Param::Int(self.policy.max_attempts),
            // A job that died under its worker as often as it may be retried is not run again.
            exhausted: Some(Exhausted {
                rows: format!("j.run_state = 'running' AND {FAILURES} >= $3 AND {dead}"),
                code: EXHAUSTED,
                message: "the bootstrap was taken over from dead workers too often",
            }),
        }
    }

    async fn step(&self, tx: &mut PgConnection, job: &Lease) -> Result<Step, JobError> {
        match self.walk(tx, job).await {
            // Every other failure the platform's runtime records with its message only.
            Err(JobError::Fatal { code, message }) if code != walk::COMPILATION_FAILED => {
                if code != walk::PROCESSING_FAILED {
                    tracing::warn!(job = %job.job_id, code, "bootstrap step failed");
                }
                Err(walk::refuse(message))
            }
            other => other,
        }
    }

    fn end_write(&self, job: &Lease, end: &End) -> EndWrite {
        let set = match end {
            End::Succeed { .. } => {
                "run_state = 'succeeded', checkpoint = $4, completed_at = now(), last_error_code = NULL, \
                 last_error_message = NULL, snapshot_metadata = snapshot_metadata - 'notBefore'"
                    .to_owned()
            }
            End::Fail { .. } => "run_state = 'failed', completed_at = now(), last_error_code = left($4, 64), \
                 last_error_message = $5, snapshot_metadata = snapshot_metadata - 'notBefore'"
                .to_owned(),
            // A transient failure: queued again after the backoff, the run counted.
            End::Wait { refund: false, .. } => format!(
                "run_state = 'queued', last_error_code = left($4, 64), last_error_message = $5, \
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
        let (a, b, delay): (String, String, Duration) = match end {
            End::Succeed { checkpoint } => (checkpoint.clone(), String::new(), Duration::ZERO),
            // Only a transient failure with no attempts left ends here with a code of its own.
            End::Fail { code, message }
                if code != walk::COMPILATION_FAILED && code != walk::PROCESSING_FAILED =>
            {
                (EXHAUSTED.to_owned(), message.clone(), Duration::ZERO)
            }
            End::Fail { code, message } | End::Cancel { code, message } => {
                (code.clone(), message.clone(), Duration::ZERO)
            }
            End::Wait {
                delay,
                code,
                message,
                ..
            } => (code.clone(), message.clone(), *delay),
            End::Supersede { message } => ("superseded".into(), message.clone(), Duration::ZERO),
            End::Continue => (String::new(), String::new(), Duration::ZERO),
        };
        EndWrite {
            set,
            text4: Some(a),
            text5: Some(b),
            int6: job.attempt,
            bigint7: millis(delay),
        }
    }
}
