//! Consumers: decode → claim → steps → end of slice → ack. Invariant: a delivery is acked only
//! after the transaction that decides it has committed (claim verdict or end of slice); an
//! undecodable delivery is rejected to the dead-letter queue, after the outbox row it names (if
//! it names one, and no delivery of that row can ever be used) is settled `dead` (see
//! [`crate::engine::settle`]); while Postgres cannot be reached nothing is acked.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions};
use lapin::types::FieldTable;
use sqlx::{PgConnection, PgPool};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::crash;
use crate::engine::{lease, slice};
use crate::jobs::{Handler, JobCtx, Kind, Policy};
use crate::wire;
use lease::{Claim, DeliveryRef, End, Statements};
use slice::{Budget, Next, Progress};

/// What became of a delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Handled {
    /// Commit done; ack. Carries the claim outcome and, if a slice ran, how it ended.
    Ack {
        claim: &'static str,
        end: Option<&'static str>,
    },
    /// Undecodable: reject without requeue, into the dead-letter queue.
    Reject(String),
    /// Shutting down before the decision committed: leave it unacked for redelivery.
    Abandon,
    /// No decision could be reached for too long (Postgres away): hand the delivery back to the
    /// broker (requeued), so it does not hold a prefetch slot until the broker's timeout.
    GiveBack,
}

/// Counters of what the consumers did, for tests, status and metrics.
#[derive(Debug, Default)]
pub struct Counters {
    pub claimed: AtomicU64,
    pub stale: AtomicU64,
    pub duplicate: AtomicU64,
    pub terminal: AtomicU64,
    pub exhausted: AtomicU64,
    pub poison: AtomicU64,
    pub lease_lost: AtomicU64,
    pub slices: AtomicU64,
}

impl Counters {
    fn claim(&self, c: &Claim) {
        let n = match c {
            Claim::Claimed(_) => &self.claimed,
            Claim::Stale(_) => &self.stale,
            Claim::Duplicate => &self.duplicate,
            Claim::Terminal => &self.terminal,
            Claim::Exhausted => &self.exhausted,
        };
        n.fetch_add(1, Ordering::Relaxed);
    }
}

#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    /// Unacked deliveries per kind; also how many run at once.
    pub prefetch: u16,
    pub budget: Budget,
    pub policies: HashMap<Kind, Policy>,
    /// How long shutdown waits for running slices to end.
    pub shutdown_grace: Duration,
    /// How long a claim that cannot reach Postgres keeps retrying before it gives its delivery
    /// back to the broker (requeued), so it does not hold a prefetch slot until the broker's
    /// consumer timeout.
    pub claim_patience: Duration,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        Self {
            prefetch: 16,
            budget: Budget::default(),
            policies: Kind::all()
                .into_iter()
                .map(|k| (k, k.spec().policy))
                .collect(),
            shutdown_grace: Duration::from_secs(30),
            claim_patience: Duration::from_secs(30),
        }
    }
}

/// Runs jobs for deliveries. Shared by all consumers of one process.
pub struct Engine {
    pool: PgPool,
    /// Heartbeats take their connections here, never from `pool`, whose connections the
    /// slices hold for their whole length: a heartbeat queued behind them let leases expire
    /// under load.
    heartbeat_pool: PgPool,
    worker_id: String,
    handlers: HashMap<Kind, Arc<dyn Handler>>,
    statements: HashMap<Kind, Arc<Statements>>,
    cfg: ConsumerConfig,
    pub counters: Counters,
}

impl Engine {
    pub fn new(
        pool: PgPool,
        worker_id: impl Into<String>,
        handlers: Vec<Arc<dyn Handler>>,
        cfg: ConsumerConfig,
    ) -> Self {
        let handlers: HashMap<Kind, Arc<dyn Handler>> =
            handlers.into_iter().map(|h| (h.kind(), h)).collect();
        let statements = handlers
            .keys()
            .map(|&k| (k, Arc::new(Statements::new(k.spec()))))
            .collect();
        Self {
            heartbeat_pool: pool.clone(),
            pool,
            worker_id: worker_id.into(),
            handlers,
            statements,
            cfg,
            counters: Counters::default(),
        }
    }

