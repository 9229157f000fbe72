//! Maintenance against the platform's tables: what the sweep that every process runs every
//! second reads, and whose leases a process releases when it starts under a worker id.
//! Invariant under test: the sweep reads a job table only through indexes, however many
//! finished rows it holds, and a start releases only the leases of its own id's earlier
//! incarnations.

use std::time::Duration;

use kfs_worker::engine::leased::LeasedKind;
use kfs_worker::jobs::bootstrap::{self, BootstrapKind};
use kfs_worker::jobs::deletion::{request_deletion, DeletionRequest, Target};
use kfs_worker::jobs::research::{self, ResearchRequest};
use kfs_worker::jobs::Kind;
use kfs_worker::maintenance;
use kfs_worker::tools::platform;
use sqlx::PgPool;
use uuid::Uuid;

use crate::support;
use crate::support::space::{SpaceFx, OWNER};

/// Finished rows cloned per job table: far more than the few running ones, as on a platform
/// that has run for a while.
const FINISHED: i64 = 20_000;

/// Clones row `id` of `table` `FINISHED` times, each with a fresh id and `finished` (a JSON
/// object of column values, evaluated per row) applied, then analyzes the table.
async fn fill_finished(pool: &PgPool, table: &str, id: Uuid, finished: &str) {
    sqlx::query(&format!(
        "INSERT INTO {table} \
         SELECT (jsonb_populate_record(NULL::{table}, to_jsonb(r) || {finished})).* \
         FROM {table} r CROSS JOIN generate_series(1, $2) AS g WHERE r.id = $1"
    ))
    .bind(id)
    .bind(FINISHED)
    .execute(pool)
    .await
    .unwrap_or_else(|e| panic!("{table}: {e}"));
    sqlx::query(&format!("ANALYZE {table}"))
        .execute(pool)
        .await
        .unwrap();
}

/// Every scan node of a `FORMAT JSON` plan: (relation, node type, index).
fn scans(plan: &serde_json::Value, out: &mut Vec<(String, String, Option<String>)>) {
    if let Some(relation) = plan["Relation Name"].as_str() {
        out.push((
            relation.to_owned(),
            plan["Node Type"].as_str().unwrap_or("").to_owned(),
            plan["Index Name"].as_str().map(str::to_owned),
        ));
    }
    for child in plan["Plans"].as_array().into_iter().flatten() {
        scans(child, out);
    }
}

