//! Which kinds this relay leads. Invariant: of all the relays of one database and queue prefix,
//! at most one session holds a kind's lead lock (a session advisory lock on
//! `(LEAD_NAMESPACE, hashtext(prefix/kind))`, on a connection of the relay's own), and a relay
//! starts rounds of a kind only while its last look found the kind led by its session, or while
//! it has no lead session at all. A relay that stops looking (paused, its link cut) loses the
//! session after [`IDLE`], ended by Postgres, and a standby takes the kind at its next look; a
//! relay that dies loses it at once.
//!
//! Why: relays side by side are safe (claims skip each other's rows and take turns on the
//! window's lock), but on shared cores the second relay spends CPU on rounds the first would
//! run anyway: with two worker processes on two cores, one relay made the pair at least as fast
//! as one process, where two relays made it slower. Leading is never needed for safety, so a
//! relay whose lead session fails relays every kind, as before, until a session answers again.

use std::collections::BTreeSet;
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use sqlx::{PgConnection, PgPool};

use crate::jobs::Kind;

/// The namespace of the lead locks (the liveness locks use 7038579, the claims' turns 7038584).
pub const LEAD_NAMESPACE: i32 = 7_038_586;

/// How often a relay looks: a standby tries the kinds nobody leads, a leader shows it is there.
pub const LOOK: Duration = Duration::from_millis(500);

/// How long a lead session may stay without a statement before Postgres ends it, and with it
/// its leads: a paused or cut-off leader holds a kind at most this long after its last look.
pub const IDLE: Duration = Duration::from_secs(5);

/// How long one look may take before the session is dropped.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// The kinds a relay leads: those its session holds, or every kind while it has no session
/// (`off`). Pure.
pub fn led(kinds: &[Kind], held: &BTreeSet<Kind>, off: bool) -> BTreeSet<Kind> {
    if off {
        kinds.iter().copied().collect()
    } else {
        kinds.iter().copied().filter(|k| held.contains(k)).collect()
    }
}

type Answer = (Result<BTreeSet<Kind>, sqlx::Error>, Option<PgConnection>);

/// One relay session's lead locks, on a connection of its own with one look in flight at a time.
pub struct Lead {
    pool: PgPool,
    prefix: String,
    kinds: Vec<Kind>,
    conn: Option<PgConnection>,
    held: BTreeSet<Kind>,
    /// No lead session answers: every kind is led.
    off: bool,
    /// Whether what this relay leads has been logged since it last changed.
    told: bool,
    in_flight: Option<BoxFuture<'static, Answer>>,
}

impl Lead {
    /// Leads nothing until its first look answers.
    pub fn new(pool: PgPool, prefix: &str, kinds: Vec<Kind>) -> Self {
        Self {
            pool,
            prefix: prefix.to_owned(),
            kinds,
            conn: None,
            held: BTreeSet::new(),
            off: false,
            told: false,
            in_flight: None,
        }
    }

    /// The kinds this relay leads now.
    pub fn led(&self) -> BTreeSet<Kind> {
        led(&self.kinds, &self.held, self.off)
    }

    /// Starts a look, unless one is in flight: tries every kind not held, and keeps the session
    /// busy enough that Postgres does not end it.
    pub fn look(&mut self) {
        if self.in_flight.is_some() {
            return;
        }
        let conn = self.conn.take();
        let pool = self.pool.clone();
        let keys: Vec<String> = self.kinds.iter().map(|k| key(&self.prefix, *k)).collect();
        let held: Vec<String> = self.held.iter().map(|k| key(&self.prefix, *k)).collect();
        let kinds = self.kinds.clone();
        self.in_flight = Some(
            async move {
                let work = async {
                    let mut conn = match conn {
                        Some(c) => c,
                        None => open(&pool).await?,
                    };
                    let got: Vec<(String, bool)> = sqlx::query_as(
                        "SELECT k, CASE WHEN k = ANY($2::text[]) THEN true \
                                   ELSE pg_try_advisory_lock($1, hashtext(k)) END \
                         FROM unnest($3::text[]) AS k",
                    )
                    .bind(LEAD_NAMESPACE)
                    .bind(&held)
                    .bind(&keys)
                    .fetch_all(&mut conn)
                    .await?;
                    let held: BTreeSet<Kind> = kinds
                        .iter()
                        .zip(&keys)
                        .filter(|(_, key)| got.iter().any(|(k, ok)| k == *key && *ok))
                        .map(|(kind, _)| *kind)
                        .collect();
                    Ok::<_, sqlx::Error>((held, conn))
                };
                match tokio::time::timeout(CALL_TIMEOUT, work).await {
                    Ok(Ok((held, conn))) => (Ok(held), Some(conn)),
                    Ok(Err(e)) => (Err(e), None),
                    Err(_) => (Err(sqlx::Error::PoolTimedOut), None),
                }
            }
            .boxed(),
        );
    }

