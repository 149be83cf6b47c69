//! Idefics3 and SmolVLM (`Idefics3ForConditionalGeneration` / `SmolVLMForConditionalGeneration`,
//! `model_type: idefics3` / `smolvlm`: the same network) on the `Vlm` route: a SigLIP tower run
//! NaViT-style ([`SiglipVision::forward_navit`]: position ids bucketed from each patch's
//! fractional coordinates, as `Idefics3VisionEmbeddings`), the connector (a pixel shuffle that
//! folds each `scale_factor × scale_factor` block of patches into one position of
//! `scale_factor² · vision hidden` features, then a bias-free projection into the text width) and
//! the registered text decoder of `text_config` (Llama by default). Image positions are attended
//! causally, like text.
//!
//! The processor splits an image into tiles (`max_image_size` squares, plus the whole image
//! resized as the "global" tile) and frames each tile's run of `<image>` tokens with
//! `<fake_token_around_image>` and a `<row_r_col_c>` / `<global-img>` tag: each tile is one
//! [`ImageInput`] of `[1, 3, S, S]` and one run of image tokens here. The processor's tiles are
//! whole squares (it resizes to multiples of the tile side before splitting), so every patch is
//! real and `pixel_attention_mask` is all ones; the NaViT entry still computes the position ids
//! transformers does, which at some grid sizes are not simply `0 .. patches`.
//!
//! Checkpoint spellings: transformers' `model.text_model.*` / `model.vision_model.*` /
//! `model.connector.*` / `lm_head.*` (what 4.x and 5.x both write, and hub releases use), and
//! mlx-vlm's `language_model.model.*` / `language_model.lm_head.*` / `vision_model.*` /
//! `connector.*` with the patch convolution in MLX's layout.

use mlxcel_core::{Array, WeightMap};
use serde_json::{json, Value};

use crate::model::LanguageModel;
use crate::nn::Linear;
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
    "vision_model.",
    "connector.",
    "model.vision_model.",
    "model.connector.",
];

/// `LlamaConfig`'s defaults with the `rms_norm_eps` `Idefics3Config` gives its text config.
fn text_defaults() -> Value {
    json!({
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
    })
}

/// `Idefics3VisionConfig`'s defaults where they differ from `SiglipVisionConfig`'s.
fn vision_defaults() -> Value {
    json!({"hidden_size": 1152, "intermediate_size": 3072, "num_attention_heads": 16, "patch_size": 32})
}

/// The Idefics3 facts of the outer config.
#[derive(Debug, Clone)]
struct Idefics3Config {
    image_token_id: u32,
    scale_factor: usize,
}

fn outer(config: &Value) -> Result<Idefics3Config> {
    let int = |key: &str, default: u64| -> Result<u64> {
        match config.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_u64().ok_or_else(|| {
                ModelError::Config(format!(
                    "{key} = {v}: wrong type: must be a non-negative integer"
                ))
            }),
        }
    };
    let scale_factor = int("scale_factor", 2)? as usize;
    if scale_factor == 0 {
        return Err(ModelError::Config(
            "scale_factor = 0: must be positive".into(),
        ));
    }
    Ok(Idefics3Config {
        image_token_id: int("image_token_id", 128_257)? as u32,
        scale_factor,
    })
}

/// The tower's config, with the checks the connector needs: the patch grid folds evenly into
/// `scale_factor` blocks.
fn siglip_config(config: &Value, vlm: &VlmConfig) -> Result<SiglipConfig> {
    let vision = vlm
        .vision_config
        .as_ref()
        .ok_or_else(|| ModelError::Config("vision_config missing".into()))?;
    let sc = SiglipConfig::from_value(vision)?;
    let s = outer(config)?.scale_factor;
    if sc.patches_per_side() % s != 0 {
        return Err(ModelError::Config(format!(
            "scale_factor = {s}: does not divide the {} patches per side of vision_config (image_size {} / patch_size {})",
            sc.patches_per_side(),
            sc.image_size,
            sc.patch_size
        )));
    }
    Ok(sc)
}

/// The SigLIP tower and the connector.
#[derive(Debug)]
pub struct Tower {
    siglip: SiglipVision,
    projection: Linear,
    scale_factor: usize,
}

impl Tower {
    /// The SigLIP tower.
    pub fn siglip(&self) -> &SiglipVision {
        &self.siglip
    }

    /// One tile `[1, 3, S, S]` → its features `[(S / patch / scale)², text hidden]`.
    fn features(&self, pixels: &Array) -> Result<Array> {
        let side = (pixels.dim(2)? / self.siglip.config().patch_size as i32) as usize;
        let h = self.siglip.forward_navit(pixels, &[(side, side)])?;
        let shuffled = pixel_shuffle(&h, self.scale_factor)?;
        let out = self.projection.forward(&shuffled)?;
        let width = out.dim(-1)?;
        Ok(out.reshape(&[-1, width])?)
    }
}

