//! The consumer session of a running worker process: every kind it serves keeps a consumer,
//! readiness says when one has none, and no delivery is ever left unsettled.

use std::time::Duration;

use kfs_worker::jobs::probe::ProbeSpec;
use kfs_worker::jobs::Kind;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;

use crate::support::{self, free_port, http_get as get, TestEnv, Worker};

/// Spawns `kfs-worker run` for `kinds` with the given role flags, serving HTTP on `addr`.
fn spawn(
    env: &TestEnv,
    id: &str,
    roles: &[&str],
    kinds: &str,
    addr: std::net::SocketAddr,
    extra: &[(&str, &str)],
) -> Worker {
    let mut args = vec!["run", "--kinds", kinds, "--worker-id", id];
    args.extend_from_slice(roles);
    let bind = addr.to_string();
    let mut vars = vec![
        ("KFS_HTTP_ADDR", bind.as_str()),
        ("KFS_RELAY_POLL", "200ms"),
        ("KFS_SHUTDOWN_GRACE", "5s"),
    ];
    vars.extend_from_slice(extra);
    env.spawn_worker(id, &args, &vars)
}

/// Enqueues one probe job and waits until it succeeded.
async fn a_probe_job_runs(env: &TestEnv, within: Duration) -> bool {
    let before = support::probe_succeeded(&env.pool).await;
    support::enqueue_one(&env.pool, &ProbeSpec::default()).await;
    env.wait_probe_succeeded(before + 1, within).await
}

