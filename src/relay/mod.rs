//! The outbox relay: claims due outbox rows, publishes them with publisher confirms, and marks
//! what the broker confirmed. Invariant: the claim (with the new delivery id) commits before
//! anything is published; only a broker ack without a return marks a row dispatched, fenced by
//! its lock token; everything else goes back to pending with backoff, or dead after the last
//! allowed attempt, and its job fails with `dispatch_exhausted`, recorded by the kind's failure
//! hook in the same transaction. A row is never dead while its job lives on without it: one
//! whose job still holds a live lease goes back to pending instead, until a publish gets through
//! or the lease runs out. Rows are claimed with `SKIP LOCKED`, so any number of relays
//! run side by side and one row never blocks the rest.
//!
//! The database decides what runs next: per kind, at most a window of messages is published and
//! not yet claimed (`window`), and each claim takes, in this order, rows already in the window
//! that need publishing again, jobs taken over, retries, then new work round-robin between
//! tenants, within each tenant's limit (`statements`). Claims of one kind take turns on an
//! advisory lock, so relays side by side never over-admit. Relays side by side are safe, but
//! by default only one of them relays each kind at a time and the others stand by (`lead`).
pub mod lead;
mod rounds;
pub mod schedule;
mod session;
mod statements;
pub mod watch;
pub mod window;

pub use rounds::{Rounds, Settled};
pub(crate) use session::relay_loop;

use std::collections::HashMap;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use lapin::options::BasicPublishOptions;
use lapin::Channel;
use sqlx::PgPool;
use tracing::Instrument;
use uuid::Uuid;

use crate::broker::Topology;
use crate::crash;
use crate::engine::wire::{valid_traceparent, OutboundMessage};
use crate::jobs::{Kind, RetryPolicy};
use statements::Statements;

/// Sessions a relay takes out of the shared pool for good ([`crate::db::own_session`]): its
/// watch session, and its lead session when relays lead. The shared pool may open as many
/// again in their place.
pub fn own_sessions(cfg: &RelayConfig) -> u32 {
    1 + u32::from(cfg.lead)
}

#[derive(Clone, Debug)]
pub struct RelayConfig {
    /// Rows claimed per round trip.
    pub batch: i64,
    /// How long a claimed row stays locked to this relay before another may take it; less when
    /// the relay's id is a liveness holder that dies first (see `statements::claim`).
    pub lock_ttl: Duration,
    /// How long a dispatched row waits for a consumer before it is published again.
    pub visibility: Duration,
    pub max_dispatch_attempts: i32,
    /// How long to wait for publisher confirms.
    pub confirm_timeout: Duration,
    /// Backoff of rows whose publish failed.
    pub release: RetryPolicy,
    /// Fallback polling when no notification arrives.
    pub poll: Duration,
    /// Rounds of one kind in flight at once: the next batch is claimed and published while
    /// the broker confirms the previous one.
    pub depth: usize,
    /// Per kind, the most messages published and not yet claimed; everything else waits in
    /// Postgres, where it can still be reordered, paused, canceled or deleted.
    pub windows: window::Windows,
    /// Per kind, the most jobs one tenant may have in the window or running.
    pub tenant_limits: std::collections::BTreeMap<Kind, u32>,
    /// How soon a relay that filled its window, or held a tenant back, looks again when no
    /// consumer of this process woke it.
    pub window_poll: Duration,
    /// One relay of the database leads each kind and the others stand by (`lead`); off, every
    /// relay relays every kind.
    pub lead: bool,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            batch: 256,
            lock_ttl: Duration::from_secs(30),
            visibility: Duration::from_secs(300),
            max_dispatch_attempts: 10,
            confirm_timeout: Duration::from_secs(15),
            release: RetryPolicy {
                base: Duration::from_secs(1),
                max: Duration::from_secs(60),
            },
            poll: Duration::from_secs(1),
            depth: 4,
            windows: window::Windows::unbounded(),
            tenant_limits: std::collections::BTreeMap::new(),
            window_poll: Duration::from_millis(50),
            lead: true,
        }
    }
}

