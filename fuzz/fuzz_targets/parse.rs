//! Fuzzes document parsing: arbitrary bytes as text, Markdown and HTML through
//! `parse::parse`, `parse::outline`, `parse::chunks` and `parse::probe_words`, the pure
//! functions a compile runs on a user's document. Invariant (theirs, `src/jobs/compile/parse.rs`):
//! no input makes them panic; the same bytes give the same sections, outline and chunks; every
//! chunk holds at most the maximum characters (at least 16), has a letter or digit, and never
//! spans two sections.
#![no_main]

use kfs_worker::jobs::compile::parse::{self, Format};
use libfuzzer_sys::fuzz_target;

const FORMATS: [Format; 3] = [Format::Text, Format::Markdown, Format::Html];

fuzz_target!(|data: &[u8]| {
    let Some((&selector, bytes)) = data.split_first() else {
        return;
    };
    let format = FORMATS[usize::from(selector) % FORMATS.len()];
    let max_chars = usize::from(selector / 3) * 8;
    let Ok(parsed) = parse::parse(format, bytes) else {
        return;
    };
    assert_eq!(
        Ok(&parsed),
        parse::parse(format, bytes).as_ref(),
        "parsing is deterministic"
    );
    assert_eq!(parse::outline(&parsed), parse::outline(&parsed));
    let chunks = parse::chunks(&parsed, max_chars);
    assert_eq!(
        chunks,
        parse::chunks(&parsed, max_chars),
        "chunking is deterministic"
    );
    let paths: Vec<&Vec<String>> = parsed.sections.iter().map(|s| &s.heading_path).collect();
    for c in &chunks {
        assert!(
            c.content.chars().count() <= max_chars.max(16),
            "chunk too long"
        );
        assert!(
            c.content.chars().any(char::is_alphanumeric),
            "chunk without a letter or digit"
        );
        assert!(
            paths.contains(&&c.heading_path),
            "chunk outside every section"
        );
        let _ = parse::probe_words(&c.content);
    }
});
