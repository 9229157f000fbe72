//! Writing publications and moving the head. Invariant: the head row changes only in
//! [`swap_head`], by compare-and-swap on its revision (a first head has the space's id as its
//! own id and revision 1); [`publish`] and [`publish_excluding`] supersede the publication the
//! head names (with the new fingerprint) and make the new one `published` before they swap, all
//! in the caller's transaction; [`publish`] given a profile tuple binds the publication to it
//! ([`super::binding`]) after those transitions and before the swap.

use sqlx::PgConnection;
use uuid::Uuid;

use super::binding::{self, Tuple};
use super::{head, members, serves_any, Member};

/// The fingerprint of the publication a deletion job makes when it takes a target out of the
/// head `from`: the platform's formula.
pub fn deletion_fingerprint(job: Uuid, from: Uuid) -> String {
    let mut material = b"durable-deletion-publication-v1\0".to_vec();
    material.extend_from_slice(job.to_string().as_bytes());
    material.push(0);
    material.extend_from_slice(from.to_string().as_bytes());
    format!(
        "projection-set-sha256:{}",
        crate::canonical::sha256_hex(&material)
    )
}

/// Moves the head to a new `published` publication with the head's members except those of
/// `excluded` documents (every member when `excluded` is `None`), as a deletion does, copying the
/// old head's activated profile binding to the new publication. Returns `Ok(None)` when there is
/// no head or nothing to exclude.
pub async fn publish_excluding(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    deletion_job: Uuid,
    excluded: Option<&[Uuid]>,
    metadata: &serde_json::Value,
) -> Result<Option<Result<i32, Moved>>, sqlx::Error> {
    let Some(h) = head(conn, tenant, space, true).await? else {
        return Ok(None);
    };
    let affected = match excluded {
        None => !members(conn, space, h.publication_id).await?.is_empty(),
        Some(docs) => serves_any(conn, space, h.publication_id, docs).await?,
    };
    if !affected {
        return Ok(None);
    }
    let id = Uuid::new_v4();
    let fingerprint = deletion_fingerprint(deletion_job, h.publication_id);
    insert(
        conn,
        id,
        tenant,
        space,
        &fingerprint,
        h.projection_version,
        "published",
        metadata,
    )
    .await?;
    // The old head's activated profile binding goes with it, as the platform's deletion copies
    // it (a head without one moves without one).
    binding::carry(
        &mut *conn,
        tenant,
        space,
        h.publication_id,
        id,
        &fingerprint,
    )
    .await?;
    if let Some(docs) = excluded {
        sqlx::query(
            "INSERT INTO projection_set_publication_members (tenant_id, knowledge_space_id, publication_id, \
               component_type, component_key, generation_id, document_asset_id, created_at) \
             SELECT s.tenant_id, s.knowledge_space_id, $2, s.component_type, s.component_key, s.generation_id, \
               s.document_asset_id, s.created_at \
             FROM projection_set_publication_members s \
             WHERE s.publication_id = $3 AND s.knowledge_space_id = $1 \
               AND (s.document_asset_id IS NULL OR s.document_asset_id <> ALL($4))",
        )
        .bind(space)
        .bind(id)
        .bind(h.publication_id)
        .bind(docs)
        .execute(&mut *conn)
        .await?;
    }
    transition(
        conn,
        tenant,
        space,
        h.publication_id,
        "published",
        "superseded",
        Some(&fingerprint),
    )
    .await?;
    Ok(Some(swap_head(conn, tenant, space, h.revision, id).await?))
}

/// A new publication row, `status` as given (`candidate` for a compile, `published` for a row
/// that a head moves to at once). Returns false when a row with this id or this fingerprint
/// already exists.
#[allow(clippy::too_many_arguments)]
pub async fn insert(
    conn: &mut PgConnection,
    id: Uuid,
    tenant: &str,
    space: Uuid,
    fingerprint: &str,
    projection_version: i32,
    status: &str,
    metadata: &serde_json::Value,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO projection_set_publications (id, tenant_id, knowledge_space_id, fingerprint, projection_version, \
           status, superseded_by_fingerprint, metadata, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, NULL, $7, now(), now()) \
         ON CONFLICT DO NOTHING",
    )
    .bind(id)
    .bind(tenant)
    .bind(space)
    .bind(fingerprint)
    .bind(projection_version)
    .bind(status)
    .bind(metadata)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Sets a publication's members: its old members go, then the members of `inherit` (another
