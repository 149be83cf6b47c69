//! The GGUF architectures the importer reads: llama.cpp's tensor names and metadata keys mapped
//! back to the HuggingFace layout (and the mlx-lm stacked-expert layout) that the registered
//! models load unchanged.
//!
//! What llama.cpp's `convert_hf_to_gguf.py` changes, and what is undone here:
//!
//! - **llama** (Mistral and other llama-layout models convert to it too): the rows of
//!   `attn_q`/`attn_k` are permuted for llama.cpp's rope ([`super::unpermute_rope_rows`]).
//! - **gemma, gemma2, gemma3**: every `*norm.weight` is stored as `1 + w` (llama.cpp's RMSNorm
//!   multiplies by the weight; Gemma's by `1 + w`), so 1 is subtracted. Gemma 2/3's four norms
//!   per layer are `attn_norm`, `post_attention_norm`, `ffn_norm` (pre-feed-forward) and
//!   `post_ffw_norm`. The attention scale is not stored: llama.cpp uses `head_dim^-1/2`, except
//!   `(hidden / heads)^-1/2` for the 27B models (46 and 62 layers), written as
//!   `query_pre_attn_scalar`. Sliding layers follow `attention.sliding_window_pattern`
//!   (default 2 for gemma2, 6 for gemma3: every n-th layer is global), as llama.cpp reads it.
//! - **phi3**: fused `attn_qkv` and `ffn_up` (gate and up stacked) are HF's `qkv_proj` and
//!   `gate_up_proj` already; a rotary dimension below the head size is `partial_rotary_factor`.
//! - **llama with experts** (`<arch>.expert_count` set: how llama.cpp writes Mixtral): HF's
//!   `mixtral`, the stacked experts as mlx-lm's `block_sparse_moe.switch_mlp.*` and the router
//!   `ffn_gate_inp` as `block_sparse_moe.gate`; q/k un-permuted as for llama.
//! - **deepseek2** (multi-head latent attention): llama.cpp splits each layer's `kv_b_proj`
//!   `[heads·(nope + v), kv_lora]` into `attn_k_b` (`[heads, kv_lora, nope]`, transposed per head)
//!   and `attn_v_b` (`[heads, v, kv_lora]`); the two are joined back ([`join_kv_b`]) in float32.
//!   Head sizes come from `attention.key_length_mla`/`value_length_mla` (older files: `key_length`/
//!   `value_length`), the router from `expert_*` keys; experts as mlx-lm's `switch_mlp`.
//! - **qwen2moe, qwen3moe**: experts are stacked `[experts, out, in]` tensors
//!   (`ffn_{gate,up,down}_exps`), written as mlx-lm's `mlp.switch_mlp.*`; the router is
//!   `ffn_gate_inp`, Qwen2-MoE's shared expert `ffn_*_shexp` and its gate `ffn_gate_inp_shexp`.

use serde_json::{json, Map, Value};

use super::reader::GgufFile;
use super::GgufError;

/// One GGUF architecture.
pub(crate) struct Arch {
    /// `general.architecture`.
    pub gguf: &'static str,
    /// The HF `model_type` written to `config.json`.
    pub model_type: &'static str,
    /// The HF class written to `architectures`.
    pub class: &'static str,
    /// llama.cpp permuted the Q/K rows (llama-style rope).
    pub rope_permuted: bool,
    /// Norm weights are stored as `1 + w`.
    pub norm_plus_one: bool,
    /// Layer parts whose HF path differs from llama's (checked before [`LLAMA_PARTS`]).
    pub parts: &'static [(&'static str, &'static str)],
}

/// llama.cpp's per-layer tensor names and their HF (llama) paths.
const LLAMA_PARTS: &[(&str, &str)] = &[
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
];

const GEMMA2_PARTS: &[(&str, &str)] = &[
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
];

const PHI3_PARTS: &[(&str, &str)] = &[
    ("attn_qkv", "self_attn.qkv_proj"),
    ("ffn_up", "mlp.gate_up_proj"),
];

const MOE_PARTS: &[(&str, &str)] = &[
    ("ffn_gate_inp", "mlp.gate"),
    ("ffn_gate_exps", "mlp.switch_mlp.gate_proj"),
    ("ffn_up_exps", "mlp.switch_mlp.up_proj"),
    ("ffn_down_exps", "mlp.switch_mlp.down_proj"),
    ("ffn_gate_shexp", "mlp.shared_expert.gate_proj"),
    ("ffn_up_shexp", "mlp.shared_expert.up_proj"),
    ("ffn_down_shexp", "mlp.shared_expert.down_proj"),
    ("ffn_gate_inp_shexp", "mlp.shared_expert_gate"),
];

