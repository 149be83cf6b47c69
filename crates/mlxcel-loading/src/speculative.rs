//! Speculative decoding: a small draft model proposes a few tokens, the model checks them all
//! in one forward pass and keeps the longest prefix it agrees with, plus one token of its own.
//!
//! The output is the model's own, token for token: every kept token is the one the model picks
//! at its position from its own logits. Greedy: its argmax. Sampled: the sampler's draw, one
//! draw per emitted token in order and over the same history, so a seeded sampler produces the
//! same text as without a draft; the draft only decides how many tokens one pass yields. (The
//! logits of a position checked among several can differ from a one-token step's in the last
//! bits, as a chunked prefill's do, so a near-tie may still break the other way.)
//!
//! A round feeds the draft the tokens it has not seen, chains its greedy picks on the device,
//! and queues the model's pass over `[last, d1..dk]` behind them: one wait per round. What the
//! model rejects is cut from both caches ([`Session::truncate`]); rounds fall back to one plain
//! step while a cache could not take tokens back (a sliding-window ring that is full, a
//! recurrent state).

use mlxcel_arch::generate::Session;
use mlxcel_arch::{LayerCache, MultiTokenPrediction};
use mlxcel_core::{Array, Dtype};

use crate::textgen::{
    nan_error, GenerateRequest, GenerationProgress, GenerationStats, SpeculationStats, StepHooks,
    TokenLogprob,
};
use crate::tokenizer::Tokenizer;
use crate::{LoadError, Result};

/// A draft model's conversation and how many tokens it proposes per round.
pub struct Draft<'s, 'm> {
    /// The draft model's session; it follows the model's tokens (its own caches).
    pub session: &'s mut Session<'m>,
    /// Tokens proposed per round (at least 1).
    pub tokens: usize,
}

fn invalid(message: String) -> LoadError {
    LoadError::from(mlxcel_arch::ModelError::Runtime(message))
}

/// Checks that a draft model can propose tokens for a model: both tokenizers map every id to
/// the same token. The error names both folders and the first id that differs.
pub fn check_draft_tokenizer(
    model: (&std::path::Path, &Tokenizer),
    draft: (&std::path::Path, &Tokenizer),
) -> Result<()> {
    let (m, d) = (model.1, draft.1);
    let differ = |what: String| {
        invalid(format!(
            "draft model {} cannot propose tokens for {}: {what}; the two must share one tokenizer",
            draft.0.display(),
            model.0.display()
        ))
    };
    if m.vocab_size() != d.vocab_size() {
        return Err(differ(format!(
            "their tokenizers have {} and {} tokens",
            d.vocab_size(),
            m.vocab_size()
        )));
    }
    for id in 0..m.vocab_size() as u32 {
        let (a, b) = (m.id_to_token(id), d.id_to_token(id));
        if a != b {
            return Err(differ(format!(
                "token id {id} is {b:?} in the draft's tokenizer and {a:?} in the model's"
            )));
        }
    }
    Ok(())
}

/// The draft's greedy pick from its logits `[vocab_d]`, restricted to ids the model has:
/// `[1, 1]` int32, left on the device.
fn draft_pick(logits: &Array, model_vocab: usize) -> Result<Array> {
    let vocab = logits.dim(0)?.min(model_vocab as i32);
    Ok(logits
        .slice_axis(0, 0, vocab)?
        .argmax(0, false)?
        .astype(Dtype::Int32)?
        .reshape(&[1, 1])?)
}

/// Where a round's proposals come from: a draft model, or the model's own
/// multi-token-prediction layers. The shared loop ([`speculate`]) checks them and keeps what
/// the model agrees with.
trait Proposer {
    /// Called once with the model's first pick after the prompt, before the first round.
    fn start(&mut self, first: u32) -> Result<()> {
        let _ = first;
        Ok(())
    }