/// publication of the space) are copied except those of `except_document`, then `own` is added.
/// Returns how many members the publication has. Members are found by publication, not by
/// tenant first (see [`crate::publication::members`]).
pub async fn set_members(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    publication: Uuid,
    inherit: Option<Uuid>,
    except_document: Option<Uuid>,
    own: &[Member],
) -> Result<u64, sqlx::Error> {
    sqlx::query(
        "DELETE FROM projection_set_publication_members \
         WHERE publication_id = $1 AND knowledge_space_id = $2",
    )
    .bind(publication)
    .bind(space)
    .execute(&mut *conn)
    .await?;
    let mut total = 0;
    if let Some(from) = inherit {
        total += sqlx::query(
            "INSERT INTO projection_set_publication_members (tenant_id, knowledge_space_id, publication_id, \
               component_type, component_key, generation_id, document_asset_id, created_at) \
             SELECT s.tenant_id, s.knowledge_space_id, $2, s.component_type, s.component_key, s.generation_id, \
               s.document_asset_id, now() \
             FROM projection_set_publication_members s \
             WHERE s.publication_id = $3 AND s.knowledge_space_id = $1 \
               AND (s.document_asset_id IS NULL OR s.document_asset_id IS DISTINCT FROM $4) \
             ON CONFLICT (publication_id, component_type, component_key) DO NOTHING",
        )
        .bind(space)
        .bind(publication)
        .bind(from)
        .bind(except_document)
        .execute(&mut *conn)
        .await?
        .rows_affected();
    }
    for chunk in own.chunks(1000) {
        let types: Vec<&str> = chunk.iter().map(|m| m.component_type.as_str()).collect();
        let keys: Vec<Uuid> = chunk.iter().map(|m| m.component_key).collect();
        let gens: Vec<Uuid> = chunk.iter().map(|m| m.generation_id).collect();
        let docs: Vec<Option<Uuid>> = chunk.iter().map(|m| m.document_asset_id).collect();
        total += sqlx::query(
            "INSERT INTO projection_set_publication_members (tenant_id, knowledge_space_id, publication_id, \
               component_type, component_key, generation_id, document_asset_id, created_at) \
             SELECT $1, $2, $3, t.ty, t.key, t.gen, t.doc, now() \
             FROM unnest($4::varchar[], $5::uuid[], $6::uuid[], $7::uuid[]) AS t(ty, key, gen, doc) \
             ON CONFLICT (publication_id, component_type, component_key) DO NOTHING",
        )
        .bind(tenant)
        .bind(space)
        .bind(publication)
        .bind(&types)
        .bind(&keys)
        .bind(&gens)
        .bind(&docs)
        .execute(&mut *conn)
        .await?
        .rows_affected();
    }
    Ok(total)
}

/// Moves a publication from status `from` to `to` (with `superseded_by` as its
/// `superseded_by_fingerprint`). Returns whether it was in `from`.
pub async fn transition(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    id: Uuid,
    from: &str,
    to: &str,
    superseded_by: Option<&str>,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE projection_set_publications SET status = $5, superseded_by_fingerprint = $6, updated_at = now() \
         WHERE id = $3 AND tenant_id = $1 AND knowledge_space_id = $2 AND status = $4",
    )
    .bind(tenant)
    .bind(space)
    .bind(id)
    .bind(from)
    .bind(to)
    .bind(superseded_by)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// The head moved (or appeared) since the expected revision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Moved {
    pub current: i32,
}

