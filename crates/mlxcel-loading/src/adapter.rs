//! LoRA and DoRA adapters, fused into the base weights at load ([`crate::LoadOptions::adapter`],
//! `mlxcel generate --adapter DIR`: `W' = W + scale · ΔW` on the sanitised checkpoint, before the
//! model is built) or kept unfused ([`crate::LoadOptions::runtime_adapters`]).
//!
//! Two formats are read:
//! - mlx-lm: `adapter_config.json` with `fine_tune_type: "lora"` (or `"dora"`) and
//!   `lora_parameters: {rank, scale, ...}`; `adapters.safetensors` with `<module>.lora_a`
//!   `[in, r]` and `<module>.lora_b` `[r, out]`: `ΔW = (lora_a · lora_b)ᵀ`.
//! - PEFT: `adapter_config.json` with `r`, `lora_alpha` (and `use_rslora`);
//!   `adapter_model.safetensors` with `base_model.model.<module>.lora_A.weight` `[r, in]` and
//!   `.lora_B.weight` `[out, r]`: `ΔW = B · A`, scale `lora_alpha / r` (`/ √r` with rsLoRA;
//!   `rank_pattern` / `alpha_pattern` override `r` / `lora_alpha` per module, matched as PEFT
//!   does: the exact module name, else a regex matching a dotted suffix).
//!
//! DoRA (mlx-lm's `<module>.m`, PEFT's `use_dora` with `<module>.lora_magnitude_vector`, both
//! `[out]`): `W' = m / ‖W + scale · ΔW‖ ⊙ (W + scale · ΔW)`, the norm taken per output row.
//!
//! The pairs are fused into the weights ([`Adapter::fuse`]; on a quantized layer only when asked:
//! dequantize, add, requantize with the layer's own mode, bits and group size) or kept unfused as
//! runtime adapters ([`Adapter::runtime_pairs`], see [`mlxcel_arch::nn::lora`]).
//!
//! Stacked MoE experts take mlx-lm's `LoRASwitchLinear` layout: `lora_a` `[E, r, in]`, `lora_b`
//! `[E, out, r]`, `ΔW[e] = lora_b[e] · lora_a[e]`.
//!
//! Token embeddings take PEFT's `lora_embedding_A` `[r, vocab]` / `lora_embedding_B` `[dim, r]`
//! and mlx-lm's `LoRAEmbedding` (`lora_a` `[vocab, r]`, `lora_b` `[r, dim]`): the table changes
//! by `ΔE = (B · A)ᵀ` `[vocab, dim]` (for mlx-lm `lora_a · lora_b`), and a tied output head with
//! it. Output heads built as linear layers (`lm_head`) take the linear layout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mlxcel_arch::nn::lora::LoraPair;
use mlxcel_arch::ModelError;
use mlxcel_core::{Array, Dtype, WeightMap};
use mlxcel_quant::{QuantConfig, QuantizedWeight, TensorQuant};
use serde_json::Value;

use crate::{LoadError, Result};

/// The file layout an adapter came in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterFormat {
    /// mlx-lm (`adapters.safetensors`, `lora_a` `[in, r]`, `lora_b` `[r, out]`).
    MlxLm,
    /// Hugging Face PEFT (`adapter_model.safetensors`, `lora_A` `[r, in]`, `lora_B` `[out, r]`).
    Peft,
}

#[derive(Debug, Clone)]
struct Pair {
    /// The base module, e.g. `model.layers.0.self_attn.q_proj`.
    module: String,
    a: String,
    b: String,
    /// DoRA's magnitude vector `[out]` (mlx-lm's `m`, PEFT's `lora_magnitude_vector`).
    magnitude: Option<String>,
    /// This module's LoRA scale (PEFT's `rank_pattern` / `alpha_pattern` may change it).
    scale: f64,
    /// Known to be an embedding table (PEFT's `lora_embedding_*` names): its delta is `(B·A)ᵀ`.
    embedding: bool,
}

/// The last name component of the token-embedding tables of the registered families, for
/// mlx-lm adapters on a square table (where the shapes cannot tell a table from a linear layer).
const EMBEDDING_MODULES: &[&str] = &[
    "embed_tokens",
    "wte",
    "word_embeddings",
    "tok_embeddings",
    "embed_in",
    "embeddings",
];

