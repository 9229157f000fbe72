//! Requesting deletions, in the caller's transaction, as the platform's API does. Invariant: a
//! request writes the job, its active tombstone, the target's `deleting` fences (a source's active
//! documents too, in either mode; a logical document's exclusively owned assets), the
//! invalidation of the space's agent workspaces, a document's ordinal-0 raw-object item and the
//! first outbox revision together or not at all (inside a savepoint of the caller's transaction);
//! a refused request changes nothing. The requester holds exactly one authority: a permission
//! snapshot that still revalidates, whose role may delete the target (an owner for a space; an
//! owner or an editor for a source or a document), or a capability grant of the space that the
//! platform's fence finds active (checked after the space lock, before the target's; a source's
//! permission scope must lie within the grant's content scope). The job records that authority
//! alone, as the platform's columns do, and the request fingerprint covers it.

use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use super::authority::scope_allows;
pub(super) use super::authz::sha256_hex;
use super::authz::{check_channel, check_text, is_unique_violation, valid_snapshot, Access};
use super::fence;
pub use super::retry::{
    retry_deletion, retry_deletion_under_grant, GrantRetryRequest, Retried, RetryAuthority,
    RetryRequest,
};
use super::TargetType;

pub(super) use super::ask::{active_grant, insert_outbox, Ask, Asker};
pub use super::ask::{
    DeletionRequest, GrantDeletionRequest, RequestError, Requested, SourceMode, Target,
    MAX_EXECUTION_ATTEMPTS,
};

impl DeletionRequest {
    /// sha256 hex of the canonical request: every field that decides what gets deleted and
    /// under whose authority, in a fixed order, one per line.
    pub fn fingerprint(&self) -> String {
        Ask::from(self).fingerprint()
    }

    #[cfg(test)]
    fn validate(&self) -> Result<(), RequestError> {
        Ask::from(self).validate()
    }
}

impl GrantDeletionRequest {
    /// As [`DeletionRequest::fingerprint`], with the grant as the authority (no subject,
    /// snapshot or channel: the platform drops them under a grant).
    pub fn fingerprint(&self) -> String {
        Ask::from(self).fingerprint()
    }
}

impl Ask {
    pub(super) fn target_type(&self) -> TargetType {
        match self.target {
            Target::Space { .. } => TargetType::Space,
            Target::Source { .. } => TargetType::Source,
            Target::Document { .. } => TargetType::Document,
            Target::LogicalDocument { .. } => TargetType::LogicalDocument,
        }
    }

    pub(super) fn target_id(&self) -> Uuid {
        match self.target {
            Target::Space { .. } => self.knowledge_space_id,
            Target::Source { id, .. }
            | Target::Document { id }
            | Target::LogicalDocument { id } => id,
        }
    }

    fn mode(&self) -> &'static str {
        match self.target {
            Target::Source { mode, .. } => mode.as_str(),
            _ => "cascade",
        }
    }

    fn name_digest(&self) -> Option<String> {
        match &self.target {
            Target::Space { confirm_name } => Some(sha256_hex(confirm_name)),
            _ => None,
        }
    }

    /// The canonical request, one length-prefixed field per line. Under a snapshot: the
    /// subject, snapshot and channel; under a grant: a marker and the grant in their place.
    fn fingerprint(&self) -> String {
        let mut fields = vec![
            "deletion.request.v1".to_owned(),
            self.tenant_id.clone(),
            self.knowledge_space_id.to_string(),
            self.target_type().as_str().to_owned(),
            self.target_id().to_string(),
            self.mode().to_owned(),
            self.expected_revision
                .map_or_else(|| "*".to_owned(), |r| r.to_string()),
        ];
        match &self.asker {
            Asker::Snapshot {
                subject,
                snapshot,
                channel,
            } => fields.extend([subject.clone(), snapshot.to_string(), channel.clone()]),
            Asker::Grant(grant) => {
                fields.extend(["capability-grant".to_owned(), grant.to_string()])
            }
        }
        fields.push(self.name_digest().unwrap_or_default());
        sha256_hex(
            &fields
                .iter()
                .map(|f| format!("{}:{f}", f.len()))
                .collect::<Vec<_>>()
                .join("\n"),
        )
    }

    fn validate(&self) -> Result<(), RequestError> {
        check_text("tenant id", &self.tenant_id, 255)?;
        if let Asker::Snapshot {
            subject, channel, ..
        } = &self.asker
        {
            check_text("requesting subject", subject, 255)?;
            check_channel(channel)?;
        }
        check_text("idempotency key", &self.idempotency_key, 512)?;
        if let Target::Space { confirm_name } = &self.target {
            if confirm_name.is_empty() {
                return Err(RequestError::Invalid(
                    "deleting a space needs its name as a confirmation".into(),
                ));
            }
        }
        // A logical document's revision is its row_version, which starts at 0.
        let least = match self.target {
            Target::LogicalDocument { .. } => 0,
            _ => 1,
        };
        if matches!(self.expected_revision, Some(r) if r < least) {
            return Err(RequestError::Invalid(format!(
                "a revision of this target is at least {least}"
            )));
        }
        Ok(())
    }
}

