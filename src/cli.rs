//! The command line. Invariant: every command validates its input before it touches a
//! service, and a bad input ends in one line on stderr naming the problem, with exit code 2.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::config::{self, ConfigError, SecretUrl, Services};
use crate::{broker, db};

#[derive(Debug, Parser)]
#[command(
    name = "kfs-worker",
    version,
    about = "Background-job runtime of the knowledge platform: outbox relay and ack-after-commit consumers over Postgres and RabbitMQ"
)]
pub struct Cli {
    #[command(flatten)]
    pub conn: ConnArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Connection settings, from flags or the environment.
#[derive(Debug, Args)]
pub struct ConnArgs {
    /// Postgres URL, e.g. postgres://postgres@127.0.0.1:5432/kfs
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,
    /// RabbitMQ URL
    #[arg(long, env = "AMQP_URL", global = true, hide_env_values = true, default_value = config::DEFAULT_AMQP_URL, hide_default_value = true)]
    pub amqp_url: String,
    /// Prefix of every exchange and queue name; isolates deployments and tests
    #[arg(long, env = "KFS_QUEUE_PREFIX", global = true, default_value = config::DEFAULT_QUEUE_PREFIX)]
    pub queue_prefix: String,
    /// Where document bytes live: file://<dir>, memory://, s3://bucket/prefix, gs://…, az://…
    #[arg(long, env = "KFS_OBJECT_STORE", global = true, default_value = config::DEFAULT_OBJECT_STORE)]
    pub object_store: String,
    /// How long to wait for a service to answer before giving up (e.g. 5s)
    #[arg(long, env = "KFS_CONNECT_TIMEOUT", global = true, default_value = "5s")]
    pub connect_timeout: String,
}

impl ConnArgs {
    pub fn database_url(&self) -> Result<SecretUrl, ConfigError> {
        config::database_url(self.database_url.as_deref())
    }

    pub fn connect_timeout(&self) -> Result<Duration, ConfigError> {
        config::duration("KFS_CONNECT_TIMEOUT", &self.connect_timeout)
    }

    /// A small pool for a one-shot command, or the one-line error of why there is none.
    pub async fn pool(&self, command: &str) -> Result<sqlx::PgPool, Failure> {
        let url = self.database_url()?;
        let timeout = self.connect_timeout()?;
        db::connect(&url, &format!("kfs-worker {command}"), 2, timeout)
            .await
            .map_err(Failure::usage)
    }

    pub fn services(&self) -> Result<Services, ConfigError> {
        Ok(Services {
            database_url: self.database_url()?,
            amqp_url: config::amqp_url(&self.amqp_url)?,
            queue_prefix: config::queue_prefix(&self.queue_prefix)?,
            connect_timeout: self.connect_timeout()?,
        })
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the database migrations (adopts an existing platform database)
    Migrate,
    /// Check that Postgres and RabbitMQ are reachable and accept the credentials
    Check,
    /// Run the relay, the consumers, maintenance and the leased jobs until SIGTERM/SIGINT
    Run(Box<RunArgs>),
    /// Jobs by state, outbox by status, relay lag and dead letters, per kind
    Status(StatusArgs),
    /// The main job end to end: compile documents, research them, delete a source, survive a kill
    Demo(crate::demo::DemoArgs),
    /// Request, retry and inspect document compilations
    Compile(crate::jobs::compile::cli::CompileArgs),
    /// Request deletions of spaces, sources and documents, and retry failed ones
    #[command(name = "delete", alias = "deletion")]
    Delete(crate::jobs::deletion::cli::DeleteArgs),
    /// Request, control (pause, resume, cancel) and follow research tasks
    Research(crate::jobs::research::cli::ResearchArgs),
    /// Queue, retry and inspect the page-index upgrade backfill of a space's published head
    #[command(name = "pageindex")]
    PageIndex(crate::jobs::pageindex::cli::PageIndexArgs),
    /// Measure throughput and latency next to the bare publish-consume-commit loop (see BENCHMARKS.md)
    Bench(crate::bench::BenchArgs),
    /// List the dead-letter queue, or requeue one of its messages
    Dlq(DlqArgs),
}

#[derive(Debug, Args)]
pub struct DlqArgs {
    #[command(subcommand)]
    pub action: DlqAction,
}

#[derive(Debug, Subcommand)]
pub enum DlqAction {
    /// The first messages of the dead-letter queue, with why and where they died
    List {
        /// One JSON array instead of the table
        #[arg(long)]
        json: bool,
        /// How many messages to show
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// Publish one dead-lettered message again to its kind's queue, by the id `list` shows
    Requeue {
        #[arg(value_name = "MESSAGE_ID")]
        id: String,
    },
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// One JSON object instead of the table
    #[arg(long)]
    pub json: bool,
    /// Refresh every N seconds until interrupted
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "2")]
    pub watch: Option<u64>,
    /// Kinds to show
    #[arg(long, default_value = "compile,deletion,research")]
    pub kinds: String,
}

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
        })
    }
}

