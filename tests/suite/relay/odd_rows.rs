//! Odd, oversized or locked rows never block the others in their round, and each is settled.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_or_locked_rows_do_not_block_the_others() {
    let env = TestEnv::new().await;
    let mut healthy = Vec::new();
    for _ in 0..4 {
        healthy.push(enqueue_one(&env.pool, &ProbeSpec::default()).await);
    }
    // A 200 KB payload: no consumer accepts it, so the relay does not publish it; the row is
    // dead at once and its job failed, instead of being republished forever.
    let (_, huge) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    sqlx::query("UPDATE kfs_probe_outbox SET payload = payload || jsonb_build_object('padding', repeat('x', 200000)) WHERE id = $1")
        .bind(huge)
        .execute(&env.pool)
        .await
        .unwrap();
    // A payload that is not an object at all, and a non-string traceparent elsewhere.
    let (_, array) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    sqlx::query("UPDATE kfs_probe_outbox SET payload = '[1, 2, 3]' WHERE id = $1")
        .bind(array)
        .execute(&env.pool)
        .await
        .unwrap();
    let (_, odd_trace) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    sqlx::query(
        "UPDATE kfs_probe_outbox SET payload = payload || '{\"traceparent\": 42}' WHERE id = $1",
    )
    .bind(odd_trace)
    .execute(&env.pool)
    .await
    .unwrap();
    // A row whose job already failed.
    let (failed_job, failed) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    sqlx::query(
        "UPDATE kfs_probe_jobs SET run_state = 'failed', active_slot = NULL, completed_at = now(), \
           last_error_code = 'x', row_version = row_version + 1 WHERE id = $1",
    )
    .bind(failed_job)
    .execute(&env.pool)
    .await
    .unwrap();
    let failed_job_before = job_text(&env.pool, failed_job).await;
    // A row whose job row another transaction holds locked, and a row whose outbox row is.
    let (locked_job, locked_job_outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let (_, locked_outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let mut blocker = PgConnection::connect(&env.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut blocker).await.unwrap();
    sqlx::query("SELECT 1 FROM kfs_probe_jobs WHERE id = $1 FOR UPDATE")
        .bind(locked_job)
        .execute(&mut blocker)
        .await
        .unwrap();
    sqlx::query("SELECT 1 FROM kfs_probe_outbox WHERE id = $1 FOR UPDATE")
        .bind(locked_outbox)
        .execute(&mut blocker)
        .await
        .unwrap();

    let r = relay(&env, "relay-poison", cfg());
    let ch = env.confirm_channel().await;
    assert_eq!(
        round(&r, &ch, Kind::Probe).await,
        Round {
            claimed: 9,
            dispatched: 8,
            released: 0,
            dead: 1,
            look_again: false
        }
    );
    assert_eq!(outbox_state(&env.pool, huge).await.status, "dead");
    for (job, outbox) in &healthy {
        assert_eq!(outbox_state(&env.pool, *outbox).await.status, "dispatched");
        assert_eq!(job_state(&env.pool, *job).await.0, "queued");
    }
    for outbox in [array, odd_trace, failed, locked_job_outbox] {
        assert_eq!(
            outbox_state(&env.pool, outbox).await.status,
            "dispatched",
            "{outbox}"
        );
    }
    assert_eq!(
        job_text(&env.pool, failed_job).await,
        failed_job_before,
        "a failed job is not moved to queued"
    );
    assert_eq!(
        outbox_state(&env.pool, locked_outbox).await.status,
        "pending",
        "a locked outbox row is skipped"
    );
    let msgs = drain(&env).await;
    assert_eq!(msgs.len(), 8);
    assert!(
        msgs.iter().all(|m| outbox_header(m) != huge),
        "the oversized row was not published"
    );
    let arr = msgs
        .iter()
        .find(|m| outbox_header(m) == array)
        .expect("the array row was published");
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&arr.data).unwrap(),
        serde_json::json!([1, 2, 3])
    );
    let odd = msgs.iter().find(|m| outbox_header(m) == odd_trace).unwrap();
    assert_eq!(
        str_header(odd.properties.headers().as_ref().unwrap(), "traceparent"),
        None
    );

    // The lock ends: the skipped row goes out, and the skipped job transition is harmless
    // (the consumer accepts dispatch_pending as well as queued).
    sqlx::query("ROLLBACK").execute(&mut blocker).await.unwrap();
    assert_eq!(
        job_state(&env.pool, locked_job).await.0,
        "dispatch_pending",
        "mark skipped the locked job row"
    );
    assert_eq!(
        round(&r, &ch, Kind::Probe).await,
        Round {
            claimed: 1,
            dispatched: 1,
            released: 0,
            dead: 0,
            look_again: false
        }
    );
    let later = drain(&env).await;
    assert_eq!(
        later.iter().map(outbox_header).collect::<Vec<_>>(),
        vec![locked_outbox]
    );

    // A consumer settles every row: those no delivery can use at once (the array payload dead,
    // the failed job's row dead to match it), instead of leaving them to be published again
    // every visibility window; the others by running their jobs.
    let engine = Engine::new(
        env.pool.clone(),
        "worker-odd",
        vec![Arc::new(ProbeHandler)],
        ConsumerConfig::default(),
    );
    for m in msgs.iter().chain(&later) {
        tokio::time::timeout(
            HANG,
            engine.process(
                Kind::Probe,
                &m.properties,
                &m.data,
                &CancellationToken::new(),
            ),
        )
        .await
        .expect("process hung");
    }
    let mut settled = Vec::new();
    for outbox in [
        huge,
        array,
        failed,
        odd_trace,
        locked_job_outbox,
        locked_outbox,
    ] {
        settled.push(outbox_state(&env.pool, outbox).await.status);
    }
    assert_eq!(
        settled,
        [
            "dead",
            "dead",
            "dead",
            "completed",
            "completed",
            "completed"
        ],
        "huge, array, failed, odd_trace, locked_job_outbox, locked_outbox"
    );
    for (job, outbox) in &healthy {
        assert_eq!(outbox_state(&env.pool, *outbox).await.status, "completed");
        assert_eq!(job_state(&env.pool, *job).await.0, "succeeded");
    }
    assert_eq!(
        job_text(&env.pool, failed_job).await,
        failed_job_before,
        "settling its row leaves a failed job as it is"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traceparent_larger_than_a_frame_does_not_take_the_rest_of_the_batch_down() {
    let env = TestEnv::new().await;
    // The poison row comes first in claim order (available_at, id).
    let (_, poison) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    sqlx::query(
        "UPDATE kfs_probe_outbox SET available_at = now() - interval '1 minute', \
           payload = payload || jsonb_build_object('traceparent', repeat('0', 200000)) WHERE id = $1",
    )
    .bind(poison)
    .execute(&env.pool)
    .await
    .unwrap();
    let mut healthy = Vec::new();
    for _ in 0..4 {
        healthy.push(enqueue_one(&env.pool, &ProbeSpec::default()).await.1);
    }
    // Its own connection: the broker may close it.
    let conn =
        lapin::Connection::connect(&support::amqp_url(), lapin::ConnectionProperties::default())
            .await
            .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await
        .unwrap();
    let r = relay(
        &env,
        "relay-big-header",
        RelayConfig {
            confirm_timeout: Duration::from_secs(10),
            ..cfg()
        },
    );
    let _ = tokio::time::timeout(HANG, r.relay_once(&ch, Kind::Probe))
        .await
        .expect("relay_once hung");

    for outbox in &healthy {
        assert_eq!(
            outbox_state(&env.pool, *outbox).await.status,
            "dispatched",
            "a healthy row in the poison's batch"
        );
    }
    let published: HashSet<Uuid> = drain(&env).await.iter().map(outbox_header).collect();
    assert!(
        healthy.iter().all(|o| published.contains(o)),
        "healthy rows published"
    );
    env.cleanup().await;
}
