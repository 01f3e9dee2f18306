//! The Sheets stand-in seen from a client over a real socket: the token
//! exchange with keys made by openssl and JWTs signed with ring, reads,
//! writes, failures, the records, and Google's own Python client.

#![cfg(feature = "server")]
// Test helpers fail loudly; that is their job.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::sync::OnceLock;

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use evalfleet_mock::sheets::{StandIn, Trusted};
use serde_json::{Value, json};

const EMAIL: &str = "runner@standin-test.iam.gserviceaccount.com";
const SCOPE: &str = "https://www.googleapis.com/auth/spreadsheets";

/// Two RSA keys (PKCS#8 PEM) made by the openssl CLI: the trusted one and
/// another. `None` (after a skip) when openssl is absent.
fn keys() -> Option<&'static (String, String)> {
    static KEYS: OnceLock<Option<(String, String)>> = OnceLock::new();
    let keys = KEYS.get_or_init(|| Some((openssl_key()?, openssl_key()?)));
    if keys.is_none() {
        evalfleet_testkit::skip!("the openssl CLI is absent (.ci/run installs it)");
    }
    keys.as_ref()
}

fn openssl_key() -> Option<String> {
    let pem = openssl(&[
        "genpkey",
        "-algorithm",
        "RSA",
        "-pkeyopt",
        "rsa_keygen_bits:2048",
    ])?;
    Some(String::from_utf8(pem).unwrap())
}

/// What the openssl CLI writes on stdout, or `None` when it cannot start.
fn openssl(args: &[&str]) -> Option<Vec<u8>> {
    let out = std::process::Command::new("openssl")
        .args(args)
        .output()
        .ok()?;
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(out.stdout)
}

/// A service-account key file's JSON around `pem`, its token_uri at `base`.
fn key_json(pem: &str, base: &str) -> String {
    json!({
        "type": "service_account",
        "project_id": "standin-test",
        "private_key_id": "0123456789abcdef",
        "private_key": pem,
        "client_email": EMAIL,
        "client_id": "100000000000000000001",
        "auth_uri": "https://accounts.google.com/o/oauth2/auth",
        "token_uri": format!("{base}/token"),
    })
    .to_string()
}

fn der(pem: &str) -> Vec<u8> {
    let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    STANDARD.decode(body).unwrap()
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// A JWT with `claims`, signed RS256 with `pem` by ring.
fn jwt(pem: &str, claims: &Value) -> String {
    let header = json!({"alg": "RS256", "typ": "JWT", "kid": "0123456789abcdef"});
    jwt_with(pem, &header, claims)
}

/// The same with `header`, whatever it says.
fn jwt_with(pem: &str, header: &Value, claims: &Value) -> String {
    let signed = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(header.to_string()),
        URL_SAFE_NO_PAD.encode(claims.to_string())
    );
    let pair = ring::signature::RsaKeyPair::from_pkcs8(&der(pem)).unwrap();
    let mut sig = vec![0; pair.public().modulus_len()];
    pair.sign(
        &ring::signature::RSA_PKCS1_SHA256,
        &ring::rand::SystemRandom::new(),
        signed.as_bytes(),
        &mut sig,
    )
    .unwrap();
    format!("{signed}.{}", URL_SAFE_NO_PAD.encode(sig))
}

fn claims(base: &str) -> Value {
    let now = now();
    json!({"iss": EMAIL, "scope": SCOPE, "aud": format!("{base}/token"), "iat": now, "exp": now + 3600})
}

/// A client for plain HTTP (reqwest wants a TLS provider all the same).
fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

/// A stand-in serving on 127.0.0.1:0, trusting the first key, with its
/// base URL; it stops when the test's runtime does.
struct Running {
    standin: StandIn,
    base: String,
    http: reqwest::Client,
}

