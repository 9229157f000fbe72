//! The command line against real services: bad configuration and unreachable or refusing
//! services each give one clear line and exit code 2, and no secret is ever printed. A test
//! that hands the worker the shared services' addresses holds them (`support::isolation`).

use std::process::{Command, Output};

use crate::support;

fn kfs(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kfs-worker"));
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("AMQP_URL")
        .env_remove("RUST_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run kfs-worker")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Exactly one `error:` line per problem, and the exit code 2.
fn assert_usage_error(o: &Output, lines: usize, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "stderr: {err}");
    assert_eq!(
        err.lines().filter(|l| l.starts_with("error: ")).count(),
        lines,
        "stderr: {err}"
    );
    assert_eq!(
        err.lines().count(),
        lines,
        "nothing but the error lines: {err}"
    );
    assert!(err.contains(needle), "expected {needle:?} in: {err}");
    assert!(!err.contains("hunter2"), "a secret leaked: {err}");
}

#[test]
fn check_passes_against_the_running_services() {
    let _services = support::isolation::shared_blocking();
    let db = support::admin_url();
    let o = kfs(
        &["check"],
        &[("DATABASE_URL", &db), ("AMQP_URL", &support::amqp_url())],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "stdout: {out} stderr: {}", stderr(&o));
    assert!(out.contains("postgres: ok"), "{out}");
    assert!(out.contains("rabbitmq: ok"), "{out}");
    assert!(!out.contains("guest:guest"), "password printed: {out}");
}

