//! The one slice runner: fence → step → commit, until the slice ends, with a heartbeat beside
//! it. Both intakes run their jobs here; what differs between table shapes is behind
//! [`Transitions`]. Invariant: a slice returns how it ended only once that end has committed,
//! or once the lease is proven lost (then nothing more is written); a commit whose outcome is
//! unknown is settled by reading the job row back; database trouble is retried with backoff,
//! never turned into an end; and shutdown before the deciding commit returns `None`, so the
//! intake does not settle the job (the delivery is not acked, the lease runs out); a
//! heartbeat never waits for its own job's row lock on a connection (it waits for the step's
//! commit on the slice's [`StepGate`]), so no beat queues behind another job's step.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::backoff::retry_pause;
use super::kind::{JobCtx, JobError, Policy, Step};
use super::lease::End;
use super::slice::{self, Budget, Next, Progress};
use crate::crash;
use crate::db::within;

/// Every fenced transition of a claimed job of one table shape, and the kind's step. Fence,
/// advance and end compare the lease token and row version against an unexpired lease by the
/// database's wall clock; zero rows changed (`None` / `false`) means the lease is lost.
#[async_trait::async_trait]
pub trait Transitions: Send + Sync {
    /// The kind's name, for logs and metrics.
    fn kind_name(&self) -> &'static str;
    fn policy(&self) -> Policy;
    /// Locks the job row for one step; returns the row version the step runs at.
    async fn fence(&self, tx: &mut PgConnection, job: &JobCtx) -> Result<Option<i32>, sqlx::Error>;
    /// The kind's step, inside the transaction [`Transitions::fence`] opened.
    async fn step(&self, tx: &mut PgConnection, job: &JobCtx) -> Result<Step, JobError>;
    /// Moves the checkpoint after the fence, in the same transaction; returns the new row
    /// version.
    async fn advance(
        &self,
        tx: &mut PgConnection,
        job: &JobCtx,
        checkpoint: &str,
    ) -> Result<Option<i32>, sqlx::Error>;
    /// Writes the end of the slice and clears the lease.
    async fn end(
        &self,
        tx: &mut PgConnection,
        job: &JobCtx,
        end: &End,
    ) -> Result<bool, sqlx::Error>;
    /// The kind's own record of an end written on its own (a failure, a scheduled retry), in
    /// the transaction of that end, after it. The default records nothing.
    async fn record_end(
        &self,
        _tx: &mut PgConnection,
        _job: &JobCtx,
        _end: &End,
    ) -> Result<(), sqlx::Error> {
        Ok(())
    }
    /// Reads the job row back after a step whose outcome is unknown: `Some((row version,
    /// checkpoint))` while the lease is still ours and live, `None` when it is not.
    async fn resync(
        &self,
        conn: &mut PgConnection,
        job: &JobCtx,
    ) -> Result<Option<(i32, String)>, sqlx::Error>;
    /// The heartbeat of this shape, owned, so it can run beside the slice.
    fn heartbeat(&self) -> Arc<dyn Heartbeat>;
    /// Called after a step's checkpoint committed, before the next fence. Default: nothing.
    async fn after_step_commit(&self, _job: &JobCtx) {}
    /// Whether the kind has work before this step's fence ([`Transitions::prepare`]).
    /// Default: no.
    fn prepares(&self, _job: &JobCtx) -> bool {
        false
    }
    /// The kind's work before a step's fence, outside any transaction
    /// ([`super::kind::Handler::prepare`]). Default: nothing.
    async fn prepare(&self, _conn: &mut PgConnection, _job: &JobCtx) -> Result<(), JobError> {
        Ok(())
    }
}

/// Extends a live lease. Does not bump the row version, so it never races the steps.
#[async_trait::async_trait]
pub trait Heartbeat: Send + Sync + 'static {
    /// `false`: the lease is lost.
    async fn extend(&self, conn: &mut PgConnection, job: &JobCtx) -> Result<bool, sqlx::Error>;
}

/// What a slice runs with.
#[derive(Clone, Copy)]
pub struct Env<'a> {
    /// Where the slice takes a connection when it has none, and where it resynchronises.
    pub pool: &'a PgPool,
    /// Where heartbeats take theirs: never the slices' pool, whose connections the slices hold
    /// for their whole length.
    pub heartbeat_pool: &'a PgPool,
    pub budget: Budget,
    pub shutdown: &'a CancellationToken,
    /// The crash points this intake's slices pass through.
    pub points: &'static CrashPoints,
    /// Whether the slice keeps its connection from step to step (a delivery, which claimed on
    /// it), or gives it back to the pool after each committed step (a polled lease, whose
    /// heartbeats share that pool).
    pub keep_connection: bool,
}

