//! Tool calls in a model's output, in the formats chat templates teach:
//!
//! - Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the
//!   text, any number of them;
//! - Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` at the start (the marker is
//!   a special token, so decoded text usually has only the JSON list after it);
//! - Llama 3.x: the whole reply is one JSON object `{"name": ..., "parameters": {...}}`, maybe
//!   after `<|python_tag|>`.
//!
//! [`ToolCallParser`] reads the text as it streams: text that cannot be part of a call is
//! released at once, text that might be is held until it is decided. A call whose JSON does not
//! parse, or lacks a name, is given back as plain text, exactly as the model wrote it.

use mlxcel_models::{Message, ToolCallFormat};
use serde_json::Value;

use crate::api::ApiError;
use crate::constraint::Shape;
use crate::grammar::Grammar;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
/// Markers that may open a reply made only of calls.
/// Mistral's marker before its list of calls.
const MISTRAL: &str = "[TOOL_CALLS]";
const LEADING: &[&str] = &[MISTRAL, "<|python_tag|>"];

/// One parsed call.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ToolCall {
    pub name: String,
    /// The arguments as JSON text (an object).
    pub arguments: String,
}

/// What the parser releases, in output order.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Output {
    Text(String),
    Call(ToolCall),
    /// The model's reasoning (harmony's analysis channel), returned as `reasoning_content`.
    Reasoning(String),
}

/// Reads a chat reply: tool calls in the common formats when the request declared tools, or
/// every reply of a harmony-format model (its channel markup).
#[derive(Debug)]
pub(crate) enum ReplyParser {
    Tools(ToolCallParser),
    Harmony(crate::harmony::HarmonyParser),
}

impl ReplyParser {
    /// The parser a reply needs: `harmony` for a harmony-format model, else one for the
    /// declared `tools` (none without tools).
    pub fn new(harmony: bool, tools: Option<Vec<String>>) -> Option<ReplyParser> {
        if harmony {
            return Some(ReplyParser::Harmony(crate::harmony::HarmonyParser::new(
                tools.unwrap_or_default(),
            )));
        }
        tools.map(|names| ReplyParser::Tools(ToolCallParser::new(names)))
    }

    /// Adds generated text; returns what is decided.
    pub fn push(&mut self, text: &str) -> Vec<Output> {
        match self {
            ReplyParser::Tools(p) => p.push(text),
            ReplyParser::Harmony(p) => p.push(text),
        }
    }

    /// The end of the reply.
    pub fn finish(&mut self) -> Vec<Output> {
        match self {
            ReplyParser::Tools(p) => p.finish(),
            ReplyParser::Harmony(p) => p.finish(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Nothing but whitespace yet: the reply might be a bare JSON call.
    Start,
    /// Ordinary text, watching for `<tool_call>`.
    Text,
    /// Inside `<tool_call>`, waiting for its end.
    Tagged,
    /// A reply that starts like a JSON call (or a leading marker): decided at the end.
    Bare,
}

/// Splits streamed model output into text and tool calls (see the module docs).
#[derive(Debug)]
pub(crate) struct ToolCallParser {
    state: State,
    held: String,
    /// Declared tool names: a bare JSON reply is a call only when it names one of them (so an
    /// answer that happens to be JSON stays text).
    names: Vec<String>,
}

impl ToolCallParser {
    pub fn new(names: Vec<String>) -> ToolCallParser {
        ToolCallParser {
            state: State::Start,
            held: String::new(),
            names,
        }
    }

    /// Adds generated text; returns what is decided.
    pub fn push(&mut self, text: &str) -> Vec<Output> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Start => {
                    let rest = self.held.trim_start();
                    if rest.is_empty() {
                        return out;
                    }
                    if rest.starts_with('{')
                        || rest.starts_with('[')
                        || LEADING.iter().any(|m| rest.starts_with(m))
                    {
                        self.state = State::Bare;
                    } else if LEADING.iter().any(|m| m.starts_with(rest)) {
                        // Could still become a marker.
                        return out;
                    } else {
                        self.state = State::Text;
                    }
                }
                State::Text => match self.held.find(OPEN) {
                    Some(at) => {
                        push_text(&mut out, &self.held[..at]);
                        self.held.drain(..at + OPEN.len());
                        self.state = State::Tagged;
                    }
                    None => {
                        let keep = partial_suffix(&self.held, OPEN);
                        let cut = self.held.len() - keep;
                        push_text(&mut out, &self.held[..cut]);
                        self.held.drain(..cut);
                        return out;
                    }
                },
                State::Tagged => match self.held.find(CLOSE) {
                    Some(at) => {
                        let body = self.held[..at].to_string();
                        self.held.drain(..at + CLOSE.len());
                        match parse_call(&body) {
                            Some(call) => out.push(Output::Call(call)),
                            None => push_text(&mut out, &format!("{OPEN}{body}{CLOSE}")),
                        }
                        self.state = State::Text;
                    }
                    None => return out,
                },
                State::Bare => return out,
            }
        }
    }

