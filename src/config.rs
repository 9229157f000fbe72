//! Configuration: every setting comes from the environment or a flag, is validated once at
//! start, and fails with one line that names the variable. Invariant: no secret (a password
//! inside a URL, a token) ever reaches `Display`, `Debug`, a log line or an error message.

use std::fmt;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
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

/// `AMQP_URL`: one RabbitMQ node's URL, or several separated by commas (the nodes of one
/// cluster), tried in a shuffled order with TLS from no files; see [`AmqpNodes`].
pub fn amqp_url(raw: &str) -> Result<AmqpNodes, ConfigError> {
    let entries: Vec<&str> = raw.split(',').map(str::trim).collect();
    let many = entries.len() > 1;
    let mut nodes: Vec<SecretUrl> = Vec::with_capacity(entries.len());
    for (i, entry) in entries.iter().enumerate() {
        // Positions, never the text: an entry may hold a password.
        let at = |problem: String| {
            if many {
                ConfigError::new(
                    "AMQP_URL",
                    format!("entry {} of {}: {problem}", i + 1, entries.len()),
                )
            } else {
                ConfigError::new("AMQP_URL", problem)
            }
        };
        if many && entry.is_empty() {
            return Err(at(
                "is empty; separate the nodes' URLs with single commas".into()
            ));
        }
        let url = parse_url("AMQP_URL", entry, &["amqp", "amqps"], DEFAULT_AMQP_URL)
            .map_err(|e| at(e.problem))?;
        // The AMQP URI parser has rules of its own (vhost, port); check them here so that a
        // bad value fails at start, and with a message that never contains the URL text.
        url.expose().parse::<lapin::uri::AMQPUri>().map_err(|_| {
            at(format!(
                "is not a valid AMQP URI; expected a URL such as {DEFAULT_AMQP_URL}"
            ))
        })?;
        if let Some(j) = nodes
            .iter()
            .position(|n| n.endpoint(5672) == url.endpoint(5672))
        {
            return Err(at(format!("names the same node as entry {}", j + 1)));
        }
        nodes.push(url);
    }
    Ok(AmqpNodes {
        nodes: nodes.into(),
        order: NodeOrder::Shuffled,
        tls: AmqpTls::default(),
        state: Arc::new(NodeState::default()),
    })
}

/// In which order a process tries the nodes `AMQP_URL` lists (`KFS_AMQP_NODE_ORDER`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeOrder {
    /// From a node picked at random, so that a fleet spreads over the nodes (the default).
    Shuffled,
    /// From the first listed: the nodes after it are fallbacks.
    Listed,
}

impl NodeOrder {
    pub fn parse(raw: &str) -> Result<NodeOrder, ConfigError> {
        match raw.trim() {
            "shuffled" => Ok(NodeOrder::Shuffled),
            "listed" => Ok(NodeOrder::Listed),
            _ => Err(ConfigError::new(
                "KFS_AMQP_NODE_ORDER",
                "must be `shuffled` (start at a random node; the default) or `listed` (start at the first)",
            )),
        }
    }
}

/// The order in which `count` nodes are tried from `start`: each once, wrapping around.
pub fn try_order(count: usize, start: usize) -> impl Iterator<Item = usize> {
    (0..count).map(move |k| (start + k) % count)
}

