-- kfs-worker migration 0048: the platform's 0048_deletion_active_scope_indexes.
-- Deletion admission looks up only live fences: partial indexes over the active deletion jobs
-- (active_slot = 1) and the active tombstones, so that lookup does not grow with the audit
-- history the worker's finished deletion jobs leave behind.

CREATE INDEX IF NOT EXISTS "deletion_jobs_active_scope_idx"
  ON "deletion_jobs" ("tenant_id", "knowledge_space_id", "target_type", "target_id")
  WHERE "active_slot" = 1;

CREATE INDEX IF NOT EXISTS "deletion_tombstones_active_scope_idx"
  ON "deletion_tombstones" ("tenant_id", "knowledge_space_id")
  WHERE "state" = 'active';

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0048_deletion_active_scope_indexes', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
