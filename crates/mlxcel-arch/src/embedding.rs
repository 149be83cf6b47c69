//! The embedding kind: encoders ([`EmbeddingModel`]: token ids + attention mask → hidden states),
//! pooling ([`Pooling`]) and the sentence-transformers head ([`DenseLayer`], normalisation,
//! Matryoshka truncation). Encoders never implement [`crate::LanguageModel`].

use mlxcel_core::ops::{self, AttentionMask};
use mlxcel_core::{Array, Dtype};

use crate::nn::{Activation, Linear};
use crate::{ModelError, Result};

/// An encoder: token ids `[B, L]` and an attention mask `[B, L]` (int32, 1 = token, 0 = padding)
/// in, hidden states `[B, L, hidden]` out (after the final norm), with bidirectional attention.
pub trait EmbeddingModel {
    /// `ids` `[B, L]` (int32) and `mask` `[B, L]` (int32, 1 = real token) → `[B, L, hidden]`.
    /// Rows at padded positions are computed but meaningless.
    fn hidden_states(&self, ids: &Array, mask: &Array) -> Result<Array>;

    /// Width of one hidden state.
    fn hidden_size(&self) -> usize;

    /// Rows of the token embedding table (token ids must be below it).
    fn vocab_size(&self) -> usize;

    /// The most tokens one input may have (the position table's reach), when bounded.
    fn max_tokens(&self) -> Option<usize>;

    /// Pooled embeddings `[B, hidden]` under `pooling` (not normalised).
    fn pooled(&self, ids: &Array, mask: &Array, pooling: Pooling) -> Result<Array> {
        pooling.pool(&self.hidden_states(ids, mask)?, mask)
    }
}

/// How hidden states `[B, L, H]` become one vector per input (sentence-transformers'
/// `1_Pooling/config.json` modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// Mean over the real tokens (`pooling_mode_mean_tokens`).
    Mean,
    /// The first token (`pooling_mode_cls_token`).
    Cls,
    /// The last real token (`pooling_mode_lasttoken`).
    LastToken,
    /// Element-wise maximum over the real tokens (`pooling_mode_max_tokens`).
    Max,
    /// Mean weighted by position 1..=L (`pooling_mode_weightedmean_tokens`).
    WeightedMean,
    /// Sum over the real tokens divided by sqrt(length) (`pooling_mode_mean_sqrt_len_tokens`).
    MeanSqrtLen,
}

impl Pooling {
    /// `hidden` `[B, L, H]` and `mask` `[B, L]` (int, 1 = real token) → `[B, H]` in float32.
    pub fn pool(self, hidden: &Array, mask: &Array) -> Result<Array> {
        let hidden = hidden.astype(Dtype::Float32)?;
        let m = mask.astype(Dtype::Float32)?.expand_dims(&[-1])?; // [B, L, 1]
        let counts = m
            .sum(&[1], false)?
            .maximum(&Array::scalar(1e-9, Dtype::Float32)?)?; // [B, 1]
        Ok(match self {
            Pooling::Mean => hidden.multiply(&m)?.sum(&[1], false)?.divide(&counts)?,
            Pooling::MeanSqrtLen => hidden
                .multiply(&m)?
                .sum(&[1], false)?
                .divide(&counts.sqrt()?)?,
            Pooling::Cls => hidden.slice_axis(1, 0, 1)?.squeeze(&[1])?,
            Pooling::Max => {
                let neg = Array::scalar(-1e9, Dtype::Float32)?;
                let keep = m.greater(&Array::scalar(0.0, Dtype::Float32)?)?;
                ops::where_(&keep, &hidden, &neg)?.max(&[1], false)?
            }
            Pooling::WeightedMean => {
                let l = hidden.dim(1)?;
                let w = ops::arange(1.0, l as f64 + 1.0, 1.0, Dtype::Float32)?
                    .reshape(&[1, l, 1])?
                    .multiply(&m)?;
                let total = w
                    .sum(&[1], false)?
                    .maximum(&Array::scalar(1e-9, Dtype::Float32)?)?;
                hidden.multiply(&w)?.sum(&[1], false)?.divide(&total)?
            }
            Pooling::LastToken => {
                // Index of the last real token per row (right padding): count - 1.
                let last = mask
                    .astype(Dtype::Int32)?
                    .sum(&[1], false)?
                    .add_scalar(-1.0)?
                    .maximum(&Array::scalar(0.0, Dtype::Int32)?)?
                    .astype(Dtype::Int32)?;
                let b = hidden.dim(0)?;
                let h = hidden.dim(2)?;
                let idx = last.reshape(&[b, 1, 1])?.broadcast_to(&[b, 1, h])?;
                hidden.take_along_axis(&idx, 1)?.squeeze(&[1])?
            }
        })
    }
}

