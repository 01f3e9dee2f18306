use super::stalls::{GAP_FLOOR, PEERS_PASSED};
use super::*;
use evalfleet_types::ErrorClass;

#[test]
fn tpot_follows_the_vllm_definition() {
    let timing = Timing {
        sent_at: SystemTime::now(),
        ttft: Some(Duration::from_millis(100)),
        latency: Duration::from_millis(1100),
    };
    assert_eq!(timing.tpot(Some(11)), Some(Duration::from_millis(100)));
    assert_eq!(timing.tpot(Some(1)), None);
}

/// A server on 127.0.0.1:0 that answers one request with `head` and
/// then each `(pause, text)` in turn, and closes the connection.
async fn serve_once(head: &'static str, parts: Vec<(Duration, &'static str)>) -> String {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // The test's own server: it ends with the connection.
    #[allow(clippy::disallowed_methods)]
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        read_request(&mut socket).await;
        for (pause, text) in std::iter::once((Duration::ZERO, head)).chain(parts) {
            tokio::time::sleep(pause).await;
            if socket.write_all(text.as_bytes()).await.is_err() {
                return;
            }
        }
    });
    format!("http://{addr}/v1")
}

/// What the keep-alive server does with a request it has read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    /// Answers it and keeps the connection open.
    Answer,
    /// Closes the connection without an answer (FIN), as a server
    /// whose idle timeout ends just as the request arrives.
    Close,
    /// Resets the connection without an answer (RST).
    Reset,
}

/// The requests a keep-alive server read: `(connection, request)`, each
/// counted from 0 in the order they came.
type Seen = std::sync::Arc<std::sync::Mutex<Vec<(usize, usize)>>>;

/// Reads one request (headers, then a body of Content-Length bytes) from
/// `socket`; `false` when the client closed the connection first.
async fn read_request(socket: &mut tokio::net::TcpStream) -> bool {
    read_whole_request(socket).await.is_some()
}

/// The bytes of one request read whole from `socket`; `None` when the
/// client closed the connection first.
async fn read_whole_request(socket: &mut tokio::net::TcpStream) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut request = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = socket.read(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        request.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&request);
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse::<usize>().unwrap())
                })
                .unwrap_or(0);
            if request.len() >= end + 4 + length {
                return Some(request);
            }
        }
    }
}

