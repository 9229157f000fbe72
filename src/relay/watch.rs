//! Which kinds this relay watches. Invariant: while a relay holds a kind's watch (migration
//! 0102), writers of that kind's outbox do not notify, so the relay keeps looking for due rows
//! itself: it lets go only after a round found less than a batch and no round of the kind is
//! in flight, only through `kfs_outbox_unwatch` (which refuses while a writer that may have
//! skipped its notification has not ended), and after letting go it looks once more. When a
//! writer is still in flight it looks again after a short, growing pause. A kind is watched
//! only in a burst: when one round claimed [`BURST`] rows or more, so rows were committed
//! faster than rounds ran; a lone job pays no watch calls.
//!
//! Why: a transaction that notifies holds a database-wide lock through its commit's flush, so
//! notifying commits run one at a time. With a watcher, a burst of requests costs one
//! notification, not one each.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::time::Instant;

use crate::jobs::Kind;

/// The first pause before looking again while writers are in flight; it doubles with every
/// refusal up to [`LOOK_AGAIN_MAX`] and starts over when a round claims something.
pub const LOOK_AGAIN_MIN: Duration = Duration::from_millis(1);
pub const LOOK_AGAIN_MAX: Duration = Duration::from_millis(8);

/// The rows one round must claim for its kind to be watched: more than one means they were
/// committed faster than rounds ran. Rounds of lone jobs claim one each and cost no watch call.
pub const BURST: usize = 2;

/// A call to make on the watch session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    Watch(Kind),
    Unwatch(Kind),
}

/// The watches of one relay session, as a pure state machine.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Watches {
    /// Kinds held, with the number of refused unwatches since the last claim.
    held: BTreeMap<Kind, u32>,
    /// Calls decided but not answered yet (one at a time per kind).
    asked: BTreeSet<Kind>,
    /// Held kinds waiting to look again, and when.
    again: BTreeMap<Kind, Instant>,
}

impl Watches {
    /// The answer to [`Call::Watch`]. Returns whether to look now: once the watch is held,
    /// writers stop notifying, and what they commit from then on may be newer than the last
    /// round; a look also lets a quiet kind let go again.
    pub fn watched(&mut self, kind: Kind, got: bool) -> bool {
        self.asked.remove(&kind);
        if got {
            self.held.insert(kind, 0);
        }
        got
    }

    /// A round of `kind` claimed `claimed` rows. Held: rows that keep coming start the pause
    /// over. Not held: a burst (at least [`BURST`] rows in one round) asks for the watch.
    pub fn claimed(&mut self, kind: Kind, claimed: usize) -> Option<Call> {
        match self.held.get_mut(&kind) {
            Some(misses) => {
                if claimed > 0 {
                    *misses = 0;
                }
                None
            }
            None if claimed >= BURST && self.asked.insert(kind) => Some(Call::Watch(kind)),
            None => None,
        }
    }

    /// `kind` has no round in flight and none wanted: let go, if it is held and not already
    /// letting go or waiting to look again.
    pub fn quiet(&mut self, kind: Kind) -> Option<Call> {
        if self.held.contains_key(&kind)
            && !self.again.contains_key(&kind)
            && self.asked.insert(kind)
        {
            return Some(Call::Unwatch(kind));
        }
        None
    }

    /// The answer to [`Call::Unwatch`]. Returns whether to look once more now (let go).
    /// Refused: the kind stays held and looks again after a pause.
    pub fn unwatched(&mut self, kind: Kind, let_go: bool, now: Instant) -> bool {
        self.asked.remove(&kind);
        if let_go {
            self.held.remove(&kind);
            return true;
        }
        let misses = self.held.entry(kind).or_insert(0);
        let pause = LOOK_AGAIN_MIN
            .saturating_mul(1 << (*misses).min(8))
            .min(LOOK_AGAIN_MAX);
        *misses = misses.saturating_add(1);
        self.again.insert(kind, now + pause);
        false
    }

    /// When the next held kind looks again.
    pub fn next_look(&self) -> Option<Instant> {
        self.again.values().min().copied()
    }

