//! Baidu ERNIE 4.5 MoE (`ernie4_5_moe`, ERNIE-4.5-21B-A3B / 300B-A47B): llama attention with
//! interleaved rope and `use_bias` on every projection (the output head included), softmax routing whose choice adds
//! `moe_statics.e_score_correction_bias` (the kept weights are the plain softmax values,
//! renormalised), ungated shared experts (`moe_num_shared_experts · moe_intermediate_size`), and
//! MoE on every `moe_layer_interval`-th layer from `moe_layer_start_index` to
//! `moe_layer_end_index` (dense MLPs elsewhere). The multi-token-prediction tensors some releases
//! carry (`model.mtp_block.*`, `model.mtp_emb_norm.*`, ...) are not part of the forward pass and are dropped.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{
    DecoderArgs, DecoderSpec, FfnSpec, MoeSpec, SharedExpertSpec, Transformer,
};
use crate::sanitize::{rename_in_layers, stack_mlp_experts};
use crate::{ModelError, Result};

fn one() -> usize {
    1
}

fn yes() -> bool {
    true
}

/// The `config.json` keys of ERNIE 4.5 MoE (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `moe_num_experts`: routed experts per MoE layer (required).
    pub moe_num_experts: i32,
    /// `moe_k`: experts per token (required).
    pub moe_k: i32,
    /// `moe_intermediate_size`: width of one expert (required).
    pub moe_intermediate_size: i32,
    /// `moe_num_shared_experts`: shared experts, one MLP this many experts wide; default 0.
    #[serde(default)]
    pub moe_num_shared_experts: i32,
    /// `moe_layer_start_index`: the first MoE layer; default 0 (the hub configs say 1).
    #[serde(default)]
    pub moe_layer_start_index: usize,
    /// `moe_layer_end_index`: the last MoE layer, `-1` (default) for the last layer.
    #[serde(default)]
    pub moe_layer_end_index: Option<i64>,
    /// `moe_layer_interval`: layer `i` is MoE when `(i + 1) % interval == 0`; default 1.
    #[serde(default = "one")]
    pub moe_layer_interval: usize,
    /// `moe_use_aux_free`: the router has `e_score_correction_bias`; default true (transformers
    /// always has it).
    #[serde(default = "yes")]
    pub moe_use_aux_free: bool,
    /// `use_bias`: biases on the attention and MLP projections; default false.
    #[serde(default)]
    pub use_bias: bool,
}

/// The ERNIE 4.5 MoE decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let n = self.common.num_hidden_layers;
        let mtp: Vec<String> = weights
            .names()
            // transformers ignores any key with an `mtp` part (`model.mtp_block.0.*`,
            // `model.mtp_emb_norm.0.*`, ...).
            .filter(|name| name.split('.').any(|part| part.starts_with("mtp")))
            .map(str::to_string)
            .collect();
        for name in mtp {
            weights.remove(&name);
        }
        stack_mlp_experts(weights, n, self.moe_num_experts as usize)?;
        rename_in_layers(
            weights,
            n,
            &[
                ("mlp.shared_experts", "mlp.shared_expert"),
                ("mlp.moe_statics", "mlp.gate"),
            ],
        )?;
        // The correction bias is stored `[1, experts]` (one expert group).
        for i in 0..n {
            let name = format!("model.layers.{i}.mlp.gate.e_score_correction_bias");
            if weights.contains(&name) {
                let bias = weights.take(&name)?;
                weights.insert(name, bias.reshape(&[-1])?)?;
            }
        }
        Ok(())
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let c = &self.common;
        let n = c.num_hidden_layers;
        let mut spec = base_spec(c, true, "silu")?;
        spec.qkv_bias = self.use_bias;
        spec.o_bias = self.use_bias;
        spec.mlp_bias = self.use_bias;
        // transformers' `Ernie4_5_MoeForCausalLM` gives the head a bias too (even when tied).
        spec.lm_head_bias = self.use_bias;
        for rope in spec.rope.iter_mut().flatten() {
            rope.traditional = true;
        }
        let experts = self.moe_num_experts;
        if self.moe_k < 1 || self.moe_k > experts {
            return Err(ModelError::Config(format!(
                "moe_k = {}: must be between 1 and moe_num_experts = {experts}",
                self.moe_k
            )));
        }
        let end = match self.moe_layer_end_index {
            None | Some(-1) => n.saturating_sub(1),
            Some(e) if e >= 0 => e as usize,
            Some(e) => {
                return Err(ModelError::Config(format!(
                    "moe_layer_end_index = {e}: must be a layer index or -1"
                )))
            }
        };
        let interval = self.moe_layer_interval.max(1);
        let moe = MoeSpec {
            correction_bias: self.moe_use_aux_free,
            shared: (self.moe_num_shared_experts > 0).then(|| SharedExpertSpec {
                intermediate: self.moe_intermediate_size * self.moe_num_shared_experts,
                gated: false,
            }),
            ..MoeSpec::softmax(experts, self.moe_k, self.moe_intermediate_size, true)
        };
        for (i, ffn) in spec.ffn.iter_mut().enumerate() {
            if (i + 1) % interval == 0 && i >= self.moe_layer_start_index && i <= end {
                *ffn = FfnSpec::Moe(moe.clone());
            }
        }
        Ok(spec)
    }
}
