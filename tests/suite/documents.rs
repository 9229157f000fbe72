//! PDF, Word and PowerPoint documents compile into published, findable knowledge through the
//! local parsers and through the platform's parser-service route (against a local stand-in
//! of that service's API); the raw-parse checkpoint is reused instead of parsing again; a
//! document that cannot be parsed fails with one code and writes nothing else.

use std::sync::Arc;
use std::time::Duration;

use kfs_worker::jobs::compile::parse::{self, raw::RawElement, route};
use kfs_worker::jobs::Deps;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::space::{space_fixture, SpaceFx};
use crate::support::unstructured::{self, StandIn};

const TENANT: &str = "tenant-documents";

const HANDBOOK_PDF: &[u8] = include_bytes!("../fixtures/documents/handbook.pdf");
const ENCRYPTED_PDF: &[u8] = include_bytes!("../fixtures/documents/handbook-encrypted.pdf");
const CORRUPT_PDF: &[u8] = include_bytes!("../fixtures/documents/handbook-corrupt.pdf");
const SCANNED_PDF: &[u8] = include_bytes!("../fixtures/documents/scanned.pdf");
const GUIDE_DOCX: &[u8] = include_bytes!("../fixtures/documents/guide.docx");
const DECK_PPTX: &[u8] = include_bytes!("../fixtures/documents/deck.pptx");

const PDF: &str = "application/pdf";
const DOCX: &str = "application/vnd.openxmlformats-officedocument.wordprocessingml.document";
const PPTX: &str = "application/vnd.openxmlformats-officedocument.presentationml.presentation";

