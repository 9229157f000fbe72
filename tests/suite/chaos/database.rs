//! The run's database: created on the private Postgres with the observers of what the engine
//! commits, and the queries the driver makes (all through the direct pool, never the proxy).

use super::*;

/// Observers installed in the run's database. They record, they never change what the engine
/// does: every new lease (claim) with the database clock, every end of a lease (its token
/// cleared) with the session that wrote it, every checkpoint change, and every outbox write but
/// a heartbeat's (a change of status, delivery id or `updated_at`) with its session. Trigger rows
/// commit with the transaction that caused them, so a row exists exactly when that transaction
/// committed, and rows with the same `tx` were written by one transaction: a claim's lease and
/// the delivery it claimed for, a lease's end and the outbox status it wrote.
const OBSERVERS: &str = r#"
CREATE FUNCTION chaos_us(xid) RETURNS bigint LANGUAGE sql STABLE AS
  $f$ SELECT (extract(epoch FROM pg_xact_commit_timestamp($1)) * 1000000)::bigint $f$;
CREATE TABLE chaos_claims (
  id BIGSERIAL PRIMARY KEY, job_id UUID NOT NULL, worker_id TEXT NOT NULL, lease_token UUID NOT NULL,
  at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(), tx BIGINT NOT NULL DEFAULT txid_current());
CREATE INDEX chaos_claims_job ON chaos_claims (job_id, id);
CREATE INDEX chaos_claims_lease ON chaos_claims (job_id, lease_token);
CREATE INDEX chaos_claims_tx ON chaos_claims (tx, job_id);
CREATE FUNCTION chaos_claim() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
  INSERT INTO chaos_claims (job_id, worker_id, lease_token) VALUES (NEW.id, NEW.worker_id, NEW.lease_token);
  RETURN NULL;
END $f$;
CREATE TRIGGER chaos_claim AFTER UPDATE OF lease_token ON kfs_probe_jobs FOR EACH ROW
  WHEN (NEW.lease_token IS NOT NULL AND NEW.lease_token IS DISTINCT FROM OLD.lease_token)
  EXECUTE FUNCTION chaos_claim();
CREATE TABLE chaos_ends (
  id BIGSERIAL PRIMARY KEY, job_id UUID NOT NULL, lease_token UUID NOT NULL, writer TEXT NOT NULL,
  tx BIGINT NOT NULL DEFAULT txid_current());
CREATE INDEX chaos_ends_lease ON chaos_ends (job_id, lease_token);
CREATE FUNCTION chaos_end() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
  INSERT INTO chaos_ends (job_id, lease_token, writer)
  VALUES (NEW.id, OLD.lease_token, current_setting('application_name'));
  RETURN NULL;
END $f$;
CREATE TRIGGER chaos_end AFTER UPDATE OF lease_token ON kfs_probe_jobs FOR EACH ROW
  WHEN (OLD.lease_token IS NOT NULL AND NEW.lease_token IS NULL) EXECUTE FUNCTION chaos_end();
