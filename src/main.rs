//! The `kfs-worker` binary: parses the command line, starts logging, and hands over to
//! [`kfs_worker::cli`].

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // Before any thread exists: putting the values in the environment is only sound while no
    // other thread reads it, and the flags' parser reads them from there like any setting.
    match kfs_worker::config::secrets_from_files(|name| std::env::var(name).ok()) {
        Ok(found) => {
            for (name, value) in found {
                std::env::set_var(name, value);
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("the async runtime starts")
        .block_on(run())
}

async fn run() -> ExitCode {
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
