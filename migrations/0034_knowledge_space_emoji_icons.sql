-- kfs-worker migration 0034: the platform's 0034_knowledge_space_emoji_icons.
-- The space icon check of 0023 is widened: an icon may be a bounded emoji identity, with or
-- without the 'builtin:' prefix. Every value 0023 allowed still passes.

ALTER TABLE "knowledge_spaces" DROP CONSTRAINT IF EXISTS "knowledge_spaces_icon_ref_ck";
ALTER TABLE "knowledge_spaces" ADD CONSTRAINT "knowledge_spaces_icon_ref_ck" CHECK (
  "icon_ref" IS NULL OR "icon_ref" ~ '^(builtin:)?[+a-z0-9_-]{1,64}$'
);

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0034_knowledge_space_emoji_icons', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
