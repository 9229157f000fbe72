//! Claiming a delivery: the claim takes the lease, counts the attempt and leases the outbox row;
//! stale deliveries and terminal jobs are acked without a run, used-up attempts fail the job, and
//! a claim that cannot reach Postgres gives its delivery back after its patience.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_takes_the_lease_counts_the_attempt_and_moves_the_outbox_row_to_leased() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let before = probe_job(&env.pool, job).await;
    let (_, _, ctx) = claim_by_hand(&env.pool, &d, "worker-claim", Duration::from_secs(30)).await;

    let after = probe_job(&env.pool, job).await;
    assert_eq!(after.run_state, "running");
    assert_eq!(after.worker_id.as_deref(), Some("worker-claim"));
    assert_eq!(
        after.lease_token,
        Some(ctx.lease_token),
        "a fresh lease token, the one the worker holds"
    );
    assert_eq!(after.lease_live, Some(true), "lease_expires_at > now");
    assert!(after.heartbeat_set);
    assert_eq!(
        after.lease_ms,
        Some(30_000),
        "lease_expires_at = heartbeat_at + lease"
    );
    assert_eq!(after.execution_attempts, before.execution_attempts + 1);
    assert_eq!(after.row_version, before.row_version + 1);
    assert!(after.started);
    assert_eq!(after.checkpoint, "queued", "the checkpoint is not touched");
    assert_eq!(
        (
            ctx.job_id,
            ctx.outbox_id,
            ctx.delivery_id.as_str(),
            ctx.row_version,
            ctx.execution_attempts,
            ctx.checkpoint.as_str()
        ),
        (
            job,
            outbox,
            d.delivery_id.as_str(),
            after.row_version,
            1,
            "queued"
        )
    );
    let o = probe_outbox(&env.pool, outbox).await;
    assert_eq!(o.status, "leased");
    assert_eq!(
        o.at_lease_expiry,
        Some(true),
        "outbox available_at = lease_expires_at"
    );
    assert_eq!(o.queue_job_id.as_deref(), Some(d.delivery_id.as_str()));
    assert!(o.lock_cleared);
    assert!(o.delivered);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_deliveries_are_acked_without_changing_anything() {
    let env = TestEnv::new().await;
    let engine = probe_engine(&env, "worker-stale", ConsumerConfig::default());
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let (_, other_outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    dispatch(&env.pool, Kind::Probe, other_outbox).await;

    let cases: Vec<(&str, DeliveryRef)> = vec![
        (
            "an older delivery id",
            DeliveryRef {
                delivery_id: "superseded".into(),
                ..d.clone()
            },
        ),
        (
            "an outbox row of another job",
            DeliveryRef {
                outbox_id: other_outbox,
                ..d.clone()
            },
        ),
        (
            "no such outbox row",
            DeliveryRef {
                outbox_id: Uuid::new_v4(),
                ..d.clone()
            },
        ),
    ];
    let mut expected_stale = 0;
    for (why, delivery) in cases {
        let before = probe_snapshot(&env.pool).await;
        assert_eq!(
            process(&engine, &delivery).await,
            ack("stale", None),
            "{why}"
        );
        assert_eq!(
            probe_snapshot(&env.pool).await,
            before,
            "{why}: nothing changed"
        );
        expected_stale += 1;
    }
    // The right delivery id, but the row is no longer out for delivery.
    for status in ["pending", "completed", "canceled", "dead"] {
        sqlx::query("UPDATE kfs_probe_outbox SET status = $2 WHERE id = $1")
            .bind(outbox)
            .bind(status)
            .execute(&env.pool)
            .await
            .unwrap();
        let before = probe_snapshot(&env.pool).await;
        assert_eq!(
            process(&engine, &d).await,
            ack("stale", None),
            "outbox {status}"
        );
        assert_eq!(
            probe_snapshot(&env.pool).await,
            before,
            "outbox {status}: nothing changed"
        );
        expected_stale += 1;
    }
    assert_eq!(
        engine.counters.stale.load(Ordering::Relaxed),
        expected_stale
    );
    assert_eq!(engine.counters.claimed.load(Ordering::Relaxed), 0);
    assert_eq!(
        engine.counters.slices.load(Ordering::Relaxed),
        0,
        "no slice ran"
    );
    assert!(support::probe_effects(&env.pool, job).await.is_empty());

    // Positive control: the same delivery is claimed once its row is out for delivery again.
    sqlx::query("UPDATE kfs_probe_outbox SET status = 'dispatched' WHERE id = $1")
        .bind(outbox)
        .execute(&env.pool)
        .await
        .unwrap();
    assert_eq!(
        process(&engine, &d).await,
        ack("claimed", Some("succeeded"))
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_cannot_reach_postgres_gives_its_delivery_back_after_its_patience() {
    let env = TestEnv::new().await;
    let (_, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let before = probe_snapshot(&env.pool).await;
    // Postgres out of reach: nothing listens on this port.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let away = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy(&format!("postgres://postgres@127.0.0.1:{port}/kfs"))
        .unwrap();
    let engine = Engine::new(
        away,
        "worker-away",
        vec![Arc::new(ProbeHandler)],
        ConsumerConfig {
            claim_patience: Duration::from_secs(2),
            ..ConsumerConfig::default()
        },
    );
    assert_eq!(
        process(&engine, &d).await,
        Handled::GiveBack,
        "handed back to the broker instead of holding its prefetch slot"
    );
    assert_eq!(probe_snapshot(&env.pool).await, before, "nothing written");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_for_a_terminal_job_is_acked_as_terminal_and_settles_its_row_to_match() {
    let env = TestEnv::new().await;
    let engine = probe_engine(&env, "worker-term", ConsumerConfig::default());
    for (state, settled) in [
        ("succeeded", "completed"),
        ("failed", "dead"),
        ("canceled", "canceled"),
    ] {
        let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
        let d = dispatch(&env.pool, Kind::Probe, outbox).await;
        sqlx::query(
            "UPDATE kfs_probe_jobs SET run_state = $2, active_slot = NULL, completed_at = now(), row_version = row_version + 1 \
             WHERE id = $1",
        )
        .bind(d.job_id)
        .bind(state)
        .execute(&env.pool)
        .await
        .unwrap();
        let job_before = job_text(&env.pool, job).await;
        assert_eq!(process(&engine, &d).await, ack("terminal", None), "{state}");
        assert_eq!(
            job_text(&env.pool, job).await,
            job_before,
            "{state}: the job is left as it is"
        );
        // The row is settled once, so the relay does not publish it again every window.
        let o = probe_outbox(&env.pool, outbox).await;
        assert_eq!(o.status, settled, "{state}");
        assert!(o.lock_cleared, "{state}");
        assert_eq!(
            o.last_error.is_some(),
            settled != "completed",
            "{state}: {o:?}"
        );
        let before = probe_snapshot(&env.pool).await;
        assert_eq!(
            process(&engine, &d).await,
            ack("stale", None),
            "{state}: again"
        );
        assert_eq!(
            probe_snapshot(&env.pool).await,
            before,
            "{state}: settled once"
        );
    }
    assert_eq!(engine.counters.terminal.load(Ordering::Relaxed), 3);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_attempts_are_used_up_is_failed_and_its_outbox_row_is_dead() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            max_attempts: 2,
            ..ProbeSpec::default()
        },
    )
    .await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    // A worker died during the last allowed attempt, and its lease ran out.
    let (_, conn, _) = claim_by_hand(&env.pool, &d, "dead-worker", Duration::from_secs(30)).await;
    drop(conn);
    sqlx::query(
        "UPDATE kfs_probe_jobs SET execution_attempts = max_execution_attempts, lease_expires_at = now() - interval '1 second' \
         WHERE id = $1",
    )
    .bind(job)
    .execute(&env.pool)
    .await
    .unwrap();
    let rv = probe_job(&env.pool, job).await.row_version;

    let engine = probe_engine(&env, "worker-ex", ConsumerConfig::default());
    assert_eq!(process(&engine, &d).await, ack("exhausted", None));
    let j = probe_job(&env.pool, job).await;
    assert_eq!(j.run_state, "failed");
    assert_eq!(j.last_error_code.as_deref(), Some("attempts_exhausted"));
    assert_eq!(j.active_slot, None);
    assert!(j.completed);
    assert_eq!(
        (j.worker_id, j.lease_token, j.lease_live),
        (None, None, None),
        "lease cleared"
    );
    assert_eq!(j.execution_attempts, 2, "no attempt beyond the maximum");
    assert_eq!(j.row_version, rv + 1);
    let o = probe_outbox(&env.pool, outbox).await;
    assert_eq!(o.status, "dead");
    assert!(o.lock_cleared);
    assert_eq!(o.last_error.as_deref(), Some("attempts_exhausted"));
    assert!(
        support::probe_effects(&env.pool, job).await.is_empty(),
        "nothing ran"
    );
    assert_eq!(engine.counters.exhausted.load(Ordering::Relaxed), 1);
    env.cleanup().await;
}
