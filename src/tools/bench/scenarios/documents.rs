//! Scenario `documents`: a corpus of PDFs (the twelve reports shipped in the binary) through the
//! local PDF parser, through poppler's `pdftotext` (the tool a user might pick instead), both on
//! every core in the same run, and compiled by the worker into published knowledge. Invariant:
//! each run counts pages only of documents that came through (a parse that failed counts none;
//! a compile counts only when its attempt succeeded), and the parse runs read the same bytes
//! the same number of times.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::json;

use super::{run_options, wait_for, with_runtime, Params};
use crate::config;
use crate::jobs::compile::{self, parse};
use crate::jobs::Kind;
use crate::store::Store;
use crate::tools::bench::env::BenchEnv;
use crate::tools::bench::report::{Progress, Report, Run};
use crate::tools::platform;

const TENANT: &str = "kfs-bench";
const SUBJECT: &str = "bench-user";

/// The corpus: generated reports of 8 to 25 pages (`ops/make-document-fixtures`).
const CORPUS: [(&str, &[u8]); 12] = [
    (
        "report-01.pdf",
        include_bytes!("../../../../tests/fixtures/documents/corpus/report-01.pdf"),
    ),
    (
        "report-02.pdf",
        include_bytes!("../../../../tests/fixtures/documents/corpus/report-02.pdf"),
    ),
    (
        "report-03.pdf",
        include_bytes!("../../../../tests/fixtures/documents/corpus/report-03.pdf"),
    ),
    (
        "report-04.pdf",
        include_bytes!("../../../../tests/fixtures/documents/corpus/report-04.pdf"),
    ),
    (
        "report-05.pdf",
        include_bytes!("../../../../tests/fixtures/documents/corpus/report-05.pdf"),
    ),
    (
        "report-06.pdf",
        include_bytes!("../../../../tests/fixtures/documents/corpus/report-06.pdf"),
    ),
    (
        "report-07.pdf",
        include_bytes!("../../../../tests/fixtures/documents/corpus/report-07.pdf"),
    ),
    (
        "report-08.pdf",
        include_bytes!("../../../../tests/fixtures/documents/corpus/report-08.pdf"),
    ),
    (
        "report-09.pdf",
        include_bytes!("../../../../tests/fixtures/documents/corpus/report-09.pdf"),
    ),
    (
        "report-10.pdf",
        include_bytes!("../../../../tests/fixtures/documents/corpus/report-10.pdf"),
    ),
    (
        "report-11.pdf",
        include_bytes!("../../../../tests/fixtures/documents/corpus/report-11.pdf"),
    ),
    (
        "report-12.pdf",
        include_bytes!("../../../../tests/fixtures/documents/corpus/report-12.pdf"),
    ),
];

/// How many times the parse runs read the corpus.
const ROUNDS: usize = 3;
/// How many copies of the corpus the compile run uploads.
const COPIES: usize = 2;

/// The pages of a parse: its highest page number.
fn pages_of(raw: &[parse::raw::RawElement]) -> u64 {
    raw.iter()
        .filter_map(|e| e.metadata.page_number)
        .max()
        .map_or(0, |p| u64::try_from(p).unwrap_or(0))
}

/// Runs `work` over every (round, document) on one blocking thread per core; returns the
/// pages it counted and the seconds it took.
async fn on_every_core<F>(work: F) -> Result<(u64, f64), String>
where
    F: Fn(usize) -> Result<u64, String> + Send + Sync + 'static,
{
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let items = ROUNDS * CORPUS.len();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let work = Arc::new(work);
    let started = Instant::now();
    let mut threads = Vec::with_capacity(cores);
    for _ in 0..cores {
        let (next, work) = (next.clone(), work.clone());
        threads.push(tokio::task::spawn_blocking(move || {
            let mut pages = 0u64;
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= items {
                    return Ok::<u64, String>(pages);
                }
                pages += work(i % CORPUS.len())?;
            }
        }));
    }
    let mut pages = 0;
    for t in threads {
        pages += t.await.map_err(|e| e.to_string())??;
    }
    Ok((pages, started.elapsed().as_secs_f64()))
}

/// The corpus through `pdftotext` (one process per document, as a user would run it), pages
/// counted by its page breaks; `Err` names why it could not run.
async fn pdftotext(dir: &Path) -> Result<(u64, f64), String> {
    let tool = std::env::var("KFS_BENCH_PDFTOTEXT").unwrap_or_else(|_| "pdftotext".into());
    let version = std::process::Command::new(&tool).arg("-v").output();
    if version.is_err() {
        return Err(format!(
            "{tool} is not installed (Debian: apt-get install poppler-utils)"
        ));
    }
    let dir = dir.to_owned();
    on_every_core(move |i| {
        let out = std::process::Command::new(&tool)
            .arg("-q")
            .arg(dir.join(CORPUS[i].0))
            .arg("-")
            .output()
            .map_err(|e| format!("{tool}: {e}"))?;
        if !out.status.success() {
            return Err(format!("{tool} failed on {}", CORPUS[i].0));
        }
        Ok(out.stdout.iter().filter(|b| **b == 0x0c).count() as u64)
    })
    .await
}

