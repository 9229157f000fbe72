//! `kfs-worker migrate` and `kfs-worker check`: set up and check the services. Invariant: a
//! service that cannot be reached or refuses is a usage error (exit 2) naming the service;
//! `check` reports every problem it finds, not only the first.

use super::{ConnArgs, Failure, MigrateArgs};
use crate::{broker, db};

pub(super) async fn migrate(conn: &ConnArgs, args: &MigrateArgs) -> Result<(), Failure> {
    let url = conn.database_url()?;
    let timeout = conn.connect_timeout()?;
    let pool = db::connect(&url, "kfs-worker migrate", 2, timeout)
        .await
        .map_err(Failure::usage)?;
    let options = db::migrate::Options {
        upgrade_platform: args.upgrade_platform,
    };
    let report = db::migrate::migrate_with(&pool, options)
        .await
        .map_err(|e| match e {
            db::MigrateError::Refused(_) => Failure::usage(format!("cannot migrate {url}: {e}")),
            _ => Failure::runtime(format!("migration failed: {e}")),
        })?;
    if let [first, .., last] | [first @ last] = report.upgraded_platform.as_slice() {
        println!(
            "platform: applied the platform's migrations {first} through {last} ({} in all), as its own runner would",
            report.upgraded_platform.len()
        );
    }
    println!(
        "migrations: {} applied now ({}), {} in total, database {url} is up to date",
        report.applied.len(),
        report.found,
        report.total,
    );
    let built = report.indexes.created.len() + report.indexes.rebuilt.len();
    if built > 0 {
        println!(
            "indexes: {built} of the project's own built concurrently ({} rebuilt from an interrupted build)",
            report.indexes.rebuilt.len()
        );
    }
    Ok(())
}

pub(super) async fn check(conn: &ConnArgs) -> Result<(), Failure> {
    let services = conn.services()?;
    let timeout = services.connect_timeout;
    let mut problems = Vec::new();

    match db::connect(&services.database_url, "kfs-worker check", 1, timeout).await {
        Ok(pool) => {
            let version: String = sqlx::query_scalar("SELECT current_setting('server_version')")
                .fetch_one(&pool)
                .await
                .unwrap_or_else(|_| "unknown version".into());
            let tls = match pool.acquire().await {
                Ok(mut conn) => db::tls_in_use(&mut conn).await,
                Err(_) => "TLS unknown".into(),
            };
            println!(
                "postgres: ok, PostgreSQL {version} at {}, {tls}",
                services.database_url
            );
        }
        Err(e) => problems.push(e.to_string()),
    }

    // Every node on its own: a fleet spread over the list needs all of them.
    let nodes = &services.amqp_url;
    let count = nodes.nodes().len();
    let results = broker::check_each(nodes, "kfs-worker check", timeout).await;
    for (i, (url, result)) in nodes.nodes().iter().zip(results).enumerate() {
        let which = if count > 1 {
            format!("node {} of {count} ", i + 1)
        } else {
            String::new()
        };
        let tls = if url.url().scheme() == "amqps" {
            nodes.tls().describe()
        } else {
            "no TLS".to_owned()
        };
        match result {
            Ok(()) => println!("rabbitmq: {which}ok at {url}, {tls}"),
            Err(e) => problems.push(format!("rabbitmq {which}cannot be used: {e}")),
        }
    }

    if problems.is_empty() {
        Ok(())
    } else {
        Err(Failure::usage(problems.join("\nerror: ")))
    }
}
