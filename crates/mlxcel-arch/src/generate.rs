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
    prefill_chunks(model, tokens, caches, chunk, |input, caches| {
        Ok(model.forward_last(input, caches)?.reshape(&[-1])?)
    })
}

/// What [`prefill`] refuses: an empty prompt, an id outside the vocabulary, chunks of 0.
fn check_prefill(tokens: &[u32], vocab: usize, chunk: Option<usize>) -> Result<()> {
    if tokens.is_empty() {
        return Err(ModelError::Runtime("cannot prefill an empty prompt".into()));
    }
    check_token_ids(tokens, vocab)?;
    if chunk == Some(0) {
        return Err(ModelError::Runtime(
            "prefill chunk = 0: must be at least 1 token".into(),
        ));
    }
    Ok(())
}

/// [`prefill`] with each chunk's pass `forward(ids [1, n], caches)` returning its last
/// position's logits `[vocab]` (evaluated here, per chunk).
fn prefill_chunks(
    model: &dyn LanguageModel,
    tokens: &[u32],
    caches: &mut [LayerCache],
    chunk: Option<usize>,
    mut forward: impl FnMut(&Array, &mut [LayerCache]) -> Result<Array>,
) -> Result<Array> {
    check_prefill(tokens, model.vocab_size(), chunk)?;
    let step = chunk.unwrap_or(tokens.len()).max(1);
    let mut last = None;
    let pieces: Vec<&[u32]> = tokens.chunks(step).collect();
    for (k, piece) in pieces.iter().enumerate() {
        let ids: Vec<i32> = piece.iter().map(|t| *t as i32).collect();
        let input = Array::from_slice(&ids, &[1, ids.len() as i32])?;
        let row = forward(&input, caches)?;
        // Gather-ahead: the next chunk's per-token reads overlap this chunk's compute.
        if let Some(next) = pieces.get(k + 1) {
            model.prefetch(next)?;
        }
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

/// [`check_logits`] of the logits after a `len`-token prompt (generation step 0).
fn check_prompt_logits(logits: &Array, len: usize) -> Result<()> {
    check_logits(logits, || {
        format!("generation step 0 (the logits after the {len}-token prompt)")
    })
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

/// How a [`Session`] keeps snapshots of its recurrent layers' state (state-space mixers), which
/// cannot be cut back to an earlier position like a key/value cache: a later prompt that
/// diverges at token `t` resumes from the last snapshot at or before `t` instead of prefilling
/// from the start. Models without recurrent layers take no snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotPolicy {
    /// A snapshot is taken whenever prefill crosses a multiple of this many positions (the
    /// prefill of a model with recurrent layers is split there, whatever its chunk size).
    pub interval: usize,
    /// At most this many are kept (0: none). When one more is taken, the snapshot closest to
    /// its predecessor is dropped, so they stay spread over the conversation.
    pub max_snapshots: usize,
}

impl Default for SnapshotPolicy {
    /// A snapshot every 256 positions, at most 16 (a few MB of state for a 3B Mamba).
    fn default() -> SnapshotPolicy {
        SnapshotPolicy {
            interval: 256,
            max_snapshots: 16,
        }
    }
}

/// The caches that cannot be cut back after the first `position` tokens: recurrent layers'
/// states and sliding-window rings (a ring has moved past the rows the position needs once
/// its window has; it is as small as a state); `None` for the other layers, which rewind
/// instead.
#[derive(Debug, Clone)]
struct StateSnapshot {
    position: usize,
    states: Vec<Option<LayerCache>>,
}

/// A conversation's model state: the caches and the tokens they hold. A new request reuses the
/// longest common prefix with what the caches hold (rewinding them to the first differing token)
/// instead of starting over. Recurrent layers cannot rewind: for them the session resumes from
/// the last [`SnapshotPolicy`] snapshot within the common prefix (which also holds the models'
/// sliding-window rings). It falls back to a full prefill only when no such point exists (or,
/// in a model without recurrent layers, a ring no longer holds the rows the resumed position
/// needs).
pub struct Session<'m> {
    model: &'m dyn LanguageModel,
    caches: Vec<LayerCache>,
    tokens: Vec<u32>,
    snapshots: Vec<StateSnapshot>,
    policy: SnapshotPolicy,
    /// The checkpoint files the model's weights are mapped from, checked before each request.
    mapped: Option<mlxcel_core::MappedFiles>,
    /// The positions of the images the caches hold, with each image's content hash: part of
    /// the prefix identity (the same image-token ids with another image are not a match).
    image_runs: Vec<(std::ops::Range<usize>, u64)>,
    /// The model's folder, for error messages.
    model_path: Option<String>,
    /// Rotary positions run this far ahead of the cache offset after a multimodal prompt
    /// ([`crate::vision::VisionLanguage::position_delta`]); 0 otherwise.
    position_delta: i64,
}

/// What a [`Session`] holds besides the model: its caches and the tokens they hold. Kept apart
/// from the model so an owner of both (a worker thread serving many conversations of one model)
/// can park a conversation and resume it later with [`Session::resume`].
#[derive(Debug, Clone)]
pub struct SessionState {
    caches: Vec<LayerCache>,
    tokens: Vec<u32>,
    image_runs: Vec<(std::ops::Range<usize>, u64)>,
    position_delta: i64,
    snapshots: Vec<StateSnapshot>,
    policy: SnapshotPolicy,
}

impl SessionState {
    /// Fresh state for `model`.
    pub fn new(model: &dyn LanguageModel) -> SessionState {
        SessionState {
            caches: model.make_caches(),
            tokens: Vec::new(),
            image_runs: Vec::new(),
            position_delta: 0,
            snapshots: Vec::new(),
            policy: SnapshotPolicy::default(),
        }
    }

    /// The tokens the caches hold.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

/// One decode step of several conversations, each its own forward pass (for models that do not
/// batch, see [`DecodeBatch`]): feeds `tokens[i]` to `states[i]` and returns each one's next
/// logits, `[B, vocab]` (row `i` for `states[i]`); each state records its token. On an error
/// the states' caches may be partly extended: discard them.
pub fn step_batch(
    model: &dyn LanguageModel,
    states: &mut [&mut SessionState],
    tokens: &[u32],
) -> Result<Array> {
    check_batch(model, states.len(), tokens)?;
    let mut rows = Vec::with_capacity(states.len());
    for (s, id) in states.iter_mut().zip(tokens) {
        let input = Array::from_slice(&[*id as i32], &[1, 1])?;
        let logits = if s.position_delta == 0 {
            model.forward_last(&input, &mut s.caches)?
        } else {
            let offset = s.caches.first().map_or(0, LayerCache::offset) as i64;
            let position = Array::from_slice(&[(offset + s.position_delta) as i32], &[1])?;
            model.forward_embeddings(&model.embed(&input)?, Some(&position), &mut s.caches, true)?
        };
        rows.push(logits.reshape(&[1, -1])?);
        s.tokens.push(*id);
    }
    Ok(mlxcel_core::ops::concatenate(&rows, 0)?)
}

fn check_batch(model: &dyn LanguageModel, rows: usize, tokens: &[u32]) -> Result<()> {
    if rows != tokens.len() || rows == 0 {
        return Err(ModelError::Runtime(format!(
            "a batched step needs one token per conversation ({} tokens for {rows} conversations)",
            tokens.len(),
        )));
    }
    check_token_ids(tokens, model.vocab_size())
}

/// Several conversations decoded together: their caches merged layer by layer into
/// [`crate::cache::BatchCache`]s, so each [`DecodeBatch::step`] advances all of them by one
/// token in one forward pass — the projections read the weights once for the whole batch
/// (decode is bound by reading them) and attention is one masked kernel per layer. Only for
/// models whose layers all take batches ([`LanguageModel::batched_decode`]); the
/// conversations come back with [`DecodeBatch::into_states`] when the batch changes.
pub struct DecodeBatch {
    states: Vec<SessionState>,
    caches: Vec<LayerCache>,
}

impl std::fmt::Debug for DecodeBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeBatch")
            .field("rows", &self.states.len())
            .finish()
    }
}

