//! `kfs-worker bench`: how fast the engine is, next to the fastest loop the same machine allows,
//! measured in the same run. Invariant: every scenario runs against its own fresh database and
//! queue prefix and removes them afterwards; the bench reports numbers and never judges them —
//! it fails only when its input is bad, a service cannot be used, or work was left undone.

mod env;
mod machine;
mod report;
mod scenarios;
pub mod stats;

use std::io::IsTerminal;

use crate::command::{ConnArgs, Failure};
use crate::config::ConfigError;
use report::Report;
use scenarios::Params;

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Jobs (and messages) per throughput scenario
    #[arg(long, default_value_t = 20_000)]
    pub jobs: u64,
    /// Most worker processes in the scale-out scenario (it runs 1, 2, 4, … up to this)
    #[arg(long, default_value_t = 4)]
    pub workers: u32,
    /// Deliveries in flight per consumer (the prefetch); the bare loop gets the same. Deep
    /// enough that batches overlap the broker's round trips (`kfs-worker run --prefetch`)
    #[arg(long, default_value_t = 64)]
    pub inflight: u16,
    /// Most deliveries the engine claims and steps as one batch (`kfs-worker run
    /// --batch-max`; at most --inflight)
    #[arg(long, default_value_t = 16)]
    pub batch_max: u16,
    /// One JSON object per line (the machine, then each scenario) instead of the table
    #[arg(long)]
    pub json: bool,
    /// Scenarios to run: limit, relay, statements, writes (the protocol's row versions alone,
    /// by the plainest statements: the bound on any engine that keeps the protocol), engine,
    /// peer (a Celery 5 worker doing the
    /// bare loop's work; needs Python 3 and PyPI the first time), latency, kinds, fairness
    /// (a second tenant's jobs behind a first tenant's backlog), claim (the fair claim at 100
    /// and at 100,000 due rows; needs a superuser to make the backlog), takeover (a SIGKILLed worker's
    /// jobs under that backlog, also after a restart under its id), scaleout, documents (a PDF
    /// corpus through the local parser and through poppler's pdftotext, and compiled); not by
    /// default: bulk (uploads of `--bulk-sizes` documents into one space, with a second
    /// tenant's five meanwhile)
    #[arg(
        long,
        default_value = "limit,relay,statements,writes,engine,peer,latency,kinds,fairness,claim,takeover,scaleout,documents"
    )]
    pub scenarios: String,
    /// How long the latency scenario creates jobs, in seconds
    #[arg(long, default_value_t = 30)]
    pub latency_secs: u64,
    /// Jobs created per second in the latency scenario
    #[arg(long, default_value_t = 200)]
    pub latency_rate: u32,
    /// Documents in the kinds scenario's space: each is compiled, researched once and deleted
    #[arg(long, default_value_t = 100)]
    pub kind_jobs: u32,
    /// The relay's window in the scenarios that run the worker, as KFS_RELAY_WINDOW: auto (a
    /// batch per consumer, what `kfs-worker run` does by default), none, or a number
    #[arg(long, default_value = "auto")]
    pub relay_window: String,
    /// The first tenant's backlog of compiles in the fairness scenario (the second commits 5),
    /// and of probe jobs in the takeover scenario
    #[arg(long, default_value_t = 1500)]
    pub fair_backlog: u32,
    /// The sizes of the bulk scenario's uploads into one space, comma-separated (not run by
    /// default: `--scenarios bulk`)
    #[arg(long, default_value = "300,1500,5000")]
    pub bulk_sizes: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scenario {
    Limit,
    Relay,
    Statements,
    Writes,
    Engine,
    Peer,
    Latency,
    Kinds,
    Fairness,
    Claim,
    Takeover,
    Scaleout,
    Documents,
    Bulk,
}

