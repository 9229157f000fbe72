-- The engine's probe kind: job and outbox tables of the same shape as the platform's, and an
-- effects ledger. Used by the engine's tests and benchmarks, never by the platform. Idempotent.
CREATE TABLE IF NOT EXISTS "kfs_probe_jobs" (
  "id" UUID PRIMARY KEY NOT NULL,
  "checkpoint" VARCHAR(32) NOT NULL,
  "run_state" VARCHAR(16) NOT NULL,
  "active_slot" INTEGER,
  "steps_total" INTEGER NOT NULL,
  "step_sleep_ms" INTEGER NOT NULL DEFAULT 0,
  "fail_mode" VARCHAR(16) NOT NULL DEFAULT 'none',
  "execution_attempts" INTEGER NOT NULL,
  "max_execution_attempts" INTEGER NOT NULL,
  "worker_id" VARCHAR(255),
  "lease_token" UUID,
  "lease_expires_at" TIMESTAMPTZ,
  "heartbeat_at" TIMESTAMPTZ,
  "retry_at" TIMESTAMPTZ,
  "last_error_code" VARCHAR(64),
  "last_error_message" TEXT,
  "row_version" INTEGER NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  "started_at" TIMESTAMPTZ,
  "completed_at" TIMESTAMPTZ,
  CONSTRAINT "kfs_probe_jobs_run_state_ck" CHECK (
    "run_state" IN ('dispatch_pending', 'queued', 'running', 'retry_wait', 'succeeded', 'failed', 'canceled')),
  CONSTRAINT "kfs_probe_jobs_lifecycle_ck" CHECK (
    ("run_state" IN ('succeeded', 'failed', 'canceled') AND "active_slot" IS NULL AND "completed_at" IS NOT NULL)
    OR ("run_state" IN ('dispatch_pending', 'queued', 'running', 'retry_wait') AND "active_slot" = 1 AND "completed_at" IS NULL)),
  CONSTRAINT "kfs_probe_jobs_retry_ck" CHECK (
    ("run_state" = 'retry_wait' AND "retry_at" IS NOT NULL) OR ("run_state" <> 'retry_wait' AND "retry_at" IS NULL)),
  CONSTRAINT "kfs_probe_jobs_lease_ck" CHECK (
    ("run_state" = 'running' AND "worker_id" IS NOT NULL AND "lease_token" IS NOT NULL
      AND "lease_expires_at" IS NOT NULL AND "heartbeat_at" IS NOT NULL)
    OR ("run_state" <> 'running' AND "worker_id" IS NULL AND "lease_token" IS NULL
      AND "lease_expires_at" IS NULL AND "heartbeat_at" IS NULL)),
  CONSTRAINT "kfs_probe_jobs_attempts_ck" CHECK (
    "execution_attempts" >= 0 AND "execution_attempts" <= "max_execution_attempts" AND "row_version" >= 1)
);

CREATE TABLE IF NOT EXISTS "kfs_probe_outbox" (
  "id" UUID PRIMARY KEY NOT NULL,
  "probe_job_id" UUID NOT NULL REFERENCES "kfs_probe_jobs" ("id") ON DELETE CASCADE,
  "delivery_revision" INTEGER NOT NULL,
  "event_type" VARCHAR(32) NOT NULL CHECK ("event_type" = 'probe.job'),
  "schema_version" INTEGER NOT NULL,
  "idempotency_key" VARCHAR(512) NOT NULL UNIQUE,
  "payload" JSONB NOT NULL,
  "status" VARCHAR(16) NOT NULL CHECK (
    "status" IN ('pending', 'dispatching', 'dispatched', 'leased', 'completed', 'canceled', 'dead')),
  "available_at" TIMESTAMPTZ NOT NULL,
  "dispatch_attempts" INTEGER NOT NULL,
  "locked_by" VARCHAR(255),
  "locked_until" TIMESTAMPTZ,
  "lock_token" UUID,
  "queue_job_id" VARCHAR(255),
  "last_error" TEXT,
  "delivered_at" TIMESTAMPTZ,
  "created_at" TIMESTAMPTZ NOT NULL,
  "updated_at" TIMESTAMPTZ NOT NULL,
  CONSTRAINT "kfs_probe_outbox_lock_ck" CHECK (
    ("status" = 'dispatching' AND "locked_by" IS NOT NULL AND "lock_token" IS NOT NULL AND "locked_until" IS NOT NULL)
    OR ("status" <> 'dispatching' AND "locked_by" IS NULL AND "lock_token" IS NULL AND "locked_until" IS NULL))
);
CREATE INDEX IF NOT EXISTS "kfs_probe_outbox_claim_idx"
  ON "kfs_probe_outbox" ("status", "available_at", "locked_until", "id");
CREATE INDEX IF NOT EXISTS "kfs_probe_outbox_job_idx" ON "kfs_probe_outbox" ("probe_job_id");
-- The rows due again (retries, continued slices, failed publishes), which the relay's claim
-- takes before new rows (the platform outboxes' `urgent` indexes, see src/db/indexes.rs).
CREATE INDEX IF NOT EXISTS "kfs_probe_outbox_urgent_idx" ON "kfs_probe_outbox" ("available_at", "id")
  WHERE "status" = 'pending' AND ("dispatch_attempts" > 0 OR "delivered_at" IS NOT NULL);

-- One row per applied step effect; the tests count them to prove exactly-once application.
CREATE TABLE IF NOT EXISTS "kfs_probe_effects" (
  "id" BIGSERIAL PRIMARY KEY,
  "job_id" UUID NOT NULL,
  "step" INTEGER NOT NULL,
  "worker_id" VARCHAR(255) NOT NULL,
  "lease_token" UUID NOT NULL,
  "created_at" TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS "kfs_probe_effects_job_idx" ON "kfs_probe_effects" ("job_id", "step");

DO $kfs_probe_trigger$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'kfs_probe_outbox'::regclass AND tgname = 'kfs_probe_outbox_kfs_notify') THEN
    CREATE TRIGGER "kfs_probe_outbox_kfs_notify" AFTER INSERT OR UPDATE OF "status", "available_at"
      ON "kfs_probe_outbox" FOR EACH ROW WHEN (NEW."status" = 'pending') EXECUTE FUNCTION "kfs_notify_outbox"();
  END IF;
END
$kfs_probe_trigger$;