impl DecodeBatch {
    /// Merges `states` (each with a prompt already prefilled) into one batch; on an error the
    /// states come back unchanged with it.
    pub fn new(
        model: &dyn LanguageModel,
        states: Vec<SessionState>,
    ) -> std::result::Result<DecodeBatch, (ModelError, Vec<SessionState>)> {
        let merged = (|| {
            if !model.batched_decode() {
                return Err(ModelError::Unsupported(
                    "this model decodes each conversation on its own (no batched decode)".into(),
                ));
            }
            if states.iter().any(|s| s.position_delta != 0) {
                return Err(ModelError::Unsupported(
                    "a conversation whose rotary positions run ahead of its length (a multimodal prompt) decodes on its own".into(),
                ));
            }
            let layers = states.first().map_or(0, |s| s.caches.len());
            (0..layers)
                .map(|l| {
                    let rows: Vec<&LayerCache> = states.iter().map(|s| &s.caches[l]).collect();
                    Ok(LayerCache::Batch(crate::cache::BatchCache::merge(&rows)?))
                })
                .collect::<Result<Vec<_>>>()
        })();
        match merged {
            Ok(mut caches) => {
                crate::cache::BatchCache::share_step_inputs(&mut caches);
                let mut states = states;
                // The merged caches hold the rows now; the states get them back on the split.
                for s in &mut states {
                    s.caches.clear();
                }
                Ok(DecodeBatch { states, caches })
            }
            Err(e) => Err((e, states)),
        }
    }

