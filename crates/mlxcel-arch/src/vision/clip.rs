//! The CLIP vision transformer (transformers' `CLIPVisionModel`, as LLaVA reads it): a
//! bias-free patch convolution, a class embedding in front, learned position embeddings, a
//! pre-encoder LayerNorm (`pre_layrnorm`), pre-norm encoder layers (bidirectional multi-head
//! attention with biases, a `quick_gelu` MLP). LLaVA takes the hidden states after a chosen
//! layer (`vision_feature_layer`), not the final one, so [`ClipVision::hidden_states`] returns
//! them all: index 0 is the embeddings after `pre_layrnorm`, index `i` the output of layer `i`.

use mlxcel_core::ops::{self, AttentionMask};
use mlxcel_core::Array;
use serde::Deserialize;

use crate::nn::{Activation, Linear, Norm, NormKind};
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

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
fn d_channels() -> usize {
    3
}
fn d_image() -> usize {
    224
}
fn d_patch() -> usize {
    32
}
fn d_act() -> String {
    "quick_gelu".into()
}
fn d_eps() -> f64 {
    1e-5
}

/// The `vision_config` keys of a CLIP tower (defaults as `CLIPVisionConfig`).
#[derive(Debug, Clone, Deserialize)]
pub struct ClipConfig {
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
    #[serde(default = "d_channels")]
    pub num_channels: usize,
    /// `image_size`.
    #[serde(default = "d_image")]
    pub image_size: usize,
    /// `patch_size`.
    #[serde(default = "d_patch")]
    pub patch_size: usize,
    /// `hidden_act` (`quick_gelu`, or one of [`Activation::from_name`]'s).
    #[serde(default = "d_act")]
    pub hidden_act: String,
    /// `layer_norm_eps`.
    #[serde(default = "d_eps")]
    pub layer_norm_eps: f64,
}

impl ClipConfig {
    /// Patches along one side.
    pub fn patches_per_side(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// Reads a `vision_config` object; errors name the key.
    pub fn from_value(v: &serde_json::Value) -> Result<ClipConfig> {
        let c: ClipConfig = serde_json::from_value(v.clone())
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
        ClipAct::from_name(&c.hidden_act)?;
        Ok(c)
    }
}

/// CLIP's activations: its own `quick_gelu` (`x · σ(1.702 x)`) or a shared one.
#[derive(Debug, Clone, Copy)]
enum ClipAct {
    QuickGelu,
    Shared(Activation),
}

impl ClipAct {
    fn from_name(name: &str) -> Result<ClipAct> {
        if name == "quick_gelu" {
            return Ok(ClipAct::QuickGelu);
        }
        Activation::from_name(name)
            .map(ClipAct::Shared)
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "vision_config.hidden_act = `{name}`: unsupported activation"
                ))
            })
    }

    fn apply(self, x: &Array) -> Result<Array> {
        match self {
            ClipAct::QuickGelu => Ok(x.multiply(&x.mul_scalar(1.702)?.sigmoid()?)?),
            ClipAct::Shared(a) => a.apply(x),
        }
    }
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

/// A built CLIP vision tower.
#[derive(Debug)]
pub struct ClipVision {
    config: ClipConfig,
    act: ClipAct,
    patch_weight: Array,
    class_embedding: Array,
    positions: Array,
    pre_norm: Norm,
    layers: Vec<EncoderLayer>,
}

impl ClipVision {
    /// Builds the tower from `w` scoped at its root (`embeddings.*`, `pre_layrnorm`,
    /// `encoder.layers.*`; `post_layernorm` is not part of the hidden states LLaVA reads).
    pub fn build(config: &ClipConfig, w: &mut ModelWeights) -> Result<ClipVision> {
        let (h, c, p) = (
            config.hidden_size as i32,
            config.num_channels as i32,
            config.patch_size as i32,
        );
        let inter = config.intermediate_size as i32;
        let eps = config.layer_norm_eps as f32;
        let n_pos = (config.patches_per_side() * config.patches_per_side() + 1) as i32;
        let (patch_weight, class_embedding, positions) = {
            let mut e = w.scope("embeddings");
            (
                e.tensor("patch_embedding.weight", &[h, c, p, p])?,
                e.tensor("class_embedding", &[h])?,
                e.tensor("position_embedding.weight", &[n_pos, h])?,
            )
        };
        let pre_norm = w.norm("pre_layrnorm", NormKind::Layer, h, eps)?;
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
        Ok(ClipVision {
            act: ClipAct::from_name(&config.hidden_act)?,
            config: config.clone(),
            patch_weight,
            class_embedding,
            positions,
            pre_norm,
            layers,
        })
    }

    /// The tower's configuration.
    pub fn config(&self) -> &ClipConfig {
        &self.config
    }

    /// Pixel values `[N, C, S, S]` → the hidden states `[N, 1 + patches, hidden]` after the
    /// embeddings (index 0) and after each of the first `through` layers.
    pub fn hidden_states(&self, pixels: &Array, through: usize) -> Result<Vec<Array>> {
        let c = &self.config;
        let shape = pixels.shape();
        let (s, p) = (c.image_size as i32, c.patch_size as i32);
        if shape.len() != 4 || shape[1] != c.num_channels as i32 || shape[2] != s || shape[3] != s {
            return Err(ModelError::Runtime(format!(
                "pixel values of shape {shape:?}: the tower takes [N, {}, {s}, {s}]",
                c.num_channels
            )));
        }
        let (n, g, h) = (shape[0], s / p, c.hidden_size as i32);
        let patches = pixels
            .reshape(&[n, c.num_channels as i32, g, p, g, p])?
            .transpose(&[0, 2, 4, 1, 3, 5])?
            .reshape(&[n, g * g, -1])?;
        let embedded = patches.matmul(&self.patch_weight.reshape(&[h, -1])?.t()?)?;
        let class = self
            .class_embedding
            .reshape(&[1, 1, h])?
            .broadcast_to(&[n, 1, h])?;
        let x = ops::concatenate(&[class, embedded], 1)?.add(&self.positions)?;
        let mut x = self.pre_norm.forward(&x)?;
        let len = g * g + 1;
        let heads = c.num_attention_heads as i32;
        let hd = h / heads;
        let scale = (hd as f32).powf(-0.5);
        let split = |t: &Array| -> Result<Array> {
            Ok(t.reshape(&[n, len, heads, hd])?.transpose(&[0, 2, 1, 3])?)
        };
        let mut out = vec![x.clone()];
        for layer in self.layers.iter().take(through) {
            let y = layer.norm1.forward(&x)?;
            let (q, k, v) = (
                split(&layer.q.forward(&y)?)?,
                split(&layer.k.forward(&y)?)?,
                split(&layer.v.forward(&y)?)?,
            );
            let a =
                ops::scaled_dot_product_attention(&q, &k, &v, scale, AttentionMask::None, None)?
                    .transpose(&[0, 2, 1, 3])?
                    .reshape(&[n, len, h])?;
            x = x.add(&layer.out.forward(&a)?)?;
            let y = layer.norm2.forward(&x)?;
            x = x.add(
                &layer
                    .fc2
                    .forward(&self.act.apply(&layer.fc1.forward(&y)?)?)?,
            )?;
            out.push(x.clone());
        }
        Ok(out)
    }

    /// Encoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The compute dtype of the tower's weights (pixel values are cast to it).
    pub fn dtype(&self) -> Result<mlxcel_core::Dtype> {
        Ok(self.patch_weight.dtype()?)
    }
}
