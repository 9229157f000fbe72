//! Wake-ups without the poll: writers skip their notification only while a relay watches, lone
//! jobs are published on their notifications, and no row waits for the poll around the watch.

use super::*;

/// Calls the relay's watch function `f` (`kfs_outbox_watch` or `kfs_outbox_unwatch`) for the
/// probe outbox on `conn`.
async fn watch(conn: &mut PgConnection, f: &str) -> bool {
    sqlx::query_scalar::<_, bool>(&format!("SELECT {f}($1)"))
        .bind(Kind::Probe.spec().outbox_table)
        .fetch_one(conn)
        .await
        .unwrap()
}

/// The next notification on `listener`, if one comes within `within`.
async fn notified_within(
    listener: &mut sqlx::postgres::PgListener,
    within: Duration,
) -> Option<String> {
    tokio::time::timeout(within, listener.recv())
        .await
        .ok()
        .map(|n| n.expect("listener").payload().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_skip_their_notification_only_while_a_relay_watches_and_it_lets_go_only_after_they_end(
) {
    let env = TestEnv::new().await;
    let mut listener = sqlx::postgres::PgListener::connect_with(&env.pool)
        .await
        .unwrap();
    listener.listen("kfs_outbox").await.unwrap();
    let mut relay_a = PgConnection::connect(&env.url).await.unwrap();
    let mut relay_b = PgConnection::connect(&env.url).await.unwrap();

    // No watcher: every writer notifies, as before.
    enqueue_one(&env.pool, &ProbeSpec::default()).await;
    assert_eq!(
        notified_within(&mut listener, HANG).await.as_deref(),
        Some(Kind::Probe.event_type()),
        "a writer with no relay watching notifies"
    );

    assert!(watch(&mut relay_a, "kfs_outbox_watch").await, "A watches");
    assert!(
        !watch(&mut relay_b, "kfs_outbox_watch").await,
        "one watcher per outbox"
    );

    // A writer while A watches: no notification, and A cannot let go while it is in flight.
    let mut writer = env.pool.begin().await.unwrap();
    probe::enqueue(&mut writer, &ProbeSpec::default())
        .await
        .unwrap();
    assert!(
        !watch(&mut relay_a, "kfs_outbox_unwatch").await,
        "a writer that skipped its notification is still in flight: A keeps watching"
    );
    writer.commit().await.unwrap();
    assert_eq!(
        notified_within(&mut listener, Duration::from_millis(500)).await,
        None,
        "the writer did not notify: A looks for its row itself"
    );
    assert!(
        watch(&mut relay_a, "kfs_outbox_unwatch").await,
        "its writer ended: A lets go"
    );

    // After A let go, writers notify again, and another relay may watch.
    enqueue_one(&env.pool, &ProbeSpec::default()).await;
    assert_eq!(
        notified_within(&mut listener, HANG).await.as_deref(),
        Some(Kind::Probe.event_type()),
        "a writer after the watcher let go notifies"
    );
    assert!(watch(&mut relay_b, "kfs_outbox_watch").await, "B watches");
    // A watch ends with its session, whatever happens to the relay.
    drop(relay_b);
    let mut relay_c = PgConnection::connect(&env.url).await.unwrap();
    assert!(
        env.wait_until(HANG, || {
            let url = env.url.clone();
            async move {
                let mut c = PgConnection::connect(&url).await.unwrap();
                watch(&mut c, "kfs_outbox_watch").await
            }
        })
        .await,
        "the watch of a closed session is free"
    );
    assert!(
        watch(&mut relay_c, "kfs_outbox_unwatch").await,
        "letting go of a watch not held is harmless"
    );
    drop(relay_c);
    drop(relay_a);
    env.cleanup().await;
}

/// How many probe outbox rows are `dispatched`.
async fn dispatched_probes(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM kfs_probe_outbox WHERE status = 'dispatched'")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A relay process of the probe kind whose poll is an hour away, so that only wake-ups and its
/// own looks publish; returned once it is up and listening, which its publishing a first row
/// shows. No consumer runs, so its window is set wider than every row these tests write.
async fn relay_polling_hourly(env: &TestEnv, name: &str) -> support::Worker {
    let relay = env.spawn_worker(
        name,
        &["run", "--relay"],
        &[
            ("KFS_KINDS", "probe"),
            ("KFS_RELAY_POLL", "60m"),
            ("KFS_RELAY_WINDOW", "100000"),
        ],
    );
    enqueue_one(&env.pool, &ProbeSpec::default()).await;
    assert!(
        env.wait_until(HANG, || async { dispatched_probes(&env.pool).await == 1 })
            .await,
        "the relay never published a first row\n{}",
        relay.tail(30)
    );
    relay
}

/// Samples `pg_locks` of the test's database until `stop`: whether any session held the probe
/// outbox's watch (migration 0102) meanwhile.
fn sample_watch(pool: PgPool, stop: CancellationToken) -> tokio::task::JoinHandle<bool> {
    tokio::spawn(async move {
        let mut conn = pool.acquire().await.unwrap();
        while !stop.is_cancelled() {
            let held: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
                   AND mode = 'ExclusiveLock' AND granted AND classid = 7038583 \
                   AND objid = hashtext('kfs_probe_outbox')::oid AND objsubid = 2 \
                   AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))",
            )
            .fetch_one(&mut *conn)
            .await
            .unwrap();
            if held {
                return true;
            }
        }
        false
    })
}

