//! The publication binding the profile backfill reconciles since the platform's migration 0019
//! (its `bindCurrentPublished`): a pure decision over what one transaction read under its locks,
//! and the thin SQL around it. Invariant: a `legacy-bootstrap` binding is written only for the
//! current publication head of an active, not deletion-fenced space, when that publication is
//! `published`, a retrieval head exists, each current profile head names its own immutable
//! revision (snapshot and capability matching their digests, capability matching the profile)
//! in state `active`, and the published read model satisfies the tuple: with an embedding
//! profile, every plain dense-vector member of the head is `ready` in the profile's vector space
//! and every ready fts member has such a dense twin; without one, the manifest declares no
//! embedding profile and the retrieval profile is research-only. The row carries the current
//! heads' tuple, the embedding revision's vector space, a random id and `created_at =
//! activated_at`, and commits with those locks held, or nothing does. A binding the head already
//! has is never changed: the same tuple is kept, any other is refused with the platform's code.

use serde_json::Value;
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use super::profile::{
    integer, parse_embedding, parse_retrieval, EmbeddingProfile, RetrievalProfile, Selection,
};
use super::walk::digest;

const P: &str = "KNOWLEDGE_SPACE_PROFILE_PUBLICATION_";

/// The platform's codes of `bindCurrentPublished`.
pub mod code {
    pub const SPACE_NOT_WRITABLE: &str = "KNOWLEDGE_SPACE_PROFILE_PUBLICATION_SPACE_NOT_WRITABLE";
    pub const HEAD_MISSING: &str = "KNOWLEDGE_SPACE_PROFILE_PUBLICATION_HEAD_MISSING";
    pub const HEAD_INVALID: &str = "KNOWLEDGE_SPACE_PROFILE_PUBLICATION_HEAD_INVALID";
    pub const RETRIEVAL_PROFILE_REQUIRED: &str =
        "KNOWLEDGE_SPACE_PROFILE_PUBLICATION_RETRIEVAL_PROFILE_REQUIRED";
    pub const PROFILE_NOT_FOUND: &str = "KNOWLEDGE_SPACE_PROFILE_PUBLICATION_PROFILE_NOT_FOUND";
    pub const PROFILE_HEAD_INVALID: &str =
        "KNOWLEDGE_SPACE_PROFILE_PUBLICATION_PROFILE_HEAD_INVALID";
    pub const PROFILE_CORRUPT: &str = "KNOWLEDGE_SPACE_PROFILE_PUBLICATION_PROFILE_CORRUPT";
    pub const CAPABILITY_CORRUPT: &str = "KNOWLEDGE_SPACE_PROFILE_PUBLICATION_CAPABILITY_CORRUPT";
    pub const CAPABILITY_UNVERIFIED: &str =
        "KNOWLEDGE_SPACE_PROFILE_PUBLICATION_CAPABILITY_UNVERIFIED";
    pub const STATE_CONFLICT: &str = "KNOWLEDGE_SPACE_PROFILE_PUBLICATION_STATE_CONFLICT";
    pub const VECTOR_SPACE_CONFLICT: &str =
        "KNOWLEDGE_SPACE_PROFILE_PUBLICATION_VECTOR_SPACE_CONFLICT";
    pub const MANIFEST_MISSING: &str = "KNOWLEDGE_SPACE_PROFILE_PUBLICATION_MANIFEST_MISSING";
    pub const NOT_READY: &str = "KNOWLEDGE_SPACE_PROFILE_PUBLICATION_NOT_READY";
    pub const EMBEDDING_REQUIRED: &str = "KNOWLEDGE_SPACE_PROFILE_PUBLICATION_EMBEDDING_REQUIRED";
    pub const BINDING_CONFLICT: &str = "KNOWLEDGE_SPACE_PROFILE_PUBLICATION_BINDING_CONFLICT";
    pub const BINDING_NOT_ACTIVE: &str = "KNOWLEDGE_SPACE_PROFILE_PUBLICATION_BINDING_NOT_ACTIVE";
}

/// The manifest key whose presence says the space expects an embedding profile.
const EMBEDDING_KEY: &str = "__knowledgeFsEmbeddingProfile";

/// Why a space's head was not bound.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub code: &'static str,
    pub message: String,
}

impl Refusal {
    fn new(code: &'static str, message: impl Into<String>) -> Self {
        debug_assert!(code.starts_with(P));
        Self {
            code,
            message: message.into(),
        }
    }

    /// The space is not ready to be bound yet (no head, no retrieval profile, an expected
    /// embedding profile not installed): the platform's tick counts these neither way.
    pub fn not_ready(&self) -> bool {
        [
            code::HEAD_MISSING,
            code::RETRIEVAL_PROFILE_REQUIRED,
            code::NOT_READY,
        ]
        .contains(&self.code)
    }
}

