//! A tenant's knowledge space on the platform's schema (with its initial retrieval profile, or
//! bare), backed by a file object store, with in-process compilation: what the compile, research,
//! deletion, bootstrap and dashboard tests need. Invariant: each fixture has its own database (its `TestEnv`) and its own store
//! directory, and `cleanup` removes both; documents are compiled by the real compile handler
//! through the engine (`Engine::process_ref`), so every row a test reads is one the worker wrote.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kfs_worker::consumer::{ConsumerConfig, Engine, Handled};
use kfs_worker::engine::lease::DeliveryRef;
use kfs_worker::engine::slice::Budget;
use kfs_worker::jobs::compile::{
    self, AttemptStatus, CompileError, CompileHandler, RequestOptions,
};
use kfs_worker::jobs::{Deps, Kind};
use kfs_worker::publication;
use kfs_worker::store::Store;
use kfs_worker::tools::platform;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::TestEnv;

/// The subject that owns every fixture space.
pub const OWNER: &str = "owner-1";

const HANG: Duration = Duration::from_secs(60);

/// The documents of `tests/fixtures/compile` that the compile, bootstrap and page-index tests
/// upload.
pub const GUIDE_MD: &[u8] = include_bytes!("../../fixtures/compile/guide.md");
pub const PAGE_HTML: &[u8] = include_bytes!("../../fixtures/compile/page.html");
pub const NOTES_TXT: &[u8] = include_bytes!("../../fixtures/compile/notes.txt");

/// Declares `struct $name(SpaceFx)` that derefs to the `SpaceFx`, so a test module can add its
/// own steps to the shared fixture.
macro_rules! space_fixture {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        struct $name($crate::support::space::SpaceFx);

        impl std::ops::Deref for $name {
            type Target = $crate::support::space::SpaceFx;

            fn deref(&self) -> &$crate::support::space::SpaceFx {
                &self.0
            }
        }
    };
}
pub(crate) use space_fixture;

pub struct SpaceFx {
    pub env: TestEnv,
    pub store: Store,
    pub store_url: String,
    pub dir: PathBuf,
    pub tenant: String,
    pub space: Uuid,
}

impl SpaceFx {
    /// A space as the platform's API creates one and configures its initial retrieval profile.
    pub async fn new(tenant: &str, slug: &str, name: &str) -> SpaceFx {
        SpaceFx::make(tenant, slug, name, false).await
    }

    /// A space without profile heads (a legacy space, or one whose models are not configured).
    #[allow(dead_code)]
    pub async fn bare(tenant: &str, slug: &str, name: &str) -> SpaceFx {
        SpaceFx::make(tenant, slug, name, true).await
    }

