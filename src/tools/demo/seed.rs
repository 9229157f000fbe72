//! The demo's own data: a space of the `kfs-demo` tenant with two sources and the seven
//! documents (a PDF and a Word document among them) shipped in the binary, and a second space
//! whose retrieval profile names a reasoning model, with one of them. Invariant: it writes and removes rows and object keys of the demo's
//! tenant only, and the seed commits as one transaction.

use bytes::Bytes;
use sqlx::PgPool;
use uuid::Uuid;

use super::{SUBJECT, TENANT};
use crate::store::Store;
use crate::tools::platform;

/// The dimension of the demo space's embedding profile.
const EMBEDDING_DIMENSION: usize = 64;

/// The documents, written for this project.
const DOCUMENTS: [(&str, &str, &str, &[u8]); 7] = [
    (
        "guides",
        "outbox-relay.md",
        "text/markdown",
        include_bytes!("../../../examples/demo/outbox-relay.md"),
    ),
    (
        "guides",
        "leases-and-fencing.html",
        "text/html",
        include_bytes!("../../../examples/demo/leases-and-fencing.html"),
    ),
    (
        "guides",
        "research-tasks.md",
        "text/markdown",
        include_bytes!("../../../examples/demo/research-tasks.md"),
    ),
    // A PDF and a Word document, parsed by the local parsers (`ops/make-demo-documents`).
    (
        "guides",
        "runbook.pdf",
        "application/pdf",
        include_bytes!("../../../examples/demo/runbook.pdf"),
    ),
    (
        "guides",
        "onboarding.docx",
        "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
        include_bytes!("../../../examples/demo/onboarding.docx"),
    ),
    (
        "notes",
        "deletion-guide.txt",
        "text/plain",
        include_bytes!("../../../examples/demo/deletion-guide.txt"),
    ),
    (
        "notes",
        "operations.md",
        "text/markdown",
        include_bytes!("../../../examples/demo/operations.md"),
    ),
];

pub(super) struct Seed {
    pub(super) space: Uuid,
    pub(super) notes: Uuid,
    pub(super) snapshot: Uuid,
    pub(super) documents: Vec<(String, Uuid)>,
    /// A second space whose retrieval profile names a reasoning model (the workers run the
    /// offline one), and its document: compiled model-driven.
    pub(super) reasoning: Uuid,
    pub(super) reasoning_documents: Vec<(String, Uuid)>,
}

/// The model-driven space's document: named teams, people and systems for its graph.
const REASONING_DOCUMENT: (&str, &str, &[u8]) = (
    "incident-review.md",
    "text/markdown",
    include_bytes!("../../../examples/demo/incident-review.md"),
);

/// The reasoning model the second space's retrieval profile selects.
pub(super) const REASONING_MODEL: &str = "kfs-demo-reasoner";

