//! The platform's canonical encodings, reproduced byte for byte: its canonical JSON
//! (`stableJson`), its deterministic child ids, its UUID v5 node ids, its full-text
//! normalisation and its page-index terms. Invariant: every function here is pure and gives, for
//! the same input, exactly what the platform's own code gives, so rows and digests written by
//! kfs-worker are the rows and digests the platform would have written; string order is the
//! root collation the platform's `localeCompare` uses, never byte order.

use std::cmp::Ordering;
use std::sync::LazyLock;

use icu_collator::options::CollatorOptions;
use icu_collator::CollatorBorrowed;
use serde_json::Value;
use sha2::{Digest, Sha256};
use unicode_normalization::UnicodeNormalization;
use unicode_script::{Script, UnicodeScript};
use uuid::Uuid;

static COLLATOR: LazyLock<CollatorBorrowed<'static>> = LazyLock::new(|| {
    CollatorBorrowed::try_new(Default::default(), CollatorOptions::default())
        .expect("the root collation is compiled in")
});

/// Compares two strings as the platform's `a.localeCompare(b)` does (root collation).
pub fn locale_compare(a: &str, b: &str) -> Ordering {
    COLLATOR.compare(a, b)
}

/// Lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The platform's `stableJson`: object keys in collation order, `null` members kept, no
/// whitespace, strings and numbers as `JSON.stringify` writes them.
pub fn stable_json(v: &Value) -> String {
    let mut out = String::new();
    write_stable(v, &mut out);
    out
}

