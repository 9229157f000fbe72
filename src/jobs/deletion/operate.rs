//! What operators see of deletion jobs and do to them (see [`crate::jobs::operate`]).
//! Invariant: `retry` writes only through [`super::request::retry_deletion`] or
//! [`super::request::retry_deletion_under_grant`], the CLI's functions, as the form's subject,
//! snapshot and channel or else the job's own authority (its grant, for a job requested under one).

use futures_util::future::BoxFuture;
use sqlx::PgConnection;
use uuid::Uuid;

use super::request::{
    retry_deletion, retry_deletion_under_grant, GrantRetryRequest, RequestError, RetryAuthority,
    RetryRequest,
};
use crate::jobs::operate::{Action, ActionArgs, ActionError, Input, Operations};

pub static OPERATIONS: Operations = Operations {
    checkpoints: &[
        "requested",
        "quiescing",
        "deleting_objects",
        "deleting_derived_data",
        "deleting_primary_data",
        "completed",
    ],
    history: &[
        (
            "Items by status",
            "SELECT kind, status, count(*) AS items, sum(attempts) AS attempts, \
               max(last_error_code) AS last_error_code \
             FROM deletion_job_items WHERE deletion_job_id = $1 GROUP BY 1, 2 ORDER BY 1, 2",
        ),
        (
            "Manual retries",
            "SELECT created_at, retry_authority, actor_subject_id, access_channel, request_idempotency_key \
             FROM deletion_retry_audits WHERE deletion_job_id = $1 ORDER BY created_at",
        ),
    ],
    actions: &[Action {
        name: "retry",
        applies: |state| state == "failed",
        inputs: &[
            Input::Text {
                label: "as subject",
                name: "subject",
                size: None,
                prefill: Some("requested_by_subject_id"),
                placeholder: None,
            },
            Input::Text {
                label: "permission snapshot",
                name: "snapshot",
                size: Some(38),
                prefill: Some("permission_snapshot_id"),
                placeholder: None,
            },
            Input::Checkbox {
                label: "owner rescue",
                name: "owner_rescue",
            },
        ],
        run: retry,
    }],
    failure_list_action: None,
};

/// `retry`: as the form's subject, snapshot and channel, or else the job's own; a job requested
/// under a capability grant, with no subject or snapshot in the form and no owner rescue, is
/// retried under its grant.
fn retry<'a>(
    conn: &'a mut PgConnection,
    id: Uuid,
    args: &'a ActionArgs,
) -> BoxFuture<'a, Result<String, ActionError>> {
    Box::pin(async move {
        type Job = (Option<String>, Option<Uuid>, Option<String>, Option<Uuid>);
        let job: Option<Job> = sqlx::query_as(
            "SELECT requested_by_subject_id, permission_snapshot_id, access_channel, capability_grant_id \
             FROM deletion_jobs WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(&mut *conn)
        .await
        .map_err(|e| ActionError::Failed(e.to_string()))?;
        let Some((subject, snapshot, channel, grant)) = job else {
            return Err(ActionError::NotFound(format!("no deletion job {id}")));
        };
        let key = format!("dashboard:{}", Uuid::new_v4());
        let under_grant = grant
            .filter(|_| !args.owner_rescue && args.subject.is_none() && args.snapshot.is_none());
        let r = if let Some(grant) = under_grant {
            let req = GrantRetryRequest {
                job_id: id,
                capability_grant_id: grant,
                idempotency_key: key,
            };
            retry_deletion_under_grant(conn, &req).await
        } else {
            let snapshot = match args.snapshot.as_deref() {
                None => snapshot.ok_or_else(|| {
                    ActionError::BadInput("name the permission snapshot to retry under".into())
                })?,
                Some(s) => Uuid::parse_str(s).map_err(|_| {
                    ActionError::BadInput(format!("permission snapshot id {s:?} is not a UUID"))
                })?,
            };
            let req =
                RetryRequest {
                    job_id: id,
                    actor_subject_id: args.subject.clone().or(subject).ok_or_else(|| {
                        ActionError::BadInput("name the subject to retry as".into())
                    })?,
                    permission_snapshot_id: snapshot,
                    access_channel: args
                        .channel
                        .clone()
                        .or(channel)
                        .unwrap_or_else(|| "interactive".to_owned()),
                    authority: if args.owner_rescue {
                        RetryAuthority::InteractiveOwnerRescue
                    } else {
                        RetryAuthority::OriginalRequester
                    },
                    idempotency_key: key,
                };
            retry_deletion(conn, &req).await
        };
        let r = r.map_err(|e| match e {
            RequestError::Db(_) => ActionError::Failed(e.to_string()),
            other => ActionError::Refused(other.to_string()),
        })?;
        Ok(format!(
            "deletion job {id} is retrying (delivery revision {})",
            r.delivery_revision
        ))
    })
}
