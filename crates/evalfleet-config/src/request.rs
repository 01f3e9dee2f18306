//! What a request carries as a config writes it: chat messages, whose
//! contents are templates checked before the run starts, and generation
//! parameters, which may not set what evalfleet sets itself.

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::problems::Problems;
use super::{MessageTemplate, Part, path};

/// Body fields evalfleet sets itself; `params` may not override them.
const RESERVED_PARAMS: [&str; 4] = ["model", "messages", "stream", "stream_options"];
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// A chat message.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`. Required.
    pub role: Option<String>,
    /// A minijinja template over the item's fields (`{{ question }}`),
    /// checked before the run starts; or a list of parts, each `text: TEMPLATE`
    /// or `image: TEMPLATE` (see `task.images`), sent in their order as
    /// OpenAI content parts. Required.
    #[schemars(with = "Option<super::images::ContentShape>")]
    pub content: Option<Value>,
    /// A template giving the message's images (one value, or a lone
    /// expression giving a list: `"{{ pages }}"`), placed before or after
    /// the text of `content` (`images_at`): the shorthand of a content of
    /// two parts. Default: none.
    pub images: Option<String>,
    /// Where `images` go: `before` or `after` the text. Default `before`.
    pub images_at: Option<String>,
}

pub(super) fn params(
    raw: Option<Map<String, Value>>,
    at: &str,
    p: &mut Problems<'_>,
) -> Option<Map<String, Value>> {
    let raw = raw.unwrap_or_default();
    let mut ok = true;
    for key in RESERVED_PARAMS {
        if raw.contains_key(key) {
            ok = p
                .push::<()>(
                    &path::key(at, key),
                    "is set by evalfleet and cannot be given in params",
                )
                .is_some();
        }
    }
    ok.then_some(raw)
}

/// A list of chat messages, each a template checked here (`at`: where the
/// list is).
pub(super) fn message_list(
    list: Vec<RawMessage>,
    at: &str,
    p: &mut Problems<'_>,
) -> Option<Vec<MessageTemplate>> {
    if list.is_empty() {
        return p.push(at, "must hold at least one message");
    }
    let mut out = Vec::with_capacity(list.len());
    let mut ok = true;
    let checker = evalfleet_jinja::environment();
    for (i, message) in list.into_iter().enumerate() {
        let at = path::index(at, i);
        let role = match message.role {
            Some(role) if ROLES.contains(&role.as_str()) => Some(role),
            Some(role) => p.push(
                &path::key(&at, "role"),
                format!("must be one of {}, got '{role}'", ROLES.join(", ")),
            ),
            None => p.push(&path::key(&at, "role"), "is required"),
        };
        let content = match message.content {
            Some(content) => super::images::parts(
                content,
                message.images,
                message.images_at.as_deref(),
                &at,
                p,
            )
            .and_then(|(content, parts)| {
                let mut good = true;
                if parts.is_empty()
                    && let Err(err) = evalfleet_jinja::check(&checker, &content)
                {
                    good = p.push::<()>(&path::key(&at, "content"), err).is_some();
                }
                for (j, part) in parts.iter().enumerate() {
                    let (Part::Text(t) | Part::Image(t)) = part;
                    if let Err(err) = evalfleet_jinja::check(&checker, t) {
                        let part_at = path::index(&path::key(&at, "content"), j);
                        good = p.push::<()>(&part_at, err).is_some();
                    }
                }
                good.then_some((content, parts))
            }),
            None => p.push(&path::key(&at, "content"), "is required"),
        };
        match (role, content) {
            (Some(role), Some((content, parts))) => out.push(MessageTemplate {
                role,
                content,
                parts,
            }),
            _ => ok = false,
        }
    }
    ok.then_some(out)
}