/// With many finished rows in every platform job table, no statement of the sweep (the dead
/// holders and their leases, and the re-arm) plans a sequential scan of a job table, neither
/// as the custom plan of its first executions nor as the generic plan Postgres settles on for a
/// prepared statement. Each process runs them for each kind every second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sweep_statement_reads_the_job_table_through_an_index() {
    let fx = SpaceFx::new("tenant-sweep", "sweep", "Sweep").await;
    let pool = fx.pool().clone();
    let compiled = fx.add("a.md", "text/markdown", b"# A\n\nAuks.").await;
    let deleted = fx.add("b.md", "text/markdown", b"# B\n\nTerns.").await;
    let attempt = fx.request(compiled, false).await.unwrap();
    let snapshot = fx.snapshot(OWNER).await;
    // Research first: a deletion in progress refuses research in its space.
    let task = {
        let mut tx = pool.begin().await.unwrap();
        let r = research::request(
            &mut tx,
            &ResearchRequest::new(fx.space, "Which birds?", OWNER, snapshot),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        r.job_id
    };
    let deletion = {
        let mut tx = pool.begin().await.unwrap();
        let r = request_deletion(
            &mut tx,
            &DeletionRequest {
                tenant_id: fx.tenant.clone(),
                knowledge_space_id: fx.space,
                target: Target::Document { id: deleted },
                expected_revision: None,
                requested_by_subject_id: OWNER.into(),
                permission_snapshot_id: snapshot,
                access_channel: "interactive".into(),
                idempotency_key: "sweep".into(),
            },
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        r.job_id
    };
    let kinds = [
        (
            Kind::Compile,
            attempt,
            "jsonb_build_object('id', gen_random_uuid(), 'run_state', 'canceled', \
             'active_slot', NULL, 'completed_at', now())",
        ),
        (
            Kind::Deletion,
            deletion,
            "jsonb_build_object('id', gen_random_uuid(), 'idempotency_key', 'finished-' || g, \
             'run_state', 'canceled', 'active_slot', NULL, 'completed_at', now())",
        ),
        (
            Kind::Research,
            task,
            "jsonb_build_object('id', gen_random_uuid(), 'stage', 'completed', \
             'completed_at', (extract(epoch from now()) * 1000)::bigint)",
        ),
    ];
    let mut conn = pool.acquire().await.unwrap();
    let mut seq = Vec::new();
    for (kind, id, finished) in kinds {
        let table = kind.spec().job_table;
        fill_finished(&pool, table, id, finished).await;
        let statements = [
            ("dead_leases", maintenance::dead_leases_sql(kind), "", ""),
            (
                "rearm",
                maintenance::rearm_sql(kind),
                "(uuid[])",
                "ARRAY[gen_random_uuid()]",
            ),
        ];
        for mode in ["force_custom_plan", "force_generic_plan"] {
            sqlx::query(&format!("SET plan_cache_mode = {mode}"))
                .execute(&mut *conn)
                .await
                .unwrap();
            for (what, sql, types, args) in &statements {
                let name = format!("sweep_{}_{what}_{mode}", kind.name());
                let plan = if types.is_empty() {
                    sqlx::query_scalar(&format!("EXPLAIN (FORMAT JSON) {sql}"))
                        .fetch_one(&mut *conn)
                        .await
                        .unwrap()
                } else {
                    support::explain_prepared(&mut conn, "FORMAT JSON", &name, types, sql, args)
                        .await
                };
                let mut found = Vec::new();
                scans(&plan[0]["Plan"], &mut found);
                assert!(
                    found.iter().any(|(r, _, _)| r == table),
                    "{kind} {what}: the plan reads no {table}: {found:?}"
                );
                for (relation, node, index) in found {
                    if relation == table && node == "Seq Scan" {
                        seq.push(format!("{kind} {what} ({mode}): {node} on {relation}"));
                    } else if relation == table {
                        println!("{kind} {what} ({mode}): {node} on {relation} via {index:?}");
                    }
                }
            }
        }
    }
    assert!(
        seq.is_empty(),
        "sweep statements that read a whole job table of {FINISHED} finished rows: {seq:#?}"
    );
    drop(conn);
    fx.cleanup().await;
}

/// Exactly what a start releases (`maintenance::EARLIER_INCARNATIONS`), for a process of the
/// worker id `pod` whose holder is `pod#89abcdef`: the bare id and `pod#<8 hex>` other than its
/// own, and no holder of another id that begins with `pod#`.
#[tokio::test]
async fn earlier_incarnations_match_the_holder_format_exactly() {
    let env = support::TestEnv::new().await;
    let predicate = maintenance::EARLIER_INCARNATIONS.replace("j.worker_id", "$3");
    let cases = [
        ("pod", true),
        ("pod#0123abcd", true),
        ("pod#0123ABCD", true),
        ("pod#89abcdef", false),
        ("pod#7", false),
        ("pod#7#0123abcd", false),
        ("pod#0123abc", false),
        ("pod#0123abcde", false),
        ("pod#0123abcz", false),
        ("podx#0123abcd", false),
        ("po#0123abcd", false),
        ("other", false),
    ];
    for (worker_id, earlier) in cases {
        let got: bool = sqlx::query_scalar(&format!("SELECT coalesce({predicate}, false)"))
            .bind("pod#89abcdef")
            .bind("pod")
            .bind(worker_id)
            .fetch_one(&env.pool)
            .await
            .unwrap();
        assert_eq!(got, earlier, "{worker_id}");
        if earlier && worker_id != "pod" {
            assert_eq!(kfs_worker::liveness::id_of(worker_id), "pod");
        }
    }
    env.cleanup().await;
}

/// A worker id may contain `#`. When a process starts as `pod`, it releases the leases of the
/// earlier incarnations of `pod` (a killed predecessor's, `pod#<8 hex>`), and not those of a
/// live worker whose id is `pod#7` (its holder is `pod#7#<8 hex>`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_worker_pod_7_keeps_its_leases_when_a_worker_pod_starts() {
    const TENANT: &str = "tenant-ids";
    let fx = SpaceFx::new(TENANT, "ids", "Ids").await;
    let pool = fx.pool().clone();
    let other_space = {
        let mut conn = pool.acquire().await.unwrap();
        platform::create_bare_space(&mut conn, TENANT, "ids-2", "Ids 2", OWNER)
            .await
            .unwrap()
    };
    let (of_pod_7, of_dead_pod) = {
        let mut conn = pool.acquire().await.unwrap();
        (
            bootstrap::enqueue(&mut conn, TENANT, fx.space)
                .await
                .unwrap(),
            bootstrap::enqueue(&mut conn, TENANT, other_space)
                .await
                .unwrap(),
        )
    };
    // The live worker `pod#7`: its liveness locks held, one bootstrap leased.
    let pod_7 = kfs_worker::liveness::holder("pod#7");
    let _alive = kfs_worker::liveness::acquire_process(&fx.env.services().database_url, &pod_7)
        .await
        .unwrap();
    let kind = BootstrapKind::default();
    let mut conn = pool.acquire().await.unwrap();
    let lease_7 = kind
        .claim(&mut conn, &pod_7)
        .await
        .unwrap()
        .expect("claimed");
    assert_eq!(lease_7.job_id, of_pod_7);
    // A killed earlier incarnation of `pod` leased the other one.
    let dead_pod = "pod#0badcafe";
    let dead_lease = kind
        .claim(&mut conn, dead_pod)
        .await
        .unwrap()
        .expect("claimed");
    assert_eq!(dead_lease.job_id, of_dead_pod);
    drop(conn);
    let lease_of = |job: Uuid| {
        let pool = pool.clone();
        async move {
            sqlx::query_as::<_, (Option<String>, Option<Uuid>)>(
                "SELECT worker_id, lease_token FROM legacy_space_publication_bootstraps WHERE id = $1",
            )
            .bind(job)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };

    let e = [
        ("KFS_OBJECT_STORE", fx.store_url.as_str()),
        ("KFS_KINDS", "compile"),
        ("KFS_EMBEDDER", "offline"),
        ("KFS_LEASED_POLL", "100ms"),
        ("KFS_SHUTDOWN_GRACE", "5s"),
    ];
    let mut pod = fx
        .env
        .spawn_worker("pod", &["run", "--leased", "--worker-id", "pod"], &e);
    // The start releases (or claims) its predecessor's lease before it claims anything.
    let released = fx
        .env
        .wait_until(Duration::from_secs(30), || async {
            lease_of(of_dead_pod).await.1 != Some(dead_lease.lease_token)
        })
        .await;
    assert!(
        released,
        "pod never took back the lease of its dead predecessor {dead_pod}\n{}",
        pod.tail(20)
    );
    assert_eq!(
        lease_of(of_pod_7).await,
        (Some(pod_7.clone()), Some(lease_7.lease_token)),
        "the start of pod released the live lease of {pod_7}\n{}",
        pod.tail(20)
    );
    support::stop_cleanly([&mut pod], Duration::from_secs(20)).await;
    fx.cleanup().await;
}
