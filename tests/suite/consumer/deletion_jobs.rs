//! Deletion jobs on the platform's table: one walks to `completed` and completes its tombstone; a
//! failed one keeps its slot and stays incomplete for a manual retry.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_job_walks_to_completed_and_completes_its_tombstone() {
    let env = TestEnv::new().await;
    let space = space(&env.pool).await;
    let (job, outbox, doc) = insert_deletion(&env.pool, space).await;
    let engine = platform_engine(&env, "worker-deletion", None, ConsumerConfig::default());

    assert_eq!(
        deliver(&env, &engine, Kind::Deletion).await,
        ack("claimed", Some("succeeded"))
    );
    assert_eq!(
        run_state_row(&env.pool, Kind::Deletion, job).await,
        RunStateRow {
            run_state: "succeeded".into(),
            checkpoint: "completed".into(),
            active_slot: None,
            completed: true,
            lease_cleared: true,
            retry_at: Some(false),
            last_error_code: None,
            execution_attempts: 1,
        }
    );
    assert_eq!(
        outbox_status(&env.pool, Kind::Deletion, outbox).await,
        ("completed".into(), true)
    );
    let (tombstone, inventory, docs): (String, bool, i64) = sqlx::query_as(
        "SELECT t.state, j.inventory_complete, (SELECT count(*) FROM document_assets WHERE id = $2) \
         FROM deletion_jobs j JOIN deletion_tombstones t ON t.deletion_job_id = j.id WHERE j.id = $1",
    )
    .bind(job)
    .bind(doc)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        (tombstone.as_str(), inventory, docs),
        ("completed", true, 0)
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_deletion_job_keeps_its_slot_and_stays_incomplete_for_a_manual_retry() {
    let env = TestEnv::new().await;
    let space = space(&env.pool).await;
    let (job, outbox, doc) = insert_deletion(&env.pool, space).await;
    let engine = platform_engine(
        &env,
        "worker-deletion-fail",
        Some("deleting_objects"),
        ConsumerConfig::default(),
    );

    assert_eq!(
        deliver(&env, &engine, Kind::Deletion).await,
        ack("claimed", Some("failed"))
    );
    assert_eq!(
        run_state_row(&env.pool, Kind::Deletion, job).await,
        RunStateRow {
            run_state: "failed".into(),
            checkpoint: "deleting_objects".into(),
            active_slot: Some(1),
            completed: false,
            lease_cleared: true,
            retry_at: Some(false),
            last_error_code: Some("deletion_broken".into()),
            execution_attempts: 1,
        }
    );
    assert_eq!(
        outbox_status(&env.pool, Kind::Deletion, outbox).await,
        ("dead".into(), true)
    );
    let (tombstone, docs): (String, i64) = sqlx::query_as(
        "SELECT t.state, (SELECT count(*) FROM document_assets WHERE id = $2) FROM deletion_tombstones t WHERE t.deletion_job_id = $1",
    )
    .bind(job)
    .bind(doc)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        (tombstone.as_str(), docs),
        ("active", 1),
        "the target stays fenced, nothing half-deleted"
    );
    // The kept slot still blocks a second active deletion of the same target.
    let dup = sqlx::query(
        "INSERT INTO deletion_jobs (id, tenant_id, knowledge_space_id, target_type, target_id, target_revision, delete_mode, \
           requested_by_subject_id, permission_snapshot_id, permission_snapshot_revision, access_channel, idempotency_key, \
           request_fingerprint, checkpoint, inventory_complete, run_state, active_slot, execution_attempts, \
           max_execution_attempts, row_version, created_at, updated_at) \
         VALUES (gen_random_uuid(), $1, $2, 'document_asset', $3, 1, 'cascade', 'user-1', gen_random_uuid(), 1, 'interactive', \
           'req-second', repeat('a', 64), 'requested', false, 'dispatch_pending', 1, 0, 10, 1, now(), now())",
    )
    .bind(TENANT)
    .bind(space)
    .bind(doc)
    .execute(&env.pool)
    .await;
    let err = dup
        .expect_err("the failed job still holds the target's active slot")
        .to_string();
    assert!(err.contains("deletion_jobs_target_active_uq"), "{err}");
    env.cleanup().await;
}
