//! The `kfs-worker` binary: parses the command line, starts logging, and hands over to
//! [`kfs_worker::cli`].

use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = match kfs_worker::cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return kfs_worker::cli::usage_error(e),
    };
    if let Err(e) = kfs_worker::telemetry::check_env() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    // Long-running commands log at info; one-shot commands speak through their own output,
    // and the AMQP client's own error lines would only repeat what the command says.
    let filter = match cli.command {
        kfs_worker::cli::Command::Run(_) => "info,sqlx=warn,lapin=warn,amq_protocol=warn",
        kfs_worker::cli::Command::Demo(_) => "warn,sqlx=error,lapin=off,amq_protocol=off",
        _ => "warn,sqlx=error,lapin=off,amq_protocol=off",
    };
    let _telemetry = kfs_worker::telemetry::init(filter);
    kfs_worker::cli::run(cli).await
}
