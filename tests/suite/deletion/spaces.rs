//! Seeded spaces: documents compiled by the real compile handler, plus the platform's rows of
//! every table compile does not write, and what the space's publication head serves.

use super::*;

/// One seeded space of the fixture's database.
#[derive(Clone, Debug)]
pub(super) struct Space {
    pub(super) tenant: String,
    pub(super) id: Uuid,
    pub(super) name: String,
    pub(super) prefix: String,
    /// An interactive snapshot of the owner (role owner).
    pub(super) owner_snapshot: Uuid,
    pub(super) docs: Vec<Uuid>,
    pub(super) sources: Vec<Uuid>,
    pub(super) credentials: Vec<String>,
}

pub(super) fn note(i: usize, slug: &str) -> String {
    format!(
        "# Note {i} of {slug}\n\nFencing keeps a paused worker harmless; note {i} explains how the lease \
         token and the row version decide who may write.\n\n## Retries\n\nA failed step backs off and \
         tries again, {i} times at most.\n"
    )
}

pub(super) async fn conn(pool: &PgPool) -> sqlx::pool::PoolConnection<sqlx::Postgres> {
    pool.acquire().await.unwrap()
}

/// A space with `sources` credentialed sources and `docs` compiled documents spread over them
/// (every document of a source when there are sources), and the rows compile does not write.
pub(super) async fn seed(
    fx: &SpaceFx,
    tenant: &str,
    slug: &str,
    name: &str,
    sources: usize,
    docs: usize,
) -> Space {
    let pool = fx.pool();
    let mut c = conn(pool).await;
    let fixture_slug: String =
        sqlx::query_scalar("SELECT slug FROM knowledge_spaces WHERE id = $1")
            .bind(fx.space)
            .fetch_one(pool)
            .await
            .unwrap();
    let id = if tenant == fx.tenant && slug == fixture_slug {
        fx.space
    } else {
        platform::create_space(&mut c, tenant, slug, name, OWNER)
            .await
            .unwrap()
    };
    let owner_snapshot =
        platform::create_permission_snapshot(&mut c, tenant, id, OWNER, "interactive", None)
            .await
            .unwrap();
    let mut source_ids = Vec::new();
    let mut credentials = Vec::new();
    for i in 0..sources {
        let cred = platform::new_credential_ref();
        let s = platform::create_source(&mut c, id, &format!("src-{i}"), "web", Some(&cred))
            .await
            .unwrap();
        source_ids.push(s);
        credentials.push(cred);
    }
    let mut doc_ids = Vec::new();
    for i in 0..docs {
        let source = (!source_ids.is_empty()).then(|| source_ids[i % source_ids.len()]);
        let d = platform::add_document(
            &mut c,
            &fx.store,
            id,
            source,
            &format!("shared-{i}.md"),
            "text/markdown",
            Bytes::from(note(i, slug)),
        )
        .await
        .unwrap();
        doc_ids.push(d);
    }
    drop(c);
    for d in &doc_ids {
        fx.compile(*d).await;
    }
    let space = Space {
        tenant: tenant.into(),
        id,
        name: name.into(),
        prefix: platform::object_key_prefix(tenant, id),
        owner_snapshot,
        docs: doc_ids,
        sources: source_ids,
        credentials,
    };
    extras(fx, &space).await;
    space
}

