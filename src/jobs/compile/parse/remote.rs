//! The adapter for the platform's remote parser service, an Unstructured-compatible
//! `POST /general/v0/general`: its settings, the request policy (strategy, language, image
//! blocks), the policy fingerprint and artifact hash the raw-parse checkpoint is keyed by, and
//! the call itself, returning [`RawElement`]s.
//!
//! Invariant: one parse is one admitted request (repeated in place only after an explicit
//! retryable status, and only as often as `UNSTRUCTURED_MAX_RETRIES` allows), bounded in time
//! (the workload's deadline covers every attempt, the pauses between them and the whole answer)
//! and in size (the document and the answer); the API key never leaves the `Authorization`
//! header (no `Debug`, `Display`, error or log shows it, and redirects are not followed); and
//! every failure is one classified [`RemoteError`] carrying the platform's public code.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::raw::{RawElement, RawMetadata};

/// The parser version the platform records for this route (part of the fingerprint and the
/// artifact hash).
pub const PARSER_VERSION: &str = "unstructured@12";
/// The most elements one parse may return.
pub const MAX_ELEMENTS: usize = 20_000;
/// The partition path appended to `UNSTRUCTURED_API_URL` unless it already ends with it.
pub const PARTITION_PATH: &str = "/general/v0/general";
/// `UNSTRUCTURED_BACKEND_REVISION` when unset.
pub const DEFAULT_BACKEND_REVISION: &str = "external-unversioned";
/// The route reason the platform's router records for the binary formats sent here.
pub const ROUTE_COMPLEX_FILE_TYPE: &str = "complex-file-type";

const MIB: u64 = 1024 * 1024;
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 600_000;
pub const MAX_REQUEST_TIMEOUT_MS: u64 = 3_600_000;
pub const DEFAULT_MAX_CONCURRENCY: usize = 2;
pub const MAX_CONCURRENCY: usize = 32;
pub const DEFAULT_MAX_INPUT_BYTES: u64 = 15 * MIB;
pub const MAX_INPUT_BYTES: u64 = 50 * MIB;
pub const DEFAULT_MAX_RESPONSE_BYTES: u64 = 32 * MIB;
pub const DEFAULT_RETRY_DELAY_MS: u64 = 100;
const MAX_BACKEND_REVISION_CHARS: usize = 256;

/// Connecting to the service may take at most this (within the deadline).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The lease grace on top of the deadline is at most this.
const MAX_LEASE_GRACE: Duration = Duration::from_secs(300);
/// A body over this is heavy work.
const HEAVY_BODY_BYTES: usize = 8 * 1024 * 1024;
/// `%PDF-` within this many leading bytes marks a PDF.
const PDF_MAGIC_WINDOW: usize = 1024;
/// An error answer is inspected only up to this size ...
const ERROR_BODY_BYTES: usize = 4 * 1024;
/// ... and for at most this long.
const ERROR_BODY_WAIT: Duration = Duration::from_secs(1);
/// The parser sandbox's versioned rejection.
const SANDBOX_CODE: &str = "PARSER_RESOURCE_REJECTED";
const SANDBOX_REVISION: &str = "knowledgefs-unstructured-sandbox-v1";
/// Sandbox reasons that, with HTTP 413, mean the document is too big for the service.
const SANDBOX_INPUT_REASONS: &[&str] = &[
    "input_bytes",
    "response_bytes",
    "request_metadata_bytes",
    "response_metadata_bytes",
    "memory_bytes",
    "temp_bytes",
    "temp_entries",
    "cpu_seconds",
    "process_limit",
    "worker_resource_limit",
    "worker_terminated",
];
/// Sandbox reasons that, with HTTP 422, mean the document itself is unsafe or malformed.
const SANDBOX_DOCUMENT_REASONS: &[&str] = &[
    "depth",
    "attachments",
    "mime_parts",
    "decoded_bytes",
    "unsupported_attachment",
    "msg_invalid",
    "ole_invalid",
    "mime_invalid",
    "archive_entries",
    "expanded_bytes",
    "archive_path",
    "archive_encrypted",
    "archive_invalid",
    "xml_bytes",
    "xml_member_bytes",
    "xml_entity",
    "xml_depth",
    "xml_nodes",
    "sheets",
    "sheet_extent",
    "sheet_cells",
    "sheet_cell_reference",
    "workbook_cells",
    "multipart_required",
    "multipart_invalid",
    "multipart_fields",
    "multipart_files",
];
/// The exact message (with three numbers) the service gives for a PDF page too big to render.
const RASTER_LIMIT_PREFIX: &str =
    "PDF page would render to too many pixels for safe processing: page=";
const RASTER_LIMIT_SUFFIX: &str =
    ". Try splitting the PDF, reducing the page dimensions, or using a lower render DPI.";
/// The largest integer a JavaScript number holds exactly.
const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// Extensions (and their upload MIME types) of the formats the platform routes to this
/// service (`complex-file-type`).
const REMOTE_FORMATS: &[(&str, &[&str])] = &[
    ("doc", &["application/msword"]),
    (
        "docx",
        &["application/vnd.openxmlformats-officedocument.wordprocessingml.document"],
    ),
    ("eml", &["message/rfc822"]),
    ("epub", &["application/epub+zip"]),
    ("msg", &["application/vnd.ms-outlook", "application/x-msg"]),
    ("odt", &["application/vnd.oasis.opendocument.text"]),
    ("pdf", &["application/pdf"]),
    (
        "ppt",
        &[
            "application/vnd.ms-powerpoint",
            "application/mspowerpoint",
            "application/x-mspowerpoint",
        ],
    ),
    (
        "pptx",
        &["application/vnd.openxmlformats-officedocument.presentationml.presentation"],
    ),
    ("rtf", &["application/rtf", "text/rtf", "application/x-rtf"]),
    (
        "xls",
        &[
            "application/vnd.ms-excel",
            "application/excel",
            "application/x-excel",
            "application/x-msexcel",
        ],
    ),
    (
        "xlsx",
        &["application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"],
    ),
];
/// Extensions of the formats the platform's native parsers take; their MIME types do not route
/// here (the extension wins over the MIME type).
const NATIVE_EXTENSIONS: &[&str] = &[
    "csv",
    "htm",
    "html",
    "json",
    "jsonl",
    "markdown",
    "md",
    "mdx",
    "ndjson",
    "properties",
    "text",
    "txt",
    "vtt",
    "xml",
    "yaml",
    "yml",
];
/// Formats the service cannot look inside before parsing: always heavy work.
const OPAQUE_FORMATS: &[&str] = &["doc", "eml", "msg", "ppt", "rtf", "xls"];

// ---------------------------------------------------------------------------------------------
// Settings

/// The settings of the remote parser route, as the platform reads them from its environment.
#[derive(Clone, PartialEq, Eq)]
pub struct UnstructuredSettings {
    /// The partition endpoint (ends with [`PARTITION_PATH`]; never carries credentials).
    pub endpoint: url::Url,
    /// Sent as `authorization: Bearer <key>`; never printed.
    api_key: Option<String>,
    /// The deadline of ordinary work, from admission to the last byte of the answer.
    pub request_timeout: Duration,
    /// The deadline of heavy work (PDF, large or opaque documents).
    pub heavy_request_timeout: Duration,
    /// Requests in flight at once in this process.
    pub max_concurrency: usize,
    /// Heavy requests in flight at once (a nested gate, at most `max_concurrency`).
    pub heavy_max_concurrency: usize,
    /// Larger documents are refused before any request.
    pub max_input_bytes: u64,
    /// Larger answers are refused.
    pub max_response_bytes: u64,
    /// Repeats of a request answered with 408, 425, 429 or 5xx.
    pub max_retries: u32,
    /// The fixed pause before each repeat.
    pub retry_delay: Duration,
    /// The language hint when a document has none.
    pub default_language: Option<String>,
    /// The identity of the service's image and policy; part of the policy fingerprint.
    pub backend_revision: String,
}

impl fmt::Debug for UnstructuredSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnstructuredSettings")
            .field("endpoint", &self.endpoint.as_str())
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("request_timeout", &self.request_timeout)
            .field("heavy_request_timeout", &self.heavy_request_timeout)
            .field("max_concurrency", &self.max_concurrency)
            .field("heavy_max_concurrency", &self.heavy_max_concurrency)
            .field("max_input_bytes", &self.max_input_bytes)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("max_retries", &self.max_retries)
            .field("retry_delay", &self.retry_delay)
            .field("default_language", &self.default_language)
            .field("backend_revision", &self.backend_revision)
            .finish()
    }
}

impl UnstructuredSettings {
    /// Reads the settings through `get` (e.g. `|k| std::env::var(k).ok()`). `Ok(None)` when
    /// `UNSTRUCTURED_API_URL` is unset or blank: the route is off. Each bad value is one error
    /// naming the variable and what it accepts; the key and the URL's text are never echoed.
    /// A blank numeric setting counts as unset.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, String> {
        let Some(raw_url) = get("UNSTRUCTURED_API_URL")
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
        else {
            return Ok(None);
        };
        let endpoint = partition_endpoint(&raw_url)?;

