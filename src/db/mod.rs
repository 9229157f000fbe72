//! Postgres: pools, migrations, bounded lock waits, bounded calls ([`within`]) and the
//! translation of driver errors into plain words. Invariant: Postgres is the source of truth;
//! nothing here ever prints a connection string.

use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool, Postgres, Transaction};

use crate::config::SecretUrl;

pub mod indexes;
pub mod migrate;
pub mod statistics;

pub use migrate::{migrate, MigrateError, MIGRATOR};

/// Why Postgres could not be used, in words an operator can act on.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("cannot reach Postgres at {endpoint}: {reason}")]
    Unreachable { endpoint: String, reason: String },
    #[error("Postgres at {endpoint} refused the credentials of user \"{user}\": {reason}")]
    Refused {
        endpoint: String,
        user: String,
        reason: String,
    },
    #[error("Postgres at {endpoint} has no database \"{database}\"")]
    NoDatabase { endpoint: String, database: String },
    #[error("Postgres at {endpoint} is not accepting connections: {reason}")]
    NotAccepting { endpoint: String, reason: String },
    #[error("TLS to Postgres at {endpoint} failed: {reason}")]
    Tls { endpoint: String, reason: String },
    #[error("Postgres at {endpoint} failed: {reason}")]
    Other { endpoint: String, reason: String },
}

impl ConnectError {
    /// True when the same connection may succeed later without anyone changing the settings:
    /// the server is down, starting, shutting down or full. Refused credentials, a missing
    /// database and an unusable URL are not.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            ConnectError::Unreachable { .. } | ConnectError::NotAccepting { .. }
        )
    }
}

/// A connection taken out of `pool` for good, for a session lock that must not outlive its
/// holder in someone else's hands, named `<the pool's name> <role>` in `pg_stat_activity`, so
/// that an operator sees what holds it and the pool's own sessions are counted apart.
pub async fn own_session(pool: &PgPool, role: &str) -> Result<sqlx::PgConnection, sqlx::Error> {
    let mut conn = pool.acquire().await?.detach();
    sqlx::query(
        "SELECT set_config('application_name', current_setting('application_name') || ' ' || $1, false)",
    )
    .bind(role)
    .execute(&mut conn)
    .await?;
    Ok(conn)
}

/// Lets Postgres end `conn`'s session once it has had no statement for `after`
/// (`idle_session_timeout`), and with it every session lock it holds: the way a paused or
/// cut-off holder lets go. Best effort: servers before PostgreSQL 14 refuse the setting, and a
/// session that does not answer is lost anyway.
pub async fn end_when_idle(conn: &mut sqlx::PgConnection, after: Duration) {
    let set = format!("SET idle_session_timeout = {}", after.as_millis());
    let _ = tokio::time::timeout(Duration::from_secs(5), sqlx::query(&set).execute(conn)).await;
}

/// Waits at most `limit` for a call on Postgres. A call still unanswered by then (a link that
/// went silent without closing: a half-open connection, a stalled proxy) becomes an I/O error
/// that [`is_retryable`] counts as connection trouble, so the caller drops the connection and
/// goes on as it does when Postgres is away, instead of waiting on it for good.
pub async fn within<T>(
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    match tokio::time::timeout(limit, call).await {
        Ok(result) => result,
        Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("Postgres did not answer within {} ms", limit.as_millis()),
        ))),
    }
}

/// Prepared statements a session keeps (see [`connect_options`]).
pub const STATEMENT_CACHE: usize = 512;

pub fn connect_options(
    url: &SecretUrl,
    application_name: &str,
) -> Result<PgConnectOptions, ConnectError> {
    let options: PgConnectOptions =
        url.expose()
            .parse()
            .map_err(|e: sqlx::Error| ConnectError::Other {
                endpoint: url.endpoint(5432),
                reason: format!("invalid connection options ({})", describe_config_error(&e)),
            })?;
    tls_files(url)?;
    Ok(options
        .application_name(application_name)
        // Each session keeps every statement the worker runs prepared. The kinds run about 250
        // distinct statements (deletion alone over 150); with sqlx's default of 100, sessions
        // shared by the kinds evicted and prepared again about a third of their executions
        // (a parse round trip each, and planning anew instead of Postgres' cached plan).
        .statement_cache_capacity(STATEMENT_CACHE)
        .log_statements(tracing::log::LevelFilter::Trace)
        .log_slow_statements(tracing::log::LevelFilter::Warn, Duration::from_secs(2)))
}

