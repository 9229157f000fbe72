//! The planner's statistics of the tables that grow under the worker, against a real Postgres:
//! plans made while a space had no publications stop walking every publication of the space
//! once a consumer's process has analysed the tables, and a look at the statistics never waits for a
//! lock.

use kfs_worker::db::statistics;
use kfs_worker::publication::{self, Member};
use kfs_worker::tools::platform;
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

use crate::support::{self, TestEnv};

const TENANT: &str = "tenant-statistics";

/// Scans of the publications' space-and-status index so far. A check of a member through it
/// finds its publication's id among every publication of the space.
async fn status_index_scans(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT idx_scan FROM pg_stat_user_indexes \
         WHERE indexrelname = 'projection_set_publications_space_status_updated_idx'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Scans of the space-and-status index while `conn` writes a publication of 20 members.
async fn scans_of_a_copy_of_20(pool: &PgPool, conn: &mut PgConnection, space: Uuid) -> i64 {
    let before = status_index_scans(pool).await;
    publication_with_members(conn, space, 20).await;
    status_index_scans(pool).await - before
}

async fn flush_statistics(conn: &mut PgConnection) {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut *conn)
        .await
        .unwrap();
}

/// A candidate publication of `space` with `n` members of its own, written on `conn`; the
/// statistics it moved are flushed so another session sees them.
async fn publication_with_members(conn: &mut PgConnection, space: Uuid, n: usize) {
    let id = Uuid::new_v4();
    let fingerprint = format!("projection-set-sha256:{}", id.simple());
    assert!(publication::insert(
        &mut *conn,
        id,
        TENANT,
        space,
        &fingerprint,
        1,
        "candidate",
        &serde_json::json!({})
    )
    .await
    .unwrap());
    let members: Vec<Member> = (0..n)
        .map(|_| Member {
            component_type: "document-outline".into(),
            component_key: Uuid::new_v4(),
            generation_id: Uuid::new_v4(),
            document_asset_id: None,
        })
        .collect();
    let written = publication::set_members(&mut *conn, TENANT, space, id, None, None, &members)
        .await
        .unwrap();
    assert_eq!(written, n as u64);
    flush_statistics(conn).await;
}

#[tokio::test]
async fn member_checks_planned_on_an_empty_space_stop_walking_its_publications_once_analysed() {
    let env = TestEnv::new().await;
    let pool = env.pool.clone();
    let space = {
        let mut c = pool.acquire().await.unwrap();
        platform::create_space(&mut c, TENANT, "statistics", "Statistics", "owner")
            .await
            .unwrap()
    };
    // One session checks its first members while the space has no publication: the plan of
    // the member's foreign-key check is made on tables with no statistics, and kept.
    let mut conn = PgConnection::connect(&support::url_for(&env.db_name))
        .await
        .unwrap();
    for _ in 0..8 {
        publication_with_members(&mut conn, space, 1).await;
    }
    // The space grows to 400 publications before anything analyses it.
    sqlx::query(
        "INSERT INTO projection_set_publications (id, tenant_id, knowledge_space_id, fingerprint, \
           projection_version, status, metadata, created_at, updated_at) \
         SELECT gen_random_uuid(), $1, $2, 'projection-set-sha256:grown-' || g, 1, 'superseded', '{}', \
           now(), now() FROM generate_series(1, 400) g",
    )
    .bind(TENANT)
    .bind(space)
    .execute(&mut conn)
    .await
    .unwrap();
    flush_statistics(&mut conn).await;

    let unanalysed = scans_of_a_copy_of_20(&pool, &mut conn, space).await;
    assert_eq!(
        unanalysed, 20,
        "each of 20 members was checked through the space-and-status index: the plan this test is about"
    );

    let analysed = statistics::keep(&pool).await.unwrap();
    assert!(
        analysed
            .iter()
            .any(|t| t.ends_with(".projection_set_publications")),
        "the grown publications table was analysed: {analysed:?}"
    );
    let after = scans_of_a_copy_of_20(&pool, &mut conn, space).await;
    assert_eq!(
        after, 0,
        "after the analysis no member's check goes through the space-and-status index"
    );
    // Nothing changed since: nothing is analysed again.
    let again = statistics::keep(&pool).await.unwrap();
    assert!(
        !again
            .iter()
            .any(|t| t.ends_with(".projection_set_publications")),
        "{again:?}"
    );
    conn.close().await.ok();
    env.cleanup().await;
}

