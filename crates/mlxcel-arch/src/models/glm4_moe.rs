//! GLM-4.5 / GLM-4.6 (`glm4_moe`): grouped-query attention with q/k/v biases, optional per-head
//! qk-norm (`use_qk_norm`) and rope on the first `partial_rotary_factor` (default ½) of each
//! head in the rotate-half layout (GPT-NeoX's, unlike GLM-4's interleaved pairs); dense MLPs on
//! the first `first_k_dense_replace` layers, DeepSeek-V3 routing after (see
//! [`V3MoeArgs`]). The multi-token-prediction layers the checkpoints carry after the last
//! decoder layer (`num_nextn_predict_layers`) are built only for self-speculative decoding
//! (see [`super::transformer::MtpSpec`]).

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs, V3MoeArgs, V3MoeDefaults};
use super::transformer::{DecoderArgs, DecoderSpec, MtpSpec, QkNormSpec, Transformer};
use crate::sanitize::{layers_after, rename_in_layers, stack_mlp_experts};
use crate::Result;

/// The `config.json` keys of GLM-4.5 (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// The mixture-of-experts keys (`n_routed_experts`, `n_group`, ...).
    #[serde(flatten)]
    pub moe: V3MoeArgs,
    /// `attention_bias`: biases on the q/k/v projections (never on `o_proj`); default false.
    #[serde(default)]
    pub attention_bias: bool,
    /// `use_qk_norm`: per-head RMSNorm of queries and keys before rope; default false.
    #[serde(default)]
    pub use_qk_norm: bool,
    /// `num_nextn_predict_layers`: multi-token-prediction layers after the decoder layers;
    /// default 0.
    #[serde(default)]
    pub num_nextn_predict_layers: usize,
}

/// The GLM-4.5 decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

/// transformers' `Glm4MoeConfig` defaults.
const DEFAULTS: V3MoeDefaults = V3MoeDefaults {
    shared_experts: Some(1),
    first_k_dense_replace: 1,
    norm_topk_prob: true,
};

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        // The multi-token-prediction layers after the decoder layers are rewritten alike.
        let n = self.common.num_hidden_layers;
        let n = n + layers_after(weights, n);
        stack_mlp_experts(weights, n, self.moe.n_routed_experts as usize)?;
        rename_in_layers(weights, n, &[("mlp.shared_experts", "mlp.shared_expert")])
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let mut common = self.common.clone();
        // transformers' `Glm4MoeConfig` rotates half of each head unless told otherwise.
        common.partial_rotary_factor = common.partial_rotary_factor.or(Some(0.5));
        let mut spec = base_spec(&common, false, "silu")?;
        spec.qkv_bias = self.attention_bias;
        if self.use_qk_norm {
            spec.qk_norm = QkNormSpec::PerHead;
        }
        self.moe.apply(&mut spec, DEFAULTS)?;
        spec.mtp = (self.num_nextn_predict_layers > 0).then_some(MtpSpec {
            layers: self.num_nextn_predict_layers,
        });
        Ok(spec)
    }
}
