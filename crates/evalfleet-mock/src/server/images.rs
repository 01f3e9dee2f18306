//! The images of a chat request, decoded, checked and hashed.

use serde_json::Value;

use super::request::{ChatMessage, ChatRequest};

/// An image of a request, decoded.
pub(super) struct ReceivedImage {
    /// SHA-256 of its bytes (hex); `None` for a URL, not fetched.
    pub(super) sha256: Option<String>,
    pub(super) bytes: u64,
}

/// A chat request with its images checked.
pub(super) struct Checked {
    pub(super) request: ChatRequest,
    pub(super) images: Vec<ReceivedImage>,
}

/// The images of `messages` (`image_url` parts: a data URL, bare base64,
/// or an http(s) URL, which is not fetched), each decoded to check that
/// it is an image, and hashed; or why one is not, naming its part.
pub(super) async fn checked_images(messages: &[ChatMessage]) -> Result<Vec<ReceivedImage>, String> {
    let mut urls = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        let Value::Array(parts) = &message.content else {
            continue;
        };
        for (j, part) in parts.iter().enumerate() {
            if part.get("type").and_then(Value::as_str) != Some("image_url") {
                continue;
            }
            let url = part
                .get("image_url")
                .and_then(|u| u.get("url"))
                .and_then(Value::as_str)
                .ok_or_else(|| format!("messages[{i}].content[{j}]: image_url.url is missing"))?;
            urls.push((format!("messages[{i}].content[{j}]"), url.to_owned()));
        }
    }
    if urls.is_empty() {
        return Ok(Vec::new());
    }
    // Decoding is CPU work: off the async threads, awaited in place by the
    // request it is for.
    #[allow(clippy::disallowed_methods)]
    tokio::task::spawn_blocking(move || {
        urls.iter().map(|(at, url)| decode_image(at, url)).collect()
    })
    .await
    .map_err(|err| format!("image check failed: {err}"))?
}

fn decode_image(at: &str, url: &str) -> Result<ReceivedImage, String> {
    use base64::Engine as _;
    use sha2::Digest as _;
    if url.starts_with("http://") || url.starts_with("https://") {
        return Ok(ReceivedImage {
            sha256: None,
            bytes: 0,
        });
    }
    let data = match url.strip_prefix("data:") {
        Some(rest) => match rest.split_once(',') {
            Some((head, data)) if head.ends_with(";base64") => data,
            _ => {
                return Err(format!(
                    "{at}: a data URL of an image must be base64 (data:TYPE;base64,...)"
                ));
            }
        },
        None => url,
    };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|err| format!("{at}: the image is not valid base64: {err}"))?;
    image::load_from_memory(&bytes)
        .map_err(|err| format!("{at}: the image cannot be decoded: {err}"))?;
    Ok(ReceivedImage {
        sha256: Some(hex::encode(sha2::Sha256::digest(&bytes))),
        bytes: bytes.len() as u64,
    })
}
