//! The order in which the relay publishes: a bounded window, round-robin between tenants,
//! urgent rows first, per-tenant limits, and the indexes that keep the fair claim's cost flat.
//! These tests assert the order itself, never times. Compile jobs of two tenants on the
//! platform's own tables; a consumer's claim is played by moving a row to `leased`, as the
//! consumer's claim does, so each step frees exactly the room the test means.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use kfs_worker::jobs::compile::{self, RequestOptions};
use kfs_worker::jobs::Kind;
use kfs_worker::relay::window::{Size, Windows};
use kfs_worker::relay::{Relay, RelayConfig, Round};
use kfs_worker::tools::platform;
use lapin::options::{BasicGetOptions, QueuePurgeOptions};
use sqlx::PgPool;
use uuid::Uuid;

use crate::support::space::{SpaceFx, OWNER};

const HANG: Duration = Duration::from_secs(60);

/// Two tenants' spaces in one database: `tenant-a` (the fixture's) and `tenant-b`.
struct TwoTenants {
    fx: SpaceFx,
    b_space: Uuid,
}

impl TwoTenants {
    async fn new() -> TwoTenants {
        let fx = SpaceFx::new("tenant-a", "fair-a", "Fair A").await;
        let mut conn = fx.pool().acquire().await.unwrap();
        let b_space = platform::create_space(&mut conn, "tenant-b", "fair-b", "Fair B", OWNER)
            .await
            .unwrap();
        drop(conn);
        TwoTenants { fx, b_space }
    }

    fn pool(&self) -> &PgPool {
        self.fx.pool()
    }

    /// Uploads `n` documents to `tenant`'s space and commits their compile requests in one
    /// transaction, as a bulk upload does; returns the attempts in the order the relay takes a
    /// tenant's jobs: by `created_at`, then id (one transaction's rows share `created_at`).
    async fn commit_compiles(&self, tenant: &str, n: usize) -> Vec<Uuid> {
        let space = if tenant == "tenant-a" {
            self.fx.space
        } else {
            self.b_space
        };
        let mut docs = Vec::new();
        let mut conn = self.pool().acquire().await.unwrap();
        for i in 0..n {
            let body = format!("# {tenant} note {i}\n\nA line about leases and fencing {i}.\n");
            docs.push(
                platform::add_document(
                    &mut conn,
                    &self.fx.store,
                    space,
                    None,
                    &format!("{tenant}-{i}.md"),
                    "text/markdown",
                    Bytes::from(body),
                )
                .await
                .unwrap(),
            );
        }
        drop(conn);
        let mut tx = self.pool().begin().await.unwrap();
        let mut attempts = Vec::new();
        for doc in docs {
            attempts.push(
                compile::request(&mut tx, doc, RequestOptions::default())
                    .await
                    .unwrap(),
            );
        }
        tx.commit().await.unwrap();
        sqlx::query_scalar(
            "SELECT id FROM document_compilation_attempts WHERE id = ANY($1) ORDER BY created_at, id",
        )
        .bind(&attempts)
        .fetch_all(self.pool())
        .await
        .unwrap()
    }

    fn relay(&self, window: u32, limits: &[(Kind, u32)]) -> Relay {
        let cfg = RelayConfig {
            windows: Windows {
                default: Size::Fixed(window),
                per_kind: BTreeMap::new(),
            },
            tenant_limits: limits.iter().copied().collect(),
            ..RelayConfig::default()
        };
        Relay::new(
            self.pool().clone(),
            self.fx.env.topology.clone(),
            "relay-fair",
            cfg,
            &[Kind::Compile],
        )
    }

    /// Plays a consumer's claim of the oldest published row: it leaves the window.
    async fn claim_oldest(&self) {
        let n = sqlx::query(
            "UPDATE document_compilation_outbox SET status = 'leased', delivered_at = now(), \
               available_at = now() + interval '1 hour' \
             WHERE id = (SELECT id FROM document_compilation_outbox WHERE status = 'dispatched' \
                         ORDER BY updated_at, id LIMIT 1)",
        )
        .execute(self.pool())
        .await
        .unwrap()
        .rows_affected();
        assert_eq!(n, 1, "no published row to claim");
    }

