//! Qwen3-Next: gated DeltaNet linear-attention layers ([`crate::nn::GatedDeltaNet`]) with a
//! gated full-attention layer every `full_attention_interval` layers (or as `layer_types` says),
//! each followed by a sparse MoE block (softmax top-k routing plus a sigmoid-gated shared
//! expert) or, on `mlp_only_layers`, a dense MLP.
//!
//! The attention layers differ from Qwen3's in two ways: `q_proj` emits each head's query and
//! an output gate side by side (the attention output is multiplied by `sigmoid(gate)` before
//! `o_proj`), and rope covers only `partial_rotary_factor` (default ¼) of each head.
//!
//! Checkpoint conventions: transformers' checkpoints store the decoder's RMSNorms (input,
//! post-attention, final, q/k) zero-centred — the norm scales by `1 + w` — while mlx-lm's
//! conversions store `1 + w` (its sanitiser adds the one, and moves the convolution weights to
//! MLX's `[channels, kernel, 1]` layout at the same time). The convolution layout therefore
//! tells the two apart, and a transformers checkpoint gets its one added at load. The DeltaNet's
//! own gated norm scales by `w` in both.
//!
//! Checkpoint names: per-expert `mlp.experts.{e}.*` are stacked into `mlp.switch_mlp.*`, and
//! `q_proj` is split into `q_proj` and `output_gate`; the multi-token-prediction head (`mtp.*`)
//! is not used.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs, MoeArgs};
use super::mamba2::check_positive;
use super::transformer::{
    DecoderArgs, DecoderSpec, DeltaLayout, GatedDeltaSpec, MixerSpec, QkNormSpec, Transformer,
};
use crate::nn::GatedDeltaDims;
use crate::sanitize::{conv_weights_to_torch_layout, split_interleaved_rows, stack_mlp_experts};
use crate::{ModelError, Result};

fn four() -> i32 {
    4
}
fn four_layers() -> usize {
    4
}
fn head_width() -> i32 {
    128
}
fn sixteen() -> i32 {
    16
}
fn thirty_two() -> i32 {
    32
}

/// The linear-attention and layer-pattern keys Qwen3-Next and Qwen3.5 share.
#[derive(Debug, Clone, Deserialize)]
pub struct LinearAttentionArgs {
    /// `full_attention_interval`: without `layer_types`, layer `i` attends when
    /// `(i + 1) % full_attention_interval == 0`; default 4.
    #[serde(default = "four_layers")]
    pub full_attention_interval: usize,
    /// `linear_conv_kernel_dim`: default 4.
    #[serde(default = "four")]
    pub linear_conv_kernel_dim: i32,
    /// `linear_key_head_dim`: default 128.
    #[serde(default = "head_width")]
    pub linear_key_head_dim: i32,
    /// `linear_value_head_dim`: default 128.
    #[serde(default = "head_width")]
    pub linear_value_head_dim: i32,
    /// `linear_num_key_heads`: default 16.
    #[serde(default = "sixteen")]
    pub linear_num_key_heads: i32,
    /// `linear_num_value_heads`: default 32.
    #[serde(default = "thirty_two")]
    pub linear_num_value_heads: i32,
    /// `attention_bias`: biases on q/k/v/o; default false.
    #[serde(default)]
    pub attention_bias: bool,
}

impl LinearAttentionArgs {
    /// Per layer: does it attend (`full_attention`) rather than run the delta rule
    /// (`linear_attention`)? From `layer_types` when present, else `full_attention_interval`.
    pub(crate) fn attends(&self, common: &CommonArgs) -> Result<Vec<bool>> {
        let n = common.num_hidden_layers;
        match common.layer_type_flags("full_attention", "linear_attention")? {
            Some(attends) => Ok(attends),
            None => {
                let every = self.full_attention_interval;
                if every == 0 {
                    return Err(ModelError::Config(
                        "full_attention_interval = 0: must be positive".into(),
                    ));
                }
                Ok((0..n).map(|i| (i + 1) % every == 0).collect())
            }
        }
    }

    fn dims(&self) -> Result<GatedDeltaDims> {
        check_positive(&[
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
        ])?;
        if self.linear_num_value_heads % self.linear_num_key_heads != 0 {
            return Err(ModelError::Config(format!(
                "linear_num_value_heads {} must be a multiple of linear_num_key_heads {}",
                self.linear_num_value_heads, self.linear_num_key_heads
            )));
        }
        Ok(GatedDeltaDims {
            key_heads: self.linear_num_key_heads,
            key_dim: self.linear_key_head_dim,
            value_heads: self.linear_num_value_heads,
            value_dim: self.linear_value_head_dim,
        })
    }

