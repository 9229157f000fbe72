//! The OpenAI-compatible reasoning adapter: `POST {base}/chat/completions`, not streamed, at
//! temperature 0, asking for a JSON object. Invariant: the API key is sent only as the bearer
//! token and never printed, logged or put in an error; a 429, a 5xx or no answer is
//! [`ModelError::Unavailable`], any other refusal [`ModelError::Rejected`].

use std::fmt;
use std::time::Duration;

use serde::Deserialize;

use super::{Completion, ModelError, Prompt, Reasoner};
use crate::config::ApiKey;
use crate::config::{self, ConfigError};

/// Settings of the adapter.
#[derive(Clone, Debug, PartialEq)]
pub struct OpenAiChatConfig {
    pub base_url: url::Url,
    pub api_key: Option<ApiKey>,
    /// The model asked for; `None`: each profile's own reasoning model.
    pub model: Option<String>,
    pub timeout: Duration,
}

/// Reads `KFS_REASONING_BASE_URL` (else `KFS_OPENAI_BASE_URL`, else the OpenAI API),
/// `KFS_REASONING_API_KEY` (else `KFS_OPENAI_API_KEY`) and `KFS_REASONING_MODEL` (else the
/// profile's model).
pub fn config(get: &dyn Fn(&str) -> Option<String>) -> Result<OpenAiChatConfig, ConfigError> {
    let base_url = crate::embed::openai_base_url(get, "KFS_REASONING_BASE_URL")?;
    Ok(OpenAiChatConfig {
        base_url,
        api_key: get("KFS_REASONING_API_KEY")
            .or_else(|| get("KFS_OPENAI_API_KEY"))
            .map(|k| ApiKey::new(k.trim())),
        model: get("KFS_REASONING_MODEL").map(|m| m.trim().to_owned()),
        timeout: Duration::from_secs(120),
    })
}

pub struct OpenAiChat {
    cfg: OpenAiChatConfig,
    client: reqwest::Client,
}

impl fmt::Debug for OpenAiChat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiChat")
            .field("cfg", &self.cfg)
            .finish()
    }
}

impl OpenAiChat {
    pub fn new(cfg: OpenAiChatConfig) -> Result<Self, ConfigError> {
        let client = config::http_client("KFS_REASONER", cfg.timeout)?;
        Ok(Self { cfg, client })
    }

    fn endpoint(&self) -> String {
        format!(
            "{}/chat/completions",
            self.cfg.base_url.as_str().trim_end_matches('/')
        )
    }
}

#[derive(Deserialize)]
struct ChatResponse {
    choices: Vec<Choice>,
    usage: Option<Usage>,
    model: Option<String>,
}

#[derive(Deserialize)]
struct Choice {
    message: Message,
}

#[derive(Deserialize)]
struct Message {
    content: Option<String>,
}

#[derive(Deserialize)]
struct Usage {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
}

#[async_trait::async_trait]
impl Reasoner for OpenAiChat {
    fn name(&self) -> &'static str {
        "openai"
    }

    fn model_for(&self, selected: &str) -> String {
        self.cfg
            .model
            .clone()
            .unwrap_or_else(|| selected.to_owned())
    }

    async fn complete(&self, model: &str, prompt: &Prompt) -> Result<Completion, ModelError> {
        let body = serde_json::json!({
            "model": model,
            "temperature": 0,
            "max_tokens": prompt.max_output_tokens,
            "response_format": { "type": "json_object" },
            "messages": [
                { "role": "system", "content": prompt.system },
                { "role": "user", "content": prompt.user },
            ],
        });
        let where_ = config::redact(&self.cfg.base_url);
        let mut call = self
            .client
            .post(self.endpoint())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string());
        if let Some(key) = &self.cfg.api_key {
            call = call.bearer_auth(key.expose());
        }
        let resp = call.send().await.map_err(|e| {
            ModelError::Unavailable(format!(
                "the reasoning model at {where_} did not answer: {}",
                e.without_url()
            ))
        })?;
        let status = resp.status();
        if status.as_u16() == 429 || status.is_server_error() {
            return Err(ModelError::Unavailable(format!(
                "the reasoning model at {where_} answered HTTP {status}"
            )));
        }
        if !status.is_success() {
            return Err(ModelError::Rejected(format!(
                "the reasoning model at {where_} refused the request with HTTP {status}"
            )));
        }
        let body = resp.bytes().await.map_err(|e| {
            ModelError::Unavailable(format!(
                "the reasoning model at {where_} broke off its answer: {}",
                e.without_url()
            ))
        })?;
        let r: ChatResponse = serde_json::from_slice(&body).map_err(|e| {
            ModelError::Unavailable(format!(
                "the reasoning model at {where_} sent an answer that is not a chat completion: {e}"
            ))
        })?;
        let text = r
            .choices
            .into_iter()
            .next()
            .and_then(|c| c.message.content)
            .filter(|t| !t.trim().is_empty())
            .ok_or_else(|| {
                ModelError::Unavailable(format!(
                    "the reasoning model at {where_} answered with no message content"
                ))
            })?;
        Ok(Completion {
            text,
            model: r.model.unwrap_or_else(|| model.to_owned()),
            prompt_tokens: r.usage.as_ref().and_then(|u| u.prompt_tokens),
            completion_tokens: r.usage.as_ref().and_then(|u| u.completion_tokens),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_is_never_in_the_config_debug_and_a_bad_url_is_not_echoed() {
        let get = |k: &str| match k {
            "KFS_REASONING_API_KEY" => Some("sk-very-secret".to_owned()),
            "KFS_REASONING_BASE_URL" => Some("http://127.0.0.1:9/v1".to_owned()),
            _ => None,
        };
        let c = config(&get).unwrap();
        assert!(!format!("{c:?}").contains("sk-very-secret"));
        let bad = |k: &str| (k == "KFS_REASONING_BASE_URL").then(|| "ftp://u:hunter2@x".to_owned());
        let e = config(&bad).unwrap_err();
        assert_eq!(e.var, "KFS_REASONING_BASE_URL");
        assert!(!e.to_string().contains("hunter2"));
    }
}
