//! Checkpoints the benchmark makes: synthetic random-weight models (written tensor by tensor, so
//! memory holds one tensor at a time) and an 8-bit requantization of the 4-bit SmolLM2 import.
//! Everything is written into a staging folder and renamed into place when complete.

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{bail, Context, Result};
use mlxcel_core::ops::random;
use mlxcel_core::ops::{dequantize, QuantSpec};
use mlxcel_core::{Array, Dtype, WeightMap};
use serde_json::{json, Value};

use crate::staging::{publish, staging_for};

/// Standard deviation of the random weights (uniform in ±std·√3).
const STD: f64 = 0.02;
/// Tensors of more elements than this are generated in row chunks of about a quarter of it.
const HUGE: u64 = 1 << 29;

/// How a tensor is made.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fill {
    Random,
    Ones,
    /// A token embedding `[vocab, hidden]` whose rows are random with standard deviation
    /// [`TOKEN_STD`] plus one vector shared by every row, of per-element RMS [`SHARED_RMS`], along
    /// [`shared_direction`] (see [`Routing`]).
    TokenEmbedding,
    /// A router `[experts, hidden]`: random rows (as [`Fill::Random`]) made orthogonal to the
    /// shared direction, plus `beta * (1 + rank(e))^-ZIPF_ALPHA` times it for expert `e`; the
    /// ranks a seeded permutation per tensor (see [`Routing`]).
    Router {
        /// 0: no bias ([`Routing::Uniform`]); [`BIAS_BETA`] for [`Routing::Skewed`].
        beta: f64,
    },
}

/// How the synthetic Qwen3-MoE models route.
///
/// With the plain random weights ([`Routing::Random`]), the residual stream is dominated by
/// the layers' outputs (std 0.02 weights over hidden states of RMS 1 give outputs far larger
/// than a std-0.02 token embedding), which barely change from one token to the next: a random
/// router then picks nearly the same experts for every token, whatever the input — neither
/// uniform nor like a trained model. The two routing benchmarks therefore make the current token
/// dominate the residual stream (token embeddings of std [`TOKEN_STD`]) and give every token a
/// shared component along one direction `u` (RMS [`SHARED_RMS`]), the stand-in for what all
/// tokens of a trained model have in common:
/// - [`Routing::Uniform`]: random router rows made orthogonal to `u`: each token routes by
///   its own embedding, close to uniformly and independently (the worst case for a cache);
/// - [`Routing::Skewed`]: the same rows plus `BIAS_BETA * (1 + rank)^-ZIPF_ALPHA * u` for
///   the expert of that rank (a seeded permutation per layer). Since every hidden state has a
///   large positive component along `u`, this is a per-expert bias with Zipf-like weights on
///   top of the token-dependent logits: a few experts are chosen by most tokens, the rest by
///   the token. Consecutive tokens share the popular experts (the reuse rate) and the slowly
///   changing part of the context the attention layers add.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing {
    /// The plain random model (the main plan's MoE shape).
    Random,
    /// Token-dominated hidden states, random routers.
    Uniform,
    /// Token-dominated hidden states, routers with Zipf-weighted biases.
    Skewed,
}

/// Standard deviation of the token-specific part of [`Fill::TokenEmbedding`] rows.
const TOKEN_STD: f64 = 2.0;
/// Per-element RMS of the component every [`Fill::TokenEmbedding`] row shares.
const SHARED_RMS: f64 = 1.0;
/// The Zipf exponent of [`Routing::Skewed`]'s biases.
const ZIPF_ALPHA: f64 = 1.0;
/// The scale of [`Routing::Skewed`]'s biases (the most popular expert's router row gains
/// `BIAS_BETA * u`, `u` of unit norm).
const BIAS_BETA: f64 = 0.5;
/// The key of the shared direction (fixed: the embedding and the routers must agree on it).
const SHARED_KEY: u64 = 0x5eed_0a11;

/// The unit vector `[1, hidden]` all [`Fill::TokenEmbedding`] rows share a component along.
fn shared_direction(hidden: i32) -> Result<Array> {
    let u = random::uniform(&[1, hidden], Dtype::Float32, &random::key(SHARED_KEY)?)?
        .add_scalar(-0.5)?;
    let norm = u.multiply(&u)?.sum(&[1], true)?.sqrt()?;
    Ok(u.divide(&norm)?)
}

/// The Zipf weights `(1 + rank)^-alpha` of `rows` experts, ranks a permutation seeded by `key`
/// (a small xorshift: the layout must not depend on MLX's RNG).
fn zipf_weights(rows: usize, alpha: f64, key: u64) -> Vec<f32> {
    let mut state = key ^ 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut rank: Vec<usize> = (0..rows).collect();
    for i in (1..rows).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        rank.swap(i, j);
    }
    rank.iter()
        .map(|r| (1.0 + *r as f64).powf(-alpha) as f32)
        .collect()
}

/// One entry of a synthetic checkpoint: a dense float tensor or a quantized linear/embedding
/// (`<prefix>.weight/.scales/.biases`).
#[derive(Debug, Clone)]
struct Item {
    /// Full tensor name (dense) or module prefix (quantized).
    name: String,
    shape: Vec<i32>,
    fill: Fill,
    quant: Option<QuantSpec>,
}

/// A synthetic model: its `config.json` and tensors.
pub struct Synthetic {
    pub config: Value,
    items: Vec<Item>,
    dtype: Dtype,
}

