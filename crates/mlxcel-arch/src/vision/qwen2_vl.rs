//! Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`,
//! `Qwen2_5_VLForConditionalGeneration`), as transformers 5 computes them:
//!
//! - **processor** ([`smart_resize`], [`patchify`]): each image is resized so both sides are
//!   multiples of `patch_size · merge_size` with its pixel count in `[min_pixels, max_pixels]`,
//!   normalised, and cut into `patch_size²` patches repeated `temporal_patch_size` times, listed
//!   merge block by merge block (the order the patch merger reads them in);
//! - **vision tower** ([`VisionTower`]): the 3D patch-embedding convolution as one matmul (its
//!   kernel covers a whole flattened patch), a 2D rotary embedding (height and width positions
//!   on the two halves of the frequencies), bidirectional blocks — Qwen2-VL's LayerNorm +
//!   QuickGELU MLP, Qwen2.5-VL's RMSNorm + SwiGLU with window attention except on
//!   `fullatt_block_indexes` — and the patch merger (`merge_size²` neighbours concatenated, two
//!   linear layers around an exact GELU);
//! - **text decoder**: the Qwen2 decoder ([`crate::models::qwen2`]) with M-RoPE: each rotary
//!   frequency section (`mrope_section`) turns with the temporal, height or width position of
//!   the token ([`rope_index`], transformers' `get_rope_index`), and decode continues at the
//!   cache offset plus the prompt's position delta ([`crate::vision::VisionLanguage::position_delta`]).
//!
//! Checkpoints name the parts `visual.*` / `model.*` / `lm_head` (the hub releases, and what
//! transformers 5 saves), `model.visual.*` / `model.language_model.*` (transformers 5's module
//! layout) or `vision_tower.*` / `language_model.model.*` / `language_model.lm_head` (mlx-vlm,
//! with the patch-embedding kernel channels-last); all are read. The config is either flat (the
//! hub's: text keys at the top, `rope_scaling: {type: mrope, mrope_section}`) or nested
//! (`text_config`). The model loads through the `Vlm` route ([`crate::vision::load_vlm`]): the
//! registered `qwen2` decoder from the normalised text config, the tower lazily (read at the
//! first image). Without a vision tower (`vision_config` missing, null or empty,
//! `language_model_only: true`, or no vision weights) it loads as text only. Videos are refused.

use mlxcel_core::ops::{self, AttentionMask};
use mlxcel_core::{Array, Dtype, WeightMap};
use serde::Deserialize;
use serde_json::{Map, Value};

use std::ops::Range;

use crate::config::sanitize_config_json;
use crate::model::LanguageModel;
use crate::models::qwen2;
use crate::nn::{Activation, Linear, Norm, NormKind};
use crate::registry::{parse_args, GenerationModel};
use crate::vision::{
    ImageInput, LazyTower, MultimodalPrompt, VisionFamily, VisionLanguage, VlmConfig,
};
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

/// Which generation of the family a checkpoint is (its `model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `qwen2_vl`: LayerNorm + QuickGELU vision blocks, full attention everywhere.
    Qwen2Vl,
    /// `qwen2_5_vl`: RMSNorm + SwiGLU vision blocks, window attention except on
    /// `fullatt_block_indexes`.
    Qwen2_5Vl,
}

impl Family {
    fn from_model_type(t: &str) -> Result<Family> {
        match t {
            "qwen2_vl" => Ok(Family::Qwen2Vl),
            "qwen2_5_vl" => Ok(Family::Qwen2_5Vl),
            other => Err(ModelError::Config(format!(
                "model_type = {other:?}: not a Qwen2-VL / Qwen2.5-VL checkpoint"
            ))),
        }
    }
}

fn default_image_token_id() -> i32 {
    151655
}

fn default_video_token_id() -> i32 {
    151656
}

/// The `config.json` keys of a Qwen2-VL / Qwen2.5-VL checkpoint.
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// `qwen2_vl` or `qwen2_5_vl`.
    pub model_type: String,
    /// `text_config`: the decoder's keys (transformers 5); absent in the hub's flat configs,
    /// whose text keys sit at the top level.
    #[serde(default)]
    pub text_config: Option<Value>,
    /// `vision_config`: the tower's keys; missing, null or empty means text only.
    #[serde(default)]
    pub vision_config: Option<Value>,
    /// `language_model_only`: load the decoder alone even when vision weights are present.
    #[serde(default)]
    pub language_model_only: bool,
    /// `image_token_id`: the placeholder the processor repeats once per merged patch.
    #[serde(default = "default_image_token_id")]
    pub image_token_id: i32,
    /// `video_token_id` (videos are not supported yet; their placeholders are refused).
    #[serde(default = "default_video_token_id")]
    pub video_token_id: i32,
    /// `tie_word_embeddings` of the outer config (default false, as transformers'); a pre-v5
    /// `text_config.tie_word_embeddings: true` ties too.
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    /// Every other top-level key: the text keys of a flat config.
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// The text decoder's config, normalised: its `qwen2` args and the M-RoPE sections.
#[derive(Debug, Clone)]
pub struct TextArgs {
    /// The Qwen2 decoder's args (rope scaling stripped of the `mrope` marker).
    pub qwen2: qwen2::Args,
    /// `mrope_section`: rotary frequencies per temporal, height and width section (sum
    /// `head_dim / 2`); transformers' default `[16, 24, 24]`.
    pub mrope_section: [usize; 3],
}

impl Args {
    /// The family `model_type` names.
    pub fn family(&self) -> Result<Family> {
        Family::from_model_type(&self.model_type)
    }

    /// Whether the config asks for the vision tower at all (the checkpoint must also hold it).
    pub fn wants_vision(&self) -> bool {
        if self.language_model_only {
            return false;
        }
        match &self.vision_config {
            None | Some(Value::Null) => false,
            Some(Value::Object(o)) => !o.is_empty(),
            Some(_) => true,
        }
    }

    /// The text decoder's config (`qwen2`) from `text_config` or the flat top level, checked:
    /// the outer tying in, the `mrope` marker out of `rope_scaling`.
    pub fn text_config_value(&self) -> Result<Value> {
        self.text()?;
        Ok(self.normalized_text()?.0)
    }

    /// The text decoder's args from `text_config` or the flat top level.
    pub fn text(&self) -> Result<TextArgs> {
        let (text, mrope_section) = self.normalized_text()?;
        let qwen2: qwen2::Args = parse_args(&text).map_err(|e| self.in_text(e))?;
        let half = qwen2
            .common
            .head_dim
            .unwrap_or(qwen2.common.hidden_size / qwen2.common.num_attention_heads.max(1))
            / 2;
        if mrope_section.iter().sum::<usize>() != half as usize {
            return Err(self.in_text(ModelError::Config(format!(
                "rope_scaling.mrope_section = {mrope_section:?}: must sum to head_dim / 2 = {half}"
            ))));
        }
        Ok(TextArgs {
            qwen2,
            mrope_section,
        })
    }

