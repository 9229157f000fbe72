//! The logical-document product intents a compile attempt carries (the platform's 0022 and
//! 0041): the document revision it compiles, a settings reindex, or a chunk state change, each
//! bound to the attempt by `compilation_attempt_id`. Invariant: an intent changes state only in
//! the transaction that decides its attempt — bound when the attempt is requested, applied in the
//! publishing transaction after the head moves (revision `candidate → active` with its chunks,
//! the one active before `superseded`, the document `ready`; reindex `running → succeeded`;
//! chunk change `candidate → active`), restored when a failed attempt is retried — and every such
//! change is fenced on the document's active revision and row version it expected, so a
//! conflict rolls the whole transaction back. A disabled logical document is never compiled.

use std::collections::{HashMap, HashSet};

use serde_json::{json, Value};
use sqlx::PgConnection;
use uuid::Uuid;

use super::steps::Attempt;
use crate::jobs::JobError;

/// The code of a compilation of a disabled document.
pub const DOCUMENT_DISABLED: &str = "DOCUMENT_DISABLED";

/// The most chunks one revision gets (the platform's bound).
pub const MAX_CHUNKS: usize = 20_000;

/// Whether a logical document the asset was uploaded as is disabled (0041 `enabled = false`).
pub async fn disabled(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    asset: Uuid,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM logical_documents l JOIN document_revisions r ON r.tenant_id = l.tenant_id \
           AND r.knowledge_space_id = l.knowledge_space_id AND r.document_id = l.id \
         WHERE r.tenant_id = $1 AND r.knowledge_space_id = $2 AND r.document_asset_id = $3 AND NOT l.enabled)",
    )
    .bind(tenant)
    .bind(space)
    .bind(asset)
    .fetch_one(conn)
    .await
}

/// The first step's availability check: a disabled document fails its attempt, not retryable.
pub(crate) async fn refuse_disabled(conn: &mut PgConnection, a: &Attempt) -> Result<(), JobError> {
    if disabled(conn, &a.tenant, a.space, a.document).await? {
        return Err(JobError::fatal(
            DOCUMENT_DISABLED,
            format!("the logical document of asset {} is disabled", a.document),
        ));
    }
    Ok(())
}

/// Binds the unbound candidate revision of the asset version to a new attempt (the platform's
/// `bindCompilationAttempt` after an upload starts its compile). Returns whether one was bound.
pub async fn bind(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    asset: Uuid,
    version: i32,
    attempt: Uuid,
) -> Result<bool, sqlx::Error> {
    Ok(sqlx::query(
        "UPDATE document_revisions SET compilation_attempt_id = $5 \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND document_asset_id = $3 \
           AND document_asset_version = $4 AND state = 'candidate' AND compilation_attempt_id IS NULL",
    )
    .bind(tenant)
    .bind(space)
    .bind(asset)
    .bind(version)
    .bind(attempt)
    .execute(conn)
    .await?
    .rows_affected()
        > 0)
}

fn conflict(what: impl Into<String>) -> JobError {
    JobError::fatal(super::profiles::COMPILATION_FAILED, what)
}

/// A knowledge node of the candidate generation, as the chunks are made from it.
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkNode {
    pub id: Uuid,
    pub kind: String,
    pub metadata: Value,
}

/// Orders the candidate's nodes parent first and names each one's parent (the one `summary`
/// node whose `metadata.childNodeIds` lists it): `(index into nodes, parent)`. A node's ordinal
/// is its index. `Err` for a corrupt tree (a malformed child list, two parents, a cycle). Pure.
pub fn parent_first(nodes: &[ChunkNode]) -> Result<Vec<(usize, Option<Uuid>)>, String> {
    let index: HashMap<Uuid, usize> = nodes.iter().enumerate().map(|(i, n)| (n.id, i)).collect();
    if index.len() != nodes.len() {
        return Err("the candidate has a node id twice".into());
    }
    let mut parent: HashMap<Uuid, Uuid> = HashMap::new();
    for p in nodes {
        if p.kind != "summary" {
            continue;
        }
        let Some(children) = p.metadata.get("childNodeIds") else {
            continue;
        };
        let Some(children) = children.as_array() else {
            return Err(format!("node {} has a malformed child list", p.id));
        };
        let mut seen = HashSet::new();
        for c in children {
            let c = c
                .as_str()
                .and_then(|s| Uuid::parse_str(s).ok())
                .ok_or_else(|| format!("node {} has a malformed child list", p.id))?;
            if !seen.insert(c) || !index.contains_key(&c) {
                continue;
            }
            if c == p.id || parent.get(&c).is_some_and(|&q| q != p.id) {
                return Err(format!("node {c} has more than one parent"));
            }
            parent.insert(c, p.id);
        }
    }
    let mut children: HashMap<Uuid, Vec<usize>> = HashMap::new();
    for (i, n) in nodes.iter().enumerate() {
        if let Some(p) = parent.get(&n.id) {
            children.entry(*p).or_default().push(i);
        }
    }
    let mut order: Vec<usize> = (0..nodes.len())
        .filter(|i| !parent.contains_key(&nodes[*i].id))
        .collect();
    let mut k = 0;
    while k < order.len() {
        if let Some(c) = children.get(&nodes[order[k]].id) {
            order.extend(c.iter().copied());
        }
        k += 1;
    }
    if order.len() != nodes.len() {
        return Err("the candidate's node tree has a cycle".into());
    }
    Ok(order
        .into_iter()
        .map(|i| (i, parent.get(&nodes[i].id).copied()))
        .collect())
}

