//! Resource telemetry end to end: a run with a local engine on a machine
//! whose `nvidia-smi` prints what a real H200 printed (a stand-in script on
//! PATH: no GPU is needed), its samples stored, its limit event, and its
//! report's peaks and means.

use std::path::{Path, PathBuf};

use evalfleet_store::prelude::*;
use evalfleet_types::{EventKind, ResourceMetric, ResourceSource};
use serde_json::Value;

use crate::util::{BIN, Env, config};

/// The recorded outputs of a real H200 (see their README).
fn h200() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../evalfleet-fleet/tests/data/gpu/h200")
}

/// A stand-in `nvidia-smi` in `dir`/bin: the H200 holding a process, which
/// is the process whose pid is in `pid_file` (the engine) once it exists.
fn fake_nvidia_smi(env: &Env, pid_file: &Path) -> PathBuf {
    let bin = env.path("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let data = h200();
    let script = format!(
        "#!/bin/sh\n\
         case \"$*\" in\n\
         *--query-gpu=*) cat '{gpus}' ;;\n\
         *--query-compute-apps=*) [ -s '{pid}' ] && sed \"s/, 607, /, $(cat '{pid}'), /\" '{apps}' ;;\n\
         *) echo \"unexpected: $*\" >&2; exit 9 ;;\n\
         esac\n\
         exit 0\n",
        gpus = data.join("busy-gpus.csv").display(),
        apps = data.join("busy-apps.csv").display(),
        pid = pid_file.display(),
    );
    let path = bin.join("nvidia-smi");
    std::fs::write(&path, script).unwrap();
    let mut perms = std::fs::metadata(&path).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&path, perms).unwrap();
    bin
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_samples_its_gpu_engine_and_itself_and_reports_peaks_and_means() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 40);
    let pid_file = env.path("engine.pid");
    let bin = fake_nvidia_smi(&env, &pid_file);
    // The engine writes its pid where the stand-in nvidia-smi reads it,
    // then becomes the mock (same pid).
    let endpoint = format!(
        "  - name: engine\n    kind: local\n    \
         command: \"sh -c 'echo $$ > {pid}; exec {BIN} mock --bind 127.0.0.1:{{port}} --latency 100ms'\"\n    \
         model: mock\n    concurrency: 2\n    stop_grace: 2s\n    health: {{ interval: 200ms, timeout: 500ms }}\n",
        pid = pid_file.display(),
    );
    env.write(
        "run.yaml",
        &config(
            &dataset,
            &endpoint,
            "telemetry:\n  interval: 100ms\n  limits: { engine_gpu_memory_mb: 2000, gpu_memory_mb: 100000 }",
        ),
    );
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let ran: crate::util::Ran = env
        .command(&["run", "run.yaml", "-q", "--run-id", "t"])
        .env("PATH", &path)
        .output()
        .await
        .unwrap()
        .into();
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);

    let mut store = env.store();
    let points = store.resource_points("t", i64::MIN).unwrap();
    let summary = evalfleet_reports::ResourcesReport::of(&points);
    let series = |source, name: &str, metric| {
        summary
            .get(source, name, metric)
            .unwrap_or_else(|| panic!("no {source} {name} {metric} in {:#?}", summary.series))
            .clone()
    };
    // The GPU's figures are the recorded ones, exactly.
    let memory = series(ResourceSource::Gpu, "0", ResourceMetric::GpuMemoryMb);
    assert_eq!((memory.peak, memory.mean), (2575.0, 2575.0));
    assert!(memory.samples >= 2, "{memory:?}");
    let total = series(ResourceSource::Gpu, "0", ResourceMetric::GpuMemoryTotalMb);
    assert_eq!(total.peak, 143_771.0);
    assert_eq!(
        series(ResourceSource::Gpu, "0", ResourceMetric::GpuUtilizationPct).peak,
        0.0
    );
    // The recorded process is the engine's: its GPU memory is the engine's.
    let engine_gpu = series(
        ResourceSource::Endpoint,
        "engine",
        ResourceMetric::GpuMemoryMb,
    );
    assert_eq!(engine_gpu.peak, 2566.0);
    // The engine is an evalfleet mock: a few MiB resident, at least.
    let engine_rss = series(ResourceSource::Endpoint, "engine", ResourceMetric::RssMb);
    assert!(
        engine_rss.peak > 1.0 && engine_rss.mean <= engine_rss.peak,
        "{engine_rss:?}"
    );
    let own = series(ResourceSource::Evalfleet, "", ResourceMetric::RssMb);
    assert!(own.peak > 1.0, "{own:?}");

    // The engine's GPU memory stayed above its limit: one event, no more;
    // the GPU's own limit was never crossed.
    let events = store.events("t").unwrap();
    let limits: Vec<_> = events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::ResourceLimit | EventKind::ResourceBack))
        .collect();
    assert_eq!(limits.len(), 1, "{limits:#?}");
    assert_eq!(limits[0].kind, EventKind::ResourceLimit);
    assert_eq!(limits[0].endpoint.as_deref(), Some("engine"));
    assert_eq!(
        limits[0].message,
        "Endpoint engine's GPU memory is 2566 MiB, above telemetry.limits.engine_gpu_memory_mb (2000 MiB)."
    );
    drop(store);

    // The report says it, as JSON and as a table; status shows the event.
    let report = env.evalfleet(&["report", "t", "--json"]).await;
    assert_eq!(report.code, Some(0), "{}", report.stderr);
    let json: Value = serde_json::from_str(&report.stdout).unwrap();
    assert_eq!(json["resources"]["gpu_memory_peak_mb"], 2575.0);
    let table = env.evalfleet(&["report", "t"]).await;
    assert!(
        table.stdout.contains("endpoint engine gpu_memory_mb"),
        "{}",
        table.stdout
    );
    let status = env.evalfleet(&["status", "t"]).await;
    assert!(
        status
            .stdout
            .contains("above telemetry.limits.engine_gpu_memory_mb"),
        "{}",
        status.stdout
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_without_nvidia_smi_has_no_gpu_series_and_says_so_once() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 30);
    // PATH holds only what the run needs: no nvidia-smi.
    let bin = env.path("bin");
    std::fs::create_dir_all(&bin).unwrap();
    env.write(
        "run.yaml",
        &config(
            &dataset,
            "  - name: m\n    kind: mock\n    concurrency: 2\n    mock: { latency: 50ms }\n",
            "telemetry: { interval: 100ms, gpus: all }",
        ),
    );
    let ran: crate::util::Ran = env
        .command(&["run", "run.yaml", "--run-id", "n"])
        .env("PATH", &bin)
        .output()
        .await
        .unwrap()
        .into();
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let said = ran.stderr.matches("No GPU telemetry for now").count();
    assert_eq!(said, 1, "{}", ran.stderr);
    let points = env.store().resource_points("n", i64::MIN).unwrap();
    assert!(
        points
            .iter()
            .all(|p| p.series.source != ResourceSource::Gpu)
    );
    assert!(
        points
            .iter()
            .any(|p| p.series.source == ResourceSource::Evalfleet
                && p.series.metric == ResourceMetric::RssMb),
        "{points:?}"
    );
}
