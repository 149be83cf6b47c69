//! Rotary position embeddings with the scalings configs ask for: default, linear, dynamic NTK,
//! llama3, yarn and longrope (phi3). Frequencies follow transformers' `_compute_*_parameters`
//! and are handed to MLX's fused rope as periods (`freqs` = 1 / inv_freq).

use mlxcel_core::ops::Rope;
use mlxcel_core::Array;
use serde_json::Value;

use crate::{ModelError, Result};

/// What a config says about rotary embeddings, gathered from the architecture's args.
#[derive(Debug, Clone)]
pub struct RopeConfig {
    /// The base of the frequencies (`rope_theta`; `rope_local_base_freq` for Gemma 3's local
    /// layers).
    pub base: f64,
    /// Width of one attention head.
    pub head_dim: i32,
    /// Rotated dims (partial rotary: `head_dim * partial_rotary_factor`).
    pub dims: i32,
    /// Rotate interleaved pairs `(x0, x1), (x2, x3), ..` instead of the two halves (set by
    /// Cohere, GLM-4 and DeepSeek; false for most checkpoints).
    pub traditional: bool,
    /// `rope_scaling` as written (already sanitised), or `None`.
    pub scaling: Option<Value>,
    /// `max_position_embeddings` (dynamic NTK and longrope scaling read it).
    pub max_position_embeddings: Option<i64>,
}

#[derive(Debug, Clone)]
enum Scaling {
    /// Fixed periods (default, linear, llama3, yarn), and a factor applied to the rotated part.
    Fixed {
        freqs: Option<Array>,
        scale: f32,
        attention_factor: f64,
    },
    /// NTK-aware base growth once positions exceed `max_positions`.
    Dynamic { factor: f64, max_positions: i64 },
    /// Phi3 longrope: short factors up to `original_max`, long factors beyond.
    LongRope {
        short: Array,
        long: Array,
        original_max: i64,
        attention_factor: f64,
    },
}

/// A rotary embedding ready to apply to `[B, H, L, D]` queries and keys.
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    dims: i32,
    base: f64,
    traditional: bool,
    scaling: Scaling,
    /// [`RotaryEmbedding::fixed_inv_freq`] as a float32 array, made at its first use
    /// ([`RotaryEmbedding::inv_freq_array`]).
    inv_freq_array: std::cell::OnceCell<Option<(Array, bool)>>,
}

fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

fn field_err(key: &str) -> ModelError {
    ModelError::Config(format!("rope_scaling.{key} is required for this rope type"))
}

/// Periods for `dims` rotated dims from inverse frequencies.
fn periods(inv_freq: &[f64]) -> Result<Array> {
    let p: Vec<f32> = inv_freq.iter().map(|f| (1.0 / f) as f32).collect();
    Ok(Array::from_slice(&p, &[p.len() as i32])?)
}

fn default_inv_freq(base: f64, dims: i32) -> Vec<f64> {
    (0..dims / 2)
        .map(|i| 1.0 / base.powf(2.0 * i as f64 / dims as f64))
        .collect()
}

fn factor_list(v: &Value, key: &str, len: i32) -> Result<Vec<f64>> {
    let list = v
        .get(key)
        .and_then(Value::as_array)
        .ok_or_else(|| field_err(key))?;
    let vals: Vec<f64> = list.iter().filter_map(Value::as_f64).collect();
    if vals.len() != len as usize {
        return Err(ModelError::Config(format!(
            "rope_scaling.{key} has {} entries, expected {len} (rotary dims / 2)",
            vals.len()
        )));
    }
    Ok(vals)
}

