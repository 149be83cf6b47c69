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
    pub hidden_size: i32,
    pub num_hidden_layers: usize,
    pub num_attention_heads: i32,
    pub vocab_size: i32,
    #[serde(default)]
    pub intermediate_size: Option<i32>,
    #[serde(default)]
    pub num_key_value_heads: Option<i32>,
    #[serde(default)]
    pub head_dim: Option<i32>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default)]
    pub max_position_embeddings: Option<i64>,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
}

impl CommonArgs {
    pub fn kv_heads(&self) -> i32 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> i32 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

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
    pub num_experts: i32,
    pub num_experts_per_tok: i32,
    #[serde(default)]
    pub moe_intermediate_size: Option<i32>,
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
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