/// The tensors of one module while grouping.
#[derive(Default)]
struct Group {
    a: Option<String>,
    b: Option<String>,
    magnitude: Option<String>,
    embedding: bool,
}

/// A LoRA or DoRA adapter read from its folder, ready to fuse or attach at runtime.
#[derive(Debug, Clone)]
pub struct Adapter {
    dir: PathBuf,
    file: PathBuf,
    format: AdapterFormat,
    scale: f64,
    rank: Option<i64>,
    dora: bool,
    pairs: Vec<Pair>,
    tensors: WeightMap,
}

fn num(config: &Value, key: &str) -> Option<f64> {
    config.get(key).and_then(Value::as_f64)
}

/// PEFT's per-module override in `pattern` (`rank_pattern`, `alpha_pattern`) for `module`: an
/// exact name, else a key matching a dotted suffix of it as a regex (PEFT's `get_pattern_key`).
fn pattern_value(pattern: Option<&Value>, module: &str) -> Result<Option<f64>, String> {
    let Some(Value::Object(map)) = pattern else {
        return Ok(None);
    };
    if let Some(v) = map.get(module) {
        return Ok(v.as_f64());
    }
    for (key, v) in map {
        let re = regex::Regex::new(&format!("^(.*\\.)?({key})$"))
            .map_err(|e| format!("pattern `{key}` is not a valid regex: {e}"))?;
        if re.is_match(module) {
            return Ok(v.as_f64());
        }
    }
    Ok(None)
}