    /// Heartbeats use `pool` (a pool of their own) instead of the slices' pool.
    #[must_use]
    pub fn with_heartbeat_pool(mut self, pool: PgPool) -> Self {
        self.heartbeat_pool = pool;
        self
    }

    pub fn kinds(&self) -> Vec<Kind> {
        let mut k: Vec<Kind> = self.handlers.keys().copied().collect();
        k.sort();
        k
    }

    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    fn policy(&self, kind: Kind) -> Policy {
        self.cfg
            .policies
            .get(&kind)
            .copied()
            .unwrap_or(kind.spec().policy)
    }

    /// Handles one delivery from its AMQP properties and body.
    pub async fn process(
        &self,
        kind: Kind,
        props: &lapin::BasicProperties,
        body: &[u8],
        shutdown: &CancellationToken,
    ) -> Handled {
        let env = wire::envelope(props, body);
        match wire::decode(kind, &env) {
            Ok(d) => {
                let span = tracing::info_span!(
                    "consume",
                    otel.name = %format_args!("{} process", kind.event_type()),
                    otel.kind = "consumer",
                    messaging.system = "rabbitmq",
                    kind = %kind,
                    job_id = %d.job_id,
                    delivery_id = %d.delivery_id,
                    outcome = tracing::field::Empty,
                );
                crate::telemetry::set_remote_parent(&span, wire::traceparent(props));
                let handled = self
                    .process_ref(&d, shutdown)
                    .instrument(span.clone())
                    .await;
                if let Handled::Ack { claim, end } = &handled {
                    span.record("outcome", end.unwrap_or(claim));
                }
                handled
            }
            Err(e) => {
                self.counters.poison.fetch_add(1, Ordering::Relaxed);
                crate::metrics::delivery(kind.name(), "poison");
                tracing::warn!(kind = %kind, reason = %e, label = e.label(), "rejecting an undecodable delivery to the dead-letter queue");
                if let Some((outbox_id, delivery_id)) = wire::named_row(&env) {
                    self.settle_named(kind, outbox_id, &delivery_id).await;
                }
                Handled::Reject(e.to_string())
            }
        }
    }

    /// Settles the outbox row an undecodable message names, if no delivery of it can be used,
    /// before the message is rejected. Best effort: when Postgres cannot be reached the row
    /// stays out for delivery, and its next delivery settles it.
    async fn settle_named(&self, kind: Kind, outbox_id: uuid::Uuid, delivery_id: &str) {
        let Some(st) = self.statements.get(&kind) else {
            return;
        };
        let hook = self.handlers.get(&kind).map(|h| h.as_ref());
        let settled = async {
            let mut conn = crate::db::acquire(&self.pool).await?;
            lease::settle_named(&mut conn, st, hook, outbox_id, delivery_id).await
        }
        .await;
        let d = DeliveryRef {
            kind,
            job_id: uuid::Uuid::nil(),
            outbox_id,
            delivery_id: delivery_id.to_owned(),
        };
        match settled {
            Ok(s) => lease::log_settled(&d, &s),
            Err(e) => {
                tracing::warn!(kind = %kind, outbox_id = %outbox_id, error = %e, "cannot settle the outbox row of an undecodable delivery; its next delivery will");
            }
        }
    }

