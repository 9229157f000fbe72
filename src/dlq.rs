//! The dead-letter queue: peek at what it holds and put one message back on its kind's queue.
//! Invariant: a peek never removes a message (every message it takes is returned unacked when
//! its channel closes), and a requeue removes a message from the dead-letter queue only after
//! the broker confirmed its republication; while a requeue holds the message unacked no other
//! peek or requeue can take it, so one message is requeued at most once per dead-lettering.

use std::time::Duration;

use lapin::options::{BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::broker::Topology;
use crate::jobs::Kind;

/// Longest body excerpt a listing shows.
const PREVIEW_BYTES: usize = 240;

/// One dead-lettered message, as an operator sees it.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct DeadLetter {
    /// The message id the relay gave it (the delivery id), or `sha256:<16 hex>` of the body
    /// when it carries none.
    pub id: String,
    /// The kind whose queue it died in, when that is one of ours.
    pub kind: Option<String>,
    /// The `type` property (event type), as published.
    pub event_type: Option<String>,
    /// The job the message was about (`correlation_id`), if it says.
    pub job_id: Option<String>,
    /// Why RabbitMQ dead-lettered it (`rejected`, `expired`, `maxlen`, `delivery_limit`).
    pub reason: Option<String>,
    /// The queue it died in.
    pub queue: Option<String>,
    /// How many times it was dead-lettered from that queue.
    pub count: Option<i64>,
    /// When it first died, seconds since the epoch.
    pub died_at: Option<i64>,
    /// The start of its body, lossy UTF-8.
    pub body_preview: String,
}

#[derive(Debug, thiserror::Error)]
pub enum DlqError {
    #[error("no message {0} in the dead-letter queue (already requeued, or never there)")]
    NotFound(String),
    #[error("message {id} cannot be requeued: {why}")]
    NoTarget { id: String, why: String },
    #[error(
        "RabbitMQ did not take the requeued message {id}: {why}; it stays in the dead-letter queue"
    )]
    NotConfirmed { id: String, why: String },
    #[error("RabbitMQ: {0}")]
    Broker(#[from] lapin::Error),
}

impl DlqError {
    /// A refusal of the request (exit code 2), as opposed to a failing broker.
    pub fn is_refusal(&self) -> bool {
        matches!(self, DlqError::NotFound(_) | DlqError::NoTarget { .. })
    }
}

/// Where a requeue sent a message.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Requeued {
    pub id: String,
    pub kind: String,
    pub exchange: String,
    pub routing_key: String,
}

