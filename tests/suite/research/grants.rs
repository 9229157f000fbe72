//! Tasks authorized by a capability grant: they cite only content in the grant's scope, fail
//! closed when the grant is revoked or the space fenced, and such requests are refused.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_grant_authorized_task_runs_and_cites_only_content_within_the_grants_scope() {
    let s = seed("grant-scope").await;
    let pool = s.pool().clone();
    let zebra = upload(
        &s,
        s.space,
        "zebra.md",
        "# Zebra\n\nThe zebra stripes are carol's notes.\n",
        vec!["source:carol".into()],
    )
    .await;
    let giraffe = upload(
        &s,
        s.space,
        "giraffe.md",
        "# Giraffe\n\nThe giraffe neck is in the app's scope.\n",
        vec!["source:app".into()],
    )
    .await;
    // Every scope of content must be in the grant's: one of two is not enough.
    let okapi = upload(
        &s,
        s.space,
        "okapi.md",
        "# Okapi\n\nThe okapi neck belongs to the app and to carol.\n",
        vec!["source:app".into(), "source:carol".into()],
    )
    .await;
    for d in [zebra, giraffe, okapi] {
        s.compile(d).await;
    }
    let g = grant(&s, s.space, "app-user-7", &["source:app"]).await;
    let e = engine(&pool, "w-grant", extractive());

    let id = request(
        &pool,
        &ResearchRequest::under_grant(
            s.space,
            "Where are the zebra stripes, and where is the giraffe neck?",
            g,
        ),
    )
    .await;
    // Written as the platform's API writes a grant's task: the grant, and no snapshot binding.
    assert_eq!(binding(&pool, id).await, (Some(g), None, None, None, None));
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "completed", "{j:?}");
    let b = bundle(&pool, id).await;
    assert_eq!(cited_documents(&b), vec![giraffe], "{b}");
    assert!(!b["items"].to_string().contains("carol"), "{b}");
    let stored = answer(&pool, id).await.unwrap();
    assert!(stored.contains("giraffe neck"), "{stored}");
    assert!(!stored.contains("zebra"), "{stored}");
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    assert_eq!(advances(&evs), ADVANCES.to_vec());
    assert_eq!(reassemble(&evs, 1), stored);

    // Content scoped to the app and carol is not the app's to read.
    let id = request(
        &pool,
        &ResearchRequest::under_grant(s.space, "okapi neck", g),
    )
    .await;
    assert_eq!(run_until_settled(&s, &e, id).await.stage, "completed");
    assert_eq!(bundle(&pool, id).await["items"], json!([]));
    assert_eq!(answer(&pool, id).await.as_deref(), Some(NO_EVIDENCE_ANSWER));

    // Unscoped content is visible within the space, to a grant of any scope.
    let id = request(
        &pool,
        &ResearchRequest::under_grant(s.space, "fencing lease token", g),
    )
    .await;
    assert_eq!(run_until_settled(&s, &e, id).await.stage, "completed");
    assert_eq!(cited_documents(&bundle(&pool, id).await), vec![s.docs[1]]);
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_revoked_grant_or_a_fenced_space_fails_the_task_closed_with_capability_revoked() {
    let s = seed("grant-revoke").await;
    let pool = s.pool().clone();
    let handler = extractive();
    // (what happens to the grant, how many steps the task took before)
    for (change, steps) in [("revoke", 4), ("revoke", 0), ("fence", 2)] {
        let g = grant(&s, s.space, "app-user-7", &[]).await;
        let id = request(&pool, &ResearchRequest::under_grant(s.space, QUESTION, g)).await;
        let mut ctx = claim_by_hand(&pool, id, "w-grant-revoke").await;
        for _ in 0..steps {
            step_by_hand(&pool, handler.as_ref(), &mut ctx)
                .await
                .unwrap()
                .unwrap();
        }
        let at = ctx.checkpoint.clone();
        let mut conn = pool.acquire().await.unwrap();
        match change {
            "revoke" => platform::revoke_capability_grant(&mut conn, TENANT, s.space, g)
                .await
                .unwrap(),
            _ => platform::fence_capability_space(&mut conn, TENANT, s.space)
                .await
                .unwrap(),
        }
        drop(conn);
        let before = events(&pool, id).await;
        let err = step_by_hand(&pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, JobError::Fatal { code, .. } if code == REVOKED),
            "{change} at {at}: {err:?}"
        );

        // Through the engine: the task fails with the platform's code and its failed event, and
        // nothing else is written: no further stage, no answer, no partial result.
        expire(&pool, id).await;
        let e = engine(&pool, "w-grant-revoke-engine", extractive());
        let j = run_until_settled(&s, &e, id).await;
        assert_eq!(j.stage, "failed", "{change} at {at}: {j:?}");
        let error = j.error.unwrap();
        assert!(error.starts_with(&format!("{REVOKED}: ")), "{error}");
        assert!(partials(&pool, id).await.is_empty(), "{change} at {at}");
        let evs = events(&pool, id).await;
        assert_contiguous(id, &evs);
        assert_eq!(
            shape(&evs[before.len()..]),
            [
                ("stage_changed".into(), at.clone(), claim(2)),
                ("failed".into(), "failed".into(), json!({"error": REVOKED})),
            ],
            "{change} at {at}"
        );
        assert!(deltas_of(&evs, 2).is_empty());
        // What the failing step would have written is not there.
        let would_write = match at.as_str() {
            "planning" => "plan",
            "retrieving" => "retrieval",
            "analyzing" => "evidence",
            "generating" => "result",
            _ => "nothing",
        };
        assert!(j.metadata.get(would_write).is_none(), "{change} at {at}");
        let stages_reached = advances(&evs).len();
        assert_eq!(stages_reached, steps, "{change} at {at}: no stage after");
        assert_eq!(outbox_states(&pool, id).await, vec!["dead"]);
    }
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_under_a_revoked_foreign_or_fenced_grant_is_refused_and_writes_nothing() {
    let fx = SpaceFx::new(TENANT, "grant-refuse", "Docs").await;
    let pool = fx.pool().clone();
    let mut conn = pool.acquire().await.unwrap();
    let c = &mut *conn;
    let revoked = grant(&fx, fx.space, "app-user-7", &[]).await;
    platform::revoke_capability_grant(c, TENANT, fx.space, revoked)
        .await
        .unwrap();
    let second = platform::create_space(c, TENANT, "second", "Second", "owner-2")
        .await
        .unwrap();
    let foreign = grant(&fx, second, "app-user-7", &[]).await;
    let fenced_space = platform::create_space(c, TENANT, "fenced", "Fenced", "owner-3")
        .await
        .unwrap();
    let fenced = grant(&fx, fenced_space, "app-user-7", &[]).await;
    platform::fence_capability_space(c, TENANT, fenced_space)
        .await
        .unwrap();
    let cases = [
        (fx.space, revoked, "is revoked"),
        (
            fx.space,
            foreign,
            "does not exist in this tenant and knowledge space",
        ),
        (fx.space, Uuid::now_v7(), "does not exist"),
        (fenced_space, fenced, "capability fence is tombstoned"),
    ];
    for (space, g, says) in cases {
        let err = research::request(c, &ResearchRequest::under_grant(space, QUESTION, g))
            .await
            .unwrap_err();
        assert!(
            matches!(err, RequestError::PermissionDenied(_)),
            "{says}: {err}"
        );
        assert!(err.to_string().contains(says), "{err} should say {says:?}");
    }
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

    // An active grant is admitted, idempotently: the same key and request give the same job,
    // the same key under another grant is another request.
    let g = grant(&fx, fx.space, "app-user-7", &["source:app"]).await;
    let keyed = ResearchRequest {
        idempotency_key: Some("k-grant".into()),
        ..ResearchRequest::under_grant(fx.space, QUESTION, g)
    };
    let first = research::request(c, &keyed).await.unwrap();
    let again = research::request(c, &keyed).await.unwrap();
    assert!(first.created && !again.created);
    assert_eq!(first.job_id, again.job_id);
    assert_eq!(
        binding(&pool, first.job_id).await,
        (Some(g), None, None, None, None)
    );
    let other = grant(&fx, fx.space, "app-user-7", &["source:app"]).await;
    let err = research::request(
        c,
        &ResearchRequest {
            asked_by: research::AskedBy::Grant(other),
            ..keyed.clone()
        },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, RequestError::Conflict(j) if j == first.job_id),
        "{err}"
    );
    let evs = events(&pool, first.job_id).await;
    assert_eq!(
        shape(&evs),
        vec![("started".into(), "queued".into(), json!({}))]
    );
    assert_eq!(
        outbox(&pool, first.job_id).await,
        vec![(
            1,
            "pending".into(),
            format!("research.task:{TENANT}:{}:{}:1", fx.space, first.job_id)
        )]
    );
    drop(conn);
    fx.cleanup().await;
}