fn st_dtype(d: Dtype) -> Result<&'static str> {
    Ok(match d {
        Dtype::Bfloat16 => "BF16",
        Dtype::Float16 => "F16",
        Dtype::Float32 => "F32",
        Dtype::Uint32 => "U32",
        other => bail!("no safetensors tag for {other} in the synthetic writer"),
    })
}

impl Synthetic {
    /// A bfloat16 model of `config` (given its `quantization` block when `quant` is set) with no
    /// tensors yet: how every synthetic checkpoint starts.
    fn bf16(config: Value, quant: Option<QuantSpec>) -> Synthetic {
        Synthetic {
            config: with_quant(config, quant),
            items: Vec::new(),
            dtype: Dtype::Bfloat16,
        }
    }

    fn dense(&mut self, name: String, shape: &[i32], fill: Fill) {
        self.items.push(Item {
            name,
            shape: shape.to_vec(),
            fill,
            quant: None,
        });
    }

    /// A matrix `[.., out, in]` stored as `<prefix>.weight` (quantized when `quant` is set).
    fn linear(&mut self, prefix: String, shape: &[i32], quant: Option<QuantSpec>) {
        self.linear_filled(prefix, shape, quant, Fill::Random);
    }

    /// [`Synthetic::linear`] made by `fill`.
    fn linear_filled(
        &mut self,
        prefix: String,
        shape: &[i32],
        quant: Option<QuantSpec>,
        fill: Fill,
    ) {
        match quant {
            Some(_) => self.items.push(Item {
                name: prefix,
                shape: shape.to_vec(),
                fill,
                quant,
            }),
            None => self.dense(format!("{prefix}.weight"), shape, fill),
        }
    }

    /// The start of a decoder layer `p` both shapes share: its input norm and the q/k/v/o
    /// projections of `heads` query and `kv` key/value heads of `hd` dims over hidden size `h`.
    fn attention(
        &mut self,
        p: &str,
        (h, heads, kv, hd): (i32, i32, i32, i32),
        quant: Option<QuantSpec>,
    ) {
        self.dense(format!("{p}.input_layernorm.weight"), &[h], Fill::Ones);
        self.linear(format!("{p}.self_attn.q_proj"), &[heads * hd, h], quant);
        self.linear(format!("{p}.self_attn.k_proj"), &[kv * hd, h], quant);
        self.linear(format!("{p}.self_attn.v_proj"), &[kv * hd, h], quant);
        self.linear(format!("{p}.self_attn.o_proj"), &[h, heads * hd], quant);
    }

    /// `(name, dtype, shape)` of every stored tensor, in file order.
    fn layout(&self) -> Vec<(String, Dtype, Vec<i32>)> {
        let mut out = Vec::new();
        for item in &self.items {
            match item.quant {
                None => out.push((item.name.clone(), self.dtype, item.shape.clone())),
                Some(q) => {
                    let mut w = item.shape.clone();
                    let mut s = item.shape.clone();
                    let last = *item.shape.last().unwrap_or(&0);
                    *w.last_mut().unwrap_or(&mut 0) = last * q.bits / 32;
                    *s.last_mut().unwrap_or(&mut 0) = last / q.group_size;
                    out.push((format!("{}.weight", item.name), Dtype::Uint32, w));
                    out.push((format!("{}.scales", item.name), self.dtype, s.clone()));
                    out.push((format!("{}.biases", item.name), self.dtype, s));
                }
            }
        }
        out
    }

    /// Total bytes of the tensors.
    pub fn nbytes(&self) -> u64 {
        self.layout()
            .iter()
            .map(|(_, d, s)| d.size_of() as u64 * s.iter().map(|x| *x as u64).product::<u64>())
            .sum()
    }

    /// The model as a plan another program can build: `config`, and per tensor its name,
    /// shape, fill (`random`: uniform with standard deviation `std`, or `ones`) and
    /// quantization. The GPU machine has no Rust toolchain; `xtask/bench/make_plan_model.py`
    /// builds the same shapes there with Python MLX (other random values).
    pub fn plan(&self) -> Value {
        let tensors: Vec<Value> = self
            .items
            .iter()
            .map(|item| {
                json!({
                    "name": item.name,
                    "shape": item.shape,
                    "fill": match item.fill {
                        Fill::Random => "random".to_string(),
                        Fill::Ones => "ones".to_string(),
                        Fill::TokenEmbedding => format!("token_embedding:{TOKEN_STD}:{SHARED_RMS}"),
                        Fill::Router { beta } => format!("router:{ZIPF_ALPHA}:{beta}"),
                    },
                    "quantization": quant_json(item.quant),
                })
            })
            .collect();
        json!({"config": self.config, "dtype": "bfloat16", "std": STD, "tensors": tensors})
    }

