//! Worker liveness through session-level advisory locks. Invariant: while a worker process
//! runs, its Postgres session holds `(7038579, hashtext(holder))`, where the holder is its
//! worker id and a fresh incarnation (`<worker id>#<8 hex>`, what its leases record in
//! `worker_id`), and `(7038585, hashtext(worker id))`, which keeps two live processes from
//! sharing an id. The moment the process or its session dies, `kfs_worker_alive(holder)` turns
//! false and its jobs can be taken over without waiting for their leases to expire, also when a
//! process restarts under the same worker id: the restarted one is another incarnation. A session
//! that has had no statement for [`IDLE`] (its process paused, or cut off behind a link that
//! carries nothing and closes nothing) is ended by Postgres the same way, so such a lock neither
//! outlives the process's reach nor keeps a restart under its id waiting. A process whose
//! session was lost takes its locks back; once another live process holds its worker id (a
//! restart took it meanwhile), it has lost its identity for good: it stops taking work and exits
//! with one error naming the id, rather than running on as a holder `kfs_worker_alive` calls dead.
//! Fencing keeps all of that safe either way.

use std::time::Duration;

use sqlx::{Connection, PgConnection};
use tokio_util::sync::CancellationToken;

use crate::config::{AmqpNodes, SecretUrl};

pub const LOCK_NAMESPACE: i32 = 7_038_579;
/// The namespace of the lock that keeps a worker id to one live process.
pub const ID_NAMESPACE: i32 = 7_038_585;
/// How long Postgres keeps a held liveness session that has had no statement. The holding
/// loop runs one statement after another, so a healthy session is never idle for more than a
/// round trip.
pub const IDLE: Duration = Duration::from_secs(5);

/// The leases of earlier incarnations of `holder`'s worker id (see [`holder`]):
/// `worker_id` is the bare id (as versions without incarnations wrote it) or exactly the holder
/// format, the id, `#` and 8 hex digits of another incarnation. `$1` is the holder, `$2` its
/// worker id. Only that exact format matches: a worker id may itself contain `#`, and the
/// holders of `pod#7` (`pod#7#<8 hex>`) are not incarnations of `pod`.
///
/// The outbox kinds need no release of these at start: their holders are dead to
/// `kfs_worker_alive`, so the deliveries the broker hands back are claimed at once, and the
/// sweep publishes again only what no delivery brings back within its grace. Making their
/// outbox rows due at start published a second copy of each at the back of the queue and left
/// the redelivered one stale, behind the whole backlog.
pub const EARLIER_INCARNATIONS: &str = "(j.worker_id = $2 \
     OR (j.worker_id = $2 || '#' || right(j.worker_id, 8) AND right(j.worker_id, 8) ~ '^[0-9A-Fa-f]{8}$')) \
     AND j.worker_id <> $1";

/// A fresh holder name for a process running under `worker_id`: the id and an incarnation, so
/// that leases of a process that died are not taken for those of its restarted successor.
pub fn holder(worker_id: &str) -> String {
    let incarnation = uuid::Uuid::new_v4().simple().to_string();
    format!("{worker_id}#{}", &incarnation[..8])
}