/// A relay takes the watch only in a burst: lone jobs, each committed after the last was
/// published, are published on their notifications and never make it watch (which would cost
/// each of them two more calls).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lone_jobs_are_published_on_their_notifications_without_a_watch() {
    let env = TestEnv::new().await;
    let mut relay = relay_polling_hourly(&env, "relay-lone").await;
    let dispatched = || dispatched_probes(&env.pool);
    let stop = CancellationToken::new();
    let sampler = sample_watch(env.pool.clone(), stop.clone());
    for n in 2..=30 {
        enqueue_one(&env.pool, &ProbeSpec::default()).await;
        assert!(
            env.wait_until(HANG, || async { dispatched().await == n })
                .await,
            "lone job {n} was not published on its notification\n{}",
            relay.tail(30)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.cancel();
    let watched = sampler.await.unwrap();
    relay.kill();
    assert!(!watched, "a lone job made the relay watch");
    env.cleanup().await;
}

/// With the poll out of the way (an hour away), every row is published on wake-ups and the relay's
/// own looks alone: writers in bursts, some keeping their transaction open after the insert,
/// while the relay watches and lets go again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_row_waits_for_the_poll_while_writers_come_and_go_around_the_watch() {
    let env = TestEnv::new().await;
    let mut relay = relay_polling_hourly(&env, "relay-watch").await;
    let dispatched = || dispatched_probes(&env.pool);
    const WRITERS: usize = 8;
    const EACH: usize = 40;
    let stop = CancellationToken::new();
    let sampler = sample_watch(env.pool.clone(), stop.clone());
    let mut writers = tokio::task::JoinSet::new();
    for w in 0..WRITERS {
        let pool = env.pool.clone();
        writers.spawn(async move {
            for i in 0..EACH {
                let mut tx = pool.begin().await.unwrap();
                probe::enqueue(&mut tx, &ProbeSpec::default())
                    .await
                    .unwrap();
                // Some keep their transaction open a while after the insert; some pause
                // between requests long enough for the relay to let go.
                if (w + i) % 3 == 0 {
                    tokio::time::sleep(Duration::from_millis(((w * 7 + i) % 5) as u64 * 10)).await;
                }
                tx.commit().await.unwrap();
                if (w * 3 + i) % 7 == 0 {
                    tokio::time::sleep(Duration::from_millis(((w + i) % 11) as u64 * 3)).await;
                }
            }
        });
    }
    while let Some(r) = writers.join_next().await {
        r.unwrap();
    }
    let total = (WRITERS * EACH) as i64 + 1;
    let all_out = env
        .wait_until(HANG, || async { dispatched().await == total })
        .await;
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM kfs_probe_outbox WHERE status = 'pending'")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    stop.cancel();
    let watched = sampler.await.unwrap();
    relay.kill();
    assert!(
        all_out,
        "{left} of {total} rows still pending with the poll an hour away: a wake-up was lost\n{}",
        relay.tail(30)
    );
    assert!(watched, "the writers' bursts never made the relay watch");
    env.cleanup().await;
}
