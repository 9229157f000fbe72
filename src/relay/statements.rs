//! The relay's statement texts of one kind, rendered once. Invariant: a claim takes rows with
//! `SKIP LOCKED`, at most 1.5 × `batch` + 3 of them; a `dispatching` row of another relay only once
//! its lock ran out or that relay's liveness holder is dead; every later write to a claimed row
//! (mark, release, dead) is fenced by the claim's lock token and status `dispatching`; a row goes
//! dead only with its job failed with it (or already ended or paused), never while its job
//! holds a live lease; with tenant limits, no retry of a tenant at its limit takes any of a
//! claim's room; a job row another transaction holds is skipped, never waited for; the mark skips outbox rows another
//! transaction holds (a consumer's claim, which leases the row itself), so it never waits;
//! outbox rows the release waits for are taken in id order, as the consumer's batched
//! statements take them, so none of them deadlock.

use crate::db::indexes::URGENT_ROW;
use crate::engine::lease::LEASE_CLEAR;
use crate::jobs::{KindSpec, States};

/// Why a claimed row was due, in the order the relay publishes them (the `class` column).
pub(super) mod class {
    /// A relay died holding it, or its message waited past the visibility: already in the
    /// window, so taken whatever the room.
    pub const REPUBLISH: i32 = 0;
    /// Its job's lease ran out or its holder died: taken over.
    pub const TAKEOVER: i32 = 1;
    /// A retry that came due, a continued slice, or a row whose publishing failed.
    pub const RETRY: i32 = 2;
    /// New work, round-robin between tenants.
    pub const FAIR: i32 = 3;
    /// Any other due row, oldest first: fills room the round-robin left.
    pub const FILL: i32 = 4;
}

pub(super) struct Statements {
    /// Params: `$1` batch, `$2` lock token, `$3` relay id, `$4` lock ttl (ms), `$5` window,
    /// `$6` the tenant after which the round-robin starts, `$7` the tenant limit (only in
    /// `claim_limited`).
    pub(super) claim: String,
    pub(super) claim_limited: String,
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
        let (mark_job, failed_set, failable, live) = match spec.states {
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
                "(j.run_state = 'running' AND j.lease_expires_at > {now})",
            ),
            States::Stage => (
                "moved AS (SELECT 1 WHERE false)",
                "stage = 'failed', retry_at = NULL, completed_at = {now}, error = 'dispatch_exhausted: ' || $2",
                "(j.stage NOT IN ('paused', 'completed', 'failed', 'canceled') \
                  AND (j.lease_token IS NULL OR j.lease_expires_at <= {now}))",
                "(j.stage NOT IN ('paused', 'completed', 'failed', 'canceled') \
                  AND j.lease_token IS NOT NULL AND j.lease_expires_at > {now})",
            ),
        };
        Statements {
            claim: spec.sql(&claim(spec, revision, false)),
            claim_limited: spec.sql(&claim(spec, revision, true)),
            // The rows are found by id alone (the primary key); their status is checked as they
            // are written. With the status among the lock's conditions, the outbox's claim index
            // (led by the status, the id last) served it, and each of the batch's ids scanned
            // every `dispatching` row of the window: 5 ms of CPU per mark of 40 rows at
            // 3,000 jobs/s, the relay's largest statement.
            mark: spec.sql(&format!(
                "WITH lk AS ( \
                   SELECT o.id FROM {{outbox}} o \
                   WHERE o.id = ANY($1::uuid[]) AND o.lock_token = $2 \
                   ORDER BY o.id FOR UPDATE OF o SKIP LOCKED \
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
            // A row whose job still holds a live lease (a takeover published while its holder's
            // lease runs) is not made dead either: its job cannot be failed under that lease, and
            // a dead row is never published again, so the job would stay `running` for ever
            // (a compile keeping its active slot). It is counted as `kept` and released: it is
            // published again until a publish gets through or the lease runs out and the job
            // fails with it.
            dead: spec.sql(&format!(
                "WITH lockable AS ( \
                   SELECT o.id, o.{{fk}} AS job_id, {live} AS live FROM {{outbox}} o JOIN {{job}} j ON j.id = o.{{fk}} \
                   WHERE o.id = ANY($1::uuid[]) AND o.lock_token = $3 AND o.status = 'dispatching' \
                   FOR UPDATE OF o, j SKIP LOCKED \
                 ), r AS ( \
                   UPDATE {{outbox}} o SET status = 'dead', lock_token = NULL, locked_by = NULL, locked_until = NULL, \
                     last_error = 'dispatch_exhausted: ' || $2, updated_at = {{now}} \
                   FROM lockable WHERE o.id = lockable.id AND NOT lockable.live \
                   RETURNING o.{{fk}} AS job_id \
                 ), f AS ( \
                   UPDATE {{job}} j SET {failed_set}, {LEASE_CLEAR}, row_version = j.row_version + 1, updated_at = {{now}} \
                   FROM r WHERE j.id = r.job_id AND {failable} \
                   RETURNING j.id, j.{{cp}}::text AS cp, j.row_version, j.execution_attempts, j.max_execution_attempts \
                 ) SELECT (SELECT count(*) FROM r), (SELECT count(*) FROM lockable WHERE live) AS kept, \
                   f.id, f.cp, f.row_version, f.execution_attempts, f.max_execution_attempts \
                 FROM (SELECT 1) AS one LEFT JOIN f ON true"
            )),
        }
    }
}

