//! Mistral 3 (`Mistral3ForConditionalGeneration`: Mistral Small 3.1/3.2, Ministral 3, Devstral)
//! loaded as text only, on the seed's `Mistral3Dynamic` route: the nested
//! `text_config.model_type` decides the text tower — `ministral3` builds the Ministral 3 decoder
//! ([`super::ministral3`]), `mistral` or `llama` (or none, transformers' default) the
//! Llama/Mistral fallback ([`super::llama`]). The checkpoint's vision tower and projector, when
//! present, are left out of the model (and reported by the loader, see [`unused_tensors`]); the
//! text weights are read under either spelling of their prefix: `model.language_model.*` with a
//! top-level `lm_head` (transformers 5) or `language_model.model.*` / `language_model.lm_head`
//! (earlier hub and mlx-community checkpoints).

use mlxcel_core::{Array, WeightMap};
use mlxcel_quant::QuantConfig;
use serde::Deserialize;
use serde_json::Value;

use super::transformer::{Decoder, DecoderArgs, DecoderSpec, Transformer};
use super::{llama, ministral3};
use crate::cache::LayerCache;
use crate::model::{Architecture, LanguageModel, LayerKind};
use crate::registry::parse_args;
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

/// The tensor prefixes of the parts a text-only load leaves out.
const UNUSED_PREFIXES: &[&str] = &[
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
];

/// The `config.json` keys of a Mistral 3 checkpoint that the text-only load reads.
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// `text_config`: the text tower's config (required); its `model_type` picks the tower.
    pub text_config: Value,
    /// `tie_word_embeddings` of the outer config, which is the one transformers reads for the
    /// whole model (default true): without an `lm_head` tensor the head is the embedding table;
    /// a checkpoint's `lm_head`, when present, is used either way (transformers does not tie
    /// weights that both exist and differ). `text_config.tie_word_embeddings` plays no part.
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
}

/// The text tower's args, by `text_config.model_type`.
#[derive(Debug, Clone)]
pub enum TowerArgs {
    /// `ministral3`.
    Ministral3(ministral3::Args),
    /// `mistral`, `llama` or absent: the Llama/Mistral decoder.
    Llama(llama::Args),
}

impl Args {
    /// The second stage of the route: the tower `text_config.model_type` names, its args
    /// checked like any config's (an error names the `text_config` field).
    pub fn tower(&self) -> Result<TowerArgs> {
        let in_text_config = |e: ModelError| match e {
            ModelError::Config(m) => ModelError::Config(format!("text_config: {m}")),
            other => other,
        };
        match self.text_config.get("model_type") {
            Some(Value::String(t)) if t == "ministral3" => Ok(TowerArgs::Ministral3(
                parse_args(&self.text_config).map_err(in_text_config)?,
            )),
            None => Ok(TowerArgs::Llama(
                parse_args(&self.text_config).map_err(in_text_config)?,
            )),
            Some(Value::String(t)) if t == "mistral" || t == "llama" => Ok(TowerArgs::Llama(
                parse_args(&self.text_config).map_err(in_text_config)?,
            )),
            Some(other) => Err(ModelError::Unsupported(format!(
                "text_config.model_type = {other}: a Mistral 3 text tower must be `ministral3`, `mistral` or `llama`"
            ))),
        }
    }
}

impl Args {
    /// The tower and its decoder spec, with the outer config's head tying.
    fn spec(&self) -> Result<(TowerArgs, DecoderSpec)> {
        let tower = self.tower()?;
        let mut spec = match &tower {
            TowerArgs::Ministral3(a) => a.spec()?,
            TowerArgs::Llama(a) => a.spec()?,
        };
        spec.tie_word_embeddings = self.tie_word_embeddings.unwrap_or(true);
        Ok((tower, spec))
    }
}

/// The names of the tensors a text-only load of a Mistral 3 checkpoint leaves out (vision
/// tower and multimodal projector), sorted.
pub fn unused_tensors(weights: &WeightMap) -> Vec<String> {
    let mut names: Vec<String> = weights
        .names()
        .filter(|n| UNUSED_PREFIXES.iter().any(|p| n.starts_with(p)))
        .map(str::to_string)
        .collect();
    names.sort();
    names
}

/// A Mistral 3 checkpoint's text tower.
#[derive(Debug)]
pub enum Model {
    /// The Ministral 3 decoder.
    Ministral3(ministral3::Model),
    /// The Llama/Mistral decoder.
    Llama(llama::Model),
}

impl Model {
    fn decoder(&self) -> &dyn LanguageModel {
        match self {
            Model::Ministral3(m) => m,
            Model::Llama(m) => m,
        }
    }
}

impl LanguageModel for Model {
    fn embed(&self, tokens: &Array) -> Result<Array> {
        self.decoder().embed(tokens)
    }

    fn forward_embeddings(
        &self,
        embeddings: &Array,
        positions: Option<&Array>,
        caches: &mut [LayerCache],
        last_only: bool,
    ) -> Result<Array> {
        self.decoder()
            .forward_embeddings(embeddings, positions, caches, last_only)
    }

    fn final_hidden_states(&self, embeddings: &Array, caches: &mut [LayerCache]) -> Result<Array> {
        self.decoder().final_hidden_states(embeddings, caches)
    }

    fn vocab_size(&self) -> usize {
        self.decoder().vocab_size()
    }

    fn layer_schedule(&self) -> Vec<LayerKind> {
        self.decoder().layer_schedule()
    }
}

impl Architecture for Model {
    type Args = Args;

    /// Drops the vision tower and projector and brings the text weights to the decoder's
    /// canonical names.
    fn sanitize(args: &Args, weights: &mut WeightMap, quant: Option<&QuantConfig>) -> Result<()> {
        for name in unused_tensors(weights) {
            weights.remove(&name);
        }
        weights.rename_prefix("model.language_model.", "model.")?;
        weights.rename_prefix("language_model.", "")?;
        match args.tower()? {
            TowerArgs::Ministral3(a) => a.sanitize(weights, quant),
            TowerArgs::Llama(a) => a.sanitize(weights, quant),
        }
    }

    fn cache_schedule(args: &Args) -> Result<Vec<LayerKind>> {
        Ok(args.spec()?.1.layer_schedule())
    }

    fn build(args: &Args, w: &mut ModelWeights) -> Result<Self> {
        let (tower, spec) = args.spec()?;
        let decoder = Decoder::build(&spec, w)?;
        Ok(match tower {
            TowerArgs::Ministral3(_) => Model::Ministral3(Transformer::new(decoder)),
            TowerArgs::Llama(_) => Model::Llama(Transformer::new(decoder)),
        })
    }
}

/// The `Mistral3Dynamic` directory route: builds the text tower `text_config.model_type` names
/// ([`Args::tower`]) from a Mistral 3 checkpoint's weights.
pub fn load(
    config: &Value,
    weights: WeightMap,
    options: &crate::registry::BuildOptions,
) -> Result<crate::registry::LoadedModel> {
    use crate::registry::{build_architecture, GenerationModel, LoadedModel};
    let model = build_architecture::<Model>("Mistral3", config, weights, options)?;
    Ok(LoadedModel::Generation(GenerationModel::Mistral3(
        Box::new(model),
    )))
}
