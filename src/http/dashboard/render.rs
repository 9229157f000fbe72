//! The dashboard's HTML: the overview and its live parts, the outcome of an action, the error
//! pages, and the formatting helpers they use (`esc`, `page`, `fmt_*`, `render_*`); the job
//! page is in `render/job.rs`. Invariant: every text that comes from the database, the broker
//! or the request is escaped with [`esc`] before it goes into HTML (numbers, UUIDs and times
//! are written as formatted here); rendering reads and writes nothing.

mod job;

use std::collections::BTreeMap;
use std::fmt::Write as _;

use uuid::Uuid;

pub(super) use job::{render_job, render_job_live};

use super::kinds;
use super::queries::{JobRow, Overview};

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
             <div><b data-queued>{queued}</b><span>queued msgs</span></div>\
             <div><b data-backlog>{backlog}</b><span>backlog</span></div></div>\
             <table class=\"states\"><tbody>",
            kind = esc(&ks.kind),
            ok = fmt_rate(k.completed_per_minute),
            bad = fmt_rate(k.failed_per_minute),
            failcls = if k.failed_per_minute > 0.0 { "bad" } else { "" },
            lag = ks.oldest_due_seconds.map_or("0 s".into(), fmt_age),
            queued = ks.queued_messages.map_or("?".into(), |n| n.to_string()),
            backlog = ks.backlog,
        );
        state_rows(&mut s, &ks.jobs);
        s.push_str("</tbody></table><p class=\"outbox\">outbox ");
        pills(&mut s, &ks.outbox, "data-outbox", "empty");
        if ks.backlog_tenants > 0 {
            // The tenants with the most work waiting, most first.
            let _ = write!(
                s,
                "</p><p class=\"tenants\">backlog of {} tenant{} ",
                ks.backlog_tenants,
                if ks.backlog_tenants == 1 { "" } else { "s" }
            );
            for (tenant, n) in &ks.top_tenants {
                let _ = write!(
                    s,
                    "<span class=\"pill\" data-tenant=\"{v}\">{v} {n}</span>",
                    v = esc(tenant)
                );
            }
            if ks.backlog_tenants > ks.top_tenants.len() as i64 {
                s.push_str("<span class=\"muted\">…</span>");
            }
        }
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
        let inline = kinds::failure_list_action(&r.kind).filter(|a| r.actions.contains(a));
        let act = if let Some(a) = inline {
            action_button(&r.kind, &r.id, a)
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

pub(super) fn render_overview(o: &Overview) -> String {
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

/// The page that says how an action went; `back` links to the page it came from.
pub(super) fn render_outcome(ok: bool, message: &str, back: &str) -> String {
    let body = format!(
        "<div class=\"notice {cls}\" id=\"outcome\" data-ok=\"{ok}\">{msg}</div>\
         <p><a class=\"button\" id=\"back\" href=\"{back}\">Back</a></p>",
        cls = if ok { "good" } else { "bad" },
        msg = esc(message),
        back = esc(back),
    );
    let title = if ok { "Done" } else { "Refused" };
    page(title, &body)
}

/// The page shown when Postgres did not answer with `error`.
pub(super) fn render_unavailable(error: &str) -> String {
    page(
        "Unavailable",
        &format!(
            "<div class=\"notice bad\">Postgres did not answer: {}</div>",
            esc(error)
        ),
    )
}

/// The page shown when there is no `what`.
pub(super) fn render_not_found(what: &str) -> String {
    page(
        "Not found",
        &format!(
            "<div class=\"notice bad\">{}</div><p><a href=\"/\">Back to the overview</a></p>",
            esc(what)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::dashboard::queries::KindOverview;
    use crate::status::KindStatus;

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
                    backlog: 9,
                    backlog_tenants: 2,
                    top_tenants: vec![("acme<1>".into(), 7), ("globex".into(), 2)],
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
        assert!(html.contains("<b data-backlog>9</b>"), "{html}");
        assert!(
            html.contains("backlog of 2 tenants <span class=\"pill\" data-tenant=\"acme&lt;1&gt;\">acme&lt;1&gt; 7</span>"),
            "{html}"
        );
        assert!(render_dlq(&o).contains("empty"));
    }
}
