//! What a config from outside (sent to `evalfleet serve` over HTTP, or
//! named by path in such a request) may do. A config from the command line
//! is its user's own and may do anything; one from a request is the
//! requester's, who may be anybody who can reach the server. So such a
//! config:
//! - runs no command (`start_cmd`, `stop_cmd`, a `local` engine's command,
//!   a `remote` endpoint's ssh, the code judge's `python` or `compiler`, a
//!   metric backend's `command` and `setup`, an exec task's `command`) unless the server allows it
//!   (`--allow-commands`);
//! - reads and writes files only under the server's roots (`--allow-root`),
//!   symbolic links and `..` resolved first, with the same refusal whether
//!   the file exists or not, so that a refusal tells nothing of what is
//!   outside; image files named by its dataset's rows too, checked as each
//!   is read (`ImageSettings::roots`), and it fetches no image URL;
//! - expands `${VAR}` only for the variables the server names
//!   (`--allow-env`), and only where a secret belongs (an endpoint's
//!   `api_key`, `headers` and `env`, which are masked wherever they are
//!   kept or shown), so that no secret reaches a template, an item, a page
//!   or a response;
//! - sends such a variable only to the hosts the server names for it
//!   (`--allow-env NAME=HOST,...`): an `external` endpoint that uses it
//!   must have a `base_url` on one of them, so that a config cannot point
//!   its endpoint at a server of its own and receive the secret there.
//!
//! The checks run on the document as sent, before anything is expanded,
//! read or validated, and every refusal is reported at once.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::path;
use super::problems::RawProblem;

/// What a config from outside may do.
#[derive(Debug, Clone, Default)]
pub struct Admission {
    /// Directories (canonical) its files must be under.
    pub roots: Vec<PathBuf>,
    /// Variables `${NAME}` may name, in an endpoint's secrets only.
    pub env: BTreeSet<String>,
    /// The hosts (lower-case names or IP addresses) each variable of `env`
    /// may be sent to: an endpoint using it must have its `base_url` on
    /// one of them. A variable with none may be used only by endpoints
    /// that send nothing out (`mock`).
    pub destinations: BTreeMap<String, BTreeSet<String>>,
    /// Whether it may run commands: start engines (`local`, `remote`) and
    /// run an external endpoint's `start_cmd` and `stop_cmd`.
    pub commands: bool,
}

/// Every field of a config that names a file, and what a relative path in
/// it is relative to. A new field that names a file is added here, or a
/// config from outside could use it to leave the roots.
const PATHS: [(&[&str], Relative); 4] = [
    (&["dataset", "path"], Relative::ConfigDir),
    (&["task", "schema_file"], Relative::ConfigDir),
    (&["cache", "path"], Relative::WorkingDir),
    (&["store"], Relative::WorkingDir),
];

/// The same, in each endpoint.
const ENDPOINT_PATHS: [(&[&str], Relative); 1] = [(&["mock", "answers"], Relative::ConfigDir)];

/// The fields of an endpoint that may hold a secret, and so a `${VAR}`.
const SECRETS: [&str; 3] = ["api_key", "headers", "env"];

/// The fields of an endpoint that run commands.
const COMMANDS: [&str; 2] = ["start_cmd", "stop_cmd"];

/// The fields of `task.code` that name a program of the server's to run
/// (the judge's interpreter and compiler): a config from outside uses the
/// server's own.
const PROGRAMS: [&str; 2] = ["python", "compiler"];

#[derive(Debug, Clone, Copy)]
enum Relative {
    ConfigDir,
    WorkingDir,
}

impl Admission {
    /// A host as [`Self::destinations`] holds it: lower-case, without
    /// brackets or a trailing dot.
    pub fn host(name: &str) -> String {
        normalize_host(name)
    }

