//! `--estimate-memory`: what a run will hold — weights by role and dtype, the KV cache for the
//! requested context, a transient allowance — against the device's memory.

use std::collections::BTreeMap;
use std::path::Path;

use mlxcel_core::{Device, Dtype, WeightMap};
use serde_json::Value;

use crate::Result;

/// The role of a tensor, from its name (the recipe and report vocabulary). Roles ending in
/// `(unused)` are parts a text-only load leaves out (an MTP block, a vision tower).
pub fn tensor_role(name: &str) -> &'static str {
    // GPT-NeoX names its tables `embed_in` / `embed_out`, GPT-2-style checkpoints (EXAONE 3)
    // their norms `ln_1` / `ln_2` / `ln_f`. Parts of a checkpoint a text model leaves out of its
    // forward pass are named as such.
    if name.starts_with("mtp.") {
        "mtp (unused)"
    } else if [
        "audio_tower.",
        "embed_audio.",
        "model.audio_tower.",
        "model.embed_audio.",
    ]
    .iter()
    .any(|p| name.starts_with(p))
    {
        "audio (unused)"
    } else if [
        "vision_tower.",
        "multi_modal_projector.",
        "embed_vision.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
        "model.embed_vision.",
        // Qwen2-VL / Qwen2.5-VL's tower and merger (hub and transformers 5 layouts)
        "visual.",
        "model.visual.",
        // Idefics3 / SmolVLM's tower and connector
        "vision_model.",
        "connector.",
        "model.vision_model.",
        "model.connector.",
    ]
    .iter()
    .any(|p| name.starts_with(p))
    {
        "vision (unused)"
    } else if name.contains("embed_tokens_per_layer") {
        // Gemma 3n's per-layer embedding table (the largest tensor of its checkpoints).
        "per-layer embed"
    } else if name.contains("embed_tokens") || name.contains("wte") || name.contains("embed_in.") {
        "embedding"
    } else if name.starts_with("lm_head")
        || name.starts_with("language_model.lm_head")
        || name.contains("embed_out.")
    {
        "lm_head"
    } else if name.contains("norm") || name.contains(".ln_") {
        "norm"
    } else if name.contains("shared_expert") {
        "shared expert"
    } else if name.contains("switch_mlp") || name.contains(".experts.") {
        "routed experts"
    } else if name.ends_with("mlp.gate.weight")
        || name.contains("block_sparse_moe.gate")
        || name.contains(".router")
    {
        "router"
    } else if name.contains("self_attn") || name.contains("attention") {
        "attention"
    } else if name.contains("mlp") || name.contains("feed_forward") {
        "dense mlp"
    } else {
        "other"
    }
}

/// A memory budget for one run.
#[derive(Debug, Clone)]
pub struct MemoryEstimate {
    /// Bytes by (role, stored dtype) as loaded (float tensors at the compute dtype).
    pub weights: BTreeMap<(String, String), u64>,
    /// KV-cache bytes for the requested context (rounded up to the caches' 256-position growth
    /// step; sliding-window layers count their window plus one chunk).
    pub kv_cache: u64,
    /// Cache bytes one more position costs over all layers, as the model's layer schedule says
    /// (latent attention keeps far less than `2 · kv_heads · head_dim` per layer).
    pub kv_bytes_per_token: u64,
    /// Allowance for transient buffers of one prefill chunk: its logits, the widest layer's
    /// activations and attention scores.
    pub transient: u64,
    /// Slot arenas of streamed routed experts (0 when experts are resident).
    pub expert_arena: u64,
    /// A vision-language model's vision tower and projector (at the compute dtype): not in
    /// `weights` or the total, since they stay on disk until the first image (then they are
    /// resident too). 0 for text models and text-only loads.
    pub vision_tower_lazy: u64,
    /// What an external per-layer-embedding table holds in memory: its row cache, or the
    /// table in `MLXCEL_PLE_IO=ram` mode (0 when the table is resident and counted among the
    /// weights).
    pub ple_rows: u64,
    /// The device the run uses (MLX's default device).
    pub device: Device,
    /// The device's (or, for the CPU, the system's) memory.
    pub available: Option<u64>,
}

impl MemoryEstimate {
    /// Bytes of all weights.
    pub fn weight_bytes(&self) -> u64 {
        self.weights.values().fold(0, |a, b| a.saturating_add(*b))
    }

    /// All of it (saturating: a huge context reports "does not fit", never wraps).
    pub fn total(&self) -> u64 {
        self.weight_bytes()
            .saturating_add(self.kv_cache)
            .saturating_add(self.transient)
            .saturating_add(self.expert_arena)
            .saturating_add(self.ple_rows)
    }

    /// Whether the run fits, leaving 10% of the device for the system and MLX's allocator.
    pub fn fits(&self) -> bool {
        self.available
            .is_none_or(|a| self.total() as f64 <= a as f64 * 0.9)
    }
}

/// Memory of the default device (for the CPU backend: the system's), if known.
pub fn available_memory() -> Result<Option<u64>> {
    Ok(match mlxcel_core::default_device()?.memory_bytes()? {
        Some(b) => Some(b as u64),
        None => system_memory(),
    })
}