/// A failed command: the one line to print, and the exit code.
#[derive(Debug)]
pub struct Failure {
    pub message: String,
    pub code: u8,
}

impl Failure {
    pub fn usage(message: impl ToString) -> Self {
        Self {
            message: message.to_string(),
            code: 2,
        }
    }

    pub fn runtime(message: impl ToString) -> Self {
        Self {
            message: message.to_string(),
            code: 1,
        }
    }
}

impl From<ConfigError> for Failure {
    fn from(e: ConfigError) -> Self {
        Self::usage(e)
    }
}

/// Reports a command line clap refused. A value it could not parse gets one line that names
/// the flag and its environment variable, like every other configuration error; help, version
/// and usage mistakes keep clap's own output.
pub fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::{ContextKind, ErrorKind};
    if !matches!(
        e.kind(),
        ErrorKind::InvalidValue | ErrorKind::ValueValidation
    ) {
        e.exit();
    }
    let invalid = e
        .get(ContextKind::InvalidArg)
        .map(ToString::to_string)
        .unwrap_or_default();
    let env = env_of(&<Cli as clap::CommandFactory>::command(), &invalid);
    let first = e.to_string();
    let first = first.lines().next().unwrap_or("invalid value").trim();
    let first = first.strip_prefix("error: ").unwrap_or(first);
    match env {
        Some(var) => eprintln!("error: {var}: {first}"),
        None => eprintln!("error: {first}"),
    }
    ExitCode::from(2)
}

/// The environment variable behind the flag clap names as `--flag <VALUE>`, in any subcommand.
fn env_of(cmd: &clap::Command, invalid: &str) -> Option<String> {
    let flag = invalid.split_whitespace().next()?.trim_start_matches('-');
    cmd.get_arguments()
        .find(|a| a.get_long() == Some(flag))
        .and_then(|a| a.get_env())
        .map(|v| v.to_string_lossy().into_owned())
        .or_else(|| cmd.get_subcommands().find_map(|sub| env_of(sub, invalid)))
}