/// Requests a deletion in the caller's transaction (a savepoint inside it; on a plain
/// connection, its own transaction). Same idempotency key + same fingerprint returns the
/// existing job; a different fingerprint is [`RequestError::IdempotencyConflict`]; a second
/// live job for the target is [`RequestError::TargetBusy`].
pub async fn request_deletion(
    conn: &mut PgConnection,
    req: &DeletionRequest,
) -> Result<Requested, RequestError> {
    request(conn, &Ask::from(req)).await
}

/// [`request_deletion`] under a capability grant: refused, with nothing written, unless the
/// grant is active in an unfenced space (and, for a source, admits the source's permission
/// scope). The job records the grant alone.
pub async fn request_deletion_under_grant(
    conn: &mut PgConnection,
    req: &GrantDeletionRequest,
) -> Result<Requested, RequestError> {
    request(conn, &Ask::from(req)).await
}

async fn request(conn: &mut PgConnection, req: &Ask) -> Result<Requested, RequestError> {
    req.validate()?;
    let fingerprint = req.fingerprint();
    let mut sp = conn.begin().await?;
    let written = write_request(&mut sp, req, &fingerprint).await;
    match written {
        Ok(r) => {
            sp.commit().await?;
            Ok(r)
        }
        Err(e) => {
            sp.rollback().await?;
            // A concurrent request with the same key won the race: answer as if it came first.
            if let RequestError::Db(db) = &e {
                if is_unique_violation(db, "deletion_jobs_idempotency_uq") {
                    if let Some(found) = existing_request(conn, req, &fingerprint).await? {
                        return Ok(found);
                    }
                }
                if is_unique_violation(db, "deletion_jobs_target_active_uq")
                    || is_unique_violation(db, "deletion_tombstones_target_uq")
                {
                    return Err(RequestError::TargetBusy {
                        what: format!("{} {}", req.target_type().as_str(), req.target_id()),
                        job_id: None,
                    });
                }
            }
            Err(e)
        }
    }
}

async fn existing_request(
    conn: &mut PgConnection,
    req: &Ask,
    fingerprint: &str,
) -> Result<Option<Requested>, RequestError> {
    let row: Option<(Uuid, String, Option<Uuid>)> = sqlx::query_as(
        "SELECT j.id, j.request_fingerprint, \
           (SELECT o.id FROM deletion_outbox o WHERE o.deletion_job_id = j.id ORDER BY o.delivery_revision LIMIT 1) \
         FROM deletion_jobs j WHERE j.tenant_id = $1 AND j.idempotency_key = $2",
    )
    .bind(&req.tenant_id)
    .bind(&req.idempotency_key)
    .fetch_optional(&mut *conn)
    .await?;
    match row {
        None => Ok(None),
        Some((job_id, fp, outbox)) if fp == fingerprint => Ok(Some(Requested {
            job_id,
            outbox_id: outbox.unwrap_or_default(),
            created: false,
        })),
        Some((job_id, _, _)) => Err(RequestError::IdempotencyConflict {
            key: req.idempotency_key.clone(),
            job_id,
        }),
    }
}

