//! A document deletion erases every version, its derived rows, objects and graph (a
//! model-driven one its checkpoints, receipts and evaluation too) and leaves the head without it.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_document_deletion_erases_every_version_its_derived_rows_and_its_graph_and_leaves_the_head_without_it(
) {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let pool = fx.pool();
    // A document with two versions: both objects go.
    let versioned = fx
        .add("versioned.md", "text/markdown", note(9, "v1").as_bytes())
        .await;
    let mut cn = conn(pool).await;
    platform::replace_document(&mut cn, &fx.store, versioned, Bytes::from(note(9, "v2")))
        .await
        .unwrap();
    drop(cn);
    fx.compile(versioned).await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 3).await;
    let c = seed(&fx, "tenant-u", "main", "Docs", 0, 1).await;
    let (doc, other) = (s.docs[0], s.docs[1]);
    // Another document's graph stays with it.
    let other_graph = publish_graph(&fx, &s, other).await;
    // A graph entity of the other document built partly from this one's nodes.
    let cross = publish_cross_entity(pool, &s, other, doc).await;
    assert!(head_members(pool, &s)
        .await
        .iter()
        .any(|m| m.component_key == cross));
    assert_eq!(
        files_under(&fx.dir, &format!("{}/documents/{versioned}", s.prefix)).len(),
        2
    );
    let cat = catalog(pool).await;
    let before = untouched(&fx, &cat, &[&c]).await;
    let mut needles = needles_of(&fx, &s, doc).await;
    let extra_keys = [
        format!("{}/segments/{doc}/0.txt", s.prefix),
        format!("{}/assets/{doc}/figure.png", s.prefix),
        format!("{}/assets/{doc}/figure-thumb.png", s.prefix),
    ];
    needles.extend(extra_keys.iter().cloned());
    let other_nodes = nodes_of(pool, other).await.len();
    assert!(served(pool, &s).await.contains(&doc));
    let owned = cat.count_owned(pool, None, &[doc]).await;
    assert!(
        owned.len() > 10,
        "the document has rows in many tables: {owned:?}"
    );
    assert!(cat.mentions(pool, &needles).await.len() > 10);

    let rv: i32 = sqlx::query_scalar("SELECT row_version FROM document_assets WHERE id = $1")
        .bind(doc)
        .fetch_one(pool)
        .await
        .unwrap();
    // A stale revision is refused; the current one is accepted.
    let stale = DeletionRequest {
        expected_revision: Some(rv + 1),
        ..target_request(&s, Target::Document { id: doc }, "d1")
    };
    assert!(matches!(
        request(pool, &stale).await,
        Err(RequestError::RevisionMismatch { .. })
    ));
    let job = request(
        pool,
        &DeletionRequest {
            expected_revision: Some(rv),
            ..target_request(&s, Target::Document { id: doc }, "d1")
        },
    )
    .await
    .unwrap();
    // The request seeded the raw object as the job's first item, as the platform does.
    let raw: (i64, String, String) = sqlx::query_as(
        "SELECT ordinal, kind, idempotency_key FROM deletion_job_items WHERE deletion_job_id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((raw.0, raw.1.as_str()), (0, "object"));
    assert!(raw.2.starts_with("raw-object:"), "{}", raw.2);
    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    assert_documents_gone(&fx, &cat, &s, &[doc], &needles).await;
    for k in &extra_keys {
        assert!(!fx.dir.join(k).exists(), "{k} left");
    }
    // The head serves the other documents, with the other document's graph, and nothing of
    // this one (its graph members are gone with its graph rows).
    let serving = served(pool, &s).await;
    assert_eq!(serving, BTreeSet::from([other, s.docs[2], versioned]));
    let members = head_members(pool, &s).await;
    assert!(members.iter().all(|m| m.document_asset_id != Some(doc)));
    let graph: BTreeSet<Uuid> = members
        .iter()
        .filter(|m| m.component_type.starts_with("graph-"))
        .map(|m| m.component_key)
        .collect();
    assert_eq!(
        graph,
        other_graph.iter().copied().collect(),
        "the closure drops {cross}"
    );
    let graph_rows: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM graph_entities WHERE knowledge_space_id = $1) \
              + (SELECT count(*) FROM graph_relations WHERE knowledge_space_id = $1)",
    )
    .bind(s.id)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(graph_rows, 3, "only the other document's graph is left");
    assert_eq!(nodes_of(pool, other).await.len(), other_nodes);
    let golden: Vec<String> =
        sqlx::query_scalar("SELECT question FROM golden_questions WHERE knowledge_space_id = $1")
            .bind(s.id)
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(golden, vec!["about nothing in particular".to_string()]);
    let objects: i64 = item_kinds(pool, job)
        .await
        .iter()
        .filter(|(k, _)| k == "object")
        .map(|(_, n)| *n)
        .sum();
    assert!(
        objects >= 5,
        "raw (seeded and scanned), segment and manifest keys: {objects}"
    );

    // Every version of a replaced document goes.
    let job = request(
        pool,
        &target_request(&s, Target::Document { id: versioned }, "dv"),
    )
    .await
    .unwrap();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    assert!(files_under(&fx.dir, &format!("{}/documents/{versioned}", s.prefix)).is_empty());
    assert_eq!(served(pool, &s).await, BTreeSet::from([other, s.docs[2]]));
    assert_untouched(&fx, &cat, &[&c], &before).await;
    fx.cleanup().await;
}

