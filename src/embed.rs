//! The embedding port: text to vectors for a knowledge space's embedding profile. Invariant:
//! every adapter returns exactly one finite vector per input text, all of the profile's
//! dimension, or an error that says whether trying again may help; the HTTP adapter's API key is
//! never printed, logged or put in an error.
//!
//! Adapters: [`Offline`] (deterministic hashed bag of words, for tests and the demo: the same
//! text always gives the same vector, texts sharing words are close), [`OpenAiCompatible`]
//! (`POST {base}/embeddings` of any OpenAI-compatible service), and [`Unconfigured`], which
//! refuses, so that a space with an embedding profile is never given made-up vectors by a worker
//! nobody configured.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::config::ApiKey;
use crate::config::{self, ConfigError};

/// The embedding profile a space's active profile head names (`knowledge_space_profile_revisions`
/// of kind `embedding`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Profile {
    pub revision_id: uuid::Uuid,
    pub revision: i32,
    pub model: String,
    pub plugin_id: String,
    pub provider: String,
    pub vector_space_id: String,
    pub dimension: usize,
}

/// What the vectors will be compared with: stored documents or a query.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    Document,
    Query,
}

/// Vectors and the model that made them.
#[derive(Clone, Debug, PartialEq)]
pub struct Embeddings {
    pub vectors: Vec<Vec<f32>>,
    pub model: String,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EmbedError {
    /// The service may answer next time (down, overloaded, timed out).
    #[error("{0}")]
    Unavailable(String),
    /// Trying again will not help (refused, wrong dimension, not configured).
    #[error("{0}")]
    Rejected(String),
}

#[async_trait::async_trait]
pub trait Embedder: Send + Sync + fmt::Debug {
    /// The provider name recorded in a projection's metadata.
    fn name(&self) -> &'static str;

    /// Whether an embedding is computed in this process, with no call to another service, so
    /// a step that embeds stays short and may share a transaction with other jobs' steps.
    /// `false` unless an adapter says so.
    fn in_process(&self) -> bool {
        false
    }

    async fn embed(
        &self,
        profile: &Profile,
        texts: &[String],
        input: Input,
    ) -> Result<Embeddings, EmbedError>;
}

/// Checks an adapter's answer against the request.
pub fn check(profile: &Profile, texts: usize, e: &Embeddings) -> Result<(), EmbedError> {
    if e.vectors.len() != texts {
        return Err(EmbedError::Rejected(format!(
            "the embedder returned {} vectors for {texts} texts",
            e.vectors.len()
        )));
    }
    for v in &e.vectors {
        if v.len() != profile.dimension {
            return Err(EmbedError::Rejected(format!(
                "the embedder returned a vector of dimension {}, the profile's vector space {} has {}",
                v.len(),
                profile.vector_space_id,
                profile.dimension
            )));
        }
        if v.iter().any(|x| !x.is_finite()) {
            return Err(EmbedError::Rejected(
                "the embedder returned a vector that is not finite".into(),
            ));
        }
    }
    Ok(())
}

/// Deterministic offline vectors: each word of the full-text normalised text adds a signed unit
/// at a position given by its hash; the sum is L2-normalised.
#[derive(Clone, Copy, Debug, Default)]
pub struct Offline;

impl Offline {
    pub fn vector(text: &str, dimension: usize) -> Vec<f32> {
        let mut v = vec![0f32; dimension.max(1)];
        for word in crate::canonical::normalize_fts_text(text).split(' ') {
            if word.is_empty() {
                continue;
            }
            let h = Sha256::digest(word.as_bytes());
            let at = usize::try_from(u64::from_be_bytes(h[..8].try_into().unwrap_or_default()))
                .unwrap_or(0)
                % v.len();
            v[at] += if h[8] & 1 == 0 { 1.0 } else { -1.0 };
        }
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        if norm > 0.0 {
            v.iter_mut().for_each(|x| *x /= norm);
        } else {
            v[0] = 1.0;
        }
        v.truncate(dimension);
        v
    }
}

#[async_trait::async_trait]
impl Embedder for Offline {
    fn name(&self) -> &'static str {
        "offline"
    }