const MIXTRAL_PARTS: &[(&str, &str)] = &[
    ("ffn_gate_inp", "block_sparse_moe.gate"),
    ("ffn_gate_exps", "block_sparse_moe.switch_mlp.gate_proj"),
    ("ffn_up_exps", "block_sparse_moe.switch_mlp.up_proj"),
    ("ffn_down_exps", "block_sparse_moe.switch_mlp.down_proj"),
];

/// A `llama` GGUF with experts: Mixtral.
const MIXTRAL: Arch = Arch {
    rope_permuted: true,
    ..arch("llama", "mixtral", "MixtralForCausalLM", MIXTRAL_PARTS)
};

const DEEPSEEK2_PARTS: &[(&str, &str)] = &[
    ("attn_q_a", "self_attn.q_a_proj"),
    ("attn_q_a_norm", "self_attn.q_a_layernorm"),
    ("attn_q_b", "self_attn.q_b_proj"),
    ("attn_kv_a_mqa", "self_attn.kv_a_proj_with_mqa"),
    ("attn_kv_a_norm", "self_attn.kv_a_layernorm"),
    ("attn_kv_b", "self_attn.kv_b_proj"),
    ("attn_k_b", "self_attn.k_b_proj"),
    ("attn_v_b", "self_attn.v_b_proj"),
    ("ffn_gate_inp", "mlp.gate"),
    ("ffn_gate_exps", "mlp.switch_mlp.gate_proj"),
    ("ffn_up_exps", "mlp.switch_mlp.up_proj"),
    ("ffn_down_exps", "mlp.switch_mlp.down_proj"),
    ("ffn_gate_shexp", "mlp.shared_experts.gate_proj"),
    ("ffn_up_shexp", "mlp.shared_experts.up_proj"),
    ("ffn_down_shexp", "mlp.shared_experts.down_proj"),
];

const fn arch(
    gguf: &'static str,
    model_type: &'static str,
    class: &'static str,
    parts: &'static [(&'static str, &'static str)],
) -> Arch {
    Arch {
        gguf,
        model_type,
        class,
        rope_permuted: false,
        norm_plus_one: false,
        parts,
    }
}

/// Every architecture [`super::import_gguf`] reads.
pub(crate) const ARCHES: &[Arch] = &[
    Arch {
        rope_permuted: true,
        ..arch("llama", "llama", "LlamaForCausalLM", &[])
    },
    arch("qwen2", "qwen2", "Qwen2ForCausalLM", &[]),
    arch("qwen3", "qwen3", "Qwen3ForCausalLM", &[]),
    arch("qwen2moe", "qwen2_moe", "Qwen2MoeForCausalLM", MOE_PARTS),
    arch("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", MOE_PARTS),
    Arch {
        norm_plus_one: true,
        ..arch("gemma", "gemma", "GemmaForCausalLM", &[])
    },
    Arch {
        norm_plus_one: true,
        ..arch("gemma2", "gemma2", "Gemma2ForCausalLM", GEMMA2_PARTS)
    },
    Arch {
        norm_plus_one: true,
        ..arch("gemma3", "gemma3_text", "Gemma3ForCausalLM", GEMMA2_PARTS)
    },
    arch("phi3", "phi3", "Phi3ForCausalLM", PHI3_PARTS),
    arch(
        "deepseek2",
        "deepseek_v2",
        "DeepseekV2ForCausalLM",
        DEEPSEEK2_PARTS,
    ),
];

/// Whether `hf_name` is one half of a split DeepSeek `kv_b_proj`, kept dense for [`join_kv_b`].
pub(crate) fn is_split_kv_b(hf_name: &str) -> bool {
    hf_name.ends_with("self_attn.k_b_proj.weight") || hf_name.ends_with("self_attn.v_b_proj.weight")
}

/// Joins every layer's `k_b_proj` `[heads, kv_lora, nope]` and `v_b_proj` `[heads, v, kv_lora]`
/// (dense f32 values with their shapes) back into HF's `kv_b_proj` `[heads·(nope + v), kv_lora]`:
/// per head, the transposed `k_b` rows, then the `v_b` rows.
pub(crate) fn join_kv_b(
    k_b: (&[f32], &[i32]),
    v_b: (&[f32], &[i32]),
) -> Option<(Vec<f32>, [i32; 2])> {
    let (&[heads, lora, nope], &[vh, v, vlora]) = (k_b.1, v_b.1) else {
        return None;
    };
    if heads != vh || lora != vlora {
        return None;
    }
    let (heads, lora, nope, v) = (heads as usize, lora as usize, nope as usize, v as usize);
    let mut out = Vec::with_capacity(heads * (nope + v) * lora);
    for h in 0..heads {
        let k = &k_b.0[h * lora * nope..(h + 1) * lora * nope];
        for n in 0..nope {
            out.extend((0..lora).map(|l| k[l * nope + n]));
        }
        out.extend_from_slice(&v_b.0[h * v * lora..(h + 1) * v * lora]);
    }
    Some((out, [(heads * (nope + v)) as i32, lora as i32]))
}

