//! Retrieval searches only what the task may see: never another tenant's space, an unpublished
//! generation or a document the snapshot does not cover; and a space's dense leg too.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn another_tenants_space_and_unpublished_generations_are_never_searched() {
    let s = seed("iso").await;
    let pool = s.pool().clone();
    // A draft compiled up to its candidate publication, never published.
    let draft = s
        .add(
            "draft.md",
            "text/markdown",
            b"# Draft\n\nThe quokka draft was never published.\n",
        )
        .await;
    let attempt = s.request(draft, false).await.unwrap();
    s.drive_to(&s.engine("w-draft", 1), attempt, "projection_built")
        .await;
    // Only the other tenant's space and our unpublished draft have "quokka".
    let id = request(&pool, &req(&s, "Where is the quokka?")).await;
    let e = engine(&pool, "w-iso", extractive());
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "completed", "{j:?}");
    let b = bundle(&pool, id).await;
    assert_eq!(b["items"], json!([]));
    assert_eq!(b["state"], "not-enough-evidence");
    assert_eq!(answer(&pool, id).await.as_deref(), Some(NO_EVIDENCE_ANSWER));
    assert_eq!(j.metadata["result"]["citations"], json!([]));
    assert_eq!(reassemble(&events(&pool, id).await, 1), NO_EVIDENCE_ANSWER);
    assert_eq!(j.cost["entries"], json!([]), "no evidence, no model call");
    let all = format!("{} {}", j.metadata, b);
    assert!(!all.contains(&s.other_doc.to_string()));
    assert!(!all.contains(&s.other_space.to_string()));
    assert!(!all.contains(&draft.to_string()));
    let evs = events(&pool, id).await;
    assert_eq!(
        evs.last().unwrap().4,
        json!({"details": {"chunks": 0, "documents": 0, "sources": 0}, "previousStage": "generating"})
    );

    // And the words both spaces share find only ours.
    let id = request(&pool, &req(&s, "fencing lease token")).await;
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "completed");
    let b = bundle(&pool, id).await;
    assert_eq!(cited_documents(&b), vec![s.docs[1]]);
    assert!(!b.to_string().contains("OTHER-TENANT-SECRET"));
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_document_the_snapshot_does_not_cover_is_never_cited() {
    let s = seed("scope").await;
    let pool = s.pool().clone();
    let carols = vec![format!("knowledge-space:{}:member:carol", s.space)];
    let alices = vec![format!("knowledge-space:{}:member:{SUBJECT}", s.space)];
    let zebra = upload(
        &s,
        s.space,
        "zebra.md",
        "# Zebra\n\nThe zebra stripes are carol's notes.\n",
        carols,
    )
    .await;
    let giraffe = upload(
        &s,
        s.space,
        "giraffe.md",
        "# Giraffe\n\nThe giraffe neck is alice's.\n",
        alices,
    )
    .await;
    s.compile(zebra).await;
    s.compile(giraffe).await;
    let e = engine(&pool, "w-scope", extractive());

    // Alice: her own scoped document, never carol's.
    let id = request(&pool, &req(&s, "zebra stripes")).await;
    assert_eq!(run_until_settled(&s, &e, id).await.stage, "completed");
    assert_eq!(bundle(&pool, id).await["items"], json!([]));
    let id = request(&pool, &req(&s, "giraffe neck")).await;
    assert_eq!(run_until_settled(&s, &e, id).await.stage, "completed");
    assert_eq!(cited_documents(&bundle(&pool, id).await), vec![giraffe]);

    // Carol's snapshot covers carol's document (and unscoped ones), not alice's.
    let carol = s.snapshot("carol").await;
    for (question, want) in [("zebra stripes", vec![zebra]), ("giraffe neck", vec![])] {
        let r = ResearchRequest::new(s.space, question, "carol", carol);
        let id = request(&pool, &r).await;
        assert_eq!(run_until_settled(&s, &e, id).await.stage, "completed");
        assert_eq!(
            cited_documents(&bundle(&pool, id).await),
            want,
            "{question}"
        );
    }
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_space_with_an_embedding_profile_is_searched_by_its_dense_leg_too() {
    let fx = SpaceFx::new(TENANT, "dense", "Dense").await;
    let pool = fx.pool().clone();
    let profile = {
        let mut conn = pool.acquire().await.unwrap();
        platform::activate_embedding_profile(
            &mut conn,
            TENANT,
            fx.space,
            "embed-small",
            "openai",
            256,
        )
        .await
        .unwrap()
    };
    let mut docs = Vec::new();
    for (name, text) in [("leases.md", LEASES), ("cooking.md", COOKING)] {
        let d = fx.add(name, "text/markdown", text.as_bytes()).await;
        fx.compile(d).await;
        docs.push(d);
    }
    let question = "Is the heartbeat alive every ten seconds tomorrow?";
    // No passage has every word: the full-text leg alone finds nothing.
    assert!(fx
        .search("heartbeat alive every ten seconds tomorrow")
        .await
        .is_empty());
    let snapshot = fx.snapshot(SUBJECT).await;
    let id = request(
        &pool,
        &ResearchRequest::new(fx.space, question, SUBJECT, snapshot),
    )
    .await;
    let frozen = &job(&pool, id).await.metadata["__knowledgeFsPublishedRuntimeSnapshot"];
    assert_eq!(
        frozen["embeddingProfile"],
        json!({"dimension": 256, "model": "embed-small", "pluginId": "langgenius/openai", "provider": "openai",
               "revision": 1, "vectorSpaceId": profile.vector_space_id})
    );
    assert_eq!(frozen["embeddingCapabilitySnapshot"]["kind"], "embedding");

    let e = engine(&pool, "w-dense", extractive());
    let j = run_until_settled(&fx, &e, id).await;
    assert_eq!(j.stage, "completed", "{j:?}");
    let b = bundle(&pool, id).await;
    let first = &b["items"][0];
    assert!(
        first["text"].as_str().unwrap().contains("heartbeat runs"),
        "{b}"
    );
    assert_eq!(first["metadata"]["sources"], json!(["dense"]));
    assert_eq!(first["citations"][0]["documentAssetId"], json!(docs[0]));
    // Nearest first over two legs: 1/61 of the best 2/61.
    assert_eq!(first["scores"]["final"], json!(0.5));
    assert!(answer(&pool, id)
        .await
        .unwrap()
        .contains("The heartbeat runs every ten seconds"));
    fx.cleanup().await;
}
