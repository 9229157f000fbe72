//! What the numbers were measured on, read at run time: cores, memory, CPU model, load, and the
//! versions Postgres and RabbitMQ report about themselves. Invariant: reading never fails a
//! bench; what cannot be read is reported as `unknown`.

use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::config::Services;

#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    pub cores: usize,
    pub memory_gib: f64,
    pub cpu: String,
    pub load_1m: String,
    pub postgres: String,
    pub rabbitmq: String,
    pub build: &'static str,
}

pub async fn read(services: &Services, pool: &sqlx::PgPool) -> Machine {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory_gib = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| (kb / 1024.0 / 1024.0 * 10.0).round() / 10.0);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    let load_1m = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "unknown".into());
    let postgres = sqlx::query_scalar::<_, String>("SELECT current_setting('server_version')")
        .fetch_one(pool)
        .await
        .unwrap_or_else(|_| "unknown".into());
    let rabbitmq = rabbitmq_version(services)
        .await
        .unwrap_or_else(|| "unknown".into());
    Machine {
        cores,
        memory_gib,
        cpu,
        load_1m,
        postgres,
        rabbitmq,
        build: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
    }
}

/// The `version` of the broker's `connection.start` server properties: the broker says it to
/// every client before the login, so this needs no credentials and no management plugin.
async fn rabbitmq_version(services: &Services) -> Option<String> {
    use amq_protocol::frame::{parse_frame, AMQPFrame};
    use amq_protocol::protocol::{connection, AMQPClass};
    use amq_protocol::types::AMQPValue;

    let url = services.amqp_url.url();
    let host = url.host_str()?.to_owned();
    let port = url.port().unwrap_or(5672);
    let talk = async {
        let mut s = tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .ok()?;
        s.write_all(b"AMQP\x00\x00\x09\x01").await.ok()?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = s.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
            if let Ok((_, frame)) = parse_frame(buf.as_slice()) {
                let AMQPFrame::Method(_, AMQPClass::Connection(connection::AMQPMethod::Start(st))) =
                    frame
                else {
                    return None;
                };
                return match st.server_properties.inner().get("version") {
                    Some(AMQPValue::LongString(v)) => Some(v.to_string()),
                    _ => None,
                };
            }
            if buf.len() > 1 << 16 {
                return None;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), talk)
        .await
        .ok()
        .flatten()
}
