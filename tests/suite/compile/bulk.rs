//! Two hundred documents of mixed formats compiled by two worker processes: every one published
//! exactly once, serving exactly its own nodes.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_documents_across_two_worker_processes() {
    const DOCS: usize = 200;
    let fx = Fx::new().await;
    let extra = |id: &'static str| {
        vec![
            ("KFS_OBJECT_STORE", fx.store_url.clone()),
            ("KFS_KINDS", "compile".to_owned()),
            ("KFS_WORKER_ID", id.to_owned()),
            ("KFS_RELAY_POLL", "200ms".to_owned()),
            ("RUST_LOG", "info,kfs_worker=info".to_owned()),
        ]
    };
    let spawn = |id: &'static str| {
        let e = extra(id);
        let e: Vec<(&str, &str)> = e.iter().map(|(k, v)| (*k, v.as_str())).collect();
        fx.env.spawn_worker(id, &["run"], &e)
    };
    let mut workers = [spawn("bulk-1"), spawn("bulk-2")];
    let started = Instant::now();
    let docs = request_generated(&fx, DOCS, "bulkmark").await;
    let requested = started.elapsed();
    let attempts: Vec<Uuid> = docs.iter().map(|d| d.1).collect();
    let done = wait_terminal(&fx, &attempts, Duration::from_secs(240)).await;
    let elapsed = started.elapsed();
    let logs: String = workers
        .iter()
        .map(|w| {
            let t = w.log_text();
            let tail: Vec<&str> = t.lines().rev().take(20).collect();
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        })
        .collect::<Vec<_>>()
        .join("\n---\n");
    assert!(
        done,
        "not every attempt ended: {:?}\n{logs}",
        states(fx.pool()).await
    );
    println!(
        "[compile bulk] {DOCS} documents across 2 workers: {:.2}s in all, {:.1} documents/s \
         ({:.2}s to add and request them while the workers ran)",
        elapsed.as_secs_f64(),
        DOCS as f64 / elapsed.as_secs_f64(),
        requested.as_secs_f64()
    );
    assert_all_published(&fx, &docs).await;
    assert_eq!(fx.served().await.len(), DOCS);
    support::stop_cleanly(&mut workers, Duration::from_secs(20)).await;
    fx.cleanup().await;
}