/// TLS material for `amqps://` nodes, read once at start (`KFS_AMQP_TLS_CA`,
/// `KFS_AMQP_TLS_CERT`, `KFS_AMQP_TLS_KEY`). Without a CA the system's roots decide.
#[derive(Clone, Default)]
pub struct AmqpTls {
    /// PEM certificates trusted beside the system's roots.
    pub ca: Option<String>,
    /// The client's PEM certificate chain and PEM private key, for mutual TLS.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for AmqpTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

impl AmqpTls {
    /// Reads the files the settings name; each problem names its variable.
    pub fn from_files(
        ca: Option<&str>,
        cert: Option<&str>,
        key: Option<&str>,
    ) -> Result<AmqpTls, ConfigError> {
        let read =
            |var: &'static str, path: Option<&str>| -> Result<Option<Vec<u8>>, ConfigError> {
                let Some(path) = path.map(str::trim).filter(|p| !p.is_empty()) else {
                    return Ok(None);
                };
                let bytes = std::fs::read(path)
                    .map_err(|e| ConfigError::new(var, format!("cannot read {path}: {e}")))?;
                if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
                    return Err(ConfigError::new(
                        var,
                        format!("{path} holds no PEM block; expected a PEM file (-----BEGIN ...)"),
                    ));
                }
                Ok(Some(bytes))
            };
        let ca = read("KFS_AMQP_TLS_CA", ca)?
            .map(|b| {
                String::from_utf8(b)
                    .map_err(|_| ConfigError::new("KFS_AMQP_TLS_CA", "is not a text (PEM) file"))
            })
            .transpose()?;
        let identity = match (
            read("KFS_AMQP_TLS_CERT", cert)?,
            read("KFS_AMQP_TLS_KEY", key)?,
        ) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            (Some(_), None) => return Err(ConfigError::new(
                "KFS_AMQP_TLS_KEY",
                "is not set, but KFS_AMQP_TLS_CERT is; a client certificate needs its private key",
            )),
            (None, Some(_)) => return Err(ConfigError::new(
                "KFS_AMQP_TLS_CERT",
                "is not set, but KFS_AMQP_TLS_KEY is; a private key needs its client certificate",
            )),
        };
        Ok(AmqpTls { ca, identity })
    }

    /// What the TLS of an `amqps://` connection trusts and shows, in words (no key material).
    pub fn describe(&self) -> String {
        let trust = if self.ca.is_some() {
            "the system's roots and the CA of KFS_AMQP_TLS_CA"
        } else {
            "the system's roots"
        };
        let client = if self.identity.is_some() {
            "a client certificate (KFS_AMQP_TLS_CERT)"
        } else {
            "no client certificate"
        };
        format!("TLS trusting {trust}, with {client}")
    }
}

/// Which node a process is on, shared by all of its broker sessions.
#[derive(Debug, Default)]
struct NodeState {
    /// The node the next connection tries first.
    cursor: AtomicUsize,
    /// Whether `cursor` was placed yet (the first connection places it).
    placed: std::sync::atomic::AtomicBool,
    /// The node a session of the process is connected to, plus one (0: none).
    connected: AtomicUsize,
}

/// The RabbitMQ nodes of `AMQP_URL` (one, or a cluster's), how to try them and the TLS for
/// `amqps://`. Clones share which node the process is on: every broker session of a process
/// starts at the node the last one got to, and moves to the next when that node is lost.
#[derive(Clone)]
pub struct AmqpNodes {
    nodes: Arc<[SecretUrl]>,
    order: NodeOrder,
    tls: AmqpTls,
    state: Arc<NodeState>,
}

impl AmqpNodes {
    pub fn with_order(mut self, order: NodeOrder) -> Self {
        self.order = order;
        self
    }

    pub fn with_tls(mut self, tls: AmqpTls) -> Self {
        self.tls = tls;
        self
    }

    pub fn nodes(&self) -> &[SecretUrl] {
        &self.nodes
    }

    pub fn tls(&self) -> &AmqpTls {
        &self.tls
    }

    pub fn order(&self) -> NodeOrder {
        self.order
    }

    /// The first node listed.
    pub fn url(&self) -> &Url {
        self.nodes[0].url()
    }

    /// `host:port` of the first node, or of every node when there are several.
    pub fn endpoint(&self, default_port: u16) -> String {
        let all: Vec<String> = self
            .nodes
            .iter()
            .map(|n| n.endpoint(default_port))
            .collect();
        all.join(", ")
    }

    /// Every URL, comma-separated, as `AMQP_URL` takes them: for handing to a child process.
    /// Never print it.
    pub fn expose(&self) -> String {
        let all: Vec<&str> = self.nodes.iter().map(SecretUrl::expose).collect();
        all.join(",")
    }

    /// The nodes in the order the next connection tries them.
    pub fn attempt_order(&self) -> Vec<usize> {
        use std::sync::atomic::Ordering;
        let count = self.nodes.len();
        if !self.state.placed.swap(true, Ordering::AcqRel) {
            let start = match self.order {
                NodeOrder::Shuffled => rand::random_range(0..count),
                NodeOrder::Listed => 0,
            };
            self.state.cursor.store(start, Ordering::Release);
        }
        try_order(count, self.state.cursor.load(Ordering::Acquire)).collect()
    }

