//! Configuration: every setting comes from the environment or a flag, is validated once at
//! start, and fails with one line that names the variable. Invariant: no secret (a password
//! inside a URL, a token) ever reaches `Display`, `Debug`, a log line or an error message.

use std::fmt;
use std::time::Duration;

use sha2::Digest as _;
use url::Url;

/// A configuration problem, reported as one line naming the variable. Exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{var}: {problem}")]
pub struct ConfigError {
    pub var: &'static str,
    pub problem: String,
}

impl ConfigError {
    pub fn new(var: &'static str, problem: impl Into<String>) -> Self {
        Self {
            var,
            problem: problem.into(),
        }
    }
}

/// A URL that may carry a password. Only its redacted form can be printed.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretUrl(Url);

impl SecretUrl {
    /// The full URL, for handing to a driver. Never print it.
    pub fn expose(&self) -> &str {
        self.0.as_str()
    }

    pub fn url(&self) -> &Url {
        &self.0
    }

    /// `host:port`, for error messages.
    pub fn endpoint(&self, default_port: u16) -> String {
        let host = self.0.host_str().unwrap_or("localhost");
        let port = self.0.port().unwrap_or(default_port);
        if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        }
    }

    pub fn username(&self) -> &str {
        self.0.username()
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(&self.0))
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretUrl({})", redact(&self.0))
    }
}

/// The HTTP client of an outbound model adapter configured by `var`: the whole request bounded
/// by `timeout`, connecting by at most ten seconds of it.
pub fn http_client(
    var: &'static str,
    timeout: std::time::Duration,
) -> Result<reqwest::Client, ConfigError> {
    reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(timeout.min(std::time::Duration::from_secs(10)))
        .build()
        .map_err(|e| {
            ConfigError::new(
                var,
                format!("cannot build the HTTP client: {}", e.without_url()),
            )
        })
}

/// The URL with its password replaced by `***`.
pub fn redact(url: &Url) -> String {
    let mut shown = url.clone();
    if shown.password().is_some() {
        let _ = shown.set_password(Some("***"));
    }
    shown.to_string()
}

