//! Manual retries of failed deletion jobs, in the caller's transaction, as the platform's API
//! does them. Invariant: only a failed job that still holds its active slot and its active
//! tombstone can be retried, by its original requester (same subject, channel and API key
//! binding, with a snapshot that still revalidates; or, for a job requested under a capability
//! grant, the same grant, still active in an unfenced space) or by an interactive owner rescue
//! (no API key, the owner role; never under a grant); a retry writes the new outbox revision, the
//! re-armed dead items, the job back to `dispatch_pending` and its audit row (recording the grant
//! alone under a grant) together or not at all; a refused retry changes nothing.

use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use super::ask::{active_grant, insert_outbox, Asker, RequestError};
use super::authz::{
    check_channel, check_text, is_unique_violation, sha256_hex, valid_snapshot, Access,
};

/// Who may retry a failed job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryAuthority {
    /// The subject that requested the deletion.
    OriginalRequester,
    /// A space owner, interactively (no API key), rescuing someone else's failed deletion.
    InteractiveOwnerRescue,
}

impl RetryAuthority {
    pub fn as_str(self) -> &'static str {
        match self {
            RetryAuthority::OriginalRequester => "original_requester",
            RetryAuthority::InteractiveOwnerRescue => "interactive_owner_rescue",
        }
    }
}

/// A manual retry of a failed deletion job.
#[derive(Clone, Debug)]
pub struct RetryRequest {
    pub job_id: Uuid,
    pub actor_subject_id: String,
    pub permission_snapshot_id: Uuid,
    pub access_channel: String,
    pub authority: RetryAuthority,
    /// Per retry; must differ from the original request's key.
    pub idempotency_key: String,
}

/// A manual retry of a failed deletion job under the capability grant it was requested with:
/// always as its original requester (the platform refuses an owner rescue under a grant).
#[derive(Clone, Debug)]
pub struct GrantRetryRequest {
    pub job_id: Uuid,
    pub capability_grant_id: Uuid,
    /// Per retry; must differ from the original request's key.
    pub idempotency_key: String,
}

/// A retry as the write path sees it, whatever its authority.
struct RetryAsk {
    job_id: Uuid,
    asker: Asker,
    authority: RetryAuthority,
    idempotency_key: String,
}

impl From<&RetryRequest> for RetryAsk {
    fn from(r: &RetryRequest) -> Self {
        RetryAsk {
            job_id: r.job_id,
            asker: Asker::Snapshot {
                subject: r.actor_subject_id.clone(),
                snapshot: r.permission_snapshot_id,
                channel: r.access_channel.clone(),
            },
            authority: r.authority,
            idempotency_key: r.idempotency_key.clone(),
        }
    }
}

impl From<&GrantRetryRequest> for RetryAsk {
    fn from(r: &GrantRetryRequest) -> Self {
        RetryAsk {
            job_id: r.job_id,
            asker: Asker::Grant(r.capability_grant_id),
            authority: RetryAuthority::OriginalRequester,
            idempotency_key: r.idempotency_key.clone(),
        }
    }
}

/// The outbox revision a retry created or found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retried {
    pub job_id: Uuid,
    pub outbox_id: Uuid,
    pub delivery_revision: i32,
    pub created: bool,
}

impl RetryRequest {
    pub fn fingerprint(&self) -> String {
        RetryAsk::from(self).fingerprint()
    }
}

impl GrantRetryRequest {
    /// As [`RetryRequest::fingerprint`], with the grant in place of the actor, snapshot and
    /// channel.
    pub fn fingerprint(&self) -> String {
        RetryAsk::from(self).fingerprint()
    }
}

impl RetryAsk {
    fn fingerprint(&self) -> String {
        let mut fields = vec![
            "deletion.retry.v1".to_owned(),
            self.job_id.to_string(),
            self.authority.as_str().to_owned(),
        ];
        match &self.asker {
            Asker::Snapshot {
                subject,
                snapshot,
                channel,
            } => fields.extend([subject.clone(), snapshot.to_string(), channel.clone()]),
            Asker::Grant(grant) => {
                fields.extend(["capability-grant".to_owned(), grant.to_string()])
            }
        }
        sha256_hex(
            &fields
                .iter()
                .map(|f| format!("{}:{f}", f.len()))
                .collect::<Vec<_>>()
                .join("\n"),
        )
    }
}

