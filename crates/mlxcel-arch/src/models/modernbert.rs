//! ModernBERT (`ModernBertModel`): pre-LN blocks with (by default) bias-free LayerNorms, no
//! attention norm in layer 0, a fused `Wqkv`, GeGLU `Wi` (first half through the activation
//! times the second half), rotary positions with a global and a local base, global attention
//! every `global_attn_every_n_layers` layers and a sliding window `|i - j| <= local_attention / 2`
//! on the others, and a `final_norm`. Its cross-encoder ([`Classifier`],
//! `ModernBertForSequenceClassification`) pools (first token or masked mean), then a dense +
//! activation + LayerNorm head and a linear classifier.

use mlxcel_core::{Array, Dtype, WeightMap};
use mlxcel_quant::QuantConfig;
use serde::Deserialize;
use serde_json::Value;

use crate::embedding::{attention_mask, bidirectional_attention, EmbeddingModel, Pooling};
use crate::model::{Architecture, LayerKind};
use crate::nn::{Activation, Embedding, Linear, Norm, NormKind, RopeConfig, RotaryEmbedding};
use crate::rerank::{Labels, RerankerModel};
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

fn default_eps() -> f32 {
    1e-5
}

fn three() -> usize {
    3
}

fn window() -> i32 {
    128
}

fn gelu() -> String {
    "gelu".to_string()
}

/// The `config.json` keys of ModernBERT.
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// Width of the hidden states.
    pub hidden_size: i32,
    /// Encoder layers.
    pub num_hidden_layers: i32,
    /// Attention heads.
    pub num_attention_heads: i32,
    /// Width of one GeGLU half.
    pub intermediate_size: i32,
    /// Rows of the token table.
    pub vocab_size: i32,
    /// The most positions the model was trained on.
    pub max_position_embeddings: i32,
    /// LayerNorm epsilon; default `1e-5`.
    #[serde(default = "default_eps")]
    pub norm_eps: f32,
    /// Biases on the LayerNorms; default false.
    #[serde(default)]
    pub norm_bias: bool,
    /// Biases on `Wqkv` / `Wo`; default false.
    #[serde(default)]
    pub attention_bias: bool,
    /// Biases on `Wi` / `Wo` of the MLP; default false.
    #[serde(default)]
    pub mlp_bias: bool,
    /// The GeGLU activation; default `gelu`.
    #[serde(default = "gelu")]
    pub hidden_activation: String,
    /// Every n-th layer (from 0) attends globally; default 3.
    #[serde(default = "three")]
    pub global_attn_every_n_layers: usize,
    /// The local window width; default 128 (keys within half of it on each side).
    #[serde(default = "window")]
    pub local_attention: i32,
    /// Rope base of the global layers.
    #[serde(default)]
    pub global_rope_theta: Option<f64>,
    /// Rope base of the local layers.
    #[serde(default)]
    pub local_rope_theta: Option<f64>,
    /// transformers 5: `full_attention` / `sliding_attention` per layer.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// transformers 5: rope bases per layer type.
    #[serde(default)]
    pub rope_parameters: Option<Value>,
}

impl Args {
    fn theta(&self, explicit: Option<f64>, layer_type: &str, default: f64) -> f64 {
        explicit
            .or_else(|| {
                self.rope_parameters
                    .as_ref()
                    .and_then(|r| r.get(layer_type))
                    .and_then(|r| r.get("rope_theta"))
                    .and_then(Value::as_f64)
            })
            .unwrap_or(default)
    }

    fn is_global(&self, layer: usize) -> Result<bool> {
        match &self.layer_types {
            Some(types) => match types.get(layer).map(String::as_str) {
                Some("full_attention") => Ok(true),
                Some("sliding_attention") => Ok(false),
                other => Err(ModelError::Config(format!(
                    "layer_types[{layer}] = {other:?}: expected `full_attention` or `sliding_attention`"
                ))),
            },
            None => Ok(layer % self.global_attn_every_n_layers.max(1) == 0),
        }
    }
}

#[derive(Debug)]
struct Layer {
    attn_norm: Option<Norm>,
    wqkv: Linear,
    wo: Linear,
    mlp_norm: Norm,
    wi: Linear,
    mlp_out: Linear,
    global: bool,
}

