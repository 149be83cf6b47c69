//! Falcon-H1 (TII): every layer runs attention and a Mamba-2 mixer side by side on the same
//! normed input and adds both to the residual
//! ([`MixerSpec::AttentionWithMamba2`], one [`crate::LayerCache::Pair`] per layer), then a gated
//! MLP. The Mamba-2 mixer's inner width is `mamba_d_ssm`; its grouped RMSNorm is optional
//! (`mamba_rms_norm`) and sits before or after the output gate (`mamba_norm_before_gate`).
//!
//! The muP multipliers are folded into the projections when the checkpoint is read, as
//! transformers applies them: attention input (q, k, v) and output, the key multiplier (k and
//! its bias), the SSM input (in_proj) with its per-segment `ssm_multipliers` (rows of z, x, B, C,
//! dt), the SSM output, and the MLP's gate and down multipliers. The embedding and head
//! multipliers stay scalings of the decoder. mlx-lm conversions (the convolution in MLX's
//! `[C, K, 1]` layout) were already folded by mlx-lm, embedding and head included, except the
//! key multiplier and the attention input multiplier of v: those two are folded here and the
//! embedding and head multipliers taken back out, so both layouts run transformers' model.
//!
//! Checkpoint names: `feed_forward` → `mlp`, `pre_ff_layernorm` → `post_attention_layernorm`,
//! `final_layernorm` → `norm`; the Mamba-2 mixer stays under `mamba`.

use mlxcel_core::{Array, Dtype, WeightMap};
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::mamba2::{check_positive, dt_limit};
use super::transformer::{DecoderArgs, DecoderSpec, Mamba2Spec, MixerSpec, Transformer};
use crate::nn::ssm::{GatedNorm, Mamba2Dims};
use crate::sanitize::{conv_weights_to_torch_layout, rename_in_layers};
use crate::{ModelError, Result};

fn yes() -> bool {
    true
}
fn unit() -> f64 {
    1.0
}
fn d_ssm() -> Option<i32> {
    Some(1024)
}
fn heads() -> i32 {
    128
}
fn one() -> i32 {
    1
}
fn state() -> i32 {
    256
}
fn four() -> i32 {
    4
}
fn two() -> i32 {
    2
}
fn chunk() -> i32 {
    256
}

/// The `config.json` keys of Falcon-H1 (transformers' `FalconH1Config`).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, heads, `rms_norm_eps`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `mamba_d_ssm`: the Mamba-2 inner width; `null` for `mamba_expand · hidden_size`.
    #[serde(default = "d_ssm")]
    pub mamba_d_ssm: Option<i32>,
    /// `mamba_expand`: default 2.
    #[serde(default = "two")]
    pub mamba_expand: i32,
    /// `mamba_n_heads`: default 128.
    #[serde(default = "heads")]
    pub mamba_n_heads: i32,
    /// `mamba_d_head`: an integer or `"auto"` (inner width / heads).
    #[serde(default)]
    pub mamba_d_head: Option<serde_json::Value>,
    /// `mamba_n_groups`: default 1.
    #[serde(default = "one")]
    pub mamba_n_groups: i32,
    /// `mamba_d_state`: default 256.
    #[serde(default = "state")]
    pub mamba_d_state: i32,
    /// `mamba_d_conv`: default 4.
    #[serde(default = "four")]
    pub mamba_d_conv: i32,
    /// `mamba_chunk_size`: default 256.
    #[serde(default = "chunk")]
    pub mamba_chunk_size: i32,
    /// `mamba_conv_bias`: default true.
    #[serde(default = "yes")]
    pub mamba_conv_bias: bool,
    /// `mamba_proj_bias`: a bias on `in_proj`.
    #[serde(default)]
    pub mamba_proj_bias: bool,
    /// `projectors_bias`: a bias on the Mamba-2 `out_proj`.
    #[serde(default)]
    pub projectors_bias: bool,
    /// `mamba_rms_norm`: the grouped RMSNorm before `out_proj`; default false.
    #[serde(default)]
    pub mamba_rms_norm: bool,
    /// `mamba_norm_before_gate`: norm, then gate; default true.
    #[serde(default = "yes")]
    pub mamba_norm_before_gate: bool,
    /// `time_step_limit`: default `[0, inf]`.
    #[serde(default)]
    pub time_step_limit: Option<Vec<f64>>,
    /// `attention_bias`: biases on q/k/v/o.
    #[serde(default)]
    pub attention_bias: bool,
    /// `mlp_bias`: biases on the MLP.
    #[serde(default)]
    pub mlp_bias: bool,
    /// `embedding_multiplier`.
    #[serde(default = "unit")]
    pub embedding_multiplier: f64,
    /// `lm_head_multiplier`.
    #[serde(default = "unit")]
    pub lm_head_multiplier: f64,
    /// `key_multiplier`.
    #[serde(default = "unit")]
    pub key_multiplier: f64,
    /// `attention_in_multiplier`.
    #[serde(default = "unit")]
    pub attention_in_multiplier: f64,
    /// `attention_out_multiplier`.
    #[serde(default = "unit")]
    pub attention_out_multiplier: f64,
    /// `ssm_in_multiplier`.
    #[serde(default = "unit")]
    pub ssm_in_multiplier: f64,
    /// `ssm_out_multiplier`.
    #[serde(default = "unit")]
    pub ssm_out_multiplier: f64,
    /// `mlp_multipliers`: `[gate, down]`.
    #[serde(default)]
    pub mlp_multipliers: Option<Vec<f64>>,
    /// `ssm_multipliers`: the `in_proj` rows of z, x, B, C and dt.
    #[serde(default)]
    pub ssm_multipliers: Option<Vec<f64>>,
}

