//! Tencent Hunyuan, dense (`hunyuan_v1_dense`, Hunyuan-0.5B..7B) and mixture-of-experts
//! (`hunyuan_v1_moe`, Hunyuan-A13B): llama attention whose per-head qk-norm
//! (`query_layernorm`/`key_layernorm`) runs after rope, and rope scaled by a fixed NTK `alpha`
//! (`rope_scaling {"type": "dynamic", "alpha": ..}` stretches the base to
//! `theta · alpha^(d/(d-2))`; transformers' `ntk_alpha`). The MoE layers route by softmax over
//! `num_experts` (router `gate.wg`, top `moe_topk`, the kept weights always renormalised) and add
//! an ungated shared MLP (`shared_mlp`, `intermediate_size · num_shared_expert` wide). The
//! per-layer keys (`moe_topk`, `moe_intermediate_size`, `num_shared_expert`) may be one number
//! or a list with one entry per layer, as Hunyuan-A13B ships them.
//!
//! The older `model_type: "hunyuan"` (remote-code and mlx-community checkpoints) names both
//! variants; [`crate::detection::get_model_type`] picks one by `num_experts`.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{
    DecoderArgs, DecoderSpec, FfnSpec, MoeSpec, QkNormSpec, SharedExpertSpec, Transformer,
};
use crate::sanitize::{rename_in_layers, stack_mlp_experts};
use crate::{ModelError, Result};

fn yes() -> bool {
    true
}

/// A per-layer config value: one number for every layer, or a list with one per layer.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PerLayer {
    /// The same value on every layer.
    All(i32),
    /// One value per layer.
    Each(Vec<i32>),
}

impl PerLayer {
    /// The value of layer `i` of `n`; a list of another length is an error naming `field`.
    fn at(&self, i: usize, n: usize, field: &str) -> Result<i32> {
        match self {
            PerLayer::All(v) => Ok(*v),
            PerLayer::Each(list) if list.len() == n => Ok(list[i]),
            PerLayer::Each(list) => Err(ModelError::Config(format!(
                "{field} has {} entries for {n} layers",
                list.len()
            ))),
        }
    }
}

/// The `config.json` keys of both Hunyuan variants.
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `num_experts`: routed experts per layer; absent or 1 in dense checkpoints.
    #[serde(default)]
    pub num_experts: Option<i32>,
    /// `moe_topk`: experts per token, per layer; default 1.
    #[serde(default)]
    pub moe_topk: Option<PerLayer>,
    /// `moe_intermediate_size`: width of one routed expert, per layer; default
    /// `intermediate_size`.
    #[serde(default)]
    pub moe_intermediate_size: Option<PerLayer>,
    /// `num_shared_expert`: the shared MLP is this many times `intermediate_size` wide, per
    /// layer; default 1.
    #[serde(default)]
    pub num_shared_expert: Option<PerLayer>,
    /// `use_mixed_mlp_moe`: the MoE layers have the shared MLP; default true (transformers
    /// always builds it).
    #[serde(default = "yes")]
    pub use_mixed_mlp_moe: bool,
    /// `use_qk_norm`: default true; transformers always normalises, `false` is refused.
    #[serde(default = "yes")]
    pub use_qk_norm: bool,
    /// `use_cla`: cross-layer attention (layers reusing the previous layer's keys and values);
    /// not supported (`true` is an error).
    #[serde(default)]
    pub use_cla: bool,
    /// `attention_bias`: biases on the q/k/v and output projections; default false.
    #[serde(default)]
    pub attention_bias: bool,
    /// `mlp_bias`: biases on the MLP projections; default false.
    #[serde(default)]
    pub mlp_bias: bool,
}

/// `hunyuan_v1_dense`'s args.
#[derive(Debug, Clone, Deserialize)]
#[serde(transparent)]
pub struct DenseArgs(pub Args);

/// `hunyuan_v1_moe`'s args.
#[derive(Debug, Clone, Deserialize)]
#[serde(transparent)]
pub struct MoeArgs(pub Args);

/// The dense Hunyuan decoder.
pub type DenseModel = Transformer<DenseArgs>;
/// The mixture-of-experts Hunyuan decoder.
pub type MoeModel = Transformer<MoeArgs>;

