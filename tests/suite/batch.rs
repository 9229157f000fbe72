//! The batched engine against the real Postgres: deliveries claimed in one statement, a group of
//! jobs stepped in one transaction per step, and a member that fails or is fenced out going its
//! own way while the others commit once.

use std::sync::Arc;
use std::time::Duration;

use kfs_worker::consumer::{ConsumerConfig, Engine, Handled};
use kfs_worker::engine::group;
use kfs_worker::engine::lease::{self, Delivered, DeliveryRef, Statements};
use kfs_worker::engine::runner::{CrashPoints, Env, LEASE_LOST};
use kfs_worker::jobs::probe::{ProbeHandler, ProbeSpec};
use kfs_worker::jobs::{JobCtx, Kind, Policy};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::support::{self, dispatch, enqueue_one, TestEnv};

/// A bound on calls that must not block; never a timing assertion.
const HANG: Duration = Duration::from_secs(60);

fn engine(env: &TestEnv) -> Engine {
    Engine::new(
        env.pool.clone(),
        "batch-worker",
        vec![Arc::new(ProbeHandler)],
        ConsumerConfig::default(),
    )
    .with_heartbeat_pool(heartbeat_pool(env))
}

/// A heartbeat pool of the size a worker process has: its few connections are what every
/// lease's beats share, so a test with the suite's large pool would hide a beat that waits.
fn heartbeat_pool(env: &TestEnv) -> PgPool {
    let url = kfs_worker::config::database_url(Some(&env.url)).unwrap();
    let options =
        kfs_worker::db::session_options(&url, "kfs-worker batch test heartbeats", None).unwrap();
    kfs_worker::db::lazy_pool(
        options,
        kfs_worker::runtime::HEARTBEAT_CONNECTIONS,
        Duration::from_secs(10),
    )
}

/// `n` probe jobs of `spec`, each put out for delivery as the relay leaves it.
async fn dispatched(env: &TestEnv, n: usize, spec: &ProbeSpec) -> Vec<DeliveryRef> {
    let mut refs = Vec::with_capacity(n);
    for _ in 0..n {
        let (_, outbox) = enqueue_one(&env.pool, spec).await;
        refs.push(dispatch(&env.pool, Kind::Probe, outbox).await);
    }
    refs
}

async fn process_refs(engine: &Engine, refs: &[DeliveryRef]) -> Vec<Handled> {
    tokio::time::timeout(HANG, engine.process_refs(refs, &CancellationToken::new()))
        .await
        .expect("process_refs hung")
}

fn ack(claim: &'static str, end: &'static str) -> Handled {
    Handled::Ack {
        claim,
        end: Some(end),
    }
}

