//! The object store port: where document bytes live. Invariant: keys are relative to the
//! configured root and can never escape it; deleting a key that is already gone succeeds, so a
//! repeated deletion step is harmless; errors never print credentials.

use std::sync::Arc;

use bytes::Bytes;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use crate::config::{ConfigError, SecretUrl};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("object {0} not found")]
    NotFound(String),
    #[error("object key {0:?} is not a valid relative key")]
    BadKey(String),
    #[error("object store: {0}")]
    Other(String),
}

impl StoreError {
    /// Transient failures (network, throttling) are worth retrying; a missing object or a bad
    /// key is not.
    pub fn is_retryable(&self) -> bool {
        matches!(self, StoreError::Other(_))
    }
}

/// A handle on the configured object store.
#[derive(Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    root: Path,
    described: String,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Store({})", self.described)
    }
}

impl Store {
    /// Opens `KFS_OBJECT_STORE`: `file://<dir>` (relative dirs such as `file://./data/objects`
    /// resolve against the working directory and are created), `memory://`, or a cloud URL
    /// (`s3://bucket/prefix`, `gs://…`, `az://…`) configured by the provider's usual
    /// environment variables.
    pub fn open(url: &SecretUrl) -> Result<Store, ConfigError> {
        let u = url.url();
        let bad = |e: String| ConfigError::new("KFS_OBJECT_STORE", e);
        match u.scheme() {
            "file" => {
                // `file://./data/objects` parses with host "."; treat host + path as a path.
                let host = u.host_str().unwrap_or("");
                let raw = format!("{host}{}", u.path());
                let dir = std::path::PathBuf::from(if raw.is_empty() { "." } else { &raw });
                std::fs::create_dir_all(&dir)
                    .map_err(|e| bad(format!("cannot create directory {}: {e}", dir.display())))?;
                let fs = object_store::local::LocalFileSystem::new_with_prefix(&dir)
                    .map_err(|e| bad(format!("cannot use directory {}: {e}", dir.display())))?;
                Ok(Store {
                    inner: Arc::new(fs),
                    root: Path::default(),
                    described: format!("file://{}", dir.display()),
                })
            }
            "memory" => Ok(Store {
                inner: Arc::new(object_store::memory::InMemory::new()),
                root: Path::default(),
                described: "memory://".into(),
            }),
            _ => {
                let env: Vec<(String, String)> = std::env::vars()
                    .filter(|(k, _)| {
                        k.starts_with("AWS_") || k.starts_with("GOOGLE_") || k.starts_with("AZURE_")
                    })
                    .map(|(k, v)| (k.to_ascii_lowercase(), v))
                    .collect();
                let (store, root) = object_store::parse_url_opts(u, env).map_err(|_| {
                    bad(format!(
                        "cannot open a {} object store from this URL",
                        u.scheme()
                    ))
                })?;
                Ok(Store {
                    inner: Arc::from(store),
                    root,
                    described: url.to_string(),
                })
            }
        }
    }

    /// An in-memory store, for tests.
    pub fn memory() -> Store {
        Store {
            inner: Arc::new(object_store::memory::InMemory::new()),
            root: Path::default(),
            described: "memory://".into(),
        }
    }

    fn path(&self, key: &str) -> Result<Path, StoreError> {
        if key.is_empty()
            || key.starts_with('/')
            || key
                .split('/')
                .any(|p| p == ".." || p == "." || p.is_empty())
        {
            return Err(StoreError::BadKey(key.to_owned()));
        }
        let rel = Path::parse(key).map_err(|_| StoreError::BadKey(key.to_owned()))?;
        Ok(self.root.parts().chain(rel.parts()).collect())
    }

    pub async fn get(&self, key: &str) -> Result<Bytes, StoreError> {
        let path = self.path(key)?;
        let got = self.inner.get(&path).await.map_err(|e| map_err(key, e))?;
        got.bytes().await.map_err(|e| map_err(key, e))
    }

    pub async fn put(&self, key: &str, bytes: Bytes) -> Result<(), StoreError> {
        let path = self.path(key)?;
        self.inner
            .put(&path, PutPayload::from(bytes))
            .await
            .map_err(|e| map_err(key, e))?;
        Ok(())
    }

