//! Real `kfs-worker run` processes: one runs both leased kinds and `status` shows them, and a
//! worker SIGKILLed or aborted at a crash point mid-job is taken over and the job finishes.

use super::*;

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
