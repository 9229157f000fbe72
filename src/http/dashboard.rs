//! The operator dashboard at `/`: live counts and rates per kind, relay lag, recent failures,
//! dead letters, and one page per job. Invariant: every page is built from the kinds'
//! [`KindSpec`]s and [`crate::status::read`], so a new kind shows up without changes here; the
//! only writes are the actions, each allowed only with the admin token (compared in constant
//! time) and each done by the same library function the CLI calls.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Form, Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use super::AppState;
use crate::dlq::DeadLetter;
use crate::jobs::{Clock, Kind, KindSpec, States};
use crate::status::KindStatus;

const CSS: &str = include_str!("dashboard.css");
const JS: &str = include_str!("dashboard.js");

/// Rates are averaged over this window.
const RATE_WINDOW_MINUTES: i64 = 5;
/// Dead letters shown on the overview.
const DLQ_PEEK: usize = 20;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/", get(overview_page))
        .route("/api/overview", get(overview_json))
        .route("/jobs/{kind}/{id}", get(job_page))
        .route("/api/jobs/{kind}/{id}", get(job_json))
        .route("/actions/jobs/{kind}/{id}/{action}", post(job_action))
        .route("/actions/dlq/requeue", post(dlq_requeue))
        .route(
            "/assets/dashboard.css",
            get(|| async { ([("content-type", "text/css; charset=utf-8")], CSS) }),
        )
        .route(
            "/assets/dashboard.js",
            get(|| async { ([("content-type", "text/javascript; charset=utf-8")], JS) }),
        )
}

// ---------------------------------------------------------------------------------------------
// What the pages show

/// One kind's numbers, with rates.
#[derive(Clone, Debug, Serialize)]
pub struct KindOverview {
    #[serde(flatten)]
    pub status: KindStatus,
    /// Jobs that ended successfully per minute, averaged over the rate window.
    pub completed_per_minute: f64,
    /// Jobs that ended failed per minute, averaged over the rate window.
    pub failed_per_minute: f64,
    pub rate_window_minutes: i64,
    /// The actions this kind's jobs take.
    pub actions: Vec<&'static str>,
}

/// One job, as a list row.
#[derive(Clone, Debug, Serialize)]
pub struct JobRow {
    pub kind: String,
    pub id: Uuid,
    pub state: String,
    pub checkpoint: String,
    pub attempts: i32,
    pub max_attempts: i32,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    /// Seconds since the epoch.
    pub updated_at: f64,
    /// Actions that apply to the job in its current state.
    pub actions: Vec<&'static str>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Overview {
    /// Seconds since the epoch, by the database clock.
    pub generated_at: f64,
    pub actions_enabled: bool,
    pub kinds: Vec<KindOverview>,
    pub failures: Vec<JobRow>,
    pub recent: Vec<JobRow>,
    /// Messages in the dead-letter queue (None: RabbitMQ not reachable).
    pub dead_letters: Option<u32>,
    pub dead_letter_sample: Vec<DeadLetter>,
    /// The kinds leased straight from Postgres (bootstraps, profile backfills).
    pub leased: Vec<crate::status::LeasedStatus>,
}

/// The actions a kind's jobs take.
pub fn kind_actions(kind: Kind) -> Vec<&'static str> {
    match kind {
        Kind::Compile | Kind::Deletion => vec!["retry"],
        Kind::Research => vec!["pause", "resume", "cancel"],
        Kind::Probe => vec![],
    }
}

/// The actions that apply to a job of `kind` in `state`.
pub fn job_actions(kind: Kind, state: &str) -> Vec<&'static str> {
    match (kind, state) {
        (Kind::Compile | Kind::Deletion, "failed") => vec!["retry"],
        (Kind::Research, "paused") => vec!["resume", "cancel"],
        (Kind::Research, "completed" | "failed" | "canceled") => vec![],
        (Kind::Research, _) => vec!["pause", "cancel"],
        _ => vec![],
    }
}

/// The checkpoints a kind walks through, in order, for the progress strip of a job page.
pub fn checkpoint_order(kind: Kind) -> &'static [&'static str] {
    match kind {
        Kind::Compile => &[
            "queued",
            "parsed",
            "outline_built",
            "nodes_generated",
            "projection_built",
            "smoke_eval_passed",
            "published",
        ],
        Kind::Deletion => &[
            "requested",
            "quiescing",
            "deleting_objects",
            "deleting_derived_data",
            "deleting_primary_data",
            "completed",
        ],
        Kind::Research => &[
            "queued",
            "planning",
            "retrieving",
            "analyzing",
            "generating",
            "completed",
        ],
        Kind::Probe => &[],
    }
}

/// Display order of states: live ones first, then the ends.
fn state_rank(state: &str) -> usize {
    const ORDER: [&str; 16] = [
        "dispatch_pending",
        "queued",
        "planning",
        "retrieving",
        "analyzing",
        "generating",
        "running",
        "retry_wait",
        "paused",
        "succeeded",
        "completed",
        "failed",
        "canceled",
        "superseded",
        "pending",
        "dead",
    ];
    ORDER
        .iter()
        .position(|s| *s == state)
        .unwrap_or(ORDER.len())
}

fn state_column(spec: &KindSpec) -> &'static str {
    match spec.states {
        States::RunState { .. } => "run_state",
        States::Stage => "stage",
    }
}

fn success_state(spec: &KindSpec) -> &'static str {
    match spec.states {
        States::RunState { .. } => "succeeded",
        States::Stage => "completed",
    }
}

/// Epoch seconds of a time column of this kind's tables.
fn epoch(spec: &KindSpec, col: &str) -> String {
    match spec.clock {
        Clock::Timestamptz => format!("extract(epoch from {col})::float8"),
        Clock::EpochMillis => format!("({col})::float8 / 1000.0"),
    }
}

async fn rates(conn: &mut sqlx::PgConnection, kind: Kind) -> Result<(f64, f64), sqlx::Error> {
    let spec = kind.spec();
    let state = state_column(spec);
    let (ok, failed): (i64, i64) = sqlx::query_as(&spec.sql(&format!(
        "SELECT count(*) FILTER (WHERE {state} = $1), count(*) FILTER (WHERE {state} = 'failed') \
         FROM {{job}} WHERE completed_at >= {{now+$2}}"
    )))
    .bind(success_state(spec))
    .bind(-RATE_WINDOW_MINUTES * 60_000)
    .fetch_one(conn)
    .await?;
    let per = RATE_WINDOW_MINUTES as f64;
    Ok((ok as f64 / per, failed as f64 / per))
}