/// The worker id of a holder name (the name itself when it has no incarnation).
pub fn id_of(holder: &str) -> &str {
    match holder.rsplit_once('#') {
        Some((id, inc)) if inc.len() == 8 && inc.bytes().all(|b| b.is_ascii_hexdigit()) => id,
        _ => holder,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LivenessError {
    #[error("worker id \"{0}\" is already in use by a live process; give each process its own KFS_WORKER_ID")]
    InUse(String),
    /// The lock of a holder name is held by another session: for a process taking its locks
    /// back, its own earlier session, which Postgres has not ended yet.
    #[error("the liveness lock of \"{0}\" is still held by another session")]
    HolderInUse(String),
    #[error("worker id \"{0}\" was taken by another live process while this one had lost its liveness session; stopping, as this process no longer counts as alive")]
    Lost(String),
    #[error("{0}")]
    Db(#[from] sqlx::Error),
}

/// Takes a process's locks on a dedicated connection: its holder's (see [`acquire`]) and its
/// worker id's, refused while another live process runs under the same id.
/// The session is given its idle end ([`IDLE`]) before it takes either lock, so no lock of a
/// process is ever held by a session that Postgres would keep while it sits idle.
pub async fn acquire_process(url: &SecretUrl, holder: &str) -> Result<PgConnection, LivenessError> {
    let mut conn = take(url, holder, Some(IDLE)).await?;
    let id = id_of(holder);
    let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, hashtext($2))")
        .bind(ID_NAMESPACE)
        .bind(id)
        .fetch_one(&mut conn)
        .await?;
    if got {
        Ok(conn)
    } else {
        let _ = conn.close().await;
        Err(LivenessError::InUse(id.to_owned()))
    }
}

/// Takes the lock of `worker_id` (a holder name) on a dedicated connection, which Postgres keeps
/// however long it sits idle (for a caller that holds the lock without running statements).
pub async fn acquire(url: &SecretUrl, worker_id: &str) -> Result<PgConnection, LivenessError> {
    take(url, worker_id, None).await
}

/// Takes the lock of `worker_id` on a dedicated connection; with `idle`, Postgres ends the
/// session once it has had no statement for that long, set before the lock is taken.
async fn take(
    url: &SecretUrl,
    worker_id: &str,
    idle: Option<Duration>,
) -> Result<PgConnection, LivenessError> {
    // Named for the worker id, as the process's other sessions are (`kfs-worker <id> …`).
    let name = session_name(id_of(worker_id), None);
    let options = crate::db::connect_options(url, &name)
        .map_err(|e| LivenessError::Db(sqlx::Error::Configuration(e.to_string().into())))?;
    let mut conn = PgConnection::connect_with(&options).await?;
    // The session always runs a statement (see `hold`); a server checks the client's socket
    // during a statement only with this setting (PostgreSQL 14 and later), so that a killed
    // worker's session, and with it its lock, ends within 25 ms instead of at the statement's
    // end. Older servers refuse the setting; the statement's own length then bounds it.
    let _ = sqlx::query("SET client_connection_check_interval = 25")
        .execute(&mut conn)
        .await;
    if let Some(after) = idle {
        crate::db::end_when_idle(&mut conn, after).await;
    }
    let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, hashtext($2))")
        .bind(LOCK_NAMESPACE)
        .bind(worker_id)
        .fetch_one(&mut conn)
        .await?;
    if got {
        Ok(conn)
    } else {
        Err(LivenessError::HolderInUse(worker_id.to_owned()))
    }
}

/// The `application_name` of a process's liveness session: its worker id and, once it has one,
/// the RabbitMQ node it is on (Postgres keeps the first 63 bytes).
pub fn session_name(worker_id: &str, node: Option<&str>) -> String {
    match node {
        Some(node) => format!("kfs-worker liveness {worker_id} on {node}"),
        None => format!("kfs-worker liveness {worker_id}"),
    }
}

/// A live process as its liveness session names it: worker id, and RabbitMQ node if any.
pub fn parse_session_name(name: &str) -> Option<(String, Option<String>)> {
    let rest = name.strip_prefix("kfs-worker liveness ")?;
    Some(match rest.rsplit_once(" on ") {
        Some((id, node)) => (id.to_owned(), Some(node.to_owned())),
        None => (rest.to_owned(), None),
    })
}

/// Every live process of this database with the RabbitMQ node it is on, by worker id.
pub async fn processes(
    conn: &mut PgConnection,
) -> Result<Vec<(String, Option<String>)>, sqlx::Error> {
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT a.application_name FROM pg_stat_activity a \
           JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'advisory' AND l.classid = $1::oid \
            AND l.objsubid = 2 AND l.granted \
          WHERE a.datname = current_database() AND a.application_name LIKE 'kfs-worker liveness %' \
          ORDER BY 1",
    )
    .bind(ID_NAMESPACE)
    .fetch_all(conn)
    .await?;
    Ok(names.iter().filter_map(|n| parse_session_name(n)).collect())
}

/// How many worker processes are alive in this database: the sessions holding a liveness
/// lock, matched as `kfs_worker_alive` matches one.
pub async fn count_live(pool: &sqlx::PgPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = $1::oid \
           AND objsubid = 2 AND granted \
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .bind(LOCK_NAMESPACE)
    .fetch_one(pool)
    .await
}

