//! OpenAI request parsing and validation, and the JSON errors the server answers with.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use mlxcel_models::{AdapterMix, Message, Sampling};

use crate::grammar::Grammar;
use serde_json::{json, Map, Value};

/// An error answered as OpenAI's `{"error": {...}}` JSON.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 naming the request field `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: Some(param.into()),
            code: None,
        }
    }

    /// An error with no request field to name.
    pub fn other(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body().to_string();
        (
            self.status,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response()
    }
}

/// What a request asks the model for.
#[derive(Debug, Clone)]
pub(crate) enum Input {
    Chat(Vec<Message>),
    Text(String),
}

/// A validated request of either endpoint.
#[derive(Debug, Clone)]
pub(crate) struct Request {
    pub input: Input,
    pub max_tokens: Option<usize>,
    /// The field `max_tokens` came from (`max_tokens` or `max_completion_tokens`).
    pub max_field: &'static str,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// The `model` field, when given.
    pub model: Option<String>,
    /// The `adapter` extension field: an adapter name, or `{name: weight, ...}` for a blend.
    pub adapter: Option<AdapterMix>,
    /// Per-token log-probabilities with this many alternatives (`logprobs`/`top_logprobs`).
    pub logprobs: Option<usize>,
    /// Declared tools (`tools`), as given: `{"type": "function", "function": {...}}`.
    pub tools: Vec<Value>,
    pub tool_choice: ToolChoice,
    /// `response_format` `json_object` / `json_schema`: the grammar the output must follow.
    pub json: Option<Grammar>,
    /// The chat's images (`image_url` content parts of the last user message), in order.
    pub images: Vec<ImagePart>,
}

/// An image of a chat message (an `image_url` content part with a base64 `data:` URL): its
/// encoded bytes, not decoded yet (the server decodes them off the async threads).
#[derive(Debug, Clone)]
pub(crate) struct ImagePart {
    /// The request field it came from (`messages[i].content[j].image_url.url`).
    pub field: String,
    /// The encoded image (PNG, JPEG or WebP).
    pub bytes: Vec<u8>,
}

/// Largest encoded image (bytes after base64 decoding) a request may carry: 413 past it.
pub(crate) const MAX_IMAGE_BYTES: usize = 20 << 20;
/// Largest image (width · height) a request may carry: 413 past it.
pub(crate) const MAX_IMAGE_PIXELS: usize = 40_000_000;

impl ApiError {
    /// A 413 naming the request field `param`.
    pub fn too_large(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            kind: "invalid_request_error",
            message: message.into(),
            param: Some(param.into()),
            code: Some("image_too_large"),
        }
    }
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ToolChoice {
    /// Never call (the tools are still declared to the model).
    None,
    /// The model decides (the default with tools).
    Auto,
    /// At least one call.
    Required,
    /// A call of this function.
    Named(String),
}

impl Request {
    /// The declared tools' names.
    pub fn tool_names(&self) -> Vec<String> {
        self.tools
            .iter()
            .filter_map(|t| t["function"]["name"].as_str().map(str::to_string))
            .collect()
    }
}

/// Fields both endpoints implement.
const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "min_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "user",
    "stream",
    "stream_options",
    "repetition_penalty",
    "adapter",
];

/// OpenAI fields the server does not implement: refused unless absent, null or neutral.
const UNSUPPORTED: &[&str] = &[
    "functions",
    "function_call",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "audio",
    "modalities",
    "prediction",
    "reasoning_effort",
    "service_tier",
    "store",
    "metadata",
    "web_search_options",
    "echo",
    "suffix",
    "best_of",
];

/// A value that asks for nothing (`null`, `false`, `0`, `1` for `best_of`, empty, text format).
fn neutral(field: &str, v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::Number(n) => {
            n.as_f64() == Some(0.0) || (field == "best_of" && n.as_f64() == Some(1.0))
        }
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => {
            o.is_empty()
                || (field == "response_format"
                    && o.len() == 1
                    && o.get("type").and_then(Value::as_str) == Some("text"))
        }
        Value::String(s) => field == "tool_choice" && s == "none",
        _ => false,
    }
}

/// Parses a request body of `/v1/chat/completions` (`chat`) or `/v1/completions`.
/// The request body as a JSON object, or the 400 every endpoint gives for one that is not.
fn json_object(body: &[u8]) -> Result<serde_json::Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::other(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!("the request body is not valid JSON: {e}"),
        )
    })?;
    let Value::Object(obj) = value else {
        return Err(ApiError::other(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "the request body must be a JSON object",
        ));
    };
    Ok(obj)
}

/// Refuses the first field of `obj` that `known` does not list, naming it.
fn refuse_unknown_fields(
    obj: &serde_json::Map<String, Value>,
    known: &[&str],
) -> Result<(), ApiError> {
    match obj.keys().find(|key| !known.contains(&key.as_str())) {
        Some(key) => Err(ApiError::invalid(
            key.as_str(),
            format!("unknown field `{key}`"),
        )),
        None => Ok(()),
    }
}

