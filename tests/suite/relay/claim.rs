//! Which rows a round claims: only due ones; a `dispatching` row only once its lock expired or its
//! relay process died; and two relays side by side claim each row exactly once.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_whose_available_at_is_in_the_future_are_not_claimed() {
    let env = TestEnv::new().await;
    let (_, deferred) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let (_, later) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let (_, due) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    sqlx::query(
        "UPDATE kfs_probe_outbox SET available_at = '9999-12-31T23:59:59.999Z' WHERE id = $1",
    )
    .bind(deferred)
    .execute(&env.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE kfs_probe_outbox SET available_at = now() + interval '1 hour' WHERE id = $1",
    )
    .bind(later)
    .execute(&env.pool)
    .await
    .unwrap();
    let deferred_before = outbox_text(&env.pool, deferred).await;
    let later_before = outbox_text(&env.pool, later).await;
    let r = relay(&env, "relay-deferred", cfg());
    let ch = env.confirm_channel().await;

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
    assert_eq!(outbox_state(&env.pool, due).await.status, "dispatched");
    assert_eq!(outbox_text(&env.pool, deferred).await, deferred_before);
    assert_eq!(outbox_text(&env.pool, later).await, later_before);
    let published: Vec<Uuid> = drain(&env).await.iter().map(outbox_header).collect();
    assert_eq!(published, vec![due]);

    // Releasing the deferred row (available_at = now) is all it takes.
    sqlx::query("UPDATE kfs_probe_outbox SET available_at = now() WHERE id = $1")
        .bind(deferred)
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
    let published: Vec<Uuid> = drain(&env).await.iter().map(outbox_header).collect();
    assert_eq!(published, vec![deferred]);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatching_row_is_reclaimed_only_after_its_lock_expired() {
    let env = TestEnv::new().await;
    let (_, expired) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let (_, held) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
    // A relay died mid-publish on `expired`; another one is still publishing `held`.
    sqlx::query(
        "UPDATE kfs_probe_outbox SET status = 'dispatching', lock_token = gen_random_uuid(), locked_by = 'dead-relay', \
           locked_until = CASE WHEN id = $1 THEN now() - interval '1 second' ELSE now() + interval '1 hour' END, \
           queue_job_id = 'old-' || id, dispatch_attempts = 1 \
         WHERE id IN ($1, $2)",
    )
    .bind(expired)
    .bind(held)
    .execute(&env.pool)
    .await
    .unwrap();
    let held_before = outbox_text(&env.pool, held).await;
    let r = relay(&env, "relay-reclaim", cfg());
    let ch = env.confirm_channel().await;

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
    let row = outbox_state(&env.pool, expired).await;
    assert_eq!(row.status, "dispatched");
    assert!(row.lock_cleared);
    assert_eq!(row.dispatch_attempts, 2);
    let new_id = row.queue_job_id.unwrap();
    assert_ne!(
        new_id,
        format!("old-{expired}"),
        "reclaimed under a new delivery id"
    );
    assert_eq!(
        outbox_text(&env.pool, held).await,
        held_before,
        "a live lock is not taken"
    );
    let msgs = drain(&env).await;
    assert_eq!(msgs.len(), 1);
    assert_eq!(outbox_header(&msgs[0]), expired);
    assert_eq!(message_id(&msgs[0]), new_id);
    env.cleanup().await;
}