impl Arch {
    /// The architecture named by `general.architecture`, or `None`.
    pub fn find(name: &str) -> Option<&'static Arch> {
        ARCHES.iter().find(|a| a.gguf == name)
    }

    /// The architecture of `g`, named `name`: [`Arch::find`], except that a `llama` file with
    /// experts is Mixtral.
    pub fn of_file(g: &GgufFile, name: &str) -> Result<Option<&'static Arch>, GgufError> {
        if name == "llama" && meta_u64(g, "llama.expert_count")?.is_some_and(|n| n > 0) {
            return Ok(Some(&MIXTRAL));
        }
        Ok(Arch::find(name))
    }

    /// The HF name of a GGUF tensor (`blk.3.attn_q.weight` →
    /// `model.layers.3.self_attn.q_proj.weight`), or `None` for names without one.
    pub fn hf_name(&self, gguf: &str) -> Option<String> {
        let (stem, suffix) = gguf.rsplit_once('.')?;
        if suffix != "weight" && suffix != "bias" {
            return None;
        }
        let module = match stem {
            "token_embd" => "model.embed_tokens".to_string(),
            "output_norm" => "model.norm".to_string(),
            "output" => "lm_head".to_string(),
            _ => {
                let rest = stem.strip_prefix("blk.")?;
                let (layer, part) = rest.split_once('.')?;
                let layer: u32 = layer.parse().ok()?;
                let path = self
                    .parts
                    .iter()
                    .chain(LLAMA_PARTS)
                    .find(|(g, _)| *g == part)?
                    .1;
                format!("model.layers.{layer}.{path}")
            }
        };
        Some(format!("{module}.{suffix}"))
    }

    /// Whether the HF tensor is a norm weight stored as `1 + w`.
    pub fn offset_norm(&self, hf_name: &str) -> bool {
        self.norm_plus_one && hf_name.ends_with("norm.weight")
    }

    /// The architecture-specific `config.json` keys, from `<arch>.*` metadata.
    pub fn config_extras(
        &self,
        g: &GgufFile,
        p: &ArchParams,
        config: &mut Map<String, Value>,
    ) -> Result<(), GgufError> {
        let k = |s: &str| format!("{}.{s}", self.gguf);
        let f64_key = |s: &str| meta_f64(g, &k(s));
        let u64_key = |s: &str| meta_u64(g, &k(s));
        match self.model_type {
            "mixtral" => {
                let need = |s: &str| -> Result<u64, GgufError> {
                    let key = k(s);
                    meta_u64(g, &key)?.ok_or_else(|| GgufError::metadata(g.path(), &key, "missing"))
                };
                config.insert("num_local_experts".into(), json!(need("expert_count")?));
                config.insert(
                    "num_experts_per_tok".into(),
                    json!(need("expert_used_count")?),
                );
                config.insert("sliding_window".into(), Value::Null);
            }
            "gemma" | "gemma2" | "gemma3_text" => {
                config.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
                config.insert("hidden_act".into(), json!("gelu_pytorch_tanh"));
                if self.gguf == "gemma" {
                    return Ok(());
                }
                // llama.cpp's attention scale (not stored in the GGUF).
                let is_27b = matches!(p.n_layer, 46 | 62);
                let scalar = if is_27b {
                    p.n_embd / p.n_head.max(1)
                } else {
                    p.head_dim
                };
                config.insert("query_pre_attn_scalar".into(), json!(scalar));
                for (key, hf) in [
                    ("attn_logit_softcapping", "attn_logit_softcapping"),
                    ("final_logit_softcapping", "final_logit_softcapping"),
                ] {
                    config.insert(hf.into(), json!(f64_key(key)?));
                }
                let window = u64_key("attention.sliding_window")?;
                config.insert("sliding_window".into(), json!(window));
                let pattern = u64_key("attention.sliding_window_pattern")?
                    .unwrap_or(if self.gguf == "gemma2" { 2 } else { 6 })
                    .max(1);
                // llama.cpp: layer i slides unless it is the last of each group of `pattern`.
                let types: Vec<&str> = (0..p.n_layer)
                    .map(|i| {
                        if window.is_some() && (i + 1) % pattern != 0 {
                            "sliding_attention"
                        } else {
                            "full_attention"
                        }
                    })
                    .collect();
                config.insert("layer_types".into(), json!(types));
                if self.gguf == "gemma3" {
                    config.insert("sliding_window_pattern".into(), json!(pattern));
                    let local = f64_key("rope.freq_base_swa")?.unwrap_or(10000.0);
                    config.insert("rope_local_base_freq".into(), json!(local));
                }
            }
            "deepseek_v2" => {
                let need = |s: &str| -> Result<u64, GgufError> {
                    let key = k(s);
                    meta_u64(g, &key)?.ok_or_else(|| GgufError::metadata(g.path(), &key, "missing"))
                };
                let rope = need("rope.dimension_count")?;
                let kv_lora = need("attention.kv_lora_rank")?;
                // MLA files (llama.cpp's absorbed layout) carry the per-head sizes under `_mla`.
                let (key_len, value_len) = match u64_key("attention.key_length_mla")? {
                    Some(kl) => (kl, need("attention.value_length_mla")?),
                    None => (
                        need("attention.key_length")?,
                        need("attention.value_length")?,
                    ),
                };
                let nope = key_len.checked_sub(rope).ok_or_else(|| {
                    GgufError::metadata(
                        g.path(),
                        &k("rope.dimension_count"),
                        "exceeds the key length",
                    )
                })?;
                config.insert("num_key_value_heads".into(), json!(p.n_head));
                config.insert("kv_lora_rank".into(), json!(kv_lora));
                config.insert(
                    "q_lora_rank".into(),
                    json!(u64_key("attention.q_lora_rank")?),
                );
                config.insert("qk_rope_head_dim".into(), json!(rope));
                config.insert("qk_nope_head_dim".into(), json!(nope));
                config.insert("v_head_dim".into(), json!(value_len));
                config.insert("head_dim".into(), json!(rope));
                config.insert("n_routed_experts".into(), json!(need("expert_count")?));
                config.insert(
                    "n_shared_experts".into(),
                    json!(u64_key("expert_shared_count")?.unwrap_or(0)),
                );
                config.insert(
                    "num_experts_per_tok".into(),
                    json!(need("expert_used_count")?),
                );
                config.insert(
                    "moe_intermediate_size".into(),
                    json!(need("expert_feed_forward_length")?),
                );
                config.insert(
                    "first_k_dense_replace".into(),
                    json!(u64_key("leading_dense_block_count")?.unwrap_or(0)),
                );
                config.insert("moe_layer_freq".into(), json!(1));
                config.insert(
                    "routed_scaling_factor".into(),
                    json!(f64_key("expert_weights_scale")?.unwrap_or(1.0)),
                );
                let groups = u64_key("expert_group_count")?.unwrap_or(1);
                config.insert("n_group".into(), json!(groups));
                config.insert(
                    "topk_group".into(),
                    json!(u64_key("expert_group_used_count")?.unwrap_or(1)),
                );
                config.insert(
                    "topk_method".into(),
                    json!(if groups > 1 {
                        "group_limited_greedy"
                    } else {
                        "greedy"
                    }),
                );
                let norm = match g.get(&k("expert_weights_norm")) {
                    None => false,
                    Some(v) => v.as_bool().ok_or_else(|| {
                        GgufError::metadata(g.path(), &k("expert_weights_norm"), "not a bool")
                    })?,
                };
                config.insert("norm_topk_prob".into(), json!(norm));
            }
            "phi3" => {
                let rot = u64_key("rope.dimension_count")?.unwrap_or(p.head_dim);
                config.insert(
                    "partial_rotary_factor".into(),
                    json!(rot as f64 / p.head_dim.max(1) as f64),
                );
                let window = u64_key("attention.sliding_window")?.filter(|w| *w > 0);
                config.insert("sliding_window".into(), json!(window));
                let original = u64_key("rope.scaling.original_context_length")?.unwrap_or(p.n_ctx);
                config.insert("original_max_position_embeddings".into(), json!(original));
            }
            "qwen2_moe" | "qwen3_moe" => {
                let need = |s: &str| -> Result<u64, GgufError> {
                    let key = k(s);
                    meta_u64(g, &key)?.ok_or_else(|| GgufError::metadata(g.path(), &key, "missing"))
                };
                config.insert("num_experts".into(), json!(need("expert_count")?));
                config.insert(
                    "num_experts_per_tok".into(),
                    json!(need("expert_used_count")?),
                );
                config.insert(
                    "moe_intermediate_size".into(),
                    json!(need("expert_feed_forward_length")?),
                );
                config.insert("decoder_sparse_step".into(), json!(1));
                config.insert("mlp_only_layers".into(), json!([]));
                // llama.cpp normalises the top-k weights for Qwen3-MoE and not for Qwen2-MoE.
                config.insert("norm_topk_prob".into(), json!(self.gguf == "qwen3moe"));
                if self.gguf == "qwen2moe" {
                    let shared = u64_key("expert_shared_feed_forward_length")?.unwrap_or(p.n_ff);
                    config.insert("shared_expert_intermediate_size".into(), json!(shared));
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// The common hyper-parameters the architecture extras need.
pub(crate) struct ArchParams {
    pub n_layer: u64,
    pub n_embd: u64,
    pub n_ff: u64,
    pub n_head: u64,
    pub n_ctx: u64,
    pub head_dim: u64,
}

pub(crate) fn meta_u64(g: &GgufFile, key: &str) -> Result<Option<u64>, GgufError> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            GgufError::metadata(
                g.path(),
                key,
                format!("expected an unsigned integer, found {}", v.type_name()),
            )
        }),
    }
}