    /// How many tokens it proposes after `last` this round: at most `budget` and its own
    /// tokens a round (0: this round is a plain step).
    fn can_propose(&self, session: &Session<'_>, last: u32, budget: usize) -> usize;

    /// Queues the round: up to `k` proposals chained behind `last`, and the model's pass over
    /// `[last, d1..dk]`. Returns the fed ids `[1, k + 1]` and the model's logits after each,
    /// `[k + 1, vocab]`, unevaluated. With `k = 0` it is a plain step.
    fn propose_and_feed(
        &mut self,
        session: &mut Session<'_>,
        last: u32,
        k: usize,
    ) -> Result<(Array, Array)>;

    /// After the round that fed `k + 1` tokens from position `held` on, before the model's
    /// caches are cut back: the model emitted `emitted`, its picks at those positions (the
    /// kept proposals and one token of its own); `going`: whether generation goes on (when it
    /// stops, `emitted` may end early).
    fn after_round(
        &mut self,
        session: &Session<'_>,
        held: usize,
        k: usize,
        emitted: &[u32],
        going: bool,
    ) -> Result<()>;
}

/// A draft model as a [`Proposer`].
struct DraftProposer<'d, 's, 'm> {
    draft: &'d mut Draft<'s, 'm>,
}

impl Proposer for DraftProposer<'_, '_, '_> {
    fn can_propose(&self, session: &Session<'_>, last: u32, budget: usize) -> usize {
        let wanted = self.draft.tokens.min(budget);
        let draft = &self.draft.session;
        if (last as usize) >= draft.vocab_size()
            || !session.can_speculate(wanted + 1)
            || !draft.can_speculate(wanted + 1)
        {
            return 0;
        }
        wanted
    }

    fn propose_and_feed(
        &mut self,
        session: &mut Session<'_>,
        last: u32,
        k: usize,
    ) -> Result<(Array, Array)> {
        let mut fed = vec![Array::from_slice(&[last as i32], &[1, 1])?];
        if k > 0 {
            let draft = &mut self.draft.session;
            let mut context = session.tokens().to_vec();
            context.push(last);
            // Keeps what the draft holds; feeds what it has not seen (one or two tokens),
            // queued.
            let logits = draft.catch_up(&context)?;
            let vocab = session.vocab_size();
            let mut pick = draft_pick(&logits, vocab)?;
            fed.push(pick.clone());
            for _ in 1..k {
                pick = draft_pick(&draft.step_pending(&pick)?, vocab)?;
                fed.push(pick.clone());
            }
        }
        let fed = mlxcel_core::ops::concatenate(&fed, 1)?;
        let logits = session.feed_pending(&fed)?;
        Ok((fed, logits))
    }

    fn after_round(
        &mut self,
        session: &Session<'_>,
        held: usize,
        k: usize,
        _emitted: &[u32],
        _going: bool,
    ) -> Result<()> {
        if k > 0 {
            // The draft was fed d1..d(k-1); it catches up next round.
            let fed: Vec<u32> = session.tokens()[held + 1..held + k].to_vec();
            self.draft.session.record_tokens(&fed);
        }
        Ok(())
    }
}

/// [`crate::generate_text_with`] with a draft model proposing up to `draft.tokens` tokens a
/// round (see the module docs). The draft session must be of a model sharing the tokenizer
/// ([`check_draft_tokenizer`]); its caches follow this generation's tokens. Prompts with images
/// are refused (the draft has no vision tower). The stats carry [`SpeculationStats`].
#[allow(clippy::too_many_arguments)]
pub fn generate_text_speculative(
    session: &mut Session<'_>,
    mut draft: Draft<'_, '_>,
    tokenizer: Option<&Tokenizer>,
    prompt: &[u32],
    request: &GenerateRequest,
    hooks: StepHooks<'_>,
    on_text: impl FnMut(&str),
    on_token: impl FnMut(u32, Option<TokenLogprob>),
) -> Result<(Vec<u32>, GenerationStats)> {
    if draft.tokens == 0 {
        return Err(invalid(
            "draft tokens = 0: a draft model must propose at least 1 token a round".into(),
        ));
    }
    if !request.images.is_empty() {
        return Err(invalid(
            "speculative decoding takes text prompts only: the draft model cannot see images"
                .into(),
        ));
    }
    let draft_vocab = draft.session.vocab_size();
    if let Some(bad) = prompt.iter().find(|t| **t as usize >= draft_vocab) {
        return Err(invalid(format!(
            "prompt token {bad} is outside the draft model's vocabulary (size {draft_vocab})"
        )));
    }
    let (mut g, logits) =
        GenerationProgress::start(session, prompt, request.clone(), tokenizer.is_some())?;
    let draft_started = std::time::Instant::now();
    draft.session.prefill(prompt, request.prefill_chunk)?;
    g.prefill_seconds += draft_started.elapsed().as_secs_f64();
    let mut proposer = DraftProposer { draft: &mut draft };
    speculate(
        session,
        &mut proposer,
        g,
        logits,
        tokenizer,
        hooks,
        on_text,
        on_token,
    )
}