    fn in_process(&self) -> bool {
        true
    }

    async fn embed(
        &self,
        profile: &Profile,
        texts: &[String],
        _input: Input,
    ) -> Result<Embeddings, EmbedError> {
        Ok(Embeddings {
            vectors: texts
                .iter()
                .map(|t| Self::vector(t, profile.dimension))
                .collect(),
            model: profile.model.clone(),
        })
    }
}

/// Refuses every call: no embedder was configured.
#[derive(Clone, Copy, Debug, Default)]
pub struct Unconfigured;

#[async_trait::async_trait]
impl Embedder for Unconfigured {
    fn name(&self) -> &'static str {
        "none"
    }

    async fn embed(
        &self,
        profile: &Profile,
        _texts: &[String],
        _input: Input,
    ) -> Result<Embeddings, EmbedError> {
        Err(EmbedError::Rejected(format!(
            "the space's embedding profile ({} of {}) needs vectors, and no embedder is \
             configured (set KFS_EMBEDDER=openai, or offline for tests)",
            profile.model, profile.provider
        )))
    }
}

/// Settings of the OpenAI-compatible adapter.
#[derive(Clone, Debug, PartialEq)]
pub struct OpenAiConfig {
    /// Requests go to `{base}/embeddings`.
    pub base_url: url::Url,
    pub api_key: Option<ApiKey>,
    /// The model to ask for; the profile's own model when `None`.
    pub model: Option<String>,
    pub timeout: Duration,
    /// Texts per request.
    pub batch: usize,
}

/// Calls `POST {base}/embeddings`.
pub struct OpenAiCompatible {
    cfg: OpenAiConfig,
    client: reqwest::Client,
}

impl fmt::Debug for OpenAiCompatible {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiCompatible")
            .field("cfg", &self.cfg)
            .finish()
    }
}

#[derive(Deserialize)]
struct EmbeddingResponse {
    data: Vec<EmbeddingItem>,
    model: Option<String>,
}

#[derive(Deserialize)]
struct EmbeddingItem {
    embedding: Vec<f32>,
    index: Option<usize>,
}

impl OpenAiCompatible {
    pub fn new(cfg: OpenAiConfig) -> Result<Self, ConfigError> {
        let client = config::http_client("KFS_EMBEDDER", cfg.timeout)?;
        Ok(Self { cfg, client })
    }

    fn endpoint(&self) -> String {
        format!(
            "{}/embeddings",
            self.cfg.base_url.as_str().trim_end_matches('/')
        )
    }

    async fn call(&self, model: &str, texts: &[String]) -> Result<Embeddings, EmbedError> {
        let where_ = config::redact(&self.cfg.base_url);
        let body =
            serde_json::json!({ "model": model, "input": texts, "encoding_format": "float" });
        let mut req = self
            .client
            .post(self.endpoint())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string());
        if let Some(key) = &self.cfg.api_key {
            req = req.bearer_auth(key.expose());
        }
        let resp = req.send().await.map_err(|e| {
            EmbedError::Unavailable(format!(
                "the embedder at {where_} did not answer: {}",
                e.without_url()
            ))
        })?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(|e| {
            EmbedError::Unavailable(format!(
                "reading the embedder's answer failed: {}",
                e.without_url()
            ))
        })?;
        if status.as_u16() == 429 || status.is_server_error() {
            return Err(EmbedError::Unavailable(format!(
                "the embedder at {where_} answered HTTP {status}"
            )));
        }
        if !status.is_success() {
            return Err(EmbedError::Rejected(format!(
                "the embedder at {where_} refused the request with HTTP {status}"
            )));
        }
        let parsed: EmbeddingResponse = serde_json::from_slice(&bytes).map_err(|e| {
            EmbedError::Rejected(format!(
                "the embedder's answer is not an embeddings response: {e}"
            ))
        })?;
        let mut items = parsed.data;
        items.sort_by_key(|i| i.index.unwrap_or(usize::MAX));
        Ok(Embeddings {
            vectors: items.into_iter().map(|i| i.embedding).collect(),
            model: parsed.model.unwrap_or_else(|| model.to_owned()),
        })
    }
}

