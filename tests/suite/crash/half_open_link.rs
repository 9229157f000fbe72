//! A half-open link (a proxy that forwards nothing and closes nothing) never keeps a worker's
//! liveness and id locks: Postgres ends the idle session and the id is free for a restart.

use super::*;

/// The holder name a worker process logged at start (`holder=<id>#<incarnation>`).
fn logged_holder(w: &Worker) -> String {
    let log = w.log_text();
    log.split("holder=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .map(|h| h.trim_matches('"').to_owned())
        .unwrap_or_else(|| panic!("{} logged no holder\n{}", w.name, w.tail(20)))
}

/// A worker cut off behind a link that carries nothing and closes nothing (a half-open
/// connection: a partition, a firewall dropping its state) leaves Postgres a session that still
/// holds its liveness and worker-id locks, until the server notices the dead link (TCP
/// keepalive: hours by default). The session is ended after `liveness::IDLE` without a
/// statement instead, so the cut-off worker stops counting as alive and a process restarted
/// under its id is not refused.
///
/// When the link heals, the cut-off process finds its id held by the restart: it has lost its
/// identity, and exits with one error naming the id instead of running on as a holder that
/// `kfs_worker_alive` calls dead, whose every claim the others would take over (an attempt
/// each). Jobs enqueued after it healed are therefore claimed once each, by the restart only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cut_off_by_a_half_open_link_frees_its_id_for_a_restart() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new().await;
    install_claim_log(&env.pool).await;
    let (link, through) = crate::support::proxy::Proxy::before(&env.url).await;
    let e = base_env("probe=10s");
    let mut relay = spawn(&env, "r", &["--relay", "--maintenance"], &e);
    let mut cut_off = spawn(
        &env,
        "w1",
        &["--consumer"],
        &[e.as_slice(), &[("DATABASE_URL", through.as_str())]].concat(),
    );
    // Live, and its start logged (the holder line comes just after the locks are taken; on a
    // loaded machine the check can fall between the two).
    let live = env
        .wait_until(Duration::from_secs(15), || async {
            kfs_worker::liveness::count_live(&env.pool).await.unwrap() == 1
                && cut_off.log_text().contains("holder=")
        })
        .await;
    assert!(live, "w1 never started\n{}", cut_off.tail(20));
    let cut_off_holder = logged_holder(&cut_off);

    link.set_hold(true);
    // The restart reaches Postgres directly and waits for the id up to its connect timeout.
    let mut restarted = spawn(
        &env,
        "w1",
        &["--consumer"],
        &[e.as_slice(), &[("KFS_CONNECT_TIMEOUT", "30s")]].concat(),
    );
    let took = env
        .wait_until(Duration::from_secs(40), || async {
            restarted.log_text().contains("kfs-worker running")
        })
        .await;
    assert!(
        took,
        "the restart under w1 never took the id while the cut-off session lingered\n{}",
        restarted.tail(20)
    );
    let holders: Vec<String> = sqlx::query_scalar(
        "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.granted AND l.classid = $1::oid AND l.objsubid = 2 \
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .bind(kfs_worker::liveness::ID_NAMESPACE)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(holders.len(), 1, "one session holds the id w1: {holders:?}");
    assert_eq!(
        kfs_worker::liveness::count_live(&env.pool).await.unwrap(),
        1,
        "only the restart counts as alive"
    );

    // The link heals: the cut-off process reaches Postgres again, its id now the restart's.
    link.heal();
    let exited = cut_off.exited(Duration::from_secs(30)).await;
    const JOBS: i64 = 8;
    probe::enqueue_many(&env.pool, JOBS, &probe_spec(3, 1000))
        .await
        .unwrap();
    let done = wait_all_terminal(&env, Duration::from_secs(90)).await;
    assert!(
        done,
        "not every job ended: {:?}\n{}\n{}",
        support::probe_states(&env.pool).await,
        restarted.tail(20),
        cut_off.tail(20)
    );
    let by_cut_off = count(
        &env.pool,
        &format!("SELECT count(*) FROM crash_claims WHERE worker_id = '{cut_off_holder}'"),
    )
    .await;
    let burnt: Vec<(Uuid, i32)> = sqlx::query_as(
        "SELECT id, execution_attempts FROM kfs_probe_jobs WHERE execution_attempts > 1 ORDER BY id",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert!(
        by_cut_off == 0 && burnt.is_empty(),
        "after the restart took w1, the cut-off process ({cut_off_holder}) claimed {by_cut_off} \
         jobs as a dead holder; jobs that used more than one attempt: {burnt:?}\n{}",
        cut_off.tail(20)
    );
    assert!(
        exited.is_some_and(|s| !s.success()),
        "the cut-off process, its id taken, did not exit with an error: {exited:?}\n{}",
        cut_off.tail(20)
    );
    let log = cut_off.log_text();
    let errors: Vec<&str> = log.lines().filter(|l| l.starts_with("error:")).collect();
    assert!(
        errors.len() == 1
            && errors[0].contains("worker id \"w1\" was taken by another live process"),
        "the cut-off process did not end with one error naming its id: {errors:?}\n{}",
        cut_off.tail(20)
    );
    support::stop_cleanly([&mut restarted, &mut relay], Duration::from_secs(20)).await;
    assert_history(&env.pool).await;
    env.cleanup().await;
}

/// A process's liveness session can be ended by Postgres from its first lock on: a link cut off
/// right after the start-up took the locks, before the holding loop ran any statement, frees the
/// worker id within the idle end. Before, the idle end was set by the holding loop, so a cut in
/// that window kept the id (and the process looking alive) for as long as the link stayed
/// half-open, and a restart under the id waited out its connect timeout and was refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_cut_off_right_after_the_liveness_locks_are_taken_frees_them_once_idle() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new().await;
    let (link, through) = crate::support::proxy::Proxy::before(&env.url).await;
    let url = kfs_worker::config::database_url(Some(through.as_str())).unwrap();
    let holder = kfs_worker::liveness::holder("cut-at-start");
    let session = kfs_worker::liveness::acquire_process(&url, &holder)
        .await
        .unwrap();
    assert_eq!(
        kfs_worker::liveness::count_live(&env.pool).await.unwrap(),
        1,
        "the locks were taken"
    );
    link.set_hold(true);
    let freed = env
        .wait_until(kfs_worker::liveness::IDLE * 3, || async {
            kfs_worker::liveness::count_live(&env.pool).await.unwrap() == 0
        })
        .await;
    assert!(
        freed,
        "a session cut off right after taking the liveness locks still held them after {:?}",
        kfs_worker::liveness::IDLE * 3
    );
    drop(session);
    link.heal();
    env.cleanup().await;
}
