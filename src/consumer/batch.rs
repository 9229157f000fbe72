//! Deliveries of one kind that arrived together: claimed in one statement, then run as one
//! group (kinds whose steps share a transaction) or side by side. Invariant: every delivery
//! gets the verdict the one-delivery path would give it, and only after its deciding commit: a
//! delivery the batched claim did not claim (or whose batched claim failed) goes through that
//! path under the lease token it had in the batch, so a batched claim that committed unseen is
//! recognised as its own; a job named twice in a batch is claimed once.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use futures_util::future::join_all;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use super::{Engine, Handled};
use crate::crash;
use crate::engine::lease::{self, DeliveryRef};
use crate::engine::wire;
use crate::jobs::Kind;

impl Engine {
    /// Handles deliveries of `kind` that arrived together, from their AMQP properties and
    /// bodies. Returns one verdict per delivery, in order.
    pub async fn process_many(
        &self,
        kind: Kind,
        items: &[(&lapin::BasicProperties, &[u8])],
        shutdown: &CancellationToken,
    ) -> Vec<Handled> {
        if let [(props, body)] = items {
            return vec![self.process(kind, props, body, shutdown).await];
        }
        let mut out: Vec<Option<Handled>> = vec![None; items.len()];
        let mut decoded: Vec<(usize, DeliveryRef)> = Vec::with_capacity(items.len());
        for (i, (props, body)) in items.iter().enumerate() {
            match wire::decode(kind.spec(), &wire::envelope(props, body)) {
                Ok(d) => decoded.push((i, d)),
                // Undecodable: the one-delivery path rejects it and settles the row it names.
                Err(_) => out[i] = Some(self.process(kind, props, body, shutdown).await),
            }
        }
        let refs: Vec<DeliveryRef> = decoded.iter().map(|(_, d)| d.clone()).collect();
        let span = tracing::info_span!(
            "consume_batch",
            otel.name = %format_args!("{} process batch", kind.event_type()),
            otel.kind = "consumer",
            messaging.system = "rabbitmq",
            kind = %kind,
            deliveries = refs.len(),
        );
        for (i, _) in &decoded {
            crate::telemetry::add_remote_link(&span, wire::traceparent(items[*i].0));
        }
        let handled = self.process_refs(&refs, shutdown).instrument(span).await;
        for ((i, _), h) in decoded.into_iter().zip(handled) {
            out[i] = Some(h);
        }
        out.into_iter()
            .map(|h| h.expect("every delivery has a verdict"))
            .collect()
    }

    /// Handles decoded deliveries of one kind that arrived together: one batched claim, then
    /// their slices. Returns one verdict per delivery, in order.
    pub async fn process_refs(
        &self,
        refs: &[DeliveryRef],
        shutdown: &CancellationToken,
    ) -> Vec<Handled> {
        let Some(first) = refs.first() else {
            return Vec::new();
        };
        if refs.len() == 1 || refs.iter().any(|d| d.kind != first.kind) {
            return join_all(refs.iter().map(|d| self.process_ref(d, shutdown))).await;
        }
        let kind = first.kind;
        let st = &self.statements[&kind];
        let handler = self.handlers[&kind].clone();
        let policy = self.policy(kind);
        let tokens: Vec<Uuid> = refs.iter().map(|_| Uuid::new_v4()).collect();
        // A job named twice is claimed by its first delivery; the other is judged alone.
        let mut jobs_seen = HashSet::new();
        let (batch, mut alone): (Vec<usize>, Vec<usize>) =
            (0..refs.len()).partition(|&i| jobs_seen.insert(refs[i].job_id));
        let pairs: Vec<(&DeliveryRef, Uuid)> =
            batch.iter().map(|&i| (&refs[i], tokens[i])).collect();
        let mut conn = None;
        // Unanswered by the end of the claim patience: claimed one by one, each bounded so too.
        let claimed = crate::db::within(self.cfg.claim_patience, async {
            let mut c = crate::db::acquire(self.pool_for(kind)).await?;
            let jobs = lease::claim_many(&mut c, st, &pairs, &self.worker_id, policy.lease).await?;
            conn = Some(c);
            Ok::<_, sqlx::Error>(jobs)
        })
        .instrument(tracing::info_span!("claim_batch", kind = %kind, deliveries = pairs.len()))
        .await;
        let jobs = match claimed {
            Ok(jobs) => jobs,
            Err(e) => {
                // Committed or not, the one-delivery claim under the same token finds out.
                tracing::warn!(kind = %kind, error = %e, deliveries = pairs.len(), "batched claim failed; claiming one by one");
                Vec::new()
            }
        };
        let claimed_ids: HashSet<Uuid> = jobs.iter().map(|j| j.job_id).collect();
        alone.extend(
            batch
                .iter()
                .copied()
                .filter(|&i| !claimed_ids.contains(&refs[i].job_id)),
        );
        self.counters
            .claimed
            .fetch_add(jobs.len() as u64, Ordering::Relaxed);
        for _ in &jobs {
            crate::metrics::delivery(kind.name(), "claimed");
        }
        if !jobs.is_empty() {
            // Messages left the relay's window.
            crate::relay::window::claimed(kind, jobs.len() as u64);
        }
        if jobs.len() > 1 {
            crash::point("after-group-claim-commit");
        }
        let claimed_at: Vec<(Uuid, usize)> = batch
            .iter()
            .copied()
            .filter(|&i| claimed_ids.contains(&refs[i].job_id))
            .map(|i| (refs[i].job_id, i))
            .collect();
        let together = async {
            if jobs.len() > 1 && handler.shares_transaction() {
                self.run_group(kind, jobs, policy, conn, shutdown).await
            } else {
                let mut conns = std::iter::once(conn).chain(std::iter::repeat_with(|| None));
                join_all(jobs.into_iter().map(|job| {
                    let c = conns.next().flatten();
                    async move {
                        let id = job.job_id;
                        (id, self.run_slice(job, policy, c, shutdown).await)
                    }
                }))
                .await
            }
        };
        let apart = join_all(
            alone
                .iter()
                .map(|&i| self.process_ref_as(&refs[i], tokens[i], shutdown)),
        );
        let (ends, apart) = tokio::join!(together, apart);
        let mut out: Vec<Option<Handled>> = vec![None; refs.len()];
        for (id, end) in ends {
            let Some(&(_, i)) = claimed_at.iter().find(|(j, _)| *j == id) else {
                continue;
            };
            out[i] = Some(match end {
                Some(end) => Handled::Ack {
                    claim: "claimed",
                    end: Some(end),
                },
                None => Handled::Abandon,
            });
        }
        for (&i, h) in alone.iter().zip(apart) {
            out[i] = Some(h);
        }
        out.into_iter()
            .map(|h| h.unwrap_or(Handled::Abandon))
            .collect()
    }
}