/// The libpq TLS settings that name files, from the URL's query or else the environment.
const TLS_FILES: [(&str, &str); 3] = [
    ("sslrootcert", "PGSSLROOTCERT"),
    ("sslcert", "PGSSLCERT"),
    ("sslkey", "PGSSLKEY"),
];

/// Checks that every TLS file the settings name can be read, so that a wrong path is one
/// clear error at start and not an I/O error at each connection (which would read as Postgres
/// being unreachable).
fn tls_files(url: &SecretUrl) -> Result<(), ConnectError> {
    for (param, var) in TLS_FILES {
        let from_url = url
            .url()
            .query_pairs()
            .find(|(k, _)| k == param)
            .map(|(_, v)| (v.into_owned(), param));
        let Some((path, setting)) = from_url.or_else(|| std::env::var(var).ok().map(|v| (v, var)))
        else {
            continue;
        };
        if let Err(e) = std::fs::File::open(&path) {
            return Err(ConnectError::Tls {
                endpoint: url.endpoint(5432),
                reason: format!("cannot read the file {setting} names ({path}): {e}"),
            });
        }
    }
    Ok(())
}

/// What a connection uses: `TLS 1.3 (TLS_AES_256_GCM_SHA384)` or `no TLS`.
pub async fn tls_in_use(conn: &mut sqlx::PgConnection) -> String {
    let row: Option<(bool, Option<String>, Option<String>)> =
        sqlx::query_as("SELECT ssl, version, cipher FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_optional(conn)
            .await
            .ok()
            .flatten();
    match row {
        Some((true, version, cipher)) => format!(
            "{} ({})",
            version.unwrap_or_else(|| "TLS".into()),
            cipher.unwrap_or_default()
        ),
        _ => "no TLS".into(),
    }
}

/// Never the raw error text: sqlx configuration errors may quote the URL.
fn describe_config_error(e: &sqlx::Error) -> &'static str {
    match e {
        sqlx::Error::Configuration(_) => "a parameter in the URL is not understood",
        _ => "the URL could not be used",
    }
}

/// Opens a pool and checks it with one round trip, so that failures surface at start.
pub async fn connect(
    url: &SecretUrl,
    application_name: &str,
    max_connections: u32,
    timeout: Duration,
) -> Result<PgPool, ConnectError> {
    connect_with(url, application_name, max_connections, timeout, None).await
}

/// [`connect`] for workers: sessions idle inside a transaction for longer than
/// `idle_in_transaction` are ended by Postgres. A worker frozen mid-step (SIGSTOP, a stall)
/// thus releases its row locks, and the job can be taken over once its lease has run out.
pub async fn connect_with(
    url: &SecretUrl,
    application_name: &str,
    max_connections: u32,
    timeout: Duration,
    idle_in_transaction: Option<Duration>,
) -> Result<PgPool, ConnectError> {
    let options = session_options(url, application_name, idle_in_transaction)?;
    probe(url, &options, timeout).await?;
    Ok(lazy_pool(options, max_connections, timeout))
}

/// The options of a worker's sessions; see [`connect_with`]. Fails only on a URL that cannot
/// be used, never on the server.
pub fn session_options(
    url: &SecretUrl,
    application_name: &str,
    idle_in_transaction: Option<Duration>,
) -> Result<PgConnectOptions, ConnectError> {
    let mut options = connect_options(url, application_name)?;
    if let Some(idle) = idle_in_transaction {
        let ms = idle.as_millis().max(1000).to_string();
        options = options.options([("idle_in_transaction_session_timeout", ms.as_str())]);
    }
    Ok(options)
}

/// Opens and closes one direct connection: a pool would turn every failure into a timeout.
pub async fn probe(
    url: &SecretUrl,
    options: &PgConnectOptions,
    timeout: Duration,
) -> Result<(), ConnectError> {
    let probe = tokio::time::timeout(
        timeout,
        <sqlx::PgConnection as sqlx::Connection>::connect_with(options),
    )
    .await;
    match probe {
        Ok(Ok(conn)) => {
            let _ = sqlx::Connection::close(conn).await;
            Ok(())
        }
        Ok(Err(e)) => Err(classify_connect_error(url, &e)),
        Err(_) => Err(ConnectError::Unreachable {
            endpoint: url.endpoint(5432),
            reason: format!("no answer within {}s", timeout.as_secs()),
        }),
    }
}