    /// A config error inside `text_config` says so.
    fn in_text(&self, e: ModelError) -> ModelError {
        match e {
            ModelError::Config(m) if self.text_config.is_some() => {
                ModelError::Config(format!("text_config: {m}"))
            }
            other => other,
        }
    }

    fn normalized_text(&self) -> Result<(Value, [usize; 3])> {
        let mut text = match &self.text_config {
            Some(Value::Object(t)) => t.clone(),
            Some(other) => {
                return Err(ModelError::Config(format!(
                    "text_config = {other}: wrong type: must be an object"
                )))
            }
            None => self.rest.clone(),
        };
        let nested_tie = text.get("tie_word_embeddings").and_then(Value::as_bool);
        let tie = self.tie_word_embeddings.unwrap_or(false) || nested_tie.unwrap_or(false);
        text.insert("tie_word_embeddings".into(), Value::Bool(tie));
        let mut text = match sanitize_config_json(Value::Object(text)) {
            Value::Object(t) => t,
            _ => unreachable!("sanitising an object gives an object"),
        };
        let section = ["rope_scaling", "rope_parameters"]
            .iter()
            .find_map(|k| text.get(*k).and_then(|r| r.get("mrope_section")).cloned());
        let mrope_section = match section {
            None => [16, 24, 24],
            Some(v) => {
                let s: Vec<usize> = serde_json::from_value(v.clone()).map_err(|_| {
                    self.in_text(ModelError::Config(format!(
                        "rope_scaling.mrope_section = {v}: must be three non-negative integers"
                    )))
                })?;
                <[usize; 3]>::try_from(s.as_slice()).map_err(|_| {
                    self.in_text(ModelError::Config(format!(
                        "rope_scaling.mrope_section = {v}: must have three entries (temporal, height, width)"
                    )))
                })?
            }
        };
        // `mrope` is plain rope per section; the sections are applied through the positions.
        let plain = text
            .get("rope_scaling")
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(Value::as_str)
            .is_none_or(|t| t == "mrope" || t == "default");
        if plain {
            text.remove("rope_scaling");
        }
        text.insert("model_type".into(), Value::from("qwen2"));
        Ok((Value::Object(text), mrope_section))
    }

    /// The vision tower's args (`None` when the config leaves it out).
    pub fn vision(&self) -> Result<Option<VisionArgs>> {
        if !self.wants_vision() {
            return Ok(None);
        }
        let v = self.vision_config.clone().unwrap_or(Value::Null);
        serde_json::from_value(v)
            .map(Some)
            .map_err(|e| ModelError::Config(format!("vision_config: {e}")))
    }
}

fn theta_default() -> f64 {
    10000.0
}

/// The `vision_config` keys (both families; each reads its own, with transformers' defaults).
#[derive(Debug, Clone, Deserialize)]
pub struct VisionArgs {
    /// `depth`: blocks.
    #[serde(default)]
    pub depth: Option<usize>,
    /// `embed_dim`: the Qwen2-VL tower's width.
    #[serde(default)]
    pub embed_dim: Option<i32>,
    /// `hidden_size`: Qwen2-VL's merger output (the text width); Qwen2.5-VL's tower width.
    #[serde(default)]
    pub hidden_size: Option<i32>,
    /// `out_hidden_size`: Qwen2.5-VL's merger output (the text width).
    #[serde(default)]
    pub out_hidden_size: Option<i32>,
    /// `num_heads`.
    #[serde(default)]
    pub num_heads: Option<i32>,
    /// `num_attention_heads` (transformers' attribute alias of `num_heads`).
    #[serde(default)]
    pub num_attention_heads: Option<i32>,
    /// `mlp_ratio`: Qwen2-VL's MLP width over `embed_dim`.
    #[serde(default)]
    pub mlp_ratio: Option<f64>,
    /// `intermediate_size`: Qwen2.5-VL's MLP width.
    #[serde(default)]
    pub intermediate_size: Option<i32>,
    /// `hidden_act`: `quick_gelu` (Qwen2-VL) or `silu` (Qwen2.5-VL) by default.
    #[serde(default)]
    pub hidden_act: Option<String>,
    /// `in_channels`.
    #[serde(default)]
    pub in_channels: Option<i32>,
    /// `in_chans`: the hub configs' spelling of `in_channels` (both may be present).
    #[serde(default)]
    pub in_chans: Option<i32>,
    /// `patch_size`.
    #[serde(default)]
    pub patch_size: Option<i32>,
    /// `spatial_patch_size`: the hub configs' second spelling of `patch_size`.
    #[serde(default)]
    pub spatial_patch_size: Option<i32>,
    /// `spatial_merge_size`: patches merged per side into one text token.
    #[serde(default)]
    pub spatial_merge_size: Option<i32>,
    /// `temporal_patch_size`: frames per patch (an image is repeated this many times).
    #[serde(default)]
    pub temporal_patch_size: Option<i32>,
    /// `window_size`: Qwen2.5-VL's attention window side in pixels.
    #[serde(default)]
    pub window_size: Option<i32>,
    /// `fullatt_block_indexes`: Qwen2.5-VL's blocks with full attention.
    #[serde(default)]
    pub fullatt_block_indexes: Option<Vec<usize>>,
    /// `rope_parameters.rope_theta` (or a top-level `rope_theta`); default 10000.
    #[serde(default)]
    pub rope_parameters: Option<Value>,
    /// A top-level `rope_theta`.
    #[serde(default = "theta_default")]
    pub rope_theta: f64,
}

/// The vision tower's shape, resolved per family.
#[derive(Debug, Clone)]
pub struct VisionShape {
    /// Blocks.
    pub depth: usize,
    /// Tower width.
    pub width: i32,
    /// Attention heads.
    pub heads: i32,
    /// MLP width.
    pub mlp: i32,
    /// Merger output width (the text decoder's `hidden_size`).
    pub out: i32,
    /// Input channels.
    pub channels: i32,
    /// Patch side in pixels.
    pub patch: i32,
    /// Patches merged per side.
    pub merge: i32,
    /// Frames per patch.
    pub temporal: i32,
    /// Qwen2.5-VL's window side in pixels (`None`: full attention in every block).
    pub window: Option<i32>,
    /// Blocks with full attention (every block without windows).
    pub full_attention: Vec<usize>,
    /// The MLP's activation name.
    pub act: String,
    /// Rotary base.
    pub theta: f64,
}

