//! The Pixtral vision encoder (transformers' `PixtralVisionModel`), Mistral 3's tower: images
//! at their own resolution (sides multiples of `patch_size`), a bias-free patch convolution,
//! `ln_pre` RMSNorm, and pre-norm transformer layers (RMSNorm, attention with a 2-D rotary
//! embedding over each patch's row and column, RMSNorm, gated MLP). Several images in one call
//! are one sequence attended block-diagonally: a patch sees the patches of its own image only.
//!
//! Tensor names under the tower's root: `patch_conv.weight` `[hidden, channels, p, p]`,
//! `ln_pre.weight`, `transformer.layers.{i}.{attention_norm, attention.{q,k,v,o}_proj,
//! ffn_norm, feed_forward.{gate,up,down}_proj}`.

use mlxcel_core::ops::{self, AttentionMask};
use mlxcel_core::{Array, Dtype};
use serde_json::Value;

use crate::nn::{Activation, Linear, Norm, NormKind};
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

/// The RMSNorm epsilon transformers hard-codes for Pixtral's norms.
const PIXTRAL_NORM_EPS: f32 = 1e-5;

/// `vision_config` of a Pixtral tower (`PixtralVisionConfig`'s defaults for absent keys).
#[derive(Debug, Clone, PartialEq)]
pub struct PixtralConfig {
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `intermediate_size`.
    pub intermediate_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `num_attention_heads`; the head size is `hidden_size / num_attention_heads` (as
    /// transformers sets `head_dim`, whatever the config says).
    pub num_attention_heads: usize,
    /// `num_channels`.
    pub num_channels: usize,
    /// `patch_size`.
    pub patch_size: usize,
    /// `hidden_act` of the gated MLP.
    pub hidden_act: String,
    /// `rope_parameters.rope_theta` (older configs: `rope_theta`).
    pub rope_theta: f64,
}

impl PixtralConfig {
    /// Reads `vision_config`; errors name the `vision_config` field.
    pub fn from_value(v: &Value) -> Result<PixtralConfig> {
        let num = |k: &str, default: u64| -> Result<usize> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(default as usize),
                Some(x) => x
                    .as_u64()
                    .filter(|n| *n > 0)
                    .map(|n| n as usize)
                    .ok_or_else(|| {
                        ModelError::Config(format!(
                            "vision_config.{k} = {x}: must be a positive integer"
                        ))
                    }),
            }
        };
        let hidden_act = v
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("gelu")
            .to_string();
        if Activation::from_name(&hidden_act).is_none() {
            return Err(ModelError::Config(format!(
                "vision_config.hidden_act = `{hidden_act}`: unsupported"
            )));
        }
        if let Some(t) = v
            .get("rope_parameters")
            .and_then(|r| r.get("rope_type"))
            .and_then(Value::as_str)
        {
            // transformers accepts only the axial rope here (older configs said `default`,
            // which transformers 5 reads as the same axial rope).
            if t != "axial" && t != "default" {
                return Err(ModelError::Config(format!(
                    "vision_config.rope_parameters.rope_type = `{t}`: Pixtral takes `axial` only"
                )));
            }
        }
        let rope_theta = v
            .get("rope_parameters")
            .and_then(|r| r.get("rope_theta"))
            .or_else(|| v.get("rope_theta"))
            .map(|x| {
                x.as_f64().filter(|t| *t > 0.0).ok_or_else(|| {
                    ModelError::Config(format!(
                        "vision_config.rope_parameters.rope_theta = {x}: must be a positive number"
                    ))
                })
            })
            .transpose()?
            .unwrap_or(10_000.0);
        let c = PixtralConfig {
            hidden_size: num("hidden_size", 1024)?,
            intermediate_size: num("intermediate_size", 4096)?,
            num_hidden_layers: num("num_hidden_layers", 24)?,
            num_attention_heads: num("num_attention_heads", 16)?,
            num_channels: num("num_channels", 3)?,
            patch_size: num("patch_size", 16)?,
            hidden_act,
            rope_theta,
        };
        if c.hidden_size % c.num_attention_heads != 0 || c.head_dim() % 4 != 0 {
            return Err(ModelError::Config(format!(
                "vision_config: hidden_size {} over num_attention_heads {} must give a head size divisible by 4 (the 2-D rope's row and column halves)",
                c.hidden_size, c.num_attention_heads
            )));
        }
        Ok(c)
    }

    /// The attention head size.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }
}

