//! Config fields most decoder architectures share, with the defaults transformers uses, and the
//! derived quantities (kv heads, head dim, rope, per-layer windows) every spec needs.

use serde::Deserialize;
use serde_json::Value;

use crate::nn::{Activation, RopeConfig};
use crate::{ModelError, Result};

fn default_rope_theta() -> f64 {
    10000.0
}

fn default_eps() -> f32 {
    1e-6
}

/// Fields read by `#[serde(flatten)]` into each architecture's `ModelArgs`.
#[derive(Debug, Clone, Deserialize)]
pub struct CommonArgs {
    /// `hidden_size`: the model width (required).
    pub hidden_size: i32,
    /// `num_hidden_layers`: decoder layers (required).
    pub num_hidden_layers: usize,
    /// `num_attention_heads`: query heads per layer (required).
    pub num_attention_heads: i32,
    /// `vocab_size`: rows of the embedding table and the output head (required).
    pub vocab_size: i32,
    /// `intermediate_size`: the dense MLP width; required by architectures with dense MLPs
    /// (see [`CommonArgs::intermediate`]).
    #[serde(default)]
    pub intermediate_size: Option<i32>,
    /// `num_key_value_heads`: key/value heads (grouped-query attention); default
    /// `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<i32>,
    /// `head_dim`: width of one head; default `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<i32>,
    /// `rms_norm_eps`: the norms' epsilon; default `1e-6`.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    /// `rope_theta` (or `rope_parameters.rope_theta`, after sanitising): the rotary base;
    /// default `10000`.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// `rope_scaling`: the rotary scaling object (`rope_type` `linear`, `dynamic`, `llama3`,
    /// `yarn`, `longrope`, ...); absent for plain rope.
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    /// `partial_rotary_factor`: the share of each head's features that is rotated; default 1.
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// `max_position_embeddings`: the trained context length (read by dynamic and longrope
    /// scaling).
    #[serde(default)]
    pub max_position_embeddings: Option<i64>,
    /// `tie_word_embeddings`: reuse the embedding table as the output head; the default is the
    /// architecture's (see [`base_spec`]).
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    /// `hidden_act`: the MLP activation (`silu`, `gelu_pytorch_tanh`, ...); the default is the
    /// architecture's.
    #[serde(default)]
    pub hidden_act: Option<String>,
    /// `sliding_window`: keys per query on sliding-window layers; absent means none slide.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// `layer_types`: per layer `"full_attention"` or `"sliding_attention"`; overrides the
    /// architecture's own sliding pattern when present.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
}

impl CommonArgs {
    /// `num_key_value_heads`, else `num_attention_heads`.
    pub fn kv_heads(&self) -> i32 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// `head_dim`, else `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> i32 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// `intermediate_size`, or a [`ModelError::Config`] naming it when absent.
    pub fn intermediate(&self) -> Result<i32> {
        self.intermediate_size
            .ok_or_else(|| ModelError::Config("missing field `intermediate_size`".into()))
    }

    /// The activation named by `hidden_act` (or `default` when absent).
    pub fn activation(&self, default: &str) -> Result<Activation> {
        let name = self.hidden_act.as_deref().unwrap_or(default);
        Activation::from_name(name)
            .ok_or_else(|| ModelError::Unsupported(format!("hidden_act `{name}`")))
    }

    /// Rope of the global layers.
    pub fn rope(&self) -> RopeConfig {
        let head_dim = self.head_dim();
        let dims = match self.partial_rotary_factor {
            Some(f) => (head_dim as f64 * f) as i32,
            None => head_dim,
        };
        RopeConfig {
            base: self.rope_theta,
            head_dim,
            dims,
            traditional: false,
            scaling: self.rope_scaling.clone(),
            max_position_embeddings: self.max_position_embeddings,
        }
    }

    /// `layer_types` as one flag per layer, true for `yes` and false for `no` (`None` without
    /// the key): the two-kind layer patterns (sliding / full, linear / full, chunked / full). A
    /// list of another length than the layers, or an entry of a third kind, is refused by name.
    pub fn layer_type_flags(&self, yes: &str, no: &str) -> Result<Option<Vec<bool>>> {
        let Some(types) = &self.layer_types else {
            return Ok(None);
        };
        let n = self.num_hidden_layers;
        if types.len() != n {
            return Err(ModelError::Config(format!(
                "layer_types has {} entries for {n} layers",
                types.len()
            )));
        }
        types
            .iter()
            .map(|t| match t.as_str() {
                t if t == yes => Ok(true),
                t if t == no => Ok(false),
                other => Err(ModelError::Unsupported(format!(
                    "layer_types entry `{other}`: this architecture has `{yes}` and `{no}` layers"
                ))),
            })
            .collect::<Result<_>>()
            .map(Some)
    }

