//! `kfs-worker migrate`: the project's migrations, applied once each, recorded in the project's
//! own ledger `kfs_worker_migrations`. Invariant: the database is classified before anything
//! changes — fresh (no platform table at all), adopted (a platform database whose own ledger
//! `schema_migrations` records every platform migration through 0018 and whose schema has what
//! those migrations made), or already managed (the project's ledger exists) — and a database
//! that is none of these is refused with one line naming what is missing, with nothing written.
//! On an adopted database every migration statement is a no-op except the project's own objects.

use std::fmt;
use std::time::Instant;

use sqlx::migrate::{Migration, Migrator};
use sqlx::{Connection, PgConnection, PgPool};

/// The project's migrations, embedded at build time.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// The session advisory lock that serialises concurrent `migrate` runs (one-key form, so it
/// never collides with the two-key liveness locks).
const LOCK_KEY: i64 = 7_038_579_000;

/// The platform's migrations whose schema the project builds, as the platform's own runner
/// records them in `schema_migrations` (`migration_id`, dialect `postgres`).
pub const PLATFORM_MIGRATIONS: [&str; 18] = [
    "0001_initial_schema",
    "0002_vector_index_upgrade",
    "0003_projection_set_publications",
    "0004_projection_publication_members",
    "0005_publication_generation_nonzero",
    "0006_document_compilation_attempts",
    "0007_knowledge_node_generations",
    "0008_flattened_page_index",
    "0009_legacy_space_bootstrap",
    "0010_page_index_upgrade_backfill",
    "0011_tidb_fts_postings",
    "0012_tidb_baseline_repair",
    "0013_space_access_control",
    "0014_source_credential_refs",
    "0015_research_task_jobs",
    "0016_compilation_job_requester_binding",
    "0017_durable_deletion",
    "0018_versioned_space_profiles",
];

/// What a platform migration leaves behind, checked on a database the platform built before
/// anything is changed. Each object was introduced by that migration (0012 is a no-op on
/// Postgres and leaves nothing).
#[derive(Clone, Copy, Debug)]
enum Marker {
    Table(&'static str),
    Column(&'static str, &'static str),
    Constraint(&'static str, &'static str),
    /// 0002: `dense_vector` is a dimension-free `vector`.
    VectorWithoutDimension(&'static str, &'static str),
}

const MARKERS: &[(&str, Marker)] = &[
    ("0001", Marker::Table("knowledge_spaces")),
    ("0001", Marker::Table("knowledge_nodes")),
    ("0001", Marker::Table("index_projections")),
    ("0001", Marker::Table("parse_artifacts")),
    ("0001", Marker::Table("embedding_models")),
    (
        "0002",
        Marker::VectorWithoutDimension("index_projections", "dense_vector"),
    ),
    ("0003", Marker::Table("projection_set_publications")),
    ("0003", Marker::Table("projection_set_publication_heads")),
    ("0004", Marker::Table("projection_set_publication_members")),
    (
        "0004",
        Marker::Column("index_projections", "publication_generation_id"),
    ),
    (
        "0005",
        Marker::Constraint("index_projections", "index_projections_pub_gen_nonzero_ck"),
    ),
    ("0006", Marker::Table("document_compilation_attempts")),
    ("0006", Marker::Table("document_compilation_outbox")),
    (
        "0007",
        Marker::Column("knowledge_nodes", "publication_generation_id"),
    ),
    (
        "0007",
        Marker::Constraint(
            "document_compilation_attempts",
            "document_compilation_attempts_candidate_checkpoint_ck",
        ),
    ),
    ("0008", Marker::Table("page_index_manifests")),
    ("0008", Marker::Table("page_index_nodes")),
    ("0008", Marker::Table("page_index_terms")),
    ("0009", Marker::Table("legacy_space_publication_bootstraps")),
    ("0009", Marker::Table("knowledge_space_mutation_leases")),
    ("0010", Marker::Table("page_index_upgrade_backfills")),
    ("0010", Marker::Table("page_index_upgrade_backfill_items")),
    ("0011", Marker::Table("index_projection_fts_postings")),
    (
        "0011",
        Marker::Constraint(
            "projection_set_publications",
            "projection_set_publications_status_ck",
        ),
    ),
    ("0013", Marker::Table("knowledge_space_members")),
    (
        "0013",
        Marker::Table("knowledge_space_permission_snapshots"),
    ),
    ("0014", Marker::Column("sources", "credential_ref")),
    ("0014", Marker::Table("source_secret_lifecycle_refs")),
    ("0015", Marker::Table("research_task_jobs")),
    ("0015", Marker::Column("answer_traces", "subject_id")),
    (
        "0016",
        Marker::Column("document_compilation_attempts", "requested_by_subject_id"),
    ),
    (
        "0016",
        Marker::Constraint(
            "document_compilation_attempts",
            "document_compilation_attempts_permission_snapshot_fk",
        ),
    ),
    ("0017", Marker::Table("deletion_jobs")),
    (
        "0017",
        Marker::Column("knowledge_spaces", "lifecycle_state"),
    ),
    (
        "0017",
        Marker::Constraint(
            "knowledge_space_manifests",
            "knowledge_space_manifests_space_fk",
        ),
    ),
    ("0018", Marker::Table("knowledge_space_profile_revisions")),
    ("0018", Marker::Table("knowledge_space_profile_heads")),
    ("0018", Marker::Table("knowledge_space_profile_backfills")),
];

/// Tables whose presence means the database already holds the platform's schema (in part or in
/// whole): the first platform table of each of its migrations that creates one.
const PLATFORM_TABLES: &[&str] = &[
    "knowledge_spaces",
    "document_assets",
    "knowledge_nodes",
    "index_projections",
    "projection_set_publications",
    "projection_set_publication_members",
    "document_compilation_attempts",
    "page_index_manifests",
    "legacy_space_publication_bootstraps",
    "page_index_upgrade_backfills",
    "index_projection_fts_postings",
    "knowledge_space_permission_snapshots",
    "source_secret_lifecycle_refs",
    "research_task_jobs",
    "deletion_jobs",
    "knowledge_space_profile_heads",
];

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// The database cannot be migrated as it is; nothing was changed.
    #[error("{0}; nothing was changed")]
    Refused(String),
    #[error("migration {version} ({description}) failed: {source}")]
    Failed {
        version: i64,
        description: String,
        source: sqlx::Error,
    },
    #[error(
        "migration {version} ({description}) was applied with other contents than this build has"
    )]
    Changed { version: i64, description: String },
    #[error("building the project's own indexes failed: {0}")]
    Index(sqlx::Error),
    #[error("{0}")]
    Db(#[from] sqlx::Error),
}