/// How many of a tenant's never-dispatched jobs, oldest first, the round-robin looks at in one
/// claim: twice its share and a few (jobs another relay claimed and has not marked yet sit there
/// too). A job whose outbox row is not due (a compile whose dispatch is deferred until its
/// upload ends sits there with `available_at` in 9999) looks like any other in the `fair`
/// index, which cannot see the outbox; bounding the look keeps a claim's cost independent of
/// how many such jobs a tenant has. A tenant whose oldest jobs are all deferred gets its due
/// ones from the fill (oldest due first) until they are released.
const FAIR_SCAN: &str = "(2 * sh.n + 32)";

/// The claim: what is due, urgent first, new work round-robin between tenants, within the
/// window's room and each tenant's limit.
///
/// Each way a row comes due is its own index range scan locked with `SKIP LOCKED`, so a claim
/// costs the same on an outbox of a hundred due rows or of millions:
/// - rows a relay died holding (`stuck`) and rows whose visibility passed (`lost`) are already
///   in the window and are taken whatever the room, up to a quarter and an eighth of a batch;
///   a row is stuck once its lock ran out, or at once when its `locked_by` is a liveness holder
///   (`<id>#<8 hex>`, what a worker process's relay locks under) that `kfs_worker_alive` calls
///   dead (`dead_relays`, each distinct holder asked once): a relay killed between its claim
///   and its mark left nothing to wait for. Any other `locked_by` (a relay with no liveness
///   session) waits out its lock;
/// - the room is the window less what is published and not yet claimed (`dispatching` and
///   `dispatched` rows), at most a batch; taken-over rows (`expired`), then retries (`retry`,
///   the project's `urgent` index) use it first;
/// - new work then goes round-robin: a loose index scan over the kind's `fair` index lists the
///   tenants with never-dispatched jobs, starting after the tenant served last (`$6`) and
///   wrapping around, as many as there is room; each gets an equal share of the room, taken
///   from its oldest jobs in the same index;
/// - room the tenants did not use is filled from the oldest due rows (`fill`), which also
///   covers any row neither the `urgent` nor the `fair` index holds.
///
/// With limits, a tenant whose jobs in the window or running (`dispatching`, `dispatched`,
/// `leased`) reach `$7` gets no tenant slot, and no row of any class past its limit.
fn claim(spec: &KindSpec, revision: &str, limited: bool) -> String {
    let busy = if limited {
        "busy AS ( \
           SELECT j.tenant_id::text AS t, count(*) AS n FROM {outbox} o JOIN {job} j ON j.id = o.{fk} \
           WHERE o.status IN ('dispatching', 'dispatched', 'leased') GROUP BY 1 \
         ), "
    } else {
        ""
    };
    let open = |t: &str| {
        if limited {
            format!("AND NOT EXISTS (SELECT 1 FROM busy b WHERE b.t = {t} AND b.n >= $7)")
        } else {
            String::new()
        }
    };
    // The job `job` of a row is not its tenant's at the limit.
    let open_job = |job: &str| {
        format!(
            "NOT EXISTS (SELECT 1 FROM {{job}} j JOIN busy b ON b.t = j.tenant_id::text \
             WHERE j.id = {job} AND b.n >= $7)"
        )
    };
    let share = if limited {
        "least(sh.n, $7 - coalesce((SELECT b.n FROM busy b WHERE b.t = r.t), 0))"
    } else {
        "sh.n"
    };
    let admitted = if limited {
        "WHERE coalesce((SELECT b.n FROM busy b WHERE b.t = k.t), 0) + k.tr <= $7"
    } else {
        ""
    };
    // A tenant was at its limit, or rows were held back by it.
    let held = if limited {
        "(EXISTS (SELECT 1 FROM busy b WHERE b.n >= $7) OR EXISTS (SELECT 1 FROM ranked k \
           WHERE coalesce((SELECT b.n FROM busy b WHERE b.t = k.t), 0) + k.tr > $7))"
    } else {
        "false"
    };
    let fresh_ctes = match &spec.fairness {
        Some(f) => {
            let fresh = f.fresh;
            let (open_after, open_before) = (open("a.t"), open("b.t"));
            // Rows of tenants at their limit are left out before the fill's limit, or a held
            // tenant's oldest rows would take all of it. Which of them are held is read from
            // the oldest candidates only (a few batches), so a held tenant's backlog of new work
            // is never walked: that work is the round-robin's, and a row behind more than that
            // is reached as the rows before it leave.
            let open_fill = if limited {
                format!(
                    "AND o.id = ANY (ARRAY( \
                       SELECT c.id FROM ( \
                         SELECT o2.id, o2.{{fk}} AS job_id FROM {{outbox}} o2 \
                         WHERE o2.status = 'pending' AND o2.available_at <= {{now}} \
                           AND o2.id <> ALL (ARRAY(SELECT id FROM retry UNION ALL SELECT id FROM fair)) \
                         ORDER BY o2.available_at LIMIT $1 * 4 + 16 \
                       ) c WHERE {} \
                     ))",
                    open_job("c.job_id")
                )
            } else {
                String::new()
            };
            format!(
                "after(t) AS ( \
                   (SELECT j.tenant_id::text FROM {{job}} j WHERE {fresh} AND j.tenant_id > $6::text \
                    ORDER BY j.tenant_id LIMIT 1) \
                   UNION ALL \
                   SELECT (SELECT j.tenant_id::text FROM {{job}} j WHERE {fresh} AND j.tenant_id > a.t \
                           ORDER BY j.tenant_id LIMIT 1) \
                   FROM after a WHERE a.t IS NOT NULL \
                 ), before(t) AS ( \
                   (SELECT j.tenant_id::text FROM {{job}} j WHERE {fresh} ORDER BY j.tenant_id LIMIT 1) \
                   UNION ALL \
                   SELECT (SELECT j.tenant_id::text FROM {{job}} j WHERE {fresh} AND j.tenant_id > b.t \
                           ORDER BY j.tenant_id LIMIT 1) \
                   FROM before b WHERE b.t IS NOT NULL AND b.t < $6::text \
                 ), ring AS ( \
                   SELECT x.t, row_number() OVER () AS pos FROM ( \
                     (SELECT a.t FROM after a WHERE a.t IS NOT NULL {open_after} LIMIT (SELECT n FROM room)) \
                     UNION ALL \
                     (SELECT b.t FROM before b WHERE b.t IS NOT NULL AND b.t <= $6::text {open_before} \
                      LIMIT (SELECT n FROM room)) \
                     LIMIT (SELECT n FROM room) \
                   ) x \
                 ), share AS ( \
                   SELECT greatest(ceil(rm.n::numeric / greatest((SELECT count(*) FROM ring), 1)), 1)::bigint AS n \
                   FROM room rm \
                 ), fair AS ( \
                   SELECT x.id, x.job_id, x.created_at, r.t, r.pos FROM ring r CROSS JOIN share sh \
                   CROSS JOIN LATERAL ( \
                     SELECT o.id, o.{{fk}} AS job_id, j.created_at \
                     FROM ( \
                       SELECT j.id, j.created_at FROM {{job}} j WHERE j.tenant_id = r.t AND {fresh} \
                       ORDER BY j.created_at, j.id LIMIT {FAIR_SCAN} \
                     ) j JOIN {{outbox}} o ON o.{{fk}} = j.id \
                     WHERE o.status = 'pending' AND o.available_at <= {{now}} \
                       AND o.dispatch_attempts = 0 AND o.delivered_at IS NULL \
                     ORDER BY j.created_at, j.id LIMIT {share} \
                     FOR UPDATE OF o SKIP LOCKED \
                   ) x \
                 ), fill AS ( \
                   SELECT o.id, o.{{fk}} AS job_id, o.available_at FROM {{outbox}} o \
                   WHERE o.status = 'pending' AND o.available_at <= {{now}} \
                     AND o.id <> ALL (ARRAY(SELECT id FROM retry UNION ALL SELECT id FROM fair)) {open_fill} \
                   ORDER BY o.available_at \
                   LIMIT greatest((SELECT n FROM room) - (SELECT count(*) FROM retry) - (SELECT count(*) FROM fair), 0) \
                   FOR UPDATE OF o SKIP LOCKED \
                 ), gated AS ( \
                   SELECT id, {retry} AS class, available_at AS at, id AS k, \
                     (SELECT j.tenant_id::text FROM {{job}} j WHERE j.id = retry.job_id) AS t, 0::bigint AS pos FROM retry \
                   UNION ALL SELECT id, {fair_class}, created_at, job_id, t, pos FROM fair \
                   UNION ALL SELECT id, {fill}, available_at, id, \
                     (SELECT j.tenant_id::text FROM {{job}} j WHERE j.id = fill.job_id), 0::bigint FROM fill \
                 ), ",
                retry = class::RETRY,
                fair_class = class::FAIR,
                fill = class::FILL,
            )
        }
        None => format!(
            "fresh AS ( \
               SELECT o.id, o.available_at FROM {{outbox}} o \
               WHERE o.status = 'pending' AND o.available_at <= {{now}} \
                 AND o.id <> ALL (ARRAY(SELECT id FROM retry)) \
               ORDER BY o.available_at \
               LIMIT greatest((SELECT n FROM room) - (SELECT count(*) FROM retry), 0) \
               FOR UPDATE OF o SKIP LOCKED \
             ), gated AS ( \
               SELECT id, {retry} AS class, available_at AS at, id AS k, NULL::text AS t, 0::bigint AS pos FROM retry \
               UNION ALL SELECT id, {fair}, available_at, id, NULL::text, 0::bigint FROM fresh \
             ), ",
            retry = class::RETRY,
            fair = class::FAIR,
        ),
    };
    // A tenant-less kind has no limit: its busy CTE would count every row as one tenant's.
    let (busy, admitted, held) = if spec.fairness.is_some() {
        (busy, admitted, held)
    } else {
        ("", "", "false")
    };
    // Retries of tenants at their limit are left out before the retry's limit: taken first and
    // dropped after, a held tenant's due retries filled it at every claim, and no other
    // tenant's retry or continued slice was ever reached.
    let open_retry = if limited && spec.fairness.is_some() {
        format!("AND {}", open_job("{outbox}.{fk}"))
    } else {
        String::new()
    };
    format!(
        "WITH RECURSIVE free AS ( \
           SELECT greatest(least($1::bigint, $5::bigint - count(*)), 0) AS n, count(*) AS c \
           FROM {{outbox}} WHERE status IN ('dispatching', 'dispatched') \
         ), dead_relays AS MATERIALIZED ( \
           SELECT r.h FROM ( \
             SELECT DISTINCT locked_by AS h FROM {{outbox}} \
             WHERE status = 'dispatching' AND locked_until > {{now}} OFFSET 0 \
           ) r WHERE r.h <> $3 AND r.h ~ '#[0-9A-Fa-f]{{8}}$' AND NOT kfs_worker_alive(r.h) \
         ), stuck AS ( \
           SELECT id FROM {{outbox}} WHERE status = 'dispatching' \
             AND (locked_until <= {{now}} OR locked_by IN (SELECT h FROM dead_relays)) \
           ORDER BY locked_until LIMIT $1 / 4 + 1 FOR UPDATE SKIP LOCKED \
         ), lost AS ( \
           SELECT id FROM {{outbox}} WHERE status = 'dispatched' AND available_at <= {{now}} \
           ORDER BY available_at LIMIT $1 / 8 + 1 FOR UPDATE SKIP LOCKED \
         ), expired AS ( \
           SELECT id, available_at FROM {{outbox}} WHERE status = 'leased' AND available_at <= {{now}} \
           ORDER BY available_at LIMIT (SELECT n FROM free) FOR UPDATE SKIP LOCKED \
         ), room AS ( \
           SELECT greatest(f.n - (SELECT count(*) FROM expired), 0) AS n FROM free f \
         ), {busy}retry AS ( \
           SELECT id, {{fk}} AS job_id, available_at FROM {{outbox}} \
           WHERE status = 'pending' AND available_at <= {{now}} AND {URGENT_ROW} {open_retry} \
           ORDER BY available_at LIMIT (SELECT n FROM room) FOR UPDATE SKIP LOCKED \
         ), {fresh_ctes}ranked AS ( \
           SELECT g.*, row_number() OVER (PARTITION BY g.t ORDER BY g.class, g.at, g.k) AS tr, \
             row_number() OVER (PARTITION BY g.t, g.class ORDER BY g.at, g.k) AS rn \
           FROM (SELECT DISTINCT ON (id) * FROM gated ORDER BY id, class) g \
         ), taken AS ( \
           SELECT k.id, k.class, k.t, k.rn, k.pos, k.at, k.k FROM ranked k {admitted} \
           ORDER BY k.class, k.rn, k.pos, k.at, k.k LIMIT (SELECT n FROM room) \
         ), claimed AS ( \
           SELECT id, {republish} AS class, NULL::text AS t, 0::bigint AS ord FROM stuck \
           UNION ALL SELECT id, {republish}, NULL::text, 0::bigint FROM lost \
           UNION ALL SELECT id, {takeover}, NULL::text, row_number() OVER (ORDER BY available_at) FROM expired \
           UNION ALL SELECT id, class, t, row_number() OVER (ORDER BY class, rn, pos, at, k) FROM taken \
         ), upd AS ( \
           UPDATE {{outbox}} o SET status = 'dispatching', lock_token = $2, locked_by = $3, \
             locked_until = {{now+$4}}, dispatch_attempts = o.dispatch_attempts + 1, \
             queue_job_id = gen_random_uuid()::text, updated_at = {{now}} \
           WHERE o.id = ANY(ARRAY(SELECT id FROM claimed)) \
           RETURNING o.id, o.{{fk}} AS job_id, o.payload, o.queue_job_id, o.dispatch_attempts, \
             {revision} AS revision, o.schema_version \
         ) \
         SELECT u.id, u.job_id, u.payload, u.queue_job_id, u.dispatch_attempts, u.revision, u.schema_version, \
           c.class, c.t, f.n AS free, f.c AS in_window, {held} AS held \
         FROM free f LEFT JOIN (upd u JOIN claimed c ON c.id = u.id) ON true \
         ORDER BY c.class, c.ord",
        republish = class::REPUBLISH,
        takeover = class::TAKEOVER,
    )
}
