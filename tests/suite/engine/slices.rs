//! A slice outlives trouble with its connection: one that dies resynchronises and finishes once,
//! heartbeats keep a lease from a pool of one, and calls on a link gone silent are bounded.

use super::*;

/// A leased kind defined here, on a table of its own: one step that records its effect, the
/// first time with its own session terminated before the engine writes the end.
mod flaky {
    use std::sync::atomic::{AtomicBool, Ordering};

    use kfs_worker::engine::lease::End;
    use kfs_worker::engine::leased::{ClaimRule, EndWrite, Lease, LeasedKind, Param};
    use kfs_worker::jobs::{JobError, Policy, RetryPolicy, Step};
    use sqlx::{PgConnection, PgPool};

    pub const TABLE: &str = "kfs_flaky_jobs";

    pub const SCHEMA: &str = "
        CREATE TABLE kfs_flaky_jobs (
          id uuid PRIMARY KEY, run_state text NOT NULL DEFAULT 'queued', checkpoint text NOT NULL DEFAULT 'start',
          row_version int NOT NULL DEFAULT 1, updated_at timestamptz NOT NULL DEFAULT now(),
          completed_at timestamptz, last_error_code text, last_error_message text,
          worker_id text, lease_token uuid, lease_expires_at timestamptz, heartbeat_at timestamptz);
        CREATE TABLE kfs_flaky_effects (job_id uuid NOT NULL, at timestamptz NOT NULL DEFAULT now());";

    /// Three attempts under `lease`, retried after 1 to 5 s.
    fn policy(lease: std::time::Duration) -> Policy {
        Policy {
            lease,
            max_attempts: 3,
            retry: RetryPolicy {
                base: std::time::Duration::from_secs(1),
                max: std::time::Duration::from_secs(5),
            },
        }
    }

    /// One row per run of a step, in the step's transaction.
    async fn record_effect(tx: &mut PgConnection, job: &Lease) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO kfs_flaky_effects (job_id) VALUES ($1)")
            .bind(job.job_id)
            .execute(tx)
            .await
            .map(|_| ())
    }

    /// Claims any queued row.
    pub fn rule() -> ClaimRule {
        ClaimRule {
            claimable: "j.run_state = 'queued' AND $4::int IS NOT NULL".into(),
            select: String::new(),
            set: String::new(),
            attempt: "1",
            max_attempts: None,
            param: Param::Int(0),
            exhausted: None,
        }
    }

    /// What each end writes on the test table.
    pub fn end_write(end: &End) -> EndWrite {
        let set = match end {
            End::Succeed { .. } => "run_state = 'succeeded', checkpoint = $4, completed_at = now()",
            End::Fail { .. } | End::Cancel { .. } | End::Supersede { .. } => {
                "run_state = 'failed', completed_at = now(), last_error_code = $4, last_error_message = $5"
            }
            End::Wait { .. } | End::Continue => "run_state = 'queued'",
        };
        let (text4, text5) = match end {
            End::Succeed { checkpoint } => (Some(checkpoint.clone()), None),
            End::Fail { code, message } | End::Cancel { code, message } => {
                (Some(code.clone()), Some(message.clone()))
            }
            _ => (None, None),
        };
        EndWrite {
            set: set.into(),
            text4,
            text5,
            ..EndWrite::default()
        }
    }

    pub struct Flaky {
        pub admin: PgPool,
        pub broken_once: AtomicBool,
        pub policy: Policy,
    }

    impl Flaky {
        pub fn new(admin: PgPool) -> Self {
            Flaky {
                admin,
                broken_once: AtomicBool::new(false),
                policy: policy(std::time::Duration::from_secs(30)),
            }
        }
    }

    #[async_trait::async_trait]
    impl LeasedKind for Flaky {
        fn name(&self) -> &'static str {
            "flaky"
        }
        fn table(&self) -> &'static str {
            TABLE
        }
        fn states(&self) -> &'static [&'static str] {
            &["queued", "running", "succeeded", "failed"]
        }
        fn policy(&self) -> &Policy {
            &self.policy
        }
        fn claim_rule(&self) -> ClaimRule {
            rule()
        }
        async fn step(&self, tx: &mut PgConnection, job: &Lease) -> Result<Step, JobError> {
            record_effect(tx, job).await?;
            if !self.broken_once.swap(true, Ordering::SeqCst) {
                // The step's own session dies before the engine writes the end: the end's
                // statement fails, and the step's effect is rolled back with it.
                let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                    .fetch_one(&mut *tx)
                    .await?;
                let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 5000)")
                    .bind(pid)
                    .fetch_one(&self.admin)
                    .await
                    .expect("terminate the step's session");
                assert!(killed, "the step's session was terminated");
            }
            Ok(Step::Succeed("done".into()))
        }
        fn end_write(&self, _job: &Lease, end: &End) -> EndWrite {
            end_write(end)
        }
    }

    /// Ten steps of 300 ms each inside their transactions, under a 1.5 s lease: the slice
    /// outlives its lease unless heartbeats extend it between steps.
    pub struct Steady {
        pub policy: Policy,
    }

    impl Steady {
        pub fn new() -> Self {
            Steady {
                policy: policy(std::time::Duration::from_millis(1500)),
            }
        }
    }

    #[async_trait::async_trait]
    impl LeasedKind for Steady {
        fn name(&self) -> &'static str {
            "steady"
        }
        fn table(&self) -> &'static str {
            TABLE
        }
        fn states(&self) -> &'static [&'static str] {
            &["queued", "running", "succeeded", "failed"]
        }
        fn policy(&self) -> &Policy {
            &self.policy
        }
        fn claim_rule(&self) -> ClaimRule {
            rule()
        }
        async fn step(&self, tx: &mut PgConnection, job: &Lease) -> Result<Step, JobError> {
            record_effect(tx, job).await?;
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            let n: i32 = job
                .checkpoint
                .strip_prefix("step-")
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
                + 1;
            Ok(if n >= 10 {
                Step::Succeed("done".into())
            } else {
                Step::Advance(format!("step-{n}"))
            })
        }
        fn end_write(&self, _job: &Lease, end: &End) -> EndWrite {
            end_write(end)
        }
    }
}

