//! Publications: which document generations a knowledge space serves. Invariant: the space's
//! one head (`projection_set_publication_heads`) only moves by compare-and-swap on its
//! revision, to a publication row whose `metadata.members` lists, per document, the generation
//! and version served. Readers see only nodes of member generations; writers never edit a
//! publication that a head may point at, they make a new one.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::PgConnection;
use uuid::Uuid;

/// One document's served generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub generation: Uuid,
    pub version: i32,
}

/// Document id → member. Ordered, so that fingerprints are stable.
pub type Members = BTreeMap<Uuid, Member>;

/// The space's current head.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Head {
    pub publication_id: Uuid,
    pub revision: i32,
    pub members: Members,
}

/// The fingerprint of a member set: hex SHA-256 over the sorted members.
pub fn fingerprint(members: &Members) -> String {
    let mut h = Sha256::new();
    for (doc, m) in members {
        h.update(doc.as_bytes());
        h.update(m.generation.as_bytes());
        h.update(m.version.to_be_bytes());
    }
    hex::encode(h.finalize())
}

/// Reads the head of a space (tenant-scoped), locking it when `for_update`.
pub async fn head(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    for_update: bool,
) -> Result<Option<Head>, sqlx::Error> {
    let sql = if for_update {
        r#"SELECT h.publication_id, h.head_revision, p.metadata -> 'members'
           FROM projection_set_publication_heads h
           JOIN projection_set_publications p ON p.id = h.publication_id AND p.tenant_id = h.tenant_id
           WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2
           FOR UPDATE OF h"#
    } else {
        r#"SELECT h.publication_id, h.head_revision, p.metadata -> 'members'
           FROM projection_set_publication_heads h
           JOIN projection_set_publications p ON p.id = h.publication_id AND p.tenant_id = h.tenant_id
           WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2"#
    };
    let row: Option<(Uuid, i32, Option<serde_json::Value>)> = sqlx::query_as(sql)
        .bind(tenant)
        .bind(space)
        .fetch_optional(conn)
        .await?;
    Ok(row.map(|(publication_id, revision, members)| Head {
        publication_id,
        revision,
        members: members
            .and_then(|m| serde_json::from_value(m).ok())
            .unwrap_or_default(),
    }))
}

/// A new publication row (status `candidate` until a head points at it).
pub async fn create(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    members: &Members,
    metadata_extra: serde_json::Value,
) -> Result<(Uuid, String), sqlx::Error> {
    let id = Uuid::now_v7();
    let fp = fingerprint(members);
    let mut metadata = serde_json::json!({ "members": members });
    if let (Some(m), serde_json::Value::Object(extra)) = (metadata.as_object_mut(), metadata_extra)
    {
        m.extend(extra);
    }
    sqlx::query(
        r#"INSERT INTO projection_set_publications
             (id, tenant_id, knowledge_space_id, fingerprint, projection_version, status, metadata, created_at, updated_at)
           VALUES ($1, $2, $3, $4, 1, 'candidate', $5, now(), now())"#,
    )
    .bind(id)
    .bind(tenant)
    .bind(space)
    .bind(&fp)
    .bind(metadata)
    .execute(conn)
    .await?;
    Ok((id, fp))
}

/// The head moved (or appeared) since the expected revision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Moved {
    pub current: i32,
}

