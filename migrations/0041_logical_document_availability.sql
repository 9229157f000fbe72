-- kfs-worker migration 0041: the platform's 0041_logical_document_availability.
-- A logical document can be disabled without touching its source or index state. Existing
-- documents get enabled = TRUE (the column default) and no disable record, which the check admits.
-- disabled_at is a TIMESTAMP without time zone, as the platform declares it.

ALTER TABLE "logical_documents"
  ADD COLUMN IF NOT EXISTS "enabled" BOOLEAN NOT NULL DEFAULT TRUE,
  ADD COLUMN IF NOT EXISTS "disabled_at" TIMESTAMP,
  ADD COLUMN IF NOT EXISTS "disabled_by_subject_id" VARCHAR(255);

ALTER TABLE "logical_documents" DROP CONSTRAINT IF EXISTS "logical_documents_availability_ck";
ALTER TABLE "logical_documents" ADD CONSTRAINT "logical_documents_availability_ck" CHECK (
  ("enabled" AND "disabled_at" IS NULL AND "disabled_by_subject_id" IS NULL)
  OR (NOT "enabled" AND "disabled_at" IS NOT NULL AND "disabled_by_subject_id" IS NOT NULL)
);

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0041_logical_document_availability', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
