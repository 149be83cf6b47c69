//! The SigLIP vision transformer (transformers' `SiglipVisionModel` up to `last_hidden_state`):
//! a non-overlapping patch convolution plus learned position embeddings, pre-norm encoder
//! layers (LayerNorm, bidirectional multi-head attention with biases, GELU MLP) and a final
//! LayerNorm. Gemma 3 and Idefics3 / SmolVLM use it as their tower.

use mlxcel_core::ops::{self, AttentionMask};
use mlxcel_core::{Array, WeightMap};
use serde::Deserialize;

use crate::nn::{Activation, Linear, Norm, NormKind};
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

fn default_act() -> String {
    "gelu_pytorch_tanh".into()
}
fn default_eps() -> f64 {
    1e-6
}
fn default_channels() -> usize {
    3
}

/// The `vision_config` keys of a SigLIP tower (defaults as `SiglipVisionConfig`).
#[derive(Debug, Clone, Deserialize)]
pub struct SiglipConfig {
    /// `hidden_size`.
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    /// `intermediate_size`.
    #[serde(default = "d_intermediate")]
    pub intermediate_size: usize,
    /// `num_hidden_layers`.
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    /// `num_attention_heads`.
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    /// `num_channels`.
    #[serde(default = "default_channels")]
    pub num_channels: usize,
    /// `image_size`: the side of the square input.
    #[serde(default = "d_image")]
    pub image_size: usize,
    /// `patch_size`.
    #[serde(default = "d_patch")]
    pub patch_size: usize,
    /// `hidden_act`.
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// `layer_norm_eps`.
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
}

fn d_hidden() -> usize {
    768
}
fn d_intermediate() -> usize {
    3072
}
fn d_layers() -> usize {
    12
}
fn d_heads() -> usize {
    12
}
fn d_image() -> usize {
    224
}
fn d_patch() -> usize {
    16
}

impl SiglipConfig {
    /// Patches along one side.
    pub fn patches_per_side(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// Reads a `vision_config` object; errors name the key.
    pub fn from_value(v: &serde_json::Value) -> Result<SiglipConfig> {
        let c: SiglipConfig = serde_json::from_value(v.clone())
            .map_err(|e| ModelError::Config(format!("vision_config: {e}")))?;
        if c.patch_size == 0 || c.image_size % c.patch_size != 0 {
            return Err(ModelError::Config(format!(
                "vision_config: image_size {} is not a multiple of patch_size {}",
                c.image_size, c.patch_size
            )));
        }
        if c.num_attention_heads == 0 || c.hidden_size % c.num_attention_heads != 0 {
            return Err(ModelError::Config(format!(
                "vision_config: hidden_size {} is not a multiple of num_attention_heads {}",
                c.hidden_size, c.num_attention_heads
            )));
        }
        Activation::from_name(&c.hidden_act).ok_or_else(|| {
            ModelError::Config(format!(
                "vision_config.hidden_act = `{}`: unsupported activation",
                c.hidden_act
            ))
        })?;
        Ok(c)
    }
}

/// Brings a patch-embedding convolution stored in MLX's layout `[out, kh, kw, in]` (mlx-vlm
/// checkpoints) to PyTorch's `[out, in, kh, kw]`, which the tower reads.
pub fn patch_embedding_to_torch_layout(
    weights: &mut WeightMap,
    name: &str,
    channels: usize,
) -> Result<()> {
    let Some(info) = weights.info(name) else {
        return Ok(());
    };
    let s = info.shape.clone();
    if s.len() == 4 && s[3] as usize == channels && s[1] as usize != channels {
        let w = weights.get(name)?.transpose(&[0, 3, 1, 2])?;
        weights.insert(name, w)?;
    }
    Ok(())
}

#[derive(Debug)]
struct EncoderLayer {
    norm1: Norm,
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
    norm2: Norm,
    fc1: Linear,
    fc2: Linear,
}

/// A built SigLIP tower.
#[derive(Debug)]
pub struct SiglipVision {
    config: SiglipConfig,
    act: Activation,
    patch_weight: Array,
    patch_bias: Array,
    positions: Array,
    layers: Vec<EncoderLayer>,
    post_norm: Norm,
}

impl SiglipVision {
    /// Builds the tower from `w` scoped at the tower's root (`embeddings.*`, `encoder.layers.*`,
    /// `post_layernorm`).
    pub fn build(config: &SiglipConfig, w: &mut ModelWeights) -> Result<SiglipVision> {
        let (h, c, p) = (
            config.hidden_size as i32,
            config.num_channels as i32,
            config.patch_size as i32,
        );
        let inter = config.intermediate_size as i32;
        let eps = config.layer_norm_eps as f32;
        let n_pos = (config.patches_per_side() * config.patches_per_side()) as i32;
        let (patch_weight, patch_bias, positions) = {
            let mut e = w.scope("embeddings");
            let weight = e.tensor("patch_embedding.weight", &[h, c, p, p])?;
            let bias = e.tensor("patch_embedding.bias", &[h])?;
            let pos = e.tensor("position_embedding.weight", &[n_pos, h])?;
            (weight, bias, pos)
        };
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        {
            let mut enc = w.scope("encoder");
            let mut ls = enc.scope("layers");
            for i in 0..config.num_hidden_layers {
                let mut l = ls.scope(i);
                layers.push(EncoderLayer {
                    norm1: l.norm("layer_norm1", NormKind::Layer, h, eps)?,
                    q: l.linear("self_attn.q_proj", h, h, true)?,
                    k: l.linear("self_attn.k_proj", h, h, true)?,
                    v: l.linear("self_attn.v_proj", h, h, true)?,
                    out: l.linear("self_attn.out_proj", h, h, true)?,
                    norm2: l.norm("layer_norm2", NormKind::Layer, h, eps)?,
                    fc1: l.linear("mlp.fc1", h, inter, true)?,
                    fc2: l.linear("mlp.fc2", inter, h, true)?,
                });
            }
        }
        let post_norm = w.norm("post_layernorm", NormKind::Layer, h, eps)?;
        Ok(SiglipVision {
            act: Activation::from_name(&config.hidden_act).expect("checked in from_value"),
            config: config.clone(),
            patch_weight,
            patch_bias,
            positions,
            layers,
            post_norm,
        })
    }