    /// Per-layer sliding windows: from `layer_types` when the config has it, else `fallback(i)`
    /// decides whether layer `i` slides (over `sliding_window`).
    pub fn windows(&self, fallback: impl Fn(usize) -> bool) -> Result<Vec<Option<usize>>> {
        let n = self.num_hidden_layers;
        let sliding = match self.layer_type_flags("sliding_attention", "full_attention")? {
            Some(sliding) => sliding,
            None => (0..n).map(fallback).collect(),
        };
        sliding
            .into_iter()
            .map(|s| match (s, self.sliding_window) {
                (false, _) => Ok(None),
                (true, Some(w)) if w > 0 => Ok(Some(w)),
                (true, w) => Err(ModelError::Config(format!(
                    "sliding_window = {}: a sliding layer needs a positive `sliding_window`",
                    w.map_or("(absent)".to_string(), |w| w.to_string())
                ))),
            })
            .collect()
    }
}

/// Reads the keys of a config that spells the common keys its own way (GPT-J, EXAONE 3): each
/// hub-only key `alias` moves to its canonical name `key` (`(alias, key)` pairs, as transformers'
/// `attribute_map` lists them) unless the canonical key is present, then the canonical keys are
/// validated (as every other architecture's are before parsing) and `T` is read.
pub fn parse_with_aliases<T: serde::de::DeserializeOwned>(
    mut config: Value,
    aliases: &[(&str, &str)],
) -> std::result::Result<T, serde_json::Error> {
    if let Value::Object(obj) = &mut config {
        for (alias, key) in aliases {
            if !obj.contains_key(*key) {
                if let Some(v) = obj.remove(*alias) {
                    obj.insert(key.to_string(), v);
                }
            }
        }
    }
    crate::validate::validate_config(&config)
        .map_err(|e| <serde_json::Error as serde::de::Error>::custom(e.to_string()))?;
    serde_json::from_value(config)
}

/// The plain llama-shaped spec of `c`: pre-norm blocks, RMSNorm, bias-free projections, dense
/// gated MLPs, global attention, rope on every layer. Architectures adjust the values that differ.
pub fn base_spec(
    c: &CommonArgs,
    tie_default: bool,
    act_default: &str,
) -> Result<super::transformer::DecoderSpec> {
    use super::transformer::{BlockTopology, DecoderSpec, FfnSpec, MixerSpec, QkNormSpec};
    let n = c.num_hidden_layers;
    let intermediate = c.intermediate()?;
    Ok(DecoderSpec {
        vocab: c.vocab_size,
        hidden: c.hidden_size,
        heads: c.num_attention_heads,
        kv_heads: c.kv_heads(),
        head_dim: c.head_dim(),
        norm: crate::nn::NormKind::Rms,
        eps: c.rms_norm_eps,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        qk_norm: QkNormSpec::None,
        attn_scale: 1.0 / (c.head_dim() as f32).sqrt(),
        attn_softcap: None,
        attn_sinks: false,
        attn_output_gate: false,
        act: c.activation(act_default)?,
        topology: BlockTopology::PreNorm,
        mixers: vec![MixerSpec::Attention; n],
        rope: vec![Some(c.rope()); n],
        windows: vec![None; n],
        ffn: vec![FfnSpec::Dense { intermediate }; n],
        query_scales: vec![None; n],
        chunks: vec![None; n],
        block_scales: vec![super::transformer::BlockScales::ONE; n],
        embed_scale: None,
        residual_scale: None,
        logit_scale: None,
        final_softcap: None,
        tie_word_embeddings: c.tie_word_embeddings.unwrap_or(tie_default),
        lm_head_bias: false,
        mtp: None,
    })
}

/// Plain `up_proj` → activation → `down_proj` MLPs (no gate projection) of `intermediate_size`
/// on every layer: the feed-forward of the GPT-2-era families (GPT-NeoX, GPT-J, Phi,
/// StarCoder2) and of Apertus, in place of [`base_spec`]'s gated ones.
pub fn plain_ffn(c: &CommonArgs) -> Result<Vec<super::transformer::FfnSpec>> {
    let intermediate = c.intermediate()?;
    Ok(vec![
        super::transformer::FfnSpec::Plain { intermediate };
        c.num_hidden_layers
    ])
}