    /// The kinds whose pause is over at `now`: they look again.
    pub fn due(&mut self, now: Instant) -> Vec<Kind> {
        let due: Vec<Kind> = self
            .again
            .iter()
            .filter(|(_, &at)| at <= now)
            .map(|(&k, _)| k)
            .collect();
        for k in &due {
            self.again.remove(k);
        }
        due
    }

    /// The watch session is gone, and with it every watch: the kinds that were held look once
    /// more.
    pub fn lost(&mut self) -> Vec<Kind> {
        self.asked.clear();
        self.again.clear();
        std::mem::take(&mut self.held).into_keys().collect()
    }

    pub fn held(&self) -> Vec<Kind> {
        self.held.keys().copied().collect()
    }
}

/// How long one call on the watch session may take before the session is dropped.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

type Answer = (Call, Result<bool, sqlx::Error>, Option<PgConnection>);

/// The relay's own Postgres session for watches, with one call in flight at a time. Its
/// advisory locks end with the session: whatever fails, the connection is dropped and every
/// watch with it.
pub struct Watcher {
    pool: PgPool,
    conn: Option<PgConnection>,
    queue: VecDeque<Call>,
    in_flight: Option<BoxFuture<'static, Answer>>,
    /// Off after a failure, for the rest of the relay session: writers notify as before.
    off: bool,
}

impl Watcher {
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            conn: None,
            queue: VecDeque::new(),
            in_flight: None,
            off: false,
        }
    }

    /// Queues calls. Ask nothing of a watcher that is off: it would never answer.
    pub fn ask(&mut self, calls: impl IntoIterator<Item = Call>) {
        if self.off {
            return;
        }
        self.queue.extend(calls);
        self.send();
    }

    /// After a failure the watcher is off for the rest of the relay session, and writers
    /// notify as they did without one.
    pub fn is_off(&self) -> bool {
        self.off
    }

    fn send(&mut self) {
        if self.in_flight.is_some() {
            return;
        }
        let Some(call) = self.queue.pop_front() else {
            return;
        };
        let conn = self.conn.take();
        let pool = self.pool.clone();
        self.in_flight = Some(
            async move {
                let work = async {
                    let mut conn = match conn {
                        Some(c) => c,
                        // Its own connection, never returned to the pool: a session lock
                        // must not outlive the relay in someone else's hands.
                        None => crate::db::own_session(&pool, "relay watch").await?,
                    };
                    let got = make(&mut conn, call).await?;
                    Ok::<_, sqlx::Error>((got, conn))
                };
                match tokio::time::timeout(CALL_TIMEOUT, work).await {
                    Ok(Ok((got, conn))) => (call, Ok(got), Some(conn)),
                    Ok(Err(e)) => (call, Err(e), None),
                    Err(_) => (call, Err(sqlx::Error::PoolTimedOut), None),
                }
            }
            .boxed(),
        );
    }

    /// The next answer. `Err`: the session failed; every watch is gone and the watcher is off.
    /// Never returns while nothing is in flight.
    pub async fn answer(&mut self) -> Result<(Call, bool), sqlx::Error> {
        let Some(f) = self.in_flight.as_mut() else {
            return std::future::pending().await;
        };
        let (call, result, conn) = f.await;
        self.in_flight = None;
        match result {
            Ok(got) => {
                self.conn = conn;
                self.send();
                Ok((call, got))
            }
            Err(e) => {
                self.off = true;
                self.queue.clear();
                Err(e)
            }
        }
    }

    /// Ends the session's watches: each held kind lets go as soon as its writers have ended
    /// (within `within`), then notifies, so that another relay looks for what those writers
    /// committed. Dropping the session after `within` lets go of the rest.
    pub async fn close(mut self, held: Vec<Kind>, within: Duration) {
        let mut held = held;
        let mut let_go = Vec::new();
        if let Some(f) = self.in_flight.take() {
            let (call, got, conn) = f.await;
            match (call, got) {
                (Call::Watch(k), Ok(true)) => held.push(k),
                (Call::Unwatch(k), Ok(true)) => {
                    held.retain(|&h| h != k);
                    let_go.push(k);
                }
                _ => {}
            }
            self.conn = conn;
        }
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let _ = tokio::time::timeout(within, async {
            for &k in &held {
                loop {
                    let unwatched = make(&mut conn, Call::Unwatch(k)).await;
                    match unwatched {
                        Ok(true) => break,
                        Ok(false) => tokio::time::sleep(LOOK_AGAIN_MIN).await,
                        Err(_) => return,
                    }
                }
                let_go.push(k);
            }
            for k in &let_go {
                let _ = sqlx::query("SELECT pg_notify('kfs_outbox', $1)")
                    .bind(k.event_type())
                    .execute(&mut conn)
                    .await;
            }
        })
        .await;
        let _ = tokio::time::timeout(Duration::from_secs(1), conn.close()).await;
    }
}

