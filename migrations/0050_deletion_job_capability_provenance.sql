-- kfs-worker migration 0050: the platform's 0050_deletion_job_capability_provenance.
-- A space deletion job outlives the space-owned grant that authorized it, so the grant foreign
-- keys 0026 put on deletion_jobs and deletion_retry_audits are dropped: capability_grant_id stays
-- as immutable audit provenance (still indexed), and the terminal space delete is not blocked.

ALTER TABLE "deletion_jobs" DROP CONSTRAINT IF EXISTS "deletion_jobs_capability_grant_fk";

ALTER TABLE "deletion_retry_audits"
  DROP CONSTRAINT IF EXISTS "deletion_retry_audits_capability_grant_fk";

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0050_deletion_job_capability_provenance', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
