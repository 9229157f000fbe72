//! Fencing and heartbeats: an expired lease or a stale row version refuses every write, a
//! heartbeat extends the lease without bumping the row version, the step fence locks the job row
//! until the step commits, and a lease lost mid-slice stops the slice.

use super::*;

/// Every kind of end a slice can write.
fn every_end() -> Vec<End> {
    vec![
        End::Succeed {
            checkpoint: "done".into(),
        },
        End::Fail {
            code: "x".into(),
            message: "y".into(),
        },
        End::Cancel {
            code: "x".into(),
            message: "y".into(),
        },
        End::Wait {
            delay: Duration::from_secs(5),
            code: "x".into(),
            message: "y".into(),
            refund: false,
        },
        End::Continue,
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_or_a_stale_row_version_refuses_every_write() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let (st, mut conn, ctx) =
        claim_by_hand(&env.pool, &d, "worker-paused", Duration::from_secs(30)).await;

    // The worker was paused past its lease.
    sqlx::query(
        "UPDATE kfs_probe_jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1",
    )
    .bind(job)
    .execute(&env.pool)
    .await
    .unwrap();
    let before = probe_snapshot(&env.pool).await;
    assert_eq!(
        lease::fence(&mut conn, &st, &ctx, Duration::from_secs(30))
            .await
            .unwrap(),
        None,
        "fence"
    );
    assert!(
        !lease::heartbeat(&mut conn, &st, &ctx, Duration::from_secs(30))
            .await
            .unwrap(),
        "heartbeat"
    );
    for end in every_end() {
        assert!(
            !lease::end(&mut conn, &st, &ctx, &end).await.unwrap(),
            "end {end:?}"
        );
    }
    assert_eq!(
        probe_snapshot(&env.pool).await,
        before,
        "an expired lease writes nothing"
    );

    // The lease is valid again, but someone else moved the row on (row_version bumped).
    sqlx::query("UPDATE kfs_probe_jobs SET lease_expires_at = now() + interval '1 minute', row_version = row_version + 1 WHERE id = $1")
        .bind(job)
        .execute(&env.pool)
        .await
        .unwrap();
    let before = probe_snapshot(&env.pool).await;
    assert_eq!(
        lease::fence(&mut conn, &st, &ctx, Duration::from_secs(30))
            .await
            .unwrap(),
        None,
        "fence with a stale row_version"
    );
    for end in every_end() {
        assert!(
            !lease::end(&mut conn, &st, &ctx, &end).await.unwrap(),
            "end {end:?} with a stale row_version"
        );
    }
    assert_eq!(
        probe_snapshot(&env.pool).await,
        before,
        "a stale row_version writes nothing"
    );

    // A wrong lease token is refused the same way.
    let impostor = JobCtx {
        lease_token: Uuid::new_v4(),
        row_version: ctx.row_version + 1,
        ..ctx.clone()
    };
    assert_eq!(
        lease::fence(&mut conn, &st, &impostor, Duration::from_secs(30))
            .await
            .unwrap(),
        None
    );
    assert!(
        !lease::heartbeat(&mut conn, &st, &impostor, Duration::from_secs(30))
            .await
            .unwrap()
    );
    assert_eq!(probe_snapshot(&env.pool).await, before);

    // Control: with the current row version and the live lease, the fence passes.
    let current = JobCtx {
        row_version: ctx.row_version + 1,
        ..ctx.clone()
    };
    assert_eq!(
        lease::fence(&mut conn, &st, &current, Duration::from_secs(30))
            .await
            .unwrap(),
        Some(ctx.row_version + 1)
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_extends_the_lease_and_the_outbox_visibility_without_bumping_row_version() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let (st, mut conn, ctx) =
        claim_by_hand(&env.pool, &d, "worker-hb", Duration::from_secs(10)).await;
    let expires = |pool: PgPool| async move {
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>(
            "SELECT lease_expires_at FROM kfs_probe_jobs WHERE id = $1",
        )
        .bind(job)
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let before = probe_job(&env.pool, job).await;
    let first_expiry = expires(env.pool.clone()).await;

    assert!(
        lease::heartbeat(&mut conn, &st, &ctx, Duration::from_secs(600))
            .await
            .unwrap()
    );
    let after = probe_job(&env.pool, job).await;
    assert_eq!(
        after.lease_ms,
        Some(600_000),
        "lease_expires_at = heartbeat_at + lease"
    );
    assert!(
        expires(env.pool.clone()).await > first_expiry,
        "the lease is longer"
    );
    assert_eq!(after.row_version, before.row_version, "no row_version bump");
    assert_eq!(after.lease_token, before.lease_token);
    let o = probe_outbox(&env.pool, outbox).await;
    assert_eq!(
        (o.status.as_str(), o.at_lease_expiry),
        ("leased", Some(true)),
        "outbox available_at follows the lease"
    );

    // The worker's own steps still pass the fence after any number of heartbeats.
    assert!(
        lease::heartbeat(&mut conn, &st, &ctx, Duration::from_secs(600))
            .await
            .unwrap()
    );
    assert_eq!(
        lease::fence(&mut conn, &st, &ctx, Duration::from_secs(30))
            .await
            .unwrap(),
        Some(ctx.row_version),
        "the fence passes and leaves the row version to the step's own write"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_step_fence_locks_the_job_row_until_the_step_commits_and_the_step_bumps_row_version_once(
) {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            steps: 3,
            ..ProbeSpec::default()
        },
    )
    .await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let (st, mut conn, ctx) =
        claim_by_hand(&env.pool, &d, "worker-fenced", Duration::from_secs(30)).await;
    let before = job_text(&env.pool, job).await;

    let mut tx = env.pool.begin().await.unwrap();
    assert_eq!(
        lease::fence(&mut tx, &st, &ctx, Duration::from_secs(30))
            .await
            .unwrap(),
        Some(ctx.row_version),
        "the fence passes"
    );
    assert_eq!(
        job_text(&env.pool, job).await,
        before,
        "the fence writes nothing"
    );

    // Any other writer (here: a takeover) must wait for the step.
    let mut other = env.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '300ms'")
        .execute(&mut *other)
        .await
        .unwrap();
    let blocked = sqlx::query(
        "UPDATE kfs_probe_jobs SET lease_token = gen_random_uuid(), row_version = row_version + 1 WHERE id = $1",
    )
    .bind(job)
    .execute(&mut *other)
    .await
    .expect_err("the row is locked by the step");
    assert_eq!(
        blocked
            .as_database_error()
            .and_then(|e| e.code())
            .as_deref(),
        Some("55P03"),
        "lock_not_available: {blocked}"
    );
    drop(other);

    let advanced = lease::advance(&mut tx, &st, &ctx, "step-1")
        .await
        .unwrap()
        .expect("the lease is ours");
    tx.commit().await.unwrap();
    assert_eq!(advanced, ctx.row_version + 1, "one bump per committed step");
    let after = probe_job(&env.pool, job).await;
    assert_eq!(
        (after.row_version, after.checkpoint.as_str()),
        (ctx.row_version + 1, "step-1")
    );

    // The old row version is now stale: a fence with it is refused.
    assert_eq!(
        lease::fence(&mut conn, &st, &ctx, Duration::from_secs(30))
            .await
            .unwrap(),
        None
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_lost_mid_slice_stops_the_slice_and_writes_nothing_after_the_takeover() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(
        &env.pool,
        &ProbeSpec {
            steps: 20,
            step_sleep: Duration::from_millis(300),
            ..ProbeSpec::default()
        },
    )
    .await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let engine = Arc::new(probe_engine(&env, "worker-slow", ConsumerConfig::default()));
    let running = {
        let engine = engine.clone();
        let d = d.clone();
        tokio::spawn(async move { engine.process_ref(&d, &CancellationToken::new()).await })
    };
    // Wait for the first effect: the slice is running.
    let pool = env.pool.clone();
    let started = env
        .wait_until(HANG, || {
            let pool = pool.clone();
            async move {
                let n: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM kfs_probe_effects WHERE job_id = $1")
                        .bind(job)
                        .fetch_one(&pool)
                        .await
                        .unwrap();
                n >= 1
            }
        })
        .await;
    assert!(started);

    // Another session takes the job over: new lease token, row_version bumped. (It waits for
    // the step in flight, which holds the row lock, and commits right after it.)
    let taken: i64 = sqlx::query_scalar(
        "WITH t AS (UPDATE kfs_probe_jobs SET lease_token = gen_random_uuid(), worker_id = 'usurper', \
           row_version = row_version + 1 WHERE id = $1 AND run_state = 'running' RETURNING 1) SELECT count(*) FROM t",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(taken, 1, "the job was still running when taken over");
    let effects_at_takeover = support::probe_effects(&env.pool, job).await;
    let job_at_takeover = job_text(&env.pool, job).await;
    let outbox_at_takeover: String =
        sqlx::query_scalar("SELECT o::text FROM kfs_probe_outbox o WHERE id = $1")
            .bind(outbox)
            .fetch_one(&env.pool)
            .await
            .unwrap();

    let handled = tokio::time::timeout(HANG, running)
        .await
        .expect("the slice did not stop")
        .unwrap();
    assert_eq!(handled, ack("claimed", Some("lease_lost")));
    assert_eq!(
        support::probe_effects(&env.pool, job).await,
        effects_at_takeover,
        "no effect after the takeover"
    );
    assert!(effects_at_takeover.len() < 20);
    assert_eq!(
        job_text(&env.pool, job).await,
        job_at_takeover,
        "the job row is the usurper's"
    );
    let outbox_now: String =
        sqlx::query_scalar("SELECT o::text FROM kfs_probe_outbox o WHERE id = $1")
            .bind(outbox)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(
        outbox_now, outbox_at_takeover,
        "the outbox row is not touched either"
    );
    assert_eq!(engine.counters.lease_lost.load(Ordering::Relaxed), 1);
    env.cleanup().await;
}