pub(crate) fn parse(body: &[u8], chat: bool) -> Result<Request, ApiError> {
    let obj = json_object(body)?;
    let own: &[&str] = if chat {
        &[
            "messages",
            "max_completion_tokens",
            "logprobs",
            "top_logprobs",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "response_format",
        ]
    } else {
        &["prompt", "logprobs", "response_format"]
    };
    for (key, v) in &obj {
        if COMMON.contains(&key.as_str()) || own.contains(&key.as_str()) {
            continue;
        }
        if UNSUPPORTED.contains(&key.as_str()) {
            if neutral(key, v) {
                continue;
            }
            return Err(ApiError::invalid(
                key.as_str(),
                format!("`{key}` is not supported by this server"),
            ));
        }
        return Err(ApiError::invalid(
            key.as_str(),
            format!("Unrecognized request argument supplied: {key}"),
        ));
    }
    let field = |name: &str| obj.get(name).filter(|v| !v.is_null());

    let (input, images) = if chat {
        let (messages, images) = messages(field("messages"))?;
        (Input::Chat(messages), images)
    } else {
        (Input::Text(prompt(field("prompt"))?), Vec::new())
    };
    if let Some(v) = field("model") {
        if !v.is_string() {
            return Err(ApiError::invalid("model", "`model` must be a string"));
        }
    }
    let model = field("model").and_then(Value::as_str).map(str::to_string);
    let adapter = match field("adapter") {
        None => None,
        Some(Value::String(name)) => Some(AdapterMix::single(name.as_str())),
        Some(Value::Object(blend)) => {
            let mut entries = Vec::with_capacity(blend.len());
            for (name, w) in blend {
                match w.as_f64().filter(|w| w.is_finite()) {
                    Some(w) => entries.push((name.clone(), w as f32)),
                    None => {
                        return Err(ApiError::invalid(
                            "adapter",
                            format!("`adapter`: the weight of `{name}` must be a number, not {w}"),
                        ))
                    }
                }
            }
            Some(AdapterMix { entries })
        }
        Some(v) => {
            return Err(ApiError::invalid(
                "adapter",
                format!(
                    "`adapter` must be an adapter name or an object of weights by name, not {v}"
                ),
            ))
        }
    };
    if let Some(v) = field("user") {
        if !v.is_string() {
            return Err(ApiError::invalid("user", "`user` must be a string"));
        }
    }
    if let Some(v) = field("n") {
        if v.as_u64() != Some(1) {
            return Err(ApiError::invalid(
                "n",
                format!("`n` must be 1 (one choice per request), not {v}"),
            ));
        }
    }
    let max_name = if chat && field("max_completion_tokens").is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let max_tokens = match field(max_name) {
        None => None,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            _ => {
                return Err(ApiError::invalid(
                    max_name,
                    format!("`{max_name}` must be a positive integer, not {v}"),
                ))
            }
        },
    };

    let mut sampling = Sampling::default();
    if let Some(t) = number(
        field("temperature"),
        "temperature",
        |x| (0.0..=2.0).contains(&x),
        "between 0 and 2",
    )? {
        sampling.temperature = t;
    }
    if let Some(p) = number(
        field("top_p"),
        "top_p",
        |x| x > 0.0 && x <= 1.0,
        "in (0, 1]",
    )? {
        sampling.top_p = p;
    }
    if let Some(p) = number(
        field("min_p"),
        "min_p",
        |x| (0.0..=1.0).contains(&x),
        "between 0 and 1",
    )? {
        sampling.min_p = p;
    }
    if let Some(p) = number(
        field("repetition_penalty"),
        "repetition_penalty",
        |x| x > 0.0,
        "positive",
    )? {
        sampling.repetition_penalty = p;
    }
    if let Some(v) = field("top_k") {
        sampling.top_k = match v.as_i64() {
            // -1 (llama.cpp, vLLM) and 0 both mean no top-k cut.
            Some(-1) => 0,
            Some(k) if k >= 0 => usize::try_from(k).unwrap_or(usize::MAX),
            _ => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("`top_k` must be a non-negative integer, not {v}"),
                ))
            }
        };
    }
    if let Some(v) = field("seed") {
        sampling.seed = match (v.as_u64(), v.as_i64()) {
            (Some(s), _) => s,
            (None, Some(s)) => s as u64,
            _ => {
                return Err(ApiError::invalid(
                    "seed",
                    format!("`seed` must be an integer, not {v}"),
                ))
            }
        };
    }

    let stop = match field("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            let mut stop = Vec::new();
            for (i, item) in items.iter().enumerate() {
                match item.as_str() {
                    Some(s) => stop.push(s.to_string()),
                    None => {
                        return Err(ApiError::invalid(
                            format!("stop[{i}]"),
                            "`stop` must be a string or a list of strings",
                        ))
                    }
                }
            }
            stop
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "`stop` must be a string or a list of strings",
            ))
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "stop strings must not be empty"));
    }

    let stream = match field("stream") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(ApiError::invalid(
                "stream",
                format!("`stream` must be a boolean, not {v}"),
            ))
        }
    };
    let include_usage = match field("stream_options") {
        None => false,
        Some(Value::Object(o)) => {
            for key in o.keys() {
                if key != "include_usage" {
                    return Err(ApiError::invalid(
                        format!("stream_options.{key}"),
                        format!("Unrecognized request argument supplied: stream_options.{key}"),
                    ));
                }
            }
            match o.get("include_usage") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ApiError::invalid(
                        "stream_options.include_usage",
                        "`stream_options.include_usage` must be a boolean",
                    ))
                }
            }
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stream_options",
                "`stream_options` must be an object",
            ))
        }
    };

    let logprobs = if chat {
        chat_logprobs(field("logprobs"), field("top_logprobs"))?
    } else {
        match field("logprobs") {
            None => None,
            Some(v) => match v.as_u64() {
                Some(n) if n <= 5 => Some(n as usize),
                _ => {
                    return Err(ApiError::invalid(
                        "logprobs",
                        format!("`logprobs` must be an integer from 0 to 5, not {v}"),
                    ))
                }
            },
        }
    };

    let (tools, tool_choice) = if chat {
        tools(field("tools"), field("tool_choice"))?
    } else {
        (Vec::new(), ToolChoice::None)
    };
    if let Some(v) = field("parallel_tool_calls") {
        if !v.is_boolean() {
            return Err(ApiError::invalid(
                "parallel_tool_calls",
                "`parallel_tool_calls` must be a boolean",
            ));
        }
    }

    let json = response_format(field("response_format"))?;
    if json.is_some() && matches!(tool_choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(ApiError::invalid(
            "response_format",
            "`response_format` and a `tool_choice` that forces a call cannot both shape the output",
        ));
    }

    Ok(Request {
        json,
        tools,
        tool_choice,
        logprobs,
        input,
        max_tokens,
        max_field: max_name,
        sampling,
        stop,
        stream,
        include_usage,
        model,
        adapter,
        images,
    })
}