/// One claimed outbox row.
#[derive(Clone, Debug, sqlx::FromRow)]
struct Claimed {
    id: Uuid,
    job_id: Uuid,
    payload: serde_json::Value,
    queue_job_id: String,
    dispatch_attempts: i32,
    revision: i32,
    schema_version: i32,
    /// Why it was due (`statements::class`).
    class: i32,
    /// Its job's tenant, where the kind has tenants.
    tenant: Option<String>,
}

/// What a claim saw beside the rows it took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Room {
    /// Room in the window before the claim (at most a batch).
    free: i64,
    /// Rows the claim took into that room.
    used: i64,
    /// Messages in the window before the claim (published or being published, not claimed).
    in_window: i64,
    /// A tenant was at its limit.
    held: bool,
}

impl Room {
    /// The window filled up, or a tenant was held back: room may come only from a consumer, so
    /// look again when one frees it (or after `window_poll`).
    fn look_again(self) -> bool {
        self.free == 0 || self.used >= self.free || self.held
    }
}

impl KindState {
    /// Folds the demand since the last period into the rate, once a period (250 ms) has
    /// passed, half old and half new; returns the rate. The demand is the rows this relay took
    /// into the window or its process's consumers' claims `left` [`window::across`] the
    /// queue's consumers, whichever is more: relays side by side each take a share of the
    /// rows, and the window is the whole queue's.
    fn fold_rate(&mut self, now: std::time::Instant, left: u64, own: u32) -> f64 {
        let since = *self.since.get_or_insert(now);
        let at_fold = *self.left_at_fold.get_or_insert(left);
        let period = now.duration_since(since).as_secs_f64();
        if period >= 0.25 {
            let claims = window::across(left.wrapping_sub(at_fold), own, self.consumers);
            let demand = self.taken.max(claims);
            self.rate = 0.5 * self.rate + 0.5 * (demand as f64 / period);
            self.taken = 0;
            self.since = Some(now);
            self.left_at_fold = Some(left);
        }
        self.rate
    }

    /// The window of `size` now, with the rate folded from this process's consumers (`local`).
    fn window(&mut self, size: window::Size, local: window::Local) -> i64 {
        let rate = self.fold_rate(std::time::Instant::now(), local.claimed, local.consumers);
        size.messages(self.consumers, rate)
    }
}

/// What one round did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Round {
    pub claimed: usize,
    pub dispatched: usize,
    pub released: usize,
    pub dead: usize,
    /// The window was full or a tenant at its limit: more may be due once room is freed.
    pub look_again: bool,
}

/// What the relay keeps of each kind between rounds.
#[derive(Clone, Debug, Default)]
struct KindState {
    /// Consumers of the kind's queue at the last look (for an `auto` window).
    consumers: u32,
    /// Messages per second taken into the window (what the consumers take out of it while it
    /// is full), averaged over the last periods (for an `auto` window).
    rate: f64,
    /// Rows taken into the window since `since`.
    taken: u64,
    since: Option<std::time::Instant>,
    /// This process's consumers' claims ([`window::Local::claimed`]) at `since`.
    left_at_fold: Option<u64>,
    /// The tenant whose new work was published last: the round-robin goes on after it.
    cursor: String,
    /// Messages in the window after the last claim, the count of this process's consumers'
    /// claims ([`window::Local::claimed`]) read before it, and whether it held a tenant back: what
    /// [`Relay::worth_a_look`] needs.
    in_window: i64,
    left_at_claim: u64,
    held: bool,
    /// The last claim found the window full, or filled it.
    full: bool,
}

/// Begins the relay's claim and mark transactions: see [`Relay::index_planned`].
const INDEX_PLANNED: &str =
    "BEGIN; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_seqscan = off";

/// The namespace of the advisory lock claims of one kind take turns on (the second key is the
/// outbox table's name hashed).
const CLAIM_LOCK_NAMESPACE: i32 = 7_038_584;

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("broker: {0}")]
    Broker(#[from] lapin::Error),
}