    /// Writes `config.json` and `model.safetensors` into `dest` (via a staging folder).
    pub fn write(
        &self,
        dest: &Path,
        seed: u64,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<()> {
        let staging = staging_for(dest)?;
        let layout = self.layout();
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": "mlx"}));
        let mut offset = 0u64;
        let mut sizes = Vec::new();
        for (name, dtype, shape) in &layout {
            let n = dtype.size_of() as u64 * shape.iter().map(|x| *x as u64).product::<u64>();
            header.insert(
                name.clone(),
                json!({"dtype": st_dtype(*dtype)?, "shape": shape, "data_offsets": [offset, offset + n]}),
            );
            sizes.push(n);
            offset += n;
        }
        let mut text = serde_json::to_string(&Value::Object(header))?;
        while text.len() % 8 != 0 {
            text.push(' ');
        }
        let path = staging.join("model.safetensors");
        let file = std::fs::File::create(&path).with_context(|| format!("{}", path.display()))?;
        let data_start = 8 + text.len() as u64;
        file.set_len(data_start + offset)?;
        let mut head = (text.len() as u64).to_le_bytes().to_vec();
        head.extend_from_slice(text.as_bytes());
        file.write_all_at(&head, 0)?;
        // Each plane's offset in the file, in layout order.
        let mut plane_at = Vec::with_capacity(sizes.len());
        let mut at = data_start;
        for n in &sizes {
            plane_at.push(at);
            at += n;
        }
        let mut next = 0usize;
        for (i, item) in self.items.iter().enumerate() {
            progress(i, self.items.len());
            let planes = if item.quant.is_some() { 3 } else { 1 };
            let rows = item.shape.first().copied().unwrap_or(1).max(1);
            let numel: u64 = item.shape.iter().map(|x| *x as u64).product();
            // Tensors past HUGE elements are made in row chunks (one key each, written at their
            // place in every plane), so memory holds a chunk; smaller ones in one piece, as before.
            let chunk_rows = if numel > HUGE {
                ((HUGE / 4) / (numel / rows as u64).max(1)).max(1) as i32
            } else {
                rows
            };
            let mut written = vec![0u64; planes];
            let mut start = 0;
            while start < rows {
                let stop = (start + chunk_rows).min(rows);
                let mut shape = item.shape.clone();
                if let Some(first) = shape.first_mut() {
                    *first = stop - start;
                }
                let key_index = if chunk_rows == rows {
                    seed.wrapping_mul(1_000_003).wrapping_add(i as u64)
                } else {
                    seed.wrapping_mul(1_000_003)
                        .wrapping_add(i as u64)
                        .wrapping_mul(65_537)
                        .wrapping_add(start as u64)
                };
                let key = random::key(key_index)?;
                let base = match item.fill {
                    Fill::Ones => mlxcel_core::ops::ones(&shape, Dtype::Float32)?,
                    Fill::Random => random::uniform(&shape, Dtype::Float32, &key)?
                        .add_scalar(-0.5)?
                        .mul_scalar(2.0 * STD * 3f64.sqrt())?,
                    Fill::TokenEmbedding => {
                        let h = *shape.last().unwrap_or(&1);
                        random::uniform(&shape, Dtype::Float32, &key)?
                            .add_scalar(-0.5)?
                            .mul_scalar(2.0 * TOKEN_STD * 3f64.sqrt())?
                            .add(
                                &shared_direction(h)?.mul_scalar(SHARED_RMS * (h as f64).sqrt())?,
                            )?
                    }
                    Fill::Router { beta } => {
                        let h = *shape.last().unwrap_or(&1);
                        let u = shared_direction(h)?;
                        let all = zipf_weights(rows as usize, ZIPF_ALPHA, key_index);
                        let part = &all[start as usize..stop as usize];
                        let bias = Array::from_slice(part, &[stop - start, 1])?
                            .mul_scalar(beta)?
                            .multiply(&u)?;
                        let g = random::uniform(&shape, Dtype::Float32, &key)?
                            .add_scalar(-0.5)?
                            .mul_scalar(2.0 * STD * 3f64.sqrt())?;
                        // Without their part along `u`, the rows see only what differs between
                        // tokens (a random row's chance projection on `u` would act as a bias of
                        // its own, a few tenths of the logits' spread).
                        let along = g.multiply(&u)?.sum(&[1], true)?;
                        g.subtract(&along.multiply(&u)?)?.add(&bias)?
                    }
                };
                let base = base.astype(self.dtype)?;
                let arrays: Vec<Array> = match item.quant {
                    None => vec![base],
                    Some(q) => {
                        let p = base.quantize(q)?;
                        let biases = p.biases.context("affine quantization without biases")?;
                        vec![p.weight, p.scales, biases]
                    }
                };
                for (k, plane) in arrays.into_iter().enumerate() {
                    let bytes = plane.to_bytes()?;
                    file.write_all_at(&bytes, plane_at[next + k] + written[k])?;
                    written[k] += bytes.len() as u64;
                }
                start = stop;
            }
            for (k, w) in written.iter().enumerate() {
                let (name, _, _) = &layout[next + k];
                if *w != sizes[next + k] {
                    bail!(
                        "{name}: wrote {w} bytes, the header says {}",
                        sizes[next + k]
                    );
                }
            }
            next += planes;
        }
        file.sync_all()?;
        drop(file);
        std::fs::write(
            staging.join("config.json"),
            serde_json::to_string_pretty(&self.config)?,
        )?;
        publish(&staging, dest)
    }
}

fn quant_json(q: Option<QuantSpec>) -> Option<Value> {
    q.map(|q| json!({"group_size": q.group_size, "bits": q.bits, "mode": "affine"}))
}

fn with_quant(mut config: Value, q: Option<QuantSpec>) -> Value {
    if let (Some(obj), Some(qj)) = (config.as_object_mut(), quant_json(q)) {
        obj.insert("quantization".into(), qj.clone());
        obj.insert("quantization_config".into(), qj);
    }
    config
}

/// A Llama-3.2-1B-shaped model: hidden 2048, 16 layers, 32 heads (8 KV, head_dim 64),
/// intermediate 8192, vocab 128256, tied embeddings, llama3 rope scaling.
pub fn llama_1b(quant: Option<QuantSpec>) -> Synthetic {
    let (h, layers, heads, kv, hd, inter, vocab) = (2048, 16, 32, 8, 64, 8192, 128256);
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "intermediate_size": inter,
        "vocab_size": vocab, "tie_word_embeddings": true, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "hidden_act": "silu", "attention_bias": false, "mlp_bias": false,
        "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    });
    let mut m = Synthetic::bf16(config, quant);
    m.linear("model.embed_tokens".into(), &[vocab, h], quant);
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        m.attention(&p, (h, heads, kv, hd), quant);
        m.dense(
            format!("{p}.post_attention_layernorm.weight"),
            &[h],
            Fill::Ones,
        );
        m.linear(format!("{p}.mlp.gate_proj"), &[inter, h], quant);
        m.linear(format!("{p}.mlp.up_proj"), &[inter, h], quant);
        m.linear(format!("{p}.mlp.down_proj"), &[h, inter], quant);
    }
    m.dense("model.norm.weight".into(), &[h], Fill::Ones);
    m
}

