//! The HTTP surface of a running worker: health, readiness and metrics that move when their
//! events happen.

use std::time::Duration;

use kfs_worker::consumer::ConsumerConfig;
use kfs_worker::jobs::probe::{self, ProbeSpec};
use kfs_worker::jobs::Kind;
use kfs_worker::maintenance::MaintenanceConfig;
use kfs_worker::relay::RelayConfig;
use kfs_worker::runtime::{self, RunOptions};
use kfs_worker::wire::OutboundMessage;
use tokio_util::sync::CancellationToken;

use crate::support::{self, free_port, http_get as get, TestEnv};

/// The value of the first sample line of `metric` whose labels contain all of `labels`.
fn sample(body: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    body.lines()
        .filter(|l| l.starts_with(metric) && !l.starts_with('#'))
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

/// A whole worker (relay, consumer, maintenance) of the probe kind, serving HTTP on `addr`.
fn options(env: &TestEnv, worker: &str, addr: std::net::SocketAddr) -> RunOptions {
    RunOptions {
        services: env.services(),
        object_store: kfs_worker::config::object_store("memory://").unwrap(),
        worker_id: worker.into(),
        kinds: vec![Kind::Probe],
        relay: true,
        consumer: true,
        maintenance: true,
        leased: None,
        relay_cfg: RelayConfig {
            poll: Duration::from_millis(200),
            ..RelayConfig::default()
        },
        consumer_cfg: ConsumerConfig::default(),
        maintenance_cfg: MaintenanceConfig::default(),
        http_addr: Some(addr),
        admin_token: None,
        embedder: kfs_worker::embed::EmbedderConfig::Offline,
        reasoner: Default::default(),
        parser: Default::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn health_readiness_and_metrics_follow_the_work() {
    let env = TestEnv::new().await;
    let addr = free_port();
    let shutdown = CancellationToken::new();
    let opts = options(&env, "http-test", addr);
    let worker = tokio::spawn(runtime::run(opts, shutdown.clone()));

    let ready = env
        .wait_until(Duration::from_secs(20), || async {
            get(addr, "/readyz").await.0 == 200
        })
        .await;
    assert!(ready, "readyz: {:?}", get(addr, "/readyz").await);
    assert_eq!(get(addr, "/healthz").await, (200, "ok\n".to_owned()));
    let (_, ready_body) = get(addr, "/readyz").await;
    assert!(
        ready_body.contains("postgres: ok") && ready_body.contains("rabbitmq: ok"),
        "{ready_body}"
    );

    let (_, before) = get(addr, "/metrics").await;
    let claimed_before = sample(
        &before,
        "kfs_deliveries_total",
        &["kind=\"probe\"", "outcome=\"claimed\""],
    )
    .unwrap_or(0.0);

    probe::enqueue_many(
        &env.pool,
        20,
        &ProbeSpec {
            steps: 2,
            ..ProbeSpec::default()
        },
    )
    .await
    .unwrap();
    let done = env.wait_probe_succeeded(20, Duration::from_secs(30)).await;
    assert!(done);

    let (code, after) = get(addr, "/metrics").await;
    assert_eq!(code, 200);
    let claimed = sample(
        &after,
        "kfs_deliveries_total",
        &["kind=\"probe\"", "outcome=\"claimed\""],
    )
    .unwrap_or(0.0);
    assert!(
        claimed >= claimed_before + 20.0,
        "claimed {claimed_before} -> {claimed}\n{after}"
    );
    assert!(
        sample(
            &after,
            "kfs_slices_total",
            &["kind=\"probe\"", "end=\"succeeded\""]
        )
        .unwrap_or(0.0)
            >= 20.0
    );
    assert!(
        sample(
            &after,
            "kfs_relay_messages_total",
            &["kind=\"probe\"", "result=\"confirmed\""]
        )
        .unwrap_or(0.0)
            >= 20.0
    );
    assert_eq!(
        sample(
            &after,
            "kfs_jobs",
            &["kind=\"probe\"", "state=\"succeeded\""]
        ),
        Some(20.0),
        "{after}"
    );
    assert_eq!(
        sample(
            &after,
            "kfs_outbox_rows",
            &["kind=\"probe\"", "status=\"completed\""]
        ),
        Some(20.0)
    );
    assert!(
        after.contains("kfs_slice_duration_seconds_bucket"),
        "histogram present"
    );
    assert!(
        after.contains("kfs_relay_lag_seconds{kind=\"probe\"} 0"),
        "{after}"
    );
    assert!(!after.contains("guest"), "no credentials in metrics");

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(20), worker)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    env.cleanup().await;
}

/// A message for `job` as the relay would publish it, under delivery id `delivery`.
fn probe_message(job: uuid::Uuid, outbox: uuid::Uuid, delivery: &str) -> OutboundMessage {
    OutboundMessage {
        kind: Kind::Probe,
        event_type: Kind::Probe.event_type(),
        outbox_id: outbox,
        job_id: job,
        delivery_id: delivery.to_owned(),
        revision: 1,
        schema_version: 1,
        traceparent: None,
        body: serde_json::to_vec(&serde_json::json!({ "probeJobId": job })).unwrap(),
    }
}

async fn publish(env: &TestEnv, props: lapin::BasicProperties, body: &[u8]) {
    env.confirm_channel()
        .await
        .basic_publish(
            env.topology.exchange().as_str().into(),
            Kind::Probe.event_type().into(),
            lapin::options::BasicPublishOptions::default(),
            body,
            props,
        )
        .await
        .unwrap()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_delivery_outcome_retry_takeover_and_dead_letter_moves_its_metric() {
    let env = TestEnv::new().await;
    // A job its holder never finished: leased for ten minutes by a worker that is gone, whose
    // last heartbeat was three seconds ago.
    let (gone_job, _) = support::enqueue_one(&env.pool, &ProbeSpec::default()).await;
    sqlx::query(
        "UPDATE kfs_probe_jobs SET run_state = 'running', worker_id = 'gone', lease_token = gen_random_uuid(), \
           lease_expires_at = now() + interval '10 minutes', heartbeat_at = now() - interval '3 seconds', \
           execution_attempts = 1 WHERE id = $1",
    )
    .bind(gone_job)
    .execute(&env.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE kfs_probe_outbox SET status = 'leased', queue_job_id = 'gone-' || id, \
           available_at = now() + interval '10 minutes' WHERE probe_job_id = $1",
    )
    .bind(gone_job)
    .execute(&env.pool)
    .await
    .unwrap();

    let addr = free_port();
    let shutdown = CancellationToken::new();
    let opts = options(&env, "metrics-test", addr);
    let worker = tokio::spawn(runtime::run(opts, shutdown.clone()));
    assert!(
        env.wait_until(Duration::from_secs(20), || async {
            get(addr, "/readyz").await.0 == 200
        })
        .await
    );
    let metric = |body: &str, name: &str, labels: &[&str]| sample(body, name, labels);
    let (_, before) = get(addr, "/metrics").await;
    let count = |body: &str, name: &str, extra: &[&str]| {
        let mut l = vec!["kind=\"probe\""];
        l.extend_from_slice(extra);
        metric(body, name, &l).unwrap_or(0.0)
    };

    // Takeover: the sweep makes the dead holder's job due, the relay publishes it again and
    // the claim takes it over.
    let pool = env.pool.clone();
    let state_of = |job: uuid::Uuid| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT run_state::text FROM kfs_probe_jobs WHERE id = $1",
            )
            .bind(job)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert!(
        env.wait_until(Duration::from_secs(30), || async {
            state_of(gone_job).await == "succeeded"
        })
        .await
    );

    // A retry: the first attempt fails with a retryable error.
    let (retried, _) = support::enqueue_one(
        &env.pool,
        &ProbeSpec {
            fail_mode: "retry_once",
            ..ProbeSpec::default()
        },
    )
    .await;
    // A long job, to receive a duplicate of its delivery while it runs, and a stale one.
    let (slow, slow_outbox) = support::enqueue_one(
        &env.pool,
        &ProbeSpec {
            steps: 1,
            step_sleep: Duration::from_secs(3),
            ..ProbeSpec::default()
        },
    )
    .await;
    let delivery = {
        let pool = env.pool.clone();
        let mut d = None;
        for _ in 0..100 {
            d = sqlx::query_scalar::<_, Option<String>>(
                "SELECT queue_job_id FROM kfs_probe_outbox WHERE id = $1 AND status = 'leased'",
            )
            .bind(slow_outbox)
            .fetch_optional(&pool)
            .await
            .unwrap()
            .flatten();
            if d.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        d.expect("the slow job is claimed")
    };
    let dup = probe_message(slow, slow_outbox, &delivery);
    publish(&env, dup.properties(), &dup.body).await;
    let stale = probe_message(slow, slow_outbox, "an-older-delivery");
    publish(&env, stale.properties(), &stale.body).await;
    // Poison: nothing a consumer can decode.
    publish(&env, lapin::BasicProperties::default(), b"not json").await;

    for job in [retried, slow] {
        assert!(
            env.wait_until(Duration::from_secs(30), || async {
                state_of(job).await == "succeeded"
            })
            .await
        );
    }
    let dlq = env.topology.dead_letter_queue();
    assert!(
        env.wait_until(Duration::from_secs(10), || async {
            env.queue_depth(&dlq).await == 1
        })
        .await
    );

    let (_, after) = get(addr, "/metrics").await;
    let moved =
        |name: &str, extra: &[&str]| count(&after, name, extra) - count(&before, name, extra);
    assert!(moved("kfs_takeovers_total", &[]) >= 1.0, "{after}");
    assert!(moved("kfs_takeover_seconds_count", &[]) >= 1.0, "{after}");
    assert!(
        count(&after, "kfs_takeover_seconds_sum", &[]) >= 3.0,
        "time to take over counts from the holder's last heartbeat: {after}"
    );
    assert!(moved("kfs_retries_total", &[]) >= 1.0, "{after}");
    assert!(moved("kfs_attempts_total", &[]) >= 4.0, "{after}");
    assert!(moved("kfs_attempt_number_count", &[]) >= 4.0, "{after}");
    for outcome in ["claimed", "duplicate", "stale", "poison"] {
        let o = format!("outcome=\"{outcome}\"");
        assert!(
            moved("kfs_deliveries_total", &[&o]) >= 1.0,
            "{outcome}: {after}"
        );
    }
    assert!(
        moved("kfs_relay_publish_seconds_count", &[]) >= 1.0,
        "{after}"
    );
    assert!(
        moved("kfs_relay_confirm_seconds_count", &[]) >= 1.0,
        "{after}"
    );
    assert_eq!(
        metric(&after, "kfs_dead_letters", &[]),
        Some(1.0),
        "{after}"
    );

    // The Grafana dashboard shipped in ops/ charts only metrics the worker really exports.
    let dashboard = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ops/deploy/grafana/kfs-worker.json"),
    )
    .unwrap();
    let _: serde_json::Value = serde_json::from_str(&dashboard).expect("dashboard JSON");
    let mut charted: Vec<&str> = dashboard
        .match_indices("kfs_")
        .map(|(i, _)| {
            let rest = &dashboard[i..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            &rest[..end]
        })
        .filter(|m| *m != "kfs_")
        .collect();
    charted.sort_unstable();
    charted.dedup();
    assert!(charted.len() >= 10, "{charted:?}");
    for m in charted {
        assert!(
            after.lines().any(|l| l.starts_with(m)),
            "the dashboard charts {m}, which /metrics does not export:\n{after}"
        );
    }

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(20), worker)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    env.cleanup().await;
}

/// Every sample line of `body` named exactly `metric` (a histogram's `_count` is its own name).
fn samples<'a>(body: &'a str, metric: &str) -> Vec<&'a str> {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(metric)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .collect()
}

