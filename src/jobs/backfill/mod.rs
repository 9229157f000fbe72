//! Profile backfills (`knowledge_space_profile_backfills`, platform migration 0018), discovered
//! and leased straight from Postgres as the platform's runtime does. Invariant: a backfill row
//! exists for a space's manifest profile key only as discovery froze it (manifest version,
//! snapshot, SHA-256 of its `stableJson`); a backfill installs the space's initial profile
//! revision and head only in the one transaction that is fenced by its lease token and row
//! version, holds the space row's lock (active, not deletion-fenced), the manifest's and the
//! head's locks, and finds the manifest's profile still at the discovered version and digest;
//! the revision (`active`, every column as the platform writes it) and the head (row_version 1)
//! commit together with `succeeded`, or nothing does. Refusals carry the platform's codes and
//! are final; only an operator's [`retry`] queues a failed backfill again.
//!
//! Since the platform's migration 0019 the backfill also reconciles publication bindings, as the
//! platform's tick does: discovery also selects the spaces whose current
//! publication head has no activated binding, every scanned space is a binding candidate, and
//! [`tick`] runs the platform's `bindCurrentPublished` for each ([`binding`]), which writes one
//! `legacy-bootstrap` binding of the current active profile heads for a head the published read
//! model satisfies, and never changes a binding the head has. The tick counts
//! `bindings_reconciled` (bound, or already bound to that tuple) and `binding_failed` (every
//! refusal but the three "not ready yet" ones), as the platform's tick reports them.
//!
//! Where kfs-worker differs from the platform's runtime: the model capability is derived from
//! the profile ([`profile::derive_capability`]) instead of verified over the network (the
//! platform's assembly requires model preflight; kfs-worker has none); a failure
//! to reach the database is retried with the kind's backoff (the row goes back to `queued`, and
//! the claim takes it once `updated_at` is older than the backoff for the attempts used) where
//! the platform would fail the row; a stored snapshot that no longer hashes to its digest fails
//! the row (`LEGACY_PROFILE_SOURCE_CHANGED`) where the platform's reader throws on every claim.
//! The tick runs before each claim (the engine's `before_claim`) and binds a page's candidates
//! right after discovering them, where the platform binds them after processing the tick's
//! claimed backfills: a head whose profile heads a backfill installs later in the same pass is
//! bound when discovery comes round to its space again. The kind logs each tick's counts
//! ([`Tick`]). In checking a head's profile revisions, kfs-worker checks a
//! capability's kind, selection and dimension but not the rest of the platform's strict
//! capability schema, and a snapshot that no longer parses is refused as `…PROFILE_CORRUPT`
//! where the platform throws its schema error (both count as `binding_failed`).

pub mod binding;
pub mod profile;
pub mod walk;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::engine::lease::{millis, End};
use crate::engine::leased::{
    ClaimRule, EndWrite, Exhausted, Lease, LeasedKind, Param, HOLDER_GONE,
};
use crate::jobs::{JobError, Policy, RetryPolicy, Step};

use walk::{HeadFact, Plan, SourceFacts};

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

const EXHAUSTED_MESSAGE: &str = "Profile backfill exhausted its durable execution-attempt budget";

/// Spaces looked at per discovery page.
pub const DISCOVERY_LIMIT: i64 = 100;

/// Where discovery goes on (a keyset cursor over space ids, kept in memory as the platform's
/// runtime keeps it; it starts over when a page comes back empty).
#[derive(Clone, Debug, Default)]
pub struct DiscoveryCursor(Arc<Mutex<Option<Uuid>>>);

impl DiscoveryCursor {
    fn get(&self) -> Option<Uuid> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set(&self, next: Option<Uuid>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = next;
    }
}

/// The backfill kind.
#[derive(Clone, Debug)]
pub struct BackfillKind {
    pub policy: Policy,
    /// Spaces looked at by the discovery page that runs before each claim.
    pub discovery_limit: i64,
    pub cursor: DiscoveryCursor,
}