pub(super) async fn seed(pool: &PgPool, store: &Store) -> Result<Seed, String> {
    let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
    let space = platform::create_space(&mut tx, TENANT, "handbook", "Worker handbook", SUBJECT)
        .await
        .map_err(|e| e.to_string())?;
    // The space embeds with the offline embedder's vectors (the workers run KFS_EMBEDDER=offline),
    // so every node gets a dense projection beside its full-text one.
    platform::activate_embedding_profile(
        &mut tx,
        TENANT,
        space,
        "kfs-demo-embedding",
        "offline",
        EMBEDDING_DIMENSION,
    )
    .await
    .map_err(|e| e.to_string())?;
    platform::activate_retrieval_profile(&mut tx, TENANT, space, "kfs-demo-extractive", "offline")
        .await
        .map_err(|e| e.to_string())?;
    let guides = platform::create_source(
        &mut tx,
        space,
        "guides",
        "upload",
        Some(&platform::new_credential_ref()),
    )
    .await
    .map_err(|e| e.to_string())?;
    let notes = platform::create_source(
        &mut tx,
        space,
        "notes",
        "upload",
        Some(&platform::new_credential_ref()),
    )
    .await
    .map_err(|e| e.to_string())?;
    let snapshot =
        platform::create_permission_snapshot(&mut tx, TENANT, space, SUBJECT, "interactive", None)
            .await
            .map_err(|e| e.to_string())?;
    let mut documents = Vec::new();
    for (source, name, mime, bytes) in DOCUMENTS {
        let src = if source == "guides" { guides } else { notes };
        let id = platform::add_document(
            &mut tx,
            store,
            space,
            Some(src),
            name,
            mime,
            Bytes::from_static(bytes),
        )
        .await
        .map_err(|e| e.to_string())?;
        documents.push((name.to_owned(), id));
    }
    let reasoning = platform::create_space(
        &mut tx,
        TENANT,
        "handbook-models",
        "Worker handbook, model-driven",
        SUBJECT,
    )
    .await
    .map_err(|e| e.to_string())?;
    platform::activate_embedding_profile(
        &mut tx,
        TENANT,
        reasoning,
        "kfs-demo-embedding",
        "offline",
        EMBEDDING_DIMENSION,
    )
    .await
    .map_err(|e| e.to_string())?;
    platform::activate_retrieval_profile(&mut tx, TENANT, reasoning, REASONING_MODEL, "offline")
        .await
        .map_err(|e| e.to_string())?;
    let (name, mime, bytes) = REASONING_DOCUMENT;
    let id = platform::add_document(
        &mut tx,
        store,
        reasoning,
        None,
        name,
        mime,
        Bytes::from_static(bytes),
    )
    .await
    .map_err(|e| e.to_string())?;
    tx.commit().await.map_err(|e| e.to_string())?;
    Ok(Seed {
        space,
        notes,
        snapshot,
        documents,
        reasoning,
        reasoning_documents: vec![(format!("{name} (model-driven)"), id)],
    })
}

/// Removes everything the demo wrote before: its tenant's rows and object keys.
pub(super) async fn reset(pool: &PgPool, store: &Store) -> Result<(), String> {
    let keys: Vec<String> = sqlx::query_scalar(
        "SELECT d.object_key FROM document_assets d JOIN knowledge_spaces s ON s.id = d.knowledge_space_id \
         WHERE s.tenant_id = $1",
    )
    .bind(TENANT)
    .fetch_all(pool)
    .await
    .map_err(|e| e.to_string())?;
    for k in keys {
        store.delete(&k).await.map_err(|e| e.to_string())?;
    }
    let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
    // Order matters: rows that RESTRICT-reference publications go before the spaces cascade.
    for sql in [
        "DELETE FROM projection_set_publication_heads WHERE tenant_id = $1",
        "DELETE FROM document_compilation_attempts WHERE tenant_id = $1",
        "DELETE FROM legacy_space_publication_bootstraps WHERE tenant_id = $1",
        "DELETE FROM deletion_jobs WHERE tenant_id = $1",
        "DELETE FROM deletion_tombstones WHERE tenant_id = $1",
        "DELETE FROM deletion_retry_audits WHERE tenant_id = $1",
        "DELETE FROM research_task_jobs WHERE tenant_id = $1",
        "DELETE FROM source_secret_lifecycle_refs WHERE tenant_id = $1",
        "DELETE FROM knowledge_space_profile_publication_bindings WHERE tenant_id = $1",
        "DELETE FROM document_reindex_attempts WHERE tenant_id = $1",
        "DELETE FROM document_chunk_state_changes WHERE tenant_id = $1",
        "DELETE FROM document_settings_heads WHERE tenant_id = $1",
        "DELETE FROM logical_documents WHERE tenant_id = $1",
        "DELETE FROM knowledge_spaces WHERE tenant_id = $1",
    ] {
        sqlx::query(sql)
            .bind(TENANT)
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
    }
    tx.commit().await.map_err(|e| e.to_string())
}
