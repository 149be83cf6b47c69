//! Constrained decoding: before each token is picked, every token whose bytes cannot continue
//! the output within the [`Grammar`] (or cannot let it finish within the token budget) gets a
//! logit of minus infinity, so the output always parses and validates.
//!
//! The vocabulary's byte strings are put in a trie once per model ([`Vocabulary`]); each step
//! walks the trie depth-first with the automaton, so tokens sharing a prefix share its work and
//! a dead prefix prunes all tokens below it.

use std::sync::Arc;

use mlxcel_models::{LogitsProcessor, TokenBytes};

use crate::grammar::{Grammar, Machine};

/// The tokenizer's byte strings in a trie, and the ids that end generation.
pub(crate) struct Vocabulary {
    /// Node 0 is the root; children sorted by byte.
    children: Vec<Vec<(u8, u32)>>,
    /// Token ids whose bytes end at each node.
    ends: Vec<Vec<u32>>,
    token_bytes: Arc<Vec<TokenBytes>>,
    eos: Vec<u32>,
}

impl Vocabulary {
    /// Special tokens and tokens without bytes are left out (never allowed inside JSON); `eos`
    /// are allowed once the value is complete.
    pub fn new(token_bytes: Arc<Vec<TokenBytes>>, eos: Vec<u32>) -> Vocabulary {
        let mut children: Vec<Vec<(u8, u32)>> = vec![Vec::new()];
        let mut ends: Vec<Vec<u32>> = vec![Vec::new()];
        for (id, t) in token_bytes.iter().enumerate() {
            if t.special || t.bytes.is_empty() || eos.contains(&(id as u32)) {
                continue;
            }
            let mut node = 0usize;
            for &b in &t.bytes {
                node = match children[node].binary_search_by_key(&b, |(c, _)| *c) {
                    Ok(i) => children[node][i].1 as usize,
                    Err(i) => {
                        let next = children.len();
                        children.push(Vec::new());
                        ends.push(Vec::new());
                        children[node].insert(i, (b, next as u32));
                        next
                    }
                };
            }
            ends[node].push(id as u32);
        }
        Vocabulary {
            children,
            ends,
            token_bytes,
            eos,
        }
    }

    /// The ids that end generation.
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }
}

/// Where the output is: a fixed prefix, the JSON value, a fixed suffix, or done.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Stage {
    Prefix(usize),
    Json,
    Suffix(usize),
    Done,
}

/// The output so far, as the constraint sees it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Cursor {
    stage: Stage,
    machine: Machine,
}

/// The shape the output must take: `prefix`, a JSON value of `grammar`, `suffix` (a tool call
/// is `<tool_call>\n{...}\n</tool_call>`; a `response_format` has neither).
#[derive(Debug, Clone)]
pub(crate) struct Shape {
    pub grammar: Arc<Grammar>,
    pub prefix: Vec<u8>,
    pub suffix: Vec<u8>,
}

impl Shape {
    /// A bare JSON value.
    pub fn json(grammar: Grammar) -> Shape {
        Shape {
            grammar: Arc::new(grammar),
            prefix: Vec::new(),
            suffix: Vec::new(),
        }
    }

    /// Fewest bytes (so tokens) any allowed output takes, not counting the end-of-sequence
    /// token.
    pub fn min_bytes(&self) -> usize {
        self.prefix.len() + self.grammar.start().min_to_finish(&self.grammar) + self.suffix.len()
    }

    fn start(&self) -> Cursor {
        Cursor {
            stage: if self.prefix.is_empty() {
                Stage::Json
            } else {
                Stage::Prefix(0)
            },
            machine: self.grammar.start(),
        }
    }

