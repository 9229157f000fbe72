//! The command line of research tasks:
//!
//! ```text
//! kfs-worker research <spaceId> "<question>" --subject <s> --snapshot <id> [--channel interactive]
//!            [--budget-usd X] [--top-k N] [--mode auto] [--idempotency-key K]
//! kfs-worker research <spaceId> "<question>" --grant <id> [--budget-usd X] [--top-k N] ...
//! kfs-worker research pause|cancel <jobId> [--reason R]
//! kfs-worker research resume <jobId>
//! kfs-worker research follow <jobId>
//! kfs-worker research show <jobId>
//! ```
//!
//! Invariant: every input is validated before Postgres is touched, a request names exactly one
//! authority (a permission snapshot with its subject, or a capability grant), and a bad input or
//! a refused request ends in one `error:` line with exit code 2 and changes nothing.

use std::time::Duration;

use uuid::Uuid;

use super::{control, follow, request, Stage};
use crate::command::{ConnArgs, Failure};
use crate::config;

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct ResearchArgs {
    #[command(subcommand)]
    pub action: Option<ResearchAction>,
    /// The knowledge space to ask
    #[arg(value_name = "SPACE_ID")]
    pub space_id: Option<String>,
    /// The question
    #[arg(value_name = "QUESTION")]
    pub question: Option<String>,
    /// Who asks (the permission snapshot's subject)
    #[arg(long)]
    pub subject: Option<String>,
    /// The permission snapshot that grants access
    #[arg(long)]
    pub snapshot: Option<String>,
    /// The capability grant that authorizes the task (instead of --subject and --snapshot)
    #[arg(long)]
    pub grant: Option<String>,
    /// Access channel of the snapshot: interactive (the default), service_api, mcp or agent
    #[arg(long)]
    pub channel: Option<String>,
    /// Most USD the answer may cost (HTTP generator)
    #[arg(long)]
    pub budget_usd: Option<String>,
    /// Evidence passages to keep (1-100; default: the space's retrieval profile, else 10)
    #[arg(long)]
    pub top_k: Option<String>,
    /// auto, fast, research or deep
    #[arg(long, default_value = "auto")]
    pub mode: String,
    /// Repeating a request with the same key returns the first task
    #[arg(long)]
    pub idempotency_key: Option<String>,
}

#[derive(Debug, clap::Subcommand)]
pub enum ResearchAction {
    /// Pause a task (the running worker is fenced out at its next write)
    Pause {
        job_id: String,
        /// Why, recorded with the task
        #[arg(long)]
        reason: Option<String>,
    },
    /// Resume a paused task where it stopped
    Resume { job_id: String },
    /// Cancel a task for good
    Cancel {
        job_id: String,
        /// Why, recorded with the task
        #[arg(long)]
        reason: Option<String>,
    },
    /// Print progress events as they commit, until the task ends
    Follow {
        job_id: String,
        /// Polling interval
        #[arg(long, default_value = "250ms")]
        poll: String,
    },
    /// Print a task's state, answer (from its final partial result) and evidence as JSON
    Show { job_id: String },
}

fn uuid(what: &str, raw: &str) -> Result<Uuid, Failure> {
    Uuid::parse_str(raw.trim())
        .map_err(|_| Failure::usage(format!("{what} must be a UUID, got '{}'", raw.trim())))
}

/// The authority the arguments name, as given.
#[derive(Debug, PartialEq, Eq)]
enum Authority<'a> {
    Snapshot { subject: &'a str, snapshot: &'a str },
    Grant(&'a str),
}

const ONE_AUTHORITY: &str =
    "a research request needs exactly one authority: --subject <s> --snapshot <id>, or --grant <id>";

/// Which one authority the arguments name: `--grant`, or `--subject` with `--snapshot` (and
/// `--channel` only with them). Pure.
fn authority(args: &ResearchArgs) -> Result<Authority<'_>, Failure> {
    let snapshot_flags = args.subject.is_some() || args.snapshot.is_some();
    match (&args.grant, snapshot_flags) {
        (Some(_), true) => Err(Failure::usage(format!(
            "{ONE_AUTHORITY}; --grant cannot be given with --subject or --snapshot"
        ))),
        (Some(_), false) if args.channel.is_some() => Err(Failure::usage(
            "--channel names a permission snapshot's channel; a request under --grant has none",
        )),
        (Some(grant), false) => Ok(Authority::Grant(grant)),
        (None, false) => Err(Failure::usage(format!("{ONE_AUTHORITY}; none was given"))),
        (None, true) => {
            let subject = args.subject.as_deref().ok_or_else(|| {
                Failure::usage("--subject is required with --snapshot: who asks the question")
            })?;
            let snapshot = args.snapshot.as_deref().ok_or_else(|| {
                Failure::usage("--snapshot is required with --subject: the permission snapshot id")
            })?;
            Ok(Authority::Snapshot { subject, snapshot })
        }
    }
}

