//! Images sent with a request: an image value (a path, a URL, a data URL or
//! base64) read, checked, optionally rescaled and re-encoded, and hashed;
//! and the request body that carries them.
//!
//! A request's messages name each image by the SHA-256 of the bytes sent
//! (`evalfleet-image:sha256:HEX` in place of its URL), so that the cache key,
//! attempt records and anything else made from the messages holds the hash,
//! never the bytes; the client puts the data URL in place as it writes the
//! body ([`write_body`]). The reading is blocking work: callers run it off
//! the async threads.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use evalfleet_types::ImageRef;
use sha2::{Digest, Sha256};

use evalfleet_config::{ImageFormat, ImageSettings, PdfPages};

/// What stands for an image's data URL in a request's messages, before
/// the hash.
pub const PLACEHOLDER: &str = "evalfleet-image:sha256:";

/// Pixels decoded at once in this process, whatever the images and however
/// many items read them at once: a decoded image takes 3 or 4 bytes a
/// pixel (and scaling it down, by averaging, little more), so decoding
/// stays within a few hundred MB (8 items of one 8,000 x 8,000 PNG at
/// concurrency 8: 279-285 MB peak RSS for the whole run, against 1,985 MB
/// unbounded; 64 A4 pages scanned at 300 dpi, 239-255 MB; V3 in
/// docs/benchmarks.md). An image of more pixels than this is decoded
/// alone. (Such buffers go back to the system when freed: the binary
/// sets glibc's threshold for mapping them, see its `main`.)
pub const DECODE_PIXELS: u64 = 48_000_000;

/// The pixels being decoded now, over every thread.
struct PixelBudget {
    used: std::sync::Mutex<u64>,
    freed: std::sync::Condvar,
    limit: u64,
}

/// A share of a [`PixelBudget`], given back when dropped.
struct Decoding<'a> {
    budget: &'a PixelBudget,
    pixels: u64,
}

impl PixelBudget {
    const fn new(limit: u64) -> Self {
        Self {
            used: std::sync::Mutex::new(0),
            freed: std::sync::Condvar::new(),
            limit,
        }
    }

    /// Waits until `pixels` more may be decoded (at once when nothing is
    /// being decoded, however many they are).
    fn take(&self, pixels: u64) -> Decoding<'_> {
        let pixels = pixels.min(self.limit);
        let mut used = self
            .used
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while *used > 0 && *used + pixels > self.limit {
            used = self
                .freed
                .wait(used)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        *used += pixels;
        Decoding {
            budget: self,
            pixels,
        }
    }
}

impl Drop for Decoding<'_> {
    fn drop(&mut self) {
        let mut used = self
            .budget
            .used
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *used -= self.pixels;
        self.budget.freed.notify_all();
    }
}

static DECODING: PixelBudget = PixelBudget::new(DECODE_PIXELS);

/// One image, ready to send.
#[derive(Clone, Debug)]
pub struct Image {
    /// Where it came from, and its hash.
    pub reference: ImageRef,
    /// How it is sent.
    pub payload: Payload,
}

/// How an image is sent.
#[derive(Clone)]
pub enum Payload {
    /// Its bytes, as a data URL of this media type.
    Bytes { mime: &'static str, bytes: Bytes },
    /// The URL itself; the endpoint fetches it.
    Url(String),
}

impl std::fmt::Debug for Payload {
    // Never the bytes: requests are logged.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Bytes { mime, bytes } => write!(f, "{mime} ({} bytes)", bytes.len()),
            Self::Url(url) => write!(f, "{url}"),
        }
    }
}

impl Image {
    /// What takes the place of its URL in the messages.
    pub fn url_in_messages(&self) -> String {
        match (&self.payload, &self.reference.sha256) {
            (Payload::Bytes { .. }, Some(sha)) => format!("{PLACEHOLDER}{sha}"),
            (Payload::Url(url), _) => url.clone(),
            (Payload::Bytes { .. }, None) => String::new(),
        }
    }
}

