//! A kind defined outside the crate and registered runs through relay and consumer like a
//! built-in one.

use super::*;

/// A kind defined outside the crate, registered the way the built-in kinds are (see the
/// README's "Adding a kind"): its identity and tables, its handler, its operator surface and
/// its migration, in one module, and one `register` call.
mod note {
    use std::sync::Arc;
    use std::time::Duration;

    use kfs_worker::jobs::operate::Operations;
    use kfs_worker::jobs::{
        Clock, Entry, Handler, JobCtx, JobError, Kind, KindSpec, Policy, RetryPolicy, States, Step,
    };
    use sqlx::{PgConnection, PgPool};

    pub const KIND: Kind = Kind::new("note");

    pub static SPEC: KindSpec = KindSpec {
        kind: KIND,
        event_type: "note.job",
        job_table: "kfs_note_jobs",
        outbox_table: "kfs_note_outbox",
        outbox_fk: "note_job_id",
        payload_id_field: "noteJobId",
        clock: Clock::Timestamptz,
        states: States::RunState {
            failed_keeps_slot: false,
        },
        superseded_state: false,
        // As research and deletion: each step transaction plans its statements once.
        generic_plans: true,
        fairness: None,
        revisions: true,
        max_connections: None,
        policy: Policy {
            lease: Duration::from_secs(30),
            max_attempts: 3,
            retry: RetryPolicy {
                base: Duration::from_secs(1),
                max: Duration::from_secs(10),
            },
        },
        record_failure: None,
    };

    pub static ENTRY: Entry = Entry {
        spec: &SPEC,
        default: false,
        handler: |_| Ok(Arc::new(NoteHandler)),
        ops: &Operations::NONE,
        prepare: Some(|pool| Box::pin(migrate(pool))),
    };

    /// Two steps, each recording its effect in the step's transaction, with the plan mode that
    /// transaction runs under.
    struct NoteHandler;

    #[async_trait::async_trait]
    impl Handler for NoteHandler {
        fn kind(&self) -> Kind {
            KIND
        }

        async fn step(&self, tx: &mut PgConnection, job: &JobCtx) -> Result<Step, JobError> {
            sqlx::query(
                "INSERT INTO kfs_note_effects (job_id, checkpoint, plans) \
                 VALUES ($1, $2, current_setting('plan_cache_mode'))",
            )
            .bind(job.job_id)
            .bind(&job.checkpoint)
            .execute(tx)
            .await?;
            Ok(match job.checkpoint.as_str() {
                "queued" => Step::Advance("written".into()),
                _ => Step::Succeed("done".into()),
            })
        }
    }

    /// The kind's migration: tables of the probe's shape, under its own names, in one
    /// transaction.
    async fn migrate(pool: &PgPool) -> Result<(), sqlx::Error> {
        let mut tx = pool.begin().await?;
        for ddl in [
            "CREATE TABLE IF NOT EXISTS kfs_note_jobs (LIKE kfs_probe_jobs INCLUDING DEFAULTS INCLUDING INDEXES)",
            "CREATE TABLE IF NOT EXISTS kfs_note_outbox (LIKE kfs_probe_outbox INCLUDING DEFAULTS INCLUDING INDEXES)",
            "DO $$ BEGIN ALTER TABLE kfs_note_outbox RENAME COLUMN probe_job_id TO note_job_id; \
             EXCEPTION WHEN undefined_column THEN NULL; END $$",
            "CREATE TABLE IF NOT EXISTS kfs_note_effects (job_id UUID NOT NULL, checkpoint TEXT NOT NULL, plans TEXT NOT NULL)",
        ] {
            sqlx::query(ddl).execute(&mut *tx).await?;
        }
        tx.commit().await
    }

    /// A note job and its outbox row, as the platform's API would write them.
    pub async fn enqueue(pool: &PgPool) -> uuid::Uuid {
        let id = uuid::Uuid::now_v7();
        sqlx::query(
            "WITH j AS ( \
               INSERT INTO kfs_note_jobs (id, checkpoint, run_state, active_slot, steps_total, \
                 execution_attempts, max_execution_attempts, row_version, created_at, updated_at) \
               VALUES ($1, 'queued', 'dispatch_pending', 1, 2, 0, 3, 1, now(), now()) RETURNING id) \
             INSERT INTO kfs_note_outbox (id, note_job_id, delivery_revision, event_type, schema_version, \
               idempotency_key, payload, status, available_at, dispatch_attempts, created_at, updated_at) \
             SELECT gen_random_uuid(), j.id, 1, 'note.job', 1, 'note.job:' || j.id || ':1', \
               jsonb_build_object('noteJobId', j.id), 'pending', now(), 0, now(), now() FROM j",
        )
        .bind(id)
        .execute(pool)
        .await
        .expect("enqueue a note job");
        id
    }
}

/// The registry is the process's, and the suite is one process: once this test ran, every
/// test after it sees the note kind too. Nothing there depends on it: a `TestEnv` declares and
/// deletes the note kind's queues with the others', workers serve only the kinds they are given
/// (the note kind is not a default one), and the decoding properties hold for every kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kind_registered_from_outside_runs_through_relay_and_consumer_like_a_built_in_one() {
    kfs_worker::jobs::register(&note::ENTRY).expect("the note kind registers");
    assert_eq!(
        kfs_worker::jobs::register(&note::ENTRY),
        Ok(()),
        "registering the same kind again does nothing"
    );
    assert_eq!(
        Kind::parse_list("note.job").unwrap(),
        vec![note::KIND],
        "--kinds knows it"
    );
    assert!(Kind::all().ends_with(&[note::KIND]), "{:?}", Kind::all());

    let env = TestEnv::new().await;
    let mut opts = options(&env, "note-worker");
    opts.kinds = vec![note::KIND];
    // The kind's migration runs when a worker that serves it starts.
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(runtime::run(opts, shutdown.clone()));
    let ready = env
        .wait_until(Duration::from_secs(30), || async {
            sqlx::query_scalar::<_, bool>("SELECT to_regclass('kfs_note_outbox') IS NOT NULL")
                .fetch_one(&env.pool)
                .await
                .unwrap()
        })
        .await;
    assert!(ready, "the kind's tables were prepared");
    let job = note::enqueue(&env.pool).await;
    let done = env
        .wait_until(Duration::from_secs(30), || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT run_state = 'succeeded' FROM kfs_note_jobs WHERE id = $1",
            )
            .bind(job)
            .fetch_one(&env.pool)
            .await
            .unwrap()
        })
        .await;
    assert!(done, "the note job succeeded");
    let effects: Vec<String> =
        sqlx::query_scalar("SELECT checkpoint FROM kfs_note_effects WHERE job_id = $1 ORDER BY 1")
            .bind(job)
            .fetch_all(&env.pool)
            .await
            .unwrap();
    assert_eq!(effects, vec!["queued", "written"], "each step once");
    let plans: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT plans FROM kfs_note_effects WHERE job_id = $1")
            .bind(job)
            .fetch_all(&env.pool)
            .await
            .unwrap();
    assert_eq!(
        plans,
        vec!["force_generic_plan"],
        "the steps ran under the plan mode the kind's spec asks for"
    );
    let outbox: String =
        sqlx::query_scalar("SELECT status FROM kfs_note_outbox WHERE note_job_id = $1")
            .bind(job)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(outbox, "completed");
    let status = kfs_worker::status::read(&env.pool, &[note::KIND])
        .await
        .unwrap();
    let text = serde_json::to_string(&status).unwrap();
    assert!(text.contains("note"), "status reports the kind: {text}");
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(30), worker).await;
    env.cleanup().await;
}