impl VisionShape {
    /// Values per flattened patch: `channels · temporal · patch²`.
    pub fn patch_values(&self) -> i32 {
        self.channels * self.temporal * self.patch * self.patch
    }

    fn resolve(family: Family, v: &VisionArgs) -> Result<VisionShape> {
        let depth = v.depth.unwrap_or(32);
        let heads = v.num_heads.or(v.num_attention_heads).unwrap_or(16);
        let theta = v
            .rope_parameters
            .as_ref()
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(v.rope_theta);
        let (width, mlp, out, act, window, full_attention) = match family {
            Family::Qwen2Vl => {
                let width = v.embed_dim.unwrap_or(1280);
                let mlp = (width as f64 * v.mlp_ratio.unwrap_or(4.0)) as i32;
                let out = v.hidden_size.unwrap_or(3584);
                let act = v.hidden_act.clone().unwrap_or("quick_gelu".into());
                (width, mlp, out, act, None, (0..depth).collect())
            }
            Family::Qwen2_5Vl => {
                let width = v.hidden_size.unwrap_or(3584);
                let mlp = v.intermediate_size.unwrap_or(3420);
                let out = v.out_hidden_size.unwrap_or(3584);
                let act = v.hidden_act.clone().unwrap_or("silu".into());
                let full = v
                    .fullatt_block_indexes
                    .clone()
                    .unwrap_or(vec![7, 15, 23, 31]);
                (
                    width,
                    mlp,
                    out,
                    act,
                    Some(v.window_size.unwrap_or(112)),
                    full,
                )
            }
        };
        let shape = VisionShape {
            depth,
            width,
            heads,
            mlp,
            out,
            channels: v.in_channels.or(v.in_chans).unwrap_or(3),
            patch: v.patch_size.or(v.spatial_patch_size).unwrap_or(14),
            merge: v.spatial_merge_size.unwrap_or(2),
            temporal: v.temporal_patch_size.unwrap_or(2),
            window,
            full_attention,
            act,
            theta,
        };
        let bad = |m: String| Err(ModelError::Config(format!("vision_config: {m}")));
        if heads <= 0 || width % heads != 0 || (width / heads) % 4 != 0 {
            return bad(format!(
                "width {width} over num_heads {heads} must give a head width divisible by 4 (2D rope)"
            ));
        }
        if shape.patch <= 0 || shape.merge <= 0 || shape.temporal <= 0 || shape.channels <= 0 {
            return bad("patch_size, spatial_merge_size, temporal_patch_size and in_channels must be positive".into());
        }
        if let Some(w) = window {
            if w % (shape.patch * shape.merge) != 0 || w <= 0 {
                return bad(format!(
                    "window_size = {w}: must be a positive multiple of patch_size · spatial_merge_size"
                ));
            }
        }
        Ok(shape)
    }
}

// ---------------------------------------------------------------------------------------------
// The processor
// ---------------------------------------------------------------------------------------------