/// A pool that connects on first use.
pub fn lazy_pool(options: PgConnectOptions, max_connections: u32, timeout: Duration) -> PgPool {
    lazy_pool_with_floor(options, max_connections, 0, timeout)
}

/// A pool that connects on first use and, once [`open_floor`] has opened them, keeps `floor`
/// connections (sqlx opens them again when one is closed). Past Postgres' connection limit a
/// pool with no connection of its own can get none: every session is held by the process's
/// other pools, which keep their idle ones. A floor opened at start is what such a pool always
/// has, and [`acquire`] waits for it to come back instead of for a session Postgres refuses.
pub fn lazy_pool_with_floor(
    options: PgConnectOptions,
    max_connections: u32,
    floor: u32,
    timeout: Duration,
) -> PgPool {
    // No ping before each acquire: it is a round trip on every use of the pool, and every
    // caller already treats a failed statement as retryable. sqlx still pings a connection
    // when it is returned, off the caller's path, and drops a broken one.
    let mut pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .min_connections(floor.min(max_connections))
        .test_before_acquire(false)
        .acquire_timeout(timeout.max(Duration::from_secs(30)));
    if floor >= max_connections {
        // A pool that is all floor keeps its connections for good: closing one for its age
        // or idleness would hand its session to whichever pool asks next.
        pool = pool.idle_timeout(None).max_lifetime(None);
    }
    pool.connect_lazy_with(options)
}

/// Opens the floor of `pool` (see [`lazy_pool_with_floor`]): holds that many of its
/// connections at once, then lets them go idle in it. Gives up after `within`.
pub async fn open_floor(pool: &PgPool, within: Duration) -> Result<(), sqlx::Error> {
    let floor = pool.options().get_min_connections();
    tokio::time::timeout(within, async {
        let mut held = Vec::new();
        while held.len() < usize::try_from(floor).unwrap_or(usize::MAX) {
            held.push(pool.acquire().await?);
        }
        Ok(())
    })
    .await
    .unwrap_or(Err(sqlx::Error::PoolTimedOut))
}

/// How long [`acquire`] waits as sqlx does before it also looks for the pool's own connections
/// coming back, and how often it looks then: soon at first, less often the longer it waits (a
/// Postgres that is down leaves nothing to find).
const ACQUIRE_PATIENCE: Duration = Duration::from_millis(20);
const LOOK_FIRST: Duration = Duration::from_millis(2);
const LOOK_MAX: Duration = Duration::from_millis(50);

/// A connection from `pool`, as `pool.acquire()` gives, except that it never sits out a
/// refused connect while the pool's own connections come free.
///
/// With none idle and the pool below its size, sqlx opens a new connection, and retries a
/// connect that Postgres refuses as full (SQLSTATE 53300) with backoff until the acquire
/// timeout, while the other connections of the same pool are returned and taken by others.
/// Past Postgres' connection limit that stalled a delivery for the whole timeout. After a short
/// wait this also takes the first connection the pool gets back, and drops the connect.
pub async fn acquire(pool: &PgPool) -> Result<PoolConnection<Postgres>, sqlx::Error> {
    let acquire = pool.acquire();
    tokio::pin!(acquire);
    if let Ok(done) = tokio::time::timeout(ACQUIRE_PATIENCE, &mut acquire).await {
        return done;
    }
    let mut look = LOOK_FIRST;
    loop {
        tokio::select! {
            done = &mut acquire => return done,
            () = tokio::time::sleep(look) => {
                if let Some(conn) = pool.try_acquire() {
                    return Ok(conn);
                }
                look = (look * 2).min(LOOK_MAX);
            }
        }
    }
}

/// A transaction on a connection from [`acquire`].
pub async fn begin(pool: &PgPool) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    let conn = acquire(pool).await?;
    Transaction::begin(conn, None).await
}

