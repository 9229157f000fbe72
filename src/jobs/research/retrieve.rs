//! Retrieval: full-text search over the space's published knowledge. Invariant: the one search
//! statement names the job's tenant and space on every table it reads (projections, nodes,
//! documents) and keeps only nodes the space's current head serves
//! ([`crate::publication::PUBLISHED_NODE_FILTER`]), so another tenant's or space's rows, and
//! unpublished generations, can never be found.

use sqlx::PgConnection;
use uuid::Uuid;

use super::plan::{Hit, SubQuery};
use crate::publication::PUBLISHED_NODE_FILTER;

/// The search statement. `$1` tenant, `$2` space, `$3` search text, `$4` limit. The query
/// matches both stemmed (`english`) and unstemmed (`simple`) lexemes, so it finds projections
/// built with either configuration.
pub fn search_sql() -> String {
    format!(
        "SELECT n.id, n.document_asset_id, n.document_version, d.filename, n.heading_path, n.content, \
           ts_rank_cd(ip.search_vector, q.query)::float8 AS rank \
         FROM knowledge_nodes n \
         JOIN index_projections ip ON ip.node_id = n.id AND ip.tenant_id = $1 AND ip.knowledge_space_id = $2 \
         JOIN document_assets d ON d.id = n.document_asset_id AND d.knowledge_space_id = $2 \
         CROSS JOIN (SELECT websearch_to_tsquery('english', $3) || websearch_to_tsquery('simple', $3) AS query) q \
         WHERE {PUBLISHED_NODE_FILTER} \
           AND ip.publication_generation_id IS NOT DISTINCT FROM n.publication_generation_id \
           AND ip.search_vector @@ q.query \
         ORDER BY rank DESC, n.id \
         LIMIT $4"
    )
}

/// The best `limit` published nodes for one sub-query.
pub async fn search(
    conn: &mut PgConnection,
    tenant_id: &str,
    space_id: Uuid,
    sub_query: &SubQuery,
    limit: usize,
) -> Result<Vec<Hit>, sqlx::Error> {
    let text = sub_query.search_text();
    if text.is_empty() {
        return Ok(Vec::new());
    }
    type Row = (Uuid, Uuid, i32, String, serde_json::Value, String, f64);
    let rows: Vec<Row> = sqlx::query_as(&search_sql())
        .bind(tenant_id)
        .bind(space_id)
        .bind(text)
        .bind(i64::try_from(limit).unwrap_or(100))
        .fetch_all(conn)
        .await?;
    Ok(rows
        .into_iter()
        .map(
            |(node_id, document_id, document_version, filename, heading_path, content, rank)| Hit {
                node_id,
                document_id,
                document_version,
                filename,
                heading_path,
                content,
                rank,
            },
        )
        .collect())
}
