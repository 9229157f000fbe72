//! The HTTP generator against a local stand-in answers and records its cost, and a budget
//! overrun cancels the task with the platform's reason.

use kfs_worker::jobs::RetryPolicy;

use super::*;

/// A tiny OpenAI-compatible stand-in on 127.0.0.1 that answers the n-th request with the n-th
/// reply (the last one from then on).
async fn stand_in(replies: Vec<(u16, Value)>) -> (String, Arc<Mutex<Vec<Captured>>>) {
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
                let (status, reply) = replies[(n - 1).min(replies.len() - 1)].clone();
                let reply = reply.to_string();
                let resp = format!(
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}",
                    reply.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    (format!("http://{addr}/v1"), seen)
}

fn completion(content: &str, prompt_tokens: u64, completion_tokens: u64) -> Value {
    json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "stand-in-1",
        "choices": [{ "index": 0, "message": { "role": "assistant", "content": content }, "finish_reason": "stop" }],
        "usage": { "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens }
    })
}

/// An engine whose research retries come due at once.
fn quick_retry_engine(pool: &PgPool, worker: &str, handler: Arc<dyn Handler>) -> Engine {
    let mut cfg = ConsumerConfig::default();
    cfg.policies.insert(
        Kind::Research,
        Policy {
            retry: RetryPolicy {
                base: Duration::from_millis(10),
                max: Duration::from_millis(10),
            },
            ..RESEARCH.policy
        },
    );
    Engine::new(pool.clone(), worker, vec![handler], cfg)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_http_generator_answers_through_a_local_stand_in_and_records_its_cost() {
    let s = seed("http").await;
    let pool = s.pool().clone();
    let said = "Fencing will use the lease token on every write [1]; a lease will expire after thirty seconds [2].";
    let ok = completion(said, 1200, 40);
    // The first call finds the service overloaded: a retry, then the answer.
    let (base, seen) = stand_in(vec![(503, json!({"error": "busy"})), (200, ok)]).await;
    let handler = Arc::new(ResearchHandler::with_generator(openai(&base, 0.5, 1.5)));
    let id = request(
        &pool,
        &ResearchRequest {
            budget_usd: Some(1.0),
            ..req(&s, QUESTION)
        },
    )
    .await;
    let e = quick_retry_engine(&pool, "w-http", handler);
    deliver(&s, &e).await.expect("a delivery");
    let j = job(&pool, id).await;
    assert_eq!(j.stage, "generating", "{j:?}");
    let (retry_at, error): (i64, String) =
        sqlx::query_as("SELECT retry_at, error FROM research_task_jobs WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(error.starts_with("generator_unavailable: "), "{error}");
    assert!(!error.contains("sk-test-secret"));
    let retried = events(&pool, id).await;
    assert_eq!(
        shape(&retried).last().unwrap(),
        &(
            "stage_changed".into(),
            "generating".into(),
            json!({"error": error, "retryAt": retry_at, "retryScheduled": true})
        )
    );
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "completed", "{j:?}");

    let calls = seen.lock().unwrap().clone();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[1].request_line, "POST /v1/chat/completions HTTP/1.1");
    assert_eq!(
        calls[1].authorization.as_deref(),
        Some("Bearer sk-test-secret")
    );
    assert_eq!(calls[1].body["model"], "stand-in-1");
    assert_eq!(calls[1].body["max_tokens"], 100);
    let user = calls[1].body["messages"][1]["content"].as_str().unwrap();
    assert!(
        user.contains(QUESTION) && user.contains("[1]") && user.contains("Fencing will use"),
        "{user}"
    );
    assert!(!user.contains("OTHER-TENANT-SECRET"));

    // The stream was asked for; this service answered with one JSON completion instead, so the
    // answer is one delta, of the attempt that made it.
    assert_eq!(calls[1].body["stream"], true);
    assert_eq!(answer(&pool, id).await.as_deref(), Some(said));
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    assert_eq!(reassemble(&evs, 2), said);
    assert!(
        deltas_of(&evs, 1).is_empty(),
        "the failed call streamed nothing"
    );
    let result = &j.metadata["result"];
    assert_eq!(result["generator"], "openai");
    assert_eq!(result["model"], "stand-in-1");
    let indices: Vec<u64> = result["citations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indices, vec![1, 2]);
    // The failed attempt's reservation went with its step; the second attempt's call is the one
    // entry, settled with what the service billed.
    let mut cost = j.cost.clone();
    cost["entries"][0]["recordedAt"] = json!(0);
    assert_eq!(
        cost,
        json!({"budgetUsd": 1.0, "entries": [{"costUsd": 0.66, "provider": "openai", "recordedAt": 0,
          "step": "query.answer", "usage": {"completionTokens": 40, "estimated": false, "promptTokens": 1200,
            "researchModelCallId": format!("attempt:2:query-answer:{id}:2:openai"), "reserved": false,
            "status": "succeeded", "totalTokens": 1240}}], "totalUsd": 0.66})
    );
    // The key is nowhere in the database.
    let dump: String = sqlx::query_scalar(
        "SELECT concat((SELECT string_agg(j::text, '') FROM research_task_jobs j), \
           (SELECT string_agg(e::text, '') FROM research_task_progress_events e), \
           (SELECT string_agg(p::text, '') FROM research_task_partial_results p))",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(!dump.contains("sk-test-secret"));
    s.fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_budget_overrun_cancels_the_task_with_the_platforms_reason() {
    let s = seed("budget").await;
    let pool = s.pool().clone();
    let (base, seen) = stand_in(vec![(
        200,
        completion("A very long answer [1].", 1000, 500_000),
    )])
    .await;
    let handler = Arc::new(ResearchHandler::with_generator(openai(&base, 0.001, 0.01)));
    let id = request(
        &pool,
        &ResearchRequest {
            budget_usd: Some(1.0),
            ..req(&s, QUESTION)
        },
    )
    .await;
    let e = engine(&pool, "w-budget", handler);
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "canceled", "{j:?}");
    assert_eq!(
        seen.lock().unwrap().len(),
        1,
        "the reservation fit; the call was made"
    );
    let error = j.error.unwrap();
    assert!(
        error.starts_with("RESEARCH_TASK_BUDGET_EXHAUSTED: "),
        "{error}"
    );
    assert!(error.contains("over the budget of $1.0"), "{error}");
    assert_eq!(j.cost["budgetExceeded"], true);
    let usd = j.cost["totalUsd"].as_f64().unwrap();
    assert!(
        (usd - 5.001).abs() < 1e-9,
        "the spend is recorded: {}",
        j.cost
    );
    assert_eq!(j.cost["entries"][0]["usage"]["status"], "succeeded");
    assert!(j.metadata.get("result").is_none(), "no answer over budget");
    assert!(partials(&pool, id).await.is_empty());
    let evs = events(&pool, id).await;
    assert_contiguous(id, &evs);
    assert_eq!(advances(&evs), ADVANCES[..4].to_vec());
    assert_eq!(
        shape(&evs).last().unwrap(),
        &(
            "canceled".into(),
            "canceled".into(),
            json!({"reason": "RESEARCH_TASK_BUDGET_EXHAUSTED"})
        )
    );
    assert_eq!(outbox_states(&pool, id).await, vec!["canceled"]);

    // A budget the reservation alone exceeds cancels before any call, and spends nothing.
    let id = request(
        &pool,
        &ResearchRequest {
            budget_usd: Some(0.0),
            ..req(&s, QUESTION)
        },
    )
    .await;
    let j = run_until_settled(&s, &e, id).await;
    assert_eq!(j.stage, "canceled");
    assert!(j.error.unwrap().contains("would cost up to"));
    assert_eq!(
        j.cost,
        json!({"budgetUsd": 0.0, "entries": [], "totalUsd": 0.0})
    );
    assert_eq!(seen.lock().unwrap().len(), 1, "no second call");
    s.fx.cleanup().await;
}
