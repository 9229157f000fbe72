//! Scenario `claim`: the cost of the relay's fair claim on a backlog of 100 due compiles and on
//! one of 100,000, spread over tenants. Invariant: the same relay statements, the same claim size
//! and the same number of claims at both sizes; only the claim and its mark are timed, and
//! between claims the rows are put back, so every claim faces the whole backlog.
//!
//! The backlog is made by copying one real compile request (its attempt and outbox rows, written
//! by the platform's request path) with fresh ids, tenants and documents, under
//! `session_replication_role = replica` so that the copies need no documents of their own: the
//! claim reads only the job and outbox tables, and each copy passes their CHECK constraints.

use std::time::Instant;

use serde_json::json;
use sqlx::PgPool;

use super::Params;
use crate::config;
use crate::jobs::{compile, Kind};
use crate::relay::{Relay, RelayConfig};
use crate::store::Store;
use crate::tools::bench::env::BenchEnv;
use crate::tools::bench::report::{Report, Run};
use crate::tools::platform;

/// Rows one claim takes (as a relay whose window has that much room).
const CLAIM: i64 = 64;
/// Claims timed at each size.
const CLAIMS: u64 = 200;
/// Tenants the backlog is spread over, at both sizes, so that every claim has the same shape:
/// one row from each of `CLAIM` tenants.
const TENANTS: i64 = 100;