/// A worker process of this test's environment serving HTTP on a port of its own; its
/// `/metrics` once it is ready.
async fn spawn_and_scrape(
    env: &TestEnv,
    name: &str,
    args: &[&str],
) -> (support::Worker, std::net::SocketAddr, String) {
    let addr = free_port();
    let bind = addr.to_string();
    let worker = env.spawn_worker(name, args, &[("KFS_HTTP_ADDR", &bind)]);
    assert!(
        env.wait_until(Duration::from_secs(30), || async {
            get(addr, "/readyz").await.0 == 200
        })
        .await,
        "the worker never became ready"
    );
    let (code, body) = get(addr, "/metrics").await;
    assert_eq!(code, 200, "{body}");
    (worker, addr, body)
}

/// Prometheus users alert on series and take `rate()` of counters: both need each series to
/// exist before its first event. A fresh worker, before any job, exports every metric with every
/// known label value of each kind it serves, at zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fresh_worker_exports_every_series_at_zero_with_its_known_labels() {
    let env = TestEnv::new().await;
    let (mut worker, _, body) = spawn_and_scrape(&env, "fresh", &["run"]).await;

    let zero = |metric: &str, labels: &[String]| {
        let found: Vec<&str> = samples(&body, metric)
            .into_iter()
            .filter(|l| labels.iter().all(|x| l.contains(x.as_str())))
            .collect();
        assert_eq!(
            found.len(),
            1,
            "{metric} {labels:?} should be exported exactly once:\n{body}"
        );
        assert!(
            found[0].ends_with(" 0"),
            "{metric} {labels:?} should start at zero: {}",
            found[0]
        );
    };
    let kinds = Kind::platform();
    assert_eq!(kinds.len(), 3);
    for kind in &kinds {
        let k = format!("kind=\"{}\"", kind.name());
        for outcome in kfs_worker::metrics::DELIVERY_OUTCOMES {
            zero(
                "kfs_deliveries_total",
                &[k.clone(), format!("outcome=\"{outcome}\"")],
            );
        }
        for end in kfs_worker::metrics::SLICE_ENDS {
            zero("kfs_slices_total", &[k.clone(), format!("end=\"{end}\"")]);
        }
        for result in kfs_worker::metrics::RELAY_RESULTS {
            zero(
                "kfs_relay_messages_total",
                &[k.clone(), format!("result=\"{result}\"")],
            );
        }
        for state in kind.spec().job_states() {
            zero("kfs_jobs", &[k.clone(), format!("state=\"{state}\"")]);
        }
        for status in kfs_worker::engine::kind::OUTBOX_STATUSES {
            zero(
                "kfs_outbox_rows",
                &[k.clone(), format!("status=\"{status}\"")],
            );
        }
        for counter in [
            "kfs_retries_total",
            "kfs_attempts_total",
            "kfs_takeovers_total",
            "kfs_relay_lag_seconds",
            "kfs_queue_messages",
            "kfs_slice_duration_seconds_count",
            "kfs_attempt_number_count",
            "kfs_takeover_seconds_count",
            "kfs_relay_publish_seconds_count",
            "kfs_relay_confirm_seconds_count",
        ] {
            zero(counter, std::slice::from_ref(&k));
        }
    }
    // The leased kinds run by default: their counters, and their gauges by state and checkpoint.
    for lk in kfs_worker::jobs::leased_kinds() {
        let k = format!("kind=\"{}\"", lk.name());
        for state in lk.states() {
            zero("kfs_jobs", &[k.clone(), format!("state=\"{state}\"")]);
        }
        for cp in lk.checkpoints() {
            zero(
                "kfs_leased_checkpoints",
                &[k.clone(), format!("checkpoint=\"{cp}\"")],
            );
        }
        for end in kfs_worker::metrics::SLICE_ENDS {
            zero("kfs_slices_total", &[k.clone(), format!("end=\"{end}\"")]);
        }
        zero("kfs_attempts_total", std::slice::from_ref(&k));
    }
    zero("kfs_dead_letters", &[]);
    // Each metric says what it is.
    for help in [
        "kfs_deliveries_total",
        "kfs_jobs",
        "kfs_slice_duration_seconds",
    ] {
        assert!(
            body.lines()
                .any(|l| l.starts_with(&format!("# HELP {help} "))),
            "{help} has no HELP line:\n{body}"
        );
    }
    worker.signal("TERM");
    assert!(worker.exited(Duration::from_secs(30)).await.is_some());
    env.cleanup().await;
}

