//! The dashboard: server-rendered page shells, each filled in by a script
//! of its own from the JSON API; its assets (and the vendored uPlot) are
//! built into the binary. `report_html` makes the one self-contained page
//! `evalfleet report --html` writes.

use std::sync::Arc;

use axum::Form;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use evalfleet_reports::Report;
use serde::Deserialize;

use crate::auth;
use crate::state::AppState;

/// An asset: its path under `/assets/`, content type and bytes.
struct Asset {
    path: &'static str,
    kind: &'static str,
    bytes: &'static [u8],
}

const ASSETS: &[Asset] = &[
    Asset {
        path: "app.css",
        kind: "text/css; charset=utf-8",
        bytes: include_bytes!("../assets/app.css"),
    },
    Asset {
        path: "app.js",
        kind: "text/javascript; charset=utf-8",
        bytes: include_bytes!("../assets/app.js"),
    },
    Asset {
        path: "report.js",
        kind: "text/javascript; charset=utf-8",
        bytes: include_bytes!("../assets/report.js"),
    },
    Asset {
        path: "runs.js",
        kind: "text/javascript; charset=utf-8",
        bytes: include_bytes!("../assets/runs.js"),
    },
    Asset {
        path: "run.js",
        kind: "text/javascript; charset=utf-8",
        bytes: include_bytes!("../assets/run.js"),
    },
    Asset {
        path: "items.js",
        kind: "text/javascript; charset=utf-8",
        bytes: include_bytes!("../assets/items.js"),
    },
    Asset {
        path: "item.js",
        kind: "text/javascript; charset=utf-8",
        bytes: include_bytes!("../assets/item.js"),
    },
    Asset {
        path: "compare.js",
        kind: "text/javascript; charset=utf-8",
        bytes: include_bytes!("../assets/compare.js"),
    },
    Asset {
        path: "new.js",
        kind: "text/javascript; charset=utf-8",
        bytes: include_bytes!("../assets/new.js"),
    },
    Asset {
        path: "vendor/uplot/uPlot.iife.min.js",
        kind: "text/javascript; charset=utf-8",
        bytes: include_bytes!("../assets/vendor/uplot/uPlot.iife.min.js"),
    },
    Asset {
        path: "vendor/uplot/uPlot.min.css",
        kind: "text/css; charset=utf-8",
        bytes: include_bytes!("../assets/vendor/uplot/uPlot.min.css"),
    },
    Asset {
        path: "vendor/uplot/LICENSE",
        kind: "text/plain; charset=utf-8",
        bytes: include_bytes!("../assets/vendor/uplot/LICENSE"),
    },
];

fn asset_text(path: &str) -> &'static str {
    ASSETS
        .iter()
        .find(|a| a.path == path)
        .and_then(|a| std::str::from_utf8(a.bytes).ok())
        .unwrap_or_default()
}

/// `/assets/{path}`.
pub async fn asset(Path(path): Path<String>) -> Response {
    match ASSETS.iter().find(|a| a.path == path) {
        Some(asset) => (
            [
                (header::CONTENT_TYPE, HeaderValue::from_static(asset.kind)),
                (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
                (
                    header::X_CONTENT_TYPE_OPTIONS,
                    HeaderValue::from_static("nosniff"),
                ),
            ],
            asset.bytes,
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, "no such asset").into_response(),
    }
}

/// Text made safe for HTML.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A page: the layout, the page's data attributes and its script.
fn shell(title: &str, active: &str, data: &[(&str, &str)], script: &str) -> Response {
    let nav = [
        ("/", "Runs", "runs"),
        ("/compare", "Compare", "compare"),
        ("/new", "New run", "new"),
    ]
    .iter()
    .map(|(href, label, key)| {
        format!(
            "<a href=\"{href}\"{}>{label}</a>",
            if *key == active {
                " class=\"active\""
            } else {
                ""
            }
        )
    })
    .collect::<String>();
    let attrs = data
        .iter()
        .map(|(k, v)| format!(" data-{k}=\"{}\"", escape(v)))
        .collect::<String>();
    let page = format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{title} · evalfleet</title>\
         <link rel=\"stylesheet\" href=\"/assets/vendor/uplot/uPlot.min.css\">\
         <link rel=\"stylesheet\" href=\"/assets/app.css\"></head>\
         <body data-page=\"{active}\"{attrs}>\
         <header class=\"top\"><a class=\"brand\" href=\"/\">evalfleet</a><nav>{nav}</nav></header>\
         <main id=\"content\"></main>\
         <script src=\"/assets/vendor/uplot/uPlot.iife.min.js\"></script>\
         <script src=\"/assets/app.js\"></script>\
         <script src=\"/assets/report.js\"></script>\
         <script src=\"/assets/{script}\"></script>\
         </body></html>",
        title = escape(title),
    );
    (
        [
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(
                    "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'",
                ),
            ),
            (header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY")),
        ],
        Html(page),
    )
        .into_response()
}

