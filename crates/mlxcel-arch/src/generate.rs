//! Token generation over a [`LanguageModel`]: prefill (whole or in chunks) and greedy decoding.

use mlxcel_core::{Array, Dtype};

use crate::cache::LayerCache;
use crate::model::LanguageModel;
use crate::{ModelError, Result};

/// Runs `tokens` through the model in chunks of `chunk` positions (all at once when `None`),
/// extending `caches`; returns the logits of the last position `[vocab]`.
pub fn prefill(
    model: &dyn LanguageModel,
    tokens: &[u32],
    caches: &mut [LayerCache],
    chunk: Option<usize>,
) -> Result<Array> {
    if tokens.is_empty() {
        return Err(ModelError::Runtime("cannot prefill an empty prompt".into()));
    }
    check_token_ids(tokens, model.vocab_size())?;
    if chunk == Some(0) {
        return Err(ModelError::Runtime(
            "prefill chunk = 0: must be at least 1 token".into(),
        ));
    }
    let step = chunk.unwrap_or(tokens.len()).max(1);
    let mut last = None;
    for piece in tokens.chunks(step) {
        let ids: Vec<i32> = piece.iter().map(|t| *t as i32).collect();
        let input = Array::from_slice(&ids, &[1, ids.len() as i32])?;
        let row = model.forward_last(&input, caches)?.reshape(&[-1])?;
        // Evaluate per chunk so the graph (and memory) stays bounded by one chunk.
        row.eval()?;
        last = Some(row);
    }
    last.ok_or_else(|| ModelError::Runtime("cannot prefill an empty prompt".into()))
}

/// An error naming the first id at or above the vocabulary size (an out-of-range id would read
/// outside the embedding table).
pub fn check_token_ids(tokens: &[u32], vocab: usize) -> Result<()> {
    match tokens.iter().position(|&t| t as usize >= vocab) {
        Some(i) => Err(ModelError::Runtime(format!(
            "token id {} at position {i} is outside the vocabulary (size {vocab})",
            tokens[i]
        ))),
        None => Ok(()),
    }
}

/// An error naming `at` when `logits` hold a NaN (one reduction, read as a scalar): a NaN in a
/// weight or an overflow would otherwise decode as token 0 forever.
pub fn check_logits(logits: &Array, at: impl FnOnce() -> String) -> Result<()> {
    let nan = logits
        .reshape(&[-1])?
        .isnan()?
        .any(&[0], false)?
        .astype(Dtype::Int32)?;
    if nan.to_vec::<i32>()?.first().copied().unwrap_or(0) != 0 {
        return Err(ModelError::Runtime(format!(
            "the model produced NaN logits at {}: the checkpoint's weights (or the config's scales) give non-finite activations",
            at()
        )));
    }
    Ok(())
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
    for step in 0..max_new {
        check_logits(&logits, || format!("generation step {step}"))?;
        let token = argmax_token(&logits)?;
        out.push(token);
        if stop(token) || out.len() == max_new {
            break;
        }
        logits = prefill(model, &[token], &mut caches, None)?;
    }
    Ok(out)
}

/// A conversation's model state: the caches and the tokens they hold. A new request reuses the
/// longest common prefix with what the caches hold (rewinding them to the first differing token)
/// instead of starting over, and falls back to a full prefill only when a sliding-window ring no
/// longer holds the rows the resumed position needs.
pub struct Session<'m> {
    model: &'m dyn LanguageModel,
    caches: Vec<LayerCache>,
    tokens: Vec<u32>,
    /// The checkpoint files the model's weights are mapped from, checked before each request.
    mapped: Option<mlxcel_core::MappedFiles>,
}

/// What a [`Session`] holds besides the model: its caches and the tokens they hold. Kept apart
/// from the model so an owner of both (a worker thread serving many conversations of one model)
/// can park a conversation and resume it later with [`Session::resume`].
#[derive(Debug, Clone)]
pub struct SessionState {
    caches: Vec<LayerCache>,
    tokens: Vec<u32>,
}

