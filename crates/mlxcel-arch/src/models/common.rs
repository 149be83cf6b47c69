//! Config fields most decoder architectures share, with the defaults transformers uses, and the
//! derived quantities (kv heads, head dim, rope, per-layer windows) every spec needs.

use serde::Deserialize;
use serde_json::Value;

use crate::nn::{Activation, RopeConfig};
use crate::{ModelError, Result};

fn default_rope_theta() -> f64 {
    10000.0
}

fn default_eps() -> f32 {
    1e-6
}

/// Fields read by `#[serde(flatten)]` into each architecture's `ModelArgs`.
#[derive(Debug, Clone, Deserialize)]
pub struct CommonArgs {
    /// `hidden_size`: the model width (required).
    pub hidden_size: i32,
    /// `num_hidden_layers`: decoder layers (required).
    pub num_hidden_layers: usize,
    /// `num_attention_heads`: query heads per layer (required).
    pub num_attention_heads: i32,
    /// `vocab_size`: rows of the embedding table and the output head (required).
    pub vocab_size: i32,
    /// `intermediate_size`: the dense MLP width; required by architectures with dense MLPs
    /// (see [`CommonArgs::intermediate`]).
    #[serde(default)]
    pub intermediate_size: Option<i32>,
    /// `num_key_value_heads`: key/value heads (grouped-query attention); default
    /// `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<i32>,
    /// `head_dim`: width of one head; default `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<i32>,
    /// `rms_norm_eps`: the norms' epsilon; default `1e-6`.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    /// `rope_theta` (or `rope_parameters.rope_theta`, after sanitising): the rotary base;
    /// default `10000`.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// `rope_scaling`: the rotary scaling object (`rope_type` `linear`, `dynamic`, `llama3`,
    /// `yarn`, `longrope`, ...); absent for plain rope.
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    /// `partial_rotary_factor`: the share of each head's features that is rotated; default 1.
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// `max_position_embeddings`: the trained context length (read by dynamic and longrope
    /// scaling).
    #[serde(default)]
    pub max_position_embeddings: Option<i64>,
    /// `tie_word_embeddings`: reuse the embedding table as the output head; the default is the
    /// architecture's (see [`base_spec`]).
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    /// `hidden_act`: the MLP activation (`silu`, `gelu_pytorch_tanh`, ...); the default is the
    /// architecture's.
    #[serde(default)]
    pub hidden_act: Option<String>,
    /// `sliding_window`: keys per query on sliding-window layers; absent means none slide.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// `layer_types`: per layer `"full_attention"` or `"sliding_attention"`; overrides the
    /// architecture's own sliding pattern when present.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
}

impl CommonArgs {
    /// `num_key_value_heads`, else `num_attention_heads`.
    pub fn kv_heads(&self) -> i32 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// `head_dim`, else `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> i32 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// `intermediate_size`, or a [`ModelError::Config`] naming it when absent.
    pub fn intermediate(&self) -> Result<i32> {
        self.intermediate_size
            .ok_or_else(|| ModelError::Config("missing field `intermediate_size`".into()))
    }

    /// The activation named by `hidden_act` (or `default` when absent).
    pub fn activation(&self, default: &str) -> Result<Activation> {
        let name = self.hidden_act.as_deref().unwrap_or(default);
        Activation::from_name(name)
            .ok_or_else(|| ModelError::Unsupported(format!("hidden_act `{name}`")))
    }

    /// Rope of the global layers.
    pub fn rope(&self) -> RopeConfig {
        let head_dim = self.head_dim();
        let dims = match self.partial_rotary_factor {
            Some(f) => (head_dim as f64 * f) as i32,
            None => head_dim,
        };
        RopeConfig {
            base: self.rope_theta,
            head_dim,
            dims,
            traditional: false,
            scaling: self.rope_scaling.clone(),
            max_position_embeddings: self.max_position_embeddings,
        }
    }

    /// Per-layer sliding windows: from `layer_types` when the config has it, else `fallback(i)`
    /// decides whether layer `i` slides (over `sliding_window`).
    pub fn windows(&self, fallback: impl Fn(usize) -> bool) -> Result<Vec<Option<usize>>> {
        let n = self.num_hidden_layers;
        let sliding: Vec<bool> = match &self.layer_types {
            Some(types) => {
                if types.len() != n {
                    return Err(ModelError::Config(format!(
                        "layer_types has {} entries for {n} layers",
                        types.len()
                    )));
                }
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        "sliding_attention" => Ok(true),
                        "full_attention" => Ok(false),
                        other => Err(ModelError::Unsupported(format!("layer type `{other}`"))),
                    })
                    .collect::<Result<_>>()?
            }
            None => (0..n).map(fallback).collect(),
        };
        sliding
            .into_iter()
            .map(|s| match (s, self.sliding_window) {
                (false, _) => Ok(None),
                (true, Some(w)) if w > 0 => Ok(Some(w)),
                (true, w) => Err(ModelError::Config(format!(
                    "sliding_window = {}: a sliding layer needs a positive `sliding_window`",
                    w.map_or("(absent)".to_string(), |w| w.to_string())
                ))),
            })
            .collect()
    }
}