    /// A session of the process is on node `i` now.
    pub fn connected(&self, i: usize) {
        use std::sync::atomic::Ordering;
        self.state.cursor.store(i, Ordering::Release);
        self.state.connected.store(i + 1, Ordering::Release);
    }

    /// A session lost its connection to node `i`: the next connection starts at the node after
    /// it, unless another session of the process has moved on already.
    pub fn lost(&self, i: usize) {
        use std::sync::atomic::Ordering;
        let next = (i + 1) % self.nodes.len();
        let _ = self
            .state
            .cursor
            .compare_exchange(i, next, Ordering::AcqRel, Ordering::Acquire);
        let _ =
            self.state
                .connected
                .compare_exchange(i + 1, 0, Ordering::AcqRel, Ordering::Acquire);
    }

    /// `host:port` of the node a session of the process is connected to now.
    pub fn current(&self) -> Option<String> {
        use std::sync::atomic::Ordering;
        match self.state.connected.load(Ordering::Acquire) {
            0 => None,
            i => self.nodes.get(i - 1).map(|n| n.endpoint(5672)),
        }
    }
}

impl fmt::Display for AmqpNodes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let all: Vec<String> = self.nodes.iter().map(ToString::to_string).collect();
        f.write_str(&all.join(","))
    }
}

impl fmt::Debug for AmqpNodes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AmqpNodes({self}, {:?}, {:?})", self.order, self.tls)
    }
}

impl PartialEq for AmqpNodes {
    fn eq(&self, other: &Self) -> bool {
        self.nodes == other.nodes && self.order == other.order
    }
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

/// The settings that hold secrets, each with the variable that may name a file holding it
/// instead (`<NAME>_FILE`, the convention of the official Postgres and RabbitMQ images and of
/// mounted Kubernetes and Docker secrets).
pub const SECRET_SETTINGS: &[(&str, &str)] = &[
    ("DATABASE_URL", "DATABASE_URL_FILE"),
    ("AMQP_URL", "AMQP_URL_FILE"),
    ("KFS_ADMIN_TOKEN", "KFS_ADMIN_TOKEN_FILE"),
    ("KFS_OPENAI_API_KEY", "KFS_OPENAI_API_KEY_FILE"),
    ("KFS_EMBEDDING_API_KEY", "KFS_EMBEDDING_API_KEY_FILE"),
    ("KFS_REASONING_API_KEY", "KFS_REASONING_API_KEY_FILE"),
    ("UNSTRUCTURED_API_KEY", "UNSTRUCTURED_API_KEY_FILE"),
    ("PGPASSWORD", "PGPASSWORD_FILE"),
    ("AWS_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID_FILE"),
    ("AWS_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY_FILE"),
    ("AWS_SESSION_TOKEN", "AWS_SESSION_TOKEN_FILE"),
    (
        "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_ACCOUNT_KEY_FILE",
    ),
    ("AZURE_STORAGE_ACCESS_KEY", "AZURE_STORAGE_ACCESS_KEY_FILE"),
    (
        "GOOGLE_SERVICE_ACCOUNT_KEY",
        "GOOGLE_SERVICE_ACCOUNT_KEY_FILE",
    ),
    (
        "OTEL_EXPORTER_OTLP_HEADERS",
        "OTEL_EXPORTER_OTLP_HEADERS_FILE",
    ),
];

/// The secret settings given as files: for each `<NAME>_FILE` set, `NAME` and the file's
/// content (one trailing line break dropped). Reads `env` only; the caller puts the values in
/// place. Each problem names the `_FILE` variable and never shows the content.
pub fn secrets_from_files(
    env: impl Fn(&str) -> Option<String>,
) -> Result<Vec<(&'static str, String)>, ConfigError> {
    let mut found = Vec::new();
    for &(name, file_var) in SECRET_SETTINGS {
        let Some(path) = env(file_var).filter(|p| !p.trim().is_empty()) else {
            continue;
        };
        if env(name).is_some() {
            return Err(ConfigError::new(
                file_var,
                format!("is set, and so is {name}; set only one of them"),
            ));
        }
        let bytes = std::fs::read(&path)
            .map_err(|e| ConfigError::new(file_var, format!("cannot read {path}: {e}")))?;
        let mut value = String::from_utf8(bytes)
            .map_err(|_| ConfigError::new(file_var, format!("{path} is not UTF-8 text")))?;
        if value.ends_with('\n') {
            value.pop();
            if value.ends_with('\r') {
                value.pop();
            }
        }
        if value.trim().is_empty() {
            return Err(ConfigError::new(file_var, format!("{path} is empty")));
        }
        found.push((name, value));
    }
    Ok(found)
}

/// Connection settings shared by every command that talks to the services.
#[derive(Clone, Debug)]
pub struct Services {
    pub database_url: SecretUrl,
    pub amqp_url: AmqpNodes,
    pub queue_prefix: String,
    pub connect_timeout: Duration,
}

/// An API key of a model provider. Only its length can be printed.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    pub fn new(key: impl Into<String>) -> Self {
        Self(key.into())
    }

    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKey(*** {} chars)", self.0.len())
    }
}

