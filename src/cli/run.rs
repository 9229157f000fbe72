//! `kfs-worker run`: its flags and the runtime options they make. Invariant: every flag is
//! validated into [`RunOptions`](crate::runtime::RunOptions) before the runtime starts, and a bad
//! one is a [`ConfigError`] naming its environment variable.

use clap::Args;

use super::{ConnArgs, Failure};
use crate::config::{self, ConfigError};

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Run the outbox relay (with no role flag, every role runs)
    #[arg(long)]
    pub relay: bool,
    /// Run the consumers
    #[arg(long)]
    pub consumer: bool,
    /// Run maintenance: early takeover of dead workers' jobs and outbox retention
    #[arg(long)]
    pub maintenance: bool,
    /// Run the jobs leased straight from Postgres: legacy space bootstraps, profile backfills and
    /// page-index upgrade backfills
    #[arg(long)]
    pub leased: bool,
    /// How often the leased runner looks for claimable leased jobs
    #[arg(long, env = "KFS_LEASED_POLL", default_value = "1s")]
    pub leased_poll: String,
    /// Job kinds to relay and consume: compile, deletion, research (and probe, the engine's test kind)
    #[arg(long, env = "KFS_KINDS", default_value = "compile,deletion,research")]
    pub kinds: String,
    /// This process's worker id; unique per process (default: host-pid)
    #[arg(long, env = "KFS_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Unacked deliveries per kind, which is also how many slices run at once per kind
    #[arg(long, env = "KFS_PREFETCH", default_value_t = 16)]
    pub prefetch: u16,
    /// Most deliveries of one kind claimed and stepped together as one batch; a batch takes
    /// only what has arrived, so at low rates it is one delivery (1: no batches)
    #[arg(long, env = "KFS_BATCH_MAX", default_value_t = 8)]
    pub batch_max: u16,
    /// Most steps one delivery runs before the job goes back to the queue
    #[arg(long, env = "KFS_SLICE_STEPS", default_value_t = 64)]
    pub slice_steps: u32,
    /// Most time one delivery runs before the job goes back to the queue
    #[arg(long, env = "KFS_SLICE_TIME", default_value = "20s")]
    pub slice_time: String,
    /// Lease per kind, e.g. compile=60s,deletion=30s (defaults: compile 60s, deletion 30s, research 30s)
    #[arg(long, env = "KFS_LEASES", default_value = "")]
    pub leases: String,
    /// Base of the retry backoff for every kind (default: per kind, 5s)
    #[arg(long, env = "KFS_RETRY_BASE")]
    pub retry_base: Option<String>,
    /// Cap of the retry backoff for every kind (default 5m)
    #[arg(long, env = "KFS_RETRY_MAX")]
    pub retry_max: Option<String>,
    /// Outbox rows the relay claims per round trip
    #[arg(long, env = "KFS_RELAY_BATCH", default_value_t = 256)]
    pub relay_batch: i64,
    /// How long a dispatched message may wait for a consumer before it is published again
    #[arg(long, env = "KFS_VISIBILITY", default_value = "300s")]
    pub visibility: String,
    /// Publish attempts before an outbox row is dead and its job failed
    #[arg(long, env = "KFS_MAX_DISPATCH_ATTEMPTS", default_value_t = 10)]
    pub max_dispatch_attempts: i32,
    /// Most messages of one kind published and not yet claimed: "auto" (KFS_BATCH_MAX per
    /// consumer of the kind's queue), a number, or per kind, e.g.
    /// compile=64,deletion=8; everything else waits in Postgres, in fair order
    #[arg(long, env = "KFS_RELAY_WINDOW", default_value = "auto")]
    pub relay_window: String,
    /// Which relays relay a kind: "one" (one relay of the database leads each kind; the others
    /// stand by and take over within 0.5 s of its exit, 6 s if it hangs) or "all" (every relay,
    /// side by side)
    #[arg(long, env = "KFS_RELAY_LEAD", default_value = "one", value_parser = ["one", "all"])]
    pub relay_lead: String,
    /// Most jobs of a kind one tenant may have published or running, per kind, e.g.
    /// compile=8,deletion=2 (unset: no limit)
    #[arg(long, env = "KFS_TENANT_LIMITS", default_value = "")]
    pub tenant_limits: String,
    /// Relay polling interval when no notification arrives
    #[arg(long, env = "KFS_RELAY_POLL", default_value = "1s")]
    pub relay_poll: String,
    /// How long shutdown waits for running slices
    #[arg(long, env = "KFS_SHUTDOWN_GRACE", default_value = "30s")]
    pub shutdown_grace: String,
    /// How long a claim that cannot reach Postgres retries before it gives its delivery back
    /// to the broker (requeued)
    #[arg(long, env = "KFS_CLAIM_PATIENCE", default_value = "30s")]
    pub claim_patience: String,
    /// Address of /healthz, /readyz and /metrics; "off" for none, port 0 for any free port
    #[arg(long, env = "KFS_HTTP_ADDR", default_value = "127.0.0.1:9464")]
    pub http_addr: String,
    /// Token that authorises the dashboard's actions (retry, pause, resume, cancel, requeue);
    /// unset: the dashboard only shows
    #[arg(long, env = "KFS_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
}