/// The images of a request (none, mostly), cheap to clone; while any clone
/// lives, it holds its place among the images allowed in memory.
#[derive(Clone, Default)]
pub struct Images(Option<Arc<Held>>);

struct Held {
    images: Vec<Image>,
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Images {
    /// `images`, holding `permit` (a place in memory) as long as they live.
    pub fn new(images: Vec<Image>, permit: Option<tokio::sync::OwnedSemaphorePermit>) -> Self {
        if images.is_empty() {
            return Self(None);
        }
        Self(Some(Arc::new(Held {
            images,
            _permit: permit,
        })))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Image> {
        self.0.iter().flat_map(|held| held.images.iter())
    }

    /// What the store keeps of them.
    pub fn references(&self) -> Vec<ImageRef> {
        self.iter().map(|image| image.reference.clone()).collect()
    }

    fn by_hash(&self, sha256: &str) -> Option<(&'static str, &Bytes)> {
        self.iter().find_map(|image| match &image.payload {
            Payload::Bytes { mime, bytes } if image.reference.sha256.as_deref() == Some(sha256) => {
                Some((*mime, bytes))
            }
            _ => None,
        })
    }
}

impl std::fmt::Debug for Images {
    // The hashes only: a request is logged and compared, its bytes never.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(
                self.iter()
                    .map(|i| i.reference.sha256.as_deref().unwrap_or("url")),
            )
            .finish()
    }
}

/// Appends `messages` (JSON) to `out` with each image placeholder replaced
/// by the data URL of its bytes. A placeholder of no image in `images` is
/// left as it is.
pub fn write_body(messages: &str, images: &Images, out: &mut Vec<u8>) {
    let quoted = format!("\"{PLACEHOLDER}");
    let mut rest = messages;
    while let Some(at) = rest.find(&quoted) {
        let (before, after) = rest.split_at(at);
        out.extend_from_slice(before.as_bytes());
        let after = &after[quoted.len()..];
        let found = after
            .get(..64)
            .filter(|_| after.as_bytes().get(64) == Some(&b'"'))
            .and_then(|hash| images.by_hash(hash));
        match found {
            Some((mime, bytes)) => {
                out.extend_from_slice(b"\"data:");
                out.extend_from_slice(mime.as_bytes());
                out.extend_from_slice(b";base64,");
                let start = out.len();
                out.resize(
                    start + base64::encoded_len(bytes.len(), true).unwrap_or(0),
                    0,
                );
                let written = STANDARD.encode_slice(bytes, &mut out[start..]).unwrap_or(0);
                out.truncate(start + written);
                rest = &after[64..];
            }
            None => {
                out.extend_from_slice(quoted.as_bytes());
                rest = after;
            }
        }
    }
    out.extend_from_slice(rest.as_bytes());
}

/// `text` with the base64 of every data URL in it cut out (an error that
/// quotes a request must not carry its images into the store).
pub fn redact(text: &str) -> String {
    const MARK: &str = ";base64,";
    let mut out = String::with_capacity(text.len().min(4096));
    let mut rest = text;
    while let Some(at) = rest.find(MARK) {
        let end = at + MARK.len();
        out.push_str(&rest[..end]);
        let data = rest[end..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '/' | '=')))
            .unwrap_or(rest.len() - end);
        if data > 0 {
            out.push_str(&format!("[{data} chars]"));
        }
        rest = &rest[end + data..];
    }
    out.push_str(rest);
    out
}

/// Why an image value cannot be sent.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{shown}: {problem}")]
    Bad { shown: String, problem: String },
}

impl ImageError {
    fn bad(shown: &str, problem: impl std::fmt::Display) -> Self {
        Self::Bad {
            shown: shown.to_owned(),
            problem: problem.to_string(),
        }
    }
}

/// Why an image value of more than `max` bytes is refused.
pub fn too_large(max: u64) -> String {
    format!("is larger than task.images.max_bytes ({max} bytes)")
}