#[tokio::test]
async fn a_look_at_the_statistics_leaves_a_table_another_session_holds_and_analyses_the_rest() {
    let env = TestEnv::new().await;
    let pool = env.pool.clone();
    let mut writer = PgConnection::connect(&support::url_for(&env.db_name))
        .await
        .unwrap();
    for table in ["stats_held", "stats_free"] {
        sqlx::query(&format!("CREATE TABLE {table} (n int)"))
            .execute(&mut writer)
            .await
            .unwrap();
        sqlx::query(&format!(
            "INSERT INTO {table} SELECT g FROM generate_series(1, 1000) g"
        ))
        .execute(&mut writer)
        .await
        .unwrap();
    }
    flush_statistics(&mut writer).await;
    writer.close().await.ok();
    // Another session holds the lock an analysis takes (as a running ANALYZE or VACUUM does).
    let mut holder = PgConnection::connect(&support::url_for(&env.db_name))
        .await
        .unwrap();
    let mut tx = holder.begin().await.unwrap();
    sqlx::query("LOCK TABLE stats_held IN SHARE UPDATE EXCLUSIVE MODE")
        .execute(&mut *tx)
        .await
        .unwrap();
    let analysed =
        tokio::time::timeout(std::time::Duration::from_secs(30), statistics::keep(&pool))
            .await
            .expect("the look waited for the held table")
            .unwrap();
    assert!(
        analysed.iter().any(|t| t.ends_with(".stats_free")),
        "{analysed:?}"
    );
    assert!(
        !analysed.iter().any(|t| t.ends_with(".stats_held")),
        "{analysed:?}"
    );
    tx.rollback().await.unwrap();
    // Released, it is analysed at the next look.
    let next = statistics::keep(&pool).await.unwrap();
    assert!(next.iter().any(|t| t.ends_with(".stats_held")), "{next:?}");
    holder.close().await.ok();
    env.cleanup().await;
}

/// Growth is counted in live rows. A job table writes each of its rows several times (claim,
/// steps, end); counting those writes analysed it at almost every look while it grew, and each
/// analysis sent every connection back to plan its statements. A table written in place is
/// left to autovacuum, and analysed again only once it has doubled.
#[tokio::test]
async fn a_table_written_in_place_is_analysed_again_only_once_its_rows_have_doubled() {
    let env = TestEnv::new().await;
    let pool = env.pool.clone();
    let mut writer = PgConnection::connect(&support::url_for(&env.db_name))
        .await
        .unwrap();
    let write = |sql: &'static str| sqlx::query(sql);
    write("CREATE TABLE stats_jobs (n int)")
        .execute(&mut writer)
        .await
        .unwrap();
    write("INSERT INTO stats_jobs SELECT g FROM generate_series(1, 1000) g")
        .execute(&mut writer)
        .await
        .unwrap();
    flush_statistics(&mut writer).await;
    let analysed = |tables: &[String]| tables.iter().any(|t| t.ends_with(".stats_jobs"));
    let first = statistics::keep(&pool).await.unwrap();
    assert!(analysed(&first), "the new table was analysed: {first:?}");

    // Every row written three times over, as claims, steps and ends do: 3,000 rows written.
    for _ in 0..3 {
        write("UPDATE stats_jobs SET n = n + 1")
            .execute(&mut writer)
            .await
            .unwrap();
    }
    flush_statistics(&mut writer).await;
    let rewritten = statistics::keep(&pool).await.unwrap();
    assert!(
        !analysed(&rewritten),
        "a table written in place was analysed again: {rewritten:?}"
    );

    // Grown past twice the 1,000 rows its statistics counted.
    write("INSERT INTO stats_jobs SELECT g FROM generate_series(1, 1001) g")
        .execute(&mut writer)
        .await
        .unwrap();
    flush_statistics(&mut writer).await;
    let grown = statistics::keep(&pool).await.unwrap();
    assert!(
        analysed(&grown),
        "the doubled table was analysed: {grown:?}"
    );
    writer.close().await.ok();
    env.cleanup().await;
}