impl Default for BackfillKind {
    fn default() -> Self {
        Self {
            policy: POLICY,
            discovery_limit: DISCOVERY_LIMIT,
            cursor: DiscoveryCursor::default(),
        }
    }
}

/// What one discovery page did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Discovered {
    pub scanned: usize,
    pub created: usize,
    /// The last space of the page: where the next page starts.
    pub next: Option<Uuid>,
    /// Every scanned space (tenant, space), once: the spaces whose current head the tick
    /// reconciles to an activated publication binding.
    pub binding_candidates: Vec<(String, Uuid)>,
}

/// One discovery page, in one transaction, as the platform's discovery runs it: the active,
/// not deletion-fenced spaces after `after` that lack an embedding or a retrieval head, or whose
/// current publication head has no activated publication binding; for each of them, each
/// manifest profile key holding an object becomes a queued backfill of the manifest's version
/// (insert-if-absent on the source), and every scanned space is a binding candidate.
pub async fn discover(
    conn: &mut PgConnection,
    after: Option<Uuid>,
    limit: i64,
    max_attempts: i32,
) -> Result<Discovered, sqlx::Error> {
    let mut tx = conn.begin().await?;
    let rows: Vec<(String, Uuid, i32, Value)> = sqlx::query_as(
        "SELECT space.tenant_id::text, space.id, manifest.manifest_version, manifest.metadata \
         FROM knowledge_spaces space \
         JOIN knowledge_space_manifests manifest ON manifest.tenant_id = space.tenant_id \
           AND manifest.knowledge_space_id = space.id \
         WHERE ($1::uuid IS NULL OR space.id > $1) AND space.lifecycle_state = 'active' \
           AND space.deletion_job_id IS NULL \
           AND (NOT EXISTS (SELECT 1 FROM knowledge_space_profile_heads h WHERE h.tenant_id = space.tenant_id \
                  AND h.knowledge_space_id = space.id AND h.kind = 'embedding') \
             OR NOT EXISTS (SELECT 1 FROM knowledge_space_profile_heads h WHERE h.tenant_id = space.tenant_id \
                  AND h.knowledge_space_id = space.id AND h.kind = 'retrieval') \
             OR EXISTS (SELECT 1 FROM projection_set_publication_heads ph \
                  LEFT JOIN knowledge_space_profile_publication_bindings b ON b.tenant_id = ph.tenant_id \
                    AND b.knowledge_space_id = ph.knowledge_space_id AND b.publication_id = ph.publication_id \
                    AND b.activated_at IS NOT NULL \
                  WHERE ph.tenant_id = space.tenant_id AND ph.knowledge_space_id = space.id AND b.id IS NULL)) \
         ORDER BY space.id LIMIT $2",
    )
    .bind(after)
    .bind(limit)
    .fetch_all(&mut *tx)
    .await?;
    let mut created = 0;
    for (tenant, space, manifest_version, metadata) in &rows {
        for (kind, key) in walk::KINDS {
            let Some(snapshot) = metadata.get(key).filter(|v| v.is_object()) else {
                continue;
            };
            created += sqlx::query(
                "INSERT INTO knowledge_space_profile_backfills \
                   (id, tenant_id, knowledge_space_id, kind, source_manifest_version, source_snapshot, \
                    source_snapshot_digest, run_state, execution_attempts, max_execution_attempts, worker_id, \
                    lease_token, lease_expires_at, heartbeat_at, row_version, last_error_code, last_error_message, \
                    created_at, updated_at, completed_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, 'queued', 0, $8, NULL, NULL, NULL, NULL, 1, NULL, NULL, \
                    now(), now(), NULL) \
                 ON CONFLICT (tenant_id, knowledge_space_id, kind, source_manifest_version, source_snapshot_digest) \
                 DO NOTHING",
            )
            .bind(Uuid::new_v4())
            .bind(tenant)
            .bind(space)
            .bind(kind)
            .bind(manifest_version)
            .bind(snapshot)
            .bind(walk::digest(snapshot))
            .bind(max_attempts)
            .execute(&mut *tx)
            .await?
            .rows_affected() as usize;
        }
    }
    tx.commit().await?;
    Ok(Discovered {
        scanned: rows.len(),
        created,
        next: rows.last().map(|r| r.1),
        binding_candidates: rows.into_iter().map(|(t, s, _, _)| (t, s)).collect(),
    })
}

