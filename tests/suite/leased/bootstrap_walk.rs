//! The legacy space publication bootstrap: its walk rebuilds every frozen document, records the
//! verified head and sets the readiness latch; leftover legacy state, a failed compile, exhausted
//! attempts, a live mutation lease or an active compile fail it until an operator's retry.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bootstrap_walk_rebuilds_every_document_verifies_the_head_and_sets_the_latch() {
    let fx = Fx::bare().await;
    fx.install_profiles().await;
    let docs = fx.three_documents().await;
    let id = fx.enqueue_bootstrap().await;
    assert_eq!(id, fx.space, "the marker's id is the space's");
    assert_eq!(id, fx.enqueue_bootstrap().await, "enqueue is idempotent");
    assert!(
        !fx.ready().await,
        "a queued bootstrap keeps strict reads closed"
    );

    let kind = BootstrapKind::default();
    let engine = fx.engine("compile-in-test", 64);
    let row = fx.drive_bootstrap(&kind, &engine, id).await;
    assert_eq!(
        (row.run_state.as_str(), row.checkpoint.as_str()),
        ("succeeded", "published"),
        "{row:?}"
    );
    assert_eq!((row.total_documents, row.completed_documents), (3, 3));
    assert_eq!(
        (row.tenant_id.as_str(), row.knowledge_space_id),
        (TENANT, fx.space)
    );
    assert_eq!(row.idempotency_key, bootstrap::IDEMPOTENCY_KEY);
    assert!(row.lease_token.is_none() && row.completed && row.last_error_code.is_none());
    let meta = &row.snapshot_metadata;
    assert_eq!(meta["documentCount"], json!(3));
    assert_eq!(meta["directLegacyAdoption"], json!(false));
    assert_eq!(meta["strategy"], json!("full-generation-rebuild"));
    assert_eq!(meta["source"], json!("migration-marker"));
    assert_eq!(
        meta["reason"],
        json!("legacy graph ownership and immutable generation cannot be proven")
    );
    assert!(meta["capturedAt"].as_str().unwrap().ends_with('Z'));
    assert!(fx.ready().await, "success is the readiness latch");

    // The frozen items, in document id order, each rebuilt by one ordinary compile attempt
    // that published it (an internal starter: no requester binding).
    let items = fx.items(id).await;
    assert_eq!(items.len(), 3);
    for (i, it) in items.iter().enumerate() {
        assert_eq!(
            (it.ordinal, it.document_asset_id, it.document_version),
            (i as i32, docs[i], 1)
        );
        let sha: String = sqlx::query_scalar("SELECT sha256 FROM document_assets WHERE id = $1")
            .bind(it.document_asset_id)
            .fetch_one(fx.pool())
            .await
            .unwrap();
        assert_eq!(it.document_sha256, sha);
        assert_eq!(
            (it.status.as_str(), it.last_error.as_deref()),
            ("succeeded", None)
        );
        let a = fx.status(it.compilation_attempt_id.unwrap()).await;
        assert_eq!(
            (a.run_state.as_str(), a.checkpoint.as_str()),
            ("succeeded", "published")
        );
        assert_eq!(
            (a.document_asset_id, a.document_version, a.active_slot),
            (docs[i], 1, None)
        );
        assert_eq!(
            (
                a.requested_by_subject_id,
                a.permission_snapshot_id,
                a.access_channel
            ),
            (None, None, None)
        );
    }

    // The recorded head is the space's head, and it serves every frozen document at its frozen
    // version, with ready dense projections of the manifest's vector space.
    let head = fx.head().await.unwrap();
    assert_eq!(row.published_publication_id, Some(head.publication_id));
    assert_eq!(row.published_head_revision, Some(head.revision));
    assert_eq!(
        row.published_fingerprint.as_deref(),
        Some(head.fingerprint.as_str())
    );
    let served = fx.served().await;
    assert_eq!(served.keys().copied().collect::<Vec<_>>(), docs);
    assert!(served.values().all(|s| s.version == 1));
    let dense: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT m.document_asset_id) FROM projection_set_publication_members m \
         JOIN index_projections p ON p.id = m.component_key AND p.type = 'dense-vector' AND p.status = 'ready' \
         WHERE m.publication_id = $1 AND p.model = $2",
    )
    .bind(head.publication_id)
    .bind(embedding_profile()["vectorSpaceId"].as_str())
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(dense, 3);

    // Every state the walk wrote.
    let states = fx.states(id).await;
    assert_bootstrap_states(&states);
    let seen: Vec<&str> = states.iter().filter_map(|s| s.1.as_deref()).collect();
    for cp in Checkpoint::ALL {
        assert!(
            seen.contains(&cp.as_str()),
            "{cp:?} never written: {seen:?}"
        );
    }
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_space_without_documents_bootstraps_without_a_publication_unless_legacy_state_remains() {
    let fx = Fx::new().await;
    let id = fx.enqueue_bootstrap().await;
    let engine = fx.engine("compile-in-test", 64);
    let row = fx
        .drive_bootstrap(&BootstrapKind::default(), &engine, id)
        .await;
    assert_eq!(
        (row.run_state.as_str(), row.checkpoint.as_str()),
        ("succeeded", "published")
    );
    assert_eq!((row.total_documents, row.completed_documents), (0, 0));
    assert_eq!(row.published_publication_id, None);
    assert!(fx.ready().await);
    let seen: Vec<String> = fx
        .states(id)
        .await
        .into_iter()
        .filter_map(|s| s.1)
        .collect();
    assert!(
        !seen.iter().any(|c| c == "rebuilding"),
        "nothing to rebuild: {seen:?}"
    );
    assert_bootstrap_states(&fx.states(id).await);

    // Null-generation state without documents cannot be rebuilt: the platform refuses.
    let other = new_space(fx.pool(), "residue").await;
    sqlx::query(
        "INSERT INTO knowledge_paths (id, knowledge_space_id, publication_generation_id, virtual_path, resource_type, \
           target_id, version, view_name, view_type, metadata) \
         VALUES (gen_random_uuid(), $1, NULL, '/knowledge/docs/gone', 'document', 'gone', 1, 'docs', 'physical', '{}')",
    )
    .bind(other)
    .execute(fx.pool())
    .await
    .unwrap();
    let mut conn = fx.pool().acquire().await.unwrap();
    assert!(
        !bootstrap::ready(&mut conn, TENANT, other).await.unwrap(),
        "legacy state without a bootstrap is not ready"
    );
    let other_id = bootstrap::enqueue(&mut conn, TENANT, other).await.unwrap();
    drop(conn);
    let (_, outcome) = fx.run_bootstrap(&BootstrapKind::default()).await.unwrap();
    assert_eq!(outcome, Outcome::Ended("failed"));
    let row = fx.bootstrap(other_id).await;
    assert_eq!(
        (row.run_state.as_str(), row.checkpoint.as_str()),
        ("failed", "verifying")
    );
    assert_eq!(
        row.last_error_code.as_deref(),
        Some(walk::PROCESSING_FAILED)
    );
    assert_eq!(
        row.last_error_message.as_deref(),
        Some("Legacy null-generation derived state remains after rebuilding an empty document snapshot")
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_compile_fails_the_bootstrap_until_an_operator_retry_compiles_it_again() {
    let fx = Fx::bare().await;
    fx.install_profiles().await;
    let docs = fx.three_documents().await;
    // The bytes of one document are missing from the store: its compile fails for good.
    let key: String = sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
        .bind(docs[1])
        .fetch_one(fx.pool())
        .await
        .unwrap();
    let bytes = fx.store.get(&key).await.unwrap();
    fx.store.delete(&key).await.unwrap();
    let id = fx.enqueue_bootstrap().await;
    let kind = BootstrapKind::default();
    let engine = fx.engine("compile-in-test", 64);
    let row = fx.drive_bootstrap(&kind, &engine, id).await;
    assert_eq!(
        (row.run_state.as_str(), row.checkpoint.as_str()),
        ("failed", "rebuilding"),
        "{row:?}"
    );
    assert_eq!(
        row.last_error_code.as_deref(),
        Some(walk::COMPILATION_FAILED)
    );
    assert!(row.completed && row.lease_token.is_none());
    assert!(!fx.ready().await);
    let items = fx.items(id).await;
    let failed: Vec<&Item> = items.iter().filter(|i| i.status == "failed").collect();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].document_asset_id, docs[1]);
    let first_attempt = failed[0].compilation_attempt_id.unwrap();
    let attempt = fx.status(first_attempt).await;
    assert_eq!(attempt.run_state, "failed");
    assert_eq!(
        failed[0].last_error, attempt.last_error_message,
        "the compile's own error"
    );
    assert_eq!(row.last_error_message, attempt.last_error_message);

    // A failed bootstrap is final: not claimed again, however long one waits.
    fx.due_now(id).await;
    assert!(
        fx.run_bootstrap(&kind).await.is_none(),
        "a failed bootstrap was claimed"
    );

    // Restore the bytes; the operator's retry queues the same row, the failed item pending
    // again with no attempt, and the document is compiled again by a new attempt.
    fx.store.put(&key, bytes).await.unwrap();
    assert!(fx.retry_bootstrap().await);
    assert!(
        !fx.retry_bootstrap().await,
        "only a failed bootstrap is retried"
    );
    let row = fx.bootstrap(id).await;
    assert_eq!(
        (row.run_state.as_str(), row.last_error_code, row.completed),
        ("queued", None, false)
    );
    let again = fx
        .items(id)
        .await
        .into_iter()
        .find(|i| i.document_asset_id == docs[1])
        .unwrap();
    assert_eq!(
        (
            again.status.as_str(),
            again.compilation_attempt_id,
            again.last_error
        ),
        ("pending", None, None)
    );
    let row = fx.drive_bootstrap(&kind, &engine, id).await;
    assert_eq!(row.run_state, "succeeded", "{row:?}");
    assert_eq!(row.last_error_code, None);
    let again = fx
        .items(id)
        .await
        .into_iter()
        .find(|i| i.document_asset_id == docs[1])
        .unwrap();
    assert_eq!(again.status, "succeeded");
    assert_ne!(again.compilation_attempt_id, Some(first_attempt));
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM legacy_space_publication_bootstraps")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(n, 1, "retried in place, never a second bootstrap");
    assert_bootstrap_states(&fx.states(id).await);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bootstrap_fails_for_good_after_its_attempts() {
    let fx = Fx::new().await;
    let id = fx.enqueue_bootstrap().await;
    let kind = BootstrapKind {
        policy: kfs_worker::jobs::Policy {
            max_attempts: 2,
            ..bootstrap::POLICY
        },
        ..BootstrapKind::default()
    };
    let mut conn = fx.pool().acquire().await.unwrap();
    // A transient failure queues it again after the backoff, the run counted.
    let job = kind.claim(&mut conn, "w-live").await.unwrap().unwrap();
    let transient = End::Wait {
        delay: Duration::from_secs(60),
        code: "db_unavailable".into(),
        message: "connection reset".into(),
        refund: false,
    };
    assert!(kind.end(&mut conn, &job, &transient).await.unwrap());
    let row = fx.bootstrap(id).await;
    assert_eq!(
        (row.run_state.as_str(), row.last_error_code.as_deref()),
        ("queued", Some("db_unavailable"))
    );
    assert_eq!(row.snapshot_metadata["failures"], json!(1));
    assert!(row.snapshot_metadata["notBefore"].as_i64().is_some());
    assert!(
        kind.claim(&mut conn, "w-live").await.unwrap().is_none(),
        "claimed before its retry time"
    );
    fx.due_now(id).await;
    // Workers that die holding it (no liveness lock) use up the rest.
    let held = kind.claim(&mut conn, "ghost-1").await.unwrap().unwrap();
    assert_eq!(held.attempt, 2);
    let taken = kind.claim(&mut conn, "ghost-2").await.unwrap().unwrap();
    assert!(taken.taken_over);
    assert!(
        kind.claim(&mut conn, "w-live").await.unwrap().is_none(),
        "out of attempts"
    );
    let row = fx.bootstrap(id).await;
    assert_eq!(
        (row.run_state.as_str(), row.last_error_code.as_deref()),
        ("failed", Some(bootstrap::EXHAUSTED))
    );
    assert_eq!(row.snapshot_metadata["failures"], json!(2));
    fx.due_now(id).await;
    assert!(
        fx.run_bootstrap(&kind).await.is_none(),
        "a bootstrap out of attempts is not run again"
    );
    // The operator's retry gives it a fresh budget.
    assert!(fx.retry_bootstrap().await);
    assert_eq!(
        fx.bootstrap(id).await.snapshot_metadata.get("failures"),
        None
    );
    let (_, outcome) = fx
        .run_bootstrap(&kind)
        .await
        .expect("claimed after the retry");
    assert_eq!(outcome, Outcome::Ended("succeeded"));
    assert_bootstrap_states(&fx.states(id).await);
    fx.cleanup().await;
}

async fn add_mutation_lease(pool: &PgPool, space: Uuid, expires: &str) -> Uuid {
    sqlx::query_scalar(&format!(
        "INSERT INTO knowledge_space_mutation_leases (id, tenant_id, knowledge_space_id, operation, acquired_at, \
           lease_token, heartbeat_at, expires_at) \
         VALUES (gen_random_uuid(), $1, $2, 'upload', now(), gen_random_uuid(), now(), {expires}) RETURNING id"
    ))
    .bind(TENANT)
    .bind(space)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_live_mutation_lease_or_an_active_compile_fails_the_snapshot_and_an_expired_lease_does_not(
) {
    let fx = Fx::new().await;
    let docs = fx.three_documents().await;
    let lease = add_mutation_lease(fx.pool(), fx.space, "now() + interval '1 hour'").await;
    let id = fx.enqueue_bootstrap().await;
    let kind = BootstrapKind {
        waits: walk::Waits {
            poll: Duration::from_secs(60),
        },
        ..BootstrapKind::default()
    };
    let (_, outcome) = fx.run_bootstrap(&kind).await.expect("claimed");
    assert_eq!(outcome, Outcome::Ended("failed"));
    let row = fx.bootstrap(id).await;
    assert_eq!(
        (row.run_state.as_str(), row.checkpoint.as_str()),
        ("failed", "pending_snapshot")
    );
    assert_eq!(
        row.last_error_code.as_deref(),
        Some(walk::PROCESSING_FAILED)
    );
    assert_eq!(
        row.last_error_message.as_deref(),
        Some("Knowledge space already has an active document mutation lease")
    );
    assert_eq!(row.total_documents, 0);
    assert!(
        fx.items(id).await.is_empty(),
        "nothing frozen under a live lease"
    );
    assert!(fx.run_bootstrap(&kind).await.is_none(), "failed for good");

    // The lease expires (it stays, as the platform's capture leaves it): after the operator's
    // retry the capture freezes the set and requests the compiles.
    sqlx::query("UPDATE knowledge_space_mutation_leases SET expires_at = now() - interval '1 second' WHERE id = $1")
        .bind(lease)
        .execute(fx.pool())
        .await
        .unwrap();
    assert!(fx.retry_bootstrap().await);
    let (_, outcome) = fx.run_bootstrap(&kind).await.expect("claimed");
    assert_eq!(
        outcome,
        Outcome::Ended("wait"),
        "waits for its compiles now"
    );
    let row = fx.bootstrap(id).await;
    assert_eq!(
        (row.checkpoint.as_str(), row.total_documents),
        ("rebuilding", 3)
    );
    let items = fx.items(id).await;
    assert_eq!(
        items
            .iter()
            .map(|i| i.document_asset_id)
            .collect::<Vec<_>>(),
        docs
    );
    assert!(items
        .iter()
        .all(|i| i.status == "running" && i.compilation_attempt_id.is_some()));

    // Another space: a lease without an expiry is not live for the platform's capture, but an
    // active compile attempt is refused.
    let other = new_space(fx.pool(), "other").await;
    add_mutation_lease(fx.pool(), other, "NULL").await;
    let mut conn = fx.pool().acquire().await.unwrap();
    let doc = platform::add_document(
        &mut conn,
        &fx.store,
        other,
        None,
        "notes.txt",
        "text/plain",
        NOTES_TXT.to_vec().into(),
    )
    .await
    .unwrap();
    let mut tx = conn.begin().await.unwrap();
    compile::request(&mut tx, doc, Default::default())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let other_id = bootstrap::enqueue(&mut conn, TENANT, other).await.unwrap();
    drop(conn);
    let (lease, outcome) = fx.run_bootstrap(&kind).await.expect("claimed");
    assert_eq!(
        (lease.job_id, outcome),
        (other_id, Outcome::Ended("failed"))
    );
    let row = fx.bootstrap(other_id).await;
    assert_eq!(
        row.last_error_message.as_deref(),
        Some("Legacy publication bootstrap requires all document compilation attempts to be idle")
    );
    fx.cleanup().await;
}
