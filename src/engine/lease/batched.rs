//! The outbox kinds' transitions for many jobs in one statement: claim, fence, advance, end
//! (succeed or continue) and heartbeat over `unnest` of the members' ids, tokens and row
//! versions. Invariant: each statement applies to every member exactly the comparison the
//! one-job statement of the same name applies (lease token, row version, an unexpired lease by
//! the wall clock, a live job), takes job row locks before outbox row locks, each in id order
//! (or skips locked rows), and returns the ids it changed, so a caller sees precisely which
//! members matched. Every statement that waits for several outbox rows (these, and the relay's
//! release) takes them in id order, so two of them never deadlock; the relay's mark waits for
//! none.

use std::time::Duration;

use sqlx::PgConnection;
use uuid::Uuid;

use super::claims::{leased, record_claim};
use super::{millis, DeliveryRef, Statements, LEASE_CLEAR};
use crate::engine::kind::{JobCtx, KindSpec};

/// The SQL fragments of one kind's state model that the batched statements share with the
/// one-job ones, so both compare exactly the same things.
pub(super) struct Fragments<'a> {
    pub claimable: &'a str,
    pub running_set: &'a str,
    pub live: &'a str,
    /// The succeed end's job columns; `$5` is the final checkpoint.
    pub succeed: &'a str,
    pub cont: &'a str,
    pub silent_for: &'a str,
    /// Job rows in this state are locked only by short transactions (the relay's mark moving
    /// them to `queued`, a claim): the batched claim waits for them instead of skipping them.
    pub brief: Option<&'a str>,
}

/// The rendered texts of the batched statements of one kind.
#[derive(Debug)]
pub struct Batched {
    claim: String,
    fence: String,
    advance: String,
    succeed: String,
    cont: String,
    heartbeat: String,
}

