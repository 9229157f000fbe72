//! The schema contract (DESIGN.md, "The schema contract").
//!
//! Invariants checked here, against a real Postgres (DATABASE_URL names the admin database):
//! - the project's migrations build exactly the platform's reference schema
//!   (`../shared/tools/schema-compat`);
//! - `MIGRATOR.run` adopts a database the platform already migrated: it adds only the project's
//!   own objects, ends with the same schema as a fresh database, and changes no row. In
//!   particular the one-time backfills of 0009 and 0017 do not run a second time;
//! - running the migrations again is a no-op.
//!
//! Every test works in its own scratch database, dropped afterwards even when the test fails.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;

use anyhow::{ensure, Context, Result};
use kfs_worker::db::MIGRATOR;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Executor, PgPool};

const DEFAULT_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn shared_dir() -> PathBuf {
    manifest_dir().join("..").join("shared")
}

fn admin_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_ADMIN_URL.to_owned())
}

/// A database of its own for one test. Dropped (with FORCE) when the value goes out of scope,
/// including when the test panics.
struct ScratchDb {
    name: String,
    admin: PgConnectOptions,
    pool: Option<PgPool>,
}

impl ScratchDb {
    async fn create(tag: &str) -> Result<Self> {
        let admin = PgConnectOptions::from_str(&admin_url())
            .context("DATABASE_URL is not a Postgres URL")?;
        let name = format!("kfs_schema_{tag}_{}", uuid::Uuid::new_v4().simple());
        let mut conn = sqlx::ConnectOptions::connect(&admin)
            .await
            .context("connecting to the admin database (DATABASE_URL)")?;
        conn.execute(format!(r#"CREATE DATABASE "{name}""#).as_str())
            .await
            .with_context(|| format!("creating scratch database {name}"))?;
        drop(conn);
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(admin.clone().database(&name))
            .await
            .with_context(|| format!("connecting to scratch database {name}"))?;
        Ok(Self {
            name,
            admin,
            pool: Some(pool),
        })
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

/// Runs a whole SQL file in one transaction, like `psql -1 -f`.
async fn apply_file(pool: &PgPool, path: &Path) -> Result<()> {
    let sql =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut tx = pool.begin().await?;
    sqlx::raw_sql(&sql)
        .execute(&mut *tx)
        .await
        .with_context(|| format!("applying {}", path.display()))?;
    tx.commit().await?;
    Ok(())
}

async fn apply_sql(pool: &PgPool, what: &str, sql: &str) -> Result<()> {
    sqlx::raw_sql(sql)
        .execute(pool)
        .await
        .with_context(|| format!("inserting {what}"))?;
    Ok(())
}

/// `count digest` of every table's rows, keyed by table. sqlx's own bookkeeping table is left
/// out: adopting a database is expected to create it.
async fn row_digests(pool: &PgPool) -> Result<BTreeMap<String, String>> {
    let tables: Vec<String> = sqlx::query_scalar(
        r#"
        SELECT c.relname::text
        FROM pg_class c
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = current_schema() AND c.relkind = 'r' AND c.relname <> '_sqlx_migrations'
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

/// The objects the reference migrations name, found the way schema-compat finds them.
#[derive(Default)]
struct ReferenceObjects {
    relations: Vec<String>,
    constraints: Vec<String>,
    dropped_constraints: Vec<String>,
    columns: Vec<(String, String)>,
}

/// The double-quoted names that follow each occurrence of `marker` (which ends with `"`).
fn names_after<'a>(text: &'a str, marker: &str) -> Vec<&'a str> {
    text.match_indices(marker)
        .filter_map(|(at, _)| {
            let rest = &text[at + marker.len()..];
            rest.find('"').map(|end| &rest[..end])
        })
        .collect()
}

fn reference_objects(texts: &[String]) -> ReferenceObjects {
    let mut objects = ReferenceObjects::default();
    for text in texts {
        let own = |v: Vec<&str>| v.into_iter().map(str::to_owned).collect::<Vec<_>>();
        objects
            .relations
            .extend(own(names_after(text, r#"CREATE TABLE IF NOT EXISTS ""#)));
        objects
            .relations
            .extend(own(names_after(text, r#"INDEX IF NOT EXISTS ""#)));
        objects
            .constraints
            .extend(own(names_after(text, r#"CONSTRAINT ""#)));
        objects
            .dropped_constraints
            .extend(own(names_after(text, r#"DROP CONSTRAINT IF EXISTS ""#)));
        for (at, _) in text.match_indices(r#"ALTER TABLE ""#) {
            let rest = &text[at + r#"ALTER TABLE ""#.len()..];
            let Some(end) = rest.find('"') else { continue };
            let statement = &rest[..rest.find(';').unwrap_or(rest.len())];
            for column in names_after(statement, r#"ADD COLUMN IF NOT EXISTS ""#) {
                objects
                    .columns
                    .push((rest[..end].to_owned(), column.to_owned()));
            }
        }
    }
    objects
}

/// Every relation, constraint and column the reference files create is present, and every
/// constraint they drop is absent. Returns the number of objects checked.
async fn assert_reference_objects(pool: &PgPool, refs: &ReferenceObjects) -> Result<usize> {
    let missing_relations: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM unnest($1::text[]) AS name WHERE to_regclass(format('%I', name)) IS NULL",
    )
    .bind(&refs.relations)
    .fetch_all(pool)
    .await?;
    ensure!(
        missing_relations.is_empty(),
        "missing tables/indexes: {missing_relations:?}"
    );

    let missing_constraints: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM unnest($1::text[]) AS name
         WHERE NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = name)",
    )
    .bind(&refs.constraints)
    .fetch_all(pool)
    .await?;
    ensure!(
        missing_constraints.is_empty(),
        "missing constraints: {missing_constraints:?}"
    );

    let present_dropped: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM unnest($1::text[]) AS name
         WHERE EXISTS (SELECT 1 FROM pg_constraint WHERE conname = name)",
    )
    .bind(&refs.dropped_constraints)
    .fetch_all(pool)
    .await?;
    ensure!(
        present_dropped.is_empty(),
        "constraints the reference drops are present: {present_dropped:?}"
    );

    let (tables, columns): (Vec<String>, Vec<String>) = refs.columns.iter().cloned().unzip();
    let missing_columns: Vec<String> = sqlx::query_scalar(
        "SELECT t || '.' || c FROM unnest($1::text[], $2::text[]) AS x(t, c)
         WHERE NOT EXISTS (
           SELECT 1 FROM pg_attribute
           WHERE attrelid = to_regclass(format('%I', x.t)) AND attname = x.c AND NOT attisdropped
         )",
    )
    .bind(&tables)
    .bind(&columns)
    .fetch_all(pool)
    .await?;
    ensure!(
        missing_columns.is_empty(),
        "missing columns: {missing_columns:?}"
    );

    Ok(refs.relations.len()
        + refs.constraints.len()
        + refs.dropped_constraints.len()
        + refs.columns.len())
}

/// The reference migrations in version order, or None when ../shared is not next to the crate.
fn reference_files() -> Result<Option<Vec<PathBuf>>> {
    let dir = shared_dir().join("reference-schema");
    if !dir.is_dir() {
        return Ok(None);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    files.retain(|p| p.to_string_lossy().ends_with(".postgres.sql"));
    files.sort();
    ensure!(
        !files.is_empty(),
        "no reference migrations in {}",
        dir.display()
    );
    Ok(Some(files))
}

fn reference_file(files: &[PathBuf], version: &str) -> Result<PathBuf> {
    files
        .iter()
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(version))
        })
        .cloned()
        .with_context(|| format!("reference migration {version} not found"))
}

#[test]
fn schema_matches_reference_contract() {
    let tool = shared_dir().join("tools").join("schema-compat");
    if !tool.is_file() {
        eprintln!(
            "skipped: {} does not exist (the shared schema tools are not next to this checkout)",
            tool.display()
        );
        return;
    }
    let mut command = Command::new(&tool);
    command.arg("migrations").current_dir(manifest_dir());
    // The tool speaks libpq environment variables; point them at DATABASE_URL's server.
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
        let database = url.path().trim_start_matches('/');
        if !database.is_empty() {
            command.env("PGDATABASE", database);
        }
    }
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", tool.display()));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "schema-compat failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("schema-compat: all ")
                && l.ends_with(" reference definitions match")),
        "schema-compat did not report a full match:\n{stdout}\n{stderr}"
    );
}

#[tokio::test]
async fn migrate_adopts_existing_platform_database() -> Result<()> {
    let Some(refs) = reference_files()? else {
        eprintln!(
            "skipped: {} does not exist, so there is no platform schema to adopt",
            shared_dir().join("reference-schema").display()
        );
        return Ok(());
    };
    let reference_texts = refs
        .iter()
        .map(std::fs::read_to_string)
        .collect::<std::io::Result<Vec<_>>>()?;
    let ref_file = |version: &str| reference_file(&refs, version);

    // A platform database: our base tables, then the platform's own migrations verbatim, with
    // rows written between them the way the platform's history would have written them.
    let platform = ScratchDb::create("adopt").await?;
    let pool = platform.pool();
    apply_file(
        pool,
        &manifest_dir().join("migrations/0001_platform_base.sql"),
    )
    .await?;
    apply_file(pool, &ref_file("0006")?).await?;
    apply_sql(
        pool,
        "a legacy space with a document and no head",
        r#"
        INSERT INTO knowledge_spaces (id, tenant_id, slug, name, description, created_at, updated_at)
        VALUES ('aaaaaaaa-0000-4000-8000-000000000001', 'tenant-a', 'space-a', 'Space A', NULL, now(), now());
        INSERT INTO document_assets (id, knowledge_space_id, source_id, filename, mime_type, object_key,
                                     sha256, size_bytes, version, parser_status, metadata, created_at, updated_at)
        VALUES ('aaaaaaaa-0000-4000-8000-0000000000d1', 'aaaaaaaa-0000-4000-8000-000000000001', NULL, 'a.pdf',
                'application/pdf', 'objects/a', repeat('a', 64), 10, 1, 'parsed', '{}', now(), now());
        "#,
    )
    .await?;
    apply_file(pool, &ref_file("0009")?).await?;
    apply_file(pool, &ref_file("0015")?).await?;
    apply_sql(
        pool,
        "pre-0017 rows: an ownerless mutation lease and evidence bundle, a manifest",
        r#"
        INSERT INTO knowledge_space_mutation_leases (id, tenant_id, knowledge_space_id, operation, acquired_at)
        VALUES ('aaaaaaaa-0000-4000-8000-0000000000f1', 'tenant-a', 'aaaaaaaa-0000-4000-8000-000000000001',
                'document.upload', now() - interval '1 hour');
        INSERT INTO answer_traces (id, knowledge_space_id, evidence_bundle_id, query, answer, metadata, created_at)
        VALUES ('aaaaaaaa-0000-4000-8000-0000000000a1', 'aaaaaaaa-0000-4000-8000-000000000001',
                'aaaaaaaa-0000-4000-8000-0000000000e1', 'question', NULL, '{}', now());
        INSERT INTO evidence_bundles (id, trace_id, payload, created_at)
        VALUES ('aaaaaaaa-0000-4000-8000-0000000000e1', NULL, '{}', now());
        INSERT INTO knowledge_space_manifests (id, tenant_id, knowledge_space_id, version, manifest, created_at, updated_at)
        VALUES ('aaaaaaaa-0000-4000-8000-0000000000c1', 'tenant-a', 'aaaaaaaa-0000-4000-8000-000000000001',
                1, '{}', now(), now());
        "#,
    )
    .await?;
    apply_file(pool, &ref_file("0017")?).await?;
    apply_file(pool, &ref_file("0018")?).await?;
    // Written after the platform's migrations. Each would be touched if a one-time backfill ran
    // again: 0009's marker would latch space B (documents, no head yet), 0017 would make the
    // old writer's lease instantly reclaimable and give the ownerless bundle an owner.
    apply_sql(
        pool,
        "post-migration rows that a replayed backfill would change",
        r#"
        INSERT INTO knowledge_spaces (id, tenant_id, slug, name, description, created_at, updated_at)
        VALUES ('bbbbbbbb-0000-4000-8000-000000000001', 'tenant-b', 'space-b', 'Space B', NULL, now(), now());
        INSERT INTO document_assets (id, knowledge_space_id, source_id, filename, mime_type, object_key,
                                     sha256, size_bytes, version, parser_status, metadata, created_at, updated_at)
        VALUES ('bbbbbbbb-0000-4000-8000-0000000000d1', 'bbbbbbbb-0000-4000-8000-000000000001', NULL, 'b.pdf',
                'application/pdf', 'objects/b', repeat('b', 64), 10, 1, 'uploaded', '{}', now(), now());
        INSERT INTO knowledge_space_mutation_leases (id, tenant_id, knowledge_space_id, operation, acquired_at)
        VALUES ('bbbbbbbb-0000-4000-8000-0000000000f1', 'tenant-b', 'bbbbbbbb-0000-4000-8000-000000000001',
                'document.upload', now());
        INSERT INTO answer_traces (id, knowledge_space_id, evidence_bundle_id, query, answer, metadata, created_at)
        VALUES ('bbbbbbbb-0000-4000-8000-0000000000a1', 'bbbbbbbb-0000-4000-8000-000000000001',
                'bbbbbbbb-0000-4000-8000-0000000000e1', 'question', NULL, '{}', now());
        INSERT INTO evidence_bundles (id, trace_id, payload, created_at)
        VALUES ('bbbbbbbb-0000-4000-8000-0000000000e1', NULL, '{}', now());
        "#,
    )
    .await?;

    // The platform's backfills did run: otherwise the "unchanged" check below proves nothing.
    let markers: Vec<String> =
        sqlx::query_scalar("SELECT tenant_id FROM legacy_space_publication_bootstraps ORDER BY 1")
            .fetch_all(pool)
            .await?;
    ensure!(
        markers == ["tenant-a"],
        "platform 0009 markers: {markers:?}"
    );
    let (backfilled_lease, backfilled_bundle): (bool, bool) = sqlx::query_as(
        "SELECT
           (SELECT lease_token IS NOT NULL FROM knowledge_space_mutation_leases
            WHERE id = 'aaaaaaaa-0000-4000-8000-0000000000f1'),
           (SELECT tenant_id IS NOT NULL FROM evidence_bundles
            WHERE id = 'aaaaaaaa-0000-4000-8000-0000000000e1')",
    )
    .fetch_one(pool)
    .await?;
    ensure!(
        backfilled_lease && backfilled_bundle,
        "platform 0017 backfills did not run"
    );

    let rows_before = row_digests(pool).await?;
    MIGRATOR
        .run(pool)
        .await
        .context("first migrate over the platform database")?;
    MIGRATOR
        .run(pool)
        .await
        .context("second migrate over the platform database")?;
    let rows_after = row_digests(pool).await?;
    let changed = differences(&rows_before, &rows_after);
    assert!(
        changed.is_empty(),
        "migrate changed platform rows:\n{}",
        changed.join("\n")
    );

    let reference = reference_objects(&reference_texts);
    let checked = assert_reference_objects(pool, &reference).await?;
    assert!(
        checked > 100,
        "only {checked} reference objects found; is the parser broken?"
    );

    // The adopted database ends with exactly the schema a fresh database gets.
    let fresh = ScratchDb::create("adopt_fresh").await?;
    MIGRATOR
        .run(fresh.pool())
        .await
        .context("migrating a fresh database")?;
    let diff = differences(
        &describe_schema(pool).await?,
        &describe_schema(fresh.pool()).await?,
    );
    assert!(
        diff.is_empty(),
        "adopted (left) and fresh (right) schemas differ:\n{}",
        diff.join("\n")
    );
    Ok(())
}

#[tokio::test]
async fn migrate_is_idempotent_on_fresh_database() -> Result<()> {
    let db = ScratchDb::create("fresh").await?;
    let pool = db.pool();
    MIGRATOR.run(pool).await.context("first migrate")?;
    let schema_once = describe_schema(pool).await?;
    let rows_once = row_digests(pool).await?;
    MIGRATOR.run(pool).await.context("second migrate")?;
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

    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE success")
        .fetch_one(pool)
        .await?;
    assert_eq!(applied, i64::try_from(MIGRATOR.iter().count())?);

    let key_tables = [
        "knowledge_spaces",
        "document_assets",
        "projection_set_publication_heads",
        "document_compilation_attempts",
        "document_compilation_outbox",
        "legacy_space_publication_bootstraps",
        "knowledge_space_mutation_leases",
        "research_task_jobs",
        "research_task_outbox",
        "research_task_progress_events",
        "deletion_jobs",
        "deletion_outbox",
        "deletion_job_items",
        "deletion_tombstones",
        "deletion_retry_audits",
        "retrieval_execution_leases",
        "knowledge_space_profile_backfills",
    ];
    for table in key_tables {
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(table)
            .fetch_one(pool)
            .await?;
        assert!(exists, "table {table} is missing after migrate");
    }
    Ok(())
}
