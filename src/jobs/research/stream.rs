//! The answer as it is made, as the platform's `research_task.answer_delta` events. Invariant:
//! the deltas of one execution attempt, in order, concatenate to exactly the text its generator
//! produced; each is keyed by the attempt and by its offset in that text (UTF-16 code units, as
//! the platform counts), carries exactly `{delta, executionAttempt, offset}` and is appended at
//! stage `generating`; the first is flushed as soon as there is text, the next ones once at
//! least [`BATCH_UNITS`] units are pending, the rest when the answer ends ([`Batcher`]). A
//! generator that calls a service streams them: each flush commits on a connection of its own
//! before the step does, and only while the task's lease (and grant) still holds
//! ([`progress::append_fenced`]); a flush that finds it gone stops the answer, and nothing more is
//! written. An in-process generator makes its answer at once, so its deltas are written with
//! the step's own writes. A retried attempt starts again at offset 0 under its own number.

use sqlx::PgPool;

use super::access::CAPABILITY_REVOKED;
use super::generator::AnswerSink;
use super::progress::{self, Fenced, JobScope, LeaseFence, NewEvent};
use super::walk::Stage;
use crate::jobs::JobError;

/// The platform's batch: after the first delta, pending text is flushed once it is this long.
pub const BATCH_UNITS: usize = 128;

/// A string's length as the platform measures it (JavaScript's `length`: UTF-16 code units).
pub fn utf16_len(s: &str) -> usize {
    s.encode_utf16().count()
}

/// One delta: `text` starts `offset` units into the attempt's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delta {
    pub offset: usize,
    pub text: String,
}

/// Cuts an answer arriving in pieces into the platform's deltas. Pure.
#[derive(Clone, Debug, Default)]
pub struct Batcher {
    /// Units flushed so far: the next delta's offset.
    offset: usize,
    pending: String,
    flushed: bool,
}

impl Batcher {
    /// Takes the next piece; returns a delta when one is due.
    pub fn push(&mut self, piece: &str) -> Option<Delta> {
        self.pending.push_str(piece);
        let due =
            !self.pending.is_empty() && (!self.flushed || utf16_len(&self.pending) >= BATCH_UNITS);
        due.then(|| self.take())
    }

    /// The answer ended: what is still pending.
    pub fn finish(&mut self) -> Option<Delta> {
        (!self.pending.is_empty()).then(|| self.take())
    }

    fn take(&mut self) -> Delta {
        let text = std::mem::take(&mut self.pending);
        let delta = Delta {
            offset: self.offset,
            text,
        };
        self.offset += utf16_len(&delta.text);
        self.flushed = true;
        delta
    }
}

/// Where a step's deltas go.
pub(super) enum Target {
    /// Kept, and written with the step's other writes.
    Step(Vec<NewEvent>),
    /// Committed as they come, each flush in a statement of its own on a connection of `pool`,
    /// fenced by `fence`. `claim`: the attempt's claim event, still to be written before them.
    Own {
        pool: PgPool,
        fence: LeaseFence,
        claim: Option<NewEvent>,
    },
}

/// The sink a step hands its generator.
pub(super) struct Stream {
    scope: JobScope,
    attempt: i32,
    batcher: Batcher,
    target: Target,
    /// Set once a flush failed: every later piece fails the same way and writes nothing.
    stopped: Option<JobError>,
}

impl Stream {
    pub(super) fn new(scope: JobScope, attempt: i32, target: Target) -> Self {
        Self {
            scope,
            attempt,
            batcher: Batcher::default(),
            target,
            stopped: None,
        }
    }

    /// The answer ended: flushes what is pending. Returns the deltas still to be written with
    /// the step's writes (none when they were streamed).
    pub(super) async fn finish(mut self) -> Result<Vec<NewEvent>, JobError> {
        if let Some(e) = self.stopped.take() {
            return Err(e);
        }
        if let Some(d) = self.batcher.finish() {
            self.flush(d).await?;
        }
        Ok(match self.target {
            Target::Step(events) => events,
            Target::Own { .. } => Vec::new(),
        })
    }

