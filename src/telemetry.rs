//! Logging setup. Invariant: logs go to stderr (stdout belongs to command output), human
//! readable by default, one JSON object per line with `KFS_LOG_FORMAT=json`.

use tracing_subscriber::{fmt, EnvFilter};

/// `default_filter` applies when `RUST_LOG` is unset.
pub fn init(default_filter: &str) {
    let filter =
        EnvFilter::try_from_env("RUST_LOG").unwrap_or_else(|_| EnvFilter::new(default_filter));
    let json = std::env::var("KFS_LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if json {
        builder.json().flatten_event(true).try_init()
    } else {
        builder.compact().try_init()
    };
}