/// `tools` (function declarations with a name and, optionally, a description and a JSON-schema
/// object of parameters) and `tool_choice`.
fn tools(
    tools: Option<&Value>,
    choice: Option<&Value>,
) -> Result<(Vec<Value>, ToolChoice), ApiError> {
    let list = match tools {
        None => Vec::new(),
        Some(Value::Array(items)) => items.clone(),
        Some(_) => return Err(ApiError::invalid("tools", "`tools` must be a list")),
    };
    let mut names = Vec::new();
    for (i, tool) in list.iter().enumerate() {
        let at = |f: &str| format!("tools[{i}]{f}");
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid(
                at(".type"),
                "only tools of type `function` are supported",
            ));
        }
        let Some(function) = tool.get("function").and_then(Value::as_object) else {
            return Err(ApiError::invalid(
                at(".function"),
                "a tool needs a `function` object",
            ));
        };
        let name = match function.get("name").and_then(Value::as_str) {
            Some(n)
                if !n.is_empty()
                    && n.len() <= 64
                    && n.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') =>
            {
                n
            }
            _ => {
                return Err(ApiError::invalid(
                    at(".function.name"),
                    "a function name must be 1 to 64 letters, digits, `_` or `-`",
                ))
            }
        };
        if names.contains(&name) {
            return Err(ApiError::invalid(
                at(".function.name"),
                format!("the function `{name}` is declared twice"),
            ));
        }
        names.push(name);
        for (key, v) in function {
            match key.as_str() {
                "name" => {}
                "description" if v.is_string() || v.is_null() => {}
                "parameters" if v.is_object() || v.is_null() => {}
                "strict" if v.is_boolean() || v.is_null() => {}
                "description" | "parameters" | "strict" => {
                    return Err(ApiError::invalid(
                        at(&format!(".function.{key}")),
                        format!("`{key}` has the wrong type"),
                    ))
                }
                _ => {
                    return Err(ApiError::invalid(
                        at(&format!(".function.{key}")),
                        format!("Unrecognized tool field: {key}"),
                    ))
                }
            }
        }
    }
    let choice = match choice {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice` must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ))
            }
        },
        Some(v) => match v["function"]["name"].as_str() {
            Some(n) if v["type"] == "function" => ToolChoice::Named(n.to_string()),
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice` must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ))
            }
        },
    };
    if list.is_empty() && matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` asks for a call but no `tools` are declared",
        ));
    }
    if let ToolChoice::Named(n) = &choice {
        if !names.contains(&n.as_str()) {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("`tool_choice` names `{n}`, which is not among the declared `tools`"),
            ));
        }
    }
    Ok((list, choice))
}

/// `response_format`: `{"type": "text"}`, `{"type": "json_object"}` or
/// `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`.
fn response_format(v: Option<&Value>) -> Result<Option<Grammar>, ApiError> {
    let Some(v) = v else { return Ok(None) };
    let Some(obj) = v.as_object() else {
        return Err(ApiError::invalid(
            "response_format",
            "`response_format` must be an object",
        ));
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::any_object())),
        Some("json_schema") => {
            let Some(spec) = obj.get("json_schema").and_then(Value::as_object) else {
                return Err(ApiError::invalid(
                    "response_format.json_schema",
                    "`json_schema` must be an object with a `schema`",
                ));
            };
            for key in spec.keys() {
                if !matches!(key.as_str(), "name" | "schema" | "strict" | "description") {
                    return Err(ApiError::invalid(
                        format!("response_format.json_schema.{key}"),
                        format!("Unrecognized argument: response_format.json_schema.{key}"),
                    ));
                }
            }
            let schema = spec
                .get("schema")
                .cloned()
                .unwrap_or(json!({"type": "object"}));
            Grammar::compile(&schema).map(Some).map_err(|e| {
                ApiError::invalid(
                    format!("response_format.json_schema.schema{}", e.path),
                    format!(
                        "response_format.json_schema.schema{}: {}",
                        e.path, e.message
                    ),
                )
            })
        }
        _ => Err(ApiError::invalid(
            "response_format.type",
            "`response_format.type` must be text, json_object or json_schema",
        )),
    }
}

/// Chat's `logprobs` (a boolean) and `top_logprobs` (0 to 20, only with `logprobs`).
fn chat_logprobs(logprobs: Option<&Value>, top: Option<&Value>) -> Result<Option<usize>, ApiError> {
    let on = match logprobs {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("`logprobs` must be a boolean, not {v}"),
            ))
        }
    };
    let top = match top {
        None => 0,
        Some(v) => match v.as_u64() {
            Some(n) if n <= 20 => n as usize,
            _ => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("`top_logprobs` must be an integer from 0 to 20, not {v}"),
                ))
            }
        },
    };
    if top > 0 && !on {
        return Err(ApiError::invalid(
            "top_logprobs",
            "`top_logprobs` needs `logprobs` set to true",
        ));
    }
    Ok(on.then_some(top))
}

/// A finite number accepted by `ok` (`what` says the range in the error).
fn number(
    v: Option<&Value>,
    name: &str,
    ok: impl Fn(f64) -> bool,
    what: &str,
) -> Result<Option<f32>, ApiError> {
    let Some(v) = v else { return Ok(None) };
    match v.as_f64() {
        Some(x) if x.is_finite() && ok(x) => Ok(Some(x as f32)),
        _ => Err(ApiError::invalid(
            name,
            format!("`{name}` must be a number {what}, not {v}"),
        )),
    }
}

/// The chat's messages and their images (which must all be in the last user message: the
/// model sees a conversation's images at the start of its last user message, see
/// `mlxcel_models::Generation::images`).
fn messages(v: Option<&Value>) -> Result<(Vec<Message>, Vec<ImagePart>), ApiError> {
    let Some(v) = v else {
        return Err(ApiError::invalid("messages", "`messages` is required"));
    };
    let Some(items) = v.as_array().filter(|a| !a.is_empty()) else {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must be a non-empty list of messages",
        ));
    };
    let mut out = Vec::with_capacity(items.len());
    let mut images = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let Some(m) = item.as_object() else {
            return Err(ApiError::invalid(
                format!("messages[{i}]"),
                "a message must be an object",
            ));
        };
        let (message, own) = message(i, m)?;
        out.push(message);
        images.push(own);
    }
    let last_user = out.iter().rposition(|m| m.role == "user");
    for (i, own) in images.iter().enumerate() {
        if let (Some(image), true) = (own.first(), Some(i) != last_user) {
            return Err(ApiError::invalid(
                image.field.clone(),
                format!(
                    "images are supported only in the last user message (messages[{}]): the \
                     model sees a conversation's images at the start of that message",
                    last_user.unwrap_or(i)
                ),
            ));
        }
    }
    Ok((out, images.into_iter().flatten().collect()))
}

/// The encoded bytes of an image given as a base64 `data:` URL (`field` names it in errors).
/// Other URLs are refused: the server never fetches a URL or reads a file for a request.
fn data_url(field: &str, url: &str) -> Result<Vec<u8>, ApiError> {
    let invalid = |message: String| ApiError::invalid(field, message);
    let scheme = url.split_once(':').map(|(s, _)| s.to_ascii_lowercase());
    if scheme.as_deref() != Some("data") {
        let shown: String = url.chars().take(40).collect();
        return Err(invalid(format!(
            "`{field}` must be a base64 `data:` URL (data:image/png;base64,...), not `{shown}`: \
             this server never fetches http(s) URLs or reads files"
        )));
    }
    let Some((meta, data)) = url[5..].split_once(',') else {
        return Err(invalid(format!(
            "`{field}`: a `data:` URL needs a `,` before its data"
        )));
    };
    let mut params = meta.split(';');
    let media = params
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    if !media.is_empty() && !media.starts_with("image/") {
        return Err(invalid(format!(
            "`{field}`: the data URL's media type `{media}` is not an image type"
        )));
    }
    if !params.any(|p| p.trim().eq_ignore_ascii_case("base64")) {
        return Err(invalid(format!(
            "`{field}`: only base64 data URLs are supported (data:image/png;base64,...)"
        )));
    }
    // Base64 takes 4 characters per 3 bytes: refuse a too large image before decoding it.
    if data.len() / 4 * 3 > MAX_IMAGE_BYTES {
        return Err(ApiError::too_large(
            field,
            format!(
                "`{field}`: the image is larger than the {} MiB an image may have",
                MAX_IMAGE_BYTES >> 20
            ),
        ));
    }
    let bytes = base64_decode(data).map_err(|e| invalid(format!("`{field}`: {e}")))?;
    if bytes.is_empty() {
        return Err(invalid(format!("`{field}`: the image data is empty")));
    }
    Ok(bytes)
}

/// Decodes base64 (the standard or URL-safe alphabet, padding optional; ASCII whitespace, as
/// line-wrapped data holds, is skipped).
pub(crate) fn base64_decode(text: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let (mut acc, mut bits, mut padding) = (0u32, 0u32, 0usize);
    for (at, c) in text.bytes().enumerate() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            b'=' => {
                padding += 1;
                continue;
            }
            c if c.is_ascii_whitespace() => continue,
            _ => return Err(format!("invalid base64: unexpected byte {c:#04x} at {at}")),
        };
        if padding > 0 {
            return Err(format!("invalid base64: data after padding at {at}"));
        }
        acc = acc << 6 | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    // A lone 6-bit group cannot end the data, nor padding beyond the 3 characters' worth.
    if bits == 6 || padding > 2 || acc != 0 {
        return Err("invalid base64: the data is truncated or its last character is wrong".into());
    }
    Ok(out)
}

fn message(i: usize, m: &Map<String, Value>) -> Result<(Message, Vec<ImagePart>), ApiError> {
    for (key, v) in m {
        match key.as_str() {
            "role" | "content" | "name" | "tool_call_id" | "tool_calls" => {}
            "function_call" | "audio" | "refusal" if neutral(key, v) => {}
            _ => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].{key}"),
                    format!("`messages[{i}].{key}` is not supported by this server"),
                ))
            }
        }
    }
    let role = match m.get("role").and_then(Value::as_str) {
        Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
        Some("developer") => "system",
        _ => {
            return Err(ApiError::invalid(
                format!("messages[{i}].role"),
                "`role` must be one of system, developer, user, assistant, tool",
            ))
        }
    };
    let mut images = Vec::new();
    let content = match m.get("content") {
        None | Some(Value::Null) if role == "assistant" => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                let ty = part.get("type").and_then(Value::as_str);
                match (ty, part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => texts.push(t),
                    (Some("text"), None) => {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].content[{j}].text"),
                            "a text part needs a string `text`",
                        ))
                    }
                    (Some("image_url"), _) => images.push(image_part(i, j, role, part)?),
                    _ => {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].content[{j}].type"),
                            "only content parts of type `text` and `image_url` are supported",
                        ))
                    }
                }
            }
            texts.join("\n")
        }
        _ => {
            return Err(ApiError::invalid(
                format!("messages[{i}].content"),
                "`content` must be a string or a list of text and image_url parts",
            ))
        }
    };
    let mut message = Message::new(role, &content);
    let text = |key: &str| -> Result<Option<String>, ApiError> {
        match m.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(ApiError::invalid(
                format!("messages[{i}].{key}"),
                format!("`{key}` must be a string"),
            )),
        }
    };
    message.name = text("name")?;
    message.tool_call_id = text("tool_call_id")?;
    match m.get("tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Array(calls)) if role == "assistant" => {
            for (j, call) in calls.iter().enumerate() {
                message.tool_calls.push(history_call(call).ok_or_else(|| {
                    ApiError::invalid(
                        format!("messages[{i}].tool_calls[{j}]"),
                        "a tool call must be {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\": a JSON object as text}}",
                    )
                })?);
            }
        }
        Some(_) => {
            return Err(ApiError::invalid(
                format!("messages[{i}].tool_calls"),
                "`tool_calls` must be a list, on assistant messages",
            ))
        }
    }
    Ok((message, images))
}

/// Content part `j` of message `i`, of type `image_url`: `{"type": "image_url", "image_url":
/// {"url": "data:image/png;base64,...", "detail": ...}}` (`detail` is ignored), or with the URL
/// as `image_url` itself, as some clients send it.
fn image_part(i: usize, j: usize, role: &str, part: &Value) -> Result<ImagePart, ApiError> {
    let at = format!("messages[{i}].content[{j}]");
    if role != "user" {
        return Err(ApiError::invalid(
            format!("{at}.type"),
            format!("images are accepted only in user messages, not in a {role} message"),
        ));
    }
    let (field, url) = match part.get("image_url") {
        Some(Value::String(url)) => (format!("{at}.image_url"), url),
        Some(Value::Object(o)) => {
            if let Some(key) = o.keys().find(|k| !matches!(k.as_str(), "url" | "detail")) {
                return Err(ApiError::invalid(
                    format!("{at}.image_url.{key}"),
                    format!("`{at}.image_url.{key}` is not supported by this server"),
                ));
            }
            match o.get("url") {
                Some(Value::String(url)) => (format!("{at}.image_url.url"), url),
                _ => {
                    return Err(ApiError::invalid(
                        format!("{at}.image_url.url"),
                        "an image part needs a string `url` (data:image/png;base64,...)",
                    ))
                }
            }
        }
        _ => {
            return Err(ApiError::invalid(
                format!("{at}.image_url"),
                "an image part needs `image_url`: {\"url\": \"data:image/png;base64,...\"}",
            ))
        }
    };
    let bytes = data_url(&field, url)?;
    Ok(ImagePart { field, bytes })
}

/// An assistant's earlier tool call, with its `arguments` text parsed into the JSON object
/// chat templates expect.
fn history_call(call: &Value) -> Option<Value> {
    let function = call.get("function")?.as_object()?;
    let name = function.get("name")?.as_str()?;
    let arguments = match function.get("arguments") {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s)
            .ok()
            .filter(Value::is_object)?,
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return None,
    };
    if call.get("type").is_some_and(|t| t != "function") {
        return None;
    }
    let mut out = json!({
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    });
    if let Some(id) = call.get("id").and_then(Value::as_str) {
        out["id"] = json!(id);
    }
    Some(out)
}