    /// The kinds led once the look in flight answers. A failed look drops the session (and its
    /// locks with it): every kind is led until a later look opens a session again. Never
    /// returns while no look is in flight.
    pub async fn answer(&mut self) -> BTreeSet<Kind> {
        let Some(f) = self.in_flight.as_mut() else {
            return std::future::pending().await;
        };
        let (result, conn) = f.await;
        self.in_flight = None;
        let before = self.led();
        match result {
            Ok(held) => {
                self.conn = conn;
                self.held = held;
                self.off = false;
            }
            Err(e) => {
                if !self.off {
                    tracing::warn!(error = %e, "relay lost its lead session; relaying every kind until it has one again");
                }
                self.held.clear();
                self.off = true;
            }
        }
        let now = self.led();
        if now != before || !self.told {
            self.told = true;
            let names = |s: &BTreeSet<Kind>| s.iter().map(ToString::to_string).collect::<Vec<_>>();
            tracing::info!(leads = ?names(&now), stands_by = ?names(&self.kinds.iter().copied().filter(|k| !now.contains(k)).collect()), "relay leads");
        }
        now
    }
}

/// The lock key of `kind` for relays of queue prefix `prefix`: relays publishing to other
/// exchanges do not stand by for each other.
fn key(prefix: &str, kind: Kind) -> String {
    format!("{prefix}/{kind}")
}

/// Its own connection ([`crate::db::own_session`], `… relay lead`), which Postgres ends once it
/// has had no statement for [`IDLE`].
/// Servers before PostgreSQL 14 refuse the setting; a paused leader then keeps its kinds until
/// it resumes or its link is found dead.
async fn open(pool: &PgPool) -> Result<PgConnection, sqlx::Error> {
    let mut conn = crate::db::own_session(pool, "relay lead").await?;
    crate::db::end_when_idle(&mut conn, IDLE).await;
    Ok(conn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn led_table() {
        let kinds = [Kind::Compile, Kind::Research, Kind::Deletion];
        let set = |k: &[Kind]| k.iter().copied().collect::<BTreeSet<Kind>>();
        // (held, off, led)
        let cases: &[(&[Kind], bool, &[Kind])] = &[
            (&[], false, &[]),
            (&[Kind::Research], false, &[Kind::Research]),
            (
                &[Kind::Compile, Kind::Deletion],
                false,
                &[Kind::Compile, Kind::Deletion],
            ),
            (&[], true, &kinds),
            (&[Kind::Research], true, &kinds),
            // a held kind the relay does not relay is not led
            (&[Kind::Probe], false, &[]),
        ];
        for (held, off, want) in cases {
            assert_eq!(
                led(&kinds, &set(held), *off),
                set(want),
                "held {held:?}, off {off}"
            );
        }
    }

    #[test]
    fn keys_differ_by_prefix_and_kind() {
        assert_eq!(key("kfs", Kind::Compile), "kfs/compile");
        assert_ne!(key("kfs", Kind::Compile), key("other", Kind::Compile));
        assert_ne!(key("kfs", Kind::Compile), key("kfs", Kind::Research));
    }
}
