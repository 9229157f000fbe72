//! Profile backfills (`knowledge_space_profile_backfills`), leased straight from Postgres.
//! Invariant: a backfill installs a space's initial profile head only in the one transaction
//! that is fenced by its lease token and row version, holds the space manifest's row lock and
//! the head row's lock, and finds the manifest still at the discovered version and the snapshot
//! still hashing to its recorded digest; the revision and the head are written together, the
//! head by compare-and-swap on its absence. Every refusal is final and names its reason.
//!
//! Retries: a retryable failure puts the job back to `queued` (the table keeps no error on a
//! queued row), and the claim takes it again once `updated_at` is older than the kind's
//! backoff for the attempts it has used.

pub mod walk;

use std::time::Duration;

use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::consumer::lease::{millis, End};
use crate::jobs::leased::{Lease, LeasedKind};
use crate::jobs::{JobError, Policy, RetryPolicy, Step};

use walk::{Facts, HeadFact, Plan};

pub const TABLE: &str = "knowledge_space_profile_backfills";

/// The defaults: lease 30 s, 5 attempts, backoff from 5 s to 5 min.
pub const POLICY: Policy = Policy {
    lease: Duration::from_secs(30),
    max_attempts: 5,
    retry: RetryPolicy {
        base: Duration::from_secs(5),
        max: Duration::from_secs(300),
    },
};

/// The backfill kind.
#[derive(Clone, Debug)]
pub struct BackfillKind {
    pub policy: Policy,
}

impl Default for BackfillKind {
    fn default() -> Self {
        Self { policy: POLICY }
    }
}

const LEASE_CLEAR: &str =
    "worker_id = NULL, lease_token = NULL, lease_expires_at = NULL, heartbeat_at = NULL";
const FENCE: &str = "id = $1 AND lease_token = $2 AND row_version = $3 AND run_state = 'running' \
                     AND lease_expires_at > clock_timestamp()";

/// A discovered source profile, as the platform's discovery writes it.
#[derive(Clone, Debug, PartialEq)]
pub struct BackfillRequest {
    pub tenant: String,
    pub space: Uuid,
    /// `embedding` or `retrieval`.
    pub kind: String,
    pub manifest_version: i32,
    pub snapshot: serde_json::Value,
}

/// Writes a queued backfill (digest computed here, `max_execution_attempts` from the kind's
/// policy). Idempotent on the source: the existing backfill is returned.
pub async fn enqueue(conn: &mut PgConnection, req: &BackfillRequest) -> Result<Uuid, sqlx::Error> {
    let digest = walk::digest(&req.snapshot);
    sqlx::query(
        "INSERT INTO knowledge_space_profile_backfills \
           (id, tenant_id, knowledge_space_id, kind, source_manifest_version, source_snapshot, source_snapshot_digest, \
            run_state, execution_attempts, max_execution_attempts, row_version, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, 'queued', 0, $8, 1, now(), now()) \
         ON CONFLICT (tenant_id, knowledge_space_id, kind, source_manifest_version, source_snapshot_digest) DO NOTHING",
    )
    .bind(Uuid::now_v7())
    .bind(&req.tenant)
    .bind(req.space)
    .bind(&req.kind)
    .bind(req.manifest_version)
    .bind(&req.snapshot)
    .bind(&digest)
    .bind(POLICY.max_attempts)
    .execute(&mut *conn)
    .await?;
    sqlx::query_scalar(
        "SELECT id FROM knowledge_space_profile_backfills WHERE tenant_id = $1 AND knowledge_space_id = $2 \
           AND kind = $3 AND source_manifest_version = $4 AND source_snapshot_digest = $5",
    )
    .bind(&req.tenant)
    .bind(req.space)
    .bind(&req.kind)
    .bind(req.manifest_version)
    .bind(&digest)
    .fetch_one(conn)
    .await
}

impl BackfillKind {
    /// The backoff after n used attempts (index n−1), without jitter.
    fn delays(&self) -> Vec<i64> {
        (1..=self.policy.max_attempts.max(1) as u32)
            .map(|n| millis(self.policy.retry.delay(n, 0.0)))
            .collect()
    }
}