/// A ModernBERT encoder (see the module docs).
#[derive(Debug)]
pub struct Model {
    words: Embedding,
    embed_norm: Norm,
    layers: Vec<Layer>,
    final_norm: Norm,
    global_rope: RotaryEmbedding,
    local_rope: RotaryEmbedding,
    heads: i32,
    half_window: i32,
    act: Activation,
    hidden: i32,
    vocab: i32,
    max_positions: i32,
}

impl EmbeddingModel for Model {
    fn hidden_states(&self, ids: &Array, mask: &Array) -> Result<Array> {
        let ids = ids.astype(Dtype::Int32)?;
        let mut x = self.embed_norm.forward(&self.words.forward(&ids)?)?;
        let dtype = x.dtype()?;
        let global_mask = attention_mask(mask, dtype, None)?;
        let local_mask = attention_mask(mask, dtype, Some(self.half_window))?;
        let b = x.dim(0)?;
        let l = x.dim(1)?;
        let d = self.hidden / self.heads;
        for layer in &self.layers {
            let normed = match &layer.attn_norm {
                Some(n) => n.forward(&x)?,
                None => x.clone(),
            };
            // [B, L, 3 * H * D] → [3, B, H, L, D].
            let qkv = layer
                .wqkv
                .forward(&normed)?
                .reshape(&[b, l, 3, self.heads, d])?
                .transpose(&[2, 0, 3, 1, 4])?;
            let parts = qkv.split_equal(3, 0)?;
            let [q, k, v] = [0, 1, 2].map(|i| parts[i].squeeze(&[0]));
            let (q, k, v) = (q?, k?, v?);
            let (rope, mask) = if layer.global {
                (&self.global_rope, &global_mask)
            } else {
                (&self.local_rope, &local_mask)
            };
            let q = rope.forward(&q, 0)?;
            let k = rope.forward(&k, 0)?;
            let a = bidirectional_attention(&q, &k, &v, mask)?;
            x = x.add(&layer.wo.forward(&a)?)?;
            let h = layer.wi.forward(&layer.mlp_norm.forward(&x)?)?;
            let halves = h.split_equal(2, -1)?;
            let g = self.act.apply(&halves[0])?.multiply(&halves[1])?;
            x = x.add(&layer.mlp_out.forward(&g)?)?;
        }
        self.final_norm.forward(&x)
    }

    fn hidden_size(&self) -> usize {
        self.hidden as usize
    }

    fn vocab_size(&self) -> usize {
        self.vocab as usize
    }

    fn max_tokens(&self) -> Option<usize> {
        Some(self.max_positions.max(0) as usize)
    }
}

impl Architecture for Model {
    type Args = Args;

    fn sanitize(_args: &Args, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        super::bert::strip_task_heads(weights, &["model."], &["head.", "decoder."])
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
        let act = Activation::from_name(&args.hidden_activation).ok_or_else(|| {
            ModelError::Unsupported(format!("hidden_activation `{}`", args.hidden_activation))
        })?;
        let eps = args.norm_eps;
        let head_dim = h / heads;
        let rope = |base: f64| {
            RotaryEmbedding::new(&RopeConfig {
                base,
                head_dim,
                dims: head_dim,
                traditional: false,
                scaling: None,
                max_position_embeddings: None,
            })
        };
        let global_rope = rope(args.theta(args.global_rope_theta, "full_attention", 160_000.0))?;
        let local_rope = rope(args.theta(args.local_rope_theta, "sliding_attention", 10_000.0))?;
        w.keep_all(global_rope.arrays());
        w.keep_all(local_rope.arrays());
        let mut e = w.scope("embeddings");
        let words = e.embedding("tok_embeddings", args.vocab_size, h)?;
        let embed_norm = e.norm("norm", NormKind::Layer, h, eps)?;
        drop(e);
        let i = args.intermediate_size;
        let mut layers = Vec::new();
        {
            let mut all = w.scope("layers");
            for n in 0..args.num_hidden_layers as usize {
                let mut l = all.scope(n);
                layers.push(Layer {
                    attn_norm: if n == 0 {
                        None
                    } else {
                        Some(l.norm("attn_norm", NormKind::Layer, h, eps)?)
                    },
                    wqkv: l.linear("attn.Wqkv", h, 3 * h, args.attention_bias)?,
                    wo: l.linear("attn.Wo", h, h, args.attention_bias)?,
                    mlp_norm: l.norm("mlp_norm", NormKind::Layer, h, eps)?,
                    wi: l.linear("mlp.Wi", h, 2 * i, args.mlp_bias)?,
                    mlp_out: l.linear("mlp.Wo", i, h, args.mlp_bias)?,
                    global: args.is_global(n)?,
                });
            }
        }
        let final_norm = w.norm("final_norm", NormKind::Layer, h, eps)?;
        Ok(Model {
            words,
            embed_norm,
            layers,
            final_norm,
            global_rope,
            local_rope,
            heads,
            half_window: args.local_attention / 2,
            act,
            hidden: h,
            vocab: args.vocab_size,
            max_positions: args.max_position_embeddings,
        })
    }
}

