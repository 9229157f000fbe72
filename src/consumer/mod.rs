//! Consumers: decode → claim → steps → end of slice → ack. Invariant: a delivery is acked only
//! after the transaction that decides it has committed (claim verdict or end of slice); an
//! undecodable delivery is rejected to the dead-letter queue, after the outbox row it names (if
//! it names one, and no delivery of that row can ever be used) is settled `dead` (see
//! [`crate::engine::settle`]); while Postgres cannot be reached nothing is acked.

mod acks;
mod batch;
mod consume;
mod pace;
mod runner;
mod supervise;

pub use consume::consume;
pub(crate) use supervise::consumers;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::crash;
use crate::engine::backoff::{nap, retry_pause};
use crate::engine::wire;
use crate::engine::{lease, slice};
use crate::jobs::{Handler, Kind, Policy};
use lease::{Claim, DeliveryRef, Statements};
use slice::Budget;

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
    fn claim(&self, kind: Kind, c: &Claim) {
        let n = match c {
            Claim::Claimed(_) => &self.claimed,
            Claim::Stale(_) => &self.stale,
            Claim::Duplicate => &self.duplicate,
            Claim::Terminal => &self.terminal,
            Claim::Exhausted => &self.exhausted,
        };
        n.fetch_add(1, Ordering::Relaxed);
        if matches!(c, Claim::Claimed(_)) {
            // A message left the relay's window.
            crate::relay::window::claimed(kind, 1);
        }
    }
}

#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    /// Unacked deliveries per kind; also how many run at once.
    pub prefetch: u16,
    /// The most deliveries handled as one batch (one claim, one group). A batch is what has
    /// arrived, so at low rates it is one delivery.
    pub batch_max: u16,
    pub budget: Budget,
    pub policies: HashMap<Kind, Policy>,
    /// How long shutdown waits for running slices to end.
    pub shutdown_grace: Duration,
    /// How long a claim that cannot reach Postgres keeps retrying before it gives its delivery
    /// back to the broker (requeued), so it does not hold a prefetch slot until the broker's
    /// consumer timeout.
    pub claim_patience: Duration,
    /// How long a claim that finds its job leased by a holder that looks alive keeps looking
    /// before it acks the delivery as a duplicate. A killed worker's deliveries come back from
    /// the broker at once, often before Postgres has ended its liveness session (within
    /// `client_connection_check_interval`, 25 ms); acked then, the job waited for the
    /// maintenance sweep's grace and period (2 to 3 s) to be published again.
    pub holder_settle: Duration,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        Self {
            prefetch: 16,
            batch_max: 8,
            budget: Budget::default(),
            policies: Kind::all()
                .into_iter()
                .map(|k| (k, k.spec().policy))
                .collect(),
            shutdown_grace: Duration::from_secs(30),
            claim_patience: Duration::from_secs(30),
            holder_settle: Duration::from_millis(500),
        }
    }
}

/// How soon a claim that found a live-looking holder (see [`ConsumerConfig::holder_settle`])
/// looks again: the check interval of a liveness session.
const HOLDER_LOOK_AGAIN: Duration = Duration::from_millis(25);

/// Runs jobs for deliveries. Shared by all consumers of one process.
pub struct Engine {
    /// Where a kind without a pool of its own takes connections, and where undecodable
    /// deliveries are settled.
    pool: PgPool,
    /// Each kind's own pool for its claims and slices, so its connections stay warm for its
    /// statements (see `runtime::plan`).
    kind_pools: HashMap<Kind, PgPool>,
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
        for h in &handlers {
            h.attach(&pool);
        }
        let handlers: HashMap<Kind, Arc<dyn Handler>> =
            handlers.into_iter().map(|h| (h.kind(), h)).collect();
        let statements = handlers
            .keys()
            .map(|&k| (k, Arc::new(Statements::new(k.spec()))))
            .collect();
        Self {
            heartbeat_pool: pool.clone(),
            pool,
            kind_pools: HashMap::new(),
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

    /// Claims and slices of each kind in `pools` take their connections from its pool there.
    #[must_use]
    pub fn with_kind_pools(mut self, pools: HashMap<Kind, PgPool>) -> Self {
        self.kind_pools = pools;
        self
    }

    /// Where `kind`'s claims and slices take their connections.
    fn pool_for(&self, kind: Kind) -> &PgPool {
        self.kind_pools.get(&kind).unwrap_or(&self.pool)
    }

    pub fn kinds(&self) -> Vec<Kind> {
        let mut k: Vec<Kind> = self.handlers.keys().copied().collect();
        k.sort();
        k
    }

    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    /// Whether `kind`'s claimed jobs step together in one transaction.
    pub fn groups(&self, kind: Kind) -> bool {
        self.handlers
            .get(&kind)
            .is_some_and(|h| h.shares_transaction())
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
        match wire::decode(kind.spec(), &env) {
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
        self.process_ref_as(d, uuid::Uuid::new_v4(), shutdown).await
    }

    /// [`Engine::process_ref`] under the lease token `token`: a delivery whose batched claim
    /// may have committed unseen claims again under the token it had there, and recognises
    /// that claim as its own.
    async fn process_ref_as(
        &self,
        d: &DeliveryRef,
        token: uuid::Uuid,
        shutdown: &CancellationToken,
    ) -> Handled {
        let st = &self.statements[&d.kind];
        let hook = self.handlers[&d.kind].as_ref();
        let policy = self.policy(d.kind);
        // One connection serves the claim and the whole slice; a failed statement drops it.
        let mut conn: Slot = None;
        // One token for every try of this claim: a retry after a claim that committed but whose
        // reply was lost then recognises the lease as its own.
        let claiming = Instant::now();
        let mut tries = 0u32;
        let claim = loop {
            let attempt = async {
                let c = self.connection(d.kind, &mut conn).await?;
                let claimed =
                    lease::claim_as(c, st, d, &self.worker_id, policy.lease, token, Some(hook))
                        .await?;
                if matches!(claimed, Claim::Claimed(_)) && crash::lose_reply("claim") {
                    // Fault injection (crash-points builds): the claim committed, its reply is lost.
                    return Err(sqlx::Error::Protocol("the claim's reply was lost".into()));
                }
                Ok(claimed)
            };
            // A claim that gets no answer (a link gone silent) is a failed claim by the end of
            // the patience, not a delivery held for good.
            let left = self
                .cfg
                .claim_patience
                .saturating_sub(claiming.elapsed())
                .max(Duration::from_millis(100));
            match crate::db::within(
                left,
                attempt
                    .instrument(tracing::info_span!("claim", kind = %d.kind, job_id = %d.job_id)),
            )
            .await
            {
                // A lease that looks live may be a just-killed holder's, whose session Postgres
                // has not ended yet: look again for a moment (`holder_settle`) under the same
                // token before acking a duplicate.
                Ok(Claim::Duplicate) if claiming.elapsed() < self.cfg.holder_settle => {
                    if !nap(HOLDER_LOOK_AGAIN, shutdown).await {
                        return Handled::Abandon;
                    }
                }
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
                    if !nap(retry_pause(tries), shutdown).await {
                        return Handled::Abandon;
                    }
                }
            }
        };
        self.counters.claim(d.kind, &claim);
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
        kind: Kind,
        slot: &'a mut Slot,
    ) -> Result<&'a mut PgConnection, sqlx::Error> {
        if slot.is_none() {
            *slot = Some(crate::db::acquire(self.pool_for(kind)).await?);
        }
        Ok(&mut **slot.as_mut().expect("acquired above"))
    }
}

/// The connection a delivery holds from its claim to the end of its slice.
type Slot = crate::engine::runner::Slot;
