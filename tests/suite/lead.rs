//! One relay leads each kind (`relay::lead`) against a real Postgres and RabbitMQ: of two relays
//! one holds the kind's lead lock and the other stands by; the standby takes the kind when the
//! leader stops, and relays what comes after; a leader that stops looking is cut off by Postgres;
//! a relay whose lead session ends relays every kind until it has a session again.

use std::collections::BTreeSet;
use std::time::Duration;

use kfs_worker::jobs::probe::{self, ProbeSpec};
use kfs_worker::jobs::Kind;
use kfs_worker::relay::lead::{Lead, IDLE, LEAD_NAMESPACE};
use kfs_worker::runtime::{self, RunOptions};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::support::TestEnv;

/// A bound on waits that end in milliseconds when the behaviour works; never a timing assertion.
const HANG: Duration = Duration::from_secs(30);

fn relay_only(env: &TestEnv, worker: &str) -> RunOptions {
    RunOptions {
        consumer: false,
        maintenance: false,
        ..crate::engine::options(env, worker)
    }
}

/// The application names of the sessions holding the probe kind's lead lock of `env`'s prefix.
async fn leaders(env: &TestEnv) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT coalesce(a.application_name, '') FROM pg_locks l \
           JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.granted AND l.classid = $1::oid \
           AND l.objid = hashtext($2)::oid AND l.objsubid = 2 \
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .bind(LEAD_NAMESPACE)
    .bind(format!("{}/probe", env.topology.prefix))
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

async fn dispatched(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM kfs_probe_outbox WHERE status = 'dispatched'")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn of_two_relays_one_leads_a_kind_and_the_other_takes_it_over_when_the_first_stops() {
    let env = TestEnv::new().await;
    let (stop_a, stop_b) = (CancellationToken::new(), CancellationToken::new());
    let a = tokio::spawn(runtime::run(relay_only(&env, "lead-a"), stop_a.clone()));
    assert!(
        env.wait_until(HANG, || async { leaders(&env).await.len() == 1 })
            .await,
        "the first relay never took the lead"
    );
    let b = tokio::spawn(runtime::run(relay_only(&env, "lead-b"), stop_b.clone()));
    // b's relay session is up once its listener is: wait for several of its looks.
    assert!(
        env.wait_until(HANG, || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'kfs-worker lead-b%'",
            )
            .fetch_one(&env.pool)
            .await
            .unwrap()
                > 0
        })
        .await,
        "the second relay never connected"
    );
    tokio::time::sleep(kfs_worker::relay::lead::LOOK * 4).await;
    let now = leaders(&env).await;
    assert_eq!(
        now.len(),
        1,
        "one lead of the kind with two relays: {now:?}"
    );
    assert!(
        now[0].starts_with("kfs-worker lead-a"),
        "the first relay keeps it: {now:?}"
    );

    probe::enqueue_many(&env.pool, 20, &ProbeSpec::default())
        .await
        .unwrap();
    assert!(
        env.wait_until(HANG, || async { dispatched(&env.pool).await == 20 })
            .await,
        "the leader relayed the first 20"
    );

    stop_a.cancel();
    tokio::time::timeout(HANG, a)
        .await
        .expect("shutdown within bound")
        .unwrap()
        .unwrap();
    assert!(
        env.wait_until(HANG, || async {
            let l = leaders(&env).await;
            l.len() == 1 && l[0].starts_with("kfs-worker lead-b")
        })
        .await,
        "the standby never took the lead: {:?}",
        leaders(&env).await
    );
    probe::enqueue_many(&env.pool, 20, &ProbeSpec::default())
        .await
        .unwrap();
    assert!(
        env.wait_until(HANG, || async { dispatched(&env.pool).await == 40 })
            .await,
        "the new leader relayed what came after: {} dispatched",
        dispatched(&env.pool).await
    );
    stop_b.cancel();
    tokio::time::timeout(HANG, b)
        .await
        .expect("shutdown within bound")
        .unwrap()
        .unwrap();
    env.cleanup().await;
}

async fn answered(lead: &mut Lead) -> BTreeSet<Kind> {
    lead.look();
    tokio::time::timeout(HANG, lead.answer())
        .await
        .expect("a look hung")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_stops_looking_is_cut_off_and_a_standby_takes_the_kind() {
    let env = TestEnv::new().await;
    let prefix = env.topology.prefix.clone();
    let mut first = Lead::new(env.pool.clone(), &prefix, vec![Kind::Probe]);
    let mut second = Lead::new(env.pool.clone(), &prefix, vec![Kind::Probe]);
    let probe_only: BTreeSet<Kind> = [Kind::Probe].into();
    assert_eq!(
        answered(&mut first).await,
        probe_only,
        "the first to look leads"
    );
    assert_eq!(
        answered(&mut second).await,
        BTreeSet::new(),
        "the second stands by"
    );
    // The first's last statement ends after this instant, and Postgres counts its silence from
    // that statement's end.
    let silent = tokio::time::Instant::now();
    assert_eq!(
        answered(&mut first).await,
        probe_only,
        "a leader that looks keeps the kind"
    );
    // The first stops looking, as a paused process would; Postgres ends its session while the
    // second goes on looking, and takes the kind once it is free.
    let mut took = false;
    while silent.elapsed() < IDLE + HANG && !took {
        tokio::time::sleep(kfs_worker::relay::lead::LOOK).await;
        took = answered(&mut second).await == probe_only;
    }
    assert!(took, "the standby never took the silent leader's kind");
    assert!(
        silent.elapsed() >= IDLE,
        "taken before the silent leader's session could have been ended"
    );
    assert_eq!(
        leaders(&env).await.len(),
        1,
        "the standby holds the lead lock (not relaying every kind for want of a session)"
    );
    assert_eq!(
        answered(&mut first).await,
        probe_only,
        "the cut-off leader's look fails: it relays every kind until a session answers"
    );
    assert_eq!(
        answered(&mut first).await,
        BTreeSet::new(),
        "with a session again, it stands by for the new leader"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_lead_session_is_ended_relays_every_kind_until_it_leads_again() {
    let env = TestEnv::new().await;
    let prefix = env.topology.prefix.clone();
    let kinds = vec![Kind::Probe, Kind::Compile];
    let mut other = Lead::new(env.pool.clone(), &prefix, vec![Kind::Compile]);
    let compile_only: BTreeSet<Kind> = [Kind::Compile].into();
    assert_eq!(answered(&mut other).await, compile_only);
    let mut lead = Lead::new(env.pool.clone(), &prefix, kinds.clone());
    let probe_only: BTreeSet<Kind> = [Kind::Probe].into();
    assert_eq!(
        answered(&mut lead).await,
        probe_only,
        "another relay leads compile"
    );
    let ended: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(l.pid)) FROM pg_locks l \
         WHERE l.locktype = 'advisory' AND l.granted AND l.classid = $1::oid \
           AND l.objid = hashtext($2)::oid AND l.objsubid = 2",
    )
    .bind(LEAD_NAMESPACE)
    .bind(format!("{prefix}/probe"))
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(ended, 1, "the probe lead's session");
    let every: BTreeSet<Kind> = kinds.iter().copied().collect();
    assert_eq!(
        answered(&mut lead).await,
        every,
        "no session: every kind, as relays side by side"
    );
    assert_eq!(
        answered(&mut lead).await,
        probe_only,
        "a new session leads what nobody else leads"
    );
    env.cleanup().await;
}
