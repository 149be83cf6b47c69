//! LLaVA (`LlavaForConditionalGeneration`, `model_type: llava`) on the `Vlm` route: a CLIP
//! vision tower ([`crate::vision::clip`]) read at `vision_feature_layer` (one layer, or several
//! concatenated), the class position dropped under the `default` feature strategy, a two-layer
//! MLP projector, and the registered text decoder of `text_config` (Llama by default). Image
//! positions are attended causally, like text.
//!
//! Checkpoint spellings as for Gemma 3 ([`super::gemma3`]): `model.language_model.*` or
//! `language_model.model.*`, the tower under `vision_tower.` or `vision_tower.vision_model.`.

use mlxcel_core::{Array, WeightMap};
use serde_json::{json, Value};

use crate::model::LanguageModel;
use crate::nn::{Activation, Linear};
use crate::registry::GenerationModel;
use crate::vision::clip::{ClipConfig, ClipVision};
use crate::vision::siglip::patch_embedding_to_torch_layout;
use crate::vision::{
    text_config_with_defaults, vision_config_with_defaults, ImageInput, LazyTower, VisionFamily,
    VisionLanguage, VlmConfig,
};
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

/// The prefixes of the vision tensors as checkpoints spell them (before sanitising).
pub const RAW_VISION_PREFIXES: &[&str] = &[
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
];

/// `LlamaConfig`'s defaults for keys a LLaVA `text_config` may leave out.
fn text_defaults() -> Value {
    json!({
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
    })
}

/// The LLaVA facts of the outer config.
#[derive(Debug, Clone)]
struct LlavaConfig {
    image_token_id: u32,
    /// Hidden-state indices (negative from the end) whose features are concatenated.
    feature_layers: Vec<i64>,
    /// `vision_feature_select_strategy == "default"`: drop the class position.
    drop_class: bool,
    projector_act: Activation,
    projector_bias: bool,
}

fn outer(config: &Value) -> Result<LlavaConfig> {
    let image_token_id = ["image_token_index", "image_token_id"]
        .iter()
        .find_map(|k| config.get(*k).filter(|v| !v.is_null()))
        .map(|v| {
            v.as_u64().ok_or_else(|| {
                ModelError::Config(format!(
                    "image_token_index = {v}: must be a non-negative integer"
                ))
            })
        })
        .transpose()?
        .unwrap_or(32000) as u32;
    let feature_layers = match config.get("vision_feature_layer") {
        None | Some(Value::Null) => vec![-2],
        Some(Value::Number(n)) => vec![n.as_i64().ok_or_else(|| {
            ModelError::Config(format!("vision_feature_layer = {n}: must be an integer"))
        })?],
        Some(Value::Array(a)) if !a.is_empty() => a
            .iter()
            .map(|v| {
                v.as_i64().ok_or_else(|| {
                    ModelError::Config(format!("vision_feature_layer: {v} is not an integer"))
                })
            })
            .collect::<Result<_>>()?,
        Some(other) => {
            return Err(ModelError::Config(format!(
                "vision_feature_layer = {other}: must be an integer or a list of integers"
            )))
        }
    };
    let drop_class = match config
        .get("vision_feature_select_strategy")
        .and_then(Value::as_str)
        .unwrap_or("default")
    {
        "default" => true,
        "full" => false,
        other => {
            return Err(ModelError::Config(format!(
                "vision_feature_select_strategy = `{other}`: must be `default` or `full`"
            )))
        }
    };
    let act_name = config
        .get("projector_hidden_act")
        .and_then(Value::as_str)
        .unwrap_or("gelu");
    let projector_act = Activation::from_name(act_name).ok_or_else(|| {
        ModelError::Config(format!("projector_hidden_act = `{act_name}`: unsupported"))
    })?;
    Ok(LlavaConfig {
        image_token_id,
        feature_layers,
        drop_class,
        projector_act,
        projector_bias: config
            .get("multimodal_projector_bias")
            .and_then(Value::as_bool)
            .unwrap_or(true),
    })
}

/// The CLIP tower and the MLP projector.
#[derive(Debug)]
pub struct Tower {
    clip: ClipVision,
    linear_1: Linear,
    linear_2: Linear,
    /// Hidden-state indices (from 0) read, in order.
    layers: Vec<usize>,
    config: LlavaConfig,
}

