//! RabbitMQ: connections, the topology and the message shape. Invariant: the broker holds only
//! wake-up calls; every declaration is idempotent, and nothing here prints credentials.

use std::time::Duration;

use lapin::{Connection, ConnectionProperties};

use crate::config::SecretUrl;

/// Why RabbitMQ could not be used, in words an operator can act on.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("cannot reach RabbitMQ at {endpoint}: {reason}")]
    Unreachable { endpoint: String, reason: String },
    #[error("RabbitMQ at {endpoint} refused the credentials of user \"{user}\" (wrong user name or password, or no access to the vhost)")]
    Refused { endpoint: String, user: String },
    #[error("RabbitMQ at {endpoint} failed: {reason}")]
    Other { endpoint: String, reason: String },
}

/// Seconds between AMQP heartbeats unless the URL says otherwise.
pub const DEFAULT_HEARTBEAT_SECS: u16 = 5;

/// Connects once, within `timeout`.
pub async fn connect(
    url: &SecretUrl,
    name: &str,
    timeout: Duration,
) -> Result<Connection, ConnectError> {
    let endpoint = url.endpoint(5672);
    let props = ConnectionProperties::default().with_connection_name(name.into());
    let Ok(mut uri) = url.expose().parse::<lapin::uri::AMQPUri>() else {
        return Err(ConnectError::Other {
            endpoint,
            reason: "the AMQP URL cannot be used".into(),
        });
    };
    // A short heartbeat lets the broker notice a frozen or partitioned consumer and hand its
    // unacked deliveries to another within seconds. `?heartbeat=` in the URL overrides it.
    if uri.query.heartbeat.is_none() {
        uri.query.heartbeat = Some(DEFAULT_HEARTBEAT_SECS);
    }
    match tokio::time::timeout(timeout, Connection::connect_uri(uri, props)).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(classify(url, &e)),
        Err(_) => Err(ConnectError::Unreachable {
            endpoint,
            reason: format!("no answer within {}s", timeout.as_secs()),
        }),
    }
}

fn classify(url: &SecretUrl, e: &lapin::Error) -> ConnectError {
    use lapin::ErrorKind;
    let endpoint = url.endpoint(5672);
    match e.kind() {
        ErrorKind::IOError(io) => match io.kind() {
            // RabbitMQ closes the socket without a word when the login fails.
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof => {
                ConnectError::Refused {
                    endpoint,
                    user: url.username().to_owned(),
                }
            }
            std::io::ErrorKind::ConnectionRefused => ConnectError::Unreachable {
                endpoint,
                reason: "connection refused (is RabbitMQ running and listening there?)".into(),
            },
            _ => ConnectError::Unreachable {
                endpoint,
                reason: io.to_string(),
            },
        },
        ErrorKind::ProtocolError(p)
            if p.get_id() == 403 || p.to_string().contains("ACCESS_REFUSED") =>
        {
            ConnectError::Refused {
                endpoint,
                user: url.username().to_owned(),
            }
        }
        ErrorKind::InvalidConnectionState(_) => ConnectError::Refused {
            endpoint,
            user: url.username().to_owned(),
        },
        _ => ConnectError::Other {
            endpoint,
            reason: e.to_string(),
        },
    }
}

/// Exchange, queues and dead-letter queue names under one prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    pub prefix: String,
}

impl Topology {
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
        }
    }

    pub fn exchange(&self) -> String {
        format!("{}.jobs", self.prefix)
    }

    pub fn dead_letter_queue(&self) -> String {
        format!("{}.jobs.dead", self.prefix)
    }

    pub fn queue(&self, kind: crate::jobs::Kind) -> String {
        kind.spec().queue_name(&self.prefix)
    }

    /// Declares the exchange, the dead-letter queue and the queues of `kinds`, and binds them.
    /// Idempotent: the same arguments every time, so a redeclare never conflicts.
    pub async fn declare(
        &self,
        channel: &lapin::Channel,
        kinds: &[crate::jobs::Kind],
    ) -> Result<(), lapin::Error> {
        use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
        use lapin::types::{AMQPValue, FieldTable};
        use lapin::ExchangeKind;

        channel
            .exchange_declare(
                self.exchange().as_str().into(),
                ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        let mut quorum = FieldTable::default();
        quorum.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        channel
            .queue_declare(
                self.dead_letter_queue().as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                quorum.clone(),
            )
            .await?;
        for &kind in kinds {
            let mut args = quorum.clone();
            // Rejected deliveries go through the default exchange straight to the DLQ.
            args.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString("".into()),
            );
            args.insert(
                "x-dead-letter-routing-key".into(),
                AMQPValue::LongString(self.dead_letter_queue().into()),
            );
            let queue = self.queue(kind);
            channel
                .queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    args,
                )
                .await?;
            channel
                .queue_bind(
                    queue.as_str().into(),
                    self.exchange().as_str().into(),
                    kind.event_type().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
        }
        Ok(())
    }

    /// Deletes everything [`Self::declare`] made; for tests and benchmarks.
    pub async fn delete(
        &self,
        channel: &lapin::Channel,
        kinds: &[crate::jobs::Kind],
    ) -> Result<(), lapin::Error> {
        use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
        for &kind in kinds {
            channel
                .queue_delete(
                    self.queue(kind).as_str().into(),
                    QueueDeleteOptions::default(),
                )
                .await?;
        }
        channel
            .queue_delete(
                self.dead_letter_queue().as_str().into(),
                QueueDeleteOptions::default(),
            )
            .await?;
        channel
            .exchange_delete(
                self.exchange().as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await?;
        Ok(())
    }
}
