-- kfs-worker migration 0053: the platform's 0053_answer_trace_source.
-- Answer traces record which caller produced them (console retrieval test, workflow node, service
-- API, agent, MCP). Nullable, and NULL means a retrieval test, which is what existing traces were.

ALTER TABLE "answer_traces" ADD COLUMN IF NOT EXISTS "source" TEXT;

CREATE INDEX IF NOT EXISTS "answer_traces_space_source_created_idx"
  ON "answer_traces" ("knowledge_space_id", "source", "created_at", "id");

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0053_answer_trace_source', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
