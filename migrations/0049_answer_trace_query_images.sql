-- kfs-worker migration 0049: the platform's 0049_answer_trace_query_images.
-- Answer traces keep the query-image references they ran with (nullable; existing traces NULL).

ALTER TABLE "answer_traces" ADD COLUMN IF NOT EXISTS "query_images" JSONB;

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0049_answer_trace_query_images', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