pub async fn runs() -> Response {
    shell("Runs", "runs", &[], "runs.js")
}

pub async fn run(Path(run_id): Path<String>) -> Response {
    shell(&run_id, "run", &[("run", &run_id)], "run.js")
}

pub async fn items(Path(run_id): Path<String>) -> Response {
    shell(
        &format!("Results of {run_id}"),
        "items",
        &[("run", &run_id)],
        "items.js",
    )
}

pub async fn item(Path((run_id, item_id)): Path<(String, String)>) -> Response {
    shell(
        &format!("{item_id} of {run_id}"),
        "item",
        &[("run", &run_id), ("item", &item_id)],
        "item.js",
    )
}

/// `/benches/{name}`: a benchmark matrix, rendered here from its report;
/// each cell links to its run's page.
pub async fn bench(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> Result<Html<String>, crate::error::ApiError> {
    let report = crate::api::benches::report(&state, name).await?;
    Ok(Html(bench_html(&report, true)))
}

pub async fn compare() -> Response {
    shell("Compare", "compare", &[], "compare.js")
}

pub async fn new_run() -> Response {
    shell("New run", "new", &[], "new.js")
}

/// The sign-in page (a server with an API key).
pub async fn login_page() -> Html<String> {
    Html(login_html(None))
}

fn login_html(error: Option<&str>) -> String {
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Sign in · evalfleet</title>\
         <link rel=\"stylesheet\" href=\"/assets/app.css\"></head><body>\
         <header class=\"top\"><span class=\"brand\">evalfleet</span></header>\
         <main><div class=\"card\" style=\"max-width:420px\"><h1>Sign in</h1>\
         <p class=\"sub\">This server asks for its API key (EVALFLEET_API_KEY where it runs).</p>{}\
         <form method=\"post\" action=\"/login\"><input type=\"password\" name=\"key\" id=\"key\" autocomplete=\"current-password\" style=\"width:100%\">\
         <div class=\"actions\"><button class=\"primary\" type=\"submit\">Sign in</button></div></form></div></main></body></html>",
        error.map_or_else(String::new, |e| format!(
            "<div class=\"error-banner\">{}</div>",
            escape(e)
        ))
    )
}

#[derive(Debug, Deserialize)]
pub struct Login {
    key: String,
}

