//! The whole walk answers from published knowledge with the platform's payloads, a replayed
//! step adds no event and no partial, and a worker killed at any kill point leaves a walk another
//! finishes.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_whole_walk_answers_from_published_knowledge_with_the_platforms_payloads() {
    let s = seed("walk").await;
    let pool = s.pool().clone();
    let id = request(&pool, &req(&s, QUESTION)).await;

    // As requested: queued, version 1, routed to research, top-k 10, the head frozen.
    let j = job(&pool, id).await;
    assert_eq!((j.stage.as_str(), j.row_version), ("queued", 1));
    type Admitted = (String, i32, i32, i32, Option<String>, Option<i32>);
    let (tenant, attempts, max, rev, mode, top_k): Admitted = sqlx::query_as(
        "SELECT tenant_id, execution_attempts, max_execution_attempts, permission_snapshot_revision, mode, top_k \
         FROM research_task_jobs WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (tenant.as_str(), attempts, max, rev, mode.as_deref(), top_k),
        (TENANT, 0, 5, 1, Some("research"), Some(10))
    );
    let head = s.head().await.unwrap();
    // The space's retrieval profile (every fixture space starts with the platform's initial one).
    let (profile, capability): (serde_json::Value, serde_json::Value) = sqlx::query_as(
        "SELECT snapshot, capability_snapshot FROM knowledge_space_profile_revisions \
         WHERE knowledge_space_id = $1 AND kind = 'retrieval' AND state = 'active'",
    )
    .bind(s.space)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        j.metadata["__knowledgeFsPublishedRuntimeSnapshot"],
        json!({
            "projectionSnapshot": {"fingerprint": head.fingerprint, "headRevision": head.revision,
              "knowledgeSpaceId": s.space, "projectionVersion": head.projection_version,
              "publicationId": head.publication_id, "tenantId": TENANT},
            "retrievalCapabilitySnapshot": capability, "retrievalProfile": profile
        })
    );
    assert_eq!(
        j.metadata["__knowledgeFsAutoRetrievalModeDecision"],
        json!({"degraded": true, "durationMs": 0, "errorClass": "AutoRetrievalModeResolverUnavailable",
               "requestedMode": "auto", "resolvedMode": "research", "resolver": "fallback"})
    );
    assert_eq!(j.cost, json!({"entries": [], "totalUsd": 0.0}));
    assert_eq!(
        outbox(&pool, id).await,
        vec![(
            1,
            "pending".into(),
            format!("research.task:{TENANT}:{}:{id}:1", s.space)
        )]
    );
    let payload: Value = sqlx::query_scalar(
        "SELECT payload FROM research_task_outbox WHERE research_task_job_id = $1",
    )
    .bind(id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(payload, json!({ "researchTaskJobId": id }));
    let evs = events(&pool, id).await;
    assert_eq!(
        shape(&evs),
        vec![("started".into(), "queued".into(), json!({}))]
    );
    assert_eq!(
        evs[0].3,
        format!("research-task-progress:{id}:1:research_task.started")
    );

    let e = engine(&pool, "w-walk", extractive());
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "completed", "{j:?}");
    assert_eq!(j.lease_token, None);
    let stored = answer(&pool, id)
        .await
        .expect("the answer in the final partial result");

    // Every event, exactly: the claim, then each stage with the runtime's details, the answer
    // as one delta (the extractive answer is made at once) before the completion.
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    let sc = |stage: &str, payload: Value| ("stage_changed".to_owned(), stage.to_owned(), payload);
    assert_eq!(
        shape(&evs),
        vec![
            ("started".into(), "queued".into(), json!({})),
            sc("queued", claim(1)),
            sc("planning", json!({"previousStage": "queued"})),
            sc(
                "retrieving",
                json!({"details": {"questions": [QUESTION, "How does fencing use the lease token",
                  "when does a lease expire"], "topK": 10}, "previousStage": "planning"})
            ),
            sc(
                "analyzing",
                json!({"details": {"results": [
                    {"chunkCount": 0, "question": QUESTION},
                    {"chunkCount": 1, "question": "How does fencing use the lease token"},
                    {"chunkCount": 1, "question": "when does a lease expire"}],
                  "retrievalCount": 2}, "previousStage": "retrieving"})
            ),
            sc(
                "generating",
                json!({"details": {"chunks": 2, "retrievalCount": 2}, "previousStage": "analyzing"})
            ),
            (
                "answer_delta".into(),
                "generating".into(),
                json!({"delta": stored, "executionAttempt": 1, "offset": 0})
            ),
            sc(
                "completed",
                json!({"details": {"chunks": 2, "documents": 2, "sources": 2}, "previousStage": "generating"})
            ),
        ]
    );
    // Keyed by the row version each transition wrote: the claim wrote 2, each step one more;
    // the delta by its attempt and offset.
    let rvs: Vec<&str> = evs.iter().map(|e| e.3.split(':').nth(2).unwrap()).collect();
    assert_eq!(rvs, vec!["1", "2", "3", "4", "5", "6", "attempt", "7"]);
    assert_eq!(
        evs[6].3,
        format!("research-task-progress:{id}:attempt:1:answer:0")
    );

    // The final evidence bundle, in the platform's shape.
    let b = bundle(&pool, id).await;
    assert_eq!(b["traceId"], json!(id.to_string()));
    assert_eq!(b["query"], json!(QUESTION));
    assert_eq!(b["state"], "answerable");
    assert_eq!(b["missingEvidence"], json!([]));
    let items = b["items"].as_array().unwrap();
    assert_eq!(items.len(), 2);
    for item in items {
        let c = &item["citations"][0];
        assert_eq!(c["documentVersion"], 1);
        assert!(c["artifactHash"].as_str().unwrap().len() > 8, "{c}");
        assert!(c["endOffset"].as_i64() > c["startOffset"].as_i64(), "{c}");
        assert_eq!(item["metadata"]["sources"], json!(["fts"]));
        assert_eq!(
            item["metadata"]["projectionIds"].as_array().unwrap().len(),
            1
        );
        assert_eq!(item["freshness"], json!({"status": "unknown"}));
        assert_eq!(item["scores"]["final"], item["score"]);
    }
    assert_eq!(cited_documents(&b), {
        let mut d = vec![s.docs[0], s.docs[1]];
        d.sort();
        d
    });
    let text = b.to_string();
    assert!(
        !text.contains("OTHER-TENANT-SECRET"),
        "another tenant leaked"
    );
    assert!(!text.contains("bread"), "irrelevant node retrieved: {text}");

    // The answer (in the final partial result, as the platform keeps it since its 0033) cites
    // what it quotes (metadata.result).
    assert!(
        stored.contains("Fencing will use the lease token"),
        "{stored}"
    );
    assert_eq!(stored, stored.trim());
    let result = &j.metadata["result"];
    assert!(result.get("answer").is_none(), "the answer is kept once");
    let cited: Vec<Uuid> = result["citations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Uuid::parse_str(c["documentId"].as_str().unwrap()).unwrap())
        .collect();
    assert!(
        cited.contains(&s.docs[0]) && cited.contains(&s.docs[1]),
        "{result}"
    );
    assert_eq!(result["generator"], "extractive");
    // One free call, reserved and settled in the platform's entry shape.
    let mut cost = j.cost.clone();
    assert!(cost["entries"][0]["recordedAt"].as_i64().unwrap() > 0);
    cost["entries"][0]["recordedAt"] = json!(0);
    assert_eq!(
        cost,
        json!({"entries": [{"costUsd": 0.0, "provider": "extractive", "recordedAt": 0, "step": "query.answer",
          "usage": {"completionTokens": 0, "estimated": false, "promptTokens": 0,
            "researchModelCallId": format!("attempt:1:query-answer:{id}:1:extractive"), "reserved": false,
            "status": "succeeded", "totalTokens": 0}}], "totalUsd": 0.0})
    );
    assert_eq!(outbox_states(&pool, id).await, vec!["completed"]);

    // A late duplicate of the finished job's delivery changes nothing.
    assert!(deliver(&s, &e).await.is_none(), "nothing is due any more");
    assert_eq!(events(&pool, id).await.len(), evs.len());
    assert_eq!(partials(&pool, id).await.len(), 1);
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replayed_step_adds_no_event_and_no_partial() {
    let s = seed("replay").await;
    let pool = s.pool().clone();
    let id = request(&pool, &req(&s, QUESTION)).await;
    let handler = extractive();
    let st = Statements::new(&RESEARCH);
    let mut ctx = claim_by_hand(&pool, id, "w-replay").await;
    loop {
        // First run: effects commit, but (as if the process died) the stage does not move.
        let mut tx = pool.begin().await.unwrap();
        ctx.row_version = lease::fence(&mut tx, &st, &ctx, std::time::Duration::from_secs(30))
            .await
            .unwrap()
            .expect("ours");
        let first = handler.step(&mut tx, &ctx).await.unwrap();
        tx.commit().await.unwrap();
        let counts = (
            events(&pool, id).await.len(),
            partials(&pool, id).await.len(),
            job(&pool, id).await.cost,
        );

        // The replay, with the same row version, then the stage moves with it.
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM research_task_jobs WHERE id = $1 FOR UPDATE")
            .bind(id)
            .execute(&mut *tx)
            .await
            .unwrap();
        let again = handler.step(&mut tx, &ctx).await.unwrap();
        assert_eq!(first, again, "a replay decides the same");
        commit_step(&mut tx, &st, &mut ctx, &again).await;
        tx.commit().await.unwrap();
        assert_eq!(
            counts,
            (
                events(&pool, id).await.len(),
                partials(&pool, id).await.len(),
                job(&pool, id).await.cost,
            ),
            "the replay of the step at {} added rows or spent again",
            ctx.checkpoint
        );
        if matches!(again, Step::Succeed(_)) {
            break;
        }
    }
    assert_eq!(job(&pool, id).await.stage, "completed");
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    assert_eq!(advances(&evs), ADVANCES.to_vec());
    assert_eq!(evs.iter().filter(|e| is_claim(e)).count(), 1);
    assert_eq!(partials(&pool, id).await.len(), 1);
    s.fx.cleanup().await;
}

#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_at_each_kill_point_leaves_a_walk_another_finishes() {
    let s = seed("kill").await;
    let pool = s.pool().clone();
    let env = &s.env;
    let common_env = [
        ("KFS_RELAY_POLL", "100ms"),
        ("KFS_SLICE_STEPS", "1"),
        ("KFS_GENERATOR", "extractive"),
    ];
    for point in ["after-claim-commit", "after-step-commit:2", "before-ack:2"] {
        let id = request(&pool, &req(&s, QUESTION)).await;
        let mut extra = common_env.to_vec();
        extra.push(("KFS_CRASH_AT", point));
        let mut doomed = env.spawn_worker(
            "doomed",
            &[
                "run",
                "--kinds",
                "research",
                "--worker-id",
                &format!("doomed-{point}"),
            ],
            &extra,
        );
        let (status, doomed) = tokio::task::spawn_blocking(move || {
            let s = doomed.wait_exit(Duration::from_secs(60));
            (s, doomed)
        })
        .await
        .unwrap();
        let status =
            status.unwrap_or_else(|| panic!("did not crash at {point}:\n{}", doomed.log_text()));
        assert!(!status.success(), "{point}: {status:?}");
        assert!(
            doomed.log_text().contains("crash point"),
            "{}",
            doomed.log_text()
        );
        let mid = job(&pool, id).await;
        assert_ne!(
            mid.stage, "completed",
            "{point}: crashed too late to matter"
        );

        let mut rescuer = env.spawn_worker(
            "rescuer",
            &[
                "run",
                "--kinds",
                "research",
                "--worker-id",
                &format!("rescuer-{point}"),
            ],
            &common_env,
        );
        let p = pool.clone();
        let done = env
            .wait_until(Duration::from_secs(60), || {
                let p = p.clone();
                async move { job(&p, id).await.stage == "completed" }
            })
            .await;
        assert!(
            done,
            "{point}: {:?}\n{}",
            job(&pool, id).await,
            rescuer.log_text()
        );
        support::stop_cleanly([&mut rescuer], Duration::from_secs(20)).await;

        let evs = events(&pool, id).await;
        assert_contiguous(id, &evs);
        assert_eq!(advances(&evs), ADVANCES.to_vec(), "{point}");
        // One claim event per execution attempt, in order.
        let attempts: Vec<i64> = evs
            .iter()
            .filter(|e| is_claim(e))
            .map(|e| e.4["executionAttempt"].as_i64().unwrap())
            .collect();
        assert!(
            !attempts.is_empty() && attempts.windows(2).all(|w| w[0] < w[1]),
            "{point}: {attempts:?}"
        );
        bundle(&pool, id).await;
        assert!(answer(&pool, id).await.is_some());
    }
    s.fx.cleanup().await;
}
