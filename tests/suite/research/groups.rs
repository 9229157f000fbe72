//! Tasks claimed or stepped together take each stage in one transaction, read their space and
//! snapshot once and write each table once, and answer as a task alone; a model keeps a
//! transaction per step.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tasks_claimed_together_take_each_stage_in_one_transaction_and_answer_as_alone() {
    let s = seed("group").await;
    let pool = s.pool().clone();
    let env = &s.env;
    // One task alone: the walk every member of the group must also have.
    let solo = request(&pool, &req(&s, QUESTION)).await;
    let alone = engine(&pool, "research-solo", extractive());
    assert_eq!(run_until_settled(&s, &alone, solo).await.stage, "completed");

    let ids = [
        request(&pool, &req(&s, QUESTION)).await,
        request(
            &pool,
            &req(&s, "When does a lease expire without a heartbeat?"),
        )
        .await,
        request(&pool, &req(&s, "What does fencing refuse?")).await,
    ];
    assert_eq!(relay_round(&s).await, 3);
    let ch = env.channel().await;
    let mut got = Vec::new();
    while let Some(m) = ch
        .basic_get(
            env.topology.queue(Kind::Research).as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
    {
        got.push(m.delivery);
    }
    assert_eq!(got.len(), 3);
    let items: Vec<(&lapin::BasicProperties, &[u8])> = got
        .iter()
        .map(|d| (&d.properties, d.data.as_slice()))
        .collect();
    let together = engine(&pool, "research-group", extractive());
    let handled = tokio::time::timeout(
        HANG,
        together.process_many(Kind::Research, &items, &CancellationToken::new()),
    )
    .await
    .expect("process_many hung");
    assert!(
        handled.iter().all(|h| matches!(
            h,
            Handled::Ack {
                end: Some("succeeded"),
                ..
            }
        )),
        "{handled:?}"
    );

    // The group's last step wrote every member's row in one transaction.
    let ends: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT xmin::text) FROM research_task_jobs WHERE id = ANY($1)",
    )
    .bind(&ids[..])
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(ends, 1, "the members ended in one commit");
    // And each member's own record is the one a task run alone leaves.
    let walk = types(&events(&pool, solo).await);
    for id in ids {
        let j = job(&pool, id).await;
        assert_eq!((j.stage.as_str(), j.lease_token), ("completed", None));
        let evs = events(&pool, id).await;
        assert_contiguous(id, &evs);
        assert_eq!(types(&evs), walk, "task {id}");
        assert_eq!(
            partials(&pool, id).await.len(),
            1,
            "task {id}: one final bundle"
        );
    }
    s.fx.cleanup().await;
}

/// Scans of `table` by this transaction so far.
async fn scans(tx: &mut PgConnection, table: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0) FROM pg_stat_xact_user_tables WHERE relname = $1",
    )
    .bind(table)
    .fetch_one(tx)
    .await
    .unwrap()
}

/// `(rows, distinct statements)` of `table`'s rows of `ids` (by `id_column`) that this
/// transaction wrote: rows written by one statement share its command id.
async fn written(tx: &mut PgConnection, table: &str, id_column: &str, ids: &[Uuid]) -> (i64, i64) {
    sqlx::query_as(&format!(
        "SELECT count(*), count(DISTINCT cmin::text) FROM {table} \
         WHERE {id_column} = ANY($1) AND xmin::text = pg_current_xact_id()::text"
    ))
    .bind(ids)
    .fetch_one(tx)
    .await
    .unwrap()
}

#[tokio::test]
async fn tasks_stepped_together_read_their_space_and_snapshot_once_and_write_each_table_once() {
    let s = seed("group-reads").await;
    let pool = s.pool().clone();
    let handler = extractive();
    let questions = [
        QUESTION,
        "When does a lease expire without a heartbeat?",
        "What does fencing refuse?",
    ];
    let mut ids = Vec::new();
    for q in questions {
        ids.push(request(&pool, &req(&s, q)).await);
    }
    ids.sort();
    let mut ctxs = Vec::new();
    for id in &ids {
        ctxs.push(claim_by_hand(&pool, *id, "research-group-reads").await);
    }
    let st = Statements::new(&RESEARCH);
    for advance in ADVANCES {
        let mut tx = pool.begin().await.unwrap();
        for ctx in ctxs.iter_mut() {
            ctx.row_version = lease::fence(&mut tx, &st, ctx, Duration::from_secs(30))
                .await
                .unwrap()
                .expect("ours");
        }
        let fences_before = scans(&mut tx, "deletion_jobs").await;
        let policies_before = scans(&mut tx, "knowledge_space_access_policies").await;
        let until = kfs_worker::jobs::Until::after(Duration::from_secs(3600));
        let steps = handler.step_many(&mut tx, &ctxs, until).await.unwrap();
        assert_eq!(
            scans(&mut tx, "deletion_jobs").await - fences_before,
            1,
            "step to {advance}: the space's deletion fence is read once for the three tasks"
        );
        assert_eq!(
            scans(&mut tx, "knowledge_space_access_policies").await - policies_before,
            1,
            "step to {advance}: the snapshot is revalidated once for the three tasks"
        );
        let (events, statements) = written(
            &mut tx,
            "research_task_progress_events",
            "research_task_job_id",
            &ids,
        )
        .await;
        assert!(events >= 3, "step to {advance}: {events} events");
        assert_eq!(
            statements, 1,
            "step to {advance}: the events in one statement"
        );
        if advance != "planning" {
            // Every stage after the first writes the task's metadata.
            assert_eq!(
                written(&mut tx, "research_task_jobs", "id", &ids).await,
                (3, 1),
                "step to {advance}: the job rows in one statement"
            );
        }
        if advance == "completed" {
            assert_eq!(
                written(
                    &mut tx,
                    "research_task_partial_results",
                    "research_task_job_id",
                    &ids
                )
                .await,
                (3, 1),
                "the final bundles in one statement"
            );
        }
        for (ctx, step) in ctxs.iter_mut().zip(&steps) {
            commit_step(&mut tx, &st, ctx, step).await;
        }
        tx.commit().await.unwrap();
    }
    // The walk each task took is the one a task stepped alone takes.
    let solo = request(&pool, &req(&s, QUESTION)).await;
    let mut ctx = claim_by_hand(&pool, solo, "research-solo").await;
    while let Some(step) = step_by_hand(&pool, handler.as_ref(), &mut ctx)
        .await
        .unwrap()
    {
        if !matches!(step, Step::Advance(_)) {
            break;
        }
    }
    let walk = types(&events(&pool, solo).await);
    for id in &ids {
        let j = job(&pool, *id).await;
        assert_eq!(j.stage, "completed", "task {id}");
        let evs = events(&pool, *id).await;
        assert_contiguous(*id, &evs);
        assert_eq!(types(&evs), walk, "task {id}");
        assert_eq!(partials(&pool, *id).await.len(), 1, "task {id}");
    }
    s.fx.cleanup().await;
}

#[test]
fn tasks_that_call_a_model_keep_a_transaction_per_step() {
    assert!(
        ResearchHandler::with_generator(Arc::new(ExtractiveGenerator::new())).shares_transaction()
    );
    let with_model = ResearchHandler::with_generator(openai("http://127.0.0.1:9/v1", 0.0, 0.0));
    assert!(!with_model.shares_transaction());
}
