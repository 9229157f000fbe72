//! The delivery loop of one kind's queue. Invariant: a delivery is settled with the broker
//! (ack, reject or give back) only after [`Engine::process`] returned its verdict, and acked
//! only after the commit that decided it; an abandoned delivery is left unacked for
//! redelivery; on shutdown the loop stops taking deliveries and gives the running ones the
//! grace period to end.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions};
use lapin::types::FieldTable;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{Engine, Handled};
use crate::jobs::Kind;

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
