//! Chat templates: the Jinja template a model ships (`tokenizer_config.json` `chat_template`, a
//! named template list, or `chat_template.jinja`), rendered with minijinja and what real HF
//! templates use: `raise_exception`, `tojson`, `strftime_now`, loop controls, Python string
//! methods (`.strip()`, `.startswith()`, ...), `bos_token`/`eos_token`, `add_generation_prompt`.

use std::path::Path;

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value as JinjaValue};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{LoadError, Result};

/// One chat message, as HF chat templates read it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, or another role the template names.
    pub role: String,
    /// The message text.
    pub content: String,
    /// The tool calls an assistant message made, in OpenAI's shape
    /// (`{"id", "type": "function", "function": {"name", "arguments"}}`) with `arguments` as a
    /// JSON object, which is what templates expect (`tool_call.arguments | tojson`). Absent from
    /// the template's view when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<Value>,
    /// A `tool` message: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A `tool` message: the tool's name (or a participant's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    /// A message of `role` (`system`, `user`, `assistant`, ...).
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.to_string(),
            content: content.to_string(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }

    /// A `user` message.
    pub fn user(content: &str) -> Message {
        Message::new("user", content)
    }

    /// A `system` message.
    pub fn system(content: &str) -> Message {
        Message::new("system", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: &str) -> Message {
        Message::new("assistant", content)
    }
}

/// A loaded chat template with the special tokens it may reference.
///
/// [`ChatTemplate::render`] produces the full prompt text including the model's special tokens
/// (BOS, turn markers), so the result must be encoded WITHOUT adding special tokens:
/// `tokenizer.encode(&text, false)` (see [`crate::Tokenizer`]).
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Where the template came from, for error messages.
    origin: String,
    /// Roles the template may be given: the usual four plus any it names as a string literal.
    roles: Vec<String>,
}

/// Roles every template is assumed to handle.
pub const STANDARD_ROLES: &[&str] = &["system", "user", "assistant", "tool"];

/// Minijinja instructions a render may run: real templates need a few thousand per message, a
/// looping one runs out quickly (well under a second).
const BASE_FUEL: u64 = 20_000_000;
const FUEL_PER_MESSAGE: u64 = 100_000;

/// Bytes a render may write: 1 MiB plus eight times the messages' text.
const BASE_OUTPUT: usize = 1 << 20;

/// A writer that refuses to grow past `limit` bytes (stops a runaway template quickly).
struct Bounded {
    out: Vec<u8>,
    limit: usize,
    overflowed: bool,
}

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len().saturating_add(buf.len()) > self.limit {
            self.overflowed = true;
            return Err(std::io::Error::other("output limit"));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Roles named as quoted literals in a template's source (`'developer'`, `"ipython"`).
fn literal_roles(source: &str) -> Vec<String> {
    let mut roles: Vec<String> = STANDARD_ROLES.iter().map(|r| r.to_string()).collect();
    for quote in ['\'', '"'] {
        for (i, piece) in source.split(quote).enumerate() {
            if i % 2 == 1
                && !piece.is_empty()
                && piece.len() <= 32
                && piece
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                && !roles.iter().any(|r| r == piece)
            {
                roles.push(piece.to_string());
            }
        }
    }
    roles
}

fn token_text(config: &Value, key: &str) -> String {
    match config.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

/// Formats the current local-agnostic UTC time with the strftime subset templates use.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let days = secs.div_euclid(86_400);
    let (h, mi, s) = ((secs % 86_400) / 3600, (secs % 3600) / 60, secs % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('M') => out.push_str(&format!("{mi:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Python's `json.dumps` separators (`", "` and `": "`), as HF's `tojson` writes them.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// `tojson` as transformers defines it for chat templates: `json.dumps(x, ensure_ascii=False,
/// indent=indent)` with keys in their given order and no HTML escaping (minijinja's own
/// filter writes compact JSON with `<`, `>`, `&`, `'` escaped, which changes the prompt).
fn python_tojson(
    value: &JinjaValue,
    indent: Option<JinjaValue>,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<JinjaValue, JinjaError> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<JinjaValue>>("indent")?,
    };
    // Other keyword arguments (`ensure_ascii`, `sort_keys`, `separators`) are not used by
    // real templates; refuse them rather than ignore them.
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v).map_err(|_| {
            JinjaError::new(
                ErrorKind::InvalidOperation,
                "tojson: indent must be an integer",
            )
        })?),
    };
    let mut out = Vec::new();
    let written = match indent {
        // Python's indented form uses "," at line ends and ": ", as serde's pretty printer.
        Some(n) => {
            let pad = " ".repeat(n);
            let formatter = serde_json::ser::PrettyFormatter::with_indent(pad.as_bytes());
            serde::Serialize::serialize(
                value,
                &mut serde_json::Serializer::with_formatter(&mut out, formatter),
            )
        }
        None => serde::Serialize::serialize(
            value,
            &mut serde_json::Serializer::with_formatter(&mut out, PythonFormatter),
        ),
    };
    written.map_err(|e| {
        JinjaError::new(ErrorKind::InvalidOperation, "tojson: cannot serialize").with_source(e)
    })?;
    let text = String::from_utf8(out)
        .map_err(|_| JinjaError::new(ErrorKind::InvalidOperation, "tojson: output is not UTF-8"))?;
    Ok(JinjaValue::from_safe_string(text))
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let source_len = self
            .env
            .get_template("chat")
            .map(|t| t.source().len())
            .unwrap_or(0);
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("source_len", &source_len)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("roles", &self.roles)
            .finish()
    }
}