/// The platform's approximate token count of a chunk: a quarter of its trimmed length in UTF-16
/// units, rounded up, at least 1 when there is any text. Pure.
pub fn token_count(text: &str) -> i32 {
    let n = text.trim().encode_utf16().count();
    if n == 0 {
        0
    } else {
        i32::try_from(n.div_ceil(4).max(1)).unwrap_or(i32::MAX)
    }
}

/// The revision this attempt's publish activates: document, revision, and the document's active
/// revision and row version it expects.
struct RevisionFence {
    document: Uuid,
    revision: i32,
    expected_active: Option<i32>,
    expected_row_version: i32,
}

/// Applies the attempt's intents in the publishing transaction, after the head moved to
/// `publication` (`fingerprint`). Fails the attempt (the whole transaction rolls back) when an
/// intent no longer fits what it expected.
pub(crate) async fn publish(
    conn: &mut PgConnection,
    a: &Attempt,
    publication: Uuid,
    fingerprint: &str,
) -> Result<(), JobError> {
    activate(conn, a).await?;
    reindex(conn, a, publication, fingerprint).await?;
    chunk_change(conn, a, publication, fingerprint).await?;
    Ok(())
}

/// Activates the attempt's candidate revision of its logical document, if it has one (the part
/// of [`publish`] that does not name the publication). Fails the attempt when the revision no
/// longer fits what it expected.
pub(crate) async fn activate(conn: &mut PgConnection, a: &Attempt) -> Result<(), JobError> {
    let fence: Option<(Uuid, i32, Option<i32>, i32)> = sqlx::query_as(
        "SELECT document_id, revision, expected_active_revision, expected_document_row_version \
         FROM document_revisions WHERE tenant_id = $1 AND knowledge_space_id = $2 AND compilation_attempt_id = $3 \
           AND document_asset_id = $4 AND document_asset_version = $5 AND state = 'candidate' LIMIT 1 FOR UPDATE",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.id)
    .bind(a.document)
    .bind(a.version)
    .fetch_optional(&mut *conn)
    .await?;
    if let Some((document, revision, expected_active, expected_row_version)) = fence {
        let f = RevisionFence {
            document,
            revision,
            expected_active,
            expected_row_version,
        };
        chunks(conn, a, &f).await?;
        activate_revision(conn, a, &f).await?;
    }
    Ok(())
}

