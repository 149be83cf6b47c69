//! Chat templates: the Jinja template a model ships (`tokenizer_config.json` `chat_template`, a
//! named template list, or `chat_template.jinja`), rendered with minijinja and what real HF
//! templates use: `raise_exception`, `tojson`, `strftime_now`, loop controls, Python string
//! methods (`.strip()`, `.startswith()`, ...), `bos_token`/`eos_token`, `add_generation_prompt`.

use std::path::Path;

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value as JinjaValue};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{LoadError, Result};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    /// A message of `role` (`system`, `user`, `assistant`, ...).
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.to_string(),
            content: content.to_string(),
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
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
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

impl ChatTemplate {
    /// Builds a template from its source and the tokenizer config (for `bos_token`/`eos_token`).
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
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| LoadError::Unsupported(format!("chat template does not parse: {e}")))?;
        Ok(ChatTemplate {
            env,
            bos_token: token_text(tokenizer_config, "bos_token"),
            eos_token: token_text(tokenizer_config, "eos_token"),
        })
    }

    /// The model folder's template, or `None` when it ships none.
    pub fn load(folder: &Path) -> Result<Option<ChatTemplate>> {
        let config_path = folder.join("tokenizer_config.json");
        let config: Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| LoadError::file(&config_path, format!("invalid JSON: {e}")))?,
            Err(_) => Value::Null,
        };
        let jinja = folder.join("chat_template.jinja");
        let source = if jinja.is_file() {
            Some(
                std::fs::read_to_string(&jinja)
                    .map_err(|e| LoadError::file(&jinja, e.to_string()))?,
            )
        } else {
            match config.get("chat_template") {
                Some(Value::String(s)) => Some(s.clone()),
                // A list of named templates: the one called "default".
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template").and_then(Value::as_str))
                    .map(str::to_string),
                _ => None,
            }
        };
        source.map(|s| ChatTemplate::new(&s, &config)).transpose()
    }

    /// Renders `messages`; `add_generation_prompt` opens the assistant's turn.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| LoadError::Unsupported(format!("chat template: {e}")))?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| LoadError::Unsupported(format!("chat template failed: {e}")))
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
            .render(&[], false)
            .unwrap();
        assert_eq!(date.len(), 10);
        assert!(date.starts_with("20"), "{date}");
    }
}
