//! The job page: the job's row, its live part (state, checkpoint strip, error, deliveries and
//! history) and its action forms. Invariant: as for all of `render`, every text from the
//! database is escaped with [`esc`] before it goes into HTML; the form inputs of an action are
//! the ones `kinds.rs` lists for the job's kind.

use std::fmt::Write as _;

use serde_json::Value;

use super::{esc, fmt_time, page, state_badge, truncate};
use crate::http::dashboard::kinds;
use crate::http::dashboard::queries::{error_of, JobDetail};
use crate::jobs::operate::Input;

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
pub(in crate::http::dashboard) fn render_job_live(d: &JobDetail) -> String {
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
        a = esc(&d.job.get("execution_attempts").unwrap_or(&Value::Null).to_string()),
        m = esc(&d.job.get("max_execution_attempts").unwrap_or(&Value::Null).to_string()),
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
        let extra = action_inputs(d, a);
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

/// The inputs of `action`'s form on the page of job `d`, as [`kinds::action_inputs`] lists them.
fn action_inputs(d: &JobDetail, action: &str) -> String {
    let mut s = String::new();
    for input in kinds::action_inputs(&d.kind, action) {
        match input {
            Input::Text {
                label,
                name,
                size,
                prefill,
                placeholder,
            } => {
                let _ = write!(s, "<label>{} <input name=\"{}\"", esc(label), esc(name));
                if let Some(n) = size {
                    let _ = write!(s, " size=\"{n}\"");
                }
                if let Some(col) = prefill {
                    let v = d.job.get(*col).and_then(Value::as_str).unwrap_or("");
                    let _ = write!(s, " value=\"{}\"", esc(v));
                }
                if let Some(p) = placeholder {
                    let _ = write!(s, " placeholder=\"{}\"", esc(p));
                }
                s.push_str("></label>");
            }
            Input::Checkbox { label, name } => {
                let _ = write!(
                    s,
                    "<label><input type=\"checkbox\" name=\"{}\" value=\"1\"> {}</label>",
                    esc(name),
                    esc(label)
                );
            }
        }
    }
    s
}

pub(in crate::http::dashboard) fn render_job(d: &JobDetail) -> String {
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
