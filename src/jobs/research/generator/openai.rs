//! The OpenAI-compatible generator: `POST {base}/chat/completions`, streamed. Invariant: the
//! prompt holds only the task's question and its numbered evidence, the request asks for at most
//! `max_output_tokens`, so [`Generator::estimate`] bounds what a call may cost before it is made;
//! the answer reaches the sink as the service sends it (server-sent events, `stream: true`; a
//! service that answers with one JSON completion instead gives it in one piece), and a stream
//! that ends before the service finished its answer is an error, never an answer; the usage the
//! service reports (or an estimate from text length, marked as such) is what the call cost; the
//! API key is only ever sent as a bearer token, never printed, logged or put into an error.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;

use super::{AnswerSink, Citation, Generation, GenerationRequest, Generator, Usage};
use crate::config::{self, ConfigError};
use crate::jobs::research::budget::Estimate;
use crate::jobs::JobError;

/// The longest answer asked for unless `KFS_OPENAI_MAX_OUTPUT_TOKENS` says otherwise.
pub const DEFAULT_MAX_OUTPUT_TOKENS: u32 = 1024;

pub use crate::config::ApiKey;

/// Settings of the OpenAI-compatible generator.
#[derive(Clone, Debug, PartialEq)]
pub struct OpenAiConfig {
    /// e.g. `https://api.openai.com/v1`; requests go to `{base}/chat/completions`.
    pub base_url: url::Url,
    pub api_key: Option<ApiKey>,
    pub model: String,
    /// USD per 1000 prompt tokens.
    pub price_per_1k_input: f64,
    /// USD per 1000 completion tokens.
    pub price_per_1k_output: f64,
    pub timeout: Duration,
    /// The longest answer asked for (`max_tokens`), and reserved against the budget.
    pub max_output_tokens: u32,
}

impl OpenAiConfig {
    pub fn endpoint(&self) -> String {
        format!(
            "{}/chat/completions",
            self.base_url.as_str().trim_end_matches('/')
        )
    }

    /// USD for a usage at this configuration's prices.
    pub fn cost(&self, usage: &Usage) -> f64 {
        (usage.prompt_tokens as f64) / 1000.0 * self.price_per_1k_input
            + (usage.completion_tokens as f64) / 1000.0 * self.price_per_1k_output
    }
}

/// Calls `POST {base}/chat/completions` of an OpenAI-compatible service.
pub struct OpenAiGenerator {
    cfg: OpenAiConfig,
    client: reqwest::Client,
}

impl fmt::Debug for OpenAiGenerator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiGenerator")
            .field("cfg", &self.cfg)
            .finish()
    }
}

/// Most characters of one evidence passage sent to the service.
const PASSAGE_CHARS: usize = 2000;

const SYSTEM_PROMPT: &str =
    "You answer questions using only the numbered evidence passages you are given. \
Cite every claim with the passage number in square brackets, e.g. [1]. If the evidence does not \
answer the question, say so plainly.";

/// The prompt's user message: the question and the numbered evidence.
pub fn user_prompt(req: &GenerationRequest<'_>) -> String {
    let mut s = format!("Question: {}\n\nEvidence:\n", req.question.trim());
    for (i, e) in req.evidence.iter().enumerate() {
        let passage: String = e.content.chars().take(PASSAGE_CHARS).collect();
        s.push_str(&format!(
            "[{}] ({}) {}\n",
            i + 1,
            e.filename,
            passage.trim()
        ));
    }
    if req.evidence.is_empty() {
        s.push_str("(none)\n");
    }
    s
}

/// The `[n]` markers of an answer that name a passage, each once, in order.
pub fn cited_indices(answer: &str, passages: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut rest = answer;
    while let Some(open) = rest.find('[') {
        rest = &rest[open + 1..];
        let Some(close) = rest.find(']') else { break };
        for part in rest[..close].split(',') {
            if let Ok(n) = part.trim().parse::<usize>() {
                if (1..=passages).contains(&n) && !out.contains(&n) {
                    out.push(n);
                }
            }
        }
        rest = &rest[close + 1..];
    }
    out.sort_unstable();
    out
}