    /// The end of the output: decides what is still held.
    pub fn finish(&mut self) -> Vec<Output> {
        let held = std::mem::take(&mut self.held);
        let mut out = Vec::new();
        match self.state {
            State::Start | State::Text => push_text(&mut out, &held),
            // An unclosed call (the model stopped at its end-of-turn token instead).
            State::Tagged => match parse_call(&held) {
                Some(call) => out.push(Output::Call(call)),
                None => push_text(&mut out, &format!("{OPEN}{held}")),
            },
            State::Bare => match self.bare_calls(&held) {
                Some(calls) => out.extend(calls.into_iter().map(Output::Call)),
                None => push_text(&mut out, &held),
            },
        }
        self.state = State::Text;
        out
    }

    /// A reply made only of calls: `[TOOL_CALLS]` / `<|python_tag|>` (optional) and a JSON
    /// object or list of objects.
    fn bare_calls(&self, text: &str) -> Option<Vec<ToolCall>> {
        let mut rest = text.trim();
        let mut marked = false;
        for m in LEADING {
            if let Some(r) = rest.strip_prefix(m) {
                rest = r.trim_start();
                marked = true;
            }
        }
        let calls = match serde_json::from_str::<Value>(rest).ok()? {
            Value::Array(items) if !items.is_empty() => items
                .iter()
                .map(call_from_value)
                .collect::<Option<Vec<_>>>()?,
            v @ Value::Object(_) => vec![call_from_value(&v)?],
            _ => return None,
        };
        let declared = |c: &ToolCall| self.names.contains(&c.name);
        (marked || calls.iter().all(declared)).then_some(calls)
    }
}

fn push_text(out: &mut Vec<Output>, text: &str) {
    if text.is_empty() {
        return;
    }
    if let Some(Output::Text(t)) = out.last_mut() {
        t.push_str(text);
    } else {
        out.push(Output::Text(text.to_string()));
    }
}

/// Bytes at the end of `text` that are a proper prefix of `marker` (held back until the next
/// piece says whether the marker follows).
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|n| text.ends_with(&marker[..*n]))
        .unwrap_or(0)
}

fn parse_call(body: &str) -> Option<ToolCall> {
    call_from_value(&serde_json::from_str::<Value>(body.trim()).ok()?)
}

/// `{"name": "...", "arguments" | "parameters": {...} or a JSON string of one}`.
fn call_from_value(v: &Value) -> Option<ToolCall> {
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str().filter(|n| !n.is_empty())?;
    let arguments = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s).ok()? {
            a @ Value::Object(_) => a.to_string(),
            _ => return None,
        },
        Some(_) => return None,
    };
    Some(ToolCall {
        name: name.to_string(),
        arguments,
    })
}