impl SessionState {
    /// Fresh state for `model`.
    pub fn new(model: &dyn LanguageModel) -> SessionState {
        SessionState {
            caches: model.make_caches(),
            tokens: Vec::new(),
        }
    }

    /// The tokens the caches hold.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

impl std::fmt::Debug for Session<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("vocab_size", &self.model.vocab_size())
            .field("layers", &self.caches.len())
            .field("tokens", &self.tokens.len())
            .field("mapped_files", &self.mapped.is_some())
            .finish()
    }
}

impl<'m> Session<'m> {
    /// A fresh conversation of `model`: empty caches, no tokens.
    pub fn new(model: &'m dyn LanguageModel) -> Session<'m> {
        Session::resume(model, SessionState::new(model))
    }

    /// Continues a conversation of `model` from a parked state (which must come from the
    /// same model).
    pub fn resume(model: &'m dyn LanguageModel, state: SessionState) -> Session<'m> {
        Session {
            model,
            caches: state.caches,
            tokens: state.tokens,
            mapped: None,
        }
    }

    /// Checks `files` (the mapped checkpoint) are unchanged before each request
    /// ([`Session::check_files`]).
    pub fn with_mapped_files(mut self, files: mlxcel_core::MappedFiles) -> Session<'m> {
        self.mapped = Some(files);
        self
    }

    /// An error naming a mapped checkpoint file that was modified, truncated or replaced since
    /// the model was loaded (reading its pages could fault); see
    /// [`mlxcel_core::MappedFiles`] for the window this leaves.
    pub fn check_files(&self) -> Result<()> {
        match &self.mapped {
            Some(files) => Ok(files.check_unchanged()?),
            None => Ok(()),
        }
    }

    /// Parks the conversation (see [`Session::resume`]).
    pub fn into_state(self) -> SessionState {
        SessionState {
            caches: self.caches,
            tokens: self.tokens,
        }
    }

    /// The tokens whose keys and values the caches hold.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The per-layer caches, one per layer of the model.
    pub fn caches(&self) -> &[LayerCache] {
        &self.caches
    }

    /// Makes the caches hold `prompt`; returns how many leading tokens were reused and the
    /// logits after the last prompt token.
    pub fn prefill(&mut self, prompt: &[u32], chunk: Option<usize>) -> Result<(usize, Array)> {
        let common = self
            .tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count();
        // At least the last prompt token is recomputed: its logits start the reply.
        let mut reuse = common.min(prompt.len().saturating_sub(1));
        if reuse > 0 && self.caches.iter().all(|c| c.can_rewind(reuse)) {
            for c in &mut self.caches {
                c.rewind(reuse)?;
            }
        } else {
            reuse = 0;
            self.caches = self.model.make_caches();
        }
        self.tokens.truncate(reuse);
        let logits = prefill(self.model, &prompt[reuse..], &mut self.caches, chunk)?;
        check_logits(&logits, || {
            format!(
                "generation step 0 (the logits after the {}-token prompt)",
                prompt.len()
            )
        })?;
        self.tokens.extend_from_slice(&prompt[reuse..]);
        Ok((reuse, logits))
    }

    /// Feeds a token the device is still computing (`[1, 1]` int32) and returns the next
    /// logits `[vocab]` without waiting for either: the caller queues the following step before
    /// reading this token, so building the graph overlaps the device's work. Call
    /// [`Session::record_token`] with the token's value once read.
    pub fn step_pending(&mut self, token: &Array) -> Result<Array> {
        Ok(self
            .model
            .forward_last(token, &mut self.caches)?
            .reshape(&[-1])?)
    }

    /// Records the value of a token fed by [`Session::step_pending`].
    pub fn record_token(&mut self, token: u32) {
        self.tokens.push(token);
    }

    /// Feeds one generated token; returns the logits for the next.
    pub fn step(&mut self, token: u32) -> Result<Array> {
        let logits = prefill(self.model, &[token], &mut self.caches, None)?;
        let position = self.tokens.len();
        check_logits(&logits, || {
            format!("position {position} (after token {token})")
        })?;
        self.tokens.push(token);
        Ok(logits)
    }
}