    /// The tower's configuration.
    pub fn config(&self) -> &SiglipConfig {
        &self.config
    }

    /// The compute dtype of the tower's weights (pixel values are cast to it).
    pub fn dtype(&self) -> Result<mlxcel_core::Dtype> {
        Ok(self.patch_weight.dtype()?)
    }

    /// Pixel values `[N, C, S, S]` (S = `image_size`) → `last_hidden_state`
    /// `[N, patches, hidden]`.
    pub fn forward(&self, pixels: &Array) -> Result<Array> {
        let c = &self.config;
        let shape = pixels.shape();
        let s = c.image_size as i32;
        if shape.len() != 4 || shape[1] != c.num_channels as i32 || shape[2] != s || shape[3] != s {
            return Err(ModelError::Runtime(format!(
                "pixel values of shape {shape:?}: the tower takes [N, {}, {s}, {s}]",
                c.num_channels
            )));
        }
        let x = self.patch_embeddings(pixels)?.add(&self.positions)?;
        self.encode(x, None)
    }

    /// The NaViT-style entry (transformers' `Idefics3VisionTransformer` / SmolVLM's): pixel
    /// values `[N, C, H, W]` (H, W multiples of `patch_size`, any size) of which only the
    /// top-left `valid[i] = (rows, columns)` patches of image `i` are real — the processor pads
    /// bottom and right, and `pixel_attention_mask` marks the rest. The real patches take
    /// position ids bucketed from their fractional coordinates onto the `image_size` grid
    /// ([`navit_position_ids`]), padded patches position 0, and no query attends to a padded
    /// key. → `last_hidden_state` `[N, patches, hidden]` (padded positions included, as
    /// transformers returns them).
    pub fn forward_navit(&self, pixels: &Array, valid: &[(usize, usize)]) -> Result<Array> {
        let c = &self.config;
        let shape = pixels.shape();
        let p = c.patch_size as i32;
        if shape.len() != 4
            || shape[1] != c.num_channels as i32
            || shape[2] % p != 0
            || shape[3] % p != 0
            || shape[2] == 0
            || shape[3] == 0
        {
            return Err(ModelError::Runtime(format!(
                "pixel values of shape {shape:?}: the tower takes [N, {}, H, W] with H and W multiples of {p}",
                c.num_channels
            )));
        }
        let (n, gh, gw) = (
            shape[0] as usize,
            (shape[2] / p) as usize,
            (shape[3] / p) as usize,
        );
        if valid.len() != n {
            return Err(ModelError::Runtime(format!(
                "{} valid-patch extents for {n} images",
                valid.len()
            )));
        }
        let per_side = c.patches_per_side();
        let mut ids = Vec::with_capacity(n * gh * gw);
        let mut keep = Vec::with_capacity(n * gh * gw);
        for &(rows, cols) in valid {
            if rows == 0 || cols == 0 || rows > gh || cols > gw {
                return Err(ModelError::Runtime(format!(
                    "valid patches {rows}x{cols}: must be within the {gh}x{gw} patch grid and not empty"
                )));
            }
            let (bh, bw) = (
                navit_position_ids(rows, gh, per_side),
                navit_position_ids(cols, gw, per_side),
            );
            for (r, &pr) in bh.iter().enumerate() {
                for (col, &pc) in bw.iter().enumerate() {
                    let real = r < rows && col < cols;
                    ids.push(if real { (pr * per_side + pc) as i32 } else { 0 });
                    keep.push(real);
                }
            }
        }
        let len = (gh * gw) as i32;
        let pos = self
            .positions
            .take(&Array::from_slice(&ids, &[n as i32, len])?, 0)?;
        let x = self.patch_embeddings(pixels)?.add(&pos)?;
        let mask = if keep.iter().all(|k| *k) {
            None
        } else {
            Some(Array::from_slice(&keep, &[n as i32, 1, 1, len])?)
        };
        self.encode(x, mask.as_ref())
    }