/// The three documents, each with the words that must be findable after its compile and the
/// page (PDF page, slide) each is on, where it has pages.
/// A document: name, MIME type, bytes, and each findable word with its page.
type Document = (
    &'static str,
    &'static str,
    &'static [u8],
    Vec<(&'static str, Option<i32>)>,
);

fn documents() -> Vec<Document> {
    vec![
        (
            "handbook.pdf",
            PDF,
            HANDBOOK_PDF,
            vec![
                ("aurora", Some(1)),
                ("quaternion", Some(2)),
                ("sourdough", Some(3)),
            ],
        ),
        (
            "guide.docx",
            DOCX,
            GUIDE_DOCX,
            vec![("photosynthesis", None), ("mitochondria", None)],
        ),
        (
            "deck.pptx",
            PPTX,
            DECK_PPTX,
            vec![("kubernetes", None), ("terraform", None)],
        ),
    ]
}

space_fixture!(Fx);

impl Fx {
    async fn new(slug: &str) -> Fx {
        Fx(SpaceFx::new(TENANT, slug, "Documents").await)
    }

    /// The parse artifact of `doc`: parser, metadata, elements.
    async fn artifact(&self, doc: Uuid) -> Option<(String, Value, Vec<Value>)> {
        let row: Option<(String, Value, Value)> = sqlx::query_as(
            "SELECT parser, metadata, elements FROM parse_artifacts WHERE document_asset_id = $1",
        )
        .bind(doc)
        .fetch_optional(self.pool())
        .await
        .unwrap();
        row.map(|(p, m, e)| (p, m, e.as_array().cloned().unwrap_or_default()))
    }

    async fn count(&self, sql: &str, doc: Uuid) -> i64 {
        sqlx::query_scalar(sql)
            .bind(doc)
            .fetch_one(self.pool())
            .await
            .unwrap()
    }

    async fn checkpoints(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM parse_artifact_checkpoints")
            .fetch_one(self.pool())
            .await
            .unwrap()
    }

    /// The titles of `doc`'s published outline.
    async fn outline_titles(&self, doc: Uuid) -> String {
        let nodes: Value = sqlx::query_scalar(
            "SELECT nodes FROM document_outlines WHERE document_asset_id = $1 \
             ORDER BY created_at DESC LIMIT 1",
        )
        .bind(doc)
        .fetch_one(self.pool())
        .await
        .unwrap();
        nodes.to_string()
    }

    /// Asserts `doc` compiled into published, findable knowledge from its parse: its words are
    /// found in what the head serves, on their pages; its headings are in its outline.
    async fn assert_findable(&self, doc: Uuid, name: &str, words: &[(&str, Option<i32>)]) {
        for (word, page) in words {
            let hits = self.search(word).await;
            let hit = hits
                .iter()
                .find(|h| h.document_asset_id == doc)
                .unwrap_or_else(|| panic!("{word:?} of {name} is not findable: {hits:?}"));
            assert!(
                hit.text.to_lowercase().contains(word),
                "{name}: the hit for {word:?} is {:?}",
                hit.text
            );
            if let Some(p) = page {
                assert_eq!(
                    hit.source_location["pageNumber"],
                    json!(p),
                    "{name}: {word:?} is on page {p}: {}",
                    hit.source_location
                );
            }
        }
        let (parser, _, elements) = self.artifact(doc).await.expect("a parse artifact");
        assert_eq!(parser, "unstructured", "{name}: the platform's parser enum");
        let headings: Vec<&str> = elements
            .iter()
            .filter(|e| e["type"] == "title")
            .filter_map(|e| e["text"].as_str())
            .collect();
        assert!(headings.len() >= 2, "{name}: headings {headings:?}");
        let outline = self.outline_titles(doc).await;
        for h in &headings {
            assert!(
                outline.contains(h),
                "{name}: {h:?} not in the outline {outline}"
            );
        }
        assert!(
            elements.iter().any(|e| e["type"] == "list"),
            "{name}: its bullets are list elements"
        );
    }
}

/// The stand-in's answer: the crate's own local parse of the bytes, in the service's JSON.
fn local_as_service(bytes: &[u8], filename: &str) -> Result<Value, (u16, String)> {
    let parsed: Result<Vec<RawElement>, parse::ParseError> = if filename.ends_with(".pdf") {
        parse::pdf::parse_pdf(bytes)
    } else if filename.ends_with(".docx") {
        parse::office::parse_docx(bytes)
    } else if filename.ends_with(".pptx") {
        parse::office::parse_pptx(bytes)
    } else {
        return Err((422, format!("{{\"detail\":\"unsupported {filename}\"}}")));
    };
    match parsed {
        Ok(e) => Ok(unstructured::unstructured_json(&e)),
        // A service finds no elements in pages without text.
        Err(parse::ParseError::Empty(_)) => Ok(json!([])),
        Err(e) => Err((422, json!({ "detail": e.to_string() }).to_string())),
    }
}

const KEY: &str = "sk-standin-secret-4711";

async fn stand_in() -> StandIn {
    unstructured::start(Some(KEY), Arc::new(local_as_service)).await
}

/// Parsers that call the stand-in.
fn remote_parsers(s: &StandIn) -> Arc<route::Parsers> {
    let url = s.url();
    let cfg = route::parser_config(|k| match k {
        "UNSTRUCTURED_API_URL" => Some(url.clone()),
        "UNSTRUCTURED_API_KEY" => Some(KEY.to_owned()),
        "UNSTRUCTURED_REQUEST_TIMEOUT_MS" => Some("20000".to_owned()),
        _ => None,
    })
    .unwrap();
    assert!(cfg.remote.is_some());
    Arc::new(route::Parsers::new(&cfg).unwrap())
}

fn deps(fx: &Fx, parsers: Arc<route::Parsers>) -> Deps {
    let mut d = Deps::offline(fx.store.clone());
    d.parsers = parsers;
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pdf_a_word_and_a_powerpoint_document_compile_through_the_local_parsers_into_findable_knowledge(
) {
    let fx = Fx::new("local").await;
    for (name, mime, bytes, words) in documents() {
        let doc = fx.add(name, mime, bytes).await;
        fx.compile(doc).await;
        fx.assert_findable(doc, name, &words).await;
        let (_, metadata, elements) = fx.artifact(doc).await.unwrap();
        assert_eq!(metadata["backendRevision"], route::LOCAL_BACKEND, "{name}");
        assert_eq!(metadata["parserVersion"], route::PARSER_VERSION, "{name}");
        if name.ends_with(".pdf") || name.ends_with(".pptx") {
            let pages: std::collections::BTreeSet<i64> = elements
                .iter()
                .filter_map(|e| e["pageNumber"].as_i64())
                .collect();
            assert_eq!(pages, (1..=3).collect(), "{name}: every page is recorded");
        }
        if name.ends_with(".docx") || name.ends_with(".pptx") {
            assert!(
                elements.iter().any(|e| e["type"] == "table"),
                "{name}: its table is a table element"
            );
        }
    }
    assert_eq!(fx.served().await.len(), 3);
    assert_eq!(
        fx.checkpoints().await,
        0,
        "each checkpoint went with its artifact"
    );
    fx.0.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_documents_compile_through_the_parser_service_route_against_a_stand_in() {
    let fx = Fx::new("remote").await;
    let service = stand_in().await;
    let engine = fx.engine_with("w-remote", 64, deps(&fx, remote_parsers(&service)));
    for (name, mime, bytes, words) in documents() {
        let doc = fx.add(name, mime, bytes).await;
        let attempt = fx.request(doc, false).await.unwrap();
        let s = fx.drive(&engine, attempt).await;
        assert_eq!(s.run_state, "succeeded", "{name}: {s:?}");
        fx.assert_findable(doc, name, &words).await;
        let (_, metadata, _) = fx.artifact(doc).await.unwrap();
        assert_eq!(
            metadata["backendRevision"], "external-unversioned",
            "{name}"
        );
        assert_eq!(metadata["routedParser"], "unstructured");
    }
    let requests = service.requests();
    assert_eq!(requests.len(), 3, "one request per document: {requests:?}");
    for r in &requests {
        assert!(
            r.authorized,
            "the key went in the Authorization header: {r:?}"
        );
        assert_eq!(r.coordinates.as_deref(), Some("true"), "{r:?}");
        assert!(r.strategy.is_some(), "{r:?}");
    }
    assert_eq!(
        requests
            .iter()
            .map(|r| r.filename.as_deref().unwrap_or(""))
            .collect::<Vec<_>>(),
        ["handbook.pdf", "guide.docx", "deck.pptx"]
    );
    // The key is never written anywhere a reader sees.
    let leaked: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM parse_artifacts WHERE metadata::text LIKE '%' || $1 || '%') \
           + (SELECT count(*) FROM document_compilation_attempts WHERE coalesce(last_error_message, '') LIKE '%' || $1 || '%')",
    )
    .bind(KEY)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(leaked, 0);
    fx.0.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_an_encrypted_and_a_textless_pdf_each_fail_with_one_code_and_write_nothing() {
    let fx = Fx::new("unreadable").await;
    let service = stand_in().await;
    let local = fx.engine("w-local", 64);
    let remote = fx.engine_with("w-remote", 64, deps(&fx, remote_parsers(&service)));
    let head_before = fx.head().await;
    for (engine, route) in [(&local, "local"), (&remote, "service")] {
        for (name, bytes, says) in [
            ("corrupt.pdf", CORRUPT_PDF, "corrupt"),
            ("encrypted.pdf", ENCRYPTED_PDF, "password"),
            ("scanned.pdf", SCANNED_PDF, "no extractable text"),
        ] {
            let doc = fx.add(name, PDF, bytes).await;
            let attempt = fx.request(doc, false).await.unwrap();
            let s = fx.drive(engine, attempt).await;
            assert_eq!(s.run_state, "failed", "{route} {name}: {s:?}");
            assert_eq!(
                s.last_error_code.as_deref(),
                Some(route::INPUT_INVALID),
                "{route} {name}: {s:?}"
            );
            let message = s.last_error_message.clone().unwrap_or_default();
            assert!(
                message.to_lowercase().contains(says),
                "{route} {name}: the message says why: {message}"
            );
            assert_eq!(s.checkpoint, "queued", "{route} {name}: nothing advanced");
            assert_eq!(s.execution_attempts, 1, "{route} {name}: not retried");
            assert!(
                fx.artifact(doc).await.is_none(),
                "{route} {name}: no artifact"
            );
            assert_eq!(
                fx.count(
                    "SELECT count(*) FROM knowledge_nodes WHERE document_asset_id = $1",
                    doc
                )
                .await,
                0
            );
            let status: String =
                sqlx::query_scalar("SELECT parser_status FROM document_assets WHERE id = $1")
                    .bind(doc)
                    .fetch_one(fx.pool())
                    .await
                    .unwrap();
            assert_eq!(status, "failed", "{route} {name}");
        }
    }
    assert_eq!(fx.checkpoints().await, 0);
    assert_eq!(fx.head().await, head_before, "nothing was published");
    assert_eq!(
        service
            .requests()
            .iter()
            .map(|r| r.filename.as_deref().unwrap_or(""))
            .collect::<Vec<_>>(),
        ["scanned.pdf"],
        "the preflight refused the corrupt and the encrypted PDF before any request"
    );
    fx.0.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_under_the_routes_policy_is_reused_and_one_under_another_is_parsed_again() {
    let fx = Fx::new("checkpoint").await;
    let service = stand_in().await;
    let parsers = remote_parsers(&service);
    let engine = fx.engine_with("w-checkpoint", 64, deps(&fx, parsers.clone()));
    let metadata = json!({});
    // A checkpoint made under this route's policy: the compile stores it and asks nothing.
    let kept = fx.add("kept.pdf", PDF, HANDBOOK_PDF).await;
    let fingerprint = parsers.policy_fingerprint(&route::Source {
        asset: kept,
        version: 1,
        format: parse::Format::Pdf,
        bytes: HANDBOOK_PDF,
        filename: "kept.pdf",
        mime_type: PDF,
        metadata: &metadata,
    });
    let checkpointed = route::Artifact {
        id: route::artifact_id(kept, 1),
        hash: "a".repeat(64),
        elements: parse::raw::to_elements(
            route::artifact_id(kept, 1),
            &[
                RawElement::title("Checkpointed", 0, Some(1)),
                RawElement::new("NarrativeText", "the zeppelin was checkpointed", Some(1)),
            ],
        ),
        metadata: json!({ "parserVersion": route::PARSER_VERSION }),
    };
    insert_checkpoint(&fx, kept, &fingerprint, &checkpointed.to_json(kept, 1)).await;
    // One under another policy: not reused, replaced by a fresh parse.
    let stale = fx.add("stale.pdf", PDF, HANDBOOK_PDF).await;
    let mut other = checkpointed.to_json(stale, 1);
    other["elements"] = json!([]);
    insert_checkpoint(&fx, stale, &"0".repeat(64), &other).await;

    for doc in [kept, stale] {
        let attempt = fx.request(doc, false).await.unwrap();
        let s = fx.drive(&engine, attempt).await;
        assert_eq!(s.run_state, "succeeded", "{s:?}");
    }
    assert!(
        fx.search("zeppelin")
            .await
            .iter()
            .any(|h| h.document_asset_id == kept),
        "the checkpointed parse was published"
    );
    assert_eq!(
        service
            .requests()
            .iter()
            .map(|r| r.filename.as_deref().unwrap_or(""))
            .collect::<Vec<_>>(),
        ["stale.pdf"],
        "only the document without a matching checkpoint was parsed"
    );
    fx.assert_findable(stale, "stale.pdf", &[("quaternion", Some(2))])
        .await;
    assert_eq!(
        fx.checkpoints().await,
        0,
        "both checkpoints went with their artifacts"
    );
    fx.0.cleanup().await;
}

async fn insert_checkpoint(fx: &Fx, doc: Uuid, fingerprint: &str, artifact: &Value) {
    sqlx::query(
        "INSERT INTO parse_artifact_checkpoints \
           (document_asset_id, version, policy_fingerprint, artifact, created_at, updated_at) \
         VALUES ($1, 1, $2, $3, now(), now())",
    )
    .bind(doc)
    .bind(fingerprint)
    .bind(artifact)
    .execute(fx.pool())
    .await
    .unwrap();
}

#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_after_the_raw_parse_checkpoint_is_followed_by_one_that_reuses_it() {
    let fx = Fx::new("crash").await;
    let service = stand_in().await;
    let http = crate::support::free_port();
    let env = |id: &str, crash: bool| {
        let mut e = vec![
            ("KFS_OBJECT_STORE", fx.store_url.clone()),
            ("KFS_KINDS", "compile".to_owned()),
            ("KFS_WORKER_ID", id.to_owned()),
            ("KFS_RELAY_POLL", "200ms".to_owned()),
            ("KFS_LEASES", "compile=60s".to_owned()),
            ("UNSTRUCTURED_API_URL", service.url()),
            ("UNSTRUCTURED_API_KEY", KEY.to_owned()),
        ];
        if crash {
            e.push(("KFS_CRASH_AT", "compile-after-parse-checkpoint".to_owned()));
        } else {
            e.push(("KFS_HTTP_ADDR", http.to_string()));
        }
        e
    };
    let spawn = |id: &str, crash: bool| {
        let e = env(id, crash);
        let e: Vec<(&str, &str)> = e.iter().map(|(k, v)| (*k, v.as_str())).collect();
        fx.env.spawn_worker(id, &["run"], &e)
    };
    let doc = fx.add("handbook.pdf", PDF, HANDBOOK_PDF).await;
    let attempt = fx.request(doc, false).await.unwrap();
    let mut a = spawn("a", true);
    let status = a.wait_exit(Duration::from_secs(90));
    let log = a.log_text();
    assert!(
        status.is_some_and(|s| !s.success()),
        "A did not abort: {status:?}\n{log}"
    );
    assert!(
        log.contains("crash point compile-after-parse-checkpoint reached"),
        "{log}"
    );
    assert_eq!(service.count(), 1, "A parsed once");
    assert_eq!(
        fx.checkpoints().await,
        1,
        "and checkpointed the parse before it died"
    );
    assert!(
        fx.artifact(doc).await.is_none(),
        "no canonical artifact yet"
    );

    let b = spawn("b", false);
    let ended = fx
        .env
        .wait_until(Duration::from_secs(90), || async {
            fx.status(attempt).await.is_terminal()
        })
        .await;
    let s = fx.status(attempt).await;
    assert!(ended, "the attempt did not end: {s:?}\n{}", b.tail(40));
    assert_eq!(s.run_state, "succeeded", "{s:?}");
    assert_eq!(service.count(), 1, "B did not parse again");
    let (_, metrics) = crate::support::http_get(http, "/metrics").await;
    let reused = metric(&metrics, "kfs_parse_checkpoints_total{outcome=\"reused\"}");
    assert_eq!(reused, Some(1.0), "B reused the checkpoint:\n{metrics}");
    assert_eq!(
        metric(&metrics, "kfs_document_parses_total"),
        None,
        "B ran no parse:\n{metrics}"
    );
    assert_eq!(fx.checkpoints().await, 0, "stored, then deleted");
    fx.assert_findable(doc, "handbook.pdf", &documents()[0].3)
        .await;
    crate::support::stop_cleanly(&mut [b], Duration::from_secs(20)).await;
    fx.0.cleanup().await;
}

/// The value of the first sample whose line starts with `prefix` in a Prometheus text page.
#[cfg(feature = "crash-points")]
fn metric(page: &str, prefix: &str) -> Option<f64> {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// A 1×1 PNG.
const PIXEL_PNG: &[u8] = &[
    0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48, 0x44, 0x52,
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x06, 0x00, 0x00, 0x00, 0x1f, 0x15, 0xc4,
    0x89, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9c, 0x63, 0xf8, 0xcf, 0xc0, 0xf0,
    0x1f, 0x00, 0x05, 0x00, 0x01, 0xff, 0x89, 0x99, 0x3d, 0x1d, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45,
    0x4e, 0x44, 0xae, 0x42, 0x60, 0x82,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_blocks_asked_of_the_service_are_stored_as_objects_not_inline() {
    use base64::Engine as _;
    let fx = Fx::new("images").await;
    // The service answers the local parse plus one image block, sent inline as it is when
    // image blocks are asked for.
    let service = unstructured::start(
        Some(KEY),
        Arc::new(|bytes: &[u8], name: &str| {
            let mut v = local_as_service(bytes, name)?;
            if let Some(a) = v.as_array_mut() {
                a.push(json!({
                    "type": "Image",
                    "element_id": "img-1",
                    "text": "",
                    "metadata": {
                        "page_number": 1,
                        "image_mime_type": "image/png",
                        "image_base64": base64::engine::general_purpose::STANDARD.encode(PIXEL_PNG),
                    },
                }));
            }
            Ok(v)
        }),
    )
    .await;
    let url = service.url();
    let cfg = route::parser_config(|k| match k {
        "UNSTRUCTURED_API_URL" => Some(url.clone()),
        "UNSTRUCTURED_API_KEY" => Some(KEY.to_owned()),
        "KFS_PARSER_REQUIRE_IMAGES" => Some("true".to_owned()),
        _ => None,
    })
    .unwrap();
    let parsers = Arc::new(route::Parsers::new(&cfg).unwrap());
    let engine = fx.engine_with("w-images", 64, deps(&fx, parsers));
    let doc = fx.add("handbook.pdf", PDF, HANDBOOK_PDF).await;
    let attempt = fx.request(doc, false).await.unwrap();
    let s = fx.drive(&engine, attempt).await;
    assert_eq!(s.run_state, "succeeded", "{s:?}");

    let asked = &service.requests()[0];
    assert_eq!(
        asked.extract_image_block_types,
        ["Image", "Table"],
        "{asked:?}"
    );
    assert_eq!(
        asked.extract_image_block_to_payload.as_deref(),
        Some("true")
    );
    let (_, metadata, elements) = fx.artifact(doc).await.unwrap();
    let image = elements
        .iter()
        .find(|e| e["type"] == "image")
        .expect("the image block is an image element");
    let asset = &image["metadata"]["assetRef"];
    let key = asset["objectKey"].as_str().expect("stored under a key");
    assert!(
        key.contains(&format!("/documents/{doc}/assets/{attempt}/")),
        "under the document and the attempt: {key}"
    );
    assert_eq!(asset["contentType"], "image/png");
    assert_eq!(asset["source"], "data-uri");
    let stored = fx.store.get(key).await.unwrap();
    assert_eq!(&stored[..], PIXEL_PNG);
    assert_eq!(metadata["multimodalAssets"]["extractedCount"], 1);
    let text = serde_json::to_string(&elements).unwrap();
    assert!(!text.contains("data:image"), "no image stays inline");
    fx.0.cleanup().await;
}
