//! document.compile against real Postgres and RabbitMQ: request, the fenced walk, publication
//! by compare-and-swap, failures with clear codes, supersede, manual retry, deferred dispatch,
//! the command line, kill points (with `--features crash-points`) and 200 documents across two
//! worker processes.
//!
//! Most tests drive deliveries in-process: the outbox row is put out for delivery by SQL (as the
//! relay's mark leaves it) and `Engine::process_ref` runs the slice, so interleavings are exact.
//! Document bytes live in a temporary `file://` object store that the test and any spawned
//! worker share.

use std::time::{Duration, Instant};

use bytes::Bytes;
use kfs_worker::consumer::Handled;
use kfs_worker::jobs::compile::artifact;
use kfs_worker::jobs::compile::chunk::{self, MAX_CHUNK_GRAPHEMES};
use kfs_worker::jobs::compile::parse;
use kfs_worker::jobs::compile::{
    self, AttemptStatus, CompileError, CompileHandler, RequestOptions, Requester,
};
use kfs_worker::jobs::{Deps, Kind};
use kfs_worker::tools::platform;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::support;
use crate::support::space::{SpaceFx, GUIDE_MD, NOTES_TXT, PAGE_HTML};

mod attempts;
mod authority;
mod bulk;
mod command_line;
#[cfg(feature = "crash-points")]
mod crash;
mod embedding;
mod formats;
mod idempotence;
mod profiles;
mod publish;
mod publish_waits;
mod query_plans;
mod revisions;
mod together;

const TENANT: &str = "tenant-compile";

support::space::space_fixture!(
    /// A test database and queues, a shared file object store, and one knowledge space.
    Fx
);

impl Fx {
    async fn new() -> Fx {
        Fx(SpaceFx::new(TENANT, "compile", "Compile tests").await)
    }

    /// Nodes of `doc` reachable from the head's publication through its projection members of `doc`.
    async fn served_nodes(&self, doc: Uuid) -> i64 {
        sqlx::query_scalar(
            "SELECT count(DISTINCT n.id) FROM projection_set_publication_heads h \
             JOIN projection_set_publication_members m ON m.tenant_id = h.tenant_id \
               AND m.knowledge_space_id = h.knowledge_space_id AND m.publication_id = h.publication_id \
               AND m.component_type = 'index-projection' AND m.document_asset_id = $3 \
             JOIN index_projections p ON p.id = m.component_key AND p.publication_generation_id = m.generation_id \
             JOIN knowledge_nodes n ON n.id = p.node_id AND n.publication_generation_id = p.publication_generation_id \
             WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2 AND n.document_asset_id = $3",
        )
        .bind(TENANT)
        .bind(self.space)
        .bind(doc)
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    async fn rows_of_generation(&self, table: &str, generation: Uuid) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {table} WHERE knowledge_space_id = $1 AND publication_generation_id = $2"
        ))
        .bind(self.space)
        .bind(generation)
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    async fn cleanup(self) {
        self.0.cleanup().await;
    }
}

/// The nodes a document must produce: the platform's chunker over its parse's elements (plain
/// text is parsed as Markdown).
fn expected_nodes(mime: &str, filename: &str, bytes: &[u8]) -> i64 {
    let f = match parse::detect(mime, filename).unwrap() {
        parse::Format::Text => parse::Format::Markdown,
        f => f,
    };
    let id = Uuid::new_v4();
    let els = artifact::elements(id, &parse::parse(f, bytes).unwrap());
    chunk::chunk(&els, id, "h").len() as i64
}

fn assert_succeeded(s: &AttemptStatus) {
    assert_eq!(s.run_state, "succeeded", "{s:?}");
    assert_eq!(s.checkpoint, "published", "{s:?}");
    assert_eq!(s.active_slot, None);
    assert_eq!(s.outbox_status.as_deref(), Some("completed"));
    assert!(s.candidate_publication_id.is_some() && s.candidate_fingerprint.is_some());
}

fn assert_failed(s: &AttemptStatus, code: &str) {
    assert_eq!(s.run_state, "failed", "{s:?}");
    assert_eq!(s.last_error_code.as_deref(), Some(code), "{s:?}");
    assert_eq!(s.active_slot, None, "a failed attempt frees its slot");
    assert!(s.completed_at.is_some());
    assert_eq!(s.outbox_status.as_deref(), Some("dead"));
}