/// The nodes of a document, with their generation.
pub(super) async fn nodes_of(pool: &PgPool, doc: Uuid) -> Vec<(Uuid, Uuid)> {
    sqlx::query_as(
        "SELECT id, publication_generation_id FROM knowledge_nodes WHERE document_asset_id = $1 ORDER BY id",
    )
    .bind(doc)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Graph rows built from `doc`'s nodes, published in the head as graph members (a new
/// publication inheriting the head, moved in by compare-and-swap). Returns the graph row ids.
pub(super) async fn publish_graph(fx: &SpaceFx, s: &Space, doc: Uuid) -> Vec<Uuid> {
    let pool = fx.pool();
    let nodes = nodes_of(pool, doc).await;
    let (n0, generation) = nodes[0];
    let n1 = nodes.get(1).map_or(n0, |n| n.0);
    let (e1, e2, r) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    sqlx::raw_sql(&format!(
        r#"INSERT INTO graph_entities (id, knowledge_space_id, publication_generation_id, canonical_key, name, type,
             aliases, confidence, source_node_ids, permission_scope, extraction_version, metadata, created_at, updated_at)
           VALUES ('{e1}', '{sp}', '{generation}', 'lease-{doc}', 'Lease', 'concept', '[]', 0.9, '["{n0}"]', '[]', 1, '{{}}', now(), now()),
                  ('{e2}', '{sp}', '{generation}', 'fence-{doc}', 'Fence', 'concept', '[]', 0.8, '["{n1}"]', '[]', 1, '{{}}', now(), now());
           INSERT INTO graph_relations (id, knowledge_space_id, publication_generation_id, subject_entity_id, object_entity_id,
             type, confidence, source_node_ids, permission_scope, extraction_version, metadata, created_at, updated_at)
           VALUES ('{r}', '{sp}', '{generation}', '{e1}', '{e2}', 'guards', 0.7, '["{n0}"]', '[]', 1, '{{}}', now(), now());"#,
        sp = s.id
    ))
    .execute(pool)
    .await
    .unwrap();
    let member = |ty: &str, key: Uuid| Member {
        component_type: ty.into(),
        component_key: key,
        generation_id: generation,
        document_asset_id: Some(doc),
    };
    publish_members(
        pool,
        s,
        &[
            member(publication::GRAPH_ENTITY, e1),
            member(publication::GRAPH_ENTITY, e2),
            member(publication::GRAPH_RELATION, r),
        ],
    )
    .await;
    vec![e1, e2, r]
}

/// Publishes the head's members plus `own` (a new publication moved in by compare-and-swap).
pub(super) async fn publish_members(pool: &PgPool, s: &Space, own: &[Member]) {
    let mut c = conn(pool).await;
    let head = publication::head(&mut c, &s.tenant, s.id, false)
        .await
        .unwrap()
        .unwrap();
    let new = Uuid::new_v4();
    let fp = format!(
        "projection-set-sha256:{}",
        platform::sha256_hex(new.as_bytes())
    );
    assert!(publication::insert(
        &mut c,
        new,
        &s.tenant,
        s.id,
        &fp,
        head.projection_version,
        "candidate",
        &serde_json::json!({ "graph": true }),
    )
    .await
    .unwrap());
    publication::set_members(
        &mut c,
        &s.tenant,
        s.id,
        new,
        Some(head.publication_id),
        None,
        own,
    )
    .await
    .unwrap();
    publication::publish(&mut c, &s.tenant, s.id, head.revision, new, &fp, None)
        .await
        .unwrap()
        .unwrap();
}

/// A graph entity of `owner`'s generation built from `owner`'s first node and `from`'s first
/// node, published as a member of `owner`: its closure fails once `from` is gone.
pub(super) async fn publish_cross_entity(
    pool: &PgPool,
    s: &Space,
    owner: Uuid,
    from: Uuid,
) -> Uuid {
    let (n_owner, generation) = nodes_of(pool, owner).await[0];
    let (n_from, _) = nodes_of(pool, from).await[0];
    let e = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO graph_entities (id, knowledge_space_id, publication_generation_id, canonical_key, name, type, \
           aliases, confidence, source_node_ids, permission_scope, extraction_version, metadata, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, 'Cross', 'concept', '[]', 0.5, $5, '[]', 1, '{}', now(), now())",
    )
    .bind(e)
    .bind(s.id)
    .bind(generation)
    .bind(format!("cross-{e}"))
    .bind(serde_json::json!([n_owner.to_string(), n_from.to_string()]))
    .execute(pool)
    .await
    .unwrap();
    publish_members(
        pool,
        s,
        &[Member {
            component_type: publication::GRAPH_ENTITY.into(),
            component_key: e,
            generation_id: generation,
            document_asset_id: Some(owner),
        }],
    )
    .await;
    e
}