pub(crate) fn meta_f64(g: &GgufFile, key: &str) -> Result<Option<f64>, GgufError> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| {
            GgufError::metadata(
                g.path(),
                key,
                format!("expected a float, found {}", v.type_name()),
            )
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_each_architecture() {
        let name = |arch: &str, gguf: &str| Arch::find(arch).unwrap().hf_name(gguf);
        let layer = |s: &str| Some(format!("model.layers.1.{s}"));
        assert_eq!(
            name("gemma2", "blk.1.ffn_norm.weight"),
            layer("pre_feedforward_layernorm.weight")
        );
        assert_eq!(
            name("gemma", "blk.1.ffn_norm.weight"),
            layer("post_attention_layernorm.weight")
        );
        assert_eq!(
            name("gemma3", "blk.1.post_ffw_norm.weight"),
            layer("post_feedforward_layernorm.weight")
        );
        assert_eq!(
            name("phi3", "blk.1.ffn_up.weight"),
            layer("mlp.gate_up_proj.weight")
        );
        assert_eq!(
            name("llama", "blk.1.ffn_up.weight"),
            layer("mlp.up_proj.weight")
        );
        assert_eq!(
            name("qwen2moe", "blk.1.ffn_gate_inp_shexp.weight"),
            layer("mlp.shared_expert_gate.weight")
        );
        assert_eq!(
            name("qwen3moe", "blk.1.ffn_down_exps.weight"),
            layer("mlp.switch_mlp.down_proj.weight")
        );
        assert_eq!(
            name("deepseek2", "blk.1.ffn_up_shexp.weight"),
            layer("mlp.shared_experts.up_proj.weight")
        );
        assert_eq!(
            MIXTRAL.hf_name("blk.1.ffn_gate_inp.weight"),
            layer("block_sparse_moe.gate.weight")
        );
        assert_eq!(name("qwen3", "blk.1.ffn_gate_exps.weight"), None);
        assert!(Arch::find("gemma3")
            .unwrap()
            .offset_norm("model.norm.weight"));
        assert!(!Arch::find("llama")
            .unwrap()
            .offset_norm("model.norm.weight"));
    }

    #[test]
    fn kv_b_joins_transposed_k_then_v_per_head() {
        // 2 heads, kv_lora 3, nope 2, v 1. k_b[h][l][n] = 100h + 10l + n; v_b[h][0][l] = -(10h + l).
        let k: Vec<f32> = (0..2)
            .flat_map(|h| {
                (0..3).flat_map(move |l| (0..2).map(move |n| (100 * h + 10 * l + n) as f32))
            })
            .collect();
        let v: Vec<f32> = (0..2)
            .flat_map(|h| (0..3).map(move |l| -((10 * h + l) as f32)))
            .collect();
        let (out, shape) = join_kv_b((&k, &[2, 3, 2]), (&v, &[2, 1, 3])).unwrap();
        assert_eq!(shape, [6, 3]);
        #[rustfmt::skip]
        let want = [
            0.0, 10.0, 20.0,     // head 0, nope 0: k_b[0][l][0]
            1.0, 11.0, 21.0,     // head 0, nope 1
            -0.0, -1.0, -2.0,    // head 0, v
            100.0, 110.0, 120.0, // head 1, nope 0
            101.0, 111.0, 121.0,
            -10.0, -11.0, -12.0,
        ];
        assert_eq!(out, want);
        assert!(join_kv_b((&k, &[2, 3, 2]), (&v, &[1, 2, 3])).is_none());
    }
}