/// Retries a failed deletion job in the caller's transaction: a new outbox revision, dead items
/// re-armed with one more attempt, the job back to `dispatch_pending`, and an audit row. The
/// actor is either the original requester or an interactive owner rescue (channel
/// `interactive`, no API key, a snapshot with the owner role); anything else is refused.
/// Idempotent per `idempotency_key`.
pub async fn retry_deletion(
    conn: &mut PgConnection,
    req: &RetryRequest,
) -> Result<Retried, RequestError> {
    check_text("acting subject", &req.actor_subject_id, 255)?;
    check_channel(&req.access_channel)?;
    retry(conn, &RetryAsk::from(req)).await
}

/// [`retry_deletion`] under the capability grant the job was requested with: refused, with
/// nothing written, for a job of another authority or a grant that is no longer active. The
/// audit row records the grant and no actor, snapshot, channel or API key.
pub async fn retry_deletion_under_grant(
    conn: &mut PgConnection,
    req: &GrantRetryRequest,
) -> Result<Retried, RequestError> {
    retry(conn, &RetryAsk::from(req)).await
}

async fn retry(conn: &mut PgConnection, req: &RetryAsk) -> Result<Retried, RequestError> {
    check_text("idempotency key", &req.idempotency_key, 512)?;
    let fingerprint = req.fingerprint();
    let mut sp = conn.begin().await?;
    let written = write_retry(&mut sp, req, &fingerprint).await;
    match written {
        Ok(r) => {
            sp.commit().await?;
            Ok(r)
        }
        Err(e) => {
            sp.rollback().await?;
            if let RequestError::Db(db) = &e {
                if is_unique_violation(db, "deletion_retry_audits_job_request_uq")
                    || is_unique_violation(db, "deletion_outbox_job_request_uq")
                {
                    if let Some(found) = existing_retry(conn, req, &fingerprint).await? {
                        return Ok(found);
                    }
                    return Err(RequestError::IdempotencyConflict {
                        key: req.idempotency_key.clone(),
                        job_id: req.job_id,
                    });
                }
            }
            Err(e)
        }
    }
}

/// The authority columns of a retry's audit row.
#[derive(Default)]
struct Audit {
    grant: Option<Uuid>,
    actor: Option<String>,
    snapshot: Option<Uuid>,
    revision: Option<i32>,
    channel: Option<String>,
    api_key_id: Option<Uuid>,
    api_key_revision: Option<i32>,
    api_key_expires_at: Option<chrono::DateTime<chrono::Utc>>,
}

async fn existing_retry(
    conn: &mut PgConnection,
    req: &RetryAsk,
    fingerprint: &str,
) -> Result<Option<Retried>, RequestError> {
    let row: Option<(Uuid, String, i32)> = sqlx::query_as(
        "SELECT a.outbox_id, a.request_fingerprint, o.delivery_revision \
         FROM deletion_retry_audits a JOIN deletion_outbox o ON o.id = a.outbox_id AND o.deletion_job_id = a.deletion_job_id \
         WHERE a.deletion_job_id = $1 AND a.request_idempotency_key = $2",
    )
    .bind(req.job_id)
    .bind(&req.idempotency_key)
    .fetch_optional(&mut *conn)
    .await?;
    match row {
        None => Ok(None),
        Some((outbox_id, fp, rev)) if fp == fingerprint => Ok(Some(Retried {
            job_id: req.job_id,
            outbox_id,
            delivery_revision: rev,
            created: false,
        })),
        Some(_) => Err(RequestError::IdempotencyConflict {
            key: req.idempotency_key.clone(),
            job_id: req.job_id,
        }),
    }
}