/// `Idefics3Connector.pixel_shuffle`: `[B, side², E]` → `[B, (side / s)², E · s²]`, each output
/// position the `s × s` block of patches it covers, concatenated in the order transformers'
/// view / permute sequence produces.
pub fn pixel_shuffle(x: &Array, s: usize) -> Result<Array> {
    let (b, seq, e) = (x.dim(0)?, x.dim(1)?, x.dim(2)?);
    let side = (seq as f64).sqrt() as i32;
    let s = s as i32;
    if side * side != seq || side % s != 0 {
        return Err(ModelError::Runtime(format!(
            "pixel shuffle: {seq} positions are not a square whose side divides by {s}"
        )));
    }
    Ok(x.reshape(&[b, side, side / s, e * s])?
        .transpose(&[0, 2, 1, 3])?
        .reshape(&[b, side / s, side / s, e * s * s])?
        .transpose(&[0, 2, 1, 3])?
        .reshape(&[b, seq / (s * s), e * s * s])?)
}

/// An Idefics3 / SmolVLM checkpoint: its text decoder, and the tower unless loaded text-only.
#[derive(Debug)]
pub struct Model {
    text: GenerationModel,
    tower: Option<LazyTower<Tower>>,
    config: Idefics3Config,
    /// `patch_size · scale_factor`: a tile's side must be a multiple of it.
    block: usize,
}

impl Model {
    /// The vision tower, `None` for a text-only load.
    pub fn tower(&self) -> Option<&LazyTower<Tower>> {
        self.tower.as_ref()
    }
}

impl VisionFamily for Model {
    type Tower = Tower;
    const NAME: &'static str = "Idefics3";
    const VISION_PREFIXES: &'static [&'static str] = &["vision_model.", "connector."];

    fn config(config: &Value) -> Result<VlmConfig> {
        let mut defaults = text_defaults();
        // The outer config's tying is the one transformers reads for the whole model.
        defaults["tie_word_embeddings"] = config
            .get("tie_word_embeddings")
            .cloned()
            .unwrap_or(json!(false));
        let (mut text_config, text_type) = text_config_with_defaults(config, "llama", &defaults)?;
        text_config["tie_word_embeddings"] = defaults["tie_word_embeddings"].clone();
        outer(config)?;
        Ok(VlmConfig {
            text_config,
            text_type,
            vision_config: vision_config_with_defaults(config, &vision_defaults()),
        })
    }

    fn sanitize(config: &Value, weights: &mut WeightMap) -> Result<()> {
        weights.rename_prefix("model.vision_model.", "vision_model.")?;
        weights.rename_prefix("model.connector.", "connector.")?;
        weights.rename_prefix("model.text_model.", "model.")?;
        weights.rename_prefix("language_model.", "")?;
        let channels = config
            .get("vision_config")
            .and_then(|v| v.get("num_channels"))
            .and_then(Value::as_u64)
            .unwrap_or(3) as usize;
        patch_embedding_to_torch_layout(
            weights,
            "vision_model.embeddings.patch_embedding.weight",
            channels,
        )
    }

    fn build_tower(config: &Value, vlm: &VlmConfig, w: &mut ModelWeights) -> Result<Tower> {
        let sc = siglip_config(config, vlm)?;
        let g = outer(config)?;
        let text_hidden = vlm
            .text_config
            .get("hidden_size")
            .and_then(Value::as_u64)
            .ok_or_else(|| ModelError::Config("text_config.hidden_size missing".into()))?
            as i32;
        let siglip = SiglipVision::build(&sc, &mut w.scope("vision_model"))?;
        let in_features = (sc.hidden_size * g.scale_factor * g.scale_factor) as i32;
        let projection = w.scope("connector").linear(
            "modality_projection.proj",
            in_features,
            text_hidden,
            false,
        )?;
        Ok(Tower {
            siglip,
            projection,
            scale_factor: g.scale_factor,
        })
    }

    fn assemble(
        config: &Value,
        text: GenerationModel,
        tower: Option<LazyTower<Tower>>,
    ) -> Result<Model> {
        let g = outer(config)?;
        let vlm = <Model as VisionFamily>::config(config)?;
        let block = match &vlm.vision_config {
            Some(_) => siglip_config(config, &vlm)?.patch_size * g.scale_factor,
            None => 0,
        };
        Ok(Model {
            text,
            tower,
            config: g,
            block,
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
        let [tiles, _, h, w] = image.shape();
        if tiles != 1 {
            return Err(ModelError::Unsupported(format!(
                "an Idefics3 image input is one tile (the processor's tiles are separate inputs, each its own run of image tokens); given {tiles}"
            )));
        }
        if h != w || self.block == 0 || h % self.block != 0 {
            return Err(ModelError::Unsupported(format!(
                "an Idefics3 tile is a square whose side is a multiple of patch_size · scale_factor = {}; given {h}x{w}",
                self.block
            )));
        }
        let side = h / self.block;
        Ok(side * side)
    }

    fn image_features(&self, image: &ImageInput) -> Result<Array> {
        self.image_token_count(image)?;
        let tower = self
            .tower
            .as_ref()
            .ok_or_else(|| ModelError::Runtime("no vision tower".into()))?
            .get()?;
        let dtype = tower.siglip.dtype()?;
        tower.features(&image.array(dtype)?)
    }
}

crate::vision::vlm_model_impls!(Model, "Idefics3");