/// The revision activations of several attempts publishing together in one transaction (what
/// [`activate`] does for each), in a few statements: each attempt whose candidate revision no
/// longer fits what it expected (its logical document moved, is being deleted, or is revised
/// by another of `attempts` too), or whose revision would have too many chunks, is left out
/// and nothing is written for it. Returns the attempts whose revisions were activated, and
/// those without one. `Err` when a write found other rows than the reads before it (the caller
/// rolls all of it back).
pub(crate) async fn activate_many(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    attempts: &[&Attempt],
) -> Result<HashSet<Uuid>, JobError> {
    let ids: Vec<Uuid> = attempts.iter().map(|a| a.id).collect();
    let assets: Vec<Uuid> = attempts.iter().map(|a| a.document).collect();
    let versions: Vec<i32> = attempts.iter().map(|a| a.version).collect();
    let fences: Vec<(Uuid, Uuid, i32, Option<i32>, i32)> = sqlx::query_as(
        "SELECT r.compilation_attempt_id, r.document_id, r.revision, r.expected_active_revision, \
           r.expected_document_row_version \
         FROM document_revisions r \
         JOIN unnest($3::uuid[], $4::uuid[], $5::int4[]) AS x(attempt, asset, version) \
           ON r.compilation_attempt_id = x.attempt AND r.document_asset_id = x.asset \
          AND r.document_asset_version = x.version \
         WHERE r.tenant_id = $1 AND r.knowledge_space_id = $2 AND r.state = 'candidate' \
         ORDER BY r.document_id, r.revision FOR UPDATE OF r",
    )
    .bind(tenant)
    .bind(space)
    .bind(&ids)
    .bind(&assets)
    .bind(&versions)
    .fetch_all(&mut *conn)
    .await?;
    let mut by_attempt: HashMap<Uuid, RevisionFence> = HashMap::new();
    let mut per_document: HashMap<Uuid, usize> = HashMap::new();
    for (attempt, document, revision, expected_active, expected_row_version) in fences {
        *per_document.entry(document).or_default() += 1;
        by_attempt.entry(attempt).or_insert(RevisionFence {
            document,
            revision,
            expected_active,
            expected_row_version,
        });
    }
    let documents: Vec<Uuid> = per_document.keys().copied().collect();
    let current: HashMap<Uuid, (Option<i32>, i32)> = sqlx::query_as::<_, (Uuid, Option<i32>, i32)>(
        "SELECT id, active_revision, row_version FROM logical_documents \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND id = ANY($3) AND status <> 'deleting' \
           AND deletion_job_id IS NULL ORDER BY id FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .bind(&documents)
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .map(|(id, active, rv)| (id, (active, rv)))
    .collect();
    let fits = |f: &RevisionFence| {
        per_document.get(&f.document) == Some(&1)
            && current.get(&f.document) == Some(&(f.expected_active, f.expected_row_version))
    };
    let mut accepted: HashSet<Uuid> = attempts
        .iter()
        .filter(|a| by_attempt.get(&a.id).is_none_or(fits))
        .map(|a| a.id)
        .collect();
    // The chunks of the accepted revisions: their generations' nodes, parent first.
    let revised: Vec<&Attempt> = attempts
        .iter()
        .copied()
        .filter(|a| accepted.contains(&a.id) && by_attempt.contains_key(&a.id))
        .collect();
    if revised.is_empty() {
        return Ok(accepted);
    }
    let generations: Vec<Uuid> = revised.iter().map(|a| a.generation).collect();
    type Row = (Uuid, Uuid, String, String, i32, i32, Value, Value);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT n.publication_generation_id, n.id, n.kind::text, n.text, n.start_offset, n.end_offset, \
           n.source_location, n.metadata \
         FROM knowledge_nodes n JOIN unnest($2::uuid[], $3::uuid[]) AS g(generation, asset) \
           ON n.publication_generation_id = g.generation AND n.document_asset_id = g.asset \
         WHERE n.knowledge_space_id = $1 ORDER BY n.publication_generation_id, n.start_offset, n.id",
    )
    .bind(space)
    .bind(&generations)
    .bind(revised.iter().map(|a| a.document).collect::<Vec<Uuid>>())
    .fetch_all(&mut *conn)
    .await?;
    let mut nodes: HashMap<Uuid, Vec<&Row>> = HashMap::new();
    for r in &rows {
        nodes.entry(r.0).or_default().push(r);
    }
    let mut chunk = ChunkRows::default();
    let mut activated = Vec::new();
    for a in &revised {
        let f = &by_attempt[&a.id];
        let of = nodes
            .get(&a.generation)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let listed: Vec<ChunkNode> = of
            .iter()
            .map(|r| ChunkNode {
                id: r.1,
                kind: r.2.clone(),
                metadata: r.7.clone(),
            })
            .collect();
        let order = match parent_first(&listed) {
            Ok(order) if of.len() <= MAX_CHUNKS => order,
            _ => {
                accepted.remove(&a.id);
                continue;
            }
        };
        for (i, parent) in order {
            let r = of[i];
            chunk.push(
                f,
                r.1,
                parent,
                i,
                &r.3,
                json!({ "endOffset": r.5, "kind": r.2,
                "nodeMetadata": r.7, "sourceLocation": r.6, "startOffset": r.4 }),
            );
        }
        activated.push(f);
    }
    chunk.insert(conn, tenant, space).await?;
    let docs: Vec<Uuid> = activated.iter().map(|f| f.document).collect();
    let revisions: Vec<i32> = activated.iter().map(|f| f.revision).collect();
    let row_versions: Vec<i32> = activated.iter().map(|f| f.expected_row_version).collect();
    let old: Vec<(Uuid, i32)> = activated
        .iter()
        .filter_map(|f| f.expected_active.map(|r| (f.document, r)))
        .collect();
    let superseded = sqlx::query(
        "UPDATE document_revisions r SET state = 'superseded' FROM unnest($3::uuid[], $4::int4[]) AS x(document, revision) \
         WHERE r.tenant_id = $1 AND r.knowledge_space_id = $2 AND r.document_id = x.document \
           AND r.revision = x.revision AND r.state = 'active'",
    )
    .bind(tenant)
    .bind(space)
    .bind(old.iter().map(|o| o.0).collect::<Vec<Uuid>>())
    .bind(old.iter().map(|o| o.1).collect::<Vec<i32>>())
    .execute(&mut *conn)
    .await?
    .rows_affected();
    let made_active = sqlx::query(
        "UPDATE document_revisions r SET state = 'active', activated_at = now() \
         FROM unnest($3::uuid[], $4::int4[]) AS x(document, revision) \
         WHERE r.tenant_id = $1 AND r.knowledge_space_id = $2 AND r.document_id = x.document \
           AND r.revision = x.revision AND r.state = 'candidate'",
    )
    .bind(tenant)
    .bind(space)
    .bind(&docs)
    .bind(&revisions)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    let advanced = sqlx::query(
        "UPDATE logical_documents l SET active_revision = x.revision, status = 'ready', \
           row_version = l.row_version + 1, updated_at = now() \
         FROM unnest($3::uuid[], $4::int4[], $5::int4[]) AS x(document, revision, row_version) \
         WHERE l.tenant_id = $1 AND l.knowledge_space_id = $2 AND l.id = x.document \
           AND l.row_version = x.row_version AND l.status <> 'deleting' AND l.deletion_job_id IS NULL",
    )
    .bind(tenant)
    .bind(space)
    .bind(&docs)
    .bind(&revisions)
    .bind(&row_versions)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    let n = activated.len() as u64;
    if superseded != old.len() as u64 || made_active != n || advanced != n {
        return Err(conflict(
            "the revisions of the attempts publishing together changed while they were activated",
        ));
    }
    Ok(accepted)
}

