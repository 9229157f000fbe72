-- kfs-worker migration 0052: the platform's 0052_namespace_source_previews.
-- Source previews made before a space exists (scoped to a tenant and account): a preview job with
-- an unconstrained status string and no foreign keys at all, and its pages (which go with the job).

CREATE TABLE IF NOT EXISTS "namespace_source_preview_jobs" (
  "id" UUID NOT NULL,
  "tenant_id" VARCHAR(255) NOT NULL,
  "account_id" VARCHAR(255) NOT NULL,
  "status" VARCHAR(32) NOT NULL,
  "provider_config" JSONB NOT NULL,
  "configuration_fingerprint" VARCHAR(128) NOT NULL,
  "expires_at" TIMESTAMPTZ NOT NULL,
  "consumed_at" TIMESTAMPTZ,
  "content_cleaned_at" TIMESTAMPTZ,
  "import_workflow_id" UUID,
  "error_code" VARCHAR(128),
  "created_at" TIMESTAMPTZ NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "namespace_source_preview_jobs_pkey" PRIMARY KEY ("id")
);

CREATE INDEX IF NOT EXISTS "namespace_source_preview_jobs_claim_idx"
  ON "namespace_source_preview_jobs" ("status", "expires_at", "created_at");
CREATE INDEX IF NOT EXISTS "namespace_source_preview_jobs_owner_idx"
  ON "namespace_source_preview_jobs" ("tenant_id", "account_id", "created_at");
CREATE INDEX IF NOT EXISTS "namespace_source_preview_jobs_cleanup_idx"
  ON "namespace_source_preview_jobs" ("status", "content_cleaned_at", "updated_at");

CREATE TABLE IF NOT EXISTS "namespace_source_preview_pages" (
  "job_id" UUID NOT NULL,
  "page_id" VARCHAR(128) NOT NULL,
  "source_url" VARCHAR(4096) NOT NULL,
  "title" VARCHAR(500),
  "description" TEXT,
  "content_hash" VARCHAR(64) NOT NULL,
  "content_object_key" VARCHAR(2048) NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "namespace_source_preview_pages_pkey" PRIMARY KEY ("job_id", "page_id"),
  CONSTRAINT "namespace_source_preview_pages_job_id_fkey"
    FOREIGN KEY ("job_id") REFERENCES "namespace_source_preview_jobs" ("id") ON DELETE CASCADE
);

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0052_namespace_source_previews', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
