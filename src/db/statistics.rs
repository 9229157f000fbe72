//! The planner's statistics of the tables that grow under the worker. Invariant: a table of the
//! current schema that this role may analyse, whose rows changed since its last analysis by
//! more than autovacuum's default threshold (50 rows and a tenth of the table), is analysed at
//! the next look; a look never waits for a lock (another session analysing the table is left
//! to it) and a failure only logs.
//!
//! Why: a connection keeps the plans of its statements, and Postgres keeps the plans of the
//! foreign-key checks its triggers run, for as long as nothing invalidates them. On tables
//! with no statistics yet (a new database, a first burst) the planner cannot tell two indexes
//! apart: the check of every publication member against its publication chose the index that
//! leads with the space and its status, and walked every publication of the space for each
//! member copied. Autovacuum looks at a database once a minute; a compile backlog of 600
//! documents in a new space took 89 s before it did, and 44 s when the tables were analysed
//! as they grew. An analysis invalidates the plans made on the table, so each connection plans
//! again with what the table holds now.

use sqlx::PgPool;

/// At most this many tables are analysed per look, the most changed first.
const PER_LOOK: i64 = 4;

/// The tables due for an analysis, the most changed first, each as a quoted name.
const DUE: &str = "SELECT format('%I.%I', s.schemaname, s.relname) \
     FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid \
     WHERE s.schemaname = current_schema() \
       AND s.n_mod_since_analyze > 50 + 0.1 * greatest(c.reltuples, s.n_live_tup, 0) \
       AND pg_has_role(current_user, c.relowner, 'MEMBER') \
     ORDER BY s.n_mod_since_analyze DESC LIMIT $1";

/// Whether a table with `live` rows (at least as many as its last statistics say) that had
/// `changed` rows written since its last analysis is due for one: autovacuum's default
/// threshold. Pure; the statement above says the same.
pub fn due(changed: i64, live: f64) -> bool {
    changed as f64 > 50.0 + 0.1 * live.max(0.0)
}

/// Analyses the tables that are due; returns the ones it analysed.
pub async fn keep(pool: &PgPool) -> Result<Vec<String>, sqlx::Error> {
    let mut conn = crate::db::acquire(pool).await?;
    let tables: Vec<String> = sqlx::query_scalar(DUE)
        .bind(PER_LOOK)
        .fetch_all(&mut *conn)
        .await?;
    let mut done = Vec::with_capacity(tables.len());
    for table in tables {
        // ANALYZE cannot run in a transaction block; the session's lock_timeout bounds it.
        sqlx::query("SET lock_timeout = '200ms'")
            .execute(&mut *conn)
            .await?;
        let analyse = format!("ANALYZE {table}");
        let analysed = sqlx::query(&analyse).execute(&mut *conn).await;
        sqlx::query("RESET lock_timeout")
            .execute(&mut *conn)
            .await?;
        match analysed {
            Ok(_) => done.push(table),
            Err(e) => tracing::debug!(table, error = %e, "table not analysed"),
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::due;

    #[test]
    fn a_table_is_due_past_fifty_rows_and_a_tenth_of_its_size_table() {
        // (rows changed since the last analysis, rows in the table, due)
        for (changed, live, want) in [
            (0, 0.0, false),
            (50, 0.0, false),
            (51, 0.0, true),
            (150, 1_000.0, false),
            (151, 1_000.0, true),
            (100_050, 1_000_000.0, false),
            (100_051, 1_000_000.0, true),
            (60, -1.0, true), // never analysed: reltuples is -1
        ] {
            assert_eq!(due(changed, live), want, "{changed} changed of {live}");
        }
    }
}
