//! Answer generation behind the [`Generator`] trait. Invariant: a generator only sees the ranked
//! evidence of its own job, every answer cites evidence by its 1-based position, the extractive
//! generator is deterministic and offline, and a generator states before each call what it may
//! cost at most ([`Generator::estimate`]: the estimated prompt and its largest answer) and after
//! it the tokens it was billed for (or an estimate, marked as such), so the budget is reserved
//! before the call and settled after it. A generator hands its answer to an [`AnswerSink`] piece
//! by piece as it makes it, and the pieces, in order, are exactly the answer it returns; when the
//! sink refuses a piece, it stops and fails with the sink's error. The API key is never logged,
//! printed or put into an error.
//!
//! - [`openai`] — the OpenAI-compatible HTTP generator.

pub mod openai;

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

pub use openai::{cited_indices, user_prompt, ApiKey, OpenAiConfig, OpenAiGenerator};

use super::budget::Estimate;
use super::plan::{self, Evidence};
use crate::config::{self, ConfigError};
use crate::jobs::JobError;

/// What a generator answers from.
#[derive(Clone, Copy, Debug)]
pub struct GenerationRequest<'a> {
    pub question: &'a str,
    pub evidence: &'a [Evidence],
}

/// A cited piece of evidence. `index` is the `[n]` marker used in the answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Citation {
    pub index: usize,
    pub node_id: Uuid,
    pub document_id: Uuid,
    pub document_version: i32,
    pub filename: String,
    pub heading_path: serde_json::Value,
}

impl Citation {
    pub(crate) fn of(index: usize, e: &Evidence) -> Self {
        Self {
            index,
            node_id: e.node_id,
            document_id: e.document_id,
            document_version: e.document_version,
            filename: e.filename.clone(),
            heading_path: e.heading_path.clone(),
        }
    }
}

/// Token usage of one call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// The service reported no usage; these counts are estimated from text length.
    pub estimated: bool,
}

/// A generated answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Generation {
    pub answer: String,
    pub citations: Vec<Citation>,
    pub generator: String,
    pub model: Option<String>,
    pub usage: Option<Usage>,
    pub cost_usd: f64,
}

/// Where a generator sends its answer while it makes it.
#[async_trait::async_trait]
pub trait AnswerSink: Send {
    /// The next piece of the answer. `Err`: stop generating and fail with it.
    async fn text(&mut self, piece: &str) -> Result<(), JobError>;
}

/// A sink that keeps nothing: for a caller that wants only the answer returned.
#[derive(Clone, Copy, Debug, Default)]
pub struct Discard;

#[async_trait::async_trait]
impl AnswerSink for Discard {
    async fn text(&mut self, _piece: &str) -> Result<(), JobError> {
        Ok(())
    }
}

/// Something that turns evidence into an answer with citations.
#[async_trait::async_trait]
pub trait Generator: Send + Sync + 'static {
    fn name(&self) -> &'static str;

    /// Whether an answer is made in this process, with no call to a model service, so the
    /// answering step stays short and may share a transaction with other tasks' steps.
    /// `false` unless a generator says so.
    fn in_process(&self) -> bool {
        false
    }

    /// The most a call for `req` may cost (its estimated prompt tokens, its largest answer, at
    /// the generator's prices), reserved against the budget before the call. Free by default.
    fn estimate(&self, _req: &GenerationRequest<'_>) -> Estimate {
        Estimate::default()
    }

    /// The answer to `req`, each piece of it sent to `sink` as it is made.
    async fn generate(
        &self,
        req: &GenerationRequest<'_>,
        sink: &mut dyn AnswerSink,
    ) -> Result<Generation, JobError>;
}

/// What the platform answers when retrieval found nothing (no model is called then).
pub const NO_EVIDENCE_ANSWER: &str =
    "I could not find evidence for that query in the indexed retrieval projections.";

// ---------------------------------------------------------------------------------------------
// Extractive

/// Picks the evidence sentences that share the most words with the question, in a fixed order,
/// and cites where each came from. Offline and free.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExtractiveGenerator {
    pub max_sentences: usize,
}

impl ExtractiveGenerator {
    pub fn new() -> Self {
        Self { max_sentences: 3 }
    }
}

/// The sentences of a text: split after `.`, `!` or `?` followed by whitespace, and at line
/// breaks; whitespace collapsed; empty ones dropped.
pub fn sentences(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let chars: Vec<char> = text.chars().collect();
    for (i, &c) in chars.iter().enumerate() {
        if c == '\n' || c == '\r' {
            out.push(std::mem::take(&mut cur));
            continue;
        }
        cur.push(c);
        if matches!(c, '.' | '!' | '?') && chars.get(i + 1).is_none_or(|n| n.is_whitespace()) {
            out.push(std::mem::take(&mut cur));
        }
    }
    out.push(cur);
    out.into_iter()
        .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|s| s.chars().any(char::is_alphanumeric))
        .collect()
}

