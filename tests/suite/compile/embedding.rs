//! Dense projections under an embedding profile: one per node in the profile's vector space, the
//! HTTP embedder's requests and stored vectors, and a clear code for a wrong dimension or no
//! embedder.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_an_embedding_profile_every_node_has_a_dense_projection_of_its_vector_space() {
    let fx = Fx::new().await;
    let profile = {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::activate_embedding_profile(
            &mut conn,
            TENANT,
            fx.space,
            "text-embedding-3-small",
            "openai",
            48,
        )
        .await
        .unwrap()
    };
    let doc = fx.add("guide.md", "text/markdown", GUIDE_MD).await;
    let done = fx.compile(doc).await;
    let g = done.publication_generation_id;
    let nodes = fx.rows_of_generation("knowledge_nodes", g).await;
    let (dense, dims, models, ready): (i64, Vec<i32>, Vec<String>, i64) = sqlx::query_as(
        "SELECT count(*), array_agg(DISTINCT vector_dims(dense_vector)), array_agg(DISTINCT model::text), \
           count(*) FILTER (WHERE status = 'ready') \
         FROM index_projections WHERE publication_generation_id = $1 AND type = 'dense-vector'",
    )
    .bind(g)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(dense, nodes, "one dense projection per node");
    assert_eq!(dims, [48], "the profile's dimension");
    assert_eq!(models, std::slice::from_ref(&profile.vector_space_id));
    assert_eq!(ready, nodes);
    let meta: serde_json::Value = sqlx::query_scalar(
        "SELECT metadata FROM index_projections WHERE publication_generation_id = $1 AND type = 'dense-vector' LIMIT 1",
    )
    .bind(g)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(meta["vectorSpaceId"], profile.vector_space_id.as_str());
    assert_eq!(meta["dimension"], 48);
    assert_eq!(meta["embeddingProfile"]["revision"], 1);
    // The platform's dense read path finds the node of the query's words first.
    let query = kfs_worker::embed::Offline::vector("static heaviness weigh-off", 48);
    let head = fx.head().await.unwrap();
    let best: (Uuid, String, f64) = sqlx::query_as(&format!(
        "SELECT x.node_id, x.text, x.score FROM ({}) x LIMIT 1",
        kfs_worker::publication::DENSE_READ_SQL
    ))
    .bind(fx.space)
    .bind(serde_json::to_string(&query).unwrap())
    .bind(TENANT)
    .bind(head.publication_id)
    .bind(48)
    .bind(&profile.vector_space_id)
    .bind(serde_json::json!([]))
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert!(best.1.contains("static heaviness"), "{best:?}");
    fx.cleanup().await;
}

