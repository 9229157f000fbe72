//! The command line of deletion jobs:
//! `kfs-worker delete space|source|document|logical-document <id> ...`, `delete retry <jobId> ...`,
//! `delete show <jobId>`, each asked either as a subject under a permission snapshot
//! (`--as S --snapshot P [--channel C]`) or under a capability grant (`--grant G`), never both.
//! Invariant: arguments are validated before any service is contacted (no authority, or two, is
//! one usage error; so is an owner rescue under a grant); a refusal (unknown target, wrong name,
//! revision moved, permission, a revoked grant, idempotency conflict, a live job already) is one
//! line on stderr with exit code 2 and changes nothing; a database failure exits 1.

use uuid::Uuid;

use super::request::{
    self, DeletionRequest, GrantDeletionRequest, GrantRetryRequest, RequestError, RetryAuthority,
    RetryRequest, SourceMode, Target,
};
use crate::command::{ConnArgs, Failure};

#[derive(Debug, clap::Args)]
pub struct DeleteArgs {
    #[command(subcommand)]
    pub action: Action,
}

/// Who asks: a subject under a permission snapshot, or a capability grant.
#[derive(Debug, Clone, clap::Args)]
pub struct Actor {
    /// The subject asking (as the platform authenticated it), with --snapshot
    #[arg(long = "as", value_name = "SUBJECT")]
    pub subject: Option<String>,
    /// The permission snapshot that authorises the subject
    #[arg(long, value_name = "SNAPSHOT_ID")]
    pub snapshot: Option<String>,
    /// interactive (the default), service_api, mcp or agent (must match the snapshot)
    #[arg(long)]
    pub channel: Option<String>,
    /// The capability grant that authorises the request, in place of --as/--snapshot
    #[arg(long, value_name = "GRANT_ID")]
    pub grant: Option<String>,
    /// Idempotency key of this request (default: a fresh one)
    #[arg(long)]
    pub idempotency_key: Option<String>,
}

/// Where the target lives.
#[derive(Debug, Clone, clap::Args)]
pub struct Scope {
    /// The tenant that owns the space
    #[arg(long)]
    pub tenant: String,
    /// The revision the caller saw; the request is refused if the target moved since
    #[arg(long)]
    pub revision: Option<i32>,
}

#[derive(Debug, clap::Subcommand)]
pub enum Action {
    /// Delete a whole knowledge space (needs its name as confirmation)
    Space {
        #[arg(value_name = "SPACE_ID")]
        space_id: String,
        #[command(flatten)]
        scope: Scope,
        /// The space's exact name: the name challenge
        #[arg(long)]
        confirm_name: String,
        #[command(flatten)]
        actor: Actor,
    },
    /// Delete a source: `keep` detaches its documents, `cascade` deletes them
    Source {
        #[arg(value_name = "SOURCE_ID")]
        source_id: String,
        #[arg(long, value_name = "SPACE_ID")]
        space: String,
        #[command(flatten)]
        scope: Scope,
        #[arg(long, value_parser = ["keep", "cascade"])]
        mode: String,
        #[command(flatten)]
        actor: Actor,
    },
    /// Delete one document (a document asset)
    Document {
        #[arg(value_name = "DOCUMENT_ID")]
        document_id: String,
        #[arg(long, value_name = "SPACE_ID")]
        space: String,
        #[command(flatten)]
        scope: Scope,
        #[command(flatten)]
        actor: Actor,
    },
    /// Delete a logical document with the assets only its revisions use (--revision: its
    /// row_version, which may be 0)
    LogicalDocument {
        #[arg(value_name = "DOCUMENT_ID")]
        document_id: String,
        #[arg(long, value_name = "SPACE_ID")]
        space: String,
        #[command(flatten)]
        scope: Scope,
        #[command(flatten)]
        actor: Actor,
    },
    /// Retry a failed deletion job, as its requester or (--owner-rescue) as an interactive owner
    Retry {
        #[arg(value_name = "JOB_ID")]
        job_id: String,
        /// Act as a space owner rescuing someone else's failed deletion (interactive only)
        #[arg(long)]
        owner_rescue: bool,
        #[command(flatten)]
        actor: Actor,
    },
    /// Print a deletion job, its items by status and its outbox revisions as JSON
    Show {
        #[arg(value_name = "JOB_ID")]
        job_id: String,
    },
}

