//! OpenAI's harmony reply format (gpt-oss). The model writes every reply as messages in channel
//! markup, special tokens kept in the text:
//!
//! - `<|channel|>analysis<|message|>…<|end|>`: its reasoning (returned as `reasoning_content`);
//! - `<|channel|>final<|message|>…`: the answer (the content), ended by `<|return|>`;
//! - `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}` (the recipient may
//!   also stand before the channel: `<|start|>assistant to=functions.NAME<|channel|>…`): a call,
//!   ended by `<|call|>`; commentary without a recipient is a preamble, returned as content.
//!
//! `<|return|>` and `<|call|>` end generation (they are end-of-sequence ids of gpt-oss), so the
//! text stops before them; the end of the text closes the open message.

use crate::tools::{Output, ToolCall};

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const CONSTRAIN: &str = "<|constrain|>";
/// What ends a message body.
const ENDS: [&str; 4] = ["<|end|>", "<|call|>", "<|return|>", START];

/// What the open message's body is.
#[derive(Debug, Clone, PartialEq)]
enum Body {
    /// Content (the final channel, or commentary without a recipient).
    Content,
    /// Reasoning (the analysis channel).
    Reasoning,
    /// Arguments of a call to a declared function, collected until the message ends.
    Call { name: String, arguments: String },
}

/// Splits streamed harmony text into content, reasoning and tool calls.
#[derive(Debug)]
pub(crate) struct HarmonyParser {
    held: String,
    /// `None` while reading a header (up to `<|message|>`).
    body: Option<Body>,
    /// Declared tool names: a call to another recipient stays content.
    names: Vec<String>,
}

impl HarmonyParser {
    pub fn new(names: Vec<String>) -> HarmonyParser {
        HarmonyParser {
            held: String::new(),
            body: None,
            names,
        }
    }

