//! The task's spend, in the platform's `cost` shape: `{"budgetUsd"?, "budgetExceeded"?,
//! "entries": [...], "totalUsd"}`, one entry per model call keyed by its `researchModelCallId`
//! (`attempt:<executionAttempt>:<callId>`). Invariant: pure functions only; a call is reserved
//! (its estimated price appended as a `reserved` entry) before it is made, and only when the
//! reservation keeps `totalUsd` within the budget; a reservation is made once per call id; once
//! the call returns, its entry is settled in place with what it really cost and `totalUsd` is the
//! sum of the entries, with `budgetExceeded` set when that sum passed the budget.

use serde::{Deserialize, Serialize};

/// The platform's cancel reason of a task whose budget would be, or was, passed.
pub const BUDGET_EXHAUSTED: &str = "RESEARCH_TASK_BUDGET_EXHAUSTED";

/// The platform's limit on entries per task.
pub const MAX_ENTRIES: usize = 1000;

/// Most characters of an entry's `provider` and `step`.
pub const MAX_LABEL_CHARS: usize = 200;

/// `cost` as stored.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Cost {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_usd: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_exceeded: Option<bool>,
    #[serde(default)]
    pub entries: Vec<Entry>,
    #[serde(default)]
    pub total_usd: f64,
}

/// One model call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    pub cost_usd: f64,
    pub provider: String,
    /// Epoch milliseconds of the reservation (kept when the entry is settled).
    pub recorded_at: i64,
    pub step: String,
    pub usage: EntryUsage,
}

/// An entry's tokens and state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EntryUsage {
    pub completion_tokens: u64,
    pub estimated: bool,
    pub prompt_tokens: u64,
    pub research_model_call_id: String,
    pub reserved: bool,
    /// `reserved`, `succeeded` or `failed`.
    pub status: String,
    pub total_tokens: u64,
}

/// What a call is expected to cost before it is made: its estimated prompt and the most it may
/// answer, at the generator's prices.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Estimate {
    pub prompt_tokens: u64,
    pub max_output_tokens: u64,
    pub usd: f64,
}

/// What a call really used.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Actual {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub estimated: bool,
    pub usd: f64,
}

/// The reservation would pass the budget; nothing was written.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Exceeded {
    pub spent_usd: f64,
    pub needed_usd: f64,
    pub budget_usd: f64,
}

/// USD rounded to a millionth, as the platform rounds.
pub fn round_usd(usd: f64) -> f64 {
    if usd.is_finite() {
        (usd * 1_000_000.0).round() / 1_000_000.0
    } else {
        0.0
    }
}

/// `attempt:<n>:query-answer:<jobId>:<n>:<generator>`: the id of the answer call of one
/// execution attempt.
pub fn answer_call_id(job_id: uuid::Uuid, attempt: i32, generator: &str) -> String {
    format!("attempt:{attempt}:query-answer:{job_id}:{attempt}:{generator}")
}

fn label(s: &str) -> String {
    s.chars().take(MAX_LABEL_CHARS).collect()
}

impl Cost {
    /// The stored value, or a fresh one for `budget` when it is absent or of an older shape.
    pub fn parse(stored: &serde_json::Value, budget: Option<f64>) -> Cost {
        let mut c: Cost = serde_json::from_value(stored.clone()).unwrap_or_default();
        if c.budget_usd.is_none() {
            c.budget_usd = budget;
        }
        c
    }

    /// The initial `cost` of a task with this budget.
    pub fn initial(budget: Option<f64>) -> Cost {
        Cost {
            budget_usd: budget,
            ..Cost::default()
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self)
            .unwrap_or_else(|_| serde_json::json!({"entries": [], "totalUsd": 0}))
    }

    pub fn entry(&self, call_id: &str) -> Option<&Entry> {
        self.entries
            .iter()
            .find(|e| e.usage.research_model_call_id == call_id)
    }

    fn sum(&self) -> f64 {
        round_usd(self.entries.iter().map(|e| e.cost_usd).sum())
    }

    /// Reserves a call: appends its `reserved` entry and adds its price to `totalUsd`. A call
    /// already reserved (a replay) changes nothing. Returns `Err` and changes nothing when the
    /// reservation would pass the budget, or the task has no room for another entry.
    pub fn reserve(
        &mut self,
        call_id: &str,
        estimate: Estimate,
        provider: &str,
        step: &str,
        now_ms: i64,
    ) -> Result<(), Exceeded> {
        if self.entry(call_id).is_some() {
            return Ok(());
        }
        let cost = round_usd(estimate.usd.max(0.0));
        let exceeded = Exceeded {
            spent_usd: self.total_usd,
            needed_usd: cost,
            budget_usd: self.budget_usd.unwrap_or(f64::INFINITY),
        };
        if self.entries.len() >= MAX_ENTRIES {
            return Err(exceeded);
        }
        if let Some(b) = self.budget_usd {
            if round_usd(self.total_usd + cost) > b {
                return Err(exceeded);
            }
        }
        self.entries.push(Entry {
            cost_usd: cost,
            provider: label(provider),
            recorded_at: now_ms,
            step: label(step),
            usage: EntryUsage {
                completion_tokens: estimate.max_output_tokens,
                estimated: true,
                prompt_tokens: estimate.prompt_tokens,
                research_model_call_id: call_id.to_owned(),
                reserved: true,
                status: "reserved".into(),
                total_tokens: estimate.prompt_tokens + estimate.max_output_tokens,
            },
        });
        self.total_usd = round_usd(self.total_usd + cost);
        Ok(())
    }