    /// Deletes `key`. Already gone counts as deleted.
    pub async fn delete(&self, key: &str) -> Result<(), StoreError> {
        let path = self.path(key)?;
        match self.inner.delete(&path).await {
            Ok(()) => Ok(()),
            Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(map_err(key, e)),
        }
    }

    /// Up to `limit` keys under the folder `prefix` (`a/b` lists `a/b/...`, never `a/bc`) that
    /// sort after `after`, in byte order. A folder that does not exist lists nothing.
    pub async fn list(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<String>, StoreError> {
        use futures_util::TryStreamExt;
        let path = self.path(prefix.trim_end_matches('/'))?;
        let root: Vec<String> = self.root.parts().map(|p| p.as_ref().to_owned()).collect();
        // Listing past `after` lets stores that list in key order skip what was listed already.
        let listing = match after {
            Some(a) => self.inner.list_with_offset(Some(&path), &self.path(a)?),
            None => self.inner.list(Some(&path)),
        };
        let metas: Vec<object_store::ObjectMeta> = match listing.try_collect().await {
            Ok(m) => m,
            Err(object_store::Error::NotFound { .. }) => Vec::new(),
            Err(e) => return Err(map_err(prefix, e)),
        };
        let mut keys: Vec<String> = metas
            .into_iter()
            .map(|m| {
                let parts: Vec<String> =
                    m.location.parts().map(|p| p.as_ref().to_owned()).collect();
                parts[root.len().min(parts.len())..].join("/")
            })
            .filter(|k| after.is_none_or(|a| k.as_str() > a))
            .collect();
        keys.sort();
        keys.truncate(limit);
        Ok(keys)
    }

    pub async fn exists(&self, key: &str) -> Result<bool, StoreError> {
        let path = self.path(key)?;
        match self.inner.head(&path).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(map_err(key, e)),
        }
    }
}

fn map_err(key: &str, e: object_store::Error) -> StoreError {
    match e {
        object_store::Error::NotFound { .. } => StoreError::NotFound(key.to_owned()),
        other => StoreError::Other(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn put_get_delete_and_delete_again() {
        let s = Store::memory();
        s.put("a/b.md", Bytes::from_static(b"hello")).await.unwrap();
        assert_eq!(s.get("a/b.md").await.unwrap(), Bytes::from_static(b"hello"));
        assert!(s.exists("a/b.md").await.unwrap());
        s.delete("a/b.md").await.unwrap();
        s.delete("a/b.md").await.unwrap();
        assert!(matches!(
            s.get("a/b.md").await,
            Err(StoreError::NotFound(_))
        ));
    }

    #[tokio::test]
    async fn lists_a_folder_in_pages() {
        let s = Store::memory();
        for k in ["t/s/a/2", "t/s/a/1", "t/s/ab/x", "t/s/b/1"] {
            s.put(k, Bytes::from_static(b"x")).await.unwrap();
        }
        assert_eq!(
            s.list("t/s/a", None, 10).await.unwrap(),
            vec!["t/s/a/1", "t/s/a/2"]
        );
        assert_eq!(
            s.list("t/s/a/", Some("t/s/a/1"), 10).await.unwrap(),
            vec!["t/s/a/2"]
        );
        assert_eq!(
            s.list("t/s", None, 2).await.unwrap(),
            vec!["t/s/a/1", "t/s/a/2"]
        );
        assert!(s.list("t/none", None, 10).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn keys_cannot_escape_the_root() {
        let s = Store::memory();
        for key in ["", "/etc/passwd", "../x", "a/../../x", "a//b", "./a"] {
            assert!(
                matches!(s.get(key).await, Err(StoreError::BadKey(_))),
                "{key}"
            );
        }
    }

    #[test]
    fn relative_file_urls_resolve_against_the_working_directory() {
        let dir = std::env::temp_dir().join(format!("kfs-store-{}", uuid::Uuid::new_v4().simple()));
        let url = crate::config::object_store(&format!("file://{}", dir.display())).unwrap();
        let store = Store::open(&url).unwrap();
        assert!(dir.is_dir());
        assert!(format!("{store:?}").contains(&dir.display().to_string()));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
