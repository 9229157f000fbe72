//! The I/O of each compile step, inside the engine's fenced transaction. Invariant: a step
//! writes only rows of its attempt's own tenant, space, document and publication generation,
//! deletes that generation's rows of the kind it writes before writing them (so repeating a
//! step after a crash yields the same rows once), keeps nothing in memory for a later step
//! (the parse is regenerated from the hash-checked bytes), binds the candidate publication at
//! most once, and moves the space's head only by compare-and-swap under the head row's lock.

use serde_json::json;
use sqlx::PgConnection;
use uuid::Uuid;

use super::parse::{self, Chunk, Parsed, MAX_CHUNK_CHARS};
use super::walk::{self, Checkpoint, Facts, Gate, Served};
use crate::jobs::{JobError, Step};
use crate::publication::{self, Member, Members};
use crate::store::{Store, StoreError};

/// The attempt being worked on, read from its (already fenced and locked) row.
#[derive(Clone, Debug)]
pub(crate) struct Attempt {
    pub id: Uuid,
    pub tenant: String,
    pub space: Uuid,
    pub document: Uuid,
    pub version: i32,
    pub generation: Uuid,
    pub base_head_revision: i32,
    pub candidate: Option<(Uuid, String)>,
    pub created_at: chrono::DateTime<chrono::Utc>,
}

/// The attempt's document, share-locked for the rest of the step.
#[derive(Clone, Debug)]
pub(crate) struct Document {
    pub version: i32,
    pub active: bool,
    pub space_active: bool,
    pub filename: String,
    pub mime_type: String,
    pub object_key: String,
    pub sha256: String,
}

