//! An item's images read by its task's first step: a fetched URL and a data
//! URL, sent as data URLs named by hash, with a bound on how many are held.

use std::sync::Arc;

use base64::Engine as _;
use evalfleet_config::{ImageSettings, MessageTemplate, Part, TaskConfig, TaskKind};
use evalfleet_io::dataset::Row;
use evalfleet_io::images::{PLACEHOLDER, write_body};
use evalfleet_io::template::Templates;
use evalfleet_pipeline::task::images::Loader;
use evalfleet_pipeline::task::{ItemContext, Step};
use futures_util::FutureExt as _;
use sha2::Digest as _;

fn png() -> Vec<u8> {
    let image = image::RgbImage::from_fn(3, 2, |x, y| image::Rgb([x as u8 * 80, y as u8 * 90, 7]));
    let mut out = Vec::new();
    image::DynamicImage::ImageRgb8(image)
        .write_with_encoder(image::codecs::png::PngEncoder::new(&mut out))
        .unwrap();
    out
}

fn templates() -> Templates {
    let mut message = MessageTemplate::text("user", "");
    message.parts = vec![
        Part::Text("Read:".into()),
        Part::Image("{{ pages }}".into()),
    ];
    Templates::compile(&TaskConfig {
        prompts: Vec::new(),
        kind: TaskKind::Chat,
        messages: vec![message],
        images: ImageSettings::default(),
        params: Default::default(),
        stream: false,
        samples: 1,
        eval: Default::default(),
    })
    .unwrap()
}

/// The first step of an item whose row is `row`.
fn first_step(loader: &Arc<Loader>, templates: &Templates, row: &str) -> Step {
    let parsed: Row = serde_json::from_str(row).unwrap();
    let messages = templates.render_parts(&parsed).unwrap();
    let cell = std::cell::OnceCell::from(parsed);
    loader.clone().first_call(
        messages,
        None,
        &ItemContext::new("item", &cell, row, 0).at_line(3),
    )
}