/// The publication the space's head names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Publication {
    pub id: Uuid,
    pub fingerprint: String,
    pub status: String,
}

/// A profile revision row, as read for the head of its kind.
#[derive(Clone, Debug, PartialEq)]
pub struct Revision {
    pub id: Uuid,
    pub revision: i32,
    pub state: String,
    pub snapshot: Value,
    pub snapshot_digest: String,
    pub capability: Value,
    pub capability_digest: String,
    pub vector_space_id: Option<String>,
}

/// A current profile head and the revision row of its kind at its active revision.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadFacts {
    pub profile_revision_id: Uuid,
    pub active_revision: i32,
    pub revision: Option<Revision>,
}

/// Whether the head's index-projection members close over the embedding's vector space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Closure {
    /// A plain (not visual) dense-vector member that is not ready, or not in the space, or
    /// has no vector.
    pub dense_outside: bool,
    /// A ready fts member with no ready dense twin in the space for its node.
    pub fts_without_twin: bool,
}

/// One profile of a binding: the immutable revision it names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProfileRef {
    pub id: Uuid,
    pub revision: i32,
    pub snapshot_digest: String,
}

/// A binding row, as far as the platform compares two of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    pub binding_reason: String,
    pub changed_kind: String,
    pub publication_id: Uuid,
    pub publication_fingerprint: String,
    pub embedding: Option<ProfileRef>,
    pub retrieval: ProfileRef,
    pub vector_space_id: Option<String>,
    pub activated: bool,
}

impl Binding {
    /// Everything but activation, the way the platform tells two tuples apart.
    fn same_tuple(&self, other: &Binding) -> bool {
        Binding {
            activated: other.activated,
            ..self.clone()
        } == *other
    }
}

/// What the transaction read, in its lock order. A read that cannot matter any more (after an
/// unwritable space or a missing head) is not made and stays empty.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Facts {
    /// The space is active, not deletion-fenced and has no active deletion job.
    pub writable: bool,
    /// `None`: no publication head; `Some(None)`: the head names no publication row.
    pub head: Option<Option<Publication>>,
    pub embedding: Option<HeadFacts>,
    pub retrieval: Option<HeadFacts>,
    /// Read when the embedding revision names a vector space.
    pub closure: Option<Closure>,
    /// Read without an embedding head (`None` with one, or without a manifest): whether the
    /// manifest's metadata has the embedding profile key.
    pub manifest: Option<bool>,
    /// The binding the head's publication already has.
    pub existing: Option<Binding>,
}

/// What to do with the head.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Write this (activated) binding.
    Insert(Box<Binding>),
    /// The head already has an activated binding of exactly this tuple.
    Keep,
}

/// A verified head profile.
struct Verified {
    reference: ProfileRef,
    state: String,
    vector_space_id: Option<String>,
    default_mode: Option<String>,
}

fn same_selection(capability: &Value, sel: &Selection) -> bool {
    let s = &capability["selection"];
    s["model"].as_str() == Some(sel.model.as_str())
        && s["pluginId"].as_str() == Some(sel.plugin_id.as_str())
        && s["provider"].as_str() == Some(sel.provider.as_str())
}

fn capability_of_kind(capability: &Value, kind: &str, sel: &Selection) -> bool {
    capability["kind"].as_str() == Some(kind) && same_selection(capability, sel)
}

/// A head profile's snapshot, parsed strictly as its kind.
enum Parsed {
    Embedding(EmbeddingProfile),
    Retrieval(RetrievalProfile),
}

