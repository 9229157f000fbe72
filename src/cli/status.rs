//! `kfs-worker status`: jobs by state, outbox by status, relay lag and dead letters, per kind.
//! Invariant: it only reads; without RabbitMQ it still shows what Postgres holds.

use std::time::Duration;

use clap::Args;

use super::{ConnArgs, Failure};
use crate::config::ConfigError;
use crate::{broker, db};

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

pub(super) async fn status(conn: &ConnArgs, args: &StatusArgs) -> Result<(), Failure> {
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