/// The extractive answer as a pure function.
pub fn extract(
    question: &str,
    evidence: &[Evidence],
    max_sentences: usize,
) -> (String, Vec<Citation>) {
    if evidence.is_empty() {
        return (NO_EVIDENCE_ANSWER.to_owned(), Vec::new());
    }
    let wanted = plan::terms(question);
    // (overlap, evidence position, sentence position, text)
    let mut scored: Vec<(usize, usize, usize, String)> = Vec::new();
    for (ei, e) in evidence.iter().enumerate() {
        for (si, s) in sentences(&e.content).into_iter().enumerate() {
            let have = plan::terms(&s);
            let overlap = wanted.iter().filter(|w| have.contains(w)).count();
            scored.push((overlap, ei, si, s));
        }
    }
    scored.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut picked: Vec<&(usize, usize, usize, String)> = scored
        .iter()
        .filter(|s| s.0 > 0)
        .take(max_sentences.max(1))
        .collect();
    if picked.is_empty() {
        // Nothing shares a word with the question: quote the best evidence's first sentence.
        picked = scored
            .iter()
            .filter(|s| s.1 == 0)
            .min_by_key(|s| s.2)
            .into_iter()
            .collect();
    }
    if picked.is_empty() {
        return (NO_EVIDENCE_ANSWER.to_owned(), Vec::new());
    }
    let answer = picked
        .iter()
        .map(|(_, ei, _, s)| format!("{s} [{}]", ei + 1))
        .collect::<Vec<_>>()
        .join(" ");
    let mut used: Vec<usize> = picked.iter().map(|s| s.1).collect();
    used.sort_unstable();
    used.dedup();
    let citations = used
        .into_iter()
        .map(|ei| Citation::of(ei + 1, &evidence[ei]))
        .collect();
    (answer, citations)
}

