//! `kfs-worker bench` end to end with tiny numbers: every scenario runs against the real
//! services, reports a well-formed result and finishes all of its work, and removes what it
//! created. No assertion here is about speed.

use std::process::{Command, Output};

use crate::support;

fn bench(args: &[&str]) -> Output {
    bench_with(args, &[])
}

fn bench_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kfs-worker"))
        .arg("bench")
        .args(args)
        .env("DATABASE_URL", support::admin_url())
        .env("AMQP_URL", support::amqp_url())
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .output()
        .expect("run kfs-worker bench")
}

fn num(v: &serde_json::Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {v}"))
}

/// Every run finished all it asked for, in a positive time, at a finite rate.
fn assert_run_complete(v: &serde_json::Value, what: &str) {
    let (n, done, secs, rate) = (num(v, "n"), num(v, "done"), num(v, "secs"), num(v, "rate"));
    assert!(n > 0.0, "{what}: nothing asked: {v}");
    assert_eq!(done, n, "{what}: work left undone: {v}");
    assert!(
        secs > 0.0 && secs.is_finite(),
        "{what}: no time measured: {v}"
    );
    assert!(rate > 0.0 && rate.is_finite(), "{what}: no rate: {v}");
}

fn assert_latency(v: &serde_json::Value, key: &str) {
    let s = &v[key];
    let (p50, p99, max) = (num(s, "p50"), num(s, "p99"), num(s, "max"));
    assert!(
        0.0 <= p50 && p50 <= p99 && p99 <= max,
        "{key}: percentiles out of order: {s}"
    );
}

async fn bench_databases() -> i64 {
    let pool = sqlx::PgPool::connect(&support::admin_url()).await.unwrap();
    let n = sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname LIKE 'kfs_bench_%'")
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    n
}