/// For a chat template that does not read `tools`: the conversation with the declarations
/// and the Hermes call format described in its system message (opened when there is none), and
/// earlier calls written into their assistant messages in that format, so the model still sees
/// them.
pub(crate) fn described_in_system(messages: Vec<Message>, tools: &[Value]) -> Vec<Message> {
    let lines: Vec<String> = tools
        .iter()
        .map(|t| t.get("function").unwrap_or(t).to_string())
        .collect();
    let instructions = format!(
        "You may call functions to answer. Their signatures, one JSON object each:\n<tools>\n{}\n</tools>\n\
         To call one, reply with <tool_call>{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}</tool_call> for each call.",
        lines.join("\n")
    );
    let mut out = Vec::with_capacity(messages.len() + 1);
    let mut messages = messages.into_iter().peekable();
    match messages.peek() {
        Some(first) if first.role == "system" => {
            let mut first = messages.next().unwrap_or_else(|| Message::system(""));
            first.content = format!("{}\n\n{instructions}", first.content);
            out.push(first);
        }
        _ => out.push(Message::system(&instructions)),
    }
    for mut m in messages {
        for call in std::mem::take(&mut m.tool_calls) {
            let f = &call["function"];
            let body = serde_json::json!({"name": f["name"], "arguments": f["arguments"]});
            m.content.push_str(&format!("{OPEN}{body}{CLOSE}"));
        }
        out.push(m);
    }
    out
}

