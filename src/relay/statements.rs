//! The relay's statement texts of one kind, rendered once. Invariant: a claim takes rows with
//! `SKIP LOCKED`, at most 1.5 × `batch` + 3 of them; every later write to a claimed row
//! (mark, release, dead) is fenced by the claim's lock token and status `dispatching`; a job row
//! another transaction holds is skipped, never waited for; outbox rows a statement waits for are
//! taken in id order, as the consumer's batched statements take them, so none of them deadlock.

use crate::engine::lease::LEASE_CLEAR;
use crate::jobs::{KindSpec, States};

pub(super) struct Statements {
    pub(super) claim: String,
    pub(super) mark: String,
    pub(super) release: String,
    pub(super) dead: String,
}

impl Statements {
    pub(super) fn new(spec: &KindSpec) -> Self {
        let revision = if spec.revisions {
            "o.delivery_revision"
        } else {
            "1"
        };
        let (mark_job, failed_set, failable) = match spec.states {
            States::RunState { failed_keeps_slot } => (
                "ready AS ( \
                   SELECT j.id FROM {job} j JOIN marked ON j.id = marked.job_id \
                   WHERE j.run_state = 'dispatch_pending' FOR UPDATE OF j SKIP LOCKED \
                 ), moved AS ( \
                   UPDATE {job} j SET run_state = 'queued', row_version = j.row_version + 1, updated_at = {now} \
                   FROM ready WHERE j.id = ready.id RETURNING 1 \
                 )",
                if failed_keeps_slot {
                    "run_state = 'failed', retry_at = NULL, last_error_code = 'dispatch_exhausted', last_error_message = $2"
                } else {
                    "run_state = 'failed', retry_at = NULL, active_slot = NULL, completed_at = now(), \
                     last_error_code = 'dispatch_exhausted', last_error_message = $2"
                },
                "(j.run_state IN ('dispatch_pending', 'queued', 'retry_wait') \
                  OR (j.run_state = 'running' AND j.lease_expires_at <= {now}))",
            ),
            States::Stage => (
                "moved AS (SELECT 1 WHERE false)",
                "stage = 'failed', retry_at = NULL, completed_at = {now}, error = 'dispatch_exhausted: ' || $2",
                "(j.stage NOT IN ('paused', 'completed', 'failed', 'canceled') \
                  AND (j.lease_token IS NULL OR j.lease_expires_at <= {now}))",
            ),
        };
        Statements {
            // Each way a row comes due is its own index range scan on (status, available_at
            // or locked_until), locked with SKIP LOCKED, so a claim costs the same on an outbox
            // of a hundred rows or of millions. Rows a relay died holding (a quarter of the
            // batch) and rows whose visibility passed (another quarter) are taken besides the
            // new ones, so new work cannot starve them; a claim is at most 1.5 × `batch` + 3.
            claim: spec.sql(&format!(
                "WITH stuck AS ( \
                   SELECT id FROM {{outbox}} WHERE status = 'dispatching' AND locked_until <= {{now}} \
                   ORDER BY locked_until LIMIT $1 / 4 + 1 FOR UPDATE SKIP LOCKED \
                 ), lost AS ( \
                   SELECT id FROM {{outbox}} WHERE status = 'dispatched' AND available_at <= {{now}} \
                   ORDER BY available_at LIMIT $1 / 8 + 1 FOR UPDATE SKIP LOCKED \
                 ), expired AS ( \
                   SELECT id FROM {{outbox}} WHERE status = 'leased' AND available_at <= {{now}} \
                   ORDER BY available_at LIMIT $1 / 8 + 1 FOR UPDATE SKIP LOCKED \
                 ), fresh AS ( \
                   SELECT id FROM {{outbox}} WHERE status = 'pending' AND available_at <= {{now}} \
                   ORDER BY available_at LIMIT $1 FOR UPDATE SKIP LOCKED \
                 ) \
                 UPDATE {{outbox}} o SET status = 'dispatching', lock_token = $2, locked_by = $3, \
                   locked_until = {{now+$4}}, dispatch_attempts = o.dispatch_attempts + 1, \
                   queue_job_id = gen_random_uuid()::text, updated_at = {{now}} \
                 WHERE o.id = ANY(ARRAY( \
                   SELECT id FROM stuck UNION ALL SELECT id FROM lost UNION ALL SELECT id FROM expired \
                   UNION ALL SELECT id FROM fresh)) \
                 RETURNING o.id, o.{{fk}}, o.payload, o.queue_job_id, o.dispatch_attempts, {revision}, o.schema_version"
            )),
            mark: spec.sql(&format!(
                "WITH lk AS ( \
                   SELECT o.id FROM {{outbox}} o \
                   WHERE o.id = ANY($1::uuid[]) AND o.lock_token = $2 AND o.status = 'dispatching' \
                   ORDER BY o.id FOR UPDATE OF o \
                 ), marked AS ( \
                   UPDATE {{outbox}} o SET status = 'dispatched', lock_token = NULL, locked_by = NULL, \
                     locked_until = NULL, available_at = {{now+$3}}, last_error = NULL, updated_at = {{now}} \
                   FROM lk WHERE o.id = lk.id AND o.lock_token = $2 AND o.status = 'dispatching' \
                   RETURNING o.{{fk}} AS job_id \
                 ), {mark_job} \
                 SELECT (SELECT count(*) FROM marked), (SELECT count(*) FROM moved)"
            )),
            // `refund`: the message never left (the channel was already broken), so this claim
            // does not count as a dispatch attempt.
            release: spec.sql(
                "WITH m AS ( \
                   SELECT * FROM unnest($1::uuid[], $4::bigint[], $5::int[]) AS m(id, delay_ms, refund) \
                 ), lk AS ( \
                   SELECT o.id, m.delay_ms, m.refund FROM {outbox} o JOIN m ON o.id = m.id \
                   WHERE o.lock_token = $2 AND o.status = 'dispatching' ORDER BY o.id FOR UPDATE OF o \
                 ) \
                 UPDATE {outbox} o SET status = 'pending', available_at = {now+lk.delay_ms}, lock_token = NULL, \
                   locked_by = NULL, locked_until = NULL, last_error = $3, \
                   dispatch_attempts = o.dispatch_attempts - lk.refund, updated_at = {now} \
                 FROM lk WHERE o.id = lk.id AND o.lock_token = $2 AND o.status = 'dispatching'",
            ),
            // Job rows locked by someone else (a worker mid-step) are skipped, never waited for:
            // their outbox rows stay `dispatching` under our token and are released instead.
            dead: spec.sql(&format!(
                "WITH lockable AS ( \
                   SELECT o.id, o.{{fk}} AS job_id FROM {{outbox}} o JOIN {{job}} j ON j.id = o.{{fk}} \
                   WHERE o.id = ANY($1::uuid[]) AND o.lock_token = $3 AND o.status = 'dispatching' \
                   FOR UPDATE OF o, j SKIP LOCKED \
                 ), r AS ( \
                   UPDATE {{outbox}} o SET status = 'dead', lock_token = NULL, locked_by = NULL, locked_until = NULL, \
                     last_error = 'dispatch_exhausted: ' || $2, updated_at = {{now}} \
                   FROM lockable WHERE o.id = lockable.id \
                   RETURNING o.{{fk}} AS job_id \
                 ), f AS ( \
                   UPDATE {{job}} j SET {failed_set}, {LEASE_CLEAR}, row_version = j.row_version + 1, updated_at = {{now}} \
                   FROM r WHERE j.id = r.job_id AND {failable} \
                   RETURNING j.id, j.{{cp}}::text AS cp, j.row_version, j.execution_attempts, j.max_execution_attempts \
                 ) SELECT (SELECT count(*) FROM r), f.id, f.cp, f.row_version, f.execution_attempts, \
                   f.max_execution_attempts \
                 FROM (SELECT 1) AS one LEFT JOIN f ON true"
            )),
        }
    }
}
