//! Bad input on the live queues: 10,000 malformed, foreign and replayed messages published into
//! the queues of a running `kfs-worker` while real jobs flow. Invariant under test: each bad
//! message is either dead-lettered (undecodable, with a logged reason) or acked as stale,
//! terminal or duplicate without work (logged in the ack log with its claim outcome); the
//! database is unchanged apart from the real jobs that ran meanwhile; and the real jobs all
//! finish, each effect exactly once.

use std::collections::BTreeMap;
use std::time::Duration;

use kfs_worker::jobs::probe::{self, ProbeSpec};
use kfs_worker::jobs::Kind;
use kfs_worker::wire::{H_OUTBOX_ID, H_SCHEMA, MAX_BODY};
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::PgPool;
use uuid::Uuid;

use crate::support::{self, TestEnv};

/// One message to publish: where, and what the worker must do with it.
struct Bad {
    kind: Kind,
    props: BasicProperties,
    body: Vec<u8>,
    /// true: undecodable, must be dead-lettered; false: decodes, must be acked without work.
    poison: bool,
    category: &'static str,
}

fn headers(outbox: Option<AMQPValue>, schema: Option<AMQPValue>) -> FieldTable {
    let mut h = FieldTable::default();
    if let Some(o) = outbox {
        h.insert(H_OUTBOX_ID.into(), o);
    }
    if let Some(s) = schema {
        h.insert(H_SCHEMA.into(), s);
    }
    h
}

fn props(message_id: Option<&str>, kind: Option<&str>, h: FieldTable) -> BasicProperties {
    let mut p = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(h);
    if let Some(m) = message_id {
        p = p.with_message_id(m.into());
    }
    if let Some(k) = kind {
        p = p.with_type(k.into());
    }
    p
}

fn uuid_str(u: Uuid) -> AMQPValue {
    AMQPValue::LongString(u.to_string().into())
}

fn good_props(id: &str, kind: Kind, outbox: Uuid) -> BasicProperties {
    props(
        Some(id),
        Some(kind.event_type()),
        headers(Some(uuid_str(outbox)), Some(AMQPValue::LongInt(1))),
    )
}

