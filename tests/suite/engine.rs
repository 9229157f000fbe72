//! End to end through real Postgres and RabbitMQ: the whole protocol in one process.

mod connections;
mod flow;
mod liveness;
mod logs;
mod registered_kind;
mod slices;

use std::time::Duration;

use kfs_worker::consumer::ConsumerConfig;
use kfs_worker::jobs::probe::{self, ProbeSpec};
use kfs_worker::jobs::Kind;
use kfs_worker::maintenance::MaintenanceConfig;
use kfs_worker::relay::RelayConfig;
use kfs_worker::runtime::{self, RunOptions};
use tokio_util::sync::CancellationToken;

use crate::support::{self, TestEnv};

/// A whole runtime of the probe kind for `env` (every role but the leased jobs).
pub(crate) fn options(env: &TestEnv, worker: &str) -> RunOptions {
    RunOptions {
        services: env.services(),
        object_store: kfs_worker::config::object_store("memory://").unwrap(),
        worker_id: worker.into(),
        kinds: vec![Kind::Probe],
        relay: true,
        consumer: true,
        maintenance: true,
        leased: None,
        relay_cfg: RelayConfig {
            poll: Duration::from_millis(200),
            ..RelayConfig::default()
        },
        consumer_cfg: ConsumerConfig::default(),
        maintenance_cfg: MaintenanceConfig::default(),
        http_addr: None,
        admin_token: None,
        embedder: kfs_worker::embed::EmbedderConfig::Offline,
        reasoner: Default::default(),
        parser: Default::default(),
    }
}
