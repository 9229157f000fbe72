//! Images a parser returned inline (the image blocks a parser service sends as base64 when
//! asked for them) moved into the object store, as the platform's multimodal asset extractor
//! moves them. Invariant: an artifact that reaches `parse_artifacts` carries no `data:` URI:
//! each image is stored once under the document's prefix and this attempt's write-owner folder
//! (`<tenant>/spaces/<space>/documents/<document>/assets/<attempt>/<element>-<sha12>.<ext>`, so
//! a retry of the attempt writes the same keys again and another attempt never touches them),
//! and its `assetRef` names the key, the bytes' SHA-256 and where they came from; an image
//! over the platform's caps keeps no bytes and says why (`analysisUnavailable`).

use base64::Engine as _;
use bytes::Bytes;
use serde_json::{json, Value};
use uuid::Uuid;

use super::artifact::Element;
use crate::canonical::sha256_hex;
use crate::engine::kind::JobError;
use crate::store::Store;

/// The platform's caps: one image, all of a document's images, and how many.
pub const MAX_IMAGE_BYTES: usize = 10 * 1024 * 1024;
pub const MAX_TOTAL_BYTES: usize = 64 * 1024 * 1024;
pub const MAX_IMAGES: usize = 1000;

/// What was extracted, for the artifact's `multimodalAssets` metadata.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Extracted {
    pub count: usize,
    pub bytes: usize,
    pub skipped: usize,
}

/// The media type and bytes of a `data:<type>;base64,<data>` URI.
fn decode_data_uri(uri: &str) -> Option<(String, Vec<u8>)> {
    let rest = uri.strip_prefix("data:")?;
    let (head, data) = rest.split_once(',')?;
    let mime = head.strip_suffix(";base64")?;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .ok()?;
    Some((mime.trim().to_ascii_lowercase(), bytes))
}

/// The platform's file extension of an image type.
fn extension(mime: &str) -> &'static str {
    match mime {
        "image/png" => "png",
        "image/jpeg" | "image/jpg" => "jpg",
        "image/gif" => "gif",
        "image/webp" => "webp",
        "image/svg+xml" => "svg",
        "image/tiff" => "tiff",
        "image/bmp" => "bmp",
        "image/avif" => "avif",
        _ => "bin",
    }
}

/// An element id as a key segment: lower case, runs of other characters as `-`.
fn safe(id: &str) -> String {
    let mut out = String::new();
    for c in id.to_lowercase().chars() {
        if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
            out.push(c);
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    out.trim_matches('-').to_owned()
}

/// Moves every inline image of `elements` into the store under `prefix` (the document's key
/// prefix) and `owner` (the attempt), rewriting each `assetRef`.
pub async fn extract(
    store: &Store,
    prefix: &str,
    owner: Uuid,
    elements: &mut [Element],
) -> Result<Extracted, JobError> {
    let mut done = Extracted::default();
    for e in elements.iter_mut() {
        let Some(uri) = e.metadata["assetRef"]["uri"].as_str() else {
            continue;
        };
        if !uri.starts_with("data:") {
            continue;
        }
        let source_sha = sha256_hex(uri.as_bytes());
        let Some((mime, bytes)) = decode_data_uri(uri) else {
            e.metadata["assetRef"] = json!({
                "analysisUnavailable": { "reason": "invalid-data-uri" },
                "sourceUriSha256": source_sha,
            });
            done.skipped += 1;
            continue;
        };
        let over = if bytes.len() > MAX_IMAGE_BYTES {
            Some("asset-too-large")
        } else if done.bytes + bytes.len() > MAX_TOTAL_BYTES || done.count >= MAX_IMAGES {
            Some("document-asset-budget")
        } else {
            None
        };
        if let Some(reason) = over {
            e.metadata["assetRef"] = json!({
                "analysisUnavailable": { "reason": reason },
                "contentType": mime,
                "sourceUriSha256": source_sha,
            });
            done.skipped += 1;
            continue;
        }
        let sha = sha256_hex(&bytes);
        let key = format!(
            "{prefix}/assets/{owner}/{}-{}.{}",
            safe(&e.id),
            &sha[..12],
            extension(&mime)
        );
        done.bytes += bytes.len();
        store
            .put(&key, Bytes::from(bytes))
            .await
            .map_err(|err| JobError::retryable("store_unavailable", err.to_string()))?;
        e.metadata["assetRef"] = json!({
            "contentType": mime,
            "objectKey": key,
            "sha256": sha,
            "source": "data-uri",
            "sourceUriSha256": source_sha,
        });
        done.count += 1;
    }
    Ok(done)
}

/// The artifact metadata's `multimodalAssets` of an extraction, `None` when there was nothing.
pub fn metadata(done: &Extracted) -> Option<Value> {
    (done.count + done.skipped > 0).then(|| {
        json!({
            "extractedCount": done.count,
            "materializedBytes": done.bytes,
            "skippedForCapCount": done.skipped,
            "sources": ["data-uri"],
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_uris_decode_and_name_their_type() {
        assert_eq!(
            decode_data_uri("data:image/PNG;base64,aGk="),
            Some(("image/png".into(), b"hi".to_vec()))
        );
        for bad in [
            "data:image/png,aGk=",
            "data:image/png;base64,***",
            "http://x/y.png",
        ] {
            assert_eq!(decode_data_uri(bad), None, "{bad}");
        }
        assert_eq!(extension("image/jpeg"), "jpg");
        assert_eq!(extension("application/x-thing"), "bin");
        assert_eq!(safe("9f0c…:element-12"), "9f0c-element-12");
    }
}
