//! Text generation: a tokenized prompt through a [`Session`], sampled token by token, streamed
//! as text that never splits a UTF-8 character, stopped at EOS ids, stop strings or a length.

use std::time::Instant;

use mlxcel_arch::generate::Session;
use mlxcel_arch::sampling::{Sampler, SamplingParams};
use mlxcel_core::{Array, Dtype};

use crate::tokenizer::{DecodeProgress, Tokenizer};
use crate::Result;

/// What to generate. The default generates up to [`GenerateRequest::DEFAULT_MAX_NEW_TOKENS`]
/// greedy tokens and knows no end-of-sequence ids: take those from the model with
/// [`GenerateRequest::for_model`].
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Most tokens to generate (EOS excluded).
    pub max_new_tokens: usize,
    /// Temperature, top-k/p, min-p, repetition penalty and seed; the default is greedy.
    pub sampling: SamplingParams,
    /// Generation ends before the first occurrence of any of these in the output.
    pub stop: Vec<String>,
    /// Generation ends at any of these tokens (not emitted).
    pub eos_token_ids: Vec<u32>,
    /// Prefill the prompt in chunks of this many positions (bounds prefill memory); `None`:
    /// all at once. Must be positive.
    pub prefill_chunk: Option<usize>,
    /// Set from another thread to stop generation after the current token
    /// ([`FinishReason::Cancelled`]).
    pub cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// Keep special tokens in the text (a harmony-format reply's channel markup, which a
    /// reader then parses); by default they are left out.
    pub keep_special_tokens: bool,
    /// The prompt's images' inputs, in order ([`crate::vision::PreparedImage::inputs`]); the prompt must
    /// be expanded ([`crate::Loaded::expand_image_tokens_for`]). Empty for text.
    pub images: Vec<mlxcel_arch::vision::ImageInput>,
}

impl GenerateRequest {
    /// The token budget of [`GenerateRequest::default`].
    pub const DEFAULT_MAX_NEW_TOKENS: usize = 256;

    /// Greedy generation stopping at `loaded`'s end-of-sequence ids.
    pub fn for_model(loaded: &crate::Loaded) -> GenerateRequest {
        GenerateRequest {
            eos_token_ids: loaded.eos_token_ids.clone(),
            ..GenerateRequest::default()
        }
    }

    /// Checks the request's ranges (sampling parameters, a positive prefill chunk); the error
    /// names the parameter and its value.
    pub fn validate(&self) -> Result<()> {
        let invalid = |m: String| crate::LoadError::from(mlxcel_arch::ModelError::Runtime(m));
        self.sampling
            .validate()
            .map_err(|e| invalid(e.to_string()))?;
        if self.prefill_chunk == Some(0) {
            return Err(invalid(
                "prefill_chunk = 0: must be at least 1 token".to_string(),
            ));
        }
        Ok(())
    }
}

impl Default for GenerateRequest {
    fn default() -> Self {
        GenerateRequest {
            max_new_tokens: Self::DEFAULT_MAX_NEW_TOKENS,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            eos_token_ids: Vec::new(),
            prefill_chunk: None,
            cancel: None,
            keep_special_tokens: false,
            images: Vec::new(),
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token (not emitted).
    Eos,
    /// A stop string (not emitted).
    Stop,
    /// `max_new_tokens` were generated.
    Length,
    /// The request's cancel flag was set.
    Cancelled,
}

/// Measurements of one generation.
#[derive(Debug, Clone)]
pub struct GenerationStats {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Leading prompt tokens served from the caches of the previous turn.
    pub reused_tokens: usize,
    /// Time to prefill the prompt (the non-reused part) and produce the first logits.
    pub prefill_seconds: f64,
    /// Tokens generated (EOS excluded).
    pub generated_tokens: usize,
    /// Time spent decoding after prefill.
    pub decode_seconds: f64,
    /// Part of `decode_seconds` the host spent building step graphs (greedy decoding).
    pub decode_graph_seconds: f64,
    /// Part of `decode_seconds` spent in MLX's `async_eval` of each step: encoding its
    /// kernels, and waiting whenever MLX throttles the host to the device's pace.
    pub decode_dispatch_seconds: f64,
    /// Arrays of each primitive kind in one queued decode step (greedy decoding), most frequent
    /// first: MLX spends host time on every one, so on a GPU this count sets decode speed.
    pub decode_step_census: Vec<(String, usize)>,
    /// Why generation ended.
    pub finish: FinishReason,
    /// How speculative decoding went, when a draft model proposed tokens
    /// ([`crate::speculative::generate_text_speculative`]).
    pub speculation: Option<SpeculationStats>,
}

/// Speculative decoding's measurements: each round the draft model proposes up to its token
/// budget, the model checks them in one pass and keeps the longest prefix it agrees with, plus
/// one token of its own.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpeculationStats {
    /// Verification passes of the model (each yields at least one token).
    pub rounds: usize,
    /// Tokens the draft proposed.
    pub proposed: usize,
    /// Proposed tokens the model agreed with (and kept).
    pub accepted: usize,
    /// Host time building the rounds' graphs: the draft's proposal steps and the model's
    /// checking pass, queued without being evaluated.
    pub build_seconds: f64,
    /// Time evaluating them until the picks are on the host: the draft's and the model's work
    /// on the device, and the wait for it. The rest of decode time is emitting tokens and
    /// bookkeeping.
    pub eval_seconds: f64,
}

impl SpeculationStats {
    /// Share of proposed tokens kept (0 when none were proposed).
    pub fn acceptance_rate(&self) -> f64 {
        self.accepted as f64 / self.proposed.max(1) as f64
    }

