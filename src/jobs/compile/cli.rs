//! The command line of compile jobs:
//! `kfs-worker compile <documentId> [--defer] [--as SUBJECT --snapshot ID | --grant ID]`,
//! `compile release <attemptId>`,
//! `compile retry <attemptId>`, `compile show <attemptId>`, `compile wait <attemptId>`.
//! Invariant: ids are validated before any service is contacted; a refusal (unknown document,
//! document deleting, an attempt already active, an attempt in the wrong state) is one line on
//! stderr with exit code 2 and changes nothing; a database failure exits 1.

use std::time::Duration;

use uuid::Uuid;

use super::request::{self, CompileError, RequestOptions, Requester};
use crate::command::{ConnArgs, Failure};

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct CompileArgs {
    #[command(subcommand)]
    pub action: Option<Action>,
    /// The document to compile (its current version)
    #[arg(value_name = "DOCUMENT_ID")]
    pub document_id: Option<String>,
    /// Write the job with its dispatch deferred until `compile release <attemptId>`
    #[arg(long)]
    pub defer: bool,
    /// The requesting subject, recorded on the attempt with --snapshot (both or neither)
    #[arg(long = "as", value_name = "SUBJECT", requires = "snapshot")]
    pub requested_by: Option<String>,
    /// The permission snapshot that authorises the request
    #[arg(long, value_name = "SNAPSHOT_ID", requires = "requested_by")]
    pub snapshot: Option<String>,
    /// The capability grant that authorises the request, in place of --as/--snapshot
    #[arg(long, value_name = "GRANT_ID", conflicts_with_all = ["requested_by", "snapshot"])]
    pub grant: Option<String>,
}

#[derive(Debug, clap::Subcommand)]
pub enum Action {
    /// Release a deferred dispatch: the relay sends the job now
    Release {
        #[arg(value_name = "ATTEMPT_ID")]
        attempt_id: String,
    },
    /// Re-arm a failed attempt (same attempt, same outbox row)
    Retry {
        #[arg(value_name = "ATTEMPT_ID")]
        attempt_id: String,
    },
    /// Print an attempt and its outbox row as JSON
    Show {
        #[arg(value_name = "ATTEMPT_ID")]
        attempt_id: String,
    },
    /// Wait until an attempt ends, then print it as JSON (exit 1 unless it succeeded)
    Wait {
        #[arg(value_name = "ATTEMPT_ID")]
        attempt_id: String,
        /// How long to wait, e.g. 60s
        #[arg(long, default_value = "60s")]
        timeout: String,
    },
}

fn uuid_arg(what: &str, raw: &str) -> Result<Uuid, Failure> {
    Uuid::parse_str(raw.trim()).map_err(|_| Failure::usage(format!("{what} {raw:?} is not a UUID")))
}

fn failure(e: CompileError) -> Failure {
    if e.is_refusal() {
        Failure::usage(e)
    } else {
        Failure::runtime(e)
    }
}

enum Plan {
    Request(Uuid, RequestOptions),
    Release(Uuid),
    Retry(Uuid),
    Show(Uuid),
    Wait(Uuid, Duration),
}

fn plan(args: &CompileArgs) -> Result<Plan, Failure> {
    match &args.action {
        Some(Action::Release { attempt_id }) => {
            Ok(Plan::Release(uuid_arg("attempt id", attempt_id)?))
        }
        Some(Action::Retry { attempt_id }) => Ok(Plan::Retry(uuid_arg("attempt id", attempt_id)?)),
        Some(Action::Show { attempt_id }) => Ok(Plan::Show(uuid_arg("attempt id", attempt_id)?)),
        Some(Action::Wait {
            attempt_id,
            timeout,
        }) => Ok(Plan::Wait(
            uuid_arg("attempt id", attempt_id)?,
            crate::config::duration("--timeout", timeout)?,
        )),
        None => {
            let raw = args.document_id.as_deref().ok_or_else(|| {
                Failure::usage(
                    "compile needs a document id, or one of: release, retry, show, wait <attemptId>",
                )
            })?;
            let requester = match (&args.requested_by, &args.snapshot) {
                (Some(subject), Some(snapshot)) => {
                    let subject = subject.trim();
                    if subject.is_empty() {
                        return Err(Failure::usage("--as needs a subject id"));
                    }
                    Some(Requester {
                        subject: subject.to_owned(),
                        snapshot: uuid_arg("snapshot id", snapshot)?,
                    })
                }
                _ => None,
            };
            let grant = match &args.grant {
                Some(g) if requester.is_some() => {
                    return Err(Failure::usage(format!(
                        "--grant {g:?} cannot be combined with --as/--snapshot: one authority only"
                    )))
                }
                Some(g) => Some(uuid_arg("grant id", g)?),
                None => None,
            };
            Ok(Plan::Request(
                uuid_arg("document id", raw)?,
                RequestOptions {
                    defer: args.defer,
                    requester,
                    grant,
                },
            ))
        }
    }
}