fn probe_body(job: Uuid) -> Vec<u8> {
    format!(r#"{{"probeJobId":"{job}"}}"#).into_bytes()
}

/// The 10,000 messages. `real` are (job id, outbox id, delivery id) of finished real jobs.
fn bad_messages(rng: &mut StdRng, real: &[(Uuid, Uuid, String)]) -> Vec<Bad> {
    let mut out = Vec::new();
    let mut n = 0u32;
    let mut id = || {
        n += 1;
        format!("bad-{n}")
    };
    let p = Kind::Probe;
    let poison = |kind, props, body, category| Bad {
        kind,
        props,
        body,
        poison: true,
        category,
    };
    // Not JSON at all: random bytes, half of them not even UTF-8.
    for i in 0..1500 {
        let len = rng.random_range(0..400);
        let mut body: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        if i % 2 == 0 {
            body = String::from_utf8_lossy(&body)
                .replace(['{', '['], "")
                .into_bytes();
        }
        out.push(poison(
            p,
            good_props(&id(), p, Uuid::new_v4()),
            body,
            "not JSON",
        ));
    }
    // JSON, but not an object.
    for i in 0..800 {
        let body = ["[1,2]", "42", "\"probeJobId\"", "null", "true", "{"][i % 6];
        out.push(poison(
            p,
            good_props(&id(), p, Uuid::new_v4()),
            body.into(),
            "JSON not an object",
        ));
    }
    // An object with the id of the wrong type, missing, nil, or under another kind's name.
    for i in 0..1000 {
        let body = match i % 6 {
            0 => r#"{"probeJobId":42}"#.to_owned(),
            1 => r#"{"probeJobId":null}"#.to_owned(),
            2 => r#"{"probeJobId":"not-a-uuid"}"#.to_owned(),
            3 => r#"{"probeJobId":"00000000-0000-0000-0000-000000000000"}"#.to_owned(),
            4 => format!(r#"{{"attemptId":"{}"}}"#, Uuid::new_v4()),
            _ => format!(r#"{{"probeJobId":["{}"]}}"#, Uuid::new_v4()),
        };
        out.push(poison(
            p,
            good_props(&id(), p, Uuid::new_v4()),
            body.into_bytes(),
            "wrong types",
        ));
    }
    // Wrong or missing schema version.
    for i in 0..1000 {
        let schema = match i % 5 {
            0 => Some(AMQPValue::LongInt(2)),
            1 => Some(AMQPValue::LongInt(0)),
            2 => Some(AMQPValue::LongLongInt(-1)),
            3 => Some(AMQPValue::LongString("1".into())),
            _ => None,
        };
        let h = headers(Some(uuid_str(Uuid::new_v4())), schema);
        out.push(poison(
            p,
            props(Some(&id()), Some(p.event_type()), h),
            probe_body(Uuid::new_v4()),
            "wrong schema version",
        ));
    }
    // Missing, empty, over-long or control-character delivery ids.
    for i in 0..800 {
        let mid = match i % 4 {
            0 => None,
            1 => Some(String::new()),
            2 => Some(format!("\u{7f}bad{i}")),
            _ => Some(format!("bad\n{i}")),
        };
        let h = headers(Some(uuid_str(Uuid::new_v4())), Some(AMQPValue::LongInt(1)));
        out.push(poison(
            p,
            props(mid.as_deref(), Some(p.event_type()), h),
            probe_body(Uuid::new_v4()),
            "bad delivery id",
        ));
    }
    // A message type that does not belong on the queue.
    for i in 0..800 {
        let t = ["deletion.job", "document.compile", "x", ""][i % 4];
        let h = headers(Some(uuid_str(Uuid::new_v4())), Some(AMQPValue::LongInt(1)));
        out.push(poison(
            p,
            props(Some(&id()), Some(t), h),
            probe_body(Uuid::new_v4()),
            "wrong event type",
        ));
    }
    // Missing or malformed outbox-id header.
    for i in 0..500 {
        let o = match i % 3 {
            0 => None,
            1 => Some(AMQPValue::LongString("nope".into())),
            _ => Some(AMQPValue::LongInt(7)),
        };
        let h = headers(o, Some(AMQPValue::LongInt(1)));
        out.push(poison(
            p,
            props(Some(&id()), Some(p.event_type()), h),
            probe_body(Uuid::new_v4()),
            "bad outbox id",
        ));
    }
    // Oversized bodies.
    for _ in 0..100 {
        let mut body = probe_body(Uuid::new_v4());
        body.resize(MAX_BODY + rng.random_range(1..2000), b' ');
        out.push(poison(
            p,
            good_props(&id(), p, Uuid::new_v4()),
            body,
            "oversized",
        ));
    }
    let stale = |props, body, kind, category| Bad {
        kind,
        props,
        body,
        poison: false,
        category,
    };
    // Well formed, but the ids exist nowhere.
    for _ in 0..1500 {
        let job = Uuid::new_v4();
        out.push(stale(
            good_props(&id(), p, Uuid::new_v4()),
            probe_body(job),
            p,
            "unknown ids",
        ));
    }
    // Ids of another table: a real probe job and its outbox row, sent to the compile and
    // deletion queues; and a real outbox row paired with another job.
    for i in 0..1000 {
        let (job, outbox, _) = &real[i % real.len()];
        let (kind, body, ob) = match i % 3 {
            0 => (
                Kind::Compile,
                format!(r#"{{"attemptId":"{job}"}}"#),
                *outbox,
            ),
            1 => (
                Kind::Deletion,
                format!(r#"{{"deletionJobId":"{job}"}}"#),
                *outbox,
            ),
            _ => (
                p,
                format!(r#"{{"probeJobId":"{}"}}"#, real[(i + 1) % real.len()].0),
                *outbox,
            ),
        };
        out.push(stale(
            good_props(&id(), kind, ob),
            body.into_bytes(),
            kind,
            "ids of another table",
        ));
    }
    // Replays of real, finished deliveries, exactly as the relay sent them, ten times each.
    for i in 0..1000 {
        let (job, outbox, delivery) = &real[i % real.len()];
        out.push(stale(
            good_props(delivery, p, *outbox),
            probe_body(*job),
            p,
            "replayed delivery ids",
        ));
    }
    out
}

/// count + md5 of every table; of the probe tables only the rows of the finished first batch
/// of real jobs (replays must not touch them), not those of the jobs running meanwhile.
async fn digest(pool: &PgPool, finished: &[Uuid]) -> BTreeMap<String, String> {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = current_schema() AND c.relkind = 'r' AND c.relname <> 'kfs_worker_migrations' ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut out = BTreeMap::new();
    for table in tables {
        let filter = match table.as_str() {
            "kfs_probe_jobs" => "WHERE t.id = ANY($1)",
            "kfs_probe_outbox" => "WHERE t.probe_job_id = ANY($1)",
            "kfs_probe_effects" => "WHERE t.job_id = ANY($1)",
            _ => "WHERE cardinality($1::uuid[]) >= 0",
        };
        let d: String = sqlx::query_scalar(&format!(
            "SELECT count(*)::text || ' ' || md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) \
             FROM \"{table}\" AS t {filter}"
        ))
        .bind(finished)
        .fetch_one(pool)
        .await
        .unwrap();
        out.insert(table, d);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_bad_messages_change_nothing_and_real_jobs_keep_flowing() {
    let env = TestEnv::new().await;
    let mut rng = StdRng::seed_from_u64(20_261_129);
    let mut worker = env.spawn_worker(
        "w",
        &[
            "run",
            "--kinds",
            "compile,deletion,research,probe",
            "--worker-id",
            "w",
        ],
        &[
            ("KFS_LOG_FORMAT", "json"),
            ("RUST_LOG", "info,kfs_worker=debug,sqlx=warn,lapin=warn"),
            ("KFS_OBJECT_STORE", "memory://"),
            ("KFS_RELAY_POLL", "200ms"),
        ],
    );

    // A first batch of real jobs runs to completion: their deliveries are replayed later.
    let spec = ProbeSpec {
        steps: 2,
        ..ProbeSpec::default()
    };
    probe::enqueue_many(&env.pool, 100, &spec).await.unwrap();
    let pool = env.pool.clone();
    let done = env
        .wait_until(Duration::from_secs(60), || {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM kfs_probe_jobs WHERE run_state <> 'succeeded'",
                )
                .fetch_one(&pool)
                .await
                .unwrap()
                    == 0
            }
        })
        .await;
    assert!(
        done,
        "the first batch did not finish: {:?}",
        support::probe_states(&env.pool).await
    );
    let real: Vec<(Uuid, Uuid, String)> =
        sqlx::query_as("SELECT probe_job_id, id, queue_job_id FROM kfs_probe_outbox ORDER BY id")
            .fetch_all(&env.pool)
            .await
            .unwrap();
    assert_eq!(real.len(), 100);

    let first: Vec<Uuid> = real.iter().map(|(j, _, _)| *j).collect();
    let before = digest(&env.pool, &first).await;

    let messages = bad_messages(&mut rng, &real);
    assert_eq!(messages.len(), 10_000);
    let poison = messages.iter().filter(|m| m.poison).count();
    let ch = env.confirm_channel().await;
    let mut confirms = Vec::new();
    const SECOND: usize = 300;
    let mut enqueued = 0usize;
    for (i, m) in messages.iter().enumerate() {
        // Real jobs keep arriving while the bad messages do.
        if i % 33 == 0 && enqueued < SECOND {
            support::enqueue_one(&env.pool, &spec).await;
            enqueued += 1;
        }
        let c = ch
            .basic_publish(
                "".into(),
                env.topology.queue(m.kind).as_str().into(),
                BasicPublishOptions::default(),
                &m.body,
                m.props.clone(),
            )
            .await
            .expect("publish");
        confirms.push(c);
    }
    while enqueued < SECOND {
        support::enqueue_one(&env.pool, &spec).await;
        enqueued += 1;
    }
    for c in confirms {
        c.await.expect("broker confirm");
    }

    // Every real job finishes; the job queues drain; the dead-letter queue holds the poison.
    let pool = env.pool.clone();
    let finished = env
        .wait_until(Duration::from_secs(120), || {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM kfs_probe_jobs WHERE run_state <> 'succeeded'",
                )
                .fetch_one(&pool)
                .await
                .unwrap()
                    == 0
            }
        })
        .await;
    let dlq = env.topology.dead_letter_queue();
    let mut depths = Vec::new();
    for _ in 0..240 {
        depths.clear();
        for k in [Kind::Probe, Kind::Compile, Kind::Deletion] {
            depths.push(env.queue_depth(&env.topology.queue(k)).await);
        }
        if depths.iter().all(|d| *d == 0) && env.queue_depth(&dlq).await as usize >= poison {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    worker.signal("TERM");
    let status = worker.wait_exit(Duration::from_secs(30));
    let log = worker.log_text();
    assert!(
        finished,
        "real jobs did not finish during the storm: {:?}",
        support::probe_states(&env.pool).await
    );
    assert_eq!(
        depths,
        vec![0, 0, 0],
        "job queues (probe, compile, deletion) not drained"
    );
    assert_eq!(
        env.queue_depth(&dlq).await as usize,
        poison,
        "dead-lettered messages"
    );
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(0),
        "worker exit on SIGTERM"
    );

    // Each poison message has a logged reason; each decodable bad message an ack-log line
    // with a claim outcome that did no work.
    let mut rejected = 0usize;
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    let mut acked: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in log.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let f = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or("").to_owned();
        if f("message") == "rejecting an undecodable delivery to the dead-letter queue" {
            assert!(
                !f("reason").is_empty(),
                "a rejection without a reason: {line}"
            );
            rejected += 1;
            *reasons.entry(f("label")).or_default() += 1;
        } else if f("message") == "acked" {
            acked.entry(f("delivery_id")).or_default().push(f("claim"));
        }
    }
    assert_eq!(
        rejected, poison,
        "rejections logged (by label: {reasons:?})"
    );
    let mut by_category: BTreeMap<&str, BTreeMap<String, usize>> = BTreeMap::new();
    let mut replay_seen: BTreeMap<String, usize> = BTreeMap::new();
    for m in messages.iter().filter(|m| !m.poison) {
        let id = m.props.message_id().as_ref().unwrap().to_string();
        if m.category == "replayed delivery ids" {
            *replay_seen.entry(id).or_default() += 1;
            continue;
        }
        let claims = acked.get(&id).cloned().unwrap_or_default();
        assert_eq!(
            claims.len(),
            1,
            "{} message {id} acked {} times",
            m.category,
            claims.len()
        );
        assert!(
            matches!(claims[0].as_str(), "stale" | "terminal" | "duplicate"),
            "{} message {id} was {}",
            m.category,
            claims[0]
        );
        *by_category
            .entry(m.category)
            .or_default()
            .entry(claims[0].clone())
            .or_default() += 1;
    }
    for (id, n) in &replay_seen {
        let claims = acked.get(id).cloned().unwrap_or_default();
        let no_work = claims
            .iter()
            .filter(|c| matches!(c.as_str(), "stale" | "terminal" | "duplicate"))
            .count();
        assert_eq!(no_work, *n, "replays of {id}: acks {claims:?}");
    }
    println!("rejections by reason: {reasons:?}\ndecodable bad messages by claim outcome: {by_category:?}");

    // Nothing changed but the real jobs; those ran exactly once.
    let after = digest(&env.pool, &first).await;
    assert_eq!(before, after, "the database changed outside the real jobs");
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM kfs_probe_jobs")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(
        jobs,
        (100 + SECOND) as i64,
        "probe jobs other than the real ones appeared"
    );
    support::assert_probe_invariants(&env.pool).await;
    env.cleanup().await;
}

/// How one generated envelope's fields are made.
#[derive(Clone, Debug)]
enum Mutation {
    Flip(usize, u8),
    Truncate(usize),
    Prefix(Vec<u8>),
    /// Pads the body by this many halves of `MAX_BODY`.
    Pad(usize),
}

#[derive(Clone, Debug)]
enum EventType {
    Own,
    Of(usize),
    Text(String),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Mutation::Flip(at, b)),
        any::<usize>().prop_map(Mutation::Truncate),
        proptest::collection::vec(any::<u8>(), 1..8).prop_map(Mutation::Prefix),
        (0usize..3).prop_map(Mutation::Pad),
    ]
}

fn mutated_body(kind: Kind, job: u128, raw: Option<Vec<u8>>, muts: &[Mutation]) -> Vec<u8> {
    let field = kind.spec().payload_id_field;
    let mut body = raw.unwrap_or_else(|| {
        format!(
            r#"{{"{field}":"{}","traceparent":"00-x"}}"#,
            Uuid::from_u128(job)
        )
        .into_bytes()
    });
    for m in muts {
        match m {
            Mutation::Flip(at, b) if !body.is_empty() => {
                let at = at % body.len();
                body[at] = *b;
            }
            Mutation::Truncate(at) if !body.is_empty() => body.truncate(at % body.len()),
            Mutation::Prefix(bytes) => body.splice(0..0, bytes.iter().copied()).for_each(drop),
            Mutation::Pad(halves) => body.resize(body.len() + halves * (MAX_BODY / 2), b' '),
            _ => {}
        }
    }
    body
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 20_000, ..ProptestConfig::default() })]

    /// The fuzz target's property (fuzz/fuzz_targets/decode.rs), run by proptest on every suite
    /// run, so that it needs no nightly toolchain: decoding never panics, is deterministic, and
    /// accepts only a well-formed delivery of the queue's own kind.
    #[test]
    fn decoding_is_total_and_strict_on_mutated_envelopes(
        kind in 0usize..Kind::all().len(),
        job in any::<u128>(),
        raw in proptest::option::weighted(0.1, proptest::collection::vec(any::<u8>(), 0..256)),
        muts in proptest::collection::vec(mutation(), 0..4),
        message_id in proptest::option::weighted(0.9, prop_oneof![
            4 => Just("d-1".to_owned()),
            1 => Just(String::new()),
            1 => Just("a\u{0}b".to_owned()),
            2 => ".{0,300}",
        ]),
        event_type in proptest::option::weighted(0.8, prop_oneof![
            6 => Just(EventType::Own),
            1 => (0usize..Kind::all().len()).prop_map(EventType::Of),
            1 => ".{0,40}".prop_map(EventType::Text),
        ]),
        schema in proptest::option::weighted(0.9, prop_oneof![
            4 => Just(kfs_worker::wire::SCHEMA_VERSION),
            1 => any::<i64>(),
        ]),
        outbox in proptest::option::weighted(0.9, prop_oneof![
            9 => any::<u128>().prop_map(|u| Uuid::from_u128(u).to_string()),
            1 => ".{0,40}",
        ]),
    ) {
        use kfs_worker::wire::{decode, Envelope, SCHEMA_VERSION};
        let kind = Kind::all()[kind];
        let field = kind.spec().payload_id_field;
        let body = mutated_body(kind, job, raw, &muts);
        let event_type = event_type.map(|e| match e {
            EventType::Own => kind.event_type().to_owned(),
            EventType::Of(i) => Kind::all()[i].event_type().to_owned(),
            EventType::Text(t) => t,
        });
        let env = Envelope {
            message_id: message_id.as_deref(),
            event_type: event_type.as_deref(),
            schema_version: schema,
            outbox_id: outbox.as_deref(),
            body: &body,
        };
        let got = decode(kind.spec(), &env);
        prop_assert_eq!(&got, &decode(kind.spec(), &env), "deterministic");
        if let Ok(d) = got {
            prop_assert!(body.len() <= MAX_BODY);
            prop_assert!(!d.delivery_id.is_empty() && d.delivery_id.len() <= 255);
            prop_assert!(!d.delivery_id.chars().any(char::is_control));
            prop_assert_eq!(Some(d.delivery_id.as_str()), env.message_id);
            prop_assert_eq!(env.schema_version, Some(SCHEMA_VERSION));
            prop_assert!(env.event_type.is_none_or(|t| t == kind.event_type()));
            prop_assert_eq!(Some(d.outbox_id), env.outbox_id.and_then(|o| Uuid::parse_str(o).ok()));
            prop_assert!(!d.job_id.is_nil());
            let v: serde_json::Value =
                serde_json::from_slice(&body).expect("accepted body is JSON");
            prop_assert_eq!(
                v[field].as_str().and_then(|s| Uuid::parse_str(s).ok()),
                Some(d.job_id)
            );
        }
    }

    /// The other half: every well-formed envelope of a queue's kind is accepted, with exactly
    /// the ids it carries. Together with the property above, decoding is strict and complete.
    #[test]
    fn every_well_formed_envelope_decodes_to_its_own_ids(
        kind in 0usize..Kind::all().len(),
        job in 1u128..,
        outbox in any::<u128>(),
        delivery_id in "[^\\p{Cc}]{1,60}",
        with_type in any::<bool>(),
        extra in proptest::collection::btree_map("[a-z]{1,8}", any::<i64>(), 0..4),
    ) {
        use kfs_worker::wire::{decode, Envelope, SCHEMA_VERSION};
        let kind = Kind::all()[kind];
        let field = kind.spec().payload_id_field;
        let mut payload: serde_json::Map<String, serde_json::Value> =
            extra.into_iter().map(|(k, v)| (k, v.into())).collect();
        payload.insert(field.to_owned(), Uuid::from_u128(job).to_string().into());
        let body = serde_json::to_vec(&payload).unwrap();
        let outbox = Uuid::from_u128(outbox).to_string();
        let env = Envelope {
            message_id: Some(&delivery_id),
            event_type: with_type.then(|| kind.event_type()),
            schema_version: Some(SCHEMA_VERSION),
            outbox_id: Some(&outbox),
            body: &body,
        };
        let d = decode(kind.spec(), &env);
        prop_assert!(d.is_ok(), "refused a well-formed envelope: {:?}", d);
        let d = d.unwrap();
        prop_assert_eq!(d.kind, kind);
        prop_assert_eq!(d.job_id, Uuid::from_u128(job));
        prop_assert_eq!(d.outbox_id.to_string(), outbox);
        prop_assert_eq!(d.delivery_id, delivery_id);
    }
}
