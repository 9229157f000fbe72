-- kfs-worker migration 0051: the platform's 0051_failed_query_trace_outcome_index.
-- The overview joins failed queries to their trace and trigger directly; a partial index over the
-- rows that have a trace.

CREATE INDEX IF NOT EXISTS "failed_queries_trace_trigger_idx"
  ON "failed_queries" ("tenant_id", "knowledge_space_id", "answer_trace_id", "trigger")
  WHERE "answer_trace_id" IS NOT NULL;

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0051_failed_query_trace_outcome_index', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
