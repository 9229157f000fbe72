//! Requesting a research task, as the platform's API admits one. Invariant: the job row
//! (`queued`, row version 1), its first outbox row (revision 1, pending) and the
//! `research_task.started` event (sequence 1) are written together in the caller's transaction,
//! or nothing is; nothing is written for an invalid request, a space being deleted or with a
//! deletion in progress, a permission snapshot the platform's revalidation does not grant, or a
//! capability grant the platform's capability fence refuses (revoked, of another space, or its
//! space fenced); the job records exactly one authority, as the platform's API writes it: the
//! snapshot's subject, id, revision and channel with no grant, or the grant with those four NULL;
//! the job records the mode and top-k it will run with (an `auto` request is routed here, by the
//! platform's fallback, since kfs-worker has no routing model) and the published runtime
//! snapshot of the space at this moment, so that the task reads what was published when it was
//! asked.
//!
//! Where kfs-worker differs from the platform: a space with no published head yet is admitted
//! (the platform refuses it as not query-ready) and freezes no snapshot; its task reads the head
//! current at its retrieving step.

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use super::access::{self, Expected};
use super::budget::Cost;
use super::plan;
use super::progress::{self, payload, EventType, JobScope, NOW_MS};
use super::snapshot::{self, RuntimeSnapshot};
use super::walk::Stage;
use crate::capability;
use crate::jobs::RESEARCH;

pub const CHANNELS: [&str; 4] = ["interactive", "service_api", "mcp", "agent"];
pub const MODES: [&str; 4] = ["auto", "fast", "research", "deep"];
/// The platform's top-k when neither the request nor the retrieval profile names one.
pub const DEFAULT_TOP_K: i32 = 10;
pub const MAX_TOP_K: i32 = 100;
pub const MAX_QUESTION_CHARS: usize = 4000;

/// The authority a task is asked on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AskedBy {
    /// A permission snapshot issued to `subject_id` for `access_channel` (`interactive`,
    /// `service_api`, `mcp` or `agent`).
    Snapshot {
        subject_id: String,
        permission_snapshot_id: Uuid,
        access_channel: String,
    },
    /// A capability grant: it names the subject and the content it may read.
    Grant(Uuid),
}

/// A research request.
#[derive(Clone, Debug, PartialEq)]
pub struct ResearchRequest {
    pub space_id: Uuid,
    pub question: String,
    pub asked_by: AskedBy,
    pub budget_usd: Option<f64>,
    pub top_k: Option<i32>,
    /// `auto`, `fast`, `research` or `deep`.
    pub mode: String,
    /// Repeating a request with the same key returns the first job (same request) or is refused
    /// (different request).
    pub idempotency_key: Option<String>,
}

impl ResearchRequest {
    /// An interactive request in `auto` mode with no budget.
    pub fn new(
        space_id: Uuid,
        question: impl Into<String>,
        subject_id: impl Into<String>,
        permission_snapshot_id: Uuid,
    ) -> Self {
        Self {
            space_id,
            question: question.into(),
            asked_by: AskedBy::Snapshot {
                subject_id: subject_id.into(),
                permission_snapshot_id,
                access_channel: "interactive".into(),
            },
            budget_usd: None,
            top_k: None,
            mode: "auto".into(),
            idempotency_key: None,
        }
    }

    /// A request on a capability grant, in `auto` mode with no budget.
    pub fn under_grant(space_id: Uuid, question: impl Into<String>, grant: Uuid) -> Self {
        Self {
            asked_by: AskedBy::Grant(grant),
            ..Self::new(space_id, question, "", Uuid::nil())
        }
    }