    /// The hybrid's spec before its feed-forward blocks are chosen: gated attention (per-head
    /// q/k norms, rope on `partial_rotary_factor` — default ¼ — of each head) on the attending
    /// layers, the gated DeltaNet (`layout`) on the others, dense MLPs of `intermediate_size`.
    pub(crate) fn spec(&self, common: &CommonArgs, layout: DeltaLayout) -> Result<DecoderSpec> {
        let dims = self.dims()?;
        let mut common = common.clone();
        // transformers' default for Qwen3-Next and Qwen3.5: rope on a quarter of each head.
        common.partial_rotary_factor.get_or_insert(0.25);
        let mut spec = base_spec(&common, false, "silu")?;
        spec.qk_norm = QkNormSpec::PerHead;
        spec.attn_output_gate = true;
        spec.qkv_bias = self.attention_bias;
        spec.o_bias = self.attention_bias;
        let delta = MixerSpec::GatedDelta(GatedDeltaSpec {
            dims,
            conv_kernel: self.linear_conv_kernel_dim,
            norm_eps: common.rms_norm_eps,
            layout,
        });
        for (i, attends) in self.attends(&common)?.into_iter().enumerate() {
            if !attends {
                spec.mixers[i] = delta.clone();
                spec.rope[i] = None;
            }
        }
        Ok(spec)
    }

    /// The rewrites both families' checkpoints need (see the module docs): `mtp.*` dropped,
    /// transformers' zero-centred norms uncentred, convolutions in PyTorch's layout, per-expert
    /// tensors of `experts` experts stacked, and each attending layer's `q_proj` split into
    /// `q_proj` and `output_gate`.
    pub(crate) fn sanitize(
        &self,
        common: &CommonArgs,
        weights: &mut WeightMap,
        experts: usize,
    ) -> Result<()> {
        let mtp: Vec<String> = weights
            .names()
            .filter(|n| n.starts_with("mtp."))
            .map(str::to_string)
            .collect();
        for name in mtp {
            weights.remove(&name);
        }
        if transformers_layout(weights) {
            uncentre_norms(weights, CENTRED_NORMS)?;
        }
        conv_weights_to_torch_layout(weights)?;
        stack_mlp_experts(weights, common.num_hidden_layers, experts)?;
        let (heads, head_dim) = (common.num_attention_heads, common.head_dim());
        for (i, attends) in self.attends(common)?.into_iter().enumerate() {
            if attends {
                let at = |m: &str| format!("model.layers.{i}.self_attn.{m}");
                split_interleaved_rows(
                    weights,
                    &at("q_proj"),
                    heads,
                    head_dim,
                    (&at("q_proj"), &at("output_gate")),
                )?;
            }
        }
        Ok(())
    }
}

/// The `config.json` keys of Qwen3-Next (transformers' `Qwen3NextConfig`).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, heads, `head_dim`, rope, `layer_types`,
    /// ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// The MoE keys (`num_experts`, `num_experts_per_tok`, `moe_intermediate_size`,
    /// `norm_topk_prob`, `decoder_sparse_step`, `mlp_only_layers`).
    #[serde(flatten)]
    pub moe: MoeArgs,
    /// The linear-attention keys and the layer pattern.
    #[serde(flatten)]
    pub linear: LinearAttentionArgs,
    /// `shared_expert_intermediate_size`: the sigmoid-gated shared expert's width; default 512.
    #[serde(default)]
    pub shared_expert_intermediate_size: Option<i32>,
}

/// The Qwen3-Next model: the shared decoder with per-layer gated DeltaNet or gated attention.
pub type Model = Transformer<Args>;

/// Whether `weights` are laid out as transformers saves them (zero-centred norms): a
/// convolution in PyTorch's `[channels, 1, kernel]` layout, or per-expert tensors, which mlx-lm's
/// conversion rewrites.
fn transformers_layout(weights: &WeightMap) -> bool {
    weights.names().any(|n| {
        (n.ends_with(".conv1d.weight")
            && weights
                .info(n)
                .is_some_and(|i| i.shape.len() == 3 && i.shape[1] == 1 && i.shape[2] > 1))
            || n.contains(".mlp.experts.0.")
            || n.ends_with(".mlp.experts.gate_up_proj")
    })
}

/// Adds the one to the zero-centred RMSNorm weights of a transformers checkpoint (`norms`: the
/// suffixes of the norms that scale by `1 + w`).
fn uncentre_norms(weights: &mut WeightMap, norms: &[&str]) -> Result<()> {
    let names: Vec<String> = weights
        .names()
        .filter(|n| norms.iter().any(|s| n.ends_with(s)))
        .map(str::to_string)
        .collect();
    for name in names {
        let w = weights.take(&name)?;
        weights.insert(name, w.add_scalar(1.0)?)?;
    }
    Ok(())
}

/// The decoder norms Qwen3-Next (and Qwen3.5) store zero-centred.
const CENTRED_NORMS: &[&str] = &[
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
];

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let experts = self.moe.num_experts.max(0) as usize;
        self.linear.sanitize(&self.common, weights, experts)
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let mut spec = self.linear.spec(&self.common, DeltaLayout::PerKeyHead)?;
        if self.moe.num_experts > 0 {
            let shared = self.shared_expert_intermediate_size.unwrap_or(512);
            check_positive(&[("shared_expert_intermediate_size", shared)])?;
            self.moe.apply(
                &mut spec,
                self.moe.expert_intermediate(&self.common)?,
                self.moe.norm_topk_prob,
                Some(shared),
            );
        }
        Ok(spec)
    }
}
