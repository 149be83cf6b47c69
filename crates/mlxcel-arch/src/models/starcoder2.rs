//! StarCoder2: LayerNorms with biases, biases on every projection (`use_bias`), a plain
//! (non-gated) MLP `c_fc` → GELU-tanh → `c_proj` (renamed `up_proj`/`down_proj` at load), tied
//! embeddings, optional sliding window on every layer.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, plain_ffn, CommonArgs};
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::nn::NormKind;
use crate::sanitize::rename_in_layers;
use crate::Result;

fn default_norm_epsilon() -> f32 {
    1e-5
}

fn yes() -> bool {
    true
}

/// The `config.json` keys of StarCoder2 (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `norm_epsilon`: the LayerNorms' epsilon; default `1e-5`.
    #[serde(default = "default_norm_epsilon")]
    pub norm_epsilon: f32,
    /// `use_bias`: biases on every projection; default true.
    #[serde(default = "yes")]
    pub use_bias: bool,
}

/// The StarCoder2 decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        rename_in_layers(
            weights,
            self.common.num_hidden_layers,
            &[("mlp.c_fc", "mlp.up_proj"), ("mlp.c_proj", "mlp.down_proj")],
        )
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let c = &self.common;
        let mut spec = base_spec(c, true, "gelu_pytorch_tanh")?;
        spec.norm = NormKind::Layer;
        spec.eps = self.norm_epsilon;
        spec.qkv_bias = self.use_bias;
        spec.o_bias = self.use_bias;
        spec.mlp_bias = self.use_bias;
        spec.ffn = plain_ffn(c)?;
        spec.windows = c.windows(|_| c.sliding_window.is_some())?;
        Ok(spec)
    }
}
