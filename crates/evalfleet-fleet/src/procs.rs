//! What processes use, from Linux's `/proc`: a process tree's resident
//! memory and CPU time, for the run's telemetry (`watchdog`). Elsewhere
//! than Linux, or where `/proc` cannot be read, nothing is known (`None`),
//! never an error.
//!
//! These reads block (they are file reads, however fast): call them off the
//! async threads.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::Instant;

/// `/proc`'s CPU times are in clock ticks of `USER_HZ`, which Linux fixes
/// at 100 for every architecture's user ABI.
const TICKS_PER_SECOND: f64 = 100.0;

/// One process, as `/proc/PID/stat` and `/proc/PID/status` tell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proc {
    pub pid: u32,
    pub ppid: u32,
    /// User and system CPU time, in clock ticks.
    pub ticks: u64,
    /// Resident memory, in KiB (`VmRSS`; 0 for a kernel thread or a zombie).
    pub rss_kib: u64,
}

/// Reads `/proc/PID/stat` (`pid (comm) state ppid ... utime stime ...`):
/// the command's name may hold spaces and parentheses, so the fields are
/// counted after its last `)`.
pub fn parse_stat(text: &str) -> Option<(u32, u32, u64)> {
    let (head, tail) = text.rsplit_once(')')?;
    let pid = head.split_whitespace().next()?.parse().ok()?;
    let fields: Vec<&str> = tail.split_whitespace().collect();
    // After the name: state (3), ppid (4), ..., utime (14), stime (15).
    let ppid = fields.get(1)?.parse().ok()?;
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((pid, ppid, utime + stime))
}

/// `VmRSS` of `/proc/PID/status`, in KiB.
pub fn parse_rss_kib(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
}

fn read(root: &Path, pid: u32) -> Option<Proc> {
    let dir = root.join(pid.to_string());
    let (pid, ppid, ticks) = parse_stat(&std::fs::read_to_string(dir.join("stat")).ok()?)?;
    let rss_kib = std::fs::read_to_string(dir.join("status"))
        .ok()
        .and_then(|s| parse_rss_kib(&s))
        .unwrap_or(0);
    Some(Proc {
        pid,
        ppid,
        ticks,
        rss_kib,
    })
}

/// One process now, if it exists.
pub fn process(pid: u32) -> Option<Proc> {
    read(Path::new("/proc"), pid)
}

/// Every process's pid and parent, from `/proc/*/stat`.
fn parents() -> HashMap<u32, u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return HashMap::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            parse_stat(&stat).map(|(pid, ppid, _)| (pid, ppid))
        })
        .collect()
}

/// The pids of the trees rooted at `roots`, each root with its
/// descendants, read once for all of them.
pub fn trees(roots: &[u32]) -> Vec<Vec<u32>> {
    if roots.is_empty() {
        return Vec::new();
    }
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for (pid, ppid) in parents() {
        children.entry(ppid).or_default().push(pid);
    }
    roots
        .iter()
        .map(|root| descendants(&children, *root))
        .collect()
}

/// `root` and every process below it in `children`.
pub fn descendants(children: &HashMap<u32, Vec<u32>>, root: u32) -> Vec<u32> {
    let mut seen = HashSet::from([root]);
    let mut out = vec![root];
    let mut next = 0;
    while let Some(pid) = out.get(next).copied() {
        next += 1;
        for child in children.get(&pid).into_iter().flatten() {
            if seen.insert(*child) {
                out.push(*child);
            }
        }
    }
    out
}

/// What a process tree uses now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    pub rss_mb: f64,
    /// Percent of one core since the last reading of the same meter;
    /// `None` at the first.
    pub cpu_pct: Option<f64>,
}

/// Turns a tree's CPU ticks into a share of a core between two readings.
/// A process is counted from the reading after the one it first appears
/// in (its earlier time is not of this interval).
#[derive(Debug, Default)]
pub struct CpuMeter {
    last: Option<(Instant, HashMap<u32, u64>)>,
}

impl CpuMeter {
    /// The usage of `procs` (a tree's processes) at `now`.
    pub fn read(&mut self, procs: &[Proc], now: Instant) -> Usage {
        let rss_kib: u64 = procs.iter().map(|p| p.rss_kib).sum();
        let ticks: HashMap<u32, u64> = procs.iter().map(|p| (p.pid, p.ticks)).collect();
        let cpu_pct = self.last.as_ref().and_then(|(then, before)| {
            let wall = now.saturating_duration_since(*then).as_secs_f64();
            (wall > 0.0).then(|| {
                let spent: u64 = ticks
                    .iter()
                    .filter_map(|(pid, t)| before.get(pid).map(|b| t.saturating_sub(*b)))
                    .sum();
                100.0 * spent as f64 / TICKS_PER_SECOND / wall
            })
        });
        self.last = Some((now, ticks));
        Usage {
            rss_mb: rss_kib as f64 / 1024.0,
            cpu_pct,
        }
    }
}

/// The processes of `pids` that still exist.
pub fn read_all(pids: &[u32]) -> Vec<Proc> {
    pids.iter().filter_map(|pid| process(*pid)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_is_read_past_a_name_with_spaces_and_parentheses() {
        let line = "4242 (vllm (worker) 1) S 4200 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 8 0 123 456 789 18446744073709551615\n";
        assert_eq!(parse_stat(line), Some((4242, 4200, 300)));
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(
            parse_rss_kib("Name:\tx\nVmRSS:\t  102400 kB\nVmSwap: 0 kB\n"),
            Some(102_400)
        );
        assert_eq!(parse_rss_kib("Name:\tkthreadd\n"), None);
    }

    #[test]
    fn a_tree_is_its_root_and_every_descendant_once() {
        let children = HashMap::from([(1, vec![2, 3]), (2, vec![4]), (4, vec![1]), (9, vec![10])]);
        let mut tree = descendants(&children, 1);
        tree.sort_unstable();
        assert_eq!(tree, vec![1, 2, 3, 4]);
        assert_eq!(descendants(&children, 7), vec![7]);
    }

    #[test]
    fn cpu_is_counted_between_readings_and_from_a_process_second_reading() {
        let mut meter = CpuMeter::default();
        let start = Instant::now();
        let proc = |pid, ticks| Proc {
            pid,
            ppid: 1,
            ticks,
            rss_kib: 1024,
        };
        let first = meter.read(&[proc(1, 1000)], start);
        assert_eq!(first.cpu_pct, None);
        assert!((first.rss_mb - 1.0).abs() < 1e-9);
        // 50 ticks in half a second: one core; a newcomer's 900 ticks are
        // not of this interval.
        let second = meter.read(
            &[proc(1, 1050), proc(2, 900)],
            start + std::time::Duration::from_millis(500),
        );
        assert!((second.cpu_pct.unwrap() - 100.0).abs() < 1e-6, "{second:?}");
        assert!((second.rss_mb - 2.0).abs() < 1e-9);
    }
}