fn estimate_tokens(chars: usize) -> u64 {
    u64::try_from(chars.div_ceil(4)).unwrap_or(u64::MAX)
}

#[derive(Deserialize)]
struct ChatResponse {
    choices: Vec<ChatChoice>,
    usage: Option<ChatUsage>,
    model: Option<String>,
}

#[derive(Deserialize)]
struct ChatChoice {
    message: ChatMessage,
}

#[derive(Deserialize)]
struct ChatMessage {
    content: Option<String>,
}

#[derive(Deserialize)]
struct ChatUsage {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
}

/// One event of a streamed completion (`chat.completion.chunk`).
#[derive(Deserialize)]
struct StreamChunk {
    #[serde(default)]
    choices: Vec<StreamChoice>,
    usage: Option<ChatUsage>,
    model: Option<String>,
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct StreamChoice {
    #[serde(default)]
    index: u32,
    delta: Option<StreamDelta>,
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct StreamDelta {
    content: Option<String>,
}

/// The `data` of server-sent events, from bytes as they arrive. Pure.
#[derive(Debug, Default)]
pub struct SseData {
    buf: Vec<u8>,
    lines: Vec<String>,
}

impl SseData {
    /// Takes the next bytes; returns the `data` of each event they complete (its `data:` lines
    /// joined by newlines), in order. Other fields and comments are skipped; a line is only read
    /// once it is whole, so a character split between two reads is never cut.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(end) = self.buf.iter().position(|b| *b == b'\n') {
            let raw: Vec<u8> = self.buf.drain(..=end).collect();
            let line = String::from_utf8_lossy(&raw[..end]);
            let line = line.strip_suffix('\r').unwrap_or(&line);
            if line.is_empty() {
                if !self.lines.is_empty() {
                    out.push(std::mem::take(&mut self.lines).join("\n"));
                }
            } else if let Some(data) = line.strip_prefix("data:") {
                self.lines
                    .push(data.strip_prefix(' ').unwrap_or(data).to_owned());
            }
        }
        out
    }
}
impl OpenAiGenerator {
    pub fn new(cfg: OpenAiConfig) -> Result<Self, ConfigError> {
        let client = config::http_client("KFS_GENERATOR", cfg.timeout)?;
        Ok(Self { cfg, client })
    }

    pub fn config(&self) -> &OpenAiConfig {
        &self.cfg
    }

    fn where_(&self) -> String {
        config::redact(&self.cfg.base_url)
    }
}