/// An OpenAI-compatible `/embeddings` stand-in on 127.0.0.1: answers the n-th request with the
/// n-th status (the last from then on), `dimension`-wide vectors made from each input's length,
/// and records each request's authorization and body.
async fn embedding_stand_in(
    statuses: Vec<u16>,
    dimension: usize,
) -> (
    String,
    std::sync::Arc<std::sync::Mutex<Vec<(Option<String>, serde_json::Value)>>>,
) {
    use axum::http::{HeaderMap, StatusCode};
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    let app = axum::Router::new().route(
        "/v1/embeddings",
        axum::routing::post(move |headers: HeaderMap, body: String| {
            let seen = seen2.clone();
            let statuses = statuses.clone();
            async move {
                let body: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                let auth = headers
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                let n = {
                    let mut seen = seen.lock().unwrap();
                    seen.push((auth, body.clone()));
                    seen.len()
                };
                let status = statuses[(n - 1).min(statuses.len() - 1)];
                let inputs = body["input"].as_array().cloned().unwrap_or_default();
                // Reversed on purpose: the adapter must order by `index`.
                let data: Vec<serde_json::Value> = inputs
                    .iter()
                    .enumerate()
                    .rev()
                    .map(|(i, t)| {
                        let len = t.as_str().unwrap_or("").len() as f32;
                        let v: Vec<f32> = (0..dimension).map(|d| len + d as f32).collect();
                        serde_json::json!({"object": "embedding", "index": i, "embedding": v})
                    })
                    .collect();
                (
                    StatusCode::from_u16(status).unwrap(),
                    serde_json::json!({"object": "list", "data": data, "model": body["model"]})
                        .to_string(),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}/v1"), seen)
}

fn http_engine(fx: &Fx, base: &str, key: &str) -> kfs_worker::consumer::Engine {
    use kfs_worker::embed::{OpenAiCompatible, OpenAiConfig};
    let embedder = OpenAiCompatible::new(OpenAiConfig {
        base_url: url::Url::parse(base).unwrap(),
        api_key: Some(kfs_worker::jobs::research::generator::ApiKey::new(key)),
        model: None,
        timeout: Duration::from_secs(10),
        batch: 2,
    })
    .unwrap();
    let handler = CompileHandler::new(Deps {
        store: fx.store.clone(),
        embedder: std::sync::Arc::new(embedder),
        parsers: std::sync::Arc::new(kfs_worker::jobs::compile::parse::route::Parsers::local()),
        models: kfs_worker::model::Models::none(),
    })
    .unwrap();
    kfs_worker::consumer::Engine::new(
        fx.pool().clone(),
        "w-http-embedder",
        vec![std::sync::Arc::new(handler)],
        kfs_worker::consumer::ConsumerConfig::default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_http_embedder_sends_the_profiles_model_and_stores_its_vectors() {
    const KEY: &str = "sk-embedding-secret-42";
    let fx = Fx::new().await;
    {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::activate_embedding_profile(
            &mut conn,
            TENANT,
            fx.space,
            "embed-small",
            "openai",
            4,
        )
        .await
        .unwrap();
    }
    let doc = fx.add("guide.md", "text/markdown", GUIDE_MD).await;
    let (base, seen) = embedding_stand_in(vec![503, 200], 4).await;
    let engine = http_engine(&fx, &base, KEY);
    let attempt = fx.request(doc, false).await.unwrap();
    // The service is down at first: a retryable failure, then the next slice embeds.
    let mut retried = false;
    for _ in 0..20 {
        let s = fx.status(attempt).await;
        if s.is_terminal() {
            break;
        }
        if s.run_state == "retry_wait" {
            assert_eq!(s.last_error_code.as_deref(), Some("embedder_unavailable"));
            assert!(!s.last_error_message.unwrap_or_default().contains(KEY));
            retried = true;
            sqlx::query("UPDATE document_compilation_attempts SET retry_at = now() WHERE id = $1")
                .bind(attempt)
                .execute(fx.pool())
                .await
                .unwrap();
        }
        fx.slice(&engine, attempt).await;
    }
    assert!(retried, "the 503 was retried");
    let done = fx.status(attempt).await;
    assert_succeeded(&done);
    let requests = seen.lock().unwrap().clone();
    let nodes = fx
        .rows_of_generation("knowledge_nodes", done.publication_generation_id)
        .await;
    assert!(requests.len() >= 2);
    for (auth, body) in &requests {
        assert_eq!(auth.as_deref(), Some(format!("Bearer {KEY}").as_str()));
        assert_eq!(body["model"], "embed-small", "the profile's model");
        assert!(body["input"].as_array().unwrap().len() <= 2, "batches of 2");
    }
    // Every node's dense vector is the one the service returned for its text, in order.
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT p.dense_vector::text, p.metadata ->> 'embeddingProvider' FROM index_projections p \
         WHERE p.publication_generation_id = $1 AND p.type = 'dense-vector'",
    )
    .bind(done.publication_generation_id)
    .fetch_all(fx.pool())
    .await
    .unwrap();
    assert_eq!(rows.len() as i64, nodes);
    let sent: Vec<String> = requests
        .iter()
        .skip(1)
        .flat_map(|(_, b)| {
            b["input"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    for (v, provider) in &rows {
        assert_eq!(provider, "openai-compatible");
        let first: f32 = v
            .trim_start_matches('[')
            .split(',')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            sent.iter().any(|t| t.len() as f32 == first),
            "{v} matches no input"
        );
    }
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_embedder_answering_the_wrong_dimension_fails_the_attempt_with_a_clear_code() {
    let fx = Fx::new().await;
    {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::activate_embedding_profile(
            &mut conn,
            TENANT,
            fx.space,
            "embed-small",
            "openai",
            8,
        )
        .await
        .unwrap();
    }
    let doc = fx
        .add("n.md", "text/markdown", b"# N\n\nNautilus shells.")
        .await;
    let (base, _) = embedding_stand_in(vec![200], 3).await;
    let engine = http_engine(&fx, &base, "sk-other-secret");
    let attempt = fx.request(doc, false).await.unwrap();
    let s = fx.drive(&engine, attempt).await;
    assert_failed(&s, "embedder_rejected");
    let msg = s.last_error_message.unwrap_or_default();
    assert!(
        msg.contains("dimension 3") && msg.contains("has 8"),
        "{msg}"
    );
    assert!(!msg.contains("sk-other-secret"));
    assert!(fx.head().await.is_none());
    // Without any embedder configured, a space with a profile is refused the same way.
    let unconfigured = CompileHandler::new(Deps {
        store: fx.store.clone(),
        embedder: std::sync::Arc::new(kfs_worker::embed::Unconfigured),
        parsers: std::sync::Arc::new(kfs_worker::jobs::compile::parse::route::Parsers::local()),
        models: kfs_worker::model::Models::none(),
    })
    .unwrap();
    let engine = kfs_worker::consumer::Engine::new(
        fx.pool().clone(),
        "w-none",
        vec![std::sync::Arc::new(unconfigured)],
        kfs_worker::consumer::ConsumerConfig::default(),
    );
    let doc = fx.add("m.md", "text/markdown", b"# M\n\nMarlins.").await;
    let attempt = fx.request(doc, false).await.unwrap();
    let s = fx.drive(&engine, attempt).await;
    assert_failed(&s, "embedder_rejected");
    assert!(s
        .last_error_message
        .unwrap_or_default()
        .contains("KFS_EMBEDDER"));
    fx.cleanup().await;
}
