//! `evalfleet serve` as an attacker meets it: a page of another site that
//! rebinds its name to the loopback, a config sent over HTTP that tries to
//! run commands, read files outside the allowed roots or read the server's
//! secrets, and a read-only server asked to change things.

use std::time::Duration;

use serde_json::{Value, json};

use crate::serve::{client, config, get_keyed, serve_with, wait_for_state_keyed};
use crate::util::{Env, wait_until};

/// `POST /api/v1/runs` with `body`: its status and JSON body.
async fn create(base: &str, key: Option<&str>, body: Value) -> (u16, Value) {
    let mut request = client().post(format!("{base}/api/v1/runs")).json(&body);
    if let Some(key) = key {
        request = request.header("x-api-key", key);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

fn port(base: &str) -> &str {
    base.rsplit_once(':').unwrap().1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_whose_name_was_rebound_to_the_loopback_reaches_no_handler() {
    let env = Env::new();
    let marker = env.path("ran");
    for key in [None, Some("the-key")] {
        let vars: Vec<(&str, &str)> = key.iter().map(|k| ("EVALFLEET_API_KEY", *k)).collect();
        let (_server, base) = serve_with(&env, &["--allow-commands"], &vars).await;
        let rebound = format!("rebound.attacker.example:{}", port(&base));
        let origin = format!("http://{rebound}");
        // A config that runs a command, on a server that lets configs.
        let text = config(&env, 2, "1ms", 1, "")
            .replace(", mock: { latency: 1ms }", "")
            .replace(
                "kind: mock,",
                &format!(
                    "kind: external, base_url: \"http://127.0.0.1:9/v1\", model: m, start_cmd: \"touch {}\",",
                    marker.display()
                ),
            );
        for path in ["/api/v1/runs", "/", "/login", "/assets/app.js", "/metrics"] {
            let mut request = client()
                .get(format!("{base}{path}"))
                .header("host", &rebound);
            if let Some(key) = key {
                request = request.header("x-api-key", key);
            }
            let response = request.send().await.unwrap();
            assert_eq!(response.status(), 421, "{path} with key {key:?}");
        }
        let mut request = client()
            .post(format!("{base}/api/v1/runs"))
            .header("host", &rebound)
            .header("origin", &origin)
            .json(&json!({"config": text}));
        if let Some(key) = key {
            request = request.header("x-api-key", key);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 421);
        let body: Value = response.json().await.unwrap();
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--allow-host"),
            "{body}"
        );
        // The server's own names are answered; a page of another scheme or
        // port is not this server's.
        for host in [format!("localhost:{}", port(&base)), base[7..].to_owned()] {
            let mut request = client()
                .get(format!("{base}/api/v1/runs"))
                .header("host", &host);
            if let Some(key) = key {
                request = request.header("x-api-key", key);
            }
            assert_eq!(request.send().await.unwrap().status(), 200, "{host}");
        }
        for foreign in [
            format!("https://rebound.attacker.example:{}", port(&base)),
            "http://127.0.0.1:1".to_owned(),
            "null".to_owned(),
        ] {
            let mut request = client()
                .post(format!("{base}/api/v1/runs"))
                .header("origin", &foreign)
                .json(&json!({"config": text}));
            if let Some(key) = key {
                request = request.header("x-api-key", key);
            }
            assert_eq!(request.send().await.unwrap().status(), 403, "{foreign}");
        }
        let runs = get_keyed(&format!("{base}/api/v1/runs"), key).await;
        assert_eq!(runs, json!([]), "no run was registered");
    }
    assert!(!marker.exists(), "no command ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_sent_over_http_runs_no_command_and_reads_nothing_outside_its_roots() {
    let env = Env::new();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(
        outside.path().join("secret.jsonl"),
        "{\"id\": \"s\", \"question\": \"the secret row\"}\n",
    )
    .unwrap();
    std::os::unix::fs::symlink(outside.path(), env.path("link")).unwrap();
    let marker = env.path("ran");
    let (_server, base) = serve_with(&env, &[], &[]).await;
    let good = config(&env, 3, "1ms", 1, "");
    let engine = good.replace(", mock: { latency: 1ms }", "");
    let dataset = env.path("items.jsonl").display().to_string();
    let commands = [
        engine.replace(
            "kind: mock,",
            &format!(
                "kind: external, base_url: \"http://127.0.0.1:9/v1\", model: m, start_cmd: \"touch {}\",",
                marker.display()
            ),
        ),
        engine.replace(
            "kind: mock,",
            &format!(
                "kind: local, model: m, command: \"touch {} {{port}}\",",
                marker.display()
            ),
        ),
        engine.replace(
            "kind: mock,",
            "kind: remote, host: gpu1, model: m, preset: vllm,",
        ),
    ];
    for text in &commands {
        let (status, body) = create(&base, None, json!({"config": text})).await;
        assert_eq!(status, 403, "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--allow-commands"),
            "{body}"
        );
    }
    let secret = outside.path().join("secret.jsonl").display().to_string();
    let files = [
        ("dataset", good.replace(&dataset, &secret)),
        ("dataset", good.replace(&dataset, "/etc/passwd")),
        ("dataset", good.replace(&dataset, "/no/such/file.jsonl")),
        ("dataset", good.replace(&dataset, "link/secret.jsonl")),
        ("dataset", good.replace(&dataset, "../elsewhere.jsonl")),
        (
            "cache",
            format!(
                "{good}cache: {{ path: {}/cache.db }}\n",
                outside.path().display()
            ),
        ),
        (
            "task.schema_file",
            good.replace(
                "  metrics:",
                &format!("  schema_file: {secret}\n  metrics:"),
            ),
        ),
    ];
    for (place, text) in &files {
        let (status, body) = create(&base, None, json!({"config": text})).await;
        assert_eq!(status, 403, "{place}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(place) && message.contains("--allow-root"),
            "{message}"
        );
        assert!(!message.contains("the secret row"), "{message}");
    }
    // A config file named by path outside the roots, existing or not: the
    // same refusal.
    for path in [secret.as_str(), "/no/such/config.yaml"] {
        let (status, body) = create(&base, None, json!({"config_path": path})).await;
        assert_eq!(status, 403, "{path}: {body}");
    }
    let runs = get_keyed(&format!("{base}/api/v1/runs"), None).await;
    assert_eq!(runs, json!([]), "nothing was registered");
    assert!(!marker.exists(), "no command ran");

    // A server that allows commands runs them.
    let (_server, base) = serve_with(&env, &["--allow-commands"], &[]).await;
    let (status, body) = create(&base, None, json!({"config": commands[0], "run_id": "cmd"})).await;
    assert_eq!(status, 201, "{body}");
    wait_until(Duration::from_secs(30), "start_cmd ran", || marker.exists()).await;
    let cancelled = client()
        .post(format!("{base}/api/v1/runs/cmd/cancel"))
        .send()
        .await
        .unwrap();
    assert_eq!(cancelled.status(), 202);
}

/// A posted config's Parquet folder lies under the roots, and holds a link
/// to a shard outside them: the run reads the shards under the roots only,
/// never what a link leads out to (its files are opened beneath the roots,
/// links never followed out, whenever they are opened).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_posted_run_reads_no_parquet_shard_a_link_leads_out_to() {
    let env = Env::new();
    let outside = tempfile::tempdir().unwrap();
    std::fs::create_dir(env.path("shards")).unwrap();
    crate::parquet::write_items(&env.path("shards/train-00000-of-00002.parquet"), 3, 3);
    // Read too, its ids would be the inside shard's again: the run would
    // stop on a duplicate id.
    let secret = outside.path().join("train-00001-of-00002.parquet");
    crate::parquet::write_items(&secret, 5, 5);
    std::os::unix::fs::symlink(&secret, env.path("shards/train-00001-of-00002.parquet")).unwrap();
    let (_server, base) = serve_with(&env, &[], &[]).await;
    let text = config(&env, 3, "1ms", 1, "").replace(
        &env.path("items.jsonl").display().to_string(),
        &env.path("shards").display().to_string(),
    );
    let (status, body) = create(&base, None, json!({"config": text, "run_id": "linked"})).await;
    assert_eq!(status, 201, "{body}");
    let run = crate::serve::wait_for_state(&base, "linked", "finished").await;
    assert_eq!(run["total"], 3, "{run}");
    // Resumed at a request, it reads its dataset as it did: the same
    // three items (nothing to resume), not a dataset grown by the link.
    let response = client()
        .post(format!("{base}/api/v1/runs/linked/resume"))
        .json(&json!({"retry_failed": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 409);
    let body: Value = response.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("nothing to resume"),
        "{body}"
    );

    // The same folder in a config of the user's own follows the link (and
    // meets the duplicate ids).
    env.write("own.yaml", &text);
    let own = env.evalfleet(&["run", "own.yaml", "-q"]).await;
    assert_eq!(own.code, Some(2), "{}", own.stderr);
    assert!(own.stderr.contains("duplicate"), "{}", own.stderr);
}

/// The bench whose report and page [`everything_shown`] reads.
const BENCH: &str = "sec";

/// Every answer of the API's GET routes about `run_id` and every page of
/// it, as text.
async fn everything_shown(
    base: &str,
    key: &str,
    run_id: &str,
    item_id: &str,
) -> Vec<(String, String)> {
    let openapi = get_keyed(&format!("{base}/api/openapi.json"), Some(key)).await;
    let mut urls: Vec<String> = openapi["paths"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(path, operations)| operations.get("get").is_some() && path.as_str() != "/compare")
        .map(|(path, _)| {
            format!(
                "{base}/api/v1{}",
                path.replace("{run_id}", run_id)
                    .replace("{item_id}", item_id)
                    .replace("{name}", BENCH)
            )
        })
        .collect();
    urls.push(format!("{base}/api/v1/compare?runs={run_id},{run_id}"));
    for page in [
        "/".to_owned(),
        format!("/runs/{run_id}"),
        format!("/runs/{run_id}/items"),
        format!("/runs/{run_id}/items/{item_id}"),
        format!("/compare?a={run_id}&b={run_id}"),
        format!("/benches/{BENCH}"),
        "/metrics".to_owned(),
        "/api/openapi.json".to_owned(),
    ] {
        urls.push(format!("{base}{page}"));
    }
    let mut out = Vec::new();
    for url in urls {
        let response = tokio::time::timeout(
            Duration::from_secs(30),
            client().get(&url).header("x-api-key", key).send(),
        )
        .await
        .unwrap()
        .unwrap();
        let status = response.status();
        let body = response.text().await.unwrap();
        assert!(status.is_success(), "{url}: {status} {body}");
        out.push((url, body));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_started_over_http_reads_only_allowed_variables_and_shows_no_secret() {
    let env = Env::new();
    let key = "server-key-4f1c0d";
    let allowed = "sk-allowed-9b2e77";
    let other = "sk-other-31aa05";
    let vars = [
        ("EVALFLEET_API_KEY", key),
        ("EF_ALLOWED_SECRET", allowed),
        ("EF_OTHER_SECRET", other),
    ];
    // A bench whose engine fails after printing its command line, with
    // the key it was given, and its arguments: the failed cell's message
    // carries the engine's last lines.
    env.dataset("b.jsonl", 2);
    env.write(
        "bench.yaml",
        &format!(
            "name: {BENCH}\nmodels:\n  - name: a\n    endpoint:\n      kind: local\n      model: a\n      \
             api_key: {allowed}\n      \
             command: \"echo serve a --api-key {other} >&2; echo \\\"args: api_key='{allowed}'\\\" >&2; exit 3\"\n\
             datasets:\n  - name: d\n    dataset: {{path: b.jsonl, id_field: id}}\n    \
             task: {{messages: [{{role: user, content: '{{{{ question }}}}'}}]}}\n"
        ),
    );
    let bench = env.evalfleet(&["bench", "bench.yaml"]).await;
    assert_eq!(bench.code, Some(1), "{}\n{}", bench.stdout, bench.stderr);
    assert!(
        bench.stderr.contains("serve a --api-key ***"),
        "{}",
        bench.stderr
    );
    for secret in [allowed, other] {
        assert!(!bench.stderr.contains(secret), "{}", bench.stderr);
    }
    let (_server, base) =
        serve_with(&env, &["--allow-env", "EF_ALLOWED_SECRET=127.0.0.1"], &vars).await;
    let good = config(&env, 4, "1ms", 2, ", api_key: \"${EF_ALLOWED_SECRET}\"");
    let refused = [
        good.replace("{{ question }}\"", "{{ question }} ${EVALFLEET_API_KEY}\""),
        good.replace("{{ question }}\"", "{{ question }} ${EF_ALLOWED_SECRET}\""),
        good.replace("${EF_ALLOWED_SECRET}", "${EF_OTHER_SECRET}"),
        good.replace("name: served", "name: \"${EF_ALLOWED_SECRET}\""),
    ];
    for text in &refused {
        let (status, body) = create(&base, Some(key), json!({"config": text})).await;
        assert_eq!(status, 403, "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("--allow-env"), "{message}");
        for secret in [key, allowed, other] {
            assert!(!message.contains(secret), "{message}");
        }
    }
    let (status, body) = create(&base, Some(key), json!({"config": good, "run_id": "r"})).await;
    assert_eq!(status, 201, "{body}");
    let run = wait_for_state_keyed(&base, "r", "finished", Some(key)).await;
    assert_eq!(run["counts"]["done"], 4, "{run}");
    let shown = everything_shown(&base, key, "r", "item-00000").await;
    assert!(shown.len() >= 15, "{}", shown.len());
    let bench_page = shown
        .iter()
        .find(|(url, _)| url.ends_with(&format!("/benches/{BENCH}")))
        .unwrap();
    assert!(
        bench_page.1.contains("serve a --api-key ***"),
        "the failed cell's message is shown, masked: {}",
        bench_page.1
    );
    for (url, body) in &shown {
        for secret in [key, allowed, other] {
            assert!(!body.contains(secret), "{url} shows a secret: {body}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_server_refuses_every_route_that_would_change_something() {
    let env = Env::new();
    let path = env.write("run.yaml", &config(&env, 3, "1ms", 1, ""));
    let ran = env
        .evalfleet(&["run", path.to_str().unwrap(), "--run-id", "done", "--quiet"])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let (_server, base) = serve_with(&env, &["--read-only"], &[]).await;
    let openapi = get_keyed(&format!("{base}/api/openapi.json"), None).await;
    let mut writes = Vec::new();
    for (path, operations) in openapi["paths"].as_object().unwrap() {
        for method in ["post", "put", "patch", "delete"] {
            if operations.get(method).is_some() {
                writes.push((method, path.replace("{run_id}", "done")));
            }
        }
    }
    assert!(writes.len() >= 5, "{writes:?}");
    let bodies = [
        json!({}),
        json!({"action": "remove", "endpoint": "m"}),
        json!({"config_path": path}),
    ];
    for (method, path) in &writes {
        for body in &bodies {
            let url = format!("{base}/api/v1{path}");
            let request = match *method {
                "post" => client().post(&url),
                "put" => client().put(&url),
                "patch" => client().patch(&url),
                _ => client().delete(&url),
            };
            let response = request.json(body).send().await.unwrap();
            assert_eq!(response.status(), 403, "{method} {path} {body}");
        }
    }
    let runs = get_keyed(&format!("{base}/api/v1/runs"), None).await;
    assert_eq!(runs.as_array().unwrap().len(), 1, "{runs}");
    let changes =
        evalfleet_store::FleetMailbox::fleet_changes(&mut env.store(), "done", 0).unwrap();
    assert!(changes.is_empty(), "{changes:?}");
}

/// `evalfleet env` as `serve`: any address but a loopback one needs a key
/// (it does not start without one), and with a key every request carries it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_environment_server_on_another_address_needs_a_key_and_asks_for_it() {
    use tokio::io::AsyncBufReadExt;
    let env = Env::new();
    let _mocks = crate::conversation::spread(&env, 2, crate::conversation::TRAINER).await;
    // Were it to start, it would serve until stopped.
    let ran = tokio::time::timeout(
        Duration::from_secs(30),
        env.command(&["env", "spread.yaml", "--bind", "0.0.0.0:0"])
            .env_remove("EVALFLEET_API_KEY")
            .output(),
    )
    .await
    .expect("it refuses to start")
    .unwrap();
    assert_eq!(ran.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(stderr.contains("EVALFLEET_API_KEY"), "{stderr}");

    let key = "env-key-77d1";
    let mut server = env
        .command(&[
            "env",
            "spread.yaml",
            "--bind",
            "0.0.0.0:0",
            "--sessions",
            "2",
        ])
        .env("EVALFLEET_API_KEY", key)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = server.stdout.take().unwrap();
    let url = tokio::io::BufReader::new(stdout)
        .lines()
        .next_line()
        .await
        .unwrap()
        .expect("the server prints its address");
    let base = format!("http://127.0.0.1:{}", port(&url));
    let spec = format!("{base}/v1/spec");
    for wrong in [None, Some("env-key-77d2"), Some("")] {
        let mut request = client().get(&spec);
        if let Some(wrong) = wrong {
            request = request.header("x-api-key", wrong);
        }
        assert_eq!(request.send().await.unwrap().status(), 401, "{wrong:?}");
        let reset = client()
            .post(format!("{base}/v1/reset"))
            .bearer_auth(wrong.unwrap_or("x"))
            .json(&json!({"wait_s": 0}))
            .send()
            .await
            .unwrap();
        assert_eq!(reset.status(), 401, "{wrong:?}");
    }
    let keyed = client().get(&spec).header("x-api-key", key).send().await;
    assert_eq!(keyed.unwrap().status(), 200);
    let bearer = client().get(&spec).bearer_auth(key).send().await;
    assert_eq!(bearer.unwrap().status(), 200);
}

/// A sign-in with the key: its session cookie, from `Set-Cookie`.
async fn sign_in(base: &str, key: &str) -> reqwest::Response {
    let _ = client();
    let browser = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let body = format!("key={}", key.replace(' ', "+"));
    browser
        .post(format!("{base}/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body)
        .send()
        .await
        .unwrap()
}

/// The session cookie `evalfleet_session=TOKEN` a sign-in set, and the
/// whole `Set-Cookie`.
fn session_cookie(response: &reqwest::Response) -> (String, String) {
    let set = response.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .to_owned();
    let pair = set.split(';').next().unwrap().trim().to_owned();
    assert!(pair.starts_with("evalfleet_session="), "{set}");
    (pair, set)
}

async fn runs_with_cookie(base: &str, cookie: &str) -> u16 {
    client()
        .get(format!("{base}/api/v1/runs"))
        .header("cookie", cookie)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// Sign-in (issue 38, part 13): a session is a random token the server
/// keeps (none survives a restart), and a client that offers wrong keys in
/// a burst has only a few looked at.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sign_ins_open_random_sessions_and_a_burst_of_wrong_keys_is_mostly_refused_unread() {
    let env = Env::new();
    let key = "sign-in-key-5e1a";
    let (server, base) = crate::serve::serve(&env, &[], Some(key)).await;
    let first = sign_in(&base, key).await;
    assert_eq!(first.status(), 303);
    let (cookie, set) = session_cookie(&first);
    assert!(
        set.contains("HttpOnly") && set.contains("Max-Age=604800"),
        "{set}"
    );
    let (again, _) = session_cookie(&sign_in(&base, key).await);
    assert_ne!(cookie, again, "each sign-in opens a session of its own");
    assert!(!cookie.contains(key));
    assert_eq!(runs_with_cookie(&base, &cookie).await, 200);
    assert_eq!(runs_with_cookie(&base, &again).await, 200);
    let forged = format!("evalfleet_session={}", "0".repeat(64));
    assert_eq!(runs_with_cookie(&base, &forged).await, 401);
    // A restart ends every session.
    drop(server);
    let (_server, base) = crate::serve::serve(&env, &[], Some(key)).await;
    assert_eq!(runs_with_cookie(&base, &cookie).await, 401);

    // 40 wrong keys at once: 5 are free, the 6th makes the client wait a
    // second, and those sent meanwhile are not looked at.
    let (mut looked_at, mut refused) = (0, 0);
    for i in 0..40 {
        let response = sign_in(&base, &format!("wrong-{i}")).await;
        match response.status().as_u16() {
            401 => looked_at += 1,
            429 => {
                refused += 1;
                let retry: u64 = response.headers()["retry-after"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                assert!((1..=2).contains(&retry), "{retry}");
                if refused == 1 {
                    // The wait has just begun (a second at least): the
                    // right key is not looked at either, by header or
                    // sign-in, and wrong keys in a header count alike.
                    right_key_refused(&base, key).await;
                }
            }
            other => panic!("a wrong key got {other}"),
        }
    }
    assert!(
        (6..=7).contains(&looked_at),
        "{looked_at} wrong keys looked at"
    );
    assert_eq!(looked_at + refused, 40);
    // Once the wait is over the right key is taken, and forgets the wrong.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let status = sign_in(&base, key).await.status();
        if status == 303 {
            break;
        }
        assert_eq!(status, 429);
        assert!(tokio::time::Instant::now() < deadline, "still refused");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(sign_in(&base, "wrong-again").await.status(), 401);
}

/// While its client waits, the right key is refused unread (429), by
/// header and by sign-in, and a wrong key in a header alike.
async fn right_key_refused(base: &str, key: &str) {
    let keyed = client()
        .get(format!("{base}/api/v1/runs"))
        .header("x-api-key", key)
        .send()
        .await
        .unwrap();
    assert_eq!(keyed.status(), 429);
    assert_eq!(sign_in(base, key).await.status(), 429);
    // Wrong keys in a header count alike.
    let wrong = client()
        .get(format!("{base}/api/v1/runs"))
        .bearer_auth("wrong-header-key")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 429);
}

/// A stand-in endpoint on 127.0.0.1 that keeps the head (request line and
/// headers) of every request it gets and answers each with `status` and
/// `body`: its port and what it got.
async fn recorder(
    status: u16,
    body: &'static str,
) -> (u16, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let heads = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = heads.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let kept = kept.clone();
            tokio::spawn(async move {
                let mut read = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let Ok(n) = stream.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    read.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&read).into_owned();
                    let Some(end) = text.find("\r\n\r\n") else {
                        continue;
                    };
                    let length: usize = text[..end]
                        .lines()
                        .find_map(|l| {
                            let (name, value) = l.split_once(':')?;
                            name.eq_ignore_ascii_case("content-length")
                                .then(|| value.trim().parse().ok())?
                        })
                        .unwrap_or(0);
                    if read.len() < end + 4 + length {
                        continue;
                    }
                    kept.lock().unwrap().push(text[..end].to_owned());
                    read.drain(..end + 4 + length);
                    let answer = format!(
                        "HTTP/1.1 {status} Whatever\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if stream.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (port, heads)
}

/// The served config with its endpoint at `base_url`, given `secrets`
/// (`api_key: ...`, `headers: {...}`).
fn external_config(env: &Env, items: usize, base_url: &str, secrets: &str) -> String {
    config(env, items, "1ms", 1, "")
        .replace(", mock: { latency: 1ms }", "")
        .replace(
            "kind: mock,",
            &format!("kind: external, base_url: \"{base_url}\", model: m, {secrets},"),
        )
}

/// `--allow-env NAME=HOST` (issue 38, part 9): a posted config may use the
/// secret only in an endpoint on one of the hosts; one pointing elsewhere
/// is refused before anything is sent, and a listener there sees nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowed_secret_is_sent_only_to_the_hosts_its_operator_named() {
    let env = Env::new();
    let secret = "sk-bound-6a0f3c";
    // A variable allowed with no host: the server does not start.
    let ran = tokio::time::timeout(
        Duration::from_secs(30),
        env.command(&[
            "serve",
            "--bind",
            "127.0.0.1:0",
            "--allow-env",
            "EF_BOUND_SECRET",
        ])
        .output(),
    )
    .await
    .expect("it refuses to start")
    .unwrap();
    assert_eq!(ran.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(
        stderr.contains("--allow-env EF_BOUND_SECRET=HOST"),
        "{stderr}"
    );

    let (theirs, their_heads) = recorder(400, r#"{"error": "no"}"#).await;
    let (ours, our_heads) = recorder(400, r#"{"error": "no"}"#).await;
    let (_server, base) = serve_with(
        &env,
        &["--allow-env", "EF_BOUND_SECRET=127.0.0.1"],
        &[("EF_BOUND_SECRET", secret)],
    )
    .await;
    let attacker = format!("http://localhost:{theirs}/v1");
    for secrets in [
        "api_key: \"${EF_BOUND_SECRET}\"",
        "headers: { x-custom: \"token ${EF_BOUND_SECRET}\" }",
    ] {
        let text = external_config(&env, 2, &attacker, secrets);
        let (status, body) = create(&base, None, json!({"config": text})).await;
        assert_eq!(status, 403, "{secrets}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("${EF_BOUND_SECRET}") && message.contains("not to localhost"),
            "{message}"
        );
        assert!(!message.contains(secret), "{message}");
    }
    // On the named host, the key goes as it should.
    let text = external_config(
        &env,
        1,
        &format!("http://127.0.0.1:{ours}/v1"),
        "api_key: \"${EF_BOUND_SECRET}\"",
    );
    let (status, body) = create(&base, None, json!({"config": text, "run_id": "ok"})).await;
    assert_eq!(status, 201, "{body}");
    let bearer = format!("bearer {secret}");
    wait_until(
        Duration::from_secs(30),
        "the named host gets the key",
        || {
            our_heads
                .lock()
                .unwrap()
                .iter()
                .any(|head| head.to_ascii_lowercase().contains(&bearer))
        },
    )
    .await;
    let theirs = their_heads.lock().unwrap();
    assert!(theirs.is_empty(), "the other host got {theirs:?}");
}

/// Three nested loops of 100000, which would render for ever.
const FOREVER: &str = "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}{{ question }}{% endfor %}{% endfor %}{% endfor %}";

/// A template that would render for ever (issue 38, part 8): a posted
/// config of a few hundred bytes is refused soon, naming its template, and
/// SIGTERM stops the server within its grace while another is in progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_that_would_render_for_ever_is_refused_soon_and_sigterm_stops_the_server() {
    let env = Env::new();
    let (mut server, base) = serve_with(&env, &[], &[]).await;
    let text = config(&env, 3, "1ms", 1, "").replacen(
        "content: \"{{ question }}\"",
        &format!("content: \"{FOREVER}\""),
        1,
    );
    assert!(text.contains(FOREVER) && text.len() < 700, "{text}");
    let started = std::time::Instant::now();
    let (status, body) = tokio::time::timeout(
        Duration::from_secs(60),
        create(&base, None, json!({"config": text})),
    )
    .await
    .expect("the server answers");
    assert_eq!(status, 422, "{body}");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(15), "answered after {took:?}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("task.messages[0].content") && message.contains("steps"),
        "{message}"
    );
    let runs = crate::serve::get(&format!("{base}/api/v1/runs")).await;
    assert_eq!(runs, json!([]), "no run was registered");

    // Another on its way: SIGTERM stops the server within its grace
    // (5 s) all the same.
    let posting = tokio::spawn({
        let base = base.clone();
        async move { create(&base, None, json!({"config": text})).await }
    });
    // Long enough for the request to be under way, not to wait for it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    crate::util::signal(&server, "TERM").await;
    let exited = tokio::time::timeout(Duration::from_secs(10), server.wait())
        .await
        .expect("the server stops within its grace")
        .unwrap();
    assert!(exited.success() || exited.code().is_some(), "{exited:?}");
    drop(posting);
}

/// What an internal service at the endpoint's address replies.
const INTERNAL_REPLY: &str =
    r#"{"error": {"message": "internal-reply-5c1d: db=prod password=hunter2"}}"#;

/// An endpoint's error body (issue 38, part 11): a posted config whose
/// endpoint is an internal service reads nothing of its reply through the
/// item's error (only the status and its reason); a run of the user's own
/// still shows the endpoint's message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_posted_run_reads_no_endpoint_error_body_back() {
    let env = Env::new();
    let (internal, heads) = recorder(400, INTERNAL_REPLY).await;
    let base_url = format!("http://127.0.0.1:{internal}/v1");
    let (_server, base) = serve_with(&env, &[], &[]).await;
    let text = external_config(&env, 1, &base_url, "rpm: 600");
    let (status, body) = create(&base, None, json!({"config": text, "run_id": "probe"})).await;
    assert_eq!(status, 201, "{body}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let run = crate::serve::get(&format!("{base}/api/v1/runs/probe")).await;
        if run["counts"]["failed"] == 1 && run["state"] != "running" {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{run}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!heads.lock().unwrap().is_empty(), "the service was asked");
    let item = crate::serve::get(&format!("{base}/api/v1/runs/probe/items/item-00000")).await;
    let error = item.to_string();
    assert!(error.contains("HTTP 400: Bad Request"), "{item}");
    let openapi = crate::serve::get(&format!("{base}/api/openapi.json")).await;
    let mut urls: Vec<String> = openapi["paths"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(path, ops)| ops.get("get").is_some() && !path.contains("{name}"))
        .map(|(path, _)| {
            let path = path
                .replace("{run_id}", "probe")
                .replace("{item_id}", "item-00000");
            format!("{base}/api/v1{path}")
        })
        .collect();
    for page in [
        "/runs/probe",
        "/runs/probe/items",
        "/runs/probe/items/item-00000",
    ] {
        urls.push(format!("{base}{page}"));
    }
    assert!(urls.len() >= 10, "{urls:?}");
    let mut shown = Vec::new();
    for url in urls {
        let body = client()
            .get(&url)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        shown.push((url, body));
    }
    for (url, body) in &shown {
        assert!(
            !body.contains("internal-reply-5c1d") && !body.contains("hunter2"),
            "{url} shows the service's reply: {body}"
        );
    }

    // The user's own run tells the endpoint's message, as before.
    env.write("own.yaml", &text);
    let own = env
        .evalfleet(&["run", "own.yaml", "--run-id", "own", "-q"])
        .await;
    assert_ne!(own.code, Some(0), "{}", own.stderr);
    let exported = env.export("own").await;
    assert!(
        exported
            .iter()
            .any(|row| row.to_string().contains("internal-reply-5c1d")),
        "{exported:?}"
    );
}