#[async_trait::async_trait]
impl Generator for ExtractiveGenerator {
    fn name(&self) -> &'static str {
        "extractive"
    }

    fn in_process(&self) -> bool {
        true
    }

    /// The whole answer is one piece: it is made at once.
    async fn generate(
        &self,
        req: &GenerationRequest<'_>,
        sink: &mut dyn AnswerSink,
    ) -> Result<Generation, JobError> {
        let (answer, citations) = extract(req.question, req.evidence, self.max_sentences);
        sink.text(&answer).await?;
        Ok(Generation {
            answer,
            citations,
            generator: self.name().into(),
            model: None,
            usage: None,
            cost_usd: 0.0,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Configuration

#[derive(Clone, Debug, PartialEq)]
pub enum GeneratorConfig {
    Extractive,
    OpenAi(OpenAiConfig),
}

pub use crate::config::DEFAULT_OPENAI_BASE_URL;

fn price(var: &'static str, raw: Option<String>) -> Result<f64, ConfigError> {
    let Some(raw) = raw.filter(|r| !r.trim().is_empty()) else {
        return Ok(0.0);
    };
    match raw.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(ConfigError::new(
            var,
            "must be a non-negative number of USD per 1000 tokens, e.g. 0.0005",
        )),
    }
}

/// Reads the generator settings through `lookup` (the environment, or a table in tests):
/// `KFS_GENERATOR` (`extractive`, the default, or `openai`), and for `openai`
/// `KFS_OPENAI_BASE_URL`, `KFS_OPENAI_API_KEY`, `KFS_OPENAI_MODEL` (required),
/// `KFS_OPENAI_PRICE_PER_1K_INPUT`, `KFS_OPENAI_PRICE_PER_1K_OUTPUT`, `KFS_OPENAI_TIMEOUT` and
/// `KFS_OPENAI_MAX_OUTPUT_TOKENS` (the longest answer asked for and reserved, default 1024).
pub fn generator_config(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<GeneratorConfig, ConfigError> {
    let which = lookup("KFS_GENERATOR").unwrap_or_default();
    match which.trim() {
        "" | "extractive" => Ok(GeneratorConfig::Extractive),
        "openai" => {
            let raw_base = lookup("KFS_OPENAI_BASE_URL")
                .filter(|b| !b.trim().is_empty())
                .unwrap_or_else(|| DEFAULT_OPENAI_BASE_URL.into());
            // Never echo the text: a malformed URL may still carry a password.
            let base_url = url::Url::parse(raw_base.trim()).map_err(|e| {
                ConfigError::new(
                    "KFS_OPENAI_BASE_URL",
                    format!("is not a valid URL ({e}); expected e.g. {DEFAULT_OPENAI_BASE_URL}"),
                )
            })?;
            if !matches!(base_url.scheme(), "http" | "https") || base_url.host_str().is_none() {
                return Err(ConfigError::new(
                    "KFS_OPENAI_BASE_URL",
                    format!(
                        "must be an http or https URL with a host, e.g. {DEFAULT_OPENAI_BASE_URL}"
                    ),
                ));
            }
            let api_key = match lookup("KFS_OPENAI_API_KEY") {
                None => None,
                Some(k) if k.trim().is_empty() => {
                    return Err(ConfigError::new(
                        "KFS_OPENAI_API_KEY",
                        "is set but empty; unset it for a service without keys",
                    ))
                }
                Some(k)
                    if k.trim()
                        .chars()
                        .any(|c| c.is_control() || c.is_whitespace()) =>
                {
                    return Err(ConfigError::new(
                        "KFS_OPENAI_API_KEY",
                        "contains whitespace or control characters",
                    ))
                }
                Some(k) => Some(ApiKey::new(k.trim())),
            };
            let model = lookup("KFS_OPENAI_MODEL")
                .map(|m| m.trim().to_owned())
                .filter(|m| !m.is_empty())
                .ok_or_else(|| {
                    ConfigError::new(
                        "KFS_OPENAI_MODEL",
                        "is required with KFS_GENERATOR=openai, e.g. gpt-4o-mini",
                    )
                })?;
            let timeout = match lookup("KFS_OPENAI_TIMEOUT") {
                Some(t) if !t.trim().is_empty() => config::duration("KFS_OPENAI_TIMEOUT", &t)?,
                _ => Duration::from_secs(20),
            };
            if timeout.is_zero() {
                return Err(ConfigError::new(
                    "KFS_OPENAI_TIMEOUT",
                    "must be more than 0",
                ));
            }
            let max_output_tokens = match lookup("KFS_OPENAI_MAX_OUTPUT_TOKENS") {
                Some(t) if !t.trim().is_empty() => match t.trim().parse::<u32>() {
                    Ok(n) if n >= 1 => n,
                    _ => {
                        return Err(ConfigError::new(
                            "KFS_OPENAI_MAX_OUTPUT_TOKENS",
                            "must be a whole number of tokens, at least 1, e.g. 1024",
                        ))
                    }
                },
                _ => openai::DEFAULT_MAX_OUTPUT_TOKENS,
            };
            Ok(GeneratorConfig::OpenAi(OpenAiConfig {
                base_url,
                api_key,
                model,
                price_per_1k_input: price(
                    "KFS_OPENAI_PRICE_PER_1K_INPUT",
                    lookup("KFS_OPENAI_PRICE_PER_1K_INPUT"),
                )?,
                price_per_1k_output: price(
                    "KFS_OPENAI_PRICE_PER_1K_OUTPUT",
                    lookup("KFS_OPENAI_PRICE_PER_1K_OUTPUT"),
                )?,
                timeout,
                max_output_tokens,
            }))
        }
        _ => Err(ConfigError::new(
            "KFS_GENERATOR",
            "must be extractive or openai",
        )),
    }
}

/// The generator a configuration names.
pub fn build(cfg: &GeneratorConfig) -> Result<Arc<dyn Generator>, ConfigError> {
    Ok(match cfg {
        GeneratorConfig::Extractive => Arc::new(ExtractiveGenerator::new()),
        GeneratorConfig::OpenAi(c) => Arc::new(OpenAiGenerator::new(c.clone())?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    pub(crate) fn ev(n: u128, content: &str) -> Evidence {
        Evidence {
            node_id: Uuid::from_u128(n),
            document_id: Uuid::from_u128(1000 + n),
            document_version: 1,
            filename: format!("d{n}.md"),
            heading_path: serde_json::json!(["H"]),
            content: content.into(),
            score: 1.0,
            sub_queries: vec![0],
            artifact_hash: String::new(),
            start_offset: 0,
            end_offset: 0,
            page_number: None,
            projection_ids: vec![],
            sources: vec![],
        }
    }

    #[test]
    fn sentences_split() {
        assert_eq!(
            sentences("One fact. Two facts!\nThree v1.2 facts? "),
            vec!["One fact.", "Two facts!", "Three v1.2 facts?"]
        );
        assert!(sentences("  \n ... ").is_empty());
    }

    #[test]
    fn extractive_answers_cite_their_sources() {
        let evidence = [
            ev(1, "Leases last thirty seconds. Unrelated words here."),
            ev(
                2,
                "Fencing compares the lease token. Fencing also checks row versions.",
            ),
        ];
        let (answer, cites) = extract("How does fencing use the lease token?", &evidence, 3);
        assert_eq!(
            answer,
            "Fencing compares the lease token. [2] Fencing also checks row versions. [2]"
        );
        assert_eq!(cites.iter().map(|c| c.index).collect::<Vec<_>>(), vec![2]);
        assert_eq!(cites[0].document_id, Uuid::from_u128(1002));
        // Deterministic.
        assert_eq!(
            extract("How does fencing use the lease token?", &evidence, 3).0,
            answer
        );
        // No overlap: the best evidence's first sentence.
        let (a, c) = extract("zebra", &evidence, 3);
        assert_eq!(a, "Leases last thirty seconds. [1]");
        assert_eq!(c.len(), 1);
        // No evidence.
        let (a, c) = extract("anything", &[], 3);
        assert_eq!(a, NO_EVIDENCE_ANSWER);
        assert!(c.is_empty());
    }

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn configuration_table() {
        assert_eq!(
            generator_config(lookup(&[])).unwrap(),
            GeneratorConfig::Extractive
        );
        assert_eq!(
            generator_config(lookup(&[
                ("KFS_GENERATOR", "extractive"),
                ("KFS_OPENAI_MODEL", "")
            ]))
            .unwrap(),
            GeneratorConfig::Extractive
        );
        let ok = generator_config(lookup(&[
            ("KFS_GENERATOR", "openai"),
            ("KFS_OPENAI_BASE_URL", "http://127.0.0.1:9/v1/"),
            ("KFS_OPENAI_API_KEY", "sk-secret-123"),
            ("KFS_OPENAI_MODEL", "m1"),
            ("KFS_OPENAI_PRICE_PER_1K_INPUT", "0.5"),
            ("KFS_OPENAI_PRICE_PER_1K_OUTPUT", "1.5"),
        ]))
        .unwrap();
        let GeneratorConfig::OpenAi(c) = ok else {
            panic!("openai expected")
        };
        assert_eq!(c.endpoint(), "http://127.0.0.1:9/v1/chat/completions");
        assert_eq!(c.max_output_tokens, openai::DEFAULT_MAX_OUTPUT_TOKENS);
        assert_eq!(c.model, "m1");
        assert!(
            !format!("{c:?}").contains("sk-secret-123"),
            "key leaked: {c:?}"
        );
        let usage = Usage {
            prompt_tokens: 2000,
            completion_tokens: 1000,
            estimated: false,
        };
        assert!((c.cost(&usage) - 2.5).abs() < 1e-9);

        let bad: Vec<(Vec<(&str, &str)>, &str)> = vec![
            (vec![("KFS_GENERATOR", "gpt")], "KFS_GENERATOR"),
            (vec![("KFS_GENERATOR", "openai")], "KFS_OPENAI_MODEL"),
            (
                vec![
                    ("KFS_GENERATOR", "openai"),
                    ("KFS_OPENAI_MODEL", "m"),
                    ("KFS_OPENAI_BASE_URL", "not a url"),
                ],
                "KFS_OPENAI_BASE_URL",
            ),
            (
                vec![
                    ("KFS_GENERATOR", "openai"),
                    ("KFS_OPENAI_MODEL", "m"),
                    ("KFS_OPENAI_BASE_URL", "ftp://x/"),
                ],
                "KFS_OPENAI_BASE_URL",
            ),
            (
                vec![
                    ("KFS_GENERATOR", "openai"),
                    ("KFS_OPENAI_MODEL", "m"),
                    ("KFS_OPENAI_PRICE_PER_1K_INPUT", "-1"),
                ],
                "KFS_OPENAI_PRICE_PER_1K_INPUT",
            ),
            (
                vec![
                    ("KFS_GENERATOR", "openai"),
                    ("KFS_OPENAI_MODEL", "m"),
                    ("KFS_OPENAI_PRICE_PER_1K_OUTPUT", "cheap"),
                ],
                "KFS_OPENAI_PRICE_PER_1K_OUTPUT",
            ),
            (
                vec![
                    ("KFS_GENERATOR", "openai"),
                    ("KFS_OPENAI_MODEL", "m"),
                    ("KFS_OPENAI_API_KEY", " "),
                ],
                "KFS_OPENAI_API_KEY",
            ),
            (
                vec![
                    ("KFS_GENERATOR", "openai"),
                    ("KFS_OPENAI_MODEL", "m"),
                    ("KFS_OPENAI_TIMEOUT", "soon"),
                ],
                "KFS_OPENAI_TIMEOUT",
            ),
            (
                vec![
                    ("KFS_GENERATOR", "openai"),
                    ("KFS_OPENAI_MODEL", "m"),
                    ("KFS_OPENAI_MAX_OUTPUT_TOKENS", "0"),
                ],
                "KFS_OPENAI_MAX_OUTPUT_TOKENS",
            ),
        ];
        for (vars, var) in bad {
            let e = generator_config(lookup(&vars)).unwrap_err();
            assert_eq!(e.var, var, "{vars:?}: {e}");
        }
    }
}
