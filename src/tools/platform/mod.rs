//! The platform API's own rows that jobs work on: spaces (with their manifest, access control and
//! initial retrieval profile), sources (with their secret lifecycle), uploaded documents (with
//! their logical document and candidate revision), permission snapshots, capability grants and
//! embedding and retrieval profiles, written the way the platform's API writes them. kfs-worker writes these
//! only for its demo, its tests, its bench and its command line. Invariant: every row is written
//! complete and consistent with the platform's constraints, scoped to its tenant and space; a
//! document's bytes reach the object store before the row that names them commits.
//!
//! Where these fixtures choose differently from the platform's defaults, they say so: a space is
//! shared with all its members and open to API channels (the platform starts a space as the
//! owner's only, API access off), so that tests can issue snapshots for several subjects and
//! channels; a snapshot lasts a day unless told otherwise (the platform's last an hour).
//!
//! By concern: [`space`] (spaces, members, sources), [`document`] (uploads and new versions),
//! [`snapshot`] (permission snapshots), [`grant`] (capability grants and the space's fence), [`profile`] (embedding and retrieval profiles) and
//! [`notes`] (a ready space of sample notes). Everything is re-exported here, so callers name
//! `platform::create_space` and the like.

pub mod document;
pub mod grant;
pub mod notes;
pub mod profile;
pub mod snapshot;
pub mod space;

use crate::store::StoreError;

pub use crate::canonical::sha256_hex;
pub use document::{
    add_document, add_revision, document_key, logical_document_of, replace_document,
    sanitize_filename, upload, Upload,
};
pub use grant::{create_capability_grant, fence_capability_space, revoke_capability_grant};
pub use notes::{create_notes_space, sample_note, NotesSpace};
pub use profile::{activate_embedding_profile, activate_retrieval_profile, vector_space_id};
pub use snapshot::{create_permission_snapshot, permission_scopes, revoke_permission_snapshot};
pub use space::{
    add_member, create_bare_space, create_source, create_space, new_credential_ref,
    object_key_prefix, INITIAL_RETRIEVAL_MODEL,
};

#[derive(Debug, thiserror::Error)]
pub enum PlatformError {
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("{0}")]
    NotFound(String),
}

#[cfg(test)]
mod tests {
    use uuid::Uuid;

    use super::*;

    #[test]
    fn keys_and_names_follow_the_platform() {
        assert_eq!(
            object_key_prefix("acme corp/eu", Uuid::nil()),
            format!("acme-corp-eu/spaces/{}", Uuid::nil())
        );
        assert_eq!(
            object_key_prefix("//", Uuid::nil()),
            format!("tenant/spaces/{}", Uuid::nil())
        );
        assert_eq!(
            sanitize_filename("dir/My Report (v2).PDF"),
            "my-report-v2-.pdf"
        );
        assert_eq!(sanitize_filename("..."), "upload");
        assert_eq!(
            vector_space_id("text-embedding-3-small", "langgenius/openai", "openai", 1),
            "embedding-space-sha256:dee54439e74d6aa00be2145649df55d567e0587ee48bd89a7b27a9b10a846fa1"
        );
        let scopes = permission_scopes("t", Uuid::nil(), "u", "owner", "only_me");
        assert_eq!(scopes.len(), 5);
        assert!(scopes.windows(2).all(|w| w[0] < w[1]));
        assert!(scopes.contains(&format!(
            "knowledge-space:{}:visibility:only_me:u",
            Uuid::nil()
        )));
    }
}
