//! Workers on many machines share one run through PostgreSQL: a run on a
//! PostgreSQL store answers, exports and reports as one on SQLite does;
//! workers that die, stall, lose their network, lose their connection
//! right after a commit, or run with a wrong clock, against a database
//! that restarts mid-run, still leave exactly one result per item.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use evalfleet_mock::{MockServer, MockSettings};
use evalfleet_testkit::postgres::OwnServer;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::Child;

use crate::util::{Env, NO_HEALTH, by_id, config, external, mock, ms, signal, wait_until};

/// `evalfleet ARGS --store URL` in `env`.
async fn on(env: &Env, url: &str, args: &[&str]) -> crate::util::Ran {
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--store", url]);
    env.evalfleet(&all).await
}

/// The JSONL export of a run of the store at `url`.
async fn export(env: &Env, url: &str, run_id: &str) -> Vec<Value> {
    let ran = on(env, url, &["export", run_id, "--format", "jsonl"]).await;
    assert_eq!(ran.code, Some(0), "export failed: {}", ran.stderr);
    ran.stdout
        .lines()
        .map(|line| serde_json::from_str(line).expect("an export line is JSON"))
        .collect()
}

/// Runs `work`, which uses a blocking PostgreSQL client (its own runtime
/// cannot start on a thread of the test's).
fn blocking<R>(work: impl FnOnce() -> R) -> R {
    tokio::task::block_in_place(work)
}

/// How `child` (`what`) ended, within five minutes: its exit code and
/// what it wrote to stderr, when that was piped.
async fn ended_with(child: &mut Child, what: &str) -> (Option<i32>, String) {
    let status = tokio::time::timeout(Duration::from_secs(300), child.wait())
        .await
        .unwrap_or_else(|_| panic!("{what} does not finish"))
        .unwrap();
    let mut said = String::new();
    if let Some(mut err) = child.stderr.take() {
        err.read_to_string(&mut said).await.unwrap();
    }
    (status.code(), said)
}

/// Items of the run `run_id` ended so far (0 before it is registered),
/// read from the database directly.
fn ended(url: &str, run_id: &str) -> i64 {
    blocking(|| ended_here(url, run_id))
}

fn ended_here(url: &str, run_id: &str) -> i64 {
    let Ok(mut client) = postgres::Client::connect(url, postgres::NoTls) else {
        return 0;
    };
    client
        .query_one(
            "SELECT count(*) FROM evalfleet.items i JOIN evalfleet.runs r ON r.rid = i.rid
             WHERE r.run_id = $1 AND (i.state = 'done' OR i.state = 'failed')",
            &[&run_id],
        )
        .map_or(0, |row| row.get(0))
}

/// The checker every scale-out test ends with: every item of the run has
/// exactly one result, committed under the item's final claim; each
/// answer is the mock's answer to that item's own question; the mock
/// answered at least once per item. Returns results per worker.
fn check_exactly_once(
    url: &str,
    run_id: &str,
    items: usize,
    server: &MockServer,
) -> BTreeMap<String, i64> {
    blocking(|| check_here(url, run_id, items, server))
}

