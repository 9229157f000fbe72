//! Jobs flow through a whole runtime from the outbox to their end, poison goes to the
//! dead-letter queue, retention deletes only old finished outbox rows, and the relay publishes
//! by polling when its listener never comes up.

use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jobs_flow_from_outbox_to_success_and_poison_goes_to_the_dead_letter_queue() {
    let env = TestEnv::new().await;
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(runtime::run(options(&env, "engine-e2e"), shutdown.clone()));

    probe::enqueue_many(
        &env.pool,
        200,
        &ProbeSpec {
            steps: 3,
            ..ProbeSpec::default()
        },
    )
    .await
    .unwrap();

    // A flood of undecodable messages on the live queue, interleaved with the real jobs.
    let ch = env.channel().await;
    let queue = env.topology.queue(Kind::Probe);
    let outbox_before: i64 = sqlx::query_scalar("SELECT count(*) FROM kfs_probe_outbox")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    let bodies: [&[u8]; 4] = [b"not json", b"{}", b"[1]", br#"{"probeJobId":"nope"}"#];
    for i in 0..200 {
        let mut headers = FieldTable::default();
        if i % 2 == 0 {
            headers.insert("x-kfs-schema-version".into(), AMQPValue::LongInt(1));
        }
        ch.basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            bodies[i % bodies.len()],
            BasicProperties::default()
                .with_message_id(format!("poison-{i}").into())
                .with_headers(headers),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }

    let done = env.wait_probe_succeeded(200, Duration::from_secs(60)).await;
    assert!(done, "jobs: {:?}", support::probe_states(&env.pool).await);
    support::assert_probe_invariants(&env.pool).await;

    let dlq = env.topology.dead_letter_queue();
    let dead_lettered = env
        .wait_until(Duration::from_secs(10), || async {
            env.queue_depth(&dlq).await == 200
        })
        .await;
    assert!(
        dead_lettered,
        "dead-letter queue holds {} of 200",
        env.queue_depth(&dlq).await
    );
    // The poison touched nothing: no row appeared, and every job is in the state its own work left.
    let outbox_after: i64 = sqlx::query_scalar("SELECT count(*) FROM kfs_probe_outbox")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(outbox_after, outbox_before);
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM kfs_probe_jobs")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(jobs, 200);

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(20), worker)
        .await
        .expect("shutdown within bound")
        .unwrap()
        .unwrap();
    assert_eq!(env.queue_depth(&queue).await, 0, "queue drained");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_old_finished_outbox_rows_in_batches_and_keeps_dead_and_recent_ones() {
    let env = TestEnv::new().await;
    probe::enqueue_many(&env.pool, 8, &ProbeSpec::default())
        .await
        .unwrap();
    // Six finished long ago (four completed, two canceled), one dead long ago, one completed now.
    sqlx::query(
        "WITH o AS (SELECT id, row_number() OVER (ORDER BY id) AS n FROM kfs_probe_outbox) \
         UPDATE kfs_probe_outbox p SET \
           status = CASE WHEN o.n <= 4 THEN 'completed' WHEN o.n <= 6 THEN 'canceled' WHEN o.n = 7 THEN 'dead' ELSE 'completed' END, \
           updated_at = CASE WHEN o.n <= 7 THEN now() - interval '8 days' ELSE now() END \
         FROM o WHERE p.id = o.id",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    let week = Duration::from_secs(7 * 24 * 3600);
    let first = kfs_worker::maintenance::retention_once(&env.pool, Kind::Probe, week, 4)
        .await
        .unwrap();
    assert_eq!(first, 4, "one batch at a time");
    let second = kfs_worker::maintenance::retention_once(&env.pool, Kind::Probe, week, 4)
        .await
        .unwrap();
    assert_eq!(second, 2);
    let third = kfs_worker::maintenance::retention_once(&env.pool, Kind::Probe, week, 4)
        .await
        .unwrap();
    assert_eq!(third, 0);
    let left: Vec<(String,)> =
        sqlx::query_as("SELECT status FROM kfs_probe_outbox ORDER BY status")
            .fetch_all(&env.pool)
            .await
            .unwrap();
    assert_eq!(
        left,
        vec![("completed".to_owned(),), ("dead".to_owned(),)],
        "the recent row and the dead row stay"
    );
    env.cleanup().await;
}

/// The relay's listener is set up beside its rounds, never before them. Its connection comes
/// from the pool, and past Postgres' connection limit the pool may wait up to its acquire
/// timeout for a session; meanwhile the relay must publish by polling. Here the listener's
/// setup never ends at all (a stall point), and the jobs enqueued after it began must still run.
#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_listener_never_comes_up_publishes_by_polling() {
    let env = TestEnv::new().await;
    let mut w = env.spawn_worker(
        "deaf",
        &["run", "--kinds", "probe", "--worker-id", "deaf"],
        &[("KFS_STALL_AT", "relay-listen")],
    );
    let stalled = env
        .wait_until(Duration::from_secs(30), || async {
            w.log_text().contains("stall point relay-listen reached")
        })
        .await;
    assert!(stalled, "the listener's setup never began:\n{}", w.tail(20));
    probe::enqueue_many(&env.pool, 20, &ProbeSpec::default())
        .await
        .unwrap();
    let done = env.wait_probe_succeeded(20, Duration::from_secs(60)).await;
    assert!(
        done,
        "jobs stayed unpublished while the listener was stalled: {:?}\n{}",
        support::probe_states(&env.pool).await,
        w.tail(20)
    );
    support::stop_cleanly([&mut w], Duration::from_secs(30)).await;
    support::assert_probe_invariants(&env.pool).await;
    env.cleanup().await;
}
