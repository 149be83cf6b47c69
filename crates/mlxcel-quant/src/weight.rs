//! [`QuantizedWeight`]: the planes of one quantized matrix (or stack of expert matrices) and the
//! checks that make a malformed layout an error naming the tensor.

use mlxcel_core::cuda_kernels::{self, GemvInput};
use mlxcel_core::ops::{self, QuantMode, QuantSpec};
use mlxcel_core::{Array, Dtype};

use crate::{QuantError, Result};

/// A quantized matrix `[.., out, in]` stored as MLX packs it: `weight` `[.., out, in * bits / 32]`
/// (uint32), `scales` `[.., out, in / group_size]`, and `biases` like scales for affine.
#[derive(Debug, Clone)]
pub struct QuantizedWeight {
    /// Packed elements, `uint32` `[.., out, in * bits / 32]`.
    pub weight: Array,
    /// One scale per group, `[.., out, in / group_size]`.
    pub scales: Array,
    /// One bias per group, shaped like `scales`; present for affine only.
    pub biases: Option<Array>,
    /// Mode, group size and bit width of the planes.
    pub spec: QuantSpec,
}

/// Infers the bit width of an affine tensor from its shapes: MLX packs `in` values of `bits`
/// bits into `packed_in` uint32 words, so `packed_in * 32 == bits * num_groups * group_size`.
/// The inferred width wins over `caller_bits` (mixed 4/8-bit checkpoints without per-layer
/// overrides); `group_size` is trusted, since the scales count fixes `in` only together with it.
/// Returns an error naming `tensor` when no width 1..=8 fits.
pub fn infer_quantization_bits(
    tensor: &str,
    weight_shape: &[i32],
    scales_shape: &[i32],
    group_size: i32,
    caller_bits: i32,
) -> Result<i32> {
    let layout = |message: String| QuantError::Layout {
        tensor: tensor.to_string(),
        message,
    };
    let (Some(&packed_in), Some(&num_groups)) = (weight_shape.last(), scales_shape.last()) else {
        return Err(layout(
            "weight and scales need at least one dimension".into(),
        ));
    };
    if weight_shape.len() != scales_shape.len()
        || weight_shape[..weight_shape.len() - 1] != scales_shape[..scales_shape.len() - 1]
    {
        return Err(layout(format!(
            "scales shape {scales_shape:?} does not match weight shape {weight_shape:?}"
        )));
    }
    if group_size <= 0 || num_groups <= 0 {
        return Err(layout(format!(
            "group size {group_size} with {num_groups} groups"
        )));
    }
    let packed_bits = packed_in as i64 * 32;
    let per_bit = num_groups as i64 * group_size as i64;
    if packed_bits % per_bit != 0 || !(1..=8).contains(&(packed_bits / per_bit)) {
        return Err(layout(format!(
            "{packed_in} packed words cannot hold {num_groups} groups of {group_size} values at any width 1..8 (config says {caller_bits} bits)"
        )));
    }
    let bits = (packed_bits / per_bit) as i32;
    if bits == 7 {
        return Err(layout("7-bit quantization is not an MLX format".into()));
    }
    Ok(bits)
}

