//! The parser route of documents (PDF and office files): the platform's remote parser service
//! when one is configured (`UNSTRUCTURED_API_URL`), else the local parsers. Invariant: a route
//! turns the same bytes, name and hints into the same policy fingerprint and, on success, into
//! the platform's parse artifact (`parser` `unstructured`, ids `<artifactId>:element-<n>`);
//! every failure is one coded error, retryable only where the platform retries it; a local
//! parse runs off the async threads, at most one per core at a time, and is given up after
//! its deadline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};
use uuid::Uuid;

use super::raw::{self, RawElement};
use super::remote::{self, ParseRequest, Unstructured, UnstructuredSettings};
use super::{Format, ParseError};
use crate::canonical::sha256_hex;
use crate::config::ConfigError;
use crate::engine::kind::JobError;

/// The parser version the platform records for its parser-service route.
pub const PARSER_VERSION: &str = "unstructured@12";
/// The platform's artifact `parser` of the route.
pub const PARSER: &str = "unstructured";
/// The backend revision the local parsers record: the artifact says which backend served the
/// route, as a service's own revision does.
pub const LOCAL_BACKEND: &str = "kfs-worker-local-parser-v1";
/// The platform's cap on a parse's elements.
pub const MAX_ELEMENTS: usize = 20_000;
/// The code of a document the parser cannot read (corrupt, encrypted, empty, too large): the
/// platform's `DOCUMENT_PARSER_INPUT_INVALID`, never retried.
pub const INPUT_INVALID: &str = "DOCUMENT_PARSER_INPUT_INVALID";
/// The code of a format the route cannot parse.
pub const UNSUPPORTED_TYPE: &str = "DOCUMENT_PARSER_UNSUPPORTED_TYPE";
/// The code of a local parse that outlived its deadline.
pub const TIMEOUT: &str = "DOCUMENT_PARSER_TIMEOUT";

/// The parser service's settings, for naming the one a settings error is about.
const SETTINGS: [&str; 14] = [
    "UNSTRUCTURED_DEFAULT_LANGUAGE",
    "UNSTRUCTURED_API_URL",
    "UNSTRUCTURED_API_KEY",
    "UNSTRUCTURED_REQUEST_TIMEOUT_MS",
    "UNSTRUCTURED_HEAVY_REQUEST_TIMEOUT_MS",
    "UNSTRUCTURED_PDF_REQUEST_TIMEOUT_MS",
    "UNSTRUCTURED_MAX_CONCURRENCY",
    "UNSTRUCTURED_HEAVY_MAX_CONCURRENCY",
    "UNSTRUCTURED_PDF_MAX_CONCURRENCY",
    "UNSTRUCTURED_MAX_INPUT_BYTES",
    "UNSTRUCTURED_MAX_RESPONSE_BYTES",
    "UNSTRUCTURED_MAX_RETRIES",
    "UNSTRUCTURED_RETRY_DELAY_MS",
    "UNSTRUCTURED_BACKEND_REVISION",
];

/// How a process parses documents.
#[derive(Clone, Debug)]
pub struct ParserConfig {
    /// The remote parser service; `None`: the local parsers.
    pub remote: Option<UnstructuredSettings>,
    /// How long one local parse may take.
    pub local_timeout: Duration,
    /// Whether parses ask the service for image blocks (a deployment with a visual embedding
    /// model), as the platform does when it has one.
    pub requires_images: bool,
}

impl Default for ParserConfig {
    fn default() -> Self {
        Self {
            remote: None,
            local_timeout: Duration::from_secs(600),
            requires_images: false,
        }
    }
}

