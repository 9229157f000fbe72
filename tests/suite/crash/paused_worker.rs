//! SIGSTOP / SIGCONT: a worker paused past its lease is taken over, and when it wakes it is
//! fenced out: none of its late writes lands and nothing runs twice.

use super::*;

/// (application, state, wait event type, query, blocked by)
type Session = (String, String, Option<String>, Option<String>, Vec<i32>);
/// (status, available_at, dispatch_attempts, delivered_at)
type OutboxState = (String, DateTime<Utc>, i32, Option<DateTime<Utc>>);

/// Field order matters: the workers are dropped (killed) before the environment is removed.
struct Stopped {
    a: Worker,
    b: Worker,
    token_a: Uuid,
    expires_a: DateTime<Utc>,
    stopped_at: DateTime<Utc>,
    /// B's first claim of the job, if it came while A was still stopped.
    claim_b_while_stopped: Option<DateTime<Utc>>,
    diagnostics: String,
    env: TestEnv,
}

/// Worker A runs one long job (6 steps of 1 s, the sleep inside the step's transaction as a
/// slow handler's I/O would be) under a 3 s lease, and is SIGSTOPped in its second step. Its
/// liveness lock stays held (its Postgres session is alive), so B may only take the job over
/// once the lease expired. Waits up to `wait` for B's claim while A is stopped.
async fn stop_a_and_start_b(wait: Duration) -> Stopped {
    let env = TestEnv::new().await;
    install_claim_log(&env.pool).await;
    probe::enqueue_many(&env.pool, 1, &probe_spec(6, 1000))
        .await
        .unwrap();
    let short = base_env("probe=3s");
    let a = spawn(&env, "a", &[], &short);

    let pool = env.pool.clone();
    let running = env
        .wait_until(Duration::from_secs(20), || {
            let pool = pool.clone();
            async move {
                count(
                    &pool,
                    "SELECT count(*) FROM kfs_probe_effects WHERE split_part(worker_id, '#', 1) = 'a'",
                )
                .await
                    >= 1
            }
        })
        .await;
    assert!(running, "A never ran a step\n{}", a.tail(30));
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.signal("STOP");
    let stopped_at = db_now(&env.pool).await;
    // Let statements A had already sent finish, then read the lease A is left with.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (token_a, expires_a): (Uuid, DateTime<Utc>) = sqlx::query_as(
        "SELECT lease_token, lease_expires_at FROM kfs_probe_jobs WHERE split_part(worker_id, '#', 1) = 'a' AND run_state = 'running'",
    )
    .fetch_one(&env.pool)
    .await
    .expect("A holds the job when it is stopped");
    let b = spawn(&env, "b", &[], &short);

    let pool = env.pool.clone();
    let taken = env
        .wait_until(wait, || {
            let pool = pool.clone();
            async move {
                count(
                    &pool,
                    "SELECT count(*) FROM crash_claims WHERE split_part(worker_id, '#', 1) = 'b'",
                )
                .await
                    >= 1
            }
        })
        .await;
    let claim_b: Option<DateTime<Utc>> = sqlx::query_scalar(
        "SELECT min(at) FROM crash_claims WHERE split_part(worker_id, '#', 1) = 'b'",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    // Who holds what while A is stopped: A's sessions, and B's sessions waiting on a lock.
    let sessions: Vec<Session> = sqlx::query_as(
        "SELECT application_name, state, wait_event_type, left(query, 70), pg_blocking_pids(pid) \
         FROM pg_stat_activity WHERE datname = current_database() AND application_name IN ('kfs-worker a', 'kfs-worker b') \
           AND (application_name = 'kfs-worker a' OR wait_event_type = 'Lock') ORDER BY 1",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    // Is the job row locked by A's open step transaction (which any claim would wait for)?
    let mut probe_tx = env.pool.begin().await.unwrap();
    let row_locked = sqlx::query("SELECT 1 FROM kfs_probe_jobs FOR UPDATE NOWAIT")
        .execute(&mut *probe_tx)
        .await
        .is_err();
    drop(probe_tx);
    let outbox: Vec<OutboxState> = sqlx::query_as(
        "SELECT status, available_at, dispatch_attempts, delivered_at FROM kfs_probe_outbox",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let diagnostics = format!(
        "A stopped at {stopped_at}, A's lease expired at {expires_a}; job row locked by A's open \
         transaction: {row_locked}; outbox (status, available_at, \
         dispatch_attempts, delivered_at): {outbox:?}; sessions while A is stopped \
         (application, state, wait, query, blocked by): {sessions:?}\n{}",
        b.tail(20)
    );
    Stopped {
        env,
        a,
        b,
        token_a,
        expires_a,
        stopped_at,
        claim_b_while_stopped: if taken { claim_b } else { None },
        diagnostics,
    }
}

/// After SIGCONT: waits for the job to end and for A to notice, stops both workers (exit 0),
/// and checks the history. Returns A's effects written at or after its lease expired.
async fn wake_a_and_finish(s: &mut Stopped) -> Vec<(i32, DateTime<Utc>)> {
    s.a.signal("CONT");
    let done = wait_all_terminal(&s.env, Duration::from_secs(30)).await;
    assert!(
        done,
        "job not terminal: {:?}\n{}\n{}",
        support::probe_states(&s.env.pool).await,
        s.a.tail(20),
        s.b.tail(20)
    );
    let start = Instant::now();
    while !s.a.log_text().contains("lease lost") && start.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        s.a.log_text().contains("lease lost"),
        "A's log does not report the lost lease\n{}",
        s.a.tail(30)
    );
    // The takeover: the first new lease of the job after A was stopped (B's, or A's own second
    // delivery once awake; either way A's first lease is over).
    let (taker, claim_b): (String, DateTime<Utc>) = sqlx::query_as(
        "SELECT worker_id, at FROM crash_claims WHERE lease_token <> $1 AND at > $2 ORDER BY id LIMIT 1",
    )
    .bind(s.token_a)
    .bind(s.stopped_at)
    .fetch_one(&s.env.pool)
    .await
    .expect("the job was claimed again after A's stop");
    assert!(
        claim_b >= s.expires_a,
        "{taker} claimed at {claim_b}, before A's live lease expired at {}",
        s.expires_a
    );
    let late_a: Vec<(i32, DateTime<Utc>)> =
        sqlx::query_as("SELECT step, created_at FROM kfs_probe_effects WHERE lease_token = $1 AND created_at >= $2 ORDER BY id")
            .bind(s.token_a)
            .bind(s.expires_a)
            .fetch_all(&s.env.pool)
            .await
            .unwrap();
    let steps_a = count(
        &s.env.pool,
        "SELECT count(*) FROM kfs_probe_effects WHERE split_part(worker_id, '#', 1) = 'a'",
    )
    .await;
    let steps_b = count(
        &s.env.pool,
        "SELECT count(*) FROM kfs_probe_effects WHERE split_part(worker_id, '#', 1) = 'b'",
    )
    .await;
    println!(
        "[sigstop] lease=3s a_steps={steps_a} b_steps={steps_b} stop->lease_expiry_ms={:.0} stop->takeover_ms={:.0} \
         taken_over_by={taker} taken_over_while_a_stopped={} a_writes_after_its_lease_expired={late_a:?}",
        ms(s.expires_a - s.stopped_at),
        ms(claim_b - s.stopped_at),
        s.claim_b_while_stopped.is_some(),
    );
    support::stop_cleanly([&mut s.a, &mut s.b], Duration::from_secs(20)).await;
    assert_history(&s.env.pool).await;
    assert_no_overlap(&s.env.pool, "a", "b").await;
    let depths = wait_queues_drained(&s.env, Duration::from_secs(5)).await;
    assert_eq!(depths, (0, 0), "queues not drained");
    late_a
}

/// The full contract of a paused worker: B takes the job over while A is still stopped (after
/// A's lease expired), and A, woken up, finds every write refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstopped_worker_is_taken_over_and_every_late_write_is_refused() {
    let _serial = SERIAL.lock().await;
    let mut s = stop_a_and_start_b(Duration::from_secs(20)).await;
    if s.claim_b_while_stopped.is_none() {
        s.a.signal("CONT");
        panic!(
            "B did not take the job over within 20 s while A was stopped. {}",
            s.diagnostics
        );
    }
    // Let B run a step, then wake A up.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let late_a = wake_a_and_finish(&mut s).await;
    assert!(
        late_a.is_empty(),
        "A wrote after its lease expired at {} (step, at): {late_a:?}",
        s.expires_a
    );
    let Stopped { env, a, b, .. } = s;
    drop((a, b));
    env.cleanup().await;
}

/// What holds today for a paused worker: whenever the takeover happens, nothing runs twice, A's
/// lease is never overlapped by B's, A reports the lost lease, and the job succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstopped_worker_wakes_up_fenced_out_and_nothing_runs_twice() {
    let _serial = SERIAL.lock().await;
    // Wait past A's lease expiry (at most 3 s after the stop) before waking A up.
    let mut s = stop_a_and_start_b(Duration::from_secs(5)).await;
    if s.claim_b_while_stopped.is_none() {
        println!(
            "[sigstop] no takeover while A was stopped. {}",
            s.diagnostics
        );
    }
    wake_a_and_finish(&mut s).await;
    let Stopped { env, a, b, .. } = s;
    drop((a, b));
    env.cleanup().await;
}