    /// Rows of `tenant` published and not claimed, or running.
    async fn in_flight(&self, tenant: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM document_compilation_outbox o \
             JOIN document_compilation_attempts a ON a.id = o.attempt_id \
             WHERE a.tenant_id = $1 AND o.status IN ('dispatching', 'dispatched', 'leased')",
        )
        .bind(tenant)
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    /// The tenants of rows published since `since`, in the order the relay published them.
    async fn published_since(&self, since: &[Uuid]) -> Vec<(Uuid, String)> {
        sqlx::query_as(
            "SELECT a.id, a.tenant_id::text FROM document_compilation_outbox o \
             JOIN document_compilation_attempts a ON a.id = o.attempt_id \
             WHERE o.status <> 'pending' AND NOT (a.id = ANY($1)) ORDER BY o.updated_at, o.id",
        )
        .bind(since)
        .fetch_all(self.pool())
        .await
        .unwrap()
    }

    async fn cleanup(self) {
        self.fx.cleanup().await;
    }
}

async fn round(relay: &Relay, channel: &lapin::Channel) -> Round {
    tokio::time::timeout(HANG, relay.relay_once(channel, Kind::Compile))
        .await
        .expect("relay_once hung")
        .expect("relay_once failed")
}

/// Every attempt the relay has let out of Postgres so far.
async fn out_of_postgres(pool: &PgPool) -> Vec<Uuid> {
    sqlx::query_scalar(
        "SELECT attempt_id FROM document_compilation_outbox WHERE status <> 'pending'",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Tenant A's bulk upload fills the window; tenant B commits three compiles after it. From then
/// on each freed slot goes to the tenant after the one served last: B's three are published
/// in the next three turns, alternating with A, not after A's backlog.
#[tokio::test]
async fn a_second_tenants_jobs_are_published_within_one_round_robin_turn() {
    let t = TwoTenants::new().await;
    let a = t.commit_compiles("tenant-a", 12).await;
    let relay = t.relay(2, &[]);
    let ch = t.fx.env.confirm_channel().await;
    let first = round(&relay, &ch).await;
    assert_eq!(first.claimed, 2, "the window holds two messages: {first:?}");
    assert!(
        first.look_again,
        "a full window asks to look again once room is freed"
    );
    assert_eq!(t.in_flight("tenant-a").await, 2);
    let b = t.commit_compiles("tenant-b", 3).await;
    assert_eq!(
        round(&relay, &ch).await.claimed,
        0,
        "nothing is published while the window is full"
    );

    let before = out_of_postgres(t.pool()).await;
    for _ in 0..8 {
        t.claim_oldest().await;
        let r = round(&relay, &ch).await;
        assert_eq!(r.claimed, 1, "one slot freed, one row published: {r:?}");
    }
    let order: Vec<String> = t
        .published_since(&before)
        .await
        .into_iter()
        .map(|(_, tenant)| tenant)
        .collect();
    assert_eq!(
        order,
        [
            "tenant-b", "tenant-a", "tenant-b", "tenant-a", "tenant-b", "tenant-a", "tenant-a",
            "tenant-a"
        ],
        "freed slots go round-robin between the tenants with waiting work"
    );
    // Within each tenant, in commit order.
    let published = t.published_since(&before).await;
    let b_order: Vec<Uuid> = published
        .iter()
        .filter(|(_, tn)| tn == "tenant-b")
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(b_order, b, "a tenant's own jobs go oldest first");
    let a_order: Vec<Uuid> = published
        .iter()
        .filter(|(_, tn)| tn == "tenant-a")
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(a_order, a[2..7].to_vec());
    t.cleanup().await;
}

/// Rows due again (a job whose lease ran out, a retry that came due) go ahead of new work of
/// the same kind, even with the backlog of new work older than them.
#[tokio::test]
async fn taken_over_and_retried_rows_are_published_before_new_rows() {
    let t = TwoTenants::new().await;
    let a = t.commit_compiles("tenant-a", 6).await;
    let relay = t.relay(3, &[]);
    let ch = t.fx.env.confirm_channel().await;
    assert_eq!(round(&relay, &ch).await.claimed, 3);
    let queue = t.fx.env.topology.queue(Kind::Compile);
    ch.queue_purge(queue.as_str().into(), QueuePurgeOptions::default())
        .await
        .unwrap();
    // a[0]: its holder died and its lease ran out; a[1]: its retry came due; a[2]: running.
    for (attempt, set) in [
        (
            a[0],
            "status = 'leased', delivered_at = now() - interval '20 seconds', \
             available_at = now() - interval '1 second'",
        ),
        (
            a[1],
            "status = 'pending', delivered_at = now() - interval '20 seconds', \
             dispatch_attempts = 0, available_at = now() - interval '1 second'",
        ),
        (
            a[2],
            "status = 'leased', delivered_at = now(), available_at = now() + interval '1 hour'",
        ),
    ] {
        sqlx::query(&format!(
            "UPDATE document_compilation_outbox SET {set} WHERE attempt_id = $1"
        ))
        .bind(attempt)
        .execute(t.pool())
        .await
        .unwrap();
    }

    let r = round(&relay, &ch).await;
    assert_eq!(r.claimed, 3, "{r:?}");
    let mut order = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        let body: serde_json::Value = serde_json::from_slice(&m.delivery.data).unwrap();
        order.push(body["attemptId"].as_str().unwrap().parse::<Uuid>().unwrap());
    }
    assert_eq!(
        order,
        [a[0], a[1], a[3]],
        "the taken-over row, then the retry, then the oldest new row"
    );
    t.cleanup().await;
}

/// With `compile=2`, a tenant never has more than two compiles published or running: its
/// third waits in Postgres, other tenants go on, and it is published once one of its jobs ends.
#[tokio::test]
async fn a_tenant_at_its_limit_gets_nothing_more_until_one_of_its_jobs_ends() {
    let t = TwoTenants::new().await;
    let a = t.commit_compiles("tenant-a", 5).await;
    let _b = t.commit_compiles("tenant-b", 1).await;
    let relay = t.relay(10, &[(Kind::Compile, 2)]);
    let ch = t.fx.env.confirm_channel().await;
    let r = round(&relay, &ch).await;
    assert_eq!(
        (t.in_flight("tenant-a").await, t.in_flight("tenant-b").await),
        (2, 1),
        "{r:?}"
    );
    assert!(
        r.look_again,
        "a held tenant asks to look again when room is freed"
    );

    // Claimed by consumers: still running, so still counted.
    t.claim_oldest().await;
    t.claim_oldest().await;
    assert_eq!(
        round(&relay, &ch).await.claimed,
        0,
        "tenant-a is at its limit"
    );
    assert_eq!(t.in_flight("tenant-a").await, 2);

    // One of tenant-a's jobs ends.
    sqlx::query(
        "UPDATE document_compilation_outbox SET status = 'completed' \
         WHERE attempt_id = ANY($1) AND status = 'leased' \
           AND id = (SELECT id FROM document_compilation_outbox WHERE attempt_id = ANY($1) \
                     AND status = 'leased' ORDER BY id LIMIT 1)",
    )
    .bind(&a)
    .execute(t.pool())
    .await
    .unwrap();
    assert_eq!(
        round(&relay, &ch).await.claimed,
        1,
        "one ended, one more admitted"
    );
    assert_eq!(t.in_flight("tenant-a").await, 2);
    t.cleanup().await;
}

/// Makes `attempts` due retries, as a consumer leaves a job it will continue: the job `queued`
/// (out of the fair index), its outbox row `pending`, delivered before, due since `ago`.
async fn due_retries(pool: &PgPool, attempts: &[Uuid], ago: &str) {
    sqlx::query(
        "UPDATE document_compilation_attempts SET run_state = 'queued', row_version = row_version + 1 \
         WHERE id = ANY($1)",
    )
    .bind(attempts)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(&format!(
        "UPDATE document_compilation_outbox SET status = 'pending', dispatch_attempts = 1, \
           delivered_at = now() - interval '1 minute', available_at = now() - interval '{ago}' \
         WHERE attempt_id = ANY($1)"
    ))
    .bind(attempts)
    .execute(pool)
    .await
    .unwrap();
}

/// Makes `attempts` running: their rows `leased`, counted against their tenant's limit.
async fn running(pool: &PgPool, attempts: &[Uuid]) {
    sqlx::query(
        "UPDATE document_compilation_outbox SET status = 'leased', delivered_at = now(), \
           available_at = now() + interval '1 hour' WHERE attempt_id = ANY($1)",
    )
    .bind(attempts)
    .execute(pool)
    .await
    .unwrap();
}

/// Tenant A is at its limit (2 running) and has more due retries, older than anything else,
/// than a claim has room for; tenant B has one due retry. B's retry is published by the next
/// claim: A's retries, which cannot go, take none of its room.
#[tokio::test]
async fn a_held_tenants_due_retries_never_keep_another_tenants_retry_waiting() {
    let t = TwoTenants::new().await;
    let a = t.commit_compiles("tenant-a", 14).await;
    let b = t.commit_compiles("tenant-b", 1).await;
    running(t.pool(), &a[..2]).await;
    due_retries(t.pool(), &a[2..], "10 seconds").await;
    due_retries(t.pool(), &b, "1 second").await;
    // Room for 4: A's 12 due retries are three times that.
    let relay = t.relay(4, &[(Kind::Compile, 2)]);
    let ch = t.fx.env.confirm_channel().await;
    let r = round(&relay, &ch).await;
    let b_state: String =
        sqlx::query_scalar("SELECT status FROM document_compilation_outbox WHERE attempt_id = $1")
            .bind(b[0])
            .fetch_one(t.pool())
            .await
            .unwrap();
    assert_eq!(
        (b_state.as_str(), t.in_flight("tenant-a").await),
        ("dispatched", 2),
        "tenant-b's due retry is published by one claim while tenant-a, at its limit, gets nothing: {r:?}"
    );
    assert!(r.look_again, "a held tenant asks to look again: {r:?}");
    t.cleanup().await;
}

/// A relay-only `kfs-worker run` process of compile, named `id`, under `limits`, serving
/// `/metrics` on `http`.
fn relay_process(
    t: &TwoTenants,
    id: &str,
    http: std::net::SocketAddr,
    extra: &[(&str, &str)],
) -> crate::support::Worker {
    let http = http.to_string();
    let mut vars: Vec<(&str, &str)> = vec![
        ("KFS_OBJECT_STORE", t.fx.store_url.as_str()),
        ("KFS_HTTP_ADDR", http.as_str()),
    ];
    vars.extend_from_slice(extra);
    t.fx.env.spawn_worker(
        id,
        &["run", "--kinds", "compile", "--worker-id", id, "--relay"],
        &vars,
    )
}

/// The claims the relay process serving `/metrics` on `http` has made so far.
async fn claims(http: std::net::SocketAddr) -> Option<u64> {
    let (code, body) = crate::support::http_get(http, "/metrics").await;
    if code != 200 {
        return None;
    }
    Some(
        body.lines()
            .filter(|l| l.starts_with("kfs_relay_claims_total{") && l.contains("kind=\"compile\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64,
    )
}

/// While a tenant sits at its limit and nothing of it ends, a relay claims only now and then:
/// after waits that grow up to its poll (1 s), not every 50 ms for as long as the tenant is
/// held. Counted over 3 s of a relay process holding tenant-a (limit 1, three compiles, no
/// consumer to end any): a handful of claims, where polling every 50 ms made about sixty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_holding_a_tenant_at_its_limit_does_not_claim_every_50_ms() {
    let t = TwoTenants::new().await;
    t.commit_compiles("tenant-a", 3).await;
    let http = crate::support::free_port();
    let mut relay = relay_process(
        &t,
        "held-relay",
        http,
        &[("KFS_TENANT_LIMITS", "compile=1")],
    );
    let pool = t.pool().clone();
    let held =
        t.fx.env
            .wait_until(HANG, || {
                let pool = pool.clone();
                async move {
                    let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM document_compilation_outbox WHERE status = 'dispatched'",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                    n == 1 && claims(http).await.is_some()
                }
            })
            .await;
    assert!(
        held,
        "the relay never published tenant-a's first job\n{}",
        relay.tail(30)
    );
    // Let the first looks pass; then count.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = claims(http).await.expect("metrics");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = claims(http).await.expect("metrics");
    assert_eq!(t.in_flight("tenant-a").await, 1, "never over the limit");
    let made = after - before;
    assert!(
        made <= 12,
        "{made} claims in 3 s while tenant-a was held at its limit with nothing ending\n{}",
        relay.tail(10)
    );
    relay.kill();
    t.cleanup().await;
}

/// Two relay processes side by side (`KFS_RELAY_LEAD=all`) under `compile=2`, while the test
/// plays the consumers (claims a published row, ends a running one): at every sampled moment no
/// tenant has more than two compiles published or running, and both relays claimed rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relay_processes_never_admit_a_tenant_past_its_limit() {
    let t = TwoTenants::new().await;
    sqlx::raw_sql(
        "CREATE TABLE relay_claims (locked_by TEXT NOT NULL); \
         CREATE FUNCTION relay_claimed() RETURNS trigger LANGUAGE plpgsql AS $f$ \
         BEGIN INSERT INTO relay_claims VALUES (NEW.locked_by); RETURN NULL; END $f$; \
         CREATE TRIGGER relay_claimed AFTER UPDATE ON document_compilation_outbox FOR EACH ROW \
           WHEN (NEW.status = 'dispatching' AND OLD.status <> 'dispatching') \
           EXECUTE FUNCTION relay_claimed();",
    )
    .execute(t.pool())
    .await
    .unwrap();
    let vars = [
        ("KFS_TENANT_LIMITS", "compile=2"),
        ("KFS_RELAY_LEAD", "all"),
        ("KFS_RELAY_WINDOW", "8"),
        ("KFS_RELAY_POLL", "100ms"),
    ];
    let http = [crate::support::free_port(), crate::support::free_port()];
    let mut relays = [
        relay_process(&t, "limit-relay-1", http[0], &vars),
        relay_process(&t, "limit-relay-2", http[1], &vars),
    ];
    // Both relays claim rounds before the work is committed: the jobs are then shared between
    // two relays at work, not taken by whichever process started first (on a loaded machine
    // one start can outlast the whole run).
    let both_polling =
        t.fx.env
            .wait_until(Duration::from_secs(60), || async {
                claims(http[0]).await.is_some_and(|n| n >= 1)
                    && claims(http[1]).await.is_some_and(|n| n >= 1)
            })
            .await;
    assert!(
        both_polling,
        "the relays did not start\n{}\n{}",
        relays[0].tail(10),
        relays[1].tail(10)
    );
    t.commit_compiles("tenant-a", 12).await;
    t.commit_compiles("tenant-b", 12).await;
    let started = std::time::Instant::now();
    let mut samples = 0;
    loop {
        let busy: Vec<(String, i64)> = sqlx::query_as(
            "SELECT a.tenant_id::text, count(*) FROM document_compilation_outbox o \
             JOIN document_compilation_attempts a ON a.id = o.attempt_id \
             WHERE o.status IN ('dispatching', 'dispatched', 'leased') GROUP BY 1",
        )
        .fetch_all(t.pool())
        .await
        .unwrap();
        samples += 1;
        assert!(
            busy.iter().all(|(_, n)| *n <= 2),
            "a tenant past its limit of 2: {busy:?}"
        );
        let done: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM document_compilation_outbox WHERE status = 'completed'",
        )
        .fetch_one(t.pool())
        .await
        .unwrap();
        if done == 24 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{done} of 24 ended\n{}\n{}",
            relays[0].tail(10),
            relays[1].tail(10)
        );
        // A consumer ends a running job, and claims a published one.
        sqlx::query(
            "UPDATE document_compilation_outbox SET status = 'completed' WHERE id = \
               (SELECT id FROM document_compilation_outbox WHERE status = 'leased' ORDER BY updated_at LIMIT 1)",
        )
        .execute(t.pool())
        .await
        .unwrap();
        sqlx::query(
            "UPDATE document_compilation_outbox SET status = 'leased', delivered_at = now(), \
               available_at = now() + interval '1 hour' WHERE id = \
               (SELECT id FROM document_compilation_outbox WHERE status = 'dispatched' \
                ORDER BY updated_at LIMIT 1 FOR UPDATE SKIP LOCKED)",
        )
        .execute(t.pool())
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let by: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT split_part(locked_by, '#', 1) FROM relay_claims ORDER BY 1",
    )
    .fetch_all(t.pool())
    .await
    .unwrap();
    assert_eq!(
        by,
        ["limit-relay-1", "limit-relay-2"],
        "both relays claimed ({samples} samples)"
    );
    for r in &mut relays {
        r.kill();
    }
    t.cleanup().await;
}