/// What kind of database `migrate` found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// No platform table and no ledger: every migration builds the schema.
    Fresh,
    /// A database the platform's own migrations built, taken over as it is.
    Platform,
    /// A database this project migrated before.
    Managed,
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Found::Fresh => "a fresh database",
            Found::Platform => "a platform database",
            Found::Managed => "a database migrated before",
        })
    }
}

/// The outcome of a `migrate` run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub found: Found,
    /// Versions applied by this run, in order.
    pub applied: Vec<i64>,
    pub total: usize,
    /// Platform migrations after 0018 recorded in the database (the project builds the schema
    /// through 0018; later platform columns are left to the platform).
    pub newer_platform: Vec<String>,
    /// The project's own indexes built by this run (see [`super::indexes`]).
    pub indexes: super::indexes::Built,
}

/// Classifies the database, refuses one that cannot be adopted, then applies every pending
/// migration, each in its own transaction together with its ledger row. Safe to run from many
/// processes at once: they take turns on an advisory lock.
pub async fn migrate(pool: &PgPool) -> Result<Report, MigrateError> {
    let mut conn = pool.acquire().await?;
    // Waiting by polling, never inside one statement: a session blocked in `pg_advisory_lock`
    // holds a snapshot, which the holder's `CREATE INDEX CONCURRENTLY` would wait for while the
    // blocked session waits for the holder.
    while !sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_lock($1)")
        .bind(LOCK_KEY)
        .fetch_one(&mut *conn)
        .await?
    {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let result = match migrate_locked(&mut conn).await {
        Ok(mut report) => match super::indexes::ensure(&mut conn).await {
            Ok(built) => {
                report.indexes = built;
                Ok(report)
            }
            Err(source) => Err(MigrateError::Index(source)),
        },
        Err(e) => Err(e),
    };
    let unlocked = sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(LOCK_KEY)
        .execute(&mut *conn)
        .await;
    if unlocked.is_err() {
        // The lock goes with the session: make sure this one is not handed out again.
        conn.detach().close().await.ok();
    }
    result
}

async fn migrate_locked(conn: &mut PgConnection) -> Result<Report, MigrateError> {
    let (found, newer_platform) = classify(conn).await?;
    sqlx::raw_sql(
        r#"CREATE TABLE IF NOT EXISTS "kfs_worker_migrations" (
             "version" BIGINT PRIMARY KEY,
             "description" TEXT NOT NULL,
             "checksum" BYTEA NOT NULL,
             "installed_at" TIMESTAMPTZ NOT NULL DEFAULT now(),
             "execution_ms" BIGINT NOT NULL
           )"#,
    )
    .execute(&mut *conn)
    .await?;
    let done: Vec<(i64, Vec<u8>)> =
        sqlx::query_as(r#"SELECT "version", "checksum" FROM "kfs_worker_migrations""#)
            .fetch_all(&mut *conn)
            .await?;
    let mut applied = Vec::new();
    for m in MIGRATOR.iter() {
        if let Some((_, checksum)) = done.iter().find(|(v, _)| *v == m.version) {
            if checksum.as_slice() != &*m.checksum {
                return Err(MigrateError::Changed {
                    version: m.version,
                    description: m.description.to_string(),
                });
            }
            continue;
        }
        apply(conn, m).await?;
        applied.push(m.version);
    }
    Ok(Report {
        found,
        applied,
        total: MIGRATOR.iter().count(),
        newer_platform,
        indexes: super::indexes::Built::default(),
    })
}

async fn apply(conn: &mut PgConnection, m: &Migration) -> Result<(), MigrateError> {
    let failed = |source| MigrateError::Failed {
        version: m.version,
        description: m.description.to_string(),
        source,
    };
    let start = Instant::now();
    let record = |ms: i64| {
        sqlx::query(
            r#"INSERT INTO "kfs_worker_migrations" ("version", "description", "checksum", "execution_ms")
               VALUES ($1, $2, $3, $4)"#,
        )
        .bind(m.version)
        .bind(m.description.to_string())
        .bind(m.checksum.to_vec())
        .bind(ms)
    };
    if m.no_tx {
        // CREATE INDEX CONCURRENTLY and friends: each statement commits on its own, and every
        // such statement is written to be repeatable.
        sqlx::raw_sql(&m.sql)
            .execute(&mut *conn)
            .await
            .map_err(failed)?;
        let ms = i64::try_from(start.elapsed().as_millis()).unwrap_or(i64::MAX);
        record(ms).execute(&mut *conn).await.map_err(failed)?;
        return Ok(());
    }
    let mut tx = conn.begin().await?;
    sqlx::raw_sql(&m.sql)
        .execute(&mut *tx)
        .await
        .map_err(failed)?;
    let ms = i64::try_from(start.elapsed().as_millis()).unwrap_or(i64::MAX);
    record(ms).execute(&mut *tx).await.map_err(failed)?;
    tx.commit().await.map_err(failed)?;
    Ok(())
}

/// Reads what the database holds and decides whether it may be migrated. Writes nothing.
async fn classify(conn: &mut PgConnection) -> Result<(Found, Vec<String>), MigrateError> {
    let managed: bool =
        sqlx::query_scalar("SELECT to_regclass('kfs_worker_migrations') IS NOT NULL")
            .fetch_one(&mut *conn)
            .await?;
    let present: Vec<String> = sqlx::query_scalar(
        "SELECT t FROM unnest($1::text[]) AS t WHERE to_regclass(quote_ident(t)) IS NOT NULL",
    )
    .bind(PLATFORM_TABLES)
    .fetch_all(&mut *conn)
    .await?;
    let ledger: bool = sqlx::query_scalar("SELECT to_regclass('schema_migrations') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await?;
    let recorded: Vec<String> = if ledger {
        sqlx::query_scalar(
            "SELECT migration_id::text FROM schema_migrations WHERE dialect = 'postgres' ORDER BY 1",
        )
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| {
            MigrateError::Refused(format!(
                "schema_migrations exists but is not the platform's migration ledger ({e})"
            ))
        })?
    } else {
        Vec::new()
    };
    let newer: Vec<String> = recorded
        .iter()
        .filter(|id| id.as_str() > PLATFORM_MIGRATIONS[PLATFORM_MIGRATIONS.len() - 1])
        .cloned()
        .collect();
    if managed {
        return Ok((Found::Managed, newer));
    }
    if present.is_empty() && !ledger {
        let available: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'vector')",
        )
        .fetch_one(&mut *conn)
        .await?;
        if !available {
            return Err(MigrateError::Refused(
                "the Postgres server has no vector extension (pgvector), which the platform's \
                 index_projections table needs: install pgvector for this server (ops/services does \
                 it on Debian)"
                    .into(),
            ));
        }
        return Ok((Found::Fresh, newer));
    }
    check_platform(conn, ledger, &present, &recorded).await?;
    Ok((Found::Platform, newer))
}

