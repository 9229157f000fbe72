//! The claim and the mark keep plans that use the indexes: planned on a nearly empty outbox, they
//! never read the whole outbox or job table later.

use super::*;

/// The sequential scans of `table` counted so far, read afresh.
/// Waits until no session named `application` is left in `env`'s database (a session that ends
/// reports its table counters first); `false` if one still is after [`HANG`].
async fn ended(env: &TestEnv, application: &str) -> bool {
    env.wait_until(HANG, || async {
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
                .bind(application)
                .fetch_one(&env.pool)
                .await
                .unwrap();
        left == 0
    })
    .await
}

async fn seq_scans(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar("SELECT seq_scan FROM pg_stat_user_tables WHERE relid = $1::regclass")
        .bind(table)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A connection keeps the plans it made of a statement at its first executions. The relay's
/// claim and mark were planned while the outbox held a handful of rows and no analyse had run,
/// so they counted the window, updated the claimed rows and found the marked jobs by reading
/// the whole outbox and job table; as both grew, every lone job's claim read more (2.7 ms
/// after 6,000 jobs). Planned for the indexes, neither statement reads a table through.
///
/// Counted with `pg_stat_user_tables.seq_scan` over rounds that only the relay's own
/// connection runs: the relay planned its statements on 8 rows, then relays 12 more one at a
/// time over 5,000 rows.
#[tokio::test]
async fn the_claim_and_the_mark_planned_on_a_nearly_empty_outbox_never_read_the_whole_of_it_later()
{
    let env = TestEnv::new().await;
    for table in ["kfs_probe_outbox", "kfs_probe_jobs"] {
        sqlx::query(&format!(
            "ALTER TABLE {table} SET (autovacuum_enabled = false)"
        ))
        .execute(&env.pool)
        .await
        .unwrap();
    }
    // One connection, so every claim and mark runs on the connection that planned them.
    let own = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(
            PgConnectOptions::from_str(&env.url)
                .unwrap()
                .application_name("relay-plans"),
        )
        .await
        .unwrap();
    let r = Relay::new(
        own.clone(),
        env.topology.clone(),
        "relay-plans",
        RelayConfig { batch: 1, ..cfg() },
        &[Kind::Probe],
    );
    let ch = env.confirm_channel().await;
    let one_at_a_time = |n: usize| {
        let (r, ch) = (&r, &ch);
        async move {
            for _ in 0..n {
                let got = round(r, ch, Kind::Probe).await;
                assert_eq!((got.claimed, got.dispatched), (1, 1), "{got:?}");
            }
        }
    };
    probe::enqueue_many(&env.pool, 8, &ProbeSpec::default())
        .await
        .unwrap();
    one_at_a_time(8).await;
    // The outbox and the jobs grow; nothing analyses them. On a session of its own, which ends
    // (and reports its counters, among them the update's read of the whole outbox) before the
    // counting starts: a busy server may report an idle session's counters seconds late.
    let setup = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(
            PgConnectOptions::from_str(&env.url)
                .unwrap()
                .application_name("relay-plans-setup"),
        )
        .await
        .unwrap();
    probe::enqueue_many(&setup, 5_000, &ProbeSpec::default())
        .await
        .unwrap();
    sqlx::query("UPDATE kfs_probe_outbox SET status = 'canceled' WHERE status = 'pending'")
        .execute(&setup)
        .await
        .unwrap();
    probe::enqueue_many(&setup, 12, &ProbeSpec::default())
        .await
        .unwrap();
    setup.close().await;
    let setup_gone = ended(&env, "relay-plans-setup").await;
    assert!(setup_gone, "the setup's session did not end");
    let analysed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_user_tables WHERE relname IN ('kfs_probe_outbox', 'kfs_probe_jobs') \
           AND (last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL)",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(analysed, 0, "the tables must have no statistics");
    // Sessions report their table counters within a second of going idle: wait until every
    // other session's scans are in, then count from zero.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    for table in ["kfs_probe_outbox", "kfs_probe_jobs"] {
        sqlx::query("SELECT pg_stat_reset_single_table_counters($1::regclass)")
            .bind(table)
            .execute(&env.pool)
            .await
            .unwrap();
    }

    // Rounds counted, one lone job each.
    const ROUNDS: usize = 12;
    one_at_a_time(ROUNDS).await;

    // A session that ends reports its counters first.
    own.close().await;
    let gone = ended(&env, "relay-plans").await;
    assert!(gone, "the relay's session did not end");
    let (outbox, jobs) = (
        seq_scans(&env.pool, "kfs_probe_outbox").await,
        seq_scans(&env.pool, "kfs_probe_jobs").await,
    );
    // The counters are the database's, and a session reports what it scanned when it can. On a
    // loaded server this once counted 5 reads of the outbox: as many as the migration builds
    // indexes on it (each build counts as a read of the table), most likely reported late by
    // the migration's session. A connection keeps its plan, so a statement planned to read a
    // table through reads it at every round: fewer reads than rounds proves neither was.
    let rounds = ROUNDS as i64;
    assert!(
        outbox < rounds && jobs < rounds,
        "{ROUNDS} lone claims and marks read the whole outbox {outbox} times and the whole job table {jobs} times"
    );
    env.cleanup().await;
}