/// The model's multi-token-prediction layers as a [`Proposer`]: each round's drafts are
/// queued at the end of the previous round, from the hidden states of the positions the
/// model kept (see [`generate_text_mtp`]).
struct MtpProposer<'m> {
    mtp: &'m dyn MultiTokenPrediction,
    /// One cache per MTP layer.
    caches: Vec<LayerCache>,
    /// How many rows of layer 0's cache belong to positions the model kept. Its other rows,
    /// and all of the deeper layers', are the last round's chained drafts, taken back before
    /// the next feed.
    confirmed: usize,
    /// The prompt's rows for [`Proposer::start`]: the first position fed, the model's hidden
    /// states there, and the prompt tokens after each (the first pick completes them).
    prompt: Option<(usize, Array, Vec<u32>)>,
    /// Hidden states after the final norm of the last verification pass, `[1, k + 1, hidden]`.
    hidden: Option<Array>,
    /// The queued drafts for the token after `last` and on, `[1, 1]` int32 each.
    drafts: Vec<Array>,
    /// Tokens proposed per round.
    tokens: usize,
    vocab: usize,
}

impl MtpProposer<'_> {
    /// Feeds MTP layer 0 the model's hidden states `hidden` `[1, L, hidden]` at positions
    /// `first..first + L` with the tokens after them `next` (host values), then chains the
    /// drafts: the first from layer 0's last row, each further one from the next layer (in
    /// turn) over the previous draft.
    fn feed_and_draft(&mut self, hidden: &Array, first: usize, next: &[u32]) -> Result<()> {
        for (depth, cache) in self.caches.iter_mut().enumerate() {
            cache.rewind(if depth == 0 { self.confirmed } else { 0 })?;
        }
        let ids: Vec<i32> = next.iter().map(|t| *t as i32).collect();
        let positions: Vec<i32> = (first..first + next.len()).map(|p| p as i32).collect();
        let (logits, out) = self.mtp.mtp_forward(
            0,
            hidden,
            &Array::from_slice(&ids, &[1, ids.len() as i32])?,
            &Array::from_slice(&positions, &[positions.len() as i32])?,
            &mut self.caches[0],
        )?;
        self.confirmed += next.len();
        let rows = logits.dim(1)?;
        let mut pick = draft_pick(
            &logits.slice_axis(1, rows - 1, rows)?.reshape(&[-1])?,
            self.vocab,
        )?;
        let mut carried = out.slice_axis(1, rows - 1, rows)?;
        self.drafts = vec![pick.clone()];
        let layers = self.caches.len();
        for j in 1..self.tokens {
            let position = Array::from_slice(&[(first + next.len() - 1 + j) as i32], &[1])?;
            let (logits, out) = self.mtp.mtp_forward(
                j % layers,
                &carried,
                &pick,
                &position,
                &mut self.caches[j % layers],
            )?;
            pick = draft_pick(&logits.reshape(&[-1])?, self.vocab)?;
            carried = out;
            self.drafts.push(pick.clone());
        }
        Ok(())
    }
}