pub fn classify_connect_error(url: &SecretUrl, e: &sqlx::Error) -> ConnectError {
    let endpoint = url.endpoint(5432);
    // A failed handshake comes back as an I/O error (sqlx) or the server's refusal: either
    // way not transient, and its cause is what the operator needs.
    if let Some(cause) = crate::tls::cause(e) {
        return ConnectError::Tls {
            endpoint,
            reason: cause.explain(
                "sslrootcert (or PGSSLROOTCERT)",
                "sslcert and sslkey (or PGSSLCERT and PGSSLKEY)",
            ),
        };
    }
    match e {
        sqlx::Error::Io(io) => ConnectError::Unreachable {
            endpoint,
            reason: io_reason(io),
        },
        sqlx::Error::PoolTimedOut => ConnectError::Unreachable {
            endpoint,
            reason: "timed out while connecting".into(),
        },
        // The answer to the TLS request is the server's first byte: a connection closed at once
        // (a proxy whose server is away, a server shutting down) reads as a stray one.
        sqlx::Error::Protocol(p) if p.contains("SSLRequest") => ConnectError::Unreachable {
            endpoint,
            reason: "the connection was closed before Postgres answered".into(),
        },
        sqlx::Error::Tls(e) => ConnectError::Tls {
            endpoint,
            reason: format!("the handshake failed: {e}"),
        },
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            match code.as_ref() {
                // invalid_password, invalid_authorization_specification
                "28P01" | "28000" => ConnectError::Refused {
                    endpoint,
                    user: url.username().to_owned(),
                    reason: db.message().to_owned(),
                },
                // admin_shutdown, crash_shutdown, cannot_connect_now, too_many_connections
                "57P01" | "57P02" | "57P03" | "53300" => ConnectError::NotAccepting {
                    endpoint,
                    reason: format!("{} (SQLSTATE {code})", db.message()),
                },
                "3D000" => ConnectError::NoDatabase {
                    endpoint,
                    database: url.url().path().trim_start_matches('/').to_owned(),
                },
                _ => ConnectError::Other {
                    endpoint,
                    reason: format!("{} (SQLSTATE {code})", db.message()),
                },
            }
        }
        other => ConnectError::Other {
            endpoint,
            reason: other.to_string(),
        },
    }
}

fn io_reason(io: &std::io::Error) -> String {
    use std::io::ErrorKind::*;
    match io.kind() {
        ConnectionRefused => "connection refused (is Postgres running and listening there?)".into(),
        TimedOut => "connection timed out".into(),
        NotFound => "host not found".into(),
        _ => io.to_string(),
    }
}

/// True for errors where the same work may succeed if tried again: lost connections,
/// serialization failures (40001), deadlocks (40P01), and the server shutting down.
pub fn is_retryable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => matches!(
            db.code().as_deref(),
            Some(
                // serialization failure, deadlock
                "40001"
                    | "40P01"
                    // statement cancelled or timed out, lock not available, idle in
                    // transaction too long: the session or statement was stopped, not refused
                    | "57014"
                    | "55P03"
                    | "25P03"
                    // admin shutdown, crash shutdown, cannot connect now
                    | "57P01"
                    | "57P02"
                    | "57P03"
                    // out of disk, out of memory, too many connections
                    | "53100"
                    | "53200"
                    | "53300"
                    // connection exceptions, protocol violation
                    | "08000"
                    | "08001"
                    | "08003"
                    | "08004"
                    | "08006"
                    | "08007"
                    | "08P01"
            )
        ),
        _ => false,
    }
}

/// What Postgres can give the workers, read when a worker starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// `max_connections` less `superuser_reserved_connections`.
    pub usable: i64,
    /// Client sessions that are not kfs-worker's.
    pub others: i64,
    /// Live worker processes (holders of a liveness lock), this one included.
    pub workers: i64,
}

/// Reads [`Capacity`], given the live worker processes the caller counted (this one included).
pub async fn capacity(pool: &PgPool, workers: i64) -> Result<Capacity, sqlx::Error> {
    let (usable, others): (i64, i64) = sqlx::query_as(
        "SELECT current_setting('max_connections')::bigint \
                - current_setting('superuser_reserved_connections')::bigint, \
           (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' \
              AND application_name NOT LIKE 'kfs-worker%')",
    )
    .fetch_one(pool)
    .await?;
    Ok(Capacity {
        usable,
        others,
        workers,
    })
}

/// The warning to log when every live worker opening as many connections as this one may
/// (`per_worker`) would need more than Postgres accepts. Past that point Postgres refuses new
/// sessions ("too many clients"): each worker goes on with the connections it has (see
/// [`acquire`]), its deliveries wait for one another, and connections idle in one worker's pool
/// are of no use to another's.
pub fn over_capacity(per_worker: u32, cap: Capacity) -> Option<String> {
    let wanted = cap.others + cap.workers * i64::from(per_worker);
    (wanted > cap.usable).then(|| {
        format!(
            "Postgres may run out of connections: {} worker process(es) at up to {per_worker} \
             connections each, plus {} other sessions, need up to {wanted}, and Postgres accepts \
             {}; deliveries would then wait for each other's connections. Lower KFS_PREFETCH, raise \
             max_connections, or put a pooler in front of Postgres",
            cap.workers, cap.others, cap.usable
        )
    })
}

