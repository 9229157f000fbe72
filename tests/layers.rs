//! The house's layering, read from the `crate::`, `super::` and `self::` paths of `src/` (code
//! only: comments and `#[cfg(test)]` modules are left out). Floors, lowest first:
//!
//! ```text
//!   process   cli  runtime  http  status  maintenance  dlq  tools
//!      │ may import everything below
//!   intakes   relay  consumer  poller
//!      │
//!   kinds     jobs/<kind>  (the registry: jobs/mod.rs)
//!      │
//!   engine    engine/  (the slice runner, leases, the wire format)
//!      │
//!   leaves    config tls canonical crash telemetry db liveness metrics broker store command
//!             access capability publication progress embed model
//! ```
//!
//! A room imports only rooms on its own floor or below; imports within a floor form no circle;
//! and no two files import each other, directly or round a circle (a file may use what the
//! modules above it in its own folder define: that is how a folder is built, not a circle).
//! [`UPWARD`] lists the imports allowed to run upward, each with its reason — at most three.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The rooms of each floor, lowest first.
const FLOORS: &[(&str, &[&str])] = &[
    (
        "leaves",
        &[
            "config",
            "tls",
            "canonical",
            "crash",
            "telemetry",
            "db",
            "liveness",
            "metrics",
            "broker",
            "store",
            "command",
            "access",
            "capability",
            "publication",
            "progress",
            "embed",
            "model",
        ],
    ),
    ("engine", &["engine"]),
    ("kinds", &["jobs"]),
    ("intakes", &["relay", "consumer", "poller"]),
    (
        "process",
        &[
            "maintenance",
            "status",
            "dlq",
            "http",
            "runtime",
            "cli",
            "tools",
            "lib",
            "main",
        ],
    ),
];

/// Imports that run upward: (importing room, imported room, why). At most three.
const UPWARD: &[(&str, &str, &str)] = &[];

fn floor(room: &str) -> Option<usize> {
    FLOORS.iter().position(|(_, rooms)| rooms.contains(&room))
}

/// A source file's module path (`src/jobs/deletion/request.rs` → `jobs::deletion::request`).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of a file: no comment lines, nothing from its `#[cfg(test)]` module on.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod ") {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn ident(b: &[u8], mut i: usize) -> (usize, String) {
    let start = i;
    while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
        i += 1;
    }
    (i, String::from_utf8_lossy(&b[start..i]).into_owned())
}

/// Every path the code names from `crate`, `super` or `self`, as written (groups expanded one
/// level: `super::{a, b::c}` gives `super::a` and `super::b::c`).
fn paths(code: &str) -> Vec<Vec<String>> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let boundary =
            i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_' || b[i - 1] == b':');
        if !boundary || !(b[i].is_ascii_alphabetic()) {
            i += 1;
            continue;
        }
        let (end, first) = ident(b, i);
        if !matches!(first.as_str(), "crate" | "super" | "self") || !code[end..].starts_with("::") {
            i = end.max(i + 1);
            continue;
        }
        let mut segs = vec![first];
        let mut j = end;
        let mut grouped = false;
        while code[j..].starts_with("::") {
            j += 2;
            if code[j..].starts_with('{') {
                // One level of a group.
                let close = code[j..].find('}').map_or(code.len(), |k| j + k);
                for item in code[j + 1..close].split(',') {
                    let item = item.trim();
                    let name: String = item
                        .split(|c: char| c.is_whitespace())
                        .next()
                        .unwrap_or("")
                        .to_owned();
                    if name.is_empty() || name == "self" {
                        continue;
                    }
                    let mut p = segs.clone();
                    p.extend(name.split("::").map(str::to_owned));
                    out.push(p);
                }
                j = close;
                grouped = true;
                break;
            }
            let (e, s) = ident(b, j);
            if s.is_empty() {
                break;
            }
            segs.push(s);
            j = e;
            if code[j..].starts_with("::super") {
                continue;
            }
        }
        if !grouped {
            out.push(segs);
        }
        i = j.max(i + 1);
    }
    out
}