/// Parses a URL without ever echoing its text: a malformed URL may still hold a password.
fn parse_url(
    var: &'static str,
    raw: &str,
    schemes: &[&str],
    example: &str,
) -> Result<SecretUrl, ConfigError> {
    let raw = raw.trim();
    if raw.is_empty() {
        return Err(ConfigError::new(
            var,
            format!("is empty; expected a URL such as {example}"),
        ));
    }
    let url = Url::parse(raw).map_err(|e| {
        ConfigError::new(
            var,
            format!("is not a valid URL ({e}); expected a URL such as {example}"),
        )
    })?;
    if !schemes.contains(&url.scheme()) {
        return Err(ConfigError::new(
            var,
            format!(
                "has scheme '{}', expected {}; for example {example}",
                url.scheme(),
                schemes.join(" or ")
            ),
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(ConfigError::new(
            var,
            format!("has no host; expected a URL such as {example}"),
        ));
    }
    Ok(SecretUrl(url))
}

pub const DATABASE_URL_EXAMPLE: &str = "postgres://postgres@127.0.0.1:5432/kfs";
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub const DEFAULT_QUEUE_PREFIX: &str = "kfs";
pub const DEFAULT_OBJECT_STORE: &str = "file://./data/objects";

pub fn database_url(raw: Option<&str>) -> Result<SecretUrl, ConfigError> {
    let raw = raw.ok_or_else(|| {
        ConfigError::new(
            "DATABASE_URL",
            format!("is not set; set it (or pass --database-url) to a Postgres URL such as {DATABASE_URL_EXAMPLE}"),
        )
    })?;
    let url = parse_url(
        "DATABASE_URL",
        raw,
        &["postgres", "postgresql"],
        DATABASE_URL_EXAMPLE,
    )?;
    let db = url.url().path().trim_start_matches('/');
    if db.is_empty() {
        return Err(ConfigError::new(
            "DATABASE_URL",
            format!("names no database; expected a URL such as {DATABASE_URL_EXAMPLE}"),
        ));
    }
    Ok(url)
}

pub fn amqp_url(raw: &str) -> Result<SecretUrl, ConfigError> {
    let url = parse_url("AMQP_URL", raw, &["amqp", "amqps"], DEFAULT_AMQP_URL)?;
    // The AMQP URI parser has rules of its own (vhost, port); check them here so that a bad
    // value fails at start, and with a message that never contains the URL text.
    url.expose().parse::<lapin::uri::AMQPUri>().map_err(|_| {
        ConfigError::new(
            "AMQP_URL",
            format!("is not a valid AMQP URI; expected a URL such as {DEFAULT_AMQP_URL}"),
        )
    })?;
    Ok(url)
}

/// Queue and exchange names are `<prefix>.<name>`; the prefix isolates deployments and tests.
pub fn queue_prefix(raw: &str) -> Result<String, ConfigError> {
    let ok = !raw.is_empty()
        && raw.len() <= 64
        && raw
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(raw.to_owned())
    } else {
        Err(ConfigError::new(
            "KFS_QUEUE_PREFIX",
            "must be 1 to 64 characters of letters, digits, '-', '_' or '.'",
        ))
    }
}

pub fn object_store(raw: &str) -> Result<SecretUrl, ConfigError> {
    let raw = raw.trim();
    let url = Url::parse(raw)
        .or_else(|e| match e {
            // `file://./data/objects` and bare paths: resolve against the working directory.
            url::ParseError::RelativeUrlWithoutBase => Url::parse("file:///").and_then(|b| b.join(raw)),
            other => Err(other),
        })
        .map_err(|e| ConfigError::new("KFS_OBJECT_STORE", format!("is not a valid URL ({e}); expected e.g. {DEFAULT_OBJECT_STORE} or s3://bucket/prefix")))?;
    match url.scheme() {
        "file" | "memory" | "s3" | "gs" | "az" | "azure" | "abfs" | "abfss" | "http" | "https" => {
            Ok(SecretUrl(url))
        }
        other => Err(ConfigError::new(
            "KFS_OBJECT_STORE",
            format!("has scheme '{other}'; expected file, memory, s3, gs, az or http(s)"),
        )),
    }
}

/// Defaults to `<host>-<pid>`: unique per process, readable in `worker_id` columns.
pub fn worker_id(raw: Option<&str>) -> Result<String, ConfigError> {
    match raw {
        None => {
            let host = gethostname::gethostname().to_string_lossy().into_owned();
            let host = if host.is_empty() {
                "worker".to_owned()
            } else {
                host
            };
            Ok(format!("{host}-{}", std::process::id()))
        }
        Some(id) => {
            let id = id.trim();
            if id.is_empty() || id.len() > 200 || id.chars().any(char::is_control) {
                Err(ConfigError::new(
                    "KFS_WORKER_ID",
                    "must be 1 to 200 printable characters",
                ))
            } else {
                Ok(id.to_owned())
            }
        }
    }
}

/// Parses a duration such as `30s`, `250ms`, `5m` or a plain number of seconds.
pub fn duration(var: &'static str, raw: &str) -> Result<Duration, ConfigError> {
    let raw = raw.trim();
    let (num, unit) = raw
        .find(|c: char| !c.is_ascii_digit())
        .map_or((raw, "s"), |i| raw.split_at(i));
    let value: u64 = num
        .parse()
        .map_err(|_| ConfigError::new(var, "must be a duration such as 30s, 250ms or 5m"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(value)),
        "s" => Ok(Duration::from_secs(value)),
        "m" => Ok(Duration::from_secs(value * 60)),
        _ => Err(ConfigError::new(
            var,
            "must be a duration such as 30s, 250ms or 5m",
        )),
    }
}

/// The shared secret that authorises the dashboard's actions (`KFS_ADMIN_TOKEN`). Only a
/// comparison can be made with it: it has no `Display`, and `Debug` shows `***`.
#[derive(Clone)]
pub struct AdminToken(sha2::digest::Output<sha2::Sha256>);

/// Shortest token accepted: guessing one must be hopeless.
pub const ADMIN_TOKEN_MIN_LEN: usize = 16;

impl AdminToken {
    /// `None` when unset or empty (actions are then refused); an error when too short.
    pub fn parse(raw: Option<&str>) -> Result<Option<AdminToken>, ConfigError> {
        let Some(raw) = raw.map(str::trim).filter(|r| !r.is_empty()) else {
            return Ok(None);
        };
        if raw.chars().count() < ADMIN_TOKEN_MIN_LEN {
            return Err(ConfigError::new(
                "KFS_ADMIN_TOKEN",
                format!("is too short; use at least {ADMIN_TOKEN_MIN_LEN} characters (e.g. `openssl rand -hex 24`)"),
            ));
        }
        Ok(Some(AdminToken(sha2::Sha256::digest(raw.as_bytes()))))
    }

    /// Whether `given` is the token, in time that depends on neither its content nor its
    /// length (both sides are compared as digests, with `subtle`).
    pub fn matches(&self, given: &str) -> bool {
        use subtle::ConstantTimeEq;
        let given = sha2::Sha256::digest(given.trim().as_bytes());
        self.0.as_slice().ct_eq(given.as_slice()).into()
    }
}

impl fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AdminToken(***)")
    }
}