impl RunArgs {
    pub fn options(&self, conn: &ConnArgs) -> Result<crate::runtime::RunOptions, ConfigError> {
        use crate::consumer::ConsumerConfig;
        use crate::engine::slice::Budget;
        use crate::jobs::Kind;
        use crate::relay::RelayConfig;

        let services = conn.services()?;
        let kinds = Kind::parse_list(&self.kinds).map_err(|e| ConfigError::new("KFS_KINDS", e))?;
        let worker_id = config::worker_id(self.worker_id.as_deref())?;
        if self.prefetch == 0 {
            return Err(ConfigError::new("KFS_PREFETCH", "must be at least 1"));
        }
        if self.batch_max == 0 {
            return Err(ConfigError::new("KFS_BATCH_MAX", "must be at least 1"));
        }
        if self.slice_steps == 0 {
            return Err(ConfigError::new("KFS_SLICE_STEPS", "must be at least 1"));
        }
        if !(1..=10_000).contains(&self.relay_batch) {
            return Err(ConfigError::new(
                "KFS_RELAY_BATCH",
                "must be between 1 and 10000",
            ));
        }
        if self.max_dispatch_attempts < 1 {
            return Err(ConfigError::new(
                "KFS_MAX_DISPATCH_ATTEMPTS",
                "must be at least 1",
            ));
        }
        let mut consumer_cfg = ConsumerConfig {
            prefetch: self.prefetch,
            // A batch never holds more than the prefetch lets arrive.
            batch_max: self.batch_max.min(self.prefetch),
            budget: Budget {
                max_steps: self.slice_steps,
                max_time: config::duration("KFS_SLICE_TIME", &self.slice_time)?,
            },
            shutdown_grace: config::duration("KFS_SHUTDOWN_GRACE", &self.shutdown_grace)?,
            claim_patience: config::duration("KFS_CLAIM_PATIENCE", &self.claim_patience)?,
            ..ConsumerConfig::default()
        };
        for part in self
            .leases
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
        {
            let (k, d) = part.split_once('=').ok_or_else(|| {
                ConfigError::new(
                    "KFS_LEASES",
                    "expected KIND=DURATION pairs, e.g. compile=60s",
                )
            })?;
            let kind = Kind::parse_list(k).map_err(|e| ConfigError::new("KFS_LEASES", e))?[0];
            let lease = config::duration("KFS_LEASES", d)?;
            if lease < std::time::Duration::from_secs(1) {
                return Err(ConfigError::new(
                    "KFS_LEASES",
                    "a lease must be at least 1s",
                ));
            }
            if let Some(p) = consumer_cfg.policies.get_mut(&kind) {
                p.lease = lease;
            }
        }
        let retry_base = self
            .retry_base
            .as_deref()
            .map(|r| config::duration("KFS_RETRY_BASE", r))
            .transpose()?;
        let retry_max = self
            .retry_max
            .as_deref()
            .map(|r| config::duration("KFS_RETRY_MAX", r))
            .transpose()?;
        for p in consumer_cfg.policies.values_mut() {
            if let Some(b) = retry_base {
                p.retry.base = b;
            }
            if let Some(m) = retry_max {
                p.retry.max = m;
            }
        }
        let relay_cfg = RelayConfig {
            batch: self.relay_batch,
            visibility: config::duration("KFS_VISIBILITY", &self.visibility)?,
            max_dispatch_attempts: self.max_dispatch_attempts,
            poll: config::duration("KFS_RELAY_POLL", &self.relay_poll)?,
            windows: crate::relay::window::Windows::parse(
                &self.relay_window,
                self.batch_max.min(self.prefetch),
            )
            .map_err(|e| ConfigError::new("KFS_RELAY_WINDOW", e))?,
            tenant_limits: crate::relay::window::parse_limits(&self.tenant_limits)
                .map_err(|e| ConfigError::new("KFS_TENANT_LIMITS", e))?,
            lead: self.relay_lead == "one",
            ..RelayConfig::default()
        };
        let all = !(self.relay || self.consumer || self.maintenance || self.leased);
        let leased_poll = config::duration("KFS_LEASED_POLL", &self.leased_poll)?;
        if leased_poll < std::time::Duration::from_millis(10) {
            return Err(ConfigError::new("KFS_LEASED_POLL", "must be at least 10ms"));
        }
        let leased_cfg = crate::poller::LeasedConfig {
            poll: leased_poll,
            budget: consumer_cfg.budget,
            ..Default::default()
        };
        Ok(crate::runtime::RunOptions {
            services,
            object_store: config::object_store(&conn.object_store)?,
            worker_id,
            kinds,
            relay: all || self.relay,
            consumer: all || self.consumer,
            maintenance: all || self.maintenance,
            leased: (all || self.leased).then_some(leased_cfg),
            relay_cfg,
            consumer_cfg,
            maintenance_cfg: crate::maintenance::MaintenanceConfig::default(),
            http_addr: match self.http_addr.trim() {
                "off" | "" => None,
                a => Some(a.parse().map_err(|_| {
                    ConfigError::new(
                        "KFS_HTTP_ADDR",
                        "must be host:port such as 127.0.0.1:9464, or off",
                    )
                })?),
            },
            admin_token: config::AdminToken::parse(self.admin_token.as_deref())?,
            embedder: crate::embed::embedder_config(|k| std::env::var(k).ok())?,
            reasoner: crate::model::config(|k| std::env::var(k).ok())?,
            parser: crate::jobs::compile::parse::route::parser_config(|k| std::env::var(k).ok())?,
        })
    }
}

pub(super) async fn run_worker(conn: &ConnArgs, args: &RunArgs) -> Result<(), Failure> {
    let opts = args.options(conn)?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    tokio::spawn(crate::runtime::signals(shutdown.clone()));
    crate::runtime::run(opts, shutdown)
        .await
        .map_err(|e| Failure::usage(format!("{e:#}")))
}
