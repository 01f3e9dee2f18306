//! An engine loaded for a turn of its own, outside any run's fleet: a
//! benchmark matrix (`evalfleet bench`) loads one model's engine, runs that
//! model's cells against it as ordinary runs, then unloads it and waits
//! until its GPU memory is released before the next model's engine starts.
//!
//! The engine is started under the same supervisor as a run's engines
//! ([`super::engine`]): it never outlives the process that loaded it.

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Endpoint;
use super::engine::{Launcher, free_port};
use super::gpu::{self, GpuReport};
use super::runtime::{Running, launch, ready};
use evalfleet_config::{EndpointConfig, EndpointKind};
use evalfleet_types::now_ms;

/// How often readiness is probed while an engine loads: a turn's start is
/// measured, so it is noticed soon after the engine answers.
const READY_POLL: Duration = Duration::from_millis(20);

/// How often the GPUs are read while waiting for an engine's memory to go.
const RELEASE_POLL: Duration = Duration::from_millis(250);

/// Memory on a GPU above what was in use before the engine started that
/// still counts as released (the driver's own, other small users).
const RELEASE_MARGIN_MB: u64 = 256;

/// An engine that is up for a turn.
pub struct EngineTurn {
    running: Running,
    grace: Duration,
    /// The GPUs it was given (`CUDA_VISIBLE_DEVICES`), if any.
    gpu: Option<String>,
    /// Memory in use on each of its GPUs (every GPU when it was given
    /// none) before it started (index, MB); empty where `nvidia-smi` did
    /// not answer.
    before: Vec<(u32, u64)>,
    /// Its OpenAI API, `http://127.0.0.1:PORT/v1`.
    pub base_url: String,
    pub pid: Option<u32>,
    /// When its process was started, and when it first answered its health
    /// path (ms since the epoch).
    pub spawned_at_ms: i64,
    pub ready_at_ms: i64,
}

/// How an engine's turn ended.
#[derive(Debug, Clone)]
pub struct Released {
    /// When the stop was asked, and when its processes had ended and its
    /// GPU memory was back (ms since the epoch).
    pub stopping_at_ms: i64,
    pub released_at_ms: i64,
    /// What was waited on, or why the wait gave up (in words).
    pub note: String,
    /// False when its GPU memory was still in use at the deadline.
    pub clean: bool,
}

/// Memory in use on each GPU of `devices` (`"0"`, `"0,1"`), or on every
/// GPU with `None` (an engine given no GPU may use any).
fn memory_of(report: &GpuReport, devices: Option<&str>) -> Vec<(u32, u64)> {
    let GpuReport::Gpus { gpus, .. } = report else {
        return Vec::new();
    };
    let Some(devices) = devices else {
        return gpus.iter().map(|g| (g.index, g.memory_used_mb)).collect();
    };
    devices
        .split(',')
        .filter_map(|d| d.trim().parse::<u32>().ok())
        .filter_map(|index| {
            gpus.iter()
                .find(|g| g.index == index)
                .map(|g| (index, g.memory_used_mb))
        })
        .collect()
}

/// What still holds memory on the engine's GPUs, against `before`: `None`
/// once every GPU is back within [`RELEASE_MARGIN_MB`] of it and `pid`
/// is gone from its compute processes.
fn still_held(report: &GpuReport, before: &[(u32, u64)], pid: Option<u32>) -> Option<String> {
    let GpuReport::Gpus { gpus, processes } = report else {
        return None;
    };
    for (index, was) in before {
        let Some(gpu) = gpus.iter().find(|g| g.index == *index) else {
            continue;
        };
        let ours = processes
            .iter()
            .any(|p| p.gpu_uuid == gpu.uuid && Some(p.pid) == pid);
        if ours || gpu.memory_used_mb > was + RELEASE_MARGIN_MB {
            return Some(format!(
                "GPU {index} has {} MB in use ({was} MB before the engine started){}",
                gpu.memory_used_mb,
                if ours {
                    format!("; pid {} still uses it", pid.unwrap_or(0))
                } else {
                    String::new()
                }
            ));
        }
    }
    None
}

impl EngineTurn {
    /// Starts the engine of `config` (`kind: local` or `remote`) and waits
    /// until it answers its health path, it exits, its start-up timeout
    /// passes or `stop` is cancelled. A failure says why, with the
    /// engine's last lines.
    pub async fn load(
        config: &EndpointConfig,
        launcher: &Launcher,
        stop: &CancellationToken,
    ) -> Result<Self, String> {
        let Some(engine) = config.kind.engine() else {
            return Err(format!(
                "endpoint {} (kind {}) has no engine to load",
                config.name,
                config.kind.name()
            ));
        };
        let requested = match &config.kind {
            EndpointKind::Remote(remote) => remote.local_port,
            _ => engine.port,
        };
        let port = requested
            .map_or_else(free_port, Ok)
            .map_err(|err| format!("no free port: {err}"))?;
        let gpu = match &config.kind {
            EndpointKind::Local(engine) => engine.gpu.clone(),
            _ => None,
        };
        let before = memory_of(&gpu::report().await, gpu.as_deref());
        let endpoint = Endpoint::new(config, Duration::from_secs(10));
        let spawned_at_ms = now_ms();
        let mut running = launch(launcher, &endpoint, port).await?;
        if let Err(err) = ready(
            &endpoint,
            &mut running,
            engine.startup_timeout,
            READY_POLL,
            stop,
        )
        .await
        {
            running.process.stop(engine.stop_grace).await;
            return Err(err);
        }
        Ok(Self {
            base_url: running.base_url.clone(),
            pid: running.process.pid,
            spawned_at_ms,
            ready_at_ms: now_ms(),
            grace: engine.stop_grace,
            gpu,
            before,
            running,
        })
    }