fn check_here(url: &str, run_id: &str, items: usize, server: &MockServer) -> BTreeMap<String, i64> {
    let mut client = postgres::Client::connect(url, postgres::NoTls).expect("the store answers");
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE i.state <> 'done'),
                    count(r.seq),
                    count(*) FILTER (WHERE r.claim_attempt <> i.attempt),
                    count(*) FILTER (WHERE r.output IS NULL
                                     OR strpos(r.output, 'question ' || (i.seq - 1) || ' of') = 0)
             FROM evalfleet.items i
             JOIN evalfleet.runs ru ON ru.rid = i.rid
             LEFT JOIN evalfleet.results r ON r.rid = i.rid AND r.seq = i.seq
             WHERE ru.run_id = $1",
            &[&run_id],
        )
        .unwrap();
    let (not_done, results, stale, wrong): (i64, i64, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    assert_eq!(not_done, 0, "every item is done");
    assert_eq!(results, items as i64, "one result per item");
    assert_eq!(
        stale, 0,
        "every result was committed under its item's last claim"
    );
    assert_eq!(
        wrong, 0,
        "every answer is the mock's answer to its own item"
    );
    assert!(
        server.stats().completed >= items as u64,
        "the mock answered every item: {:?}",
        server.stats()
    );
    client
        .query(
            "SELECT r.worker, count(*) FROM evalfleet.results r JOIN evalfleet.runs ru
             ON ru.rid = r.rid WHERE ru.run_id = $1 GROUP BY r.worker",
            &[&run_id],
        )
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_on_postgres_answers_exports_and_reports_as_one_on_sqlite() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 200);
    let server = mock(MockSettings::default()).await;
    env.write(
        "run.yaml",
        &config(&dataset, &external("m", &server, 8), ""),
    );
    let pg = on(&env, &db.url, &["run", "run.yaml", "-q", "--run-id", "r"]).await;
    assert_eq!(pg.code, Some(0), "{}", pg.stderr);
    let lite = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "r"])
        .await;
    assert_eq!(lite.code, Some(0), "{}", lite.stderr);

    // The same answers, field for field, but for what each call measured.
    let strip = |rows: Vec<Value>| -> BTreeMap<String, Value> {
        by_id(&rows)
            .into_iter()
            .map(|(id, mut row)| {
                for measured in ["latency_ms", "ttft_ms", "tpot_ms", "endpoint"] {
                    row.as_object_mut().unwrap().remove(measured);
                }
                (id, row)
            })
            .collect()
    };
    let on_pg = strip(export(&env, &db.url, "r").await);
    let on_lite = strip(env.export("r").await);
    assert_eq!(on_pg.len(), 200);
    assert_eq!(on_pg, on_lite);

    let status = on(&env, &db.url, &["status", "r", "--json"]).await;
    assert_eq!(status.code, Some(0), "{}", status.stderr);
    let status: Value = serde_json::from_str(&status.stdout).unwrap();
    assert_eq!(status["counts"]["done"], 200, "{status}");
    let runs = on(&env, &db.url, &["runs"]).await;
    assert_eq!(runs.code, Some(0), "{}", runs.stderr);
    assert!(
        runs.stdout
            .lines()
            .any(|line| line.split_whitespace().next() == Some("r")),
        "the run is listed: {}",
        runs.stdout
    );
    let report = on(&env, &db.url, &["report", "r"]).await;
    assert_eq!(report.code, Some(0), "{}", report.stderr);
    // The URL's password never shows; a store that cannot be reached is
    // named, with a code of its own.
    let bad = env
        .evalfleet(&["runs", "--store", "postgres://u:hunter2@127.0.0.1:1/x"])
        .await;
    assert_eq!(bad.code, Some(3), "{}", bad.stderr);
    assert!(
        bad.stderr.contains("postgres://u:***@127.0.0.1:1/x"),
        "{}",
        bad.stderr
    );
    assert!(!bad.stderr.contains("hunter2"), "{}", bad.stderr);
    check_exactly_once(&db.url, "r", 200, &server);
}

/// A TCP proxy to PostgreSQL that, `cuts` times, closes both connections
/// right after the server has committed a transaction that stored
/// results, before the client hears of it: the client cannot tell
/// whether its commit was stored.
struct CommitCutter {
    addr: std::net::SocketAddr,
    cuts: Arc<AtomicU32>,
    _task: tokio::task::JoinHandle<()>,
}

impl CommitCutter {
    async fn start(bind: &str, upstream: std::net::SocketAddr, cuts: u32) -> Self {
        let listener = TcpListener::bind(bind).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cuts = Arc::new(AtomicU32::new(cuts));
        let left = cuts.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let left = left.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        let _ = relay(client, server, left).await;
                    }
                });
            }
        });
        Self {
            addr,
            cuts,
            _task: task,
        }
    }

    fn cut(&self, total: u32) -> u32 {
        total - self.cuts.load(Ordering::Relaxed)
    }
}