    /// Settles a reserved call with what it used (`succeeded`, or `failed`). Returns whether
    /// the total now passes the budget (then `budgetExceeded` is set).
    pub fn settle(&mut self, call_id: &str, actual: Actual, succeeded: bool) -> bool {
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| e.usage.research_model_call_id == call_id)
        {
            e.cost_usd = round_usd(actual.usd.max(0.0));
            e.usage.prompt_tokens = actual.prompt_tokens;
            e.usage.completion_tokens = actual.completion_tokens;
            e.usage.total_tokens = actual.prompt_tokens + actual.completion_tokens;
            e.usage.estimated = actual.estimated;
            e.usage.reserved = false;
            e.usage.status = if succeeded { "succeeded" } else { "failed" }.into();
        }
        self.total_usd = self.sum();
        let over = self.budget_usd.is_some_and(|b| self.total_usd > b);
        if over {
            self.budget_exceeded = Some(true);
        }
        over
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn est(usd: f64) -> Estimate {
        Estimate {
            prompt_tokens: 100,
            max_output_tokens: 50,
            usd,
        }
    }

    #[test]
    fn the_platform_shape() {
        let mut c = Cost::initial(Some(1.0));
        assert_eq!(
            c.to_json(),
            json!({"budgetUsd": 1.0, "entries": [], "totalUsd": 0.0})
        );
        c.reserve("attempt:1:x", est(0.000_000_4), "openai", "query.answer", 7)
            .unwrap();
        assert_eq!(
            c.to_json(),
            json!({"budgetUsd": 1.0, "entries": [{"costUsd": 0.0, "provider": "openai", "recordedAt": 7,
              "step": "query.answer", "usage": {"completionTokens": 50, "estimated": true, "promptTokens": 100,
              "researchModelCallId": "attempt:1:x", "reserved": true, "status": "reserved", "totalTokens": 150}}],
              "totalUsd": 0.0})
        );
        assert_eq!(
            Cost::initial(None).to_json(),
            json!({"entries": [], "totalUsd": 0.0})
        );
        // An older shape, or garbage, reads as a fresh cost with the job's budget.
        assert_eq!(
            Cost::parse(&json!({"usd": 3}), Some(2.0)),
            Cost::initial(Some(2.0))
        );
    }

    #[test]
    fn reserve_and_settle_table() {
        // (budget, spent before, reservation, actual, reserve ok, exceeded after settle)
        let table: Vec<(Option<f64>, f64, f64, f64, bool, bool)> = vec![
            (None, 0.0, 5.0, 9.0, true, false),
            (Some(1.0), 0.0, 0.4, 0.5, true, false),
            (Some(1.0), 0.0, 1.0, 1.0, true, false),
            (Some(1.0), 0.0, 0.01, 5.001, true, true),
            (Some(1.0), 0.7, 0.4, 0.0, false, false),
            (Some(0.0), 0.0, 0.000_001, 0.0, false, false),
            (Some(0.0), 0.0, 0.0, 0.0, true, false),
        ];
        for (budget, spent, reserve, actual, ok, over) in table {
            let mut c = Cost::initial(budget);
            if spent > 0.0 {
                c.reserve("earlier", est(spent), "p", "s", 1).unwrap();
            }
            let before = c.clone();
            let r = c.reserve("call", est(reserve), "p", "s", 2);
            assert_eq!(r.is_ok(), ok, "{budget:?} {spent} {reserve}");
            if !ok {
                assert_eq!(c, before, "a refused reservation writes nothing");
                continue;
            }
            assert!((c.total_usd - round_usd(spent + reserve)).abs() < 1e-9);
            let a = Actual {
                prompt_tokens: 10,
                completion_tokens: 20,
                estimated: false,
                usd: actual,
            };
            assert_eq!(c.settle("call", a, true), over, "{budget:?} {actual}");
            assert!((c.total_usd - round_usd(spent + actual)).abs() < 1e-9);
            assert_eq!(c.budget_exceeded, over.then_some(true));
            let e = c.entry("call").unwrap();
            assert_eq!(
                (e.usage.status.as_str(), e.usage.reserved),
                ("succeeded", false)
            );
            assert_eq!(e.usage.total_tokens, 30);
            assert_eq!(e.recorded_at, 2, "the reservation's time stays");
        }
    }

    #[test]
    fn a_call_is_reserved_once() {
        let mut c = Cost::initial(Some(1.0));
        c.reserve("a", est(0.6), "p", "s", 1).unwrap();
        c.reserve("a", est(0.6), "p", "s", 2).unwrap();
        assert_eq!(c.entries.len(), 1);
        assert!((c.total_usd - 0.6).abs() < 1e-9);
        assert_eq!(round_usd(0.123_456_789), 0.123_457);
        assert_eq!(
            answer_call_id(uuid::Uuid::nil(), 2, "openai"),
            format!("attempt:2:query-answer:{}:2:openai", uuid::Uuid::nil())
        );
    }
}