/// How many distinct transactions wrote the effects of `jobs`.
async fn effect_transactions(pool: &PgPool, jobs: &[Uuid]) -> i64 {
    sqlx::query_scalar(
        "SELECT count(DISTINCT xmin::text) FROM kfs_probe_effects WHERE job_id = ANY($1)",
    )
    .bind(jobs)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn state(pool: &PgPool, job: Uuid) -> (String, String) {
    sqlx::query_as("SELECT j.run_state, o.status FROM kfs_probe_jobs j JOIN kfs_probe_outbox o ON o.probe_job_id = j.id WHERE j.id = $1")
        .bind(job)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_that_arrive_together_are_stepped_in_one_transaction_per_step_and_each_effect_is_written_once(
) {
    let env = TestEnv::new().await;
    let spec = ProbeSpec {
        steps: 3,
        ..ProbeSpec::default()
    };
    let refs = dispatched(&env, 12, &spec).await;
    let engine = engine(&env);
    let handled = process_refs(&engine, &refs).await;
    assert_eq!(handled, vec![ack("claimed", "succeeded"); 12]);
    support::assert_probe_invariants(&env.pool).await;
    let jobs: Vec<Uuid> = refs.iter().map(|d| d.job_id).collect();
    // Three steps of twelve jobs, each step of all of them in one commit: three transactions,
    // where twelve slices of their own would have taken thirty-six.
    assert_eq!(effect_transactions(&env.pool, &jobs).await, 3);
    // Every checkpoint still moved once per step: the row version counts claim + 2 advances +
    // the end.
    let versions: Vec<i32> =
        sqlx::query_scalar("SELECT row_version FROM kfs_probe_jobs WHERE id = ANY($1)")
            .bind(&jobs)
            .fetch_all(&env.pool)
            .await
            .unwrap();
    assert!(versions.iter().all(|&v| v == 5), "{versions:?}");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_member_fails_or_retries_alone_and_the_others_commit_once() {
    let env = TestEnv::new().await;
    let good = ProbeSpec {
        steps: 2,
        ..ProbeSpec::default()
    };
    let mut refs = dispatched(&env, 6, &good).await;
    let fatal = dispatched(
        &env,
        1,
        &ProbeSpec {
            fail_mode: "fatal",
            ..good.clone()
        },
    )
    .await;
    let retry = dispatched(
        &env,
        1,
        &ProbeSpec {
            fail_mode: "retry_once",
            ..good.clone()
        },
    )
    .await;
    refs.insert(2, fatal[0].clone());
    refs.insert(5, retry[0].clone());
    let engine = engine(&env);
    let handled = process_refs(&engine, &refs).await;
    for (i, (d, h)) in refs.iter().zip(&handled).enumerate() {
        let want = if d.job_id == fatal[0].job_id {
            ack("claimed", "failed")
        } else if d.job_id == retry[0].job_id {
            ack("claimed", "wait")
        } else {
            ack("claimed", "succeeded")
        };
        assert_eq!(h, &want, "delivery {i}");
    }
    for d in &refs {
        let effects = support::probe_effects(&env.pool, d.job_id).await;
        let st = state(&env.pool, d.job_id).await;
        if d.job_id == fatal[0].job_id {
            assert_eq!(effects, vec![], "the failed member wrote nothing");
            assert_eq!(st, ("failed".into(), "dead".into()));
        } else if d.job_id == retry[0].job_id {
            assert_eq!(
                effects,
                vec![],
                "the retrying member's step was rolled back"
            );
            assert_eq!(st, ("retry_wait".into(), "pending".into()));
        } else {
            assert_eq!(effects, vec![(1, 1), (2, 1)], "{}", d.job_id);
            assert_eq!(st, ("succeeded".into(), "completed".into()));
        }
    }
    env.cleanup().await;
}

/// The crash points a test group passes through: none of them is armed in this binary.
static POINTS: CrashPoints = CrashPoints {
    after_step: "after-step-commit",
    after_end: None,
    before_end: None,
};

/// Claims the jobs of `refs` in one batched claim under `lease`, as the consumer would.
async fn claim_all(env: &TestEnv, refs: &[DeliveryRef], lease: Duration) -> Vec<JobCtx> {
    let st = Statements::new(Kind::Probe.spec());
    let pairs: Vec<(&DeliveryRef, Uuid)> = refs.iter().map(|d| (d, Uuid::new_v4())).collect();
    let mut conn = env.pool.acquire().await.unwrap();
    lease::claim_many(&mut conn, &st, &pairs, "batch-worker", lease)
        .await
        .unwrap()
}

/// Runs claimed probe jobs as one group under `policy`; returns each member's end.
async fn run_group(
    env: &TestEnv,
    jobs: Vec<JobCtx>,
    policy: Policy,
) -> Vec<(Uuid, Option<&'static str>)> {
    let tr = Delivered {
        statements: Arc::new(Statements::new(Kind::Probe.spec())),
        handler: Arc::new(ProbeHandler),
        policy,
    };
    let shutdown = CancellationToken::new();
    let beats = heartbeat_pool(env);
    let env_ = Env {
        pool: &env.pool,
        heartbeat_pool: &beats,
        budget: Default::default(),
        shutdown: &shutdown,
        points: &POINTS,
        keep_connection: true,
    };
    tokio::time::timeout(HANG, group::run_group(&tr, jobs, None, env_))
        .await
        .expect("the group hung")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_fenced_out_after_the_group_claim_writes_nothing_and_the_others_commit_once() {
    let env = TestEnv::new().await;
    let spec = ProbeSpec {
        steps: 2,
        ..ProbeSpec::default()
    };
    let refs = dispatched(&env, 5, &spec).await;
    let policy = Kind::Probe.spec().policy;
    let jobs = claim_all(&env, &refs, Duration::from_secs(30)).await;
    assert_eq!(jobs.len(), 5, "the batched claim takes every job");
    // Between the claim and the group's first fence, another writer (a pause, a takeover)
    // moves one member's row on.
    let fenced_out = refs[3].job_id;
    sqlx::query("UPDATE kfs_probe_jobs SET row_version = row_version + 1 WHERE id = $1")
        .bind(fenced_out)
        .execute(&env.pool)
        .await
        .unwrap();
    let ends = run_group(&env, jobs, policy).await;
    assert_eq!(ends.len(), 5);
    for (id, end) in ends {
        let effects = support::probe_effects(&env.pool, id).await;
        if id == fenced_out {
            assert_eq!(end, Some(LEASE_LOST));
            assert_eq!(effects, vec![], "the fenced-out member wrote nothing");
        } else {
            assert_eq!(end, Some("succeeded"), "{id}");
            assert_eq!(effects, vec![(1, 1), (2, 1)], "{id}");
        }
    }
    env.cleanup().await;
}

/// The group's transaction holds every member's row, so no heartbeat extends a member's lease
/// while it runs. Four members whose steps take 1.75 s each, under a 5 s lease, would keep it
/// open past every lease (7 s): the group must commit what fits in a heartbeat interval
/// (1.67 s) and let the members go on alone, each finishing on the lease of its first claim.
/// (The lease leaves a member's heartbeat 3.3 s of slack, so a loaded test machine does not
/// make it lose a lease the engine kept.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_whose_steps_outlast_a_heartbeat_interval_commits_what_fits_and_every_member_finishes_on_its_first_lease(
) {
    let env = TestEnv::new().await;
    let spec = ProbeSpec {
        steps: 2,
        step_sleep: Duration::from_millis(1750),
        ..ProbeSpec::default()
    };
    let refs = dispatched(&env, 4, &spec).await;
    let lease = Duration::from_secs(5);
    let jobs = claim_all(&env, &refs, lease).await;
    assert_eq!(jobs.len(), 4, "the batched claim takes every job");
    let policy = Policy {
        lease,
        ..Kind::Probe.spec().policy
    };
    let ends = run_group(&env, jobs, policy).await;
    assert_eq!(ends.len(), 4);
    for (id, end) in ends {
        assert_eq!(end, Some("succeeded"), "{id}");
        assert_eq!(
            support::probe_effects(&env.pool, id).await,
            vec![(1, 1), (2, 1)],
            "{id}"
        );
        let attempts: i32 =
            sqlx::query_scalar("SELECT execution_attempts FROM kfs_probe_jobs WHERE id = $1")
                .bind(id)
                .fetch_one(&env.pool)
                .await
                .unwrap();
        assert_eq!(attempts, 1, "{id} was claimed again");
    }
    support::assert_probe_invariants(&env.pool).await;
    env.cleanup().await;
}

/// A lease's heartbeats fall due one interval (lease/3) after it was last renewed, wherever
/// the job runs meanwhile. Here the group begins 0.9 s into its members' 2 s leases (a worker
/// waiting for a connection, say), and its steps of 250 ms disband it before its own interval
/// has passed. Counting from when each member went on alone, its first heartbeat would come
/// 0.67 s later, past the end of the lease it was claimed under: every member would lose it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_going_on_alone_late_in_their_leases_are_heartbeaten_by_the_claims_clock_and_finish(
) {
    let env = TestEnv::new().await;
    let spec = ProbeSpec {
        steps: 4,
        step_sleep: Duration::from_millis(250),
        ..ProbeSpec::default()
    };
    let refs = dispatched(&env, 4, &spec).await;
    let lease = Duration::from_secs(2);
    let jobs = claim_all(&env, &refs, lease).await;
    assert_eq!(jobs.len(), 4, "the batched claim takes every job");
    let mut ids: Vec<Uuid> = jobs.iter().map(|j| j.job_id).collect();
    ids.sort();
    tokio::time::sleep(Duration::from_millis(900)).await;
    let policy = Policy {
        lease,
        ..Kind::Probe.spec().policy
    };
    let ends = run_group(&env, jobs, policy).await;
    assert_eq!(ends.len(), 4);
    for (id, end) in ends {
        assert_eq!(end, Some("succeeded"), "{id}");
        assert_eq!(
            support::probe_effects(&env.pool, id).await,
            vec![(1, 1), (2, 1), (3, 1), (4, 1)],
            "{id}"
        );
    }
    // The group did go apart: its one step took the first two members (in id order), and the
    // other two took their first steps alone.
    let first_steps: Vec<String> = sqlx::query_scalar(
        "SELECT xmin::text FROM kfs_probe_effects WHERE step = 1 AND job_id = ANY($1) \
         ORDER BY job_id",
    )
    .bind(&ids)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(first_steps.len(), 4);
    assert_eq!(
        first_steps[0], first_steps[1],
        "the group stepped the first two"
    );
    assert_ne!(first_steps[1], first_steps[2], "the third went on alone");
    assert_ne!(first_steps[2], first_steps[3], "the fourth went on alone");
    let claimed_again: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM kfs_probe_jobs WHERE id = ANY($1) AND execution_attempts <> 1",
    )
    .bind(&ids)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(claimed_again, 0, "no member was claimed again");
    support::assert_probe_invariants(&env.pool).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_claims_each_job_once_and_judges_stale_and_repeated_deliveries_alone() {
    let env = TestEnv::new().await;
    let refs = dispatched(&env, 4, &ProbeSpec::default()).await;
    // A delivery the relay has since replaced, and the same delivery twice.
    let mut stale = refs[1].clone();
    stale.delivery_id = "an-older-delivery".into();
    let batch = vec![
        refs[0].clone(),
        stale,
        refs[1].clone(),
        refs[2].clone(),
        refs[2].clone(),
        refs[3].clone(),
    ];
    // The worker is alive, as a running one is: a repeat of its live lease is no takeover.
    let _alive = kfs_worker::liveness::acquire(&env.services().database_url, "batch-worker")
        .await
        .unwrap();
    let engine = engine(&env);
    let handled = process_refs(&engine, &batch).await;
    assert_eq!(handled[0], ack("claimed", "succeeded"));
    assert_eq!(
        handled[1],
        Handled::Ack {
            claim: "stale",
            end: None
        }
    );
    assert_eq!(handled[2], ack("claimed", "succeeded"));
    assert_eq!(handled[3], ack("claimed", "succeeded"));
    // The repeat is judged while its job runs (a duplicate of a live lease) or after it ended.
    assert!(
        matches!(
            handled[4],
            Handled::Ack {
                claim: "terminal" | "duplicate" | "stale",
                end: None
            }
        ),
        "{:?}",
        handled[4]
    );
    assert_eq!(handled[5], ack("claimed", "succeeded"));
    support::assert_probe_invariants(&env.pool).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_end_takes_its_outbox_rows_in_id_order_so_it_cannot_deadlock_with_the_relays_mark()
{
    let env = TestEnv::new().await;
    let st = Statements::new(Kind::Probe.spec());
    // Two members whose job ids and outbox ids sort in opposite orders.
    let mut refs = dispatched(&env, 2, &ProbeSpec::default()).await;
    while !(refs.len() >= 2 && {
        let (a, b) = (&refs[refs.len() - 2], &refs[refs.len() - 1]);
        (a.job_id < b.job_id) != (a.outbox_id < b.outbox_id)
    }) {
        refs.extend(dispatched(&env, 1, &ProbeSpec::default()).await);
    }
    let pair = refs.split_off(refs.len() - 2);
    let pairs: Vec<(&DeliveryRef, Uuid)> = pair.iter().map(|d| (d, Uuid::new_v4())).collect();
    let mut conn = env.pool.acquire().await.unwrap();
    let mut jobs = lease::claim_many(&mut conn, &st, &pairs, "w", Duration::from_secs(60))
        .await
        .unwrap();
    drop(conn);
    assert_eq!(jobs.len(), 2);
    jobs.sort_by_key(|j| j.job_id);
    let (high, low) = if jobs[0].outbox_id > jobs[1].outbox_id {
        (jobs[0].outbox_id, jobs[1].outbox_id)
    } else {
        (jobs[1].outbox_id, jobs[0].outbox_id)
    };
    // Another writer (a relay's mark, say) holds the higher outbox row.
    let mut holder = env.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM kfs_probe_outbox WHERE id = $1 FOR UPDATE")
        .bind(high)
        .execute(&mut *holder)
        .await
        .unwrap();
    let mut ender = env.pool.acquire().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *ender)
        .await
        .unwrap();
    let ending = tokio::spawn(async move {
        let mut tx = sqlx::Connection::begin(&mut *ender).await.unwrap();
        let refs: Vec<&kfs_worker::jobs::JobCtx> = jobs.iter().collect();
        let fenced = lease::fence_many(&mut tx, &st, &refs, Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(fenced.len(), 2);
        // Given the higher outbox row first: the order of the input decides nothing.
        let mut by_outbox: Vec<&kfs_worker::jobs::JobCtx> = jobs.iter().collect();
        by_outbox.sort_by_key(|j| std::cmp::Reverse(j.outbox_id));
        let ends: Vec<(&kfs_worker::jobs::JobCtx, &str)> =
            by_outbox.into_iter().map(|j| (j, "done")).collect();
        let ended = lease::end_many(&mut tx, &st, lease::GroupEnd::Succeed, &ends)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        ended.len()
    });
    // Wait until the group's end waits for the held row.
    let waiting = env
        .wait_until(HANG, || {
            let pool = env.pool.clone();
            async move { waits_for_a_lock(&pool, pid).await }
        })
        .await;
    assert!(
        waiting,
        "the group's end never waited for the held outbox row"
    );
    // Waiting for the higher row, it already holds the lower one: it took them in id order,
    // as the relay's mark does, so the two can never each hold what the other waits for.
    let mut probe = env.pool.begin().await.unwrap();
    let lower = sqlx::query("SELECT 1 FROM kfs_probe_outbox WHERE id = $1 FOR UPDATE NOWAIT")
        .bind(low)
        .execute(&mut *probe)
        .await;
    let code = lower
        .as_ref()
        .err()
        .and_then(|e| e.as_database_error())
        .and_then(|d| d.code().map(|c| c.into_owned()));
    assert_eq!(
        code.as_deref(),
        Some("55P03"),
        "the lower outbox row must be locked by the waiting end: {lower:?}"
    );
    probe.rollback().await.unwrap();
    holder.rollback().await.unwrap();
    let ended = tokio::time::timeout(HANG, ending).await.unwrap().unwrap();
    assert_eq!(ended, 2);
    env.cleanup().await;
}

/// Whether backend `pid` waits for a lock now.
async fn waits_for_a_lock(pool: &PgPool, pid: i32) -> bool {
    sqlx::query_scalar::<_, Option<String>>(
        "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1",
    )
    .bind(pid)
    .fetch_one(pool)
    .await
    .unwrap()
    .as_deref()
        == Some("Lock")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_that_arrive_while_the_relay_marks_their_rows_are_claimed_in_the_batch() {
    let env = TestEnv::new().await;
    let st = Statements::new(Kind::Probe.spec());
    let refs = dispatched(&env, 4, &ProbeSpec::default()).await;
    let jobs: Vec<Uuid> = refs.iter().map(|d| d.job_id).collect();
    let outboxes: Vec<Uuid> = refs.iter().map(|d| d.outbox_id).collect();
    // The relay's mark in progress: the outbox rows locked, the jobs moved to `queued`, not yet
    // committed (a consumer is delivered a message as soon as it is published, before the
    // broker's confirm reaches the relay).
    let mut mark = env.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM kfs_probe_outbox WHERE id = ANY($1) ORDER BY id FOR UPDATE")
        .bind(&outboxes)
        .execute(&mut *mark)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE kfs_probe_jobs SET run_state = 'queued', row_version = row_version + 1 \
         WHERE id = ANY($1) AND run_state = 'dispatch_pending'",
    )
    .bind(&jobs)
    .execute(&mut *mark)
    .await
    .unwrap();
    let mut conn = env.pool.acquire().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let claiming = tokio::spawn(async move {
        let pairs: Vec<(&DeliveryRef, Uuid)> = refs.iter().map(|d| (d, Uuid::new_v4())).collect();
        let jobs = lease::claim_many(&mut conn, &st, &pairs, "w", Duration::from_secs(60))
            .await
            .unwrap();
        jobs.len()
    });
    // The claim waits for the mark instead of skipping its rows (and sending every delivery
    // through the one-job claim).
    let waited = env
        .wait_until(HANG, || {
            let pool = env.pool.clone();
            async move { waits_for_a_lock(&pool, pid).await }
        })
        .await;
    assert!(
        waited,
        "the batched claim did not wait for the relay's mark"
    );
    mark.commit().await.unwrap();
    let claimed = tokio::time::timeout(HANG, claiming).await.unwrap().unwrap();
    assert_eq!(claimed, 4, "every member is claimed by the batched claim");
    let running: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM kfs_probe_jobs j JOIN kfs_probe_outbox o ON o.probe_job_id = j.id \
         WHERE j.id = ANY($1) AND j.run_state = 'running' AND o.status = 'leased'",
    )
    .bind(&jobs)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(running, 4);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_claim_skips_a_job_row_a_step_may_hold_and_claims_the_others() {
    let env = TestEnv::new().await;
    let st = Statements::new(Kind::Probe.spec());
    let refs = dispatched(&env, 3, &ProbeSpec::default()).await;
    // The first job is running under a lease that ran out (claimable, as a takeover), and a
    // transaction (a step, say, of any length) holds its row.
    sqlx::query(
        "UPDATE kfs_probe_jobs SET run_state = 'running', worker_id = 'gone', lease_token = gen_random_uuid(), \
           lease_expires_at = now() - interval '1 minute', heartbeat_at = now() - interval '2 minutes' \
         WHERE id = $1",
    )
    .bind(refs[0].job_id)
    .execute(&env.pool)
    .await
    .unwrap();
    let mut step = env.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM kfs_probe_jobs WHERE id = $1 FOR NO KEY UPDATE")
        .bind(refs[0].job_id)
        .execute(&mut *step)
        .await
        .unwrap();
    let pairs: Vec<(&DeliveryRef, Uuid)> = refs.iter().map(|d| (d, Uuid::new_v4())).collect();
    let mut conn = env.pool.acquire().await.unwrap();
    // Returns while the step still holds the row: it is skipped, not waited for.
    let claimed = tokio::time::timeout(
        HANG,
        lease::claim_many(&mut conn, &st, &pairs, "w", Duration::from_secs(60)),
    )
    .await
    .expect("the batched claim waited for a row a step holds")
    .unwrap();
    let mut ids: Vec<Uuid> = claimed.iter().map(|j| j.job_id).collect();
    ids.sort();
    let mut others = vec![refs[1].job_id, refs[2].job_id];
    others.sort();
    assert_eq!(ids, others);
    step.rollback().await.unwrap();
    env.cleanup().await;
}

/// Jobs whose steps hold their rows for most of a lease, beside jobs of many short steps whose
/// slices outlast the lease, under a short lease and the production heartbeat pool: a beat due
/// mid-step waits for its own step without taking a connection, so no job's beat queues
/// behind another job's step and no lease is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn long_steps_beside_short_jobs_lose_no_lease_on_the_production_heartbeat_pool() {
    let env = TestEnv::new().await;
    let long = ProbeSpec {
        steps: 3,
        step_sleep: Duration::from_millis(2000),
        ..ProbeSpec::default()
    };
    let short = ProbeSpec {
        steps: 40,
        step_sleep: Duration::from_millis(100),
        ..ProbeSpec::default()
    };
    let mut refs = dispatched(&env, 4, &long).await;
    refs.extend(dispatched(&env, 4, &short).await);
    let mut cfg = ConsumerConfig::default();
    // Beats every second; a long step holds its row for two of them.
    cfg.policies.insert(
        Kind::Probe,
        Policy {
            lease: Duration::from_secs(3),
            ..Kind::Probe.spec().policy
        },
    );
    let engine = Engine::new(
        env.pool.clone(),
        "batch-worker-beats",
        vec![Arc::new(ProbeHandler)],
        cfg,
    )
    .with_heartbeat_pool(heartbeat_pool(&env));
    let shutdown = CancellationToken::new();
    let handled = tokio::time::timeout(
        HANG,
        futures_util::future::join_all(refs.iter().map(|d| engine.process_ref(d, &shutdown))),
    )
    .await
    .expect("the slices hung");
    let mut lost = Vec::new();
    for (d, h) in refs.iter().zip(&handled) {
        let (run_state, outbox) = state(&env.pool, d.job_id).await;
        if *h != ack("claimed", "succeeded") || run_state != "succeeded" || outbox != "completed" {
            lost.push((d.job_id, h.clone(), run_state, outbox));
        }
    }
    assert!(
        lost.is_empty(),
        "jobs whose slices did not succeed on their first lease (a heartbeat waited): {lost:?}"
    );
    for d in &refs {
        let steps = support::probe_effects(&env.pool, d.job_id).await;
        assert!(
            steps.iter().all(|(_, n)| *n == 1),
            "every step once: {steps:?}"
        );
    }
    env.cleanup().await;
}
