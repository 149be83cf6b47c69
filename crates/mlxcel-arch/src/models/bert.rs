//! BERT and XLM-RoBERTa encoders (`BertModel`, `XLMRobertaModel`): learned absolute positions
//! (XLM-R's start at `pad_token_id + 1` and skip padding), token-type embeddings (type 0 when
//! embedding), post-LN blocks with biased projections, bidirectional attention under a padding
//! mask; and their cross-encoders ([`Classifier`]: `BertForSequenceClassification`,
//! `XLMRobertaForSequenceClassification`).

use mlxcel_core::ops;
use mlxcel_core::{Array, Dtype, WeightMap};
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use crate::embedding::{attention_mask, bidirectional_attention, split_heads, EmbeddingModel};
use crate::model::{Architecture, LayerKind};
use crate::nn::{Activation, Embedding, Linear, Norm, NormKind};
use crate::rerank::{Labels, RerankerModel};
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
    type_vocab: i32,
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

impl Model {
    /// Hidden states `[B, L, hidden]`; `type_ids` `[B, L]` select the token-type embeddings
    /// (all type 0 when `None`).
    fn encode(&self, ids: &Array, type_ids: Option<&Array>, mask: &Array) -> Result<Array> {
        let ids = ids.astype(Dtype::Int32)?;
        let positions = self.position_ids(&ids)?;
        let types = match type_ids {
            Some(t) => self.token_types.forward(&t.astype(Dtype::Int32)?)?,
            None => self
                .token_types
                .forward(&Array::from_slice(&[0i32], &[1, 1])?)?,
        };
        let mut x = self
            .words
            .forward(&ids)?
            .add(&self.positions.forward(&positions)?)?
            .add(&types)?;
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
            let h = layer.intermediate.forward_activated(&x, self.act)?;
            x = layer
                .out_norm
                .forward(&layer.output.forward(&h)?.add(&x)?)?;
        }
        Ok(x)
    }
}

impl EmbeddingModel for Model {
    fn hidden_states(&self, ids: &Array, mask: &Array) -> Result<Array> {
        self.encode(ids, None, mask)
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

/// Checks the position scheme, strips the task model's prefix and drops the MLM/NSP heads,
/// registered buffers and `also_dropped`.
fn sanitize_encoder(args: &Args, weights: &mut WeightMap, also_dropped: &[&str]) -> Result<()> {
    if let Some(p) = &args.position_embedding_type {
        if p != "absolute" {
            return Err(ModelError::Unsupported(format!(
                "position_embedding_type `{p}` (only `absolute` is supported)"
            )));
        }
    }
    let mut dropped = vec![
        "cls.",
        "lm_head.",
        "embeddings.position_ids",
        "embeddings.token_type_ids",
    ];
    dropped.extend_from_slice(also_dropped);
    strip_task_heads(weights, &["bert.", "roberta."], &dropped)
}

impl Architecture for Model {
    type Args = Args;

    fn sanitize(args: &Args, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        sanitize_encoder(args, weights, &["pooler."])
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
            type_vocab: args.type_vocab_size,
        })
    }
}

/// The `config.json` keys of a BERT / XLM-RoBERTa cross-encoder: the encoder's and the labels.
#[derive(Debug, Clone, Deserialize)]
pub struct ClassifierArgs {
    /// The encoder.
    #[serde(flatten)]
    pub encoder: Args,
    /// `id2label` / `num_labels`.
    #[serde(flatten)]
    pub labels: Labels,
}

/// A BERT / XLM-RoBERTa cross-encoder: the encoder, then a `tanh` dense layer on the first
/// token and a linear classifier. BERT names them `pooler.dense` and `classifier`, XLM-RoBERTa
/// `classifier.dense` and `classifier.out_proj` (transformers' `RobertaClassificationHead`).
#[derive(Debug)]
pub struct Classifier {
    encoder: Model,
    pooler: Linear,
    classifier: Linear,
    labels: i32,
}

impl RerankerModel for Classifier {
    fn logits(&self, ids: &Array, type_ids: &Array, mask: &Array) -> Result<Array> {
        let types = self.uses_token_types().then_some(type_ids);
        let h = self.encoder.encode(ids, types, mask)?;
        let first = h.slice_axis(1, 0, 1)?.squeeze(&[1])?;
        let pooled = self.pooler.forward(&first)?.tanh()?;
        self.classifier.forward(&pooled)
    }

    fn num_labels(&self) -> usize {
        self.labels as usize
    }

    fn uses_token_types(&self) -> bool {
        self.encoder.type_vocab > 1
    }

    fn vocab_size(&self) -> usize {
        self.encoder.vocab_size()
    }

    fn max_tokens(&self) -> Option<usize> {
        self.encoder.max_tokens()
    }
}

impl Architecture for Classifier {
    type Args = ClassifierArgs;

    fn sanitize(
        args: &ClassifierArgs,
        weights: &mut WeightMap,
        _quant: Option<&QuantConfig>,
    ) -> Result<()> {
        // The pooler (BERT) and the classification head stay.
        sanitize_encoder(&args.encoder, weights, &[])
    }

    fn cache_schedule(_args: &ClassifierArgs) -> Result<Vec<LayerKind>> {
        Ok(Vec::new())
    }

    fn build(args: &ClassifierArgs, w: &mut ModelWeights) -> Result<Classifier> {
        let encoder = <Model as Architecture>::build(&args.encoder, w)?;
        let h = args.encoder.hidden_size;
        let labels = args.labels.count() as i32;
        let (pooler, classifier) = if args.encoder.roberta() {
            ("classifier.dense", "classifier.out_proj")
        } else {
            ("pooler.dense", "classifier")
        };
        Ok(Classifier {
            encoder,
            pooler: w.linear(pooler, h, h, true)?,
            classifier: w.linear(classifier, h, labels, true)?,
            labels,
        })
    }
}
