//! Rows of the platform's later tables (0019..0054): capability grants and requests under them,
//! logical documents and revisions, source runs and connections, the head's profile binding.

use super::*;

/// A grant for an agent of the space admitting `scopes`.
pub(super) async fn grant_for(fx: &SpaceFx, s: &Space, scopes: &[&str]) -> Uuid {
    let mut c = conn(fx.pool()).await;
    let scopes: Vec<String> = scopes.iter().map(|x| (*x).to_owned()).collect();
    platform::create_capability_grant(&mut c, &s.tenant, s.id, "agent-7", &scopes)
        .await
        .unwrap()
}

pub(super) fn grant_request(
    s: &Space,
    target: Target,
    grant: Uuid,
    key: &str,
) -> GrantDeletionRequest {
    GrantDeletionRequest {
        tenant_id: s.tenant.clone(),
        knowledge_space_id: s.id,
        target,
        expected_revision: None,
        capability_grant_id: grant,
        idempotency_key: key.into(),
    }
}

pub(super) async fn request_under_grant(
    pool: &PgPool,
    req: &GrantDeletionRequest,
) -> Result<Uuid, RequestError> {
    let mut tx = pool.begin().await.unwrap();
    let r = request_deletion_under_grant(&mut tx, req).await;
    tx.commit().await.unwrap();
    r.map(|r| r.job_id)
}

/// The space's rows, every table but the deletion job's own (which a failure writes).
pub(super) async fn rows_but_the_jobs(
    cat: &Catalog,
    pool: &PgPool,
    space: Uuid,
) -> BTreeMap<String, String> {
    let mut rows = cat.fingerprint(pool, space).await;
    rows.retain(|t, _| !kept_by_design(t));
    rows
}

/// What a job failed closed on its grant holds: run state, checkpoint, error, slot, tombstone
/// state, and the statuses of its outbox rows.
pub(super) type Closed = (
    String,
    String,
    Option<String>,
    Option<String>,
    Option<i32>,
    String,
    Vec<String>,
);

pub(super) async fn closed(pool: &PgPool, job: Uuid) -> Closed {
    let (state, cp, code, message, slot): (String, String, Option<String>, Option<String>, Option<i32>) =
        sqlx::query_as(
            "SELECT run_state, checkpoint, last_error_code, last_error_message, active_slot FROM deletion_jobs WHERE id = $1",
        )
        .bind(job)
        .fetch_one(pool)
        .await
        .unwrap();
    let tomb: String =
        sqlx::query_scalar("SELECT state FROM deletion_tombstones WHERE deletion_job_id = $1")
            .bind(job)
            .fetch_one(pool)
            .await
            .unwrap();
    let outbox: Vec<String> = sqlx::query_scalar(
        "SELECT status FROM deletion_outbox WHERE deletion_job_id = $1 ORDER BY delivery_revision",
    )
    .bind(job)
    .fetch_all(pool)
    .await
    .unwrap();
    (state, cp, code, message, slot, tomb, outbox)
}

pub(super) fn failed_closed_at(cp: &str) -> Closed {
    (
        "failed".into(),
        cp.into(),
        Some(CAPABILITY_REVOKED.into()),
        Some(CAPABILITY_REVOKED_MESSAGE.into()),
        Some(1),
        "active".into(),
        vec!["dead".into()],
    )
}