pub async fn run(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Migrate => migrate(&cli.conn).await,
        Command::Check => check(&cli.conn).await,
        Command::Run(args) => run_worker(&cli.conn, &args).await,
        Command::Status(args) => status(&cli.conn, &args).await,
        Command::Demo(args) => crate::demo::run(&cli.conn, &args).await,
        Command::Compile(args) => crate::jobs::compile::cli::run(&cli.conn, &args).await,
        Command::Delete(args) => crate::jobs::deletion::cli::run(&cli.conn, &args).await,
        Command::Research(args) => crate::jobs::research::cli::run(&cli.conn, &args).await,
        Command::PageIndex(args) => crate::jobs::pageindex::cli::run(&cli.conn, &args).await,
        Command::Bench(args) => crate::bench::run(&cli.conn, &args).await,
        Command::Dlq(args) => dlq(&cli.conn, &args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("error: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}

async fn migrate(conn: &ConnArgs) -> Result<(), Failure> {
    let url = conn.database_url()?;
    let timeout = conn.connect_timeout()?;
    let pool = db::connect(&url, "kfs-worker migrate", 2, timeout)
        .await
        .map_err(Failure::usage)?;
    let report = db::migrate(&pool).await.map_err(|e| match e {
        db::MigrateError::Refused(_) => Failure::usage(format!("cannot migrate {url}: {e}")),
        _ => Failure::runtime(format!("migration failed: {e}")),
    })?;
    if !report.newer_platform.is_empty() {
        eprintln!(
            "warning: the database also records the platform's migrations {}; kfs-worker builds \
             and uses the platform's schema through {}",
            report.newer_platform.join(", "),
            db::migrate::PLATFORM_MIGRATIONS[db::migrate::PLATFORM_MIGRATIONS.len() - 1]
        );
    }
    println!(
        "migrations: {} applied now ({}), {} in total, database {url} is up to date",
        report.applied.len(),
        report.found,
        report.total,
    );
    Ok(())
}

async fn status(conn: &ConnArgs, args: &StatusArgs) -> Result<(), Failure> {
    use crate::jobs::Kind;
    let services = conn.services()?;
    let kinds = Kind::parse_list(&args.kinds).map_err(|e| ConfigError::new("--kinds", e))?;
    if args.watch == Some(0) {
        return Err(Failure::usage("--watch: must be at least 1 second"));
    }
    let pool = db::connect(
        &services.database_url,
        "kfs-worker status",
        2,
        services.connect_timeout,
    )
    .await
    .map_err(Failure::usage)?;
    let topology = broker::Topology::new(&services.queue_prefix);
    loop {
        let mut st = crate::status::read(&pool, &kinds).await.map_err(|e| {
            Failure::runtime(format!(
                "cannot read the job tables: {e} (did you run `kfs-worker migrate`?)"
            ))
        })?;
        if let Ok(amqp) = broker::connect(
            &services.amqp_url,
            "kfs-worker status",
            services.connect_timeout,
        )
        .await
        {
            crate::status::add_queue_depths(&mut st, &amqp, &topology, &kinds).await;
            let _ = amqp.close(200, "status".into()).await;
        }
        if args.json {
            println!("{}", serde_json::to_string(&st).unwrap_or_default());
        } else {
            if args.watch.is_some() {
                print!("\x1b[2J\x1b[H");
            }
            print!("{}", crate::status::render(&st));
        }
        match args.watch {
            Some(secs) => tokio::time::sleep(Duration::from_secs(secs)).await,
            None => return Ok(()),
        }
    }
}

async fn dlq(conn: &ConnArgs, args: &DlqArgs) -> Result<(), Failure> {
    if let DlqAction::Requeue { id } = &args.action {
        if id.trim().is_empty() {
            return Err(Failure::usage("dlq requeue: the message id is empty"));
        }
    }
    let services = conn.services()?;
    let amqp = broker::connect(
        &services.amqp_url,
        "kfs-worker dlq",
        services.connect_timeout,
    )
    .await
    .map_err(Failure::usage)?;
    let topology = broker::Topology::new(&services.queue_prefix);
    let result =
        match &args.action {
            DlqAction::List { json, limit } => crate::dlq::list(&amqp, &topology, *limit)
                .await
                .map(|letters| {
                    if *json {
                        println!("{}", serde_json::to_string(&letters).unwrap_or_default());
                    } else if letters.is_empty() {
                        println!(
                            "the dead-letter queue {} is empty",
                            topology.dead_letter_queue()
                        );
                    } else {
                        for l in &letters {
                            println!(
                                "{}  kind={}  reason={}  count={}  job={}  {}",
                                l.id,
                                l.kind.as_deref().unwrap_or("?"),
                                l.reason.as_deref().unwrap_or("?"),
                                l.count.map_or("?".into(), |c| c.to_string()),
                                l.job_id.as_deref().unwrap_or("?"),
                                l.body_preview.replace('\n', " "),
                            );
                        }
                    }
                }),
            DlqAction::Requeue { id } => crate::dlq::requeue(&amqp, &topology, id.trim())
                .await
                .map(|r| {
                    println!(
                        "requeued {} to exchange {} with routing key {} ({})",
                        r.id, r.exchange, r.routing_key, r.kind
                    );
                }),
        };
    let _ = amqp.close(200, "dlq".into()).await;
    result.map_err(|e| {
        if e.is_refusal() {
            Failure::usage(e)
        } else {
            Failure::runtime(e)
        }
    })
}

async fn run_worker(conn: &ConnArgs, args: &RunArgs) -> Result<(), Failure> {
    let opts = args.options(conn)?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    tokio::spawn(crate::runtime::signals(shutdown.clone()));
    crate::runtime::run(opts, shutdown)
        .await
        .map_err(|e| Failure::usage(format!("{e:#}")))
}

async fn check(conn: &ConnArgs) -> Result<(), Failure> {
    let services = conn.services()?;
    let timeout = services.connect_timeout;
    let mut problems = Vec::new();

    match db::connect(&services.database_url, "kfs-worker check", 1, timeout).await {
        Ok(pool) => {
            let version: String = sqlx::query_scalar("SELECT current_setting('server_version')")
                .fetch_one(&pool)
                .await
                .unwrap_or_else(|_| "unknown version".into());
            println!(
                "postgres: ok, PostgreSQL {version} at {}",
                services.database_url
            );
        }
        Err(e) => problems.push(e.to_string()),
    }

    match broker::connect(&services.amqp_url, "kfs-worker check", timeout).await {
        Ok(c) => {
            let channel = c.create_channel().await;
            let _ = c.close(200, "check done".into()).await;
            match channel {
                Ok(_) => println!("rabbitmq: ok at {}", services.amqp_url),
                Err(e) => problems.push(format!(
                    "RabbitMQ at {} accepted the login but refused a channel: {e}",
                    services.amqp_url.endpoint(5672)
                )),
            }
        }
        Err(e) => problems.push(e.to_string()),
    }

    if problems.is_empty() {
        Ok(())
    } else {
        Err(Failure::usage(problems.join("\nerror: ")))
    }
}