/// A wait for a row or advisory lock bounded by `lock_timeout`, for one statement, inside the
/// caller's transaction: [`LockWait::begin`] before the statement, [`LockWait::end`] with its
/// result. The wait runs in Postgres' own lock queue, so waiters get the lock in order the
/// moment its holder ends; one that waited the whole time leaves the transaction as it was.
pub struct LockWait {
    before: String,
}

impl LockWait {
    /// Sets `lock_timeout` to `wait` under a savepoint.
    pub async fn begin(conn: &mut sqlx::PgConnection, wait: Duration) -> Result<Self, sqlx::Error> {
        let before: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
            .fetch_one(&mut *conn)
            .await?;
        sqlx::query("SAVEPOINT kfs_lock_wait")
            .execute(&mut *conn)
            .await?;
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .bind(format!("{}ms", wait.as_millis().max(1)))
            .execute(&mut *conn)
            .await?;
        Ok(LockWait { before })
    }

    /// `Some` with the statement's result once it got its lock (the old `lock_timeout` is back
    /// and the lock is kept); `None` when it timed out waiting (rolled back to the savepoint,
    /// which also undoes the setting); any other error as it came.
    pub async fn end<T>(
        self,
        conn: &mut sqlx::PgConnection,
        locked: Result<T, sqlx::Error>,
    ) -> Result<Option<T>, sqlx::Error> {
        match locked {
            Ok(v) => {
                sqlx::query("SELECT set_config('lock_timeout', $1, true)")
                    .bind(&self.before)
                    .execute(&mut *conn)
                    .await?;
                sqlx::query("RELEASE SAVEPOINT kfs_lock_wait")
                    .execute(&mut *conn)
                    .await?;
                Ok(Some(v))
            }
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => {
                sqlx::query("ROLLBACK TO SAVEPOINT kfs_lock_wait")
                    .execute(&mut *conn)
                    .await?;
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_failures_are_not_outages_and_a_connection_closed_at_the_tls_request_is() {
        let url = crate::config::database_url(Some("postgres://kfs:hunter2@db:5432/kfs")).unwrap();
        let cases: [(sqlx::Error, bool, &str); 4] = [
            (
                sqlx::Error::Protocol("unexpected response from SSLRequest: 0x00".into()),
                true,
                "cannot reach Postgres at db:5432",
            ),
            (
                sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "invalid peer certificate: UnknownIssuer",
                )),
                false,
                "TLS to Postgres at db:5432 failed: the server's certificate is not signed by a CA this client trusts (unknown CA)",
            ),
            (
                sqlx::Error::Tls("server does not support TLS".into()),
                false,
                "does not offer TLS",
            ),
            (
                sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    "refused",
                )),
                true,
                "connection refused",
            ),
        ];
        for (e, transient, text) in cases {
            let c = classify_connect_error(&url, &e);
            assert_eq!(c.is_transient(), transient, "{c}");
            assert!(c.to_string().contains(text), "{c}");
            assert!(!c.to_string().contains("hunter2"));
        }
    }

    #[test]
    fn over_capacity_table() {
        let cap = |usable, others, workers| Capacity {
            usable,
            others,
            workers,
        };
        for (per_worker, c, warns) in [
            // One worker at the default prefetch on a default Postgres.
            (25, cap(97, 5, 1), false),
            // Three fit, a fourth does not (the bench's scale-out at in flight 16).
            (25, cap(97, 5, 3), false),
            (25, cap(97, 5, 4), true),
            // Exactly full is still enough.
            (25, cap(100, 0, 4), false),
            // Other clients count too.
            (25, cap(97, 50, 2), true),
        ] {
            assert_eq!(
                over_capacity(per_worker, c).is_some(),
                warns,
                "{per_worker} × {c:?}"
            );
        }
        let text = over_capacity(25, cap(97, 5, 4)).unwrap();
        assert!(
            text.contains("4 worker process(es) at up to 25") && text.contains("need up to 105"),
            "{text}"
        );
        assert!(text.contains("accepts 97"), "{text}");
    }
}
