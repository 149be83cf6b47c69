//! DeepSeek V2 and V3: multi-head latent attention (a compressed `(latent, k_pe)` cache; the
//! per-head key/value up-projection `kv_b_proj` is split at load into `embed_q`/`unembed_out`,
//! the layout mlx-lm conversions already store), yarn rope with its `mscale` softmax correction,
//! dense MLPs on the first `first_k_dense_replace` layers and routed experts with ungated shared
//! experts after. V2 routes by softmax (greedy, or limited to the best groups by their best
//! expert); V3 by sigmoid with an `e_score_correction_bias` for the choice and groups scored by
//! their two best experts. Both scale the routing weights by `routed_scaling_factor`. The
//! multi-token-prediction layers V3 checkpoints carry (`num_nextn_predict_layers`) are built
//! only for self-speculative decoding (see [`super::transformer::MtpSpec`]).

use mlxcel_core::{Dtype, WeightMap};
use mlxcel_quant::{QuantConfig, QuantizedWeight, TensorQuant};
use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{
    DecoderArgs, DecoderSpec, FfnSpec, LatentSpec, MixerSpec, MoeSpec, MtpSpec, SharedExpertSpec,
    Transformer,
};
use crate::nn::{GroupLimit, GroupScore, LatentDims, RopeConfig, RouterScoring};
use crate::sanitize::{layers_after, rename_in_layers, stack_mlp_experts};
use crate::{ModelError, Result};

fn one_i32() -> i32 {
    1
}

fn one_usize() -> usize {
    1
}

fn one_f64() -> f64 {
    1.0
}

fn yes() -> bool {
    true
}

/// The config fields of both versions.
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `kv_lora_rank`: width of the compressed key/value latent that is cached (required).
    pub kv_lora_rank: i32,
    /// `q_lora_rank`: width of the query bottleneck; absent/null: queries are projected
    /// directly.
    #[serde(default)]
    pub q_lora_rank: Option<i32>,
    /// `qk_nope_head_dim`: per-head query/key features without rope (required).
    pub qk_nope_head_dim: i32,
    /// `qk_rope_head_dim`: per-head query/key features with rope (required).
    pub qk_rope_head_dim: i32,
    /// `v_head_dim`: per-head value width (required).
    pub v_head_dim: i32,
    /// `n_routed_experts`: routed experts per MoE layer; absent: every layer is dense.
    #[serde(default)]
    pub n_routed_experts: Option<i32>,
    /// `n_shared_experts`: shared (ungated) experts per MoE layer, run as one MLP of
    /// `n_shared_experts * moe_intermediate_size`; absent: none.
    #[serde(default)]
    pub n_shared_experts: Option<i32>,
    /// `num_experts_per_tok`: experts per token (required with `n_routed_experts`).
    #[serde(default)]
    pub num_experts_per_tok: Option<i32>,
    /// `moe_intermediate_size`: width of one expert (required with `n_routed_experts`).
    #[serde(default)]
    pub moe_intermediate_size: Option<i32>,
    /// `first_k_dense_replace`: the first this-many layers keep a dense MLP; default 0.
    #[serde(default)]
    pub first_k_dense_replace: usize,
    /// `moe_layer_freq`: after those, every this-many-th layer is MoE; default 1.
    #[serde(default = "one_usize")]
    pub moe_layer_freq: usize,
    /// `routed_scaling_factor`: multiplies the routing weights; default 1.
    #[serde(default = "one_f64")]
    pub routed_scaling_factor: f64,
    /// `n_group`: expert groups for group-limited routing (divides `n_routed_experts`);
    /// default 1.
    #[serde(default = "one_i32")]
    pub n_group: i32,
    /// `topk_group`: groups a token may route to; default 1.
    #[serde(default = "one_i32")]
    pub topk_group: i32,
    /// `topk_method`: V2's `"group_limited_greedy"` turns on group-limited routing (else
    /// greedy); V3 always limits by group.
    #[serde(default)]
    pub topk_method: Option<String>,
    /// `norm_topk_prob`: V3 renormalises the kept weights to sum to one (V2 never does);
    /// default false.
    #[serde(default)]
    pub norm_topk_prob: bool,
    /// `attention_bias`: biases on the attention projections; default false.
    #[serde(default)]
    pub attention_bias: bool,
    /// `rope_interleave` (V3): rope over interleaved pairs (V2 always interleaves).
    #[serde(default = "yes")]
    pub rope_interleave: bool,
    /// `num_nextn_predict_layers` (V3): multi-token-prediction layers after the decoder
    /// layers; default 0.
    #[serde(default)]
    pub num_nextn_predict_layers: usize,
}

