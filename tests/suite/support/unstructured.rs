//! A local stand-in of the platform's remote parser service (Unstructured-compatible
//! `POST /general/v0/general`) for the tests of the remote parser adapter. Invariant: every
//! request is recorded (its file, its form fields, whether it carried an `Authorization`
//! header) before it is answered; the answer is the first that applies of: 401 for a missing
//! or wrong key, a scripted fault status, and then (after any scripted delay) the caller's
//! parser function's JSON or error status.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Multipart, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use kfs_worker::jobs::compile::parse::raw::RawElement;
use serde_json::Value;

/// What the service does with a file: `(bytes, filename)` to the elements (a JSON value,
/// normally an array) or to an error status and body.
pub type ParseFn = Arc<dyn Fn(&[u8], &str) -> Result<Value, (u16, String)> + Send + Sync>;

/// One request as the stand-in received it.
#[derive(Clone, Debug, Default)]
pub struct Recorded {
    /// The `files` part.
    pub filename: Option<String>,
    pub content_type: Option<String>,
    pub bytes: Vec<u8>,
    pub strategy: Option<String>,
    /// Every `languages` field, in order.
    pub languages: Vec<String>,
    /// Every `extract_image_block_types` field, in order.
    pub extract_image_block_types: Vec<String>,
    pub extract_image_block_to_payload: Option<String>,
    pub coordinates: Option<String>,
    /// Whether an `Authorization` header came at all.
    pub authorization: bool,
    /// Whether it was `Bearer <the configured key>`.
    pub authorized: bool,
    /// Any other form field, in order.
    pub other_fields: Vec<(String, String)>,
}

#[derive(Default)]
struct Faults {
    /// The statuses of the next requests, one each.
    fail: VecDeque<u16>,
    delay: Duration,
}

struct Shared {
    key: Option<String>,
    parse: ParseFn,
    faults: Mutex<Faults>,
    seen: Mutex<Vec<Recorded>>,
}

/// A running stand-in; it stops when dropped.
pub struct StandIn {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

/// Starts a stand-in on an ephemeral port of 127.0.0.1 that requires `Bearer <key>` when `key`
/// is given and answers with `parse`.
pub async fn start(key: Option<&str>, parse: ParseFn) -> StandIn {
    let shared = Arc::new(Shared {
        key: key.map(str::to_owned),
        parse,
        faults: Mutex::new(Faults::default()),
        seen: Mutex::new(Vec::new()),
    });
    let app = axum::Router::new()
        .route("/general/v0/general", axum::routing::post(partition))
        .layer(DefaultBodyLimit::disable())
        .with_state(shared.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the parser stand-in");
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    StandIn { addr, shared, task }
}

impl StandIn {
    /// The service's base URL (the adapter appends `/general/v0/general`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Answers the next `n` requests with `status` (after recording them).
    pub fn fail_next(&self, n: usize, status: u16) {
        let mut faults = self.shared.faults.lock().unwrap();
        faults.fail.extend(std::iter::repeat_n(status, n));
    }

    /// Answers every later request only after `delay`.
    pub fn delay(&self, delay: Duration) {
        self.shared.faults.lock().unwrap().delay = delay;
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.seen.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.shared.seen.lock().unwrap().len()
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Raw elements as the service's JSON answer (`element_id` at the top level).
pub fn unstructured_json(elements: &[RawElement]) -> Value {
    Value::Array(
        elements
            .iter()
            .map(|e| {
                let mut v = serde_json::to_value(e).expect("a raw element serialises");
                let id = v["metadata"]
                    .as_object_mut()
                    .and_then(|m| m.remove("element_id"));
                if let Some(id) = id {
                    v["element_id"] = id;
                }
                v
            })
            .collect(),
    )
}

fn answer(status: u16, body: String) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, [("content-type", "application/json")], body).into_response()
}

async fn partition(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    mut multipart: Multipart,
) -> Response {
    let auth = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut seen = Recorded {
        authorization: auth.is_some(),
        authorized: match &shared.key {
            Some(key) => auth.as_deref() == Some(format!("Bearer {key}").as_str()),
            None => true,
        },
        ..Recorded::default()
    };
    let mut malformed = None;
    loop {
        let field = match multipart.next_field().await {
            Ok(Some(field)) => field,
            Ok(None) => break,
            Err(e) => {
                malformed = Some(e.to_string());
                break;
            }
        };
        let name = field.name().unwrap_or_default().to_owned();
        if name == "files" {
            seen.filename = field.file_name().map(str::to_owned);
            seen.content_type = field.content_type().map(str::to_owned);
            match field.bytes().await {
                Ok(bytes) => seen.bytes = bytes.to_vec(),
                Err(e) => malformed = Some(e.to_string()),
            }
            continue;
        }
        let value = match field.text().await {
            Ok(value) => value,
            Err(e) => {
                malformed = Some(e.to_string());
                break;
            }
        };
        match name.as_str() {
            "strategy" => seen.strategy = Some(value),
            "languages" => seen.languages.push(value),
            "extract_image_block_types" => seen.extract_image_block_types.push(value),
            "extract_image_block_to_payload" => seen.extract_image_block_to_payload = Some(value),
            "coordinates" => seen.coordinates = Some(value),
            _ => seen.other_fields.push((name, value)),
        }
    }
    let authorized = seen.authorized;
    let file = seen.filename.clone().map(|name| (name, seen.bytes.clone()));
    shared.seen.lock().unwrap().push(seen);

    if !authorized {
        return answer(401, r#"{"detail":"Invalid API key"}"#.into());
    }
    if let Some(problem) = malformed {
        return answer(400, serde_json::json!({ "detail": problem }).to_string());
    }
    let (fault, delay) = {
        let mut faults = shared.faults.lock().unwrap();
        (faults.fail.pop_front(), faults.delay)
    };
    if let Some(status) = fault {
        return answer(status, r#"{"detail":"injected fault"}"#.into());
    }
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let Some((filename, bytes)) = file else {
        return answer(400, r#"{"detail":"no files part"}"#.into());
    };
    match (shared.parse)(&bytes, &filename) {
        Ok(elements) => answer(200, elements.to_string()),
        Err((status, body)) => answer(status, body),
    }
}
