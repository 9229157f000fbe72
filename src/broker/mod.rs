//! RabbitMQ: connections, the topology and the message shape. Invariant: the broker holds only
//! wake-up calls; every declaration is idempotent, and nothing here prints credentials. A
//! connection goes to one node of `AMQP_URL`'s list, tried in order from where the process's
//! last connection got to, so that a process whose node is lost moves on to the next.

use std::time::Duration;

use lapin::{Connection, ConnectionProperties};

use crate::config::{AmqpNodes, AmqpTls, SecretUrl};

/// Why RabbitMQ could not be used, in words an operator can act on.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("cannot reach RabbitMQ at {endpoint}: {reason}")]
    Unreachable { endpoint: String, reason: String },
    #[error("RabbitMQ at {endpoint} refused the credentials of user \"{user}\" (wrong user name or password, or no access to the vhost)")]
    Refused { endpoint: String, user: String },
    #[error("TLS to RabbitMQ at {endpoint} failed: {reason}")]
    Tls { endpoint: String, reason: String },
    #[error("RabbitMQ at {endpoint} failed: {reason}")]
    Other { endpoint: String, reason: String },
    #[error("no RabbitMQ node of the {count} in AMQP_URL could be used: {}", .tried.join("; "))]
    NoNode { count: usize, tried: Vec<String> },
}

/// A connection and the index of the node it went to in `AMQP_URL`'s list.
pub struct Connected {
    pub conn: Connection,
    pub node: usize,
}

/// Connects a session of the process (relay, consumers) to one of the nodes, trying each once
/// from where the process's last session got to, each within `timeout`, and records the node
/// as the one the process is on. With one node, its own error; with several, every node's.
pub async fn connect_node(
    nodes: &AmqpNodes,
    name: &str,
    timeout: Duration,
) -> Result<Connected, ConnectError> {
    let connected = try_nodes(nodes, name, timeout).await?;
    nodes.connected(connected.node);
    Ok(connected)
}

/// Tries each node once, from the process's cursor; records nothing.
async fn try_nodes(
    nodes: &AmqpNodes,
    name: &str,
    timeout: Duration,
) -> Result<Connected, ConnectError> {
    let mut tried = Vec::new();
    for i in nodes.attempt_order() {
        match connect_one(&nodes.nodes()[i], nodes.tls(), name, timeout).await {
            Ok(conn) => {
                if !tried.is_empty() {
                    tracing::info!(
                        node = %nodes.nodes()[i].endpoint(5672),
                        "connected to another RabbitMQ node after {} failed",
                        tried.len()
                    );
                }
                return Ok(Connected { conn, node: i });
            }
            Err(e) => tried.push(e),
        }
    }
    if tried.len() == 1 {
        return Err(tried.remove(0));
    }
    Err(ConnectError::NoNode {
        count: tried.len(),
        tried: tried.iter().map(ToString::to_string).collect(),
    })
}

/// A connection for a short errand (a status read, a dead-letter action), to whichever node
/// answers first from the process's cursor; it does not change which node the process is on.
pub async fn connect(
    nodes: &AmqpNodes,
    name: &str,
    timeout: Duration,
) -> Result<Connection, ConnectError> {
    try_nodes(nodes, name, timeout).await.map(|c| c.conn)
}

/// Each node on its own: whether it takes a connection and opens a channel, in list order.
pub async fn check_each(
    nodes: &AmqpNodes,
    name: &str,
    timeout: Duration,
) -> Vec<Result<(), ConnectError>> {
    let mut out = Vec::new();
    for url in nodes.nodes() {
        let result = match connect_one(url, nodes.tls(), name, timeout).await {
            Ok(conn) => {
                let channel = conn.create_channel().await;
                let _ = conn.close(200, "check done".into()).await;
                channel.map(|_| ()).map_err(|e| ConnectError::Other {
                    endpoint: url.endpoint(5672),
                    reason: format!("accepted the login but refused a channel: {e}"),
                })
            }
            Err(e) => Err(e),
        };
        out.push(result);
    }
    out
}

/// Seconds between AMQP heartbeats unless the URL says otherwise.
pub const DEFAULT_HEARTBEAT_SECS: u16 = 5;

/// Connects once to one node, within `timeout`; `amqps://` with `tls`.
async fn connect_one(
    url: &SecretUrl,
    tls: &AmqpTls,
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
    let connecting = async {
        if url.url().scheme() == "amqps" {
            let config = lapin::tcp::OwnedTLSConfig {
                identity: tls.identity.as_ref().map(|(cert, key)| {
                    lapin::tcp::OwnedIdentity::PKCS8 {
                        pem: cert.clone(),
                        key: key.clone(),
                    }
                }),
                cert_chain: tls.ca.clone(),
            };
            Connection::connect_uri_with_config(
                uri,
                props,
                config,
                lapin::runtime::default_runtime()?,
            )
            .await
        } else {
            Connection::connect_uri(uri, props).await
        }
    };
    match tokio::time::timeout(timeout, connecting).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => match classify(url, &e) {
            // Over TLS 1.3 a server that requires a client certificate says so after the
            // handshake, and the alert is often lost to the reset of a client already talking
            // AMQP: it reads like a refused login. A second handshake that only listens tells.
            ConnectError::Refused { endpoint, .. }
                if url.url().scheme() == "amqps"
                    && tls.identity.is_none()
                    && crate::tls::client_cert_required(
                        url.url().host_str().unwrap_or("localhost"),
                        url.url().port().unwrap_or(5671),
                        timeout.min(Duration::from_secs(3)),
                    )
                    .await =>
            {
                Err(ConnectError::Tls {
                    endpoint,
                    reason: crate::tls::Cause::ClientCertRequired
                        .explain("KFS_AMQP_TLS_CA", "KFS_AMQP_TLS_CERT and KFS_AMQP_TLS_KEY"),
                })
            }
            other => Err(other),
        },
        Err(_) => Err(ConnectError::Unreachable {
            endpoint,
            reason: format!("no answer within {}s", timeout.as_secs()),
        }),
    }
}

fn classify(url: &SecretUrl, e: &lapin::Error) -> ConnectError {
    use lapin::ErrorKind;
    let endpoint = url.endpoint(5672);
    if let Some(cause) = crate::tls::cause(e) {
        return ConnectError::Tls {
            endpoint,
            reason: cause.explain("KFS_AMQP_TLS_CA", "KFS_AMQP_TLS_CERT and KFS_AMQP_TLS_KEY"),
        };
    }
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

/// What the broker needs of a job kind: its queue's name under a prefix and the routing key its
/// messages carry. The job kinds implement it (`crate::jobs`); the broker knows none of them.
pub trait Routed: Copy {
    fn queue_name(&self, prefix: &str) -> String;
    fn routing_key(&self) -> &'static str;
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

    pub fn queue<K: Routed>(&self, kind: K) -> String {
        kind.queue_name(&self.prefix)
    }

    /// Declares the exchange, the dead-letter queue and the queues of `kinds`, and binds them.
    /// Idempotent: the same arguments every time, so a redeclare never conflicts.
    pub async fn declare<K: Routed>(
        &self,
        channel: &lapin::Channel,
        kinds: &[K],
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
                    kind.routing_key().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
        }
        Ok(())
    }

    /// Deletes everything [`Self::declare`] made; for tests and benchmarks.
    pub async fn delete<K: Routed>(
        &self,
        channel: &lapin::Channel,
        kinds: &[K],
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
