//! Publication bindings of legacy heads: a head published before its profiles gets one
//! legacy-bootstrap binding and becomes resolvable, a bound head is left alone, and a head whose
//! dense projections do not close over the profile's vector space is not bound.

use super::*;

/// The platform's published-runtime-snapshot condition, written from its resolver's one
/// SELECT: the head's publication is `published` and has an activated binding of its
/// fingerprint whose retrieval profile is the current active retrieval head, and either neither
/// the binding nor the space has an embedding profile, or the binding names exactly the current
/// embedding head, its digest and its vector space. Without a row, the platform's queries,
/// retrieval tests and research tasks answer 503.
const RUNTIME_SNAPSHOT: &str = r#"
SELECT count(*) FROM projection_set_publication_heads ph
JOIN projection_set_publications pub ON pub.tenant_id = ph.tenant_id
  AND pub.knowledge_space_id = ph.knowledge_space_id AND pub.id = ph.publication_id AND pub.status = 'published'
JOIN knowledge_space_profile_publication_bindings b ON b.tenant_id = ph.tenant_id
  AND b.knowledge_space_id = ph.knowledge_space_id AND b.publication_id = pub.id
  AND b.publication_fingerprint = pub.fingerprint AND b.activated_at IS NOT NULL
JOIN knowledge_space_profile_heads rh ON rh.tenant_id = ph.tenant_id AND rh.knowledge_space_id = ph.knowledge_space_id
  AND rh.kind = 'retrieval' AND rh.profile_revision_id = b.retrieval_profile_revision_id
  AND rh.active_revision = b.retrieval_profile_revision
JOIN knowledge_space_profile_revisions rr ON rr.id = rh.profile_revision_id AND rr.tenant_id = rh.tenant_id
  AND rr.knowledge_space_id = rh.knowledge_space_id AND rr.kind = rh.kind AND rr.revision = rh.active_revision
  AND rr.snapshot_digest = b.retrieval_profile_snapshot_digest AND rr.state = 'active'
LEFT JOIN knowledge_space_profile_heads eh ON eh.tenant_id = ph.tenant_id
  AND eh.knowledge_space_id = ph.knowledge_space_id AND eh.kind = 'embedding'
LEFT JOIN knowledge_space_profile_revisions er ON er.id = eh.profile_revision_id AND er.tenant_id = eh.tenant_id
  AND er.knowledge_space_id = eh.knowledge_space_id AND er.kind = eh.kind AND er.revision = eh.active_revision
  AND er.state = 'active'
WHERE ph.tenant_id = $1 AND ph.knowledge_space_id = $2
  AND ((b.embedding_profile_revision_id IS NULL AND b.embedding_profile_revision IS NULL
        AND b.embedding_profile_snapshot_digest IS NULL AND b.vector_space_id IS NULL
        AND eh.profile_revision_id IS NULL AND er.id IS NULL)
    OR (b.embedding_profile_revision_id IS NOT NULL AND eh.profile_revision_id = b.embedding_profile_revision_id
        AND eh.active_revision = b.embedding_profile_revision AND er.id = b.embedding_profile_revision_id
        AND er.snapshot_digest = b.embedding_profile_snapshot_digest AND er.vector_space_id = b.vector_space_id))"#;

/// Whether the platform's readers can resolve the space's published runtime snapshot.
async fn resolvable(pool: &PgPool, space: Uuid) -> bool {
    let n: i64 = sqlx::query_scalar(RUNTIME_SNAPSHOT)
        .bind(TENANT)
        .bind(space)
        .fetch_one(pool)
        .await
        .unwrap();
    n == 1
}

