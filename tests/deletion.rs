//! deletion.job end to end against real Postgres, RabbitMQ and a local object directory: every
//! target and mode, idempotent and refused requests, lease drains, item retries and dead items,
//! redaction, residue, manual retries under both authorities, tenant and space fences, crashed
//! workers, and a 10,000-document space in bounded pages.
//!
//! Jobs are driven in-process: a real relay round publishes the due outbox rows, the test takes
//! the messages off the queue and hands them to an `Engine`, as a consumer would. Waiting time is
//! skipped with SQL (retry_at and item next_attempt_at moved to now), never slept through.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::TestEnv;
use futures_util::StreamExt;
use kfs_worker::consumer::slice::Budget;
use kfs_worker::consumer::{ConsumerConfig, Engine};
use kfs_worker::jobs::deletion::{
    request_deletion, retry_deletion, DeletionConfig, DeletionHandler, DeletionRequest,
    ObjectEraser, PortError, RequestError, RetrievalCache, RetryAuthority, RetryRequest,
    SecretStore, SourceMode, Target,
};
use kfs_worker::jobs::{Deps, Handler, JobCtx, JobError, Kind, Step};
use kfs_worker::publication::{self, Member, Members};
use kfs_worker::relay::{Relay, RelayConfig};
use kfs_worker::store::Store;
use kfs_worker::{config, platform};
use lapin::options::BasicGetOptions;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

// ---------------------------------------------------------------------------------------------
// Fixtures

struct Objects {
    store: Store,
    dir: PathBuf,
}

impl Objects {
    fn new() -> Objects {
        let dir = std::env::temp_dir().join(format!("kfs-deletion-{}", Uuid::new_v4().simple()));
        let url = config::object_store(&format!("file://{}", dir.display())).unwrap();
        Objects {
            store: Store::open(&url).unwrap(),
            dir,
        }
    }

    fn url(&self) -> String {
        format!("file://{}", self.dir.display())
    }

    /// Files under `spaces/<space>/`.
    fn count(&self, space: Uuid) -> usize {
        fn walk(p: &Path) -> usize {
            let Ok(rd) = std::fs::read_dir(p) else {
                return 0;
            };
            rd.flatten()
                .map(|e| {
                    let p = e.path();
                    if p.is_dir() {
                        walk(&p)
                    } else {
                        1
                    }
                })
                .sum()
        }
        walk(&self.dir.join("spaces").join(space.to_string()))
    }
}

impl Drop for Objects {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One seeded space.
#[derive(Clone, Debug)]
struct Space {
    tenant: String,
    id: Uuid,
    name: String,
    owner_snapshot: Uuid,
    docs: Vec<Uuid>,
    sources: Vec<Uuid>,
}

async fn conn(pool: &PgPool) -> sqlx::pool::PoolConnection<sqlx::Postgres> {
    pool.acquire().await.unwrap()
}

/// A snapshot for `subject` with `scopes` (JSON array text).
async fn snapshot(
    pool: &PgPool,
    tenant: &str,
    space: Uuid,
    subject: &str,
    channel: &str,
    scopes: &str,
) -> Uuid {
    let id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO knowledge_space_permission_snapshots (id, tenant_id, knowledge_space_id, subject_id, access_channel, \
           revision, status, expires_at, revoked_at, scopes, created_at) \
         VALUES ($1, $2, $3, $4, $5, 1, 'active', NULL, NULL, $6::jsonb, now())",
    )
    .bind(id)
    .bind(tenant)
    .bind(space)
    .bind(subject)
    .bind(channel)
    .bind(scopes)
    .execute(pool)
    .await
    .unwrap();
    id
}

/// A space with `sources` sources (each with a credential) and `docs` documents spread over
/// them (plus one loose document when `loose`), every document with derived rows, and the
/// space-level rows a deletion must erase. `filename` is shared across spaces on purpose.
async fn seed(
    pool: &PgPool,
    objects: &Objects,
    tenant: &str,
    slug: &str,
    sources: usize,
    docs: usize,
) -> Space {
    let mut c = conn(pool).await;
    let name = format!("Space {slug}");
    let id = platform::create_space(&mut c, tenant, slug, &name)
        .await
        .unwrap();
    let owner_snapshot = snapshot(
        pool,
        tenant,
        id,
        "alice",
        "interactive",
        r#"["read","write","delete","owner"]"#,
    )
    .await;
    let mut source_ids = Vec::new();
    for i in 0..sources {
        let s = platform::create_source(
            &mut c,
            id,
            &format!("src-{i}"),
            "web",
            Some(&format!("vault://{tenant}/{slug}/{i}")),
        )
        .await
        .unwrap();
        source_ids.push(s);
    }
    let mut doc_ids = Vec::new();
    for i in 0..docs {
        let source = if source_ids.is_empty() {
            None
        } else {
            Some(source_ids[i % source_ids.len()])
        };
        let d = platform::add_document(
            &mut c,
            &objects.store,
            id,
            source,
            &format!("shared-{i}.md"),
            "text/markdown",
            Bytes::from(format!("# doc {i} of {slug}")),
        )
        .await
        .unwrap();
        doc_ids.push(d);
        derived_rows(pool, tenant, id, d).await;
    }
    space_rows(pool, tenant, id, owner_snapshot).await;
    // A published head serving every document.
    let mut members = Members::new();
    for d in &doc_ids {
        members.insert(
            *d,
            Member {
                generation: gen(*d),
                version: 1,
            },
        );
    }
    let (p, _) = publication::create(&mut c, tenant, id, &members, serde_json::json!({}))
        .await
        .unwrap();
    publication::swap_head(&mut c, tenant, id, 0, p)
        .await
        .unwrap()
        .unwrap();
    Space {
        tenant: tenant.into(),
        id,
        name,
        owner_snapshot,
        docs: doc_ids,
        sources: source_ids,
    }
}

/// The generation id of a document's derived rows (the same value in every space: a collision).
fn gen(_doc: Uuid) -> Uuid {
    Uuid::from_u128(0x6e6e)
}

async fn derived_rows(pool: &PgPool, tenant: &str, space: Uuid, doc: Uuid) {
    let g = gen(doc);
    let sql = format!(
        r#"
        INSERT INTO knowledge_nodes (id, tenant_id, knowledge_space_id, document_asset_id, document_version,
          publication_generation_id, ordinal, heading_path, content, content_sha256, token_count, metadata, created_at)
        VALUES ('{n}', '{tenant}', '{space}', '{doc}', 1, '{g}', 0, '[]', 'same content everywhere', 'x', 3, '{{}}', now());
        INSERT INTO index_projections (id, tenant_id, knowledge_space_id, document_asset_id, publication_generation_id,
          node_id, search_vector, created_at)
        VALUES (gen_random_uuid(), '{tenant}', '{space}', '{doc}', '{g}', '{n}', to_tsvector('simple', 'same'), now());
        INSERT INTO document_outlines (id, tenant_id, knowledge_space_id, document_asset_id, document_version,
          publication_generation_id, outline, created_at)
        VALUES (gen_random_uuid(), '{tenant}', '{space}', '{doc}', 1, '{g}', '{{}}', now());
        INSERT INTO document_multimodal_manifests (id, tenant_id, knowledge_space_id, document_asset_id, document_version,
          publication_generation_id, manifest, created_at)
        VALUES (gen_random_uuid(), '{tenant}', '{space}', '{doc}', 1, '{g}', '{{}}', now());
        INSERT INTO page_index_manifests (id, tenant_id, knowledge_space_id, document_asset_id, document_version,
          publication_generation_id, manifest, created_at)
        VALUES (gen_random_uuid(), '{tenant}', '{space}', '{doc}', 1, '{g}', '{{}}', now());
        INSERT INTO knowledge_paths (id, tenant_id, knowledge_space_id, document_asset_id, publication_generation_id,
          path, metadata, created_at)
        VALUES (gen_random_uuid(), '{tenant}', '{space}', '{doc}', '{g}', '/shared.md', '{{}}', now());
        "#,
        n = Uuid::now_v7(),
    );
    sqlx::raw_sql(&sql).execute(pool).await.unwrap();
}