pub struct Relay {
    pool: PgPool,
    topology: Topology,
    relay_id: String,
    cfg: RelayConfig,
    statements: HashMap<Kind, Statements>,
    state: std::sync::Mutex<HashMap<Kind, KindState>>,
}

impl Relay {
    pub fn new(
        pool: PgPool,
        topology: Topology,
        relay_id: impl Into<String>,
        cfg: RelayConfig,
        kinds: &[Kind],
    ) -> Self {
        let statements = kinds
            .iter()
            .map(|&k| (k, Statements::new(k.spec())))
            .collect();
        Self {
            pool,
            topology,
            relay_id: relay_id.into(),
            cfg,
            statements,
            state: std::sync::Mutex::new(
                kinds.iter().map(|&k| (k, KindState::default())).collect(),
            ),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, HashMap<Kind, KindState>> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The kind's window now, in messages.
    pub fn window(&self, kind: Kind) -> i64 {
        let size = self.cfg.windows.of(kind);
        let local = window::local(kind);
        self.state()
            .get_mut(&kind)
            .map_or_else(|| size.messages(0, 0.0), |s| s.window(size, local))
    }

    /// Whether a relay waiting for room in `kind`'s window should claim again now
    /// ([`window::worth_a_look`]).
    pub fn worth_a_look(&self, kind: Kind) -> bool {
        let size = self.cfg.windows.of(kind);
        let local = window::local(kind);
        self.state().get_mut(&kind).is_none_or(|s| {
            let window = s.window(size, local);
            window::worth_a_look(
                s.in_window,
                window::across(
                    local.claimed.wrapping_sub(s.left_at_claim),
                    local.consumers,
                    s.consumers,
                ),
                window,
                s.held,
            )
        })
    }

    /// Whether `kind`'s last claim found a tenant at its limit with room left in the window:
    /// only a job of that tenant ending can let more in.
    pub fn held_only(&self, kind: Kind) -> bool {
        self.state().get(&kind).is_some_and(|s| s.held && !s.full)
    }

    /// Records how many consumers the kind's queue has, for an `auto` window.
    pub fn set_consumers(&self, kind: Kind, consumers: u32) {
        if let Some(s) = self.state().get_mut(&kind) {
            s.consumers = consumers;
        }
    }

    /// Kinds whose window follows their consumers.
    pub fn auto_kinds(&self) -> Vec<Kind> {
        self.kinds()
            .into_iter()
            .filter(|&k| matches!(self.cfg.windows.of(k), window::Size::Auto { .. }))
            .collect()
    }

    pub fn pool(&self) -> PgPool {
        self.pool.clone()
    }

    /// A transaction whose statements are planned for the outbox's indexes: no bitmap scans
    /// and no sequential scans. The outbox's statistics lag behind its churn, and a connection
    /// keeps the plan it made of a statement at its first executions:
    /// - planned from an outbox that looked empty, a claim over a backlog of thousands read and
    ///   sorted every due row (a bitmap scan) to return one batch, and its cost grew with the
    ///   backlog. An index scan in `available_at` order stops after one batch, whatever the
    ///   statistics say;
    /// - planned while the outbox held a handful of rows, the claim counted the window and
    ///   updated its rows by sequential scans, and the mark found its job rows by one; with no
    ///   analyse yet, every claim and mark went on reading the whole outbox and job table as
    ///   they grew (2.7 ms of each lone job's claim after 6,000 jobs).
    ///
    /// The settings go with the `BEGIN`, in one round trip.
    async fn index_planned(
        &self,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
        let conn = crate::db::acquire(&self.pool).await?;
        sqlx::Transaction::begin(conn, Some(std::borrow::Cow::Borrowed(INDEX_PLANNED))).await
    }

    pub fn config(&self) -> &RelayConfig {
        &self.cfg
    }

    pub fn kinds(&self) -> Vec<Kind> {
        let mut k: Vec<Kind> = self.statements.keys().copied().collect();
        k.sort();
        k
    }

    /// Claims one batch of `kind`, publishes it on `channel` (in confirm mode) and settles it.
    pub async fn relay_once(&self, channel: &Channel, kind: Kind) -> Result<Round, RelayError> {
        let st = &self.statements[&kind];
        let started = std::time::Instant::now();
        let token = Uuid::new_v4();
        let (rows, room) = self.claim(kind, st, token).await?;
        let mut round = Round {
            claimed: rows.len(),
            look_again: room.look_again(),
            ..Round::default()
        };
        if rows.is_empty() {
            return Ok(round);
        }

        let exchange = self.topology.exchange();
        let mut pending = FuturesUnordered::new();
        let mut failed: Vec<Failed> = Vec::new();
        let mut publish_error = None;
        let mut outstanding = std::collections::HashSet::new();
        for (i, row) in rows.iter().enumerate() {
            if publish_error.is_some() {
                failed.push(Failed::refund(i, "not published: the channel failed"));
                continue;
            }
            let mut msg = message(kind, row);
            if msg.body.len() > crate::engine::wire::MAX_BODY {
                // No consumer would accept it: it can never be delivered.
                failed.push(Failed::dead(
                    i,
                    format!(
                        "undeliverable: a payload of {} bytes is over the limit of {}",
                        msg.body.len(),
                        crate::engine::wire::MAX_BODY
                    ),
                ));
                continue;
            }
            let span = tracing::info_span!(
                "publish",
                otel.name = %format_args!("{} publish", kind.event_type()),
                otel.kind = "producer",
                messaging.system = "rabbitmq",
                kind = %kind,
                job_id = %row.job_id,
                delivery_id = %msg.delivery_id,
            );
            crate::telemetry::set_remote_parent(&span, msg.traceparent.as_deref());
            if let Some(tp) = crate::telemetry::traceparent_of(&span) {
                // The consumer's span becomes a child of this publish, itself a child of the
                // request that wrote the row.
                msg.traceparent = Some(tp);
            }
            let sent = channel
                .basic_publish(
                    exchange.as_str().into(),
                    kind.event_type().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &msg.body,
                    msg.properties(),
                )
                .instrument(span)
                .await;
            match sent {
                Ok(confirm) => {
                    outstanding.insert(i);
                    pending.push(confirm.map(move |r| (i, r)));
                }
                Err(e) => {
                    failed.push(Failed::refund(i, format!("publish failed: {e}")));
                    publish_error = Some(e);
                }
            }
        }

        let published_at = std::time::Instant::now();
        crate::metrics::publish_latency(kind.name(), published_at - started);
        let deadline = tokio::time::Instant::now() + self.cfg.confirm_timeout;
        let mut first = true;
        while !pending.is_empty() {
            let Ok(Some(next)) = tokio::time::timeout_at(deadline, pending.next()).await else {
                break;
            };
            // The first confirms are marked at once; the rest of the batch when all of it is
            // confirmed (or the deadline passed): at most two marks per batch, whatever the
            // number of acks the broker splits its confirms into.
            let mut chunk = vec![next];
            if first {
                while let Some(Some(more)) = pending.next().now_or_never() {
                    chunk.push(more);
                }
            } else {
                while let Ok(Some(more)) = tokio::time::timeout_at(deadline, pending.next()).await {
                    chunk.push(more);
                }
            }
            let mut confirmed = Vec::with_capacity(chunk.len());
            for (i, result) in chunk {
                outstanding.remove(&i);
                match result {
                    Ok(c) if c.is_ack() => {
                        if c.take_message().is_none() {
                            confirmed.push(rows[i].id);
                        } else {
                            failed.push(Failed::counted(
                                i,
                                "returned by the broker: no queue is bound for it",
                            ));
                        }
                    }
                    Ok(_) => failed.push(Failed::counted(i, "nacked by the broker")),
                    Err(e) => failed.push(Failed::counted(i, format!("no confirm: {e}"))),
                }
            }
            if first {
                crash::point("after-publish-before-mark");
                first = false;
            }
            crate::metrics::confirm_latency(kind.name(), published_at.elapsed());
            // Counted by the broker's confirms: a row a consumer leased first is not marked.
            crate::metrics::published(kind.name(), "confirmed", confirmed.len() as u64);
            let marked = self.mark(st, token, &confirmed).await?;
            round.dispatched += marked;
            if !pending.is_empty() {
                crash::point("after-mark-before-confirm-wait");
            }
        }
        // Whatever is still unconfirmed at the deadline is treated as not delivered.
        drop(pending);
        failed.extend(
            outstanding
                .into_iter()
                .map(|i| Failed::counted(i, "no confirm within the timeout")),
        );

        let (released, dead) = self
            .settle_failures(kind, st, token, &rows, &failed)
            .await?;
        round.released = released;
        round.dead = dead;
        crate::metrics::published(kind.name(), "released", released as u64);
        crate::metrics::published(kind.name(), "dead", dead as u64);
        if let Some(e) = publish_error {
            return Err(e.into());
        }
        Ok(round)
    }

    /// Publishes every due row of `kind` with up to `depth` rounds in flight, until a round
    /// finds less than a batch and no other is in flight. Returns the sum of the rounds.
    pub async fn drain(&self, channel: &Channel, kind: Kind) -> Result<Round, RelayError> {
        let mut rounds = Rounds::new(self, channel, &[kind]);
        let mut total = Round::default();
        rounds.start();
        while let Some(settled) = rounds.settle().await {
            let (_, Settled::Round(r)) = settled else {
                continue;
            };
            total.claimed += r.claimed;
            total.dispatched += r.dispatched;
            total.released += r.released;
            total.dead += r.dead;
            rounds.start();
        }
        match rounds.failed() {
            Some(e) => Err(e),
            None => Ok(total),
        }
    }

    /// Claims one batch under `token`, committed before anything is published, in the order to
    /// publish it. Claims of one kind take turns (a transaction-level advisory lock), so the
    /// room in the window and the tenants' counts each claim reads are not read by another
    /// claim at the same time: relays side by side never over-admit.
    async fn claim(
        &self,
        kind: Kind,
        st: &Statements,
        token: Uuid,
    ) -> Result<(Vec<Claimed>, Room), sqlx::Error> {
        let (sql, args) = self.claim_statement(kind, st, token)?;
        // Read before the claim's snapshot: a consumer's claim in between is counted both as
        // gone from the window and as left since, so the estimate errs towards looking early.
        let left_at_claim = window::local(kind).claimed;
        let mut tx = self.index_planned().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
            .bind(CLAIM_LOCK_NAMESPACE)
            .bind(kind.spec().outbox_table)
            .execute(&mut *tx)
            .await?;
        type Row = (
            Option<Uuid>,
            Option<Uuid>,
            Option<serde_json::Value>,
            Option<String>,
            Option<i32>,
            Option<i32>,
            Option<i32>,
            Option<i32>,
            Option<String>,
            i64,
            i64,
            bool,
        );
        let got = sqlx::query_as_with::<_, Row, _>(sql, args)
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        let mut room = Room::default();
        let mut rows = Vec::with_capacity(got.len());
        for (
            id,
            job_id,
            payload,
            q,
            attempts,
            revision,
            schema,
            class,
            tenant,
            free,
            in_window,
            held,
        ) in got
        {
            room.free = free;
            room.in_window = in_window;
            room.held = held;
            let (Some(id), Some(job_id), Some(class)) = (id, job_id, class) else {
                continue;
            };
            if class != statements::class::REPUBLISH {
                room.used += 1;
            }
            rows.push(Claimed {
                id,
                job_id,
                payload: payload.unwrap_or(serde_json::Value::Null),
                queue_job_id: q.unwrap_or_default(),
                dispatch_attempts: attempts.unwrap_or(0),
                revision: revision.unwrap_or(1),
                schema_version: schema.unwrap_or(1),
                class,
                tenant,
            });
        }
        if let Some(last) = rows
            .iter()
            .rev()
            .find(|r| r.class == statements::class::FAIR)
            .and_then(|r| r.tenant.clone())
        {
            if let Some(s) = self.state().get_mut(&kind) {
                s.cursor = last;
            }
        }
        if let Some(s) = self.state().get_mut(&kind) {
            s.taken += u64::try_from(room.used).unwrap_or(0);
            s.in_window = room.in_window + room.used;
            s.left_at_claim = left_at_claim;
            s.held = room.held;
            s.full = room.free == 0 || room.used >= room.free;
        }
        // Counted so that how often a relay claims can be read off `/metrics`.
        metrics::counter!("kfs_relay_claims_total", "kind" => kind.name()).increment(1);
        Ok((rows, room))
    }

    /// The claim statement of `kind` as this relay would run it now under `token`, and its
    /// arguments: the window, the round-robin's cursor and, with a tenant limit, the limit.
    fn claim_statement<'s>(
        &self,
        kind: Kind,
        st: &'s Statements,
        token: Uuid,
    ) -> Result<(&'s str, sqlx::postgres::PgArguments), sqlx::Error> {
        use sqlx::Arguments;
        let window = self.window(kind);
        let cursor = self
            .state()
            .get(&kind)
            .map(|s| s.cursor.clone())
            .unwrap_or_default();
        let limit = self.cfg.tenant_limits.get(&kind).copied();
        let fair = kind.spec().fairness.is_some();
        let mut args = sqlx::postgres::PgArguments::default();
        args.add(self.cfg.batch).map_err(sqlx::Error::Encode)?;
        args.add(token).map_err(sqlx::Error::Encode)?;
        args.add(self.relay_id.as_str())
            .map_err(sqlx::Error::Encode)?;
        args.add(crate::engine::lease::millis(self.cfg.lock_ttl))
            .map_err(sqlx::Error::Encode)?;
        args.add(window).map_err(sqlx::Error::Encode)?;
        if !fair {
            return Ok((&st.claim, args));
        }
        args.add(cursor).map_err(sqlx::Error::Encode)?;
        let Some(limit) = limit else {
            return Ok((&st.claim, args));
        };
        args.add(i64::from(limit)).map_err(sqlx::Error::Encode)?;
        Ok((&st.claim_limited, args))
    }

    /// `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)` of the claim this relay would run for `kind`
    /// now, in a transaction rolled back afterwards: what a claim costs, for tests and
    /// benchmarks. Nothing is claimed. `generic`: under the plan Postgres may settle on for the
    /// prepared statement after its first executions, which knows none of the parameters.
    pub async fn explain_claim(
        &self,
        kind: Kind,
        generic: bool,
    ) -> Result<serde_json::Value, sqlx::Error> {
        let (sql, args) = self.claim_statement(kind, &self.statements[&kind], Uuid::new_v4())?;
        let explain = format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}");
        let mut tx = self.index_planned().await?;
        let mode = if generic {
            "force_generic_plan"
        } else {
            "auto"
        };
        sqlx::query("SELECT set_config('plan_cache_mode', $1, true)")
            .bind(mode)
            .execute(&mut *tx)
            .await?;
        let plan = sqlx::query_scalar_with::<_, serde_json::Value, _>(&explain, args)
            .fetch_one(&mut *tx)
            .await?;
        tx.rollback().await?;
        Ok(plan)
    }