/// The names of a slice's crash points (see [`crate::crash`]); `None`: not a point here.
#[derive(Debug)]
pub struct CrashPoints {
    /// After a step's checkpoint committed.
    pub after_step: &'static str,
    /// After the slice's end committed.
    pub after_end: Option<&'static str>,
    /// Before the commit of a step that ends the slice.
    pub before_end: Option<&'static str>,
}

/// A connection a job holds from its claim to the end of its slice; `None` takes one.
pub type Slot = Option<sqlx::pool::PoolConnection<sqlx::Postgres>>;

/// The name a slice ends with when the lease was lost.
pub const LEASE_LOST: &str = "lease_lost";

/// Runs steps until the slice ends. Returns how it ended ([`LEASE_LOST`] when fenced out), or
/// `None` when shutdown interrupted it before its end committed.
pub async fn run_slice(
    tr: &dyn Transitions,
    mut job: JobCtx,
    mut conn: Slot,
    env: Env<'_>,
) -> Option<&'static str> {
    let policy = tr.policy();
    let name = tr.kind_name();
    // No call of a slice waits on Postgres longer than its lease: past it, the lease is gone
    // and what the call would have written is refused anyway.
    let limit = policy.lease;
    let lost = CancellationToken::new();
    let gate = StepGate::default();
    let _heartbeat = HeartbeatGuard::start(
        env.heartbeat_pool.clone(),
        job.clone(),
        policy,
        lost.clone(),
        tr.heartbeat(),
        gate.clone(),
    );
    let started = Instant::now();
    let mut steps_done = 0u32;
    // Set when the connection failed: a fresh one is taken at the next step.
    let mut broken = false;
    // Database calls retried in a row, for the backoff; reset by each committed step.
    let mut tries = 0u32;
    loop {
        if lost.is_cancelled() {
            return Some(lease_lost(name, &job));
        }
        if std::mem::take(&mut broken) {
            conn = None;
        }
        // The kind's long work for this step, outside any transaction: the heartbeat goes on
        // extending the lease meanwhile. Its error is the step's. Only a kind that has such
        // work takes a connection here, outside the gate: where slices and beats share one
        // small pool (the polled leases), a slice holding the connection while it waits for the
        // gate, and a beat holding the gate while it waits for a connection, would stall each
        // other.
        let prepared = if tr.prepares(&job) {
            tokio::select! {
                biased;
                () = lost.cancelled() => return Some(lease_lost(name, &job)),
                p = prepare(tr, env.pool, &mut conn, &job) => p,
            }
        } else {
            Ok(Ok(()))
        };
        let prepared = match prepared {
            Ok(p) => p,
            Err(e) => {
                broken = true;
                tries += 1;
                tracing::warn!(error = %e, tries, "cannot prepare a step; retrying");
                if !pause(tries, env.shutdown).await {
                    return None;
                }
                continue;
            }
        };
        // Held while this step's transaction is open: the heartbeat waits for it here, on no
        // connection, instead of on the row lock the fence takes.
        let held = gate.hold().await;
        let mut tx = match within(limit, begin(env.pool, &mut conn)).await {
            Ok(tx) => tx,
            Err(e) => {
                drop(held);
                broken = true;
                tries += 1;
                tracing::warn!(error = %e, tries, "cannot begin a step; retrying");
                if !pause(tries, env.shutdown).await {
                    return None;
                }
                continue;
            }
        };
        let rv_before = job.row_version;
        let fenced = match within(limit, tr.fence(&mut tx, &job)).await {
            Ok(Some(rv)) => rv,
            Ok(None) => return Some(lease_lost(name, &job)),
            Err(e) => {
                drop(tx);
                drop(held);
                conn = None;
                tries += 1;
                tracing::warn!(error = %e, tries, "fence failed; retrying");
                if !pause(tries, env.shutdown).await {
                    return None;
                }
                continue;
            }
        };
        job.row_version = fenced;
        // A panic in the step is its failure, settled like any other (see `unwind`).
        let stepped = super::unwind::step(async {
            match prepared {
                Ok(()) => tr.step(&mut tx, &job).await,
                Err(e) => Err(e),
            }
        })
        .instrument(tracing::info_span!(
            "step",
            kind = name,
            job_id = %job.job_id,
            checkpoint = %job.checkpoint,
            attempt = job.execution_attempts,
        ));
        let Ok(result) = tokio::time::timeout(limit, stepped).await else {
            // The step's connection went silent: whatever it wrote is not committed.
            drop(tx);
            drop(held);
            conn = None;
            tries += 1;
            tracing::warn!(kind = name, job_id = %job.job_id, tries, "a step got no answer from Postgres within its lease; resynchronising");
            match recover(tr, env, &mut job, tries).await {
                Some(end) => return end,
                None => continue,
            }
        };
        steps_done += 1;
        let progress = Progress {
            steps_done,
            elapsed: started.elapsed(),
            attempts: job.execution_attempts,
            max_attempts: job.max_execution_attempts,
        };
        let next = slice::after_step(result, progress, env.budget, policy.retry, rand::random());
        // Errors before `commit()` are certain: the transaction rolled back. Only a failing
        // `commit()` leaves the outcome unknown.
        let commit_span = match &next {
            Next::Step(_) => tracing::info_span!("commit_step", kind = name, job_id = %job.job_id),
            Next::End { end, .. } | Next::Abort(end) => {
                tracing::info_span!("end_slice", kind = name, job_id = %job.job_id, end = end.name())
            }
        };
        // The row version after this step's checkpoint write, when it made one.
        let mut advanced = fenced;
        let committed: Result<Option<&'static str>, StepError> = async {
            match &next {
                Next::Step(cp) => {
                    let Some(rv) = within(limit, tr.advance(&mut tx, &job, cp))
                        .await
                        .map_err(StepError::Certain)?
                    else {
                        return Ok(Some(LEASE_LOST));
                    };
                    advanced = rv;
                    within(limit, tx.commit())
                        .await
                        .map_err(StepError::Uncertain)?;
                    Ok(None)
                }
                Next::End { checkpoint, end } => {
                    let mut ending = std::borrow::Cow::Borrowed(&job);
                    if let Some(cp) = checkpoint {
                        let Some(rv) = within(limit, tr.advance(&mut tx, &job, cp))
                            .await
                            .map_err(StepError::Certain)?
                        else {
                            return Ok(Some(LEASE_LOST));
                        };
                        ending.to_mut().row_version = rv;
                    }
                    if !within(limit, tr.end(&mut tx, &ending, end))
                        .await
                        .map_err(StepError::Certain)?
                    {
                        return Ok(Some(LEASE_LOST));
                    }
                    if let Some(p) = env.points.before_end {
                        crash::point(p);
                    }
                    within(limit, tx.commit())
                        .await
                        .map_err(StepError::Uncertain)?;
                    Ok(Some(end.name()))
                }
                Next::Abort(_) => {
                    // The step's writes are dropped; its end is written below, on its own.
                    within(limit, tx.rollback())
                        .await
                        .map_err(StepError::Certain)?;
                    Ok(None)
                }
            }
        }
        .instrument(commit_span.clone())
        .await;
        let committed = match (&next, committed) {
            (Next::Abort(end), Ok(_)) => {
                job.row_version = rv_before;
                let written = write_end(tr, env.pool, &mut conn, &job, end)
                    .instrument(commit_span)
                    .await;
                if let (
                    Ok(Some(ended)),
                    End::Fail { code, message } | End::Wait { code, message, .. },
                ) = (&written, end)
                {
                    if *ended != LEASE_LOST {
                        tracing::warn!(kind = name, job_id = %job.job_id, code, message, end = end.name(), "step did not finish");
                    }
                }
                written
            }
            (_, c) => c,
        };
        drop(held);
        match committed {
            Ok(None) => {
                crash::point(env.points.after_step);
                tries = 0;
                if !env.keep_connection {
                    conn = None;
                }
                if let Next::Step(cp) = next {
                    job.checkpoint = cp;
                    job.row_version = advanced;
                    tr.after_step_commit(&job).await;
                }
            }
            Ok(Some(LEASE_LOST)) => return Some(lease_lost(name, &job)),
            Ok(Some(end)) => {
                if let Some(p) = env.points.after_end {
                    crash::point(p);
                }
                tracing::debug!(kind = name, job_id = %job.job_id, end, steps = steps_done, "slice ended");
                crate::metrics::slice(name, end, started.elapsed());
                if matches!(&next, Next::Abort(End::Wait { refund: false, .. })) {
                    crate::metrics::retry(name);
                }
                return Some(end);
            }
            Err(StepError::Certain(e)) if !crate::db::is_retryable(&e) => {
                // A write of this step broke a rule of the database (a CHECK, a length):
                // running it again would fail the same way. Fail the job instead.
                job.row_version = rv_before;
                let code = e
                    .as_database_error()
                    .and_then(|d| d.code())
                    .map_or("db_error".to_owned(), |c| format!("db_{c}"));
                tracing::error!(kind = name, job_id = %job.job_id, error = %e, "a step's write was refused; failing the job");
                let end = End::Fail {
                    code,
                    message: e.to_string(),
                };
                // The failure is written, or the lease is proven lost, before the slice
                // returns: never an ack without its deciding commit. While the failure cannot
                // be written (Postgres away, say) the slice waits.
                let mut tries = 0u32;
                return loop {
                    let held = gate.hold().await;
                    let written = write_end(tr, env.pool, &mut conn, &job, &end).await;
                    drop(held);
                    match written {
                        Ok(Some(LEASE_LOST)) => break Some(lease_lost(name, &job)),
                        Ok(Some(ended)) => {
                            crate::metrics::slice(name, ended, started.elapsed());
                            break Some(ended);
                        }
                        Ok(None) => break None,
                        Err(e) => {
                            tries += 1;
                            conn = None;
                            tracing::warn!(kind = name, job_id = %job.job_id, error = %e, tries, "cannot record the failure yet; retrying");
                            if !pause(tries, env.shutdown).await {
                                break None;
                            }
                        }
                    }
                };
            }
            Err(StepError::Certain(e) | StepError::Uncertain(e)) => {
                // Connection trouble, or a commit whose outcome is unknown. Find out from the
                // row itself: while our lease token is on a live row, only we can have written
                // it.
                conn = None;
                tries += 1;
                tracing::warn!(kind = name, job_id = %job.job_id, error = %e, tries, "step not confirmed; resynchronising");
                if let Some(end) = recover(tr, env, &mut job, tries).await {
                    return end;
                }
            }
        }
    }
}