    /// Why `document` (as sent, before `${VAR}` expansion) may not be run,
    /// each reason with the path it is at; empty when it may.
    pub(super) fn refusals(&self, document: &Value, dir: &Path) -> Vec<RawProblem> {
        let mut out = Vec::new();
        self.references(document, "", false, &mut out);
        for (keys, relative) in PATHS {
            self.file(document, keys, "", relative, dir, &mut out);
        }
        if !self.commands
            && document
                .get("task")
                .and_then(|task| task.get("metric_backends"))
                .is_some()
        {
            let at = "task.metric_backends".to_owned();
            let message = format!(
                "{at}: a config sent to this server may not run metric backends (each runs a command on the server); the server allows it only when started with --allow-commands"
            );
            out.push((at, message));
        }
        if document
            .get("dataset")
            .and_then(|dataset| dataset.get("sheet"))
            .is_some()
        {
            let at = "dataset.sheet".to_owned();
            let message = format!(
                "{at}: a config sent to this server may not read or write a Google Sheet (it would do so with the server's service-account key)"
            );
            out.push((at, message));
        }
        let task = document.get("task");
        let exec = task
            .and_then(|task| task.get("kind"))
            .and_then(Value::as_str)
            == Some("exec")
            || task.and_then(|task| task.get("command")).is_some();
        if !self.commands && exec {
            let at = "task.command".to_owned();
            let message = format!(
                "{at}: a config sent to this server may not run an agent (kind: exec runs a command on the server); the server allows it only when started with --allow-commands"
            );
            out.push((at, message));
        }
        let fetch = document
            .get("task")
            .and_then(|task| task.get("images"))
            .and_then(|images| images.get("fetch_urls"));
        if fetch.is_some_and(|f| f != &Value::Bool(false)) {
            let at = "task.images.fetch_urls".to_owned();
            let message = format!(
                "{at}: a config sent to this server may not have it fetch URLs (the endpoint may fetch them itself)"
            );
            out.push((at, message));
        }
        if !self.commands {
            let code = document.get("task").and_then(|task| task.get("code"));
            for key in PROGRAMS {
                if code.and_then(|code| code.get(key)).is_some() {
                    let at = format!("task.code.{key}");
                    let message = format!(
                        "{at}: a config sent to this server may not choose a program to run (the judge uses the server's own); the server allows it only when started with --allow-commands"
                    );
                    out.push((at, message));
                }
            }
        }
        let endpoints = document.get("endpoints").and_then(Value::as_array);
        for (i, endpoint) in endpoints.into_iter().flatten().enumerate() {
            let at = path::index("endpoints", i);
            for (keys, relative) in ENDPOINT_PATHS {
                self.file(endpoint, keys, &at, relative, dir, &mut out);
            }
            self.destination(endpoint, &at, &mut out);
            if self.commands {
                continue;
            }
            let kind = endpoint.get("kind").and_then(Value::as_str);
            if let Some(kind @ ("local" | "remote")) = kind {
                let at = path::key(&at, "kind");
                let message = format!(
                    "{at}: a config sent to this server may not start engines ({kind} runs a command on the server); the server allows it only when started with --allow-commands"
                );
                out.push((at, message));
            }
            for key in COMMANDS {
                if endpoint.get(key).is_some() {
                    let at = path::key(&at, key);
                    let message = format!(
                        "{at}: a config sent to this server may not run commands; the server allows it only when started with --allow-commands"
                    );
                    out.push((at, message));
                }
            }
        }
        out
    }