pub(crate) async fn load_attempt(conn: &mut PgConnection, id: Uuid) -> Result<Attempt, JobError> {
    type Row = (
        String,
        Uuid,
        Uuid,
        i32,
        Uuid,
        i32,
        Option<Uuid>,
        Option<String>,
        chrono::DateTime<chrono::Utc>,
    );
    let row: Option<Row> = sqlx::query_as(
        "SELECT tenant_id::text, knowledge_space_id, document_asset_id, document_version, publication_generation_id, \
           base_head_revision, candidate_publication_id, candidate_fingerprint::text, created_at \
         FROM document_compilation_attempts WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    let (tenant, space, document, version, generation, base, cand_id, cand_fp, created_at) =
        row.ok_or_else(|| JobError::fatal("attempt_missing", format!("no attempt {id}")))?;
    Ok(Attempt {
        id,
        tenant,
        space,
        document,
        version,
        generation,
        base_head_revision: base,
        candidate: cand_id.zip(cand_fp),
        created_at,
    })
}

pub(crate) async fn load_document(
    conn: &mut PgConnection,
    a: &Attempt,
) -> Result<Document, JobError> {
    type Row = (i32, String, String, String, String, String, String);
    let row: Option<Row> = sqlx::query_as(
        "SELECT d.version, d.lifecycle_state::text, s.lifecycle_state::text, d.filename::text, d.mime_type::text, \
           d.object_key, d.sha256::text \
         FROM document_assets d JOIN knowledge_spaces s ON s.id = d.knowledge_space_id \
         WHERE s.tenant_id = $1 AND d.knowledge_space_id = $2 AND d.id = $3 \
         FOR SHARE OF d",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.document)
    .fetch_optional(&mut *conn)
    .await?;
    let (version, doc_state, space_state, filename, mime_type, object_key, sha256) = row
        .ok_or_else(|| {
            JobError::fatal(
                "document_missing",
                format!(
                    "document {} is not in space {} of tenant {}",
                    a.document, a.space, a.tenant
                ),
            )
        })?;
    Ok(Document {
        version,
        active: doc_state == "active",
        space_active: space_state == "active",
        filename,
        mime_type,
        object_key,
        sha256,
    })
}

/// The highest version of this document with another active attempt.
pub(crate) async fn newest_other_active(
    conn: &mut PgConnection,
    a: &Attempt,
) -> Result<Option<i32>, JobError> {
    Ok(sqlx::query_scalar(
        "SELECT max(document_version) FROM document_compilation_attempts \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND document_asset_id = $3 AND active_slot = 1 AND id <> $4",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.document)
    .bind(a.id)
    .fetch_one(&mut *conn)
    .await?)
}

pub(crate) fn facts(
    a: &Attempt,
    d: &Document,
    newest: Option<i32>,
    served: Option<Served>,
) -> Facts {
    Facts {
        version: a.version,
        document_version: d.version,
        document_active: d.active,
        space_active: d.space_active,
        newest_other_active: newest,
        served,
    }
}

/// What a closed gate makes of the step; `None` when the gate is open.
pub(crate) fn stop(gate: Gate) -> Option<Result<Step, JobError>> {
    Some(match gate {
        Gate::Go => return None,
        Gate::Supersede(message) => Ok(Step::Supersede { message }),
        Gate::Deleting(message) => Ok(Step::Cancel {
            code: "document_deleting".into(),
            message,
        }),
        Gate::Invalid(message) => Err(JobError::fatal("version_mismatch", message)),
    })
}

/// Reads the document's bytes and checks them against the recorded SHA-256.
pub(crate) async fn read_bytes(store: &Store, d: &Document) -> Result<bytes::Bytes, JobError> {
    let bytes = store.get(&d.object_key).await.map_err(|e| match e {
        StoreError::Other(m) => JobError::retryable("store_unavailable", m),
        StoreError::NotFound(_) => JobError::fatal(
            "object_missing",
            format!("the bytes of {:?} are not in the object store", d.filename),
        ),
        StoreError::BadKey(_) => JobError::fatal(
            "object_missing",
            format!("the object key of {:?} is not a valid key", d.filename),
        ),
    })?;
    let actual = crate::platform::sha256_hex(&bytes);
    if !actual.eq_ignore_ascii_case(d.sha256.trim()) {
        return Err(JobError::fatal(
            "hash_mismatch",
            format!(
                "the stored bytes of {:?} hash to {actual}, the document records {}",
                d.filename, d.sha256
            ),
        ));
    }
    Ok(bytes)
}

/// Reads, checks and parses the document: the same result every time for the same version.
pub(crate) async fn parsed(store: &Store, d: &Document) -> Result<Parsed, JobError> {
    let bytes = read_bytes(store, d).await?;
    let format = parse::detect(&d.mime_type, &d.filename)
        .map_err(|e| JobError::fatal(e.code(), e.to_string()))?;
    parse::parse(format, &bytes).map_err(|e| JobError::fatal(e.code(), e.to_string()))
}

/// queued → parsed: the bytes are there, match their hash and parse; `parser_status` records it.
pub(crate) async fn parse_step(
    conn: &mut PgConnection,
    store: &Store,
    a: &Attempt,
    d: &Document,
) -> Result<(), JobError> {
    let p = parsed(store, d).await?;
    tracing::debug!(attempt = %a.id, format = p.format.as_str(), sections = p.sections.len(), "parsed");
    sqlx::query(
        "UPDATE document_assets d SET parser_status = 'parsed', updated_at = now() \
         FROM knowledge_spaces s \
         WHERE s.id = d.knowledge_space_id AND s.tenant_id = $1 AND d.knowledge_space_id = $2 AND d.id = $3 \
           AND d.version = $4 AND d.parser_status <> 'parsed'",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.document)
    .bind(a.version)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// parsed → outline_built: this generation's heading tree, replaced as a whole.
pub(crate) async fn outline_step(
    conn: &mut PgConnection,
    store: &Store,
    a: &Attempt,
    d: &Document,
) -> Result<(), JobError> {
    let p = parsed(store, d).await?;
    let outline = parse::outline(&p);
    clear_generation(conn, Generated::Outlines, a).await?;
    sqlx::query(
        "INSERT INTO document_outlines (id, tenant_id, knowledge_space_id, document_asset_id, document_version, \
           publication_generation_id, outline, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, now())",
    )
    .bind(Uuid::now_v7())
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.document)
    .bind(a.version)
    .bind(a.generation)
    .bind(outline)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// outline_built → nodes_generated: this generation's chunks, replaced as a whole.
pub(crate) async fn nodes_step(
    conn: &mut PgConnection,
    store: &Store,
    a: &Attempt,
    d: &Document,
) -> Result<usize, JobError> {
    let p = parsed(store, d).await?;
    let chunks: Vec<Chunk> = parse::chunks(&p, MAX_CHUNK_CHARS);
    // Projections of these nodes go with them (ON DELETE CASCADE).
    clear_generation(conn, Generated::Nodes, a).await?;
    if chunks.is_empty() {
        return Ok(0);
    }
    let n = chunks.len();
    let ids: Vec<Uuid> = (0..n).map(|_| Uuid::now_v7()).collect();
    let ordinals: Vec<i32> = (0..n)
        .map(|i| i32::try_from(i).unwrap_or(i32::MAX))
        .collect();
    let paths: Vec<serde_json::Value> = chunks.iter().map(|c| json!(c.heading_path)).collect();
    let contents: Vec<String> = chunks.iter().map(|c| c.content.clone()).collect();
    let hashes: Vec<String> = chunks
        .iter()
        .map(|c| crate::platform::sha256_hex(c.content.as_bytes()))
        .collect();
    let tokens: Vec<i32> = chunks.iter().map(Chunk::token_count).collect();
    let meta: Vec<serde_json::Value> = chunks
        .iter()
        .map(|c| {
            json!({
                "format": p.format,
                "chars": c.content.chars().count(),
                "attemptId": a.id,
            })
        })
        .collect();
    sqlx::query(
        "INSERT INTO knowledge_nodes (id, tenant_id, knowledge_space_id, document_asset_id, document_version, \
           publication_generation_id, ordinal, heading_path, content, content_sha256, token_count, metadata, created_at) \
         SELECT t.id, $1, $2, $3, $4, $5, t.ordinal, t.path, t.content, t.hash, t.tokens, t.meta, now() \
         FROM unnest($6::uuid[], $7::int4[], $8::jsonb[], $9::text[], $10::text[], $11::int4[], $12::jsonb[]) \
           AS t(id, ordinal, path, content, hash, tokens, meta)",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.document)
    .bind(a.version)
    .bind(a.generation)
    .bind(&ids)
    .bind(&ordinals)
    .bind(&paths)
    .bind(&contents)
    .bind(&hashes)
    .bind(&tokens)
    .bind(&meta)
    .execute(&mut *conn)
    .await?;
    Ok(n)
}

/// nodes_generated → projection_built: this generation's search vectors, replaced as a whole,
/// and the candidate publication, bound once and reused ever after.
pub(crate) async fn projection_step(conn: &mut PgConnection, a: &Attempt) -> Result<(), JobError> {
    clear_generation(conn, Generated::Projections, a).await?;
    sqlx::query(
        "INSERT INTO index_projections (id, tenant_id, knowledge_space_id, document_asset_id, publication_generation_id, \
           node_id, search_vector, created_at) \
         SELECT gen_random_uuid(), n.tenant_id, n.knowledge_space_id, n.document_asset_id, n.publication_generation_id, \
           n.id, to_tsvector('english', n.content), now() \
         FROM knowledge_nodes n \
         WHERE n.tenant_id = $1 AND n.knowledge_space_id = $2 AND n.document_asset_id = $3 \
           AND n.publication_generation_id = $4",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.document)
    .bind(a.generation)
    .execute(&mut *conn)
    .await?;
    if a.candidate.is_some() {
        return Ok(());
    }
    let head = publication::head(conn, &a.tenant, a.space, false).await?;
    let (mut members, base) = head.map_or((Members::new(), 0), |h| (h.members, h.revision));
    members.insert(
        a.document,
        Member {
            generation: a.generation,
            version: a.version,
        },
    );
    let (id, fingerprint) = publication::create(
        conn,
        &a.tenant,
        a.space,
        &members,
        json!({ "attemptId": a.id, "documentId": a.document, "role": "candidate", "baseHeadRevision": base }),
    )
    .await?;
    let bound = sqlx::query(
        "UPDATE document_compilation_attempts SET candidate_publication_id = $2, candidate_fingerprint = $3, \
           base_head_revision = $4 \
         WHERE id = $1 AND tenant_id = $5 AND knowledge_space_id = $6 AND candidate_publication_id IS NULL",
    )
    .bind(a.id)
    .bind(id)
    .bind(&fingerprint)
    .bind(base)
    .bind(&a.tenant)
    .bind(a.space)
    .execute(&mut *conn)
    .await?;
    if bound.rows_affected() != 1 {
        return Err(JobError::fatal(
            "candidate_conflict",
            "the candidate publication was bound concurrently",
        ));
    }
    Ok(())
}

/// The numbers of a smoke evaluation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Smoke {
    pub nodes: i64,
    pub projections: i64,
    pub probeable: i64,
    pub found: i64,
}

impl Smoke {
    pub fn passed(&self) -> bool {
        self.projections == self.nodes
            && self.found == self.probeable
            && (self.nodes == 0 || self.probeable > 0)
    }
}

/// projection_built → smoke_eval_passed: every node of the generation is found by a full-text
/// probe built from a few of its own distinctive words.
pub(crate) async fn smoke_step(conn: &mut PgConnection, a: &Attempt) -> Result<(), JobError> {
    let nodes: Vec<(Uuid, i32, String)> = sqlx::query_as(
        "SELECT id, ordinal, content FROM knowledge_nodes \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND document_asset_id = $3 AND publication_generation_id = $4 \
         ORDER BY ordinal",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.document)
    .bind(a.generation)
    .fetch_all(&mut *conn)
    .await?;
    let ids: Vec<Uuid> = nodes.iter().map(|n| n.0).collect();
    let ordinals: Vec<i32> = nodes.iter().map(|n| n.1).collect();
    let words: Vec<String> = nodes.iter().map(|n| parse::probe_words(&n.2)).collect();
    let (projections, probeable, found, missing): (i64, i64, i64, Vec<i32>) = sqlx::query_as(
        "WITH q AS ( \
           SELECT t.node_id, t.ordinal, plainto_tsquery('english', t.words) AS query \
           FROM unnest($5::uuid[], $6::int4[], $7::text[]) AS t(node_id, ordinal, words) \
         ), r AS ( \
           SELECT q.ordinal, numnode(q.query) > 0 AS probeable, \
             EXISTS (SELECT 1 FROM index_projections p \
                     WHERE p.tenant_id = $1 AND p.knowledge_space_id = $2 AND p.document_asset_id = $3 \
                       AND p.publication_generation_id = $4 AND p.node_id = q.node_id \
                       AND p.search_vector @@ q.query) AS found \
           FROM q \
         ) \
         SELECT (SELECT count(*) FROM index_projections p WHERE p.tenant_id = $1 AND p.knowledge_space_id = $2 \
                   AND p.document_asset_id = $3 AND p.publication_generation_id = $4), \
           (SELECT count(*) FROM r WHERE probeable), \
           (SELECT count(*) FROM r WHERE probeable AND found), \
           coalesce((SELECT array_agg(ordinal ORDER BY ordinal) FROM (SELECT ordinal FROM r WHERE probeable AND NOT found \
             ORDER BY ordinal LIMIT 10) m), '{}'::int4[])",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.document)
    .bind(a.generation)
    .bind(&ids)
    .bind(&ordinals)
    .bind(&words)
    .fetch_one(&mut *conn)
    .await?;
    let smoke = Smoke {
        nodes: i64::try_from(nodes.len()).unwrap_or(i64::MAX),
        projections,
        probeable,
        found,
    };
    if !smoke.passed() {
        return Err(JobError::fatal(
            "smoke_eval_failed",
            format!(
                "{} of {} probeable nodes found by their own words ({} nodes, {} projections); first missing ordinals: {:?}",
                smoke.found, smoke.probeable, smoke.nodes, smoke.projections, missing
            ),
        ));
    }
    tracing::debug!(attempt = %a.id, nodes = smoke.nodes, found = smoke.found, "smoke eval passed");
    Ok(())
}

/// smoke_eval_passed → published: the head moves to the candidate if it is still at the base
/// revision; if it moved, to a new publication of the current head's members plus this
/// document (the bound candidate stays as it is). Everything under the head row's lock.
pub(crate) async fn publish_step(
    conn: &mut PgConnection,
    a: &Attempt,
    d: &Document,
) -> Result<Step, JobError> {
    let (candidate, _) = a.candidate.clone().ok_or_else(|| {
        JobError::fatal(
            "candidate_missing",
            "no candidate publication is bound at smoke_eval_passed",
        )
    })?;
    let newest = newest_other_active(conn, a).await?;
    for _ in 0..3 {
        let head = publication::head(conn, &a.tenant, a.space, true).await?;
        let served = match head.as_ref().and_then(|h| h.members.get(&a.document)) {
            None => None,
            Some(m) => Some(Served {
                version: m.version,
                ours: m.generation == a.generation,
                by_later_attempt: m.generation != a.generation
                    && later_attempt_made(conn, a, m.generation).await?,
            }),
        };
        if let Some(stopped) = stop(walk::gate(&facts(a, d, newest, served))) {
            return stopped;
        }
        if served.is_some_and(|s| s.ours) {
            // Already served (a repeated step after an uncertain commit): nothing to move.
            return Ok(Step::Succeed(Checkpoint::Published.as_str().into()));
        }
        let current = head.as_ref().map_or(0, |h| h.revision);
        let target = if current == a.base_head_revision {
            candidate
        } else {
            let mut members = head.map(|h| h.members).unwrap_or_default();
            members.insert(
                a.document,
                Member {
                    generation: a.generation,
                    version: a.version,
                },
            );
            let (id, _) = publication::create(
                conn,
                &a.tenant,
                a.space,
                &members,
                json!({ "attemptId": a.id, "documentId": a.document, "role": "rebased", "candidate": candidate,
                        "baseHeadRevision": current }),
            )
            .await?;
            sqlx::query(
                "UPDATE document_compilation_attempts SET base_head_revision = $4 \
                 WHERE id = $1 AND tenant_id = $2 AND knowledge_space_id = $3",
            )
            .bind(a.id)
            .bind(&a.tenant)
            .bind(a.space)
            .bind(current)
            .execute(&mut *conn)
            .await?;
            tracing::debug!(attempt = %a.id, from = a.base_head_revision, to = current, "head moved; publishing rebased members");
            id
        };
        match publication::swap_head(conn, &a.tenant, a.space, current, target).await? {
            Ok(revision) => {
                tracing::debug!(attempt = %a.id, revision, "published");
                return Ok(Step::Succeed(Checkpoint::Published.as_str().into()));
            }
            // Only when no head existed and another publisher created it first: read it again.
            Err(moved) => {
                tracing::debug!(attempt = %a.id, current = moved.current, "head appeared concurrently; retrying the swap");
            }
        }
    }
    Err(JobError::retryable(
        "head_contended",
        "the publication head kept moving during publish",
    ))
}

/// Whether the attempt that produced `generation` (same tenant, space and document) was created
/// after this one.
async fn later_attempt_made(
    conn: &mut PgConnection,
    a: &Attempt,
    generation: Uuid,
) -> Result<bool, JobError> {
    let later: Option<bool> = sqlx::query_scalar(
        "SELECT (created_at, id) > ($5, $6) FROM document_compilation_attempts \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND document_asset_id = $3 AND publication_generation_id = $4",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(a.document)
    .bind(generation)
    .bind(a.created_at)
    .bind(a.id)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(later.unwrap_or(false))
}

/// The per-generation rows a compile step writes, each replaced as a whole when the step runs.
#[derive(Clone, Copy)]
enum Generated {
    Outlines,
    Nodes,
    Projections,
}

/// Deletes this attempt's generation of one kind of derived row, so that a repeated step writes
/// its rows exactly once. Scoped to the attempt's tenant, space and document.
async fn clear_generation(
    conn: &mut PgConnection,
    what: Generated,
    a: &Attempt,
) -> Result<(), sqlx::Error> {
    let sql = match what {
        Generated::Outlines => {
            "DELETE FROM document_outlines WHERE tenant_id = $1 AND knowledge_space_id = $2 \
               AND document_asset_id = $3 AND publication_generation_id = $4"
        }
        Generated::Nodes => {
            "DELETE FROM knowledge_nodes WHERE tenant_id = $1 AND knowledge_space_id = $2 \
               AND document_asset_id = $3 AND publication_generation_id = $4"
        }
        Generated::Projections => {
            "DELETE FROM index_projections WHERE tenant_id = $1 AND knowledge_space_id = $2 \
               AND document_asset_id = $3 AND publication_generation_id = $4"
        }
    };
    sqlx::query(sql)
        .bind(&a.tenant)
        .bind(a.space)
        .bind(a.document)
        .bind(a.generation)
        .execute(conn)
        .await?;
    Ok(())
}