/// Chunk rows of several revisions, for one insert.
#[derive(Default)]
struct ChunkRows {
    ids: Vec<Uuid>,
    documents: Vec<Uuid>,
    revisions: Vec<i32>,
    parents: Vec<Option<Uuid>>,
    ordinals: Vec<i32>,
    tokens: Vec<i32>,
    texts: Vec<String>,
    metas: Vec<Value>,
}

impl ChunkRows {
    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        f: &RevisionFence,
        id: Uuid,
        parent: Option<Uuid>,
        ordinal: usize,
        text: &str,
        meta: Value,
    ) {
        self.ids.push(id);
        self.documents.push(f.document);
        self.revisions.push(f.revision);
        self.parents.push(parent);
        self.ordinals
            .push(i32::try_from(ordinal).unwrap_or(i32::MAX));
        self.tokens.push(token_count(text));
        self.texts.push(text.to_owned());
        self.metas.push(meta);
    }

    async fn insert(
        &self,
        conn: &mut PgConnection,
        tenant: &str,
        space: Uuid,
    ) -> Result<(), sqlx::Error> {
        if self.ids.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "INSERT INTO document_revision_chunks (id, tenant_id, knowledge_space_id, document_id, document_revision, \
               parent_chunk_id, ordinal, token_count, text, system_metadata, user_metadata, created_at) \
             SELECT t.id, $1, $2, t.document, t.revision, t.parent, t.ordinal, t.tokens, t.text, t.meta, '{}'::jsonb, now() \
             FROM unnest($3::uuid[], $4::uuid[], $5::int4[], $6::uuid[], $7::int4[], $8::int4[], $9::text[], $10::jsonb[]) \
               AS t(id, document, revision, parent, ordinal, tokens, text, meta)",
        )
        .bind(tenant)
        .bind(space)
        .bind(&self.ids)
        .bind(&self.documents)
        .bind(&self.revisions)
        .bind(&self.parents)
        .bind(&self.ordinals)
        .bind(&self.tokens)
        .bind(&self.texts)
        .bind(&self.metas)
        .execute(conn)
        .await?;
        Ok(())
    }
}