    /// Checks the request's own fields. Pure.
    pub fn validate(&self) -> Result<(), RequestError> {
        let q = self.question.trim();
        if q.is_empty() {
            return Err(RequestError::Invalid("the question is empty".into()));
        }
        if q.chars().count() > MAX_QUESTION_CHARS {
            return Err(RequestError::Invalid(format!(
                "the question is longer than {MAX_QUESTION_CHARS} characters"
            )));
        }
        if plan::terms(q).is_empty() {
            return Err(RequestError::Invalid(
                "the question has no word to search for".into(),
            ));
        }
        if let AskedBy::Snapshot {
            subject_id,
            access_channel,
            ..
        } = &self.asked_by
        {
            let subject = subject_id.trim();
            if subject.is_empty() || subject.len() > 255 {
                return Err(RequestError::Invalid(
                    "the subject must be 1 to 255 characters".into(),
                ));
            }
            if !CHANNELS.contains(&access_channel.as_str()) {
                return Err(RequestError::Invalid(format!(
                    "unknown channel '{access_channel}'; expected one of {}",
                    CHANNELS.join(", ")
                )));
            }
        }
        if !MODES.contains(&self.mode.as_str()) {
            return Err(RequestError::Invalid(format!(
                "unknown mode '{}'; expected one of {}",
                self.mode,
                MODES.join(", ")
            )));
        }
        if let Some(b) = self.budget_usd {
            if !b.is_finite() || b < 0.0 {
                return Err(RequestError::Invalid(
                    "the budget must be a non-negative number of USD".into(),
                ));
            }
        }
        if let Some(k) = self.top_k {
            if !(1..=MAX_TOP_K).contains(&k) {
                return Err(RequestError::Invalid(format!(
                    "top-k must be between 1 and {MAX_TOP_K}"
                )));
            }
        }
        if let Some(key) = &self.idempotency_key {
            if key.trim().is_empty() || key.len() > 255 {
                return Err(RequestError::Invalid(
                    "the idempotency key must be 1 to 255 characters".into(),
                ));
            }
        }
        Ok(())
    }

    /// The request fingerprint: hex SHA-256 over every field that shapes the task.
    pub fn fingerprint(&self) -> String {
        let mut canonical = json!({
            "space": self.space_id,
            "question": self.question.trim(),
            "budgetUsd": self.budget_usd,
            "topK": self.top_k,
            "mode": self.mode,
        });
        match &self.asked_by {
            AskedBy::Snapshot {
                subject_id,
                permission_snapshot_id,
                access_channel,
            } => {
                canonical["subject"] = json!(subject_id.trim());
                canonical["snapshot"] = json!(permission_snapshot_id);
                canonical["channel"] = json!(access_channel);
            }
            AskedBy::Grant(grant) => canonical["grant"] = json!(grant),
        }
        hex::encode(Sha256::digest(canonical.to_string().as_bytes()))
    }

    /// The effective limits, stored in `limits`, for the resolved mode and top-k.
    pub fn limits(&self, mode: &str, top_k: i32) -> Value {
        json!({
            "topK": top_k,
            "maxSubQueries": plan::max_sub_queries(mode),
            "budgetUsd": self.budget_usd,
        })
    }
}

/// The mode a request runs in, and the platform's record of how an `auto` request was routed:
/// without a routing model, its fallback (the retrieval profile's default mode, else
/// `research`). Pure.
pub fn resolve_mode(requested: &str, default_mode: Option<&str>) -> (String, Option<Value>) {
    if requested != "auto" {
        return (requested.to_owned(), None);
    }
    let resolved = default_mode
        .filter(|m| matches!(*m, "fast" | "research" | "deep"))
        .unwrap_or("research");
    (
        resolved.to_owned(),
        Some(json!({
            "degraded": true, "durationMs": 0, "errorClass": "AutoRetrievalModeResolverUnavailable",
            "requestedMode": "auto", "resolvedMode": resolved, "resolver": "fallback",
        })),
    )
}

/// Why a request was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("invalid research request: {0}")]
    Invalid(String),
    #[error("no knowledge space {0}")]
    SpaceNotFound(Uuid),
    #[error("knowledge space {space} cannot be researched: {reason}")]
    SpaceUnavailable { space: Uuid, reason: String },
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    #[error("idempotency key already used for a different request (job {0})")]
    Conflict(Uuid),
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
}

impl RequestError {
    /// A problem with the request itself (exit code 2), as opposed to a failing database.
    pub fn is_refusal(&self) -> bool {
        !matches!(self, RequestError::Db(_))
    }
}

/// A requested (or, for a repeated idempotent request, the existing) task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Requested {
    pub job_id: Uuid,
    pub tenant_id: String,
    pub space_id: Uuid,
    /// The first outbox row.
    pub outbox_id: Uuid,
    /// `false`: an earlier request with the same idempotency key made this job.
    pub created: bool,
}

/// The outbox key of a delivery revision: `research.task:<tenant>:<space>:<jobId>:<revision>`.
pub fn outbox_key(scope: &JobScope, revision: i32) -> String {
    format!(
        "research.task:{}:{}:{}:{revision}",
        scope.tenant_id, scope.space_id, scope.job_id
    )
}

