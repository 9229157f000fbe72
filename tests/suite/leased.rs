//! The jobs leased straight from Postgres — legacy space publication bootstraps (0009) and
//! profile backfills (0018, with the publication bindings they reconcile since 0019) — on the
//! platform's real tables, against the real Postgres (and RabbitMQ where compiles travel the
//! outbox).
//!
//! Spaces, documents and manifests are written by the platform fixtures (`SpaceFx`,
//! `kfs_worker::tools::platform`). Most tests drive slices in-process with `leased::run_once` and run
//! the compile attempts a bootstrap requests with the real compile handler (`SpaceFx::slice`),
//! so interleavings are exact. The process tests run real `kfs-worker run` children, one of them
//! SIGKILLed in the middle of a walk, others aborted at crash points.
//!
//! Every test installs a trigger that logs each state written to the two job tables, so the
//! tests can inspect every written state, not only the last one.

use std::time::Duration;

use kfs_worker::consumer::Engine;
use kfs_worker::engine::lease::End;
use kfs_worker::engine::leased::{self, Lease, LeasedKind, Outcome};
use kfs_worker::engine::slice::Budget;
use kfs_worker::jobs::backfill::{self, profile, BackfillKind};
use kfs_worker::jobs::bootstrap::walk::{self, Checkpoint};
use kfs_worker::jobs::bootstrap::{self, BootstrapKind};
use kfs_worker::jobs::compile;
use kfs_worker::jobs::Kind;
use kfs_worker::tools::platform;
use serde_json::{json, Value};
use sqlx::{Connection, PgPool};
use uuid::Uuid;

use crate::support;
use crate::support::space::{SpaceFx, GUIDE_MD, NOTES_TXT, OWNER, PAGE_HTML};

mod bindings;
mod bootstrap_walk;
mod fencing;
mod processes;
mod profile_backfill;

const TENANT: &str = "tenant-leased";

/// Logs every state written to the two job tables.
const STATE_LOG: &str = r#"
CREATE TABLE leased_state_log (
  seq BIGSERIAL PRIMARY KEY, tbl TEXT NOT NULL, job UUID NOT NULL, run_state TEXT NOT NULL,
  checkpoint TEXT, row_version INT NOT NULL, lease_token UUID, worker_id TEXT,
  completed INT, total INT, last_error_code TEXT);
CREATE FUNCTION leased_state_log_bootstrap() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO leased_state_log (tbl, job, run_state, checkpoint, row_version, lease_token, worker_id, completed, total, last_error_code)
  VALUES ('bootstrap', NEW.id, NEW.run_state, NEW.checkpoint, NEW.row_version, NEW.lease_token, NEW.worker_id,
          NEW.completed_documents, NEW.total_documents, NEW.last_error_code);
  RETURN NEW;
END $$;
CREATE FUNCTION leased_state_log_backfill() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO leased_state_log (tbl, job, run_state, checkpoint, row_version, lease_token, worker_id, last_error_code)
  VALUES ('backfill', NEW.id, NEW.run_state, NULL, NEW.row_version, NEW.lease_token, NEW.worker_id, NEW.last_error_code);
  RETURN NEW;
END $$;
CREATE TRIGGER leased_state_log_bootstrap AFTER INSERT OR UPDATE ON legacy_space_publication_bootstraps
  FOR EACH ROW EXECUTE FUNCTION leased_state_log_bootstrap();
CREATE TRIGGER leased_state_log_backfill AFTER INSERT OR UPDATE ON knowledge_space_profile_backfills
  FOR EACH ROW EXECUTE FUNCTION leased_state_log_backfill();
"#;

support::space::space_fixture!(Fx);

/// A legacy embedding profile as a 0018-era API wrote it into the manifest.
fn embedding_profile() -> Value {
    json!({ "dimension": 8, "model": "text-embedding-3-small", "pluginId": "langgenius/openai",
            "provider": "openai", "revision": 1,
            "vectorSpaceId": platform::vector_space_id("text-embedding-3-small", "langgenius/openai", "openai", 1) })
}

/// A legacy retrieval profile as a 0018-era API wrote it into the manifest.
fn retrieval_profile() -> Value {
    json!({ "defaultMode": "research", "rerank": {"enabled": false}, "revision": 1, "topK": 8,
            "reasoningModel": {"model": "gpt-4o-mini", "pluginId": "langgenius/openai", "provider": "openai"} })
}