    /// Refuses every `${VAR}` in `value` but those of allowed variables in
    /// an endpoint's secrets.
    fn references(&self, value: &Value, at: &str, secret: bool, out: &mut Vec<RawProblem>) {
        match value {
            Value::String(text) => {
                for name in super::env::references(text) {
                    let allowed = secret && self.env.contains(&name);
                    if !allowed {
                        let message = if secret {
                            format!(
                                "{at}: ${{{name}}} is not a variable this server lets a config read (it names them with --allow-env)"
                            )
                        } else {
                            format!(
                                "{at}: ${{{name}}}: a config sent to this server may read variables only in an endpoint's api_key, headers or env, and only those the server names with --allow-env"
                            )
                        };
                        out.push((at.to_owned(), message));
                    }
                }
            }
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    self.references(item, &path::index(at, i), secret, out);
                }
            }
            Value::Object(map) => {
                let in_endpoint = path::parent(at)
                    .is_some_and(|parent| parent == "endpoints" && at.ends_with(']'));
                for (key, item) in map {
                    let secret = secret || (in_endpoint && SECRETS.contains(&key.as_str()));
                    self.references(item, &path::key(at, key), secret, out);
                }
            }
            _ => {}
        }
    }

    /// Refuses an endpoint that would send an allowed variable (in its
    /// secrets) to a host the server did not name for it. Endpoints that
    /// start engines are left to `--allow-commands` (which, allowing any
    /// command, allows reading any secret); a mock sends nothing out.
    fn destination(&self, endpoint: &Value, at: &str, out: &mut Vec<RawProblem>) {
        let kind = endpoint.get("kind").and_then(Value::as_str);
        if matches!(kind, Some("mock" | "local" | "remote")) {
            return;
        }
        let mut used = BTreeMap::new();
        for key in SECRETS {
            let Some(value) = endpoint.get(key) else {
                continue;
            };
            let texts: Vec<(&str, String)> = match value {
                Value::String(text) => vec![(text.as_str(), path::key(at, key))],
                Value::Object(map) => map
                    .iter()
                    .filter_map(|(name, v)| {
                        Some((v.as_str()?, path::key(&path::key(at, key), name)))
                    })
                    .collect(),
                _ => Vec::new(),
            };
            for (text, place) in texts {
                for name in super::env::references(text) {
                    if self.env.contains(&name) {
                        used.entry(name).or_insert(place.clone());
                    }
                }
            }
        }
        if used.is_empty() {
            return;
        }
        let url = endpoint.get("base_url").and_then(Value::as_str);
        let host = url.and_then(url_host);
        for (name, place) in used {
            let hosts = self.destinations.get(&name);
            let allowed =
                hosts.is_some_and(|hosts| host.as_ref().is_some_and(|h| hosts.contains(h)));
            if allowed {
                continue;
            }
            let named = match hosts {
                Some(hosts) if !hosts.is_empty() => {
                    hosts.iter().cloned().collect::<Vec<_>>().join(", ")
                }
                _ => "no host".to_owned(),
            };
            let sent_to = match (&host, url) {
                (Some(host), _) => format!("to {host} (this endpoint's base_url)"),
                (None, Some(url)) => {
                    format!("to '{url}' (this endpoint's base_url, which names no host)")
                }
                (None, None) => "to an endpoint without a base_url".to_owned(),
            };
            let message = format!(
                "{place}: ${{{name}}} may be sent only to {named} (the server names them with --allow-env {name}=HOST,...), not {sent_to}"
            );
            out.push((place, message));
        }
    }

    /// Refuses the file named at `keys` under `value` unless it is under a
    /// root.
    fn file(
        &self,
        value: &Value,
        keys: &[&str],
        at: &str,
        relative: Relative,
        dir: &Path,
        out: &mut Vec<RawProblem>,
    ) {
        let mut here = value;
        let mut at = at.to_owned();
        for key in keys {
            match here.get(key) {
                Some(next) => here = next,
                None => return,
            }
            at = path::key(&at, key);
        }
        let Some(text) = here.as_str() else {
            return;
        };
        if text.trim().is_empty() {
            return;
        }
        let base = match relative {
            Relative::ConfigDir => dir.to_owned(),
            Relative::WorkingDir => std::env::current_dir().unwrap_or_else(|_| dir.to_owned()),
        };
        if !self.inside(&base.join(text)) {
            let message = format!(
                "{at}: '{text}' is not under the directories this server reads from (--allow-root)"
            );
            out.push((at, message));
        }
    }

    /// Whether `path`, with its links followed, is under one of the roots.
    /// A path that does not exist (yet) is judged by its nearest existing
    /// ancestor, resolved, and the rest of it, which may not go up.
    pub fn inside(&self, path: &Path) -> bool {
        self.confined(path).is_some()
    }

    /// `path` resolved (links followed), when it is under one of the
    /// roots: what to open, so that a link changed after the check cannot
    /// lead out. A path with `..` in it is refused as it stands: resolving
    /// it through a folder outside the roots would tell, by the answer,
    /// whether that folder exists.
    pub fn confined(&self, path: &Path) -> Option<PathBuf> {
        if path
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            return None;
        }
        resolved(path).filter(|resolved| self.roots.iter().any(|root| resolved.starts_with(root)))
    }
}

/// A host as `--allow-env NAME=HOST` names it: lower-case, without
/// brackets or a trailing dot.
fn normalize_host(host: &str) -> String {
    host.trim()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .trim_end_matches('.')
        .to_ascii_lowercase()
}

/// The host of an http(s) URL, normalized; `None` when it is not one (or
/// still holds a `${VAR}`).
fn url_host(url: &str) -> Option<String> {
    if url.contains("${") {
        return None;
    }
    let parsed = reqwest::Url::parse(url.trim()).ok()?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return None;
    }
    Some(normalize_host(parsed.host_str()?))
}

