//! A source deletion either keeps its documents (detached, still served) or cascades to them.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn source_deletion_keeps_or_cascades_its_documents() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 2, 4).await;
    let b = seed(&fx, "tenant-t", "other", "Other", 1, 1).await;
    let c = seed(&fx, "tenant-u", "main", "Docs", 1, 1).await;
    let pool = fx.pool();
    let (keep_src, cascade_src) = (s.sources[0], s.sources[1]);
    let kept: Vec<Uuid> = vec![s.docs[0], s.docs[2]];
    let cascaded: Vec<Uuid> = vec![s.docs[1], s.docs[3]];
    // The platform's sources record their identity in their documents' metadata.
    sqlx::query(
        "UPDATE document_assets SET metadata = metadata || jsonb_build_object('sourceId', $2::text, \
           'provenance', jsonb_build_object('sourceId', $2::text, 'providerItemId', 'item-1')) WHERE id = ANY($1)",
    )
    .bind(&kept)
    .bind(keep_src.to_string())
    .execute(pool)
    .await
    .unwrap();
    let cat = catalog(pool).await;
    let before = untouched(&fx, &cat, &[&b, &c]).await;
    let kept_nodes: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM knowledge_nodes WHERE document_asset_id = ANY($1)",
    )
    .bind(&kept)
    .fetch_one(pool)
    .await
    .unwrap();
    let kept_objects: BTreeSet<String> = kept
        .iter()
        .flat_map(|d| files_under(&fx.dir, &format!("{}/documents/{d}", s.prefix)))
        .collect();
    let graph_before: Vec<Member> = head_members(pool, &s)
        .await
        .into_iter()
        .filter(|m| m.component_type.starts_with("graph-"))
        .collect();
    assert_eq!(graph_before.len(), 3);
    let secrets = Arc::new(Recording {
        failures_left: AtomicU64::new(1),
        ..Recording::default()
    });
    let h = DeletionHandler::with_ports(
        Deps::offline(fx.store.clone()),
        secrets.clone(),
        Arc::new(kfs_worker::jobs::deletion::NoCache),
    )
    .with_config(fast_config());
    let driver = Driver::new(&fx, Arc::new(h), Budget::default()).await;

    // keep: the source goes, its documents stay (detached, reactivated, still served) with
    // their objects and derived rows, and nothing names the source any more.
    let job = request(
        pool,
        &target_request(
            &s,
            Target::Source {
                id: keep_src,
                mode: SourceMode::Keep,
            },
            "keep",
        ),
    )
    .await
    .unwrap();
    let fenced: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM document_assets WHERE id = ANY($1) AND lifecycle_state = 'deleting' AND deletion_job_id = $2",
    )
    .bind(&kept)
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(fenced, 2, "both modes fence the source's documents");
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    let left: Vec<(Option<Uuid>, String, Option<Uuid>, serde_json::Value)> = sqlx::query_as(
        "SELECT source_id, lifecycle_state, deletion_job_id, metadata FROM document_assets WHERE id = ANY($1)",
    )
    .bind(&kept)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(left.len(), 2);
    for (src, st, fence, meta) in &left {
        assert_eq!((src, st.as_str(), fence), (&None, "active", &None));
        assert!(
            meta.get("sourceId").is_none() && meta["provenance"].get("sourceId").is_none(),
            "{meta}"
        );
        assert!(meta["provenance"].get("providerItemId").is_none(), "{meta}");
        assert_eq!(meta["tenantId"], "tenant-t");
    }
    let nodes: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM knowledge_nodes WHERE document_asset_id = ANY($1)",
    )
    .bind(&kept)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(nodes, kept_nodes);
    for k in &kept_objects {
        assert!(fx.dir.join(k).exists(), "kept object {k} erased");
    }
    let head = fx_head(pool, &s).await;
    let meta: serde_json::Value =
        sqlx::query_scalar("SELECT metadata FROM projection_set_publications WHERE id = $1")
            .bind(head.publication_id)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(meta["sourceIdentityScrubbed"], true);
    assert_eq!(meta["deletionJobId"], job.to_string());
    let serving = served(pool, &s).await;
    assert!(kept.iter().all(|d| serving.contains(d)), "{serving:?}");
    let graph_after: Vec<Member> = head_members(pool, &s)
        .await
        .into_iter()
        .filter(|m| m.component_type.starts_with("graph-"))
        .collect();
    assert_eq!(
        graph_after, graph_before,
        "kept documents keep their graph members"
    );
    let named = cat
        .mentions(pool, &[keep_src.to_string(), s.credentials[0].clone()])
        .await;
    assert!(
        named.is_empty(),
        "rows naming the kept source left: {named:?}"
    );
    // The secret failed once, retried on its own schedule, then went.
    assert_eq!(
        secrets.secrets.lock().unwrap().clone(),
        vec![(
            s.tenant.clone(),
            s.id,
            Some(keep_src),
            s.credentials[0].clone()
        )]
    );
    let attempts: i32 = sqlx::query_scalar(
        "SELECT attempts FROM deletion_job_items WHERE deletion_job_id = $1 AND kind = 'secret_ref'",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(attempts, 2);

    // cascade: the source and its documents go, with objects, derived rows and head membership.
    let mut needles = vec![cascade_src.to_string(), s.credentials[1].clone()];
    for d in &cascaded {
        needles.extend(needles_of(&fx, &s, *d).await);
    }
    let job = request(
        pool,
        &target_request(
            &s,
            Target::Source {
                id: cascade_src,
                mode: SourceMode::Cascade,
            },
            "cascade",
        ),
    )
    .await
    .unwrap();
    let marked: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM document_assets WHERE id = ANY($1) AND lifecycle_state = 'deleting' AND deletion_job_id = $2",
    )
    .bind(&cascaded)
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(marked, 2, "cascade fences the source's documents");
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    assert_documents_gone(&fx, &cat, &s, &cascaded, &needles).await;
    let serving = served(pool, &s).await;
    assert_eq!(serving, kept.iter().copied().collect::<BTreeSet<_>>());
    for k in &kept_objects {
        assert!(
            fx.dir.join(k).exists(),
            "kept object {k} erased by the cascade"
        );
    }
    assert_eq!(
        item_kinds(pool, job).await,
        vec![("object".into(), 2), ("secret_ref".into(), 1)]
    );
    assert_untouched(&fx, &cat, &[&b, &c], &before).await;
    fx.cleanup().await;
}