/// Makes one call on the watch session: the answer of `kfs_outbox_watch` or
/// `kfs_outbox_unwatch` for the kind's outbox table.
async fn make(conn: &mut PgConnection, call: Call) -> Result<bool, sqlx::Error> {
    let (sql, kind) = match call {
        Call::Watch(k) => ("SELECT kfs_outbox_watch($1)", k),
        Call::Unwatch(k) => ("SELECT kfs_outbox_unwatch($1)", k),
    };
    sqlx::query_scalar(sql)
        .bind(kind.spec().outbox_table)
        .fetch_one(conn)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug)]
    enum Ev {
        Watched(Kind, bool),
        Claimed(Kind, usize),
        Quiet(Kind),
        Unwatched(Kind, bool),
        Lost,
    }

    /// Applies `events` at one instant; returns every call decided, the kinds to look at
    /// now, and the pause before the next look.
    fn run(events: &[Ev]) -> (Vec<Call>, Vec<Kind>, Option<Duration>) {
        let now = Instant::now();
        let mut w = Watches::default();
        let (mut calls, mut look) = (Vec::new(), Vec::new());
        for e in events {
            match *e {
                Ev::Watched(k, got) => {
                    if w.watched(k, got) {
                        look.push(k);
                    }
                }
                Ev::Claimed(k, n) => calls.extend(w.claimed(k, n)),
                Ev::Quiet(k) => calls.extend(w.quiet(k)),
                Ev::Unwatched(k, let_go) => {
                    if w.unwatched(k, let_go, now) {
                        look.push(k);
                    }
                }
                Ev::Lost => look.extend(w.lost()),
            }
        }
        (calls, look, w.next_look().map(|at| at - now))
    }

    #[test]
    #[allow(non_upper_case_globals)]
    fn watches_table() {
        use Call::{Unwatch, Watch};
        use Ev::*;
        const C: Kind = Kind::Compile;
        const R: Kind = Kind::Research;
        let ms = Duration::from_millis;
        // (name, events, calls decided, looks now, pause before the next look)
        type Case<'a> = (&'a str, &'a [Ev], &'a [Call], &'a [Kind], Option<Duration>);
        let cases: &[Case] = &[
            (
                "a round of one row (a lone job) asks nothing",
                &[Claimed(C, 1), Claimed(C, 0), Claimed(C, 1)],
                &[],
                &[],
                None,
            ),
            (
                "a round that claimed a burst asks for the watch",
                &[Claimed(C, 2)],
                &[Watch(C)],
                &[],
                None,
            ),
            (
                "a second burst before the answer asks nothing more",
                &[Claimed(C, 2), Claimed(C, 7)],
                &[Watch(C)],
                &[],
                None,
            ),
            (
                "a held kind is not asked for again",
                &[Claimed(C, 2), Watched(C, true), Claimed(C, 2)],
                &[Watch(C)],
                &[C],
                None,
            ),
            (
                "refused (another relay watches): asked again at the next burst",
                &[Claimed(C, 2), Watched(C, false), Claimed(C, 2)],
                &[Watch(C), Watch(C)],
                &[],
                None,
            ),
            (
                "an unwatched kind going quiet has nothing to let go",
                &[Quiet(C)],
                &[],
                &[],
                None,
            ),
            (
                "a held kind going quiet lets go",
                &[Claimed(C, 2), Watched(C, true), Quiet(C)],
                &[Watch(C), Unwatch(C)],
                &[C],
                None,
            ),
            (
                "let go: look once more at once",
                &[
                    Claimed(C, 2),
                    Watched(C, true),
                    Quiet(C),
                    Unwatched(C, true),
                ],
                &[Watch(C), Unwatch(C)],
                &[C, C],
                None,
            ),
            (
                "after letting go a burst asks for the watch again",
                &[
                    Claimed(C, 2),
                    Watched(C, true),
                    Quiet(C),
                    Unwatched(C, true),
                    Claimed(C, 2),
                ],
                &[Watch(C), Unwatch(C), Watch(C)],
                &[C, C],
                None,
            ),
            (
                "refused (a writer in flight): still held, look again after the first pause",
                &[
                    Claimed(C, 2),
                    Watched(C, true),
                    Quiet(C),
                    Unwatched(C, false),
                ],
                &[Watch(C), Unwatch(C)],
                &[C],
                Some(ms(1)),
            ),
            (
                "quiet again while waiting to look: no second unwatch",
                &[
                    Claimed(C, 2),
                    Watched(C, true),
                    Quiet(C),
                    Unwatched(C, false),
                    Quiet(C),
                ],
                &[Watch(C), Unwatch(C)],
                &[C],
                Some(ms(1)),
            ),
            (
                "the pause doubles with each refusal",
                &[
                    Claimed(C, 2),
                    Watched(C, true),
                    Unwatched(C, false),
                    Unwatched(C, false),
                    Unwatched(C, false),
                ],
                &[Watch(C)],
                &[C],
                Some(ms(4)),
            ),
            (
                "the pause stops growing at its bound",
                &[
                    Claimed(C, 2),
                    Watched(C, true),
                    Unwatched(C, false),
                    Unwatched(C, false),
                    Unwatched(C, false),
                    Unwatched(C, false),
                    Unwatched(C, false),
                    Unwatched(C, false),
                ],
                &[Watch(C)],
                &[C],
                Some(ms(8)),
            ),
            (
                "a round that claimed rows starts the pause over",
                &[
                    Claimed(C, 2),
                    Watched(C, true),
                    Unwatched(C, false),
                    Unwatched(C, false),
                    Claimed(C, 3),
                    Unwatched(C, false),
                ],
                &[Watch(C)],
                &[C],
                Some(ms(1)),
            ),
            (
                "an empty round does not",
                &[
                    Claimed(C, 2),
                    Watched(C, true),
                    Unwatched(C, false),
                    Claimed(C, 0),
                    Unwatched(C, false),
                ],
                &[Watch(C)],
                &[C],
                Some(ms(2)),
            ),
            (
                "kinds are watched each on its own",
                &[
                    Claimed(C, 2),
                    Claimed(R, 5),
                    Watched(C, true),
                    Quiet(R),
                    Quiet(C),
                ],
                &[Watch(C), Watch(R), Unwatch(C)],
                &[C],
                None,
            ),
            (
                "the session lost: every held kind looks once more",
                &[
                    Claimed(C, 2),
                    Claimed(R, 5),
                    Watched(C, true),
                    Watched(R, true),
                    Unwatched(R, false),
                    Lost,
                ],
                &[Watch(C), Watch(R)],
                &[C, R, C, R],
                None,
            ),
        ];
        for (name, events, calls, look, pause) in cases {
            let (c, l, p) = run(events);
            assert_eq!(&c, calls, "{name}: calls");
            assert_eq!(&l, look, "{name}: looks");
            assert_eq!(&p, pause, "{name}: pause");
        }
    }

    #[test]
    fn due_returns_each_kind_once_its_pause_is_over() {
        let now = Instant::now();
        let mut w = Watches::default();
        w.claimed(Kind::Compile, BURST);
        w.watched(Kind::Compile, true);
        w.unwatched(Kind::Compile, false, now);
        assert!(w.due(now).is_empty(), "the pause is not over");
        assert_eq!(w.due(now + LOOK_AGAIN_MIN), vec![Kind::Compile]);
        assert!(w.due(now + LOOK_AGAIN_MAX).is_empty(), "once");
        assert_eq!(
            w.quiet(Kind::Compile),
            Some(Call::Unwatch(Kind::Compile)),
            "after its look it may let go again"
        );
    }
}