/// The module a path names: resolved against the file's module, cut to the longest prefix that
/// is a module of the crate.
fn resolve(
    from: &[String],
    is_mod_file: bool,
    path: &[String],
    modules: &BTreeSet<Vec<String>>,
) -> Option<Vec<String>> {
    // The module `self` means: the file's own.
    let mut base: Vec<String> = from.to_vec();
    let _ = is_mod_file;
    let mut rest = path;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        Some("super") => {
            while rest.first().map(String::as_str) == Some("super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        _ => return None,
    }
    let mut full = base;
    full.extend(rest.iter().cloned());
    (0..=full.len())
        .rev()
        .map(|n| full[..n].to_vec())
        .find(|p| modules.contains(p))
}

fn room(m: &[String]) -> String {
    m.first().cloned().unwrap_or_else(|| "lib".into())
}

/// Strongly connected components of more than one node.
fn circles(edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<Vec<String>>> {
    #[derive(Default)]
    struct T<'a> {
        index: BTreeMap<&'a Vec<String>, usize>,
        low: BTreeMap<&'a Vec<String>, usize>,
        stack: Vec<&'a Vec<String>>,
        on: BTreeSet<&'a Vec<String>>,
        out: Vec<Vec<Vec<String>>>,
        n: usize,
    }
    fn visit<'a>(
        v: &'a Vec<String>,
        edges: &'a BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        t: &mut T<'a>,
    ) {
        t.index.insert(v, t.n);
        t.low.insert(v, t.n);
        t.n += 1;
        t.stack.push(v);
        t.on.insert(v);
        for w in edges.get(v).into_iter().flatten() {
            if !t.index.contains_key(w) {
                visit(w, edges, t);
                let l = t.low[v].min(t.low[w]);
                t.low.insert(v, l);
            } else if t.on.contains(w) {
                let l = t.low[v].min(t.index[w]);
                t.low.insert(v, l);
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.clone());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T::default();
    for v in edges.keys() {
        if !t.index.contains_key(v) {
            visit(v, edges, &mut t);
        }
    }
    t.out
}

#[test]
fn the_house_has_no_circle_and_no_room_imports_one_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, &mut all);
    all.sort();
    let modules: BTreeSet<Vec<String>> = all.iter().map(|f| module_of(&src, f)).collect();
    let mut file_edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    let mut upward = Vec::new();
    let mut unplaced = BTreeSet::new();
    for f in &all {
        let me = module_of(&src, f);
        let is_mod = f.file_stem().is_some_and(|s| s == "mod" || s == "lib");
        let text = std::fs::read_to_string(f).unwrap();
        for p in paths(&code(&text)) {
            let Some(target) = resolve(&me, is_mod, &p, &modules) else {
                continue;
            };
            // Using what a module above it in its own folder defines is how a folder is built.
            if target.is_empty() || me.starts_with(&target) {
                continue;
            }
            file_edges
                .entry(me.clone())
                .or_default()
                .insert(target.clone());
            let (a, b) = (room(&me), room(&target));
            if a == b {
                continue;
            }
            match (floor(&a), floor(&b)) {
                (Some(fa), Some(fb))
                    if fb > fa && !UPWARD.iter().any(|(x, y, _)| *x == a && *y == b) =>
                {
                    upward.push(format!(
                        "{} imports {} ({})",
                        me.join("::"),
                        p.join("::"),
                        FLOORS[fb].0
                    ));
                }
                (None, _) => {
                    unplaced.insert(a);
                }
                (_, None) => {
                    unplaced.insert(b);
                }
                _ => {}
            }
        }
    }
    assert!(UPWARD.len() <= 3, "at most three upward imports");
    assert!(
        unplaced.is_empty(),
        "rooms on no floor (add them to FLOORS): {unplaced:?}"
    );
    upward.sort();
    upward.dedup();
    assert!(
        upward.is_empty(),
        "imports that run upward:\n  {}",
        upward.join("\n  ")
    );
    // Circles between rooms, and between files.
    let mut room_edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (a, targets) in &file_edges {
        for b in targets {
            if room(a) != room(b) {
                room_edges
                    .entry(vec![room(a)])
                    .or_default()
                    .insert(vec![room(b)]);
            }
        }
    }
    let show = |cs: Vec<Vec<Vec<String>>>| {
        cs.iter()
            .map(|c| {
                c.iter()
                    .map(|m| m.join("::"))
                    .collect::<Vec<_>>()
                    .join(" ⇄ ")
            })
            .collect::<Vec<_>>()
    };
    let rooms = show(circles(&room_edges));
    assert!(
        rooms.is_empty(),
        "circles between rooms:\n  {}",
        rooms.join("\n  ")
    );
    let files = show(circles(&file_edges));
    assert!(
        files.is_empty(),
        "circles between files:\n  {}",
        files.join("\n  ")
    );
}

#[test]
fn the_reader_finds_paths_through_groups_and_supers() {
    let code = "use crate::engine::kind::{Kind, KindSpec};\nuse super::super::authz;\nlet x = self::fence::check(); crate::db::acquire(p)";
    let got: Vec<String> = paths(code).iter().map(|p| p.join("::")).collect();
    assert_eq!(
        got,
        [
            "crate::engine::kind::Kind",
            "crate::engine::kind::KindSpec",
            "super::super::authz",
            "self::fence::check",
            "crate::db::acquire"
        ]
    );
    let modules: BTreeSet<Vec<String>> = [
        vec![],
        vec!["jobs".to_owned()],
        vec!["jobs".to_owned(), "authz".to_owned()],
    ]
    .into_iter()
    .collect();
    let from = vec![
        "jobs".to_owned(),
        "deletion".to_owned(),
        "request".to_owned(),
    ];
    let r = resolve(
        &from,
        false,
        &["super".into(), "super".into(), "authz".into()],
        &modules,
    );
    assert_eq!(r, Some(vec!["jobs".to_owned(), "authz".to_owned()]));
}
