-- kfs-worker migration 0031: the platform's 0031_source_connection_capability_provenance.
-- Source connections record the capability grant that created them (a locator only: no bearer
-- token, raw jti or host-product credential). Existing connections keep NULL.

ALTER TABLE "source_connections" ADD COLUMN IF NOT EXISTS "capability_grant_id" UUID;
ALTER TABLE "source_connections" DROP CONSTRAINT IF EXISTS "source_connections_capability_grant_fk";
ALTER TABLE "source_connections"
  ADD CONSTRAINT "source_connections_capability_grant_fk"
  FOREIGN KEY ("tenant_id", "knowledge_space_id", "capability_grant_id")
  REFERENCES "capability_grants" ("tenant_id", "knowledge_space_id", "grant_id")
  ON DELETE RESTRICT;

CREATE INDEX IF NOT EXISTS "source_connections_capability_grant_idx"
  ON "source_connections" ("tenant_id", "knowledge_space_id", "capability_grant_id");

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0031_source_connection_capability_provenance', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
