//! The `kfs-worker compile` command line requests, releases, retries, shows and waits for an
//! attempt, and refuses what it cannot do with a one-line error.

use super::*;

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