    async fn flush(&mut self, d: Delta) -> Result<(), JobError> {
        let event = NewEvent::answer_delta(
            &self.scope,
            Stage::Generating,
            self.attempt,
            d.offset,
            &d.text,
        );
        match &mut self.target {
            Target::Step(events) => {
                events.push(event);
                Ok(())
            }
            Target::Own { pool, fence, claim } => {
                let mut events: Vec<NewEvent> = claim.iter().cloned().collect();
                events.push(event);
                let mut conn = crate::db::acquire(pool).await?;
                match progress::append_fenced(&mut conn, fence, &events).await? {
                    Fenced::Written => {
                        *claim = None;
                        Ok(())
                    }
                    Fenced::LeaseLost => Err(JobError::retryable(
                        "lease_lost",
                        "the task's lease was lost while its answer was streaming; the answer stopped",
                    )),
                    Fenced::Revoked => Err(JobError::fatal(
                        CAPABILITY_REVOKED,
                        "the capability grant was revoked or its space fenced while the answer was streaming",
                    )),
                }
            }
        }
    }
}

fn copy(e: &JobError) -> JobError {
    match e {
        JobError::Retryable { code, message } => JobError::retryable(code, message),
        JobError::Fatal { code, message } => JobError::fatal(code, message),
    }
}

#[async_trait::async_trait]
impl AnswerSink for Stream {
    async fn text(&mut self, piece: &str) -> Result<(), JobError> {
        if let Some(e) = &self.stopped {
            return Err(copy(e));
        }
        let Some(d) = self.batcher.push(piece) else {
            return Ok(());
        };
        self.flush(d)
            .await
            .inspect_err(|e| self.stopped = Some(copy(e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The deltas `pieces` make, flushed as they come and at the end.
    fn deltas(pieces: &[&str]) -> Vec<(usize, String)> {
        let mut b = Batcher::default();
        let mut out: Vec<Delta> = pieces.iter().filter_map(|p| b.push(p)).collect();
        out.extend(b.finish());
        out.into_iter().map(|d| (d.offset, d.text)).collect()
    }

    #[test]
    fn the_first_delta_goes_at_once_then_batches_of_128_units_then_the_rest() {
        let long = "x".repeat(127);
        type Case<'a> = (Vec<&'a str>, Vec<(usize, String)>);
        let table: Vec<Case> = vec![
            (vec![], vec![]),
            (vec!["", ""], vec![]),
            // The platform's own example.
            (
                vec!["T", "h", "e", " warranty", " is two years."],
                vec![(0, "T".into()), (1, "he warranty is two years.".into())],
            ),
            // One piece (an extractive answer): one delta at 0.
            (vec!["All of it."], vec![(0, "All of it.".into())]),
            // 127 pending units wait; the 128th flushes.
            (
                vec!["A", &long, "y", "z"],
                vec![(0, "A".into()), (1, format!("{long}y")), (129, "z".into())],
            ),
            // Offsets count UTF-16 units: an astral character counts two, an accented one one.
            (
                vec!["🔒", "é", "b"],
                vec![(0, "🔒".into()), (2, "éb".into())],
            ),
        ];
        for (pieces, want) in table {
            assert_eq!(deltas(&pieces), want, "{pieces:?}");
        }
        // A batch is due by units, not bytes or chars: 64 astral characters are 128 units.
        let astral = "😀".repeat(64);
        assert_eq!(
            deltas(&["a", &astral, "b"]),
            vec![(0, "a".into()), (1, astral.clone()), (129, "b".into())]
        );
    }

    #[test]
    fn deltas_reassemble_the_answer_at_their_offsets() {
        let pieces: Vec<String> = (0..300).map(|i| format!("w{i}é ")).collect();
        let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
        let got = deltas(&refs);
        let mut units = 0;
        let mut text = String::new();
        for (offset, d) in &got {
            assert_eq!(*offset, units);
            units += utf16_len(d);
            text.push_str(d);
        }
        assert_eq!(text, pieces.concat());
        // Every delta but the first and the last is a full batch.
        for (_, d) in &got[1..got.len() - 1] {
            assert!(utf16_len(d) >= BATCH_UNITS, "{d:?}");
        }
    }
}
