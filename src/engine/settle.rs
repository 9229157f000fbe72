//! Settling an outbox row that no delivery can use. Invariant: a row is settled only when the
//! delivery that names it is the row's current one (`queue_job_id`), the row is still out for
//! delivery, and no live worker holds its job's lease (that is a legitimate duplicate); then,
//! with the job row locked before the outbox row, a row whose own message no consumer can
//! decode (or that names another job) goes `dead` with the reason in `last_error`, its job
//! failed through [`super::kind::failed`] when the job is live and has no other live outbox row,
//! and a usable row of a terminal job goes `completed`, `dead` or `canceled` to match it. Only
//! statuses the outbox's CHECKs allow are written, with the lock columns cleared. Anything else
//! is left for the relay to publish again.

use sqlx::PgConnection;
use uuid::Uuid;

use super::kind::{Handler, JobCtx, KindSpec, States};

/// The columns an end or a release clears, in every table shape.
pub const LEASE_CLEAR: &str =
    "worker_id = NULL, lease_token = NULL, lease_expires_at = NULL, heartbeat_at = NULL";

/// The code a job fails with when its outbox row can never be delivered.
pub const UNDELIVERABLE: &str = "undeliverable";

/// The statements of one kind, rendered once.
#[derive(Debug)]
pub struct Statements {
    spec: &'static KindSpec,
    lock_job: String,
    lock_outbox: String,
    others_live: String,
    settle_row: String,
    fail_job: String,
}

impl Statements {
    pub fn new(spec: &'static KindSpec) -> Self {
        let (state, failable, fail_set) = match spec.states {
            States::RunState { failed_keeps_slot } => (
                "j.run_state",
                "(run_state IN ('dispatch_pending', 'queued', 'retry_wait') \
                  OR (run_state = 'running' AND (lease_expires_at <= {now} OR NOT kfs_worker_alive(worker_id))))",
                if failed_keeps_slot {
                    "run_state = 'failed', retry_at = NULL, last_error_code = $3, last_error_message = $4"
                } else {
                    "run_state = 'failed', retry_at = NULL, active_slot = NULL, completed_at = now(), \
                     last_error_code = $3, last_error_message = $4"
                },
            ),
            States::Stage => (
                "j.stage",
                "(stage NOT IN ('paused', 'completed', 'failed', 'canceled') \
                  AND (lease_token IS NULL OR lease_expires_at <= {now} OR NOT kfs_worker_alive(worker_id)))",
                "stage = 'failed', retry_at = NULL, completed_at = {now}, error = $3 || ': ' || $4",
            ),
        };
        Statements {
            spec,
            // The job row first, as every writer locks: the job of the row, whatever the
            // message said.
            lock_job: spec.sql(&format!(
                "SELECT j.id, j.{{cp}}::text, j.row_version, j.execution_attempts, j.max_execution_attempts, \
                   {state}::text, \
                   (j.lease_token IS NOT NULL AND j.lease_expires_at > {{now}} AND kfs_worker_alive(j.worker_id)) \
                 FROM {{job}} j WHERE j.id = (SELECT o.{{fk}} FROM {{outbox}} o WHERE o.id = $1) FOR UPDATE OF j"
            )),
            lock_outbox: spec.sql(
                "SELECT o.{fk}, o.status::text, o.queue_job_id, o.payload, o.schema_version \
                 FROM {outbox} o WHERE o.id = $1 FOR UPDATE",
            ),
            others_live: spec.sql(
                "SELECT EXISTS (SELECT 1 FROM {outbox} WHERE {fk} = $1 AND id <> $2 \
                   AND status IN ('pending', 'dispatching', 'dispatched', 'leased'))",
            ),
            settle_row: spec.sql(
                "UPDATE {outbox} SET status = $2, last_error = $3, lock_token = NULL, locked_by = NULL, \
                   locked_until = NULL, updated_at = {now} \
                 WHERE id = $1 AND status IN ('dispatching', 'dispatched', 'leased')",
            ),
            fail_job: spec.sql(&format!(
                "UPDATE {{job}} SET {fail_set}, {LEASE_CLEAR}, row_version = row_version + 1, updated_at = {{now}} \
                 WHERE id = $1 AND row_version = $2 AND {failable} RETURNING row_version"
            )),
        }
    }
}

