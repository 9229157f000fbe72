//! Outbox rows no delivery can use (a payload, schema version or job id no consumer can act on)
//! are settled once and dead-lettered at most once.

use super::*;

/// Every message on the dead-letter queue, taken off it: the outbox id each names.
async fn dead_lettered(env: &TestEnv) -> Vec<Option<Uuid>> {
    let ch = env.channel().await;
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(
            env.topology.dead_letter_queue().as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
    {
        let outbox = m
            .delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|h| kfs_worker::wire::str_header(h, "x-kfs-outbox-id"))
            .and_then(|s| Uuid::parse_str(s).ok());
        out.push(outbox);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_no_delivery_can_use_are_settled_once_and_dead_lettered_at_most_once() {
    let env = TestEnv::new().await;
    let url = env.services().database_url;
    let terminal = |state: &'static str| {
        format!(
            "UPDATE kfs_probe_jobs SET run_state = '{state}', active_slot = NULL, completed_at = now(), \
               row_version = row_version + 1 WHERE id = $1"
        )
    };
    let (succeeded_job, _) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    // (what, the row's change, the job's change, outbox status, job state, most copies in the DLQ)
    type Case = (
        &'static str,
        String,
        Option<String>,
        &'static str,
        &'static str,
        usize,
    );
    let cases: Vec<Case> = vec![
        (
            "a payload that is no JSON object",
            "UPDATE kfs_probe_outbox SET payload = '[1, 2, 3]' WHERE id = $1".into(),
            None,
            "dead",
            "failed",
            1,
        ),
        (
            "a schema version no consumer reads",
            "UPDATE kfs_probe_outbox SET schema_version = 2 WHERE id = $1".into(),
            None,
            "dead",
            "failed",
            1,
        ),
        (
            "an id of another kind's job",
            "UPDATE kfs_probe_outbox SET payload = jsonb_build_object('attemptId', probe_job_id::text) WHERE id = $1"
                .into(),
            None,
            "dead",
            "failed",
            1,
        ),
        (
            "a job id that names no job",
            "UPDATE kfs_probe_outbox SET payload = jsonb_build_object('probeJobId', gen_random_uuid()::text) WHERE id = $1"
                .into(),
            None,
            "dead",
            "failed",
            0,
        ),
        (
            "another job's id",
            format!(
                "UPDATE kfs_probe_outbox SET payload = jsonb_build_object('probeJobId', '{succeeded_job}') WHERE id = $1"
            ),
            None,
            "dead",
            "failed",
            0,
        ),
        (
            "a job that succeeded",
            "SELECT $1::uuid".into(),
            Some(terminal("succeeded")),
            "completed",
            "succeeded",
            0,
        ),
        (
            "a job that failed",
            "SELECT $1::uuid".into(),
            Some(terminal("failed")),
            "dead",
            "failed",
            0,
        ),
        (
            "a job that was canceled",
            "SELECT $1::uuid".into(),
            Some(terminal("canceled")),
            "canceled",
            "canceled",
            0,
        ),
        (
            "a healthy row (control)",
            "SELECT $1::uuid".into(),
            None,
            "completed",
            "succeeded",
            0,
        ),
    ];
    let mut rows = Vec::new();
    for (what, row_sql, job_sql, ..) in &cases {
        let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
        sqlx::query(row_sql)
            .bind(outbox)
            .execute(&env.pool)
            .await
            .unwrap();
        if let Some(sql) = job_sql {
            sqlx::query(sql).bind(job).execute(&env.pool).await.unwrap();
        }
        rows.push((*what, job, outbox));
    }
    // The row of `succeeded_job` itself is put out of the way: only the job is needed.
    sqlx::query("DELETE FROM kfs_probe_outbox WHERE probe_job_id = $1")
        .bind(succeeded_job)
        .execute(&env.pool)
        .await
        .unwrap();
    sqlx::query(&terminal("succeeded"))
        .bind(succeeded_job)
        .execute(&env.pool)
        .await
        .unwrap();

    // A live worker leases a healthy job for long: its duplicates are legitimate.
    let (live_job, live_outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let live = dispatch(&env.pool, Kind::Probe, live_outbox).await;
    let liveness = kfs_worker::liveness::acquire(&url, "live-worker")
        .await
        .expect("liveness lock");
    let (_, conn, _) =
        claim_by_hand(&env.pool, &live, "live-worker", Duration::from_secs(600)).await;
    drop(conn);
    let live_before = (
        job_text(&env.pool, live_job).await,
        support::outbox_text(&env.pool, live_outbox).await,
    );

    // A relay with a short visibility window and a consumer, for many windows. The window is
    // far longer than a delivery takes to be decided, even on a loaded machine: a row settled
    // by its first delivery is never due again.
    let window = Duration::from_millis(1500);
    let relay = Relay::new(
        env.pool.clone(),
        env.topology.clone(),
        "relay-settle",
        RelayConfig {
            visibility: window,
            ..RelayConfig::default()
        },
        &[Kind::Probe],
    );
    let engine = Arc::new(probe_engine(
        &env,
        "worker-settle",
        ConsumerConfig::default(),
    ));
    let shutdown = CancellationToken::new();
    let consumer = tokio::spawn(kfs_worker::consumer::consume(
        engine.clone(),
        env.channel().await,
        env.topology.queue(Kind::Probe),
        Kind::Probe,
        8,
        shutdown.clone(),
    ));
    let ch = env.confirm_channel().await;
    let started = std::time::Instant::now();
    while started.elapsed() < window * 6 {
        relay
            .relay_once(&ch, Kind::Probe)
            .await
            .expect("relay round");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Every delivery in flight is decided, then the consumer stops.
    tokio::time::sleep(window * 2).await;
    shutdown.cancel();
    tokio::time::timeout(HANG, consumer)
        .await
        .expect("consumer stopped")
        .unwrap()
        .unwrap();
    let copies = dead_lettered(&env).await;

    // (case, outbox status, job state, whether the dead-lettered copies are within the bound)
    let mut got = Vec::new();
    let mut want = Vec::new();
    let mut counted = Vec::new();
    for ((what, job, outbox), (_, _, job_sql, status, state, most)) in rows.iter().zip(&cases) {
        let o = probe_outbox(&env.pool, *outbox).await;
        let j = probe_job(&env.pool, *job).await;
        let n = copies.iter().filter(|c| **c == Some(*outbox)).count();
        counted.push((*what, n, o.dispatch_attempts));
        got.push((*what, o.status.clone(), j.run_state.clone(), n <= *most));
        want.push((*what, (*status).to_owned(), (*state).to_owned(), true));
        if o.status == "dead" {
            assert!(
                o.last_error.as_deref().is_some_and(|e| !e.is_empty()),
                "{what}: the reason is kept: {:?}",
                o.last_error
            );
        }
        if *status == "dead" && job_sql.is_none() && j.run_state == "failed" {
            // The job of a row no delivery can use fails with a recorded error code.
            assert_eq!(
                j.last_error_code.as_deref(),
                Some("undeliverable"),
                "{what}"
            );
            assert!(j.completed, "{what}");
            assert_eq!(j.active_slot, None, "{what}");
        }
        assert!(o.lock_cleared, "{what}");
    }
    assert_eq!(
        got, want,
        "(case, outbox, job, dead-lettered at most as allowed); (case, copies, dispatches): {counted:?}"
    );
    assert_eq!(
        copies.iter().filter(|c| c.is_none()).count(),
        0,
        "every dead-lettered copy names its row"
    );

    // The live worker's job: not published again, and neither a stale duplicate of it nor a
    // garbled message naming it settles anything.
    assert_eq!(process(&engine, &live).await, ack("duplicate", None));
    let garbled = tokio::time::timeout(
        HANG,
        engine.process(
            Kind::Probe,
            &props(
                Some(live.delivery_id.as_str()),
                Some("probe.job"),
                Some(1),
                Some(&live_outbox.to_string()),
            ),
            b"not json",
            &CancellationToken::new(),
        ),
    )
    .await
    .unwrap();
    assert!(matches!(garbled, Handled::Reject(_)), "{garbled:?}");
    assert_eq!(
        (
            job_text(&env.pool, live_job).await,
            support::outbox_text(&env.pool, live_outbox).await,
        ),
        live_before,
        "a live worker's job and row are left as they are"
    );
    liveness.close().await.unwrap();
    env.cleanup().await;
}