/// A sign-in: a right key opens a session (a random token in the cookie,
/// kept by this process until it expires) and goes to the runs. A client
/// that offered too many wrong keys waits first (429, its key not looked
/// at).
pub async fn login(
    State(state): State<Arc<AppState>>,
    extensions: axum::http::Extensions,
    Form(form): Form<Login>,
) -> Response {
    if state.key_digest.is_none() {
        return Redirect::to("/").into_response();
    }
    let now = std::time::Instant::now();
    match auth::offered(&state, auth::client_of(&extensions), &form.key, now) {
        Ok(()) => {}
        Err(crate::ApiError::TooManyTries(seconds)) => {
            let mut response = (
                StatusCode::TOO_MANY_REQUESTS,
                Html(login_html(Some(&format!(
                    "Too many wrong keys from this address: try again in {seconds} s."
                )))),
            )
                .into_response();
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
            return response;
        }
        Err(_) => {
            return (
                StatusCode::UNAUTHORIZED,
                Html(login_html(Some("That is not this server's key."))),
            )
                .into_response();
        }
    }
    let token = match state.sessions.open(now) {
        Ok(token) => token,
        Err(err) => {
            return crate::ApiError::Internal(format!("no session could be opened: {err}"))
                .into_response();
        }
    };
    let cookie = format!(
        "{}={token}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}",
        auth::COOKIE,
        crate::sessions::LIFETIME.as_secs()
    );
    let mut response = Redirect::to("/").into_response();
    if let Ok(value) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

/// One self-contained page with a run's report: the dashboard's own
/// styles and report renderer inlined, the report as data; it needs no
/// server and fetches nothing.
pub fn report_html(report: &Report) -> String {
    let data = serde_json::to_string(report)
        .unwrap_or_else(|_| "null".to_owned())
        // Inside a <script> element, "</" would end it.
        .replace("</", "<\\/");
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{title} · evalfleet report</title><style>{css}</style></head><body>\
         <header class=\"top\"><span class=\"brand\">evalfleet</span><span>report of {title}</span></header>\
         <main><h1>{name}</h1><div class=\"sub mono\">{title}</div><div class=\"card\" id=\"report\"></div></main>\
         <script type=\"application/json\" id=\"data\">{data}</script>\
         <script>{app}</script><script>{report_js}</script>\
         <script>EFReport.render(document.getElementById(\"report\"), JSON.parse(document.getElementById(\"data\").textContent));</script>\
         </body></html>",
        title = escape(&report.run_id),
        name = escape(&report.name),
        css = asset_text("app.css"),
        app = asset_text("app.js"),
        report_js = asset_text("report.js"),
    )
}