impl Tower {
    fn features(&self, pixels: &Array) -> Result<Array> {
        let deepest = self.layers.iter().copied().max().unwrap_or(0);
        let states = self.clip.hidden_states(pixels, deepest)?;
        let picked = self
            .layers
            .iter()
            .map(|&i| {
                let s = &states[i];
                if self.config.drop_class {
                    let n = s.dim(1)?;
                    Ok(s.slice_axis(1, 1, n)?)
                } else {
                    Ok(s.clone())
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let x = mlxcel_core::ops::concatenate(&picked, -1)?;
        let h = self
            .config
            .projector_act
            .apply(&self.linear_1.forward(&x)?)?;
        let out = self.linear_2.forward(&h)?;
        let width = out.dim(-1)?;
        Ok(out.reshape(&[-1, width])?)
    }
}

/// A LLaVA checkpoint: its text decoder, and the tower unless loaded text-only.
#[derive(Debug)]
pub struct Model {
    text: GenerationModel,
    tower: Option<LazyTower<Tower>>,
    config: LlavaConfig,
    /// Image positions per image (patches, plus the class position under `full`).
    tokens_per_image: usize,
}

impl Model {
    /// The vision tower, `None` for a text-only load.
    pub fn tower(&self) -> Option<&LazyTower<Tower>> {
        self.tower.as_ref()
    }
}

fn clip_config(vlm: &VlmConfig) -> Result<ClipConfig> {
    ClipConfig::from_value(
        vlm.vision_config
            .as_ref()
            .ok_or_else(|| ModelError::Config("vision_config missing".into()))?,
    )
}

impl VisionFamily for Model {
    type Tower = Tower;
    const NAME: &'static str = "Llava";
    const VISION_PREFIXES: &'static [&'static str] = &["vision_tower.", "multi_modal_projector."];

    fn config(config: &Value) -> Result<VlmConfig> {
        let (text_config, text_type) =
            text_config_with_defaults(config, "llama", &text_defaults())?;
        outer(config)?;
        Ok(VlmConfig {
            text_config,
            text_type,
            vision_config: vision_config_with_defaults(
                config,
                &json!({"model_type": "clip_vision_model"}),
            ),
        })
    }

    fn sanitize(config: &Value, weights: &mut WeightMap) -> Result<()> {
        weights.rename_prefix("model.vision_tower.", "vision_tower.")?;
        weights.rename_prefix("model.multi_modal_projector.", "multi_modal_projector.")?;
        weights.rename_prefix("model.language_model.", "model.")?;
        weights.rename_prefix("language_model.", "")?;
        weights.rename_prefix("vision_tower.vision_model.", "vision_tower.")?;
        // Not on the feature path LLaVA reads (the hidden states of an inner layer), and the
        // position-id buffer older checkpoints store.
        let unused: Vec<String> = weights
            .names()
            .filter(|n| {
                n.starts_with("vision_tower.post_layernorm.")
                    || n.starts_with("vision_tower.head.")
                    || (n.starts_with("vision_tower.") && n.ends_with(".position_ids"))
            })
            .map(str::to_string)
            .collect();
        for n in unused {
            weights.remove(&n);
        }
        let channels = config
            .get("vision_config")
            .and_then(|v| v.get("num_channels"))
            .and_then(Value::as_u64)
            .unwrap_or(3) as usize;
        patch_embedding_to_torch_layout(
            weights,
            "vision_tower.embeddings.patch_embedding.weight",
            channels,
        )
    }

    fn build_tower(config: &Value, vlm: &VlmConfig, w: &mut ModelWeights) -> Result<Tower> {
        let cc = clip_config(vlm)?;
        let g = outer(config)?;
        let states = cc.num_hidden_layers as i64 + 1;
        let layers = g
            .feature_layers
            .iter()
            .map(|&l| {
                let i = if l < 0 { states + l } else { l };
                if (0..states).contains(&i) {
                    Ok(i as usize)
                } else {
                    Err(ModelError::Config(format!(
                        "vision_feature_layer {l}: the tower has {states} hidden states"
                    )))
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let text_hidden = vlm
            .text_config
            .get("hidden_size")
            .and_then(Value::as_u64)
            .ok_or_else(|| ModelError::Config("text_config.hidden_size missing".into()))?
            as i32;
        let clip = ClipVision::build(&cc, &mut w.scope("vision_tower"))?;
        let mut p = w.scope("multi_modal_projector");
        let in_features = (cc.hidden_size * layers.len()) as i32;
        let linear_1 = p.linear("linear_1", in_features, text_hidden, g.projector_bias)?;
        let linear_2 = p.linear("linear_2", text_hidden, text_hidden, g.projector_bias)?;
        Ok(Tower {
            clip,
            linear_1,
            linear_2,
            layers,
            config: g,
        })
    }

    fn assemble(
        config: &Value,
        text: GenerationModel,
        tower: Option<LazyTower<Tower>>,
    ) -> Result<Model> {
        let g = outer(config)?;
        let vlm = <Model as VisionFamily>::config(config)?;
        let tokens_per_image = match &vlm.vision_config {
            Some(_) => {
                let side = clip_config(&vlm)?.patches_per_side();
                side * side + usize::from(!g.drop_class)
            }
            None => 0,
        };
        Ok(Model {
            text,
            tower,
            config: g,
            tokens_per_image,
        })
    }
}

impl VisionLanguage for Model {
    fn text(&self) -> &dyn LanguageModel {
        &self.text
    }

    fn image_token_id(&self) -> u32 {
        self.config.image_token_id
    }

    fn image_token_count(&self, image: &ImageInput) -> Result<usize> {
        if image.shape()[0] != 1 {
            return Err(ModelError::Unsupported(format!(
                "a LLaVA image is one tile; given {}",
                image.shape()[0]
            )));
        }
        Ok(self.tokens_per_image)
    }

    fn image_features(&self, image: &ImageInput) -> Result<Array> {
        let tower = self
            .tower
            .as_ref()
            .ok_or_else(|| ModelError::Runtime("no vision tower".into()))?
            .get()?;
        tower.features(&image.array(tower.clip.dtype()?)?)
    }
}

crate::vision::vlm_model_impls!(Model, "Llava");
