//! What the GPUs of this machine are doing, from `nvidia-smi`, so that an
//! engine is not started on a GPU someone else is using, and so that the
//! run's telemetry knows what its GPUs hold (`watchdog`).
//!
//! The parsers take both CSV shapes nvidia-smi writes (`nounits` or not,
//! with or without the header line) and fields it cannot fill (`[N/A]`,
//! `[Not Supported]`): such a field reads as unknown, never as an error.

use std::time::Duration;

use serde::Serialize;

/// One GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_used_mb: u64,
    pub memory_total_mb: u64,
    /// `utilization.gpu`, in percent; `None` where the driver does not say.
    pub utilization_pct: Option<u32>,
}

/// A process using a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuProcess {
    pub gpu_uuid: String,
    pub pid: u32,
    pub name: String,
    /// `None` where the driver does not say (`[N/A]`).
    pub used_memory_mb: Option<u64>,
}

/// The machine's GPUs, or why they cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuReport {
    Gpus {
        gpus: Vec<Gpu>,
        processes: Vec<GpuProcess>,
    },
    Unavailable(String),
}

/// Arguments of the two queries (CSV, no header, no units).
pub const GPU_QUERY: [&str; 2] = [
    "--query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu",
    "--format=csv,noheader,nounits",
];
pub const PROCESS_QUERY: [&str; 2] = [
    "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
    "--format=csv,noheader,nounits",
];

fn fields(line: &str) -> Vec<&str> {
    line.split(',').map(str::trim).collect()
}

/// A field's number, without its unit (`2575 MiB`, `0 %`, `123.74 W`,
/// rounded); `None` for `[N/A]`, `[Not Supported]` and the like.
fn number(field: &str) -> Option<u64> {
    let value = field.split_whitespace().next()?;
    value.parse().ok().or_else(|| {
        value
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v >= 0.0)
            .map(|v| v.round() as u64)
    })
}

/// Whether `line` is the header nvidia-smi writes without `noheader`.
fn is_header(line: &str, first: &str) -> bool {
    line.trim_start().starts_with(first)
}

/// Parses `nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total
/// [,utilization.gpu] --format=csv[,noheader][,nounits]`.
pub fn parse_gpus(text: &str) -> Result<Vec<Gpu>, String> {
    text.lines()
        .filter(|l| !l.trim().is_empty() && !is_header(l, "index,"))
        .map(|line| {
            let f = fields(line);
            if f.len() < 5 {
                return Err(format!(
                    "expected at least 5 fields in nvidia-smi's line '{line}'"
                ));
            }
            Ok(Gpu {
                index: f[0]
                    .parse()
                    .map_err(|_| format!("bad GPU index in '{line}'"))?,
                uuid: f[1].to_owned(),
                name: f[2].to_owned(),
                memory_used_mb: number(f[3]).unwrap_or(0),
                memory_total_mb: number(f[4]).unwrap_or(0),
                utilization_pct: f
                    .get(5)
                    .and_then(|u| number(u))
                    .and_then(|u| u32::try_from(u).ok()),
            })
        })
        .collect()
}

/// Parses `nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory
/// --format=csv[,noheader][,nounits]`. A process name may hold commas.
pub fn parse_processes(text: &str) -> Result<Vec<GpuProcess>, String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("No running") && !is_header(l, "gpu_uuid,"))
        .map(|line| {
            let f = fields(line);
            if f.len() < 4 {
                return Err(format!("expected 4 fields in nvidia-smi's line '{line}'"));
            }
            let last = f.len() - 1;
            Ok(GpuProcess {
                gpu_uuid: f[0].to_owned(),
                pid: f[1].parse().map_err(|_| format!("bad pid in '{line}'"))?,
                name: f[2..last].join(", "),
                used_memory_mb: number(f[last]),
            })
        })
        .collect()
}

