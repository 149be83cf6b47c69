//! dots.llm1 (`dots1`, rednote-hilab): Qwen3 attention (per-head qk-norm, optional sliding
//! windows from `layer_types` / `max_window_layers`) with DeepSeek-V3 routing (see
//! [`V3MoeArgs`]) after the first `first_k_dense_replace` dense layers.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs, V3MoeArgs, V3MoeDefaults};
use super::transformer::{DecoderArgs, DecoderSpec, QkNormSpec, Transformer};
use crate::sanitize::{rename_in_layers, stack_mlp_experts};
use crate::Result;

/// The `config.json` keys of dots.llm1 (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// The mixture-of-experts keys (`n_routed_experts`, `n_group`, ...).
    #[serde(flatten)]
    pub moe: V3MoeArgs,
    /// `attention_bias`: biases on the q/k/v and output projections; default false.
    #[serde(default)]
    pub attention_bias: bool,
    /// `max_window_layers`: without `layer_types`, layers from this index on slide (when
    /// `sliding_window` is set); default: none slide.
    #[serde(default)]
    pub max_window_layers: Option<usize>,
}

/// The dots.llm1 decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

/// transformers' `Dots1Config` defaults.
const DEFAULTS: V3MoeDefaults = V3MoeDefaults {
    shared_experts: None,
    first_k_dense_replace: 0,
    norm_topk_prob: false,
};

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let n = self.common.num_hidden_layers;
        stack_mlp_experts(weights, n, self.moe.n_routed_experts as usize)?;
        rename_in_layers(weights, n, &[("mlp.shared_experts", "mlp.shared_expert")])
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let c = &self.common;
        let mut spec = base_spec(c, false, "silu")?;
        spec.qkv_bias = self.attention_bias;
        spec.o_bias = self.attention_bias;
        spec.qk_norm = QkNormSpec::PerHead;
        let first_sliding = self.max_window_layers.unwrap_or(c.num_hidden_layers);
        spec.windows = c.windows(|i| c.sliding_window.is_some() && i >= first_sliding)?;
        self.moe.apply(&mut spec, DEFAULTS)?;
        Ok(spec)
    }
}
