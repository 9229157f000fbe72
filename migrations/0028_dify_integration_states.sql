-- kfs-worker migration 0028: the platform's 0028_dify_integration_states.
-- One row per tenant records that its host-product integration was activated (a one-way switch,
-- so one workspace never mixes authorization sources). Not touched by the worker.

CREATE TABLE IF NOT EXISTS "dify_integration_states" (
  "tenant_id" VARCHAR(255) NOT NULL,
  "activation_id" VARCHAR(255) NOT NULL,
  "activation_revision" BIGINT NOT NULL,
  "source_revision_digest" VARCHAR(71) NOT NULL,
  "activated_at" TIMESTAMPTZ NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "dify_integration_states_pkey" PRIMARY KEY ("tenant_id"),
  CONSTRAINT "dify_integration_states_evidence_ck" CHECK (
    "activation_revision" >= 1 AND "source_revision_digest" ~ '^sha256:[a-f0-9]{64}$'
  )
);

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0028_dify_integration_states', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
