//! Images in items: a dataset of PNG, JPEG and PDF pages made here, sent to
//! a mock that decodes each image and answers by its hash.

use std::path::Path;

use evalfleet_mock::{MockServer, MockSettings};
use sha2::{Digest, Sha256};

use crate::util::*;

fn sha256(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// A PNG of `width` x `height` whose pixels depend on `seed`.
fn png(width: u32, height: u32, seed: u8) -> Vec<u8> {
    let image = image::RgbImage::from_fn(width, height, |x, y| {
        image::Rgb([(x as u8).wrapping_mul(seed), (y as u8) ^ seed, seed])
    });
    let mut out = Vec::new();
    image::DynamicImage::ImageRgb8(image)
        .write_with_encoder(image::codecs::png::PngEncoder::new(&mut out))
        .unwrap();
    out
}

fn jpeg(width: u32, height: u32) -> Vec<u8> {
    let image = image::RgbImage::from_fn(width, height, |x, y| {
        let grain = ((x * 31 + y * 17) % 23) as u8;
        image::Rgb([220 - grain, 215 - grain, 200 - grain])
    });
    let mut out = Vec::new();
    image::DynamicImage::ImageRgb8(image)
        .write_with_encoder(image::codecs::jpeg::JpegEncoder::new_with_quality(
            &mut out, 80,
        ))
        .unwrap();
    out
}

/// A PDF of one page per drawing (a PDF content stream each), no fonts.
fn pdf(pages: &[&str]) -> Vec<u8> {
    let n = pages.len();
    let mut objects = vec![
        "<< /Type /Catalog /Pages 2 0 R >>".to_owned(),
        format!(
            "<< /Type /Pages /Kids [{}] /Count {n} >>",
            (0..n)
                .map(|i| format!("{} 0 R", 3 + i))
                .collect::<Vec<_>>()
                .join(" ")
        ),
    ];
    for i in 0..n {
        objects.push(format!(
            "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 100] /Contents {} 0 R >>",
            3 + n + i
        ));
    }
    for drawing in pages {
        objects.push(format!(
            "<< /Length {} >>\nstream\n{drawing}\nendstream",
            drawing.len()
        ));
    }
    let mut out = b"%PDF-1.4\n".to_vec();
    let mut offsets = Vec::new();
    for (i, object) in objects.iter().enumerate() {
        offsets.push(out.len());
        out.extend_from_slice(format!("{} 0 obj\n{object}\nendobj\n", i + 1).as_bytes());
    }
    let xref = out.len();
    out.extend_from_slice(
        format!("xref\n0 {}\n0000000000 65535 f \n", objects.len() + 1).as_bytes(),
    );
    for offset in offsets {
        out.extend_from_slice(format!("{offset:010} 00000 n \n").as_bytes());
    }
    out.extend_from_slice(
        format!(
            "trailer\n<< /Size {} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n",
            objects.len() + 1
        )
        .as_bytes(),
    );
    out
}

/// The PNG `pdftoppm` renders of page `page` of `pdf` at 150 dpi, as
/// evalfleet renders it by default.
fn rendered(pdf: &Path, page: u32) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new("pdftoppm")
        .args([
            "-png",
            "-r",
            "150",
            "-f",
            &page.to_string(),
            "-l",
            &page.to_string(),
        ])
        .arg(pdf)
        .arg(dir.path().join("p"))
        .output()
        .expect("pdftoppm (poppler-utils) is installed");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let file = std::fs::read_dir(dir.path())
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    std::fs::read(file.path()).unwrap()
}