/// The space's publication bindings, every column, oldest first.
async fn bindings(pool: &PgPool, space: Uuid) -> Vec<Value> {
    sqlx::query_scalar(
        "SELECT to_jsonb(b) FROM knowledge_space_profile_publication_bindings b \
         WHERE b.knowledge_space_id = $1 ORDER BY b.created_at, b.id",
    )
    .bind(space)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The space's current profile head of `kind`: its revision's id, number, digest and vector
/// space.
async fn current_profile(
    pool: &PgPool,
    space: Uuid,
    kind: &str,
) -> (Uuid, i32, String, Option<String>) {
    sqlx::query_as(
        "SELECT r.id, r.revision, r.snapshot_digest::text, r.vector_space_id::text \
         FROM knowledge_space_profile_heads h JOIN knowledge_space_profile_revisions r ON r.id = h.profile_revision_id \
         WHERE h.knowledge_space_id = $1 AND h.kind = $2",
    )
    .bind(space)
    .bind(kind)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// One tick on a fresh cursor: (scanned, created, bindings reconciled, binding failed).
async fn tick(pool: &PgPool) -> (usize, usize, usize, usize) {
    let mut conn = pool.acquire().await.unwrap();
    let t = backfill::tick(&mut conn, None, 100, 5).await.unwrap();
    (
        t.discovered.scanned,
        t.discovered.created,
        t.bindings_reconciled,
        t.binding_failed,
    )
}

async fn bind_directly(
    pool: &PgPool,
    space: Uuid,
) -> Result<backfill::binding::Reconciled, &'static str> {
    let mut conn = pool.acquire().await.unwrap();
    backfill::binding::bind_current_published(&mut conn, TENANT, space)
        .await
        .unwrap()
        .map_err(|r| r.code)
}

/// A legacy space: its head was compiled (with dense vectors in the manifest embedding
/// profile's vector space) before 0018, so it has the manifest's profiles but no profile head,
/// no profile revision and no binding. Returns the head's publication.
///
/// Compile now runs only under profile heads and its publish binds the head, so the head is
/// compiled under the space's profiles and then put back into the state a space that predates
/// 0018/0019 is in: the publish's `content-publication` binding deleted, the attempt's frozen
/// profile tuple cleared (the eight columns writers before 0019 left NULL), the profile heads
/// and revisions deleted, and the profiles left only in the manifest keys a 0018-era API wrote.
async fn legacy_head(fx: &Fx) -> Uuid {
    let mut conn = fx.pool().acquire().await.unwrap();
    platform::activate_embedding_profile(
        &mut conn,
        TENANT,
        fx.space,
        "text-embedding-3-small",
        "openai",
        8,
    )
    .await
    .unwrap();
    drop(conn);
    let doc = fx.add("guide.md", "text/markdown", GUIDE_MD).await;
    fx.compile(doc).await;
    let publication = fx.head().await.unwrap().publication_id;
    assert_eq!(
        bindings(fx.pool(), fx.space).await.len(),
        1,
        "the publish bound its head"
    );
    for sql in [
        "DELETE FROM knowledge_space_profile_publication_bindings WHERE knowledge_space_id = $1",
        "UPDATE document_compilation_attempts SET embedding_profile_kind = NULL, \
           embedding_profile_revision_id = NULL, embedding_profile_revision = NULL, \
           embedding_profile_snapshot_digest = NULL, retrieval_profile_kind = NULL, \
           retrieval_profile_revision_id = NULL, retrieval_profile_revision = NULL, \
           retrieval_profile_snapshot_digest = NULL WHERE knowledge_space_id = $1",
        "DELETE FROM knowledge_space_profile_heads WHERE knowledge_space_id = $1",
        "DELETE FROM knowledge_space_profile_revisions WHERE knowledge_space_id = $1",
    ] {
        sqlx::query(sql)
            .bind(fx.space)
            .execute(fx.pool())
            .await
            .unwrap();
    }
    set_manifest_keys(
        fx.pool(),
        fx.space,
        json!({ "__knowledgeFsEmbeddingProfile": embedding_profile(),
                "__knowledgeFsRetrievalProfile": retrieval_profile() }),
    )
    .await;
    assert!(bindings(fx.pool(), fx.space).await.is_empty());
    assert_eq!(fx.head().await.unwrap().publication_id, publication);
    publication
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_head_published_before_its_profiles_gets_one_legacy_bootstrap_binding_and_becomes_resolvable(
) {
    let fx = Fx::new().await;
    let pool = fx.pool();
    let publication = legacy_head(&fx).await;
    assert!(!resolvable(pool, fx.space).await);

    // The first ticks find the profile heads missing (not ready: neither counted); the tick
    // after the backfills installed them binds the head.
    assert_eq!(run_backfills(pool, &BackfillKind::default()).await, 2);
    let rows = bindings(pool, fx.space).await;
    assert_eq!(rows.len(), 1, "{rows:#?}");
    let mut row = rows[0].clone();
    let fingerprint: String = sqlx::query_scalar(
        "SELECT fingerprint::text FROM projection_set_publications WHERE id = $1",
    )
    .bind(publication)
    .fetch_one(pool)
    .await
    .unwrap();
    let (e_id, e_rev, e_digest, e_vsid) = current_profile(pool, fx.space, "embedding").await;
    let (r_id, r_rev, r_digest, _) = current_profile(pool, fx.space, "retrieval").await;
    assert_eq!(
        e_vsid.as_deref(),
        embedding_profile()["vectorSpaceId"].as_str()
    );
    let o = row.as_object_mut().unwrap();
    let id = o.remove("id").unwrap();
    assert_ne!(id, json!(publication), "a random id, not the publication's");
    let (created, activated) = (
        o.remove("created_at").unwrap(),
        o.remove("activated_at").unwrap(),
    );
    assert_eq!(created, activated);
    assert_eq!(
        row,
        json!({ "tenant_id": TENANT, "knowledge_space_id": fx.space, "changed_kind": "bootstrap",
                "binding_reason": "legacy-bootstrap", "embedding_profile_kind": "embedding",
                "embedding_profile_revision_id": e_id, "embedding_profile_revision": e_rev,
                "embedding_profile_snapshot_digest": e_digest, "retrieval_profile_kind": "retrieval",
                "retrieval_profile_revision_id": r_id, "retrieval_profile_revision": r_rev,
                "retrieval_profile_snapshot_digest": r_digest, "vector_space_id": e_vsid,
                "publication_id": publication, "publication_fingerprint": fingerprint })
    );
    assert!(
        resolvable(pool, fx.space).await,
        "the platform's readers now resolve the head"
    );

    // Again: discovery no longer selects the space, and a direct reconciliation keeps the row.
    assert_eq!(tick(pool).await, (0, 0, 0, 0));
    assert_eq!(run_backfills(pool, &BackfillKind::default()).await, 0);
    assert_eq!(
        bind_directly(pool, fx.space).await,
        Ok(backfill::binding::Reconciled::Kept)
    );
    assert_eq!(
        bindings(pool, fx.space).await,
        rows,
        "nothing more was written"
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_head_that_already_has_a_binding_is_left_alone() {
    // The space's initial retrieval profile and an embedding profile, then a compile: its
    // publish writes the head's `content-publication` binding.
    let fx = Fx::new().await;
    let pool = fx.pool();
    let mut conn = pool.acquire().await.unwrap();
    platform::activate_embedding_profile(
        &mut conn,
        TENANT,
        fx.space,
        "text-embedding-3-small",
        "openai",
        8,
    )
    .await
    .unwrap();
    drop(conn);
    let doc = fx.add("guide.md", "text/markdown", GUIDE_MD).await;
    fx.compile(doc).await;
    let publication = fx.head().await.unwrap().publication_id;
    let before = bindings(pool, fx.space).await;
    assert_eq!(before.len(), 1, "{before:#?}");
    assert_eq!(
        (
            &before[0]["id"],
            &before[0]["publication_id"],
            &before[0]["binding_reason"]
        ),
        (
            &json!(publication),
            &json!(publication),
            &json!("content-publication")
        ),
        "the publish's binding"
    );
    assert!(resolvable(pool, fx.space).await);

    // Discovery does not select the space; a reconciliation forced on it refuses the other
    // tuple (another reason) and writes nothing.
    assert_eq!(tick(pool).await, (0, 0, 0, 0));
    assert_eq!(run_backfills(pool, &BackfillKind::default()).await, 0);
    assert_eq!(
        bind_directly(pool, fx.space).await,
        Err(backfill::binding::code::BINDING_CONFLICT)
    );
    assert_eq!(bindings(pool, fx.space).await, before);
    assert!(resolvable(pool, fx.space).await);
    fx.cleanup().await;
}

/// A statement and its one argument.
type Statement = (&'static str, Value);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_head_whose_dense_projections_are_not_ready_in_the_profiles_vector_space_is_not_bound() {
    let fx = Fx::new().await;
    let pool = fx.pool();
    let publication = legacy_head(&fx).await;
    let dense: Vec<Uuid> = sqlx::query_scalar(
        "SELECT ip.id FROM projection_set_publication_members pm \
         JOIN index_projections ip ON ip.id = pm.component_key AND ip.publication_generation_id = pm.generation_id \
         WHERE pm.publication_id = $1 AND pm.component_type = 'index-projection' AND ip.type = 'dense-vector' \
         ORDER BY ip.id",
    )
    .bind(publication)
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(!dense.is_empty());
    let exec = |sql: &'static str, id: Value| async move {
        sqlx::query(sql).bind(id).execute(pool).await.unwrap();
    };
    // Each way the head fails to close over the profile's vector space, and its repair.
    let member: Value = sqlx::query_scalar(
        "SELECT to_jsonb(pm) FROM projection_set_publication_members pm WHERE pm.component_key = $1",
    )
    .bind(dense[0])
    .fetch_one(pool)
    .await
    .unwrap();
    let ids = json!(dense.iter().map(Uuid::to_string).collect::<Vec<_>>());
    let first = json!(dense[0].to_string());
    let cases: Vec<(&str, Statement, Statement)> = vec![
        (
            "dense vectors of another vector space",
            ("UPDATE index_projections SET model = 'embedding-space-sha256:' || repeat('b', 64) \
              WHERE id IN (SELECT jsonb_array_elements_text($1)::uuid)", ids.clone()),
            ("UPDATE index_projections p SET model = m.vsid FROM (SELECT vector_space_id AS vsid \
              FROM knowledge_space_profile_revisions WHERE kind = 'embedding' LIMIT 1) m \
              WHERE p.id IN (SELECT jsonb_array_elements_text($1)::uuid)", ids.clone()),
        ),
        (
            "a dense vector not ready",
            ("UPDATE index_projections SET status = 'building' WHERE id = ($1 #>> '{}')::uuid", first.clone()),
            ("UPDATE index_projections SET status = 'ready' WHERE id = ($1 #>> '{}')::uuid", first.clone()),
        ),
        (
            "a ready fts member without its dense twin",
            ("DELETE FROM projection_set_publication_members WHERE component_key = ($1 #>> '{}')::uuid", first),
            ("INSERT INTO projection_set_publication_members \
              SELECT * FROM jsonb_populate_record(NULL::projection_set_publication_members, $1)", member),
        ),
    ];
    let mut installed = false;
    for (name, (break_sql, break_arg), (repair_sql, repair_arg)) in cases {
        exec(break_sql, break_arg).await;
        if !installed {
            // The backfills install the profile heads; no tick binds the head.
            assert_eq!(run_backfills(pool, &BackfillKind::default()).await, 2);
            installed = true;
        }
        assert_eq!(
            tick(pool).await,
            (1, 0, 0, 1),
            "{name}: counted as a failed binding"
        );
        assert_eq!(
            bind_directly(pool, fx.space).await,
            Err(backfill::binding::code::VECTOR_SPACE_CONFLICT),
            "{name}"
        );
        assert!(bindings(pool, fx.space).await.is_empty(), "{name}");
        assert!(!resolvable(pool, fx.space).await, "{name}");
        exec(repair_sql, repair_arg).await;
    }
    // Repaired, the head is bound by the next tick.
    assert_eq!(tick(pool).await, (1, 0, 1, 0));
    assert_eq!(bindings(pool, fx.space).await.len(), 1);
    assert!(resolvable(pool, fx.space).await);
    fx.cleanup().await;
}
