-- kfs-worker migration 0099: the platform's own migration ledger.
--
-- The platform's migration runner records each migration it applied in schema_migrations
-- (migration_id = the file name up to its first dot, dialect 'postgres') and applies only those it
-- finds missing. A database built by these migrations holds the platform's schema through its
-- migration 0018, so it records those eighteen here: the platform's runner can then take the
-- database over and apply its later migrations. On a database the platform built, the table and
-- every row already exist (`kfs-worker migrate` refuses one that lacks any of them), and nothing
-- changes.
CREATE TABLE IF NOT EXISTS "schema_migrations" (
  "migration_id" VARCHAR(255) PRIMARY KEY,
  "dialect" VARCHAR(32) NOT NULL,
  "applied_at" TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP
);

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES
  ('0001_initial_schema', 'postgres'),
  ('0002_vector_index_upgrade', 'postgres'),
  ('0003_projection_set_publications', 'postgres'),
  ('0004_projection_publication_members', 'postgres'),
  ('0005_publication_generation_nonzero', 'postgres'),
  ('0006_document_compilation_attempts', 'postgres'),
  ('0007_knowledge_node_generations', 'postgres'),
  ('0008_flattened_page_index', 'postgres'),
  ('0009_legacy_space_bootstrap', 'postgres'),
  ('0010_page_index_upgrade_backfill', 'postgres'),
  ('0011_tidb_fts_postings', 'postgres'),
  ('0012_tidb_baseline_repair', 'postgres'),
  ('0013_space_access_control', 'postgres'),
  ('0014_source_credential_refs', 'postgres'),
  ('0015_research_task_jobs', 'postgres'),
  ('0016_compilation_job_requester_binding', 'postgres'),
  ('0017_durable_deletion', 'postgres'),
  ('0018_versioned_space_profiles', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
