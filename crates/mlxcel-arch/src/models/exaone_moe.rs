//! K-EXAONE (`exaone_moe`): EXAONE 4's attention (grouped-query with per-head q/k RMSNorm, a
//! local/global layer pattern such as `"LLLG"`, no positional encoding on the global layers when
//! there are sliding ones) in pre-norm blocks, dense MLPs on the first layers and DeepSeek-V3
//! routing after: sigmoid scores, an `e_score_correction_bias` for the choice, group-limited
//! top-k, renormalised and scaled by `routed_scaling_factor`, plus ungated shared experts.
//!
//! The checkpoints' multi-token-prediction block (`mtp.*`, for speculative decoding) is not
//! part of the forward pass: it is dropped here and `mlxcel inspect` lists it as its own role.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::exaone4;
use super::transformer::{
    BlockTopology, DecoderArgs, DecoderSpec, FfnSpec, MoeSpec, SharedExpertSpec, Transformer,
};
use crate::nn::{GroupLimit, GroupScore, RouterScoring};
use crate::sanitize::{rename_in_layers, stack_mlp_experts};
use crate::{ModelError, Result};

fn one() -> i32 {
    1
}

fn one_usize() -> usize {
    1
}

fn yes() -> bool {
    true
}

fn default_scaling() -> f64 {
    2.5
}

/// The `config.json` keys of K-EXAONE (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// EXAONE 4's keys: the shared ones and `sliding_window_pattern`.
    #[serde(flatten)]
    pub attention: exaone4::Args,
    /// `num_experts`: routed experts per MoE layer (required).
    pub num_experts: i32,
    /// `num_experts_per_tok`: experts per token (required).
    pub num_experts_per_tok: i32,
    /// `moe_intermediate_size`: width of one routed expert (required).
    pub moe_intermediate_size: i32,
    /// `num_shared_experts`: shared experts, run as one MLP of `num_shared_experts ·
    /// moe_intermediate_size`; default 1 (0: none).
    #[serde(default = "one")]
    pub num_shared_experts: i32,
    /// `mlp_layer_types` (transformers): per layer `"dense"` or `"sparse"`.
    #[serde(default)]
    pub mlp_layer_types: Option<Vec<String>>,
    /// `is_moe_layer` (hub checkpoints): per layer whether it is MoE; used without
    /// `mlp_layer_types`.
    #[serde(default)]
    pub is_moe_layer: Option<Vec<bool>>,
    /// `first_k_dense_replace`: without either list, the first this-many layers are dense;
    /// default 1.
    #[serde(default = "one_usize")]
    pub first_k_dense_replace: usize,
    /// `norm_topk_prob`: renormalise the kept routing weights; default true.
    #[serde(default = "yes")]
    pub norm_topk_prob: bool,
    /// `routed_scaling_factor`: multiplies the routing weights; default 2.5.
    #[serde(default = "default_scaling")]
    pub routed_scaling_factor: f64,
    /// `n_group`: expert groups for group-limited routing; default 1.
    #[serde(default = "one")]
    pub n_group: i32,
    /// `topk_group`: groups kept per token; default 1.
    #[serde(default = "one")]
    pub topk_group: i32,
}

/// The K-EXAONE decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl Args {
    /// Per layer: whether its feed-forward block is the mixture of experts.
    fn moe_layers(&self) -> Result<Vec<bool>> {
        let n = self.attention.common.num_hidden_layers;
        let layers: Vec<bool> = match (&self.mlp_layer_types, &self.is_moe_layer) {
            (Some(types), _) => types
                .iter()
                .map(|t| match t.as_str() {
                    "sparse" => Ok(true),
                    "dense" => Ok(false),
                    other => Err(ModelError::Config(format!(
                        "mlp_layer_types: `{other}` is neither \"dense\" nor \"sparse\""
                    ))),
                })
                .collect::<Result<_>>()?,
            (None, Some(flags)) => flags.clone(),
            (None, None) => (0..n).map(|i| i >= self.first_k_dense_replace).collect(),
        };
        if layers.len() != n {
            return Err(ModelError::Config(format!(
                "{} has {} entries for {n} layers",
                if self.mlp_layer_types.is_some() {
                    "mlp_layer_types"
                } else {
                    "is_moe_layer"
                },
                layers.len()
            )));
        }
        Ok(layers)
    }
}

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let n = self.attention.common.num_hidden_layers;
        let mtp: Vec<String> = weights
            .names()
            .filter(|name| name.starts_with("mtp."))
            .map(str::to_string)
            .collect();
        for name in mtp {
            weights.remove(&name);
        }
        stack_mlp_experts(weights, n, self.num_experts as usize)?;
        // Hub checkpoints keep the correction bias on the block, transformers on the router.
        for i in 0..n {
            let hub = format!("model.layers.{i}.mlp.e_score_correction_bias");
            if weights.contains(&hub) {
                weights.rename(
                    &hub,
                    &format!("model.layers.{i}.mlp.gate.e_score_correction_bias"),
                )?;
            }
        }
        rename_in_layers(weights, n, &[("mlp.shared_experts", "mlp.shared_expert")])
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let mut spec = self.attention.spec()?;
        spec.topology = BlockTopology::PreNorm;
        if self.n_group <= 0 || self.num_experts % self.n_group != 0 || self.topk_group <= 0 {
            return Err(ModelError::Config(format!(
                "num_experts {} must split into n_group {} groups (topk_group {})",
                self.num_experts, self.n_group, self.topk_group
            )));
        }
        let moe = MoeSpec {
            scoring: RouterScoring::Sigmoid,
            group_limit: Some(GroupLimit {
                groups: self.n_group,
                keep: self.topk_group,
                score: GroupScore::TopTwoSum,
            }),
            correction_bias: true,
            weight_scale: self.routed_scaling_factor as f32,
            shared: (self.num_shared_experts > 0).then(|| SharedExpertSpec {
                intermediate: self.moe_intermediate_size * self.num_shared_experts,
                gated: false,
            }),
            ..MoeSpec::softmax(
                self.num_experts,
                self.num_experts_per_tok,
                self.moe_intermediate_size,
                self.norm_topk_prob,
            )
        };
        for (ffn, is_moe) in spec.ffn.iter_mut().zip(self.moe_layers()?) {
            if is_moe {
                *ffn = FfnSpec::Moe(moe.clone());
            }
        }
        Ok(spec)
    }
}