impl QuantizedWeight {
    /// Assembles and checks the planes of a tensor. For affine, the bit width is inferred from
    /// the shapes ([`infer_quantization_bits`]); fixed-format modes check their fixed layout.
    pub fn new(
        tensor: &str,
        weight: Array,
        scales: Array,
        biases: Option<Array>,
        mode: QuantMode,
        group_size: i32,
        bits: i32,
    ) -> Result<QuantizedWeight> {
        let layout = |message: String| QuantError::Layout {
            tensor: tensor.to_string(),
            message,
        };
        let wdt = weight.dtype()?;
        if wdt != Dtype::Uint32 {
            return Err(layout(format!("packed weight must be uint32, found {wdt}")));
        }
        let spec = match mode.fixed_layout() {
            Some((g, b)) => {
                let (ws, ss) = (weight.shape(), scales.shape());
                let inferred = infer_quantization_bits(tensor, &ws, &ss, g, b)?;
                if inferred != b {
                    return Err(layout(format!(
                        "{mode} needs {b}-bit codes in groups of {g}, but the shapes {ws:?} / {ss:?} imply {inferred} bits"
                    )));
                }
                if biases.is_some() {
                    return Err(layout(format!("{mode} has no biases plane")));
                }
                QuantSpec {
                    mode,
                    group_size: g,
                    bits: b,
                }
            }
            None => {
                let bits = infer_quantization_bits(
                    tensor,
                    &weight.shape(),
                    &scales.shape(),
                    group_size,
                    bits,
                )?;
                if biases.is_none() {
                    return Err(layout(format!(
                        "affine {bits}-bit tensor has no `.biases` plane"
                    )));
                }
                QuantSpec::affine(group_size, bits)
            }
        };
        if let Some(b) = &biases {
            if b.shape() != scales.shape() {
                return Err(layout(format!(
                    "biases shape {:?} differs from scales shape {:?}",
                    b.shape(),
                    scales.shape()
                )));
            }
        }
        Ok(QuantizedWeight {
            weight,
            scales,
            biases,
            spec,
        })
    }

    /// The number of input features (unpacked).
    pub fn in_features(&self) -> i32 {
        self.weight.shape().last().copied().unwrap_or(0) * 32 / self.spec.bits
    }

    /// The output rows (`out` of `[.., out, in]`).
    pub fn out_features(&self) -> i32 {
        let s = self.weight.shape();
        s.get(s.len().wrapping_sub(2)).copied().unwrap_or(0)
    }

    /// `x @ W^T` without materialising `W`.
    pub fn matmul_t(&self, x: &Array) -> mlxcel_core::Result<Array> {
        ops::quantized_matmul(
            x,
            &self.weight,
            &self.scales,
            self.biases.as_ref(),
            true,
            self.spec,
        )
    }

    /// `input(x) @ W^T (+ residual)` as one mlxcel CUDA kernel when it takes these operands
    /// (decode rows of affine 4/8-bit weights on a GPU, see `cuda_kernels::gemv_applies`), else
    /// `None`, for the caller to run the ops one by one.
    pub fn fused_gemv(
        &self,
        x: &Array,
        input: GemvInput<'_>,
        residual: Option<&Array>,
    ) -> mlxcel_core::Result<Option<Array>> {
        let Some(biases) = &self.biases else {
            return Ok(None);
        };
        let (w, s, spec) = (&self.weight, &self.scales, self.spec);
        if !cuda_kernels::gemv_applies(x, w, s, Some(biases), spec, input, residual)? {
            return Ok(None);
        }
        cuda_kernels::gemv(x, w, s, biases, spec, input, residual).map(Some)
    }

    /// The dense matrix, in `dtype`.
    pub fn dequantize(&self, dtype: Dtype) -> mlxcel_core::Result<Array> {
        ops::dequantize(
            &self.weight,
            &self.scales,
            self.biases.as_ref(),
            self.spec,
            Some(dtype),
        )
    }

    /// Casts the float planes (scales and biases of affine) to `dtype`; fp modes keep their
    /// byte scales.
    pub fn with_float_dtype(self, dtype: Dtype) -> mlxcel_core::Result<QuantizedWeight> {
        if self.spec.mode != QuantMode::Affine || self.scales.dtype()? == dtype {
            return Ok(self);
        }
        Ok(QuantizedWeight {
            scales: self.scales.astype(dtype)?,
            biases: self.biases.map(|b| b.astype(dtype)).transpose()?,
            ..self
        })
    }

