//! PostgreSQL for tests: a database of a test's own on the machine's server
//! (`$EVALFLEET_TEST_POSTGRES`, else `postgres://root@127.0.0.1:5432/test`),
//! and a server of a test's own (the machine's `initdb` and `postgres`, a
//! temporary folder, a free port) for the tests that stop or restart it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use postgres::{Client, NoTls};

/// Runs `work` on a thread of its own: the blocking `postgres` client
/// starts a runtime of its own, which it cannot do on a thread of a test's
/// runtime (and a database dropped while such a test unwinds must not
/// panic again).
fn on_own_thread<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    std::thread::scope(|scope| match scope.spawn(work).join() {
        Ok(value) => value,
        Err(panic) => std::panic::resume_unwind(panic),
    })
}

/// The server tests use, as a URL of a database on it that exists.
pub fn server_url() -> String {
    std::env::var("EVALFLEET_TEST_POSTGRES")
        .ok()
        .filter(|url| !url.is_empty())
        .unwrap_or_else(|| "postgres://root@127.0.0.1:5432/test".to_owned())
}

/// `url` with its database replaced by `database`.
fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, format!("?{query}")),
        None => (url, String::new()),
    };
    let scheme_end = base.find("://").map_or(0, |at| at + 3);
    let host_end = base[scheme_end..]
        .find('/')
        .map_or(base.len(), |at| scheme_end + at);
    format!("{}/{database}{query}", &base[..host_end])
}

/// A database of one test's own, dropped (with whatever is still connected
/// to it) when it goes out of scope.
pub struct ScratchDb {
    /// Its URL.
    pub url: String,
    admin: String,
    name: String,
}

impl ScratchDb {
    /// A new empty database on the server at `server` (a URL of a database
    /// that exists there); `Err` says why there is none (no server
    /// answers, say).
    pub fn on(server: &str) -> Result<Self, String> {
        on_own_thread(|| Self::make(server))
    }

    fn make(server: &str) -> Result<Self, String> {
        let mut admin = Client::connect(server, NoTls)
            .map_err(|err| format!("no PostgreSQL server answers at {server}: {err}"))?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!(
            "evalfleet_test_{}_{}_{nanos:x}",
            std::process::id(),
            unique()
        );
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .map_err(|err| format!("cannot create a database at {server}: {err}"))?;
        Ok(Self {
            url: with_database(server, &name),
            admin: server.to_owned(),
            name,
        })
    }

    /// A new database on the machine's server (see [`server_url`]).
    pub fn new() -> Result<Self, String> {
        Self::on(&server_url())
    }

    /// A connection to it (on a thread outside any runtime).
    pub fn connect(&self) -> Client {
        #[allow(clippy::expect_used)] // a test's own database
        Client::connect(&self.url, NoTls).expect("the scratch database takes connections")
    }
}

impl Drop for ScratchDb {
    fn drop(&mut self) {
        let (admin, name) = (&self.admin, &self.name);
        on_own_thread(|| {
            if let Ok(mut admin) = Client::connect(admin, NoTls) {
                let _ =
                    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"));
            }
        });
    }
}

/// A number no other call in this process gets.
fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A scratch database on the machine's server, or `None` after
/// [`crate::skip!`] when none answers: `let Some(db) = scratch_db!() else { return };`.
#[macro_export]
macro_rules! scratch_db {
    () => {
        match $crate::postgres::ScratchDb::new() {
            Ok(db) => Some(db),
            Err(why) => {
                $crate::skip!("{why}");
                None
            }
        }
    };
}

/// A PostgreSQL server of a test's own, in a temporary folder, on a free
/// port of 127.0.0.1: started, stopped the way a crash stops it, and
/// started again on the same port and data. Run as the `postgres` user
/// when the tests run as root (PostgreSQL refuses root).
#[derive(Debug)]
pub struct OwnServer {
    dir: PathBuf,
    pub port: u16,
    /// The addresses it listens on (`listen_addresses`).
    listen: String,
    child: Option<Child>,
}

/// Where the machine's PostgreSQL programs are: on `PATH`, or Debian's
/// folder of the newest version.
fn program(name: &str) -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|path| path.is_file())
    });
    on_path.or_else(|| {
        let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path().join("bin").join(name)))
            .filter(|p| p.is_file())
            .collect();
        versions.sort();
        versions.pop()
    })
}

/// A port of 127.0.0.1 free now.
fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|err| format!("no free port: {err}"))
}

impl OwnServer {
    /// Makes a cluster and starts it on 127.0.0.1; `Err` says why it
    /// could not.
    pub fn start() -> Result<Self, String> {
        Self::start_on("127.0.0.1")
    }