/// The platform's reading of a head profile: the revision of the head's number must exist, be
/// the head's own, and be intact (digests, strict snapshot, capability verified against it,
/// revision number and vector space as its snapshot says).
fn verify(kind: &str, head: &HeadFacts) -> Result<Verified, Refusal> {
    let Some(r) = &head.revision else {
        return Err(Refusal::new(
            code::PROFILE_NOT_FOUND,
            format!(
                "{kind} profile revision={} was not found",
                head.active_revision
            ),
        ));
    };
    if r.id != head.profile_revision_id {
        return Err(Refusal::new(
            code::PROFILE_HEAD_INVALID,
            format!("{kind} profile head points to a different immutable revision"),
        ));
    }
    let corrupt = |m: &str| Refusal::new(code::PROFILE_CORRUPT, m);
    if digest(&r.snapshot) != r.snapshot_digest.trim() {
        return Err(corrupt("Profile revision snapshot digest is invalid"));
    }
    let parsed = if kind == "embedding" {
        Parsed::Embedding(parse_embedding(&r.snapshot).map_err(|e| corrupt(&e))?)
    } else {
        Parsed::Retrieval(parse_retrieval(&r.snapshot).map_err(|e| corrupt(&e))?)
    };
    if digest(&r.capability) != r.capability_digest.trim() {
        return Err(Refusal::new(
            code::CAPABILITY_CORRUPT,
            "Profile capability snapshot digest is invalid",
        ));
    }
    let cap = &r.capability;
    let (revision, vsid, default_mode) = match parsed {
        Parsed::Embedding(p) => {
            let verified = capability_of_kind(cap, "embedding", &p.selection)
                && p.dimension.is_some()
                && cap.get("dimension").and_then(integer) == p.dimension;
            if !verified {
                return Err(Refusal::new(
                    code::CAPABILITY_UNVERIFIED,
                    "Embedding profile lacks an exact verified model preflight snapshot",
                ));
            }
            (p.revision, Some(p.vector_space_id), None)
        }
        Parsed::Retrieval(p) => {
            let rerank_ok = match &p.rerank {
                Some(m) => capability_of_kind(&cap["rerank"], "rerank", m),
                None => cap.get("rerank") == Some(&Value::Null),
            };
            let verified = cap["verification"].as_str() == Some("verified")
                && capability_of_kind(&cap["reasoning"], "reasoning", &p.reasoning)
                && rerank_ok;
            if !verified {
                return Err(Refusal::new(
                    code::CAPABILITY_UNVERIFIED,
                    "Retrieval profile lacks exact verified reasoning/rerank preflight snapshots",
                ));
            }
            let mode = p.value["defaultMode"].as_str().map(str::to_owned);
            (p.revision, None, mode)
        }
    };
    if revision != i64::from(r.revision) {
        return Err(corrupt(
            "Profile snapshot revision differs from its immutable row",
        ));
    }
    if r.vector_space_id != vsid {
        return Err(corrupt(
            "Profile vector-space identity differs from its immutable snapshot",
        ));
    }
    Ok(Verified {
        reference: ProfileRef {
            id: r.id,
            revision: r.revision,
            snapshot_digest: r.snapshot_digest.trim().to_owned(),
        },
        state: r.state.clone(),
        vector_space_id: r.vector_space_id.clone(),
        default_mode,
    })
}

fn require_active(p: &Verified, label: &str) -> Result<(), Refusal> {
    if p.state == "active" {
        Ok(())
    } else {
        Err(Refusal::new(
            code::STATE_CONFLICT,
            format!("{label} is {}, expected active", p.state),
        ))
    }
}

/// The platform's `bindCurrentPublished`, in its order: what to write for the space's current
/// head, or why not.
pub fn decide(f: &Facts) -> Result<Plan, Refusal> {
    if !f.writable {
        return Err(Refusal::new(
            code::SPACE_NOT_WRITABLE,
            "Knowledge space is missing, deleting, or fenced by an active deletion job",
        ));
    }
    let publication = match &f.head {
        None => {
            return Err(Refusal::new(
                code::HEAD_MISSING,
                "Current publication bootstrap requires a published head",
            ))
        }
        Some(None) => {
            return Err(Refusal::new(
                code::HEAD_INVALID,
                "Publication head references a missing row",
            ))
        }
        Some(Some(p)) => p,
    };
    if publication.status != "published" {
        return Err(Refusal::new(
            code::HEAD_INVALID,
            "Current publication head does not reference a published row",
        ));
    }
    let Some(retrieval_head) = &f.retrieval else {
        return Err(Refusal::new(
            code::RETRIEVAL_PROFILE_REQUIRED,
            "Current publication bootstrap requires a retrieval profile head",
        ));
    };
    let embedding = f
        .embedding
        .as_ref()
        .map(|h| verify("embedding", h))
        .transpose()?;
    let retrieval = verify("retrieval", retrieval_head)?;
    if let Some(e) = &embedding {
        require_active(e, "embedding head profile")?;
        let closed = f
            .closure
            .is_some_and(|c| !c.dense_outside && !c.fts_without_twin);
        if e.vector_space_id.is_none() || !closed {
            return Err(Refusal::new(
                code::VECTOR_SPACE_CONFLICT,
                "Publication dense members do not form a complete snapshot in the bound vector space",
            ));
        }
    }
    require_active(&retrieval, "retrieval head profile")?;
    if embedding.is_none() {
        match f.manifest {
            None => {
                return Err(Refusal::new(
                    code::MANIFEST_MISSING,
                    "Cannot prove that the knowledge space intentionally has no embedding profile",
                ))
            }
            Some(true) => {
                return Err(Refusal::new(
                    code::NOT_READY,
                    "The manifest declares an embedding profile whose active head is not ready",
                ))
            }
            Some(false) => {}
        }
        if retrieval.default_mode.as_deref() != Some("research") {
            return Err(Refusal::new(
                code::EMBEDDING_REQUIRED,
                "A publication without an embedding profile is only valid for Research retrieval",
            ));
        }
    }
    let tuple = Binding {
        binding_reason: "legacy-bootstrap".into(),
        changed_kind: "bootstrap".into(),
        publication_id: publication.id,
        publication_fingerprint: publication.fingerprint.clone(),
        vector_space_id: embedding.as_ref().and_then(|e| e.vector_space_id.clone()),
        embedding: embedding.map(|e| e.reference),
        retrieval: retrieval.reference,
        activated: true,
    };
    match &f.existing {
        None => Ok(Plan::Insert(Box::new(tuple))),
        Some(b) if !b.same_tuple(&tuple) => Err(Refusal::new(
            code::BINDING_CONFLICT,
            "Publication already has another immutable profile tuple",
        )),
        Some(b) if !b.activated => Err(Refusal::new(
            code::BINDING_NOT_ACTIVE,
            "Existing current-publication binding is not activated",
        )),
        Some(_) => Ok(Plan::Keep),
    }
}