/// What one tick did: the discovery page, and the reconciliation of its binding candidates
/// counted as the platform's tick counts them (`bindingsReconciled`, `bindingFailed`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tick {
    pub discovered: Discovered,
    pub bindings_reconciled: usize,
    pub binding_failed: usize,
}

/// One tick: a discovery page ([`discover`]), then the platform's `bindCurrentPublished` for
/// each of its binding candidates, each in its own transaction
/// ([`binding::bind_current_published`]). A candidate that cannot be bound is logged and
/// counted, never retried here: discovery offers it again until its head is bound.
pub async fn tick(
    conn: &mut PgConnection,
    after: Option<Uuid>,
    limit: i64,
    max_attempts: i32,
) -> Result<Tick, sqlx::Error> {
    let discovered = discover(conn, after, limit, max_attempts).await?;
    let mut t = Tick::default();
    for (tenant, space) in &discovered.binding_candidates {
        let outcome = binding::bind_current_published(conn, tenant, *space).await;
        match &outcome {
            Ok(Ok(binding::Reconciled::Bound(id))) => {
                tracing::info!(%space, binding = %id, "bound the published head to its profiles")
            }
            Ok(Err(r)) if !r.not_ready() => {
                tracing::warn!(%space, code = r.code, message = %r.message, "cannot bind the published head")
            }
            Err(e) => tracing::warn!(%space, error = %e, "cannot bind the published head"),
            _ => {}
        }
        match binding::tally(outcome.as_ref().ok()) {
            binding::Tally::Reconciled => t.bindings_reconciled += 1,
            binding::Tally::Failed => t.binding_failed += 1,
            binding::Tally::NotReady => {}
        }
    }
    t.discovered = discovered;
    Ok(t)
}

/// The operator's retry, as the platform's: the space's latest backfill of `kind`, if it
/// failed, goes back to `queued` with its attempts reset. Returns its id, or `None` when the
/// latest backfill did not fail (or there is none).
pub async fn retry(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    kind: &str,
) -> Result<Option<Uuid>, sqlx::Error> {
    sqlx::query_scalar(&format!(
        "WITH latest AS ( \
           SELECT id, run_state FROM {TABLE} WHERE tenant_id = $1 AND knowledge_space_id = $2 AND kind = $3 \
           ORDER BY source_manifest_version DESC, created_at DESC, id DESC LIMIT 1 FOR UPDATE) \
         UPDATE {TABLE} b SET run_state = 'queued', execution_attempts = 0, last_error_code = NULL, \
           last_error_message = NULL, completed_at = NULL, updated_at = now(), row_version = b.row_version + 1 \
         FROM latest WHERE b.id = latest.id AND latest.run_state = 'failed' RETURNING b.id"
    ))
    .bind(tenant)
    .bind(space)
    .bind(kind)
    .fetch_optional(conn)
    .await
}

impl BackfillKind {
    /// The backoff after n used attempts (index n−1), without jitter.
    fn delays(&self) -> Vec<i64> {
        (1..=self.policy.max_attempts.max(1) as u32)
            .map(|n| millis(self.policy.retry.delay(n, 0.0)))
            .collect()
    }

