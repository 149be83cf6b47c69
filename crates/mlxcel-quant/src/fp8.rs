//! Vendor FP8 block checkpoints (`quantization_config: {quant_method: "fp8",
//! weight_block_size: [128, 128]}`, DeepSeek-V3 / Qwen3-FP8 style): `X.weight` in `F8_E4M3` and
//! `X.weight_scale_inv` (f32 `[ceil(out/bo), ceil(in/bi)]`) with `w = fp8 · scale_inv[block]`.
//! They are requantized at load to MLX `mxfp8` (E4M3 codes, one power-of-two scale per 32
//! inputs): the FP8 bytes are decoded on the host (a 256-entry table), multiplied by their block
//! scale, and quantized with MLX one tensor at a time.

use serde_json::Value;

use mlxcel_core::{Array, Dtype, WeightMap};

use crate::{QuantConfig, QuantError, QuantMode, QuantSpec, Result};

/// The block size of a vendor FP8 checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockFp8 {
    /// Output rows per scale block (`weight_block_size[0]`).
    pub block_out: usize,
    /// Input columns per scale block (`weight_block_size[1]`).
    pub block_in: usize,
}

/// `Some` when the config declares a block-FP8 checkpoint (`quant_method: "fp8"`).
pub fn block_fp8_config(config: &Value) -> Result<Option<BlockFp8>> {
    let Some(q) = config.get("quantization_config") else {
        return Ok(None);
    };
    if q.get("quant_method").and_then(Value::as_str) != Some("fp8") {
        return Ok(None);
    }
    let field = "quantization_config.weight_block_size";
    let bad = |message: String| QuantError::Config {
        field: field.into(),
        message,
    };
    if let Some(fmt) = q.get("fmt").and_then(Value::as_str) {
        if fmt != "e4m3" {
            return Err(QuantError::Config {
                field: "quantization_config.fmt".into(),
                message: format!("only e4m3 FP8 is supported, found `{fmt}`"),
            });
        }
    }
    let block = q
        .get("weight_block_size")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            bad("missing: per-tensor FP8 scales are not supported, only blocks".into())
        })?;
    let dims: Vec<usize> = block
        .iter()
        .filter_map(Value::as_u64)
        .map(|x| x as usize)
        .collect();
    match dims.as_slice() {
        [o, i] if *o > 0 && *i > 0 => Ok(Some(BlockFp8 {
            block_out: *o,
            block_in: *i,
        })),
        _ => Err(bad(format!(
            "expected two positive integers, found {block:?}"
        ))),
    }
}

/// The value of an E4M3 (`e4m3fn`: no infinities, `0x7f`/`0xff` are NaN) byte.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// Decodes a block-FP8 matrix to f32: `bytes` `[out, in]` of E4M3 and `scale_inv`
/// `[ceil(out/bo), ceil(in/bi)]`.
pub fn dequantize_block_fp8(
    tensor: &str,
    bytes: &[u8],
    shape: &[i32],
    scale_inv: &[f32],
    scale_shape: &[i32],
    block: BlockFp8,
) -> Result<Vec<f32>> {
    let layout = |message: String| QuantError::Layout {
        tensor: tensor.to_string(),
        message,
    };
    let [out, inp] = shape else {
        return Err(layout(format!(
            "expected a 2-D FP8 weight, found shape {shape:?}"
        )));
    };
    let (out, inp) = (*out as usize, *inp as usize);
    let (bo, bi) = (out.div_ceil(block.block_out), inp.div_ceil(block.block_in));
    if scale_shape != [bo as i32, bi as i32] {
        return Err(layout(format!(
            "weight_scale_inv has shape {scale_shape:?}, expected [{bo}, {bi}] for blocks of {}x{}",
            block.block_out, block.block_in
        )));
    }
    if bytes.len() != out * inp || scale_inv.len() != bo * bi {
        return Err(layout(format!(
            "{} bytes / {} scales for shape [{out}, {inp}]",
            bytes.len(),
            scale_inv.len()
        )));
    }
    let table: Vec<f32> = (0..=255u8).map(e4m3_to_f32).collect();
    let mut dense = vec![0.0f32; out * inp];
    for r in 0..out {
        let srow = &scale_inv[(r / block.block_out) * bi..(r / block.block_out + 1) * bi];
        for c in 0..inp {
            dense[r * inp + c] = table[bytes[r * inp + c] as usize] * srow[c / block.block_in];
        }
    }
    if let Some(i) = dense.iter().position(|x| !x.is_finite()) {
        return Err(layout(format!(
            "element {i} decodes to a non-finite value (NaN byte or scale)"
        )));
    }
    Ok(dense)
}

/// Requantizes one block-FP8 matrix to mxfp8 planes (`weight` uint32, `scales` uint8).
pub fn requantize_block_fp8(
    tensor: &str,
    bytes: &[u8],
    shape: &[i32],
    scale_inv: &[f32],
    scale_shape: &[i32],
    block: BlockFp8,
) -> Result<crate::Quantized> {
    let dense = dequantize_block_fp8(tensor, bytes, shape, scale_inv, scale_shape, block)?;
    if shape[1] % 32 != 0 {
        return Err(QuantError::Layout {
            tensor: tensor.to_string(),
            message: format!(
                "{} input features are not a multiple of mxfp8's group of 32",
                shape[1]
            ),
        });
    }
    let spec = QuantSpec::fixed(QuantMode::Mxfp8).ok_or_else(|| QuantError::Layout {
        tensor: tensor.into(),
        message: "mxfp8 has no fixed layout".into(),
    })?;
    let q = Array::from_slice(&dense, shape)?.quantize(spec)?;
    mlxcel_core::ops::eval_all([&q.weight, &q.scales])?;
    Ok(q)
}