    /// Tokens each verification pass yielded on average (kept proposals plus the model's own).
    pub fn tokens_per_round(&self) -> f64 {
        (self.accepted + self.rounds) as f64 / self.rounds.max(1) as f64
    }
}

impl GenerationStats {
    /// Prefilled (non-reused) prompt tokens per second.
    pub fn prefill_tokens_per_second(&self) -> f64 {
        (self.prompt_tokens - self.reused_tokens) as f64 / self.prefill_seconds.max(1e-9)
    }

    /// Tokens after the first, over the time after the first (the first comes from prefill).
    pub fn decode_tokens_per_second(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode_seconds.max(1e-9)
    }
}

/// Holds back output that might be the start of a stop string.
#[derive(Debug)]
struct StopFilter {
    stops: Vec<String>,
    pending: String,
}

impl StopFilter {
    /// Adds text; returns what can be released and whether a stop string was hit.
    fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Keep the longest tail that is a proper prefix of a stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|n| s.is_char_boundary(*n))
                    .map(move |n| &s[..n])
            })
            .filter(|p| self.pending.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }
}

pub(crate) fn nan_error(step: usize) -> crate::LoadError {
    crate::LoadError::from(mlxcel_arch::ModelError::Runtime(format!(
        "the model produced NaN logits at generation step {step}: the checkpoint's weights (or the config's scales) give non-finite activations"
    )))
}

/// Changes each step's logits before the next token is picked: constrained decoding (a
/// grammar's token mask), logit biases. It runs on the thread that generates.
pub trait LogitsProcessor: Send {
    /// `generated`: the tokens this generation has produced so far; `logits`: the next token's
    /// logits (one per vocabulary id, float32), changed in place (`f32::NEG_INFINITY` forbids a
    /// token). An error ends the generation with that message.
    fn process(&mut self, generated: &[u32], logits: &mut [f32])
        -> std::result::Result<(), String>;
}

/// A generated token's log-probability and the most likely alternatives at its step.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token picked.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens at this step with their log-probabilities, most likely first
    /// ([`StepHooks::logprobs`] of them).
    pub top: Vec<(u32, f32)>,
}

/// Optional work at each generation step ([`generate_text_with`]). The default does nothing and
/// costs nothing: without hooks greedy decoding stays on the device.
#[derive(Default)]
pub struct StepHooks<'a> {
    /// Report each token's log-probability with this many top alternatives (`Some(0)`: only
    /// the token's own). Log-probabilities are the log-softmax of the logits the token was
    /// picked from, after the [`StepHooks::processor`] and before the sampler's own
    /// transformations (temperature, top-k/p, repetition penalty).
    pub logprobs: Option<usize>,
    /// Changes the logits before each pick.
    pub processor: Option<&'a mut dyn LogitsProcessor>,
}

impl StepHooks<'_> {
    fn active(&self) -> bool {
        self.logprobs.is_some() || self.processor.is_some()
    }
}

