//! Whether a capability grant still authorizes the job it was requested under, decided the
//! platform's way (its capability job fence, since its migrations 0025 and 0026). Invariant:
//! fail closed — a grant authorizes only while one statement, in the caller's transaction, finds
//! its row in the job's own tenant and space with `state = 'active'` and finds the space's
//! capability fence not tombstoned; both rows are share-locked, so a revocation or a fence (an
//! UPDATE of either row) waits for the transaction that relies on the grant and is seen by the
//! next one. As in the platform, the grant's `expires_at` is not read: it bounds the admission of
//! new work, not the work already admitted.

use sqlx::PgConnection;
use uuid::Uuid;

/// A grant that authorizes: who it was issued to and the content it may read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    pub subject_id: String,
    /// The permission-scope tokens the grant admits (a JSON array of strings): content whose
    /// every scope is among them may be read.
    pub content_scope_ids: serde_json::Value,
}

/// What the fence found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Active(Grant),
    /// The grant is not active in this tenant and space; the text says why.
    Revoked(String),
    /// The space's capability fence is tombstoned: no grant of the space authorizes anything.
    Fenced,
}

impl Verdict {
    /// The grant, or why it does not authorize.
    pub fn into_result(self) -> Result<Grant, String> {
        match self {
            Verdict::Active(g) => Ok(g),
            Verdict::Revoked(why) => Err(why),
            Verdict::Fenced => Err(FENCED.to_owned()),
        }
    }
}

/// The platform's longest permission-scope token, in UTF-16 code units (how it measures text).
pub const MAX_SCOPE_UNITS: usize = 512;

/// A permission-scope token as the platform accepts one: a non-empty string without surrounding
/// whitespace, at most [`MAX_SCOPE_UNITS`] long; `None` for anything else. Pure.
pub fn scope_token(v: &serde_json::Value) -> Option<&str> {
    let s = v.as_str()?;
    (!s.is_empty() && s.trim() == s && s.encode_utf16().count() <= MAX_SCOPE_UNITS).then_some(s)
}

/// Why a fenced space's grants no longer authorize.
pub const FENCED: &str = "the knowledge space's capability fence is tombstoned";

/// The fence statement. `$1` tenant, `$2` space, `$3` grant.
const CHECK_SQL: &str = r#"
SELECT g.state::text, g.revoke_reason_code::text, g.subject_id::text, g.content_scope_ids,
       coalesce((SELECT f.tombstoned FROM capability_space_fences f
                 WHERE f.tenant_id = g.tenant_id AND f.knowledge_space_id = g.knowledge_space_id
                 FOR SHARE), false)
FROM capability_grants g
WHERE g.tenant_id = $1 AND g.knowledge_space_id = $2 AND g.grant_id = $3
FOR SHARE OF g
"#;

type Row = (String, Option<String>, String, serde_json::Value, bool);

/// Checks `grant` for a job of `tenant` and `space`, locking what it read until the caller's
/// transaction ends.
pub async fn check(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    grant: Uuid,
) -> Result<Verdict, sqlx::Error> {
    let row: Option<Row> = sqlx::query_as(CHECK_SQL)
        .bind(tenant)
        .bind(space)
        .bind(grant)
        .fetch_optional(conn)
        .await?;
    Ok(decide(grant, row))
}

/// The verdict on the row the fence statement read. Pure.
fn decide(grant: Uuid, row: Option<Row>) -> Verdict {
    let Some((state, reason, subject_id, content_scope_ids, tombstoned)) = row else {
        return Verdict::Revoked(format!(
            "capability grant {grant} does not exist in this tenant and knowledge space"
        ));
    };
    if tombstoned {
        return Verdict::Fenced;
    }
    if state != "active" {
        let reason = reason.map(|r| format!(" ({r})")).unwrap_or_default();
        return Verdict::Revoked(format!("capability grant {grant} is {state}{reason}"));
    }
    if subject_id.is_empty() || !content_scope_ids.is_array() {
        return Verdict::Revoked(format!(
            "capability grant {grant} names no subject or no content scope"
        ));
    }
    Verdict::Active(Grant {
        subject_id,
        content_scope_ids,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_an_active_grant_of_an_unfenced_space_authorizes() {
        let id = Uuid::nil();
        let row = |state: &str, reason: Option<&str>, subject: &str, scopes, fenced| {
            Some((
                state.to_owned(),
                reason.map(str::to_owned),
                subject.to_owned(),
                scopes,
                fenced,
            ))
        };
        let active = Verdict::Active(Grant {
            subject_id: "s".into(),
            content_scope_ids: json!(["tenant:t"]),
        });
        // (row, verdict or the text a refusal contains)
        let table: Vec<(Option<Row>, Result<Verdict, &str>)> = vec![
            (
                row("active", None, "s", json!(["tenant:t"]), false),
                Ok(active),
            ),
            (
                row("active", None, "s", json!(["tenant:t"]), true),
                Ok(Verdict::Fenced),
            ),
            (
                row("revoked", Some("user_removed"), "s", json!([]), false),
                Err("is revoked (user_removed)"),
            ),
            (
                row("revoked", Some("user_removed"), "s", json!([]), true),
                Ok(Verdict::Fenced),
            ),
            (
                row("active", None, "", json!([]), false),
                Err("names no subject"),
            ),
            (
                row("active", None, "s", json!({}), false),
                Err("no content scope"),
            ),
            (None, Err("does not exist in this tenant")),
        ];
        for (input, want) in table {
            let got = decide(id, input.clone());
            match want {
                Ok(v) => assert_eq!(got, v, "{input:?}"),
                Err(text) => match got {
                    Verdict::Revoked(why) => assert!(why.contains(text), "{why}"),
                    other => panic!("{input:?}: {other:?}"),
                },
            }
        }
    }
}
