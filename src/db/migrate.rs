//! `kfs-worker migrate`: the project's migrations, applied once each, recorded in the project's
//! own ledger `kfs_worker_migrations`. The project's migrations 0001–0054 are the platform's
//! schema through its migration 0054; 0099 and later are the project's own objects.
//!
//! Invariant: the database is classified before anything changes — fresh (no platform table at
//! all), adopted (a platform database whose ledger `schema_migrations` records the platform's
//! migrations through at least 0018, and whose schema has what every recorded one made), or
//! already managed (the project's ledger exists) — and one that cannot be taken as it is gets one
//! line naming why, with nothing written: a ledger that records a platform migration this build
//! does not know, or that lacks one of 0001–0018, or (unless `--upgrade-platform` allows it) one
//! of 0019–0054. A platform migration the platform's ledger records never runs again, so on a
//! database at 0054 only the project's own objects are added; one it lacks runs once, in order,
//! in one transaction with its ledger row.

use std::fmt;
use std::time::Instant;

use sqlx::migrate::{Migration, Migrator};
use sqlx::{Connection, PgConnection, PgPool};

/// The project's migrations, embedded at build time.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// The session advisory lock that serialises concurrent `migrate` runs (one-key form, so it
/// never collides with the two-key liveness locks).
const LOCK_KEY: i64 = 7_038_579_000;

/// The platform's migrations whose schema the project builds, in order, as the platform's own
/// runner records them in `schema_migrations` (`migration_id`, dialect `postgres`). The project's
/// migration of version N (N <= 54) is the platform's migration `PLATFORM_MIGRATIONS[N - 1]`
/// (its 0001 also builds the tables of the platform's 0002-0014 that have no file of their own).
pub const PLATFORM_MIGRATIONS: [&str; 54] = [
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
    "0019_profile_publication_bindings",
    "0020_profile_migration_runs",
    "0021_source_product_workflows",
    "0022_logical_document_revisions",
    "0023_knowledge_space_overview",
    "0024_quality_control",
    "0025_capability_grant_provenance",
    "0026_capability_job_provenance",
    "0027_upload_sessions",
    "0028_dify_integration_states",
    "0029_dify_integration_freezes",
    "0030_bulk_operations",
    "0031_source_connection_capability_provenance",
    "0032_capability_source_sync_policies",
    "0033_research_task_final_answers",
    "0034_knowledge_space_emoji_icons",
    "0035_research_task_answer_streaming",
    "0036_page_index_findability",
    "0037_logical_document_zero_revision_deletion",
    "0038_document_outline_summary_checkpoints",
    "0039_document_semantic_enrichment",
    "0040_knowledge_space_metadata",
    "0041_logical_document_availability",
    "0042_workflow_failed_retrieval_capture",
    "0043_semantic_generation_receipts",
    "0044_document_semantic_window_checkpoints",
    "0045_quality_replay_match_policy",
    "0046_remove_provider_sync_policy",
    "0047_parse_artifact_checkpoints",
    "0048_deletion_active_scope_indexes",
    "0049_answer_trace_query_images",
    "0050_deletion_job_capability_provenance",
    "0051_failed_query_trace_outcome_index",
    "0052_namespace_source_previews",
    "0053_answer_trace_source",
    "0054_graph_semantic_projections",
];

/// The platform's migrations a database must record before `migrate` takes it over at all:
/// through 0018, the level the project first adopted. The later ones `migrate` applies itself
/// only when asked to (`--upgrade-platform`).
const BASE_LEVEL: usize = 18;