impl Scenario {
    pub const ALL: [Scenario; 14] = [
        Scenario::Limit,
        Scenario::Relay,
        Scenario::Statements,
        Scenario::Writes,
        Scenario::Engine,
        Scenario::Peer,
        Scenario::Latency,
        Scenario::Kinds,
        Scenario::Fairness,
        Scenario::Claim,
        Scenario::Takeover,
        Scenario::Scaleout,
        Scenario::Documents,
        Scenario::Bulk,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::Limit => "limit",
            Scenario::Relay => "relay",
            Scenario::Engine => "engine",
            Scenario::Statements => "statements",
            Scenario::Writes => "writes",
            Scenario::Peer => "peer",
            Scenario::Latency => "latency",
            Scenario::Kinds => "kinds",
            Scenario::Fairness => "fairness",
            Scenario::Claim => "claim",
            Scenario::Takeover => "takeover",
            Scenario::Scaleout => "scaleout",
            Scenario::Documents => "documents",
            Scenario::Bulk => "bulk",
        }
    }

    /// Parses `a,b,…` into scenarios in their canonical order (the limit, the relay and the
    /// statements run before the engine that is compared with them), without repeats.
    pub fn parse_list(raw: &str) -> Result<Vec<Scenario>, String> {
        let mut out = Vec::new();
        for part in raw.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let s = Scenario::ALL
                .into_iter()
                .find(|s| s.name() == part)
                .ok_or_else(|| {
                    format!("unknown scenario '{part}'; expected limit, relay, statements, writes, engine, peer, latency, kinds, fairness, claim, takeover, scaleout, documents or bulk")
                })?;
            if !out.contains(&s) {
                out.push(s);
            }
        }
        if out.is_empty() {
            return Err("names no scenario".into());
        }
        out.sort();
        Ok(out)
    }
}

impl BenchArgs {
    fn params(&self) -> Result<(Vec<Scenario>, Params), ConfigError> {
        let scenarios = Scenario::parse_list(&self.scenarios)
            .map_err(|e| ConfigError::new("--scenarios", e))?;
        if !(1..=10_000_000).contains(&self.jobs) {
            return Err(ConfigError::new("--jobs", "must be between 1 and 10000000"));
        }
        if !(1..=16).contains(&self.workers) {
            return Err(ConfigError::new("--workers", "must be between 1 and 16"));
        }
        if self.inflight == 0 {
            return Err(ConfigError::new("--inflight", "must be at least 1"));
        }
        if self.batch_max == 0 {
            return Err(ConfigError::new("--batch-max", "must be at least 1"));
        }
        if !(1..=3600).contains(&self.latency_secs) {
            return Err(ConfigError::new(
                "--latency-secs",
                "must be between 1 and 3600",
            ));
        }
        if !(1..=5000).contains(&self.latency_rate) {
            return Err(ConfigError::new(
                "--latency-rate",
                "must be between 1 and 5000",
            ));
        }
        let windows = crate::relay::window::Windows::parse(
            &self.relay_window,
            self.batch_max.min(self.inflight),
        )
        .map_err(|e| ConfigError::new("--relay-window", e))?;
        if !(1..=100_000).contains(&self.fair_backlog) {
            return Err(ConfigError::new(
                "--fair-backlog",
                "must be between 1 and 100000",
            ));
        }
        if !(1..=10_000).contains(&self.kind_jobs) {
            return Err(ConfigError::new(
                "--kind-jobs",
                "must be between 1 and 10000",
            ));
        }
        let bulk_sizes = self
            .bulk_sizes
            .split(',')
            .map(|s| s.trim().parse::<usize>().ok().filter(|n| (1..=100_000).contains(n)))
            .collect::<Option<Vec<usize>>>()
            .filter(|v| !v.is_empty())
            .ok_or_else(|| {
                ConfigError::new(
                    "--bulk-sizes",
                    "must be comma-separated numbers of documents from 1 to 100000, e.g. 300,1500,5000",
                )
            })?;
        Ok((
            scenarios,
            Params {
                jobs: self.jobs,
                workers: self.workers,
                inflight: self.inflight,
                batch_max: self.batch_max.min(self.inflight),
                latency_secs: self.latency_secs,
                latency_rate: self.latency_rate,
                kind_jobs: self.kind_jobs,
                fair_backlog: self.fair_backlog,
                windows,
                window_setting: self.relay_window.clone(),
                interactive: !self.json,
                bulk_sizes,
            },
        ))
    }
}

