//! The kinds that follow a model-driven publish, against real Postgres: the findability
//! evaluation (`quality.page-index-findability`) scores the published outline against the
//! space's golden questions with the layered tree search of the offline reasoning model and
//! writes the platform's evaluation row — `passed`/`layered` when the search finds the labelled
//! evidence, `failed`/`hybrid` with a summary repair queued when it does not, `not-evaluated`
//! with no model call under three usable questions — and the summary repair (`page-index.repair`)
//! leases that row, makes the outline's summaries again from their checkpoints and ends
//! `dispatched`. The crash runs kill real workers in the middle of each and check that their
//! successors finish the same work once.

use std::time::Duration;

use kfs_worker::jobs::findability::{FindabilityKind, Skipped};
use kfs_worker::jobs::repair::RepairKind;
use kfs_worker::jobs::Deps;
use kfs_worker::model::Models;
use kfs_worker::tools::platform;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support;
use crate::support::space::SpaceFx;

const TENANT: &str = "tenant-findability";

/// Three sections whose words do not overlap, and an overview that names them all.
const GUIDE: &[u8] = b"# Saltmere Harbour Guide\n\nThis guide covers the granite quay, diesel \
bunkering and the storm pennant.\n\n## Mooring\n\nVessels moor alongside the granite quay. \
Mooring lines are inspected daily by the dockmaster.\n\n## Fuel\n\nDiesel bunkering happens at \
the eastern pontoon. Fuel pumps accept marine cards only.\n\n## Weather\n\nStorm warnings raise \
the red pennant. Gale forecasts close the harbour mouth.\n";

support::space::space_fixture!(
    /// A space whose retrieval profile names the offline reasoning model.
    Fx
);

#[derive(Debug, sqlx::FromRow)]
struct Row {
    status: String,
    recommended_route: String,
    evaluation: Value,
    summary_repair_state: String,
    summary_repair_attempts: i32,
    summary_repair_error: Option<String>,
    compilation_attempt_id: Uuid,
    outline_id: Uuid,
}

impl Fx {
    async fn new(name: &str) -> Fx {
        let fx = Fx(SpaceFx::new(TENANT, name, "Findability").await);
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::activate_retrieval_profile(
            &mut conn,
            TENANT,
            fx.space,
            "kfs-reasoner",
            "offline",
        )
        .await
        .unwrap();
        platform::activate_embedding_profile(&mut conn, TENANT, fx.space, "e", "openai", 16)
            .await
            .unwrap();
        drop(conn);
        fx
    }

    /// Compiles the guide with the offline model: the attempt and its generation.
    async fn compiled(&self) -> (Uuid, Uuid) {
        let doc = self.add("guide.md", "text/markdown", GUIDE).await;
        let attempt = self.request(doc, false).await.unwrap();
        let s = self
            .drive(
                &self.engine_with("w-find", 64, Deps::offline_models(self.store.clone())),
                attempt,
            )
            .await;
        assert_eq!(s.run_state, "succeeded", "{s:?}");
        (attempt, s.publication_generation_id)
    }

    /// The shortest knowledge node of the generation that holds `word`.
    async fn evidence(&self, generation: Uuid, word: &str) -> String {
        let id: Option<Uuid> = sqlx::query_scalar(
            "SELECT id FROM knowledge_nodes WHERE knowledge_space_id = $1 AND publication_generation_id = $2 \
               AND text LIKE '%' || $3 || '%' ORDER BY end_offset - start_offset LIMIT 1",
        )
        .bind(self.space)
        .bind(generation)
        .bind(word)
        .fetch_optional(self.pool())
        .await
        .unwrap();
        id.unwrap_or_else(|| panic!("no node of the generation holds {word}"))
            .to_string()
    }

    async fn question(&self, text: &str, evidence: &[String]) {
        sqlx::query(
            "INSERT INTO golden_questions (id, created_at, expected_evidence_ids, knowledge_space_id, metadata, \
               question, tags, updated_at) VALUES ($1, now(), $2, $3, '{}', $4, '[]', now())",
        )
        .bind(Uuid::new_v4())
        .bind(json!(evidence))
        .bind(self.space)
        .bind(text)
        .execute(self.pool())
        .await
        .unwrap();
    }

    async fn row(&self) -> Option<Row> {
        sqlx::query_as(
            "SELECT status::text AS status, recommended_route::text AS recommended_route, evaluation, \
               summary_repair_state::text AS summary_repair_state, summary_repair_attempts, \
               summary_repair_error::text AS summary_repair_error, compilation_attempt_id, outline_id \
             FROM page_index_findability_evaluations WHERE knowledge_space_id = $1",
        )
        .bind(self.space)
        .fetch_optional(self.pool())
        .await
        .unwrap()
    }