/// A Gemma-3n-E2B-shaped text model (`gemma3n_text`): hidden 2048, 30 layers (4 sliding of
/// window 512 then 1 full, six times), 8 heads (2 KV, head_dim 256), intermediate
/// 8192, the last 10 layers sharing keys and values, activation sparsity 0.95 on the first 10,
/// AltUp of 4, LAuReL rank 64, vocab 262400, and the per-layer-embedding table of 262144 rows ×
/// 30·256 values (2.01 G parameters). Quantized as mlx-vlm's external-PLE layout expects (affine
/// 4-bit g32, bf16 scales and biases) when `quant` is set; AltUp and LAuReL matrices, tiny, stay
/// dense.
pub fn gemma3n_e2b(quant: Option<QuantSpec>) -> Synthetic {
    let (h, layers, heads, kv, hd, inter, vocab) = (2048, 30, 8, 2, 256, 8192, 262_400);
    let (ple_rows, ple_dim, shared, altup, laurel) = (262_144, 256, 10, 4, 64);
    let types: Vec<&str> = (0..layers)
        .map(|i| {
            if i % 5 == 4 {
                "full_attention"
            } else {
                "sliding_attention"
            }
        })
        .collect();
    let sparsity: Vec<f64> = (0..layers)
        .map(|i| if i < 10 { 0.95 } else { 0.0 })
        .collect();
    let config = json!({
        "architectures": ["Gemma3nForCausalLM"],
        "model_type": "gemma3n_text",
        "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "intermediate_size": vec![inter; layers as usize],
        "vocab_size": vocab, "vocab_size_per_layer_input": ple_rows,
        "hidden_size_per_layer_input": ple_dim, "num_kv_shared_layers": shared,
        "altup_num_inputs": altup, "altup_active_idx": 0, "altup_coef_clip": 120.0,
        "altup_correct_scale": true, "laurel_rank": laurel, "layer_types": types,
        "activation_sparsity_pattern": sparsity, "sliding_window": 512,
        "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": true,
        "attention_bias": false,
        "rope_parameters": {
            "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "torch_dtype": "bfloat16",
    });
    let mut m = Synthetic::bf16(config, quant);
    m.linear("model.embed_tokens".into(), &[vocab, h], quant);
    m.linear(
        "model.embed_tokens_per_layer".into(),
        &[ple_rows, layers * ple_dim],
        quant,
    );
    m.linear(
        "model.per_layer_model_projection".into(),
        &[layers * ple_dim, h],
        quant,
    );
    m.dense(
        "model.per_layer_projection_norm.weight".into(),
        &[ple_dim],
        Fill::Ones,
    );
    for name in ["altup_projections", "altup_unembed_projections"] {
        for j in 0..altup - 1 {
            m.linear(format!("model.{name}.{j}"), &[h, h], quant);
        }
    }
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        m.dense(format!("{p}.input_layernorm.weight"), &[h], Fill::Ones);
        m.linear(format!("{p}.self_attn.q_proj"), &[heads * hd, h], quant);
        m.dense(format!("{p}.self_attn.q_norm.weight"), &[hd], Fill::Ones);
        if i < layers - shared {
            m.linear(format!("{p}.self_attn.k_proj"), &[kv * hd, h], quant);
            m.linear(format!("{p}.self_attn.v_proj"), &[kv * hd, h], quant);
            m.dense(format!("{p}.self_attn.k_norm.weight"), &[hd], Fill::Ones);
        }
        m.linear(format!("{p}.self_attn.o_proj"), &[h, heads * hd], quant);
        for norm in [
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_per_layer_input_norm",
        ] {
            m.dense(format!("{p}.{norm}.weight"), &[h], Fill::Ones);
        }
        m.linear(format!("{p}.mlp.gate_proj"), &[inter, h], quant);
        m.linear(format!("{p}.mlp.up_proj"), &[inter, h], quant);
        m.linear(format!("{p}.mlp.down_proj"), &[h, inter], quant);
        let a = format!("{p}.altup");
        m.dense(format!("{a}.correct_output_scale"), &[h], Fill::Ones);
        m.dense(
            format!("{a}.correction_coefs.weight"),
            &[altup, altup],
            Fill::Random,
        );
        m.dense(
            format!("{a}.modality_router.weight"),
            &[altup, h],
            Fill::Random,
        );
        m.dense(
            format!("{a}.prediction_coefs.weight"),
            &[altup * altup, altup],
            Fill::Random,
        );
        m.dense(format!("{a}.router_norm.weight"), &[h], Fill::Ones);
        m.dense(
            format!("{p}.laurel.linear_left.weight"),
            &[laurel, h],
            Fill::Random,
        );
        m.dense(
            format!("{p}.laurel.linear_right.weight"),
            &[h, laurel],
            Fill::Random,
        );
        m.dense(
            format!("{p}.laurel.post_laurel_norm.weight"),
            &[h],
            Fill::Ones,
        );
        m.linear(format!("{p}.per_layer_input_gate"), &[ple_dim, h], quant);
        m.linear(format!("{p}.per_layer_projection"), &[h, ple_dim], quant);
    }
    m.dense("model.norm.weight".into(), &[h], Fill::Ones);
    m
}

