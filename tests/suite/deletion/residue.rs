//! Residue found at the end (a document a writer added past the fence) sends the job back to
//! quiescing; a second inventory pass erases it.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn residue_found_at_the_end_sends_the_job_back_to_quiescing() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 1, 2).await;
    let pool = fx.pool();
    let job = request(pool, &space_request(&s, "residue")).await.unwrap();
    // One step per slice, so the test sees every checkpoint.
    let driver = Driver::new(
        &fx,
        Arc::new(handler(&fx)),
        Budget {
            max_steps: 1,
            max_time: Duration::from_secs(20),
        },
    )
    .await;
    let mut straggler = None;
    let mut checkpoints = Vec::new();
    for _ in 0..2000 {
        let (state, cp) = job_state(pool, job).await;
        assert_ne!(state, "failed");
        if checkpoints.last() != Some(&cp) {
            checkpoints.push(cp.clone());
        }
        if cp == "deleting_derived_data" && straggler.is_none() {
            // A writer that ignores the fence adds a document (with its bytes).
            let mut c = conn(pool).await;
            let d = platform::add_document(
                &mut c,
                &fx.store,
                s.id,
                None,
                "late.md",
                "text/markdown",
                Bytes::from_static(b"# late\n\nwritten after the inventory"),
            )
            .await
            .unwrap();
            let key: String =
                sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
                    .bind(d)
                    .fetch_one(pool)
                    .await
                    .unwrap();
            straggler = Some(key);
        }
        if state == "succeeded" {
            break;
        }
        if state == "retry_wait" {
            skip_wait(pool, job).await;
        }
        driver.turn().await;
    }
    let straggler = straggler.expect("the job passed through deleting_derived_data");
    assert_finished_clean(pool, job).await;
    let back = checkpoints
        .windows(2)
        .any(|w| w[0] == "deleting_primary_data" && w[1] == "quiescing");
    assert!(
        back,
        "the residue sent the job back to quiescing: {checkpoints:?}"
    );
    let cursor: Option<String> =
        sqlx::query_scalar("SELECT scan_cursor FROM deletion_jobs WHERE id = $1")
            .bind(job)
            .fetch_one(pool)
            .await
            .unwrap();
    assert!(
        cursor.unwrap_or_default().contains("\"pass\":2"),
        "a second inventory pass ran"
    );
    let erased: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM deletion_job_items WHERE deletion_job_id = $1 AND idempotency_key = $2 \
           AND status = 'completed'",
    )
    .bind(job)
    .bind(format!("object:{}", platform::sha256_hex(straggler.as_bytes())))
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        erased, 1,
        "the straggler's object was inventoried and erased"
    );
    assert!(!fx.dir.join(&straggler).exists());
    let cat = catalog(pool).await;
    let left = cat.count_owned(pool, Some(s.id), &s.docs).await;
    assert!(left.is_empty(), "{left:?}");
    assert!(files_under(&fx.dir, &s.prefix).is_empty());
    fx.cleanup().await;
}