    /// The platform's `process`, inside the engine's fenced transaction.
    async fn process(&self, tx: &mut PgConnection, job: &Lease) -> Result<Step, JobError> {
        type Row = (String, Uuid, String, i32, Value, String, String);
        let (tenant, space, kind, source_version, stored, recorded, discovered_at): Row =
            sqlx::query_as(&format!(
                "SELECT tenant_id::text, knowledge_space_id, kind::text, source_manifest_version, source_snapshot, \
               source_snapshot_digest::text, \
               to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') \
             FROM {TABLE} WHERE id = $1"
            ))
            .bind(job.job_id)
            .fetch_one(&mut *tx)
            .await?;
        if walk::digest(&stored) != recorded.trim() {
            return Err(JobError::fatal(
                "LEGACY_PROFILE_SOURCE_CHANGED",
                "Knowledge-space profile backfill source snapshot digest mismatch",
            ));
        }
        // In place of the platform's preflight.
        let capability = profile::derive_capability(&kind, &stored, &discovered_at)?;
        // Lock order: the job row (the engine's fence), the space, the manifest, the head.
        let space_writable = binding::lock_space(tx, &tenant, space).await?;
        let manifest: Option<(i32, Value)> = sqlx::query_as(
            "SELECT manifest_version, metadata FROM knowledge_space_manifests \
             WHERE tenant_id = $1 AND knowledge_space_id = $2 FOR UPDATE",
        )
        .bind(&tenant)
        .bind(space)
        .fetch_optional(&mut *tx)
        .await?;
        let source = walk::check_source(&SourceFacts {
            space_writable,
            manifest,
            kind: kind.clone(),
            source_manifest_version: source_version,
            recorded_digest: recorded,
        })?;
        let n = walk::normalize(&kind, &source, &capability)?;
        let head: Option<(String, String, String, i32)> = sqlx::query_as(
            "SELECT r.snapshot_digest::text, r.capability_snapshot_digest::text, r.state::text, h.active_revision \
             FROM knowledge_space_profile_heads h \
             JOIN knowledge_space_profile_revisions r ON r.id = h.profile_revision_id \
             WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2 AND h.kind = $3 FOR UPDATE",
        )
        .bind(&tenant)
        .bind(space)
        .bind(&kind)
        .fetch_optional(&mut *tx)
        .await?;
        let taken: Option<Uuid> = sqlx::query_scalar(
            "SELECT id FROM knowledge_space_profile_revisions \
             WHERE tenant_id = $1 AND knowledge_space_id = $2 AND kind = $3 AND revision = $4 LIMIT 1 FOR UPDATE",
        )
        .bind(&tenant)
        .bind(space)
        .bind(&kind)
        .bind(n.revision)
        .fetch_optional(&mut *tx)
        .await?;
        let head = head.map(
            |(snapshot_digest, capability_digest, state, active_revision)| HeadFact {
                snapshot_digest,
                capability_digest,
                state,
                active_revision,
            },
        );
        if walk::decide(&n, head.as_ref(), taken.is_some())? == Plan::AlreadyActive {
            return Ok(Step::Succeed("succeeded".into()));
        }
        let revision_id = Uuid::new_v4();
        sqlx::query(
            "INSERT INTO knowledge_space_profile_revisions \
               (id, tenant_id, knowledge_space_id, kind, revision, state, snapshot, snapshot_digest, capability_snapshot, \
                capability_snapshot_digest, plugin_id, provider, model, vector_space_id, dimension, created_by_subject_id, \
                failure_code, failure_message, created_at, updated_at, activated_at, superseded_at, failed_at) \
             VALUES ($1, $2, $3, $4, $5, 'active', $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, \
                NULL, NULL, now(), now(), now(), NULL, NULL)",
        )
        .bind(revision_id)
        .bind(&tenant)
        .bind(space)
        .bind(&kind)
        .bind(n.revision)
        .bind(&n.snapshot)
        .bind(walk::digest(&n.snapshot))
        .bind(&n.capability)
        .bind(walk::digest(&n.capability))
        .bind(&n.plugin_id)
        .bind(&n.provider)
        .bind(&n.model)
        .bind(&n.vector_space_id)
        .bind(n.dimension)
        .bind(walk::SYSTEM_ACTOR)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO knowledge_space_profile_heads \
               (id, tenant_id, knowledge_space_id, kind, profile_revision_id, active_revision, row_version, \
                created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, 1, now(), now())",
        )
        .bind(Uuid::new_v4())
        .bind(&tenant)
        .bind(space)
        .bind(&kind)
        .bind(revision_id)
        .bind(n.revision)
        .execute(&mut *tx)
        .await?;
        crate::crash::point("backfill-before-commit");
        Ok(Step::Succeed("succeeded".into()))
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
    fn states(&self) -> &'static [&'static str] {
        &["queued", "running", "succeeded", "failed"]
    }

    fn has_checkpoint(&self) -> bool {
        false
    }

    fn policy(&self) -> &Policy {
        &self.policy
    }

    async fn before_claim(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        let t = tick(
            conn,
            self.cursor.get(),
            self.discovery_limit,
            self.policy.max_attempts,
        )
        .await?;
        tracing::debug!(
            scanned = t.discovered.scanned,
            discovered = t.discovered.created,
            bindings_reconciled = t.bindings_reconciled,
            binding_failed = t.binding_failed,
            "profile backfill tick"
        );
        self.cursor.set(t.discovered.next);
        Ok(())
    }

    fn claim_rule(&self) -> ClaimRule {
        let dead = HOLDER_GONE;
        ClaimRule {
            claimable: format!(
                "j.execution_attempts < j.max_execution_attempts \
                 AND ((j.run_state = 'queued' \
                       AND j.updated_at + coalesce(($4::bigint[])[j.execution_attempts], 0) * interval '1 millisecond' <= now()) \
                   OR (j.run_state = 'running' AND {dead}))"
            ),
            select: String::new(),
            set: ", execution_attempts = j.execution_attempts + 1, completed_at = NULL, \
                  last_error_code = NULL, last_error_message = NULL"
                .into(),
            attempt: "j.execution_attempts",
            max_attempts: Some("j.max_execution_attempts"),
            param: Param::BigInts(self.delays()),
            // A job whose last attempt died with its worker fails instead of staying held
            // forever.
            exhausted: Some(Exhausted {
                rows: format!(
                    "j.execution_attempts >= j.max_execution_attempts \
                     AND (j.run_state = 'queued' OR (j.run_state = 'running' AND {dead}))"
                ),
                code: walk::EXHAUSTED,
                message: EXHAUSTED_MESSAGE,
            }),
        }
    }

    async fn step(&self, tx: &mut PgConnection, job: &Lease) -> Result<Step, JobError> {
        match self.process(tx, job).await {
            // Any other failure the platform's runtime records as its capability failure,
            // without the cause's text.
            Err(JobError::Fatal { code, message }) if !walk::CODES.contains(&code.as_str()) => {
                tracing::warn!(job = %job.job_id, code, message, "profile backfill failed");
                Err(JobError::fatal(
                    profile::CAPABILITY_INVALID,
                    "Legacy profile capability verification failed",
                ))
            }
            other => other,
        }
    }

    fn end_write(&self, job: &Lease, end: &End) -> EndWrite {
        let failed = "run_state = 'failed', completed_at = now(), last_error_code = left($4, 64), \
                      last_error_message = left($5, 16384)";
        let (set, code, message, refund) = match end {
            End::Succeed { .. } => (
                "run_state = 'succeeded', completed_at = now(), last_error_code = NULL, last_error_message = NULL",
                None,
                None,
                0,
            ),
            // Only a transient failure with no attempts left ends here with a code of its own.
            End::Fail { code, message } if !walk::CODES.contains(&code.as_str()) => {
                tracing::warn!(job = %job.job_id, code, message, "profile backfill out of attempts");
                (failed, Some(walk::EXHAUSTED.to_owned()), Some(EXHAUSTED_MESSAGE.to_owned()), 0)
            }
            End::Fail { code, message } | End::Cancel { code, message } => {
                (failed, Some(code.clone()), Some(message.clone()), 0)
            }
            End::Supersede { message } => (
                failed,
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
        EndWrite {
            set: set.to_owned(),
            text4: code,
            text5: message,
            int6: refund,
            bigint7: 0,
        }
    }
}