/// Connection settings shared by every command that talks to the services.
#[derive(Clone, Debug)]
pub struct Services {
    pub database_url: SecretUrl,
    pub amqp_url: SecretUrl,
    pub queue_prefix: String,
    pub connect_timeout: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_database_url_names_the_variable() {
        let e = database_url(None).unwrap_err();
        assert_eq!(e.var, "DATABASE_URL");
        assert!(e.to_string().starts_with("DATABASE_URL: is not set"));
    }

    #[test]
    fn malformed_urls_never_echo_the_secret() {
        for raw in [
            "postgres//user:hunter2@host/db",
            "mysql://user:hunter2@host/db",
            "postgres://user:hunter2@/db",
            "postgres://user:hunter2@host:99999/db",
        ] {
            let e = database_url(Some(raw)).unwrap_err().to_string();
            assert!(e.starts_with("DATABASE_URL: "), "{e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
        for raw in [
            "amqp://guest:hunter2@host:notaport/%2f",
            "http://guest:hunter2@host/",
            "amqp//x",
        ] {
            let e = amqp_url(raw).unwrap_err().to_string();
            assert!(e.starts_with("AMQP_URL: "), "{e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
    }

    #[test]
    fn display_and_debug_redact_passwords() {
        let url = database_url(Some("postgres://kfs:hunter2@db:5432/kfs")).unwrap();
        assert_eq!(url.to_string(), "postgres://kfs:***@db:5432/kfs");
        assert!(!format!("{url:?}").contains("hunter2"));
        assert_eq!(url.endpoint(5432), "db:5432");
        assert_eq!(url.expose(), "postgres://kfs:hunter2@db:5432/kfs");
    }

    #[test]
    fn database_url_needs_a_database_name() {
        assert!(database_url(Some("postgres://db:5432/")).is_err());
        assert!(database_url(Some("postgres://db:5432/kfs")).is_ok());
    }

    #[test]
    fn queue_prefix_rules() {
        assert!(queue_prefix("kfs").is_ok());
        assert!(queue_prefix("test-1_a.b").is_ok());
        assert!(queue_prefix("").is_err());
        assert!(queue_prefix("has space").is_err());
        assert!(queue_prefix(&"x".repeat(65)).is_err());
    }

    #[test]
    fn object_store_accepts_relative_file_urls_and_known_schemes() {
        assert_eq!(
            object_store("file://./data/objects")
                .unwrap()
                .url()
                .scheme(),
            "file"
        );
        assert!(object_store("s3://bucket/prefix").is_ok());
        assert!(object_store("ftp://x/y").is_err());
    }

    #[test]
    fn worker_id_defaults_to_host_and_pid() {
        let id = worker_id(None).unwrap();
        assert!(id.ends_with(&format!("-{}", std::process::id())));
        assert!(worker_id(Some("  ")).is_err());
        assert_eq!(worker_id(Some("w1")).unwrap(), "w1");
    }

    #[test]
    fn durations() {
        assert_eq!(duration("X", "30s").unwrap(), Duration::from_secs(30));
        assert_eq!(duration("X", "250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(duration("X", "5m").unwrap(), Duration::from_secs(300));
        assert_eq!(duration("X", "7").unwrap(), Duration::from_secs(7));
        assert!(duration("X", "soon").is_err());
        assert!(duration("X", "5h").is_err());
    }

    #[test]
    fn the_admin_token_is_optional_long_enough_and_never_shown() {
        assert!(AdminToken::parse(None).unwrap().is_none());
        assert!(AdminToken::parse(Some("  ")).unwrap().is_none());
        let e = AdminToken::parse(Some("short-secret")).unwrap_err();
        assert_eq!(e.var, "KFS_ADMIN_TOKEN");
        assert!(!e.to_string().contains("short-secret"), "{e}");
        let t = AdminToken::parse(Some("correct-horse-battery"))
            .unwrap()
            .unwrap();
        assert!(t.matches("correct-horse-battery"));
        assert!(!t.matches("correct-horse-batterx"));
        assert!(!t.matches(""));
        assert!(!t.matches("correct-horse-battery-and-more"));
        assert_eq!(format!("{t:?}"), "AdminToken(***)");
    }
}