#[async_trait::async_trait]
impl Generator for OpenAiGenerator {
    fn name(&self) -> &'static str {
        "openai"
    }

    fn estimate(&self, req: &GenerationRequest<'_>) -> Estimate {
        let prompt_tokens = estimate_tokens(SYSTEM_PROMPT.len() + user_prompt(req).len());
        let max_output_tokens = u64::from(self.cfg.max_output_tokens);
        Estimate {
            prompt_tokens,
            max_output_tokens,
            usd: self.cfg.cost(&Usage {
                prompt_tokens,
                completion_tokens: max_output_tokens,
                estimated: true,
            }),
        }
    }

    async fn generate(
        &self,
        req: &GenerationRequest<'_>,
        sink: &mut dyn AnswerSink,
    ) -> Result<Generation, JobError> {
        let prompt = user_prompt(req);
        let body = serde_json::json!({
            "model": self.cfg.model,
            "temperature": 0,
            "max_tokens": self.cfg.max_output_tokens,
            "stream": true,
            "stream_options": { "include_usage": true },
            "messages": [
                { "role": "system", "content": SYSTEM_PROMPT },
                { "role": "user", "content": prompt },
            ],
        });
        let mut call = self
            .client
            .post(self.cfg.endpoint())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(
                reqwest::header::ACCEPT,
                "text/event-stream, application/json",
            )
            .body(body.to_string());
        if let Some(key) = &self.cfg.api_key {
            call = call.bearer_auth(key.expose());
        }
        let resp = call.send().await.map_err(|e| {
            JobError::retryable(
                "generator_unavailable",
                format!(
                    "the generator at {} did not answer: {}",
                    self.where_(),
                    e.without_url()
                ),
            )
        })?;
        let status = resp.status();
        if status.as_u16() == 429 || status.is_server_error() {
            return Err(JobError::retryable(
                "generator_unavailable",
                format!("the generator at {} answered HTTP {status}", self.where_()),
            ));
        }
        if !status.is_success() {
            return Err(JobError::fatal(
                "generator_rejected",
                format!(
                    "the generator at {} refused the request with HTTP {status}",
                    self.where_()
                ),
            ));
        }
        let streamed = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
        let made = if streamed {
            read_stream(resp, sink).await?
        } else {
            read_whole(resp, sink).await?
        };
        if made.answer.trim().is_empty() {
            return Err(JobError::fatal(
                "generator_bad_response",
                "the generator's answer has no message content",
            ));
        }
        let answer = made.answer;
        let usage = match made.usage {
            Some(ChatUsage {
                prompt_tokens: Some(p),
                completion_tokens: Some(c),
            }) => Usage {
                prompt_tokens: p,
                completion_tokens: c,
                estimated: false,
            },
            _ => Usage {
                prompt_tokens: estimate_tokens(SYSTEM_PROMPT.len() + prompt.len()),
                completion_tokens: estimate_tokens(answer.trim().len()),
                estimated: true,
            },
        };
        let mut cited = cited_indices(&answer, req.evidence.len());
        if cited.is_empty() {
            // No marker: the answer rests on everything it was given.
            cited = (1..=req.evidence.len()).collect();
        }
        let citations = cited
            .into_iter()
            .map(|n| Citation::of(n, &req.evidence[n - 1]))
            .collect();
        Ok(Generation {
            answer,
            citations,
            generator: self.name().into(),
            model: Some(made.model.unwrap_or_else(|| self.cfg.model.clone())),
            cost_usd: self.cfg.cost(&usage),
            usage: Some(usage),
        })
    }
}

/// What a call returned: the answer as sent, and what the service said of it.
struct Made {
    answer: String,
    usage: Option<ChatUsage>,
    model: Option<String>,
}

fn bad_response(what: impl fmt::Display) -> JobError {
    JobError::fatal(
        "generator_bad_response",
        format!("the generator's answer is not a chat completion: {what}"),
    )
}

fn cut_off(e: reqwest::Error) -> JobError {
    JobError::retryable(
        "generator_unavailable",
        format!("reading the generator's answer failed: {}", e.without_url()),
    )
}

/// A streamed completion: each piece of the first choice's content to `sink` as it arrives.
async fn read_stream(
    mut resp: reqwest::Response,
    sink: &mut dyn AnswerSink,
) -> Result<Made, JobError> {
    let mut sse = SseData::default();
    let mut made = Made {
        answer: String::new(),
        usage: None,
        model: None,
    };
    let mut finished = false;
    let mut done = false;
    while !done {
        let Some(bytes) = resp.chunk().await.map_err(cut_off)? else {
            break;
        };
        for data in sse.feed(&bytes) {
            if data.trim() == "[DONE]" {
                done = true;
                break;
            }
            let chunk: StreamChunk = serde_json::from_str(&data).map_err(bad_response)?;
            if chunk.error.is_some() {
                return Err(JobError::retryable(
                    "generator_unavailable",
                    "the generator reported an error in the middle of its answer",
                ));
            }
            if chunk.usage.is_some() {
                made.usage = chunk.usage;
            }
            if made.model.is_none() {
                made.model = chunk.model;
            }
            for choice in chunk.choices.into_iter().filter(|c| c.index == 0) {
                if let Some(piece) = choice.delta.and_then(|d| d.content) {
                    if !piece.is_empty() {
                        made.answer.push_str(&piece);
                        sink.text(&piece).await?;
                    }
                }
                finished |= choice.finish_reason.is_some();
            }
        }
    }
    if !(done || finished) {
        return Err(JobError::retryable(
            "generator_unavailable",
            "the generator's stream ended before its answer was finished",
        ));
    }
    Ok(made)
}