/// After connection trouble mid-step: waits, then reads the job row back. `None`: the lease is
/// still ours, go on from the row's checkpoint; `Some(end)`: the slice ends so.
async fn recover(
    tr: &dyn Transitions,
    env: Env<'_>,
    job: &mut JobCtx,
    tries: u32,
) -> Option<Option<&'static str>> {
    if !pause(tries, env.shutdown).await {
        return Some(None);
    }
    match resync(tr, env, job).await {
        Resync::Ours {
            row_version,
            checkpoint,
        } => {
            job.row_version = row_version;
            job.checkpoint = checkpoint;
            None
        }
        Resync::Lost => Some(Some(lease_lost(tr.kind_name(), job))),
        Resync::Shutdown => Some(None),
    }
}

/// Writes an end of slice in its own transaction, with the kind's record of it.
async fn write_end(
    tr: &dyn Transitions,
    pool: &PgPool,
    conn: &mut Slot,
    job: &JobCtx,
    end: &End,
) -> Result<Option<&'static str>, StepError> {
    let limit = tr.policy().lease;
    let mut tx = within(limit, begin(pool, conn))
        .await
        .map_err(StepError::Certain)?;
    if !within(limit, tr.end(&mut tx, job, end))
        .await
        .map_err(StepError::Certain)?
    {
        return Ok(Some(LEASE_LOST));
    }
    within(limit, tr.record_end(&mut tx, job, end))
        .await
        .map_err(StepError::Certain)?;
    within(limit, tx.commit())
        .await
        .map_err(StepError::Uncertain)?;
    Ok(Some(end.name()))
}

