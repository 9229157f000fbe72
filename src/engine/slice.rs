//! How a slice goes on or ends, as a pure function of what the last step returned and what the
//! slice has used. Invariant: every unacked delivery ends within the slice budget, retryable
//! errors wait and fatal ones fail, and a job never waits once its attempts are used up.

use std::time::Duration;

use super::kind::{JobError, RetryPolicy, Step};
use super::lease::End;

/// How much one delivery may do before it is acked and the job goes back to the relay. Keeps
/// unacked time far below RabbitMQ's `consumer_timeout`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    pub max_steps: u32,
    pub max_time: Duration,
}

impl Default for Budget {
    fn default() -> Self {
        Self {
            max_steps: 64,
            max_time: Duration::from_secs(20),
        }
    }
}

/// What the engine does after a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// Commit the checkpoint and run the next step in this slice.
    Step(String),
    /// Commit the checkpoint (if any) and this end in the step's transaction.
    End {
        checkpoint: Option<String>,
        end: End,
    },
    /// Roll the step back, then write this end in a fresh transaction.
    Abort(End),
}

/// Where the slice stands after a step.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    pub steps_done: u32,
    pub elapsed: Duration,
    pub attempts: i32,
    pub max_attempts: i32,
}

pub fn after_step(
    result: Result<Step, JobError>,
    p: Progress,
    budget: Budget,
    retry: RetryPolicy,
    jitter: f64,
) -> Next {
    match result {
        Ok(Step::Advance(cp)) => {
            if p.steps_done >= budget.max_steps || p.elapsed >= budget.max_time {
                Next::End {
                    checkpoint: Some(cp),
                    end: End::Continue,
                }
            } else {
                Next::Step(cp)
            }
        }
        Ok(Step::Succeed(cp)) => Next::End {
            checkpoint: None,
            end: End::Succeed { checkpoint: cp },
        },
        Ok(Step::Wait { delay, reason }) => Next::End {
            checkpoint: None,
            end: End::Wait {
                delay,
                code: "waiting".into(),
                message: reason,
                refund: true,
            },
        },
        Ok(Step::Supersede { message }) => Next::End {
            checkpoint: None,
            end: End::Supersede { message },
        },
        Ok(Step::Cancel { code, message }) => Next::End {
            checkpoint: None,
            end: End::Cancel { code, message },
        },
        Err(JobError::Retryable { code, message }) => {
            if p.attempts >= p.max_attempts {
                Next::Abort(End::Fail {
                    code,
                    message: format!(
                        "{message} (no attempts left: {} of {})",
                        p.attempts, p.max_attempts
                    ),
                })
            } else {
                let attempt = u32::try_from(p.attempts.max(1)).unwrap_or(1);
                Next::Abort(End::Wait {
                    delay: retry.delay(attempt, jitter),
                    code,
                    message,
                    refund: false,
                })
            }
        }
        Err(JobError::Fatal { code, message }) => Next::Abort(End::Fail { code, message }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn decision_table() {
        let budget = Budget {
            max_steps: 3,
            max_time: s(10),
        };
        let retry = RetryPolicy {
            base: s(5),
            max: s(300),
        };
        let fresh = Progress {
            steps_done: 1,
            elapsed: s(1),
            attempts: 1,
            max_attempts: 5,
        };
        let table: Vec<(Result<Step, JobError>, Progress, Next)> = vec![
            (
                Ok(Step::Advance("parsed".into())),
                fresh,
                Next::Step("parsed".into()),
            ),
            (
                Ok(Step::Advance("parsed".into())),
                Progress {
                    steps_done: 3,
                    ..fresh
                },
                Next::End {
                    checkpoint: Some("parsed".into()),
                    end: End::Continue,
                },
            ),
            (
                Ok(Step::Advance("parsed".into())),
                Progress {
                    elapsed: s(10),
                    ..fresh
                },
                Next::End {
                    checkpoint: Some("parsed".into()),
                    end: End::Continue,
                },
            ),
            (
                Ok(Step::Succeed("published".into())),
                Progress {
                    steps_done: 99,
                    ..fresh
                },
                Next::End {
                    checkpoint: None,
                    end: End::Succeed {
                        checkpoint: "published".into(),
                    },
                },
            ),
            (
                Ok(Step::Wait {
                    delay: s(2),
                    reason: "leases draining".into(),
                }),
                fresh,
                Next::End {
                    checkpoint: None,
                    end: End::Wait {
                        delay: s(2),
                        code: "waiting".into(),
                        message: "leases draining".into(),
                        refund: true,
                    },
                },
            ),
            (
                Ok(Step::Cancel {
                    code: "budget".into(),
                    message: "over".into(),
                }),
                fresh,
                Next::End {
                    checkpoint: None,
                    end: End::Cancel {
                        code: "budget".into(),
                        message: "over".into(),
                    },
                },
            ),
            (
                Err(JobError::retryable("io", "reset")),
                Progress {
                    attempts: 2,
                    ..fresh
                },
                Next::Abort(End::Wait {
                    delay: s(10),
                    code: "io".into(),
                    message: "reset".into(),
                    refund: false,
                }),
            ),
            (
                Err(JobError::retryable("io", "reset")),
                Progress {
                    attempts: 5,
                    ..fresh
                },
                Next::Abort(End::Fail {
                    code: "io".into(),
                    message: "reset (no attempts left: 5 of 5)".into(),
                }),
            ),
            (
                Err(JobError::fatal("corrupt", "bad bytes")),
                fresh,
                Next::Abort(End::Fail {
                    code: "corrupt".into(),
                    message: "bad bytes".into(),
                }),
            ),
        ];
        for (i, (result, progress, want)) in table.into_iter().enumerate() {
            assert_eq!(
                after_step(result, progress, budget, retry, 0.0),
                want,
                "row {i}"
            );
        }
    }
}