    /// Adds generated text; returns what is decided.
    pub fn push(&mut self, text: &str) -> Vec<Output> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.body.take() {
                None => {
                    let Some(at) = self.held.find(MESSAGE) else {
                        // A reply without markup is content as it stands.
                        let t = self.held.trim_start();
                        if !t.is_empty() && !t.starts_with("<|") && !"<|".starts_with(t) {
                            self.body = Some(Body::Content);
                            continue;
                        }
                        return out;
                    };
                    let header = self.held[..at].to_string();
                    self.held.drain(..at + MESSAGE.len());
                    self.body = Some(self.open(&header));
                }
                Some(mut body) => {
                    let end = ENDS
                        .iter()
                        .filter_map(|m| self.held.find(m).map(|at| (at, m.len())))
                        .min();
                    match end {
                        Some((at, len)) => {
                            let text: String = self.held.drain(..at).collect();
                            self.held.drain(..len);
                            emit(&mut out, body.take_text(&text));
                            if let Body::Call { name, arguments } = body {
                                out.push(call(name, arguments));
                            }
                            // The next message's header follows.
                        }
                        None => {
                            // Hold back what may be the start of a marker.
                            let keep = ENDS
                                .iter()
                                .flat_map(|m| (1..m.len()).map(move |n| &m[..n]))
                                .filter(|p| self.held.ends_with(p))
                                .map(|p| p.len())
                                .max()
                                .unwrap_or(0);
                            let cut = self.held.len() - keep;
                            let text: String = self.held.drain(..cut).collect();
                            emit(&mut out, body.take_text(&text));
                            self.body = Some(body);
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// The end of the text: closes the open message.
    pub fn finish(&mut self) -> Vec<Output> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.held);
        // An unfinished header carries no text worth showing.
        if let Some(mut body) = self.body.take() {
            emit(&mut out, body.take_text(&rest));
            if let Body::Call { name, arguments } = body {
                out.push(call(name, arguments));
            }
        }
        out
    }

    /// The body a message header opens.
    fn open(&self, header: &str) -> Body {
        let header = header.replace(START, " ").replace(CONSTRAIN, " ");
        let (before, channel_part) = match header.split_once(CHANNEL) {
            Some((b, c)) => (b.to_string(), c.to_string()),
            None => (header.clone(), String::new()),
        };
        let channel = channel_part.split_whitespace().next().unwrap_or("");
        let recipient = before
            .split_whitespace()
            .chain(channel_part.split_whitespace())
            .find_map(|w| w.strip_prefix("to="));
        match recipient.and_then(|r| r.strip_prefix("functions.")) {
            Some(name) if self.names.iter().any(|n| n == name) => Body::Call {
                name: name.to_string(),
                arguments: String::new(),
            },
            _ if channel == "analysis" => Body::Reasoning,
            _ => Body::Content,
        }
    }
}

impl Body {
    /// The output for `text` of this body (a call's arguments are kept until it ends).
    fn take_text(&mut self, text: &str) -> Option<Output> {
        if text.is_empty() {
            return None;
        }
        match self {
            Body::Content => Some(Output::Text(text.to_string())),
            Body::Reasoning => Some(Output::Reasoning(text.to_string())),
            Body::Call { arguments, .. } => {
                arguments.push_str(text);
                None
            }
        }
    }
}

fn emit(out: &mut Vec<Output>, o: Option<Output>) {
    match (o, out.last_mut()) {
        (Some(Output::Text(t)), Some(Output::Text(prev))) => prev.push_str(&t),
        (Some(Output::Reasoning(t)), Some(Output::Reasoning(prev))) => prev.push_str(&t),
        (Some(o), _) => out.push(o),
        (None, _) => {}
    }
}

/// A call, or its text as content when the arguments are not a JSON object.
fn call(name: String, arguments: String) -> Output {
    match serde_json::from_str::<serde_json::Value>(arguments.trim()) {
        Ok(v) if v.is_object() => Output::Call(ToolCall {
            name,
            arguments: v.to_string(),
        }),
        _ => Output::Text(arguments),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(names: &[&str], pieces: &[&str]) -> Vec<Output> {
        let mut p = HarmonyParser::new(names.iter().map(|n| n.to_string()).collect());
        let mut all = Vec::new();
        for piece in pieces {
            for o in p.push(piece) {
                emit(&mut all, Some(o));
            }
        }
        for o in p.finish() {
            emit(&mut all, Some(o));
        }
        all
    }

    /// Every split of `whole` into two pieces gives what the whole gives.
    fn splits_agree(names: &[&str], whole: &str) -> Vec<Output> {
        let want = run(names, &[whole]);
        for cut in (1..whole.len()).filter(|c| whole.is_char_boundary(*c)) {
            let (a, b) = whole.split_at(cut);
            assert_eq!(run(names, &[a, b]), want, "split at {cut}: {a:?} | {b:?}");
        }
        want
    }

    #[test]
    fn reasoning_then_answer() {
        let got = splits_agree(
            &[],
            "<|channel|>analysis<|message|>User greets. Reply.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!",
        );
        assert_eq!(
            got,
            vec![
                Output::Reasoning("User greets. Reply.".into()),
                Output::Text("Hello there!".into())
            ]
        );
    }

    #[test]
    fn calls_with_the_recipient_on_either_side_of_the_channel() {
        for text in [
            "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Tokyo\"}",
            "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Tokyo\"}",
        ] {
            let got = splits_agree(&["get_weather"], text);
            assert_eq!(
                got,
                vec![
                    Output::Reasoning("Need weather.".into()),
                    Output::Call(ToolCall {
                        name: "get_weather".into(),
                        arguments: r#"{"city":"Tokyo"}"#.into()
                    })
                ],
                "{text}"
            );
        }
    }

    #[test]
    fn undeclared_functions_and_bad_arguments_stay_content() {
        let got = run(
            &["get_weather"],
            &["<|channel|>commentary to=functions.other <|constrain|>json<|message|>{\"a\": 1}"],
        );
        assert_eq!(got, vec![Output::Text("{\"a\": 1}".into())]);
        let got = run(
            &["get_weather"],
            &["<|channel|>commentary to=functions.get_weather<|message|>not json"],
        );
        assert_eq!(got, vec![Output::Text("not json".into())]);
    }

    #[test]
    fn plain_text_without_markup_is_content() {
        assert_eq!(
            run(&[], &["Just ", "text."]),
            vec![Output::Text("Just text.".into())]
        );
    }
}
