//! Fuzzes message decoding: AMQP properties (message id, type, header values of any AMQP type)
//! and body bytes into `decode::envelope` and `decode::decode`. Invariant: decoding never
//! panics, is deterministic, and accepts only what a consumer may act on: a body within
//! `MAX_BODY` that is a JSON object holding a non-nil job id of the queue's kind, a delivery
//! id of 1..=255 characters without control characters, schema version 1, and an outbox id.
#![no_main]

use kfs_worker::wire::{self as decode, H_OUTBOX_ID, H_SCHEMA, MAX_BODY, SCHEMA_VERSION};
use kfs_worker::jobs::Kind;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::BasicProperties;
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

const KINDS: [Kind; 4] = [Kind::Compile, Kind::Deletion, Kind::Research, Kind::Probe];

fn short(u: &mut Unstructured<'_>) -> Result<ShortString> {
    let s: String = u.arbitrary()?;
    let mut end = s.len().min(255);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    Ok(s[..end].into())
}

fn value(u: &mut Unstructured<'_>) -> Result<AMQPValue> {
    Ok(match u.int_in_range(0..=9)? {
        0 => AMQPValue::ShortShortInt(u.arbitrary()?),
        1 => AMQPValue::ShortShortUInt(u.arbitrary()?),
        2 => AMQPValue::ShortInt(u.arbitrary()?),
        3 => AMQPValue::LongInt(u.arbitrary()?),
        4 => AMQPValue::LongLongInt(u.arbitrary()?),
        5 => AMQPValue::LongUInt(u.arbitrary()?),
        6 => AMQPValue::ShortString(short(u)?),
        7 => AMQPValue::Boolean(u.arbitrary()?),
        8 => AMQPValue::LongString(LongString::from(u.arbitrary::<Vec<u8>>()?)),
        _ => AMQPValue::LongString(
            if u.arbitrary()? {
                uuid_like(u)?
            } else {
                u.arbitrary::<String>()?
            }
            .into(),
        ),
    })
}

/// Mostly-valid UUID text, so that the fuzzer reaches the JSON checks.
fn uuid_like(u: &mut Unstructured<'_>) -> Result<String> {
    let b: [u8; 16] = u.arbitrary()?;
    Ok(format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        u32::from_be_bytes([b[0], b[1], b[2], b[3]]),
        u16::from_be_bytes([b[4], b[5]]),
        u16::from_be_bytes([b[6], b[7]]),
        u16::from_be_bytes([b[8], b[9]]),
        u64::from_be_bytes([0, 0, b[10], b[11], b[12], b[13], b[14], b[15]])
    ))
}

fn run(data: &[u8]) -> Result<()> {
    let mut u = Unstructured::new(data);
    let kind = KINDS[u.int_in_range(0..=3)?];
    let mut headers = FieldTable::default();
    if u.arbitrary()? {
        headers.insert(H_SCHEMA.into(), value(&mut u)?);
    }
    if u.arbitrary()? {
        headers.insert(H_OUTBOX_ID.into(), value(&mut u)?);
    }
    let mut props = BasicProperties::default().with_headers(headers);
    if u.arbitrary()? {
        props = props.with_message_id(short(&mut u)?);
    }
    if u.arbitrary()? {
        props = props.with_type(if u.arbitrary()? {
            kind.event_type().into()
        } else {
            short(&mut u)?
        });
    }
    let body: Vec<u8> = if u.arbitrary()? {
        // A JSON object with the kind's id field, of some value.
        let field = kind.spec().payload_id_field;
        let v = match u.int_in_range(0..=3)? {
            0 => format!("\"{}\"", uuid_like(&mut u)?),
            1 => u.arbitrary::<i64>()?.to_string(),
            2 => "null".to_owned(),
            _ => serde_like_string(&mut u)?,
        };
        format!("{{\"{field}\":{v}}}").into_bytes()
    } else {
        u.arbitrary()?
    };

    let env = decode::envelope(&props, &body);
    let first = decode::decode(kind.spec(), &env);
    assert_eq!(
        first,
        decode::decode(kind.spec(), &env),
        "decoding is deterministic"
    );
    if let Ok(d) = first {
        assert!(body.len() <= MAX_BODY);
        assert!(!d.delivery_id.is_empty() && d.delivery_id.len() <= 255);
        assert!(!d.delivery_id.chars().any(char::is_control));
        assert!(!d.job_id.is_nil());
        assert_eq!(d.kind, kind);
        assert_eq!(env.schema_version, Some(SCHEMA_VERSION));
        let v: serde_json::Value = serde_json::from_slice(&body).expect("accepted body is JSON");
        assert!(v.is_object());
    }
    Ok(())
}

fn serde_like_string(u: &mut Unstructured<'_>) -> Result<String> {
    let s: String = u.arbitrary()?;
    Ok(format!("\"{}\"", s.replace(['"', '\\'], "")))
}

fuzz_target!(|data: &[u8]| {
    let _ = run(data);
});
