//! The planner's statistics of the tables that grow under the worker. Invariant: a table of the
//! current schema that this role owns, whose rows changed since its last analysis by more than
//! 50 and more than the table held then (so its statistics describe less than half of it), is
//! analysed at the next look; a look never waits for a lock (another session analysing the
//! table is left to it) and a failure only logs.
//!
//! Why: a connection keeps the plans of its statements, and Postgres keeps the plans of the
//! foreign-key checks its triggers run, for as long as nothing invalidates them. On tables
//! with no statistics yet (a new database, a first burst) the planner cannot tell two indexes
//! apart: the check of every publication member against its publication chose the index that
//! leads with the space and its status, and walked every publication of the space for each
//! member copied. Autovacuum looks at a database once a minute; a compile backlog of 600
//! documents in a new space took 89 s before it did, and 44 s when the tables were analysed
//! as they grew. An analysis invalidates the plans made on the table, so each connection plans
//! again with what the table holds now. Only a table that outgrew its statistics twice over is
//! analysed, so a growing table is analysed a handful of times (at each doubling) and then left
//! to autovacuum: analysing at autovacuum's own threshold (a tenth) every 5 s made every
//! connection plan its statements again every few seconds, and raised the p99 to claim at
//! 200 jobs/s from 8-9 to 13-16 ms.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// How often a consumer's process looks at the statistics.
pub const EVERY: Duration = Duration::from_secs(5);

/// At most this many tables are analysed per look, the most changed first.
const PER_LOOK: usize = 4;

/// The tables of the schema this role owns that changed since their last analysis, each as a
/// quoted name with the rows changed and the rows its statistics counted (-1: never analysed),
/// the most changed first.
const CHANGED: &str = "SELECT format('%I.%I', s.schemaname, s.relname), s.n_mod_since_analyze, \
       c.reltuples::float8 \
     FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid \
     WHERE s.schemaname = current_schema() AND s.n_mod_since_analyze > 50 \
       AND pg_has_role(current_user, c.relowner, 'MEMBER') \
     ORDER BY s.n_mod_since_analyze DESC";

/// Whether a table whose last statistics counted `known` rows (-1: never analysed) and that
/// had `changed` rows written since is due for an analysis. Pure.
pub fn due(changed: i64, known: f64) -> bool {
    changed as f64 > 50.0 + known.max(0.0)
}

/// Analyses the tables that are due; returns the ones it analysed.
pub async fn keep(pool: &PgPool) -> Result<Vec<String>, sqlx::Error> {
    let mut conn = crate::db::acquire(pool).await?;
    let changed: Vec<(String, i64, f64)> = sqlx::query_as(CHANGED).fetch_all(&mut *conn).await?;
    let tables: Vec<String> = changed
        .into_iter()
        .filter(|&(_, n, known)| due(n, known))
        .map(|(t, _, _)| t)
        .take(PER_LOOK)
        .collect();
    let mut done = Vec::with_capacity(tables.len());
    if tables.is_empty() {
        return Ok(done);
    }
    // ANALYZE cannot run in a transaction block, so the bound on its lock wait is the session's
    // for the look, and the connection goes back to the pool without it.
    sqlx::query("SET lock_timeout = '200ms'")
        .execute(&mut *conn)
        .await?;
    for table in tables {
        let analyse = format!("ANALYZE {table}");
        match sqlx::query(&analyse)
            .persistent(false)
            .execute(&mut *conn)
            .await
        {
            Ok(_) => done.push(table),
            Err(e) => tracing::debug!(table, error = %e, "table not analysed"),
        }
    }
    sqlx::query("RESET lock_timeout")
        .execute(&mut *conn)
        .await?;
    Ok(done)
}

/// Looks every `every` until shutdown; runs in every process with consumers, whose steps write
/// the tables that grow.
pub async fn run(pool: PgPool, every: Duration, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        match keep(&pool).await {
            Ok(tables) if !tables.is_empty() => {
                tracing::debug!(?tables, "analysed tables that outgrew their statistics")
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "statistics look failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::due;

    #[test]
    fn a_table_is_due_once_it_outgrew_its_statistics_twice_over_table() {
        // (rows changed since the last analysis, rows it counted then, due)
        for (changed, known, want) in [
            (0, 0.0, false),
            (50, 0.0, false),
            (51, 0.0, true),
            (60, -1.0, true), // never analysed: reltuples is -1
            (1_050, 1_000.0, false),
            (1_051, 1_000.0, true),
            (150_000, 1_000_000.0, false), // autovacuum's business
            (1_000_051, 1_000_000.0, true),
        ] {
            assert_eq!(
                due(changed, known),
                want,
                "{changed} changed, {known} known"
            );
        }
    }
}