/// Rows of `kind`'s jobs matching `filter` (a constant SQL condition on `{state}`), newest first.
async fn job_rows(
    conn: &mut sqlx::PgConnection,
    kind: Kind,
    filter: &str,
    limit: i64,
) -> Result<Vec<JobRow>, sqlx::Error> {
    let spec = kind.spec();
    let state = state_column(spec);
    let filter = filter.replace("{state}", state);
    let rows: Vec<(Uuid, String, String, i32, i32, Value, f64)> = sqlx::query_as(&spec.sql(&format!(
        "SELECT j.id, j.{state}::text, j.{{cp}}::text, j.execution_attempts, j.max_execution_attempts, \
           jsonb_build_object('code', to_jsonb(j)->'last_error_code', 'message', to_jsonb(j)->'last_error_message', \
             'error', to_jsonb(j)->'error'), {} \
         FROM {{job}} j WHERE {filter} ORDER BY j.updated_at DESC LIMIT $1",
        epoch(spec, "j.updated_at")
    )))
    .bind(limit)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, st, cp, attempts, max, err, updated)| {
            let (code, message) = error_of(&err);
            JobRow {
                kind: kind.name().to_owned(),
                actions: job_actions(kind, &st),
                id,
                state: st,
                checkpoint: cp,
                attempts,
                max_attempts: max,
                error_code: code,
                error_message: message,
                updated_at: updated,
            }
        })
        .collect())
}

/// A job's error code and message: `last_error_code`/`last_error_message` columns, or one
/// `error` column written as `code: message`.
fn error_of(v: &Value) -> (Option<String>, Option<String>) {
    let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    match (s("code"), s("message"), s("error")) {
        (None, None, Some(e)) => match e.split_once(": ") {
            Some((c, m)) if !c.contains(' ') => (Some(c.to_owned()), Some(m.to_owned())),
            _ => (None, Some(e)),
        },
        (c, m, _) => (c, m),
    }
}

/// Reads everything the overview shows. Dead letters need RabbitMQ; without it they are `None`.
pub async fn overview(st: &AppState) -> Result<Overview, sqlx::Error> {
    let mut status = crate::status::read(&st.pool, &st.kinds).await?;
    let amqp = tokio::time::timeout(
        Duration::from_secs(2),
        lapin::Connection::connect(
            st.services.amqp_url.expose(),
            lapin::ConnectionProperties::default(),
        ),
    )
    .await;
    let mut sample = Vec::new();
    if let Ok(Ok(conn)) = amqp {
        crate::status::add_queue_depths(&mut status, &conn, &st.topology, &st.kinds).await;
        if status.dead_letters.unwrap_or(0) > 0 {
            if let Ok(Ok(letters)) = tokio::time::timeout(
                Duration::from_secs(2),
                crate::dlq::list(&conn, &st.topology, DLQ_PEEK),
            )
            .await
            {
                sample = letters;
            }
        }
        let _ = conn.close(200, "dashboard".into()).await;
    }
    let leased = std::mem::take(&mut status.leased);
    let mut conn = crate::db::acquire(&st.pool).await?;
    let mut kinds = Vec::new();
    let mut failures = Vec::new();
    let mut recent = Vec::new();
    for (ks, &kind) in status.kinds.into_iter().zip(&st.kinds) {
        let (completed, failed) = rates(&mut conn, kind).await?;
        kinds.push(KindOverview {
            status: ks,
            completed_per_minute: completed,
            failed_per_minute: failed,
            rate_window_minutes: RATE_WINDOW_MINUTES,
            actions: kind_actions(kind),
        });
        failures
            .extend(job_rows(&mut conn, kind, "j.{state} IN ('failed', 'retry_wait')", 20).await?);
        recent.extend(job_rows(&mut conn, kind, "true", 20).await?);
    }
    let newest_first = |a: &JobRow, b: &JobRow| b.updated_at.total_cmp(&a.updated_at);
    failures.sort_by(newest_first);
    failures.truncate(20);
    recent.sort_by(newest_first);
    recent.truncate(20);
    let generated_at: f64 = sqlx::query_scalar("SELECT extract(epoch from now())::float8")
        .fetch_one(&mut *conn)
        .await?;
    Ok(Overview {
        generated_at,
        actions_enabled: st.admin_token.is_some(),
        kinds,
        failures,
        recent,
        dead_letters: status.dead_letters,
        dead_letter_sample: sample,
        leased,
    })
}

