//! `kfs-worker status`: what the job tables and queues hold right now. Invariant: read-only —
//! it only ever runs SELECTs and passive queue declarations.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;
use sqlx::{PgConnection, PgPool};

use crate::broker::Topology;
use crate::db;
use crate::jobs::{Kind, States};

/// One kind's numbers.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct KindStatus {
    pub kind: String,
    /// Jobs by state (`run_state`, or `stage` for research).
    pub jobs: BTreeMap<String, i64>,
    /// Outbox rows by status.
    pub outbox: BTreeMap<String, i64>,
    /// Age in seconds of the oldest outbox row that is due and not yet out for delivery.
    pub oldest_due_seconds: Option<f64>,
    /// Messages waiting in the kind's queue (None when the broker was not asked or not reachable).
    pub queued_messages: Option<u32>,
    /// Work not yet claimed by a consumer: due rows waiting in Postgres, plus messages published
    /// and not yet claimed (the relay's window). What the KEDA ScaledObject scales on.
    pub backlog: i64,
    /// Tenants with work in the backlog (kinds whose jobs have tenants).
    pub backlog_tenants: i64,
    /// The tenants with the most work in the backlog, most first (at most [`TOP_TENANTS`]).
    pub top_tenants: Vec<(String, i64)>,
}

/// How many tenants `status`, the dashboard and `/metrics` name in a kind's backlog: enough to
/// see who is flooding, bounded so a platform with many tenants stays readable.
pub const TOP_TENANTS: i64 = 10;

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Status {
    pub kinds: Vec<KindStatus>,
    pub dead_letters: Option<u32>,
    /// The jobs leased straight from Postgres (no outbox, no queue).
    pub leased: Vec<LeasedStatus>,
    /// The live worker processes, by worker id, with the RabbitMQ node each is on.
    pub processes: Vec<ProcessStatus>,
}

/// A live worker process.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct ProcessStatus {
    pub worker_id: String,
    /// `host:port` of its RabbitMQ node; `None` while it is on none.
    pub node: Option<String>,
}

/// One leased kind's numbers (bootstraps, profile and page-index backfills).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct LeasedStatus {
    pub kind: String,
    /// Jobs by `run_state`.
    pub jobs: BTreeMap<String, i64>,
    /// Jobs by checkpoint (kinds that have one).
    pub checkpoints: BTreeMap<String, i64>,
}

/// Reads the leased kinds' numbers.
async fn read_leased(conn: &mut PgConnection) -> Result<Vec<LeasedStatus>, sqlx::Error> {
    let mut out = Vec::new();
    for kind in crate::jobs::leased_kinds() {
        let (table, checkpoint) = (kind.table(), kind.has_checkpoint());
        let jobs: Vec<(String, i64)> = sqlx::query_as(&format!(
            "SELECT run_state::text, count(*) FROM {table} GROUP BY 1"
        ))
        .fetch_all(&mut *conn)
        .await?;
        let checkpoints: Vec<(String, i64)> = if checkpoint {
            sqlx::query_as(&format!(
                "SELECT checkpoint::text, count(*) FROM {table} GROUP BY 1"
            ))
            .fetch_all(&mut *conn)
            .await?
        } else {
            Vec::new()
        };
        out.push(LeasedStatus {
            kind: kind.name().to_owned(),
            jobs: jobs.into_iter().collect(),
            checkpoints: checkpoints.into_iter().collect(),
        });
    }
    for kind in crate::jobs::polled_kinds(crate::model::Models::none()) {
        let jobs: Vec<(String, i64)> = sqlx::query_as(kind.counts_sql())
            .fetch_all(&mut *conn)
            .await?;
        out.push(LeasedStatus {
            kind: kind.name().to_owned(),
            jobs: jobs.into_iter().collect(),
            checkpoints: BTreeMap::new(),
        });
    }
    Ok(out)
}

/// Records what a status read found as the point-in-time gauges of `/metrics`, with every state
/// the registry knows for each kind (one without rows reads zero).
pub fn record_metrics(status: &Status) {
    for k in &status.kinds {
        let known = Kind::named(&k.kind).map_or(&[][..], |kind| kind.spec().job_states());
        crate::metrics::record_kind(&crate::metrics::KindNumbers {
            kind: &k.kind,
            jobs: &k.jobs,
            job_states: known,
            outbox: &k.outbox,
            outbox_statuses: crate::engine::kind::OUTBOX_STATUSES,
            oldest_due_seconds: k.oldest_due_seconds,
            backlog: k.backlog,
            backlog_tenants: k.backlog_tenants,
            top_tenant: k.top_tenants.first().map(|t| t.1),
            queued_messages: k.queued_messages,
        });
    }
    let leased = crate::jobs::leased_kinds();
    let polled = crate::jobs::polled_kinds(crate::model::Models::none());
    for k in &status.leased {
        let lk = leased.iter().find(|l| l.name() == k.kind);
        let states = match (lk, polled.iter().find(|p| p.name() == k.kind)) {
            (Some(l), _) => l.states(),
            (None, Some(p)) => p.states(),
            (None, None) => &[][..],
        };
        let checkpoints = lk.map_or(&[][..], |l| l.checkpoints());
        crate::metrics::record_leased(&k.kind, &k.jobs, states, &k.checkpoints, checkpoints);
    }
    if let Some(d) = status.dead_letters {
        crate::metrics::record_dead_letters(d);
    }
}

