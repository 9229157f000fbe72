//! TLS to Postgres and RabbitMQ, against private servers with certificates made by the test
//! (`support::pki`): the libpq `sslmode`s in the URL and as settings, a CA given as a file, a
//! client certificate; and each way a handshake fails gives one line naming its cause.

use std::process::{Command, Output};

use crate::support::pki::Pki;
use crate::support::private::{PrivatePostgres, PrivateRabbit};
use crate::support::{self};

/// `kfs-worker check` with only `env` for settings (none inherited from the test's).
fn check(env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kfs-worker"));
    cmd.arg("check");
    for var in [
        "DATABASE_URL",
        "AMQP_URL",
        "RUST_LOG",
        "PGSSLMODE",
        "PGSSLROOTCERT",
        "PGSSLCERT",
        "PGSSLKEY",
        "KFS_AMQP_TLS_CA",
        "KFS_AMQP_TLS_CERT",
        "KFS_AMQP_TLS_KEY",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("KFS_CONNECT_TIMEOUT", "10s");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run kfs-worker check")
}

fn out(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The line `check` prints about one service: `postgres:` or `rabbitmq`, ok or the error.
fn line<'a>(text: &'a str, service: &str) -> &'a str {
    text.lines()
        .find(|l| l.contains(service))
        .unwrap_or_else(|| panic!("no line about {service} in:\n{text}"))
}

fn services_installed() -> bool {
    let ok = std::path::Path::new("/usr/lib/postgresql/15/bin/initdb").exists()
        && Command::new("rabbitmq-server")
            .arg("--help")
            .output()
            .is_ok();
    if !ok {
        support::skip_or_fail(
            "the Postgres 15 server binaries and rabbitmq-server (ops/services installs them)",
        );
    }
    ok
}

#[test]
fn postgres_over_tls_with_require_and_verify_full_against_the_tests_ca() {
    if !services_installed() {
        return;
    }
    // `check` also looks at the shared service of the other kind.
    let _services = support::isolation::shared_blocking();
    let pki = Pki::make("pg");
    let pg = PrivatePostgres::start_tls(&pki);
    let amqp = support::amqp_url();
    let ca = pki.file("ca.pem");

    // require: encrypted, the certificate not checked.
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?sslmode=require",
        pg.port
    );
    let o = check(&[("DATABASE_URL", &url), ("AMQP_URL", &amqp)]);
    let text = out(&o);
    assert!(o.status.success(), "{text}");
    assert!(line(&text, "postgres:").contains("TLSv1."), "{text}");

    // verify-full in the URL: the CA checked, and the host name against the certificate.
    let url = format!(
        "postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert={ca}",
        pg.port
    );
    let o = check(&[("DATABASE_URL", &url), ("AMQP_URL", &amqp)]);
    let text = out(&o);
    assert!(o.status.success(), "{text}");
    assert!(line(&text, "postgres:").contains("TLSv1."), "{text}");

    // The same as libpq's settings, with a plain URL.
    let url = format!("postgres://postgres@localhost:{}/postgres", pg.port);
    let o = check(&[
        ("DATABASE_URL", &url),
        ("AMQP_URL", &amqp),
        ("PGSSLMODE", "verify-full"),
        ("PGSSLROOTCERT", &ca),
    ]);
    let text = out(&o);
    assert!(o.status.success(), "{text}");
    assert!(line(&text, "postgres:").contains("TLSv1."), "{text}");

    // A client certificate, where the server asks for one (database `mtls`).
    let url = format!(
        "postgres://postgres@localhost:{}/mtls?sslmode=verify-full&sslrootcert={ca}&sslcert={}&sslkey={}",
        pg.port,
        pki.file("client.pem"),
        pki.file("client.key")
    );
    let mut admin = Command::new("psql");
    let created = admin
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &pg.port.to_string(),
            "-U",
            "postgres",
            "-c",
            "CREATE DATABASE mtls",
        ])
        .env("PGSSLMODE", "require")
        .output()
        .expect("psql");
    assert!(created.status.success(), "{}", out(&created));
    let o = check(&[("DATABASE_URL", &url), ("AMQP_URL", &amqp)]);
    let text = out(&o);
    assert!(o.status.success(), "{text}");
}

