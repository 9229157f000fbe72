-- Relay wake-ups without serialized commits. A transaction that has called `pg_notify` takes
-- one database-wide lock at commit and keeps it through its commit record's flush, so every
-- notifying commit waits for the one before it. The trigger made each of the platform's job
-- requests a notifying commit; under load that cost each request tens of milliseconds.
--
-- A relay that is awake for a kind holds the session advisory lock
-- (7038583, hashtext(outbox table)) exclusively, as that kind's watcher, and looks for due rows
-- itself until it lets go. A writer of a pending row notifies only when no watcher holds it.
-- A writer that finds a watcher takes (7038582, hashtext(outbox table)) shared until its
-- transaction ends, then tests for the watcher again; it skips its notification only when the
-- watcher is still there. A watcher lets go (`kfs_outbox_unwatch`) only when it can take
-- 7038582 exclusively without waiting; it releases the watch, then 7038582, and looks once
-- more afterwards. So a
-- writer that skipped its notification committed before that last look, and a writer that
-- comes after the watcher let go notifies. No wake-up is lost, and a writer never waits for a
-- relay longer than that one call.
CREATE OR REPLACE FUNCTION "kfs_notify_outbox"() RETURNS trigger
LANGUAGE plpgsql AS $kfs_notify_outbox$
BEGIN
  IF NEW."status" = 'pending' THEN
    -- Tested with a shared lock given back at once: a writer never keeps a watcher out.
    IF pg_try_advisory_lock_shared(7038583, hashtext(TG_TABLE_NAME)) THEN
      PERFORM pg_advisory_unlock_shared(7038583, hashtext(TG_TABLE_NAME));
      PERFORM pg_notify('kfs_outbox', NEW."event_type");
    ELSE
      -- A watcher: hold off its letting go until this transaction ends, then test again, so
      -- a watcher that let go in between is not missed.
      PERFORM pg_advisory_xact_lock_shared(7038582, hashtext(TG_TABLE_NAME));
      IF pg_try_advisory_lock_shared(7038583, hashtext(TG_TABLE_NAME)) THEN
        PERFORM pg_advisory_unlock_shared(7038583, hashtext(TG_TABLE_NAME));
        PERFORM pg_notify('kfs_outbox', NEW."event_type");
      END IF;
    END IF;
  END IF;
  RETURN NULL;
END
$kfs_notify_outbox$;

-- The relay's side, on its own session: become the watcher of an outbox table (false: another
-- relay watches, or a writer is testing for one at this instant).
CREATE OR REPLACE FUNCTION "kfs_outbox_watch"("outbox" TEXT) RETURNS BOOLEAN
LANGUAGE sql VOLATILE AS $kfs_outbox_watch$
  SELECT pg_try_advisory_lock(7038583, hashtext("outbox"))
$kfs_outbox_watch$;

-- Let go of the watch, unless a writer that may have skipped its notification has not ended
-- yet (false: still the watcher; look again and retry).
CREATE OR REPLACE FUNCTION "kfs_outbox_unwatch"("outbox" TEXT) RETURNS BOOLEAN
LANGUAGE plpgsql VOLATILE AS $kfs_outbox_unwatch$
BEGIN
  IF NOT pg_try_advisory_lock(7038582, hashtext("outbox")) THEN
    RETURN false;
  END IF;
  PERFORM pg_advisory_unlock(7038583, hashtext("outbox"));
  PERFORM pg_advisory_unlock(7038582, hashtext("outbox"));
  RETURN true;
END
$kfs_outbox_unwatch$;