    /// Handles one decoded delivery: claim, then run a slice if the job is ours.
    pub async fn process_ref(&self, d: &DeliveryRef, shutdown: &CancellationToken) -> Handled {
        let st = &self.statements[&d.kind];
        let hook = self.handlers[&d.kind].as_ref();
        let policy = self.policy(d.kind);
        // One connection serves the claim and the whole slice; a failed statement drops it.
        let mut conn: Slot = None;
        // One token for every try of this claim: a retry after a claim that committed but whose
        // reply was lost then recognises the lease as its own.
        let token = uuid::Uuid::new_v4();
        let claiming = Instant::now();
        let mut tries = 0u32;
        let claim = loop {
            let attempt = async {
                let c = self.connection(&mut conn).await?;
                let claimed =
                    lease::claim_as(c, st, d, &self.worker_id, policy.lease, token, Some(hook))
                        .await?;
                if matches!(claimed, Claim::Claimed(_)) && crash::lose_reply("claim") {
                    // Fault injection (crash-points builds): the claim committed, its reply is lost.
                    return Err(sqlx::Error::Protocol("the claim's reply was lost".into()));
                }
                Ok(claimed)
            };
            match attempt
                .instrument(tracing::info_span!("claim", kind = %d.kind, job_id = %d.job_id))
                .await
            {
                Ok(c) => break c,
                Err(e) => {
                    conn = None;
                    tries += 1;
                    if claiming.elapsed() >= self.cfg.claim_patience {
                        // Hand the delivery back to the broker instead of holding a prefetch
                        // slot: another worker, or this one later, may reach Postgres.
                        tracing::warn!(kind = %d.kind, job_id = %d.job_id, error = %e, tries, "claim failed for too long; giving the delivery back");
                        return Handled::GiveBack;
                    }
                    tracing::warn!(kind = %d.kind, job_id = %d.job_id, error = %e, tries, "claim failed; not acking, will retry");
                    if !self.pause_for(retry_pause(tries), shutdown).await {
                        return Handled::Abandon;
                    }
                }
            }
        };
        self.counters.claim(&claim);
        crate::metrics::delivery(d.kind.name(), claim.outcome());
        let outcome = claim.outcome();
        let Claim::Claimed(job) = claim else {
            if let Claim::Stale(why) = claim {
                tracing::debug!(kind = %d.kind, job_id = %d.job_id, delivery_id = %d.delivery_id, why, "stale delivery acked without work");
            }
            crash::point("before-ack");
            return Handled::Ack {
                claim: outcome,
                end: None,
            };
        };
        tracing::debug!(kind = %d.kind, job_id = %job.job_id, checkpoint = %job.checkpoint, attempt = job.execution_attempts, "claimed");
        crash::point("after-claim-commit");
        let end = self.run_slice(job, policy, conn, shutdown).await;
        match end {
            Some(end) => {
                crash::point("before-ack");
                Handled::Ack {
                    claim: outcome,
                    end: Some(end),
                }
            }
            None => Handled::Abandon,
        }
    }