/// The size the Qwen2-VL processor resizes an image of `height × width` to (transformers'
/// `smart_resize`): both sides multiples of `factor` (`patch_size · merge_size`), as close to
/// the aspect ratio as that allows, the pixel count in `[min_pixels, max_pixels]`. An aspect
/// ratio above 200 is refused, as transformers refuses it.
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize)> {
    if height == 0 || width == 0 || factor == 0 {
        return Err(ModelError::Runtime(format!(
            "cannot resize a {height}x{width} image to multiples of {factor}"
        )));
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    if h.max(w) / h.min(w) > 200.0 {
        return Err(ModelError::Runtime(format!(
            "absolute aspect ratio must be smaller than 200, got {}",
            h.max(w) / h.min(w)
        )));
    }
    // Python's round: half to even.
    let mut h_bar = (h / f).round_ties_even() * f;
    let mut w_bar = (w / f).round_ties_even() * f;
    if h_bar * w_bar > max_pixels as f64 {
        let beta = ((h * w) / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as usize, w_bar as usize))
}

/// The processor's patches of one normalised image `pixels` (channel-first `[channels, height,
/// width]`, both sides multiples of `patch · merge`): `[grid_h · grid_w, channels · temporal ·
/// patch²]` row-major, patches listed merge block by merge block (row of blocks, column of
/// blocks, row and column inside the block), each patch's values channel, frame, row, column —
/// transformers' `patchify`, the image repeated over the `temporal` frames. Returns the values
/// and the grid `[1, grid_h, grid_w]` (`image_grid_thw`).
pub fn patchify(
    pixels: &[f32],
    channels: usize,
    height: usize,
    width: usize,
    patch: usize,
    merge: usize,
    temporal: usize,
) -> Result<(Vec<f32>, [i32; 3])> {
    let side = patch * merge;
    if pixels.len() != channels * height * width {
        return Err(ModelError::Runtime(format!(
            "{} pixel values for a {channels}x{height}x{width} image",
            pixels.len()
        )));
    }
    if side == 0 || height % side != 0 || width % side != 0 {
        return Err(ModelError::Runtime(format!(
            "a {height}x{width} image cannot be cut into {patch}-pixel patches merged {merge} by {merge} (resize it with smart_resize first)"
        )));
    }
    let (gh, gw) = (height / patch, width / patch);
    let per_patch = channels * temporal * patch * patch;
    let mut out = Vec::with_capacity(gh * gw * per_patch);
    for bh in 0..gh / merge {
        for bw in 0..gw / merge {
            for mh in 0..merge {
                for mw in 0..merge {
                    let (py, px) = ((bh * merge + mh) * patch, (bw * merge + mw) * patch);
                    for c in 0..channels {
                        let plane = &pixels[c * height * width..(c + 1) * height * width];
                        for _ in 0..temporal {
                            for y in 0..patch {
                                let row = (py + y) * width + px;
                                out.extend_from_slice(&plane[row..row + patch]);
                            }
                        }
                    }
                }
            }
        }
    }
    Ok((out, [1, gh as i32, gw as i32]))
}

/// The number of placeholder tokens an image of grid `grid` (`[t, h, w]`) takes in the prompt:
/// `t · h · w / merge²` (what `Qwen2VLProcessor` repeats `<|image_pad|>` by).
pub fn image_token_count(grid: [i32; 3], merge: i32) -> usize {
    (grid[0] * grid[1] * grid[2] / (merge * merge)).max(0) as usize
}

// ---------------------------------------------------------------------------------------------
// Positions
// ---------------------------------------------------------------------------------------------

/// Transformers' `get_rope_index` for one prompt: the temporal, height and width position of
/// every token (`[3][L]`) and the position delta decoding continues with (the next token's
/// position is the cache offset plus it). Text tokens count up by one on all three axes; each
/// run of `image_token_id` is one image (the next of `grids`, in order), placed on its merged
/// `h × w` grid from the position after the text before it; the text after an image resumes at
/// that start plus the larger side of the grid.
pub fn rope_index(
    ids: &[i32],
    grids: &[[i32; 3]],
    image_token_id: i32,
    merge: i32,
) -> Result<([Vec<i64>; 3], i64)> {
    let mut pos: [Vec<i64>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    let mut next_grid = grids.iter();
    let mut current: i64 = 0;
    let mut i = 0;
    while i < ids.len() {
        if ids[i] != image_token_id {
            for axis in &mut pos {
                axis.push(current);
            }
            current += 1;
            i += 1;
            continue;
        }
        let run = ids[i..]
            .iter()
            .take_while(|t| **t == image_token_id)
            .count();
        let Some(&[t, h, w]) = next_grid.next() else {
            return Err(ModelError::Runtime(format!(
                "the prompt has more runs of image tokens ({image_token_id}) than images ({})",
                grids.len()
            )));
        };
        let (lh, lw) = ((h / merge) as i64, (w / merge) as i64);
        let expected = image_token_count([t, h, w], merge);
        if run != expected {
            return Err(ModelError::Runtime(format!(
                "image {} (grid {t}x{h}x{w}) needs {expected} image tokens, the prompt has a run of {run}",
                grids.len() - next_grid.len()
            )));
        }
        for ti in 0..t as i64 {
            for hi in 0..lh {
                for wi in 0..lw {
                    pos[0].push(current + ti);
                    pos[1].push(current + hi);
                    pos[2].push(current + wi);
                }
            }
        }
        current += lh.max(lw);
        i += run;
    }
    if next_grid.next().is_some() {
        return Err(ModelError::Runtime(format!(
            "{} images for {} runs of image tokens ({image_token_id}) in the prompt",
            grids.len(),
            grids.len() - next_grid.len() - 1
        )));
    }
    let max = pos[0]
        .iter()
        .chain(&pos[1])
        .chain(&pos[2])
        .copied()
        .max()
        .unwrap_or(-1);
    Ok((pos, max + 1 - ids.len() as i64))
}

/// Per-frequency positions `[1, L, Σ sections]` (float32) for the decoder's rotary embedding
/// (see [`crate::nn::RotaryEmbedding::forward_at`]): frequency `j` of section `k` turns with
/// axis `k`'s position (transformers' `mrope_section` recomposition).
pub fn mrope_positions(pos: &[Vec<i64>; 3], sections: [usize; 3]) -> Result<Array> {
    let l = pos[0].len();
    let half: usize = sections.iter().sum();
    let axis_of: Vec<usize> = (0..3).flat_map(|k| vec![k; sections[k]]).collect();
    let out: Vec<f32> = (0..l)
        .flat_map(|i| axis_of.iter().map(move |&k| pos[k][i] as f32))
        .collect();
    Ok(Array::from_slice(&out, &[1, l as i32, half as i32])?)
}

// ---------------------------------------------------------------------------------------------
// The vision tower
// ---------------------------------------------------------------------------------------------

/// A vision block's MLP.
#[derive(Debug)]
enum VisionMlp {
    /// Qwen2-VL: `fc2(act(fc1(x)))`.
    Plain {
        fc1: Linear,
        fc2: Linear,
        act: VisionAct,
    },
    /// Qwen2.5-VL: `down(act(gate(x)) · up(x))`, all with biases.
    Gated {
        gate: Linear,
        up: Linear,
        down: Linear,
        act: VisionAct,
    },
}

/// An activation of the vision MLP: one the decoder knows, or CLIP's QuickGELU.
#[derive(Debug, Clone, Copy)]
enum VisionAct {
    QuickGelu,
    Known(Activation),
}

impl VisionAct {
    fn from_name(name: &str) -> Result<VisionAct> {
        if name == "quick_gelu" {
            return Ok(VisionAct::QuickGelu);
        }
        Activation::from_name(name)
            .map(VisionAct::Known)
            .ok_or_else(|| ModelError::Unsupported(format!("vision_config.hidden_act = {name:?}")))
    }

    fn apply(self, x: &Array) -> Result<Array> {
        match self {
            // x · sigmoid(1.702 x)
            VisionAct::QuickGelu => Ok(x.multiply(&x.mul_scalar(1.702)?.sigmoid()?)?),
            VisionAct::Known(a) => a.apply(x),
        }
    }
}

impl VisionMlp {
    fn forward(&self, x: &Array) -> Result<Array> {
        match self {
            VisionMlp::Plain { fc1, fc2, act } => fc2.forward(&act.apply(&fc1.forward(x)?)?),
            VisionMlp::Gated {
                gate,
                up,
                down,
                act,
            } => {
                let (g, u) = (gate.forward(x)?, up.forward(x)?);
                let h = match act {
                    VisionAct::Known(a) => a.gated(&g, &u)?,
                    VisionAct::QuickGelu => act.apply(&g)?.multiply(&u)?,
                };
                down.forward(&h)
            }
        }
    }
}

#[derive(Debug)]
struct VisionBlock {
    norm1: Norm,
    norm2: Norm,
    qkv: Linear,
    proj: Linear,
    mlp: VisionMlp,
    full_attention: bool,
}

/// The vision tower with its patch merger: flattened patches in, one text-width row per merged
/// `merge × merge` block out.
#[derive(Debug)]
pub struct VisionTower {
    family: Family,
    shape: VisionShape,
    /// The patch-embedding kernel as a linear layer (`[width, patch_values]`, no bias).
    patch_embed: Linear,
    /// The tower's compute dtype (its weights'): pixel values are cast to it.
    dtype: Dtype,
    blocks: Vec<VisionBlock>,
    merger_norm: Norm,
    merger_fc1: Linear,
    merger_fc2: Linear,
    /// The 2D rope's inverse frequencies (`head_dim / 4` of them, shared by both axes).
    inv_freq: Vec<f32>,
}

/// How the tokens of one forward pass attend: per segment (image frame or window), each a
/// contiguous range of rows.
fn segment_mask(lengths: &[usize]) -> Result<Option<Array>> {
    if lengths.len() <= 1 {
        return Ok(None);
    }
    let ids: Vec<i32> = lengths
        .iter()
        .enumerate()
        .flat_map(|(s, &n)| std::iter::repeat_n(s as i32, n))
        .collect();
    let n = ids.len() as i32;
    let seg = Array::from_slice(&ids, &[n])?;
    let mask = seg
        .reshape(&[n, 1])?
        .equal(&seg.reshape(&[1, n])?)?
        .reshape(&[1, 1, n, n])?;
    Ok(Some(mask))
}

/// `x · cos + rotate_half(x) · sin` for `x` `[N, heads, D]`, `cos`/`sin` `[N, 1, D]`.
fn rotate(x: &Array, cos: &Array, sin: &Array) -> Result<Array> {
    let d = x.dim(-1)?;
    let parts = x.split_at(&[d / 2], -1)?;
    let rotated = ops::concatenate(&[parts[1].negative()?, parts[0].clone()], -1)?;
    Ok(x.multiply(cos)?.add(&rotated.multiply(sin)?)?)
}

/// Qwen2.5-VL's window layout: the order of the merged units when grouped by window
/// (transformers' `get_vision_window_index`) and the windows' lengths in patches.
fn window_layout(grids: &[[i32; 3]], merge: i32, window_units: i32) -> (Vec<i32>, Vec<usize>) {
    let unit = (merge * merge) as usize;
    let mut order = Vec::new();
    let mut lengths = Vec::new();
    let mut base = 0i32;
    for &[t, h, w] in grids {
        let (lh, lw) = (h / merge, w / merge);
        let (nh, nw) = (lh / window_units + 1, lw / window_units + 1);
        for ti in 0..t {
            for wy in 0..nh {
                for wx in 0..nw {
                    let mut n = 0;
                    for y in wy * window_units..((wy + 1) * window_units).min(lh) {
                        for x in wx * window_units..((wx + 1) * window_units).min(lw) {
                            order.push(base + ti * lh * lw + y * lw + x);
                            n += 1;
                        }
                    }
                    // transformers drops empty windows (`unique_consecutive` of the bounds)
                    if n > 0 {
                        lengths.push(n * unit);
                    }
                }
            }
        }
        base += t * lh * lw;
    }
    (order, lengths)
}

impl VisionTower {
    fn build(family: Family, shape: VisionShape, w: &mut ModelWeights) -> Result<VisionTower> {
        let (e, mlp) = (shape.width, shape.mlp);
        let patch_embed = {
            let mut s = w.scope("patch_embed");
            let kernel = s.tensor(
                "proj.weight",
                &[e, shape.channels, shape.temporal, shape.patch, shape.patch],
            )?;
            Linear::dense(kernel.reshape(&[e, shape.patch_values()])?, None)?
        };
        let dtype = w.dtype();
        let norm_kind = match family {
            Family::Qwen2Vl => NormKind::Layer,
            Family::Qwen2_5Vl => NormKind::Rms,
        };
        let act = VisionAct::from_name(&shape.act)?;
        let mut blocks = Vec::with_capacity(shape.depth);
        {
            let mut bw = w.scope("blocks");
            for i in 0..shape.depth {
                let mut b = bw.scope(i);
                let mlp = {
                    let mut m = b.scope("mlp");
                    match family {
                        Family::Qwen2Vl => VisionMlp::Plain {
                            fc1: m.linear("fc1", e, mlp, true)?,
                            fc2: m.linear("fc2", mlp, e, true)?,
                            act,
                        },
                        Family::Qwen2_5Vl => VisionMlp::Gated {
                            gate: m.linear("gate_proj", e, mlp, true)?,
                            up: m.linear("up_proj", e, mlp, true)?,
                            down: m.linear("down_proj", mlp, e, true)?,
                            act,
                        },
                    }
                };
                let (qkv, proj) = {
                    let mut a = b.scope("attn");
                    (
                        a.linear("qkv", e, 3 * e, true)?,
                        a.linear("proj", e, e, true)?,
                    )
                };
                blocks.push(VisionBlock {
                    norm1: b.norm("norm1", norm_kind, e, 1e-6)?,
                    norm2: b.norm("norm2", norm_kind, e, 1e-6)?,
                    qkv,
                    proj,
                    mlp,
                    full_attention: shape.window.is_none() || shape.full_attention.contains(&i),
                });
            }
        }
        let merged = e * shape.merge * shape.merge;
        let (merger_norm, merger_fc1, merger_fc2) = {
            let mut m = w.scope("merger");
            let norm = m.norm("ln_q", norm_kind, e, 1e-6)?;
            let mut mlp_scope = m.scope("mlp");
            (
                norm,
                mlp_scope.linear("0", merged, merged, true)?,
                mlp_scope.linear("2", merged, shape.out, true)?,
            )
        };
        let head_dim = e / shape.heads;
        let spatial = head_dim / 2;
        let inv_freq = (0..spatial / 2)
            .map(|i| (1.0 / shape.theta.powf(2.0 * i as f64 / spatial as f64)) as f32)
            .collect();
        Ok(VisionTower {
            family,
            shape,
            patch_embed,
            dtype,
            blocks,
            merger_norm,
            merger_fc1,
            merger_fc2,
            inv_freq,
        })
    }

    /// The tower's shape.
    pub fn shape(&self) -> &VisionShape {
        &self.shape
    }

    /// `cos` and `sin` `[N, 1, head_dim]` of the 2D rope for the patches of `grids`, in the
    /// processor's order (merge block by merge block): the first quarter of the frequencies
    /// turns with the patch row, the second with its column, both halves repeated.
    fn rope_tables(&self, grids: &[[i32; 3]]) -> Result<(Array, Array)> {
        let m = self.shape.merge;
        let q = self.inv_freq.len();
        let d = 4 * q;
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        let mut angles = vec![0f32; 2 * q];
        for &[t, h, w] in grids {
            for _ in 0..t {
                for bh in 0..h / m {
                    for bw in 0..w / m {
                        for mh in 0..m {
                            for mw in 0..m {
                                let (row, col) = ((bh * m + mh) as f32, (bw * m + mw) as f32);
                                for (j, f) in self.inv_freq.iter().enumerate() {
                                    angles[j] = row * f;
                                    angles[q + j] = col * f;
                                }
                                for _ in 0..2 {
                                    cos.extend(angles.iter().map(|a| a.cos()));
                                    sin.extend(angles.iter().map(|a| a.sin()));
                                }
                            }
                        }
                    }
                }
            }
        }
        let n = (cos.len() / d) as i32;
        Ok((
            Array::from_slice(&cos, &[n, 1, d as i32])?,
            Array::from_slice(&sin, &[n, 1, d as i32])?,
        ))
    }

    /// Image features: `pixel_values` `[N, channels · temporal · patch²]` (the processor's
    /// patches of every image, concatenated) and each image's `[t, h, w]` patch grid → `[N /
    /// merge², out]`, one row per image token, images in order.
    pub fn forward(&self, pixel_values: &Array, grids: &[[i32; 3]]) -> Result<Array> {
        let s = &self.shape;
        let m = s.merge;
        for (i, &[t, h, w]) in grids.iter().enumerate() {
            if t <= 0 || h <= 0 || w <= 0 || h % m != 0 || w % m != 0 {
                return Err(ModelError::Runtime(format!(
                    "image {i}: grid {t}x{h}x{w} is not a positive grid of whole {m}x{m} merge blocks"
                )));
            }
        }
        let n: i64 = grids.iter().map(|g| (g[0] * g[1] * g[2]) as i64).sum();
        let shape = pixel_values.shape();
        if shape.len() != 2 || shape[0] as i64 != n || shape[1] != s.patch_values() {
            return Err(ModelError::Runtime(format!(
                "pixel values of shape {shape:?} for {} images of {n} patches of {} values",
                grids.len(),
                s.patch_values()
            )));
        }
        let n = n as i32;
        let unit = m * m;
        let (heads, e) = (s.heads, s.width);
        let head_dim = e / heads;
        let dtype = self.dtype;
        let mut x = self.patch_embed.forward(&pixel_values.astype(dtype)?)?;
        let (mut cos, mut sin) = self.rope_tables(grids)?;
        let frames: Vec<usize> = grids
            .iter()
            .flat_map(|&[t, h, w]| std::iter::repeat_n((h * w) as usize, t as usize))
            .collect();
        let full_mask = segment_mask(&frames)?;
        let (order, window_mask) = match s.window {
            Some(window) => {
                let (order, lengths) = window_layout(grids, m, window / m / s.patch);
                let idx = Array::from_slice(&order, &[order.len() as i32])?;
                let by_window = |a: &Array| -> Result<Array> {
                    let tail: Vec<i32> = a.shape()[1..].to_vec();
                    let mut grouped = vec![n / unit, unit];
                    grouped.extend(&tail);
                    let mut flat = vec![n];
                    flat.extend(&tail);
                    Ok(a.reshape(&grouped)?.take(&idx, 0)?.reshape(&flat)?)
                };
                x = by_window(&x)?;
                cos = by_window(&cos)?;
                sin = by_window(&sin)?;
                (Some(idx), segment_mask(&lengths)?)
            }
            None => (None, None),
        };
        let scale = (head_dim as f32).powf(-0.5);
        for block in &self.blocks {
            let h = block.norm1.forward(&x)?;
            let qkv = block.qkv.forward(&h)?.reshape(&[n, 3, heads, head_dim])?;
            let parts = qkv.split_equal(3, 1)?;
            let heads_of = |a: &Array, rope: bool| -> Result<Array> {
                let a = a.reshape(&[n, heads, head_dim])?;
                let a = if rope {
                    // In float32 and cast back, as transformers' `apply_rotary_pos_emb_vision`
                    // (`cos`/`sin` are float32).
                    rotate(&a.astype(Dtype::Float32)?, &cos, &sin)?.astype(dtype)?
                } else {
                    a
                };
                Ok(a.transpose(&[1, 0, 2])?.expand_dims(&[0])?)
            };
            let (q, k, v) = (
                heads_of(&parts[0], true)?,
                heads_of(&parts[1], true)?,
                heads_of(&parts[2], false)?,
            );
            let mask = if block.full_attention {
                full_mask.as_ref()
            } else {
                window_mask.as_ref()
            };
            let mask = mask.map_or(AttentionMask::None, AttentionMask::Array);
            let att = ops::scaled_dot_product_attention(&q, &k, &v, scale, mask, None)?
                .squeeze(&[0])?
                .transpose(&[1, 0, 2])?
                .reshape(&[n, e])?;
            x = x.add(&block.proj.forward(&att)?)?;
            x = x.add(&block.mlp.forward(&block.norm2.forward(&x)?)?)?;
        }
        let merged = self
            .merger_norm
            .forward(&x)?
            .reshape(&[n / unit, unit * e])?;
        let hidden = self.merger_fc1.forward(&merged)?;
        let out = self.merger_fc2.forward(&Activation::Gelu.apply(&hidden)?)?;
        match order {
            // Back from window order to the processor's.
            Some(idx) => Ok(out.take(&idx.argsort(0)?, 0)?),
            None => Ok(out),
        }
    }

    /// The family this tower belongs to.
    pub fn family(&self) -> Family {
        self.family
    }
}

// ---------------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------------

/// The outer config's facts the model keeps.
#[derive(Debug, Clone)]
struct Outer {
    family: Family,
    image_token_id: i32,
    video_token_id: i32,
    mrope_section: [usize; 3],
}

/// A Qwen2-VL / Qwen2.5-VL checkpoint on the `Vlm` route: the registered Qwen2 decoder
/// (positions per M-RoPE section) and, unless loaded text only, the lazy vision tower.
#[derive(Debug)]
pub struct Model {
    text: GenerationModel,
    tower: Option<LazyTower<VisionTower>>,
    outer: Outer,
}

impl Family {
    fn name(self) -> &'static str {
        match self {
            Family::Qwen2Vl => "Qwen2-VL",
            Family::Qwen2_5Vl => "Qwen2.5-VL",
        }
    }
}

impl Model {
    /// The vision tower, `None` for a text-only load.
    pub fn tower(&self) -> Option<&LazyTower<VisionTower>> {
        self.tower.as_ref()
    }

    /// The family `model_type` names.
    pub fn family(&self) -> Family {
        self.outer.family
    }

    fn shape(&self) -> Result<&VisionShape> {
        match &self.tower {
            Some(t) => Ok(&t.get()?.shape),
            None => Err(ModelError::Runtime("no vision tower".into())),
        }
    }

    /// An image's `[t, h, w]` patch grid from its pixel size (`[1, channels, H, W]`, both sides
    /// multiples of `patch · merge`), checked against the processor's grid when it reports one.
    fn grid(&self, image: &ImageInput) -> Result<[i32; 3]> {
        let s = self.shape()?;
        let [tiles, channels, h, w] = image.shape();
        let side = (s.patch * s.merge) as usize;
        if tiles != 1 || channels != s.channels as usize || h % side != 0 || w % side != 0 {
            return Err(ModelError::Runtime(format!(
                "a {} image is one {}-channel picture with sides multiple of {side} (the processor's smart_resize); given pixel values of shape {:?}",
                self.outer.family.name(),
                s.channels,
                image.shape()
            )));
        }
        let grid = [
            1,
            (h / s.patch as usize) as i32,
            (w / s.patch as usize) as i32,
        ];
        if let Some(g) = image.grid_thw {
            let g = [g[0] as i32, g[1] as i32, g[2] as i32];
            if g != grid {
                return Err(ModelError::Runtime(format!(
                    "image grid {g:?} does not match its {h}x{w} pixels (grid {grid:?})"
                )));
            }
        }
        Ok(grid)
    }

    /// The prompt's M-RoPE axes and decode delta (see [`rope_index`]).
    fn rope_index_of(&self, prompt: &MultimodalPrompt<'_>) -> Result<([Vec<i64>; 3], i64)> {
        if prompt.tokens.contains(&(self.outer.video_token_id as u32)) {
            return Err(ModelError::Unsupported(format!(
                "video placeholders (token {}) in the prompt: videos are not supported",
                self.outer.video_token_id
            )));
        }
        let ids: Vec<i32> = prompt.tokens.iter().map(|t| *t as i32).collect();
        let grids = prompt
            .images
            .iter()
            .map(|i| self.grid(i))
            .collect::<Result<Vec<_>>>()?;
        let merge = if grids.is_empty() {
            1
        } else {
            self.shape()?.merge
        };
        rope_index(&ids, &grids, self.outer.image_token_id, merge)
    }
}

impl VisionFamily for Model {
    type Tower = VisionTower;
    const NAME: &'static str = "Qwen2-VL";
    const VISION_PREFIXES: &'static [&'static str] = &["visual."];

    fn config(config: &Value) -> Result<VlmConfig> {
        let args: Args = parse_args(config)?;
        args.family()?;
        Ok(VlmConfig {
            text_config: args.text_config_value()?,
            text_type: crate::registry::ModelType::Qwen2,
            vision_config: if args.wants_vision() {
                args.vision_config.clone()
            } else {
                None
            },
        })
    }

    /// Brings every layout to `visual.*` / `model.*` / `lm_head` (the mlx-vlm patch kernel back
    /// to channels-first).
    fn sanitize(config: &Value, weights: &mut WeightMap) -> Result<()> {
        weights.rename_prefix("model.language_model.", "model.")?;
        weights.rename_prefix("language_model.model.", "model.")?;
        weights.rename_prefix("language_model.lm_head.", "lm_head.")?;
        for prefix in RAW_VISION_PREFIXES {
            if *prefix != "visual." {
                weights.rename_prefix(prefix, "visual.")?;
            }
        }
        let kernel = "visual.patch_embed.proj.weight";
        let channels = config
            .get("vision_config")
            .and_then(|v| v.get("in_channels").or_else(|| v.get("in_chans")))
            .and_then(Value::as_i64)
            .unwrap_or(3) as i32;
        if let Some(info) = weights.info(kernel) {
            let s = info.shape.clone();
            // mlx-vlm stores Conv3d kernels channels-last: [out, t, p, p, channels].
            if s.len() == 5 && s[4] == channels && s[1] != channels {
                let a = weights.take(kernel)?.transpose(&[0, 4, 1, 2, 3])?;
                weights.insert(kernel, a)?;
            }
        }
        Ok(())
    }

    fn build_tower(config: &Value, vlm: &VlmConfig, w: &mut ModelWeights) -> Result<VisionTower> {
        let args: Args = parse_args(config)?;
        let family = args.family()?;
        let v = args
            .vision()?
            .ok_or_else(|| ModelError::Config("vision_config: missing".into()))?;
        let shape = VisionShape::resolve(family, &v)?;
        let hidden = vlm
            .text_config
            .get("hidden_size")
            .and_then(Value::as_i64)
            .unwrap_or_default() as i32;
        if shape.out != hidden {
            return Err(ModelError::Config(format!(
                "vision_config: the merger's output width {} is not the text hidden_size {hidden}",
                shape.out
            )));
        }
        VisionTower::build(family, shape, &mut w.scope("visual"))
    }

    fn assemble(
        config: &Value,
        text: GenerationModel,
        tower: Option<LazyTower<VisionTower>>,
    ) -> Result<Model> {
        let args: Args = parse_args(config)?;
        Ok(Model {
            text,
            tower,
            outer: Outer {
                family: args.family()?,
                image_token_id: args.image_token_id,
                video_token_id: args.video_token_id,
                mrope_section: args.text()?.mrope_section,
            },
        })
    }
}