/// The Falcon-H1 model: the shared decoder, attention and Mamba-2 in every layer.
pub type Model = Transformer<Args>;

/// How a fold scales a projection.
enum Factor {
    /// Every output row alike.
    Scalar(f64),
    /// Output row `i` by `rows[i]`.
    Rows(Vec<f32>),
}

/// Multiplies the stored planes of the linear layer `name` (`weight`, or a quantized layer's
/// `scales` and `biases`: `w = scales · q + biases`, so both scale) by `factor` on its output
/// rows, and its `bias` too when `with_bias`; an absent layer is an error naming it.
fn scale_linear(map: &mut WeightMap, name: &str, factor: &Factor, with_bias: bool) -> Result<()> {
    let weight = format!("{name}.weight");
    if !map.contains(&weight) {
        return Err(ModelError::MissingTensor(weight));
    }
    let mut planes = vec!["weight", "scales", "biases"];
    if with_bias {
        planes.push("bias");
    }
    for plane in planes {
        let key = format!("{name}.{plane}");
        if !map.contains(&key) {
            continue;
        }
        let a = map.take(&key)?;
        let dtype = a.dtype()?;
        let scaled = match factor {
            Factor::Scalar(s) => a.mul_scalar(*s)?,
            Factor::Rows(rows) => {
                let mut shape = vec![rows.len() as i32];
                shape.resize(a.ndim(), 1);
                if a.dim(0)? != rows.len() as i32 {
                    return Err(ModelError::Shape {
                        tensor: key,
                        found: a.shape(),
                        expected: vec![rows.len() as i32],
                    });
                }
                a.astype(Dtype::Float32)?
                    .multiply(&Array::from_slice(rows, &shape)?)?
                    .astype(dtype)?
            }
        };
        map.insert(key, scaled)?;
    }
    Ok(())
}

impl Args {
    fn inner(&self) -> i32 {
        self.mamba_d_ssm
            .unwrap_or(self.mamba_expand * self.common.hidden_size)
    }

    fn head_dim(&self) -> Result<i32> {
        let inner = self.inner();
        match &self.mamba_d_head {
            None | Some(serde_json::Value::Null) => Ok(inner / self.mamba_n_heads.max(1)),
            Some(serde_json::Value::String(s)) if s == "auto" => {
                Ok(inner / self.mamba_n_heads.max(1))
            }
            Some(v) => v
                .as_i64()
                .filter(|d| *d > 0 && *d <= i32::MAX as i64)
                .map(|d| d as i32)
                .ok_or_else(|| {
                    ModelError::Config(format!(
                        "mamba_d_head = {v}: must be a positive integer or \"auto\""
                    ))
                }),
        }
    }