/// The rows of every table compile does not write, with the platform's columns: graph rows
/// (published for the first document), traces with steps, evidence and failed queries, golden
/// questions, KnowledgeFS sessions and leases, workspaces, retrieval leases, research residue,
/// artifact segments and multimodal assets with their objects, postings, API keys, policy
/// members, credential and index backfills, a legacy bootstrap, profiles.
pub(super) async fn extras(fx: &SpaceFx, s: &Space) {
    let pool = fx.pool();
    let Some(&d0) = s.docs.first() else {
        return;
    };
    publish_graph(fx, s, d0).await;
    let (n0, _) = nodes_of(pool, d0).await[0];
    let (t, sp, snap) = (&s.tenant, s.id, s.owner_snapshot);
    let (bundle, trace, session, research) = (
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
    );
    let items = format!(
        r#"[{{"nodeId": "{n0}", "citations": [{{"documentAssetId": "{d0}"}}], "text": "x"}}]"#
    );
    let prefix = &s.prefix;
    let ms = "(extract(epoch from now()) * 1000)::bigint";
    let head = fx_head(pool, s).await;
    sqlx::raw_sql(&format!(
        r#"
        INSERT INTO evidence_bundles (id, tenant_id, knowledge_space_id, trace_id, query, state, items, missing_evidence, created_at)
        VALUES ('{bundle}', '{t}', '{sp}', NULL, 'who writes?', 'answerable', '{items}', '[]', now());
        INSERT INTO answer_traces (id, knowledge_space_id, evidence_bundle_id, query, mode, completed, created_at, subject_id,
          permission_snapshot_id, permission_snapshot_revision, access_channel)
        VALUES ('{trace}', '{sp}', '{bundle}', 'who writes?', 'fast', true, now(), '{OWNER}', '{snap}', 1, 'interactive');
        INSERT INTO answer_trace_steps (id, trace_id, name, status, started_at, ended_at, metadata)
        VALUES (gen_random_uuid(), '{trace}', 'retrieve', 'completed', now(), now(), '{{}}');
        INSERT INTO failed_queries (id, knowledge_space_id, answer_trace_id, query, mode, status, trigger, metadata, created_at, updated_at)
        VALUES (gen_random_uuid(), '{sp}', '{trace}', 'who writes?', 'fast', 'open', 'low-confidence', '{{}}', now(), now());
        INSERT INTO golden_questions (id, knowledge_space_id, question, expected_evidence_ids, tags, metadata, created_at, updated_at)
        VALUES (gen_random_uuid(), '{sp}', 'about the first note', '["{d0}"]', '[]', '{{}}', now(), now()),
               (gen_random_uuid(), '{sp}', 'about nothing in particular', '[]', '[]', '{{}}', now(), now());
        INSERT INTO knowledge_fs_sessions (id, tenant_id, knowledge_space_id, subject, permission_snapshot, client_kind,
          client_version, consistency_class, metadata, created_at, updated_at, heartbeat_at, expires_at)
        VALUES ('{session}', '{t}', '{sp}', '{{"subjectId": "{OWNER}"}}', '{{"id": "{snap}"}}', 'cli', '1.0.0',
          'path-consistent', '{{}}', now(), now(), now(), now() + interval '1 hour');
        INSERT INTO knowledge_fs_leases (id, tenant_id, knowledge_space_id, session_id, lease_type, target_type, target_id,
          target_version, virtual_path, status, metadata, acquired_at, heartbeat_at, expires_at, updated_at)
        VALUES (gen_random_uuid(), '{t}', '{sp}', '{session}', 'read', 'document-asset', '{d0}', 1,
          '/sources/documents/{d0}', 'released', '{{}}', now() - interval '1 hour', now() - interval '1 hour',
          now() - interval '30 minutes', now());
        INSERT INTO agent_workspace_snapshots (id, tenant_id, knowledge_space_id, subject_id, access_channel,
          permission_snapshot_id, permission_snapshot_revision, permission_scopes, fingerprint, payload, created_at)
        VALUES (gen_random_uuid(), '{t}', '{sp}', '{OWNER}', 'interactive', '{snap}', 1, '[]', 'same-fp', '{{}}', now());
        INSERT INTO retrieval_execution_leases (id, tenant_id, knowledge_space_id, subject_id, trace_id, lease_token,
          status, row_version, acquired_at, heartbeat_at, expires_at, updated_at)
        VALUES (gen_random_uuid(), '{t}', '{sp}', '{OWNER}', '{trace}', 'tok', 'released', 1, now() - interval '1 hour',
          now() - interval '1 hour', now() - interval '30 minutes', now());
        INSERT INTO resource_mounts (id, tenant_id, knowledge_space_id, mount_path, resource_type, provider, source_pointer,
          mode, capabilities, permission_scope, permission_snapshot_version, freshness_policy, cache_policy, metadata, created_at)
        VALUES (gen_random_uuid(), '{t}', '{sp}', '/mnt/wiki', 'source', 'web', 'https://wiki.example', 'read-only',
          '["read"]', '[]', 1, '{{}}', '{{}}', '{{}}', now());
        INSERT INTO research_task_jobs (id, tenant_id, knowledge_space_id, subject_id, permission_snapshot_id,
          permission_snapshot_revision, access_channel, query, limits, metadata, cost, stage, row_version,
          execution_attempts, max_execution_attempts, created_at, updated_at, completed_at)
        VALUES ('{research}', '{t}', '{sp}', '{OWNER}', '{snap}', 1, 'interactive', 'who writes?', '{{}}', '{{}}',
          '{{"entries": [], "totalUsd": 0}}', 'completed', 3, 1, 5, {ms}, {ms}, {ms});
        INSERT INTO research_task_outbox (id, research_task_job_id, delivery_revision, event_type, schema_version,
          idempotency_key, payload, status, available_at, dispatch_attempts, created_at, updated_at)
        VALUES (gen_random_uuid(), '{research}', 1, 'research.task', 1, 'research.task:{t}:{sp}:{research}:1',
          '{{"researchTaskJobId": "{research}"}}', 'completed', {ms}, 1, {ms}, {ms});
        INSERT INTO research_task_partial_results (id, tenant_id, knowledge_space_id, research_task_job_id, sequence,
          idempotency_key, evidence_bundle, created_at)
        VALUES (gen_random_uuid(), '{t}', '{sp}', '{research}', 1, 'research-task:{research}:final-evidence',
          '{{"id": "{bundle}", "items": {items}}}', {ms});
        INSERT INTO research_task_progress_events (id, tenant_id, knowledge_space_id, research_task_job_id, sequence,
          idempotency_key, event_type, stage, payload, created_at)
        VALUES (gen_random_uuid(), '{t}', '{sp}', '{research}', 1, 'research-task-progress:{research}:1:started',
          'research_task.started', 'queued', '{{}}', {ms});
        INSERT INTO artifact_segments (id, knowledge_space_id, document_asset_id, parse_artifact_id, artifact_hash,
          segment_index, segment_type, content_encoding, checksum, object_key, size_bytes, source_location, metadata, created_at)
        SELECT gen_random_uuid(), '{sp}', '{d0}', pa.id, pa.artifact_hash, 0, 'text', 'utf-8', 'sum',
          '{prefix}/segments/{d0}/0.txt', 4, '{{}}', '{{}}', now()
        FROM parse_artifacts pa WHERE pa.document_asset_id = '{d0}';
        UPDATE document_multimodal_manifests SET items = items || jsonb_build_array(jsonb_build_object('id', 'fig-1',
            'modality', 'image', 'assetRef', jsonb_build_object('objectKey', '{prefix}/assets/{d0}/figure.png',
              'variants', jsonb_build_object('thumb', jsonb_build_object('objectKey', '{prefix}/assets/{d0}/figure-thumb.png')))))
        WHERE document_asset_id = '{d0}';
        INSERT INTO index_projection_fts_postings (id, knowledge_space_id, projection_id, term, term_hash, term_frequency,
          document_token_count, tokenizer_version)
        SELECT gen_random_uuid(), '{sp}', ip.id, 'fencing', 'h-fencing', 1, 9, 'pg-simple-v1'
        FROM index_projections ip JOIN knowledge_nodes n ON n.id = ip.node_id WHERE n.document_asset_id = '{d0}' LIMIT 1;
        INSERT INTO knowledge_space_api_keys (id, tenant_id, knowledge_space_id, name, key_prefix, key_hash,
          principal_subject_id, status, revision, created_by_subject_id, created_at, updated_at)
        VALUES (gen_random_uuid(), '{t}', '{sp}', 'ci', 'kfs_', 'hash-{sp}', '{OWNER}', 'active', 1, '{OWNER}', now(), now());
        INSERT INTO knowledge_space_access_policy_members (id, tenant_id, knowledge_space_id, access_policy_id, subject_id, created_at)
        SELECT gen_random_uuid(), p.tenant_id, p.knowledge_space_id, p.id, '{OWNER}', now()
        FROM knowledge_space_access_policies p WHERE p.tenant_id = '{t}' AND p.knowledge_space_id = '{sp}';
        INSERT INTO legacy_space_publication_bootstraps (id, tenant_id, knowledge_space_id, idempotency_key, checkpoint,
          run_state, total_documents, completed_documents, snapshot_metadata, published_publication_id,
          published_fingerprint, published_head_revision, row_version, created_at, updated_at, completed_at)
        VALUES ('{boot}', '{t}', '{sp}', 'bootstrap', 'published', 'succeeded', 1, 1, '{{}}', '{hp}', '{hf}', {hr}, 4,
          now(), now(), now());
        INSERT INTO legacy_space_publication_bootstrap_items (bootstrap_id, document_asset_id, document_version,
          document_sha256, ordinal, status, created_at, updated_at)
        SELECT '{boot}', d.id, d.version, d.sha256, 0, 'succeeded', now(), now() FROM document_assets d WHERE d.id = '{d0}';
        INSERT INTO page_index_upgrade_backfills (id, tenant_id, knowledge_space_id, publication_id, publication_fingerprint,
          head_revision, run_state, total_items, completed_items, retry_count, row_version, created_at, updated_at, completed_at)
        VALUES ('{pib}', '{t}', '{sp}', '{hp}', '{hf}', {hr}, 'succeeded', 1, 1, 0, 2, now(), now(), now());
        INSERT INTO page_index_upgrade_backfill_items (backfill_id, document_asset_id, document_outline_id, document_version,
          publication_generation_id, ordinal, status, created_at, updated_at)
        SELECT '{pib}', o.document_asset_id, o.id, o.version, o.publication_generation_id, 0, 'succeeded', now(), now()
        FROM document_outlines o WHERE o.document_asset_id = '{d0}' LIMIT 1;
        INSERT INTO tidb_fts_posting_backfills (id, tenant_id, knowledge_space_id, tokenizer_version, run_state,
          scanned_projections, written_postings, retry_count, row_version, created_at, updated_at, completed_at)
        VALUES (gen_random_uuid(), '{t}', '{sp}', 'tidb-v1', 'succeeded', 3, 9, 0, 1, now(), now(), now());
        INSERT INTO knowledge_space_profile_backfills (id, tenant_id, knowledge_space_id, kind, source_manifest_version,
          source_snapshot, source_snapshot_digest, run_state, execution_attempts, max_execution_attempts, row_version,
          created_at, updated_at, completed_at)
        VALUES (gen_random_uuid(), '{t}', '{sp}', 'retrieval', 1, '{{}}', repeat('0', 64), 'succeeded', 1, 5, 2, now(), now(), now());
        "#,
        boot = Uuid::new_v4(),
        pib = Uuid::new_v4(),
        hp = head.publication_id,
        hf = head.fingerprint,
        hr = head.revision,
    ))
    .execute(pool)
    .await
    .unwrap();
    if let Some(&src) = s.sources.first() {
        sqlx::query(
            "INSERT INTO source_credential_backfills (id, tenant_id, knowledge_space_id, source_id, source_version, \
               candidate_credential_ref, secret_fingerprint, run_state, retry_count, row_version, created_at, updated_at, \
               completed_at) \
             VALUES (gen_random_uuid(), $1, $2, $3, 1, $4, repeat('a', 64), 'succeeded', 0, 1, now(), now(), now())",
        )
        .bind(t)
        .bind(sp)
        .bind(src)
        .bind(platform::new_credential_ref())
        .execute(pool)
        .await
        .unwrap();
    }
    for key in [
        format!("{prefix}/segments/{d0}/0.txt"),
        format!("{prefix}/assets/{d0}/figure.png"),
        format!("{prefix}/assets/{d0}/figure-thumb.png"),
    ] {
        fx.store
            .put(&key, Bytes::from_static(b"data"))
            .await
            .unwrap();
    }
    let mut c = conn(pool).await;
    platform::activate_embedding_profile(&mut c, t, sp, "text-embedding-3-small", "openai", 8)
        .await
        .unwrap();
}

pub(super) async fn fx_head(pool: &PgPool, s: &Space) -> publication::Head {
    let mut c = conn(pool).await;
    publication::head(&mut c, &s.tenant, s.id, false)
        .await
        .unwrap()
        .unwrap()
}

pub(super) async fn served(pool: &PgPool, s: &Space) -> BTreeSet<Uuid> {
    let mut c = conn(pool).await;
    let Some(h) = publication::head(&mut c, &s.tenant, s.id, false)
        .await
        .unwrap()
    else {
        return BTreeSet::new();
    };
    publication::documents(&mut c, &s.tenant, s.id, h.publication_id)
        .await
        .unwrap()
        .into_keys()
        .collect()
}

pub(super) async fn head_members(pool: &PgPool, s: &Space) -> Vec<Member> {
    let mut c = conn(pool).await;
    let Some(h) = publication::head(&mut c, &s.tenant, s.id, false)
        .await
        .unwrap()
    else {
        return Vec::new();
    };
    publication::members(&mut c, s.id, h.publication_id)
        .await
        .unwrap()
}
