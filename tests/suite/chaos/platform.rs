//! The platform's own kinds in the chaos mix: a space of Markdown documents compiled, researched
//! and deleted through the library's request functions while the faults run, next to the probe
//! jobs. Invariant under test: whatever failed when, every compile ends succeeded with its
//! outline, page index and nodes written once and its document published, every research task
//! completes with contiguous progress and each stage entered once (a stage-changed event with
//! `previousStage`; the platform's claim and retry events repeat the current stage), every
//! deletion completes and leaves no row of its document, and no walk ever goes backwards.
//!
//! A deletion in a space removes, as the platform's does, the space's research tasks and the
//! compile attempts whose candidates served the deleted document: a research task or an attempt
//! requested before a deletion may therefore be gone (or a research task canceled) at the end;
//! one requested after the last deletion may not.
//!
//! The requests are the platform's, in its transactions; the only change the harness makes is
//! to give each job 100 execution attempts (in the request's own transaction), as the probe
//! jobs get, so that a job killed with its worker five times is not a legitimate failure.

use std::time::Duration;

use kfs_worker::jobs::{compile, deletion, research};
use kfs_worker::store::Store;
use kfs_worker::tools::platform::{self, NotesSpace};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::{Connection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const TENANT: &str = "tenant-chaos";
const SUBJECT: &str = "user-chaos";
/// Documents of the space; the first half is never deleted, so research always has sources.
const DOCUMENTS: usize = 24;

/// Observers on the platform's tables, as for the probe kind: claims, ends of leases, walks
/// (checkpoint or stage) and outbox writes, recorded in the transaction that makes them.
pub const OBSERVERS: &str = r#"
CREATE TABLE chaos_walks (
  id BIGSERIAL PRIMARY KEY, kind TEXT NOT NULL, job_id UUID NOT NULL, old_cp TEXT NOT NULL, new_cp TEXT NOT NULL);
CREATE FUNCTION chaos_walk() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
  INSERT INTO chaos_walks (kind, job_id, old_cp, new_cp)
  VALUES (TG_ARGV[0], NEW.id, to_jsonb(OLD) ->> TG_ARGV[1], to_jsonb(NEW) ->> TG_ARGV[1]);
  RETURN NULL;
END $f$;
CREATE TRIGGER chaos_walk AFTER UPDATE OF checkpoint ON document_compilation_attempts FOR EACH ROW
  WHEN (NEW.checkpoint IS DISTINCT FROM OLD.checkpoint) EXECUTE FUNCTION chaos_walk('compile', 'checkpoint');
CREATE TRIGGER chaos_walk AFTER UPDATE OF stage ON research_task_jobs FOR EACH ROW
  WHEN (NEW.stage IS DISTINCT FROM OLD.stage) EXECUTE FUNCTION chaos_walk('research', 'stage');
CREATE FUNCTION chaos_outbox_of() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
  INSERT INTO chaos_outbox (job_id, old_status, status, queue_job_id)
  VALUES ((to_jsonb(NEW) ->> TG_ARGV[0])::uuid, OLD.status, NEW.status, NEW.queue_job_id);
  RETURN NULL;
END $f$;
CREATE TRIGGER chaos_outbox AFTER UPDATE ON document_compilation_outbox FOR EACH ROW
  WHEN (NEW.status IS DISTINCT FROM OLD.status OR NEW.queue_job_id IS DISTINCT FROM OLD.queue_job_id
        OR NEW.updated_at IS DISTINCT FROM OLD.updated_at)
  EXECUTE FUNCTION chaos_outbox_of('attempt_id');
CREATE TRIGGER chaos_outbox AFTER UPDATE ON deletion_outbox FOR EACH ROW
  WHEN (NEW.status IS DISTINCT FROM OLD.status OR NEW.queue_job_id IS DISTINCT FROM OLD.queue_job_id
        OR NEW.updated_at IS DISTINCT FROM OLD.updated_at)
  EXECUTE FUNCTION chaos_outbox_of('deletion_job_id');
CREATE TRIGGER chaos_outbox AFTER UPDATE ON research_task_outbox FOR EACH ROW
  WHEN (NEW.status IS DISTINCT FROM OLD.status OR NEW.queue_job_id IS DISTINCT FROM OLD.queue_job_id
        OR NEW.updated_at IS DISTINCT FROM OLD.updated_at)
  EXECUTE FUNCTION chaos_outbox_of('research_task_job_id');
CREATE TRIGGER chaos_claim AFTER UPDATE OF lease_token ON document_compilation_attempts FOR EACH ROW
  WHEN (NEW.lease_token IS NOT NULL AND NEW.lease_token IS DISTINCT FROM OLD.lease_token)
  EXECUTE FUNCTION chaos_claim();
CREATE TRIGGER chaos_claim AFTER UPDATE OF lease_token ON deletion_jobs FOR EACH ROW
  WHEN (NEW.lease_token IS NOT NULL AND NEW.lease_token IS DISTINCT FROM OLD.lease_token)
  EXECUTE FUNCTION chaos_claim();
CREATE TRIGGER chaos_claim AFTER UPDATE OF lease_token ON research_task_jobs FOR EACH ROW
  WHEN (NEW.lease_token IS NOT NULL AND NEW.lease_token IS DISTINCT FROM OLD.lease_token)
  EXECUTE FUNCTION chaos_claim();
CREATE TRIGGER chaos_end AFTER UPDATE OF lease_token ON document_compilation_attempts FOR EACH ROW
  WHEN (OLD.lease_token IS NOT NULL AND NEW.lease_token IS NULL) EXECUTE FUNCTION chaos_end();
CREATE TRIGGER chaos_end AFTER UPDATE OF lease_token ON deletion_jobs FOR EACH ROW
  WHEN (OLD.lease_token IS NOT NULL AND NEW.lease_token IS NULL) EXECUTE FUNCTION chaos_end();
CREATE TRIGGER chaos_end AFTER UPDATE OF lease_token ON research_task_jobs FOR EACH ROW
  WHEN (OLD.lease_token IS NOT NULL AND NEW.lease_token IS NULL) EXECUTE FUNCTION chaos_end();
"#;

/// The jobs requested during the run.
#[derive(Default)]
pub struct Requested {
    /// (attempt, document, deletions requested before it)
    pub compiles: Vec<(Uuid, Uuid, usize)>,
    /// (job, deletions requested before it)
    pub research: Vec<(Uuid, usize)>,
    pub deletions: Vec<(Uuid, Uuid)>,
}

/// Creates the space, its source, a permission snapshot and the documents in `store`.
pub async fn seed(pool: &PgPool, store: &Store) -> NotesSpace {
    let mut tx = pool.begin().await.unwrap();
    let notes = platform::create_notes_space(&mut tx, store, TENANT, SUBJECT, "chaos", DOCUMENTS)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    notes
}

/// Gives the job just requested in `tx` its 100 execution attempts, in the request's own
/// transaction, and commits both.
async fn commit_with_attempts(
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    job_table: &str,
    id: Uuid,
) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "UPDATE {job_table} SET max_execution_attempts = 100 WHERE id = $1"
    ))
    .bind(id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// Requests compiles of every document, then research tasks and deletions of the second half,
/// on a seeded schedule until `stop`. A request refused because Postgres is down is tried again
/// later, as the platform's API would be.
pub async fn drive(pool: PgPool, s: NotesSpace, stop: CancellationToken, seed: u64) -> Requested {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x91a7);
    let mut out = Requested::default();
    let mut compiled_next = 0usize;
    let mut deleted_next = DOCUMENTS / 2;
    while !stop.is_cancelled() {
        let roll: f64 = rng.random();
        let made = async {
            let mut conn = pool.acquire().await?;
            let mut tx = conn.begin().await?;
            if compiled_next < DOCUMENTS && (roll < 0.6 || out.research.len() >= 3 * DOCUMENTS) {
                let id = compile::request::request(
                    &mut tx,
                    s.documents[compiled_next],
                    compile::request::RequestOptions::default(),
                )
                .await
                .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
                commit_with_attempts(tx, "document_compilation_attempts", id).await?;
                out.compiles.push((id, s.documents[compiled_next], out.deletions.len()));
                compiled_next += 1;
            } else if roll < 0.85 || deleted_next >= DOCUMENTS {
                let doc = rng.random_range(0..DOCUMENTS / 2);
                let req = research::request::ResearchRequest::new(
                    s.space,
                    format!("How does note {doc} describe leases and fencing of workers?"),
                    SUBJECT,
                    s.snapshot,
                );
                let r = research::request::request(&mut tx, &req)
                    .await
                    .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
                commit_with_attempts(tx, "research_task_jobs", r.job_id).await?;
                out.research.push((r.job_id, out.deletions.len()));
            } else {
                // Only a document whose compile ended may be deleted: a deletion racing its own
                // document's compile is a different test.
                let doc = s.documents[deleted_next];
                let ended: bool = sqlx::query_scalar(
                    "SELECT count(*) > 0 AND bool_and(run_state IN ('succeeded', 'failed', 'canceled', 'superseded')) \
                     FROM document_compilation_attempts WHERE document_asset_id = $1",
                )
                .bind(doc)
                .fetch_one(&mut *tx)
                .await?;
                if !ended {
                    return Ok(());
                }
                let req = deletion::request::DeletionRequest {
                    tenant_id: TENANT.into(),
                    knowledge_space_id: s.space,
                    target: deletion::request::Target::Document { id: doc },
                    expected_revision: None,
                    requested_by_subject_id: SUBJECT.into(),
                    permission_snapshot_id: s.snapshot,
                    access_channel: "interactive".into(),
                    idempotency_key: format!("chaos-delete-{doc}"),
                };
                let r = deletion::request::request_deletion(&mut tx, &req)
                    .await
                    .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
                commit_with_attempts(tx, "deletion_jobs", r.job_id).await?;
                out.deletions.push((r.job_id, doc));
                deleted_next += 1;
            }
            Ok::<(), sqlx::Error>(())
        }
        .await;
        if let Err(e) = made {
            // Postgres down or cut: the platform's request fails too and is made again later.
            // A compile whose commit went through while its answer was lost is found active
            // by the next request of the same document: it stands, and the checks below judge
            // every job in the tables, recorded here or not.
            if e.to_string()
                .contains("already has an active compilation attempt")
            {
                compiled_next += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(400..=1500))).await;
    }
    out
}