/// Writes manifest profile keys (a manifest change: version + 1). Returns the new version.
async fn set_manifest_keys(pool: &PgPool, space: Uuid, keys: Value) -> i32 {
    sqlx::query_scalar(
        "UPDATE knowledge_space_manifests SET metadata = metadata || $3, manifest_version = manifest_version + 1, \
           updated_at = now() WHERE tenant_id = $1 AND knowledge_space_id = $2 RETURNING manifest_version",
    )
    .bind(TENANT)
    .bind(space)
    .bind(keys)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A legacy space: profiles (if any) only in its manifest, no profile heads.
async fn new_space(pool: &PgPool, slug: &str) -> Uuid {
    let mut conn = pool.acquire().await.unwrap();
    platform::create_bare_space(&mut conn, TENANT, slug, slug, OWNER)
        .await
        .unwrap()
}

/// Runs backfill slices until none is claimable.
async fn run_backfills(pool: &PgPool, kind: &BackfillKind) -> usize {
    let mut n = 0;
    while leased::run_once(pool, kind, "leased-in-test", Budget::default())
        .await
        .unwrap()
        .is_some()
    {
        n += 1;
        assert!(n < 50, "backfills never ran out");
    }
    n
}

impl Fx {
    async fn new() -> Fx {
        let fx = SpaceFx::new(TENANT, "legacy", "Legacy space").await;
        sqlx::raw_sql(STATE_LOG).execute(fx.pool()).await.unwrap();
        Fx(fx)
    }

    /// A legacy space without profile heads, for the backfill to install them.
    async fn bare() -> Fx {
        let fx = SpaceFx::bare(TENANT, "legacy", "Legacy space").await;
        sqlx::raw_sql(STATE_LOG).execute(fx.pool()).await.unwrap();
        Fx(fx)
    }

    async fn cleanup(self) {
        self.0.cleanup().await;
    }

    /// Three documents, in id order (the snapshot's order).
    async fn three_documents(&self) -> Vec<Uuid> {
        let mut docs = vec![
            self.add("guide.md", "text/markdown", GUIDE_MD).await,
            self.add("page.html", "text/html", PAGE_HTML).await,
            self.add("notes.txt", "text/plain", NOTES_TXT).await,
        ];
        docs.sort();
        docs
    }

    /// The legacy profiles in the manifest, installed by the backfill as the platform's
    /// runtime installs them, so that compiles embed with the space's embedding profile.
    async fn install_profiles(&self) {
        set_manifest_keys(
            self.pool(),
            self.space,
            json!({ "__knowledgeFsEmbeddingProfile": embedding_profile(),
                    "__knowledgeFsRetrievalProfile": retrieval_profile() }),
        )
        .await;
        assert_eq!(
            run_backfills(self.pool(), &BackfillKind::default()).await,
            2
        );
    }

    async fn enqueue_bootstrap(&self) -> Uuid {
        let mut conn = self.pool().acquire().await.unwrap();
        bootstrap::enqueue(&mut conn, TENANT, self.space)
            .await
            .unwrap()
    }

    /// Runs every compile attempt of the space that has not ended, to its end, in-process.
    async fn run_compiles(&self, engine: &Engine) {
        for _ in 0..40 {
            let open: Vec<Uuid> = sqlx::query_scalar(
                "SELECT id FROM document_compilation_attempts WHERE knowledge_space_id = $1 \
                   AND run_state NOT IN ('succeeded', 'failed', 'canceled', 'superseded') ORDER BY id",
            )
            .bind(self.space)
            .fetch_all(self.pool())
            .await
            .unwrap();
            if open.is_empty() {
                return;
            }
            for attempt in open {
                // A slice that only waits (retry_wait) is fine: the next round dispatches again.
                sqlx::query("UPDATE document_compilation_attempts SET retry_at = now() WHERE id = $1 AND run_state = 'retry_wait'")
                    .bind(attempt)
                    .execute(self.pool())
                    .await
                    .unwrap();
                self.slice(engine, attempt).await;
            }
        }
        panic!("compile attempts did not end");
    }

    /// Lets a waiting bootstrap be claimed again now.
    async fn due_now(&self, id: Uuid) {
        sqlx::query(
            "UPDATE legacy_space_publication_bootstraps SET snapshot_metadata = snapshot_metadata - 'notBefore' WHERE id = $1",
        )
        .bind(id)
        .execute(self.pool())
        .await
        .unwrap();
    }

    async fn run_bootstrap(&self, kind: &BootstrapKind) -> Option<(Lease, Outcome)> {
        leased::run_once(self.pool(), kind, "leased-in-test", Budget::default())
            .await
            .unwrap()
    }

    /// Slices and compiles until the bootstrap ends (succeeded or failed).
    async fn drive_bootstrap(&self, kind: &BootstrapKind, engine: &Engine, id: Uuid) -> Row {
        for _ in 0..30 {
            self.due_now(id).await;
            self.run_bootstrap(kind).await;
            let row = self.bootstrap(id).await;
            if row.run_state == "succeeded" || row.run_state == "failed" {
                return row;
            }
            self.run_compiles(engine).await;
        }
        panic!("bootstrap did not end: {:?}", self.bootstrap(id).await);
    }

    async fn bootstrap(&self, id: Uuid) -> Row {
        sqlx::query_as::<_, Row>(
            "SELECT id, tenant_id::text AS tenant_id, knowledge_space_id, idempotency_key::text AS idempotency_key, \
               checkpoint::text AS checkpoint, run_state::text AS run_state, total_documents, completed_documents, \
               published_publication_id, published_fingerprint::text AS published_fingerprint, published_head_revision, \
               last_error_code::text AS last_error_code, last_error_message, snapshot_metadata, row_version, \
               lease_token, completed_at IS NOT NULL AS completed \
             FROM legacy_space_publication_bootstraps WHERE id = $1",
        )
        .bind(id)
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    async fn items(&self, id: Uuid) -> Vec<Item> {
        sqlx::query_as::<_, Item>(
            "SELECT document_asset_id, document_version, document_sha256::text AS document_sha256, ordinal, \
               compilation_attempt_id, status::text AS status, last_error \
             FROM legacy_space_publication_bootstrap_items WHERE bootstrap_id = $1 ORDER BY ordinal",
        )
        .bind(id)
        .fetch_all(self.pool())
        .await
        .unwrap()
    }

    async fn ready(&self) -> bool {
        let mut conn = self.pool().acquire().await.unwrap();
        bootstrap::ready(&mut conn, TENANT, self.space)
            .await
            .unwrap()
    }

    async fn retry_bootstrap(&self) -> bool {
        let mut conn = self.pool().acquire().await.unwrap();
        bootstrap::retry(&mut conn, TENANT, self.space)
            .await
            .unwrap()
    }

    /// Every logged state of one job, in order.
    async fn states(&self, job: Uuid) -> Vec<LoggedState> {
        sqlx::query_as(
            "SELECT run_state, checkpoint, row_version, lease_token, completed, total, last_error_code \
             FROM leased_state_log WHERE job = $1 ORDER BY seq",
        )
        .bind(job)
        .fetch_all(self.pool())
        .await
        .unwrap()
    }

    fn worker_env(&self, id: &str) -> Vec<(String, String)> {
        vec![
            ("KFS_OBJECT_STORE".into(), self.store_url.clone()),
            ("KFS_KINDS".into(), "compile".into()),
            ("KFS_EMBEDDER".into(), "offline".into()),
            ("KFS_WORKER_ID".into(), id.into()),
            ("KFS_RELAY_POLL".into(), "200ms".into()),
            ("KFS_LEASED_POLL".into(), "100ms".into()),
            ("KFS_SHUTDOWN_GRACE".into(), "5s".into()),
        ]
    }

    fn spawn(&self, id: &str, args: &[&str], extra: &[(&str, &str)]) -> support::Worker {
        let mut env = self.worker_env(id);
        env.extend(
            extra
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
        let e: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        self.env.spawn_worker(id, args, &e)
    }
}

type LoggedState = (
    String,
    Option<String>,
    i32,
    Option<Uuid>,
    Option<i32>,
    Option<i32>,
    Option<String>,
);

#[derive(Debug, sqlx::FromRow)]
#[allow(dead_code)]
struct Row {
    id: Uuid,
    tenant_id: String,
    knowledge_space_id: Uuid,
    idempotency_key: String,
    checkpoint: String,
    run_state: String,
    total_documents: i32,
    completed_documents: i32,
    published_publication_id: Option<Uuid>,
    published_fingerprint: Option<String>,
    published_head_revision: Option<i32>,
    last_error_code: Option<String>,
    last_error_message: Option<String>,
    snapshot_metadata: Value,
    row_version: i32,
    lease_token: Option<Uuid>,
    completed: bool,
}

#[derive(Debug, sqlx::FromRow)]
struct Item {
    document_asset_id: Uuid,
    document_version: i32,
    document_sha256: String,
    ordinal: i32,
    compilation_attempt_id: Option<Uuid>,
    status: String,
    last_error: Option<String>,
}

/// Checks every logged state of a bootstrap: checkpoints only move forward, row versions never
/// go back, a lease is held exactly while running, and `published` comes only with success.
fn assert_bootstrap_states(states: &[LoggedState]) {
    assert!(!states.is_empty());
    for w in states.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        let from = Checkpoint::parse(a.1.as_deref().unwrap()).unwrap();
        let to = Checkpoint::parse(b.1.as_deref().unwrap()).unwrap();
        assert!(walk::allowed(from, to), "{from:?} -> {to:?} in {states:#?}");
        assert!(b.2 >= a.2, "row_version went back: {states:#?}");
    }
    for s in states {
        assert_eq!(s.0 == "running", s.3.is_some(), "lease iff running: {s:?}");
        if s.1.as_deref() == Some("published") {
            assert_eq!(s.0, "succeeded", "{s:?}");
        }
        assert!(s.4 <= s.5, "completed > total: {s:?}");
    }
}

type BackfillRow = (String, i32, i32, Option<String>, Option<Uuid>);

async fn backfill_row(pool: &PgPool, id: Uuid) -> BackfillRow {
    sqlx::query_as(
        "SELECT run_state::text, execution_attempts, row_version, last_error_code::text, lease_token \
         FROM knowledge_space_profile_backfills WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The backfills of a space: kind, source manifest version, id, run state, error code.
async fn backfills(pool: &PgPool, space: Uuid) -> Vec<(String, i32, Uuid, String, Option<String>)> {
    sqlx::query_as(
        "SELECT kind::text, source_manifest_version, id, run_state::text, last_error_code::text \
         FROM knowledge_space_profile_backfills WHERE knowledge_space_id = $1 \
         ORDER BY kind, source_manifest_version, created_at",
    )
    .bind(space)
    .fetch_all(pool)
    .await
    .unwrap()
}