async fn write_request(
    conn: &mut PgConnection,
    req: &Ask,
    fingerprint: &str,
) -> Result<Requested, RequestError> {
    if let Some(found) = existing_request(conn, req, fingerprint).await? {
        return Ok(found);
    }
    let tenant = req.tenant_id.as_str();
    let space = req.knowledge_space_id;
    let target_id = req.target_id();
    let target_type = req.target_type();

    // The space, locked: every target lives in it, and a space being deleted takes no new job.
    let space_row: Option<(i32, String, Option<Uuid>, String)> = sqlx::query_as(
        "SELECT revision, lifecycle_state, deletion_job_id, name FROM knowledge_spaces \
         WHERE tenant_id = $1 AND id = $2 FOR UPDATE",
    )
    .bind(tenant)
    .bind(space)
    .fetch_optional(&mut *conn)
    .await?;
    let Some((space_revision, space_state, space_job, space_name)) = space_row else {
        return Err(RequestError::NotFound(format!(
            "no knowledge space {space} in tenant {tenant}"
        )));
    };
    if space_state == "deleting" {
        return Err(RequestError::TargetBusy {
            what: format!("knowledge space {space}"),
            job_id: space_job,
        });
    }
    // A grant is locked after the space and before the target, as the platform does, so a
    // revocation cannot slip between the check and the fences.
    let grant = match &req.asker {
        Asker::Grant(grant) => Some(active_grant(conn, tenant, space, *grant).await?),
        Asker::Snapshot { .. } => None,
    };

    let check_revision = |what: String, current: i32| -> Result<(), RequestError> {
        match req.expected_revision {
            Some(expected) if expected != current => Err(RequestError::RevisionMismatch {
                what,
                expected,
                current,
            }),
            _ => Ok(()),
        }
    };

    let target_revision = match &req.target {
        Target::Space { confirm_name } => {
            if confirm_name != &space_name {
                return Err(RequestError::NameChallenge);
            }
            check_revision(format!("knowledge space {space}"), space_revision)?;
            // A space waits for the deletions of its children to finish.
            let child: Option<Uuid> = sqlx::query_scalar(
                "SELECT deletion_job_id FROM deletion_tombstones \
                 WHERE tenant_id = $1 AND knowledge_space_id = $2 AND state = 'active' LIMIT 1",
            )
            .bind(tenant)
            .bind(space)
            .fetch_optional(&mut *conn)
            .await?;
            if let Some(job) = child {
                return Err(RequestError::TargetBusy {
                    what: format!("a source or document of knowledge space {space}"),
                    job_id: Some(job),
                });
            }
            space_revision
        }
        Target::Source { id, .. } => {
            let row: Option<(i32, String, Option<Uuid>, serde_json::Value)> = sqlx::query_as(
                "SELECT s.version, s.status, s.deletion_job_id, s.permission_scope FROM sources s \
                 WHERE s.id = $3 AND s.knowledge_space_id = $2 \
                   AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = s.knowledge_space_id AND k.tenant_id = $1) \
                 FOR UPDATE",
            )
            .bind(tenant)
            .bind(space)
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
            let Some((version, status, job, scope)) = row else {
                return Err(RequestError::NotFound(format!(
                    "no source {id} in knowledge space {space}"
                )));
            };
            if let Some(g) = &grant {
                if !scope_allows(&scope, &g.content_scope_ids) {
                    return Err(RequestError::Permission(format!(
                        "the permission scope of source {id} is not within the capability grant's content scope"
                    )));
                }
            }
            if status == "deleting" {
                return Err(RequestError::TargetBusy {
                    what: format!("source {id}"),
                    job_id: job,
                });
            }
            check_revision(format!("source {id}"), version)?;
            {
                let busy: Option<(Uuid, Option<Uuid>)> = sqlx::query_as(
                    "SELECT d.id, d.deletion_job_id FROM document_assets d \
                     WHERE d.knowledge_space_id = $2 AND d.source_id = $3 AND d.lifecycle_state = 'deleting' \
                       AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = d.knowledge_space_id AND k.tenant_id = $1) \
                     LIMIT 1",
                )
                .bind(tenant)
                .bind(space)
                .bind(id)
                .fetch_optional(&mut *conn)
                .await?;
                if let Some((doc, job)) = busy {
                    return Err(RequestError::TargetBusy {
                        what: format!("document {doc} of source {id}"),
                        job_id: job,
                    });
                }
            }
            version
        }
        Target::Document { id } => {
            type DocRow = (i32, String, Option<Uuid>, Option<String>, Option<Uuid>);
            let row: Option<DocRow> = sqlx::query_as(
                "SELECT d.row_version, d.lifecycle_state, d.deletion_job_id, s.status, s.deletion_job_id \
                 FROM document_assets d LEFT JOIN sources s ON s.id = d.source_id AND s.knowledge_space_id = d.knowledge_space_id \
                 WHERE d.id = $3 AND d.knowledge_space_id = $2 \
                   AND EXISTS (SELECT 1 FROM knowledge_spaces k WHERE k.id = d.knowledge_space_id AND k.tenant_id = $1) \
                 FOR UPDATE OF d",
            )
            .bind(tenant)
            .bind(space)
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
            let Some((row_version, state, job, source_status, source_job)) = row else {
                return Err(RequestError::NotFound(format!(
                    "no document {id} in knowledge space {space}"
                )));
            };
            if state == "deleting" {
                return Err(RequestError::TargetBusy {
                    what: format!("document {id}"),
                    job_id: job,
                });
            }
            if source_status.as_deref() == Some("deleting") {
                return Err(RequestError::TargetBusy {
                    what: format!("the source of document {id}"),
                    job_id: source_job,
                });
            }
            check_revision(format!("document {id}"), row_version)?;
            row_version
        }
        Target::LogicalDocument { id } => {
            let row: Option<(i32, String, Option<Uuid>, Option<Uuid>)> = sqlx::query_as(
                "SELECT row_version, status, deletion_job_id, source_id FROM logical_documents \
                 WHERE tenant_id = $1 AND knowledge_space_id = $2 AND id = $3 FOR UPDATE",
            )
            .bind(tenant)
            .bind(space)
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
            let Some((row_version, status, job, source)) = row else {
                return Err(RequestError::NotFound(format!(
                    "no logical document {id} in knowledge space {space}"
                )));
            };
            if status == "deleting" || job.is_some() {
                return Err(RequestError::TargetBusy {
                    what: format!("logical document {id}"),
                    job_id: job,
                });
            }
            if let Some(source) = source {
                let parent: Option<(String, Option<Uuid>)> = sqlx::query_as(
                    "SELECT status, deletion_job_id FROM sources WHERE knowledge_space_id = $1 AND id = $2 FOR UPDATE",
                )
                .bind(space)
                .bind(source)
                .fetch_optional(&mut *conn)
                .await?;
                if let Some((status, job)) = parent {
                    if status == "deleting" || job.is_some() {
                        return Err(RequestError::TargetBusy {
                            what: format!("the source of logical document {id}"),
                            job_id: job,
                        });
                    }
                }
            }
            // One of its assets already being deleted by another job is a live child deletion.
            let busy: Option<(Uuid, Option<Uuid>)> = sqlx::query_as(
                "SELECT d.id, d.deletion_job_id FROM document_assets d \
                 WHERE d.knowledge_space_id = $2 AND d.lifecycle_state = 'deleting' \
                   AND d.id IN (SELECT r.document_asset_id FROM document_revisions r \
                     WHERE r.tenant_id = $1 AND r.knowledge_space_id = $2 AND r.document_id = $3) \
                 LIMIT 1",
            )
            .bind(tenant)
            .bind(space)
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
            if let Some((doc, job)) = busy {
                return Err(RequestError::TargetBusy {
                    what: format!("document {doc} of logical document {id}"),
                    job_id: job,
                });
            }
            check_revision(format!("logical document {id}"), row_version)?;
            row_version
        }
    };

    // The columns of the authority, as the platform writes them: a snapshot binding (with its
    // API key), or the grant alone.
    let binding = match &req.asker {
        Asker::Snapshot {
            subject,
            snapshot,
            channel,
        } => {
            let snap = valid_snapshot(
                conn,
                tenant,
                space,
                *snapshot,
                subject,
                channel,
                match req.target {
                    Target::Space { .. } => Access::Owner,
                    _ => Access::Write,
                },
            )
            .await?;
            Binding {
                grant: None,
                subject: Some(subject.clone()),
                snapshot: Some(*snapshot),
                revision: Some(snap.revision),
                channel: Some(channel.clone()),
                api_key_id: snap.api_key_id,
                api_key_revision: snap.api_key_revision,
                api_key_expires_at: snap.api_key_expires_at,
            }
        }
        Asker::Grant(grant) => Binding {
            grant: Some(*grant),
            ..Binding::default()
        },
    };

    let job_id = Uuid::now_v7();
    sqlx::query(
        r#"INSERT INTO deletion_jobs (id, tenant_id, knowledge_space_id, target_type, target_id, target_revision,
             delete_mode, requested_by_subject_id, permission_snapshot_id, permission_snapshot_revision, access_channel,
             api_key_id, api_key_revision, api_key_expires_at, capability_grant_id, idempotency_key, request_fingerprint,
             name_challenge_digest, checkpoint, scan_phase, scan_cursor, inventory_complete, run_state, active_slot,
             execution_attempts, max_execution_attempts, row_version, created_at, updated_at)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18,
             'requested', NULL, NULL, false, 'dispatch_pending', 1, 0, $19, 1, now(), now())"#,
    )
    .bind(job_id)
    .bind(tenant)
    .bind(space)
    .bind(target_type.as_str())
    .bind(target_id)
    .bind(target_revision)
    .bind(req.mode())
    .bind(&binding.subject)
    .bind(binding.snapshot)
    .bind(binding.revision)
    .bind(&binding.channel)
    .bind(binding.api_key_id)
    .bind(binding.api_key_revision)
    .bind(binding.api_key_expires_at)
    .bind(binding.grant)
    .bind(&req.idempotency_key)
    .bind(fingerprint)
    .bind(req.name_digest())
    .bind(MAX_EXECUTION_ATTEMPTS)
    .execute(&mut *conn)
    .await?;

    sqlx::query(
        r#"INSERT INTO deletion_tombstones (id, deletion_job_id, tenant_id, knowledge_space_id, target_type, target_id,
             target_revision, state, row_version, created_at, completed_at)
           VALUES ($1, $2, $3, $4, $5, $6, $7, 'active', 1, now(), NULL)"#,
    )
    .bind(Uuid::now_v7())
    .bind(job_id)
    .bind(tenant)
    .bind(space)
    .bind(target_type.as_str())
    .bind(target_id)
    .bind(target_revision)
    .execute(&mut *conn)
    .await?;

    fence::fence(conn, req, job_id, target_revision).await?;

    let outbox_id = Uuid::now_v7();
    insert_outbox(
        conn,
        outbox_id,
        job_id,
        1,
        &req.idempotency_key,
        fingerprint,
    )
    .await?;
    Ok(Requested {
        job_id,
        outbox_id,
        created: true,
    })
}