/// One job with everything recorded about it.
#[derive(Clone, Debug, Serialize)]
pub struct JobDetail {
    pub kind: String,
    pub id: Uuid,
    pub state: String,
    pub checkpoint: String,
    /// The checkpoints of the kind in order (empty when the kind has no fixed order).
    pub checkpoints: Vec<&'static str>,
    pub actions: Vec<&'static str>,
    /// Every action the kind takes, in any state.
    pub kind_actions: Vec<&'static str>,
    pub actions_enabled: bool,
    /// The job row, column by column.
    pub job: Value,
    /// Its outbox rows: one per delivery revision, with dispatch attempts and errors.
    pub deliveries: Vec<Value>,
    /// Kind-specific history (progress events, other attempts, items, retries, effects).
    pub history: Vec<Section>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Section {
    pub title: &'static str,
    pub rows: Vec<Value>,
}

/// Kind-specific history queries: each takes the job id as `$1`.
fn history_queries(kind: Kind) -> Vec<(&'static str, &'static str)> {
    match kind {
        Kind::Compile => vec![(
            "Attempts of this document",
            "SELECT a.id, a.document_version, a.checkpoint, a.run_state, a.execution_attempts, \
               a.last_error_code, a.created_at, a.completed_at \
             FROM document_compilation_attempts a \
             JOIN document_compilation_attempts me ON me.id = $1 \
               AND a.tenant_id = me.tenant_id AND a.document_asset_id = me.document_asset_id \
             ORDER BY a.created_at",
        )],
        Kind::Deletion => vec![
            (
                "Items by status",
                "SELECT kind, status, count(*) AS items, sum(attempts) AS attempts, \
                   max(last_error_code) AS last_error_code \
                 FROM deletion_job_items WHERE deletion_job_id = $1 GROUP BY 1, 2 ORDER BY 1, 2",
            ),
            (
                "Manual retries",
                "SELECT created_at, retry_authority, actor_subject_id, access_channel, request_idempotency_key \
                 FROM deletion_retry_audits WHERE deletion_job_id = $1 ORDER BY created_at",
            ),
        ],
        Kind::Research => vec![
            (
                "Progress events",
                "SELECT sequence, event_type, stage, payload, created_at \
                 FROM research_task_progress_events WHERE research_task_job_id = $1 ORDER BY sequence",
            ),
            (
                "Partial results",
                "SELECT sequence, created_at, pg_column_size(evidence_bundle) AS bytes \
                 FROM research_task_partial_results WHERE research_task_job_id = $1 ORDER BY sequence",
            ),
        ],
        Kind::Probe => vec![(
            "Step effects",
            "SELECT step, worker_id, created_at FROM kfs_probe_effects WHERE job_id = $1 ORDER BY step, id",
        )],
    }
}

/// Reads one job; `None` when there is no such job of that kind.
pub async fn job_detail(
    st: &AppState,
    kind: Kind,
    id: Uuid,
) -> Result<Option<JobDetail>, sqlx::Error> {
    let spec = kind.spec();
    let mut conn = crate::db::acquire(&st.pool).await?;
    let Some(job): Option<Value> =
        sqlx::query_scalar(&spec.sql("SELECT to_jsonb(j) FROM {job} j WHERE j.id = $1"))
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?
    else {
        return Ok(None);
    };
    let deliveries: Value = sqlx::query_scalar(&spec.sql(
        "SELECT coalesce(jsonb_agg(to_jsonb(o) - 'payload' - 'lock_token' ORDER BY o.created_at, o.id), '[]'::jsonb) \
         FROM {outbox} o WHERE o.{fk} = $1",
    ))
    .bind(id)
    .fetch_one(&mut *conn)
    .await?;
    let mut history = Vec::new();
    for (title, q) in history_queries(kind) {
        let rows: Value = sqlx::query_scalar(&format!(
            "SELECT coalesce(jsonb_agg(to_jsonb(x)), '[]'::jsonb) FROM ({q}) x"
        ))
        .bind(id)
        .fetch_one(&mut *conn)
        .await?;
        history.push(Section {
            title,
            rows: rows.as_array().cloned().unwrap_or_default(),
        });
    }
    let text = |k: &str| {
        job.get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let state = text(state_column(spec));
    Ok(Some(JobDetail {
        kind: kind.name().to_owned(),
        id,
        checkpoint: text(spec.checkpoint_column()),
        checkpoints: checkpoint_order(kind).to_vec(),
        actions: job_actions(kind, &state),
        kind_actions: kind_actions(kind),
        actions_enabled: st.admin_token.is_some(),
        state,
        job,
        deliveries: deliveries.as_array().cloned().unwrap_or_default(),
        history,
    }))
}

// ---------------------------------------------------------------------------------------------
// Handlers

fn db_error(e: sqlx::Error) -> Response {
    tracing::warn!(error = %e, "dashboard: database read failed");
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Html(page(
            "Unavailable",
            &format!(
                "<div class=\"notice bad\">Postgres did not answer: {}</div>",
                esc(&e.to_string())
            ),
        )),
    )
        .into_response()
}

async fn overview_json(State(st): State<AppState>) -> Response {
    match overview(&st).await {
        Ok(o) => {
            let mut v = serde_json::to_value(&o).unwrap_or_default();
            v["html"] = serde_json::json!({
                "kinds": render_kinds(&o),
                "failures": render_failures(&o),
                "recent": render_recent(&o),
                "dlq": render_dlq(&o),
            });
            Json(v).into_response()
        }
        Err(e) => db_error(e),
    }
}

async fn overview_page(State(st): State<AppState>) -> Response {
    match overview(&st).await {
        Ok(o) => Html(render_overview(&o)).into_response(),
        Err(e) => db_error(e),
    }
}

fn parse_kind(st: &AppState, raw: &str) -> Option<Kind> {
    let kind = *Kind::parse_list(raw).ok()?.first()?;
    st.kinds.contains(&kind).then_some(kind)
}

fn not_found(what: &str) -> Response {
    (
        StatusCode::NOT_FOUND,
        Html(page(
            "Not found",
            &format!(
                "<div class=\"notice bad\">{}</div><p><a href=\"/\">Back to the overview</a></p>",
                esc(what)
            ),
        )),
    )
        .into_response()
}

async fn job_json(
    State(st): State<AppState>,
    Path((kind, id)): Path<(String, String)>,
) -> Response {
    let (Some(kind), Ok(id)) = (parse_kind(&st, &kind), Uuid::parse_str(&id)) else {
        return not_found("no such kind or job id");
    };
    match job_detail(&st, kind, id).await {
        Ok(Some(d)) => {
            let mut v = serde_json::to_value(&d).unwrap_or_default();
            v["html"] = Value::String(render_job_live(&d));
            Json(v).into_response()
        }
        Ok(None) => not_found(&format!("no {kind} job {id}")),
        Err(e) => db_error(e),
    }
}

async fn job_page(
    State(st): State<AppState>,
    Path((kind, id)): Path<(String, String)>,
) -> Response {
    let Some(kind) = parse_kind(&st, &kind) else {
        return not_found(&format!("this worker serves no job kind '{kind}'"));
    };
    let Ok(id) = Uuid::parse_str(&id) else {
        return not_found(&format!("'{id}' is not a job id (a UUID)"));
    };
    match job_detail(&st, kind, id).await {
        Ok(Some(d)) => Html(render_job(&d)).into_response(),
        Ok(None) => not_found(&format!("no {kind} job {id}")),
        Err(e) => db_error(e),
    }
}

/// The fields an action form may carry.
#[derive(Debug, Default, Deserialize)]
pub struct ActionForm {
    pub token: Option<String>,
    /// Deletion retry: the acting subject, its permission snapshot, its channel, and whether
    /// it is an owner rescue.
    pub subject: Option<String>,
    pub snapshot: Option<String>,
    pub channel: Option<String>,
    pub owner_rescue: Option<String>,
    /// Research cancel: the reason recorded.
    pub reason: Option<String>,
    /// DLQ requeue: the message id.
    pub id: Option<String>,
}

/// The outcome of an action, as HTML for a browser and JSON for a client that asks for it.
struct Outcome {
    code: StatusCode,
    message: String,
    back: String,
}

impl Outcome {
    fn new(code: StatusCode, message: impl Into<String>, back: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            back: back.into(),
        }
    }