fn system_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = text
        .lines()
        .find(|l| l.starts_with("MemTotal:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

fn num(config: &Value, key: &str) -> Option<u64> {
    config.get(key).and_then(Value::as_u64)
}

/// Estimates a run of `context` tokens with prefill chunks of `chunk` positions over the model
/// in `folder` computed in `dtype`.
pub fn estimate(
    folder: &Path,
    config: &Value,
    dtype: Dtype,
    context: u64,
    chunk: u64,
) -> Result<MemoryEstimate> {
    estimate_rank(folder, config, dtype, context, chunk, &RankPart::WHOLE)
}

/// One rank's part of a model spread over several processes (see
/// [`mlxcel_arch::parallel`]), for [`estimate_rank`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPart {
    /// Pipeline parallelism (contiguous layers per rank) rather than tensor parallelism.
    pub pipeline: bool,
    /// The rank.
    pub rank: usize,
    /// The number of ranks.
    pub size: usize,
    /// Pipeline parallelism: layers per rank (`None`: as even as possible).
    pub layers_per_rank: Option<Vec<usize>>,
}

impl RankPart {
    /// The whole model in one process.
    pub const WHOLE: RankPart = RankPart {
        pipeline: false,
        rank: 0,
        size: 1,
        layers_per_rank: None,
    };

    /// This rank's layers of a model of `layers` layers (all of them under tensor
    /// parallelism).
    fn layers(&self, layers: usize) -> Result<std::ops::Range<usize>> {
        if !self.pipeline {
            return Ok(0..layers);
        }
        let counts = self.layers_per_rank.as_deref();
        Ok(mlxcel_arch::parallel::stage_layers(
            layers, self.size, self.rank, counts,
        )?)
    }

    /// The layer index in a tensor name (`model.layers.N.…`), if any.
    fn layer_of(name: &str) -> Option<usize> {
        let rest = &name[name.find("layers.")? + "layers.".len()..];
        rest.split('.').next()?.parse().ok()
    }

    /// This rank's bytes of tensor `name` (of role `role`, `bytes` in all) when it holds layers
    /// `range` of a model whose head is tied to the embedding when `tied`: tensor parallelism
    /// splits attention, MLP, expert and untied head weights (rounded up: the first ranks take one unit
    /// more) and replicates the rest; pipeline parallelism keeps the tensors of the rank's
    /// layers, the embedding on the first rank (and the last, for a tied head), the head and
    /// final norm on the last.
    fn share(
        &self,
        name: &str,
        role: &str,
        bytes: u64,
        range: &std::ops::Range<usize>,
        tied: bool,
    ) -> u64 {
        if self.size <= 1 {
            return bytes;
        }
        let size = self.size as u64;
        if !self.pipeline {
            return match role {
                "attention" | "dense mlp" | "shared expert" | "routed experts" | "lm_head" => {
                    bytes.div_ceil(size)
                }
                _ => bytes,
            };
        }
        let (first, last) = (self.rank == 0, self.rank + 1 == self.size);
        let keep = match (Self::layer_of(name), role) {
            (Some(l), _) => range.contains(&l),
            (None, "embedding") => first || (last && tied),
            (None, "lm_head" | "norm") => last,
            (None, _) => first,
        };
        if keep {
            bytes
        } else {
            0
        }
    }
}

/// [`estimate`] of one rank's part of a model spread over several processes.
pub fn estimate_rank(
    folder: &Path,
    config: &Value,
    dtype: Dtype,
    context: u64,
    chunk: u64,
    part: &RankPart,
) -> Result<MemoryEstimate> {
    let weights = WeightMap::open(folder)?;
    let model_type = mlxcel_arch::detection::get_model_type(config, false)?;
    let schedule = mlxcel_arch::cache_schedule(model_type, config)?;
    let tied = !weights.names().any(|n| tensor_role(n) == "lm_head");
    let own = part.layers(schedule.len())?;
    // A vision-language checkpoint loaded with its tower keeps it on disk until the first image.
    let has_vision = weights.names().any(|n| tensor_role(n) == "vision (unused)");
    let lazy_tower = matches!(
        model_type.descriptor().directory_route,
        mlxcel_arch::DirectoryRoute::Vlm | mlxcel_arch::DirectoryRoute::Mistral3Dynamic
    ) && !mlxcel_arch::detection::is_text_only(config, has_vision);
    let mut vision_tower_lazy = 0u64;
    let mut by_role: BTreeMap<(String, String), u64> = BTreeMap::new();
    for name in weights.names() {
        let Some(info) = weights.info(name) else {
            continue;
        };
        if lazy_tower && tensor_role(name) == "vision (unused)" {
            let bytes = if info.dtype.is_float() {
                info.numel() * dtype.size_of()
            } else {
                info.nbytes()
            };
            vision_tower_lazy = vision_tower_lazy.saturating_add(bytes as u64);
            continue;
        }
        // What the load leaves out is never held.
        if tensor_role(name).ends_with("(unused)") {
            continue;
        }
        // Float tensors are held at the compute dtype; packed planes as stored.
        let quantized_plane = name.ends_with(".scales")
            || name.ends_with(".biases")
            || weights.contains(&format!("{}.scales", name.trim_end_matches(".weight")));
        let (label, bytes) = if info.dtype.is_float() && !quantized_plane {
            (
                dtype.name().to_string(),
                (info.numel() * dtype.size_of()) as u64,
            )
        } else {
            (info.stored_dtype.to_lowercase(), info.nbytes() as u64)
        };
        let role = tensor_role(name);
        let bytes = part.share(name, role, bytes, &own, tied);
        if bytes == 0 {
            continue;
        }
        let slot = by_role.entry((role.to_string(), label)).or_default();
        *slot = slot.saturating_add(bytes);
    }
    // A vision-language config keeps the decoder's widths in `text_config`.
    let text = config
        .get("text_config")
        .filter(|t| t.is_object())
        .unwrap_or(config);
    let heads = num(text, "num_attention_heads").unwrap_or(1).max(1);
    let hidden = num(text, "hidden_size").unwrap_or(0);
    // The model's own cache schedule: what each layer keeps per position, and how many
    // positions (sliding-window rings hold at most window + chunk rows).
    // A rank holds its own layers' caches (pipeline) or its heads' share of each (tensor).
    let schedule: Vec<_> = schedule
        .into_iter()
        .enumerate()
        .filter(|(i, _)| own.contains(i))
        .map(|(_, k)| k)
        .collect();
    let kv_share = |bytes: u64| match part.pipeline {
        true => bytes,
        false => bytes.div_ceil(part.size.max(1) as u64),
    };
    let kv_bytes_per_token: u64 = kv_share(schedule.iter().map(|k| k.bytes_per_token(dtype)).sum());
    // Growth happens in steps of 256 positions.
    let rows = context.saturating_add(255) / 256 * 256;
    let kv_cache = schedule
        .iter()
        .map(|k| {
            k.bytes_per_token(dtype)
                .saturating_mul(k.rows_held(rows, chunk))
                // Recurrent layers: a fixed-size window and state instead.
                .saturating_add(k.fixed_bytes(dtype))
        })
        .fold(0u64, u64::saturating_add);
    let kv_cache = kv_share(kv_cache);
    let vocab = num(text, "vocab_size").unwrap_or(0);
    let inter = num(text, "intermediate_size")
        .unwrap_or(hidden.saturating_mul(4))
        .max(num(text, "moe_intermediate_size").unwrap_or(0));
    let f = dtype.size_of() as u64;
    // Logits of one chunk (f32), a few activations of the widest layer, attention scores.
    let transient = chunk
        .saturating_mul(vocab.saturating_mul(4))
        .saturating_add(
            chunk
                .saturating_mul(4)
                .saturating_mul(inter.max(hidden))
                .saturating_mul(f),
        )
        .saturating_add(
            heads
                .saturating_mul(chunk)
                .saturating_mul(context)
                .saturating_mul(f),
        );
    let device = mlxcel_core::default_device()?;
    let available = available_memory()?;
    // Streamed routed experts are not resident: the arena holds them instead.
    let mut expert_arena = 0;
    let stream = mlxcel_stream::StreamConfig::from_env()?;
    if let Some(plan) = crate::stream::plan(folder, config, &stream, available)? {
        by_role.retain(|(role, _), _| role != "routed experts");
        expert_arena = plan.arena_bytes();
    }
    // An external per-layer-embedding table stays on disk: its cache (or, in `ram` mode, the
    // table) counts instead.
    let policy = mlxcel_core::RuntimePolicy::from_env()?;
    let mut ple_rows = 0;
    if let Some((resident, _on_disk)) = crate::ple::footprint(folder, config, &policy)? {
        by_role.retain(|(role, _), _| role != "per-layer embed");
        ple_rows = resident;
    }
    Ok(MemoryEstimate {
        ple_rows,
        weights: by_role,
        kv_cache,
        kv_bytes_per_token,
        transient,
        expert_arena,
        vision_tower_lazy,
        device,
        available,
    })
}

#[cfg(test)]
mod tests {
    use super::tensor_role;

    #[test]
    fn roles_of_gpt_style_names() {
        for (name, role) in [
            ("gpt_neox.embed_in.weight", "embedding"),
            ("embed_out.weight", "lm_head"),
            ("model.embed_out.scales", "lm_head"),
            ("transformer.h.0.ln_1.weight", "norm"),
            ("transformer.ln_f.weight", "norm"),
            (
                "gpt_neox.layers.0.attention.query_key_value.weight",
                "attention",
            ),
            ("model.layers.0.mlp.act_fn.alpha_p", "dense mlp"),
            (
                "model.language_model.embed_tokens_per_layer.weight",
                "per-layer embed",
            ),
            (
                "model.audio_tower.conformer.0.norm.weight",
                "audio (unused)",
            ),
            ("model.language_model.embed_tokens.weight", "embedding"),
            ("model.embed_audio.embedding.weight", "audio (unused)"),
            ("model.embed_vision.embedding.weight", "vision (unused)"),
        ] {
            assert_eq!(tensor_role(name), role, "{name}");
        }
    }
}