    /// Evaluates the attempt in this process; another process may have done it first (their
    /// rows are the same: the offline model is deterministic). The model calls made here, if any.
    async fn evaluate(&self, attempt: Uuid) -> Option<usize> {
        match FindabilityKind::new(Models::offline())
            .evaluate(self.pool(), attempt)
            .await
        {
            Ok(e) => Some(e.calls),
            Err(Skipped::Busy) => None,
            Err(Skipped::Failed(e)) => panic!("the evaluation failed: {e:?}"),
        }
    }

    async fn summary_checkpoints(&self, generation: Uuid) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM document_outline_summary_checkpoints \
             WHERE knowledge_space_id = $1 AND publication_generation_id = $2",
        )
        .bind(self.space)
        .bind(generation)
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    /// Waits until the space's evaluation row satisfies `f`.
    async fn wait_row(&self, what: &str, f: impl Fn(&Row) -> bool) -> Row {
        for _ in 0..300 {
            if let Some(r) = self.row().await {
                if f(&r) {
                    return r;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("{what}: {:?}", self.row().await);
    }

    async fn cleanup(self) {
        self.0.cleanup().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn golden_questions_found_by_the_layered_search_pass_and_route_layered() {
    let fx = Fx::new("find-pass").await;
    let (attempt, g) = fx.compiled().await;
    for (q, word) in [
        ("granite quay mooring lines", "dockmaster"),
        ("diesel bunkering pontoon pumps", "pontoon"),
        ("storm pennant gale forecasts", "Gale"),
    ] {
        let e = fx.evidence(g, word).await;
        fx.question(q, &[e]).await;
    }
    if let Some(calls) = fx.evaluate(attempt).await {
        assert!(
            calls >= 3,
            "each question is searched by the model: {calls} calls"
        );
    }
    let r = fx.wait_row("the evaluation is written", |_| true).await;
    assert_eq!(
        (r.status.as_str(), r.recommended_route.as_str()),
        ("passed", "layered"),
        "{r:?}"
    );
    assert_eq!(r.compilation_attempt_id, attempt);
    let e = &r.evaluation;
    assert_eq!(e["evaluatorVersion"], "pageindex-layered-findability-v1");
    assert_eq!(e["promptVersion"], "pageindex-layered-tree-search-v1");
    assert_eq!(e["sampleCount"], 3);
    assert_eq!(e["topK"], 5);
    assert_eq!(e["recallAtK"], 1.0, "{e}");
    assert_eq!(e["meanReciprocalRank"], 1.0, "{e}");
    assert_eq!(e["pathRecallAtK"], 1.0, "{e}");
    assert_eq!(e["summaryRepairRequested"], false);
    assert_eq!(e["model"]["model"], "kfs-reasoner");
    assert_eq!(r.summary_repair_state, "not-requested");
    // Evaluated once: the attempt is no longer due.
    let due = FindabilityKind::new(Models::offline())
        .due(fx.pool())
        .await
        .unwrap();
    assert!(!due.contains(&attempt));
    let outline: Uuid =
        sqlx::query_scalar("SELECT id FROM document_outlines WHERE publication_generation_id = $1")
            .bind(g)
            .fetch_one(fx.pool())
            .await
            .unwrap();
    assert_eq!(r.outline_id, outline);
    // Status counts the evaluations by verdict.
    let st = kfs_worker::status::read(fx.pool(), &[]).await.unwrap();
    let find = st
        .leased
        .iter()
        .find(|l| l.kind == "findability")
        .expect("findability in status");
    assert!(
        find.jobs.get("passed").copied().unwrap_or(0) >= 1,
        "{find:?}"
    );
    assert!(kfs_worker::status::render(&st).contains("findability (leased)"));
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_evaluation_queues_one_repair_that_reuses_every_summary_checkpoint() {
    let fx = Fx::new("find-fail").await;
    let (attempt, g) = fx.compiled().await;
    // Each question's words lead to another section than its evidence.
    let (mooring, fuel, weather) = (
        fx.evidence(g, "dockmaster").await,
        fx.evidence(g, "pontoon").await,
        fx.evidence(g, "Gale").await,
    );
    fx.question(
        "diesel bunkering pontoon pumps",
        std::slice::from_ref(&mooring),
    )
    .await;
    fx.question("storm pennant gale forecasts", std::slice::from_ref(&fuel))
        .await;
    fx.question("granite quay mooring lines", std::slice::from_ref(&weather))
        .await;
    fx.evaluate(attempt).await;
    let r = fx.wait_row("the evaluation is written", |_| true).await;
    assert_eq!(
        (r.status.as_str(), r.recommended_route.as_str()),
        ("failed", "hybrid"),
        "{r:?}"
    );
    assert_eq!(r.evaluation["recallAtK"], 0.0);
    assert_eq!(r.evaluation["summaryRepairRequested"], true);
    assert!(
        ["queued", "leased", "dispatched"].contains(&r.summary_repair_state.as_str()),
        "{r:?}"
    );
    let before = fx.summary_checkpoints(g).await;
    assert!(before > 0);
    // The repair: this process's, unless another worker took it first.
    let repaired = RepairKind::new(Models::offline())
        .run_due(fx.pool(), "w-repair")
        .await
        .unwrap();
    for rep in &repaired {
        assert_eq!(rep.state, "dispatched", "{rep:?}");
        assert_eq!(rep.calls, 0, "every summary had its checkpoint: {rep:?}");
    }
    let r = fx
        .wait_row("the repair is dispatched", |r| {
            r.summary_repair_state == "dispatched"
        })
        .await;
    assert_eq!(r.summary_repair_attempts, 1);
    assert_eq!(r.summary_repair_error, None);
    assert_eq!(
        fx.summary_checkpoints(g).await,
        before,
        "a repair publishes nothing new"
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fewer_than_three_usable_questions_are_not_evaluated_and_call_no_model() {
    let fx = Fx::new("find-few").await;
    let (attempt, g) = fx.compiled().await;
    let e = fx.evidence(g, "dockmaster").await;
    fx.question("granite quay mooring lines", std::slice::from_ref(&e))
        .await;
    fx.question(
        "a question whose evidence is elsewhere",
        &[Uuid::new_v4().to_string()],
    )
    .await;
    fx.question(
        "a question with an evidence id that is no node",
        &["not-a-node".into()],
    )
    .await;
    if let Some(calls) = fx.evaluate(attempt).await {
        assert_eq!(calls, 0);
    }
    let r = fx.wait_row("the evaluation is written", |_| true).await;
    assert_eq!(
        (r.status.as_str(), r.recommended_route.as_str()),
        ("not-evaluated", "unchanged")
    );
    assert_eq!(r.evaluation["sampleCount"], 1);
    assert_eq!(r.summary_repair_state, "not-requested");
    fx.cleanup().await;
}

#[cfg(feature = "crash-points")]
mod crash {
    use super::*;

    fn counter(body: &str, metric: &str, filter: &str) -> f64 {
        body.lines()
            .filter(|l| l.starts_with(metric) && l.contains(filter))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    fn spawn(fx: &Fx, id: &str, extra: &[(&str, String)]) -> support::Worker {
        let mut e = vec![
            ("KFS_OBJECT_STORE", fx.store_url.clone()),
            ("KFS_WORKER_ID", id.to_owned()),
            ("KFS_LEASED_POLL", "100ms".to_owned()),
            ("KFS_REASONER", "offline".to_owned()),
            ("KFS_EMBEDDER", "offline".to_owned()),
        ];
        e.extend(extra.iter().map(|(k, v)| (*k, v.clone())));
        let e: Vec<(&str, &str)> = e.iter().map(|(k, v)| (*k, v.as_str())).collect();
        fx.env.spawn_worker(id, &["run"], &e)
    }

    /// Worker A dies after its first findability model answer, before anything is written;
    /// worker B evaluates the attempt once, with the verdict the search gives uninterrupted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_worker_killed_in_the_middle_of_an_evaluation_leaves_it_to_a_successor() {
        let fx = Fx::new("find-crash").await;
        let (attempt, g) = fx.compiled().await;
        for (q, word) in [
            ("granite quay mooring lines", "dockmaster"),
            ("diesel bunkering pontoon pumps", "pontoon"),
            ("storm pennant gale forecasts", "Gale"),
        ] {
            let e = fx.evidence(g, word).await;
            fx.question(q, &[e]).await;
        }
        let mut a = spawn(
            &fx,
            "find-a",
            &[("KFS_CRASH_AT", "findability-after-model-call:1".into())],
        );
        let status = a.wait_exit(Duration::from_secs(90));
        assert!(
            status.is_some_and(|s| !s.success()),
            "A did not die after a findability answer: {status:?}\n{}",
            a.log_text()
        );
        let mut b = spawn(&fx, "find-b", &[]);
        let r = fx.wait_row("B writes the evaluation", |_| true).await;
        assert_eq!(r.compilation_attempt_id, attempt);
        assert_eq!(
            (r.status.as_str(), r.recommended_route.as_str()),
            ("passed", "layered"),
            "{r:?}"
        );
        assert_eq!(r.evaluation["sampleCount"], 3);
        let rows: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM page_index_findability_evaluations WHERE knowledge_space_id = $1",
        )
        .bind(fx.space)
        .fetch_one(fx.pool())
        .await
        .unwrap();
        assert_eq!(rows, 1, "one evaluation per generation and evaluator");
        support::stop_cleanly([&mut b], Duration::from_secs(20)).await;
        drop(a);
        fx.cleanup().await;
    }

    /// A repair whose outline lost two summary checkpoints: worker A dies right after the first
    /// one is made again; worker B takes the lease over at once (A's liveness lock is gone),
    /// asks only for the one still missing, and dispatches the repair on its second attempt.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_worker_killed_in_the_middle_of_a_repair_leaves_only_the_missing_summary_to_a_successor(
    ) {
        let fx = Fx::new("repair-crash").await;
        let (attempt, g) = fx.compiled().await;
        let (mooring, fuel, weather) = (
            fx.evidence(g, "dockmaster").await,
            fx.evidence(g, "pontoon").await,
            fx.evidence(g, "Gale").await,
        );
        // Two summaries lose their checkpoints before the failed evaluation queues the repair.
        let all = fx.summary_checkpoints(g).await;
        let removed = sqlx::query(
            "DELETE FROM document_outline_summary_checkpoints WHERE (publication_generation_id, outline_node_id) IN \
               (SELECT publication_generation_id, outline_node_id FROM document_outline_summary_checkpoints \
                WHERE knowledge_space_id = $1 AND publication_generation_id = $2 \
                ORDER BY outline_node_id LIMIT 2)",
        )
        .bind(fx.space)
        .bind(g)
        .execute(fx.pool())
        .await
        .unwrap()
        .rows_affected();
        assert_eq!(removed, 2, "removed {removed} summary checkpoints of {all}");
        fx.question(
            "diesel bunkering pontoon pumps",
            std::slice::from_ref(&mooring),
        )
        .await;
        fx.question("storm pennant gale forecasts", std::slice::from_ref(&fuel))
            .await;
        fx.question("granite quay mooring lines", std::slice::from_ref(&weather))
            .await;
        fx.evaluate(attempt).await;
        let r = fx.wait_row("the evaluation is written", |_| true).await;
        assert_eq!(r.status, "failed", "{r:?}");
        let mut a = spawn(
            &fx,
            "repair-a",
            &[("KFS_CRASH_AT", "repair-after-model-checkpoint:1".into())],
        );
        let status = a.wait_exit(Duration::from_secs(90));
        assert!(
            status.is_some_and(|s| !s.success()),
            "A did not die after a repaired summary: {status:?}\n{}",
            a.log_text()
        );
        let at_death = fx.summary_checkpoints(g).await;
        assert_eq!(
            at_death,
            all - removed as i64 + 1,
            "A made one summary again before it died"
        );
        let held = fx.row().await.unwrap();
        assert_eq!(
            (
                held.summary_repair_state.as_str(),
                held.summary_repair_attempts
            ),
            ("leased", 1)
        );
        let addr = support::free_port();
        let mut b = spawn(&fx, "repair-b", &[("KFS_HTTP_ADDR", addr.to_string())]);
        let r = fx
            .wait_row("B dispatches the repair", |r| {
                r.summary_repair_state == "dispatched"
            })
            .await;
        assert_eq!(
            r.summary_repair_attempts, 2,
            "B's claim is the second attempt"
        );
        assert_eq!(
            fx.summary_checkpoints(g).await,
            all,
            "every summary has its checkpoint again"
        );
        let (code, body) = support::http_get(addr, "/metrics").await;
        assert_eq!(code, 200);
        let calls = counter(
            &body,
            "kfs_model_calls_total",
            "purpose=\"summary\",outcome=\"ok\"",
        ) + counter(
            &body,
            "kfs_model_calls_total",
            "outcome=\"ok\",purpose=\"summary\"",
        );
        assert_eq!(
            calls,
            (all - at_death) as f64,
            "B asked only for the summaries still missing"
        );
        support::stop_cleanly([&mut b], Duration::from_secs(20)).await;
        drop(a);
        fx.cleanup().await;
    }
}