#[test]
fn secret_settings_are_read_from_files_and_a_bad_file_is_one_clear_line() {
    let _services = support::isolation::shared_blocking();
    let dir = std::env::temp_dir().join(format!("kfs-secret-files-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    // As Docker and Kubernetes mount them: the value and a line break.
    let db = file("database-url", &format!("{}\n", support::admin_url()));
    let amqp = file("amqp-url", &format!("{}\n", support::amqp_url()));
    let o = kfs(
        &["check"],
        &[("DATABASE_URL_FILE", &db), ("AMQP_URL_FILE", &amqp)],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "stdout: {out} stderr: {}", stderr(&o));
    assert!(
        out.contains("postgres: ok") && out.contains("rabbitmq: ok"),
        "{out}"
    );
    assert!(!out.contains("guest:guest"), "password printed: {out}");

    // A secret read from a file is used as given: a wrong password is refused, never shown.
    let wrong = file("wrong", "amqp://guest:hunter2@127.0.0.1:5672/%2f\n");
    let o = kfs(
        &["check"],
        &[("DATABASE_URL_FILE", &db), ("AMQP_URL_FILE", &wrong)],
    );
    assert_usage_error(&o, 1, "refused the credentials of user \"guest\"");

    let missing = dir.join("missing").display().to_string();
    let o = kfs(
        &["check"],
        &[("DATABASE_URL_FILE", &db), ("AMQP_URL_FILE", &missing)],
    );
    assert_usage_error(&o, 1, &format!("AMQP_URL_FILE: cannot read {missing}"));
    let o = kfs(
        &["check"],
        &[
            ("DATABASE_URL_FILE", &db),
            ("DATABASE_URL", "postgres://u:hunter2@x/y"),
        ],
    );
    assert_usage_error(&o, 1, "DATABASE_URL_FILE: is set, and so is DATABASE_URL");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn check_with_a_wrong_rabbitmq_password_says_so() {
    let _services = support::isolation::shared_blocking();
    let o = kfs(
        &["check"],
        &[
            ("DATABASE_URL", &support::admin_url()),
            ("AMQP_URL", "amqp://guest:hunter2@127.0.0.1:5672/%2f"),
        ],
    );
    assert_usage_error(
        &o,
        1,
        "RabbitMQ at 127.0.0.1:5672 refused the credentials of user \"guest\"",
    );
}

#[test]
fn check_with_a_postgres_role_that_cannot_log_in_says_so() {
    let _services = support::isolation::shared_blocking();
    let o = kfs(
        &["check"],
        &[
            (
                "DATABASE_URL",
                "postgres://no_such_role:hunter2@127.0.0.1:5432/postgres",
            ),
            ("AMQP_URL", &support::amqp_url()),
        ],
    );
    assert_usage_error(
        &o,
        1,
        "Postgres at 127.0.0.1:5432 refused the credentials of user \"no_such_role\"",
    );
}

#[test]
fn check_with_closed_ports_says_which_service_is_unreachable() {
    let o = kfs(
        &["check"],
        &[
            (
                "DATABASE_URL",
                "postgres://postgres:hunter2@127.0.0.1:1/postgres",
            ),
            ("AMQP_URL", "amqp://guest:hunter2@127.0.0.1:1/%2f"),
        ],
    );
    let err = stderr(&o);
    assert_usage_error(
        &o,
        2,
        "cannot reach Postgres at 127.0.0.1:1: connection refused",
    );
    assert!(
        err.contains("cannot reach RabbitMQ at 127.0.0.1:1: connection refused"),
        "{err}"
    );
}

#[test]
fn malformed_urls_name_the_variable_and_hide_the_password() {
    let _services = support::isolation::shared_blocking();
    let o = kfs(
        &["check"],
        &[("DATABASE_URL", "postgres//admin:hunter2@db/kfs")],
    );
    assert_usage_error(&o, 1, "DATABASE_URL: is not a valid URL");
    let o = kfs(
        &["check"],
        &[
            ("DATABASE_URL", &support::admin_url()),
            ("AMQP_URL", "amqp://guest:hunter2@127.0.0.1:notaport/%2f"),
        ],
    );
    assert_usage_error(&o, 1, "AMQP_URL: ");
    let o = kfs(
        &["migrate"],
        &[("DATABASE_URL", "mysql://root:hunter2@127.0.0.1/kfs")],
    );
    assert_usage_error(&o, 1, "DATABASE_URL: has scheme 'mysql'");
}

#[test]
fn missing_database_url_is_one_clear_line() {
    let o = kfs(&["migrate"], &[]);
    assert_usage_error(&o, 1, "DATABASE_URL: is not set");
}

#[test]
fn bad_run_settings_are_refused_before_connecting() {
    let _services = support::isolation::shared_blocking();
    let db = support::admin_url();
    for (var, value, needle) in [
        (
            "KFS_KINDS",
            "compile,bogus",
            "KFS_KINDS: unknown job kind 'bogus'",
        ),
        ("KFS_QUEUE_PREFIX", "has space", "KFS_QUEUE_PREFIX: must be"),
        (
            "KFS_EMBEDDER",
            "magic",
            "KFS_EMBEDDER: must be offline or openai",
        ),
        (
            "KFS_SLICE_TIME",
            "soon",
            "KFS_SLICE_TIME: must be a duration",
        ),
        (
            "KFS_LEASES",
            "compile",
            "KFS_LEASES: expected KIND=DURATION",
        ),
        ("KFS_WORKER_ID", " ", "KFS_WORKER_ID: must be"),
        ("KFS_PREFETCH", "0", "KFS_PREFETCH: must be at least 1"),
        ("KFS_BATCH_MAX", "0", "KFS_BATCH_MAX: must be at least 1"),
        (
            "KFS_SLICE_STEPS",
            "0",
            "KFS_SLICE_STEPS: must be at least 1",
        ),
        (
            "KFS_RELAY_BATCH",
            "0",
            "KFS_RELAY_BATCH: must be between 1 and 10000",
        ),
        (
            "KFS_MAX_DISPATCH_ATTEMPTS",
            "-1",
            "KFS_MAX_DISPATCH_ATTEMPTS: must be at least 1",
        ),
        (
            "KFS_CONNECT_TIMEOUT",
            "5parsecs",
            "KFS_CONNECT_TIMEOUT: must be a duration",
        ),
        (
            "KFS_SHUTDOWN_GRACE",
            "-1s",
            "KFS_SHUTDOWN_GRACE: must be a duration",
        ),
        (
            "KFS_HTTP_ADDR",
            "nowhere",
            "KFS_HTTP_ADDR: must be host:port",
        ),
        (
            "KFS_OBJECT_STORE",
            "ftp://x",
            "KFS_OBJECT_STORE: has scheme 'ftp'",
        ),
        ("KFS_PREFETCH", "lots", "KFS_PREFETCH: invalid value 'lots'"),
        (
            "KFS_SLICE_STEPS",
            "-3",
            "KFS_SLICE_STEPS: invalid value '-3'",
        ),
        (
            "KFS_LOG_FORMAT",
            "xml",
            "KFS_LOG_FORMAT: must be 'text' or 'json', got 'xml'",
        ),
        ("RUST_LOG", "info,=[{", "RUST_LOG: is not a log filter"),
    ] {
        let o = kfs(&["run"], &[("DATABASE_URL", &db), (var, value)]);
        assert_usage_error(&o, 1, needle);
    }
}

#[test]
fn every_subcommand_has_help() {
    for sub in ["migrate", "check", "run"] {
        let o = kfs(&[sub, "--help"], &[]);
        assert!(o.status.success(), "{sub} --help failed");
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("Usage: kfs-worker"),
            "{sub}"
        );
    }
}

/// A worker runs only on the schema its build's migrations made: on a database `migrate` never
/// touched, and on one whose platform ledger records a migration this build does not know, `run`
/// ends with one line saying so before it takes any job.
#[tokio::test]
async fn a_worker_refuses_a_database_not_migrated_for_its_build() {
    let env = support::TestEnv::new().await;
    let plain = format!(
        "kfs_t_plain_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    sqlx::query(&format!(r#"CREATE DATABASE "{plain}""#))
        .execute(&env.pool)
        .await
        .expect("create an empty database");
    let run = |url: String| {
        let amqp = support::amqp_url();
        let prefix = env.prefix.clone();
        std::thread::spawn(move || {
            kfs(
                &["run", "--kinds", "probe", "--worker-id", "schema-check"],
                &[
                    ("DATABASE_URL", url.as_str()),
                    ("AMQP_URL", amqp.as_str()),
                    ("KFS_QUEUE_PREFIX", prefix.as_str()),
                    ("KFS_HTTP_ADDR", "off"),
                ],
            )
        })
        .join()
        .expect("the worker ran")
    };
    let o = run(support::url_for(&plain));
    assert_usage_error(
        &o,
        1,
        "has not been migrated by kfs-worker: run `kfs-worker migrate` first",
    );

    sqlx::query("INSERT INTO schema_migrations (migration_id, dialect) VALUES ('0055_future_things', 'postgres')")
        .execute(&env.pool)
        .await
        .expect("record a later platform migration");
    let o = run(env.url.clone());
    assert_usage_error(&o, 1, "records the platform's migration 0055_future_things");
    let claimed: i64 = sqlx::query_scalar("SELECT count(*) FROM kfs_worker_migrations")
        .fetch_one(&env.pool)
        .await
        .expect("the ledger is readable");
    assert!(claimed > 0);
    sqlx::query(&format!(r#"DROP DATABASE "{plain}" WITH (FORCE)"#))
        .execute(&env.pool)
        .await
        .expect("drop the empty database");
    env.cleanup().await;
}