    /// Conversations in the batch.
    pub fn len(&self) -> usize {
        self.states.len()
    }

    /// Whether the batch holds no conversation.
    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }

    /// The tokens conversation `i` holds (prompt and reply so far).
    pub fn tokens(&self, i: usize) -> &[u32] {
        &self.states[i].tokens
    }

    /// Feeds `tokens[i]` to conversation `i`; returns the next logits `[B, vocab]`. On an error
    /// the caches may be partly extended: discard the batch.
    pub fn step(&mut self, model: &dyn LanguageModel, tokens: &[u32]) -> Result<Array> {
        check_batch(model, self.states.len(), tokens)?;
        let ids: Vec<i32> = tokens.iter().map(|t| *t as i32).collect();
        let input = Array::from_slice(&ids, &[ids.len() as i32, 1])?;
        let logits = model
            .forward_last(&input, &mut self.caches)?
            .reshape(&[ids.len() as i32, -1])?;
        for (s, t) in self.states.iter_mut().zip(tokens) {
            s.tokens.push(*t);
        }
        Ok(logits)
    }

    /// Feeds each conversation the token the device is still computing for it (`ids`, `[B]`
    /// int32, e.g. the argmax of the previous step's logits) and returns the next logits
    /// `[B, vocab]` without waiting: the caller queues this step before reading `ids`, so
    /// building the graph overlaps the device's work. Call [`DecodeBatch::record`] with the
    /// values once read. On an error the caches may be partly extended: discard the batch.
    pub fn step_pending(&mut self, model: &dyn LanguageModel, ids: &Array) -> Result<Array> {
        let rows = self.states.len() as i32;
        if ids.size() != self.states.len() {
            return Err(ModelError::Runtime(format!(
                "a batched step needs one token per conversation ({} tokens for {rows} \
                 conversations)",
                ids.size()
            )));
        }
        let input = ids.reshape(&[rows, 1])?;
        Ok(model
            .forward_last(&input, &mut self.caches)?
            .reshape(&[rows, -1])?)
    }

    /// Records the values of the tokens fed by [`DecodeBatch::step_pending`], one per
    /// conversation.
    pub fn record(&mut self, tokens: &[u32]) {
        for (s, t) in self.states.iter_mut().zip(tokens) {
            s.tokens.push(*t);
        }
    }

    /// The conversations with their own caches again, in batch order.
    pub fn into_states(self) -> Result<Vec<SessionState>> {
        let DecodeBatch { mut states, caches } = self;
        for layer in caches {
            let LayerCache::Batch(b) = layer else {
                return Err(ModelError::Runtime(
                    "internal: a decode batch holds a non-batch cache".into(),
                ));
            };
            for (s, c) in states.iter_mut().zip(b.split()?) {
                s.caches.push(c);
            }
        }
        Ok(states)
    }
}