/// What a platform migration leaves behind, checked on a database the platform built before
/// anything is changed. Each object was introduced by that migration (0012 is a no-op on
/// Postgres and leaves nothing).
#[derive(Clone, Copy, Debug)]
enum Marker {
    Table(&'static str),
    Column(&'static str, &'static str),
    Constraint(&'static str, &'static str),
    /// A constraint whose definition mentions the text (a CHECK list the migration widened).
    ConstraintMentions(&'static str, &'static str, &'static str),
    /// A constraint whose definition no longer mentions the text (a value the migration removed).
    ConstraintOmits(&'static str, &'static str, &'static str),
    /// A constraint the migration dropped.
    NoConstraint(&'static str, &'static str),
    Index(&'static str),
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
    (
        "0019",
        Marker::Table("knowledge_space_profile_publication_bindings"),
    ),
    (
        "0019",
        Marker::Column(
            "document_compilation_attempts",
            "retrieval_profile_revision_id",
        ),
    ),
    (
        "0020",
        Marker::Table("knowledge_space_profile_migration_runs"),
    ),
    ("0021", Marker::Table("source_workflow_runs")),
    ("0021", Marker::Column("sources", "connection_id")),
    ("0022", Marker::Table("logical_documents")),
    ("0022", Marker::Table("document_revisions")),
    ("0023", Marker::Column("knowledge_spaces", "icon_ref")),
    ("0024", Marker::Table("quality_replay_runs")),
    ("0025", Marker::Table("capability_grants")),
    ("0025", Marker::Table("capability_space_fences")),
    (
        "0026",
        Marker::Column("research_task_jobs", "capability_grant_id"),
    ),
    (
        "0026",
        Marker::Column("deletion_jobs", "capability_grant_id"),
    ),
    (
        "0026",
        Marker::Constraint(
            "document_compilation_attempts",
            "document_compilation_attempts_authorization_binding_ck",
        ),
    ),
    ("0027", Marker::Table("upload_sessions")),
    ("0028", Marker::Table("dify_integration_states")),
    ("0029", Marker::Table("dify_integration_freezes")),
    ("0030", Marker::Table("bulk_operations")),
    (
        "0031",
        Marker::Column("source_connections", "capability_grant_id"),
    ),
    (
        "0032",
        Marker::Column("source_sync_policies", "capability_grant_id"),
    ),
    (
        "0033",
        Marker::Column("research_task_partial_results", "answer"),
    ),
    (
        "0034",
        Marker::ConstraintMentions(
            "knowledge_spaces",
            "knowledge_spaces_icon_ref_ck",
            "(builtin:)?",
        ),
    ),
    (
        "0035",
        Marker::ConstraintMentions(
            "research_task_progress_events",
            "research_task_progress_event_ck",
            "research_task.answer_delta",
        ),
    ),
    ("0036", Marker::Table("page_index_findability_evaluations")),
    (
        "0037",
        Marker::ConstraintMentions(
            "deletion_jobs",
            "deletion_jobs_positive_ck",
            "logical_document",
        ),
    ),
    (
        "0038",
        Marker::Table("document_outline_summary_checkpoints"),
    ),
    ("0039", Marker::Table("document_semantic_enrichment_jobs")),
    ("0040", Marker::Table("knowledge_space_metadata_fields")),
    ("0041", Marker::Column("logical_documents", "enabled")),
    (
        "0042",
        Marker::Column("failed_queries", "capability_grant_id"),
    ),
    ("0043", Marker::Table("knowledge_node_generation_receipts")),
    (
        "0044",
        Marker::Table("document_semantic_window_checkpoints"),
    ),
    (
        "0045",
        Marker::Column("quality_replay_items", "match_policy"),
    ),
    (
        "0046",
        Marker::ConstraintOmits(
            "source_sync_policies",
            "source_sync_policies_mode_ck",
            "'provider'",
        ),
    ),
    ("0047", Marker::Table("parse_artifact_checkpoints")),
    ("0048", Marker::Index("deletion_jobs_active_scope_idx")),
    ("0049", Marker::Column("answer_traces", "query_images")),
    (
        "0050",
        Marker::NoConstraint("deletion_jobs", "deletion_jobs_capability_grant_fk"),
    ),
    ("0051", Marker::Index("failed_queries_trace_trigger_idx")),
    ("0052", Marker::Table("namespace_source_preview_jobs")),
    ("0053", Marker::Column("answer_traces", "source")),
    ("0054", Marker::Table("graph_entity_semantic_projections")),
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

/// How `migrate` may treat the platform's schema.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// Apply the platform's migrations after 0018 that the database lacks, as the platform's own
    /// runner would (each once, in order, recorded in its ledger), instead of refusing.
    pub upgrade_platform: bool,
}

/// The outcome of a `migrate` run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub found: Found,
    /// Versions applied by this run, in order.
    pub applied: Vec<i64>,
    pub total: usize,
    /// The platform's migrations this run applied to a database that had platform tables
    /// (`--upgrade-platform`), in order.
    pub upgraded_platform: Vec<&'static str>,
    /// The project's own indexes built by this run (see [`super::indexes`]).
    pub indexes: super::indexes::Built,
}

/// [`migrate_with`] without leave to upgrade the platform's schema: a database must be fresh or
/// record every platform migration the project knows.
pub async fn migrate(pool: &PgPool) -> Result<Report, MigrateError> {
    migrate_with(pool, Options::default()).await
}

/// Classifies the database, refuses one that cannot be adopted, then applies every pending
/// migration, each in its own transaction together with its ledger row (and, for a platform
/// migration, the platform's ledger row). Safe to run from many processes at once: they take
/// turns on an advisory lock.
pub async fn migrate_with(pool: &PgPool, options: Options) -> Result<Report, MigrateError> {
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
    let result = match migrate_locked(&mut conn, options).await {
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

/// Whether the database is at this build's level, as a worker needs it before it touches a job:
/// every project migration applied and the platform's ledger naming no migration this build does
/// not know. `Ok(Err(why))` says, in one line, what is not; reads only.
pub async fn current(conn: &mut PgConnection) -> Result<Result<(), String>, sqlx::Error> {
    let managed: bool =
        sqlx::query_scalar("SELECT to_regclass('kfs_worker_migrations') IS NOT NULL")
            .fetch_one(&mut *conn)
            .await?;
    if !managed {
        return Ok(Err(
            "the database has not been migrated by kfs-worker: run `kfs-worker migrate` first"
                .into(),
        ));
    }
    let done: Vec<i64> = sqlx::query_scalar(r#"SELECT "version" FROM "kfs_worker_migrations""#)
        .fetch_all(&mut *conn)
        .await?;
    if let Some(m) = MIGRATOR.iter().find(|m| !done.contains(&m.version)) {
        return Ok(Err(format!(
            "the database lacks this build's migration {} ({}): run `kfs-worker migrate` first",
            m.version, m.description
        )));
    }
    let recorded: Vec<String> = sqlx::query_scalar(
        "SELECT migration_id::text FROM schema_migrations WHERE dialect = 'postgres' ORDER BY 1",
    )
    .fetch_all(&mut *conn)
    .await?;
    let last = PLATFORM_MIGRATIONS[PLATFORM_MIGRATIONS.len() - 1];
    if let Some(unknown) = recorded
        .iter()
        .find(|r| !PLATFORM_MIGRATIONS.contains(&r.as_str()))
    {
        return Ok(Err(format!(
            "the database records the platform's migration {unknown}, which this kfs-worker does \
             not know (it runs on the platform's schema through {last})"
        )));
    }
    Ok(Ok(()))
}

/// The platform migration a project migration of `version` is, if it is one.
fn platform_id(version: i64) -> Option<&'static str> {
    let index = usize::try_from(version).ok()?.checked_sub(1)?;
    PLATFORM_MIGRATIONS.get(index).copied()
}

async fn migrate_locked(conn: &mut PgConnection, options: Options) -> Result<Report, MigrateError> {
    let (found, recorded, upgrade) = classify(conn, options).await?;
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
        // A platform migration the platform's ledger records is the platform's own work: the
        // schema already has it (checked above), and its statements and one-time backfills must
        // not run again. It is only noted as done.
        let present = platform_id(m.version).is_some_and(|id| recorded.iter().any(|r| r == id));
        apply(conn, m, !present).await?;
        applied.push(m.version);
    }
    Ok(Report {
        found,
        applied,
        total: MIGRATOR.iter().count(),
        upgraded_platform: upgrade,
        indexes: super::indexes::Built::default(),
    })
}

async fn apply(conn: &mut PgConnection, m: &Migration, run: bool) -> Result<(), MigrateError> {
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
    if !run {
        record(0).execute(&mut *conn).await.map_err(failed)?;
        return Ok(());
    }
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

/// Decides, from the platform migrations a database records, which ones `migrate` must apply
/// to it; `Err` is the one line that refuses it. `fresh`: a database with no platform table and
/// no ledger, which gets every one. Pure.
fn platform_plan(
    recorded: &[String],
    fresh: bool,
    options: Options,
) -> Result<Vec<&'static str>, String> {
    let last = PLATFORM_MIGRATIONS[PLATFORM_MIGRATIONS.len() - 1];
    if let Some(unknown) = recorded
        .iter()
        .find(|r| !PLATFORM_MIGRATIONS.contains(&r.as_str()))
    {
        let why = if unknown.as_str() > last {
            "a later platform migration than this kfs-worker knows"
        } else {
            "a platform migration this kfs-worker does not know"
        };
        return Err(format!(
            "schema_migrations records {unknown}, {why} (it runs on the platform's schema through \
             {last}): use a kfs-worker built for that schema"
        ));
    }
    if fresh {
        return Ok(Vec::new());
    }
    let missing: Vec<&'static str> = PLATFORM_MIGRATIONS
        .iter()
        .copied()
        .filter(|id| !recorded.iter().any(|r| r == id))
        .collect();
    if let Some(first) = missing
        .iter()
        .find(|id| PLATFORM_MIGRATIONS[..BASE_LEVEL].contains(id))
    {
        return Err(format!(
            "the platform's migration {first} has not been applied to this database (no \
             schema_migrations row); apply the platform's migrations through {} first",
            PLATFORM_MIGRATIONS[BASE_LEVEL - 1]
        ));
    }
    if missing.is_empty() || options.upgrade_platform {
        return Ok(missing);
    }
    let named = match missing.as_slice() {
        [one] => (*one).to_owned(),
        [first, .., end] => format!("{first} … {end} ({} in all)", missing.len()),
        [] => unreachable!("missing is not empty"),
    };
    Err(format!(
        "the platform's migrations {named} have not been applied to this database, and \
         kfs-worker runs on the platform's schema through {last}: apply them with the platform's \
         own migration runner, or let kfs-worker apply them with `kfs-worker migrate \
         --upgrade-platform`"
    ))
}

/// Reads what the database holds and decides whether it may be migrated: what it is, the
/// platform migrations its ledger records, and those this run applies to it. Writes nothing.
async fn classify(
    conn: &mut PgConnection,
    options: Options,
) -> Result<(Found, Vec<String>, Vec<&'static str>), MigrateError> {
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
    let fresh = !managed && present.is_empty() && !ledger;
    if fresh {
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
    }
    if !managed && !fresh {
        check_ledger(conn, ledger, &present).await?;
    }
    let upgrade = platform_plan(&recorded, fresh, options).map_err(MigrateError::Refused)?;
    if !managed && !fresh {
        check_platform(conn, &recorded).await?;
    }
    let found = if managed {
        Found::Managed
    } else if fresh {
        Found::Fresh
    } else {
        Found::Platform
    };
    Ok((found, recorded, upgrade))
}

/// A database with platform tables but no project ledger must have the platform's ledger.
async fn check_ledger(
    conn: &mut PgConnection,
    ledger: bool,
    present: &[String],
) -> Result<(), MigrateError> {
    if ledger {
        return Ok(());
    }
    let legacy: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await?;
    let hint = if legacy {
        " (it looks like a database built by an older kfs-worker, whose tables were not the \
         platform's: migrate a fresh database instead)"
    } else {
        ""
    };
    Err(MigrateError::Refused(format!(
        "the database has platform tables ({}) but no schema_migrations ledger, so it was not \
         built by the platform's migrations{hint}",
        present.join(", ")
    )))
}

/// A platform database must have what every platform migration its ledger records made, and
/// the vector extension.
async fn check_platform(conn: &mut PgConnection, recorded: &[String]) -> Result<(), MigrateError> {
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
        let Some(id) = recorded.iter().find(|r| r.starts_with(migration)) else {
            continue;
        };
        if !has(conn, *marker).await? {
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
        Marker::ConstraintMentions(t, c, text) => {
            format!("constraint {c} on {t} as it allows {text}")
        }
        Marker::ConstraintOmits(t, c, text) => {
            format!("constraint {c} on {t} without {text}")
        }
        Marker::NoConstraint(t, c) => format!("the removal of constraint {c} on {t}"),
        Marker::Index(i) => format!("index {i}"),
        Marker::VectorWithoutDimension(t, c) => {
            format!("column {t}.{c} as a vector without a fixed dimension")
        }
    }
}

async fn has(conn: &mut PgConnection, m: Marker) -> Result<bool, sqlx::Error> {
    match m {
        Marker::Table(t) | Marker::Index(t) => {
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
        Marker::ConstraintMentions(t, c, text) | Marker::ConstraintOmits(t, c, text) => {
            let mentions: Option<bool> = sqlx::query_scalar(
                "SELECT strpos(pg_get_constraintdef(oid), $3) > 0 FROM pg_constraint \
                 WHERE conrelid = to_regclass(quote_ident($1)) AND conname = $2",
            )
            .bind(t)
            .bind(c)
            .bind(text)
            .fetch_optional(conn)
            .await?;
            Ok(mentions == Some(matches!(m, Marker::ConstraintMentions(..))))
        }
        Marker::NoConstraint(t, c) => {
            sqlx::query_scalar(
                "SELECT NOT EXISTS (SELECT 1 FROM pg_constraint \
                 WHERE conrelid = to_regclass(quote_ident($1)) AND conname = $2)",
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

    fn ids(n: usize) -> Vec<String> {
        PLATFORM_MIGRATIONS[..n]
            .iter()
            .map(|s| (*s).to_owned())
            .collect()
    }

    #[test]
    fn the_platform_plan_applies_only_what_a_database_lacks_and_refuses_the_rest() {
        let upgrade = Options {
            upgrade_platform: true,
        };
        let keep = Options::default();
        let mut later = ids(54);
        later.push("0055_something_new".into());
        let mut gap = ids(54);
        gap.retain(|id| !id.starts_with("0030"));
        let mut below = ids(54);
        below.retain(|id| !id.starts_with("0016"));
        let mut stray = ids(54);
        stray.push("0030_other_branch".into());
        // (recorded, fresh, options) -> Ok(applied count, first applied) or Err(needle)
        type Case = (
            Vec<String>,
            bool,
            Options,
            Result<(usize, &'static str), &'static str>,
        );
        let table: Vec<Case> = vec![
            (vec![], true, keep, Ok((0, ""))),
            (ids(54), false, keep, Ok((0, ""))),
            (ids(54), false, upgrade, Ok((0, ""))),
            (ids(18), false, upgrade, Ok((36, "0019_profile_publication_bindings"))),
            (ids(53), false, upgrade, Ok((1, "0054_graph_semantic_projections"))),
            (gap.clone(), false, upgrade, Ok((1, "0030_bulk_operations"))),
            (ids(18), false, keep, Err("0019_profile_publication_bindings … 0054_graph_semantic_projections (36 in all) have not been applied")),
            (ids(53), false, keep, Err("migrations 0054_graph_semantic_projections have not been applied")),
            (gap, false, keep, Err("--upgrade-platform")),
            (ids(17), false, upgrade, Err("0018_versioned_space_profiles has not been applied")),
            (below, false, upgrade, Err("0016_compilation_job_requester_binding has not been applied")),
            (later.clone(), false, upgrade, Err("records 0055_something_new, a later platform migration")),
            (later, true, keep, Err("0055_something_new")),
            (stray, false, keep, Err("records 0030_other_branch, a platform migration this kfs-worker does not know")),
        ];
        for (recorded, fresh, options, want) in table {
            let got = platform_plan(&recorded, fresh, options);
            match (got, want) {
                (Ok(plan), Ok((n, first))) => {
                    assert_eq!(plan.len(), n, "{recorded:?}");
                    assert_eq!(plan.first().copied().unwrap_or(""), first);
                }
                (Err(e), Err(needle)) => assert!(e.contains(needle), "{e}"),
                (got, want) => panic!("{} recorded: {got:?}, wanted {want:?}", recorded.len()),
            }
        }
    }

    #[test]
    fn every_project_migration_up_to_0054_is_the_platform_migration_of_its_number() {
        for m in MIGRATOR.iter().filter(|m| m.version <= 54) {
            let id = platform_id(m.version).expect("a platform migration");
            assert!(
                id.starts_with(&format!("{:04}", m.version)),
                "{} is not {id}",
                m.version
            );
            if m.version > 18 {
                assert_eq!(id[5..], *m.description.replace(' ', "_"), "{id}");
            }
        }
    }

    #[test]
    fn platform_migrations_are_in_order() {
        let mut sorted = PLATFORM_MIGRATIONS;
        sorted.sort_unstable();
        assert_eq!(sorted, PLATFORM_MIGRATIONS);
    }
}