#[derive(Debug)]
struct Layer {
    attention_norm: Norm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ffn_norm: Norm,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// A built Pixtral tower.
#[derive(Debug)]
pub struct PixtralVision {
    config: PixtralConfig,
    act: Activation,
    patch_weight: Array,
    ln_pre: Norm,
    layers: Vec<Layer>,
    /// The rope's inverse frequencies in transformers' order: the even-indexed ones (rows)
    /// then the odd-indexed ones (columns), `head_dim / 2` in all.
    inv_freq: Vec<f32>,
}

impl PixtralVision {
    /// Builds the tower from `w` scoped at its root.
    pub fn build(config: &PixtralConfig, w: &mut ModelWeights) -> Result<PixtralVision> {
        let (h, c, p) = (
            config.hidden_size as i32,
            config.num_channels as i32,
            config.patch_size as i32,
        );
        let inter = config.intermediate_size as i32;
        let patch_weight = w.tensor("patch_conv.weight", &[h, c, p, p])?;
        let ln_pre = w.norm("ln_pre", NormKind::Rms, h, PIXTRAL_NORM_EPS)?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        {
            let mut t = w.scope("transformer");
            let mut ls = t.scope("layers");
            for i in 0..config.num_hidden_layers {
                let mut l = ls.scope(i);
                layers.push(Layer {
                    attention_norm: l.norm("attention_norm", NormKind::Rms, h, PIXTRAL_NORM_EPS)?,
                    q: l.linear("attention.q_proj", h, h, false)?,
                    k: l.linear("attention.k_proj", h, h, false)?,
                    v: l.linear("attention.v_proj", h, h, false)?,
                    o: l.linear("attention.o_proj", h, h, false)?,
                    ffn_norm: l.norm("ffn_norm", NormKind::Rms, h, PIXTRAL_NORM_EPS)?,
                    gate: l.linear("feed_forward.gate_proj", h, inter, false)?,
                    up: l.linear("feed_forward.up_proj", h, inter, false)?,
                    down: l.linear("feed_forward.down_proj", inter, h, false)?,
                });
            }
        }
        // transformers: 1 / theta^(arange(0, dim, 2) / dim) in f32, then [0::2] ++ [1::2].
        let dim = config.head_dim();
        let base = config.rope_theta as f32;
        let freqs: Vec<f32> = (0..dim)
            .step_by(2)
            .map(|i| 1.0 / base.powf(i as f32 / dim as f32))
            .collect();
        let inv_freq = freqs
            .iter()
            .step_by(2)
            .chain(freqs.iter().skip(1).step_by(2))
            .copied()
            .collect();
        Ok(PixtralVision {
            act: Activation::from_name(&config.hidden_act).expect("checked in from_value"),
            config: config.clone(),
            patch_weight,
            ln_pre,
            layers,
            inv_freq,
        })
    }

    /// The tower's configuration.
    pub fn config(&self) -> &PixtralConfig {
        &self.config
    }

    /// The dtype the tower computes in (its patch kernel's).
    pub fn dtype(&self) -> Result<Dtype> {
        Ok(self.patch_weight.dtype()?)
    }

    /// The patch grid `(rows, columns)` of an image of `height × width` pixels (both must be
    /// multiples of `patch_size`, as the Pixtral processor makes them).
    pub fn grid(&self, height: usize, width: usize) -> Result<(usize, usize)> {
        let p = self.config.patch_size;
        if height % p != 0 || width % p != 0 || height == 0 || width == 0 {
            return Err(ModelError::Runtime(format!(
                "an image of {height}x{width} pixels: Pixtral takes sides that are multiples of patch_size {p}"
            )));
        }
        Ok((height / p, width / p))
    }

    /// The rope's `(cos, sin)` `[1, 1, N, head_dim]` for patches at `positions` (row, column).
    fn rope(&self, positions: &[(usize, usize)], dtype: Dtype) -> Result<(Array, Array)> {
        let half = self.inv_freq.len();
        let quarter = half / 2;
        let dim = 2 * half;
        let (mut cos, mut sin) = (
            Vec::with_capacity(positions.len() * dim),
            Vec::with_capacity(positions.len() * dim),
        );
        for &(r, c) in positions {
            // The first quarter of the frequencies turn with the row, the second with the
            // column; the half is repeated (rotate-half layout).
            let angles: Vec<f32> = (0..half)
                .map(|j| {
                    let pos = if j < quarter { r } else { c } as f32;
                    pos * self.inv_freq[j]
                })
                .collect();
            for _ in 0..2 {
                cos.extend(angles.iter().map(|a| a.cos()));
                sin.extend(angles.iter().map(|a| a.sin()));
            }
        }
        let shape = [1, 1, positions.len() as i32, dim as i32];
        Ok((
            Array::from_slice(&cos[..], &shape)?.astype(dtype)?,
            Array::from_slice(&sin[..], &shape)?.astype(dtype)?,
        ))
    }

