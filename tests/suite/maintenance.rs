//! Maintenance against the platform's tables: what the sweep that every process runs every
//! second reads, and whose leases a process releases when it starts under a worker id.
//! Invariant under test: the sweep reads a job table only through indexes, however many
//! finished rows it holds, and a start releases only the leases of its own id's earlier
//! incarnations.

use kfs_worker::jobs::deletion::{request_deletion, DeletionRequest, Target};
use kfs_worker::jobs::research::{self, ResearchRequest};
use kfs_worker::jobs::Kind;
use kfs_worker::maintenance;
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
