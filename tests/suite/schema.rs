//! The schema contract (DESIGN.md, "The schema contract").
//!
//! Invariants checked here, against a real Postgres (DATABASE_URL names the admin database):
//! - the project's migrations build the platform's whole schema as its migrations 0001–0054
//!   leave it (`../shared/tools/platform-compat --at 0054`);
//! - `kfs-worker migrate` adopts a database the platform built at 0054
//!   (`../shared/tools/platform-db`, filled with rows of every kind as today's API writes them,
//!   authorized by snapshots and by a capability grant): it adds only the project's own objects,
//!   changes no platform row or definition, ends with the schema a fresh database gets, and does
//!   nothing the second time;
//! - on a database the platform left at 0018 it refuses, naming the missing migrations, unless
//!   given `--upgrade-platform`; then the database ends at exactly the platform's 0054 schema and
//!   ledger with every row it had (and 0022's logical documents backfilled);
//! - it refuses, with one line naming the problem and nothing changed (with or without
//!   `--upgrade-platform`), a database that records a later platform migration than it knows, one
//!   whose ledger lacks one of the first eighteen, one whose ledger claims what its schema lacks,
//!   and one without the vector extension;
//! - running the migrations again on a fresh database is a no-op.
//!
//! Every test works in its own scratch database, dropped afterwards even when the test fails,
//! and holds the shared services (`support::isolation`) while it uses them.
//! Under `CI=true` a missing `../shared` fails the test instead of skipping it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;

use anyhow::{ensure, Context, Result};
use kfs_worker::db::migrate::PLATFORM_MIGRATIONS;
use kfs_worker::db::MIGRATOR;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Executor, PgPool};

use crate::support;

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn shared_dir() -> PathBuf {
    manifest_dir().join("..").join("shared")
}

/// A database of its own for one test. Dropped (with FORCE) when the value goes out of scope,
/// including when the test panics; it holds the shared services until then.
struct ScratchDb {
    name: String,
    admin: PgConnectOptions,
    pool: Option<PgPool>,
    /// Released after `Drop::drop` dropped the database.
    _services: support::isolation::Services,
}

impl ScratchDb {
    async fn create(tag: &str) -> Result<Self> {
        Self::build(tag, None)
            .await
            .map(|db| db.expect("an empty database needs no tool"))
    }

    /// A scratch database built by `platform-db --at AT`: the platform's schema and ledger as
    /// its migrations 0001..AT leave them. `None` when `../shared` is missing outside CI.
    async fn platform(tag: &str, at: &str) -> Result<Option<Self>> {
        Self::build(tag, Some(at)).await
    }

    async fn build(tag: &str, at: Option<&str>) -> Result<Option<Self>> {
        let services = support::isolation::shared().await;
        let admin = PgConnectOptions::from_str(&support::admin_url())
            .context("DATABASE_URL is not a Postgres URL")?;
        let name = format!("kfs_schema_{tag}_{}", uuid::Uuid::new_v4().simple());
        match at {
            Some(at) => {
                let built = platform_db(at, &name);
                if built.is_none() {
                    return Ok(None);
                }
            }
            None => {
                let mut conn = sqlx::ConnectOptions::connect(&admin)
                    .await
                    .context("connecting to the admin database (DATABASE_URL)")?;
                conn.execute(format!(r#"CREATE DATABASE "{name}""#).as_str())
                    .await
                    .with_context(|| format!("creating scratch database {name}"))?;
            }
        }
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(admin.clone().database(&name))
            .await
            .with_context(|| format!("connecting to scratch database {name}"))?;
        Ok(Some(Self {
            name,
            admin,
            pool: Some(pool),
            _services: services,
        }))
    }

    fn pool(&self) -> &PgPool {
        self.pool.as_ref().expect("pool lives until drop")
    }
}

impl Drop for ScratchDb {
    fn drop(&mut self) {
        // FORCE ends the sessions the dropped pool may still hold. Runs on a thread of its own
        // because Drop cannot await inside the test's runtime.
        drop(self.pool.take());
        let admin = self.admin.clone();
        let name = std::mem::take(&mut self.name);
        let outcome = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async {
                let mut conn = sqlx::ConnectOptions::connect(&admin).await?;
                conn.execute(format!(r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#).as_str())
                    .await?;
                anyhow::Ok(())
            })
            .with_context(|| format!("dropping scratch database {name}"))
        })
        .join();
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("warning: {e:#}"),
            Err(_) => eprintln!("warning: the thread dropping a scratch database panicked"),
        }
    }
}

async fn apply_sql(pool: &PgPool, what: &str, sql: &str) -> Result<()> {
    sqlx::raw_sql(sql)
        .execute(pool)
        .await
        .with_context(|| format!("inserting {what}"))?;
    Ok(())
}

