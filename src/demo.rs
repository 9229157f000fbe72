//! `kfs-worker demo`: the main job end to end on real services. It writes only its own tenant
//! (`kfs-demo`): a space, two sources and five documents shipped in the binary; it compiles them,
//! asks two research questions, deletes one source, and kills one of its two worker processes
//! mid-run to show the other take over. Invariant: it resets its own demo data, never anything
//! else, so running it twice works.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use sqlx::PgPool;
use uuid::Uuid;

use crate::cli::{ConnArgs, Failure};
use crate::config::{self, Services};
use crate::jobs::{compile, deletion, research, Kind};
use crate::{db, platform, status, store::Store};

pub const TENANT: &str = "kfs-demo";
const SUBJECT: &str = "demo-user";
/// The dimension of the demo space's embedding profile.
const EMBEDDING_DIMENSION: usize = 64;

/// The documents, written for this project.
const DOCUMENTS: [(&str, &str, &str, &[u8]); 5] = [
    (
        "guides",
        "outbox-relay.md",
        "text/markdown",
        include_bytes!("../examples/demo/outbox-relay.md"),
    ),
    (
        "guides",
        "leases-and-fencing.html",
        "text/html",
        include_bytes!("../examples/demo/leases-and-fencing.html"),
    ),
    (
        "guides",
        "research-tasks.md",
        "text/markdown",
        include_bytes!("../examples/demo/research-tasks.md"),
    ),
    (
        "notes",
        "deletion-guide.txt",
        "text/plain",
        include_bytes!("../examples/demo/deletion-guide.txt"),
    ),
    (
        "notes",
        "operations.md",
        "text/markdown",
        include_bytes!("../examples/demo/operations.md"),
    ),
];

const QUESTIONS: [&str; 2] = [
    "What happens when the broker says no: a negative confirm, a returned message or a timeout?",
    "How is a worker fenced out after its lease expires?",
];

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Print the summary and stop the workers instead of running until Ctrl-C (the default when
    /// stdin is not a terminal)
    #[arg(long)]
    pub no_wait: bool,
    /// Where the worker processes write their logs
    #[arg(long, default_value = "data/demo")]
    pub log_dir: String,
}

struct Progress(Instant);

impl Progress {
    fn line(&self, msg: impl AsRef<str>) -> String {
        format!(
            "[{:>6.1}s] {}",
            self.0.elapsed().as_secs_f64(),
            msg.as_ref()
        )
    }

    fn say(&self, msg: impl AsRef<str>) {
        println!("{}", self.line(msg));
    }
}

fn fail(what: &str) -> impl Fn(String) -> Failure + '_ {
    move |e| Failure::runtime(format!("demo: {what}: {e}"))
}

/// A worker process of the demo.
struct Worker {
    name: String,
    child: Child,
    http: String,
}

