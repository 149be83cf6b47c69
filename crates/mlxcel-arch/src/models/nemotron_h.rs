//! Nemotron-H (NVIDIA): a stack of single-branch layers, each `h += mixer(norm(h))` where the
//! mixer is, per `layers_block_type` (or the older `hybrid_override_pattern` string), a
//! Mamba-2 layer (`M`, grouped gated RMSNorm), attention without positional encoding (`*`), a
//! plain relu² MLP (`-`) or a mixture of plain relu² experts with a sigmoid router, DeepSeek-V3
//! group limit and one shared expert (`E`). The MLP and MoE layers run as the decoder's
//! feed-forward-only layers ([`MixerSpec::None`]).
//!
//! Checkpoints store everything under `backbone.layers.{i}.{norm,mixer}` (per-expert
//! `mixer.experts.{e}.{up,down}_proj`; mlx-lm stacks them as `mixer.switch_mlp.{fc1,fc2}`); the
//! sanitiser brings each layer's mixer to its canonical scope (`mixer`, `self_attn` or `mlp`).

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::mamba::{mixer_only_spec, sanitize_backbone};
use super::mamba2::check_positive;
use super::transformer::{
    DecoderArgs, DecoderSpec, FfnSpec, Mamba2Spec, MixerSpec, MoeSpec, SharedExpertSpec,
    Transformer,
};
use crate::nn::ssm::{GatedNorm, Mamba2Dims};
use crate::nn::{Activation, GroupLimit, GroupScore, RouterScoring};
use crate::sanitize::stack_experts;
use crate::{ModelError, Result};

fn yes() -> bool {
    true
}
fn one() -> i32 {
    1
}
fn four() -> i32 {
    4
}
fn default_chunk() -> i32 {
    128
}
fn default_eps() -> f32 {
    1e-5
}
fn relu2() -> String {
    "relu2".into()
}
fn default_dt_min() -> f64 {
    0.001
}
fn unit() -> f64 {
    1.0
}

/// The `config.json` keys of Nemotron-H (transformers' `NemotronHConfig`, with the aliases
/// older hub configs spell).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// `vocab_size`.
    pub vocab_size: i32,
    /// `hidden_size`.
    pub hidden_size: i32,
    /// `layers_block_type` (alias `layer_types`): per layer `linear_attention` (Mamba-2),
    /// `full_attention`, `mlp` or `moe` (legacy `mamba`, `attention`).
    #[serde(default, alias = "layer_types")]
    pub layers_block_type: Option<Vec<String>>,
    /// `hybrid_override_pattern`: the same as one character per layer (`M`, `*`, `-`, `E`).
    #[serde(default)]
    pub hybrid_override_pattern: Option<String>,
    /// `num_attention_heads`.
    pub num_attention_heads: i32,
    /// `num_key_value_heads`; default `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<i32>,
    /// `head_dim`; default `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<i32>,
    /// `intermediate_size`: the MLP layers' width.
    #[serde(default)]
    pub intermediate_size: Option<i32>,
    /// `mlp_hidden_act`: default `relu2`.
    #[serde(default = "relu2")]
    pub mlp_hidden_act: String,
    /// `mlp_bias`: biases on the MLPs and experts' projections.
    #[serde(default)]
    pub mlp_bias: bool,
    /// `ssm_state_size`.
    pub ssm_state_size: i32,
    /// `mamba_num_heads`.
    pub mamba_num_heads: i32,
    /// `mamba_head_dim`.
    pub mamba_head_dim: i32,
    /// `n_groups` (alias `mamba_n_groups`): groups of `B`/`C` and of the gated norm.
    #[serde(default = "one", alias = "mamba_n_groups")]
    pub n_groups: i32,
    /// `conv_kernel` (alias `mamba_d_conv`).
    #[serde(default = "four", alias = "mamba_d_conv")]
    pub conv_kernel: i32,
    /// `chunk_size` (alias `mamba_chunk_size`).
    #[serde(default = "default_chunk", alias = "mamba_chunk_size")]
    pub chunk_size: i32,
    /// `use_conv_bias` (alias `mamba_conv_bias`).
    #[serde(default = "yes", alias = "mamba_conv_bias")]
    pub use_conv_bias: bool,
    /// `use_bias`: biases on the Mamba layers' `in_proj`/`out_proj`.
    #[serde(default)]
    pub use_bias: bool,
    /// `time_step_min` (alias `mamba_dt_min`): transformers clamps the time step to
    /// `[time_step_min, inf)` (not to `time_step_limit`).
    #[serde(default = "default_dt_min", alias = "mamba_dt_min")]
    pub time_step_min: f64,
    /// `layer_norm_epsilon`.
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f32,
    /// `tie_word_embeddings`.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// `n_routed_experts`.
    #[serde(default)]
    pub n_routed_experts: Option<i32>,
    /// `num_experts_per_tok`.
    #[serde(default)]
    pub num_experts_per_tok: Option<i32>,
    /// `moe_intermediate_size`: one routed expert's width.
    #[serde(default)]
    pub moe_intermediate_size: Option<i32>,
    /// `moe_shared_expert_intermediate_size`: the shared expert's width.
    #[serde(default)]
    pub moe_shared_expert_intermediate_size: Option<i32>,
    /// `moe_latent_size`: experts on a projected latent (not supported yet).
    #[serde(default)]
    pub moe_latent_size: Option<i32>,
    /// `n_group`: expert groups of the router.
    #[serde(default = "one")]
    pub n_group: i32,
    /// `topk_group`: groups a token may route to.
    #[serde(default = "one")]
    pub topk_group: i32,
    /// `norm_topk_prob`: renormalise the kept weights.
    #[serde(default = "yes")]
    pub norm_topk_prob: bool,
    /// `routed_scaling_factor`.
    #[serde(default = "unit")]
    pub routed_scaling_factor: f64,
}

