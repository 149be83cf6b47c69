//! BERT and XLM-RoBERTa encoders (`BertModel`, `XLMRobertaModel`): learned absolute positions
//! (XLM-R's start at `pad_token_id + 1` and skip padding), token-type embeddings (type 0),
//! post-LN blocks with biased projections, bidirectional attention under a padding mask.

use mlxcel_core::ops;
use mlxcel_core::{Array, Dtype, WeightMap};
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use crate::embedding::{attention_mask, bidirectional_attention, split_heads, EmbeddingModel};
use crate::model::{Architecture, LayerKind};
use crate::nn::{Activation, Embedding, Linear, Norm, NormKind};
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

fn two() -> i32 {
    2
}

fn default_eps() -> f32 {
    1e-12
}

fn gelu() -> String {
    "gelu".to_string()
}

/// The `config.json` keys of BERT and XLM-RoBERTa.
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// `model_type`: `bert` or `xlm-roberta` (which position scheme applies).
    pub model_type: String,
    /// Width of the hidden states.
    pub hidden_size: i32,
    /// Encoder layers.
    pub num_hidden_layers: i32,
    /// Attention heads.
    pub num_attention_heads: i32,
    /// Width of the feed-forward layer.
    pub intermediate_size: i32,
    /// Rows of the token table.
    pub vocab_size: i32,
    /// Rows of the position table.
    pub max_position_embeddings: i32,
    /// Rows of the token-type table; default 2.
    #[serde(default = "two")]
    pub type_vocab_size: i32,
    /// LayerNorm epsilon; default `1e-12`.
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f32,
    /// Feed-forward activation; default `gelu` (exact).
    #[serde(default = "gelu")]
    pub hidden_act: String,
    /// The padding id (XLM-R positions start after it); default 0 for BERT, 1 for XLM-R.
    #[serde(default)]
    pub pad_token_id: Option<i64>,
    /// Only `absolute` is supported.
    #[serde(default)]
    pub position_embedding_type: Option<String>,
}

impl Args {
    fn roberta(&self) -> bool {
        matches!(self.model_type.as_str(), "xlm-roberta" | "roberta")
    }

    fn pad(&self) -> i64 {
        self.pad_token_id
            .unwrap_or(if self.roberta() { 1 } else { 0 })
    }
}

#[derive(Debug)]
struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    attn_norm: Norm,
    intermediate: Linear,
    output: Linear,
    out_norm: Norm,
}

/// A BERT-family encoder (see the module docs).
#[derive(Debug)]
pub struct Model {
    words: Embedding,
    positions: Embedding,
    token_types: Embedding,
    embed_norm: Norm,
    layers: Vec<Layer>,
    heads: i32,
    act: Activation,
    roberta: bool,
    pad: i64,
    hidden: i32,
    vocab: i32,
    max_positions: i32,
}

impl Model {
    fn position_ids(&self, ids: &Array) -> Result<Array> {
        let l = ids.dim(1)?;
        if !self.roberta {
            return Ok(ops::arange(0.0, l as f64, 1.0, Dtype::Int32)?.reshape(&[1, l])?);
        }
        // transformers' create_position_ids_from_input_ids: cumsum over non-padding tokens,
        // offset by the padding id; padding itself sits at the padding id.
        let not_pad = ids
            .not_equal(&Array::scalar(self.pad as f64, Dtype::Int32)?)?
            .astype(Dtype::Int32)?;
        Ok(not_pad
            .cumsum(1, false, true)?
            .multiply(&not_pad)?
            .add_scalar(self.pad as f64)?
            .astype(Dtype::Int32)?)
    }
}

impl EmbeddingModel for Model {
    fn hidden_states(&self, ids: &Array, mask: &Array) -> Result<Array> {
        let ids = ids.astype(Dtype::Int32)?;
        let positions = self.position_ids(&ids)?;
        let zeros = Array::from_slice(&[0i32], &[1, 1])?;
        let mut x = self
            .words
            .forward(&ids)?
            .add(&self.positions.forward(&positions)?)?
            .add(&self.token_types.forward(&zeros)?)?;
        x = self.embed_norm.forward(&x)?;
        let mask = attention_mask(mask, x.dtype()?, None)?;
        for layer in &self.layers {
            let q = split_heads(&layer.query.forward(&x)?, self.heads)?;
            let k = split_heads(&layer.key.forward(&x)?, self.heads)?;
            let v = split_heads(&layer.value.forward(&x)?, self.heads)?;
            let a = bidirectional_attention(&q, &k, &v, &mask)?;
            x = layer
                .attn_norm
                .forward(&layer.attn_out.forward(&a)?.add(&x)?)?;
            let h = self.act.apply(&layer.intermediate.forward(&x)?)?;
            x = layer
                .out_norm
                .forward(&layer.output.forward(&h)?.add(&x)?)?;
        }
        Ok(x)
    }

