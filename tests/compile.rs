//! document.compile against real Postgres and RabbitMQ: request, the fenced walk, publication
//! by compare-and-swap, failures with clear codes, supersede, manual retry, deferred dispatch,
//! the command line, kill points (with `--features crash-points`) and 200 documents across two
//! worker processes.
//!
//! Most tests drive deliveries in-process: the outbox row is put out for delivery by SQL (as the
//! relay's mark leaves it) and `Engine::process_ref` runs the slice, so interleavings are exact.
//! Document bytes live in a temporary `file://` object store that the test and any spawned
//! worker share.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::space::SpaceFx;
use kfs_worker::consumer::lease::DeliveryRef;
use kfs_worker::consumer::slice::Budget;
use kfs_worker::consumer::{ConsumerConfig, Engine, Handled};
use kfs_worker::jobs::compile::parse::{self, MAX_CHUNK_CHARS};
use kfs_worker::jobs::compile::{
    self, AttemptStatus, CompileError, CompileHandler, RequestOptions,
};
use kfs_worker::jobs::{Deps, Kind};
use kfs_worker::publication::{self, PUBLISHED_NODE_FILTER};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const HANG: Duration = Duration::from_secs(60);
const TENANT: &str = "tenant-compile";

const GUIDE_MD: &[u8] = include_bytes!("fixtures/compile/guide.md");
const PAGE_HTML: &[u8] = include_bytes!("fixtures/compile/page.html");
const NOTES_TXT: &[u8] = include_bytes!("fixtures/compile/notes.txt");

common::space::space_fixture!(
    /// A test database and queues, a shared file object store, and one knowledge space.
    Fx
);

impl Fx {
    async fn new() -> Fx {
        Fx(SpaceFx::new(TENANT, "compile", "Compile tests").await)
    }

    async fn request(&self, doc: Uuid, defer: bool) -> Result<Uuid, CompileError> {
        let mut tx = self.pool().begin().await.unwrap();
        let r = compile::request(&mut tx, doc, RequestOptions { defer }).await;
        tx.commit().await.unwrap();
        r
    }

    fn engine(&self, worker: &str, max_steps: u32) -> Engine {
        let handler = CompileHandler::new(Deps {
            store: self.store.clone(),
        })
        .unwrap();
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

    async fn status(&self, attempt: Uuid) -> AttemptStatus {
        let mut conn = self.pool().acquire().await.unwrap();
        compile::show(&mut conn, attempt).await.unwrap()
    }

    /// Puts the attempt's outbox row out for delivery as the relay's mark leaves it.
    async fn dispatch(&self, attempt: Uuid) -> DeliveryRef {
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
    async fn slice(&self, engine: &Engine, attempt: Uuid) -> Handled {
        let d = self.dispatch(attempt).await;
        tokio::time::timeout(HANG, engine.process_ref(&d, &CancellationToken::new()))
            .await
            .expect("process_ref hung")
    }

    /// Slices until the attempt ends.
    async fn drive(&self, engine: &Engine, attempt: Uuid) -> AttemptStatus {
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
    async fn drive_to(&self, engine: &Engine, attempt: Uuid, cp: &str) {
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

    /// Nodes of `doc` that the space's head serves.
    async fn served_nodes(&self, doc: Uuid) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM knowledge_nodes n WHERE {PUBLISHED_NODE_FILTER} AND n.document_asset_id = $3"
        ))
        .bind(TENANT)
        .bind(self.space)
        .bind(doc)
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    /// Served nodes of `doc` whose generation is not `generation`.
    async fn served_from_other_generations(&self, doc: Uuid, generation: Uuid) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM knowledge_nodes n WHERE {PUBLISHED_NODE_FILTER} AND n.document_asset_id = $3 \
               AND n.publication_generation_id <> $4"
        ))
        .bind(TENANT)
        .bind(self.space)
        .bind(doc)
        .bind(generation)
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    async fn rows_of_generation(&self, table: &str, generation: Uuid) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {table} WHERE tenant_id = $1 AND knowledge_space_id = $2 AND publication_generation_id = $3"
        ))
        .bind(TENANT)
        .bind(self.space)
        .bind(generation)
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    async fn search(&self, query: &str) -> Vec<compile::Hit> {
        let mut conn = self.pool().acquire().await.unwrap();
        compile::search_published(&mut conn, TENANT, self.space, query, 50)
            .await
            .unwrap()
    }

    async fn head(&self) -> Option<publication::Head> {
        let mut conn = self.pool().acquire().await.unwrap();
        publication::head(&mut conn, TENANT, self.space, false)
            .await
            .unwrap()
    }

    async fn cleanup(self) {
        self.0.cleanup().await;
    }
}