/// The authority columns of a job row.
#[derive(Default)]
struct Binding {
    grant: Option<Uuid>,
    subject: Option<String>,
    snapshot: Option<Uuid>,
    revision: Option<i32>,
    channel: Option<String>,
    api_key_id: Option<Uuid>,
    api_key_revision: Option<i32>,
    api_key_expires_at: Option<chrono::DateTime<chrono::Utc>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> DeletionRequest {
        DeletionRequest {
            tenant_id: "t1".into(),
            knowledge_space_id: Uuid::from_u128(1),
            target: Target::Document {
                id: Uuid::from_u128(2),
            },
            expected_revision: None,
            requested_by_subject_id: "alice".into(),
            permission_snapshot_id: Uuid::from_u128(3),
            access_channel: "interactive".into(),
            idempotency_key: "k".into(),
        }
    }

    #[test]
    fn fingerprint_covers_what_is_deleted_and_by_whom_but_not_the_key() {
        let a = req();
        let same = DeletionRequest {
            idempotency_key: "other".into(),
            ..req()
        };
        assert_eq!(a.fingerprint(), same.fingerprint());
        assert_eq!(a.fingerprint().len(), 64);
        for other in [
            DeletionRequest {
                requested_by_subject_id: "bob".into(),
                ..req()
            },
            DeletionRequest {
                expected_revision: Some(1),
                ..req()
            },
            DeletionRequest {
                target: Target::Source {
                    id: Uuid::from_u128(2),
                    mode: SourceMode::Keep,
                },
                ..req()
            },
            DeletionRequest {
                target: Target::Source {
                    id: Uuid::from_u128(2),
                    mode: SourceMode::Cascade,
                },
                ..req()
            },
        ] {
            assert_ne!(a.fingerprint(), other.fingerprint());
        }
    }

