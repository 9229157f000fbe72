//! A tenant's knowledge space backed by a file object store, as the compile, bootstrap and
//! dashboard tests need it. Invariant: each fixture has its own database (its `TestEnv`) and its
//! own store directory, and `cleanup` removes both.

use std::path::PathBuf;

use bytes::Bytes;
use kfs_worker::platform;
use kfs_worker::store::Store;
use sqlx::PgPool;
use uuid::Uuid;

use super::TestEnv;

/// Declares `struct $name(SpaceFx)` that derefs to the `SpaceFx`, so a test file can add its
/// own steps to the shared fixture.
#[allow(unused_macros)]
macro_rules! space_fixture {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        struct $name(common::space::SpaceFx);

        impl std::ops::Deref for $name {
            type Target = common::space::SpaceFx;

            fn deref(&self) -> &common::space::SpaceFx {
                &self.0
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use space_fixture;

pub struct SpaceFx {
    pub env: TestEnv,
    pub store: Store,
    pub store_url: String,
    pub dir: PathBuf,
    pub space: Uuid,
}

impl SpaceFx {
    pub async fn new(tenant: &str, slug: &str, name: &str) -> SpaceFx {
        let env = TestEnv::new().await;
        let dir = std::env::temp_dir().join(format!("kfs-{slug}-{}", Uuid::new_v4().simple()));
        let store_url = format!("file://{}", dir.display());
        let store = Store::open(&kfs_worker::config::object_store(&store_url).unwrap()).unwrap();
        let mut conn = env.pool.acquire().await.unwrap();
        let space = platform::create_space(&mut conn, tenant, slug, name)
            .await
            .unwrap();
        drop(conn);
        SpaceFx {
            env,
            store,
            store_url,
            dir,
            space,
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.env.pool
    }

    /// Stores a document's bytes and writes its asset row, as the platform's upload does.
    pub async fn add(&self, filename: &str, mime: &str, bytes: &[u8]) -> Uuid {
        let mut conn = self.pool().acquire().await.unwrap();
        platform::add_document(
            &mut conn,
            &self.store,
            self.space,
            None,
            filename,
            mime,
            Bytes::copy_from_slice(bytes),
        )
        .await
        .unwrap()
    }

    pub async fn cleanup(self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        self.env.cleanup().await;
    }
}
