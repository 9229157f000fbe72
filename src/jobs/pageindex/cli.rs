//! The command line of page-index upgrade backfills:
//! `kfs-worker pageindex start|retry|show --tenant T --space S`. Invariant: arguments are
//! validated before any service is contacted; a refusal (unknown space, a backfill that cannot
//! be retried from its state) is one line on stderr with exit code 2 and changes nothing; a
//! database failure exits 1. Output is the current head's backfill as one JSON object, or
//! `null` when the head needs none.

use uuid::Uuid;

use super::RequestError;
use crate::command::{ConnArgs, Failure};

#[derive(Debug, clap::Args)]
pub struct PageIndexArgs {
    #[command(subcommand)]
    pub action: Action,
}

/// The space whose current head is meant.
#[derive(Debug, Clone, clap::Args)]
pub struct Scope {
    /// The tenant that owns the space
    #[arg(long)]
    pub tenant: String,
    /// The knowledge space
    #[arg(long, value_name = "SPACE_ID")]
    pub space: String,
}

#[derive(Debug, clap::Subcommand)]
pub enum Action {
    /// Queue a backfill for the space's published head if its page index is incomplete
    Start(Scope),
    /// Queue the head's failed backfill again (its succeeded items stay done)
    Retry(Scope),
    /// The head's backfill
    Show(Scope),
}

pub async fn run(conn: &ConnArgs, args: &PageIndexArgs) -> Result<(), Failure> {
    let scope = match &args.action {
        Action::Start(s) | Action::Retry(s) | Action::Show(s) => s,
    };
    let tenant = scope.tenant.trim();
    if tenant.is_empty() {
        return Err(Failure::usage("--tenant must not be empty"));
    }
    let space = Uuid::parse_str(scope.space.trim())
        .map_err(|_| Failure::usage(format!("--space {:?} is not a UUID", scope.space)))?;
    let pool = conn.pool("pageindex").await?;
    let result = async {
        let mut c = pool
            .acquire()
            .await
            .map_err(|e| Failure::runtime(format!("database: {e}")))?;
        match &args.action {
            Action::Start(_) => super::start(&mut c, tenant, space).await,
            Action::Retry(_) => super::retry(&mut c, tenant, space).await,
            Action::Show(_) => super::get(&mut c, tenant, space)
                .await
                .map_err(RequestError::from),
        }
        .map_err(|e| match e {
            RequestError::Db(e) => Failure::runtime(format!("database: {e}")),
            refused => Failure::usage(refused),
        })
    }
    .await;
    pool.close().await;
    let job = result?;
    println!(
        "{}",
        serde_json::to_string(&job).map_err(|e| Failure::runtime(e.to_string()))?
    );
    Ok(())
}
