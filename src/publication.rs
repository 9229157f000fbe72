//! Publications: what a knowledge space serves, in the platform's own read model. A publication
//! (`projection_set_publications`) lists its components in `projection_set_publication_members`
//! (index projections, outlines, multimodal manifests, knowledge paths, graph rows, each of one
//! generation); the space's one head (`projection_set_publication_heads`) names the publication
//! readers use. Invariant: the head only moves by compare-and-swap on its revision (a first head
//! has the space's id as its own id and revision 1), to a publication that is `published`, and
//! the publication it replaces becomes `superseded` with the new fingerprint; a publication a
//! head has pointed at is never given other members.

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
    if for_update {
        let locked: Option<i32> = sqlx::query_scalar(
            "SELECT head_revision FROM projection_set_publication_heads \
             WHERE tenant_id = $1 AND knowledge_space_id = $2 FOR UPDATE",
        )
        .bind(tenant)
        .bind(space)
        .fetch_optional(&mut *conn)
        .await?;
        if locked.is_none() {
            return Ok(None);
        }
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
    /// The head row is locked by this transaction (or the space has no head yet).
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
    let before: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
        .fetch_one(&mut *conn)
        .await?;
    sqlx::query("SAVEPOINT kfs_head_lock")
        .execute(&mut *conn)
        .await?;
    sqlx::query("SELECT set_config('lock_timeout', $1, true)")
        .bind(format!("{}ms", wait.as_millis().max(1)))
        .execute(&mut *conn)
        .await?;
    let locked = sqlx::query_scalar::<_, i32>(
        "SELECT head_revision FROM projection_set_publication_heads \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .fetch_optional(&mut *conn)
    .await;
    match locked {
        Ok(found) => {
            sqlx::query("SELECT set_config('lock_timeout', $1, true)")
                .bind(&before)
                .execute(&mut *conn)
                .await?;
            sqlx::query("RELEASE SAVEPOINT kfs_head_lock")
                .execute(&mut *conn)
                .await?;
            Ok(Locked::Held(match found {
                Some(_) => head(conn, tenant, space, false).await?,
                None => None,
            }))
        }
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => {
            // Rolling back to the savepoint also undoes the set_config.
            sqlx::query("ROLLBACK TO SAVEPOINT kfs_head_lock")
                .execute(&mut *conn)
                .await?;
            Ok(Locked::Busy)
        }
        Err(e) => Err(e),
    }
}

/// The members of a publication, in the platform's order (component type, then key).
pub async fn members(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    publication: Uuid,
) -> Result<Vec<Member>, sqlx::Error> {
    let rows: Vec<(String, Uuid, Uuid, Option<Uuid>)> = sqlx::query_as(
        "SELECT component_type::text, component_key, generation_id, document_asset_id \
         FROM projection_set_publication_members \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND publication_id = $3 \
         ORDER BY component_type, component_key",
    )
    .bind(tenant)
    .bind(space)
    .bind(publication)
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
    tenant: &str,
    space: Uuid,
    publication: Uuid,
    documents: &[Uuid],
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM projection_set_publication_members \
           WHERE tenant_id = $1 AND knowledge_space_id = $2 AND publication_id = $3 \
             AND document_asset_id = ANY($4))",
    )
    .bind(tenant)
    .bind(space)
    .bind(publication)
    .bind(documents)
    .fetch_one(conn)
    .await
}

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
/// `excluded` documents (every member when `excluded` is `None`), as a deletion does. Returns
/// `Ok(None)` when there is no head or nothing to exclude.
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
        None => !members(conn, tenant, space, h.publication_id)
            .await?
            .is_empty(),
        Some(docs) => serves_any(conn, tenant, space, h.publication_id, docs).await?,
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
    if let Some(docs) = excluded {
        sqlx::query(
            "INSERT INTO projection_set_publication_members (tenant_id, knowledge_space_id, publication_id, \
               component_type, component_key, generation_id, document_asset_id, created_at) \
             SELECT s.tenant_id, s.knowledge_space_id, $3, s.component_type, s.component_key, s.generation_id, \
               s.document_asset_id, s.created_at \
             FROM projection_set_publication_members s \
             WHERE s.tenant_id = $1 AND s.knowledge_space_id = $2 AND s.publication_id = $4 \
               AND (s.document_asset_id IS NULL OR s.document_asset_id <> ALL($5))",
        )
        .bind(tenant)
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
/// Returns how many members the publication has.
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
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND publication_id = $3",
    )
    .bind(tenant)
    .bind(space)
    .bind(publication)
    .execute(&mut *conn)
    .await?;
    let mut total = 0;
    if let Some(from) = inherit {
        total += sqlx::query(
            "INSERT INTO projection_set_publication_members (tenant_id, knowledge_space_id, publication_id, \
               component_type, component_key, generation_id, document_asset_id, created_at) \
             SELECT s.tenant_id, s.knowledge_space_id, $3, s.component_type, s.component_key, s.generation_id, \
               s.document_asset_id, now() \
             FROM projection_set_publication_members s \
             WHERE s.tenant_id = $1 AND s.knowledge_space_id = $2 AND s.publication_id = $4 \
               AND (s.document_asset_id IS NULL OR s.document_asset_id IS DISTINCT FROM $5) \
             ON CONFLICT (publication_id, component_type, component_key) DO NOTHING",
        )
        .bind(tenant)
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
/// first head has the space's id as its id and revision 1). Only the head row changes here; the
/// publications' statuses are the caller's, in the same transaction. Returns the new revision.
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
             VALUES ($2, $1, $2, $3, 1, now(), now()) \
             ON CONFLICT (tenant_id, knowledge_space_id) DO NOTHING \
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
               updated_at = now() \
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

/// Publishes `publication` in place of the space's head at revision `expected`: the publication
/// goes `from` → `published` (through `validating` when it was a candidate), the old head's
/// publication becomes `superseded` by its fingerprint, and the head moves by compare-and-swap.
/// On `Err(Moved)` nothing was written that the caller's transaction should keep.
pub async fn publish(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    expected: i32,
    publication: Uuid,
    fingerprint: &str,
) -> Result<Result<i32, Moved>, sqlx::Error> {
    let old = head(conn, tenant, space, true).await?;
    let current = old.as_ref().map_or(0, |h| h.revision);
    if current != expected {
        return Ok(Err(Moved { current }));
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
    swap_head(conn, tenant, space, expected, publication).await
}

/// The read paths' shared parts: the selected columns, the joins from a projection to its
/// node, artifact, document and the publication member that serves it, and the filter that
/// keeps only parsed, active documents whose source is not being deleted.
macro_rules! read_columns {
    () => {
        "SELECT p.id AS projection_id, n.id AS node_id, n.document_asset_id, pa.version AS document_version,
       n.text, n.source_location, da.filename,\n"
    };
}
macro_rules! read_joins {
    () => {
        r#"FROM index_projections p
JOIN knowledge_nodes n ON n.id = p.node_id AND n.knowledge_space_id = p.knowledge_space_id
     AND n.publication_generation_id IS NOT DISTINCT FROM p.publication_generation_id
JOIN parse_artifacts pa ON pa.id = n.parse_artifact_id AND pa.document_asset_id = n.document_asset_id
     AND pa.artifact_hash = n.artifact_hash
JOIN document_assets da ON da.id = n.document_asset_id AND da.knowledge_space_id = n.knowledge_space_id
JOIN projection_set_publications retrieval_pub ON retrieval_pub.tenant_id = $3
     AND retrieval_pub.knowledge_space_id = p.knowledge_space_id AND retrieval_pub.id = $4
     AND retrieval_pub.status IN ('published', 'superseded')
JOIN projection_set_publication_members pm ON pm.tenant_id = retrieval_pub.tenant_id
     AND pm.knowledge_space_id = retrieval_pub.knowledge_space_id AND pm.publication_id = retrieval_pub.id
     AND pm.component_type = 'index-projection' AND pm.component_key = p.id
     AND pm.generation_id = p.publication_generation_id AND pm.document_asset_id = n.document_asset_id
"#
    };
}
macro_rules! read_live_documents {
    () => {
        r#"  AND da.parser_status = 'parsed' AND da.lifecycle_state = 'active'
  AND (da.source_id IS NULL OR EXISTS (SELECT 1 FROM sources s WHERE s.id = da.source_id
       AND s.knowledge_space_id = da.knowledge_space_id AND s.status <> 'deleting' AND s.deletion_job_id IS NULL))
"#
    };
}

/// The platform's full-text read path, as its retrieval runs it: from the named publication
/// (`$4`, which must be `published` or `superseded`) through its `index-projection` members to
/// `ready` `fts` projections and their nodes, of parsed, active documents whose source (if any)
/// is not being deleted, and only nodes whose permission scope the reader's scopes (`$5`, a
/// JSON array) cover. `$1` space, `$2` normalised query text, `$3` tenant. Rows: projection id,
/// node id, document id, document version, node text, node source location, score.
pub const FTS_READ_SQL: &str = concat!(
    "\n",
    read_columns!(),
    r#"       ts_rank(p.fts_document, plainto_tsquery('simple', $2))::float8 AS score
"#,
    read_joins!(),
    r#"WHERE p.knowledge_space_id = $1 AND p.type = 'fts' AND p.status = 'ready'
  AND p.fts_document @@ plainto_tsquery('simple', $2)
"#,
    read_live_documents!(),
    r#"  AND (jsonb_array_length(n.permission_scope) = 0 OR $5::jsonb @> n.permission_scope)
ORDER BY score DESC, n.id
"#
);

/// The platform's dense read path over the same publication: `ready` `dense-vector`
/// projections of vector space `$6` and dimension `$5`, nearest to `$2` (the query vector as
/// JSON text) first. `$1` space, `$3` tenant, `$4` publication, `$7` reader scopes.
pub const DENSE_READ_SQL: &str = concat!(
    "\n",
    read_columns!(),
    r#"       (1 - (p.dense_vector <=> $2::vector))::float8 AS score
"#,
    read_joins!(),
    r#"WHERE p.knowledge_space_id = $1 AND p.type = 'dense-vector' AND p.status = 'ready'
  AND p.model = $6 AND p.dense_vector IS NOT NULL AND vector_dims(p.dense_vector) = $5
"#,
    read_live_documents!(),
    r#"  AND (jsonb_array_length(n.permission_scope) = 0 OR $7::jsonb @> n.permission_scope)
ORDER BY p.dense_vector <=> $2::vector, n.id
"#
);