/// `path` with every link and `..` of its existing part resolved; `None`
/// when nothing of it exists, when its missing part climbs (`..`), or when
/// it passes through a link that leads nowhere (writing through it would
/// create its target, wherever that is).
fn resolved(path: &Path) -> Option<PathBuf> {
    let mut existing = path.to_owned();
    let mut missing = Vec::new();
    loop {
        if let Ok(real) = std::fs::canonicalize(&existing) {
            let mut out = real;
            out.extend(missing.iter().rev());
            return Some(out);
        }
        if std::fs::symlink_metadata(&existing).is_ok() {
            return None;
        }
        // A path ending in `..` has no file name: it climbs.
        missing.push(existing.file_name()?.to_owned());
        if !existing.pop() {
            return None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn admission(root: &Path) -> Admission {
        Admission {
            roots: vec![std::fs::canonicalize(root).unwrap()],
            env: BTreeSet::from(["EF_ALLOWED_KEY".to_owned()]),
            destinations: BTreeMap::from([(
                "EF_ALLOWED_KEY".to_owned(),
                BTreeSet::from(["api.example.com".to_owned(), "::1".to_owned()]),
            )]),
            commands: false,
        }
    }

    fn paths(problems: &[RawProblem]) -> Vec<&str> {
        problems.iter().map(|(at, _)| at.as_str()).collect()
    }

    #[test]
    fn files_outside_the_roots_are_refused_alike_whether_they_exist_or_not() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret.csv"), "a\n1\n").unwrap();
        std::fs::write(root.path().join("items.jsonl"), "{}\n").unwrap();
        std::os::unix::fs::symlink(outside.path(), root.path().join("link")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("absent"), root.path().join("dangling"))
            .unwrap();
        let admission = admission(root.path());
        let dir = root.path();
        for ok in ["items.jsonl", "not-yet.jsonl", "sub/new.jsonl"] {
            let document = json!({"dataset": {"path": ok}});
            assert!(admission.refusals(&document, dir).is_empty(), "{ok}");
        }
        let secret = outside.path().join("secret.csv");
        for refused in [
            secret.to_str().unwrap(),
            "/etc/passwd",
            "/no/such/file",
            "../x.jsonl",
            "link/secret.csv",
            "link/absent.csv",
            "dangling",
            "absent/../../x.jsonl",
        ] {
            let document = json!({"dataset": {"path": refused}, "task": {"schema_file": refused}});
            let problems = admission.refusals(&document, dir);
            assert_eq!(
                paths(&problems),
                vec!["dataset.path", "task.schema_file"],
                "{refused}"
            );
            assert!(problems[0].1.contains("--allow-root"), "{problems:?}");
        }
    }

    #[test]
    fn commands_are_refused_unless_allowed() {
        let root = tempfile::tempdir().unwrap();
        let document = json!({"endpoints": [
            {"name": "a", "kind": "external", "start_cmd": "id > /tmp/x", "stop_cmd": "true"},
            {"name": "b", "kind": "local", "command": "sh -c id"},
            {"name": "c", "kind": "remote", "host": "gpu1"},
            {"name": "d", "kind": "mock"},
        ], "task": {"code": {"format": "stdio", "python": "/bin/sh", "compiler": "/tmp/cc"},
                    "metric_backends": [{"name": "x", "command": ["sh", "-c", "id"], "metrics": ["m"]}]}});
        let agent = json!({"task": {"kind": "exec", "command": "sh -c id"}});
        let refused = Admission::default().refusals(&agent, Path::new("/srv"));
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].0, "task.command");
        let allowing = Admission {
            commands: true,
            ..Admission::default()
        };
        assert!(allowing.refusals(&agent, Path::new("/srv")).is_empty());
        let mut admission = admission(root.path());
        assert_eq!(
            paths(&admission.refusals(&document, root.path())),
            vec![
                "task.metric_backends",
                "task.code.python",
                "task.code.compiler",
                "endpoints[0].start_cmd",
                "endpoints[0].stop_cmd",
                "endpoints[1].kind",
                "endpoints[2].kind"
            ]
        );
        admission.commands = true;
        assert!(admission.refusals(&document, root.path()).is_empty());
    }

    #[test]
    fn variables_are_read_only_when_allowed_and_only_into_secrets() {
        let root = tempfile::tempdir().unwrap();
        let document = json!({
            "name": "${EF_ALLOWED_KEY}",
            "endpoints": [{
                "name": "a", "kind": "external", "model": "${EF_ALLOWED_KEY}",
                "base_url": "https://api.example.com/v1",
                "api_key": "${EF_ALLOWED_KEY}",
                "headers": {"x-token": "${EF_OTHER}", "x-ok": "Bearer ${EF_ALLOWED_KEY}"},
            }],
            "task": {"messages": [{"role": "user", "content": "{{ q }} ${EF_ALLOWED_KEY} $${LITERAL}"}]},
        });
        let problems = admission(root.path()).refusals(&document, root.path());
        let mut refused = paths(&problems);
        refused.sort_unstable();
        assert_eq!(
            refused,
            vec![
                "endpoints[0].headers.x-token",
                "endpoints[0].model",
                "name",
                "task.messages[0].content"
            ]
        );
    }

    #[test]
    fn an_allowed_variable_goes_only_to_the_hosts_named_for_it() {
        let root = tempfile::tempdir().unwrap();
        let admission = admission(root.path());
        let endpoint = |base_url: Value, secret: (&str, Value)| {
            let mut endpoint = json!({"name": "a", "kind": "external", "model": "m"});
            if !base_url.is_null() {
                endpoint["base_url"] = base_url;
            }
            endpoint[secret.0] = secret.1;
            json!({"endpoints": [endpoint]})
        };
        let key = ("api_key", json!("${EF_ALLOWED_KEY}"));
        for ok in [
            "https://api.example.com/v1",
            "http://API.Example.com.:8443/v1",
            "http://[::1]:9/v1",
        ] {
            let problems = admission.refusals(&endpoint(json!(ok), key.clone()), root.path());
            assert!(problems.is_empty(), "{ok}: {problems:?}");
        }
        for (base_url, secret) in [
            (json!("https://attacker.example/v1"), key.clone()),
            (
                json!("https://api.example.com.attacker.example/v1"),
                key.clone(),
            ),
            (json!("http://127.0.0.1:9/v1"), key.clone()),
            (json!("not a url"), key.clone()),
            (Value::Null, key.clone()),
            (
                json!("https://attacker.example/v1"),
                ("headers", json!({"x-key": "Bearer ${EF_ALLOWED_KEY}"})),
            ),
        ] {
            let problems = admission.refusals(&endpoint(base_url.clone(), secret), root.path());
            assert_eq!(problems.len(), 1, "{base_url}: {problems:?}");
            let message = &problems[0].1;
            assert!(
                message.contains("${EF_ALLOWED_KEY}") && message.contains("api.example.com"),
                "{message}"
            );
        }
        let refused = admission.refusals(
            &endpoint(json!("https://attacker.example/v1"), key.clone()),
            root.path(),
        );
        assert!(
            refused[0].1.contains("not to attacker.example"),
            "{:?}",
            refused[0]
        );
        // A variable allowed with no host goes nowhere; a mock sends nothing.
        let nowhere = Admission {
            destinations: BTreeMap::new(),
            ..admission.clone()
        };
        let problems = nowhere.refusals(
            &endpoint(json!("https://api.example.com/v1"), key.clone()),
            root.path(),
        );
        assert!(problems[0].1.contains("only to no host"), "{problems:?}");
        let mock =
            json!({"endpoints": [{"name": "m", "kind": "mock", "api_key": "${EF_ALLOWED_KEY}"}]});
        assert!(nowhere.refusals(&mock, root.path()).is_empty());
    }

    #[test]
    fn a_config_from_outside_fetches_no_image_url_and_reads_images_only_under_its_roots() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let refused = admission(root.path()).refusals(
            &json!({"task": {"images": {"fetch_urls": true}}}),
            root.path(),
        );
        assert_eq!(paths(&refused), ["task.images.fetch_urls"]);
        assert!(
            admission(root.path())
                .refusals(
                    &json!({"task": {"images": {"fetch_urls": false}}}),
                    root.path()
                )
                .is_empty()
        );

        std::fs::write(root.path().join("in.png"), b"x").unwrap();
        std::fs::write(outside.path().join("out.png"), b"x").unwrap();
        let settings = super::super::ImageSettings {
            roots: Some(admission(root.path()).roots),
            ..Default::default()
        };
        assert!(settings.readable(&root.path().join("in.png")).is_some());
        assert!(settings.readable(&outside.path().join("out.png")).is_none());
        assert!(
            settings
                .readable(&root.path().join("../x/out.png"))
                .is_none()
        );
        let anywhere = super::super::ImageSettings::default();
        assert!(anywhere.readable(&outside.path().join("out.png")).is_some());
    }
}
