-- kfs-worker migration 0033: the platform's 0033_research_task_final_answers.
-- A research task's partial result row can carry the final synthesized answer next to its
-- retrieval evidence (nullable; existing rows keep NULL). The research job's result row.

ALTER TABLE "research_task_partial_results" ADD COLUMN IF NOT EXISTS "answer" TEXT;

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0033_research_task_final_answers', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
