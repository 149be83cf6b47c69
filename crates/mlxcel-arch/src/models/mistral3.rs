//! Mistral 3 (`Mistral3ForConditionalGeneration`: Mistral Small 3.1/3.2, Ministral 3, Devstral)
//! on the seed's `Mistral3Dynamic` route: the nested `text_config.model_type` decides the text
//! tower — `ministral3` builds the Ministral 3 decoder ([`super::ministral3`]), `mistral` or
//! `llama` (or none, transformers' default) the Llama/Mistral fallback ([`super::llama`]).
//!
//! With a vision tower in the checkpoint (and none of the text-only rules of
//! [`crate::detection::is_text_only`]), the Pixtral encoder ([`crate::vision::pixtral`]) and the
//! multimodal projector (RMSNorm, a 2×2 patch merger over `spatial_merge_size`, linear / act /
//! linear) are built lazily ([`LazyTower`]), and the model answers
//! [`LanguageModel::vision`]: an image's features fill the `[IMG]` positions of its rows (each
//! row followed by `[IMG_BREAK]`, the last by `[IMG_END]`, see
//! [`VisionLanguage::image_rows`]). Otherwise the tower and projector are left out (and
//! reported by the loader, see [`unused_tensors`]).
//!
//! Tensor names under either layout: `model.language_model.*` with a top-level `lm_head`,
//! `model.vision_tower.*`, `model.multi_modal_projector.*` (transformers 5) or
//! `language_model.model.*` / `language_model.lm_head`, `vision_tower.*`,
//! `multi_modal_projector.*` (earlier hub and mlx-community checkpoints, whose patch
//! convolution may be stored in MLX's `[out, kh, kw, in]` layout).

use mlxcel_core::{Array, WeightMap};
use mlxcel_quant::QuantConfig;
use serde::Deserialize;
use serde_json::Value;

use super::transformer::{Decoder, DecoderArgs, DecoderSpec, Transformer};
use super::{llama, ministral3};
use crate::cache::LayerCache;
use crate::model::{Architecture, LanguageModel, LayerKind};
use crate::nn::{Activation, Linear, Norm, NormKind};
use crate::registry::{parse_args, ModelType};
use crate::vision::pixtral::{PixtralConfig, PixtralVision};
use crate::vision::{ImageInput, LazyTower, VisionLanguage, VlmConfig};
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
pub enum Text {
    /// The Ministral 3 decoder.
    Ministral3(ministral3::Model),
    /// The Llama/Mistral decoder.
    Llama(llama::Model),
}

impl Text {
    fn decoder(&self) -> &dyn LanguageModel {
        match self {
            Text::Ministral3(m) => m,
            Text::Llama(m) => m,
        }
    }
}

/// The Mistral 3 facts of the outer config a vision load reads.
#[derive(Debug, Clone)]
pub struct VisionArgs {
    /// `image_token_index` (transformers' default 10).
    pub image_token_id: u32,
    /// `vision_feature_layer` as a hidden-state index from 0 (0: the patch embeddings).
    pub feature_layer: usize,
    /// `spatial_merge_size` (default 2).
    pub spatial_merge_size: usize,
    /// `projector_hidden_act` (default gelu).
    pub projector_act: Activation,
    /// `multimodal_projector_bias` (default false).
    pub projector_bias: bool,
    /// `text_config.hidden_size`.
    pub text_hidden: usize,
    /// `text_config.rms_norm_eps`: the projector's norm epsilon, as transformers builds it.
    pub norm_eps: f64,
    /// `vision_config`.
    pub pixtral: PixtralConfig,
}