/// The slice runner is the same for leased kinds as for delivered ones: when the step's
/// connection dies before the end commits, the slice reads the row back, finds its lease still
/// live and runs the step again on a fresh connection, instead of leaving the job held until
/// its lease runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_slice_whose_connection_dies_resynchronises_and_finishes_once() {
    use kfs_worker::engine::leased::{self, Outcome};
    use kfs_worker::engine::slice::Budget;

    let env = TestEnv::new().await;
    sqlx::raw_sql(flaky::SCHEMA)
        .execute(&env.pool)
        .await
        .unwrap();
    let job = uuid::Uuid::new_v4();
    sqlx::query("INSERT INTO kfs_flaky_jobs (id) VALUES ($1)")
        .bind(job)
        .execute(&env.pool)
        .await
        .unwrap();
    let kind = flaky::Flaky::new(env.pool.clone());
    let ran = tokio::time::timeout(
        Duration::from_secs(60),
        leased::run_once(&env.pool, &kind, "w-flaky", Budget::default()),
    )
    .await
    .expect("the slice ended")
    .unwrap();
    let (_, outcome) = ran.expect("the job was claimed");
    assert!(
        kind.broken_once.load(std::sync::atomic::Ordering::SeqCst),
        "the step's session was terminated once"
    );
    assert_eq!(outcome, Outcome::Ended("succeeded"));
    let (state, token): (String, Option<uuid::Uuid>) =
        sqlx::query_as("SELECT run_state, lease_token FROM kfs_flaky_jobs WHERE id = $1")
            .bind(job)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!((state.as_str(), token), ("succeeded", None));
    let effects: i64 =
        sqlx::query_scalar("SELECT count(*) FROM kfs_flaky_effects WHERE job_id = $1")
            .bind(job)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(effects, 1, "the step's effect committed exactly once");
    env.cleanup().await;
}

/// A polled lease gives its connection back to the pool between steps, so its heartbeats get
/// one even from a pool of one: a slice longer than its lease keeps it and finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_slice_longer_than_its_lease_is_kept_alive_by_heartbeats_from_a_pool_of_one() {
    use kfs_worker::engine::leased::{self, Outcome};
    use kfs_worker::engine::slice::Budget;

    let env = TestEnv::new().await;
    sqlx::raw_sql(flaky::SCHEMA)
        .execute(&env.pool)
        .await
        .unwrap();
    let job = uuid::Uuid::new_v4();
    sqlx::query("INSERT INTO kfs_flaky_jobs (id) VALUES ($1)")
        .bind(job)
        .execute(&env.pool)
        .await
        .unwrap();
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&env.url)
        .await
        .unwrap();
    let kind = flaky::Steady::new();
    let (_, outcome) = tokio::time::timeout(
        Duration::from_secs(60),
        leased::run_once(&one, &kind, "w-steady", Budget::default()),
    )
    .await
    .expect("the slice ended")
    .unwrap()
    .expect("the job was claimed");
    assert_eq!(
        outcome,
        Outcome::Ended("succeeded"),
        "3 s of steps under a 1.5 s lease"
    );
    let effects: i64 =
        sqlx::query_scalar("SELECT count(*) FROM kfs_flaky_effects WHERE job_id = $1")
            .bind(job)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(effects, 10, "each of the ten steps once");
    one.close().await;
    env.cleanup().await;
}

