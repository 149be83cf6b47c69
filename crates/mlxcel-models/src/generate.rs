//! Token generation over a [`LanguageModel`]: prefill (whole or in chunks) and greedy decoding.

use mlxcel_core::{Array, Dtype};

use crate::cache::KvCache;
use crate::model::LanguageModel;
use crate::{ModelError, Result};

/// Runs `tokens` through the model in chunks of `chunk` positions (all at once when `None`),
/// extending `caches`; returns the logits of the last position `[vocab]`.
pub fn prefill(
    model: &dyn LanguageModel,
    tokens: &[u32],
    caches: &mut [KvCache],
    chunk: Option<usize>,
) -> Result<Array> {
    if tokens.is_empty() {
        return Err(ModelError::Config("cannot prefill an empty prompt".into()));
    }
    let step = chunk.unwrap_or(tokens.len()).max(1);
    let mut last = None;
    for piece in tokens.chunks(step) {
        let ids: Vec<i32> = piece.iter().map(|t| *t as i32).collect();
        let input = Array::from_slice(&ids, &[1, ids.len() as i32])?;
        let logits = model.forward(&input, caches)?;
        let n = logits.dim(1)?;
        let row = logits.slice_axis(1, n - 1, n)?.reshape(&[-1])?;
        // Evaluate per chunk so the graph (and memory) stays bounded by one chunk.
        row.eval()?;
        last = Some(row);
    }
    last.ok_or_else(|| ModelError::Config("empty prompt".into()))
}

/// The index of the largest logit.
pub fn argmax_token(logits: &Array) -> Result<u32> {
    let idx = logits.argmax(-1, false)?.astype(Dtype::Uint32)?;
    Ok(idx.to_vec::<u32>()?[0])
}

/// Greedy continuation of `prompt`: `max_new` tokens (fewer if `stop` returns true for one).
pub fn greedy(
    model: &dyn LanguageModel,
    prompt: &[u32],
    max_new: usize,
    chunk: Option<usize>,
    stop: impl Fn(u32) -> bool,
) -> Result<Vec<u32>> {
    let mut caches = model.make_caches();
    let mut logits = prefill(model, prompt, &mut caches, chunk)?;
    let mut out = Vec::with_capacity(max_new);
    for _ in 0..max_new {
        let token = argmax_token(&logits)?;
        out.push(token);
        if stop(token) || out.len() == max_new {
            break;
        }
        logits = prefill(model, &[token], &mut caches, None)?;
    }
    Ok(out)
}