/// How a model writes a tool call in its reply, as its chat template teaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// Hermes / Qwen: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
    Hermes,
    /// Llama 3.x: the reply is one JSON object `{"name": ..., "parameters": {...}}`.
    Llama3Json,
    /// Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`.
    Mistral,
    /// OpenAI's harmony (gpt-oss): every reply is channel markup —
    /// `<|channel|>analysis<|message|>…<|end|>`, `<|channel|>final<|message|>…`, and calls as
    /// `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}` ending at
    /// `<|call|>` — so the text keeps its special tokens and is always parsed.
    Harmony,
}

impl ChatTemplate {
    /// Builds a template from its source and the tokenizer config (for `bos_token`/`eos_token`);
    /// a template that does not parse is a [`LoadError::Unsupported`].
    pub fn new(source: &str, tokenizer_config: &Value) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<JinjaValue, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", python_tojson);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| LoadError::Unsupported(format!("chat template does not parse: {e}")))?;
        Ok(ChatTemplate {
            env,
            bos_token: token_text(tokenizer_config, "bos_token"),
            eos_token: token_text(tokenizer_config, "eos_token"),
            origin: "chat template".to_string(),
            roles: literal_roles(source),
        })
    }

    fn named(source: &str, tokenizer_config: &Value, origin: String) -> Result<ChatTemplate> {
        let mut t = ChatTemplate::new(source, tokenizer_config)
            .map_err(|e| LoadError::Unsupported(format!("{origin}: {e}")))?;
        t.origin = origin;
        Ok(t)
    }

    /// The model folder's template, or `None` when it ships none: `chat_template.jinja` when
    /// present, else `tokenizer_config.json`'s `chat_template` (a string, or the entry named
    /// `default` of a list).
    pub fn load(folder: &Path) -> Result<Option<ChatTemplate>> {
        let config_path = folder.join("tokenizer_config.json");
        let config: Value = if config_path.exists() {
            let path = mlxcel_core::weights::confined_path(folder, "tokenizer_config.json")?;
            let text = std::fs::read_to_string(&path)
                .map_err(|e| LoadError::file(&path, e.to_string()))?;
            serde_json::from_str(&text)
                .map_err(|e| LoadError::file(&config_path, format!("invalid JSON: {e}")))?
        } else {
            Value::Null
        };
        let jinja = folder.join("chat_template.jinja");
        let (source, origin) = if jinja.exists() {
            let path = mlxcel_core::weights::confined_path(folder, "chat_template.jinja")?;
            (
                Some(
                    std::fs::read_to_string(&path)
                        .map_err(|e| LoadError::file(&jinja, e.to_string()))?,
                ),
                jinja.display().to_string(),
            )
        } else {
            let origin = format!("{}: chat_template", config_path.display());
            let source = match config.get("chat_template") {
                Some(Value::String(s)) => Some(s.clone()),
                // A list of named templates: the one called "default".
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template").and_then(Value::as_str))
                    .map(str::to_string),
                _ => None,
            };
            (source, origin)
        };
        source
            .map(|s| ChatTemplate::named(&s, &config, origin))
            .transpose()
    }

    /// Checks a conversation before rendering: at least one message, each with a role the
    /// template handles (`system`, `user`, `assistant`, `tool`, and any role the template names
    /// as a string literal). An error is a [`LoadError::Unsupported`] naming the message.
    pub fn check_messages(&self, messages: &[Message]) -> Result<()> {
        if messages.is_empty() {
            return Err(LoadError::Unsupported(
                "messages: the conversation is empty (at least one message is needed)".into(),
            ));
        }
        for (i, m) in messages.iter().enumerate() {
            if !self.roles.contains(&m.role) {
                return Err(LoadError::Unsupported(format!(
                    "messages[{i}].role = {:?}: must be one of {} (the roles {} handles)",
                    m.role,
                    self.roles.join(", "),
                    self.origin
                )));
            }
        }
        Ok(())
    }

    /// Renders `messages`; `add_generation_prompt` opens the assistant's turn.
    ///
    /// The text already contains the model's special tokens (BOS, turn markers): encode it
    /// WITHOUT adding special tokens, `tokenizer.encode(&text, false)`, or the prompt gets a
    /// second BOS.
    ///
    /// The render is bounded: it may run 20,000,000 (plus 100,000 per message) template
    /// instructions and write 1 MiB plus eight times the messages' text; a template past either
    /// bound fails with an error naming it instead of running away.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// How the template tells the model to write a tool call, from the markers in its source
    /// (`None` when it names none of them): [`ToolCallFormat::Harmony`] for `<|channel|>`,
    /// [`ToolCallFormat::Mistral`] for `[TOOL_CALLS]`, [`ToolCallFormat::Hermes`] for
    /// `<tool_call>`, [`ToolCallFormat::Llama3Json`] for Llama 3.x's
    /// `{"name": function name, "parameters": ...}` instruction.
    pub fn tool_call_format(&self) -> Option<ToolCallFormat> {
        let source = self.env.get_template("chat").ok()?.source().to_string();
        if source.contains("<|channel|>") {
            Some(ToolCallFormat::Harmony)
        } else if source.contains("[TOOL_CALLS]") {
            Some(ToolCallFormat::Mistral)
        } else if source.contains("<tool_call>") {
            Some(ToolCallFormat::Hermes)
        } else if source.contains("\"parameters\": dictionary")
            || source.contains("\"name\": function name")
        {
            Some(ToolCallFormat::Llama3Json)
        } else {
            None
        }
    }

    /// Whether the template reads the `tools` variable (tool declarations), as tool-calling
    /// models' templates do.
    pub fn takes_tools(&self) -> bool {
        self.env
            .get_template("chat")
            .is_ok_and(|t| t.undeclared_variables(false).contains("tools"))
    }

    /// [`ChatTemplate::render`] with tool declarations: `tools` is given to the template as
    /// HF's `apply_chat_template(tools=...)` gives it (a list of OpenAI-style
    /// `{"type": "function", "function": {"name", "description", "parameters"}}` objects; `None`
    /// leaves the variable none).
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.check_messages(messages)?;
        let origin = &self.origin;
        let mut env = self.env.clone();
        env.set_fuel(Some(BASE_FUEL.saturating_add(
            FUEL_PER_MESSAGE.saturating_mul(messages.len() as u64),
        )));
        let template = env
            .get_template("chat")
            .map_err(|e| LoadError::Unsupported(format!("{origin}: {e}")))?;
        let tools_text = tools.map_or(0, |t| t.iter().map(|v| v.to_string().len()).sum());
        let text: usize = messages
            .iter()
            .map(|m| {
                m.content.len()
                    + m.role.len()
                    + m.tool_calls
                        .iter()
                        .map(|c| c.to_string().len())
                        .sum::<usize>()
            })
            .fold(tools_text, usize::saturating_add);
        let limit = BASE_OUTPUT.saturating_add(text.saturating_mul(8));
        let mut out = Bounded {
            out: Vec::new(),
            limit,
            overflowed: false,
        };
        let rendered = template.render_captured_to(
            minijinja::context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            },
            &mut out,
        );
        match rendered {
            Ok(_) => String::from_utf8(out.out).map_err(|_| {
                LoadError::Unsupported(format!("{origin}: rendered text is not UTF-8"))
            }),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(LoadError::Unsupported(format!(
                "{origin}: the template ran too long (over {} instructions): it loops or is far too complex",
                BASE_FUEL
            ))),
            Err(_) if out.overflowed => {
                Err(LoadError::Unsupported(format!(
                    "{origin}: the template's output exceeds {limit} bytes: it loops or repeats text"
                )))
            }
            Err(e) => Err(LoadError::Unsupported(format!("{origin} failed: {e}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_hf_style_templates() {
        let source = r#"{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}{%- set messages = messages[1:] %}{%- else %}{%- set system = 'default' %}{%- endif %}{{ bos_token }}[{{ system | tojson }}]{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}{% if loop.index > 5 %}{% break %}{% endif %}<{{ m.role }}>{{ m.content.strip() }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"#;
        let config = serde_json::json!({"bos_token": "<s>", "eos_token": {"content": "</s>"}});
        let t = ChatTemplate::new(source, &config).unwrap();
        let out = t
            .render(
                &[
                    Message::new("system", "be nice"),
                    Message::new("user", "  hi  "),
                ],
                true,
            )
            .unwrap();
        assert_eq!(out, "<s>[\"be nice\"]<user>hi<assistant>");
        let err = t
            .render(&[Message::new("tool", "x")], false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("bad role tool"), "{err}");
        let date = ChatTemplate::new("{{ strftime_now('%Y-%m-%d') }}", &config)
            .unwrap()
            .render(&[Message::new("user", "x")], false)
            .unwrap();
        assert_eq!(date.len(), 10);
        assert!(date.starts_with("20"), "{date}");
    }
}
