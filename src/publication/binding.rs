//! The profile binding of a content publication (the platform's 0019
//! `knowledge_space_profile_publication_bindings`): the embedding and retrieval profile tuple a
//! published head was built under, which the platform's published-runtime-snapshot resolver
//! requires, activated, beside the head it reads. Invariant: a compile's publication gets exactly
//! one activated `content-publication` row, its id the publication's, written in the publishing
//! transaction before the head moves (so the binding and the head become visible together or not
//! at all); an identical activated row already there is kept, any other row refuses the publish.
//! A head a deletion replaces hands its activated binding on ([`carry`]) in the same transaction.

use sqlx::PgConnection;
use uuid::Uuid;

/// One frozen profile reference: the revision row's id, number and snapshot digest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProfileRef {
    pub revision_id: Uuid,
    pub revision: i32,
    pub digest: String,
}

/// The embedding profile of a tuple, with its revision's vector space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Embedding {
    pub profile: ProfileRef,
    pub vector_space_id: String,
}

/// The verified profile tuple a publication is bound to: a retrieval profile always, an
/// embedding profile when the space has one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tuple {
    pub retrieval: ProfileRef,
    pub embedding: Option<Embedding>,
}

/// A binding row of the publication that is not the one this publish would write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conflict;

type Row = (
    String,
    String,
    Option<String>,
    Option<Uuid>,
    Option<i32>,
    Option<String>,
    String,
    Uuid,
    i32,
    String,
    Option<String>,
    String,
    bool,
);

/// Whether an existing row is the activated `content-publication` binding of `fingerprint`
/// under `tuple`. Pure.
fn same(row: &Row, fingerprint: &str, tuple: &Tuple) -> bool {
    let (
        changed_kind,
        reason,
        e_kind,
        e_id,
        e_rev,
        e_digest,
        r_kind,
        r_id,
        r_rev,
        r_digest,
        vsid,
        fp,
        activated,
    ) = row;
    let embedding = match &tuple.embedding {
        Some(e) => {
            e_kind.as_deref() == Some("embedding")
                && *e_id == Some(e.profile.revision_id)
                && *e_rev == Some(e.profile.revision)
                && e_digest.as_deref() == Some(e.profile.digest.as_str())
                && vsid.as_deref() == Some(e.vector_space_id.as_str())
        }
        None => {
            e_kind.is_none()
                && e_id.is_none()
                && e_rev.is_none()
                && e_digest.is_none()
                && vsid.is_none()
        }
    };
    embedding
        && changed_kind == "content"
        && reason == "content-publication"
        && r_kind == "retrieval"
        && *r_id == tuple.retrieval.revision_id
        && *r_rev == tuple.retrieval.revision
        && *r_digest == tuple.retrieval.digest
        && fp == fingerprint
        && *activated
}

