//! The planner's statistics of the tables that grow under the worker. Invariant: a table of the
//! current schema that this role owns, written since its last analysis, whose live rows number
//! more than 50 and more than twice what its statistics counted, is analysed at the next look;
//! a look never waits for a lock (another session analysing the table is left to it) and a
//! failure only logs.
//!
//! Why: a connection keeps the plans of its statements, and Postgres keeps the plans of the
//! foreign-key checks its triggers run, for as long as nothing invalidates them. On tables
//! with no statistics yet (a new database, a first burst) the planner cannot tell two indexes
//! apart: the check of every publication member against its publication chose the index that
//! leads with the space and its status, and walked every publication of the space for each
//! member copied. Autovacuum looks at a database once a minute; a compile backlog of 600
//! documents in a new space took 89 s before it did, and 44 s when the tables were analysed
//! as they grew. An analysis invalidates the plans made on the table, so each connection plans
//! again with what the table holds now, and that costs: analysing at autovacuum's own
//! threshold (a tenth) every 5 s raised the p99 to claim at 200 jobs/s from 8-9 to 13-16 ms.
//! So a growing table is analysed only at each doubling, a handful of times, and then left to
//! autovacuum. Growth is counted in live rows, not in rows written: a job table writes each
//! row four times or more (claim, steps, end), and counting those writes analysed it at almost
//! every look of its first minute (jobs and outbox five times each in a 30-second run at 200
//! jobs/s), with the p99 to claim 1-2 ms above the build without these looks.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// How often a consumer's process looks at the statistics.
pub const EVERY: Duration = Duration::from_secs(5);

/// At most this many tables are analysed per look, the most changed first.
const PER_LOOK: usize = 4;

/// The tables of the schema this role owns that were written since their last analysis, each
/// as a quoted name with its live rows and the rows its statistics counted (-1: never
/// analysed), the largest first.
const CHANGED: &str = "SELECT format('%I.%I', s.schemaname, s.relname), s.n_live_tup, \
       c.reltuples::float8 \
     FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid \
     WHERE s.schemaname = current_schema() AND s.n_mod_since_analyze > 0 AND s.n_live_tup > 50 \
       AND pg_has_role(current_user, c.relowner, 'MEMBER') \
     ORDER BY s.n_live_tup DESC";

/// Whether a table that holds `live` rows, whose last statistics counted `known` (-1: never
/// analysed), is due for an analysis: it has more than 50 and has outgrown its statistics
/// twice over. Pure.
pub fn due(live: i64, known: f64) -> bool {
    live > 50 && live as f64 > 2.0 * known.max(0.0)
}

/// Analyses the tables that are due; returns the ones it analysed.
pub async fn keep(pool: &PgPool) -> Result<Vec<String>, sqlx::Error> {
    let mut conn = crate::db::acquire(pool).await?;
    let changed: Vec<(String, i64, f64)> = sqlx::query_as(CHANGED).fetch_all(&mut *conn).await?;
    let tables: Vec<String> = changed
        .into_iter()
        .filter(|&(_, live, known)| due(live, known))
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
    fn a_table_is_due_once_its_live_rows_outgrew_its_statistics_twice_over_table() {
        // (live rows, rows its statistics counted, due)
        for (live, known, want) in [
            (0, -1.0, false),
            (50, -1.0, false),
            (51, -1.0, true), // never analysed: reltuples is -1
            (51, 0.0, true),  // analysed while empty
            (2_000, 1_000.0, false),
            (2_001, 1_000.0, true),
            (1_000, 1_000.0, false), // written in place, however often: autovacuum's business
            (1_500_000, 1_000_000.0, false),
            (2_000_001, 1_000_000.0, true),
        ] {
            assert_eq!(due(live, known), want, "{live} live, {known} known");
        }
    }
}