/// The items of a job: (ordinal, status, object key still there).
pub(super) async fn items_of(pool: &PgPool, job: Uuid) -> Vec<(i64, String, bool)> {
    sqlx::query_as(
        "SELECT ordinal, status, object_key IS NOT NULL FROM deletion_job_items WHERE deletion_job_id = $1 ORDER BY ordinal",
    )
    .bind(job)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Every document as the platform's 0022 backfill leaves it: a logical document with the
/// asset's id, one active revision of the asset, `row_version` 1.
pub(super) async fn backfill_logical_documents(pool: &PgPool, docs: &[Uuid]) {
    sqlx::raw_sql(&format!(
        r#"
        INSERT INTO logical_documents (id, tenant_id, knowledge_space_id, source_id, provider_item_id, title, status,
          active_revision, row_version, system_metadata, user_metadata, created_at, updated_at)
        SELECT a.id, k.tenant_id, a.knowledge_space_id, NULL, NULL, a.filename, 'ready', NULL, 0,
          jsonb_build_object('legacyDocumentAssetId', a.id::text), '{{}}', now(), now()
        FROM document_assets a JOIN knowledge_spaces k ON k.id = a.knowledge_space_id WHERE a.id = ANY('{{{ids}}}');
        INSERT INTO document_revisions (tenant_id, knowledge_space_id, document_id, revision, document_asset_id,
          document_asset_version, compilation_attempt_id, expected_active_revision, expected_document_row_version,
          content_hash, mime_type, size_bytes, state, system_metadata, created_at, activated_at)
        SELECT k.tenant_id, a.knowledge_space_id, a.id, a.version, a.id, a.version, NULL, NULL, 0, a.sha256,
          a.mime_type, a.size_bytes, 'active', '{{}}', now(), now()
        FROM document_assets a JOIN knowledge_spaces k ON k.id = a.knowledge_space_id WHERE a.id = ANY('{{{ids}}}');
        UPDATE logical_documents l SET active_revision = a.version, row_version = l.row_version + 1
        FROM document_assets a WHERE l.id = a.id AND a.id = ANY('{{{ids}}}');
        "#,
        ids = docs.iter().map(Uuid::to_string).collect::<Vec<_>>().join(",")
    ))
    .execute(pool)
    .await
    .unwrap();
}

/// A revision row of logical document `doc` using asset `asset`.
pub(super) fn revision_sql(
    s: &Space,
    doc: Uuid,
    revision: i32,
    asset: Uuid,
    state: &str,
) -> String {
    let activated = if matches!(state, "active" | "superseded") {
        "now()"
    } else {
        "NULL"
    };
    format!(
        "INSERT INTO document_revisions (tenant_id, knowledge_space_id, document_id, revision, document_asset_id, \
           document_asset_version, compilation_attempt_id, expected_active_revision, expected_document_row_version, \
           content_hash, mime_type, size_bytes, state, system_metadata, created_at, activated_at) \
         SELECT '{t}', a.knowledge_space_id, '{doc}', {revision}, a.id, a.version, gen_random_uuid(), NULL, 0, a.sha256, \
           a.mime_type, a.size_bytes, '{state}', '{{}}', now(), {activated} \
         FROM document_assets a WHERE a.id = '{asset}' AND a.knowledge_space_id = '{sp}';",
        t = s.tenant,
        sp = s.id
    )
}

/// A source workflow run of `source` (completed) with a completed outbox row, under `grant` or
/// else the owner's snapshot.
pub(super) async fn source_run(
    pool: &PgPool,
    s: &Space,
    source: Uuid,
    grant: Option<Uuid>,
) -> Uuid {
    let run = Uuid::new_v4();
    let authority = match grant {
        Some(g) => format!("'{g}', NULL, NULL, NULL, NULL, NULL"),
        None => format!(
            "NULL, '{OWNER}', '{}', 1, '[]', 'interactive'",
            s.owner_snapshot
        ),
    };
    sqlx::raw_sql(&format!(
        r#"
        INSERT INTO source_workflow_runs (id, tenant_id, knowledge_space_id, kind, source_id, source_scope, idempotency_key,
          idempotency_digest, checkpoint, run_state, active_slot, completed_at, execution_attempts, max_execution_attempts,
          payload, progress_completed, progress_failed, progress_skipped, row_version, created_at, updated_at,
          capability_grant_id, requested_by_subject_id, permission_snapshot_id, permission_snapshot_revision,
          required_permission_scope, access_channel)
        VALUES ('{run}', '{t}', '{sp}', 'sync', '{source}', 'source:{source}', 'sync-{run}', repeat('a', 64),
          'source-committed', 'completed', NULL, now(), 1, 3, '{{}}', 1, 0, 0, 2, now(), now(), {authority});
        INSERT INTO source_workflow_outbox (id, run_id, delivery_revision, status, available_at, created_at, updated_at)
        VALUES (gen_random_uuid(), '{run}', 1, 'completed', now(), now(), now());
        INSERT INTO source_sync_policies (id, tenant_id, knowledge_space_id, source_id, mode, enabled,
          expected_source_version, revision, created_at, updated_at, capability_grant_id, requested_by_subject_id,
          permission_snapshot_id, permission_snapshot_revision, required_permission_scope, access_channel)
        VALUES (gen_random_uuid(), '{t}', '{sp}', '{source}', 'manual', false, 1, 1, now(), now(), {authority});
        "#,
        t = s.tenant,
        sp = s.id,
    ))
    .execute(pool)
    .await
    .unwrap();
    run
}

/// A source connection (under `grant` if any) that `source` uses.
pub(super) async fn connect_source(
    pool: &PgPool,
    s: &Space,
    source: Uuid,
    grant: Option<Uuid>,
) -> Uuid {
    let connection = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO source_connections (id, tenant_id, knowledge_space_id, provider_id, name, auth_kind, configuration, \
           scopes, status, credential_ref, version, capability_grant_id, created_at, updated_at) \
         VALUES ($1, $2, $3, 'notion', 'wiki', 'api-key', '{}', '[]', 'active', $4, 1, $5, now(), now())",
    )
    .bind(connection)
    .bind(&s.tenant)
    .bind(s.id)
    .bind(platform::new_credential_ref())
    .bind(grant)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("UPDATE sources SET connection_id = $1 WHERE id = $2")
        .bind(connection)
        .bind(source)
        .execute(pool)
        .await
        .unwrap();
    connection
}