/// Points the head at `publication` if it is still at revision `expected` (0: no head yet; the
/// first head has the space's id as its id and revision 1). Two first heads racing meet on the
/// primary key as well as on the space's unique key, so the insert yields on any conflict: the
/// loser sees the head moved, never a unique violation. Only the head row changes here; the
/// publications' statuses are the caller's, in the same transaction. Its `updated_at` is the
/// moment of the move (not the transaction's start: a long publish would otherwise look as
/// if it had moved the head long ago, and the publishes of a space are paced on it). Returns
/// the new revision.
pub async fn swap_head(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    expected: i32,
    publication: Uuid,
) -> Result<Result<i32, Moved>, sqlx::Error> {
    let revision: Option<i32> = if expected == 0 {
        sqlx::query_scalar(
            "INSERT INTO projection_set_publication_heads \
               (id, tenant_id, knowledge_space_id, publication_id, head_revision, created_at, updated_at) \
             VALUES ($2, $1, $2, $3, 1, now(), clock_timestamp()) \
             ON CONFLICT DO NOTHING \
             RETURNING head_revision",
        )
        .bind(tenant)
        .bind(space)
        .bind(publication)
        .fetch_optional(&mut *conn)
        .await?
    } else {
        sqlx::query_scalar(
            "UPDATE projection_set_publication_heads SET publication_id = $3, head_revision = $4 + 1, \
               updated_at = clock_timestamp() \
             WHERE tenant_id = $1 AND knowledge_space_id = $2 AND head_revision = $4 \
             RETURNING head_revision",
        )
        .bind(tenant)
        .bind(space)
        .bind(publication)
        .bind(expected)
        .fetch_optional(&mut *conn)
        .await?
    };
    match revision {
        Some(r) => Ok(Ok(r)),
        None => Ok(Err(Moved {
            current: head(conn, tenant, space, false)
                .await?
                .map_or(0, |h| h.revision),
        })),
    }
}

/// Why [`publish`] did not move the head.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The head moved (or appeared) since the expected revision.
    Moved(Moved),
    /// The publication already has a profile binding other than the one to be written.
    Binding(binding::Conflict),
    /// The publication is not a candidate (given up, or published already): a head never
    /// moves to it.
    NotCandidate(Option<String>),
}

/// Publishes `publication` in place of the space's head at revision `expected`: the publication
/// goes `from` → `published` (through `validating` when it was a candidate), the old head's
/// publication becomes `superseded` by its fingerprint, the publication is bound to `profiles`
/// when given (a compile's publish: the platform's content-publication binding), and the head
/// moves by compare-and-swap. On `Err` nothing was written that the caller's transaction should
/// keep.
pub async fn publish(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    expected: i32,
    publication: Uuid,
    fingerprint: &str,
    profiles: Option<&Tuple>,
) -> Result<Result<i32, Refused>, sqlx::Error> {
    let old = head(conn, tenant, space, true).await?;
    let current = old.as_ref().map_or(0, |h| h.revision);
    if current != expected {
        return Ok(Err(Refused::Moved(Moved { current })));
    }
    let status: Option<String> = sqlx::query_scalar(
        "SELECT status::text FROM projection_set_publications \
         WHERE id = $3 AND tenant_id = $1 AND knowledge_space_id = $2 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .bind(publication)
    .fetch_optional(&mut *conn)
    .await?;
    if !matches!(status.as_deref(), Some("candidate" | "validating")) {
        return Ok(Err(Refused::NotCandidate(status)));
    }
    if status.as_deref() == Some("candidate") {
        transition(
            conn,
            tenant,
            space,
            publication,
            "candidate",
            "validating",
            None,
        )
        .await?;
    }
    if let Some(h) = &old {
        if h.publication_id != publication {
            transition(
                conn,
                tenant,
                space,
                h.publication_id,
                "published",
                "superseded",
                Some(fingerprint),
            )
            .await?;
        }
    }
    transition(
        conn,
        tenant,
        space,
        publication,
        "validating",
        "published",
        None,
    )
    .await?;
    if let Some(tuple) = profiles {
        if let Err(conflict) =
            binding::bind(conn, tenant, space, publication, fingerprint, tuple).await?
        {
            return Ok(Err(Refused::Binding(conflict)));
        }
    }
    Ok(swap_head(conn, tenant, space, expected, publication)
        .await?
        .map_err(Refused::Moved))
}