/// A bench report as one page: a table of every model on every dataset,
/// rendered here (every value escaped). With `link_runs` (the dashboard)
/// each cell links to its run's page; the page `bench report --html`
/// writes needs no server and links nowhere.
pub fn bench_html(report: &evalfleet_core::bench::BenchReport, link_runs: bool) -> String {
    let number = |value: Option<f64>, digits: usize| {
        value.map_or_else(|| "–".to_owned(), |v| format!("{v:.digits$}"))
    };
    let mut rows = String::new();
    for cell in &report.cells {
        let s = &cell.status;
        let run = if link_runs {
            format!(
                "<a href=\"/runs/{id}\">{id}</a>",
                id = escape(&s.plan.run_id)
            )
        } else {
            escape(&s.plan.run_id)
        };
        let headline = cell.headline.as_ref().map_or_else(
            || "–".to_owned(),
            |h| {
                format!(
                    "{:.3} <small>[{:.3}, {:.3}] n={}</small>",
                    h.mean, h.ci_low, h.ci_high, h.n
                )
            },
        );
        let groups: Vec<String> = cell
            .groups
            .iter()
            .map(|g| {
                format!(
                    "{}: {:.3} <small>[{:.3}, {:.3}]</small>",
                    escape(&g.group),
                    g.score.mean,
                    g.score.ci_low,
                    g.score.ci_high
                )
            })
            .collect();
        let (scored, failed) = cell.scored_and_failed();
        // A cell whose numbers are over fewer items than it has is marked.
        let mark = if cell.outcome.is_some() && !cell.is_complete() {
            " class=\"incomplete\""
        } else {
            ""
        };
        let headline = if mark.is_empty() {
            headline
        } else {
            format!("{headline} <strong>*</strong>")
        };
        rows.push_str(&format!(
            "<tr{mark}><td>{model}</td><td>{dataset}</td><td>{conc}</td><td>{state}{message}</td><td>{ended}/{total}</td><td>{scored}/{failed}</td>\
             <td>{metric}</td><td>{headline}</td><td>{groups}</td><td>{p50}</td><td>{ttft}</td><td>{tpot}</td><td>{tps}</td>\
             <td>{gpu}</td><td>{start}</td><td class=\"mono\">{run}</td></tr>",
            model = escape(&s.plan.model),
            dataset = escape(&s.plan.dataset),
            conc = s.plan.concurrency.map_or_else(|| "–".to_owned(), |n| n.to_string()),
            state = cell.standing(),
            message = s
                .message
                .iter()
                .cloned()
                .chain(
                    cell.outcome
                        .iter()
                        .filter(|o| !o.is_complete())
                        .flat_map(|o| o.cause_lines().into_iter().take(3))
                )
                .map(|m| format!("<br><small>{}</small>", escape(&m)))
                .collect::<String>(),
            ended = s.done + s.failed,
            total = s.total,
            metric = escape(cell.metric.as_deref().unwrap_or("–")),
            groups = groups.join("<br>"),
            p50 = number(cell.latency_p50_ms, 1),
            ttft = number(cell.ttft_p50_ms, 1),
            tpot = number(cell.tpot_p50_ms, 2),
            tps = number(cell.tokens_per_second, 1),
            gpu = cell
                .peak_gpu_memory_mb
                .map_or_else(|| "–".to_owned(), |m| m.to_string()),
            start = number(cell.engine_start_ms.map(|m| m as f64 / 1000.0), 2),
        ));
    }
    let handovers: String = report
        .handovers
        .iter()
        .map(|h| {
            format!(
                "<li>{} → {}: {:.3} s from the last answer to the first call, {:.3} s of it the engine's start, {:.3} s ours</li>",
                escape(&h.from),
                escape(&h.to),
                h.gap_ms as f64 / 1000.0,
                h.engine_start_ms as f64 / 1000.0,
                h.overhead_ms as f64 / 1000.0
            )
        })
        .collect();
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{name} · evalfleet bench</title><style>{css}</style></head><body>\
         <header class=\"top\"><span class=\"brand\">evalfleet</span><span>bench {name}</span></header>\
         <main><h1>{name}</h1><div class=\"sub\">{models} model(s) × {datasets} dataset(s); headline: each dataset's first metric, with its 95% interval; latency, TTFT and TPOT are medians (ms); GPU MB is the most GPU memory in use during the cell (telemetry); start is the engine's load time (s); * marks a cell that is not complete: its numbers are over fewer items than it has.</div>\
         <div class=\"card\"><table><thead><tr><th>model</th><th>dataset</th><th>concurrency</th><th>state</th><th>items</th><th>scored/failed</th><th>metric</th><th>headline</th><th>by category</th>\
         <th>latency p50</th><th>TTFT p50</th><th>TPOT p50</th><th>tokens/s</th><th>GPU MB</th><th>start</th><th>run</th></tr></thead><tbody>{rows}</tbody></table></div>\
         <ul>{handovers}</ul></main></body></html>",
        name = escape(&report.name),
        css = asset_text("app.css"),
        models = report.models.len(),
        datasets = report.datasets.len(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped_for_html() {
        assert_eq!(
            escape("<a href=\"x\">'&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
    }

    #[test]
    fn every_vendored_file_is_the_one_its_list_names() {
        use sha2::{Digest, Sha256};
        let list = include_str!("../assets/vendor/VENDORED.md");
        let mut checked = 0;
        for line in list.lines().filter(|l| l.starts_with("| uPlot")) {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let (file, sha) = (cells[5], cells[6]);
            let asset = ASSETS
                .iter()
                .find(|a| a.path == format!("vendor/{file}"))
                .unwrap_or_else(|| panic!("{file} is listed but not served"));
            let digest: [u8; 32] = Sha256::digest(asset.bytes).into();
            let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(hex, sha, "{file} is not the vendored file");
            checked += 1;
        }
        assert_eq!(checked, 3);
    }
}
