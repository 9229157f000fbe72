//! A model's answer streams as deltas readers see before completion; a delta that finds its
//! fence gone stops the answer, a retry streams again from offset 0, and a fenced space fails it.

use super::*;

/// One step of a streamed reply.
#[derive(Clone)]
enum Sse {
    /// A chunk carrying this piece of the answer.
    Piece(String),
    /// Waits until the test opens the gate.
    Gate(Arc<tokio::sync::Notify>),
    /// The last choice chunk, the usage chunk and `[DONE]`.
    End {
        prompt_tokens: u64,
        completion_tokens: u64,
    },
}

fn piece(text: &str) -> Sse {
    Sse::Piece(text.to_owned())
}

/// A stand-in that streams its n-th reply (the last one from then on) as server-sent events,
/// sending each event as it comes to it.
async fn sse_stand_in(replies: Vec<Vec<Sse>>) -> (String, Arc<Mutex<Vec<Captured>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let seen = seen2.clone();
            let replies = replies.clone();
            tokio::spawn(async move {
                let Some(captured) = read_request(&mut sock).await else {
                    return;
                };
                let n = {
                    let mut seen = seen.lock().unwrap();
                    seen.push(captured);
                    seen.len()
                };
                let script = replies[(n - 1).min(replies.len() - 1)].clone();
                let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n";
                if sock.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = |choices: Value, usage: Value| {
                    let c = json!({"id": "chatcmpl-s", "object": "chat.completion.chunk", "model": "stand-in-1",
                                   "choices": choices, "usage": usage});
                    format!("data: {c}\n\n")
                };
                for step in script {
                    let out = match step {
                        Sse::Piece(p) => chunk(
                            json!([{"index": 0, "delta": {"content": p}, "finish_reason": null}]),
                            Value::Null,
                        ),
                        Sse::Gate(g) => {
                            g.notified().await;
                            continue;
                        }
                        Sse::End {
                            prompt_tokens,
                            completion_tokens,
                        } => {
                            let stop = chunk(
                                json!([{"index": 0, "delta": {}, "finish_reason": "stop"}]),
                                Value::Null,
                            );
                            let usage = chunk(
                                json!([]),
                                json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                       "total_tokens": prompt_tokens + completion_tokens}),
                            );
                            format!("{stop}{usage}data: [DONE]\n\n")
                        }
                    };
                    if sock.write_all(out.as_bytes()).await.is_err() {
                        return;
                    }
                    let _ = sock.flush().await;
                }
                let _ = sock.shutdown().await;
            });
        }
    });
    (format!("http://{addr}/v1"), seen)
}