/// The bytes of the file at `path`, refused past `max` bytes (read no
/// further than that, should it grow while read).
fn read_file(
    confine: &crate::confine::Confine,
    path: PathBuf,
    shown: &str,
    max: u64,
) -> Result<Vec<u8>, ImageError> {
    use std::io::Read as _;
    let fail = |source| ImageError::Read {
        path: path.clone(),
        source,
    };
    // A config from outside: opened beneath its roots, as it was checked.
    let file = confine.open(&path).map_err(fail)?;
    let size = file.metadata().map_err(fail)?.len();
    if size > max {
        return Err(ImageError::bad(shown, too_large(max)));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(fail)?;
    if bytes.len() as u64 > max {
        return Err(ImageError::bad(shown, too_large(max)));
    }
    Ok(bytes)
}

/// Where an image value points.
#[derive(Debug, PartialEq, Eq)]
pub enum Source<'a> {
    /// A file: the path as given, and as resolved.
    File(&'a str, PathBuf),
    /// An http(s) URL.
    Url(&'a str),
    /// A data URL's media type and base64.
    DataUrl(&'a str, &'a str),
    /// Bare base64.
    Base64(&'a str),
}

impl<'a> Source<'a> {
    /// What `value` is: a data URL, an http(s) URL, base64 (it starts as
    /// a PNG, JPEG, WebP, TIFF or PDF encodes, or is long and all of
    /// base64's alphabet with no dot), else a path relative to `base`.
    pub fn of(value: &'a str, base: &Path) -> Self {
        let value = value.trim();
        if let Some(rest) = value.strip_prefix("data:") {
            let (head, data) = rest.split_once(',').unwrap_or((rest, ""));
            let mime = head.strip_suffix(";base64").unwrap_or(head);
            return Self::DataUrl(mime, data);
        }
        if value.starts_with("http://") || value.starts_with("https://") {
            return Self::Url(value);
        }
        const MAGIC: [&str; 6] = ["iVBORw0KGgo", "/9j/", "UklGR", "SUkq", "TU0AK", "JVBERi0"];
        let alphabet = |c: char| c.is_ascii_alphanumeric() || matches!(c, '+' | '/' | '=');
        if MAGIC.iter().any(|m| value.starts_with(m)) && value.len() > 64
            || value.len() >= 256 && value.chars().all(alphabet)
        {
            return Self::Base64(value);
        }
        Self::File(value, base.join(value))
    }

    /// How the store shows it: a data URL or base64 only by its kind and
    /// length.
    pub fn shown(&self) -> String {
        match self {
            Self::File(given, _) => (*given).to_owned(),
            Self::Url(url) => (*url).to_owned(),
            Self::DataUrl(mime, data) => format!("data:{mime};base64 ({} chars)", data.len()),
            Self::Base64(data) => format!("base64 ({} chars)", data.len()),
        }
    }
}

/// The formats read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Png,
    Jpeg,
    Webp,
    Tiff,
    Pdf,
}

impl Kind {
    fn sniff(bytes: &[u8]) -> Option<Self> {
        if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
            Some(Self::Png)
        } else if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
            Some(Self::Jpeg)
        } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
            Some(Self::Webp)
        } else if bytes.starts_with(b"II*\0") || bytes.starts_with(b"MM\0*") {
            Some(Self::Tiff)
        } else if bytes.starts_with(b"%PDF-") {
            Some(Self::Pdf)
        } else {
            None
        }
    }

    fn codec(self) -> image::ImageFormat {
        match self {
            Self::Png | Self::Pdf => image::ImageFormat::Png,
            Self::Jpeg => image::ImageFormat::Jpeg,
            Self::Webp => image::ImageFormat::WebP,
            Self::Tiff => image::ImageFormat::Tiff,
        }
    }

    /// The format it is sent in when it is not re-encoded; `None`: it must
    /// be (a TIFF).
    fn sendable(self) -> Option<ImageFormat> {
        match self {
            Self::Png => Some(ImageFormat::Png),
            Self::Jpeg => Some(ImageFormat::Jpeg),
            Self::Webp => Some(ImageFormat::Webp),
            Self::Tiff | Self::Pdf => None,
        }
    }
}