        let api_key = get("UNSTRUCTURED_API_KEY")
            .map(|k| k.trim().to_owned())
            .filter(|k| !k.is_empty());
        if let Some(key) = &api_key {
            if !key.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
                return Err(
                    "UNSTRUCTURED_API_KEY: must be printable ASCII without spaces \
                            (it is sent in an HTTP header)"
                        .into(),
                );
            }
        }

        let request_timeout_ms = bounded(
            &get,
            "UNSTRUCTURED_REQUEST_TIMEOUT_MS",
            1,
            MAX_REQUEST_TIMEOUT_MS,
        )?
        .unwrap_or(DEFAULT_REQUEST_TIMEOUT_MS);
        let heavy_request_timeout_ms = match aliased(
            &get,
            "UNSTRUCTURED_HEAVY_REQUEST_TIMEOUT_MS",
            "UNSTRUCTURED_PDF_REQUEST_TIMEOUT_MS",
        ) {
            Some(var) => bounded(&get, var, 1, MAX_REQUEST_TIMEOUT_MS)?,
            None => None,
        }
        .unwrap_or(request_timeout_ms);

        let max_concurrency = bounded(&get, "UNSTRUCTURED_MAX_CONCURRENCY", 1, 32)?
            .map_or(DEFAULT_MAX_CONCURRENCY, |n| n as usize);
        let heavy_var = aliased(
            &get,
            "UNSTRUCTURED_HEAVY_MAX_CONCURRENCY",
            "UNSTRUCTURED_PDF_MAX_CONCURRENCY",
        );
        let heavy_max_concurrency = match heavy_var {
            Some(var) => bounded(&get, var, 1, MAX_CONCURRENCY as u64)?,
            None => None,
        }
        .map_or(max_concurrency, |n| n as usize);
        if heavy_max_concurrency > max_concurrency {
            return Err(format!(
                "{}: must not exceed UNSTRUCTURED_MAX_CONCURRENCY ({max_concurrency}), got \
                 {heavy_max_concurrency}",
                heavy_var.unwrap_or("UNSTRUCTURED_HEAVY_MAX_CONCURRENCY")
            ));
        }

        let max_input_bytes = bounded(&get, "UNSTRUCTURED_MAX_INPUT_BYTES", 1, MAX_INPUT_BYTES)?
            .unwrap_or(DEFAULT_MAX_INPUT_BYTES);
        let max_response_bytes =
            bounded(&get, "UNSTRUCTURED_MAX_RESPONSE_BYTES", 1, MAX_SAFE_INTEGER)?
                .unwrap_or(DEFAULT_MAX_RESPONSE_BYTES);
        let max_retries = bounded(&get, "UNSTRUCTURED_MAX_RETRIES", 0, u64::from(u32::MAX))?
            .map_or(0, |n| n as u32);
        let retry_delay_ms = bounded(
            &get,
            "UNSTRUCTURED_RETRY_DELAY_MS",
            0,
            MAX_REQUEST_TIMEOUT_MS,
        )?
        .unwrap_or(DEFAULT_RETRY_DELAY_MS);

        let default_language = get("UNSTRUCTURED_DEFAULT_LANGUAGE")
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty());
        let backend_revision = match get("UNSTRUCTURED_BACKEND_REVISION") {
            None => DEFAULT_BACKEND_REVISION.to_owned(),
            Some(v) => {
                let v = v.trim();
                let chars = v.chars().count();
                if chars == 0 || chars > MAX_BACKEND_REVISION_CHARS {
                    return Err(format!(
                        "UNSTRUCTURED_BACKEND_REVISION: must be 1 to \
                         {MAX_BACKEND_REVISION_CHARS} characters, got {chars}"
                    ));
                }
                v.to_owned()
            }
        };

        Ok(Some(Self {
            endpoint,
            api_key,
            request_timeout: Duration::from_millis(request_timeout_ms),
            heavy_request_timeout: Duration::from_millis(heavy_request_timeout_ms),
            max_concurrency,
            heavy_max_concurrency,
            max_input_bytes,
            max_response_bytes,
            max_retries,
            retry_delay: Duration::from_millis(retry_delay_ms),
            default_language,
            backend_revision,
        }))
    }

    /// Whether requests carry an `Authorization` header.
    pub fn has_api_key(&self) -> bool {
        self.api_key.is_some()
    }
}

/// The partition endpoint of `raw` (already trimmed): trailing `/` removed, then
/// [`PARTITION_PATH`] appended unless the URL already ends with it.
fn partition_endpoint(raw: &str) -> Result<url::Url, String> {
    const VAR: &str = "UNSTRUCTURED_API_URL";
    const EXAMPLE: &str = "http://unstructured:8000";
    let trimmed = raw.trim_end_matches('/');
    let full = if trimmed.ends_with(PARTITION_PATH) {
        trimmed.to_owned()
    } else {
        format!("{trimmed}{PARTITION_PATH}")
    };
    // The URL's text is never echoed: a malformed URL may still hold a password.
    let url = url::Url::parse(&full)
        .map_err(|e| format!("{VAR}: is not a valid URL ({e}); expected e.g. {EXAMPLE}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!(
            "{VAR}: has scheme '{}', expected http or https; e.g. {EXAMPLE}",
            url.scheme()
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(format!("{VAR}: has no host; expected e.g. {EXAMPLE}"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(format!(
            "{VAR}: must not carry credentials (user:password@); put the key in \
             UNSTRUCTURED_API_KEY"
        ));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(format!(
            "{VAR}: must not carry a query or fragment; expected e.g. {EXAMPLE}"
        ));
    }
    Ok(url)
}

/// The first of `primary` and its lower-precedence `alias` that is set (and not blank).
fn aliased(
    get: &impl Fn(&str) -> Option<String>,
    primary: &'static str,
    alias: &'static str,
) -> Option<&'static str> {
    [primary, alias]
        .into_iter()
        .find(|var| get(var).is_some_and(|v| !v.trim().is_empty()))
}

/// An integer in `min..=max` from `var`; `None` when unset or blank.
fn bounded(
    get: &impl Fn(&str) -> Option<String>,
    var: &str,
    min: u64,
    max: u64,
) -> Result<Option<u64>, String> {
    let Some(raw) = get(var) else {
        return Ok(None);
    };
    let raw = raw.trim();
    if raw.is_empty() {
        return Ok(None);
    }
    let shown: String = raw.chars().take(40).collect();
    let problem = || format!("{var}: must be an integer from {min} to {max}, got {shown:?}");
    if !raw.bytes().all(|b| b.is_ascii_digit()) {
        return Err(problem());
    }
    match raw.parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(Some(n)),
        _ => Err(problem()),
    }
}

// ---------------------------------------------------------------------------------------------
// The request

/// One document to parse and the hints that shape the request.
#[derive(Clone, Copy)]
pub struct ParseRequest<'a> {
    pub bytes: &'a [u8],
    pub filename: &'a str,
    pub mime_type: &'a str,
    /// The document's language tag (metadata `language`); the default language when `None`.
    pub language: Option<&'a str>,
    /// Whether image (and, for PDF, table) blocks are wanted as base64 payloads.
    pub requires_images: bool,
    /// Metadata `layoutComplexity`: `simple` or `complex`.
    pub layout_complexity: Option<&'a str>,
    /// Metadata `requiresOcr`.
    pub requires_ocr: bool,
    /// Metadata `requiresTables`.
    pub requires_tables: bool,
    /// A PDF's images are produced elsewhere (a local rasteriser), so none are asked for.
    pub images_handled_externally: bool,
}

impl fmt::Debug for ParseRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ParseRequest")
            .field("bytes", &self.bytes.len())
            .field("filename", &self.filename)
            .field("mime_type", &self.mime_type)
            .field("language", &self.language)
            .field("requires_images", &self.requires_images)
            .field("layout_complexity", &self.layout_complexity)
            .field("requires_ocr", &self.requires_ocr)
            .field("requires_tables", &self.requires_tables)
            .field("images_handled_externally", &self.images_handled_externally)
            .finish()
    }
}

impl<'a> ParseRequest<'a> {
    /// A request without hints.
    pub fn new(bytes: &'a [u8], filename: &'a str, mime_type: &'a str) -> Self {
        Self {
            bytes,
            filename,
            mime_type,
            language: None,
            requires_images: false,
            layout_complexity: None,
            requires_ocr: false,
            requires_tables: false,
            images_handled_externally: false,
        }
    }

    /// Takes the hints from a document's metadata object: `language` and `layoutComplexity`
    /// (strings), `requiresOcr` and `requiresTables` (`true` only when JSON `true`). Other
    /// keys and values of other types are ignored.
    pub fn hints_from_metadata(mut self, metadata: &'a Value) -> Self {
        self.language = metadata.get("language").and_then(Value::as_str);
        self.layout_complexity = metadata.get("layoutComplexity").and_then(Value::as_str);
        self.requires_ocr = metadata.get("requiresOcr") == Some(&Value::Bool(true));
        self.requires_tables = metadata.get("requiresTables") == Some(&Value::Bool(true));
        self
    }