/// Relays one connection; the server's messages are read one by one, so
/// that a `COMMIT` after a transaction that stored results is noticed.
async fn relay(client: TcpStream, server: TcpStream, cuts: Arc<AtomicU32>) -> std::io::Result<()> {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let storing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = storing.clone();
    // Client to server: bytes as they come, watched for a result insert
    // (the statement's text is sent when it is prepared).
    let up = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = client_read.read(&mut buf).await?;
            if n == 0 {
                return server_write.shutdown().await;
            }
            if buf[..n].windows(19).any(|w| w == b"INSERT INTO results") {
                seen.store(true, Ordering::Relaxed);
            }
            server_write.write_all(&buf[..n]).await?;
        }
    });
    let mut pending = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = server_read.read(&mut buf).await?;
        if n == 0 {
            up.abort();
            return Ok(());
        }
        pending.extend_from_slice(&buf[..n]);
        // Whole messages: a type byte, then a length that counts itself.
        let mut at = 0;
        while pending.len() >= at + 5 {
            let len = u32::from_be_bytes(pending[at + 1..at + 5].try_into().unwrap()) as usize;
            let end = at + 1 + len;
            if pending.len() < end {
                break;
            }
            let commit = pending[at] == b'C' && pending[at + 5..end].starts_with(b"COMMIT\0");
            if commit && storing.swap(false, Ordering::Relaxed) {
                let took = cuts
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                    .is_ok();
                if took {
                    // Committed on the server; the client never hears it.
                    client_write.write_all(&pending[..at]).await?;
                    up.abort();
                    return Ok(());
                }
            }
            at = end;
        }
        client_write.write_all(&pending[..at]).await?;
        pending.drain(..at);
    }
}

/// Network namespaces joined to this one by veth pairs, as hosts: host
/// `i` is `A.B.i.2` and reaches this one at `A.B.i.1`, where `A.B.0.0/16`
/// is a network that no address or route of this machine touches. Their
/// names hold the process id and a count, and are names no namespace or
/// link has yet, so that runs at once and leftovers of a crashed run do
/// not collide. Removed on drop.
struct Hosts {
    /// The first two bytes of the hosts' addresses.
    net: [u8; 2],
    names: Vec<String>,
    links: Vec<String>,
}