/// L2-normalises the rows of `x` `[B, H]` (a zero row stays zero).
pub fn normalize(x: &Array) -> Result<Array> {
    let norm = x
        .square()?
        .sum(&[-1], true)?
        .sqrt()?
        .maximum(&Array::scalar(1e-12, Dtype::Float32)?)?;
    Ok(x.divide(&norm)?)
}

/// Matryoshka truncation: the first `dimensions` columns of `x` `[B, H]`, re-normalised when
/// `renormalize`. An error when `dimensions` is 0 or wider than the embedding.
pub fn truncate_dimensions(x: &Array, dimensions: usize, renormalize: bool) -> Result<Array> {
    let width = x.dim(-1)? as usize;
    if dimensions == 0 || dimensions > width {
        return Err(ModelError::Config(format!(
            "dimensions = {dimensions}: must be between 1 and the embedding width {width}"
        )));
    }
    let cut = x.slice_axis(-1, 0, dimensions as i32)?;
    if renormalize {
        normalize(&cut)
    } else {
        Ok(cut)
    }
}

/// A sentence-transformers `Dense` module: `act(x W^T + b)`.
#[derive(Debug, Clone)]
pub struct DenseLayer {
    /// The projection (`linear.weight` `[out, in]`, `linear.bias`).
    pub linear: Linear,
    /// `activation_function` (`torch.nn.modules.linear.Identity` → `None`).
    pub activation: Option<DenseActivation>,
}

/// Activations a sentence-transformers `Dense` module may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenseActivation {
    /// `torch.nn.modules.activation.Tanh`.
    Tanh,
    /// One of the MLP activations (GELU, ReLU, SiLU).
    Mlp(Activation),
    /// `torch.nn.modules.activation.Sigmoid`.
    Sigmoid,
}

impl DenseActivation {
    /// The activation a `Dense` config's `activation_function` names; `Ok(None)` for identity,
    /// an error naming it when unknown.
    pub fn from_torch_name(name: &str) -> Result<Option<DenseActivation>> {
        let short = name.rsplit('.').next().unwrap_or(name);
        Ok(Some(match short {
            "Identity" => return Ok(None),
            "Tanh" => DenseActivation::Tanh,
            "Sigmoid" => DenseActivation::Sigmoid,
            "GELU" => DenseActivation::Mlp(Activation::Gelu),
            "ReLU" => DenseActivation::Mlp(Activation::Relu),
            "SiLU" => DenseActivation::Mlp(Activation::Silu),
            _ => {
                return Err(ModelError::Unsupported(format!(
                    "Dense activation_function `{name}`"
                )))
            }
        }))
    }
}

impl DenseLayer {
    /// `x` `[.., in]` → `[.., out]`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let y = self.linear.forward(x)?;
        Ok(match self.activation {
            None => y,
            Some(DenseActivation::Tanh) => y.tanh()?,
            Some(DenseActivation::Sigmoid) => y.sigmoid()?,
            Some(DenseActivation::Mlp(a)) => a.apply(&y)?,
        })
    }
}

/// The key-padding mask for bidirectional attention: `mask` `[B, L]` (1 = token) →
/// additive `[B, 1, 1, L]` in `dtype` (0 where kept, a large negative where padded), combined
/// with an optional window `|i - j| <= half_window` (then `[B, 1, L, L]`).
pub fn attention_mask(mask: &Array, dtype: Dtype, half_window: Option<i32>) -> Result<Array> {
    let b = mask.dim(0)?;
    let l = mask.dim(1)?;
    let mut keep = mask
        .greater(&Array::scalar(0.0, mask.dtype()?)?)?
        .reshape(&[b, 1, 1, l])?;
    if let Some(w) = half_window {
        let pos = ops::arange(0.0, l as f64, 1.0, Dtype::Int32)?;
        let dist = pos
            .reshape(&[l, 1])?
            .subtract(&pos.reshape(&[1, l])?)?
            .abs()?;
        let near = dist
            .less_equal(&Array::scalar(w as f64, Dtype::Int32)?)?
            .reshape(&[1, 1, l, l])?;
        keep = keep.logical_and(&near)?;
    }
    // Finite, so a query row with no visible key (a padded row under a window) stays finite.
    let big = if dtype == Dtype::Float16 {
        -6.0e4
    } else {
        -1.0e9
    };
    let zero = Array::scalar(0.0, dtype)?;
    let neg = Array::scalar(big, dtype)?;
    Ok(ops::where_(&keep, &zero, &neg)?)
}

