//! deletion.job end to end against real Postgres, RabbitMQ and a local object directory, on the
//! platform's schema: every target and mode, idempotent and refused requests, draining writers
//! and leases, item retries and dead items, redaction, residue, manual retries under both
//! authorities, tenant and space isolation checked over every table of the schema, crashed
//! workers, a 10,000-document space in bounded pages; jobs under capability grants (revoked or
//! fenced ones fail closed), logical documents, the 0019..0054 RESTRICT keys and the head's
//! profile binding.
//!
//! Documents are compiled by the real compile handler (`SpaceFx::compile`), so their read model
//! is the one the worker writes; the tables compile does not write are seeded with the platform's
//! columns. Jobs are driven in-process: a real relay round publishes the due outbox rows, the test
//! takes the messages off the queue and hands them to an `Engine`, as a consumer would. Waiting
//! time is skipped with SQL (retry_at and item next_attempt_at moved to now), never slept through.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use kfs_worker::consumer::{ConsumerConfig, Engine};
use kfs_worker::engine::slice::Budget;
use kfs_worker::jobs::compile::{self, RequestOptions, Requester};
use kfs_worker::jobs::deletion::{
    request_deletion, request_deletion_under_grant, retry_deletion, retry_deletion_under_grant,
    CachePage, DeletionConfig, DeletionHandler, DeletionRequest, GrantDeletionRequest,
    GrantRetryRequest, ObjectEraser, PortError, RequestError, RetrievalCache, RetryAuthority,
    RetryRequest, SecretRef, SecretStore, SourceMode, Target, CAPABILITY_REVOKED,
    CAPABILITY_REVOKED_MESSAGE, SPACE_LOCK_CLASS,
};
use kfs_worker::jobs::{Deps, Handler, JobCtx, JobError, Kind, Step};
use kfs_worker::publication::{self, Member};
use kfs_worker::relay::{Relay, RelayConfig};
use kfs_worker::store::Store;
use kfs_worker::tools::platform;
use lapin::options::BasicGetOptions;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::support::space::{SpaceFx, OWNER};

// ---------------------------------------------------------------------------------------------
// Spaces: compiled documents plus every table compile does not write

/// One seeded space of the fixture's database.
#[derive(Clone, Debug)]
struct Space {
    tenant: String,
    id: Uuid,
    name: String,
    prefix: String,
    /// An interactive snapshot of the owner (role owner).
    owner_snapshot: Uuid,
    docs: Vec<Uuid>,
    sources: Vec<Uuid>,
    credentials: Vec<String>,
}

fn note(i: usize, slug: &str) -> String {
    format!(
        "# Note {i} of {slug}\n\nFencing keeps a paused worker harmless; note {i} explains how the lease \
         token and the row version decide who may write.\n\n## Retries\n\nA failed step backs off and \
         tries again, {i} times at most.\n"
    )
}

async fn conn(pool: &PgPool) -> sqlx::pool::PoolConnection<sqlx::Postgres> {
    pool.acquire().await.unwrap()
}