#[tokio::test]
async fn every_scenario_reports_all_its_work_done() {
    let _services = support::isolation::shared().await;
    let before = bench_databases().await;
    let o = bench(&[
        "--jobs",
        "200",
        "--latency-secs",
        "2",
        "--latency-rate",
        "50",
        "--kind-jobs",
        "4",
        "--fair-backlog",
        "30",
        "--workers",
        "2",
        // The tests beside this one share Postgres' connections: the bench's default depth
        // (64 in flight, a pool of 64 per scenario) is for a machine of its own.
        "--inflight",
        "16",
        "--batch-max",
        "8",
        "--json",
    ]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");

    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let machine = &lines[0]["machine"];
    assert!(num(machine, "cores") >= 1.0, "{machine}");
    assert!(
        machine["postgres"].as_str().is_some_and(|v| v != "unknown"),
        "{machine}"
    );
    assert!(
        machine["rabbitmq"].as_str().is_some_and(|v| v != "unknown"),
        "{machine}"
    );

    let scenario = |name: &str| -> &serde_json::Value {
        let found: Vec<&serde_json::Value> =
            lines.iter().filter(|l| l["scenario"] == name).collect();
        assert_eq!(found.len(), 1, "one result for {name} in: {out}");
        found[0]
    };
    for name in [
        "limit",
        "relay",
        "engine",
        "statements",
        "writes",
        "latency",
        "kinds",
        "fairness",
        "claim",
        "takeover",
        "scaleout",
        "documents",
    ] {
        assert_run_complete(scenario(name), name);
    }
    // The PDF corpus through the local parser and through pdftotext (ops/test installs
    // poppler-utils), both in pages, and compiled: every page of each came through.
    let documents = scenario("documents");
    let labels: Vec<&str> = documents["runs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["label"].as_str())
        .collect();
    assert_eq!(
        labels,
        [
            "local PDF parser",
            "pdftotext (poppler)",
            "compile (local parser)",
            "compile, model-driven (offline model)"
        ],
        "{documents}"
    );
    // The model-driven run asked for windows and summaries, within the per-document budget.
    let calls = &documents["settings"]["model_calls_per_document"];
    assert!(num(calls, "windows") >= 1.0, "{documents}");
    assert!(num(calls, "summaries") >= 1.0, "{documents}");
    assert!(
        num(calls, "most_in_one_document") <= num(calls, "budget_requests_per_document"),
        "{documents}"
    );
    for run in documents["runs"].as_array().unwrap() {
        assert_run_complete(run, "documents");
        assert!(num(run, "n") >= 200.0, "{run}");
    }
    // With the window and without: the second tenant's five and the backlog, each done.
    let fairness = scenario("fairness");
    assert_eq!(
        fairness["runs"].as_array().map(Vec::len),
        Some(4),
        "{fairness}"
    );
    for run in fairness["runs"].as_array().unwrap() {
        assert_run_complete(run, "fairness");
    }
    assert_eq!(num(&fairness["settings"], "backlog"), 30.0, "{fairness}");
    assert_eq!(num(scenario("limit"), "n"), 200.0);
    assert_eq!(num(scenario("engine"), "n"), 200.0);

    let relay = scenario("relay");
    assert_run_complete(&relay["runs"][0], "raw publishes");
    assert_run_complete(&relay["runs"][1], "relay statements alone");
    assert_eq!(num(&relay["runs"][1], "n"), 200.0, "{relay}");
    assert!(num(relay, "ratio") > 0.0, "{relay}");
    // The ceiling comes from the CPU each part used: the relay's statements and the publishes.
    // The machine's busy time counts in 10 ms ticks, and 200 publishes can take less than one,
    // so a part may read 0: then there is no ceiling, never a made-up one.
    let statements_cpu = num(&relay["runs"][1], "cpu_ms");
    let publishes_cpu = num(&relay["runs"][0], "cpu_ms");
    assert!(statements_cpu >= 0.0 && publishes_cpu >= 0.0, "{relay}");
    if statements_cpu + publishes_cpu > 0.0 {
        assert!(num(relay, "ratio_ceiling") > 0.0, "{relay}");
    } else {
        assert!(relay.get("ratio_ceiling").is_none(), "{relay}");
    }

    let engine = scenario("engine");
    assert_eq!(engine["ratio_to"], "limit", "{engine}");
    assert!(num(engine, "ratio") > 0.0, "{engine}");

    let statements = scenario("statements");
    assert_eq!(num(statements, "n"), 200.0, "{statements}");
    assert_eq!(statements["ratio_to"], "limit", "{statements}");
    assert!(num(statements, "ratio") > 0.0, "{statements}");
    assert!(num(statements, "cpu_ms") > 0.0, "{statements}");
    assert!(num(engine, "cpu_ms") > 0.0, "{engine}");
    // The engine's ceiling: the relay's parts and the consumer's statements, over the limit.
    if statements_cpu + publishes_cpu > 0.0 {
        let floor = num(relay, "floor_cpu_ms");
        assert!(
            (floor - (statements_cpu + publishes_cpu)).abs() < 1e-9,
            "{relay}"
        );
        let cores = std::thread::available_parallelism().unwrap().get() as f64;
        let ceiling =
            cores * 1000.0 / (floor + num(statements, "cpu_ms")) / num(scenario("limit"), "rate");
        assert!(
            (num(engine, "ratio_ceiling") - ceiling).abs() < 1e-9,
            "{engine}"
        );
    } else {
        assert!(engine.get("ratio_ceiling").is_none(), "{engine}");
    }

    // The protocol's writes alone: every job given them, and the bound they put on any engine,
    // from their CPU and the raw publishes' in the same run.
    let writes = scenario("writes");
    assert_eq!(num(writes, "n"), 200.0, "{writes}");
    assert_eq!(writes["ratio_to"], "limit", "{writes}");
    assert!(writes.get("ratio").is_none(), "{writes}");
    let writes_cpu = num(writes, "cpu_ms");
    assert!(writes_cpu > 0.0, "{writes}");
    let cores = std::thread::available_parallelism().unwrap().get() as f64;
    let bound = cores * 1000.0 / (writes_cpu + publishes_cpu) / num(scenario("limit"), "rate");
    assert!(
        (num(writes, "ratio_ceiling") - bound).abs() < 1e-9,
        "{writes}"
    );

    let latency = scenario("latency");
    assert_eq!(num(latency, "n"), 100.0, "2 s at 50 jobs/s");
    assert_latency(latency, "to_claim_ms");
    assert_latency(latency, "to_done_ms");
    assert!(
        num(&latency["to_claim_ms"], "p99") <= num(&latency["to_done_ms"], "max"),
        "{latency}"
    );

    let kinds = scenario("kinds");
    let runs = kinds["runs"].as_array().expect("runs");
    let labels: Vec<&str> = runs.iter().filter_map(|r| r["label"].as_str()).collect();
    assert_eq!(labels, ["compile", "research", "deletion"], "{kinds}");
    for r in runs {
        assert_eq!(num(r, "n"), 4.0, "{r}");
        assert_run_complete(r, "kinds");
    }

    // The peer is Celery doing the bare loop's work, from a virtualenv the bench makes. A
    // machine without Python skips it with the reason; CI has Python, so there it must run.
    let peer = scenario("peer");
    if std::env::var("CI").as_deref() == Ok("true") || peer.get("skipped").is_none() {
        assert!(peer.get("skipped").is_none(), "the peer ran: {peer}");
        assert_run_complete(peer, "peer");
        assert_eq!(num(peer, "n"), 200.0, "{peer}");
        assert_eq!(peer["ratio_to"], "limit", "{peer}");
        assert!(
            peer["settings"]["peer"]
                .as_str()
                .is_some_and(|v| v.starts_with("celery 5")),
            "{peer}"
        );
        assert_eq!(peer["settings"]["prefetch_multiplier"], 1, "{peer}");
        assert_eq!(peer["settings"]["acks_late"], true, "{peer}");
    } else {
        assert!(
            peer["skipped"]
                .as_str()
                .is_some_and(|w| w.contains("skipped")),
            "{peer}"
        );
    }

    let scale = scenario("scaleout");
    let runs = scale["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2, "1 and 2 workers: {scale}");
    for r in runs {
        assert_eq!(num(r, "n"), 200.0, "{r}");
        assert_run_complete(r, "scale-out");
    }

    assert_eq!(
        bench_databases().await,
        before,
        "the bench left databases behind"
    );
}

#[test]
fn without_python_the_peer_row_says_so_and_the_bench_still_succeeds() {
    let _services = support::isolation::shared_blocking();
    let venv = std::env::temp_dir().join(format!("kfs-no-venv-{}", uuid::Uuid::new_v4()));
    let o = bench_with(
        &["--jobs", "10", "--scenarios", "peer", "--json"],
        &[
            ("KFS_BENCH_PYTHON", "/nonexistent/python3"),
            ("KFS_BENCH_PEER_VENV", venv.to_str().unwrap()),
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    let peer: serde_json::Value = out
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l["scenario"] == "peer")
        .unwrap_or_else(|| panic!("no peer row in: {out}"));
    let why = peer["skipped"].as_str().unwrap_or_default();
    assert!(
        why.contains("skipped") && why.contains("/nonexistent/python3"),
        "{peer}"
    );
    assert_eq!(num(&peer, "done"), 0.0, "{peer}");
    assert!(!venv.exists(), "no virtualenv was made");
}

#[tokio::test]
async fn the_bulk_scenario_reports_each_uploads_publications_and_the_second_tenant() {
    let _services = support::isolation::shared().await;
    let o = bench(&[
        "--scenarios",
        "bulk",
        "--bulk-sizes",
        "6,12",
        "--inflight",
        "16",
        "--json",
    ]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    let bulk: serde_json::Value = out
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l["scenario"] == "bulk")
        .unwrap_or_else(|| panic!("no bulk row in: {out}"));
    let runs = bulk["runs"].as_array().unwrap();
    assert_eq!(
        runs.len(),
        4,
        "an upload and the second tenant, per size: {bulk}"
    );
    for run in runs {
        assert_run_complete(run, "bulk");
    }
    for (size, n) in [("6", 6.0), ("12", 12.0)] {
        let d = &bulk["settings"]["by_size"][size];
        // Every document's publication was a head once; nothing else was.
        assert!(
            num(d, "head_moves") >= 1.0 && num(d, "head_moves") <= n,
            "{d}"
        );
        assert!(num(d, "member_rows") > 0.0, "{d}");
        assert!(num(d, "candidates_composed") >= num(d, "head_moves"), "{d}");
        assert_eq!(num(&d["second_tenant"], "succeeded"), 5.0, "{d}");
        assert!(d["head_lock_waits"].as_f64().is_some(), "{d}");
    }
}

#[test]
fn an_unknown_scenario_is_one_clear_error() {
    let _services = support::isolation::shared_blocking();
    let o = bench(&["--scenarios", "limit,fastest"]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("--scenarios") && err.contains("unknown scenario 'fastest'"),
        "{err}"
    );
    assert!(o.stdout.is_empty(), "nothing measured");
}