/// DeepSeek V2's args.
#[derive(Debug, Clone, Deserialize)]
#[serde(transparent)]
pub struct V2Args(pub Args);

/// DeepSeek V3's args.
#[derive(Debug, Clone, Deserialize)]
#[serde(transparent)]
pub struct V3Args(pub Args);

/// The DeepSeek V2 decoder.
pub type V2Model = Transformer<V2Args>;
/// The DeepSeek V3 decoder.
pub type V3Model = Transformer<V3Args>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Version {
    V2,
    V3,
}

impl Args {
    /// The softmax scale: `qk_head_dim^-1/2`, times yarn's `mscale(factor, mscale_all_dim)²`.
    fn attention_scale(&self) -> f32 {
        let mut scale = ((self.qk_nope_head_dim + self.qk_rope_head_dim) as f64).powf(-0.5);
        if let Some(s) = &self.common.rope_scaling {
            let kind = s
                .get("rope_type")
                .or_else(|| s.get("type"))
                .and_then(|v| v.as_str())
                .unwrap_or("default");
            let all_dim = s
                .get("mscale_all_dim")
                .and_then(|v| v.as_f64())
                .unwrap_or(0.0);
            let factor = s.get("factor").and_then(|v| v.as_f64()).unwrap_or(1.0);
            if kind != "default" && all_dim != 0.0 && factor > 1.0 {
                let m = 0.1 * all_dim * factor.ln() + 1.0;
                scale *= m * m;
            }
        }
        scale as f32
    }

    fn spec(&self, version: Version) -> Result<DecoderSpec> {
        let c = &self.common;
        let n = c.num_hidden_layers;
        let mut spec = base_spec(c, false, "silu")?;
        let latent = LatentSpec {
            dims: LatentDims {
                heads: c.num_attention_heads,
                kv_lora_rank: self.kv_lora_rank,
                qk_nope: self.qk_nope_head_dim,
                qk_rope: self.qk_rope_head_dim,
                v_head: self.v_head_dim,
            },
            q_lora_rank: self.q_lora_rank,
            bias: self.attention_bias,
            scale: self.attention_scale(),
            rope: RopeConfig {
                base: c.rope_theta,
                head_dim: self.qk_rope_head_dim,
                dims: self.qk_rope_head_dim,
                traditional: version == Version::V2 || self.rope_interleave,
                scaling: c.rope_scaling.clone(),
                max_position_embeddings: c.max_position_embeddings,
            },
        };
        spec.mixers = vec![MixerSpec::Latent(latent); n];
        spec.rope = vec![None; n];
        if let Some(experts) = self.n_routed_experts {
            let field = |v: Option<i32>, name: &str| {
                v.ok_or_else(|| ModelError::Config(format!("missing field `{name}`")))
            };
            let intermediate = field(self.moe_intermediate_size, "moe_intermediate_size")?;
            let top_k = field(self.num_experts_per_tok, "num_experts_per_tok")?;
            if self.n_group <= 0 || experts % self.n_group != 0 || self.topk_group <= 0 {
                return Err(ModelError::Config(format!(
                    "n_routed_experts {experts} must split into n_group {} groups (topk_group {})",
                    self.n_group, self.topk_group
                )));
            }
            let (scoring, normalize, group_limit) = match version {
                // transformers' V2 router never renormalises.
                Version::V2 => (
                    RouterScoring::Softmax,
                    false,
                    (self.topk_method.as_deref() == Some("group_limited_greedy")).then_some(
                        GroupLimit {
                            groups: self.n_group,
                            keep: self.topk_group,
                            score: GroupScore::Max,
                        },
                    ),
                ),
                Version::V3 => (
                    RouterScoring::Sigmoid,
                    self.norm_topk_prob,
                    Some(GroupLimit {
                        groups: self.n_group,
                        keep: self.topk_group,
                        score: GroupScore::TopTwoSum,
                    }),
                ),
            };
            let moe = MoeSpec {
                scoring,
                group_limit,
                correction_bias: version == Version::V3,
                weight_scale: self.routed_scaling_factor as f32,
                shared: self.n_shared_experts.map(|s| SharedExpertSpec {
                    intermediate: intermediate * s,
                    gated: false,
                }),
                ..MoeSpec::softmax(experts, top_k, intermediate, normalize)
            };
            let freq = self.moe_layer_freq.max(1);
            for (i, ffn) in spec.ffn.iter_mut().enumerate() {
                if i >= self.first_k_dense_replace && i % freq == 0 {
                    *ffn = FfnSpec::Moe(moe.clone());
                }
            }
        }
        if version == Version::V3 && self.num_nextn_predict_layers > 0 {
            spec.mtp = Some(MtpSpec {
                layers: self.num_nextn_predict_layers,
            });
        }
        Ok(spec)
    }

