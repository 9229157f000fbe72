//! The ports a deletion works through: the object store (erase, list, probe), the secret store
//! and the retrieval cache. Invariant: every erase is idempotent (erasing what is already gone
//! succeeds), listings only ever name keys under the folder they were asked for, and a port
//! error never carries the secret reference it was asked to erase.

use std::sync::Arc;

use uuid::Uuid;

use crate::store::{Store, StoreError};

/// A failed port call.
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

/// Where document bytes live: erased item by item, listed by folder for the inventory and the
/// final probe.
#[async_trait::async_trait]
pub trait ObjectEraser: Send + Sync + 'static {
    async fn delete_object(&self, key: &str) -> Result<(), PortError>;

    /// Up to `limit` keys under the folder `prefix`, after `after`, in byte order.
    async fn list_objects(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<String>, PortError>;

    async fn object_exists(&self, key: &str) -> Result<bool, PortError>;
}

/// The secret a `secret_ref` item names, with the tenant, space and source it belongs to.
#[derive(Clone, Copy, Debug)]
pub struct SecretRef<'a> {
    pub tenant: &'a str,
    pub space: Uuid,
    pub source: Option<Uuid>,
    pub credential_ref: &'a str,
}

/// Where source credentials are erased (`sources.credential_ref` and the 0014 lifecycle rows
/// name them).
#[async_trait::async_trait]
pub trait SecretStore: Send + Sync + 'static {
    async fn delete_secret(&self, secret: &SecretRef<'_>) -> Result<(), PortError>;
}

/// One page of a cache prefix deletion.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CachePage {
    pub deleted: u64,
    /// More keys remain under the prefix.
    pub more: bool,
}

/// The retrieval cache, drained by key prefix ([`super::cache_prefixes`]).
#[async_trait::async_trait]
pub trait RetrievalCache: Send + Sync + 'static {
    async fn delete_prefix(&self, prefix: &str, limit: usize) -> Result<CachePage, PortError>;
}

fn store_error(e: StoreError) -> PortError {
    match e {
        e @ StoreError::BadKey(_) => PortError::permanent("object_key_invalid", e.to_string()),
        e => PortError::retryable("object_store", e.to_string()),
    }
}

#[async_trait::async_trait]
impl ObjectEraser for Store {
    async fn delete_object(&self, key: &str) -> Result<(), PortError> {
        match self.delete(key).await {
            Ok(()) | Err(StoreError::NotFound(_)) => Ok(()),
            Err(e) => Err(store_error(e)),
        }
    }

    async fn list_objects(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<String>, PortError> {
        self.list(prefix, after, limit).await.map_err(store_error)
    }

    async fn object_exists(&self, key: &str) -> Result<bool, PortError> {
        self.exists(key).await.map_err(store_error)
    }
}

/// The default secret store: kfs-worker has no secret manager of its own, so erasing a
/// reference means forgetting it (the item's `credential_ref` is redacted, the lifecycle row
/// marked deleted) and logging that it happened, by digest only.
#[derive(Clone, Debug, Default)]
pub struct ForgetSecrets;

#[async_trait::async_trait]
impl SecretStore for ForgetSecrets {
    async fn delete_secret(&self, secret: &SecretRef<'_>) -> Result<(), PortError> {
        let digest = crate::canonical::sha256_hex(secret.credential_ref.as_bytes());
        tracing::info!(credential_digest = &digest[..16], space = %secret.space, "secret reference erased");
        Ok(())
    }
}

/// The default cache: kfs-worker runs without a shared retrieval cache, so there is nothing to
/// drain.
#[derive(Clone, Debug, Default)]
pub struct NoCache;

#[async_trait::async_trait]
impl RetrievalCache for NoCache {
    async fn delete_prefix(&self, _prefix: &str, _limit: usize) -> Result<CachePage, PortError> {
        Ok(CachePage::default())
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
