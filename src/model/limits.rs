//! The platform's model limits: a process-wide FIFO gate on concurrent model calls, a
//! per-document budget of estimated tokens and requests, and a circuit breaker. Invariant: a
//! call is charged to its document's budget before it is made and refused, with nothing sent,
//! once the budget would be exceeded; at most `concurrency` calls are in flight in the process,
//! and waiters are let in in the order they came; while the breaker is open no call is made,
//! and after its cool-down exactly one trial call decides whether it closes again. The breaker
//! is a pure state machine ([`Breaker::decide`], [`Breaker::record`]) driven by the caller's
//! clock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The limits' settings, with the platform's defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// `KNOWLEDGE_MODEL_RUNTIME_GLOBAL_CONCURRENCY`: model calls in flight in the process.
    pub concurrency: usize,
    /// `KNOWLEDGE_DOCUMENT_MODEL_MAX_ESTIMATED_TOKENS`: estimated tokens per document.
    pub document_tokens: u64,
    /// `KNOWLEDGE_DOCUMENT_MODEL_MAX_REQUESTS`: model requests per document.
    pub document_requests: u32,
    /// Consecutive failed calls that open the breaker.
    pub breaker_failures: u32,
    /// How long the open breaker refuses calls before one trial.
    pub breaker_open_for: Duration,
    /// The longest one call may take.
    pub call_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            concurrency: 16,
            document_tokens: 2_000_000,
            document_requests: 500,
            breaker_failures: 3,
            breaker_open_for: Duration::from_secs(60),
            call_timeout: Duration::from_secs(120),
        }
    }
}

/// Estimated tokens of a text, as the platform estimates them: a third of its UTF-8 bytes,
/// rounded up, at least one for any text.
pub fn estimate_tokens(text: &str) -> u64 {
    if text.is_empty() {
        return 0;
    }
    u64::try_from(text.len().div_ceil(3))
        .unwrap_or(u64::MAX)
        .max(1)
}

/// The process-wide FIFO gate: tokio's semaphore hands permits out in the order they were asked
/// for.
#[derive(Clone, Debug)]
pub struct Gate {
    permits: Arc<Semaphore>,
    size: usize,
}

impl Gate {
    pub fn new(size: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(size.max(1))),
            size: size.max(1),
        }
    }

    /// Waits for a place; the call holds it until the permit drops.
    pub async fn enter(&self) -> OwnedSemaphorePermit {
        self.permits
            .clone()
            .acquire_owned()
            .await
            .expect("the model gate is never closed")
    }

    /// Calls in flight now.
    pub fn in_flight(&self) -> usize {
        self.size - self.permits.available_permits()
    }

    pub fn size(&self) -> usize {
        self.size
    }
}

/// One document's model budget: what its compile may still spend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Budget {
    pub max_tokens: u64,
    pub max_requests: u32,
    pub tokens: u64,
    pub requests: u32,
}

/// Why a budget refused a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Exceeded {
    Requests { max: u32 },
    Tokens { max: u64, wanted: u64, spent: u64 },
}

impl std::fmt::Display for Exceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exceeded::Requests { max } => {
                write!(
                    f,
                    "Document model request budget exceeded maxRequests={max}"
                )
            }
            Exceeded::Tokens { max, wanted, spent } => write!(
                f,
                "Document model token budget exceeded maxEstimatedTokens={max} (a call of about \
                 {wanted} tokens after {spent})"
            ),
        }
    }
}

impl Budget {
    pub fn new(limits: &Limits) -> Self {
        Self {
            max_tokens: limits.document_tokens,
            max_requests: limits.document_requests,
            tokens: 0,
            requests: 0,
        }
    }

    /// Charges one call of about `tokens` tokens, or refuses it and charges nothing.
    pub fn charge(&mut self, tokens: u64) -> Result<(), Exceeded> {
        if self.requests >= self.max_requests {
            return Err(Exceeded::Requests {
                max: self.max_requests,
            });
        }
        if self.tokens.saturating_add(tokens) > self.max_tokens {
            return Err(Exceeded::Tokens {
                max: self.max_tokens,
                wanted: tokens,
                spent: self.tokens,
            });
        }
        self.requests += 1;
        self.tokens += tokens;
        Ok(())
    }
}

/// The breaker's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go through; `failures` in a row so far.
    Closed { failures: u32 },
    /// Calls are refused until `until`.
    Open { until: Instant },
    /// One trial call is out; the others are refused until it ends.
    Trial,
}

/// What the breaker says of a call about to be made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    Call,
    /// This call is the trial after the cool-down.
    Trial,
    Refuse,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Breaker {
    pub state: BreakerState,
    pub threshold: u32,
    pub open_for: Duration,
}

impl Breaker {
    pub fn new(threshold: u32, open_for: Duration) -> Self {
        Self {
            state: BreakerState::Closed { failures: 0 },
            threshold: threshold.max(1),
            open_for,
        }
    }