/// A database with platform tables but no project ledger: it must be one the platform's own
/// migrations 0001–0018 built, complete.
async fn check_platform(
    conn: &mut PgConnection,
    ledger: bool,
    present: &[String],
    recorded: &[String],
) -> Result<(), MigrateError> {
    if !ledger {
        let legacy: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
            .fetch_one(&mut *conn)
            .await?;
        let hint = if legacy {
            " (it looks like a database built by an older kfs-worker, whose tables were not the \
             platform's: migrate a fresh database instead)"
        } else {
            ""
        };
        return Err(MigrateError::Refused(format!(
            "the database has platform tables ({}) but no schema_migrations ledger, so it was not \
             built by the platform's migrations{hint}",
            present.join(", ")
        )));
    }
    if let Some(missing) = PLATFORM_MIGRATIONS
        .iter()
        .find(|id| !recorded.iter().any(|r| r == *id))
    {
        return Err(MigrateError::Refused(format!(
            "the platform's migration {missing} has not been applied to this database (no \
             schema_migrations row); apply the platform's migrations through \
             {} first",
            PLATFORM_MIGRATIONS[PLATFORM_MIGRATIONS.len() - 1]
        )));
    }
    let vector: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'vector')")
            .fetch_one(&mut *conn)
            .await?;
    if !vector {
        return Err(MigrateError::Refused(
            "the platform database has no vector extension (pgvector) installed".into(),
        ));
    }
    for (migration, marker) in MARKERS {
        if !has(conn, *marker).await? {
            let id = PLATFORM_MIGRATIONS
                .iter()
                .find(|id| id.starts_with(migration))
                .copied()
                .unwrap_or(migration);
            return Err(MigrateError::Refused(format!(
                "schema_migrations records the platform's migration {id}, but {} is missing",
                describe(*marker)
            )));
        }
    }
    Ok(())
}

