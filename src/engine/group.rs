//! The group slice runner: the slices of several claimed jobs of one kind, stepped together in
//! one transaction per step. Invariant: a group step commits only when every member's fence,
//! and every stepped member's checkpoint advance and end, matched, so each commit holds, for
//! each member, its step's effects together with its fenced checkpoint (or nothing, for a
//! member the step did not reach), exactly as a slice of its own would; a group step's members
//! step only while another step still fits in a heartbeat interval, and a step cut short
//! disbands the group, so a group's transaction (which keeps the heartbeat off its rows) lasts
//! at most that interval and one member's step, not the sum of all their steps; on any
//! error, mismatch or end the group cannot write (a failure, a wait) the transaction is rolled
//! back and each member is replayed alone through [`runner::run_slice`], from the state the
//! rolled-back step started from, so a failing member never undoes or blocks the others; a
//! group commit whose outcome is unknown is settled member by member by reading each row back.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use super::kind::{JobCtx, JobError, Step, Until};
use super::lease::{End, GroupEnd};
use super::runner::{self, Env, Slot, Transitions, LEASE_LOST};
use super::slice::{self, Next, Progress};
use crate::crash;

/// The batched transitions of a table shape, beside its one-job [`Transitions`]. Each compares,
/// for every member, what the one-job transition of the same name compares.
#[async_trait::async_trait]
pub trait GroupTransitions: Transitions {
    /// The members' steps, inside the transaction [`GroupTransitions::fence_many`] opened.
    async fn step_many(
        &self,
        tx: &mut PgConnection,
        jobs: &[JobCtx],
        until: Until,
    ) -> Result<Vec<Step>, JobError>;
    /// Locks the members' job rows for one step; returns `(id, row version)` of those fenced.
    async fn fence_many(
        &self,
        tx: &mut PgConnection,
        jobs: &[&JobCtx],
    ) -> Result<Vec<(Uuid, i32)>, sqlx::Error>;
    /// Moves each member's checkpoint; returns `(id, new row version)` of those moved.
    async fn advance_many(
        &self,
        tx: &mut PgConnection,
        moves: &[(&JobCtx, &str)],
    ) -> Result<Vec<(Uuid, i32)>, sqlx::Error>;
    /// Ends the members' slices the same way; returns the ids of those ended.
    async fn end_many(
        &self,
        tx: &mut PgConnection,
        how: GroupEnd,
        ends: &[(&JobCtx, &str)],
    ) -> Result<Vec<Uuid>, sqlx::Error>;
    /// The group heartbeat of this shape, owned, so it can run beside the group.
    fn group_heartbeat(&self) -> Arc<dyn GroupHeartbeat>;
}

/// What a group step writes, decided from each member's [`Next`]: checkpoint advances, then one
/// end statement per end kind. `None`: some member needs an end the group does not write (a
/// failure, a wait, a cancel: they carry the kind's own records), so every member goes alone.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// `(member, checkpoint)` to advance before any end.
    pub advance: Vec<(usize, String)>,
    /// `(member, final checkpoint)` to succeed.
    pub succeed: Vec<(usize, String)>,
    /// Members whose slice budget ran out.
    pub cont: Vec<usize>,
}

pub fn plan(nexts: &[Next]) -> Option<Plan> {
    let mut p = Plan::default();
    for (i, n) in nexts.iter().enumerate() {
        match n {
            Next::Step(cp) => p.advance.push((i, cp.clone())),
            Next::End { checkpoint, end } => {
                if !matches!(end, End::Succeed { .. } | End::Continue) {
                    return None;
                }
                if let Some(cp) = checkpoint {
                    p.advance.push((i, cp.clone()));
                }
                match end {
                    End::Succeed { checkpoint } => p.succeed.push((i, checkpoint.clone())),
                    _ => p.cont.push(i),
                }
            }
            Next::Abort(_) => return None,
        }
    }
    Some(p)
}