/// Bidirectional attention over `q`, `k`, `v` `[B, H, L, D]` with an additive `mask` from
/// [`attention_mask`] → `[B, L, H * D]`.
pub fn bidirectional_attention(q: &Array, k: &Array, v: &Array, mask: &Array) -> Result<Array> {
    let d = q.dim(-1)?;
    let b = q.dim(0)?;
    let l = q.dim(2)?;
    let h = q.dim(1)?;
    let scale = 1.0 / (d as f32).sqrt();
    let out = ops::scaled_dot_product_attention(q, k, v, scale, AttentionMask::Array(mask), None)?;
    Ok(out.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, h * d])?)
}

/// `x` `[B, L, H * D]` → `[B, H, L, D]`.
pub fn split_heads(x: &Array, heads: i32) -> Result<Array> {
    let b = x.dim(0)?;
    let l = x.dim(1)?;
    let d = x.dim(2)? / heads;
    Ok(x.reshape(&[b, l, heads, d])?.transpose(&[0, 2, 1, 3])?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two rows, the second padded after two tokens; hidden values `[B, L, 2]`.
    fn pooled(mode: Pooling) -> Vec<f32> {
        let h: Vec<f32> = vec![
            1.0, 10.0, 2.0, 20.0, 3.0, 30.0, // row 0: three tokens
            4.0, -1.0, 6.0, -3.0, 99.0, 99.0, // row 1: two tokens + padding
        ];
        let hidden = Array::from_slice(&h, &[2, 3, 2]).unwrap();
        let mask = Array::from_slice(&[1i32, 1, 1, 1, 1, 0], &[2, 3]).unwrap();
        mode.pool(&hidden, &mask).unwrap().to_vec::<f32>().unwrap()
    }

    #[test]
    fn pooling_modes_ignore_padding() {
        assert_eq!(pooled(Pooling::Mean), vec![2.0, 20.0, 5.0, -2.0]);
        assert_eq!(pooled(Pooling::Cls), vec![1.0, 10.0, 4.0, -1.0]);
        assert_eq!(pooled(Pooling::Max), vec![3.0, 30.0, 6.0, -1.0]);
        assert_eq!(pooled(Pooling::LastToken), vec![3.0, 30.0, 6.0, -3.0]);
        // Weights 1, 2, 3 over the real tokens: (1 + 4 + 9) / 6, (4 + 12) / 3.
        let w = pooled(Pooling::WeightedMean);
        let want = [14.0 / 6.0, 140.0 / 6.0, 16.0 / 3.0, -7.0 / 3.0];
        for (g, e) in w.iter().zip(want) {
            assert!((g - e).abs() < 1e-5, "{w:?}");
        }
        let s = pooled(Pooling::MeanSqrtLen);
        assert!((s[0] - 6.0 / 3f32.sqrt()).abs() < 1e-5, "{s:?}");
    }

    #[test]
    fn truncation_renormalises_and_checks_its_range() {
        let x = Array::from_slice(&[3.0f32, 4.0, 12.0], &[1, 3]).unwrap();
        let t = truncate_dimensions(&x, 2, true)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        assert!(
            (t[0] - 0.6).abs() < 1e-6 && (t[1] - 0.8).abs() < 1e-6,
            "{t:?}"
        );
        assert!(truncate_dimensions(&x, 0, true).is_err());
        assert!(truncate_dimensions(&x, 4, true).is_err());
    }

    #[test]
    fn window_mask_keeps_near_real_keys() {
        let mask = Array::from_slice(&[1i32, 1, 1, 0], &[1, 4]).unwrap();
        let m = attention_mask(&mask, Dtype::Float32, Some(1))
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let keep: Vec<bool> = m.iter().map(|v| *v == 0.0).collect();
        // Query 0 sees keys 0, 1; query 2 sees 1, 2 (key 3 is padding).
        assert_eq!(&keep[0..4], &[true, true, false, false]);
        assert_eq!(&keep[8..12], &[false, true, true, false]);
    }
}
