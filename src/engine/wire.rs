//! The wire format, written once for the relay and the consumer: the message's properties and
//! headers ([`OutboundMessage`]), the body limit, the `traceparent` that is forwarded, and
//! decoding a delivery into the outbox row it points at. Invariant: everything here is pure and
//! total: any bytes and properties give either a [`DeliveryRef`] or a [`DecodeError`] naming
//! why, never a panic, and nothing here looks anything up in the database or talks to the
//! broker. The same rules judge an outbox row by the message the relay sends for it
//! ([`unusable_row`]), and what the relay publishes is exactly what decoding accepts.

use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use uuid::Uuid;

use crate::engine::kind::{Kind, KindSpec};

/// Bodies are a few hundred bytes; anything past this is not ours.
pub const MAX_BODY: usize = 64 * 1024;
pub const SCHEMA_VERSION: i64 = 1;

pub const H_OUTBOX_ID: &str = "x-kfs-outbox-id";
pub const H_REVISION: &str = "x-kfs-delivery-revision";
pub const H_SCHEMA: &str = "x-kfs-schema-version";
pub const H_TRACEPARENT: &str = "traceparent";

/// The identity of a delivery, taken from the message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeliveryRef {
    pub kind: Kind,
    pub job_id: Uuid,
    pub outbox_id: Uuid,
    pub delivery_id: String,
}

/// The message the relay publishes for one outbox row.
#[derive(Clone, Debug)]
pub struct OutboundMessage {
    pub kind: Kind,
    /// The kind's event type (`type` property): `KindSpec::event_type`.
    pub event_type: &'static str,
    pub outbox_id: uuid::Uuid,
    pub job_id: uuid::Uuid,
    pub delivery_id: String,
    pub revision: i32,
    pub schema_version: i32,
    pub traceparent: Option<String>,
    pub body: Vec<u8>,
}

impl OutboundMessage {
    pub fn properties(&self) -> lapin::BasicProperties {
        let mut headers = FieldTable::default();
        headers.insert(
            H_OUTBOX_ID.into(),
            AMQPValue::LongString(self.outbox_id.to_string().into()),
        );
        headers.insert(H_REVISION.into(), AMQPValue::LongInt(self.revision));
        headers.insert(H_SCHEMA.into(), AMQPValue::LongInt(self.schema_version));
        if let Some(tp) = &self.traceparent {
            headers.insert(
                H_TRACEPARENT.into(),
                AMQPValue::LongString(tp.as_str().into()),
            );
        }
        lapin::BasicProperties::default()
            .with_message_id(self.delivery_id.as_str().into())
            .with_correlation_id(self.job_id.to_string().into())
            .with_type(self.event_type.into())
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_headers(headers)
    }
}

/// A W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`); anything else is not forwarded.
pub fn valid_traceparent(s: &str) -> bool {
    let parts: Vec<&str> = s.split('-').collect();
    let hex = |p: &str, n: usize| {
        p.len() == n
            && p.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    parts.len() == 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && hex(parts[1], 32)
        && parts[1].bytes().any(|b| b != b'0')
        && hex(parts[2], 16)
        && parts[2].bytes().any(|b| b != b'0')
        && hex(parts[3], 2)
}

/// The `traceparent` a message carries, when it is a valid one.
pub fn traceparent(props: &BasicProperties) -> Option<&str> {
    props
        .headers()
        .as_ref()
        .and_then(|h| str_header(h, H_TRACEPARENT))
        .filter(|t| valid_traceparent(t))
}

/// The parts of a message that decoding reads, independent of the AMQP client.
#[derive(Clone, Debug, Default)]
pub struct Envelope<'a> {
    pub message_id: Option<&'a str>,
    pub event_type: Option<&'a str>,
    pub schema_version: Option<i64>,
    pub outbox_id: Option<&'a str>,
    pub body: &'a [u8],
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("body of {0} bytes is larger than {MAX_BODY}")]
    Oversized(usize),
    #[error("no message_id (the delivery id)")]
    NoDeliveryId,
    #[error("message_id is not a delivery id")]
    BadDeliveryId,
    #[error("type '{0}' does not belong on this queue")]
    WrongType(String),
    #[error("no {H_SCHEMA} header")]
    NoSchemaVersion,
    #[error("schema version {0} is not supported")]
    WrongSchemaVersion(i64),
    #[error("no valid {H_OUTBOX_ID} header")]
    BadOutboxId,
    #[error("body is not a JSON object")]
    NotJsonObject,
    #[error("body has no valid '{0}'")]
    BadJobId(&'static str),
}

impl DecodeError {
    /// A short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            DecodeError::Oversized(_) => "oversized",
            DecodeError::NoDeliveryId | DecodeError::BadDeliveryId => "delivery_id",
            DecodeError::WrongType(_) => "wrong_type",
            DecodeError::NoSchemaVersion | DecodeError::WrongSchemaVersion(_) => "schema_version",
            DecodeError::BadOutboxId => "outbox_id",
            DecodeError::NotJsonObject => "not_json",
            DecodeError::BadJobId(_) => "job_id",
        }
    }
}