/// A space with `sources` credentialed sources and `docs` compiled documents spread over them
/// (every document of a source when there are sources), and the rows compile does not write.
async fn seed(
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
async fn nodes_of(pool: &PgPool, doc: Uuid) -> Vec<(Uuid, Uuid)> {
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
async fn publish_graph(fx: &SpaceFx, s: &Space, doc: Uuid) -> Vec<Uuid> {
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
async fn publish_members(pool: &PgPool, s: &Space, own: &[Member]) {
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
async fn publish_cross_entity(pool: &PgPool, s: &Space, owner: Uuid, from: Uuid) -> Uuid {
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
async fn extras(fx: &SpaceFx, s: &Space) {
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

async fn fx_head(pool: &PgPool, s: &Space) -> publication::Head {
    let mut c = conn(pool).await;
    publication::head(&mut c, &s.tenant, s.id, false)
        .await
        .unwrap()
        .unwrap()
}

async fn served(pool: &PgPool, s: &Space) -> BTreeSet<Uuid> {
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

async fn head_members(pool: &PgPool, s: &Space) -> Vec<Member> {
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

// ---------------------------------------------------------------------------------------------
// The object store, as files

fn files_under(root: &Path, prefix: &str) -> BTreeSet<String> {
    fn walk(base: &Path, p: &Path, out: &mut BTreeSet<String>) {
        let Ok(rd) = std::fs::read_dir(p) else {
            return;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(base, &p, out);
            } else if let Ok(rel) = p.strip_prefix(base) {
                out.insert(rel.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(root, &root.join(prefix), &mut out);
    out
}

// ---------------------------------------------------------------------------------------------
// The schema, generically: which rows of every table belong to a space or to documents

struct Catalog {
    tables: Vec<String>,
    columns: BTreeMap<String, BTreeSet<String>>,
    /// Foreign keys: (child, columns, parent, parent columns).
    fks: Vec<(String, Vec<String>, String, Vec<String>)>,
}

/// The deletion job tables keep their rows by design (job, redacted items, outbox, tombstone).
fn kept_by_design(table: &str) -> bool {
    table.starts_with("deletion_")
}

async fn catalog(pool: &PgPool) -> Catalog {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public' \
           AND table_type = 'BASE TABLE' AND table_name NOT LIKE 'kfs\\_%' AND table_name <> 'schema_migrations' \
         ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(
        tables.len() >= 60,
        "the 0018 schema has 60 tables: {tables:?}"
    );
    let cols: Vec<(String, String)> = sqlx::query_as(
        "SELECT table_name::text, column_name::text FROM information_schema.columns WHERE table_schema = 'public'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut columns: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (t, c) in cols {
        columns.entry(t).or_default().insert(c);
    }
    let fks: Vec<(String, Vec<String>, String, Vec<String>)> = sqlx::query_as(
        "SELECT c.conrelid::regclass::text, \
           ARRAY(SELECT a.attname::text FROM unnest(c.conkey) WITH ORDINALITY k(n, i) \
                 JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.n ORDER BY k.i), \
           c.confrelid::regclass::text, \
           ARRAY(SELECT a.attname::text FROM unnest(c.confkey) WITH ORDINALITY k(n, i) \
                 JOIN pg_attribute a ON a.attrelid = c.confrelid AND a.attnum = k.n ORDER BY k.i) \
         FROM pg_constraint c WHERE c.contype = 'f'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    Catalog {
        tables,
        columns,
        fks,
    }
}

impl Catalog {
    /// A predicate on `table` for its rows of space `$1` (documents `$2` when `space` is false:
    /// only rows of those documents), through its own columns or its parents' (a row cannot
    /// outlive its parent, so this reaches every child table).
    fn owned(&self, table: &str, space: bool, depth: u32) -> Option<String> {
        let cols = self.columns.get(table)?;
        if space && table == "knowledge_spaces" {
            return Some("id = $1".into());
        }
        if space && cols.contains("knowledge_space_id") {
            return Some("knowledge_space_id = $1".into());
        }
        if cols.contains("document_asset_id") {
            return Some("document_asset_id = ANY($2)".into());
        }
        if !space && table == "document_assets" {
            return Some("id = ANY($2)".into());
        }
        if depth > 4 {
            return None;
        }
        let preds: Vec<String> = self
            .fks
            .iter()
            .filter(|(child, _, parent, _)| child == table && parent != table)
            .filter_map(|(_, cols, parent, pcols)| {
                self.owned(parent, space, depth + 1).map(|p| {
                    format!(
                        "({}) IN (SELECT {} FROM {parent} WHERE {p})",
                        cols.join(", "),
                        pcols.join(", ")
                    )
                })
            })
            .collect();
        (!preds.is_empty()).then(|| format!("({})", preds.join(" OR ")))
    }

    /// Rows per table that belong to the space (`docs`: its documents).
    async fn count_owned(
        &self,
        pool: &PgPool,
        space: Option<Uuid>,
        docs: &[Uuid],
    ) -> BTreeMap<String, i64> {
        let mut out = BTreeMap::new();
        for t in self.tables.iter().filter(|t| !kept_by_design(t)) {
            let Some(pred) = self.owned(t, space.is_some(), 0) else {
                continue;
            };
            let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {t} WHERE {pred}"))
                .bind(space.unwrap_or_default())
                .bind(docs)
                .fetch_one(pool)
                .await
                .unwrap_or_else(|e| panic!("{t}: {e}"));
            if n > 0 {
                out.insert(t.clone(), n);
            }
        }
        out
    }

    /// Rows of any table (but the deletion job's own) whose text names one of `needles`.
    async fn mentions(&self, pool: &PgPool, needles: &[String]) -> BTreeMap<String, i64> {
        let patterns: Vec<String> = needles.iter().map(|n| format!("%{n}%")).collect();
        let mut out = BTreeMap::new();
        for t in self.tables.iter().filter(|t| !kept_by_design(t)) {
            let n: i64 = sqlx::query_scalar(&format!(
                "SELECT count(*) FROM {t} x WHERE x::text LIKE ANY($1)"
            ))
            .bind(&patterns)
            .fetch_one(pool)
            .await
            .unwrap();
            if n > 0 {
                out.insert(t.clone(), n);
            }
        }
        out
    }

    /// A digest of every row of every table that belongs to `space` (and its documents).
    async fn fingerprint(&self, pool: &PgPool, space: Uuid) -> BTreeMap<String, String> {
        let docs: Vec<Uuid> =
            sqlx::query_scalar("SELECT id FROM document_assets WHERE knowledge_space_id = $1")
                .bind(space)
                .fetch_all(pool)
                .await
                .unwrap();
        let mut out = BTreeMap::new();
        for t in &self.tables {
            let Some(pred) = self.owned(t, true, 0) else {
                continue;
            };
            let digest: Option<String> = sqlx::query_scalar(&format!(
                "SELECT md5(string_agg(x::text, '|' ORDER BY x::text)) FROM {t} x WHERE {pred}"
            ))
            .bind(space)
            .bind(&docs)
            .fetch_one(pool)
            .await
            .unwrap();
            if let Some(d) = digest {
                out.insert(t.clone(), d);
            }
        }
        out
    }
}

/// Other spaces' rows and objects, to compare before and after.
struct Untouched {
    rows: Vec<BTreeMap<String, String>>,
    objects: Vec<BTreeSet<String>>,
}

async fn untouched(fx: &SpaceFx, cat: &Catalog, others: &[&Space]) -> Untouched {
    let mut rows = Vec::new();
    let mut objects = Vec::new();
    for o in others {
        rows.push(cat.fingerprint(fx.pool(), o.id).await);
        objects.push(files_under(&fx.dir, &o.prefix));
    }
    Untouched { rows, objects }
}

async fn assert_untouched(fx: &SpaceFx, cat: &Catalog, others: &[&Space], before: &Untouched) {
    let now = untouched(fx, cat, others).await;
    for (i, o) in others.iter().enumerate() {
        assert!(
            before.rows[i].len() > 20,
            "{} has rows in too few tables to mean anything",
            o.id
        );
        let changed: Vec<&String> = before.rows[i]
            .iter()
            .filter(|(t, d)| now.rows[i].get(*t) != Some(*d))
            .map(|(t, _)| t)
            .chain(
                now.rows[i]
                    .keys()
                    .filter(|t| !before.rows[i].contains_key(*t)),
            )
            .collect();
        assert!(
            changed.is_empty(),
            "rows of {} ({}) changed in {changed:?}",
            o.id,
            o.tenant
        );
        assert_eq!(
            now.objects[i], before.objects[i],
            "objects of {} changed",
            o.id
        );
        assert!(!before.objects[i].is_empty());
    }
}

// ---------------------------------------------------------------------------------------------
// Requests

fn space_request(s: &Space, key: &str) -> DeletionRequest {
    DeletionRequest {
        tenant_id: s.tenant.clone(),
        knowledge_space_id: s.id,
        target: Target::Space {
            confirm_name: s.name.clone(),
        },
        expected_revision: None,
        requested_by_subject_id: OWNER.into(),
        permission_snapshot_id: s.owner_snapshot,
        access_channel: "interactive".into(),
        idempotency_key: key.into(),
    }
}

fn target_request(s: &Space, target: Target, key: &str) -> DeletionRequest {
    DeletionRequest {
        target,
        ..space_request(s, key)
    }
}

async fn request(pool: &PgPool, req: &DeletionRequest) -> Result<Uuid, RequestError> {
    let mut tx = pool.begin().await.unwrap();
    let r = request_deletion(&mut tx, req).await;
    tx.commit().await.unwrap();
    r.map(|r| r.job_id)
}

async fn snapshot_for(fx: &SpaceFx, s: &Space, subject: &str, channel: &str) -> Uuid {
    let mut c = conn(fx.pool()).await;
    platform::create_permission_snapshot(&mut c, &s.tenant, s.id, subject, channel, None)
        .await
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Ports that record or fail

/// A secret the store was asked to erase: tenant, space, source, reference.
type SeenSecret = (String, Uuid, Option<Uuid>, String);

#[derive(Default)]
struct Recording {
    secrets: Mutex<Vec<SeenSecret>>,
    failures_left: AtomicU64,
    cache: Mutex<BTreeSet<String>>,
    prefixes: Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl SecretStore for Recording {
    async fn delete_secret(&self, s: &SecretRef<'_>) -> Result<(), PortError> {
        if self
            .failures_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(PortError::retryable("secret_store", "vault unavailable"));
        }
        self.secrets.lock().unwrap().push((
            s.tenant.to_owned(),
            s.space,
            s.source,
            s.credential_ref.to_owned(),
        ));
        Ok(())
    }
}

#[async_trait::async_trait]
impl RetrievalCache for Recording {
    async fn delete_prefix(&self, prefix: &str, limit: usize) -> Result<CachePage, PortError> {
        self.prefixes.lock().unwrap().push(prefix.to_owned());
        let mut cache = self.cache.lock().unwrap();
        let hits: Vec<String> = cache
            .iter()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect();
        let gone: Vec<String> = hits.iter().take(limit).cloned().collect();
        for k in &gone {
            cache.remove(k);
        }
        Ok(CachePage {
            deleted: gone.len() as u64,
            more: hits.len() > gone.len(),
        })
    }
}

/// An object store that fails deletions while `broken` is set.
struct Flaky {
    inner: Store,
    broken: AtomicBool,
    calls: AtomicU64,
}

#[async_trait::async_trait]
impl ObjectEraser for Flaky {
    async fn delete_object(&self, key: &str) -> Result<(), PortError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.broken.load(Ordering::SeqCst) {
            return Err(PortError::retryable("object_store", "503 slow down"));
        }
        self.inner.delete_object(key).await
    }

    async fn list_objects(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<String>, PortError> {
        self.inner.list_objects(prefix, after, limit).await
    }

    async fn object_exists(&self, key: &str) -> Result<bool, PortError> {
        self.inner.object_exists(key).await
    }
}

/// Counts steps per checkpoint, then delegates.
struct Counting {
    inner: DeletionHandler,
    steps: Mutex<BTreeMap<String, u64>>,
    time: Mutex<BTreeMap<String, Duration>>,
}

#[async_trait::async_trait]
impl Handler for Counting {
    fn kind(&self) -> Kind {
        Kind::Deletion
    }

    async fn step(&self, tx: &mut PgConnection, job: &JobCtx) -> Result<Step, JobError> {
        *self
            .steps
            .lock()
            .unwrap()
            .entry(job.checkpoint.clone())
            .or_default() += 1;
        let started = Instant::now();
        let out = self.inner.step(tx, job).await;
        *self
            .time
            .lock()
            .unwrap()
            .entry(job.checkpoint.clone())
            .or_default() += started.elapsed();
        out
    }
}

fn fast_config() -> DeletionConfig {
    DeletionConfig {
        item_retry_base: Duration::from_millis(10),
        item_retry_max: Duration::from_millis(50),
        max_wait: Duration::from_millis(200),
        ..DeletionConfig::default()
    }
}

fn handler(fx: &SpaceFx) -> DeletionHandler {
    DeletionHandler::new(Deps::offline(fx.store.clone()))
        .unwrap()
        .with_config(fast_config())
}

// ---------------------------------------------------------------------------------------------
// Driving jobs in-process

struct Driver {
    engine: Engine,
    relay: Relay,
    publish: lapin::Channel,
    take: lapin::Channel,
    queue: String,
    pool: PgPool,
}

impl Driver {
    async fn new(fx: &SpaceFx, handler: Arc<dyn Handler>, budget: Budget) -> Driver {
        let env = &fx.env;
        let cfg = ConsumerConfig {
            budget,
            ..ConsumerConfig::default()
        };
        Driver {
            engine: Engine::new(env.pool.clone(), "deletion-test", vec![handler], cfg),
            relay: Relay::new(
                env.pool.clone(),
                env.topology.clone(),
                "deletion-relay",
                RelayConfig::default(),
                &[Kind::Deletion],
            ),
            publish: env.confirm_channel().await,
            take: env.channel().await,
            queue: env.topology.queue(Kind::Deletion),
            pool: env.pool.clone(),
        }
    }

    /// One relay round, then every message on the queue through the engine.
    async fn turn(&self) -> usize {
        self.relay
            .relay_once(&self.publish, Kind::Deletion)
            .await
            .expect("relay round");
        let mut n = 0;
        while let Some(m) = self
            .take
            .basic_get(self.queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let d = m.delivery;
            tokio::time::timeout(
                Duration::from_secs(120),
                self.engine.process(
                    Kind::Deletion,
                    &d.properties,
                    &d.data,
                    &CancellationToken::new(),
                ),
            )
            .await
            .expect("process hung");
            n += 1;
        }
        n
    }

    /// Drives `job` until it succeeds or fails, skipping planned waits when `skip_waits`.
    async fn finish(&self, job: Uuid, skip_waits: bool) -> (String, String) {
        for _ in 0..5000 {
            let (state, cp) = job_state(&self.pool, job).await;
            if matches!(state.as_str(), "succeeded" | "failed" | "canceled") {
                if state != "succeeded" {
                    let why: (Option<String>, Option<String>) = sqlx::query_as(
                        "SELECT last_error_code, last_error_message FROM deletion_jobs WHERE id = $1",
                    )
                    .bind(job)
                    .fetch_one(&self.pool)
                    .await
                    .unwrap();
                    eprintln!("job {job} ended {state} at {cp}: {why:?}");
                }
                return (state, cp);
            }
            if skip_waits && state == "retry_wait" {
                skip_wait(&self.pool, job).await;
            }
            if self.turn().await == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        panic!(
            "job {job} did not finish: {:?}",
            job_state(&self.pool, job).await
        );
    }
}

async fn job_state(pool: &PgPool, job: Uuid) -> (String, String) {
    sqlx::query_as("SELECT run_state, checkpoint FROM deletion_jobs WHERE id = $1")
        .bind(job)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn skip_wait(pool: &PgPool, job: Uuid) {
    sqlx::query(
        "UPDATE deletion_jobs SET retry_at = now() WHERE id = $1 AND run_state = 'retry_wait'",
    )
    .bind(job)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("UPDATE deletion_outbox SET available_at = now() WHERE deletion_job_id = $1 AND status = 'pending'")
        .bind(job)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("UPDATE deletion_job_items SET next_attempt_at = now() WHERE deletion_job_id = $1 AND status = 'retry_wait'")
        .bind(job)
        .execute(pool)
        .await
        .unwrap();
}

/// After success: job, outbox, tombstone final; every item completed with its key redacted.
async fn assert_finished_clean(pool: &PgPool, job: Uuid) {
    let (state, cp, slot): (String, String, Option<i32>) = sqlx::query_as(
        "SELECT run_state, checkpoint, active_slot FROM deletion_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        (state.as_str(), cp.as_str(), slot),
        ("succeeded", "completed", None)
    );
    let tomb: (String, bool) = sqlx::query_as(
        "SELECT state, completed_at IS NOT NULL FROM deletion_tombstones WHERE deletion_job_id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(tomb, ("completed".into(), true));
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM deletion_outbox WHERE deletion_job_id = $1 AND status NOT IN ('completed', 'dead')",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(open, 0, "outbox rows still open");
    let unredacted: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM deletion_job_items WHERE deletion_job_id = $1 AND (status <> 'completed' \
           OR object_key IS NOT NULL OR credential_ref IS NOT NULL OR cache_key IS NOT NULL OR redacted_at IS NULL)",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(unredacted, 0, "items not completed or not redacted");
}

async fn item_kinds(pool: &PgPool, job: Uuid) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT kind, count(*) FROM deletion_job_items WHERE deletion_job_id = $1 GROUP BY 1 ORDER BY 1",
    )
    .bind(job)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Everything a document leaves behind, to look for after its deletion: its id, its nodes'
/// ids, its object keys and its folder.
async fn needles_of(fx: &SpaceFx, s: &Space, doc: Uuid) -> Vec<String> {
    let mut out = vec![doc.to_string(), format!("{}/documents/{doc}", s.prefix)];
    for (n, _) in nodes_of(fx.pool(), doc).await {
        out.push(n.to_string());
    }
    let key: String = sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
        .bind(doc)
        .fetch_one(fx.pool())
        .await
        .unwrap();
    out.push(key);
    out
}

/// Nothing of the documents is left in any table of the schema, nor under their folders.
async fn assert_documents_gone(
    fx: &SpaceFx,
    cat: &Catalog,
    s: &Space,
    docs: &[Uuid],
    needles: &[String],
) {
    let owned = cat.count_owned(fx.pool(), None, docs).await;
    assert!(owned.is_empty(), "rows of the documents left: {owned:?}");
    let named = cat.mentions(fx.pool(), needles).await;
    assert!(
        named.is_empty(),
        "rows naming the documents left: {named:?}"
    );
    for d in docs {
        let left = files_under(&fx.dir, &format!("{}/documents/{d}", s.prefix));
        assert!(left.is_empty(), "objects of {d} left: {left:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Tests

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
async fn a_space_whose_compile_attempts_bind_permission_snapshots_is_deleted_despite_the_restrict_key(
) {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let pool = fx.pool();
    let mut s = seed(&fx, "tenant-t", "main", "Docs", 0, 0).await;
    let restrict: String = sqlx::query_scalar(
        "SELECT confdeltype::text FROM pg_constraint WHERE conrelid = 'document_compilation_attempts'::regclass \
           AND confrelid = 'knowledge_space_permission_snapshots'::regclass",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(restrict, "r", "the 0016 binding is ON DELETE RESTRICT");
    for i in 0..2 {
        let doc = fx
            .add(
                &format!("bound-{i}.md"),
                "text/markdown",
                note(i, "bound").as_bytes(),
            )
            .await;
        let mut tx = pool.begin().await.unwrap();
        let attempt = compile::request(
            &mut tx,
            doc,
            RequestOptions {
                requester: Some(Requester {
                    subject: OWNER.into(),
                    snapshot: s.owner_snapshot,
                }),
                ..RequestOptions::default()
            },
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        let st = fx.drive(&fx.engine("w-bound", 64), attempt).await;
        assert_eq!(st.run_state, "succeeded", "{st:?}");
        s.docs.push(doc);
    }
    // Traces and research tasks bind the same snapshot.
    extras(&fx, &s).await;
    let bound: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM document_compilation_attempts WHERE permission_snapshot_id = $1",
    )
    .bind(s.owner_snapshot)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(bound, 2);
    let cat = catalog(pool).await;
    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    let job = request(pool, &space_request(&s, "bound")).await.unwrap();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    let left = cat.count_owned(pool, Some(s.id), &s.docs).await;
    assert!(left.is_empty(), "rows of the space left: {left:?}");
    assert!(files_under(&fx.dir, &s.prefix).is_empty());
    fx.cleanup().await;
}

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

/// Another deletion's space-wide step in the same space holds the space's lock (taken here
/// the way that step takes it).
async fn hold_space_lock(pool: &PgPool, space: Uuid) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
        .bind(SPACE_LOCK_CLASS)
        .bind(space.to_string())
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_space_wide_step_queues_behind_another_deletions_step_then_runs_or_gives_its_slice_back()
{
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 0).await;
    let pool = fx.pool();
    let doc = fx
        .add("queued.md", "text/markdown", note(1, "queued").as_bytes())
        .await;
    fx.compile(doc).await;
    let job = request(
        pool,
        &target_request(&s, Target::Document { id: doc }, "queued"),
    )
    .await
    .unwrap();
    let patient = |wait: Duration| {
        Arc::new(handler(&fx).with_config(DeletionConfig {
            space_lock_wait: wait,
            ..fast_config()
        }))
    };

    // Held for longer than the step waits: the slice ends with a cooperative wait, using no
    // attempt, and its transaction (rolled back to before the lock) writes nothing else.
    let holder = hold_space_lock(pool, s.id).await;
    let short = Driver::new(&fx, patient(Duration::from_millis(300)), Budget::default()).await;
    for _ in 0..20 {
        short.turn().await;
        if job_state(pool, job).await.0 == "retry_wait" {
            break;
        }
    }
    let (state, cp, code, message, attempts): (String, String, Option<String>, Option<String>, i32) =
        sqlx::query_as(
            "SELECT run_state, checkpoint, last_error_code, last_error_message, execution_attempts              FROM deletion_jobs WHERE id = $1",
        )
        .bind(job)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!((state.as_str(), cp.as_str()), ("retry_wait", "quiescing"));
    assert_eq!(code.as_deref(), Some("waiting"));
    assert!(
        message
            .unwrap_or_default()
            .contains("another deletion in the space"),
        "the wait names why"
    );
    assert_eq!(attempts, 0, "a planned wait gives its attempt back");
    assert!(
        served(pool, &s).await.contains(&doc),
        "nothing of the quiescing step committed"
    );

    // Released while the next step queues for it: that step gets the lock and goes on.
    skip_wait(pool, job).await;
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        holder.commit().await.unwrap();
    });
    let queued = Driver::new(&fx, patient(Duration::from_secs(60)), Budget::default()).await;
    assert_eq!(queued.finish(job, true).await.0, "succeeded");
    release.await.unwrap();
    let (attempts, code): (i32, Option<String>) = sqlx::query_as(
        "SELECT execution_attempts, last_error_code FROM deletion_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        (attempts, code),
        (1, None),
        "one slice queued for the lock and ran to the end"
    );
    assert_finished_clean(pool, job).await;
    assert!(!served(pool, &s).await.contains(&doc));
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_are_idempotent_and_every_refusal_is_typed_and_changes_nothing() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 1, 0).await;
    let pool = fx.pool();
    let mut docs = Vec::new();
    for i in 0..2 {
        let mut c = conn(pool).await;
        docs.push(
            platform::add_document(
                &mut c,
                &fx.store,
                s.id,
                Some(s.sources[0]),
                &format!("r-{i}.md"),
                "text/markdown",
                Bytes::from(note(i, "r")),
            )
            .await
            .unwrap(),
        );
    }
    let doc = docs[0];
    let req = target_request(&s, Target::Document { id: doc }, "k1");
    let mut tx = pool.begin().await.unwrap();
    let first = request_deletion(&mut tx, &req).await.unwrap();
    let again = request_deletion(&mut tx, &req).await.unwrap();
    tx.commit().await.unwrap();
    assert!(first.created && !again.created);
    assert_eq!(
        (first.job_id, first.outbox_id),
        (again.job_id, again.outbox_id)
    );

    let count = |pool: PgPool| async move {
        let n: (i64, i64, i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM deletion_jobs), (SELECT count(*) FROM deletion_tombstones), \
                    (SELECT count(*) FROM deletion_outbox), (SELECT count(*) FROM deletion_job_items)",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        n
    };
    let before = count(pool.clone()).await;
    assert_eq!(before, (1, 1, 1, 1));

    // Same key, different request.
    let r = request(
        pool,
        &target_request(&s, Target::Document { id: docs[1] }, "k1"),
    )
    .await;
    assert!(
        matches!(r, Err(RequestError::IdempotencyConflict { job_id, .. }) if job_id == first.job_id),
        "{r:?}"
    );
    // Another key, same target: the live job owns it.
    let r = request(
        pool,
        &target_request(&s, Target::Document { id: doc }, "k2"),
    )
    .await;
    assert!(
        matches!(r, Err(RequestError::TargetBusy { job_id: Some(j), .. }) if j == first.job_id),
        "{r:?}"
    );
    // The document's source, in either mode, and its space wait for the document's deletion.
    for mode in [SourceMode::Cascade, SourceMode::Keep] {
        let r = request(
            pool,
            &target_request(
                &s,
                Target::Source {
                    id: s.sources[0],
                    mode,
                },
                &format!("k3-{mode:?}"),
            ),
        )
        .await;
        assert!(matches!(r, Err(RequestError::TargetBusy { .. })), "{r:?}");
    }
    let r = request(pool, &space_request(&s, "k3-space")).await;
    assert!(
        matches!(r, Err(RequestError::TargetBusy { job_id: Some(j), .. }) if j == first.job_id),
        "{r:?}"
    );
    // The name challenge.
    let mut wrong = space_request(&s, "k4");
    wrong.target = Target::Space {
        confirm_name: "not the name".into(),
    };
    assert!(matches!(
        request(pool, &wrong).await,
        Err(RequestError::NameChallenge)
    ));
    // Unknown targets, and targets of another tenant.
    let r = request(
        pool,
        &target_request(&s, Target::Document { id: Uuid::now_v7() }, "k5"),
    )
    .await;
    assert!(matches!(r, Err(RequestError::NotFound(_))), "{r:?}");
    let r = request(
        pool,
        &DeletionRequest {
            tenant_id: "tenant-u".into(),
            ..target_request(&s, Target::Document { id: docs[1] }, "k6")
        },
    )
    .await;
    assert!(matches!(r, Err(RequestError::NotFound(_))), "{r:?}");
    // Snapshots: another subject's, revoked, expired, a viewer's, another channel's, unknown;
    // and an editor may delete a document but not the space.
    let bob = snapshot_for(&fx, &s, "bob", "interactive").await;
    let revoked = snapshot_for(&fx, &s, OWNER, "interactive").await;
    let mut c = conn(pool).await;
    platform::revoke_permission_snapshot(&mut c, &s.tenant, revoked)
        .await
        .unwrap();
    let expired = platform::create_permission_snapshot(
        &mut c,
        &s.tenant,
        s.id,
        OWNER,
        "interactive",
        Some(chrono::Utc::now() - chrono::Duration::minutes(1)),
    )
    .await
    .unwrap();
    platform::add_member(&mut c, &s.tenant, s.id, "vic", "viewer")
        .await
        .unwrap();
    drop(c);
    let viewer = snapshot_for(&fx, &s, "vic", "interactive").await;
    let mcp = snapshot_for(&fx, &s, OWNER, "mcp").await;
    for (snap, subject) in [
        (bob, OWNER),
        (revoked, OWNER),
        (expired, OWNER),
        (viewer, "vic"),
        (mcp, OWNER),
        (Uuid::now_v7(), OWNER),
    ] {
        let r = request(
            pool,
            &DeletionRequest {
                permission_snapshot_id: snap,
                requested_by_subject_id: subject.into(),
                ..target_request(&s, Target::Document { id: docs[1] }, &format!("p-{snap}"))
            },
        )
        .await;
        assert!(
            matches!(r, Err(RequestError::Permission(_))),
            "{snap}: {r:?}"
        );
    }
    let editor_space = DeletionRequest {
        permission_snapshot_id: bob,
        requested_by_subject_id: "bob".into(),
        ..space_request(&s, "k-editor")
    };
    // (The space is busy first; an editor is refused for a space of its own.)
    let other = seed(&fx, "tenant-t", "editor", "Editor", 0, 0).await;
    let bob_other = snapshot_for(&fx, &other, "bob", "interactive").await;
    let r = request(
        pool,
        &DeletionRequest {
            knowledge_space_id: other.id,
            permission_snapshot_id: bob_other,
            target: Target::Space {
                confirm_name: other.name.clone(),
            },
            ..editor_space
        },
    )
    .await;
    assert!(
        matches!(&r, Err(RequestError::Permission(m)) if m.contains("owner")),
        "{r:?}"
    );
    assert_eq!(
        count(pool.clone()).await,
        before,
        "a refusal wrote something"
    );
    let state: String =
        sqlx::query_scalar("SELECT lifecycle_state FROM document_assets WHERE id = $1")
            .bind(docs[1])
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(state, "active");
    // The caller's transaction stays usable after a refusal (the request used a savepoint).
    let mut tx = pool.begin().await.unwrap();
    assert!(request_deletion(
        &mut tx,
        &target_request(&s, Target::Document { id: doc }, "k7")
    )
    .await
    .is_err());
    let ok = request_deletion(
        &mut tx,
        &DeletionRequest {
            permission_snapshot_id: bob,
            requested_by_subject_id: "bob".into(),
            ..target_request(&s, Target::Document { id: docs[1] }, "k8")
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(ok.created, "an editor may delete a document");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn live_writers_and_leases_hold_the_job_without_using_attempts_and_the_rest_is_canceled_or_reclaimed(
) {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 1, 2).await;
    let pool = fx.pool();
    let ms = "(extract(epoch from now()) * 1000)::bigint";
    let lease = |status: &'static str, expires: &'static str| {
        let pool = pool.clone();
        let s = s.clone();
        async move {
            let id = Uuid::now_v7();
            sqlx::query(&format!(
                "INSERT INTO retrieval_execution_leases (id, tenant_id, knowledge_space_id, subject_id, trace_id, \
                   lease_token, status, row_version, acquired_at, heartbeat_at, expires_at, updated_at) \
                 VALUES ($1, $2, $3, 'bob', gen_random_uuid(), 'tok', '{status}', 0, now() - interval '2 hours', \
                   now() - interval '2 hours', {expires}, now())"
            ))
            .bind(id)
            .bind(&s.tenant)
            .bind(s.id)
            .execute(&pool)
            .await
            .unwrap();
            id
        }
    };
    let live = lease("active", "now() + interval '1 hour'").await;
    let stale = lease("active", "now() - interval '1 hour'").await;
    // A compile attempt holding a live lease, and one still queued.
    let running = fx.request(s.docs[1], false).await.unwrap();
    sqlx::query(
        "UPDATE document_compilation_attempts SET run_state = 'running', worker_id = 'w-elsewhere', \
           lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 hour', heartbeat_at = now(), \
           execution_attempts = 1 WHERE id = $1",
    )
    .bind(running)
    .execute(pool)
    .await
    .unwrap();
    let queued = fx.request(s.docs[0], false).await.unwrap();
    // A research task holding a live lease, and one queued with its outbox.
    let (live_task, queued_task) = (Uuid::new_v4(), Uuid::new_v4());
    let session = Uuid::new_v4();
    sqlx::raw_sql(&format!(
        r#"
        INSERT INTO research_task_jobs (id, tenant_id, knowledge_space_id, subject_id, permission_snapshot_id,
          permission_snapshot_revision, access_channel, query, limits, metadata, cost, stage, row_version,
          execution_attempts, max_execution_attempts, worker_id, lease_token, lease_expires_at, heartbeat_at,
          created_at, updated_at)
        VALUES ('{live_task}', '{t}', '{sp}', '{OWNER}', '{snap}', 1, 'interactive', 'q', '{{}}', '{{}}', '{{}}',
          'retrieving', 2, 1, 5, 'w-elsewhere', gen_random_uuid(), {ms} + 3600000, {ms}, {ms}, {ms}),
               ('{queued_task}', '{t}', '{sp}', '{OWNER}', '{snap}', 1, 'interactive', 'q', '{{}}', '{{}}', '{{}}',
          'queued', 1, 0, 5, NULL, NULL, NULL, NULL, {ms}, {ms});
        INSERT INTO research_task_outbox (id, research_task_job_id, delivery_revision, event_type, schema_version,
          idempotency_key, payload, status, available_at, dispatch_attempts, created_at, updated_at)
        VALUES (gen_random_uuid(), '{queued_task}', 1, 'research.task', 1, 'research.task:{t}:{sp}:{queued_task}:1',
          '{{}}', 'pending', {ms}, 0, {ms}, {ms});
        INSERT INTO knowledge_fs_sessions (id, tenant_id, knowledge_space_id, subject, permission_snapshot, client_kind,
          client_version, consistency_class, metadata, created_at, updated_at, heartbeat_at, expires_at)
        VALUES ('{session}', '{t}', '{sp}', '{{}}', '{{}}', 'mcp', '1', 'path-consistent', '{{}}', now(), now(), now(),
          now() + interval '1 hour');
        INSERT INTO knowledge_fs_leases (id, tenant_id, knowledge_space_id, session_id, lease_type, target_type, target_id,
          virtual_path, status, metadata, acquired_at, heartbeat_at, expires_at, updated_at)
        VALUES ('{live_fs}', '{t}', '{sp}', '{session}', 'write', 'knowledge-space', '{sp}', '/', 'active', '{{}}',
          now(), now(), now() + interval '1 hour', now()),
               ('{stale_fs}', '{t}', '{sp}', '{session}', 'read', 'knowledge-space', '{sp}', '/', 'active', '{{}}',
          now() - interval '2 hours', now() - interval '2 hours', now() - interval '1 hour', now());
        INSERT INTO knowledge_space_mutation_leases (id, tenant_id, knowledge_space_id, operation, acquired_at,
          lease_token, heartbeat_at, expires_at)
        VALUES (gen_random_uuid(), '{t}', '{sp}', 'import', now() - interval '1 hour', gen_random_uuid(),
          now() - interval '1 hour', now() - interval '30 minutes');
        UPDATE source_credential_backfills SET run_state = 'queued', completed_at = NULL WHERE knowledge_space_id = '{sp}';
        UPDATE sources SET status = 'syncing' WHERE knowledge_space_id = '{sp}';
        "#,
        t = s.tenant,
        sp = s.id,
        snap = s.owner_snapshot,
        live_fs = Uuid::from_u128(1),
        stale_fs = Uuid::from_u128(2),
    ))
    .execute(pool)
    .await
    .unwrap();
    let objects = files_under(&fx.dir, &s.prefix);

    let job = request(pool, &space_request(&s, "drain")).await.unwrap();
    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    for _ in 0..3 {
        driver.turn().await;
        skip_wait(pool, job).await;
    }
    let row: (String, String, i32, Option<String>) = sqlx::query_as(
        "SELECT run_state, checkpoint, execution_attempts, last_error_code FROM deletion_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        row,
        (
            "retry_wait".into(),
            "quiescing".into(),
            0,
            Some("waiting".into())
        )
    );
    let one = |sql: &'static str, id: Uuid| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(sql)
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    const LEASE: &str = "SELECT status FROM retrieval_execution_leases WHERE id = $1";
    const FS: &str = "SELECT status FROM knowledge_fs_leases WHERE id = $1";
    const ATTEMPT: &str = "SELECT run_state FROM document_compilation_attempts WHERE id = $1";
    const TASK: &str = "SELECT stage FROM research_task_jobs WHERE id = $1";
    // What holds a live lease is only waited for.
    assert_eq!(
        one(LEASE, live).await,
        "active",
        "a live lease is never reclaimed"
    );
    assert_eq!(one(FS, Uuid::from_u128(1)).await, "active");
    assert_eq!(one(ATTEMPT, running).await, "running");
    assert_eq!(one(TASK, live_task).await, "retrieving");
    // What expired is reclaimed; what is only queued is canceled.
    assert_eq!(
        one(LEASE, stale).await,
        "expired",
        "an expired lease is reclaimed"
    );
    assert_eq!(one(FS, Uuid::from_u128(2)).await, "released");
    assert_eq!(one(ATTEMPT, queued).await, "canceled");
    assert_eq!(
        one(
            "SELECT status FROM document_compilation_outbox WHERE attempt_id = $1",
            queued
        )
        .await,
        "canceled"
    );
    assert_eq!(one(TASK, queued_task).await, "canceled");
    assert_eq!(
        one(
            "SELECT status FROM research_task_outbox WHERE research_task_job_id = $1",
            queued_task
        )
        .await,
        "canceled"
    );
    let (mutation, staged, backfill, syncing): (i64, i64, String, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM knowledge_space_mutation_leases WHERE knowledge_space_id = $1), \
                (SELECT count(*) FROM knowledge_space_staged_commits WHERE knowledge_space_id = $1 AND status <> 'canceled'), \
                (SELECT run_state || ':' || coalesce(last_error_code, '') FROM source_credential_backfills WHERE knowledge_space_id = $1), \
                (SELECT count(*) FROM sources WHERE knowledge_space_id = $1 AND status = 'syncing')",
    )
    .bind(s.id)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(mutation, 0, "the expired mutation lease is reclaimed");
    assert_eq!(staged, 0, "staged commits are canceled");
    assert_eq!(backfill, "failed:DURABLE_DELETION_FENCE");
    assert_eq!(syncing, 0, "syncing sources are disabled");
    // Nothing destructive happened while anything was live.
    assert_eq!(files_under(&fx.dir, &s.prefix), objects);
    let items: i64 =
        sqlx::query_scalar("SELECT count(*) FROM deletion_job_items WHERE deletion_job_id = $1")
            .bind(job)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(items, 0);

    // The holders finish or die: their leases end.
    sqlx::raw_sql(&format!(
        "UPDATE retrieval_execution_leases SET status = 'released', updated_at = now() WHERE id = '{live}'; \
         UPDATE knowledge_fs_leases SET status = 'released', updated_at = now() WHERE id = '{}'; \
         UPDATE document_compilation_attempts SET lease_expires_at = now() - interval '1 second' WHERE id = '{running}'; \
         UPDATE research_task_jobs SET lease_expires_at = {ms} - 1000 WHERE id = '{live_task}';",
        Uuid::from_u128(1)
    ))
    .execute(pool)
    .await
    .unwrap();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    let cat = catalog(pool).await;
    let left = cat.count_owned(pool, Some(s.id), &s.docs).await;
    assert!(left.is_empty(), "{left:?}");
    assert!(files_under(&fx.dir, &s.prefix).is_empty());
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failing_items_retry_then_die_and_a_manual_retry_under_either_authority_finishes_the_job() {
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
            item_max_attempts: 3,
            ..fast_config()
        });
    let driver = Driver::new(&fx, Arc::new(h), Budget::default()).await;

    // Requested by bob (an MCP client); rescued later by the owner, interactively.
    let bob = snapshot_for(&fx, &s, "bob", "mcp").await;
    let by_bob = |doc: Uuid, key: &str| DeletionRequest {
        requested_by_subject_id: "bob".into(),
        permission_snapshot_id: bob,
        access_channel: "mcp".into(),
        ..target_request(&s, Target::Document { id: doc }, key)
    };
    let doc = s.docs[1];
    let job = request(pool, &by_bob(doc, "fail-1")).await.unwrap();
    // The request seeds the raw object's item with the job's attempts; this test gives every
    // item three.
    sqlx::query(
        "UPDATE deletion_job_items SET max_attempts = 3 WHERE deletion_job_id = $1 AND ordinal = 0",
    )
    .bind(job)
    .execute(pool)
    .await
    .unwrap();
    let (state, cp) = driver.finish(job, true).await;
    assert_eq!(
        (state.as_str(), cp.as_str()),
        ("failed", "deleting_objects")
    );
    let row: (Option<String>, Option<i32>, String) = sqlx::query_as(
        "SELECT last_error_code, active_slot, (SELECT status FROM deletion_outbox WHERE deletion_job_id = $1 \
           AND delivery_revision = 1) FROM deletion_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        row,
        (Some("item_dead".into()), Some(1), "dead".into()),
        "a failed deletion keeps its slot"
    );
    type Item = (String, i32, i32, Option<String>, bool, bool);
    let items = |pool: PgPool| async move {
        sqlx::query_as::<_, Item>(
            "SELECT status, attempts, max_attempts, last_error_code, object_key IS NOT NULL, redacted_at IS NULL \
             FROM deletion_job_items WHERE deletion_job_id = $1 AND kind = 'object' ORDER BY ordinal",
        )
        .bind(job)
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    let dead = items(pool.clone()).await;
    // The request's raw item and the inventory's item for the same key, each on its own schedule.
    assert_eq!(dead.len(), 2, "{dead:?}");
    for d in &dead {
        assert_eq!(
            d,
            &("dead".into(), 3, 3, Some("object_store".into()), true, true)
        );
    }
    assert_eq!(
        flaky.calls.load(Ordering::SeqCst),
        6,
        "one call per item and attempt"
    );
    // Still fenced: no new request can take the target while the failed job holds it.
    assert!(matches!(
        request(pool, &by_bob(doc, "fail-again")).await,
        Err(RequestError::TargetBusy { .. })
    ));

    let retry = |actor: &str, snap: Uuid, channel: &str, authority: RetryAuthority, key: &str| {
        RetryRequest {
            job_id: job,
            actor_subject_id: actor.into(),
            permission_snapshot_id: snap,
            access_channel: channel.into(),
            authority,
            idempotency_key: key.into(),
        }
    };
    let do_retry = |r: RetryRequest| {
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            let out = retry_deletion(&mut tx, &r).await;
            tx.commit().await.unwrap();
            out
        }
    };
    // Refused: a stranger claiming to be the requester; an owner rescue outside the interactive
    // channel; an interactive "rescue" by someone who is not an owner.
    let carol = snapshot_for(&fx, &s, "carol", "interactive").await;
    let owner_mcp = snapshot_for(&fx, &s, OWNER, "mcp").await;
    for (r, why) in [
        (
            retry(
                "carol",
                carol,
                "interactive",
                RetryAuthority::OriginalRequester,
                "r0",
            ),
            "not the subject that requested",
        ),
        (
            retry(
                OWNER,
                owner_mcp,
                "mcp",
                RetryAuthority::InteractiveOwnerRescue,
                "r0",
            ),
            "interactive",
        ),
        (
            retry(
                "carol",
                carol,
                "interactive",
                RetryAuthority::InteractiveOwnerRescue,
                "r0",
            ),
            "owner",
        ),
    ] {
        let out = do_retry(r).await;
        assert!(
            matches!(&out, Err(RequestError::RetryRefused(m)) if m.contains(why)),
            "{why}: {out:?}"
        );
    }
    let audits: i64 = sqlx::query_scalar("SELECT count(*) FROM deletion_retry_audits")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(audits, 0);

    // The original requester retries; the same request again is the same retry.
    let r1 = retry("bob", bob, "mcp", RetryAuthority::OriginalRequester, "r1");
    let first = do_retry(r1.clone()).await.unwrap();
    let again = do_retry(r1).await.unwrap();
    assert!(first.created && !again.created && first.outbox_id == again.outbox_id);
    assert_eq!(first.delivery_revision, 2);
    let (state, rv_ok, room, err): (String, bool, bool, Option<String>) = sqlx::query_as(
        "SELECT run_state, row_version > 1, max_execution_attempts > execution_attempts, last_error_code \
         FROM deletion_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        (state.as_str(), rv_ok, room, err),
        ("dispatch_pending", true, true, None)
    );
    for item in items(pool.clone()).await {
        assert_eq!(
            (item.0.as_str(), item.1, item.2),
            ("pending", 0, 4),
            "re-armed with one more attempt"
        );
    }
    let outbox: (String, String) =
        sqlx::query_as("SELECT idempotency_key, status FROM deletion_outbox WHERE id = $1")
            .bind(first.outbox_id)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(outbox, (format!("deletion:{job}:2"), "pending".into()));
    // Still broken: the re-armed attempts fail, and the job fails again.
    assert_eq!(driver.finish(job, true).await.0, "failed");
    assert_eq!(flaky.calls.load(Ordering::SeqCst), 6 + 8);

    // Now the owner rescues it, interactively, and the store works again.
    flaky.broken.store(false, Ordering::SeqCst);
    let rescued = do_retry(retry(
        OWNER,
        s.owner_snapshot,
        "interactive",
        RetryAuthority::InteractiveOwnerRescue,
        "r2",
    ))
    .await
    .unwrap();
    assert_eq!(rescued.delivery_revision, 3);
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    let audit: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT retry_authority, actor_subject_id, access_channel FROM deletion_retry_audits \
         WHERE deletion_job_id = $1 ORDER BY created_at",
    )
    .bind(job)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        audit,
        vec![
            ("original_requester".into(), "bob".into(), "mcp".into()),
            (
                "interactive_owner_rescue".into(),
                OWNER.into(),
                "interactive".into()
            ),
        ]
    );
    let requester: String =
        sqlx::query_scalar("SELECT requested_by_subject_id FROM deletion_jobs WHERE id = $1")
            .bind(job)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(requester, "bob", "a rescue never rewrites the requester");
    assert!(files_under(&fx.dir, &format!("{}/documents/{doc}", s.prefix)).is_empty());
    assert!(!files_under(&fx.dir, &format!("{}/documents/{}", s.prefix, s.docs[0])).is_empty());
    // A job that did not fail cannot be retried.
    let out = do_retry(retry(
        "bob",
        bob,
        "mcp",
        RetryAuthority::OriginalRequester,
        "r3",
    ))
    .await;
    assert!(
        matches!(out, Err(RequestError::NotRetryable { .. })),
        "{out:?}"
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn residue_found_at_the_end_sends_the_job_back_to_quiescing() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 1, 2).await;
    let pool = fx.pool();
    let job = request(pool, &space_request(&s, "residue")).await.unwrap();
    // One step per slice, so the test sees every checkpoint.
    let driver = Driver::new(
        &fx,
        Arc::new(handler(&fx)),
        Budget {
            max_steps: 1,
            max_time: Duration::from_secs(20),
        },
    )
    .await;
    let mut straggler = None;
    let mut checkpoints = Vec::new();
    for _ in 0..2000 {
        let (state, cp) = job_state(pool, job).await;
        assert_ne!(state, "failed");
        if checkpoints.last() != Some(&cp) {
            checkpoints.push(cp.clone());
        }
        if cp == "deleting_derived_data" && straggler.is_none() {
            // A writer that ignores the fence adds a document (with its bytes).
            let mut c = conn(pool).await;
            let d = platform::add_document(
                &mut c,
                &fx.store,
                s.id,
                None,
                "late.md",
                "text/markdown",
                Bytes::from_static(b"# late\n\nwritten after the inventory"),
            )
            .await
            .unwrap();
            let key: String =
                sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
                    .bind(d)
                    .fetch_one(pool)
                    .await
                    .unwrap();
            straggler = Some(key);
        }
        if state == "succeeded" {
            break;
        }
        if state == "retry_wait" {
            skip_wait(pool, job).await;
        }
        driver.turn().await;
    }
    let straggler = straggler.expect("the job passed through deleting_derived_data");
    assert_finished_clean(pool, job).await;
    let back = checkpoints
        .windows(2)
        .any(|w| w[0] == "deleting_primary_data" && w[1] == "quiescing");
    assert!(
        back,
        "the residue sent the job back to quiescing: {checkpoints:?}"
    );
    let cursor: Option<String> =
        sqlx::query_scalar("SELECT scan_cursor FROM deletion_jobs WHERE id = $1")
            .bind(job)
            .fetch_one(pool)
            .await
            .unwrap();
    assert!(
        cursor.unwrap_or_default().contains("\"pass\":2"),
        "a second inventory pass ran"
    );
    let erased: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM deletion_job_items WHERE deletion_job_id = $1 AND idempotency_key = $2 \
           AND status = 'completed'",
    )
    .bind(job)
    .bind(format!("object:{}", platform::sha256_hex(straggler.as_bytes())))
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        erased, 1,
        "the straggler's object was inventoried and erased"
    );
    assert!(!fx.dir.join(&straggler).exists());
    let cat = catalog(pool).await;
    let left = cat.count_owned(pool, Some(s.id), &s.docs).await;
    assert!(left.is_empty(), "{left:?}");
    assert!(files_under(&fx.dir, &s.prefix).is_empty());
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cli_requests_and_refuses_with_one_line() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 1).await;
    let run = |args: Vec<String>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"));
        cmd.args(&args)
            .env("DATABASE_URL", &fx.env.url)
            .env("KFS_OBJECT_STORE", &fx.store_url);
        cmd.output().unwrap()
    };
    let doc = s.docs[0].to_string();
    let base = |key: &str| -> Vec<String> {
        [
            "delete",
            "document",
            &doc,
            "--space",
            &s.id.to_string(),
            "--tenant",
            &s.tenant,
            "--as",
            OWNER,
            "--snapshot",
            &s.owner_snapshot.to_string(),
            "--idempotency-key",
            key,
        ]
        .iter()
        .map(|a| a.to_string())
        .collect()
    };
    let out = run(base("cli-1"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["created"], true);
    let job = v["jobId"].as_str().unwrap().to_owned();
    let again: serde_json::Value = serde_json::from_slice(&run(base("cli-1")).stdout).unwrap();
    assert_eq!(
        (again["jobId"].as_str(), &again["created"]),
        (Some(job.as_str()), &serde_json::json!(false))
    );
    let busy = run(base("cli-2"));
    assert_eq!(busy.status.code(), Some(2));
    let err = String::from_utf8_lossy(&busy.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("already has a live deletion job"), "{err}");
    // Retrying a job that has not failed is refused.
    let retry = run([
        "delete",
        "retry",
        &job,
        "--as",
        OWNER,
        "--snapshot",
        &s.owner_snapshot.to_string(),
        "--channel",
        "interactive",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect());
    assert_eq!(
        retry.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&retry.stderr)
    );
    assert!(String::from_utf8_lossy(&retry.stderr).contains("only a failed job can be retried"));
    let show = run(vec!["delete".into(), "show".into(), job.clone()]);
    let v: serde_json::Value = serde_json::from_slice(&show.stdout).unwrap();
    assert_eq!(v["runState"], "dispatch_pending");
    assert_eq!(v["items"]["pending"], 1, "the raw object's item: {v}");
    fx.cleanup().await;
}

#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_at_any_kill_point_mid_deletion_is_finished_by_another() {
    // This deletion's passes through the kill points, three steps a slice. Slice 1: the claim
    // (`after-claim-commit`), `requested → quiescing` (`after-step-commit:1`), the inventory
    // and the head exclusion (`:2`), then the batch of object items, which ends the slice (`:3`,
    // `before-ack:1`). Slice 2: no item left, on to the derived rows (`:4`), their one page
    // (`:5`), none left, which ends the slice (`:6`, `before-ack:2`). Slices 3 and 4: the
    // primary pages, the space's logical-document rows first (the active revisions unset `:7`,
    // the revision chunks `:8`, the revisions `:9`, `before-ack:3`, the logical documents
    // `:10`), then its documents, no longer referenced (`:11`), then the completing step (`:12`).
    // Every pass before the end is killed at; the last entry checks that pass 12 is the end, so
    // a deletion that gains a step fails here instead of leaving that step's kill point untried.
    for (point, ended) in [
        ("after-claim-commit", false),
        ("after-step-commit:1", false),
        ("after-step-commit:2", false),
        ("after-step-commit:3", false),
        ("before-ack:1", false),
        ("after-step-commit:4", false),
        ("after-step-commit:5", false),
        ("after-step-commit:6", false),
        ("before-ack:2", false),
        ("after-step-commit:7", false),
        ("after-step-commit:8", false),
        ("after-step-commit:9", false),
        ("before-ack:3", false),
        ("after-step-commit:10", false),
        ("after-step-commit:11", false),
        ("after-step-commit:12", true),
    ] {
        let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
        let s = seed(&fx, "tenant-t", "main", "Docs", 1, 2).await;
        let other = seed(&fx, "tenant-u", "main", "Docs", 0, 1).await;
        let pool = fx.pool();
        let cat = catalog(pool).await;
        let before = untouched(&fx, &cat, &[&other]).await;
        let job = request(pool, &space_request(&s, "crash")).await.unwrap();
        // The workers run the relay, the consumers and maintenance, not the leased runner: its
        // profile backfills would change the other tenant's rows this test proves untouched.
        let common_env = [
            ("KFS_OBJECT_STORE", fx.store_url.as_str()),
            ("KFS_SLICE_STEPS", "3"),
            ("KFS_RELAY_POLL", "100ms"),
        ];
        let mut crash_env = common_env.to_vec();
        crash_env.push(("KFS_CRASH_AT", point));
        let mut doomed = fx.env.spawn_worker(
            &format!("doomed-{point}"),
            &[
                "run",
                "--relay",
                "--consumer",
                "--maintenance",
                "--kinds",
                "deletion",
            ],
            &crash_env,
        );
        let exited = doomed.wait_exit(Duration::from_secs(60));
        assert!(
            exited.is_some(),
            "{point}: the worker did not reach its kill point\n{}",
            doomed.log_text()
        );
        assert!(
            !exited.unwrap().success(),
            "{point}: the worker exited normally"
        );
        let (state, cp) = job_state(pool, job).await;
        if ended {
            // Killed after the completing commit, before the ack: the rescuer only acks.
            assert_eq!(
                (state.as_str(), cp.as_str()),
                ("succeeded", "completed"),
                "{point}: the completing step is not the 12th pass"
            );
        } else {
            assert_ne!(
                state, "succeeded",
                "{point}: finished before the kill ({cp})"
            );
        }

        let mut rescuer = fx.env.spawn_worker(
            &format!("rescuer-{point}"),
            &[
                "run",
                "--relay",
                "--consumer",
                "--maintenance",
                "--kinds",
                "deletion",
            ],
            &common_env,
        );
        let p = pool.clone();
        let done = fx
            .env
            .wait_until(Duration::from_secs(90), || {
                let p = p.clone();
                async move { job_state(&p, job).await.0 == "succeeded" }
            })
            .await;
        assert!(
            done,
            "{point}: {:?}\n{}",
            job_state(pool, job).await,
            rescuer.log_text()
        );
        if ended {
            // The unacked delivery comes back to the rescuer, which acks it as stale and runs
            // no step of the finished job.
            let settled =
                fx.env
                    .wait_until(Duration::from_secs(30), || {
                        let log = rescuer.log_text();
                        async move {
                            log.contains("acked kind=deletion") && log.contains("claim=\"stale\"")
                        }
                    })
                    .await;
            let log = rescuer.log_text();
            assert!(settled, "{point}: the redelivery was not settled\n{log}");
            assert!(
                !log.contains("deletion step"),
                "{point}: the finished job ran again\n{log}"
            );
        }
        crate::support::stop_cleanly([&mut rescuer], Duration::from_secs(30)).await;
        assert_finished_clean(pool, job).await;
        let left = cat.count_owned(pool, Some(s.id), &s.docs).await;
        assert!(left.is_empty(), "{point}: {left:?}");
        assert!(
            files_under(&fx.dir, &s.prefix).is_empty(),
            "{point}: objects left behind"
        );
        assert_untouched(&fx, &cat, &[&other], &before).await;
        fx.cleanup().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_compile_building_on_a_publication_of_the_deleted_document_is_waited_for_not_deleted() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 0).await;
    let pool = fx.pool();
    let doc = fx
        .add("gone.md", "text/markdown", note(1, "gone").as_bytes())
        .await;
    fx.compile(doc).await;
    // Another document's compile has evaluated its candidate; it only has to publish.
    let other = fx
        .add("other.md", "text/markdown", note(2, "other").as_bytes())
        .await;
    let attempt = fx.request(other, false).await.unwrap();
    let step = fx.engine("w-step", 1);
    fx.drive_to(&step, attempt, "smoke_eval_passed").await;
    let candidate = fx.status(attempt).await.candidate_publication_id.unwrap();

    let job = request(
        pool,
        &target_request(&s, Target::Document { id: doc }, "held"),
    )
    .await
    .unwrap();
    // Its publish completes the candidate over the head that serves `doc`, finds the deletion
    // under way and waits for it: the candidate now holds `doc`'s members.
    assert_eq!(
        fx.slice(&step, attempt).await,
        kfs_worker::consumer::Handled::Ack {
            claim: "claimed",
            end: Some("wait")
        }
    );
    let mut c = conn(pool).await;
    let inherited = publication::members(&mut c, s.id, candidate).await.unwrap();
    drop(c);
    assert!(inherited.iter().any(|m| m.document_asset_id == Some(doc)));
    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    let mut held = false;
    for _ in 0..200 {
        driver.turn().await;
        let (state, cp, why): (String, String, Option<String>) = sqlx::query_as(
            "SELECT run_state, checkpoint, last_error_message FROM deletion_jobs WHERE id = $1",
        )
        .bind(job)
        .fetch_one(pool)
        .await
        .unwrap();
        assert_ne!(
            state, "succeeded",
            "the deletion did not wait for the compile"
        );
        assert_ne!(state, "failed");
        if state == "retry_wait" && cp == "deleting_derived_data" {
            assert!(why.unwrap_or_default().contains("active compile attempt"));
            held = true;
            break;
        }
        skip_wait(pool, job).await;
    }
    assert!(held, "the deletion waits at deleting_derived_data");
    let st = fx.status(attempt).await;
    assert_eq!(
        (st.active_slot, st.run_state.as_str()),
        (Some(1), "retry_wait"),
        "{st:?}"
    );

    // The compile goes on (its wait cut short): it rebases onto the head without `doc` and
    // publishes; then the deletion finishes, and the compile's attempt is still there.
    sqlx::query("UPDATE document_compilation_attempts SET retry_at = now() WHERE id = $1")
        .bind(attempt)
        .execute(pool)
        .await
        .unwrap();
    let st = fx.drive(&fx.engine("w-rest", 64), attempt).await;
    assert_eq!(st.run_state, "succeeded", "{st:?}");
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    assert_eq!(fx.status(attempt).await.run_state, "succeeded");
    assert_eq!(served(pool, &s).await, BTreeSet::from([other]));
    fx.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// Capability grants, logical documents and the platform's 0019..0054 keys

/// A grant for an agent of the space admitting `scopes`.
async fn grant_for(fx: &SpaceFx, s: &Space, scopes: &[&str]) -> Uuid {
    let mut c = conn(fx.pool()).await;
    let scopes: Vec<String> = scopes.iter().map(|x| (*x).to_owned()).collect();
    platform::create_capability_grant(&mut c, &s.tenant, s.id, "agent-7", &scopes)
        .await
        .unwrap()
}

fn grant_request(s: &Space, target: Target, grant: Uuid, key: &str) -> GrantDeletionRequest {
    GrantDeletionRequest {
        tenant_id: s.tenant.clone(),
        knowledge_space_id: s.id,
        target,
        expected_revision: None,
        capability_grant_id: grant,
        idempotency_key: key.into(),
    }
}

async fn request_under_grant(
    pool: &PgPool,
    req: &GrantDeletionRequest,
) -> Result<Uuid, RequestError> {
    let mut tx = pool.begin().await.unwrap();
    let r = request_deletion_under_grant(&mut tx, req).await;
    tx.commit().await.unwrap();
    r.map(|r| r.job_id)
}

/// The space's rows, every table but the deletion job's own (which a failure writes).
async fn rows_but_the_jobs(cat: &Catalog, pool: &PgPool, space: Uuid) -> BTreeMap<String, String> {
    let mut rows = cat.fingerprint(pool, space).await;
    rows.retain(|t, _| !kept_by_design(t));
    rows
}

/// What a job failed closed on its grant holds: run state, checkpoint, error, slot, tombstone
/// state, and the statuses of its outbox rows.
type Closed = (
    String,
    String,
    Option<String>,
    Option<String>,
    Option<i32>,
    String,
    Vec<String>,
);

async fn closed(pool: &PgPool, job: Uuid) -> Closed {
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

fn failed_closed_at(cp: &str) -> Closed {
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
async fn items_of(pool: &PgPool, job: Uuid) -> Vec<(i64, String, bool)> {
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
async fn backfill_logical_documents(pool: &PgPool, docs: &[Uuid]) {
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
fn revision_sql(s: &Space, doc: Uuid, revision: i32, asset: Uuid, state: &str) -> String {
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
async fn source_run(pool: &PgPool, s: &Space, source: Uuid, grant: Option<Uuid>) -> Uuid {
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
async fn connect_source(pool: &PgPool, s: &Space, source: Uuid, grant: Option<Uuid>) -> Uuid {
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
async fn bind_head(pool: &PgPool, s: &Space) -> (Uuid, i32, Uuid, i32, String) {
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
type Binding = (
    (Uuid, String, String, String, bool),
    (Uuid, i32, Uuid, i32, String),
);

async fn binding_of(pool: &PgPool, publication: Uuid) -> Option<Binding> {
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

async fn count(pool: &PgPool, sql: &str, id: Uuid) -> i64 {
    sqlx::query_scalar(sql)
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_logical_document_deleted_at_revision_zero_leaves_nothing_of_it_and_keeps_a_shared_asset()
{
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 1).await;
    let pool = fx.pool();
    // Logical document `ld`, as uploads and compiles write it: uploaded as `shared.md`
    // (revision 1), then a new revision uploaded as `owned.md` (revision 2, its own asset);
    // compiling that activates it and supersedes revision 1, each with its chunks.
    let shared = fx
        .add("shared.md", "text/markdown", note(2, "shared").as_bytes())
        .await;
    fx.compile(shared).await;
    let mut c = conn(pool).await;
    let ld = platform::logical_document_of(&mut c, shared)
        .await
        .unwrap()
        .unwrap();
    let owned = platform::add_revision(
        &mut c,
        &fx.store,
        ld,
        "owned.md",
        "text/markdown",
        Bytes::from(note(1, "owned")),
    )
    .await
    .unwrap();
    drop(c);
    fx.compile(owned).await;
    let revisions: Vec<(i32, Uuid, String)> = sqlx::query_as(
        "SELECT revision, document_asset_id, state FROM document_revisions WHERE document_id = $1 ORDER BY revision",
    )
    .bind(ld)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        revisions,
        vec![
            (1, shared, "superseded".into()),
            (2, owned, "active".into())
        ]
    );
    let chunk: Uuid = sqlx::query_scalar(
        "SELECT id FROM document_revision_chunks WHERE document_id = $1 AND document_revision = 2 \
         ORDER BY ordinal LIMIT 1",
    )
    .bind(ld)
    .fetch_one(pool)
    .await
    .unwrap();
    // Beside it: a chunk state change, settings and a reindex attempt of revision 2, and an
    // activity event; `keeper`, another document, has its active revision on the shared asset.
    // The request fences the document's row_version, which the platform lets be 0 (as an upload
    // leaves it): `ld` is put back at 0 to be asked for at revision zero.
    let keeper = Uuid::new_v4();
    let (t, sp) = (&s.tenant, s.id);
    let attempt = Uuid::new_v4();
    sqlx::raw_sql(&format!(
        r#"
        BEGIN;
        INSERT INTO logical_documents (id, tenant_id, knowledge_space_id, title, status, active_revision, row_version,
          system_metadata, user_metadata, created_at, updated_at)
        VALUES ('{keeper}', '{t}', '{sp}', 'Keeper', 'ready', 1, 0, '{{}}', '{{}}', now(), now());
        {k1}
        COMMIT;
        UPDATE logical_documents SET row_version = 0 WHERE id = '{ld}';
        INSERT INTO document_chunk_state_changes (id, tenant_id, knowledge_space_id, document_id, document_revision, chunk_id,
          compilation_attempt_id, enabled, state, created_at, activated_at)
        VALUES (gen_random_uuid(), '{t}', '{sp}', '{ld}', 2, '{chunk}', '{attempt}', false, 'active', now(), now());
        INSERT INTO document_settings_revisions (tenant_id, knowledge_space_id, document_id, revision, settings, state,
          created_by_subject_id, created_at, activated_at)
        VALUES ('{t}', '{sp}', '{ld}', 1, '{{}}', 'active', '{OWNER}', now(), now());
        INSERT INTO document_settings_heads (tenant_id, knowledge_space_id, document_id, active_revision, row_version, updated_at)
        VALUES ('{t}', '{sp}', '{ld}', 1, 0, now());
        INSERT INTO document_reindex_attempts (id, tenant_id, knowledge_space_id, document_id, document_revision,
          settings_revision, expected_settings_head_revision, compilation_attempt_id, state, active_slot, row_version,
          created_at, updated_at, completed_at)
        VALUES (gen_random_uuid(), '{t}', '{sp}', '{ld}', 2, 1, 1, '{attempt}', 'succeeded', NULL, 1, now(), now(), now());
        INSERT INTO knowledge_space_activity_events (id, tenant_id, knowledge_space_id, action, actor_type, details,
          occurred_at, required_permission_scope, resource_id, resource_type, result)
        VALUES (gen_random_uuid(), '{t}', '{sp}', 'document.published', 'system', '{{}}', now(), '[]', '{ld}', 'document', 'success');
        "#,
        k1 = revision_sql(&s, keeper, 1, shared, "active"),
    ))
    .execute(pool)
    .await
    .unwrap();
    let cat = catalog(pool).await;
    let mut needles = needles_of(&fx, &s, owned).await;
    needles.push(ld.to_string());

    // Requested on the command line, at the document's row_version 0.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"))
        .args([
            "delete",
            "logical-document",
            &ld.to_string(),
            "--space",
            &s.id.to_string(),
            "--tenant",
            &s.tenant,
            "--revision",
            "0",
            "--as",
            OWNER,
            "--snapshot",
            &s.owner_snapshot.to_string(),
        ])
        .env("DATABASE_URL", &fx.env.url)
        .env("KFS_OBJECT_STORE", &fx.store_url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let job: Uuid = v["jobId"].as_str().unwrap().parse().unwrap();
    let fenced: (String, i32, String, i32) = sqlx::query_as(
        "SELECT j.target_type, j.target_revision, l.status, l.row_version FROM deletion_jobs j \
         JOIN logical_documents l ON l.id = j.target_id WHERE j.id = $1",
    )
    .bind(job)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(fenced, ("logical_document".into(), 0, "deleting".into(), 1));
    // Only the asset it alone references is fenced.
    let states: Vec<(Uuid, String, Option<Uuid>)> = sqlx::query_as(
        "SELECT id, lifecycle_state, deletion_job_id FROM document_assets WHERE id = ANY($1) ORDER BY id = $2 DESC",
    )
    .bind(vec![owned, shared])
    .bind(owned)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        states,
        vec![
            (owned, "deleting".into(), Some(job)),
            (shared, "active".into(), None)
        ]
    );

    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    for table in [
        "document_reindex_attempts",
        "document_chunk_state_changes",
        "document_revision_chunks",
        "document_settings_heads",
        "document_settings_revisions",
        "document_revisions",
    ] {
        let n = count(
            pool,
            &format!("SELECT count(*) FROM {table} WHERE document_id = $1"),
            ld,
        )
        .await;
        assert_eq!(n, 0, "{table}");
    }
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM logical_documents WHERE id = $1",
            ld
        )
        .await,
        0
    );
    assert_documents_gone(&fx, &cat, &s, &[owned], &needles).await;
    // The shared asset and the other document are as they were, still served.
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM document_revisions WHERE document_id = $1 AND state = 'active'",
            keeper
        )
        .await,
        1
    );
    let served = served(pool, &s).await;
    assert!(
        served.contains(&shared) && !served.contains(&owned),
        "{served:?}"
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_document_with_its_0022_logical_document_is_deleted_despite_the_restrict_key_then_the_logical_document_too(
) {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 2).await;
    let pool = fx.pool();
    backfill_logical_documents(pool, &s.docs).await;
    let doc = s.docs[1];
    // An unpublished logical document whose only revision is a candidate of the same asset, as
    // the API leaves an upload that never compiled.
    let pending = Uuid::new_v4();
    sqlx::raw_sql(&format!(
        "INSERT INTO logical_documents (id, tenant_id, knowledge_space_id, title, status, active_revision, row_version, \
           system_metadata, user_metadata, created_at, updated_at) \
         VALUES ('{pending}', '{}', '{}', 'Pending', 'pending', NULL, 0, '{{}}', '{{}}', now(), now()); {}",
        s.tenant,
        s.id,
        revision_sql(&s, pending, 1, doc, "candidate")
    ))
    .execute(pool)
    .await
    .unwrap();
    let restrict: String = sqlx::query_scalar(
        "SELECT confdeltype::text FROM pg_constraint WHERE conrelid = 'document_revisions'::regclass \
           AND confrelid = 'document_assets'::regclass",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(restrict, "r", "the 0022 key is ON DELETE RESTRICT");
    let cat = catalog(pool).await;
    let needles = needles_of(&fx, &s, doc).await;

    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    let job = request(
        pool,
        &target_request(&s, Target::Document { id: doc }, "a1"),
    )
    .await
    .unwrap();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    let owned = cat.count_owned(pool, None, &[doc]).await;
    assert!(owned.is_empty(), "rows of the document left: {owned:?}");
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM logical_documents WHERE id = $1",
            pending
        )
        .await,
        0
    );
    // As the platform does, the logical document whose active revision it was stays, failed and
    // without a revision, for a logical-document deletion; the other document is untouched.
    let left: (String, Option<i32>, i32) = sqlx::query_as(
        "SELECT status, active_revision, row_version FROM logical_documents WHERE id = $1",
    )
    .bind(doc)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((left.0.as_str(), left.1), ("failed", None));
    assert_eq!(
        count(pool, "SELECT count(*) FROM logical_documents WHERE id = $1 AND status = 'ready' AND active_revision IS NOT NULL", s.docs[0]).await,
        1
    );

    let job = request(
        pool,
        &DeletionRequest {
            expected_revision: Some(left.2),
            ..target_request(&s, Target::LogicalDocument { id: doc }, "a2")
        },
    )
    .await
    .unwrap();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    assert_documents_gone(&fx, &cat, &s, &[doc], &needles).await;
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_source_with_workflow_runs_a_sync_policy_and_logical_documents_is_deleted_despite_the_restrict_keys(
) {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 1, 2).await;
    let pool = fx.pool();
    let source = s.sources[0];
    backfill_logical_documents(pool, &s.docs).await;
    let connection = connect_source(pool, &s, source, None).await;
    let run = source_run(pool, &s, source, None).await;
    let cat = catalog(pool).await;

    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    let job = request(
        pool,
        &target_request(
            &s,
            Target::Source {
                id: source,
                mode: SourceMode::Cascade,
            },
            "s1",
        ),
    )
    .await
    .unwrap();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    for (sql, id) in [
        ("SELECT count(*) FROM sources WHERE id = $1", source),
        (
            "SELECT count(*) FROM source_workflow_runs WHERE id = $1",
            run,
        ),
        (
            "SELECT count(*) FROM source_workflow_outbox WHERE run_id = $1",
            run,
        ),
        (
            "SELECT count(*) FROM source_sync_policies WHERE source_id = $1",
            source,
        ),
    ] {
        assert_eq!(count(pool, sql, id).await, 0, "{sql}");
    }
    let owned = cat.count_owned(pool, None, &s.docs).await;
    assert!(
        owned.is_empty(),
        "rows of the source's documents left: {owned:?}"
    );
    let logical: i64 =
        sqlx::query_scalar("SELECT count(*) FROM logical_documents WHERE id = ANY($1)")
            .bind(&s.docs)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(logical, 0, "the source's logical documents went with it");
    // The platform leaves the connection: the source named it, not the other way round.
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM source_connections WHERE id = $1",
            connection
        )
        .await,
        1
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_space_with_source_connections_bindings_and_a_capability_grant_is_deleted_under_that_grant(
) {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 1, 2).await;
    let c = seed(&fx, "tenant-u", "main", "Docs", 0, 1).await;
    let pool = fx.pool();
    let source = s.sources[0];
    backfill_logical_documents(pool, &s.docs).await;
    let grant = grant_for(&fx, &s, &["tenant:tenant-t"]).await;
    // Rows that name the grant or the publications by RESTRICT keys: a connection made under
    // the grant (the source uses it), a run and a sync policy under it, an OAuth transaction,
    // and the head's profile binding.
    let connection = connect_source(pool, &s, source, Some(grant)).await;
    source_run(pool, &s, source, Some(grant)).await;
    sqlx::query(
        "INSERT INTO source_oauth_transactions (id, tenant_id, knowledge_space_id, connection_id, access_channel, \
           permission_snapshot_id, permission_snapshot_revision, requested_by_subject_id, redirect_uri, state_hash, \
           status, verifier_ref, expires_at, created_at) \
         VALUES (gen_random_uuid(), $1, $2, $3, 'interactive', $4, 1, $5, 'https://app.example/cb', repeat('b', 64), \
           'pending', 'verifier:1', now() + interval '10 minutes', now())",
    )
    .bind(&s.tenant)
    .bind(s.id)
    .bind(connection)
    .bind(s.owner_snapshot)
    .bind(OWNER)
    .execute(pool)
    .await
    .unwrap();
    bind_head(pool, &s).await;
    let cat = catalog(pool).await;
    let before = untouched(&fx, &cat, &[&c]).await;

    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    let job = request_under_grant(
        pool,
        &grant_request(
            &s,
            Target::Space {
                confirm_name: s.name.clone(),
            },
            grant,
            "sp1",
        ),
    )
    .await
    .unwrap();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    assert_finished_clean(pool, job).await;
    let left = cat.count_owned(pool, Some(s.id), &s.docs).await;
    assert!(left.is_empty(), "rows of the space left: {left:?}");
    assert!(files_under(&fx.dir, &s.prefix).is_empty());
    assert_untouched(&fx, &cat, &[&c], &before).await;
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_head_replacement_carries_the_heads_profile_binding_and_drops_the_old_one() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 3).await;
    let pool = fx.pool();
    let tuple = bind_head(pool, &s).await;
    let old = fx_head(pool, &s).await;

    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    let job = request(
        pool,
        &target_request(&s, Target::Document { id: s.docs[0] }, "b1"),
    )
    .await
    .unwrap();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    let new = fx_head(pool, &s).await;
    assert_ne!(new.publication_id, old.publication_id);
    assert_eq!(
        binding_of(pool, new.publication_id).await,
        Some((
            (
                new.publication_id,
                "content".into(),
                "content-publication".into(),
                new.fingerprint.clone(),
                true
            ),
            tuple.clone()
        ))
    );
    // The replaced head's publication served the document: it went as a historical
    // publication, its binding first.
    assert_eq!(binding_of(pool, old.publication_id).await, None);
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM projection_set_publications WHERE id = $1",
            old.publication_id
        )
        .await,
        0
    );

    // The publication module's own head replacement (what a deletion does, for other callers)
    // carries it too.
    let mut c = conn(pool).await;
    let moved = publication::publish_excluding(
        &mut c,
        &s.tenant,
        s.id,
        Uuid::new_v4(),
        Some(&[s.docs[1]]),
        &serde_json::json!({}),
    )
    .await
    .unwrap();
    assert!(matches!(moved, Some(Ok(_))), "{moved:?}");
    drop(c);
    let newer = fx_head(pool, &s).await;
    let carried = binding_of(pool, newer.publication_id).await.unwrap();
    assert_eq!((carried.0 .0, carried.1), (newer.publication_id, tuple));
    fx.cleanup().await;
}
