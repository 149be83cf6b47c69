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

/// One round's queued work: the draft's `k` proposals chained behind `last`, and the model's
/// logits after each of `[last, d1..dk]`, `[k + 1, vocab]`. Returns the fed ids `[1, k + 1]`
/// and those logits, unevaluated. With `k = 0` it is a plain step.
fn propose_and_feed(
    session: &mut Session<'_>,
    draft: &mut Session<'_>,
    last: u32,
    k: usize,
) -> Result<(Array, Array)> {
    let mut fed = vec![Array::from_slice(&[last as i32], &[1, 1])?];
    if k > 0 {
        let mut context = session.tokens().to_vec();
        context.push(last);
        // Keeps what the draft holds; feeds what it has not seen (one or two tokens), queued.
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

/// [`crate::generate_text_with`] with a draft model proposing up to `draft.tokens` tokens a
/// round (see the module docs). The draft session must be of a model sharing the tokenizer
/// ([`check_draft_tokenizer`]); its caches follow this generation's tokens. Prompts with images
/// are refused (the draft has no vision tower). The stats carry [`SpeculationStats`].
#[allow(clippy::too_many_arguments)]
pub fn generate_text_speculative(
    session: &mut Session<'_>,
    draft: Draft<'_, '_>,
    tokenizer: Option<&Tokenizer>,
    prompt: &[u32],
    request: &GenerateRequest,
    mut hooks: StepHooks<'_>,
    mut on_text: impl FnMut(&str),
    mut on_token: impl FnMut(u32, Option<TokenLogprob>),
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
    g.decode_start = std::time::Instant::now();
    let mut stats = SpeculationStats::default();
    let max_new = request.max_new_tokens;
    // Greedy picks are compared on the device's argmax; hooks need each row on the host.
    let greedy = g.is_greedy() && hooks.logprobs.is_none() && hooks.processor.is_none();
    let (mut last, logprob) = g.pick(&logits, session.tokens(), &mut hooks)?;
    let mut going = g.generated.len() < max_new
        && g.emit(last, logprob, tokenizer, &mut on_text, &mut on_token)?;
    while going {
        let held = session.tokens().len();
        let budget = max_new - g.generated.len();
        let mut k = draft.tokens.min(budget - 1);
        if (last as usize) >= draft_vocab
            || !session.can_speculate(k + 1)
            || !draft.session.can_speculate(k + 1)
        {
            k = 0;
        }
        let building = std::time::Instant::now();
        let (fed, logits) = propose_and_feed(session, draft.session, last, k)?;
        let mut kept = 0;
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
            // The draft was fed d1..d(k-1); it catches up next round.
            let fed: Vec<u32> = session.tokens()[held + 1..held + k].to_vec();
            draft.session.record_tokens(&fed);
        }
        session.truncate(held + 1 + kept)?;
        going = going && g.generated.len() < max_new;
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