    /// The MIME type without parameters, trimmed and lowercased.
    fn mime_essence(&self) -> String {
        self.mime_type
            .split(';')
            .next()
            .map(js_trim)
            .unwrap_or("")
            .to_lowercase()
    }

    /// The lowercased extension, if the name has a non-empty one.
    fn extension(&self) -> Option<String> {
        let name = js_trim(self.filename).to_lowercase();
        let (_, ext) = name.rsplit_once('.')?;
        (!ext.is_empty()).then(|| ext.to_owned())
    }

    /// A PDF by its MIME type (what the request policy goes by).
    fn is_pdf_mime(&self) -> bool {
        self.mime_essence() == "application/pdf"
    }

    /// The extension of the remote format this is (by extension first, else by MIME type).
    fn remote_format(&self) -> Option<&'static str> {
        if let Some(ext) = self.extension() {
            if let Some((known, _)) = REMOTE_FORMATS.iter().find(|(e, _)| *e == ext) {
                return Some(known);
            }
            if NATIVE_EXTENSIONS.contains(&ext.as_str()) {
                return None;
            }
        }
        let mime = self.mime_essence();
        REMOTE_FORMATS
            .iter()
            .find(|(_, mimes)| mimes.contains(&mime.as_str()))
            .map(|(e, _)| *e)
    }

    /// An Office, OpenDocument or EPUB archive, whose embedded media the platform takes from
    /// the archive itself rather than asking the service for image blocks.
    fn is_media_archive(&self) -> bool {
        let name = js_trim(self.filename).to_lowercase();
        let mime = js_trim(self.mime_type).to_lowercase();
        let ends = |exts: &[&str]| exts.iter().any(|e| name.ends_with(e));
        ends(&[".docm", ".docx", ".dotm", ".dotx"])
            || mime.contains("wordprocessingml")
            || mime.contains("ms-word.document.macroenabled")
            || ends(&[".potm", ".potx", ".ppsm", ".ppsx", ".pptm", ".pptx"])
            || mime.contains("presentationml")
            || mime.contains("ms-powerpoint.presentation.macroenabled")
            || ends(&[".xlsb", ".xlsm", ".xlsx", ".xltm", ".xltx"])
            || mime.contains("spreadsheetml")
            || mime.contains("ms-excel.sheet.macroenabled")
            || mime.contains("ms-excel.sheet.binary.macroenabled")
            || name.ends_with(".vsdx")
            || mime.contains("visio.drawing")
            || ends(&[".odp", ".ods", ".odt"])
            || mime.starts_with("application/vnd.oasis.opendocument.")
            || name.ends_with(".epub")
            || mime == "application/epub+zip"
    }
}

/// `String.prototype.trim` (which also strips U+FEFF).
fn js_trim(s: &str) -> &str {
    s.trim_matches(|c: char| c.is_whitespace() || c == '\u{feff}')
}

/// The image block types asked for: none unless images are required and not taken from
/// elsewhere; `Image` and `Table` for a PDF, `Image` otherwise.
pub fn image_block_types(req: &ParseRequest<'_>) -> &'static [&'static str] {
    if !req.requires_images
        || req.is_media_archive()
        || (req.is_pdf_mime() && req.images_handled_externally)
    {
        &[]
    } else if req.is_pdf_mime() {
        &["Image", "Table"]
    } else {
        &["Image"]
    }
}

/// The partition strategy: `hi_res` when OCR, a complex layout, tables or image blocks are
/// wanted (or images of a PDF), `fast` for a simple layout, else `auto`.
pub fn strategy(req: &ParseRequest<'_>) -> &'static str {
    if req.requires_ocr
        || req.layout_complexity == Some("complex")
        || req.requires_tables
        || !image_block_types(req).is_empty()
        || (req.requires_images && req.is_pdf_mime())
    {
        "hi_res"
    } else if req.layout_complexity == Some("simple") {
        "fast"
    } else {
        "auto"
    }
}

/// The ISO 639-3 code the service takes for a language tag: the base tag (before `-`) mapped
/// for the common languages, any other tag passed through lowercased; `None` when blank.
pub fn iso639_3(tag: &str) -> Option<String> {
    let tag = js_trim(tag).to_lowercase();
    if tag.is_empty() {
        return None;
    }
    let base = tag.split('-').next().unwrap_or(&tag);
    let mapped = match base {
        "ar" => "ara",
        "de" => "deu",
        "en" => "eng",
        "es" => "spa",
        "fr" => "fra",
        "hi" => "hin",
        "ja" => "jpn",
        "ko" => "kor",
        "pt" => "por",
        "ru" => "rus",
        "zh" => "zho",
        _ => return Some(tag),
    };
    Some(mapped.to_owned())
}

/// Why the platform's router sends this document here: `ocr-required`, `complex-layout`,
/// `complex-file-type` (the binary formats), else `unsupported-file-type`.
pub fn route_reason(req: &ParseRequest<'_>) -> &'static str {
    if req.requires_ocr {
        "ocr-required"
    } else if req.layout_complexity == Some("complex") {
        "complex-layout"
    } else if req.remote_format().is_some() {
        ROUTE_COMPLEX_FILE_TYPE
    } else {
        "unsupported-file-type"
    }
}

/// `parserHints` of the artifact hash context (key order is the JSON key order).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ContextHints<'a> {
    images_handled_externally: bool,
    language: Option<String>,
    layout_complexity: Option<&'a str>,
    requires_images: bool,
    requires_ocr: bool,
    requires_tables: bool,
}

/// `request` of the artifact hash context.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ContextRequest {
    coordinates: bool,
    image_block_types: &'static [&'static str],
    image_payload: bool,
    language: Option<String>,
    strategy: &'static str,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Context<'a> {
    backend_revision: &'a str,
    filename: &'a str,
    mime_type: String,
    parser_hints: ContextHints<'a>,
    request: ContextRequest,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct FingerprintParser<'a> {
    artifact_hash_context: &'a str,
    max_elements: usize,
    version: &'static str,
}

#[derive(Serialize)]
struct Fingerprint<'a> {
    kind: &'static str,
    parser: FingerprintParser<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct RouterFingerprint<'a> {
    effective_fingerprint: &'a str,
    kind: &'static str,
    route_reason: &'static str,
    routed_parser: &'static str,
}

/// The platform's parser router's wrap of a routed parser's fingerprint: what a raw-parse
/// checkpoint records as its `policy_fingerprint`.
pub fn router_fingerprint(effective: &str, route_reason: &'static str) -> String {
    sha256_hex(
        to_json(&RouterFingerprint {
            effective_fingerprint: effective,
            kind: "router",
            route_reason,
            routed_parser: "unstructured",
        })
        .as_bytes(),
    )
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn to_json(value: &impl Serialize) -> String {
    // Plain structs of strings, booleans and numbers always serialise.
    serde_json::to_string(value).unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// Errors

/// A failed remote parse, classified as the platform classifies it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RemoteError {
    /// The document cannot be parsed as it is (too big, unsafe, malformed): never retried.
    Input { host: String, reason: String },
    /// The service answered 429.
    RateLimited { host: String },
    /// No usable answer: a transport failure (`status: None`, the outcome unknown) or an
    /// error status.
    RequestFailed {
        host: String,
        status: Option<u16>,
        retryable: bool,
        /// The service may still be working on the request.
        ambiguous: bool,
        cause: String,
    },
    /// The answer is not a parse: too big, not JSON, or not an array of elements.
    ResponseInvalid { host: String, reason: String },
    /// The deadline passed (`ambiguous`: the service may still be working, so a new attempt
    /// must not start before the lease runs out), or the service stopped at its own limit.
    Timeout {
        host: String,
        timeout_ms: u64,
        ambiguous: bool,
    },
}

impl RemoteError {
    /// The platform's public error code.
    pub fn code(&self) -> &'static str {
        match self {
            RemoteError::Input { .. } => "DOCUMENT_PARSER_INPUT_INVALID",
            RemoteError::RateLimited { .. } => "DOCUMENT_PARSER_RATE_LIMITED",
            RemoteError::RequestFailed { .. } => "DOCUMENT_PARSER_UNAVAILABLE",
            RemoteError::ResponseInvalid { .. } => "DOCUMENT_PARSER_RESPONSE_INVALID",
            RemoteError::Timeout { .. } => "DOCUMENT_PARSER_TIMEOUT",
        }
    }

    /// Whether a later attempt may succeed (automatic retry).
    pub fn retryable(&self) -> bool {
        match self {
            RemoteError::RateLimited { .. } => true,
            RemoteError::RequestFailed { retryable, .. } => *retryable,
            RemoteError::Input { .. }
            | RemoteError::ResponseInvalid { .. }
            | RemoteError::Timeout { .. } => false,
        }
    }

    /// Whether no answer came back, so the service may still be working on the request (the
    /// caller keeps its long lease then).
    pub fn ambiguous(&self) -> bool {
        match self {
            RemoteError::RequestFailed { ambiguous, .. }
            | RemoteError::Timeout { ambiguous, .. } => *ambiguous,
            _ => false,
        }
    }
}

