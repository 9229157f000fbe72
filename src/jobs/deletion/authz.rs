//! Who may request or retry a deletion: the checks of text, channels and permission snapshots
//! shared by requests and retries. Invariant: every check fails closed — a snapshot serves only
//! if it belongs to the tenant, space, subject and channel, is neither revoked nor expired, still
//! revalidates against the space's members, access policy, API access and API key, and its role
//! grants the access asked for; a check reads and never writes.

use sha2::{Digest, Sha256};
use sqlx::PgConnection;
use uuid::Uuid;

use super::ask::RequestError;

pub(crate) fn sha256_hex(s: &str) -> String {
    hex::encode(Sha256::digest(s.as_bytes()))
}

const CHANNELS: [&str; 4] = ["interactive", "service_api", "mcp", "agent"];

pub(super) fn check_text(what: &str, v: &str, max: usize) -> Result<(), RequestError> {
    if v.trim().is_empty() {
        return Err(RequestError::Invalid(format!("{what} is empty")));
    }
    if v.len() > max {
        return Err(RequestError::Invalid(format!(
            "{what} is longer than {max} bytes"
        )));
    }
    Ok(())
}

pub(super) fn check_channel(c: &str) -> Result<(), RequestError> {
    if CHANNELS.contains(&c) {
        Ok(())
    } else {
        Err(RequestError::Invalid(format!(
            "access channel {c:?} is not one of interactive, service_api, mcp, agent"
        )))
    }
}

pub(super) fn is_unique_violation(e: &sqlx::Error, constraint: &str) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("23505") && d.constraint() == Some(constraint))
}

/// What a deletion may need of the requester's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Access {
    /// An owner or an editor (sources, documents, a requester's retry).
    Write,
    /// An owner (a space; an owner rescue).
    Owner,
}

/// A permission snapshot that revalidated now.
pub(super) struct Snapshot {
    pub revision: i32,
    pub api_key_id: Option<Uuid>,
    pub api_key_revision: Option<i32>,
    pub api_key_expires_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// Loads the snapshot, says precisely why it does not serve (another subject or channel,
/// revoked, expired), revalidates it as the platform does (member, policy, API access and API key
/// revisions unchanged, visibility) and checks that its role grants `need`.
pub(super) async fn valid_snapshot(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    snapshot: Uuid,
    subject: &str,
    channel: &str,
    need: Access,
) -> Result<Snapshot, RequestError> {
    type Row = (
        String,
        String,
        String,
        bool,
        bool,
        Option<Uuid>,
        Option<i32>,
        Option<chrono::DateTime<chrono::Utc>>,
    );
    let row: Option<Row> = sqlx::query_as(
        "SELECT subject_id::text, access_channel::text, status::text, revoked_at IS NOT NULL, expires_at <= now(), \
           api_key_id, api_key_revision, api_key_expires_at \
         FROM knowledge_space_permission_snapshots WHERE tenant_id = $1 AND knowledge_space_id = $2 AND id = $3",
    )
    .bind(tenant)
    .bind(space)
    .bind(snapshot)
    .fetch_optional(&mut *conn)
    .await?;
    let Some((
        p_subject,
        p_channel,
        status,
        revoked,
        expired,
        api_key_id,
        api_key_revision,
        api_key_expires_at,
    )) = row
    else {
        return Err(RequestError::Permission(format!(
            "no permission snapshot {snapshot} in this tenant and space"
        )));
    };
    if p_subject != subject {
        return Err(RequestError::Permission(format!(
            "permission snapshot {snapshot} belongs to another subject"
        )));
    }
    if p_channel != channel {
        return Err(RequestError::Permission(format!(
            "permission snapshot {snapshot} was issued for the {p_channel} channel, not {channel}"
        )));
    }
    if status == "revoked" || revoked {
        return Err(RequestError::Permission(format!(
            "permission snapshot {snapshot} is revoked"
        )));
    }
    if status == "expired" || expired {
        return Err(RequestError::Permission(format!(
            "permission snapshot {snapshot} has expired"
        )));
    }
    let Some(valid) =
        crate::access::revalidate(conn, tenant, space, snapshot, subject, channel).await?
    else {
        return Err(RequestError::Permission(format!(
            "permission snapshot {snapshot} no longer holds: the membership, access policy, API access or API key changed"
        )));
    };
    let granted = match need {
        Access::Write => matches!(valid.role.as_str(), "owner" | "editor"),
        Access::Owner => valid.role == "owner",
    };
    if !granted {
        let what = match need {
            Access::Write => "an owner or an editor",
            Access::Owner => "an owner",
        };
        return Err(RequestError::Permission(format!(
            "permission snapshot {snapshot} has the role {}; deleting this needs {what}",
            valid.role
        )));
    }
    Ok(Snapshot {
        revision: valid.revision,
        api_key_id,
        api_key_revision,
        api_key_expires_at,
    })
}
