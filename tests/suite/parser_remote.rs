//! The remote parser adapter against a local stand-in of the parser service
//! (`support::unstructured`): the request it sends, the elements it maps, and how each failure
//! is classified. No database or broker is needed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kfs_worker::jobs::compile::parse::raw::RawElement;
use kfs_worker::jobs::compile::parse::remote::{
    ParseRequest, RemoteError, Unstructured, UnstructuredSettings,
};
use serde_json::{json, Value};

use crate::support::unstructured::{self, ParseFn, StandIn};

const KEY: &str = "sk-parser-secret-7";
const DOCX: &str = "application/vnd.openxmlformats-officedocument.wordprocessingml.document";

fn adapter(stand_in: &StandIn, extra: &[(&str, &str)]) -> Unstructured {
    let mut vars: Vec<(String, String)> = vec![
        (
            "UNSTRUCTURED_API_URL".into(),
            format!("{}/", stand_in.url()),
        ),
        ("UNSTRUCTURED_API_KEY".into(), KEY.into()),
    ];
    vars.extend(
        extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    let settings = UnstructuredSettings::from_lookup(|k| {
        vars.iter()
            .find(|(name, _)| name == k)
            .map(|(_, v)| v.clone())
    })
    .expect("valid settings")
    .expect("the route is configured");
    Unstructured::new(settings).expect("the adapter")
}

/// Answers every file with the same elements.
fn fixed(elements: Value) -> ParseFn {
    Arc::new(move |_: &[u8], _: &str| Ok(elements.clone()))
}

fn one_paragraph() -> ParseFn {
    fixed(json!([{"type": "NarrativeText", "text": "hello", "metadata": {"page_number": 1}}]))
}

fn assert_failure(err: &RemoteError, code: &str, retryable: bool) {
    assert_eq!(err.code(), code, "{err}");
    assert_eq!(err.retryable(), retryable, "{err}");
    let line = err.to_string();
    assert!(line.contains("127.0.0.1:"), "names the host: {line}");
    assert!(!line.contains(KEY), "never the key: {line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parse_sends_the_documents_fields_and_maps_the_elements() {
    let mut heading = RawElement::title("Quarterly report", 0, Some(1));
    heading.metadata.element_id = Some("h1".into());
    let mut table = RawElement::table(&[vec!["a".into(), "b".into()]], Some(2));
    table.metadata.parent_id = Some("h1".into());
    let mut answer = unstructured::unstructured_json(&[heading.clone(), table.clone()]);
    answer
        .as_array_mut()
        .unwrap()
        .push(json!({"text": "loose text", "metadata": {"languages": ["deu"], "filetype": "x"}}));
    let stand_in = unstructured::start(
        Some(KEY),
        Arc::new(move |bytes: &[u8], filename: &str| {
            assert_eq!(
                (bytes, filename),
                (&b"PK\x03\x04 word"[..], "Bericht Q3.docx")
            );
            Ok(answer.clone())
        }),
    )
    .await;
    let parser = adapter(&stand_in, &[]);
    let metadata = json!({"language": "de-DE", "layoutComplexity": "simple"});
    let req = ParseRequest::new(b"PK\x03\x04 word", "Bericht Q3.docx", DOCX)
        .hints_from_metadata(&metadata);

    let elements = parser.parse(&req).await.expect("parsed");

    assert_eq!(elements.len(), 3);
    assert_eq!(elements[0], heading);
    assert_eq!(elements[1], table);
    assert_eq!(elements[2].kind, "UncategorizedText");
    assert_eq!(elements[2].text, "loose text");
    assert_eq!(elements[2].metadata.languages, Some(vec!["deu".to_owned()]));
    let seen = stand_in.requests();
    assert_eq!(seen.len(), 1);
    let r = &seen[0];
    assert!(r.authorization && r.authorized, "Bearer {KEY} was sent");
    assert_eq!(r.filename.as_deref(), Some("Bericht Q3.docx"));
    assert_eq!(r.content_type.as_deref(), Some(DOCX));
    assert_eq!(r.bytes, b"PK\x03\x04 word");
    assert_eq!(r.coordinates.as_deref(), Some("true"));
    assert_eq!(r.strategy.as_deref(), Some("fast"));
    assert_eq!(r.languages, ["deu"]);
    assert!(r.extract_image_block_types.is_empty());
    assert_eq!(r.extract_image_block_to_payload, None);
    assert!(r.other_fields.is_empty(), "{:?}", r.other_fields);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_of_a_pdf_ask_for_image_and_table_blocks_with_their_payload() {
    let stand_in = unstructured::start(Some(KEY), one_paragraph()).await;
    let parser = adapter(&stand_in, &[("UNSTRUCTURED_DEFAULT_LANGUAGE", "en")]);
    let req = ParseRequest {
        requires_images: true,
        ..ParseRequest::new(b"%PDF-1.7\n...", "scan.pdf", "application/pdf")
    };
    parser.parse(&req).await.expect("parsed");
    let r = &stand_in.requests()[0];
    assert_eq!(r.strategy.as_deref(), Some("hi_res"));
    assert_eq!(r.extract_image_block_types, ["Image", "Table"]);
    assert_eq!(r.extract_image_block_to_payload.as_deref(), Some("true"));
    assert_eq!(r.languages, ["eng"], "the default language");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_is_repeated_when_retries_are_allowed() {
    let stand_in = unstructured::start(Some(KEY), one_paragraph()).await;
    stand_in.fail_next(1, 503);
    let parser = adapter(
        &stand_in,
        &[
            ("UNSTRUCTURED_MAX_RETRIES", "1"),
            ("UNSTRUCTURED_RETRY_DELAY_MS", "10"),
        ],
    );
    let elements = parser
        .parse(&ParseRequest::new(b"PK", "a.docx", DOCX))
        .await
        .expect("the second attempt parses");
    assert_eq!(elements[0].text, "hello");
    assert_eq!(stand_in.count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_without_retries_is_an_unavailable_parser_to_retry_later() {
    let stand_in = unstructured::start(Some(KEY), one_paragraph()).await;
    stand_in.fail_next(1, 503);
    let parser = adapter(&stand_in, &[]);
    let err = parser
        .parse(&ParseRequest::new(b"PK", "a.docx", DOCX))
        .await
        .unwrap_err();
    assert_failure(&err, "DOCUMENT_PARSER_UNAVAILABLE", true);
    assert!(err.to_string().contains("HTTP 503"), "{err}");
    assert!(!err.ambiguous());
    assert_eq!(stand_in.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_key_is_refused_and_not_retried() {
    let stand_in = unstructured::start(Some("another-key"), one_paragraph()).await;
    let parser = adapter(&stand_in, &[("UNSTRUCTURED_MAX_RETRIES", "3")]);
    let err = parser
        .parse(&ParseRequest::new(b"PK", "a.docx", DOCX))
        .await
        .unwrap_err();
    assert_failure(&err, "DOCUMENT_PARSER_UNAVAILABLE", false);
    assert!(err.to_string().contains("HTTP 401"), "{err}");
    let seen = stand_in.requests();
    assert_eq!(seen.len(), 1);
    assert!(seen[0].authorization && !seen[0].authorized);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_past_the_deadline_is_a_timeout_not_to_retry() {
    let stand_in = unstructured::start(Some(KEY), one_paragraph()).await;
    stand_in.delay(Duration::from_secs(5));
    let parser = adapter(
        &stand_in,
        &[
            ("UNSTRUCTURED_REQUEST_TIMEOUT_MS", "1000"),
            ("UNSTRUCTURED_MAX_RETRIES", "2"),
        ],
    );
    let started = Instant::now();
    let err = parser
        .parse(&ParseRequest::new(b"PK", "a.docx", DOCX))
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert_failure(&err, "DOCUMENT_PARSER_TIMEOUT", false);
    assert!(err.ambiguous(), "the service may still be parsing");
    assert!(err.to_string().contains("requestTimeoutMs=1000"), "{err}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!(stand_in.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_rejection_is_invalid_input() {
    let stand_in = unstructured::start(
        Some(KEY),
        Arc::new(|_: &[u8], _: &str| {
            Err((
                422,
                json!({"detail": {
                    "code": "PARSER_RESOURCE_REJECTED",
                    "revision": "knowledgefs-unstructured-sandbox-v1",
                    "reason": "archive_encrypted"
                }})
                .to_string(),
            ))
        }),
    )
    .await;
    let parser = adapter(&stand_in, &[("UNSTRUCTURED_MAX_RETRIES", "2")]);
    let err = parser
        .parse(&ParseRequest::new(b"PK", "locked.docx", DOCX))
        .await
        .unwrap_err();
    assert_failure(&err, "DOCUMENT_PARSER_INPUT_INVALID", false);
    assert!(err.to_string().contains("archive_encrypted"), "{err}");
    assert_eq!(stand_in.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_that_is_not_an_array_is_an_invalid_response() {
    let stand_in = unstructured::start(Some(KEY), fixed(json!({"elements": []}))).await;
    let parser = adapter(&stand_in, &[]);
    let err = parser
        .parse(&ParseRequest::new(b"PK", "a.docx", DOCX))
        .await
        .unwrap_err();
    assert_failure(&err, "DOCUMENT_PARSER_RESPONSE_INVALID", false);
    assert!(err.to_string().contains("expected a JSON array"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_hold_on_both_sides() {
    let big = json!([{"text": "x".repeat(4096), "metadata": {}}]);
    let stand_in = unstructured::start(Some(KEY), fixed(big)).await;
    let parser = adapter(
        &stand_in,
        &[
            ("UNSTRUCTURED_MAX_INPUT_BYTES", "16"),
            ("UNSTRUCTURED_MAX_RESPONSE_BYTES", "1024"),
        ],
    );
    let err = parser
        .parse(&ParseRequest::new(&[b'P'; 17], "a.docx", DOCX))
        .await
        .unwrap_err();
    assert_failure(&err, "DOCUMENT_PARSER_INPUT_INVALID", false);
    assert_eq!(stand_in.count(), 0, "refused before any request");
    let err = parser
        .parse(&ParseRequest::new(b"PK", "a.docx", DOCX))
        .await
        .unwrap_err();
    assert_failure(&err, "DOCUMENT_PARSER_RESPONSE_INVALID", false);
    assert!(
        err.to_string().contains("UNSTRUCTURED_MAX_RESPONSE_BYTES"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_that_is_gone_is_an_ambiguous_failure_to_retry() {
    let stand_in = unstructured::start(None, one_paragraph()).await;
    let parser = adapter(&stand_in, &[]);
    drop(stand_in);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let err = parser
        .parse(&ParseRequest::new(b"PK", "a.docx", DOCX))
        .await
        .unwrap_err();
    assert_failure(&err, "DOCUMENT_PARSER_UNAVAILABLE", true);
    assert!(err.ambiguous(), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_work_waits_for_its_narrower_gate() {
    let stand_in = unstructured::start(Some(KEY), one_paragraph()).await;
    stand_in.delay(Duration::from_millis(400));
    let parser = adapter(
        &stand_in,
        &[
            ("UNSTRUCTURED_MAX_CONCURRENCY", "2"),
            ("UNSTRUCTURED_HEAVY_MAX_CONCURRENCY", "1"),
        ],
    );
    let pdf = ParseRequest::new(b"%PDF-1.4", "a.pdf", "application/pdf");
    let docx = ParseRequest::new(b"PK", "a.docx", DOCX);
    assert!(parser.is_heavy(&pdf) && !parser.is_heavy(&docx));

    let started = Instant::now();
    let (a, b) = tokio::join!(parser.parse(&pdf), parser.parse(&docx));
    a.unwrap();
    b.unwrap();
    let side_by_side = started.elapsed();

    let started = Instant::now();
    let (a, b) = tokio::join!(parser.parse(&pdf), parser.parse(&pdf));
    a.unwrap();
    b.unwrap();
    let one_after_the_other = started.elapsed();

    assert!(
        side_by_side < Duration::from_millis(750),
        "{side_by_side:?}"
    );
    assert!(
        one_after_the_other >= Duration::from_millis(800),
        "{one_after_the_other:?}"
    );
    assert_eq!(stand_in.count(), 4);
}
