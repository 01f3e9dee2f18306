//! Remote engines against a real host: an sshd of the test's own on
//! 127.0.0.1 (its own host key, client key and config), whose logins get a
//! home and a tmux server of their own. The engine is `evalfleet mock`,
//! started in tmux over SSH and reached through `ssh -L`, as a real engine
//! would be; the run is ended every way a run ends, and each time nothing
//! of the engine is left: its process, its tmux session, its tunnel, the
//! tunnel's port, its supervisor.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use tokio::process::{Child, Command};

use crate::fleet::{
    done, events, exists, free_port, kill_unawares, port_free, signal_group, spawn_in_group,
    with_arg, with_env,
};
use crate::util::{BIN, Env, by_id, config, ms, wait_until};

/// Whether `program` is on PATH (or, given a path, is a file).
fn installed(program: &str) -> bool {
    if program.contains('/') {
        return Path::new(program).is_file();
    }
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// A real sshd on 127.0.0.1 for one test.
struct Sshd {
    dir: tempfile::TempDir,
    port: u16,
    user: String,
    _server: Child,
}

impl Sshd {
    /// Starts one, or skips the test when OpenSSH's server or client, or
    /// tmux, is absent (`apt-get install openssh-server tmux`).
    async fn start() -> Option<Self> {
        for program in ["/usr/sbin/sshd", "ssh", "ssh-keygen", "tmux", "flock"] {
            if !installed(program) {
                evalfleet_testkit::skip!(
                    "{program} is absent (apt-get install openssh-server tmux)"
                );
                return None;
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let path = |name: &str| dir.path().join(name);
        for key in ["host_key", "client_key"] {
            let made = std::process::Command::new("ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", ""])
                .arg("-f")
                .arg(path(key))
                .status()
                .unwrap();
            assert!(made.success(), "ssh-keygen made {key}");
        }
        std::fs::copy(path("client_key.pub"), path("authorized_keys")).unwrap();
        std::fs::create_dir_all(path("home")).unwrap();
        std::fs::create_dir_all(path("tmux")).unwrap();
        // The logins' home and tmux server are the test's: nothing of the
        // machine's is touched, and tests do not see each other's sessions.
        let sshd_config = format!(
            "ListenAddress 127.0.0.1\n\
             HostKey {dir}/host_key\n\
             AuthorizedKeysFile {dir}/authorized_keys\n\
             PidFile {dir}/sshd.pid\n\
             StrictModes no\n\
             UsePAM no\n\
             PasswordAuthentication no\n\
             KbdInteractiveAuthentication no\n\
             PermitRootLogin prohibit-password\n\
             SetEnv HOME={dir}/home TMUX_TMPDIR={dir}/tmux\n\
             LogLevel ERROR\n",
            dir = dir.path().display()
        );
        std::fs::write(path("sshd_config"), sshd_config).unwrap();
        // sshd run by root wants its privilege separation directory, which
        // only the service's start script makes.
        let _ = std::fs::create_dir_all("/run/sshd");
        let user = String::from_utf8(
            std::process::Command::new("id")
                .arg("-un")
                .output()
                .unwrap()
                .stdout,
        )
        .unwrap()
        .trim()
        .to_owned();
        let port = free_port();
        let server = Command::new("/usr/sbin/sshd")
            .args(["-D", "-e", "-p", &port.to_string(), "-f"])
            .arg(path("sshd_config"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(path("sshd.log")).unwrap())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut sshd = Self {
            dir,
            port,
            user,
            _server: server,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let logged_in = sshd.ssh("true");
            if logged_in.status.success() {
                break;
            }
            let log = std::fs::read_to_string(sshd.dir.path().join("sshd.log")).unwrap_or_default();
            if let Ok(Some(status)) = sshd._server.try_wait() {
                panic!("sshd exited ({status}): {log}");
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "cannot log in to the test's sshd: {}; sshd said: {log}",
                String::from_utf8_lossy(&logged_in.stderr)
            );
            tokio::time::sleep(ms(50)).await;
        }
        Some(sshd)
    }

    /// The options an endpoint and the test log in with.
    fn options(&self) -> Vec<String> {
        let key = self.dir.path().join("client_key");
        [
            "-i",
            key.to_str().unwrap(),
            "-p",
            &self.port.to_string(),
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "LogLevel=ERROR",
        ]
        .map(str::to_owned)
        .to_vec()
    }

    fn host(&self) -> String {
        format!("{}@127.0.0.1", self.user)
    }

    /// Runs `command` on the host.
    fn ssh(&self, command: &str) -> Output {
        std::process::Command::new("ssh")
            .args(self.options())
            .arg(self.host())
            .arg(command)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// Runs tmux against the host's tmux server (the same machine).
    fn tmux(&self, args: &[&str]) -> Output {
        std::process::Command::new("tmux")
            .args(args)
            .env("TMUX_TMPDIR", self.dir.path().join("tmux"))
            .env("HOME", self.dir.path().join("home"))
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    fn has_session(&self, name: &str) -> bool {
        self.tmux(&["has-session", "-t", &format!("={name}")])
            .status
            .success()
    }

    /// Where the host keeps the engines' logs and owners.
    fn state(&self) -> PathBuf {
        self.dir.path().join("home/.local/state/evalfleet")
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.tmux(&["kill-server"]);
    }
}

/// A remote engine on the test's host: `evalfleet mock`, marked with
/// `mark` (`EF_MARK=...`, a leading assignment in the command as the
/// ollama preset has), on `remote_port` there, reached from `local_port`.
struct Remote {
    mark: String,
    local_port: u16,
    remote_port: u16,
}

const SESSION: &str = "evalfleet-box";

impl Remote {
    fn new(name: &str) -> Self {
        Self {
            mark: format!("EF_MARK={name}-{}", std::process::id()),
            local_port: free_port(),
            remote_port: free_port(),
        }
    }

    /// The endpoint's entry; `flags` are the mock's, `extra` more keys.
    /// Writes `run.yaml`: `items` items, answered by this engine started
    /// with the mock's `flags` (and `extra` endpoint keys), and `more` of
    /// the config's own.
    fn write_run(
        &self,
        env: &Env,
        sshd: &Sshd,
        items: usize,
        flags: &str,
        extra: &str,
        more: &str,
    ) {
        let dataset = env.dataset("items.jsonl", items);
        env.write(
            "run.yaml",
            &config(&dataset, &self.endpoint(sshd, flags, extra), more),
        );
    }

    fn endpoint(&self, sshd: &Sshd, flags: &str, extra: &str) -> String {
        format!(
            "  - name: box\n    kind: remote\n    host: {}\n    ssh_options: {}\n    \
             command: \"{} {BIN} mock --bind 127.0.0.1:{{port}} {flags}\"\n    \
             port: {}\n    local_port: {}\n    model: mock\n    concurrency: 8\n    \
             stop_grace: 2s\n    restart_delay: 200ms\n    \
             health: {{ interval: 200ms, timeout: 500ms }}\n{extra}",
            sshd.host(),
            serde_json::to_string(&sshd.options()).unwrap(),
            self.mark,
            self.remote_port,
            self.local_port,
        )
    }

    fn engine(&self) -> Vec<u32> {
        with_env(&self.mark)
    }

    /// Waits until nothing of the engine is left: no process of it (nor
    /// of `pids`, zombies included), no tmux session, no tunnel and its
    /// port free, no supervisor of the store.
    async fn assert_gone(&self, sshd: &Sshd, env: &Env, pids: &[u32]) {
        let tunnel = format!("{}:127.0.0.1:{}", self.local_port, self.remote_port);
        let claims = env.path("runs/.engines");
        let claims = claims.to_str().unwrap();
        wait_until(
            ms(30_000),
            "the engine, its session, its tunnel and its supervisor are gone",
            || {
                self.engine().is_empty()
                    && pids.iter().all(|pid| !exists(*pid))
                    && !sshd.has_session(SESSION)
                    && with_arg(&tunnel).is_empty()
                    && port_free(self.local_port)
                    && with_arg(claims).is_empty()
            },
        )
        .await;
    }

    /// Waits until the run serves through the engine, and returns the
    /// engine's processes.
    async fn serving(&self, env: &Env, run_id: &str, items: u64) -> Vec<u32> {
        wait_until(ms(30_000), "the remote engine serves", || {
            done(env, run_id) >= items && !self.engine().is_empty()
        })
        .await;
        self.engine()
    }
}

/// The run's log of the engine.
fn log(env: &Env, run_id: &str) -> String {
    std::fs::read_to_string(env.path(&format!("runs/{run_id}/box.log"))).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_engine_runs_over_real_ssh_in_tmux_keeps_its_output_and_is_restarted_when_killed()
{
    let Some(sshd) = Sshd::start().await else {
        return;
    };
    let env = Env::new();
    let remote = Remote::new("serve");
    remote.write_run(
        &env,
        &sshd,
        1000,
        "--latency 20ms",
        "    gpu: \"1\"\n",
        "retry: { backoff_base: 20ms }",
    );

    let dry = env.evalfleet(&["run", "run.yaml", "--dry-run"]).await;
    assert_eq!(dry.code, Some(0), "{}", dry.stderr);
    for expected in [
        "in tmux session evalfleet-box".to_owned(),
        format!(
            "-L {}:127.0.0.1:{} {}",
            remote.local_port,
            remote.remote_port,
            sshd.host()
        ),
        "env:      CUDA_VISIBLE_DEVICES=1".to_owned(),
    ] {
        assert!(dry.stdout.contains(&expected), "{expected}: {}", dry.stdout);
    }
    assert!(
        !env.store_path().exists() && !sshd.has_session(SESSION),
        "a dry run runs and writes nothing"
    );

    let mut run = env.spawn(&["run", "run.yaml", "-q", "--run-id", "rm"]);
    let first = remote.serving(&env, "rm", 50).await;
    // The command's own assignment and the config's gpu both reach it.
    let environ = std::fs::read(format!("/proc/{}/environ", first[0])).unwrap();
    let environ = String::from_utf8_lossy(&environ);
    assert!(environ.contains("CUDA_VISIBLE_DEVICES=1"), "{environ}");
    assert!(sshd.has_session(SESSION));
    for pid in &first {
        crate::util::signal_pid(*pid, "KILL").await;
    }
    let status = run.wait().await.unwrap();
    assert_eq!(status.code(), Some(0));

    let rows = by_id(&env.export("rm").await);
    assert_eq!(rows.len(), 1000, "every item exactly once");
    assert!(
        rows.values()
            .all(|r| r["status"] == "done" && r["endpoint"] == "box")
    );
    let kinds: Vec<String> = events(&env, "rm").into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        kinds.iter().filter(|k| *k == "started").count(),
        2,
        "restarted once: {kinds:?}"
    );
    // The engine's own output, from the host's tmux session, is in the
    // run's log: each start's first line, and how the first one ended.
    let log = log(&env, "rm");
    let url = format!("http://127.0.0.1:{}/v1", remote.remote_port);
    assert_eq!(
        log.lines().filter(|line| line.trim() == url).count(),
        2,
        "each start's output: {log}"
    );
    assert!(
        log.contains("evalfleet: the engine exited with status 137"),
        "{log}"
    );
    remote.assert_gone(&sshd, &env, &first).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hangup_or_a_kill_of_the_run_s_process_group_leaves_nothing_of_a_remote_engine() {
    let Some(sshd) = Sshd::start().await else {
        return;
    };
    let env = Env::new();
    let remote = Remote::new("group");
    remote.write_run(
        &env,
        &sshd,
        2000,
        "--latency 20ms",
        "",
        "retry: { backoff_base: 20ms }",
    );

    // Closing the terminal (or the SSH login) the run was started from
    // sends SIGHUP to its whole group.
    let mut run = spawn_in_group(&env, &["run", "run.yaml", "-q", "--run-id", "g"]);
    let first = remote.serving(&env, "g", 20).await;
    signal_group(&mut run, "HUP").await;
    remote.assert_gone(&sshd, &env, &first).await;

    let mut run = spawn_in_group(&env, &["resume", "g"]);
    let before = done(&env, "g");
    let second = remote.serving(&env, "g", before + 20).await;
    signal_group(&mut run, "KILL").await;
    remote.assert_gone(&sshd, &env, &second).await;

    let resumed = env.evalfleet(&["resume", "g", "-q"]).await;
    assert_eq!(resumed.code, Some(0), "{}", resumed.stderr);
    let rows = by_id(&env.export("g").await);
    assert_eq!(rows.len(), 2000);
    assert!(rows.values().all(|r| r["status"] == "done"));
    remote.assert_gone(&sshd, &env, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_engine_killed_while_it_starts_or_left_by_a_dead_run_is_replaced_never_refused() {
    let Some(sshd) = Sshd::start().await else {
        return;
    };
    let env = Env::new();
    let remote = Remote::new("start");
    remote.write_run(
        &env,
        &sshd,
        1500,
        "--latency 20ms",
        "",
        "retry: { backoff_base: 20ms }",
    );

    // Killed while the engine starts: the SSH login that makes the tmux
    // session is under way.
    let mut run = spawn_in_group(&env, &["run", "run.yaml", "-q", "--run-id", "s"]);
    wait_until(ms(30_000), "the engine is being started", || {
        log(&env, "s").contains("evalfleet supervise: started pid")
    })
    .await;
    signal_group(&mut run, "KILL").await;
    remote.assert_gone(&sshd, &env, &[]).await;

    // Left by a run whose supervisor died too (SIGKILL of both): the
    // session, the engine and the tunnel stay...
    let mut run = spawn_in_group(&env, &["resume", "s"]);
    let left = remote.serving(&env, "s", 20).await;
    let claims = env.path("runs/.engines");
    let supervisors = with_arg(claims.to_str().unwrap());
    assert_eq!(supervisors.len(), 1, "one supervisor: {supervisors:?}");
    kill_unawares(supervisors[0], &mut run).await;
    assert!(sshd.has_session(SESSION) && left.iter().all(|pid| exists(*pid)));
    assert!(!port_free(remote.local_port), "the tunnel is left");

    // ... and the next start replaces them.
    let resumed = env.evalfleet(&["resume", "s", "-q"]).await;
    assert_eq!(resumed.code, Some(0), "{}", resumed.stderr);
    let rows = by_id(&env.export("s").await);
    assert_eq!(rows.len(), 1500);
    assert!(rows.values().all(|r| r["status"] == "done"));
    let log = log(&env, "s");
    assert!(
        log.contains("left by a supervisor that died")
            && log.contains(
                "replacing tmux session evalfleet-box, left by an earlier run of this store"
            ),
        "{log}"
    );
    remote.assert_gone(&sshd, &env, &left).await;

    // A session of the same name that no run of this store started is
    // someone else's: refused, said, and left alone.
    let foreign = sshd.tmux(&["new-session", "-d", "-s", SESSION, "sleep 600"]);
    assert!(foreign.status.success());
    std::fs::remove_file(sshd.state().join(format!("{SESSION}.owner"))).unwrap();
    let small = env.dataset("small.jsonl", 5);
    env.write(
        "other.yaml",
        &config(
            &small,
            &remote.endpoint(&sshd, "--latency 20ms", "    restarts: 0\n"),
            "",
        ),
    );
    let refused = env
        .evalfleet(&["run", "other.yaml", "-q", "--run-id", "o"])
        .await;
    assert_eq!(refused.code, Some(130), "{}", refused.stderr);
    assert!(
        refused.stderr.contains(
            "tmux session evalfleet-box on ") && refused.stderr.contains(
            " was not started by a run of this store: end it (tmux kill-session -t evalfleet-box) or give the endpoint another session"
        ),
        "{}",
        refused.stderr
    );
    assert!(
        sshd.has_session(SESSION),
        "someone else's session is left alone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_engine_that_cannot_start_gives_up_with_its_own_last_lines() {
    let Some(sshd) = Sshd::start().await else {
        return;
    };
    let env = Env::new();
    let remote = Remote::new("fail");
    remote.write_run(&env, &sshd, 10, "--no-such-flag", "    restarts: 1\n", "");
    let ran = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "f"])
        .await;
    assert_eq!(ran.code, Some(130), "{}", ran.stderr);
    assert!(
        ran.stderr.contains(
            "box is left out of the run: it failed again after 1 restarts: it exited before it was ready"
        ) && ran.stderr.contains("its last lines: error: unexpected argument '--no-such-flag' found")
            && ran.stderr.contains("evalfleet: the engine exited with status 2"),
        "{}",
        ran.stderr
    );
    assert_eq!(env.counts("f").pending, 10, "every item left for a resume");
    let kinds: Vec<String> = events(&env, "f").into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        kinds.iter().filter(|k| *k == "start_failed").count(),
        2,
        "{kinds:?}"
    );
    remote.assert_gone(&sshd, &env, &[]).await;
}