/// A Qwen3-MoE-shaped model of about 1 GB at 4-bit: hidden 1024, 16 layers, 16 heads (4 KV,
/// head_dim 128), 64 experts top-8 with moe_intermediate 512, vocab 32000, untied head. Experts
/// in mlx-lm's stacked `switch_mlp` layout; the router `mlp.gate` stays dense bf16 and routes
/// as `routing` says (only the token embedding and the routers differ).
pub fn qwen3_moe(quant: Option<QuantSpec>, routing: Routing) -> Synthetic {
    qwen3_moe_shaped(
        MoeDims {
            hidden: 1024,
            layers: 16,
            heads: 16,
            kv_heads: 4,
            head_dim: 128,
            intermediate: 3072,
            experts: 64,
            top_k: 8,
            moe_intermediate: 512,
            vocab: 32000,
        },
        quant,
        routing,
    )
}

/// A Qwen3-30B-A3B-shaped model (~17 GB at 4-bit g64): hidden 2048, 48 layers, 32 heads (4 KV,
/// head_dim 128), 128 experts top-8 with moe_intermediate 768, vocab 151936, untied head;
/// routed as `routing` says.
pub fn qwen3_30b_a3b(quant: Option<QuantSpec>, routing: Routing) -> Synthetic {
    qwen3_moe_shaped(
        MoeDims {
            hidden: 2048,
            layers: 48,
            heads: 32,
            kv_heads: 4,
            head_dim: 128,
            intermediate: 6144,
            experts: 128,
            top_k: 8,
            moe_intermediate: 768,
            vocab: 151_936,
        },
        quant,
        routing,
    )
}

/// The sizes of a Qwen3-MoE-shaped model.
struct MoeDims {
    hidden: i32,
    layers: i32,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    intermediate: i32,
    experts: i32,
    top_k: i32,
    moe_intermediate: i32,
    vocab: i32,
}

fn qwen3_moe_shaped(d: MoeDims, quant: Option<QuantSpec>, routing: Routing) -> Synthetic {
    let (embedding, router) = match routing {
        Routing::Random => (Fill::Random, Fill::Random),
        Routing::Uniform => (Fill::TokenEmbedding, Fill::Router { beta: 0.0 }),
        Routing::Skewed => (Fill::TokenEmbedding, Fill::Router { beta: BIAS_BETA }),
    };
    let (h, hd, experts, moe_inter, vocab) =
        (d.hidden, d.head_dim, d.experts, d.moe_intermediate, d.vocab);
    let config = json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": h, "num_hidden_layers": d.layers, "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads, "head_dim": hd, "intermediate_size": d.intermediate,
        "num_experts": experts, "num_experts_per_tok": d.top_k,
        "moe_intermediate_size": moe_inter, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": true, "vocab_size": vocab, "tie_word_embeddings": false,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "rope_scaling": null, "hidden_act": "silu", "attention_bias": false,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    });
    let mut m = Synthetic::bf16(config, quant);
    m.linear_filled("model.embed_tokens".into(), &[vocab, h], quant, embedding);
    for i in 0..d.layers {
        let p = format!("model.layers.{i}");
        m.attention(&p, (h, d.heads, d.kv_heads, hd), quant);
        m.dense(format!("{p}.self_attn.q_norm.weight"), &[hd], Fill::Ones);
        m.dense(format!("{p}.self_attn.k_norm.weight"), &[hd], Fill::Ones);
        m.dense(
            format!("{p}.post_attention_layernorm.weight"),
            &[h],
            Fill::Ones,
        );
        m.dense(format!("{p}.mlp.gate.weight"), &[experts, h], router);
        let s = format!("{p}.mlp.switch_mlp");
        m.linear(format!("{s}.gate_proj"), &[experts, moe_inter, h], quant);
        m.linear(format!("{s}.up_proj"), &[experts, moe_inter, h], quant);
        m.linear(format!("{s}.down_proj"), &[experts, h, moe_inter], quant);
    }
    m.dense("model.norm.weight".into(), &[h], Fill::Ones);
    m.linear("lm_head".into(), &[vocab, h], quant);
    m
}

