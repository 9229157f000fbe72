//! The verdicts of a run: each invariant checked against the database, the logs and the
//! record once the run has drained.

use super::acks::{acks_after_their_commits, read_logs, Ack};
use super::database::count;
use super::record::percentile;
use super::*;

pub(super) struct Check {
    pub(super) name: &'static str,
    pub(super) ok: bool,
    pub(super) detail: String,
}

pub(super) fn check(name: &'static str, ok: bool, detail: impl Into<String>) -> Check {
    Check {
        name,
        ok,
        detail: detail.into(),
    }
}

/// Moves each enqueue in doubt that did commit into the jobs the run must account for; one
/// that did not is as a request the platform's API refused.
pub(super) async fn settle_in_doubt(pool: &PgPool, rec: &mut Record) {
    let ids: Vec<Uuid> = rec.in_doubt.iter().map(|(id, _)| *id).collect();
    let committed: HashSet<Uuid> =
        sqlx::query_scalar("SELECT id FROM kfs_probe_jobs WHERE id = ANY($1)")
            .bind(&ids)
            .fetch_all(pool)
            .await
            .expect("look up the enqueues in doubt")
            .into_iter()
            .collect();
    rec.in_doubt_committed = committed.len();
    let found = rec.in_doubt.iter().filter(|(id, _)| committed.contains(id));
    rec.jobs.extend(found.copied());
}

/// Every channel close a consumer played: the process restarted that kind's consumer on a new
/// channel of the same connection (no reconnect in between) and consumed every kind again; and,
/// for the probe kind, whose jobs arrive all the time, it acked probe deliveries after that,
/// unless it died within 10 s or the run stopped enqueuing within 10 s.
fn channels_consumed_again(rec: &Record, cluster: &Cluster, acks: &[Ack]) -> Check {
    let mut bad = Vec::new();
    let mut played: BTreeMap<&str, u64> = BTreeMap::new();
    let mut acked_after = 0;
    let mut times: Vec<f64> = Vec::new();
    let margin = chrono::TimeDelta::seconds(10);
    for c in &rec.channel_closes {
        let Some(n) = c.played else { continue };
        *played.entry(c.kind).or_default() += 1;
        let text = std::fs::read_to_string(&c.log).unwrap_or_default();
        let Some(r) = consuming_again(&text, n) else {
            bad.push(format!("{} {}: never consuming again", c.process, c.kind));
            continue;
        };
        times.push(r.back_ms);
        if r.kind != c.kind || !r.restarted || r.reconnected {
            bad.push(format!(
                "{} {} (played on {}): restarted on the connection {}, reconnected {}",
                c.process, c.kind, r.kind, r.restarted, r.reconnected
            ));
            continue;
        }
        let back = DateTime::from_timestamp_micros(r.back_at_us).unwrap_or_default();
        let lived = cluster
            .ended
            .get(&c.process)
            .is_none_or(|end| *end > back + margin);
        let fed = rec.faults_ended.is_none_or(|end| end > back + margin);
        let after = acks
            .iter()
            .filter(|a| a.process == c.process && a.kind == c.kind && a.sent_at > r.back_at_us)
            .count();
        if after > 0 {
            acked_after += 1;
        } else if c.kind == Kind::Probe.name() && lived && fed {
            bad.push(format!(
                "{} {}: no ack of the kind after it consumed again",
                c.process, c.kind
            ));
        }
    }
    times.sort_by(f64::total_cmp);
    check(
        "a channel the broker closed is consumed again at once, on the same connection",
        bad.is_empty(),
        format!(
            "{} closes played ({} asked; by kind {played:?}), each kind consumed again on a new channel after \
             p50 {:.0} ms, max {:.0} ms; {acked_after} of them with acks of that kind after; \
             not so: {bad:?}",
            played.values().sum::<u64>(),
            rec.channel_closes.len(),
            percentile(&times, 0.5),
            times.last().copied().unwrap_or(f64::NAN)
        ),
    )
}