async fn start() -> Option<Running> {
    let (pem, _) = keys()?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let standin = StandIn::new(Trusted::from_key_json(&key_json(pem, &base)).unwrap());
    // Ends with the test's runtime.
    #[allow(clippy::disallowed_methods)]
    tokio::spawn(standin.clone().serve(listener));
    Some(Running {
        standin,
        base,
        http: client(),
    })
}

/// Sends `request`: its status and its body as JSON (a body that is not
/// JSON comes back as a string).
async fn answer(request: reqwest::RequestBuilder) -> (u16, Value) {
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let bytes = response.bytes().await.unwrap();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, body)
}

impl Running {
    async fn token_request(&self, assertion: &str) -> (u16, Value) {
        let body = format!(
            "grant_type=urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Ajwt-bearer&assertion={assertion}"
        );
        answer(
            self.http
                .post(format!("{}/token", self.base))
                .header("content-type", "application/x-www-form-urlencoded")
                .body(body),
        )
        .await
    }

    /// A token for the trusted key.
    async fn token(&self) -> String {
        let (pem, _) = keys().unwrap();
        let (status, body) = self.token_request(&jwt(pem, &claims(&self.base))).await;
        assert_eq!(status, 200, "{body}");
        body["access_token"].as_str().unwrap().to_owned()
    }

