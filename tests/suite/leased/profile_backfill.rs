//! Profile backfills: discovery freezes the manifest's profiles, the backfill installs revision and
//! head as the platform does or refuses with the platform's codes and writes nothing, and it locks
//! its space without holding up a compile request for it.

use super::*;

/// A row as JSON, without the columns named in `drop`.
async fn row_json(pool: &PgPool, table: &str, args: (Uuid, &str), drop: &[&str]) -> Value {
    let mut v: Value = sqlx::query_scalar(&format!(
        "SELECT to_jsonb(t) FROM {table} t WHERE t.knowledge_space_id = $1 AND t.kind = $2"
    ))
    .bind(args.0)
    .bind(args.1)
    .fetch_one(pool)
    .await
    .unwrap();
    for k in drop {
        v.as_object_mut().unwrap().remove(*k);
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn backfill_discovers_the_manifest_profiles_and_installs_revision_and_head_as_the_platform_does(
) {
    let fx = Fx::bare().await;
    let version = set_manifest_keys(
        fx.pool(),
        fx.space,
        json!({ "__knowledgeFsEmbeddingProfile": embedding_profile(),
                "__knowledgeFsRetrievalProfile": retrieval_profile(), "__knowledgeFsEmbeddingProfileFrozenAt": "x" }),
    )
    .await;
    // Discovery freezes each profile key once per manifest version and digest.
    let mut conn = fx.pool().acquire().await.unwrap();
    let page = backfill::discover(&mut conn, None, 10, 5).await.unwrap();
    assert_eq!(
        (page.scanned, page.created, page.next),
        (1, 2, Some(fx.space))
    );
    assert_eq!(
        backfill::discover(&mut conn, None, 10, 5)
            .await
            .unwrap()
            .created,
        0
    );
    assert_eq!(
        backfill::discover(&mut conn, Some(fx.space), 10, 5)
            .await
            .unwrap()
            .scanned,
        0
    );
    drop(conn);
    let rows = backfills(fx.pool(), fx.space).await;
    assert_eq!(
        rows.iter()
            .map(|r| (r.0.as_str(), r.1, r.3.as_str()))
            .collect::<Vec<_>>(),
        [
            ("embedding", version, "queued"),
            ("retrieval", version, "queued")
        ]
    );
    let queued = row_json(
        fx.pool(),
        "knowledge_space_profile_backfills",
        (fx.space, "embedding"),
        &["id", "created_at", "updated_at"],
    )
    .await;
    assert_eq!(
        queued,
        json!({ "tenant_id": TENANT, "knowledge_space_id": fx.space, "kind": "embedding", "source_manifest_version": version,
                "source_snapshot": embedding_profile(), "source_snapshot_digest": backfill::walk::digest(&embedding_profile()),
                "run_state": "queued", "execution_attempts": 0, "max_execution_attempts": 5, "worker_id": null,
                "lease_token": null, "lease_expires_at": null, "heartbeat_at": null, "row_version": 1,
                "last_error_code": null, "last_error_message": null, "completed_at": null })
    );

    let kind = BackfillKind::default();
    assert_eq!(run_backfills(fx.pool(), &kind).await, 2);
    for (kind_name, _, id, state, err) in backfills(fx.pool(), fx.space).await {
        assert_eq!((state.as_str(), err), ("succeeded", None), "{kind_name}");
        let (_, attempts, _, _, token) = backfill_row(fx.pool(), id).await;
        assert_eq!((attempts, token), (1, None));
        // Every state written: queued → running → running (the step's fence) → succeeded.
        let states = fx.states(id).await;
        let runs: Vec<&str> = states.iter().map(|s| s.0.as_str()).collect();
        assert_eq!(
            runs,
            ["queued", "running", "running", "succeeded"],
            "{states:?}"
        );
        assert!(states.windows(2).all(|w| w[1].2 > w[0].2));
    }

    // The revision and head rows, every column as the platform's process writes them, all in
    // the transaction that ended the backfill.
    for (kind_name, source) in [
        ("embedding", embedding_profile()),
        ("retrieval", retrieval_profile()),
    ] {
        let (discovered_at, revision_id, one_tx): (String, Uuid, bool) = sqlx::query_as(
            "SELECT to_char(b.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'), r.id, r.created_at = b.completed_at AND r.updated_at = b.completed_at \
               AND r.activated_at = b.completed_at AND h.created_at = b.completed_at AND h.updated_at = b.completed_at \
             FROM knowledge_space_profile_backfills b \
             JOIN knowledge_space_profile_revisions r ON r.knowledge_space_id = b.knowledge_space_id AND r.kind = b.kind \
             JOIN knowledge_space_profile_heads h ON h.profile_revision_id = r.id \
             WHERE b.knowledge_space_id = $1 AND b.kind = $2",
        )
        .bind(fx.space)
        .bind(kind_name)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert!(
            one_tx,
            "{kind_name}: revision, head and success share one transaction's time"
        );
        let capability = profile::derive_capability(kind_name, &source, &discovered_at).unwrap();
        let (model, vsid, dim) = if kind_name == "embedding" {
            (
                "text-embedding-3-small",
                source["vectorSpaceId"].clone(),
                json!(8),
            )
        } else {
            ("gpt-4o-mini", Value::Null, Value::Null)
        };
        let drop = ["id", "created_at", "updated_at", "activated_at"];
        assert_eq!(
            row_json(
                fx.pool(),
                "knowledge_space_profile_revisions",
                (fx.space, kind_name),
                &drop
            )
            .await,
            json!({ "tenant_id": TENANT, "knowledge_space_id": fx.space, "kind": kind_name, "revision": 1, "state": "active",
                    "snapshot": source, "snapshot_digest": backfill::walk::digest(&source),
                    "capability_snapshot": capability, "capability_snapshot_digest": backfill::walk::digest(&capability),
                    "plugin_id": "langgenius/openai", "provider": "openai", "model": model, "vector_space_id": vsid,
                    "dimension": dim, "created_by_subject_id": "system:legacy-profile-backfill", "failure_code": null,
                    "failure_message": null, "superseded_at": null, "failed_at": null }),
            "{kind_name}"
        );
        assert_eq!(
            row_json(
                fx.pool(),
                "knowledge_space_profile_heads",
                (fx.space, kind_name),
                &drop
            )
            .await,
            json!({ "tenant_id": TENANT, "knowledge_space_id": fx.space, "kind": kind_name,
                    "profile_revision_id": revision_id, "active_revision": 1, "row_version": 1 }),
            "{kind_name}"
        );
    }

    // A repeated process (the row queued again) finds its own head and succeeds without writing.
    let (_, _, emb, _, _) = backfills(fx.pool(), fx.space).await.remove(0);
    sqlx::query(
        "UPDATE knowledge_space_profile_backfills SET run_state = 'queued', completed_at = NULL, updated_at = now() - interval '1 hour' WHERE id = $1",
    )
    .bind(emb)
    .execute(fx.pool())
    .await
    .unwrap();
    assert_eq!(run_backfills(fx.pool(), &kind).await, 1);
    assert_eq!(backfill_row(fx.pool(), emb).await.0, "succeeded");
    let revisions: i64 =
        sqlx::query_scalar("SELECT count(*) FROM knowledge_space_profile_revisions")
            .fetch_one(fx.pool())
            .await
            .unwrap();
    assert_eq!(revisions, 2);
    // And compiles now embed with the installed profile (the space has a head of each kind).
    let mut conn = fx.pool().acquire().await.unwrap();
    assert_eq!(
        backfill::discover(&mut conn, None, 10, 5)
            .await
            .unwrap()
            .scanned,
        0
    );
    fx.cleanup().await;
}

/// A backfill's kind, run state and error code.
type Fill<'a> = (&'a str, &'a str, Option<&'a str>);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn backfill_refuses_with_the_platforms_codes_and_writes_nothing() {
    let fx = Fx::bare().await;
    let pool = fx.pool();
    let emb = |v: Value| json!({ "__knowledgeFsEmbeddingProfile": v });
    let ret = json!({ "__knowledgeFsRetrievalProfile": retrieval_profile() });
    let mut conn = pool.acquire().await.unwrap();

    // The manifest moved on after discovery: the stale snapshot fails, the new version's succeeds.
    let moved = new_space(pool, "moved").await;
    set_manifest_keys(pool, moved, ret.clone()).await;
    backfill::discover(&mut conn, None, 100, 5).await.unwrap();
    set_manifest_keys(pool, moved, json!({})).await;
    // The manifest's profile is no longer an object (no version change): nothing new is discovered.
    let replaced = new_space(pool, "replaced").await;
    set_manifest_keys(pool, replaced, ret.clone()).await;
    // The stored snapshot no longer hashes to its digest.
    let tampered = new_space(pool, "tampered").await;
    set_manifest_keys(pool, tampered, ret.clone()).await;
    // A different head exists (the platform's own activation, with its own capability).
    let headed = new_space(pool, "headed").await;
    platform::activate_embedding_profile(
        &mut conn,
        TENANT,
        headed,
        "text-embedding-3-small",
        "openai",
        8,
    )
    .await
    .unwrap();
    // A revision of the same number exists without a head.
    let orphan = new_space(pool, "orphan").await;
    platform::activate_embedding_profile(
        &mut conn,
        TENANT,
        orphan,
        "text-embedding-3-small",
        "openai",
        8,
    )
    .await
    .unwrap();
    sqlx::query("DELETE FROM knowledge_space_profile_heads WHERE knowledge_space_id = $1")
        .bind(orphan)
        .execute(pool)
        .await
        .unwrap();
    // No manifest, a space being deleted, and profiles the platform rejects.
    let unmanifested = new_space(pool, "unmanifested").await;
    set_manifest_keys(pool, unmanifested, ret.clone()).await;
    let deleting = new_space(pool, "deleting").await;
    set_manifest_keys(pool, deleting, ret.clone()).await;
    let undimensioned = new_space(pool, "undimensioned").await;
    let mut no_dim = embedding_profile();
    no_dim.as_object_mut().unwrap().remove("dimension");
    set_manifest_keys(pool, undimensioned, emb(no_dim)).await;
    let unproven = new_space(pool, "unproven").await;
    let mut other_vsid = embedding_profile();
    other_vsid["vectorSpaceId"] = json!(format!("embedding-space-sha256:{}", "a".repeat(64)));
    set_manifest_keys(pool, unproven, emb(other_vsid)).await;
    let malformed = new_space(pool, "malformed").await;
    let mut extra = embedding_profile();
    extra["capabilities"] = json!({"batch": true});
    set_manifest_keys(pool, malformed, emb(extra)).await;
    backfill::discover(&mut conn, None, 100, 5).await.unwrap();

    set_manifest_keys(
        pool,
        replaced,
        json!({ "__knowledgeFsRetrievalProfile": "gone" }),
    )
    .await;
    // (set_manifest_keys bumps the version; put it back so only the profile changed.)
    sqlx::query("UPDATE knowledge_space_manifests SET manifest_version = manifest_version - 1 WHERE knowledge_space_id = $1")
        .bind(replaced)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("UPDATE knowledge_space_profile_backfills SET source_snapshot = source_snapshot || '{\"topK\": 9}' WHERE knowledge_space_id = $1")
        .bind(tampered)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM knowledge_space_manifests WHERE knowledge_space_id = $1")
        .bind(unmanifested)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("UPDATE knowledge_spaces SET lifecycle_state = 'deleting', deletion_job_id = gen_random_uuid(), deleting_at = now() WHERE id = $1")
        .bind(deleting)
        .execute(pool)
        .await
        .unwrap();
    drop(conn);

    run_backfills(pool, &BackfillKind::default()).await;
    let want: Vec<(Uuid, Vec<Fill>)> = vec![
        (
            moved,
            vec![
                ("retrieval", "failed", Some("LEGACY_PROFILE_SOURCE_CHANGED")),
                ("retrieval", "succeeded", None),
            ],
        ),
        (
            replaced,
            vec![("retrieval", "failed", Some("LEGACY_PROFILE_SOURCE_CHANGED"))],
        ),
        (
            tampered,
            vec![("retrieval", "failed", Some("LEGACY_PROFILE_SOURCE_CHANGED"))],
        ),
        (
            headed,
            vec![("embedding", "failed", Some("PROFILE_HEAD_ALREADY_EXISTS"))],
        ),
        (
            orphan,
            vec![(
                "embedding",
                "failed",
                Some("PROFILE_REVISION_ALREADY_EXISTS"),
            )],
        ),
        (
            unmanifested,
            vec![("retrieval", "failed", Some("LEGACY_MANIFEST_NOT_FOUND"))],
        ),
        (
            deleting,
            vec![("retrieval", "failed", Some("KNOWLEDGE_SPACE_NOT_WRITABLE"))],
        ),
        (
            undimensioned,
            vec![("embedding", "failed", Some("LEGACY_PROFILE_INVALID"))],
        ),
        (
            unproven,
            vec![("embedding", "failed", Some("LEGACY_PROFILE_INVALID"))],
        ),
        (
            malformed,
            vec![(
                "embedding",
                "failed",
                Some("PROFILE_BACKFILL_CAPABILITY_INVALID"),
            )],
        ),
    ];
    for (space, rows) in want {
        let got = backfills(pool, space).await;
        let got: Vec<Fill> = got
            .iter()
            .map(|r| (r.0.as_str(), r.3.as_str(), r.4.as_deref()))
            .collect();
        assert_eq!(got, rows, "space {space}");
    }
    let failed: Vec<(Option<Uuid>, Option<String>, bool)> = sqlx::query_as(
        "SELECT lease_token, last_error_message, completed_at IS NOT NULL FROM knowledge_space_profile_backfills \
         WHERE run_state = 'failed'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(failed.len(), 10);
    assert!(failed
        .iter()
        .all(|(t, m, done)| t.is_none() && m.is_some() && *done));
    // Refusals write no revision: only the moved space's fresh profile and the fixtures' own.
    let revisions: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT knowledge_space_id, created_by_subject_id::text FROM knowledge_space_profile_revisions ORDER BY 2, 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let backfilled: Vec<Uuid> = revisions
        .iter()
        .filter(|r| r.1 == "system:legacy-profile-backfill")
        .map(|r| r.0)
        .collect();
    assert_eq!(backfilled, [moved]);
    assert_eq!(revisions.len(), 3);

    // The operator's retry queues the latest failed backfill of a kind again, attempts reset.
    let mut conn = pool.acquire().await.unwrap();
    let again = backfill::retry(&mut conn, TENANT, undimensioned, "embedding")
        .await
        .unwrap();
    assert!(again.is_some());
    assert_eq!(
        backfill::retry(&mut conn, TENANT, moved, "retrieval")
            .await
            .unwrap(),
        None,
        "its latest succeeded"
    );
    let (state, attempts, _, err, _) = backfill_row(pool, again.unwrap()).await;
    assert_eq!((state.as_str(), attempts, err), ("queued", 0, None));
    fx.cleanup().await;
}

/// A profile backfill holds its space's row while it reads the space's heads. It locks it
/// against the space's deletion and other writers of the row (`FOR NO KEY UPDATE`), not against
/// every insert that references the space: a compile request's insert, whose foreign key check
/// takes `KEY SHARE` on the space, goes on meanwhile. Under `FOR UPDATE` the platform's request
/// waited for the backfill while holding the profile heads the backfill was about to lock, and
/// Postgres broke the deadlock by failing the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_holding_its_space_lets_a_compile_request_for_it_insert_meanwhile() {
    let fx = Fx::new().await;
    let pool = fx.pool().clone();
    let doc = fx.add("guide.md", "text/markdown", GUIDE_MD).await;
    // Holds the backfill once it has locked the space: its next lock (on `deletion_jobs`, the
    // platform's deletion admission) waits for this table lock, which plain reads pass.
    let mut gate = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE deletion_jobs IN EXCLUSIVE MODE")
        .execute(&mut *gate)
        .await
        .unwrap();
    let space = fx.space;
    let backfill = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let mut conn = pool.acquire().await.unwrap();
            backfill::binding::bind_current_published(&mut conn, TENANT, space).await
        })
    };
    let waiting = fx
        .env
        .wait_until(Duration::from_secs(20), || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database() \
                   AND wait_event_type = 'Lock' AND query LIKE '%FROM deletion_jobs%')",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
        })
        .await;
    assert!(waiting, "the backfill never reached its deletion admission");
    let mut request = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '5s'")
        .execute(&mut *request)
        .await
        .unwrap();
    let requested = compile::request(&mut request, doc, compile::RequestOptions::default()).await;
    assert!(
        requested.is_ok(),
        "a compile request waited for the backfill's lock on its space: {requested:?}"
    );
    request.commit().await.unwrap();
    gate.rollback().await.unwrap();
    let reconciled = tokio::time::timeout(Duration::from_secs(30), backfill)
        .await
        .expect("the backfill hung")
        .unwrap();
    assert!(reconciled.is_ok(), "{reconciled:?}");
    fx.cleanup().await;
}