/// Runs `ip ARGS`, which must succeed; what it prints.
fn ip(args: &[&str]) -> String {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .expect("ip runs");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The IPv4 networks this machine's addresses and routes (of every
/// table) cover, as (address, prefix length); gateways, sources and
/// broadcast addresses count as /32s. The default route covers
/// everything and is left out.
fn networks_in_use() -> Vec<(u32, u32)> {
    let addrs = ip(&["-o", "-4", "addr", "show"]);
    let routes = ip(&["-4", "route", "show", "table", "all"]);
    addrs
        .split_whitespace()
        .chain(routes.split_whitespace())
        .filter_map(|word| {
            let (addr, len) = word.split_once('/').unwrap_or((word, "32"));
            let addr: std::net::Ipv4Addr = addr.parse().ok()?;
            let len: u32 = len.parse().ok()?;
            (1..=32).contains(&len).then_some((u32::from(addr), len))
        })
        .collect()
}

/// Whether two networks share an address.
fn overlap(a: (u32, u32), b: (u32, u32)) -> bool {
    let mask = u32::MAX << (32 - a.1.min(b.1));
    a.0 & mask == b.0 & mask
}

/// A private /16 that no address or route of this machine touches:
/// 10.231 (the tests' own, where it is free), else another of 10.200 to
/// 10.254 or 172.16 to 172.31.
fn free_net() -> [u8; 2] {
    let used = networks_in_use();
    (231..=254)
        .chain(200..231)
        .map(|b| [10, b])
        .chain((16..=31).map(|b| [172, b]))
        .find(|&[a, b]| {
            let net = (u32::from(std::net::Ipv4Addr::new(a, b, 0, 0)), 16);
            !used.iter().any(|&other| overlap(net, other))
        })
        .unwrap_or_else(|| panic!("no free /16 for the hosts; in use: {used:?}"))
}

/// Sets of hosts this process has named.
static NAMED: AtomicU32 = AtomicU32::new(0);

/// Names for `count` hosts that no namespace or link has yet: each
/// host's namespace, its link here and its link there.
fn free_names(count: usize) -> Vec<(String, String, String)> {
    let tag = std::process::id() % 100_000;
    loop {
        let set = NAMED.fetch_add(1, Ordering::Relaxed);
        let names: Vec<_> = (1..=count)
            .map(|i| {
                (
                    format!("efw{tag}n{set}h{i}"),
                    format!("efo{tag}n{set}h{i}"),
                    format!("efi{tag}n{set}h{i}"),
                )
            })
            .collect();
        let taken = names.iter().any(|(name, outer, inner)| {
            Path::new("/run/netns").join(name).exists()
                || Path::new("/sys/class/net").join(outer).exists()
                || Path::new("/sys/class/net").join(inner).exists()
        });
        if !taken {
            // A link's name holds at most 15 bytes.
            assert!(
                names
                    .iter()
                    .all(|(_, outer, inner)| outer.len() <= 15 && inner.len() <= 15)
            );
            return names;
        }
    }
}

impl Hosts {
    fn make(count: usize) -> Self {
        // Another run's hosts hold their network once made: choosing and
        // making are one step for runs at once.
        std::fs::create_dir_all("/run/lock").expect("/run/lock is made");
        let lock = std::fs::File::create("/run/lock/evalfleet-scaleout.lock")
            .expect("the lock file opens");
        lock.lock().expect("the lock is taken");
        let mut hosts = Self {
            net: free_net(),
            names: Vec::new(),
            links: Vec::new(),
        };
        for (i, (name, outer, inner)) in (1..=count).zip(free_names(count)) {
            ip(&["netns", "add", &name]);
            hosts.names.push(name.clone());
            ip(&[
                "link", "add", &outer, "type", "veth", "peer", "name", &inner,
            ]);
            hosts.links.push(outer.clone());
            ip(&["link", "set", &inner, "netns", &name]);
            ip(&[
                "addr",
                "add",
                &format!("{}/24", hosts.here(i)),
                "dev",
                &outer,
            ]);
            ip(&["link", "set", &outer, "up"]);
            ip(&[
                "-n",
                &name,
                "addr",
                "add",
                &format!("{}/24", hosts.there(i)),
                "dev",
                &inner,
            ]);
            ip(&["-n", &name, "link", "set", &inner, "up"]);
            ip(&["-n", &name, "link", "set", "lo", "up"]);
        }
        eprintln!(
            "hosts {:?} on {}.{}.0.0/16",
            hosts.names, hosts.net[0], hosts.net[1]
        );
        hosts
    }

    /// The address host `i` reaches this one at.
    fn here(&self, i: usize) -> String {
        let [a, b] = self.net;
        format!("{a}.{b}.{i}.1")
    }

    /// Host `i`'s address.
    fn there(&self, i: usize) -> String {
        let [a, b] = self.net;
        format!("{a}.{b}.{i}.2")
    }

    /// Host `i`'s link: up or cut.
    fn link(&self, i: usize, up: bool) {
        ip(&[
            "link",
            "set",
            &self.links[i - 1],
            if up { "up" } else { "down" },
        ]);
    }

    /// `evalfleet ARGS` on host `i`, its clock set off by `offset` (as
    /// libfaketime reads it: `-4m`), if given.
    fn spawn(&self, env: &Env, i: usize, offset: Option<&str>, args: &[&str]) -> Child {
        let mut command = tokio::process::Command::new("ip");
        if let Some(offset) = offset {
            command
                .env("LD_PRELOAD", FAKETIME)
                .env("FAKETIME", offset)
                // Only the wall clock: a monotonic clock set back could
                // fall below zero.
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        }
        command
            .args(["netns", "exec", &self.names[i - 1]])
            .arg(crate::util::BIN)
            .args(args)
            .current_dir(env.dir.path())
            .env_remove("EVALFLEET_STORE")
            .env_remove("EVALFLEET_LOG")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        command.spawn().expect("evalfleet starts in the namespace")
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for link in &self.links {
            let _ = std::process::Command::new("ip")
                .args(["link", "del", link])
                .output();
        }
        for name in &self.names {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", name])
                .output();
        }
    }
}

/// The config's endpoint as host `i` reaches the mock.
fn endpoints_of_host(env: &Env, hosts: &Hosts, i: usize, port: u16) -> std::path::PathBuf {
    env.write(
        &format!("host{i}.yaml"),
        &format!(
            "endpoints:\n  - {{ name: gpu, kind: external, base_url: \"http://{here}:{port}/v1\", model: m, concurrency: 4, {NO_HEALTH} }}\n",
            here = hosts.here(i),
        ),
    )
}

/// libfaketime (Debian's libfaketime), which sets a program's wall clock
/// off.
const FAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

const ITEMS: usize = 2000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hosts_share_a_run_through_kills_stalls_cuts_lost_commits_skewed_clocks_and_a_database_crash()
 {
    if !evalfleet_testkit::is_root() {
        evalfleet_testkit::skip!("network namespaces need root");
        return;
    }
    if !Path::new(FAKETIME).is_file() {
        evalfleet_testkit::skip!("{FAKETIME} is absent (Debian's libfaketime)");
        return;
    }
    let hosts = Hosts::make(3);
    let mut pg = match OwnServer::start_on(&format!(
        "127.0.0.1,{},{},{}",
        hosts.here(1),
        hosts.here(2),
        hosts.here(3)
    )) {
        Ok(pg) => pg,
        Err(why) => {
            evalfleet_testkit::skip!("no PostgreSQL server of the test's own: {why}");
            return;
        }
    };
    blocking(|| {
        let mut admin = postgres::Client::connect(&pg.url(), postgres::NoTls).unwrap();
        admin.batch_execute("CREATE DATABASE evals").unwrap();
    });
    let local = pg.url_at("127.0.0.1", "evals");

    let env = Env::new();
    let dataset = env.dataset("items.jsonl", ITEMS);
    let server = MockServer::start(
        std::net::SocketAddr::from(([0, 0, 0, 0], 0)),
        MockSettings {
            latency: ms(40),
            ..MockSettings::default()
        },
    )
    .await
    .unwrap();
    let port = server.addr().port();
    env.write(
        "run.yaml",
        &config(
            &dataset,
            &format!(
                "  - {{ name: gpu, kind: external, base_url: \"http://{here}:{port}/v1\", model: m, concurrency: 4, {NO_HEALTH} }}\n",
                here = hosts.here(1),
            ),
            "timeouts: { lease: 3s }\nwriter: { batch_size: 16, flush_interval: 20ms }",
        ),
    );
    let host2 = endpoints_of_host(&env, &hosts, 2, port);
    let host3 = endpoints_of_host(&env, &hosts, 3, port);
    // Host 2 reaches the database through a proxy that loses the answer to
    // some of its commits.
    let upstream = std::net::SocketAddr::from(([127, 0, 0, 1], pg.port));
    let cutter = CommitCutter::start(&format!("{}:0", hosts.here(2)), upstream, 3).await;
    let via_cutter = format!(
        "postgres://root@{}:{}/evals",
        hosts.here(2),
        cutter.addr.port()
    );

    // Host 1 registers the run and works on it, its clock 4 minutes
    // behind; hosts 2 and 3 join with endpoints of their own, host 3's
    // clock 7 minutes ahead.
    let mut first = hosts.spawn(
        &env,
        1,
        Some("-4m"),
        &[
            "run",
            "run.yaml",
            "-q",
            "--run-id",
            "shared",
            "--store",
            &pg.url_at(&hosts.here(1), "evals"),
        ],
    );
    wait_until(ms(60_000), "the run is registered and under way", || {
        if let Ok(Some(status)) = first.try_wait() {
            panic!("host 1 exited early ({status})");
        }
        ended(&local, "shared") >= 20
    })
    .await;
    let host2 = host2.to_string_lossy().into_owned();
    let host3 = host3.to_string_lossy().into_owned();
    let mut second = hosts.spawn(
        &env,
        2,
        None,
        &[
            "worker",
            "--run",
            "shared",
            "-q",
            "--endpoints",
            &host2,
            "--store",
            &via_cutter,
        ],
    );
    let third = hosts.spawn(
        &env,
        3,
        Some("+7m"),
        &[
            "worker",
            "--run",
            "shared",
            "-q",
            "--endpoints",
            &host3,
            "--store",
            &pg.url_at(&hosts.here(3), "evals"),
        ],
    );
    let at = |share: f64| (ITEMS as f64 * share) as i64;

    // Host 3 dies.
    wait_until(ms(120_000), "15% is done", || {
        ended(&local, "shared") >= at(0.15)
    })
    .await;
    signal(&third, "KILL").await;
    // Host 1's link is cut for longer than its lease, then restored.
    wait_until(ms(120_000), "30% is done", || {
        ended(&local, "shared") >= at(0.30)
    })
    .await;
    hosts.link(1, false);
    tokio::time::sleep(ms(5_000)).await;
    hosts.link(1, true);
    // Host 2 stalls past its lease, then goes on.
    wait_until(ms(120_000), "45% is done", || {
        ended(&local, "shared") >= at(0.45)
    })
    .await;
    signal(&second, "STOP").await;
    tokio::time::sleep(ms(5_000)).await;
    signal(&second, "CONT").await;
    // The database crashes (immediate shutdown) and comes back.
    wait_until(ms(120_000), "65% is done", || {
        ended(&local, "shared") >= at(0.65)
    })
    .await;
    pg.crash();
    tokio::time::sleep(ms(1_000)).await;
    pg.resume().expect("the database comes back");

    let (first_code, _) = ended_with(&mut first, "host 1").await;
    let (second_code, said) = ended_with(&mut second, "host 2").await;
    assert_eq!(first_code, Some(0), "host 1");
    assert_eq!(second_code, Some(0), "host 2: {said}");
    assert!(cutter.cut(3) >= 1, "a commit's answer was lost");
    assert!(
        said.contains("Lost the connection"),
        "host 2 noticed its lost connections: {said}"
    );
    assert!(
        said.contains("were refused"),
        "host 2's results made before its stall were refused once it went on: {said}"
    );
    assert!(
        said.contains("taken over by other workers"),
        "host 2's heartbeat told it which items it lost: {said}"
    );
    eprintln!("host 2 said:\n{said}");

    let by_worker = check_exactly_once(&local, "shared", ITEMS, &server);
    eprintln!(
        "results by worker: {by_worker:?}; commit answers lost: {}",
        cutter.cut(3)
    );
    assert!(
        by_worker.len() >= 3,
        "every host committed results: {by_worker:?}"
    );
    let status = on(&env, &local, &["status", "shared", "--json"]).await;
    assert_eq!(status.code, Some(0), "{}", status.stderr);
    let status: Value = serde_json::from_str(&status.stdout).unwrap();
    assert_eq!(status["status"], "finished", "{status}");
    // Which worker did what, as `status` shows it: the same split.
    let shown: BTreeMap<String, i64> = status["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["worker"].as_str().unwrap().to_owned(),
                w["done"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(shown, by_worker, "{status}");
}

/// The attempts of item `seq` of run `run_id`: (sent at, HTTP status), in
/// order, from a SQLite file or a PostgreSQL database.
fn attempts_of(store: &str, run_id: &str, seq: i64) -> Vec<(i64, Option<i32>)> {
    const SQL: &str = "SELECT a.sent_at, a.http_status FROM attempts a JOIN runs r ON r.rid = a.rid
                       WHERE r.run_id = $1 AND a.seq = $2 ORDER BY a.attempt";
    if store.starts_with("postgres://") {
        return blocking(|| {
            let Ok(mut client) = postgres::Client::connect(store, postgres::NoTls) else {
                return Vec::new();
            };
            let sql = SQL
                .replace("FROM attempts", "FROM evalfleet.attempts")
                .replace("JOIN runs", "JOIN evalfleet.runs");
            client
                .query(&sql, &[&run_id, &seq])
                .map(|rows| rows.iter().map(|r| (r.get(0), r.get(1))).collect())
                .unwrap_or_default()
        });
    }
    let Ok(conn) = rusqlite::Connection::open(store) else {
        return Vec::new();
    };
    conn.busy_timeout(Duration::from_secs(30)).unwrap();
    let Ok(mut stmt) = conn.prepare(&SQL.replace('$', "?")) else {
        return Vec::new();
    };
    stmt.query_map(rusqlite::params![run_id, seq], |row| {
        Ok((row.get(0)?, row.get(1)?))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_servers_retry_after_outlives_the_worker_that_heard_it() {
    let db = evalfleet_testkit::scratch_db!();
    let env = Env::new();
    let sqlite = env.path("runs/evalfleet.db").display().to_string();
    let mut stores = vec![sqlite];
    stores.extend(db.as_ref().map(|db| db.url.clone()));
    for (n, store) in stores.iter().enumerate() {
        // One request every 3 s: the second item is refused with a
        // Retry-After of about 3 s.
        let dataset = env.dataset(&format!("items{n}.jsonl"), 2);
        let server = mock(MockSettings {
            rpm: Some(20),
            burst: 1,
            ..MockSettings::default()
        })
        .await;
        env.write(
            "run.yaml",
            &config(
                &dataset,
                &external("m", &server, 1),
                "writer: { batch_size: 1, flush_interval: 10ms }",
            ),
        );
        let run_id = format!("r{n}");
        let mut first = env.spawn(&[
            "run", "run.yaml", "-q", "--run-id", &run_id, "--store", store,
        ]);
        // The 429 is stored with its wait; the worker dies before the wait
        // is over.
        wait_until(ms(30_000), "the second item's 429 is stored", || {
            attempts_of(store, &run_id, 2)
                .first()
                .is_some_and(|a| a.1 == Some(429))
        })
        .await;
        signal(&first, "KILL").await;
        let _ = first.wait().await;
        let refused_at = attempts_of(store, &run_id, 2)[0].0;
        let resumed = on(&env, store, &["resume", &run_id, "-q"]).await;
        assert_eq!(resumed.code, Some(0), "{store}: {}", resumed.stderr);
        let tries = attempts_of(store, &run_id, 2);
        assert!(tries.len() >= 2, "{store}: {tries:?}");
        assert!(
            tries[1].0 - refused_at >= 2_900,
            "{store}: the resumed worker waited out the Retry-After its predecessor heard: {tries:?}"
        );
        assert_eq!(tries.last().unwrap().1, Some(200), "{store}: {tries:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_sharing_an_api_key_share_its_quota() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let env = Env::new();
    const N: usize = 120;
    let dataset = env.dataset("items.jsonl", N);
    // The provider's quota: 600 requests a minute for the key, a second's
    // worth at once; beyond it, 429.
    let server = mock(MockSettings {
        rpm: Some(600),
        burst: 10,
        ..MockSettings::default()
    })
    .await;
    env.write(
        "run.yaml",
        &config(
            &dataset,
            &crate::util::external_with("api", &server, 8, "api_key: \"${SHARED_KEY}\", rpm: 600"),
            "timeouts: { lease: 30s }",
        ),
    );
    // The key, for both workers (a joining worker reads it again).
    env.write(".env", "SHARED_KEY=sk-shared\n");
    let mut first = env.spawn(&["run", "run.yaml", "-q", "--run-id", "q", "--store", &db.url]);
    wait_until(ms(30_000), "the run is under way", || {
        ended(&db.url, "q") >= 5
    })
    .await;
    let second = on(&env, &db.url, &["worker", "--run", "q", "-q"]).await;
    assert_eq!(second.code, Some(0), "{}", second.stderr);
    let first = first.wait().await.unwrap();
    assert_eq!(first.code(), Some(0));
    let by_worker = check_exactly_once(&db.url, "q", N, &server);
    assert_eq!(
        by_worker.len(),
        2,
        "both workers answered items: {by_worker:?}"
    );
    // Each paced alone to 600 a minute, the two together would send twice
    // the quota and meet a 429 about every other call.
    let stats = server.stats();
    assert!(
        stats.rate_limited <= 5,
        "the two workers kept within the key's quota together: {stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_rides_out_a_database_outage_longer_than_a_command_waits() {
    let mut pg = match OwnServer::start() {
        Ok(pg) => pg,
        Err(why) => {
            evalfleet_testkit::skip!("no PostgreSQL server of the test's own: {why}");
            return;
        }
    };
    let url = pg.url();
    let env = Env::new();
    let server = crate::workers::shared_run(&env, "10m").await;
    // Commands give up on the database after 2 s; a worker never does.
    let mut worker = env
        .command(&["run", "run.yaml", "-q", "--run-id", "r", "--store", &url])
        .env("EVALFLEET_STORE_WAIT", "2s")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_until(ms(30_000), "the worker has ended 50 items", || {
        ended(&url, "r") >= 50
    })
    .await;
    pg.crash();
    // A command cannot reach it: exit 3, saying so.
    let status = env
        .command(&["status", "r", "--store", &url])
        .env("EVALFLEET_STORE_WAIT", "2s")
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&status.stderr);
    assert_eq!(status.status.code(), Some(3), "{said}");
    assert!(said.contains("cannot connect to the store"), "{said}");
    // The outage lasts well past the commands' 2 s.
    tokio::time::sleep(ms(6_000)).await;
    pg.resume().expect("the database comes back");
    let (code, stderr) = ended_with(&mut worker, "the worker").await;
    assert_eq!(code, Some(0), "{stderr}");
    check_exactly_once(&url, "r", crate::workers::ITEMS, &server);
}
