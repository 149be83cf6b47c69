//! Multi-token-prediction (MTP) layers, as DeepSeek-V3 introduced them and GLM-4.5 ships them:
//! `num_nextn_predict_layers` extra layers stored after the last decoder layer
//! (`model.layers.{n + d}`), each predicting one token further ahead.
//!
//! Layer `d` at position `i` reads the model's hidden state after its final norm, `h[i]` (for
//! `d > 0`, layer `d - 1`'s block output there), and the embedding of the token after it:
//! `x = eh_proj([enorm(embed(t[i+1])); hnorm(h[i])])` (the embedding first, as `eh_proj`'s
//! input columns are stored), then one decoder block of the model's last layer's kind with its
//! own cache, then `shared_head.norm` and the output head: the logits of `t[i+2]`.
//!
//! A layer's own `embed_tokens` and `shared_head.head` are used when the checkpoint stores them
//! (DeepSeek-V3 and GLM-4.5 store copies), the model's otherwise (mlx-lm-style conversions
//! that kept the layer but not the copies). No position's embedding is masked: vLLM zeroes the
//! one at position 0, which the DeepSeek-V3 report does not describe; it changes only the
//! drafts, never the output.
//!
//! The layers are built only when asked for ([`ModelWeights::wants_mtp`]); otherwise their
//! tensors are skipped without being read.

use mlxcel_core::Array;

use super::{build_block, check_token_ids, norm, Block, Decoder, DecoderSpec};
use crate::cache::LayerCache;
use crate::model::{LayerKind, MultiTokenPrediction};
use crate::nn::{Embedding, Linear, Norm};
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

/// Where a checkpoint keeps its MTP layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MtpSpec {
    /// `num_nextn_predict_layers`: MTP layers stored as `model.layers.{n + d}` after the `n`
    /// decoder layers, each a block of the last decoder layer's kind.
    pub layers: usize,
}

#[derive(Debug)]
struct MtpLayer {
    enorm: Norm,
    hnorm: Norm,
    eh_proj: Linear,
    block: Block,
    norm: Norm,
    /// The layer's own `embed_tokens`, when stored.
    embed: Option<Embedding>,
    /// The layer's own `shared_head.head`, when stored.
    head: Option<Linear>,
}

/// A decoder's MTP layers and their caches' kinds.
#[derive(Debug)]
pub(super) struct Mtp {
    layers: Vec<MtpLayer>,
    schedule: Vec<LayerKind>,
}

impl Mtp {
    /// Builds the MTP layers `spec.mtp` names from `layers` (the `model.layers` scope) when
    /// `w.wants_mtp()`, else marks their tensors used without reading them. A model asked for
    /// MTP layers it lacks is an error naming the tensor that is missing.
    pub(super) fn build(layers: &mut ModelWeights, spec: &DecoderSpec) -> Result<Option<Mtp>> {
        let n = spec.layers();
        let count = spec.mtp.map_or(0, |m| m.layers);
        if !layers.wants_mtp() {
            // Whatever the checkpoint stores past the last layer (also beyond the config's
            // count) is never read.
            let mut d = 0;
            while layers.contains(&format!("{}.eh_proj.weight", n + d))
                || layers.contains(&format!("{}.input_layernorm.weight", n + d))
            {
                layers.skip(&(n + d).to_string());
                d += 1;
            }
            return Ok(None);
        }
        if count == 0 {
            return Err(ModelError::Unsupported(
                "no multi-token-prediction layers to build: mlxcel builds those of DeepSeek-V3 and GLM-4.5 checkpoints (`num_nextn_predict_layers` > 0 in config.json); use a draft model for speculative decoding".into(),
            ));
        }
        if n == 0 {
            return Err(ModelError::Config(
                "multi-token prediction needs at least one decoder layer".into(),
            ));
        }
        let block_spec = with_last_layer_repeated(spec, count);
        let h = spec.hidden;
        let mut built = Vec::with_capacity(count);
        for d in 0..count {
            let i = n + d;
            let mut l = layers.scope(i);
            let eh = format!("{}.weight", l.path("eh_proj"));
            if !l.contains("eh_proj.weight") && !l.contains("eh_proj.scales") {
                return Err(ModelError::MissingTensor(format!(
                    "{eh} (multi-token-prediction layer {d} of {count}: the checkpoint does not carry its MTP layers; conversions such as mlx-lm's drop them)"
                )));
            }
            let enorm = norm(&mut l, spec, "enorm", h)?;
            let hnorm = norm(&mut l, spec, "hnorm", h)?;
            let eh_proj = l.linear("eh_proj", 2 * h, h, false)?;
            let embed = if l.contains("embed_tokens.weight") {
                Some(l.embedding("embed_tokens", spec.vocab, h)?)
            } else {
                None
            };
            let (head_norm, head) = {
                let mut s = l.scope("shared_head");
                let head_norm = norm(&mut s, spec, "norm", h)?;
                let head = if s.contains("head.weight") {
                    Some(s.linear("head", h, spec.vocab, false)?)
                } else {
                    None
                };
                (head_norm, head)
            };
            let block = build_block(&mut l, &block_spec, i, None)?;
            built.push(MtpLayer {
                enorm,
                hnorm,
                eh_proj,
                block,
                norm: head_norm,
                embed,
                head,
            });
        }
        let schedule = block_spec.layer_schedule()[n..].to_vec();
        Ok(Some(Mtp {
            layers: built,
            schedule,
        }))
    }