fn text(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

fn int(v: &AMQPValue) -> Option<i64> {
    match v {
        AMQPValue::ShortShortInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortShortUInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortUInt(v) => Some(i64::from(*v)),
        AMQPValue::LongInt(v) => Some(i64::from(*v)),
        AMQPValue::LongUInt(v) => Some(i64::from(*v)),
        AMQPValue::LongLongInt(v) => Some(*v),
        AMQPValue::Timestamp(v) => i64::try_from(*v).ok(),
        _ => None,
    }
}

/// The newest `x-death` entry (RabbitMQ puts the most recent first).
fn last_death(headers: Option<&FieldTable>) -> Option<&FieldTable> {
    match headers?.inner().get("x-death")? {
        AMQPValue::FieldArray(a) => a.as_slice().iter().find_map(|v| match v {
            AMQPValue::FieldTable(t) => Some(t),
            _ => None,
        }),
        _ => None,
    }
}

/// The id a listing shows and a requeue takes: the message id, else a digest of the body.
pub fn message_key(props: &BasicProperties, body: &[u8]) -> String {
    match props.message_id().as_ref().map(|s| s.as_str()) {
        Some(id) if !id.is_empty() => id.to_owned(),
        _ => format!("sha256:{}", &hex::encode(Sha256::digest(body))[..16]),
    }
}

/// The kind whose queue is `queue` under `topology`.
fn kind_of_queue(topology: &Topology, queue: &str) -> Option<Kind> {
    Kind::all()
        .into_iter()
        .find(|&k| topology.queue(k) == queue)
}

/// Describes one message taken from the dead-letter queue.
pub fn describe(topology: &Topology, props: &BasicProperties, body: &[u8]) -> DeadLetter {
    let death = last_death(props.headers().as_ref());
    let field = |k: &str| death.and_then(|d| d.inner().get(k));
    let queue = field("queue").and_then(text);
    let event_type = props.kind().as_ref().map(|s| s.as_str().to_owned());
    let kind = queue
        .as_deref()
        .and_then(|q| kind_of_queue(topology, q))
        .or_else(|| event_type.as_deref().and_then(Kind::from_event_type))
        .map(|k| k.name().to_owned());
    let cut = body.len().min(PREVIEW_BYTES);
    DeadLetter {
        id: message_key(props, body),
        kind,
        event_type,
        job_id: props
            .correlation_id()
            .as_ref()
            .map(|s| s.as_str().to_owned()),
        reason: field("reason").and_then(text),
        queue,
        count: field("count").and_then(int),
        died_at: field("time").and_then(int),
        body_preview: String::from_utf8_lossy(&body[..cut]).into_owned(),
    }
}

/// Takes up to `limit` messages without acknowledging them. The caller closes the channel to
/// give them all back (or acks the one it moved).
async fn take(
    ch: &Channel,
    topology: &Topology,
    limit: usize,
) -> Result<Vec<lapin::message::Delivery>, lapin::Error> {
    let mut out = Vec::new();
    while out.len() < limit {
        let Some(got) = ch
            .basic_get(
                topology.dead_letter_queue().as_str().into(),
                BasicGetOptions { no_ack: false },
            )
            .await?
        else {
            break;
        };
        out.push(got.delivery);
    }
    Ok(out)
}

/// The first `limit` messages of the dead-letter queue, oldest first. Changes nothing.
pub async fn list(
    conn: &Connection,
    topology: &Topology,
    limit: usize,
) -> Result<Vec<DeadLetter>, DlqError> {
    let ch = conn.create_channel().await?;
    let taken = take(&ch, topology, limit).await;
    // Closing the channel returns every unacked message to the queue, in order.
    let _ = ch.close(200, "dlq peek".into()).await;
    Ok(taken?
        .iter()
        .map(|d| describe(topology, &d.properties, &d.data))
        .collect())
}

/// How many messages a requeue looks through for its id.
const SCAN_LIMIT: usize = 10_000;

/// Publishes the dead-lettered message `id` again to its kind's exchange and routing key, and
/// removes it from the dead-letter queue once the broker confirmed the publication. The body
/// and properties are kept (the `x-death` history shows how often it died).
pub async fn requeue(
    conn: &Connection,
    topology: &Topology,
    id: &str,
) -> Result<Requeued, DlqError> {
    // A peek running at the same moment holds messages briefly; look again before saying no.
    for round in 0..3 {
        if round > 0 {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        match requeue_once(conn, topology, id).await {
            Err(DlqError::NotFound(_)) => continue,
            other => return other,
        }
    }
    Err(DlqError::NotFound(id.to_owned()))
}

async fn requeue_once(
    conn: &Connection,
    topology: &Topology,
    id: &str,
) -> Result<Requeued, DlqError> {
    let ch = conn.create_channel().await?;
    let result = async {
        let mut found = None;
        let queue = topology.dead_letter_queue();
        while found.is_none() {
            let Some(got) = ch
                .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false })
                .await?
            else {
                break;
            };
            let d = got.delivery;
            if message_key(&d.properties, &d.data) == id {
                found = Some(d);
            } else if d.delivery_tag as usize >= SCAN_LIMIT {
                break;
            }
        }
        let d = found.ok_or_else(|| DlqError::NotFound(id.to_owned()))?;
        let described = describe(topology, &d.properties, &d.data);
        let kind = described
            .kind
            .as_deref()
            .and_then(|k| Kind::parse_list(k).ok())
            .and_then(|k| k.first().copied())
            .ok_or_else(|| DlqError::NoTarget {
                id: id.to_owned(),
                why: format!(
                    "it names no job kind of this deployment (queue {}, type {})",
                    described.queue.as_deref().unwrap_or("unknown"),
                    described.event_type.as_deref().unwrap_or("none")
                ),
            })?;
        let publisher = conn.create_channel().await?;
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let exchange = topology.exchange();
        let confirm = publisher
            .basic_publish(
                exchange.as_str().into(),
                kind.event_type().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                &d.data,
                d.properties.clone(),
            )
            .await?
            .await;
        let _ = publisher.close(200, "dlq requeue".into()).await;
        let refused = |why: &str| DlqError::NotConfirmed {
            id: id.to_owned(),
            why: why.to_owned(),
        };
        match confirm {
            Ok(c) if c.is_ack() => {
                if c.take_message().is_some() {
                    return Err(refused("no queue is bound for it"));
                }
            }
            Ok(_) => return Err(refused("the broker refused it")),
            Err(e) => return Err(refused(&e.to_string())),
        }
        d.acker.ack(BasicAckOptions::default()).await?;
        Ok::<_, DlqError>(Requeued {
            id: id.to_owned(),
            kind: kind.name().to_owned(),
            exchange,
            routing_key: kind.event_type().to_owned(),
        })
    }
    .await;
    // Everything taken and not acked goes back to the dead-letter queue.
    let _ = ch.close(200, "dlq requeue".into()).await;
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::FieldArray;

    fn death(queue: &str, reason: &str, count: i64) -> FieldTable {
        let mut d = FieldTable::default();
        d.insert("queue".into(), AMQPValue::LongString(queue.into()));
        d.insert("reason".into(), AMQPValue::LongString(reason.into()));
        d.insert("count".into(), AMQPValue::LongLongInt(count));
        d.insert("time".into(), AMQPValue::Timestamp(1_700_000_000));
        let mut h = FieldTable::default();
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(d)])),
        );
        h
    }

    #[test]
    fn describes_the_reason_the_queue_and_the_kind() {
        let t = Topology::new("p");
        let props = BasicProperties::default()
            .with_message_id("delivery-1".into())
            .with_type("document.compile".into())
            .with_headers(death("p.deletion.job", "rejected", 2));
        let d = describe(&t, &props, b"{\"x\":1}");
        assert_eq!(d.id, "delivery-1");
        assert_eq!(
            d.kind.as_deref(),
            Some("deletion"),
            "the queue it died in wins"
        );
        assert_eq!(d.reason.as_deref(), Some("rejected"));
        assert_eq!(d.count, Some(2));
        assert_eq!(d.died_at, Some(1_700_000_000));
        assert_eq!(d.body_preview, "{\"x\":1}");
    }

    #[test]
    fn a_message_without_id_or_history_is_named_by_its_body() {
        let t = Topology::new("p");
        let props = BasicProperties::default();
        let d = describe(&t, &props, b"garbage");
        assert!(d.id.starts_with("sha256:") && d.id.len() == 23, "{}", d.id);
        assert_eq!(d.id, describe(&t, &props, b"garbage").id, "stable");
        assert_ne!(d.id, describe(&t, &props, b"other").id);
        assert_eq!((d.kind, d.reason, d.queue), (None, None, None));
        let typed = BasicProperties::default().with_type("research.task".into());
        assert_eq!(
            describe(&t, &typed, b"x").kind.as_deref(),
            Some("research"),
            "falls back to the type property"
        );
    }

    #[test]
    fn previews_are_cut_and_lossy() {
        let t = Topology::new("p");
        let body = vec![b'a'; 1000];
        let d = describe(&t, &BasicProperties::default(), &body);
        assert_eq!(d.body_preview.len(), PREVIEW_BYTES);
        let bad = describe(&t, &BasicProperties::default(), &[0xff, b'o', b'k']);
        assert!(bad.body_preview.ends_with("ok"));
    }
}