impl Batched {
    pub(super) fn new(spec: &'static KindSpec, f: &Fragments<'_>) -> Self {
        let Fragments {
            claimable,
            running_set,
            live,
            succeed,
            cont,
            silent_for,
            brief,
        } = f;
        // Job rows in a brief state are waited for (a delivery usually arrives while the relay
        // still marks its row); the others (a step may hold them for long) are skipped. Both
        // parts lock in id order, the waited ones first, so no cycle forms.
        let prev = |filter: &str, skip: &str| {
            format!(
                "SELECT j.id, j.lease_token IS NOT NULL AS held, j.heartbeat_at FROM {{job}} j \
                 WHERE j.id IN (SELECT job_id FROM req) AND {claimable} \
                   AND j.execution_attempts < j.max_execution_attempts AND {filter} \
                 ORDER BY j.id FOR UPDATE OF j{skip}"
            )
        };
        let prev = match brief {
            Some(b) => format!(
                "prev_wait AS ({}), prev_skip AS ({}), \
                 prev AS (SELECT * FROM prev_wait UNION ALL SELECT * FROM prev_skip)",
                prev(b, ""),
                prev(&format!("NOT ({b})"), " SKIP LOCKED")
            ),
            None => format!("prev AS ({})", prev("true", " SKIP LOCKED")),
        };
        let end = |job_set: &str, outbox_set: &str| {
            spec.sql(&format!(
                "WITH e AS ( \
                   SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::int[], $4::uuid[], $5::text[]) \
                     AS e(id, token, rv, outbox_id, cp) \
                 ), j AS ( \
                   UPDATE {{job}} AS j SET {job_set}, {LEASE_CLEAR}, row_version = j.row_version + 1, updated_at = {{now}} \
                   FROM e WHERE j.id = e.id AND j.lease_token = e.token AND j.row_version = e.rv \
                     AND j.lease_expires_at > {{clock}} AND {live} \
                   RETURNING j.id, e.outbox_id \
                 ), ol AS ( \
                   SELECT o.id, j.id AS job_id FROM {{outbox}} o JOIN j ON o.id = j.outbox_id \
                   ORDER BY o.id FOR UPDATE OF o \
                 ) \
                 UPDATE {{outbox}} AS o SET {outbox_set}, lock_token = NULL, locked_by = NULL, locked_until = NULL, \
                   updated_at = {{now}} \
                 FROM ol WHERE o.id = ol.id RETURNING ol.job_id"
            ))
        };
        Batched {
            // As the one-job claim, for every delivery at once: the job rows locked in id order,
            // skipping rows a step may hold (those deliveries are claimed one by one, where the
            // diagnosis can wait for the lock), then their outbox rows in id order, waited for:
            // only short transactions hold an outbox row whose job row is free (above all the
            // relay's mark, which skips every row a claim holds, so it never waits for this
            // claim).
            claim: spec.sql(&format!(
                "WITH req AS ( \
                   SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::uuid[]) \
                     AS r(job_id, outbox_id, delivery_id, token) \
                 ), {prev}, ob AS ( \
                   SELECT o.id, prev.id AS job_id, req.token FROM {{outbox}} o \
                   JOIN req ON req.outbox_id = o.id \
                   JOIN prev ON prev.id = req.job_id AND o.{{fk}} = prev.id \
                   WHERE o.queue_job_id = req.delivery_id AND o.status IN ('dispatching', 'dispatched', 'leased') \
                   ORDER BY o.id FOR UPDATE OF o \
                 ), claimed AS ( \
                   UPDATE {{job}} AS j SET {running_set} \
                     worker_id = $5, lease_token = ob.token, lease_expires_at = {{now+$6}}, heartbeat_at = {{now}}, \
                     execution_attempts = j.execution_attempts + 1, row_version = j.row_version + 1, updated_at = {{now}} \
                   FROM ob WHERE j.id = ob.job_id \
                   RETURNING j.id, j.{{cp}}::text AS cp, j.row_version, j.execution_attempts, \
                     j.max_execution_attempts, j.lease_expires_at \
                 ), leased AS ( \
                   UPDATE {{outbox}} AS o SET status = 'leased', available_at = claimed.lease_expires_at, \
                     delivered_at = {{now}}, lock_token = NULL, locked_by = NULL, locked_until = NULL, updated_at = {{now}} \
                   FROM ob JOIN claimed ON claimed.id = ob.job_id WHERE o.id = ob.id RETURNING 1 \
                 ) \
                 SELECT claimed.id, claimed.cp, claimed.row_version, claimed.execution_attempts, \
                   claimed.max_execution_attempts, prev.held, {silent_for} \
                 FROM claimed JOIN prev ON prev.id = claimed.id"
            )),
            fence: spec.sql(&format!(
                "SELECT j.id, j.row_version, {} \
                 FROM {{job}} j JOIN unnest($1::uuid[], $2::uuid[], $3::int[]) AS f(id, token, rv) ON j.id = f.id \
                 WHERE j.lease_token = f.token AND j.row_version = f.rv AND j.lease_expires_at > {{clock}} AND {live} \
                 ORDER BY j.id FOR NO KEY UPDATE OF j",
                spec.step_settings()
            )),
            advance: spec.sql(
                "UPDATE {job} AS j SET {cp} = a.cp, row_version = j.row_version + 1, updated_at = {now} \
                 FROM unnest($1::uuid[], $2::uuid[], $3::text[]) AS a(id, token, cp) \
                 WHERE j.id = a.id AND j.lease_token = a.token AND j.lease_expires_at > {clock} \
                 RETURNING j.id, j.row_version",
            ),
            succeed: end(&succeed.replace("$5", "e.cp"), "status = 'completed'"),
            cont: end(
                cont,
                "status = 'pending', available_at = {now}, dispatch_attempts = 0, last_error = NULL",
            ),
            heartbeat: spec.sql(&format!(
                "WITH h AS ( \
                   SELECT * FROM unnest($1::uuid[], $2::uuid[], $4::uuid[], $5::text[]) \
                     AS h(id, token, outbox_id, delivery_id) \
                 ), jl AS ( \
                   SELECT j.id FROM {{job}} j JOIN h ON j.id = h.id \
                   WHERE j.lease_token = h.token AND j.lease_expires_at > {{clock}} AND {live} \
                   ORDER BY j.id FOR NO KEY UPDATE OF j \
                 ), j AS ( \
                   UPDATE {{job}} AS j SET lease_expires_at = {{clock+$3}}, heartbeat_at = {{clock}} FROM jl, h \
                   WHERE j.id = jl.id AND h.id = jl.id AND j.lease_token = h.token AND j.lease_expires_at > {{clock}} AND {live} \
                   RETURNING j.id, j.lease_expires_at, h.outbox_id, h.delivery_id \
                 ), ol AS ( \
                   SELECT o.id, j.lease_expires_at FROM {{outbox}} o JOIN j ON o.id = j.outbox_id \
                   WHERE o.status = 'leased' AND o.queue_job_id = j.delivery_id \
                   ORDER BY o.id FOR UPDATE OF o \
                 ), o AS ( \
                   UPDATE {{outbox}} AS o SET available_at = ol.lease_expires_at FROM ol WHERE o.id = ol.id \
                   RETURNING 1 \
                 ) SELECT id FROM j"
            )),
        }
    }
}