/// Marks an attempt failed exactly as the engine's fatal end does.
async fn fail_like_the_engine(pool: &PgPool, attempt: Uuid) {
    let done = sqlx::query(
        "WITH j AS (UPDATE document_compilation_attempts SET run_state = 'failed', active_slot = NULL, \
           completed_at = now(), last_error_code = 'test_failure', last_error_message = 'failed by the test', \
           retry_at = NULL, row_version = row_version + 1, updated_at = now() \
         WHERE id = $1 AND run_state IN ('queued', 'dispatch_pending') RETURNING id) \
         UPDATE document_compilation_outbox o SET status = 'dead', last_error = 'test_failure' FROM j WHERE o.attempt_id = j.id",
    )
    .bind(attempt)
    .execute(pool)
    .await
    .unwrap();
    assert_eq!(done.rows_affected(), 1);
}

fn kfs(fx: &Fx, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"))
        .args(args)
        .env("DATABASE_URL", &fx.env.url)
        .env("KFS_OBJECT_STORE", &fx.store_url)
        .env_remove("RUST_LOG")
        .output()
        .expect("run kfs-worker")
}

/// Lowercase letters only, so that each marker is one plain full-text word.
fn letters(mut i: usize) -> String {
    let mut s = String::new();
    loop {
        s.push((b'a' + (i % 26) as u8) as char);
        i /= 26;
        if i == 0 {
            break;
        }
    }
    s
}

/// A document of the given format carrying the unique word `marker`.
fn generated(i: usize, marker: &str) -> (String, &'static str, Vec<u8>) {
    let filler =
        "Sediment layers record floods, droughts and the slow drift of river channels. ".repeat(12);
    match i % 3 {
        0 => (
            format!("doc{i}.md"),
            "text/markdown",
            format!("# Report {marker}\n\nThe {marker} survey opens here.\n\n## Details\n\n{filler}\n\nClosing {marker} remarks.")
                .into_bytes(),
        ),
        1 => (
            format!("doc{i}.html"),
            "text/html",
            format!("<html><body><h1>Page</h1><p>The {marker} page.</p><h2>More</h2><p>{filler}</p></body></html>")
                .into_bytes(),
        ),
        _ => (
            format!("doc{i}.txt"),
            "text/plain",
            format!("Notes on {marker}.\n\n{filler}\n").into_bytes(),
        ),
    }
}

async fn wait_terminal(fx: &Fx, attempts: &[Uuid], timeout: Duration) -> bool {
    let pool = fx.pool().clone();
    let ids = attempts.to_vec();
    fx.env
        .wait_until(timeout, || {
            let pool = pool.clone();
            let ids = ids.clone();
            async move {
                let open: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM document_compilation_attempts WHERE id = ANY($1) \
                     AND run_state NOT IN ('succeeded', 'failed', 'canceled', 'superseded')",
                )
                .bind(&ids)
                .fetch_one(&pool)
                .await
                .unwrap();
                open == 0
            }
        })
        .await
}