    /// The delivery's connection, acquired when it has none.
    async fn connection<'a>(
        &self,
        slot: &'a mut Slot,
    ) -> Result<&'a mut PgConnection, sqlx::Error> {
        if slot.is_none() {
            *slot = Some(crate::db::acquire(&self.pool).await?);
        }
        Ok(&mut **slot.as_mut().expect("acquired above"))
    }

    /// Begins a transaction on the delivery's connection.
    async fn begin<'a>(
        &self,
        slot: &'a mut Slot,
    ) -> Result<sqlx::Transaction<'a, sqlx::Postgres>, sqlx::Error> {
        let c = self.connection(slot).await?;
        sqlx::Connection::begin(c).await
    }

    /// Waits `delay`. `false`: shutting down instead.
    async fn pause_for(&self, delay: Duration, shutdown: &CancellationToken) -> bool {
        tokio::select! {
            () = shutdown.cancelled() => false,
            () = tokio::time::sleep(delay) => true,
        }
    }

    /// Runs steps until the slice ends. Returns how it ended (`"lease_lost"` when fenced out),
    /// or `None` when shutdown interrupted it before its end committed.
    async fn run_slice(
        &self,
        mut job: JobCtx,
        policy: Policy,
        mut conn: Slot,
        shutdown: &CancellationToken,
    ) -> Option<&'static str> {
        self.counters.slices.fetch_add(1, Ordering::Relaxed);
        let st = &self.statements[&job.kind];
        let handler = self.handlers[&job.kind].clone();
        let lost = CancellationToken::new();
        let _heartbeat = HeartbeatGuard::start(
            self.heartbeat_pool.clone(),
            job.clone(),
            policy,
            lost.clone(),
            st.clone(),
        );
        let started = Instant::now();
        let mut steps_done = 0u32;
        // Set when the connection failed: a fresh one is taken at the next step.
        let mut broken = false;
        // Database calls retried in a row, for the backoff; reset by each committed step.
        let mut tries = 0u32;
        loop {
            if lost.is_cancelled() {
                return Some(self.lease_lost(&job));
            }
            if std::mem::take(&mut broken) {
                conn = None;
            }
            let mut tx = match self.begin(&mut conn).await {
                Ok(tx) => tx,
                Err(e) => {
                    broken = true;
                    tries += 1;
                    tracing::warn!(error = %e, tries, "cannot begin a step; retrying");
                    if !self.pause_for(retry_pause(tries), shutdown).await {
                        return None;
                    }
                    continue;
                }
            };
            let rv_before = job.row_version;
            let fenced = match lease::fence(&mut tx, st, &job, policy.lease).await {
                Ok(Some(rv)) => rv,
                Ok(None) => return Some(self.lease_lost(&job)),
                Err(e) => {
                    drop(tx);
                    conn = None;
                    tries += 1;
                    tracing::warn!(error = %e, tries, "fence failed; retrying");
                    if !self.pause_for(retry_pause(tries), shutdown).await {
                        return None;
                    }
                    continue;
                }
            };
            job.row_version = fenced;
            let result = handler
                .step(&mut tx, &job)
                .instrument(tracing::info_span!(
                    "step",
                    kind = %job.kind,
                    job_id = %job.job_id,
                    checkpoint = %job.checkpoint,
                    attempt = job.execution_attempts,
                ))
                .await;
            steps_done += 1;
            let progress = Progress {
                steps_done,
                elapsed: started.elapsed(),
                attempts: job.execution_attempts,
                max_attempts: job.max_execution_attempts,
            };
            let next = slice::after_step(
                result,
                progress,
                self.cfg.budget,
                policy.retry,
                rand::random(),
            );
            // Errors before `commit()` are certain: the transaction rolled back. Only a failing
            // `commit()` leaves the outcome unknown.
            let commit_span = match &next {
                Next::Step(_) => {
                    tracing::info_span!("commit_step", kind = %job.kind, job_id = %job.job_id)
                }
                Next::End { end, .. } | Next::Abort(end) => {
                    tracing::info_span!("end_slice", kind = %job.kind, job_id = %job.job_id, end = end.name())
                }
            };
            // The row version after this step's checkpoint write, when it made one.
            let mut advanced = fenced;
            let committed: Result<Option<&'static str>, StepError> = async {
                match &next {
                    Next::Step(cp) => {
                        let Some(rv) = lease::advance(&mut tx, st, &job, cp)
                            .await
                            .map_err(StepError::Certain)?
                        else {
                            return Ok(Some("lease_lost"));
                        };
                        advanced = rv;
                        tx.commit().await.map_err(StepError::Uncertain)?;
                        Ok(None)
                    }
                    Next::End { checkpoint, end } => {
                        let mut ending = std::borrow::Cow::Borrowed(&job);
                        if let Some(cp) = checkpoint {
                            let Some(rv) = lease::advance(&mut tx, st, &job, cp)
                                .await
                                .map_err(StepError::Certain)?
                            else {
                                return Ok(Some("lease_lost"));
                            };
                            ending.to_mut().row_version = rv;
                        }
                        if !lease::end(&mut tx, st, &ending, end)
                            .await
                            .map_err(StepError::Certain)?
                        {
                            return Ok(Some("lease_lost"));
                        }
                        tx.commit().await.map_err(StepError::Uncertain)?;
                        Ok(Some(end.name()))
                    }
                    Next::Abort(_) => {
                        // The step's writes are dropped; its end is written below, on its own.
                        tx.rollback().await.map_err(StepError::Certain)?;
                        Ok(None)
                    }
                }
            }
            .instrument(commit_span.clone())
            .await;
            let committed = match (&next, committed) {
                (Next::Abort(end), Ok(_)) => {
                    job.row_version = rv_before;
                    let written = self
                        .write_end(&mut conn, &handler, &job, end)
                        .instrument(commit_span)
                        .await;
                    if let (
                        Ok(Some(name)),
                        End::Fail { code, message } | End::Wait { code, message, .. },
                    ) = (&written, end)
                    {
                        if *name != "lease_lost" {
                            tracing::warn!(kind = %job.kind, job_id = %job.job_id, code, message, end = end.name(), "step did not finish");
                        }
                    }
                    written
                }
                (_, c) => c,
            };
            match committed {
                Ok(None) => {
                    crash::point("after-step-commit");
                    tries = 0;
                    if let Next::Step(cp) = next {
                        job.checkpoint = cp;
                        job.row_version = advanced;
                        handler.after_step_commit(&job).await;
                    }
                }
                Ok(Some("lease_lost")) => return Some(self.lease_lost(&job)),
                Ok(Some(end)) => {
                    crash::point("after-step-commit");
                    tracing::debug!(kind = %job.kind, job_id = %job.job_id, end, steps = steps_done, "slice ended");
                    crate::metrics::slice(job.kind.name(), end, started.elapsed());
                    if matches!(&next, Next::Abort(End::Wait { refund: false, .. })) {
                        crate::metrics::retry(job.kind.name());
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
                    tracing::error!(kind = %job.kind, job_id = %job.job_id, error = %e, "a step's write was refused; failing the job");
                    let end = End::Fail {
                        code,
                        message: e.to_string(),
                    };
                    // The failure is written, or the lease is proven lost, before the delivery
                    // is settled: never an ack without its deciding commit. While the failure
                    // cannot be written (Postgres away, say) the delivery stays unacked.
                    let mut tries = 0u32;
                    return loop {
                        match self.write_end(&mut conn, &handler, &job, &end).await {
                            Ok(Some("lease_lost")) => break Some(self.lease_lost(&job)),
                            Ok(Some(name)) => {
                                crate::metrics::slice(job.kind.name(), name, started.elapsed());
                                break Some(name);
                            }
                            Ok(None) => break None,
                            Err(e) => {
                                tries += 1;
                                conn = None;
                                tracing::warn!(kind = %job.kind, job_id = %job.job_id, error = %e, tries, "cannot record the failure yet; retrying");
                                if !self.pause_for(retry_pause(tries), shutdown).await {
                                    break None;
                                }
                            }
                        }
                    };
                }
                Err(StepError::Certain(e) | StepError::Uncertain(e)) => {
                    // Connection trouble, or a commit whose outcome is unknown. Find out from
                    // the row itself: while our lease token is on a live row, only we can have
                    // written it.
                    conn = None;
                    tries += 1;
                    tracing::warn!(kind = %job.kind, job_id = %job.job_id, error = %e, tries, "step not confirmed; resynchronising");
                    if !self.pause_for(retry_pause(tries), shutdown).await {
                        return None;
                    }
                    match self.resync(&job, shutdown).await {
                        Resync::Ours {
                            row_version,
                            checkpoint,
                        } => {
                            job.row_version = row_version;
                            job.checkpoint = checkpoint;
                        }
                        Resync::Gone => return Some("ended"),
                        Resync::Lost => return Some(self.lease_lost(&job)),
                        Resync::Shutdown => return None,
                    }
                }
            }
        }
    }

    /// Writes an end of slice in its own transaction, with the kind's failure hook.
    async fn write_end(
        &self,
        conn: &mut Slot,
        handler: &Arc<dyn Handler>,
        job: &JobCtx,
        end: &End,
    ) -> Result<Option<&'static str>, StepError> {
        let st = &self.statements[&job.kind];
        let mut tx = self.begin(conn).await.map_err(StepError::Certain)?;
        if !lease::end(&mut tx, st, job, end)
            .await
            .map_err(StepError::Certain)?
        {
            return Ok(Some("lease_lost"));
        }
        if let End::Fail { code, .. } = end {
            // The kind's own record of the failure commits with the failure.
            crate::jobs::failed(&mut tx, Some(handler.as_ref()), job.kind.spec(), job, code)
                .await
                .map_err(StepError::Certain)?;
        }
        if let End::Wait {
            code,
            refund: false,
            ..
        } = end
        {
            // Likewise the kind's record of a scheduled retry.
            handler
                .on_retry(&mut tx, job, code)
                .await
                .map_err(StepError::Certain)?;
        }
        tx.commit().await.map_err(StepError::Uncertain)?;
        Ok(Some(end.name()))
    }

    fn lease_lost(&self, job: &JobCtx) -> &'static str {
        self.counters.lease_lost.fetch_add(1, Ordering::Relaxed);
        crate::metrics::lease_lost(job.kind.name());
        tracing::warn!(kind = %job.kind, job_id = %job.job_id, "lease lost; stopping the slice and writing nothing more");
        "lease_lost"
    }

    async fn resync(&self, job: &JobCtx, shutdown: &CancellationToken) -> Resync {
        let st = job.kind.spec();
        let (live, terminal) = match st.states {
            crate::jobs::States::RunState { .. } => {
                ("run_state = 'running'", "run_state <> 'running'")
            }
            crate::jobs::States::Stage => (
                "stage NOT IN ('paused', 'completed', 'failed', 'canceled')",
                "stage IN ('completed', 'failed', 'canceled')",
            ),
        };
        let sql = st.sql(&format!(
            "SELECT row_version, {{cp}}::text, (lease_token = $2 AND lease_expires_at > {{now}} AND {live}) AS ours, \
               (lease_token IS NULL AND {terminal}) AS ended \
             FROM {{job}} WHERE id = $1"
        ));
        let mut tries = 0u32;
        loop {
            type Row = (i32, String, Option<bool>, Option<bool>);
            let row: Result<Option<Row>, _> = async {
                let mut conn = crate::db::acquire(&self.pool).await?;
                sqlx::query_as(&sql)
                    .bind(job.job_id)
                    .bind(job.lease_token)
                    .fetch_optional(&mut *conn)
                    .await
            }
            .await;
            match row {
                Ok(Some((rv, cp, Some(true), _))) => {
                    return Resync::Ours {
                        row_version: rv,
                        checkpoint: cp,
                    }
                }
                Ok(_) => return Resync::Lost,
                Err(e) => {
                    tries += 1;
                    tracing::warn!(error = %e, tries, "database unreachable; waiting");
                    if !self.pause_for(retry_pause(tries), shutdown).await {
                        return Resync::Shutdown;
                    }
                }
            }
        }
    }
}