#[async_trait::async_trait]
impl Embedder for OpenAiCompatible {
    fn name(&self) -> &'static str {
        "openai-compatible"
    }

    async fn embed(
        &self,
        profile: &Profile,
        texts: &[String],
        _input: Input,
    ) -> Result<Embeddings, EmbedError> {
        let model = self.cfg.model.as_deref().unwrap_or(&profile.model);
        let mut out = Embeddings {
            vectors: Vec::with_capacity(texts.len()),
            model: model.to_owned(),
        };
        for batch in texts.chunks(self.cfg.batch.max(1)) {
            let part = self.call(model, batch).await?;
            check(
                profile,
                batch.len(),
                &Embeddings {
                    vectors: part.vectors.clone(),
                    model: part.model.clone(),
                },
            )?;
            out.model = part.model;
            out.vectors.extend(part.vectors);
        }
        Ok(out)
    }
}

/// Which embedder a process uses.
#[derive(Clone, Debug, PartialEq)]
pub enum EmbedderConfig {
    Unconfigured,
    Offline,
    OpenAi(OpenAiConfig),
}

/// Reads `KFS_EMBEDDER` (unset: none; `offline`; `openai`) and, for `openai`,
/// `KFS_EMBEDDING_BASE_URL` (else `KFS_OPENAI_BASE_URL`, else the OpenAI API),
/// `KFS_EMBEDDING_API_KEY` (else `KFS_OPENAI_API_KEY`), `KFS_EMBEDDING_MODEL` (else each
/// profile's own model) and `KFS_EMBEDDING_BATCH` (default 128).
pub fn embedder_config(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<EmbedderConfig, ConfigError> {
    let get = |k: &str| lookup(k).filter(|v| !v.trim().is_empty());
    match get("KFS_EMBEDDER").unwrap_or_default().trim() {
        "" | "none" => Ok(EmbedderConfig::Unconfigured),
        "offline" => Ok(EmbedderConfig::Offline),
        "openai" => {
            let base_url = openai_base_url(&get, "KFS_EMBEDDING_BASE_URL")?;
            let api_key = get("KFS_EMBEDDING_API_KEY")
                .or_else(|| get("KFS_OPENAI_API_KEY"))
                .map(|k| ApiKey::new(k.trim()));
            let batch = match get("KFS_EMBEDDING_BATCH") {
                None => 128,
                Some(b) => b
                    .trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=2048).contains(n))
                    .ok_or_else(|| {
                        ConfigError::new(
                            "KFS_EMBEDDING_BATCH",
                            "must be a whole number from 1 to 2048",
                        )
                    })?,
            };
            Ok(EmbedderConfig::OpenAi(OpenAiConfig {
                base_url,
                api_key,
                model: get("KFS_EMBEDDING_MODEL").map(|m| m.trim().to_owned()),
                timeout: Duration::from_secs(60),
                batch,
            }))
        }
        _ => Err(ConfigError::new(
            "KFS_EMBEDDER",
            "must be offline or openai (or unset for none)",
        )),
    }
}

