//! The command line. Invariant: every command validates its input before it touches a
//! service, and a bad input ends in one line on stderr naming the problem, with exit code 2.
//!
//! Here: the top level (`Cli`, `Command` and the dispatch) and clap's refusals; the connection
//! flags every command shares and the failure a command ends with are in [`crate::command`],
//! below the kinds, so a kind's subcommands need nothing from here. Each group of
//! subcommands has its own file (`run`, `status`, `dlq`, and `setup` for `migrate` and
//! `check`); the kind-specific subcommands live with their kind, in `jobs/<kind>/cli.rs`, and
//! the dev tools' in `tools`.

mod dlq;
mod run;
mod setup;
mod status;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub use crate::command::{ConnArgs, Failure};

pub use dlq::{DlqAction, DlqArgs};
pub use run::RunArgs;
pub use status::StatusArgs;

#[derive(Debug, Parser)]
#[command(
    name = "kfs-worker",
    version,
    about = "Background-job runtime of the knowledge platform: outbox relay and ack-after-commit consumers over Postgres and RabbitMQ"
)]
pub struct Cli {
    #[command(flatten)]
    pub conn: ConnArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// `kfs-worker migrate`'s own flags.
#[derive(Debug, Default, clap::Args)]
pub struct MigrateArgs {
    /// On a platform database that the platform's migrations left before 0054, apply the
    /// missing platform migrations as the platform's own runner would (each once, in order,
    /// recorded in schema_migrations, rows kept) instead of refusing
    #[arg(long)]
    pub upgrade_platform: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the database migrations (adopts an existing platform database at its migration 0054)
    Migrate(MigrateArgs),
    /// Check that Postgres and RabbitMQ are reachable and accept the credentials
    Check,
    /// Run the relay, the consumers, maintenance and the leased jobs until SIGTERM/SIGINT
    Run(Box<RunArgs>),
    /// Jobs by state, outbox by status, relay lag and dead letters, per kind
    Status(StatusArgs),
    /// The main job end to end: compile documents, research them, delete a source, survive a kill
    Demo(crate::tools::demo::DemoArgs),
    /// Request, retry and inspect document compilations
    Compile(crate::jobs::compile::cli::CompileArgs),
    /// Request deletions of spaces, sources and documents, and retry failed ones
    #[command(name = "delete", alias = "deletion")]
    Delete(crate::jobs::deletion::cli::DeleteArgs),
    /// Request, control (pause, resume, cancel) and follow research tasks
    Research(crate::jobs::research::cli::ResearchArgs),
    /// Queue, retry and inspect the page-index upgrade backfill of a space's published head
    #[command(name = "pageindex")]
    PageIndex(crate::jobs::pageindex::cli::PageIndexArgs),
    /// Measure throughput and latency next to the bare publish-consume-commit loop (see BENCHMARKS.md)
    Bench(crate::tools::bench::BenchArgs),
    /// List the dead-letter queue, or requeue one of its messages
    Dlq(DlqArgs),
}

/// Reports a command line clap refused. A value it could not parse gets one line that names
/// the flag and its environment variable, like every other configuration error; help, version
/// and usage mistakes keep clap's own output.
pub fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::{ContextKind, ErrorKind};
    if !matches!(
        e.kind(),
        ErrorKind::InvalidValue | ErrorKind::ValueValidation
    ) {
        e.exit();
    }
    let invalid = e
        .get(ContextKind::InvalidArg)
        .map(ToString::to_string)
        .unwrap_or_default();
    let env = env_of(&<Cli as clap::CommandFactory>::command(), &invalid);
    let first = e.to_string();
    let first = first.lines().next().unwrap_or("invalid value").trim();
    let first = first.strip_prefix("error: ").unwrap_or(first);
    match env {
        Some(var) => eprintln!("error: {var}: {first}"),
        None => eprintln!("error: {first}"),
    }
    ExitCode::from(2)
}

/// The environment variable behind the flag clap names as `--flag <VALUE>`, in any subcommand.
fn env_of(cmd: &clap::Command, invalid: &str) -> Option<String> {
    let flag = invalid.split_whitespace().next()?.trim_start_matches('-');
    cmd.get_arguments()
        .find(|a| a.get_long() == Some(flag))
        .and_then(|a| a.get_env())
        .map(|v| v.to_string_lossy().into_owned())
        .or_else(|| cmd.get_subcommands().find_map(|sub| env_of(sub, invalid)))
}

pub async fn run(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Migrate(args) => setup::migrate(&cli.conn, &args).await,
        Command::Check => setup::check(&cli.conn).await,
        Command::Run(args) => run::run_worker(&cli.conn, &args).await,
        Command::Status(args) => status::status(&cli.conn, &args).await,
        Command::Demo(args) => crate::tools::demo::run(&cli.conn, &args).await,
        Command::Compile(args) => crate::jobs::compile::cli::run(&cli.conn, &args).await,
        Command::Delete(args) => crate::jobs::deletion::cli::run(&cli.conn, &args).await,
        Command::Research(args) => crate::jobs::research::cli::run(&cli.conn, &args).await,
        Command::PageIndex(args) => crate::jobs::pageindex::cli::run(&cli.conn, &args).await,
        Command::Bench(args) => crate::tools::bench::run(&cli.conn, &args).await,
        Command::Dlq(args) => dlq::dlq(&cli.conn, &args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("error: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}
