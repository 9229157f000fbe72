//! The outbox relay: claims due outbox rows, publishes them with publisher confirms, and marks
//! what the broker confirmed. Invariant: the claim (with the new delivery id) commits before
//! anything is published; only a broker ack without a return marks a row dispatched, fenced by
//! its lock token; everything else goes back to pending with backoff, or dead after the last
//! allowed attempt, and its job fails with `dispatch_exhausted`. Rows are claimed with
//! `SKIP LOCKED`, so any number of relays run side by side and one row never blocks the rest.

use std::collections::HashMap;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use lapin::options::BasicPublishOptions;
use lapin::Channel;
use sqlx::PgPool;
use uuid::Uuid;

use crate::broker::{OutboundMessage, Topology};
use crate::crash;
use crate::jobs::{Kind, KindSpec, RetryPolicy, States};

#[derive(Clone, Debug)]
pub struct RelayConfig {
    /// Rows claimed per round trip.
    pub batch: i64,
    /// How long a claimed row stays locked to this relay before another may take it.
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
        }
    }
}

struct Statements {
    claim: String,
    mark: String,
    release: String,
    dead: String,
}

impl Statements {
    fn new(spec: &KindSpec) -> Self {
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
            claim: spec.sql(&format!(
                "WITH due AS ( \
                   SELECT id FROM {{outbox}} \
                   WHERE (status = 'pending' AND available_at <= {{now}}) \
                      OR (status = 'dispatching' AND locked_until <= {{now}}) \
                      OR (status IN ('dispatched', 'leased') AND available_at <= {{now}}) \
                   ORDER BY available_at, id LIMIT $1 FOR UPDATE SKIP LOCKED \
                 ) \
                 UPDATE {{outbox}} o SET status = 'dispatching', lock_token = $2, locked_by = $3, \
                   locked_until = {{now+$4}}, dispatch_attempts = o.dispatch_attempts + 1, \
                   queue_job_id = gen_random_uuid()::text, updated_at = {{now}} \
                 FROM due WHERE o.id = due.id \
                 RETURNING o.id, o.{{fk}}, o.payload, o.queue_job_id, o.dispatch_attempts, {revision}, o.schema_version"
            )),
            mark: spec.sql(&format!(
                "WITH marked AS ( \
                   UPDATE {{outbox}} o SET status = 'dispatched', lock_token = NULL, locked_by = NULL, \
                     locked_until = NULL, available_at = {{now+$3}}, last_error = NULL, updated_at = {{now}} \
                   FROM unnest($1::uuid[]) AS m(id) \
                   WHERE o.id = m.id AND o.lock_token = $2 AND o.status = 'dispatching' \
                   RETURNING o.{{fk}} AS job_id \
                 ), {mark_job} \
                 SELECT (SELECT count(*) FROM marked), (SELECT count(*) FROM moved)"
            )),
            release: spec.sql(
                "UPDATE {outbox} o SET status = 'pending', available_at = {now+m.delay_ms}, lock_token = NULL, \
                   locked_by = NULL, locked_until = NULL, last_error = $3, updated_at = {now} \
                 FROM unnest($1::uuid[], $4::bigint[]) AS m(id, delay_ms) \
                 WHERE o.id = m.id AND o.lock_token = $2 AND o.status = 'dispatching'",
            ),
            dead: spec.sql(&format!(
                "WITH r AS ( \
                   UPDATE {{outbox}} o SET status = 'dead', lock_token = NULL, locked_by = NULL, locked_until = NULL, \
                     last_error = 'dispatch_exhausted: ' || $2, updated_at = {{now}} \
                   FROM unnest($1::uuid[]) AS m(id) \
                   WHERE o.id = m.id AND o.lock_token = $3 AND o.status = 'dispatching' \
                   RETURNING o.{{fk}} AS job_id \
                 ), f AS ( \
                   UPDATE {{job}} j SET {failed_set}, worker_id = NULL, lease_token = NULL, lease_expires_at = NULL, \
                     heartbeat_at = NULL, row_version = j.row_version + 1, updated_at = {{now}} \
                   FROM r WHERE j.id = r.job_id AND {failable} RETURNING 1 \
                 ) SELECT (SELECT count(*) FROM r), (SELECT count(*) FROM f)"
            )),
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
}

/// What one round did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Round {
    pub claimed: usize,
    pub dispatched: usize,
    pub released: usize,
    pub dead: usize,
}

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
        }
    }

    pub fn pool(&self) -> PgPool {
        self.pool.clone()
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
        let token = Uuid::new_v4();
        let rows: Vec<Claimed> = sqlx::query_as::<
            _,
            (Uuid, Uuid, serde_json::Value, Option<String>, i32, i32, i32),
        >(&st.claim)
        .bind(self.cfg.batch)
        .bind(token)
        .bind(&self.relay_id)
        .bind(crate::consumer::lease::millis(self.cfg.lock_ttl))
        .fetch_all(&self.pool)
        .await?
        .into_iter()
        .map(
            |(id, job_id, payload, q, dispatch_attempts, revision, schema_version)| Claimed {
                id,
                job_id,
                payload,
                queue_job_id: q.unwrap_or_default(),
                dispatch_attempts,
                revision,
                schema_version,
            },
        )
        .collect();
        let mut round = Round {
            claimed: rows.len(),
            ..Round::default()
        };
        if rows.is_empty() {
            return Ok(round);
        }

        let exchange = self.topology.exchange();
        let mut pending = FuturesUnordered::new();
        let mut failed: Vec<(usize, String)> = Vec::new();
        let mut publish_error = None;
        let mut outstanding = std::collections::HashSet::new();
        for (i, row) in rows.iter().enumerate() {
            if publish_error.is_some() {
                failed.push((i, "not published: the channel failed".into()));
                continue;
            }
            let msg = message(kind, row);
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
                .await;
            match sent {
                Ok(confirm) => {
                    outstanding.insert(i);
                    pending.push(confirm.map(move |r| (i, r)));
                }
                Err(e) => {
                    failed.push((i, format!("publish failed: {e}")));
                    publish_error = Some(e);
                }
            }
        }

        let deadline = tokio::time::Instant::now() + self.cfg.confirm_timeout;
        let mut first = true;
        while !pending.is_empty() {
            let Ok(Some(next)) = tokio::time::timeout_at(deadline, pending.next()).await else {
                break;
            };
            // Settle what has arrived so far in one statement, then wait for the rest.
            let mut chunk = vec![next];
            while let Some(Some(more)) = pending.next().now_or_never() {
                chunk.push(more);
            }
            let mut confirmed = Vec::with_capacity(chunk.len());
            for (i, result) in chunk {
                outstanding.remove(&i);
                match result {
                    Ok(c) if c.is_ack() => {
                        if c.take_message().is_none() {
                            confirmed.push(rows[i].id);
                        } else {
                            failed.push((
                                i,
                                "returned by the broker: no queue is bound for it".into(),
                            ));
                        }
                    }
                    Ok(_) => failed.push((i, "nacked by the broker".into())),
                    Err(e) => failed.push((i, format!("no confirm: {e}"))),
                }
            }
            if first {
                crash::point("after-publish-before-mark");
                first = false;
            }
            round.dispatched += self.mark(st, token, &confirmed).await?;
            if !pending.is_empty() {
                crash::point("after-mark-before-confirm-wait");
            }
        }
        // Whatever is still unconfirmed at the deadline is treated as not delivered.
        drop(pending);
        failed.extend(
            outstanding
                .into_iter()
                .map(|i| (i, "no confirm within the timeout".to_owned())),
        );

        let (released, dead) = self
            .settle_failures(kind, st, token, &rows, &failed)
            .await?;
        round.released = released;
        round.dead = dead;
        if let Some(e) = publish_error {
            return Err(e.into());
        }
        Ok(round)
    }

    async fn mark(&self, st: &Statements, token: Uuid, ids: &[Uuid]) -> Result<usize, sqlx::Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let (marked, _moved): (i64, i64) = sqlx::query_as(&st.mark)
            .bind(ids)
            .bind(token)
            .bind(crate::consumer::lease::millis(self.cfg.visibility))
            .fetch_one(&self.pool)
            .await?;
        Ok(usize::try_from(marked).unwrap_or(0))
    }

    async fn settle_failures(
        &self,
        kind: Kind,
        st: &Statements,
        token: Uuid,
        rows: &[Claimed],
        failed: &[(usize, String)],
    ) -> Result<(usize, usize), sqlx::Error> {
        if failed.is_empty() {
            return Ok((0, 0));
        }
        let mut retry_ids = Vec::new();
        let mut delays = Vec::new();
        let mut dead_ids = Vec::new();
        let reason = failed[0].1.clone();
        for (i, why) in failed {
            let row = &rows[*i];
            tracing::warn!(kind = %kind, outbox_id = %row.id, attempt = row.dispatch_attempts, reason = %why, "publish not confirmed");
            if row.dispatch_attempts >= self.cfg.max_dispatch_attempts {
                dead_ids.push(row.id);
            } else {
                retry_ids.push(row.id);
                let attempt = u32::try_from(row.dispatch_attempts.max(1)).unwrap_or(1);
                delays.push(crate::consumer::lease::millis(
                    self.cfg.release.delay_jittered(attempt),
                ));
            }
        }
        let mut released = 0;
        if !retry_ids.is_empty() {
            released = sqlx::query(&st.release)
                .bind(&retry_ids)
                .bind(token)
                .bind(&reason)
                .bind(&delays)
                .execute(&self.pool)
                .await?
                .rows_affected() as usize;
        }
        let mut dead = 0;
        if !dead_ids.is_empty() {
            let (d, _f): (i64, i64) = sqlx::query_as(&st.dead)
                .bind(&dead_ids)
                .bind(&reason)
                .bind(token)
                .fetch_one(&self.pool)
                .await?;
            dead = usize::try_from(d).unwrap_or(0);
            tracing::error!(kind = %kind, rows = dead, reason = %reason, "outbox rows dead after their last dispatch attempt; jobs failed with dispatch_exhausted");
        }
        Ok((released, dead))
    }
}

fn message(kind: Kind, row: &Claimed) -> OutboundMessage {
    let traceparent = row
        .payload
        .get("traceparent")
        .and_then(|v| v.as_str())
        .map(str::to_owned);
    OutboundMessage {
        kind,
        outbox_id: row.id,
        job_id: row.job_id,
        delivery_id: row.queue_job_id.clone(),
        revision: row.revision,
        schema_version: row.schema_version,
        traceparent,
        body: serde_json::to_vec(&row.payload).unwrap_or_default(),
    }
}
