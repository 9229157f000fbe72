//! With `--features crash-points`: a worker killed at each kill point mid-compile has its
//! attempts taken over without waiting for their lease, and every document is published
//! exactly once with exactly its own nodes.

use super::*;

/// Every attempt A held is taken over within this of its death: half the lease, so a
/// takeover that waited for the lease (renewed by A's heartbeats until it died) could not.
const TAKEOVER_BOUND: Duration = Duration::from_secs(30);

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
    let death = Instant::now();
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
    // The attempts A held a lease on when it died, and their lease tokens.
    let (held, tokens): (Vec<Uuid>, Vec<Uuid>) = sqlx::query_as::<_, (Uuid, Uuid)>(
        "SELECT id, lease_token FROM document_compilation_attempts \
         WHERE run_state = 'running' AND split_part(worker_id, '#', 1) = 'a'",
    )
    .fetch_all(fx.pool())
    .await
    .unwrap()
    .into_iter()
    .unzip();
    let started = Instant::now();
    let mut b = spawn("b", None);
    // Taken over: no held attempt still runs under A's lease.
    let pool = fx.pool().clone();
    let taken = fx
        .env
        .wait_until(TAKEOVER_BOUND, || {
            let (pool, held, tokens) = (pool.clone(), held.clone(), tokens.clone());
            async move {
                let still: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM unnest($1::uuid[], $2::uuid[]) AS h(id, token) \
                     JOIN document_compilation_attempts c ON c.id = h.id AND c.lease_token = h.token",
                )
                .bind(&held)
                .bind(&tokens)
                .fetch_one(&pool)
                .await
                .unwrap();
                still == 0
            }
        })
        .await;
    let takeover = death.elapsed();
    assert!(
        taken,
        "the {} attempts A held at its death ({point}) were not taken over within \
         {TAKEOVER_BOUND:?} of it: as if the takeover waited for the 60 s lease\n{}",
        held.len(),
        b.log_text()
    );
    let attempts: Vec<Uuid> = docs.iter().map(|d| d.1).collect();
    let done = wait_terminal(&fx, &attempts, Duration::from_secs(90)).await;
    assert!(
        done,
        "not every attempt ended after A died at {point}: {:?}\n{}",
        states(fx.pool()).await,
        b.log_text()
    );
    println!(
        "[compile crash {point}] at death: {mid:?}; {} held attempts taken over within \
         {:.2}s of the kill; B finished in {:.2}s (lease 60s)",
        held.len(),
        takeover.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    assert_all_published(&fx, &docs).await;
    support::stop_cleanly([&mut b], Duration::from_secs(20)).await;
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