fn uuid_arg(what: &str, raw: &str) -> Result<Uuid, Failure> {
    Uuid::parse_str(raw.trim()).map_err(|_| Failure::usage(format!("{what} {raw:?} is not a UUID")))
}

fn failure(e: RequestError) -> Failure {
    match e {
        RequestError::Db(_) => Failure::runtime(e),
        other => Failure::usage(other),
    }
}

#[derive(Debug)]
enum Plan {
    Request(DeletionRequest),
    GrantRequest(GrantDeletionRequest),
    Retry(RetryRequest),
    GrantRetry(GrantRetryRequest),
    Show(Uuid),
}

/// The one authority the arguments name.
enum Authority {
    Snapshot {
        subject: String,
        snapshot: Uuid,
        channel: String,
    },
    Grant(Uuid),
}

fn authority(actor: &Actor) -> Result<Authority, Failure> {
    match (&actor.subject, &actor.snapshot, &actor.grant) {
        (Some(subject), Some(snapshot), None) => Ok(Authority::Snapshot {
            subject: subject.clone(),
            snapshot: uuid_arg("permission snapshot id", snapshot)?,
            channel: actor
                .channel
                .clone()
                .unwrap_or_else(|| "interactive".to_owned()),
        }),
        (None, None, Some(grant)) if actor.channel.is_none() => {
            Ok(Authority::Grant(uuid_arg("capability grant id", grant)?))
        }
        (None, None, Some(_)) => Err(Failure::usage(
            "--channel goes with --snapshot; a capability grant carries no channel",
        )),
        _ => Err(Failure::usage(
            "name exactly one authority: --as SUBJECT --snapshot SNAPSHOT_ID, or --grant GRANT_ID",
        )),
    }
}

fn key(actor: &Actor) -> String {
    actor
        .idempotency_key
        .clone()
        .unwrap_or_else(|| format!("cli:{}", Uuid::new_v4()))
}

fn deletion(space: Uuid, target: Target, scope: &Scope, actor: &Actor) -> Result<Plan, Failure> {
    Ok(match authority(actor)? {
        Authority::Snapshot {
            subject,
            snapshot,
            channel,
        } => Plan::Request(DeletionRequest {
            tenant_id: scope.tenant.clone(),
            knowledge_space_id: space,
            target,
            expected_revision: scope.revision,
            requested_by_subject_id: subject,
            permission_snapshot_id: snapshot,
            access_channel: channel,
            idempotency_key: key(actor),
        }),
        Authority::Grant(grant) => Plan::GrantRequest(GrantDeletionRequest {
            tenant_id: scope.tenant.clone(),
            knowledge_space_id: space,
            target,
            expected_revision: scope.revision,
            capability_grant_id: grant,
            idempotency_key: key(actor),
        }),
    })
}

fn plan(args: &DeleteArgs) -> Result<Plan, Failure> {
    match &args.action {
        Action::Space {
            space_id,
            scope,
            confirm_name,
            actor,
        } => deletion(
            uuid_arg("space id", space_id)?,
            Target::Space {
                confirm_name: confirm_name.clone(),
            },
            scope,
            actor,
        ),
        Action::Source {
            source_id,
            space,
            scope,
            mode,
            actor,
        } => deletion(
            uuid_arg("space id", space)?,
            Target::Source {
                id: uuid_arg("source id", source_id)?,
                mode: SourceMode::parse(mode).ok_or_else(|| {
                    Failure::usage(format!("mode {mode:?} is not keep or cascade"))
                })?,
            },
            scope,
            actor,
        ),
        Action::Document {
            document_id,
            space,
            scope,
            actor,
        } => deletion(
            uuid_arg("space id", space)?,
            Target::Document {
                id: uuid_arg("document id", document_id)?,
            },
            scope,
            actor,
        ),
        Action::LogicalDocument {
            document_id,
            space,
            scope,
            actor,
        } => deletion(
            uuid_arg("space id", space)?,
            Target::LogicalDocument {
                id: uuid_arg("logical document id", document_id)?,
            },
            scope,
            actor,
        ),
        Action::Retry {
            job_id,
            owner_rescue,
            actor,
        } => {
            let job_id = uuid_arg("job id", job_id)?;
            match authority(actor)? {
                Authority::Grant(_) if *owner_rescue => Err(Failure::usage(
                    "an owner rescue is interactive, under a permission snapshot; under a grant only the original requester retries",
                )),
                Authority::Grant(grant) => Ok(Plan::GrantRetry(GrantRetryRequest {
                    job_id,
                    capability_grant_id: grant,
                    idempotency_key: key(actor),
                })),
                Authority::Snapshot {
                    subject,
                    snapshot,
                    channel,
                } => Ok(Plan::Retry(RetryRequest {
                    job_id,
                    actor_subject_id: subject,
                    permission_snapshot_id: snapshot,
                    access_channel: channel,
                    authority: if *owner_rescue {
                        RetryAuthority::InteractiveOwnerRescue
                    } else {
                        RetryAuthority::OriginalRequester
                    },
                    idempotency_key: key(actor),
                })),
            }
        }
        Action::Show { job_id } => Ok(Plan::Show(uuid_arg("job id", job_id)?)),
    }
}