/// The request the arguments describe. Pure: no service is touched.
pub fn parse_request(args: &ResearchArgs) -> Result<request::ResearchRequest, Failure> {
    let (Some(space), Some(question)) = (&args.space_id, &args.question) else {
        return Err(Failure::usage(
            "research needs <spaceId> \"<question>\" and either --subject <s> --snapshot <id> or --grant <id>, or one of pause, resume, cancel, follow, show",
        ));
    };
    let space_id = uuid("the space id", space)?;
    let asked_by = match authority(args)? {
        Authority::Grant(grant) => request::AskedBy::Grant(uuid("--grant", grant)?),
        Authority::Snapshot { subject, snapshot } => request::AskedBy::Snapshot {
            subject_id: subject.to_owned(),
            permission_snapshot_id: uuid("--snapshot", snapshot)?,
            access_channel: args
                .channel
                .as_deref()
                .unwrap_or("interactive")
                .trim()
                .to_owned(),
        },
    };
    let budget_usd = args
        .budget_usd
        .as_deref()
        .map(|b| {
            b.trim()
                .parse::<f64>()
                .map_err(|_| Failure::usage(format!("--budget-usd must be a number, got '{b}'")))
        })
        .transpose()?;
    let top_k = args
        .top_k
        .as_deref()
        .map(|k| {
            k.trim()
                .parse::<i32>()
                .map_err(|_| Failure::usage(format!("--top-k must be a whole number, got '{k}'")))
        })
        .transpose()?;
    let req = request::ResearchRequest {
        space_id,
        question: question.clone(),
        asked_by,
        budget_usd,
        top_k,
        mode: args.mode.trim().to_owned(),
        idempotency_key: args.idempotency_key.clone(),
    };
    req.validate().map_err(Failure::usage)?;
    Ok(req)
}

async fn pool(conn: &ConnArgs) -> Result<sqlx::PgPool, Failure> {
    conn.pool("research").await
}

fn control_failure(e: control::ControlError) -> Failure {
    if e.is_refusal() {
        Failure::usage(e)
    } else {
        Failure::runtime(e)
    }
}