/// The plain llama-shaped spec of `c`: pre-norm blocks, RMSNorm, bias-free projections, dense
/// gated MLPs, global attention, rope on every layer. Architectures adjust the values that differ.
pub fn base_spec(
    c: &CommonArgs,
    tie_default: bool,
    act_default: &str,
) -> Result<super::transformer::DecoderSpec> {
    use super::transformer::{BlockTopology, DecoderSpec, FfnSpec, MixerSpec, QkNormSpec};
    let n = c.num_hidden_layers;
    let intermediate = c.intermediate()?;
    Ok(DecoderSpec {
        vocab: c.vocab_size,
        hidden: c.hidden_size,
        heads: c.num_attention_heads,
        kv_heads: c.kv_heads(),
        head_dim: c.head_dim(),
        norm: crate::nn::NormKind::Rms,
        eps: c.rms_norm_eps,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        qk_norm: QkNormSpec::None,
        attn_scale: 1.0 / (c.head_dim() as f32).sqrt(),
        attn_softcap: None,
        attn_output_gate: false,
        act: c.activation(act_default)?,
        topology: BlockTopology::PreNorm,
        mixers: vec![MixerSpec::Attention; n],
        rope: vec![Some(c.rope()); n],
        windows: vec![None; n],
        ffn: vec![FfnSpec::Dense { intermediate }; n],
        embed_scale: None,
        residual_scale: None,
        logit_scale: None,
        final_softcap: None,
        tie_word_embeddings: c.tie_word_embeddings.unwrap_or(tie_default),
    })
}

fn one() -> usize {
    1
}

/// Config fields of softmax-routed mixture-of-experts architectures (`num_local_experts`
/// arrives as `num_experts` after sanitising).
#[derive(Debug, Clone, Deserialize)]
pub struct MoeArgs {
    /// `num_experts` (or `num_local_experts`): routed experts per MoE layer (required).
    pub num_experts: i32,
    /// `num_experts_per_tok`: experts each token is routed to (required).
    pub num_experts_per_tok: i32,
    /// `moe_intermediate_size`: width of one routed expert; default `intermediate_size`.
    #[serde(default)]
    pub moe_intermediate_size: Option<i32>,
    /// `norm_topk_prob`: renormalise the kept routing weights to sum to one; default false.
    #[serde(default)]
    pub norm_topk_prob: bool,
    /// `decoder_sparse_step`: every this-many-th layer is an MoE layer; default 1 (all).
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    /// `mlp_only_layers`: layer indices that keep a dense MLP; default none.
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
}

impl MoeArgs {
    /// Turns the sparse layers of `spec` into expert blocks of `expert_intermediate` width:
    /// every layer not in `mlp_only_layers` whose index + 1 is a multiple of
    /// `decoder_sparse_step` (transformers' rule; all layers by default).
    pub fn apply(
        &self,
        spec: &mut super::transformer::DecoderSpec,
        expert_intermediate: i32,
        normalize: bool,
        shared_intermediate: Option<i32>,
    ) {
        // `shared_intermediate`: a sigmoid-gated shared expert of that width (Qwen2-MoE).
        use super::transformer::{FfnSpec, MoeSpec, SharedExpertSpec};
        let moe = MoeSpec {
            shared: shared_intermediate.map(|intermediate| SharedExpertSpec {
                intermediate,
                gated: true,
            }),
            ..MoeSpec::softmax(
                self.num_experts,
                self.num_experts_per_tok,
                expert_intermediate,
                normalize,
            )
        };
        let step = self.decoder_sparse_step;
        for (i, ffn) in spec.ffn.iter_mut().enumerate() {
            if !self.mlp_only_layers.contains(&i) && step > 0 && (i + 1) % step == 0 {
                *ffn = FfnSpec::Moe(moe.clone());
            }
        }
    }

    /// The width of the routed experts: `moe_intermediate_size`, else `intermediate_size`.
    pub fn expert_intermediate(&self, c: &CommonArgs) -> Result<i32> {
        match self.moe_intermediate_size {
            Some(i) => Ok(i),
            None => c.intermediate(),
        }
    }
}