async fn states(pool: &PgPool) -> Vec<(String, String, Option<String>, i64)> {
    sqlx::query_as(
        "SELECT run_state::text, checkpoint::text, last_error_code::text, count(*) FROM document_compilation_attempts \
         GROUP BY 1, 2, 3 ORDER BY 1, 2",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Every attempt succeeded, each document serves exactly its own generation's nodes, and those
/// are the nodes its bytes produce, once.
async fn assert_all_published(fx: &Fx, docs: &[(Uuid, Uuid, i64, String)]) {
    let served = fx.served().await;
    for (doc, attempt, expected, marker) in docs {
        let s = fx.status(*attempt).await;
        assert_succeeded(&s);
        let g = s.publication_generation_id;
        assert_eq!(
            served[doc].generation, g,
            "head serves the attempt's generation"
        );
        assert_eq!(
            fx.served_nodes(*doc).await,
            *expected,
            "served nodes of {doc}"
        );
        assert_eq!(
            fx.rows_of_generation("knowledge_nodes", g).await,
            *expected,
            "nodes of the generation, once"
        );
        assert_eq!(
            fx.rows_of_generation("index_projections", g).await,
            *expected
        );
        let all: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM knowledge_nodes WHERE knowledge_space_id = $1 AND document_asset_id = $2",
        )
        .bind(fx.space)
        .bind(doc)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert_eq!(all, *expected, "no nodes of any other generation exist");
        let hits = fx.search(marker).await;
        assert!(!hits.is_empty(), "{marker} not searchable");
        assert!(
            hits.iter().all(|h| h.document_asset_id == *doc),
            "{marker}: {hits:?}"
        );
    }
}

/// Adds and requests `n` generated documents; returns (doc, attempt, expected nodes, marker).
async fn request_generated(fx: &Fx, n: usize, tag: &str) -> Vec<(Uuid, Uuid, i64, String)> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // A consonant tail keeps the English stemmer from folding two markers together.
        let marker = format!("{tag}{}qk", letters(i));
        let (name, mime, bytes) = generated(i, &marker);
        let doc = fx.add(&name, mime, &bytes).await;
        let attempt = fx.request(doc, false).await.unwrap();
        out.push((doc, attempt, expected_nodes(mime, &name, &bytes), marker));
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The platform's 0019–0041 rows around a compile: capability grants, the frozen profile tuple and
// its fence, the publication's profile binding, and the logical-document intents.
// ---------------------------------------------------------------------------------------------

impl Fx {
    /// Requests `doc` under `opts` in a transaction of its own.
    async fn request_with(&self, doc: Uuid, opts: RequestOptions) -> Result<Uuid, CompileError> {
        let mut tx = self.pool().begin().await.unwrap();
        let r = compile::request(&mut tx, doc, opts).await;
        tx.commit().await.unwrap();
        r
    }

    /// A capability grant of `subject` in this space for every content scope.
    async fn grant(&self, subject: &str) -> Uuid {
        let mut conn = self.pool().acquire().await.unwrap();
        platform::create_capability_grant(&mut conn, TENANT, self.space, subject, &[])
            .await
            .unwrap()
    }

    /// The space's profile binding rows.
    async fn bindings(&self) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM knowledge_space_profile_publication_bindings WHERE knowledge_space_id = $1",
        )
        .bind(self.space)
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    /// A publication's status.
    async fn publication_status(&self, id: Uuid) -> String {
        sqlx::query_scalar("SELECT status::text FROM projection_set_publications WHERE id = $1")
            .bind(id)
            .fetch_one(self.pool())
            .await
            .unwrap()
    }

    /// The revision of asset `asset`: (logical document, revision, state, bound attempt,
    /// activated).
    async fn revision_of(&self, asset: Uuid) -> (Uuid, i32, String, Option<Uuid>, bool) {
        sqlx::query_as(
            "SELECT document_id, revision, state::text, compilation_attempt_id, activated_at IS NOT NULL \
             FROM document_revisions WHERE document_asset_id = $1",
        )
        .bind(asset)
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    /// A logical document: (status, active revision, row version).
    async fn logical(&self, id: Uuid) -> (String, Option<i32>, i32) {
        sqlx::query_as(
            "SELECT status::text, active_revision, row_version FROM logical_documents WHERE id = $1",
        )
        .bind(id)
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    /// The space's active profile heads: (kind, revision id, revision, digest), in kind order.
    async fn active_heads(&self) -> Vec<(String, Uuid, i32, String)> {
        sqlx::query_as(
            "SELECT h.kind::text, r.id, r.revision, r.snapshot_digest::text FROM knowledge_space_profile_heads h \
             JOIN knowledge_space_profile_revisions r ON r.id = h.profile_revision_id AND r.revision = h.active_revision \
             WHERE h.knowledge_space_id = $1 AND r.state = 'active' ORDER BY h.kind",
        )
        .bind(self.space)
        .fetch_all(self.pool())
        .await
        .unwrap()
    }
}

fn by_grant(grant: Uuid) -> RequestOptions {
    RequestOptions {
        grant: Some(grant),
        ..RequestOptions::default()
    }
}