/// The base URL of an OpenAI-compatible service: `own` (the adapter's setting), else
/// `KFS_OPENAI_BASE_URL`, else the OpenAI API. A bad value is refused by its variable's name,
/// never echoed (a malformed URL may still carry a password).
pub fn openai_base_url(
    get: &dyn Fn(&str) -> Option<String>,
    own: &'static str,
) -> Result<url::Url, ConfigError> {
    let (var, raw) = match get(own) {
        Some(v) => (own, v),
        None => (
            "KFS_OPENAI_BASE_URL",
            get("KFS_OPENAI_BASE_URL")
                .unwrap_or_else(|| crate::config::DEFAULT_OPENAI_BASE_URL.into()),
        ),
    };
    url::Url::parse(raw.trim())
        .ok()
        .filter(|u| matches!(u.scheme(), "http" | "https") && u.host_str().is_some())
        .ok_or_else(|| {
            ConfigError::new(
                var,
                "must be an http or https URL with a host, e.g. https://api.openai.com/v1",
            )
        })
}

/// The embedder a configuration names.
pub fn build(cfg: &EmbedderConfig) -> Result<Arc<dyn Embedder>, ConfigError> {
    Ok(match cfg {
        EmbedderConfig::Unconfigured => Arc::new(Unconfigured),
        EmbedderConfig::Offline => Arc::new(Offline),
        EmbedderConfig::OpenAi(c) => Arc::new(OpenAiCompatible::new(c.clone())?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(dimension: usize) -> Profile {
        Profile {
            revision_id: uuid::Uuid::nil(),
            revision: 1,
            model: "m".into(),
            plugin_id: "p".into(),
            provider: "prov".into(),
            vector_space_id: "embedding-space-sha256:x".into(),
            dimension,
        }
    }

    #[test]
    fn offline_vectors_are_deterministic_unit_and_close_for_shared_words() {
        let a = Offline::vector("leases fence stale writers", 64);
        let b = Offline::vector("Leases fence STALE writers!", 64);
        let c = Offline::vector("publication heads move by compare and swap", 64);
        assert_eq!(a, b);
        assert_eq!(a.len(), 64);
        let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| p * q).sum::<f32>();
        assert!((dot(&a, &a) - 1.0).abs() < 1e-5);
        assert!(dot(&a, &b) > dot(&a, &c));
        assert_eq!(Offline::vector("", 8).len(), 8);
    }

    #[test]
    fn answers_are_checked_against_the_profile() {
        let p = profile(3);
        let ok = Embeddings {
            vectors: vec![vec![0.0, 1.0, 0.0]],
            model: "m".into(),
        };
        assert!(check(&p, 1, &ok).is_ok());
        assert!(check(&p, 2, &ok)
            .unwrap_err()
            .to_string()
            .contains("1 vectors for 2"));
        let wrong = Embeddings {
            vectors: vec![vec![0.0; 4]],
            model: "m".into(),
        };
        assert!(check(&p, 1, &wrong)
            .unwrap_err()
            .to_string()
            .contains("dimension 4"));
        let nan = Embeddings {
            vectors: vec![vec![f32::NAN, 0.0, 0.0]],
            model: "m".into(),
        };
        assert!(check(&p, 1, &nan).is_err());
    }

    #[test]
    fn configuration_names_its_variable_and_never_the_key() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        assert_eq!(
            embedder_config(env(&[])).unwrap(),
            EmbedderConfig::Unconfigured
        );
        assert_eq!(
            embedder_config(env(&[("KFS_EMBEDDER", "offline")])).unwrap(),
            EmbedderConfig::Offline
        );
        let e = embedder_config(env(&[("KFS_EMBEDDER", "magic")])).unwrap_err();
        assert!(e.to_string().contains("KFS_EMBEDDER"), "{e}");
        let e = embedder_config(env(&[
            ("KFS_EMBEDDER", "openai"),
            ("KFS_EMBEDDING_BASE_URL", "ftp://user:hunter2@x"),
        ]))
        .unwrap_err();
        assert!(
            e.to_string().contains("KFS_EMBEDDING_BASE_URL") && !e.to_string().contains("hunter2")
        );
        let cfg = embedder_config(env(&[
            ("KFS_EMBEDDER", "openai"),
            ("KFS_OPENAI_API_KEY", "sk-secret-value"),
        ]))
        .unwrap();
        assert!(!format!("{cfg:?}").contains("sk-secret-value"));
    }
}
