//! Llama 4 text (`llama4_text`, and the text tower of `llama4` checkpoints): layers with
//! interleaved rope use chunked local attention (`attention_chunk_size`) and a weightless q/k L2
//! norm (`use_qk_norm`); every `no_rope_layer_interval`-th layer (`no_rope_layers[i] == 0`) is
//! global attention without positions whose queries are temperature-tuned on long positions
//! (`1 + attn_scale · ln(1 + ⌊(p + 1) / floor_scale⌋)`, `attn_temperature_tuning`). Dense MLPs
//! (`intermediate_size_mlp`) interleave with mixture-of-experts layers (`moe_layers`, else every
//! `interleave_moe_layer_step`-th): the sigmoid of each chosen expert's router logit scales that
//! expert's *input*, and a shared expert runs for every token.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, no_rope_flags, CommonArgs};
use super::transformer::{
    DecoderArgs, DecoderSpec, FfnSpec, MoeSpec, QkNormSpec, SharedExpertSpec, Transformer,
};
use crate::nn::{PositionScale, RouterScoring};
use crate::sanitize::rename_in_layers;
use crate::{ModelError, Result};

fn one() -> i32 {
    1
}

fn one_usize() -> usize {
    1
}

fn four() -> usize {
    4
}

fn yes() -> bool {
    true
}

fn default_floor_scale() -> f64 {
    8192.0
}

fn default_attn_scale() -> f64 {
    0.1
}

fn default_chunk() -> usize {
    8192
}

/// The `config.json` keys of Llama 4's text model (read after
/// [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares; `intermediate_size` is the routed and shared experts'
    /// width.
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `intermediate_size_mlp`: the dense layers' MLP width (required when a layer is dense).
    #[serde(default)]
    pub intermediate_size_mlp: Option<i32>,
    /// `num_local_experts`: routed experts per MoE layer (required).
    pub num_local_experts: i32,
    /// `num_experts_per_tok`: experts per token; default 1.
    #[serde(default = "one")]
    pub num_experts_per_tok: i32,
    /// `moe_layers`: the MoE layers' indices; default every `interleave_moe_layer_step`-th.
    #[serde(default)]
    pub moe_layers: Option<Vec<usize>>,
    /// `interleave_moe_layer_step`; default 1 (every layer MoE).
    #[serde(default = "one_usize")]
    pub interleave_moe_layer_step: usize,
    /// `no_rope_layers`: per layer 1 (rope) or 0 (no positions); default 0 on every
    /// `no_rope_layer_interval`-th layer.
    #[serde(default)]
    pub no_rope_layers: Option<Vec<u8>>,
    /// `no_rope_layer_interval`; default 4.
    #[serde(default = "four")]
    pub no_rope_layer_interval: usize,
    /// `attention_chunk_size`: the block of chunked local attention; default 8192.
    #[serde(default = "default_chunk")]
    pub attention_chunk_size: usize,
    /// `use_qk_norm`: weightless L2 norm of queries and keys on the rope layers; default true.
    #[serde(default = "yes")]
    pub use_qk_norm: bool,
    /// `attn_temperature_tuning`: scale the queries of the no-rope layers; default true.
    #[serde(default = "yes")]
    pub attn_temperature_tuning: bool,
    /// `floor_scale`: positions per step of the temperature tuning; default 8192.
    #[serde(default = "default_floor_scale")]
    pub floor_scale: f64,
    /// `attn_scale`: the temperature tuning's weight; default 0.1.
    #[serde(default = "default_attn_scale")]
    pub attn_scale: f64,
    /// `attention_bias`: biases on the attention projections; default false.
    #[serde(default)]
    pub attention_bias: bool,
}