impl Proposer for MtpProposer<'_> {
    fn start(&mut self, first: u32) -> Result<()> {
        let (position, hidden, mut next) = self
            .prompt
            .take()
            .ok_or_else(|| invalid("internal: the MTP layers started twice".into()))?;
        // Position i reads the token after it: the last prompt position's is the first pick.
        next.push(first);
        self.feed_and_draft(&hidden, position, &next)
    }

    fn can_propose(&self, session: &Session<'_>, _last: u32, budget: usize) -> usize {
        let k = budget.min(self.drafts.len());
        if !session.can_speculate(k + 1) {
            return 0;
        }
        k
    }

    fn propose_and_feed(
        &mut self,
        session: &mut Session<'_>,
        last: u32,
        k: usize,
    ) -> Result<(Array, Array)> {
        let mut fed = vec![Array::from_slice(&[last as i32], &[1, 1])?];
        fed.extend(self.drafts.iter().take(k).cloned());
        let fed = mlxcel_core::ops::concatenate(&fed, 1)?;
        let (logits, hidden) = session.feed_pending_with_hidden(&fed)?;
        self.hidden = Some(hidden);
        Ok((fed, logits))
    }

    fn after_round(
        &mut self,
        _session: &Session<'_>,
        held: usize,
        _k: usize,
        emitted: &[u32],
        going: bool,
    ) -> Result<()> {
        let hidden = self
            .hidden
            .take()
            .ok_or_else(|| invalid("internal: a round without hidden states".into()))?;
        if !going {
            return Ok(());
        }
        // Positions held..held + emitted.len() were fed the tokens the model kept; the token
        // after each is its pick there.
        let rows = hidden.slice_axis(1, 0, emitted.len() as i32)?;
        self.feed_and_draft(&rows, held, emitted)
    }
}

/// Self-speculative decoding: the model's multi-token-prediction layers (DeepSeek-V3,
/// GLM-4.5; the model must be loaded with `LoadOptions::mtp`) propose `tokens` tokens a round
/// (each further one from the next MTP layer in turn, over the previous one's output), the
/// model checks them in one pass and keeps the longest prefix it agrees with plus one token of
/// its own, as with a draft model (see the module docs): the output is the model's.
///
/// The MTP layers see the positions prefilled in this request and those generated after:
/// a prefix reused from the session's caches has no MTP rows (the drafts, not the output,
/// depend on it). Prompts with images are refused. The stats carry [`SpeculationStats`].
#[allow(clippy::too_many_arguments)]
pub fn generate_text_mtp(
    session: &mut Session<'_>,
    tokens: usize,
    tokenizer: Option<&Tokenizer>,
    prompt: &[u32],
    request: &GenerateRequest,
    hooks: StepHooks<'_>,
    on_text: impl FnMut(&str),
    on_token: impl FnMut(u32, Option<TokenLogprob>),
) -> Result<(Vec<u32>, GenerationStats)> {
    let Some(mtp) = session.model().mtp() else {
        return Err(invalid(
            "self-speculative decoding needs the model's multi-token-prediction layers: load it with them (`--speculative mtp`, `LoadOptions::mtp`)".into(),
        ));
    };
    if tokens == 0 {
        return Err(invalid(
            "draft tokens = 0: the multi-token-prediction layers must propose at least 1 token a round".into(),
        ));
    }
    if !request.images.is_empty() {
        return Err(invalid(
            "self-speculative decoding takes text prompts only".into(),
        ));
    }
    let mut prefilled = None;
    let (g, logits) = GenerationProgress::start_with(
        session,
        prompt,
        request.clone(),
        tokenizer.is_some(),
        |session, prompt, chunk| {
            let (reused, logits, hidden) = session.prefill_with_hidden(prompt, chunk)?;
            prefilled = Some((reused, hidden));
            Ok((reused, logits))
        },
    )?;
    let (reused, hidden) =
        prefilled.ok_or_else(|| invalid("internal: the prefill kept no hidden states".into()))?;
    let mut proposer = MtpProposer {
        mtp,
        caches: mtp.mtp_caches(),
        confirmed: 0,
        prompt: Some((reused, hidden, prompt[reused + 1..].to_vec())),
        hidden: None,
        drafts: Vec::new(),
        tokens,
        vocab: session.vocab_size(),
    };
    speculate(
        session,
        &mut proposer,
        g,
        logits,
        tokenizer,
        hooks,
        on_text,
        on_token,
    )
}

