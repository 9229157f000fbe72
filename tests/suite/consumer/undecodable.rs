//! Undecodable deliveries are rejected, counted, and change nothing.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_deliveries_are_rejected_counted_and_change_nothing() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = dispatch(&env.pool, Kind::Probe, outbox).await;
    let engine = probe_engine(&env, "worker-poison", ConsumerConfig::default());
    let ob = outbox.to_string();
    let body = serde_json::to_vec(&serde_json::json!({ "probeJobId": job })).unwrap();
    let id = Some(d.delivery_id.as_str());
    let good_type = Some("probe.job");
    let cases: Vec<(&str, BasicProperties, Vec<u8>)> = vec![
        (
            "not JSON",
            props(id, good_type, Some(1), Some(&ob)),
            b"not json".to_vec(),
        ),
        (
            "a JSON array",
            props(id, good_type, Some(1), Some(&ob)),
            b"[1]".to_vec(),
        ),
        (
            "no job id in the body",
            props(id, good_type, Some(1), Some(&ob)),
            b"{}".to_vec(),
        ),
        (
            "wrong schema version",
            props(id, good_type, Some(2), Some(&ob)),
            body.clone(),
        ),
        (
            "no schema version",
            props(id, good_type, None, Some(&ob)),
            body.clone(),
        ),
        (
            "no message_id",
            props(None, good_type, Some(1), Some(&ob)),
            body.clone(),
        ),
        (
            "no outbox id",
            props(id, good_type, Some(1), None),
            body.clone(),
        ),
        (
            "an outbox id that is no uuid",
            props(id, good_type, Some(1), Some("nope")),
            body.clone(),
        ),
        (
            "another kind's type",
            props(id, Some("document.compile"), Some(1), Some(&ob)),
            body.clone(),
        ),
        (
            "oversized",
            props(id, good_type, Some(1), Some(&ob)),
            vec![b' '; 64 * 1024 + 1],
        ),
    ];
    let n = cases.len() as u64;
    let before = probe_snapshot(&env.pool).await;
    for (why, p, b) in cases {
        let handled = tokio::time::timeout(
            HANG,
            engine.process(Kind::Probe, &p, &b, &CancellationToken::new()),
        )
        .await
        .unwrap();
        assert!(matches!(handled, Handled::Reject(_)), "{why}: {handled:?}");
    }
    assert_eq!(engine.counters.poison.load(Ordering::Relaxed), n);
    // The row itself is usable (its own message decodes): garbled messages that name it settle
    // nothing, and its next delivery is claimed. Rows whose own message is unusable are settled
    // (`rows_no_delivery_can_use_are_settled_once_and_dead_lettered_at_most_once`).
    assert_eq!(
        probe_snapshot(&env.pool).await,
        before,
        "nothing changed in Postgres"
    );
    assert_eq!(engine.counters.slices.load(Ordering::Relaxed), 0);

    // Control: the well-formed message is claimed.
    let handled = engine
        .process(
            Kind::Probe,
            &props(id, good_type, Some(1), Some(&ob)),
            &body,
            &CancellationToken::new(),
        )
        .await;
    assert_eq!(handled, ack("claimed", Some("succeeded")));
    assert_eq!(engine.counters.poison.load(Ordering::Relaxed), n);
    env.cleanup().await;
}
