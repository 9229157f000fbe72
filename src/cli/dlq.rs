//! `kfs-worker dlq`: list the dead-letter queue, or requeue one of its messages. Invariant: the
//! message id is checked before any service is touched, and the broker connection is closed
//! before the command's result is reported.

use clap::{Args, Subcommand};

use super::{ConnArgs, Failure};
use crate::broker;

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

pub(super) async fn dlq(conn: &ConnArgs, args: &DlqArgs) -> Result<(), Failure> {
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