/// A Mamba-2-shaped model (the size of mamba2-130m): hidden 768, 24 layers of SSD mixers with
/// 24 heads × 64 (inner 1536), one group of B/C, d_state 128, conv 4, chunk 256, vocab 50288,
/// tied embeddings. Tensors in transformers' `backbone.*` layout (conv weights `[C, 1, K]`).
pub fn mamba2(quant: Option<QuantSpec>) -> Synthetic {
    let (h, layers, heads, hd, state, vocab) = (768, 24, 24, 64, 128, 50288);
    let inner = heads * hd;
    let conv_dim = inner + 2 * state;
    let config = json!({
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "hidden_size": h, "num_hidden_layers": layers, "num_heads": heads, "head_dim": hd,
        "state_size": state, "n_groups": 1, "expand": 2, "conv_kernel": 4, "chunk_size": 256,
        "intermediate_size": inner, "vocab_size": vocab, "tie_word_embeddings": true,
        "layer_norm_epsilon": 1e-5, "use_bias": false, "use_conv_bias": true,
        "time_step_limit": [0.0, 1e30], "time_step_rank": "auto", "residual_in_fp32": true,
        "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "bfloat16",
    });
    let mut m = Synthetic::bf16(config, quant);
    m.linear("backbone.embeddings".into(), &[vocab, h], quant);
    for i in 0..layers {
        let p = format!("backbone.layers.{i}");
        m.dense(format!("{p}.norm.weight"), &[h], Fill::Ones);
        let x = format!("{p}.mixer");
        m.linear(
            format!("{x}.in_proj"),
            &[inner + conv_dim + heads, h],
            quant,
        );
        m.dense(
            format!("{x}.conv1d.weight"),
            &[conv_dim, 1, 4],
            Fill::Random,
        );
        m.dense(format!("{x}.conv1d.bias"), &[conv_dim], Fill::Random);
        m.dense(format!("{x}.dt_bias"), &[heads], Fill::Random);
        m.dense(format!("{x}.A_log"), &[heads], Fill::Random);
        m.dense(format!("{x}.D"), &[heads], Fill::Ones);
        m.dense(format!("{x}.norm.weight"), &[inner], Fill::Ones);
        m.linear(format!("{x}.out_proj"), &[h, inner], quant);
    }
    m.dense("backbone.norm_f.weight".into(), &[h], Fill::Ones);
    m
}

/// A Jamba-shaped model (a scaled-down Jamba): hidden 1024, 8 layers of which layer 4 attends
/// (16 heads, 8 KV, no rope) and the others are Mamba layers (expand 2, d_state 16, dt_rank 64,
/// conv 4, weighted dt/B/C norms); the odd layers' feed-forward is 8 experts top-2 of width 1024
/// (`feed_forward.switch_mlp`, router dense), the even ones a dense MLP of the same width;
/// vocab 32000, untied head.
pub fn jamba(quant: Option<QuantSpec>) -> Synthetic {
    let (h, layers, heads, kv, vocab) = (1024, 8, 16, 8, 32000);
    // Jamba's dense MLPs and experts share `intermediate_size`.
    let (experts, top_k, expert_inter) = (8, 2, 1024);
    let dense_inter = expert_inter;
    let (inner, state, dt_rank) = (2 * h, 16, 64);
    let config = json!({
        "architectures": ["JambaForCausalLM"],
        "model_type": "jamba",
        "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "intermediate_size": expert_inter,
        "attn_layer_period": 8, "attn_layer_offset": 4,
        "expert_layer_period": 2, "expert_layer_offset": 1,
        "num_experts": experts, "num_experts_per_tok": top_k,
        "mamba_d_state": state, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": dt_rank,
        "mamba_conv_bias": true, "mamba_proj_bias": false, "rms_norm_eps": 1e-6,
        "vocab_size": vocab, "tie_word_embeddings": false, "max_position_embeddings": 262144,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    });
    let mut m = Synthetic::bf16(config, quant);
    m.linear("model.embed_tokens".into(), &[vocab, h], quant);
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        if i % 8 == 4 {
            m.attention(&p, (h, heads, kv, h / heads), quant);
        } else {
            m.dense(format!("{p}.input_layernorm.weight"), &[h], Fill::Ones);
            let x = format!("{p}.mamba");
            m.linear(format!("{x}.in_proj"), &[2 * inner, h], quant);
            m.dense(format!("{x}.conv1d.weight"), &[inner, 1, 4], Fill::Random);
            m.dense(format!("{x}.conv1d.bias"), &[inner], Fill::Random);
            m.linear(format!("{x}.x_proj"), &[dt_rank + 2 * state, inner], quant);
            m.linear(format!("{x}.dt_proj"), &[inner, dt_rank], quant);
            m.dense(format!("{x}.dt_proj.bias"), &[inner], Fill::Random);
            m.dense(format!("{x}.A_log"), &[inner, state], Fill::Random);
            m.dense(format!("{x}.D"), &[inner], Fill::Ones);
            m.dense(format!("{x}.dt_layernorm.weight"), &[dt_rank], Fill::Ones);
            m.dense(format!("{x}.b_layernorm.weight"), &[state], Fill::Ones);
            m.dense(format!("{x}.c_layernorm.weight"), &[state], Fill::Ones);
            m.linear(format!("{x}.out_proj"), &[h, inner], quant);
        }
        m.dense(format!("{p}.pre_ff_layernorm.weight"), &[h], Fill::Ones);
        let f = format!("{p}.feed_forward");
        if i % 2 == 1 {
            m.dense(format!("{f}.router.weight"), &[experts, h], Fill::Random);
            let s = format!("{f}.switch_mlp");
            m.linear(format!("{s}.gate_proj"), &[experts, expert_inter, h], quant);
            m.linear(format!("{s}.up_proj"), &[experts, expert_inter, h], quant);
            m.linear(format!("{s}.down_proj"), &[experts, h, expert_inter], quant);
        } else {
            m.linear(format!("{f}.gate_proj"), &[dense_inter, h], quant);
            m.linear(format!("{f}.up_proj"), &[dense_inter, h], quant);
            m.linear(format!("{f}.down_proj"), &[h, dense_inter], quant);
        }
    }
    m.dense("model.final_layernorm.weight".into(), &[h], Fill::Ones);
    m.linear("lm_head".into(), &[vocab, h], quant);
    m
}

