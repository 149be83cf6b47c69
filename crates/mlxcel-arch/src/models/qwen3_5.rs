//! Qwen3.5 and Qwen3.5-MoE (text): the gated-DeltaNet hybrid of [`super::qwen3_next`] with the
//! DeltaNet's input projections stored separately (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
//! `in_proj_a`), and either a dense MLP on every layer or (when `num_experts` > 0) a sparse MoE
//! block on every layer, whose top-k weights are always renormalised, with a sigmoid-gated
//! shared expert. Its rope is multimodal (`mrope_section`) but, for text, every section sees the
//! same position, which is plain rope.
//!
//! The published checkpoints are vision-language models (`model_type` `qwen3_5` /
//! `qwen3_5_moe`, the text config under `text_config`, the decoder under
//! `model.language_model.*` next to a vision tower); [`crate::nonstandard::load_qwen3_5`]
//! reads the text config, and the sanitiser takes the decoder and drops the vision tower.
//! transformers' fused expert stacks (`mlp.experts.gate_up_proj` `[E, 2I, H]`,
//! `mlp.experts.down_proj`) are split into `switch_mlp.*`; per-expert tensors are stacked.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::CommonArgs;
use super::mamba2::check_positive;
use super::qwen3_next::LinearAttentionArgs;
use super::transformer::{
    DecoderArgs, DecoderSpec, DeltaLayout, FfnSpec, MoeSpec, SharedExpertSpec, Transformer,
};
use crate::{ModelError, Result};

/// The `config.json` keys of Qwen3.5 text (transformers' `Qwen3_5TextConfig` and
/// `Qwen3_5MoeTextConfig`).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, heads, `head_dim`, rope, `layer_types`,
    /// ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// The linear-attention keys and the layer pattern.
    #[serde(flatten)]
    pub linear: LinearAttentionArgs,
    /// `num_experts`: routed experts of every layer; absent or 0 for the dense model.
    #[serde(default)]
    pub num_experts: i32,
    /// `num_experts_per_tok`: required with experts.
    #[serde(default)]
    pub num_experts_per_tok: Option<i32>,
    /// `moe_intermediate_size`: width of a routed expert; required with experts.
    #[serde(default)]
    pub moe_intermediate_size: Option<i32>,
    /// `shared_expert_intermediate_size`: the sigmoid-gated shared expert's width; required
    /// with experts.
    #[serde(default)]
    pub shared_expert_intermediate_size: Option<i32>,
}

/// The Qwen3.5 model: the shared decoder with per-layer gated DeltaNet or gated attention.
pub type Model = Transformer<Args>;

impl Args {
    /// A key the MoE model needs.
    fn moe_key(value: Option<i32>, key: &str) -> Result<i32> {
        let v = value.ok_or_else(|| {
            ModelError::Config(format!("`{key}` is required when num_experts > 0"))
        })?;
        check_positive(&[(key, v)])?;
        Ok(v)
    }
}

/// Takes the decoder out of a vision-language checkpoint: `model.language_model.*` (transformers)
/// or `language_model.model.*` (mlx-lm) become `model.*`, `language_model.lm_head.*` becomes
/// `lm_head.*`, and the vision tower is dropped.
fn take_language_model(weights: &mut WeightMap) -> Result<()> {
    let vision: Vec<String> = weights
        .names()
        .filter(|n| {
            n.starts_with("model.visual.")
                || n.starts_with("visual.")
                || n.starts_with("vision_tower.")
        })
        .map(str::to_string)
        .collect();
    for name in vision {
        weights.remove(&name);
    }
    weights.rename_prefix("model.language_model.", "model.")?;
    weights.rename_prefix("language_model.model.", "model.")?;
    weights.rename_prefix("language_model.lm_head.", "lm_head.")?;
    Ok(())
}

/// Splits transformers' fused expert stacks of layer `i` (`experts.gate_up_proj` `[E, 2I, H]`:
/// gate rows then up rows per expert; `experts.down_proj` `[E, H, I]`) into `switch_mlp.*`.
fn unfuse_experts(weights: &mut WeightMap, layer: usize, width: i32) -> Result<()> {
    let prefix = format!("model.layers.{layer}.mlp");
    let gate_up = format!("{prefix}.experts.gate_up_proj");
    if !weights.contains(&gate_up) {
        return Ok(());
    }
    let fused = weights.take(&gate_up)?;
    if fused.ndim() != 3 || fused.dim(1)? != 2 * width {
        return Err(ModelError::Shape {
            tensor: gate_up,
            found: fused.shape(),
            expected: vec![-1, 2 * width, -1],
        });
    }
    let parts = fused.split_at(&[width], 1)?;
    weights.insert(
        format!("{prefix}.switch_mlp.gate_proj.weight"),
        parts[0].clone(),
    )?;
    weights.insert(
        format!("{prefix}.switch_mlp.up_proj.weight"),
        parts[1].clone(),
    )?;
    Ok(weights.rename(
        &format!("{prefix}.experts.down_proj"),
        &format!("{prefix}.switch_mlp.down_proj.weight"),
    )?)
}

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        take_language_model(weights)?;
        let experts = self.num_experts.max(0) as usize;
        self.linear.sanitize(&self.common, weights, experts)?;
        if experts > 0 {
            let width = Self::moe_key(self.moe_intermediate_size, "moe_intermediate_size")?;
            for i in 0..self.common.num_hidden_layers {
                unfuse_experts(weights, i, width)?;
            }
        }
        Ok(())
    }

    fn spec(&self) -> Result<DecoderSpec> {
        if self.num_experts <= 0 {
            return self.linear.spec(&self.common, DeltaLayout::Separate);
        }
        let width = Self::moe_key(self.moe_intermediate_size, "moe_intermediate_size")?;
        let top_k = Self::moe_key(self.num_experts_per_tok, "num_experts_per_tok")?;
        let shared = Self::moe_key(
            self.shared_expert_intermediate_size,
            "shared_expert_intermediate_size",
        )?;
        // Every layer is sparse: `intermediate_size` (often absent) sizes no block.
        let mut common = self.common.clone();
        common.intermediate_size.get_or_insert(width);
        let mut spec = self.linear.spec(&common, DeltaLayout::Separate)?;
        let moe = MoeSpec {
            shared: Some(SharedExpertSpec {
                intermediate: shared,
                gated: true,
            }),
            ..MoeSpec::softmax(self.num_experts, top_k, width, true)
        };
        for ffn in spec.ffn.iter_mut() {
            *ffn = FfnSpec::Moe(moe.clone());
        }
        Ok(spec)
    }
}