/// The connection a delivery holds from its claim to the end of its slice.
type Slot = Option<sqlx::pool::PoolConnection<sqlx::Postgres>>;

/// A database error inside a step, and whether the step's commit may have happened anyway.
#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error("{0}")]
    Certain(sqlx::Error),
    #[error("commit outcome unknown: {0}")]
    Uncertain(sqlx::Error),
}

enum Resync {
    Ours {
        row_version: i32,
        checkpoint: String,
    },
    #[allow(dead_code)]
    Gone,
    Lost,
    Shutdown,
}

/// Extends the lease every lease/3 while the slice runs; stops when dropped. A refused
/// heartbeat cancels `lost`, so the slice stops at its next step.
struct HeartbeatGuard {
    stop: CancellationToken,
}

impl HeartbeatGuard {
    fn start(
        pool: PgPool,
        job: JobCtx,
        policy: Policy,
        lost: CancellationToken,
        statements: Arc<Statements>,
    ) -> Self {
        let stop = CancellationToken::new();
        let stop2 = stop.clone();
        tokio::spawn(async move {
            let every = policy.heartbeat().max(Duration::from_millis(100));
            loop {
                tokio::select! {
                    () = stop2.cancelled() => return,
                    () = tokio::time::sleep(every) => {}
                }
                let beat = async {
                    let mut conn = crate::db::acquire(&pool).await?;
                    lease::heartbeat(&mut conn, &statements, &job, policy.lease).await
                };
                match beat.await {
                    Ok(true) => {}
                    Ok(false) => {
                        lost.cancel();
                        return;
                    }
                    Err(e) => {
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

/// Consumes one kind's queue on `channel` until shutdown or until the channel fails.
pub async fn consume(
    engine: Arc<Engine>,
    channel: lapin::Channel,
    queue: String,
    kind: Kind,
    prefetch: u16,
    shutdown: CancellationToken,
) -> Result<(), lapin::Error> {
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let tag = format!("{}:{}", engine.worker_id(), kind);
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut running = JoinSet::new();
    let result = loop {
        tokio::select! {
            () = shutdown.cancelled() => break Ok(()),
            Some(done) = running.join_next(), if !running.is_empty() => {
                if let Err(e) = done {
                    tracing::error!(error = %e, "delivery task panicked");
                }
            }
            next = consumer.next() => {
                let delivery = match next {
                    Some(Ok(d)) => d,
                    Some(Err(e)) => break Err(e),
                    None => break Ok(()),
                };
                let engine = engine.clone();
                let shutdown = shutdown.clone();
                running.spawn(async move {
                    let handled = engine.process(kind, &delivery.properties, &delivery.data, &shutdown).await;
                    let sent = match &handled {
                        Handled::Ack { claim, end } => {
                            // When the ack left, in microseconds since the epoch: the ack log
                            // lets each ack be compared with the commit that decided it.
                            let sent_at = std::time::SystemTime::now()
                                .duration_since(std::time::UNIX_EPOCH)
                                .map_or(0, |d| d.as_micros());
                            let sent = delivery.ack(BasicAckOptions::default()).await;
                            if sent.is_ok() {
                                // The ack log: every line follows the commit that decided the
                                // delivery, so each can be checked against the database.
                                tracing::debug!(target: "kfs_worker::ack", kind = %kind, delivery_id = delivery.properties.message_id().as_ref().map_or("", |s| s.as_str()), claim, end = end.unwrap_or("none"), sent_at = sent_at as u64, "acked");
                            }
                            sent
                        }
                        Handled::Reject(_) => delivery.reject(BasicRejectOptions { requeue: false }).await,
                        Handled::GiveBack => delivery.reject(BasicRejectOptions { requeue: true }).await,
                        Handled::Abandon => Ok(true),
                    };
                    if let Err(e) = sent {
                        // The decision is committed; the broker redelivers and the claim sees it.
                        tracing::warn!(error = %e, "could not settle a delivery with the broker");
                    }
                });
            }
        }
    };
    // Stop taking deliveries, then let the running slices end with their commits and acks.
    // A channel the broker already dropped may never answer.
    let _ = tokio::time::timeout(
        Duration::from_secs(3),
        channel.basic_cancel(
            tag.as_str().into(),
            lapin::options::BasicCancelOptions::default(),
        ),
    )
    .await;
    let grace = engine.cfg.shutdown_grace;
    let drained = tokio::time::timeout(grace, async {
        while running.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(kind = %kind, "slices still running after the shutdown grace period; leaving them to redelivery");
        running.abort_all();
    }
    // Closed and answered before the connection closes: a channel merely dropped is closed in
    // the background, and a connection closed meanwhile fails that close with an error log.
    let _ = tokio::time::timeout(
        Duration::from_secs(3),
        channel.close(200, "consumer done".into()),
    )
    .await;
    result
}

/// The pause before the `tries`-th retry of a database call: 100 ms doubling to 5 s, with
/// jitter (half to all of it), so that workers that lost Postgres together do not return in
/// step.
fn retry_pause(tries: u32) -> Duration {
    let base = backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .with_factor(2.0)
        .without_max_times();
    let ceiling = backon::BackoffBuilder::build(base)
        .nth(usize::try_from(tries.saturating_sub(1)).unwrap_or(usize::MAX))
        .unwrap_or(Duration::from_secs(5));
    ceiling.mul_f64(0.5 + rand::random::<f64>() * 0.5)
}

#[cfg(test)]
mod tests {
    use super::retry_pause;
    use std::time::Duration;

    #[test]
    fn retry_pauses_grow_to_a_ceiling_with_jitter() {
        // (try, lowest, highest): half to all of 100 ms × 2^(try-1), at most 5 s.
        let table = [
            (1, 50, 100),
            (2, 100, 200),
            (3, 200, 400),
            (6, 1600, 3200),
            (7, 2500, 5000),
            (50, 2500, 5000),
        ];
        for (tries, lo, hi) in table {
            for _ in 0..50 {
                let p = retry_pause(tries);
                assert!(
                    p >= Duration::from_millis(lo) && p <= Duration::from_millis(hi),
                    "try {tries}: {p:?} outside {lo}..={hi} ms"
                );
            }
        }
    }
}
