//! Failing items retry on their own schedule then die, and a manual retry by the requester or
//! an owner (interactively) finishes the failed job.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failing_items_retry_then_die_and_a_manual_retry_under_either_authority_finishes_the_job() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 2).await;
    let pool = fx.pool();
    let flaky = Arc::new(Flaky {
        inner: fx.store.clone(),
        broken: AtomicBool::new(true),
        calls: AtomicU64::new(0),
    });
    let h = handler(&fx)
        .with_objects(flaky.clone())
        .with_config(DeletionConfig {
            item_max_attempts: 3,
            ..fast_config()
        });
    let driver = Driver::new(&fx, Arc::new(h), Budget::default()).await;

    // Requested by bob (an MCP client); rescued later by the owner, interactively.
    let bob = snapshot_for(&fx, &s, "bob", "mcp").await;
    let by_bob = |doc: Uuid, key: &str| DeletionRequest {
        requested_by_subject_id: "bob".into(),
        permission_snapshot_id: bob,
        access_channel: "mcp".into(),
        ..target_request(&s, Target::Document { id: doc }, key)
    };
    let doc = s.docs[1];
    let job = request(pool, &by_bob(doc, "fail-1")).await.unwrap();
    // The request seeds the raw object's item with the job's attempts; this test gives every
    // item three.
    sqlx::query(
        "UPDATE deletion_job_items SET max_attempts = 3 WHERE deletion_job_id = $1 AND ordinal = 0",
    )
    .bind(job)
    .execute(pool)
    .await
    .unwrap();
    let (state, cp) = driver.finish(job, true).await;
    assert_eq!(
        (state.as_str(), cp.as_str()),
        ("failed", "deleting_objects")
    );
    let row: (Option<String>, Option<i32>, String) = sqlx::query_as(
        "SELECT last_error_code, active_slot, (SELECT status FROM deletion_outbox WHERE deletion_job_id = $1 \
           AND delivery_revision = 1) FROM deletion_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        row,
        (Some("item_dead".into()), Some(1), "dead".into()),
        "a failed deletion keeps its slot"
    );
    type Item = (String, i32, i32, Option<String>, bool, bool);
    let items = |pool: PgPool| async move {
        sqlx::query_as::<_, Item>(
            "SELECT status, attempts, max_attempts, last_error_code, object_key IS NOT NULL, redacted_at IS NULL \
             FROM deletion_job_items WHERE deletion_job_id = $1 AND kind = 'object' ORDER BY ordinal",
        )
        .bind(job)
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    let dead = items(pool.clone()).await;
    // The request's raw item and the inventory's item for the same key, each on its own schedule.
    assert_eq!(dead.len(), 2, "{dead:?}");
    for d in &dead {
        assert_eq!(
            d,
            &("dead".into(), 3, 3, Some("object_store".into()), true, true)
        );
    }
    assert_eq!(
        flaky.calls.load(Ordering::SeqCst),
        6,
        "one call per item and attempt"
    );
    // Still fenced: no new request can take the target while the failed job holds it.
    assert!(matches!(
        request(pool, &by_bob(doc, "fail-again")).await,
        Err(RequestError::TargetBusy { .. })
    ));

    let retry = |actor: &str, snap: Uuid, channel: &str, authority: RetryAuthority, key: &str| {
        RetryRequest {
            job_id: job,
            actor_subject_id: actor.into(),
            permission_snapshot_id: snap,
            access_channel: channel.into(),
            authority,
            idempotency_key: key.into(),
        }
    };
    let do_retry = |r: RetryRequest| {
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            let out = retry_deletion(&mut tx, &r).await;
            tx.commit().await.unwrap();
            out
        }
    };
    // Refused: a stranger claiming to be the requester; an owner rescue outside the interactive
    // channel; an interactive "rescue" by someone who is not an owner.
    let carol = snapshot_for(&fx, &s, "carol", "interactive").await;
    let owner_mcp = snapshot_for(&fx, &s, OWNER, "mcp").await;
    for (r, why) in [
        (
            retry(
                "carol",
                carol,
                "interactive",
                RetryAuthority::OriginalRequester,
                "r0",
            ),
            "not the subject that requested",
        ),
        (
            retry(
                OWNER,
                owner_mcp,
                "mcp",
                RetryAuthority::InteractiveOwnerRescue,
                "r0",
            ),
            "interactive",
        ),
        (
            retry(
                "carol",
                carol,
                "interactive",
                RetryAuthority::InteractiveOwnerRescue,
                "r0",
            ),
            "owner",
        ),
    ] {
        let out = do_retry(r).await;
        assert!(
            matches!(&out, Err(RequestError::RetryRefused(m)) if m.contains(why)),
            "{why}: {out:?}"
        );
    }
    let audits: i64 = sqlx::query_scalar("SELECT count(*) FROM deletion_retry_audits")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(audits, 0);

    // The original requester retries; the same request again is the same retry.
    let r1 = retry("bob", bob, "mcp", RetryAuthority::OriginalRequester, "r1");
    let first = do_retry(r1.clone()).await.unwrap();
    let again = do_retry(r1).await.unwrap();
    assert!(first.created && !again.created && first.outbox_id == again.outbox_id);
    assert_eq!(first.delivery_revision, 2);
    let (state, rv_ok, room, err): (String, bool, bool, Option<String>) = sqlx::query_as(
        "SELECT run_state, row_version > 1, max_execution_attempts > execution_attempts, last_error_code \
         FROM deletion_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        (state.as_str(), rv_ok, room, err),
        ("dispatch_pending", true, true, None)
    );
    for item in items(pool.clone()).await {
        assert_eq!(
            (item.0.as_str(), item.1, item.2),
            ("pending", 0, 4),
            "re-armed with one more attempt"
        );
    }
    let outbox: (String, String) =
        sqlx::query_as("SELECT idempotency_key, status FROM deletion_outbox WHERE id = $1")
            .bind(first.outbox_id)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(outbox, (format!("deletion:{job}:2"), "pending".into()));
    // Still broken: the re-armed attempts fail, and the job fails again.
    assert_eq!(driver.finish(job, true).await.0, "failed");
    assert_eq!(flaky.calls.load(Ordering::SeqCst), 6 + 8);

    // Now the owner rescues it, interactively, and the store works again.
    flaky.broken.store(false, Ordering::SeqCst);
    let rescued = do_retry(retry(
        OWNER,
        s.owner_snapshot,
        "interactive",
        RetryAuthority::InteractiveOwnerRescue,
        "r2",
    ))
    .await
    .unwrap();
    assert_eq!(rescued.delivery_revision, 3);
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    let audit: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT retry_authority, actor_subject_id, access_channel FROM deletion_retry_audits \
         WHERE deletion_job_id = $1 ORDER BY created_at",
    )
    .bind(job)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        audit,
        vec![
            ("original_requester".into(), "bob".into(), "mcp".into()),
            (
                "interactive_owner_rescue".into(),
                OWNER.into(),
                "interactive".into()
            ),
        ]
    );
    let requester: String =
        sqlx::query_scalar("SELECT requested_by_subject_id FROM deletion_jobs WHERE id = $1")
            .bind(job)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(requester, "bob", "a rescue never rewrites the requester");
    assert!(files_under(&fx.dir, &format!("{}/documents/{doc}", s.prefix)).is_empty());
    assert!(!files_under(&fx.dir, &format!("{}/documents/{}", s.prefix, s.docs[0])).is_empty());
    // A job that did not fail cannot be retried.
    let out = do_retry(retry(
        "bob",
        bob,
        "mcp",
        RetryAuthority::OriginalRequester,
        "r3",
    ))
    .await;
    assert!(
        matches!(out, Err(RequestError::NotRetryable { .. })),
        "{out:?}"
    );
    fx.cleanup().await;
}