pub async fn run(conn: &ConnArgs, args: &DeleteArgs) -> Result<(), Failure> {
    let plan = plan(args)?;
    let pool = conn.pool("delete").await?;
    let result = execute(&pool, plan).await;
    pool.close().await;
    result
}

fn print_requested(r: &request::Requested, key: &str) {
    println!(
        "{}",
        serde_json::json!({
            "jobId": r.job_id,
            "outboxId": r.outbox_id,
            "created": r.created,
            "idempotencyKey": key,
        })
    );
}

fn print_retried(r: &request::Retried, key: &str) {
    println!(
        "{}",
        serde_json::json!({
            "jobId": r.job_id,
            "outboxId": r.outbox_id,
            "deliveryRevision": r.delivery_revision,
            "created": r.created,
            "idempotencyKey": key,
        })
    );
}

async fn execute(pool: &sqlx::PgPool, plan: Plan) -> Result<(), Failure> {
    let db = |e: sqlx::Error| Failure::runtime(format!("database: {e}"));
    match plan {
        Plan::Request(req) => {
            let mut tx = pool.begin().await.map_err(db)?;
            let r = request::request_deletion(&mut tx, &req)
                .await
                .map_err(failure)?;
            tx.commit().await.map_err(db)?;
            print_requested(&r, &req.idempotency_key);
        }
        Plan::GrantRequest(req) => {
            let mut tx = pool.begin().await.map_err(db)?;
            let r = request::request_deletion_under_grant(&mut tx, &req)
                .await
                .map_err(failure)?;
            tx.commit().await.map_err(db)?;
            print_requested(&r, &req.idempotency_key);
        }
        Plan::Retry(req) => {
            let mut tx = pool.begin().await.map_err(db)?;
            let r = request::retry_deletion(&mut tx, &req)
                .await
                .map_err(failure)?;
            tx.commit().await.map_err(db)?;
            print_retried(&r, &req.idempotency_key);
        }
        Plan::GrantRetry(req) => {
            let mut tx = pool.begin().await.map_err(db)?;
            let r = request::retry_deletion_under_grant(&mut tx, &req)
                .await
                .map_err(failure)?;
            tx.commit().await.map_err(db)?;
            print_retried(&r, &req.idempotency_key);
        }
        Plan::Show(job) => {
            let row: Option<serde_json::Value> = sqlx::query_scalar(
                r#"SELECT jsonb_build_object(
                     'jobId', j.id, 'tenantId', j.tenant_id, 'spaceId', j.knowledge_space_id,
                     'targetType', j.target_type, 'targetId', j.target_id, 'mode', j.delete_mode,
                     'checkpoint', j.checkpoint, 'runState', j.run_state, 'scanPhase', j.scan_phase,
                     'inventoryComplete', j.inventory_complete, 'attempts', j.execution_attempts,
                     'lastErrorCode', j.last_error_code, 'lastErrorMessage', j.last_error_message,
                     'capabilityGrantId', j.capability_grant_id,
                     'items', (SELECT coalesce(jsonb_object_agg(s, n), '{}'::jsonb) FROM
                                (SELECT status AS s, count(*) AS n FROM deletion_job_items WHERE deletion_job_id = j.id GROUP BY 1) x),
                     'outbox', (SELECT coalesce(jsonb_agg(jsonb_build_object('revision', o.delivery_revision, 'status', o.status)
                                  ORDER BY o.delivery_revision), '[]'::jsonb) FROM deletion_outbox o WHERE o.deletion_job_id = j.id),
                     'tombstone', (SELECT t.state FROM deletion_tombstones t WHERE t.deletion_job_id = j.id AND t.tenant_id = j.tenant_id))
                   FROM deletion_jobs j WHERE j.id = $1"#,
            )
            .bind(job)
            .fetch_optional(pool)
            .await
            .map_err(db)?;
            let Some(v) = row else {
                return Err(Failure::usage(format!("no deletion job {job}")));
            };
            println!(
                "{}",
                serde_json::to_string_pretty(&v).unwrap_or_else(|_| v.to_string())
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, clap::Parser)]
    struct Top {
        #[command(flatten)]
        args: DeleteArgs,
    }

    fn parse(argv: &[&str]) -> Result<Plan, Failure> {
        let top = Top::try_parse_from(std::iter::once("delete").chain(argv.iter().copied()))
            .map_err(|e| Failure::usage(e.to_string()))?;
        plan(&top.args)
    }

    const ID: &str = "0198c6a0-0000-7000-8000-000000000001";

    #[test]
    fn arguments_are_checked_before_any_service() {
        let ok = parse(&[
            "space",
            ID,
            "--tenant",
            "t",
            "--confirm-name",
            "Docs",
            "--as",
            "alice",
            "--snapshot",
            ID,
        ]);
        assert!(matches!(
            ok,
            Ok(Plan::Request(DeletionRequest {
                target: Target::Space { .. },
                ..
            }))
        ));
        let ok = parse(&[
            "source",
            ID,
            "--space",
            ID,
            "--tenant",
            "t",
            "--mode",
            "keep",
            "--as",
            "a",
            "--snapshot",
            ID,
        ]);
        assert!(matches!(
            ok,
            Ok(Plan::Request(DeletionRequest {
                target: Target::Source {
                    mode: SourceMode::Keep,
                    ..
                },
                ..
            }))
        ));
        let ok = parse(&[
            "retry",
            ID,
            "--as",
            "owner",
            "--snapshot",
            ID,
            "--owner-rescue",
            "--idempotency-key",
            "r1",
        ]);
        match ok {
            Ok(Plan::Retry(r)) => {
                assert_eq!(r.authority, RetryAuthority::InteractiveOwnerRescue);
                assert_eq!(r.idempotency_key, "r1");
                assert_eq!(r.access_channel, "interactive");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(parse(&["show", ID]), Ok(Plan::Show(_))));
        match parse(&[
            "logical-document",
            ID,
            "--space",
            ID,
            "--tenant",
            "t",
            "--revision",
            "0",
            "--grant",
            ID,
        ]) {
            Ok(Plan::GrantRequest(r)) => {
                assert_eq!(
                    r.target,
                    Target::LogicalDocument {
                        id: r.knowledge_space_id
                    }
                );
                assert_eq!(r.expected_revision, Some(0));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            parse(&["retry", ID, "--grant", ID]),
            Ok(Plan::GrantRetry(_))
        ));

        for bad in [
            vec![
                "space",
                "nope",
                "--tenant",
                "t",
                "--confirm-name",
                "x",
                "--as",
                "a",
                "--snapshot",
                ID,
            ],
            vec!["space", ID, "--tenant", "t", "--as", "a", "--snapshot", ID],
            vec![
                "source",
                ID,
                "--space",
                ID,
                "--tenant",
                "t",
                "--mode",
                "wipe",
                "--as",
                "a",
                "--snapshot",
                ID,
            ],
            vec![
                "document",
                ID,
                "--space",
                "x",
                "--tenant",
                "t",
                "--as",
                "a",
                "--snapshot",
                ID,
            ],
            vec!["retry", ID, "--as", "a", "--snapshot", "not-a-uuid"],
            vec!["show"],
            // Exactly one authority.
            vec!["document", ID, "--space", ID, "--tenant", "t"],
            vec!["document", ID, "--space", ID, "--tenant", "t", "--as", "a"],
            vec![
                "document",
                ID,
                "--space",
                ID,
                "--tenant",
                "t",
                "--as",
                "a",
                "--snapshot",
                ID,
                "--grant",
                ID,
            ],
            vec![
                "document", ID, "--space", ID, "--tenant", "t", "--grant", "nope",
            ],
            vec![
                "document",
                ID,
                "--space",
                ID,
                "--tenant",
                "t",
                "--grant",
                ID,
                "--channel",
                "mcp",
            ],
            // An owner rescue is never under a grant.
            vec!["retry", ID, "--grant", ID, "--owner-rescue"],
        ] {
            let r = parse(&bad);
            assert!(matches!(&r, Err(f) if f.code == 2), "{bad:?}: {r:?}");
        }
    }
}