/// `count digest` of every table's rows, keyed by table. The project's own migration ledger is
/// left out: adopting a database is expected to create it.
async fn row_digests(pool: &PgPool) -> Result<BTreeMap<String, String>> {
    let tables: Vec<String> = sqlx::query_scalar(
        r#"
        SELECT c.relname::text
        FROM pg_class c
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = current_schema() AND c.relkind = 'r' AND c.relname <> 'kfs_worker_migrations'
        ORDER BY 1
        "#,
    )
    .fetch_all(pool)
    .await?;
    let mut digests = BTreeMap::new();
    for table in tables {
        let digest: String = sqlx::query_scalar(&format!(
            r#"SELECT count(*)::text || ' ' || md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), ''))
               FROM "{table}" AS t"#
        ))
        .fetch_one(pool)
        .await
        .with_context(|| format!("digesting rows of {table}"))?;
        digests.insert(table, digest);
    }
    Ok(digests)
}

/// Catalog definitions of everything in the schema: columns (type, NOT NULL, default),
/// constraints, indexes, triggers and functions, keyed by kind and name.
async fn describe_schema(pool: &PgPool) -> Result<BTreeMap<String, String>> {
    let rows: Vec<(String, String)> = sqlx::query_as(
        r#"
        SELECT 'column ' || c.relname || '.' || a.attname,
               format_type(a.atttypid, a.atttypmod) || ' notnull=' || a.attnotnull
                 || ' default=' || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE n.nspname = current_schema() AND c.relkind = 'r' AND a.attnum > 0 AND NOT a.attisdropped
        UNION ALL
        SELECT 'constraint ' || c.relname || '.' || k.conname, pg_get_constraintdef(k.oid)
        FROM pg_constraint k
        JOIN pg_class c ON c.oid = k.conrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = current_schema()
        UNION ALL
        SELECT 'index ' || indexname, indexdef
        FROM pg_indexes
        WHERE schemaname = current_schema()
        UNION ALL
        SELECT 'trigger ' || c.relname || '.' || t.tgname, pg_get_triggerdef(t.oid)
        FROM pg_trigger t
        JOIN pg_class c ON c.oid = t.tgrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = current_schema() AND NOT t.tgisinternal
        UNION ALL
        SELECT 'function ' || p.oid::regprocedure::text, pg_get_functiondef(p.oid)
        FROM pg_proc p
        JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = current_schema() AND p.prokind = 'f'
        "#,
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().collect())
}