async fn write_retry(
    conn: &mut PgConnection,
    req: &RetryAsk,
    fingerprint: &str,
) -> Result<Retried, RequestError> {
    if let Some(found) = existing_retry(conn, req, fingerprint).await? {
        return Ok(found);
    }
    type JobRow = (
        String,
        Uuid,
        Option<String>,
        String,
        String,
        Option<i32>,
        Option<String>,
        Option<Uuid>,
        Option<i32>,
        Option<chrono::DateTime<chrono::Utc>>,
        Option<Uuid>,
    );
    let row: Option<JobRow> = sqlx::query_as(
        "SELECT tenant_id, knowledge_space_id, requested_by_subject_id, run_state, idempotency_key, active_slot, \
           access_channel, api_key_id, api_key_revision, api_key_expires_at, capability_grant_id \
         FROM deletion_jobs WHERE id = $1 FOR UPDATE",
    )
    .bind(req.job_id)
    .fetch_optional(&mut *conn)
    .await?;
    let Some((
        tenant,
        space,
        requester,
        run_state,
        original_key,
        active_slot,
        job_channel,
        job_key_id,
        job_key_revision,
        job_key_expires_at,
        job_grant,
    )) = row
    else {
        return Err(RequestError::NotFound(format!(
            "no deletion job {}",
            req.job_id
        )));
    };
    if run_state != "failed" {
        return Err(RequestError::NotRetryable {
            job_id: req.job_id,
            why: format!("it is {run_state}; only a failed job can be retried"),
        });
    }
    let tombstone: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM deletion_tombstones WHERE deletion_job_id = $1 AND tenant_id = $2 \
           AND knowledge_space_id = $3 AND state = 'active')",
    )
    .bind(req.job_id)
    .bind(&tenant)
    .bind(space)
    .fetch_one(&mut *conn)
    .await?;
    if active_slot != Some(1) || !tombstone {
        return Err(RequestError::NotRetryable {
            job_id: req.job_id,
            why: "it no longer holds its target (no active slot or tombstone)".into(),
        });
    }
    if req.idempotency_key == original_key {
        return Err(RequestError::Invalid(
            "a retry needs its own idempotency key, not the original request's".into(),
        ));
    }
    let audit = match &req.asker {
        Asker::Grant(grant) => {
            if job_grant != Some(*grant) {
                return Err(RequestError::RetryRefused(
                    "this deletion was not requested under that capability grant; only its original \
                     requester may retry it"
                        .into(),
                ));
            }
            active_grant(conn, &tenant, space, *grant)
                .await
                .map_err(|e| match e {
                    RequestError::Permission(m) => RequestError::RetryRefused(m),
                    other => other,
                })?;
            Audit {
                grant: Some(*grant),
                ..Audit::default()
            }
        }
        Asker::Snapshot {
            subject,
            snapshot,
            channel,
        } => {
            match req.authority {
                RetryAuthority::OriginalRequester => {
                    let Some(requester) = requester.as_deref() else {
                        return Err(RequestError::RetryRefused(
                            "this deletion was requested under a capability grant; its requester \
                             retries it under the same grant"
                                .into(),
                        ));
                    };
                    if subject != requester {
                        return Err(RequestError::RetryRefused(format!(
                            "{subject} is not the subject that requested this deletion; only the requester or an interactive owner rescue may retry it"
                        )));
                    }
                    if Some(channel) != job_channel.as_ref() {
                        return Err(RequestError::RetryRefused(format!(
                            "the requester asked on the {} channel, not {channel}",
                            job_channel.as_deref().unwrap_or("(none)")
                        )));
                    }
                }
                RetryAuthority::InteractiveOwnerRescue => {
                    if channel != "interactive" {
                        return Err(RequestError::RetryRefused(
                            "an owner rescue must come from the interactive channel".into(),
                        ));
                    }
                }
            }
            let snap = valid_snapshot(
                conn,
                &tenant,
                space,
                *snapshot,
                subject,
                channel,
                match req.authority {
                    RetryAuthority::OriginalRequester => Access::Write,
                    RetryAuthority::InteractiveOwnerRescue => Access::Owner,
                },
            )
            .await
            .map_err(|e| match e {
                RequestError::Permission(m) => RequestError::RetryRefused(m),
                other => other,
            })?;
            match req.authority {
                RetryAuthority::InteractiveOwnerRescue if snap.api_key_id.is_some() => {
                    return Err(RequestError::RetryRefused(
                        "an owner rescue cannot use an API key".into(),
                    ));
                }
                RetryAuthority::OriginalRequester
                    if (
                        snap.api_key_id,
                        snap.api_key_revision,
                        snap.api_key_expires_at,
                    ) != (job_key_id, job_key_revision, job_key_expires_at) =>
                {
                    return Err(RequestError::RetryRefused(
                        "the requester's retry must use the API key binding of the original request"
                            .into(),
                    ));
                }
                _ => {}
            }
            Audit {
                grant: None,
                actor: Some(subject.clone()),
                snapshot: Some(*snapshot),
                revision: Some(snap.revision),
                channel: Some(channel.clone()),
                api_key_id: snap.api_key_id,
                api_key_revision: snap.api_key_revision,
                api_key_expires_at: snap.api_key_expires_at,
            }
        }
    };
    let revision: i32 = sqlx::query_scalar(
        "SELECT coalesce(max(delivery_revision), 0) + 1 FROM deletion_outbox WHERE deletion_job_id = $1",
    )
    .bind(req.job_id)
    .fetch_one(&mut *conn)
    .await?;
    // Close any outbox row still out for delivery: the new revision is the only live one.
    sqlx::query(
        "UPDATE deletion_outbox SET status = 'dead', lock_token = NULL, locked_by = NULL, locked_until = NULL, \
           last_error = coalesce(last_error, 'superseded by a manual retry'), updated_at = now() \
         WHERE deletion_job_id = $1 AND status IN ('pending', 'dispatching', 'dispatched', 'leased')",
    )
    .bind(req.job_id)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "UPDATE deletion_job_items SET status = 'pending', attempts = 0, max_attempts = max_attempts + 1, \
           completed_at = NULL, next_attempt_at = NULL, last_error_code = NULL, last_error_message = NULL, \
           row_version = row_version + 1, updated_at = now() \
         WHERE deletion_job_id = $1 AND status = 'dead'",
    )
    .bind(req.job_id)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "UPDATE deletion_jobs SET run_state = 'dispatch_pending', queue_job_id = NULL, retry_at = NULL, \
           max_execution_attempts = greatest(max_execution_attempts, execution_attempts + 1), \
           last_error_code = NULL, last_error_message = NULL, row_version = row_version + 1, updated_at = now() \
         WHERE id = $1 AND run_state = 'failed'",
    )
    .bind(req.job_id)
    .execute(&mut *conn)
    .await?;
    let outbox_id = Uuid::now_v7();
    insert_outbox(
        conn,
        outbox_id,
        req.job_id,
        revision,
        &req.idempotency_key,
        fingerprint,
    )
    .await?;
    sqlx::query(
        r#"INSERT INTO deletion_retry_audits (id, deletion_job_id, outbox_id, tenant_id, knowledge_space_id,
             retry_authority, actor_subject_id, permission_snapshot_id, permission_snapshot_revision, access_channel,
             api_key_id, api_key_revision, api_key_expires_at, capability_grant_id, request_idempotency_key,
             request_fingerprint, created_at)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, now())"#,
    )
    .bind(Uuid::now_v7())
    .bind(req.job_id)
    .bind(outbox_id)
    .bind(&tenant)
    .bind(space)
    .bind(req.authority.as_str())
    .bind(&audit.actor)
    .bind(audit.snapshot)
    .bind(audit.revision)
    .bind(&audit.channel)
    .bind(audit.api_key_id)
    .bind(audit.api_key_revision)
    .bind(audit.api_key_expires_at)
    .bind(audit.grant)
    .bind(&req.idempotency_key)
    .bind(fingerprint)
    .execute(&mut *conn)
    .await?;
    Ok(Retried {
        job_id: req.job_id,
        outbox_id,
        delivery_revision: revision,
        created: true,
    })
}
