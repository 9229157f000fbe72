//! On tables without statistics, as in a new space, the publish path's reads stay within their
//! publication: the snapshot read and the smoke evaluation read only its members' rows.

use super::*;

/// The indexes a bitmap heap scan reads, from its bitmap index scans.
fn bitmap_indexes(plan: &serde_json::Value, out: &mut Vec<String>) {
    if let Some(index) = plan["Index Name"].as_str() {
        out.push(index.to_owned());
    }
    for child in plan["Plans"].as_array().into_iter().flatten() {
        bitmap_indexes(child, out);
    }
}

/// Every scan node of an `EXPLAIN (ANALYZE, FORMAT JSON)` plan: (relation, how it is read: an
/// index, the indexes of a bitmap scan, or `Seq Scan`, and the rows it produced and its
/// filters removed, over all its loops).
fn scans(plan: &serde_json::Value, out: &mut Vec<(String, String, f64)>) {
    let n = |k: &str| plan[k].as_f64().unwrap_or(0.0);
    if let Some(relation) = plan["Relation Name"].as_str() {
        let read = match (plan["Index Name"].as_str(), plan["Node Type"].as_str()) {
            (Some(index), _) => index.to_owned(),
            (None, Some("Bitmap Heap Scan")) => {
                let mut indexes = Vec::new();
                bitmap_indexes(plan, &mut indexes);
                indexes.join(" + ")
            }
            (None, t) => t.unwrap_or("").to_owned(),
        };
        let rows = (n("Actual Rows") + n("Rows Removed by Filter")) * n("Actual Loops");
        out.push((relation.to_owned(), read, rows));
    }
    for child in plan["Plans"].as_array().into_iter().flatten() {
        scans(child, out);
    }
}

/// Runs `sql` with `args` (as `PREPARE name types`) under `EXPLAIN ANALYZE`; returns its scans.
async fn explained_scans(
    pool: &PgPool,
    name: &str,
    types: &str,
    sql: &str,
    args: &str,
) -> Vec<(String, String, f64)> {
    let mut c = pool.acquire().await.unwrap();
    let explained =
        support::explain_prepared(&mut c, "ANALYZE, FORMAT JSON", name, types, sql, args).await;
    let mut out = Vec::new();
    scans(&explained[0]["Plan"], &mut out);
    assert!(!out.is_empty(), "{name}: no scans in {explained}");
    out
}

/// A new space's tables have no statistics yet. There, the publish path's reads stay within
/// their publication: the rebased candidate's snapshot read looks up each of its outlines'
/// documents once, and the smoke evaluation reads its publication's members, never those of
/// every publication the space has had. With plain joins, the snapshot read started from the
/// space's documents and probed every outline member for each (rows read grew with the square
/// of the documents, 5 ms of each publish under the head lock at 100 documents); with the
/// tenant and space in the member lookup, the smoke evaluation took the index led by (tenant,
/// space, generation) and walked the members of every publication of the space.
#[tokio::test]
async fn the_publish_reads_stay_within_their_publication_on_tables_without_statistics() {
    const DOCS: usize = 24;
    let fx = Fx::new().await;
    // No statistics, as in a new space's first minutes: autovacuum may not analyse them.
    for table in [
        "projection_set_publication_members",
        "document_assets",
        "document_outlines",
        "parse_artifacts",
    ] {
        sqlx::query(&format!(
            "ALTER TABLE {table} SET (autovacuum_enabled = false)"
        ))
        .execute(fx.pool())
        .await
        .unwrap();
    }
    let mut docs = Vec::new();
    for i in 0..DOCS {
        let (name, mime, bytes) = generated(i, &format!("stat{}qk", letters(i)));
        let doc = fx.add(&name, mime, &bytes).await;
        fx.compile(doc).await;
        docs.push(doc);
    }
    let analysed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_user_tables WHERE relname IN ('projection_set_publication_members', \
           'document_assets', 'document_outlines', 'parse_artifacts') \
           AND (last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL)",
    )
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(analysed, 0, "the tables must have no statistics");
    let head = fx.head().await.unwrap();
    let members: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM projection_set_publication_members WHERE publication_id = $1",
    )
    .bind(head.publication_id)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    let space = fx.space;
    let publication = head.publication_id;

    let snapshots = explained_scans(
        fx.pool(),
        "snapshots",
        "(uuid, uuid, text)",
        compile::MEMBER_SNAPSHOTS_SQL,
        &format!("'{publication}', '{space}', 'document-outline'"),
    )
    .await;
    // One outline member, its outline, its document and its artifact per document.
    let read: f64 = snapshots.iter().map(|s| s.2).sum();
    assert!(
        read <= (4 * DOCS) as f64,
        "the snapshot read looked at {read} rows for {DOCS} documents: {snapshots:?}"
    );

    let doc = docs[DOCS / 2];
    let smoke = explained_scans(
        fx.pool(),
        "smoke",
        "(uuid, uuid, text, text, uuid, varchar)",
        compile::SMOKE_COUNTS_SQL,
        &format!("'{space}', '{publication}', 'x', NULL, '{doc}', '{TENANT}'"),
    )
    .await;
    let of_members: Vec<_> = smoke
        .iter()
        .filter(|s| s.0 == "projection_set_publication_members")
        .collect();
    assert!(!of_members.is_empty(), "{smoke:?}");
    for (_, index, rows) in &of_members {
        assert!(
            *index == "projection_set_publication_members_component_uq"
                || *index == "projection_set_publication_members_document_idx",
            "the smoke evaluation read members through {index:?}, which is not bounded by the publication: {smoke:?}"
        );
        assert!(
            *rows <= members as f64,
            "{rows} rows of {members}: {smoke:?}"
        );
    }
    fx.cleanup().await;
}