#[tokio::test]
async fn fetched_and_inline_images_go_as_data_urls_named_by_hash_within_the_memory_bound() {
    let bytes = png();
    let served = bytes.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().route(
        "/a.png",
        axum::routing::get(move || async move { served.clone() }),
    );
    let server = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let _ = rustls::crypto::ring::default_provider().install_default();
    let settings = ImageSettings {
        fetch_urls: true,
        in_memory: 2,
        ..ImageSettings::default()
    };
    let loader = Arc::new(Loader::new(&settings, std::env::temp_dir()).unwrap());
    let templates = templates();
    let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
    let row = format!(r#"{{"pages": ["http://{addr}/a.png", "data:image/png;base64,{b64}"]}}"#);
    let Step::Work(work) = first_step(&loader, &templates, &row) else {
        panic!("images are read as work");
    };
    let Step::Call(request) = work.await else {
        panic!("the images were read");
    };
    let sha = hex::encode(sha2::Sha256::digest(&bytes));
    let stored: Vec<_> = request.images.references();
    assert_eq!(stored.len(), 2);
    assert!(
        stored
            .iter()
            .all(|r| r.sha256.as_deref() == Some(sha.as_str()))
    );
    assert_eq!(stored[0].source, format!("http://{addr}/a.png"));
    assert!(
        stored[1].source.starts_with("data:image/png;base64 ("),
        "{}",
        stored[1].source
    );
    let messages = request.messages.get();
    assert_eq!(
        messages.matches(&format!("{PLACEHOLDER}{sha}")).count(),
        2,
        "{messages}"
    );
    assert!(!messages.contains(&b64), "no bytes in the messages");
    let mut body = Vec::new();
    write_body(messages, &request.images, &mut body);
    let body = String::from_utf8(body).unwrap();
    assert_eq!(
        body.matches(&format!("data:image/png;base64,{b64}"))
            .count(),
        2
    );

    // Both places in memory are held by this request's images: the next
    // item waits until they are dropped.
    let Step::Work(next) = first_step(&loader, &templates, &row) else {
        panic!("images are read as work");
    };
    let mut next = next.boxed();
    assert!(
        (&mut next).now_or_never().is_none(),
        "no room for its images yet"
    );
    drop(request);
    assert!(matches!(next.await, Step::Call(_)));

    // A missing file fails the item, naming the file and the line.
    let Step::Work(missing) = first_step(&loader, &templates, r#"{"pages": "gone.png"}"#) else {
        panic!("images are read as work");
    };
    let Step::Finish(finish) = missing.await else {
        panic!("a missing image ends the item");
    };
    let error = finish.error.unwrap();
    assert!(
        error.starts_with("image of item 'item' (dataset line 3): cannot read ")
            && error.contains("gone.png"),
        "{error}"
    );
    server.abort();
}

#[tokio::test]
async fn an_image_larger_than_max_bytes_fails_its_item_naming_it_whatever_its_source() {
    use futures_util::StreamExt as _;
    const MAX: u64 = 2_000;
    // Bytes that start as a PNG, too many of them: with a length, and
    // streamed without one (read until the bound, no further).
    let mut big = png();
    big.resize(5_000, 0);
    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = sent.clone();
    let with_length = big.clone();
    let app = axum::Router::new()
        .route(
            "/sized.png",
            axum::routing::get(move || async move { with_length.clone() }),
        )
        .route(
            "/streamed.png",
            axum::routing::get(move || async move {
                let counted = counted.clone();
                let chunks = futures_util::stream::iter(0..100_000).map(move |_| {
                    counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    Ok::<_, std::io::Error>(bytes::Bytes::from(vec![0_u8; 1_000]))
                });
                axum::body::Body::from_stream(chunks)
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("big.png"), &big).unwrap();
    std::fs::write(dir.path().join("small.png"), png()).unwrap();
    let settings = ImageSettings {
        fetch_urls: true,
        max_bytes: MAX,
        ..ImageSettings::default()
    };
    let loader = Arc::new(Loader::new(&settings, dir.path().to_owned()).unwrap());
    let templates = templates();
    let b64 = base64::engine::general_purpose::STANDARD.encode(&big);
    let fails = |value: String| {
        let loader = loader.clone();
        let row = serde_json::json!({ "pages": ["small.png", value] }).to_string();
        let step = first_step(&loader, &templates, &row);
        async move {
            let Step::Work(work) = step else {
                panic!("images are read as work");
            };
            let Step::Finish(finish) = work.await else {
                panic!("{row}: a too large image ends the item");
            };
            finish.error.unwrap()
        }
    };
    let says = |error: &str, shown: &str| {
        assert!(
            error.starts_with(&format!("image of item 'item' (dataset line 3): {shown}: "))
                && error.contains("is larger than task.images.max_bytes (2000 bytes)"),
            "{error}"
        );
    };
    says(&fails("big.png".into()).await, "big.png");
    says(
        &fails(format!("data:image/png;base64,{b64}")).await,
        &format!("data:image/png;base64 ({} chars)", b64.len()),
    );
    says(
        &fails(b64.clone()).await,
        &format!("base64 ({} chars)", b64.len()),
    );
    says(
        &fails(format!("http://{addr}/sized.png")).await,
        &format!("http://{addr}/sized.png"),
    );
    says(
        &fails(format!("http://{addr}/streamed.png")).await,
        &format!("http://{addr}/streamed.png"),
    );
    // The download stopped at the bound: far from all of the 100 MB was
    // produced (the sockets' buffers hold some).
    let produced = sent.load(std::sync::atomic::Ordering::Relaxed);
    assert!(produced < 50_000, "{produced} chunks of 1000 bytes sent");

    // Within the bound, the same sources are read.
    let Step::Work(work) = first_step(&loader, &templates, r#"{"pages": ["small.png"]}"#) else {
        panic!("images are read as work");
    };
    assert!(matches!(work.await, Step::Call(_)));
    server.abort();
}
