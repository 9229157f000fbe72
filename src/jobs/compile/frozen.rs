//! An attempt's profile work at its first step: binding the space's current profile tuple onto
//! an attempt written without one, and reading the frozen embedding profile it builds with.
//! Invariant: the decisions are [`super::profiles`]'s pure functions; this file only reads and
//! writes the attempt's row, under the step's fence.

use sqlx::PgConnection;
use uuid::Uuid;

use super::profiles::*;
use super::steps::Attempt;
use crate::embed::Profile;
use crate::jobs::JobError;
use crate::publication::binding::ProfileRef;

/// The first step's profile work: binds the space's current tuple onto an attempt written
/// without one (columns only; the step's own checkpoint write bumps the row version), or fails
/// the attempt as [`ready`] decides.
pub(crate) async fn ensure_ready(conn: &mut PgConnection, a: &mut Attempt) -> Result<(), JobError> {
    let current = if a.profiles.is_some() {
        Vec::new()
    } else {
        heads(conn, &a.tenant, a.space).await?
    };
    match ready(a.profiles.as_ref(), &current) {
        Ready::Keep => Ok(()),
        Ready::Fail { code, message } => Err(JobError::fatal(code, message)),
        Ready::Bind(f) => {
            let e = f.embedding.as_ref();
            let bound = sqlx::query(
                "UPDATE document_compilation_attempts SET embedding_profile_kind = $2, \
                   embedding_profile_revision_id = $3, embedding_profile_revision = $4, \
                   embedding_profile_snapshot_digest = $5, retrieval_profile_kind = 'retrieval', \
                   retrieval_profile_revision_id = $6, retrieval_profile_revision = $7, \
                   retrieval_profile_snapshot_digest = $8, updated_at = now() \
                 WHERE id = $1 AND checkpoint = 'queued' AND candidate_publication_id IS NULL \
                   AND retrieval_profile_kind IS NULL AND embedding_profile_kind IS NULL",
            )
            .bind(a.id)
            .bind(e.map(|_| "embedding"))
            .bind(e.map(|e| e.revision_id))
            .bind(e.map(|e| e.revision))
            .bind(e.map(|e| e.digest.clone()))
            .bind(f.retrieval.revision_id)
            .bind(f.retrieval.revision)
            .bind(&f.retrieval.digest)
            .execute(&mut *conn)
            .await?;
            if bound.rows_affected() != 1 {
                return Err(JobError::retryable(
                    BIND_FAILED,
                    "the attempt's initial profiles could not be bound",
                ));
            }
            a.profiles = Some(f);
            Ok(())
        }
    }
}

/// The frozen embedding profile the attempt builds with (and its snapshot digest), or none; the
/// platform's `loadDocumentCompilationFrozenProfiles`: the frozen revisions must still be stored
/// as frozen, `active` or `superseded` (the heads are not consulted here, only at publish).
pub(crate) async fn frozen_embedding(
    conn: &mut PgConnection,
    a: &Attempt,
) -> Result<Option<(Profile, String)>, JobError> {
    let invalid = |why: String| JobError::fatal(SNAPSHOT_INVALID, why);
    let f = a
        .profiles
        .as_ref()
        .ok_or_else(|| invalid("the attempt froze no retrieval profile".into()))?;
    let ids: Vec<Uuid> = std::iter::once(f.retrieval.revision_id)
        .chain(f.embedding.as_ref().map(|e| e.revision_id))
        .collect();
    let rows: Vec<Stored> = sqlx::query_as(
        "SELECT id, kind::text AS kind, revision, snapshot_digest::text AS digest, model::text AS model, \
           plugin_id::text AS plugin_id, provider::text AS provider, vector_space_id::text AS vector_space_id, \
           dimension \
         FROM knowledge_space_profile_revisions \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND id = ANY($3) AND state IN ('active', 'superseded')",
    )
    .bind(&a.tenant)
    .bind(a.space)
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await?;
    let find = |kind: &str, r: &ProfileRef| {
        rows.iter().find(|s| {
            s.id == r.revision_id
                && s.kind == kind
                && s.revision == r.revision
                && s.digest == r.digest
        })
    };
    if find("retrieval", &f.retrieval).is_none() {
        return Err(invalid(format!(
            "the attempt's retrieval profile revision {} is no longer stored as it was frozen",
            f.retrieval.revision
        )));
    }
    let Some(e) = &f.embedding else {
        return Ok(None);
    };
    let s = find("embedding", e).ok_or_else(|| {
        invalid(format!(
            "the attempt's embedding profile revision {} is no longer stored as it was frozen",
            e.revision
        ))
    })?;
    let (Some(vector_space_id), Some(dimension)) = (
        s.vector_space_id.clone(),
        s.dimension.and_then(|d| usize::try_from(d).ok()),
    ) else {
        return Err(invalid(
            "the attempt's embedding profile revision has no vector space".into(),
        ));
    };
    Ok(Some((
        Profile {
            revision_id: e.revision_id,
            revision: s.revision,
            model: s.model.clone(),
            plugin_id: s.plugin_id.clone(),
            provider: s.provider.clone(),
            vector_space_id,
            dimension,
        },
        s.digest.clone(),
    )))
}

/// A stored profile revision, as [`frozen_embedding`] reads it.
#[derive(sqlx::FromRow)]
struct Stored {
    id: Uuid,
    kind: String,
    revision: i32,
    digest: String,
    model: String,
    plugin_id: String,
    provider: String,
    vector_space_id: Option<String>,
    dimension: Option<i32>,
}
