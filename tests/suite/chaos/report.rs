//! The run's report: faults and kill points, takeover and recovery times, soak samples, worker
//! warnings and the verdict of each invariant.

use super::acks::read_logs;
use super::database::count;
use super::record::percentile;
use super::*;

#[allow(clippy::too_many_arguments)]
pub(super) async fn report(
    settings: &Settings,
    rec: &Record,
    pool: &PgPool,
    cluster: &Cluster,
    checks: &[Check],
    drain_s: f64,
    exit_codes: &[(String, Option<i32>)],
    started: Instant,
) -> String {
    let mut r = String::new();
    let _ = writeln!(r, "== chaos report ==");
    let _ = writeln!(
        r,
        "seed {}, {} s of faults{}, total {:.0} s; recovery phase {drain_s:.1} s",
        settings.seed,
        settings.seconds,
        if settings.outages {
            " with the long outages"
        } else {
            ""
        },
        started.elapsed().as_secs_f64()
    );
    let _ = writeln!(r, "processes: 3 consumers (c1 a witness, never killed), 2 relays with maintenance (r1 a witness); lease {LEASE}, slices of 4 steps");
    let _ = writeln!(r, "\nfaults injected:");
    let total: u64 = rec.faults.values().sum();
    for (k, n) in &rec.faults {
        let _ = writeln!(r, "  {n:>5}  {k}");
    }
    let _ = writeln!(r, "  {total:>5}  total");
    let _ = writeln!(r, "kill points reached:");
    for p in CONSUMER_POINTS.iter().chain(RELAY_POINTS.iter()) {
        let _ = writeln!(
            r,
            "  {:>5}  {p}",
            rec.crash_points.get(*p).copied().unwrap_or(0)
        );
    }

    let states: Vec<(String, i64)> = sqlx::query_as(
        "SELECT run_state::text, count(*) FROM kfs_probe_jobs GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    let steps = count(pool, "SELECT count(*) FROM kfs_probe_effects").await;
    let claims = count(pool, "SELECT count(*) FROM chaos_claims").await;
    let reclaims = count(
        pool,
        "SELECT count(*) - count(DISTINCT job_id) FROM chaos_claims",
    )
    .await;
    let _ = writeln!(
        r,
        "\njobs: {} enqueued; by final state {states:?}; {steps} step effects",
        rec.jobs.len()
    );
    let _ = writeln!(r, "platform jobs: {}", platform::summary(&rec.platform));
    let _ = writeln!(r, "claims: {claims} (of which {reclaims} after the job's first claim: new slices, retries and takeovers)");
    let (acks, warnings) = read_logs(cluster);
    let mut by_claim: BTreeMap<String, u64> = BTreeMap::new();
    for a in &acks {
        *by_claim
            .entry(format!("{}/{}", a.claim, a.end))
            .or_default() += 1;
    }
    let _ = writeln!(r, "acks by claim/end: {by_claim:?}");
    let lease_lost = warnings
        .get("lease lost; stopping the slice and writing nothing more")
        .copied()
        .unwrap_or(0);
    let _ = writeln!(r, "slices stopped by fencing (lease lost): {lease_lost}");

    // Takeovers: from a death or pause to the next claim of each job it held.
    let mut times: Vec<f64> = Vec::new();
    let mut never = 0usize;
    for t in &rec.takeovers {
        let rows: Vec<(Uuid, Option<DateTime<Utc>>)> = sqlx::query_as(
            "SELECT j, (SELECT min(c.at) FROM chaos_claims c WHERE c.job_id = j AND c.at > $2) FROM unnest($1::uuid[]) AS j",
        )
        .bind(&t.jobs)
        .bind(t.at)
        .fetch_all(pool)
        .await
        .unwrap_or_default();
        for (_, at) in rows {
            match at {
                Some(at) => times.push((at - t.at).num_milliseconds() as f64 / 1000.0),
                None => never += 1,
            }
        }
    }
    times.sort_by(f64::total_cmp);
    let _ = writeln!(
        r,
        "takeovers: {} jobs held by killed, aborted or paused processes; time to the next claim p50 {:.2} s, p90 {:.2} s, p99 {:.2} s, max {:.2} s; {never} never claimed again (finished by their holder after SIGCONT, or ended)",
        times.len() + never,
        percentile(&times, 0.5),
        percentile(&times, 0.9),
        percentile(&times, 0.99),
        times.last().copied().unwrap_or(f64::NAN)
    );
    let mut rec_times: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for (label, at) in &rec.recoveries {
        let first: Option<DateTime<Utc>> = sqlx::query_scalar(
            "SELECT min(created_at) FROM kfs_probe_effects WHERE created_at > $1",
        )
        .bind(at)
        .fetch_one(pool)
        .await
        .unwrap_or(None);
        if let Some(first) = first {
            rec_times
                .entry(label.clone())
                .or_default()
                .push((first - *at).num_milliseconds() as f64 / 1000.0);
        }
    }
    for (label, mut v) in rec_times {
        v.sort_by(f64::total_cmp);
        let _ = writeln!(
            r,
            "recovery after {label} (service back → first step committed): n {}, p50 {:.2} s, p90 {:.2} s, max {:.2} s",
            v.len(),
            percentile(&v, 0.5),
            percentile(&v, 0.9),
            v.last().copied().unwrap_or(f64::NAN)
        );
    }
    for line in &rec.outage_cpu {
        let _ = writeln!(r, "{line}");
    }

    let _ = writeln!(r, "\nsoak samples (s since the faults began: witness RSS kB; worker sessions in Postgres; AMQP connections in RabbitMQ; open via the proxies pg/mq; accepted by the proxies so far pg/mq):");
    for s in &rec.samples {
        let rss: Vec<String> = s
            .rss_kb
            .iter()
            .map(|(id, kb)| format!("{id} {kb}"))
            .collect();
        let mq = s.mq_connections.map_or("-".to_owned(), |n| n.to_string());
        let _ = writeln!(
            r,
            "  {:>5} s: {}; pg sessions {}; mq connections {mq}; open {}/{}; accepted {}/{}",
            s.at_s,
            rss.join(", "),
            s.pg_sessions,
            s.pg_proxy_open,
            s.mq_proxy_open,
            s.accepted.0,
            s.accepted.1
        );
    }
    if let (Some(first), Some(last)) = (
        rec.samples.iter().find(|s| s.at_s >= 10),
        rec.samples.last(),
    ) {
        for ((id, a), (_, b)) in first.rss_kb.iter().zip(last.rss_kb.iter()) {
            let _ = writeln!(
                r,
                "  RSS growth of {id}: {a} kB → {b} kB ({:+.1} %)",
                (*b as f64 - *a as f64) * 100.0 / (*a).max(1) as f64
            );
        }
        let _ = writeln!(
            r,
            "  Postgres sessions: {} → {}",
            first.pg_sessions, last.pg_sessions
        );
    }
    let _ = writeln!(r, "\nworker warnings (message: count):");
    let mut w: Vec<(&String, &u64)> = warnings.iter().collect();
    w.sort_by(|a, b| b.1.cmp(a.1));
    for (m, n) in w.iter().take(12) {
        let _ = writeln!(r, "  {n:>6}  {m}");
    }
    let _ = writeln!(r, "exit codes on SIGTERM at the end: {exit_codes:?}");
    for n in &rec.notes {
        let _ = writeln!(r, "note: {n}");
    }
    let _ = writeln!(r, "\ninvariants:");
    for c in checks {
        let _ = writeln!(
            r,
            "  [{}] {} — {}",
            if c.ok { "ok" } else { "FAIL" },
            c.name,
            c.detail
        );
    }
    r
}