/// Reads the numbers of `kinds` from Postgres, on one connection taken by [`db::acquire`], so
/// that `/metrics` still answers while the worker's pool is at Postgres' connection limit.
pub async fn read(pool: &PgPool, kinds: &[Kind]) -> Result<Status, sqlx::Error> {
    let mut conn = db::acquire(pool).await?;
    let conn = &mut *conn;
    let mut out = Status {
        processes: crate::liveness::processes(conn)
            .await?
            .into_iter()
            .map(|(worker_id, node)| ProcessStatus { worker_id, node })
            .collect(),
        ..Status::default()
    };
    for &kind in kinds {
        let spec = kind.spec();
        let state = match spec.states {
            States::RunState { .. } => "run_state",
            States::Stage => "stage",
        };
        let jobs: Vec<(String, i64)> = sqlx::query_as(&spec.sql(&format!(
            "SELECT {state}::text, count(*) FROM {{job}} GROUP BY 1"
        )))
        .fetch_all(&mut *conn)
        .await?;
        let outbox: Vec<(String, i64)> =
            sqlx::query_as(&spec.sql("SELECT status::text, count(*) FROM {outbox} GROUP BY 1"))
                .fetch_all(&mut *conn)
                .await?;
        let age_expr = match spec.clock {
            crate::jobs::Clock::Timestamptz => {
                "extract(epoch from now() - min(available_at))::float8"
            }
            crate::jobs::Clock::EpochMillis => {
                "((extract(epoch from now()) * 1000)::bigint - min(available_at))::float8 / 1000.0"
            }
        };
        let oldest: Option<f64> = sqlx::query_scalar(&spec.sql(&format!(
            "SELECT {age_expr} FROM {{outbox}} WHERE status = 'pending' AND available_at <= {{now}}"
        )))
        .fetch_one(&mut *conn)
        .await?;
        let waiting = "((o.status = 'pending' AND o.available_at <= {now}) \
                        OR o.status IN ('dispatching', 'dispatched'))";
        let backlog: i64 = sqlx::query_scalar(&spec.sql(&format!(
            "SELECT count(*) FROM {{outbox}} o WHERE {waiting}"
        )))
        .fetch_one(&mut *conn)
        .await?;
        let by_tenant: Vec<(String, i64, i64)> = if spec.fairness.is_some() && backlog > 0 {
            sqlx::query_as(&spec.sql(&format!(
                "SELECT j.tenant_id::text, count(*), count(*) OVER () FROM {{outbox}} o \
                 JOIN {{job}} j ON j.id = o.{{fk}} WHERE {waiting} \
                 GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT {TOP_TENANTS}"
            )))
            .fetch_all(&mut *conn)
            .await?
        } else {
            Vec::new()
        };
        out.kinds.push(KindStatus {
            kind: kind.name().to_owned(),
            jobs: jobs.into_iter().collect(),
            outbox: outbox.into_iter().collect(),
            oldest_due_seconds: oldest,
            queued_messages: None,
            backlog,
            backlog_tenants: by_tenant.first().map_or(0, |t| t.2),
            top_tenants: by_tenant.into_iter().map(|(t, n, _)| (t, n)).collect(),
        });
    }
    out.leased = read_leased(conn).await?;
    Ok(out)
}

