//! The jobs leased straight from Postgres — legacy space publication bootstraps and profile
//! backfills — against the real Postgres (and RabbitMQ where compiles travel the outbox).
//!
//! Most tests drive slices in-process with `leased::run_once`, and run the compile attempts a
//! bootstrap requests with the compile engine's `process_ref` (the outbox row is put out for
//! delivery by SQL, as the relay's mark leaves it), so interleavings are exact. The process
//! tests run real `kfs-worker run` children, one of them SIGKILLed in the middle of a walk.
//!
//! Every test installs a trigger that logs each state the walk writes to the job tables, so the
//! tests can inspect every written state, not only the last one.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::space::SpaceFx;
use kfs_worker::consumer::lease::{DeliveryRef, End};
use kfs_worker::consumer::slice::Budget;
use kfs_worker::consumer::{ConsumerConfig, Engine};
use kfs_worker::jobs::backfill::{self, BackfillKind, BackfillRequest};
use kfs_worker::jobs::bootstrap::walk::{self, Checkpoint, Waits};
use kfs_worker::jobs::bootstrap::{self, BootstrapKind};
use kfs_worker::jobs::compile::{self, CompileHandler};
use kfs_worker::jobs::leased::{self, Lease, LeasedKind, Outcome};
use kfs_worker::jobs::{Deps, Kind};
use kfs_worker::platform;
use kfs_worker::publication;
use serde_json::json;
use sqlx::{Connection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const TENANT: &str = "tenant-leased";
const GUIDE_MD: &[u8] = include_bytes!("fixtures/compile/guide.md");
const PAGE_HTML: &[u8] = include_bytes!("fixtures/compile/page.html");
const NOTES_TXT: &[u8] = include_bytes!("fixtures/compile/notes.txt");

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

common::space::space_fixture!(Fx);

impl Fx {
    async fn new() -> Fx {
        let fx = SpaceFx::new(TENANT, "legacy", "Legacy space").await;
        sqlx::raw_sql(STATE_LOG).execute(fx.pool()).await.unwrap();
        Fx(fx)
    }

    async fn cleanup(self) {
        self.0.cleanup().await;
    }

    async fn three_documents(&self) -> Vec<Uuid> {
        vec![
            self.add("guide.md", "text/markdown", GUIDE_MD).await,
            self.add("page.html", "text/html", PAGE_HTML).await,
            self.add("notes.txt", "text/plain", NOTES_TXT).await,
        ]
    }

    async fn enqueue_bootstrap(&self) -> Uuid {
        let mut conn = self.pool().acquire().await.unwrap();
        bootstrap::enqueue(&mut conn, TENANT, self.space)
            .await
            .unwrap()
    }

    fn engine(&self) -> Engine {
        let handler = CompileHandler::new(Deps {
            store: self.store.clone(),
        })
        .unwrap();
        Engine::new(
            self.pool().clone(),
            "compile-in-test",
            vec![Arc::new(handler)],
            ConsumerConfig::default(),
        )
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
                // A slice that only waits (retry_wait) is fine: the next round dispatches again.
                sqlx::query(
                    "UPDATE document_compilation_attempts SET retry_at = now() WHERE id = $1 AND run_state = 'retry_wait'",
                )
                .bind(attempt)
                .execute(self.pool())
                .await
                .unwrap();
                let d = DeliveryRef {
                    kind: Kind::Compile,
                    job_id: attempt,
                    outbox_id: outbox,
                    delivery_id,
                };
                tokio::time::timeout(
                    Duration::from_secs(60),
                    engine.process_ref(&d, &CancellationToken::new()),
                )
                .await
                .expect("compile slice hung");
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

    /// Slices and compiles until the bootstrap ends (succeeded or failed).
    async fn drive_bootstrap(&self, kind: &BootstrapKind, engine: &Engine, id: Uuid) -> Row {
        for _ in 0..30 {
            self.due_now(id).await;
            leased::run_once(self.pool(), kind, "leased-in-test", Budget::default())
                .await
                .unwrap();
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
            "SELECT checkpoint::text AS checkpoint, run_state::text AS run_state, total_documents, completed_documents, \
               published_publication_id, published_fingerprint::text AS published_fingerprint, published_head_revision, \
               last_error_code::text AS last_error_code, snapshot_metadata, row_version, lease_token \
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

    /// Every logged state of one job, in order: (run_state, checkpoint, row_version, token).
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
            ("KFS_WORKER_ID".into(), id.into()),
            ("KFS_RELAY_POLL".into(), "200ms".into()),
            ("KFS_LEASED_POLL".into(), "100ms".into()),
            ("KFS_SHUTDOWN_GRACE".into(), "5s".into()),
        ]
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
    checkpoint: String,
    run_state: String,
    total_documents: i32,
    completed_documents: i32,
    published_publication_id: Option<Uuid>,
    published_fingerprint: Option<String>,
    published_head_revision: Option<i32>,
    last_error_code: Option<String>,
    snapshot_metadata: serde_json::Value,
    row_version: i32,
    lease_token: Option<Uuid>,
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

/// Checks every logged state of a bootstrap: checkpoints only move forward one phase at a time,
/// row versions never go back, a lease is held exactly while running, and `published` comes
/// only with success.
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
async fn bootstrap_walk_rebuilds_every_document_publishes_the_head_and_sets_the_latch() {
    let fx = Fx::new().await;
    let docs = fx.three_documents().await;
    let id = fx.enqueue_bootstrap().await;
    assert_eq!(id, fx.enqueue_bootstrap().await, "enqueue is idempotent");
    assert!(
        !fx.ready().await,
        "a queued bootstrap keeps strict reads closed"
    );

    let kind = BootstrapKind::default();
    let engine = fx.engine();
    let row = fx.drive_bootstrap(&kind, &engine, id).await;
    assert_eq!(row.run_state, "succeeded", "{row:?}");
    assert_eq!(row.checkpoint, "published");
    assert_eq!((row.total_documents, row.completed_documents), (3, 3));
    assert!(row.lease_token.is_none());
    assert!(fx.ready().await, "success is the readiness latch");

    // The frozen items: document, version, hash and ordinal, each rebuilt by one attempt.
    let items = fx.items(id).await;
    assert_eq!(items.len(), 3);
    for (i, it) in items.iter().enumerate() {
        assert_eq!(it.ordinal, i as i32);
        assert_eq!(it.document_asset_id, docs[i]);
        assert_eq!(it.document_version, 1);
        let sha: String = sqlx::query_scalar("SELECT sha256 FROM document_assets WHERE id = $1")
            .bind(it.document_asset_id)
            .fetch_one(fx.pool())
            .await
            .unwrap();
        assert_eq!(it.document_sha256, sha);
        assert_eq!(it.status, "succeeded", "{it:?}");
        let mut conn = fx.pool().acquire().await.unwrap();
        let attempt = compile::show(&mut conn, it.compilation_attempt_id.unwrap())
            .await
            .unwrap();
        assert_eq!(attempt.run_state, "succeeded");
        assert_eq!(attempt.document_asset_id, it.document_asset_id);
    }

    // The recorded head is the space's head and serves every document.
    let mut conn = fx.pool().acquire().await.unwrap();
    let head = publication::head(&mut conn, TENANT, fx.space, false)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.published_publication_id, Some(head.publication_id));
    assert_eq!(row.published_head_revision, Some(head.revision));
    assert_eq!(
        row.published_fingerprint.as_deref(),
        Some(publication::fingerprint(&head.members).as_str())
    );
    for d in &docs {
        assert!(head.members.contains_key(d), "head lacks {d}");
    }

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
async fn a_space_without_documents_bootstraps_without_a_publication() {
    let fx = Fx::new().await;
    let id = fx.enqueue_bootstrap().await;
    let engine = fx.engine();
    let row = fx
        .drive_bootstrap(&BootstrapKind::default(), &engine, id)
        .await;
    assert_eq!(row.run_state, "succeeded");
    assert_eq!(row.checkpoint, "published");
    assert_eq!((row.total_documents, row.completed_documents), (0, 0));
    assert_eq!(row.published_publication_id, None);
    assert!(fx.ready().await);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_bootstrap_retries_in_place_and_compiles_the_failed_document_again() {
    let fx = Fx::new().await;
    let docs = fx.three_documents().await;
    // The stored hash of one document does not match its bytes: its compile fails for good.
    sqlx::query("UPDATE document_assets SET sha256 = repeat('0', 64) WHERE id = $1")
        .bind(docs[1])
        .execute(fx.pool())
        .await
        .unwrap();
    let id = fx.enqueue_bootstrap().await;
    let kind = BootstrapKind::default();
    let engine = fx.engine();
    let row = fx.drive_bootstrap(&kind, &engine, id).await;
    assert_eq!(row.run_state, "failed", "{row:?}");
    assert_eq!(row.checkpoint, "rebuilding");
    assert_eq!(
        row.last_error_code.as_deref(),
        Some("document_compile_failed")
    );
    assert_eq!(row.snapshot_metadata["failures"], json!(1));
    assert!(
        row.snapshot_metadata["notBefore"].as_i64().is_some(),
        "a retry time is set: {row:?}"
    );
    assert!(!fx.ready().await);
    let items = fx.items(id).await;
    let failed: Vec<&Item> = items.iter().filter(|i| i.status == "failed").collect();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].document_asset_id, docs[1]);
    assert!(failed[0]
        .last_error
        .as_deref()
        .unwrap()
        .starts_with("failed"));
    let first_attempt = failed[0].compilation_attempt_id.unwrap();

    // Not before its backoff ran out.
    let early = leased::run_once(fx.pool(), &kind, "leased-in-test", Budget::default())
        .await
        .unwrap();
    assert!(early.is_none(), "claimed before its retry time");

    // Repair the document; once due, the same row is retried and the document compiled again.
    let sha = platform::sha256_hex(PAGE_HTML);
    sqlx::query("UPDATE document_assets SET sha256 = $2 WHERE id = $1")
        .bind(docs[1])
        .bind(sha)
        .execute(fx.pool())
        .await
        .unwrap();
    let row = fx.drive_bootstrap(&kind, &engine, id).await;
    assert_eq!(row.run_state, "succeeded", "{row:?}");
    assert_eq!(row.last_error_code, None);
    let items = fx.items(id).await;
    let again = items
        .iter()
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
    let docs = fx.three_documents().await;
    sqlx::query("UPDATE document_assets SET sha256 = repeat('0', 64) WHERE id = $1")
        .bind(docs[0])
        .execute(fx.pool())
        .await
        .unwrap();
    let id = fx.enqueue_bootstrap().await;
    let kind = BootstrapKind {
        policy: kfs_worker::jobs::Policy {
            max_attempts: 2,
            ..bootstrap::POLICY
        },
        ..BootstrapKind::default()
    };
    let engine = fx.engine();
    let row = fx.drive_bootstrap(&kind, &engine, id).await;
    assert_eq!(row.run_state, "failed");
    assert_eq!(row.snapshot_metadata["failures"], json!(1));
    let row = fx.drive_bootstrap(&kind, &engine, id).await;
    assert_eq!(row.run_state, "failed");
    assert_eq!(row.snapshot_metadata["failures"], json!(2));
    fx.due_now(id).await;
    let claimed = leased::run_once(fx.pool(), &kind, "leased-in-test", Budget::default())
        .await
        .unwrap();
    assert!(
        claimed.is_none(),
        "a bootstrap out of attempts is not run again"
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_mutation_lease_blocks_the_snapshot_and_an_expired_one_is_reclaimed() {
    let fx = Fx::new().await;
    let docs = fx.three_documents().await;
    let lease = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO knowledge_space_mutation_leases (id, tenant_id, knowledge_space_id, operation, acquired_at, \
           lease_token, heartbeat_at, expires_at) \
         VALUES ($1, $2, $3, 'document.upload', now(), $1, now(), now() + interval '1 hour')",
    )
    .bind(lease)
    .bind(TENANT)
    .bind(fx.space)
    .execute(fx.pool())
    .await
    .unwrap();
    let id = fx.enqueue_bootstrap().await;
    let kind = BootstrapKind {
        waits: Waits {
            poll: Duration::from_millis(100),
            max_lease_wait: Duration::from_secs(5),
        },
        ..BootstrapKind::default()
    };
    let (_, outcome) = leased::run_once(fx.pool(), &kind, "leased-in-test", Budget::default())
        .await
        .unwrap()
        .expect("claimed");
    assert_eq!(outcome, Outcome::Ended("wait"));
    let row = fx.bootstrap(id).await;
    assert_eq!(
        (row.run_state.as_str(), row.checkpoint.as_str()),
        ("queued", "pending_snapshot")
    );
    assert_eq!(row.total_documents, 0);
    assert!(
        fx.items(id).await.is_empty(),
        "nothing frozen under a live lease"
    );
    assert_eq!(row.snapshot_metadata.get("failures"), Some(&json!(0)));

    // Still waiting: not claimable before its wait ran out.
    assert!(
        leased::run_once(fx.pool(), &kind, "leased-in-test", Budget::default())
            .await
            .unwrap()
            .is_none()
    );

    // The lease expires: the next capture reclaims it and freezes the set.
    sqlx::query("UPDATE knowledge_space_mutation_leases SET expires_at = now() - interval '1 second' WHERE id = $1")
        .bind(lease)
        .execute(fx.pool())
        .await
        .unwrap();
    fx.due_now(id).await;
    let (_, outcome) = leased::run_once(fx.pool(), &kind, "leased-in-test", Budget::default())
        .await
        .unwrap()
        .expect("claimed");
    assert_eq!(
        outcome,
        Outcome::Ended("wait"),
        "waits for its compiles now"
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM knowledge_space_mutation_leases")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(left, 0, "the expired lease was reclaimed");
    let row = fx.bootstrap(id).await;
    assert_eq!(row.checkpoint, "rebuilding");
    assert_eq!(row.total_documents, 3);
    let items = fx.items(id).await;
    assert_eq!(
        items
            .iter()
            .map(|i| i.document_asset_id)
            .collect::<Vec<_>>(),
        docs
    );
    assert!(items.iter().all(|i| i.status == "running"));

    // A lease taken after the snapshot changes nothing frozen; a lease without an expiry
    // blocks another space's snapshot for good (fails closed).
    let mut conn = fx.pool().acquire().await.unwrap();
    let other = platform::create_space(&mut conn, TENANT, "other", "Other")
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO knowledge_space_mutation_leases (id, tenant_id, knowledge_space_id, operation, acquired_at, \
           lease_token, heartbeat_at, expires_at) \
         VALUES (gen_random_uuid(), $1, $2, 'document.upload', now(), gen_random_uuid(), now(), NULL)",
    )
    .bind(TENANT)
    .bind(other)
    .execute(fx.pool())
    .await
    .unwrap();
    let other_id = bootstrap::enqueue(&mut conn, TENANT, other).await.unwrap();
    drop(conn);
    for _ in 0..3 {
        sqlx::query(
            "UPDATE legacy_space_publication_bootstraps SET snapshot_metadata = snapshot_metadata - 'notBefore'",
        )
        .execute(fx.pool())
        .await
        .unwrap();
        leased::run_once(fx.pool(), &kind, "leased-in-test", Budget::default())
            .await
            .unwrap();
    }
    let row = fx.bootstrap(other_id).await;
    assert_eq!(row.checkpoint, "pending_snapshot");
    assert_eq!(row.run_state, "queued");
    fx.cleanup().await;
}

fn embedding_snapshot() -> serde_json::Value {
    json!({
        "pluginId": "openai-embeddings",
        "provider": "openai",
        "model": "text-embedding-3-small",
        "vectorSpaceId": "openai:text-embedding-3-small:1536",
        "dimension": 1536,
        "capabilities": {"batch": true, "maxInput": 8191}
    })
}

async fn add_manifest(pool: &PgPool, space: Uuid, version: i32) {
    sqlx::query(
        "INSERT INTO knowledge_space_manifests (id, tenant_id, knowledge_space_id, version, manifest, created_at, updated_at) \
         VALUES (gen_random_uuid(), $1, $2, $3, '{}'::jsonb, now(), now())",
    )
    .bind(TENANT)
    .bind(space)
    .bind(version)
    .execute(pool)
    .await
    .unwrap();
}

async fn enqueue_backfill(
    pool: &PgPool,
    space: Uuid,
    kind: &str,
    version: i32,
    snap: serde_json::Value,
) -> Uuid {
    let mut conn = pool.acquire().await.unwrap();
    backfill::enqueue(
        &mut conn,
        &BackfillRequest {
            tenant: TENANT.into(),
            space,
            kind: kind.into(),
            manifest_version: version,
            snapshot: snap,
        },
    )
    .await
    .unwrap()
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn backfill_installs_the_revision_and_the_initial_head() {
    let fx = Fx::new().await;
    add_manifest(fx.pool(), fx.space, 1).await;
    add_manifest(fx.pool(), fx.space, 2).await;
    let snap = embedding_snapshot();
    let id = enqueue_backfill(fx.pool(), fx.space, "embedding", 2, snap.clone()).await;
    assert_eq!(
        id,
        enqueue_backfill(fx.pool(), fx.space, "embedding", 2, snap.clone()).await,
        "idempotent on its source"
    );
    let kind = BackfillKind::default();
    let (lease, outcome) = leased::run_once(fx.pool(), &kind, "leased-in-test", Budget::default())
        .await
        .unwrap()
        .expect("claimed");
    assert_eq!(lease.job_id, id);
    assert_eq!(outcome, Outcome::Ended("succeeded"));
    let (state, attempts, _, err, token) = backfill_row(fx.pool(), id).await;
    assert_eq!(
        (state.as_str(), attempts, err, token),
        ("succeeded", 1, None, None)
    );

    type Rev = (
        Uuid,
        i32,
        String,
        String,
        String,
        Option<String>,
        Option<i32>,
        serde_json::Value,
        String,
    );
    let (rev_id, revision, state, digest, model, vs, dim, caps, cap_digest): Rev = sqlx::query_as(
        "SELECT id, revision, state::text, snapshot_digest::text, model::text, vector_space_id::text, dimension, \
           capability_snapshot, capability_snapshot_digest::text \
         FROM knowledge_space_profile_revisions WHERE tenant_id = $1 AND knowledge_space_id = $2 AND kind = 'embedding'",
    )
    .bind(TENANT)
    .bind(fx.space)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!((revision, state.as_str()), (1, "active"));
    assert_eq!(digest, backfill::walk::digest(&snap));
    assert_eq!(model, "text-embedding-3-small");
    assert_eq!(vs.as_deref(), Some("openai:text-embedding-3-small:1536"));
    assert_eq!(dim, Some(1536));
    assert_eq!(caps, json!({"batch": true, "maxInput": 8191}));
    assert_eq!(cap_digest, backfill::walk::digest(&caps));
    let (head_rev_id, active, row_version): (Uuid, i32, i32) = sqlx::query_as(
        "SELECT profile_revision_id, active_revision, row_version FROM knowledge_space_profile_heads \
         WHERE tenant_id = $1 AND knowledge_space_id = $2 AND kind = 'embedding'",
    )
    .bind(TENANT)
    .bind(fx.space)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!((head_rev_id, active, row_version), (rev_id, 1, 1));

    // Every state written: queued → running → succeeded, row version bumped each time.
    let states = fx.states(id).await;
    let runs: Vec<&str> = states.iter().map(|s| s.0.as_str()).collect();
    assert_eq!(
        runs,
        ["queued", "running", "running", "succeeded"],
        "{states:?}"
    );
    assert!(states.windows(2).all(|w| w[1].2 > w[0].2));
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn backfill_refuses_a_moved_manifest_a_bad_digest_and_an_existing_head() {
    let fx = Fx::new().await;
    let kind = BackfillKind::default();
    let retrieval = json!({"pluginId": "pg-fts", "provider": "postgres", "model": "ts_rank"});

    // (space, setup, expected code)
    let mut conn = fx.pool().acquire().await.unwrap();
    let moved = platform::create_space(&mut conn, TENANT, "moved", "m")
        .await
        .unwrap();
    let tampered = platform::create_space(&mut conn, TENANT, "tampered", "t")
        .await
        .unwrap();
    let headed = platform::create_space(&mut conn, TENANT, "headed", "h")
        .await
        .unwrap();
    let missing = platform::create_space(&mut conn, TENANT, "missing", "x")
        .await
        .unwrap();
    let invalid = platform::create_space(&mut conn, TENANT, "invalid", "i")
        .await
        .unwrap();
    drop(conn);
    for s in [moved, tampered, headed, invalid] {
        add_manifest(fx.pool(), s, 1).await;
    }
    // The manifest moved on after discovery.
    let moved_id = enqueue_backfill(fx.pool(), moved, "retrieval", 1, retrieval.clone()).await;
    add_manifest(fx.pool(), moved, 2).await;
    // The stored snapshot no longer matches its digest.
    let tampered_id =
        enqueue_backfill(fx.pool(), tampered, "retrieval", 1, retrieval.clone()).await;
    sqlx::query("UPDATE knowledge_space_profile_backfills SET source_snapshot = source_snapshot || '{\"model\":\"other\"}' WHERE id = $1")
        .bind(tampered_id)
        .execute(fx.pool())
        .await
        .unwrap();
    // A head exists already (installed by an earlier backfill of another snapshot).
    let first = enqueue_backfill(fx.pool(), headed, "retrieval", 1, retrieval.clone()).await;
    let second = enqueue_backfill(
        fx.pool(),
        headed,
        "retrieval",
        1,
        json!({"pluginId": "pg-fts", "provider": "postgres", "model": "bm25"}),
    )
    .await;
    let no_manifest = enqueue_backfill(fx.pool(), missing, "retrieval", 1, retrieval.clone()).await;
    let bad_shape = enqueue_backfill(fx.pool(), invalid, "embedding", 1, retrieval.clone()).await;

    for _ in 0..6 {
        leased::run_once(fx.pool(), &kind, "leased-in-test", Budget::default())
            .await
            .unwrap()
            .expect("claimed");
    }
    assert!(
        leased::run_once(fx.pool(), &kind, "leased-in-test", Budget::default())
            .await
            .unwrap()
            .is_none()
    );
    let (s, ..) = backfill_row(fx.pool(), first).await;
    assert_eq!(s, "succeeded");
    for (id, code) in [
        (moved_id, "manifest_moved"),
        (tampered_id, "snapshot_digest_mismatch"),
        (second, "profile_head_exists"),
        (no_manifest, "manifest_missing"),
        (bad_shape, "invalid_snapshot"),
    ] {
        let (state, _, _, err, token) = backfill_row(fx.pool(), id).await;
        assert_eq!(
            (state.as_str(), err.as_deref(), token),
            ("failed", Some(code), None)
        );
    }
    let revisions: i64 =
        sqlx::query_scalar("SELECT count(*) FROM knowledge_space_profile_revisions")
            .fetch_one(fx.pool())
            .await
            .unwrap();
    assert_eq!(revisions, 1, "refusals write no revision");
    let heads: i64 = sqlx::query_scalar("SELECT count(*) FROM knowledge_space_profile_heads")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(heads, 1);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stale_lease_tokens_and_row_versions_cannot_write() {
    let fx = Fx::new().await;
    fx.three_documents().await;
    add_manifest(fx.pool(), fx.space, 1).await;
    let boot = fx.enqueue_bootstrap().await;
    let fill = enqueue_backfill(
        fx.pool(),
        fx.space,
        "retrieval",
        1,
        json!({"pluginId": "p", "provider": "pg", "model": "m"}),
    )
    .await;
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
                leased::fence(&mut tx, table, stale).await.unwrap(),
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
        assert_eq!(leased::fence(&mut tx, table, &job).await.unwrap(), None);
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
        assert!(leased::fence(&mut tx, table, &taken)
            .await
            .unwrap()
            .is_some());
        tx.rollback().await.unwrap();
        assert!(kind.end(&mut conn, &taken, &End::Continue).await.unwrap());
    }
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn check_constraints_refuse_invalid_states_of_both_tables() {
    let fx = Fx::new().await;
    add_manifest(fx.pool(), fx.space, 1).await;
    let boot = fx.enqueue_bootstrap().await;
    let fill = enqueue_backfill(
        fx.pool(),
        fx.space,
        "retrieval",
        1,
        json!({"pluginId": "p", "provider": "pg", "model": "m"}),
    )
    .await;
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
        End::Cancel {
            code: "c".into(),
            message: "m".into(),
        },
    ];
    let kinds: [(&dyn LeasedKind, Uuid); 2] = [
        (&BootstrapKind::default(), boot),
        (&BackfillKind::default(), fill),
    ];
    for (kind, id) in kinds {
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
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn worker_process_runs_both_leased_kinds_and_status_shows_them() {
    let fx = Fx::new().await;
    fx.three_documents().await;
    add_manifest(fx.pool(), fx.space, 1).await;
    let boot = fx.enqueue_bootstrap().await;
    let fill = enqueue_backfill(fx.pool(), fx.space, "embedding", 1, embedding_snapshot()).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut env: Vec<(String, String)> = fx.worker_env("leased-proc");
    env.push(("KFS_HTTP_ADDR".into(), format!("127.0.0.1:{port}")));
    let e: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut w = fx.env.spawn_worker("leased-proc", &["run"], &e);
    let done = fx
        .env
        .wait_until(Duration::from_secs(120), || async {
            fx.bootstrap(boot).await.run_state == "succeeded"
                && backfill_row(fx.pool(), fill).await.0 == "succeeded"
        })
        .await;
    assert!(
        done,
        "not done: {:?} {:?}\n{}",
        fx.bootstrap(boot).await,
        backfill_row(fx.pool(), fill).await,
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
    assert_eq!(by_kind("backfill").jobs.get("succeeded"), Some(&1));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"))
        .args(["status", "--json", "--kinds", "compile"])
        .env("DATABASE_URL", &fx.env.url)
        .env("AMQP_URL", common::amqp_url())
        .env("KFS_QUEUE_PREFIX", &fx.env.prefix)
        .output()
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["leased"][0]["kind"], "bootstrap");
    assert_eq!(json["leased"][0]["jobs"]["succeeded"], 1);
    assert_eq!(json["leased"][1]["jobs"]["succeeded"], 1);
    let metrics = http_get(port, "/metrics");
    for want in [
        r#"kfs_jobs{kind="bootstrap",state="succeeded"} 1"#,
        r#"kfs_jobs{kind="backfill",state="succeeded"} 1"#,
        r#"kfs_leased_checkpoints{kind="bootstrap",checkpoint="published"} 1"#,
        r#"kfs_slices_total{kind="backfill",end="succeeded"} 1"#,
    ] {
        assert!(metrics.contains(want), "{want} missing from\n{metrics}");
    }
    common::stop_cleanly([&mut w], Duration::from_secs(30)).await;
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_mid_walk_is_replaced_and_the_walk_finishes() {
    let fx = Fx::new().await;
    fx.three_documents().await;
    let boot = fx.enqueue_bootstrap().await;
    // The first worker runs only the leased jobs: it freezes the set and requests the compiles,
    // then waits for compiles nobody runs — and is SIGKILLed in the middle of the walk.
    let env = fx.worker_env("leased-a");
    let e: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut a = fx.env.spawn_worker("leased-a", &["run", "--leased"], &e);
    let rebuilding = fx
        .env
        .wait_until(Duration::from_secs(60), || async {
            fx.bootstrap(boot).await.checkpoint == "rebuilding"
        })
        .await;
    assert!(rebuilding, "{}", a.log_text());
    a.kill();
    let row = fx.bootstrap(boot).await;
    assert_ne!(row.run_state, "succeeded");

    let env = fx.worker_env("leased-b");
    let e: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut b = fx.env.spawn_worker("leased-b", &["run"], &e);
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
    common::stop_cleanly([&mut b], Duration::from_secs(30)).await;
    fx.cleanup().await;
}

/// A worker aborted right after committing a step (a held lease, mid-walk) is taken over at
/// once through its lost liveness lock, and another worker finishes the walk.
#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_dying_after_a_step_commit_is_taken_over_and_the_walk_finishes() {
    use std::os::unix::process::ExitStatusExt;
    let fx = Fx::new().await;
    fx.three_documents().await;
    let boot = fx.enqueue_bootstrap().await;
    let mut env = fx.worker_env("crash-a");
    env.push(("KFS_CRASH_AT".into(), "leased-after-step-commit:2".into()));
    let e: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut a = fx.env.spawn_worker("crash-a", &["run"], &e);
    let status = a
        .wait_exit(Duration::from_secs(60))
        .expect("worker a reached its kill point");
    assert_eq!(status.signal(), Some(6), "{}", a.log_text());
    let row = fx.bootstrap(boot).await;
    assert_eq!(row.run_state, "running", "died holding the lease: {row:?}");
    assert_eq!(row.checkpoint, "rebuilding");

    let env = fx.worker_env("crash-b");
    let e: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut b = fx.env.spawn_worker("crash-b", &["run"], &e);
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
        "the takeover counts as a failed run"
    );
    let states = fx.states(boot).await;
    assert_bootstrap_states(&states);
    let tokens: std::collections::BTreeSet<Uuid> = states.iter().filter_map(|s| s.3).collect();
    assert!(tokens.len() >= 2, "a second lease finished the walk");
    common::stop_cleanly([&mut b], Duration::from_secs(30)).await;
    fx.cleanup().await;
}