/// The platform's jobs not yet in a terminal state.
pub async fn open(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM document_compilation_attempts \
                 WHERE run_state NOT IN ('succeeded', 'failed', 'canceled', 'superseded')) \
              + (SELECT count(*) FROM deletion_jobs WHERE run_state NOT IN ('succeeded', 'failed', 'canceled')) \
              + (SELECT count(*) FROM research_task_jobs WHERE stage NOT IN ('completed', 'failed', 'canceled'))",
    )
    .fetch_one(pool)
    .await
    .unwrap_or(i64::MAX)
}

/// Outbox rows of the platform's kinds not settled.
pub async fn outbox_open(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM document_compilation_outbox WHERE status NOT IN ('completed', 'dead', 'canceled')) \
              + (SELECT count(*) FROM deletion_outbox WHERE status NOT IN ('completed', 'dead', 'canceled')) \
              + (SELECT count(*) FROM research_task_outbox WHERE status NOT IN ('completed', 'dead', 'canceled'))",
    )
    .fetch_one(pool)
    .await
    .unwrap_or(i64::MAX)
}

/// The checks of the platform's kinds: (name, passed, detail).
pub async fn checks(pool: &PgPool, r: &Requested) -> Vec<(&'static str, bool, String)> {
    let mut out = Vec::new();
    let deleted: Vec<Uuid> = r.deletions.iter().map(|(_, d)| *d).collect();
    let deletion_jobs: Vec<Uuid> = r.deletions.iter().map(|(j, _)| *j).collect();
    let all = r.deletions.len();
    // A job requested after the last deletion must be there; an earlier one may have gone with
    // a deletion's derived data.
    let must_exist = |before: usize| before == all;
    let kept_compiles: Vec<Uuid> = r
        .compiles
        .iter()
        .filter(|(_, d, before)| !deleted.contains(d) && must_exist(*before))
        .map(|(a, _, _)| *a)
        .collect();
    let late_research: Vec<Uuid> = r
        .research
        .iter()
        .filter(|(_, before)| must_exist(*before))
        .map(|(j, _)| *j)
        .collect();
    let early_research: Vec<Uuid> = r
        .research
        .iter()
        .filter(|(_, before)| !must_exist(*before))
        .map(|(j, _)| *j)
        .collect();

    // Every job in the tables is judged, including one whose request committed while its
    // answer was lost.
    let wrong_compiles: Vec<(Uuid, String, Option<String>)> = sqlx::query_as(
        "SELECT id, run_state::text, last_error_code FROM document_compilation_attempts \
         WHERE run_state <> 'succeeded' LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    // A research task is completed, or (requested before a deletion) canceled by it.
    let wrong_research: Vec<(Uuid, String, Option<String>)> = sqlx::query_as(
        "SELECT id, stage::text, error FROM research_task_jobs \
         WHERE stage <> 'completed' AND NOT (stage = 'canceled' AND id = ANY($1)) LIMIT 10",
    )
    .bind(&early_research)
    .fetch_all(pool)
    .await
    .unwrap();
    let wrong_deletions: Vec<(Uuid, String, Option<String>)> = sqlx::query_as(
        "SELECT id, run_state::text, last_error_code FROM deletion_jobs \
         WHERE run_state <> 'succeeded' OR checkpoint <> 'completed' LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let missing: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM unnest($1::uuid[]) x(id) WHERE NOT EXISTS \
                  (SELECT 1 FROM document_compilation_attempts a WHERE a.id = x.id)) \
              + (SELECT count(*) FROM unnest($2::uuid[]) x(id) WHERE NOT EXISTS \
                  (SELECT 1 FROM research_task_jobs j WHERE j.id = x.id)) \
              + (SELECT count(*) FROM unnest($3::uuid[]) x(id) WHERE NOT EXISTS \
                  (SELECT 1 FROM deletion_jobs j WHERE j.id = x.id))",
    )
    .bind(&kept_compiles)
    .bind(&late_research)
    .bind(&deletion_jobs)
    .fetch_one(pool)
    .await
    .unwrap();
    let (compiles, research, deletions): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM document_compilation_attempts), (SELECT count(*) FROM research_task_jobs), \
           (SELECT count(*) FROM deletion_jobs)",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    out.push((
        "platform jobs: none lost; every compile succeeded, every research task and deletion completed",
        wrong_compiles.is_empty()
            && wrong_research.is_empty()
            && wrong_deletions.is_empty()
            && missing == 0
            && compiles > 0
            && !r.research.is_empty(),
        format!(
            "requested {} compiles, {} research tasks ({} after the last deletion), {} deletions; in the database \
             {compiles}, {research}, {deletions}; recorded but missing {missing}; wrong (job, state, error): \
             compile {wrong_compiles:?}, research {wrong_research:?}, deletion {wrong_deletions:?}",
            r.compiles.len(),
            r.research.len(),
            late_research.len(),
            r.deletions.len()
        ),
    ));

    // Each generation's outline, page index and multimodal manifest once; every compiled
    // document that was not deleted served by the head with its nodes; no row of a deleted one.
    let dup_outlines: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM (SELECT 1 FROM document_outlines GROUP BY document_asset_id, \
                   publication_generation_id HAVING count(*) <> 1) x) \
              + (SELECT count(*) FROM (SELECT 1 FROM page_index_manifests GROUP BY document_outline_id, \
                   publication_generation_id HAVING count(*) <> 1) x) \
              + (SELECT count(*) FROM (SELECT 1 FROM document_multimodal_manifests GROUP BY document_asset_id, \
                   version, publication_generation_id HAVING count(*) <> 1) x)",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let dup_nodes: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT 1 FROM knowledge_nodes GROUP BY document_asset_id, publication_generation_id, \
           kind, start_offset, end_offset HAVING count(*) <> 1) x",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let compiled: Vec<Uuid> = r
        .compiles
        .iter()
        .map(|(_, d, _)| *d)
        .filter(|d| !deleted.contains(d))
        .collect();
    let unserved: Vec<Uuid> = sqlx::query_scalar(
        "SELECT d FROM unnest($1::uuid[]) AS x(d) WHERE NOT EXISTS ( \
           SELECT 1 FROM projection_set_publication_heads h \
           JOIN projection_set_publication_members m ON m.publication_id = h.publication_id \
             AND m.component_type = 'index-projection' AND m.document_asset_id = x.d \
           JOIN index_projections p ON p.id = m.component_key AND p.status = 'ready' \
           JOIN knowledge_nodes n ON n.id = p.node_id) LIMIT 10",
    )
    .bind(&compiled)
    .fetch_all(pool)
    .await
    .unwrap();
    let residue: Vec<Uuid> = sqlx::query_scalar(
        "SELECT DISTINCT document_asset_id FROM knowledge_nodes WHERE document_asset_id = ANY($1) \
         UNION SELECT DISTINCT document_asset_id FROM parse_artifacts WHERE document_asset_id = ANY($1) \
         UNION SELECT DISTINCT document_asset_id FROM projection_set_publication_members WHERE document_asset_id = ANY($1) \
         LIMIT 10",
    )
    .bind(&deleted)
    .fetch_all(pool)
    .await
    .unwrap();
    out.push((
        "platform effects once: one outline and page index per compile, each node once, every kept document published, nothing left of a deleted one",
        dup_outlines == 0 && dup_nodes == 0 && unserved.is_empty() && residue.is_empty(),
        format!(
            "duplicated outlines or manifests {dup_outlines}, duplicated nodes {dup_nodes}; compiled documents the head \
             does not serve {unserved:?}; deleted documents with rows {residue:?}"
        ),
    ));

    let gaps: Vec<(Uuid, i64, i32, i32)> = sqlx::query_as(
        "SELECT research_task_job_id, count(*), min(sequence), max(sequence) FROM research_task_progress_events \
         GROUP BY 1 HAVING min(sequence) <> 1 OR max(sequence) <> count(*) LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let twice: Vec<(Uuid, String, i64)> = sqlx::query_as(
        "SELECT research_task_job_id, stage::text, count(*) FROM research_task_progress_events \
         WHERE event_type = 'research_task.stage_changed' AND payload ? 'previousStage' GROUP BY 1, 2 HAVING count(*) > 1 LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    out.push((
        "research progress contiguous (1, 2, 3, …) and each stage entered once",
        gaps.is_empty() && twice.is_empty(),
        format!("(job, events, first, last) with gaps: {gaps:?}; (job, stage, times): {twice:?}"),
    ));

    let back: Vec<(String, Uuid, String, String)> = sqlx::query_as(
        "SELECT kind, job_id, old_cp, new_cp FROM chaos_walks w WHERE \
         array_position(CASE kind WHEN 'compile' THEN ARRAY['queued', 'parsed', 'outline_built', 'nodes_generated', \
             'projection_built', 'smoke_eval_passed', 'published'] \
           ELSE ARRAY['queued', 'planning', 'retrieving', 'analyzing', 'generating', 'completed'] END, old_cp) > \
         array_position(CASE kind WHEN 'compile' THEN ARRAY['queued', 'parsed', 'outline_built', 'nodes_generated', \
             'projection_built', 'smoke_eval_passed', 'published'] \
           ELSE ARRAY['queued', 'planning', 'retrieving', 'analyzing', 'generating', 'completed'] END, new_cp) LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let walks: i64 = sqlx::query_scalar("SELECT count(*) FROM chaos_walks")
        .fetch_one(pool)
        .await
        .unwrap();
    out.push((
        "compile and research walks never went backwards",
        back.is_empty() && walks > 0,
        format!("{walks} checkpoint and stage changes; backwards (kind, job, from, to): {back:?}"),
    ));
    out
}

/// One line for the report.
pub fn summary(r: &Requested) -> String {
    format!(
        "{} document compiles, {} research tasks, {} document deletions",
        r.compiles.len(),
        r.research.len(),
        r.deletions.len()
    )
}