/// A link that goes silent without closing (a half-open connection: a NAT or a failed peer
/// dropped it) answers no call. Every call is bounded: a claim on such a link fails within
/// the claim patience and gives its delivery back to the broker, and a slice whose connection
/// goes silent mid-step drops it and goes on on a fresh one, each step committed once.
#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_on_a_link_gone_silent_are_bounded_so_claims_give_back_and_slices_go_on() {
    use std::sync::Arc;

    use kfs_worker::consumer::{Engine, Handled};
    use kfs_worker::jobs::probe::ProbeHandler;
    use kfs_worker::jobs::Policy;

    let env = TestEnv::new().await;
    let (link, through) = crate::support::proxy::Proxy::before(&env.url).await;
    let url = kfs_worker::config::database_url(Some(through.as_str())).unwrap();
    let options =
        kfs_worker::db::session_options(&url, "kfs-worker silent link test", None).unwrap();
    let pool = kfs_worker::db::lazy_pool(options, 4, Duration::from_secs(2));
    let mut cfg = ConsumerConfig {
        claim_patience: Duration::from_secs(3),
        ..ConsumerConfig::default()
    };
    cfg.policies.insert(
        Kind::Probe,
        Policy {
            lease: Duration::from_secs(4),
            ..Kind::Probe.spec().policy
        },
    );
    let engine = Arc::new(Engine::new(
        pool.clone(),
        "worker-silent-link",
        vec![Arc::new(ProbeHandler)],
        cfg,
    ));
    let shutdown = CancellationToken::new();
    // Whatever a call does, the test goes on: a hang is a failure, not a stalled suite.
    const HANG: Duration = Duration::from_secs(60);

    // A claim: the connection it would use is open, then the whole link goes silent.
    let (job, outbox) = support::enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let d = support::dispatch(&env.pool, Kind::Probe, outbox).await;
    sqlx::query("SELECT 1").execute(&pool).await.unwrap();
    // Back in the pool, idle, so the claim runs its statement on it (not on a connection
    // still being opened: opening one is bounded by the pool's own timeout).
    let idle = env
        .wait_until(Duration::from_secs(10), || async { pool.num_idle() == 1 })
        .await;
    assert!(idle, "the pool's connection never came back idle");
    link.set_hold(true);
    let handled = tokio::time::timeout(HANG, engine.process_ref(&d, &shutdown)).await;
    assert_eq!(
        handled.ok(),
        Some(Handled::GiveBack),
        "a claim on a silent link must give its delivery back within its patience"
    );
    link.heal();
    let untouched: (i32, bool) = sqlx::query_as(
        "SELECT execution_attempts, lease_token IS NULL FROM kfs_probe_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(untouched, (0, true), "nothing was claimed");

    // A slice: its connection goes silent after the first step; new connections pass.
    let spec = ProbeSpec {
        steps: 3,
        step_sleep: Duration::from_millis(1500),
        ..ProbeSpec::default()
    };
    let (job, outbox) = support::enqueue_one(&env.pool, &spec).await;
    let d = support::dispatch(&env.pool, Kind::Probe, outbox).await;
    let running = {
        let (engine, d, shutdown) = (engine.clone(), d.clone(), shutdown.clone());
        tokio::spawn(async move { engine.process_ref(&d, &shutdown).await })
    };
    let first = env
        .wait_until(Duration::from_secs(30), || async {
            !support::probe_effects(&env.pool, job).await.is_empty()
        })
        .await;
    assert!(first, "the first step never committed");
    link.freeze_open();
    let handled = tokio::time::timeout(HANG, running)
        .await
        .expect("a slice whose connection went silent never ended")
        .unwrap();
    let Handled::Ack { claim, end } = handled.clone() else {
        panic!("the slice ended without a decision: {handled:?}");
    };
    assert_eq!(claim, "claimed");
    if end == Some("lease_lost") {
        // Its lease ran out while it found out: the next delivery takes the job over.
        let again = support::dispatch(&env.pool, Kind::Probe, outbox).await;
        let handled = tokio::time::timeout(HANG, engine.process_ref(&again, &shutdown))
            .await
            .expect("the takeover hung");
        assert!(
            matches!(
                handled,
                Handled::Ack {
                    end: Some("succeeded"),
                    ..
                }
            ),
            "{handled:?}"
        );
    } else {
        assert_eq!(end, Some("succeeded"), "{handled:?}");
    }
    assert_eq!(
        support::probe_effects(&env.pool, job).await,
        vec![(1, 1), (2, 1), (3, 1)],
        "each step committed once"
    );
    link.heal();
    env.cleanup().await;
}
