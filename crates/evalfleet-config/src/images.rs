//! Images in messages: a message's content as a list of parts (text and
//! images), the `images:` shorthand, and `task.images`, the settings of
//! how image values become the bytes sent.

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::Value;

use super::path;
use super::problems::Problems;

/// One part of a message's content, as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// A template giving text.
    Text(String),
    /// A template giving one image value, or an expression (`{{ pages }}`)
    /// giving a list of them.
    Image(String),
}

/// The shapes `content` takes, for the schema only.
#[derive(JsonSchema)]
#[serde(untagged)]
#[allow(dead_code)] // described, never built
pub(super) enum ContentShape {
    /// A template over the item's fields.
    Text(String),
    /// Parts: text and images, sent in this order.
    Parts(Vec<PartShape>),
}

/// One part of a message: `text` or `image`.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)] // described, never built
pub(super) struct PartShape {
    /// A template giving text (`"Read this page: {{ title }}"`). Required
    /// in a text part (a part is `text` or `image`).
    text: Option<String>,
    /// A template giving an image: a path (relative to the dataset file's
    /// folder, or absolute), an http(s) URL, a data URL or base64. A lone
    /// expression whose value is a list (`"{{ pages }}"`) gives one image
    /// each. Required in an image part.
    image: Option<String>,
}

/// `task.images`: how image values become the bytes sent.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawImages {
    /// Images whose longer side is longer are scaled down to it (keeping
    /// their proportions), and sent re-encoded (`format`). Default: none
    /// (sizes as they are).
    pub max_side: Option<u32>,
    /// Re-encode every image as `png`, `jpeg` or `webp` (lossless). Default:
    /// none: a PNG, JPEG or WebP file is sent as its bytes are; TIFF and
    /// PDF pages are sent as PNG.
    pub format: Option<String>,
    /// JPEG quality, 1 to 100. Default 90.
    pub quality: Option<u8>,
    /// Which pages of a PDF are sent, each as an image: `first`, `all`, or a
    /// page number (from 1). Rendered with poppler's `pdftoppm`, which must
    /// be installed (`apt install poppler-utils`). Default `first`.
    #[schemars(with = "Option<PdfPagesShape>")]
    pub pdf_pages: Option<Value>,
    /// Resolution of rendered PDF pages, in dots per inch, 18 to 600.
    /// Default 150.
    pub pdf_dpi: Option<u32>,
    /// Fetch http(s) image URLs and send their bytes (as data URLs);
    /// otherwise the URL itself is sent and the endpoint fetches it. A
    /// fetch that has not finished in 60 seconds fails its item. Default
    /// `false`.
    pub fetch_urls: Option<bool>,
    /// The most bytes one image value may have, as read: a file, a fetched
    /// URL (its download stops there) or decoded base64; a larger one fails
    /// its item, naming it. 1000 to 10000000000. Default 50000000 (50 MB).
    pub max_bytes: Option<u64>,
    /// How many image values may be held in memory at once, read and ready
    /// to send (a PDF's pages count as one value), 1 to 100000. Items whose
    /// images would pass it wait to start: memory is bounded by this times
    /// the size of an image (at most `max_bytes`), whatever the dataset's
    /// size. Default 128 (twice
    /// a concurrency of 64, so that the next calls' images are ready while
    /// the present ones are in flight).
    pub in_memory: Option<u32>,
}

/// The shapes of `pdf_pages`, for the schema only.
#[derive(JsonSchema)]
#[serde(untagged)]
#[allow(dead_code)] // described, never built
enum PdfPagesShape {
    Named(String),
    Page(u32),
}

/// An image format that images can be re-encoded as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    Png,
    Jpeg,
    Webp,
}

impl ImageFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Png => "png",
            Self::Jpeg => "jpeg",
            Self::Webp => "webp",
        }
    }
}

/// Which pages of a PDF are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdfPages {
    First,
    All,
    /// One page, from 1.
    Page(u32),
}

/// `task.images`, validated (see [`RawImages`] for each key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSettings {
    pub max_side: Option<u32>,
    pub format: Option<ImageFormat>,
    pub quality: u8,
    pub pdf_pages: PdfPages,
    pub pdf_dpi: u32,
    pub fetch_urls: bool,
    pub in_memory: u32,
    pub max_bytes: u64,
    /// For a config from outside (`evalfleet serve`): the directories image
    /// files must be under (see [`super::Admission`]); `None`: anywhere.
    pub roots: Option<Vec<std::path::PathBuf>>,
}

impl Default for ImageSettings {
    fn default() -> Self {
        Self {
            max_side: None,
            format: None,
            quality: 90,
            pdf_pages: PdfPages::First,
            pdf_dpi: 150,
            fetch_urls: false,
            in_memory: 128,
            max_bytes: 50_000_000,
            roots: None,
        }
    }
}

impl ImageSettings {
    /// Where `path` may be read from: itself, resolved, or `None` when it
    /// is outside the roots of a config from outside.
    pub fn readable(&self, path: &std::path::Path) -> Option<std::path::PathBuf> {
        match &self.roots {
            None => Some(path.to_owned()),
            Some(roots) => super::Admission {
                roots: roots.clone(),
                ..super::Admission::default()
            }
            .confined(path),
        }
    }

    /// Whether an image is decoded and encoded again before it is sent
    /// (otherwise a PNG, JPEG or WebP file goes as its bytes are).
    pub fn reencodes(&self) -> bool {
        self.max_side.is_some() || self.format.is_some()
    }