    fn sanitize(&self, weights: &mut WeightMap, quant: Option<&QuantConfig>) -> Result<()> {
        // The multi-token-prediction layers after the decoder layers are rewritten alike.
        let n = self.common.num_hidden_layers;
        let n = n + layers_after(weights, n);
        if let Some(experts) = self.n_routed_experts {
            stack_mlp_experts(weights, n, experts as usize)?;
        }
        rename_in_layers(weights, n, &[("mlp.shared_experts", "mlp.shared_expert")])?;
        for i in 0..n {
            self.split_kv_b_proj(weights, &format!("model.layers.{i}.self_attn"), quant)?;
        }
        Ok(())
    }

    /// `kv_b_proj` `[heads · (nope + v), rank]` → `embed_q` `[heads, rank, nope]` (applied to
    /// queries) and `unembed_out` `[heads, v, rank]` (applied to attended latents). A quantized
    /// `kv_b_proj` is dequantized first; the halves stay dense (they are small).
    fn split_kv_b_proj(
        &self,
        weights: &mut WeightMap,
        prefix: &str,
        quant: Option<&QuantConfig>,
    ) -> Result<()> {
        let name = format!("{prefix}.kv_b_proj.weight");
        if !weights.contains(&name) {
            return Ok(());
        }
        let (nope, v, rank) = (self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank);
        let heads = self.common.num_attention_heads;
        let stored = weights.take(&name)?;
        let scales_name = format!("{prefix}.kv_b_proj.scales");
        let dense = if weights.contains(&scales_name) {
            let module = format!("{prefix}.kv_b_proj");
            let Some(TensorQuant::Quantized {
                mode,
                group_size,
                bits,
            }) = quant.map(|q| q.for_module(&module))
            else {
                return Err(ModelError::Config(format!(
                    "`{scales_name}` is quantized but config.json has no quantization for it"
                )));
            };
            let scales = weights.take(&scales_name)?;
            let biases_name = format!("{prefix}.kv_b_proj.biases");
            let biases = if weights.contains(&biases_name) {
                Some(weights.take(&biases_name)?)
            } else {
                None
            };
            let dtype = match scales.dtype()? {
                Dtype::Uint8 => Dtype::Float32,
                d => d,
            };
            QuantizedWeight::new(&name, stored, scales, biases, mode, group_size, bits)?
                .dequantize(dtype)?
        } else {
            stored
        };
        if dense.shape() != [heads * (nope + v), rank] {
            return Err(ModelError::Shape {
                tensor: name,
                found: dense.shape(),
                expected: vec![heads * (nope + v), rank],
            });
        }
        let per_head = dense.reshape(&[heads, nope + v, rank])?;
        let parts = per_head.split_at(&[nope], 1)?;
        weights.insert(
            format!("{prefix}.embed_q.weight"),
            parts[0].transpose(&[0, 2, 1])?.contiguous()?,
        )?;
        weights.insert(
            format!("{prefix}.unembed_out.weight"),
            parts[1].contiguous()?,
        )?;
        Ok(())
    }
}

impl DecoderArgs for V2Args {
    fn spec(&self) -> Result<DecoderSpec> {
        self.0.spec(Version::V2)
    }

    fn sanitize(&self, weights: &mut WeightMap, quant: Option<&QuantConfig>) -> Result<()> {
        self.0.sanitize(weights, quant)
    }
}

impl DecoderArgs for V3Args {
    fn spec(&self) -> Result<DecoderSpec> {
        self.0.spec(Version::V3)
    }

    fn sanitize(&self, weights: &mut WeightMap, quant: Option<&QuantConfig>) -> Result<()> {
        self.0.sanitize(weights, quant)
    }
}