    /// The relay's Postgres work for one batch of `kind` with no broker: claim, then mark every
    /// claimed row dispatched as if the broker had confirmed it. Returns the rows marked. Only
    /// the bench uses it, to measure how fast the relay could go if publishing cost nothing;
    /// the messages it "dispatches" are never sent.
    pub async fn claim_and_mark_without_publishing(&self, kind: Kind) -> Result<usize, RelayError> {
        let st = &self.statements[&kind];
        let token = Uuid::new_v4();
        let ids: Vec<Uuid> = self
            .claim(kind, st, token)
            .await?
            .0
            .iter()
            .map(|r| r.id)
            .collect();
        Ok(self.mark(st, token, &ids).await?)
    }

    async fn mark(&self, st: &Statements, token: Uuid, ids: &[Uuid]) -> Result<usize, sqlx::Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let mut tx = self.index_planned().await?;
        let (marked, _moved): (i64, i64) = sqlx::query_as(&st.mark)
            .bind(ids)
            .bind(token)
            .bind(crate::engine::lease::millis(self.cfg.visibility))
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(usize::try_from(marked).unwrap_or(0))
    }

    async fn settle_failures(
        &self,
        kind: Kind,
        st: &Statements,
        token: Uuid,
        rows: &[Claimed],
        failed: &[Failed],
    ) -> Result<(usize, usize), sqlx::Error> {
        if failed.is_empty() {
            return Ok((0, 0));
        }
        let mut retry = (Vec::new(), Vec::new(), Vec::new());
        let mut dead: Vec<(Uuid, &str)> = Vec::new();
        let reason = failed[0].reason.clone();
        for f in failed {
            let row = &rows[f.index];
            tracing::warn!(kind = %kind, outbox_id = %row.id, attempt = row.dispatch_attempts, reason = %f.reason, "publish not confirmed");
            if f.dead || (!f.refund && row.dispatch_attempts >= self.cfg.max_dispatch_attempts) {
                dead.push((row.id, &f.reason));
            } else {
                let attempt = u32::try_from(row.dispatch_attempts.max(1)).unwrap_or(1);
                retry.0.push(row.id);
                retry.1.push(crate::engine::lease::millis(
                    self.cfg.release.delay_jittered(attempt),
                ));
                retry.2.push(i32::from(f.refund));
            }
        }
        let mut conn = crate::db::acquire(&self.pool).await?;
        let mut dead_count = 0;
        for (id, why) in &dead {
            // The row goes dead, its job fails and the kind records the failure, in one
            // transaction.
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            type Dead = (
                i64,
                i64,
                Option<Uuid>,
                Option<String>,
                Option<i32>,
                Option<i32>,
                Option<i32>,
            );
            let (d, kept, job, checkpoint, row_version, attempts, max_attempts): Dead =
                sqlx::query_as(&st.dead)
                    .bind([*id])
                    .bind(*why)
                    .bind(token)
                    .fetch_one(&mut *tx)
                    .await?;
            if let (Some(job), Some(checkpoint), Some(rv), Some(n), Some(max)) =
                (job, checkpoint, row_version, attempts, max_attempts)
            {
                let ctx = crate::jobs::JobCtx::unleased(kind, job, *id, rv, checkpoint, n, max);
                crate::jobs::failed(&mut tx, None, ctx.kind.spec(), &ctx, "dispatch_exhausted")
                    .await?;
            }
            tx.commit().await?;
            dead_count += usize::try_from(d).unwrap_or(0);
            if kept > 0 {
                // Its job still holds a live lease, which no dead row may outlive: published
                // again after the usual backoff, until a publish gets through or the lease runs
                // out and the job fails with the row.
                let row = rows.iter().find(|r| r.id == *id);
                let attempt = row.map_or(1, |r| {
                    u32::try_from(r.dispatch_attempts.max(1)).unwrap_or(1)
                });
                tracing::warn!(kind = %kind, outbox_id = %id, reason = %why, "dispatch attempts used up while the job's lease is live; released, not dead");
                retry.0.push(*id);
                retry.1.push(crate::engine::lease::millis(
                    self.cfg.release.delay_jittered(attempt),
                ));
                retry.2.push(0);
            } else if d == 0 {
                // Its job row was busy: try again shortly rather than wait for it.
                retry.0.push(*id);
                retry.1.push(1000);
                retry.2.push(0);
            } else {
                tracing::error!(kind = %kind, outbox_id = %id, reason = %why, "outbox row dead; its job failed with dispatch_exhausted");
            }
        }
        let mut released = 0;
        if !retry.0.is_empty() {
            released = sqlx::query(&st.release)
                .bind(&retry.0)
                .bind(token)
                .bind(&reason)
                .bind(&retry.1)
                .bind(&retry.2)
                .execute(&mut *conn)
                .await?
                .rows_affected() as usize;
        }
        Ok((released, dead_count))
    }
}