/// Counts of a document's rows in the tables a model-driven compile and its follow-on kinds add.
async fn model_rows(pool: &PgPool, space: Uuid, doc: Uuid) -> BTreeMap<&'static str, i64> {
    let mut out = BTreeMap::new();
    for (table, sql) in [
        ("window checkpoints", "SELECT count(*) FROM document_semantic_window_checkpoints WHERE document_asset_id = $2"),
        ("summary checkpoints", "SELECT count(*) FROM document_outline_summary_checkpoints WHERE document_asset_id = $2"),
        ("receipts", "SELECT count(*) FROM knowledge_node_generation_receipts WHERE document_asset_id = $2"),
        ("evaluations", "SELECT count(*) FROM page_index_findability_evaluations WHERE document_asset_id = $2"),
        ("graph entities", "SELECT count(*) FROM graph_entities WHERE knowledge_space_id = $1"),
        ("graph relations", "SELECT count(*) FROM graph_relations WHERE knowledge_space_id = $1"),
        ("entity projections", "SELECT count(*) FROM graph_entity_semantic_projections WHERE knowledge_space_id = $1"),
        ("relation projections", "SELECT count(*) FROM graph_relation_semantic_projections WHERE knowledge_space_id = $1"),
    ] {
        let n: i64 = sqlx::query_scalar(sql)
            .bind(space)
            .bind(doc)
            .fetch_one(pool)
            .await
            .unwrap();
        out.insert(table, n);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_model_driven_document_deletion_erases_its_checkpoints_receipts_graph_and_evaluation() {
    let fx = SpaceFx::new("tenant-md", "main", "Model docs").await;
    let pool = fx.pool();
    let mut c = conn(pool).await;
    platform::activate_retrieval_profile(&mut c, "tenant-md", fx.space, "kfs-reasoner", "offline")
        .await
        .unwrap();
    platform::activate_embedding_profile(&mut c, "tenant-md", fx.space, "e", "openai", 16)
        .await
        .unwrap();
    drop(c);
    let s = seed(&fx, "tenant-md", "main", "Model docs", 0, 0).await;
    let doc = fx
        .add(
            "harbour.md",
            "text/markdown",
            b"# Harbour\n\nThe Harbour Authority hired Captain Morgan. Captain Morgan briefed the Pilot \
Service on the Tide Table.\n\n## Fees\n\nThe Harbour Authority sets Berth Fees with the Port Council.\n",
        )
        .await;
    let attempt = fx.request(doc, false).await.unwrap();
    let st = fx
        .drive(
            &fx.engine_with("w-md", 64, Deps::offline_models(fx.store.clone())),
            attempt,
        )
        .await;
    assert_eq!(st.run_state, "succeeded", "{st:?}");
    // Its findability evaluation (this process's, or a worker's that got there first).
    let _ =
        kfs_worker::jobs::findability::FindabilityKind::new(kfs_worker::model::Models::offline())
            .evaluate(pool, attempt)
            .await;
    let before = model_rows(pool, s.id, doc).await;
    for (table, n) in &before {
        assert!(*n > 0, "the model-driven document has {table}: {before:?}");
    }
    let cat = catalog(pool).await;
    let needles = needles_of(&fx, &s, doc).await;
    let job = request(
        pool,
        &target_request(&s, Target::Document { id: doc }, "md"),
    )
    .await
    .unwrap();
    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    assert_documents_gone(&fx, &cat, &s, &[doc], &needles).await;
    let after = model_rows(pool, s.id, doc).await;
    assert!(after.values().all(|n| *n == 0), "left: {after:?}");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_document_deletion_without_a_seeded_raw_object_item_still_erases_the_raw_object() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 0).await;
    let pool = fx.pool();
    let doc = fx
        .add("raw.md", "text/markdown", note(1, "raw").as_bytes())
        .await;
    // The raw object lives outside the document's folder (an older upload layout), so only the
    // document row names it.
    let old: String = sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
        .bind(doc)
        .fetch_one(pool)
        .await
        .unwrap();
    let raw = format!("{}/uploads/{doc}.md", s.prefix);
    let bytes = fx.store.get(&old).await.unwrap();
    fx.store.put(&raw, bytes).await.unwrap();
    fx.store.delete(&old).await.unwrap();
    sqlx::query("UPDATE document_assets SET object_key = $2 WHERE id = $1")
        .bind(doc)
        .bind(&raw)
        .execute(pool)
        .await
        .unwrap();
    fx.compile(doc).await;
    let cat = catalog(pool).await;
    let needles = needles_of(&fx, &s, doc).await;
    let job = request(
        pool,
        &target_request(&s, Target::Document { id: doc }, "raw"),
    )
    .await
    .unwrap();
    // A request that did not seed the raw object's item.
    let seeded = sqlx::query("DELETE FROM deletion_job_items WHERE deletion_job_id = $1")
        .bind(job)
        .execute(pool)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(seeded, 1);
    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    assert!(!fx.dir.join(&raw).exists(), "the raw object was not erased");
    let erased: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM deletion_job_items WHERE deletion_job_id = $1 AND idempotency_key = $2 \
           AND status = 'completed' AND object_key IS NULL",
    )
    .bind(job)
    .bind(format!("object:{}", platform::sha256_hex(raw.as_bytes())))
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(erased, 1, "the inventory found the raw object itself");
    let passes: Option<String> =
        sqlx::query_scalar("SELECT scan_cursor FROM deletion_jobs WHERE id = $1")
            .bind(job)
            .fetch_one(pool)
            .await
            .unwrap();
    assert!(
        passes.unwrap_or_default().contains("\"pass\":1"),
        "found in the first pass"
    );
    assert_documents_gone(&fx, &cat, &s, &[doc], &needles).await;
    fx.cleanup().await;
}