impl fmt::Display for RemoteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RemoteError::Input { host, reason } => {
                write!(
                    f,
                    "the parser service at {host} cannot take this document: {reason}"
                )
            }
            RemoteError::RateLimited { host } => {
                write!(
                    f,
                    "the parser service at {host} is rate limiting requests (HTTP 429)"
                )
            }
            RemoteError::RequestFailed {
                host,
                status: Some(status),
                cause,
                ..
            } => {
                write!(f, "the parser service at {host} answered HTTP {status}")?;
                if !cause.is_empty() {
                    write!(f, ": {cause}")?;
                }
                Ok(())
            }
            RemoteError::RequestFailed {
                host,
                status: None,
                cause,
                ..
            } => write!(
                f,
                "the request to the parser service at {host} failed: {cause}"
            ),
            RemoteError::ResponseInvalid { host, reason } => {
                write!(
                    f,
                    "the parser service at {host} sent an unusable answer: {reason}"
                )
            }
            RemoteError::Timeout {
                host,
                timeout_ms,
                ambiguous: true,
            } => write!(
                f,
                "the parser service at {host} did not finish within the deadline \
                 (requestTimeoutMs={timeout_ms}); it may still be working on the document"
            ),
            RemoteError::Timeout {
                host,
                ambiguous: false,
                ..
            } => write!(
                f,
                "the parser service at {host} stopped the document at its own time limit \
                 (HTTP 504, wall_seconds)"
            ),
        }
    }
}

impl std::error::Error for RemoteError {}

/// 408, 425, 429 and 5xx may succeed when repeated.
fn retryable_status(status: u16) -> bool {
    matches!(status, 408 | 425 | 429) || status >= 500
}

/// A transport error and its causes, without the URL.
fn describe(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut out = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The client

/// The request policy of one document.
struct Policy {
    strategy: &'static str,
    image_block_types: &'static [&'static str],
    language: Option<String>,
}

struct Inner {
    settings: UnstructuredSettings,
    client: reqwest::Client,
    /// Every request holds a permit of this.
    gate: Semaphore,
    /// Heavy requests hold a permit of this first (lock order: heavy, then global).
    heavy_gate: Semaphore,
    /// `host:port` of the service, for messages.
    host: String,
}

/// The remote parser adapter; clones share the client and the admission gates.
#[derive(Clone)]
pub struct Unstructured {
    inner: Arc<Inner>,
}

impl fmt::Debug for Unstructured {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Unstructured")
            .field("settings", &self.inner.settings)
            .finish()
    }
}