/// Claims the jobs of `deliveries` (distinct jobs, each with its fresh lease token) in one
/// statement committed on its own. Returns the jobs claimed; a delivery not among them was not
/// claimed (its job or outbox row did not qualify, or another transaction held it) and goes
/// through the one-job claim and its diagnosis.
pub async fn claim_many(
    conn: &mut PgConnection,
    st: &Statements,
    deliveries: &[(&DeliveryRef, Uuid)],
    worker_id: &str,
    lease: Duration,
) -> Result<Vec<JobCtx>, sqlx::Error> {
    type Row = (Uuid, String, i32, i32, i32, bool, Option<f64>);
    let ids: Vec<Uuid> = deliveries.iter().map(|(d, _)| d.job_id).collect();
    let outbox: Vec<Uuid> = deliveries.iter().map(|(d, _)| d.outbox_id).collect();
    let delivery: Vec<&str> = deliveries
        .iter()
        .map(|(d, _)| d.delivery_id.as_str())
        .collect();
    let tokens: Vec<Uuid> = deliveries.iter().map(|&(_, t)| t).collect();
    let sent = std::time::Instant::now();
    let rows: Vec<Row> = sqlx::query_as(&st.batched.claim)
        .bind(&ids)
        .bind(&outbox)
        .bind(&delivery)
        .bind(&tokens)
        .bind(worker_id)
        .bind(millis(lease))
        .fetch_all(&mut *conn)
        .await?;
    let mut claimed = Vec::with_capacity(rows.len());
    for (job_id, checkpoint, row_version, attempts, max_attempts, taken_over, silent_for) in rows {
        let Some(&(d, token)) = deliveries.iter().find(|(d, _)| d.job_id == job_id) else {
            continue;
        };
        record_claim(d, attempts, taken_over, silent_for);
        claimed.push(leased(
            d,
            token,
            worker_id,
            (checkpoint, row_version, attempts, max_attempts),
            sent,
        ));
    }
    Ok(claimed)
}

/// Locks every member's job row (in id order) for one group step, under the one-job fence's
/// comparison. Returns `(job id, row version)` of the members that still hold their lease.
pub async fn fence_many(
    tx: &mut PgConnection,
    st: &Statements,
    jobs: &[&JobCtx],
    lease: Duration,
) -> Result<Vec<(Uuid, i32)>, sqlx::Error> {
    let ids: Vec<Uuid> = jobs.iter().map(|j| j.job_id).collect();
    let tokens: Vec<Uuid> = jobs.iter().map(|j| j.lease_token).collect();
    let rvs: Vec<i32> = jobs.iter().map(|j| j.row_version).collect();
    let rows: Vec<(Uuid, i32, String)> = sqlx::query_as(&st.batched.fence)
        .bind(&ids)
        .bind(&tokens)
        .bind(&rvs)
        .bind(super::idle_timeout(lease))
        .fetch_all(tx)
        .await?;
    Ok(rows.into_iter().map(|(id, rv, _)| (id, rv)).collect())
}

