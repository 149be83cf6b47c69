//! Jamba: attention and Mamba layers interleaved (layer `i` attends when
//! `i % attn_layer_period == attn_layer_offset`), each followed by a dense MLP or a softmax-routed
//! mixture of experts (`i % expert_layer_period == expert_layer_offset`; top-k weights not
//! renormalised). Attention has no positional encoding (the Mamba layers carry position); the
//! Mamba layers normalise dt, B and C with weighted RMS norms.
//!
//! Checkpoint names: `mamba` → `mixer`, `feed_forward` → `mlp` (its `router` → `gate`, per-expert
//! tensors stacked into `switch_mlp`), `pre_ff_layernorm` → `post_attention_layernorm`,
//! `final_layernorm` → `norm`.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;
use serde_json::Value;

use super::common::{base_spec, CommonArgs};
use super::mamba::rank_or_auto;
use super::mamba2::check_positive;
use super::transformer::{
    BcdtNormSpec, DecoderArgs, DecoderSpec, FfnSpec, MambaSpec, MixerSpec, MoeSpec, Transformer,
};
use crate::nn::ssm::MambaDims;
use crate::sanitize::{conv_weights_to_torch_layout, rename_in_layers, stack_experts};
use crate::Result;

fn yes() -> bool {
    true
}
fn one() -> usize {
    1
}
fn two() -> usize {
    2
}
fn eight() -> usize {
    8
}
fn four() -> usize {
    4
}
fn sixteen() -> i32 {
    16
}
fn expand_two() -> i32 {
    2
}
fn conv_four() -> i32 {
    4
}

/// The `config.json` keys of Jamba (transformers' `JambaConfig`).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, heads, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `attn_layer_period`: default 8.
    #[serde(default = "eight")]
    pub attn_layer_period: usize,
    /// `attn_layer_offset`: default 4.
    #[serde(default = "four")]
    pub attn_layer_offset: usize,
    /// `expert_layer_period`: default 2.
    #[serde(default = "two")]
    pub expert_layer_period: usize,
    /// `expert_layer_offset`: default 1.
    #[serde(default = "one")]
    pub expert_layer_offset: usize,
    /// `num_experts`: routed experts of an MoE layer; default 16 (1 = no MoE layers).
    #[serde(default)]
    pub num_experts: Option<i32>,
    /// `num_experts_per_tok`: default 2.
    #[serde(default)]
    pub num_experts_per_tok: Option<i32>,
    /// `mamba_d_state`: default 16.
    #[serde(default = "sixteen")]
    pub mamba_d_state: i32,
    /// `mamba_d_conv`: default 4.
    #[serde(default = "conv_four")]
    pub mamba_d_conv: i32,
    /// `mamba_expand`: default 2.
    #[serde(default = "expand_two")]
    pub mamba_expand: i32,
    /// `mamba_dt_rank`: an integer or `"auto"` (`ceil(hidden_size / 16)`).
    #[serde(default)]
    pub mamba_dt_rank: Option<Value>,
    /// `mamba_conv_bias`: default true.
    #[serde(default = "yes")]
    pub mamba_conv_bias: bool,
    /// `mamba_proj_bias`: default false.
    #[serde(default)]
    pub mamba_proj_bias: bool,
}

impl Args {
    fn is_attention(&self, i: usize) -> bool {
        i % self.attn_layer_period == self.attn_layer_offset
    }

    fn experts(&self) -> i32 {
        self.num_experts.unwrap_or(16)
    }

    fn is_moe(&self, i: usize) -> bool {
        self.experts() > 1 && i % self.expert_layer_period == self.expert_layer_offset
    }
}

/// The Jamba model: the shared decoder with per-layer attention or Mamba mixers.
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let n = self.common.num_hidden_layers;
        weights.rename_prefix("model.final_layernorm.", "model.norm.")?;
        rename_in_layers(
            weights,
            n,
            &[
                ("mamba", "mixer"),
                ("feed_forward.router", "feed_forward.gate"),
                ("feed_forward", "mlp"),
                ("pre_ff_layernorm", "post_attention_layernorm"),
            ],
        )?;
        for i in 0..n {
            if self.is_moe(i) {
                stack_experts(
                    weights,
                    &format!("model.layers.{i}.mlp"),
                    "experts",
                    self.experts() as usize,
                    &[
                        ("gate_proj", "gate_proj"),
                        ("up_proj", "up_proj"),
                        ("down_proj", "down_proj"),
                    ],
                )?;
            }
        }
        conv_weights_to_torch_layout(weights)
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let c = &self.common;
        check_positive(&[
            ("mamba_d_state", self.mamba_d_state),
            ("mamba_d_conv", self.mamba_d_conv),
            ("mamba_expand", self.mamba_expand),
        ])?;
        if self.attn_layer_period == 0 || self.expert_layer_period == 0 {
            return Err(crate::ModelError::Config(
                "attn_layer_period and expert_layer_period must be positive".into(),
            ));
        }
        let mut spec = base_spec(c, false, "silu")?;
        let mamba = MixerSpec::Mamba(MambaSpec {
            dims: MambaDims {
                inner: self.mamba_expand * c.hidden_size,
                state: self.mamba_d_state,
                dt_rank: rank_or_auto(self.mamba_dt_rank.as_ref(), c.hidden_size, "mamba_dt_rank")?,
            },
            conv_kernel: self.mamba_d_conv,
            conv_bias: self.mamba_conv_bias,
            proj_bias: self.mamba_proj_bias,
            bcdt_norms: Some(BcdtNormSpec {
                weighted: true,
                eps: c.rms_norm_eps,
            }),
        });
        let moe = MoeSpec::softmax(
            self.experts(),
            self.num_experts_per_tok.unwrap_or(2),
            c.intermediate()?,
            false,
        );
        for i in 0..c.num_hidden_layers {
            // Attention without rope: position reaches it only through the Mamba layers.
            spec.rope[i] = None;
            if !self.is_attention(i) {
                spec.mixers[i] = mamba.clone();
            }
            if self.is_moe(i) {
                spec.ffn[i] = FfnSpec::Moe(moe.clone());
            }
        }
        Ok(spec)
    }
}