/// A worker consuming two kinds loses one kind's consumer: the broker cancels it because its
/// queue was deleted, and a queue of the same name that the worker cannot use (a classic
/// queue where the topology declares a quorum queue) keeps it from coming back for as long as
/// the test wants. Meanwhile `/readyz` must say not ready, while the other kind keeps its
/// consumer; once the queue can be declared again the kind is consumed again (a job of it runs
/// to success) and the worker is ready again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kind_whose_consumer_the_broker_cancelled_is_consumed_again_and_not_ready_meanwhile() {
    let env = TestEnv::new().await;
    let kinds = "probe,compile";
    let mut relay = spawn(&env, "relay", &["--relay"], kinds, free_port(), &[]);
    let addr = free_port();
    let mut worker = spawn(&env, "consumer", &["--consumer"], kinds, addr, &[]);
    let probe_queue = env.topology.queue(Kind::Probe);
    let compile_queue = env.topology.queue(Kind::Compile);

    let ready = env
        .wait_until(Duration::from_secs(30), || async {
            get(addr, "/readyz").await.0 == 200
        })
        .await;
    assert!(ready, "the worker never became ready\n{}", worker.tail(30));
    for q in [&probe_queue, &compile_queue] {
        assert_eq!(env.queue_counts(q).await.map(|c| c.1), Some(1), "{q}");
    }
    assert!(
        a_probe_job_runs(&env, Duration::from_secs(30)).await,
        "a probe job did not run before anything happened\n{}",
        worker.tail(30)
    );

    // Delete the probe queue (the broker cancels the worker's consumer) and put a queue the
    // worker cannot declare in its place. Should the worker declare its queue again before the
    // test does, that declare wins: delete it again.
    let mut blocked = false;
    for _ in 0..20 {
        let ch = env.channel().await;
        ch.queue_delete(probe_queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .expect("delete the probe queue");
        let ch = env.channel().await;
        if ch
            .queue_declare(
                probe_queue.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .is_ok()
        {
            blocked = true;
            break;
        }
    }
    assert!(blocked, "could not take the probe queue's place");

    let not_ready = env
        .wait_until(Duration::from_secs(30), || async {
            get(addr, "/readyz").await.0 == 503
        })
        .await;
    assert!(
        not_ready,
        "/readyz stayed ready for 30 s while the probe kind had no consumer: {:?}\n{}",
        get(addr, "/readyz").await,
        worker.tail(30)
    );
    assert_eq!(
        env.queue_counts(&compile_queue).await.map(|c| c.1),
        Some(1),
        "the other kind lost its consumer\n{}",
        worker.tail(30)
    );

    // The queue can be declared again: the kind's consumer comes back.
    let ch = env.channel().await;
    ch.queue_delete(probe_queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .expect("delete the blocking queue");
    let back = env
        .wait_until(Duration::from_secs(30), || async {
            get(addr, "/readyz").await.0 == 200
                && env.queue_counts(&probe_queue).await.map(|c| c.1) == Some(1)
        })
        .await;
    assert!(
        back,
        "the probe kind was not consumed again within 30 s: readyz {:?}, probe consumers {:?}\n{}",
        get(addr, "/readyz").await,
        env.queue_counts(&probe_queue).await.map(|c| c.1),
        worker.tail(30)
    );
    assert!(
        a_probe_job_runs(&env, Duration::from_secs(30)).await,
        "a probe job did not run after the kind's consumer came back: {:?}\n{}",
        support::probe_states(&env.pool).await,
        worker.tail(30)
    );
    assert_eq!(env.queue_counts(&compile_queue).await.map(|c| c.1), Some(1));
    support::stop_cleanly([&mut worker, &mut relay], Duration::from_secs(30)).await;
    env.cleanup().await;
}

/// (run_state, execution_attempts, last_error_code, last_error_message) of a probe job.
async fn probe_row(
    env: &TestEnv,
    job: uuid::Uuid,
) -> (String, i32, Option<String>, Option<String>) {
    sqlx::query_as(
        "SELECT run_state, execution_attempts, last_error_code, last_error_message \
         FROM kfs_probe_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap()
}

/// Steps that panic, some on their first attempt only, one on every attempt, on a worker with
/// as many prefetch slots as there are such jobs (they arrive together, so the batched claim
/// and the group step meet the panic too). Each panic is a failed step: the job is retried
/// and succeeds, or fails once its attempts are used up, naming the panic; every delivery is
/// settled, so the slots come back and a job enqueued afterwards runs, and nothing is left
/// unacked for the shutdown to return to the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_that_panics_is_retried_like_a_failing_step_and_its_delivery_is_settled() {
    let env = TestEnv::new().await;
    let mut once = Vec::new();
    for _ in 0..3 {
        let spec = ProbeSpec {
            fail_mode: "panic_once",
            ..ProbeSpec::default()
        };
        once.push(support::enqueue_one(&env.pool, &spec).await.0);
    }
    let always_spec = ProbeSpec {
        fail_mode: "panic",
        max_attempts: 2,
        ..ProbeSpec::default()
    };
    let (always, _) = support::enqueue_one(&env.pool, &always_spec).await;
    let mut worker = spawn(
        &env,
        "panics",
        &[],
        "probe",
        free_port(),
        &[("KFS_PREFETCH", "4"), ("KFS_RETRY_BASE", "200ms")],
    );

    let ended = env
        .wait_until(Duration::from_secs(60), || async {
            let mut ids = once.clone();
            ids.push(always);
            let open: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM kfs_probe_jobs WHERE id = ANY($1) \
                 AND run_state NOT IN ('succeeded', 'failed', 'canceled')",
            )
            .bind(&ids)
            .fetch_one(&env.pool)
            .await
            .unwrap();
            open == 0
        })
        .await;
    assert!(
        ended,
        "the jobs whose steps panic did not end within 60 s: {:?}\n{}",
        support::probe_states(&env.pool).await,
        worker.tail(30)
    );
    for job in &once {
        let (state, attempts, ..) = probe_row(&env, *job).await;
        assert_eq!(
            (state.as_str(), attempts),
            ("succeeded", 2),
            "a job that panicked once is retried and succeeds\n{}",
            worker.tail(30)
        );
    }
    let (state, attempts, code, message) = probe_row(&env, always).await;
    assert_eq!(
        (state.as_str(), attempts, code.as_deref()),
        ("failed", 2, Some("step_panicked")),
        "a job that always panics fails after its attempts, naming the panic\n{}",
        worker.tail(30)
    );
    assert!(
        message
            .as_deref()
            .is_some_and(|m| m.contains("the probe was told to panic")),
        "{message:?}"
    );

    assert!(
        a_probe_job_runs(&env, Duration::from_secs(30)).await,
        "a job enqueued after the panics did not run: {:?}\n{}",
        support::probe_states(&env.pool).await,
        worker.tail(30)
    );
    let queue = env.topology.queue(Kind::Probe);
    let drained = env
        .wait_until(Duration::from_secs(15), || async {
            env.queue_depth(&queue).await == 0
        })
        .await;
    assert!(
        drained,
        "the probe queue did not drain\n{}",
        worker.tail(30)
    );
    support::stop_cleanly([&mut worker], Duration::from_secs(30)).await;
    // A delivery left unacked goes back to the queue when the worker's channel closes.
    assert_eq!(
        (
            env.queue_depth(&queue).await,
            env.queue_depth(&env.topology.dead_letter_queue()).await
        ),
        (0, 0),
        "deliveries left unsettled came back to the queue (probe, dead-letter)\n{}",
        worker.tail(30)
    );
    env.cleanup().await;
}