impl Unstructured {
    pub fn new(settings: UnstructuredSettings) -> Result<Self, String> {
        if !(1..=MAX_CONCURRENCY).contains(&settings.max_concurrency) {
            return Err(format!(
                "UNSTRUCTURED_MAX_CONCURRENCY: must be an integer from 1 to {MAX_CONCURRENCY}, \
                 got {}",
                settings.max_concurrency
            ));
        }
        if settings.heavy_max_concurrency == 0
            || settings.heavy_max_concurrency > settings.max_concurrency
        {
            return Err(format!(
                "UNSTRUCTURED_HEAVY_MAX_CONCURRENCY: must be from 1 to \
                 UNSTRUCTURED_MAX_CONCURRENCY ({}), got {}",
                settings.max_concurrency, settings.heavy_max_concurrency
            ));
        }
        if settings.request_timeout.is_zero() || settings.heavy_request_timeout.is_zero() {
            return Err("UNSTRUCTURED_REQUEST_TIMEOUT_MS: must be at least 1".into());
        }
        let client = reqwest::Client::builder()
            // No total timeout here: the workload's deadline is enforced around the whole
            // exchange, so that it alone decides when a request has timed out. Connecting is
            // bounded as the platform's transport bounds it.
            .connect_timeout(CONNECT_TIMEOUT)
            // A redirect would be a second request, possibly elsewhere.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| {
                format!(
                    "UNSTRUCTURED_API_URL: cannot build the HTTP client: {}",
                    describe(e)
                )
            })?;
        let host = host_label(&settings.endpoint);
        Ok(Self {
            inner: Arc::new(Inner {
                gate: Semaphore::new(settings.max_concurrency),
                heavy_gate: Semaphore::new(settings.heavy_max_concurrency),
                settings,
                client,
                host,
            }),
        })
    }

    pub fn settings(&self) -> &UnstructuredSettings {
        &self.inner.settings
    }

    /// `host:port` of the service.
    pub fn host(&self) -> &str {
        &self.inner.host
    }

    /// Heavy work (its own narrower gate and deadline): any PDF signal (`%PDF-` in the first
    /// 1024 bytes, the MIME type or the extension), a body over 8 MiB, or an opaque format
    /// (doc, eml, msg, ppt, rtf, xls).
    pub fn is_heavy(&self, req: &ParseRequest<'_>) -> bool {
        let head = &req.bytes[..req.bytes.len().min(PDF_MAGIC_WINDOW)];
        let pdf_magic = head.windows(5).any(|w| w == b"%PDF-");
        let ext = req.extension();
        let pdf = pdf_magic || req.is_pdf_mime() || ext.as_deref() == Some("pdf");
        let mime = req.mime_essence();
        let opaque = OPAQUE_FORMATS.iter().any(|format| {
            ext.as_deref() == Some(*format)
                || REMOTE_FORMATS
                    .iter()
                    .any(|(e, mimes)| e == format && mimes.contains(&mime.as_str()))
        });
        pdf || req.bytes.len() > HEAVY_BODY_BYTES || opaque
    }

    /// The deadline of this document's workload class.
    pub fn timeout(&self, req: &ParseRequest<'_>) -> Duration {
        self.timeout_for(self.is_heavy(req))
    }

    fn timeout_for(&self, heavy: bool) -> Duration {
        let s = &self.inner.settings;
        if heavy {
            s.heavy_request_timeout
        } else {
            s.request_timeout
        }
    }

    /// How long the caller should hold its job lease for this parse: the deadline plus a grace
    /// of at most five minutes (default 600 s + 300 s = 900 s).
    pub fn lease(&self, req: &ParseRequest<'_>) -> Duration {
        let timeout = self.timeout(req);
        timeout + timeout.min(MAX_LEASE_GRACE)
    }

    /// The ISO 639-3 language sent: the document's hint, else the default language.
    pub fn language(&self, req: &ParseRequest<'_>) -> Option<String> {
        req.language
            .or(self.inner.settings.default_language.as_deref())
            .and_then(iso639_3)
    }

    fn policy(&self, req: &ParseRequest<'_>) -> Policy {
        Policy {
            strategy: strategy(req),
            image_block_types: image_block_types(req),
            language: self.language(req),
        }
    }

    /// The JSON text that identifies how this document is parsed (not its bytes): the
    /// platform's `artifactHashContext`, byte for byte.
    pub fn artifact_hash_context(&self, req: &ParseRequest<'_>) -> String {
        let policy = self.policy(req);
        let hint_language = req
            .language
            .map(|l| js_trim(l).to_lowercase())
            .filter(|l| !l.is_empty());
        to_json(&Context {
            backend_revision: &self.inner.settings.backend_revision,
            filename: req.filename,
            mime_type: js_trim(req.mime_type).to_lowercase(),
            parser_hints: ContextHints {
                images_handled_externally: req.images_handled_externally,
                language: hint_language,
                layout_complexity: req.layout_complexity,
                requires_images: req.requires_images,
                requires_ocr: req.requires_ocr,
                requires_tables: req.requires_tables,
            },
            request: ContextRequest {
                coordinates: true,
                image_block_types: policy.image_block_types,
                image_payload: !policy.image_block_types.is_empty(),
                language: policy.language,
                strategy: policy.strategy,
            },
        })
    }

    /// The fingerprint of this route's policy alone (the router's `effectiveFingerprint`).
    pub fn effective_fingerprint(&self, req: &ParseRequest<'_>) -> String {
        let context = self.artifact_hash_context(req);
        sha256_hex(
            to_json(&Fingerprint {
                kind: "unstructured",
                parser: FingerprintParser {
                    artifact_hash_context: &context,
                    max_elements: MAX_ELEMENTS,
                    version: PARSER_VERSION,
                },
            })
            .as_bytes(),
        )
    }

    /// The `policy_fingerprint` of the raw-parse checkpoint: 64 lowercase hex, the router's
    /// wrap of [`Self::effective_fingerprint`] with the route reason.
    pub fn policy_fingerprint(&self, req: &ParseRequest<'_>) -> String {
        router_fingerprint(&self.effective_fingerprint(req), route_reason(req))
    }

    /// The artifact hash: SHA-256 of `parserVersion + "\n" + context + "\n"` and the bytes.
    pub fn artifact_hash(&self, req: &ParseRequest<'_>) -> String {
        let mut hasher = Sha256::new();
        hasher.update(PARSER_VERSION.as_bytes());
        hasher.update(b"\n");
        hasher.update(self.artifact_hash_context(req).as_bytes());
        hasher.update(b"\n");
        hasher.update(req.bytes);
        hex::encode(hasher.finalize())
    }

    /// Parses one document remotely: refuses it when over `max_input_bytes`, waits for the
    /// heavy gate (heavy work) and the global gate, then runs the exchange under the workload's
    /// deadline.
    pub async fn parse(&self, req: &ParseRequest<'_>) -> Result<Vec<RawElement>, RemoteError> {
        let s = &self.inner.settings;
        let host = || self.inner.host.clone();
        if req.bytes.len() as u64 > s.max_input_bytes {
            return Err(RemoteError::Input {
                host: host(),
                reason: format!(
                    "the document is {} bytes, over UNSTRUCTURED_MAX_INPUT_BYTES={}",
                    req.bytes.len(),
                    s.max_input_bytes
                ),
            });
        }
        let closed = |_| RemoteError::RequestFailed {
            host: host(),
            status: None,
            retryable: true,
            ambiguous: false,
            cause: "the admission gate is closed".into(),
        };
        let heavy = self.is_heavy(req);
        let _heavy_permit = if heavy {
            Some(self.inner.heavy_gate.acquire().await.map_err(closed)?)
        } else {
            None
        };
        let _permit = self.inner.gate.acquire().await.map_err(closed)?;
        let timeout = self.timeout_for(heavy);
        match tokio::time::timeout_at(Instant::now() + timeout, self.exchange(req)).await {
            Ok(result) => result,
            Err(_) => Err(RemoteError::Timeout {
                host: host(),
                timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                ambiguous: true,
            }),
        }
    }

    /// The multipart form of one attempt.
    fn form(
        &self,
        req: &ParseRequest<'_>,
        body: &Bytes,
        policy: &Policy,
    ) -> reqwest::multipart::Form {
        use reqwest::multipart::{Form, Part};
        let file = || {
            Part::stream_with_length(body.clone(), body.len() as u64)
                .file_name(req.filename.to_owned())
        };
        // As a browser `File` would: a printable type lowercased, else the generic one.
        let mime = if !req.mime_type.is_empty()
            && req.mime_type.bytes().all(|b| (0x20..=0x7e).contains(&b))
        {
            req.mime_type.to_ascii_lowercase()
        } else {
            String::new()
        };
        let part = file()
            .mime_str(&mime)
            .or_else(|_| file().mime_str("application/octet-stream"))
            .unwrap_or_else(|_| file());
        let mut form = Form::new()
            .part("files", part)
            .text("coordinates", "true")
            .text("strategy", policy.strategy);
        if let Some(language) = &policy.language {
            form = form.text("languages", language.clone());
        }
        if !policy.image_block_types.is_empty() {
            for kind in policy.image_block_types {
                form = form.text("extract_image_block_types", *kind);
            }
            form = form.text("extract_image_block_to_payload", "true");
        }
        form
    }

    /// The attempts of one parse, under the caller's deadline.
    async fn exchange(&self, req: &ParseRequest<'_>) -> Result<Vec<RawElement>, RemoteError> {
        let inner = &*self.inner;
        let s = &inner.settings;
        let host = || inner.host.clone();
        let policy = self.policy(req);
        let body = Bytes::copy_from_slice(req.bytes);
        let mut attempt = 0u32;
        loop {
            let mut request = inner
                .client
                .post(s.endpoint.clone())
                .header(reqwest::header::ACCEPT, "application/json")
                .multipart(self.form(req, &body, &policy));
            if let Some(key) = &s.api_key {
                request = request.bearer_auth(key);
            }
            // A transport failure is never repeated here: the service may have the request.
            let response = request
                .send()
                .await
                .map_err(|e| RemoteError::RequestFailed {
                    host: host(),
                    status: None,
                    retryable: true,
                    ambiguous: true,
                    cause: describe(e),
                })?;
            let status = response.status().as_u16();
            if response.status().is_success() {
                let bytes = self.read_answer(response, status).await?;
                return elements_from_json(&bytes).map_err(|reason| RemoteError::ResponseInvalid {
                    host: host(),
                    reason,
                });
            }
            if let Some(rejection) = self.inspect_rejection(response, status).await {
                return Err(rejection);
            }
            if retryable_status(status) && attempt < s.max_retries {
                attempt += 1;
                tokio::time::sleep(s.retry_delay).await;
                continue;
            }
            return Err(if status == 429 {
                RemoteError::RateLimited { host: host() }
            } else {
                RemoteError::RequestFailed {
                    host: host(),
                    status: Some(status),
                    retryable: retryable_status(status),
                    ambiguous: false,
                    cause: String::new(),
                }
            });
        }
    }

    /// The body of a successful answer, at most `max_response_bytes`.
    async fn read_answer(
        &self,
        mut response: reqwest::Response,
        status: u16,
    ) -> Result<Vec<u8>, RemoteError> {
        let inner = &*self.inner;
        let max = inner.settings.max_response_bytes;
        let too_big = |size: String| RemoteError::ResponseInvalid {
            host: inner.host.clone(),
            reason: format!(
                "the answer is {size} bytes, over UNSTRUCTURED_MAX_RESPONSE_BYTES={max}"
            ),
        };
        if let Some(length) = response.content_length() {
            if length > max {
                return Err(too_big(length.to_string()));
            }
        }
        let mut bytes = Vec::new();
        loop {
            match response.chunk().await {
                Ok(Some(chunk)) => {
                    if (bytes.len() + chunk.len()) as u64 > max {
                        return Err(too_big("more than that".into()));
                    }
                    bytes.extend_from_slice(&chunk);
                }
                Ok(None) => return Ok(bytes),
                Err(e) => {
                    return Err(RemoteError::RequestFailed {
                        host: inner.host.clone(),
                        status: Some(status),
                        retryable: true,
                        ambiguous: false,
                        cause: format!("the answer was cut off: {}", describe(e)),
                    })
                }
            }
        }
    }

    /// A confirmed rejection in an error answer (413, 422, 500, 504; at most 4 KiB read
    /// within 1 s): a PDF page too big to render, or the sandbox's versioned resource
    /// rejection. Anything else keeps its HTTP classification.
    async fn inspect_rejection(
        &self,
        mut response: reqwest::Response,
        status: u16,
    ) -> Option<RemoteError> {
        if !matches!(status, 413 | 422 | 500 | 504) {
            return None;
        }
        let read = async {
            let mut body = Vec::new();
            while let Some(chunk) = response.chunk().await.ok()? {
                if body.len() + chunk.len() > ERROR_BODY_BYTES {
                    return None;
                }
                body.extend_from_slice(&chunk);
            }
            Some(body)
        };
        let body = tokio::time::timeout(ERROR_BODY_WAIT, read).await.ok()??;
        let payload: Value = serde_json::from_slice(&body).ok()?;
        let host = self.inner.host.clone();
        if matches!(status, 500 | 422) && is_raster_limit(&payload) {
            return Some(RemoteError::Input {
                host,
                reason: "a PDF page exceeds safe raster limits; split the PDF or reduce its \
                         page dimensions"
                    .into(),
            });
        }
        let reason = sandbox_reason(&payload)?;
        if status == 504 && reason == "wall_seconds" {
            return Some(RemoteError::Timeout {
                host,
                timeout_ms: u64::try_from(self.inner.settings.request_timeout.as_millis())
                    .unwrap_or(u64::MAX),
                ambiguous: false,
            });
        }
        if (status == 413 && SANDBOX_INPUT_REASONS.contains(&reason))
            || (status == 422 && SANDBOX_DOCUMENT_REASONS.contains(&reason))
        {
            return Some(RemoteError::Input {
                host,
                reason: format!(
                    "it exceeds the parser's resource limit '{reason}' (HTTP {status})"
                ),
            });
        }
        None
    }
}

/// `host:port` of a URL.
fn host_label(url: &url::Url) -> String {
    let host = url.host_str().unwrap_or("localhost");
    match url.port_or_known_default() {
        Some(port) if host.contains(':') => format!("[{host}]:{port}"),
        Some(port) => format!("{host}:{port}"),
        None => host.to_owned(),
    }
}

/// `{"detail": "PDF page would render to too many pixels ...: page=P, pixels=N, maximum=M. ..."}`
/// with N over M.
fn is_raster_limit(payload: &Value) -> bool {
    let Some(detail) = payload.get("detail").and_then(Value::as_str) else {
        return false;
    };
    let Some(numbers) = detail
        .strip_prefix(RASTER_LIMIT_PREFIX)
        .and_then(|rest| rest.strip_suffix(RASTER_LIMIT_SUFFIX))
    else {
        return false;
    };
    let number = |text: Option<&str>, label: &str| -> Option<u64> {
        let digits = text?.strip_prefix(label)?;
        let valid = !digits.is_empty()
            && !digits.starts_with('0')
            && digits.bytes().all(|b| b.is_ascii_digit());
        digits
            .parse::<u64>()
            .ok()
            .filter(|n| valid && *n <= MAX_SAFE_INTEGER)
    };
    let mut parts = numbers.split(", ");
    let page = number(parts.next(), "");
    let pixels = number(parts.next(), "pixels=");
    let maximum = number(parts.next(), "maximum=");
    matches!((page, pixels, maximum, parts.next()), (Some(_), Some(p), Some(m), None) if p > m)
}