pub async fn run(conn: &ConnArgs, args: &CompileArgs) -> Result<(), Failure> {
    let plan = plan(args)?;
    let pool = conn.pool("compile").await?;
    let result = execute(&pool, plan).await;
    pool.close().await;
    result
}

async fn execute(pool: &sqlx::PgPool, plan: Plan) -> Result<(), Failure> {
    let db = |e: sqlx::Error| Failure::runtime(format!("database: {e}"));
    match plan {
        Plan::Request(document, opts) => {
            let mut tx = pool.begin().await.map_err(db)?;
            let attempt = request::request(&mut tx, document, opts)
                .await
                .map_err(failure)?;
            tx.commit().await.map_err(db)?;
            println!("{attempt}");
        }
        Plan::Release(attempt) => {
            let mut tx = pool.begin().await.map_err(db)?;
            request::release(&mut tx, attempt).await.map_err(failure)?;
            tx.commit().await.map_err(db)?;
            println!("released {attempt}");
        }
        Plan::Retry(attempt) => {
            let mut tx = pool.begin().await.map_err(db)?;
            request::retry(&mut tx, attempt).await.map_err(failure)?;
            tx.commit().await.map_err(db)?;
            println!("retrying {attempt}");
        }
        Plan::Show(attempt) => {
            let mut conn = pool.acquire().await.map_err(db)?;
            let status = request::show(&mut conn, attempt).await.map_err(failure)?;
            print_json(&status);
        }
        Plan::Wait(attempt, timeout) => {
            let status = request::wait(pool, attempt, timeout)
                .await
                .map_err(failure)?;
            print_json(&status);
            if status.run_state != "succeeded" {
                return Err(Failure::runtime(format!(
                    "attempt {attempt} ended {}{}",
                    status.run_state,
                    status
                        .last_error_code
                        .as_deref()
                        .map(|c| format!(" ({c})"))
                        .unwrap_or_default()
                )));
            }
        }
    }
    Ok(())
}

fn print_json(status: &request::AttemptStatus) {
    match serde_json::to_string_pretty(status) {
        Ok(s) => println!("{s}"),
        Err(_) => println!("{status:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, clap::Parser)]
    struct Top {
        #[command(flatten)]
        args: CompileArgs,
    }

    fn parse(argv: &[&str]) -> Result<Plan, Failure> {
        let top = Top::try_parse_from(std::iter::once("compile").chain(argv.iter().copied()))
            .map_err(|e| Failure::usage(e.to_string()))?;
        plan(&top.args)
    }

    #[test]
    fn arguments_are_checked_before_any_service() {
        let id = "0198c6a0-0000-7000-8000-000000000001";
        assert!(matches!(
            parse(&[id]),
            Ok(Plan::Request(
                _,
                RequestOptions {
                    defer: false,
                    requester: None,
                    grant: None,
                }
            ))
        ));
        assert!(matches!(
            parse(&[id, "--defer"]),
            Ok(Plan::Request(
                _,
                RequestOptions {
                    defer: true,
                    requester: None,
                    grant: None,
                }
            ))
        ));
        let snap = "0198c6a0-0000-7000-8000-000000000002";
        assert!(matches!(
            parse(&[id, "--as", "alice", "--snapshot", snap]),
            Ok(Plan::Request(_, RequestOptions { requester: Some(Requester { subject, .. }), .. }))
                if subject == "alice"
        ));
        assert!(
            parse(&[id, "--as", "alice"]).is_err(),
            "--as needs --snapshot"
        );
        assert!(
            parse(&[id, "--snapshot", snap]).is_err(),
            "--snapshot needs --as"
        );
        assert!(parse(&[id, "--as", " ", "--snapshot", snap]).is_err());
        let grant = "0198c6a0-0000-7000-8000-000000000003";
        assert!(matches!(
            parse(&[id, "--grant", grant]),
            Ok(Plan::Request(_, RequestOptions { requester: None, grant: Some(g), .. }))
                if g.to_string() == grant
        ));
        for both in [
            &[id, "--grant", grant, "--as", "alice", "--snapshot", snap][..],
            &[id, "--grant", grant, "--snapshot", snap],
            &[id, "--grant", "not-a-grant"],
        ] {
            let e = parse(both).err().expect("refused");
            assert_eq!(e.code, 2, "{both:?}: {}", e.message);
        }
        assert!(parse(&[id, "--as", "alice", "--snapshot", "nope"]).is_err());
        assert!(matches!(parse(&["release", id]), Ok(Plan::Release(_))));
        assert!(matches!(parse(&["retry", id]), Ok(Plan::Retry(_))));
        assert!(matches!(parse(&["show", id]), Ok(Plan::Show(_))));
        assert!(matches!(
            parse(&["wait", id, "--timeout", "5s"]),
            Ok(Plan::Wait(_, d)) if d == Duration::from_secs(5)
        ));
        for bad in [
            &["not-a-uuid"][..],
            &["retry", "x"],
            &[],
            &["wait", id, "--timeout", "soon"],
        ] {
            let e = parse(bad).err().expect("refused");
            assert_eq!(e.code, 2, "{bad:?}: {}", e.message);
        }
    }
}