async fn space_rows(pool: &PgPool, tenant: &str, space: Uuid, snap: Uuid) {
    let (e1, e2, job, bundle) = (
        Uuid::now_v7(),
        Uuid::now_v7(),
        Uuid::now_v7(),
        Uuid::now_v7(),
    );
    let sql = format!(
        r#"
        INSERT INTO graph_entities (id, tenant_id, knowledge_space_id, publication_generation_id, name, entity_type, properties, created_at)
        VALUES ('{e1}', '{tenant}', '{space}', NULL, 'Same Name', 'thing', '{{}}', now()),
               ('{e2}', '{tenant}', '{space}', NULL, 'Other', 'thing', '{{}}', now());
        INSERT INTO graph_relations (id, tenant_id, knowledge_space_id, publication_generation_id, source_entity_id,
          target_entity_id, relation_type, properties, created_at)
        VALUES (gen_random_uuid(), '{tenant}', '{space}', NULL, '{e1}', '{e2}', 'rel', '{{}}', now());
        INSERT INTO evidence_bundles (id, trace_id, payload, created_at, tenant_id, knowledge_space_id)
        VALUES ('{bundle}', NULL, '{{}}', now(), '{tenant}', '{space}');
        INSERT INTO answer_traces (id, knowledge_space_id, evidence_bundle_id, query, answer, metadata, created_at,
          subject_id, permission_snapshot_id, permission_snapshot_revision, access_channel)
        VALUES (gen_random_uuid(), '{space}', '{bundle}', 'q', 'a', '{{}}', now(), 'alice', '{snap}', 1, 'interactive');
        INSERT INTO research_task_jobs (id, tenant_id, knowledge_space_id, subject_id, permission_snapshot_id,
          permission_snapshot_revision, access_channel, query, limits, metadata, cost, stage, row_version,
          execution_attempts, max_execution_attempts, created_at, updated_at, completed_at)
        VALUES ('{job}', '{tenant}', '{space}', 'alice', '{snap}', 1, 'interactive', 'q', '{{}}', '{{}}', '{{}}',
          'completed', 1, 0, 5, 1, 1, 1);
        INSERT INTO research_task_partial_results (id, tenant_id, knowledge_space_id, research_task_job_id, sequence,
          idempotency_key, evidence_bundle, created_at)
        VALUES (gen_random_uuid(), '{tenant}', '{space}', '{job}', 1, 'k1', '{{}}', 1);
        INSERT INTO research_task_progress_events (id, tenant_id, knowledge_space_id, research_task_job_id, sequence,
          idempotency_key, event_type, stage, payload, created_at)
        VALUES (gen_random_uuid(), '{tenant}', '{space}', '{job}', 1, 'k1', 'research_task.started', 'queued', '{{}}', 1);
        INSERT INTO agent_workspace_snapshots (id, tenant_id, knowledge_space_id, subject_id, access_channel,
          permission_snapshot_id, permission_snapshot_revision, permission_scopes, fingerprint, payload, created_at)
        VALUES (gen_random_uuid(), '{tenant}', '{space}', 'alice', 'interactive', '{snap}', 1, '[]', 'same-fp', '{{}}', now());
        INSERT INTO knowledge_space_manifests (id, tenant_id, knowledge_space_id, version, manifest, created_at, updated_at)
        VALUES (gen_random_uuid(), '{tenant}', '{space}', 1, '{{}}', now(), now());
        "#
    );
    sqlx::raw_sql(&sql).execute(pool).await.unwrap();
}

/// Row counts per table for one space (tenant-scoped where the table has a tenant).
async fn footprint(pool: &PgPool, tenant: &str, space: Uuid) -> BTreeMap<&'static str, i64> {
    let tenanted = [
        "knowledge_nodes",
        "index_projections",
        "document_outlines",
        "document_multimodal_manifests",
        "page_index_manifests",
        "knowledge_paths",
        "graph_entities",
        "graph_relations",
        "evidence_bundles",
        "research_task_jobs",
        "research_task_partial_results",
        "research_task_progress_events",
        "agent_workspace_snapshots",
        "projection_set_publications",
        "projection_set_publication_heads",
        "knowledge_space_permission_snapshots",
        "knowledge_space_manifests",
        "retrieval_execution_leases",
        "knowledge_space_mutation_leases",
    ];
    let mut out = BTreeMap::new();
    for t in tenanted {
        let n: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {t} WHERE tenant_id = $1 AND knowledge_space_id = $2"
        ))
        .bind(tenant)
        .bind(space)
        .fetch_one(pool)
        .await
        .unwrap();
        out.insert(t, n);
    }
    for t in ["sources", "document_assets", "answer_traces"] {
        let n: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {t} WHERE knowledge_space_id = $1"
        ))
        .bind(space)
        .fetch_one(pool)
        .await
        .unwrap();
        out.insert(t, n);
    }
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM knowledge_spaces WHERE tenant_id = $1 AND id = $2",
    )
    .bind(tenant)
    .bind(space)
    .fetch_one(pool)
    .await
    .unwrap();
    out.insert("knowledge_spaces", n);
    out
}

fn assert_empty(fp: &BTreeMap<&'static str, i64>) {
    let left: Vec<_> = fp.iter().filter(|(_, n)| **n > 0).collect();
    assert!(left.is_empty(), "rows left behind: {left:?}");
}

fn space_request(s: &Space, key: &str) -> DeletionRequest {
    DeletionRequest {
        tenant_id: s.tenant.clone(),
        knowledge_space_id: s.id,
        target: Target::Space {
            confirm_name: s.name.clone(),
        },
        expected_revision: None,
        requested_by_subject_id: "alice".into(),
        permission_snapshot_id: s.owner_snapshot,
        access_channel: "interactive".into(),
        idempotency_key: key.into(),
    }
}

fn target_request(s: &Space, target: Target, key: &str) -> DeletionRequest {
    DeletionRequest {
        target,
        ..space_request(s, key)
    }
}

async fn request(pool: &PgPool, req: &DeletionRequest) -> Result<Uuid, RequestError> {
    let mut tx = pool.begin().await.unwrap();
    let r = request_deletion(&mut tx, req).await;
    tx.commit().await.unwrap();
    r.map(|r| r.job_id)
}

// ---------------------------------------------------------------------------------------------
// Ports that record or fail

#[derive(Default)]
struct Recording {
    seen: Mutex<Vec<String>>,
    failures_left: AtomicU64,
}

#[async_trait::async_trait]
impl SecretStore for Recording {
    async fn delete_secret(&self, credential_ref: &str) -> Result<(), PortError> {
        if self
            .failures_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(PortError::retryable("secret_store", "vault unavailable"));
        }
        self.seen.lock().unwrap().push(credential_ref.to_owned());
        Ok(())
    }
}

#[async_trait::async_trait]
impl RetrievalCache for Recording {
    async fn evict(&self, key: &str) -> Result<(), PortError> {
        self.seen.lock().unwrap().push(key.to_owned());
        Ok(())
    }
}