/// Why the members stopped stepping together.
#[derive(Debug)]
enum Apart {
    /// Rolled back (or never begun): replay every member from where the step began.
    RolledBack(&'static str),
    /// A group step committed only the members that fit in its time: steps this long gain
    /// nothing from sharing a transaction, so each member goes on alone from where it is.
    Disbanded,
    /// The commit's outcome is unknown: read each member back first.
    Uncertain,
}

/// Runs the slices of `jobs` (claimed, of one kind) together. Returns each job's end, as
/// [`runner::run_slice`] would (`None`: shutdown came before its deciding commit).
pub async fn run_group(
    tr: &dyn GroupTransitions,
    mut jobs: Vec<JobCtx>,
    mut conn: Slot,
    env: Env<'_>,
) -> Vec<(Uuid, Option<&'static str>)> {
    let name = tr.kind_name();
    let policy = tr.policy();
    jobs.sort_by_key(|j| j.job_id);
    let mut ended: Vec<(Uuid, Option<&'static str>)> = Vec::with_capacity(jobs.len());
    let beats = GroupBeat::start(tr, env, policy.heartbeat(), &jobs);
    let started = Instant::now();
    let mut steps_done = 0u32;
    let apart = loop {
        beats.end_lost(name, &mut jobs, &mut ended);
        if jobs.len() <= 1 {
            break Apart::RolledBack("one member left");
        }
        if env.shutdown.is_cancelled() {
            break Apart::RolledBack("shutting down");
        }
        let span = tracing::info_span!("group_step", kind = name, members = jobs.len());
        let held = beats.gate.hold().await;
        // A group step unanswered for a whole lease (a link gone silent) may have committed or
        // not: each member reads its row back.
        let stepped = tokio::time::timeout(
            policy.lease,
            step_together(tr, &mut jobs, &mut conn, env, &mut steps_done, started).instrument(span),
        )
        .await
        .unwrap_or(Err(Apart::Uncertain));
        drop(held);
        match stepped {
            Ok((done, cut)) => {
                crash::point("after-group-step-commit");
                for (id, end) in done {
                    beats.forget(id);
                    crate::metrics::slice(name, end, started.elapsed());
                    ended.push((id, Some(end)));
                }
                for job in &jobs {
                    tr.after_step_commit(job).await;
                }
                if !env.keep_connection {
                    conn = None;
                }
                if cut {
                    break Apart::Disbanded;
                }
            }
            Err(apart) => {
                // The members alone take fresh connections: this one may be broken.
                conn = None;
                break apart;
            }
        }
    };
    // The members going on alone carry the group's last renewal of their leases, so their own
    // heartbeats fall due one interval after it, not one interval after they go alone. That
    // renewal extended every member but those the beats found lost, which end here.
    beats.end_lost(name, &mut jobs, &mut ended);
    if let Some(renewed) = beats.renewed() {
        for job in &mut jobs {
            job.renewed = job.renewed.max(renewed);
        }
    }
    drop(beats);
    if jobs.is_empty() {
        return ended;
    }
    match &apart {
        Apart::RolledBack(why) if jobs.len() > 1 => tracing::debug!(
            kind = name,
            members = jobs.len(),
            why,
            "group step rolled back; replaying each member alone"
        ),
        Apart::Disbanded => tracing::debug!(
            kind = name,
            members = jobs.len(),
            "group steps outlast a heartbeat interval; each member goes on alone"
        ),
        _ => {}
    }
    // Each member alone, from where the group left it: its own fence finds out whether the
    // lease is still its own.
    let uncertain = matches!(apart, Apart::Uncertain);
    let mut conns: Vec<Slot> = std::iter::once(conn)
        .chain(std::iter::repeat_with(|| None))
        .take(jobs.len())
        .collect();
    let alone = jobs
        .into_iter()
        .zip(conns.drain(..))
        .map(|(mut job, conn)| async move {
            if uncertain {
                match runner::resync(tr, env, &job).await {
                    runner::Resync::Ours {
                        row_version,
                        checkpoint,
                    } => {
                        job.row_version = row_version;
                        job.checkpoint = checkpoint;
                    }
                    runner::Resync::Lost => return (job.job_id, Some(LEASE_LOST)),
                    runner::Resync::Shutdown => return (job.job_id, None),
                }
            }
            let id = job.job_id;
            (id, runner::run_slice(tr, job, conn, env).await)
        });
    ended.extend(join_all(alone).await);
    ended
}

/// One group step: fence all, step each (while they fit in a heartbeat interval), advance and
/// end those stepped, commit. Returns the members that ended (removed from `jobs`), with how,
/// and whether the step was cut short (some members not stepped: they are left as they were);
/// the others moved to their new checkpoints.
async fn step_together(
    tr: &dyn GroupTransitions,
    jobs: &mut Vec<JobCtx>,
    conn: &mut Slot,
    env: Env<'_>,
    steps_done: &mut u32,
    started: Instant,
) -> Result<(Vec<(Uuid, &'static str)>, bool), Apart> {
    // Until this commits, the group's row locks keep the heartbeat from extending any
    // member's lease: its steps must end within a heartbeat interval.
    let until = Until::new(Instant::now() + tr.policy().heartbeat());
    if conn.is_none() {
        *conn = Some(
            crate::db::acquire(env.pool)
                .await
                .map_err(|_| Apart::RolledBack("no connection"))?,
        );
    }
    let c: &mut PgConnection = conn.as_mut().expect("acquired above");
    let mut tx = sqlx::Connection::begin(c)
        .await
        .map_err(|_| Apart::RolledBack("cannot begin"))?;
    let refs: Vec<&JobCtx> = jobs.iter().collect();
    let fenced = tr
        .fence_many(&mut tx, &refs)
        .await
        .map_err(|_| Apart::RolledBack("fence failed"))?;
    if fenced.len() != jobs.len() {
        return Err(Apart::RolledBack("a member's fence did not match"));
    }
    let span = tracing::info_span!("steps", kind = tr.kind_name(), members = jobs.len());
    // On an error the transaction may be aborted, and the failure is the member's own to write.
    // A panic counts as an error (see `unwind`): each member's own step then settles it.
    let results = super::unwind::step(tr.step_many(&mut tx, jobs.as_slice(), until))
        .instrument(span)
        .await
        .map_err(|_| Apart::RolledBack("a member's step failed"))?;
    if results.is_empty() || results.len() > jobs.len() {
        return Err(Apart::RolledBack("a step is missing"));
    }
    // Members past the prefix were not stepped: no advance, no end, and the commit only
    // releases their fence.
    let cut = results.len() < jobs.len();
    *steps_done += 1;
    let policy = tr.policy();
    let nexts: Vec<Next> = results
        .into_iter()
        .zip(jobs.iter())
        .map(|(r, job)| {
            let progress = Progress {
                steps_done: *steps_done,
                elapsed: started.elapsed(),
                attempts: job.execution_attempts,
                max_attempts: job.max_execution_attempts,
            };
            slice::after_step(Ok(r), progress, env.budget, policy.retry, rand::random())
        })
        .collect();
    let Some(plan) = plan(&nexts) else {
        return Err(Apart::RolledBack("a member ends in a way of its own"));
    };
    let mut moved = jobs.clone();
    if !plan.advance.is_empty() {
        let moves: Vec<(&JobCtx, &str)> = plan
            .advance
            .iter()
            .map(|(i, cp)| (&jobs[*i], cp.as_str()))
            .collect();
        let rows = tr
            .advance_many(&mut tx, &moves)
            .await
            .map_err(|_| Apart::RolledBack("advance failed"))?;
        if rows.len() != moves.len() {
            return Err(Apart::RolledBack("a member's lease ran out"));
        }
        for (i, cp) in &plan.advance {
            let rv = rows
                .iter()
                .find(|(id, _)| *id == jobs[*i].job_id)
                .map(|&(_, rv)| rv)
                .ok_or(Apart::RolledBack("a member's advance is missing"))?;
            moved[*i].row_version = rv;
            moved[*i].checkpoint = cp.clone();
        }
    }
    for (how, members) in [
        (GroupEnd::Succeed, plan.succeed.clone()),
        (
            GroupEnd::Continue,
            plan.cont.iter().map(|&i| (i, String::new())).collect(),
        ),
    ] {
        if members.is_empty() {
            continue;
        }
        let ends: Vec<(&JobCtx, &str)> = members
            .iter()
            .map(|(i, cp)| (&moved[*i], cp.as_str()))
            .collect();
        let ids = tr
            .end_many(&mut tx, how, &ends)
            .await
            .map_err(|_| Apart::RolledBack("end failed"))?;
        if ids.len() != ends.len() {
            return Err(Apart::RolledBack("a member's end did not match"));
        }
    }
    tx.commit().await.map_err(|_| Apart::Uncertain)?;
    let ending: HashSet<usize> = plan
        .succeed
        .iter()
        .map(|(i, _)| *i)
        .chain(plan.cont.iter().copied())
        .collect();
    let mut done = Vec::new();
    let mut rest = Vec::with_capacity(moved.len());
    for (i, job) in moved.into_iter().enumerate() {
        if ending.contains(&i) {
            let end = if plan.cont.contains(&i) {
                End::Continue.name()
            } else {
                "succeeded"
            };
            done.push((job.job_id, end));
        } else {
            rest.push(job);
        }
    }
    *jobs = rest;
    Ok((done, cut))
}

fn lease_lost(name: &'static str, job: &JobCtx) -> &'static str {
    crate::metrics::lease_lost(name);
    tracing::warn!(kind = name, job_id = %job.job_id, "lease lost; stopping the slice and writing nothing more");
    LEASE_LOST
}

/// The heartbeat of a group: every lease/3, one statement extends every member's lease. A
/// member it did not extend is lost: the group stops stepping it. Stops when dropped.
struct GroupBeat {
    stop: CancellationToken,
    /// Held by each group step's transaction and by each beat: see [`runner::StepGate`].
    gate: runner::StepGate,
    live: Arc<Mutex<Vec<JobCtx>>>,
    lost: Arc<Mutex<Vec<Uuid>>>,
    /// When the last beat that extended every live member was sent.
    renewed: Arc<Mutex<Option<Instant>>>,
}

impl GroupBeat {
    fn start(tr: &dyn GroupTransitions, env: Env<'_>, every: Duration, jobs: &[JobCtx]) -> Self {
        let stop = CancellationToken::new();
        let gate = runner::StepGate::default();
        let turns = gate.clone();
        let live = Arc::new(Mutex::new(jobs.to_vec()));
        let lost = Arc::new(Mutex::new(Vec::new()));
        let renewed = Arc::new(Mutex::new(None));
        let beat = tr.group_heartbeat();
        let (stopped, pool, members, gone, last) = (
            stop.clone(),
            env.heartbeat_pool.clone(),
            live.clone(),
            lost.clone(),
            renewed.clone(),
        );
        let every = every.max(Duration::from_millis(100));
        // One interval after the oldest member's lease was last renewed.
        let mut due = jobs
            .iter()
            .map(|j| j.beat_due(every))
            .min()
            .unwrap_or_else(|| Instant::now() + every);
        tokio::spawn(async move {
            loop {
                let wait = due.saturating_duration_since(Instant::now());
                if !super::backoff::nap(wait, &stopped).await {
                    return;
                }
                let Some(_held) = turns.hold_unless(&stopped).await else {
                    return;
                };
                due = Instant::now() + every;
                let now: Vec<JobCtx> = members.lock().expect("not poisoned").clone();
                if now.is_empty() {
                    continue;
                }
                let sent = Instant::now();
                let extended = crate::db::within(every, async {
                    let mut conn = crate::db::acquire(&pool).await?;
                    beat.extend_many(&mut conn, &now).await
                });
                match extended.await {
                    Ok(ids) => {
                        due = sent + every;
                        let missing: Vec<Uuid> = now
                            .iter()
                            .map(|j| j.job_id)
                            .filter(|id| !ids.contains(id))
                            .collect();
                        if !missing.is_empty() {
                            members
                                .lock()
                                .expect("not poisoned")
                                .retain(|j| !missing.contains(&j.job_id));
                            gone.lock().expect("not poisoned").extend(missing);
                        }
                        // After the lost are known: a reader of this renewal finds them.
                        *last.lock().expect("not poisoned") = Some(sent);
                    }
                    Err(e) => {
                        tracing::warn!(members = now.len(), error = %e, "group heartbeat failed; will try again");
                    }
                }
            }
        });
        Self {
            stop,
            gate,
            live,
            lost,
            renewed,
        }
    }

    /// When the last beat that extended every member still live was sent, if one did.
    fn renewed(&self) -> Option<Instant> {
        *self.renewed.lock().expect("not poisoned")
    }

    /// Moves the members the beats found lost from `jobs` to `ended`, as lease lost.
    fn end_lost(
        &self,
        name: &'static str,
        jobs: &mut Vec<JobCtx>,
        ended: &mut Vec<(Uuid, Option<&'static str>)>,
    ) {
        let lost = std::mem::take(&mut *self.lost.lock().expect("not poisoned"));
        for id in lost {
            if let Some(i) = jobs.iter().position(|j| j.job_id == id) {
                let job = jobs.remove(i);
                ended.push((job.job_id, Some(lease_lost(name, &job))));
            }
        }
    }

    fn forget(&self, id: Uuid) {
        self.live
            .lock()
            .expect("not poisoned")
            .retain(|j| j.job_id != id);
    }
}

impl Drop for GroupBeat {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Extends every lease of a group in one statement; returns the ids extended (any other lease
/// is lost). Does not bump row versions, so it never races the group's steps.
#[async_trait::async_trait]
pub trait GroupHeartbeat: Send + Sync + 'static {
    async fn extend_many(
        &self,
        conn: &mut PgConnection,
        jobs: &[JobCtx],
    ) -> Result<Vec<Uuid>, sqlx::Error>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn succeed(cp: &str) -> Next {
        Next::End {
            checkpoint: None,
            end: End::Succeed {
                checkpoint: cp.into(),
            },
        }
    }

    #[test]
    fn a_group_writes_advances_and_shared_ends_and_goes_apart_for_any_other_end() {
        let fail = End::Fail {
            code: "x".into(),
            message: "y".into(),
        };
        let cases: Vec<(&str, Vec<Next>, Option<Plan>)> = vec![
            (
                "all step",
                vec![Next::Step("a".into()), Next::Step("b".into())],
                Some(Plan {
                    advance: vec![(0, "a".into()), (1, "b".into())],
                    ..Plan::default()
                }),
            ),
            (
                "all succeed",
                vec![succeed("done"), succeed("done")],
                Some(Plan {
                    succeed: vec![(0, "done".into()), (1, "done".into())],
                    ..Plan::default()
                }),
            ),
            (
                "mixed step, succeed and a budget end with its checkpoint",
                vec![
                    Next::Step("s1".into()),
                    succeed("done"),
                    Next::End {
                        checkpoint: Some("s2".into()),
                        end: End::Continue,
                    },
                ],
                Some(Plan {
                    advance: vec![(0, "s1".into()), (2, "s2".into())],
                    succeed: vec![(1, "done".into())],
                    cont: vec![2],
                }),
            ),
            (
                "a member aborts",
                vec![succeed("done"), Next::Abort(fail.clone())],
                None,
            ),
            (
                "a member is canceled",
                vec![
                    succeed("done"),
                    Next::End {
                        checkpoint: None,
                        end: End::Cancel {
                            code: "c".into(),
                            message: "m".into(),
                        },
                    },
                ],
                None,
            ),
            (
                "a member waits",
                vec![
                    Next::Step("a".into()),
                    Next::End {
                        checkpoint: None,
                        end: End::Wait {
                            delay: Duration::from_secs(1),
                            code: "waiting".into(),
                            message: "m".into(),
                            refund: true,
                        },
                    },
                ],
                None,
            ),
        ];
        for (name, nexts, want) in cases {
            assert_eq!(plan(&nexts), want, "{name}");
        }
    }
}