#[test]
fn postgres_tls_failures_name_their_cause() {
    if !services_installed() {
        return;
    }
    // `check` also looks at the shared service of the other kind.
    let _services = support::isolation::shared_blocking();
    let pki = Pki::make("pg");
    let stranger = Pki::make("stranger");
    let pg = PrivatePostgres::start_tls(&pki);
    let plain = PrivatePostgres::start();
    let amqp = support::amqp_url();
    let ca = pki.file("ca.pem");
    let cases: Vec<(String, &str)> = vec![
        (
            format!(
                "postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert={}",
                pg.port,
                stranger.file("ca.pem")
            ),
            "unknown CA",
        ),
        (
            format!(
                "postgres://postgres@localhost:{}/postgres?sslmode=verify-ca&sslrootcert={}",
                pg.port,
                stranger.file("ca.pem")
            ),
            "unknown CA",
        ),
        (
            format!(
                "postgres://postgres@127.0.0.1:{}/postgres?sslmode=verify-full&sslrootcert={ca}",
                pg.port
            ),
            "host name mismatch",
        ),
        (
            format!(
                "postgres://postgres@127.0.0.1:{}/postgres?sslmode=require",
                plain.port
            ),
            "does not offer TLS",
        ),
        (
            format!(
                "postgres://postgres@localhost:{}/mtls?sslmode=verify-full&sslrootcert={ca}",
                pg.port
            ),
            "no certificate",
        ),
        (
            format!(
                "postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert=/no/such/ca.pem",
                pg.port
            ),
            "cannot read the file sslrootcert names (/no/such/ca.pem)",
        ),
    ];
    for (url, cause) in cases {
        let o = check(&[("DATABASE_URL", &url), ("AMQP_URL", &amqp)]);
        let text = out(&o);
        assert_eq!(o.status.code(), Some(2), "{url}: {text}");
        let err = line(&text, "Postgres at");
        assert!(err.starts_with("error: "), "{url}: {text}");
        assert!(err.contains(cause), "{url}: expected {cause:?} in {err}");
        assert!(
            !err.contains("unreachable") && !err.contains("cannot reach"),
            "a TLS failure is not an outage: {err}"
        );
    }
}

#[test]
fn amqps_with_the_tests_ca_with_and_without_a_client_certificate() {
    if !services_installed() {
        return;
    }
    // `check` also looks at the shared service of the other kind.
    let _services = support::isolation::shared_blocking();
    let pki = Pki::make("mq");
    let stranger = Pki::make("stranger");
    let mq = PrivateRabbit::start_tls(&pki, false);
    let db = support::admin_url();
    let amqps = mq.tls_url();
    let ca = pki.file("ca.pem");
    let (cert, key) = (pki.file("client.pem"), pki.file("client.key"));

    let o = check(&[
        ("DATABASE_URL", &db),
        ("AMQP_URL", &amqps),
        ("KFS_AMQP_TLS_CA", &ca),
    ]);
    let text = out(&o);
    assert!(o.status.success(), "{text}");
    let ok = line(&text, "rabbitmq:");
    assert!(
        ok.contains("ok at amqps://guest:***@localhost")
            && ok.contains("KFS_AMQP_TLS_CA")
            && ok.contains("no client certificate"),
        "{text}"
    );

    let o = check(&[
        ("DATABASE_URL", &db),
        ("AMQP_URL", &amqps),
        ("KFS_AMQP_TLS_CA", &ca),
        ("KFS_AMQP_TLS_CERT", &cert),
        ("KFS_AMQP_TLS_KEY", &key),
    ]);
    let text = out(&o);
    assert!(o.status.success(), "{text}");
    assert!(
        line(&text, "rabbitmq:").contains("with a client certificate"),
        "{text}"
    );

    // Failures, each with its cause.
    let plain_as_tls = format!("amqps://guest:guest@localhost:{}/%2f", mq.port);
    let stranger_ca = stranger.file("ca.pem");
    let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
        (vec![("AMQP_URL", &amqps)], "unknown CA"),
        (
            vec![("AMQP_URL", &amqps), ("KFS_AMQP_TLS_CA", &stranger_ca)],
            "unknown CA",
        ),
        (
            vec![("AMQP_URL", &plain_as_tls), ("KFS_AMQP_TLS_CA", &ca)],
            "did not answer with TLS",
        ),
    ];
    for (env, cause) in cases {
        let mut env = env;
        env.push(("DATABASE_URL", &db));
        let o = check(&env);
        let text = out(&o);
        assert_eq!(o.status.code(), Some(2), "{text}");
        let err = line(&text, "rabbitmq cannot be used");
        assert!(err.contains(cause), "expected {cause:?} in {err}");
        assert!(!text.contains("guest:guest"), "a secret leaked: {text}");
    }
}

#[test]
fn amqps_that_requires_a_client_certificate_refuses_a_client_without_one() {
    if !services_installed() {
        return;
    }
    // `check` also looks at the shared service of the other kind.
    let _services = support::isolation::shared_blocking();
    let pki = Pki::make("mtls");
    let mq = PrivateRabbit::start_tls(&pki, true);
    let db = support::admin_url();
    let amqps = mq.tls_url();
    let ca = pki.file("ca.pem");

    let o = check(&[
        ("DATABASE_URL", &db),
        ("AMQP_URL", &amqps),
        ("KFS_AMQP_TLS_CA", &ca),
    ]);
    let text = out(&o);
    assert_eq!(o.status.code(), Some(2), "{text}");
    let err = line(&text, "rabbitmq cannot be used");
    assert!(err.contains("requires a client certificate"), "{text}");

    let o = check(&[
        ("DATABASE_URL", &db),
        ("AMQP_URL", &amqps),
        ("KFS_AMQP_TLS_CA", &ca),
        ("KFS_AMQP_TLS_CERT", &pki.file("client.pem")),
        ("KFS_AMQP_TLS_KEY", &pki.file("client.key")),
    ]);
    let text = out(&o);
    assert!(o.status.success(), "{text}");
    assert!(
        line(&text, "rabbitmq:").contains("with a client certificate"),
        "{text}"
    );
}
