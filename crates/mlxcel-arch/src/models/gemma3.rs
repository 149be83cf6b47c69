//! Gemma 3 vision-language (`Gemma3ForConditionalGeneration`, `model_type: gemma3`) on the
//! `Vlm` route: a SigLIP tower ([`crate::vision::siglip`]), the multimodal projector (average
//! pooling of the patch grid down to `mm_tokens_per_image` soft tokens, Gemma's `(1 + w)`
//! RMS norm, a projection into the text width) and the registered Gemma 3 text decoder
//! (`text_config`, `gemma3_text`). Image positions attend to each other bidirectionally
//! (transformers' `token_type_ids` block mask), the rest causally.
//!
//! A text-only checkpoint (see [`crate::detection::is_text_only`]) loads the text decoder alone.
//! Checkpoint spellings: `model.language_model.*` / `model.vision_tower.*` /
//! `model.multi_modal_projector.*` with a top-level `lm_head`, and `language_model.model.*` /
//! `language_model.lm_head` / `vision_tower.*` / `multi_modal_projector.*` (what transformers
//! 5.24 writes, and hub / mlx-vlm checkpoints); the tower's modules directly under
//! `vision_tower.` or under `vision_tower.vision_model.` (hub); mlx-vlm's patch convolution in
//! MLX's layout.

use mlxcel_core::{Array, WeightMap};
use serde_json::{json, Value};

use crate::model::LanguageModel;
use crate::nn::{Norm, NormKind};
use crate::registry::GenerationModel;
use crate::vision::siglip::{patch_embedding_to_torch_layout, SiglipConfig, SiglipVision};
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

/// `Gemma3TextConfig`'s defaults for the keys hub checkpoints leave out of `text_config`.
fn text_defaults() -> Value {
    json!({
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
    })
}

/// `SiglipVisionConfig` as Gemma 3 uses it (no pooling head).
fn vision_defaults() -> Value {
    json!({"model_type": "siglip_vision_model", "vision_use_head": false})
}

/// The Gemma 3 facts of the outer config.
#[derive(Debug, Clone)]
struct Gemma3Config {
    image_token_id: u32,
    mm_tokens_per_image: usize,
}

fn outer(config: &Value) -> Result<Gemma3Config> {
    let int = |keys: &[&str], default: u64| -> Result<u64> {
        for k in keys {
            match config.get(*k) {
                None | Some(Value::Null) => continue,
                Some(v) => {
                    return v.as_u64().ok_or_else(|| {
                        ModelError::Config(format!(
                            "{k} = {v}: wrong type: must be a non-negative integer"
                        ))
                    })
                }
            }
        }
        Ok(default)
    };
    let mm = int(&["mm_tokens_per_image"], 256)? as usize;
    let side = (mm as f64).sqrt() as usize;
    if mm == 0 || side * side != mm {
        return Err(ModelError::Config(format!(
            "mm_tokens_per_image = {mm}: must be a positive square"
        )));
    }
    Ok(Gemma3Config {
        image_token_id: int(&["image_token_index", "image_token_id"], 262_144)? as u32,
        mm_tokens_per_image: mm,
    })
}

/// The SigLIP tower and the projector.
#[derive(Debug)]
pub struct Tower {
    siglip: SiglipVision,
    soft_emb_norm: Norm,
    projection: Array,
    tokens_per_side: usize,
}

impl Tower {
    /// One image `[1, 3, S, S]` → its soft tokens `[mm_tokens_per_image, text hidden]`.
    fn features(&self, pixels: &Array) -> Result<Array> {
        let h = self.siglip.forward(pixels)?;
        let c = self.siglip.config();
        let (g, t) = (c.patches_per_side() as i32, self.tokens_per_side as i32);
        let k = g / t;
        let vh = c.hidden_size as i32;
        // AvgPool2d(k, stride k) over the (row, column) patch grid, row-major as transformers
        // flattens it.
        let pooled = h
            .reshape(&[t, k, t, k, vh])?
            .mean(&[1, 3], false)?
            .reshape(&[t * t, vh])?;
        let normed = self.soft_emb_norm.forward(&pooled)?;
        Ok(normed.matmul(&self.projection)?)
    }
}

/// A Gemma 3 checkpoint: its text decoder, and the tower unless loaded text-only.
#[derive(Debug)]
pub struct Model {
    text: GenerationModel,
    tower: Option<LazyTower<Tower>>,
    config: Gemma3Config,
}

