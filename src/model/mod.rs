//! The reasoning-model port of model-driven compiles: semantic chunking, outline summaries and
//! graph extraction ask a model through [`Models::call`]. Invariant: every call passes the
//! platform's limits in the same order (breaker, then the document's [`Budget`], then the
//! process-wide FIFO [`Gate`]), is bounded by the call timeout, counted in
//! `kfs_model_calls_total` by purpose and outcome and traced in a `model.call` span; a refused
//! call sends nothing. Adapters: [`offline::Offline`] (deterministic, in process: tests, the
//! demo, the bench) and [`openai::OpenAiChat`] (`POST {base}/chat/completions` of any
//! OpenAI-compatible service; its API key is never printed, logged or put in an error).

pub mod limits;
pub mod offline;
pub mod openai;

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use tracing::Instrument;

use crate::canonical::sha256_hex;
use crate::config::ConfigError;
pub use limits::{estimate_tokens, Admit, Breaker, BreakerState, Budget, Exceeded, Gate, Limits};

/// What a model call is for (a metrics label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Purpose {
    /// Splitting a window of a document into semantic chunks.
    Chunk,
    /// Summarising one outline section.
    Summary,
    /// The entities of one knowledge node.
    Entity,
    /// The relations between a node's entities.
    Relation,
    /// One level of a page-index tree search: which visible sections to open or expand.
    Navigate,
}

impl Purpose {
    pub const ALL: [Purpose; 5] = [
        Purpose::Chunk,
        Purpose::Summary,
        Purpose::Entity,
        Purpose::Relation,
        Purpose::Navigate,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Purpose::Chunk => "chunk",
            Purpose::Summary => "summary",
            Purpose::Entity => "entity",
            Purpose::Relation => "relation",
            Purpose::Navigate => "navigate",
        }
    }
}

/// How a call ended (a metrics label).
pub const OUTCOMES: &[&str] = &["ok", "failed", "budget", "circuit_open"];

/// One request to a reasoning model: the messages a remote model reads, and the same input as
/// data for an in-process adapter.
#[derive(Clone, Debug)]
pub struct Prompt {
    pub purpose: Purpose,
    pub system: String,
    pub user: String,
    /// The input the messages were made from.
    pub input: Value,
    /// The longest answer asked for.
    pub max_output_tokens: u32,
}

impl Prompt {
    /// The tokens a call is charged before it is made: its messages and its longest answer.
    pub fn estimated_tokens(&self) -> u64 {
        estimate_tokens(&self.system)
            + estimate_tokens(&self.user)
            + u64::from(self.max_output_tokens)
    }
}

/// A model's answer.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    pub text: String,
    /// The model that answered.
    pub model: String,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// The model may answer next time (down, overloaded, timed out, breaker open).
    #[error("{0}")]
    Unavailable(String),
    /// Trying again will not help (refused, not configured, malformed answer after retries).
    #[error("{0}")]
    Rejected(String),
    /// The document's budget is spent.
    #[error("{0}")]
    Budget(String),
}

/// The failure code of a compile whose document spent its model budget. The platform's budget
/// error carries `DOCUMENT_MODEL_BUDGET_EXCEEDED`, but it is no compilation processing error, so
/// its compile worker's classifier records the attempt as `DOCUMENT_COMPILATION_FAILED` (not
/// retryable) with the budget's message; readers of the attempt see that code.
pub const BUDGET_EXCEEDED: &str = "DOCUMENT_COMPILATION_FAILED";

/// A reasoning model.
#[async_trait::async_trait]
pub trait Reasoner: Send + Sync + fmt::Debug {
    /// The adapter's name (`offline`, `openai`).
    fn name(&self) -> &'static str;
    /// The model this adapter asks for `selected` (the profile's model, unless the adapter is
    /// configured with one of its own).
    fn model_for(&self, selected: &str) -> String;
    async fn complete(&self, model: &str, prompt: &Prompt) -> Result<Completion, ModelError>;
}

/// `sha256:<hex>` of a text: the platform's fingerprint form.
pub fn fingerprint(text: &str) -> String {
    format!("sha256:{}", sha256_hex(text.as_bytes()))
}

/// The process's models: the reasoner, the gate, the breaker and the limits. Cheap to clone.
#[derive(Clone)]
pub struct Models {
    reasoner: Option<Arc<dyn Reasoner>>,
    gate: Gate,
    breaker: Arc<Mutex<Breaker>>,
    pub limits: Limits,
}