    async fn get(&self, token: &str, id: &str, range: &str, query: &str) -> (u16, Value) {
        let range: String = range
            .bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() {
                    char::from(b).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect();
        answer(
            self.http
                .get(format!(
                    "{}/v4/spreadsheets/{id}/values/{range}?{query}",
                    self.base
                ))
                .bearer_auth(token),
        )
        .await
    }

    async fn batch(&self, token: &str, id: &str, body: &Value) -> (u16, Value) {
        self.batch_raw(token, id, body.to_string()).await
    }

    async fn batch_raw(&self, token: &str, id: &str, body: String) -> (u16, Value) {
        answer(
            self.http
                .post(format!(
                    "{}/v4/spreadsheets/{id}/values:batchUpdate",
                    self.base
                ))
                .bearer_auth(token)
                .header("content-type", "application/json")
                .body(body),
        )
        .await
    }
}

fn raw(range: &str, values: Value) -> Value {
    json!({"valueInputOption": "RAW", "data": [{"range": range, "majorDimension": "ROWS", "values": values}]})
}

fn dataset(standin: &StandIn) {
    standin.put_tab(
        "sheet-1",
        "Data",
        vec![
            vec![json!("id"), json!("question"), json!("answer")],
            vec![json!(1), json!("2+2?"), json!(4)],
            vec![json!(2), json!("half?"), json!(0.5)],
            vec![json!(3), json!(""), json!(true)],
        ],
    );
    standin.put_tab(
        "sheet-1",
        "My Tab",
        vec![vec![json!("a"), json!("b"), json!("c"), json!("d")]],
    );
}

#[tokio::test]
async fn the_public_key_is_derived_from_the_key_file_as_openssl_derives_it() {
    let Some((pem, _)) = keys() else { return };
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key.pem");
    std::fs::write(&key, pem).unwrap();
    let public = openssl(&[
        "rsa",
        "-in",
        key.to_str().unwrap(),
        "-RSAPublicKey_out",
        "-outform",
        "DER",
    ])
    .unwrap();
    let trusted = Trusted::from_key_json(&key_json(pem, "http://x")).unwrap();
    assert_eq!(trusted.client_email, EMAIL);
    assert_eq!(trusted.public_key_der, public);

    for (bad, why) in [
        ("{", "not JSON"),
        (r#"{"type":"authorized_user"}"#, "service_account"),
        (
            r#"{"type":"service_account","client_email":"a@b"}"#,
            "private_key",
        ),
        (
            r#"{"type":"service_account","client_email":"a@b","private_key":"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"}"#,
            "PKCS#8",
        ),
    ] {
        let err = Trusted::from_key_json(bad).unwrap_err();
        assert!(err.contains(why), "{bad}: {err}");
    }
}

#[tokio::test]
async fn a_jwt_signed_by_the_trusted_key_gets_a_token_and_others_are_refused() {
    let Some(run) = start().await else { return };
    let (pem, other) = keys().unwrap();
    let (status, body) = run.token_request(&jwt(pem, &claims(&run.base))).await;
    assert_eq!(status, 200, "{body}");
    assert!(body["access_token"].as_str().unwrap().len() > 20);
    assert_eq!(body["expires_in"], 3599);
    assert_eq!(body["token_type"], "Bearer");

    let good = claims(&run.base);
    let with = |key: &str, value: Value| {
        let mut c = good.clone();
        c[key] = value;
        c
    };
    let t = now();
    let refused = [
        (jwt(other, &good), "Signature"),
        (
            jwt(
                pem,
                &with("iss", json!("someone@else.iam.gserviceaccount.com")),
            ),
            "iss",
        ),
        (
            jwt(
                pem,
                &with("exp", json!(t - 10))
                    .as_object()
                    .cloned()
                    .map(|mut c| {
                        c.insert("iat".into(), json!(t - 3610));
                        Value::Object(c)
                    })
                    .unwrap(),
            ),
            "short-lived",
        ),
        (
            jwt(
                pem,
                &with("scope", json!("https://www.googleapis.com/auth/drive")),
            ),
            "scope",
        ),
        (
            jwt(pem, &with("aud", json!("https://oauth2.example.com/token"))),
            "aud",
        ),
        (
            jwt(pem, &with("aud", json!(format!("{}/other", run.base)))),
            "aud",
        ),
        (jwt(pem, &with("iat", json!(t + 600))), "short-lived"),
        (jwt(pem, &with("exp", json!(t + 7200))), "short-lived"),
        (
            jwt_with(pem, &json!({"alg": "HS256", "typ": "JWT"}), &good),
            "RS256",
        ),
        (jwt_with(pem, &json!({"alg": "none"}), &good), "RS256"),
        ("not-a-jwt".to_owned(), "three"),
        ("a.b.c".to_owned(), "base64url"),
    ];
    for (assertion, why) in &refused {
        let (status, body) = run.token_request(assertion).await;
        assert_eq!(status, 400, "{why}: {body}");
        assert_eq!(body["error"], "invalid_grant", "{why}: {body}");
        assert!(
            body["error_description"].as_str().unwrap().contains(why),
            "{why}: {body}"
        );
    }
    // Google's own address is an audience too: google-auth always sends it.
    let google = jwt(
        pem,
        &with("aud", json!("https://oauth2.googleapis.com/token")),
    );
    assert_eq!(run.token_request(&google).await.0, 200);
    let (status, body) = run.token_request("").await;
    assert_eq!(
        (status, body["error"].as_str()),
        (400, Some("invalid_request"))
    );
    assert_eq!(run.standin.tokens_issued(), 2);
    let reasons = run.standin.token_refusals();
    assert_eq!(reasons.len(), refused.len() + 1, "{reasons:?}");
    assert!(reasons[0].contains("Signature"), "{reasons:?}");
}

#[tokio::test]
async fn reads_render_values_formatted_or_not_over_ranges_of_every_shape() {
    let Some(run) = start().await else { return };
    dataset(&run.standin);
    let token = run.token().await;
    let (status, body) = run.get(&token, "sheet-1", "Data!A1:F", "").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({"range": "Data!A1:F1000", "majorDimension": "ROWS", "values": [
            ["id", "question", "answer"], ["1", "2+2?", "4"], ["2", "half?", "0.5"], ["3", "", "TRUE"]]})
    );
    let (_, body) = run
        .get(
            &token,
            "sheet-1",
            "Data!A2:C100",
            "valueRenderOption=UNFORMATTED_VALUE&majorDimension=ROWS",
        )
        .await;
    assert_eq!(
        body,
        json!({"range": "Data!A2:C100", "majorDimension": "ROWS", "values": [
            [1, "2+2?", 4], [2, "half?", 0.5], [3, "", true]]})
    );
    let (_, body) = run.get(&token, "sheet-1", "Data", "").await;
    assert_eq!(body["range"], "Data!A1:Z1000");
    assert_eq!(body["values"].as_array().unwrap().len(), 4);
    let (_, body) = run.get(&token, "sheet-1", "'My Tab'!B:C", "").await;
    assert_eq!(
        body,
        json!({"range": "'My Tab'!B1:C1000", "majorDimension": "ROWS", "values": [["b", "c"]]})
    );
    let (_, body) = run
        .get(
            &token,
            "sheet-1",
            "Data!C3",
            "valueRenderOption=UNFORMATTED_VALUE",
        )
        .await;
    assert_eq!(
        body,
        json!({"range": "Data!C3", "majorDimension": "ROWS", "values": [[0.5]]})
    );
    // Empty cells: no `values` at all, as Google answers.
    let (_, body) = run.get(&token, "sheet-1", "Data!E5", "").await;
    assert_eq!(body, json!({"range": "Data!E5", "majorDimension": "ROWS"}));
    let (_, body) = run
        .get(&token, "sheet-1", "Data!A1:B2", "majorDimension=COLUMNS")
        .await;
    assert_eq!(body["values"], json!([["id", "1"], ["question", "2+2?"]]));
    // A column whose first cells are empty: they read as "".
    run.standin.put_tab(
        "sheet-1",
        "Ragged",
        vec![vec![json!("a")], vec![json!("b"), json!("c")]],
    );
    let (_, body) = run
        .get(&token, "sheet-1", "Ragged!A1:B2", "majorDimension=COLUMNS")
        .await;
    assert_eq!(body["values"], json!([["a", "b"], ["", "c"]]));
    let (_, body) = run
        .get(&token, "sheet-1", "Data!B3:B4", "majorDimension=COLUMNS")
        .await;
    assert_eq!(body["values"], json!([["half?"]]));
    let (_, body) = run
        .get(&token, "sheet-1", "Data!B4:C4", "majorDimension=COLUMNS")
        .await;
    assert_eq!(body["values"], json!([[], ["TRUE"]]));
    // A bare range is on the first tab.
    let (_, body) = run.get(&token, "sheet-1", "B2", "").await;
    assert_eq!(body["range"], "Data!B2");

    for (range, status, message) in [
        ("Nope!A1", 400, "Unable to parse range"),
        ("Data!A0", 400, "Unable to parse range"),
        ("Data!A1:B1001", 400, "exceeds grid limits"),
        ("Data!!", 400, "Unable to parse range"),
    ] {
        let (got, body) = run.get(&token, "sheet-1", range, "").await;
        assert_eq!(got, status, "{range}: {body}");
        assert_eq!(body["error"]["status"], "INVALID_ARGUMENT");
        assert!(
            body["error"]["message"].as_str().unwrap().contains(message),
            "{body}"
        );
    }
    let (status, body) = run.get(&token, "no-such-sheet", "Data!A1", "").await;
    assert_eq!(
        (status, &body["error"]["status"]),
        (404, &json!("NOT_FOUND"))
    );
    let (status, _) = run
        .get(&token, "sheet-1", "Data", "valueRenderOption=PRETTY")
        .await;
    assert_eq!(status, 400);
    let (status, _) = run.get(&token, "sheet-1", "Data", "colour=blue").await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn writes_store_values_as_given_leave_nulls_alone_and_clear_empties() {
    let Some(run) = start().await else { return };
    dataset(&run.standin);
    let token = run.token().await;
    let body = json!({"valueInputOption": "RAW", "data": [
        {"range": "Data!D1:E1", "majorDimension": "ROWS", "values": [["score", "note"]]},
        {"range": "Data!B2:D2", "values": [[null, "", 0.5]]},
        {"range": "'My Tab'!A2", "values": [["=1+1", 7]]},
    ]});
    let (status, answer) = run.batch(&token, "sheet-1", &body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["spreadsheetId"], "sheet-1");
    assert_eq!(answer["totalUpdatedCells"], 6);
    assert_eq!(answer["totalUpdatedSheets"], 2);
    assert_eq!(answer["responses"][0]["updatedRange"], "Data!D1:E1");
    assert_eq!(answer["responses"][1]["updatedRange"], "Data!B2:D2");
    assert_eq!(answer["responses"][1]["updatedCells"], 2);
    assert_eq!(answer["responses"][2]["updatedRange"], "'My Tab'!A2:B2");
    assert_eq!(
        run.standin.tab("sheet-1", "Data"),
        vec![
            vec![
                json!("id"),
                json!("question"),
                json!("answer"),
                json!("score"),
                json!("note")
            ],
            vec![json!(1), json!("2+2?"), json!(""), json!(0.5)],
            vec![json!(2), json!("half?"), json!(0.5)],
            vec![json!(3), json!(""), json!(true)],
        ]
    );
    // RAW keeps a formula's text; USER_ENTERED reads typed numbers.
    assert_eq!(
        run.standin.tab("sheet-1", "My Tab")[1],
        vec![json!("=1+1"), json!(7)]
    );
    let typed = json!({"valueInputOption": "USER_ENTERED", "data": [{"range": "Data!F1", "values": [["2.5"]]}]});
    assert_eq!(run.batch(&token, "sheet-1", &typed).await.0, 200);
    assert_eq!(run.standin.tab("sheet-1", "Data")[0][5], json!(2.5));
    // Columns-major writes go down.
    let down = json!({"valueInputOption": "RAW", "data": [{"range": "Data!G1:G3", "majorDimension": "COLUMNS", "values": [["x", "y"]]}]});
    assert_eq!(run.batch(&token, "sheet-1", &down).await.0, 200);
    let (_, read) = run.get(&token, "sheet-1", "Data!G1:G3", "").await;
    assert_eq!(read["values"], json!([["x"], ["y"]]));

    let writes = run.standin.writes();
    assert_eq!(writes.len(), 3);
    assert_eq!(
        (
            writes[0].status,
            writes[0].ranges.clone(),
            writes[0].rows,
            writes[0].cells
        ),
        (
            200,
            vec![
                "Data!D1:E1".to_owned(),
                "Data!B2:D2".to_owned(),
                "'My Tab'!A2".to_owned()
            ],
            3,
            6
        )
    );
    assert!(writes[0].at_ms <= writes[2].at_ms);
}

#[tokio::test]
async fn a_batch_with_one_bad_range_changes_nothing() {
    let Some(run) = start().await else { return };
    dataset(&run.standin);
    let token = run.token().await;
    let before = run.standin.tab("sheet-1", "Data");
    for bad in [
        json!({"range": "Nope!A1", "values": [[1]]}),
        json!({"range": "Data!A1:B1", "values": [[1, 2, 3]]}),
        json!({"range": "Data!A1:A1", "values": [[1], [2]]}),
        json!({"range": "Data!Z1", "values": [[1, 2]]}),
        json!({"range": "Data!A1", "values": [[{"nested": true}]]}),
        json!({"range": "Data!A1", "majorDimension": "DIAGONAL", "values": [[1]]}),
        json!({"range": "Data!A1", "values": [[1]], "colour": "blue"}),
    ] {
        let body = json!({"valueInputOption": "RAW", "data": [
            {"range": "Data!A1", "values": [["changed"]]}, bad.clone()]});
        let (status, answer) = run.batch(&token, "sheet-1", &body).await;
        assert_eq!(status, 400, "{bad}: {answer}");
        assert_eq!(answer["error"]["status"], "INVALID_ARGUMENT", "{answer}");
        assert_eq!(run.standin.tab("sheet-1", "Data"), before, "{bad}");
    }
    let no_option = json!({"data": [{"range": "Data!A1", "values": [["changed"]]}]});
    assert_eq!(run.batch(&token, "sheet-1", &no_option).await.0, 400);
    assert_eq!(
        run.batch(&token, "nope", &raw("Data!A1", json!([[1]])))
            .await
            .0,
        404
    );
    assert!(run.standin.cell_writes().is_empty());
}

#[tokio::test]
async fn requests_without_a_live_token_get_401() {
    let Some(run) = start().await else { return };
    dataset(&run.standin);
    let (status, body) = run.get("", "sheet-1", "Data", "").await;
    assert_eq!(
        (status, &body["error"]["status"]),
        (401, &json!("UNAUTHENTICATED"))
    );
    let (status, _) = run.get("ya29.made-up", "sheet-1", "Data", "").await;
    assert_eq!(status, 401);
    let token = run.token().await;
    assert_eq!(run.get(&token, "sheet-1", "Data", "").await.0, 200);
    run.standin.expire_tokens();
    assert_eq!(run.get(&token, "sheet-1", "Data", "").await.0, 401);
    let (status, _) = run
        .batch(&token, "sheet-1", &raw("Data!A1", json!([[1]])))
        .await;
    assert_eq!(status, 401);
    assert_eq!(run.standin.writes()[0].status, 401);
    assert!(run.standin.cell_writes().is_empty());
    let token = run.token().await;
    assert_eq!(run.get(&token, "sheet-1", "Data", "").await.0, 200);
}

#[tokio::test]
async fn a_read_only_token_reads_but_may_not_write() {
    let Some(run) = start().await else { return };
    dataset(&run.standin);
    let (pem, _) = keys().unwrap();
    let mut read_only = claims(&run.base);
    read_only["scope"] = json!(format!("{SCOPE}.readonly"));
    let (status, body) = run.token_request(&jwt(pem, &read_only)).await;
    assert_eq!(status, 200, "{body}");
    let token = body["access_token"].as_str().unwrap();
    assert_eq!(run.get(token, "sheet-1", "Data", "").await.0, 200);
    let (status, body) = run
        .batch(token, "sheet-1", &raw("Data!A1", json!([[1]])))
        .await;
    assert_eq!(
        (status, &body["error"]["status"]),
        (403, &json!("PERMISSION_DENIED"))
    );
    assert!(run.standin.cell_writes().is_empty());
    let mut other = claims(&run.base);
    other["scope"] = json!("https://www.googleapis.com/auth/drive");
    let (status, body) = run.token_request(&jwt(pem, &other)).await;
    assert_eq!(status, 400, "{body}");
}

#[tokio::test]
async fn injected_failures_answer_in_order_then_always_then_stop() {
    let Some(run) = start().await else { return };
    dataset(&run.standin);
    let token = run.token().await;
    run.standin.fail_next(&[429, 503, 500]);
    let write = raw("Data!E2", json!([[1]]));
    let mut seen = Vec::new();
    for _ in 0..4 {
        let (status, body) = run.batch(&token, "sheet-1", &write).await;
        seen.push((status, body["error"]["status"].as_str().map(str::to_owned)));
    }
    assert_eq!(
        seen,
        vec![
            (429, Some("RESOURCE_EXHAUSTED".to_owned())),
            (503, Some("UNAVAILABLE".to_owned())),
            (500, Some("INTERNAL".to_owned())),
            (200, None),
        ]
    );
    run.standin.fail_always(Some(403));
    for _ in 0..2 {
        let (status, body) = run.batch(&token, "sheet-1", &write).await;
        assert_eq!(
            (status, &body["error"]["status"]),
            (403, &json!("PERMISSION_DENIED"))
        );
    }
    run.standin.fail_always(None);
    assert_eq!(run.batch(&token, "sheet-1", &write).await.0, 200);
    let statuses: Vec<u16> = run.standin.writes().iter().map(|w| w.status).collect();
    assert_eq!(statuses, [429, 503, 500, 200, 403, 403, 200]);
    // Only the two that succeeded wrote the cell.
    assert_eq!(
        run.standin.cell_writes(),
        [(("Data".to_owned(), 2, 5), 2)].into()
    );
    // Reads are never failed.
    assert_eq!(run.get(&token, "sheet-1", "Data", "").await.0, 200);

    // Every third write call from now on fails (the benchmark's process
    // sets this from --fail-every).
    run.standin.fail_every(3, 503);
    let mut statuses = Vec::new();
    for _ in 0..6 {
        statuses.push(run.batch(&token, "sheet-1", &write).await.0);
    }
    assert_eq!(statuses, [200, 200, 503, 200, 200, 503]);
    run.standin.fail_every(0, 503);
    assert_eq!(run.batch(&token, "sheet-1", &write).await.0, 200);
}

#[tokio::test]
async fn an_accounts_writes_past_its_quota_get_429_until_the_window_moves_on() {
    let Some(run) = start().await else { return };
    dataset(&run.standin);
    // Two tokens of one account: the quota is the account's, not a token's.
    let (first, second) = (run.token().await, run.token().await);
    let window = std::time::Duration::from_millis(400);
    run.standin.write_quota(Some((3, window)));
    let write = raw("Data!E2", json!([[1]]));
    let mut seen = Vec::new();
    for token in [&first, &second, &first, &second, &first] {
        seen.push(run.batch(token, "sheet-1", &write).await);
    }
    let statuses: Vec<u16> = seen.iter().map(|(status, _)| *status).collect();
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    assert_eq!(seen[3].1["error"]["status"], "RESOURCE_EXHAUSTED");
    assert!(
        seen[3].1["error"]["message"]
            .as_str()
            .unwrap()
            .contains("'Write requests per minute per user'"),
        "{}",
        seen[3].1
    );
    // Refused calls applied nothing, and did not count against the quota.
    assert_eq!(
        run.standin.cell_writes(),
        [(("Data".to_owned(), 2, 5), 3)].into()
    );
    tokio::time::sleep(window).await;
    assert_eq!(run.batch(&second, "sheet-1", &write).await.0, 200);
    run.standin.write_quota(None);
    for _ in 0..5 {
        assert_eq!(run.batch(&first, "sheet-1", &write).await.0, 200);
    }
}

#[tokio::test]
async fn cell_writes_count_each_cell_of_each_successful_write() {
    let Some(run) = start().await else { return };
    dataset(&run.standin);
    let token = run.token().await;
    let twice = json!({"valueInputOption": "RAW", "data": [
        {"range": "Data!D2:E2", "values": [[1, null]]},
        {"range": "Data!D2:D3", "values": [[2], [""]]},
    ]});
    assert_eq!(run.batch(&token, "sheet-1", &twice).await.0, 200);
    let counts = run.standin.cell_writes();
    assert_eq!(
        counts,
        [
            (("Data".to_owned(), 2, 4), 2),
            (("Data".to_owned(), 3, 4), 1)
        ]
        .into()
    );
    let (status, stats) = answer(run.http.get(format!("{}/_standin/stats", run.base))).await;
    assert_eq!(status, 200);
    assert_eq!(stats["cell_writes_total"], 3);
    assert_eq!(stats["cells_written_twice"], 1);
    assert_eq!(stats["tokens_issued"], 1);
    assert_eq!(
        stats["writes"][0]["ranges"],
        json!(["Data!D2:E2", "Data!D2:D3"])
    );
}

#[tokio::test]
async fn hostile_requests_get_errors_and_the_stand_in_keeps_serving() {
    let Some(run) = start().await else { return };
    dataset(&run.standin);
    let token = run.token().await;
    for body in [
        "",
        "{",
        "[]",
        "null",
        r#"{"valueInputOption":"RAW","data":"x"}"#,
        "\u{0}\u{ff}",
    ] {
        let (status, answer) = run.batch_raw(&token, "sheet-1", body.to_owned()).await;
        assert_eq!(status, 400, "{body:?}: {answer}");
    }
    let huge = format!(
        r#"{{"valueInputOption":"RAW","data":[],"x":"{}"}}"#,
        "a".repeat(11 << 20)
    );
    let (status, _) = run.batch_raw(&token, "sheet-1", huge).await;
    assert_eq!(status, 413);
    for path in [
        "/v4/spreadsheets/",
        "/v4/spreadsheets/sheet-1/values",
        "/v4/spreadsheets/sheet-1/values/%ZZ",
        "/v4/spreadsheets/sheet-1/values/Data/extra",
        "/v4/spreadsheets/sheet-1/values:batchClear",
        "/v3/anything",
    ] {
        let response = run
            .http
            .get(format!("{}{path}", run.base))
            .bearer_auth(&token)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 404, "{path}");
    }
    for range in [
        "'",
        "''",
        "Data!A1:B2:C3",
        "Data!ZZZZ1",
        "Data!A4294967296",
        "💥!A1",
    ] {
        let (status, _) = run.get(&token, "sheet-1", range, "").await;
        assert_eq!(status, 400, "{range}");
    }
    assert_eq!(run.get(&token, "sheet-1", "Data!A1", "").await.0, 200);
}

#[tokio::test]
async fn only_the_assertion_and_bearer_tokens_travel_never_the_private_key() {
    let Some(run) = start().await else { return };
    dataset(&run.standin);
    let token = run.token().await;
    run.get(&token, "sheet-1", "Data", "").await;
    let seen = run.standin.seen_text();
    assert!(seen.contains(&format!("Bearer {token}")), "{seen}");
    assert!(seen.contains("assertion="), "{seen}");
    let (pem, _) = keys().unwrap();
    let key_base64: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    assert!(!seen.contains("PRIVATE KEY"));
    assert!(!seen.contains(&key_base64[..64]));
}

/// A Python whose google.auth and requests import, or `None` after a skip.
fn gauth_python() -> Option<String> {
    let var = "EVALFLEET_GAUTH_PYTHON";
    let candidates = std::env::var(var)
        .ok()
        .into_iter()
        .chain(["python3".to_owned()]);
    for python in candidates {
        let imports = std::process::Command::new(&python)
            .args([
                "-c",
                "import google.auth, google.oauth2.service_account, requests",
            ])
            .status()
            .is_ok_and(|s| s.success());
        if imports {
            return Some(python);
        }
    }
    evalfleet_testkit::skip!(
        "no Python with google-auth and requests (set {var}; .ci/run makes one)"
    );
    None
}

#[tokio::test]
async fn googles_python_client_gets_a_token_reads_and_writes() {
    let Some(run) = start().await else { return };
    let Some(python) = gauth_python() else { return };
    dataset(&run.standin);
    let (pem, _) = keys().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("key.json");
    std::fs::write(&key_file, key_json(pem, &run.base)).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sheets_gauth.py");
    let out = tokio::process::Command::new(&python)
        .arg(&script)
        .arg(&key_file)
        .arg(&run.base)
        .arg("sheet-1")
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}\nrefusals: {:?}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        run.standin.token_refusals()
    );
    let seen: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(seen["read_status"], 200, "{seen}");
    assert_eq!(seen["read"]["range"], "Data!A1:C1000");
    assert_eq!(seen["read"]["values"][2], json!([2, "half?", 0.5]));
    assert_eq!(seen["write_status"], 200, "{seen}");
    assert_eq!(seen["write"]["responses"][0]["updatedRange"], "Data!D2:D3");
    assert_eq!(seen["token_valid"], true);
    assert_eq!(run.standin.tokens_issued(), 1);
    assert!(run.standin.token_refusals().is_empty());
    let tab = run.standin.tab("sheet-1", "Data");
    assert_eq!((&tab[1][3], &tab[2][3]), (&json!(0.75), &json!("done")));
}