/// Writes an outbox row of `revision`, pending now. The caller holds the job row.
pub(crate) async fn insert_outbox(
    conn: &mut PgConnection,
    scope: &JobScope,
    revision: i32,
) -> Result<Uuid, sqlx::Error> {
    let id = Uuid::now_v7();
    sqlx::query(&format!(
        "INSERT INTO research_task_outbox (id, research_task_job_id, delivery_revision, event_type, schema_version, \
           idempotency_key, payload, status, available_at, dispatch_attempts, locked_by, locked_until, lock_token, \
           queue_job_id, last_error, delivered_at, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, 1, $5, $6, 'pending', {NOW_MS}, 0, NULL, NULL, NULL, NULL, NULL, NULL, {NOW_MS}, {NOW_MS})"
    ))
    .bind(id)
    .bind(scope.job_id)
    .bind(revision)
    .bind(RESEARCH.event_type)
    .bind(outbox_key(scope, revision))
    .bind(json!({ "researchTaskJobId": scope.job_id }))
    .execute(conn)
    .await?;
    Ok(id)
}

/// Requests a research task in the caller's transaction (or, on a plain connection, in one of
/// its own). Nothing is written unless every check passes.
pub async fn request(
    conn: &mut PgConnection,
    req: &ResearchRequest,
) -> Result<Requested, RequestError> {
    req.validate()?;
    let mut tx = conn.begin().await?;

    let tenant: Option<String> =
        sqlx::query_scalar("SELECT tenant_id FROM knowledge_spaces WHERE id = $1")
            .bind(req.space_id)
            .fetch_optional(&mut *tx)
            .await?;
    let tenant = tenant.ok_or(RequestError::SpaceNotFound(req.space_id))?;
    // The space, share-locked so that a deletion cannot mark it between our check and commit.
    let deletions = access::deletions(&mut tx, &tenant, req.space_id).await?;
    if let Some(reason) = access::admission_fence(&deletions) {
        return Err(RequestError::SpaceUnavailable {
            space: req.space_id,
            reason,
        });
    }
    // The authority, checked and locked for the rest of the transaction: the snapshot columns
    // (subject, snapshot, revision, channel) or the grant, as the row records them.
    type Binding<'a> = (
        Option<&'a str>,
        Option<Uuid>,
        Option<i32>,
        Option<&'a str>,
        Option<Uuid>,
    );
    let binding: Binding<'_> = match &req.asked_by {
        AskedBy::Snapshot {
            subject_id,
            permission_snapshot_id,
            access_channel,
        } => {
            let want = Expected {
                tenant_id: &tenant,
                space_id: req.space_id,
                snapshot_id: *permission_snapshot_id,
                subject_id: subject_id.trim(),
                access_channel,
                revision: None,
            };
            let valid = access::revalidate(&mut tx, &want)
                .await?
                .map_err(RequestError::PermissionDenied)?;
            (
                Some(subject_id.trim()),
                Some(*permission_snapshot_id),
                Some(valid.revision),
                Some(access_channel.as_str()),
                None,
            )
        }
        AskedBy::Grant(grant) => {
            capability::check(&mut tx, &tenant, req.space_id, *grant)
                .await?
                .into_result()
                .map_err(RequestError::PermissionDenied)?;
            (None, None, None, None, Some(*grant))
        }
    };

    let fingerprint = req.fingerprint();
    if let Some(key) = &req.idempotency_key {
        // One request per key at a time; then the key decides.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(format!("research-request:{tenant}:{}:{key}", req.space_id))
            .execute(&mut *tx)
            .await?;
        let existing: Option<(Uuid, Option<String>)> = sqlx::query_as(
            "SELECT id, metadata ->> 'requestFingerprint' FROM research_task_jobs \
             WHERE tenant_id = $1 AND knowledge_space_id = $2 AND metadata ->> 'idempotencyKey' = $3",
        )
        .bind(&tenant)
        .bind(req.space_id)
        .bind(key)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some((job_id, fp)) = existing {
            if fp.as_deref() != Some(fingerprint.as_str()) {
                return Err(RequestError::Conflict(job_id));
            }
            let outbox_id: Uuid = sqlx::query_scalar(
                "SELECT id FROM research_task_outbox WHERE research_task_job_id = $1 AND delivery_revision = 1",
            )
            .bind(job_id)
            .fetch_one(&mut *tx)
            .await?;
            tx.commit().await?;
            return Ok(Requested {
                job_id,
                tenant_id: tenant,
                space_id: req.space_id,
                outbox_id,
                created: false,
            });
        }
    }

    let frozen: Option<RuntimeSnapshot> = snapshot::capture(&mut tx, &tenant, req.space_id).await?;
    let (mode, routed) = resolve_mode(&req.mode, frozen.as_ref().and_then(|s| s.default_mode()));
    if mode != "research" {
        let embedding = match &frozen {
            Some(s) => s.embedding_profile.is_some(),
            None => crate::jobs::compile::steps::embedding_profile(&mut tx, &tenant, req.space_id)
                .await?
                .is_some(),
        };
        if !embedding {
            return Err(RequestError::SpaceUnavailable {
                space: req.space_id,
                reason: format!("{mode} mode needs an embedding profile, and the space has none"),
            });
        }
    }
    let top_k = req
        .top_k
        .or(frozen.as_ref().and_then(RuntimeSnapshot::top_k))
        .unwrap_or(DEFAULT_TOP_K)
        .clamp(1, MAX_TOP_K);

    let scope = JobScope {
        job_id: Uuid::now_v7(),
        tenant_id: tenant.clone(),
        space_id: req.space_id,
    };
    let mut metadata = json!({ "requestFingerprint": fingerprint });
    if let Some(key) = &req.idempotency_key {
        metadata["idempotencyKey"] = json!(key);
    }
    if let Some(s) = &frozen {
        metadata[snapshot::METADATA_KEY] = serde_json::to_value(s).unwrap_or(Value::Null);
    }
    if let Some(d) = routed {
        metadata[snapshot::AUTO_MODE_KEY] = d;
    }
    sqlx::query(&format!(
        "INSERT INTO research_task_jobs (id, tenant_id, knowledge_space_id, subject_id, permission_snapshot_id, \
           permission_snapshot_revision, access_channel, query, mode, top_k, budget_usd, limits, metadata, cost, \
           stage, paused_from_stage, queue_job_id, error, resume_after, paused_at, completed_at, row_version, \
           execution_attempts, max_execution_attempts, worker_id, lease_token, lease_expires_at, heartbeat_at, \
           retry_at, created_at, updated_at, capability_grant_id) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, 'queued', NULL, NULL, NULL, NULL, NULL, \
           NULL, 1, 0, $15, NULL, NULL, NULL, NULL, NULL, {NOW_MS}, {NOW_MS}, $16)"
    ))
    .bind(scope.job_id)
    .bind(&scope.tenant_id)
    .bind(scope.space_id)
    .bind(binding.0)
    .bind(binding.1)
    .bind(binding.2)
    .bind(binding.3)
    .bind(req.question.trim())
    .bind(&mode)
    .bind(top_k)
    .bind(req.budget_usd)
    .bind(req.limits(&mode, top_k))
    .bind(metadata)
    .bind(Cost::initial(req.budget_usd).to_json())
    .bind(RESEARCH.policy.max_attempts)
    .bind(binding.4)
    .execute(&mut *tx)
    .await?;
    let outbox_id = insert_outbox(&mut tx, &scope, 1).await?;
    progress::append_event(
        &mut tx,
        &scope,
        1,
        EventType::Started,
        Stage::Queued,
        payload::started(),
    )
    .await?;
    tx.commit().await?;
    Ok(Requested {
        job_id: scope.job_id,
        tenant_id: scope.tenant_id,
        space_id: scope.space_id,
        outbox_id,
        created: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok() -> ResearchRequest {
        ResearchRequest::new(
            Uuid::from_u128(1),
            "How do leases work?",
            "alice",
            Uuid::from_u128(2),
        )
    }

    #[test]
    fn validation_table() {
        assert!(ok().validate().is_ok());
        let bad: Vec<(ResearchRequest, &str)> = vec![
            (
                ResearchRequest {
                    question: "  ".into(),
                    ..ok()
                },
                "empty",
            ),
            (
                ResearchRequest {
                    question: "what is it?".into(),
                    ..ok()
                },
                "no word",
            ),
            (
                ResearchRequest {
                    question: "x".repeat(4001) + " lease",
                    ..ok()
                },
                "longer",
            ),
            (
                ResearchRequest::new(Uuid::from_u128(1), "How do leases work?", " ", Uuid::nil()),
                "subject",
            ),
            (
                ResearchRequest {
                    asked_by: AskedBy::Snapshot {
                        subject_id: "alice".into(),
                        permission_snapshot_id: Uuid::from_u128(2),
                        access_channel: "email".into(),
                    },
                    ..ok()
                },
                "channel",
            ),
            (
                ResearchRequest {
                    mode: "slow".into(),
                    ..ok()
                },
                "mode",
            ),
            (
                ResearchRequest {
                    budget_usd: Some(-1.0),
                    ..ok()
                },
                "budget",
            ),
            (
                ResearchRequest {
                    budget_usd: Some(f64::NAN),
                    ..ok()
                },
                "budget",
            ),
            (
                ResearchRequest {
                    top_k: Some(0),
                    ..ok()
                },
                "top-k",
            ),
            (
                ResearchRequest {
                    top_k: Some(101),
                    ..ok()
                },
                "top-k",
            ),
            (
                ResearchRequest {
                    idempotency_key: Some(String::new()),
                    ..ok()
                },
                "idempotency",
            ),
        ];
        for (r, needle) in bad {
            let e = r.validate().unwrap_err().to_string();
            assert!(e.contains(needle), "{e:?} should mention {needle:?}");
        }
    }

    #[test]
    fn a_grant_request_needs_no_subject_or_channel() {
        let g = ResearchRequest::under_grant(
            Uuid::from_u128(1),
            "How do leases work?",
            Uuid::from_u128(3),
        );
        assert!(g.validate().is_ok());
        assert_eq!(g.asked_by, AskedBy::Grant(Uuid::from_u128(3)));
        assert!(ResearchRequest {
            question: " ".into(),
            ..g
        }
        .validate()
        .is_err());
    }

    #[test]
    fn fingerprints_follow_the_fields() {
        assert_eq!(ok().fingerprint(), ok().fingerprint());
        // The authority is part of the request: a grant, or another grant, is another request.
        let g = |n| {
            ResearchRequest::under_grant(
                Uuid::from_u128(1),
                "How do leases work?",
                Uuid::from_u128(n),
            )
        };
        assert_eq!(g(3).fingerprint(), g(3).fingerprint());
        assert_ne!(g(3).fingerprint(), g(4).fingerprint());
        assert_ne!(g(2).fingerprint(), ok().fingerprint());
        // A snapshot request's fingerprint is the one kfs-worker always wrote for it.
        let canonical = json!({
            "space": Uuid::from_u128(1), "question": "How do leases work?", "subject": "alice",
            "snapshot": Uuid::from_u128(2), "channel": "interactive", "budgetUsd": null,
            "topK": null, "mode": "auto",
        });
        assert_eq!(
            ok().fingerprint(),
            hex::encode(Sha256::digest(canonical.to_string().as_bytes()))
        );
        assert_ne!(
            ok().fingerprint(),
            ResearchRequest {
                top_k: Some(3),
                ..ok()
            }
            .fingerprint()
        );
        // The key itself is not part of the request.
        assert_eq!(
            ok().fingerprint(),
            ResearchRequest {
                idempotency_key: Some("k".into()),
                ..ok()
            }
            .fingerprint()
        );
    }

    #[test]
    fn auto_mode_routes_to_the_fallback() {
        assert_eq!(
            resolve_mode("deep", Some("fast")),
            ("deep".to_owned(), None)
        );
        let (m, d) = resolve_mode("auto", None);
        assert_eq!(m, "research");
        assert_eq!(
            d.unwrap(),
            json!({"degraded": true, "durationMs": 0, "errorClass": "AutoRetrievalModeResolverUnavailable",
                   "requestedMode": "auto", "resolvedMode": "research", "resolver": "fallback"})
        );
        assert_eq!(resolve_mode("auto", Some("deep")).0, "deep");
        assert_eq!(resolve_mode("auto", Some("auto")).0, "research");
    }

    #[test]
    fn outbox_keys() {
        let s = JobScope {
            job_id: Uuid::from_u128(3),
            tenant_id: "t1".into(),
            space_id: Uuid::from_u128(4),
        };
        assert_eq!(
            outbox_key(&s, 2),
            format!("research.task:t1:{}:{}:2", s.space_id, s.job_id)
        );
    }
}
