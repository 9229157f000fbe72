//! `kfs-worker demo`: the main job end to end on real services. It writes only its own tenant
//! (`kfs-demo`): a space, two sources and seven documents (a PDF and a Word document among
//! them) shipped in the binary; it compiles them, asks two research questions, deletes one
//! source, and kills one of its two worker processes mid-run to show the other take over.
//! Invariant: it resets its own demo data, never anything else, so running it twice works.
//!
//! By concern: `seed` writes and resets the demo's data, `workers` starts, kills and watches
//! the worker processes, and `summary` waits for the jobs and prints what they left.

mod seed;
mod summary;
mod workers;

use std::time::{Duration, Instant};

use crate::command::{ConnArgs, Failure};
use crate::config;
use crate::jobs::{compile, deletion, research, Kind};
use crate::{db, status, store::Store};
use summary::{print_summary, read_model, read_semantic, wait_deletion, wait_research};
use workers::{both_consuming, http_addr, kill_mid_run, Worker};

pub const TENANT: &str = "kfs-demo";
const SUBJECT: &str = "demo-user";

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
    seed::reset(&pool, &store).await.map_err(fail("reset"))?;

    p.say("creating a knowledge space with two sources and seven documents (Markdown, HTML, text, a PDF, a Word file), and a second one whose retrieval profile names a reasoning model (the offline model)");
    let seed = seed::seed(&pool, &store).await.map_err(fail("seed"))?;

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
            grant: None,
        };
        let id = compile::request::request(&mut c, *doc, opts)
            .await
            .map_err(|e| fail("compile request")(e.to_string()))?;
        attempts.push((name.clone(), id));
    }
    for (name, doc) in &seed.reasoning_documents {
        let mut c = pool
            .acquire()
            .await
            .map_err(|e| fail("db")(e.to_string()))?;
        let id = compile::request::request(&mut c, *doc, Default::default())
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
    let semantic = read_semantic(&pool, seed.reasoning)
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
        &semantic,
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
