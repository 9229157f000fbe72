//! The ack log and its verdict: every ack a worker logged follows the commit it rests on.

use super::*;

/// An `acked` line of a worker's ack log.
pub(super) struct Ack {
    /// The process that acked (its worker id, from its log's name).
    pub(super) process: String,
    pub(super) kind: String,
    pub(super) delivery_id: String,
    pub(super) claim: String,
    pub(super) end: String,
    /// When the ack left the worker, in microseconds since the epoch.
    pub(super) sent_at: i64,
}

pub(super) fn read_logs(cluster: &Cluster) -> (Vec<Ack>, BTreeMap<String, u64>) {
    let mut acks = Vec::new();
    let mut warnings: BTreeMap<String, u64> = BTreeMap::new();
    for path in &cluster.all_logs {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let process = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let field = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or("").to_owned();
            if field("message") == "acked" {
                acks.push(Ack {
                    process: process.clone(),
                    kind: field("kind"),
                    delivery_id: field("delivery_id"),
                    claim: field("claim"),
                    end: field("end"),
                    sent_at: v
                        .get("sent_at")
                        .and_then(serde_json::Value::as_i64)
                        .unwrap_or(0),
                });
            } else if matches!(field("level").as_str(), "WARN" | "ERROR") {
                *warnings.entry(field("message")).or_default() += 1;
            }
        }
    }
    (acks, warnings)
}

/// The outbox status the end of a slice writes, in the end's own transaction (`end_*` in
/// `src/engine/lease.rs`, and the group ends of `src/engine/lease/batched.rs`).
fn outbox_status_of_end(end: &str) -> Option<&'static str> {
    Some(match end {
        "succeeded" => "completed",
        "failed" => "dead",
        "canceled" | "superseded" => "canceled",
        "wait" | "continue" => "pending",
        _ => return None,
    })
}

/// Per ack: (its index, delivery id given to its row at (µs), the deciding commit found (µs),
/// whether that commit carries the delivery's own id, a newer id given to the row at (µs)).
type AckVerdict = (i64, Option<i64>, Option<i64>, Option<bool>, Option<i64>);