/// `migrate` builds the relay's indexes outside any transaction (concurrently), leaves valid
/// ones alone, and rebuilds one an interrupted build left invalid.
#[tokio::test]
async fn migrate_builds_the_fair_claims_indexes_and_rebuilds_an_invalid_one() {
    let env = crate::support::TestEnv::new().await;
    let valid: Vec<(String, bool)> = sqlx::query_as(
        "SELECT c.relname::text, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
         WHERE c.relname = ANY($1) ORDER BY 1",
    )
    .bind(
        kfs_worker::db::indexes::OWN_INDEXES
            .iter()
            .map(|i| i.name)
            .collect::<Vec<_>>(),
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        valid.len(),
        kfs_worker::db::indexes::OWN_INDEXES.len(),
        "{valid:?}"
    );
    assert!(valid.iter().all(|(_, v)| *v), "{valid:?}");

    let again = kfs_worker::db::migrate(&env.pool).await.unwrap();
    assert!(
        again.indexes.created.is_empty() && again.indexes.rebuilt.is_empty(),
        "{again:?}"
    );

    // What a build killed halfway leaves: the index exists and is not valid.
    sqlx::query(
        "UPDATE pg_index SET indisvalid = false \
         WHERE indexrelid = 'kfs_document_compilation_attempts_fair_idx'::regclass",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    let repaired = kfs_worker::db::migrate(&env.pool).await.unwrap();
    assert_eq!(
        repaired.indexes.rebuilt,
        ["kfs_document_compilation_attempts_fair_idx"]
    );
    let ok: bool = sqlx::query_scalar(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = 'kfs_document_compilation_attempts_fair_idx'::regclass",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert!(ok);
    env.cleanup().await;
}

/// The KEDA ScaledObject scales on the backlog in Postgres: each of its queries runs on the
/// platform's tables and counts what `status` (and `kfs_backlog` on /metrics) reports for the
/// kind, with the tenants named.
#[tokio::test]
async fn the_keda_queries_count_the_backlog_that_status_reports_by_tenant() {
    let t = TwoTenants::new().await;
    t.commit_compiles("tenant-a", 3).await;
    t.commit_compiles("tenant-b", 1).await;
    let yaml = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ops/deploy/kubernetes/keda.yaml"),
    )
    .unwrap();
    let queries: Vec<&str> = yaml
        .lines()
        .filter_map(|l| l.trim().strip_prefix("query: "))
        .map(|q| q.trim_matches('"'))
        .collect();
    assert_eq!(queries.len(), 3, "one trigger per platform kind: {yaml}");
    let status = kfs_worker::status::read(t.pool(), &Kind::platform())
        .await
        .unwrap();
    for q in queries {
        let n: i64 = sqlx::query_scalar(q).fetch_one(t.pool()).await.unwrap();
        let kind = if q.contains("document_compilation_outbox") {
            "compile"
        } else if q.contains("deletion_outbox") {
            "deletion"
        } else {
            "research"
        };
        let ks = status.kinds.iter().find(|k| k.kind == kind).unwrap();
        assert_eq!(n, ks.backlog, "{kind}: {q}");
    }
    let compile = status.kinds.iter().find(|k| k.kind == "compile").unwrap();
    assert_eq!(compile.backlog, 4);
    assert_eq!(compile.backlog_tenants, 2);
    assert_eq!(
        compile.top_tenants,
        [("tenant-a".to_owned(), 3), ("tenant-b".to_owned(), 1)]
    );
    t.cleanup().await;
}

/// A kind whose jobs have tenants lists its two indexes in `db::indexes` (the part of its
/// migration built online): the `fair` one over exactly its spec's "never dispatched"
/// predicate, which the claim's loose index scan needs, and the `urgent` one on its outbox.
#[test]
fn every_kind_with_tenants_has_its_fair_and_urgent_indexes() {
    use kfs_worker::db::indexes::{OWN_INDEXES, URGENT_ROW};
    let mut checked = 0;
    for kind in Kind::all() {
        let spec = kind.spec();
        let Some(fairness) = &spec.fairness else {
            continue;
        };
        let fair = OWN_INDEXES
            .iter()
            .find(|i| i.name == format!("kfs_{}_fair_idx", spec.job_table))
            .unwrap_or_else(|| panic!("{kind}: no fair index"));
        assert_eq!(fair.table, spec.job_table);
        assert_eq!(
            fair.definition,
            format!(
                "(tenant_id, created_at, id) WHERE {}",
                fairness.fresh.replace("j.", "")
            ),
            "{kind}"
        );
        let urgent = OWN_INDEXES
            .iter()
            .find(|i| i.name == format!("kfs_{}_urgent_idx", spec.outbox_table))
            .unwrap_or_else(|| panic!("{kind}: no urgent index"));
        assert_eq!(urgent.table, spec.outbox_table);
        assert!(
            urgent
                .definition
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
                == format!("(available_at, id) WHERE status = 'pending' AND {URGENT_ROW}"),
            "{kind}: {}",
            urgent.definition
        );
        checked += 1;
    }
    assert_eq!(checked, 3, "compile, deletion and research have tenants");
}

/// Shared buffers the whole plan of an `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)` touched.
fn buffers(plan: &serde_json::Value) -> i64 {
    let top = &plan[0]["Plan"];
    top["Shared Hit Blocks"].as_i64().unwrap_or(0) + top["Shared Read Blocks"].as_i64().unwrap_or(0)
}

/// Adds `n` copies of the new attempt `template` of a tenant, each on a document of its own,
/// its outbox row due or deferred as the template's.
async fn clone_attempt(pool: &PgPool, template: Uuid, n: i64) {
    let mut conn = pool.acquire().await.unwrap();
    let doc: Uuid = sqlx::query_scalar(
        "SELECT document_asset_id FROM document_compilation_attempts WHERE id = $1",
    )
    .bind(template)
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    for sql in [
        "CREATE TEMP TABLE td AS SELECT d.*, g AS n FROM document_assets d, generate_series(1, $2::int) g \
         WHERE d.id = $1",
        "UPDATE td SET id = gen_random_uuid()",
        "CREATE TEMP TABLE ta AS SELECT a.*, td.id AS new_doc FROM document_compilation_attempts a, td \
         WHERE a.id = $3",
        "UPDATE ta SET id = gen_random_uuid(), publication_generation_id = gen_random_uuid(), \
           document_asset_id = new_doc",
        "CREATE TEMP TABLE tob AS SELECT o.*, ta.id AS new_attempt FROM document_compilation_outbox o, ta \
         WHERE o.attempt_id = $3",
        "UPDATE tob SET id = gen_random_uuid(), attempt_id = new_attempt, \
           idempotency_key = 'document.compile:' || new_attempt::text, \
           payload = jsonb_build_object('attemptId', new_attempt::text)",
        "ALTER TABLE td DROP COLUMN n",
        "ALTER TABLE ta DROP COLUMN new_doc",
        "ALTER TABLE tob DROP COLUMN new_attempt",
        "INSERT INTO document_assets SELECT * FROM td",
        "INSERT INTO document_compilation_attempts SELECT * FROM ta",
        "INSERT INTO document_compilation_outbox SELECT * FROM tob",
        "DROP TABLE td, ta, tob",
        "ANALYZE document_assets",
        "ANALYZE document_compilation_attempts",
        "ANALYZE document_compilation_outbox",
    ] {
        let mut q = sqlx::query(sql);
        if sql.contains("$1") {
            q = q.bind(doc).bind(i32::try_from(n).unwrap());
        } else if sql.contains("$3") {
            // Only `$3` is used: the other two are bound for its position.
            q = q.bind(doc).bind(0i32).bind(template);
        }
        q.execute(&mut *conn).await.unwrap();
    }
}

/// Compiles whose dispatch is deferred (held until their upload ends, their outbox row due in
/// 9999) sit among a tenant's never-dispatched jobs in the fair index, which cannot see the
/// outbox. The round-robin looks at a bounded number of each tenant's oldest jobs, so a claim
/// costs the same with 2,000 deferred compiles as with 20,000, and the other tenant's work is
/// still what it claims.
#[tokio::test]
async fn a_claims_cost_does_not_grow_with_a_tenants_deferred_compiles() {
    let t = TwoTenants::new().await;
    // tenant-b's bulk upload: a backlog of due compiles.
    let b = t.commit_compiles("tenant-b", 1).await;
    clone_attempt(t.pool(), b[0], 4_999).await;
    let mut conn = t.pool().acquire().await.unwrap();
    let doc = platform::add_document(
        &mut conn,
        &t.fx.store,
        t.fx.space,
        None,
        "deferred.md",
        "text/markdown",
        Bytes::from("# Deferred\n\nStill uploading.\n"),
    )
    .await
    .unwrap();
    let template = compile::request(
        &mut conn,
        doc,
        RequestOptions {
            defer: true,
            ..RequestOptions::default()
        },
    )
    .await
    .unwrap();
    drop(conn);
    let relay = t.relay(64, &[]);
    let mut costs = Vec::new();
    for (deferred, add) in [(1, 0), (2_000, 1_999), (20_000, 18_000)] {
        if add > 0 {
            clone_attempt(t.pool(), template, add).await;
        }
        for generic in [false, true] {
            let plan = relay.explain_claim(Kind::Compile, generic).await.unwrap();
            costs.push((
                deferred,
                generic,
                buffers(&plan),
                plan[0]["Execution Time"].clone(),
            ));
        }
    }
    println!(
        "[fair claim] (deferred compiles of tenant-a, generic plan, shared buffers, ms): {costs:?}"
    );
    for generic in [false, true] {
        let at = |d: i64| {
            costs
                .iter()
                .find(|c| c.0 == d && c.1 == generic)
                .map(|c| c.2)
                .unwrap()
        };
        let (at_2k, at_20k) = (at(2_000), at(20_000));
        assert!(
            at_20k <= at_2k + at_2k / 5 + 50,
            "the claim's cost grows with a tenant's deferred compiles (generic plan: {generic}): \
             {costs:?}"
        );
    }
    // Nothing was claimed by the explained claims, and the relay still publishes tenant-b's.
    let channel = t.fx.env.channel().await;
    let got = round(&relay, &channel).await;
    assert!(got.claimed > 0, "{got:?}");
    t.cleanup().await;
}