#[async_trait::async_trait]
impl LeasedKind for BackfillKind {
    fn name(&self) -> &'static str {
        "backfill"
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
        // A job whose last attempt died with its worker fails instead of staying held forever.
        sqlx::query(&format!(
            "UPDATE {TABLE} SET run_state = 'failed', {LEASE_CLEAR}, completed_at = now(), \
               last_error_code = 'attempts_exhausted', \
               last_error_message = 'the backfill used up its execution attempts', \
               row_version = row_version + 1, updated_at = now() \
             WHERE execution_attempts >= max_execution_attempts \
               AND (run_state = 'queued' OR (run_state = 'running' \
                    AND (lease_expires_at <= now() OR NOT kfs_worker_alive(worker_id))))"
        ))
        .execute(&mut *tx)
        .await?;
        let token = Uuid::new_v4();
        let row: Option<(Uuid, i32, i32, i32, String)> = sqlx::query_as(&format!(
            "WITH c AS ( \
               SELECT j.id, j.run_state::text AS was FROM {TABLE} j \
               WHERE j.execution_attempts < j.max_execution_attempts \
                 AND ((j.run_state = 'queued' \
                       AND j.updated_at + coalesce(($4::bigint[])[j.execution_attempts], 0) * interval '1 millisecond' <= now()) \
                   OR (j.run_state = 'running' \
                       AND (j.lease_expires_at <= now() OR NOT kfs_worker_alive(j.worker_id)))) \
               ORDER BY j.updated_at, j.id LIMIT 1 FOR UPDATE OF j SKIP LOCKED \
             ) \
             UPDATE {TABLE} j SET run_state = 'running', worker_id = $1, lease_token = $2, \
               lease_expires_at = now() + $3::bigint * interval '1 millisecond', heartbeat_at = now(), \
               execution_attempts = j.execution_attempts + 1, row_version = j.row_version + 1, updated_at = now() \
             FROM c WHERE j.id = c.id \
             RETURNING j.id, j.row_version, j.execution_attempts, j.max_execution_attempts, c.was"
        ))
        .bind(worker_id)
        .bind(token)
        .bind(millis(self.policy.lease))
        .bind(self.delays())
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(
            row.map(|(id, row_version, attempt, max_attempts, was)| Lease {
                job_id: id,
                lease_token: token,
                row_version,
                checkpoint: "running".into(),
                attempt,
                max_attempts,
                worker_id: worker_id.to_owned(),
                taken_over: was == "running",
            }),
        )
    }

    async fn step(&self, tx: &mut PgConnection, job: &Lease) -> Result<Step, JobError> {
        type Row = (String, Uuid, String, i32, serde_json::Value, String);
        let (tenant, space, kind, source_version, snapshot, recorded): Row = sqlx::query_as(&format!(
            "SELECT tenant_id::text, knowledge_space_id, kind::text, source_manifest_version, source_snapshot, \
               source_snapshot_digest::text FROM {TABLE} WHERE id = $1"
        ))
        .bind(job.job_id)
        .fetch_one(&mut *tx)
        .await?;
        // Lock order: the job row (fence), the manifest, then the head.
        let manifest_version: Option<i32> = sqlx::query_scalar(
            "SELECT version FROM knowledge_space_manifests WHERE tenant_id = $1 AND knowledge_space_id = $2 \
             ORDER BY version DESC LIMIT 1 FOR UPDATE",
        )
        .bind(&tenant)
        .bind(space)
        .fetch_optional(&mut *tx)
        .await?;
        let head: Option<(i32, String)> = sqlx::query_as(
            "SELECT h.active_revision, r.snapshot_digest::text FROM knowledge_space_profile_heads h \
             JOIN knowledge_space_profile_revisions r ON r.id = h.profile_revision_id \
             WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2 AND h.kind = $3 FOR UPDATE OF h",
        )
        .bind(&tenant)
        .bind(space)
        .bind(&kind)
        .fetch_optional(&mut *tx)
        .await?;
        let facts = Facts {
            manifest_version,
            source_manifest_version: source_version,
            computed_digest: walk::digest(&snapshot),
            recorded_digest: recorded.clone(),
            head: head.map(|(revision, digest)| {
                if digest.trim() == recorded.trim() {
                    HeadFact::Ours
                } else {
                    HeadFact::Other { revision }
                }
            }),
        };
        match walk::decide(&facts)? {
            Plan::AlreadyInstalled => return Ok(Step::Succeed("succeeded".into())),
            Plan::Install => {}
        }
        let profile = walk::profile(&kind, &snapshot)?;
        let capabilities = profile
            .capabilities
            .clone()
            .unwrap_or_else(|| serde_json::json!({}));
        let revision_id = Uuid::now_v7();
        let revision: i32 = sqlx::query_scalar(
            "INSERT INTO knowledge_space_profile_revisions \
               (id, tenant_id, knowledge_space_id, kind, revision, state, snapshot, snapshot_digest, capability_snapshot, \
                capability_snapshot_digest, plugin_id, provider, model, vector_space_id, dimension, created_by_subject_id, \
                failure_code, failure_message, created_at, updated_at, activated_at, superseded_at, failed_at) \
             SELECT $1, $2, $3, $4, coalesce(max(r.revision), 0) + 1, 'active', $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, \
                NULL, NULL, now(), now(), now(), NULL, NULL \
             FROM (SELECT revision FROM knowledge_space_profile_revisions \
                   WHERE tenant_id = $2 AND knowledge_space_id = $3 AND kind = $4) r \
             RETURNING revision",
        )
        .bind(revision_id)
        .bind(&tenant)
        .bind(space)
        .bind(&kind)
        .bind(&snapshot)
        .bind(recorded.trim())
        .bind(&capabilities)
        .bind(walk::digest(&capabilities))
        .bind(&profile.plugin_id)
        .bind(&profile.provider)
        .bind(&profile.model)
        .bind(&profile.vector_space_id)
        .bind(profile.dimension)
        .bind(
            profile
                .created_by_subject_id
                .as_deref()
                .unwrap_or("system:profile-backfill"),
        )
        .fetch_one(&mut *tx)
        .await?;
        let installed: Option<Uuid> = sqlx::query_scalar(
            "INSERT INTO knowledge_space_profile_heads \
               (id, tenant_id, knowledge_space_id, kind, profile_revision_id, active_revision, row_version, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, 1, now(), now()) \
             ON CONFLICT (tenant_id, knowledge_space_id, kind) DO NOTHING RETURNING id",
        )
        .bind(Uuid::now_v7())
        .bind(&tenant)
        .bind(space)
        .bind(&kind)
        .bind(revision_id)
        .bind(revision)
        .fetch_optional(&mut *tx)
        .await?;
        if installed.is_none() {
            // Someone installed a head since we looked: decide again on the next attempt.
            return Err(JobError::retryable(
                "profile_head_moved",
                "another profile head was installed at the same time",
            ));
        }
        crate::crash::point("backfill-before-commit");
        Ok(Step::Succeed("succeeded".into()))
    }

    async fn end(
        &self,
        conn: &mut PgConnection,
        job: &Lease,
        end: &End,
    ) -> Result<bool, sqlx::Error> {
        let (set, code, message, refund) = match end {
            End::Succeed { .. } => (
                "run_state = 'succeeded', completed_at = now(), last_error_code = NULL, last_error_message = NULL",
                None,
                None,
                0,
            ),
            End::Fail { code, message } | End::Cancel { code, message } => (
                "run_state = 'failed', completed_at = now(), last_error_code = left($4, 64), last_error_message = $5",
                Some(code.clone()),
                Some(message.clone()),
                0,
            ),
            End::Supersede { message } => (
                "run_state = 'failed', completed_at = now(), last_error_code = left($4, 64), last_error_message = $5",
                Some("superseded".to_owned()),
                Some(message.clone()),
                0,
            ),
            End::Wait { refund, .. } => (
                "run_state = 'queued', execution_attempts = execution_attempts - $6",
                None,
                None,
                i32::from(*refund),
            ),
            End::Continue => (
                "run_state = 'queued', execution_attempts = execution_attempts - $6",
                None,
                None,
                1,
            ),
        };
        let done = sqlx::query(&format!(
            "UPDATE {TABLE} SET {set}, {LEASE_CLEAR}, row_version = row_version + 1, updated_at = now() WHERE {FENCE}"
        ))
        .bind(job.job_id)
        .bind(job.lease_token)
        .bind(job.row_version)
        .bind(code)
        .bind(message)
        .bind(refund)
        .execute(conn)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn release_own(
        &self,
        conn: &mut PgConnection,
        worker_id: &str,
    ) -> Result<u64, sqlx::Error> {
        // The dead predecessor's attempt stays used, as a crash's does.
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