fn mime(format: ImageFormat) -> &'static str {
    match format {
        ImageFormat::Png => "image/png",
        ImageFormat::Jpeg => "image/jpeg",
        ImageFormat::Webp => "image/webp",
    }
}

/// The images `value` gives (a PDF may give several pages): read (or
/// `fetched` already, for a URL), checked and prepared as `settings` say.
/// Blocking: files, decoding, and `pdftoppm` for PDFs.
pub fn load(
    value: &str,
    fetched: Option<Vec<u8>>,
    base: &Path,
    settings: &ImageSettings,
) -> Result<Vec<Image>, ImageError> {
    let source = Source::of(value, base);
    let shown = source.shown();
    let bytes = match (&source, fetched) {
        (Source::Url(url), None) => {
            return Ok(vec![Image {
                reference: ImageRef {
                    source: (*url).to_owned(),
                    page: None,
                    sha256: None,
                    bytes: None,
                },
                payload: Payload::Url((*url).to_owned()),
            }]);
        }
        (_, Some(bytes)) => bytes,
        (Source::File(given, path), None) => {
            let Some(path) = settings.readable(path) else {
                return Err(ImageError::bad(
                    given,
                    "is not under the directories this server reads from (--allow-root)",
                ));
            };
            let confine = crate::confine::Confine::of(settings.roots.as_deref());
            read_file(&confine, path, &shown, settings.max_bytes)?
        }
        (Source::DataUrl(_, data) | Source::Base64(data), None) => {
            // Refused before it is decoded when it cannot fit.
            if base64::decoded_len_estimate(data.len()) as u64
                > settings.max_bytes.saturating_add(3)
            {
                return Err(ImageError::bad(&shown, too_large(settings.max_bytes)));
            }
            STANDARD
                .decode(data.as_bytes())
                .map_err(|err| ImageError::bad(&shown, format!("is not valid base64: {err}")))?
        }
    };
    if bytes.len() as u64 > settings.max_bytes {
        return Err(ImageError::bad(&shown, too_large(settings.max_bytes)));
    }
    let kind = Kind::sniff(&bytes)
        .ok_or_else(|| ImageError::bad(&shown, "is not a PNG, JPEG, WebP, TIFF or PDF file"))?;
    if kind == Kind::Pdf {
        let pages = render_pdf(&bytes, settings, &shown)?;
        return pages
            .into_iter()
            .map(|(page, png)| prepare(&shown, Some(page), png, Kind::Png, settings))
            .collect();
    }
    Ok(vec![prepare(&shown, None, bytes, kind, settings)?])
}

/// One image's bytes as they are sent: as they are when no setting asks
/// for a change (only their header is checked), else decoded, scaled down
/// and encoded again.
fn prepare(
    shown: &str,
    page: Option<u32>,
    bytes: Vec<u8>,
    kind: Kind,
    settings: &ImageSettings,
) -> Result<Image, ImageError> {
    let reader = || image::ImageReader::with_format(std::io::Cursor::new(&bytes[..]), kind.codec());
    let (width, height) = reader()
        .into_dimensions()
        .map_err(|err| ImageError::bad(shown, format!("cannot be decoded: {err}")))?;
    let target = settings.format.or(kind.sendable());
    let too_big = settings
        .max_side
        .is_some_and(|side| width.max(height) > side);
    let (format, bytes) = match target {
        Some(format) if !too_big && kind.sendable() == Some(format) => (format, bytes),
        _ => {
            let format = target.unwrap_or(ImageFormat::Png);
            // Held until the image is encoded again and its pixels freed.
            let _decoding = DECODING.take(u64::from(width) * u64::from(height));
            let mut decoded = reader()
                .decode()
                .map_err(|err| ImageError::bad(shown, format!("cannot be decoded: {err}")))?;
            if let Some(side) = settings.max_side.filter(|_| too_big) {
                decoded = scale_down(&decoded, side);
            }
            (format, encode(decoded, format, settings.quality, shown)?)
        }
    };
    let sha256 = hex::encode(Sha256::digest(&bytes));
    Ok(Image {
        reference: ImageRef {
            source: shown.to_owned(),
            page,
            sha256: Some(sha256),
            bytes: Some(bytes.len() as u64),
        },
        payload: Payload::Bytes {
            mime: mime(format),
            bytes: Bytes::from(bytes),
        },
    })
}