impl VisionArgs {
    /// Reads the outer config; errors name the field.
    pub fn from_config(config: &Value) -> Result<VisionArgs> {
        let vision = config
            .get("vision_config")
            .filter(|v| v.is_object())
            .ok_or_else(|| ModelError::Config("vision_config: missing".into()))?;
        let pixtral = PixtralConfig::from_value(vision)?;
        let uint = |k: &str, default: u64| -> Result<u64> {
            match config.get(k) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v.as_u64().ok_or_else(|| {
                    ModelError::Config(format!("{k} = {v}: must be a non-negative integer"))
                }),
            }
        };
        let image_token_id = match config.get("image_token_index") {
            None | Some(Value::Null) => uint("image_token_id", 10)?,
            Some(_) => uint("image_token_index", 10)?,
        } as u32;
        let spatial_merge_size = uint("spatial_merge_size", 2)? as usize;
        if spatial_merge_size == 0 {
            return Err(ModelError::Config(
                "spatial_merge_size = 0: must be at least 1".into(),
            ));
        }
        let states = pixtral.num_hidden_layers as i64 + 1;
        let feature_layer = match config.get("vision_feature_layer") {
            None | Some(Value::Null) => -1,
            Some(Value::Number(n)) if n.as_i64().is_some() => n.as_i64().expect("checked"),
            Some(other) => {
                // transformers' projector norms one layer's width: a list does not run there.
                return Err(ModelError::Config(format!(
                    "vision_feature_layer = {other}: Mistral 3 takes one integer layer"
                )));
            }
        };
        let index = if feature_layer < 0 {
            states + feature_layer
        } else {
            feature_layer
        };
        if !(0..states).contains(&index) {
            return Err(ModelError::Config(format!(
                "vision_feature_layer = {feature_layer}: the vision tower has {states} hidden states"
            )));
        }
        let act_name = config
            .get("projector_hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("gelu");
        let projector_act = Activation::from_name(act_name).ok_or_else(|| {
            ModelError::Config(format!("projector_hidden_act = `{act_name}`: unsupported"))
        })?;
        let text = config.get("text_config");
        let text_hidden = text
            .and_then(|t| t.get("hidden_size"))
            .and_then(Value::as_u64)
            .ok_or_else(|| {
                ModelError::Config("text_config.hidden_size: missing or not an integer".into())
            })? as usize;
        Ok(VisionArgs {
            image_token_id,
            feature_layer: index as usize,
            spatial_merge_size,
            projector_act,
            projector_bias: config
                .get("multimodal_projector_bias")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            text_hidden,
            norm_eps: text
                .and_then(|t| t.get("rms_norm_eps"))
                .and_then(Value::as_f64)
                .unwrap_or(1e-5),
            pixtral,
        })
    }

    /// Pixels per merged patch side: `patch_size · spatial_merge_size`.
    fn unit(&self) -> usize {
        self.pixtral.patch_size * self.spatial_merge_size
    }

    /// `(rows, cols)` of merged patches of an image input, which must be one tile whose sides
    /// are multiples of `VisionArgs::unit` (as the Pixtral processor resizes them).
    pub fn grid(&self, image: &ImageInput) -> Result<(usize, usize)> {
        let [tiles, _, h, w] = image.shape();
        let unit = self.unit();
        if tiles != 1 || h % unit != 0 || w % unit != 0 {
            return Err(ModelError::Runtime(format!(
                "a Mistral 3 image is one tile with sides that are multiples of patch_size · spatial_merge_size = {unit}; given {tiles} tile(s) of {h}x{w}"
            )));
        }
        Ok((h / unit, w / unit))
    }
}

/// The Pixtral tower and Mistral 3's multimodal projector.
#[derive(Debug)]
pub struct Tower {
    pixtral: PixtralVision,
    norm: Norm,
    merging_layer: Linear,
    linear_1: Linear,
    linear_2: Linear,
    args: VisionArgs,
}

impl Tower {
    /// Builds the tower (`vision_tower.*`) and projector (`multi_modal_projector.*`).
    fn build(config: &Value, _vlm: &VlmConfig, w: &mut ModelWeights) -> Result<Tower> {
        let args = VisionArgs::from_config(config)?;
        let pixtral = PixtralVision::build(&args.pixtral, &mut w.scope("vision_tower"))?;
        let d = args.pixtral.hidden_size as i32;
        let m = args.spatial_merge_size as i32;
        let text = args.text_hidden as i32;
        let mut p = w.scope("multi_modal_projector");
        Ok(Tower {
            pixtral,
            norm: p.norm("norm", NormKind::Rms, d, args.norm_eps as f32)?,
            merging_layer: p.linear("patch_merger.merging_layer", d * m * m, d, false)?,
            linear_1: p.linear("linear_1", d, text, args.projector_bias)?,
            linear_2: p.linear("linear_2", text, text, args.projector_bias)?,
            args,
        })
    }

