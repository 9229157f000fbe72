-- kfs-worker migration 0035: the platform's 0035_research_task_answer_streaming.
-- Research progress streams may carry batched answer deltas: 'research_task.answer_delta' joins
-- the allowed progress event types. The other six types are unchanged.

ALTER TABLE "research_task_progress_events"
  DROP CONSTRAINT IF EXISTS "research_task_progress_event_ck";
ALTER TABLE "research_task_progress_events"
  ADD CONSTRAINT "research_task_progress_event_ck" CHECK (
    "event_type" IN (
      'research_task.answer_delta', 'research_task.canceled', 'research_task.failed',
      'research_task.paused', 'research_task.resumed', 'research_task.stage_changed',
      'research_task.started'
    )
  );

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0035_research_task_answer_streaming', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