    fn respond(self, headers: &HeaderMap) -> Response {
        let wants_json = headers
            .get("accept")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|a| a.contains("application/json"));
        let ok = self.code.is_success();
        if wants_json {
            return (
                self.code,
                Json(serde_json::json!({ "ok": ok, "message": self.message })),
            )
                .into_response();
        }
        let body = format!(
            "<div class=\"notice {cls}\" id=\"outcome\" data-ok=\"{ok}\">{msg}</div>\
             <p><a class=\"button\" id=\"back\" href=\"{back}\">Back</a></p>",
            cls = if ok { "good" } else { "bad" },
            msg = esc(&self.message),
            back = esc(&self.back),
        );
        let title = if ok { "Done" } else { "Refused" };
        (self.code, Html(page(title, &body))).into_response()
    }
}

/// The token gate: `None` when the request may act, else the refusal.
fn refuse_without_token(
    st: &AppState,
    headers: &HeaderMap,
    form: &ActionForm,
    back: &str,
) -> Option<Outcome> {
    let Some(expected) = &st.admin_token else {
        return Some(Outcome::new(
            StatusCode::FORBIDDEN,
            "actions are disabled on this worker: it was started without KFS_ADMIN_TOKEN",
            back,
        ));
    };
    let bearer = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let given = bearer
        .or(form.token.as_deref())
        .map(str::trim)
        .filter(|t| !t.is_empty());
    match given {
        None => Some(Outcome::new(
            StatusCode::UNAUTHORIZED,
            "this action needs the admin token (KFS_ADMIN_TOKEN): enter it at the top of the page",
            back,
        )),
        Some(t) if !expected.matches(t) => Some(Outcome::new(
            StatusCode::FORBIDDEN,
            "the admin token is wrong; nothing was changed",
            back,
        )),
        Some(_) => None,
    }
}

fn field(v: &Option<String>) -> Option<&str> {
    v.as_deref().map(str::trim).filter(|s| !s.is_empty())
}

async fn job_action(
    State(st): State<AppState>,
    Path((kind, id, action)): Path<(String, String, String)>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Response {
    let back = format!("/jobs/{kind}/{id}");
    let back = if back
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "/-_".contains(c))
    {
        back
    } else {
        "/".to_owned()
    };
    if let Some(refusal) = refuse_without_token(&st, &headers, &form, &back) {
        return refusal.respond(&headers);
    }
    let Some(kind) = parse_kind(&st, &kind) else {
        return Outcome::new(
            StatusCode::NOT_FOUND,
            format!("this worker serves no job kind '{kind}'"),
            "/",
        )
        .respond(&headers);
    };
    let Ok(id) = Uuid::parse_str(&id) else {
        return Outcome::new(
            StatusCode::BAD_REQUEST,
            format!("'{id}' is not a job id (a UUID)"),
            "/",
        )
        .respond(&headers);
    };
    let outcome = act(&st, kind, id, &action, &form).await;
    let (code, message) = match outcome {
        Ok(m) => (StatusCode::OK, m),
        Err(e) => e,
    };
    if code.is_success() {
        tracing::info!(kind = %kind, job = %id, action = %action, "dashboard action done");
    }
    Outcome::new(code, message, back).respond(&headers)
}

type ActError = (StatusCode, String);

fn refused(e: impl std::fmt::Display) -> ActError {
    (StatusCode::CONFLICT, e.to_string())
}