/// The reason of `{"detail": {"code": "PARSER_RESOURCE_REJECTED", "revision": <sandbox>,
/// "reason": R}}` (exactly these keys).
fn sandbox_reason(payload: &Value) -> Option<&str> {
    let outer = payload.as_object()?;
    if outer.len() != 1 {
        return None;
    }
    let detail = outer.get("detail")?.as_object()?;
    if detail.len() != 3
        || detail.get("code")?.as_str()? != SANDBOX_CODE
        || detail.get("revision")?.as_str()? != SANDBOX_REVISION
    {
        return None;
    }
    detail.get("reason")?.as_str()
}

// ---------------------------------------------------------------------------------------------
// The answer

/// The elements of an answer: a JSON array of `{element_id?, type?, text?, metadata}`.
fn elements_from_json(body: &[u8]) -> Result<Vec<RawElement>, String> {
    let value: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON ({e})"))?;
    let Value::Array(items) = value else {
        return Err(format!(
            "expected a JSON array of elements, got {}",
            json_kind(&value)
        ));
    };
    if items.len() > MAX_ELEMENTS {
        return Err(format!(
            "{} elements, over the limit of {MAX_ELEMENTS}",
            items.len()
        ));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| element(item).map_err(|e| format!("element {i}: {e}")))
        .collect()
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// An integral JSON number (`3` or `3.0`) within JavaScript's exact range.
fn integer(value: &Value) -> Option<i64> {
    value.as_i64().or_else(|| {
        value
            .as_f64()
            .filter(|f| f.fract() == 0.0 && f.abs() <= MAX_SAFE_INTEGER as f64)
            .map(|f| f as i64)
    })
}

fn element(item: Value) -> Result<RawElement, String> {
    let Value::Object(mut object) = item else {
        return Err(format!("is {}, not an object", json_kind(&item)));
    };
    let mut string = |key: &str| -> Result<Option<String>, String> {
        match object.remove(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(format!("{key} is {}, not a string", json_kind(&other))),
        }
    };
    let element_id = string("element_id")?;
    if let Some(id) = &element_id {
        if id.is_empty() || id.chars().count() > 512 {
            return Err("element_id must be 1 to 512 characters".into());
        }
    }
    let kind = string("type")?
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| "UncategorizedText".to_owned());
    let text = string("text")?.unwrap_or_default();
    let metadata = match object.remove("metadata") {
        Some(Value::Object(m)) => m,
        Some(other) => return Err(format!("metadata is {}, not an object", json_kind(&other))),
        None => return Err("has no metadata".into()),
    };
    Ok(RawElement {
        kind,
        text,
        metadata: raw_metadata(&metadata, element_id)?,
    })
}