pub fn decode(spec: &KindSpec, env: &Envelope<'_>) -> Result<DeliveryRef, DecodeError> {
    if env.body.len() > MAX_BODY {
        return Err(DecodeError::Oversized(env.body.len()));
    }
    let delivery_id = env.message_id.ok_or(DecodeError::NoDeliveryId)?;
    if delivery_id.is_empty()
        || delivery_id.len() > 255
        || delivery_id.chars().any(char::is_control)
    {
        return Err(DecodeError::BadDeliveryId);
    }
    if let Some(t) = env.event_type {
        if t != spec.event_type {
            return Err(DecodeError::WrongType(t.chars().take(64).collect()));
        }
    }
    match env.schema_version {
        None => return Err(DecodeError::NoSchemaVersion),
        Some(SCHEMA_VERSION) => {}
        Some(v) => return Err(DecodeError::WrongSchemaVersion(v)),
    }
    let outbox_id = env
        .outbox_id
        .and_then(|s| Uuid::parse_str(s).ok())
        .ok_or(DecodeError::BadOutboxId)?;
    let body: serde_json::Value =
        serde_json::from_slice(env.body).map_err(|_| DecodeError::NotJsonObject)?;
    let obj = body.as_object().ok_or(DecodeError::NotJsonObject)?;
    let field = spec.payload_id_field;
    let job_id = obj
        .get(field)
        .and_then(serde_json::Value::as_str)
        .and_then(|s| Uuid::parse_str(s).ok())
        .filter(|u| !u.is_nil())
        .ok_or(DecodeError::BadJobId(field))?;
    Ok(DeliveryRef {
        kind: spec.kind,
        job_id,
        outbox_id,
        delivery_id: delivery_id.to_owned(),
    })
}

/// Why no consumer can use the message the relay publishes for an outbox row, if none can: the
/// row's own message (its delivery id, schema version, id and payload, as the relay sends them)
/// does not decode, or names a job other than the row's. `None`: the row is usable, so a bad
/// message that pointed at it was not the row's fault, and the row's next publish is good.
pub fn unusable_row(
    spec: &KindSpec,
    outbox_id: Uuid,
    row_job_id: Uuid,
    delivery_id: &str,
    schema_version: i32,
    payload: &serde_json::Value,
) -> Option<String> {
    let body = serde_json::to_vec(payload).unwrap_or_default();
    let outbox = outbox_id.to_string();
    let env = Envelope {
        message_id: Some(delivery_id),
        event_type: Some(spec.event_type),
        schema_version: Some(i64::from(schema_version)),
        outbox_id: Some(&outbox),
        body: &body,
    };
    match decode(spec, &env) {
        Err(e) => Some(e.to_string()),
        Ok(d) if d.job_id != row_job_id => Some(format!(
            "its payload names job {}, not the row's job {row_job_id}",
            d.job_id
        )),
        Ok(_) => None,
    }
}

/// The outbox row and delivery a message names in its properties, readable even when its body
/// is not: the relay sets both on every message.
pub fn named_row(env: &Envelope<'_>) -> Option<(Uuid, String)> {
    let outbox = env.outbox_id.and_then(|s| Uuid::parse_str(s).ok())?;
    let delivery = env
        .message_id
        .filter(|m| !m.is_empty() && m.len() <= 255 && !m.chars().any(char::is_control))?;
    Some((outbox, delivery.to_owned()))
}

/// Reads the envelope out of AMQP properties.
pub fn envelope<'a>(props: &'a BasicProperties, body: &'a [u8]) -> Envelope<'a> {
    let headers = props.headers().as_ref();
    Envelope {
        message_id: props.message_id().as_ref().map(|s| s.as_str()),
        event_type: props.kind().as_ref().map(|s| s.as_str()),
        schema_version: headers.and_then(|h| int_header(h, H_SCHEMA)),
        outbox_id: headers.and_then(|h| str_header(h, H_OUTBOX_ID)),
        body,
    }
}

pub fn str_header<'a>(h: &'a FieldTable, key: &str) -> Option<&'a str> {
    match h.inner().get(key)? {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str()),
        _ => None,
    }
}