fn failed(e: impl std::fmt::Display) -> ActError {
    (StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

/// Runs one action through the library function the CLI uses, in its own transaction.
async fn act(
    st: &AppState,
    kind: Kind,
    id: Uuid,
    action: &str,
    form: &ActionForm,
) -> Result<String, ActError> {
    use crate::jobs::{compile, deletion, research};
    if !kind_actions(kind).contains(&action) {
        let allowed = kind_actions(kind);
        return Err((
            StatusCode::BAD_REQUEST,
            if allowed.is_empty() {
                format!("{kind} jobs take no action")
            } else {
                format!(
                    "{kind} jobs take no action '{action}'; they take {}",
                    allowed.join(", ")
                )
            },
        ));
    }
    let mut tx = crate::db::begin(&st.pool).await.map_err(failed)?;
    let message = match (kind, action) {
        (Kind::Compile, "retry") => {
            compile::request::retry(&mut tx, id).await.map_err(|e| {
                if e.is_refusal() {
                    refused(e)
                } else {
                    failed(e)
                }
            })?;
            format!("compile attempt {id} is retrying from its checkpoint")
        }
        (Kind::Deletion, "retry") => {
            let job: Option<(String, Uuid, String)> = sqlx::query_as(
                "SELECT requested_by_subject_id, permission_snapshot_id, access_channel FROM deletion_jobs WHERE id = $1",
            )
            .bind(id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(failed)?;
            let Some((subject, snapshot, channel)) = job else {
                return Err((StatusCode::NOT_FOUND, format!("no deletion job {id}")));
            };
            let snapshot = match field(&form.snapshot) {
                None => snapshot,
                Some(s) => Uuid::parse_str(s).map_err(|_| {
                    (
                        StatusCode::BAD_REQUEST,
                        format!("permission snapshot id {s:?} is not a UUID"),
                    )
                })?,
            };
            let req = deletion::request::RetryRequest {
                job_id: id,
                actor_subject_id: field(&form.subject).unwrap_or(subject.as_str()).to_owned(),
                permission_snapshot_id: snapshot,
                access_channel: field(&form.channel).unwrap_or(channel.as_str()).to_owned(),
                authority: if field(&form.owner_rescue).is_some() {
                    deletion::request::RetryAuthority::InteractiveOwnerRescue
                } else {
                    deletion::request::RetryAuthority::OriginalRequester
                },
                idempotency_key: format!("dashboard:{}", Uuid::new_v4()),
            };
            let r = deletion::request::retry_deletion(&mut tx, &req)
                .await
                .map_err(|e| match e {
                    deletion::request::RequestError::Db(_) => failed(e),
                    other => refused(other),
                })?;
            format!(
                "deletion job {id} is retrying (delivery revision {})",
                r.delivery_revision
            )
        }
        (Kind::Research, "pause" | "resume" | "cancel") => {
            let r = match action {
                "pause" => research::control::pause(&mut tx, id).await,
                "resume" => research::control::resume(&mut tx, id).await,
                _ => research::control::cancel(&mut tx, id, field(&form.reason)).await,
            }
            .map_err(|e| {
                if matches!(e, research::control::ControlError::NotFound(_)) {
                    (StatusCode::NOT_FOUND, e.to_string())
                } else if e.is_refusal() {
                    refused(e)
                } else {
                    failed(e)
                }
            })?;
            if r.changed {
                format!(
                    "research task {id}: {action} done ({} → {})",
                    r.from.as_str(),
                    r.to.as_str()
                )
            } else {
                format!(
                    "research task {id} already was {}; nothing changed",
                    r.to.as_str()
                )
            }
        }
        _ => unreachable!("checked against kind_actions above"),
    };
    tx.commit().await.map_err(failed)?;
    Ok(message)
}

async fn dlq_requeue(
    State(st): State<AppState>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Response {
    if let Some(refusal) = refuse_without_token(&st, &headers, &form, "/#dead-letters") {
        return refusal.respond(&headers);
    }
    let Some(id) = field(&form.id) else {
        return Outcome::new(
            StatusCode::BAD_REQUEST,
            "requeue needs the message id",
            "/#dead-letters",
        )
        .respond(&headers);
    };
    let conn = match crate::broker::connect(
        &st.services.amqp_url,
        "kfs-worker dashboard",
        st.services.connect_timeout,
    )
    .await
    {
        Ok(c) => c,
        Err(e) => {
            return Outcome::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string(), "/")
                .respond(&headers)
        }
    };
    let result = crate::dlq::requeue(&conn, &st.topology, id).await;
    let _ = conn.close(200, "dashboard".into()).await;
    let outcome = match result {
        Ok(r) => {
            tracing::info!(id = %r.id, kind = %r.kind, "dashboard requeued a dead letter");
            Outcome::new(
                StatusCode::OK,
                format!(
                    "requeued {} to its {} queue (exchange {}, routing key {})",
                    r.id, r.kind, r.exchange, r.routing_key
                ),
                "/#dead-letters",
            )
        }
        Err(e @ crate::dlq::DlqError::NotFound(_)) => {
            Outcome::new(StatusCode::NOT_FOUND, e.to_string(), "/#dead-letters")
        }
        Err(e) if e.is_refusal() => {
            Outcome::new(StatusCode::CONFLICT, e.to_string(), "/#dead-letters")
        }
        Err(e) => Outcome::new(StatusCode::BAD_GATEWAY, e.to_string(), "/#dead-letters"),
    };
    outcome.respond(&headers)
}

// ---------------------------------------------------------------------------------------------
// HTML

/// Escapes text for HTML content and attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn page(title: &str, body: &str) -> String {
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{title} · kfs-worker</title>\
         <link rel=\"stylesheet\" href=\"/assets/dashboard.css\"></head><body>\
         <header><a class=\"brand\" href=\"/\">kfs-worker</a><nav>\
         <a href=\"/#kinds\">Kinds</a><a href=\"/#failures\">Failures</a>\
         <a href=\"/#recent\">Recent jobs</a><a href=\"/#dead-letters\">Dead letters</a></nav>\
         <label class=\"token\">admin token <input type=\"password\" id=\"admin-token\" \
         autocomplete=\"off\" placeholder=\"KFS_ADMIN_TOKEN\"></label></header>\
         <main>{body}</main><script src=\"/assets/dashboard.js\"></script></body></html>",
        title = esc(title),
    )
}

fn fmt_rate(r: f64) -> String {
    if r == 0.0 {
        "0".into()
    } else if r < 10.0 {
        format!("{r:.1}")
    } else {
        format!("{r:.0}")
    }
}

fn fmt_age(seconds: f64) -> String {
    let s = seconds.max(0.0);
    if s < 1.0 {
        format!("{:.0} ms", s * 1000.0)
    } else if s < 120.0 {
        format!("{s:.1} s")
    } else if s < 7200.0 {
        format!("{:.0} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

fn fmt_time(epoch_s: f64) -> String {
    chrono::DateTime::from_timestamp_millis((epoch_s * 1000.0) as i64)
        .map_or_else(String::new, |t| {
            t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
        })
}

fn state_badge(state: &str) -> String {
    let cls = match state {
        "succeeded" | "completed" => "ok",
        "failed" | "dead" => "bad",
        "retry_wait" | "paused" => "warn",
        "canceled" | "superseded" => "muted",
        _ => "live",
    };
    format!("<span class=\"badge {cls}\">{}</span>", esc(state))
}

fn sorted_states(m: &BTreeMap<String, i64>) -> Vec<(&String, &i64)> {
    let mut v: Vec<_> = m.iter().collect();
    v.sort_by_key(|(s, _)| (state_rank(s), (*s).clone()));
    v
}

/// One table row per job state, with its count and its share of all jobs as a bar.
fn state_rows(s: &mut String, jobs: &BTreeMap<String, i64>) {
    let total: i64 = jobs.values().sum();
    if jobs.is_empty() {
        s.push_str("<tr><td class=\"muted\" colspan=\"2\">no jobs yet</td></tr>");
    }
    for (state, n) in sorted_states(jobs) {
        let pct = if total > 0 { *n * 100 / total } else { 0 };
        let _ = write!(
            s,
            "<tr><td>{badge}</td><td class=\"num\" data-state=\"{st}\">{n}</td>\
             <td class=\"bar\"><span style=\"width:{pct}%\"></span></td></tr>",
            badge = state_badge(state),
            st = esc(state),
        );
    }
}

/// One pill per entry (`name count`), tagged with `attr` for the page's script; `empty` when none.
fn pills(s: &mut String, counts: &BTreeMap<String, i64>, attr: &str, empty: &str) {
    if counts.is_empty() {
        let _ = write!(s, "<span class=\"muted\">{empty}</span>");
    }
    for (name, n) in sorted_states(counts) {
        let _ = write!(
            s,
            "<span class=\"pill\" {attr}=\"{v}\">{v} {n}</span>",
            v = esc(name)
        );
    }
}

pub fn render_kinds(o: &Overview) -> String {
    let mut s = String::new();
    for k in &o.kinds {
        let ks = &k.status;
        let total: i64 = ks.jobs.values().sum();
        let _ = write!(
            s,
            "<section class=\"card kind\" data-kind=\"{kind}\"><h3>{kind} <small>{total} jobs</small></h3>\
             <div class=\"rates\"><div><b data-rate=\"completed\">{ok}</b><span>done / min</span></div>\
             <div><b data-rate=\"failed\" class=\"{failcls}\">{bad}</b><span>failed / min</span></div>\
             <div><b data-lag>{lag}</b><span>relay lag</span></div>\
             <div><b data-queued>{queued}</b><span>queued msgs</span></div></div>\
             <table class=\"states\"><tbody>",
            kind = esc(&ks.kind),
            ok = fmt_rate(k.completed_per_minute),
            bad = fmt_rate(k.failed_per_minute),
            failcls = if k.failed_per_minute > 0.0 { "bad" } else { "" },
            lag = ks.oldest_due_seconds.map_or("0 s".into(), fmt_age),
            queued = ks.queued_messages.map_or("?".into(), |n| n.to_string()),
        );
        state_rows(&mut s, &ks.jobs);
        s.push_str("</tbody></table><p class=\"outbox\">outbox ");
        pills(&mut s, &ks.outbox, "data-outbox", "empty");
        let _ = write!(
            s,
            "</p><p class=\"foot muted\">rates over the last {} min</p></section>",
            k.rate_window_minutes
        );
    }
    for l in &o.leased {
        let total: i64 = l.jobs.values().sum();
        let _ = write!(
            s,
            "<section class=\"card kind\" data-kind=\"{kind}\"><h3>{kind} <small>{total} jobs, leased from Postgres</small></h3>\
             <table class=\"states\"><tbody>",
            kind = esc(&l.kind),
        );
        state_rows(&mut s, &l.jobs);
        s.push_str("</tbody></table><p class=\"outbox\">at ");
        pills(&mut s, &l.checkpoints, "data-checkpoint", "no checkpoint");
        s.push_str("</p></section>");
    }
    s
}

fn job_link(r: &JobRow) -> String {
    format!(
        "<a class=\"mono\" href=\"/jobs/{kind}/{id}\" data-job=\"{id}\">{short}</a>",
        kind = esc(&r.kind),
        id = r.id,
        short = &r.id.to_string()[..13],
    )
}

fn action_button(kind: &str, id: &Uuid, action: &str) -> String {
    format!(
        "<form class=\"action\" method=\"post\" action=\"/actions/jobs/{kind}/{id}/{action}\">\
         <input type=\"hidden\" name=\"token\"><button type=\"submit\" data-action=\"{action}\">{action}</button></form>",
        kind = esc(kind),
    )
}

pub fn render_failures(o: &Overview) -> String {
    if o.failures.is_empty() {
        return "<p class=\"empty\">No failed or retrying jobs.</p>".into();
    }
    let mut s = String::from(
        "<table class=\"list\"><thead><tr><th>kind</th><th>job</th><th>state</th><th>checkpoint</th>\
         <th>attempts</th><th>error</th><th>updated</th><th></th></tr></thead><tbody>",
    );
    for r in &o.failures {
        let act = if r.kind == "compile" && r.actions.contains(&"retry") {
            action_button(&r.kind, &r.id, "retry")
        } else if r.actions.is_empty() {
            String::new()
        } else {
            format!(
                "<a class=\"button\" href=\"/jobs/{}/{}\">{}…</a>",
                esc(&r.kind),
                r.id,
                r.actions.join(" / ")
            )
        };
        let _ = write!(
            s,
            "<tr data-failure=\"{id}\"><td>{kind}</td><td>{link}</td><td>{state}</td><td>{cp}</td>\
             <td class=\"num\">{a}/{m}</td><td><code class=\"err\">{code}</code> <span class=\"msg\">{msg}</span></td>\
             <td class=\"when\" data-epoch=\"{t}\">{when}</td><td>{act}</td></tr>",
            id = r.id,
            kind = esc(&r.kind),
            link = job_link(r),
            state = state_badge(&r.state),
            cp = esc(&r.checkpoint),
            a = r.attempts,
            m = r.max_attempts,
            code = esc(r.error_code.as_deref().unwrap_or("—")),
            msg = esc(&truncate(r.error_message.as_deref().unwrap_or(""), 140)),
            t = r.updated_at,
            when = fmt_time(r.updated_at),
        );
    }
    s.push_str("</tbody></table>");
    s
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_owned()
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}

pub fn render_recent(o: &Overview) -> String {
    if o.recent.is_empty() {
        return "<p class=\"empty\">No jobs yet.</p>".into();
    }
    let mut s = String::from(
        "<table class=\"list\"><thead><tr><th>kind</th><th>job</th><th>state</th><th>checkpoint</th>\
         <th>attempts</th><th>updated</th></tr></thead><tbody>",
    );
    for r in &o.recent {
        let _ = write!(
            s,
            "<tr data-recent=\"{id}\" data-state=\"{st}\"><td>{kind}</td><td>{link}</td><td>{state}</td>\
             <td>{cp}</td><td class=\"num\">{a}/{m}</td><td class=\"when\" data-epoch=\"{t}\">{when}</td></tr>",
            id = r.id,
            st = esc(&r.state),
            kind = esc(&r.kind),
            link = job_link(r),
            state = state_badge(&r.state),
            cp = esc(&r.checkpoint),
            a = r.attempts,
            m = r.max_attempts,
            t = r.updated_at,
            when = fmt_time(r.updated_at),
        );
    }
    s.push_str("</tbody></table>");
    s
}

pub fn render_dlq(o: &Overview) -> String {
    let mut s = match o.dead_letters {
        None => return "<p class=\"empty\">RabbitMQ is not reachable.</p>".into(),
        Some(0) => {
            return "<p class=\"empty\" data-dead-letters=\"0\">The dead-letter queue is empty.</p>"
                .into()
        }
        Some(n) => format!(
            "<p data-dead-letters=\"{n}\"><b>{n}</b> message(s) in the dead-letter queue{}.</p>",
            if (n as usize) > o.dead_letter_sample.len() {
                format!(", the first {} shown", o.dead_letter_sample.len())
            } else {
                String::new()
            }
        ),
    };
    s.push_str(
        "<table class=\"list\"><thead><tr><th>message</th><th>kind</th><th>reason</th><th>deaths</th>\
         <th>job</th><th>body</th><th></th></tr></thead><tbody>",
    );
    for d in &o.dead_letter_sample {
        let _ = write!(
            s,
            "<tr data-dead-letter=\"{id}\"><td class=\"mono\">{id}</td><td>{kind}</td><td><code class=\"err\">{reason}</code></td>\
             <td class=\"num\">{count}</td><td class=\"mono\">{job}</td><td><code class=\"body\">{body}</code></td>\
             <td><form class=\"action\" method=\"post\" action=\"/actions/dlq/requeue\">\
             <input type=\"hidden\" name=\"token\"><input type=\"hidden\" name=\"id\" value=\"{id}\">\
             <button type=\"submit\" data-action=\"requeue\">requeue</button></form></td></tr>",
            id = esc(&d.id),
            kind = esc(d.kind.as_deref().unwrap_or("?")),
            reason = esc(d.reason.as_deref().unwrap_or("?")),
            count = d.count.map_or("?".into(), |c| c.to_string()),
            job = esc(d.job_id.as_deref().unwrap_or("—")),
            body = esc(&truncate(&d.body_preview, 80)),
        );
    }
    s.push_str("</tbody></table>");
    s
}

fn render_overview(o: &Overview) -> String {
    let gate = if o.actions_enabled {
        "<span class=\"pill ok\">actions enabled with the admin token</span>"
    } else {
        "<span class=\"pill warn\" id=\"actions-disabled\">actions disabled: KFS_ADMIN_TOKEN is not set</span>"
    };
    let body = format!(
        "<div class=\"titlebar\"><h1>Jobs</h1><span class=\"live\" id=\"live\" data-generated=\"{t}\">live · {when}</span>{gate}</div>\
         <div id=\"kinds\" class=\"grid\" data-poll=\"kinds\">{kinds}</div>\
         <h2 id=\"failures\">Recent failures</h2><div data-poll=\"failures\">{failures}</div>\
         <h2 id=\"recent\">Recent jobs</h2><div data-poll=\"recent\">{recent}</div>\
         <h2 id=\"dead-letters\">Dead letters</h2><div data-poll=\"dlq\">{dlq}</div>",
        t = o.generated_at,
        when = fmt_time(o.generated_at),
        kinds = render_kinds(o),
        failures = render_failures(o),
        recent = render_recent(o),
        dlq = render_dlq(o),
    );
    page("Jobs", &body).replace("<body>", "<body data-overview=\"/api/overview\">")
}

fn cell(key: &str, v: &Value) -> String {
    match v {
        Value::Null => "<span class=\"muted\">—</span>".into(),
        Value::Number(n) if key.ends_with("_at") || key == "resume_after" => n
            .as_f64()
            .map(|ms| fmt_time(ms / 1000.0))
            .unwrap_or_else(|| n.to_string()),
        Value::String(s) => {
            if key == "run_state" || key == "stage" || key == "status" {
                state_badge(s)
            } else {
                esc(&truncate(s, 300))
            }
        }
        other => format!("<code>{}</code>", esc(&truncate(&other.to_string(), 300))),
    }
}

fn table_of(rows: &[Value]) -> String {
    let Some(first) = rows.first().and_then(Value::as_object) else {
        return "<p class=\"empty\">None.</p>".into();
    };
    let cols: Vec<&String> = first.keys().collect();
    let mut s = String::from("<table class=\"list\"><thead><tr>");
    for c in &cols {
        let _ = write!(s, "<th>{}</th>", esc(c));
    }
    s.push_str("</tr></thead><tbody>");
    for r in rows {
        s.push_str("<tr>");
        for c in &cols {
            let _ = write!(
                s,
                "<td>{}</td>",
                cell(c, r.get(c.as_str()).unwrap_or(&Value::Null))
            );
        }
        s.push_str("</tr>");
    }
    s.push_str("</tbody></table>");
    s
}

/// The part of a job page that refreshes while the job runs.
fn render_job_live(d: &JobDetail) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        "<div class=\"facts\"><div><span>state</span><b id=\"job-state\" data-state=\"{st}\">{badge}</b></div>\
         <div><span>checkpoint</span><b id=\"job-checkpoint\">{cp}</b></div>\
         <div><span>attempts</span><b id=\"job-attempts\">{a} / {m}</b></div>\
         <div><span>updated</span><b>{upd}</b></div></div>",
        st = esc(&d.state),
        badge = state_badge(&d.state),
        cp = esc(&d.checkpoint),
        a = d.job.get("execution_attempts").unwrap_or(&Value::Null),
        m = d.job.get("max_execution_attempts").unwrap_or(&Value::Null),
        upd = cell("updated_at", d.job.get("updated_at").unwrap_or(&Value::Null)),
    );
    if !d.checkpoints.is_empty() {
        let at = d.checkpoints.iter().position(|c| *c == d.checkpoint);
        s.push_str("<ol class=\"steps\">");
        for (i, c) in d.checkpoints.iter().enumerate() {
            let cls = match at {
                Some(a) if i < a => "done",
                Some(a) if i == a => {
                    if d.state == "failed" {
                        "failed"
                    } else if matches!(d.state.as_str(), "succeeded" | "completed") {
                        "done"
                    } else {
                        "current"
                    }
                }
                _ => "",
            };
            let _ = write!(s, "<li class=\"{cls}\">{}</li>", esc(c));
        }
        s.push_str("</ol>");
    }
    let (code, msg) = error_of(&serde_json::json!({
        "code": d.job.get("last_error_code"),
        "message": d.job.get("last_error_message"),
        "error": d.job.get("error"),
    }));
    if code.is_some() || msg.is_some() {
        let _ = write!(
            s,
            "<div class=\"notice bad\" id=\"job-error\"><code>{}</code> {}</div>",
            esc(code.as_deref().unwrap_or("error")),
            esc(msg.as_deref().unwrap_or(""))
        );
    }
    s.push_str("<h2>Deliveries</h2><p class=\"muted\">One outbox row per delivery revision: dispatch attempts and the last error of each.</p>");
    s.push_str(&table_of(&d.deliveries));
    for sec in &d.history {
        let _ = write!(s, "<h2>{}</h2>{}", esc(sec.title), table_of(&sec.rows));
    }
    s
}

fn render_actions(d: &JobDetail) -> String {
    if d.kind_actions.is_empty() {
        return String::new();
    }
    let mut s = String::from("<section class=\"card actions\"><h3>Actions</h3>");
    if !d.actions_enabled {
        s.push_str("<p class=\"pill warn\">actions disabled: this worker was started without KFS_ADMIN_TOKEN</p>");
    }
    if d.actions.is_empty() {
        let _ = write!(
            s,
            "<p class=\"muted\">No action applies to a {} job that is {}.</p>",
            esc(&d.kind),
            esc(&d.state)
        );
    }
    for a in &d.actions {
        let extra = match (d.kind.as_str(), *a) {
            ("deletion", "retry") => format!(
                "<label>as subject <input name=\"subject\" value=\"{}\"></label>\
                 <label>permission snapshot <input name=\"snapshot\" size=\"38\" value=\"{}\"></label>\
                 <label><input type=\"checkbox\" name=\"owner_rescue\" value=\"1\"> owner rescue</label>",
                esc(d.job.get("requested_by_subject_id").and_then(Value::as_str).unwrap_or("")),
                esc(d.job.get("permission_snapshot_id").and_then(Value::as_str).unwrap_or("")),
            ),
            ("research", "cancel") => "<label>reason <input name=\"reason\" placeholder=\"optional\"></label>".into(),
            _ => String::new(),
        };
        let _ = write!(
            s,
            "<form class=\"action\" method=\"post\" action=\"/actions/jobs/{kind}/{id}/{a}\">\
             <input type=\"hidden\" name=\"token\">{extra}<button type=\"submit\" data-action=\"{a}\">{a}</button></form>",
            kind = esc(&d.kind),
            id = d.id,
        );
    }
    s.push_str("</section>");
    s
}

fn render_job(d: &JobDetail) -> String {
    let mut fields = String::from("<table class=\"kv\"><tbody>");
    if let Some(obj) = d.job.as_object() {
        for (k, v) in obj {
            if k == "lease_token" {
                continue;
            }
            let _ = write!(
                fields,
                "<tr><th>{}</th><td>{}</td></tr>",
                esc(k),
                cell(k, v)
            );
        }
    }
    fields.push_str("</tbody></table>");
    let body = format!(
        "<div class=\"titlebar\"><h1>{kind} job <span class=\"mono\">{id}</span></h1>\
         <span class=\"live\" id=\"live\">live</span></div>\
         <div class=\"two\"><div data-poll-job=\"/api/jobs/{kind}/{id}\">{live}</div>\
         <aside>{actions}<section class=\"card\"><h3>Row</h3>{fields}</section></aside></div>",
        kind = esc(&d.kind),
        id = d.id,
        live = render_job_live(d),
        actions = render_actions(d),
    );
    page(&format!("{} {}", d.kind, d.id), &body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_follow_kind_and_state() {
        let table: [(Kind, &str, &[&str]); 9] = [
            (Kind::Compile, "failed", &["retry"]),
            (Kind::Compile, "running", &[]),
            (Kind::Deletion, "failed", &["retry"]),
            (Kind::Deletion, "succeeded", &[]),
            (Kind::Research, "retrieving", &["pause", "cancel"]),
            (Kind::Research, "paused", &["resume", "cancel"]),
            (Kind::Research, "completed", &[]),
            (Kind::Research, "canceled", &[]),
            (Kind::Probe, "failed", &[]),
        ];
        for (kind, state, want) in table {
            assert_eq!(job_actions(kind, state), want, "{kind} {state}");
            for a in job_actions(kind, state) {
                assert!(kind_actions(kind).contains(&a), "{kind} {a}");
            }
        }
    }

    #[test]
    fn errors_come_from_columns_or_a_code_message_text() {
        let e = |v: Value| error_of(&v);
        assert_eq!(
            e(
                serde_json::json!({"code": "hash_mismatch", "message": "bytes differ", "error": null})
            ),
            (Some("hash_mismatch".into()), Some("bytes differ".into()))
        );
        assert_eq!(
            e(
                serde_json::json!({"code": null, "message": null, "error": "budget_exceeded: spent 2.1"})
            ),
            (Some("budget_exceeded".into()), Some("spent 2.1".into()))
        );
        assert_eq!(
            e(serde_json::json!({"error": "something went wrong: badly"})),
            (None, Some("something went wrong: badly".into()))
        );
        assert_eq!(e(serde_json::json!({})), (None, None));
    }

    #[test]
    fn html_is_escaped() {
        assert_eq!(
            esc("<a href=\"x\">'&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
    }

    #[test]
    fn states_sort_live_first_and_unknown_last() {
        let m: BTreeMap<String, i64> =
            [("succeeded", 1), ("zeta", 1), ("queued", 1), ("failed", 1)]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect();
        let order: Vec<&str> = sorted_states(&m)
            .into_iter()
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(order, ["queued", "succeeded", "failed", "zeta"]);
    }

    #[test]
    fn every_kind_renders_a_card_with_its_counts() {
        let o = Overview {
            generated_at: 0.0,
            actions_enabled: false,
            kinds: vec![KindOverview {
                status: KindStatus {
                    kind: "new_kind".into(),
                    jobs: [("running".to_owned(), 2)].into_iter().collect(),
                    outbox: BTreeMap::new(),
                    oldest_due_seconds: Some(3.5),
                    queued_messages: Some(4),
                },
                completed_per_minute: 1.25,
                failed_per_minute: 0.0,
                rate_window_minutes: 5,
                actions: vec![],
            }],
            failures: vec![],
            recent: vec![],
            dead_letters: Some(0),
            dead_letter_sample: vec![],
            leased: vec![crate::status::LeasedStatus {
                kind: "bootstrap".into(),
                jobs: [("running".to_owned(), 1)].into_iter().collect(),
                checkpoints: [("rebuilding".to_owned(), 1)].into_iter().collect(),
            }],
        };
        let html = render_kinds(&o);
        assert!(html.contains("data-kind=\"bootstrap\""), "{html}");
        assert!(
            html.contains("data-checkpoint=\"rebuilding\">rebuilding 1<"),
            "{html}"
        );
        assert!(html.contains("data-kind=\"new_kind\""), "{html}");
        assert!(html.contains("data-state=\"running\">2<"), "{html}");
        assert!(html.contains(">1.2<") || html.contains(">1.3<"), "{html}");
        assert!(html.contains(">3.5 s<"), "{html}");
        assert!(render_dlq(&o).contains("empty"));
    }
}