/// An object store that fails while `broken` is set.
struct Flaky {
    inner: Store,
    broken: AtomicBool,
    calls: AtomicU64,
}

#[async_trait::async_trait]
impl ObjectEraser for Flaky {
    async fn delete_object(&self, key: &str) -> Result<(), PortError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.broken.load(Ordering::SeqCst) {
            return Err(PortError::retryable("object_store", "503 slow down"));
        }
        self.inner.delete_object(key).await
    }
}

/// Counts steps per checkpoint, then delegates.
struct Counting {
    inner: DeletionHandler,
    steps: Mutex<BTreeMap<String, u64>>,
    time: Mutex<BTreeMap<String, Duration>>,
}

#[async_trait::async_trait]
impl Handler for Counting {
    fn kind(&self) -> Kind {
        Kind::Deletion
    }

    async fn step(&self, tx: &mut PgConnection, job: &JobCtx) -> Result<Step, JobError> {
        *self
            .steps
            .lock()
            .unwrap()
            .entry(job.checkpoint.clone())
            .or_default() += 1;
        let started = Instant::now();
        let out = self.inner.step(tx, job).await;
        *self
            .time
            .lock()
            .unwrap()
            .entry(job.checkpoint.clone())
            .or_default() += started.elapsed();
        out
    }
}

