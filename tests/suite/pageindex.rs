//! Page-index upgrade backfills (platform migration 0010) on the platform's real tables, against
//! the real Postgres. A space's documents are compiled in-process first (the compile writes the
//! complete page index the platform's readers expect); the tests then take a head's page index
//! away, as a head published before the page index existed lacks it, and let the backfill build
//! it back. The slices run in-process with `leased::run_once` so interleavings are exact; the
//! crash tests run real `kfs-worker run --leased` children aborted at crash points.

use std::time::Duration;

use kfs_worker::engine::leased::{self, Outcome};
use kfs_worker::engine::slice::Budget;
use kfs_worker::jobs::pageindex::{self, walk, PageIndexKind};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use crate::support::space::{SpaceFx, GUIDE_MD, NOTES_TXT, PAGE_HTML};

const TENANT: &str = "tenant-pageindex";

fn one_step() -> Budget {
    Budget {
        max_steps: 1,
        max_time: Duration::from_secs(30),
    }
}

fn kind() -> PageIndexKind {
    PageIndexKind {
        retry_after: Duration::ZERO,
        ..PageIndexKind::default()
    }
}

/// A space with up to three compiled documents.
async fn compiled(slug: &str, n: usize) -> (SpaceFx, Vec<Uuid>) {
    let fx = SpaceFx::new(TENANT, slug, "Docs").await;
    let files: [(&str, &str, &[u8]); 3] = [
        ("guide.md", "text/markdown", GUIDE_MD),
        ("page.html", "text/html", PAGE_HTML),
        ("notes.txt", "text/plain", NOTES_TXT),
    ];
    let mut docs = Vec::new();
    for (name, mime, bytes) in files.into_iter().take(n) {
        let doc = fx.add(name, mime, bytes).await;
        fx.compile(doc).await;
        docs.push(doc);
    }
    (fx, docs)
}