fn prompt(v: Option<&Value>) -> Result<String, ApiError> {
    match v {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].as_str().is_some_and(|s| !s.is_empty()) => {
            Ok(a[0].as_str().unwrap_or_default().to_string())
        }
        Some(Value::Array(a)) if a.len() > 1 => Err(ApiError::invalid(
            "prompt",
            "only one prompt per request is supported",
        )),
        None => Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(_) => Err(ApiError::invalid(
            "prompt",
            "`prompt` must be a non-empty string",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(body: &str, chat: bool) -> Option<String> {
        parse(body.as_bytes(), chat).err().and_then(|e| e.param)
    }

    #[test]
    fn refusals_name_the_field() {
        let m = r#""messages":[{"role":"user","content":"hi"}]"#;
        assert_eq!(
            param(&format!("{{{m},\"n\":2}}"), true).as_deref(),
            Some("n")
        );
        assert_eq!(
            param(
                &format!("{{{m},\"tools\":[{{\"type\":\"function\"}}]}}"),
                true
            )
            .as_deref(),
            Some("tools[0].function")
        );
        assert_eq!(
            param(&format!("{{{m},\"temperature\":-1}}"), true).as_deref(),
            Some("temperature")
        );
        assert_eq!(
            param(
                &format!("{{{m},\"response_format\":{{\"type\":\"json_schema\",\"json_schema\":{{\"schema\":{{\"type\":\"string\",\"pattern\":\"x\"}}}}}}}}"),
                true
            )
            .as_deref(),
            Some("response_format.json_schema.schema/pattern")
        );
        assert_eq!(
            param(&format!("{{{m},\"bogus\":1}}"), true).as_deref(),
            Some("bogus")
        );
        assert_eq!(
            param(r#"{"messages":[]}"#, true).as_deref(),
            Some("messages")
        );
        assert_eq!(
            param(
                r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
                true
            )
            .as_deref(),
            Some("messages[0].content[0].image_url")
        );
        assert_eq!(
            param(
                r#"{"messages":[{"role":"user","content":[{"type":"input_audio"}]}]}"#,
                true
            )
            .as_deref(),
            Some("messages[0].content[0].type")
        );
        assert_eq!(
            param(r#"{"prompt":"a","stop":[1]}"#, false).as_deref(),
            Some("stop[0]")
        );
        assert!(parse(b"{not json", true).is_err());
        assert!(parse(b"[]", true).is_err());
    }

    fn image_request(messages: Value) -> Result<Request, ApiError> {
        parse(json!({"messages": messages}).to_string().as_bytes(), true)
    }

    #[test]
    fn image_url_parts() {
        let png = "data:image/png;base64,iVBORw0KGgo=";
        let r = image_request(json!([{"role": "user", "content": [
            {"type": "text", "text": "what is it?"},
            {"type": "image_url", "image_url": {"url": png, "detail": "low"}},
            {"type": "image_url", "image_url": png},
        ]}]))
        .map_err(|e| e.message)
        .unwrap();
        assert_eq!(r.images.len(), 2);
        assert_eq!(r.images[0].field, "messages[0].content[1].image_url.url");
        assert_eq!(r.images[1].field, "messages[0].content[2].image_url");
        assert_eq!(r.images[0].bytes, b"\x89PNG\r\n\x1a\n");
        match r.input {
            Input::Chat(m) => assert_eq!(m[0].content, "what is it?"),
            Input::Text(_) => panic!("chat expected"),
        }
        let refused = |messages: Value| {
            let e = image_request(messages).unwrap_err();
            (e.status.as_u16(), e.param.unwrap_or_default(), e.message)
        };
        let part = |url: &str| json!({"type": "image_url", "image_url": {"url": url}});
        for url in [
            "https://example.com/cat.png",
            "file:///etc/passwd",
            "/etc/passwd",
        ] {
            let (status, param, message) =
                refused(json!([{"role": "user", "content": [part(url)]}]));
            assert_eq!(
                (status, param.as_str()),
                (400, "messages[0].content[0].image_url.url")
            );
            assert!(message.contains("never fetches"), "{message}");
        }
        let (status, param, _) = refused(json!([{"role": "user", "content": [
            {"type": "text", "text": "x"}, part("data:image/png;base64,iVBO!!Kgo=")]}]));
        assert_eq!(
            (status, param.as_str()),
            (400, "messages[0].content[1].image_url.url")
        );
        let (status, _, message) =
            refused(json!([{"role": "user", "content": [part("data:image/png,rawbytes")]}]));
        assert!(status == 400 && message.contains("base64"), "{message}");
        let (status, _, _) =
            refused(json!([{"role": "user", "content": [part("data:text/plain;base64,aGk=")]}]));
        assert_eq!(status, 400);
        // Not in other roles, not before the last user message.
        let (status, param, message) = refused(json!([
            {"role": "system", "content": [part(png)]},
            {"role": "user", "content": "hi"},
        ]));
        assert_eq!(
            (status, param.as_str()),
            (400, "messages[0].content[0].type")
        );
        assert!(message.contains("user messages"), "{message}");
        let (status, param, message) = refused(json!([
            {"role": "user", "content": [part(png)]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "and now?"},
        ]));
        assert_eq!(
            (status, param.as_str()),
            (400, "messages[0].content[0].image_url.url")
        );
        assert!(
            message.contains("last user message (messages[2])"),
            "{message}"
        );
        let (_, param, _) = refused(json!([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png, "bogus": 1}}]}]));
        assert_eq!(param, "messages[0].content[0].image_url.bogus");
        // Too large: refused before decoding.
        let big = format!(
            "data:image/png;base64,{}",
            "A".repeat(MAX_IMAGE_BYTES / 3 * 4 + 8)
        );
        let (status, param, _) = refused(json!([{"role": "user", "content": [part(&big)]}]));
        assert_eq!(
            (status, param.as_str()),
            (413, "messages[0].content[0].image_url.url")
        );
    }

    #[test]
    fn base64_decodes_what_base64_encodes() {
        for plain in [
            &b""[..],
            b"f",
            b"fo",
            b"foo",
            b"foob",
            b"fooba",
            b"foobar",
            &[0, 255, 254, 3],
        ] {
            let coded = base64(plain);
            assert_eq!(base64_decode(&coded).unwrap(), plain, "{coded}");
            assert_eq!(base64_decode(coded.trim_end_matches('=')).unwrap(), plain);
        }
        assert_eq!(base64_decode("Zm9v\nYmFy").unwrap(), b"foobar");
        assert_eq!(
            base64_decode("_-8=").unwrap(),
            base64_decode("/+8=").unwrap()
        );
        for bad in ["Z", "Zm9vY", "Zg==Zg==", "Zh==", "Zm9v*"] {
            assert!(base64_decode(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn accepts_openai_shapes() {
        let r = parse(
            br#"{"model":"x","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
                 "max_completion_tokens":5,"temperature":0.5,"top_p":0.9,"top_k":-1,"seed":-3,"stop":"x","n":1,"user":"u",
                 "logprobs":false,"tools":null,"stream":true,"stream_options":{"include_usage":true}}"#,
            true,
        )
        .map_err(|e| e.message)
        .unwrap();
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.stop, vec!["x".to_string()]);
        assert!(r.stream && r.include_usage);
        assert_eq!(r.sampling.top_k, 0);
        match r.input {
            Input::Chat(m) => assert_eq!(m[1].content, "a\nb"),
            Input::Text(_) => panic!("chat expected"),
        }
    }
}

/// A validated `POST /v1/embeddings` request.
#[derive(Debug, Clone)]
pub(crate) struct EmbeddingRequest {
    pub input: Vec<String>,
    pub dimensions: Option<usize>,
    /// `encoding_format` "base64": each vector as base64 of its little-endian float32 bytes
    /// (what the `openai` Python client asks for by default).
    pub base64: bool,
}

/// Parses OpenAI's embeddings request: `input` (a string or a list of strings), `model`
/// (any string; one embedding model is served), `dimensions`, `encoding_format` ("float" or
/// "base64"),
/// `user` (ignored).
pub(crate) fn parse_embeddings(body: &[u8]) -> Result<EmbeddingRequest, ApiError> {
    let obj = json_object(body)?;
    refuse_unknown_fields(
        &obj,
        &["input", "model", "dimensions", "encoding_format", "user"],
    )?;
    let input = match obj.get("input") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("input", "`input` is required"));
        }
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.is_empty() {
                return Err(ApiError::invalid(
                    "input",
                    "`input` must not be an empty list",
                ));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => Ok(s.clone()),
                    _ => Err(ApiError::invalid(
                        format!("input[{i}]"),
                        format!("`input[{i}]` must be a string (token-id input is not supported)"),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "input",
                "`input` must be a string or a list of strings",
            ))
        }
    };
    for (i, text) in input.iter().enumerate() {
        if text.is_empty() {
            return Err(ApiError::invalid(
                format!("input[{i}]"),
                format!("`input[{i}]` is an empty string"),
            ));
        }
    }
    match obj.get("model") {
        None | Some(Value::Null) | Some(Value::String(_)) => {}
        Some(_) => return Err(ApiError::invalid("model", "`model` must be a string")),
    }
    let base64 = match obj.get("encoding_format") {
        None | Some(Value::Null) => false,
        Some(Value::String(f)) if f == "float" => false,
        Some(Value::String(f)) if f == "base64" => true,
        Some(Value::String(f)) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("`encoding_format` \"{f}\" is not supported: \"float\" or \"base64\""),
            ))
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "encoding_format",
                "`encoding_format` must be the string \"float\" or \"base64\"",
            ))
        }
    };
    let dimensions = match obj.get("dimensions") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => Some(usize::try_from(n).map_err(|_| {
                ApiError::invalid("dimensions", format!("`dimensions` {n} is too large"))
            })?),
            _ => {
                return Err(ApiError::invalid(
                    "dimensions",
                    format!("`dimensions` must be a positive integer, not {v}"),
                ))
            }
        },
    };
    Ok(EmbeddingRequest {
        input,
        dimensions,
        base64,
    })
}