/// Where the OpenAI-compatible adapters send requests unless told otherwise.
pub const DEFAULT_OPENAI_BASE_URL: &str = "https://api.openai.com/v1";

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
    fn amqp_url_takes_a_list_of_nodes_and_names_a_bad_entry_by_position() {
        let nodes = amqp_url(
            "amqp://u:hunter2@a:5701/%2f, amqp://u:hunter2@b:5702/%2f,amqps://u:hunter2@c/%2f",
        )
        .unwrap();
        let endpoints: Vec<String> = nodes.nodes().iter().map(|n| n.endpoint(5672)).collect();
        assert_eq!(endpoints, ["a:5701", "b:5702", "c:5672"]);
        assert!(!nodes.to_string().contains("hunter2"), "{nodes}");
        assert!(!format!("{nodes:?}").contains("hunter2"));
        assert_eq!(nodes.expose().matches("hunter2").count(), 3);
        let cases = [
            (
                "amqp://a/%2f,,amqp://b/%2f",
                "AMQP_URL: entry 2 of 3: is empty",
            ),
            (
                "amqp://a/%2f,http://u:hunter2@b/",
                "AMQP_URL: entry 2 of 2: has scheme 'http'",
            ),
            (
                "amqp://u:hunter2@a:99999/%2f,amqp://b/%2f",
                "AMQP_URL: entry 1 of 2: is not a valid URL",
            ),
            (
                "amqp://a:5701/%2f,amqp://u:p@a:5701/other",
                "AMQP_URL: entry 2 of 2: names the same node as entry 1",
            ),
            ("amqp://a/%2f,", "AMQP_URL: entry 2 of 2: is empty"),
        ];
        for (raw, want) in cases {
            let e = amqp_url(raw).unwrap_err().to_string();
            assert!(e.starts_with(want), "{raw}: {e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
        // One node keeps the messages it always had.
        let e = amqp_url("http://x/").unwrap_err().to_string();
        assert!(e.starts_with("AMQP_URL: has scheme 'http'"), "{e}");
    }

    #[test]
    fn nodes_are_tried_each_once_from_the_cursor_and_a_lost_node_moves_it_on() {
        assert_eq!(try_order(3, 0).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(try_order(3, 2).collect::<Vec<_>>(), [2, 0, 1]);
        assert_eq!(try_order(1, 0).collect::<Vec<_>>(), [0]);

        let nodes = amqp_url("amqp://a/%2f,amqp://b/%2f,amqp://c/%2f")
            .unwrap()
            .with_order(NodeOrder::Listed);
        assert_eq!(nodes.attempt_order(), [0, 1, 2]);
        assert_eq!(nodes.current(), None);
        nodes.connected(0);
        assert_eq!(nodes.current().as_deref(), Some("a:5672"));
        // Clones are the same process: both sessions see the move once.
        let other = nodes.clone();
        nodes.lost(0);
        other.lost(0);
        assert_eq!(nodes.current(), None);
        assert_eq!(other.attempt_order(), [1, 2, 0]);
        other.connected(1);
        assert_eq!(nodes.current().as_deref(), Some("b:5672"));
        // A session that lost an older node does not move the process off its new one.
        nodes.lost(0);
        assert_eq!(nodes.attempt_order(), [1, 2, 0]);
        assert_eq!(nodes.current().as_deref(), Some("b:5672"));
        nodes.lost(1);
        assert_eq!(nodes.attempt_order(), [2, 0, 1]);
        nodes.connected(2);
        nodes.lost(2);
        assert_eq!(nodes.attempt_order(), [0, 1, 2], "wraps around");
    }

    #[test]
    fn shuffled_processes_start_at_every_node() {
        let mut starts = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let nodes = amqp_url("amqp://a/%2f,amqp://b/%2f,amqp://c/%2f").unwrap();
            let order = nodes.attempt_order();
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, [0, 1, 2], "each node once");
            starts.insert(order[0]);
            // The start is placed once per process.
            assert_eq!(nodes.attempt_order(), order);
        }
        assert_eq!(starts.len(), 3, "a fleet spreads over the nodes");
        assert!(NodeOrder::parse("listed").is_ok());
        let e = NodeOrder::parse("random").unwrap_err();
        assert_eq!(e.var, "KFS_AMQP_NODE_ORDER");
    }

    #[test]
    fn secret_settings_come_from_files_once_and_never_show() {
        let dir = std::env::temp_dir().join(format!("kfs-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let url = dir.join("db");
        std::fs::write(&url, "postgres://kfs:hunter2@db/kfs\n").unwrap();
        let token = dir.join("token");
        std::fs::write(&token, "correct-horse-battery\r\n").unwrap();
        let empty = dir.join("empty");
        std::fs::write(&empty, "\n").unwrap();
        let env = |vars: Vec<(&'static str, String)>| {
            move |name: &str| {
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.clone())
            }
        };
        let found = secrets_from_files(env(vec![
            ("DATABASE_URL_FILE", url.display().to_string()),
            ("KFS_ADMIN_TOKEN_FILE", token.display().to_string()),
            ("KFS_CLOSE_CHANNEL_FILE", "/not/a/secret".into()),
        ]))
        .unwrap();
        assert_eq!(
            found,
            [
                ("DATABASE_URL", "postgres://kfs:hunter2@db/kfs".to_owned()),
                ("KFS_ADMIN_TOKEN", "correct-horse-battery".to_owned()),
            ]
        );
        let missing = dir.join("missing");
        let cases = [
            (
                vec![("AMQP_URL_FILE", missing.display().to_string())],
                "AMQP_URL_FILE: cannot read",
            ),
            (
                vec![
                    ("DATABASE_URL_FILE", url.display().to_string()),
                    ("DATABASE_URL", "postgres://x/y".to_owned()),
                ],
                "DATABASE_URL_FILE: is set, and so is DATABASE_URL",
            ),
            (
                vec![("KFS_OPENAI_API_KEY_FILE", empty.display().to_string())],
                "KFS_OPENAI_API_KEY_FILE: ",
            ),
        ];
        for (vars, want) in cases {
            let e = secrets_from_files(env(vars)).unwrap_err().to_string();
            assert!(e.starts_with(want), "{e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn amqp_tls_files_are_read_at_start_and_named_when_wrong() {
        let dir = std::env::temp_dir().join(format!("kfs-amqp-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pem = dir.join("a.pem");
        std::fs::write(
            &pem,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let not_pem = dir.join("b.txt");
        std::fs::write(&not_pem, "hello").unwrap();
        let p = |f: &std::path::Path| f.display().to_string();
        let tls = AmqpTls::from_files(Some(&p(&pem)), Some(&p(&pem)), Some(&p(&pem))).unwrap();
        assert!(tls.ca.is_some() && tls.identity.is_some());
        assert!(!format!("{tls:?}").contains("AAAA"), "{tls:?}");
        assert!(AmqpTls::from_files(None, None, None).unwrap().ca.is_none());
        let bad = [
            (
                AmqpTls::from_files(Some("/no/such.pem"), None, None),
                "KFS_AMQP_TLS_CA: cannot read /no/such.pem",
            ),
            (
                AmqpTls::from_files(Some(&p(&not_pem)), None, None),
                "KFS_AMQP_TLS_CA: ",
            ),
            (
                AmqpTls::from_files(None, Some(&p(&pem)), None),
                "KFS_AMQP_TLS_KEY: is not set",
            ),
            (
                AmqpTls::from_files(None, None, Some(&p(&pem))),
                "KFS_AMQP_TLS_CERT: is not set",
            ),
        ];
        for (got, want) in bad {
            let e = got.unwrap_err().to_string();
            assert!(e.starts_with(want), "{e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
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
