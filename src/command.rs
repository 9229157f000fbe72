//! What every command shares: the connection flags ([`ConnArgs`]) and the [`Failure`] a command
//! ends with. Invariant: it sits below the kinds and the CLI, so a kind's own subcommands
//! (`jobs/<kind>/cli.rs`) and the top-level CLI both use it without importing each other; a
//! secret in a URL never reaches a [`Failure`]'s message (URLs are [`SecretUrl`]s).

use std::time::Duration;

use clap::Args;

use crate::config::{self, ConfigError, SecretUrl, Services};
use crate::db;

/// Connection settings, from flags or the environment.
#[derive(Debug, Args)]
pub struct ConnArgs {
    /// Postgres URL, e.g. postgres://postgres@127.0.0.1:5432/kfs
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,
    /// RabbitMQ URL, or the URLs of a cluster's nodes separated by commas
    #[arg(long, env = "AMQP_URL", global = true, hide_env_values = true, default_value = config::DEFAULT_AMQP_URL, hide_default_value = true)]
    pub amqp_url: String,
    /// Which listed node a process tries first: shuffled (a fleet spreads over the nodes) or listed
    #[arg(
        long,
        env = "KFS_AMQP_NODE_ORDER",
        global = true,
        default_value = "shuffled"
    )]
    pub amqp_node_order: String,
    /// PEM file of the CA that signed the amqps:// nodes' certificates (else the system's roots)
    #[arg(long, env = "KFS_AMQP_TLS_CA", global = true)]
    pub amqp_tls_ca: Option<String>,
    /// PEM file of the client certificate for mutual TLS with amqps:// nodes
    #[arg(long, env = "KFS_AMQP_TLS_CERT", global = true)]
    pub amqp_tls_cert: Option<String>,
    /// PEM file of the client certificate's private key
    #[arg(long, env = "KFS_AMQP_TLS_KEY", global = true)]
    pub amqp_tls_key: Option<String>,
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
            amqp_url: config::amqp_url(&self.amqp_url)?
                .with_order(config::NodeOrder::parse(&self.amqp_node_order)?)
                .with_tls(config::AmqpTls::from_files(
                    self.amqp_tls_ca.as_deref(),
                    self.amqp_tls_cert.as_deref(),
                    self.amqp_tls_key.as_deref(),
                )?),
            queue_prefix: config::queue_prefix(&self.queue_prefix)?,
            connect_timeout: self.connect_timeout()?,
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