    /// How many MTP layers were built.
    pub(super) fn len(&self) -> usize {
        self.layers.len()
    }

    /// Fresh caches, one per MTP layer.
    pub(super) fn caches(&self) -> Vec<LayerCache> {
        self.schedule.iter().map(LayerKind::new_cache).collect()
    }
}

/// `spec` with `count` more layers, each a copy of its last layer's kind (mixer, feed-forward
/// block, rope, window, ...): the blocks of the MTP layers stored after it.
fn with_last_layer_repeated(spec: &DecoderSpec, count: usize) -> DecoderSpec {
    fn repeat_last<T: Clone>(v: &mut Vec<T>, count: usize) {
        if let Some(last) = v.last().cloned() {
            v.extend(std::iter::repeat_n(last, count));
        }
    }
    let mut s = spec.clone();
    repeat_last(&mut s.mixers, count);
    repeat_last(&mut s.rope, count);
    repeat_last(&mut s.windows, count);
    repeat_last(&mut s.ffn, count);
    repeat_last(&mut s.chunks, count);
    repeat_last(&mut s.block_scales, count);
    repeat_last(&mut s.query_scales, count);
    s
}

impl Decoder {
    fn built_mtp(&self) -> Result<&Mtp> {
        self.mtp.as_ref().ok_or_else(|| {
            ModelError::Unsupported(
                "the multi-token-prediction layers were not built (load with `mtp`)".into(),
            )
        })
    }
}

impl MultiTokenPrediction for Decoder {
    fn mtp_layers(&self) -> usize {
        self.mtp.as_ref().map_or(0, Mtp::len)
    }

    fn mtp_caches(&self) -> Vec<LayerCache> {
        self.mtp.as_ref().map_or_else(Vec::new, Mtp::caches)
    }

    fn forward_with_hidden(
        &self,
        tokens: &Array,
        caches: &mut [LayerCache],
        last_only: bool,
    ) -> Result<(Array, Array)> {
        if self.stage.is_some() || self.vocab_parallel.is_some() {
            return Err(ModelError::Unsupported(
                "multi-token prediction of a model spread over several processes".into(),
            ));
        }
        let h = self.body(self.embed(tokens)?, None, caches)?;
        let normed = self.norm.forward(&h)?;
        let rows = if last_only {
            let n = normed.dim(1)?;
            normed.slice_axis(1, n - 1, n)?
        } else {
            normed.clone()
        };
        Ok((self.project_normed(&rows)?, normed))
    }

    fn mtp_forward(
        &self,
        depth: usize,
        hidden: &Array,
        next_tokens: &Array,
        positions: &Array,
        cache: &mut LayerCache,
    ) -> Result<(Array, Array)> {
        let mtp = self.built_mtp()?;
        let layer = mtp.layers.get(depth).ok_or_else(|| {
            ModelError::Runtime(format!(
                "multi-token-prediction depth {depth}: the model has {} MTP layers",
                mtp.len()
            ))
        })?;
        let embedded = match &layer.embed {
            Some(e) => {
                check_token_ids(next_tokens, self.vocab)?;
                e.forward(next_tokens)?
            }
            None => self.embed(next_tokens)?,
        };
        let joined = mlxcel_core::ops::concatenate(
            &[
                layer.enorm.forward(&embedded)?,
                layer.hnorm.forward(hidden)?,
            ],
            2,
        )?;
        let x = layer.eh_proj.forward(&joined)?;
        let out = layer
            .block
            .forward(&x, cache, Some(positions), self.residual_scale)?;
        let normed = layer.norm.forward(&out)?;
        let logits = match &layer.head {
            Some(head) => self.scale_logits(head.forward(&normed)?)?,
            None => self.project_normed(&normed)?,
        };
        Ok((logits, out))
    }
}
