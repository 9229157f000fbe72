-- kfs-worker migration 0045: the platform's 0045_quality_replay_match_policy.
-- Each replay item freezes its golden question's evidence match policy, 'all' or 'any'. Items
-- that exist already were judged under the old rule (every expected evidence id must match), so
-- they are backfilled with 'all' before the column becomes NOT NULL.

ALTER TABLE "quality_replay_items" ADD COLUMN IF NOT EXISTS "match_policy" VARCHAR(8);

UPDATE "quality_replay_items" SET "match_policy" = 'all' WHERE "match_policy" IS NULL;

ALTER TABLE "quality_replay_items" ALTER COLUMN "match_policy" SET NOT NULL;

ALTER TABLE "quality_replay_items" DROP CONSTRAINT IF EXISTS "quality_replay_items_match_policy_ck";
ALTER TABLE "quality_replay_items" ADD CONSTRAINT "quality_replay_items_match_policy_ck" CHECK (
  "match_policy" IN ('all', 'any')
);

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0045_quality_replay_match_policy', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