fn describe(m: Marker) -> String {
    match m {
        Marker::Table(t) => format!("table {t}"),
        Marker::Column(t, c) => format!("column {t}.{c}"),
        Marker::Constraint(t, c) => format!("constraint {c} on {t}"),
        Marker::VectorWithoutDimension(t, c) => {
            format!("column {t}.{c} as a vector without a fixed dimension")
        }
    }
}

async fn has(conn: &mut PgConnection, m: Marker) -> Result<bool, sqlx::Error> {
    match m {
        Marker::Table(t) => {
            sqlx::query_scalar("SELECT to_regclass(quote_ident($1)) IS NOT NULL")
                .bind(t)
                .fetch_one(conn)
                .await
        }
        Marker::Column(t, c) => {
            sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(quote_ident($1)) \
                   AND attname = $2 AND attnum > 0 AND NOT attisdropped)",
            )
            .bind(t)
            .bind(c)
            .fetch_one(conn)
            .await
        }
        Marker::Constraint(t, c) => {
            sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = to_regclass(quote_ident($1)) \
                   AND conname = $2)",
            )
            .bind(t)
            .bind(c)
            .fetch_one(conn)
            .await
        }
        Marker::VectorWithoutDimension(t, c) => {
            sqlx::query_scalar(
                "SELECT coalesce((SELECT format_type(atttypid, atttypmod) = 'vector' FROM pg_attribute \
                   WHERE attrelid = to_regclass(quote_ident($1)) AND attname = $2 AND NOT attisdropped), false)",
            )
            .bind(t)
            .bind(c)
            .fetch_one(conn)
            .await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_platform_migration_but_the_no_op_has_a_marker() {
        for id in PLATFORM_MIGRATIONS {
            let n = &id[..4];
            let marked = MARKERS.iter().any(|(m, _)| *m == n);
            assert_eq!(marked, n != "0012", "{id}");
        }
    }

    #[test]
    fn platform_migrations_are_in_order() {
        let mut sorted = PLATFORM_MIGRATIONS;
        sorted.sort_unstable();
        assert_eq!(sorted, PLATFORM_MIGRATIONS);
    }
}
