//! The demo's worker processes: `kfs-worker run` children of this executable, the wait until both
//! consume, and the kill of one mid-run. Invariant: a worker that is still running when its
//! handle is dropped is stopped (SIGTERM, then SIGKILL), so the demo never leaves one behind.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use uuid::Uuid;

use super::{fail, Progress, TENANT};
use crate::command::Failure;
use crate::config::Services;
use crate::jobs::Kind;

/// A worker process of the demo.
pub(super) struct Worker {
    name: String,
    child: Child,
    pub(super) http: String,
}

impl Worker {
    pub(super) fn spawn(
        name: &str,
        services: &Services,
        object_store: &str,
        http: &str,
        log_dir: &str,
    ) -> Result<Worker, Failure> {
        std::fs::create_dir_all(log_dir).map_err(|e| fail("log directory")(e.to_string()))?;
        let log = std::fs::File::create(format!("{log_dir}/{name}.log"))
            .map_err(|e| fail("log file")(e.to_string()))?;
        let exe = std::env::current_exe().map_err(|e| fail("own executable")(e.to_string()))?;
        let child = Command::new(exe)
            .args([
                "run",
                "--worker-id",
                name,
                "--kinds",
                "compile,deletion,research",
            ])
            .env("DATABASE_URL", services.database_url.expose())
            .env("AMQP_URL", services.amqp_url.expose())
            .env("KFS_QUEUE_PREFIX", &services.queue_prefix)
            .env("KFS_OBJECT_STORE", object_store)
            .env("KFS_HTTP_ADDR", http)
            .env("KFS_RELAY_POLL", "250ms")
            .env("KFS_EMBEDDER", "offline")
            .env("KFS_REASONER", "offline")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| fail("start a worker")(e.to_string()))?;
        Ok(Worker {
            name: name.to_owned(),
            child,
            http: http.to_owned(),
        })
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then wait for a clean exit.
    pub(super) fn stop(&mut self) -> Option<i32> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(40);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.kill();
        None
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.stop();
        }
    }
}

/// A free local port, preferring `preferred`.
pub(super) fn http_addr(preferred: u16) -> String {
    let l = std::net::TcpListener::bind(("127.0.0.1", preferred))
        .or_else(|_| std::net::TcpListener::bind(("127.0.0.1", 0)));
    match l.and_then(|l| l.local_addr()) {
        Ok(a) => a.to_string(),
        Err(_) => "off".into(),
    }
}

/// Waits until two consumers (demo-a's and demo-b's) are on the compile queue.
pub(super) async fn both_consuming(services: &Services, timeout: Duration) -> Result<(), String> {
    let conn = crate::broker::connect(
        &services.amqp_url,
        "kfs-worker demo",
        services.connect_timeout,
    )
    .await
    .map_err(|e| e.to_string())?;
    let queue = crate::broker::Topology::new(&services.queue_prefix).queue(Kind::Compile);
    let deadline = Instant::now() + timeout;
    let mut consumers = 0;
    while Instant::now() < deadline {
        // A passive declare fails while the queue does not exist yet, and closes its channel.
        let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
        let declared = ch
            .queue_declare(
                queue.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await;
        if let Ok(q) = declared {
            consumers = q.consumer_count();
            let _ = ch.close(200, "checked".into()).await;
            if consumers >= 2 {
                let _ = conn.close(200, "bye".into()).await;
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = conn.close(200, "bye".into()).await;
    Err(format!(
        "the two workers did not both consume {queue} within {}s ({consumers} consumer(s)); see their logs",
        timeout.as_secs()
    ))
}

/// A job leased by an incarnation of the worker id `$2`: exactly the holder format
/// (`<id>#<8 hex>`, see [`crate::liveness::id_of`]), so that `demo-a` never matches the holders
/// of another id that merely starts with `demo-a#`.
const HELD_BY: &str =
    "(worker_id = $2 || '#' || right(worker_id, 8) AND right(worker_id, 8) ~ '^[0-9A-Fa-f]{8}$')";

pub(super) struct Kill {
    pub(super) held: usize,
    pub(super) takeover: Option<Duration>,
}

pub(super) async fn kill_mid_run(
    pool: &PgPool,
    a: &mut Worker,
    p: &Progress,
) -> Result<Kill, String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut held: Vec<Uuid> = Vec::new();
    while Instant::now() < deadline {
        held = sqlx::query_scalar(&format!(
            "SELECT id FROM document_compilation_attempts WHERE tenant_id = $1 AND {HELD_BY} \
             AND run_state = 'running'"
        ))
        .bind(TENANT)
        .bind(&a.name)
        .fetch_all(pool)
        .await
        .map_err(|e| e.to_string())?;
        if !held.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    a.kill();
    let killed = Instant::now();
    p.say(format!(
        "killed demo-a with SIGKILL while it held {} compile job(s)",
        held.len()
    ));
    if held.is_empty() {
        return Ok(Kill {
            held: 0,
            takeover: None,
        });
    }
    // Taken over: none of those jobs is still leased by demo-a.
    let mut takeover = None;
    while killed.elapsed() < Duration::from_secs(90) {
        let still: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM document_compilation_attempts WHERE id = ANY($1) AND {HELD_BY}"
        ))
        .bind(&held)
        .bind(&a.name)
        .fetch_one(pool)
        .await
        .map_err(|e| e.to_string())?;
        if still == 0 {
            takeover = Some(killed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    if let Some(t) = takeover {
        p.say(format!(
            "demo-b took over demo-a's work {:.0} ms after the kill",
            t.as_secs_f64() * 1000.0
        ));
    }
    Ok(Kill {
        held: held.len(),
        takeover,
    })
}
