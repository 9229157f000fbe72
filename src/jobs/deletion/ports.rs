//! The ports a deletion erases through: the object store, the secret store and the retrieval
//! cache. Invariant: every port call is idempotent (erasing what is already gone succeeds), and
//! a port error never carries the secret reference it was asked to erase.

use std::sync::Arc;

use crate::store::{Store, StoreError};

/// A failed erase.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortError {
    /// Short, stable code (`object_store`, `secret_store`, ...), stored on the item.
    pub code: String,
    /// Human text, stored on the item. Must never contain a credential reference.
    pub message: String,
    /// `false`: no later attempt can succeed (e.g. a malformed key); the item goes dead now.
    pub retryable: bool,
}

impl PortError {
    pub fn retryable(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            code: code.into(),
            message: message.into(),
            retryable: true,
        }
    }

    pub fn permanent(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            code: code.into(),
            message: message.into(),
            retryable: false,
        }
    }
}

/// Where document bytes are erased.
#[async_trait::async_trait]
pub trait ObjectEraser: Send + Sync + 'static {
    async fn delete_object(&self, key: &str) -> Result<(), PortError>;
}

/// Where source credentials are erased (`sources.credential_ref` names them).
#[async_trait::async_trait]
pub trait SecretStore: Send + Sync + 'static {
    async fn delete_secret(&self, credential_ref: &str) -> Result<(), PortError>;
}

/// The retrieval cache; keys follow [`super::cache_key_for_document`] and
/// [`super::cache_key_for_space`].
#[async_trait::async_trait]
pub trait RetrievalCache: Send + Sync + 'static {
    async fn evict(&self, key: &str) -> Result<(), PortError>;
}

#[async_trait::async_trait]
impl ObjectEraser for Store {
    async fn delete_object(&self, key: &str) -> Result<(), PortError> {
        match self.delete(key).await {
            Ok(()) | Err(StoreError::NotFound(_)) => Ok(()),
            Err(e @ StoreError::BadKey(_)) => {
                Err(PortError::permanent("object_key_invalid", e.to_string()))
            }
            Err(e) => Err(PortError::retryable("object_store", e.to_string())),
        }
    }
}

/// The default secret store: kfs-worker has no secret manager of its own, so erasing a
/// reference means forgetting it (the item's `credential_ref` is redacted) and logging that it
/// happened, by digest only.
#[derive(Clone, Debug, Default)]
pub struct ForgetSecrets;

#[async_trait::async_trait]
impl SecretStore for ForgetSecrets {
    async fn delete_secret(&self, credential_ref: &str) -> Result<(), PortError> {
        let digest = crate::platform::sha256_hex(credential_ref.as_bytes());
        tracing::info!(credential_digest = &digest[..16], "secret reference erased");
        Ok(())
    }
}

/// The default cache: kfs-worker runs without a shared retrieval cache, so there is nothing to
/// evict.
#[derive(Clone, Debug, Default)]
pub struct NoCache;

#[async_trait::async_trait]
impl RetrievalCache for NoCache {
    async fn evict(&self, _key: &str) -> Result<(), PortError> {
        Ok(())
    }
}

/// The three ports together.
#[derive(Clone)]
pub struct Ports {
    pub objects: Arc<dyn ObjectEraser>,
    pub secrets: Arc<dyn SecretStore>,
    pub cache: Arc<dyn RetrievalCache>,
}

impl std::fmt::Debug for Ports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ports")
    }
}
