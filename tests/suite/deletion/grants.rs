//! Deletions under capability grants: recorded under the grant alone, refused or failed closed
//! when the grant is revoked, too narrow or its space fenced, and retried under their own grant.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_grant_authorized_document_deletion_succeeds_and_records_the_grant_alone() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 2).await;
    let pool = fx.pool();
    let grant = grant_for(&fx, &s, &["tenant:tenant-t"]).await;
    let doc = s.docs[1];
    let req = grant_request(&s, Target::Document { id: doc }, grant, "g1");
    let job = request_under_grant(pool, &req).await.unwrap();
    // The platform's columns under a grant: the grant, and no subject, snapshot, channel or key.
    type Cols = (
        Option<Uuid>,
        Option<String>,
        Option<Uuid>,
        Option<i32>,
        Option<String>,
        Option<Uuid>,
        String,
    );
    let cols: Cols =
        sqlx::query_as(
            "SELECT capability_grant_id, requested_by_subject_id, permission_snapshot_id, permission_snapshot_revision, \
               access_channel, api_key_id, request_fingerprint FROM deletion_jobs WHERE id = $1",
        )
        .bind(job)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(
        cols,
        (Some(grant), None, None, None, None, None, req.fingerprint())
    );
    // A replay is the same job; the same key under the owner's snapshot is another request.
    assert_eq!(request_under_grant(pool, &req).await.unwrap(), job);
    assert!(matches!(
        request(
            pool,
            &target_request(&s, Target::Document { id: doc }, "g1")
        )
        .await,
        Err(RequestError::IdempotencyConflict { .. })
    ));
    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    assert!(!served(pool, &s).await.contains(&doc));
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deletion_whose_grant_was_revoked_before_it_ran_fails_closed_and_writes_nothing_else() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 2).await;
    let pool = fx.pool();
    let grant = grant_for(&fx, &s, &["tenant:tenant-t"]).await;
    let doc = s.docs[0];
    let job = request_under_grant(
        pool,
        &grant_request(&s, Target::Document { id: doc }, grant, "r1"),
    )
    .await
    .unwrap();
    let mut c = conn(pool).await;
    platform::revoke_capability_grant(&mut c, &s.tenant, s.id, grant)
        .await
        .unwrap();
    drop(c);
    let cat = catalog(pool).await;
    let rows = rows_but_the_jobs(&cat, pool, s.id).await;
    let objects = files_under(&fx.dir, &s.prefix);
    let items = items_of(pool, job).await;
    let served_before = served(pool, &s).await;

    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    driver.finish(job, true).await;
    assert_eq!(closed(pool, job).await, failed_closed_at("requested"));
    // Nothing else: the target and every row of the space as they were (the document still
    // fenced `deleting`), its items untouched, its objects and the head as they were.
    assert_eq!(rows_but_the_jobs(&cat, pool, s.id).await, rows);
    let state: String =
        sqlx::query_scalar("SELECT lifecycle_state FROM document_assets WHERE id = $1")
            .bind(doc)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(state, "deleting");
    assert_eq!(items_of(pool, job).await, items);
    assert_eq!(items, vec![(0, "pending".into(), true)]);
    assert_eq!(files_under(&fx.dir, &s.prefix), objects);
    assert_eq!(served(pool, &s).await, served_before);
    // A failed job still holds its target.
    assert!(matches!(
        request(
            pool,
            &target_request(&s, Target::Document { id: doc }, "r2")
        )
        .await,
        Err(RequestError::TargetBusy { .. })
    ));
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deletion_in_a_space_fenced_mid_way_fails_closed_at_its_next_step() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 2).await;
    let pool = fx.pool();
    let grant = grant_for(&fx, &s, &["tenant:tenant-t"]).await;
    let doc = s.docs[1];
    let job = request_under_grant(
        pool,
        &grant_request(&s, Target::Document { id: doc }, grant, "f1"),
    )
    .await
    .unwrap();
    // One step per slice, so the fence lands between two checkpoints.
    let driver = Driver::new(
        &fx,
        Arc::new(handler(&fx)),
        Budget {
            max_steps: 1,
            ..Budget::default()
        },
    )
    .await;
    for _ in 0..500 {
        if job_state(pool, job).await.1 == "deleting_objects" {
            break;
        }
        skip_wait(pool, job).await;
        driver.turn().await;
    }
    assert_eq!(
        job_state(pool, job).await,
        ("queued".into(), "deleting_objects".into())
    );
    let mut c = conn(pool).await;
    platform::fence_capability_space(&mut c, &s.tenant, s.id)
        .await
        .unwrap();
    drop(c);
    let cat = catalog(pool).await;
    let rows = rows_but_the_jobs(&cat, pool, s.id).await;
    let objects = files_under(&fx.dir, &s.prefix);
    let items = items_of(pool, job).await;
    assert!(
        items.len() > 1 && items.iter().all(|i| i.1 == "pending"),
        "{items:?}"
    );

    driver.finish(job, true).await;
    assert_eq!(
        closed(pool, job).await,
        failed_closed_at("deleting_objects")
    );
    assert_eq!(items_of(pool, job).await, items, "no item was erased");
    assert_eq!(files_under(&fx.dir, &s.prefix), objects);
    assert_eq!(rows_but_the_jobs(&cat, pool, s.id).await, rows);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_under_a_revoked_or_too_narrow_grant_is_refused_and_writes_nothing() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 1, 2).await;
    let pool = fx.pool();
    let source = s.sources[0];
    sqlx::query("UPDATE sources SET permission_scope = '[\"team:red\"]' WHERE id = $1")
        .bind(source)
        .execute(pool)
        .await
        .unwrap();
    let blue = grant_for(&fx, &s, &["team:blue"]).await;
    let revoked = grant_for(&fx, &s, &["team:red", "team:blue"]).await;
    let mut c = conn(pool).await;
    platform::revoke_capability_grant(&mut c, &s.tenant, s.id, revoked)
        .await
        .unwrap();
    drop(c);
    let elsewhere = seed(&fx, "tenant-t", "other", "Other", 0, 0).await;
    let foreign = grant_for(&fx, &elsewhere, &["team:red"]).await;
    let cat = catalog(pool).await;
    let rows = rows_but_the_jobs(&cat, pool, s.id).await;

    // A grant that does not admit the source's permission scope may not delete the source.
    let source_target = || Target::Source {
        id: source,
        mode: SourceMode::Cascade,
    };
    let err = request_under_grant(pool, &grant_request(&s, source_target(), blue, "n1"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, RequestError::Permission(m) if m.contains("permission scope")),
        "{err}"
    );
    // A revoked grant may delete nothing; nor may a grant of another space.
    for (target, grant) in [
        (Target::Document { id: s.docs[0] }, revoked),
        (source_target(), revoked),
        (
            Target::Space {
                confirm_name: s.name.clone(),
            },
            revoked,
        ),
        (Target::Document { id: s.docs[0] }, foreign),
    ] {
        let err = request_under_grant(pool, &grant_request(&s, target.clone(), grant, "n2"))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, RequestError::Permission(m) if m.contains("capability grant refused")),
            "{target:?}: {err}"
        );
    }
    // The CLI says so in one line, and refuses a request naming two authorities or none.
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"))
            .args(args)
            .env("DATABASE_URL", &fx.env.url)
            .env("KFS_OBJECT_STORE", &fx.store_url)
            .output()
            .unwrap()
    };
    let (doc, space, revoked, snap) = (
        s.docs[0].to_string(),
        s.id.to_string(),
        revoked.to_string(),
        s.owner_snapshot.to_string(),
    );
    let base = [
        "delete", "document", &doc, "--space", &space, "--tenant", &s.tenant,
    ];
    for extra in [
        vec!["--grant", revoked.as_str()],
        vec![
            "--grant",
            revoked.as_str(),
            "--as",
            OWNER,
            "--snapshot",
            &snap,
        ],
        vec![],
    ] {
        let out = run(&[&base[..], &extra[..]].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    // Nothing was written: no job, no tombstone, no fence, no invalidated workspace.
    for table in ["deletion_jobs", "deletion_tombstones"] {
        let n = count(
            pool,
            &format!("SELECT count(*) FROM {table} WHERE knowledge_space_id = $1"),
            s.id,
        )
        .await;
        assert_eq!(n, 0, "{table}");
    }
    assert_eq!(rows_but_the_jobs(&cat, pool, s.id).await, rows);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_grant_deletion_is_retried_under_its_own_grant_only_and_audited_as_such() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 2).await;
    let pool = fx.pool();
    let flaky = Arc::new(Flaky {
        inner: fx.store.clone(),
        broken: AtomicBool::new(true),
        calls: AtomicU64::new(0),
    });
    let h = handler(&fx)
        .with_objects(flaky.clone())
        .with_config(DeletionConfig {
            item_max_attempts: 2,
            ..fast_config()
        });
    let driver = Driver::new(&fx, Arc::new(h), Budget::default()).await;
    let grant = grant_for(&fx, &s, &["tenant:tenant-t"]).await;
    let job = request_under_grant(
        pool,
        &grant_request(&s, Target::Document { id: s.docs[1] }, grant, "t1"),
    )
    .await
    .unwrap();
    sqlx::query("UPDATE deletion_job_items SET max_attempts = 2 WHERE deletion_job_id = $1")
        .bind(job)
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(driver.finish(job, true).await.0, "failed");
    let retry = |grant: Uuid, key: &str| {
        let pool = pool.clone();
        let req = GrantRetryRequest {
            job_id: job,
            capability_grant_id: grant,
            idempotency_key: key.into(),
        };
        async move {
            let mut tx = pool.begin().await.unwrap();
            let r = retry_deletion_under_grant(&mut tx, &req).await;
            tx.commit().await.unwrap();
            r
        }
    };
    // Another grant is not the requester; nor is the owner claiming to be it under a snapshot.
    let other = grant_for(&fx, &s, &["tenant:tenant-t"]).await;
    assert!(matches!(
        retry(other, "t2").await,
        Err(RequestError::RetryRefused(_))
    ));
    let mut tx = pool.begin().await.unwrap();
    let as_owner = retry_deletion(
        &mut tx,
        &RetryRequest {
            job_id: job,
            actor_subject_id: OWNER.into(),
            permission_snapshot_id: s.owner_snapshot,
            access_channel: "interactive".into(),
            authority: RetryAuthority::OriginalRequester,
            idempotency_key: "t3".into(),
        },
    )
    .await;
    tx.commit().await.unwrap();
    assert!(
        matches!(as_owner, Err(RequestError::RetryRefused(_))),
        "{as_owner:?}"
    );
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM deletion_retry_audits WHERE deletion_job_id = $1",
            job
        )
        .await,
        0
    );

    flaky.broken.store(false, Ordering::SeqCst);
    let r = retry(grant, "t4").await.unwrap();
    assert!(r.created);
    assert!(!retry(grant, "t4").await.unwrap().created, "a replay");
    type Audit = (
        String,
        Option<String>,
        Option<Uuid>,
        Option<i32>,
        Option<String>,
        Option<Uuid>,
        Option<Uuid>,
    );
    let audit: Audit =
        sqlx::query_as(
            "SELECT retry_authority, actor_subject_id, permission_snapshot_id, permission_snapshot_revision, \
               access_channel, api_key_id, capability_grant_id FROM deletion_retry_audits WHERE deletion_job_id = $1",
        )
        .bind(job)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(
        audit,
        (
            "original_requester".into(),
            None,
            None,
            None,
            None,
            None,
            Some(grant)
        )
    );
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    fx.cleanup().await;
}