/// What one attempt to take a process's locks back found (see [`hold`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retake {
    /// Both locks are held again.
    Taken,
    /// The holder's lock is still held: the process's own earlier session, which Postgres has
    /// not ended yet (it ends once idle for [`IDLE`], or when the server sees the link die).
    OwnSessionLingers,
    /// The holder's lock was free, so the earlier session is gone, and the worker id's lock is
    /// held by another session: another live process runs under the id.
    IdTaken,
    /// No answer, or an error: Postgres cannot be reached for now.
    Failed,
}

/// What the holding loop does after a [`Retake`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Hold the locks again.
    Hold,
    /// Try again after a pause.
    Retry,
    /// The identity is lost: stop taking work and exit.
    GiveUp,
}

/// How many [`Retake::IdTaken`] in a row prove the id taken. A session's locks are released one
/// after the other as it ends, so a single sighting may fall between the holder's lock and the
/// id's; the second, a retry later, cannot.
pub const ID_TAKEN_CONFIRMATIONS: u32 = 2;

/// The holding loop's decision after a retake found `found`, `id_taken` counting the
/// [`Retake::IdTaken`] in a row so far (this one included).
pub fn next(found: Retake, id_taken: u32) -> Next {
    match found {
        Retake::Taken => Next::Hold,
        Retake::OwnSessionLingers | Retake::Failed => Next::Retry,
        Retake::IdTaken if id_taken >= ID_TAKEN_CONFIRMATIONS => Next::GiveUp,
        Retake::IdTaken => Next::Retry,
    }
}

