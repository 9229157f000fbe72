//! Republishing: every claim writes a new delivery id and its publish carries it, and `dispatched`
//! and `leased` rows go out again under a new one once their visibility window passed.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_claim_writes_a_new_delivery_id_and_a_republish_carries_it() {
    let env = TestEnv::new().await;
    let (_, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let r = relay(&env, "relay-ids", cfg());
    let ch = env.confirm_channel().await;

    round(&r, &ch, Kind::Probe).await;
    let first = outbox_state(&env.pool, outbox).await.queue_job_id.unwrap();
    // The visibility window passed without a consumer: republish.
    sqlx::query(
        "UPDATE kfs_probe_outbox SET available_at = now() - interval '1 second' WHERE id = $1",
    )
    .bind(outbox)
    .execute(&env.pool)
    .await
    .unwrap();
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
    let second = outbox_state(&env.pool, outbox).await;
    let second_id = second.queue_job_id.clone().unwrap();
    assert_ne!(first, second_id, "a new delivery id per claim");
    assert_eq!(second.dispatch_attempts, 2);

    let ids: Vec<String> = drain(&env).await.iter().map(message_id).collect();
    assert_eq!(
        ids,
        vec![first, second_id],
        "each publish carries the id its claim wrote"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatched_and_leased_rows_are_republished_with_a_new_delivery_id_once_their_visibility_passed(
) {
    let env = TestEnv::new().await;
    let mut rows = Vec::new();
    for (status, due) in [
        ("dispatched", true),
        ("leased", true),
        ("dispatched", false),
        ("leased", false),
    ] {
        let (_, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
        sqlx::query(
            "UPDATE kfs_probe_outbox SET status = $2, queue_job_id = 'old-' || id, dispatch_attempts = 1, \
               available_at = CASE WHEN $3 THEN now() - interval '1 second' ELSE now() + interval '1 hour' END \
             WHERE id = $1",
        )
        .bind(outbox)
        .bind(status)
        .bind(due)
        .execute(&env.pool)
        .await
        .unwrap();
        rows.push((outbox, status, due, outbox_text(&env.pool, outbox).await));
    }
    let r = relay(&env, "relay-visibility", cfg());
    let ch = env.confirm_channel().await;

    assert_eq!(
        round(&r, &ch, Kind::Probe).await,
        Round {
            claimed: 2,
            dispatched: 2,
            released: 0,
            dead: 0,
            look_again: false
        }
    );
    let msgs = drain(&env).await;
    let mut expected = HashSet::new();
    for (outbox, status, due, before) in &rows {
        if *due {
            let row = outbox_state(&env.pool, *outbox).await;
            assert_eq!(row.status, "dispatched", "{status} row republished");
            assert_eq!(row.dispatch_attempts, 2);
            let id = row.queue_job_id.unwrap();
            assert_ne!(
                id,
                format!("old-{outbox}"),
                "{status} row gets a new delivery id"
            );
            expected.insert((*outbox, id));
        } else {
            assert_eq!(
                &outbox_text(&env.pool, *outbox).await,
                before,
                "{status} row inside its window untouched"
            );
        }
    }
    let got: HashSet<(Uuid, String)> = msgs
        .iter()
        .map(|m| (outbox_header(m), message_id(m)))
        .collect();
    assert_eq!(msgs.len(), 2);
    assert_eq!(got, expected);
    env.cleanup().await;
}