/// The Nemotron-H model: the shared decoder, one branch per layer.
pub type Model = Transformer<Args>;

/// What one layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Mamba,
    Attention,
    Mlp,
    Moe,
}

impl Args {
    fn blocks(&self) -> Result<Vec<Block>> {
        if let Some(types) = &self.layers_block_type {
            return types
                .iter()
                .map(|t| match t.as_str() {
                    "linear_attention" | "mamba" => Ok(Block::Mamba),
                    "full_attention" | "attention" => Ok(Block::Attention),
                    "mlp" => Ok(Block::Mlp),
                    "moe" => Ok(Block::Moe),
                    other => Err(ModelError::Config(format!(
                        "layers_block_type: unknown layer type {other:?} (expected linear_attention, full_attention, mlp or moe)"
                    ))),
                })
                .collect();
        }
        let Some(pattern) = &self.hybrid_override_pattern else {
            return Err(ModelError::Config(
                "neither layers_block_type nor hybrid_override_pattern says what the layers are"
                    .into(),
            ));
        };
        pattern
            .chars()
            .map(|c| match c {
                'M' => Ok(Block::Mamba),
                '*' => Ok(Block::Attention),
                '-' => Ok(Block::Mlp),
                'E' => Ok(Block::Moe),
                other => Err(ModelError::Config(format!(
                    "hybrid_override_pattern: unknown layer {other:?} (expected M, *, - or E)"
                ))),
            })
            .collect()
    }

    fn required(&self, key: &str, v: Option<i32>) -> Result<i32> {
        match v {
            Some(v) if v > 0 => Ok(v),
            Some(v) => Err(ModelError::Config(format!("{key} = {v}: must be positive"))),
            None => Err(ModelError::Config(format!(
                "{key} is required by the config's layer types"
            ))),
        }
    }

