//! What a publish carries: a due row goes out once, with every property, header and the payload as
//! its body, and is marked dispatched; a traceparent in the payload travels as the header.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_due_pending_row_is_published_once_with_every_property_and_marked_dispatched() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let payload: serde_json::Value =
        sqlx::query_scalar("SELECT payload FROM kfs_probe_outbox WHERE id = $1")
            .bind(outbox)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    let (_, rv_before) = job_state(&env.pool, job).await;
    let r = relay(&env, "relay-props", cfg());
    let ch = env.confirm_channel().await;

    let got = round(&r, &ch, Kind::Probe).await;
    assert_eq!(
        got,
        Round {
            claimed: 1,
            dispatched: 1,
            released: 0,
            dead: 0,
            look_again: false
        }
    );

    let row = outbox_state(&env.pool, outbox).await;
    assert_eq!(row.status, "dispatched");
    assert!(row.lock_cleared, "lock fields cleared: {row:?}");
    assert_eq!(row.dispatch_attempts, 1);
    assert_eq!(row.last_error, None);
    assert_eq!(
        row.available_after_update_ms, 300_000,
        "available_at = now + visibility (300 s)"
    );
    let delivery_id = row.queue_job_id.clone().expect("queue_job_id written");
    assert_eq!(
        job_state(&env.pool, job).await,
        ("queued".to_owned(), rv_before + 1),
        "dispatch_pending -> queued, fenced by row_version"
    );

    let msgs = drain(&env).await;
    assert_eq!(msgs.len(), 1, "published exactly once");
    let m = &msgs[0];
    let p = &m.properties;
    assert_eq!(
        p.message_id().as_ref().map(|s| s.to_string()),
        Some(delivery_id),
        "message_id = queue_job_id"
    );
    assert_eq!(
        p.correlation_id().as_ref().map(|s| s.to_string()),
        Some(job.to_string()),
        "correlation_id = job id"
    );
    assert_eq!(
        p.kind().as_ref().map(|s| s.to_string()).as_deref(),
        Some("probe.job")
    );
    assert_eq!(
        p.content_type().as_ref().map(|s| s.to_string()).as_deref(),
        Some("application/json")
    );
    assert_eq!(*p.delivery_mode(), Some(2), "persistent");
    let h = p.headers().as_ref().expect("headers");
    assert_eq!(
        str_header(h, "x-kfs-outbox-id"),
        Some(outbox.to_string().as_str())
    );
    assert_eq!(int_header(h, "x-kfs-delivery-revision"), Some(1));
    assert_eq!(int_header(h, "x-kfs-schema-version"), Some(1));
    assert_eq!(
        str_header(h, "traceparent"),
        None,
        "no traceparent when the payload has none"
    );
    let body: serde_json::Value = serde_json::from_slice(&m.data).expect("body is JSON");
    assert_eq!(body, payload, "body = payload");
    assert_eq!(m.routing_key.as_str(), "probe.job", "routed by event type");
    assert_eq!(
        m.exchange.as_str(),
        env.topology.exchange(),
        "through the job exchange"
    );

    // Published once: a second round finds nothing due.
    assert_eq!(round(&r, &ch, Kind::Probe).await, Round::default());
    assert!(drain(&env).await.is_empty());
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traceparent_in_the_payload_travels_as_the_traceparent_header() {
    let env = TestEnv::new().await;
    let (_, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    sqlx::query("UPDATE kfs_probe_outbox SET payload = payload || jsonb_build_object('traceparent', $2::text) WHERE id = $1")
        .bind(outbox)
        .bind(tp)
        .execute(&env.pool)
        .await
        .unwrap();
    let r = relay(&env, "relay-trace", cfg());
    round(&r, &env.confirm_channel().await, Kind::Probe).await;
    let msgs = drain(&env).await;
    assert_eq!(msgs.len(), 1);
    let h = msgs[0].properties.headers().as_ref().expect("headers");
    assert_eq!(str_header(h, "traceparent"), Some(tp));
    let body: serde_json::Value = serde_json::from_slice(&msgs[0].data).unwrap();
    assert_eq!(
        body["traceparent"], tp,
        "the body is still the whole payload"
    );
    env.cleanup().await;
}