    /// The features `[rows · cols, text hidden]` of each image (`[1, 3, H, W]`), the images
    /// encoded together (block-diagonal attention), merged patches in row-major order.
    pub fn features(&self, images: &[ImageInput]) -> Result<Vec<Array>> {
        let dtype = self.pixtral.dtype()?;
        let pixels = images
            .iter()
            .map(|i| i.array(dtype))
            .collect::<Result<Vec<_>>>()?;
        let states = self
            .pixtral
            .hidden_states(&pixels, self.args.feature_layer)?;
        let x = states[self.args.feature_layer].squeeze(&[0])?;
        let x = self.norm.forward(&x)?;
        let d = self.args.pixtral.hidden_size as i32;
        let m = self.args.spatial_merge_size as i32;
        let mut at = 0;
        let mut merged = Vec::with_capacity(images.len());
        for image in images {
            let (rows, cols) = self.args.grid(image)?;
            let (gh, gw) = ((rows as i32) * m, (cols as i32) * m);
            let n = gh * gw;
            // torch's `unfold` of the [d, gh, gw] grid with an m×m kernel, stride m: one row
            // per merged patch (row-major), its features ordered (channel, kernel row, kernel
            // column).
            let grid = x
                .slice_axis(0, at, at + n)?
                .reshape(&[rows as i32, m, cols as i32, m, d])?
                .transpose(&[0, 2, 4, 1, 3])?
                .reshape(&[(rows * cols) as i32, d * m * m])?;
            merged.push(grid);
            at += n;
        }
        let merged = self
            .merging_layer
            .forward(&mlxcel_core::ops::concatenate(&merged, 0)?)?;
        let h = self
            .args
            .projector_act
            .apply(&self.linear_1.forward(&merged)?)?;
        let out = self.linear_2.forward(&h)?;
        let mut at = 0;
        images
            .iter()
            .map(|image| {
                let (rows, cols) = self.args.grid(image)?;
                let n = (rows * cols) as i32;
                let f = out.slice_axis(0, at, at + n)?;
                at += n;
                Ok(f)
            })
            .collect()
    }
}

/// A Mistral 3 checkpoint: its text tower, and the vision tower unless loaded text-only.
#[derive(Debug)]
pub struct Model {
    text: Text,
    tower: Option<LazyTower<Tower>>,
    vision: Option<VisionArgs>,
}

impl Model {
    /// The text tower `text_config.model_type` picked.
    pub fn text_tower(&self) -> &Text {
        &self.text
    }

    /// The vision tower and projector, `None` for a text-only load.
    pub fn tower(&self) -> Option<&LazyTower<Tower>> {
        self.tower.as_ref()
    }
}

impl LanguageModel for Model {
    fn embed(&self, tokens: &Array) -> Result<Array> {
        self.text.decoder().embed(tokens)
    }

    fn forward_embeddings(
        &self,
        embeddings: &Array,
        positions: Option<&Array>,
        caches: &mut [LayerCache],
        last_only: bool,
    ) -> Result<Array> {
        self.text
            .decoder()
            .forward_embeddings(embeddings, positions, caches, last_only)
    }

    fn final_hidden_states(&self, embeddings: &Array, caches: &mut [LayerCache]) -> Result<Array> {
        self.text.decoder().final_hidden_states(embeddings, caches)
    }

    fn vocab_size(&self) -> usize {
        self.text.decoder().vocab_size()
    }

    fn layer_schedule(&self) -> Vec<LayerKind> {
        self.text.decoder().layer_schedule()
    }

    fn vision(&self) -> Option<&dyn VisionLanguage> {
        self.tower.as_ref().map(|_| self as &dyn VisionLanguage)
    }
}

impl VisionLanguage for Model {
    fn text(&self) -> &dyn LanguageModel {
        self.text.decoder()
    }

    fn image_token_id(&self) -> u32 {
        self.vision.as_ref().map_or(10, |v| v.image_token_id)
    }

    fn image_token_count(&self, image: &ImageInput) -> Result<usize> {
        let (rows, cols) = self.vision_args()?.grid(image)?;
        Ok(rows * cols)
    }

    fn image_rows(&self, image: &ImageInput) -> Result<Option<(usize, usize)>> {
        self.vision_args()?.grid(image).map(Some)
    }