/// Waits (up to a minute) until the job has an answer delta; then returns its events, stage and
/// partial results as they were.
async fn first_delta(pool: &PgPool, id: Uuid) -> (Vec<Event>, String, usize) {
    for _ in 0..600 {
        let evs = events(pool, id).await;
        if evs.iter().any(|e| e.1 == "research_task.answer_delta") {
            let stage = job(pool, id).await.stage;
            let partials = partials(pool, id).await.len();
            return (evs, stage, partials);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no answer delta of {id} appeared");
}

/// The attempt of the last claim among `evs`.
fn last_attempt(evs: &[Event]) -> i64 {
    evs.iter()
        .rev()
        .filter(|e| is_claim(e))
        .find_map(|e| e.4["executionAttempt"].as_i64())
        .expect("a claim")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_models_answer_streams_deltas_readers_see_before_completion_that_reassemble_the_stored_answer(
) {
    let s = seed("stream").await;
    let pool = s.pool().clone();
    let gate = Arc::new(tokio::sync::Notify::new());
    // Text past the first batch: accented and astral characters count in UTF-16 units.
    let long = " on every write; a worker whose lease was lost finds every write refused, \
        and the row version moves with each step (é, 🔒) so that a stale worker can never \
        commit a step twice";
    let (base, seen) = sse_stand_in(vec![vec![
        piece("Fencing"),
        piece(" will use the lease token"),
        Sse::Gate(gate.clone()),
        piece(long),
        piece(" [1]."),
        Sse::End {
            prompt_tokens: 900,
            completion_tokens: 60,
        },
    ]])
    .await;
    let handler = Arc::new(ResearchHandler::with_generator(openai(&base, 0.5, 1.5)));
    let id = request(&pool, &req(&s, QUESTION)).await;
    let e = engine(&pool, "w-stream", handler);
    let watch = async {
        let seen_then = first_delta(&pool, id).await;
        gate.notify_one();
        seen_then
    };
    let (j, (then, stage_then, partials_then)) = tokio::join!(run_until_settled(&s, &e, id), watch);
    assert_eq!(j.stage, "completed", "{j:?}");

    // While the model was still answering, a reader saw the first delta: committed on its own,
    // after the attempt's claim, with the task still generating and no result yet.
    assert_eq!((stage_then.as_str(), partials_then), ("generating", 0));
    let first = then.last().unwrap();
    assert_eq!(first.1, "research_task.answer_delta");
    assert_eq!(first.4["delta"], "Fencing");
    assert_eq!(first.4["offset"], 0);
    assert!(then.iter().any(is_claim));

    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    assert_eq!(advances(&evs), ADVANCES.to_vec());
    let attempt = last_attempt(&evs);
    let stored = answer(&pool, id).await.unwrap();
    let said = format!("Fencing will use the lease token{long} [1].");
    assert_eq!(stored, said);
    assert_eq!(reassemble(&evs, attempt), stored);
    // The first piece at once, then a batch of at least 128 units, then the rest at the end.
    let ds = deltas_of(&evs, attempt);
    let texts: Vec<&str> = ds.iter().map(|e| e.4["delta"].as_str().unwrap()).collect();
    assert_eq!(texts.len(), 3, "{texts:?}");
    assert_eq!(texts[0], "Fencing");
    assert!(texts[1].encode_utf16().count() >= 128, "{texts:?}");
    assert_eq!(texts[2], " [1].");
    for d in &ds {
        assert_eq!(
            d.3,
            format!(
                "research-task-progress:{id}:attempt:{attempt}:answer:{}",
                d.4["offset"]
            )
        );
    }
    // All of them before the completion, which is the last event.
    let completed = evs.iter().position(|e| e.2 == "completed").unwrap();
    assert_eq!(completed, evs.len() - 1);
    assert!(ds.iter().all(|d| d.0 < evs[completed].0));
    // The usage the stream reported is what the call cost.
    assert_eq!(seen.lock().unwrap()[0].body["stream"], true);
    assert_eq!(j.cost["entries"][0]["usage"]["promptTokens"], 900);
    assert_eq!(j.cost["entries"][0]["usage"]["estimated"], false);
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delta_that_finds_its_fence_gone_stops_the_answer_and_a_retry_streams_again_from_offset_0(
) {
    let s = seed("stream-fence").await;
    let pool = s.pool().clone();
    let gate = Arc::new(tokio::sync::Notify::new());
    let long = " on every write, and a worker whose lease was lost finds every write refused, \
        because the fence compares the lease token and the row version each time it writes";
    let (base, seen) = sse_stand_in(vec![
        vec![
            piece("Fencing"),
            Sse::Gate(gate.clone()),
            piece(long),
            piece(" [1]."),
            Sse::End {
                prompt_tokens: 900,
                completion_tokens: 60,
            },
        ],
        vec![
            piece("A lease"),
            piece(" will expire after thirty seconds [2]."),
            Sse::End {
                prompt_tokens: 900,
                completion_tokens: 12,
            },
        ],
    ])
    .await;
    let handler: Arc<dyn Handler> =
        Arc::new(ResearchHandler::with_generator(openai(&base, 0.0, 0.0)));
    // Walked to `generating` by hand (attempt 1), then let go.
    let id = request(&pool, &req(&s, QUESTION)).await;
    let mut ctx = claim_by_hand(&pool, id, "w-hand").await;
    for _ in 0..4 {
        step_by_hand(&pool, handler.as_ref(), &mut ctx)
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(ctx.checkpoint, "generating");
    expire(&pool, id).await;

    // A worker with a one-second lease claims it (attempt 2) and streams the first delta. Its
    // step's transaction idles past the lease and is ended by Postgres, which lets a pause in;
    // then the model goes on, and the next delta finds the task paused.
    let mut cfg = ConsumerConfig::default();
    cfg.policies.insert(
        Kind::Research,
        Policy {
            lease: Duration::from_secs(1),
            ..RESEARCH.policy
        },
    );
    let short = Engine::new(pool.clone(), "w-short", vec![handler.clone()], cfg);
    let pause_then_go = async {
        let (evs, stage, _) = first_delta(&pool, id).await;
        assert_eq!(stage, "generating");
        let mut conn = pool.acquire().await.unwrap();
        let paused = control::pause(&mut conn, id).await.unwrap();
        assert!(paused.changed);
        gate.notify_one();
        evs
    };
    let (handled, then) = tokio::join!(deliver(&s, &short), pause_then_go);
    assert!(handled.is_some());
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    let cut = last_attempt(&then);
    assert_eq!(cut, 2);
    let ds = deltas_of(&evs, cut);
    assert_eq!(ds.len(), 1, "nothing after the fence was lost: {ds:#?}");
    assert_eq!(
        (ds[0].4["delta"].as_str(), ds[0].4["offset"].as_i64()),
        (Some("Fencing"), Some(0))
    );
    assert!(partials(&pool, id).await.is_empty(), "no answer stored");
    let j = job(&pool, id).await;
    assert_eq!(j.stage, "paused", "{j:?}");
    assert!(j.metadata.get("result").is_none());
    assert_eq!(advances(&evs), ADVANCES[..4].to_vec(), "no completion");

    // Resumed, the next attempt streams its own answer from offset 0, under its own number; the
    // cut attempt's delta stays, told apart by its attempt.
    let mut conn = pool.acquire().await.unwrap();
    control::resume(&mut conn, id).await.unwrap();
    drop(conn);
    let e = engine(&pool, "w-after", handler);
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "completed", "{j:?}");
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    let attempt = last_attempt(&evs);
    assert!(attempt > cut, "{attempt}");
    let stored = answer(&pool, id).await.unwrap();
    assert_eq!(stored, "A lease will expire after thirty seconds [2].");
    assert_eq!(reassemble(&evs, attempt), stored);
    assert_eq!(deltas_of(&evs, attempt)[0].4["offset"], 0);
    assert_eq!(reassemble(&evs, cut), "Fencing");
    assert_eq!(seen.lock().unwrap().len(), 2);
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_space_fenced_while_a_model_answers_fails_the_task_with_capability_revoked() {
    let s = seed("stream-grant").await;
    let pool = s.pool().clone();
    let long = " on every write, and a worker whose lease was lost finds every write refused, \
        because the fence compares the lease token and the row version each time it writes";
    // (what the model says after the fence: more text, which its next delta carries; or
    // nothing, so that only the check before completing sees the fence)
    for more in [Some(long), None] {
        let gate = Arc::new(tokio::sync::Notify::new());
        let mut script = vec![piece("Fencing [1]."), Sse::Gate(gate.clone())];
        script.extend(more.map(piece));
        script.push(Sse::End {
            prompt_tokens: 900,
            completion_tokens: 60,
        });
        let (base, _) = sse_stand_in(vec![script]).await;
        let handler = Arc::new(ResearchHandler::with_generator(openai(&base, 0.0, 0.0)));
        let g = grant(&s, s.space, "app-user-7", &[]).await;
        let id = request(&pool, &ResearchRequest::under_grant(s.space, QUESTION, g)).await;
        let e = engine(&pool, "w-stream-grant", handler);
        let fence_then_go = async {
            first_delta(&pool, id).await;
            // No fence row yet: putting one on the space does not wait for the step.
            let mut conn = pool.acquire().await.unwrap();
            platform::fence_capability_space(&mut conn, TENANT, s.space)
                .await
                .unwrap();
            gate.notify_one();
        };
        let (j, ()) = tokio::join!(run_until_settled(&s, &e, id), fence_then_go);
        assert_eq!(j.stage, "failed", "{more:?}: {j:?}");
        assert!(
            j.error
                .as_deref()
                .unwrap()
                .starts_with(&format!("{REVOKED}: ")),
            "{j:?}"
        );
        assert!(partials(&pool, id).await.is_empty());
        let evs = events(&pool, id).await;
        assert_contiguous(id, &evs);
        let sh = shape(&evs);
        assert_eq!(
            sh.last().unwrap(),
            &("failed".into(), "failed".into(), json!({"error": REVOKED}))
        );
        assert_eq!(advances(&evs), ADVANCES[..4].to_vec(), "no completion");
        // Only what was streamed before the fence.
        assert_eq!(reassemble(&evs, last_attempt(&evs)), "Fencing [1].");
        sqlx::query("DELETE FROM capability_space_fences WHERE knowledge_space_id = $1")
            .bind(s.space)
            .execute(&pool)
            .await
            .unwrap();
    }
    s.fx.cleanup().await;
}
