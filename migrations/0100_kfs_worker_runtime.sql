-- kfs-worker's own runtime objects. Nothing here changes a platform table's columns or
-- constraints: it adds wake-up triggers on the outbox tables and a liveness probe function.

-- Relay wake-ups: an outbox row that becomes pending (insert, re-arm, release) notifies the
-- channel `kfs_outbox` with the event type, after its transaction commits. Polling remains the
-- fallback, so a missed notification only costs latency.
CREATE OR REPLACE FUNCTION "kfs_notify_outbox"() RETURNS trigger
LANGUAGE plpgsql AS $kfs_notify_outbox$
BEGIN
  IF NEW."status" = 'pending' THEN
    PERFORM pg_notify('kfs_outbox', NEW."event_type");
  END IF;
  RETURN NULL;
END
$kfs_notify_outbox$;

DO $kfs_0100_outbox_triggers$
DECLARE
  t TEXT;
BEGIN
  FOREACH t IN ARRAY ARRAY['document_compilation_outbox', 'deletion_outbox', 'research_task_outbox'] LOOP
    IF NOT EXISTS (
      SELECT 1 FROM "pg_trigger"
      WHERE "tgrelid" = t::regclass AND "tgname" = t || '_kfs_notify'
    ) THEN
      EXECUTE format(
        'CREATE TRIGGER %I AFTER INSERT OR UPDATE OF "status", "available_at" ON %I '
        'FOR EACH ROW EXECUTE FUNCTION "kfs_notify_outbox"()',
        t || '_kfs_notify', t
      );
    END IF;
  END LOOP;
END
$kfs_0100_outbox_triggers$;

-- Worker liveness: every worker process holds the session-level advisory lock
-- (7038579, hashtext(worker_id)) for as long as it lives. When its session ends (process
-- killed, connection cut), the lock is gone at once, so a job it leased can be taken over
-- without waiting for the lease to expire. Fencing by lease token and row_version keeps that
-- safe even when the worker is still running: its next write is refused.
CREATE OR REPLACE FUNCTION "kfs_worker_alive"("worker" TEXT) RETURNS BOOLEAN
LANGUAGE sql STABLE AS $kfs_worker_alive$
  SELECT "worker" IS NULL OR EXISTS (
    SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory'
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND classid = 7038579::oid
      AND objid = hashtext("worker")::oid
      AND objsubid = 2
      AND granted
  )
$kfs_worker_alive$;