/// The per-layer `no_rope_layers` flags of the NoPE families (Llama 4, SmolLM3): `given` (one
/// entry per layer; 1 = rope, 0 = no positional encoding), else transformers' default of 0 on
/// every `interval`-th layer and 1 elsewhere. Each family reads the entries its own way.
pub fn no_rope_flags(c: &CommonArgs, given: Option<&[u8]>, interval: usize) -> Result<Vec<u8>> {
    let n = c.num_hidden_layers;
    match given {
        Some(flags) if flags.len() != n => Err(ModelError::Config(format!(
            "no_rope_layers has {} entries for {n} layers",
            flags.len()
        ))),
        Some(flags) => Ok(flags.to_vec()),
        None if interval == 0 => Err(ModelError::Config(
            "no_rope_layer_interval = 0: must be positive".into(),
        )),
        None => Ok((0..n).map(|i| u8::from((i + 1) % interval != 0)).collect()),
    }
}

fn one() -> usize {
    1
}

/// Config fields of softmax-routed mixture-of-experts architectures (`num_local_experts`
/// arrives as `num_experts` after sanitising).
#[derive(Debug, Clone, Deserialize)]
pub struct MoeArgs {
    /// `num_experts` (or `num_local_experts`): routed experts per MoE layer (required).
    pub num_experts: i32,
    /// `num_experts_per_tok`: experts each token is routed to (required).
    pub num_experts_per_tok: i32,
    /// `moe_intermediate_size`: width of one routed expert; default `intermediate_size`.
    #[serde(default)]
    pub moe_intermediate_size: Option<i32>,
    /// `norm_topk_prob`: renormalise the kept routing weights to sum to one; default false.
    #[serde(default)]
    pub norm_topk_prob: bool,
    /// `decoder_sparse_step`: every this-many-th layer is an MoE layer; default 1 (all).
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    /// `mlp_only_layers`: layer indices that keep a dense MLP; default none.
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
}

impl MoeArgs {
    /// Turns the sparse layers of `spec` into expert blocks of `expert_intermediate` width:
    /// every layer not in `mlp_only_layers` whose index + 1 is a multiple of
    /// `decoder_sparse_step` (transformers' rule; all layers by default).
    pub fn apply(
        &self,
        spec: &mut super::transformer::DecoderSpec,
        expert_intermediate: i32,
        normalize: bool,
        shared_intermediate: Option<i32>,
    ) {
        // `shared_intermediate`: a sigmoid-gated shared expert of that width (Qwen2-MoE).
        use super::transformer::{FfnSpec, MoeSpec, SharedExpertSpec};
        let moe = MoeSpec {
            shared: shared_intermediate.map(|intermediate| SharedExpertSpec {
                intermediate,
                gated: true,
            }),
            ..MoeSpec::softmax(
                self.num_experts,
                self.num_experts_per_tok,
                expert_intermediate,
                normalize,
            )
        };
        let step = self.decoder_sparse_step;
        for (i, ffn) in spec.ffn.iter_mut().enumerate() {
            if !self.mlp_only_layers.contains(&i) && step > 0 && (i + 1) % step == 0 {
                *ffn = FfnSpec::Moe(moe.clone());
            }
        }
    }

    /// The width of the routed experts: `moe_intermediate_size`, else `intermediate_size`.
    pub fn expert_intermediate(&self, c: &CommonArgs) -> Result<i32> {
        match self.moe_intermediate_size {
            Some(i) => Ok(i),
            None => c.intermediate(),
        }
    }
}

/// The spec of architecture `A` read from [`test_config`]`(model_type, extra)`: what the
/// architectures' spec tests check (a config that does not parse panics; a refused one is `Err`).
#[cfg(test)]
pub(crate) fn test_spec<A>(
    model_type: &str,
    extra: serde_json::Value,
) -> Result<super::transformer::DecoderSpec>
where
    A: serde::de::DeserializeOwned + super::transformer::DecoderArgs,
{
    let args: A = serde_json::from_value(test_config(model_type, extra)).unwrap();
    args.spec()
}

/// A small config of `model_type` with `extra` keys merged in, sanitised as a loader would:
/// what the architectures' config tests parse.
#[cfg(test)]
pub(crate) fn test_config(model_type: &str, extra: serde_json::Value) -> serde_json::Value {
    let mut config = serde_json::json!({
        "model_type": model_type, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
    });
    if let (Some(obj), serde_json::Value::Object(extra)) = (config.as_object_mut(), extra) {
        obj.extend(extra);
    }
    crate::config::sanitize_config_json(config)
}