fn cls() -> String {
    "cls".to_string()
}

/// The `config.json` keys of a ModernBERT cross-encoder: the encoder's, the head's and the
/// labels.
#[derive(Debug, Clone, Deserialize)]
pub struct ClassifierArgs {
    /// The encoder.
    #[serde(flatten)]
    pub encoder: Args,
    /// `cls` (first token) or `mean` (over the real tokens); default `cls`.
    #[serde(default = "cls")]
    pub classifier_pooling: String,
    /// The head's activation; default `gelu`.
    #[serde(default = "gelu")]
    pub classifier_activation: String,
    /// A bias on the head's dense layer; default false.
    #[serde(default)]
    pub classifier_bias: bool,
    /// `id2label` / `num_labels`.
    #[serde(flatten)]
    pub labels: Labels,
}

/// A ModernBERT cross-encoder (see the module docs): transformers'
/// `ModernBertForSequenceClassification`, `head` = `norm(act(dense(pooled)))`.
#[derive(Debug)]
pub struct Classifier {
    encoder: Model,
    pooling: Pooling,
    dense: Linear,
    act: Activation,
    norm: Norm,
    classifier: Linear,
    labels: i32,
}

impl RerankerModel for Classifier {
    fn logits(&self, ids: &Array, _type_ids: &Array, mask: &Array) -> Result<Array> {
        let h = self.encoder.hidden_states(ids, mask)?;
        let pooled = self.pooling.pool(&h, mask)?.astype(h.dtype()?)?;
        let x = self
            .norm
            .forward(&self.act.apply(&self.dense.forward(&pooled)?)?)?;
        self.classifier.forward(&x)
    }

    fn num_labels(&self) -> usize {
        self.labels as usize
    }

    fn uses_token_types(&self) -> bool {
        false
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
        _args: &ClassifierArgs,
        weights: &mut WeightMap,
        _quant: Option<&QuantConfig>,
    ) -> Result<()> {
        // `head.` is the classification head here, not the MLM head.
        super::bert::strip_task_heads(weights, &["model."], &["decoder."])
    }

    fn cache_schedule(_args: &ClassifierArgs) -> Result<Vec<LayerKind>> {
        Ok(Vec::new())
    }

    fn build(args: &ClassifierArgs, w: &mut ModelWeights) -> Result<Classifier> {
        let pooling = match args.classifier_pooling.as_str() {
            "cls" => Pooling::Cls,
            "mean" => Pooling::Mean,
            other => {
                return Err(ModelError::Unsupported(format!(
                    "classifier_pooling `{other}` (expected `cls` or `mean`)"
                )))
            }
        };
        let act = Activation::from_name(&args.classifier_activation).ok_or_else(|| {
            ModelError::Unsupported(format!(
                "classifier_activation `{}`",
                args.classifier_activation
            ))
        })?;
        let encoder = <Model as Architecture>::build(&args.encoder, w)?;
        let h = args.encoder.hidden_size;
        let labels = args.labels.count() as i32;
        Ok(Classifier {
            encoder,
            pooling,
            dense: w.linear("head.dense", h, h, args.classifier_bias)?,
            act,
            norm: w.norm("head.norm", NormKind::Layer, h, args.encoder.norm_eps)?,
            classifier: w.linear("classifier", h, labels, true)?,
            labels,
        })
    }
}
