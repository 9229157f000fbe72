//! Jobs leased straight from Postgres, with no outbox and no queue: legacy space publication
//! bootstraps, profile backfills and page-index upgrade backfills. Invariant: the same
//! discipline as the outbox kinds — a claim takes a fresh lease token under `FOR UPDATE SKIP
//! LOCKED`, every step is one transaction fenced by lease token, row version and an unexpired
//! lease (wall clock), the heartbeat extends only a live lease, and zero rows changed means the
//! lease is lost and nothing more is written. Slices run in the engine's one slice runner
//! ([`runner::run_slice`]), so how a slice goes on or ends is decided by
//! [`after_step`](super::slice::after_step) as for every kind, retries follow the kind's
//! [`RetryPolicy`](super::retry::RetryPolicy), and a running job whose worker lost its liveness
//! lock ([`crate::liveness`]) is claimable at once.

use std::sync::Arc;
use std::time::Duration;

use sqlx::{Connection, PgConnection, PgPool, Postgres};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::kind::{JobCtx, JobError, Kind, Policy, Step};
use super::lease::{millis, End, LEASE_CLEAR};
use super::runner::{self, CrashPoints, Env, Heartbeat, Transitions, LEASE_LOST};
use super::slice::Budget;

/// A job claimed from a leased table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub job_id: Uuid,
    pub lease_token: Uuid,
    /// The row version after the claim; every fenced write compares and bumps it.
    pub row_version: i32,
    /// The checkpoint (bootstrap) or the run state (kinds without a checkpoint).
    pub checkpoint: String,
    /// This run's attempt, counting from 1, and the most allowed.
    pub attempt: i32,
    pub max_attempts: i32,
    pub worker_id: String,
    /// The job was taken over from a worker that died or lost its lease.
    pub taken_over: bool,
}

/// One leased job kind: its table, which of its rows are claimable, its steps and what each
/// end writes. The claim, the fence, the checkpoint, the heartbeat, the end and the release
/// are the engine's ([`claim`], [`end`], [`release_own`] and the slice runner): a kind gives
/// the facts of its table, never a statement of its own for them.
#[async_trait::async_trait]
pub trait LeasedKind: Send + Sync + 'static {
    /// Short name used on the command line, in status and in metrics.
    fn name(&self) -> &'static str;
    /// The job table; it has `id`, `run_state`, `row_version`, `updated_at`, `completed_at`,
    /// `last_error_code`, `last_error_message` and the four lease columns.
    fn table(&self) -> &'static str;
    /// The table has a `checkpoint` column that [`advance`] moves; without one a step that goes
    /// on only re-checks the lease.
    fn has_checkpoint(&self) -> bool {
        true
    }
    /// Every `run_state` the table allows: the label values of its job gauge.
    fn states(&self) -> &'static [&'static str];
    /// Every `checkpoint` the table allows (none without one): the label values of its
    /// checkpoint gauge.
    fn checkpoints(&self) -> &'static [&'static str] {
        &[]
    }
    fn policy(&self) -> &Policy;
    /// Which rows a claim takes, and what it writes on them besides the lease.
    fn claim_rule(&self) -> ClaimRule;
    /// Work before each claim, on its own (a discovery of new jobs, say). Default: none.
    async fn before_claim(&self, _conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        Ok(())
    }
    /// One step, inside the transaction that [`fence`] opened; its writes commit together with
    /// the checkpoint it returns, or not at all.
    async fn step(&self, tx: &mut PgConnection, job: &Lease) -> Result<Step, JobError>;
    /// Work a step needs that may take longer than a transaction may stay open (model calls),
    /// before the step's fence, outside any transaction, while the heartbeat extends the lease;
    /// as [`crate::engine::kind::Handler::prepare`]. Runs only where [`LeasedKind::prepares`]
    /// says so. Default: nothing.
    async fn prepare(&self, _conn: &mut PgConnection, _job: &Lease) -> Result<(), JobError> {
        Ok(())
    }
    /// Whether [`LeasedKind::prepare`] has work before this step (no I/O). Default: no.
    fn prepares(&self, _job: &Lease) -> bool {
        false
    }
    /// What the end of a slice writes besides clearing the lease.
    fn end_write(&self, job: &Lease, end: &End) -> EndWrite;

    /// Claims the most overdue claimable job, in one committed transaction.
    async fn claim(
        &self,
        conn: &mut PgConnection,
        worker_id: &str,
    ) -> Result<Option<Lease>, sqlx::Error> {
        claim(conn, self, worker_id).await
    }
    /// Writes the end of a slice, fenced by lease token and row version. `false`: the lease was
    /// lost and nothing was written.
    async fn end(
        &self,
        conn: &mut PgConnection,
        job: &Lease,
        end: &End,
    ) -> Result<bool, sqlx::Error> {
        self::end(conn, self, job, end).await
    }
    /// Ends the leases of earlier incarnations of `worker_id`'s id (a dead predecessor's, see
    /// [`crate::liveness::EARLIER_INCARNATIONS`]), so that a restart under the same id takes
    /// its jobs back at once.
    async fn release_own(
        &self,
        conn: &mut PgConnection,
        worker_id: &str,
    ) -> Result<u64, sqlx::Error> {
        release_own(conn, self.table(), worker_id).await
    }
}

