//! Deletion requests are idempotent and every refusal is typed and writes nothing, through the
//! library and through the CLI's one-line answers.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_are_idempotent_and_every_refusal_is_typed_and_changes_nothing() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 1, 0).await;
    let pool = fx.pool();
    let mut docs = Vec::new();
    for i in 0..2 {
        let mut c = conn(pool).await;
        docs.push(
            platform::add_document(
                &mut c,
                &fx.store,
                s.id,
                Some(s.sources[0]),
                &format!("r-{i}.md"),
                "text/markdown",
                Bytes::from(note(i, "r")),
            )
            .await
            .unwrap(),
        );
    }
    let doc = docs[0];
    let req = target_request(&s, Target::Document { id: doc }, "k1");
    let mut tx = pool.begin().await.unwrap();
    let first = request_deletion(&mut tx, &req).await.unwrap();
    let again = request_deletion(&mut tx, &req).await.unwrap();
    tx.commit().await.unwrap();
    assert!(first.created && !again.created);
    assert_eq!(
        (first.job_id, first.outbox_id),
        (again.job_id, again.outbox_id)
    );

    let count = |pool: PgPool| async move {
        let n: (i64, i64, i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM deletion_jobs), (SELECT count(*) FROM deletion_tombstones), \
                    (SELECT count(*) FROM deletion_outbox), (SELECT count(*) FROM deletion_job_items)",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        n
    };
    let before = count(pool.clone()).await;
    assert_eq!(before, (1, 1, 1, 1));

    // Same key, different request.
    let r = request(
        pool,
        &target_request(&s, Target::Document { id: docs[1] }, "k1"),
    )
    .await;
    assert!(
        matches!(r, Err(RequestError::IdempotencyConflict { job_id, .. }) if job_id == first.job_id),
        "{r:?}"
    );
    // Another key, same target: the live job owns it.
    let r = request(
        pool,
        &target_request(&s, Target::Document { id: doc }, "k2"),
    )
    .await;
    assert!(
        matches!(r, Err(RequestError::TargetBusy { job_id: Some(j), .. }) if j == first.job_id),
        "{r:?}"
    );
    // The document's source, in either mode, and its space wait for the document's deletion.
    for mode in [SourceMode::Cascade, SourceMode::Keep] {
        let r = request(
            pool,
            &target_request(
                &s,
                Target::Source {
                    id: s.sources[0],
                    mode,
                },
                &format!("k3-{mode:?}"),
            ),
        )
        .await;
        assert!(matches!(r, Err(RequestError::TargetBusy { .. })), "{r:?}");
    }
    let r = request(pool, &space_request(&s, "k3-space")).await;
    assert!(
        matches!(r, Err(RequestError::TargetBusy { job_id: Some(j), .. }) if j == first.job_id),
        "{r:?}"
    );
    // The name challenge.
    let mut wrong = space_request(&s, "k4");
    wrong.target = Target::Space {
        confirm_name: "not the name".into(),
    };
    assert!(matches!(
        request(pool, &wrong).await,
        Err(RequestError::NameChallenge)
    ));
    // Unknown targets, and targets of another tenant.
    let r = request(
        pool,
        &target_request(&s, Target::Document { id: Uuid::now_v7() }, "k5"),
    )
    .await;
    assert!(matches!(r, Err(RequestError::NotFound(_))), "{r:?}");
    let r = request(
        pool,
        &DeletionRequest {
            tenant_id: "tenant-u".into(),
            ..target_request(&s, Target::Document { id: docs[1] }, "k6")
        },
    )
    .await;
    assert!(matches!(r, Err(RequestError::NotFound(_))), "{r:?}");
    // Snapshots: another subject's, revoked, expired, a viewer's, another channel's, unknown;
    // and an editor may delete a document but not the space.
    let bob = snapshot_for(&fx, &s, "bob", "interactive").await;
    let revoked = snapshot_for(&fx, &s, OWNER, "interactive").await;
    let mut c = conn(pool).await;
    platform::revoke_permission_snapshot(&mut c, &s.tenant, revoked)
        .await
        .unwrap();
    let expired = platform::create_permission_snapshot(
        &mut c,
        &s.tenant,
        s.id,
        OWNER,
        "interactive",
        Some(chrono::Utc::now() - chrono::Duration::minutes(1)),
    )
    .await
    .unwrap();
    platform::add_member(&mut c, &s.tenant, s.id, "vic", "viewer")
        .await
        .unwrap();
    drop(c);
    let viewer = snapshot_for(&fx, &s, "vic", "interactive").await;
    let mcp = snapshot_for(&fx, &s, OWNER, "mcp").await;
    for (snap, subject) in [
        (bob, OWNER),
        (revoked, OWNER),
        (expired, OWNER),
        (viewer, "vic"),
        (mcp, OWNER),
        (Uuid::now_v7(), OWNER),
    ] {
        let r = request(
            pool,
            &DeletionRequest {
                permission_snapshot_id: snap,
                requested_by_subject_id: subject.into(),
                ..target_request(&s, Target::Document { id: docs[1] }, &format!("p-{snap}"))
            },
        )
        .await;
        assert!(
            matches!(r, Err(RequestError::Permission(_))),
            "{snap}: {r:?}"
        );
    }
    let editor_space = DeletionRequest {
        permission_snapshot_id: bob,
        requested_by_subject_id: "bob".into(),
        ..space_request(&s, "k-editor")
    };
    // (The space is busy first; an editor is refused for a space of its own.)
    let other = seed(&fx, "tenant-t", "editor", "Editor", 0, 0).await;
    let bob_other = snapshot_for(&fx, &other, "bob", "interactive").await;
    let r = request(
        pool,
        &DeletionRequest {
            knowledge_space_id: other.id,
            permission_snapshot_id: bob_other,
            target: Target::Space {
                confirm_name: other.name.clone(),
            },
            ..editor_space
        },
    )
    .await;
    assert!(
        matches!(&r, Err(RequestError::Permission(m)) if m.contains("owner")),
        "{r:?}"
    );
    assert_eq!(
        count(pool.clone()).await,
        before,
        "a refusal wrote something"
    );
    let state: String =
        sqlx::query_scalar("SELECT lifecycle_state FROM document_assets WHERE id = $1")
            .bind(docs[1])
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(state, "active");
    // The caller's transaction stays usable after a refusal (the request used a savepoint).
    let mut tx = pool.begin().await.unwrap();
    assert!(request_deletion(
        &mut tx,
        &target_request(&s, Target::Document { id: doc }, "k7")
    )
    .await
    .is_err());
    let ok = request_deletion(
        &mut tx,
        &DeletionRequest {
            permission_snapshot_id: bob,
            requested_by_subject_id: "bob".into(),
            ..target_request(&s, Target::Document { id: docs[1] }, "k8")
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(ok.created, "an editor may delete a document");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cli_requests_and_refuses_with_one_line() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 1).await;
    let run = |args: Vec<String>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"));
        cmd.args(&args)
            .env("DATABASE_URL", &fx.env.url)
            .env("KFS_OBJECT_STORE", &fx.store_url);
        cmd.output().unwrap()
    };
    let doc = s.docs[0].to_string();
    let base = |key: &str| -> Vec<String> {
        [
            "delete",
            "document",
            &doc,
            "--space",
            &s.id.to_string(),
            "--tenant",
            &s.tenant,
            "--as",
            OWNER,
            "--snapshot",
            &s.owner_snapshot.to_string(),
            "--idempotency-key",
            key,
        ]
        .iter()
        .map(|a| a.to_string())
        .collect()
    };
    let out = run(base("cli-1"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["created"], true);
    let job = v["jobId"].as_str().unwrap().to_owned();
    let again: serde_json::Value = serde_json::from_slice(&run(base("cli-1")).stdout).unwrap();
    assert_eq!(
        (again["jobId"].as_str(), &again["created"]),
        (Some(job.as_str()), &serde_json::json!(false))
    );
    let busy = run(base("cli-2"));
    assert_eq!(busy.status.code(), Some(2));
    let err = String::from_utf8_lossy(&busy.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("already has a live deletion job"), "{err}");
    // Retrying a job that has not failed is refused.
    let retry = run([
        "delete",
        "retry",
        &job,
        "--as",
        OWNER,
        "--snapshot",
        &s.owner_snapshot.to_string(),
        "--channel",
        "interactive",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect());
    assert_eq!(
        retry.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&retry.stderr)
    );
    assert!(String::from_utf8_lossy(&retry.stderr).contains("only a failed job can be retried"));
    let show = run(vec!["delete".into(), "show".into(), job.clone()]);
    let v: serde_json::Value = serde_json::from_slice(&show.stdout).unwrap();
    assert_eq!(v["runState"], "dispatch_pending");
    assert_eq!(v["items"]["pending"], 1, "the raw object's item: {v}");
    fx.cleanup().await;
}