    fn feed(&self, c: &mut Cursor, b: u8) -> bool {
        match c.stage {
            Stage::Prefix(i) => {
                if self.prefix[i] != b {
                    return false;
                }
                c.stage = if i + 1 == self.prefix.len() {
                    Stage::Json
                } else {
                    Stage::Prefix(i + 1)
                };
                true
            }
            Stage::Json => {
                if !self.suffix.is_empty() && c.machine.is_complete() && b == self.suffix[0] {
                    // The value is closed (objects close themselves): on to the suffix.
                    c.stage = if self.suffix.len() == 1 {
                        Stage::Done
                    } else {
                        Stage::Suffix(1)
                    };
                    return true;
                }
                c.machine.feed(&self.grammar, &[b])
            }
            Stage::Suffix(i) => {
                if self.suffix[i] != b {
                    return false;
                }
                c.stage = if i + 1 == self.suffix.len() {
                    Stage::Done
                } else {
                    Stage::Suffix(i + 1)
                };
                true
            }
            Stage::Done => false,
        }
    }

    fn done(&self, c: &Cursor) -> bool {
        match c.stage {
            Stage::Done => true,
            Stage::Json => self.suffix.is_empty() && c.machine.is_complete(),
            _ => false,
        }
    }

    /// Fewest bytes that finish the output from `c`.
    fn to_finish(&self, c: &Cursor) -> usize {
        match c.stage {
            Stage::Prefix(i) => {
                self.prefix.len() - i
                    + self.grammar.start().min_to_finish(&self.grammar)
                    + self.suffix.len()
            }
            Stage::Json => c.machine.min_to_finish(&self.grammar) + self.suffix.len(),
            Stage::Suffix(i) => self.suffix.len() - i,
            Stage::Done => 0,
        }
    }
}

/// The [`LogitsProcessor`] of one constrained generation.
pub(crate) struct JsonConstraint {
    shape: Shape,
    vocab: Arc<Vocabulary>,
    cursor: Cursor,
    /// Generated tokens already read into `cursor`.
    consumed: usize,
    /// The generation's `max_new_tokens`. The output is closed one token before it, so the
    /// end-of-sequence token still fits and the reply ends as `stop`, not `length`.
    budget: usize,
    /// The tokens that can continue from recent states, each with the bytes that finish the
    /// output after it: inside a long string every step is the same state.
    cache: std::collections::HashMap<Cursor, Arc<Vec<(u32, usize)>>>,
}

/// States whose continuations [`JsonConstraint`] keeps (each up to a vocabulary's worth).
const CACHED_STATES: usize = 16;

impl JsonConstraint {
    pub fn new(shape: Shape, vocab: Arc<Vocabulary>, budget: usize) -> JsonConstraint {
        let cursor = shape.start();
        JsonConstraint {
            shape,
            vocab,
            cursor,
            consumed: 0,
            budget,
            cache: std::collections::HashMap::new(),
        }
    }

    /// Tokens allowed next, given that at most `left` more may follow the one picked.
    fn allowed(&mut self, left: usize) -> Vec<u32> {
        let mut out = Vec::new();
        if self.shape.done(&self.cursor) {
            out.extend_from_slice(self.vocab.eos());
        }
        let next = match self.cache.get(&self.cursor) {
            Some(next) => next.clone(),
            None => {
                let next = Arc::new(self.continuations());
                if self.cache.len() >= CACHED_STATES {
                    self.cache.clear();
                }
                self.cache.insert(self.cursor.clone(), next.clone());
                next
            }
        };
        out.extend(
            next.iter()
                .filter(|(_, finish)| *finish <= left)
                .map(|(t, _)| *t),
        );
        out
    }

    /// Every token that can continue the output, with the bytes that finish it after that token.
    fn continuations(&self) -> Vec<(u32, usize)> {
        let mut out = Vec::new();
        // Depth-first over the trie, one cursor per level.
        let mut todo: Vec<(u32, Cursor)> = vec![(0, self.cursor.clone())];
        while let Some((node, cursor)) = todo.pop() {
            for &(b, child) in &self.vocab.children[node as usize] {
                let mut c = cursor.clone();
                if !self.shape.feed(&mut c, b) {
                    continue;
                }
                let ends = &self.vocab.ends[child as usize];
                if !ends.is_empty() {
                    let finish = self.shape.to_finish(&c);
                    out.extend(ends.iter().map(|t| (*t, finish)));
                }
                if !self.vocab.children[child as usize].is_empty() {
                    todo.push((child, c));
                }
            }
        }
        out
    }
}