CREATE TABLE chaos_checkpoints (
  id BIGSERIAL PRIMARY KEY, job_id UUID NOT NULL, old_cp TEXT NOT NULL, new_cp TEXT NOT NULL,
  at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION chaos_checkpoint() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
  INSERT INTO chaos_checkpoints (job_id, old_cp, new_cp) VALUES (NEW.id, OLD.checkpoint, NEW.checkpoint);
  RETURN NULL;
END $f$;
CREATE TRIGGER chaos_checkpoint AFTER UPDATE OF checkpoint ON kfs_probe_jobs FOR EACH ROW
  WHEN (NEW.checkpoint IS DISTINCT FROM OLD.checkpoint) EXECUTE FUNCTION chaos_checkpoint();
CREATE TABLE chaos_outbox (
  id BIGSERIAL PRIMARY KEY, job_id UUID NOT NULL, old_status TEXT NOT NULL, status TEXT NOT NULL,
  queue_job_id TEXT, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
  writer TEXT NOT NULL DEFAULT current_setting('application_name'),
  tx BIGINT NOT NULL DEFAULT txid_current());
CREATE INDEX chaos_outbox_delivery ON chaos_outbox (queue_job_id);
CREATE INDEX chaos_outbox_job ON chaos_outbox (job_id, id);
CREATE INDEX chaos_outbox_tx ON chaos_outbox (tx, job_id);
CREATE FUNCTION chaos_outbox() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
  INSERT INTO chaos_outbox (job_id, old_status, status, queue_job_id)
  VALUES (NEW.probe_job_id, OLD.status, NEW.status, NEW.queue_job_id);
  RETURN NULL;
END $f$;
CREATE TRIGGER chaos_outbox AFTER UPDATE ON kfs_probe_outbox FOR EACH ROW
  WHEN (NEW.status IS DISTINCT FROM OLD.status OR NEW.queue_job_id IS DISTINCT FROM OLD.queue_job_id
        OR NEW.updated_at IS DISTINCT FROM OLD.updated_at)
  EXECUTE FUNCTION chaos_outbox();
"#;

pub(super) async fn db_now(pool: &PgPool) -> Option<DateTime<Utc>> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await
        .ok()
}

pub(super) async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Jobs a process of worker id `worker` (any incarnation) holds a live lease on at `at`.
pub(super) async fn held_by(pool: &PgPool, worker: &str) -> Option<(DateTime<Utc>, Vec<Uuid>)> {
    let at = db_now(pool).await?;
    let jobs = sqlx::query_scalar(
        "SELECT id FROM kfs_probe_jobs WHERE run_state = 'running' AND left(worker_id, length($1) + 1) = $1 || '#' AND lease_expires_at > $2",
    )
    .bind(worker)
    .bind(at)
    .fetch_all(pool)
    .await
    .ok()?;
    Some((at, jobs))
}

pub(super) async fn terminate_worker_sessions(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = $1 AND pid <> pg_backend_pid() AND application_name LIKE 'kfs-worker%'",
    )
    .bind(DB)
    .fetch_one(pool)
    .await
    .unwrap_or(0)
}

/// A run's database and object store.
pub(super) struct RunDatabase {
    pub(super) pool: PgPool,
    pub(super) store_dir: std::path::PathBuf,
    pub(super) store_url: String,
    pub(super) space: kfs_worker::tools::platform::NotesSpace,
}

/// Creates database [`DB`] on `pg`, migrated, with the probe kind and the observers of both
/// the probe's and the platform's tables, and the platform's space seeded in an object store
/// of its own.
pub(super) async fn run_database(pg: &PrivatePostgres, seed: u64) -> RunDatabase {
    {
        let mut admin = sqlx::PgConnection::connect_with(&pg.url("postgres").parse().unwrap())
            .await
            .expect("connect to the private Postgres");
        sqlx::Executor::execute(&mut admin, format!("CREATE DATABASE {DB}").as_str())
            .await
            .unwrap();
    }
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&pg.url(DB))
        .await
        .unwrap();
    kfs_worker::db::migrate(&pool).await.expect("migrate");
    probe::install(&pool).await.expect("install probe kind");
    sqlx::raw_sql(OBSERVERS)
        .execute(&pool)
        .await
        .expect("observers");
    sqlx::raw_sql(platform::OBSERVERS)
        .execute(&pool)
        .await
        .expect("observers of the platform's tables");
    let store_dir =
        std::env::temp_dir().join(format!("kfschaos-store-{seed}-{}", Uuid::new_v4().simple()));
    let store_url = format!("file://{}", store_dir.display());
    let store = kfs_worker::store::Store::open(
        &kfs_worker::config::object_store(&store_url).expect("object store URL"),
    )
    .expect("object store");
    let space = platform::seed(&pool, &store).await;
    RunDatabase {
        pool,
        store_dir,
        store_url,
        space,
    }
}
