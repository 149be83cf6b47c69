//! Ministral 3 (the text tower of Mistral 3 checkpoints, `Ministral3ForCausalLM`): Mistral's
//! decoder (a `sliding_window`, when set, on every layer) with yarn rope and Llama 4's query
//! scaling `1 + β·ln(1 + ⌊p / original_max_position_embeddings⌋)`, `β` being the rope
//! parameters' `llama_4_scaling_beta`.

use serde::Deserialize;
use serde_json::Value;

use super::common::{base_spec, CommonArgs};
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::nn::PositionScale;
use crate::{ModelError, Result};

/// The `config.json` keys of Ministral 3 (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `rope_parameters` (transformers 5): holds `llama_4_scaling_beta` and
    /// `original_max_position_embeddings`; hub configs in the classic spelling carry them in
    /// `rope_scaling` instead.
    #[serde(default)]
    pub rope_parameters: Option<Value>,
}

/// The Ministral 3 decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl Args {
    /// A number of the rope parameters (`rope_parameters`, else `rope_scaling`), or an error
    /// naming it.
    fn rope_number(&self, key: &str) -> Result<f64> {
        let found = [&self.rope_parameters, &self.common.rope_scaling]
            .into_iter()
            .flatten()
            .find_map(|rope| rope.get(key));
        match found {
            Some(v) => v.as_f64().ok_or_else(|| {
                ModelError::Config(format!("rope_parameters.{key} = {v}: must be a number"))
            }),
            None => Err(ModelError::Config(format!(
                "missing field `rope_parameters.{key}` (Ministral 3 scales its queries by it)"
            ))),
        }
    }

    /// The query scaling of every layer.
    pub fn query_scale(&self) -> Result<PositionScale> {
        let weight = self.rope_number("llama_4_scaling_beta")?;
        let period = self.rope_number("original_max_position_embeddings")?;
        if period < 1.0 {
            return Err(ModelError::Config(format!(
                "rope_parameters.original_max_position_embeddings = {period}: must be at least 1"
            )));
        }
        Ok(PositionScale {
            weight,
            shift: 0.0,
            period,
        })
    }
}

impl DecoderArgs for Args {
    fn spec(&self) -> Result<DecoderSpec> {
        let c = &self.common;
        let mut spec = base_spec(c, false, "silu")?;
        // As Mistral: `sliding_window` applies to every layer unless `layer_types` says otherwise.
        spec.windows = c.windows(|_| c.sliding_window.is_some())?;
        spec.query_scales = vec![Some(self.query_scale()?); c.num_hidden_layers];
        Ok(spec)
    }
}
