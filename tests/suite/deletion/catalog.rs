//! The schema, generically: which rows of every table (and which objects under the store's
//! directory) belong to a space or to documents, and checks that nothing of them is left or
//! that other spaces are untouched.

use super::*;

// ---------------------------------------------------------------------------------------------
// The object store, as files

pub(super) fn files_under(root: &Path, prefix: &str) -> BTreeSet<String> {
    fn walk(base: &Path, p: &Path, out: &mut BTreeSet<String>) {
        let Ok(rd) = std::fs::read_dir(p) else {
            return;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(base, &p, out);
            } else if let Ok(rel) = p.strip_prefix(base) {
                out.insert(rel.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(root, &root.join(prefix), &mut out);
    out
}

// ---------------------------------------------------------------------------------------------
// The schema, generically: which rows of every table belong to a space or to documents

pub(super) struct Catalog {
    tables: Vec<String>,
    columns: BTreeMap<String, BTreeSet<String>>,
    /// Foreign keys: (child, columns, parent, parent columns).
    fks: Vec<(String, Vec<String>, String, Vec<String>)>,
}

/// The deletion job tables keep their rows by design (job, redacted items, outbox, tombstone).
pub(super) fn kept_by_design(table: &str) -> bool {
    table.starts_with("deletion_")
}

pub(super) async fn catalog(pool: &PgPool) -> Catalog {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public' \
           AND table_type = 'BASE TABLE' AND table_name NOT LIKE 'kfs\\_%' AND table_name <> 'schema_migrations' \
         ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(
        tables.len() >= 60,
        "the 0018 schema has 60 tables: {tables:?}"
    );
    let cols: Vec<(String, String)> = sqlx::query_as(
        "SELECT table_name::text, column_name::text FROM information_schema.columns WHERE table_schema = 'public'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut columns: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (t, c) in cols {
        columns.entry(t).or_default().insert(c);
    }
    let fks: Vec<(String, Vec<String>, String, Vec<String>)> = sqlx::query_as(
        "SELECT c.conrelid::regclass::text, \
           ARRAY(SELECT a.attname::text FROM unnest(c.conkey) WITH ORDINALITY k(n, i) \
                 JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.n ORDER BY k.i), \
           c.confrelid::regclass::text, \
           ARRAY(SELECT a.attname::text FROM unnest(c.confkey) WITH ORDINALITY k(n, i) \
                 JOIN pg_attribute a ON a.attrelid = c.confrelid AND a.attnum = k.n ORDER BY k.i) \
         FROM pg_constraint c WHERE c.contype = 'f'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    Catalog {
        tables,
        columns,
        fks,
    }
}

impl Catalog {
    /// A predicate on `table` for its rows of space `$1` (documents `$2` when `space` is false:
    /// only rows of those documents), through its own columns or its parents' (a row cannot
    /// outlive its parent, so this reaches every child table).
    pub(super) fn owned(&self, table: &str, space: bool, depth: u32) -> Option<String> {
        let cols = self.columns.get(table)?;
        if space && table == "knowledge_spaces" {
            return Some("id = $1".into());
        }
        if space && cols.contains("knowledge_space_id") {
            return Some("knowledge_space_id = $1".into());
        }
        if cols.contains("document_asset_id") {
            return Some("document_asset_id = ANY($2)".into());
        }
        if !space && table == "document_assets" {
            return Some("id = ANY($2)".into());
        }
        if depth > 4 {
            return None;
        }
        let preds: Vec<String> = self
            .fks
            .iter()
            .filter(|(child, _, parent, _)| child == table && parent != table)
            .filter_map(|(_, cols, parent, pcols)| {
                self.owned(parent, space, depth + 1).map(|p| {
                    format!(
                        "({}) IN (SELECT {} FROM {parent} WHERE {p})",
                        cols.join(", "),
                        pcols.join(", ")
                    )
                })
            })
            .collect();
        (!preds.is_empty()).then(|| format!("({})", preds.join(" OR ")))
    }

    /// Rows per table that belong to the space (`docs`: its documents).
    pub(super) async fn count_owned(
        &self,
        pool: &PgPool,
        space: Option<Uuid>,
        docs: &[Uuid],
    ) -> BTreeMap<String, i64> {
        let mut out = BTreeMap::new();
        for t in self.tables.iter().filter(|t| !kept_by_design(t)) {
            let Some(pred) = self.owned(t, space.is_some(), 0) else {
                continue;
            };
            let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {t} WHERE {pred}"))
                .bind(space.unwrap_or_default())
                .bind(docs)
                .fetch_one(pool)
                .await
                .unwrap_or_else(|e| panic!("{t}: {e}"));
            if n > 0 {
                out.insert(t.clone(), n);
            }
        }
        out
    }

    /// Rows of any table (but the deletion job's own) whose text names one of `needles`.
    pub(super) async fn mentions(
        &self,
        pool: &PgPool,
        needles: &[String],
    ) -> BTreeMap<String, i64> {
        let patterns: Vec<String> = needles.iter().map(|n| format!("%{n}%")).collect();
        let mut out = BTreeMap::new();
        for t in self.tables.iter().filter(|t| !kept_by_design(t)) {
            let n: i64 = sqlx::query_scalar(&format!(
                "SELECT count(*) FROM {t} x WHERE x::text LIKE ANY($1)"
            ))
            .bind(&patterns)
            .fetch_one(pool)
            .await
            .unwrap();
            if n > 0 {
                out.insert(t.clone(), n);
            }
        }
        out
    }

    /// A digest of every row of every table that belongs to `space` (and its documents).
    pub(super) async fn fingerprint(&self, pool: &PgPool, space: Uuid) -> BTreeMap<String, String> {
        let docs: Vec<Uuid> =
            sqlx::query_scalar("SELECT id FROM document_assets WHERE knowledge_space_id = $1")
                .bind(space)
                .fetch_all(pool)
                .await
                .unwrap();
        let mut out = BTreeMap::new();
        for t in &self.tables {
            let Some(pred) = self.owned(t, true, 0) else {
                continue;
            };
            let digest: Option<String> = sqlx::query_scalar(&format!(
                "SELECT md5(string_agg(x::text, '|' ORDER BY x::text)) FROM {t} x WHERE {pred}"
            ))
            .bind(space)
            .bind(&docs)
            .fetch_one(pool)
            .await
            .unwrap();
            if let Some(d) = digest {
                out.insert(t.clone(), d);
            }
        }
        out
    }
}

/// Other spaces' rows and objects, to compare before and after.
pub(super) struct Untouched {
    rows: Vec<BTreeMap<String, String>>,
    objects: Vec<BTreeSet<String>>,
}

pub(super) async fn untouched(fx: &SpaceFx, cat: &Catalog, others: &[&Space]) -> Untouched {
    let mut rows = Vec::new();
    let mut objects = Vec::new();
    for o in others {
        rows.push(cat.fingerprint(fx.pool(), o.id).await);
        objects.push(files_under(&fx.dir, &o.prefix));
    }
    Untouched { rows, objects }
}

pub(super) async fn assert_untouched(
    fx: &SpaceFx,
    cat: &Catalog,
    others: &[&Space],
    before: &Untouched,
) {
    let now = untouched(fx, cat, others).await;
    for (i, o) in others.iter().enumerate() {
        assert!(
            before.rows[i].len() > 20,
            "{} has rows in too few tables to mean anything",
            o.id
        );
        let changed: Vec<&String> = before.rows[i]
            .iter()
            .filter(|(t, d)| now.rows[i].get(*t) != Some(*d))
            .map(|(t, _)| t)
            .chain(
                now.rows[i]
                    .keys()
                    .filter(|t| !before.rows[i].contains_key(*t)),
            )
            .collect();
        assert!(
            changed.is_empty(),
            "rows of {} ({}) changed in {changed:?}",
            o.id,
            o.tenant
        );
        assert_eq!(
            now.objects[i], before.objects[i],
            "objects of {} changed",
            o.id
        );
        assert!(!before.objects[i].is_empty());
    }
}

/// Everything a document leaves behind, to look for after its deletion: its id, its nodes'
/// ids, its object keys and its folder.
pub(super) async fn needles_of(fx: &SpaceFx, s: &Space, doc: Uuid) -> Vec<String> {
    let mut out = vec![doc.to_string(), format!("{}/documents/{doc}", s.prefix)];
    for (n, _) in nodes_of(fx.pool(), doc).await {
        out.push(n.to_string());
    }
    let key: String = sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
        .bind(doc)
        .fetch_one(fx.pool())
        .await
        .unwrap();
    out.push(key);
    out
}

/// Nothing of the documents is left in any table of the schema, nor under their folders.
pub(super) async fn assert_documents_gone(
    fx: &SpaceFx,
    cat: &Catalog,
    s: &Space,
    docs: &[Uuid],
    needles: &[String],
) {
    let owned = cat.count_owned(fx.pool(), None, docs).await;
    assert!(owned.is_empty(), "rows of the documents left: {owned:?}");
    let named = cat.mentions(fx.pool(), needles).await;
    assert!(
        named.is_empty(),
        "rows naming the documents left: {named:?}"
    );
    for d in docs {
        let left = files_under(&fx.dir, &format!("{}/documents/{d}", s.prefix));
        assert!(left.is_empty(), "objects of {d} left: {left:?}");
    }
}