fn lease_lost(name: &'static str, job: &JobCtx) -> &'static str {
    crate::metrics::lease_lost(name);
    tracing::warn!(kind = name, job_id = %job.job_id, "lease lost; stopping the slice and writing nothing more");
    LEASE_LOST
}

/// Reads the job row back until the database answers (see [`Transitions::resync`]).
pub(crate) async fn resync(tr: &dyn Transitions, env: Env<'_>, job: &JobCtx) -> Resync {
    let mut tries = 0u32;
    loop {
        let row = async {
            let mut conn = crate::db::acquire(env.pool).await?;
            within(tr.policy().lease, tr.resync(&mut conn, job)).await
        }
        .await;
        match row {
            Ok(Some((row_version, checkpoint))) => {
                return Resync::Ours {
                    row_version,
                    checkpoint,
                }
            }
            Ok(None) => return Resync::Lost,
            Err(e) => {
                tries += 1;
                tracing::warn!(error = %e, tries, "database unreachable; waiting");
                if !pause(tries, env.shutdown).await {
                    return Resync::Shutdown;
                }
            }
        }
    }
}

/// Begins a transaction on the slot's connection, taking one from `pool` when it has none.
/// Runs the kind's [`Transitions::prepare`] on the slice's connection (taken when it has
/// none); a panic in it is its failure, as in a step. The outer error is the connection's, the
/// inner one the kind's.
async fn prepare(
    tr: &dyn Transitions,
    pool: &PgPool,
    slot: &mut Slot,
    job: &JobCtx,
) -> Result<Result<(), JobError>, sqlx::Error> {
    if slot.is_none() {
        *slot = Some(crate::db::acquire(pool).await?);
    }
    let c: &mut PgConnection = slot.as_mut().expect("acquired above");
    Ok(super::unwind::step(tr.prepare(c, job)).await)
}

async fn begin<'a>(
    pool: &PgPool,
    slot: &'a mut Slot,
) -> Result<sqlx::Transaction<'a, sqlx::Postgres>, sqlx::Error> {
    if slot.is_none() {
        *slot = Some(crate::db::acquire(pool).await?);
    }
    let c: &mut PgConnection = slot.as_mut().expect("acquired above");
    sqlx::Connection::begin(c).await
}