/// A claimed row that was not confirmed, and what becomes of it.
#[derive(Clone, Debug)]
struct Failed {
    index: usize,
    reason: String,
    /// The message never left: the attempt does not count.
    refund: bool,
    /// It can never be delivered: dead now.
    dead: bool,
}

impl Failed {
    fn counted(index: usize, reason: impl Into<String>) -> Self {
        Self {
            index,
            reason: reason.into(),
            refund: false,
            dead: false,
        }
    }

    fn refund(index: usize, reason: impl Into<String>) -> Self {
        Self {
            index,
            reason: reason.into(),
            refund: true,
            dead: false,
        }
    }

    fn dead(index: usize, reason: impl Into<String>) -> Self {
        Self {
            index,
            reason: reason.into(),
            refund: false,
            dead: true,
        }
    }
}

fn message(kind: Kind, row: &Claimed) -> OutboundMessage {
    let traceparent = row
        .payload
        .get("traceparent")
        .and_then(|v| v.as_str())
        .filter(|t| valid_traceparent(t))
        .map(str::to_owned);
    OutboundMessage {
        kind,
        event_type: kind.spec().event_type,
        outbox_id: row.id,
        job_id: row.job_id,
        delivery_id: row.queue_job_id.clone(),
        revision: row.revision,
        schema_version: row.schema_version,
        traceparent,
        body: serde_json::to_vec(&row.payload).unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// One period of a relay's rate: its own takes and its process's consumers' claims, with
    /// `own` of `consumers` on the queue; returns the rate after the period.
    fn rate_after(taken: u64, claims: u64, own: u32, consumers: u32) -> f64 {
        let t0 = Instant::now();
        let mut s = KindState {
            consumers,
            ..KindState::default()
        };
        s.fold_rate(t0, 1_000, own);
        s.taken = taken;
        s.fold_rate(t0 + Duration::from_secs(1), 1_000 + claims, own)
    }

    #[test]
    fn a_relay_beside_others_folds_the_whole_queues_drain_into_its_rate_table() {
        // (taken by this relay, claimed by this process's consumers, own, consumers, rate)
        let cases: &[(u64, u64, u32, u32, f64)] = &[
            // Alone: what it took and what was claimed agree.
            (400, 400, 1, 1, 200.0),
            // One of two processes: it took half the rows; its consumer claimed half.
            (200, 200, 1, 2, 200.0),
            (100, 200, 1, 4, 400.0),
            // A relay-only process: what it took.
            (300, 0, 0, 2, 150.0),
            // Consumers claimed less than it published (a filling window): what it took.
            (400, 100, 1, 1, 200.0),
        ];
        for &(taken, claims, own, consumers, want) in cases {
            let got = rate_after(taken, claims, own, consumers);
            assert!(
                (got - want).abs() < 1e-9,
                "took {taken}, {claims} claims, {own} of {consumers} consumers: {got}, want {want}"
            );
        }
    }

    #[test]
    fn the_rate_waits_for_a_whole_period_before_it_folds() {
        let t0 = Instant::now();
        let mut s = KindState {
            consumers: 2,
            ..KindState::default()
        };
        s.fold_rate(t0, 0, 1);
        s.taken = 500;
        assert_eq!(s.fold_rate(t0 + Duration::from_millis(100), 500, 1), 0.0);
        // The claims counted from the period's start, not from the early look.
        let r = s.fold_rate(t0 + Duration::from_millis(500), 500, 1);
        assert!((r - 0.5 * 1000.0 / 0.5).abs() < 1e-9, "{r}");
    }
}