pub async fn run(conn: &ConnArgs, args: &BenchArgs) -> Result<(), Failure> {
    let (scenarios, params) = args.params()?;
    let services = conn.services()?;
    let pool = crate::db::connect(
        &services.database_url,
        "kfs-worker bench",
        1,
        services.connect_timeout,
    )
    .await
    .map_err(Failure::usage)?;
    crate::broker::connect(
        &services.amqp_url,
        "kfs-worker bench",
        services.connect_timeout,
    )
    .await
    .map_err(Failure::usage)?
    .close(200, "checked".into())
    .await
    .ok();
    let machine = machine::read(&services, &pool).await;
    pool.close().await;
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "machine": machine, "jobs": params.jobs, "inflight": params.inflight, "batch_max": params.batch_max })
        );
    } else {
        println!(
            "kfs-worker bench: {} cores ({}), {} GiB, load {}; PostgreSQL {}, RabbitMQ {}; {} build",
            machine.cores,
            machine.cpu,
            machine.memory_gib,
            machine.load_1m,
            machine.postgres,
            machine.rabbitmq,
            machine.build
        );
        println!(
            "jobs {}, in flight {}, scenarios {}\n",
            params.jobs,
            params.inflight,
            scenarios
                .iter()
                .map(|s| s.name())
                .collect::<Vec<_>>()
                .join(",")
        );
    }

    let mut same_run = SameRun::default();
    let mut rows = Vec::new();
    let mut undone = Vec::new();
    for s in scenarios {
        let mut report = one(&services, s, &params, same_run.limit_rate)
            .await
            .map_err(|e| Failure::runtime(format!("bench {}: {e}", s.name())))?;
        match s {
            Scenario::Engine => report.ratio_ceiling = same_run.engine_ceiling(),
            Scenario::Writes => report.ratio_ceiling = same_run.protocol_ceiling(&report),
            _ => {}
        }
        same_run.record(s, &report);
        if report.skipped.is_none() && report.done < report.n {
            undone.push(format!("{}: {} of {}", s.name(), report.done, report.n));
        }
        if args.json {
            println!("{}", serde_json::to_string(&report).unwrap_or_default());
        } else {
            rows.extend(report.rows());
            if std::io::stdout().is_terminal() {
                // Show each result as it comes, then the whole table at the end.
                println!("{}", report::table(&report.rows()));
            }
        }
    }
    if !args.json {
        print!("{}", report::table(&rows));
    }
    if undone.is_empty() {
        Ok(())
    } else {
        Err(Failure::runtime(format!(
            "bench: work left undone ({})",
            undone.join("; ")
        )))
    }
}

/// What the scenarios before this one measured in the same run, for the ratios of the later ones.
#[derive(Debug, Default)]
struct SameRun {
    limit_rate: Option<f64>,
    /// The relay's least CPU per row: its statements alone plus the raw publishes.
    relay_floor_ms: Option<f64>,
    /// The raw publishes alone (the relay scenario's best of two), CPU per message.
    publish_ms: Option<f64>,
    /// The consumer's statements alone, CPU per job.
    statements_ms: Option<f64>,
}

impl SameRun {
    fn record(&mut self, s: Scenario, r: &Report) {
        match s {
            Scenario::Limit => self.limit_rate = Some(r.rate),
            Scenario::Relay => {
                self.relay_floor_ms = r.floor_cpu_ms;
                self.publish_ms = r.runs.first().and_then(|raw| raw.cpu_ms);
            }
            Scenario::Statements => self.statements_ms = r.cpu_ms,
            _ => {}
        }
    }

    /// The highest engine ÷ limit the cores allow: each job needs the relay's statements and
    /// publish and the consumer's statements, each no cheaper than alone in this run (the
    /// broker's delivery and ack are not counted, so the true ceiling is lower still).
    fn engine_ceiling(&self) -> Option<f64> {
        let limit = self.limit_rate.filter(|r| *r > 0.0)?;
        report::cpu_ceiling(&[self.relay_floor_ms, self.statements_ms]).map(|c| c / limit)
    }

    /// The highest engine ÷ limit the cores allow any engine that keeps the protocol, with the
    /// same batches: each job needs the protocol's row versions (`writes`, written by the
    /// plainest statements) and its publish, each no cheaper than alone in this run; reads,
    /// fences, the broker's delivery and ack, and the worker's own CPU all come on top.
    fn protocol_ceiling(&self, writes: &Report) -> Option<f64> {
        let limit = self.limit_rate.filter(|r| *r > 0.0)?;
        report::cpu_ceiling(&[writes.cpu_ms, self.publish_ms]).map(|c| c / limit)
    }
}