    fn image_features(&self, image: &ImageInput) -> Result<Array> {
        let tower = self
            .tower
            .as_ref()
            .ok_or_else(|| ModelError::Runtime("no vision tower".into()))?
            .get()?;
        let mut f = tower.features(std::slice::from_ref(image))?;
        Ok(f.remove(0))
    }
}

impl Model {
    fn vision_args(&self) -> Result<&VisionArgs> {
        self.vision
            .as_ref()
            .ok_or_else(|| ModelError::Runtime("no vision tower".into()))
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

    /// The text tower alone; [`load`] adds the vision tower when the checkpoint has one.
    fn build(args: &Args, w: &mut ModelWeights) -> Result<Self> {
        let (tower, spec) = args.spec()?;
        let decoder = Decoder::build(&spec, w)?;
        let text = match tower {
            TowerArgs::Ministral3(_) => Text::Ministral3(Transformer::new(decoder)),
            TowerArgs::Llama(_) => Text::Llama(Transformer::new(decoder)),
        };
        Ok(Model {
            text,
            tower: None,
            vision: None,
        })
    }
}

/// The vision tensors under the older names (`vision_tower.*`, `multi_modal_projector.*`),
/// with the patch convolution in PyTorch's layout.
fn sanitize_vision(config: &Value, weights: &mut WeightMap) -> Result<()> {
    weights.rename_prefix("model.vision_tower.", "vision_tower.")?;
    weights.rename_prefix("model.multi_modal_projector.", "multi_modal_projector.")?;
    let channels = config
        .get("vision_config")
        .and_then(|v| v.get("num_channels"))
        .and_then(Value::as_u64)
        .unwrap_or(3) as usize;
    crate::vision::siglip::patch_embedding_to_torch_layout(
        weights,
        "vision_tower.patch_conv.weight",
        channels,
    )
}

/// The `Mistral3Dynamic` directory route: builds the text tower `text_config.model_type` names
/// ([`Args::tower`]) from a Mistral 3 checkpoint's weights, and the (lazy) vision tower when
/// the checkpoint has one and is not text-only ([`crate::detection::is_text_only`]).
pub fn load(
    config: &Value,
    mut weights: WeightMap,
    options: &crate::registry::BuildOptions,
) -> Result<crate::registry::LoadedModel> {
    use crate::registry::{build_architecture, GenerationModel, LoadedModel};
    // The tower's tensors decide (as the loader's text-only report does): a projector alone
    // is left out with the rest.
    let has_vision = weights
        .names()
        .any(|n| n.starts_with("vision_tower.") || n.starts_with("model.vision_tower."));
    if crate::detection::is_text_only(config, has_vision) {
        let model = build_architecture::<Model>("Mistral3", config, weights, options)?;
        return Ok(LoadedModel::Generation(GenerationModel::Mistral3(
            Box::new(model),
        )));
    }
    let in_part = |part: &str| {
        let part = format!("model_type `mistral3`: {part}");
        move |e: ModelError| ModelError::InPart {
            part,
            source: Box::new(e),
        }
    };
    let args = VisionArgs::from_config(config).map_err(in_part("vision tower"))?;
    sanitize_vision(config, &mut weights)?;
    let vision_names: Vec<String> = unused_tensors(&weights);
    let mut vision = weights.clone();
    let text_names: Vec<String> = vision
        .names()
        .filter(|n| !vision_names.iter().any(|v| v == n))
        .map(str::to_string)
        .collect();
    for n in &vision_names {
        weights.remove(n);
    }
    for n in &text_names {
        vision.remove(n);
    }
    let mut model = build_architecture::<Model>("Mistral3", config, weights, options)?;
    let text_config = config.get("text_config").cloned().unwrap_or(Value::Null);
    let text_type = text_config
        .get("model_type")
        .and_then(Value::as_str)
        .and_then(ModelType::from_model_type)
        .unwrap_or(ModelType::Llama);
    let vlm = VlmConfig {
        text_config,
        text_type,
        vision_config: config.get("vision_config").cloned(),
    };
    let tower = LazyTower::new(
        "Mistral3 vision tower",
        config,
        &vlm,
        vision,
        options,
        Tower::build,
    )
    .map_err(in_part("vision tower"))?;
    model.tower = Some(tower);
    model.vision = Some(args);
    Ok(LoadedModel::Generation(GenerationModel::Mistral3(
        Box::new(model),
    )))
}
