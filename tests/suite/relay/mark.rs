//! The mark after the publish: fenced by status when a consumer won the race, by lock token when
//! another relay reclaimed the row, and it skips a row a claim holds without waiting.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_delivery_id_is_committed_before_publishing_so_a_consumer_may_win_the_race_against_the_mark(
) {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    Gate::install(&env).await;
    let gate = Gate::close(&env, "kfs-test-gate-relay").await;
    let (relaying, gated) = gate.hold_a_round(&env, "relay-gated").await;

    // Published and confirmed, not yet marked: the claim with the delivery id is committed.
    let row = outbox_state(&env.pool, outbox).await;
    assert_eq!(row.status, "dispatching");
    let msgs = drain(&env).await;
    assert_eq!(msgs.len(), 1);
    assert_eq!(
        Some(message_id(&msgs[0])),
        row.queue_job_id,
        "the message carries the committed delivery id"
    );

    // A consumer takes the message now and runs the job to its end.
    let engine = Engine::new(
        env.pool.clone(),
        "consumer-fast",
        vec![Arc::new(ProbeHandler)],
        ConsumerConfig::default(),
    );
    let handled = engine
        .process(
            Kind::Probe,
            &msgs[0].properties,
            &msgs[0].data,
            &CancellationToken::new(),
        )
        .await;
    assert_eq!(
        handled,
        Handled::Ack {
            claim: "claimed",
            end: Some("succeeded")
        }
    );
    let outbox_after_consumer = outbox_text(&env.pool, outbox).await;
    let job_after_consumer = job_text(&env.pool, job).await;

    // The mark finds the row no longer 'dispatching' and changes nothing.
    gate.open().await;
    let got = tokio::time::timeout(HANG, relaying)
        .await
        .expect("relay hung")
        .unwrap()
        .unwrap();
    assert_eq!(
        got,
        Round {
            claimed: 1,
            dispatched: 0,
            released: 0,
            dead: 0,
            look_again: false
        }
    );
    assert_eq!(
        outbox_text(&env.pool, outbox).await,
        outbox_after_consumer,
        "mark is fenced by status"
    );
    assert_eq!(
        job_text(&env.pool, job).await,
        job_after_consumer,
        "the job is not moved back to queued"
    );
    assert_eq!(outbox_state(&env.pool, outbox).await.status, "completed");
    gated.close().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mark_dispatched_is_fenced_by_the_lock_token_when_another_relay_reclaimed_the_row() {
    let env = TestEnv::new().await;
    let (job, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    Gate::install(&env).await;

    // Relay A claims and publishes, then stops before its mark.
    let gate_a = Gate::close(&env, "kfs-test-gate-a").await;
    let (relaying_a, pool_a) = gate_a.hold_a_round(&env, "relay-a").await;
    let first_id = outbox_state(&env.pool, outbox).await.queue_job_id.unwrap();

    // A's lock runs out; relay B reclaims the row under its own token and stops before its mark.
    expire_lock(&env.pool, outbox).await;
    let gate_b = Gate::close(&env, "kfs-test-gate-b").await;
    let (relaying_b, pool_b) = gate_b.hold_a_round(&env, "relay-b").await;
    let reclaimed = outbox_state(&env.pool, outbox).await;
    let second_id = reclaimed.queue_job_id.clone().unwrap();
    assert_ne!(first_id, second_id, "B's claim wrote a new delivery id");
    assert_eq!(
        (reclaimed.status.as_str(), reclaimed.dispatch_attempts),
        ("dispatching", 2)
    );
    let outbox_before = outbox_text(&env.pool, outbox).await;
    let job_before = job_text(&env.pool, job).await;

    // A marks now: the row is 'dispatching', but under B's token. A changes nothing.
    gate_a.open().await;
    let got = tokio::time::timeout(HANG, relaying_a)
        .await
        .expect("relay A hung")
        .unwrap()
        .unwrap();
    assert_eq!(
        got,
        Round {
            claimed: 1,
            dispatched: 0,
            released: 0,
            dead: 0,
            look_again: false
        },
        "a stale lock token marks nothing"
    );
    assert_eq!(
        outbox_text(&env.pool, outbox).await,
        outbox_before,
        "B's claim is intact"
    );
    assert_eq!(
        job_text(&env.pool, job).await,
        job_before,
        "the job is not moved by A"
    );

    // B marks its own claim.
    gate_b.open().await;
    let got = tokio::time::timeout(HANG, relaying_b)
        .await
        .expect("relay B hung")
        .unwrap()
        .unwrap();
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
    assert_eq!(
        (row.status.as_str(), row.queue_job_id.as_deref()),
        ("dispatched", Some(second_id.as_str()))
    );
    assert_eq!(job_state(&env.pool, job).await.0, "queued");
    // Both messages went out; only the second names the current delivery.
    let ids: HashSet<String> = drain(&env).await.iter().map(message_id).collect();
    assert_eq!(ids, HashSet::from([first_id, second_id]));
    pool_a.close().await;
    pool_b.close().await;
    env.cleanup().await;
}

/// The mark never waits for a row a consumer's claim holds: that claim leases the row itself.
/// Waiting, the mark held the rows it had already locked until the claim ended, and the claims
/// and ends of those rows queued behind it. The skipped row stays `dispatching` under the
/// relay's lock; if its claim does not commit, the row is published again once that lock has
/// expired, with a new delivery id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mark_skips_a_row_a_claim_holds_and_marks_the_others_without_waiting() {
    let env = TestEnv::new().await;
    let mut rows = Vec::new();
    for _ in 0..3 {
        rows.push(enqueue_one(&env.pool, &ProbeSpec::default()).await.1);
    }
    rows.sort();
    let held = rows[1];
    Gate::install(&env).await;
    let gate = Gate::close(&env, "kfs-test-gate-skip").await;
    let (relaying, gated) = gate.hold_a_round(&env, "relay-skip").await;
    let first = outbox_state(&env.pool, held).await;
    assert_eq!(first.status, "dispatching");

    // A consumer's claim of the middle row is in flight, holding its outbox row.
    let mut claim = env.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM kfs_probe_outbox WHERE id = $1 FOR UPDATE")
        .bind(held)
        .execute(&mut *claim)
        .await
        .unwrap();
    gate.open().await;
    let got = tokio::time::timeout(HANG, relaying)
        .await
        .expect("the mark waited for the row the claim holds")
        .unwrap()
        .unwrap();
    assert_eq!((got.claimed, got.dispatched), (3, 2), "{got:?}");
    for id in [rows[0], rows[2]] {
        assert_eq!(outbox_state(&env.pool, id).await.status, "dispatched");
    }

    // The claim does not commit: the row is still the relay's, and once its lock has expired
    // it is published again under a new delivery id.
    claim.rollback().await.unwrap();
    let skipped = outbox_state(&env.pool, held).await;
    assert_eq!(skipped.status, "dispatching");
    assert!(!skipped.lock_cleared, "{skipped:?}");
    expire_lock(&env.pool, held).await;
    drain(&env).await;
    let again = round(
        &relay(&env, "relay-after", cfg()),
        &env.confirm_channel().await,
        Kind::Probe,
    )
    .await;
    assert_eq!((again.claimed, again.dispatched), (1, 1), "{again:?}");
    let republished = outbox_state(&env.pool, held).await;
    assert_eq!(republished.status, "dispatched");
    assert_ne!(republished.queue_job_id, first.queue_job_id);
    let msgs = drain(&env).await;
    assert_eq!(msgs.len(), 1);
    assert_eq!(Some(message_id(&msgs[0])), republished.queue_job_id);
    gated.close().await;
    env.cleanup().await;
}