/// `image` scaled down to fit `side`. Halved or more, each pixel of the
/// result averages the source pixels it covers (`thumbnail`: no buffer
/// beside the two images, where a filtered resize keeps one of floats the
/// width of the source, some hundreds of MB for a 64-megapixel scan);
/// less than halved, a triangle filter, whose buffer is then small.
fn scale_down(image: &image::DynamicImage, side: u32) -> image::DynamicImage {
    if image.width().max(image.height()) >= side.saturating_mul(2) {
        image.thumbnail(side, side)
    } else {
        image.resize(side, side, image::imageops::FilterType::Triangle)
    }
}

fn encode(
    image: image::DynamicImage,
    format: ImageFormat,
    quality: u8,
    shown: &str,
) -> Result<Vec<u8>, ImageError> {
    let mut out = Vec::new();
    let result = match format {
        ImageFormat::Png => image.write_with_encoder(image::codecs::png::PngEncoder::new(&mut out)),
        ImageFormat::Jpeg => image::DynamicImage::ImageRgb8(image.to_rgb8()).write_with_encoder(
            image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, quality),
        ),
        ImageFormat::Webp => image::DynamicImage::ImageRgba8(image.to_rgba8())
            .write_with_encoder(image::codecs::webp::WebPEncoder::new_lossless(&mut out)),
    };
    result.map_err(|err| {
        ImageError::bad(
            shown,
            format!("cannot be encoded as {}: {err}", format.as_str()),
        )
    })?;
    Ok(out)
}