impl fmt::Debug for Models {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Models")
            .field("reasoner", &self.reasoner)
            .field("limits", &self.limits)
            .finish()
    }
}

impl Models {
    pub fn new(reasoner: Option<Arc<dyn Reasoner>>, limits: Limits) -> Self {
        Self {
            reasoner,
            gate: Gate::new(limits.concurrency),
            breaker: Arc::new(Mutex::new(Breaker::new(
                limits.breaker_failures,
                limits.breaker_open_for,
            ))),
            limits,
        }
    }

    /// No reasoning model: every compile runs the deterministic pipeline.
    pub fn none() -> Self {
        Self::new(None, Limits::default())
    }

    /// The deterministic offline model with the default limits (tests, the demo, the bench).
    pub fn offline() -> Self {
        Self::new(Some(Arc::new(offline::Offline)), Limits::default())
    }

    pub fn reasoner(&self) -> Option<&Arc<dyn Reasoner>> {
        self.reasoner.as_ref()
    }

    pub fn gate(&self) -> &Gate {
        &self.gate
    }

    /// A fresh budget for one document.
    pub fn budget(&self) -> Budget {
        Budget::new(&self.limits)
    }

    /// The fingerprint of the model a call for `selected` goes to: adapter and model.
    pub fn model_fingerprint(&self, selected: &str) -> Option<String> {
        let r = self.reasoner.as_ref()?;
        Some(fingerprint(&format!(
            "{}\n{}",
            r.name(),
            r.model_for(selected)
        )))
    }

    /// One model call under the limits (see the module's invariant).
    pub async fn call(
        &self,
        budget: &Mutex<Budget>,
        selected: &str,
        prompt: &Prompt,
    ) -> Result<Completion, ModelError> {
        let Some(reasoner) = self.reasoner.clone() else {
            return Err(ModelError::Rejected(
                "no reasoning model is configured (set KFS_REASONER)".into(),
            ));
        };
        let purpose = prompt.purpose.as_str();
        let admit = {
            let mut b = self.breaker.lock().unwrap_or_else(|p| p.into_inner());
            let (admit, next) = b.decide(Instant::now());
            b.state = next;
            admit
        };
        if admit == Admit::Refuse {
            crate::metrics::model_call(purpose, "circuit_open", Duration::ZERO);
            return Err(ModelError::Unavailable(format!(
                "the reasoning model's circuit is open after {} failed calls in a row",
                self.limits.breaker_failures
            )));
        }
        let charged = budget
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .charge(prompt.estimated_tokens());
        if let Err(why) = charged {
            self.settle(admit, None);
            crate::metrics::model_call(purpose, "budget", Duration::ZERO);
            return Err(ModelError::Budget(why.to_string()));
        }
        let model = reasoner.model_for(selected);
        let span =
            tracing::info_span!("model.call", purpose, adapter = reasoner.name(), model = %model);
        let started = Instant::now();
        let result = async {
            let _permit = self.gate.enter().await;
            crate::metrics::model_in_flight(self.gate.in_flight());
            let r =
                tokio::time::timeout(self.limits.call_timeout, reasoner.complete(&model, prompt))
                    .await
                    .unwrap_or_else(|_| {
                        Err(ModelError::Unavailable(format!(
                            "the reasoning model did not answer within {:?}",
                            self.limits.call_timeout
                        )))
                    });
            drop(_permit);
            crate::metrics::model_in_flight(self.gate.in_flight());
            r
        }
        .instrument(span)
        .await;
        self.settle(admit, Some(result.is_ok()));
        let outcome = if result.is_ok() { "ok" } else { "failed" };
        crate::metrics::model_call(purpose, outcome, started.elapsed());
        result
    }

    /// Ends a call for the breaker: `None` for one that was never made (a trial given back).
    fn settle(&self, admit: Admit, ok: Option<bool>) {
        let mut b = self.breaker.lock().unwrap_or_else(|p| p.into_inner());
        b.state = match ok {
            Some(ok) => b.record(admit, ok, Instant::now()),
            None if admit == Admit::Trial => BreakerState::Open {
                until: Instant::now(),
            },
            None => b.state,
        };
    }
}

