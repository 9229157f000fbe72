//! Trace context across the broker: a job written with the request's W3C `traceparent` in its
//! outbox payload shows up, in the spans a worker exports over OTLP, as one trace
//! request → relay publish → consumer → claim and steps. The collector here is a real OTLP/HTTP
//! endpoint that decodes what the worker sends.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use axum::Router;
use kfs_worker::jobs::probe::{self, ProbeSpec};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message;

use crate::support::{self, TestEnv};

#[derive(Clone, Debug)]
struct Exported {
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
}

type Spans = Arc<Mutex<Vec<Exported>>>;

async fn receive(State(spans): State<Spans>, body: Bytes) -> &'static str {
    let req = ExportTraceServiceRequest::decode(body).expect("an OTLP/protobuf trace export");
    let mut out = spans.lock().unwrap();
    for rs in req.resource_spans {
        for ss in rs.scope_spans {
            for s in ss.spans {
                out.push(Exported {
                    name: s.name,
                    trace_id: hex::encode(s.trace_id),
                    span_id: hex::encode(s.span_id),
                    parent: hex::encode(s.parent_span_id),
                });
            }
        }
    }
    ""
}

/// An OTLP/HTTP collector on a free port; returns its base URL and what it received.
async fn collector() -> (String, Spans) {
    let spans: Spans = Arc::default();
    let app = Router::new()
        .route("/v1/traces", post(receive))
        .with_state(spans.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), spans)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_requests_traceparent_reaches_the_consumer_through_the_relay() {
    let env = TestEnv::new().await;
    let (endpoint, spans) = collector().await;

    // The platform's API writes the job and its outbox row with its own trace context.
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let api_span = "00f067aa0ba902b7";
    let traceparent = format!("00-{trace_id}-{api_span}-01");
    let mut tx = env.pool.begin().await.unwrap();
    let job = probe::enqueue(
        &mut tx,
        &ProbeSpec {
            steps: 2,
            ..ProbeSpec::default()
        },
    )
    .await
    .unwrap();
    sqlx::query(
        "UPDATE kfs_probe_outbox SET payload = payload || jsonb_build_object('traceparent', $2::text) \
         WHERE probe_job_id = $1",
    )
    .bind(job)
    .bind(&traceparent)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();

    let mut worker = env.spawn_worker(
        "traced",
        &["run", "--kinds", "probe", "--worker-id", "traced"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ("OTEL_SERVICE_NAME", "kfs-worker-test"),
        ],
    );
    let pool = env.pool.clone();
    let done = env
        .wait_until(Duration::from_secs(30), || {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, String>(
                    "SELECT run_state::text FROM kfs_probe_jobs WHERE id = $1",
                )
                .bind(job)
                .fetch_one(&pool)
                .await
                .unwrap()
                    == "succeeded"
            }
        })
        .await;
    assert!(done, "job did not finish:\n{}", worker.log_text());

    // The steps' spans are exported in the next batch after the job ends.
    let ours = |spans: &Spans| -> Vec<Exported> {
        spans
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.trace_id == trace_id)
            .cloned()
            .collect()
    };
    let complete = env
        .wait_until(Duration::from_secs(20), || {
            // A parent ends after its children, so it may come in a later batch.
            let t = ours(&spans);
            let ready = t.iter().filter(|s| s.name == "step").count() >= 2
                && t.iter().any(|s| s.name.ends_with("process"))
                && t.iter().any(|s| s.name.ends_with("publish"));
            async move { ready }
        })
        .await;
    let trace = ours(&spans);
    assert!(
        complete,
        "spans of the trace: {trace:#?}\nworker log:\n{}",
        worker.log_text()
    );

    let child_of =
        |parent: &str| -> Vec<&Exported> { trace.iter().filter(|s| s.parent == parent).collect() };
    let publish = child_of(api_span);
    assert_eq!(
        publish.len(),
        1,
        "one publish under the request: {trace:#?}"
    );
    assert!(publish[0].name.ends_with("publish"), "{:?}", publish[0]);
    let consume = child_of(&publish[0].span_id);
    assert_eq!(
        consume.len(),
        1,
        "one consume under the publish: {trace:#?}"
    );
    assert!(consume[0].name.ends_with("process"), "{:?}", consume[0]);
    let under_consume: Vec<&str> = child_of(&consume[0].span_id)
        .iter()
        .map(|s| s.name.as_str())
        .collect();
    assert!(under_consume.contains(&"claim"), "{under_consume:?}");
    assert_eq!(
        under_consume.iter().filter(|n| **n == "step").count(),
        2,
        "{under_consume:?}"
    );
    assert!(under_consume.contains(&"end_slice"), "{under_consume:?}");

    support::stop_cleanly([&mut worker], Duration::from_secs(30)).await;
    env.cleanup().await;
}