/// Which rows of a leased table a claim takes. Each SQL fragment may name the candidate row
/// `j` and use `$4`, bound to [`ClaimRule::param`]; the fragments of the update and its
/// `RETURNING` may also name the candidate's selection `c` (with `c.was`, its run state
/// before).
pub struct ClaimRule {
    /// The claimable rows: a condition on `j`. Rows are taken oldest `updated_at` first, under
    /// `FOR UPDATE SKIP LOCKED`.
    pub claimable: String,
    /// More columns of the selection `c`, each as `, <expr> AS <name>`; empty for none.
    pub select: String,
    /// More assignments of the claim, each as `, <column> = <expr>`; empty for none.
    pub set: String,
    /// The attempt this claim starts, counting from 1 (an `int` expression).
    pub attempt: &'static str,
    /// The most attempts (an `int` expression); `None`: the kind's policy.
    pub max_attempts: Option<&'static str>,
    /// The value of `$4` (and of `$3` in [`Exhausted::rows`]).
    pub param: Param,
    /// Rows failed before each claim because they may not run again.
    pub exhausted: Option<Exhausted>,
}

/// The rows a claim fails first: attempts used up, a dead holder or none.
pub struct Exhausted {
    /// A condition on `j`; `$3` is [`ClaimRule::param`].
    pub rows: String,
    pub code: &'static str,
    pub message: &'static str,
}

/// A running row `j` whose holder is gone: its lease ran out, or its worker lost its liveness
/// lock. Such a row is claimable again (or, out of attempts, failed) in every leased table.
pub const HOLDER_GONE: &str = "(j.lease_expires_at <= now() OR NOT kfs_worker_alive(j.worker_id))";

/// The one kind-specific value of a claim.
#[derive(Clone, Debug)]
pub enum Param {
    Int(i32),
    BigInt(i64),
    BigInts(Vec<i64>),
}

/// What an end writes besides clearing the lease: assignments that may use `$4` and `$5`
/// (text), `$6` (int) and `$7` (bigint).
#[derive(Clone, Debug, Default)]
pub struct EndWrite {
    pub set: String,
    pub text4: Option<String>,
    pub text5: Option<String>,
    pub int6: i32,
    pub bigint7: i64,
}

/// The fence of every write: our token, our row version, a live lease by the wall clock.
const FENCE: &str = "id = $1 AND lease_token = $2 AND row_version = $3 AND run_state = 'running' \
                     AND lease_expires_at > clock_timestamp()";

fn bind_param<'q, O>(
    q: sqlx::query::QueryAs<'q, Postgres, O, sqlx::postgres::PgArguments>,
    p: &Param,
) -> sqlx::query::QueryAs<'q, Postgres, O, sqlx::postgres::PgArguments> {
    match p {
        Param::Int(v) => q.bind(*v),
        Param::BigInt(v) => q.bind(*v),
        Param::BigInts(v) => q.bind(v.clone()),
    }
}

/// What a [`Lease`] carries as its checkpoint: the `checkpoint` column (of the row named by
/// `alias`, `j.` or none), or the run state for kinds without one.
fn checkpoint_of<K: LeasedKind + ?Sized>(kind: &K, alias: &str) -> String {
    if kind.has_checkpoint() {
        format!("{alias}checkpoint::text")
    } else {
        "'running'::text".to_owned()
    }
}