    /// The hidden states `0..=deepest` (0: the patch embeddings after `ln_pre`, `i`: the output
    /// of layer `i`) of `images` (each `[1, channels, H, W]`) attended as one block-diagonal
    /// sequence: each `[1, Σ patches, hidden]`, the patches of each image in row-major order.
    pub fn hidden_states(&self, images: &[Array], deepest: usize) -> Result<Vec<Array>> {
        let c = &self.config;
        if images.is_empty() {
            return Err(ModelError::Runtime("Pixtral: no images given".into()));
        }
        if deepest > self.layers.len() {
            return Err(ModelError::Runtime(format!(
                "Pixtral: hidden state {deepest} asked of a tower of {} layers",
                self.layers.len()
            )));
        }
        let (h, p, ch) = (
            c.hidden_size as i32,
            c.patch_size as i32,
            c.num_channels as i32,
        );
        let dtype = self.dtype()?;
        let kernel = self.patch_weight.reshape(&[h, -1])?.t()?;
        let mut embeds = Vec::with_capacity(images.len());
        let mut positions = Vec::new();
        let mut blocks = Vec::with_capacity(images.len());
        for image in images {
            let shape = image.shape();
            if shape.len() != 4 || shape[0] != 1 || shape[1] != ch {
                return Err(ModelError::Runtime(format!(
                    "pixel values of shape {shape:?}: the Pixtral tower takes [1, {ch}, H, W]"
                )));
            }
            let (gh, gw) = self.grid(shape[2] as usize, shape[3] as usize)?;
            // The stride-p convolution as a matmul over flattened (channel, row, column)
            // patches, patches in row-major order.
            let patches = image
                .astype(dtype)?
                .reshape(&[ch, gh as i32, p, gw as i32, p])?
                .transpose(&[1, 3, 0, 2, 4])?
                .reshape(&[(gh * gw) as i32, -1])?;
            embeds.push(patches.matmul(&kernel)?);
            for r in 0..gh {
                for col in 0..gw {
                    positions.push((r, col));
                }
            }
            blocks.push(gh * gw);
        }
        let n = positions.len() as i32;
        let mut x = self
            .ln_pre
            .forward(&ops::concatenate(&embeds, 0)?.expand_dims(&[0])?)?;
        let (cos, sin) = self.rope(&positions, dtype)?;
        // Block-diagonal attention: -inf between patches of different images.
        let mask = if blocks.len() > 1 {
            let total = positions.len();
            let mut m = vec![f32::NEG_INFINITY; total * total];
            let mut start = 0;
            for b in &blocks {
                for i in start..start + b {
                    m[i * total + start..i * total + start + b].fill(0.0);
                }
                start += b;
            }
            Some(Array::from_slice(&m[..], &[1, 1, n, n])?.astype(dtype)?)
        } else {
            None
        };
        let heads = c.num_attention_heads as i32;
        let hd = c.head_dim() as i32;
        let scale = (hd as f32).powf(-0.5);
        let split = |t: &Array| -> Result<Array> {
            Ok(t.reshape(&[1, n, heads, hd])?.transpose(&[0, 2, 1, 3])?)
        };
        let rotate = |t: &Array| -> Result<Array> {
            let x1 = t.slice_axis(-1, 0, hd / 2)?;
            let x2 = t.slice_axis(-1, hd / 2, hd)?;
            let rotated = ops::concatenate(&[x2.negative()?, x1], -1)?;
            Ok(t.multiply(&cos)?.add(&rotated.multiply(&sin)?)?)
        };
        let mut states = vec![x.clone()];
        for layer in &self.layers[..deepest] {
            let y = layer.attention_norm.forward(&x)?;
            let q = rotate(&split(&layer.q.forward(&y)?)?)?;
            let k = rotate(&split(&layer.k.forward(&y)?)?)?;
            let v = split(&layer.v.forward(&y)?)?;
            let m = match &mask {
                Some(m) => AttentionMask::Array(m),
                None => AttentionMask::None,
            };
            let a = ops::scaled_dot_product_attention(&q, &k, &v, scale, m, None)?
                .transpose(&[0, 2, 1, 3])?
                .reshape(&[1, n, h])?;
            x = x.add(&layer.o.forward(&a)?)?;
            let y = layer.ffn_norm.forward(&x)?;
            let y = layer.down.forward(
                &self
                    .act
                    .gated(&layer.gate.forward(&y)?, &layer.up.forward(&y)?)?,
            )?;
            x = x.add(&y)?;
            states.push(x.clone());
        }
        Ok(states)
    }
}