    #[test]
    fn a_grant_request_is_fingerprinted_by_its_grant_without_subject_or_channel() {
        let grant = |g: u128, key: &str| GrantDeletionRequest {
            tenant_id: "t1".into(),
            knowledge_space_id: Uuid::from_u128(1),
            target: Target::Document {
                id: Uuid::from_u128(2),
            },
            expected_revision: None,
            capability_grant_id: Uuid::from_u128(g),
            idempotency_key: key.into(),
        };
        assert_eq!(grant(7, "a").fingerprint(), grant(7, "b").fingerprint());
        assert_ne!(grant(7, "a").fingerprint(), grant(8, "a").fingerprint());
        assert_ne!(grant(3, "k").fingerprint(), req().fingerprint());
        let ask = Ask::from(&grant(7, "a"));
        assert_eq!(ask.asker, Asker::Grant(Uuid::from_u128(7)));
        assert!(ask.validate().is_ok());
    }

    #[test]
    fn a_logical_document_may_be_asked_at_revision_zero_and_nothing_else_may() {
        let logical = DeletionRequest {
            target: Target::LogicalDocument {
                id: Uuid::from_u128(2),
            },
            expected_revision: Some(0),
            ..req()
        };
        assert!(logical.validate().is_ok());
        assert_eq!(
            Ask::from(&logical).target_type(),
            TargetType::LogicalDocument
        );
        assert!(matches!(
            DeletionRequest {
                expected_revision: Some(-1),
                ..logical.clone()
            }
            .validate(),
            Err(RequestError::Invalid(_))
        ));
        assert_ne!(
            logical.fingerprint(),
            DeletionRequest {
                target: Target::Document {
                    id: Uuid::from_u128(2)
                },
                ..logical.clone()
            }
            .fingerprint()
        );
    }

    #[test]
    fn bad_input_is_refused_before_any_query() {
        let bad = [
            DeletionRequest {
                access_channel: "web".into(),
                ..req()
            },
            DeletionRequest {
                idempotency_key: " ".into(),
                ..req()
            },
            DeletionRequest {
                target: Target::Space {
                    confirm_name: String::new(),
                },
                ..req()
            },
            DeletionRequest {
                expected_revision: Some(0),
                ..req()
            },
        ];
        for r in bad {
            assert!(
                matches!(r.validate(), Err(RequestError::Invalid(_))),
                "{r:?}"
            );
        }
    }
}
