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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bootstrap_walk_rebuilds_every_document_verifies_the_head_and_sets_the_latch() {
    let fx = Fx::bare().await;
    fx.install_profiles().await;
    let docs = fx.three_documents().await;
    let id = fx.enqueue_bootstrap().await;
    assert_eq!(id, fx.space, "the marker's id is the space's");
    assert_eq!(id, fx.enqueue_bootstrap().await, "enqueue is idempotent");
    assert!(
        !fx.ready().await,
        "a queued bootstrap keeps strict reads closed"
    );

    let kind = BootstrapKind::default();
    let engine = fx.engine("compile-in-test", 64);
    let row = fx.drive_bootstrap(&kind, &engine, id).await;
    assert_eq!(
        (row.run_state.as_str(), row.checkpoint.as_str()),
        ("succeeded", "published"),
        "{row:?}"
    );
    assert_eq!((row.total_documents, row.completed_documents), (3, 3));
    assert_eq!(
        (row.tenant_id.as_str(), row.knowledge_space_id),
        (TENANT, fx.space)
    );
    assert_eq!(row.idempotency_key, bootstrap::IDEMPOTENCY_KEY);
    assert!(row.lease_token.is_none() && row.completed && row.last_error_code.is_none());
    let meta = &row.snapshot_metadata;
    assert_eq!(meta["documentCount"], json!(3));
    assert_eq!(meta["directLegacyAdoption"], json!(false));
    assert_eq!(meta["strategy"], json!("full-generation-rebuild"));
    assert_eq!(meta["source"], json!("migration-marker"));
    assert_eq!(
        meta["reason"],
        json!("legacy graph ownership and immutable generation cannot be proven")
    );
    assert!(meta["capturedAt"].as_str().unwrap().ends_with('Z'));
    assert!(fx.ready().await, "success is the readiness latch");

    // The frozen items, in document id order, each rebuilt by one ordinary compile attempt
    // that published it (an internal starter: no requester binding).
    let items = fx.items(id).await;
    assert_eq!(items.len(), 3);
    for (i, it) in items.iter().enumerate() {
        assert_eq!(
            (it.ordinal, it.document_asset_id, it.document_version),
            (i as i32, docs[i], 1)
        );
        let sha: String = sqlx::query_scalar("SELECT sha256 FROM document_assets WHERE id = $1")
            .bind(it.document_asset_id)
            .fetch_one(fx.pool())
            .await
            .unwrap();
        assert_eq!(it.document_sha256, sha);
        assert_eq!(
            (it.status.as_str(), it.last_error.as_deref()),
            ("succeeded", None)
        );
        let a = fx.status(it.compilation_attempt_id.unwrap()).await;
        assert_eq!(
            (a.run_state.as_str(), a.checkpoint.as_str()),
            ("succeeded", "published")
        );
        assert_eq!(
            (a.document_asset_id, a.document_version, a.active_slot),
            (docs[i], 1, None)
        );
        assert_eq!(
            (
                a.requested_by_subject_id,
                a.permission_snapshot_id,
                a.access_channel
            ),
            (None, None, None)
        );
    }

    // The recorded head is the space's head, and it serves every frozen document at its frozen
    // version, with ready dense projections of the manifest's vector space.
    let head = fx.head().await.unwrap();
    assert_eq!(row.published_publication_id, Some(head.publication_id));
    assert_eq!(row.published_head_revision, Some(head.revision));
    assert_eq!(
        row.published_fingerprint.as_deref(),
        Some(head.fingerprint.as_str())
    );
    let served = fx.served().await;
    assert_eq!(served.keys().copied().collect::<Vec<_>>(), docs);
    assert!(served.values().all(|s| s.version == 1));
    let dense: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT m.document_asset_id) FROM projection_set_publication_members m \
         JOIN index_projections p ON p.id = m.component_key AND p.type = 'dense-vector' AND p.status = 'ready' \
         WHERE m.publication_id = $1 AND p.model = $2",
    )
    .bind(head.publication_id)
    .bind(embedding_profile()["vectorSpaceId"].as_str())
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(dense, 3);

    // Every state the walk wrote.
    let states = fx.states(id).await;
    assert_bootstrap_states(&states);
    let seen: Vec<&str> = states.iter().filter_map(|s| s.1.as_deref()).collect();
    for cp in Checkpoint::ALL {
        assert!(
            seen.contains(&cp.as_str()),
            "{cp:?} never written: {seen:?}"
        );
    }
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_space_without_documents_bootstraps_without_a_publication_unless_legacy_state_remains() {
    let fx = Fx::new().await;
    let id = fx.enqueue_bootstrap().await;
    let engine = fx.engine("compile-in-test", 64);
    let row = fx
        .drive_bootstrap(&BootstrapKind::default(), &engine, id)
        .await;
    assert_eq!(
        (row.run_state.as_str(), row.checkpoint.as_str()),
        ("succeeded", "published")
    );
    assert_eq!((row.total_documents, row.completed_documents), (0, 0));
    assert_eq!(row.published_publication_id, None);
    assert!(fx.ready().await);
    let seen: Vec<String> = fx
        .states(id)
        .await
        .into_iter()
        .filter_map(|s| s.1)
        .collect();
    assert!(
        !seen.iter().any(|c| c == "rebuilding"),
        "nothing to rebuild: {seen:?}"
    );
    assert_bootstrap_states(&fx.states(id).await);

    // Null-generation state without documents cannot be rebuilt: the platform refuses.
    let other = new_space(fx.pool(), "residue").await;
    sqlx::query(
        "INSERT INTO knowledge_paths (id, knowledge_space_id, publication_generation_id, virtual_path, resource_type, \
           target_id, version, view_name, view_type, metadata) \
         VALUES (gen_random_uuid(), $1, NULL, '/knowledge/docs/gone', 'document', 'gone', 1, 'docs', 'physical', '{}')",
    )
    .bind(other)
    .execute(fx.pool())
    .await
    .unwrap();
    let mut conn = fx.pool().acquire().await.unwrap();
    assert!(
        !bootstrap::ready(&mut conn, TENANT, other).await.unwrap(),
        "legacy state without a bootstrap is not ready"
    );
    let other_id = bootstrap::enqueue(&mut conn, TENANT, other).await.unwrap();
    drop(conn);
    let (_, outcome) = fx.run_bootstrap(&BootstrapKind::default()).await.unwrap();
    assert_eq!(outcome, Outcome::Ended("failed"));
    let row = fx.bootstrap(other_id).await;
    assert_eq!(
        (row.run_state.as_str(), row.checkpoint.as_str()),
        ("failed", "verifying")
    );
    assert_eq!(
        row.last_error_code.as_deref(),
        Some(walk::PROCESSING_FAILED)
    );
    assert_eq!(
        row.last_error_message.as_deref(),
        Some("Legacy null-generation derived state remains after rebuilding an empty document snapshot")
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_compile_fails_the_bootstrap_until_an_operator_retry_compiles_it_again() {
    let fx = Fx::bare().await;
    fx.install_profiles().await;
    let docs = fx.three_documents().await;
    // The bytes of one document are missing from the store: its compile fails for good.
    let key: String = sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
        .bind(docs[1])
        .fetch_one(fx.pool())
        .await
        .unwrap();
    let bytes = fx.store.get(&key).await.unwrap();
    fx.store.delete(&key).await.unwrap();
    let id = fx.enqueue_bootstrap().await;
    let kind = BootstrapKind::default();
    let engine = fx.engine("compile-in-test", 64);
    let row = fx.drive_bootstrap(&kind, &engine, id).await;
    assert_eq!(
        (row.run_state.as_str(), row.checkpoint.as_str()),
        ("failed", "rebuilding"),
        "{row:?}"
    );
    assert_eq!(
        row.last_error_code.as_deref(),
        Some(walk::COMPILATION_FAILED)
    );
    assert!(row.completed && row.lease_token.is_none());
    assert!(!fx.ready().await);
    let items = fx.items(id).await;
    let failed: Vec<&Item> = items.iter().filter(|i| i.status == "failed").collect();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].document_asset_id, docs[1]);
    let first_attempt = failed[0].compilation_attempt_id.unwrap();
    let attempt = fx.status(first_attempt).await;
    assert_eq!(attempt.run_state, "failed");
    assert_eq!(
        failed[0].last_error, attempt.last_error_message,
        "the compile's own error"
    );
    assert_eq!(row.last_error_message, attempt.last_error_message);

    // A failed bootstrap is final: not claimed again, however long one waits.
    fx.due_now(id).await;
    assert!(
        fx.run_bootstrap(&kind).await.is_none(),
        "a failed bootstrap was claimed"
    );

    // Restore the bytes; the operator's retry queues the same row, the failed item pending
    // again with no attempt, and the document is compiled again by a new attempt.
    fx.store.put(&key, bytes).await.unwrap();
    assert!(fx.retry_bootstrap().await);
    assert!(
        !fx.retry_bootstrap().await,
        "only a failed bootstrap is retried"
    );
    let row = fx.bootstrap(id).await;
    assert_eq!(
        (row.run_state.as_str(), row.last_error_code, row.completed),
        ("queued", None, false)
    );
    let again = fx
        .items(id)
        .await
        .into_iter()
        .find(|i| i.document_asset_id == docs[1])
        .unwrap();
    assert_eq!(
        (
            again.status.as_str(),
            again.compilation_attempt_id,
            again.last_error
        ),
        ("pending", None, None)
    );
    let row = fx.drive_bootstrap(&kind, &engine, id).await;
    assert_eq!(row.run_state, "succeeded", "{row:?}");
    assert_eq!(row.last_error_code, None);
    let again = fx
        .items(id)
        .await
        .into_iter()
        .find(|i| i.document_asset_id == docs[1])
        .unwrap();
    assert_eq!(again.status, "succeeded");
    assert_ne!(again.compilation_attempt_id, Some(first_attempt));
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM legacy_space_publication_bootstraps")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(n, 1, "retried in place, never a second bootstrap");
    assert_bootstrap_states(&fx.states(id).await);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bootstrap_fails_for_good_after_its_attempts() {
    let fx = Fx::new().await;
    let id = fx.enqueue_bootstrap().await;
    let kind = BootstrapKind {
        policy: kfs_worker::jobs::Policy {
            max_attempts: 2,
            ..bootstrap::POLICY
        },
        ..BootstrapKind::default()
    };
    let mut conn = fx.pool().acquire().await.unwrap();
    // A transient failure queues it again after the backoff, the run counted.
    let job = kind.claim(&mut conn, "w-live").await.unwrap().unwrap();
    let transient = End::Wait {
        delay: Duration::from_secs(60),
        code: "db_unavailable".into(),
        message: "connection reset".into(),
        refund: false,
    };
    assert!(kind.end(&mut conn, &job, &transient).await.unwrap());
    let row = fx.bootstrap(id).await;
    assert_eq!(
        (row.run_state.as_str(), row.last_error_code.as_deref()),
        ("queued", Some("db_unavailable"))
    );
    assert_eq!(row.snapshot_metadata["failures"], json!(1));
    assert!(row.snapshot_metadata["notBefore"].as_i64().is_some());
    assert!(
        kind.claim(&mut conn, "w-live").await.unwrap().is_none(),
        "claimed before its retry time"
    );
    fx.due_now(id).await;
    // Workers that die holding it (no liveness lock) use up the rest.
    let held = kind.claim(&mut conn, "ghost-1").await.unwrap().unwrap();
    assert_eq!(held.attempt, 2);
    let taken = kind.claim(&mut conn, "ghost-2").await.unwrap().unwrap();
    assert!(taken.taken_over);
    assert!(
        kind.claim(&mut conn, "w-live").await.unwrap().is_none(),
        "out of attempts"
    );
    let row = fx.bootstrap(id).await;
    assert_eq!(
        (row.run_state.as_str(), row.last_error_code.as_deref()),
        ("failed", Some(bootstrap::EXHAUSTED))
    );
    assert_eq!(row.snapshot_metadata["failures"], json!(2));
    fx.due_now(id).await;
    assert!(
        fx.run_bootstrap(&kind).await.is_none(),
        "a bootstrap out of attempts is not run again"
    );
    // The operator's retry gives it a fresh budget.
    assert!(fx.retry_bootstrap().await);
    assert_eq!(
        fx.bootstrap(id).await.snapshot_metadata.get("failures"),
        None
    );
    let (_, outcome) = fx
        .run_bootstrap(&kind)
        .await
        .expect("claimed after the retry");
    assert_eq!(outcome, Outcome::Ended("succeeded"));
    assert_bootstrap_states(&fx.states(id).await);
    fx.cleanup().await;
}

async fn add_mutation_lease(pool: &PgPool, space: Uuid, expires: &str) -> Uuid {
    sqlx::query_scalar(&format!(
        "INSERT INTO knowledge_space_mutation_leases (id, tenant_id, knowledge_space_id, operation, acquired_at, \
           lease_token, heartbeat_at, expires_at) \
         VALUES (gen_random_uuid(), $1, $2, 'upload', now(), gen_random_uuid(), now(), {expires}) RETURNING id"
    ))
    .bind(TENANT)
    .bind(space)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_live_mutation_lease_or_an_active_compile_fails_the_snapshot_and_an_expired_lease_does_not(
) {
    let fx = Fx::new().await;
    let docs = fx.three_documents().await;
    let lease = add_mutation_lease(fx.pool(), fx.space, "now() + interval '1 hour'").await;
    let id = fx.enqueue_bootstrap().await;
    let kind = BootstrapKind {
        waits: walk::Waits {
            poll: Duration::from_secs(60),
        },
        ..BootstrapKind::default()
    };
    let (_, outcome) = fx.run_bootstrap(&kind).await.expect("claimed");
    assert_eq!(outcome, Outcome::Ended("failed"));
    let row = fx.bootstrap(id).await;
    assert_eq!(
        (row.run_state.as_str(), row.checkpoint.as_str()),
        ("failed", "pending_snapshot")
    );
    assert_eq!(
        row.last_error_code.as_deref(),
        Some(walk::PROCESSING_FAILED)
    );
    assert_eq!(
        row.last_error_message.as_deref(),
        Some("Knowledge space already has an active document mutation lease")
    );
    assert_eq!(row.total_documents, 0);
    assert!(
        fx.items(id).await.is_empty(),
        "nothing frozen under a live lease"
    );
    assert!(fx.run_bootstrap(&kind).await.is_none(), "failed for good");

    // The lease expires (it stays, as the platform's capture leaves it): after the operator's
    // retry the capture freezes the set and requests the compiles.
    sqlx::query("UPDATE knowledge_space_mutation_leases SET expires_at = now() - interval '1 second' WHERE id = $1")
        .bind(lease)
        .execute(fx.pool())
        .await
        .unwrap();
    assert!(fx.retry_bootstrap().await);
    let (_, outcome) = fx.run_bootstrap(&kind).await.expect("claimed");
    assert_eq!(
        outcome,
        Outcome::Ended("wait"),
        "waits for its compiles now"
    );
    let row = fx.bootstrap(id).await;
    assert_eq!(
        (row.checkpoint.as_str(), row.total_documents),
        ("rebuilding", 3)
    );
    let items = fx.items(id).await;
    assert_eq!(
        items
            .iter()
            .map(|i| i.document_asset_id)
            .collect::<Vec<_>>(),
        docs
    );
    assert!(items
        .iter()
        .all(|i| i.status == "running" && i.compilation_attempt_id.is_some()));

    // Another space: a lease without an expiry is not live for the platform's capture, but an
    // active compile attempt is refused.
    let other = new_space(fx.pool(), "other").await;
    add_mutation_lease(fx.pool(), other, "NULL").await;
    let mut conn = fx.pool().acquire().await.unwrap();
    let doc = platform::add_document(
        &mut conn,
        &fx.store,
        other,
        None,
        "notes.txt",
        "text/plain",
        NOTES_TXT.to_vec().into(),
    )
    .await
    .unwrap();
    let mut tx = conn.begin().await.unwrap();
    compile::request(&mut tx, doc, Default::default())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let other_id = bootstrap::enqueue(&mut conn, TENANT, other).await.unwrap();
    drop(conn);
    let (lease, outcome) = fx.run_bootstrap(&kind).await.expect("claimed");
    assert_eq!(
        (lease.job_id, outcome),
        (other_id, Outcome::Ended("failed"))
    );
    let row = fx.bootstrap(other_id).await;
    assert_eq!(
        row.last_error_message.as_deref(),
        Some("Legacy publication bootstrap requires all document compilation attempts to be idle")
    );
    fx.cleanup().await;
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

/// A row as JSON, without the columns named in `drop`.
async fn row_json(pool: &PgPool, table: &str, args: (Uuid, &str), drop: &[&str]) -> Value {
    let mut v: Value = sqlx::query_scalar(&format!(
        "SELECT to_jsonb(t) FROM {table} t WHERE t.knowledge_space_id = $1 AND t.kind = $2"
    ))
    .bind(args.0)
    .bind(args.1)
    .fetch_one(pool)
    .await
    .unwrap();
    for k in drop {
        v.as_object_mut().unwrap().remove(*k);
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn backfill_discovers_the_manifest_profiles_and_installs_revision_and_head_as_the_platform_does(
) {
    let fx = Fx::bare().await;
    let version = set_manifest_keys(
        fx.pool(),
        fx.space,
        json!({ "__knowledgeFsEmbeddingProfile": embedding_profile(),
                "__knowledgeFsRetrievalProfile": retrieval_profile(), "__knowledgeFsEmbeddingProfileFrozenAt": "x" }),
    )
    .await;
    // Discovery freezes each profile key once per manifest version and digest.
    let mut conn = fx.pool().acquire().await.unwrap();
    let page = backfill::discover(&mut conn, None, 10, 5).await.unwrap();
    assert_eq!(
        (page.scanned, page.created, page.next),
        (1, 2, Some(fx.space))
    );
    assert_eq!(
        backfill::discover(&mut conn, None, 10, 5)
            .await
            .unwrap()
            .created,
        0
    );
    assert_eq!(
        backfill::discover(&mut conn, Some(fx.space), 10, 5)
            .await
            .unwrap()
            .scanned,
        0
    );
    drop(conn);
    let rows = backfills(fx.pool(), fx.space).await;
    assert_eq!(
        rows.iter()
            .map(|r| (r.0.as_str(), r.1, r.3.as_str()))
            .collect::<Vec<_>>(),
        [
            ("embedding", version, "queued"),
            ("retrieval", version, "queued")
        ]
    );
    let queued = row_json(
        fx.pool(),
        "knowledge_space_profile_backfills",
        (fx.space, "embedding"),
        &["id", "created_at", "updated_at"],
    )
    .await;
    assert_eq!(
        queued,
        json!({ "tenant_id": TENANT, "knowledge_space_id": fx.space, "kind": "embedding", "source_manifest_version": version,
                "source_snapshot": embedding_profile(), "source_snapshot_digest": backfill::walk::digest(&embedding_profile()),
                "run_state": "queued", "execution_attempts": 0, "max_execution_attempts": 5, "worker_id": null,
                "lease_token": null, "lease_expires_at": null, "heartbeat_at": null, "row_version": 1,
                "last_error_code": null, "last_error_message": null, "completed_at": null })
    );

    let kind = BackfillKind::default();
    assert_eq!(run_backfills(fx.pool(), &kind).await, 2);
    for (kind_name, _, id, state, err) in backfills(fx.pool(), fx.space).await {
        assert_eq!((state.as_str(), err), ("succeeded", None), "{kind_name}");
        let (_, attempts, _, _, token) = backfill_row(fx.pool(), id).await;
        assert_eq!((attempts, token), (1, None));
        // Every state written: queued → running → running (the step's fence) → succeeded.
        let states = fx.states(id).await;
        let runs: Vec<&str> = states.iter().map(|s| s.0.as_str()).collect();
        assert_eq!(
            runs,
            ["queued", "running", "running", "succeeded"],
            "{states:?}"
        );
        assert!(states.windows(2).all(|w| w[1].2 > w[0].2));
    }

    // The revision and head rows, every column as the platform's process writes them, all in
    // the transaction that ended the backfill.
    for (kind_name, source) in [
        ("embedding", embedding_profile()),
        ("retrieval", retrieval_profile()),
    ] {
        let (discovered_at, revision_id, one_tx): (String, Uuid, bool) = sqlx::query_as(
            "SELECT to_char(b.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'), r.id, r.created_at = b.completed_at AND r.updated_at = b.completed_at \
               AND r.activated_at = b.completed_at AND h.created_at = b.completed_at AND h.updated_at = b.completed_at \
             FROM knowledge_space_profile_backfills b \
             JOIN knowledge_space_profile_revisions r ON r.knowledge_space_id = b.knowledge_space_id AND r.kind = b.kind \
             JOIN knowledge_space_profile_heads h ON h.profile_revision_id = r.id \
             WHERE b.knowledge_space_id = $1 AND b.kind = $2",
        )
        .bind(fx.space)
        .bind(kind_name)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert!(
            one_tx,
            "{kind_name}: revision, head and success share one transaction's time"
        );
        let capability = profile::derive_capability(kind_name, &source, &discovered_at).unwrap();
        let (model, vsid, dim) = if kind_name == "embedding" {
            (
                "text-embedding-3-small",
                source["vectorSpaceId"].clone(),
                json!(8),
            )
        } else {
            ("gpt-4o-mini", Value::Null, Value::Null)
        };
        let drop = ["id", "created_at", "updated_at", "activated_at"];
        assert_eq!(
            row_json(
                fx.pool(),
                "knowledge_space_profile_revisions",
                (fx.space, kind_name),
                &drop
            )
            .await,
            json!({ "tenant_id": TENANT, "knowledge_space_id": fx.space, "kind": kind_name, "revision": 1, "state": "active",
                    "snapshot": source, "snapshot_digest": backfill::walk::digest(&source),
                    "capability_snapshot": capability, "capability_snapshot_digest": backfill::walk::digest(&capability),
                    "plugin_id": "langgenius/openai", "provider": "openai", "model": model, "vector_space_id": vsid,
                    "dimension": dim, "created_by_subject_id": "system:legacy-profile-backfill", "failure_code": null,
                    "failure_message": null, "superseded_at": null, "failed_at": null }),
            "{kind_name}"
        );
        assert_eq!(
            row_json(
                fx.pool(),
                "knowledge_space_profile_heads",
                (fx.space, kind_name),
                &drop
            )
            .await,
            json!({ "tenant_id": TENANT, "knowledge_space_id": fx.space, "kind": kind_name,
                    "profile_revision_id": revision_id, "active_revision": 1, "row_version": 1 }),
            "{kind_name}"
        );
    }

    // A repeated process (the row queued again) finds its own head and succeeds without writing.
    let (_, _, emb, _, _) = backfills(fx.pool(), fx.space).await.remove(0);
    sqlx::query(
        "UPDATE knowledge_space_profile_backfills SET run_state = 'queued', completed_at = NULL, updated_at = now() - interval '1 hour' WHERE id = $1",
    )
    .bind(emb)
    .execute(fx.pool())
    .await
    .unwrap();
    assert_eq!(run_backfills(fx.pool(), &kind).await, 1);
    assert_eq!(backfill_row(fx.pool(), emb).await.0, "succeeded");
    let revisions: i64 =
        sqlx::query_scalar("SELECT count(*) FROM knowledge_space_profile_revisions")
            .fetch_one(fx.pool())
            .await
            .unwrap();
    assert_eq!(revisions, 2);
    // And compiles now embed with the installed profile (the space has a head of each kind).
    let mut conn = fx.pool().acquire().await.unwrap();
    assert_eq!(
        backfill::discover(&mut conn, None, 10, 5)
            .await
            .unwrap()
            .scanned,
        0
    );
    fx.cleanup().await;
}

/// A backfill's kind, run state and error code.
type Fill<'a> = (&'a str, &'a str, Option<&'a str>);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn backfill_refuses_with_the_platforms_codes_and_writes_nothing() {
    let fx = Fx::bare().await;
    let pool = fx.pool();
    let emb = |v: Value| json!({ "__knowledgeFsEmbeddingProfile": v });
    let ret = json!({ "__knowledgeFsRetrievalProfile": retrieval_profile() });
    let mut conn = pool.acquire().await.unwrap();

    // The manifest moved on after discovery: the stale snapshot fails, the new version's succeeds.
    let moved = new_space(pool, "moved").await;
    set_manifest_keys(pool, moved, ret.clone()).await;
    backfill::discover(&mut conn, None, 100, 5).await.unwrap();
    set_manifest_keys(pool, moved, json!({})).await;
    // The manifest's profile is no longer an object (no version change): nothing new is discovered.
    let replaced = new_space(pool, "replaced").await;
    set_manifest_keys(pool, replaced, ret.clone()).await;
    // The stored snapshot no longer hashes to its digest.
    let tampered = new_space(pool, "tampered").await;
    set_manifest_keys(pool, tampered, ret.clone()).await;
    // A different head exists (the platform's own activation, with its own capability).
    let headed = new_space(pool, "headed").await;
    platform::activate_embedding_profile(
        &mut conn,
        TENANT,
        headed,
        "text-embedding-3-small",
        "openai",
        8,
    )
    .await
    .unwrap();
    // A revision of the same number exists without a head.
    let orphan = new_space(pool, "orphan").await;
    platform::activate_embedding_profile(
        &mut conn,
        TENANT,
        orphan,
        "text-embedding-3-small",
        "openai",
        8,
    )
    .await
    .unwrap();
    sqlx::query("DELETE FROM knowledge_space_profile_heads WHERE knowledge_space_id = $1")
        .bind(orphan)
        .execute(pool)
        .await
        .unwrap();
    // No manifest, a space being deleted, and profiles the platform rejects.
    let unmanifested = new_space(pool, "unmanifested").await;
    set_manifest_keys(pool, unmanifested, ret.clone()).await;
    let deleting = new_space(pool, "deleting").await;
    set_manifest_keys(pool, deleting, ret.clone()).await;
    let undimensioned = new_space(pool, "undimensioned").await;
    let mut no_dim = embedding_profile();
    no_dim.as_object_mut().unwrap().remove("dimension");
    set_manifest_keys(pool, undimensioned, emb(no_dim)).await;
    let unproven = new_space(pool, "unproven").await;
    let mut other_vsid = embedding_profile();
    other_vsid["vectorSpaceId"] = json!(format!("embedding-space-sha256:{}", "a".repeat(64)));
    set_manifest_keys(pool, unproven, emb(other_vsid)).await;
    let malformed = new_space(pool, "malformed").await;
    let mut extra = embedding_profile();
    extra["capabilities"] = json!({"batch": true});
    set_manifest_keys(pool, malformed, emb(extra)).await;
    backfill::discover(&mut conn, None, 100, 5).await.unwrap();

    set_manifest_keys(
        pool,
        replaced,
        json!({ "__knowledgeFsRetrievalProfile": "gone" }),
    )
    .await;
    // (set_manifest_keys bumps the version; put it back so only the profile changed.)
    sqlx::query("UPDATE knowledge_space_manifests SET manifest_version = manifest_version - 1 WHERE knowledge_space_id = $1")
        .bind(replaced)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("UPDATE knowledge_space_profile_backfills SET source_snapshot = source_snapshot || '{\"topK\": 9}' WHERE knowledge_space_id = $1")
        .bind(tampered)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM knowledge_space_manifests WHERE knowledge_space_id = $1")
        .bind(unmanifested)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("UPDATE knowledge_spaces SET lifecycle_state = 'deleting', deletion_job_id = gen_random_uuid(), deleting_at = now() WHERE id = $1")
        .bind(deleting)
        .execute(pool)
        .await
        .unwrap();
    drop(conn);

    run_backfills(pool, &BackfillKind::default()).await;
    let want: Vec<(Uuid, Vec<Fill>)> = vec![
        (
            moved,
            vec![
                ("retrieval", "failed", Some("LEGACY_PROFILE_SOURCE_CHANGED")),
                ("retrieval", "succeeded", None),
            ],
        ),
        (
            replaced,
            vec![("retrieval", "failed", Some("LEGACY_PROFILE_SOURCE_CHANGED"))],
        ),
        (
            tampered,
            vec![("retrieval", "failed", Some("LEGACY_PROFILE_SOURCE_CHANGED"))],
        ),
        (
            headed,
            vec![("embedding", "failed", Some("PROFILE_HEAD_ALREADY_EXISTS"))],
        ),
        (
            orphan,
            vec![(
                "embedding",
                "failed",
                Some("PROFILE_REVISION_ALREADY_EXISTS"),
            )],
        ),
        (
            unmanifested,
            vec![("retrieval", "failed", Some("LEGACY_MANIFEST_NOT_FOUND"))],
        ),
        (
            deleting,
            vec![("retrieval", "failed", Some("KNOWLEDGE_SPACE_NOT_WRITABLE"))],
        ),
        (
            undimensioned,
            vec![("embedding", "failed", Some("LEGACY_PROFILE_INVALID"))],
        ),
        (
            unproven,
            vec![("embedding", "failed", Some("LEGACY_PROFILE_INVALID"))],
        ),
        (
            malformed,
            vec![(
                "embedding",
                "failed",
                Some("PROFILE_BACKFILL_CAPABILITY_INVALID"),
            )],
        ),
    ];
    for (space, rows) in want {
        let got = backfills(pool, space).await;
        let got: Vec<Fill> = got
            .iter()
            .map(|r| (r.0.as_str(), r.3.as_str(), r.4.as_deref()))
            .collect();
        assert_eq!(got, rows, "space {space}");
    }
    let failed: Vec<(Option<Uuid>, Option<String>, bool)> = sqlx::query_as(
        "SELECT lease_token, last_error_message, completed_at IS NOT NULL FROM knowledge_space_profile_backfills \
         WHERE run_state = 'failed'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(failed.len(), 10);
    assert!(failed
        .iter()
        .all(|(t, m, done)| t.is_none() && m.is_some() && *done));
    // Refusals write no revision: only the moved space's fresh profile and the fixtures' own.
    let revisions: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT knowledge_space_id, created_by_subject_id::text FROM knowledge_space_profile_revisions ORDER BY 2, 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let backfilled: Vec<Uuid> = revisions
        .iter()
        .filter(|r| r.1 == "system:legacy-profile-backfill")
        .map(|r| r.0)
        .collect();
    assert_eq!(backfilled, [moved]);
    assert_eq!(revisions.len(), 3);

    // The operator's retry queues the latest failed backfill of a kind again, attempts reset.
    let mut conn = pool.acquire().await.unwrap();
    let again = backfill::retry(&mut conn, TENANT, undimensioned, "embedding")
        .await
        .unwrap();
    assert!(again.is_some());
    assert_eq!(
        backfill::retry(&mut conn, TENANT, moved, "retrieval")
            .await
            .unwrap(),
        None,
        "its latest succeeded"
    );
    let (state, attempts, _, err, _) = backfill_row(pool, again.unwrap()).await;
    assert_eq!((state.as_str(), attempts, err), ("queued", 0, None));
    fx.cleanup().await;
}

/// The platform's published-runtime-snapshot condition, written from its resolver's one
/// SELECT: the head's publication is `published` and has an activated binding of its
/// fingerprint whose retrieval profile is the current active retrieval head, and either neither
/// the binding nor the space has an embedding profile, or the binding names exactly the current
/// embedding head, its digest and its vector space. Without a row, the platform's queries,
/// retrieval tests and research tasks answer 503.
const RUNTIME_SNAPSHOT: &str = r#"
SELECT count(*) FROM projection_set_publication_heads ph
JOIN projection_set_publications pub ON pub.tenant_id = ph.tenant_id
  AND pub.knowledge_space_id = ph.knowledge_space_id AND pub.id = ph.publication_id AND pub.status = 'published'
JOIN knowledge_space_profile_publication_bindings b ON b.tenant_id = ph.tenant_id
  AND b.knowledge_space_id = ph.knowledge_space_id AND b.publication_id = pub.id
  AND b.publication_fingerprint = pub.fingerprint AND b.activated_at IS NOT NULL
JOIN knowledge_space_profile_heads rh ON rh.tenant_id = ph.tenant_id AND rh.knowledge_space_id = ph.knowledge_space_id
  AND rh.kind = 'retrieval' AND rh.profile_revision_id = b.retrieval_profile_revision_id
  AND rh.active_revision = b.retrieval_profile_revision
JOIN knowledge_space_profile_revisions rr ON rr.id = rh.profile_revision_id AND rr.tenant_id = rh.tenant_id
  AND rr.knowledge_space_id = rh.knowledge_space_id AND rr.kind = rh.kind AND rr.revision = rh.active_revision
  AND rr.snapshot_digest = b.retrieval_profile_snapshot_digest AND rr.state = 'active'
LEFT JOIN knowledge_space_profile_heads eh ON eh.tenant_id = ph.tenant_id
  AND eh.knowledge_space_id = ph.knowledge_space_id AND eh.kind = 'embedding'
LEFT JOIN knowledge_space_profile_revisions er ON er.id = eh.profile_revision_id AND er.tenant_id = eh.tenant_id
  AND er.knowledge_space_id = eh.knowledge_space_id AND er.kind = eh.kind AND er.revision = eh.active_revision
  AND er.state = 'active'
WHERE ph.tenant_id = $1 AND ph.knowledge_space_id = $2
  AND ((b.embedding_profile_revision_id IS NULL AND b.embedding_profile_revision IS NULL
        AND b.embedding_profile_snapshot_digest IS NULL AND b.vector_space_id IS NULL
        AND eh.profile_revision_id IS NULL AND er.id IS NULL)
    OR (b.embedding_profile_revision_id IS NOT NULL AND eh.profile_revision_id = b.embedding_profile_revision_id
        AND eh.active_revision = b.embedding_profile_revision AND er.id = b.embedding_profile_revision_id
        AND er.snapshot_digest = b.embedding_profile_snapshot_digest AND er.vector_space_id = b.vector_space_id))"#;

/// Whether the platform's readers can resolve the space's published runtime snapshot.
async fn resolvable(pool: &PgPool, space: Uuid) -> bool {
    let n: i64 = sqlx::query_scalar(RUNTIME_SNAPSHOT)
        .bind(TENANT)
        .bind(space)
        .fetch_one(pool)
        .await
        .unwrap();
    n == 1
}

/// The space's publication bindings, every column, oldest first.
async fn bindings(pool: &PgPool, space: Uuid) -> Vec<Value> {
    sqlx::query_scalar(
        "SELECT to_jsonb(b) FROM knowledge_space_profile_publication_bindings b \
         WHERE b.knowledge_space_id = $1 ORDER BY b.created_at, b.id",
    )
    .bind(space)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The space's current profile head of `kind`: its revision's id, number, digest and vector
/// space.
async fn current_profile(
    pool: &PgPool,
    space: Uuid,
    kind: &str,
) -> (Uuid, i32, String, Option<String>) {
    sqlx::query_as(
        "SELECT r.id, r.revision, r.snapshot_digest::text, r.vector_space_id::text \
         FROM knowledge_space_profile_heads h JOIN knowledge_space_profile_revisions r ON r.id = h.profile_revision_id \
         WHERE h.knowledge_space_id = $1 AND h.kind = $2",
    )
    .bind(space)
    .bind(kind)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// One tick on a fresh cursor: (scanned, created, bindings reconciled, binding failed).
async fn tick(pool: &PgPool) -> (usize, usize, usize, usize) {
    let mut conn = pool.acquire().await.unwrap();
    let t = backfill::tick(&mut conn, None, 100, 5).await.unwrap();
    (
        t.discovered.scanned,
        t.discovered.created,
        t.bindings_reconciled,
        t.binding_failed,
    )
}

async fn bind_directly(
    pool: &PgPool,
    space: Uuid,
) -> Result<backfill::binding::Reconciled, &'static str> {
    let mut conn = pool.acquire().await.unwrap();
    backfill::binding::bind_current_published(&mut conn, TENANT, space)
        .await
        .unwrap()
        .map_err(|r| r.code)
}

/// A legacy space: its head was compiled (with dense vectors in the manifest embedding
/// profile's vector space) before 0018, so it has the manifest's profiles but no profile head,
/// no profile revision and no binding. Returns the head's publication.
///
/// Compile now runs only under profile heads and its publish binds the head, so the head is
/// compiled under the space's profiles and then put back into the state a space that predates
/// 0018/0019 is in: the publish's `content-publication` binding deleted, the attempt's frozen
/// profile tuple cleared (the eight columns writers before 0019 left NULL), the profile heads
/// and revisions deleted, and the profiles left only in the manifest keys a 0018-era API wrote.
async fn legacy_head(fx: &Fx) -> Uuid {
    let mut conn = fx.pool().acquire().await.unwrap();
    platform::activate_embedding_profile(
        &mut conn,
        TENANT,
        fx.space,
        "text-embedding-3-small",
        "openai",
        8,
    )
    .await
    .unwrap();
    drop(conn);
    let doc = fx.add("guide.md", "text/markdown", GUIDE_MD).await;
    fx.compile(doc).await;
    let publication = fx.head().await.unwrap().publication_id;
    assert_eq!(
        bindings(fx.pool(), fx.space).await.len(),
        1,
        "the publish bound its head"
    );
    for sql in [
        "DELETE FROM knowledge_space_profile_publication_bindings WHERE knowledge_space_id = $1",
        "UPDATE document_compilation_attempts SET embedding_profile_kind = NULL, \
           embedding_profile_revision_id = NULL, embedding_profile_revision = NULL, \
           embedding_profile_snapshot_digest = NULL, retrieval_profile_kind = NULL, \
           retrieval_profile_revision_id = NULL, retrieval_profile_revision = NULL, \
           retrieval_profile_snapshot_digest = NULL WHERE knowledge_space_id = $1",
        "DELETE FROM knowledge_space_profile_heads WHERE knowledge_space_id = $1",
        "DELETE FROM knowledge_space_profile_revisions WHERE knowledge_space_id = $1",
    ] {
        sqlx::query(sql)
            .bind(fx.space)
            .execute(fx.pool())
            .await
            .unwrap();
    }
    set_manifest_keys(
        fx.pool(),
        fx.space,
        json!({ "__knowledgeFsEmbeddingProfile": embedding_profile(),
                "__knowledgeFsRetrievalProfile": retrieval_profile() }),
    )
    .await;
    assert!(bindings(fx.pool(), fx.space).await.is_empty());
    assert_eq!(fx.head().await.unwrap().publication_id, publication);
    publication
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_head_published_before_its_profiles_gets_one_legacy_bootstrap_binding_and_becomes_resolvable(
) {
    let fx = Fx::new().await;
    let pool = fx.pool();
    let publication = legacy_head(&fx).await;
    assert!(!resolvable(pool, fx.space).await);

    // The first ticks find the profile heads missing (not ready: neither counted); the tick
    // after the backfills installed them binds the head.
    assert_eq!(run_backfills(pool, &BackfillKind::default()).await, 2);
    let rows = bindings(pool, fx.space).await;
    assert_eq!(rows.len(), 1, "{rows:#?}");
    let mut row = rows[0].clone();
    let fingerprint: String = sqlx::query_scalar(
        "SELECT fingerprint::text FROM projection_set_publications WHERE id = $1",
    )
    .bind(publication)
    .fetch_one(pool)
    .await
    .unwrap();
    let (e_id, e_rev, e_digest, e_vsid) = current_profile(pool, fx.space, "embedding").await;
    let (r_id, r_rev, r_digest, _) = current_profile(pool, fx.space, "retrieval").await;
    assert_eq!(
        e_vsid.as_deref(),
        embedding_profile()["vectorSpaceId"].as_str()
    );
    let o = row.as_object_mut().unwrap();
    let id = o.remove("id").unwrap();
    assert_ne!(id, json!(publication), "a random id, not the publication's");
    let (created, activated) = (
        o.remove("created_at").unwrap(),
        o.remove("activated_at").unwrap(),
    );
    assert_eq!(created, activated);
    assert_eq!(
        row,
        json!({ "tenant_id": TENANT, "knowledge_space_id": fx.space, "changed_kind": "bootstrap",
                "binding_reason": "legacy-bootstrap", "embedding_profile_kind": "embedding",
                "embedding_profile_revision_id": e_id, "embedding_profile_revision": e_rev,
                "embedding_profile_snapshot_digest": e_digest, "retrieval_profile_kind": "retrieval",
                "retrieval_profile_revision_id": r_id, "retrieval_profile_revision": r_rev,
                "retrieval_profile_snapshot_digest": r_digest, "vector_space_id": e_vsid,
                "publication_id": publication, "publication_fingerprint": fingerprint })
    );
    assert!(
        resolvable(pool, fx.space).await,
        "the platform's readers now resolve the head"
    );

    // Again: discovery no longer selects the space, and a direct reconciliation keeps the row.
    assert_eq!(tick(pool).await, (0, 0, 0, 0));
    assert_eq!(run_backfills(pool, &BackfillKind::default()).await, 0);
    assert_eq!(
        bind_directly(pool, fx.space).await,
        Ok(backfill::binding::Reconciled::Kept)
    );
    assert_eq!(
        bindings(pool, fx.space).await,
        rows,
        "nothing more was written"
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_head_that_already_has_a_binding_is_left_alone() {
    // The space's initial retrieval profile and an embedding profile, then a compile: its
    // publish writes the head's `content-publication` binding.
    let fx = Fx::new().await;
    let pool = fx.pool();
    let mut conn = pool.acquire().await.unwrap();
    platform::activate_embedding_profile(
        &mut conn,
        TENANT,
        fx.space,
        "text-embedding-3-small",
        "openai",
        8,
    )
    .await
    .unwrap();
    drop(conn);
    let doc = fx.add("guide.md", "text/markdown", GUIDE_MD).await;
    fx.compile(doc).await;
    let publication = fx.head().await.unwrap().publication_id;
    let before = bindings(pool, fx.space).await;
    assert_eq!(before.len(), 1, "{before:#?}");
    assert_eq!(
        (
            &before[0]["id"],
            &before[0]["publication_id"],
            &before[0]["binding_reason"]
        ),
        (
            &json!(publication),
            &json!(publication),
            &json!("content-publication")
        ),
        "the publish's binding"
    );
    assert!(resolvable(pool, fx.space).await);

    // Discovery does not select the space; a reconciliation forced on it refuses the other
    // tuple (another reason) and writes nothing.
    assert_eq!(tick(pool).await, (0, 0, 0, 0));
    assert_eq!(run_backfills(pool, &BackfillKind::default()).await, 0);
    assert_eq!(
        bind_directly(pool, fx.space).await,
        Err(backfill::binding::code::BINDING_CONFLICT)
    );
    assert_eq!(bindings(pool, fx.space).await, before);
    assert!(resolvable(pool, fx.space).await);
    fx.cleanup().await;
}

/// A statement and its one argument.
type Statement = (&'static str, Value);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_head_whose_dense_projections_are_not_ready_in_the_profiles_vector_space_is_not_bound() {
    let fx = Fx::new().await;
    let pool = fx.pool();
    let publication = legacy_head(&fx).await;
    let dense: Vec<Uuid> = sqlx::query_scalar(
        "SELECT ip.id FROM projection_set_publication_members pm \
         JOIN index_projections ip ON ip.id = pm.component_key AND ip.publication_generation_id = pm.generation_id \
         WHERE pm.publication_id = $1 AND pm.component_type = 'index-projection' AND ip.type = 'dense-vector' \
         ORDER BY ip.id",
    )
    .bind(publication)
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(!dense.is_empty());
    let exec = |sql: &'static str, id: Value| async move {
        sqlx::query(sql).bind(id).execute(pool).await.unwrap();
    };
    // Each way the head fails to close over the profile's vector space, and its repair.
    let member: Value = sqlx::query_scalar(
        "SELECT to_jsonb(pm) FROM projection_set_publication_members pm WHERE pm.component_key = $1",
    )
    .bind(dense[0])
    .fetch_one(pool)
    .await
    .unwrap();
    let ids = json!(dense.iter().map(Uuid::to_string).collect::<Vec<_>>());
    let first = json!(dense[0].to_string());
    let cases: Vec<(&str, Statement, Statement)> = vec![
        (
            "dense vectors of another vector space",
            ("UPDATE index_projections SET model = 'embedding-space-sha256:' || repeat('b', 64) \
              WHERE id IN (SELECT jsonb_array_elements_text($1)::uuid)", ids.clone()),
            ("UPDATE index_projections p SET model = m.vsid FROM (SELECT vector_space_id AS vsid \
              FROM knowledge_space_profile_revisions WHERE kind = 'embedding' LIMIT 1) m \
              WHERE p.id IN (SELECT jsonb_array_elements_text($1)::uuid)", ids.clone()),
        ),
        (
            "a dense vector not ready",
            ("UPDATE index_projections SET status = 'building' WHERE id = ($1 #>> '{}')::uuid", first.clone()),
            ("UPDATE index_projections SET status = 'ready' WHERE id = ($1 #>> '{}')::uuid", first.clone()),
        ),
        (
            "a ready fts member without its dense twin",
            ("DELETE FROM projection_set_publication_members WHERE component_key = ($1 #>> '{}')::uuid", first),
            ("INSERT INTO projection_set_publication_members \
              SELECT * FROM jsonb_populate_record(NULL::projection_set_publication_members, $1)", member),
        ),
    ];
    let mut installed = false;
    for (name, (break_sql, break_arg), (repair_sql, repair_arg)) in cases {
        exec(break_sql, break_arg).await;
        if !installed {
            // The backfills install the profile heads; no tick binds the head.
            assert_eq!(run_backfills(pool, &BackfillKind::default()).await, 2);
            installed = true;
        }
        assert_eq!(
            tick(pool).await,
            (1, 0, 0, 1),
            "{name}: counted as a failed binding"
        );
        assert_eq!(
            bind_directly(pool, fx.space).await,
            Err(backfill::binding::code::VECTOR_SPACE_CONFLICT),
            "{name}"
        );
        assert!(bindings(pool, fx.space).await.is_empty(), "{name}");
        assert!(!resolvable(pool, fx.space).await, "{name}");
        exec(repair_sql, repair_arg).await;
    }
    // Repaired, the head is bound by the next tick.
    assert_eq!(tick(pool).await, (1, 0, 1, 0));
    assert_eq!(bindings(pool, fx.space).await.len(), 1);
    assert!(resolvable(pool, fx.space).await);
    fx.cleanup().await;
}

/// The body of a plain HTTP GET to the worker's own server.
fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The SQLSTATE of a failed statement.
async fn sqlstate(pool: &PgPool, sql: &str, id: Uuid) -> Option<String> {
    match sqlx::query(sql).bind(id).execute(pool).await {
        Ok(_) => None,
        Err(sqlx::Error::Database(db)) => db.code().map(|c| c.into_owned()),
        Err(e) => panic!("{e}"),
    }
}

/// A queued bootstrap and a queued (discovered) retrieval backfill of the fixture space.
async fn one_of_each(fx: &Fx) -> (Uuid, Uuid) {
    set_manifest_keys(
        fx.pool(),
        fx.space,
        json!({ "__knowledgeFsRetrievalProfile": retrieval_profile() }),
    )
    .await;
    let mut conn = fx.pool().acquire().await.unwrap();
    backfill::discover(&mut conn, None, 100, 5).await.unwrap();
    let fill = backfills(fx.pool(), fx.space).await[0].2;
    (fx.enqueue_bootstrap().await, fill)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stale_lease_tokens_and_row_versions_cannot_write() {
    let fx = Fx::new().await;
    fx.three_documents().await;
    let (boot, fill) = one_of_each(&fx).await;
    // Worker w1 is alive (it holds its liveness lock), so its leases are not taken over early.
    let services = fx.env.services();
    let _alive = kfs_worker::liveness::acquire(&services.database_url, "w1")
        .await
        .unwrap();
    let kinds: [(&dyn LeasedKind, Uuid); 2] = [
        (&BootstrapKind::default(), boot),
        (&BackfillKind::default(), fill),
    ];
    for (kind, id) in kinds {
        let table = kind.table();
        let mut conn = fx.pool().acquire().await.unwrap();
        let job = kind.claim(&mut conn, "w1").await.unwrap().expect("claimed");
        assert_eq!(job.job_id, id);
        assert!(
            kind.claim(&mut conn, "w2").await.unwrap().is_none(),
            "{table}: a live lease is not claimed twice"
        );
        let before: String =
            sqlx::query_scalar(&format!("SELECT t::text FROM {table} t WHERE id = $1"))
                .bind(id)
                .fetch_one(fx.pool())
                .await
                .unwrap();
        let stale_version = Lease {
            row_version: job.row_version - 1,
            ..job.clone()
        };
        let stale_token = Lease {
            lease_token: Uuid::new_v4(),
            ..job.clone()
        };
        let succeed = End::Succeed {
            checkpoint: "published".into(),
        };
        for stale in [&stale_version, &stale_token] {
            let mut tx = conn.begin().await.unwrap();
            assert_eq!(
                leased::fence(&mut tx, table, stale, std::time::Duration::from_secs(30))
                    .await
                    .unwrap(),
                None,
                "{table}"
            );
            tx.rollback().await.unwrap();
            assert!(
                !kind.end(&mut conn, stale, &succeed).await.unwrap(),
                "{table}"
            );
            assert!(
                !kind.end(&mut conn, stale, &End::Continue).await.unwrap(),
                "{table}"
            );
        }
        assert!(
            !leased::heartbeat(&mut conn, table, &stale_token, Duration::from_secs(30))
                .await
                .unwrap()
        );
        let after: String =
            sqlx::query_scalar(&format!("SELECT t::text FROM {table} t WHERE id = $1"))
                .bind(id)
                .fetch_one(fx.pool())
                .await
                .unwrap();
        assert_eq!(before, after, "{table}: stale writers changed the row");

        // The lease runs out: the holder's own token no longer writes, and another worker
        // takes the job over.
        assert!(
            leased::heartbeat(&mut conn, table, &job, Duration::from_secs(30))
                .await
                .unwrap()
        );
        sqlx::query(&format!(
            "UPDATE {table} SET lease_expires_at = now() - interval '1 second' WHERE id = $1"
        ))
        .bind(id)
        .execute(fx.pool())
        .await
        .unwrap();
        let mut tx = conn.begin().await.unwrap();
        assert_eq!(
            leased::fence(&mut tx, table, &job, std::time::Duration::from_secs(30))
                .await
                .unwrap(),
            None
        );
        tx.rollback().await.unwrap();
        assert!(
            !leased::heartbeat(&mut conn, table, &job, Duration::from_secs(30))
                .await
                .unwrap()
        );
        let taken = kind
            .claim(&mut conn, "w2")
            .await
            .unwrap()
            .expect("taken over");
        assert!(taken.taken_over);
        assert_ne!(taken.lease_token, job.lease_token);
        assert!(
            !kind.end(&mut conn, &job, &End::Continue).await.unwrap(),
            "{table}: the old lease wrote"
        );
        let mut tx = conn.begin().await.unwrap();
        assert!(
            leased::fence(&mut tx, table, &taken, std::time::Duration::from_secs(30))
                .await
                .unwrap()
                .is_some()
        );
        tx.rollback().await.unwrap();
        assert!(kind.end(&mut conn, &taken, &End::Continue).await.unwrap());
    }
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn check_constraints_refuse_invalid_states_of_both_tables() {
    let fx = Fx::new().await;
    let (boot, fill) = one_of_each(&fx).await;
    let b = "UPDATE legacy_space_publication_bootstraps SET";
    let f = "UPDATE knowledge_space_profile_backfills SET";
    let refused = [
        // Success only at published, with the counts complete (and a head when documents exist).
        format!("{b} run_state = 'succeeded', completed_at = now(), checkpoint = 'verifying' WHERE id = $1"),
        format!("{b} run_state = 'succeeded', completed_at = now(), checkpoint = 'published', total_documents = 2, completed_documents = 2 WHERE id = $1"),
        format!("{b} checkpoint = 'compiling' WHERE id = $1"),
        format!("{b} run_state = 'paused' WHERE id = $1"),
        format!("{b} completed_documents = 1 WHERE id = $1"),
        // A lease exactly while running; an end time exactly when ended.
        format!("{b} run_state = 'running' WHERE id = $1"),
        format!("{b} lease_token = gen_random_uuid() WHERE id = $1"),
        format!("{b} run_state = 'failed' WHERE id = $1"),
        format!("{b} row_version = -1 WHERE id = $1"),
        format!("{f} run_state = 'running' WHERE id = $1"),
        format!("{f} last_error_code = 'x', last_error_message = 'y' WHERE id = $1"),
        format!("{f} run_state = 'failed', completed_at = now() WHERE id = $1"),
        format!("{f} run_state = 'succeeded' WHERE id = $1"),
        format!("{f} execution_attempts = max_execution_attempts + 1 WHERE id = $1"),
        format!("{f} run_state = 'canceled', completed_at = now() WHERE id = $1"),
        format!("{f} row_version = 0 WHERE id = $1"),
    ];
    for sql in &refused {
        let id = if sql.starts_with(b) { boot } else { fill };
        assert_eq!(
            sqlstate(fx.pool(), sql, id).await.as_deref(),
            Some("23514"),
            "{sql}"
        );
    }
    // The walks' own writes: every end each kind writes is accepted by the CHECKs, from a held
    // lease, and leaves a consistent row.
    let services = fx.env.services();
    let _alive = kfs_worker::liveness::acquire(&services.database_url, "w1")
        .await
        .unwrap();
    let kinds: [(&dyn LeasedKind, Uuid, &str); 2] = [
        (&BootstrapKind::default(), boot, walk::PROCESSING_FAILED),
        (&BackfillKind::default(), fill, "LEGACY_PROFILE_INVALID"),
    ];
    for (kind, id, refusal) in kinds {
        let ends = [
            End::Continue,
            End::Wait {
                delay: Duration::from_millis(1),
                code: "waiting".into(),
                message: "m".into(),
                refund: true,
            },
            End::Wait {
                delay: Duration::from_millis(1),
                code: "db_unavailable".into(),
                message: "m".into(),
                refund: false,
            },
            End::Fail {
                code: refusal.into(),
                message: "m".into(),
            },
            End::Fail {
                code: "db_unavailable".into(),
                message: "m (no attempts left)".into(),
            },
            End::Cancel {
                code: "c".into(),
                message: "m".into(),
            },
        ];
        for end in &ends {
            sqlx::query(&format!(
                "UPDATE {} SET run_state = 'queued', completed_at = NULL, last_error_code = NULL, last_error_message = NULL, \
                   updated_at = now() - interval '1 hour' WHERE id = $1",
                kind.table()
            ))
            .bind(id)
            .execute(fx.pool())
            .await
            .unwrap();
            fx.due_now(boot).await;
            let mut conn = fx.pool().acquire().await.unwrap();
            let job = kind.claim(&mut conn, "w1").await.unwrap().expect("claimed");
            assert!(
                kind.end(&mut conn, &job, end).await.unwrap(),
                "{} {end:?}",
                kind.name()
            );
        }
    }
    // A refusal keeps its code; a transient failure out of attempts is recorded as exhausted.
    let codes: Vec<Option<String>> = sqlx::query_scalar(
        "SELECT last_error_code FROM leased_state_log WHERE run_state = 'failed' ORDER BY seq",
    )
    .fetch_all(fx.pool())
    .await
    .unwrap();
    let codes: Vec<&str> = codes.iter().map(|c| c.as_deref().unwrap()).collect();
    assert_eq!(
        codes,
        [
            walk::PROCESSING_FAILED,
            bootstrap::EXHAUSTED,
            "LEGACY_PROFILE_INVALID",
            backfill::walk::EXHAUSTED,
            "c"
        ]
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn worker_process_runs_both_leased_kinds_and_status_shows_them() {
    let fx = Fx::bare().await;
    fx.install_profiles().await;
    fx.three_documents().await;
    let boot = fx.enqueue_bootstrap().await;
    // Another space whose retrieval profile the worker's own discovery finds.
    let other = new_space(fx.pool(), "discovered").await;
    set_manifest_keys(
        fx.pool(),
        other,
        json!({ "__knowledgeFsRetrievalProfile": retrieval_profile() }),
    )
    .await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut w = fx.spawn("leased-proc", &["run"], &[("KFS_HTTP_ADDR", addr.as_str())]);
    let filled = || async {
        backfills(fx.pool(), other)
            .await
            .first()
            .is_some_and(|r| r.3 == "succeeded")
    };
    let done = fx
        .env
        .wait_until(Duration::from_secs(120), || async {
            fx.bootstrap(boot).await.run_state == "succeeded" && filled().await
        })
        .await;
    assert!(
        done,
        "not done: {:?} {:?}\n{}",
        fx.bootstrap(boot).await,
        backfills(fx.pool(), other).await,
        w.log_text()
    );
    assert!(fx.ready().await);
    assert_bootstrap_states(&fx.states(boot).await);

    let st = kfs_worker::status::read(fx.pool(), &[Kind::Compile])
        .await
        .unwrap();
    let by_kind = |k: &str| st.leased.iter().find(|l| l.kind == k).cloned().unwrap();
    assert_eq!(by_kind("bootstrap").jobs.get("succeeded"), Some(&1));
    assert_eq!(by_kind("bootstrap").checkpoints.get("published"), Some(&1));
    assert_eq!(by_kind("backfill").jobs.get("succeeded"), Some(&3));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"))
        .args(["status", "--json", "--kinds", "compile"])
        .env("DATABASE_URL", &fx.env.url)
        .env("AMQP_URL", support::amqp_url())
        .env("KFS_QUEUE_PREFIX", &fx.env.prefix)
        .output()
        .unwrap();
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["leased"][0]["kind"], "bootstrap");
    assert_eq!(json["leased"][0]["jobs"]["succeeded"], 1);
    assert_eq!(json["leased"][1]["jobs"]["succeeded"], 3);
    let metrics = http_get(port, "/metrics");
    for want in [
        r#"kfs_jobs{kind="bootstrap",state="succeeded"} 1"#,
        r#"kfs_jobs{kind="backfill",state="succeeded"} 3"#,
        r#"kfs_leased_checkpoints{kind="bootstrap",checkpoint="published"} 1"#,
        r#"kfs_slices_total{kind="backfill",end="succeeded"} 1"#,
    ] {
        assert!(metrics.contains(want), "{want} missing from\n{metrics}");
    }
    support::stop_cleanly([&mut w], Duration::from_secs(30)).await;
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_mid_walk_is_replaced_and_the_walk_finishes() {
    let fx = Fx::bare().await;
    fx.install_profiles().await;
    fx.three_documents().await;
    let boot = fx.enqueue_bootstrap().await;
    // The first worker runs only the leased jobs: it freezes the set and requests the compiles,
    // then waits for compiles nobody runs — and is SIGKILLed in the middle of the walk.
    let mut a = fx.spawn("leased-a", &["run", "--leased"], &[]);
    let rebuilding = fx
        .env
        .wait_until(Duration::from_secs(60), || async {
            fx.bootstrap(boot).await.checkpoint == "rebuilding"
        })
        .await;
    assert!(rebuilding, "{}", a.log_text());
    a.kill();
    assert_ne!(fx.bootstrap(boot).await.run_state, "succeeded");

    let mut b = fx.spawn("leased-b", &["run"], &[]);
    let done = fx
        .env
        .wait_until(Duration::from_secs(120), || async {
            fx.bootstrap(boot).await.run_state == "succeeded"
        })
        .await;
    assert!(done, "{:?}\n{}", fx.bootstrap(boot).await, b.log_text());
    // One compile per frozen document: nothing was requested twice.
    let per_doc: Vec<i64> = sqlx::query_scalar(
        "SELECT count(*) FROM document_compilation_attempts WHERE knowledge_space_id = $1 GROUP BY document_asset_id",
    )
    .bind(fx.space)
    .fetch_all(fx.pool())
    .await
    .unwrap();
    assert_eq!(per_doc, vec![1, 1, 1]);
    assert_bootstrap_states(&fx.states(boot).await);
    support::stop_cleanly([&mut b], Duration::from_secs(30)).await;
    fx.cleanup().await;
}

/// A worker aborted right after committing a step (a held lease, mid-walk) is taken over at
/// once through its lost liveness lock, and another worker finishes the walk.
#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_dying_after_a_step_commit_is_taken_over_and_the_walk_finishes() {
    use std::os::unix::process::ExitStatusExt;
    let fx = Fx::bare().await;
    fx.install_profiles().await;
    fx.three_documents().await;
    let boot = fx.enqueue_bootstrap().await;
    let mut a = fx.spawn(
        "crash-a",
        &["run"],
        &[("KFS_CRASH_AT", "leased-after-step-commit:2")],
    );
    let status = a
        .wait_exit(Duration::from_secs(60))
        .expect("worker a reached its kill point");
    assert_eq!(status.signal(), Some(6), "{}", a.log_text());
    let row = fx.bootstrap(boot).await;
    assert_eq!(row.run_state, "running", "died holding the lease: {row:?}");
    assert_eq!(row.checkpoint, "rebuilding");

    let mut b = fx.spawn("crash-b", &["run"], &[]);
    let done = fx
        .env
        .wait_until(Duration::from_secs(120), || async {
            fx.bootstrap(boot).await.run_state == "succeeded"
        })
        .await;
    assert!(done, "{:?}\n{}", fx.bootstrap(boot).await, b.log_text());
    let row = fx.bootstrap(boot).await;
    assert_eq!(
        row.snapshot_metadata["failures"],
        json!(1),
        "the takeover counts as a retried run"
    );
    let states = fx.states(boot).await;
    assert_bootstrap_states(&states);
    let tokens: std::collections::BTreeSet<Uuid> = states.iter().filter_map(|s| s.3).collect();
    assert!(tokens.len() >= 2, "a second lease finished the walk");
    support::stop_cleanly([&mut b], Duration::from_secs(30)).await;
    fx.cleanup().await;
}

/// A worker aborted inside the backfill's one transaction, just before it commits, leaves no
/// revision and no head; another worker takes the backfill over and installs them once.
#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_dying_inside_the_backfill_transaction_leaves_nothing_and_is_taken_over() {
    use std::os::unix::process::ExitStatusExt;
    let fx = Fx::bare().await;
    set_manifest_keys(
        fx.pool(),
        fx.space,
        json!({ "__knowledgeFsRetrievalProfile": retrieval_profile() }),
    )
    .await;
    let mut a = fx.spawn(
        "fill-a",
        &["run", "--leased"],
        &[("KFS_CRASH_AT", "backfill-before-commit")],
    );
    let status = a
        .wait_exit(Duration::from_secs(60))
        .expect("worker a reached its kill point");
    assert_eq!(status.signal(), Some(6), "{}", a.log_text());
    let (_, _, id, state, _) = backfills(fx.pool(), fx.space).await.remove(0);
    assert_eq!(state, "running", "died holding the lease");
    let heads: i64 = sqlx::query_scalar("SELECT count(*) FROM knowledge_space_profile_heads")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(heads, 0, "nothing of the aborted transaction is visible");

    let mut b = fx.spawn("fill-b", &["run", "--leased"], &[]);
    let done = fx
        .env
        .wait_until(Duration::from_secs(60), || async {
            backfill_row(fx.pool(), id).await.0 == "succeeded"
        })
        .await;
    assert!(
        done,
        "{:?}\n{}",
        backfill_row(fx.pool(), id).await,
        b.log_text()
    );
    assert_eq!(
        backfill_row(fx.pool(), id).await.1,
        2,
        "the takeover used a second attempt"
    );
    let (revisions, heads): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM knowledge_space_profile_revisions), (SELECT count(*) FROM knowledge_space_profile_heads)",
    )
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!((revisions, heads), (1, 1));
    support::stop_cleanly([&mut b], Duration::from_secs(30)).await;
    fx.cleanup().await;
}

/// A profile backfill holds its space's row while it reads the space's heads. It locks it
/// against the space's deletion and other writers of the row (`FOR NO KEY UPDATE`), not against
/// every insert that references the space: a compile request's insert, whose foreign key check
/// takes `KEY SHARE` on the space, goes on meanwhile. Under `FOR UPDATE` the platform's request
/// waited for the backfill while holding the profile heads the backfill was about to lock, and
/// Postgres broke the deadlock by failing the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_holding_its_space_lets_a_compile_request_for_it_insert_meanwhile() {
    let fx = Fx::new().await;
    let pool = fx.pool().clone();
    let doc = fx.add("guide.md", "text/markdown", GUIDE_MD).await;
    // Holds the backfill once it has locked the space: its next lock (on `deletion_jobs`, the
    // platform's deletion admission) waits for this table lock, which plain reads pass.
    let mut gate = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE deletion_jobs IN EXCLUSIVE MODE")
        .execute(&mut *gate)
        .await
        .unwrap();
    let space = fx.space;
    let backfill = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let mut conn = pool.acquire().await.unwrap();
            backfill::binding::bind_current_published(&mut conn, TENANT, space).await
        })
    };
    let waiting = fx
        .env
        .wait_until(Duration::from_secs(20), || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database() \
                   AND wait_event_type = 'Lock' AND query LIKE '%FROM deletion_jobs%')",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
        })
        .await;
    assert!(waiting, "the backfill never reached its deletion admission");
    let mut request = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '5s'")
        .execute(&mut *request)
        .await
        .unwrap();
    let requested = compile::request(&mut request, doc, compile::RequestOptions::default()).await;
    assert!(
        requested.is_ok(),
        "a compile request waited for the backfill's lock on its space: {requested:?}"
    );
    request.commit().await.unwrap();
    gate.rollback().await.unwrap();
    let reconciled = tokio::time::timeout(Duration::from_secs(30), backfill)
        .await
        .expect("the backfill hung")
        .unwrap();
    assert!(reconciled.is_ok(), "{reconciled:?}");
    fx.cleanup().await;
}