/// A Qwen3-Next-shaped model (scaled down): hidden 1024, 8 layers of which every fourth (3, 7)
/// is gated attention (8 query heads, 2 KV, head 128, rope on a quarter) and the others gated
/// DeltaNet (8 key heads × 64, 16 value heads × 64, conv 4); every layer's feed-forward is 32
/// experts top-4 of width 256 plus a sigmoid-gated shared expert of width 512 (routers dense);
/// vocab 32000, untied head. Tensors in mlx-lm's layout (norms stored as 1 + w, conv weights
/// `[C, K, 1]`, experts in `switch_mlp`), which both engines load as they are.
pub fn qwen3_next(quant: Option<QuantSpec>) -> Synthetic {
    let (h, layers, heads, kv, hd, vocab) = (1024, 8, 8, 2, 128, 32000);
    let (key_heads, key_dim, value_heads, value_dim) = (8, 64, 16, 64);
    let (experts, top_k, expert_inter, shared_inter) = (32, 4, 256, 512);
    let (key_width, value_width) = (key_heads * key_dim, value_heads * value_dim);
    let conv_dim = 2 * key_width + value_width;
    let config = json!({
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "intermediate_size": 2 * expert_inter,
        "full_attention_interval": 4, "partial_rotary_factor": 0.25, "rope_theta": 10000000.0,
        "linear_num_key_heads": key_heads, "linear_key_head_dim": key_dim,
        "linear_num_value_heads": value_heads, "linear_value_head_dim": value_dim,
        "linear_conv_kernel_dim": 4,
        "num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": expert_inter,
        "shared_expert_intermediate_size": shared_inter, "norm_topk_prob": true,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rms_norm_eps": 1e-6, "vocab_size": vocab, "tie_word_embeddings": false,
        "max_position_embeddings": 262144, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    });
    let mut m = Synthetic::bf16(config, quant);
    m.linear("model.embed_tokens".into(), &[vocab, h], quant);
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        if (i + 1) % 4 == 0 {
            m.dense(format!("{p}.input_layernorm.weight"), &[h], Fill::Ones);
            let a = format!("{p}.self_attn");
            m.linear(format!("{a}.q_proj"), &[2 * heads * hd, h], quant);
            m.linear(format!("{a}.k_proj"), &[kv * hd, h], quant);
            m.linear(format!("{a}.v_proj"), &[kv * hd, h], quant);
            m.linear(format!("{a}.o_proj"), &[h, heads * hd], quant);
            m.dense(format!("{a}.q_norm.weight"), &[hd], Fill::Ones);
            m.dense(format!("{a}.k_norm.weight"), &[hd], Fill::Ones);
        } else {
            m.dense(format!("{p}.input_layernorm.weight"), &[h], Fill::Ones);
            let x = format!("{p}.linear_attn");
            m.linear(
                format!("{x}.in_proj_qkvz"),
                &[2 * key_width + 2 * value_width, h],
                quant,
            );
            m.linear(format!("{x}.in_proj_ba"), &[2 * value_heads, h], quant);
            m.dense(
                format!("{x}.conv1d.weight"),
                &[conv_dim, 4, 1],
                Fill::Random,
            );
            m.dense(format!("{x}.dt_bias"), &[value_heads], Fill::Random);
            m.dense(format!("{x}.A_log"), &[value_heads], Fill::Random);
            m.dense(format!("{x}.norm.weight"), &[value_dim], Fill::Ones);
            m.linear(format!("{x}.out_proj"), &[h, value_width], quant);
        }
        m.dense(
            format!("{p}.post_attention_layernorm.weight"),
            &[h],
            Fill::Ones,
        );
        let f = format!("{p}.mlp");
        m.dense(format!("{f}.gate.weight"), &[experts, h], Fill::Random);
        let s = format!("{f}.switch_mlp");
        m.linear(format!("{s}.gate_proj"), &[experts, expert_inter, h], quant);
        m.linear(format!("{s}.up_proj"), &[experts, expert_inter, h], quant);
        m.linear(format!("{s}.down_proj"), &[experts, h, expert_inter], quant);
        let e = format!("{f}.shared_expert");
        m.linear(format!("{e}.gate_proj"), &[shared_inter, h], quant);
        m.linear(format!("{e}.up_proj"), &[shared_inter, h], quant);
        m.linear(format!("{e}.down_proj"), &[h, shared_inter], quant);
        m.dense(
            format!("{f}.shared_expert_gate.weight"),
            &[1, h],
            Fill::Random,
        );
    }
    m.dense("model.norm.weight".into(), &[h], Fill::Ones);
    m.linear("lm_head".into(), &[vocab, h], quant);
    m
}

/// The quantization of module `prefix` per an MLX `quantization` block (per-module overrides,
/// else the defaults).
fn module_spec(q: &Value, prefix: &str) -> Option<QuantSpec> {
    let block = q.get(prefix).filter(|v| v.is_object()).unwrap_or(q);
    let gs = block.get("group_size")?.as_i64()? as i32;
    let bits = block.get("bits")?.as_i64()? as i32;
    Some(QuantSpec::affine(gs, bits))
}

