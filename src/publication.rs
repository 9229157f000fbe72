//! Publications: what a knowledge space serves, in the platform's own read model. A publication
//! (`projection_set_publications`) lists its components in `projection_set_publication_members`
//! (index projections, outlines, multimodal manifests, knowledge paths, graph rows, each of one
//! generation); the space's one head (`projection_set_publication_heads`) names the publication
//! readers use. Invariant: the head only moves by compare-and-swap on its revision (a first head
//! has the space's id as its own id and revision 1), to a publication that is `published`, and
//! the publication it replaces becomes `superseded` with the new fingerprint; a publication a
//! head has pointed at is never given other members; a compile's publication is bound to its
//! profile tuple ([`binding`]) in the transaction that moves the head to it.

pub mod binding;
mod read_sql;
mod write;

pub use read_sql::{DENSE_READ_SQL, FTS_READ_SQL};
pub use write::{
    deletion_fingerprint, insert, publish, publish_excluding, set_members, swap_head, transition,
    Moved, Refused,
};

use std::collections::BTreeMap;

use serde::Serialize;
use sqlx::PgConnection;
use uuid::Uuid;

/// The `component_type` of a publication member.
pub const INDEX_PROJECTION: &str = "index-projection";
pub const DOCUMENT_OUTLINE: &str = "document-outline";
pub const MULTIMODAL_MANIFEST: &str = "multimodal-manifest";
pub const KNOWLEDGE_PATH: &str = "knowledge-path";
pub const GRAPH_ENTITY: &str = "graph-entity";
pub const GRAPH_RELATION: &str = "graph-relation";

/// The space's current head and the publication it names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Head {
    pub publication_id: Uuid,
    pub revision: i32,
    pub fingerprint: String,
    pub status: String,
    pub projection_version: i32,
}

/// One member row of a publication.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Member {
    pub component_type: String,
    pub component_key: Uuid,
    pub generation_id: Uuid,
    pub document_asset_id: Option<Uuid>,
}

/// Reads the head of a space (tenant-scoped), locking the head row when `for_update`.
///
/// The lock is taken by a statement on the head table alone, and the head is then read by a
/// statement of its own: a locking read that joins the publication would, after waiting for a
/// concurrent publisher, see the moved head row but not the publication it now names (a
/// read-committed re-check only re-reads the locked row), and find no head at all.
pub async fn head(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    for_update: bool,
) -> Result<Option<Head>, sqlx::Error> {
    if for_update && lock_head_row(conn, tenant, space).await?.is_none() {
        return Ok(None);
    }
    let row: Option<(Uuid, i32, String, String, i32)> = sqlx::query_as(
        "SELECT h.publication_id, h.head_revision, p.fingerprint::text, p.status::text, p.projection_version \
         FROM projection_set_publication_heads h \
         JOIN projection_set_publications p ON p.id = h.publication_id AND p.tenant_id = h.tenant_id \
           AND p.knowledge_space_id = h.knowledge_space_id \
         WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2",
    )
    .bind(tenant)
    .bind(space)
    .fetch_optional(conn)
    .await?;
    Ok(row.map(
        |(publication_id, revision, fingerprint, status, projection_version)| Head {
            publication_id,
            revision,
            fingerprint,
            status,
            projection_version,
        },
    ))
}

/// What a bounded wait for the head lock found.
#[derive(Debug)]
pub enum Locked {
    /// The head row is locked by this transaction; or the space has no head yet, and this
    /// transaction holds [`HEAD_CREATE_LOCK_CLASS`], so no other publisher can create one first.
    Held(Option<Head>),
    /// Another transaction held the head row for longer than the wait.
    Busy,
}

/// Reads and locks the head of a space like `head(.., true)`, but waits at most `wait` for a
/// publisher that holds it. Publishes of one space are serialized on this lock; a caller that
/// also holds its job row must not queue behind them for longer than its heartbeat can wait,
/// so after `wait` it gets `Busy` (the transaction is still usable: the wait ran under a
/// savepoint, rolled back on timeout) and can end its slice with a cooperative wait.
pub async fn lock_head_within(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    wait: std::time::Duration,
) -> Result<Locked, sqlx::Error> {
    let wait = crate::db::LockWait::begin(conn, wait).await?;
    let locked = lock_or_queue_to_create(conn, tenant, space).await;
    match wait.end(conn, locked).await? {
        Some(Some(_)) => Ok(Locked::Held(head(conn, tenant, space, false).await?)),
        Some(None) => Ok(Locked::Held(None)),
        None => Ok(Locked::Busy),
    }
}

