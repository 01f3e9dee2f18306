//! Parquet datasets, run end to end on the mock, and Parquet exports.

use std::path::Path;

use evalfleet_io::dataset::{ColumnKind, ColumnValues, TableWriter};
use evalfleet_mock::MockSettings;
use serde_json::Value;

use crate::util::{Env, by_id, config, external, mock};

/// `n` items (`id` p0.., `question`, `level` an integer) in row groups of
/// `group` rows.
pub(crate) fn write_items(path: &Path, n: usize, group: usize) {
    let columns = [
        ("id".to_owned(), ColumnKind::Text),
        ("question".to_owned(), ColumnKind::Text),
        ("level".to_owned(), ColumnKind::Int),
    ];
    let file = std::fs::File::create(path).unwrap();
    let mut writer = TableWriter::new(file, &columns).unwrap();
    for start in (0..n).step_by(group) {
        let rows = start..(start + group).min(n);
        let mut values = [
            ColumnValues::Text(rows.clone().map(|i| Some(format!("p{i}"))).collect()),
            ColumnValues::Text(
                rows.clone()
                    .map(|i| Some(format!("what is {i}?")))
                    .collect(),
            ),
            ColumnValues::Int(rows.map(|i| (i % 3 != 0).then_some(i as i64)).collect()),
        ];
        writer.write_group(&mut values).unwrap();
    }
    writer.finish().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_dataset_is_answered_item_by_item_and_its_resume_is_checked() {
    let env = Env::new();
    let dataset = env.path("items.parquet");
    write_items(&dataset, 50, 16);
    let server = mock(MockSettings::default()).await;
    env.write(
        "run.yaml",
        &config(&dataset, &external("only", &server, 8), ""),
    );
    let checked = env.evalfleet(&["check", "run.yaml"]).await;
    assert!(
        checked.stdout.contains("items.parquet: 50 rows, 0 invalid"),
        "{}{}",
        checked.stdout,
        checked.stderr
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let rows = by_id(&env.export(&ran.run_id()).await);
    assert_eq!(rows.len(), 50);
    assert_eq!(rows["p37"]["output"], "what is 37?");
    assert_eq!(rows["p37"]["item"]["level"], 37);
    assert_eq!(rows["p36"]["item"]["level"], Value::Null);

    // The same run over a changed file is refused by the fingerprint.
    write_items(&dataset, 51, 16);
    let resumed = env
        .evalfleet(&["resume", &ran.run_id(), "--retry-failed"])
        .await;
    assert_eq!(resumed.code, Some(2), "{}", resumed.stderr);
    assert!(
        resumed.stderr.contains("the dataset's content changed"),
        "{}",
        resumed.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_parquet_dataset_is_refused_naming_the_file() {
    let env = Env::new();
    let dataset = env.write("items.parquet", "PAR1 not really");
    let said = refused(&env, &dataset).await;
    assert!(
        said.contains(&format!(
            "{}: not a readable Parquet file",
            dataset.display()
        )),
        "{said}"
    );
}

/// What a run over `dataset` says when it is refused as bad input.
async fn refused(env: &Env, dataset: &Path) -> String {
    let server = mock(MockSettings::default()).await;
    env.write(
        "run.yaml",
        &config(dataset, &external("only", &server, 8), ""),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    ran.stderr
}

/// The Python with pyarrow that `.ci/run` prepares.
fn pyarrow_python() -> Option<String> {
    crate::util::python_with("EVALFLEET_PYARROW_PYTHON", "pyarrow.parquet", "pyarrow")
}

/// A test folder with `items.parquet` written by `script` (which gets its
/// path) in the Python with pyarrow: that Python, the folder and the path;
/// `None`, the test skipped, where there is no such Python.
fn pyarrow_items(script: &str) -> Option<(String, Env, std::path::PathBuf)> {
    let py = pyarrow_python()?;
    let env = Env::new();
    let dataset = env.path("items.parquet");
    python(&py, script, &[&dataset]);
    Some((py, env, dataset))
}

fn python<A: AsRef<std::ffi::OsStr>>(python: &str, script: &str, args: &[A]) -> String {
    let out = std::process::Command::new(python)
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Writes a Hugging Face style folder: two train shards and a test shard,
/// with a struct, a list, a nullable column and an image as bytes.
const WRITE_SHARDS: &str = r#"
import base64, os, sys
import pyarrow as pa, pyarrow.parquet as pq
root = sys.argv[1]
os.makedirs(os.path.join(root, "data"))
png = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")
def shard(split, k, of, ids):
    table = pa.table({
        "id": ids,
        "question": [f"{split} {i}?" for i in ids],
        "meta": [{"source": split, "rank": i} for i in ids],
        "choices": [[str(i), "x"] for i in ids],
        "note": [None if i % 2 else "even" for i in ids],
        "image": [{"bytes": png, "path": None} for i in ids],
    })
    pq.write_table(table, os.path.join(root, "data", f"{split}-{k:05d}-of-{of:05d}.parquet"), row_group_size=3)
shard("train", 0, 2, list(range(0, 7)))
shard("train", 1, 2, list(range(7, 10)))
shard("test", 0, 1, list(range(100, 104)))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pyarrow_written_folder_of_shards_runs_by_split() {
    let Some(py) = pyarrow_python() else {
        return;
    };
    let env = Env::new();
    let root = env.path("hub");
    python(&py, WRITE_SHARDS, &[&root]);
    let server = mock(MockSettings::default()).await;
    for (split, n, id) in [("", 10, "7"), ("  split: test\n", 4, "101")] {
        // The image column's bytes (base64 text) go with the question.
        let yaml = config(&root, &external("only", &server, 8), "")
            .replace("  id_field: id\n", &format!("  id_field: id\n{split}"))
            .replace(
                "content: \"{{ question }}\" }",
                "content: \"{{ question }}\", images: \"{{ image.bytes }}\" }",
            );
        env.write("run.yaml", &yaml);
        let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
        assert_eq!(ran.code, Some(0), "{}", ran.stderr);
        let rows = by_id(&env.export(&ran.run_id()).await);
        assert_eq!(rows.len(), n, "{split}");
        let item = &rows[id]["item"];
        assert_eq!(rows[id]["output"], item["question"]);
        assert_eq!(item["meta"]["rank"], id.parse::<i64>().unwrap());
        assert_eq!(item["choices"], serde_json::json!([id, "x"]));
        assert_eq!(item["note"], Value::Null);
        assert!(
            item["image"]["bytes"]
                .as_str()
                .unwrap()
                .starts_with("iVBORw0KGgo"),
            "binary data is base64 text: {item}"
        );
        assert_eq!(
            rows[id]["images"].as_array().map(Vec::len),
            Some(1),
            "the image went with the request: {}",
            rows[id]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_export_has_typed_columns_and_reads_back_as_a_dataset() {
    let env = Env::new();
    let dataset = env.path("items.parquet");
    write_items(&dataset, 20, 8);
    let server = mock(MockSettings::default()).await;
    let metric = "  metrics:\n    - { name: exact_match, reference: \"{{ question }}\" }";
    env.write(
        "run.yaml",
        &config(&dataset, &external("only", &server, 8), metric),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let exported = env.path("out.parquet");
    let export = env
        .evalfleet(&[
            "export",
            &ran.run_id(),
            "--format",
            "parquet",
            "-o",
            exported.to_str().unwrap(),
        ])
        .await;
    assert_eq!(export.code, Some(0), "{}", export.stderr);

    // The export is a dataset: a run over it sees every column.
    env.write(
        "again.yaml",
        &config(&exported, &external("only", &server, 8), "")
            .replace("id_field: id", "id_field: item_id")
            .replace("{{ question }}", "{{ output }}"),
    );
    let again = env.evalfleet(&["run", "again.yaml", "-q"]).await;
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    let rows = by_id(&env.export(&again.run_id()).await);
    assert_eq!(rows.len(), 20);
    let row = &rows["p13"]["item"];
    assert_eq!(rows["p13"]["output"], "what is 13?");
    assert_eq!(row["status"], "done");
    assert_eq!(row["attempts"], 1);
    assert_eq!(row["score.exact_match@1"], 1.0);
    assert_eq!(row["valid"], true);
    assert_eq!(row["tokens_estimated"], false);
    assert!(row["latency_ms"].as_f64().unwrap() > 0.0, "{row}");
    assert!(row["completion_tokens"].as_i64().unwrap() > 0, "{row}");
    let item: Value = serde_json::from_str(row["item"].as_str().unwrap()).unwrap();
    assert_eq!(
        item,
        serde_json::json!({"id": "p13", "question": "what is 13?", "level": 13})
    );

    let Some(py) = pyarrow_python() else {
        return;
    };
    let schema = python(
        &py,
        "import sys, json, pyarrow.parquet as pq\n\
         t = pq.read_table(sys.argv[1])\n\
         print(json.dumps({'rows': t.num_rows, 'types': {f.name: str(f.type) for f in t.schema}}))",
        &[&exported],
    );
    let schema: Value = serde_json::from_str(&schema).unwrap();
    assert_eq!(schema["rows"], 20);
    let types = &schema["types"];
    for (column, kind) in [
        ("item_id", "string"),
        ("status", "string"),
        ("output", "string"),
        ("attempts", "int64"),
        ("latency_ms", "double"),
        ("ttft_ms", "double"),
        ("prompt_tokens", "int64"),
        ("completion_tokens", "int64"),
        ("tokens_estimated", "bool"),
        ("valid", "bool"),
        ("item", "string"),
        ("score.exact_match@1", "double"),
    ] {
        assert_eq!(types[column], kind, "{column}: {types}");
    }
}

/// Runs `evalfleet ARGS` in `dir` from `python`, which then reads its one
/// child's peak resident memory (`getrusage`): its exit code, what it
/// printed (stdout, then stderr) and that peak in MiB.
fn peak_rss(py: &str, dir: &Path, args: &[&str]) -> (i32, String, f64) {
    let mut argv = vec![dir.as_os_str(), Path::new(crate::util::BIN).as_os_str()];
    argv.extend(args.iter().map(std::ffi::OsStr::new));
    let said = python(
        py,
        "import json, os, resource, subprocess, sys\n\
         env = {k: v for k, v in os.environ.items() if k not in ('EVALFLEET_STORE', 'EVALFLEET_LOG')}\n\
         ran = subprocess.run(sys.argv[2:], cwd=sys.argv[1], env=env, capture_output=True, text=True)\n\
         peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n\
         print(json.dumps([ran.returncode, ran.stdout + ran.stderr, peak / 1024]))",
        &argv,
    );
    serde_json::from_str(&said).unwrap()
}

/// A file of 200,000 rows in one row group (pyarrow writes a million rows
/// to a group unless told otherwise) is checked and run with memory that
/// does not hold the group: decoded whole, it took `check` 372 MiB, where
/// streamed it takes 50 MiB (a debug build; the run 73 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_file_of_one_large_row_group_is_read_with_flat_memory() {
    let Some((py, env, dataset)) = pyarrow_items(
        "import sys, pyarrow as pa, pyarrow.parquet as pq\n\
         n = 200_000\n\
         pq.write_table(pa.table({\n\
             'id': [f'r{i}' for i in range(n)],\n\
             'question': [f'What is {i} plus {i % 97}? Answer with the number.' for i in range(n)],\n\
             'level': [i % 5 for i in range(n)],\n\
         }), sys.argv[1], row_group_size=n)",
    ) else {
        return;
    };
    let server = mock(MockSettings::default()).await;
    env.write(
        "run.yaml",
        &config(&dataset, &external("only", &server, 8), ""),
    );
    const BOUND_MIB: f64 = 150.0;

    // The scan: every row's id.
    let (_, said, peak) = peak_rss(&py, env.dir.path(), &["check", "run.yaml"]);
    assert!(
        said.contains("items.parquet: 200000 rows, 0 invalid"),
        "{said}"
    );
    assert!(peak < BOUND_MIB, "check took {peak:.0} MiB");

    // The row reader: a sample's rows, spread over the group, read forward.
    let (code, said, peak) = peak_rss(
        &py,
        env.dir.path(),
        &["run", "run.yaml", "-q", "--n-sample", "20", "--seed", "1"],
    );
    assert_eq!(code, 0, "{said}");
    assert!(
        said.contains("finished, complete: 20 of 20 items scored"),
        "{said}"
    );
    assert!(peak < BOUND_MIB, "the run took {peak:.0} MiB");
}

/// Files compressed as pyarrow and polars write them are read: zstd (polars'
/// default), gzip, snappy (pyarrow's) and lz4; a codec it does not read is
/// named, with what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parquet_files_compressed_with_zstd_gzip_snappy_or_lz4_are_read() {
    let Some(py) = pyarrow_python() else {
        return;
    };
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    for codec in ["zstd", "gzip", "snappy", "lz4", "brotli"] {
        let dataset = env.path(&format!("{codec}.parquet"));
        python(
            &py,
            "import sys, pyarrow as pa, pyarrow.parquet as pq\n\
             t = pa.table({'id': ['a', 'b', 'c'], 'question': ['x', 'y', 'z']})\n\
             pq.write_table(t, sys.argv[1], compression=sys.argv[2])",
            &[dataset.as_os_str(), std::ffi::OsStr::new(codec)],
        );
        env.write(
            "run.yaml",
            &config(&dataset, &external("only", &server, 2), ""),
        );
        let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
        if codec == "brotli" {
            assert_eq!(ran.code, Some(2), "{}", ran.stderr);
            assert!(
                ran.stderr.contains(
                    "it is compressed with brotli, which evalfleet does not read (it reads snappy, zstd, gzip and lz4"
                ),
                "{}",
                ran.stderr
            );
            continue;
        }
        assert_eq!(ran.code, Some(0), "{codec}: {}", ran.stderr);
        let rows = by_id(&env.export(&ran.run_id()).await);
        assert_eq!(rows["b"]["output"], "y", "{codec}");
    }
}

/// A folder the `datasets` library's `save_to_disk` wrote (Arrow files, a
/// `Dataset` or a `DatasetDict`) is refused with what to write instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_save_to_disk_folder_is_refused_with_the_to_parquet_hint() {
    let Some(py) = crate::util::python_with("EVALFLEET_PYARROW_PYTHON", "datasets", "datasets")
    else {
        return;
    };
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    python(
        &py,
        "import sys, datasets\n\
         d = datasets.Dataset.from_dict({'id': ['a', 'b'], 'question': ['x', 'y']})\n\
         d.save_to_disk(sys.argv[1] + '/one')\n\
         datasets.DatasetDict({'train': d, 'test': d}).save_to_disk(sys.argv[1] + '/dict')",
        &[env.path("")],
    );
    for folder in ["one", "dict"] {
        env.write(
            "run.yaml",
            &config(&env.path(folder), &external("only", &server, 2), ""),
        );
        let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
        assert_eq!(ran.code, Some(2), "{}", ran.stderr);
        assert!(
            ran.stderr
                .contains("was written by the datasets library's save_to_disk")
                && ran.stderr.contains("ds.to_parquet('items.parquet')"),
            "{}",
            ran.stderr
        );
    }
    assert_eq!(server.stats().requests, 0);
}