impl Worker {
    fn spawn(
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
    fn stop(&mut self) -> Option<i32> {
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
fn http_addr(preferred: u16) -> String {
    let l = std::net::TcpListener::bind(("127.0.0.1", preferred))
        .or_else(|_| std::net::TcpListener::bind(("127.0.0.1", 0)));
    match l.and_then(|l| l.local_addr()) {
        Ok(a) => a.to_string(),
        Err(_) => "off".into(),
    }
}

pub async fn run(conn: &ConnArgs, args: &DemoArgs) -> Result<(), Failure> {
    let p = Progress(Instant::now());
    let services = conn.services()?;
    let object_store_url = config::object_store(&conn.object_store)?;
    let store = Store::open(&object_store_url)?;
    let pool = db::connect(
        &services.database_url,
        "kfs-worker demo",
        8,
        services.connect_timeout,
    )
    .await
    .map_err(Failure::usage)?;
    db::migrate(&pool)
        .await
        .map_err(|e| fail("migrate")(e.to_string()))?;

    p.say("resetting the demo's own data (tenant kfs-demo)");
    reset(&pool, &store).await.map_err(fail("reset"))?;

    p.say("creating a knowledge space with two sources and five documents");
    let seed = seed(&pool, &store).await.map_err(fail("seed"))?;

    let (http_a, http_b) = (http_addr(9464), http_addr(9465));
    p.say(format!(
        "starting two workers: demo-a (http {http_a}) and demo-b (http {http_b})"
    ));
    let mut a = Worker::spawn(
        "demo-a",
        &services,
        &conn.object_store,
        &http_a,
        &args.log_dir,
    )?;
    let mut b = Worker::spawn(
        "demo-b",
        &services,
        &conn.object_store,
        &http_b,
        &args.log_dir,
    )?;

    // Both workers consume before any work exists: RabbitMQ then hands the compile messages
    // out round-robin, so demo-a holds some of them when it is killed. (Requested earlier, the
    // first worker to connect could take every message and the kill would find nothing.)
    both_consuming(&services, Duration::from_secs(60))
        .await
        .map_err(fail("workers"))?;

    p.say("requesting the compilation of every document");
    let mut attempts = Vec::new();
    for (name, doc) in &seed.documents {
        let mut c = pool
            .acquire()
            .await
            .map_err(|e| fail("db")(e.to_string()))?;
        // Requested by the demo user under its permission snapshot, as the platform's upload
        // records the requester on the attempt.
        let opts = compile::request::RequestOptions {
            defer: false,
            requester: Some(compile::request::Requester {
                subject: SUBJECT.into(),
                snapshot: seed.snapshot,
            }),
        };
        let id = compile::request::request(&mut c, *doc, opts)
            .await
            .map_err(|e| fail("compile request")(e.to_string()))?;
        attempts.push((name.clone(), id));
    }

    // Kill demo-a as soon as it holds a lease, so its work must be taken over.
    let kill = kill_mid_run(&pool, &mut a, &p)
        .await
        .map_err(fail("kill"))?;

    let mut compiled = 0u64;
    let bar = crate::progress::Bar::new(attempts.len() as u64, "compiling");
    for (name, id) in &attempts {
        bar.set(compiled, format!("waiting for {name}"));
        let s = compile::request::wait(&pool, *id, Duration::from_secs(120))
            .await
            .map_err(|e| fail("compile")(e.to_string()))?;
        bar.println(p.line(format!(
            "compiled {name}: {} at {}",
            s.run_state, s.checkpoint
        )));
        if s.run_state != "succeeded" {
            return Err(Failure::runtime(format!(
                "demo: compiling {name} ended {} ({})",
                s.run_state,
                s.last_error_message.unwrap_or_default()
            )));
        }
        compiled += 1;
        bar.set(compiled, "");
    }
    bar.finish();

    p.say("asking two research questions");
    let mut answers = Vec::new();
    for q in QUESTIONS {
        let mut c = pool
            .acquire()
            .await
            .map_err(|e| fail("db")(e.to_string()))?;
        let req = research::request::ResearchRequest::new(seed.space, q, SUBJECT, seed.snapshot);
        let r = research::request::request(&mut c, &req)
            .await
            .map_err(|e| fail("research request")(e.to_string()))?;
        answers.push((q, r.job_id));
    }
    let mut research_results = Vec::new();
    for (q, job) in &answers {
        let (stage, result) = wait_research(&pool, *job, Duration::from_secs(120))
            .await
            .map_err(fail("research"))?;
        p.say(format!("research \"{q}\": {stage}"));
        if stage != "completed" {
            return Err(Failure::runtime(format!("demo: research ended {stage}")));
        }
        research_results.push((q.to_string(), result));
    }

    // Taken before the deletion: like the platform's, a deletion in a space removes the space's
    // research tasks with the rest of its derived data.
    let before = status::read(&pool, &[Kind::Compile, Kind::Research])
        .await
        .map_err(|e| fail("status")(e.to_string()))?;
    let model = read_model(&pool, seed.space)
        .await
        .map_err(fail("read model"))?;

    p.say("deleting the source \"notes\" with its documents");
    let deletion = {
        let mut c = pool
            .acquire()
            .await
            .map_err(|e| fail("db")(e.to_string()))?;
        let req = deletion::request::DeletionRequest {
            tenant_id: TENANT.into(),
            knowledge_space_id: seed.space,
            target: deletion::request::Target::Source {
                id: seed.notes,
                mode: deletion::request::SourceMode::Cascade,
            },
            expected_revision: None,
            requested_by_subject_id: SUBJECT.into(),
            permission_snapshot_id: seed.snapshot,
            access_channel: "interactive".into(),
            idempotency_key: format!("demo-delete-notes-{}", seed.notes),
        };
        deletion::request::request_deletion(&mut c, &req)
            .await
            .map_err(|e| fail("deletion request")(e.to_string()))?
            .job_id
    };
    let removed = wait_deletion(&pool, deletion, Duration::from_secs(120))
        .await
        .map_err(fail("deletion"))?;
    p.say(format!("deletion {}", removed.run_state));
    if removed.run_state != "succeeded" {
        return Err(Failure::runtime(format!(
            "demo: deletion ended {}",
            removed.run_state
        )));
    }

    let after = status::read(&pool, &[Kind::Deletion])
        .await
        .map_err(|e| fail("status")(e.to_string()))?;
    print_summary(
        &before,
        &after,
        &model,
        &research_results,
        &removed,
        &kill,
        &seed,
        &b,
    );

    // Without a terminal to press Ctrl-C in (a script, CI), the demo ends after its summary.
    if args.no_wait || !std::io::IsTerminal::is_terminal(&std::io::stdin()) {
        let code = b.stop();
        p.say(format!(
            "stopped demo-b (exit {})",
            code.map_or("signal".into(), |c| c.to_string())
        ));
        println!(
            "\nThe dashboard and metrics above are served while a worker runs: start one with \
             `kfs-worker run` (same DATABASE_URL and AMQP_URL) and open http://127.0.0.1:9464/, \
             or run the demo in a terminal to keep demo-b up."
        );
        return Ok(());
    }
    println!("\nThe worker demo-b keeps running. Press Ctrl-C to stop it.");
    let _ = tokio::signal::ctrl_c().await;
    let code = b.stop();
    p.say(format!(
        "stopped demo-b (exit {})",
        code.map_or("signal".into(), |c| c.to_string())
    ));
    Ok(())
}

struct Seed {
    space: Uuid,
    notes: Uuid,
    snapshot: Uuid,
    documents: Vec<(String, Uuid)>,
}

async fn seed(pool: &PgPool, store: &Store) -> Result<Seed, String> {
    let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
    let space = platform::create_space(&mut tx, TENANT, "handbook", "Worker handbook", SUBJECT)
        .await
        .map_err(|e| e.to_string())?;
    // The space embeds with the offline embedder's vectors (the workers run KFS_EMBEDDER=offline),
    // so every node gets a dense projection beside its full-text one.
    platform::activate_embedding_profile(
        &mut tx,
        TENANT,
        space,
        "kfs-demo-embedding",
        "offline",
        EMBEDDING_DIMENSION,
    )
    .await
    .map_err(|e| e.to_string())?;
    platform::activate_retrieval_profile(&mut tx, TENANT, space, "kfs-demo-extractive", "offline")
        .await
        .map_err(|e| e.to_string())?;
    let guides = platform::create_source(
        &mut tx,
        space,
        "guides",
        "upload",
        Some(&platform::new_credential_ref()),
    )
    .await
    .map_err(|e| e.to_string())?;
    let notes = platform::create_source(
        &mut tx,
        space,
        "notes",
        "upload",
        Some(&platform::new_credential_ref()),
    )
    .await
    .map_err(|e| e.to_string())?;
    let snapshot =
        platform::create_permission_snapshot(&mut tx, TENANT, space, SUBJECT, "interactive", None)
            .await
            .map_err(|e| e.to_string())?;
    let mut documents = Vec::new();
    for (source, name, mime, bytes) in DOCUMENTS {
        let src = if source == "guides" { guides } else { notes };
        let id = platform::add_document(
            &mut tx,
            store,
            space,
            Some(src),
            name,
            mime,
            Bytes::from_static(bytes),
        )
        .await
        .map_err(|e| e.to_string())?;
        documents.push((name.to_owned(), id));
    }
    tx.commit().await.map_err(|e| e.to_string())?;
    Ok(Seed {
        space,
        notes,
        snapshot,
        documents,
    })
}

/// Removes everything the demo wrote before: its tenant's rows and object keys.
async fn reset(pool: &PgPool, store: &Store) -> Result<(), String> {
    let keys: Vec<String> = sqlx::query_scalar(
        "SELECT d.object_key FROM document_assets d JOIN knowledge_spaces s ON s.id = d.knowledge_space_id \
         WHERE s.tenant_id = $1",
    )
    .bind(TENANT)
    .fetch_all(pool)
    .await
    .map_err(|e| e.to_string())?;
    for k in keys {
        store.delete(&k).await.map_err(|e| e.to_string())?;
    }
    let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
    // Order matters: rows that RESTRICT-reference publications go before the spaces cascade.
    for sql in [
        "DELETE FROM projection_set_publication_heads WHERE tenant_id = $1",
        "DELETE FROM document_compilation_attempts WHERE tenant_id = $1",
        "DELETE FROM legacy_space_publication_bootstraps WHERE tenant_id = $1",
        "DELETE FROM deletion_jobs WHERE tenant_id = $1",
        "DELETE FROM deletion_tombstones WHERE tenant_id = $1",
        "DELETE FROM deletion_retry_audits WHERE tenant_id = $1",
        "DELETE FROM research_task_jobs WHERE tenant_id = $1",
        "DELETE FROM source_secret_lifecycle_refs WHERE tenant_id = $1",
        "DELETE FROM knowledge_spaces WHERE tenant_id = $1",
    ] {
        sqlx::query(sql)
            .bind(TENANT)
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
    }
    tx.commit().await.map_err(|e| e.to_string())
}

/// Waits until two consumers (demo-a's and demo-b's) are on the compile queue.
async fn both_consuming(services: &Services, timeout: Duration) -> Result<(), String> {
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

struct Kill {
    held: usize,
    takeover: Option<Duration>,
}

async fn kill_mid_run(pool: &PgPool, a: &mut Worker, p: &Progress) -> Result<Kill, String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut held: Vec<Uuid> = Vec::new();
    while Instant::now() < deadline {
        held = sqlx::query_scalar(
            "SELECT id FROM document_compilation_attempts WHERE tenant_id = $1 AND worker_id = $2 AND run_state = 'running'",
        )
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
        let still: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM document_compilation_attempts WHERE id = ANY($1) AND worker_id = 'demo-a'",
        )
        .bind(&held)
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

async fn wait_research(
    pool: &PgPool,
    job: Uuid,
    timeout: Duration,
) -> Result<(String, serde_json::Value), String> {
    let start = Instant::now();
    loop {
        let (stage, result): (String, Option<serde_json::Value>) =
            sqlx::query_as("SELECT stage, metadata -> 'result' FROM research_task_jobs WHERE id = $1 AND tenant_id = $2")
                .bind(job)
                .bind(TENANT)
                .fetch_one(pool)
                .await
                .map_err(|e| e.to_string())?;
        if matches!(stage.as_str(), "completed" | "failed" | "canceled")
            || start.elapsed() > timeout
        {
            return Ok((stage, result.unwrap_or_default()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What the compiled documents look like in the platform's read model.
struct ReadModel {
    head_revision: i32,
    documents: i64,
    nodes: i64,
    fts: i64,
    dense: i64,
    dimension: Option<i32>,
}

/// Reads the read model the way the platform's retrieval does: through the head's publication
/// and its members.
async fn read_model(pool: &PgPool, space: Uuid) -> Result<ReadModel, String> {
    let row: (i32, i64, i64, i64, i64, Option<i32>) = sqlx::query_as(
        "SELECT h.head_revision, \
           (SELECT count(DISTINCT m.document_asset_id) FROM projection_set_publication_members m \
              WHERE m.publication_id = h.publication_id), \
           (SELECT count(DISTINCT p.node_id) FROM projection_set_publication_members m \
              JOIN index_projections p ON p.id = m.component_key WHERE m.publication_id = h.publication_id), \
           (SELECT count(*) FROM projection_set_publication_members m JOIN index_projections p ON p.id = m.component_key \
              WHERE m.publication_id = h.publication_id AND p.type = 'fts' AND p.status = 'ready'), \
           (SELECT count(*) FROM projection_set_publication_members m JOIN index_projections p ON p.id = m.component_key \
              WHERE m.publication_id = h.publication_id AND p.type = 'dense-vector' AND p.status = 'ready'), \
           (SELECT max(vector_dims(p.dense_vector)) FROM projection_set_publication_members m \
              JOIN index_projections p ON p.id = m.component_key WHERE m.publication_id = h.publication_id) \
         FROM projection_set_publication_heads h WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2",
    )
    .bind(TENANT)
    .bind(space)
    .fetch_one(pool)
    .await
    .map_err(|e| e.to_string())?;
    Ok(ReadModel {
        head_revision: row.0,
        documents: row.1,
        nodes: row.2,
        fts: row.3,
        dense: row.4,
        dimension: row.5,
    })
}

struct Removed {
    run_state: String,
    items: Vec<(String, i64, i64)>,
    documents_left: i64,
}

async fn wait_deletion(pool: &PgPool, job: Uuid, timeout: Duration) -> Result<Removed, String> {
    let start = Instant::now();
    loop {
        let run_state: String = sqlx::query_scalar(
            "SELECT run_state FROM deletion_jobs WHERE id = $1 AND tenant_id = $2",
        )
        .bind(job)
        .bind(TENANT)
        .fetch_one(pool)
        .await
        .map_err(|e| e.to_string())?;
        if matches!(run_state.as_str(), "succeeded" | "failed" | "canceled")
            || start.elapsed() > timeout
        {
            let items: Vec<(String, i64, i64)> = sqlx::query_as(
                "SELECT kind::text, count(*), count(redacted_at) FROM deletion_job_items WHERE deletion_job_id = $1 \
                 GROUP BY 1 ORDER BY 1",
            )
            .bind(job)
            .fetch_all(pool)
            .await
            .map_err(|e| e.to_string())?;
            let documents_left: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM document_assets d JOIN knowledge_spaces s ON s.id = d.knowledge_space_id \
                 WHERE s.tenant_id = $1",
            )
            .bind(TENANT)
            .fetch_one(pool)
            .await
            .map_err(|e| e.to_string())?;
            return Ok(Removed {
                run_state,
                items,
                documents_left,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[allow(clippy::too_many_arguments)]
fn print_summary(
    before: &status::Status,
    after: &status::Status,
    model: &ReadModel,
    research: &[(String, serde_json::Value)],
    removed: &Removed,
    kill: &Kill,
    seed: &Seed,
    b: &Worker,
) {
    println!("\n== Summary");
    println!("jobs by kind and final state:");
    let line = |k: &status::KindStatus, note: &str| {
        let states: Vec<String> = k.jobs.iter().map(|(s, n)| format!("{s}={n}")).collect();
        println!("  {:<9} {}{note}", k.kind, states.join("  "));
    };
    for k in &before.kinds {
        line(
            k,
            "  (before the deletion, which removes them with the space's derived data)",
        );
    }
    for k in &after.kinds {
        line(k, "");
    }
    let not_done: i64 = before
        .kinds
        .iter()
        .chain(&after.kinds)
        .flat_map(|k| k.jobs.iter())
        .filter(|(s, _)| !matches!(s.as_str(), "succeeded" | "completed"))
        .map(|(_, n)| n)
        .sum();
    println!(
        "  {}",
        if not_done == 0 {
            "all jobs succeeded".to_owned()
        } else {
            format!("{not_done} job(s) did not succeed")
        }
    );
    println!(
        "read model: head revision {}, {} documents, {} nodes with {} ready fts and {} ready dense-vector \
         projections{}",
        model.head_revision,
        model.documents,
        model.nodes,
        model.fts,
        model.dense,
        model.dimension.map(|d| format!(" (dimension {d})")).unwrap_or_default()
    );
    println!("research answers:");
    for (q, r) in research {
        println!("  Q: {q}");
        let answer = r.get("answer").and_then(|a| a.as_str()).unwrap_or("");
        println!("  A: {}", answer.replace('\n', " "));
        let mut cited: Vec<String> = r
            .get("citations")
            .and_then(|c| c.as_array())
            .map(|c| {
                c.iter()
                    .filter_map(|x| x.get("filename")?.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        cited.sort();
        cited.dedup();
        println!(
            "     cites: {}",
            if cited.is_empty() {
                "nothing".into()
            } else {
                cited.join(", ")
            }
        );
    }
    println!("deletion of source \"notes\" ({}):", removed.run_state);
    for (kind, n, redacted) in &removed.items {
        println!("  {kind:<17} {n} removed, {redacted} keys redacted");
    }
    println!(
        "  documents left in the space: {} of {}",
        removed.documents_left,
        seed.documents.len()
    );
    match kill.takeover {
        Some(t) => println!(
            "takeover: demo-a was killed holding {} job(s); demo-b took over in {:.0} ms",
            kill.held,
            t.as_secs_f64() * 1000.0
        ),
        None => println!(
            "takeover: demo-a was killed holding {} job(s); nothing to take over",
            kill.held
        ),
    }
    if b.http != "off" {
        println!("dashboard: http://{}/", b.http);
        println!("metrics:   http://{}/metrics", b.http);
        println!("health:    http://{}/healthz and /readyz", b.http);
    }
}
