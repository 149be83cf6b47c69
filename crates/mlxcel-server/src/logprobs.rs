//! Log-probabilities in OpenAI's two shapes: chat's `logprobs.content` list and the legacy
//! completions object (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

use std::sync::Arc;

use mlxcel_models::{TokenBytes, TokenLogprob};
use serde_json::{json, Map, Value};

/// OpenAI reports impossible tokens as -9999 (JSON has no infinity).
const FLOOR: f32 = -9999.0;

/// Turns token ids into the strings and bytes the API shows.
#[derive(Clone)]
pub(crate) struct Vocab(pub Arc<Vec<TokenBytes>>);

impl Vocab {
    fn bytes(&self, id: u32) -> &[u8] {
        self.0.get(id as usize).map_or(&[], |t| t.bytes.as_slice())
    }

    /// The token's text (a partial UTF-8 character shows as U+FFFD; `bytes` has the truth).
    fn text(&self, id: u32) -> String {
        String::from_utf8_lossy(self.bytes(id)).into_owned()
    }

    fn entry(&self, id: u32, logprob: f32) -> Value {
        json!({
            "token": self.text(id),
            "logprob": logprob.max(FLOOR),
            "bytes": self.bytes(id),
        })
    }

    /// Chat's `choices[].logprobs` for these tokens.
    pub fn chat(&self, tokens: &[TokenLogprob]) -> Value {
        let content: Vec<Value> = tokens
            .iter()
            .map(|t| {
                let mut e = self.entry(t.token, t.logprob);
                let top: Vec<Value> = t.top.iter().map(|(id, lp)| self.entry(*id, *lp)).collect();
                e["top_logprobs"] = Value::Array(top);
                e
            })
            .collect();
        json!({"content": content, "refusal": null})
    }

    /// The completions endpoint's `choices[].logprobs` for these tokens; `offset` is the
    /// completion text's length before them (in bytes), advanced past them.
    pub fn completion(&self, tokens: &[TokenLogprob], offset: &mut usize) -> Value {
        let mut texts = Vec::with_capacity(tokens.len());
        let mut lps = Vec::with_capacity(tokens.len());
        let mut tops = Vec::with_capacity(tokens.len());
        let mut offsets = Vec::with_capacity(tokens.len());
        for t in tokens {
            texts.push(self.text(t.token));
            lps.push(t.logprob.max(FLOOR));
            let mut top = Map::new();
            for (id, lp) in &t.top {
                top.insert(self.text(*id), json!(lp.max(FLOOR)));
            }
            tops.push(Value::Object(top));
            offsets.push(*offset);
            *offset += self.bytes(t.token).len();
        }
        json!({
            "tokens": texts,
            "token_logprobs": lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        })
    }
}