/// Requantizes an MLX affine checkpoint folder to `target` (every quantized matrix is
/// dequantized to float32 and quantized again; other tensors are copied), copying the tokenizer
/// files; `config.json` gets `quantization` and `quantization_config` for `target`.
pub fn requantize(src: &Path, dest: &Path, target: QuantSpec) -> Result<()> {
    let text = std::fs::read_to_string(src.join("config.json"))
        .with_context(|| format!("{}/config.json", src.display()))?;
    let mut config: Value = serde_json::from_str(&text)?;
    let q = config
        .get("quantization")
        .cloned()
        .with_context(|| format!("{}: config.json has no quantization block", src.display()))?;
    let weights = WeightMap::open(src)?;
    let mut out: Vec<(String, Array)> = Vec::new();
    let names: Vec<String> = weights.names().map(str::to_string).collect();
    for name in &names {
        if name.ends_with(".scales") || name.ends_with(".biases") {
            continue;
        }
        let prefix = name.strip_suffix(".weight").unwrap_or(name);
        let scales = format!("{prefix}.scales");
        if name.ends_with(".weight") && weights.contains(&scales) {
            let spec = module_spec(&q, prefix).with_context(|| {
                format!("{prefix}: no group_size/bits in the quantization block")
            })?;
            let biases = format!("{prefix}.biases");
            let b = if weights.contains(&biases) {
                Some(weights.get(&biases)?)
            } else {
                None
            };
            let dense = dequantize(
                &weights.get(name)?,
                &weights.get(&scales)?,
                b.as_ref(),
                spec,
                Some(Dtype::Float32),
            )?;
            let scales_dtype = weights.get(&scales)?.dtype()?;
            let p = dense.quantize(target)?;
            out.push((name.clone(), p.weight));
            out.push((scales, p.scales.astype(scales_dtype)?));
            if let Some(b) = p.biases {
                out.push((biases, b.astype(scales_dtype)?));
            }
        } else {
            out.push((name.clone(), weights.get(name)?));
        }
    }
    let staging = staging_for(dest)?;
    let meta: HashMap<String, String> = [("format".to_string(), "mlx".to_string())].into();
    mlxcel_core::weights::save_safetensors(staging.join("model.safetensors"), &out, Some(meta))?;
    let qj = json!({"group_size": target.group_size, "bits": target.bits, "mode": "affine"});
    if let Some(obj) = config.as_object_mut() {
        obj.insert("quantization".into(), qj.clone());
        obj.insert("quantization_config".into(), qj);
    }
    std::fs::write(
        staging.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "special_tokens_map.json",
    ] {
        if src.join(f).is_file() {
            std::fs::copy(src.join(f), staging.join(f))?;
        }
    }
    publish(&staging, dest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_layouts_have_the_intended_size() {
        let q = Some(QuantSpec::affine(64, 4));
        // 4-bit g64 with bf16 scales and biases: 4.5 bits per weight, norms in bf16.
        let gb = |m: &Synthetic| m.nbytes() as f64 / 1e9;
        assert!(
            (0.6..0.8).contains(&gb(&llama_1b(q))),
            "{}",
            gb(&llama_1b(q))
        );
        assert!((2.4..2.6).contains(&gb(&llama_1b(None))));
        assert!(
            (0.9..1.1).contains(&gb(&qwen3_moe(q, Routing::Random))),
            "{}",
            gb(&qwen3_moe(q, Routing::Random))
        );
        assert!((0.06..0.09).contains(&gb(&mamba2(q))), "{}", gb(&mamba2(q)));
        let big = qwen3_30b_a3b(q, Routing::Skewed);
        assert!((16.5..17.8).contains(&gb(&big)), "{}", gb(&big));
        assert_eq!(big.config["num_experts"], 128);
        assert!((0.11..0.15).contains(&gb(&jamba(q))), "{}", gb(&jamba(q)));
        assert!(
            (0.1..0.3).contains(&gb(&qwen3_next(q))),
            "{}",
            gb(&qwen3_next(q))
        );
        // 2.01 G parameters of per-layer table plus ~2.5 G others, 4-bit g32 (5 bits each).
        let e2b = gemma3n_e2b(Some(QuantSpec::affine(32, 4)));
        assert!((2.6..3.2).contains(&gb(&e2b)), "{}", gb(&e2b));
        let names: Vec<String> = qwen3_moe(q, Routing::Random)
            .layout()
            .into_iter()
            .map(|l| l.0)
            .collect();
        assert!(names.contains(&"model.layers.3.mlp.switch_mlp.down_proj.scales".to_string()));
        assert!(names.contains(&"model.layers.3.mlp.gate.weight".to_string()));
    }

    #[test]
    fn zipf_weights_are_a_seeded_permutation() {
        let a = zipf_weights(64, 1.0, 7);
        assert_eq!(a, zipf_weights(64, 1.0, 7));
        assert_ne!(a, zipf_weights(64, 1.0, 8));
        let mut sorted = a.clone();
        sorted.sort_by(|x, y| y.total_cmp(x));
        for (r, got) in sorted.iter().enumerate() {
            assert!(
                (got - 1.0 / (1.0 + r as f32)).abs() < 1e-6,
                "rank {r}: {got}"
            );
        }
    }
}