/// A server on 127.0.0.1:0 that keeps its connections open: it does
/// `plan(connection, request)` with each request it reads, answering
/// with a whole completion and the `extra` headers. Returns its base
/// URL and what it read.
async fn keep_alive_server(extra: &'static str, plan: fn(usize, usize) -> Then) -> (String, Seen) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Seen::default();
    let log = seen.clone();
    // The test's own server: it ends with the test's runtime.
    #[allow(clippy::disallowed_methods)]
    tokio::spawn(async move {
        let mut connection = 0;
        while let Ok((mut socket, _)) = listener.accept().await {
            let log = log.clone();
            let this = connection;
            connection += 1;
            #[allow(clippy::disallowed_methods)]
            tokio::spawn(async move {
                let mut request = 0;
                while read_request(&mut socket).await {
                    log.lock().unwrap().push((this, request));
                    match plan(this, request) {
                        Then::Answer => {
                            let body = r#"{"choices":[{"message":{"content":"ok"},"finish_reason":"stop"}]}"#;
                            let answer = format!(
                                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{extra}\r\n{body}",
                                body.len()
                            );
                            if socket.write_all(answer.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                        Then::Close => return,
                        Then::Reset => {
                            socket.set_zero_linger().unwrap();
                            return;
                        }
                    }
                    request += 1;
                }
            });
        }
    });
    (format!("http://{addr}/v1"), seen)
}

fn hi() -> Box<RawValue> {
    RawValue::from_string(r#"[{"role":"user","content":"hi"}]"#.to_owned()).unwrap()
}

#[tokio::test]
async fn a_call_on_a_connection_the_server_closed_goes_again_on_a_new_one() {
    // The second request on the first connection finds it closed (or
    // reset) by the server, as when its idle timeout ends just as the
    // request arrives. The server never read it as a request to answer:
    // it is sent again at once on a new connection, and the call
    // succeeds.
    for then in [Then::Close, Then::Reset] {
        let plan = match then {
            Then::Close => |c: usize, r: usize| {
                if (c, r) == (0, 1) {
                    Then::Close
                } else {
                    Then::Answer
                }
            },
            _ => |c: usize, r: usize| {
                if (c, r) == (0, 1) {
                    Then::Reset
                } else {
                    Then::Answer
                }
            },
        };
        let (url, seen) = keep_alive_server("", plan).await;
        let client = client(&url, false, Stalls::default());
        assert_eq!(client.complete(&hi()).await.result.unwrap().content, "ok");
        let second = client.complete(&hi()).await.result;
        assert_eq!(second.map(|c| c.content).unwrap(), "ok", "{then:?}");
        assert_eq!(*seen.lock().unwrap(), [(0, 0), (0, 1), (1, 0)], "{then:?}");
    }
}

#[tokio::test]
async fn a_connection_that_fails_on_every_try_says_why() {
    // Every connection is closed (then reset) as the request arrives:
    // the call fails after one more try on a new connection, and its
    // error names the cause, not only "error sending request".
    for (then, cause) in [
        (Then::Close, "connection closed before message completed"),
        (Then::Reset, "reset by peer"),
    ] {
        let plan = match then {
            Then::Close => |_: usize, _: usize| Then::Close,
            _ => |_: usize, _: usize| Then::Reset,
        };
        let (url, seen) = keep_alive_server("", plan).await;
        let err = complete(&url, false, Stalls::default()).await.unwrap_err();
        assert!(matches!(err, CallError::Transport(_)), "{err:?}");
        // Said once, the same in a log line as in the stored attempt.
        let text = evalfleet_types::error_text(&err);
        assert_eq!(text, err.to_string());
        assert!(
            text.starts_with("the connection failed: ") && text.contains(cause),
            "{then:?}: {text}"
        );
        assert_eq!(*seen.lock().unwrap(), [(0, 0), (1, 0)], "{then:?}");
    }
}

#[tokio::test]
async fn a_connection_is_not_reused_past_the_keep_alive_the_server_announced() {
    // The server keeps idle connections for 2 s, and says so. Calls
    // close together share a connection; a call after the connection
    // was idle for 1.2 s (more than the second's margin) goes on a new
    // one, not on one the server may be closing.
    let (url, seen) =
        keep_alive_server("keep-alive: timeout=2, max=100\r\n", |_, _| Then::Answer).await;
    let client = client(&url, false, Stalls::default());
    for _ in 0..3 {
        client.complete(&hi()).await.result.unwrap();
    }
    let (reused, _) = seen.lock().unwrap()[2];
    assert_eq!(seen.lock().unwrap()[1].0, reused, "{seen:?}");
    // The time the connection stays idle is what this test is about.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    client.complete(&hi()).await.result.unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 4);
    assert!(seen[3].0 > reused && seen[3].1 == 0, "{seen:?}");
}

const SSE: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
const JSON: &str = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n";

fn client(base_url: &str, stream: bool, stalls: Stalls) -> ChatClient {
    // The config names a dataset that exists; the client reads none.
    let dataset = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let config = serde_json::json!({
        "name": "t",
        "dataset": {"path": dataset, "format": "jsonl"},
        "endpoints": [{"name": "e", "kind": "external", "base_url": base_url, "model": "m"}],
        "task": {"messages": [{"role": "user", "content": "{{ q }}"}]},
    });
    let loaded = evalfleet_config::load_snapshot(&config, std::path::Path::new(".")).unwrap();
    ChatClient::new(&loaded.config.endpoints[0], base_url, &Map::new(), stream)
        .unwrap()
        .with_stalls(stalls)
}

async fn complete(base_url: &str, stream: bool, stalls: Stalls) -> Result<Completion, CallError> {
    let messages = RawValue::from_string(r#"[{"role":"user","content":"hi"}]"#.to_owned()).unwrap();
    client(base_url, stream, stalls)
        .complete(&messages)
        .await
        .result
}

/// Limits a stream meets within a test: 300 ms to the first token, and
/// between events.
const SHORT_STALLS: Stalls = Stalls {
    first_byte: Duration::from_millis(300),
    idle: Duration::from_millis(300),
};

/// A streamed call to `base_url` while, from 200 ms on,
/// [`PEERS_PASSED`] other streams of the endpoint end in full.
async fn complete_while_neighbours_end(
    base_url: &str,
    stalls: Stalls,
) -> Result<Completion, CallError> {
    let client = client(base_url, true, stalls);
    let messages = RawValue::from_string(r#"[{"role":"user","content":"hi"}]"#.to_owned()).unwrap();
    let call = client.complete(&messages);
    tokio::pin!(call);
    let neighbours = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        for _ in 0..PEERS_PASSED {
            client.gaps.record(Duration::from_millis(5));
        }
        std::future::pending::<()>().await;
    };
    tokio::select! {
        outcome = &mut call => outcome.result,
        () = neighbours => unreachable!(),
    }
}

fn chunk(content: &str, finish: Option<&str>) -> String {
    let finish = finish.map_or("null".to_owned(), |f| format!("\"{f}\""));
    format!(
        "data: {{\"choices\":[{{\"delta\":{{\"content\":\"{content}\"}},\"finish_reason\":{finish}}}]}}\n\n"
    )
}

fn leak(text: String) -> &'static str {
    Box::leak(text.into_boxed_str())
}

#[tokio::test]
async fn a_stream_closed_without_a_finish_reason_is_not_an_answer() {
    // As llama-cpp-python's server ends a stream it interrupts.
    let parts = vec![
        (Duration::ZERO, leak(chunk("Den", None))),
        (Duration::ZERO, leak(chunk("ver", None))),
        (Duration::ZERO, "data: [DONE]\n\n"),
    ];
    let url = serve_once(SSE, parts).await;
    let err = complete(&url, true, Stalls::default()).await.unwrap_err();
    assert!(matches!(err, CallError::Unfinished), "{err}");
    assert_eq!(err.class(), ErrorClass::BadResponse);
    // A whole body without one is not either.
    let body = r#"{"choices":[{"message":{"content":"Den"},"finish_reason":null}]}"#;
    let url = serve_once(JSON, vec![(Duration::ZERO, body)]).await;
    let err = complete(&url, false, Stalls::default()).await.unwrap_err();
    assert!(matches!(err, CallError::Unfinished), "{err}");
}

#[tokio::test]
async fn a_stream_that_never_said_done_is_truncated() {
    // The finish_reason came, then the connection closed cleanly before
    // the usage chunk and `[DONE]`.
    let parts = vec![
        (Duration::ZERO, leak(chunk("Denver", None))),
        (Duration::ZERO, leak(chunk("", Some("stop")))),
    ];
    let url = serve_once(SSE, parts).await;
    let err = complete(&url, true, Stalls::default()).await.unwrap_err();
    assert!(matches!(err, CallError::Unended), "{err}");
    assert_eq!(err.class(), ErrorClass::BadResponse);
    // The same stream with its end is an answer.
    let parts = vec![
        (Duration::ZERO, leak(chunk("Denver", None))),
        (Duration::ZERO, leak(chunk("", Some("stop")))),
        (Duration::ZERO, "data: [DONE]\n\n"),
    ];
    let url = serve_once(SSE, parts).await;
    let answer = complete(&url, true, Stalls::default()).await.unwrap();
    assert_eq!(answer.content, "Denver");
}

#[tokio::test]
async fn a_stream_without_usage_counts_its_chunks_as_estimated_tokens() {
    let parts = vec![
        (Duration::ZERO, leak(chunk("The", None))),
        (Duration::ZERO, leak(chunk(" Denver", None))),
        (Duration::ZERO, leak(chunk(" Broncos", Some("stop")))),
        (Duration::ZERO, "data: [DONE]\n\n"),
    ];
    let url = serve_once(SSE, parts).await;
    let answer = complete(&url, true, Stalls::default()).await.unwrap();
    assert_eq!(answer.content, "The Denver Broncos");
    assert_eq!(answer.finish_reason.as_deref(), Some("stop"));
    assert_eq!(
        (answer.completion_tokens, answer.tokens_estimated),
        (Some(3), true)
    );
    // With usage, the count is the server's.
    let parts = vec![
        (
            Duration::ZERO,
            leak(chunk("The Denver Broncos", Some("stop"))),
        ),
        (
            Duration::ZERO,
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":4}}\n\n",
        ),
        (Duration::ZERO, "data: [DONE]\n\n"),
    ];
    let url = serve_once(SSE, parts).await;
    let answer = complete(&url, true, Stalls::default()).await.unwrap();
    assert_eq!(
        (answer.completion_tokens, answer.tokens_estimated),
        (Some(4), false)
    );
}

#[tokio::test]
async fn a_stream_that_goes_quiet_or_never_starts_is_given_up() {
    let short = SHORT_STALLS;
    // Quiet for 10 s after its first chunk.
    let parts = vec![
        (Duration::ZERO, leak(chunk("Den", None))),
        (Duration::from_secs(10), leak(chunk("ver", Some("stop")))),
    ];
    let url = serve_once(SSE, parts).await;
    let err = complete(&url, true, short).await.unwrap_err();
    assert!(matches!(err, CallError::Stalled(_)), "{err}");
    assert_eq!(err.class(), ErrorClass::Stalled);
    // Headers, then nothing for 10 s.
    let url = serve_once(SSE, vec![(Duration::from_secs(10), "data: [DONE]\n\n")]).await;
    let err = complete(&url, true, short).await.unwrap_err();
    assert!(matches!(err, CallError::FirstByteTimeout(_)), "{err}");
    assert_eq!(err.class(), ErrorClass::FirstByteTimeout);
    // A slow but steady stream is fine: each chunk within the idle limit.
    let parts = (0..4)
        .map(|_| (Duration::from_millis(100), leak(chunk("x", None))))
        .chain([
            (Duration::from_millis(100), leak(chunk("y", Some("stop")))),
            (Duration::ZERO, "data: [DONE]\n\n"),
        ])
        .collect();
    let url = serve_once(SSE, parts).await;
    assert_eq!(complete(&url, true, short).await.unwrap().content, "xxxxy");
}

#[tokio::test]
async fn the_wait_for_the_first_token_after_a_role_chunk_is_no_stall() {
    // The role chunk comes at once, the first token later, under load;
    // meanwhile twenty others of the endpoint end. That is the time to
    // the first token, bounded by the first byte's limit: no stall.
    let patient = Stalls {
        first_byte: Duration::from_secs(30),
        idle: Duration::from_secs(30),
    };
    let role = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n";
    let parts = vec![
        (Duration::ZERO, role),
        (
            GAP_FLOOR + Duration::from_millis(500),
            leak(chunk("Denver", Some("stop"))),
        ),
        (Duration::ZERO, "data: [DONE]\n\n"),
    ];
    let url = serve_once(SSE, parts).await;
    let answer = complete_while_neighbours_end(&url, patient).await;
    assert_eq!(answer.unwrap().content, "Denver");
}

#[tokio::test]
async fn thinking_under_any_name_is_the_answer_under_way() {
    // A model that thinks for longer than the first byte's limit, in
    // `reasoning` (newer vLLM, Ollama): its tokens keep the call alive.
    let short = SHORT_STALLS;
    let thought =
        "data: {\"choices\":[{\"delta\":{\"reasoning\":\"hmm\"},\"finish_reason\":null}]}\n\n";
    let parts = (0..5)
        .map(|_| (Duration::from_millis(100), thought))
        .chain([
            (Duration::from_millis(100), leak(chunk("42", Some("stop")))),
            (Duration::ZERO, "data: [DONE]\n\n"),
        ])
        .collect();
    let url = serve_once(SSE, parts).await;
    assert_eq!(complete(&url, true, short).await.unwrap().content, "42");
}

#[tokio::test]
async fn a_stream_quiet_while_its_neighbours_are_answered_in_full_has_stalled() {
    // No normal gap is known yet and the idle limit is long; but while
    // this stream sends nothing, twenty others of the endpoint end.
    let patient = Stalls {
        first_byte: Duration::from_secs(30),
        idle: Duration::from_secs(30),
    };
    let parts = vec![
        (Duration::ZERO, leak(chunk("Den", None))),
        (Duration::from_secs(10), leak(chunk("ver", Some("stop")))),
    ];
    let url = serve_once(SSE, parts).await;
    let err = complete_while_neighbours_end(&url, patient)
        .await
        .unwrap_err();
    assert!(matches!(err, CallError::Stalled(_)), "{err}");
}

/// A server on 127.0.0.1:0 that reads one request whole, answers it
/// with a completion, and sends what it read (head and body) back to the
/// test.
async fn capture_one() -> (String, tokio::sync::oneshot::Receiver<String>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    // The test's own server: it ends with the connection.
    #[allow(clippy::disallowed_methods)]
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let request = read_whole_request(&mut socket)
            .await
            .expect("the client closed before its request was whole");
        let body = r#"{"choices":[{"message":{"content":"ok"},"finish_reason":"stop"}]}"#;
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        socket.write_all(answer.as_bytes()).await.unwrap();
        let _ = tx.send(String::from_utf8(request).unwrap());
    });
    (format!("http://{addr}/v1"), rx)
}

#[tokio::test]
async fn a_plain_http_endpoint_is_called_directly_with_every_header_of_the_endpoint() {
    let (url, request) = capture_one().await;
    let dataset = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let config = serde_json::json!({
        "name": "t",
        "dataset": {"path": dataset, "format": "jsonl"},
        "endpoints": [{"name": "e", "kind": "external", "base_url": url, "model": "m",
                       "api_key": "sk-test", "headers": {"X-Team": "evals"}}],
        "task": {"messages": [{"role": "user", "content": "{{ q }}"}]},
    });
    let loaded = evalfleet_config::load_snapshot(&config, std::path::Path::new(".")).unwrap();
    let client = ChatClient::new(&loaded.config.endpoints[0], &url, &Map::new(), false).unwrap();
    // (Where the environment names a proxy, reqwest takes it there.)
    assert_eq!(
        client.http.is_direct(),
        !super::http::env_proxy(),
        "http:// with no proxy goes on hyper's client"
    );
    let outcome = client.complete(&hi()).await;
    assert_eq!(outcome.result.unwrap().content, "ok");
    let request = request.await.unwrap();
    let (head, body) = request.split_once("\r\n\r\n").unwrap();
    let mut lines = head.lines();
    // Origin-form, as servers expect from a client that is not a proxy.
    assert_eq!(
        lines.next(),
        Some("POST /v1/chat/completions HTTP/1.1"),
        "{head}"
    );
    let headers: Vec<String> = lines.map(str::to_ascii_lowercase).collect();
    let port = url.trim_start_matches("http://").trim_end_matches("/v1");
    for expected in [
        format!("host: {port}"),
        "content-type: application/json".to_owned(),
        "authorization: bearer sk-test".to_owned(),
        "x-team: evals".to_owned(),
        "accept: */*".to_owned(),
        format!("content-length: {}", body.len()),
    ] {
        assert!(headers.contains(&expected), "{expected} not in {headers:?}");
    }
    assert_eq!(
        body,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":false}"#
    );
}

#[tokio::test]
async fn tls_and_userinfo_go_through_reqwest_and_a_refused_connection_names_its_address() {
    let tls = client("https://127.0.0.1:9/v1", false, Stalls::default());
    assert!(!tls.http.is_direct());
    let basic = client(
        "http://user:secret@127.0.0.1:9/v1",
        false,
        Stalls::default(),
    );
    assert!(
        !basic.http.is_direct(),
        "reqwest sends the URL's user as Basic auth"
    );
    if super::http::env_proxy() {
        // A proxy would answer for the port below.
        return;
    }
    // A port nothing listens on: no connection, the address and the
    // cause said (the key in a query left out).
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let url = format!("http://127.0.0.1:{port}/v1");
    let err = complete(&url, false, Stalls::default()).await.unwrap_err();
    let CallError::Connect(unanswered) = &err else {
        panic!("{err:?}");
    };
    assert_eq!(
        unanswered.url().map(shown_url).as_deref(),
        Some(format!("{url}/chat/completions").as_str())
    );
    let text = err.to_string();
    assert!(
        text.starts_with("cannot connect: ") && text.contains("refused"),
        "{text}"
    );
    assert_eq!(err.class(), ErrorClass::Retryable);
}