/// The advisory-lock class (with `hashtext(space id)`) that the publishers of a space without a
/// head queue on, so that one of them creates the first head and the others then find it.
pub const HEAD_CREATE_LOCK_CLASS: i32 = 7_038_581;

/// Locks the head row. A space without a head has no row to lock, so its first publishers would
/// all compose against revision 0 and all but one would lose the compare-and-swap, each losing
/// an attempt and a retry's backoff (the whole tail of a bulk upload into a new space). They
/// queue on [`HEAD_CREATE_LOCK_CLASS`] instead and read again once they hold it. Publishers of
/// a space with a head never take that lock, so the two locks are never waited on in opposite
/// orders.
async fn lock_or_queue_to_create(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<Option<i32>, sqlx::Error> {
    let locked = lock_head_row(conn, tenant, space).await?;
    if locked.is_some() {
        return Ok(locked);
    }
    sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
        .bind(HEAD_CREATE_LOCK_CLASS)
        .bind(space.to_string())
        .execute(&mut *conn)
        .await?;
    lock_head_row(conn, tenant, space).await
}

/// Locks the space's head row; its revision, or `None` when the space has no head.
async fn lock_head_row(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<Option<i32>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT head_revision FROM projection_set_publication_heads \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .fetch_optional(conn)
    .await
}

/// The members of a publication, in the platform's order (component type, then key). Looked up
/// by publication, which names one space, not by tenant first: two of the platform's indexes
/// lead with (tenant, space), and without statistics (a new database, a first bulk upload) the
/// planner may take either and scan every member of the space.
pub async fn members(
    conn: &mut PgConnection,
    space: Uuid,
    publication: Uuid,
) -> Result<Vec<Member>, sqlx::Error> {
    let rows: Vec<(String, Uuid, Uuid, Option<Uuid>)> = sqlx::query_as(
        "SELECT component_type::text, component_key, generation_id, document_asset_id \
         FROM projection_set_publication_members \
         WHERE publication_id = $1 AND knowledge_space_id = $2 \
         ORDER BY component_type, component_key",
    )
    .bind(publication)
    .bind(space)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(
            |(component_type, component_key, generation_id, document_asset_id)| Member {
                component_type,
                component_key,
                generation_id,
                document_asset_id,
            },
        )
        .collect())
}

/// What a publication serves of one document: the generation of its outline member and the
/// document version that outline was built from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Served {
    pub generation: Uuid,
    pub version: i32,
}

/// Document id → what the publication serves of it.
pub type Documents = BTreeMap<Uuid, Served>;

/// The documents a publication serves.
pub async fn documents(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    publication: Uuid,
) -> Result<Documents, sqlx::Error> {
    let rows: Vec<(Uuid, Uuid, i32)> = sqlx::query_as(
        "SELECT m.document_asset_id, m.generation_id, o.version FROM projection_set_publication_members m \
         JOIN document_outlines o ON o.id = m.component_key AND o.knowledge_space_id = m.knowledge_space_id \
           AND o.publication_generation_id = m.generation_id AND o.document_asset_id = m.document_asset_id \
         WHERE m.tenant_id = $1 AND m.knowledge_space_id = $2 AND m.publication_id = $3 \
           AND m.component_type = 'document-outline'",
    )
    .bind(tenant)
    .bind(space)
    .bind(publication)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(doc, generation, version)| {
            (
                doc,
                Served {
                    generation,
                    version,
                },
            )
        })
        .collect())
}

/// Whether a publication has any member of one of `documents`.
pub async fn serves_any(
    conn: &mut PgConnection,
    space: Uuid,
    publication: Uuid,
    documents: &[Uuid],
) -> Result<bool, sqlx::Error> {
    // By publication first, like [`members`].
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM projection_set_publication_members \
           WHERE publication_id = $1 AND knowledge_space_id = $2 AND document_asset_id = ANY($3))",
    )
    .bind(publication)
    .bind(space)
    .bind(documents)
    .fetch_one(conn)
    .await
}