    fn moe(&self) -> Result<MoeSpec> {
        if self.moe_latent_size.is_some() {
            return Err(ModelError::Unsupported(
                "Nemotron-H experts on a latent projection (moe_latent_size)".into(),
            ));
        }
        let experts = self.required("n_routed_experts", self.n_routed_experts)?;
        check_positive(&[("n_group", self.n_group), ("topk_group", self.topk_group)])?;
        if experts % self.n_group != 0 {
            return Err(ModelError::Config(format!(
                "n_routed_experts {experts} is not a multiple of n_group {}",
                self.n_group
            )));
        }
        Ok(MoeSpec {
            scoring: RouterScoring::Sigmoid,
            shared: Some(SharedExpertSpec {
                intermediate: self.required(
                    "moe_shared_expert_intermediate_size",
                    self.moe_shared_expert_intermediate_size,
                )?,
                gated: false,
            }),
            group_limit: Some(GroupLimit {
                groups: self.n_group,
                keep: self.topk_group,
                score: GroupScore::TopTwoSum,
            }),
            correction_bias: true,
            weight_scale: self.routed_scaling_factor as f32,
            ..MoeSpec::softmax(
                experts,
                self.required("num_experts_per_tok", self.num_experts_per_tok)?,
                self.required("moe_intermediate_size", self.moe_intermediate_size)?,
                self.norm_topk_prob,
            )
        })
    }
}

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let blocks = self.blocks()?;
        let mtp: Vec<String> = weights
            .names()
            .filter(|n| n.starts_with("mtp."))
            .map(str::to_string)
            .collect();
        for name in mtp {
            weights.remove(&name);
        }
        sanitize_backbone(weights, blocks.len())?;
        for (i, block) in blocks.iter().enumerate() {
            let layer = format!("model.layers.{i}");
            let scope = match block {
                Block::Mamba => continue,
                Block::Attention => "self_attn",
                Block::Mlp | Block::Moe => "mlp",
            };
            weights.rename_prefix(&format!("{layer}.mixer."), &format!("{layer}.{scope}."))?;
            if *block == Block::Moe {
                let mlp = format!("{layer}.mlp");
                weights.rename_prefix(
                    &format!("{mlp}.shared_experts."),
                    &format!("{mlp}.shared_expert."),
                )?;
                // mlx-lm's stacked names.
                weights.rename_prefix(
                    &format!("{mlp}.switch_mlp.fc1."),
                    &format!("{mlp}.switch_mlp.up_proj."),
                )?;
                weights.rename_prefix(
                    &format!("{mlp}.switch_mlp.fc2."),
                    &format!("{mlp}.switch_mlp.down_proj."),
                )?;
                let experts = self.required("n_routed_experts", self.n_routed_experts)?;
                stack_experts(
                    weights,
                    &mlp,
                    "experts",
                    experts as usize,
                    &[("up_proj", "up_proj"), ("down_proj", "down_proj")],
                )?;
            }
        }
        Ok(())
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let blocks = self.blocks()?;
        check_positive(&[
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("ssm_state_size", self.ssm_state_size),
            ("mamba_num_heads", self.mamba_num_heads),
            ("mamba_head_dim", self.mamba_head_dim),
            ("n_groups", self.n_groups),
            ("conv_kernel", self.conv_kernel),
            ("chunk_size", self.chunk_size),
        ])?;
        let inner = self.mamba_num_heads * self.mamba_head_dim;
        let mamba = MixerSpec::Mamba2(Mamba2Spec {
            dims: Mamba2Dims {
                inner,
                heads: self.mamba_num_heads,
                head_dim: self.mamba_head_dim,
                groups: self.n_groups,
                state: self.ssm_state_size,
                chunk: self.chunk_size,
            },
            conv_kernel: self.conv_kernel,
            conv_bias: self.use_conv_bias,
            proj_bias: self.use_bias,
            norm_eps: self.layer_norm_epsilon,
            gated_norm: GatedNorm::GateThenNorm,
            dt_limit: (self.time_step_min, f64::INFINITY),
        });
        let mut mixers = Vec::with_capacity(blocks.len());
        let mut ffn = Vec::with_capacity(blocks.len());
        for block in &blocks {
            let (m, f) = match block {
                Block::Mamba => (mamba.clone(), FfnSpec::None),
                Block::Attention => (MixerSpec::Attention, FfnSpec::None),
                Block::Mlp => (
                    MixerSpec::None,
                    FfnSpec::Plain {
                        intermediate: self.required("intermediate_size", self.intermediate_size)?,
                    },
                ),
                Block::Moe => (MixerSpec::None, FfnSpec::PlainMoe(self.moe()?)),
            };
            mixers.push(m);
            ffn.push(f);
        }
        let mut spec = mixer_only_spec(
            self.vocab_size,
            self.hidden_size,
            self.layer_norm_epsilon,
            self.tie_word_embeddings,
            mixers,
        );
        let head_dim = self
            .head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads);
        spec.heads = self.num_attention_heads;
        spec.kv_heads = self.num_key_value_heads.unwrap_or(self.num_attention_heads);
        spec.head_dim = head_dim;
        spec.attn_scale = 1.0 / (head_dim as f32).sqrt();
        spec.mlp_bias = self.mlp_bias;
        spec.act = Activation::from_name(&self.mlp_hidden_act).ok_or_else(|| {
            ModelError::Unsupported(format!("mlp_hidden_act {:?}", self.mlp_hidden_act))
        })?;
        spec.ffn = ffn;
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: serde_json::Value) -> Args {
        let mut cfg = serde_json::json!({
            "vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
            "ssm_state_size": 16, "mamba_num_heads": 8, "mamba_head_dim": 16,
        });
        cfg.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        serde_json::from_value(cfg).unwrap()
    }

    #[test]
    fn the_pattern_string_and_the_list_name_the_same_layers() {
        let a = args(serde_json::json!({"hybrid_override_pattern": "M*-"}));
        let b = args(serde_json::json!({
            "layers_block_type": ["linear_attention", "full_attention", "mlp"]
        }));
        assert_eq!(a.blocks().unwrap(), b.blocks().unwrap());
        let s = a.spec().unwrap();
        assert!(matches!(s.mixers[0], MixerSpec::Mamba2(_)));
        assert!(matches!(s.mixers[1], MixerSpec::Attention));
        assert!(matches!(s.mixers[2], MixerSpec::None));
        assert!(matches!(s.ffn[2], FfnSpec::Plain { intermediate: 128 }));
        assert_eq!(s.act, Activation::Relu2);
    }

    #[test]
    fn unknown_layers_and_missing_moe_keys_are_named() {
        let e = args(serde_json::json!({"hybrid_override_pattern": "M?"}))
            .spec()
            .unwrap_err();
        assert!(e.to_string().contains("hybrid_override_pattern"), "{e}");
        let e = args(serde_json::json!({"hybrid_override_pattern": "ME"}))
            .spec()
            .unwrap_err();
        assert!(e.to_string().contains("n_routed_experts"), "{e}");
    }
}