/// What settling found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settled {
    /// Nothing was written, and why.
    Left(&'static str),
    /// The row is `dead`: nothing can use it. `job_failed`: its live job failed with it.
    Dead { reason: String, job_failed: bool },
    /// The row was settled to match its terminal job (`completed`, `dead` or `canceled`).
    Matched(&'static str),
}

/// The outbox status that matches a terminal job state, with its `last_error`.
fn matching(state: &str) -> Option<(&'static str, Option<&'static str>)> {
    match state {
        "succeeded" | "completed" => Some(("completed", None)),
        "failed" => Some(("dead", Some("job_failed: its job had already failed"))),
        "canceled" => Some(("canceled", Some("job_canceled: its job had been canceled"))),
        "superseded" => Some(("canceled", Some("superseded: its job had been superseded"))),
        _ => None,
    }
}

/// Settles outbox row `outbox_id` for the delivery `delivery_id` that named it, in `tx`, if
/// nothing can use the row; see the module's invariant. `hook`: the consumer's handler of the
/// kind, for the record of a failure.
pub async fn settle(
    tx: &mut PgConnection,
    st: &Statements,
    hook: Option<&dyn Handler>,
    outbox_id: Uuid,
    delivery_id: &str,
) -> Result<Settled, sqlx::Error> {
    type JobRow = (Uuid, String, i32, i32, i32, String, Option<bool>);
    let job: Option<JobRow> = sqlx::query_as(&st.lock_job)
        .bind(outbox_id)
        .fetch_optional(&mut *tx)
        .await?;
    let Some((job_id, checkpoint, row_version, attempts, max_attempts, state, held)) = job else {
        return Ok(Settled::Left("no such outbox row"));
    };
    type OutboxRow = (Uuid, String, Option<String>, serde_json::Value, i32);
    let row: Option<OutboxRow> = sqlx::query_as(&st.lock_outbox)
        .bind(outbox_id)
        .fetch_optional(&mut *tx)
        .await?;
    let Some((row_job, status, queue_job_id, payload, schema_version)) = row else {
        return Ok(Settled::Left("no such outbox row"));
    };
    if row_job != job_id {
        return Ok(Settled::Left("the row changed hands"));
    }
    if !matches!(status.as_str(), "dispatching" | "dispatched" | "leased") {
        return Ok(Settled::Left("the row is no longer out for delivery"));
    }
    if queue_job_id.as_deref() != Some(delivery_id) {
        return Ok(Settled::Left("a newer delivery replaced this one"));
    }
    if held == Some(true) {
        return Ok(Settled::Left("a live worker holds the job"));
    }
    let unusable = crate::engine::wire::unusable_row(
        st.spec,
        outbox_id,
        job_id,
        delivery_id,
        schema_version,
        &payload,
    );
    if let Some(why) = unusable {
        let reason = format!("{UNDELIVERABLE}: {why}");
        sqlx::query(&st.settle_row)
            .bind(outbox_id)
            .bind("dead")
            .bind(&reason)
            .execute(&mut *tx)
            .await?;
        let others: bool = sqlx::query_scalar(&st.others_live)
            .bind(job_id)
            .bind(outbox_id)
            .fetch_one(&mut *tx)
            .await?;
        let mut job_failed = false;
        if !others {
            let failed: Option<i32> = sqlx::query_scalar(&st.fail_job)
                .bind(job_id)
                .bind(row_version)
                .bind(UNDELIVERABLE)
                .bind(&why)
                .fetch_optional(&mut *tx)
                .await?;
            if let Some(rv) = failed {
                let ctx = JobCtx::unleased(
                    st.spec.kind,
                    job_id,
                    outbox_id,
                    rv,
                    checkpoint,
                    attempts,
                    max_attempts,
                );
                super::kind::failed(tx, hook, st.spec, &ctx, UNDELIVERABLE).await?;
                job_failed = true;
            }
        }
        return Ok(Settled::Dead { reason, job_failed });
    }
    if let Some((to, last_error)) = matching(&state) {
        sqlx::query(&st.settle_row)
            .bind(outbox_id)
            .bind(to)
            .bind(last_error)
            .execute(&mut *tx)
            .await?;
        return Ok(Settled::Matched(to));
    }
    Ok(Settled::Left("the row is usable and its job live"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_states_map_to_the_outbox_statuses_the_schema_allows() {
        for (state, want) in [
            ("succeeded", Some("completed")),
            ("completed", Some("completed")),
            ("failed", Some("dead")),
            ("canceled", Some("canceled")),
            ("superseded", Some("canceled")),
            ("queued", None),
            ("paused", None),
            ("running", None),
        ] {
            assert_eq!(matching(state).map(|m| m.0), want, "{state}");
        }
    }
}