    /// Makes a cluster that takes connections from any address (trusting
    /// them: a test's own network) and starts it listening on `listen`
    /// (PostgreSQL's `listen_addresses`: `*`, or addresses separated by
    /// commas).
    pub fn start_on(listen: &str) -> Result<Self, String> {
        let initdb = program("initdb").ok_or("initdb is not installed")?;
        let dir =
            std::env::temp_dir().join(format!("evalfleet-pg-{}-{}", std::process::id(), unique()));
        std::fs::create_dir_all(&dir).map_err(|err| format!("{}: {err}", dir.display()))?;
        let root = crate::is_root();
        if root {
            chown_to_postgres(&dir)?;
        }
        let data = dir.join("data");
        let out = as_owner(root, &initdb)
            .args(["-D"])
            .arg(&data)
            .args(["-U", "root", "--auth=trust", "--no-sync", "-E", "UTF8"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .map_err(|err| format!("initdb did not run: {err}"))?;
        if !out.status.success() {
            return Err(format!(
                "initdb failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let hba = data.join("pg_hba.conf");
        let mut rules = std::fs::read_to_string(&hba).map_err(|err| format!("{err}"))?;
        rules.push_str("\nhost all all 0.0.0.0/0 trust\n");
        std::fs::write(&hba, rules).map_err(|err| format!("{}: {err}", hba.display()))?;
        let mut server = Self {
            dir,
            port: free_port()?,
            listen: listen.to_owned(),
            child: None,
        };
        server.resume()?;
        Ok(server)
    }

    /// A URL of its `postgres` database.
    pub fn url(&self) -> String {
        self.url_at("127.0.0.1", "postgres")
    }

    /// A URL of its database `database`, reached at `host`.
    pub fn url_at(&self, host: &str, database: &str) -> String {
        format!("postgres://root@{host}:{}/{database}", self.port)
    }

    /// Starts it (again) and waits until it takes connections.
    pub fn resume(&mut self) -> Result<(), String> {
        let postgres = program("postgres").ok_or("postgres is not installed")?;
        let root = crate::is_root();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.log"))
            .map_err(|err| format!("the server's log: {err}"))?;
        if root {
            chown_to_postgres(&self.dir.join("server.log"))?;
        }
        let child = as_owner(root, &postgres)
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-p", &self.port.to_string(), "-c"])
            .arg(format!("listen_addresses={}", self.listen))
            .args(["-c", "unix_socket_directories=", "-c", "fsync=off"])
            .args(["-c", "max_connections=200"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|err| format!("postgres did not start: {err}"))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        let url = self.url();
        loop {
            if on_own_thread(|| Client::connect(&url, NoTls).is_ok()) {
                return Ok(());
            }
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(format!(
                    "postgres exited ({status}); its log: {}",
                    std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
                ));
            }
            if Instant::now() > deadline {
                return Err("postgres did not take connections within 60 s".to_owned());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops it as a crash would: immediate shutdown (SIGQUIT to the
    /// postmaster), every connection cut, no checkpoint; waits until it
    /// has exited.
    pub fn crash(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-QUIT", &child.id().to_string()])
                .status();
            let _ = child.wait();
        }
    }

    /// Its data folder's parent, for logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        self.crash();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `program`, run as the `postgres` user when `root` (by `setpriv`, which
/// becomes it: signals sent to the child reach the program itself).
fn as_owner(root: bool, program: &Path) -> Command {
    if root {
        let mut command = Command::new("setpriv");
        command
            .args([
                "--reuid=postgres",
                "--regid=postgres",
                "--init-groups",
                "--",
            ])
            .arg(program);
        command
    } else {
        Command::new(program)
    }
}

fn chown_to_postgres(path: &Path) -> Result<(), String> {
    let status = Command::new("chown")
        .args(["postgres:postgres"])
        .arg(path)
        .status()
        .map_err(|err| format!("chown: {err}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!(
            "cannot give {} to the postgres user",
            path.display()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_names_another_database_with_its_options_kept() {
        assert_eq!(
            with_database("postgres://root@127.0.0.1:5432/test", "x"),
            "postgres://root@127.0.0.1:5432/x"
        );
        assert_eq!(
            with_database("postgres://u:p@h/test?sslmode=disable", "x"),
            "postgres://u:p@h/x?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h", "x"), "postgres://h/x");
    }

    #[test]
    fn a_scratch_database_is_made_and_dropped() {
        let Some(db) = crate::scratch_db!() else {
            return;
        };
        let name: String = db
            .connect()
            .query_one("SELECT current_database()", &[])
            .unwrap()
            .get(0);
        assert!(name.starts_with("evalfleet_test_"), "{name}");
        drop(db);
        let mut admin = Client::connect(&server_url(), NoTls).unwrap();
        let left: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_database WHERE datname = $1",
                &[&name],
            )
            .unwrap()
            .get(0);
        assert_eq!(left, 0);
    }

    #[test]
    fn an_own_server_keeps_its_data_across_a_crash() {
        let mut server = match OwnServer::start() {
            Ok(server) => server,
            Err(why) => {
                crate::skip!("no PostgreSQL server of the test's own: {why}");
                return;
            }
        };
        let mut client = Client::connect(&server.url(), NoTls).unwrap();
        client
            .batch_execute("CREATE TABLE t (x int); INSERT INTO t VALUES (7)")
            .unwrap();
        server.crash();
        assert!(
            client.query_one("SELECT 1", &[]).is_err(),
            "the connection is cut"
        );
        server.resume().unwrap();
        let mut client = Client::connect(&server.url(), NoTls).unwrap();
        let x: i32 = client.query_one("SELECT x FROM t", &[]).unwrap().get(0);
        assert_eq!(x, 7, "committed data outlives an immediate shutdown");
    }
}
