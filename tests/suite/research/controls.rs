//! Pause, resume and cancel: a pause in any stage fences the worker out, every write of a
//! paused worker is refused, controls are idempotent, resume finishes the walk, cancel ends it.

use std::sync::atomic::{AtomicBool, Ordering};

use kfs_worker::jobs::research::{walk::Refusal, ControlError};

use super::*;

/// Pauses its job from another connection while the step at `stage` runs: the pause waits for
/// the step's row lock. When the step's checkpoint has committed, `after_step_commit` waits for
/// the pause to finish, so it commits before the worker's next fence, every time.
struct PauseDuring {
    inner: Arc<dyn Handler>,
    stage: String,
    pool: PgPool,
    fired: AtomicBool,
    pause: Mutex<Option<tokio::task::JoinHandle<Result<control::Controlled, ControlError>>>>,
    /// The pause's outcome, once `after_step_commit` has waited for it.
    paused: Mutex<Option<Result<control::Controlled, ControlError>>>,
}

impl PauseDuring {
    /// The pause's outcome: waited for between two steps, or (when the step at `stage` ended
    /// the slice) now.
    async fn outcome(&self) -> Result<control::Controlled, ControlError> {
        if let Some(done) = self.paused.lock().unwrap().take() {
            return done;
        }
        let pending = self.pause.lock().unwrap().take().expect("pause fired");
        pending.await.unwrap()
    }
}

#[async_trait::async_trait]
impl Handler for PauseDuring {
    fn kind(&self) -> Kind {
        Kind::Research
    }