/// Makes the backlog `n` copies of the template attempt, spread over [`TENANTS`] tenants.
async fn backlog(pool: &PgPool, template: uuid::Uuid, n: i64) -> Result<(), String> {
    let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
    sqlx::query("SET LOCAL session_replication_role = replica")
        .execute(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
    // Foreign keys are not enforced under `replica`: each table is cleared on its own.
    for sql in [
        "DELETE FROM document_compilation_outbox WHERE attempt_id <> $1",
        "DELETE FROM document_compilation_attempts WHERE id <> $1",
    ] {
        sqlx::query(sql)
            .bind(template)
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
    }
    sqlx::query(
        "CREATE TEMP TABLE copies ON COMMIT DROP AS \
         SELECT gen_random_uuid() AS id, gen_random_uuid() AS doc, \
           'bench-tenant-' || lpad((g % $2)::text, 5, '0') AS tenant, g \
         FROM generate_series(1, $1) g",
    )
    .bind(n)
    .bind(TENANTS)
    .execute(&mut *tx)
    .await
    .map_err(|e| e.to_string())?;
    // Every column of the template row, with the copy's id, tenant and document.
    let cols: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns \
         WHERE table_name = 'document_compilation_attempts' AND table_schema = current_schema() \
         ORDER BY ordinal_position",
    )
    .fetch_all(&mut *tx)
    .await
    .map_err(|e| e.to_string())?;
    let pick = |c: &String| match c.as_str() {
        "id" => "c.id".to_owned(),
        "tenant_id" => "c.tenant".to_owned(),
        "document_asset_id" => "c.doc".to_owned(),
        "created_at" | "updated_at" => "now() + c.g * interval '1 microsecond'".to_owned(),
        other => format!("a.\"{other}\""),
    };
    sqlx::query(&format!(
        "INSERT INTO document_compilation_attempts ({}) SELECT {} FROM copies c, \
           document_compilation_attempts a WHERE a.id = $1",
        cols.iter()
            .map(|c| format!("\"{c}\""))
            .collect::<Vec<_>>()
            .join(", "),
        cols.iter().map(pick).collect::<Vec<_>>().join(", "),
    ))
    .bind(template)
    .execute(&mut *tx)
    .await
    .map_err(|e| e.to_string())?;
    sqlx::query(
        "INSERT INTO document_compilation_outbox (id, attempt_id, event_type, schema_version, payload, \
           idempotency_key, status, dispatch_attempts, available_at, created_at, updated_at) \
         SELECT gen_random_uuid(), c.id, o.event_type, o.schema_version, \
           jsonb_build_object('attemptId', c.id::text), 'document.compile:' || c.id::text, 'pending', 0, \
           now() - interval '1 second', o.created_at, o.updated_at \
         FROM copies c, document_compilation_outbox o WHERE o.attempt_id = $1",
    )
    .bind(template)
    .execute(&mut *tx)
    .await
    .map_err(|e| e.to_string())?;
    // The template itself leaves the backlog.
    for sql in [
        "DELETE FROM document_compilation_outbox WHERE attempt_id = $1",
        "DELETE FROM document_compilation_attempts WHERE id = $1",
    ] {
        sqlx::query(sql)
            .bind(template)
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
    }
    tx.commit().await.map_err(|e| e.to_string())?;
    sqlx::query("ANALYZE document_compilation_attempts")
        .execute(pool)
        .await
        .map_err(|e| e.to_string())?;
    sqlx::query("ANALYZE document_compilation_outbox")
        .execute(pool)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Times `CLAIMS` claims of `CLAIM` rows, putting the claimed rows back after each.
async fn time_claims(env: &BenchEnv, relay: &Relay, label: &str) -> Result<Run, String> {
    let mut secs = 0.0;
    let mut claimed = 0u64;
    for _ in 0..CLAIMS {
        let t = Instant::now();
        let n = relay
            .claim_and_mark_without_publishing(Kind::Compile)
            .await
            .map_err(|e| e.to_string())?;
        secs += t.elapsed().as_secs_f64();
        claimed += (n as i64 == CLAIM) as u64;
        sqlx::query(
            "WITH o AS (UPDATE document_compilation_outbox SET status = 'pending', dispatch_attempts = 0, \
                          available_at = now() - interval '1 second' \
                        WHERE status = 'dispatched' RETURNING attempt_id) \
             UPDATE document_compilation_attempts SET run_state = 'dispatch_pending' \
             WHERE id IN (SELECT attempt_id FROM o)",
        )
        .execute(&env.pool)
        .await
        .map_err(|e| e.to_string())?;
    }
    Ok(Run::new(label, CLAIMS, claimed, secs, "claims/s"))
}

/// The fair claim at 100 and at 100,000 due rows.
pub async fn claim(env: &BenchEnv, _p: &Params) -> Result<Report, String> {
    let dir = std::env::temp_dir().join(format!("kfs-bench-{}", env.tag));
    std::fs::create_dir_all(&dir).map_err(|e| format!("object store directory: {e}"))?;
    let store_url = format!("file://{}", dir.display());
    let store = Store::open(&config::object_store(&store_url).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let template = {
        let mut tx = env.pool.begin().await.map_err(|e| e.to_string())?;
        let notes =
            platform::create_notes_space(&mut tx, &store, "bench-claim", "bench-user", "claim", 1)
                .await
                .map_err(|e| e.to_string())?;
        let attempt = compile::request::request(
            &mut tx,
            notes.documents[0],
            compile::request::RequestOptions::default(),
        )
        .await
        .map_err(|e| format!("compile request: {e}"))?;
        tx.commit().await.map_err(|e| e.to_string())?;
        attempt
    };
    let _ = std::fs::remove_dir_all(&dir);
    let relay = Relay::new(
        env.pool.clone(),
        env.topology.clone(),
        format!("bench-claim-{}", env.tag),
        RelayConfig {
            batch: CLAIM,
            ..RelayConfig::default()
        },
        &[Kind::Compile],
    );
    let mut runs = Vec::new();
    let mut template = Some(template);
    for n in [100i64, 100_000] {
        // The first size copies the request; the second copies one of the first's copies.
        let t = match template.take() {
            Some(t) => t,
            None => sqlx::query_scalar("SELECT id FROM document_compilation_attempts LIMIT 1")
                .fetch_one(&env.pool)
                .await
                .map_err(|e| e.to_string())?,
        };
        backlog(&env.pool, t, n).await?;
        runs.push(
            time_claims(
                env,
                &relay,
                &format!("fair claim of {CLAIM} at {n} due rows"),
            )
            .await?,
        );
    }
    let per_claim_ms: Vec<f64> = runs.iter().map(|r| r.secs * 1000.0 / r.n as f64).collect();
    let settings = json!({
        "claim_rows": CLAIM,
        "claims": CLAIMS,
        "tenants": TENANTS,
        "ms_per_claim_at_100": per_claim_ms[0],
        "ms_per_claim_at_100000": per_claim_ms[1],
        "growth": per_claim_ms[1] / per_claim_ms[0],
    });
    Ok(Report::of_runs("claim", "claims/s", runs, settings))
}
