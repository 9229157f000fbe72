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

/// The CPU time the whole machine spent busy since it was started: what Postgres, RabbitMQ and
/// this process (and anything else running) used together, which is what a scenario costs on
/// cores they all share.
#[derive(Clone, Copy, Debug)]
pub struct CpuMeter(Option<f64>);

impl CpuMeter {
    pub fn start() -> CpuMeter {
        CpuMeter(cpu_busy_secs())
    }

    /// Busy CPU-seconds, summed over all cores, since [`CpuMeter::start`].
    pub fn busy(&self) -> Option<f64> {
        Some(cpu_busy_secs()? - self.0?).filter(|b| *b >= 0.0)
    }
}

/// Busy CPU-seconds of all cores since boot, from `/proc/stat`; `None` where it cannot be read.
fn cpu_busy_secs() -> Option<f64> {
    parse_cpu_busy(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// The `cpu` line of `/proc/stat` counts user, nice, system, idle, iowait, irq, softirq, steal,
/// … in USER_HZ (100 per second on Linux). Busy is user + nice + system + irq + softirq: idle
/// and I/O wait are not work, and time stolen by a hypervisor was not ours.
fn parse_cpu_busy(stat: &str) -> Option<f64> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    if v.len() < 7 {
        return None;
    }
    Some((v[0] + v[1] + v[2] + v[5] + v[6]) as f64 / 100.0)
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

#[cfg(test)]
mod tests {
    use super::parse_cpu_busy;

    #[test]
    fn busy_cpu_counts_work_not_idle_wait_or_steal() {
        // user nice system idle iowait irq softirq steal guest guest_nice
        let stat = "cpu  100 20 30 5000 400 5 15 700 0 0\ncpu0 50 10 15 2500 200 2 7 350 0 0\n";
        assert_eq!(parse_cpu_busy(stat), Some(1.7));
        assert_eq!(
            parse_cpu_busy("cpu0 1 2 3 4 5 6 7\n"),
            None,
            "no total line"
        );
        assert_eq!(parse_cpu_busy("cpu  1 2 3\n"), None, "too few fields");
        assert_eq!(parse_cpu_busy("cpu  1 2 x 4 5 6 7\n"), None, "not a number");
    }
}
