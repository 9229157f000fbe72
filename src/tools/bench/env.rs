//! A fresh place for one scenario: its own database (migrated, probe kind installed) and its own
//! queue prefix on the services the bench was pointed at. Invariant: the bench only ever creates
//! and removes databases named `kfs_bench_*` and queues under its own `kfsbench*` prefix, and
//! [`BenchEnv::cleanup`] removes both (it keeps the database, for a look afterwards, only when
//! `KFS_BENCH_KEEP_DB=1`).

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection, PgPool};

use crate::broker::{self, Topology};
use crate::config::{self, Services};
use crate::jobs::Kind;
use crate::{db, jobs};

pub struct BenchEnv {
    pub tag: String,
    pub db_name: String,
    /// The services bound to this scenario's database and prefix.
    pub services: Services,
    pub pool: PgPool,
    pub topology: Topology,
    pub amqp: lapin::Connection,
    base: Services,
}

impl BenchEnv {
    /// Creates the database and declares the topology of every kind.
    pub async fn new(base: &Services, scenario: &str) -> Result<BenchEnv, String> {
        let tag = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
        let db_name = format!("kfs_bench_{scenario}_{tag}");
        let mut admin = PgConnection::connect(base.database_url.expose())
            .await
            .map_err(|e| db::classify_connect_error(&base.database_url, &e).to_string())?;
        sqlx::query(&format!("CREATE DATABASE \"{db_name}\""))
            .execute(&mut admin)
            .await
            .map_err(|e| format!("cannot create the bench database {db_name}: {e}"))?;
        let _ = admin.close().await;
        let mut url = base.database_url.url().clone();
        url.set_path(&format!("/{db_name}"));
        let database_url = config::database_url(Some(url.as_str())).map_err(|e| e.to_string())?;
        let services = Services {
            database_url,
            amqp_url: base.amqp_url.clone(),
            queue_prefix: format!("kfsbench{tag}"),
            connect_timeout: base.connect_timeout,
        };
        let pool = db::connect(
            &services.database_url,
            "kfs-worker bench",
            8,
            base.connect_timeout,
        )
        .await
        .map_err(|e| e.to_string())?;
        db::migrate(&pool)
            .await
            .map_err(|e| format!("migrate {db_name}: {e}"))?;
        jobs::probe::install(&pool)
            .await
            .map_err(|e| format!("install the probe kind: {e}"))?;
        let amqp = broker::connect(&base.amqp_url, "kfs-worker bench", base.connect_timeout)
            .await
            .map_err(|e| e.to_string())?;
        let topology = Topology::new(services.queue_prefix.clone());
        let ch = amqp.create_channel().await.map_err(|e| e.to_string())?;
        topology
            .declare(&ch, &Kind::all())
            .await
            .map_err(|e| format!("declare the bench topology: {e}"))?;
        let _ = ch.close(200, "declared".into()).await;
        Ok(BenchEnv {
            tag,
            db_name,
            services,
            pool,
            topology,
            amqp,
            base: base.clone(),
        })
    }

    pub async fn channel(&self) -> Result<lapin::Channel, String> {
        self.amqp.create_channel().await.map_err(|e| e.to_string())
    }

    /// A channel in confirm mode, as the relay publishes on.
    pub async fn confirm_channel(&self) -> Result<lapin::Channel, String> {
        let ch = self.channel().await?;
        ch.confirm_select(lapin::options::ConfirmSelectOptions::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok(ch)
    }

    /// Consumers attached to `queue`, from a passive declare.
    pub async fn consumers(&self, queue: &str) -> Result<u32, String> {
        let ch = self.channel().await?;
        let q = ch
            .queue_declare(
                queue.into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .map_err(|e| e.to_string())?;
        let _ = ch.close(200, "asked".into()).await;
        Ok(q.consumer_count())
    }

    /// Waits until `queue` has `n` consumers: the workers are ready to take deliveries.
    pub async fn wait_consumers(
        &self,
        queue: &str,
        n: u32,
        timeout: Duration,
    ) -> Result<(), String> {
        let start = Instant::now();
        loop {
            let have = self.consumers(queue).await?;
            if have >= n {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(format!(
                    "only {have} of {n} consumers attached to {queue} after {}s",
                    timeout.as_secs()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Postgres' clock now; scenario times are differences of database timestamps.
    pub async fn db_now(&self) -> Result<chrono::DateTime<chrono::Utc>, String> {
        sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(&self.pool)
            .await
            .map_err(|e| e.to_string())
    }

    /// Removes the queues and the database.
    pub async fn cleanup(self) {
        self.pool.close().await;
        if let Ok(ch) = self.amqp.create_channel().await {
            let _ = self.topology.delete(&ch, &Kind::all()).await;
            let _ = ch
                .queue_delete(
                    format!("{}.limit", self.topology.prefix).as_str().into(),
                    lapin::options::QueueDeleteOptions::default(),
                )
                .await;
        }
        let _ = self.amqp.close(200, "bench done".into()).await;
        if std::env::var_os("KFS_BENCH_KEEP_DB").is_some_and(|v| v == "1") {
            eprintln!(
                "bench: kept database {} (KFS_BENCH_KEEP_DB=1)",
                self.db_name
            );
            return;
        }
        if let Ok(mut admin) = PgConnection::connect(self.base.database_url.expose()).await {
            let _ = sqlx::query(&format!(
                "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
                self.db_name
            ))
            .execute(&mut admin)
            .await;
            let _ = admin.close().await;
        }
    }
}
