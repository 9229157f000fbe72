//! One element of a parse artifact: what every parser produces and the artifact, the outline and
//! the chunkers read. Invariant: it depends on nothing of the compile, so the parsers and the
//! artifact builder both import it and never each other.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One element of a parse artifact (`parse_artifacts.elements[i]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Element {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(rename = "sectionPath", default)]
    pub section_path: Vec<String>,
    #[serde(
        rename = "pageNumber",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub page_number: Option<i32>,
    #[serde(default)]
    pub metadata: Value,
}

impl Element {
    /// The element's text without surrounding Unicode whitespace ("" when it has none).
    pub fn trimmed(&self) -> &str {
        self.text.as_deref().map_or("", str::trim)
    }

    pub fn is_heading(&self) -> bool {
        matches!(self.kind.as_str(), "heading" | "title")
    }
}

/// `parse_artifacts.content_type`: `mixed` when any element is code, an image, a list or a
/// table, else `text`.
pub fn content_type_of(elements: &[Element]) -> &'static str {
    if elements
        .iter()
        .any(|e| matches!(e.kind.as_str(), "code" | "image" | "list" | "table"))
    {
        "mixed"
    } else {
        "text"
    }
}