/// Claims the most overdue claimable job of `kind`, in one committed transaction: first fails
/// the rows that may not run again, then takes one row under `FOR UPDATE SKIP LOCKED` with a
/// fresh lease token.
pub async fn claim<K: LeasedKind + ?Sized>(
    conn: &mut PgConnection,
    kind: &K,
    worker_id: &str,
) -> Result<Option<Lease>, sqlx::Error> {
    kind.before_claim(conn).await?;
    let rule = kind.claim_rule();
    let table = kind.table();
    let mut tx = conn.begin().await?;
    if let Some(ex) = &rule.exhausted {
        let sql = format!(
            "WITH f AS (UPDATE {table} j SET run_state = 'failed', {LEASE_CLEAR}, completed_at = now(), \
               last_error_code = $1, last_error_message = $2, \
               row_version = j.row_version + 1, updated_at = now() \
             WHERE {rows} RETURNING 1) SELECT count(*) FROM f",
            rows = ex.rows
        );
        let q = sqlx::query_as::<_, (i64,)>(&sql)
            .bind(ex.code)
            .bind(ex.message);
        bind_param(q, &rule.param).fetch_one(&mut *tx).await?;
    }
    let token = Uuid::new_v4();
    let checkpoint = checkpoint_of(kind, "j.");
    let max = rule.max_attempts.unwrap_or("$5::int");
    let sql = format!(
        "WITH c AS ( \
           SELECT j.id, j.run_state::text AS was{select} FROM {table} j \
           WHERE ({claimable}) \
           ORDER BY j.updated_at, j.id LIMIT 1 FOR UPDATE OF j SKIP LOCKED \
         ) \
         UPDATE {table} j SET run_state = 'running', worker_id = $1, lease_token = $2, \
           lease_expires_at = now() + $3::bigint * interval '1 millisecond', heartbeat_at = now(){set}, \
           row_version = j.row_version + 1, updated_at = now() \
         FROM c WHERE j.id = c.id \
         RETURNING j.id, j.row_version, {checkpoint}, ({attempt})::int, ({max})::int, c.was",
        select = rule.select,
        claimable = rule.claimable,
        set = rule.set,
        attempt = rule.attempt,
    );
    let q = sqlx::query_as::<_, (Uuid, i32, String, i32, i32, String)>(&sql)
        .bind(worker_id)
        .bind(token)
        .bind(millis(kind.policy().lease));
    let row = bind_param(q, &rule.param)
        .bind(kind.policy().max_attempts)
        .fetch_optional(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(row.map(
        |(id, row_version, checkpoint, attempt, max_attempts, was)| Lease {
            job_id: id,
            lease_token: token,
            row_version,
            checkpoint,
            attempt,
            max_attempts,
            worker_id: worker_id.to_owned(),
            taken_over: was == "running",
        },
    ))
}

/// Writes the end of a slice of `kind`, fenced by lease token and row version, and clears the
/// lease. `false`: the lease was lost and nothing was written.
pub async fn end<K: LeasedKind + ?Sized>(
    conn: &mut PgConnection,
    kind: &K,
    job: &Lease,
    end: &End,
) -> Result<bool, sqlx::Error> {
    let w = kind.end_write(job, end);
    let done = sqlx::query(&format!(
        "UPDATE {table} SET {set}, {LEASE_CLEAR}, row_version = row_version + 1, updated_at = now() \
         WHERE {FENCE}",
        table = kind.table(),
        set = w.set,
    ))
    .bind(job.job_id)
    .bind(job.lease_token)
    .bind(job.row_version)
    .bind(w.text4)
    .bind(w.text5)
    .bind(w.int6)
    .bind(w.bigint7)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Puts back in the queue the jobs of `table` still running under `worker_id`: not a failure
/// of the job, the process that held it is gone and this one replaces it (the attempt it used
/// stays used, as a crash's does).
pub async fn release_own(
    conn: &mut PgConnection,
    table: &str,
    worker_id: &str,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(&format!(
        "UPDATE {table} SET run_state = 'queued', {LEASE_CLEAR}, row_version = row_version + 1, updated_at = now() \
         WHERE {} AND run_state = 'running'",
        crate::liveness::EARLIER_INCARNATIONS.replace("j.", "")
    ))
    .bind(worker_id)
    .bind(crate::liveness::id_of(worker_id))
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// Locks the job row for one step and checks that the lease is still ours. Returns the new row
/// version, or `None` when the lease is lost.
///
/// Like the consumer's fence, it sets the transaction's `idle_in_transaction_session_timeout`
/// to the kind's `lease`.
pub async fn fence(
    tx: &mut PgConnection,
    table: &str,
    job: &Lease,
    lease: std::time::Duration,
) -> Result<Option<i32>, sqlx::Error> {
    let row: Option<(i32, String)> = sqlx::query_as(&format!(
        "UPDATE {table} SET row_version = row_version + 1, updated_at = now() WHERE {FENCE} \
         RETURNING row_version, set_config('idle_in_transaction_session_timeout', $4, true)"
    ))
    .bind(job.job_id)
    .bind(job.lease_token)
    .bind(job.row_version)
    .bind(super::lease::idle_timeout(lease))
    .fetch_optional(tx)
    .await?;
    Ok(row.map(|(rv, _)| rv))
}

/// Moves the checkpoint right after [`fence`] in the same transaction, checking once more that
/// the lease has not run out meanwhile. `false`: it has; roll back.
pub async fn advance(
    tx: &mut PgConnection,
    kind: &dyn LeasedKind,
    job: &Lease,
    checkpoint: &str,
) -> Result<bool, sqlx::Error> {
    let table = kind.table();
    let sql = if kind.has_checkpoint() {
        format!("UPDATE {table} SET checkpoint = $4 WHERE {FENCE} AND checkpoint IS NOT NULL")
    } else {
        format!("UPDATE {table} SET updated_at = updated_at WHERE {FENCE} AND $4::text IS NOT NULL")
    };
    let done = sqlx::query(&sql)
        .bind(job.job_id)
        .bind(job.lease_token)
        .bind(job.row_version)
        .bind(checkpoint)
        .execute(tx)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// Extends the lease. Does not bump `row_version`, so it never races the worker's own steps.
/// `false`: the lease is lost.
pub async fn heartbeat(
    conn: &mut PgConnection,
    table: &str,
    job: &Lease,
    lease: Duration,
) -> Result<bool, sqlx::Error> {
    extend(conn, table, job.job_id, job.lease_token, lease).await
}

async fn extend(
    conn: &mut PgConnection,
    table: &str,
    job_id: Uuid,
    lease_token: Uuid,
    lease: Duration,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(&format!(
        "UPDATE {table} SET lease_expires_at = now() + $3::bigint * interval '1 millisecond', \
           heartbeat_at = now() \
         WHERE id = $1 AND lease_token = $2 AND run_state = 'running' AND lease_expires_at > clock_timestamp()"
    ))
    .bind(job_id)
    .bind(lease_token)
    .bind(millis(lease))
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// How one slice ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The end was written (its name: succeeded, failed, wait, continue, ...).
    Ended(&'static str),
    /// The lease was lost; nothing more was written.
    LeaseLost,
    /// Shutdown came before the slice's end committed; the lease runs out by itself.
    Interrupted(String),
}

/// Claims one job of `kind` and runs one slice of it. `None`: nothing was claimable.
pub async fn run_once(
    pool: &PgPool,
    kind: &dyn LeasedKind,
    worker_id: &str,
    budget: Budget,
) -> Result<Option<(Lease, Outcome)>, sqlx::Error> {
    let claimed = {
        let mut conn = crate::db::acquire(pool).await?;
        kind.claim(&mut conn, worker_id).await?
    };
    let Some(job) = claimed else {
        return Ok(None);
    };
    crate::crash::point("leased-after-claim-commit");
    if job.taken_over {
        crate::metrics::takeover(kind.name(), None);
    }
    let outcome = run_slice(pool, kind, job.clone(), budget, &CancellationToken::new()).await;
    Ok(Some((job, outcome)))
}

/// The crash points a leased slice passes through.
static POINTS: CrashPoints = CrashPoints {
    after_step: "leased-after-step-commit",
    after_end: None,
    before_end: Some("leased-before-end-commit"),
};

/// Runs steps of a claimed job until its slice ends, through the engine's one slice runner,
/// with a heartbeat alongside. Database trouble is retried until `shutdown`.
pub async fn run_slice(
    pool: &PgPool,
    kind: &dyn LeasedKind,
    job: Lease,
    budget: Budget,
    shutdown: &CancellationToken,
) -> Outcome {
    let slice = LeasedSlice {
        kind,
        worker_id: job.worker_id.clone(),
        taken_over: job.taken_over,
    };
    let env = Env {
        pool,
        heartbeat_pool: pool,
        budget,
        shutdown,
        points: &POINTS,
        keep_connection: false,
    };
    match runner::run_slice(&slice, slice.ctx(job), None, env).await {
        Some(LEASE_LOST) => Outcome::LeaseLost,
        Some(end) => Outcome::Ended(end),
        None => {
            tracing::warn!(
                kind = kind.name(),
                "leased slice interrupted by shutdown; its lease runs out by itself"
            );
            Outcome::Interrupted("shutting down".into())
        }
    }
}

/// A leased job as the slice runner sees it: its [`Lease`] carried in a [`JobCtx`].
struct LeasedSlice<'a> {
    kind: &'a dyn LeasedKind,
    worker_id: String,
    taken_over: bool,
}

impl LeasedSlice<'_> {
    fn ctx(&self, l: Lease) -> JobCtx {
        JobCtx {
            kind: Kind::new(self.kind.name()),
            job_id: l.job_id,
            outbox_id: Uuid::nil(),
            delivery_id: String::new(),
            lease_token: l.lease_token,
            row_version: l.row_version,
            checkpoint: l.checkpoint,
            execution_attempts: l.attempt,
            max_execution_attempts: l.max_attempts,
            worker_id: l.worker_id,
            // Claimed just before its slice runs.
            renewed: std::time::Instant::now(),
        }
    }

    fn lease(&self, job: &JobCtx) -> Lease {
        Lease {
            job_id: job.job_id,
            lease_token: job.lease_token,
            row_version: job.row_version,
            checkpoint: job.checkpoint.clone(),
            attempt: job.execution_attempts,
            max_attempts: job.max_execution_attempts,
            worker_id: self.worker_id.clone(),
            taken_over: self.taken_over,
        }
    }
}

#[async_trait::async_trait]
impl Transitions for LeasedSlice<'_> {
    fn kind_name(&self) -> &'static str {
        self.kind.name()
    }

    fn policy(&self) -> Policy {
        *self.kind.policy()
    }

    async fn fence(&self, tx: &mut PgConnection, job: &JobCtx) -> Result<Option<i32>, sqlx::Error> {
        fence(
            tx,
            self.kind.table(),
            &self.lease(job),
            self.kind.policy().lease,
        )
        .await
    }

    async fn step(&self, tx: &mut PgConnection, job: &JobCtx) -> Result<Step, JobError> {
        self.kind.step(tx, &self.lease(job)).await
    }

    fn prepares(&self, job: &JobCtx) -> bool {
        self.kind.prepares(&self.lease(job))
    }

    async fn prepare(&self, conn: &mut PgConnection, job: &JobCtx) -> Result<(), JobError> {
        self.kind.prepare(conn, &self.lease(job)).await
    }

    async fn advance(
        &self,
        tx: &mut PgConnection,
        job: &JobCtx,
        checkpoint: &str,
    ) -> Result<Option<i32>, sqlx::Error> {
        // The checkpoint write does not bump the row version: the fence did.
        Ok(advance(tx, self.kind, &self.lease(job), checkpoint)
            .await?
            .then_some(job.row_version))
    }

    async fn end(
        &self,
        tx: &mut PgConnection,
        job: &JobCtx,
        end: &End,
    ) -> Result<bool, sqlx::Error> {
        self.kind.end(tx, &self.lease(job), end).await
    }

    async fn resync(
        &self,
        conn: &mut PgConnection,
        job: &JobCtx,
    ) -> Result<Option<(i32, String)>, sqlx::Error> {
        let checkpoint = checkpoint_of(self.kind, "");
        sqlx::query_as(&format!(
            "SELECT row_version, {checkpoint} FROM {table} \
             WHERE id = $1 AND lease_token = $2 AND run_state = 'running' AND lease_expires_at > clock_timestamp()",
            table = self.kind.table()
        ))
        .bind(job.job_id)
        .bind(job.lease_token)
        .fetch_optional(conn)
        .await
    }

    fn heartbeat(&self) -> Arc<dyn Heartbeat> {
        Arc::new(Beat {
            table: self.kind.table(),
            lease: self.kind.policy().lease,
        })
    }
}

/// Extends a leased job's lease.
struct Beat {
    table: &'static str,
    lease: Duration,
}

#[async_trait::async_trait]
impl Heartbeat for Beat {
    async fn extend(&self, conn: &mut PgConnection, job: &JobCtx) -> Result<bool, sqlx::Error> {
        extend(conn, self.table, job.job_id, job.lease_token, self.lease).await
    }
}