/// Waits before the `tries`-th retry. `false`: shutting down instead.
async fn pause(tries: u32, shutdown: &CancellationToken) -> bool {
    super::backoff::nap(retry_pause(tries), shutdown).await
}

/// A database error inside a step, and whether the step's commit may have happened anyway.
#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error("{0}")]
    Certain(sqlx::Error),
    #[error("commit outcome unknown: {0}")]
    Uncertain(sqlx::Error),
}

pub(crate) enum Resync {
    Ours {
        row_version: i32,
        checkpoint: String,
    },
    Lost,
    Shutdown,
}

/// Extends the lease every lease/3 while the slice runs, on connections of the heartbeat
/// pool, between the slice's step transactions ([`StepGate`]); stops when dropped. A refused heartbeat cancels `lost`, so the slice stops at its
/// next step; a failed one is tried again at the next beat (two may fail before the lease
/// runs out).
struct HeartbeatGuard {
    stop: CancellationToken,
}

/// What a slice (or a group) and its heartbeat take turns on: the slice holds it while one of
/// its step transactions is open (the job rows locked), the heartbeat while it extends the
/// leases. A beat due mid-step so waits for the step's commit here, holding no connection,
/// rather than on the row lock with one of the few connections every other job's beat
/// needs; and it is the next to go once the step commits (the lock is fair), before the next
/// step's fence locks the rows again.
#[derive(Clone, Default)]
pub(crate) struct StepGate(Arc<tokio::sync::Mutex<()>>);

impl StepGate {
    pub(crate) async fn hold(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.0.lock().await
    }

    /// Held for one beat, unless `stop` comes first: `None` then.
    pub(crate) async fn hold_unless(
        &self,
        stop: &CancellationToken,
    ) -> Option<tokio::sync::MutexGuard<'_, ()>> {
        tokio::select! {
            biased;
            () = stop.cancelled() => None,
            held = self.0.lock() => (!stop.is_cancelled()).then_some(held),
        }
    }
}

impl HeartbeatGuard {
    fn start(
        pool: PgPool,
        job: JobCtx,
        policy: Policy,
        lost: CancellationToken,
        beat: Arc<dyn Heartbeat>,
        gate: StepGate,
    ) -> Self {
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        tokio::spawn(async move {
            let every = policy.heartbeat().max(Duration::from_millis(100));
            // One interval after the lease was last renewed, which may be well before this
            // slice began (a group's member going on alone).
            let mut due = job.beat_due(every);
            loop {
                let wait = due.saturating_duration_since(Instant::now());
                if !super::backoff::nap(wait, &stopped).await {
                    return;
                }
                let Some(_held) = gate.hold_unless(&stopped).await else {
                    return;
                };
                let sent = Instant::now();
                // A beat unanswered for a whole interval is a failed one: the next is due.
                let extended = within(every, async {
                    let mut conn = crate::db::acquire(&pool).await?;
                    beat.extend(&mut conn, &job).await
                });
                match extended.await {
                    Ok(true) => due = sent + every,
                    Ok(false) => {
                        lost.cancel();
                        return;
                    }
                    Err(e) => {
                        due = Instant::now() + every;
                        tracing::warn!(job_id = %job.job_id, error = %e, "heartbeat failed; will try again")
                    }
                }
            }
        });
        Self { stop }
    }
}

impl Drop for HeartbeatGuard {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
