-- kfs-worker migration 0029: the platform's 0029_dify_integration_freezes.
-- A durable per-tenant maintenance freeze that stops legacy writes before the final delta of a
-- host-product integration. Not touched by the worker.

CREATE TABLE IF NOT EXISTS "dify_integration_freezes" (
  "tenant_id" VARCHAR(255) NOT NULL,
  "freeze_id" VARCHAR(255) NOT NULL,
  "freeze_revision" BIGINT NOT NULL,
  "source_revision_digest" VARCHAR(71) NOT NULL,
  "source_task_watermark" BIGINT NOT NULL,
  "frozen_at" TIMESTAMPTZ NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "dify_integration_freezes_pkey" PRIMARY KEY ("tenant_id"),
  CONSTRAINT "dify_integration_freezes_evidence_ck" CHECK (
    "freeze_revision" >= 1 AND "source_task_watermark" >= 0
    AND "source_revision_digest" ~ '^sha256:[a-f0-9]{64}$'
  )
);

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0029_dify_integration_freezes', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