impl Model {
    /// The vision tower, `None` for a text-only load.
    pub fn tower(&self) -> Option<&LazyTower<Tower>> {
        self.tower.as_ref()
    }
}

impl VisionFamily for Model {
    type Tower = Tower;
    const NAME: &'static str = "Gemma3";
    const VISION_PREFIXES: &'static [&'static str] = &["vision_tower.", "multi_modal_projector."];

    fn config(config: &Value) -> Result<VlmConfig> {
        let mut defaults = text_defaults();
        let text = config.get("text_config");
        let has_rope = |k: &str| text.and_then(|t| t.get(k)).is_some();
        if !has_rope("rope_theta") && !has_rope("rope_parameters") {
            defaults["rope_theta"] = json!(1_000_000.0);
        }
        // The outer config's tying is the one transformers reads for the whole model.
        defaults["tie_word_embeddings"] = config
            .get("tie_word_embeddings")
            .cloned()
            .unwrap_or(json!(true));
        let (mut text_config, text_type) =
            text_config_with_defaults(config, "gemma3_text", &defaults)?;
        if let Some(t) = config.get("tie_word_embeddings") {
            text_config["tie_word_embeddings"] = t.clone();
        }
        outer(config)?;
        Ok(VlmConfig {
            text_config,
            text_type,
            vision_config: vision_config_with_defaults(config, &vision_defaults()),
        })
    }

    fn sanitize(config: &Value, weights: &mut WeightMap) -> Result<()> {
        weights.rename_prefix("model.vision_tower.", "vision_tower.")?;
        // Hub checkpoints nest the tower's modules under `vision_model.`; transformers 5 saves
        // them directly under `vision_tower.`.
        weights.rename_prefix("vision_tower.vision_model.", "vision_tower.")?;
        weights.rename_prefix("model.multi_modal_projector.", "multi_modal_projector.")?;
        weights.rename_prefix("model.language_model.", "model.")?;
        weights.rename_prefix("language_model.", "")?;
        // SigLIP's pooling head does not touch `last_hidden_state`, which Gemma 3 reads.
        let head: Vec<String> = weights
            .names()
            .filter(|n| n.starts_with("vision_tower.head."))
            .map(str::to_string)
            .collect();
        for n in head {
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
        let vision = vlm
            .vision_config
            .as_ref()
            .ok_or_else(|| ModelError::Config("vision_config missing".into()))?;
        let sc = SiglipConfig::from_value(vision)?;
        let g = outer(config)?;
        let side = (g.mm_tokens_per_image as f64).sqrt() as usize;
        if sc.patches_per_side() % side != 0 {
            return Err(ModelError::Config(format!(
                "mm_tokens_per_image = {}: {side} tokens per side do not divide the {} patches per side",
                g.mm_tokens_per_image,
                sc.patches_per_side()
            )));
        }
        let text_hidden = vlm
            .text_config
            .get("hidden_size")
            .and_then(Value::as_u64)
            .ok_or_else(|| ModelError::Config("text_config.hidden_size missing".into()))?
            as i32;
        let siglip = SiglipVision::build(&sc, &mut w.scope("vision_tower"))?;
        let mut p = w.scope("multi_modal_projector");
        let soft_emb_norm = p.norm(
            "mm_soft_emb_norm",
            NormKind::RmsOffset,
            sc.hidden_size as i32,
            sc.layer_norm_eps as f32,
        )?;
        let projection = p.tensor(
            "mm_input_projection_weight",
            &[sc.hidden_size as i32, text_hidden],
        )?;
        Ok(Tower {
            siglip,
            soft_emb_norm,
            projection,
            tokens_per_side: side,
        })
    }

    fn assemble(
        config: &Value,
        text: GenerationModel,
        tower: Option<LazyTower<Tower>>,
    ) -> Result<Model> {
        Ok(Model {
            text,
            tower,
            config: outer(config)?,
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
                "a Gemma 3 image is one {}x{} tile (pan and scan crops are separate images); given {}",
                image.shape()[2],
                image.shape()[3],
                image.shape()[0]
            )));
        }
        Ok(self.config.mm_tokens_per_image)
    }

    fn image_features(&self, image: &ImageInput) -> Result<Array> {
        let tower = self
            .tower
            .as_ref()
            .ok_or_else(|| ModelError::Runtime("no vision tower".into()))?
            .get()?;
        let dtype = tower.projection.dtype()?;
        tower.features(&image.array(dtype)?)
    }

    fn bidirectional_images(&self) -> bool {
        true
    }
}

crate::vision::vlm_model_impls!(Model, "Gemma3");
