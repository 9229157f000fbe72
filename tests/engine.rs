//! End to end through real Postgres and RabbitMQ: the whole protocol in one process.

mod common;

use std::time::Duration;

use common::TestEnv;
use kfs_worker::consumer::ConsumerConfig;
use kfs_worker::jobs::probe::{self, ProbeSpec};
use kfs_worker::jobs::Kind;
use kfs_worker::maintenance::MaintenanceConfig;
use kfs_worker::relay::RelayConfig;
use kfs_worker::runtime::{self, RunOptions};
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use tokio_util::sync::CancellationToken;

fn options(env: &TestEnv, worker: &str) -> RunOptions {
    RunOptions {
        services: env.services(),
        object_store: kfs_worker::config::object_store("memory://").unwrap(),
        worker_id: worker.into(),
        kinds: vec![Kind::Probe],
        relay: true,
        consumer: true,
        maintenance: true,
        relay_cfg: RelayConfig {
            poll: Duration::from_millis(200),
            ..RelayConfig::default()
        },
        consumer_cfg: ConsumerConfig::default(),
        maintenance_cfg: MaintenanceConfig::default(),
        http_addr: None,
    }
}

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

    let pool = env.pool.clone();
    let done = env
        .wait_until(Duration::from_secs(60), || {
            let pool = pool.clone();
            async move {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM kfs_probe_jobs WHERE run_state = 'succeeded'",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                n == 200
            }
        })
        .await;
    assert!(done, "jobs: {:?}", common::probe_states(&env.pool).await);
    common::assert_probe_invariants(&env.pool).await;

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