    /// Waits until the engine's process (its supervisor, which ends the
    /// engine's group first) has ended on its own.
    pub async fn exited(&mut self) {
        let _ = self.running.process.wait().await;
    }

    /// The engine's log, for messages.
    pub fn log(&self) -> &std::path::Path {
        &self.running.process.log
    }

    /// Unloads the engine: its whole process group is ended (SIGTERM, then
    /// SIGKILL after its grace) and waited for; then, where `nvidia-smi`
    /// answers, its GPUs (every GPU when it was given none) are read until
    /// their memory is back near what it was before the engine started and
    /// its process is gone from them, up to `deadline`.
    pub async fn unload(self, deadline: Duration) -> Released {
        let stopping_at_ms = now_ms();
        let pid = self.running.process.pid;
        self.running.process.stop(self.grace).await;
        if self.before.is_empty() {
            return Released {
                stopping_at_ms,
                released_at_ms: now_ms(),
                note: "its process group has exited".to_owned(),
                clean: true,
            };
        }
        let devices = self
            .gpu
            .map_or_else(|| "every GPU".to_owned(), |d| format!("GPU {d}"));
        let until = Instant::now() + deadline;
        loop {
            let report = gpu::report().await;
            if let GpuReport::Unavailable(why) = &report {
                return Released {
                    stopping_at_ms,
                    released_at_ms: now_ms(),
                    note: format!("its process group has exited (GPUs not readable: {why})"),
                    clean: true,
                };
            }
            match still_held(&report, &self.before, pid) {
                None => {
                    return Released {
                        stopping_at_ms,
                        released_at_ms: now_ms(),
                        note: format!("its process group has exited and {devices} is free"),
                        clean: true,
                    };
                }
                Some(held) if Instant::now() >= until => {
                    return Released {
                        stopping_at_ms,
                        released_at_ms: now_ms(),
                        note: format!(
                            "{held} {} after its engine was stopped",
                            humantime::format_duration(deadline)
                        ),
                        clean: false,
                    };
                }
                Some(_) => tokio::time::sleep(RELEASE_POLL).await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{Gpu, GpuProcess};

    fn report(used: u64, pids: &[u32]) -> GpuReport {
        GpuReport::Gpus {
            gpus: vec![Gpu {
                index: 0,
                uuid: "GPU-a".to_owned(),
                name: "H100".to_owned(),
                memory_used_mb: used,
                memory_total_mb: 81_559,
                utilization_pct: None,
            }],
            processes: pids
                .iter()
                .map(|pid| GpuProcess {
                    gpu_uuid: "GPU-a".to_owned(),
                    pid: *pid,
                    name: "python3".to_owned(),
                    used_memory_mb: Some(used),
                })
                .collect(),
        }
    }

    #[test]
    fn memory_counts_as_released_near_its_level_before_and_without_the_engine_s_process() {
        let before = memory_of(&report(500, &[]), Some("0"));
        assert_eq!(before, [(0, 500)]);
        let held = still_held(&report(70_000, &[42]), &before, Some(42)).unwrap();
        assert!(
            held.contains("GPU 0 has 70000 MB in use (500 MB before"),
            "{held}"
        );
        assert!(held.contains("pid 42 still uses it"), "{held}");
        assert!(still_held(&report(600, &[42]), &before, Some(42)).is_some());
        assert!(still_held(&report(20_000, &[]), &before, Some(42)).is_some());
        assert_eq!(still_held(&report(700, &[7]), &before, Some(42)), None);
        assert_eq!(
            still_held(&GpuReport::Unavailable("no".to_owned()), &before, Some(42)),
            None
        );
    }

    #[test]
    fn an_engine_given_no_gpu_is_waited_for_on_every_gpu() {
        let mut two = report(500, &[]);
        if let GpuReport::Gpus { gpus, .. } = &mut two {
            let mut second = gpus[0].clone();
            second.index = 1;
            second.uuid = "GPU-b".to_owned();
            second.memory_used_mb = 900;
            gpus.push(second);
        }
        assert_eq!(memory_of(&two, None), [(0, 500), (1, 900)]);
        assert_eq!(memory_of(&two, Some("1")), [(1, 900)]);
        let before = memory_of(&two, None);
        assert!(still_held(&report(40_000, &[42]), &before, Some(42)).is_some());
    }
}