    fn hidden_size(&self) -> usize {
        self.hidden as usize
    }

    fn vocab_size(&self) -> usize {
        self.vocab as usize
    }

    fn max_tokens(&self) -> Option<usize> {
        let reach = if self.roberta {
            self.max_positions as i64 - self.pad - 1
        } else {
            self.max_positions as i64
        };
        Some(reach.max(0) as usize)
    }
}

/// Strips a task model's prefix (`bert.`, `roberta.`) and drops what an encoder does not use
/// (the pooler, MLM/NSP heads, registered buffers).
pub(crate) fn strip_task_heads(
    weights: &mut WeightMap,
    prefixes: &[&str],
    dropped: &[&str],
) -> Result<()> {
    for p in prefixes {
        if weights.names().any(|n| n.starts_with(p)) {
            weights.rename_prefix(p, "")?;
        }
    }
    let drop: Vec<String> = weights
        .names()
        .filter(|n| dropped.iter().any(|d| n.starts_with(d)))
        .map(str::to_string)
        .collect();
    for n in drop {
        weights.remove(&n);
    }
    Ok(())
}

impl Architecture for Model {
    type Args = Args;

    fn sanitize(args: &Args, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        if let Some(p) = &args.position_embedding_type {
            if p != "absolute" {
                return Err(ModelError::Unsupported(format!(
                    "position_embedding_type `{p}` (only `absolute` is supported)"
                )));
            }
        }
        strip_task_heads(
            weights,
            &["bert.", "roberta."],
            &[
                "pooler.",
                "cls.",
                "lm_head.",
                "embeddings.position_ids",
                "embeddings.token_type_ids",
            ],
        )
    }

    fn cache_schedule(_args: &Args) -> Result<Vec<LayerKind>> {
        Ok(Vec::new())
    }

    fn build(args: &Args, w: &mut ModelWeights) -> Result<Model> {
        let h = args.hidden_size;
        let heads = args.num_attention_heads;
        if heads <= 0 || h % heads != 0 {
            return Err(ModelError::Config(format!(
                "num_attention_heads = {heads}: must divide hidden_size = {h}"
            )));
        }
        let act = Activation::from_name(&args.hidden_act)
            .ok_or_else(|| ModelError::Unsupported(format!("hidden_act `{}`", args.hidden_act)))?;
        let eps = args.layer_norm_eps;
        let mut e = w.scope("embeddings");
        let words = e.embedding("word_embeddings", args.vocab_size, h)?;
        let positions = e.embedding("position_embeddings", args.max_position_embeddings, h)?;
        let token_types = e.embedding("token_type_embeddings", args.type_vocab_size, h)?;
        let embed_norm = e.norm("LayerNorm", NormKind::Layer, h, eps)?;
        drop(e);
        let mut layers = Vec::new();
        let mut enc = w.scope("encoder");
        let mut all = enc.scope("layer");
        for i in 0..args.num_hidden_layers {
            let mut l = all.scope(i);
            layers.push(Layer {
                query: l.linear("attention.self.query", h, h, true)?,
                key: l.linear("attention.self.key", h, h, true)?,
                value: l.linear("attention.self.value", h, h, true)?,
                attn_out: l.linear("attention.output.dense", h, h, true)?,
                attn_norm: l.norm("attention.output.LayerNorm", NormKind::Layer, h, eps)?,
                intermediate: l.linear("intermediate.dense", h, args.intermediate_size, true)?,
                output: l.linear("output.dense", args.intermediate_size, h, true)?,
                out_norm: l.norm("output.LayerNorm", NormKind::Layer, h, eps)?,
            });
        }
        Ok(Model {
            words,
            positions,
            token_types,
            embed_norm,
            layers,
            heads,
            act,
            roberta: args.roberta(),
            pad: args.pad(),
            hidden: h,
            vocab: args.vocab_size,
            max_positions: args.max_position_embeddings,
        })
    }
}
