//! Who may compile: the requester's permission snapshot or a capability grant is recorded alone and
//! checked again at publish; a refused, revoked or fenced authority fails closed and writes nothing
//! else.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_requester_binding_is_recorded_whole_and_checked_at_publish() {
    let fx = Fx::new().await;
    let engine = fx.engine("w-binding", 64);
    let snap = fx.snapshot("editor-1").await;
    let doc = fx
        .add(
            "b.md",
            "text/markdown",
            b"# Binding\n\nWalruses haul out on ice.",
        )
        .await;
    let mut tx = fx.pool().begin().await.unwrap();
    let attempt = compile::request(
        &mut tx,
        doc,
        RequestOptions {
            defer: false,
            requester: Some(Requester {
                subject: "editor-1".into(),
                snapshot: snap,
            }),
            grant: None,
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let s = fx.status(attempt).await;
    assert_eq!(
        (
            s.requested_by_subject_id.as_deref(),
            s.permission_snapshot_id,
            s.permission_snapshot_revision,
            s.access_channel.as_deref()
        ),
        (Some("editor-1"), Some(snap), Some(1), Some("interactive"))
    );
    assert_succeeded(&fx.drive(&engine, attempt).await);

    // Refused before anything is written: a snapshot of another subject, or a revoked one.
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM document_compilation_attempts")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    let other = fx
        .add("o.md", "text/markdown", b"# Other\n\nNarwhals.")
        .await;
    let mut tx = fx.pool().begin().await.unwrap();
    let e = compile::request(
        &mut tx,
        other,
        RequestOptions {
            defer: false,
            requester: Some(Requester {
                subject: "someone-else".into(),
                snapshot: snap,
            }),
            grant: None,
        },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(e, CompileError::Snapshot { .. }) && e.is_refusal(),
        "{e}"
    );
    tx.commit().await.unwrap();
    // A snapshot revoked after the request: the publish refuses, nothing is served.
    let late = fx
        .add("l.md", "text/markdown", b"# Late\n\nBelugas sing.")
        .await;
    let mut tx = fx.pool().begin().await.unwrap();
    let attempt = compile::request(
        &mut tx,
        late,
        RequestOptions {
            defer: false,
            requester: Some(Requester {
                subject: "editor-1".into(),
                snapshot: snap,
            }),
            grant: None,
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM document_compilation_attempts")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(after, before + 1, "the refused request wrote nothing");
    let one_step = fx.engine("w-binding-1", 1);
    fx.drive_to(&one_step, attempt, "smoke_eval_passed").await;
    {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::revoke_permission_snapshot(&mut conn, TENANT, snap)
            .await
            .unwrap();
    }
    let s = fx.drive(&engine, attempt).await;
    assert_failed(&s, "permission_snapshot_invalid");
    assert!(fx.search("belugas").await.is_empty());
    let cand: String =
        sqlx::query_scalar("SELECT status::text FROM projection_set_publications WHERE id = $1")
            .bind(s.candidate_publication_id.unwrap())
            .fetch_one(fx.pool())
            .await
            .unwrap();
    assert_eq!(cand, "inactive", "the candidate is given up");

    // The command line records the binding too, and refuses half of it.
    let fresh = fx.snapshot("editor-2").await;
    let doc3 = fx
        .add("c.md", "text/markdown", b"# CLI\n\nManatees graze.")
        .await;
    let out = kfs(
        &fx,
        &[
            "compile",
            &doc3.to_string(),
            "--as",
            "editor-2",
            "--snapshot",
            &fresh.to_string(),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let attempt: Uuid = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let s = fx.status(attempt).await;
    assert_eq!(s.permission_snapshot_id, Some(fresh));
    assert_eq!(s.requested_by_subject_id.as_deref(), Some("editor-2"));
    let out = kfs(&fx, &["compile", &doc3.to_string(), "--as", "editor-2"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_grant_authorized_compile_records_the_grant_alone_and_publishes() {
    let fx = Fx::new().await;
    let grant = fx.grant("app-1").await;
    let doc = fx
        .add(
            "g.md",
            "text/markdown",
            b"# Grant\n\nPuffins nest in burrows.",
        )
        .await;
    let attempt = fx.request_with(doc, by_grant(grant)).await.unwrap();
    let s = fx.status(attempt).await;
    assert_eq!(s.capability_grant_id, Some(grant));
    assert_eq!(
        (
            s.requested_by_subject_id.as_deref(),
            s.permission_snapshot_id,
            s.permission_snapshot_revision,
            s.access_channel.as_deref()
        ),
        (None, None, None, None),
        "a grant is recorded alone"
    );
    let done = fx.drive(&fx.engine("w-grant", 64), attempt).await;
    assert_succeeded(&done);
    assert_eq!(fx.search("puffins burrows").await.len(), 1);

    // The command line takes --grant in place of --as/--snapshot, and refuses both at once.
    let doc2 = fx
        .add("g2.md", "text/markdown", b"# CLI grant\n\nGannets dive.")
        .await;
    let out = kfs(
        &fx,
        &["compile", &doc2.to_string(), "--grant", &grant.to_string()],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let by_cli: Uuid = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert_eq!(fx.status(by_cli).await.capability_grant_id, Some(grant));
    let snap = fx.snapshot("editor-1").await;
    let doc3 = fx.add("g3.md", "text/markdown", b"# Both\n\nTerns.").await;
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM document_compilation_attempts")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    let out = kfs(
        &fx,
        &[
            "compile",
            &doc3.to_string(),
            "--grant",
            &grant.to_string(),
            "--as",
            "editor-1",
            "--snapshot",
            &snap.to_string(),
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    let e = fx
        .request_with(
            doc3,
            RequestOptions {
                requester: Some(Requester {
                    subject: "editor-1".into(),
                    snapshot: snap,
                }),
                grant: Some(grant),
                ..RequestOptions::default()
            },
        )
        .await
        .unwrap_err();
    assert!(
        matches!(e, CompileError::TwoAuthorities) && e.is_refusal(),
        "{e}"
    );
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM document_compilation_attempts")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(after, before, "two authorities wrote nothing");
    fx.cleanup().await;
}

/// Drives a grant-authorized compile of a new document to `smoke_eval_passed`, then lets
/// `fence` end the grant's authority, and runs the publish: the attempt fails closed as the
/// platform fails it, and nothing but the attempt's failure is written.
async fn grant_fenced_at_publish(fx: &Fx, name: &str, fence: impl AsyncFnOnce(Uuid)) {
    let grant = fx.grant("app-2").await;
    let doc = fx
        .add(name, "text/markdown", b"# Fenced\n\nKittiwakes on cliffs.")
        .await;
    let attempt = fx.request_with(doc, by_grant(grant)).await.unwrap();
    fx.drive_to(&fx.engine("w-fence-1", 1), attempt, "smoke_eval_passed")
        .await;
    let head_before = fx.head().await;
    let bindings_before = fx.bindings().await;
    let candidate = fx.status(attempt).await.candidate_publication_id.unwrap();
    fence(grant).await;
    let s = fx.drive(&fx.engine("w-fence", 64), attempt).await;
    assert_failed(&s, "DOCUMENT_COMPILATION_FAILED");
    assert_eq!(
        s.last_error_message.as_deref(),
        Some("Capability publication is fenced")
    );
    assert_eq!(s.checkpoint, "smoke_eval_passed", "the checkpoint is kept");
    assert_eq!(fx.head().await, head_before, "the head is untouched");
    assert_eq!(fx.bindings().await, bindings_before, "no binding");
    assert_eq!(fx.publication_status(candidate).await, "candidate");
    let (logical, _, state, bound, _) = fx.revision_of(doc).await;
    assert_eq!((state.as_str(), bound), ("candidate", Some(attempt)));
    assert_eq!(fx.logical(logical).await, ("pending".into(), None, 0));
    assert!(fx.search("kittiwakes").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_revoked_grant_or_a_fenced_space_fails_the_attempt_closed_and_writes_nothing_else() {
    let fx = Fx::new().await;
    // A head to stay untouched.
    let base = fx.add("base.md", "text/markdown", b"# Base\n\nAuks.").await;
    fx.compile(base).await;
    grant_fenced_at_publish(&fx, "revoked.md", async |grant| {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::revoke_capability_grant(&mut conn, TENANT, fx.space, grant)
            .await
            .unwrap();
    })
    .await;
    // A request under a revoked grant is refused with nothing written.
    let revoked = fx.grant("app-3").await;
    {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::revoke_capability_grant(&mut conn, TENANT, fx.space, revoked)
            .await
            .unwrap();
    }
    let doc = fx
        .add("late.md", "text/markdown", b"# Late\n\nMurres.")
        .await;
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM document_compilation_attempts")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    let e = fx.request_with(doc, by_grant(revoked)).await.unwrap_err();
    assert!(
        matches!(e, CompileError::Grant { grant, .. } if grant == revoked) && e.is_refusal(),
        "{e}"
    );
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM document_compilation_attempts")
        .fetch_one(fx.pool())
        .await
        .unwrap();
    assert_eq!(after, before);
    assert_eq!(
        fx.revision_of(doc).await.3,
        None,
        "the revision stays unbound"
    );
    // A fenced space: every grant of it stops authorizing.
    grant_fenced_at_publish(&fx, "fenced.md", async |_| {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::fence_capability_space(&mut conn, TENANT, fx.space)
            .await
            .unwrap();
    })
    .await;
    fx.cleanup().await;
}
