//! Kinds polled from Postgres whose work is not a row of a job table (a findability evaluation
//! due for a published attempt, a repair queued inside an evaluation row). Invariant: such a kind
//! claims in its own way with the engine's discipline — a claim is exclusive, every write is
//! fenced by it, and a holder that died loses it at once; the poller's loop only calls
//! [`PolledKind::tick`].

use sqlx::PgPool;

/// A kind whose work is not a row of a job table — an evaluation due for a published attempt, a
/// repair queued inside an evaluation row — so it claims in its own way, with the same
/// discipline: a claim is exclusive, every write is fenced by it, and a holder that died loses
/// it at once. Its loop ticks while there is work and sleeps the poll interval otherwise.
#[async_trait::async_trait]
pub trait PolledKind: Send + Sync + 'static {
    fn name(&self) -> &'static str;
    /// Every state its rows can be in: the label values of its `kfs_jobs` gauge.
    fn states(&self) -> &'static [&'static str];
    /// `SELECT state, count(*)` over its rows, for status and metrics.
    fn counts_sql(&self) -> &'static str;
    /// One round for `holder` (this process's liveness holder): claims what is due and runs it
    /// to its end. Returns how much it ran.
    async fn tick(&self, pool: &PgPool, holder: &str) -> Result<usize, sqlx::Error>;
}
