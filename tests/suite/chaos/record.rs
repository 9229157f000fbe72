//! What the run records as it goes (faults, takeovers, recoveries, channel closes, soak
//! samples, the jobs it requested) and the process measures the samples read.

use super::*;

/// A process death or pause whose jobs others must take over.
pub(super) struct Takeover {
    pub(super) at: DateTime<Utc>,
    pub(super) jobs: Vec<Uuid>,
}

#[derive(Default)]
pub(super) struct Record {
    pub(super) faults: BTreeMap<String, u64>,
    pub(super) crash_points: BTreeMap<String, u64>,
    pub(super) takeovers: Vec<Takeover>,
    /// Service back at (database clock), for "time to the first effect after recovery".
    pub(super) recoveries: Vec<(String, DateTime<Utc>)>,
    pub(super) outage_cpu: Vec<String>,
    pub(super) outage_cpu_ok: bool,
    pub(super) samples: Vec<Sample>,
    pub(super) jobs: Vec<(Uuid, &'static str)>,
    /// Enqueues that failed, each committed or not: [`settle_in_doubt`] finds out which.
    pub(super) in_doubt: Vec<(Uuid, &'static str)>,
    /// How many of them had committed.
    pub(super) in_doubt_committed: usize,
    /// The platform's jobs requested during the run.
    pub(super) platform: platform::Requested,
    /// Consumer channels the broker was made to close.
    pub(super) channel_closes: Vec<ChannelClose>,
    /// When the faulty phase ended (no new probe jobs after it).
    pub(super) faults_ended: Option<DateTime<Utc>>,
    /// Unexpected events worth reading in the report.
    pub(super) notes: Vec<String>,
}

/// One request to a consumer process to have the broker close one kind's channel.
pub(super) struct ChannelClose {
    /// The process (its worker id) and its log.
    pub(super) process: String,
    pub(super) log: std::path::PathBuf,
    pub(super) kind: &'static str,
    /// Which of the process's plays this is (1 for its first), once it played it.
    pub(super) played: Option<usize>,
}

impl Record {
    pub(super) fn fault(&mut self, kind: &str) {
        *self.faults.entry(kind.to_owned()).or_default() += 1;
    }
}

pub(super) struct Sample {
    pub(super) at_s: u64,
    pub(super) rss_kb: Vec<(String, u64)>,
    pub(super) pg_sessions: i64,
    pub(super) pg_proxy_open: usize,
    pub(super) mq_proxy_open: usize,
    pub(super) mq_connections: Option<usize>,
    pub(super) accepted: (u64, u64),
}

pub(super) fn rss_kb(pid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// utime + stime of a process, in clock ticks.
pub(super) fn cpu_ticks(pid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces; fields after it start past the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

pub(super) fn clock_ticks() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100)
}

pub(super) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}