async fn nvidia_smi(args: &[&str]) -> Result<String, String> {
    let run = tokio::process::Command::new("nvidia-smi")
        .args(args)
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(Duration::from_secs(10), run).await {
        Err(_) => Err("nvidia-smi did not answer within 10s".to_owned()),
        Ok(Err(err)) if err.kind() == std::io::ErrorKind::NotFound => {
            Err("nvidia-smi is not installed here (no NVIDIA driver?)".to_owned())
        }
        Ok(Err(err)) => Err(format!("cannot run nvidia-smi: {err}")),
        Ok(Ok(out)) if !out.status.success() => Err(format!(
            "nvidia-smi failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Ok(Ok(out)) => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
    }
}

/// Asks `nvidia-smi` about the GPUs and the processes on them.
pub async fn report() -> GpuReport {
    let gpus = match nvidia_smi(&GPU_QUERY).await.and_then(|t| parse_gpus(&t)) {
        Ok(gpus) => gpus,
        Err(reason) => return GpuReport::Unavailable(reason),
    };
    let processes = match nvidia_smi(&PROCESS_QUERY)
        .await
        .and_then(|t| parse_processes(&t))
    {
        Ok(processes) => processes,
        Err(reason) => return GpuReport::Unavailable(reason),
    };
    GpuReport::Gpus { gpus, processes }
}

/// Why an engine should not start on `devices` (`"0"`, `"0,1"`): the GPUs
/// whose memory in use exceeds `threshold_mb`, with the processes using them.
pub fn busy(report: &GpuReport, devices: &str, threshold_mb: u64) -> Vec<String> {
    let GpuReport::Gpus { gpus, processes } = report else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for device in devices
        .split(',')
        .filter_map(|d| d.trim().parse::<u32>().ok())
    {
        let Some(gpu) = gpus.iter().find(|g| g.index == device) else {
            out.push(format!("GPU {device} does not exist here"));
            continue;
        };
        if gpu.memory_used_mb > threshold_mb {
            let users: Vec<String> = processes
                .iter()
                .filter(|p| p.gpu_uuid == gpu.uuid)
                .map(|p| match p.used_memory_mb {
                    Some(mb) => format!("pid {} {} ({mb} MB)", p.pid, p.name),
                    None => format!("pid {} {}", p.pid, p.name),
                })
                .collect();
            out.push(format!(
                "GPU {} ({}) has {} of {} MB in use, above the threshold of {threshold_mb} MB{}",
                gpu.index,
                gpu.name,
                gpu.memory_used_mb,
                gpu.memory_total_mb,
                if users.is_empty() {
                    String::new()
                } else {
                    format!(": {}", users.join(", "))
                }
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // The documented CSV shape of the two queries (nounits, noheader). No GPU
    // was available to capture a real machine's output.
    const GPUS: &str = "0, GPU-6a3c1f7e-1d2b-4c8a-9f10-2b3c4d5e6f70, NVIDIA H100 80GB HBM3, 71234, 81559\n\
                        1, GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0, NVIDIA H100 80GB HBM3, 3, 81559\n";
    const PROCESSES: &str = "GPU-6a3c1f7e-1d2b-4c8a-9f10-2b3c4d5e6f70, 4242, /usr/bin/python3, 71200\n\
                             GPU-6a3c1f7e-1d2b-4c8a-9f10-2b3c4d5e6f70, 4343, vllm, serve, [N/A]\n";

    #[test]
    fn gpus_and_processes_parse() {
        let gpus = parse_gpus(GPUS).unwrap();
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[0].memory_used_mb, 71234);
        assert_eq!(gpus[1].name, "NVIDIA H100 80GB HBM3");
        let processes = parse_processes(PROCESSES).unwrap();
        assert_eq!(processes[0].pid, 4242);
        assert_eq!(processes[1].name, "vllm, serve");
        assert_eq!(processes[1].used_memory_mb, None);
        assert!(parse_processes("").unwrap().is_empty());
        assert!(parse_gpus("0, x, y\n").is_err());
    }

    #[test]
    fn a_busy_gpu_is_named_with_its_users() {
        let report = GpuReport::Gpus {
            gpus: parse_gpus(GPUS).unwrap(),
            processes: parse_processes(PROCESSES).unwrap(),
        };
        let busy_0 = busy(&report, "0", 1024);
        assert_eq!(busy_0.len(), 1);
        assert!(
            busy_0[0].contains("71234 of 81559 MB") && busy_0[0].contains("pid 4242"),
            "{busy_0:?}"
        );
        assert!(busy(&report, "1", 1024).is_empty());
        assert_eq!(
            busy(&report, "0,1,7", 100_000),
            vec!["GPU 7 does not exist here"]
        );
    }
}

/// What a real NVIDIA H200 printed (`tests/data/gpu/h200/README.md`).
#[cfg(test)]
mod recorded {
    use super::*;

    macro_rules! h200 {
        ($file:literal) => {
            include_str!(concat!("../tests/data/gpu/h200/", $file))
        };
    }

    const UUID: &str = "GPU-f0371bb6-ac84-5519-f095-fead4f3756d1";

    fn busy_gpu(utilization_pct: Option<u32>) -> Gpu {
        Gpu {
            index: 0,
            uuid: UUID.to_owned(),
            name: "NVIDIA H200".to_owned(),
            memory_used_mb: 2575,
            memory_total_mb: 143_771,
            utilization_pct,
        }
    }

    #[test]
    fn an_h200_holding_a_process_parses_exactly_with_and_without_units() {
        assert_eq!(
            parse_gpus(h200!("busy-gpus.csv")).unwrap(),
            vec![busy_gpu(Some(0))]
        );
        assert_eq!(
            parse_gpus(h200!("busy-gpus-units.csv")).unwrap(),
            vec![busy_gpu(Some(0))]
        );
        assert_eq!(
            parse_gpus(h200!("busy-gpus-5.csv")).unwrap(),
            vec![busy_gpu(None)]
        );
        let process = GpuProcess {
            gpu_uuid: UUID.to_owned(),
            pid: 607,
            name: "python3".to_owned(),
            used_memory_mb: Some(2566),
        };
        assert_eq!(
            parse_processes(h200!("busy-apps.csv")).unwrap(),
            vec![process.clone()]
        );
        assert_eq!(
            parse_processes(h200!("busy-apps-units.csv")).unwrap(),
            vec![process]
        );
    }

    #[test]
    fn an_idle_h200_has_no_processes_and_no_memory_in_use() {
        for (gpus, apps) in [
            (h200!("idle-gpus.csv"), h200!("idle-apps.csv")),
            (h200!("idle-gpus-units.csv"), h200!("idle-apps-units.csv")),
            (h200!("after-gpus.csv"), h200!("after-apps.csv")),
            (h200!("after-gpus-units.csv"), h200!("after-apps-units.csv")),
        ] {
            let gpus = parse_gpus(gpus).unwrap();
            assert_eq!(gpus.len(), 1);
            assert_eq!(gpus[0].memory_used_mb, 0);
            assert_eq!(gpus[0].memory_total_mb, 143_771);
            assert_eq!(gpus[0].utilization_pct, Some(0));
            assert!(parse_processes(apps).unwrap().is_empty());
        }
    }

    #[test]
    fn the_queries_sent_parse_as_an_h200_printed_them() {
        let uuid = "GPU-6c162e19-590f-7bda-014d-6565b8e9bf47";
        assert_eq!(
            parse_gpus(h200!("query-busy-gpus.csv")).unwrap(),
            vec![Gpu {
                index: 0,
                uuid: uuid.to_owned(),
                name: "NVIDIA H200".to_owned(),
                memory_used_mb: 1551,
                memory_total_mb: 143_771,
                utilization_pct: Some(0),
            }]
        );
        assert_eq!(
            parse_processes(h200!("query-busy-apps.csv")).unwrap(),
            vec![GpuProcess {
                gpu_uuid: uuid.to_owned(),
                pid: 496,
                name: "python3".to_owned(),
                used_memory_mb: Some(1542),
            }]
        );
        let after = parse_gpus(h200!("query-after-gpus.csv")).unwrap();
        assert_eq!(after[0].memory_used_mb, 0);
    }

    #[test]
    fn fields_the_driver_cannot_fill_read_as_unknown() {
        // The recorded line with the fields a MIG slice or an old board
        // leaves out (nvidia-smi writes `[N/A]` or `[Not Supported]`).
        let line = format!(
            "0, {UUID}, NVIDIA H200, 2575 MiB, 143771 MiB, [N/A], [Not Supported], 41, [N/A]\n"
        );
        let gpus = parse_gpus(&line).unwrap();
        assert_eq!(gpus[0].utilization_pct, None);
        assert_eq!(gpus[0].memory_used_mb, 2575);
        let apps = format!("{UUID}, 607, python3, [Not Supported]\n");
        assert_eq!(parse_processes(&apps).unwrap()[0].used_memory_mb, None);
    }
}