/// The pages `settings` ask for of a PDF, each as PNG, rendered by
/// poppler's `pdftoppm` in a folder of its own.
fn render_pdf(
    pdf: &[u8],
    settings: &ImageSettings,
    shown: &str,
) -> Result<Vec<(u32, Vec<u8>)>, ImageError> {
    let dir = tempfile::tempdir()
        .map_err(|err| ImageError::bad(shown, format!("no folder to render it in: {err}")))?;
    let input = dir.path().join("in.pdf");
    std::fs::write(&input, pdf)
        .map_err(|err| ImageError::bad(shown, format!("cannot be written to render: {err}")))?;
    let mut command = std::process::Command::new("pdftoppm");
    command
        .arg("-png")
        .arg("-r")
        .arg(settings.pdf_dpi.to_string());
    let (first, single) = match settings.pdf_pages {
        PdfPages::First => (Some(1), true),
        PdfPages::Page(n) => (Some(n), true),
        PdfPages::All => (None, false),
    };
    if let Some(n) = first {
        command.args(["-f", &n.to_string(), "-l", &n.to_string()]);
    }
    let output = command
        .arg(&input)
        .arg(dir.path().join("page"))
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|err| {
            ImageError::bad(
                shown,
                format!("is a PDF, and pdftoppm (poppler-utils) cannot be started: {err}"),
            )
        })?;
    if !output.status.success() {
        let said = String::from_utf8_lossy(&output.stderr);
        return Err(ImageError::bad(
            shown,
            format!("pdftoppm cannot render it: {}", said.trim()),
        ));
    }
    // `page-1.png`, or `page-01.png` with ten pages or more.
    let mut pages: Vec<(u32, PathBuf)> = std::fs::read_dir(dir.path())
        .map_err(|err| ImageError::bad(shown, err))?
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            let number = name
                .strip_prefix("page-")?
                .strip_suffix(".png")?
                .parse()
                .ok()?;
            Some((number, entry.path()))
        })
        .collect();
    pages.sort_unstable();
    if pages.is_empty() || single && pages.len() != 1 {
        return Err(ImageError::bad(
            shown,
            format!("pdftoppm rendered {} pages", pages.len()),
        ));
    }
    pages
        .into_iter()
        .map(|(n, path)| {
            std::fs::read(&path)
                .map(|png| (n, png))
                .map_err(|source| ImageError::Read { path, source })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_at_once_stay_within_the_pixel_budget_and_a_larger_image_goes_alone() {
        use std::sync::atomic::{AtomicU64, Ordering};
        let budget = PixelBudget::new(100);
        let now = AtomicU64::new(0);
        let most = AtomicU64::new(0);
        let alone = AtomicU64::new(0);
        std::thread::scope(|scope| {
            for i in 0..16u64 {
                let (budget, now, most, alone) = (&budget, &now, &most, &alone);
                scope.spawn(move || {
                    // Images of 30 pixels, and two of 250 (past the budget).
                    let pixels = if i % 8 == 0 { 250 } else { 30 };
                    let _held = budget.take(pixels);
                    let counted = pixels.min(100);
                    let at = now.fetch_add(counted, Ordering::SeqCst) + counted;
                    most.fetch_max(at, Ordering::SeqCst);
                    if pixels > 100 && at == 100 {
                        alone.fetch_add(1, Ordering::SeqCst);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    now.fetch_sub(counted, Ordering::SeqCst);
                });
            }
        });
        assert!(most.load(Ordering::SeqCst) <= 100, "{most:?}");
        assert_eq!(
            alone.load(Ordering::SeqCst),
            2,
            "a large image is decoded alone"
        );
        assert_eq!(*budget.used.lock().unwrap(), 0);
    }

    fn png(width: u32, height: u32) -> Vec<u8> {
        let image = image::RgbImage::from_fn(width, height, |x, y| {
            image::Rgb([(x * 7) as u8, (y * 3) as u8, ((x + y) % 256) as u8])
        });
        let mut out = Vec::new();
        image::DynamicImage::ImageRgb8(image)
            .write_with_encoder(image::codecs::png::PngEncoder::new(&mut out))
            .unwrap();
        out
    }

    #[test]
    fn an_image_scaled_down_keeps_its_shape_and_its_colours_on_average() {
        // A checkerboard of black and white pixels, 4,000 x 2,000: halved
        // or more, each pixel averages what it covers (grey); a little
        // smaller, the triangle filter.
        let board = image::RgbImage::from_fn(4000, 2000, |x, y| {
            if (x + y) % 2 == 0 {
                image::Rgb([0, 0, 0])
            } else {
                image::Rgb([255, 255, 255])
            }
        });
        let image = image::DynamicImage::ImageRgb8(board);
        let small = scale_down(&image, 1000).to_rgb8();
        assert_eq!(small.dimensions(), (1000, 500));
        let mean = |img: &image::RgbImage| {
            img.pixels().map(|p| f64::from(p[0])).sum::<f64>()
                / f64::from(img.width() * img.height())
        };
        assert!((mean(&small) - 127.5).abs() < 2.0, "{}", mean(&small));
        assert!(small.pixels().all(|p| (120..=135).contains(&p[0])));
        let near = scale_down(&image, 3000).to_rgb8();
        assert_eq!(near.dimensions(), (3000, 1500));
        assert!((mean(&near) - 127.5).abs() < 2.0, "{}", mean(&near));
    }

    #[test]
    fn data_urls_are_cut_out_of_messages() {
        assert_eq!(
            redact("bad image data:image/png;base64,iVBORw0KGgo= in part 2"),
            "bad image data:image/png;base64,[12 chars] in part 2"
        );
        assert_eq!(redact("nothing here"), "nothing here");
    }

    #[test]
    fn values_are_told_apart() {
        let base = Path::new("/data");
        assert_eq!(
            Source::of("pages/1.png", base),
            Source::File("pages/1.png", PathBuf::from("/data/pages/1.png"))
        );
        assert_eq!(
            Source::of("/abs/1.png", base),
            Source::File("/abs/1.png", PathBuf::from("/abs/1.png"))
        );
        assert_eq!(
            Source::of("https://x/1.png", base),
            Source::Url("https://x/1.png")
        );
        assert_eq!(
            Source::of("data:image/png;base64,AAAA", base),
            Source::DataUrl("image/png", "AAAA")
        );
        let b64 = STANDARD.encode(png(4, 4));
        assert_eq!(Source::of(&b64, base), Source::Base64(&b64));
        assert_eq!(
            Source::of(&b64, base).shown(),
            format!("base64 ({} chars)", b64.len())
        );
    }

    #[test]
    fn a_file_is_sent_as_its_bytes_unless_asked_otherwise() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = png(40, 20);
        std::fs::write(dir.path().join("a.png"), &bytes).unwrap();
        let settings = ImageSettings::default();
        let images = load("a.png", None, dir.path(), &settings).unwrap();
        assert_eq!(images.len(), 1);
        let sha = hex::encode(Sha256::digest(&bytes));
        assert_eq!(images[0].reference.sha256.as_deref(), Some(sha.as_str()));
        assert_eq!(images[0].reference.source, "a.png");

        let small = ImageSettings {
            max_side: Some(20),
            format: Some(ImageFormat::Jpeg),
            ..ImageSettings::default()
        };
        let images = load("a.png", None, dir.path(), &small).unwrap();
        let Payload::Bytes { mime, bytes } = &images[0].payload else {
            panic!("bytes expected");
        };
        assert_eq!(*mime, "image/jpeg");
        let decoded = image::load_from_memory(bytes).unwrap();
        assert_eq!((decoded.width(), decoded.height()), (20, 10));
    }

    #[test]
    fn a_missing_or_broken_image_says_which() {
        let dir = tempfile::tempdir().unwrap();
        let settings = ImageSettings::default();
        let err = load("gone.png", None, dir.path(), &settings).unwrap_err();
        assert!(err.to_string().contains("gone.png"), "{err}");
        std::fs::write(dir.path().join("x.png"), b"not an image").unwrap();
        let err = load("x.png", None, dir.path(), &settings).unwrap_err();
        assert_eq!(
            err.to_string(),
            "x.png: is not a PNG, JPEG, WebP, TIFF or PDF file"
        );
    }

    #[test]
    fn the_body_carries_data_urls_where_the_messages_carry_hashes() {
        let bytes = png(2, 2);
        let sha = hex::encode(Sha256::digest(&bytes));
        let image = Image {
            reference: ImageRef {
                source: "a.png".into(),
                page: None,
                sha256: Some(sha.clone()),
                bytes: Some(bytes.len() as u64),
            },
            payload: Payload::Bytes {
                mime: "image/png",
                bytes: Bytes::from(bytes.clone()),
            },
        };
        let messages = format!(
            r#"[{{"url":"{}"}},{{"url":"{PLACEHOLDER}{}"}}]"#,
            image.url_in_messages(),
            "0".repeat(64)
        );
        let mut out = Vec::new();
        write_body(&messages, &Images::new(vec![image], None), &mut out);
        let expected = format!(
            r#"[{{"url":"data:image/png;base64,{}"}},{{"url":"{PLACEHOLDER}{}"}}]"#,
            STANDARD.encode(&bytes),
            "0".repeat(64)
        );
        assert_eq!(String::from_utf8(out).unwrap(), expected);
    }
}