/// The job gauges are read at scrape time, and a read returns only the states that have rows:
/// once the last running job ends, `kfs_jobs{state="running"}` reads zero, not the one it read
/// while the job ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_gauge_whose_state_emptied_reads_zero() {
    let env = TestEnv::new().await;
    let (mut worker, addr, _) =
        spawn_and_scrape(&env, "gauges", &["run", "--kinds", "probe"]).await;
    let running = || async {
        let (_, body) = get(addr, "/metrics").await;
        sample(&body, "kfs_jobs", &["kind=\"probe\"", "state=\"running\""])
    };
    assert_eq!(running().await, Some(0.0));
    let (job, _) = support::enqueue_one(
        &env.pool,
        &ProbeSpec {
            steps: 1,
            step_sleep: Duration::from_secs(3),
            ..ProbeSpec::default()
        },
    )
    .await;
    assert!(
        env.wait_until(Duration::from_secs(20), || async {
            running().await == Some(1.0)
        })
        .await,
        "the running job shows in the gauge"
    );
    assert!(
        env.wait_probe_succeeded(1, Duration::from_secs(30)).await,
        "job {job}"
    );
    assert_eq!(running().await, Some(0.0), "no job runs any more");
    worker.signal("TERM");
    assert!(worker.exited(Duration::from_secs(30)).await.is_some());
    env.cleanup().await;
}

