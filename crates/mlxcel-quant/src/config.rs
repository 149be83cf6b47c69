//! The `quantization` block of an MLX checkpoint's `config.json`, as mlx-lm writes it:
//! defaults (`group_size`, `bits`, `mode`) plus per-module overrides keyed by the module path
//! (`"model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}`), or `false` for a module left
//! dense.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::{QuantError, QuantMode, Result};

/// How one module is stored, as the config declares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorQuant {
    /// Left unquantized (`false` in the config): a plain float weight.
    Dense,
    /// Quantized with these parameters.
    Quantized {
        /// The format.
        mode: QuantMode,
        /// Elements per scale along the input axis.
        group_size: i32,
        /// Bits per element.
        bits: i32,
    },
}

/// The checkpoint-wide quantization defaults and per-module overrides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantConfig {
    /// The default format (`mode`; `affine` when absent).
    pub mode: QuantMode,
    /// The default group size (`group_size`; 64 when absent, fixed by the fp modes).
    pub group_size: i32,
    /// The default bit width (`bits`; 4 when absent, fixed by the fp modes).
    pub bits: i32,
    /// Per-module settings keyed by module path (without `.weight`), overriding the defaults.
    pub overrides: BTreeMap<String, TensorQuant>,
}

fn int_field(obj: &serde_json::Map<String, Value>, key: &str, field: &str) -> Result<Option<i32>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_i64()
            .and_then(|x| i32::try_from(x).ok())
            .map(Some)
            .ok_or_else(|| QuantError::Config {
                field: format!("{field}.{key}"),
                message: format!("expected an integer, found {v}"),
            }),
    }
}

fn mode_field(obj: &serde_json::Map<String, Value>, field: &str) -> Result<Option<QuantMode>> {
    match obj.get("mode") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => {
            QuantMode::from_name(s)
                .map(Some)
                .ok_or_else(|| QuantError::Config {
                    field: format!("{field}.mode"),
                    message: format!(
                        "unknown quantization mode `{s}` (affine, mxfp4, mxfp8, nvfp4)"
                    ),
                })
        }
        Some(v) => Err(QuantError::Config {
            field: format!("{field}.mode"),
            message: format!("expected a string, found {v}"),
        }),
    }
}

impl QuantConfig {
    /// Reads `quantization` (or `quantization_config`, which mlx-lm writes as a copy) from a
    /// config. `Ok(None)` when the checkpoint is not MLX-quantized. Vendor blocks with a
    /// `quant_method` (fp8, gptq, awq, ...) are not MLX layouts and are refused here with the
    /// method's name unless handled by a dedicated importer; `mxfp4` (gpt-oss) is MLX's mxfp4
    /// for every tensor stored with scales.
    pub fn from_config(config: &Value) -> Result<Option<QuantConfig>> {
        let (field, block) = match (
            config.get("quantization"),
            config.get("quantization_config"),
        ) {
            (Some(b), _) if !b.is_null() => ("quantization", b),
            (_, Some(b)) if !b.is_null() => ("quantization_config", b),
            _ => return Ok(None),
        };
        let obj = block.as_object().ok_or_else(|| QuantError::Config {
            field: field.into(),
            message: "expected an object".into(),
        })?;
        if let Some(method) = obj.get("quant_method").and_then(Value::as_str) {
            if method == "mxfp4" {
                // OpenAI's MXFP4 checkpoints (gpt-oss): the experts' `*_blocks` (two E2M1 codes
                // per byte, low nibble first) and `*_scales` (E8M0, one per 32 inputs) are MLX's
                // mxfp4 layout once the blocks are read as uint32 (the architecture's sanitiser
                // renames them); every tensor without scales stays dense.
                return Ok(Some(QuantConfig {
                    mode: QuantMode::Mxfp4,
                    group_size: 32,
                    bits: 4,
                    overrides: BTreeMap::new(),
                }));
            }
            return Err(QuantError::Config {
                field: format!("{field}.quant_method"),
                message: format!("`{method}` checkpoints are not MLX-quantized and are not supported by this loader"),
            });
        }
        let mode = mode_field(obj, field)?.unwrap_or(QuantMode::Affine);
        let (fixed_group, fixed_bits) = mode.fixed_layout().unwrap_or((64, 4));
        let group_size = int_field(obj, "group_size", field)?.unwrap_or(fixed_group);
        let bits = int_field(obj, "bits", field)?.unwrap_or(fixed_bits);
        let mut overrides = BTreeMap::new();
        for (key, value) in obj {
            let entry_field = format!("{field}.{key}");
            let quant = match value {
                Value::Bool(false) => TensorQuant::Dense,
                Value::Bool(true) => TensorQuant::Quantized {
                    mode,
                    group_size,
                    bits,
                },
                Value::Object(o) => {
                    let m = mode_field(o, &entry_field)?.unwrap_or(mode);
                    let (fg, fb) = m.fixed_layout().unwrap_or((group_size, bits));
                    TensorQuant::Quantized {
                        mode: m,
                        group_size: int_field(o, "group_size", &entry_field)?.unwrap_or(fg),
                        bits: int_field(o, "bits", &entry_field)?.unwrap_or(fb),
                    }
                }
                // The scalar defaults themselves.
                _ => continue,
            };
            overrides.insert(key.clone(), quant);
        }
        Ok(Some(QuantConfig {
            mode,
            group_size,
            bits,
            overrides,
        }))
    }

    /// What the config says about the module at `path` (e.g. `model.layers.0.mlp.gate_proj`).
    pub fn for_module(&self, path: &str) -> TensorQuant {
        self.overrides
            .get(path)
            .copied()
            .unwrap_or(TensorQuant::Quantized {
                mode: self.mode,
                group_size: self.group_size,
                bits: self.bits,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_mxfp4_checkpoints_read_as_mlx_mxfp4() {
        // gpt-oss's block, as the hub ships it.
        let cfg = serde_json::json!({"quantization_config": {
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4"}});
        let q = QuantConfig::from_config(&cfg).unwrap().unwrap();
        assert_eq!((q.mode, q.group_size, q.bits), (QuantMode::Mxfp4, 32, 4));
        assert!(q.overrides.is_empty());
        // Other vendor methods are still refused by name.
        let gptq = serde_json::json!({"quantization_config": {"quant_method": "gptq"}});
        let err = QuantConfig::from_config(&gptq).unwrap_err().to_string();
        assert!(
            err.contains("quant_method") && err.contains("gptq"),
            "{err}"
        );
    }
}