/// "No message acked before its commit", ack by ack, from the ack log and the observers. Commit
/// times come from `track_commit_timestamp` (on in this cluster); `sent_at` is when the ack
/// left the worker. What each ack must follow:
///
/// - Every ack, whatever its outcome: the relay's claim that gave the row this delivery id
///   (`dispatching` under it). It committed before the message was published; the run sends
///   no foreign messages.
/// - `claimed` with an end that decides the slice (succeeded, failed, canceled, superseded,
///   wait, continue): the commit that ended the very lease this delivery's claim issued. The
///   claim is found by the delivery id (its `leased` outbox write) and the lease token written
///   in the same transaction, by a holder of the acking process; the end is the transaction that
///   cleared that token, written by a session of the acking process, whose outbox write has the
///   status the end names (completed, dead, canceled, pending). That write carries the
///   delivery's own id, except when the relay published the row again while the slice ran (its
///   worker looked dead for a moment): the end then writes under the newer id, and the lease
///   is what ties it to this delivery (counted in the detail).
/// - `claimed` / `lease_lost`: no commit of its own: the slice was fenced out and wrote nothing
///   more; the job belongs to whoever holds it now. It must follow its claim (by the process).
/// - `exhausted`: the diagnosis failed the job in its own transaction, writing the row `dead`
///   (`fail_exhausted`): that write, by a session of the acking process, before the ack.
/// - `terminal`: the diagnosis settled the row of a job already ended (`settle`, `completed` /
///   `dead` / `canceled` under this delivery's id), or another copy of the same delivery did
///   first (the broker redelivers a delivery whose channel closed before its ack): a settling
///   write under this id before the ack. Exception: the diagnosis reads without locks, so the
///   relay may give the row a newer id between the diagnosis and the settle, which then writes
///   nothing; then that newer id, given before the ack, is what must be found.
/// - `duplicate`: no commit of its own (the diagnosis saw another live lease; re-arming the
///   row's due time writes only when it differs): a claim of the job before the ack.
/// - `stale`: no commit of its own (the delivery was replaced, its row settled or its job not
///   claimable; a re-arm at the retry time writes only sometimes): only the first rule.
pub(super) async fn acks_after_their_commits(pool: &PgPool, acks: &[Ack]) -> Check {
    let name = "no message acked before its commit";
    let want: Vec<String> = acks
        .iter()
        .map(|a| match a.claim.as_str() {
            "claimed" => outbox_status_of_end(&a.end).map_or(a.end.clone(), str::to_owned),
            _ => String::new(),
        })
        .collect();
    let verdicts: Vec<AckVerdict> = sqlx::query_as(
        "WITH a AS (SELECT (i - 1)::bigint AS i, p, d, claim, want, sent FROM \
           unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[]) WITH ORDINALITY \
           AS a(p, d, claim, want, sent, i)), \
         x AS (SELECT a.*, g.job, g.given_id, g.given_us FROM a LEFT JOIN LATERAL ( \
             SELECT r.job_id AS job, r.id AS given_id, chaos_us(r.xmin) AS given_us \
             FROM chaos_outbox r WHERE r.queue_job_id = a.d AND r.status = 'dispatching' \
             ORDER BY r.id LIMIT 1) g ON true) \
         SELECT x.i, x.given_us, v.committed, v.own, n.newer FROM x \
         LEFT JOIN LATERAL ( \
           SELECT chaos_us(o.xmin) AS committed, o.queue_job_id = x.d AS own \
           FROM chaos_outbox oc \
           JOIN chaos_claims c ON c.tx = oc.tx AND c.job_id = oc.job_id \
           JOIN chaos_ends e ON e.job_id = c.job_id AND e.lease_token = c.lease_token \
           JOIN chaos_outbox o ON o.tx = e.tx AND o.job_id = e.job_id \
           WHERE x.claim = 'claimed' AND x.want IN ('completed', 'dead', 'canceled', 'pending') \
             AND oc.queue_job_id = x.d AND oc.status = 'leased' \
             AND left(c.worker_id, length(x.p) + 1) = x.p || '#' \
             AND (e.writer = 'kfs-worker ' || x.p \
               OR left(e.writer, length(x.p) + 12) = 'kfs-worker ' || x.p || ' ') \
             AND o.status = x.want \
           UNION ALL \
           SELECT chaos_us(c.xmin), true FROM chaos_outbox oc \
           JOIN chaos_claims c ON c.tx = oc.tx AND c.job_id = oc.job_id \
           WHERE x.claim = 'claimed' AND x.want = 'lease_lost' \
             AND oc.queue_job_id = x.d AND oc.status = 'leased' \
             AND left(c.worker_id, length(x.p) + 1) = x.p || '#' \
           UNION ALL \
           SELECT chaos_us(o.xmin), o.queue_job_id = x.d FROM chaos_outbox o \
           WHERE x.claim = 'exhausted' AND o.job_id = x.job \
             AND o.status = 'dead' AND o.old_status <> 'dead' \
             AND (o.writer = 'kfs-worker ' || x.p \
               OR left(o.writer, length(x.p) + 12) = 'kfs-worker ' || x.p || ' ') \
           UNION ALL \
           SELECT chaos_us(o.xmin), true FROM chaos_outbox o \
           WHERE x.claim = 'terminal' AND o.job_id = x.job AND o.queue_job_id = x.d \
             AND o.status IN ('completed', 'dead', 'canceled') AND o.old_status <> o.status \
           UNION ALL \
           SELECT chaos_us(c.xmin), false FROM chaos_claims c \
           WHERE x.claim = 'duplicate' AND c.job_id = x.job \
           ORDER BY 1 LIMIT 1) v ON true \
         LEFT JOIN LATERAL ( \
           SELECT min(chaos_us(o.xmin)) AS newer FROM chaos_outbox o \
           WHERE x.claim = 'terminal' AND o.job_id = x.job AND o.status = 'dispatching' \
             AND o.id > x.given_id AND o.queue_job_id <> x.d) n ON true \
         ORDER BY x.i",
    )
    .bind(acks.iter().map(|a| a.process.clone()).collect::<Vec<_>>())
    .bind(
        acks.iter()
            .map(|a| a.delivery_id.clone())
            .collect::<Vec<_>>(),
    )
    .bind(acks.iter().map(|a| a.claim.clone()).collect::<Vec<_>>())
    .bind(&want)
    .bind(acks.iter().map(|a| a.sent_at).collect::<Vec<_>>())
    .fetch_all(pool)
    .await
    .unwrap();
    let mut bad = Vec::new();
    let mut by: BTreeMap<String, u64> = BTreeMap::new();
    let mut newer_id = 0u64;
    let mut terminal_raced = 0u64;
    for (i, given, committed, own, newer) in verdicts {
        let a = &acks[usize::try_from(i).expect("an index")];
        let before = |t: Option<i64>| t.is_some_and(|t| t <= a.sent_at);
        let decided = a.claim == "claimed" && outbox_status_of_end(&a.end).is_some();
        let ok = before(given)
            && a.sent_at > 0
            && match a.claim.as_str() {
                "claimed" if decided || a.end == "lease_lost" => before(committed),
                "exhausted" | "duplicate" => before(committed),
                "terminal" if before(committed) => true,
                "terminal" if before(newer) => {
                    terminal_raced += 1;
                    true
                }
                "stale" => true,
                _ => false,
            };
        if !ok {
            bad.push(format!(
                "{} {} {}/{} sent {} given {given:?} committed {committed:?}",
                a.process, a.delivery_id, a.claim, a.end, a.sent_at
            ));
            continue;
        }
        if decided && own == Some(false) {
            newer_id += 1;
        }
        let class = if decided {
            "decided a slice"
        } else {
            a.claim.as_str()
        };
        let class = if a.end == "lease_lost" {
            "lease_lost"
        } else {
            class
        };
        *by.entry(class.to_owned()).or_default() += 1;
    }
    let decided = by.get("decided a slice").copied().unwrap_or(0);
    let shown: Vec<&String> = bad.iter().take(10).collect();
    check(
        name,
        bad.is_empty() && decided > 0,
        format!(
            "{} acks logged, each after the commit it rests on ({by:?}): each that decided a slice \
             after the commit that ended the lease its own claim issued, by its process, with the \
             outbox status its end names ({newer_id} of them under a newer delivery id, the row \
             published again while the slice ran); each lease_lost after its claim, exhausted after \
             its dead row, terminal after its row settled under its id ({terminal_raced} after a \
             newer id instead), duplicate after a claim of its job; every delivery id given by a \
             relay before its ack. Not so ({} acks, the first 10: process, delivery, claim/end, \
             sent, id given, commit found, in µs): {shown:?}",
            acks.len(),
            bad.len()
        ),
    )
}
