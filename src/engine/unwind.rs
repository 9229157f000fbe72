//! A step that panics. Invariant: a panic inside a kind's step is that step's failure, never
//! the intake's: it becomes the kind's retryable step error (code [`PANICKED`], the message
//! naming the panic), so the slice ends through the same path as any failing step, its attempt
//! counts, and the job fails like any other once its attempts are used up.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;

use super::kind::JobError;

/// The error code of a step that panicked.
pub const PANICKED: &str = "step_panicked";

/// What a panic said, when it said it with a string.
pub fn message(payload: &(dyn Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "a panic without a message"
    }
}

/// Runs a step, turning a panic inside it into the retryable step error [`PANICKED`].
pub async fn step<T>(f: impl Future<Output = Result<T, JobError>>) -> Result<T, JobError> {
    match AssertUnwindSafe(f).catch_unwind().await {
        Ok(r) => r,
        Err(payload) => Err(JobError::retryable(
            PANICKED,
            format!("the step panicked: {}", message(payload.as_ref())),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (case, what the step returns, what comes out as a value or (code, message)).
    type Case = (
        &'static str,
        Result<u8, JobError>,
        Result<u8, (&'static str, &'static str)>,
    );

    #[tokio::test]
    async fn a_panicking_step_is_a_retryable_error_naming_the_panic() {
        let cases: Vec<Case> = vec![
            ("a step that returns", Ok(7), Ok(7)),
            (
                "a step's own error",
                Err(JobError::fatal("x", "y")),
                Err(("x", "y")),
            ),
        ];
        for (name, given, want) in cases {
            let got = step(async move { given }).await;
            let got = got
                .as_ref()
                .map(|v| *v)
                .map_err(|e| (e.code(), e.message()));
            assert_eq!(got, want, "{name}");
        }
        async fn literal() -> Result<u8, JobError> {
            panic!("boom")
        }
        async fn formatted(n: u8) -> Result<u8, JobError> {
            panic!("formatted {n}")
        }
        let with_str = step(literal()).await;
        let with_string = step(formatted(1)).await;
        for (got, says) in [(with_str, "boom"), (with_string, "formatted 1")] {
            match got {
                Err(e @ JobError::Retryable { .. }) => {
                    assert_eq!(e.code(), PANICKED);
                    assert_eq!(e.message(), format!("the step panicked: {says}"));
                }
                other => panic!("a panic must be a retryable error: {other:?}"),
            }
        }
    }
}
