//! A task fails closed when its snapshot is revoked, expired or outdated mid-run, ends failed
//! when its attempts are used up, and never reads a document or space deleted mid-task.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_snapshot_revoked_expired_or_outdated_mid_run_fails_the_task_closed() {
    let s = seed("revoke").await;
    let pool = s.pool().clone();
    let handler = extractive();
    for change in ["revoke", "expire", "revision", "member"] {
        let snapshot = s.snapshot(SUBJECT).await;
        let r = ResearchRequest::new(s.space, QUESTION, SUBJECT, snapshot);
        let id = request(&pool, &r).await;
        let mut ctx = claim_by_hand(&pool, id, "w-revoke").await;
        for _ in 0..2 {
            step_by_hand(&pool, handler.as_ref(), &mut ctx)
                .await
                .unwrap()
                .unwrap();
        }
        assert_eq!(ctx.checkpoint, "retrieving");
        let mut conn = pool.acquire().await.unwrap();
        let sql = match change {
            "revoke" => {
                platform::revoke_permission_snapshot(&mut conn, TENANT, snapshot)
                    .await
                    .unwrap();
                None
            }
            "expire" => Some(
                "UPDATE knowledge_space_permission_snapshots SET expires_at = now() - interval '1 second' WHERE id = $1",
            ),
            "revision" => Some(
                "UPDATE knowledge_space_permission_snapshots SET revision = revision + 1 WHERE id = $1",
            ),
            // The member's role changed: the snapshot's member revision is no longer current.
            _ => Some(
                "UPDATE knowledge_space_members m SET revision = m.revision + 1 \
                 FROM knowledge_space_permission_snapshots s \
                 WHERE s.id = $1 AND m.tenant_id = s.tenant_id AND m.knowledge_space_id = s.knowledge_space_id \
                   AND m.subject_id = s.subject_id",
            ),
        };
        if let Some(sql) = sql {
            sqlx::query(sql)
                .bind(snapshot)
                .execute(&mut *conn)
                .await
                .unwrap();
        }
        drop(conn);
        let err = step_by_hand(&pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, JobError::Fatal { code, .. } if code == INVALID),
            "{change}: {err:?}"
        );

        // Through the engine: the task fails, with nothing retrieved.
        expire(&pool, id).await;
        let e = engine(&pool, "w-revoke-engine", extractive());
        let j = run_until_settled(&s, &e, id).await;
        assert_eq!(j.stage, "failed", "{j:?}");
        assert!(
            j.error
                .as_deref()
                .unwrap()
                .starts_with(&format!("{INVALID}: ")),
            "{j:?}"
        );
        assert!(
            j.metadata.get("retrieval").is_none(),
            "{change}: nothing retrieved"
        );
        assert!(partials(&pool, id).await.is_empty());
        let evs = events(&pool, id).await;
        assert_contiguous(id, &evs);
        // The failure's own attempt is claimed, then the failure is the last event.
        let sh = shape(&evs);
        assert_eq!(
            sh[sh.len() - 2..],
            [
                ("stage_changed".into(), "retrieving".into(), claim(2)),
                ("failed".into(), "failed".into(), json!({"error": INVALID})),
            ]
        );
        assert_eq!(outbox_states(&pool, id).await, vec!["dead"]);
    }
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_task_whose_attempts_are_used_up_ends_failed_with_its_failed_event() {
    let s = seed("exhausted").await;
    let pool = s.pool().clone();
    let id = request(&pool, &req(&s, QUESTION)).await;
    // A worker claims the last allowed attempt, takes one step, and dies holding the lease.
    let handler = extractive();
    let mut ctx = claim_by_hand(&pool, id, "w-gone").await;
    step_by_hand(&pool, handler.as_ref(), &mut ctx)
        .await
        .unwrap()
        .unwrap();
    sqlx::query(
        "UPDATE research_task_jobs SET max_execution_attempts = execution_attempts WHERE id = $1",
    )
    .bind(id)
    .execute(&pool)
    .await
    .unwrap();
    expire(&pool, id).await;

    // The next delivery finds the attempts used up: the task fails, as every failure does, with
    // its `research_task.failed` event in the same transaction.
    let e = engine(&pool, "w-after", extractive());
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "failed", "{j:?}");
    assert!(
        j.error
            .as_deref()
            .unwrap_or_default()
            .starts_with("attempts_exhausted"),
        "{j:?}"
    );
    assert_eq!(
        e.counters
            .exhausted
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    let sh = shape(&evs);
    assert_eq!(
        sh.last(),
        Some(&(
            "failed".into(),
            "failed".into(),
            json!({"error": "attempts_exhausted"})
        )),
        "{sh:#?}"
    );
    // Keyed by the row version the failure wrote.
    assert_eq!(
        evs.last().unwrap().3,
        format!(
            "research-task-progress:{id}:{}:research_task.failed",
            j.row_version
        )
    );
    assert_eq!(
        types(&evs).iter().filter(|t| *t == "failed").count(),
        1,
        "{sh:#?}"
    );
    assert_eq!(outbox_states(&pool, id).await, vec!["dead"]);
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_document_deleted_or_a_space_being_deleted_mid_task_is_never_read() {
    let s = seed("deleted").await;
    let pool = s.pool().clone();
    let handler = extractive();
    let id = request(&pool, &req(&s, QUESTION)).await;
    let frozen = s.head().await.unwrap();
    let mut ctx = claim_by_hand(&pool, id, "w-del").await;
    for _ in 0..2 {
        step_by_hand(&pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(ctx.checkpoint, "retrieving");
    // fencing.md is deleted while the task runs: marked deleting, as a deletion request marks its
    // target, and taken out of the head, as its quiescing does.
    let fencing = s.docs[1];
    let deletion = Uuid::new_v4();
    sqlx::query(
        "UPDATE document_assets SET lifecycle_state = 'deleting', deletion_job_id = $2, deleting_at = now(), \
           row_version = row_version + 1 WHERE id = $1",
    )
    .bind(fencing)
    .bind(deletion)
    .execute(&pool)
    .await
    .unwrap();
    {
        let mut conn = pool.acquire().await.unwrap();
        let moved = kfs_worker::publication::publish_excluding(
            &mut conn,
            TENANT,
            s.space,
            deletion,
            Some(&[fencing][..]),
            &json!({}),
        )
        .await
        .unwrap();
        assert!(matches!(moved, Some(Ok(_))), "{moved:?}");
    }
    assert_ne!(
        s.head().await.unwrap().publication_id,
        frozen.publication_id
    );
    let e = engine(&pool, "w-del-engine", extractive());
    expire(&pool, id).await;
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "completed", "{j:?}");
    // The task read its frozen publication (now superseded) and found only what is still live.
    let retrieval = &j.metadata["retrieval"];
    assert_eq!(retrieval["publicationId"], json!(frozen.publication_id));
    let b = bundle(&pool, id).await;
    assert_eq!(cited_documents(&b), vec![s.docs[0]]);
    assert!(!b.to_string().contains("Fencing will use"), "{b}");
    assert!(!j.metadata["result"]
        .to_string()
        .contains(&fencing.to_string()));
    assert!(!answer(&pool, id)
        .await
        .unwrap()
        .contains("Fencing will use"));

    // A space being deleted stops a running task at its next step.
    let id = request(&pool, &req(&s, "lease expire")).await;
    let mut ctx = claim_by_hand(&pool, id, "w-space").await;
    step_by_hand(&pool, handler.as_ref(), &mut ctx)
        .await
        .unwrap()
        .unwrap();
    sqlx::query(
        "UPDATE knowledge_spaces SET lifecycle_state = 'deleting', deletion_job_id = gen_random_uuid(), \
           deleting_at = now() WHERE id = $1",
    )
    .bind(s.space)
    .execute(&pool)
    .await
    .unwrap();
    let step = step_by_hand(&pool, handler.as_ref(), &mut ctx)
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(&step, Step::Cancel { code, .. } if code == "RESEARCH_TASK_DELETION_FENCE_ACTIVE"),
        "{step:?}"
    );
    let j = job(&pool, id).await;
    assert_eq!(j.stage, "canceled");
    assert!(j
        .error
        .unwrap()
        .starts_with("RESEARCH_TASK_DELETION_FENCE_ACTIVE: "));
    assert!(
        j.metadata.get("plan").is_none(),
        "the planning step did nothing"
    );
    assert_eq!(
        shape(&events(&pool, id).await).last().unwrap(),
        &(
            "canceled".into(),
            "canceled".into(),
            json!({"reason": "RESEARCH_TASK_DELETION_FENCE_ACTIVE"})
        )
    );
    assert_eq!(outbox_states(&pool, id).await, vec!["canceled"]);
    s.fx.cleanup().await;
}