fn fast_config() -> DeletionConfig {
    DeletionConfig {
        item_retry_base: Duration::from_millis(10),
        item_retry_max: Duration::from_millis(50),
        max_wait: Duration::from_millis(200),
        ..DeletionConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Driving jobs in-process

struct Driver {
    engine: Engine,
    relay: Relay,
    publish: lapin::Channel,
    take: lapin::Channel,
    queue: String,
    pool: PgPool,
}

impl Driver {
    async fn new(env: &TestEnv, handler: Arc<dyn Handler>, budget: Budget) -> Driver {
        let cfg = ConsumerConfig {
            budget,
            ..ConsumerConfig::default()
        };
        Driver {
            engine: Engine::new(env.pool.clone(), "deletion-test", vec![handler], cfg),
            relay: Relay::new(
                env.pool.clone(),
                env.topology.clone(),
                "deletion-relay",
                RelayConfig::default(),
                &[Kind::Deletion],
            ),
            publish: env.confirm_channel().await,
            take: env.channel().await,
            queue: env.topology.queue(Kind::Deletion),
            pool: env.pool.clone(),
        }
    }

    /// One relay round, then every message on the queue through the engine.
    async fn turn(&self) -> usize {
        self.relay
            .relay_once(&self.publish, Kind::Deletion)
            .await
            .expect("relay round");
        let mut n = 0;
        while let Some(m) = self
            .take
            .basic_get(self.queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let d = m.delivery;
            tokio::time::timeout(
                Duration::from_secs(120),
                self.engine.process(
                    Kind::Deletion,
                    &d.properties,
                    &d.data,
                    &CancellationToken::new(),
                ),
            )
            .await
            .expect("process hung");
            n += 1;
        }
        n
    }

    /// Drives `job` until it succeeds or fails, skipping planned waits when `skip_waits`.
    async fn finish(&self, job: Uuid, skip_waits: bool) -> (String, String) {
        for _ in 0..5000 {
            let (state, cp) = job_state(&self.pool, job).await;
            if matches!(state.as_str(), "succeeded" | "failed" | "canceled") {
                return (state, cp);
            }
            if skip_waits && state == "retry_wait" {
                skip_wait(&self.pool, job).await;
            }
            if self.turn().await == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        panic!(
            "job {job} did not finish: {:?}",
            job_state(&self.pool, job).await
        );
    }
}

async fn job_state(pool: &PgPool, job: Uuid) -> (String, String) {
    sqlx::query_as("SELECT run_state, checkpoint FROM deletion_jobs WHERE id = $1")
        .bind(job)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn skip_wait(pool: &PgPool, job: Uuid) {
    sqlx::query(
        "UPDATE deletion_jobs SET retry_at = now() WHERE id = $1 AND run_state = 'retry_wait'",
    )
    .bind(job)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("UPDATE deletion_outbox SET available_at = now() WHERE deletion_job_id = $1 AND status = 'pending'")
        .bind(job)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("UPDATE deletion_job_items SET next_attempt_at = now() WHERE deletion_job_id = $1 AND status = 'retry_wait'")
        .bind(job)
        .execute(pool)
        .await
        .unwrap();
}

fn handler(objects: &Objects) -> DeletionHandler {
    DeletionHandler::new(Deps {
        store: objects.store.clone(),
    })
    .unwrap()
    .with_config(fast_config())
}

/// After success: job, outbox, tombstone final; every item completed with its key redacted.
async fn assert_finished_clean(pool: &PgPool, job: Uuid) {
    let (state, cp, slot): (String, String, Option<i32>) = sqlx::query_as(
        "SELECT run_state, checkpoint, active_slot FROM deletion_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        (state.as_str(), cp.as_str(), slot),
        ("succeeded", "completed", None)
    );
    let tomb: (String, bool) = sqlx::query_as(
        "SELECT state, completed_at IS NOT NULL FROM deletion_tombstones WHERE deletion_job_id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(tomb, ("completed".into(), true));
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM deletion_outbox WHERE deletion_job_id = $1 AND status NOT IN ('completed', 'dead')",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(open, 0, "outbox rows still open");
    let unredacted: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM deletion_job_items WHERE deletion_job_id = $1 AND (status <> 'completed' \
           OR object_key IS NOT NULL OR credential_ref IS NOT NULL OR cache_key IS NOT NULL \
           OR (kind IN ('object', 'secret_ref', 'cache_key') AND redacted_at IS NULL))",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(unredacted, 0, "items not completed or not redacted");
}

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_space_deletion_erases_everything_of_the_space_and_nothing_of_any_other() {
    let env = TestEnv::new().await;
    let objects = Objects::new();
    let a = seed(&env.pool, &objects, "tenant-t", "docs", 2, 6).await;
    // Same tenant, another space; another tenant with the same slug, name, filenames, node
    // contents, generation ids, entity names and workspace fingerprints.
    let b = seed(&env.pool, &objects, "tenant-t", "other", 1, 3).await;
    let c = seed(&env.pool, &objects, "tenant-u", "docs", 2, 6).await;
    // A knowledge node in space B that points at a document of space B but carries A's text.
    // A live retrieval lease in space C must not hold up A's deletion.
    sqlx::query(
        "INSERT INTO retrieval_execution_leases (id, tenant_id, knowledge_space_id, subject_id, trace_id, lease_token, \
           status, row_version, acquired_at, heartbeat_at, expires_at, updated_at) \
         VALUES (gen_random_uuid(), $1, $2, 'bob', gen_random_uuid(), 'tok', 'active', 0, now(), now(), \
           now() + interval '1 hour', now())",
    )
    .bind(&c.tenant)
    .bind(c.id)
    .execute(&env.pool)
    .await
    .unwrap();
    let before_b = footprint(&env.pool, &b.tenant, b.id).await;
    let before_c = footprint(&env.pool, &c.tenant, c.id).await;
    let (objs_b, objs_c) = (objects.count(b.id), objects.count(c.id));
    assert_eq!(objects.count(a.id), 6);

    let recorder = Arc::new(Recording::default());
    let h = DeletionHandler::with_ports(
        Deps {
            store: objects.store.clone(),
        },
        recorder.clone(),
        recorder.clone(),
    )
    .with_config(fast_config());
    let driver = Driver::new(&env, Arc::new(h), Budget::default()).await;
    let job = request(&env.pool, &space_request(&a, "del-a"))
        .await
        .unwrap();

    // The request wrote the job, the tombstone, the fence and the first outbox revision.
    let row: (String, String, i32, bool, i32, i32, String, Option<String>) = sqlx::query_as(
        "SELECT run_state, checkpoint, row_version, inventory_complete, active_slot, max_execution_attempts, \
           request_fingerprint, name_challenge_digest FROM deletion_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        (row.0.as_str(), row.1.as_str(), row.2, row.3, row.4, row.5),
        ("dispatch_pending", "requested", 1, false, 1, 10)
    );
    assert_eq!(row.6, space_request(&a, "del-a").fingerprint());
    assert_eq!(
        row.7.as_deref(),
        Some(platform::sha256_hex(a.name.as_bytes()).as_str())
    );
    let fence: (String, Option<Uuid>) = sqlx::query_as(
        "SELECT lifecycle_state, deletion_job_id FROM knowledge_spaces WHERE id = $1",
    )
    .bind(a.id)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(fence, ("deleting".into(), Some(job)));
    let outbox: (String, i32, String, serde_json::Value, String) = sqlx::query_as(
        "SELECT idempotency_key, delivery_revision, status, payload, request_idempotency_key FROM deletion_outbox \
         WHERE deletion_job_id = $1",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(outbox.0, format!("deletion:{job}:1"));
    assert_eq!(
        (outbox.1, outbox.2.as_str(), outbox.4.as_str()),
        (1, "pending", "del-a")
    );
    assert_eq!(
        outbox.3,
        serde_json::json!({ "deletionJobId": job.to_string() })
    );

    let (state, _) = driver.finish(job, true).await;
    assert_eq!(state, "succeeded");
    assert_finished_clean(&env.pool, job).await;
    assert_empty(&footprint(&env.pool, &a.tenant, a.id).await);
    assert_eq!(objects.count(a.id), 0, "objects of the space left behind");
    // Nothing of the other spaces moved.
    assert_eq!(footprint(&env.pool, &b.tenant, b.id).await, before_b);
    assert_eq!(footprint(&env.pool, &c.tenant, c.id).await, before_c);
    assert_eq!((objects.count(b.id), objects.count(c.id)), (objs_b, objs_c));
    // Secrets and cache keys went through their ports; the items kept only digests.
    let seen = recorder.seen.lock().unwrap().clone();
    assert!(
        seen.contains(&"vault://tenant-t/docs/0".to_string()),
        "{seen:?}"
    );
    assert!(
        seen.contains(&"vault://tenant-t/docs/1".to_string()),
        "{seen:?}"
    );
    assert!(
        !seen
            .iter()
            .any(|s| s.contains("tenant-u") || s.contains("/other/")),
        "{seen:?}"
    );
    assert!(seen.contains(&format!("kfs:retrieval:tenant-t:{}", a.id)));
    assert!(seen.contains(&format!("kfs:retrieval:tenant-t:{}:{}", a.id, a.docs[0])));
    let kinds: Vec<(String, i64)> = sqlx::query_as(
        "SELECT kind, count(*) FROM deletion_job_items WHERE deletion_job_id = $1 GROUP BY 1 ORDER BY 1",
    )
    .bind(job)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        kinds,
        vec![
            ("cache_key".into(), 7),
            ("object".into(), 6),
            ("secret_ref".into(), 2)
        ]
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn source_deletion_keeps_or_cascades_its_documents() {
    let env = TestEnv::new().await;
    let objects = Objects::new();
    let s = seed(&env.pool, &objects, "tenant-t", "docs", 2, 6).await;
    let (keep_src, cascade_src) = (s.sources[0], s.sources[1]);
    let docs_of = |src: Uuid| -> Vec<Uuid> {
        s.docs
            .iter()
            .enumerate()
            .filter(|(i, _)| s.sources[i % 2] == src)
            .map(|(_, d)| *d)
            .collect()
    };
    let (kept, cascaded) = (docs_of(keep_src), docs_of(cascade_src));
    let secrets = Arc::new(Recording {
        failures_left: AtomicU64::new(1),
        ..Recording::default()
    });
    let h = DeletionHandler::with_ports(
        Deps {
            store: objects.store.clone(),
        },
        secrets.clone(),
        Arc::new(kfs_worker::jobs::deletion::NoCache),
    )
    .with_config(fast_config());
    let driver = Driver::new(&env, Arc::new(h), Budget::default()).await;

    // keep: the source goes, its documents stay (detached), with their objects and derived rows.
    let job = request(
        &env.pool,
        &target_request(
            &s,
            Target::Source {
                id: keep_src,
                mode: SourceMode::Keep,
            },
            "keep",
        ),
    )
    .await
    .unwrap();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(&env.pool, job).await;
    let left: Vec<(Uuid, Option<Uuid>, String)> = sqlx::query_as(
        "SELECT id, source_id, lifecycle_state FROM document_assets WHERE id = ANY($1) ORDER BY id",
    )
    .bind(&kept)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(left.len(), kept.len());
    assert!(
        left.iter()
            .all(|(_, src, st)| src.is_none() && st == "active"),
        "{left:?}"
    );
    let nodes: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM knowledge_nodes WHERE document_asset_id = ANY($1)",
    )
    .bind(&kept)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(nodes, kept.len() as i64);
    assert_eq!(objects.count(s.id), 6);
    let source_left: i64 = sqlx::query_scalar("SELECT count(*) FROM sources WHERE id = $1")
        .bind(keep_src)
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(source_left, 0);
    // The secret failed once, retried on its own schedule, then went.
    assert_eq!(
        secrets.seen.lock().unwrap().clone(),
        vec!["vault://tenant-t/docs/0".to_string()]
    );
    let attempts: i32 = sqlx::query_scalar(
        "SELECT attempts FROM deletion_job_items WHERE deletion_job_id = $1 AND kind = 'secret_ref'",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(attempts, 2);

    // cascade: the source and its documents go, with objects, derived rows and head membership.
    let job = request(
        &env.pool,
        &target_request(
            &s,
            Target::Source {
                id: cascade_src,
                mode: SourceMode::Cascade,
            },
            "cascade",
        ),
    )
    .await
    .unwrap();
    let marked: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM document_assets WHERE id = ANY($1) AND lifecycle_state = 'deleting' AND deletion_job_id = $2",
    )
    .bind(&cascaded)
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        marked,
        cascaded.len() as i64,
        "cascade fences the source's documents"
    );
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(&env.pool, job).await;
    let gone: i64 = sqlx::query_scalar("SELECT count(*) FROM document_assets WHERE id = ANY($1)")
        .bind(&cascaded)
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(gone, 0);
    let derived: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM knowledge_nodes WHERE document_asset_id = ANY($1)) \
              + (SELECT count(*) FROM document_outlines WHERE document_asset_id = ANY($1)) \
              + (SELECT count(*) FROM knowledge_paths WHERE document_asset_id = ANY($1))",
    )
    .bind(&cascaded)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(derived, 0);
    assert_eq!(objects.count(s.id), kept.len());
    let mut c = conn(&env.pool).await;
    let head = publication::head(&mut c, &s.tenant, s.id, false)
        .await
        .unwrap()
        .unwrap();
    assert!(cascaded.iter().all(|d| !head.members.contains_key(d)));
    assert!(kept.iter().all(|d| head.members.contains_key(d)));
    let items: Vec<(String, i64)> = sqlx::query_as(
        "SELECT kind, count(*) FROM deletion_job_items WHERE deletion_job_id = $1 GROUP BY 1 ORDER BY 1",
    )
    .bind(job)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        items,
        vec![
            ("cache_key".into(), 3),
            ("document_cascade".into(), 3),
            ("object".into(), 3),
            ("secret_ref".into(), 1)
        ]
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_document_deletion_erases_every_version_and_leaves_the_head_without_it() {
    let env = TestEnv::new().await;
    let objects = Objects::new();
    let s = seed(&env.pool, &objects, "tenant-t", "docs", 0, 3).await;
    let (doc, other) = (s.docs[0], s.docs[1]);
    let mut c = conn(&env.pool).await;
    platform::replace_document(&mut c, &objects.store, doc, Bytes::from_static(b"v2"))
        .await
        .unwrap();
    assert_eq!(objects.count(s.id), 4);
    let rv: i32 = sqlx::query_scalar("SELECT row_version FROM document_assets WHERE id = $1")
        .bind(doc)
        .fetch_one(&env.pool)
        .await
        .unwrap();
    // A stale revision is refused; the current one is accepted.
    let stale = DeletionRequest {
        expected_revision: Some(rv - 1),
        ..target_request(&s, Target::Document { id: doc }, "d1")
    };
    assert!(matches!(
        request(&env.pool, &stale).await,
        Err(RequestError::RevisionMismatch { .. })
    ));
    let job = request(
        &env.pool,
        &DeletionRequest {
            expected_revision: Some(rv),
            ..target_request(&s, Target::Document { id: doc }, "d1")
        },
    )
    .await
    .unwrap();
    let driver = Driver::new(&env, Arc::new(handler(&objects)), Budget::default()).await;
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(&env.pool, job).await;
    assert_eq!(
        objects.count(s.id),
        2,
        "both versions erased, the other documents kept"
    );
    let head = publication::head(&mut c, &s.tenant, s.id, false)
        .await
        .unwrap()
        .unwrap();
    assert!(!head.members.contains_key(&doc));
    assert!(head.members.contains_key(&other));
    let fp = footprint(&env.pool, &s.tenant, s.id).await;
    assert_eq!(fp["document_assets"], 2);
    assert_eq!(fp["knowledge_nodes"], 2);
    assert_eq!(fp["knowledge_spaces"], 1);
    // Workspaces of the space were invalidated (they cannot be attributed) and this job's removed.
    assert_eq!(fp["agent_workspace_snapshots"], 0);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_are_idempotent_and_every_refusal_is_typed_and_changes_nothing() {
    let env = TestEnv::new().await;
    let objects = Objects::new();
    let s = seed(&env.pool, &objects, "tenant-t", "docs", 1, 2).await;
    let doc = s.docs[0];
    let req = target_request(&s, Target::Document { id: doc }, "k1");
    let mut tx = env.pool.begin().await.unwrap();
    let first = request_deletion(&mut tx, &req).await.unwrap();
    let again = request_deletion(&mut tx, &req).await.unwrap();
    tx.commit().await.unwrap();
    assert!(first.created && !again.created);
    assert_eq!(
        (first.job_id, first.outbox_id),
        (again.job_id, again.outbox_id)
    );

    let count = |pool: PgPool| async move {
        let n: (i64, i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM deletion_jobs), (SELECT count(*) FROM deletion_tombstones), \
                    (SELECT count(*) FROM deletion_outbox)",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        n
    };
    let before = count(env.pool.clone()).await;
    assert_eq!(before, (1, 1, 1));

    // Same key, different request.
    let r = request(
        &env.pool,
        &target_request(&s, Target::Document { id: s.docs[1] }, "k1"),
    )
    .await;
    assert!(
        matches!(r, Err(RequestError::IdempotencyConflict { job_id, .. }) if job_id == first.job_id),
        "{r:?}"
    );
    // Another key, same target: the live job owns it.
    let r = request(
        &env.pool,
        &target_request(&s, Target::Document { id: doc }, "k2"),
    )
    .await;
    assert!(
        matches!(r, Err(RequestError::TargetBusy { job_id: Some(j), .. }) if j == first.job_id),
        "{r:?}"
    );
    // A cascade of the document's source collides with the document's job.
    let r = request(
        &env.pool,
        &target_request(
            &s,
            Target::Source {
                id: s.sources[0],
                mode: SourceMode::Cascade,
            },
            "k3",
        ),
    )
    .await;
    assert!(matches!(r, Err(RequestError::TargetBusy { .. })), "{r:?}");
    // The name challenge.
    let mut wrong = space_request(&s, "k4");
    wrong.target = Target::Space {
        confirm_name: "not the name".into(),
    };
    assert!(matches!(
        request(&env.pool, &wrong).await,
        Err(RequestError::NameChallenge)
    ));
    // Unknown targets, and targets of another tenant.
    let r = request(
        &env.pool,
        &target_request(&s, Target::Document { id: Uuid::now_v7() }, "k5"),
    )
    .await;
    assert!(matches!(r, Err(RequestError::NotFound(_))), "{r:?}");
    let r = request(
        &env.pool,
        &DeletionRequest {
            tenant_id: "tenant-u".into(),
            ..target_request(&s, Target::Document { id: s.docs[1] }, "k6")
        },
    )
    .await;
    assert!(matches!(r, Err(RequestError::NotFound(_))), "{r:?}");
    // Snapshots: another subject's, revoked, expired, without the delete scope, wrong channel.
    let other = snapshot(
        &env.pool,
        &s.tenant,
        s.id,
        "bob",
        "interactive",
        r#"["delete"]"#,
    )
    .await;
    let revoked = snapshot(
        &env.pool,
        &s.tenant,
        s.id,
        "alice",
        "interactive",
        r#"["delete"]"#,
    )
    .await;
    sqlx::query("UPDATE knowledge_space_permission_snapshots SET revoked_at = now(), status = 'revoked' WHERE id = $1")
        .bind(revoked)
        .execute(&env.pool)
        .await
        .unwrap();
    let expired = snapshot(
        &env.pool,
        &s.tenant,
        s.id,
        "alice",
        "interactive",
        r#"["delete"]"#,
    )
    .await;
    sqlx::query("UPDATE knowledge_space_permission_snapshots SET expires_at = now() - interval '1 minute' WHERE id = $1")
        .bind(expired)
        .execute(&env.pool)
        .await
        .unwrap();
    let reader = snapshot(
        &env.pool,
        &s.tenant,
        s.id,
        "alice",
        "interactive",
        r#"["read"]"#,
    )
    .await;
    let mcp = snapshot(&env.pool, &s.tenant, s.id, "alice", "mcp", r#"["delete"]"#).await;
    for snap in [other, revoked, expired, reader, mcp, Uuid::now_v7()] {
        let r = request(
            &env.pool,
            &DeletionRequest {
                permission_snapshot_id: snap,
                ..target_request(&s, Target::Document { id: s.docs[1] }, &format!("p-{snap}"))
            },
        )
        .await;
        assert!(
            matches!(r, Err(RequestError::Permission(_))),
            "{snap}: {r:?}"
        );
    }
    assert_eq!(
        count(env.pool.clone()).await,
        before,
        "a refusal wrote something"
    );
    let state: String =
        sqlx::query_scalar("SELECT lifecycle_state FROM document_assets WHERE id = $1")
            .bind(s.docs[1])
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(state, "active");
    // The caller's transaction stays usable after a refusal (the request used a savepoint).
    let mut tx = env.pool.begin().await.unwrap();
    assert!(request_deletion(
        &mut tx,
        &target_request(&s, Target::Document { id: doc }, "k7")
    )
    .await
    .is_err());
    let ok = request_deletion(
        &mut tx,
        &target_request(&s, Target::Document { id: s.docs[1] }, "k8"),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(ok.created);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn live_leases_hold_the_job_without_using_attempts_and_expired_ones_are_reclaimed() {
    let env = TestEnv::new().await;
    let objects = Objects::new();
    let s = seed(&env.pool, &objects, "tenant-t", "docs", 0, 2).await;
    let lease = |status: &'static str, expires: &'static str| {
        let pool = env.pool.clone();
        let s = s.clone();
        async move {
            let id = Uuid::now_v7();
            sqlx::query(&format!(
                "INSERT INTO retrieval_execution_leases (id, tenant_id, knowledge_space_id, subject_id, trace_id, \
                   lease_token, status, row_version, acquired_at, heartbeat_at, expires_at, updated_at) \
                 VALUES ($1, $2, $3, 'bob', gen_random_uuid(), 'tok', '{status}', 0, now() - interval '2 hours', \
                   now() - interval '2 hours', {expires}, now())"
            ))
            .bind(id)
            .bind(&s.tenant)
            .bind(s.id)
            .execute(&pool)
            .await
            .unwrap();
            id
        }
    };
    let live = lease("active", "now() + interval '1 hour'").await;
    let stale = lease("active", "now() - interval '1 hour'").await;
    sqlx::query(
        "INSERT INTO knowledge_space_mutation_leases (id, tenant_id, knowledge_space_id, operation, acquired_at, \
           lease_token, heartbeat_at, expires_at) \
         VALUES (gen_random_uuid(), $1, $2, 'import', now() - interval '1 hour', gen_random_uuid(), \
           now() - interval '1 hour', now() - interval '30 minutes')",
    )
    .bind(&s.tenant)
    .bind(s.id)
    .execute(&env.pool)
    .await
    .unwrap();

    let job = request(&env.pool, &space_request(&s, "drain"))
        .await
        .unwrap();
    let driver = Driver::new(&env, Arc::new(handler(&objects)), Budget::default()).await;
    for _ in 0..3 {
        driver.turn().await;
        skip_wait(&env.pool, job).await;
    }
    let row: (String, String, i32, Option<String>) = sqlx::query_as(
        "SELECT run_state, checkpoint, execution_attempts, last_error_code FROM deletion_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        row,
        (
            "retry_wait".into(),
            "quiescing".into(),
            0,
            Some("waiting".into())
        )
    );
    let status = |id: Uuid| {
        let pool = env.pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT status FROM retrieval_execution_leases WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(
        status(live).await,
        "active",
        "a live lease is never reclaimed"
    );
    assert_eq!(
        status(stale).await,
        "expired",
        "an expired lease is reclaimed"
    );
    let mutation: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM knowledge_space_mutation_leases WHERE knowledge_space_id = $1",
    )
    .bind(s.id)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(mutation, 0, "the expired mutation lease is reclaimed");
    // Nothing destructive happened while the lease was live.
    assert_eq!(objects.count(s.id), 2);
    let items: i64 =
        sqlx::query_scalar("SELECT count(*) FROM deletion_job_items WHERE deletion_job_id = $1")
            .bind(job)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(items, 0);

    sqlx::query("UPDATE retrieval_execution_leases SET status = 'released', updated_at = now() WHERE id = $1")
        .bind(live)
        .execute(&env.pool)
        .await
        .unwrap();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(&env.pool, job).await;
    assert_eq!(objects.count(s.id), 0);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failing_items_retry_then_die_and_a_manual_retry_under_either_authority_finishes_the_job() {
    let env = TestEnv::new().await;
    let objects = Objects::new();
    let s = seed(&env.pool, &objects, "tenant-t", "docs", 0, 3).await;
    let flaky = Arc::new(Flaky {
        inner: objects.store.clone(),
        broken: AtomicBool::new(true),
        calls: AtomicU64::new(0),
    });
    let h = handler(&objects)
        .with_objects(flaky.clone())
        .with_config(DeletionConfig {
            item_max_attempts: 3,
            ..fast_config()
        });
    let driver = Driver::new(&env, Arc::new(h), Budget::default()).await;

    // Requested by bob (a service API caller); rescued later by alice, an interactive owner.
    let bob = snapshot(&env.pool, &s.tenant, s.id, "bob", "mcp", r#"["delete"]"#).await;
    let by_bob = |doc: Uuid, key: &str| DeletionRequest {
        requested_by_subject_id: "bob".into(),
        permission_snapshot_id: bob,
        access_channel: "mcp".into(),
        ..target_request(&s, Target::Document { id: doc }, key)
    };
    let job = request(&env.pool, &by_bob(s.docs[0], "fail-1"))
        .await
        .unwrap();
    let (state, cp) = driver.finish(job, true).await;
    assert_eq!(
        (state.as_str(), cp.as_str()),
        ("failed", "deleting_objects")
    );
    let row: (Option<String>, Option<i32>, String) = sqlx::query_as(
        "SELECT last_error_code, active_slot, (SELECT status FROM deletion_outbox WHERE deletion_job_id = $1 \
           AND delivery_revision = 1) FROM deletion_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        row,
        (Some("item_dead".into()), Some(1), "dead".into()),
        "a failed deletion keeps its slot"
    );
    let dead: (String, i32, i32, Option<String>, bool, bool) = sqlx::query_as(
        "SELECT status, attempts, max_attempts, last_error_code, object_key IS NOT NULL, redacted_at IS NULL \
         FROM deletion_job_items WHERE deletion_job_id = $1 AND kind = 'object'",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        dead,
        ("dead".into(), 3, 3, Some("object_store".into()), true, true)
    );
    assert_eq!(
        flaky.calls.load(Ordering::SeqCst),
        3,
        "one call per attempt, each on its own schedule"
    );
    // The cache item did not wait for the object: completed and redacted.
    let cache: (String, bool) = sqlx::query_as(
        "SELECT status, cache_key IS NULL AND redacted_at IS NOT NULL FROM deletion_job_items \
         WHERE deletion_job_id = $1 AND kind = 'cache_key'",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(cache, ("completed".into(), true));
    // Still fenced: no new request can take the target while the failed job holds it.
    assert!(matches!(
        request(&env.pool, &by_bob(s.docs[0], "fail-again")).await,
        Err(RequestError::TargetBusy { .. })
    ));

    let retry = |actor: &str, snap: Uuid, channel: &str, authority: RetryAuthority, key: &str| {
        RetryRequest {
            job_id: job,
            actor_subject_id: actor.into(),
            permission_snapshot_id: snap,
            access_channel: channel.into(),
            authority,
            idempotency_key: key.into(),
        }
    };
    let do_retry = |r: RetryRequest| {
        let pool = env.pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            let out = retry_deletion(&mut tx, &r).await;
            tx.commit().await.unwrap();
            out
        }
    };
    // Refused: a stranger claiming to be the requester; an owner rescue outside the interactive
    // channel; an interactive "rescue" by someone who is not an owner.
    let carol = snapshot(
        &env.pool,
        &s.tenant,
        s.id,
        "carol",
        "interactive",
        r#"["delete"]"#,
    )
    .await;
    let alice_mcp = snapshot(
        &env.pool,
        &s.tenant,
        s.id,
        "alice",
        "mcp",
        r#"["delete","owner"]"#,
    )
    .await;
    for (r, why) in [
        (
            retry(
                "carol",
                carol,
                "interactive",
                RetryAuthority::OriginalRequester,
                "r0",
            ),
            "not the subject that requested",
        ),
        (
            retry(
                "alice",
                alice_mcp,
                "mcp",
                RetryAuthority::InteractiveOwnerRescue,
                "r0",
            ),
            "interactive",
        ),
        (
            retry(
                "carol",
                carol,
                "interactive",
                RetryAuthority::InteractiveOwnerRescue,
                "r0",
            ),
            "owner",
        ),
    ] {
        let out = do_retry(r).await;
        assert!(
            matches!(&out, Err(RequestError::RetryRefused(m)) if m.contains(why)),
            "{why}: {out:?}"
        );
    }
    let audits: i64 = sqlx::query_scalar("SELECT count(*) FROM deletion_retry_audits")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(audits, 0);

    // The original requester retries; the same request again is the same retry.
    let r1 = retry("bob", bob, "mcp", RetryAuthority::OriginalRequester, "r1");
    let first = do_retry(r1.clone()).await.unwrap();
    let again = do_retry(r1).await.unwrap();
    assert!(first.created && !again.created && first.outbox_id == again.outbox_id);
    assert_eq!(first.delivery_revision, 2);
    let (state, rv_ok, attempts, err): (String, bool, i32, Option<String>) = sqlx::query_as(
        "SELECT run_state, row_version > 1, execution_attempts, last_error_code FROM deletion_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        (state.as_str(), rv_ok, attempts, err),
        ("dispatch_pending", true, 0, None)
    );
    let item: (String, i32, i32) = sqlx::query_as(
        "SELECT status, attempts, max_attempts FROM deletion_job_items WHERE deletion_job_id = $1 AND kind = 'object'",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(item, ("pending".into(), 3, 4), "one more attempt allowed");
    let outbox: (String, String) =
        sqlx::query_as("SELECT idempotency_key, status FROM deletion_outbox WHERE id = $1")
            .bind(first.outbox_id)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(outbox, (format!("deletion:{job}:2"), "pending".into()));
    // Still broken: the one extra attempt fails, and the job fails again.
    assert_eq!(driver.finish(job, true).await.0, "failed");

    // Now an interactive owner rescues it, and the store works again.
    flaky.broken.store(false, Ordering::SeqCst);
    let rescued = do_retry(retry(
        "alice",
        s.owner_snapshot,
        "interactive",
        RetryAuthority::InteractiveOwnerRescue,
        "r2",
    ))
    .await
    .unwrap();
    assert_eq!(rescued.delivery_revision, 3);
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(&env.pool, job).await;
    let audit: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT retry_authority, actor_subject_id, access_channel FROM deletion_retry_audits \
         WHERE deletion_job_id = $1 ORDER BY created_at",
    )
    .bind(job)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        audit,
        vec![
            ("original_requester".into(), "bob".into(), "mcp".into()),
            (
                "interactive_owner_rescue".into(),
                "alice".into(),
                "interactive".into()
            ),
        ]
    );
    let requester: String =
        sqlx::query_scalar("SELECT requested_by_subject_id FROM deletion_jobs WHERE id = $1")
            .bind(job)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(requester, "bob", "a rescue never rewrites the requester");
    assert_eq!(objects.count(s.id), 2);
    // A job that did not fail cannot be retried.
    let out = do_retry(retry(
        "bob",
        bob,
        "mcp",
        RetryAuthority::OriginalRequester,
        "r3",
    ))
    .await;
    assert!(
        matches!(out, Err(RequestError::NotRetryable { .. })),
        "{out:?}"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn residue_found_at_the_end_sends_the_job_back_to_quiescing() {
    let env = TestEnv::new().await;
    let objects = Objects::new();
    let s = seed(&env.pool, &objects, "tenant-t", "docs", 1, 3).await;
    let job = request(&env.pool, &space_request(&s, "residue"))
        .await
        .unwrap();
    // One step per slice, so the test sees every checkpoint.
    let driver = Driver::new(
        &env,
        Arc::new(handler(&objects)),
        Budget {
            max_steps: 1,
            max_time: Duration::from_secs(20),
        },
    )
    .await;
    let mut straggler = None;
    for _ in 0..500 {
        let (state, cp) = job_state(&env.pool, job).await;
        assert_ne!(state, "failed");
        if cp == "deleting_derived_data" && straggler.is_none() {
            // A writer that ignores the fence adds a document (with its bytes) and a node.
            let mut c = conn(&env.pool).await;
            let d = platform::add_document(
                &mut c,
                &objects.store,
                s.id,
                None,
                "late.md",
                "text/markdown",
                Bytes::from_static(b"late"),
            )
            .await
            .unwrap();
            derived_rows(&env.pool, &s.tenant, s.id, d).await;
            straggler = Some(d);
        }
        if state == "succeeded" {
            break;
        }
        if state == "retry_wait" {
            skip_wait(&env.pool, job).await;
        }
        driver.turn().await;
    }
    let straggler = straggler.expect("the job passed through deleting_derived_data");
    assert_finished_clean(&env.pool, job).await;
    let phase: Option<String> =
        sqlx::query_scalar("SELECT scan_phase FROM deletion_jobs WHERE id = $1")
            .bind(job)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(
        phase.as_deref(),
        Some("p2:complete"),
        "a second inventory pass ran"
    );
    let covered: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM deletion_job_items WHERE deletion_job_id = $1 AND resource_id = $2 AND status = 'completed'",
    )
    .bind(job)
    .bind(straggler)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        covered, 2,
        "the straggler's object and cache key were inventoried and erased"
    );
    assert_empty(&footprint(&env.pool, &s.tenant, s.id).await);
    assert_eq!(
        objects.count(s.id),
        0,
        "the straggler's object was erased too"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_documents_are_deleted_one_bounded_page_per_step() {
    const DOCS: i64 = 10_000;
    let env = TestEnv::new().await;
    let objects = Objects::new();
    let mut c = conn(&env.pool).await;
    let tenant = "tenant-big";
    let space = platform::create_space(&mut c, tenant, "big", "Big")
        .await
        .unwrap();
    let snap = snapshot(
        &env.pool,
        tenant,
        space,
        "alice",
        "interactive",
        r#"["delete"]"#,
    )
    .await;
    let seeded = Instant::now();
    let docs: Vec<(Uuid, String)> = sqlx::query_as(
        "INSERT INTO document_assets (id, knowledge_space_id, source_id, filename, mime_type, object_key, sha256, size_bytes, \
           version, parser_status, metadata, created_at, updated_at) \
         SELECT d.id, $1, NULL, 'f' || d.g || '.md', 'text/markdown', \
           'spaces/' || $1::text || '/documents/' || d.id::text || '/v1/f' || d.g || '.md', 'x', 4, 1, 'pending', '{}', now(), now() \
         FROM (SELECT gen_random_uuid() AS id, g FROM generate_series(1, $2) g) d \
         RETURNING id, object_key",
    )
    .bind(space)
    .bind(DOCS)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO knowledge_nodes (id, tenant_id, knowledge_space_id, document_asset_id, document_version, \
           publication_generation_id, ordinal, heading_path, content, content_sha256, token_count, metadata, created_at) \
         SELECT gen_random_uuid(), $1, $2, id, 1, NULL, 0, '[]', 'c', 'x', 1, '{}', now() \
         FROM document_assets WHERE knowledge_space_id = $2",
    )
    .bind(tenant)
    .bind(space)
    .execute(&env.pool)
    .await
    .unwrap();
    futures_util::stream::iter(docs.iter().map(|(_, key)| {
        let store = objects.store.clone();
        async move { store.put(key, Bytes::from_static(b"data")).await.unwrap() }
    }))
    .buffer_unordered(64)
    .collect::<Vec<()>>()
    .await;
    assert_eq!(objects.count(space) as i64, DOCS);
    println!(
        "seeded {DOCS} documents with objects and nodes in {:?}",
        seeded.elapsed()
    );

    let s = Space {
        tenant: tenant.into(),
        id: space,
        name: "Big".into(),
        owner_snapshot: snap,
        docs: vec![],
        sources: vec![],
    };
    let counting = Arc::new(Counting {
        inner: handler(&objects),
        steps: Mutex::new(BTreeMap::new()),
        time: Mutex::new(BTreeMap::new()),
    });
    let cfg = counting.inner.config().clone();
    let driver = Driver::new(&env, counting.clone(), Budget::default()).await;
    let job = request(&env.pool, &space_request(&s, "big")).await.unwrap();
    let started = Instant::now();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    let took = started.elapsed();
    assert_finished_clean(&env.pool, job).await;
    assert_empty(&footprint(&env.pool, tenant, space).await);
    assert_eq!(objects.count(space), 0);
    let steps = counting.steps.lock().unwrap().clone();
    let total: u64 = steps.values().sum();
    println!(
        "time in steps per checkpoint: {:?}",
        counting.time.lock().unwrap()
    );
    println!(
        "deleted a space of {DOCS} documents, {DOCS} objects and {DOCS} nodes in {took:?}: {total} steps {steps:?}, \
         {} slices",
        driver.engine.counters.slices.load(Ordering::Relaxed)
    );
    // Every step holds at most one page: the inventory needs ≥ DOCS/page steps, the objects
    // ≥ 2·DOCS/batch (object + cache key per document), derived and primary ≥ DOCS/page each.
    let page = cfg.page_size as u64;
    let at = |cp: &str| steps.get(cp).copied().unwrap_or(0);
    assert!(at("quiescing") >= DOCS as u64 / page, "{steps:?}");
    assert!(
        at("deleting_objects") >= 2 * DOCS as u64 / cfg.item_batch as u64,
        "{steps:?}"
    );
    assert!(
        at("deleting_derived_data") >= DOCS as u64 / page,
        "{steps:?}"
    );
    assert!(
        at("deleting_primary_data") >= DOCS as u64 / page,
        "{steps:?}"
    );
    let items: i64 =
        sqlx::query_scalar("SELECT count(*) FROM deletion_job_items WHERE deletion_job_id = $1")
            .bind(job)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(items, 2 * DOCS + 1);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cli_requests_and_refuses_with_one_line() {
    let env = TestEnv::new().await;
    let objects = Objects::new();
    let s = seed(&env.pool, &objects, "tenant-t", "docs", 0, 2).await;
    let run = |args: Vec<String>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"));
        cmd.args(&args)
            .env("DATABASE_URL", &env.url)
            .env("KFS_OBJECT_STORE", objects.url());
        cmd.output().unwrap()
    };
    let doc = s.docs[0].to_string();
    let base = |key: &str| -> Vec<String> {
        [
            "delete",
            "document",
            &doc,
            "--space",
            &s.id.to_string(),
            "--tenant",
            &s.tenant,
            "--as",
            "alice",
            "--snapshot",
            &s.owner_snapshot.to_string(),
            "--idempotency-key",
            key,
        ]
        .iter()
        .map(|a| a.to_string())
        .collect()
    };
    let out = run(base("cli-1"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["created"], true);
    let job = v["jobId"].as_str().unwrap().to_owned();
    let again: serde_json::Value = serde_json::from_slice(&run(base("cli-1")).stdout).unwrap();
    assert_eq!(
        (again["jobId"].as_str(), &again["created"]),
        (Some(job.as_str()), &serde_json::json!(false))
    );
    let busy = run(base("cli-2"));
    assert_eq!(busy.status.code(), Some(2));
    let err = String::from_utf8_lossy(&busy.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("already has a live deletion job"), "{err}");
    // Retrying a job that has not failed is refused.
    let retry = run([
        "delete",
        "retry",
        &job,
        "--as",
        "alice",
        "--snapshot",
        &s.owner_snapshot.to_string(),
        "--channel",
        "interactive",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect());
    assert_eq!(
        retry.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&retry.stderr)
    );
    assert!(String::from_utf8_lossy(&retry.stderr).contains("only a failed job can be retried"));
    let show = run(vec!["delete".into(), "show".into(), job.clone()]);
    let v: serde_json::Value = serde_json::from_slice(&show.stdout).unwrap();
    assert_eq!(v["runState"], "dispatch_pending");
    env.cleanup().await;
}

#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_at_any_kill_point_mid_deletion_is_finished_by_another() {
    for point in [
        "after-claim-commit",
        "after-step-commit:2",
        "after-step-commit:6",
        "after-step-commit:12",
        "before-ack:2",
    ] {
        let env = TestEnv::new().await;
        let objects = Objects::new();
        let s = seed(&env.pool, &objects, "tenant-t", "docs", 2, 8).await;
        let other = seed(&env.pool, &objects, "tenant-u", "docs", 1, 3).await;
        let before_other = footprint(&env.pool, &other.tenant, other.id).await;
        let job = request(&env.pool, &space_request(&s, "crash"))
            .await
            .unwrap();
        let store = objects.url();
        let common_env = [
            ("KFS_OBJECT_STORE", store.as_str()),
            ("KFS_SLICE_STEPS", "3"),
            ("KFS_RELAY_POLL", "100ms"),
        ];
        let mut crash_env = common_env.to_vec();
        crash_env.push(("KFS_CRASH_AT", point));
        let mut doomed = env.spawn_worker(
            &format!("doomed-{point}"),
            &["run", "--kinds", "deletion"],
            &crash_env,
        );
        let exited = doomed.wait_exit(Duration::from_secs(60));
        assert!(
            exited.is_some(),
            "{point}: the worker did not reach its kill point\n{}",
            doomed.log_text()
        );
        assert!(
            !exited.unwrap().success(),
            "{point}: the worker exited normally"
        );
        let (state, cp) = job_state(&env.pool, job).await;
        assert_ne!(
            state, "succeeded",
            "{point}: finished before the kill ({cp})"
        );

        let mut rescuer = env.spawn_worker(
            &format!("rescuer-{point}"),
            &["run", "--kinds", "deletion"],
            &common_env,
        );
        let pool = env.pool.clone();
        let done = env
            .wait_until(Duration::from_secs(90), || {
                let pool = pool.clone();
                async move { job_state(&pool, job).await.0 == "succeeded" }
            })
            .await;
        assert!(
            done,
            "{point}: {:?}\n{}",
            job_state(&env.pool, job).await,
            rescuer.log_text()
        );
        common::stop_cleanly([&mut rescuer], Duration::from_secs(30)).await;
        assert_finished_clean(&env.pool, job).await;
        assert_empty(&footprint(&env.pool, &s.tenant, s.id).await);
        assert_eq!(objects.count(s.id), 0, "{point}: objects left behind");
        assert_eq!(
            footprint(&env.pool, &other.tenant, other.id).await,
            before_other
        );
        assert_eq!(objects.count(other.id), 3);
        env.cleanup().await;
    }
}