/// The metadata the conversion reads; other keys are passed over.
fn raw_metadata(m: &Map<String, Value>, element_id: Option<String>) -> Result<RawMetadata, String> {
    let page_number = match m.get("page_number") {
        None => None,
        Some(v) => Some(
            integer(v)
                .filter(|n| *n > 0)
                .and_then(|n| i32::try_from(n).ok())
                .ok_or("metadata.page_number must be a positive integer")?,
        ),
    };
    let text = |key: &str| m.get(key).and_then(Value::as_str).map(str::to_owned);
    Ok(RawMetadata {
        page_number,
        category_depth: m
            .get("category_depth")
            .and_then(integer)
            .and_then(|n| i32::try_from(n).ok()),
        text_as_html: text("text_as_html"),
        image_base64: text("image_base64"),
        image_mime_type: text("image_mime_type"),
        element_id,
        parent_id: text("parent_id"),
        languages: m.get("languages").and_then(Value::as_array).map(|list| {
            list.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |k| map.get(k).cloned()
    }

    fn settings(pairs: &[(&str, &str)]) -> Result<Option<UnstructuredSettings>, String> {
        UnstructuredSettings::from_lookup(lookup(pairs))
    }

    fn with_url(extra: &[(&str, &str)]) -> Result<UnstructuredSettings, String> {
        let mut pairs = vec![("UNSTRUCTURED_API_URL", "http://parser:8000")];
        pairs.extend_from_slice(extra);
        settings(&pairs).map(|s| s.expect("configured"))
    }

    fn client(extra: &[(&str, &str)]) -> Unstructured {
        Unstructured::new(with_url(extra).unwrap()).unwrap()
    }

    #[test]
    fn no_url_means_the_route_is_off() {
        assert_eq!(settings(&[]), Ok(None));
        assert_eq!(settings(&[("UNSTRUCTURED_API_URL", "  ")]), Ok(None));
    }

    #[test]
    fn defaults() {
        let s = with_url(&[]).unwrap();
        assert_eq!(s.endpoint.as_str(), "http://parser:8000/general/v0/general");
        assert!(!s.has_api_key());
        assert_eq!(s.request_timeout, Duration::from_millis(600_000));
        assert_eq!(s.heavy_request_timeout, Duration::from_millis(600_000));
        assert_eq!(s.max_concurrency, 2);
        assert_eq!(s.heavy_max_concurrency, 2);
        assert_eq!(s.max_input_bytes, 15 * 1024 * 1024);
        assert_eq!(s.max_response_bytes, 32 * 1024 * 1024);
        assert_eq!(s.max_retries, 0);
        assert_eq!(s.retry_delay, Duration::from_millis(100));
        assert_eq!(s.default_language, None);
        assert_eq!(s.backend_revision, "external-unversioned");
    }

    #[test]
    fn the_partition_path_is_appended_once() {
        for (raw, want) in [
            ("http://p:8000/", "http://p:8000/general/v0/general"),
            ("http://p:8000//", "http://p:8000/general/v0/general"),
            ("https://p/api", "https://p/api/general/v0/general"),
            (
                " http://p:8000/general/v0/general/ ",
                "http://p:8000/general/v0/general",
            ),
        ] {
            let s = settings(&[("UNSTRUCTURED_API_URL", raw)]).unwrap().unwrap();
            assert_eq!(s.endpoint.as_str(), want, "{raw}");
        }
    }

    #[test]
    fn aliases_and_their_precedence() {
        let s = with_url(&[
            ("UNSTRUCTURED_REQUEST_TIMEOUT_MS", "1000"),
            ("UNSTRUCTURED_PDF_REQUEST_TIMEOUT_MS", "2000"),
            ("UNSTRUCTURED_MAX_CONCURRENCY", "4"),
            ("UNSTRUCTURED_PDF_MAX_CONCURRENCY", "3"),
        ])
        .unwrap();
        assert_eq!(s.heavy_request_timeout, Duration::from_millis(2000));
        assert_eq!(s.heavy_max_concurrency, 3);
        let s = with_url(&[
            ("UNSTRUCTURED_HEAVY_REQUEST_TIMEOUT_MS", "2400000"),
            ("UNSTRUCTURED_PDF_REQUEST_TIMEOUT_MS", "2000"),
            ("UNSTRUCTURED_HEAVY_MAX_CONCURRENCY", "1"),
            ("UNSTRUCTURED_PDF_MAX_CONCURRENCY", "2"),
        ])
        .unwrap();
        assert_eq!(s.heavy_request_timeout, Duration::from_millis(2_400_000));
        assert_eq!(s.heavy_max_concurrency, 1);
        // The heavy timeout follows the ordinary one when unset.
        let s = with_url(&[("UNSTRUCTURED_REQUEST_TIMEOUT_MS", "5000")]).unwrap();
        assert_eq!(s.heavy_request_timeout, Duration::from_millis(5000));
    }

    #[test]
    fn bad_values_name_the_variable_and_the_range() {
        for (var, value, range) in [
            ("UNSTRUCTURED_REQUEST_TIMEOUT_MS", "3600001", "1 to 3600000"),
            ("UNSTRUCTURED_REQUEST_TIMEOUT_MS", "0", "1 to 3600000"),
            (
                "UNSTRUCTURED_HEAVY_REQUEST_TIMEOUT_MS",
                "-5",
                "1 to 3600000",
            ),
            ("UNSTRUCTURED_PDF_REQUEST_TIMEOUT_MS", "1.5", "1 to 3600000"),
            ("UNSTRUCTURED_MAX_CONCURRENCY", "33", "1 to 32"),
            ("UNSTRUCTURED_HEAVY_MAX_CONCURRENCY", "0", "1 to 32"),
            ("UNSTRUCTURED_MAX_INPUT_BYTES", "52428801", "1 to 52428800"),
            ("UNSTRUCTURED_MAX_RESPONSE_BYTES", "0", "from 1"),
            ("UNSTRUCTURED_MAX_RETRIES", "many", "from 0"),
            ("UNSTRUCTURED_RETRY_DELAY_MS", "x", "from 0"),
        ] {
            let err = with_url(&[(var, value)]).unwrap_err();
            assert!(err.starts_with(&format!("{var}: ")), "{err}");
            assert!(err.contains(range), "{err}");
        }
        let err = with_url(&[("UNSTRUCTURED_HEAVY_MAX_CONCURRENCY", "3")]).unwrap_err();
        assert!(
            err.starts_with(
                "UNSTRUCTURED_HEAVY_MAX_CONCURRENCY: must not exceed UNSTRUCTURED_MAX_CONCURRENCY"
            ),
            "{err}"
        );
        let err = with_url(&[("UNSTRUCTURED_PDF_MAX_CONCURRENCY", "3")]).unwrap_err();
        assert!(
            err.starts_with("UNSTRUCTURED_PDF_MAX_CONCURRENCY: "),
            "{err}"
        );
        let long = "r".repeat(257);
        for revision in ["  ", long.as_str()] {
            let err = with_url(&[("UNSTRUCTURED_BACKEND_REVISION", revision)]).unwrap_err();
            assert!(err.starts_with("UNSTRUCTURED_BACKEND_REVISION: "), "{err}");
        }
    }

    #[test]
    fn bad_urls_name_the_variable_but_never_echo_it() {
        for raw in [
            "not a url with s3cr3t",
            "ftp://user:s3cr3t@host/",
            "http://user:s3cr3t@host:8000",
            "http://host:8000/?token=s3cr3t",
            "http://:s3cr3t@[::1",
        ] {
            let err = settings(&[("UNSTRUCTURED_API_URL", raw)]).unwrap_err();
            assert!(err.starts_with("UNSTRUCTURED_API_URL: "), "{err}");
            assert!(!err.contains("s3cr3t"), "{err}");
        }
    }

    #[test]
    fn the_key_is_never_printed() {
        let s = with_url(&[("UNSTRUCTURED_API_KEY", " sk-very-secret-key ")]).unwrap();
        assert!(s.has_api_key());
        assert_eq!(s.api_key.as_deref(), Some("sk-very-secret-key"));
        let shown = format!("{s:?} {:?}", Unstructured::new(s.clone()).unwrap());
        assert!(!shown.contains("sk-very-secret-key"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
        let err = with_url(&[("UNSTRUCTURED_API_KEY", "sk secret\u{7}")]).unwrap_err();
        assert!(err.starts_with("UNSTRUCTURED_API_KEY: "), "{err}");
        assert!(!err.contains("secret"), "{err}");
        assert!(!with_url(&[("UNSTRUCTURED_API_KEY", "  ")])
            .unwrap()
            .has_api_key());
    }

    #[test]
    fn strategy_rules() {
        let pdf = ParseRequest::new(b"%PDF-1.7", "a.pdf", "application/pdf");
        assert_eq!(strategy(&pdf), "auto");
        assert_eq!(
            strategy(&ParseRequest {
                layout_complexity: Some("simple"),
                ..pdf
            }),
            "fast"
        );
        for hi in [
            ParseRequest {
                requires_ocr: true,
                layout_complexity: Some("simple"),
                ..pdf
            },
            ParseRequest {
                layout_complexity: Some("complex"),
                ..pdf
            },
            ParseRequest {
                requires_tables: true,
                ..pdf
            },
            ParseRequest {
                requires_images: true,
                ..pdf
            },
            // Images of a PDF made elsewhere: no image blocks, but still hi_res.
            ParseRequest {
                requires_images: true,
                images_handled_externally: true,
                ..pdf
            },
        ] {
            assert_eq!(strategy(&hi), "hi_res", "{hi:?}");
        }
        // A Word file's images come from the archive: neither image blocks nor hi_res.
        let docx = ParseRequest {
            requires_images: true,
            ..ParseRequest::new(
                b"PK",
                "a.docx",
                "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
            )
        };
        assert!(image_block_types(&docx).is_empty());
        assert_eq!(strategy(&docx), "auto");
        // Other formats ask for Image blocks only.
        let rtf = ParseRequest {
            requires_images: true,
            ..ParseRequest::new(b"{\\rtf1", "a.rtf", "application/rtf")
        };
        assert_eq!(image_block_types(&rtf), ["Image"]);
        assert_eq!(strategy(&rtf), "hi_res");
        assert_eq!(
            image_block_types(&ParseRequest {
                requires_images: true,
                ..pdf
            }),
            ["Image", "Table"]
        );
    }

    #[test]
    fn language_rules() {
        for (tag, want) in [
            ("ar", "ara"),
            ("de-DE", "deu"),
            ("EN-us", "eng"),
            ("es", "spa"),
            ("fr-CA", "fra"),
            ("hi", "hin"),
            ("ja", "jpn"),
            ("ko-KR", "kor"),
            ("pt-BR", "por"),
            ("ru", "rus"),
            ("zh-Hant-TW", "zho"),
            (" NL-be ", "nl-be"),
            ("Tha", "tha"),
        ] {
            assert_eq!(iso639_3(tag).as_deref(), Some(want), "{tag}");
        }
        assert_eq!(iso639_3("  "), None);
        let c = client(&[("UNSTRUCTURED_DEFAULT_LANGUAGE", " fr ")]);
        let mut req = ParseRequest::new(b"", "a.pdf", "application/pdf");
        assert_eq!(c.language(&req).as_deref(), Some("fra"));
        req.language = Some("de");
        assert_eq!(c.language(&req).as_deref(), Some("deu"));
        assert_eq!(
            client(&[]).language(&ParseRequest::new(b"", "a", "b")),
            None
        );
    }

    #[test]
    fn hints_come_from_the_metadata() {
        let meta = serde_json::json!({
            "language": "ja", "layoutComplexity": "complex",
            "requiresOcr": true, "requiresTables": "true", "other": 1
        });
        let req = ParseRequest::new(b"", "a.pdf", "application/pdf").hints_from_metadata(&meta);
        assert_eq!(req.language, Some("ja"));
        assert_eq!(req.layout_complexity, Some("complex"));
        assert!(req.requires_ocr);
        assert!(!req.requires_tables, "only JSON true counts");
        let none = ParseRequest::new(b"", "a", "b").hints_from_metadata(&Value::Null);
        assert_eq!((none.language, none.requires_ocr), (None, false));
    }

    #[test]
    fn heavy_work() {
        let c = client(&[]);
        let heavy = |bytes: &[u8], name: &str, mime: &str| {
            c.is_heavy(&ParseRequest::new(bytes, name, mime))
        };
        let mut late_magic = vec![b' '; 1019];
        late_magic.extend_from_slice(b"%PDF-");
        assert!(heavy(&late_magic, "scan.bin", "application/octet-stream"));
        let mut too_late = vec![b' '; 1020];
        too_late.extend_from_slice(b"%PDF-");
        assert!(!heavy(&too_late, "scan.bin", "application/octet-stream"));
        assert!(heavy(b"x", "x.bin", "Application/PDF; charset=binary"));
        assert!(heavy(b"x", "REPORT.PDF", ""));
        for (name, mime) in [
            ("a.doc", ""),
            ("a.eml", ""),
            ("a.msg", ""),
            ("a.ppt", ""),
            ("a.rtf", ""),
            ("a.xls", ""),
            ("a", "application/msword"),
            ("a", "message/rfc822"),
        ] {
            assert!(heavy(b"PK", name, mime), "{name} {mime}");
        }
        let docx = "application/vnd.openxmlformats-officedocument.wordprocessingml.document";
        assert!(!heavy(b"PK", "a.docx", docx));
        assert!(heavy(&vec![0u8; 8 * 1024 * 1024 + 1], "a.docx", docx));
        assert!(!heavy(&vec![0u8; 8 * 1024 * 1024], "a.docx", docx));
    }

    #[test]
    fn the_lease_is_the_deadline_plus_a_bounded_grace() {
        let c = client(&[("UNSTRUCTURED_HEAVY_REQUEST_TIMEOUT_MS", "2400000")]);
        let docx = ParseRequest::new(b"PK", "a.docx", "");
        assert_eq!(c.lease(&docx), Duration::from_millis(900_000));
        let pdf = ParseRequest::new(b"%PDF-", "a.pdf", "application/pdf");
        assert_eq!(c.lease(&pdf), Duration::from_millis(2_700_000));
        let short = client(&[("UNSTRUCTURED_REQUEST_TIMEOUT_MS", "1000")]);
        assert_eq!(short.lease(&docx), Duration::from_millis(2000));
    }

    #[test]
    fn route_reasons() {
        let pdf = ParseRequest::new(b"", "a.pdf", "application/pdf");
        assert_eq!(route_reason(&pdf), "complex-file-type");
        assert_eq!(
            route_reason(&ParseRequest::new(b"", "scan", "application/pdf")),
            "complex-file-type"
        );
        assert_eq!(
            route_reason(&ParseRequest {
                requires_ocr: true,
                ..pdf
            }),
            "ocr-required"
        );
        assert_eq!(
            route_reason(&ParseRequest {
                layout_complexity: Some("complex"),
                ..pdf
            }),
            "complex-layout"
        );
        assert_eq!(
            route_reason(&ParseRequest::new(b"", "a.bin", "application/x-foo")),
            "unsupported-file-type"
        );
    }

    /// The platform's recipe, with the JSON text written out by hand to show the key order.
    #[test]
    fn the_fingerprint_follows_the_platform_recipe() {
        let c = client(&[]);
        let req = ParseRequest {
            language: Some("en-US"),
            requires_images: true,
            ..ParseRequest::new(b"%PDF-1.7 ...", "report.pdf", "Application/PDF ")
        };
        let context = format!(
            "{{\"backendRevision\":\"{}\",\"filename\":\"{}\",\"mimeType\":\"{}\",\
             \"parserHints\":{{\"imagesHandledExternally\":false,\"language\":\"en-us\",\
             \"layoutComplexity\":null,\"requiresImages\":true,\"requiresOcr\":false,\
             \"requiresTables\":false}},\"request\":{{\"coordinates\":true,\
             \"imageBlockTypes\":[\"Image\",\"Table\"],\"imagePayload\":true,\
             \"language\":\"eng\",\"strategy\":\"hi_res\"}}}}",
            "external-unversioned", "report.pdf", "application/pdf"
        );
        assert_eq!(c.artifact_hash_context(&req), context);
        let wrapped = format!(
            "{{\"kind\":\"unstructured\",\"parser\":{{\"artifactHashContext\":{},\
             \"maxElements\":20000,\"version\":\"unstructured@12\"}}}}",
            serde_json::to_string(&context).unwrap()
        );
        let effective = sha256_hex(wrapped.as_bytes());
        assert_eq!(c.effective_fingerprint(&req), effective);
        let routed = format!(
            "{{\"effectiveFingerprint\":\"{effective}\",\"kind\":\"router\",\
             \"routeReason\":\"complex-file-type\",\"routedParser\":\"unstructured\"}}"
        );
        let fingerprint = c.policy_fingerprint(&req);
        assert_eq!(fingerprint, sha256_hex(routed.as_bytes()));
        assert_eq!(fingerprint, PINNED_FINGERPRINT);
        assert_eq!(effective, PINNED_EFFECTIVE);
        assert_eq!(fingerprint.len(), 64);
        assert!(fingerprint
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        // Stable, and independent of the bytes; the backend revision changes it.
        let other_bytes = ParseRequest {
            bytes: b"%PDF-2.0 other",
            ..req
        };
        assert_eq!(c.policy_fingerprint(&other_bytes), fingerprint);
        let revised = client(&[("UNSTRUCTURED_BACKEND_REVISION", "sandbox-2")]);
        assert_ne!(revised.policy_fingerprint(&req), fingerprint);
        // The artifact hash covers the bytes after the context.
        let mut hasher = Sha256::new();
        hasher.update(format!("unstructured@12\n{context}\n").as_bytes());
        hasher.update(req.bytes);
        assert_eq!(c.artifact_hash(&req), hex::encode(hasher.finalize()));
        assert_ne!(c.artifact_hash(&other_bytes), c.artifact_hash(&req));
    }

    /// Computed with Node's `JSON.stringify` and `crypto.createHash("sha256")` over the inputs
    /// of [`the_fingerprint_follows_the_platform_recipe`].
    const PINNED_EFFECTIVE: &str =
        "88bbe2d46b510987bd5d1313d901f4429d01cb0b9688772314e5c4588af502d1";
    const PINNED_FINGERPRINT: &str =
        "8e02527bd77afb4634e0c17248c93e31f4e02e3f159eb8e2b0f0ab71f1d95ba2";

    #[test]
    fn escaping_matches_json_stringify() {
        let c = client(&[]);
        let req = ParseRequest::new(b"", "a \"q\" \\ \u{1}\n\u{7f}é😀.pdf", "application/pdf");
        let context = c.artifact_hash_context(&req);
        assert!(
            context.contains(r#""filename":"a \"q\" \\ \u0001\n"#),
            "{context}"
        );
        assert!(context.contains("\u{7f}é😀.pdf"), "{context}");
    }

    #[test]
    fn answers_map_to_raw_elements() {
        let body = serde_json::json!([
            {"element_id": "t1", "type": "Title", "text": "Intro",
             "metadata": {"page_number": 1, "category_depth": 0, "languages": ["eng"],
                          "coordinates": {"points": [[0, 0]]}}},
            {"type": "Table", "text": "a b",
             "metadata": {"page_number": 2.0, "text_as_html": "<table></table>", "parent_id": "t1"}},
            {"text": "loose", "metadata": {}},
            {"type": "Image", "metadata": {"image_base64": "AAAA", "image_mime_type": "image/png"}}
        ]);
        let elements = elements_from_json(body.to_string().as_bytes()).unwrap();
        assert_eq!(elements.len(), 4);
        assert_eq!(elements[0].kind, "Title");
        assert_eq!(elements[0].metadata.category_depth, Some(0));
        assert_eq!(elements[0].metadata.element_id.as_deref(), Some("t1"));
        assert_eq!(elements[0].metadata.languages, Some(vec!["eng".to_owned()]));
        assert_eq!(elements[1].metadata.page_number, Some(2));
        assert_eq!(elements[1].metadata.parent_id.as_deref(), Some("t1"));
        assert_eq!(
            elements[1].metadata.text_as_html.as_deref(),
            Some("<table></table>")
        );
        assert_eq!(elements[2].kind, "UncategorizedText");
        assert_eq!(elements[3].text, "");
        assert_eq!(elements[3].metadata.image_base64.as_deref(), Some("AAAA"));
    }

    #[test]
    fn malformed_answers_are_refused() {
        for (body, needle) in [
            ("{\"elements\": []}", "expected a JSON array"),
            ("[1]", "element 0: is a number"),
            ("[{\"text\": \"x\"}]", "has no metadata"),
            ("[{\"type\": 3, \"metadata\": {}}]", "type is a number"),
            ("[{\"metadata\": {\"page_number\": 0}}]", "page_number"),
            ("[{\"metadata\": {\"page_number\": \"1\"}}]", "page_number"),
            ("[{\"element_id\": \"\", \"metadata\": {}}]", "element_id"),
            ("[{\"text\": null, \"metadata\": {}}]", "text is null"),
            ("[", "not JSON"),
        ] {
            let err = elements_from_json(body.as_bytes()).unwrap_err();
            assert!(err.contains(needle), "{body}: {err}");
        }
        let many = format!(
            "[{}]",
            vec!["{\"metadata\":{}}"; MAX_ELEMENTS + 1].join(",")
        );
        assert!(elements_from_json(many.as_bytes())
            .unwrap_err()
            .contains("over the limit"));
    }

    #[test]
    fn service_rejections() {
        let detail = |code: &str, revision: &str, reason: &str| serde_json::json!({"detail": {"code": code, "revision": revision, "reason": reason}});
        let ok = detail(SANDBOX_CODE, SANDBOX_REVISION, "archive_encrypted");
        assert_eq!(sandbox_reason(&ok), Some("archive_encrypted"));
        assert_eq!(
            sandbox_reason(&detail("OTHER", SANDBOX_REVISION, "x")),
            None
        );
        assert_eq!(sandbox_reason(&detail(SANDBOX_CODE, "v0", "x")), None);
        let extra = serde_json::json!({"detail": ok["detail"], "more": 1});
        assert_eq!(sandbox_reason(&extra), None);

        let raster = |pixels: u64| {
            serde_json::json!({"detail": format!(
                "{RASTER_LIMIT_PREFIX}3, pixels={pixels}, maximum=25000000{RASTER_LIMIT_SUFFIX}"
            )})
        };
        assert!(is_raster_limit(&raster(25_000_001)));
        assert!(!is_raster_limit(&raster(25_000_000)));
        assert!(!is_raster_limit(&serde_json::json!({"detail": "boom"})));
    }

    #[test]
    fn error_codes_and_retry_classes() {
        let h = || "parser:8000".to_owned();
        let cases = [
            (
                RemoteError::Input {
                    host: h(),
                    reason: "r".into(),
                },
                "DOCUMENT_PARSER_INPUT_INVALID",
                false,
            ),
            (
                RemoteError::RateLimited { host: h() },
                "DOCUMENT_PARSER_RATE_LIMITED",
                true,
            ),
            (
                RemoteError::RequestFailed {
                    host: h(),
                    status: Some(503),
                    retryable: true,
                    ambiguous: false,
                    cause: String::new(),
                },
                "DOCUMENT_PARSER_UNAVAILABLE",
                true,
            ),
            (
                RemoteError::ResponseInvalid {
                    host: h(),
                    reason: "r".into(),
                },
                "DOCUMENT_PARSER_RESPONSE_INVALID",
                false,
            ),
            (
                RemoteError::Timeout {
                    host: h(),
                    timeout_ms: 1000,
                    ambiguous: true,
                },
                "DOCUMENT_PARSER_TIMEOUT",
                false,
            ),
        ];
        for (err, code, retryable) in cases {
            assert_eq!(err.code(), code);
            assert_eq!(err.retryable(), retryable, "{err}");
            let line = err.to_string();
            assert!(
                line.contains("parser:8000") && !line.contains('\n'),
                "{line}"
            );
        }
        assert!([408, 425, 429, 500, 503, 599]
            .into_iter()
            .all(retryable_status));
        assert!(![400, 401, 404, 413, 422].into_iter().any(retryable_status));
    }
}
