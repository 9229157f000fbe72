//! The operator dashboard at `/`: live counts and rates per kind, relay lag, recent failures,
//! dead letters, and one page per job. Invariant: every page is built from the kinds'
//! [`KindSpec`](crate::jobs::KindSpec)s, [`crate::status::read`] and each kind's registered
//! operator surface, read in `kinds.rs` (nothing here matches on a [`Kind`]); the only
//! writes are the actions, each allowed only with the admin token (compared in constant time)
//! and each done by the same library function the CLI calls.
//!
//! This file holds the routes, the handlers and the error responses. A handler only parses
//! the request, calls a query (`queries.rs`, reads only) or an action (`actions.rs`, behind the
//! token), and answers with JSON or a page from `render.rs` (which escapes every text from the
//! database).

mod actions;
mod gate;
mod kinds;
mod queries;
mod render;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Form, Json, Router};
use serde_json::Value;
use uuid::Uuid;

pub use gate::ActionForm;
pub use kinds::{checkpoint_order, job_actions, kind_actions};
pub use queries::{job_detail, overview, JobDetail, JobRow, KindOverview, Overview, Section};
pub use render::{esc, render_dlq, render_failures, render_kinds, render_recent};

use super::AppState;
use crate::jobs::Kind;
use gate::Outcome;

const CSS: &str = include_str!("dashboard.css");
const JS: &str = include_str!("dashboard.js");

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
// Error responses

fn db_error(e: sqlx::Error) -> Response {
    tracing::warn!(error = %e, "dashboard: database read failed");
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Html(render::render_unavailable(&e.to_string())),
    )
        .into_response()
}

fn not_found(what: &str) -> Response {
    (StatusCode::NOT_FOUND, Html(render::render_not_found(what))).into_response()
}

/// An action's outcome, as HTML for a browser and JSON for a client that asks for it.
fn respond(outcome: Outcome, headers: &HeaderMap) -> Response {
    let wants_json = headers
        .get("accept")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/json"));
    let ok = outcome.code.is_success();
    if wants_json {
        return (
            outcome.code,
            Json(serde_json::json!({ "ok": ok, "message": outcome.message })),
        )
            .into_response();
    }
    let html = render::render_outcome(ok, &outcome.message, &outcome.back);
    (outcome.code, Html(html)).into_response()
}

// ---------------------------------------------------------------------------------------------
// Handlers

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
        Ok(o) => Html(render::render_overview(&o)).into_response(),
        Err(e) => db_error(e),
    }
}

fn parse_kind(st: &AppState, raw: &str) -> Option<Kind> {
    let kind = *Kind::parse_list(raw).ok()?.first()?;
    st.kinds.contains(&kind).then_some(kind)
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
            v["html"] = Value::String(render::render_job_live(&d));
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
        Ok(Some(d)) => Html(render::render_job(&d)).into_response(),
        Ok(None) => not_found(&format!("no {kind} job {id}")),
        Err(e) => db_error(e),
    }
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
    let auth = match gate::authorize(&st, &headers, &form, &back) {
        Ok(auth) => auth,
        Err(refusal) => return respond(refusal, &headers),
    };
    let Some(kind) = parse_kind(&st, &kind) else {
        let message = format!("this worker serves no job kind '{kind}'");
        return respond(Outcome::new(StatusCode::NOT_FOUND, message, "/"), &headers);
    };
    let Ok(id) = Uuid::parse_str(&id) else {
        let message = format!("'{id}' is not a job id (a UUID)");
        return respond(
            Outcome::new(StatusCode::BAD_REQUEST, message, "/"),
            &headers,
        );
    };
    let outcome = actions::job_action(&auth, &st, kind, id, &action, &form, back).await;
    respond(outcome, &headers)
}

async fn dlq_requeue(
    State(st): State<AppState>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Response {
    let auth = match gate::authorize(&st, &headers, &form, "/#dead-letters") {
        Ok(auth) => auth,
        Err(refusal) => return respond(refusal, &headers),
    };
    let Some(id) = gate::field(&form.id) else {
        let message = "requeue needs the message id";
        return respond(
            Outcome::new(StatusCode::BAD_REQUEST, message, "/#dead-letters"),
            &headers,
        );
    };
    respond(actions::requeue_dead_letter(&auth, &st, id).await, &headers)
}
