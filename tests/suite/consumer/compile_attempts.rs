//! Compile attempts on the platform's table: one walks to `published` and its success frees its
//! slot; a failed one frees its slot too and is complete.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compile_attempt_walks_to_published_and_success_frees_its_slot() {
    let env = TestEnv::new().await;
    let space = space(&env.pool).await;
    let (attempt, outbox) = insert_compile(&env.pool, space).await;
    let engine = platform_engine(&env, "worker-compile", None, ConsumerConfig::default());

    assert_eq!(
        deliver(&env, &engine, Kind::Compile).await,
        ack("claimed", Some("succeeded"))
    );
    assert_eq!(
        run_state_row(&env.pool, Kind::Compile, attempt).await,
        RunStateRow {
            run_state: "succeeded".into(),
            checkpoint: "published".into(),
            active_slot: None,
            completed: true,
            lease_cleared: true,
            retry_at: Some(false),
            last_error_code: None,
            execution_attempts: 1,
        }
    );
    assert_eq!(
        outbox_status(&env.pool, Kind::Compile, outbox).await,
        ("completed".into(), true)
    );
    // The handler's writes committed with the steps: a bound candidate and a published head.
    let (bound, head_revision): (bool, i32) = sqlx::query_as(
        "SELECT a.candidate_publication_id IS NOT NULL, h.head_revision FROM document_compilation_attempts a \
         JOIN projection_set_publication_heads h ON h.publication_id = a.candidate_publication_id WHERE a.id = $1",
    )
    .bind(attempt)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!((bound, head_revision), (true, 1));
    // row_version: 0 written by the platform, +1 relay mark, +1 claim, +1 per checkpoint advance
    // (5), +1 end (the sixth step's write). The step fence locks the row and writes nothing.
    let rv: i32 =
        sqlx::query_scalar("SELECT row_version FROM document_compilation_attempts WHERE id = $1")
            .bind(attempt)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(rv, 8);

    // A second attempt for the same document version can take the freed slot.
    let doc: Uuid = sqlx::query_scalar(
        "SELECT document_asset_id FROM document_compilation_attempts WHERE id = $1",
    )
    .bind(attempt)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO document_compilation_attempts (id, tenant_id, knowledge_space_id, document_asset_id, document_version, \
           publication_generation_id, base_head_revision, checkpoint, run_state, active_slot, execution_attempts, \
           max_execution_attempts, row_version, created_at, updated_at) \
         VALUES (gen_random_uuid(), $1, $2, $3, 1, gen_random_uuid(), 1, 'queued', 'dispatch_pending', 1, 0, 5, 0, now(), now())",
    )
    .bind(TENANT)
    .bind(space)
    .bind(doc)
    .execute(&env.pool)
    .await
    .expect("the active slot is free again");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_compile_attempt_frees_its_slot_and_is_complete() {
    let env = TestEnv::new().await;
    let space = space(&env.pool).await;
    let (attempt, outbox) = insert_compile(&env.pool, space).await;
    let engine = platform_engine(
        &env,
        "worker-compile-fail",
        Some("outline_built"),
        ConsumerConfig::default(),
    );

    assert_eq!(
        deliver(&env, &engine, Kind::Compile).await,
        ack("claimed", Some("failed"))
    );
    assert_eq!(
        run_state_row(&env.pool, Kind::Compile, attempt).await,
        RunStateRow {
            run_state: "failed".into(),
            checkpoint: "outline_built".into(),
            active_slot: None,
            completed: true,
            lease_cleared: true,
            retry_at: Some(false),
            last_error_code: Some("compile_broken".into()),
            execution_attempts: 1,
        }
    );
    assert_eq!(
        outbox_status(&env.pool, Kind::Compile, outbox).await,
        ("dead".into(), true)
    );
    env.cleanup().await;
}