/// What a forced call (`tool_choice` `required` or a named function) must look like, in the
/// model's own `format`: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
/// (Hermes, also for templates that name no format: the instructions
/// [`described_in_system`] adds use it), `{"name": ..., "parameters": {...}}` (Llama 3.x) or
/// `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` (Mistral); the arguments follow the
/// function's `parameters` schema. A schema the grammar cannot enforce is an error naming it.
pub(crate) fn forced_call(
    tools: &[Value],
    only: Option<&str>,
    format: Option<ToolCallFormat>,
) -> Result<Shape, ApiError> {
    // Per format: the key of the arguments, and the text around the JSON body.
    let (arguments_key, prefix, suffix) = match format.unwrap_or(ToolCallFormat::Hermes) {
        ToolCallFormat::Hermes => ("arguments", format!("{OPEN}\n"), format!("\n{CLOSE}")),
        ToolCallFormat::Llama3Json => ("parameters", String::new(), String::new()),
        ToolCallFormat::Mistral => ("arguments", format!("{MISTRAL}["), "]".to_string()),
        ToolCallFormat::Harmony => {
            // The function's name sits in harmony's header, between special tokens, which the
            // JSON grammar's token mask does not produce.
            return Err(ApiError::invalid(
                "tool_choice",
                "forcing a tool call is not supported for harmony-format (gpt-oss) models: use \
                 tool_choice \"auto\"",
            ));
        }
    };
    let mut options = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let function = &tool["function"];
        let Some(name) = function["name"].as_str() else {
            continue;
        };
        if only.is_some_and(|o| o != name) {
            continue;
        }
        let parameters = match &function["parameters"] {
            Value::Null => serde_json::json!({"type": "object"}),
            p => p.clone(),
        };
        // Checked on its own first, so an error names the tool's own schema path.
        if let Err(e) = Grammar::compile(&parameters) {
            return Err(ApiError::invalid(
                format!("tools[{i}].function.parameters{}", e.path),
                format!("tools[{i}].function.parameters{}: {}", e.path, e.message),
            ));
        }
        options.push(serde_json::json!({
            "type": "object",
            "properties": {"name": {"const": name}, arguments_key: parameters},
            "required": ["name", arguments_key],
        }));
    }
    let schema = serde_json::json!({"anyOf": options});
    let grammar = Grammar::compile(&schema).map_err(|e| {
        ApiError::invalid(
            "tools",
            format!("the tools' schemas cannot be combined: {}", e.message),
        )
    })?;
    Ok(Shape {
        grammar: std::sync::Arc::new(grammar),
        prefix: prefix.into_bytes(),
        suffix: suffix.into_bytes(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: &str) -> Output {
        Output::Call(ToolCall {
            name: name.into(),
            arguments: arguments.into(),
        })
    }

    fn text(t: &str) -> Output {
        Output::Text(t.into())
    }

    /// A forced call in each format: the grammar accepts the format's body (and refuses the
    /// other key), and what the shape writes parses back as the call.
    #[test]
    fn forced_calls_take_the_models_format() {
        let tools = vec![
            serde_json::json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"], "additionalProperties": false}}}),
        ];
        for (format, key, other) in [
            (ToolCallFormat::Hermes, "arguments", "parameters"),
            (ToolCallFormat::Llama3Json, "parameters", "arguments"),
            (ToolCallFormat::Mistral, "arguments", "parameters"),
        ] {
            let shape = forced_call(&tools, None, Some(format)).unwrap();
            let body = format!(r#"{{"name": "get_weather", "{key}": {{"city": "Rome"}}}}"#);
            let accepts = |text: &str| {
                let mut m = shape.grammar.start();
                m.feed(&shape.grammar, text.as_bytes()) && m.is_complete()
            };
            assert!(accepts(&body), "{format:?}: {body}");
            assert!(!accepts(&body.replace(key, other)), "{format:?}");
            let written = format!(
                "{}{body}{}",
                String::from_utf8_lossy(&shape.prefix),
                String::from_utf8_lossy(&shape.suffix)
            );
            assert_eq!(
                run(&["get_weather"], &[&written]),
                vec![call("get_weather", r#"{"city":"Rome"}"#)],
                "{format:?}: {written}"
            );
        }
    }

    /// Feeds `pieces` one by one, then finishes; adjacent texts merged.
    fn run(names: &[&str], pieces: &[&str]) -> Vec<Output> {
        let mut p = ToolCallParser::new(names.iter().map(|n| n.to_string()).collect());
        let mut all = Vec::new();
        for piece in pieces {
            all.extend(p.push(piece));
        }
        all.extend(p.finish());
        let mut merged = Vec::new();
        for o in all {
            match o {
                Output::Text(t) => push_text(&mut merged, &t),
                c => merged.push(c),
            }
        }
        merged
    }

    /// Every split of `whole` into two pieces gives the same result as the whole.
    fn splits_agree(names: &[&str], whole: &str) -> Vec<Output> {
        let want = run(names, &[whole]);
        for (i, _) in whole.char_indices() {
            assert_eq!(
                run(names, &[&whole[..i], &whole[i..]]),
                want,
                "split at {i} of {whole:?}"
            );
        }
        let chars: Vec<String> = whole.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(names, &refs), want, "char by char: {whole:?}");
        want
    }

    #[test]
    fn hermes_tags_anywhere() {
        let out = splits_agree(
            &[],
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"time\", \"arguments\": {}}</tool_call>",
        );
        assert_eq!(
            out,
            vec![
                text("Let me check.\n"),
                call("get_weather", r#"{"city":"Paris"}"#),
                text("\n"),
                call("time", "{}"),
            ]
        );
    }

    #[test]
    fn text_streams_without_waiting() {
        let mut p = ToolCallParser::new(vec![]);
        assert_eq!(p.push("Hello"), vec![text("Hello")]);
        // A possible tag start is held, then released when it is not one.
        assert_eq!(p.push(" <tool"), vec![text(" ")]);
        assert_eq!(p.push("box>"), vec![text("<toolbox>")]);
        assert_eq!(p.finish(), vec![]);
    }

    #[test]
    fn malformed_calls_fall_back_to_text() {
        let bad = "<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": }</tool_call> after";
        assert_eq!(splits_agree(&[], bad), vec![text(bad)]);
        let nameless = "<tool_call>{\"arguments\": {}}</tool_call>";
        assert_eq!(splits_agree(&[], nameless), vec![text(nameless)]);
        // Unclosed and unparsable at the end.
        let open = "ok <tool_call>{\"name\": \"f\", \"argu";
        assert_eq!(splits_agree(&[], open), vec![text(open)]);
        // Unclosed but complete: a call.
        assert_eq!(
            splits_agree(
                &[],
                "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}"
            ),
            vec![call("f", r#"{"a":1}"#)]
        );
        // String arguments that are JSON are accepted; others are not.
        assert_eq!(
            run(
                &[],
                &["<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 2}\"}</tool_call>"]
            ),
            vec![call("f", r#"{"a":2}"#)]
        );
        let s = "<tool_call>{\"name\": \"f\", \"arguments\": \"nope\"}</tool_call>";
        assert_eq!(run(&[], &[s]), vec![text(s)]);
    }

    #[test]
    fn llama_json_replies() {
        let reply = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}";
        assert_eq!(
            splits_agree(&["get_weather"], reply),
            vec![call("get_weather", r#"{"city":"Rome"}"#)]
        );
        let tagged = format!("<|python_tag|>{reply}");
        assert_eq!(
            splits_agree(&[], &tagged),
            vec![call("get_weather", r#"{"city":"Rome"}"#)]
        );
        // JSON that names no declared tool is an answer, not a call.
        assert_eq!(splits_agree(&["other"], reply), vec![text(reply)]);
        let answer = "  {\"a\": 1}";
        assert_eq!(splits_agree(&["f"], answer), vec![text(answer)]);
        let broken = "{\"name\": \"get_weather\", \"parameters\": {";
        assert_eq!(splits_agree(&["get_weather"], broken), vec![text(broken)]);
    }

    #[test]
    fn tools_described_for_templates_without_them() {
        let tools = vec![
            serde_json::json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}),
        ];
        let mut assistant = Message::assistant("");
        assistant.tool_calls = vec![
            serde_json::json!({"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}),
        ];
        let out = described_in_system(
            vec![Message::system("Be nice."), Message::user("hi"), assistant],
            &tools,
        );
        assert_eq!(out.len(), 3);
        assert!(
            out[0].content.starts_with("Be nice.\n\n"),
            "{}",
            out[0].content
        );
        assert!(
            out[0].content.contains(
                "<tools>\n{\"name\":\"f\",\"parameters\":{\"type\":\"object\"}}\n</tools>"
            ),
            "{}",
            out[0].content
        );
        assert!(out[0].content.contains("<tool_call>"));
        // An earlier call is written in the format the model is told to use, and parses back.
        assert_eq!(
            out[2].content,
            "<tool_call>{\"name\":\"f\",\"arguments\":{\"a\":1}}</tool_call>"
        );
        assert!(out[2].tool_calls.is_empty());
        assert_eq!(run(&[], &[&out[2].content]), vec![call("f", r#"{"a":1}"#)]);
        // No system message: one is opened.
        let out = described_in_system(vec![Message::user("hi")], &tools);
        assert_eq!((out[0].role.as_str(), out.len()), ("system", 2));
    }

    #[test]
    fn mistral_lists() {
        let reply = "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": {}}]";
        assert_eq!(
            splits_agree(&[], reply),
            vec![call("a", r#"{"x":1}"#), call("b", "{}")]
        );
        // The marker decoded away: a bare list of declared tools.
        let bare = "[{\"name\": \"a\", \"arguments\": {\"x\": 1}}]";
        assert_eq!(splits_agree(&["a"], bare), vec![call("a", r#"{"x":1}"#)]);
        assert_eq!(splits_agree(&[], bare), vec![text(bare)]);
        let bad = "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": 5}]";
        assert_eq!(splits_agree(&[], bad), vec![text(bad)]);
        // A reply that starts like the marker but is not.
        assert_eq!(splits_agree(&[], "[TOOL] x"), vec![text("[TOOL] x")]);
        assert_eq!(splits_agree(&[], "<|pyth"), vec![text("<|pyth")]);
    }
}