/// Binds publication `publication` (fingerprint `fingerprint`) of the space to `tuple`:
/// `changed_kind = 'content'`, `binding_reason = 'content-publication'`, the row's id the
/// publication's, created and activated now (the transaction's time, as the publication's own
/// transitions). The publication's binding row is locked first; an identical activated one is a
/// no-op, any other is a [`Conflict`].
pub async fn bind(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    publication: Uuid,
    fingerprint: &str,
    tuple: &Tuple,
) -> Result<Result<(), Conflict>, sqlx::Error> {
    let existing: Option<Row> = sqlx::query_as(
        "SELECT changed_kind::text, binding_reason::text, embedding_profile_kind::text, embedding_profile_revision_id, \
           embedding_profile_revision, embedding_profile_snapshot_digest::text, retrieval_profile_kind::text, \
           retrieval_profile_revision_id, retrieval_profile_revision, retrieval_profile_snapshot_digest::text, \
           vector_space_id::text, publication_fingerprint::text, activated_at IS NOT NULL \
         FROM knowledge_space_profile_publication_bindings \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND publication_id = $3 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .bind(publication)
    .fetch_optional(&mut *conn)
    .await?;
    if let Some(row) = existing {
        return Ok(if same(&row, fingerprint, tuple) {
            Ok(())
        } else {
            Err(Conflict)
        });
    }
    let e = tuple.embedding.as_ref();
    let inserted = sqlx::query(
        "INSERT INTO knowledge_space_profile_publication_bindings (id, tenant_id, knowledge_space_id, changed_kind, \
           binding_reason, embedding_profile_kind, embedding_profile_revision_id, embedding_profile_revision, \
           embedding_profile_snapshot_digest, retrieval_profile_kind, retrieval_profile_revision_id, \
           retrieval_profile_revision, retrieval_profile_snapshot_digest, vector_space_id, publication_id, \
           publication_fingerprint, created_at, activated_at) \
         VALUES ($3, $1, $2, 'content', 'content-publication', $4, $5, $6, $7, 'retrieval', $8, $9, $10, $11, $3, $12, \
           now(), now()) \
         ON CONFLICT DO NOTHING",
    )
    .bind(tenant)
    .bind(space)
    .bind(publication)
    .bind(e.map(|_| "embedding"))
    .bind(e.map(|e| e.profile.revision_id))
    .bind(e.map(|e| e.profile.revision))
    .bind(e.map(|e| e.profile.digest.clone()))
    .bind(tuple.retrieval.revision_id)
    .bind(tuple.retrieval.revision)
    .bind(&tuple.retrieval.digest)
    .bind(e.map(|e| e.vector_space_id.clone()))
    .bind(fingerprint)
    .execute(conn)
    .await?;
    Ok(if inserted.rows_affected() == 1 {
        Ok(())
    } else {
        Err(Conflict)
    })
}

/// Copies the activated binding of publication `from` to publication `to` (fingerprint
/// `fingerprint`) as a `content-publication` row whose id is `to`'s, as the platform's deletion
/// does when it replaces a head; a publication without one hands nothing on. Returns the rows
/// written (0 or 1).
pub async fn carry(
    conn: &mut PgConnection,
    tenant: &str,
    space: Uuid,
    from: Uuid,
    to: Uuid,
    fingerprint: &str,
) -> Result<u64, sqlx::Error> {
    Ok(sqlx::query(
        "INSERT INTO knowledge_space_profile_publication_bindings (id, tenant_id, knowledge_space_id, changed_kind, \
           binding_reason, embedding_profile_kind, embedding_profile_revision_id, embedding_profile_revision, \
           embedding_profile_snapshot_digest, retrieval_profile_kind, retrieval_profile_revision_id, \
           retrieval_profile_revision, retrieval_profile_snapshot_digest, vector_space_id, publication_id, \
           publication_fingerprint, created_at, activated_at) \
         SELECT $4, b.tenant_id, b.knowledge_space_id, 'content', 'content-publication', b.embedding_profile_kind, \
           b.embedding_profile_revision_id, b.embedding_profile_revision, b.embedding_profile_snapshot_digest, \
           b.retrieval_profile_kind, b.retrieval_profile_revision_id, b.retrieval_profile_revision, \
           b.retrieval_profile_snapshot_digest, b.vector_space_id, $4, $5, now(), now() \
         FROM knowledge_space_profile_publication_bindings b \
         WHERE b.tenant_id = $1 AND b.knowledge_space_id = $2 AND b.publication_id = $3 AND b.activated_at IS NOT NULL",
    )
    .bind(tenant)
    .bind(space)
    .bind(from)
    .bind(to)
    .bind(fingerprint)
    .execute(conn)
    .await?
    .rows_affected())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_identical_activated_content_binding_is_the_same() {
        let r = ProfileRef {
            revision_id: Uuid::from_u128(1),
            revision: 2,
            digest: "a".repeat(64),
        };
        let e = Embedding {
            profile: ProfileRef {
                revision_id: Uuid::from_u128(3),
                revision: 1,
                digest: "b".repeat(64),
            },
            vector_space_id: "embedding-space-sha256:x".into(),
        };
        let with_e = Tuple {
            retrieval: r.clone(),
            embedding: Some(e.clone()),
        };
        let without = Tuple {
            retrieval: r.clone(),
            embedding: None,
        };
        let row = |t: &Tuple, reason: &str, fp: &str, activated: bool| -> Row {
            let e = t.embedding.as_ref();
            (
                if reason == "content-publication" {
                    "content".into()
                } else {
                    "retrieval".into()
                },
                reason.into(),
                e.map(|_| "embedding".to_owned()),
                e.map(|e| e.profile.revision_id),
                e.map(|e| e.profile.revision),
                e.map(|e| e.profile.digest.clone()),
                "retrieval".into(),
                t.retrieval.revision_id,
                t.retrieval.revision,
                t.retrieval.digest.clone(),
                e.map(|e| e.vector_space_id.clone()),
                fp.into(),
                activated,
            )
        };
        let moved = Tuple {
            retrieval: ProfileRef {
                revision: 3,
                ..r.clone()
            },
            embedding: None,
        };
        // (existing row, tuple this publish binds, same)
        let table = [
            (
                row(&with_e, "content-publication", "fp", true),
                &with_e,
                true,
            ),
            (
                row(&without, "content-publication", "fp", true),
                &without,
                true,
            ),
            (
                row(&without, "content-publication", "fp", false),
                &without,
                false,
            ),
            (
                row(&without, "content-publication", "other", true),
                &without,
                false,
            ),
            (
                row(&without, "candidate-switch", "fp", true),
                &without,
                false,
            ),
            (
                row(&with_e, "content-publication", "fp", true),
                &without,
                false,
            ),
            (
                row(&without, "content-publication", "fp", true),
                &with_e,
                false,
            ),
            (
                row(&moved, "content-publication", "fp", true),
                &without,
                false,
            ),
        ];
        for (i, (existing, tuple, want)) in table.into_iter().enumerate() {
            assert_eq!(same(&existing, "fp", tuple), want, "case {i}");
        }
    }
}