    async fn make(tenant: &str, slug: &str, name: &str, bare: bool) -> SpaceFx {
        let env = TestEnv::new().await;
        let dir = std::env::temp_dir().join(format!("kfs-{slug}-{}", Uuid::new_v4().simple()));
        let store_url = format!("file://{}", dir.display());
        let store = Store::open(&kfs_worker::config::object_store(&store_url).unwrap()).unwrap();
        let mut conn = env.pool.acquire().await.unwrap();
        let space = if bare {
            platform::create_bare_space(&mut conn, tenant, slug, name, OWNER).await
        } else {
            platform::create_space(&mut conn, tenant, slug, name, OWNER).await
        }
        .unwrap();
        drop(conn);
        SpaceFx {
            env,
            store,
            store_url,
            dir,
            tenant: tenant.to_owned(),
            space,
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.env.pool
    }

    /// Stores a document's bytes and writes its rows, as the platform's upload does.
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

    /// An interactive permission snapshot of `subject` in this space.
    pub async fn snapshot(&self, subject: &str) -> Uuid {
        let mut conn = self.pool().acquire().await.unwrap();
        platform::create_permission_snapshot(
            &mut conn,
            &self.tenant,
            self.space,
            subject,
            "interactive",
            None,
        )
        .await
        .unwrap()
    }

    /// Requests the compilation of `doc`'s current version.
    pub async fn request(&self, doc: Uuid, defer: bool) -> Result<Uuid, CompileError> {
        let mut tx = self.pool().begin().await.unwrap();
        let r = compile::request(
            &mut tx,
            doc,
            RequestOptions {
                defer,
                ..RequestOptions::default()
            },
        )
        .await;
        tx.commit().await.unwrap();
        r
    }

    /// An engine with the compile handler (offline embedder), `max_steps` steps per slice.
    pub fn engine(&self, worker: &str, max_steps: u32) -> Engine {
        self.engine_with(worker, max_steps, Deps::offline(self.store.clone()))
    }

    /// An engine with the compile handler built from `deps`, `max_steps` steps per slice.
    pub fn engine_with(&self, worker: &str, max_steps: u32, deps: Deps) -> Engine {
        let handler = CompileHandler::new(deps).unwrap();
        Engine::new(
            self.pool().clone(),
            worker,
            vec![Arc::new(handler)],
            ConsumerConfig {
                budget: Budget {
                    max_steps,
                    max_time: Duration::from_secs(30),
                },
                ..ConsumerConfig::default()
            },
        )
    }

    pub async fn status(&self, attempt: Uuid) -> AttemptStatus {
        let mut conn = self.pool().acquire().await.unwrap();
        compile::show(&mut conn, attempt).await.unwrap()
    }

    /// Puts the attempt's outbox row out for delivery as the relay's mark leaves it.
    pub async fn dispatch(&self, attempt: Uuid) -> DeliveryRef {
        let (outbox, delivery_id): (Uuid, String) = sqlx::query_as(
            "UPDATE document_compilation_outbox SET status = 'dispatched', queue_job_id = gen_random_uuid()::text, \
               dispatch_attempts = dispatch_attempts + 1, available_at = now() + interval '5 minutes', \
               lock_token = NULL, locked_by = NULL, locked_until = NULL, updated_at = now() \
             WHERE attempt_id = $1 RETURNING id, queue_job_id",
        )
        .bind(attempt)
        .fetch_one(self.pool())
        .await
        .unwrap();
        DeliveryRef {
            kind: Kind::Compile,
            job_id: attempt,
            outbox_id: outbox,
            delivery_id,
        }
    }

    /// One delivery, one slice.
    pub async fn slice(&self, engine: &Engine, attempt: Uuid) -> Handled {
        let d = self.dispatch(attempt).await;
        tokio::time::timeout(HANG, engine.process_ref(&d, &CancellationToken::new()))
            .await
            .expect("process_ref hung")
    }

    /// Slices until the attempt ends.
    pub async fn drive(&self, engine: &Engine, attempt: Uuid) -> AttemptStatus {
        for _ in 0..40 {
            let s = self.status(attempt).await;
            if s.is_terminal() {
                return s;
            }
            self.slice(engine, attempt).await;
        }
        panic!(
            "attempt {attempt} did not end: {:?}",
            self.status(attempt).await
        );
    }

    /// Slices (of one step each with a one-step engine) until the attempt reaches `cp`.
    pub async fn drive_to(&self, engine: &Engine, attempt: Uuid, cp: &str) {
        for _ in 0..20 {
            let s = self.status(attempt).await;
            if s.checkpoint == cp {
                return;
            }
            assert!(!s.is_terminal(), "ended before {cp}: {s:?}");
            self.slice(engine, attempt).await;
        }
        panic!("attempt {attempt} never reached {cp}");
    }

    /// Compiles `doc` to its end in-process and asserts it published.
    pub async fn compile(&self, doc: Uuid) -> AttemptStatus {
        let attempt = self.request(doc, false).await.unwrap();
        let s = self.drive(&self.engine("w-fixture", 64), attempt).await;
        assert_eq!(s.run_state, "succeeded", "{s:?}");
        s
    }

    /// The space's current head.
    pub async fn head(&self) -> Option<publication::Head> {
        let mut conn = self.pool().acquire().await.unwrap();
        publication::head(&mut conn, &self.tenant, self.space, false)
            .await
            .unwrap()
    }

    /// The documents the head serves.
    pub async fn served(&self) -> publication::Documents {
        let Some(h) = self.head().await else {
            return publication::Documents::new();
        };
        let mut conn = self.pool().acquire().await.unwrap();
        publication::documents(&mut conn, &self.tenant, self.space, h.publication_id)
            .await
            .unwrap()
    }

    /// Full-text hits of `query` in what the head publishes, found as the platform's retrieval
    /// finds them (an unscoped reader).
    pub async fn search(&self, query: &str) -> Vec<compile::Hit> {
        let mut conn = self.pool().acquire().await.unwrap();
        compile::search_published(&mut conn, &self.tenant, self.space, query, &[], 50)
            .await
            .unwrap()
    }

    pub async fn cleanup(self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        self.env.cleanup().await;
    }
}
