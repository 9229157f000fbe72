//! Requests the platform would refuse are refused clearly and write nothing.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_are_refused_clearly_and_write_nothing() {
    let s = seed("refuse").await;
    let pool = s.pool().clone();
    let mut conn = pool.acquire().await.unwrap();
    let c = &mut *conn;
    let snap = |subject: &str, channel: &str, space: Uuid, tenant: &str| {
        let (subject, channel, tenant) =
            (subject.to_owned(), channel.to_owned(), tenant.to_owned());
        let pool = pool.clone();
        async move {
            platform::create_permission_snapshot(
                &mut pool.acquire().await.unwrap(),
                &tenant,
                space,
                &subject,
                &channel,
                None,
            )
            .await
            .unwrap()
        }
    };
    let revoked = snap(SUBJECT, "interactive", s.space, TENANT).await;
    platform::revoke_permission_snapshot(c, TENANT, revoked)
        .await
        .unwrap();
    let expired = snap(SUBJECT, "interactive", s.space, TENANT).await;
    sqlx::query("UPDATE knowledge_space_permission_snapshots SET expires_at = now() - interval '1 minute' WHERE id = $1")
        .bind(expired)
        .execute(&mut *c)
        .await
        .unwrap();
    let bobs = snap("bob", "interactive", s.space, TENANT).await;
    let mcp = snap(SUBJECT, "mcp", s.space, TENANT).await;
    let second_space = platform::create_space(c, TENANT, "second", "Second", "owner-2")
        .await
        .unwrap();
    let elsewhere = snap(SUBJECT, "interactive", second_space, TENANT).await;
    let other_tenant = snap(SUBJECT, "interactive", s.other_space, OTHER_TENANT).await;

    let cases: Vec<(ResearchRequest, &str)> = vec![
        (
            ResearchRequest::new(s.space, QUESTION, SUBJECT, revoked),
            "revoked",
        ),
        (
            ResearchRequest::new(s.space, QUESTION, SUBJECT, expired),
            "expired",
        ),
        (
            ResearchRequest::new(s.space, QUESTION, SUBJECT, bobs),
            "another subject",
        ),
        (
            ResearchRequest::new(s.space, QUESTION, SUBJECT, mcp),
            "mcp channel",
        ),
        (
            ResearchRequest::new(s.space, QUESTION, SUBJECT, elsewhere),
            "another knowledge space",
        ),
        (
            ResearchRequest::new(s.space, QUESTION, SUBJECT, other_tenant),
            "does not exist",
        ),
        (
            ResearchRequest::new(s.space, QUESTION, SUBJECT, Uuid::now_v7()),
            "does not exist",
        ),
        (
            ResearchRequest::new(Uuid::now_v7(), QUESTION, SUBJECT, s.snapshot),
            "no knowledge space",
        ),
        (
            ResearchRequest {
                top_k: Some(0),
                ..req(&s, QUESTION)
            },
            "top-k",
        ),
        (
            ResearchRequest::new(s.space, "   ", SUBJECT, s.snapshot),
            "empty",
        ),
        // Fast and deep retrieval need the space's embedding profile.
        (
            ResearchRequest {
                mode: "fast".into(),
                ..req(&s, QUESTION)
            },
            "needs an embedding profile",
        ),
    ];
    for (r, needle) in cases {
        let err = research::request(c, &r).await.unwrap_err();
        assert!(err.is_refusal());
        assert!(
            err.to_string().contains(needle),
            "{err} should say {needle:?}"
        );
    }
    // A space being deleted.
    sqlx::query(
        "UPDATE knowledge_spaces SET lifecycle_state = 'deleting', deletion_job_id = gen_random_uuid(), deleting_at = now() \
         WHERE id = $1",
    )
    .bind(second_space)
    .execute(&mut *c)
    .await
    .unwrap();
    let err = research::request(
        c,
        &ResearchRequest::new(second_space, QUESTION, SUBJECT, elsewhere),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, RequestError::SpaceUnavailable { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("being deleted"), "{err}");
    for table in [
        "research_task_jobs",
        "research_task_outbox",
        "research_task_progress_events",
    ] {
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(&mut *c)
            .await
            .unwrap();
        assert_eq!(n, 0, "{table} written by a refused request");
    }

    // Idempotency: the same key and request return the first job; another request conflicts.
    let keyed = ResearchRequest {
        idempotency_key: Some("k-1".into()),
        ..req(&s, QUESTION)
    };
    let first = research::request(c, &keyed).await.unwrap();
    let second = research::request(c, &keyed).await.unwrap();
    assert!(first.created && !second.created);
    assert_eq!(
        (first.job_id, first.outbox_id),
        (second.job_id, second.outbox_id)
    );
    let err = research::request(
        c,
        &ResearchRequest {
            top_k: Some(3),
            ..keyed.clone()
        },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, RequestError::Conflict(j) if j == first.job_id),
        "{err}"
    );

    // While a deletion of one of its documents is in progress, the space admits no new task.
    let deletion = kfs_worker::jobs::deletion::request::DeletionRequest {
        tenant_id: TENANT.into(),
        knowledge_space_id: s.space,
        target: kfs_worker::jobs::deletion::request::Target::Document { id: s.docs[2] },
        expected_revision: None,
        requested_by_subject_id: SUBJECT.into(),
        permission_snapshot_id: s.snapshot,
        access_channel: "interactive".into(),
        idempotency_key: "delete-cooking".into(),
    };
    kfs_worker::jobs::deletion::request::request_deletion(c, &deletion)
        .await
        .unwrap();
    let err = research::request(c, &req(&s, "bread")).await.unwrap_err();
    assert!(err.to_string().contains("a deletion (job"), "{err}");
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM research_task_jobs")
        .fetch_one(&mut *c)
        .await
        .unwrap();
    assert_eq!(n, 1);
    drop(conn);
    s.fx.cleanup().await;
}