/// Log-softmax of `row` at `token`, and the `top` most likely ids with theirs.
fn logprobs(row: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row
        .iter()
        .filter(|v| v.is_finite())
        .map(|v| f64::from(v - max).exp())
        .sum();
    let log_z = f64::from(max) + sum.ln();
    let lp = |v: f32| (f64::from(v) - log_z) as f32;
    let mut best: Vec<(u32, f32)> = Vec::new();
    if top > 0 && !row.is_empty() {
        let mut order: Vec<u32> = (0..row.len() as u32).collect();
        let k = top.min(order.len());
        order.select_nth_unstable_by(k.saturating_sub(1), |a, b| {
            row[*b as usize].total_cmp(&row[*a as usize])
        });
        order.truncate(k);
        order.sort_by(|a, b| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b)));
        best = order
            .into_iter()
            .map(|i| (i, lp(row[i as usize])))
            .collect();
    }
    TokenLogprob {
        token,
        logprob: row
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |v| lp(*v)),
        top: best,
    }
}

/// Generates a reply to `prompt` (token ids) in `session`, calling `on_text` with each piece of
/// text as it becomes final and `on_token` with each generated id. Returns the generated ids
/// (without EOS) and the measurements.
pub fn generate_text(
    session: &mut Session<'_>,
    tokenizer: Option<&Tokenizer>,
    prompt: &[u32],
    request: &GenerateRequest,
    on_text: impl FnMut(&str),
    mut on_token: impl FnMut(u32),
) -> Result<(Vec<u32>, GenerationStats)> {
    generate_text_with(
        session,
        tokenizer,
        prompt,
        request,
        StepHooks::default(),
        on_text,
        |token, _| on_token(token),
    )
}

/// One generation between its steps: sampler, detokenisation, stop strings, the tokens so far
/// and the measurements. [`generate_text_with`] drives one from prefill to the end; a scheduler
/// serving several conversations keeps one per conversation and feeds each the logits of a
/// batched step ([`mlxcel_arch::generate::step_batch`]): [`GenerationProgress::pick`] a token,
/// [`GenerationProgress::emit`] it, and once it says the generation is over,
/// [`GenerationProgress::finish`].
#[derive(Debug)]
pub struct GenerationProgress {
    pub(crate) request: GenerateRequest,
    sampler: Sampler,
    text: Option<DecodeProgress>,
    stop: StopFilter,
    pub(crate) generated: Vec<u32>,
    finish: FinishReason,
    prompt_tokens: usize,
    reused_tokens: usize,
    pub(crate) prefill_seconds: f64,
    pub(crate) decode_start: Instant,
    graph_seconds: f64,
    dispatch_seconds: f64,
    census: Vec<(String, usize)>,
    pub(crate) speculation: Option<SpeculationStats>,
}

impl GenerationProgress {
    /// Prefills `prompt` in `session` (reusing the prefix its caches hold); returns the
    /// generation and the logits of its first token. `with_text`: detokenise the output (the
    /// tokenizer then comes with each [`GenerationProgress::emit`]).
    pub fn start(
        session: &mut Session<'_>,
        prompt: &[u32],
        request: GenerateRequest,
        with_text: bool,
    ) -> Result<(GenerationProgress, Array)> {
        let images = request.images.clone();
        GenerationProgress::start_with(session, prompt, request, with_text, |s, p, chunk| {
            Ok(s.prefill_multimodal(p, &images, chunk)?)
        })
    }

