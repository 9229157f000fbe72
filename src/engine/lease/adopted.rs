//! Jobs another job's step finishes: a step that does the last piece of work of several jobs at
//! once (compile's publish, which moves a space's head for every document ready to publish)
//! ends the others in its own transaction. Invariant: only a job no worker holds is ended this
//! way (no lease on it, not ended, at the checkpoint the caller names), its row is written with
//! the same `succeeded` end a slice of its own would write, and its outbox row is completed,
//! so a message of it still in flight finds it ended and is acked.

use sqlx::PgConnection;
use uuid::Uuid;

use crate::engine::kind::{KindSpec, States};

/// Ends each job of `ids` that is unleased, not ended and at checkpoint `from`, as succeeded at
/// checkpoint `to`, with its outbox row completed; the caller must hold the rows locked (so
/// none changes between its checks and this write). Returns the ids ended.
pub async fn succeed_unleased(
    conn: &mut PgConnection,
    spec: &'static KindSpec,
    ids: &[Uuid],
    from: &str,
    to: &str,
) -> Result<Vec<Uuid>, sqlx::Error> {
    let (succeed, waiting) = match spec.states {
        States::RunState { .. } => (
            "run_state = 'succeeded', checkpoint = $3, active_slot = NULL, completed_at = now(), \
             retry_at = NULL, last_error_code = NULL, last_error_message = NULL",
            "j.run_state IN ('dispatch_pending', 'queued', 'retry_wait')",
        ),
        States::Stage => (
            "stage = $3, completed_at = {now}, retry_at = NULL, error = NULL",
            "j.stage NOT IN ('paused', 'completed', 'failed', 'canceled')",
        ),
    };
    let sql = spec.sql(&format!(
        "WITH j AS ( \
           UPDATE {{job}} AS j SET {succeed}, {lease}, row_version = j.row_version + 1, updated_at = {{now}} \
           WHERE j.id = ANY($1) AND j.{{cp}} = $2 AND j.lease_token IS NULL AND {waiting} \
           RETURNING j.id \
         ), o AS ( \
           UPDATE {{outbox}} AS o SET status = 'completed', lock_token = NULL, locked_by = NULL, \
             locked_until = NULL, updated_at = {{now}} \
           FROM j WHERE o.{{fk}} = j.id AND o.status NOT IN ('completed', 'dead', 'canceled') \
           RETURNING 1 \
         ) SELECT id FROM j",
        lease = super::LEASE_CLEAR,
    ));
    sqlx::query_scalar(&sql)
        .bind(ids)
        .bind(from)
        .bind(to)
        .fetch_all(conn)
        .await
}