impl Args {
    fn spec(&self, moe: bool) -> Result<DecoderSpec> {
        let c = &self.common;
        if self.use_cla {
            return Err(ModelError::Unsupported(
                "hunyuan use_cla = true (cross-layer attention)".into(),
            ));
        }
        if !self.use_qk_norm {
            return Err(ModelError::Unsupported(
                "hunyuan use_qk_norm = false (transformers always normalises queries and keys)"
                    .into(),
            ));
        }
        let mut spec = base_spec(c, false, "silu")?;
        spec.qkv_bias = self.attention_bias;
        spec.o_bias = self.attention_bias;
        spec.mlp_bias = self.mlp_bias;
        spec.qk_norm = QkNormSpec::PerHeadAfterRope;
        let rope = self.rope()?;
        spec.rope = vec![Some(rope); c.num_hidden_layers];
        let experts = self.num_experts.unwrap_or(1);
        if !moe {
            if experts > 1 {
                return Err(ModelError::Config(format!(
                    "num_experts = {experts}: a hunyuan_v1_dense checkpoint has no experts \
                     (model_type hunyuan_v1_moe has)"
                )));
            }
            return Ok(spec);
        }
        let n = c.num_hidden_layers;
        let intermediate = c.intermediate()?;
        for (i, ffn) in spec.ffn.iter_mut().enumerate() {
            let top_k = match &self.moe_topk {
                Some(k) => k.at(i, n, "moe_topk")?,
                None => 1,
            };
            if top_k < 1 || top_k > experts {
                return Err(ModelError::Config(format!(
                    "moe_topk = {top_k} (layer {i}): must be between 1 and num_experts = {experts}"
                )));
            }
            let width = match &self.moe_intermediate_size {
                Some(w) => w.at(i, n, "moe_intermediate_size")?,
                None => intermediate,
            };
            let shared = match (&self.num_shared_expert, self.use_mixed_mlp_moe) {
                (_, false) => None,
                (None, true) => Some(1),
                (Some(s), true) => Some(s.at(i, n, "num_shared_expert")?),
            }
            .filter(|&s| s > 0)
            .map(|s| SharedExpertSpec {
                intermediate: intermediate * s,
                gated: false,
            });
            // transformers' gate always renormalises the kept softmax weights (mlx-lm's
            // `hunyuan` does not; transformers is the reference).
            *ffn = FfnSpec::Moe(MoeSpec {
                shared,
                ..MoeSpec::softmax(experts, top_k, width, true)
            });
        }
        Ok(spec)
    }

    /// The rope of every layer: a fixed NTK `alpha` becomes a larger base (transformers'
    /// `ntk_alpha`: the checkpoints label it `dynamic`, but the frequencies do not depend on the
    /// sequence length); any other scaling is passed on.
    fn rope(&self) -> Result<crate::nn::RopeConfig> {
        let mut rope = self.common.rope();
        let alpha = rope
            .scaling
            .as_ref()
            .and_then(|s| s.get("alpha"))
            .and_then(|a| a.as_f64());
        if let Some(alpha) = alpha {
            let d = rope.head_dim as f64;
            if !(alpha.is_finite() && alpha > 0.0) || d <= 2.0 {
                return Err(ModelError::Config(format!(
                    "rope_scaling.alpha = {alpha}: must be positive and finite (head_dim {d})"
                )));
            }
            rope.base *= alpha.powf(d / (d - 2.0));
            rope.scaling = None;
        }
        Ok(rope)
    }

    fn sanitize(&self, weights: &mut WeightMap, moe: bool) -> Result<()> {
        let n = self.common.num_hidden_layers;
        rename_in_layers(
            weights,
            n,
            &[
                ("self_attn.query_layernorm", "self_attn.q_norm"),
                ("self_attn.key_layernorm", "self_attn.k_norm"),
                ("mlp.gate.wg", "mlp.gate"),
                ("mlp.shared_mlp", "mlp.shared_expert"),
            ],
        )?;
        if moe {
            stack_mlp_experts(weights, n, self.num_experts.unwrap_or(1).max(1) as usize)?;
        }
        Ok(())
    }
}

impl DecoderArgs for DenseArgs {
    fn spec(&self) -> Result<DecoderSpec> {
        self.0.spec(false)
    }

    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        self.0.sanitize(weights, false)
    }
}

impl DecoderArgs for MoeArgs {
    fn spec(&self) -> Result<DecoderSpec> {
        self.0.spec(true)
    }

    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        self.0.sanitize(weights, true)
    }
}