/// The revision's chunks: the candidate generation's nodes of the document, in offset order,
/// parent first, each chunk's id its node's.
async fn chunks(conn: &mut PgConnection, a: &Attempt, f: &RevisionFence) -> Result<(), JobError> {
    type Row = (Uuid, String, String, i32, i32, Value, Value);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT id, kind::text, text, start_offset, end_offset, source_location, metadata FROM knowledge_nodes \
         WHERE knowledge_space_id = $1 AND document_asset_id = $2 AND publication_generation_id = $3 \
         ORDER BY start_offset, id LIMIT $4",
    )
    .bind(a.space)
    .bind(a.document)
    .bind(a.generation)
    .bind(i64::try_from(MAX_CHUNKS + 1).unwrap_or(i64::MAX))
    .fetch_all(&mut *conn)
    .await?;
    if rows.len() > MAX_CHUNKS {
        return Err(conflict(format!(
            "the document has more than {MAX_CHUNKS} chunks"
        )));
    }
    let nodes: Vec<ChunkNode> = rows
        .iter()
        .map(|r| ChunkNode {
            id: r.0,
            kind: r.1.clone(),
            metadata: r.6.clone(),
        })
        .collect();
    let order = parent_first(&nodes).map_err(conflict)?;
    for batch in order.chunks(1000) {
        let mut ids = Vec::with_capacity(batch.len());
        let mut parents = Vec::with_capacity(batch.len());
        let mut ordinals = Vec::with_capacity(batch.len());
        let mut tokens = Vec::with_capacity(batch.len());
        let mut texts = Vec::with_capacity(batch.len());
        let mut metas = Vec::with_capacity(batch.len());
        for &(i, parent) in batch {
            let (id, kind, text, start, end, location, metadata) = &rows[i];
            ids.push(*id);
            parents.push(parent);
            ordinals.push(i32::try_from(i).unwrap_or(i32::MAX));
            tokens.push(token_count(text));
            texts.push(text.clone());
            metas.push(
                json!({ "endOffset": end, "kind": kind, "nodeMetadata": metadata,
                               "sourceLocation": location, "startOffset": start }),
            );
        }
        sqlx::query(
            "INSERT INTO document_revision_chunks (id, tenant_id, knowledge_space_id, document_id, document_revision, \
               parent_chunk_id, ordinal, token_count, text, system_metadata, user_metadata, created_at) \
             SELECT t.id, $1, $2, $3, $4, t.parent, t.ordinal, t.tokens, t.text, t.meta, '{}'::jsonb, now() \
             FROM unnest($5::uuid[], $6::uuid[], $7::int4[], $8::int4[], $9::text[], $10::jsonb[]) \
               AS t(id, parent, ordinal, tokens, text, meta)",
        )
        .bind(&a.tenant)
        .bind(a.space)
        .bind(f.document)
        .bind(f.revision)
        .bind(&ids)
        .bind(&parents)
        .bind(&ordinals)
        .bind(&tokens)
        .bind(&texts)
        .bind(&metas)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// The platform's revision activation: the document (not deleting) must still be at the active
/// revision and row version the revision expected; the active revision before becomes
/// `superseded`, the candidate `active`, the document `ready` at it with its row version + 1.
async fn activate_revision(
    conn: &mut PgConnection,
    a: &Attempt,
    f: &RevisionFence,
) -> Result<(), JobError> {
    let doc: Option<(Option<i32>, i32)> = sqlx::query_as(
        "SELECT active_revision, row_version FROM logical_documents \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND id = $3 AND status <> 'deleting' \
           AND deletion_job_id IS NULL FOR UPDATE",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(f.document)
    .fetch_optional(&mut *conn)
    .await?;
    match doc {
        Some((active, rv)) if active == f.expected_active && rv == f.expected_row_version => {}
        Some((active, rv)) => {
            return Err(conflict(format!(
                "logical document {} moved to active revision {active:?} row version {rv} since revision {} \
                 expected {:?} and {}",
                f.document, f.revision, f.expected_active, f.expected_row_version
            )))
        }
        None => {
            return Err(conflict(format!(
                "logical document {} is missing or being deleted",
                f.document
            )))
        }
    }
    if let Some(old) = f.expected_active {
        let n = sqlx::query(
            "UPDATE document_revisions SET state = 'superseded' WHERE tenant_id = $1 AND knowledge_space_id = $2 \
               AND document_id = $3 AND revision = $4 AND state = 'active'",
        )
        .bind(&a.tenant)
        .bind(a.space)
        .bind(f.document)
        .bind(old)
        .execute(&mut *conn)
        .await?
        .rows_affected();
        if n != 1 {
            return Err(conflict(format!(
                "revision {old} of logical document {} is no longer active",
                f.document
            )));
        }
    }
    let activated = sqlx::query(
        "UPDATE document_revisions SET state = 'active', activated_at = now() WHERE tenant_id = $1 \
           AND knowledge_space_id = $2 AND document_id = $3 AND revision = $4 AND state = 'candidate'",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(f.document)
    .bind(f.revision)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    let advanced = sqlx::query(
        "UPDATE logical_documents SET active_revision = $4, status = 'ready', row_version = row_version + 1, \
           updated_at = now() \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND id = $3 AND row_version = $5 \
           AND status <> 'deleting' AND deletion_job_id IS NULL",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(f.document)
    .bind(f.revision)
    .bind(f.expected_row_version)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if activated != 1 || advanced != 1 {
        return Err(conflict(format!(
            "revision {} of logical document {} could not be activated",
            f.revision, f.document
        )));
    }
    Ok(())
}

/// The platform's settings mutation: a `running` reindex of the attempt activates its settings
/// revision (the active one before superseded, the settings head moved or created) and
/// `succeeds` with the publication.
async fn reindex(
    conn: &mut PgConnection,
    a: &Attempt,
    publication: Uuid,
    fingerprint: &str,
) -> Result<(), JobError> {
    let run: Option<(Uuid, i32, i32, i32)> = sqlx::query_as(
        "SELECT document_id, settings_revision, expected_settings_head_revision, row_version \
         FROM document_reindex_attempts WHERE tenant_id = $1 AND knowledge_space_id = $2 \
           AND compilation_attempt_id = $3 AND state = 'running' LIMIT 1 FOR UPDATE",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.id)
    .fetch_optional(&mut *conn)
    .await?;
    let Some((document, settings, expected_head, row_version)) = run else {
        return Ok(());
    };
    let head: Option<(i32, i32)> = sqlx::query_as(
        "SELECT active_revision, row_version FROM document_settings_heads \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND document_id = $3 FOR UPDATE",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(document)
    .fetch_optional(&mut *conn)
    .await?;
    if head.map_or(0, |h| h.0) != expected_head {
        return Err(conflict(format!(
            "the settings head of logical document {document} moved since the reindex began"
        )));
    }
    if head.is_some() {
        let n = sqlx::query(
            "UPDATE document_settings_revisions SET state = 'superseded' WHERE tenant_id = $1 \
               AND knowledge_space_id = $2 AND document_id = $3 AND revision = $4 AND state = 'active'",
        )
        .bind(&a.tenant)
        .bind(a.space)
        .bind(document)
        .bind(expected_head)
        .execute(&mut *conn)
        .await?
        .rows_affected();
        if n != 1 {
            return Err(conflict("the active settings revision changed"));
        }
    }
    let n = sqlx::query(
        "UPDATE document_settings_revisions SET state = 'active', activated_at = now() WHERE tenant_id = $1 \
           AND knowledge_space_id = $2 AND document_id = $3 AND revision = $4 AND state = 'candidate'",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(document)
    .bind(settings)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if n != 1 {
        return Err(conflict(format!(
            "settings revision {settings} of logical document {document} is not a candidate"
        )));
    }
    let moved = match head {
        Some((_, head_row_version)) => sqlx::query(
            "UPDATE document_settings_heads SET active_revision = $4, row_version = row_version + 1, updated_at = now() \
             WHERE tenant_id = $1 AND knowledge_space_id = $2 AND document_id = $3 AND row_version = $5",
        )
        .bind(&a.tenant)
        .bind(a.space)
        .bind(document)
        .bind(settings)
        .bind(head_row_version)
        .execute(&mut *conn)
        .await?
        .rows_affected(),
        None => sqlx::query(
            "INSERT INTO document_settings_heads (tenant_id, knowledge_space_id, document_id, active_revision, \
               row_version, updated_at) VALUES ($1, $2, $3, $4, 0, now())",
        )
        .bind(&a.tenant)
        .bind(a.space)
        .bind(document)
        .bind(settings)
        .execute(&mut *conn)
        .await?
        .rows_affected(),
    };
    let done = sqlx::query(
        "UPDATE document_reindex_attempts SET candidate_publication_id = $4, candidate_fingerprint = $5, \
           state = 'succeeded', active_slot = NULL, completed_at = now(), updated_at = now(), \
           row_version = row_version + 1 \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND compilation_attempt_id = $3 AND row_version = $6 \
           AND state = 'running'",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.id)
    .bind(publication)
    .bind(fingerprint)
    .bind(row_version)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if moved != 1 || done != 1 {
        return Err(conflict(format!(
            "the reindex of logical document {document} could not complete"
        )));
    }
    Ok(())
}

/// The platform's chunk mutation: the attempt's `candidate` chunk state change becomes `active`
/// with the publication, the chunk's change active before it `superseded`.
async fn chunk_change(
    conn: &mut PgConnection,
    a: &Attempt,
    publication: Uuid,
    fingerprint: &str,
) -> Result<(), JobError> {
    let change: Option<(Uuid, i32, Uuid)> = sqlx::query_as(
        "SELECT document_id, document_revision, chunk_id FROM document_chunk_state_changes \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND compilation_attempt_id = $3 AND state = 'candidate' \
         LIMIT 1 FOR UPDATE",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.id)
    .fetch_optional(&mut *conn)
    .await?;
    let Some((document, revision, chunk)) = change else {
        return Ok(());
    };
    sqlx::query(
        "UPDATE document_chunk_state_changes SET state = 'superseded' WHERE tenant_id = $1 \
           AND knowledge_space_id = $2 AND document_id = $3 AND document_revision = $4 AND chunk_id = $5 \
           AND state = 'active'",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(document)
    .bind(revision)
    .bind(chunk)
    .execute(&mut *conn)
    .await?;
    let n = sqlx::query(
        "UPDATE document_chunk_state_changes SET candidate_publication_id = $4, candidate_fingerprint = $5, \
           state = 'active', activated_at = now() \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND compilation_attempt_id = $3 AND state = 'candidate'",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.id)
    .bind(publication)
    .bind(fingerprint)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if n != 1 {
        return Err(conflict("the chunk state change could not be activated"));
    }
    Ok(())
}

/// A logical document's active revision and row version, locked, unless it is being deleted.
async fn document_at(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    id: Uuid,
) -> Result<Option<(Option<i32>, i32)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT active_revision, row_version FROM logical_documents WHERE tenant_id = $1 \
           AND knowledge_space_id = $2 AND id = $3 AND status <> 'deleting' AND deletion_job_id IS NULL \
         LIMIT 1 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .bind(id)
    .fetch_optional(conn)
    .await
}

/// Restores a failed attempt's intent for its retry, in the retry's transaction (the platform's
/// `restoreDatabaseCompilationProductIntent`): revision `failed → candidate` (and a document that
/// never had an active revision `failed → pending`), settings revision `failed → candidate` with
/// its reindex `failed|canceled → running`, or chunk change `failed → candidate`, each only while
/// the document is still where the intent expected it. `Err` names why the intent cannot be
/// retried; nothing is written then.
pub async fn restore(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    attempt: Uuid,
) -> Result<Result<(), String>, sqlx::Error> {
    let revision: Option<(Uuid, i32, String, Option<i32>, i32)> = sqlx::query_as(
        "SELECT document_id, revision, state::text, expected_active_revision, expected_document_row_version \
         FROM document_revisions WHERE tenant_id = $1 AND knowledge_space_id = $2 AND compilation_attempt_id = $3 \
         LIMIT 1 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .bind(attempt)
    .fetch_optional(&mut *conn)
    .await?;
    let reindex: Option<(Uuid, i32, i32, String, i32)> = sqlx::query_as(
        "SELECT document_id, document_revision, settings_revision, state::text, expected_settings_head_revision \
         FROM document_reindex_attempts WHERE tenant_id = $1 AND knowledge_space_id = $2 \
           AND compilation_attempt_id = $3 LIMIT 1 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .bind(attempt)
    .fetch_optional(&mut *conn)
    .await?;
    let change: Option<(Uuid, i32, String)> = sqlx::query_as(
        "SELECT document_id, document_revision, state::text FROM document_chunk_state_changes \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND compilation_attempt_id = $3 LIMIT 1 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .bind(attempt)
    .fetch_optional(&mut *conn)
    .await?;
    let bound = [revision.is_some(), reindex.is_some(), change.is_some()];
    if bound.iter().filter(|b| **b).count() > 1 {
        return Ok(Err(
            "the attempt is bound to more than one logical-document intent".into(),
        ));
    }
    let gone = || {
        Ok(Err(
            "its logical-document intent is no longer retryable".to_owned()
        ))
    };
    if let Some((doc, _, state, expected_active, expected_rv)) = revision {
        if document_at(conn, tenant, space, doc).await? != Some((expected_active, expected_rv)) {
            return gone();
        }
        match state.as_str() {
            "candidate" => {}
            "failed" => {
                sqlx::query(
                    "UPDATE document_revisions SET state = 'candidate' WHERE tenant_id = $1 \
                       AND knowledge_space_id = $2 AND compilation_attempt_id = $3 AND state = 'failed'",
                )
                .bind(tenant)
                .bind(space)
                .bind(attempt)
                .execute(&mut *conn)
                .await?;
                if expected_active.is_none() {
                    sqlx::query(
                        "UPDATE logical_documents SET status = 'pending' WHERE tenant_id = $1 \
                           AND knowledge_space_id = $2 AND id = $3 AND status = 'failed'",
                    )
                    .bind(tenant)
                    .bind(space)
                    .bind(doc)
                    .execute(&mut *conn)
                    .await?;
                }
            }
            _ => return gone(),
        }
        return Ok(Ok(()));
    }
    if let Some((doc, doc_revision, settings, state, expected_head)) = reindex {
        let head: Option<i32> = sqlx::query_scalar(
            "SELECT active_revision FROM document_settings_heads WHERE tenant_id = $1 \
               AND knowledge_space_id = $2 AND document_id = $3 LIMIT 1 FOR UPDATE",
        )
        .bind(tenant)
        .bind(space)
        .bind(doc)
        .fetch_optional(&mut *conn)
        .await?;
        let at = document_at(conn, tenant, space, doc).await?;
        if at.and_then(|d| d.0) != Some(doc_revision) || head.unwrap_or(0) != expected_head {
            return gone();
        }
        let candidate: Option<String> = sqlx::query_scalar(
            "SELECT state::text FROM document_settings_revisions WHERE tenant_id = $1 AND knowledge_space_id = $2 \
               AND document_id = $3 AND revision = $4 LIMIT 1 FOR UPDATE",
        )
        .bind(tenant)
        .bind(space)
        .bind(doc)
        .bind(settings)
        .fetch_optional(&mut *conn)
        .await?;
        match candidate.as_deref() {
            Some("candidate") => {}
            Some("failed") => {
                sqlx::query(
                    "UPDATE document_settings_revisions SET state = 'candidate' WHERE tenant_id = $1 \
                       AND knowledge_space_id = $2 AND document_id = $3 AND revision = $4 AND state = 'failed'",
                )
                .bind(tenant)
                .bind(space)
                .bind(doc)
                .bind(settings)
                .execute(&mut *conn)
                .await?;
            }
            _ => return gone(),
        }
        match state.as_str() {
            "running" | "queued" => {}
            "failed" | "canceled" => {
                sqlx::query(
                    "UPDATE document_reindex_attempts SET state = 'running', active_slot = 1, error_code = NULL, \
                       error_message = NULL, completed_at = NULL, row_version = row_version + 1 \
                     WHERE tenant_id = $1 AND knowledge_space_id = $2 AND compilation_attempt_id = $3 \
                       AND state IN ('failed', 'canceled')",
                )
                .bind(tenant)
                .bind(space)
                .bind(attempt)
                .execute(&mut *conn)
                .await?;
            }
            _ => return gone(),
        }
        return Ok(Ok(()));
    }
    if let Some((doc, doc_revision, state)) = change {
        if document_at(conn, tenant, space, doc)
            .await?
            .and_then(|d| d.0)
            != Some(doc_revision)
        {
            return gone();
        }
        match state.as_str() {
            "candidate" => {}
            "failed" => {
                sqlx::query(
                    "UPDATE document_chunk_state_changes SET state = 'candidate' WHERE tenant_id = $1 \
                       AND knowledge_space_id = $2 AND compilation_attempt_id = $3 AND state = 'failed'",
                )
                .bind(tenant)
                .bind(space)
                .bind(attempt)
                .execute(&mut *conn)
                .await?;
            }
            _ => return gone(),
        }
    }
    Ok(Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(n: u128, kind: &str, children: &[u128]) -> ChunkNode {
        let ids: Vec<String> = children
            .iter()
            .map(|c| Uuid::from_u128(*c).to_string())
            .collect();
        ChunkNode {
            id: Uuid::from_u128(n),
            kind: kind.into(),
            metadata: if children.is_empty() {
                json!({})
            } else {
                json!({ "childNodeIds": ids })
            },
        }
    }

    #[test]
    fn chunks_come_parent_first_with_their_summary_parent() {
        let u = Uuid::from_u128;
        // Offset order: leaf (0), section summary (1), document summary (2).
        let nodes = vec![
            node(3, "chunk", &[]),
            node(2, "summary", &[3]),
            node(1, "summary", &[2]),
        ];
        assert_eq!(
            parent_first(&nodes).unwrap(),
            vec![(2, None), (1, Some(u(1))), (0, Some(u(2)))]
        );
        let flat = vec![node(1, "chunk", &[]), node(2, "chunk", &[])];
        assert_eq!(parent_first(&flat).unwrap(), vec![(0, None), (1, None)]);
        // A child list of a non-summary node is not a tree edge; unknown children are skipped.
        let ignored = vec![node(1, "chunk", &[2]), node(2, "summary", &[9])];
        assert_eq!(parent_first(&ignored).unwrap(), vec![(0, None), (1, None)]);
        let two_parents = vec![
            node(1, "summary", &[3]),
            node(2, "summary", &[3]),
            node(3, "chunk", &[]),
        ];
        assert!(parent_first(&two_parents).is_err());
        let cycle = vec![node(1, "summary", &[2]), node(2, "summary", &[1])];
        assert!(parent_first(&cycle).is_err());
        let own = vec![node(1, "summary", &[1])];
        assert!(parent_first(&own).is_err());
        let mut bad = node(1, "summary", &[]);
        bad.metadata = json!({ "childNodeIds": "x" });
        assert!(parent_first(&[bad]).is_err());
    }

    #[test]
    fn token_counts_are_a_quarter_of_the_trimmed_length_rounded_up() {
        for (text, n) in [
            ("", 0),
            ("   ", 0),
            ("a", 1),
            (" abcd ", 1),
            ("abcde", 2),
            ("é😀", 1),
        ] {
            assert_eq!(token_count(text), n, "{text:?}");
        }
    }
}