/// Replaces every `X.weight` (F8_E4M3) + `X.weight_scale_inv` pair of `map` with mxfp8 planes
/// `X.weight` / `X.scales`, and returns the quantization config the model loader needs (mxfp8
/// defaults; every other tensor is dense and carries no `.scales`). FP8 activation scales
/// (`X.input_scale`, dynamic-activation checkpoints) are dropped: MLX computes in the float dtype.
pub fn requantize_checkpoint(map: &mut WeightMap, block: BlockFp8) -> Result<QuantConfig> {
    let names: Vec<String> = map
        .names()
        .filter(|n| n.ends_with(".weight_scale_inv"))
        .map(str::to_string)
        .collect();
    for scale_name in names {
        let prefix = &scale_name[..scale_name.len() - ".weight_scale_inv".len()];
        let weight_name = format!("{prefix}.weight");
        let info = map
            .info(&weight_name)
            .cloned()
            .ok_or_else(|| QuantError::Layout {
                tensor: scale_name.clone(),
                message: format!("has no `{weight_name}`"),
            })?;
        if info.stored_dtype != "F8_E4M3" {
            return Err(QuantError::Layout {
                tensor: weight_name,
                message: format!(
                    "has a weight_scale_inv but is stored as {}, not F8_E4M3",
                    info.stored_dtype
                ),
            });
        }
        let bytes = match map.bytes(&weight_name) {
            Some(b) => b.to_vec(),
            None => map.get(&weight_name)?.to_bytes()?,
        };
        let scale = map.get(&scale_name)?;
        let scale_shape = scale.shape();
        let scale_inv = scale.astype(Dtype::Float32)?.to_vec::<f32>()?;
        let q = requantize_block_fp8(
            &weight_name,
            &bytes,
            &info.shape,
            &scale_inv,
            &scale_shape,
            block,
        )?;
        map.remove(&scale_name);
        map.remove(&format!("{prefix}.input_scale"));
        map.insert(weight_name, q.weight)?;
        map.insert(format!("{prefix}.scales"), q.scales)?;
    }
    if let Some(n) = map.names().find(|n| {
        map.info(n)
            .is_some_and(|i| i.stored_dtype.starts_with("F8_"))
    }) {
        return Err(QuantError::Layout {
            tensor: n.to_string(),
            message: "FP8 tensor without a `weight_scale_inv` block scale".into(),
        });
    }
    let (group_size, bits) = QuantMode::Mxfp8.fixed_layout().unwrap_or((32, 8));
    Ok(QuantConfig {
        mode: QuantMode::Mxfp8,
        group_size,
        bits,
        overrides: Default::default(),
    })
}

/// Encodes `x` as the nearest E4M3 byte (saturating at ±448; ties to the even code). For
/// building test checkpoints.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let mut best = (0u8, f32::INFINITY);
    for b in 0..=255u8 {
        let v = e4m3_to_f32(b);
        if !v.is_finite() {
            continue;
        }
        let d = (v - x.clamp(-448.0, 448.0)).abs();
        if d < best.1 || (d == best.1 && b % 2 == 0 && (best.0 % 2 == 1)) {
            best = (b, d);
        }
    }
    best.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_table() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert!(e4m3_to_f32(0x7f).is_nan());
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if v.is_finite() && v != 0.0 {
                assert_eq!(e4m3_to_f32(f32_to_e4m3(v)), v, "{b:#x}");
            }
        }
    }

    #[test]
    fn block_layout_errors_name_the_tensor() {
        let block = BlockFp8 {
            block_out: 128,
            block_in: 128,
        };
        let e = dequantize_block_fp8("m.w", &[0; 64 * 64], &[64, 64], &[1.0; 4], &[2, 2], block)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`m.w`") && e.contains("expected [1, 1]"), "{e}");
        let cfg = serde_json::json!({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}});
        let e = block_fp8_config(&cfg).unwrap_err().to_string();
        assert!(e.contains("weight_block_size"), "{e}");
        let cfg = serde_json::json!({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}});
        assert_eq!(
            block_fp8_config(&cfg).unwrap(),
            Some(BlockFp8 {
                block_out: 128,
                block_in: 128
            })
        );
    }

    #[test]
    fn requantized_matches_dense_reference() {
        // 64x96 weight with 32x32 blocks (2x3 scales) of different magnitudes.
        let (out, inp) = (64usize, 96usize);
        let block = BlockFp8 {
            block_out: 32,
            block_in: 32,
        };
        let scales = [0.01f32, 0.002, 0.05, 0.3, 0.0007, 0.02];
        let bytes: Vec<u8> = (0..out * inp)
            .map(|i| {
                let x = ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 600.0;
                f32_to_e4m3(x)
            })
            .collect();
        let dense = dequantize_block_fp8("w", &bytes, &[64, 96], &scales, &[2, 3], block).unwrap();
        let q = requantize_block_fp8("w", &bytes, &[64, 96], &scales, &[2, 3], block).unwrap();
        let spec = QuantSpec::fixed(QuantMode::Mxfp8).unwrap();
        let back =
            mlxcel_core::ops::dequantize(&q.weight, &q.scales, None, spec, Some(Dtype::Float32))
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
        let amax = dense.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for (a, b) in dense.iter().zip(&back) {
            num += ((a - b) as f64).powi(2);
            den += (*a as f64).powi(2);
            // E4M3 keeps 3 mantissa bits: a re-rounding moves a value by at most 1/16 of itself
            // (plus subnormal steps for tiny values).
            assert!((a - b).abs() <= a.abs() / 16.0 + amax * 1e-4, "{a} vs {b}");
        }
        let rel = (num / den).sqrt();
        assert!(rel < 0.03, "relative error {rel}");
    }
}