async fn one(
    services: &crate::config::Services,
    s: Scenario,
    p: &Params,
    limit: Option<f64>,
) -> Result<Report, String> {
    if s == Scenario::Scaleout {
        return scenarios::scaleout(services, p).await;
    }
    if s == Scenario::Takeover {
        return scenarios::takeover(services, p).await;
    }
    if s == Scenario::Fairness {
        return scenarios::fairness(services, p).await;
    }
    let env = env::BenchEnv::new(services, s.name()).await?;
    let r = match s {
        Scenario::Limit => scenarios::limit(&env, p).await,
        Scenario::Relay => scenarios::relay(&env, p).await,
        Scenario::Engine => scenarios::engine(&env, p, limit).await,
        Scenario::Statements => scenarios::statements(&env, p, limit).await,
        Scenario::Writes => scenarios::writes(&env, p).await,
        Scenario::Peer => scenarios::peer(&env, p, limit).await,
        Scenario::Latency => scenarios::latency(&env, p).await,
        Scenario::Kinds => scenarios::kinds(&env, p).await,
        Scenario::Claim => scenarios::claim(&env, p).await,
        Scenario::Documents => scenarios::documents(&env, p).await,
        Scenario::Bulk => scenarios::bulk(&env, p).await,
        Scenario::Scaleout | Scenario::Takeover | Scenario::Fairness => {
            unreachable!("handled above")
        }
    };
    env.cleanup().await;
    r
}

#[cfg(test)]
mod tests {
    use super::{report, Report, SameRun, Scenario};

    #[test]
    fn the_engine_ceiling_needs_the_limit_the_relay_and_the_statements_of_the_same_run() {
        let cores = std::thread::available_parallelism().unwrap().get() as f64;
        let mut same = SameRun::default();
        let limit = Report {
            rate: cores * 1000.0,
            ..Report::default()
        };
        let relay = Report {
            floor_cpu_ms: Some(0.25),
            ..Report::default()
        };
        let statements = Report {
            cpu_ms: Some(0.25),
            ..Report::default()
        };
        same.record(Scenario::Limit, &limit);
        same.record(Scenario::Relay, &relay);
        assert_eq!(same.engine_ceiling(), None, "statements not measured");
        same.record(Scenario::Statements, &statements);
        // 0.5 ms per job on every core: 2,000 jobs/s per core, against 1,000 msg/s per core.
        assert_eq!(same.engine_ceiling(), Some(2.0));
        assert_eq!(
            same.engine_ceiling(),
            report::cpu_ceiling(&[Some(0.25), Some(0.25)]).map(|c| c / limit.rate)
        );
        same.record(Scenario::Limit, &Report::default());
        assert_eq!(same.engine_ceiling(), None, "a limit that measured nothing");
    }

    #[test]
    fn the_protocol_ceiling_needs_the_limit_and_the_publishes_of_the_same_run() {
        let cores = std::thread::available_parallelism().unwrap().get() as f64;
        let mut same = SameRun::default();
        let writes = Report {
            cpu_ms: Some(0.3),
            ..Report::default()
        };
        let relay = Report {
            floor_cpu_ms: Some(0.5),
            runs: vec![
                report::Run {
                    cpu_ms: Some(0.1),
                    ..report::Run::default()
                },
                report::Run {
                    cpu_ms: Some(0.4),
                    ..report::Run::default()
                },
            ],
            ..Report::default()
        };
        same.record(
            Scenario::Limit,
            &Report {
                rate: cores * 1000.0,
                ..Report::default()
            },
        );
        assert_eq!(
            same.protocol_ceiling(&writes),
            None,
            "publishes not measured"
        );
        same.record(Scenario::Relay, &relay);
        // The writes' 0.3 ms and the raw publishes' 0.1 ms (not the relay's statements, which
        // the writes already hold): 2,500 jobs/s per core against 1,000 msg/s per core.
        let ceiling = same.protocol_ceiling(&writes).unwrap();
        assert!((ceiling - 2.5).abs() < 1e-9, "{ceiling}");
        assert_eq!(
            same.protocol_ceiling(&Report::default()),
            None,
            "writes not measured"
        );
    }

    #[test]
    fn scenario_lists_parse_in_canonical_order() {
        assert_eq!(
            Scenario::parse_list("engine, limit,engine").unwrap(),
            vec![Scenario::Limit, Scenario::Engine]
        );
        assert_eq!(
            Scenario::parse_list(
                "limit,relay,statements,writes,engine,peer,latency,kinds,fairness,claim,takeover,scaleout,documents,bulk"
            )
            .unwrap(),
            Scenario::ALL.to_vec()
        );
        assert!(Scenario::parse_list("fast")
            .unwrap_err()
            .contains("unknown scenario 'fast'"));
        assert!(Scenario::parse_list(" , ").is_err());
    }
}