impl Adapter {
    /// Reads an adapter folder (mlx-lm or PEFT layout, told apart by `adapter_config.json`).
    /// Errors name the file and key or tensor at fault.
    pub fn load(dir: impl AsRef<Path>) -> Result<Adapter> {
        let dir = dir.as_ref().to_path_buf();
        if !dir.is_dir() {
            return Err(LoadError::file(&dir, "adapter: not a folder"));
        }
        let config_path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&config_path)
            .map_err(|e| LoadError::file(&config_path, format!("adapter config: {e}")))?;
        let config: Value = serde_json::from_str(&text)
            .map_err(|e| LoadError::file(&config_path, format!("invalid JSON: {e}")))?;
        let bad = |msg: String| LoadError::file(&config_path, msg);
        let mlx = config.get("fine_tune_type").is_some() || config.get("lora_parameters").is_some();
        // (format, file, scale, rank, dora, PEFT's lora_alpha and rsLoRA for per-module scales)
        let (format, file, scale, rank, dora, peft) = if mlx {
            let dora = match config.get("fine_tune_type").and_then(Value::as_str) {
                Some("lora") | None => false,
                Some("dora") => true,
                Some(other) => {
                    return Err(bad(format!(
                    "`fine_tune_type` is `{other}`: only `lora` and `dora` adapters are supported"
                )))
                }
            };
            let params = config
                .get("lora_parameters")
                .ok_or_else(|| bad("no `lora_parameters`".into()))?;
            let scale = num(params, "scale")
                .ok_or_else(|| bad("`lora_parameters.scale` is missing or not a number".into()))?;
            let rank = params.get("rank").and_then(Value::as_i64);
            (
                AdapterFormat::MlxLm,
                dir.join("adapters.safetensors"),
                scale,
                rank,
                dora,
                None,
            )
        } else {
            if let Some(t) = config.get("peft_type").and_then(Value::as_str) {
                if t != "LORA" {
                    return Err(bad(format!(
                        "`peft_type` is `{t}`: only LORA adapters (with or without DoRA) are supported"
                    )));
                }
            }
            let dora = config.get("use_dora").and_then(Value::as_bool) == Some(true);
            let r = num(&config, "r")
                .filter(|r| *r > 0.0)
                .ok_or_else(|| bad("`r` is missing or not a positive number (neither an mlx-lm nor a PEFT adapter config?)".into()))?;
            let alpha =
                num(&config, "lora_alpha").ok_or_else(|| bad("`lora_alpha` is missing".into()))?;
            let rslora = config.get("use_rslora").and_then(Value::as_bool) == Some(true);
            let scale = if rslora { alpha / r.sqrt() } else { alpha / r };
            let file = dir.join("adapter_model.safetensors");
            if !file.is_file() && dir.join("adapter_model.bin").is_file() {
                return Err(LoadError::file(
                    dir.join("adapter_model.bin"),
                    "PyTorch pickle adapters are not read: convert to adapter_model.safetensors",
                ));
            }
            (
                AdapterFormat::Peft,
                file,
                scale,
                Some(r as i64),
                dora,
                Some((r, alpha, rslora)),
            )
        };
        if !scale.is_finite() {
            return Err(bad("the LoRA scale is not finite".into()));
        }
        let tensors = WeightMap::open_file(&file)?;
        // Group the tensors into (A, B, magnitude) by module.
        let (a_suffix, b_suffix, m_suffix, what) = match format {
            AdapterFormat::MlxLm => (".lora_a", ".lora_b", ".m", "`lora_a`/`lora_b`/`m`"),
            AdapterFormat::Peft => (
                ".lora_A.weight",
                ".lora_B.weight",
                ".lora_magnitude_vector",
                "`lora_A`/`lora_B` weight or `lora_magnitude_vector`",
            ),
        };
        let mut groups: BTreeMap<String, Group> = BTreeMap::new();
        for name in tensors.names() {
            let rest = match format {
                AdapterFormat::MlxLm => name,
                AdapterFormat::Peft => name.strip_prefix("base_model.model.").unwrap_or(name),
            };
            // PEFT's embedding pair has its own names (parameters, no `.weight`).
            let peft_embedding = |suffix: &str| {
                rest.strip_suffix(suffix)
                    .filter(|_| format == AdapterFormat::Peft)
            };
            let (module, slot, embedding) = if let Some(m) = rest.strip_suffix(a_suffix) {
                (m, 0, false)
            } else if let Some(m) = rest.strip_suffix(b_suffix) {
                (m, 1, false)
            } else if let Some(m) = peft_embedding(".lora_embedding_A") {
                (m, 0, true)
            } else if let Some(m) = peft_embedding(".lora_embedding_B") {
                (m, 1, true)
            } else if let Some(m) = rest.strip_suffix(m_suffix).filter(|_| dora) {
                (m, 2, false)
            } else if rest.ends_with(".base_layer.weight") {
                return Err(LoadError::file(
                    &file,
                    format!("tensor `{name}` is a saved copy of a base layer (peft's `save_embedding_layers`, for a resized vocabulary): not supported; save the adapter with `save_embedding_layers=False`"),
                ));
            } else {
                return Err(LoadError::file(
                    &file,
                    format!("tensor `{name}` is not a LoRA {what} tensor (modules_to_save is not supported)"),
                ));
            };
            let group = groups.entry(module.to_string()).or_default();
            group.embedding |= embedding;
            let entry = match slot {
                0 => &mut group.a,
                1 => &mut group.b,
                _ => &mut group.magnitude,
            };
            *entry = Some(name.to_string());
        }
        let mut pairs = Vec::with_capacity(groups.len());
        for (module, group) in groups {
            let (Some(a), Some(b)) = (group.a.clone(), group.b.clone()) else {
                return Err(LoadError::file(
                    &file,
                    format!(
                        "module `{module}` has no {} tensor",
                        if group.a.is_some() { "B" } else { "A" }
                    ),
                ));
            };
            if dora && group.magnitude.is_none() {
                return Err(LoadError::file(
                    &file,
                    format!(
                        "DoRA module `{module}` has no magnitude tensor (`{module}{m_suffix}`)"
                    ),
                ));
            }
            let scale = match peft {
                None => scale,
                Some((r, alpha, rslora)) => {
                    let r = pattern_value(config.get("rank_pattern"), &module)
                        .map_err(|e| bad(format!("`rank_pattern`: {e}")))?
                        .unwrap_or(r);
                    let alpha = pattern_value(config.get("alpha_pattern"), &module)
                        .map_err(|e| bad(format!("`alpha_pattern`: {e}")))?
                        .unwrap_or(alpha);
                    if rslora {
                        alpha / r.sqrt()
                    } else {
                        alpha / r
                    }
                }
            };
            if !scale.is_finite() {
                return Err(bad(format!("the LoRA scale of `{module}` is not finite")));
            }
            pairs.push(Pair {
                module,
                a,
                b,
                magnitude: group.magnitude,
                scale,
                embedding: group.embedding,
            });
        }
        if pairs.is_empty() {
            return Err(LoadError::file(&file, "the adapter holds no LoRA tensors"));
        }
        Ok(Adapter {
            dir,
            file,
            format,
            scale,
            rank,
            dora,
            pairs,
            tensors,
        })
    }

    /// The adapter folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The layout it was read in.
    pub fn format(&self) -> AdapterFormat {
        self.format
    }

    /// The LoRA scale (mlx-lm's `scale`; PEFT's `lora_alpha / r`, which `rank_pattern` and
    /// `alpha_pattern` may override per module).
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Whether it is a DoRA adapter (mlx-lm `fine_tune_type: dora`, PEFT `use_dora`).
    pub fn is_dora(&self) -> bool {
        self.dora
    }

    /// DoRA's magnitude `[out]` of `pair` in float32, checked against `out`.
    fn magnitude(&self, pair: &Pair, out: i32) -> std::result::Result<Option<Array>, String> {
        let Some(name) = &pair.magnitude else {
            return Ok(None);
        };
        let m = self.tensors.get(name).map_err(|e| e.to_string())?;
        if m.shape() != [out] {
            return Err(format!(
                "magnitude `{name}` has shape {:?}, expected [{out}] (the rows of `{}`)",
                m.shape(),
                pair.b
            ));
        }
        Ok(Some(m.astype(Dtype::Float32).map_err(|e| e.to_string())?))
    }

    /// The adapter file and `pair`'s tensors, for messages.
    fn origin(&self, pair: &Pair) -> String {
        format!(
            "adapter {} tensors `{}` / `{}`",
            self.file.display(),
            pair.a,
            pair.b
        )
    }

    /// `pair` as `A` `[r, in]` and `B` `[out, r]` (PEFT's orientation, whatever the layout) in
    /// `dtype`, contiguous; an error when they are not matrices agreeing on the rank.
    fn low_rank(&self, pair: &Pair, dtype: Dtype) -> std::result::Result<(Array, Array), String> {
        let core = |e: mlxcel_core::Error| e.to_string();
        let a = self.tensors.get(&pair.a).map_err(core)?;
        let b = self.tensors.get(&pair.b).map_err(core)?;
        let (sa, sb) = (a.shape(), b.shape());
        let (a, b, rank_ok) = match (self.format, sa.len(), sb.len()) {
            (AdapterFormat::MlxLm, 2, 2) => {
                (a.t().map_err(core)?, b.t().map_err(core)?, sa[1] == sb[0])
            }
            // mlx-lm's `LoRASwitchLinear` on stacked experts: `lora_a` `[E, r, in]`, `lora_b`
            // `[E, out, r]`, already in `A`/`B` orientation per expert.
            (AdapterFormat::MlxLm, 3, 3) if !self.dora => {
                (a, b, sa[1] == sb[2] && sa[0] == sb[0])
            }
            (AdapterFormat::Peft, 2, 2) => (a, b, sa[0] == sb[1]),
            _ => {
                return Err(format!(
                    "tensors `{}` {sa:?} / `{}` {sb:?} are neither matrices nor (mlx-lm LoRA) expert stacks",
                    pair.a, pair.b
                ))
            }
        };
        if !rank_ok {
            return Err(format!(
                "tensors `{}` {sa:?} and `{}` {sb:?} disagree on the rank",
                pair.a, pair.b
            ));
        }
        let cast = |x: Array| x.astype(dtype).and_then(|x| x.contiguous()).map_err(core);
        Ok((cast(a)?, cast(b)?))
    }

    /// The adapter's low-rank pairs by module, in `dtype`, for runtime use
    /// ([`mlxcel_arch::nn::lora`]): shapes are checked against each linear layer when the model
    /// is built. Errors name the adapter file and tensors.
    pub fn runtime_pairs(&self, dtype: Dtype) -> Result<Vec<(String, LoraPair)>> {
        self.pairs
            .iter()
            .map(|pair| {
                let bad = |msg| LoadError::file(&self.file, msg);
                let (a, b) = self.low_rank(pair, dtype).map_err(bad)?;
                let magnitude = self.magnitude(pair, b.shape()[0]).map_err(bad)?;
                Ok((
                    pair.module.clone(),
                    LoraPair {
                        a,
                        b,
                        scale: pair.scale,
                        magnitude,
                        origin: self.origin(pair),
                    },
                ))
            })
            .collect()
    }

    /// How many linear layers the adapter changes.
    pub fn modules(&self) -> usize {
        self.pairs.len()
    }

    /// One line for the load report: folder, layout, rank and scale.
    pub fn describe(&self) -> String {
        format!(
            "adapter {} ({}{}, rank {}, scale {})",
            self.dir.display(),
            match self.format {
                AdapterFormat::MlxLm => "mlx-lm",
                AdapterFormat::Peft => "PEFT",
            },
            if self.dora { " DoRA" } else { "" },
            self.rank
                .map(|r| r.to_string())
                .unwrap_or_else(|| "?".into()),
            self.scale,
        )
    }

    /// Fuses the adapter into `weights` (sanitised tensor names): `W += scale · ΔW` for every
    /// adapted module, in `W`'s dtype; for DoRA then `W = m / ‖W‖ ⊙ W` row by row. A quantized layer (one with `.scales`; its mode, group
    /// size and bits from `quant`) is refused unless `requantize`: then it is dequantized, the
    /// delta added in float32, and quantized again with the layer's own mode, bits and group
    /// size (mlx-lm's `fuse` without `--dequantize`). Every result is computed and checked
    /// first; `weights` changes only when all fit.
    pub fn fuse(
        &self,
        weights: &mut WeightMap,
        quant: Option<&QuantConfig>,
        requantize: bool,
    ) -> mlxcel_arch::Result<String> {
        let file = self.file.display().to_string();
        let fail = |msg: String| ModelError::Transform(format!("adapter {file}: {msg}"));
        let core = |e: mlxcel_core::Error| fail(e.to_string());
        let mut staged = Vec::with_capacity(self.pairs.len());
        let mut requantized = std::collections::BTreeSet::new();
        for pair in &self.pairs {
            let target = format!("{}.weight", pair.module);
            let Some(info) = weights.info(&target) else {
                return Err(fail(format!(
                    "tensor `{}` adapts `{target}`, which the model does not have (an adapter for another architecture?)",
                    pair.a
                )));
            };
            let info = info.clone();
            let scales_name = format!("{}.scales", pair.module);
            let packed = if weights.contains(&scales_name) || !info.dtype.is_float() {
                if !requantize {
                    return Err(fail(format!(
                        "`{target}` is quantized: fusing needs dequantize-add-requantize (`--lora-fuse`, `LoadOptions::lora_fuse`), or keep the adapter unfused"
                    )));
                }
                let spec = match quant.map(|q| q.for_module(&pair.module)) {
                    Some(TensorQuant::Quantized {
                        mode,
                        group_size,
                        bits,
                    }) => (mode, group_size, bits),
                    _ => {
                        return Err(fail(format!(
                            "`{target}` has `{scales_name}` but config.json does not quantize it"
                        )))
                    }
                };
                let biases_name = format!("{}.biases", pair.module);
                let biases = if weights.contains(&biases_name) {
                    Some(weights.get(&biases_name).map_err(core)?)
                } else {
                    None
                };
                let q = QuantizedWeight::new(
                    &target,
                    weights.get(&target).map_err(core)?,
                    weights.get(&scales_name).map_err(core)?,
                    biases,
                    spec.0,
                    spec.1,
                    spec.2,
                )
                .map_err(|e| fail(e.to_string()))?;
                Some(q)
            } else {
                None
            };
            let (a, b) = self.low_rank(pair, Dtype::Float32).map_err(fail)?;
            // `[.., out, in]` of the delta `B·A` (a leading expert axis for stacks).
            let mut delta_shape = b.shape();
            let out_dim = delta_shape[delta_shape.len() - 2];
            *delta_shape.last_mut().expect("a matrix") = *a.shape().last().expect("a matrix");
            let base_shape = match &packed {
                Some(q) => {
                    let mut s = q.weight.shape();
                    *s.last_mut().expect("a matrix") = q.in_features();
                    s
                }
                None => info.shape.clone(),
            };
            // An embedding table `[vocab, dim]` takes the delta transposed: PEFT says so by
            // name; for mlx-lm the shapes tell, or the module's name on a square table.
            let transposed: Vec<i32> = delta_shape.iter().rev().copied().collect();
            let embedding = delta_shape.len() == 2
                && (pair.embedding
                    || (base_shape == transposed
                        && (base_shape != delta_shape
                            || pair
                                .module
                                .rsplit('.')
                                .next()
                                .is_some_and(|m| EMBEDDING_MODULES.contains(&m)))));
            if embedding && pair.magnitude.is_some() {
                return Err(fail(format!(
                    "`{}`: DoRA on an embedding table is not supported",
                    pair.module
                )));
            }
            let delta_shape = if embedding { transposed } else { delta_shape };
            if base_shape != delta_shape {
                return Err(fail(format!(
                    "tensors `{}` {:?} / `{}` {:?} give a delta of shape {delta_shape:?}, but `{target}` is {base_shape:?} (an adapter for another model?)",
                    pair.a,
                    self.tensors.info(&pair.a).map(|i| i.shape.clone()).unwrap_or_default(),
                    pair.b,
                    self.tensors.info(&pair.b).map(|i| i.shape.clone()).unwrap_or_default(),
                )));
            }
            let delta = b
                .matmul(&a)
                .and_then(|d| d.mul_scalar(pair.scale))
                .and_then(|d| if embedding { d.t() } else { Ok(d) })
                .map_err(core)?;
            let magnitude = self.magnitude(pair, out_dim).map_err(fail)?;
            // W + scale·ΔW in float32, then DoRA's per-row magnitude.
            let adapt = |w32: Array| -> mlxcel_core::Result<Array> {
                let w = w32.add(&delta)?;
                match &magnitude {
                    None => Ok(w),
                    Some(m) => {
                        let norm = w.square()?.sum(&[1], true)?.sqrt()?;
                        w.multiply(&m.expand_dims(&[1])?.divide(&norm)?)
                    }
                }
            };
            match packed {
                None => {
                    let w = weights.get(&target).map_err(core)?;
                    let fused = w
                        .astype(Dtype::Float32)
                        .and_then(adapt)
                        .and_then(|f| f.astype(info.dtype))
                        .map_err(core)?;
                    staged.push((target, fused));
                }
                Some(q) => {
                    let scales_dtype = q.scales.dtype().map_err(core)?;
                    let fused = q
                        .dequantize(Dtype::Float32)
                        .and_then(adapt)
                        .and_then(|w| w.quantize(q.spec))
                        .map_err(core)?;
                    // Affine scales and biases go back to the dtype they were stored in.
                    let restore = |a: Array| -> mlxcel_arch::Result<Array> {
                        if a.dtype().map_err(core)?.is_float() {
                            a.astype(scales_dtype).map_err(core)
                        } else {
                            Ok(a)
                        }
                    };
                    staged.push((target, fused.weight));
                    staged.push((scales_name, restore(fused.scales)?));
                    if let Some(biases) = fused.biases {
                        staged.push((format!("{}.biases", pair.module), restore(biases)?));
                    }
                    requantized.insert(format!(
                        "{} {}-bit g{}",
                        q.spec.mode.name(),
                        q.spec.bits,
                        q.spec.group_size
                    ));
                }
            }
        }
        let n = self.pairs.len();
        for (name, array) in staged {
            weights.insert(name, array)?;
        }
        let how = if requantized.is_empty() {
            String::new()
        } else {
            format!(
                " (dequantized, added and requantized at the layers' own {})",
                requantized.into_iter().collect::<Vec<_>>().join(", ")
            )
        };
        Ok(format!(
            "{}: fused into {n} layer{}{how}",
            self.describe(),
            if n == 1 { "" } else { "s" }
        ))
    }
}