/// The nodes a document must produce.
fn expected_nodes(mime: &str, filename: &str, bytes: &[u8]) -> i64 {
    let f = parse::detect(mime, filename).unwrap();
    parse::chunks(&parse::parse(f, bytes).unwrap(), MAX_CHUNK_CHARS).len() as i64
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_format_is_compiled_published_and_searchable() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-formats", 64);
    let docs = [
        (
            "guide.md",
            "text/markdown",
            GUIDE_MD,
            "zeppelin mooring",
            "superheat",
        ),
        (
            "page.html",
            "text/html; charset=utf-8",
            PAGE_HTML,
            "fresnel lens",
            "diaphones",
        ),
        (
            "notes.txt",
            "text/plain",
            NOTES_TXT,
            "varroa mites",
            "carniolan",
        ),
    ];
    let mut revision = 0;
    for (name, mime, bytes, query, word) in docs {
        let doc = fx.add(name, mime, bytes).await;
        let attempt = fx.request(doc, false).await.unwrap();
        let created = fx.status(attempt).await;
        assert_eq!(
            (
                created.run_state.as_str(),
                created.checkpoint.as_str(),
                created.active_slot,
                created.row_version,
                created.execution_attempts,
                created.max_execution_attempts,
                created.base_head_revision,
            ),
            ("dispatch_pending", "queued", Some(1), 0, 0, 5, revision)
        );
        assert_eq!(created.tenant_id, TENANT);
        assert_ne!(created.publication_generation_id, Uuid::nil());
        let (payload, key, event, schema, dispatch_attempts): (
            serde_json::Value,
            String,
            String,
            i32,
            i32,
        ) = sqlx::query_as(
            "SELECT payload, idempotency_key, event_type, schema_version, dispatch_attempts \
                 FROM document_compilation_outbox WHERE attempt_id = $1",
        )
        .bind(attempt)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert_eq!(
            payload,
            serde_json::json!({ "attemptId": attempt.to_string() })
        );
        assert_eq!(key, format!("document.compile:{attempt}"));
        assert_eq!(
            (event.as_str(), schema, dispatch_attempts),
            ("document.compile", 1, 0)
        );

        let done = fx.drive(&engine, attempt).await;
        assert_succeeded(&done);
        revision += 1;
        let head = fx.head().await.unwrap();
        assert_eq!(head.revision, revision);
        assert_eq!(
            head.members[&doc],
            publication::Member {
                generation: done.publication_generation_id,
                version: 1
            }
        );

        let expected = expected_nodes(mime, name, bytes);
        assert!(expected >= 1, "{name}");
        assert_eq!(fx.served_nodes(doc).await, expected, "{name}");
        let g = done.publication_generation_id;
        assert_eq!(fx.rows_of_generation("knowledge_nodes", g).await, expected);
        assert_eq!(
            fx.rows_of_generation("index_projections", g).await,
            expected
        );
        assert_eq!(fx.rows_of_generation("document_outlines", g).await, 1);
        let longest: i32 = sqlx::query_scalar(
            "SELECT max(char_length(content)) FROM knowledge_nodes WHERE publication_generation_id = $1",
        )
        .bind(g)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert!(longest as usize <= MAX_CHUNK_CHARS);
        let parser_status: String =
            sqlx::query_scalar("SELECT parser_status FROM document_assets WHERE id = $1")
                .bind(doc)
                .fetch_one(fx.pool())
                .await
                .unwrap();
        assert_eq!(parser_status, "parsed");

        for q in [query, word] {
            let hits = fx.search(q).await;
            assert!(!hits.is_empty(), "{name}: no hit for {q:?}");
            assert!(
                hits.iter().all(|h| h.document_asset_id == doc),
                "{name}: {hits:?}"
            );
        }
    }
    // Markdown: the long section was split, headings made the outline, front matter and code
    // fences kept their place.
    let outline: serde_json::Value = sqlx::query_scalar(
        "SELECT o.outline FROM document_outlines o JOIN document_assets d ON d.id = o.document_asset_id \
         WHERE d.filename = 'guide.md'",
    )
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(outline["headings"][0]["text"], "Zeppelin Field Guide");
    let h2: Vec<&str> = outline["headings"][0]["children"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(h2, ["Mooring", "Ballast", "Navigation"]);
    assert_eq!(
        outline["headings"][0]["children"][1]["children"][0]["text"],
        "Weigh-off"
    );
    let weigh = fx.search("static heaviness").await;
    assert_eq!(weigh.len(), 1);
    assert_eq!(
        weigh[0].heading_path,
        serde_json::json!(["Zeppelin Field Guide", "Ballast", "Weigh-off"])
    );
    // HTML: scripts and styles are not content.
    assert!(fx.search("telemetry indexed").await.is_empty());
    assert_eq!(
        fx.head().await.unwrap().members.len(),
        3,
        "every document is a member"
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_fails_with_a_clear_code_frees_the_slot_and_publishes_nothing() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-bad", 64);

    let corrupt = fx
        .add(
            "broken.md",
            "text/markdown",
            b"# Title\n\nok \xff\xfe bytes",
        )
        .await;
    let mismatched = fx
        .add("tampered.txt", "text/plain", b"original words")
        .await;
    let key: String = sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
        .bind(mismatched)
        .fetch_one(fx.pool())
        .await
        .unwrap();
    fx.store
        .put(&key, Bytes::from_static(b"tampered words"))
        .await
        .unwrap();
    let unsupported = fx.add("scan.pdf", "application/pdf", b"%PDF-1.7 ...").await;
    let missing = fx.add("gone.txt", "text/plain", b"soon gone").await;
    let key: String = sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
        .bind(missing)
        .fetch_one(fx.pool())
        .await
        .unwrap();
    fx.store.delete(&key).await.unwrap();

    for (doc, code) in [
        (corrupt, "corrupt_document"),
        (mismatched, "hash_mismatch"),
        (unsupported, "unsupported_format"),
        (missing, "object_missing"),
    ] {
        let attempt = fx.request(doc, false).await.unwrap();
        let s = fx.drive(&engine, attempt).await;
        assert_failed(&s, code);
        assert_eq!(s.checkpoint, "queued", "nothing advanced");
        assert!(s
            .last_error_message
            .as_deref()
            .is_some_and(|m| !m.is_empty()));
        assert_eq!(fx.served_nodes(doc).await, 0);
        let parser_status: String =
            sqlx::query_scalar("SELECT parser_status FROM document_assets WHERE id = $1")
                .bind(doc)
                .fetch_one(fx.pool())
                .await
                .unwrap();
        assert_eq!(
            parser_status, "failed",
            "the document records that its bytes failed"
        );
        assert_eq!(
            fx.rows_of_generation("knowledge_nodes", s.publication_generation_id)
                .await,
            0
        );
        // The slot is free: the same version can be requested again.
        let again = fx.request(doc, true).await.unwrap();
        assert_ne!(again, attempt);
    }
    assert!(fx.head().await.is_none(), "nothing was published");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_head_that_moved_during_publish_is_rebased_and_the_candidate_stays() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-interleave", 1);
    let a_doc = fx
        .add(
            "a.md",
            "text/markdown",
            b"# Alpha\n\nAlbatross gliding over waves.",
        )
        .await;
    let b_doc = fx
        .add(
            "b.md",
            "text/markdown",
            b"# Beta\n\nBuffalo grazing the prairie.",
        )
        .await;
    let a = fx.request(a_doc, false).await.unwrap();
    let b = fx.request(b_doc, false).await.unwrap();
    // Interleave one-step slices: both build their candidates against the empty head.
    loop {
        let (sa, sb) = (fx.status(a).await, fx.status(b).await);
        if sa.checkpoint == "smoke_eval_passed" && sb.checkpoint == "smoke_eval_passed" {
            break;
        }
        for (x, s) in [(a, sa), (b, sb)] {
            if s.checkpoint != "smoke_eval_passed" {
                assert_eq!(
                    fx.slice(&engine, x).await,
                    Handled::Ack {
                        claim: "claimed",
                        end: Some("continue")
                    }
                );
            }
        }
    }
    let (sa, sb) = (fx.status(a).await, fx.status(b).await);
    assert_eq!((sa.base_head_revision, sb.base_head_revision), (0, 0));
    let b_candidate = sb.candidate_publication_id.unwrap();

    // A publishes first; B then finds the head moved from 0 to 1.
    assert_succeeded(&fx.drive(&engine, a).await);
    assert_eq!(fx.head().await.unwrap().revision, 1);
    let sb = fx.drive(&engine, b).await;
    assert_succeeded(&sb);
    assert_eq!(sb.base_head_revision, 1, "rebased on the moved head");
    assert_eq!(
        sb.candidate_publication_id,
        Some(b_candidate),
        "the bound candidate never changes"
    );
    let head = fx.head().await.unwrap();
    assert_eq!(head.revision, 2);
    assert_ne!(head.publication_id, b_candidate);
    assert_eq!(
        head.members.keys().copied().collect::<Vec<_>>(),
        {
            let mut v = vec![a_doc, b_doc];
            v.sort();
            v
        },
        "the rebased publication keeps A and adds B"
    );
    let candidate_members: serde_json::Value = sqlx::query_scalar(
        "SELECT metadata -> 'members' FROM projection_set_publications WHERE id = $1 AND tenant_id = $2",
    )
    .bind(b_candidate)
    .bind(TENANT)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(
        candidate_members.as_object().unwrap().len(),
        1,
        "the candidate itself is untouched"
    );
    assert_eq!(fx.search("albatross").await.len(), 1);
    assert_eq!(fx.search("buffalo").await.len(), 1);
    let states: Vec<(String, i64)> = sqlx::query_as(
        "SELECT status::text, count(*) FROM projection_set_publications WHERE tenant_id = $1 AND knowledge_space_id = $2 \
         GROUP BY 1 ORDER BY 1",
    )
    .bind(TENANT)
    .bind(fx.space)
    .fetch_all(fx.pool())
    .await
    .unwrap();
    // A's candidate (superseded by the rebase), B's candidate (never served), the rebase (served).
    assert_eq!(
        states,
        vec![
            ("candidate".to_owned(), 1),
            ("published".to_owned(), 1),
            ("superseded".to_owned(), 1)
        ]
    );
    fx.cleanup().await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_older_attempt_is_superseded_by_a_later_publication_of_its_version() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-supersede", 1);
    let doc = fx
        .add(
            "s.md",
            "text/markdown",
            b"# Seal\n\nSeals basking on rocks.",
        )
        .await;
    let old = fx.request(doc, false).await.unwrap();
    fx.drive_to(&engine, old, "smoke_eval_passed").await;
    fail_like_the_engine(fx.pool(), old).await;

    let new = fx.request(doc, false).await.unwrap();
    let sn = fx.drive(&engine, new).await;
    assert_succeeded(&sn);

    // The old attempt comes back by manual retry and reaches publish after the newer one won.
    {
        let mut tx = fx.pool().begin().await.unwrap();
        compile::retry(&mut tx, old).await.unwrap();
        tx.commit().await.unwrap();
    }
    let so = fx.drive(&engine, old).await;
    assert!(so.is_superseded(), "{so:?}");
    assert_eq!(so.active_slot, None);
    assert_eq!(so.checkpoint, "smoke_eval_passed", "it never published");
    let head = fx.head().await.unwrap();
    assert_eq!(head.revision, 1, "the head did not move");
    assert_eq!(head.members[&doc].generation, sn.publication_generation_id);
    assert_eq!(
        fx.served_from_other_generations(doc, sn.publication_generation_id)
            .await,
        0
    );
    assert_eq!(fx.search("basking").await.len(), 1);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn manual_retry_rearms_the_same_attempt_and_outbox_row() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-retry", 64);
    let good = b"Otters juggle pebbles in the kelp forest.";
    let doc = fx.add("otters.txt", "text/plain", good).await;
    let key: String = sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
        .bind(doc)
        .fetch_one(fx.pool())
        .await
        .unwrap();
    fx.store
        .put(&key, Bytes::from_static(b"garbled"))
        .await
        .unwrap();
    let attempt = fx.request(doc, false).await.unwrap();
    let failed = fx.drive(&engine, attempt).await;
    assert_failed(&failed, "hash_mismatch");
    let outbox_before: Uuid =
        sqlx::query_scalar("SELECT id FROM document_compilation_outbox WHERE attempt_id = $1")
            .bind(attempt)
            .fetch_one(fx.pool())
            .await
            .unwrap();

    // Refusals: a retry of a live attempt, and of a failed one while another is active.
    let other = fx.request(doc, true).await.unwrap();
    let mut tx = fx.pool().begin().await.unwrap();
    let e = compile::retry(&mut tx, other).await.unwrap_err();
    assert!(matches!(e, CompileError::NotRetryable { .. }), "{e}");
    let e = compile::retry(&mut tx, attempt).await.unwrap_err();
    assert!(
        matches!(e, CompileError::ActiveAttemptExists { attempt: Some(a), .. } if a == other),
        "{e}"
    );
    assert!(e
        .to_string()
        .contains("already has an active compilation attempt"));
    // The caller's transaction is still usable after the refusals.
    tx.commit().await.unwrap();
    let mut conn = fx.pool().acquire().await.unwrap();
    sqlx::query("DELETE FROM document_compilation_attempts WHERE id = $1")
        .bind(other)
        .execute(&mut *conn)
        .await
        .unwrap();

    fx.store.put(&key, Bytes::from_static(good)).await.unwrap();
    compile::retry(&mut conn, attempt).await.unwrap();
    drop(conn);
    let rearmed = fx.status(attempt).await;
    assert_eq!(rearmed.run_state, "dispatch_pending");
    assert_eq!(rearmed.active_slot, Some(1));
    assert_eq!(rearmed.execution_attempts, 0);
    assert_eq!(rearmed.completed_at, None);
    assert_eq!(rearmed.last_error_code, None);
    assert_eq!(rearmed.row_version, failed.row_version + 1);
    let (outbox_after, status, attempts, queue_job, last_error): (Uuid, String, i32, Option<String>, Option<String>) =
        sqlx::query_as(
            "SELECT id, status, dispatch_attempts, queue_job_id, last_error FROM document_compilation_outbox \
             WHERE attempt_id = $1 AND available_at <= now()",
        )
        .bind(attempt)
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(outbox_after, outbox_before, "the same outbox row");
    assert_eq!(
        (status.as_str(), attempts, queue_job, last_error),
        ("pending", 0, None, None)
    );

    let done = fx.drive(&engine, attempt).await;
    assert_succeeded(&done);
    assert_eq!(fx.search("otters kelp").await.len(), 1);
    let mut conn = fx.pool().acquire().await.unwrap();
    let e = compile::retry(&mut conn, attempt).await.unwrap_err();
    assert!(matches!(e, CompileError::NotRetryable { .. }), "{e}");
    let e = compile::retry(&mut conn, Uuid::now_v7()).await.unwrap_err();
    assert!(matches!(e, CompileError::AttemptNotFound(_)), "{e}");
    drop(conn);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deferred_dispatch_is_not_sent_until_released() {
    use kfs_worker::relay::{Relay, RelayConfig};
    use lapin::options::{BasicAckOptions, BasicGetOptions};

    let fx = Fx::new().await;
    let engine = fx.engine("w-defer", 64);
    let doc = fx
        .add(
            "d.md",
            "text/markdown",
            b"Dormice hibernate in hazel hedges.",
        )
        .await;
    let attempt = fx.request(doc, true).await.unwrap();
    let s = fx.status(attempt).await;
    assert_eq!(s.outbox_status.as_deref(), Some("pending"));
    assert_eq!(
        s.outbox_available_at
            .unwrap()
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        "9999-12-31T23:59:59.999Z"
    );
    let relay = Relay::new(
        fx.pool().clone(),
        fx.env.topology.clone(),
        "test-relay",
        RelayConfig::default(),
        &[Kind::Compile],
    );
    let ch = fx.env.confirm_channel().await;
    let round = relay.relay_once(&ch, Kind::Compile).await.unwrap();
    assert_eq!(round.dispatched, 0, "deferred: not sent");
    assert_eq!(
        fx.env
            .queue_depth(&fx.env.topology.queue(Kind::Compile))
            .await,
        0
    );

    let mut conn = fx.pool().acquire().await.unwrap();
    compile::release(&mut conn, attempt).await.unwrap();
    let e = compile::release(&mut conn, attempt).await.unwrap_err();
    assert!(matches!(e, CompileError::NotDeferred { .. }), "{e}");
    drop(conn);
    let round = relay.relay_once(&ch, Kind::Compile).await.unwrap();
    assert_eq!(round.dispatched, 1, "released: sent");

    // The real message runs the attempt.
    let get = fx.env.channel().await;
    let msg = get
        .basic_get(
            fx.env.topology.queue(Kind::Compile).as_str().into(),
            BasicGetOptions::default(),
        )
        .await
        .unwrap()
        .expect("a message");
    let handled = engine
        .process(
            Kind::Compile,
            &msg.properties,
            &msg.data,
            &CancellationToken::new(),
        )
        .await;
    assert_eq!(
        handled,
        Handled::Ack {
            claim: "claimed",
            end: Some("succeeded")
        }
    );
    msg.ack(BasicAckOptions::default()).await.unwrap();
    assert_succeeded(&fx.status(attempt).await);
    assert_eq!(fx.search("dormice").await.len(), 1);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_active_attempt_and_a_deleting_document_are_refused() {
    let fx = Fx::new().await;
    let doc = fx
        .add("x.txt", "text/plain", b"Xerus squirrels dig burrows.")
        .await;
    let mut tx = fx.pool().begin().await.unwrap();
    let first = compile::request(&mut tx, doc, RequestOptions::default())
        .await
        .unwrap();
    let e = compile::request(&mut tx, doc, RequestOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(e, CompileError::ActiveAttemptExists { attempt: Some(a), version: 1, .. } if a == first),
        "{e}"
    );
    assert!(e.is_refusal());
    tx.commit().await.unwrap();
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM document_compilation_attempts WHERE document_asset_id = $1",
    )
    .bind(doc)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(n, 1);
    let outbox: i64 = sqlx::query_scalar("SELECT count(*) FROM document_compilation_outbox")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(outbox, 1);

    // Two concurrent requests: exactly one wins, the other gets the typed refusal.
    let doc2 = fx.add("y.txt", "text/plain", b"Yaks carry salt.").await;
    let (mut t1, mut t2) = (
        fx.pool().begin().await.unwrap(),
        fx.pool().begin().await.unwrap(),
    );
    let r1 = compile::request(&mut t1, doc2, RequestOptions::default()).await;
    let pending = tokio::spawn(async move {
        let r = compile::request(&mut t2, doc2, RequestOptions::default()).await;
        t2.commit().await.unwrap();
        r
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    t1.commit().await.unwrap();
    let r2 = pending.await.unwrap();
    assert!(r1.is_ok());
    assert!(
        matches!(r2, Err(CompileError::ActiveAttemptExists { .. })),
        "{r2:?}"
    );

    let doc3 = fx.add("z.txt", "text/plain", b"Zebras.").await;
    sqlx::query(
        "UPDATE document_assets SET lifecycle_state = 'deleting', deletion_job_id = gen_random_uuid(), deleting_at = now() \
         WHERE id = $1",
    )
    .bind(doc3)
    .execute(fx.pool())
    .await
    .unwrap();
    let e = fx.request(doc3, false).await.unwrap_err();
    assert!(matches!(e, CompileError::DocumentDeleting { .. }), "{e}");
    let e = fx.request(Uuid::now_v7(), false).await.unwrap_err();
    assert!(matches!(e, CompileError::DocumentNotFound(_)), "{e}");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_document_marked_deleting_mid_compile_is_canceled_without_publishing() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-deleting", 1);
    let doc = fx
        .add("q.md", "text/markdown", b"Quolls hunt at night.")
        .await;
    let attempt = fx.request(doc, false).await.unwrap();
    fx.drive_to(&engine, attempt, "nodes_generated").await;
    sqlx::query(
        "UPDATE document_assets SET lifecycle_state = 'deleting', deletion_job_id = gen_random_uuid(), deleting_at = now() \
         WHERE id = $1",
    )
    .bind(doc)
    .execute(fx.pool())
    .await
    .unwrap();
    let s = fx.drive(&engine, attempt).await;
    assert_eq!(s.run_state, "canceled");
    assert_eq!(s.last_error_code.as_deref(), Some("document_deleting"));
    assert_eq!(s.active_slot, None);
    assert!(fx.head().await.is_none());
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn repeating_every_step_yields_the_same_rows_once() {
    // A step that ran but did not commit (a crash before its commit) is simply run again: here
    // each step's transaction is run and rolled back once before the real run.
    use kfs_worker::jobs::{Handler, JobCtx};
    let fx = Fx::new().await;
    let doc = fx.add("guide.md", "text/markdown", GUIDE_MD).await;
    let attempt = fx.request(doc, false).await.unwrap();
    let handler = CompileHandler::new(Deps {
        store: fx.store.clone(),
    })
    .unwrap();
    let mut cp = "queued".to_owned();
    let mut steps = 0;
    loop {
        let ctx = JobCtx {
            kind: Kind::Compile,
            job_id: attempt,
            outbox_id: Uuid::nil(),
            delivery_id: "d".into(),
            lease_token: Uuid::new_v4(),
            row_version: 0,
            checkpoint: cp.clone(),
            execution_attempts: 1,
            max_execution_attempts: 5,
            worker_id: "w".into(),
        };
        let mut tx = fx.pool().begin().await.unwrap();
        let first = handler.step(&mut tx, &ctx).await.unwrap();
        tx.rollback().await.unwrap();
        let mut tx = fx.pool().begin().await.unwrap();
        let second = handler.step(&mut tx, &ctx).await.unwrap();
        // Run the committed step twice too: the second run replaces the first one's rows.
        let third = handler.step(&mut tx, &ctx).await.unwrap();
        assert_eq!(first, second);
        assert_eq!(second, third);
        match second {
            kfs_worker::jobs::Step::Advance(next) => {
                sqlx::query(
                    "UPDATE document_compilation_attempts SET checkpoint = $2 WHERE id = $1",
                )
                .bind(attempt)
                .bind(&next)
                .execute(&mut *tx)
                .await
                .unwrap();
                tx.commit().await.unwrap();
                cp = next;
            }
            kfs_worker::jobs::Step::Succeed(last) => {
                assert_eq!(last, "published");
                tx.commit().await.unwrap();
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
        steps += 1;
        assert!(steps < 10);
    }
    assert_eq!(steps, 5, "five advances, then the publish");
    let g = fx.status(attempt).await.publication_generation_id;
    let expected = expected_nodes("text/markdown", "guide.md", GUIDE_MD);
    assert!(expected >= 4, "the guide spans several nodes: {expected}");
    assert_eq!(fx.rows_of_generation("knowledge_nodes", g).await, expected);
    assert_eq!(
        fx.rows_of_generation("index_projections", g).await,
        expected
    );
    assert_eq!(fx.rows_of_generation("document_outlines", g).await, 1);
    assert_eq!(fx.served_nodes(doc).await, expected);
    let candidates: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM projection_set_publications WHERE tenant_id = $1 AND knowledge_space_id = $2",
    )
    .bind(TENANT)
    .bind(fx.space)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(candidates, 1, "the candidate was created once");
    fx.cleanup().await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_command_line_requests_releases_retries_and_shows() {
    let fx = Fx::new().await;
    let doc = fx
        .add("c.txt", "text/plain", b"Capybaras relax in hot springs.")
        .await;
    let out = kfs(&fx, &["compile", &doc.to_string(), "--defer"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let attempt: Uuid = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert_eq!(fx.status(attempt).await.run_state, "dispatch_pending");

    let refused = |o: &std::process::Output, needle: &str| {
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.starts_with("error: ") && err.contains(needle), "{err}");
    };
    refused(
        &kfs(&fx, &["compile", &doc.to_string()]),
        "already has an active compilation attempt",
    );
    refused(&kfs(&fx, &["compile", "not-a-uuid"]), "is not a UUID");
    refused(
        &kfs(&fx, &["compile", "retry", &attempt.to_string()]),
        "only a failed attempt",
    );
    refused(
        &kfs(&fx, &["compile", "release", &Uuid::now_v7().to_string()]),
        "no compilation attempt",
    );
    refused(&kfs(&fx, &["compile"]), "needs a document id");

    let out = kfs(&fx, &["compile", "show", &attempt.to_string()]);
    assert!(out.status.success());
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["runState"], "dispatch_pending");
    assert_eq!(shown["outboxStatus"], "pending");

    let out = kfs(&fx, &["compile", "release", &attempt.to_string()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(fx.status(attempt).await.outbox_available_at.unwrap() <= chrono::Utc::now());
    refused(
        &kfs(&fx, &["compile", "release", &attempt.to_string()]),
        "not waiting for release",
    );

    // Fail it, then retry from the command line, then let the engine finish and `wait` see it.
    fail_like_the_engine(fx.pool(), attempt).await;
    let out = kfs(&fx, &["compile", "retry", &attempt.to_string()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let engine = fx.engine("w-cli", 64);
    assert_succeeded(&fx.drive(&engine, attempt).await);
    let out = kfs(
        &fx,
        &["compile", "wait", &attempt.to_string(), "--timeout", "5s"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["runState"], "succeeded");
    fx.cleanup().await;
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
    let head = fx.head().await.expect("a head");
    for (doc, attempt, expected, marker) in docs {
        let s = fx.status(*attempt).await;
        assert_succeeded(&s);
        let g = s.publication_generation_id;
        assert_eq!(
            head.members[doc].generation, g,
            "head serves the attempt's generation"
        );
        assert_eq!(
            fx.served_nodes(*doc).await,
            *expected,
            "served nodes of {doc}"
        );
        assert_eq!(fx.served_from_other_generations(*doc, g).await, 0);
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
            "SELECT count(*) FROM knowledge_nodes WHERE tenant_id = $1 AND knowledge_space_id = $2 AND document_asset_id = $3",
        )
        .bind(TENANT)
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_documents_across_two_worker_processes() {
    const DOCS: usize = 200;
    let fx = Fx::new().await;
    let extra = |id: &'static str| {
        vec![
            ("KFS_OBJECT_STORE", fx.store_url.clone()),
            ("KFS_KINDS", "compile".to_owned()),
            ("KFS_WORKER_ID", id.to_owned()),
            ("KFS_RELAY_POLL", "200ms".to_owned()),
            ("RUST_LOG", "info,kfs_worker=info".to_owned()),
        ]
    };
    let spawn = |id: &'static str| {
        let e = extra(id);
        let e: Vec<(&str, &str)> = e.iter().map(|(k, v)| (*k, v.as_str())).collect();
        fx.env.spawn_worker(id, &["run"], &e)
    };
    let mut workers = [spawn("bulk-1"), spawn("bulk-2")];
    let started = Instant::now();
    let docs = request_generated(&fx, DOCS, "bulkmark").await;
    let requested = started.elapsed();
    let attempts: Vec<Uuid> = docs.iter().map(|d| d.1).collect();
    let done = wait_terminal(&fx, &attempts, Duration::from_secs(240)).await;
    let elapsed = started.elapsed();
    let logs: String = workers
        .iter()
        .map(|w| {
            let t = w.log_text();
            let tail: Vec<&str> = t.lines().rev().take(20).collect();
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        })
        .collect::<Vec<_>>()
        .join("\n---\n");
    assert!(
        done,
        "not every attempt ended: {:?}\n{logs}",
        states(fx.pool()).await
    );
    println!(
        "[compile bulk] {DOCS} documents across 2 workers: {:.2}s in all, {:.1} documents/s \
         ({:.2}s to add and request them while the workers ran)",
        elapsed.as_secs_f64(),
        DOCS as f64 / elapsed.as_secs_f64(),
        requested.as_secs_f64()
    );
    assert_all_published(&fx, &docs).await;
    assert_eq!(fx.head().await.unwrap().members.len(), DOCS);
    common::stop_cleanly(&mut workers, Duration::from_secs(20)).await;
    fx.cleanup().await;
}

#[cfg(feature = "crash-points")]
mod crash {
    use super::*;

    /// Worker A dies at `point` mid-compile; worker B finishes; every document is published
    /// exactly once with exactly its own nodes.
    async fn kill_point(point: &'static str) {
        const DOCS: usize = 8;
        let fx = Fx::new().await;
        let base = |id: &'static str| {
            vec![
                ("KFS_OBJECT_STORE", fx.store_url.clone()),
                ("KFS_KINDS", "compile".to_owned()),
                ("KFS_WORKER_ID", id.to_owned()),
                ("KFS_RELAY_POLL", "200ms".to_owned()),
                // Slices end mid-walk, so every kill point falls inside a compilation.
                ("KFS_SLICE_STEPS", "2".to_owned()),
                // Long on purpose: finishing fast proves the takeover did not wait for it.
                ("KFS_LEASES", "compile=60s".to_owned()),
                ("KFS_SHUTDOWN_GRACE", "5s".to_owned()),
            ]
        };
        let spawn = |id: &'static str, crash: Option<&'static str>| {
            let mut e = base(id);
            if let Some(c) = crash {
                e.push(("KFS_CRASH_AT", c.to_owned()));
            }
            let e: Vec<(&str, &str)> = e.iter().map(|(k, v)| (*k, v.as_str())).collect();
            fx.env.spawn_worker(id, &["run"], &e)
        };
        let docs = request_generated(&fx, DOCS, "crashmark").await;
        let target = match point {
            "after-step-commit" => "after-step-commit:3",
            other => other,
        };
        let mut a = spawn("a", Some(target));
        let status = a.wait_exit(Duration::from_secs(60));
        let log = a.log_text();
        assert!(
            status.is_some_and(|s| !s.success()),
            "A did not abort at {point}: {status:?}\n{log}"
        );
        assert!(
            log.contains(&format!("crash point {point} reached")),
            "{log}"
        );
        let mid: Vec<(String, String, Option<String>, i64)> = states(fx.pool()).await;
        let started = Instant::now();
        let mut b = spawn("b", None);
        let attempts: Vec<Uuid> = docs.iter().map(|d| d.1).collect();
        let done = wait_terminal(&fx, &attempts, Duration::from_secs(90)).await;
        assert!(
            done,
            "not every attempt ended after A died at {point}: {:?}\n{}",
            states(fx.pool()).await,
            b.log_text()
        );
        println!(
            "[compile crash {point}] at death: {mid:?}; B finished in {:.2}s (lease 60s)",
            started.elapsed().as_secs_f64()
        );
        assert_all_published(&fx, &docs).await;
        common::stop_cleanly([&mut b], Duration::from_secs(20)).await;
        drop(a);
        fx.cleanup().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn compile_survives_a_crash_after_claim_commit() {
        kill_point("after-claim-commit").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn compile_survives_a_crash_after_step_commit() {
        kill_point("after-step-commit").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn compile_survives_a_crash_before_ack() {
        kill_point("before-ack").await;
    }
}
