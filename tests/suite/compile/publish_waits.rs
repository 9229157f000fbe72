//! A publish that cannot go on yet (a document it inherits is being deleted, or another publisher
//! holds the head) ends its slice with a cooperative wait, uses no attempt and publishes after.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publish_over_a_document_being_deleted_waits_for_the_deletion_and_then_publishes() {
    use kfs_worker::jobs::deletion::request::{self as del, DeletionRequest, Target};
    let fx = Fx::new().await;
    let gone = fx
        .add(
            "gone.md",
            "text/markdown",
            b"# Gone\n\nGannets dive for fish.",
        )
        .await;
    fx.compile(gone).await;
    let kept = fx
        .add(
            "kept.md",
            "text/markdown",
            b"# Kept\n\nKittiwakes nest on cliffs.",
        )
        .await;
    let one_step = fx.engine("w-fence", 1);
    let attempt = fx.request(kept, false).await.unwrap();
    fx.drive_to(&one_step, attempt, "smoke_eval_passed").await;
    // The document the candidate inherits is being deleted (tombstone written, head not yet
    // changed): the publish waits, using no attempt, and publishes nothing.
    let owner = fx.snapshot(support::space::OWNER).await;
    let mut tx = fx.pool().begin().await.unwrap();
    let job = del::request_deletion(
        &mut tx,
        &DeletionRequest {
            tenant_id: TENANT.into(),
            knowledge_space_id: fx.space,
            target: Target::Document { id: gone },
            expected_revision: None,
            requested_by_subject_id: support::space::OWNER.into(),
            permission_snapshot_id: owner,
            access_channel: "interactive".into(),
            idempotency_key: "fence-test".into(),
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let before = fx.status(attempt).await;
    assert_eq!(
        fx.slice(&one_step, attempt).await,
        Handled::Ack {
            claim: "claimed",
            end: Some("wait")
        }
    );
    let waited = fx.status(attempt).await;
    assert_eq!(waited.run_state, "retry_wait", "{waited:?}");
    assert_eq!(
        waited.execution_attempts, before.execution_attempts,
        "no attempt used"
    );
    assert_eq!(fx.head().await.unwrap().revision, 1, "nothing published");
    // The deletion takes its target out of the head; the attempt then publishes over it.
    {
        let mut conn = fx.pool().acquire().await.unwrap();
        kfs_worker::publication::publish_excluding(
            &mut conn,
            TENANT,
            fx.space,
            job.job_id,
            Some(&[gone][..]),
            &serde_json::json!({}),
        )
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    }
    sqlx::query("UPDATE document_compilation_attempts SET retry_at = now() WHERE id = $1")
        .bind(attempt)
        .execute(fx.pool())
        .await
        .unwrap();
    let done = fx.drive(&one_step, attempt).await;
    assert_succeeded(&done);
    let served = fx.served().await;
    assert!(
        served.contains_key(&kept) && !served.contains_key(&gone),
        "{served:?}"
    );
    assert_eq!(fx.head().await.unwrap().revision, 3);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publish_behind_a_long_held_head_lock_waits_without_holding_its_job_row() {
    let fx = Fx::new().await;
    let first = fx
        .add("first.md", "text/markdown", b"# First\n\nPuffins burrow.")
        .await;
    fx.compile(first).await;
    let second = fx
        .add(
            "second.md",
            "text/markdown",
            b"# Second\n\nShags dry their wings.",
        )
        .await;
    let one_step = fx.engine("w-head", 1);
    let attempt = fx.request(second, false).await.unwrap();
    fx.drive_to(&one_step, attempt, "smoke_eval_passed").await;
    // Another publisher holds the head far longer than a publish may queue for it.
    let mut holder = fx.pool().begin().await.unwrap();
    sqlx::query(
        "SELECT 1 FROM projection_set_publication_heads WHERE tenant_id = $1 AND knowledge_space_id = $2 FOR UPDATE",
    )
    .bind(TENANT)
    .bind(fx.space)
    .execute(&mut *holder)
    .await
    .unwrap();
    let before = fx.status(attempt).await;
    // The slice ends with a cooperative wait while the head is still held: its transaction
    // (and so the job row the heartbeat needs) is released, no attempt is used.
    let handled = tokio::time::timeout(Duration::from_secs(30), fx.slice(&one_step, attempt))
        .await
        .expect("the publish slice ended while another transaction held the head");
    assert_eq!(
        handled,
        Handled::Ack {
            claim: "claimed",
            end: Some("wait")
        }
    );
    let waited = fx.status(attempt).await;
    assert_eq!(waited.run_state, "retry_wait", "{waited:?}");
    assert_eq!(
        waited.execution_attempts, before.execution_attempts,
        "no attempt used"
    );
    let free: Uuid = sqlx::query_scalar(
        "SELECT id FROM document_compilation_attempts WHERE id = $1 FOR UPDATE NOWAIT",
    )
    .bind(attempt)
    .fetch_one(fx.pool())
    .await
    .expect("the job row is free while the head is held");
    assert_eq!(free, attempt);
    holder.rollback().await.unwrap();
    sqlx::query("UPDATE document_compilation_attempts SET retry_at = now() WHERE id = $1")
        .bind(attempt)
        .execute(fx.pool())
        .await
        .unwrap();
    let done = fx.drive(&one_step, attempt).await;
    assert_succeeded(&done);
    let served = fx.served().await;
    assert!(
        served.contains_key(&first) && served.contains_key(&second),
        "{served:?}"
    );
    fx.cleanup().await;
}