/// Reads the parser settings: the platform's `UNSTRUCTURED_*` (see [`remote`]), and
/// `KFS_DOCUMENT_PARSER` (`local` forces the local parsers even where a service is
/// configured; `unstructured` requires one), `KFS_LOCAL_PARSER_TIMEOUT_MS` (default 600000) and
/// `KFS_PARSER_REQUIRE_IMAGES` (`true`/`false`, default `false`).
pub fn parser_config(lookup: impl Fn(&str) -> Option<String>) -> Result<ParserConfig, ConfigError> {
    let get = |k: &str| lookup(k).filter(|v| !v.trim().is_empty());
    let remote = UnstructuredSettings::from_lookup(get).map_err(|e| {
        // The settings' error starts with the variable it names.
        let var = SETTINGS
            .iter()
            .copied()
            .filter(|v| e.starts_with(v))
            .max_by_key(|v| v.len())
            .unwrap_or("UNSTRUCTURED_API_URL");
        let why = e.strip_prefix(var).unwrap_or(&e);
        ConfigError::new(var, why.trim_start_matches([':', ' ']))
    })?;
    let remote = match get("KFS_DOCUMENT_PARSER").as_deref().map(str::trim) {
        None => remote,
        Some("local") => None,
        Some("unstructured") => Some(remote.ok_or_else(|| {
            ConfigError::new(
                "KFS_DOCUMENT_PARSER",
                "is unstructured, but UNSTRUCTURED_API_URL is not set",
            )
        })?),
        Some(_) => return Err(ConfigError::new(
            "KFS_DOCUMENT_PARSER",
            "must be local or unstructured (unset: unstructured when UNSTRUCTURED_API_URL is set)",
        )),
    };
    let local_timeout = match get("KFS_LOCAL_PARSER_TIMEOUT_MS") {
        None => Duration::from_secs(600),
        Some(v) => v
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|ms| (1_000..=3_600_000).contains(ms))
            .map(Duration::from_millis)
            .ok_or_else(|| {
                ConfigError::new(
                    "KFS_LOCAL_PARSER_TIMEOUT_MS",
                    "must be a whole number of milliseconds from 1000 to 3600000",
                )
            })?,
    };
    let requires_images = match get("KFS_PARSER_REQUIRE_IMAGES").as_deref().map(str::trim) {
        None | Some("false") => false,
        Some("true") => true,
        Some(_) => {
            return Err(ConfigError::new(
                "KFS_PARSER_REQUIRE_IMAGES",
                "must be true or false",
            ))
        }
    };
    Ok(ParserConfig {
        remote,
        local_timeout,
        requires_images,
    })
}

/// A document to parse: its bytes, name, type and the hints its metadata carries.
pub struct Source<'a> {
    pub asset: Uuid,
    pub version: i32,
    pub format: Format,
    pub bytes: &'a [u8],
    pub filename: &'a str,
    pub mime_type: &'a str,
    pub metadata: &'a Value,
}

/// What a parse gives: the platform's parse artifact, as the raw-parse checkpoint holds it.
#[derive(Clone, Debug, PartialEq)]
pub struct Artifact {
    pub id: Uuid,
    pub hash: String,
    pub elements: Vec<super::super::element::Element>,
    pub metadata: Value,
}

impl Artifact {
    /// The platform's `ParseArtifact` object (`parse_artifact_checkpoints.artifact`).
    pub fn to_json(&self, asset: Uuid, version: i32) -> Value {
        json!({
            "artifactHash": self.hash,
            "contentType": super::super::element::content_type_of(&self.elements),
            "createdAt": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            "documentAssetId": asset,
            "elements": self.elements,
            "id": self.id,
            "metadata": self.metadata,
            "parser": PARSER,
            "version": version,
        })
    }

    /// The artifact a checkpoint holds, when it is one for this document version.
    pub fn from_json(v: &Value, asset: Uuid, version: i32) -> Option<Self> {
        if v["documentAssetId"].as_str()? != asset.to_string()
            || v["version"].as_i64()? != i64::from(version)
            || v["parser"].as_str()? != PARSER
        {
            return None;
        }
        Some(Self {
            id: v["id"].as_str()?.parse().ok()?,
            hash: v["artifactHash"].as_str()?.to_owned(),
            elements: serde_json::from_value(v["elements"].clone()).ok()?,
            metadata: v["metadata"].clone(),
        })
    }
}

/// The platform's deterministic artifact id of a document version, used when it has none yet.
pub fn artifact_id(asset: Uuid, version: i32) -> Uuid {
    let h = sha256_hex(format!("knowledge-fs:parse-artifact:{asset}:{version}").as_bytes());
    let mut b = [0u8; 16];
    for (i, byte) in b.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&h[2 * i..2 * i + 2], 16).unwrap_or(0);
    }
    b[6] = (b[6] & 0x0f) | 0x50;
    b[8] = (b[8] & 0x3f) | 0x80;
    Uuid::from_bytes(b)
}

/// The parsers of a process.
#[derive(Debug)]
pub struct Parsers {
    remote: Option<Unstructured>,
    local_timeout: Duration,
    requires_images: bool,
    /// One local parse per core at a time.
    local_gate: Arc<tokio::sync::Semaphore>,
}

/// The local route's fingerprint context, keys in the order they are hashed.
#[derive(Serialize)]
struct LocalContext<'a> {
    #[serde(rename = "backendRevision")]
    backend_revision: &'a str,
    filename: &'a str,
    #[serde(rename = "mimeType")]
    mime_type: String,
}