pub fn int_header(h: &FieldTable, key: &str) -> Option<i64> {
    match h.inner().get(key)? {
        AMQPValue::ShortShortInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortShortUInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortUInt(v) => Some(i64::from(*v)),
        AMQPValue::LongInt(v) => Some(i64::from(*v)),
        AMQPValue::LongUInt(v) => Some(i64::from(*v)),
        AMQPValue::LongLongInt(v) => Some(*v),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_table() {
        for (tp, ok) in [
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                true,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
                true,
            ),
            (
                "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                false,
            ),
            (
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                false,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                false,
            ),
            (
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                false,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
                false,
            ),
            ("", false),
        ] {
            assert_eq!(valid_traceparent(tp), ok, "{tp}");
        }
        assert!(!valid_traceparent(&"0".repeat(200_000)));
    }

    const OUTBOX: &str = "0b5c1a55-7d0e-4a39-9f0e-3c6a2d7a9d11";
    const JOB: &str = "7a1f3c2e-5b8d-4e6f-a0b1-c2d3e4f50617";

    fn good(body: &[u8]) -> Envelope<'_> {
        Envelope {
            message_id: Some("d-1"),
            event_type: Some("document.compile"),
            schema_version: Some(1),
            outbox_id: Some(OUTBOX),
            body,
        }
    }

    #[test]
    fn decodes_a_good_message() {
        let body = format!(r#"{{"attemptId":"{JOB}","traceparent":"00-x"}}"#);
        let d = decode(Kind::Compile.spec(), &good(body.as_bytes())).unwrap();
        assert_eq!(d.job_id.to_string(), JOB);
        assert_eq!(d.outbox_id.to_string(), OUTBOX);
        assert_eq!(d.delivery_id, "d-1");
    }

    #[test]
    fn rejects_each_kind_of_bad_message() {
        let ok = format!(r#"{{"attemptId":"{JOB}"}}"#);
        let big = vec![b' '; MAX_BODY + 1];
        let cases: Vec<(Envelope<'_>, DecodeError)> = vec![
            (good(&big), DecodeError::Oversized(MAX_BODY + 1)),
            (
                Envelope {
                    message_id: None,
                    ..good(ok.as_bytes())
                },
                DecodeError::NoDeliveryId,
            ),
            (
                Envelope {
                    message_id: Some(""),
                    ..good(ok.as_bytes())
                },
                DecodeError::BadDeliveryId,
            ),
            (
                Envelope {
                    event_type: Some("deletion.job"),
                    ..good(ok.as_bytes())
                },
                DecodeError::WrongType("deletion.job".into()),
            ),
            (
                Envelope {
                    schema_version: None,
                    ..good(ok.as_bytes())
                },
                DecodeError::NoSchemaVersion,
            ),
            (
                Envelope {
                    schema_version: Some(2),
                    ..good(ok.as_bytes())
                },
                DecodeError::WrongSchemaVersion(2),
            ),
            (
                Envelope {
                    outbox_id: Some("nope"),
                    ..good(ok.as_bytes())
                },
                DecodeError::BadOutboxId,
            ),
            (good(b"not json"), DecodeError::NotJsonObject),
            (good(b"[1,2]"), DecodeError::NotJsonObject),
            (
                good(br#"{"attemptId":42}"#),
                DecodeError::BadJobId("attemptId"),
            ),
            (
                good(br#"{"deletionJobId":"7a1f3c2e-5b8d-4e6f-a0b1-c2d3e4f50617"}"#),
                DecodeError::BadJobId("attemptId"),
            ),
            (
                good(br#"{"attemptId":"00000000-0000-0000-0000-000000000000"}"#),
                DecodeError::BadJobId("attemptId"),
            ),
        ];
        for (env, want) in cases {
            assert_eq!(decode(Kind::Compile.spec(), &env).unwrap_err(), want);
        }
    }

    #[test]
    fn judges_a_row_by_the_message_the_relay_would_send_for_it() {
        let outbox = Uuid::parse_str(OUTBOX).unwrap();
        let job = Uuid::parse_str(JOB).unwrap();
        let good = serde_json::json!({ "attemptId": JOB });
        assert_eq!(
            unusable_row(Kind::Compile.spec(), outbox, job, "d-1", 1, &good),
            None
        );
        let bad = [
            (1, serde_json::json!([1, 2])),
            (1, serde_json::json!({ "deletionJobId": JOB })),
            (1, serde_json::json!({ "attemptId": OUTBOX })),
            (2, good.clone()),
        ];
        for (version, payload) in bad {
            assert!(
                unusable_row(Kind::Compile.spec(), outbox, job, "d-1", version, &payload).is_some(),
                "{version} {payload}"
            );
        }
        let named = Envelope {
            message_id: Some("d-1"),
            outbox_id: Some(OUTBOX),
            body: b"not json",
            ..Envelope::default()
        };
        assert_eq!(named_row(&named), Some((outbox, "d-1".to_owned())));
        let unnamed = Envelope {
            message_id: None,
            ..named.clone()
        };
        assert_eq!(named_row(&unnamed), None);
    }

    #[test]
    fn reads_headers_of_any_integer_width() {
        let mut h = FieldTable::default();
        h.insert(H_SCHEMA.into(), AMQPValue::ShortShortUInt(1));
        h.insert(H_OUTBOX_ID.into(), AMQPValue::LongString(OUTBOX.into()));
        assert_eq!(int_header(&h, H_SCHEMA), Some(1));
        assert_eq!(str_header(&h, H_OUTBOX_ID), Some(OUTBOX));
        assert_eq!(int_header(&h, "missing"), None);
    }
}