impl std::fmt::Debug for Session<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("vocab_size", &self.model.vocab_size())
            .field("layers", &self.caches.len())
            .field("tokens", &self.tokens.len())
            .field("snapshots", &self.snapshot_positions())
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
            image_runs: state.image_runs,
            snapshots: state.snapshots,
            policy: state.policy,
            mapped: None,
            model_path: None,
            position_delta: state.position_delta,
        }
    }

    /// Keeps recurrent-state snapshots by `policy` instead of the default (existing snapshots
    /// beyond its `max_snapshots` are dropped).
    pub fn with_snapshots(mut self, policy: SnapshotPolicy) -> Session<'m> {
        self.policy = policy;
        self.thin_snapshots();
        self
    }

    /// The positions of the recurrent-state snapshots held, in order.
    pub fn snapshot_positions(&self) -> Vec<usize> {
        self.snapshots.iter().map(|s| s.position).collect()
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

    /// Names the model's folder in errors (an image sent to a model without a vision tower).
    pub fn with_model_path(mut self, path: impl Into<String>) -> Session<'m> {
        self.model_path = Some(path.into());
        self
    }

    /// Leading positions of `prompt` (whose images fill `runs`, with their hashes) that the
    /// caches hold the same: equal token ids, and at image positions the same image.
    fn common_prefix(&self, prompt: &[u32], runs: &[(std::ops::Range<usize>, u64)]) -> usize {
        let mut common = self
            .tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count();
        for held in &self.image_runs {
            if held.0.start < common && !runs.contains(held) {
                common = held.0.start;
            }
        }
        for new in runs {
            if new.0.start < common && !self.image_runs.contains(new) {
                common = new.0.start;
            }
        }
        common
    }

    /// Makes the caches hold a prompt with images: `prompt` is expanded (each image's run of
    /// the model's image token, see [`crate::vision::MultimodalPrompt`]), `images` in prompt
    /// order. Reuses the cached prefix as far as tokens and images agree; prefills the rest in
    /// chunks of about `chunk` positions that never split an image. Returns the reused count
    /// and the logits after the last prompt token. Without images it is [`Session::prefill`];
    /// with images on a model without a vision tower it is the seed's error
    /// ([`crate::vision::no_vision_tower`]).
    pub fn prefill_multimodal(
        &mut self,
        prompt: &[u32],
        images: &[crate::vision::ImageInput],
        chunk: Option<usize>,
    ) -> Result<(usize, Array)> {
        use crate::vision::{forward_multimodal, FeatureCache, MultimodalPrompt};
        if images.is_empty() {
            return self.prefill(prompt, chunk);
        }
        let model = self.model;
        let vision = model.vision().ok_or_else(|| {
            crate::vision::no_vision_tower(self.model_path.as_deref().unwrap_or("(unnamed)"))
        })?;
        if chunk == Some(0) {
            return Err(ModelError::Runtime(
                "prefill chunk = 0: must be at least 1 token".into(),
            ));
        }
        check_token_ids(
            &prompt
                .iter()
                .copied()
                .filter(|t| *t != vision.image_token_id())
                .collect::<Vec<_>>(),
            model.vocab_size(),
        )?;
        let mm = MultimodalPrompt::new(vision, prompt, images)?;
        let runs: Vec<(std::ops::Range<usize>, u64)> = mm
            .runs()
            .iter()
            .cloned()
            .zip(images.iter().map(|i| i.hash()))
            .collect();
        let reuse = self.resume_point(prompt, &runs)?;
        let mut features = FeatureCache::default();
        let mut start = reuse;
        let mut last = None;
        for end in mm.chunk_ends(reuse, chunk) {
            let logits = forward_multimodal(
                vision,
                &mm,
                start..end,
                &mut features,
                &mut self.caches,
                true,
            )?
            .reshape(&[-1])?;
            logits.eval()?;
            last = Some(logits);
            start = end;
        }
        let logits =
            last.ok_or_else(|| ModelError::Runtime("cannot prefill an empty prompt".into()))?;
        check_prompt_logits(&logits, prompt.len())?;
        self.tokens.extend_from_slice(&prompt[reuse..]);
        self.image_runs = runs;
        self.position_delta = vision.position_delta(&mm)?;
        Ok((reuse, logits))
    }

    /// Parks the conversation (see [`Session::resume`]).
    pub fn into_state(self) -> SessionState {
        SessionState {
            caches: self.caches,
            tokens: self.tokens,
            image_runs: self.image_runs,
            position_delta: self.position_delta,
            snapshots: self.snapshots,
            policy: self.policy,
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
        let reuse = self.resume_point(prompt, &[])?;
        // No image is held before `reuse` (the common prefix stops at the first), so text
        // positions are the cache offsets again.
        self.position_delta = 0;
        let logits = self.prefill_with_snapshots(&prompt[reuse..], reuse, chunk)?;
        check_prompt_logits(&logits, prompt.len())?;
        self.tokens.extend_from_slice(&prompt[reuse..]);
        Ok((reuse, logits))
    }

    /// Puts the caches back to the longest prefix of `prompt` they can continue from: the
    /// tokens (and, with `runs`, the images) they share with it, but never its last token,
    /// whose logits start the reply. Rewound where every cache can, else from a snapshot (or
    /// from scratch); the tokens, snapshots and image runs past it are forgotten. Returns its
    /// length.
    fn resume_point(
        &mut self,
        prompt: &[u32],
        runs: &[(std::ops::Range<usize>, u64)],
    ) -> Result<usize> {
        let mut reuse = self.reusable_prefix(prompt, runs);
        if reuse > 0 && self.caches.iter().all(|c| c.can_rewind(reuse)) {
            for c in &mut self.caches {
                c.rewind(reuse)?;
            }
        } else {
            reuse = self.restore_snapshot(reuse)?;
        }
        self.forget_after(reuse);
        Ok(reuse)
    }

    /// How much of `prompt` the held tokens (and, with `runs`, images) share, but never its
    /// last token: that one is always fed, its logits start the reply.
    fn reusable_prefix(&self, prompt: &[u32], runs: &[(std::ops::Range<usize>, u64)]) -> usize {
        self.common_prefix(prompt, runs)
            .min(prompt.len().saturating_sub(1))
    }

    /// Forgets the tokens past the first `len`, with the snapshots and image runs that hold
    /// any of them (the caches are cut back by the caller).
    fn forget_after(&mut self, len: usize) {
        self.tokens.truncate(len);
        self.snapshots.retain(|s| s.position <= len);
        self.image_runs.retain(|r| r.0.end <= len);
    }

    /// Puts the caches back to the last snapshot at or before `position` whose position every
    /// non-recurrent cache can still rewind to; returns the position resumed from (0, with
    /// fresh caches, when there is none).
    fn restore_snapshot(&mut self, position: usize) -> Result<usize> {
        let usable = self.snapshots.iter().rev().find(|s| {
            s.position > 0
                && s.position <= position
                && self
                    .caches
                    .iter()
                    .zip(&s.states)
                    .all(|(c, state)| match state {
                        Some(_) => c.can_restore(s.position),
                        None => c.can_rewind(s.position),
                    })
        });
        let Some(snapshot) = usable.cloned() else {
            self.caches = self.model.make_caches();
            return Ok(0);
        };
        for (cache, state) in self.caches.iter_mut().zip(snapshot.states) {
            match state {
                Some(state) => cache.restore(state, snapshot.position)?,
                None => cache.rewind(snapshot.position)?,
            }
        }
        Ok(snapshot.position)
    }

    /// Prefills `tokens` (continuing at position `start`) in chunks of `chunk`. With recurrent
    /// layers and snapshots on, the prompt is also split at every multiple of the snapshot
    /// interval, where the recurrent layers' state is kept.
    fn prefill_with_snapshots(
        &mut self,
        tokens: &[u32],
        start: usize,
        chunk: Option<usize>,
    ) -> Result<Array> {
        let recurrent = self.caches.iter().any(LayerCache::is_recurrent);
        let interval = self.policy.interval;
        if !recurrent || self.policy.max_snapshots == 0 || interval == 0 {
            return prefill(self.model, tokens, &mut self.caches, chunk);
        }
        let mut pos = start;
        let mut last = None;
        let mut rest = tokens;
        while !rest.is_empty() {
            let boundary = (pos / interval + 1) * interval;
            let (piece, tail) = rest.split_at((boundary - pos).min(rest.len()));
            last = Some(prefill(self.model, piece, &mut self.caches, chunk)?);
            pos += piece.len();
            rest = tail;
            if pos == boundary {
                self.take_snapshot(pos)?;
            }
        }
        last.ok_or_else(|| ModelError::Runtime("cannot prefill an empty prompt".into()))
    }

    /// Records the recurrent layers' state (and the sliding-window rings) after `position`
    /// tokens.
    fn take_snapshot(&mut self, position: usize) -> Result<()> {
        let states: Vec<Option<LayerCache>> =
            self.caches.iter().map(LayerCache::snapshot).collect();
        // Evaluated now, so a snapshot holds its arrays and not the graph that made them.
        let arrays: Vec<&Array> = states
            .iter()
            .flatten()
            .flat_map(LayerCache::planes)
            .collect();
        mlxcel_core::ops::eval_all(arrays)?;
        self.snapshots.retain(|s| s.position != position);
        self.snapshots.push(StateSnapshot { position, states });
        self.snapshots.sort_by_key(|s| s.position);
        self.thin_snapshots();
        Ok(())
    }

    /// Drops snapshots beyond the policy's maximum, each time the one closest to its
    /// predecessor (the newest is always kept).
    fn thin_snapshots(&mut self) {
        while self.snapshots.len() > self.policy.max_snapshots {
            let n = self.snapshots.len();
            let closest = (0..n.saturating_sub(1))
                .min_by_key(|&i| {
                    let before = if i == 0 {
                        0
                    } else {
                        self.snapshots[i - 1].position
                    };
                    self.snapshots[i].position - before
                })
                .unwrap_or(0);
            self.snapshots.remove(closest);
        }
    }

    /// Feeds a token the device is still computing (`[1, 1]` int32) and returns the next
    /// logits `[vocab]` without waiting for either: the caller queues the following step before
    /// reading this token, so building the graph overlaps the device's work. Call
    /// [`Session::record_token`] with the token's value once read.
    pub fn step_pending(&mut self, token: &Array) -> Result<Array> {
        self.forward_token(token)
    }

    /// One token `[1, 1]` through the model: logits `[vocab]`. After a multimodal prompt whose
    /// positions run ahead of the cache ([`Session::prefill_multimodal`]), at the explicit
    /// position `offset + delta`.
    fn forward_token(&mut self, token: &Array) -> Result<Array> {
        let logits = if self.position_delta == 0 {
            self.model.forward_last(token, &mut self.caches)?
        } else {
            let offset = self.caches.first().map_or(0, LayerCache::offset) as i64;
            let position = Array::from_slice(&[(offset + self.position_delta) as i32], &[1])?;
            self.model.forward_embeddings(
                &self.model.embed(token)?,
                Some(&position),
                &mut self.caches,
                true,
            )?
        };
        Ok(logits.reshape(&[-1])?)
    }

    /// The model's vocabulary size (rows of its output head).
    pub fn vocab_size(&self) -> usize {
        self.model.vocab_size()
    }

    /// Whether `extra` more positions could be fed and then taken back
    /// ([`Session::truncate`]): every cache can ([`LayerCache::can_take_back`]) and positions
    /// are the cache offsets (no image has moved them). Speculative decoding feeds draft tokens
    /// only when this holds.
    pub fn can_speculate(&self, extra: usize) -> bool {
        self.position_delta == 0 && self.caches.iter().all(|c| c.can_take_back(extra))
    }

    /// Feeds `tokens` (`[1, n]` int32, possibly still being computed) in one forward pass and
    /// returns the logits after each of them, `[n, vocab]`, unevaluated: how speculative
    /// decoding checks a draft's tokens in one pass. Record their values with
    /// [`Session::record_tokens`] once read.
    pub fn feed_pending(&mut self, tokens: &Array) -> Result<Array> {
        let n = tokens.dim(1)?;
        let logits = self.model.forward(tokens, &mut self.caches)?;
        Ok(logits.reshape(&[n, -1])?)
    }

    /// Makes the caches hold `context` and returns the logits after its last token, `[vocab]`,
    /// unevaluated when it can: the held prefix is kept, the caches are cut back to it and the
    /// rest is fed in one pass (a draft model catching up with the tokens the model kept). When
    /// the caches cannot be cut back there it is [`Session::prefill`] (evaluated).
    pub fn catch_up(&mut self, context: &[u32]) -> Result<Array> {
        let common = self.reusable_prefix(context, &[]);
        if context.is_empty() || !self.caches.iter().all(|c| c.can_rewind(common)) {
            return Ok(self.prefill(context, None)?.1);
        }
        check_token_ids(&context[common..], self.model.vocab_size())?;
        self.truncate(common)?;
        let rest: Vec<i32> = context[common..].iter().map(|t| *t as i32).collect();
        let ids = Array::from_slice(&rest, &[1, rest.len() as i32])?;
        let logits = self.model.forward_last(&ids, &mut self.caches)?;
        self.tokens.extend_from_slice(&context[common..]);
        Ok(logits.reshape(&[-1])?)
    }

    /// The model this conversation runs.
    pub fn model(&self) -> &'m dyn LanguageModel {
        self.model
    }

    fn mtp(&self) -> Result<&'m dyn crate::model::MultiTokenPrediction> {
        self.model.mtp().ok_or_else(|| {
            ModelError::Unsupported(
                "this model was loaded without multi-token-prediction layers".into(),
            )
        })
    }

    /// [`Session::prefill`] that also returns the hidden states after the final norm of the
    /// prompt positions it fed (`[1, fed, hidden]`: those past the reused prefix), which the
    /// model's multi-token-prediction layers read. Models with recurrent layers are refused
    /// (multi-token prediction speculates, and their state cannot be taken back).
    pub fn prefill_with_hidden(
        &mut self,
        prompt: &[u32],
        chunk: Option<usize>,
    ) -> Result<(usize, Array, Array)> {
        let mtp = self.mtp()?;
        // Refused before the caches are touched.
        check_prefill(prompt, self.model.vocab_size(), chunk)?;
        if self.caches.iter().any(LayerCache::is_recurrent) {
            return Err(ModelError::Unsupported(
                "multi-token prediction of a model with recurrent layers".into(),
            ));
        }
        let reuse = self.resume_point(prompt, &[])?;
        self.position_delta = 0;
        let rest = &prompt[reuse..];
        let mut hidden = Vec::new();
        let logits = prefill_chunks(
            self.model,
            rest,
            &mut self.caches,
            chunk,
            |input, caches| {
                let (logits, h) = mtp.forward_with_hidden(input, caches, true)?;
                // Evaluated with the chunk's logits, so the graph stays bounded by one chunk.
                let row = logits.reshape(&[-1])?;
                mlxcel_core::ops::eval_all([&row, &h])?;
                hidden.push(h);
                Ok(row)
            },
        )?;
        check_prompt_logits(&logits, prompt.len())?;
        self.tokens.extend_from_slice(rest);
        Ok((reuse, logits, mlxcel_core::ops::concatenate(&hidden, 1)?))
    }

    /// [`Session::feed_pending`] that also returns the hidden states after the final norm,
    /// `[1, n, hidden]`: how self-speculative decoding checks the drafts of the model's
    /// multi-token-prediction layers and gets what they read next.
    pub fn feed_pending_with_hidden(&mut self, tokens: &Array) -> Result<(Array, Array)> {
        let mtp = self.mtp()?;
        let n = tokens.dim(1)?;
        let (logits, hidden) = mtp.forward_with_hidden(tokens, &mut self.caches, false)?;
        Ok((logits.reshape(&[n, -1])?, hidden))
    }

    /// Records the values of tokens fed by [`Session::feed_pending`].
    pub fn record_tokens(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
    }

    /// Takes back every token after the first `len` (caches and tokens): the draft tokens
    /// verification rejected. An error, changing nothing, when a cache cannot be cut back there
    /// (see [`Session::can_speculate`]).
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.tokens.len() {
            return Err(ModelError::Runtime(format!(
                "cannot cut a conversation of {} tokens back to {len}",
                self.tokens.len()
            )));
        }
        if let Some(c) = self.caches.iter().find(|c| !c.can_rewind(len)) {
            return Err(ModelError::Runtime(format!(
                "cannot take the conversation back to {len} tokens: a {} cache at position {} rewinds no further than {}",
                c.kind_name(),
                c.offset(),
                c.rewind_floor()
            )));
        }
        for c in &mut self.caches {
            c.rewind(len)?;
        }
        self.forget_after(len);
        Ok(())
    }

    /// Records the value of a token fed by [`Session::step_pending`].
    pub fn record_token(&mut self, token: u32) {
        self.record_tokens(&[token]);
    }

    /// Feeds one generated token; returns the logits for the next.
    pub fn step(&mut self, token: u32) -> Result<Array> {
        check_token_ids(&[token], self.model.vocab_size())?;
        let logits = self.forward_token(&Array::from_slice(&[token as i32], &[1, 1])?)?;
        logits.eval()?;
        let position = self.tokens.len();
        check_logits(&logits, || {
            format!("position {position} (after token {token})")
        })?;
        self.tokens.push(token);
        Ok(logits)
    }
}
