//! The schema contract (DESIGN.md, "The schema contract").
//!
//! Invariants checked here, against a real Postgres (DATABASE_URL names the admin database):
//! - the project's migrations build exactly the platform's job tables
//!   (`../shared/tools/schema-compat`) and the platform's whole schema through its migration 0018
//!   (`../shared/tools/platform-compat`);
//! - `kfs-worker migrate` adopts a database the platform built (its tables created from the
//!   platform's schema facts, filled with rows, its migration ledger written): it adds only the
//!   project's own objects, changes no platform row or definition, ends with the schema a fresh
//!   database gets, and does nothing the second time;
//! - it refuses, with one line naming what is missing and nothing changed, a database whose
//!   ledger lacks a platform migration, one whose ledger claims what its schema lacks, and one
//!   without the vector extension;
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
        let services = support::isolation::shared().await;
        let admin = PgConnectOptions::from_str(&support::admin_url())
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
            _services: services,
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

/// Runs one of the shared schema tools against DATABASE_URL's server; returns its stdout.
fn run_tool(name: &str) -> Option<String> {
    let shared = shared_or_skip(name)?;
    let _services = support::isolation::shared_blocking();
    let tool = shared.join("tools").join(name);
    let mut command = Command::new(&tool);
    command.arg("migrations").current_dir(manifest_dir());
    // The tools speak libpq environment variables; point them at DATABASE_URL's server.
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
fn schema_matches_reference_contract() {
    let Some(out) = run_tool("schema-compat") else {
        return;
    };
    assert!(
        out.lines()
            .any(|l| l.starts_with("schema-compat: all ")
                && l.contains(" reference definitions match")),
        "schema-compat did not report a full match:\n{out}"
    );
}

#[test]
fn migrations_build_the_platforms_whole_schema() {
    let Some(out) = run_tool("platform-compat") else {
        return;
    };
    assert!(
        out.lines().any(|l| l.starts_with("platform-compat: all ")
            && l.ends_with(" platform definitions match")),
        "platform-compat did not report a full match:\n{out}"
    );
}

/// The platform's schema facts: `platform-0018.schema.json`.
fn platform_schema() -> Option<serde_json::Value> {
    let shared = shared_or_skip("building a platform database")?;
    let path = shared.join("reference-schema/platform-0018.schema.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Some(serde_json::from_str(&text).expect("the schema facts are JSON"))
}

/// Builds the platform's schema the way its migrations leave it, from its schema facts (not
/// from this project's migrations): the extension, every table with its columns, its keys and
/// checks, its indexes, its foreign keys; then the platform's migration ledger with `ledger`.
async fn build_platform(pool: &PgPool, facts: &serde_json::Value, ledger: &[&str]) -> Result<()> {
    let mut ddl = vec!["CREATE EXTENSION IF NOT EXISTS vector;".to_owned()];
    let tables = facts["tables"].as_object().context("tables")?;
    let mut constraints = Vec::new();
    let mut foreign = Vec::new();
    let mut indexes = Vec::new();
    for (table, t) in tables {
        let columns: Vec<String> = t["columns"]
            .as_object()
            .context("columns")?
            .iter()
            .map(|(c, v)| {
                let mut col = format!(r#""{c}" {}"#, v["type"].as_str().unwrap_or("text"));
                if v["not_null"].as_bool() == Some(true) {
                    col.push_str(" NOT NULL");
                }
                if let Some(d) = v["default"].as_str().filter(|d| !d.is_empty()) {
                    col.push_str(&format!(" DEFAULT {d}"));
                }
                col
            })
            .collect();
        ddl.push(format!(
            r#"CREATE TABLE "{table}" ({});"#,
            columns.join(", ")
        ));
        let mut backing = Vec::new();
        for (name, def) in t["constraints"].as_object().context("constraints")? {
            let def = def.as_str().unwrap_or_default();
            let stmt = format!(r#"ALTER TABLE "{table}" ADD CONSTRAINT "{name}" {def};"#);
            if def.starts_with("FOREIGN KEY") {
                foreign.push(stmt);
            } else {
                if def.starts_with("PRIMARY KEY") || def.starts_with("UNIQUE") {
                    backing.push(name.clone());
                }
                constraints.push(stmt);
            }
        }
        for (name, def) in t["indexes"].as_object().context("indexes")? {
            if !backing.contains(name) {
                indexes.push(format!("{};", def.as_str().unwrap_or_default()));
            }
        }
    }
    ddl.extend(constraints);
    ddl.extend(indexes);
    ddl.extend(foreign);
    ddl.push(
        r#"CREATE TABLE "schema_migrations" ("migration_id" VARCHAR(255) PRIMARY KEY,
             "dialect" VARCHAR(32) NOT NULL, "applied_at" TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP);"#
            .to_owned(),
    );
    for id in ledger {
        ddl.push(format!(
            "INSERT INTO schema_migrations (migration_id, dialect) VALUES ('{id}', 'postgres');"
        ));
    }
    apply_sql(pool, "the platform's schema", &ddl.join("\n")).await
}

/// Rows as the platform's API and history leave them, including rows that a one-time backfill
/// of the platform's migrations would change if it ran again: a space with a document but no
/// head (0009's bootstrap marker), a mutation lease of the old ownerless protocol (0017's
/// compatibility cut), an evidence bundle without an owner (0017's owner backfill), a source
/// credential with its lifecycle row (0014's consistency guard).
async fn fill_platform(pool: &PgPool) -> Result<()> {
    let mut conn = pool.acquire().await?;
    let store = kfs_worker::store::Store::open(
        &kfs_worker::config::object_store("memory://").map_err(|e| anyhow::anyhow!("{e}"))?,
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let space = kfs_worker::tools::platform::create_space(
        &mut conn, "tenant-a", "space-a", "Space A", "owner-a",
    )
    .await?;
    let reference = kfs_worker::tools::platform::new_credential_ref();
    let source = kfs_worker::tools::platform::create_source(
        &mut conn,
        space,
        "web",
        "web",
        Some(&reference),
    )
    .await?;
    let doc = kfs_worker::tools::platform::add_document(
        &mut conn,
        &store,
        space,
        Some(source),
        "a.md",
        "text/markdown",
        bytes::Bytes::from_static(b"# A\n\nAlpha."),
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let snapshot = kfs_worker::tools::platform::create_permission_snapshot(
        &mut conn,
        "tenant-a",
        space,
        "owner-a",
        "interactive",
        None,
    )
    .await?;
    let mut tx = pool.begin().await?;
    kfs_worker::jobs::compile::request(
        &mut tx,
        doc,
        kfs_worker::jobs::compile::RequestOptions {
            defer: true,
            requester: Some(kfs_worker::jobs::compile::Requester {
                subject: "owner-a".into(),
                snapshot,
            }),
        },
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    tx.commit().await?;
    drop(conn);
    apply_sql(
        pool,
        "rows a replayed backfill would change",
        &format!(
            r#"
            INSERT INTO knowledge_space_mutation_leases (id, tenant_id, knowledge_space_id, operation, acquired_at)
            VALUES ('aaaaaaaa-0000-4000-8000-0000000000f1', 'tenant-a', '{space}', 'document.upload', now() - interval '1 hour');
            INSERT INTO evidence_bundles (id, trace_id, query, state, items, missing_evidence, created_at)
            VALUES ('aaaaaaaa-0000-4000-8000-0000000000e1', NULL, 'question', 'answerable', '[]', '[]', now());
            INSERT INTO answer_traces (id, knowledge_space_id, evidence_bundle_id, query, mode, completed, created_at)
            VALUES ('aaaaaaaa-0000-4000-8000-0000000000a1', '{space}', 'aaaaaaaa-0000-4000-8000-0000000000e1',
                    'question', 'fast', TRUE, now());
            "#
        ),
    )
    .await
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

/// Runs the `kfs-worker` binary with DATABASE_URL naming `db`.
fn kfs_migrate(db: &ScratchDb) -> std::process::Output {
    let mut url = url::Url::parse(&support::admin_url()).expect("DATABASE_URL");
    url.set_path(&format!("/{}", db.name));
    Command::new(env!("CARGO_BIN_EXE_kfs-worker"))
        .arg("migrate")
        .env("DATABASE_URL", url.as_str())
        .env_remove("RUST_LOG")
        .output()
        .expect("run kfs-worker migrate")
}

fn text(o: &std::process::Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[tokio::test]
async fn migrate_adopts_a_platform_database_and_changes_nothing_of_it() -> Result<()> {
    let Some(facts) = platform_schema() else {
        return Ok(());
    };
    let platform = ScratchDb::create("adopt").await?;
    let pool = platform.pool();
    build_platform(pool, &facts, &PLATFORM_MIGRATIONS).await?;
    fill_platform(pool).await?;
    let rows_before = row_digests(pool).await?;
    let schema_before = describe_schema(pool).await?;
    ensure!(
        rows_before
            .values()
            .filter(|d| !d.starts_with("0 "))
            .count()
            >= 12,
        "too few rows: {rows_before:?}"
    );

    let out = kfs_migrate(&platform);
    let (stdout, stderr) = text(&out);
    ensure!(out.status.success(), "migrate failed: {stdout}{stderr}");
    ensure!(stdout.contains("(a platform database)"), "{stdout}");
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
        !added.is_empty(),
        "the project's own objects were not added"
    );
    let ledger: i64 = sqlx::query_scalar("SELECT count(*) FROM kfs_worker_migrations")
        .fetch_one(pool)
        .await?;
    ensure!(
        ledger == i64::try_from(MIGRATOR.iter().count())?,
        "ledger rows: {ledger}"
    );

    // The adopted database has exactly the schema a fresh database gets.
    let fresh = ScratchDb::create("adopt_fresh").await?;
    kfs_worker::db::migrate(fresh.pool())
        .await
        .context("migrating a fresh database")?;
    let mut adopted = describe_schema(pool).await?;
    let mut built = describe_schema(fresh.pool()).await?;
    // CHECKs that the platform writes as `IN (...)` and that the facts spell out as `= ANY`
    // read back in two spellings; compare them by meaning, not by text.
    for m in [&mut adopted, &mut built] {
        for v in m.values_mut() {
            *v = v
                .replace("(ARRAY[('", "((ARRAY['")
                .replace("'::character varying)::text, ('", "'::character varying, '")
                .replace(
                    "'::character varying)::text])",
                    "'::character varying])::text[])",
                );
        }
    }
    let diff = differences(&adopted, &built);
    ensure!(
        diff.is_empty(),
        "adopted (left) and fresh (right) schemas differ:\n{}",
        diff.join("\n")
    );
    Ok(())
}

/// Builds a platform database, spoils it with `spoil`, runs `kfs-worker migrate`, and checks that
/// it refused with one line containing `needle` and changed nothing.
async fn refused(tag: &str, ledger: &[&str], spoil: &str, needle: &str) -> Result<()> {
    let Some(facts) = platform_schema() else {
        return Ok(());
    };
    let db = ScratchDb::create(tag).await?;
    build_platform(db.pool(), &facts, ledger).await?;
    fill_platform(db.pool()).await?;
    if !spoil.is_empty() {
        apply_sql(db.pool(), "the spoiling", spoil).await?;
    }
    let rows = row_digests(db.pool()).await?;
    let schema = describe_schema(db.pool()).await?;
    let out = kfs_migrate(&db);
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
    Ok(())
}

#[tokio::test]
async fn migrate_refuses_a_platform_database_missing_one_of_the_platforms_migrations() -> Result<()>
{
    let ledger: Vec<&str> = PLATFORM_MIGRATIONS
        .iter()
        .copied()
        .filter(|id| !id.starts_with("0016"))
        .collect();
    refused(
        "no0016",
        &ledger,
        "",
        "0016_compilation_job_requester_binding has not been applied",
    )
    .await
}

#[tokio::test]
async fn migrate_refuses_a_ledger_that_claims_what_the_schema_lacks() -> Result<()> {
    refused(
        "nocolumn",
        &PLATFORM_MIGRATIONS,
        "ALTER TABLE document_compilation_attempts DROP COLUMN requested_by_subject_id CASCADE;",
        "column document_compilation_attempts.requested_by_subject_id is missing",
    )
    .await
}

#[tokio::test]
async fn migrate_refuses_a_platform_database_without_the_vector_extension() -> Result<()> {
    refused(
        "novector",
        &PLATFORM_MIGRATIONS,
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
    let recorded: Vec<String> = sqlx::query_scalar(
        "SELECT migration_id::text FROM schema_migrations WHERE dialect = 'postgres' ORDER BY 1",
    )
    .fetch_all(pool)
    .await?;
    assert_eq!(recorded, PLATFORM_MIGRATIONS);
    Ok(())
}
