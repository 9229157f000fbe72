//! A settlement the broker never answers: the bound ends the session, it is rebuilt with every
//! consumer, and the jobs still finish once.

use super::*;

/// The delivery loop settles deliveries in order, each send bounded by 5 s. Here the first ack
/// never completes (`KFS_STALL_AT=settle:1`, a broker connection that never answers it): the
/// bound must end the loop, the session is rebuilt, the deliveries left unsettled come back
/// and their claims see the committed decisions, and the jobs enqueued after the stall are
/// consumed by the new session, which then stops cleanly on SIGTERM. Without the bound the
/// loop waits on that ack forever and nothing enqueued after it is consumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_the_broker_never_answers_ends_the_session_and_the_jobs_still_finish_once() {
    settlement_never_answered(&["probe"]).await;
}

/// The same with the default kinds served beside the probe: the other kinds' consumers,
/// which never stalled, must not keep the session from being rebuilt (or the process would
/// stay half-consuming, the probe kind never consumed again), and every kind has its consumer
/// again afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_the_broker_never_answers_with_the_default_kinds_beside_rebuilds_every_consumer(
) {
    settlement_never_answered(&["probe", "compile", "deletion", "research"]).await;
}

async fn settlement_never_answered(kinds: &[&str]) {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new().await;
    install_claim_log(&env.pool).await;
    let spec = probe_spec(3, 50);
    probe::enqueue_many(&env.pool, JOBS, &spec).await.unwrap();
    let mut extra = base_env("probe=10s");
    extra.push(("KFS_STALL_AT", "settle:1"));
    let list = kinds.join(",");
    let mut w = env.spawn_worker(
        "mute-acks",
        &["run", "--kinds", &list, "--worker-id", "mute-acks"],
        &extra,
    );

    let stalled = env
        .wait_until(Duration::from_secs(30), || async {
            w.log_text().contains("stall point settle reached")
        })
        .await;
    assert!(stalled, "no settlement was ever sent\n{}", w.tail(30));
    // Enqueued after the loop stalled: only a loop that got out of the stall consumes them.
    probe::enqueue_many(&env.pool, JOBS, &spec).await.unwrap();
    let jobs = 2 * JOBS;
    let done = env
        .wait_probe_succeeded(jobs, Duration::from_secs(60))
        .await;
    assert!(
        done,
        "the jobs did not all succeed within 60 s of the stalled settlement: {:?}\n{}",
        support::probe_states(&env.pool).await,
        w.tail(30)
    );
    let depths = wait_queues_drained(&env, Duration::from_secs(15)).await;
    assert_eq!(
        depths,
        (0, 0),
        "probe queue / dead-letter queue not drained\n{}",
        w.tail(30)
    );
    for kind in kinds {
        let queue = env
            .topology
            .queue(Kind::parse_list(kind).expect("a kind")[0]);
        let one = env
            .wait_until(Duration::from_secs(15), || async {
                env.queue_consumers(&queue).await == 1
            })
            .await;
        assert!(
            one,
            "{kind} is not consumed after the rebuild\n{}",
            w.tail(30)
        );
    }
    support::stop_cleanly([&mut w], Duration::from_secs(30)).await;

    let log = w.log_text();
    assert_eq!(
        log.matches("stall point settle reached").count(),
        1,
        "only the first settlement stalls\n{}",
        w.tail(30)
    );
    assert!(
        log.contains("the broker stopped taking acks"),
        "the loop did not give up on the settlement\n{}",
        w.tail(30)
    );
    assert!(
        log.contains("a consumer stopped; reconnecting"),
        "the session was not rebuilt\n{}",
        w.tail(30)
    );
    let recognised = log
        .lines()
        .filter(|l| l.contains("kfs_worker::ack") && l.contains(" acked "))
        .filter(|l| l.contains("claim=\"stale\"") || l.contains("claim=\"terminal\""))
        .count();
    assert!(
        recognised > 0,
        "no delivery left unsettled came back and was acked as already decided\n{}",
        w.tail(30)
    );
    assert_history(&env.pool).await;
    assert_eq!(
        count(
            &env.pool,
            "SELECT count(*) FROM kfs_probe_jobs WHERE run_state = 'succeeded'"
        )
        .await,
        jobs,
        "jobs lost"
    );
    // The redelivered ones were recognised as decided, not run again: one claim per job.
    let reclaimed: Vec<(Uuid, i64)> = sqlx::query_as(
        "SELECT job_id, count(*) FROM crash_claims GROUP BY 1 HAVING count(*) <> 1 LIMIT 10",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert!(
        reclaimed.is_empty(),
        "jobs claimed more than once (job, claims): {reclaimed:?}\n{}",
        w.tail(30)
    );
    env.cleanup().await;
}
