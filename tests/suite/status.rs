//! `kfs-worker status` and the JSON log format, against the real services.

use std::process::Command;
use std::time::Duration;

use kfs_worker::jobs::probe::{self, ProbeSpec};

use crate::support::{self, TestEnv};

fn status(env: &TestEnv, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kfs-worker"))
        .arg("status")
        .args(args)
        .env("DATABASE_URL", &env.url)
        .env("AMQP_URL", support::amqp_url())
        .env("KFS_QUEUE_PREFIX", &env.prefix)
        .output()
        .expect("run status")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_jobs_outbox_lag_and_dead_letters_as_a_table_and_as_json() {
    let env = TestEnv::new().await;
    probe::enqueue_many(&env.pool, 3, &ProbeSpec::default())
        .await
        .unwrap();
    sqlx::query("UPDATE kfs_probe_outbox SET available_at = now() - interval '30 seconds'")
        .execute(&env.pool)
        .await
        .unwrap();

    let out = status(&env, &["--kinds", "probe,compile"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        table.contains("probe\n  jobs     dispatch_pending=3\n"),
        "{table}"
    );
    assert!(table.contains("  outbox   pending=3\n"), "{table}");
    assert!(
        table.contains("oldest due row waiting 3"),
        "lag of about 30 s: {table}"
    );
    assert!(table.contains("0 messages queued"), "{table}");
    assert!(table.contains("compile\n  jobs     none\n"), "{table}");
    assert!(table.ends_with("dead letters: 0\n"), "{table}");

    let out = status(&env, &["--json", "--kinds", "probe"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["kinds"][0]["kind"], "probe");
    assert_eq!(v["kinds"][0]["jobs"]["dispatch_pending"], 3);
    assert_eq!(v["kinds"][0]["outbox"]["pending"], 3);
    assert!(v["kinds"][0]["oldest_due_seconds"].as_f64().unwrap() >= 29.0);
    assert_eq!(v["dead_letters"], 0);

    let bad = status(&env, &["--kinds", "nope"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&bad.stderr).starts_with("error: --kinds: unknown job kind 'nope'")
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_logs_one_json_object_per_line_when_asked() {
    let env = TestEnv::new().await;
    let mut w = env.spawn_worker(
        "json",
        &["run", "--kinds", "probe", "--worker-id", "json-logs"],
        &[("KFS_LOG_FORMAT", "json"), ("RUST_LOG", "info")],
    );
    probe::enqueue_many(&env.pool, 2, &ProbeSpec::default())
        .await
        .unwrap();
    let done = env.wait_probe_succeeded(2, Duration::from_secs(30)).await;
    assert!(done);
    support::stop_cleanly([&mut w], Duration::from_secs(30)).await;
    let log = w.log_text();
    let lines: Vec<&str> = log.lines().collect();
    assert!(lines.len() >= 3, "{log}");
    for line in lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(
            v.get("level").is_some() && v.get("timestamp").is_some(),
            "{line}"
        );
    }
    assert!(log.contains("\"kfs-worker running\""), "{log}");
    assert!(!log.contains("guest:guest"), "no credentials in logs");
    env.cleanup().await;
}