    /// The stride-p patch convolution `[N, C, H, W]` → `[N, (H/p)·(W/p), hidden]`, row-major
    /// over the patch grid, as a matmul over flattened (channel, row, column) patches.
    fn patch_embeddings(&self, pixels: &Array) -> Result<Array> {
        let c = &self.config;
        let shape = pixels.shape();
        let p = c.patch_size as i32;
        let (n, gh, gw, h) = (shape[0], shape[2] / p, shape[3] / p, c.hidden_size as i32);
        let patches = pixels
            .reshape(&[n, c.num_channels as i32, gh, p, gw, p])?
            .transpose(&[0, 2, 4, 1, 3, 5])?
            .reshape(&[n, gh * gw, -1])?;
        let kernel = self.patch_weight.reshape(&[h, -1])?;
        Ok(patches.matmul(&kernel.t()?)?.add(&self.patch_bias)?)
    }

    /// The encoder layers and the final norm over embeddings `[N, L, hidden]`; `keys`, when
    /// given, is a boolean `[N, 1, 1, L]` (true = a real key).
    fn encode(&self, mut x: Array, keys: Option<&Array>) -> Result<Array> {
        let c = &self.config;
        let (n, l) = (x.dim(0)?, x.dim(1)?);
        let h = c.hidden_size as i32;
        let heads = c.num_attention_heads as i32;
        let hd = h / heads;
        let scale = (hd as f32).powf(-0.5);
        let split = |t: &Array| -> Result<Array> {
            Ok(t.reshape(&[n, l, heads, hd])?.transpose(&[0, 2, 1, 3])?)
        };
        let mask = match keys {
            Some(k) => AttentionMask::Array(k),
            None => AttentionMask::None,
        };
        for layer in &self.layers {
            let y = layer.norm1.forward(&x)?;
            let (q, k, v) = (
                split(&layer.q.forward(&y)?)?,
                split(&layer.k.forward(&y)?)?,
                split(&layer.v.forward(&y)?)?,
            );
            let a = ops::scaled_dot_product_attention(&q, &k, &v, scale, mask, None)?
                .transpose(&[0, 2, 1, 3])?
                .reshape(&[n, l, h])?;
            x = x.add(&layer.out.forward(&a)?)?;
            let y = layer.norm2.forward(&x)?;
            let y = layer
                .fc2
                .forward(&self.act.apply(&layer.fc1.forward(&y)?)?)?;
            x = x.add(&y)?;
        }
        self.post_norm.forward(&x)
    }
}

/// Position-grid buckets of `grid` patches along one side of which the first `real` are real
/// (NaViT, as `Idefics3VisionEmbeddings`): patch `i` sits at fractional coordinate
/// `i · (1 / real)` (float32, clamped below 1 − 1e-6) and takes the number of boundaries
/// `k / per_side` (k = 1 .. per_side − 1) at or below it (`torch.bucketize(..., right=True)`).
///
/// The boundaries are `torch.arange(1 / per_side, 1.0, 1 / per_side)` in float32, computed as
/// PyTorch's CPU kernel computes them: in vectors of 8 values (two at a time), each value the
/// float32 of `base + step · i` in double, where `base` is the vector's first value rounded to
/// float32; the tail past the last pair of vectors `start + step · idx` in double. The last
/// bit matters: at some grid sizes (19, 25, 29, 31, ...) a whole image's coordinates land on a
/// boundary and transformers' position ids are not simply `0 .. per_side`.
pub fn navit_position_ids(real: usize, grid: usize, per_side: usize) -> Vec<usize> {
    const V: usize = 8;
    let step = 1.0 / per_side as f64;
    // `arange`'s length: ceil((end - start) / step) in double.
    let count = ((1.0 - step) / step).ceil().max(0.0) as usize;
    let vectorised = count / (2 * V) * (2 * V);
    let bounds: Vec<f32> = (0..count)
        .map(|j| {
            if j < vectorised {
                let first = j / V * V;
                let base = (step + step * first as f64) as f32 as f64;
                (base + step * (j - first) as f64) as f32
            } else {
                (step + step * j as f64) as f32
            }
        })
        .collect();
    let frac_step = 1.0f32 / real as f32;
    // `clamp(max=1.0 - 1e-6)`: the Python double rounded to float32.
    let top = (1.0f64 - 1e-6) as f32;
    (0..grid)
        .map(|i| {
            let at = (i as f32 * frac_step).min(top);
            bounds.iter().take_while(|b| **b <= at).count()
        })
        .collect()
}