pub async fn run(conn: &ConnArgs, args: &ResearchArgs) -> Result<(), Failure> {
    match &args.action {
        None => {
            let req = parse_request(args)?;
            let pool = pool(conn).await?;
            let mut c = pool.acquire().await.map_err(Failure::runtime)?;
            let done = request::request(&mut c, &req).await.map_err(|e| {
                if e.is_refusal() {
                    Failure::usage(e)
                } else {
                    Failure::runtime(e)
                }
            })?;
            // The job id alone on stdout, for scripts.
            println!("{}", done.job_id);
            Ok(())
        }
        Some(ResearchAction::Pause { job_id, .. })
        | Some(ResearchAction::Resume { job_id })
        | Some(ResearchAction::Cancel { job_id, .. }) => {
            let id = uuid("the job id", job_id)?;
            let pool = pool(conn).await?;
            let mut c = pool.acquire().await.map_err(Failure::runtime)?;
            let done = match &args.action {
                Some(ResearchAction::Pause { reason, .. }) => {
                    control::pause_with(&mut c, id, reason.as_deref()).await
                }
                Some(ResearchAction::Resume { .. }) => control::resume(&mut c, id).await,
                Some(ResearchAction::Cancel { reason, .. }) => {
                    control::cancel(&mut c, id, reason.as_deref()).await
                }
                _ => unreachable!("matched above"),
            }
            .map_err(control_failure)?;
            if done.changed {
                println!(
                    "research task {id}: {} done, {} → {}",
                    done.action.name(),
                    done.from,
                    done.to
                );
            } else {
                println!(
                    "research task {id}: already {}, nothing to {}",
                    done.to,
                    done.action.name()
                );
            }
            Ok(())
        }
        Some(ResearchAction::Follow { job_id, poll }) => {
            let id = uuid("the job id", job_id)?;
            let poll = config::duration("--poll", poll)?.max(Duration::from_millis(10));
            let pool = pool(conn).await?;
            let pretty = follow::stdout_is_terminal();
            // The bar walks the stages a task passes through on its way to completion.
            let walk = [
                Stage::Queued,
                Stage::Planning,
                Stage::Retrieving,
                Stage::Analyzing,
                Stage::Generating,
                Stage::Completed,
            ];
            let bar = crate::progress::Bar::new(walk.len() as u64 - 1, "research");
            let ended = follow::follow(&pool, id, poll, |e| {
                bar.println(follow::format_event(e, pretty));
                if let Some(i) =
                    Stage::parse(&e.stage).and_then(|s| walk.iter().position(|w| *w == s))
                {
                    bar.set(i as u64, e.stage.clone());
                }
            })
            .await
            .map_err(|e| match e {
                follow::FollowError::Db(_) => Failure::runtime(e),
                _ => Failure::usage(e),
            })?;
            if pretty {
                match &ended.error {
                    Some(err) => println!("task ended {}: {err}", ended.stage),
                    None => println!("task ended {}", ended.stage),
                }
            } else if ended.stage == super::Stage::Failed {
                // A claim that finds the attempts used up fails the job without an event of the
                // kind's: say how it ended.
                println!(
                    "ended\t{}\t{}",
                    ended.stage,
                    serde_json::json!({ "error": ended.error })
                );
            }
            Ok(())
        }
        Some(ResearchAction::Show { job_id }) => {
            let id = uuid("the job id", job_id)?;
            let pool = pool(conn).await?;
            let row: Option<serde_json::Value> = sqlx::query_scalar(
                "SELECT jsonb_build_object('id', j.id, 'tenantId', j.tenant_id, 'spaceId', j.knowledge_space_id, \
                   'query', j.query, 'mode', j.mode, 'topK', j.top_k, 'stage', j.stage, \
                   'pausedFromStage', j.paused_from_stage, 'error', j.error, 'rowVersion', j.row_version, \
                   'attempts', j.execution_attempts, 'cost', j.cost, 'budgetUsd', j.budget_usd, \
                   'subjectId', j.subject_id, 'capabilityGrantId', j.capability_grant_id, \
                   'answer', p.answer, 'result', j.metadata -> 'result', 'plan', j.metadata -> 'plan', \
                   'publication', j.metadata -> '__knowledgeFsPublishedRuntimeSnapshot' -> 'projectionSnapshot', \
                   'evidence', p.evidence_bundle) \
                 FROM research_task_jobs j \
                 LEFT JOIN research_task_partial_results p ON p.tenant_id = j.tenant_id \
                   AND p.research_task_job_id = j.id \
                   AND p.idempotency_key = 'research-task:' || j.id::text || ':final-evidence' \
                 WHERE j.id = $1",
            )
            .bind(id)
            .fetch_optional(&pool)
            .await
            .map_err(Failure::runtime)?;
            let row = row.ok_or_else(|| Failure::usage(format!("no research task {id}")))?;
            println!(
                "{}",
                serde_json::to_string_pretty(&row).unwrap_or_else(|_| row.to_string())
            );
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(flags: &[(&str, &str)]) -> ResearchArgs {
        let get = |k: &str| {
            flags
                .iter()
                .find(|(f, _)| *f == k)
                .map(|(_, v)| (*v).to_owned())
        };
        ResearchArgs {
            action: None,
            space_id: Some(Uuid::from_u128(1).to_string()),
            question: Some("How do leases expire?".into()),
            subject: get("subject"),
            snapshot: get("snapshot"),
            grant: get("grant"),
            channel: get("channel"),
            budget_usd: None,
            top_k: None,
            mode: "auto".into(),
            idempotency_key: None,
        }
    }

    #[test]
    fn a_request_names_exactly_one_authority() {
        let snap = Uuid::from_u128(2).to_string();
        let grant = Uuid::from_u128(3).to_string();
        let ok = parse_request(&args(&[("grant", &grant)])).unwrap();
        assert_eq!(ok.asked_by, request::AskedBy::Grant(Uuid::from_u128(3)));
        let ok = parse_request(&args(&[("subject", "alice"), ("snapshot", &snap)])).unwrap();
        assert_eq!(
            ok.asked_by,
            request::AskedBy::Snapshot {
                subject_id: "alice".into(),
                permission_snapshot_id: Uuid::from_u128(2),
                access_channel: "interactive".into(),
            }
        );
        // (flags, what the one error line says)
        let bad: Vec<(Vec<(&str, &str)>, &str)> = vec![
            (vec![], "none was given"),
            (
                vec![("grant", &grant), ("subject", "alice"), ("snapshot", &snap)],
                "--grant cannot be given with --subject or --snapshot",
            ),
            (
                vec![("grant", &grant), ("snapshot", &snap)],
                "cannot be given",
            ),
            (vec![("grant", &grant), ("channel", "mcp")], "--channel"),
            (vec![("grant", "nope")], "--grant must be a UUID"),
            (vec![("subject", "alice")], "--snapshot is required"),
            (vec![("snapshot", &snap)], "--subject is required"),
        ];
        for (flags, says) in bad {
            let e = parse_request(&args(&flags)).unwrap_err().message;
            assert!(e.contains(says), "{flags:?}: {e}");
            assert_eq!(e.lines().count(), 1, "{e}");
        }
    }
}
