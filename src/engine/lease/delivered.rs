//! The outbox kinds' [`Transitions`]: the slice runner's fenced writes for a job table with an
//! outbox, and the kind's hooks. Invariant: every transition here is one of the statements in
//! [`Statements`], rendered once per kind; a failure or a scheduled retry written on its own
//! commits together with the kind's record of it.

use std::sync::Arc;

use sqlx::PgConnection;

use uuid::Uuid;

use super::{End, GroupEnd, Statements};
use crate::engine::group::{GroupHeartbeat, GroupTransitions};
use crate::engine::kind::{failed, Handler, JobCtx, JobError, Policy, Step, Until};
use crate::engine::runner::{Heartbeat, Transitions};

/// One outbox kind's job, as the slice runner sees it.
pub struct Delivered {
    pub statements: Arc<Statements>,
    pub handler: Arc<dyn Handler>,
    pub policy: Policy,
}

#[async_trait::async_trait]
impl Transitions for Delivered {
    fn kind_name(&self) -> &'static str {
        self.statements.spec.kind.name()
    }

    fn policy(&self) -> Policy {
        self.policy
    }

    async fn fence(&self, tx: &mut PgConnection, job: &JobCtx) -> Result<Option<i32>, sqlx::Error> {
        super::fence(tx, &self.statements, job, self.policy.lease).await
    }

    async fn step(&self, tx: &mut PgConnection, job: &JobCtx) -> Result<Step, JobError> {
        self.handler.step(tx, job).await
    }

    async fn advance(
        &self,
        tx: &mut PgConnection,
        job: &JobCtx,
        checkpoint: &str,
    ) -> Result<Option<i32>, sqlx::Error> {
        super::advance(tx, &self.statements, job, checkpoint).await
    }

    async fn end(
        &self,
        tx: &mut PgConnection,
        job: &JobCtx,
        end: &End,
    ) -> Result<bool, sqlx::Error> {
        super::end(tx, &self.statements, job, end).await
    }

    async fn record_end(
        &self,
        tx: &mut PgConnection,
        job: &JobCtx,
        end: &End,
    ) -> Result<(), sqlx::Error> {
        match end {
            // The kind's own record of the failure commits with the failure.
            End::Fail { code, .. } => {
                failed(
                    tx,
                    Some(self.handler.as_ref()),
                    self.statements.spec,
                    job,
                    code,
                )
                .await
            }
            // Likewise the kind's record of a scheduled retry.
            End::Wait {
                code,
                refund: false,
                ..
            } => self.handler.on_retry(tx, job, code).await,
            _ => Ok(()),
        }
    }

    async fn resync(
        &self,
        conn: &mut PgConnection,
        job: &JobCtx,
    ) -> Result<Option<(i32, String)>, sqlx::Error> {
        super::resync(conn, &self.statements, job).await
    }

    fn heartbeat(&self) -> Arc<dyn Heartbeat> {
        Arc::new(Beat {
            statements: self.statements.clone(),
            lease: self.policy.lease,
        })
    }

    async fn after_step_commit(&self, job: &JobCtx) {
        self.handler.after_step_commit(job).await;
    }

    fn prepares(&self, job: &JobCtx) -> bool {
        self.handler.prepares(job)
    }

    async fn prepare(&self, conn: &mut PgConnection, job: &JobCtx) -> Result<(), JobError> {
        self.handler.prepare(conn, job).await
    }
}

#[async_trait::async_trait]
impl GroupTransitions for Delivered {
    async fn step_many(
        &self,
        tx: &mut PgConnection,
        jobs: &[JobCtx],
        until: Until,
    ) -> Result<Vec<Step>, JobError> {
        self.handler.step_many(tx, jobs, until).await
    }

    async fn fence_many(
        &self,
        tx: &mut PgConnection,
        jobs: &[&JobCtx],
    ) -> Result<Vec<(Uuid, i32)>, sqlx::Error> {
        super::fence_many(tx, &self.statements, jobs, self.policy.lease).await
    }

    async fn advance_many(
        &self,
        tx: &mut PgConnection,
        moves: &[(&JobCtx, &str)],
    ) -> Result<Vec<(Uuid, i32)>, sqlx::Error> {
        super::advance_many(tx, &self.statements, moves).await
    }

    async fn end_many(
        &self,
        tx: &mut PgConnection,
        how: GroupEnd,
        ends: &[(&JobCtx, &str)],
    ) -> Result<Vec<Uuid>, sqlx::Error> {
        super::end_many(tx, &self.statements, how, ends).await
    }

    fn group_heartbeat(&self) -> Arc<dyn GroupHeartbeat> {
        Arc::new(Beat {
            statements: self.statements.clone(),
            lease: self.policy.lease,
        })
    }
}

/// Extends the job's lease and its outbox row's visibility together.
struct Beat {
    statements: Arc<Statements>,
    lease: std::time::Duration,
}

#[async_trait::async_trait]
impl Heartbeat for Beat {
    async fn extend(&self, conn: &mut PgConnection, job: &JobCtx) -> Result<bool, sqlx::Error> {
        super::heartbeat(conn, &self.statements, job, self.lease).await
    }
}

#[async_trait::async_trait]
impl GroupHeartbeat for Beat {
    async fn extend_many(
        &self,
        conn: &mut PgConnection,
        jobs: &[JobCtx],
    ) -> Result<Vec<Uuid>, sqlx::Error> {
        super::heartbeat_many(conn, &self.statements, jobs, self.lease).await
    }
}
