//! An attempt off the straight path: superseded by a later publication, re-armed by a manual retry,
//! held until released when deferred, refused beside another active attempt or for a deleting
//! document, and canceled when its document is marked deleting mid-compile.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_older_attempt_is_superseded_by_a_later_publication_of_its_version() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-supersede", 1);
    let doc = fx
        .add(
            "s.md",
            "text/markdown",
            b"# Seal\n\nSeals basking on rocks.",
        )
        .await;
    let old = fx.request(doc, false).await.unwrap();
    fx.drive_to(&engine, old, "smoke_eval_passed").await;
    fail_like_the_engine(fx.pool(), old).await;

    let new = fx.request(doc, false).await.unwrap();
    let sn = fx.drive(&engine, new).await;
    assert_succeeded(&sn);

    // The old attempt comes back by manual retry and reaches publish after the newer one won.
    {
        let mut tx = fx.pool().begin().await.unwrap();
        compile::retry(&mut tx, old).await.unwrap();
        tx.commit().await.unwrap();
    }
    let so = fx.drive(&engine, old).await;
    assert!(so.is_superseded(), "{so:?}");
    assert_eq!(so.active_slot, None);
    assert_eq!(so.checkpoint, "smoke_eval_passed", "it never published");
    let head = fx.head().await.unwrap();
    assert_eq!(head.revision, 1, "the head did not move");
    assert_eq!(
        fx.served().await[&doc].generation,
        sn.publication_generation_id
    );
    // Both attempts built the same content, so they share one fingerprint: the newer attempt
    // took over the candidate the old one had left, and published it.
    assert_eq!(so.candidate_publication_id, Some(head.publication_id));
    assert_eq!(sn.candidate_publication_id, Some(head.publication_id));
    assert_eq!(fx.search("basking").await.len(), 1);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn manual_retry_rearms_the_same_attempt_and_outbox_row() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-retry", 64);
    let good = b"Otters juggle pebbles in the kelp forest.";
    let doc = fx.add("otters.txt", "text/plain", good).await;
    let key: String = sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
        .bind(doc)
        .fetch_one(fx.pool())
        .await
        .unwrap();
    fx.store
        .put(&key, Bytes::from_static(b"garbled"))
        .await
        .unwrap();
    let attempt = fx.request(doc, false).await.unwrap();
    let failed = fx.drive(&engine, attempt).await;
    assert_failed(&failed, "hash_mismatch");
    let outbox_before: Uuid =
        sqlx::query_scalar("SELECT id FROM document_compilation_outbox WHERE attempt_id = $1")
            .bind(attempt)
            .fetch_one(fx.pool())
            .await
            .unwrap();

    // Refusals: a retry of a live attempt, and of a failed one while another is active.
    let other = fx.request(doc, true).await.unwrap();
    let mut tx = fx.pool().begin().await.unwrap();
    let e = compile::retry(&mut tx, other).await.unwrap_err();
    assert!(matches!(e, CompileError::NotRetryable { .. }), "{e}");
    let e = compile::retry(&mut tx, attempt).await.unwrap_err();
    assert!(
        matches!(e, CompileError::ActiveAttemptExists { attempt: Some(a), .. } if a == other),
        "{e}"
    );
    assert!(e
        .to_string()
        .contains("already has an active compilation attempt"));
    // The caller's transaction is still usable after the refusals.
    tx.commit().await.unwrap();
    let mut conn = fx.pool().acquire().await.unwrap();
    sqlx::query("DELETE FROM document_compilation_attempts WHERE id = $1")
        .bind(other)
        .execute(&mut *conn)
        .await
        .unwrap();

    fx.store.put(&key, Bytes::from_static(good)).await.unwrap();
    compile::retry(&mut conn, attempt).await.unwrap();
    drop(conn);
    let rearmed = fx.status(attempt).await;
    assert_eq!(rearmed.run_state, "dispatch_pending");
    assert_eq!(rearmed.active_slot, Some(1));
    assert_eq!(rearmed.execution_attempts, 0);
    assert_eq!(rearmed.completed_at, None);
    assert_eq!(rearmed.last_error_code, None);
    assert_eq!(rearmed.row_version, failed.row_version + 1);
    let (outbox_after, status, attempts, queue_job, last_error): (Uuid, String, i32, Option<String>, Option<String>) =
        sqlx::query_as(
            "SELECT id, status, dispatch_attempts, queue_job_id, last_error FROM document_compilation_outbox \
             WHERE attempt_id = $1 AND available_at <= now()",
        )
        .bind(attempt)
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(outbox_after, outbox_before, "the same outbox row");
    assert_eq!(
        (status.as_str(), attempts, queue_job, last_error),
        ("pending", 0, None, None)
    );

    let done = fx.drive(&engine, attempt).await;
    assert_succeeded(&done);
    assert_eq!(fx.search("otters kelp").await.len(), 1);
    let mut conn = fx.pool().acquire().await.unwrap();
    let e = compile::retry(&mut conn, attempt).await.unwrap_err();
    assert!(matches!(e, CompileError::NotRetryable { .. }), "{e}");
    let e = compile::retry(&mut conn, Uuid::now_v7()).await.unwrap_err();
    assert!(matches!(e, CompileError::AttemptNotFound(_)), "{e}");
    drop(conn);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deferred_dispatch_is_not_sent_until_released() {
    use kfs_worker::relay::{Relay, RelayConfig};
    use lapin::options::{BasicAckOptions, BasicGetOptions};

    let fx = Fx::new().await;
    let engine = fx.engine("w-defer", 64);
    let doc = fx
        .add(
            "d.md",
            "text/markdown",
            b"Dormice hibernate in hazel hedges.",
        )
        .await;
    let attempt = fx.request(doc, true).await.unwrap();
    let s = fx.status(attempt).await;
    assert_eq!(s.outbox_status.as_deref(), Some("pending"));
    assert_eq!(
        s.outbox_available_at
            .unwrap()
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        "9999-12-31T23:59:59.999Z"
    );
    let relay = Relay::new(
        fx.pool().clone(),
        fx.env.topology.clone(),
        "test-relay",
        RelayConfig::default(),
        &[Kind::Compile],
    );
    let ch = fx.env.confirm_channel().await;
    let round = relay.relay_once(&ch, Kind::Compile).await.unwrap();
    assert_eq!(round.dispatched, 0, "deferred: not sent");
    assert_eq!(
        fx.env
            .queue_depth(&fx.env.topology.queue(Kind::Compile))
            .await,
        0
    );

    let mut conn = fx.pool().acquire().await.unwrap();
    compile::release(&mut conn, attempt).await.unwrap();
    let e = compile::release(&mut conn, attempt).await.unwrap_err();
    assert!(matches!(e, CompileError::NotDeferred { .. }), "{e}");
    drop(conn);
    let round = relay.relay_once(&ch, Kind::Compile).await.unwrap();
    assert_eq!(round.dispatched, 1, "released: sent");

    // The real message runs the attempt.
    let get = fx.env.channel().await;
    let msg = get
        .basic_get(
            fx.env.topology.queue(Kind::Compile).as_str().into(),
            BasicGetOptions::default(),
        )
        .await
        .unwrap()
        .expect("a message");
    let handled = engine
        .process(
            Kind::Compile,
            &msg.properties,
            &msg.data,
            &CancellationToken::new(),
        )
        .await;
    assert_eq!(
        handled,
        Handled::Ack {
            claim: "claimed",
            end: Some("succeeded")
        }
    );
    msg.ack(BasicAckOptions::default()).await.unwrap();
    assert_succeeded(&fx.status(attempt).await);
    assert_eq!(fx.search("dormice").await.len(), 1);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_active_attempt_and_a_deleting_document_are_refused() {
    let fx = Fx::new().await;
    let doc = fx
        .add("x.txt", "text/plain", b"Xerus squirrels dig burrows.")
        .await;
    let mut tx = fx.pool().begin().await.unwrap();
    let first = compile::request(&mut tx, doc, RequestOptions::default())
        .await
        .unwrap();
    let e = compile::request(&mut tx, doc, RequestOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(e, CompileError::ActiveAttemptExists { attempt: Some(a), version: 1, .. } if a == first),
        "{e}"
    );
    assert!(e.is_refusal());
    tx.commit().await.unwrap();
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM document_compilation_attempts WHERE document_asset_id = $1",
    )
    .bind(doc)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(n, 1);
    let outbox: i64 = sqlx::query_scalar("SELECT count(*) FROM document_compilation_outbox")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(outbox, 1);

    // Two concurrent requests: exactly one wins, the other gets the typed refusal.
    let doc2 = fx.add("y.txt", "text/plain", b"Yaks carry salt.").await;
    let (mut t1, mut t2) = (
        fx.pool().begin().await.unwrap(),
        fx.pool().begin().await.unwrap(),
    );
    let r1 = compile::request(&mut t1, doc2, RequestOptions::default()).await;
    let pending = tokio::spawn(async move {
        let r = compile::request(&mut t2, doc2, RequestOptions::default()).await;
        t2.commit().await.unwrap();
        r
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    t1.commit().await.unwrap();
    let r2 = pending.await.unwrap();
    assert!(r1.is_ok());
    assert!(
        matches!(r2, Err(CompileError::ActiveAttemptExists { .. })),
        "{r2:?}"
    );

    let doc3 = fx.add("z.txt", "text/plain", b"Zebras.").await;
    sqlx::query(
        "UPDATE document_assets SET lifecycle_state = 'deleting', deletion_job_id = gen_random_uuid(), deleting_at = now() \
         WHERE id = $1",
    )
    .bind(doc3)
    .execute(fx.pool())
    .await
    .unwrap();
    let e = fx.request(doc3, false).await.unwrap_err();
    assert!(matches!(e, CompileError::DocumentDeleting { .. }), "{e}");
    let e = fx.request(Uuid::now_v7(), false).await.unwrap_err();
    assert!(matches!(e, CompileError::DocumentNotFound(_)), "{e}");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_document_marked_deleting_mid_compile_is_canceled_without_publishing() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-deleting", 1);
    let doc = fx
        .add("q.md", "text/markdown", b"Quolls hunt at night.")
        .await;
    let attempt = fx.request(doc, false).await.unwrap();
    fx.drive_to(&engine, attempt, "nodes_generated").await;
    sqlx::query(
        "UPDATE document_assets SET lifecycle_state = 'deleting', deletion_job_id = gen_random_uuid(), deleting_at = now() \
         WHERE id = $1",
    )
    .bind(doc)
    .execute(fx.pool())
    .await
    .unwrap();
    let s = fx.drive(&engine, attempt).await;
    assert_eq!(s.run_state, "canceled");
    assert_eq!(s.last_error_code.as_deref(), Some("document_deleting"));
    assert_eq!(s.active_slot, None);
    assert!(fx.head().await.is_none());
    fx.cleanup().await;
}
