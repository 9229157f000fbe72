//! The slice runner: fence → step → commit, until the slice ends. Invariant: a slice returns
//! how it ended only once that end has committed, or once the lease is proven lost (then
//! nothing more is written); a commit whose outcome is unknown is settled by reading the job
//! row back, and shutdown before the deciding commit returns `None`, so the delivery is not
//! acked.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::heartbeat::HeartbeatGuard;
use super::{retry_pause, Engine, Slot};
use crate::crash;
use crate::engine::{lease, slice};
use crate::jobs::{Handler, JobCtx, Policy};
use lease::End;
use slice::{Next, Progress};

impl Engine {
    /// Runs steps until the slice ends. Returns how it ended (`"lease_lost"` when fenced out),
    /// or `None` when shutdown interrupted it before its end committed.
    pub(super) async fn run_slice(
        &self,
        mut job: JobCtx,
        policy: Policy,
        mut conn: Slot,
        shutdown: &CancellationToken,
    ) -> Option<&'static str> {
        self.counters.slices.fetch_add(1, Ordering::Relaxed);
        let st = &self.statements[&job.kind];
        let handler = self.handlers[&job.kind].clone();
        let lost = CancellationToken::new();
        let _heartbeat = HeartbeatGuard::start(
            self.heartbeat_pool.clone(),
            job.clone(),
            policy,
            lost.clone(),
            st.clone(),
        );
        let started = Instant::now();
        let mut steps_done = 0u32;
        // Set when the connection failed: a fresh one is taken at the next step.
        let mut broken = false;
        // Database calls retried in a row, for the backoff; reset by each committed step.
        let mut tries = 0u32;
        loop {
            if lost.is_cancelled() {
                return Some(self.lease_lost(&job));
            }
            if std::mem::take(&mut broken) {
                conn = None;
            }
            let mut tx = match self.begin(&mut conn).await {
                Ok(tx) => tx,
                Err(e) => {
                    broken = true;
                    tries += 1;
                    tracing::warn!(error = %e, tries, "cannot begin a step; retrying");
                    if !self.pause_for(retry_pause(tries), shutdown).await {
                        return None;
                    }
                    continue;
                }
            };
            let rv_before = job.row_version;
            let fenced = match lease::fence(&mut tx, st, &job, policy.lease).await {
                Ok(Some(rv)) => rv,
                Ok(None) => return Some(self.lease_lost(&job)),
                Err(e) => {
                    drop(tx);
                    conn = None;
                    tries += 1;
                    tracing::warn!(error = %e, tries, "fence failed; retrying");
                    if !self.pause_for(retry_pause(tries), shutdown).await {
                        return None;
                    }
                    continue;
                }
            };
            job.row_version = fenced;
            let result = handler
                .step(&mut tx, &job)
                .instrument(tracing::info_span!(
                    "step",
                    kind = %job.kind,
                    job_id = %job.job_id,
                    checkpoint = %job.checkpoint,
                    attempt = job.execution_attempts,
                ))
                .await;
            steps_done += 1;
            let progress = Progress {
                steps_done,
                elapsed: started.elapsed(),
                attempts: job.execution_attempts,
                max_attempts: job.max_execution_attempts,
            };
            let next = slice::after_step(
                result,
                progress,
                self.cfg.budget,
                policy.retry,
                rand::random(),
            );
            // Errors before `commit()` are certain: the transaction rolled back. Only a failing
            // `commit()` leaves the outcome unknown.
            let commit_span = match &next {
                Next::Step(_) => {
                    tracing::info_span!("commit_step", kind = %job.kind, job_id = %job.job_id)
                }
                Next::End { end, .. } | Next::Abort(end) => {
                    tracing::info_span!("end_slice", kind = %job.kind, job_id = %job.job_id, end = end.name())
                }
            };
            // The row version after this step's checkpoint write, when it made one.
            let mut advanced = fenced;
            let committed: Result<Option<&'static str>, StepError> = async {
                match &next {
                    Next::Step(cp) => {
                        let Some(rv) = lease::advance(&mut tx, st, &job, cp)
                            .await
                            .map_err(StepError::Certain)?
                        else {
                            return Ok(Some("lease_lost"));
                        };
                        advanced = rv;
                        tx.commit().await.map_err(StepError::Uncertain)?;
                        Ok(None)
                    }
                    Next::End { checkpoint, end } => {
                        let mut ending = std::borrow::Cow::Borrowed(&job);
                        if let Some(cp) = checkpoint {
                            let Some(rv) = lease::advance(&mut tx, st, &job, cp)
                                .await
                                .map_err(StepError::Certain)?
                            else {
                                return Ok(Some("lease_lost"));
                            };
                            ending.to_mut().row_version = rv;
                        }
                        if !lease::end(&mut tx, st, &ending, end)
                            .await
                            .map_err(StepError::Certain)?
                        {
                            return Ok(Some("lease_lost"));
                        }
                        tx.commit().await.map_err(StepError::Uncertain)?;
                        Ok(Some(end.name()))
                    }
                    Next::Abort(_) => {
                        // The step's writes are dropped; its end is written below, on its own.
                        tx.rollback().await.map_err(StepError::Certain)?;
                        Ok(None)
                    }
                }
            }
            .instrument(commit_span.clone())
            .await;
            let committed = match (&next, committed) {
                (Next::Abort(end), Ok(_)) => {
                    job.row_version = rv_before;
                    let written = self
                        .write_end(&mut conn, &handler, &job, end)
                        .instrument(commit_span)
                        .await;
                    if let (
                        Ok(Some(name)),
                        End::Fail { code, message } | End::Wait { code, message, .. },
                    ) = (&written, end)
                    {
                        if *name != "lease_lost" {
                            tracing::warn!(kind = %job.kind, job_id = %job.job_id, code, message, end = end.name(), "step did not finish");
                        }
                    }
                    written
                }
                (_, c) => c,
            };
            match committed {
                Ok(None) => {
                    crash::point("after-step-commit");
                    tries = 0;
                    if let Next::Step(cp) = next {
                        job.checkpoint = cp;
                        job.row_version = advanced;
                        handler.after_step_commit(&job).await;
                    }
                }
                Ok(Some("lease_lost")) => return Some(self.lease_lost(&job)),
                Ok(Some(end)) => {
                    crash::point("after-step-commit");
                    tracing::debug!(kind = %job.kind, job_id = %job.job_id, end, steps = steps_done, "slice ended");
                    crate::metrics::slice(job.kind.name(), end, started.elapsed());
                    if matches!(&next, Next::Abort(End::Wait { refund: false, .. })) {
                        crate::metrics::retry(job.kind.name());
                    }
                    return Some(end);
                }
                Err(StepError::Certain(e)) if !crate::db::is_retryable(&e) => {
                    // A write of this step broke a rule of the database (a CHECK, a length):
                    // running it again would fail the same way. Fail the job instead.
                    job.row_version = rv_before;
                    let code = e
                        .as_database_error()
                        .and_then(|d| d.code())
                        .map_or("db_error".to_owned(), |c| format!("db_{c}"));
                    tracing::error!(kind = %job.kind, job_id = %job.job_id, error = %e, "a step's write was refused; failing the job");
                    let end = End::Fail {
                        code,
                        message: e.to_string(),
                    };
                    // The failure is written, or the lease is proven lost, before the delivery
                    // is settled: never an ack without its deciding commit. While the failure
                    // cannot be written (Postgres away, say) the delivery stays unacked.
                    let mut tries = 0u32;
                    return loop {
                        match self.write_end(&mut conn, &handler, &job, &end).await {
                            Ok(Some("lease_lost")) => break Some(self.lease_lost(&job)),
                            Ok(Some(name)) => {
                                crate::metrics::slice(job.kind.name(), name, started.elapsed());
                                break Some(name);
                            }
                            Ok(None) => break None,
                            Err(e) => {
                                tries += 1;
                                conn = None;
                                tracing::warn!(kind = %job.kind, job_id = %job.job_id, error = %e, tries, "cannot record the failure yet; retrying");
                                if !self.pause_for(retry_pause(tries), shutdown).await {
                                    break None;
                                }
                            }
                        }
                    };
                }
                Err(StepError::Certain(e) | StepError::Uncertain(e)) => {
                    // Connection trouble, or a commit whose outcome is unknown. Find out from
                    // the row itself: while our lease token is on a live row, only we can have
                    // written it.
                    conn = None;
                    tries += 1;
                    tracing::warn!(kind = %job.kind, job_id = %job.job_id, error = %e, tries, "step not confirmed; resynchronising");
                    if !self.pause_for(retry_pause(tries), shutdown).await {
                        return None;
                    }
                    match self.resync(&job, shutdown).await {
                        Resync::Ours {
                            row_version,
                            checkpoint,
                        } => {
                            job.row_version = row_version;
                            job.checkpoint = checkpoint;
                        }
                        Resync::Gone => return Some("ended"),
                        Resync::Lost => return Some(self.lease_lost(&job)),
                        Resync::Shutdown => return None,
                    }
                }
            }
        }
    }

    /// Writes an end of slice in its own transaction, with the kind's failure hook.
    async fn write_end(
        &self,
        conn: &mut Slot,
        handler: &Arc<dyn Handler>,
        job: &JobCtx,
        end: &End,
    ) -> Result<Option<&'static str>, StepError> {
        let st = &self.statements[&job.kind];
        let mut tx = self.begin(conn).await.map_err(StepError::Certain)?;
        if !lease::end(&mut tx, st, job, end)
            .await
            .map_err(StepError::Certain)?
        {
            return Ok(Some("lease_lost"));
        }
        if let End::Fail { code, .. } = end {
            // The kind's own record of the failure commits with the failure.
            crate::jobs::failed(&mut tx, Some(handler.as_ref()), job.kind.spec(), job, code)
                .await
                .map_err(StepError::Certain)?;
        }
        if let End::Wait {
            code,
            refund: false,
            ..
        } = end
        {
            // Likewise the kind's record of a scheduled retry.
            handler
                .on_retry(&mut tx, job, code)
                .await
                .map_err(StepError::Certain)?;
        }
        tx.commit().await.map_err(StepError::Uncertain)?;
        Ok(Some(end.name()))
    }

    fn lease_lost(&self, job: &JobCtx) -> &'static str {
        self.counters.lease_lost.fetch_add(1, Ordering::Relaxed);
        crate::metrics::lease_lost(job.kind.name());
        tracing::warn!(kind = %job.kind, job_id = %job.job_id, "lease lost; stopping the slice and writing nothing more");
        "lease_lost"
    }

    async fn resync(&self, job: &JobCtx, shutdown: &CancellationToken) -> Resync {
        let st = job.kind.spec();
        let (live, terminal) = match st.states {
            crate::jobs::States::RunState { .. } => {
                ("run_state = 'running'", "run_state <> 'running'")
            }
            crate::jobs::States::Stage => (
                "stage NOT IN ('paused', 'completed', 'failed', 'canceled')",
                "stage IN ('completed', 'failed', 'canceled')",
            ),
        };
        let sql = st.sql(&format!(
            "SELECT row_version, {{cp}}::text, (lease_token = $2 AND lease_expires_at > {{now}} AND {live}) AS ours, \
               (lease_token IS NULL AND {terminal}) AS ended \
             FROM {{job}} WHERE id = $1"
        ));
        let mut tries = 0u32;
        loop {
            type Row = (i32, String, Option<bool>, Option<bool>);
            let row: Result<Option<Row>, _> = async {
                let mut conn = crate::db::acquire(&self.pool).await?;
                sqlx::query_as(&sql)
                    .bind(job.job_id)
                    .bind(job.lease_token)
                    .fetch_optional(&mut *conn)
                    .await
            }
            .await;
            match row {
                Ok(Some((rv, cp, Some(true), _))) => {
                    return Resync::Ours {
                        row_version: rv,
                        checkpoint: cp,
                    }
                }
                Ok(_) => return Resync::Lost,
                Err(e) => {
                    tries += 1;
                    tracing::warn!(error = %e, tries, "database unreachable; waiting");
                    if !self.pause_for(retry_pause(tries), shutdown).await {
                        return Resync::Shutdown;
                    }
                }
            }
        }
    }
}

/// A database error inside a step, and whether the step's commit may have happened anyway.
#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error("{0}")]
    Certain(sqlx::Error),
    #[error("commit outcome unknown: {0}")]
    Uncertain(sqlx::Error),
}

enum Resync {
    Ours {
        row_version: i32,
        checkpoint: String,
    },
    #[allow(dead_code)]
    Gone,
    Lost,
    Shutdown,
}