impl RotaryEmbedding {
    /// Builds the frequencies for `cfg`, including the `rope_scaling` type (`linear`,
    /// `dynamic`, `llama3`, `yarn`, `longrope`, ...): a malformed scaling is a
    /// [`crate::ModelError::Config`] error, an unknown type [`crate::ModelError::Unsupported`].
    pub fn new(cfg: &RopeConfig) -> Result<RotaryEmbedding> {
        let dims = cfg.dims;
        let base = cfg.base;
        let fixed = |freqs: Option<Array>, scale: f64, attention_factor: f64| Scaling::Fixed {
            freqs,
            scale: scale as f32,
            attention_factor,
        };
        let Some(s) = cfg.scaling.as_ref() else {
            return Ok(RotaryEmbedding {
                dims,
                base,
                traditional: cfg.traditional,
                scaling: fixed(None, 1.0, 1.0),
                inv_freq_array: Default::default(),
            });
        };
        let kind = s
            .get("rope_type")
            .or_else(|| s.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let factor = num(s, "factor");
        let scaling = match kind {
            "default" => fixed(None, 1.0, 1.0),
            "linear" => fixed(None, 1.0 / factor.ok_or_else(|| field_err("factor"))?, 1.0),
            "dynamic" => Scaling::Dynamic {
                factor: factor.ok_or_else(|| field_err("factor"))?,
                max_positions: cfg.max_position_embeddings.ok_or_else(|| {
                    ModelError::Config("dynamic rope needs max_position_embeddings".into())
                })?,
            },
            "llama3" => {
                let factor = factor.ok_or_else(|| field_err("factor"))?;
                let low = num(s, "low_freq_factor").ok_or_else(|| field_err("low_freq_factor"))?;
                let high =
                    num(s, "high_freq_factor").ok_or_else(|| field_err("high_freq_factor"))?;
                let old = num(s, "original_max_position_embeddings")
                    .ok_or_else(|| field_err("original_max_position_embeddings"))?;
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                let inv: Vec<f64> = default_inv_freq(base, dims)
                    .into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low) / (high - low);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect();
                fixed(Some(periods(&inv)?), 1.0, 1.0)
            }
            "yarn" => {
                let factor = factor.ok_or_else(|| field_err("factor"))?;
                let original = num(s, "original_max_position_embeddings")
                    .or(cfg.max_position_embeddings.map(|v| v as f64))
                    .ok_or_else(|| field_err("original_max_position_embeddings"))?;
                let get_mscale = |scale: f64, m: f64| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * scale.ln() + 1.0
                    }
                };
                let attention_factor = match (
                    num(s, "attention_factor"),
                    num(s, "mscale"),
                    num(s, "mscale_all_dim"),
                ) {
                    (Some(a), _, _) => a,
                    (None, Some(m), Some(mad)) if m != 0.0 && mad != 0.0 => {
                        get_mscale(factor, m) / get_mscale(factor, mad)
                    }
                    _ => get_mscale(factor, 1.0),
                };
                let beta_fast = num(s, "beta_fast").unwrap_or(32.0);
                let beta_slow = num(s, "beta_slow").unwrap_or(1.0);
                let d = dims as f64;
                let correction = |rot: f64| {
                    (d * (original / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln())
                };
                let truncate = s.get("truncate").and_then(Value::as_bool).unwrap_or(true);
                let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
                if truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let high = high.min(d - 1.0);
                let high = if low == high { high + 0.001 } else { high };
                let inv: Vec<f64> = (0..dims / 2)
                    .map(|i| {
                        let pos_freq = base.powf(2.0 * i as f64 / d);
                        let extrapolation = 1.0 / pos_freq;
                        let interpolation = 1.0 / (factor * pos_freq);
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_factor)
                            + extrapolation * extrapolation_factor
                    })
                    .collect();
                fixed(Some(periods(&inv)?), 1.0, attention_factor)
            }
            "longrope" | "su" => {
                let original = num(s, "original_max_position_embeddings")
                    .map(|v| v as i64)
                    .or(cfg.max_position_embeddings)
                    .ok_or_else(|| field_err("original_max_position_embeddings"))?;
                let max = cfg.max_position_embeddings.unwrap_or(original);
                let factor = factor.unwrap_or(max as f64 / original as f64);
                let attention_factor = match num(s, "attention_factor") {
                    Some(a) => a,
                    None if factor <= 1.0 => 1.0,
                    None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
                };
                let inv = default_inv_freq(base, dims);
                let scaled = |key: &str| -> Result<Array> {
                    let f = factor_list(s, key, dims / 2)?;
                    periods(&inv.iter().zip(&f).map(|(i, f)| i / f).collect::<Vec<_>>())
                };
                Scaling::LongRope {
                    short: scaled("short_factor")?,
                    long: scaled("long_factor")?,
                    original_max: original,
                    attention_factor,
                }
            }
            other => {
                return Err(ModelError::Unsupported(format!(
                    "rope_scaling type `{other}`"
                )))
            }
        };
        Ok(RotaryEmbedding {
            dims,
            base,
            traditional: cfg.traditional,
            scaling,
            inv_freq_array: Default::default(),
        })
    }

    /// For the CPU decode engine: the angle per position of each rotated pair (`inv_freq`, a
    /// linear scaling folded in), whether pairs are interleaved, when the periods are fixed and
    /// unscaled afterwards (default, linear, llama3, yarn without an attention factor); `None`
    /// for position-dependent scalings (dynamic NTK, longrope) and yarn's attention factor.
    pub(crate) fn fixed_inv_freq(&self) -> Result<Option<(Vec<f32>, bool)>> {
        let Scaling::Fixed {
            freqs,
            scale,
            attention_factor,
        } = &self.scaling
        else {
            return Ok(None);
        };
        if *attention_factor != 1.0 {
            return Ok(None);
        }
        // As MLX's rope computes them: from the periods when given, else base^(-2i/dims).
        let inv: Vec<f32> = match freqs {
            Some(periods) => periods
                .to_vec::<f32>()?
                .iter()
                .map(|p| (1.0 / *p) * *scale)
                .collect(),
            None => default_inv_freq(self.base, self.dims)
                .iter()
                .map(|f| (*f as f32) * *scale)
                .collect(),
        };
        Ok(Some((inv, self.traditional)))
    }

    /// [`RotaryEmbedding::fixed_inv_freq`] as a float32 array `[dims / 2]`, for the kernels that
    /// rotate inside a fused op (`mlxcel_core::cuda_kernels::heads_rope`); made once.
    pub(crate) fn inv_freq_array(&self) -> Result<Option<(Array, bool)>> {
        if let Some(made) = self.inv_freq_array.get() {
            return Ok(made.clone());
        }
        let made = match self.fixed_inv_freq()? {
            Some((inv, traditional)) => {
                Some((Array::from_slice(&inv, &[inv.len() as i32])?, traditional))
            }
            None => None,
        };
        Ok(self.inv_freq_array.get_or_init(|| made).clone())
    }

    /// Applies the rotation to `x` `[B, H, L, D]` whose first row is at position `offset`.
    pub fn forward(&self, x: &Array, offset: usize) -> Result<Array> {
        let length = x.dim(-2)? as usize;
        let dims = self.dims;
        let traditional = self.traditional;
        fn spec(
            dims: i32,
            traditional: bool,
            base: f64,
            scale: f32,
            freqs: Option<&Array>,
        ) -> Rope<'_> {
            Rope {
                dims,
                traditional,
                base: base as f32,
                scale,
                freqs,
            }
        }
        let (y, attention_factor) = match &self.scaling {
            Scaling::Fixed {
                freqs,
                scale,
                attention_factor,
            } => (
                x.rope(
                    &spec(dims, traditional, self.base, *scale, freqs.as_ref()),
                    offset as i32,
                )?,
                *attention_factor,
            ),
            Scaling::Dynamic {
                factor,
                max_positions,
            } => {
                let seq = (offset + length) as f64;
                let base = if seq > *max_positions as f64 {
                    let d = self.dims as f64;
                    self.base
                        * ((factor * seq / *max_positions as f64) - (factor - 1.0))
                            .powf(d / (d - 2.0))
                } else {
                    self.base
                };
                (
                    x.rope(&spec(dims, traditional, base, 1.0, None), offset as i32)?,
                    1.0,
                )
            }
            Scaling::LongRope {
                short,
                long,
                original_max,
                attention_factor,
            } => {
                let freqs = if (offset + length) as i64 > *original_max {
                    long
                } else {
                    short
                };
                (
                    x.rope(
                        &spec(dims, traditional, self.base, 1.0, Some(freqs)),
                        offset as i32,
                    )?,
                    *attention_factor,
                )
            }
        };
        self.scale_rotated(y, attention_factor)
    }

    /// `y` (a rotated input) with its rotated features scaled by `attention_factor`:
    /// transformers scales cos and sin, i.e. only the rotated part.
    fn scale_rotated(&self, y: Array, attention_factor: f64) -> Result<Array> {
        if attention_factor == 1.0 {
            return Ok(y);
        }
        let head_dim = y.dim(-1)?;
        if self.dims == head_dim {
            return Ok(y.mul_scalar(attention_factor)?);
        }
        let parts = y.split_at(&[self.dims], -1)?;
        Ok(mlxcel_core::ops::concatenate(
            &[parts[0].mul_scalar(attention_factor)?, parts[1].clone()],
            -1,
        )?)
    }

    /// Whether [`RotaryEmbedding::forward_offsets`] applies: the frequencies do not depend on
    /// the sequence length (not dynamic NTK or LongRoPE scaling).
    pub fn takes_row_offsets(&self) -> bool {
        matches!(self.scaling, Scaling::Fixed { .. })
    }

    /// Rotates `x` `[B, heads, L, D]` with row `b` starting at position `offsets[b]`
    /// (`offsets` `[B]` int32): several conversations at different positions in one batch.
    pub fn forward_offsets(&self, x: &Array, offsets: &Array) -> Result<Array> {
        let Scaling::Fixed {
            freqs,
            scale,
            attention_factor,
        } = &self.scaling
        else {
            return Err(ModelError::Unsupported(
                "per-row positions with dynamic or longrope rope scaling".into(),
            ));
        };
        let spec = Rope {
            dims: self.dims,
            traditional: self.traditional,
            base: self.base as f32,
            scale: *scale,
            freqs: freqs.as_ref(),
        };
        let y = x.rope_at_offsets(&spec, offsets)?;
        self.scale_rotated(y, *attention_factor)
    }

    /// Rotates `x` at the explicit `positions` when given (see [`RotaryEmbedding::forward_at`]),
    /// else at consecutive positions from `offset` (see [`RotaryEmbedding::forward`]).
    pub fn rotate(&self, x: &Array, positions: Option<&Array>, offset: usize) -> Result<Array> {
        match positions {
            Some(p) => self.forward_at(x, p),
            None => self.forward(x, offset),
        }
    }

    /// Applies the rotation at explicit positions `positions` (`[L]` or `[B, L]`, integers)
    /// instead of consecutive positions from an offset: what M-RoPE sections and inputs merged
    /// from other towers need. `[B, L, dims / 2]` gives each rotary frequency its own position
    /// (M-RoPE: the temporal, height or width position of the frequency's section, see
    /// `vision::qwen2_vl::mrope_positions`). Computed with element-wise ops (MLX's fused rope takes only an
    /// offset); equals [`RotaryEmbedding::forward`] at `offset..offset + L`.
    pub fn forward_at(&self, x: &Array, positions: &Array) -> Result<Array> {
        let (periods, scale, attention_factor) = match &self.scaling {
            Scaling::Fixed {
                freqs,
                scale,
                attention_factor,
            } => (freqs.clone(), *scale, *attention_factor),
            _ => {
                return Err(ModelError::Unsupported(
                    "explicit position ids with dynamic or longrope rope scaling".into(),
                ))
            }
        };
        let dtype = x.dtype()?;
        let half = self.dims / 2;
        let inv_freq = match periods {
            Some(p) => p.astype(mlxcel_core::Dtype::Float32)?.reciprocal()?,
            None => {
                let inv: Vec<f32> = default_inv_freq(self.base, self.dims)
                    .into_iter()
                    .map(|f| f as f32)
                    .collect();
                Array::from_slice(&inv, &[half])?
            }
        };
        let pos = positions.astype(mlxcel_core::Dtype::Float32)?;
        let pos = match pos.ndim() {
            1 => pos.reshape(&[1, 1, -1, 1])?,
            2 => pos.reshape(&[pos.dim(0)?, 1, -1, 1])?,
            3 if pos.dim(2)? == half => pos.reshape(&[pos.dim(0)?, 1, -1, half])?,
            n => {
                return Err(ModelError::Runtime(format!(
                    "position ids must be [L], [B, L] or per frequency [B, L, {half}], got shape {:?} ({n} dimensions)",
                    positions.shape()
                )))
            }
        };
        if pos.dim(2)? != x.dim(-2)? {
            return Err(ModelError::Runtime(format!(
                "{} position ids for {} input rows",
                pos.dim(2)?,
                x.dim(-2)?
            )));
        }
        let angles = pos
            .mul_scalar(scale as f64)?
            .multiply(&inv_freq.reshape(&[1, 1, 1, half])?)?;
        let (cos, sin) = (angles.cos()?.astype(dtype)?, angles.sin()?.astype(dtype)?);
        let head_dim = x.dim(-1)?;
        let (rot, pass) = if self.dims == head_dim {
            (x.clone(), None)
        } else {
            let parts = x.split_at(&[self.dims], -1)?;
            (parts[0].clone(), Some(parts[1].clone()))
        };
        let rotated = if self.traditional {
            // Interleaved pairs (x0, x1), (x2, x3), ...
            let mut shape = rot.shape();
            let last = shape.len() - 1;
            shape[last] = half;
            shape.push(2);
            let pairs = rot.reshape(&shape)?;
            let x1 = pairs.slice_axis(-1, 0, 1)?.squeeze(&[-1])?;
            let x2 = pairs.slice_axis(-1, 1, 2)?.squeeze(&[-1])?;
            let a = x1.multiply(&cos)?.subtract(&x2.multiply(&sin)?)?;
            let b = x1.multiply(&sin)?.add(&x2.multiply(&cos)?)?;
            mlxcel_core::ops::stack(&[a, b], -1)?.reshape(&rot.shape())?
        } else {
            let parts = rot.split_at(&[half], -1)?;
            let (x1, x2) = (&parts[0], &parts[1]);
            let a = x1.multiply(&cos)?.subtract(&x2.multiply(&sin)?)?;
            let b = x2.multiply(&cos)?.add(&x1.multiply(&sin)?)?;
            mlxcel_core::ops::concatenate(&[a, b], -1)?
        };
        let rotated = if attention_factor == 1.0 {
            rotated
        } else {
            rotated.mul_scalar(attention_factor)?
        };
        Ok(match pass {
            Some(p) => mlxcel_core::ops::concatenate(&[rotated, p], -1)?,
            None => rotated,
        })
    }

    /// The arrays built at load (frequency tables).
    pub fn arrays(&self) -> Vec<&Array> {
        match &self.scaling {
            Scaling::Fixed { freqs, .. } => freqs.iter().collect(),
            Scaling::Dynamic { .. } => vec![],
            Scaling::LongRope { short, long, .. } => vec![short, long],
        }
    }
}
