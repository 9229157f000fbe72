//! `kfs-worker demo`, run non-interactively as a newcomer would, twice in a row.

use std::process::Command;

use crate::support::{self, TestEnv};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_runs_to_its_summary_with_every_job_succeeded_and_can_run_again() {
    let env = TestEnv::new().await;
    let store = std::env::temp_dir().join(format!("{}-objects", env.db_name));
    let logs = std::env::temp_dir().join(format!("{}-demo-logs", env.db_name));
    for run in 1..=2 {
        let out = Command::new(env!("CARGO_BIN_EXE_kfs-worker"))
            .args(["demo", "--no-wait", "--log-dir", logs.to_str().unwrap()])
            .env("DATABASE_URL", &env.url)
            .env("AMQP_URL", support::amqp_url())
            .env("KFS_QUEUE_PREFIX", &env.prefix)
            .env("KFS_OBJECT_STORE", format!("file://{}", store.display()))
            // demo-a starts consuming 3 s after demo-b, as a slow first start on a fresh
            // machine did: the kill must still find demo-a holding jobs.
            .env("KFS_DELAY_AT", "consumer-start@demo-a=3000")
            .output()
            .expect("run the demo");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "run {run} failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
        );
        for needle in [
            "== Summary",
            "all jobs succeeded",
            "deletion  succeeded=1",
            "compile   succeeded=8",
            "model-driven space (kfs-demo-reasoner, the offline reasoning model): ",
            "  a section summary: ",
            "  entities: ",
            "research  completed=2",
            "ready dense-vector projections (dimension 64)",
            "deletion of source \"notes\" (succeeded):",
            "documents left in the space: 5 of 7",
            "takeover: demo-a was killed holding",
            "; demo-b took over in ",
            "stopped demo-b (exit 0)",
            "dashboard: http://127.0.0.1:",
            "metrics:   http://127.0.0.1:",
        ] {
            assert!(
                stdout.contains(needle),
                "run {run}: missing {needle:?} in\n{stdout}"
            );
        }
        // Seven documents published, by at most seven head moves: documents ready together
        // publish in one.
        let revision = stdout
            .lines()
            .find_map(|l| l.strip_prefix("read model: head revision "))
            .and_then(|r| r.split_once(", 7 documents,"))
            .and_then(|(r, _)| r.parse::<i32>().ok());
        assert!(
            revision.is_some_and(|r| (1..=7).contains(&r)),
            "run {run}: no read model of 7 documents by 1 to 7 head moves in\n{stdout}"
        );
        assert!(
            !stdout.contains("holding 0 job(s)"),
            "run {run}: the kill found demo-a holding nothing\n{stdout}"
        );
        // Both answers cite the documents they came from.
        let cites: Vec<&str> = stdout
            .lines()
            .filter(|l| l.trim_start().starts_with("cites:"))
            .collect();
        assert_eq!(cites.len(), 2, "{stdout}");
        assert!(cites.iter().all(|l| !l.contains("nothing")), "{stdout}");
        // Keys of deleted items are redacted: the two documents' bytes and the source's secret.
        assert!(
            stdout.contains("object            2 removed, 2 keys redacted"),
            "{stdout}"
        );
        assert!(
            stdout.contains("secret_ref        1 removed, 1 keys redacted"),
            "{stdout}"
        );
    }
    // The second run reset the first: the two spaces, the five documents left in the first
    // and the one of the model-driven space, and their bytes only.
    let spaces: i64 =
        sqlx::query_scalar("SELECT count(*) FROM knowledge_spaces WHERE tenant_id = 'kfs-demo'")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(spaces, 2);
    let files = walk(&store);
    assert_eq!(files, 6, "object files left: {files}");
    let _ = std::fs::remove_dir_all(&store);
    let _ = std::fs::remove_dir_all(&logs);
    env.cleanup().await;
}

fn walk(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| {
                    if e.path().is_dir() {
                        walk(&e.path())
                    } else {
                        1
                    }
                })
                .sum()
        })
        .unwrap_or(0)
}
