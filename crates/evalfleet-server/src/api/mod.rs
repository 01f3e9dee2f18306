//! The JSON API under `/api/v1`, and its OpenAPI document, made from the
//! handlers themselves.

pub mod benches;
pub mod items;
pub mod live;
pub mod reports;
pub mod runs;

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use serde::Serialize;
use utoipa::openapi::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::state::AppState;

/// What the server is.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ServerInfo {
    pub version: String,
    /// Whether it runs evaluations (or only reads the store).
    pub runs_evaluations: bool,
    /// The runs this process is answering now.
    pub running: Vec<String>,
}

/// The server itself.
#[utoipa::path(
    get,
    path = "/server",
    tag = "server",
    responses((status = 200, description = "The server", body = ServerInfo))
)]
async fn server(State(state): State<Arc<AppState>>) -> Json<ServerInfo> {
    Json(ServerInfo {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        runs_evaluations: state.control.is_some(),
        running: state
            .control
            .as_ref()
            .map(|c| c.running())
            .unwrap_or_default(),
    })
}

/// The API's routes, and the OpenAPI document that describes them.
pub fn router() -> (axum::Router<Arc<AppState>>, OpenApi) {
    let info = utoipa::openapi::InfoBuilder::new()
        .title("evalfleet")
        .version(env!("CARGO_PKG_VERSION"))
        .description(Some(
            "Runs started, watched, explored and compared. Every path is under /api/v1; with an API key set, send it as X-API-Key or Authorization: Bearer.",
        ))
        .license(Some(utoipa::openapi::License::new(env!("CARGO_PKG_LICENSE"))))
        .build();
    let base = utoipa::openapi::OpenApiBuilder::new().info(info).build();
    let (router, mut api) = OpenApiRouter::with_openapi(base)
        .routes(routes!(server))
        .routes(routes!(runs::list, runs::create))
        .routes(routes!(runs::get))
        .routes(routes!(runs::events))
        .routes(routes!(runs::resume))
        .routes(routes!(runs::cancel))
        .routes(routes!(runs::rescore))
        .routes(routes!(runs::fleet))
        .routes(routes!(items::items))
        .routes(routes!(items::item))
        .routes(routes!(reports::report))
        .routes(routes!(reports::compare))
        .routes(routes!(benches::list_benches))
        .routes(routes!(benches::get_bench))
        .routes(routes!(live::timeline))
        .routes(routes!(live::resources))
        .routes(routes!(live::stream))
        .split_for_parts();
    api.servers = Some(vec![utoipa::openapi::Server::new("/api/v1")]);
    document_errors(&mut api);
    document_key(&mut api);
    (router, api)
}

/// What any request may get besides its own answers, each with the JSON
/// error body: a parameter or body that does not parse (400), no key
/// (401), what this server does not do or allow (403), no such run or item
/// (404), a body too large (413) or not JSON (415), a request addressed
/// to a name that is not the server's (421), what cannot be used
/// (422), too many wrong keys from this client (429, with `Retry-After`),
/// and a failure of the store (500).
const ERRORS: [(&str, &str); 10] = [
    ("400", "A parameter or the body is wrong"),
    ("401", "An API key is required"),
    ("403", "Not allowed, or not done by this server"),
    ("404", "No such run or item"),
    ("413", "The body is too large"),
    ("415", "The body is not JSON"),
    (
        "421",
        "Not addressed to one of this server's names (its Host)",
    ),
    ("422", "What was sent cannot be used"),
    (
        "429",
        "Too many wrong keys from this address: Retry-After says when the next is looked at",
    ),
    ("500", "The store failed"),
];

/// The key, where a server has one: `X-API-Key` or a bearer token; a
/// server started without one asks for none (the empty requirement).
fn document_key(api: &mut OpenApi) {
    use utoipa::openapi::security::{
        ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme,
    };
    let components = api.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "api_key",
        SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
            "X-API-Key",
            "The server's key (EVALFLEET_API_KEY), when it was started with one",
        ))),
    );
    components.add_security_scheme(
        "bearer",
        SecurityScheme::Http(
            HttpBuilder::new()
                .scheme(HttpAuthScheme::Bearer)
                .description(Some("The server's key, as Authorization: Bearer"))
                .build(),
        ),
    );
    api.security = Some(vec![
        SecurityRequirement::new("api_key", Vec::<String>::new()),
        SecurityRequirement::new("bearer", Vec::<String>::new()),
        SecurityRequirement::default(),
    ]);
}

fn document_errors(api: &mut OpenApi) {
    use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
    for item in api.paths.paths.values_mut() {
        let operations = [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.patch,
        ];
        for operation in operations.into_iter().flatten() {
            for (code, what) in ERRORS {
                operation
                    .responses
                    .responses
                    .entry(code.to_owned())
                    .or_insert_with(|| {
                        RefOr::T(
                            ResponseBuilder::new()
                                .description(what)
                                .content(
                                    "application/json",
                                    ContentBuilder::new()
                                        .schema(Some(Ref::from_schema_name("ErrorBody")))
                                        .build(),
                                )
                                .build(),
                        )
                    });
            }
        }
    }
}