/// The test's documents: each file, its text, its type, and the hashes of
/// the images it is sent as.
struct Documents {
    rows: Vec<(String, String, &'static str, Vec<String>)>,
}

fn documents(env: &Env) -> Documents {
    std::fs::create_dir_all(env.path("pages")).unwrap();
    let page = png(64, 48, 7);
    std::fs::write(env.path("pages/invoice.png"), &page).unwrap();
    let scan = jpeg(80, 60);
    std::fs::write(env.path("scan.jpg"), &scan).unwrap();
    let doc = pdf(&["0 0 0 rg 20 20 60 30 re f", "0 0 0 rg 100 50 80 20 re f"]);
    std::fs::write(env.path("report.pdf"), &doc).unwrap();
    let pages = vec![
        sha256(&rendered(&env.path("report.pdf"), 1)),
        sha256(&rendered(&env.path("report.pdf"), 2)),
    ];
    Documents {
        rows: vec![
            (
                "pages/invoice.png".into(),
                "Invoice 42".into(),
                "invoice",
                vec![sha256(&page)],
            ),
            (
                "scan.jpg".into(),
                "Scanned receipt".into(),
                "receipt",
                vec![sha256(&scan)],
            ),
            (
                "report.pdf".into(),
                "PAGE ONE\nPAGE TWO".into(),
                "report",
                pages,
            ),
        ],
    }
}

impl Documents {
    /// The dataset, and the mock's script: each image's hash answered
    /// with its text (a PDF's pages with a line each).
    fn write(&self, env: &Env) -> (std::path::PathBuf, std::path::PathBuf) {
        let mut dataset = String::new();
        let mut script = String::new();
        for (i, (file, text, doc_type, hashes)) in self.rows.iter().enumerate() {
            dataset.push_str(
                &serde_json::json!({"id": format!("doc-{i}"), "page": file, "text": text, "doc_type": doc_type})
                    .to_string(),
            );
            dataset.push('\n');
            let lines: Vec<&str> = text.split('\n').collect();
            for (hash, line) in hashes.iter().zip(lines) {
                script.push_str(&serde_json::json!({"image": hash, "replies": [line]}).to_string());
                script.push('\n');
            }
        }
        (
            env.write("docs.jsonl", &dataset),
            env.write("answers.jsonl", &script),
        )
    }
}

fn image_config(dataset: &Path, mock: &MockServer, extra: &str) -> String {
    format!(
        "name: images\n\
         dataset: {{ path: {}, id_field: id }}\n\
         endpoints:\n{}\
         task:\n\
         \x20 images: {{ pdf_pages: all }}\n\
         \x20 messages:\n\
         \x20   - {{ role: user, content: \"Transcribe this {{{{ doc_type }}}}.\", images: \"{{{{ page }}}}\" }}\n\
         \x20 metrics: [{{ name: cer, reference: \"{{{{ text }}}}\" }}]\n\
         {extra}\n",
        dataset.display(),
        external("m", mock, 4),
    )
}

/// Whether poppler's `pdftoppm` is there to render PDF pages.
fn pdftoppm() -> bool {
    let there = std::process::Command::new("pdftoppm")
        .arg("-v")
        .output()
        .is_ok();
    if !there {
        evalfleet_testkit::skip!("pdftoppm (poppler-utils) is absent");
    }
    there
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_arrive_intact_and_each_is_answered_by_its_hash() {
    if !pdftoppm() {
        return;
    }
    let env = Env::new();
    let docs = documents(&env);
    let (dataset, answers) = docs.write(&env);
    let server = scripted(answers).await;
    env.write(
        "run.yaml",
        &image_config(&dataset, &server, "cache: { mode: read_write }"),
    );
    let ran = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "img"])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);

    let stats = server.stats();
    assert_eq!((stats.images, stats.bad_images), (4, 0), "{stats:?}");
    let rows = by_id(&env.export("img").await);
    for (i, (file, text, _, hashes)) in docs.rows.iter().enumerate() {
        let row = &rows[&format!("doc-{i}")];
        // The mock answers an image's text only when its hash is the one
        // of the file (or its rendered page): the bytes arrived whole.
        assert_eq!(row["output"], text.as_str(), "{row}");
        assert_eq!(row["scores"]["cer@1"]["value"], 0.0, "{row}");
        let images = row["images"].as_array().expect("the images are stored");
        let stored: Vec<&str> = images
            .iter()
            .map(|i| i["sha256"].as_str().unwrap())
            .collect();
        assert_eq!(
            stored,
            hashes.iter().map(String::as_str).collect::<Vec<_>>()
        );
        assert!(images.iter().all(|i| i["source"] == file.as_str()), "{row}");
        if file.ends_with(".pdf") {
            assert_eq!(images[1]["page"], 2, "{row}");
        }
    }
    // Nothing of the bytes is stored: no base64 in the store's file.
    let store = std::fs::read(env.store_path()).unwrap();
    assert!(
        !store.windows(7).any(|w| w == b"base64,"),
        "the store holds no data URL"
    );

    // The same images again: every answer from the cache.
    let again = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "img2"])
        .await;
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    assert_eq!(
        server.stats().requests,
        3,
        "all three answered from the cache"
    );

    // One image's bytes change: its item alone is asked again.
    std::fs::write(env.path("pages/invoice.png"), png(64, 48, 9)).unwrap();
    let changed = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "img3"])
        .await;
    assert_eq!(server.stats().requests, 4, "{}", changed.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_image_fails_its_item_until_the_file_is_there() {
    let env = Env::new();
    let server = mock(evalfleet_mock::MockSettings::default()).await;
    // Preflight reads the first rows' images: the missing one comes after.
    let mut dataset = String::new();
    for i in 0..12 {
        if i < 11 {
            std::fs::write(env.path(&format!("p{i}.png")), png(8, 8, i as u8)).unwrap();
        }
        dataset.push_str(&format!("{{\"id\": \"p{i}\", \"page\": \"p{i}.png\", \"text\": \"x\", \"doc_type\": \"page\"}}\n"));
    }
    let dataset = env.write("pages.jsonl", &dataset);
    env.write("run.yaml", &image_config(&dataset, &server, ""));
    let ran = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "m"])
        .await;
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    let rows = by_id(&env.export("m").await);
    let failed = &rows["p11"];
    assert_eq!(failed["status"], "failed");
    let error = failed["error"].as_str().unwrap();
    assert!(
        error.contains("p11.png") && error.contains("dataset line 12"),
        "the file and the row are named: {error}"
    );
    assert_eq!(env.counts("m").done, 11);

    std::fs::write(env.path("p11.png"), png(8, 8, 11)).unwrap();
    let again = env
        .evalfleet(&["resume", "m", "-q", "--retry-failed"])
        .await;
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    let rows = by_id(&env.export("m").await);
    assert_eq!(rows["p11"]["status"], "done", "{}", rows["p11"]);
    assert_eq!(server.stats().images, 12);

    // CSV has the images too: the last column, JSON text as in JSONL.
    let (header, records) = env.export_csv("m").await;
    assert_eq!(
        header.last().map(String::as_str),
        Some("images"),
        "{header:?}"
    );
    let prompt = header.iter().position(|h| h == "prompt").unwrap();
    assert_eq!(header[prompt + 1], "item.doc_type", "{header:?}");
    let mut seen = 0;
    for record in records {
        let id = &record[0];
        let i: u8 = id.strip_prefix('p').unwrap().parse().unwrap();
        let images: serde_json::Value = serde_json::from_str(&record[header.len() - 1]).unwrap();
        assert_eq!(images, rows[id]["images"], "{id}");
        assert_eq!(images[0]["source"], format!("p{i}.png"), "{id}");
        assert_eq!(images[0]["sha256"], sha256(&png(8, 8, i)), "{id}");
        seen += 1;
    }
    assert_eq!(seen, 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preflight_refuses_a_config_whose_first_rows_images_are_missing() {
    let env = Env::new();
    let server = mock(evalfleet_mock::MockSettings::default()).await;
    std::fs::write(env.path("here.png"), png(8, 8, 1)).unwrap();
    let dataset = env.write(
        "pages.jsonl",
        "{\"id\": \"a\", \"page\": \"here.png\", \"text\": \"x\", \"doc_type\": \"page\"}\n\
         {\"id\": \"b\", \"page\": \"gone.png\", \"text\": \"x\", \"doc_type\": \"page\"}\n",
    );
    env.write("run.yaml", &image_config(&dataset, &server, ""));
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("gone.png") && ran.stderr.contains("row 2"),
        "{}",
        ran.stderr
    );
    assert_eq!(server.stats().requests, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_example_runs_on_the_mock_with_every_cer_0() {
    if !pdftoppm() {
        return;
    }
    let env = Env::new();
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/images/images.yaml"
    );
    let ran = env
        .evalfleet(&["run", example, "-q", "--run-id", "ex"])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let rows = env.export("ex").await;
    assert_eq!(rows.len(), 4);
    for row in &rows {
        assert_eq!(row["scores"]["cer@1"]["value"], 0.0, "{row}");
    }
    let pages = rows
        .iter()
        .map(|r| r["images"].as_array().unwrap().len())
        .sum::<usize>();
    assert_eq!(
        pages, 5,
        "two pages of the PDF, and one image per other document"
    );
}

/// The rule of `task.prompts` chosen for an item is recorded when its
/// messages carry images (read before its first call), as it is for text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prompt_rule_of_an_item_with_images_is_recorded() {
    let env = Env::new();
    let mut rows = String::new();
    for (i, doc_type) in ["invoice", "form", "invoice", "letter"].iter().enumerate() {
        std::fs::write(env.path(&format!("p{i}.png")), png(8, 8, i as u8 + 1)).unwrap();
        rows.push_str(&format!(
            "{{\"id\": \"d{i}\", \"doc_type\": \"{doc_type}\", \"page\": \"p{i}.png\"}}\n"
        ));
    }
    let dataset = env.write("docs.jsonl", &rows);
    let server = mock(MockSettings::default()).await;
    env.write(
        "run.yaml",
        &format!(
            "name: images\n\
             dataset: {{ path: {}, id_field: id }}\n\
             endpoints:\n{}\
             task:\n\
             \x20 messages:\n\
             \x20   - {{ role: user, content: \"Read this.\", images: \"{{{{ page }}}}\" }}\n\
             \x20 prompts:\n\
             \x20   - name: money\n\
             \x20     when: {{ doc_type: invoice }}\n\
             \x20     messages:\n\
             \x20       - {{ role: user, content: \"Read the invoice.\", images: \"{{{{ page }}}}\" }}\n",
            dataset.display(),
            external("m", &server, 2),
        ),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(server.stats().images, 4);
    let rows = by_id(&env.export(&ran.run_id()).await);
    for (id, prompt) in [
        ("d0", "money"),
        ("d1", "default"),
        ("d2", "money"),
        ("d3", "default"),
    ] {
        assert_eq!(rows[id]["prompt"], prompt, "{}", rows[id]);
    }
    let report = env
        .evalfleet(&["report", &ran.run_id(), "--by", "@prompt", "--json"])
        .await;
    let report: serde_json::Value = serde_json::from_str(&report.stdout).unwrap();
    assert_eq!(
        report["prompts"],
        serde_json::json!({"default": 2, "money": 2})
    );
}