/// Moves each member's checkpoint after [`fence_many`] in the same transaction. Returns
/// `(job id, new row version)` of the members whose lease still held.
pub async fn advance_many(
    tx: &mut PgConnection,
    st: &Statements,
    moves: &[(&JobCtx, &str)],
) -> Result<Vec<(Uuid, i32)>, sqlx::Error> {
    let ids: Vec<Uuid> = moves.iter().map(|(j, _)| j.job_id).collect();
    let tokens: Vec<Uuid> = moves.iter().map(|(j, _)| j.lease_token).collect();
    let cps: Vec<&str> = moves.iter().map(|&(_, cp)| cp).collect();
    sqlx::query_as(&st.batched.advance)
        .bind(&ids)
        .bind(&tokens)
        .bind(&cps)
        .fetch_all(tx)
        .await
}

/// How a member of a group ends in the group's own end statement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupEnd {
    Succeed,
    Continue,
}

/// Ends the slices of `ends` (each with its final checkpoint, used by `Succeed`) in one
/// statement per end kind. Returns the ids of the members whose end was written.
pub async fn end_many(
    tx: &mut PgConnection,
    st: &Statements,
    how: GroupEnd,
    ends: &[(&JobCtx, &str)],
) -> Result<Vec<Uuid>, sqlx::Error> {
    let ids: Vec<Uuid> = ends.iter().map(|(j, _)| j.job_id).collect();
    let tokens: Vec<Uuid> = ends.iter().map(|(j, _)| j.lease_token).collect();
    let rvs: Vec<i32> = ends.iter().map(|(j, _)| j.row_version).collect();
    let outbox: Vec<Uuid> = ends.iter().map(|(j, _)| j.outbox_id).collect();
    let cps: Vec<&str> = ends.iter().map(|&(_, cp)| cp).collect();
    let sql = match how {
        GroupEnd::Succeed => &st.batched.succeed,
        GroupEnd::Continue => &st.batched.cont,
    };
    sqlx::query_scalar(sql)
        .bind(&ids)
        .bind(&tokens)
        .bind(&rvs)
        .bind(&outbox)
        .bind(&cps)
        .fetch_all(tx)
        .await
}

/// Extends every lease of `jobs` and their outbox rows' visibility in one statement. Returns
/// the ids of the jobs whose lease was extended; any other lease is lost.
pub async fn heartbeat_many(
    conn: &mut PgConnection,
    st: &Statements,
    jobs: &[JobCtx],
    lease: Duration,
) -> Result<Vec<Uuid>, sqlx::Error> {
    let mut sorted: Vec<&JobCtx> = jobs.iter().collect();
    // Rows are taken in id order, as the group fence takes them.
    sorted.sort_by_key(|j| j.job_id);
    let ids: Vec<Uuid> = sorted.iter().map(|j| j.job_id).collect();
    let tokens: Vec<Uuid> = sorted.iter().map(|j| j.lease_token).collect();
    let outbox: Vec<Uuid> = sorted.iter().map(|j| j.outbox_id).collect();
    let delivery: Vec<&str> = sorted.iter().map(|j| j.delivery_id.as_str()).collect();
    sqlx::query_scalar(&st.batched.heartbeat)
        .bind(&ids)
        .bind(&tokens)
        .bind(millis(lease))
        .bind(&outbox)
        .bind(&delivery)
        .fetch_all(conn)
        .await
}