    async fn step(&self, tx: &mut PgConnection, ctx: &JobCtx) -> Result<Step, JobError> {
        if ctx.checkpoint == self.stage && !self.fired.swap(true, Ordering::SeqCst) {
            let pool = self.pool.clone();
            let id = ctx.job_id;
            let handle = tokio::spawn(async move {
                let mut c = pool.acquire().await.unwrap();
                control::pause(&mut c, id).await
            });
            *self.pause.lock().unwrap() = Some(handle);
            // Until the pause waits on our row lock.
            let mut waiting = false;
            for _ in 0..200 {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                     AND wait_event_type = 'Lock' AND query LIKE '%FOR UPDATE%'",
                )
                .fetch_one(&self.pool)
                .await
                .unwrap();
                if n > 0 {
                    waiting = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(waiting, "the pause never waited on the job row");
        }
        self.inner.step(tx, ctx).await
    }

    async fn after_step_commit(&self, _job: &JobCtx) {
        let pending = self.pause.lock().unwrap().take();
        if let Some(pending) = pending {
            let done = pending.await.unwrap();
            *self.paused.lock().unwrap() = Some(done);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pause_in_each_stage_fences_the_running_worker_and_resume_finishes_the_walk() {
    let s = seed("pause").await;
    let pool = s.pool().clone();
    for stage in ["planning", "retrieving", "analyzing", "generating"] {
        let id = request(&pool, &req(&s, QUESTION)).await;
        let pauser = Arc::new(PauseDuring {
            inner: extractive(),
            stage: stage.into(),
            pool: pool.clone(),
            fired: AtomicBool::new(false),
            pause: Mutex::new(None),
            paused: Mutex::new(None),
        });
        let e = Engine::new(
            pool.clone(),
            format!("w-pause-{stage}"),
            vec![pauser.clone() as Arc<dyn Handler>],
            ConsumerConfig::default(),
        );
        // Up to the stage: the walk goes queued → planning → ... in one slice, and the pause
        // lands between the step at `stage` and the next one.
        let handled = deliver(&s, &e).await.expect("a delivery");
        let paused = pauser.outcome().await;
        let next = research::walk::next_stage(research::Stage::parse(stage).unwrap()).unwrap();
        if next == research::Stage::Completed {
            // The step at generating completes the job in its own transaction: too late to pause.
            assert_eq!(
                handled,
                Handled::Ack {
                    claim: "claimed",
                    end: Some("succeeded")
                }
            );
            assert!(
                matches!(
                    paused,
                    Err(ControlError::Refused(
                        _,
                        Refusal::Terminal(research::Stage::Completed, _)
                    ))
                ),
                "{paused:?}"
            );
            assert_eq!(job(&pool, id).await.stage, "completed");
            assert_contiguous(id, &events(&pool, id).await);
            continue;
        }
        let paused = paused.unwrap();
        assert!(paused.changed);
        assert_eq!(paused.from, next, "paused right after the step at {stage}");
        // The worker's next write was refused: its slice ended with the lease lost.
        assert_eq!(
            handled,
            Handled::Ack {
                claim: "claimed",
                end: Some("lease_lost")
            },
            "at {stage}"
        );
        assert_eq!(e.counters.lease_lost.load(Ordering::Relaxed), 1);

        let j = job(&pool, id).await;
        assert_eq!(j.stage, "paused");
        assert_eq!(j.paused_from.as_deref(), Some(next.as_str()));
        assert_eq!(j.error, None, "a pause without a reason records none");
        assert!(
            j.lease_token.is_some(),
            "as on the platform, a pause keeps the lease columns"
        );
        assert_eq!(outbox_states(&pool, id).await, vec!["canceled"]);
        // Nothing is due while paused.
        assert!(deliver(&s, &e).await.is_none());

        let resumed = control::resume(&mut pool.acquire().await.unwrap(), id)
            .await
            .unwrap();
        assert_eq!(
            (resumed.from, resumed.to, resumed.outbox_revision),
            (research::Stage::Paused, next, Some(2))
        );
        assert_eq!(job(&pool, id).await.lease_token, None);
        let ob = outbox(&pool, id).await;
        assert_eq!(
            ob[1],
            (
                2,
                "pending".into(),
                format!("research.task:{TENANT}:{}:{id}:2", s.space)
            )
        );
        let j = run_until_settled(&s, &e, id).await;
        assert_eq!(j.stage, "completed", "after a pause at {stage}: {j:?}");
        let evs = events(&pool, id).await;
        assert_contiguous(id, &evs);
        assert_eq!(advances(&evs), ADVANCES.to_vec());
        let sh = shape(&evs);
        let p = sh.iter().position(|t| t.0 == "paused").unwrap();
        assert_eq!(sh[p], ("paused".into(), "paused".into(), json!({})));
        assert_eq!(
            sh[p + 1],
            (
                "resumed".into(),
                next.as_str().into(),
                json!({"resumedFrom": "paused"})
            )
        );
        // The resumed run is a new execution attempt, and says so.
        assert_eq!(
            sh[p + 2],
            ("stage_changed".into(), next.as_str().into(), claim(2))
        );
        assert_eq!(partials(&pool, id).await.len(), 1, "no partial twice");
    }
    s.fx.cleanup().await;
}

/// The same at the lease level, deterministically, for every runnable stage: a worker holds the
/// job at `stage`, the task is paused, and every write the worker tries is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_holding_the_job_at_any_stage_is_fenced_out_by_a_pause() {
    let s = seed("hold").await;
    let pool = s.pool().clone();
    let handler = extractive();
    let st = Statements::new(&RESEARCH);
    let walk = [
        "queued",
        "planning",
        "retrieving",
        "analyzing",
        "generating",
    ];
    for (steps, stage) in walk.iter().enumerate() {
        let id = request(&pool, &req(&s, QUESTION)).await;
        let mut ctx = claim_by_hand(&pool, id, &format!("w-{stage}")).await;
        for _ in 0..steps {
            step_by_hand(&pool, handler.as_ref(), &mut ctx)
                .await
                .unwrap()
                .unwrap();
        }
        assert_eq!(ctx.checkpoint, *stage);
        let mut conn = pool.acquire().await.unwrap();
        let p = control::pause(&mut conn, id).await.unwrap();
        assert_eq!(p.from.as_str(), *stage);
        let j = job(&pool, id).await;
        assert_eq!(
            (j.stage.as_str(), j.paused_from.as_deref()),
            ("paused", Some(*stage))
        );
        let before = (
            events(&pool, id).await.len(),
            partials(&pool, id).await.len(),
        );
        assert_eq!(
            step_by_hand(&pool, handler.as_ref(), &mut ctx)
                .await
                .unwrap(),
            None,
            "at {stage}"
        );
        assert!(
            !lease::heartbeat(&mut conn, &st, &ctx, Duration::from_secs(30))
                .await
                .unwrap()
        );
        let done = End::Succeed {
            checkpoint: "completed".into(),
        };
        assert!(!lease::end(&mut conn, &st, &ctx, &done).await.unwrap());
        assert_eq!(
            before,
            (
                events(&pool, id).await.len(),
                partials(&pool, id).await.len()
            )
        );
        let r = control::resume(&mut conn, id).await.unwrap();
        assert_eq!(r.to.as_str(), *stage);
        drop(conn);
        let e = engine(&pool, &format!("w-finish-{stage}"), extractive());
        assert_eq!(
            run_until_settled(&s, &e, id).await.stage,
            "completed",
            "at {stage}"
        );
        let evs = events(&pool, id).await;
        assert_contiguous(id, &evs);
        let ts = types(&evs);
        let at = ts.iter().position(|t| t == "paused").unwrap();
        // started, then (when a step ran) the claim and one advance per step.
        let want = if steps == 0 { 1 } else { steps + 2 };
        assert_eq!(at, want, "{ts:?}");
        assert_eq!(ts[at + 1], "resumed");
        assert_eq!(advances(&evs), ADVANCES.to_vec());
        assert_eq!(partials(&pool, id).await.len(), 1);
    }
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_worker_finds_every_write_refused_and_controls_are_idempotent() {
    let s = seed("idem").await;
    let pool = s.pool().clone();
    let id = request(&pool, &req(&s, QUESTION)).await;

    // Paused while queued, before any worker: nothing runs until resumed.
    let p = control::pause(&mut pool.acquire().await.unwrap(), id)
        .await
        .unwrap();
    assert_eq!(
        (p.from, p.to, p.changed),
        (research::Stage::Queued, research::Stage::Paused, true)
    );
    let again = control::pause(&mut pool.acquire().await.unwrap(), id)
        .await
        .unwrap();
    assert!(!again.changed, "a repeated pause changes nothing");
    control::resume(&mut pool.acquire().await.unwrap(), id)
        .await
        .unwrap();

    // A worker holds the job at retrieving; a pause (with a reason) fences it out of every write.
    let handler = extractive();
    let mut ctx = claim_by_hand(&pool, id, "w-hand").await;
    for _ in 0..2 {
        step_by_hand(&pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(ctx.checkpoint, "retrieving");
    let p = control::pause_with(&mut pool.acquire().await.unwrap(), id, Some("lunch"))
        .await
        .unwrap();
    assert_eq!(p.from, research::Stage::Retrieving);
    assert_eq!(job(&pool, id).await.error.as_deref(), Some("lunch"));
    let before = (events(&pool, id).await, partials(&pool, id).await.len());
    assert_eq!(
        step_by_hand(&pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap(),
        None
    );
    let st = Statements::new(&RESEARCH);
    let mut conn = pool.acquire().await.unwrap();
    assert!(
        !lease::heartbeat(&mut conn, &st, &ctx, Duration::from_secs(30))
            .await
            .unwrap()
    );
    assert!(!lease::end(&mut conn, &st, &ctx, &End::Continue)
        .await
        .unwrap());
    assert_eq!(
        before,
        (events(&pool, id).await, partials(&pool, id).await.len())
    );

    // Resume: back to retrieving, a new revision, the error cleared; the old worker stays out.
    let r = control::resume(&mut conn, id).await.unwrap();
    assert_eq!(
        (r.to, r.outbox_revision),
        (research::Stage::Retrieving, Some(3))
    );
    assert_eq!(job(&pool, id).await.error, None);
    assert_eq!(
        step_by_hand(&pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap(),
        None
    );
    let again = control::resume(&mut conn, id).await.unwrap();
    assert!(!again.changed, "resuming a running task changes nothing");
    let ob = outbox(&pool, id).await;
    assert_eq!(
        ob.iter().map(|o| (o.0, o.1.as_str())).collect::<Vec<_>>(),
        vec![(1, "canceled"), (2, "canceled"), (3, "pending")]
    );
    let e = engine(&pool, "w-after", extractive());
    assert_eq!(run_until_settled(&s, &e, id).await.stage, "completed");
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    let sh: Vec<(String, String, Value)> = shape(&evs)
        .into_iter()
        .map(|(t, st, mut p)| {
            // The details are asserted in the whole-walk test.
            if let Some(o) = p.as_object_mut() {
                o.remove("details");
            }
            (t, st, p)
        })
        .collect();
    let ev = |t: &str, stage: &str, p: Value| (t.to_owned(), stage.to_owned(), p);
    assert_eq!(
        sh,
        vec![
            ev("started", "queued", json!({})),
            ev("paused", "paused", json!({})),
            ev("resumed", "queued", json!({"resumedFrom": "paused"})),
            ev("stage_changed", "queued", claim(1)),
            ev(
                "stage_changed",
                "planning",
                json!({"previousStage": "queued"})
            ),
            ev(
                "stage_changed",
                "retrieving",
                json!({"previousStage": "planning"})
            ),
            ev("paused", "paused", json!({"reason": "lunch"})),
            ev("resumed", "retrieving", json!({"resumedFrom": "paused"})),
            ev("stage_changed", "retrieving", claim(2)),
            ev(
                "stage_changed",
                "analyzing",
                json!({"previousStage": "retrieving"})
            ),
            ev(
                "stage_changed",
                "generating",
                json!({"previousStage": "analyzing"})
            ),
            ev(
                "answer_delta",
                "generating",
                json!({"delta": answer(&pool, id).await.unwrap(), "executionAttempt": 2, "offset": 0})
            ),
            ev(
                "stage_changed",
                "completed",
                json!({"previousStage": "generating"})
            ),
        ]
    );
    // A finished task can be neither paused nor resumed nor canceled.
    for r in [
        control::pause(&mut conn, id).await,
        control::resume(&mut conn, id).await,
        control::cancel(&mut conn, id, None).await,
    ] {
        assert!(
            matches!(r, Err(ControlError::Refused(_, Refusal::Terminal(..)))),
            "{r:?}"
        );
    }
    assert!(matches!(
        control::pause(&mut conn, Uuid::now_v7()).await,
        Err(ControlError::NotFound(_))
    ));
    drop(conn);
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancel_ends_the_task_for_good() {
    let s = seed("cancel").await;
    let pool = s.pool().clone();
    let id = request(&pool, &req(&s, QUESTION)).await;
    let handler = extractive();
    let mut ctx = claim_by_hand(&pool, id, "w-cancel").await;
    step_by_hand(&pool, handler.as_ref(), &mut ctx)
        .await
        .unwrap()
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let c = control::cancel(&mut conn, id, Some("the user lost interest"))
        .await
        .unwrap();
    assert_eq!(
        (c.from, c.to),
        (research::Stage::Planning, research::Stage::Canceled)
    );
    let j = job(&pool, id).await;
    assert_eq!(j.stage, "canceled");
    assert_eq!(j.error.as_deref(), Some("the user lost interest"));
    assert_eq!(j.lease_token, None);
    let completed_at: Option<i64> =
        sqlx::query_scalar("SELECT completed_at FROM research_task_jobs WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(completed_at.is_some());
    assert_eq!(outbox_states(&pool, id).await, vec!["canceled"]);
    // The worker is fenced out; the task stays canceled.
    assert_eq!(
        step_by_hand(&pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap(),
        None
    );
    assert!(!control::cancel(&mut conn, id, None).await.unwrap().changed);
    assert!(matches!(
        control::resume(&mut conn, id).await,
        Err(ControlError::Refused(
            _,
            Refusal::Terminal(research::Stage::Canceled, _)
        ))
    ));
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    assert_eq!(
        shape(&evs),
        vec![
            ("started".into(), "queued".into(), json!({})),
            ("stage_changed".into(), "queued".into(), claim(1)),
            (
                "stage_changed".into(),
                "planning".into(),
                json!({"previousStage": "queued"})
            ),
            (
                "canceled".into(),
                "canceled".into(),
                json!({"reason": "the user lost interest"})
            ),
        ]
    );
    let e = engine(&pool, "w-x", extractive());
    assert!(deliver(&s, &e).await.is_none(), "nothing is due");
    drop(conn);
    s.fx.cleanup().await;
}