/// Points the head at `publication_id` if it is still at `expected` (0: no head yet). Marks the
/// publication `published` and the one it replaces `superseded`. Returns the new revision.
pub async fn swap_head(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    expected: i32,
    publication_id: Uuid,
) -> Result<Result<i32, Moved>, sqlx::Error> {
    let previous: Option<(Uuid, i32)> = if expected == 0 {
        let inserted: Option<i32> = sqlx::query_scalar(
            r#"INSERT INTO projection_set_publication_heads
                 (id, tenant_id, knowledge_space_id, publication_id, head_revision, created_at, updated_at)
               VALUES (gen_random_uuid(), $1, $2, $3, 1, now(), now())
               ON CONFLICT (tenant_id, knowledge_space_id) DO NOTHING
               RETURNING head_revision"#,
        )
        .bind(tenant)
        .bind(space)
        .bind(publication_id)
        .fetch_optional(&mut *conn)
        .await?;
        if inserted.is_none() {
            return Ok(Err(Moved {
                current: current_revision(conn, tenant, space).await?,
            }));
        }
        None
    } else {
        let row: Option<(Uuid, i32)> = sqlx::query_as(
            r#"WITH old AS (
                 SELECT publication_id FROM projection_set_publication_heads
                 WHERE tenant_id = $1 AND knowledge_space_id = $2 AND head_revision = $3 FOR UPDATE
               )
               UPDATE projection_set_publication_heads h
               SET publication_id = $4, head_revision = h.head_revision + 1, updated_at = now()
               FROM old
               WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2 AND h.head_revision = $3
               RETURNING old.publication_id, h.head_revision"#,
        )
        .bind(tenant)
        .bind(space)
        .bind(expected)
        .bind(publication_id)
        .fetch_optional(&mut *conn)
        .await?;
        match row {
            Some(r) => Some(r),
            None => {
                return Ok(Err(Moved {
                    current: current_revision(conn, tenant, space).await?,
                }))
            }
        }
    };
    let fp: String = sqlx::query_scalar(
        "UPDATE projection_set_publications SET status = 'published', updated_at = now() \
         WHERE id = $1 AND tenant_id = $2 AND knowledge_space_id = $3 RETURNING fingerprint",
    )
    .bind(publication_id)
    .bind(tenant)
    .bind(space)
    .fetch_one(&mut *conn)
    .await?;
    let revision = match previous {
        Some((old, rev)) => {
            sqlx::query(
                "UPDATE projection_set_publications SET status = 'superseded', superseded_by_fingerprint = $4, \
                   updated_at = now() WHERE id = $1 AND tenant_id = $2 AND knowledge_space_id = $3 AND id <> $5",
            )
            .bind(old)
            .bind(tenant)
            .bind(space)
            .bind(&fp)
            .bind(publication_id)
            .execute(&mut *conn)
            .await?;
            rev
        }
        None => 1,
    };
    Ok(Ok(revision))
}

async fn current_revision(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<i32, sqlx::Error> {
    Ok(sqlx::query_scalar(
        "SELECT head_revision FROM projection_set_publication_heads WHERE tenant_id = $1 AND knowledge_space_id = $2",
    )
    .bind(tenant)
    .bind(space)
    .fetch_optional(conn)
    .await?
    .unwrap_or(0))
}

/// SQL condition that keeps only nodes (alias `n`) served by the space's current head, for
/// tenant `$1` and space `$2`. Use inside a query over `knowledge_nodes n`.
pub const PUBLISHED_NODE_FILTER: &str = r#"n.tenant_id = $1 AND n.knowledge_space_id = $2 AND EXISTS (
    SELECT 1 FROM projection_set_publication_heads h
    JOIN projection_set_publications p ON p.id = h.publication_id AND p.tenant_id = h.tenant_id
    WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2
      AND (p.metadata -> 'members' -> (n.document_asset_id::text) ->> 'generation')::uuid = n.publication_generation_id)"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_depends_on_members_not_order_of_insertion() {
        let (a, b) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let m1 = Member {
            generation: Uuid::from_u128(10),
            version: 1,
        };
        let m2 = Member {
            generation: Uuid::from_u128(20),
            version: 3,
        };
        let mut x = Members::new();
        x.insert(a, m1);
        x.insert(b, m2);
        let mut y = Members::new();
        y.insert(b, m2);
        y.insert(a, m1);
        assert_eq!(fingerprint(&x), fingerprint(&y));
        assert_eq!(fingerprint(&x).len(), 64);
        y.insert(b, Member { version: 4, ..m2 });
        assert_ne!(fingerprint(&x), fingerprint(&y));
    }
}
