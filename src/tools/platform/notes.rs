//! A space of sample notes, ready for the platform's jobs, as the bench and the chaos run use
//! it. Invariant: every row goes through the caller's connection, so in the caller's transaction
//! the space appears whole or not at all (uploaded bytes stay in the object store either way).

use bytes::Bytes;
use sqlx::PgConnection;
use uuid::Uuid;

use super::{add_document, create_permission_snapshot, create_source, create_space, PlatformError};
use crate::store::Store;

/// A space set up for the platform's jobs to run on, as the bench and the chaos run use it.
#[derive(Clone, Debug)]
pub struct NotesSpace {
    pub space: Uuid,
    /// An interactive permission snapshot of the subject that requests research and deletions.
    pub snapshot: Uuid,
    pub documents: Vec<Uuid>,
}

/// A small Markdown note about leases and fencing, different for each `i`.
pub fn sample_note(i: usize) -> String {
    format!(
        "# Note {i}\n\nThe relay publishes outbox row {i} with publisher confirms, and a consumer \
         claims job {i} under a lease before it runs a step.\n\n## Fencing\n\nA worker whose lease \
         expired is fenced out by the row version; checkpoint {i} commits together with its step.\n\n\
         - retries back off exponentially\n- deletions quiesce the document first\n- research cites \
         note {i}\n"
    )
}

/// Creates a space owned by `subject` with an upload source, an interactive permission snapshot
/// for `subject` and `n` sample notes (`note-<i>.md`), in the caller's transaction.
pub async fn create_notes_space(
    conn: &mut PgConnection,
    store: &Store,
    tenant: &str,
    subject: &str,
    slug: &str,
    n: usize,
) -> Result<NotesSpace, PlatformError> {
    let space = create_space(conn, tenant, slug, &format!("{slug} notes"), subject).await?;
    let source = create_source(conn, space, "notes", "upload", None).await?;
    let snapshot =
        create_permission_snapshot(conn, tenant, space, subject, "interactive", None).await?;
    let mut documents = Vec::with_capacity(n);
    for i in 0..n {
        let id = add_document(
            conn,
            store,
            space,
            Some(source),
            &format!("note-{i}.md"),
            "text/markdown",
            Bytes::from(sample_note(i)),
        )
        .await?;
        documents.push(id);
    }
    Ok(NotesSpace {
        space,
        snapshot,
        documents,
    })
}