/// How long one attempt to take the locks back may take: a connection opened over a link that
/// carries nothing would otherwise wait for ever.
const RETAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Holds the locks of [`acquire_process`] until shutdown (`worker_id` is the holder name);
/// re-takes them at once after the session is lost.
///
/// The session always has a statement running (`pg_sleep`, half a second at a time), so a
/// session ended from outside (`pg_terminate_backend`, a pooler or server restart) fails that
/// statement the moment it happens and the lock is taken again within milliseconds, not at the
/// next ping. While it is gone, `kfs_worker_alive` is false and another worker may take this
/// one's jobs over; the shorter that window, the fewer healthy slices it costs. A statement
/// that hangs (a half-open connection) is given up after its timeout, as a lost session. On the
/// server's side such a session would otherwise sit idle, its locks held, until the server
/// notices the dead link (TCP keepalive: hours by default); a held session is therefore ended by
/// Postgres after [`IDLE`] without a statement (`idle_session_timeout`, PostgreSQL 14 and later;
/// older servers refuse it, and keep the old behaviour), which [`acquire_process`] sets before it
/// takes a lock: a link cut off between the start-up's lock and this loop's first statement frees
/// the locks too.
///
/// Once the session is gone, another process may start under the same worker id and take it
/// (a restart of a process that looked dead). This process is then no longer alive to anyone:
/// every lease it took would be taken over within seconds, each costing an attempt. So when the
/// id is held by another live process ([`next`]), it cancels `shutdown` (the process stops
/// taking work) and returns [`LivenessError::Lost`], which ends the process with that error.
///
/// The session's `application_name` also says which RabbitMQ node the process is on
/// ([`session_name`]), which `kfs-worker status` shows for every live process.
pub async fn hold(
    url: SecretUrl,
    worker_id: String,
    mut conn: PgConnection,
    shutdown: CancellationToken,
    broker: Option<AmqpNodes>,
) -> Result<(), LivenessError> {
    const NAP: &str = "SELECT set_config('application_name', $1, false), pg_sleep(0.5)";
    loop {
        // Named anew at each round: the node may have changed since the last.
        let node = broker.as_ref().and_then(AmqpNodes::current);
        let name = session_name(id_of(&worker_id), node.as_deref());
        let alive = tokio::select! {
            () = shutdown.cancelled() => {
                let _ = tokio::time::timeout(Duration::from_secs(1), conn.close()).await;
                return Ok(());
            }
            r = tokio::time::timeout(Duration::from_secs(5), sqlx::query(NAP).bind(&name).execute(&mut conn)) => match r {
                Ok(Ok(_)) => true,
                // A cancelled statement (pg_cancel_backend) leaves the session and its lock.
                Ok(Err(sqlx::Error::Database(e))) if e.code().as_deref() == Some("57014") => true,
                _ => false,
            },
        };
        if alive {
            continue;
        }
        tracing::warn!(
            worker_id,
            "liveness session lost; taking the liveness lock again"
        );
        let mut retry = Duration::from_millis(50);
        let mut id_taken = 0;
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            let tried = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                r = tokio::time::timeout(RETAKE_TIMEOUT, acquire_process(&url, &worker_id)) => r,
            };
            let found = match &tried {
                Ok(Ok(_)) => Retake::Taken,
                Ok(Err(LivenessError::HolderInUse(_))) => Retake::OwnSessionLingers,
                Ok(Err(LivenessError::InUse(_))) => Retake::IdTaken,
                Ok(Err(_)) | Err(_) => Retake::Failed,
            };
            id_taken = if found == Retake::IdTaken {
                id_taken + 1
            } else {
                0
            };
            match (next(found, id_taken), tried) {
                (Next::Hold, Ok(Ok(c))) => {
                    conn = c;
                    tracing::info!(worker_id, "liveness lock taken again");
                    break;
                }
                (Next::GiveUp, _) => {
                    shutdown.cancel();
                    return Err(LivenessError::Lost(id_of(&worker_id).to_owned()));
                }
                (_, tried) => {
                    match tried {
                        Ok(Err(e)) => {
                            tracing::warn!(worker_id, error = %e, "cannot take the liveness lock yet")
                        }
                        _ => tracing::warn!(
                            worker_id,
                            "cannot take the liveness lock yet: no answer within {}s",
                            RETAKE_TIMEOUT.as_secs()
                        ),
                    }
                    tokio::select! {
                        () = shutdown.cancelled() => return Ok(()),
                        () = tokio::time::sleep(retry) => {}
                    }
                    retry = (retry * 2).min(Duration::from_secs(2));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_name_says_the_worker_id_and_its_node() {
        let cases: [(&str, Option<&str>); 3] = [
            ("w1", Some("127.0.0.1:5701")),
            ("w1", None),
            ("pod on node", Some("[::1]:5672")),
        ];
        for (id, node) in cases {
            let name = session_name(id, node);
            assert_eq!(
                parse_session_name(&name),
                Some((id.to_owned(), node.map(str::to_owned))),
                "{name}"
            );
        }
        assert_eq!(parse_session_name("kfs-worker relay"), None);
    }

    #[test]
    fn a_holder_names_its_worker_id_and_a_fresh_incarnation() {
        let (a, b) = (holder("w1"), holder("w1"));
        assert_ne!(a, b, "each process is its own incarnation");
        for h in [&a, &b] {
            assert_eq!(id_of(h), "w1");
            assert_eq!(h.len(), "w1#".len() + 8);
        }
        let cases = [
            ("w1", "w1"),
            ("w1#0123abcd", "w1"),
            ("pod#7#0123abcd", "pod#7"),
            ("pod#7", "pod#7"),
            ("w1#0123abcz", "w1#0123abcz"),
            ("w1#0123abc", "w1#0123abc"),
        ];
        for (name, id) in cases {
            assert_eq!(id_of(name), id, "{name}");
        }
    }

    #[test]
    fn a_process_gives_up_its_identity_only_once_another_live_process_holds_its_id() {
        use Next::*;
        use Retake::*;
        let cases = [
            (Taken, 0, Hold),
            (Failed, 0, Retry),
            // Its own earlier session still holds its locks: wait for Postgres to end it.
            (OwnSessionLingers, 0, Retry),
            // Seen once: possibly the moment between the two locks' release.
            (IdTaken, 1, Retry),
            (IdTaken, ID_TAKEN_CONFIRMATIONS, GiveUp),
            (IdTaken, ID_TAKEN_CONFIRMATIONS + 1, GiveUp),
        ];
        for (found, id_taken, want) in cases {
            assert_eq!(next(found, id_taken), want, "{found:?} x{id_taken}");
        }
    }
}
