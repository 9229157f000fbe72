//! The platform's read paths over a publication, as SQL text. Invariant: both read only
//! `ready` projections that a named `published` or `superseded` publication serves as
//! `index-projection` members, of parsed, active documents whose source is not being deleted,
//! and only nodes whose permission scope the reader's scopes cover.

/// The read paths' shared parts: the selected columns, the joins from a projection to its
/// node, artifact, document and the publication member that serves it, and the filter that
/// keeps only parsed, active documents whose source is not being deleted.
macro_rules! read_columns {
    () => {
        "SELECT p.id AS projection_id, n.id AS node_id, n.document_asset_id, pa.version AS document_version,
       n.text, n.source_location, da.filename,\n"
    };
}
macro_rules! read_joins {
    () => {
        r#"FROM index_projections p
JOIN knowledge_nodes n ON n.id = p.node_id AND n.knowledge_space_id = p.knowledge_space_id
     AND n.publication_generation_id IS NOT DISTINCT FROM p.publication_generation_id
JOIN parse_artifacts pa ON pa.id = n.parse_artifact_id AND pa.document_asset_id = n.document_asset_id
     AND pa.artifact_hash = n.artifact_hash
JOIN document_assets da ON da.id = n.document_asset_id AND da.knowledge_space_id = n.knowledge_space_id
JOIN projection_set_publications retrieval_pub ON retrieval_pub.tenant_id = $3
     AND retrieval_pub.knowledge_space_id = p.knowledge_space_id AND retrieval_pub.id = $4
     AND retrieval_pub.status IN ('published', 'superseded')
JOIN projection_set_publication_members pm ON pm.tenant_id = retrieval_pub.tenant_id
     AND pm.knowledge_space_id = retrieval_pub.knowledge_space_id AND pm.publication_id = retrieval_pub.id
     AND pm.component_type = 'index-projection' AND pm.component_key = p.id
     AND pm.generation_id = p.publication_generation_id AND pm.document_asset_id = n.document_asset_id
"#
    };
}
macro_rules! read_live_documents {
    () => {
        r#"  AND da.parser_status = 'parsed' AND da.lifecycle_state = 'active'
  AND (da.source_id IS NULL OR EXISTS (SELECT 1 FROM sources s WHERE s.id = da.source_id
       AND s.knowledge_space_id = da.knowledge_space_id AND s.status <> 'deleting' AND s.deletion_job_id IS NULL))
"#
    };
}

/// The query's tsquery (and the dense path's query vector) is made in a scalar subquery, which
/// Postgres runs once per execution: written inline, a generic plan (which research's
/// statements use) parsed it again for every row the filter looked at.
///
/// The platform's full-text read path, as its retrieval runs it: from the named publication
/// (`$4`, which must be `published` or `superseded`) through its `index-projection` members to
/// `ready` `fts` projections and their nodes, of parsed, active documents whose source (if any)
/// is not being deleted, and only nodes whose permission scope the reader's scopes (`$5`, a
/// JSON array) cover. `$1` space, `$2` normalised query text, `$3` tenant. Rows: projection id,
/// node id, document id, document version, node text, node source location, score.
pub const FTS_READ_SQL: &str = concat!(
    "\n",
    read_columns!(),
    r#"       ts_rank(p.fts_document, (SELECT plainto_tsquery('simple', $2)))::float8 AS score
"#,
    read_joins!(),
    r#"WHERE p.knowledge_space_id = $1 AND p.type = 'fts' AND p.status = 'ready'
  AND p.fts_document @@ (SELECT plainto_tsquery('simple', $2))
"#,
    read_live_documents!(),
    r#"  AND (jsonb_array_length(n.permission_scope) = 0 OR $5::jsonb @> n.permission_scope)
ORDER BY score DESC, n.id
"#
);

/// The platform's dense read path over the same publication: `ready` `dense-vector`
/// projections of vector space `$6` and dimension `$5`, nearest to `$2` (the query vector as
/// JSON text) first. `$1` space, `$3` tenant, `$4` publication, `$7` reader scopes.
pub const DENSE_READ_SQL: &str = concat!(
    "\n",
    read_columns!(),
    r#"       (1 - (p.dense_vector <=> (SELECT $2::vector)))::float8 AS score
"#,
    read_joins!(),
    r#"WHERE p.knowledge_space_id = $1 AND p.type = 'dense-vector' AND p.status = 'ready'
  AND p.model = $6 AND p.dense_vector IS NOT NULL AND vector_dims(p.dense_vector) = $5
"#,
    read_live_documents!(),
    r#"  AND (jsonb_array_length(n.permission_scope) = 0 OR $7::jsonb @> n.permission_scope)
ORDER BY p.dense_vector <=> (SELECT $2::vector), n.id
"#
);
