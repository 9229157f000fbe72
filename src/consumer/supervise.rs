//! The consumers' broker session. Invariant: every kind's consumer runs on one connection; a
//! session ends only after all of its consumers have returned (their slices ended as `consume`
//! lets them: commit, then ack), the next one starts after a backoff that only a session which
//! got as far as consuming resets, and shutdown ends it without a reconnect.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{consume, Engine};
use crate::broker::{self, Topology};
use crate::config::Services;
use crate::engine::backoff::{nap, reconnect_backoff};
use crate::jobs::Kind;

/// Connects, declares the topology and consumes every kind until shutdown; reconnects with
/// backoff when the broker goes away.
pub(crate) async fn consumers(
    engine: Arc<Engine>,
    ready: impl Fn(bool) + Send + Sync,
    services: Services,
    topology: Topology,
    kinds: Vec<Kind>,
    prefetch: u16,
    shutdown: CancellationToken,
) {
    if kinds.is_empty() {
        return;
    }
    let mut backoff = reconnect_backoff();
    while !shutdown.is_cancelled() {
        let session = async {
            let conn = broker::connect(
                &services.amqp_url,
                &format!("kfs-worker consumer {}", engine.worker_id()),
                services.connect_timeout,
            )
            .await
            .map_err(|e| e.to_string())?;
            let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
            topology
                .declare(&ch, &kinds)
                .await
                .map_err(|e| e.to_string())?;
            // Closed now, not dropped at the end of the session: see `consumer::consume`.
            ch.close(200, "declared".into())
                .await
                .map_err(|e| e.to_string())?;
            crate::crash::delay("consumer-start", engine.worker_id()).await;
            let mut running = JoinSet::new();
            for &kind in &kinds {
                let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
                running.spawn(consume(
                    engine.clone(),
                    ch,
                    topology.queue(kind),
                    kind,
                    prefetch,
                    shutdown.clone(),
                ));
            }
            ready(true);
            tracing::info!("consuming");
            // One consumer failing means the connection is in trouble: rebuild all of them.
            let first = running.join_next().await;
            let session_shutdown = shutdown.is_cancelled();
            if !session_shutdown {
                tracing::warn!(result = ?first.map(|r| r.map(|x| x.map_err(|e| e.to_string()))), "a consumer stopped; reconnecting");
            }
            while running.join_next().await.is_some() {}
            // A connection the broker already dropped may never answer a close.
            let _ =
                tokio::time::timeout(Duration::from_secs(3), conn.close(200, "bye".into())).await;
            ready(false);
            Ok::<bool, String>(session_shutdown)
        };
        match session.await {
            Ok(true) => return,
            Ok(false) => {
                backoff = reconnect_backoff();
            }
            Err(e) => tracing::warn!(error = %e, "consumer cannot connect to RabbitMQ; retrying"),
        }
        let delay = backoff.next().unwrap_or(Duration::from_secs(10));
        if !nap(delay, &shutdown).await {
            return;
        }
    }
}
