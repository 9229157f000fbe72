//! The relay's poll: a row coming due is polled while another kind has steady traffic, and a
//! failed declare at the poll lets the rounds in flight settle what they claimed.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_coming_due_is_polled_while_another_kind_has_steady_traffic() {
    let env = TestEnv::new().await;
    let (attempt, deletion, research) = platform_jobs(&env.pool).await;
    // Only the research row matters: it comes due 2 s from now, and nothing notifies then.
    for (table, fk, id) in [
        ("document_compilation_outbox", "attempt_id", attempt),
        ("deletion_outbox", "deletion_job_id", deletion),
    ] {
        sqlx::query(&format!("DELETE FROM {table} WHERE {fk} = $1"))
            .bind(id)
            .execute(&env.pool)
            .await
            .unwrap();
    }
    let due_ms: i64 = sqlx::query_scalar(
        "UPDATE research_task_outbox SET available_at = (extract(epoch FROM now()) * 1000)::bigint + 2000 \
         WHERE research_task_job_id = $1 RETURNING available_at",
    )
    .bind(research)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    let poll_ms = 1000_i64;
    let mut relay = env.spawn_worker(
        "relay-poll",
        &["run", "--relay"],
        &[("KFS_KINDS", "probe,research"), ("KFS_RELAY_POLL", "1s")],
    );
    // Probe rows arrive every 300 ms, each notifying, until 5 poll periods after the due time.
    let mut dispatched: Option<i64> = None;
    loop {
        enqueue_one(&env.pool, &ProbeSpec::default()).await;
        let (status, at, now): (String, i64, i64) = sqlx::query_as(
            "SELECT status::text, updated_at, (extract(epoch FROM now()) * 1000)::bigint \
             FROM research_task_outbox WHERE research_task_job_id = $1",
        )
        .bind(research)
        .fetch_one(&env.pool)
        .await
        .unwrap();
        if status == "dispatched" {
            dispatched = Some(at);
            break;
        }
        if now > due_ms + 5 * poll_ms {
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let published = env
        .queue_depth(env.topology.queue(Kind::Probe).as_str())
        .await;
    relay.kill();
    let Some(at) = dispatched else {
        panic!(
            "the research row due at {due_ms} was not published within 5 poll periods while probe \
             traffic went on ({published} probe messages published meanwhile)\n{}",
            relay.tail(30)
        );
    };
    println!("[relay poll] published {} ms after coming due", at - due_ms);
    assert!(published > 0, "the probe traffic was relayed");
    assert!(
        at - due_ms <= 3 * poll_ms,
        "published {} ms after coming due: the poll is a fixed {poll_ms} ms interval",
        at - due_ms
    );
    env.cleanup().await;
}

/// Whether `queue` exists (a passive declare, on a channel of its own: a failed one closes it).
async fn queue_exists(env: &TestEnv, queue: &str) -> bool {
    env.channel()
        .await
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .is_ok()
}

/// A relay session whose poll finds its kind's queue gone (the passive declare that counts an
/// `auto` window's consumers fails) starts no new round, but its rounds in flight still settle
/// what they claimed before the session ends with the error: a round held before its mark
/// while the declare fails marks its rows once it goes on. Ended at once, the session dropped
/// that round and left its rows `dispatching` until their lock ran out, ten minutes here.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_declare_at_the_poll_lets_the_rounds_in_flight_settle_what_they_claimed() {
    let env = TestEnv::new().await;
    let mut rows = Vec::new();
    for _ in 0..3 {
        rows.push(enqueue_one(&env.pool, &ProbeSpec::default()).await.1);
    }
    Gate::install(&env).await;
    // The worker's sessions are named `kfs-worker <worker id>`.
    let gate = Gate::close(&env, "kfs-worker kfs-test-gate-declare").await;
    let poll = Duration::from_millis(50);
    let opts = kfs_worker::runtime::RunOptions {
        worker_id: "kfs-test-gate-declare".into(),
        consumer: false,
        maintenance: false,
        relay_cfg: RelayConfig {
            lock_ttl: Duration::from_secs(600),
            poll,
            // One round in flight: the one the gate holds.
            depth: 1,
            // An `auto` window: the poll counts the queue's consumers with a passive declare.
            windows: kfs_worker::relay::window::Windows {
                default: kfs_worker::relay::window::Size::Auto { per_consumer: 64 },
                per_kind: std::collections::BTreeMap::new(),
            },
            ..cfg()
        },
        ..crate::engine::options(&env, "kfs-test-gate-declare")
    };
    let stop = CancellationToken::new();
    let worker = tokio::spawn(kfs_worker::runtime::run(opts, stop.clone()));

    // The round claimed the three rows, published them and got its confirms; it waits to mark.
    gate.wait_until_held(&env).await;
    for &id in &rows {
        let row = outbox_state(&env.pool, id).await;
        assert_eq!(row.status, "dispatching", "{row:?}");
    }
    let queue = env.topology.queue(Kind::Probe);
    assert_eq!(env.queue_depth(&queue).await, 3, "the held round published");

    // The queue goes; the session's next poll fails its passive declare while the round waits.
    // Nothing outside the relay shows that poll, so twenty of its periods pass before the gate
    // opens (too few, and the round would settle before the poll, whatever the session does).
    env.channel()
        .await
        .queue_delete(
            queue.as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await
        .expect("delete the probe queue");
    tokio::time::sleep(poll * 20).await;

    gate.open().await;
    let states = || async {
        let mut out = Vec::new();
        for &id in &rows {
            let row = outbox_state(&env.pool, id).await;
            out.push((row.status, row.lock_cleared));
        }
        out
    };
    let settled = env
        .wait_until(HANG, || async {
            states().await.iter().all(|(s, _)| s != "dispatching")
        })
        .await;
    assert!(
        settled,
        "the rows the held round claimed are still dispatching under its lock: {:?}",
        states().await
    );
    assert_eq!(
        states().await,
        vec![("dispatched".to_owned(), true); 3],
        "the round marked what the broker had confirmed"
    );
    // Then the session ended with the error, and the next one declared the queue again.
    assert!(
        env.wait_until(HANG, || queue_exists(&env, &queue)).await,
        "the relay never declared the probe queue again"
    );

    stop.cancel();
    tokio::time::timeout(HANG, worker)
        .await
        .expect("the worker stopped")
        .unwrap()
        .unwrap();
    env.cleanup().await;
}