    /// What of these settings determines the bytes sent (not `in_memory`),
    /// as JSON for the run's fingerprint.
    pub fn identity(&self) -> Value {
        serde_json::json!({
            "max_side": self.max_side,
            "format": self.format.map(ImageFormat::as_str),
            "quality": self.quality,
            "pdf_pages": match self.pdf_pages {
                PdfPages::First => Value::from("first"),
                PdfPages::All => Value::from("all"),
                PdfPages::Page(n) => Value::from(n),
            },
            "pdf_dpi": self.pdf_dpi,
            "fetch_urls": self.fetch_urls,
        })
    }
}

/// `task.images`, validated.
pub(super) fn settings(raw: Option<RawImages>, p: &mut Problems<'_>) -> Option<ImageSettings> {
    let Some(raw) = raw else {
        return Some(ImageSettings::default());
    };
    let mut out = ImageSettings::default();
    let mut ok = true;
    let mut bad = |p: &mut Problems<'_>, key: &str, message: String| {
        ok = false;
        p.push::<()>(&path::key("task.images", key), message);
    };
    let mut within = |p: &mut Problems<'_>, key: &str, value: Option<u32>, lo: u32, hi: u32| {
        let value = value?;
        if (lo..=hi).contains(&value) {
            return Some(value);
        }
        bad(
            p,
            key,
            format!("must be between {lo} and {hi}, got {value}"),
        );
        None
    };
    out.max_side = within(p, "max_side", raw.max_side, 16, 16_384);
    let quality = within(p, "quality", raw.quality.map(u32::from), 1, 100);
    out.quality = quality
        .and_then(|q| u8::try_from(q).ok())
        .unwrap_or(out.quality);
    out.pdf_dpi = within(p, "pdf_dpi", raw.pdf_dpi, 18, 600).unwrap_or(out.pdf_dpi);
    out.in_memory = within(p, "in_memory", raw.in_memory, 1, 100_000).unwrap_or(out.in_memory);
    out.fetch_urls = raw.fetch_urls.unwrap_or(false);
    match raw.max_bytes {
        None => {}
        Some(n @ 1_000..=10_000_000_000) => out.max_bytes = n,
        Some(n) => bad(
            p,
            "max_bytes",
            format!("must be between 1000 and 10000000000, got {n}"),
        ),
    }
    match raw.format.as_deref() {
        None => {}
        Some("png") => out.format = Some(ImageFormat::Png),
        Some("jpeg" | "jpg") => out.format = Some(ImageFormat::Jpeg),
        Some("webp") => out.format = Some(ImageFormat::Webp),
        Some(other) => bad(
            p,
            "format",
            format!("must be png, jpeg or webp, got '{other}'"),
        ),
    }
    match &raw.pdf_pages {
        None => {}
        Some(Value::String(s)) if s == "first" => out.pdf_pages = PdfPages::First,
        Some(Value::String(s)) if s == "all" => out.pdf_pages = PdfPages::All,
        Some(value) => match value.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(n) if n >= 1 => out.pdf_pages = PdfPages::Page(n),
            _ => bad(
                p,
                "pdf_pages",
                format!("must be first, all or a page number from 1, got {value}"),
            ),
        },
    }
    ok.then_some(out)
}

/// A message's `content` (at `at`) as parts, with the `images:` shorthand
/// (`images_at`: `before` or `after` the text) put in place. `None` for a
/// plain text content without images (`text` is then the content).
pub(super) fn parts(
    content: Value,
    images: Option<String>,
    images_at: Option<&str>,
    at: &str,
    p: &mut Problems<'_>,
) -> Option<(String, Vec<Part>)> {
    let content_at = path::key(at, "content");
    let (text, mut parts) = match content {
        Value::String(text) => (text, Vec::new()),
        Value::Array(list) => {
            if list.is_empty() {
                return p.push(&content_at, "must hold at least one part");
            }
            let mut parts = Vec::with_capacity(list.len());
            let mut ok = true;
            for (i, item) in list.into_iter().enumerate() {
                let part_at = path::index(&content_at, i);
                let part = match item {
                    Value::Object(map) if map.len() == 1 => match map.into_iter().next() {
                        Some((key, Value::String(t))) if key == "text" => Some(Part::Text(t)),
                        Some((key, Value::String(t))) if key == "image" => Some(Part::Image(t)),
                        Some((key, _)) => {
                            p.push(&path::key(&part_at, &key), "must be a template (a string)")
                        }
                        None => None,
                    },
                    _ => p.push(
                        &part_at,
                        "must be a mapping of one key: text (a template) or image (a template \
                         giving an image)",
                    ),
                };
                match part {
                    Some(part) => parts.push(part),
                    None => ok = false,
                }
            }
            if !ok {
                return None;
            }
            if images.is_some() {
                return p.push(
                    &path::key(at, "images"),
                    "cannot be used with a content of parts (put an image part among them)",
                );
            }
            return Some((String::new(), parts));
        }
        _ => {
            return p.push(
                &content_at,
                "must be a template (a string) or a list of parts (text and image)",
            );
        }
    };
    let Some(images) = images else {
        if images_at.is_some() {
            return p.push(&path::key(at, "images_at"), "goes with images");
        }
        return Some((text, Vec::new()));
    };
    match images_at.unwrap_or("before") {
        "before" => parts.extend([Part::Image(images), Part::Text(text)]),
        "after" => parts.extend([Part::Text(text), Part::Image(images)]),
        other => {
            return p.push(
                &path::key(at, "images_at"),
                format!("must be before or after, got '{other}'"),
            );
        }
    }
    Some((String::new(), parts))
}