/// Lines describing where two maps differ, for assertion messages.
fn differences(left: &BTreeMap<String, String>, right: &BTreeMap<String, String>) -> Vec<String> {
    let missing = "MISSING".to_owned();
    let mut keys: Vec<&String> = left.keys().chain(right.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter_map(|k| {
            let (a, b) = (
                left.get(k).unwrap_or(&missing),
                right.get(k).unwrap_or(&missing),
            );
            (a != b).then(|| format!("{k}\n    left:  {a}\n    right: {b}"))
        })
        .collect()
}

/// `../shared`, or `None` outside CI when it is not next to this checkout. Under `CI=true` its
/// absence fails the test: CI always has it.
fn shared_or_skip(what: &str) -> Option<PathBuf> {
    let dir = shared_dir();
    if dir.join("reference-schema").is_dir() && dir.join("tools").is_dir() {
        return Some(dir);
    }
    support::skip_or_fail(&format!(
        "{} is missing, so {what} cannot run (CI runs with ../shared beside the checkout)",
        dir.display()
    ));
    None
}

/// Points a shared tool's libpq environment at DATABASE_URL's server.
fn libpq_env(command: &mut Command) {
    if let Ok(url) = std::env::var("DATABASE_URL") {
        let url = url::Url::parse(&url).expect("DATABASE_URL is a URL");
        if let Some(host) = url.host_str() {
            command.env("PGHOST", host);
        }
        if let Some(port) = url.port() {
            command.env("PGPORT", port.to_string());
        }
        if !url.username().is_empty() {
            command.env("PGUSER", url.username());
        }
        if let Some(password) = url.password() {
            command.env("PGPASSWORD", password);
        }
    }
}

/// Runs one of the shared schema tools on the migrations against DATABASE_URL's server;
/// returns its stdout.
fn run_tool(name: &str, args: &[&str]) -> Option<String> {
    let shared = shared_or_skip(name)?;
    let _services = support::isolation::shared_blocking();
    let tool = shared.join("tools").join(name);
    let mut command = Command::new(&tool);
    command
        .args(args)
        .arg("migrations")
        .current_dir(manifest_dir());
    libpq_env(&mut command);
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", tool.display()));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{name} failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    Some(stdout)
}

#[test]
fn migrations_build_the_platforms_whole_schema_at_0054() {
    let Some(out) = run_tool("platform-compat", &["--at", "0054"]) else {
        return;
    };
    assert!(
        out.lines().any(|l| l.starts_with("platform-compat: all ")
            && l.ends_with(" platform definitions match (at 0054)")
            || l == "platform-compat: all 2684 platform definitions match"),
        "platform-compat --at 0054 did not report a full match:\n{out}"
    );
}

/// Builds, in `db` (which must not exist yet), the platform's whole schema as its own migrations
/// 0001..`at` leave it, with its migration ledger, using `../shared/tools/platform-db`.
fn platform_db(at: &str, db: &str) -> Option<()> {
    let shared = shared_or_skip("building a platform database")?;
    let tool = shared.join("tools").join("platform-db");
    let mut command = Command::new(&tool);
    command.args(["--at", at, db]);
    libpq_env(&mut command);
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", tool.display()));
    assert!(
        output.status.success(),
        "platform-db --at {at} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Some(())
}

/// Ids of the rows the fills write.
const SPACE: &str = "5a5a5a5a-0000-4000-8000-000000000001";
const SOURCE: &str = "5a5a5a5a-0000-4000-8000-000000000002";
const ASSET_A: &str = "5a5a5a5a-0000-4000-8000-000000000003";
const ASSET_B: &str = "5a5a5a5a-0000-4000-8000-000000000004";
const GRANT: &str = "5a5a5a5a-0000-4000-8000-000000000005";
const SNAPSHOT: &str = "5a5a5a5a-0000-4000-8000-000000000006";

/// Rows as the platform's API and history leave them at its migration 0018: a space with its
/// source, two documents (one parsed), a deferred compile attempt, a research task, a deletion
/// job of a document with its tombstone, and rows that a one-time backfill of the platform's
/// migrations would change if it ran again (a space with a document but no head for 0009, a
/// mutation lease of the old ownerless protocol for 0017, an evidence bundle without an owner,
/// an answer trace). Written as SQL, not through the project's writers, which write today's
/// shape.
fn fill_0018() -> String {
    let hash = |c: char| c.to_string().repeat(64);
    format!(
        r#"
        INSERT INTO knowledge_spaces (id, tenant_id, slug, name, created_at, updated_at)
        VALUES ('{SPACE}', 'tenant-a', 'space-a', 'Space A', now(), now());
        INSERT INTO knowledge_space_permission_snapshots (id, tenant_id, knowledge_space_id, subject_id, role,
            visibility, access_channel, member_revision, access_policy_revision, api_access_revision,
            permission_scopes, status, revision, expires_at, created_at, updated_at)
        VALUES ('{SNAPSHOT}', 'tenant-a', '{SPACE}', 'owner-a', 'owner', 'all_members', 'interactive', 1, 1, 1,
            '["tenant:tenant-a"]', 'active', 1, now() + interval '1 day', now(), now());
        INSERT INTO sources (id, knowledge_space_id, name, type, uri, status, version, metadata, permission_scope,
            created_at, updated_at)
        VALUES ('{SOURCE}', '{SPACE}', 'web', 'web', 'https://example.com', 'active', 1, '{{}}', '[]', now(), now());
        INSERT INTO document_assets (id, knowledge_space_id, source_id, filename, mime_type, object_key, sha256,
            size_bytes, version, parser_status, metadata, created_at, updated_at)
        VALUES ('{ASSET_A}', '{SPACE}', '{SOURCE}', 'a.md', 'text/markdown', 'tenant-a/a.md', '{ha}', 11, 1,
                'parsed', '{{}}', now(), now()),
               ('{ASSET_B}', '{SPACE}', '{SOURCE}', 'b.md', 'text/markdown', 'tenant-a/b.md', '{hb}', 12, 2,
                'failed', '{{}}', now(), now());
        INSERT INTO document_compilation_attempts (id, tenant_id, knowledge_space_id, document_asset_id,
            document_version, publication_generation_id, base_head_revision, run_state, checkpoint, active_slot,
            execution_attempts, max_execution_attempts, row_version, requested_by_subject_id,
            permission_snapshot_id, permission_snapshot_revision, access_channel, created_at, updated_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000c1', 'tenant-a', '{SPACE}', '{ASSET_A}', 1,
            '5a5a5a5a-0000-4000-8000-0000000000c2', 0, 'dispatch_pending', 'queued', 1, 0, 5, 0, 'owner-a',
            '{SNAPSHOT}', 1, 'interactive', now(), now());
        INSERT INTO document_compilation_outbox (id, attempt_id, event_type, payload, idempotency_key, schema_version,
            status, available_at, dispatch_attempts, created_at, updated_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000c3', '5a5a5a5a-0000-4000-8000-0000000000c1', 'document.compile',
            '{{"attemptId": "5a5a5a5a-0000-4000-8000-0000000000c1"}}',
            'document.compile:5a5a5a5a-0000-4000-8000-0000000000c1', 1, 'pending',
            '9999-12-31T23:59:59.999Z', 0, now(), now());
        INSERT INTO research_task_jobs (id, tenant_id, knowledge_space_id, subject_id, permission_snapshot_id,
            permission_snapshot_revision, access_channel, query, stage, execution_attempts, max_execution_attempts,
            row_version, limits, metadata, cost, created_at, updated_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000d1', 'tenant-a', '{SPACE}', 'owner-a', '{SNAPSHOT}', 1,
            'interactive', 'what is alpha?', 'queued', 0, 5, 1, '{{}}', '{{}}', '{{}}', 1, 1);
        INSERT INTO research_task_outbox (id, research_task_job_id, delivery_revision, event_type, payload,
            idempotency_key, schema_version, status, available_at, dispatch_attempts, created_at, updated_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000d2', '5a5a5a5a-0000-4000-8000-0000000000d1', 1, 'research.task',
            '{{"researchTaskJobId": "5a5a5a5a-0000-4000-8000-0000000000d1"}}',
            'research.task:tenant-a:{SPACE}:5a5a5a5a-0000-4000-8000-0000000000d1:1', 1, 'pending', 1, 0, 1, 1);
        INSERT INTO research_task_progress_events (id, research_task_job_id, tenant_id, knowledge_space_id, sequence,
            event_type, stage, payload, idempotency_key, created_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000d3', '5a5a5a5a-0000-4000-8000-0000000000d1', 'tenant-a',
            '{SPACE}', 1, 'research_task.started', 'queued', '{{}}',
            'research-task-progress:5a5a5a5a-0000-4000-8000-0000000000d1:1:research_task.started', 1);
        INSERT INTO deletion_jobs (id, tenant_id, knowledge_space_id, target_type, target_id, target_revision,
            delete_mode, idempotency_key, request_fingerprint, requested_by_subject_id, permission_snapshot_id,
            permission_snapshot_revision, access_channel, run_state, checkpoint, active_slot, inventory_complete,
            execution_attempts, max_execution_attempts, row_version, created_at, updated_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000e1', 'tenant-a', '{SPACE}', 'document_asset', '{ASSET_B}', 1,
            'cascade', 'delete-b', '{hf}', 'owner-a', '{SNAPSHOT}', 1, 'interactive', 'dispatch_pending',
            'requested', 1, FALSE, 0, 10, 1, now(), now());
        UPDATE document_assets SET lifecycle_state = 'deleting', deletion_job_id = '5a5a5a5a-0000-4000-8000-0000000000e1',
            deleting_at = now() WHERE id = '{ASSET_B}';
        INSERT INTO deletion_tombstones (id, tenant_id, knowledge_space_id, target_type, target_id, target_revision,
            deletion_job_id, state, row_version, created_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000e2', 'tenant-a', '{SPACE}', 'document_asset', '{ASSET_B}', 1,
            '5a5a5a5a-0000-4000-8000-0000000000e1', 'active', 1, now());
        INSERT INTO deletion_outbox (id, deletion_job_id, delivery_revision, event_type, payload, idempotency_key,
            request_idempotency_key, request_fingerprint, schema_version, status, available_at, dispatch_attempts,
            created_at, updated_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000e3', '5a5a5a5a-0000-4000-8000-0000000000e1', 1, 'deletion.job',
            '{{"deletionJobId": "5a5a5a5a-0000-4000-8000-0000000000e1"}}',
            'deletion:5a5a5a5a-0000-4000-8000-0000000000e1:1', 'delete-b', '{hf}', 1, 'pending', now(), 0, now(), now());
        INSERT INTO knowledge_space_mutation_leases (id, tenant_id, knowledge_space_id, operation, acquired_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000f1', 'tenant-a', '{SPACE}', 'document.upload', now() - interval '1 hour');
        INSERT INTO evidence_bundles (id, trace_id, query, state, items, missing_evidence, created_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000f2', NULL, 'question', 'answerable', '[]', '[]', now());
        INSERT INTO answer_traces (id, knowledge_space_id, evidence_bundle_id, query, mode, completed, created_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000f3', '{SPACE}', '5a5a5a5a-0000-4000-8000-0000000000f2',
                'question', 'fast', TRUE, now());
        "#,
        ha = hash('a'),
        hb = hash('b'),
        hf = hash('f'),
    )
}

/// What today's API writes beside [`fill_0018`]'s rows on a database at 0054: the logical
/// documents and revisions of the two documents, a capability grant, and a compile attempt, a
/// research task and a deletion job each authorized by that grant alone (subject, snapshot and
/// channel NULL), with their outbox rows; and a deletion of a logical document at revision 0.
fn fill_0054() -> String {
    let hash = |c: char| c.to_string().repeat(64);
    format!(
        r#"
        INSERT INTO logical_documents (id, tenant_id, knowledge_space_id, title, status, active_revision,
            row_version, user_metadata, system_metadata, created_at, updated_at)
        VALUES ('{ASSET_A}', 'tenant-a', '{SPACE}', 'a.md', 'ready', NULL, 0, '{{}}', '{{}}', now(), now()),
               ('5a5a5a5a-0000-4000-8000-0000000000a9', 'tenant-a', '{SPACE}', 'empty', 'pending', NULL, 0,
                '{{}}', '{{}}', now(), now());
        INSERT INTO document_revisions (tenant_id, knowledge_space_id, document_id, revision, document_asset_id,
            document_asset_version, state, content_hash, mime_type, size_bytes, system_metadata,
            expected_document_row_version, activated_at, created_at)
        VALUES ('tenant-a', '{SPACE}', '{ASSET_A}', 1, '{ASSET_A}', 1, 'active', '{ha}', 'text/markdown', 11, '{{}}',
                0, now(), now());
        UPDATE logical_documents SET active_revision = 1, row_version = 1 WHERE id = '{ASSET_A}';
        INSERT INTO capability_grants (tenant_id, knowledge_space_id, grant_id, subject_id, actor_id, caller_kind,
            action, resource_type, resource_id, content_scope_ids, content_policy_revision, authz_revision,
            claims_digest, jti_hash, trace_id, revision, state, highest_revoke_sequence, issued_at, expires_at,
            admitted_at, updated_at)
        VALUES ('tenant-a', '{SPACE}', '{GRANT}', 'app-user', 'app-user', 'host-app', 'knowledge.use',
            'knowledge_space', '{SPACE}', '["tenant:tenant-a"]', 1, '{{}}', 'sha256:{ha}', 'sha256:{hb}', 'trace-1',
            1, 'active', 0, now(), now() + interval '1 hour', now(), now());
        INSERT INTO document_compilation_attempts (id, tenant_id, knowledge_space_id, document_asset_id,
            document_version, publication_generation_id, base_head_revision, run_state, checkpoint, active_slot,
            execution_attempts, max_execution_attempts, row_version, capability_grant_id, created_at, updated_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000b1', 'tenant-a', '{SPACE}', '{ASSET_B}', 2,
            '5a5a5a5a-0000-4000-8000-0000000000b2', 0, 'dispatch_pending', 'queued', 1, 0, 5, 0, '{GRANT}',
            now(), now());
        INSERT INTO document_compilation_outbox (id, attempt_id, event_type, payload, idempotency_key, schema_version,
            status, available_at, dispatch_attempts, created_at, updated_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000b3', '5a5a5a5a-0000-4000-8000-0000000000b1', 'document.compile',
            '{{"attemptId": "5a5a5a5a-0000-4000-8000-0000000000b1"}}',
            'document.compile:5a5a5a5a-0000-4000-8000-0000000000b1', 1, 'pending', now(), 0, now(), now());
        INSERT INTO research_task_jobs (id, tenant_id, knowledge_space_id, capability_grant_id, query, stage,
            execution_attempts, max_execution_attempts, row_version, limits, metadata, cost, created_at, updated_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000b4', 'tenant-a', '{SPACE}', '{GRANT}', 'what is beta?', 'queued',
            0, 5, 1, '{{}}', '{{}}', '{{}}', 1, 1);
        INSERT INTO research_task_outbox (id, research_task_job_id, delivery_revision, event_type, payload,
            idempotency_key, schema_version, status, available_at, dispatch_attempts, created_at, updated_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000b5', '5a5a5a5a-0000-4000-8000-0000000000b4', 1, 'research.task',
            '{{"researchTaskJobId": "5a5a5a5a-0000-4000-8000-0000000000b4"}}',
            'research.task:tenant-a:{SPACE}:5a5a5a5a-0000-4000-8000-0000000000b4:1', 1, 'pending', 1, 0, 1, 1);
        INSERT INTO deletion_jobs (id, tenant_id, knowledge_space_id, target_type, target_id, target_revision,
            delete_mode, idempotency_key, request_fingerprint, capability_grant_id, run_state, checkpoint, active_slot,
            inventory_complete, execution_attempts, max_execution_attempts, row_version, created_at, updated_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000b6', 'tenant-a', '{SPACE}', 'logical_document',
            '5a5a5a5a-0000-4000-8000-0000000000a9', 0, 'cascade', 'delete-empty', '{hf}', '{GRANT}',
            'dispatch_pending', 'requested', 1, FALSE, 0, 10, 1, now(), now());
        UPDATE logical_documents SET status = 'deleting', deletion_job_id = '5a5a5a5a-0000-4000-8000-0000000000b6',
            deleting_at = now(), row_version = row_version + 1 WHERE id = '5a5a5a5a-0000-4000-8000-0000000000a9';
        INSERT INTO deletion_tombstones (id, tenant_id, knowledge_space_id, target_type, target_id, target_revision,
            deletion_job_id, state, row_version, created_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000b7', 'tenant-a', '{SPACE}', 'logical_document',
            '5a5a5a5a-0000-4000-8000-0000000000a9', 0, '5a5a5a5a-0000-4000-8000-0000000000b6', 'active', 1, now());
        INSERT INTO deletion_outbox (id, deletion_job_id, delivery_revision, event_type, payload, idempotency_key,
            request_idempotency_key, request_fingerprint, schema_version, status, available_at, dispatch_attempts,
            created_at, updated_at)
        VALUES ('5a5a5a5a-0000-4000-8000-0000000000b8', '5a5a5a5a-0000-4000-8000-0000000000b6', 1, 'deletion.job',
            '{{"deletionJobId": "5a5a5a5a-0000-4000-8000-0000000000b6"}}',
            'deletion:5a5a5a5a-0000-4000-8000-0000000000b6:1', 'delete-empty', '{hf}', 1, 'pending', now(), 0,
            now(), now());
        "#,
        ha = hash('a'),
        hb = hash('b'),
        hf = hash('f'),
    )
}

/// Runs `kfs-worker migrate` with `args` on `db`.
fn kfs_migrate_with(db: &ScratchDb, args: &[&str]) -> std::process::Output {
    let mut url = url::Url::parse(&support::admin_url()).expect("DATABASE_URL");
    url.set_path(&format!("/{}", db.name));
    Command::new(env!("CARGO_BIN_EXE_kfs-worker"))
        .arg("migrate")
        .args(args)
        .env("DATABASE_URL", url.as_str())
        .env_remove("RUST_LOG")
        .output()
        .expect("run kfs-worker migrate")
}

/// Runs `kfs-worker migrate` on `db`.
fn kfs_migrate(db: &ScratchDb) -> std::process::Output {
    kfs_migrate_with(db, &[])
}

fn text(o: &std::process::Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// What the project's migrations may add to a platform database: its own ledger, its own
/// functions and triggers, and indexes named as the project's.
fn is_own(key: &str) -> bool {
    let name = key.split_once(' ').map_or(key, |(_, n)| n);
    name.starts_with("kfs_worker_migrations")
        || name.starts_with("kfs_")
        || name.contains("_kfs_notify")
        || name.starts_with("kfs_notify_outbox")
}

/// The schema without the project's own objects, with the CHECKs that Postgres prints in two
/// spellings (`IN (...)` as written by one, `= ANY` as rebuilt from facts by the other) put in
/// one, so that two databases compare by meaning.
async fn platform_definitions(pool: &PgPool) -> Result<BTreeMap<String, String>> {
    Ok(describe_schema(pool)
        .await?
        .into_iter()
        .filter(|(k, _)| !is_own(k))
        .map(|(k, v)| {
            let v = v
                .replace("(ARRAY[('", "((ARRAY['")
                .replace("'::character varying)::text, ('", "'::character varying, '")
                .replace(
                    "'::character varying)::text])",
                    "'::character varying])::text[])",
                );
            (k, v)
        })
        .collect())
}

/// `count digest` of every table's rows over the columns named for it, keyed by table: what
/// "the rows are intact" means for a table that later migrations gave more columns.
async fn row_digests_over(
    pool: &PgPool,
    columns: &BTreeMap<String, Vec<String>>,
) -> Result<BTreeMap<String, String>> {
    let mut digests = BTreeMap::new();
    for (table, cols) in columns {
        let row = cols
            .iter()
            .map(|c| format!(r#"t."{c}""#))
            .collect::<Vec<_>>()
            .join(", ");
        let digest: String = sqlx::query_scalar(&format!(
            r#"SELECT count(*)::text || ' ' || md5(coalesce(string_agg(ROW({row})::text, '|' ORDER BY ROW({row})::text), ''))
               FROM "{table}" AS t"#
        ))
        .fetch_one(pool)
        .await
        .with_context(|| format!("digesting rows of {table}"))?;
        digests.insert(table.clone(), digest);
    }
    Ok(digests)
}

/// Every table's columns, keyed by table, leaving out the project's own ledger.
async fn table_columns(pool: &PgPool) -> Result<BTreeMap<String, Vec<String>>> {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT table_name::text, column_name::text FROM information_schema.columns \
         WHERE table_schema = current_schema() AND table_name <> 'kfs_worker_migrations' \
         ORDER BY table_name, ordinal_position",
    )
    .fetch_all(pool)
    .await?;
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (t, c) in rows {
        out.entry(t).or_default().push(c);
    }
    Ok(out)
}

async fn ledger(pool: &PgPool) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT migration_id::text FROM schema_migrations WHERE dialect = 'postgres' ORDER BY 1",
    )
    .fetch_all(pool)
    .await?)
}

#[tokio::test]
async fn migrate_adopts_a_platform_database_at_0054_and_changes_nothing_of_it() -> Result<()> {
    let Some(platform) = ScratchDb::platform("adopt", "0054").await? else {
        return Ok(());
    };
    let pool = platform.pool();
    apply_sql(pool, "the platform's rows", &fill_0018()).await?;
    apply_sql(pool, "today's rows", &fill_0054()).await?;
    let rows_before = row_digests(pool).await?;
    let schema_before = describe_schema(pool).await?;
    ensure!(
        rows_before
            .values()
            .filter(|d| !d.starts_with("0 "))
            .count()
            >= 18,
        "too few rows: {rows_before:?}"
    );

    let out = kfs_migrate(&platform);
    let (stdout, stderr) = text(&out);
    ensure!(out.status.success(), "migrate failed: {stdout}{stderr}");
    ensure!(stdout.contains("(a platform database)"), "{stdout}");
    ensure!(stderr.is_empty(), "migrate warned: {stderr}");
    ensure!(!stdout.contains("platform: applied"), "{stdout}");
    let again = kfs_migrate(&platform);
    let (stdout2, stderr2) = text(&again);
    ensure!(
        again.status.success(),
        "second migrate failed: {stdout2}{stderr2}"
    );
    ensure!(
        stdout2.starts_with("migrations: 0 applied now"),
        "{stdout2}"
    );

    let changed = differences(&rows_before, &row_digests(pool).await?);
    ensure!(
        changed.is_empty(),
        "migrate changed platform rows:\n{}",
        changed.join("\n")
    );
    let schema_after = describe_schema(pool).await?;
    let removed_or_changed: Vec<String> = differences(&schema_before, &schema_after)
        .into_iter()
        .filter(|d| !is_own(d.lines().next().unwrap_or_default()))
        .collect();
    ensure!(
        removed_or_changed.is_empty(),
        "migrate changed the platform's definitions:\n{}",
        removed_or_changed.join("\n")
    );
    let added: Vec<&String> = schema_after
        .keys()
        .filter(|k| !schema_before.contains_key(*k))
        .collect();
    ensure!(
        !added.is_empty() && added.iter().all(|k| is_own(k)),
        "the project's own objects were not added, or others were: {added:?}"
    );
    let recorded: i64 = sqlx::query_scalar("SELECT count(*) FROM kfs_worker_migrations")
        .fetch_one(pool)
        .await?;
    ensure!(
        recorded == i64::try_from(MIGRATOR.iter().count())?,
        "ledger rows: {recorded}"
    );
    ensure!(
        ledger(pool).await? == PLATFORM_MIGRATIONS,
        "the platform's ledger changed"
    );

    // The adopted database has exactly the schema a fresh database gets.
    let fresh = ScratchDb::create("adopt_fresh").await?;
    kfs_worker::db::migrate(fresh.pool())
        .await
        .context("migrating a fresh database")?;
    let diff = differences(
        &platform_definitions(pool).await?,
        &platform_definitions(fresh.pool()).await?,
    );
    ensure!(
        diff.is_empty(),
        "adopted (left) and fresh (right) schemas differ:\n{}",
        diff.join("\n")
    );
    Ok(())
}

#[tokio::test]
async fn migrate_brings_a_platform_database_at_0018_to_0054_only_when_asked_keeping_its_rows(
) -> Result<()> {
    let Some(platform) = ScratchDb::platform("upgrade", "0018").await? else {
        return Ok(());
    };
    let pool = platform.pool();
    apply_sql(pool, "the platform's rows", &fill_0018()).await?;
    let mut columns = table_columns(pool).await?;
    // The ledger gains the upgrade's rows; it is checked on its own below.
    columns.remove("schema_migrations");
    let rows_before = row_digests_over(pool, &columns).await?;
    let schema_before = describe_schema(pool).await?;

    // Without leave: refused with one line naming the missing migrations, nothing changed.
    let out = kfs_migrate(&platform);
    let (stdout, stderr) = text(&out);
    ensure!(
        out.status.code() == Some(2),
        "not refused: {stdout}{stderr}"
    );
    ensure!(stderr.lines().count() == 1, "not one line: {stderr}");
    ensure!(
        stderr.contains(
            "0019_profile_publication_bindings … 0054_graph_semantic_projections (36 in all) have not been applied"
        ) && stderr.contains("--upgrade-platform")
            && stderr.contains("nothing was changed"),
        "{stderr}"
    );
    ensure!(
        differences(&rows_before, &row_digests_over(pool, &columns).await?).is_empty(),
        "refusing changed rows"
    );
    ensure!(
        differences(&schema_before, &describe_schema(pool).await?).is_empty(),
        "refusing changed the schema"
    );

    // With leave: the platform's 36 migrations, each recorded in its ledger, rows kept.
    let out = kfs_migrate_with(&platform, &["--upgrade-platform"]);
    let (stdout, stderr) = text(&out);
    ensure!(out.status.success(), "upgrade failed: {stdout}{stderr}");
    ensure!(
        stdout.contains(
            "platform: applied the platform's migrations 0019_profile_publication_bindings through \
             0054_graph_semantic_projections (36 in all)"
        ),
        "{stdout}"
    );
    ensure!(
        ledger(pool).await? == PLATFORM_MIGRATIONS,
        "the ledger is not at 0054"
    );
    let changed = differences(&rows_before, &row_digests_over(pool, &columns).await?);
    ensure!(
        changed.is_empty(),
        "the upgrade changed rows the platform had:\n{}",
        changed.join("\n")
    );
    // 0022's backfill: every document became a logical document with its active revision.
    let backfilled: Vec<(uuid::Uuid, String, Option<i32>, i64)> = sqlx::query_as(
        "SELECT d.id, d.status::text, d.active_revision, \
           (SELECT count(*) FROM document_revisions r WHERE r.document_id = d.id AND r.state = 'active') \
         FROM logical_documents d ORDER BY d.title",
    )
    .fetch_all(pool)
    .await?;
    ensure!(
        backfilled.len() == 2
            && backfilled[0].0.to_string() == ASSET_A
            && backfilled[0].1 == "ready"
            && backfilled[1].1 == "failed"
            && backfilled.iter().all(|b| b.2.is_some() && b.3 == 1),
        "logical documents after the upgrade: {backfilled:?}"
    );
    // The schema is the platform's at 0054, exactly.
    let Some(reference) = ScratchDb::platform("upgrade_reference", "0054").await? else {
        return Ok(());
    };
    let diff = differences(
        &platform_definitions(pool).await?,
        &platform_definitions(reference.pool()).await?,
    );
    ensure!(
        diff.is_empty(),
        "upgraded (left) and the platform's 0054 (right) differ:\n{}",
        diff.join("\n")
    );
    let again = kfs_migrate(&platform);
    let (stdout, stderr) = text(&again);
    ensure!(
        again.status.success() && stdout.starts_with("migrations: 0 applied now"),
        "{stdout}{stderr}"
    );
    Ok(())
}

/// Builds a platform database at `at`, fills it, spoils it with `spoil`, runs `kfs-worker
/// migrate`, and checks that it refused with one line containing `needle` and changed nothing.
async fn refused(tag: &str, at: &str, spoil: &str, needle: &str) -> Result<()> {
    let Some(db) = ScratchDb::platform(tag, at).await? else {
        return Ok(());
    };
    apply_sql(db.pool(), "the platform's rows", &fill_0018()).await?;
    if at == "0054" {
        apply_sql(db.pool(), "today's rows", &fill_0054()).await?;
    }
    if !spoil.is_empty() {
        apply_sql(db.pool(), "the spoiling", spoil).await?;
    }
    let rows = row_digests(db.pool()).await?;
    let schema = describe_schema(db.pool()).await?;
    for args in [&[][..], &["--upgrade-platform"][..]] {
        let out = kfs_migrate_with(&db, args);
        let (stdout, stderr) = text(&out);
        ensure!(
            out.status.code() == Some(2),
            "not refused ({:?}): {stdout}{stderr}",
            out.status
        );
        ensure!(stdout.is_empty(), "{stdout}");
        ensure!(stderr.lines().count() == 1, "not one line: {stderr}");
        ensure!(
            stderr.starts_with("error: ") && stderr.contains(needle),
            "{stderr}"
        );
        ensure!(stderr.contains("nothing was changed"), "{stderr}");
        ensure!(
            differences(&rows, &row_digests(db.pool()).await?).is_empty(),
            "rows changed"
        );
        ensure!(
            differences(&schema, &describe_schema(db.pool()).await?).is_empty(),
            "schema changed"
        );
    }
    Ok(())
}

#[tokio::test]
async fn migrate_refuses_a_database_that_records_a_later_platform_migration() -> Result<()> {
    refused(
        "later",
        "0054",
        "INSERT INTO schema_migrations (migration_id, dialect) VALUES ('0055_future_things', 'postgres');",
        "records 0055_future_things, a later platform migration than this kfs-worker knows",
    )
    .await
}

#[tokio::test]
async fn migrate_refuses_a_platform_database_missing_one_of_the_platforms_first_migrations(
) -> Result<()> {
    refused(
        "no0016",
        "0018",
        "DELETE FROM schema_migrations WHERE migration_id = '0016_compilation_job_requester_binding';",
        "0016_compilation_job_requester_binding has not been applied",
    )
    .await
}

#[tokio::test]
async fn migrate_refuses_a_ledger_that_claims_what_the_schema_lacks() -> Result<()> {
    refused(
        "nocolumn",
        "0054",
        "ALTER TABLE research_task_partial_results DROP COLUMN answer;",
        "records the platform's migration 0033_research_task_final_answers, but column \
         research_task_partial_results.answer is missing",
    )
    .await
}

#[tokio::test]
async fn migrate_refuses_a_platform_database_without_the_vector_extension() -> Result<()> {
    refused(
        "novector",
        "0054",
        "DROP EXTENSION vector CASCADE;",
        "no vector extension",
    )
    .await
}

#[tokio::test]
async fn migrate_is_idempotent_on_fresh_database() -> Result<()> {
    let db = ScratchDb::create("fresh").await?;
    let pool = db.pool();
    let report = kfs_worker::db::migrate(pool)
        .await
        .context("first migrate")?;
    ensure!(
        report.found == kfs_worker::db::migrate::Found::Fresh,
        "{report:?}"
    );
    let schema_once = describe_schema(pool).await?;
    let rows_once = row_digests(pool).await?;
    let report = kfs_worker::db::migrate(pool)
        .await
        .context("second migrate")?;
    ensure!(report.applied.is_empty(), "{report:?}");
    let diff = differences(&schema_once, &describe_schema(pool).await?);
    assert!(
        diff.is_empty(),
        "the second migrate changed the schema:\n{}",
        diff.join("\n")
    );
    assert_eq!(
        rows_once,
        row_digests(pool).await?,
        "the second migrate changed rows"
    );
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM kfs_worker_migrations")
        .fetch_one(pool)
        .await?;
    assert_eq!(applied, i64::try_from(MIGRATOR.iter().count())?);
    // The platform's own ledger records the platform's migrations this schema holds, so that
    // the platform's migration runner can take the database over.
    assert_eq!(ledger(pool).await?, PLATFORM_MIGRATIONS);
    Ok(())
}