/// Which reasoning model adapter the process uses (`KFS_REASONER`).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum ReasonerConfig {
    /// None: model-driven compiles are not possible.
    #[default]
    Unconfigured,
    Offline,
    OpenAi(openai::OpenAiChatConfig),
}

/// Reads `KFS_REASONER` (unset: none; `offline`; `openai`), the adapter's settings (see
/// [`openai::config`]) and the limits: `KFS_MODEL_CONCURRENCY` (16),
/// `KFS_DOCUMENT_MODEL_MAX_TOKENS` (2,000,000), `KFS_DOCUMENT_MODEL_MAX_REQUESTS` (500),
/// `KFS_MODEL_BREAKER_FAILURES` (3), `KFS_MODEL_BREAKER_OPEN_SECS` (60) and
/// `KFS_MODEL_TIMEOUT_SECS` (120). Each also answers to the platform's own name
/// (`KNOWLEDGE_MODEL_RUNTIME_GLOBAL_CONCURRENCY`, `KNOWLEDGE_DOCUMENT_MODEL_MAX_ESTIMATED_TOKENS`,
/// `KNOWLEDGE_DOCUMENT_MODEL_MAX_REQUESTS`) where it has one.
pub fn config(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<(ReasonerConfig, Limits), ConfigError> {
    let get = |k: &str| lookup(k).filter(|v| !v.trim().is_empty());
    let reasoner = match get("KFS_REASONER").unwrap_or_default().trim() {
        "" | "none" => ReasonerConfig::Unconfigured,
        "offline" => ReasonerConfig::Offline,
        "openai" => ReasonerConfig::OpenAi(openai::config(&get)?),
        _ => {
            return Err(ConfigError::new(
                "KFS_REASONER",
                "must be offline or openai (or unset for none)",
            ))
        }
    };
    let d = Limits::default();
    let number = |names: &[&'static str], min: u64, max: u64, default: u64| {
        for name in names {
            if let Some(raw) = get(name) {
                return raw
                    .trim()
                    .parse::<u64>()
                    .ok()
                    .filter(|n| (min..=max).contains(n))
                    .ok_or_else(|| {
                        ConfigError::new(
                            name,
                            format!("must be a whole number from {min} to {max}"),
                        )
                    });
            }
        }
        Ok(default)
    };
    let limits = Limits {
        concurrency: number(
            &[
                "KFS_MODEL_CONCURRENCY",
                "KNOWLEDGE_MODEL_RUNTIME_GLOBAL_CONCURRENCY",
            ],
            1,
            128,
            d.concurrency as u64,
        )? as usize,
        document_tokens: number(
            &[
                "KFS_DOCUMENT_MODEL_MAX_TOKENS",
                "KNOWLEDGE_DOCUMENT_MODEL_MAX_ESTIMATED_TOKENS",
            ],
            1,
            20_000_000,
            d.document_tokens,
        )?,
        document_requests: number(
            &[
                "KFS_DOCUMENT_MODEL_MAX_REQUESTS",
                "KNOWLEDGE_DOCUMENT_MODEL_MAX_REQUESTS",
            ],
            1,
            5_000,
            u64::from(d.document_requests),
        )? as u32,
        breaker_failures: number(&["KFS_MODEL_BREAKER_FAILURES"], 1, 1_000, 3)? as u32,
        breaker_open_for: Duration::from_secs(number(
            &["KFS_MODEL_BREAKER_OPEN_SECS"],
            1,
            3_600,
            60,
        )?),
        call_timeout: Duration::from_secs(number(&["KFS_MODEL_TIMEOUT_SECS"], 1, 3_600, 120)?),
    };
    Ok((reasoner, limits))
}

/// The models a configuration names.
pub fn build(cfg: &ReasonerConfig, limits: Limits) -> Result<Models, ConfigError> {
    let reasoner: Option<Arc<dyn Reasoner>> = match cfg {
        ReasonerConfig::Unconfigured => None,
        ReasonerConfig::Offline => Some(Arc::new(offline::Offline)),
        ReasonerConfig::OpenAi(c) => Some(Arc::new(openai::OpenAiChat::new(c.clone())?)),
    };
    Ok(Models::new(reasoner, limits))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn settings_have_the_platforms_defaults_and_names() {
        let (r, l) = config(env(&[])).unwrap();
        assert_eq!(r, ReasonerConfig::Unconfigured);
        assert_eq!(l, Limits::default());
        let (r, l) = config(env(&[
            ("KFS_REASONER", "offline"),
            ("KNOWLEDGE_MODEL_RUNTIME_GLOBAL_CONCURRENCY", "4"),
            ("KNOWLEDGE_DOCUMENT_MODEL_MAX_REQUESTS", "7"),
        ]))
        .unwrap();
        assert_eq!(r, ReasonerConfig::Offline);
        assert_eq!((l.concurrency, l.document_requests), (4, 7));
        let e = config(env(&[("KFS_MODEL_CONCURRENCY", "0")])).unwrap_err();
        assert_eq!(e.var, "KFS_MODEL_CONCURRENCY");
        let e = config(env(&[("KFS_REASONER", "magic")])).unwrap_err();
        assert_eq!(e.var, "KFS_REASONER");
    }

    fn prompt(user: &str) -> Prompt {
        Prompt {
            purpose: Purpose::Summary,
            system: String::new(),
            user: user.into(),
            input: serde_json::json!({"title": "t", "text": user}),
            max_output_tokens: 10,
        }
    }

    /// A model that fails while `failing` is set and counts its calls.
    #[derive(Debug, Default)]
    struct Flaky {
        failing: std::sync::atomic::AtomicBool,
        calls: std::sync::atomic::AtomicU32,
    }

    #[async_trait::async_trait]
    impl Reasoner for Arc<Flaky> {
        fn name(&self) -> &'static str {
            "flaky"
        }
        fn model_for(&self, selected: &str) -> String {
            selected.into()
        }
        async fn complete(&self, model: &str, _: &Prompt) -> Result<Completion, ModelError> {
            use std::sync::atomic::Ordering;
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.failing.load(Ordering::SeqCst) {
                return Err(ModelError::Unavailable("down".into()));
            }
            Ok(Completion {
                text: "{}".into(),
                model: model.into(),
                prompt_tokens: None,
                completion_tokens: None,
            })
        }
    }

    #[tokio::test]
    async fn the_breaker_opens_after_the_failures_and_refuses_without_calling() {
        use std::sync::atomic::Ordering;
        let flaky = Arc::new(Flaky::default());
        flaky.failing.store(true, Ordering::SeqCst);
        let models = Models::new(
            Some(Arc::new(flaky.clone())),
            Limits {
                breaker_failures: 2,
                breaker_open_for: Duration::from_millis(50),
                ..Limits::default()
            },
        );
        let budget = Mutex::new(models.budget());
        for _ in 0..2 {
            assert!(matches!(
                models.call(&budget, "m", &prompt("x")).await,
                Err(ModelError::Unavailable(_))
            ));
        }
        let refused = models.call(&budget, "m", &prompt("x")).await.unwrap_err();
        assert!(refused.to_string().contains("circuit is open"), "{refused}");
        assert_eq!(
            flaky.calls.load(Ordering::SeqCst),
            2,
            "an open breaker sends nothing"
        );
        tokio::time::sleep(Duration::from_millis(60)).await;
        flaky.failing.store(false, Ordering::SeqCst);
        models.call(&budget, "m", &prompt("x")).await.unwrap();
        models.call(&budget, "m", &prompt("x")).await.unwrap();
        assert_eq!(flaky.calls.load(Ordering::SeqCst), 4);
    }

    #[tokio::test]
    async fn a_call_over_the_documents_budget_is_refused_before_it_is_sent() {
        use std::sync::atomic::Ordering;
        let flaky = Arc::new(Flaky::default());
        let models = Models::new(
            Some(Arc::new(flaky.clone())),
            Limits {
                document_requests: 2,
                ..Limits::default()
            },
        );
        let budget = Mutex::new(models.budget());
        models.call(&budget, "m", &prompt("x")).await.unwrap();
        models.call(&budget, "m", &prompt("x")).await.unwrap();
        let e = models.call(&budget, "m", &prompt("x")).await.unwrap_err();
        assert!(matches!(e, ModelError::Budget(_)), "{e:?}");
        assert_eq!(flaky.calls.load(Ordering::SeqCst), 2);
        // Another document has its own budget.
        let other = Mutex::new(models.budget());
        models.call(&other, "m", &prompt("x")).await.unwrap();
    }
}