/// A completion in one JSON body (a service that does not stream): its content in one piece.
async fn read_whole(resp: reqwest::Response, sink: &mut dyn AnswerSink) -> Result<Made, JobError> {
    let bytes = resp.bytes().await.map_err(cut_off)?;
    let parsed: ChatResponse = serde_json::from_slice(&bytes).map_err(bad_response)?;
    let answer = parsed
        .choices
        .into_iter()
        .next()
        .and_then(|c| c.message.content)
        .unwrap_or_default();
    if !answer.is_empty() {
        sink.text(&answer).await?;
    }
    Ok(Made {
        answer,
        usage: parsed.usage,
        model: parsed.model,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cited_indices_table() {
        let table: Vec<(&str, usize, Vec<usize>)> = vec![
            ("A [1] and B [2].", 3, vec![1, 2]),
            ("A [2][2] [1, 3]", 3, vec![1, 2, 3]),
            ("A [4] [0] [x]", 3, vec![]),
            ("no markers", 3, vec![]),
            ("[1", 3, vec![]),
        ];
        for (answer, n, want) in table {
            assert_eq!(cited_indices(answer, n), want, "{answer:?}");
        }
    }

    #[test]
    fn server_sent_events_are_read_whole_lines_at_a_time() {
        let mut sse = SseData::default();
        // (bytes fed, data completed by them)
        let table: Vec<(&[u8], Vec<&str>)> = vec![
            (b"data: {\"a\":1}\n\n", vec!["{\"a\":1}"]),
            (b"data: {\"b\":", vec![]),
            (b"2}\r\n\r\n: keep-alive\n\n", vec!["{\"b\":2}"]),
            (
                b"event: x\nid: 3\ndata:one\ndata: two\n\n",
                vec!["one\ntwo"],
            ),
            // A character split between two reads.
            (&[b'd', b'a', b't', b'a', b':', b' ', 0xC3], vec![]),
            (&[0xA9, b'\n', b'\n'], vec!["\u{e9}"]),
            (b"data: [DONE]\n\n", vec!["[DONE]"]),
        ];
        for (bytes, want) in table {
            assert_eq!(
                sse.feed(bytes),
                want,
                "{:?}",
                String::from_utf8_lossy(bytes)
            );
        }
    }

    #[test]
    fn the_estimate_reserves_the_longest_answer() {
        let g = OpenAiGenerator::new(OpenAiConfig {
            base_url: url::Url::parse("http://127.0.0.1:9/v1").unwrap(),
            api_key: None,
            model: "m".into(),
            price_per_1k_input: 1.0,
            price_per_1k_output: 2.0,
            timeout: Duration::from_secs(1),
            max_output_tokens: 500,
        })
        .unwrap();
        let evidence = [super::super::tests::ev(1, "Leases last thirty seconds.")];
        let req = GenerationRequest {
            question: "How long?",
            evidence: &evidence,
        };
        let e = g.estimate(&req);
        let chars = SYSTEM_PROMPT.len() + user_prompt(&req).len();
        assert_eq!(e.prompt_tokens, estimate_tokens(chars));
        assert_eq!(e.max_output_tokens, 500);
        assert!((e.usd - (e.prompt_tokens as f64 / 1000.0 + 1.0)).abs() < 1e-9);
    }
}