/// The vision tower's tensor prefixes as checkpoints spell them (before sanitising): the hub's
/// and transformers 5's save, transformers 5's module layout, mlx-vlm.
pub const RAW_VISION_PREFIXES: &[&str] = &["visual.", "model.visual.", "vision_tower."];

impl VisionLanguage for Model {
    fn text(&self) -> &dyn LanguageModel {
        &self.text
    }

    fn image_token_id(&self) -> u32 {
        self.outer.image_token_id as u32
    }

    fn image_token_count(&self, image: &ImageInput) -> Result<usize> {
        Ok(image_token_count(self.grid(image)?, self.shape()?.merge))
    }

    /// The processor's patches of the image ([`patchify`]) through the tower.
    fn image_features(&self, image: &ImageInput) -> Result<Array> {
        let tower = self
            .tower
            .as_ref()
            .ok_or_else(|| ModelError::Runtime("no vision tower".into()))?
            .get()?;
        self.grid(image)?;
        let s = &tower.shape;
        let [_, c, h, w] = image.shape();
        let (patches, grid) = patchify(
            image.pixels(),
            c,
            h,
            w,
            s.patch as usize,
            s.merge as usize,
            s.temporal as usize,
        )?;
        let pixel_values = Array::from_slice(&patches, &[grid[1] * grid[2], s.patch_values()])?;
        tower.forward(&pixel_values, &[grid])
    }