/// Adds queue depths from the broker, by passive declaration (never creates anything).
pub async fn add_queue_depths(
    status: &mut Status,
    conn: &lapin::Connection,
    topology: &Topology,
    kinds: &[Kind],
) {
    let depth = |queue: String| async move {
        let ch = conn.create_channel().await.ok()?;
        let q = ch
            .queue_declare(
                queue.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .ok()?;
        let _ = ch.close(200, "status".into()).await;
        Some(q.message_count())
    };
    for (ks, &kind) in status.kinds.iter_mut().zip(kinds) {
        ks.queued_messages = depth(topology.queue(kind)).await;
    }
    status.dead_letters = depth(topology.dead_letter_queue()).await;
}

/// The human table.
pub fn render(status: &Status) -> String {
    let mut s = String::new();
    for k in &status.kinds {
        let _ = writeln!(s, "{}", k.kind);
        let jobs: Vec<String> = k.jobs.iter().map(|(st, n)| format!("{st}={n}")).collect();
        let outbox: Vec<String> = k.outbox.iter().map(|(st, n)| format!("{st}={n}")).collect();
        let _ = writeln!(
            s,
            "  jobs     {}",
            if jobs.is_empty() {
                "none".into()
            } else {
                jobs.join("  ")
            }
        );
        let _ = writeln!(
            s,
            "  outbox   {}",
            if outbox.is_empty() {
                "none".into()
            } else {
                outbox.join("  ")
            }
        );
        let due = k.oldest_due_seconds.map_or("none due".to_owned(), |a| {
            format!("oldest due row waiting {a:.1}s")
        });
        let queued = k
            .queued_messages
            .map_or("queue not reachable".to_owned(), |n| {
                format!("{n} messages queued")
            });
        let _ = writeln!(s, "  relay    {due}, {queued}");
        let mut backlog = format!("{} waiting to be claimed", k.backlog);
        if k.backlog_tenants > 0 {
            let top: Vec<String> = k
                .top_tenants
                .iter()
                .map(|(t, n)| format!("{t}={n}"))
                .collect();
            let _ = write!(
                backlog,
                " from {} tenant{}: {}",
                k.backlog_tenants,
                if k.backlog_tenants == 1 { "" } else { "s" },
                top.join("  ")
            );
            if k.backlog_tenants > k.top_tenants.len() as i64 {
                backlog.push_str("  …");
            }
        }
        let _ = writeln!(s, "  backlog  {backlog}");
    }
    for k in &status.leased {
        let jobs: Vec<String> = k.jobs.iter().map(|(st, n)| format!("{st}={n}")).collect();
        let _ = writeln!(
            s,
            "{} (leased)\n  jobs     {}",
            k.kind,
            if jobs.is_empty() {
                "none".into()
            } else {
                jobs.join("  ")
            }
        );
        if !k.checkpoints.is_empty() {
            let cps: Vec<String> = k
                .checkpoints
                .iter()
                .map(|(c, n)| format!("{c}={n}"))
                .collect();
            let _ = writeln!(s, "  at       {}", cps.join("  "));
        }
    }
    let _ = writeln!(s, "processes: {} live", status.processes.len());
    for p in &status.processes {
        let node = p
            .node
            .as_ref()
            .map_or("on no RabbitMQ node".to_owned(), |n| format!("on {n}"));
        let _ = writeln!(s, "  {}  {node}", p.worker_id);
    }
    let _ = writeln!(
        s,
        "dead letters: {}",
        status
            .dead_letters
            .map_or("not reachable".to_owned(), |n| n.to_string())
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_each_kind_and_the_dead_letters() {
        let st = Status {
            kinds: vec![KindStatus {
                kind: "compile".into(),
                jobs: [("succeeded".to_owned(), 3), ("running".to_owned(), 1)]
                    .into_iter()
                    .collect(),
                outbox: [("completed".to_owned(), 3)].into_iter().collect(),
                oldest_due_seconds: Some(1.25),
                queued_messages: Some(0),
                backlog: 7,
                backlog_tenants: 2,
                top_tenants: vec![("acme".into(), 5), ("globex".into(), 2)],
            }],
            dead_letters: Some(2),
            leased: vec![LeasedStatus {
                kind: "bootstrap".into(),
                jobs: [("succeeded".to_owned(), 1)].into_iter().collect(),
                checkpoints: [("published".to_owned(), 1)].into_iter().collect(),
            }],
            processes: vec![
                ProcessStatus {
                    worker_id: "w1".into(),
                    node: Some("127.0.0.1:5701".into()),
                },
                ProcessStatus {
                    worker_id: "w2".into(),
                    node: None,
                },
            ],
        };
        let out = render(&st);
        assert!(
            out.contains("compile\n  jobs     running=1  succeeded=3\n"),
            "{out}"
        );
        assert!(
            out.contains("oldest due row waiting 1.2s, 0 messages queued"),
            "{out}"
        );
        assert!(
            out.contains("  backlog  7 waiting to be claimed from 2 tenants: acme=5  globex=2\n"),
            "{out}"
        );
        assert!(
            out.contains("bootstrap (leased)\n  jobs     succeeded=1\n  at       published=1\n"),
            "{out}"
        );
        assert!(
            out.contains("processes: 2 live\n  w1  on 127.0.0.1:5701\n  w2  on no RabbitMQ node\n"),
            "{out}"
        );
        assert!(out.ends_with("dead letters: 2\n"), "{out}");
    }
}