fn write_stable(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort_by(|a, b| locale_compare(a, b));
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String((*k).clone()).to_string());
                out.push(':');
                write_stable(&map[*k], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_stable(item, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// `sha256_hex(stable_json(v))`: the platform's digest of a JSON value.
pub fn stable_digest(v: &Value) -> String {
    sha256_hex(stable_json(v).as_bytes())
}

/// The platform's `deterministicChildId(parent, seed)`: SHA-256 of `"<parent>:<seed>"`, laid out
/// as a UUID with version nibble 5 and the RFC 4122 variant.
pub fn child_id(parent: impl std::fmt::Display, seed: &str) -> Uuid {
    let hex = sha256_hex(format!("{parent}:{seed}").as_bytes());
    let b = hex.as_bytes();
    let variant = (u8::from_str_radix(&hex[16..17], 16).unwrap_or(0) & 0x3) | 0x8;
    let text = format!(
        "{}-{}-5{}-{:x}{}-{}",
        &hex[0..8],
        &hex[8..12],
        std::str::from_utf8(&b[13..16]).unwrap_or("000"),
        variant,
        &hex[17..20],
        &hex[20..32]
    );
    Uuid::parse_str(&text).expect("a child id is a well-formed UUID")
}

/// RFC 4122 UUID v5 (SHA-1), as the platform's chunker names nodes.
pub fn uuid_v5(namespace: Uuid, name: &str) -> Uuid {
    Uuid::new_v5(&namespace, name.as_bytes())
}

fn is_cjk(c: char) -> bool {
    matches!(
        c.script(),
        Script::Han | Script::Hiragana | Script::Katakana | Script::Hangul
    )
}

fn is_word_char(c: char) -> bool {
    c.is_alphabetic() || c.is_numeric()
}

/// The platform's `normalizeMixedLanguageFtsText`: NFKC, lower case, then words of letters and
/// digits separated by one space, each CJK character a word of its own. This is the text whose
/// `to_tsvector('simple', …)` is a node's full-text projection, and the text a query is
/// normalised to before `plainto_tsquery('simple', …)`.
pub fn normalize_fts_text(s: &str) -> String {
    let lowered: String = s.nfkc().collect::<String>().to_lowercase();
    let mut words: Vec<String> = Vec::new();
    let mut current = String::new();
    for c in lowered.chars() {
        if is_cjk(c) {
            if !current.is_empty() {
                words.push(std::mem::take(&mut current));
            }
            words.push(c.to_string());
        } else if is_word_char(c) {
            current.push(c);
        } else if !current.is_empty() {
            words.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() {
        words.push(current);
    }
    words.join(" ")
}

/// The longest page-index term, in characters and in bytes.
pub const MAX_TERM_CHARS: usize = 128;
pub const MAX_TERM_BYTES: usize = 256;

/// The platform's page-index terms of a text (`pageIndexTextTerms`): NFKC, lower case, runs of
/// letters and digits, each CJK character a term of its own; distinct, in first-seen order. A
/// term longer than the limits is an error.
pub fn page_index_terms(s: &str) -> Result<Vec<String>, String> {
    let mut terms: Vec<String> = Vec::new();
    for word in normalize_fts_text(s).split(' ').filter(|w| !w.is_empty()) {
        if word.chars().count() > MAX_TERM_CHARS || word.len() > MAX_TERM_BYTES {
            return Err(format!(
                "a page-index term of {} characters is longer than {MAX_TERM_CHARS}",
                word.chars().count()
            ));
        }
        if !terms.iter().any(|t| t == word) {
            terms.push(word.to_owned());
        }
    }
    Ok(terms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn stable_json_orders_keys_as_locale_compare_does() {
        let v = json!({"projectionSetVersion": 1, "projections": [], "chunkerVersion": "c", "a": null,
                       "nested": {"b": 1, "B": 2, "a": [3, {"z": "é\"", "y": true}]}});
        assert_eq!(
            stable_json(&v),
            r#"{"a":null,"chunkerVersion":"c","nested":{"a":[3,{"y":true,"z":"é\""}],"b":1,"B":2},"projections":[],"projectionSetVersion":1}"#
        );
        assert_eq!(locale_compare("ab", "aB"), Ordering::Less);
        assert_eq!(locale_compare("e", "é"), Ordering::Less);
        assert_eq!(locale_compare("é", "f"), Ordering::Less);
        assert_eq!(locale_compare("10", "2"), Ordering::Less);
    }

    #[test]
    fn digests_match_the_platforms_own_vector_space_id() {
        // The platform's legacy vector space id of an OpenAI embedding selection at revision 1.
        let material = json!({"model": "text-embedding-3-small", "pluginId": "langgenius/openai",
                              "provider": "openai", "revision": 1, "schemaVersion": 1});
        assert_eq!(
            stable_digest(&material),
            "dee54439e74d6aa00be2145649df55d567e0587ee48bd89a7b27a9b10a846fa1"
        );
    }

    #[test]
    fn child_ids_are_version_5_shaped_sha256() {
        let parent = Uuid::from_u128(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef);
        let id = child_id(parent, "seed");
        let hex = sha256_hex(format!("{parent}:seed").as_bytes());
        let s = id.to_string();
        assert_eq!(&s[0..8], &hex[0..8]);
        assert_eq!(&s[9..13], &hex[8..12]);
        assert_eq!(&s[14..15], "5");
        assert_eq!(&s[15..18], &hex[13..16]);
        assert!(matches!(&s[19..20], "8" | "9" | "a" | "b"), "{s}");
        assert_eq!(&s[20..23], &hex[17..20]);
        assert_eq!(&s[24..36], &hex[20..32]);
        assert_eq!(child_id(parent, "seed"), id);
        assert_ne!(child_id(parent, "other"), id);
    }

    #[test]
    fn fts_text_is_nfkc_lowercase_words_and_single_cjk_characters() {
        for (input, want) in [
            ("Hello, World!", "hello world"),
            ("  Ｆｕｌｌ　ｗｉｄｔｈ １２３ ", "full width 123"),
            // U+30FC (ー) has Script=Common: it joins the Latin word after it, as in the platform.
            ("東京タワーis高い", "東 京 タ ワ ーis 高 い"),
            ("naïve café—déjà vu", "naïve café déjà vu"),
            ("a_b-c.d", "a b c d"),
            ("", ""),
            ("!!!", ""),
        ] {
            assert_eq!(normalize_fts_text(input), want, "{input:?}");
        }
    }

    #[test]
    fn page_index_terms_are_distinct_and_bounded() {
        assert_eq!(
            page_index_terms("Leases and leases AND fencing").unwrap(),
            ["leases", "and", "fencing"]
        );
        assert!(page_index_terms(&"x".repeat(129)).is_err());
        assert_eq!(page_index_terms(&"x".repeat(128)).unwrap().len(), 1);
    }

    #[test]
    fn uuid_v5_is_the_rfc_one() {
        // RFC 4122 appendix: the DNS namespace and "www.example.com".
        let dns = Uuid::parse_str("6ba7b810-9dad-11d1-80b4-00c04fd430c8").unwrap();
        assert_eq!(
            uuid_v5(dns, "www.example.com").to_string(),
            "2ed6657d-e927-568b-95e1-2665a8aea6a2"
        );
    }
}
