//! An item's images, read when the item starts: the first step of a task
//! whose messages have images is [`Step::Work`] that reads them off the
//! async threads, then the call. A bounded number of image values is held
//! in memory at once (`task.images.in_memory`): an item waits for its
//! places before its images are read, and gives them back when its last
//! request is dropped, so memory does not grow with the dataset.

use std::path::PathBuf;
use std::sync::Arc;

use evalfleet_types::Assessment;
use tokio::sync::Semaphore;

use super::{Finish, ItemContext, Request, Step, Target};
use evalfleet_config::ImageSettings;
use evalfleet_io::images::{Image, Images, Source};
use evalfleet_io::template::{RenderedMessage, RenderedPart, messages_with_images};

/// How long fetching one image URL may take, answer and body.
pub const FETCH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Reads the images of items.
pub struct Loader {
    settings: ImageSettings,
    /// The dataset file's folder: paths are relative to it.
    base: PathBuf,
    /// Places for image values in memory.
    memory: Arc<Semaphore>,
    /// Fetches image URLs (`fetch_urls`).
    http: Option<reqwest::Client>,
}

impl Loader {
    pub fn new(settings: &ImageSettings, base: PathBuf) -> Result<Self, String> {
        let http = if settings.fetch_urls {
            Some(
                evalfleet_fleet::client::http_client(8)
                    .map_err(|err| format!("task.images.fetch_urls: no HTTP client: {err}"))?,
            )
        } else {
            None
        };
        Ok(Self {
            settings: settings.clone(),
            base,
            memory: Arc::new(Semaphore::new(settings.in_memory as usize)),
            http,
        })
    }

    /// How many items' images are read at once: enough to keep every core
    /// busy decoding while others wait on their files.
    pub fn readers(&self) -> usize {
        let cores = std::thread::available_parallelism().map_or(2, std::num::NonZero::get);
        (cores * 2).min(self.settings.in_memory as usize).max(1)
    }

    /// The step that reads the images of `messages` (an item's), then
    /// makes its first call; or fails the item, naming the image and the
    /// row, when one cannot be read.
    pub fn first_call(
        self: Arc<Self>,
        messages: Vec<RenderedMessage>,
        prompt: Option<std::sync::Arc<str>>,
        item: &ItemContext<'_>,
    ) -> Step {
        let row = match item.line {
            Some(line) => format!("item '{}' (dataset line {line})", item.item_id),
            None => format!("item '{}'", item.item_id),
        };
        let sample = item.sample;
        Step::Work(Box::pin(async move {
            let failed = |why: String| {
                Step::Finish(Finish::failed(
                    format!("image of {row}: {why}"),
                    Assessment::default(),
                ))
            };
            let (lists, images) = match self.read(&messages).await {
                Ok(read) => read,
                Err(why) => return failed(why),
            };
            match messages_with_images(&messages, &lists) {
                Ok(messages) => Step::Call(Request {
                    target: Target::Items,
                    messages,
                    sample,
                    rejected: None,
                    prompt,
                    images,
                }),
                Err(why) => failed(why),
            }
        }))
    }

    /// The images of each image part of `messages`, and all of them
    /// together holding their places in memory.
    async fn read(
        &self,
        messages: &[RenderedMessage],
    ) -> Result<(Vec<Vec<Image>>, Images), String> {
        let parts: Vec<(String, Vec<String>)> = messages
            .iter()
            .flat_map(|m| m.parts.iter())
            .filter_map(|part| match part {
                RenderedPart::Images { at, values } => Some((at.clone(), values.clone())),
                RenderedPart::Text(_) => None,
            })
            .collect();
        let count = parts.iter().map(|(_, values)| values.len()).sum::<usize>();
        let wanted = count.clamp(1, self.settings.in_memory as usize);
        let permit = self
            .memory
            .clone()
            .acquire_many_owned(u32::try_from(wanted).unwrap_or(u32::MAX))
            .await
            .map_err(|_| "the run is stopping".to_owned())?;
        let mut fetched = Vec::with_capacity(count);
        for (at, values) in &parts {
            for value in values {
                fetched.push(
                    self.fetch(value)
                        .await
                        .map_err(|why| format!("{why} ({at})"))?,
                );
            }
        }
        let settings = self.settings.clone();
        let base = self.base.clone();
        // Awaited in place by the item's step: a step dropped at shutdown
        // leaves at most `readers()` reads to finish on their own, holding
        // nothing of the run's.
        #[allow(clippy::disallowed_methods)]
        let lists = tokio::task::spawn_blocking(move || {
            let mut fetched = fetched.into_iter();
            let mut lists = Vec::with_capacity(parts.len());
            for (at, values) in &parts {
                let mut list = Vec::with_capacity(values.len());
                for value in values {
                    let bytes = fetched.next().flatten();
                    let images = evalfleet_io::images::load(value, bytes, &base, &settings)
                        .map_err(|err| format!("{err} ({at})"))?;
                    list.extend(images);
                }
                lists.push(list);
            }
            Ok::<_, String>(lists)
        })
        .await
        .map_err(|err| format!("reading images failed: {err}"))??;
        let all = lists.iter().flatten().cloned().collect();
        Ok((lists, Images::new(all, Some(permit))))
    }

    /// The bytes of an image URL, when URLs are fetched: read as they
    /// come, no more than `max_bytes` of them, within [`FETCH_TIMEOUT`].
    async fn fetch(&self, value: &str) -> Result<Option<Vec<u8>>, String> {
        let (Some(http), Source::Url(url)) = (&self.http, Source::of(value, &self.base)) else {
            return Ok(None);
        };
        let failed = |err: reqwest::Error| {
            if err.is_timeout() {
                format!(
                    "cannot fetch {url}: no answer within {} s",
                    FETCH_TIMEOUT.as_secs()
                )
            } else {
                format!("cannot fetch {url}: {}", evalfleet_types::error_text(&err))
            }
        };
        let max = self.settings.max_bytes;
        let too_large = || format!("{url}: {}", evalfleet_io::images::too_large(max));
        let mut response = http
            .get(url)
            .timeout(FETCH_TIMEOUT)
            .send()
            .await
            .map_err(failed)?;
        if !response.status().is_success() {
            return Err(format!("cannot fetch {url}: HTTP {}", response.status()));
        }
        if response.content_length().is_some_and(|n| n > max) {
            return Err(too_large());
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(failed)? {
            if (bytes.len() + chunk.len()) as u64 > max {
                return Err(too_large());
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(Some(bytes))
    }
}