/// A worker process's relay locks the rows it claims under its liveness holder
/// (`<id>#<8 hex>`). Once that holder is dead to `kfs_worker_alive` (the process was killed
/// between its claim and its mark), its rows are taken again at once, not after `lock_ttl`
/// (30 s): the jobs behind them would otherwise wait that long for their first message. A live
/// holder's rows, and rows locked under a name that is not a holder (a relay without a liveness
/// session), still wait for their lock to run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatching_row_of_a_dead_relay_process_is_reclaimed_before_its_lock_expires() {
    let env = TestEnv::new().await;
    let url = env.services().database_url;
    let live_holder = "relay-live#89abcdef";
    let _alive = kfs_worker::liveness::acquire(&url, live_holder)
        .await
        .expect("liveness lock");
    let dead_holder = "relay-killed#0123abcd";
    let mut rows = Vec::new();
    for locked_by in [dead_holder, live_holder, "relay-without-liveness"] {
        let (_, outbox) = enqueue_one(&env.pool, &ProbeSpec::default()).await;
        // Claimed an hour of lock ago, by a relay that has not marked it.
        sqlx::query(
            "UPDATE kfs_probe_outbox SET status = 'dispatching', lock_token = gen_random_uuid(), \
               locked_by = $2, locked_until = now() + interval '1 hour', queue_job_id = 'old-' || id, \
               dispatch_attempts = 1 \
             WHERE id = $1",
        )
        .bind(outbox)
        .bind(locked_by)
        .execute(&env.pool)
        .await
        .unwrap();
        rows.push((locked_by, outbox, outbox_text(&env.pool, outbox).await));
    }
    let r = relay(&env, "relay-survivor#fedcba98", cfg());
    let ch = env.confirm_channel().await;

    assert_eq!(
        round(&r, &ch, Kind::Probe).await,
        Round {
            claimed: 1,
            dispatched: 1,
            released: 0,
            dead: 0,
            look_again: false
        },
        "only the dead holder's row is taken"
    );
    let (_, dead_row, _) = &rows[0];
    let row = outbox_state(&env.pool, *dead_row).await;
    assert_eq!(row.status, "dispatched");
    assert!(row.lock_cleared);
    assert_eq!(row.dispatch_attempts, 2);
    let new_id = row.queue_job_id.unwrap();
    assert_ne!(new_id, format!("old-{dead_row}"), "under a new delivery id");
    for (locked_by, outbox, before) in &rows[1..] {
        assert_eq!(
            &outbox_text(&env.pool, *outbox).await,
            before,
            "the row locked by {locked_by} is not taken before its lock runs out"
        );
    }
    let msgs = drain(&env).await;
    assert_eq!(msgs.len(), 1);
    assert_eq!(outbox_header(&msgs[0]), *dead_row);
    assert_eq!(message_id(&msgs[0]), new_id);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_side_by_side_publish_each_of_500_rows_exactly_once() {
    let env = TestEnv::new().await;
    probe::enqueue_many(&env.pool, 500, &ProbeSpec::default())
        .await
        .unwrap();
    let a = relay(&env, "relay-a", RelayConfig { batch: 20, ..cfg() });
    let b = relay(&env, "relay-b", RelayConfig { batch: 20, ..cfg() });
    let (ch_a, ch_b) = (env.confirm_channel().await, env.confirm_channel().await);

    async fn run(r: &Relay, ch: &lapin::Channel) -> (usize, usize, usize) {
        let (mut claimed, mut dispatched, mut rounds) = (0, 0, 0);
        loop {
            let got = round(r, ch, Kind::Probe).await;
            assert_eq!(got.released + got.dead, 0, "{got:?}");
            if got.claimed == 0 {
                return (claimed, dispatched, rounds);
            }
            claimed += got.claimed;
            dispatched += got.dispatched;
            rounds += 1;
        }
    }
    let ((ca, da, ra), (cb, db, rb)) = tokio::join!(run(&a, &ch_a), run(&b, &ch_b));
    assert_eq!(
        ca + cb,
        500,
        "claimed in total (a: {ca} in {ra} rounds, b: {cb} in {rb} rounds)"
    );
    assert_eq!(da + db, 500);

    let msgs = drain(&env).await;
    assert_eq!(msgs.len(), 500, "messages in the queue");
    let ids: HashSet<String> = msgs.iter().map(message_id).collect();
    assert_eq!(ids.len(), 500, "distinct delivery ids");
    let outboxes: HashSet<Uuid> = msgs.iter().map(outbox_header).collect();
    assert_eq!(outboxes.len(), 500, "distinct outbox rows");
    let (rows, once, matching): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE status = 'dispatched' AND dispatch_attempts = 1), \
           count(*) FILTER (WHERE queue_job_id = ANY($1)) FROM kfs_probe_outbox",
    )
    .bind(ids.into_iter().collect::<Vec<_>>())
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        (rows, once, matching),
        (500, 500, 500),
        "every row claimed once, each message names its row's delivery"
    );
    env.cleanup().await;
}