/// Every page-index row of the space, without time stamps: manifests (with their status),
/// nodes and terms, each in id order.
async fn page_index_rows(pool: &PgPool, space: Uuid) -> Value {
    sqlx::query_scalar(
        "SELECT jsonb_build_object( \
           'manifests', (SELECT coalesce(jsonb_agg(to_jsonb(m) - 'created_at' - 'updated_at' ORDER BY m.id), '[]') \
                         FROM page_index_manifests m WHERE m.knowledge_space_id = $1), \
           'nodes', (SELECT coalesce(jsonb_agg(to_jsonb(n) ORDER BY n.id), '[]') FROM page_index_nodes n \
                     JOIN page_index_manifests m ON m.id = n.manifest_id WHERE m.knowledge_space_id = $1), \
           'terms', (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.id), '[]') FROM page_index_terms t \
                     WHERE t.knowledge_space_id = $1))",
    )
    .bind(space)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Takes away the page index of `docs` (all the space's documents when empty), nodes and terms
/// with it, as a head published before the page index existed lacks it.
async fn strip(pool: &PgPool, space: Uuid, docs: &[Uuid]) {
    let n = sqlx::query(
        "DELETE FROM page_index_manifests WHERE knowledge_space_id = $1 \
           AND (cardinality($2::uuid[]) = 0 OR document_asset_id = ANY($2))",
    )
    .bind(space)
    .bind(docs)
    .execute(pool)
    .await
    .unwrap()
    .rows_affected();
    assert!(n > 0, "there was a page index to take away");
}

fn statuses(rows: &Value) -> Vec<String> {
    rows["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["status"].as_str().unwrap().to_owned())
        .collect()
}

async fn start(fx: &SpaceFx) -> Option<pageindex::Job> {
    let mut conn = fx.pool().acquire().await.unwrap();
    pageindex::start(&mut conn, &fx.tenant, fx.space)
        .await
        .unwrap()
}

async fn job(pool: &PgPool, id: Uuid) -> pageindex::Job {
    sqlx::query_as(
        "SELECT id, tenant_id::text, knowledge_space_id, publication_id, publication_fingerprint::text, \
           head_revision, run_state::text, total_items, completed_items, retry_count, row_version, \
           worker_id::text, last_error_code::text, last_error_message \
         FROM page_index_upgrade_backfills WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The items of a job: (ordinal, outline, document, status), by ordinal.
async fn items(pool: &PgPool, id: Uuid) -> Vec<(i32, Uuid, Uuid, String)> {
    sqlx::query_as(
        "SELECT ordinal, document_outline_id, document_asset_id, status::text \
         FROM page_index_upgrade_backfill_items WHERE backfill_id = $1 ORDER BY ordinal",
    )
    .bind(id)
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn ready(fx: &SpaceFx) -> bool {
    let mut conn = fx.pool().acquire().await.unwrap();
    pageindex::query_ready(&mut conn, &fx.tenant, fx.space)
        .await
        .unwrap()
}

/// Runs slices of `budget` until nothing is claimable; the outcomes in order.
async fn run_all(pool: &PgPool, kind: &PageIndexKind, budget: Budget) -> Vec<Outcome> {
    let mut out = Vec::new();
    for _ in 0..50 {
        match leased::run_once(pool, kind, "w-pageindex", budget)
            .await
            .unwrap()
        {
            Some((_, o)) => out.push(o),
            None => return out,
        }
    }
    panic!("the backfill never ran out of work: {out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_incomplete_head_gets_its_page_index_rebuilt_and_promoted_as_the_platform_does() {
    let (fx, docs) = compiled("pi-rebuild", 3).await;
    let pool = fx.pool();
    let compiled_rows = page_index_rows(pool, fx.space).await;
    assert_eq!(statuses(&compiled_rows), ["ready", "ready", "ready"]);
    assert!(ready(&fx).await);
    assert!(
        start(&fx).await.is_none(),
        "a complete head needs no backfill"
    );

    strip(pool, fx.space, &[]).await;
    assert!(
        !ready(&fx).await,
        "research must not read a head without its page index"
    );
    let head = fx.head().await.unwrap();
    let queued = start(&fx)
        .await
        .expect("an incomplete head gets a backfill");
    assert_eq!(
        queued.id, head.publication_id,
        "the publication id is the job's id"
    );
    assert_eq!(
        (
            queued.publication_id,
            queued.head_revision,
            queued.run_state.as_str(),
            queued.total_items,
            queued.completed_items,
            queued.retry_count,
            queued.row_version
        ),
        (head.publication_id, head.revision, "queued", 3, 0, 0, 0)
    );
    let frozen = items(pool, queued.id).await;
    assert_eq!(frozen.iter().map(|i| i.0).collect::<Vec<_>>(), [0, 1, 2]);
    let mut outlines: Vec<Uuid> = frozen.iter().map(|i| i.1).collect();
    let in_order = outlines.clone();
    outlines.sort();
    assert_eq!(in_order, outlines, "ordinals follow the outline ids");
    let mut item_docs: Vec<Uuid> = frozen.iter().map(|i| i.2).collect();
    item_docs.sort();
    let mut want_docs = docs.clone();
    want_docs.sort();
    assert_eq!(item_docs, want_docs);
    assert_eq!(
        start(&fx).await.unwrap(),
        queued,
        "start again: the same job"
    );

    // One item per slice: the first build leaves one `building` manifest and nothing ready.
    let kind = kind();
    let first = leased::run_once(pool, &kind, "w-pageindex", one_step())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.1, Outcome::Ended("continue"));
    let j = job(pool, queued.id).await;
    assert_eq!((j.run_state.as_str(), j.completed_items), ("queued", 1));
    assert_eq!(
        statuses(&page_index_rows(pool, fx.space).await),
        ["building"]
    );
    assert_eq!(
        items(pool, queued.id).await[0].3,
        "succeeded",
        "the first ordinal first"
    );
    assert!(!ready(&fx).await);

    let rest = run_all(pool, &kind, one_step()).await;
    assert_eq!(
        rest,
        [
            Outcome::Ended("continue"),
            Outcome::Ended("continue"),
            Outcome::Ended("succeeded")
        ]
    );
    let done = job(pool, queued.id).await;
    assert_eq!(
        (
            done.run_state.as_str(),
            done.completed_items,
            done.worker_id.as_deref(),
            done.last_error_code.as_deref()
        ),
        ("succeeded", 3, None, None)
    );
    assert!(items(pool, queued.id)
        .await
        .iter()
        .all(|i| i.3 == "succeeded"));
    let (lease, completed): (Option<Uuid>, bool) = sqlx::query_as(
        "SELECT lease_token, completed_at IS NOT NULL FROM page_index_upgrade_backfills WHERE id = $1",
    )
    .bind(queued.id)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((lease, completed), (None, true));
    // The very rows the compile wrote: the same ids, checksums, nodes and terms, all ready.
    assert_eq!(page_index_rows(pool, fx.space).await, compiled_rows);
    assert!(ready(&fx).await);
    assert_eq!(fx.head().await.unwrap(), head, "the head did not move");
    assert_eq!(
        start(&fx).await.unwrap().run_state,
        "succeeded",
        "start after success: the succeeded job, no new one"
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_head_that_moves_before_cutover_supersedes_the_job_and_queues_one_for_the_new_head() {
    let (fx, docs) = compiled("pi-moved", 2).await;
    let pool = fx.pool();
    strip(pool, fx.space, &[]).await;
    let old = start(&fx).await.unwrap();
    let kind = kind();
    // Both items built (`building`), the cutover not yet run.
    for _ in 0..2 {
        leased::run_once(pool, &kind, "w-pageindex", one_step())
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(job(pool, old.id).await.completed_items, 2);
    // A third document publishes over the head (its check accepts `building` page indexes and
    // its publication promotes them); then its own page index goes missing.
    let third = fx.add("notes.txt", "text/plain", NOTES_TXT).await;
    fx.compile(third).await;
    let moved = fx.head().await.unwrap();
    assert_ne!(moved.publication_id, old.publication_id);
    strip(pool, fx.space, &[third]).await;

    let outcomes = run_all(pool, &kind, Budget::default()).await;
    assert_eq!(
        outcomes,
        [Outcome::Ended("superseded"), Outcome::Ended("succeeded")]
    );
    let old_row = job(pool, old.id).await;
    assert_eq!(
        (
            old_row.run_state.as_str(),
            old_row.last_error_code.as_deref(),
            old_row.last_error_message.as_deref()
        ),
        (
            "superseded",
            Some(walk::HEAD_CHANGED),
            Some(walk::HEAD_CHANGED_MESSAGE)
        )
    );
    let new = job(pool, moved.publication_id).await;
    assert_eq!(
        (
            new.run_state.as_str(),
            new.head_revision,
            new.total_items,
            new.completed_items
        ),
        ("succeeded", moved.revision, 3, 3)
    );
    assert_eq!(
        statuses(&page_index_rows(pool, fx.space).await),
        ["ready", "ready", "ready"]
    );
    assert!(ready(&fx).await);
    assert_eq!(fx.served().await.len(), docs.len() + 1);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_live_mutation_lease_makes_the_build_wait_and_a_missing_outline_fails_until_retried() {
    let (fx, _) = compiled("pi-refusals", 2).await;
    let pool = fx.pool();
    strip(pool, fx.space, &[]).await;
    let j = start(&fx).await.unwrap();
    let kind = kind();

    // A document mutation in progress: the build waits, nothing is built, nothing fails.
    sqlx::query(
        "INSERT INTO knowledge_space_mutation_leases (id, tenant_id, knowledge_space_id, operation, acquired_at, \
           lease_token, heartbeat_at, expires_at) \
         VALUES (gen_random_uuid(), $1, $2, 'document-upload', now(), gen_random_uuid(), now(), now() + interval '5 minutes')",
    )
    .bind(&fx.tenant)
    .bind(fx.space)
    .execute(pool)
    .await
    .unwrap();
    let (_, waited) = leased::run_once(pool, &kind, "w-pageindex", Budget::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(waited, Outcome::Ended("wait"));
    let row = job(pool, j.id).await;
    assert_eq!(
        (
            row.run_state.as_str(),
            row.completed_items,
            row.last_error_code.as_deref()
        ),
        ("queued", 0, Some("waiting"))
    );
    assert!(statuses(&page_index_rows(pool, fx.space).await).is_empty());
    let claimable_later = PageIndexKind::default();
    assert!(
        leased::run_once(pool, &claimable_later, "w-pageindex", Budget::default())
            .await
            .unwrap()
            .is_none(),
        "a waiting job is not claimed again before its retry delay"
    );
    sqlx::query(
        "UPDATE knowledge_space_mutation_leases SET expires_at = now() - interval '1 second'",
    )
    .execute(pool)
    .await
    .unwrap();

    // A frozen item whose outline no longer joins fails the job with the platform's error.
    sqlx::query(
        "UPDATE page_index_upgrade_backfill_items SET document_version = 99 WHERE backfill_id = $1 AND ordinal = 1",
    )
    .bind(j.id)
    .execute(pool)
    .await
    .unwrap();
    let outcomes = run_all(pool, &kind, Budget::default()).await;
    assert_eq!(outcomes, [Outcome::Ended("failed")]);
    let failed = job(pool, j.id).await;
    assert_eq!(
        (
            failed.run_state.as_str(),
            failed.completed_items,
            failed.last_error_code.as_deref(),
            failed.last_error_message.as_deref()
        ),
        (
            "failed",
            1,
            Some(walk::VERIFICATION),
            Some("Frozen PageIndex backfill outline closure is missing")
        )
    );

    // Only a failed job can be retried; the retry keeps the succeeded item.
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query(
        "UPDATE page_index_upgrade_backfill_items i SET document_version = o.version \
         FROM document_outlines o WHERE i.backfill_id = $1 AND o.id = i.document_outline_id",
    )
    .bind(j.id)
    .execute(&mut *conn)
    .await
    .unwrap();
    let retried = pageindex::retry(&mut conn, &fx.tenant, fx.space)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (
            retried.run_state.as_str(),
            retried.retry_count,
            retried.completed_items,
            retried.last_error_code.as_deref()
        ),
        ("queued", 1, 1, None)
    );
    let again = pageindex::retry(&mut conn, &fx.tenant, fx.space).await;
    assert!(
        matches!(&again, Err(pageindex::RequestError::Refused(m)) if m == "PageIndex upgrade cannot retry from state=queued"),
        "{again:?}"
    );
    drop(conn);
    assert_eq!(
        run_all(pool, &kind, Budget::default()).await,
        [Outcome::Ended("succeeded")]
    );
    assert_eq!(job(pool, j.id).await.completed_items, 2);
    assert!(ready(&fx).await);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_pageindex_command_starts_shows_and_refuses_with_one_line() {
    let (fx, _) = compiled("pi-cli", 1).await;
    strip(fx.pool(), fx.space, &[]).await;
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"))
            .arg("pageindex")
            .args(args)
            .env("DATABASE_URL", &fx.env.url)
            .output()
            .unwrap()
    };
    let space = fx.space.to_string();
    let out = run(&["start", "--tenant", TENANT, "--space", &space]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let head = fx.head().await.unwrap();
    assert_eq!(v["id"], head.publication_id.to_string());
    assert_eq!(
        (v["runState"].as_str(), v["totalItems"].as_i64()),
        (Some("queued"), Some(1))
    );
    let shown: Value =
        serde_json::from_slice(&run(&["show", "--tenant", TENANT, "--space", &space]).stdout)
            .unwrap();
    assert_eq!(shown, v);

    let before = page_index_rows(fx.pool(), fx.space).await;
    for (args, needle) in [
        (
            vec!["retry", "--tenant", TENANT, "--space", &space],
            "cannot retry from state=queued",
        ),
        (
            vec!["start", "--tenant", TENANT, "--space", "not-a-uuid"],
            "--space \"not-a-uuid\" is not a UUID",
        ),
        (
            vec!["start", "--tenant", "someone-else", "--space", &space],
            "was not found",
        ),
    ] {
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    assert_eq!(page_index_rows(fx.pool(), fx.space).await, before);
    let unchanged = job(fx.pool(), head.publication_id).await;
    assert_eq!(
        (unchanged.run_state.as_str(), unchanged.row_version),
        ("queued", 0)
    );
    fx.cleanup().await;
}

/// A worker aborted right after committing a build (holding the lease) or inside a build's
/// transaction is taken over through its lost liveness lock; another worker finishes the job,
/// and every page-index row exists once, exactly as the compile wrote it.
#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_dying_mid_backfill_is_taken_over_and_each_page_index_is_built_once() {
    use std::os::unix::process::ExitStatusExt;
    // (kill point, builds committed before the takeover). The slice's end shares the last
    // step's transaction, so an abort before it commits loses the cutover, not the builds.
    for (i, (point, built_before_takeover)) in [
        ("leased-after-step-commit:1", 1),
        ("pageindex-before-commit:2", 1),
        ("leased-before-end-commit:1", 3),
    ]
    .into_iter()
    .enumerate()
    {
        let (fx, _) = compiled(&format!("pi-crash-{i}"), 3).await;
        let pool = fx.pool();
        let compiled_rows = page_index_rows(pool, fx.space).await;
        strip(pool, fx.space, &[]).await;
        let j = start(&fx).await.unwrap();
        let env = |id: &str| {
            vec![
                ("KFS_OBJECT_STORE".to_owned(), fx.store_url.clone()),
                ("KFS_WORKER_ID".to_owned(), id.to_owned()),
                ("KFS_LEASED_POLL".to_owned(), "100ms".to_owned()),
            ]
        };
        let spawn = |id: &str, extra: &[(&str, &str)]| {
            let mut e = env(id);
            e.extend(
                extra
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
            );
            let e: Vec<(&str, &str)> = e.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            fx.env.spawn_worker(id, &["run", "--leased"], &e)
        };
        let mut a = spawn("pi-a", &[("KFS_CRASH_AT", point)]);
        let status = a.wait_exit(Duration::from_secs(60)).unwrap_or_else(|| {
            panic!("{point}: worker a reached its kill point\n{}", a.log_text())
        });
        assert_eq!(status.signal(), Some(6), "{point}: {}", a.log_text());
        let held = job(pool, j.id).await;
        assert_eq!(
            (held.run_state.as_str(), held.completed_items),
            ("running", built_before_takeover),
            "{point}: died holding the lease, with only committed builds visible"
        );
        assert_eq!(
            statuses(&page_index_rows(pool, fx.space).await).len(),
            usize::try_from(built_before_takeover).unwrap(),
            "{point}: nothing of an aborted transaction is visible"
        );

        let mut b = spawn("pi-b", &[]);
        let done = fx
            .env
            .wait_until(Duration::from_secs(60), || async {
                job(pool, j.id).await.run_state == "succeeded"
            })
            .await;
        assert!(
            done,
            "{point}: {:?}\n{}",
            job(pool, j.id).await,
            b.log_text()
        );
        assert_eq!(job(pool, j.id).await.completed_items, 3, "{point}");
        assert_eq!(
            page_index_rows(pool, fx.space).await,
            compiled_rows,
            "{point}: each page index built once, as the compile wrote it"
        );
        crate::support::stop_cleanly([&mut b], Duration::from_secs(30)).await;
        fx.cleanup().await;
    }
}
