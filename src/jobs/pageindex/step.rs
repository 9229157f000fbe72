//! One step of a page-index upgrade. Invariant: a step holds the space row's lock, builds at
//! most one frozen outline's page index and marks its item succeeded in the same transaction;
//! the manifests become `ready` only in the step that finds the locked head still the frozen
//! one with every item succeeded and the closure complete before and after the promotion; a
//! moved head supersedes the job.

use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use super::closure::{self, Status};
use super::walk::{self, Facts, HeadRef, Plan};
use super::{
    current_head, ensure_head_job, job_by_id, lock_space, Job, PageIndexKind, ITEMS, TABLE,
};
use crate::engine::leased::Lease;
use crate::jobs::{JobError, Step};

impl PageIndexKind {
    pub(super) async fn process(
        &self,
        tx: &mut PgConnection,
        lease: &Lease,
    ) -> Result<Step, JobError> {
        let job = job_by_id(tx, lease.job_id, false).await?.ok_or_else(|| {
            JobError::fatal(
                walk::TRANSITION_CONFLICT,
                "PageIndex upgrade job was not found",
            )
        })?;
        let (tenant, space) = (job.tenant_id.as_str(), job.knowledge_space_id);
        let space_state = lock_space(tx, tenant, space).await?;
        type Item = (Uuid, Uuid, Uuid, i32, Value);
        let next: Option<Item> = sqlx::query_as(&format!(
            "SELECT item.document_outline_id, item.publication_generation_id, item.document_asset_id, \
               item.document_version, outline_row.nodes \
             FROM {ITEMS} item JOIN document_outlines outline_row ON outline_row.id = item.document_outline_id \
               AND outline_row.knowledge_space_id = $2 \
               AND outline_row.publication_generation_id = item.publication_generation_id \
               AND outline_row.document_asset_id = item.document_asset_id \
               AND outline_row.version = item.document_version \
             WHERE item.backfill_id = $1 AND item.status = 'pending' \
             ORDER BY item.ordinal, item.document_outline_id LIMIT 1 FOR UPDATE OF item"
        ))
        .bind(job.id)
        .bind(space)
        .fetch_optional(&mut *tx)
        .await?;
        let any_pending: bool = sqlx::query_scalar(&format!(
            "SELECT EXISTS (SELECT 1 FROM {ITEMS} WHERE backfill_id = $1 AND status = 'pending')"
        ))
        .bind(job.id)
        .fetch_one(&mut *tx)
        .await?;
        let mutation_lease_live: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM knowledge_space_mutation_leases \
               WHERE tenant_id = $1 AND knowledge_space_id = $2 AND expires_at > now())",
        )
        .bind(tenant)
        .bind(space)
        .fetch_one(&mut *tx)
        .await?;
        let plan = walk::plan(&Facts {
            space: space_state,
            next_item: next.as_ref().map(|i| i.0),
            any_pending,
            mutation_lease_live,
        })?;
        match plan {
            Plan::Fenced => Ok(Step::Cancel {
                code: crate::jobs::deletion::FENCE_CODE.into(),
                message: crate::jobs::deletion::FENCE_MESSAGE.into(),
            }),
            Plan::Wait(reason) => Ok(Step::Wait {
                delay: self.retry_after,
                reason: reason.into(),
            }),
            Plan::Build(_) => {
                let (outline, generation, document, version, nodes) =
                    next.expect("a planned build has its item");
                self.build(tx, &job, outline, generation, document, version, &nodes)
                    .await
            }
            Plan::Complete => self.complete(tx, &job).await,
        }
    }

    /// Builds one frozen outline's page index and marks its item succeeded.
    #[allow(clippy::too_many_arguments)]
    async fn build(
        &self,
        tx: &mut PgConnection,
        job: &Job,
        outline: Uuid,
        generation: Uuid,
        document: Uuid,
        version: i32,
        nodes: &Value,
    ) -> Result<Step, JobError> {
        let space = job.knowledge_space_id;
        crate::jobs::compile::build::write_page_index(
            tx, space, generation, document, version, outline, nodes,
        )
        .await?;
        if closure::invalid_for(
            tx,
            &job.tenant_id,
            space,
            job.publication_id,
            Some((outline, generation)),
            Status::Built,
        )
        .await?
        {
            return Err(JobError::fatal(
                walk::BUILD,
                "PageIndex materialization did not persist its exact child closure",
            ));
        }
        let marked = sqlx::query(&format!(
            "UPDATE {ITEMS} SET status = 'succeeded', updated_at = now() \
             WHERE backfill_id = $1 AND document_outline_id = $2 AND status = 'pending'"
        ))
        .bind(job.id)
        .bind(outline)
        .execute(&mut *tx)
        .await?;
        if marked.rows_affected() != 1 {
            return Err(JobError::fatal(
                walk::TRANSITION_CONFLICT,
                "Frozen backfill item changed before completion",
            ));
        }
        sqlx::query(&format!(
            "UPDATE {TABLE} SET completed_items = completed_items + 1 WHERE id = $1"
        ))
        .bind(job.id)
        .execute(&mut *tx)
        .await?;
        crate::crash::point("pageindex-before-commit");
        Ok(Step::Advance("running".into()))
    }

    /// Cuts over: verifies against the locked head and promotes the frozen manifests.
    async fn complete(&self, tx: &mut PgConnection, job: &Job) -> Result<Step, JobError> {
        let (tenant, space) = (job.tenant_id.as_str(), job.knowledge_space_id);
        let current = current_head(tx, tenant, space, true).await?;
        let frozen = HeadRef {
            publication_id: job.publication_id,
            fingerprint: job.publication_fingerprint.clone(),
            head_revision: job.head_revision,
        };
        if !walk::head_unchanged(&frozen, current.as_ref()) {
            if let Some(head) = &current {
                ensure_head_job(tx, tenant, space, head, self.max_items).await?;
            }
            return Ok(Step::Supersede {
                message: walk::HEAD_CHANGED_MESSAGE.into(),
            });
        }
        let (items, succeeded): (i64, i64) = sqlx::query_as(&format!(
            "SELECT count(*), count(*) FILTER (WHERE status = 'succeeded') FROM {ITEMS} WHERE backfill_id = $1"
        ))
        .bind(job.id)
        .fetch_one(&mut *tx)
        .await?;
        walk::check_counts(&walk::Counts {
            items,
            succeeded,
            completed_items: job.completed_items,
            total_items: job.total_items,
        })?;
        let verification = |message: &str| JobError::fatal(walk::VERIFICATION, message);
        if closure::items_drifted(tx, job.id, tenant, space, job.publication_id).await? {
            return Err(verification(
                "Frozen PageIndex item no longer matches its immutable publication closure",
            ));
        }
        if closure::invalid(tx, tenant, space, job.publication_id, Status::Built).await? {
            return Err(verification(
                "Frozen published head has an incomplete PageIndex closure",
            ));
        }
        closure::promote(tx, job.id, space).await?;
        if closure::invalid(tx, tenant, space, job.publication_id, Status::Ready).await? {
            return Err(verification(
                "PageIndex closure did not become fully ready atomically",
            ));
        }
        Ok(Step::Succeed("succeeded".into()))
    }
}