/// Binds the space's current head to its active profiles, as the platform's backfill does:
/// returns the tuple (embedding revision id and revision, retrieval revision id and revision,
/// vector space).
pub(super) async fn bind_head(pool: &PgPool, s: &Space) -> (Uuid, i32, Uuid, i32, String) {
    let mut c = conn(pool).await;
    platform::activate_retrieval_profile(&mut c, &s.tenant, s.id, "gpt-4o-mini", "openai")
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO knowledge_space_profile_publication_bindings (id, tenant_id, knowledge_space_id, changed_kind, \
           binding_reason, embedding_profile_kind, embedding_profile_revision_id, embedding_profile_revision, \
           embedding_profile_snapshot_digest, retrieval_profile_kind, retrieval_profile_revision_id, \
           retrieval_profile_revision, retrieval_profile_snapshot_digest, vector_space_id, publication_id, \
           publication_fingerprint, created_at, activated_at) \
         SELECT gen_random_uuid(), h.tenant_id, h.knowledge_space_id, 'bootstrap', 'legacy-bootstrap', 'embedding', \
           e.id, e.revision, e.snapshot_digest, 'retrieval', r.id, r.revision, r.snapshot_digest, e.vector_space_id, \
           h.publication_id, p.fingerprint, now(), now() \
         FROM projection_set_publication_heads h \
         JOIN projection_set_publications p ON p.id = h.publication_id \
         JOIN knowledge_space_profile_revisions e ON e.tenant_id = h.tenant_id \
           AND e.knowledge_space_id = h.knowledge_space_id AND e.kind = 'embedding' AND e.state = 'active' \
         JOIN knowledge_space_profile_revisions r ON r.tenant_id = h.tenant_id \
           AND r.knowledge_space_id = h.knowledge_space_id AND r.kind = 'retrieval' AND r.state = 'active' \
         WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2",
    )
    .bind(&s.tenant)
    .bind(s.id)
    .execute(pool)
    .await
    .unwrap();
    binding_of(pool, fx_head(pool, s).await.publication_id)
        .await
        .expect("the head's binding")
        .1
}

/// A publication's binding: (id, kind, reason, fingerprint, activated), and its profile tuple.
pub(super) type Binding = (
    (Uuid, String, String, String, bool),
    (Uuid, i32, Uuid, i32, String),
);

pub(super) async fn binding_of(pool: &PgPool, publication: Uuid) -> Option<Binding> {
    type Row = (
        Uuid,
        String,
        String,
        String,
        bool,
        Uuid,
        i32,
        Uuid,
        i32,
        String,
    );
    let row: Option<Row> = sqlx::query_as(
        "SELECT id, changed_kind, binding_reason, publication_fingerprint, activated_at IS NOT NULL AND created_at = activated_at, \
           embedding_profile_revision_id, embedding_profile_revision, retrieval_profile_revision_id, \
           retrieval_profile_revision, vector_space_id \
         FROM knowledge_space_profile_publication_bindings WHERE publication_id = $1",
    )
    .bind(publication)
    .fetch_optional(pool)
    .await
    .unwrap();
    row.map(|(id, k, r, f, a, e, er, rv, rr, v)| ((id, k, r, f, a), (e, er, rv, rr, v)))
}

pub(super) async fn count(pool: &PgPool, sql: &str, id: Uuid) -> i64 {
    sqlx::query_scalar(sql)
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}