/// The shared loop: picks the first token from the prefill's `logits`, starts `proposer`
/// with it, then runs rounds until the request ends.
#[allow(clippy::too_many_arguments)]
fn speculate(
    session: &mut Session<'_>,
    proposer: &mut dyn Proposer,
    mut g: GenerationProgress,
    logits: Array,
    tokenizer: Option<&Tokenizer>,
    mut hooks: StepHooks<'_>,
    mut on_text: impl FnMut(&str),
    mut on_token: impl FnMut(u32, Option<TokenLogprob>),
) -> Result<(Vec<u32>, GenerationStats)> {
    g.decode_start = std::time::Instant::now();
    let (mut last, logprob) = g.pick(&logits, session.tokens(), &mut hooks)?;
    proposer.start(last)?;
    let mut going = g.generated.len() < g.request.max_new_tokens
        && g.emit(last, logprob, tokenizer, &mut on_text, &mut on_token)?;
    let mut stats = SpeculationStats::default();
    let max_new = g.request.max_new_tokens;
    // Greedy picks are compared on the device's argmax; hooks need each row on the host.
    let greedy = g.is_greedy() && hooks.logprobs.is_none() && hooks.processor.is_none();
    while going {
        let held = session.tokens().len();
        let budget = max_new - g.generated.len();
        let k = proposer.can_propose(session, last, budget - 1);
        let building = std::time::Instant::now();
        let (fed, logits) = proposer.propose_and_feed(session, last, k)?;
        let mut kept = 0;
        let mut emitted = Vec::with_capacity(k + 1);
        // This pass's graph-building and evaluation seconds (counted when it was a round).
        let (build_seconds, eval_seconds);
        if greedy {
            let picks = logits.argmax(-1, false)?.astype(Dtype::Int32)?;
            let nan = logits.isnan()?.any(&[0, 1], false)?.astype(Dtype::Int32)?;
            let evaluating = std::time::Instant::now();
            build_seconds = (evaluating - building).as_secs_f64();
            mlxcel_core::ops::eval_all([&fed, &picks, &nan])?;
            if nan.to_vec::<i32>()?[0] != 0 {
                return Err(nan_error(g.generated.len()));
            }
            let fed: Vec<u32> = fed.to_vec::<i32>()?.iter().map(|t| *t as u32).collect();
            let picks: Vec<u32> = picks.to_vec::<i32>()?.iter().map(|t| *t as u32).collect();
            eval_seconds = evaluating.elapsed().as_secs_f64();
            session.record_tokens(&fed);
            while kept < k && fed[kept + 1] == picks[kept] {
                kept += 1;
            }
            for (i, &token) in picks.iter().enumerate().take(kept + 1) {
                going = g.emit(token, None, tokenizer, &mut on_text, &mut on_token)?;
                emitted.push(token);
                last = token;
                if !going {
                    kept = kept.min(i);
                    break;
                }
            }
        } else {
            let rows = logits.astype(Dtype::Float32)?;
            let evaluating = std::time::Instant::now();
            build_seconds = (evaluating - building).as_secs_f64();
            let fed_ids: Vec<u32> = fed.to_vec::<i32>()?.iter().map(|t| *t as u32).collect();
            let rows = rows.to_vec::<f32>()?;
            eval_seconds = evaluating.elapsed().as_secs_f64();
            session.record_tokens(&fed_ids);
            let vocab = rows.len() / fed_ids.len();
            for (i, row) in rows.chunks(vocab).enumerate() {
                // The history of position i: what the caches held, then the fed tokens up to i.
                let history = &session.tokens()[..held + 1 + i];
                let (token, logprob) = g.pick_row(row.to_vec(), history, &mut hooks)?;
                going = g.emit(token, logprob, tokenizer, &mut on_text, &mut on_token)?;
                emitted.push(token);
                last = token;
                let agreed = i < k && fed_ids[i + 1] == token;
                if !going || !agreed {
                    break;
                }
                kept += 1;
            }
        }
        if k > 0 {
            stats.rounds += 1;
            stats.proposed += k;
            stats.accepted += kept;
            stats.build_seconds += build_seconds;
            stats.eval_seconds += eval_seconds;
        }
        going = going && g.generated.len() < max_new;
        proposer.after_round(session, held, k, &emitted, going)?;
        session.truncate(held + 1 + kept)?;
    }
    g.speculation = Some(stats);
    g.finish(tokenizer, on_text)
}