/// Config fields of the DeepSeek-V3-style mixture of experts that GLM-4.5 (`glm4_moe`) and
/// dots.llm1 (`dots1`) put on grouped-query attention: sigmoid routing with an
/// `e_score_correction_bias` for the choice, groups scored by their two best experts, ungated
/// shared experts, dense MLPs on the first `first_k_dense_replace` layers. The defaults differ
/// per architecture, so the optional keys are read as options and [`V3MoeDefaults`] fills them.
#[derive(Debug, Clone, Deserialize)]
pub struct V3MoeArgs {
    /// `n_routed_experts`: routed experts per MoE layer (required).
    pub n_routed_experts: i32,
    /// `num_experts_per_tok`: experts per token (required).
    pub num_experts_per_tok: i32,
    /// `moe_intermediate_size`: width of one expert (required).
    pub moe_intermediate_size: i32,
    /// `n_shared_experts`: shared experts, run as one MLP `n · moe_intermediate_size` wide.
    #[serde(default)]
    pub n_shared_experts: Option<i32>,
    /// `first_k_dense_replace`: the first this-many layers keep a dense MLP.
    #[serde(default)]
    pub first_k_dense_replace: Option<usize>,
    /// `norm_topk_prob`: renormalise the kept weights to sum to one.
    #[serde(default)]
    pub norm_topk_prob: Option<bool>,
    /// `routed_scaling_factor`: multiplies the routing weights; default 1.
    #[serde(default)]
    pub routed_scaling_factor: Option<f64>,
    /// `n_group`: expert groups (divides `n_routed_experts`); default 1.
    #[serde(default)]
    pub n_group: Option<i32>,
    /// `topk_group`: groups a token may route to; default 1.
    #[serde(default)]
    pub topk_group: Option<i32>,
}

/// An architecture's defaults for the optional [`V3MoeArgs`] keys (transformers' config
/// defaults).
#[derive(Debug, Clone, Copy)]
pub struct V3MoeDefaults {
    /// `n_shared_experts` when absent.
    pub shared_experts: Option<i32>,
    /// `first_k_dense_replace` when absent.
    pub first_k_dense_replace: usize,
    /// `norm_topk_prob` when absent.
    pub norm_topk_prob: bool,
}

impl V3MoeArgs {
    /// Turns the layers from `first_k_dense_replace` on into expert blocks.
    pub fn apply(
        &self,
        spec: &mut super::transformer::DecoderSpec,
        defaults: V3MoeDefaults,
    ) -> Result<()> {
        use super::transformer::{FfnSpec, MoeSpec, SharedExpertSpec};
        use crate::nn::{GroupLimit, GroupScore, RouterScoring};
        let experts = self.n_routed_experts;
        let (groups, keep) = (self.n_group.unwrap_or(1), self.topk_group.unwrap_or(1));
        if groups <= 0 || experts % groups != 0 || keep <= 0 || keep > groups {
            return Err(ModelError::Config(format!(
                "n_group = {groups}, topk_group = {keep}: n_group must divide n_routed_experts = \
                 {experts} and topk_group be between 1 and n_group"
            )));
        }
        if self.num_experts_per_tok > experts {
            return Err(ModelError::Config(format!(
                "num_experts_per_tok = {}: must be at most n_routed_experts = {experts}",
                self.num_experts_per_tok
            )));
        }
        let intermediate = self.moe_intermediate_size;
        let moe = MoeSpec {
            scoring: RouterScoring::Sigmoid,
            group_limit: Some(GroupLimit {
                groups,
                keep,
                score: GroupScore::TopTwoSum,
            }),
            correction_bias: true,
            weight_scale: self.routed_scaling_factor.unwrap_or(1.0) as f32,
            shared: self
                .n_shared_experts
                .or(defaults.shared_experts)
                .filter(|&s| s > 0)
                .map(|s| SharedExpertSpec {
                    intermediate: intermediate * s,
                    gated: false,
                }),
            ..MoeSpec::softmax(
                experts,
                self.num_experts_per_tok,
                intermediate,
                self.norm_topk_prob.unwrap_or(defaults.norm_topk_prob),
            )
        };
        let first_moe = self
            .first_k_dense_replace
            .unwrap_or(defaults.first_k_dense_replace);
        for ffn in spec.ffn.iter_mut().skip(first_moe) {
            *ffn = FfnSpec::Moe(moe.clone());
        }
        Ok(())
    }
}