    /// Per-frequency M-RoPE positions of `range` ([`rope_index`] over the whole prompt).
    fn positions(
        &self,
        prompt: &MultimodalPrompt<'_>,
        range: Range<usize>,
    ) -> Result<Option<Array>> {
        let (pos, _) = self.rope_index_of(prompt)?;
        let slice: [Vec<i64>; 3] = std::array::from_fn(|k| pos[k][range.clone()].to_vec());
        Ok(Some(mrope_positions(&slice, self.outer.mrope_section)?))
    }

    fn position_delta(&self, prompt: &MultimodalPrompt<'_>) -> Result<i64> {
        Ok(self.rope_index_of(prompt)?.1)
    }
}

// Text only in a batch: a batch decodes every row at its cache offset, which is not the
// position of a conversation with images (offset plus its delta).
crate::vision::vlm_model_impls!(
    Model,
    "Qwen2-VL",
    batched_decode = |m: &Model| { m.tower.is_none() && m.text.batched_decode() }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_rounds_half_to_even_and_keeps_the_pixel_bounds() {
        // 70 / 28 = 2.5 rounds to 2 as Python's round does (not 3).
        assert_eq!(smart_resize(70, 50, 28, 3136, 9408).unwrap(), (56, 56));
        assert_eq!(smart_resize(56, 84, 28, 3136, 9408).unwrap(), (56, 84));
        // too many pixels: scaled down, floors
        assert_eq!(
            smart_resize(1000, 1000, 28, 3136, 28 * 28 * 16).unwrap(),
            (112, 112)
        );
        // too few: scaled up, ceilings
        assert_eq!(smart_resize(10, 20, 28, 3136, 9408).unwrap(), (56, 84));
        assert!(smart_resize(1, 300, 28, 3136, 9408).is_err());
    }

    #[test]
    fn rope_index_places_images_on_their_grid_and_resumes_after_the_larger_side() {
        // text(2) image(grid 1x4x6 → 2x3 merged) text(1)
        let ids = [5, 6, 9, 9, 9, 9, 9, 9, 7];
        let (pos, delta) = rope_index(&ids, &[[1, 4, 6]], 9, 2).unwrap();
        assert_eq!(pos[0], vec![0, 1, 2, 2, 2, 2, 2, 2, 5]);
        assert_eq!(pos[1], vec![0, 1, 2, 2, 2, 3, 3, 3, 5]);
        assert_eq!(pos[2], vec![0, 1, 2, 3, 4, 2, 3, 4, 5]);
        assert_eq!(delta, 6 - 9);
        assert!(rope_index(&ids, &[[1, 4, 4]], 9, 2).is_err());
        assert!(rope_index(&ids, &[], 9, 2).is_err());
    }

    /// Qwen/Qwen2-VL-2B-Instruct's `config.json` as the hub ships it (flat, `in_chans`,
    /// `rope_scaling` type `mrope`).
    fn qwen2_vl_2b() -> Value {
        serde_json::from_str(
            r#"{
            "architectures": ["Qwen2VLForConditionalGeneration"], "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
            "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
            "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 1536,
            "initializer_range": 0.02, "intermediate_size": 8960, "max_position_embeddings": 32768,
            "max_window_layers": 28, "model_type": "qwen2_vl", "num_attention_heads": 12,
            "num_hidden_layers": 28, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
            "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": true,
            "use_sliding_window": false,
            "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16,
                "in_chans": 3, "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2,
                "spatial_patch_size": 14, "temporal_patch_size": 2},
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "vocab_size": 151936
        }"#,
        )
        .unwrap()
    }

    /// Qwen/Qwen2.5-VL-3B-Instruct's `config.json` (flat, window attention keys).
    fn qwen2_5_vl_3b() -> Value {
        serde_json::from_str(
            r#"{
            "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
            "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
            "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 2048,
            "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 128000,
            "max_window_layers": 70, "model_type": "qwen2_5_vl", "num_attention_heads": 16,
            "num_hidden_layers": 36, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
            "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": true,
            "use_sliding_window": false,
            "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
                "intermediate_size": 3420, "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048,
                "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                "tokens_per_second": 2, "temporal_patch_size": 2},
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "vocab_size": 151936
        }"#,
        )
        .unwrap()
    }

    #[test]
    fn hub_configs_give_the_released_shapes() {
        let config = crate::config::sanitize_config_json(qwen2_vl_2b());
        let vlm = <Model as VisionFamily>::config(&config).unwrap();
        assert_eq!(vlm.text_type, crate::registry::ModelType::Qwen2);
        assert_eq!(vlm.text_config["hidden_size"], 1536);
        assert_eq!(vlm.text_config["tie_word_embeddings"], true);
        assert!(vlm.text_config.get("rope_scaling").is_none());
        let args: Args = parse_args(&config).unwrap();
        assert_eq!(args.text().unwrap().mrope_section, [16, 24, 24]);
        let v: VisionArgs = serde_json::from_value(vlm.vision_config.unwrap()).unwrap();
        let s = VisionShape::resolve(Family::Qwen2Vl, &v).unwrap();
        assert_eq!(
            (s.width, s.mlp, s.out, s.heads, s.depth),
            (1280, 5120, 1536, 16, 32)
        );
        assert_eq!(
            (s.patch_values(), s.window, s.act.as_str()),
            (1176, None, "quick_gelu")
        );
        assert_eq!(
            <Model as crate::model::Architecture>::cache_schedule(&config)
                .unwrap()
                .len(),
            28
        );

        let config = crate::config::sanitize_config_json(qwen2_5_vl_3b());
        let vlm = <Model as VisionFamily>::config(&config).unwrap();
        let v: VisionArgs = serde_json::from_value(vlm.vision_config.unwrap()).unwrap();
        let s = VisionShape::resolve(Family::Qwen2_5Vl, &v).unwrap();
        assert_eq!((s.width, s.mlp, s.out), (1280, 3420, 2048));
        assert_eq!(
            (s.window, s.full_attention.clone()),
            (Some(112), vec![7, 15, 23, 31])
        );
        // 112-pixel windows are 4×4 merged units
        assert_eq!(window_layout(&[[1, 8, 8]], 2, 112 / 2 / 14).1, vec![64]);
    }

    #[test]
    fn hub_configs_load_text_only_by_the_rules() {
        for base in [qwen2_vl_2b(), qwen2_5_vl_3b()] {
            let mut lm_only = base.clone();
            lm_only["language_model_only"] = Value::Bool(true);
            let mut no_vision = base.clone();
            no_vision.as_object_mut().unwrap().remove("vision_config");
            let mut empty = base.clone();
            empty["vision_config"] = serde_json::json!({});
            let mut null = base.clone();
            null["vision_config"] = Value::Null;
            for config in [lm_only, no_vision, empty, null] {
                let config = crate::config::sanitize_config_json(config);
                let vlm = <Model as VisionFamily>::config(&config).unwrap();
                assert!(vlm.vision_config.is_none(), "{config}");
                assert_eq!(
                    vlm.text_config["num_hidden_layers"],
                    base["num_hidden_layers"]
                );
            }
            let vlm = <Model as VisionFamily>::config(&crate::config::sanitize_config_json(base))
                .unwrap();
            assert!(vlm.vision_config.is_some());
        }
    }

    #[test]
    fn mrope_sections_must_cover_the_rotary_half() {
        let mut c = qwen2_vl_2b();
        c["rope_scaling"]["mrope_section"] = serde_json::json!([16, 24, 16]);
        let err = <Model as VisionFamily>::config(&crate::config::sanitize_config_json(c))
            .unwrap_err()
            .to_string();
        assert!(err.contains("mrope_section") && err.contains("64"), "{err}");
    }

    #[test]
    fn window_layout_groups_merged_units_by_window() {
        // merged grid 2x3, windows of 2x2 units: [0 1 3 4] then [2 5]
        let (order, lengths) = window_layout(&[[1, 4, 6]], 2, 2);
        assert_eq!(order, vec![0, 1, 3, 4, 2, 5]);
        assert_eq!(lengths, vec![16, 8]);
    }
}