    /// [`GenerationProgress::start`] with the prefill `prefill(session, prompt, chunk)`, which
    /// returns how many prompt tokens the caches reused and the logits after the prompt.
    pub fn start_with(
        session: &mut Session<'_>,
        prompt: &[u32],
        request: GenerateRequest,
        with_text: bool,
        prefill: impl FnOnce(&mut Session<'_>, &[u32], Option<usize>) -> Result<(usize, Array)>,
    ) -> Result<(GenerationProgress, Array)> {
        session.check_files()?;
        request.validate()?;
        let start = Instant::now();
        let (reused, logits) = prefill(session, prompt, request.prefill_chunk)?;
        let progress = GenerationProgress {
            sampler: Sampler::new(request.sampling.clone()),
            text: with_text.then(|| DecodeProgress::new(!request.keep_special_tokens)),
            stop: StopFilter {
                stops: request.stop.clone(),
                pending: String::new(),
            },
            request,
            generated: Vec::new(),
            finish: FinishReason::Length,
            prompt_tokens: prompt.len(),
            reused_tokens: reused,
            prefill_seconds: start.elapsed().as_secs_f64(),
            decode_start: Instant::now(),
            graph_seconds: 0.0,
            dispatch_seconds: 0.0,
            census: Vec::new(),
            speculation: None,
        };
        Ok((progress, logits))
    }

    /// Whether tokens are picked greedily (the largest logit, which needs no host copy of the
    /// logits).
    pub fn is_greedy(&self) -> bool {
        self.sampler.is_greedy()
    }

    /// The tokens generated so far (EOS excluded).
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// Whether the request's cancel flag is set.
    pub fn cancelled(&self) -> bool {
        self.request
            .cancel
            .as_ref()
            .is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Picks the next token from `logits` (`[vocab]`) on the host: the processor's changes,
    /// then the sampler over `history` (the tokens the conversation's caches hold), and the
    /// token's log-probability when the hooks ask for it.
    pub fn pick(
        &mut self,
        logits: &Array,
        history: &[u32],
        hooks: &mut StepHooks<'_>,
    ) -> Result<(u32, Option<TokenLogprob>)> {
        let row = logits.astype(Dtype::Float32)?.to_vec::<f32>()?;
        self.pick_row(row, history, hooks)
    }

    /// [`GenerationProgress::pick`] from logits already on the host.
    pub(crate) fn pick_row(
        &mut self,
        mut row: Vec<f32>,
        history: &[u32],
        hooks: &mut StepHooks<'_>,
    ) -> Result<(u32, Option<TokenLogprob>)> {
        let step = self.generated.len();
        if row.iter().any(|v| v.is_nan()) {
            return Err(nan_error(step));
        }
        if let Some(p) = hooks.processor.as_deref_mut() {
            p.process(&self.generated, &mut row)
                .map_err(|m| crate::LoadError::from(mlxcel_arch::ModelError::Runtime(m)))?;
            if !row.iter().any(|v| *v > f32::NEG_INFINITY) {
                return Err(crate::LoadError::from(mlxcel_arch::ModelError::Runtime(
                    format!("the logits processor allowed no token at generation step {step}"),
                )));
            }
        }
        let token = self.sampler.sample(&row, history);
        Ok((token, hooks.logprobs.map(|top| logprobs(&row, token, top))))
    }

    /// Takes `token` as the next output: passes it (and its text, once final) on, and returns
    /// whether the generation goes on. It ends at an EOS id (not emitted), a stop string or the
    /// token budget; a cancelled request ends before its token is taken.
    pub fn emit(
        &mut self,
        token: u32,
        logprob: Option<TokenLogprob>,
        tokenizer: Option<&Tokenizer>,
        mut on_text: impl FnMut(&str),
        mut on_token: impl FnMut(u32, Option<TokenLogprob>),
    ) -> Result<bool> {
        if self.cancelled() {
            self.finish = FinishReason::Cancelled;
            return Ok(false);
        }
        if self.request.eos_token_ids.contains(&token) {
            self.finish = FinishReason::Eos;
            return Ok(false);
        }
        self.generated.push(token);
        on_token(token, logprob);
        if let (Some(d), Some(t)) = (self.text.as_mut(), tokenizer) {
            let (text, hit) = self.stop.push(&d.push(t, token)?);
            if !text.is_empty() {
                on_text(&text);
            }
            if hit {
                self.finish = FinishReason::Stop;
                return Ok(false);
            }
        }
        Ok(self.generated.len() < self.request.max_new_tokens)
    }

    /// Ends the generation: releases text held back (unless a stop string or a cancel ended
    /// it) and returns the generated ids and the measurements.
    pub fn finish(
        mut self,
        tokenizer: Option<&Tokenizer>,
        mut on_text: impl FnMut(&str),
    ) -> Result<(Vec<u32>, GenerationStats)> {
        if !matches!(self.finish, FinishReason::Stop | FinishReason::Cancelled) {
            if let (Some(d), Some(t)) = (self.text.as_mut(), tokenizer) {
                let (text, _) = self.stop.push(&d.flush(t)?);
                let rest = format!("{text}{}", self.stop.pending);
                if !rest.is_empty() {
                    on_text(&rest);
                }
            }
        }
        let stats = GenerationStats {
            prompt_tokens: self.prompt_tokens,
            reused_tokens: self.reused_tokens,
            prefill_seconds: self.prefill_seconds,
            generated_tokens: self.generated.len(),
            decode_seconds: self.decode_start.elapsed().as_secs_f64(),
            decode_graph_seconds: self.graph_seconds,
            decode_dispatch_seconds: self.dispatch_seconds,
            decode_step_census: self.census,
            finish: self.finish,
            speculation: self.speculation,
        };
        Ok((self.generated, stats))
    }
}

/// One greedy step's pick, on the device: the token (`[1, 1]` int32) of `logits`, and a flag
/// (int32 0/1) of whether they held a NaN (one reduction, evaluated in the same batch and read
/// with the token), so bad weights stop generation with an error instead of decoding token 0
/// forever. The load's warm-up runs it once, so a first request finds its kernels ready.
pub(crate) fn device_greedy_pick(logits: &Array) -> mlxcel_core::Result<(Array, Array)> {
    let token = logits
        .argmax(-1, false)?
        .astype(Dtype::Int32)?
        .reshape(&[1, 1])?;
    let nan = logits
        .reshape(&[-1])?
        .isnan()?
        .any(&[0], false)?
        .astype(Dtype::Int32)?;
    Ok((token, nan))
}
/// [`generate_text`] with [`StepHooks`]: a logits processor, and each token's log-probability
/// passed to `on_token` (when [`StepHooks::logprobs`] asks for them).
pub fn generate_text_with(
    session: &mut Session<'_>,
    tokenizer: Option<&Tokenizer>,
    prompt: &[u32],
    request: &GenerateRequest,
    mut hooks: StepHooks<'_>,
    mut on_text: impl FnMut(&str),
    mut on_token: impl FnMut(u32, Option<TokenLogprob>),
) -> Result<(Vec<u32>, GenerationStats)> {
    let (mut g, mut logits) =
        GenerationProgress::start(session, prompt, request.clone(), tokenizer.is_some())?;
    let max_new = request.max_new_tokens;
    // Greedy decoding picks tokens on the device and queues each step before reading the token
    // it feeds (as mlx-lm does), so the host builds the next graph while the device computes.
    // Hooks need the logits on the host, so they take the host path.
    let mut pending = if g.sampler.is_greedy() && !hooks.active() {
        let first = device_greedy_pick(&logits)?;
        mlxcel_core::ops::async_eval_all([&first.0, &first.1])?;
        Some(first)
    } else {
        None
    };
    while g.generated.len() < max_new {
        let (token, logprob) = match pending.take() {
            Some((current, nan)) => {
                if g.generated.len() + 1 < max_new && !g.cancelled() {
                    let built = Instant::now();
                    let next = device_greedy_pick(&session.step_pending(&current)?)?;
                    // The second step's graph: the first one also grows the KV caches after
                    // a prompt of a multiple of their growth step, which others rarely do.
                    if g.census.is_empty() && !g.generated.is_empty() {
                        g.census = mlxcel_core::ops::graph_census([&next.0])?;
                    }
                    let queued = Instant::now();
                    mlxcel_core::ops::async_eval_all([&next.0, &next.1])?;
                    g.graph_seconds += (queued - built).as_secs_f64();
                    g.dispatch_seconds += queued.elapsed().as_secs_f64();
                    pending = Some(next);
                }
                if nan.to_vec::<i32>()?.first().copied().unwrap_or(0) != 0 {
                    return Err(nan_error(g.generated.len()));
                }
                let token = current
                    .to_vec::<i32>()?
                    .first()
                    .copied()
                    .ok_or_else(|| nan_error(g.generated.len()))?
                    as u32;
                if pending.is_some() {
                    session.record_token(token);
                }
                (token, None)
            }
            None => g.pick(&logits, session.tokens(), &mut hooks)?,
        };
        if !g.emit(token, logprob, tokenizer, &mut on_text, &mut on_token)? {
            break;
        }
        if pending.is_none() {
            logits = session.step(token)?;
        }
    }
    g.finish(tokenizer, on_text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_hold_back_partial_matches() {
        let stops = vec!["<end>".to_string(), "STOP".to_string()];
        let mut f = StopFilter {
            stops,
            pending: String::new(),
        };
        assert_eq!(f.push("hello <e"), ("hello ".to_string(), false));
        assert_eq!(f.push("nx"), ("<enx".to_string(), false));
        assert_eq!(f.push(" ST"), (" ".to_string(), false));
        assert_eq!(f.push("OP tail"), ("".to_string(), true));
    }
}