/// The reasoning model the model-driven run's space selects.
const REASONER: &str = "kfs-bench-reasoner";

/// The model answers a model-driven compile checkpointed.
#[derive(Clone, Copy, Debug, Default)]
struct Calls {
    windows: u64,
    summaries: u64,
    /// The most answers one document needed.
    most: u64,
}

/// The corpus, `COPIES` times over, committed at once into a new space (whose retrieval
/// profile selects `reasoner`, if given) and compiled by the worker: the pages of the documents
/// whose attempts succeeded, the seconds from the commit to the last end, and the model answers.
async fn compile_corpus(
    env: &BenchEnv,
    p: &Params,
    store: &Store,
    store_url: &str,
    pages_each: &[u64],
    reasoner: Option<&str>,
) -> Result<(u64, f64, Calls), String> {
    let opts = run_options(env, vec![Kind::Compile], p, store_url)?;
    let queue = env.topology.queue(Kind::Compile);
    let (space, docs) = {
        let mut tx = env.pool.begin().await.map_err(|e| e.to_string())?;
        let slug = if reasoner.is_some() {
            "pdfs-models"
        } else {
            "pdfs"
        };
        let space = platform::create_space(&mut tx, TENANT, slug, "PDF corpus", SUBJECT)
            .await
            .map_err(|e| e.to_string())?;
        if let Some(model) = reasoner {
            platform::activate_retrieval_profile(&mut tx, TENANT, space, model, "offline")
                .await
                .map_err(|e| e.to_string())?;
        }
        let mut docs = Vec::new();
        for copy in 0..COPIES {
            for (i, (name, bytes)) in CORPUS.iter().enumerate() {
                let id = platform::add_document(
                    &mut tx,
                    store,
                    space,
                    None,
                    &format!("{copy}-{name}"),
                    "application/pdf",
                    Bytes::from_static(bytes),
                )
                .await
                .map_err(|e| e.to_string())?;
                docs.push((id, pages_each[i]));
            }
        }
        tx.commit().await.map_err(|e| e.to_string())?;
        (space, docs)
    };
    let label = if reasoner.is_some() {
        "compile PDFs, model-driven"
    } else {
        "compile PDFs"
    };
    with_runtime(opts, async {
        env.wait_consumers(&queue, 1, Duration::from_secs(60)).await?;
        let mut tx = env.pool.begin().await.map_err(|e| e.to_string())?;
        let mut attempts = Vec::with_capacity(docs.len());
        for (d, _) in &docs {
            attempts.push(
                compile::request::request(&mut tx, *d, compile::request::RequestOptions::default())
                    .await
                    .map_err(|e| format!("compile request: {e}"))?,
            );
        }
        tx.commit().await.map_err(|e| e.to_string())?;
        let started = Instant::now();
        let n = attempts.len() as u64;
        let progress = Progress::new(label, n, p.interactive);
        let count = "SELECT count(*) FILTER (WHERE run_state = 'succeeded'), \
               count(*) FILTER (WHERE run_state IN ('succeeded', 'failed', 'canceled', 'superseded')) \
             FROM document_compilation_attempts WHERE id = ANY($1)";
        let finished = wait_for(n, &progress, Duration::from_millis(20), || async {
            let (_, fin): (i64, i64) = sqlx::query_as(count)
                .bind(&attempts)
                .fetch_one(&env.pool)
                .await
                .map_err(|e| e.to_string())?;
            Ok(fin as u64)
        })
        .await?;
        let secs = started.elapsed().as_secs_f64();
        progress.finish(finished);
        let succeeded: Vec<bool> = sqlx::query_scalar(
            "SELECT a.run_state = 'succeeded' FROM unnest($1::uuid[]) WITH ORDINALITY AS i(id, n) \
             JOIN document_compilation_attempts a ON a.id = i.id ORDER BY i.n",
        )
        .bind(&attempts)
        .fetch_all(&env.pool)
        .await
        .map_err(|e| e.to_string())?;
        // Pages of the documents whose attempts succeeded.
        let done: u64 = succeeded
            .iter()
            .zip(&docs)
            .filter(|(ok, _)| **ok)
            .map(|(_, (_, pages))| pages)
            .sum();
        let (windows, summaries, most): (i64, i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM document_semantic_window_checkpoints WHERE knowledge_space_id = $1), \
               (SELECT count(*) FROM document_outline_summary_checkpoints WHERE knowledge_space_id = $1), \
               (SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM ( \
                  SELECT document_asset_id FROM document_semantic_window_checkpoints WHERE knowledge_space_id = $1 \
                  UNION ALL SELECT document_asset_id FROM document_outline_summary_checkpoints \
                  WHERE knowledge_space_id = $1) a GROUP BY document_asset_id) b)",
        )
        .bind(space)
        .fetch_one(&env.pool)
        .await
        .map_err(|e| e.to_string())?;
        let calls = Calls {
            windows: u64::try_from(windows).unwrap_or(0),
            summaries: u64::try_from(summaries).unwrap_or(0),
            most: u64::try_from(most).unwrap_or(0),
        };
        Ok((done, secs, calls))
    })
    .await
}

