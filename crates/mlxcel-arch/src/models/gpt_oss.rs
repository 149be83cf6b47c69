//! OpenAI gpt-oss: attention with per-head sinks (`self_attn.sinks`, a learned logit each
//! softmax also normalises over) and biases, sliding-window and full layers alternating
//! (`layer_types`; sliding first), yarn rope, and a mixture of experts on every layer: a biased
//! router (`mlp.router`) whose top-k logits are softmaxed (= the renormalised top-k of the
//! softmax), and biased experts with gpt-oss's clamped swiglu ([`Activation::OaiSwiglu`]).
//!
//! Checkpoints store the experts fused: transformers writes `experts.gate_up_proj` `[E, H, 2I]`
//! (gate and up interleaved along the last axis) and `experts.down_proj` `[E, I, H]`, both
//! transposed against `nn.Linear`; OpenAI's release stores them MXFP4-quantized
//! (`quantization_config.quant_method: "mxfp4"`) as `*_blocks` `[E, out, in/32, 16]` (two E2M1
//! codes per byte) and `*_scales` `[E, out, in/32]` (E8M0), which are MLX's mxfp4 planes once the
//! blocks are read as uint32 — they load as they are, quantized. mlx-lm conversions are already
//! split (`experts.{gate,up,down}_proj`).

use mlxcel_core::{ops, Array, Dtype, WeightMap};
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs, MoeArgs};
use super::transformer::{DecoderArgs, DecoderSpec, FfnSpec, Transformer};
use crate::nn::{Activation, OAI_SWIGLU_ALPHA, OAI_SWIGLU_LIMIT};
use crate::{ModelError, Result};

fn yes() -> bool {
    true
}

/// The `config.json` keys of gpt-oss (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...);
    /// `intermediate_size` is the width of one expert.
    #[serde(flatten)]
    pub common: CommonArgs,
    /// The mixture-of-experts keys (`num_local_experts`, `num_experts_per_tok`).
    #[serde(flatten)]
    pub moe: MoeArgs,
    /// `attention_bias`: biases on the q/k/v and output projections; default true.
    #[serde(default = "yes")]
    pub attention_bias: bool,
    /// `swiglu_limit`: the experts' clamp; only gpt-oss's 7.0 is supported.
    #[serde(default)]
    pub swiglu_limit: Option<f64>,
    /// `swiglu_alpha`: the experts' sigmoid slope; only gpt-oss's 1.702 is supported.
    #[serde(default)]
    pub swiglu_alpha: Option<f64>,
}

/// The gpt-oss decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

/// Rows `start, start + 2, ...` of `a` along `axis` (de-interleaves gpt-oss's fused gate/up).
fn every_other(a: &Array, axis: i32, start: usize) -> Result<Array> {
    let n = a.dim(axis)?;
    let rows = ops::arange(start as f64, n as f64, 2.0, Dtype::Int32)?;
    Ok(a.take(&rows, axis)?.contiguous()?)
}

