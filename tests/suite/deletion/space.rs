//! A space deletion erases every row of the space in every table, its objects, secrets and
//! caches, and nothing of any other space or tenant; 10,000 documents go one bounded page a step.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_space_deletion_erases_everything_of_the_space_and_nothing_of_any_other() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let a = seed(&fx, "tenant-t", "main", "Docs", 2, 4).await;
    // Same tenant, another space; another tenant with the same slug, name, file names and bytes.
    let b = seed(&fx, "tenant-t", "other", "Other", 1, 1).await;
    let c = seed(&fx, "tenant-u", "main", "Docs", 1, 1).await;
    let pool = fx.pool();
    // A live retrieval lease in space C must not hold up A's deletion.
    sqlx::query(
        "INSERT INTO retrieval_execution_leases (id, tenant_id, knowledge_space_id, subject_id, trace_id, lease_token, \
           status, row_version, acquired_at, heartbeat_at, expires_at, updated_at) \
         VALUES (gen_random_uuid(), $1, $2, 'bob', gen_random_uuid(), 'tok', 'active', 0, now(), now(), \
           now() + interval '1 hour', now())",
    )
    .bind(&c.tenant)
    .bind(c.id)
    .execute(pool)
    .await
    .unwrap();
    let cat = catalog(pool).await;
    let before = untouched(&fx, &cat, &[&b, &c]).await;
    let a_objects = files_under(&fx.dir, &a.prefix);
    assert_eq!(a_objects.len(), 4 + 3, "{a_objects:?}");
    assert!(cat.count_owned(pool, Some(a.id), &a.docs).await.len() > 40);

    let recorder = Arc::new(Recording::default());
    recorder.cache.lock().unwrap().extend([
        format!("space-cache:v2:evidence-bundle:space:{}:q1", a.id),
        format!("space-cache:v2:evidence-bundle:space:{}:q1", b.id),
        "evidence-bundle:legacy-entry".to_string(),
    ]);
    let h = DeletionHandler::with_ports(
        Deps::offline(fx.store.clone()),
        recorder.clone(),
        recorder.clone(),
    )
    .with_config(fast_config());
    let driver = Driver::new(&fx, Arc::new(h), Budget::default()).await;
    let job = request(pool, &space_request(&a, "del-a")).await.unwrap();

    // The request wrote the job, the tombstone, the fence and the first outbox revision.
    let row: (String, String, i32, bool, i32, i32, String, Option<String>) = sqlx::query_as(
        "SELECT run_state, checkpoint, row_version, inventory_complete, active_slot, max_execution_attempts, \
           request_fingerprint, name_challenge_digest FROM deletion_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        (row.0.as_str(), row.1.as_str(), row.2, row.3, row.4, row.5),
        ("dispatch_pending", "requested", 1, false, 1, 10)
    );
    assert_eq!(row.6, space_request(&a, "del-a").fingerprint());
    assert_eq!(
        row.7.as_deref(),
        Some(platform::sha256_hex(a.name.as_bytes()).as_str())
    );
    let fence: (String, Option<Uuid>) = sqlx::query_as(
        "SELECT lifecycle_state, deletion_job_id FROM knowledge_spaces WHERE id = $1",
    )
    .bind(a.id)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(fence, ("deleting".into(), Some(job)));
    let invalidated: Option<String> = sqlx::query_scalar(
        "SELECT invalidation_reason FROM agent_workspace_snapshots WHERE knowledge_space_id = $1",
    )
    .bind(a.id)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        invalidated.as_deref(),
        Some("durable-deletion:knowledge_space")
    );
    let outbox: (String, i32, String, serde_json::Value, String) = sqlx::query_as(
        "SELECT idempotency_key, delivery_revision, status, payload, request_idempotency_key FROM deletion_outbox \
         WHERE deletion_job_id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(outbox.0, format!("deletion:{job}:1"));
    assert_eq!(
        (outbox.1, outbox.2.as_str(), outbox.4.as_str()),
        (1, "pending", "del-a")
    );
    assert_eq!(
        outbox.3,
        serde_json::json!({ "deletionJobId": job.to_string() })
    );

    let (state, _) = driver.finish(job, true).await;
    assert_eq!(state, "succeeded");
    assert_finished_clean(pool, job).await;
    let left = cat.count_owned(pool, Some(a.id), &a.docs).await;
    assert!(left.is_empty(), "rows of the space left: {left:?}");
    let named = cat.mentions(pool, &[a.id.to_string()]).await;
    assert!(named.is_empty(), "rows naming the space left: {named:?}");
    assert!(
        files_under(&fx.dir, &a.prefix).is_empty(),
        "objects of the space left"
    );
    assert_untouched(&fx, &cat, &[&b, &c], &before).await;
    // Secrets went through their port with their tenant, space and source; the items keep
    // only digests.
    let mut seen = recorder.secrets.lock().unwrap().clone();
    seen.sort();
    let mut want: Vec<SeenSecret> = a
        .sources
        .iter()
        .zip(&a.credentials)
        .map(|(s, c)| (a.tenant.clone(), a.id, Some(*s), c.clone()))
        .collect();
    want.sort();
    assert_eq!(seen, want);
    // The caches: the space's own prefixes and the platform's legacy global ones, not B's.
    let cache = recorder.cache.lock().unwrap().clone();
    assert_eq!(
        cache,
        BTreeSet::from([format!("space-cache:v2:evidence-bundle:space:{}:q1", b.id)])
    );
    let prefixes = recorder.prefixes.lock().unwrap().clone();
    assert!(prefixes.iter().all(|p| !p.contains(&b.id.to_string())));
    assert_eq!(
        item_kinds(pool, job).await,
        vec![
            ("object".into(), a_objects.len() as i64),
            ("secret_ref".into(), 2)
        ]
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_documents_are_deleted_one_bounded_page_per_step() {
    const DOCS: i64 = 10_000;
    let fx = SpaceFx::new("tenant-big", "big", "Big").await;
    let s = seed(&fx, "tenant-big", "big", "Big", 0, 0).await;
    let pool = fx.pool();
    let seeded = Instant::now();
    // Upload rows, parse artifacts and one node per document, as compile leaves them.
    let docs: Vec<(Uuid, String)> = sqlx::query_as(
        "INSERT INTO document_assets (id, knowledge_space_id, source_id, filename, mime_type, object_key, sha256, \
           size_bytes, version, parser_status, metadata, created_at) \
         SELECT d.id, $1, NULL, 'f' || d.g || '.md', 'text/markdown', \
           $3 || '/documents/' || d.id::text || '/f' || d.g || '.md', repeat('0', 64), 4, 1, 'parsed', \
           '{\"permissionScope\": []}', now() \
         FROM (SELECT gen_random_uuid() AS id, g FROM generate_series(1, $2) g) d \
         RETURNING id, object_key",
    )
    .bind(s.id)
    .bind(DOCS)
    .bind(&s.prefix)
    .fetch_all(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO parse_artifacts (id, document_asset_id, version, parser, content_type, artifact_hash, elements, \
           metadata, created_at) \
         SELECT gen_random_uuid(), id, 1, 'native-markdown', 'text', repeat('1', 64), '[]', '{}', now() \
         FROM document_assets WHERE knowledge_space_id = $1",
    )
    .bind(s.id)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO knowledge_nodes (id, knowledge_space_id, publication_generation_id, document_asset_id, \
           parse_artifact_id, kind, text, start_offset, end_offset, source_location, permission_scope, artifact_hash, metadata) \
         SELECT gen_random_uuid(), $1, NULL, pa.document_asset_id, pa.id, 'chunk', 'data', 0, 4, '{}', '[]', \
           pa.artifact_hash, '{}' \
         FROM parse_artifacts pa JOIN document_assets d ON d.id = pa.document_asset_id WHERE d.knowledge_space_id = $1",
    )
    .bind(s.id)
    .execute(pool)
    .await
    .unwrap();
    futures_util::stream::iter(docs.iter().map(|(_, key)| {
        let store = fx.store.clone();
        async move { store.put(key, Bytes::from_static(b"data")).await.unwrap() }
    }))
    .buffer_unordered(64)
    .collect::<Vec<()>>()
    .await;
    assert_eq!(files_under(&fx.dir, &s.prefix).len() as i64, DOCS);
    println!(
        "seeded {DOCS} documents with objects, artifacts and nodes in {:?}",
        seeded.elapsed()
    );

    let counting = Arc::new(Counting {
        inner: handler(&fx),
        steps: Mutex::new(BTreeMap::new()),
        time: Mutex::new(BTreeMap::new()),
    });
    let cfg = counting.inner.config().clone();
    let driver = Driver::new(&fx, counting.clone(), Budget::default()).await;
    let job = request(pool, &space_request(&s, "big")).await.unwrap();
    let started = Instant::now();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    let took = started.elapsed();
    assert_finished_clean(pool, job).await;
    let docs: Vec<Uuid> = docs.into_iter().map(|d| d.0).collect();
    let left = catalog(pool)
        .await
        .count_owned(pool, Some(s.id), &docs)
        .await;
    assert!(left.is_empty(), "{left:?}");
    assert!(files_under(&fx.dir, &s.prefix).is_empty());
    let steps = counting.steps.lock().unwrap().clone();
    let total: u64 = steps.values().sum();
    println!(
        "time in steps per checkpoint: {:?}",
        counting.time.lock().unwrap()
    );
    println!(
        "deleted a space of {DOCS} documents, objects, artifacts and nodes in {took:?}: {total} steps {steps:?}, \
         {} slices",
        driver.engine.counters.slices.load(Ordering::Relaxed)
    );
    // Every step holds at most one page: the inventory needs ≥ DOCS/page steps, the objects
    // ≥ DOCS/batch, the derived data ≥ 2·DOCS/page (nodes, artifacts), the primary rows
    // ≥ DOCS/page.
    let page = cfg.page_size as u64;
    let at = |cp: &str| steps.get(cp).copied().unwrap_or(0);
    assert!(at("quiescing") >= DOCS as u64 / page, "{steps:?}");
    assert!(
        at("deleting_objects") >= DOCS as u64 / cfg.item_batch as u64,
        "{steps:?}"
    );
    assert!(
        at("deleting_derived_data") >= 2 * DOCS as u64 / page,
        "{steps:?}"
    );
    assert!(
        at("deleting_primary_data") >= DOCS as u64 / page,
        "{steps:?}"
    );
    let items: i64 =
        sqlx::query_scalar("SELECT count(*) FROM deletion_job_items WHERE deletion_job_id = $1")
            .bind(job)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(items, DOCS);
    fx.cleanup().await;
}