/// The layer index of a per-layer tensor name (`model.layers.12.mlp...`, `transformer.h.3...`,
/// `...blocks.7...`), `None` for the others.
fn layer_of(name: &str) -> Option<usize> {
    let parts: Vec<&str> = name.split('.').collect();
    parts.windows(2).find_map(|w| match w[0] {
        "layers" | "h" | "blocks" => w[1].parse().ok(),
        _ => None,
    })
}

/// Writes an early-exit draft of the checkpoint in `model` to the new folder `out`: its first
/// `layers` decoder layers with its own embedding, final norm and output head (the other files,
/// tokenizer included, copied). Such a draft shares the tokenizer by construction and costs a
/// fraction of the model per token; how often the model agrees with it depends on how much the
/// later layers change the prediction (LayerSkip trains models so they change it little).
/// `config.json` must give `num_hidden_layers`; per-layer lists of that length in it
/// (`layer_types`, ...) are cut to `layers` too.
pub fn write_early_exit_draft(
    model: &std::path::Path,
    out: &std::path::Path,
    layers: usize,
) -> Result<()> {
    let config_path = model.join("config.json");
    let text = std::fs::read_to_string(&config_path)
        .map_err(|e| LoadError::file(&config_path, e.to_string()))?;
    let mut config: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| LoadError::file(&config_path, format!("not JSON: {e}")))?;
    let total = config
        .get("num_hidden_layers")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| LoadError::file(&config_path, "no integer `num_hidden_layers`"))?
        as usize;
    if layers == 0 || layers > total {
        return Err(LoadError::file(
            &config_path,
            format!("an early-exit draft keeps 1 to {total} layers, not {layers}"),
        ));
    }
    if let Some(fields) = config.as_object_mut() {
        fields.insert("num_hidden_layers".into(), layers.into());
        for value in fields.values_mut() {
            if let Some(list) = value.as_array_mut().filter(|l| l.len() == total) {
                list.truncate(layers);
            }
        }
    }
    let weights = mlxcel_core::WeightMap::open(model)?;
    let mut kept = Vec::new();
    for name in weights.names() {
        if layer_of(name).is_none_or(|l| l < layers) {
            kept.push((name.to_string(), weights.get(name)?));
        }
    }
    if out.exists() && std::fs::read_dir(out).map_or(true, |mut d| d.next().is_some()) {
        return Err(LoadError::file(
            out,
            "the draft's folder must not exist or be empty",
        ));
    }
    std::fs::create_dir_all(out).map_err(|e| LoadError::file(out, e.to_string()))?;
    mlxcel_core::weights::save_safetensors(out.join("model.safetensors"), &kept, None)?;
    let config_out = out.join("config.json");
    let text = serde_json::to_string_pretty(&config).expect("a JSON value serialises");
    std::fs::write(&config_out, text).map_err(|e| LoadError::file(&config_out, e.to_string()))?;
    let entries = std::fs::read_dir(model).map_err(|e| LoadError::file(model, e.to_string()))?;
    for entry in entries {
        let path = entry
            .map_err(|e| LoadError::file(model, e.to_string()))?
            .path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let weights_file =
            name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json");
        if path.is_file() && !weights_file && name != "config.json" {
            std::fs::copy(&path, out.join(name))
                .map_err(|e| LoadError::file(&path, e.to_string()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::layer_of;

    #[test]
    fn layer_indices_come_from_the_tensor_names() {
        assert_eq!(layer_of("model.layers.12.mlp.down_proj.weight"), Some(12));
        assert_eq!(layer_of("transformer.h.3.attn.c_attn.weight"), Some(3));
        assert_eq!(layer_of("model.embed_tokens.weight"), None);
        assert_eq!(layer_of("model.norm.weight"), None);
    }
}