impl Args {
    /// One layer's experts from transformers' or OpenAI's fused layout to
    /// `mlp.switch_mlp.{gate,up,down}_proj.{weight,scales,bias}`.
    fn split_experts(&self, weights: &mut WeightMap, mlp: &str) -> Result<()> {
        let e = format!("{mlp}.experts");
        let s = format!("{mlp}.switch_mlp");
        // mlx-lm conversions: already split, under `experts`.
        for proj in ["gate_proj", "up_proj", "down_proj"] {
            weights.rename_prefix(&format!("{e}.{proj}."), &format!("{s}.{proj}."))?;
        }
        let put_gate_up = |weights: &mut WeightMap, fused: Array, axis: i32, plane: &str| {
            weights.insert(
                format!("{s}.gate_proj.{plane}"),
                every_other(&fused, axis, 0)?,
            )?;
            weights.insert(
                format!("{s}.up_proj.{plane}"),
                every_other(&fused, axis, 1)?,
            )?;
            Ok::<(), ModelError>(())
        };
        // transformers: `[E, in, out]` stacks.
        if weights.contains(&format!("{e}.gate_up_proj")) {
            let fused = weights.take(&format!("{e}.gate_up_proj"))?;
            put_gate_up(weights, fused.transpose(&[0, 2, 1])?, 1, "weight")?;
        }
        if weights.contains(&format!("{e}.down_proj")) {
            let down = weights.take(&format!("{e}.down_proj"))?;
            weights.insert(
                format!("{s}.down_proj.weight"),
                down.transpose(&[0, 2, 1])?.contiguous()?,
            )?;
        }
        // OpenAI's MXFP4 release: blocks `[E, out, groups, 16]` bytes → `[E, out, groups · 4]`
        // uint32 (the byte order is MLX's packing order), scales as they are.
        let blocks = |weights: &mut WeightMap, name: &str| -> Result<Array> {
            let b = weights.take(name)?;
            let shape = b.shape();
            if b.dtype()? != Dtype::Uint8 || shape.len() != 4 || shape[3] != 16 {
                return Err(ModelError::Shape {
                    tensor: name.to_string(),
                    found: shape,
                    expected: vec![self.moe.num_experts, -1, -1, 16],
                });
            }
            let flat = b.reshape(&[shape[0], shape[1], shape[2] * 16])?;
            Ok(flat.view(Dtype::Uint32)?)
        };
        if weights.contains(&format!("{e}.gate_up_proj_blocks")) {
            let fused = blocks(weights, &format!("{e}.gate_up_proj_blocks"))?;
            put_gate_up(weights, fused, 1, "weight")?;
            let scales = weights.take(&format!("{e}.gate_up_proj_scales"))?;
            put_gate_up(weights, scales, 1, "scales")?;
        }
        if weights.contains(&format!("{e}.down_proj_blocks")) {
            let down = blocks(weights, &format!("{e}.down_proj_blocks"))?;
            weights.insert(format!("{s}.down_proj.weight"), down)?;
            weights.rename(
                &format!("{e}.down_proj_scales"),
                &format!("{s}.down_proj.scales"),
            )?;
        }
        // The biases (float in every layout).
        if weights.contains(&format!("{e}.gate_up_proj_bias")) {
            let fused = weights.take(&format!("{e}.gate_up_proj_bias"))?;
            put_gate_up(weights, fused, 1, "bias")?;
        }
        if weights.contains(&format!("{e}.down_proj_bias")) {
            weights.rename(
                &format!("{e}.down_proj_bias"),
                &format!("{s}.down_proj.bias"),
            )?;
        }
        Ok(())
    }
}

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        for i in 0..self.common.num_hidden_layers {
            self.split_experts(weights, &format!("model.layers.{i}.mlp"))?;
        }
        Ok(())
    }

    fn spec(&self) -> Result<DecoderSpec> {
        for (field, value, supported) in [
            ("swiglu_limit", self.swiglu_limit, OAI_SWIGLU_LIMIT),
            ("swiglu_alpha", self.swiglu_alpha, OAI_SWIGLU_ALPHA),
        ] {
            if let Some(v) = value {
                if (v - supported).abs() > 1e-9 {
                    return Err(ModelError::Unsupported(format!(
                        "gpt_oss {field} = {v} (only gpt-oss's {supported})"
                    )));
                }
            }
        }
        let c = &self.common;
        let mut spec = base_spec(c, false, "silu")?;
        spec.act = Activation::OaiSwiglu;
        spec.qkv_bias = self.attention_bias;
        spec.o_bias = self.attention_bias;
        spec.attn_sinks = true;
        // transformers' default pattern: even layers slide, odd layers attend globally.
        spec.windows = c.windows(|i| i % 2 == 0)?;
        // The router keeps the top-k logits and softmaxes them: the renormalised top-k of the
        // softmax over all experts.
        self.moe.apply(&mut spec, c.intermediate()?, true, None);
        for ffn in &mut spec.ffn {
            match ffn {
                FfnSpec::Moe(m) => {
                    // mlx-lm quantizes the router at 8 bits with an override keyed by its name.
                    m.router = "router";
                    m.router_bias = true;
                    m.expert_bias = true;
                }
                _ => {
                    return Err(ModelError::Config(
                        "gpt_oss: every layer is a mixture of experts (decoder_sparse_step / \
                         mlp_only_layers are not gpt-oss keys)"
                            .into(),
                    ))
                }
            }
        }
        Ok(spec)
    }
}
