-- The outbox wake-up triggers fire only for rows that become pending. The function already
-- ignored every other row, but calling it cost a PL/pgSQL call per row on every claim, mark
-- and lease of the relay and the consumers; a WHEN condition skips the call altogether.
DO $kfs_0101_outbox_triggers$
DECLARE
  t TEXT;
BEGIN
  FOREACH t IN ARRAY ARRAY['document_compilation_outbox', 'deletion_outbox', 'research_task_outbox'] LOOP
    IF NOT EXISTS (
      SELECT 1 FROM "pg_trigger"
      WHERE "tgrelid" = t::regclass AND "tgname" = t || '_kfs_notify'
        AND pg_get_triggerdef("oid") LIKE '%WHEN%'
    ) THEN
      EXECUTE format('DROP TRIGGER IF EXISTS %I ON %I', t || '_kfs_notify', t);
      EXECUTE format(
        'CREATE TRIGGER %I AFTER INSERT OR UPDATE OF "status", "available_at" ON %I '
        'FOR EACH ROW WHEN (NEW."status" = ''pending'') EXECUTE FUNCTION "kfs_notify_outbox"()',
        t || '_kfs_notify', t
      );
    END IF;
  END LOOP;
END
$kfs_0101_outbox_triggers$;
