//! 1,000 jobs while a seeded driver SIGKILLs random workers and restarts them (under the same
//! or a fresh worker id): every job succeeds once and each held job is taken over.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

/// (at, status, locked_by, available_at)
type OutboxTransition = (DateTime<Utc>, String, Option<String>, DateTime<Utc>);

/// The driver's seed; `KFS_CRASH_SEED` replays another run.
fn seed() -> u64 {
    std::env::var("KFS_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x6b66_7321)
}

struct Kill {
    worker: String,
    at: DateTime<Utc>,
    /// Jobs the killed process held a live lease on at the kill instant.
    held: Vec<Uuid>,
    /// The lease token of each held job.
    tokens: Vec<Uuid>,
}

/// Whether `job` succeeded with its last effect written under `token`: the slice of a killed
/// worker whose final commit was already on its way to Postgres when the process died (the
/// server commits what it received), so nobody needed to claim the job again.
async fn ended_under(pool: &PgPool, job: Uuid, token: Uuid) -> bool {
    sqlx::query_scalar(
        "SELECT j.run_state = 'succeeded' AND (SELECT e.lease_token FROM kfs_probe_effects e \
           WHERE e.job_id = j.id ORDER BY e.id DESC LIMIT 1) = $2 \
         FROM kfs_probe_jobs j WHERE j.id = $1",
    )
    .bind(job)
    .bind(token)
    .fetch_one(pool)
    .await
    .unwrap_or(false)
}

const FLEET: [&str; 3] = ["w1", "w2", "w3"];
const FLEET_LEASE: &str = "probe=10s";
const FLEET_LEASE_MS: f64 = 10_000.0;
/// How long the fleet may take to make every job terminal: a bound on liveness, not a speed
/// target. The probe's group steps run their members' 300 ms one after another, so how long
/// the run takes depends on how many deliveries each claim finds waiting, which a slower
/// machine makes larger: on one 2-core host the default seed needed 145 s and more, where the
/// bound had been 150 s.
const FLEET_DEADLINE: Duration = Duration::from_secs(300);

fn fleet_env() -> Vec<(&'static str, &'static str)> {
    let mut e = base_env(FLEET_LEASE);
    e.push(("KFS_PREFETCH", "6"));
    e
}

/// 1,000 probe jobs (1 to 4 steps of 300 ms, 4 % fail their first attempt with a retryable
/// error; 25 attempts allowed, since every kill of a holder uses one up), three worker
/// processes with every role, and a driver (seeded RNG) that SIGKILLs a random one every
/// 0.5–2 s and restarts it 0.1–0.5 s later, until every job is terminal (at most [`FLEET_DEADLINE`]). Then
/// SIGTERM, and every worker must exit 0. `same_id`: the restart keeps the worker id (as a
/// supervisor restarting a container does); otherwise each incarnation gets a fresh id.
///
/// Takeover time: for each kill, the jobs the killed process held a live lease on at that
/// instant are read right after the kill and reap (`run_state = 'running'` under its worker id
/// with `lease_expires_at` after the kill; nothing else writes under that id until the
/// restart). The kill instant is the database clock read just before SIGKILL. The job's next
/// claim is the first entry of the claim log after the kill instant (database clock). Each
/// held job is one sample; median and max over all samples are printed. A takeover rides on
/// one of two paths: the broker's redelivery of the dead process's unacked messages (fast), or
/// the sweeper's re-arm and the relay's republish, whose new message joins the tail of the
/// backlog (the 1,000 jobs are published at once) and whose new delivery id makes the
/// redelivered original stale. The second path makes the max as long as the backlog takes to
/// drain; it is printed, never asserted, and the slowest case is traced from the logs.
async fn fleet_run(same_id: bool) {
    let label = if same_id {
        "sigkill x1000, same ids"
    } else {
        "sigkill x1000, fresh ids"
    };
    let env = TestEnv::new().await;
    install_claim_log(&env.pool).await;
    for steps in 1..=4 {
        let spec = ProbeSpec {
            max_attempts: 25,
            ..probe_spec(steps, 300)
        };
        probe::enqueue_many(&env.pool, 240, &spec).await.unwrap();
        let flaky = ProbeSpec {
            fail_mode: "retry_once",
            ..spec
        };
        probe::enqueue_many(&env.pool, 10, &flaky).await.unwrap();
    }
    let total = count(&env.pool, "SELECT count(*) FROM kfs_probe_jobs").await;
    assert_eq!(total, 1000);

    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let wenv = fleet_env();
    let mut ids: Vec<String> = FLEET.iter().map(|s| (*s).to_owned()).collect();
    let mut workers: Vec<Worker> = ids.iter().map(|id| spawn(&env, id, &[], &wenv)).collect();
    let mut kills: Vec<Kill> = Vec::new();
    let mut refused_restarts = 0u32;
    let mut startup_deadlocks = 0u32;
    let started = Instant::now();
    let run_start = db_now(&env.pool).await;
    let mut done = false;
    while started.elapsed() < FLEET_DEADLINE {
        tokio::time::sleep(Duration::from_millis(rng.random_range(500..2000))).await;
        if all_terminal(&env.pool).await {
            done = true;
            break;
        }
        // A worker that left on its own: a restart that found its id still in use (the previous
        // incarnation's session not yet gone) or no free Postgres connection slot may do that,
        // and so may one that hit the startup deadlock reproduced by
        // worker_start_does_not_deadlock_with_running_steps (counted and printed). Anything
        // else fails the run. Either way it is started again.
        for (i, w) in workers.iter_mut().enumerate() {
            if let Ok(Some(status)) = w.child.try_wait() {
                let log = w.log_text();
                if log.contains("deadlock detected") {
                    startup_deadlocks += 1;
                } else if log.contains("too many clients") {
                    // Postgres is shared with other test runs; a start refused for want of a
                    // connection slot is the environment's limit, not the engine's.
                    refused_restarts += 1;
                } else {
                    assert!(
                        log.contains("already in use"),
                        "{} exited on its own ({status:?})\n{}",
                        w.name,
                        w.tail(40)
                    );
                    refused_restarts += 1;
                }
                *w = spawn(&env, &ids[i], &[], &wenv);
            }
        }
        let i = rng.random_range(0..FLEET.len());
        let at = db_now(&env.pool).await;
        workers[i].kill();
        let (held, tokens): (Vec<Uuid>, Vec<Uuid>) =
            held_by(&env.pool, &ids[i], at).await.into_iter().unzip();
        kills.push(Kill {
            worker: ids[i].clone(),
            at,
            held,
            tokens,
        });
        tokio::time::sleep(Duration::from_millis(rng.random_range(100..500))).await;
        if !same_id {
            ids[i] = format!("{}-{}", FLEET[i], kills.len());
        }
        workers[i] = spawn(&env, &ids[i], &[], &wenv);
    }
    let wall = started.elapsed();
    if !done {
        done = all_terminal(&env.pool).await;
    }
    type Stuck = (
        Uuid,
        String,
        String,
        Option<String>,
        Option<DateTime<Utc>>,
        String,
        i32,
        DateTime<Utc>,
    );
    let stuck: Vec<Stuck> = sqlx::query_as(
        "SELECT j.id, j.run_state, j.checkpoint, j.worker_id, j.lease_expires_at, o.status, o.dispatch_attempts, o.available_at \
         FROM kfs_probe_jobs j JOIN kfs_probe_outbox o ON o.probe_job_id = j.id \
         WHERE j.run_state NOT IN ('succeeded', 'failed', 'canceled') ORDER BY j.id LIMIT 5",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let states = support::probe_states(&env.pool).await;

    // The figures, before any assertion can hide them.
    let mut samples: Vec<f64> = Vec::new();
    let mut slowest: Option<(f64, Uuid, usize)> = None;
    let mut never_claimed = 0usize;
    let mut ended_in_flight = 0usize;
    for (n, k) in kills.iter().enumerate() {
        for ((t, job), token) in next_claims(&env.pool, &k.held, k.at)
            .await
            .into_iter()
            .zip(&k.held)
            .zip(&k.tokens)
        {
            match t {
                Some(t) => {
                    samples.push(t);
                    if slowest.is_none_or(|(s, _, _)| t > s) {
                        slowest = Some((t, *job, n));
                    }
                }
                None if ended_under(&env.pool, *job, *token).await => ended_in_flight += 1,
                None => never_claimed += 1,
            }
        }
    }
    if let Some((t, job, n)) = slowest.filter(|(t, _, _)| *t >= FLEET_LEASE_MS) {
        // How the slowest takeover went: the job's outbox transitions and claims around it.
        let k = &kills[n];
        let outbox: Vec<OutboxTransition> = sqlx::query_as(
            "SELECT at, status, locked_by, available_at FROM crash_outbox_log WHERE job_id = $1 AND at >= $2 ORDER BY id",
        )
        .bind(job)
        .bind(k.at - chrono::TimeDelta::seconds(5))
        .fetch_all(&env.pool)
        .await
        .unwrap();
        let claims: Vec<(DateTime<Utc>, String)> =
            sqlx::query_as("SELECT at, worker_id FROM crash_claims WHERE job_id = $1 ORDER BY id")
                .bind(job)
                .fetch_all(&env.pool)
                .await
                .unwrap();
        let around: Vec<(DateTime<Utc>, String)> = kills
            .iter()
            .filter(|o| {
                o.at >= k.at - chrono::TimeDelta::seconds(5)
                    && o.at <= k.at + chrono::TimeDelta::milliseconds(t as i64)
            })
            .map(|o| (o.at, o.worker.clone()))
            .collect();
        println!(
            "[{label}] slowest takeover {t:.0} ms: job {job} held by {} killed at {}; kills around it: {around:?}\n\
             [{label}]   outbox transitions (at, status, locked_by, available_at): {outbox:?}\n\
             [{label}]   claims (at, worker): {claims:?}",
            k.worker, k.at
        );
    }
    let held_total: usize = kills.iter().map(|k| k.held.len()).sum();
    let max = samples.iter().copied().fold(f64::NAN, f64::max);
    let over_lease = samples.iter().filter(|t| **t >= FLEET_LEASE_MS).count();
    let med = median(&mut samples);
    let takeovers = count(
        &env.pool,
        "SELECT count(*) FROM (SELECT job_id FROM kfs_probe_effects GROUP BY job_id HAVING count(DISTINCT lease_token) > 1) x",
    )
    .await;
    let claims = count(&env.pool, "SELECT count(*) FROM crash_claims").await;
    let succeeded = count(
        &env.pool,
        "SELECT count(*) FROM kfs_probe_jobs WHERE run_state = 'succeeded'",
    )
    .await;
    let retried = count(
        &env.pool,
        "SELECT count(*) FROM kfs_probe_jobs WHERE fail_mode = 'retry_once' AND run_state = 'succeeded' AND execution_attempts >= 2",
    )
    .await;
    let until = sqlx::query_scalar::<_, Option<DateTime<Utc>>>(
        "SELECT max(completed_at) FROM kfs_probe_jobs",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap()
    .unwrap_or(run_start);
    println!(
        "[{label}] seed={seed} lease={FLEET_LEASE} jobs={total} succeeded={succeeded} retry_once_retried={retried} \
         kills={} refused_restarts={refused_restarts} startup_deadlocks={startup_deadlocks} claims={claims} all_terminal={done} last_completion_after_s={:.1} driver_wall_s={:.1}\n\
         [{label}] takeovers(jobs with effects from >1 lease)={takeovers} jobs_held_at_kills={held_total} \
         time_to_takeover_ms(median={med:.0}, max={max:.0}, samples={}, at_or_over_lease={over_lease}, never={never_claimed}) \
         ended_by_a_commit_in_flight_at_the_kill={ended_in_flight}",
        kills.len(),
        ms(until - run_start) / 1000.0,
        wall.as_secs_f64(),
        samples.len(),
    );

    assert!(
        done,
        "not every job terminal after {} s: {states:?}; e.g. (job, state, checkpoint, worker, lease expires, \
         outbox status, dispatch attempts, outbox available at): {stuck:#?}",
        FLEET_DEADLINE.as_secs()
    );
    support::stop_cleanly(&mut workers, Duration::from_secs(20)).await;
    assert_eq!(succeeded, 1000, "jobs not succeeded: {states:?}");
    assert_eq!(
        never_claimed, 0,
        "jobs held by a killed worker never claimed again"
    );
    assert_history(&env.pool).await;
    let depths = wait_queues_drained(&env, Duration::from_secs(10)).await;
    assert_eq!(depths, (0, 0), "queues not drained");
    env.cleanup().await;
}

/// The run as a supervisor does it: the restarted process keeps its worker id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_jobs_survive_random_sigkills_with_restarts_under_the_same_id() {
    let _serial = SERIAL.lock().await;
    fleet_run(true).await;
}

/// The same run with a fresh worker id per incarnation: every other invariant under chaos.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_jobs_survive_random_sigkills() {
    let _serial = SERIAL.lock().await;
    fleet_run(false).await;
}
