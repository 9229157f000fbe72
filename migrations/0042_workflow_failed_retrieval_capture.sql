-- kfs-worker migration 0042: the platform's 0042_workflow_failed_retrieval_capture.
-- A failed query captured from a workflow may be bound to a capability grant (with its frozen
-- scope and revision, but no requester or snapshot). The binding check of 0024 is re-created with
-- that third branch; existing rows (all-NULL or snapshot-bound) still pass.

ALTER TABLE "failed_queries" ADD COLUMN IF NOT EXISTS "capability_grant_id" UUID;

ALTER TABLE "failed_queries"
  DROP CONSTRAINT IF EXISTS "failed_queries_permission_binding_ck",
  DROP CONSTRAINT IF EXISTS "failed_queries_capability_grant_fk";
ALTER TABLE "failed_queries"
  ADD CONSTRAINT "failed_queries_permission_binding_ck" CHECK (
    (
      "tenant_id" IS NULL AND "capability_grant_id" IS NULL
      AND "requested_by_subject_id" IS NULL AND "access_channel" IS NULL
      AND "permission_snapshot_id" IS NULL AND "permission_snapshot_revision" IS NULL
      AND "required_permission_scope" IS NULL AND "revision" IS NULL
    )
    OR (
      "tenant_id" IS NOT NULL AND "capability_grant_id" IS NOT NULL
      AND "requested_by_subject_id" IS NULL AND "access_channel" IS NULL
      AND "permission_snapshot_id" IS NULL AND "permission_snapshot_revision" IS NULL
      AND "required_permission_scope" IS NOT NULL
      AND jsonb_typeof("required_permission_scope") = 'array'
      AND "revision" IS NOT NULL AND "revision" >= 1
    )
    OR (
      "tenant_id" IS NOT NULL AND "capability_grant_id" IS NULL
      AND "requested_by_subject_id" IS NOT NULL
      AND "access_channel" IS NOT NULL
      AND "access_channel" IN ('interactive', 'service_api', 'mcp', 'agent')
      AND "permission_snapshot_id" IS NOT NULL
      AND "permission_snapshot_revision" IS NOT NULL
      AND "permission_snapshot_revision" >= 1
      AND "required_permission_scope" IS NOT NULL
      AND jsonb_typeof("required_permission_scope") = 'array'
      AND "revision" IS NOT NULL AND "revision" >= 1
    )
  ),
  ADD CONSTRAINT "failed_queries_capability_grant_fk"
    FOREIGN KEY ("tenant_id", "knowledge_space_id", "capability_grant_id")
    REFERENCES "capability_grants" ("tenant_id", "knowledge_space_id", "grant_id")
    ON DELETE RESTRICT;

CREATE INDEX IF NOT EXISTS "failed_queries_capability_grant_idx"
  ON "failed_queries" ("tenant_id", "knowledge_space_id", "capability_grant_id");

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0042_workflow_failed_retrieval_capture', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