/// The documents scenario.
pub async fn documents(env: &BenchEnv, p: &Params) -> Result<Report, String> {
    let dir = std::env::temp_dir().join(format!("kfs-bench-{}", env.tag));
    let corpus_dir = dir.join("corpus");
    std::fs::create_dir_all(&corpus_dir).map_err(|e| format!("corpus directory: {e}"))?;
    for (name, bytes) in CORPUS {
        std::fs::write(corpus_dir.join(name), bytes).map_err(|e| format!("{name}: {e}"))?;
    }
    let pages_each: Vec<u64> = CORPUS
        .iter()
        .map(|(_, b)| parse::pdf::parse_pdf(b).map(|r| pages_of(&r)).unwrap_or(0))
        .collect();
    let corpus_pages: u64 = pages_each.iter().sum();

    let mut runs = Vec::new();
    let (pages, secs) = on_every_core(|i| {
        parse::pdf::parse_pdf(CORPUS[i].1)
            .map(|r| pages_of(&r))
            .map_err(|e| format!("{}: {e}", CORPUS[i].0))
    })
    .await?;
    let total = corpus_pages * ROUNDS as u64;
    runs.push(Run::new("local PDF parser", total, pages, secs, "pages/s"));
    let peer_note = match pdftotext(&corpus_dir).await {
        Ok((pages, secs)) => {
            runs.push(Run::new(
                "pdftotext (poppler)",
                total,
                pages,
                secs,
                "pages/s",
            ));
            None
        }
        Err(why) => Some(why),
    };

    // The worker: the corpus, twice over, committed at once into one space and compiled
    // through the local parser, from that commit to the last attempt that succeeded; then the
    // same into a space whose retrieval profile names a reasoning model (the offline model), so
    // the model-driven walk is measured beside the deterministic one in the same run.
    let store_url = format!("file://{}", dir.join("store").display());
    std::fs::create_dir_all(dir.join("store")).map_err(|e| format!("object store: {e}"))?;
    let store = Store::open(&config::object_store(&store_url).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let plain = compile_corpus(env, p, &store, &store_url, &pages_each, None).await;
    let models = match plain {
        Ok(_) => {
            Some(compile_corpus(env, p, &store, &store_url, &pages_each, Some(REASONER)).await)
        }
        Err(_) => None,
    };
    let _ = std::fs::remove_dir_all(&dir);
    let (done, secs, _) = plain?;
    let total = corpus_pages * COPIES as u64;
    runs.push(Run::new(
        "compile (local parser)",
        total,
        done,
        secs,
        "pages/s",
    ));
    let (done, secs, calls) = models.expect("run after the plain compile")?;
    runs.push(Run::new(
        "compile, model-driven (offline model)",
        total,
        done,
        secs,
        "pages/s",
    ));
    let documents = (CORPUS.len() * COPIES) as f64;
    let limits = crate::model::config(|k| std::env::var(k).ok())
        .map_err(|e| e.to_string())?
        .1;
    Ok(Report::of_runs(
        "documents",
        "pages/s",
        runs,
        json!({
            "documents": CORPUS.len(),
            "pages": corpus_pages,
            "parse_rounds": ROUNDS,
            "compile_copies": COPIES,
            "cores": std::thread::available_parallelism().map_or(1, usize::from),
            "pdftotext": peer_note.unwrap_or_else(|| "ran".into()),
            "model_calls_per_document": {
                "windows": calls.windows as f64 / documents,
                "summaries": calls.summaries as f64 / documents,
                "most_in_one_document": calls.most,
                "budget_requests_per_document": limits.document_requests,
                "gate": limits.concurrency,
            },
        }),
    ))
}