/// Standard base64 (with padding) of `bytes`.
pub(crate) fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod base64_tests {
    #[test]
    fn rfc4648_vectors() {
        for (plain, coded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(super::base64(plain.as_bytes()), coded);
        }
    }
}

/// A validated `POST /v1/rerank` request.
#[derive(Debug, Clone)]
pub(crate) struct RerankRequest {
    pub query: String,
    pub documents: Vec<String>,
    pub top_n: Option<usize>,
    pub return_documents: bool,
}

/// Parses a Cohere/Jina-style rerank request: `query` (a string), `documents` (a list of
/// strings or of `{"text": ...}` objects), `model` (any string; one reranker is served),
/// `top_n` (a positive integer), `return_documents` (a boolean, default false).
pub(crate) fn parse_rerank(body: &[u8]) -> Result<RerankRequest, ApiError> {
    let obj = json_object(body)?;
    refuse_unknown_fields(
        &obj,
        &["query", "documents", "model", "top_n", "return_documents"],
    )?;
    let query = match obj.get("query") {
        Some(Value::String(q)) if !q.is_empty() => q.clone(),
        Some(Value::String(_)) => return Err(ApiError::invalid("query", "`query` is empty")),
        None | Some(Value::Null) => return Err(ApiError::invalid("query", "`query` is required")),
        Some(_) => return Err(ApiError::invalid("query", "`query` must be a string")),
    };
    let documents = match obj.get("documents") {
        Some(Value::Array(items)) if !items.is_empty() => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let text = match v {
                    Value::String(s) => Some(s.as_str()),
                    Value::Object(o) => o.get("text").and_then(Value::as_str),
                    _ => None,
                };
                match text {
                    Some(t) if !t.is_empty() => Ok(t.to_string()),
                    Some(_) => Err(ApiError::invalid(
                        format!("documents[{i}]"),
                        format!("`documents[{i}]` is empty"),
                    )),
                    None => Err(ApiError::invalid(
                        format!("documents[{i}]"),
                        format!(
                            "`documents[{i}]` must be a string or an object with a string `text`"
                        ),
                    )),
                }
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                "documents",
                "`documents` must not be an empty list",
            ))
        }
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("documents", "`documents` is required"))
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "documents",
                "`documents` must be a list of strings or of {\"text\": ...} objects",
            ))
        }
    };
    match obj.get("model") {
        None | Some(Value::Null) | Some(Value::String(_)) => {}
        Some(_) => return Err(ApiError::invalid("model", "`model` must be a string")),
    }
    let top_n = match obj.get("top_n") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            _ => {
                return Err(ApiError::invalid(
                    "top_n",
                    format!("`top_n` must be a positive integer, not {v}"),
                ))
            }
        },
    };
    let return_documents = match obj.get("return_documents") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                "return_documents",
                "`return_documents` must be a boolean",
            ))
        }
    };
    Ok(RerankRequest {
        query,
        documents,
        top_n,
        return_documents,
    })
}
