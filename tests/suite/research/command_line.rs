//! The command line requests, controls and follows a task, and asks under a grant, refusing
//! both or neither authority.

use super::*;

fn kfs(fx: &SpaceFx, args: &[&str], extra: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"));
    cmd.args(args);
    for (k, v) in fx.env.worker_env() {
        cmd.env(k, v);
    }
    cmd.env_remove("RUST_LOG");
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd.output().expect("run kfs-worker")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_command_line_requests_controls_and_follows_a_task() {
    let s = seed("cli").await;
    let pool = s.pool().clone();
    let (space, snapshot) = (s.space.to_string(), s.snapshot.to_string());
    let out = kfs(
        &s,
        &[
            "research",
            &space,
            QUESTION,
            "--subject",
            SUBJECT,
            "--snapshot",
            &snapshot,
            "--top-k",
            "5",
            "--mode",
            "research",
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id =
        Uuid::parse_str(String::from_utf8_lossy(&out.stdout).trim()).expect("the job id alone");
    let (top_k, mode): (Option<i32>, Option<String>) =
        sqlx::query_as("SELECT top_k, mode FROM research_task_jobs WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((top_k, mode.as_deref()), (Some(5), Some("research")));

    let id_s = id.to_string();
    for (args, stage) in [
        (
            vec!["research", "pause", &id_s, "--reason", "coffee"],
            "paused",
        ),
        (vec!["research", "resume", &id_s], "queued"),
    ] {
        let out = kfs(&s, &args, &[]);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(job(&pool, id).await.stage, stage);
    }
    assert_eq!(events(&pool, id).await[1].4, json!({"reason": "coffee"}));

    // Follow while a worker runs it: every event, in order, one plain line each, then exit.
    let follower = {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"));
        cmd.args(["research", "follow", &id_s, "--poll", "50ms"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        for (k, v) in s.env.worker_env() {
            cmd.env(k, v);
        }
        cmd.spawn().unwrap()
    };
    let e = engine(&pool, "w-cli", extractive());
    assert_eq!(run_until_settled(&s, &e, id).await.stage, "completed");
    let out = tokio::task::spawn_blocking(move || follower.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    let evs = events(&pool, id).await;
    assert_eq!(lines.len(), evs.len(), "{stdout}");
    for (line, ev) in lines.iter().zip(&evs) {
        let f: Vec<&str> = line.split('\t').collect();
        assert_eq!(f[0], ev.0.to_string());
        assert_eq!(f[2], ev.1);
        assert_eq!(f[3], ev.2);
        assert_eq!(serde_json::from_str::<Value>(f[4]).unwrap(), ev.4);
    }

    let out = kfs(&s, &["research", "show", &id_s], &[]);
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["stage"], "completed");
    assert_eq!(shown["answer"].as_str(), answer(&pool, id).await.as_deref());
    assert!(shown["answer"].is_string());
    assert_eq!(shown["evidence"]["traceId"], json!(id_s));
    assert_eq!(shown["publication"]["tenantId"], TENANT);

    // Bad input and refusals: one error line, exit 2, nothing written.
    let jobs_before: i64 = sqlx::query_scalar("SELECT count(*) FROM research_task_jobs")
        .fetch_one(&pool)
        .await
        .unwrap();
    let bad: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "research",
                "not-a-uuid",
                QUESTION,
                "--subject",
                SUBJECT,
                "--snapshot",
                &snapshot,
            ],
            "space id",
        ),
        (
            vec!["research", &space, QUESTION, "--snapshot", &snapshot],
            "--subject",
        ),
        (
            vec![
                "research",
                &space,
                QUESTION,
                "--subject",
                SUBJECT,
                "--snapshot",
                &snapshot,
                "--budget-usd",
                "lots",
            ],
            "--budget-usd",
        ),
        (
            vec![
                "research",
                &space,
                QUESTION,
                "--subject",
                "mallory",
                "--snapshot",
                &snapshot,
            ],
            "another subject",
        ),
        (vec!["research", "cancel", &id_s], "already ended"),
        (vec!["research", "pause", "nope"], "job id"),
    ];
    for (args, needle) in bad {
        let out = kfs(&s, &args, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.starts_with("error: ") && err.contains(needle),
            "{args:?}: {err}"
        );
    }
    let jobs_after: i64 = sqlx::query_scalar("SELECT count(*) FROM research_task_jobs")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(jobs_before, jobs_after);

    // A malformed generator setting stops a worker at start, naming the variable.
    let out = kfs(
        &s,
        &["run", "--kinds", "research"],
        &[
            ("KFS_GENERATOR", "openai"),
            ("KFS_OPENAI_API_KEY", "sk-never-printed"),
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("KFS_OPENAI_MODEL"), "{err}");
    assert!(!err.contains("sk-never-printed"), "{err}");
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_command_line_asks_under_a_grant_and_refuses_both_or_neither_authority() {
    let fx = SpaceFx::new(TENANT, "cli-grant", "Docs").await;
    let pool = fx.pool().clone();
    let snapshot = fx.snapshot(SUBJECT).await.to_string();
    let g = grant(&fx, fx.space, "app-user-7", &[]).await;
    let (space, g_s) = (fx.space.to_string(), g.to_string());
    let out = kfs(&fx, &["research", &space, QUESTION, "--grant", &g_s], &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id =
        Uuid::parse_str(String::from_utf8_lossy(&out.stdout).trim()).expect("the job id alone");
    assert_eq!(binding(&pool, id).await, (Some(g), None, None, None, None));
    let shown: Value =
        serde_json::from_slice(&kfs(&fx, &["research", "show", &id.to_string()], &[]).stdout)
            .unwrap();
    assert_eq!(shown["capabilityGrantId"], json!(g));
    assert_eq!(shown["subjectId"], Value::Null);

    let revoked = grant(&fx, fx.space, "app-user-7", &[]).await;
    let mut conn = pool.acquire().await.unwrap();
    platform::revoke_capability_grant(&mut conn, TENANT, fx.space, revoked)
        .await
        .unwrap();
    drop(conn);
    let revoked = revoked.to_string();
    let bad: Vec<(Vec<&str>, &str)> =
        vec![
        (
            vec![
                "research", &space, QUESTION, "--grant", &g_s, "--subject", SUBJECT, "--snapshot",
                &snapshot,
            ],
            "exactly one authority: --subject <s> --snapshot <id>, or --grant <id>; --grant cannot",
        ),
        (
            vec!["research", &space, QUESTION],
            "exactly one authority: --subject <s> --snapshot <id>, or --grant <id>; none",
        ),
        (
            vec!["research", &space, QUESTION, "--grant", &g_s, "--channel", "mcp"],
            "--channel",
        ),
        (vec!["research", &space, QUESTION, "--grant", "g-1"], "--grant must be a UUID"),
        (vec!["research", &space, QUESTION, "--grant", &revoked], "is revoked"),
    ];
    for (args, needle) in bad {
        let out = kfs(&fx, &args, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.starts_with("error: ") && err.contains(needle),
            "{args:?}: {err}"
        );
    }
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM research_task_jobs")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(jobs, 1, "refusals wrote nothing");
    fx.cleanup().await;
}