/// What a reconciliation did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reconciled {
    /// A binding was written; its id.
    Bound(Uuid),
    /// The head's binding already was this one.
    Kept,
}

/// Locks the space for a write as the platform's deletion admission does: its row, then its
/// active deletion job. The row is locked `FOR NO KEY UPDATE`: against the space's deletion
/// and every other writer of the row, not against inserts that reference the space (their
/// foreign key checks take `KEY SHARE`), so a compile request holding the profile heads this
/// transaction locks next never waits for it, and the two cannot deadlock. `true`: the space is active, not deletion-fenced, with no active
/// deletion job.
pub(super) async fn lock_space(
    tx: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<bool, sqlx::Error> {
    let row: Option<(String, Option<Uuid>)> = sqlx::query_as(
        "SELECT lifecycle_state::text, deletion_job_id FROM knowledge_spaces \
         WHERE tenant_id = $1 AND id = $2 FOR NO KEY UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .fetch_optional(&mut *tx)
    .await?;
    let deleting: Option<Uuid> = sqlx::query_scalar(
        "SELECT id FROM deletion_jobs WHERE tenant_id = $1 AND knowledge_space_id = $2 AND active_slot = 1 \
         LIMIT 1 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .fetch_optional(&mut *tx)
    .await?;
    Ok(matches!(&row, Some((s, None)) if s == "active") && deleting.is_none())
}

async fn profile_head(
    tx: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    kind: &str,
) -> Result<Option<(Uuid, i32)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT profile_revision_id, active_revision FROM knowledge_space_profile_heads \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND kind = $3 LIMIT 1 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .bind(kind)
    .fetch_optional(tx)
    .await
}

async fn revision(
    tx: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    kind: &str,
    (profile_revision_id, active_revision): (Uuid, i32),
) -> Result<HeadFacts, sqlx::Error> {
    type Row = (
        Uuid,
        i32,
        String,
        Value,
        String,
        Value,
        String,
        Option<String>,
    );
    let row: Option<Row> = sqlx::query_as(
        "SELECT id, revision, state::text, snapshot, snapshot_digest::text, capability_snapshot, \
           capability_snapshot_digest::text, vector_space_id::text \
         FROM knowledge_space_profile_revisions \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND kind = $3 AND revision = $4 LIMIT 1 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .bind(kind)
    .bind(active_revision)
    .fetch_optional(tx)
    .await?;
    Ok(HeadFacts {
        profile_revision_id,
        active_revision,
        revision: row.map(
            |(
                id,
                revision,
                state,
                snapshot,
                snapshot_digest,
                capability,
                capability_digest,
                vsid,
            )| {
                Revision {
                    id,
                    revision,
                    state,
                    snapshot,
                    snapshot_digest,
                    capability,
                    capability_digest,
                    vector_space_id: vsid,
                }
            },
        ),
    })
}

/// A plain dense-vector member of the publication outside the vector space `$4`.
const DENSE_OUTSIDE: &str = r#"
SELECT ip.id FROM projection_set_publication_members pm
JOIN index_projections ip ON ip.id = pm.component_key AND ip.knowledge_space_id = pm.knowledge_space_id
  AND ip.publication_generation_id = pm.generation_id
WHERE pm.tenant_id = $1 AND pm.knowledge_space_id = $2 AND pm.publication_id = $3
  AND pm.component_type = 'index-projection' AND ip.type = 'dense-vector'
  AND (ip.status <> 'ready' OR ip.model IS NULL OR ip.model <> $4 OR ip.dense_vector IS NULL)
  AND ip.visual_vector IS NULL
LIMIT 1 FOR UPDATE"#;

/// A ready fts member of the publication with no ready dense twin in the vector space `$4`.
const FTS_WITHOUT_TWIN: &str = r#"
SELECT fts.id FROM projection_set_publication_members fm
JOIN index_projections fts ON fts.id = fm.component_key AND fts.knowledge_space_id = fm.knowledge_space_id
  AND fts.publication_generation_id = fm.generation_id
WHERE fm.tenant_id = $1 AND fm.knowledge_space_id = $2 AND fm.publication_id = $3
  AND fm.component_type = 'index-projection' AND fts.type = 'fts' AND fts.status = 'ready'
  AND NOT EXISTS (
    SELECT 1 FROM projection_set_publication_members dm
    JOIN index_projections dense ON dense.id = dm.component_key AND dense.knowledge_space_id = dm.knowledge_space_id
      AND dense.publication_generation_id = dm.generation_id
    WHERE dm.tenant_id = fm.tenant_id AND dm.knowledge_space_id = fm.knowledge_space_id
      AND dm.publication_id = fm.publication_id AND dm.component_type = 'index-projection'
      AND dense.node_id = fts.node_id AND dense.type = 'dense-vector' AND dense.status = 'ready'
      AND dense.model = $4 AND dense.dense_vector IS NOT NULL AND dense.visual_vector IS NULL)
LIMIT 1 FOR UPDATE"#;

async fn found(
    tx: &mut PgConnection,
    sql: &str,
    tenant: &str,
    space: Uuid,
    publication: Uuid,
    vsid: &str,
) -> Result<bool, sqlx::Error> {
    let row: Option<Uuid> = sqlx::query_scalar(sql)
        .bind(tenant)
        .bind(space)
        .bind(publication)
        .bind(vsid)
        .fetch_optional(tx)
        .await?;
    Ok(row.is_some())
}

async fn existing_binding(
    tx: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    publication: Uuid,
) -> Result<Option<Binding>, sqlx::Error> {
    type Row = (
        String,
        String,
        Option<Uuid>,
        Option<i32>,
        Option<String>,
        Uuid,
        i32,
        String,
        Option<String>,
        String,
        bool,
    );
    let row: Option<Row> = sqlx::query_as(
        "SELECT binding_reason::text, changed_kind::text, embedding_profile_revision_id, embedding_profile_revision, \
           embedding_profile_snapshot_digest::text, retrieval_profile_revision_id, retrieval_profile_revision, \
           retrieval_profile_snapshot_digest::text, vector_space_id::text, publication_fingerprint::text, \
           activated_at IS NOT NULL \
         FROM knowledge_space_profile_publication_bindings \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND publication_id = $3 LIMIT 1 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .bind(publication)
    .fetch_optional(tx)
    .await?;
    Ok(row.map(
        |(
            reason,
            changed,
            e_id,
            e_rev,
            e_digest,
            r_id,
            r_rev,
            r_digest,
            vsid,
            fingerprint,
            activated,
        )| {
            Binding {
                binding_reason: reason,
                changed_kind: changed,
                publication_id: publication,
                publication_fingerprint: fingerprint,
                embedding: match (e_id, e_rev, e_digest) {
                    (Some(id), Some(revision), Some(d)) => Some(ProfileRef {
                        id,
                        revision,
                        snapshot_digest: d.trim().to_owned(),
                    }),
                    _ => None,
                },
                retrieval: ProfileRef {
                    id: r_id,
                    revision: r_rev,
                    snapshot_digest: r_digest.trim().to_owned(),
                },
                vector_space_id: vsid,
                activated,
            }
        },
    ))
}

/// Reads the facts in the platform's lock order: the space (deletion admission), the
/// publication head and its publication, the embedding and retrieval heads, their revisions,
/// the head's projection members (with an embedding vector space), the manifest (without an
/// embedding head), the head's binding.
async fn gather(tx: &mut PgConnection, tenant: &str, space: Uuid) -> Result<Facts, sqlx::Error> {
    let mut f = Facts {
        writable: lock_space(tx, tenant, space).await?,
        ..Facts::default()
    };
    if !f.writable {
        return Ok(f);
    }
    let head: Option<Uuid> = sqlx::query_scalar(
        "SELECT publication_id FROM projection_set_publication_heads \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 LIMIT 1 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(publication_id) = head else {
        return Ok(f);
    };
    let publication: Option<(String, String)> = sqlx::query_as(
        "SELECT fingerprint::text, status::text FROM projection_set_publications \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND id = $3 LIMIT 1 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .bind(publication_id)
    .fetch_optional(&mut *tx)
    .await?;
    f.head = Some(publication.map(|(fingerprint, status)| Publication {
        id: publication_id,
        fingerprint,
        status,
    }));
    let embedding_head = profile_head(tx, tenant, space, "embedding").await?;
    let retrieval_head = profile_head(tx, tenant, space, "retrieval").await?;
    if let Some(h) = embedding_head {
        f.embedding = Some(revision(tx, tenant, space, "embedding", h).await?);
    }
    if let Some(h) = retrieval_head {
        f.retrieval = Some(revision(tx, tenant, space, "retrieval", h).await?);
    }
    let vsid = f
        .embedding
        .as_ref()
        .and_then(|h| h.revision.as_ref())
        .and_then(|r| r.vector_space_id.clone());
    if let Some(vsid) = vsid {
        f.closure = Some(Closure {
            dense_outside: found(tx, DENSE_OUTSIDE, tenant, space, publication_id, &vsid).await?,
            fts_without_twin: found(tx, FTS_WITHOUT_TWIN, tenant, space, publication_id, &vsid)
                .await?,
        });
    }
    if f.embedding.is_none() {
        f.manifest = sqlx::query_scalar(
            "SELECT (metadata -> $3::text) IS NOT NULL FROM knowledge_space_manifests \
             WHERE tenant_id = $1 AND knowledge_space_id = $2 LIMIT 1 FOR UPDATE",
        )
        .bind(tenant)
        .bind(space)
        .bind(EMBEDDING_KEY)
        .fetch_optional(&mut *tx)
        .await?;
    }
    f.existing = existing_binding(tx, tenant, space, publication_id).await?;
    Ok(f)
}

/// Reconciles the space's current head to an activated binding, in one transaction: the
/// facts under their locks, [`decide`], and the binding's row when there is one to write. A
/// refusal writes nothing.
pub async fn bind_current_published(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
) -> Result<Result<Reconciled, Refusal>, sqlx::Error> {
    let mut tx = conn.begin().await?;
    let facts = gather(&mut tx, tenant, space).await?;
    let b = match decide(&facts) {
        Err(r) => return Ok(Err(r)),
        Ok(Plan::Keep) => return Ok(Ok(Reconciled::Kept)),
        Ok(Plan::Insert(b)) => b,
    };
    let id = Uuid::new_v4();
    let e = b.embedding.as_ref();
    let inserted = sqlx::query(
        "INSERT INTO knowledge_space_profile_publication_bindings \
           (id, tenant_id, knowledge_space_id, changed_kind, binding_reason, embedding_profile_kind, \
            embedding_profile_revision_id, embedding_profile_revision, embedding_profile_snapshot_digest, \
            retrieval_profile_kind, retrieval_profile_revision_id, retrieval_profile_revision, \
            retrieval_profile_snapshot_digest, vector_space_id, publication_id, publication_fingerprint, \
            created_at, activated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'retrieval', $10, $11, $12, $13, $14, $15, now(), now()) \
         ON CONFLICT DO NOTHING",
    )
    .bind(id)
    .bind(tenant)
    .bind(space)
    .bind(&b.changed_kind)
    .bind(&b.binding_reason)
    .bind(e.map(|_| "embedding"))
    .bind(e.map(|p| p.id))
    .bind(e.map(|p| p.revision))
    .bind(e.map(|p| p.snapshot_digest.as_str()))
    .bind(b.retrieval.id)
    .bind(b.retrieval.revision)
    .bind(&b.retrieval.snapshot_digest)
    .bind(&b.vector_space_id)
    .bind(b.publication_id)
    .bind(&b.publication_fingerprint)
    .execute(&mut *tx)
    .await?;
    if inserted.rows_affected() != 1 {
        return Ok(Err(Refusal::new(
            code::BINDING_CONFLICT,
            "Publication tuple binding was not inserted",
        )));
    }
    tx.commit().await?;
    Ok(Ok(Reconciled::Bound(id)))
}

/// How the platform's tick counts one reconciliation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tally {
    /// `bindingsReconciled`: bound, or already bound to this tuple.
    Reconciled,
    /// Not ready to be bound yet: not counted.
    NotReady,
    /// `bindingFailed`: any other refusal, or an error.
    Failed,
}

/// Counts a reconciliation (`None`: it ended in an error) as the platform's tick does.
pub fn tally(outcome: Option<&Result<Reconciled, Refusal>>) -> Tally {
    match outcome {
        Some(Ok(_)) => Tally::Reconciled,
        Some(Err(r)) if r.not_ready() => Tally::NotReady,
        _ => Tally::Failed,
    }
}

#[cfg(test)]
mod tests {
    use super::super::profile::derive_capability;
    use super::super::profile::fixtures::{embedding, retrieval, AT};
    use super::*;
    use serde_json::json;

    fn rev(kind: &str, snapshot: Value) -> Revision {
        let capability = derive_capability(kind, &snapshot, AT).unwrap();
        Revision {
            id: Uuid::from_u128(if kind == "embedding" { 1 } else { 2 }),
            revision: 1,
            state: "active".into(),
            snapshot_digest: digest(&snapshot),
            capability_digest: digest(&capability),
            vector_space_id: snapshot["vectorSpaceId"].as_str().map(str::to_owned),
            snapshot,
            capability,
        }
    }

    fn head(r: Revision) -> HeadFacts {
        HeadFacts {
            profile_revision_id: r.id,
            active_revision: r.revision,
            revision: Some(r),
        }
    }

    const CLOSED: Closure = Closure {
        dense_outside: false,
        fts_without_twin: false,
    };

    /// A space whose head the backfill can bind: both profiles, a closed vector space.
    fn ready() -> Facts {
        Facts {
            writable: true,
            head: Some(Some(Publication {
                id: Uuid::from_u128(9),
                fingerprint: "projection-set-sha256:x".into(),
                status: "published".into(),
            })),
            embedding: Some(head(rev("embedding", embedding(Some(8))))),
            retrieval: Some(head(rev("retrieval", retrieval(false)))),
            closure: Some(CLOSED),
            manifest: None,
            existing: None,
        }
    }

    /// A research-only space: no embedding head, a manifest without the embedding key.
    fn research_only() -> Facts {
        Facts {
            embedding: None,
            closure: None,
            manifest: Some(false),
            ..ready()
        }
    }

    fn tuple(f: &Facts) -> Binding {
        match decide(f) {
            Ok(Plan::Insert(b)) => *b,
            other => panic!("{other:?}"),
        }
    }

    fn with(f: Facts, change: impl FnOnce(&mut Facts)) -> Facts {
        let mut f = f;
        change(&mut f);
        f
    }

    fn retrieval_rev(f: &mut Facts) -> &mut Revision {
        f.retrieval.as_mut().unwrap().revision.as_mut().unwrap()
    }

    fn embedding_rev(f: &mut Facts) -> &mut Revision {
        f.embedding.as_mut().unwrap().revision.as_mut().unwrap()
    }

    #[test]
    fn the_tuple_is_the_current_heads_with_the_embedding_vector_space() {
        let b = tuple(&ready());
        let e = rev("embedding", embedding(Some(8)));
        let r = rev("retrieval", retrieval(false));
        assert_eq!(
            b,
            Binding {
                binding_reason: "legacy-bootstrap".into(),
                changed_kind: "bootstrap".into(),
                publication_id: Uuid::from_u128(9),
                publication_fingerprint: "projection-set-sha256:x".into(),
                embedding: Some(ProfileRef {
                    id: e.id,
                    revision: 1,
                    snapshot_digest: e.snapshot_digest.clone()
                }),
                retrieval: ProfileRef {
                    id: r.id,
                    revision: 1,
                    snapshot_digest: r.snapshot_digest
                },
                vector_space_id: e.vector_space_id,
                activated: true,
            }
        );
        let b = tuple(&research_only());
        assert_eq!((b.embedding, b.vector_space_id), (None, None));
    }

    #[test]
    fn decision_table() {
        let bound = tuple(&ready());
        let mut fast = retrieval(false);
        fast["defaultMode"] = json!("fast");
        let mut tampered = embedding(Some(8));
        tampered["dimension"] = json!(9);
        let table: Vec<(&str, Facts, Result<(), &str>)> = vec![
            ("ready", ready(), Ok(())),
            ("research only", research_only(), Ok(())),
            (
                "unwritable",
                with(ready(), |f| f.writable = false),
                Err(code::SPACE_NOT_WRITABLE),
            ),
            (
                "no head",
                with(ready(), |f| f.head = None),
                Err(code::HEAD_MISSING),
            ),
            (
                "dangling head",
                with(ready(), |f| f.head = Some(None)),
                Err(code::HEAD_INVALID),
            ),
            (
                "head superseded",
                with(ready(), |f| {
                    f.head.as_mut().unwrap().as_mut().unwrap().status = "superseded".into()
                }),
                Err(code::HEAD_INVALID),
            ),
            (
                "no retrieval head",
                with(ready(), |f| f.retrieval = None),
                Err(code::RETRIEVAL_PROFILE_REQUIRED),
            ),
            (
                "revision of the head's number missing",
                with(ready(), |f| f.embedding.as_mut().unwrap().revision = None),
                Err(code::PROFILE_NOT_FOUND),
            ),
            (
                "head names another revision",
                with(ready(), |f| {
                    f.retrieval.as_mut().unwrap().profile_revision_id = Uuid::from_u128(7)
                }),
                Err(code::PROFILE_HEAD_INVALID),
            ),
            (
                "snapshot digest",
                with(ready(), |f| {
                    retrieval_rev(f).snapshot_digest = "0".repeat(64)
                }),
                Err(code::PROFILE_CORRUPT),
            ),
            (
                "capability digest",
                with(ready(), |f| {
                    embedding_rev(f).capability_digest = "0".repeat(64)
                }),
                Err(code::CAPABILITY_CORRUPT),
            ),
            (
                "capability of another dimension",
                with(ready(), |f| {
                    let r = embedding_rev(f);
                    r.capability = derive_capability("embedding", &tampered, AT).unwrap();
                    r.capability_digest = digest(&r.capability);
                }),
                Err(code::CAPABILITY_UNVERIFIED),
            ),
            (
                "rerank capability of a rerank-less profile",
                with(ready(), |f| {
                    let r = retrieval_rev(f);
                    r.capability = derive_capability("retrieval", &retrieval(true), AT).unwrap();
                    r.capability_digest = digest(&r.capability);
                }),
                Err(code::CAPABILITY_UNVERIFIED),
            ),
            (
                "revision number differs from the snapshot's",
                with(ready(), |f| {
                    retrieval_rev(f).revision = 2;
                    f.retrieval.as_mut().unwrap().active_revision = 2;
                }),
                Err(code::PROFILE_CORRUPT),
            ),
            (
                "vector space differs from the snapshot's",
                with(ready(), |f| {
                    embedding_rev(f).vector_space_id = Some("embedding-space-sha256:other".into())
                }),
                Err(code::PROFILE_CORRUPT),
            ),
            (
                "embedding superseded",
                with(ready(), |f| embedding_rev(f).state = "superseded".into()),
                Err(code::STATE_CONFLICT),
            ),
            (
                "retrieval superseded",
                with(ready(), |f| retrieval_rev(f).state = "superseded".into()),
                Err(code::STATE_CONFLICT),
            ),
            (
                "a dense member outside the vector space",
                with(ready(), |f| {
                    f.closure = Some(Closure {
                        dense_outside: true,
                        ..CLOSED
                    })
                }),
                Err(code::VECTOR_SPACE_CONFLICT),
            ),
            (
                "an fts member without a dense twin",
                with(ready(), |f| {
                    f.closure = Some(Closure {
                        fts_without_twin: true,
                        ..CLOSED
                    })
                }),
                Err(code::VECTOR_SPACE_CONFLICT),
            ),
            (
                "closure not read",
                with(ready(), |f| f.closure = None),
                Err(code::VECTOR_SPACE_CONFLICT),
            ),
            (
                "no manifest",
                with(research_only(), |f| f.manifest = None),
                Err(code::MANIFEST_MISSING),
            ),
            (
                "manifest expects an embedding profile",
                with(research_only(), |f| f.manifest = Some(true)),
                Err(code::NOT_READY),
            ),
            (
                "fast retrieval without embedding",
                with(research_only(), |f| {
                    let r = retrieval_rev(f);
                    r.snapshot = fast.clone();
                    r.snapshot_digest = digest(&fast);
                }),
                Err(code::EMBEDDING_REQUIRED),
            ),
            (
                "same tuple bound",
                with(ready(), |f| f.existing = Some(bound.clone())),
                Ok(()),
            ),
            (
                "another reason",
                with(ready(), |f| {
                    f.existing = Some(Binding {
                        binding_reason: "content-publication".into(),
                        changed_kind: "content".into(),
                        ..bound.clone()
                    })
                }),
                Err(code::BINDING_CONFLICT),
            ),
            (
                "another retrieval revision",
                with(ready(), |f| {
                    f.existing = Some(Binding {
                        retrieval: ProfileRef {
                            revision: 2,
                            ..bound.retrieval.clone()
                        },
                        ..bound.clone()
                    })
                }),
                Err(code::BINDING_CONFLICT),
            ),
            (
                "same tuple, not activated",
                with(ready(), |f| {
                    f.existing = Some(Binding {
                        activated: false,
                        ..bound.clone()
                    })
                }),
                Err(code::BINDING_NOT_ACTIVE),
            ),
        ];
        for (name, facts, want) in table {
            let got = decide(&facts).map(|_| ()).map_err(|r| r.code);
            assert_eq!(got, want, "{name}");
        }
        assert_eq!(
            decide(&with(ready(), |f| f.existing = Some(bound.clone()))),
            Ok(Plan::Keep)
        );
    }

    #[test]
    fn tally_table() {
        let refused = |code| Err(Refusal::new(code, ""));
        let table: Vec<(Option<Result<Reconciled, Refusal>>, Tally)> = vec![
            (Some(Ok(Reconciled::Bound(Uuid::nil()))), Tally::Reconciled),
            (Some(Ok(Reconciled::Kept)), Tally::Reconciled),
            (Some(refused(code::HEAD_MISSING)), Tally::NotReady),
            (
                Some(refused(code::RETRIEVAL_PROFILE_REQUIRED)),
                Tally::NotReady,
            ),
            (Some(refused(code::NOT_READY)), Tally::NotReady),
            (Some(refused(code::VECTOR_SPACE_CONFLICT)), Tally::Failed),
            (Some(refused(code::BINDING_CONFLICT)), Tally::Failed),
            (Some(refused(code::SPACE_NOT_WRITABLE)), Tally::Failed),
            (None, Tally::Failed),
        ];
        for (outcome, want) in table {
            assert_eq!(tally(outcome.as_ref()), want, "{outcome:?}");
        }
    }
}
