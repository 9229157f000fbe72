//! The project's own indexes on the platform's job and outbox tables, built online. Invariant:
//! each is created with `CREATE INDEX CONCURRENTLY`, outside any transaction, so `migrate` on a
//! live platform database never blocks the platform's writers; an index a failed or killed build
//! left invalid is dropped (concurrently) and built again; a valid one is never touched; no
//! platform definition is changed (`platform-compat` lists these as the project's own).
//!
//! Most exist for the relay's fair claim (see `relay::statements`): `fair` finds, per tenant,
//! the jobs that were never dispatched, in commit order, and `urgent` the outbox rows due again
//! (retries, continued slices, republished rows). `leased` gives the maintenance sweep the
//! leased jobs of a kind whose platform indexes do not lead with their lease (see
//! `maintenance::running`). All are partial, so they hold only what waits or runs.

use sqlx::PgConnection;

/// One index of the project's own.
#[derive(Clone, Copy, Debug)]
pub struct OwnIndex {
    pub name: &'static str,
    pub table: &'static str,
    /// What follows `ON table`: the columns and the partial predicate.
    pub definition: &'static str,
}

/// The outbox rows due again rather than new: a row that was delivered before (a retry, a
/// continued slice) or whose publishing failed: the predicate of the `urgent` indexes below.
pub const URGENT_ROW: &str = "(dispatch_attempts > 0 OR delivered_at IS NOT NULL)";

pub const OWN_INDEXES: &[OwnIndex] = &[
    OwnIndex {
        name: "kfs_document_compilation_attempts_fair_idx",
        table: "document_compilation_attempts",
        definition: "(tenant_id, created_at, id) WHERE run_state = 'dispatch_pending'",
    },
    OwnIndex {
        name: "kfs_deletion_jobs_fair_idx",
        table: "deletion_jobs",
        definition: "(tenant_id, created_at, id) WHERE run_state = 'dispatch_pending'",
    },
    OwnIndex {
        name: "kfs_research_task_jobs_fair_idx",
        table: "research_task_jobs",
        definition: "(tenant_id, created_at, id) WHERE stage = 'queued' AND execution_attempts = 0",
    },
    OwnIndex {
        name: "kfs_document_compilation_outbox_urgent_idx",
        table: "document_compilation_outbox",
        definition: "(available_at, id) WHERE status = 'pending' \
                     AND (dispatch_attempts > 0 OR delivered_at IS NOT NULL)",
    },
    OwnIndex {
        name: "kfs_deletion_outbox_urgent_idx",
        table: "deletion_outbox",
        definition: "(available_at, id) WHERE status = 'pending' \
                     AND (dispatch_attempts > 0 OR delivered_at IS NOT NULL)",
    },
    OwnIndex {
        name: "kfs_research_task_outbox_urgent_idx",
        table: "research_task_outbox",
        definition: "(available_at, id) WHERE status = 'pending' \
                     AND (dispatch_attempts > 0 OR delivered_at IS NOT NULL)",
    },
    OwnIndex {
        name: "kfs_research_task_jobs_leased_idx",
        table: "research_task_jobs",
        definition: "(worker_id) WHERE lease_token IS NOT NULL",
    },
];

/// What [`ensure`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Built {
    /// Indexes created by this run.
    pub created: Vec<&'static str>,
    /// Invalid leftovers of an earlier build, dropped and built again.
    pub rebuilt: Vec<&'static str>,
}

/// Builds every missing or invalid index of [`OWN_INDEXES`] on `conn`, which must not be in a
/// transaction. Repeatable: a second run finds every index valid and does nothing.
pub async fn ensure(conn: &mut PgConnection) -> Result<Built, sqlx::Error> {
    let mut built = Built::default();
    for ix in OWN_INDEXES {
        // None: missing; Some(false): a build that did not finish left it invalid.
        let valid: Option<bool> = sqlx::query_scalar(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE c.relname = $1 AND n.nspname = current_schema()",
        )
        .bind(ix.name)
        .fetch_optional(&mut *conn)
        .await?;
        match valid {
            Some(true) => continue,
            Some(false) => {
                sqlx::raw_sql(&format!(
                    "DROP INDEX CONCURRENTLY IF EXISTS \"{}\"",
                    ix.name
                ))
                .execute(&mut *conn)
                .await?;
                built.rebuilt.push(ix.name);
            }
            None => built.created.push(ix.name),
        }
        sqlx::raw_sql(&format!(
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS \"{}\" ON \"{}\" {}",
            ix.name, ix.table, ix.definition
        ))
        .execute(&mut *conn)
        .await?;
    }
    Ok(built)
}