pub(super) async fn check_invariants(
    pool: &PgPool,
    rec: &Record,
    cluster: &Cluster,
    drained: bool,
    depths: (u32, u32),
) -> Vec<Check> {
    let mut out = Vec::new();
    let open = count(pool, "SELECT count(*) FROM kfs_probe_jobs WHERE run_state NOT IN ('succeeded', 'failed', 'canceled')").await;
    out.push(check(
        "all jobs terminal",
        drained && open == 0,
        format!("{open} not terminal"),
    ));

    let ids: Vec<Uuid> = rec.jobs.iter().map(|(id, _)| *id).collect();
    let wants: Vec<String> = rec.jobs.iter().map(|(_, w)| (*w).to_owned()).collect();
    let wrong: Vec<(Uuid, String, Option<String>)> = sqlx::query_as(
        "SELECT x.id, x.want, j.run_state::text FROM unnest($1::uuid[], $2::text[]) AS x(id, want) \
         LEFT JOIN kfs_probe_jobs j ON j.id = x.id WHERE j.run_state IS DISTINCT FROM x.want LIMIT 10",
    )
    .bind(&ids)
    .bind(&wants)
    .fetch_all(pool)
    .await
    .unwrap();
    let total = count(pool, "SELECT count(*) FROM kfs_probe_jobs").await;
    out.push(check(
        "no job lost; each ended as its behaviour calls for",
        wrong.is_empty() && total == ids.len() as i64,
        format!(
            "{} enqueued ({} of {} enqueues in doubt had committed), {total} in the database; \
             wrong or missing (job, want, got): {wrong:?}",
            ids.len(),
            rec.in_doubt_committed,
            rec.in_doubt.len()
        ),
    ));

    let bad: Vec<(Uuid, i32, i64)> = sqlx::query_as(
        "SELECT j.id, s.step, count(e.id) FROM kfs_probe_jobs j \
         CROSS JOIN LATERAL generate_series(1, j.steps_total) AS s(step) \
         LEFT JOIN kfs_probe_effects e ON e.job_id = j.id AND e.step = s.step \
         WHERE j.run_state = 'succeeded' GROUP BY 1, 2 HAVING count(e.id) <> 1 LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let stray = count(pool, "SELECT count(*) FROM kfs_probe_effects e JOIN kfs_probe_jobs j ON j.id = e.job_id WHERE j.run_state <> 'succeeded' OR e.step > j.steps_total").await;
    out.push(check(
        "each effect applied exactly once",
        bad.is_empty() && stray == 0,
        format!("(job, step, count) ≠ 1: {bad:?}; effects of failed jobs or past the last step: {stray}"),
    ));

    let gaps: Vec<(Uuid, i32, i64)> = sqlx::query_as(
        "SELECT job_id, step, rn FROM (SELECT job_id, step, row_number() OVER (PARTITION BY job_id ORDER BY id) AS rn \
         FROM kfs_probe_effects) x WHERE step <> rn LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    out.push(check(
        "progress sequences contiguous (effects 1, 2, 3, … in commit order)",
        gaps.is_empty(),
        format!("(job, step, position): {gaps:?}"),
    ));

    let back: Vec<(Uuid, String, String)> = sqlx::query_as(
        "SELECT job_id, old_cp, new_cp FROM chaos_checkpoints WHERE \
         (CASE WHEN old_cp = 'queued' THEN 0 WHEN old_cp = 'done' THEN 1000000 \
               WHEN old_cp ~ '^step-[0-9]+$' THEN substr(old_cp, 6)::int END) > \
         (CASE WHEN new_cp = 'queued' THEN 0 WHEN new_cp = 'done' THEN 1000000 \
               WHEN new_cp ~ '^step-[0-9]+$' THEN substr(new_cp, 6)::int ELSE -1 END) LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let changes = count(pool, "SELECT count(*) FROM chaos_checkpoints").await;
    out.push(check(
        "checkpoints never regressed",
        back.is_empty(),
        format!("{changes} checkpoint changes; backwards (job, from, to): {back:?}"),
    ));

    let unclaimed = count(
        pool,
        "SELECT count(*) FROM kfs_probe_effects e WHERE NOT EXISTS \
         (SELECT 1 FROM chaos_claims c WHERE c.job_id = e.job_id AND c.lease_token = e.lease_token)",
    )
    .await;
    let late: Vec<(Uuid, i32, String, String)> = sqlx::query_as(
        "SELECT e.job_id, e.step, e.worker_id, c2.worker_id FROM kfs_probe_effects e \
         JOIN chaos_claims c1 ON c1.job_id = e.job_id AND c1.lease_token = e.lease_token \
         JOIN chaos_claims c2 ON c2.job_id = e.job_id AND c2.id > c1.id AND c2.at <= e.created_at LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    out.push(check(
        "no write accepted from a fenced-out lease",
        unclaimed == 0 && late.is_empty(),
        format!("effects under a lease no claim issued: {unclaimed}; written after a newer lease began (job, step, writer, newer): {late:?}"),
    ));

    let (acks, _) = read_logs(cluster);
    out.push(acks_after_their_commits(pool, &acks).await);
    out.push(channels_consumed_again(rec, cluster, &acks));

    let outbox_open = count(pool, "SELECT count(*) FROM kfs_probe_outbox WHERE status NOT IN ('completed', 'dead', 'canceled')").await
        + platform::outbox_open(pool).await;
    out.push(check(
        "outbox settled",
        outbox_open == 0,
        format!("{outbox_open} outbox rows not settled"),
    ));
    out.push(check(
        "queues drained (job queue, dead letters)",
        depths == (0, 0),
        format!("depths {depths:?}"),
    ));
    for (name, ok, detail) in platform::checks(pool, &rec.platform).await {
        out.push(check(name, ok, detail));
    }
    if !rec.outage_cpu.is_empty() {
        out.push(check(
            "no busy loop during outages (each process < 25 % of a core)",
            rec.outage_cpu_ok,
            rec.outage_cpu.join("; "),
        ));
    }
    out
}
