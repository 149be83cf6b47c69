//! Gemma 2: Gemma plus sandwich norms, logit soft-capping (attention and final), query scaling
//! by `query_pre_attn_scalar`, and alternating sliding/global layers.

use serde::Deserialize;

use super::common::CommonArgs;
use super::gemma::{sandwich_spec, GemmaArgs};
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::Result;

/// The `config.json` keys of Gemma 2 (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// The Gemma 2/3 keys (soft-capping, query scale, activation).
    #[serde(flatten)]
    pub gemma: GemmaArgs,
}

/// The Gemma 2 decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn spec(&self) -> Result<DecoderSpec> {
        let args = self;
        let c = &args.common;
        let mut spec = sandwich_spec(c, &args.gemma)?;
        // Without `layer_types`: even layers slide, odd layers are global.
        spec.windows = c.windows(|i| i % 2 == 0)?;
        Ok(spec)
    }
}