    /// Every array this weight holds.
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = vec![&self.weight, &self.scales];
        v.extend(self.biases.as_ref());
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn infers_mixed_widths_and_rejects_impossible_layouts() {
        // in = 128, group 64 → 2 groups; 4-bit → 16 words, 8-bit → 32 words.
        assert_eq!(
            infer_quantization_bits("t", &[8, 16], &[8, 2], 64, 8).unwrap(),
            4
        );
        assert_eq!(
            infer_quantization_bits("t", &[8, 32], &[8, 2], 64, 4).unwrap(),
            8
        );
        assert_eq!(
            infer_quantization_bits("t", &[8, 12], &[8, 2], 64, 4).unwrap(),
            3
        );
        assert_eq!(
            infer_quantization_bits("t", &[4, 8, 4], &[4, 8, 2], 64, 4).unwrap(),
            1
        );
        let err = infer_quantization_bits("model.x", &[8, 15], &[8, 2], 64, 4)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`model.x`") && err.contains("15 packed words"),
            "{err}"
        );
        let err = infer_quantization_bits("model.y", &[8, 16], &[4, 2], 64, 4)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`model.y`") && err.contains("does not match"),
            "{err}"
        );
        let err = infer_quantization_bits("model.z", &[8, 28], &[8, 2], 64, 4)
            .unwrap_err()
            .to_string();
        assert!(err.contains("7-bit"), "{err}");
    }

    #[test]
    fn planes_are_checked() {
        let w = ops::zeros(&[8, 128], Dtype::Float32).unwrap();
        let q = w.quantize(QuantSpec::affine(64, 4)).unwrap();
        let ok = QuantizedWeight::new(
            "a",
            q.weight.clone(),
            q.scales.clone(),
            q.biases.clone(),
            QuantMode::Affine,
            64,
            8,
        )
        .unwrap();
        assert_eq!(
            (ok.spec.bits, ok.in_features(), ok.out_features()),
            (4, 128, 8)
        );
        let err = QuantizedWeight::new(
            "a",
            q.weight.clone(),
            q.scales.clone(),
            None,
            QuantMode::Affine,
            64,
            4,
        )
        .unwrap_err();
        assert!(err.to_string().contains("no `.biases`"), "{err}");
        let err = QuantizedWeight::new(
            "a",
            q.weight.clone(),
            q.scales.clone(),
            q.biases.clone(),
            QuantMode::Mxfp4,
            32,
            4,
        )
        .unwrap_err();
        assert!(err.to_string().contains("`a`"), "{err}");
        let f = w
            .quantize(QuantSpec::fixed(QuantMode::Mxfp4).unwrap())
            .unwrap();
        let ok =
            QuantizedWeight::new("b", f.weight, f.scales, None, QuantMode::Mxfp4, 0, 0).unwrap();
        assert_eq!(ok.spec, QuantSpec::fixed(QuantMode::Mxfp4).unwrap());
    }

    #[test]
    fn config_block_with_overrides() {
        let cfg: serde_json::Value = serde_json::json!({
            "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
                "model.embed_tokens": {"group_size": 32, "bits": 6, "mode": "affine"},
                "lm_head": false}
        });
        let q = crate::QuantConfig::from_config(&cfg).unwrap().unwrap();
        assert_eq!(
            q.for_module("model.layers.0.mlp.gate"),
            crate::TensorQuant::Quantized {
                mode: QuantMode::Affine,
                group_size: 64,
                bits: 8
            }
        );
        assert_eq!(q.for_module("lm_head"), crate::TensorQuant::Dense);
        assert_eq!(
            q.for_module("other"),
            crate::TensorQuant::Quantized {
                mode: QuantMode::Affine,
                group_size: 64,
                bits: 4
            }
        );
        let bad = serde_json::json!({"quantization": {"mode": "int3"}});
        let err = crate::QuantConfig::from_config(&bad)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("quantization.mode") && err.contains("int3"),
            "{err}"
        );
        let fp8 = serde_json::json!({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}});
        assert!(crate::QuantConfig::from_config(&fp8)
            .unwrap_err()
            .to_string()
            .contains("fp8"));
        assert!(crate::QuantConfig::from_config(&serde_json::json!({}))
            .unwrap()
            .is_none());
    }
}
