//! Worker liveness through a session-level advisory lock. Invariant: while a worker process
//! runs, its Postgres session holds `(7038579, hashtext(worker_id))`; the moment the process
//! or its session dies, `kfs_worker_alive(worker_id)` turns false and its jobs can be taken
//! over without waiting for their leases to expire. Fencing keeps that safe either way.

use std::time::Duration;

use sqlx::{Connection, PgConnection};
use tokio_util::sync::CancellationToken;

use crate::config::SecretUrl;

pub const LOCK_NAMESPACE: i32 = 7_038_579;

#[derive(Debug, thiserror::Error)]
pub enum LivenessError {
    #[error("worker id \"{0}\" is already in use by a live process; give each process its own KFS_WORKER_ID")]
    InUse(String),
    #[error("{0}")]
    Db(#[from] sqlx::Error),
}

/// Takes the worker's lock on a dedicated connection.
pub async fn acquire(url: &SecretUrl, worker_id: &str) -> Result<PgConnection, LivenessError> {
    let options = crate::db::connect_options(url, &format!("kfs-worker liveness {worker_id}"))
        .map_err(|e| LivenessError::Db(sqlx::Error::Configuration(e.to_string().into())))?;
    let mut conn = PgConnection::connect_with(&options).await?;
    // The session always runs a statement (see `hold`); a server checks the client's socket
    // during a statement only with this setting (PostgreSQL 14 and later), so that a killed
    // worker's session, and with it its lock, ends within 25 ms instead of at the statement's
    // end. Older servers refuse the setting; the statement's own length then bounds it.
    let _ = sqlx::query("SET client_connection_check_interval = 25")
        .execute(&mut conn)
        .await;
    let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, hashtext($2))")
        .bind(LOCK_NAMESPACE)
        .bind(worker_id)
        .fetch_one(&mut conn)
        .await?;
    if got {
        Ok(conn)
    } else {
        Err(LivenessError::InUse(worker_id.to_owned()))
    }
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

/// Holds the lock until shutdown; re-takes it at once after the session is lost.
///
/// The session always has a statement running (`pg_sleep`, half a second at a time), so a
/// session ended from outside (`pg_terminate_backend`, a pooler or server restart) fails that
/// statement the moment it happens and the lock is taken again within milliseconds, not at the
/// next ping. While it is gone, `kfs_worker_alive` is false and another worker may take this
/// one's jobs over; the shorter that window, the fewer healthy slices it costs. A statement
/// that hangs (a half-open connection) is given up after its timeout, as a lost session.
pub async fn hold(
    url: SecretUrl,
    worker_id: String,
    mut conn: PgConnection,
    shutdown: CancellationToken,
) {
    const NAP: &str = "SELECT pg_sleep(0.5)";
    loop {
        let alive = tokio::select! {
            () = shutdown.cancelled() => {
                let _ = tokio::time::timeout(Duration::from_secs(1), conn.close()).await;
                return;
            }
            r = tokio::time::timeout(Duration::from_secs(5), sqlx::query(NAP).execute(&mut conn)) => match r {
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
        loop {
            if shutdown.is_cancelled() {
                return;
            }
            match acquire(&url, &worker_id).await {
                Ok(c) => {
                    conn = c;
                    tracing::info!(worker_id, "liveness lock taken again");
                    break;
                }
                Err(e) => {
                    tracing::warn!(worker_id, error = %e, "cannot take the liveness lock yet");
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(retry) => {}
                    }
                    retry = (retry * 2).min(Duration::from_secs(2));
                }
            }
        }
    }
}
