//! The HTTP surface: `/healthz` (the process answers), `/readyz` (Postgres and RabbitMQ
//! reachable, topology declared, and every kind the process consumes has a consumer), `/metrics` (Prometheus) and the operator dashboard at `/`
//! ([`dashboard`]). Invariant: read-only except the dashboard's actions, which change a job
//! only with the admin token and only through the same library functions as the CLI; no
//! response carries a secret.

pub mod dashboard;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::broker::Topology;
use crate::config::Services;
use crate::jobs::Kind;

/// What the process's parts report about their broker sessions. Ready when every role this
/// process runs is connected with the topology declared, and the consumers have one consumer
/// for each kind they serve.
#[derive(Debug)]
pub struct Health {
    relay: Option<AtomicBool>,
    consumer: Option<AtomicBool>,
}

impl Health {
    pub fn new(relay: bool, consumer: bool) -> Self {
        Self {
            relay: relay.then(|| AtomicBool::new(false)),
            consumer: consumer.then(|| AtomicBool::new(false)),
        }
    }

    pub fn set_relay(&self, ready: bool) {
        if let Some(r) = &self.relay {
            r.store(ready, Ordering::Relaxed);
        }
    }

    pub fn set_consumer(&self, ready: bool) {
        if let Some(c) = &self.consumer {
            c.store(ready, Ordering::Relaxed);
        }
    }

    pub fn broker_ready(&self) -> bool {
        [&self.relay, &self.consumer]
            .into_iter()
            .flatten()
            .all(|f| f.load(Ordering::Relaxed))
    }
}

#[derive(Clone)]
pub struct AppState {
    pub pool: PgPool,
    pub health: Arc<Health>,
    pub kinds: Vec<Kind>,
    pub services: Services,
    pub topology: Topology,
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
    /// Authorises the dashboard's actions; `None` refuses them all.
    pub admin_token: Option<crate::config::AdminToken>,
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .merge(dashboard::routes())
        .with_state(state)
}

async fn readyz(State(st): State<AppState>) -> impl IntoResponse {
    // A connection by `db::acquire`: at Postgres' connection limit a worker whose connections
    // are all busy is still ready, and answers as soon as one of them comes back.
    let db = tokio::time::timeout(Duration::from_secs(2), async {
        let mut conn = crate::db::acquire(&st.pool).await?;
        sqlx::query("SELECT 1").execute(&mut *conn).await
    })
    .await;
    let db_ok = matches!(db, Ok(Ok(_)));
    let broker_ok = st.health.broker_ready();
    let node = st
        .services
        .amqp_url
        .current()
        .map_or_else(|| "no node".to_owned(), |n| format!("node {n}"));
    let body = format!(
        "postgres: {}\nrabbitmq: {}\n",
        if db_ok { "ok" } else { "unreachable" },
        if broker_ok {
            format!("ok, topology declared, on {node}")
        } else {
            format!("not connected, or a kind without a consumer (on {node})")
        }
    );
    let code = if db_ok && broker_ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, body)
}

async fn metrics(State(st): State<AppState>) -> impl IntoResponse {
    if let Ok(Ok(mut status)) = tokio::time::timeout(
        Duration::from_secs(2),
        crate::status::read(&st.pool, &st.kinds),
    )
    .await
    {
        if let Ok(Ok(conn)) = tokio::time::timeout(
            Duration::from_secs(2),
            crate::broker::connect(
                &st.services.amqp_url,
                "kfs-worker metrics",
                Duration::from_secs(2),
            ),
        )
        .await
        {
            crate::status::add_queue_depths(&mut status, &conn, &st.topology, &st.kinds).await;
            let _ = conn.close(200, "metrics".into()).await;
        }
        crate::status::record_metrics(&status);
    }
    (
        [("content-type", "text/plain; version=0.0.4")],
        st.metrics.render(),
    )
}

/// Serves until shutdown. Returns the bound address through `bound` (useful with port 0).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

/// Binds `addr`, with a clear error when it is taken.
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, crate::config::ConfigError> {
    tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        crate::config::ConfigError::new("KFS_HTTP_ADDR", format!("cannot listen on {addr}: {e}"))
    })
}
