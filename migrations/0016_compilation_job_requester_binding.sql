-- kfs-worker migration 0016: the platform's 0016_compilation_job_requester_binding.
--
-- An attempt records who asked for it: the requesting subject, the permission snapshot (and its
-- revision) that authorised the request, and the channel it came through. All four are set, or
-- none (attempts started by the platform itself, such as legacy bootstraps). The foreign key
-- keeps a snapshot that an attempt names from being deleted (ON DELETE RESTRICT).
--
-- Guarded: the columns are ADD COLUMN IF NOT EXISTS and each constraint is added only when no
-- constraint of that name exists, so adopting a platform database changes nothing.
ALTER TABLE "document_compilation_attempts"
  ADD COLUMN IF NOT EXISTS "requested_by_subject_id" VARCHAR(255),
  ADD COLUMN IF NOT EXISTS "permission_snapshot_id" UUID,
  ADD COLUMN IF NOT EXISTS "permission_snapshot_revision" INTEGER,
  ADD COLUMN IF NOT EXISTS "access_channel" VARCHAR(16);

DO $kfs_0016_requester_binding$
BEGIN
  IF NOT EXISTS (
    SELECT 1
    FROM "pg_constraint"
    WHERE "conrelid" = 'document_compilation_attempts'::regclass
      AND "conname" = 'document_compilation_attempts_permission_binding_ck'
  ) THEN
    ALTER TABLE "document_compilation_attempts"
      ADD CONSTRAINT "document_compilation_attempts_permission_binding_ck"
      CHECK (
        (
          "requested_by_subject_id" IS NULL
          AND "permission_snapshot_id" IS NULL
          AND "permission_snapshot_revision" IS NULL
          AND "access_channel" IS NULL
        )
        OR (
          "requested_by_subject_id" IS NOT NULL
          AND "permission_snapshot_id" IS NOT NULL
          AND "permission_snapshot_revision" >= 1
          AND "access_channel" IN ('interactive', 'service_api', 'mcp', 'agent')
        )
      );
  END IF;

  IF NOT EXISTS (
    SELECT 1
    FROM "pg_constraint"
    WHERE "conrelid" = 'document_compilation_attempts'::regclass
      AND "conname" = 'document_compilation_attempts_permission_snapshot_fk'
  ) THEN
    ALTER TABLE "document_compilation_attempts"
      ADD CONSTRAINT "document_compilation_attempts_permission_snapshot_fk"
      FOREIGN KEY (
        "tenant_id",
        "knowledge_space_id",
        "permission_snapshot_id",
        "requested_by_subject_id",
        "access_channel"
      )
      REFERENCES "knowledge_space_permission_snapshots" (
        "tenant_id",
        "knowledge_space_id",
        "id",
        "subject_id",
        "access_channel"
      )
      ON DELETE RESTRICT;
  END IF;
END
$kfs_0016_requester_binding$;