    /// Whether a call may be made at `now`, and the state that follows.
    pub fn decide(self, now: Instant) -> (Admit, BreakerState) {
        match self.state {
            BreakerState::Closed { .. } => (Admit::Call, self.state),
            BreakerState::Open { until } if now >= until => (Admit::Trial, BreakerState::Trial),
            BreakerState::Open { .. } | BreakerState::Trial => (Admit::Refuse, self.state),
        }
    }

    /// The state after a call admitted as `admit` ended, at `now`.
    pub fn record(self, admit: Admit, ok: bool, now: Instant) -> BreakerState {
        let open = BreakerState::Open {
            until: now + self.open_for,
        };
        match (self.state, admit, ok) {
            (_, Admit::Trial, true) => BreakerState::Closed { failures: 0 },
            (_, Admit::Trial, false) => open,
            (BreakerState::Closed { .. }, Admit::Call, true) => {
                BreakerState::Closed { failures: 0 }
            }
            (BreakerState::Closed { failures }, Admit::Call, false) => {
                if failures + 1 >= self.threshold {
                    open
                } else {
                    BreakerState::Closed {
                        failures: failures + 1,
                    }
                }
            }
            // A call admitted before the breaker opened (or during a trial) ends: it changes
            // nothing the trial has not decided.
            (state, _, _) => state,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_refuses_the_call_that_would_exceed_it_and_charges_nothing() {
        let mut b = Budget::new(&Limits {
            document_tokens: 100,
            document_requests: 3,
            ..Limits::default()
        });
        b.charge(60).unwrap();
        assert_eq!(
            b.charge(41),
            Err(Exceeded::Tokens {
                max: 100,
                wanted: 41,
                spent: 60
            })
        );
        assert_eq!((b.tokens, b.requests), (60, 1));
        b.charge(40).unwrap();
        b.charge(0).unwrap();
        assert_eq!(b.charge(0), Err(Exceeded::Requests { max: 3 }));
        assert_eq!((b.tokens, b.requests), (100, 3));
    }

    #[test]
    fn tokens_are_a_third_of_the_utf8_bytes_rounded_up() {
        for (text, tokens) in [("", 0), ("a", 1), ("abc", 1), ("abcd", 2), ("ééééé", 4)] {
            assert_eq!(estimate_tokens(text), tokens, "{text:?}");
        }
    }

    #[test]
    fn breaker_table() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let b = |state| Breaker {
            state,
            threshold: 3,
            open_for: s(60),
        };
        let closed = |failures| BreakerState::Closed { failures };
        let open = |at: Duration| BreakerState::Open { until: t0 + at };
        // decide: (state, now) -> (admit, next)
        let decisions = [
            (closed(0), s(0), Admit::Call, closed(0)),
            (closed(2), s(0), Admit::Call, closed(2)),
            (open(s(60)), s(59), Admit::Refuse, open(s(60))),
            (open(s(60)), s(60), Admit::Trial, BreakerState::Trial),
            (
                BreakerState::Trial,
                s(61),
                Admit::Refuse,
                BreakerState::Trial,
            ),
        ];
        for (state, now, admit, next) in decisions {
            assert_eq!(
                b(state).decide(t0 + now),
                (admit, next),
                "{state:?} at {now:?}"
            );
        }
        // record: (state, admitted as, ok, now) -> next
        let records = [
            (closed(0), Admit::Call, true, s(0), closed(0)),
            (closed(1), Admit::Call, true, s(0), closed(0)),
            (closed(0), Admit::Call, false, s(0), closed(1)),
            (closed(1), Admit::Call, false, s(0), closed(2)),
            (closed(2), Admit::Call, false, s(5), open(s(65))),
            (BreakerState::Trial, Admit::Trial, true, s(70), closed(0)),
            (
                BreakerState::Trial,
                Admit::Trial,
                false,
                s(70),
                open(s(130)),
            ),
            (open(s(60)), Admit::Call, false, s(10), open(s(60))),
            (open(s(60)), Admit::Call, true, s(10), open(s(60))),
        ];
        for (state, admit, ok, now, next) in records {
            assert_eq!(
                b(state).record(admit, ok, t0 + now),
                next,
                "{state:?} {admit:?} ok={ok}"
            );
        }
    }

    #[tokio::test]
    async fn the_gate_holds_at_most_its_size_and_lets_waiters_in_first_come_first_served() {
        let gate = Gate::new(2);
        let a = gate.enter().await;
        let _b = gate.enter().await;
        assert_eq!(gate.in_flight(), 2);
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for i in 0..3 {
            let (gate, order) = (gate.clone(), order.clone());
            waiters.push(tokio::spawn(async move {
                let _p = gate.enter().await;
                order.lock().unwrap().push(i);
                tokio::task::yield_now().await;
            }));
            // Each waiter is queued before the next one asks.
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
        }
        assert!(
            order.lock().unwrap().is_empty(),
            "nobody entered a full gate"
        );
        drop(a);
        for w in waiters {
            w.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
        assert_eq!(gate.in_flight(), 1);
    }
}
