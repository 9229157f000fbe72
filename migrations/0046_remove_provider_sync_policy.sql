-- kfs-worker migration 0046: the platform's 0046_remove_provider_sync_policy.
-- The 'provider' sync mode is gone: a policy is 'manual', 'interval' or 'custom'. The platform
-- converts old provider policies to manual before it runs this migration and does not convert any
-- here; neither does this file. A remaining 'provider' row stops it with a plain message (the
-- platform's file would stop on the new check).

DO $kfs_0046_provider_policies_precheck$
DECLARE
  "provider_policies" BIGINT;
BEGIN
  SELECT count(*) INTO "provider_policies"
  FROM "source_sync_policies"
  WHERE "mode" = 'provider';
  IF "provider_policies" > 0 THEN
    RAISE EXCEPTION
      '0046_remove_provider_sync_policy: % source_sync_policies rows still use mode ''provider''; convert them to ''manual'' first', "provider_policies";
  END IF;
END
$kfs_0046_provider_policies_precheck$;

ALTER TABLE "source_sync_policies" DROP CONSTRAINT IF EXISTS "source_sync_policies_mode_ck";
ALTER TABLE "source_sync_policies" ADD CONSTRAINT "source_sync_policies_mode_ck" CHECK (
  "mode" IN ('manual', 'interval', 'custom')
);

INSERT INTO "schema_migrations" ("migration_id", "dialect")
VALUES ('0046_remove_provider_sync_policy', 'postgres')
ON CONFLICT ("migration_id") DO NOTHING;
