//! OLMo 2: post-norm blocks (`post_attention_layernorm` after attention and
//! `post_feedforward_layernorm` after the MLP, no input norms) and RMSNorm over the full query
//! and key projections, before the heads are split.

use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{BlockTopology, DecoderArgs, DecoderSpec, QkNormSpec, Transformer};
use crate::{ModelError, Result};

fn default_rms_norm_eps() -> f32 {
    1e-5
}

/// The OLMo 2 spec of `args` (OLMo 3 adds its sliding layers to it).
pub fn olmo2_spec(args: &Args) -> Result<DecoderSpec> {
    if let Some(clip) = args.clip_qkv {
        return Err(ModelError::Unsupported(format!(
            "clip_qkv = {clip} (OLMo 2/3 checkpoints have none)"
        )));
    }
    let mut spec = base_spec(&args.common, false, "silu")?;
    spec.eps = args.rms_norm_eps;
    spec.topology = BlockTopology::PostNorm;
    spec.qk_norm = QkNormSpec::Full;
    spec.qkv_bias = args.attention_bias;
    spec.o_bias = args.attention_bias;
    Ok(spec)
}

/// The `config.json` keys of OLMo 2 (read after [`crate::config::sanitize_config_json`]).
/// OLMo 3 reads the same keys (its own file adds the sliding layers).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `rms_norm_eps`: the RMSNorms' epsilon; default `1e-5` (OLMo's, not llama's `1e-6`).
    /// A named field, so it is read here rather than by [`CommonArgs`].
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f32,
    /// `attention_bias`: biases on the q/k/v and output projections; default false.
    #[serde(default)]
    pub attention_bias: bool,
    /// `clip_qkv`: OLMo 1's clamp of q/k/v; OLMo 2 and 3 have none, so a set value is refused.
    #[serde(default)]
    pub clip_qkv: Option<f64>,
}

/// The OLMo 2 decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn spec(&self) -> Result<DecoderSpec> {
        olmo2_spec(self)
    }
}
