//! LoRA adapters fused into the base weights at load ([`crate::LoadOptions::adapter`],
//! `mlxcel generate --adapter DIR`): `W' = W + scale · ΔW` on the sanitised checkpoint, before
//! the model is built.
//!
//! Two formats are read:
//! - mlx-lm: `adapter_config.json` with `fine_tune_type: "lora"` and
//!   `lora_parameters: {rank, scale, ...}`; `adapters.safetensors` with `<module>.lora_a`
//!   `[in, r]` and `<module>.lora_b` `[r, out]`: `ΔW = (lora_a · lora_b)ᵀ`.
//! - PEFT: `adapter_config.json` with `r`, `lora_alpha` (and `use_rslora`);
//!   `adapter_model.safetensors` with `base_model.model.<module>.lora_A.weight` `[r, in]` and
//!   `.lora_B.weight` `[out, r]`: `ΔW = B · A`, scale `lora_alpha / r` (`/ √r` with rsLoRA).
//!
//! The pairs are fused into the weights ([`Adapter::fuse`]; on a quantized layer only when asked:
//! dequantize, add, requantize with the layer's own mode, bits and group size) or kept unfused as
//! runtime adapters ([`Adapter::runtime_pairs`], see [`mlxcel_arch::nn::lora`]).
//!
//! Not yet: DoRA, adapters on MoE experts, embeddings.

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
}

/// A LoRA adapter read from its folder, ready to fuse.
#[derive(Debug, Clone)]
pub struct Adapter {
    dir: PathBuf,
    file: PathBuf,
    format: AdapterFormat,
    scale: f64,
    rank: Option<i64>,
    pairs: Vec<Pair>,
    tensors: WeightMap,
}

fn num(config: &Value, key: &str) -> Option<f64> {
    config.get(key).and_then(Value::as_f64)
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
        let (format, file, scale, rank) = if mlx {
            match config.get("fine_tune_type").and_then(Value::as_str) {
                Some("lora") | None => {}
                Some("dora") => return Err(bad("DoRA adapters are not supported yet".into())),
                Some(other) => {
                    return Err(bad(format!(
                        "`fine_tune_type` is `{other}`: only `lora` adapters can be fused"
                    )))
                }
            }
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
            )
        } else {
            if let Some(t) = config.get("peft_type").and_then(Value::as_str) {
                if t != "LORA" {
                    return Err(bad(format!(
                        "`peft_type` is `{t}`: only LORA adapters can be fused"
                    )));
                }
            }
            if config.get("use_dora").and_then(Value::as_bool) == Some(true) {
                return Err(bad("DoRA adapters are not supported yet".into()));
            }
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
            (AdapterFormat::Peft, file, scale, Some(r as i64))
        };
        if !scale.is_finite() {
            return Err(bad("the LoRA scale is not finite".into()));
        }
        let tensors = WeightMap::open_file(&file)?;
        // Group the tensors into (A, B) pairs by module.
        let mut groups: BTreeMap<String, (Option<String>, Option<String>)> = BTreeMap::new();
        for name in tensors.names() {
            let (module, is_a) = match format {
                AdapterFormat::MlxLm => {
                    if let Some(m) = name.strip_suffix(".lora_a") {
                        (m.to_string(), true)
                    } else if let Some(m) = name.strip_suffix(".lora_b") {
                        (m.to_string(), false)
                    } else {
                        return Err(LoadError::file(
                            &file,
                            format!("tensor `{name}` is not a LoRA `lora_a`/`lora_b` tensor (only LoRA adapters are supported)"),
                        ));
                    }
                }
                AdapterFormat::Peft => {
                    let rest = name.strip_prefix("base_model.model.").unwrap_or(name);
                    if let Some(m) = rest.strip_suffix(".lora_A.weight") {
                        (m.to_string(), true)
                    } else if let Some(m) = rest.strip_suffix(".lora_B.weight") {
                        (m.to_string(), false)
                    } else {
                        return Err(LoadError::file(
                            &file,
                            format!("tensor `{name}` is not a LoRA `lora_A`/`lora_B` weight (DoRA, modules_to_save and embedding adapters are not supported yet)"),
                        ));
                    }
                }
            };
            let entry = groups.entry(module).or_default();
            if is_a {
                entry.0 = Some(name.to_string());
            } else {
                entry.1 = Some(name.to_string());
            }
        }
        let mut pairs = Vec::with_capacity(groups.len());
        for (module, (a, b)) in groups {
            match (a, b) {
                (Some(a), Some(b)) => pairs.push(Pair { module, a, b }),
                (a, _) => {
                    return Err(LoadError::file(
                        &file,
                        format!(
                            "module `{module}` has no {} tensor",
                            if a.is_some() { "B" } else { "A" }
                        ),
                    ))
                }
            }
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

    /// The LoRA scale (mlx-lm's `scale`; PEFT's `lora_alpha / r`).
    pub fn scale(&self) -> f64 {
        self.scale
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
        if sa.len() != 2 || sb.len() != 2 {
            return Err(format!(
                "tensors `{}` {sa:?} / `{}` {sb:?} are not matrices (adapters on MoE experts are not supported yet)",
                pair.a, pair.b
            ));
        }
        let (a, b, rank_ok) = match self.format {
            AdapterFormat::MlxLm => (a.t().map_err(core)?, b.t().map_err(core)?, sa[1] == sb[0]),
            AdapterFormat::Peft => (a, b, sa[0] == sb[1]),
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
                let (a, b) = self
                    .low_rank(pair, dtype)
                    .map_err(|msg| LoadError::file(&self.file, msg))?;
                Ok((
                    pair.module.clone(),
                    LoraPair {
                        a,
                        b,
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
            "adapter {} ({}, rank {}, scale {})",
            self.dir.display(),
            match self.format {
                AdapterFormat::MlxLm => "mlx-lm",
                AdapterFormat::Peft => "PEFT",
            },
            self.rank
                .map(|r| r.to_string())
                .unwrap_or_else(|| "?".into()),
            self.scale,
        )
    }

    /// Fuses the adapter into `weights` (sanitised tensor names): `W += scale · ΔW` for every
    /// adapted module, in `W`'s dtype. A quantized layer (one with `.scales`; its mode, group
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
            let (out_dim, in_dim) = (b.shape()[0], a.shape()[1]);
            let base_shape = match &packed {
                Some(q) => vec![q.weight.dim(0).map_err(core)?, q.in_features()],
                None => info.shape.clone(),
            };
            if base_shape != [out_dim, in_dim] {
                return Err(fail(format!(
                    "tensors `{}` {:?} / `{}` {:?} give a delta of shape [{out_dim}, {in_dim}], but `{target}` is {base_shape:?} (an adapter for another model?)",
                    pair.a,
                    self.tensors.info(&pair.a).map(|i| i.shape.clone()).unwrap_or_default(),
                    pair.b,
                    self.tensors.info(&pair.b).map(|i| i.shape.clone()).unwrap_or_default(),
                )));
            }
            let delta = b
                .matmul(&a)
                .and_then(|d| d.mul_scalar(self.scale))
                .map_err(core)?;
            match packed {
                None => {
                    let w = weights.get(&target).map_err(core)?;
                    let fused = w
                        .astype(Dtype::Float32)
                        .and_then(|w32| w32.add(&delta))
                        .and_then(|f| f.astype(info.dtype))
                        .map_err(core)?;
                    staged.push((target, fused));
                }
                Some(q) => {
                    let scales_dtype = q.scales.dtype().map_err(core)?;
                    let fused = q
                        .dequantize(Dtype::Float32)
                        .and_then(|w| w.add(&delta))
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
