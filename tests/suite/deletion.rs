//! deletion.job end to end against real Postgres, RabbitMQ and a local object directory, on the
//! platform's schema: every target and mode, idempotent and refused requests, draining writers
//! and leases, item retries and dead items, redaction, residue, manual retries under both
//! authorities, tenant and space isolation checked over every table of the schema, crashed
//! workers, a 10,000-document space in bounded pages; jobs under capability grants (revoked or
//! fenced ones fail closed), logical documents, the 0019..0054 RESTRICT keys and the head's
//! profile binding.
//!
//! Documents are compiled by the real compile handler (`SpaceFx::compile`), so their read model
//! is the one the worker writes; the tables compile does not write are seeded with the platform's
//! columns. Jobs are driven in-process: a real relay round publishes the due outbox rows, the test
//! takes the messages off the queue and hands them to an `Engine`, as a consumer would. Waiting
//! time is skipped with SQL (retry_at and item next_attempt_at moved to now), never slept through.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use kfs_worker::consumer::{ConsumerConfig, Engine};
use kfs_worker::engine::slice::Budget;
use kfs_worker::jobs::compile::{self, RequestOptions, Requester};
use kfs_worker::jobs::deletion::{
    request_deletion, request_deletion_under_grant, retry_deletion, retry_deletion_under_grant,
    CachePage, DeletionConfig, DeletionHandler, DeletionRequest, GrantDeletionRequest,
    GrantRetryRequest, ObjectEraser, PortError, RequestError, RetrievalCache, RetryAuthority,
    RetryRequest, SecretRef, SecretStore, SourceMode, Target, CAPABILITY_REVOKED,
    CAPABILITY_REVOKED_MESSAGE, SPACE_LOCK_CLASS,
};
use kfs_worker::jobs::{Deps, Handler, JobCtx, JobError, Kind, Step};
use kfs_worker::publication::{self, Member};
use kfs_worker::relay::{Relay, RelayConfig};
use kfs_worker::store::Store;
use kfs_worker::tools::platform;
use lapin::options::BasicGetOptions;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::support::space::{SpaceFx, OWNER};

mod catalog;
mod platform_rows;
mod spaces;

mod concurrency;
#[cfg(feature = "crash-points")]
mod crash;
mod document;
mod grants;
mod head_binding;
mod logical_document;
mod requests;
mod residue;
mod restrict_keys;
mod retry;
mod source;
mod space;

use catalog::*;
use platform_rows::*;
use spaces::*;

// ---------------------------------------------------------------------------------------------
// Requests

fn space_request(s: &Space, key: &str) -> DeletionRequest {
    DeletionRequest {
        tenant_id: s.tenant.clone(),
        knowledge_space_id: s.id,
        target: Target::Space {
            confirm_name: s.name.clone(),
        },
        expected_revision: None,
        requested_by_subject_id: OWNER.into(),
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

async fn snapshot_for(fx: &SpaceFx, s: &Space, subject: &str, channel: &str) -> Uuid {
    let mut c = conn(fx.pool()).await;
    platform::create_permission_snapshot(&mut c, &s.tenant, s.id, subject, channel, None)
        .await
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Ports that record or fail

/// A secret the store was asked to erase: tenant, space, source, reference.
type SeenSecret = (String, Uuid, Option<Uuid>, String);

#[derive(Default)]
struct Recording {
    secrets: Mutex<Vec<SeenSecret>>,
    failures_left: AtomicU64,
    cache: Mutex<BTreeSet<String>>,
    prefixes: Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl SecretStore for Recording {
    async fn delete_secret(&self, s: &SecretRef<'_>) -> Result<(), PortError> {
        if self
            .failures_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(PortError::retryable("secret_store", "vault unavailable"));
        }
        self.secrets.lock().unwrap().push((
            s.tenant.to_owned(),
            s.space,
            s.source,
            s.credential_ref.to_owned(),
        ));
        Ok(())
    }
}

#[async_trait::async_trait]
impl RetrievalCache for Recording {
    async fn delete_prefix(&self, prefix: &str, limit: usize) -> Result<CachePage, PortError> {
        self.prefixes.lock().unwrap().push(prefix.to_owned());
        let mut cache = self.cache.lock().unwrap();
        let hits: Vec<String> = cache
            .iter()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect();
        let gone: Vec<String> = hits.iter().take(limit).cloned().collect();
        for k in &gone {
            cache.remove(k);
        }
        Ok(CachePage {
            deleted: gone.len() as u64,
            more: hits.len() > gone.len(),
        })
    }
}

/// An object store that fails deletions while `broken` is set.
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

    async fn list_objects(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<String>, PortError> {
        self.inner.list_objects(prefix, after, limit).await
    }

    async fn object_exists(&self, key: &str) -> Result<bool, PortError> {
        self.inner.object_exists(key).await
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

fn handler(fx: &SpaceFx) -> DeletionHandler {
    DeletionHandler::new(Deps::offline(fx.store.clone()))
        .unwrap()
        .with_config(fast_config())
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
    async fn new(fx: &SpaceFx, handler: Arc<dyn Handler>, budget: Budget) -> Driver {
        let env = &fx.env;
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
                if state != "succeeded" {
                    let why: (Option<String>, Option<String>) = sqlx::query_as(
                        "SELECT last_error_code, last_error_message FROM deletion_jobs WHERE id = $1",
                    )
                    .bind(job)
                    .fetch_one(&self.pool)
                    .await
                    .unwrap();
                    eprintln!("job {job} ended {state} at {cp}: {why:?}");
                }
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
           OR object_key IS NOT NULL OR credential_ref IS NOT NULL OR cache_key IS NOT NULL OR redacted_at IS NULL)",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(unredacted, 0, "items not completed or not redacted");
}

async fn item_kinds(pool: &PgPool, job: Uuid) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT kind, count(*) FROM deletion_job_items WHERE deletion_job_id = $1 GROUP BY 1 ORDER BY 1",
    )
    .bind(job)
    .fetch_all(pool)
    .await
    .unwrap()
}