impl LogitsProcessor for JsonConstraint {
    fn process(&mut self, generated: &[u32], logits: &mut [f32]) -> Result<(), String> {
        for &t in &generated[self.consumed.min(generated.len())..] {
            let bytes = self
                .vocab
                .token_bytes
                .get(t as usize)
                .map(|t| t.bytes.as_slice())
                .unwrap_or_default();
            for &b in bytes {
                if !self.shape.feed(&mut self.cursor, b) {
                    return Err(format!(
                        "constrained decoding: token {t} does not continue the JSON output"
                    ));
                }
            }
        }
        self.consumed = generated.len();
        // After this token: `left` tokens, one of them kept for the end-of-sequence token.
        let left = self.budget.saturating_sub(generated.len() + 2);
        let mut keep = vec![false; logits.len()];
        for id in self.allowed(left) {
            if let Some(k) = keep.get_mut(id as usize) {
                *k = true;
            }
        }
        for (l, k) in logits.iter_mut().zip(keep) {
            if !k {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vocab(tokens: &[&str]) -> Arc<Vocabulary> {
        let bytes: Vec<TokenBytes> = tokens
            .iter()
            .map(|t| TokenBytes {
                bytes: t.as_bytes().to_vec(),
                special: t.starts_with("<|"),
            })
            .collect();
        Arc::new(Vocabulary::new(Arc::new(bytes), vec![0]))
    }

    /// Greedy "generation" over a toy vocabulary whose logits prefer `preferred` tokens:
    /// the constraint must steer it to valid JSON within the budget.
    fn run(shape: Shape, tokens: &[&str], preferred: &[usize], budget: usize) -> String {
        let v = vocab(tokens);
        let mut c = JsonConstraint::new(shape, v, budget);
        let mut generated = Vec::new();
        while generated.len() < budget {
            let mut logits: Vec<f32> = (0..tokens.len())
                .map(|i| {
                    if preferred.contains(&i) {
                        10.0 - i as f32 * 0.01
                    } else {
                        -(i as f32) * 0.001
                    }
                })
                .collect();
            c.process(&generated, &mut logits).expect("process");
            let best = (0..logits.len())
                .max_by(|a, b| logits[*a].total_cmp(&logits[*b]))
                .unwrap_or(0);
            assert!(
                logits[best].is_finite(),
                "no token allowed after {generated:?}"
            );
            if best == 0 {
                break;
            }
            generated.push(best as u32);
        }
        generated.iter().map(|t| tokens[*t as usize]).collect()
    }

    #[test]
    fn budget_forces_the_json_closed() {
        let tokens = [
            "<|end|>",
            "{",
            "}",
            "\"",
            "a",
            "b",
            ":",
            ",",
            "1",
            " ",
            "\"a\"",
            "\"b\":",
            "true",
            "x",
            "<tool_call>",
            "\n",
            "</tool_call>",
            "[",
            "]",
            "null",
        ];
        let schema = json!({"type": "object", "properties": {
            "a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a", "b"]});
        let g = Grammar::compile(&schema).unwrap();
        // The model wants "x" and spaces forever: the budget closes it.
        for budget in [15, 16, 40] {
            let text = run(Shape::json(g.clone()), &tokens, &[13, 9, 4], budget);
            let v: serde_json::Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(v["a"].is_string() && v["b"].is_i64(), "{text}");
        }
        let shape = Shape {
            grammar: Arc::new(g),
            prefix: b"<tool_call>\n".to_vec(),
            suffix: b"\n</tool_call>".to_vec(),
        };
        assert!(shape.min_bytes() > 12);
        let text = run(shape, &tokens, &[13, 4], 30);
        let body = text
            .strip_prefix("<tool_call>\n")
            .and_then(|t| t.strip_suffix("\n</tool_call>"))
            .unwrap_or_else(|| panic!("{text:?}"));
        serde_json::from_str::<serde_json::Value>(body).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        // json_object: any object.
        let text = run(
            Shape::json(Grammar::any_object()),
            &tokens,
            &[17, 19, 9],
            20,
        );
        assert!(
            serde_json::from_str::<serde_json::Value>(&text).is_ok_and(|v| v.is_object()),
            "{text:?}"
        );
    }
}