/// The Llama 4 text decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl Args {
    /// Per layer: whether it applies rope (any non-zero entry does, as in transformers).
    fn rope_layers(&self) -> Result<Vec<bool>> {
        let flags = no_rope_flags(
            &self.common,
            self.no_rope_layers.as_deref(),
            self.no_rope_layer_interval,
        )?;
        Ok(flags.iter().map(|f| *f != 0).collect())
    }

    /// Per layer: the chunk of its local attention, from `layer_types` (else every rope layer).
    fn chunks(&self, rope: &[bool]) -> Result<Vec<Option<usize>>> {
        if self.attention_chunk_size == 0 {
            return Err(ModelError::Config(
                "attention_chunk_size = 0: must be positive".into(),
            ));
        }
        let chunk = Some(self.attention_chunk_size);
        let chunked = match self
            .common
            .layer_type_flags("chunked_attention", "full_attention")?
        {
            Some(chunked) => chunked,
            None => rope.to_vec(),
        };
        Ok(chunked
            .iter()
            .map(|c| if *c { chunk } else { None })
            .collect())
    }

    /// Per layer: whether it is a mixture of experts.
    fn moe_layers(&self) -> Vec<bool> {
        let n = self.common.num_hidden_layers;
        match &self.moe_layers {
            Some(list) => (0..n).map(|i| list.contains(&i)).collect(),
            None => {
                let step = self.interleave_moe_layer_step.max(1);
                (0..n).map(|i| (i + 1) % step == 0).collect()
            }
        }
    }
}

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let n = self.common.num_hidden_layers;
        rename_in_layers(
            weights,
            n,
            &[("feed_forward", "mlp"), ("mlp.router", "mlp.gate")],
        )?;
        for i in 0..n {
            let experts = format!("model.layers.{i}.mlp.experts");
            // transformers' fused experts: gate_up_proj `[E, hidden, 2·I]`, down_proj
            // `[E, I, hidden]`, both input-major.
            let gate_up = format!("{experts}.gate_up_proj");
            if weights.contains(&gate_up) {
                let fused = weights.take(&gate_up)?;
                let halves = fused.split_equal(2, -1)?;
                for (half, name) in halves.iter().zip(["gate_proj", "up_proj"]) {
                    weights.insert(
                        format!("{experts}.{name}.weight"),
                        half.transpose(&[0, 2, 1])?.contiguous()?,
                    )?;
                }
            }
            let down = format!("{experts}.down_proj");
            if weights.contains(&down) {
                let stored = weights.take(&down)?;
                weights.insert(
                    format!("{down}.weight"),
                    stored.transpose(&[0, 2, 1])?.contiguous()?,
                )?;
            }
        }
        // mlx-lm conversions keep the experts' names (`experts.{gate,up,down}_proj.*`).
        rename_in_layers(weights, n, &[("mlp.experts", "mlp.switch_mlp")])
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let c = &self.common;
        let mut spec = base_spec(c, false, "silu")?;
        spec.qkv_bias = self.attention_bias;
        spec.o_bias = self.attention_bias;
        let rope = self.rope_layers()?;
        let mut rope_config = c.rope();
        // Llama 4 rotates interleaved pairs (transformers' complex view).
        rope_config.traditional = true;
        spec.rope = rope
            .iter()
            .map(|r| r.then(|| rope_config.clone()))
            .collect();
        spec.chunks = self.chunks(&rope)?;
        if self.use_qk_norm {
            spec.qk_norm = QkNormSpec::WeightlessOnRopeLayers;
        }
        if self.attn_temperature_tuning {
            if self.floor_scale < 1.0 {
                return Err(ModelError::Config(format!(
                    "floor_scale = {}: must be at least 1",
                    self.floor_scale
                )));
            }
            let scale = PositionScale {
                weight: self.attn_scale,
                shift: 1.0,
                period: self.floor_scale,
            };
            spec.query_scales = rope.iter().map(|r| (!r).then_some(scale)).collect();
        }
        let expert = c.intermediate()?;
        let moe = MoeSpec {
            scoring: RouterScoring::Sigmoid,
            shared: Some(SharedExpertSpec {
                intermediate: expert,
                gated: false,
            }),
            scale_inputs: true,
            ..MoeSpec::softmax(
                self.num_local_experts,
                self.num_experts_per_tok,
                expert,
                false,
            )
        };
        for (ffn, is_moe) in spec.ffn.iter_mut().zip(self.moe_layers()) {
            *ffn = if is_moe {
                FfnSpec::Moe(moe.clone())
            } else {
                let intermediate = self.intermediate_size_mlp.ok_or_else(|| {
                    ModelError::Config(
                        "missing field `intermediate_size_mlp` (the dense layers' width)".into(),
                    )
                })?;
                FfnSpec::Dense { intermediate }
            };
        }
        Ok(spec)
    }
}

/// A `llama4` checkpoint (`Llama4ForConditionalGeneration`) loaded as text only: the text
/// model's keys in `text_config`, its weights under `language_model.*`; the vision model and
/// projector (`vision_model.*`, `multi_modal_projector.*`) are left out.
#[derive(Debug, Clone, Deserialize)]
pub struct NestedArgs {
    /// `text_config`: the text model's keys (required).
    pub text_config: Args,
}

/// The text model of a `llama4` checkpoint.
pub type NestedModel = Transformer<NestedArgs>;

impl DecoderArgs for NestedArgs {
    fn sanitize(&self, weights: &mut WeightMap, quant: Option<&QuantConfig>) -> Result<()> {
        let vision: Vec<String> = weights
            .names()
            .filter(|n| n.starts_with("vision_model.") || n.starts_with("multi_modal_projector."))
            .map(str::to_string)
            .collect();
        for name in vision {
            weights.remove(&name);
        }
        weights.rename_prefix("language_model.", "")?;
        self.text_config.sanitize(weights, quant)
    }

    fn spec(&self) -> Result<DecoderSpec> {
        self.text_config.spec()
    }
}