    /// `in_proj`'s bias (if any) by the segment multipliers of its rows.
    fn scale_in_proj_bias(&self, weights: &mut WeightMap, in_proj: &str) -> Result<()> {
        let bias = format!("{in_proj}.bias");
        if weights.contains(&bias) {
            let b = weights.take(&bias)?;
            let rows = Array::from_slice(&self.in_proj_rows()?, &[-1])?;
            weights.insert(bias, b.multiply(&rows.astype(b.dtype()?)?)?)?;
        }
        Ok(())
    }

    fn mlp_multipliers(&self) -> Result<(f64, f64)> {
        match self.mlp_multipliers.as_deref() {
            None => Ok((1.0, 1.0)),
            Some([gate, down]) => Ok((*gate, *down)),
            Some(other) => Err(ModelError::Config(format!(
                "mlp_multipliers = {other:?}: must be [gate, down]"
            ))),
        }
    }

    /// The per-row multipliers of `in_proj`'s output: z, x, B, C, dt segments.
    fn in_proj_rows(&self) -> Result<Vec<f32>> {
        let m = match self.ssm_multipliers.as_deref() {
            None => [1.0; 5],
            Some(&[z, x, b, c, dt]) => [z, x, b, c, dt],
            Some(other) => {
                return Err(ModelError::Config(format!(
                    "ssm_multipliers = {other:?}: must be five values (z, x, B, C, dt)"
                )))
            }
        };
        let (inner, gn) = (self.inner(), self.mamba_n_groups * self.mamba_d_state);
        let sizes = [inner, inner, gn, gn, self.mamba_n_heads];
        let mut rows = Vec::new();
        for (size, factor) in sizes.iter().zip(m) {
            rows.extend(std::iter::repeat_n(factor as f32, *size as usize));
        }
        Ok(rows)
    }
}

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let layers = self.common.num_hidden_layers;
        weights.rename_prefix("model.final_layernorm.", "model.norm.")?;
        rename_in_layers(
            weights,
            layers,
            &[
                ("feed_forward", "mlp"),
                ("pre_ff_layernorm", "post_attention_layernorm"),
            ],
        )?;
        // mlx-lm's conversions store the convolution as [C, K, 1] and were folded by mlx-lm.
        let conv = "model.layers.0.mamba.conv1d.weight";
        let folded_by_mlx_lm = weights
            .info(conv)
            .is_some_and(|i| i.shape.len() == 3 && i.shape[2] == 1 && i.shape[1] > 1);
        let (gate, down) = self.mlp_multipliers()?;
        let attn_in = self.attention_in_multiplier;
        let in_rows: Vec<f32> = self
            .in_proj_rows()?
            .into_iter()
            .map(|r| r * self.ssm_in_multiplier as f32)
            .collect();
        for i in 0..layers {
            let p = |name: &str| format!("model.layers.{i}.{name}");
            if folded_by_mlx_lm {
                scale_linear(
                    weights,
                    &p("self_attn.v_proj"),
                    &Factor::Scalar(attn_in),
                    false,
                )?;
                // The key multiplier scales the whole key, its bias too.
                let k = p("self_attn.k_proj");
                scale_linear(weights, &k, &Factor::Scalar(self.key_multiplier), true)?;
                // mlx-lm folded weights only: the output multipliers' biases.
                for (name, m) in [
                    ("self_attn.o_proj", self.attention_out_multiplier),
                    ("mamba.out_proj", self.ssm_out_multiplier),
                    ("mlp.gate_proj", gate),
                    ("mlp.down_proj", down),
                ] {
                    let bias = p(&format!("{name}.bias"));
                    if weights.contains(&bias) {
                        let b = weights.take(&bias)?;
                        weights.insert(bias, b.mul_scalar(m)?)?;
                    }
                }
                self.scale_in_proj_bias(weights, &p("mamba.in_proj"))?;
                continue;
            }
            for proj in ["q_proj", "v_proj"] {
                scale_linear(
                    weights,
                    &p(&format!("self_attn.{proj}")),
                    &Factor::Scalar(attn_in),
                    false,
                )?;
            }
            let k = p("self_attn.k_proj");
            scale_linear(weights, &k, &Factor::Scalar(attn_in), false)?;
            scale_linear(weights, &k, &Factor::Scalar(self.key_multiplier), true)?;
            let o = &Factor::Scalar(self.attention_out_multiplier);
            scale_linear(weights, &p("self_attn.o_proj"), o, true)?;
            // in_proj: the input multiplier scales the weight only; the segment multipliers
            // scale whole rows (the bias too), so the bias gets those alone.
            let in_proj = p("mamba.in_proj");
            scale_linear(weights, &in_proj, &Factor::Rows(in_rows.clone()), false)?;
            self.scale_in_proj_bias(weights, &in_proj)?;
            let out = &Factor::Scalar(self.ssm_out_multiplier);
            scale_linear(weights, &p("mamba.out_proj"), out, true)?;
            scale_linear(weights, &p("mlp.gate_proj"), &Factor::Scalar(gate), true)?;
            scale_linear(weights, &p("mlp.down_proj"), &Factor::Scalar(down), true)?;
        }
        if folded_by_mlx_lm {
            // Back to the stored table and head: the decoder applies these two multipliers.
            let unfold = |w: &mut WeightMap, name: &str, m: f64| -> Result<()> {
                if w.contains(&format!("{name}.weight")) {
                    scale_linear(w, name, &Factor::Scalar(1.0 / m), true)?;
                }
                Ok(())
            };
            unfold(weights, "model.embed_tokens", self.embedding_multiplier)?;
            unfold(weights, "lm_head", self.lm_head_multiplier)?;
        }
        conv_weights_to_torch_layout(weights)
    }

    fn spec(&self) -> Result<DecoderSpec> {
        check_positive(&[
            ("mamba_n_heads", self.mamba_n_heads),
            ("mamba_n_groups", self.mamba_n_groups),
            ("mamba_d_state", self.mamba_d_state),
            ("mamba_d_conv", self.mamba_d_conv),
            ("mamba_chunk_size", self.mamba_chunk_size),
            ("mamba_d_ssm", self.inner()),
        ])?;
        let mut spec = base_spec(&self.common, false, "silu")?;
        spec.qkv_bias = self.attention_bias;
        spec.o_bias = self.attention_bias;
        spec.mlp_bias = self.mlp_bias;
        spec.embed_scale = (self.embedding_multiplier != 1.0).then_some(self.embedding_multiplier);
        spec.logit_scale = (self.lm_head_multiplier != 1.0).then_some(self.lm_head_multiplier);
        let gated_norm = match (self.mamba_rms_norm, self.mamba_norm_before_gate) {
            (false, _) => GatedNorm::GateOnly,
            (true, true) => GatedNorm::NormThenGate,
            (true, false) => GatedNorm::GateThenNorm,
        };
        let mamba = Mamba2Spec {
            dims: Mamba2Dims {
                inner: self.inner(),
                heads: self.mamba_n_heads,
                head_dim: self.head_dim()?,
                groups: self.mamba_n_groups,
                state: self.mamba_d_state,
                chunk: self.mamba_chunk_size,
            },
            conv_kernel: self.mamba_d_conv,
            conv_bias: self.mamba_conv_bias,
            proj_bias: self.mamba_proj_bias,
            norm_eps: self.common.rms_norm_eps,
            gated_norm,
            dt_limit: dt_limit(self.time_step_limit.as_deref())?,
        };
        if self.projectors_bias != self.mamba_proj_bias {
            return Err(ModelError::Unsupported(
                "Falcon-H1 with projectors_bias different from mamba_proj_bias".into(),
            ));
        }
        spec.mixers = vec![MixerSpec::AttentionWithMamba2(mamba); self.common.num_hidden_layers];
        Ok(spec)
    }
}