impl Parsers {
    pub fn new(cfg: &ParserConfig) -> Result<Self, ConfigError> {
        let remote = match &cfg.remote {
            Some(s) => Some(
                Unstructured::new(s.clone())
                    .map_err(|e| ConfigError::new("UNSTRUCTURED_API_URL", &e))?,
            ),
            None => None,
        };
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        Ok(Self {
            remote,
            local_timeout: cfg.local_timeout,
            requires_images: cfg.requires_images,
            local_gate: Arc::new(tokio::sync::Semaphore::new(cores)),
        })
    }

    /// The local parsers only.
    pub fn local() -> Self {
        let cfg = ParserConfig::default();
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        Self {
            remote: None,
            local_timeout: cfg.local_timeout,
            requires_images: cfg.requires_images,
            local_gate: Arc::new(tokio::sync::Semaphore::new(cores)),
        }
    }

    /// `unstructured` or `local`: which route documents take.
    pub fn route(&self) -> &'static str {
        if self.remote.is_some() {
            "unstructured"
        } else {
            "local"
        }
    }

    fn request<'a>(&self, s: &Source<'a>) -> ParseRequest<'a> {
        let mut r =
            ParseRequest::new(s.bytes, s.filename, s.mime_type).hints_from_metadata(s.metadata);
        r.requires_images = self.requires_images;
        r
    }

    fn local_context(s: &Source<'_>) -> String {
        serde_json::to_string(&LocalContext {
            backend_revision: LOCAL_BACKEND,
            filename: s.filename,
            mime_type: s.mime_type.trim().to_ascii_lowercase(),
        })
        .unwrap_or_default()
    }

    /// The policy fingerprint of parsing `s` on this route: a checkpoint made under another is
    /// not reused.
    pub fn policy_fingerprint(&self, s: &Source<'_>) -> String {
        match &self.remote {
            Some(u) => u.policy_fingerprint(&self.request(s)),
            None => {
                let inner = sha256_hex(
                    format!(
                        "{{\"kind\":\"local\",\"parser\":{{\"artifactHashContext\":{},\"maxElements\":{MAX_ELEMENTS},\"version\":\"{PARSER_VERSION}\"}}}}",
                        serde_json::to_string(&Self::local_context(s)).unwrap_or_default()
                    )
                    .as_bytes(),
                );
                remote::router_fingerprint(&inner, remote::ROUTE_COMPLEX_FILE_TYPE)
            }
        }
    }

    /// Parses `s` into the artifact `id` names. Counted in `kfs_document_parses_total`.
    pub async fn parse(&self, s: &Source<'_>, id: Uuid) -> Result<Artifact, JobError> {
        let started = Instant::now();
        let route = self.route();
        let parsed = match &self.remote {
            Some(u) => {
                // The platform's preflight: a PDF that cannot be opened, or only with a
                // password, is refused here rather than sent.
                if s.format == Format::Pdf {
                    self.run_locally(s, |b| super::pdf::preflight(b).map(|_| Vec::new()))
                        .await?;
                }
                let req = self.request(s);
                let hash = u.artifact_hash(&req);
                u.parse(&req)
                    .await
                    .map(|raw| (raw, hash, u.settings().backend_revision.clone()))
                    .map_err(|e| {
                        if e.retryable() {
                            JobError::retryable(e.code(), e.to_string())
                        } else {
                            JobError::fatal(e.code(), e.to_string())
                        }
                    })
            }
            None => {
                let hash = {
                    let mut input =
                        format!("{PARSER_VERSION}\n{}\n", Self::local_context(s)).into_bytes();
                    input.extend_from_slice(s.bytes);
                    sha256_hex(&input)
                };
                self.parse_locally(s)
                    .await
                    .map(|raw| (raw, hash, LOCAL_BACKEND.to_owned()))
            }
        };
        let outcome = match &parsed {
            Ok(_) => "parsed",
            Err(JobError::Retryable { .. }) => "retry",
            Err(JobError::Fatal { .. }) => "failed",
        };
        crate::metrics::document_parse(route, s.format.as_str(), outcome, started.elapsed());
        let (raw, hash, backend) = parsed?;
        if raw.len() > MAX_ELEMENTS {
            return Err(JobError::fatal(
                INPUT_INVALID,
                format!(
                    "{:?} parses into {} elements, more than the {MAX_ELEMENTS} a document may have",
                    s.filename,
                    raw.len()
                ),
            ));
        }
        let elements = raw::to_elements(id, &raw);
        if elements.iter().all(|e| e.trimmed().is_empty()) {
            return Err(JobError::fatal(
                INPUT_INVALID,
                format!(
                    "{:?} has no extractable text (scanned pages need OCR)",
                    s.filename
                ),
            ));
        }
        let metadata = json!({
            "backendRevision": backend,
            "filename": s.filename,
            "mimeType": s.mime_type,
            "parserVersion": PARSER_VERSION,
            "routeReason": "complex-file-type",
            "routedParser": PARSER,
        });
        Ok(Artifact {
            id,
            hash,
            elements,
            metadata,
        })
    }

    /// The local parse of `s`, on a blocking thread, within the local deadline.
    async fn parse_locally(&self, s: &Source<'_>) -> Result<Vec<RawElement>, JobError> {
        let f: fn(&[u8]) -> Result<Vec<RawElement>, ParseError> = match s.format {
            Format::Pdf => super::pdf::parse_pdf,
            Format::Docx => super::office::parse_docx,
            Format::Pptx => super::office::parse_pptx,
            other => {
                return Err(JobError::fatal(
                    UNSUPPORTED_TYPE,
                    format!(
                        "{:?} is {}, which the local parsers do not read (PDF, .docx and .pptx); \
                         set UNSTRUCTURED_API_URL to parse it through a parser service",
                        s.filename,
                        other.as_str()
                    ),
                ))
            }
        };
        self.run_locally(s, f).await
    }

    /// Runs `f` over the bytes of `s` on a blocking thread, within the local deadline and the
    /// gate of one per core.
    async fn run_locally(
        &self,
        s: &Source<'_>,
        f: fn(&[u8]) -> Result<Vec<RawElement>, ParseError>,
    ) -> Result<Vec<RawElement>, JobError> {
        let _slot = self
            .local_gate
            .acquire()
            .await
            .map_err(|_| JobError::retryable(TIMEOUT, "the local parser is shutting down"))?;
        let bytes = s.bytes.to_vec();
        let work = tokio::task::spawn_blocking(move || f(&bytes));
        match tokio::time::timeout(self.local_timeout, work).await {
            Err(_) => Err(JobError::fatal(
                TIMEOUT,
                format!(
                    "the local parser did not finish {:?} within {} ms",
                    s.filename,
                    self.local_timeout.as_millis()
                ),
            )),
            Ok(Err(join)) => Err(JobError::fatal(
                INPUT_INVALID,
                format!("the local parser failed on {:?}: {join}", s.filename),
            )),
            Ok(Ok(Err(e))) => Err(JobError::fatal(
                INPUT_INVALID,
                format!("{:?}: {e}", s.filename),
            )),
            Ok(Ok(Ok(raw))) => Ok(raw),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_artifact_id_is_the_platforms_deterministic_uuid() {
        let asset: Uuid = "00000000-0000-0000-0000-000000000001".parse().unwrap();
        let a = artifact_id(asset, 1);
        assert_eq!(a, artifact_id(asset, 1));
        assert_ne!(a, artifact_id(asset, 2));
        assert_eq!(a.get_version_num(), 5);
        assert_eq!(a.get_variant(), uuid::Variant::RFC4122);
    }

    #[test]
    fn settings_name_the_variable_they_refuse() {
        let cfg = |pairs: &'static [(&'static str, &'static str)]| {
            parser_config(|k| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| (*v).to_owned())
            })
        };
        assert!(cfg(&[]).unwrap().remote.is_none());
        for (pairs, var) in [
            (
                &[("KFS_DOCUMENT_PARSER", "unstructured")][..],
                "KFS_DOCUMENT_PARSER",
            ),
            (
                &[("KFS_DOCUMENT_PARSER", "pdfium")][..],
                "KFS_DOCUMENT_PARSER",
            ),
            (
                &[("KFS_LOCAL_PARSER_TIMEOUT_MS", "5")][..],
                "KFS_LOCAL_PARSER_TIMEOUT_MS",
            ),
            (
                &[("KFS_PARSER_REQUIRE_IMAGES", "yes")][..],
                "KFS_PARSER_REQUIRE_IMAGES",
            ),
        ] {
            let e = cfg(pairs).expect_err("refused").to_string();
            assert!(e.contains(var), "{e}");
        }
        let forced = cfg(&[
            ("UNSTRUCTURED_API_URL", "http://127.0.0.1:9"),
            ("KFS_DOCUMENT_PARSER", "local"),
        ])
        .unwrap();
        assert!(forced.remote.is_none());
    }
}