/// The values of `column` that the CHECK constraint of `table` allows, read from the database.
async fn allowed(pool: &sqlx::PgPool, table: &str, column: &str) -> Vec<String> {
    let defs: Vec<String> = sqlx::query_scalar(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint \
         WHERE contype = 'c' AND conrelid = $1::regclass \
           AND pg_get_constraintdef(oid) LIKE '%(' || $2 || ')::text = ANY%' \
           AND pg_get_constraintdef(oid) NOT LIKE '% AND %' AND pg_get_constraintdef(oid) NOT LIKE '% OR %'",
    )
    .bind(table)
    .bind(column)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(defs.len(), 1, "{table}.{column}: {defs:?}");
    defs[0]
        .split('\'')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The label values the metrics start at zero are exactly the states each table allows: a state
/// missing from the list would have no series until its first row, one too many a series that
/// can never move.
#[tokio::test]
async fn the_known_states_are_exactly_those_each_table_allows() {
    let env = TestEnv::new().await;
    let sorted = |v: &[&str]| {
        let mut v: Vec<String> = v.iter().map(|s| (*s).to_owned()).collect();
        v.sort();
        v
    };
    for kind in Kind::platform() {
        let spec = kind.spec();
        let column = match spec.states {
            kfs_worker::jobs::States::RunState { .. } => "run_state",
            kfs_worker::jobs::States::Stage => "stage",
        };
        let mut db = allowed(&env.pool, spec.job_table, column).await;
        db.sort();
        assert_eq!(db, sorted(spec.job_states()), "{kind}");
        let mut db = allowed(&env.pool, spec.outbox_table, "status").await;
        db.sort();
        assert_eq!(
            db,
            sorted(kfs_worker::engine::kind::OUTBOX_STATUSES),
            "{kind}"
        );
    }
    for lk in kfs_worker::jobs::leased_kinds() {
        let mut db = allowed(&env.pool, lk.table(), "run_state").await;
        db.sort();
        assert_eq!(db, sorted(lk.states()), "{}", lk.name());
        if lk.has_checkpoint() {
            let mut db = allowed(&env.pool, lk.table(), "checkpoint").await;
            db.sort();
            assert_eq!(db, sorted(lk.checkpoints()), "{}", lk.name());
        } else {
            assert!(lk.checkpoints().is_empty(), "{}", lk.name());
        }
    }
    env.cleanup().await;
}
