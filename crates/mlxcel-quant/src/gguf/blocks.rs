//! Decoding ggml blocks.
//!
//! Two paths:
//!
//! - [`repack_affine`]: block types that are exactly an MLX affine format are repacked without
//!   touching a single value. `Q4_1` (`w = d·q + m`, q ∈ 0..16) is affine 4-bit with group 32,
//!   scale `d`, bias `m`; `Q4_0` (`w = d·(q − 8)`) is affine 4-bit with scale `d`, bias `−8d`;
//!   `Q8_0` (`w = d·q`, q ∈ −128..128) is affine 8-bit with scale `d`, bias `−128d` and code
//!   `q + 128`. Multiplying an f16 by a power of two is exact, so the biases are exact too.
//! - [`dequantize`]: every supported type decoded to f32 following ggml's reference
//!   (`dequantize_row_*`) arithmetic. The K-quants (`Q4_K`, `Q5_K`, `Q6_K`) and `Q5_0`/`Q5_1`
//!   take this path on import: their two-level scales have no MLX equivalent, so they are stored
//!   dense in float32. That is lossy only in the sense that the result is not re-quantized: every
//!   weight is the value llama.cpp itself computes.
//!
//! Block layouts (little-endian, `f16` halves):
//!
//! | type | bytes | layout |
//! |---|---|---|
//! | Q4_0 | 18 | `d, qs[16]` |
//! | Q4_1 | 20 | `d, m, qs[16]` |
//! | Q5_0 | 22 | `d, qh u32, qs[16]` |
//! | Q5_1 | 24 | `d, m, qh u32, qs[16]` |
//! | Q8_0 | 34 | `d, qs[32] i8` |
//! | Q4_K | 144 | `d, dmin, scales[12], qs[128]` |
//! | Q5_K | 176 | `d, dmin, scales[12], qh[32], qs[128]` |
//! | Q6_K | 210 | `ql[128], qh[64], scales[16] i8, d` |
//!
//! In the 32-element types, byte `j` of `qs` holds element `j` in its low nibble and element
//! `j + 16` in its high nibble.

use half::{bf16, f16};

use super::types::GgmlType;

/// Elements per K-quant super-block.
const QK_K: usize = 256;

fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Whether [`dequantize`] can decode `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16 | Bf16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q4K | Q5K | Q6K
    )
}

/// Decodes `bytes` (a whole number of `ty` blocks) to f32; `None` if the type is not supported.
/// The caller guarantees the length is a multiple of the type's block bytes.
pub fn dequantize(ty: GgmlType, bytes: &[u8]) -> Option<Vec<f32>> {
    use GgmlType::*;
    let n_blocks = bytes.len() / ty.type_size();
    let mut out = Vec::with_capacity(n_blocks * ty.block_size());
    let blocks = bytes.chunks_exact(ty.type_size());
    match ty {
        F32 => out.extend(blocks.map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        F16 => out.extend(blocks.map(|b| half(b, 0))),
        Bf16 => out.extend(blocks.map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())),
        Q4_0 => blocks.for_each(|b| decode_q4_0(b, &mut out)),
        Q4_1 => blocks.for_each(|b| decode_q4_1(b, &mut out)),
        Q5_0 => blocks.for_each(|b| decode_q5(b, false, &mut out)),
        Q5_1 => blocks.for_each(|b| decode_q5(b, true, &mut out)),
        Q8_0 => blocks.for_each(|b| decode_q8_0(b, &mut out)),
        Q4K => blocks.for_each(|b| decode_q4_k(b, &mut out)),
        Q5K => blocks.for_each(|b| decode_q5_k(b, &mut out)),
        Q6K => blocks.for_each(|b| decode_q6_k(b, &mut out)),
        _ => return None,
    }
    Some(out)
}

fn decode_q4_0(b: &[u8], out: &mut Vec<f32>) {
    let d = half(b, 0);
    let qs = &b[2..18];
    let lo = qs.iter().map(|q| ((q & 0xF) as i32 - 8) as f32 * d);
    let hi = qs.iter().map(|q| ((q >> 4) as i32 - 8) as f32 * d);
    out.extend(lo.chain(hi));
}

fn decode_q4_1(b: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (half(b, 0), half(b, 2));
    let qs = &b[4..20];
    let lo = qs.iter().map(|q| (q & 0xF) as f32 * d + m);
    let hi = qs.iter().map(|q| (q >> 4) as f32 * d + m);
    out.extend(lo.chain(hi));
}

/// Q5_0 (`w = d·(q − 16)`) and Q5_1 (`w = d·q + m`): the fifth bit of element `j` is bit `j`
/// of the u32 `qh`.
fn decode_q5(b: &[u8], with_min: bool, out: &mut Vec<f32>) {
    let d = half(b, 0);
    let (m, rest) = if with_min {
        (half(b, 2), &b[4..])
    } else {
        (0.0, &b[2..])
    };
    let qh = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
    let qs = &rest[4..20];
    let value = |q: u32| {
        if with_min {
            q as f32 * d + m
        } else {
            (q as i32 - 16) as f32 * d
        }
    };
    let start = out.len();
    out.resize(start + 32, 0.0);
    for (j, q) in qs.iter().enumerate() {
        let h0 = ((qh >> j) & 1) << 4;
        let h1 = ((qh >> (j + 16)) & 1) << 4;
        out[start + j] = value((q & 0xF) as u32 | h0);
        out[start + j + 16] = value((q >> 4) as u32 | h1);
    }
}

fn decode_q8_0(b: &[u8], out: &mut Vec<f32>) {
    let d = half(b, 0);
    out.extend(b[2..34].iter().map(|q| (*q as i8) as f32 * d));
}

/// The 6-bit scale and min of sub-block `j` (0..8) from the 12 packed bytes of Q4_K/Q5_K:
/// bytes 0..4 hold the low 6 bits of scales 0..4 (top 2 bits: high bits of scales 4..8),
/// bytes 4..8 the same for the mins, bytes 8..12 the low nibbles of scales/mins 4..8.
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

fn decode_q4_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    // Four chunks of 64 weights: 32 low nibbles (sub-block 2c), then 32 high (2c + 1).
    for c in 0..4 {
        let q = &qs[32 * c..32 * c + 32];
        let (s0, m0) = scale_min_k4(2 * c, scales);
        let (s1, m1) = scale_min_k4(2 * c + 1, scales);
        let (d0, m0) = (d * s0 as f32, dmin * m0 as f32);
        let (d1, m1) = (d * s1 as f32, dmin * m1 as f32);
        out.extend(q.iter().map(|x| d0 * (x & 0xF) as f32 - m0));
        out.extend(q.iter().map(|x| d1 * (x >> 4) as f32 - m1));
    }
}

fn decode_q5_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for c in 0..4 {
        let q = &qs[32 * c..32 * c + 32];
        let (s0, m0) = scale_min_k4(2 * c, scales);
        let (s1, m1) = scale_min_k4(2 * c + 1, scales);
        let (d0, m0) = (d * s0 as f32, dmin * m0 as f32);
        let (d1, m1) = (d * s1 as f32, dmin * m1 as f32);
        // The fifth bits of chunk c are bits 2c (low nibbles) and 2c + 1 (high) of qh[l].
        let (u0, u1) = (1u8 << (2 * c), 1u8 << (2 * c + 1));
        out.extend(
            q.iter()
                .zip(qh)
                .map(|(x, h)| d0 * ((x & 0xF) + if h & u0 != 0 { 16 } else { 0 }) as f32 - m0),
        );
        out.extend(
            q.iter()
                .zip(qh)
                .map(|(x, h)| d1 * ((x >> 4) + if h & u1 != 0 { 16 } else { 0 }) as f32 - m1),
        );
    }
}

fn decode_q6_k(b: &[u8], out: &mut Vec<f32>) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half(b, 208);
    let start = out.len();
    out.resize(start + QK_K, 0.0);
    let y = &mut out[start..];
    // Two halves of 128 weights, each from 64 bytes of ql, 32 of qh and 8 scales.
    for h in 0..2 {
        let (ql, qh, sc) = (&ql[64 * h..], &qh[32 * h..], &sc[8 * h..]);
        let y = &mut y[128 * h..];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| d * (sc[is + k] as i8) as f32;
            y[l] = s(0) * q1 as f32;
            y[l + 32] = s(2) * q2 as f32;
            y[l + 64] = s(4) * q3 as f32;
            y[l + 96] = s(6) * q4 as f32;
        }
    }
}

/// A matrix repacked into MLX's affine layout: `weight` `[rows, cols·bits/32]` u32 words with
/// element `i` of a row at bits `[bits·i, bits·i + bits)` (LSB first, words little-endian),
/// `scales` and `biases` `[rows, cols/group_size]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AffinePlanes {
    /// Bits per element: 4 (`Q4_0`, `Q4_1`) or 8 (`Q8_0`).
    pub bits: i32,
    /// Elements per scale: 32, the ggml block size.
    pub group_size: i32,
    /// Packed elements, row-major.
    pub weight: Vec<u32>,
    /// One scale per group, row-major.
    pub scales: Vec<f16>,
    /// One bias per group (`w = scale * q + bias`), row-major.
    pub biases: Vec<f16>,
}

impl AffinePlanes {
    /// u32 words per row of `cols` elements.
    pub fn words_per_row(&self, cols: usize) -> usize {
        cols * self.bits as usize / 32
    }
}

/// Why a tensor could not be repacked.
#[derive(Debug, Clone, PartialEq)]
pub enum RepackError {
    /// The type has no exact MLX affine equivalent.
    NotAffine,
    /// A derived bias does not fit in float16 (a scale beyond f16 range / 128).
    BiasOverflow {
        /// Index of the offending block in the tensor.
        block: usize,
        /// Its scale.
        scale: f32,
    },
}

/// Repacks whole blocks of a `Q4_0`, `Q4_1` or `Q8_0` tensor into MLX affine planes without
/// changing any value. Rows are contiguous runs of blocks, so the planes come out row-major for
/// any number of rows.
pub fn repack_affine(ty: GgmlType, bytes: &[u8]) -> Result<AffinePlanes, RepackError> {
    let (bits, type_size) = match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => (4, ty.type_size()),
        GgmlType::Q8_0 => (8, ty.type_size()),
        _ => return Err(RepackError::NotAffine),
    };
    let n_blocks = bytes.len() / type_size;
    let mut planes = AffinePlanes {
        bits,
        group_size: 32,
        weight: Vec::with_capacity(n_blocks * bits as usize),
        scales: Vec::with_capacity(n_blocks),
        biases: Vec::with_capacity(n_blocks),
    };
    for (i, b) in bytes.chunks_exact(type_size).enumerate() {
        let d = f16::from_le_bytes([b[0], b[1]]);
        let (bias, codes): (f16, [u8; 32]) = match ty {
            GgmlType::Q4_1 => (f16::from_le_bytes([b[2], b[3]]), nibbles(&b[4..20])),
            GgmlType::Q4_0 => (exact_bias(d, -8.0, i)?, nibbles(&b[2..18])),
            _ => {
                let mut codes = [0u8; 32];
                for (c, q) in codes.iter_mut().zip(&b[2..34]) {
                    // Two's complement q + 128 is the byte with its sign bit flipped.
                    *c = q ^ 0x80;
                }
                (exact_bias(d, -128.0, i)?, codes)
            }
        };
        planes.scales.push(d);
        planes.biases.push(bias);
        let per_word = 32 / bits as usize;
        for word in codes.chunks_exact(per_word) {
            planes.weight.push(
                word.iter()
                    .enumerate()
                    .fold(0u32, |w, (e, c)| w | (*c as u32) << (bits as usize * e)),
            );
        }
    }
    Ok(planes)
}

/// The 32 codes of a 16-byte nibble array in element order.
fn nibbles(qs: &[u8]) -> [u8; 32] {
    let mut codes = [0u8; 32];
    for (j, q) in qs.iter().enumerate() {
        codes[j] = q & 0xF;
        codes[j + 16] = q >> 4;
    }
    codes
}

/// `factor · d` for a power-of-two `factor`: exact in f16 unless it overflows.
fn exact_bias(d: f16, factor: f32, block: usize) -> Result<f16, RepackError> {
    let v = d.to_f32() * factor;
    let h = f16::from_f32(v);
    if h.to_f32() == v || v.is_nan() {
        Ok(h)
    } else {
        Err(RepackError::BiasOverflow {
            block,
            scale: d.to_f32(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    /// A Q4_1 block with d = 0.5, m = −1 and byte j = (j+16 high nibble, j low nibble) chosen so
    /// that element e has code e % 16 for e < 16 and 15 − (e − 16) for e ≥ 16.
    fn q4_1_block() -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(h(0.5));
        b.extend(h(-1.0));
        for j in 0..16u8 {
            b.push(j | ((15 - j) << 4));
        }
        b
    }

    #[test]
    fn q4_1_decodes_low_nibbles_first_then_high() {
        let w = dequantize(GgmlType::Q4_1, &q4_1_block()).unwrap();
        assert_eq!(w.len(), 32);
        // Hand-computed: element 0 = 0.5·0 − 1, element 1 = 0.5·1 − 1, element 15 = 6.5,
        // element 16 (high nibble of byte 0, code 15) = 6.5, element 31 (code 0) = −1.
        assert_eq!(w[0], -1.0);
        assert_eq!(w[1], -0.5);
        assert_eq!(w[15], 6.5);
        assert_eq!(w[16], 6.5);
        assert_eq!(w[17], 6.0);
        assert_eq!(w[31], -1.0);
    }

    #[test]
    fn q4_1_repacks_into_mlx_words() {
        let p = repack_affine(GgmlType::Q4_1, &q4_1_block()).unwrap();
        assert_eq!((p.bits, p.group_size), (4, 32));
        assert_eq!(p.scales, vec![f16::from_f32(0.5)]);
        assert_eq!(p.biases, vec![f16::from_f32(-1.0)]);
        // Codes 0..8 → word 0x76543210; 8..16 → 0xFEDCBA98; 15..7 → 0x89ABCDEF; 7..0.
        assert_eq!(
            p.weight,
            vec![0x7654_3210, 0xFEDC_BA98, 0x89AB_CDEF, 0x0123_4567]
        );
    }

    #[test]
    fn q8_0_block_and_repack() {
        let mut b = Vec::new();
        b.extend(h(0.25));
        let qs: Vec<i8> = (0..32)
            .map(|i| if i % 2 == 0 { -128 + i } else { 127 - i })
            .collect();
        b.extend(qs.iter().map(|q| *q as u8));
        let w = dequantize(GgmlType::Q8_0, &b).unwrap();
        assert_eq!(w[0], -32.0); // 0.25 · −128
        assert_eq!(w[1], 31.5); // 0.25 · 126
        assert_eq!(w[2], -31.5); // 0.25 · −126
        let p = repack_affine(GgmlType::Q8_0, &b).unwrap();
        assert_eq!(p.biases, vec![f16::from_f32(-32.0)]);
        // Codes q + 128: 0, 254, 2, 252 → word 0xFC02FE00.
        assert_eq!(p.weight[0], 0xFC02_FE00);
        assert_eq!(p.weight.len(), 8);
        for (e, q) in qs.iter().enumerate() {
            let code = (p.weight[e / 4] >> (8 * (e % 4))) & 0xFF;
            assert_eq!(code as f32 * 0.25 - 32.0, w[e]);
            assert_eq!(code as i32 - 128, *q as i32);
        }
    }

    #[test]
    fn q4_0_repack_matches_its_decode() {
        let mut b = Vec::new();
        b.extend(h(3.0));
        b.extend((0..16u8).map(|j| (j * 7 % 16) | ((j * 3 % 16) << 4)));
        let w = dequantize(GgmlType::Q4_0, &b).unwrap();
        assert_eq!(w[1], (7.0 - 8.0) * 3.0);
        assert_eq!(w[17], (3.0 - 8.0) * 3.0);
        let p = repack_affine(GgmlType::Q4_0, &b).unwrap();
        assert_eq!(p.biases, vec![f16::from_f32(-24.0)]);
        for (e, v) in w.iter().enumerate() {
            let code = (p.weight[e / 8] >> (4 * (e % 8))) & 0xF;
            assert_eq!(code as f32 * 3.0 - 24.0, *v);
        }
    }

    #[test]
    fn q8_0_bias_overflow_is_an_error() {
        let mut b = vec![0u8; 34];
        b[..2].copy_from_slice(&h(1024.0));
        assert!(matches!(
            repack_affine(GgmlType::Q8_0, &b),
            Err(RepackError::BiasOverflow { block: 0, .. })
        ));
    }

    #[test]
    fn q4_k_hand_computed_block() {
        // d = 2, dmin = 0.5. Scales/mins: sub-blocks 0..4 take the low 6 bits of bytes 0..4 and
        // 4..8; sub-blocks 4..8 take a nibble of bytes 8..12 plus the top bits of bytes 0..8.
        let mut b = Vec::new();
        b.extend(h(2.0));
        b.extend(h(0.5));
        let mut s = [0u8; 12];
        s[0] = 3; // scale 0 = 3
        s[4] = 5; // min 0 = 5
        s[1] = 1; // scale 1 = 1
        s[5] = 2; // min 1 = 2
                  // Sub-block 4: scale = (s[8] & 0xF) | (s[0] >> 6) << 4 = 1 | 1 << 4 = 17;
                  // min = (s[8] >> 4) | (s[4] >> 6) << 4 = 2 | 2 << 4 = 34.
        s[0] |= 1 << 6;
        s[4] |= 2 << 6;
        s[8] = 1 | (2 << 4);
        b.extend(s);
        let mut qs = [0u8; 128];
        qs[0] = 0x9 | (0x4 << 4); // element 0 = code 9 (sub-block 0), element 32 = 4 (sub-block 1)
        qs[64] = 0x7; // element 128 = code 7 (sub-block 4)
        b.extend(qs);
        let w = dequantize(GgmlType::Q4K, &b).unwrap();
        assert_eq!(w.len(), 256);
        assert_eq!(w[0], 2.0 * 3.0 * 9.0 - 0.5 * 5.0); // 51.5
        assert_eq!(w[1], -2.5); // code 0 in sub-block 0
        assert_eq!(w[32], 2.0 * 1.0 * 4.0 - 0.5 * 2.0); // 7
        assert_eq!(w[128], 2.0 * 17.0 * 7.0 - 0.5 * 34.0); // 221
        assert_eq!(w[129], -17.0);
    }

    #[test]
    fn q6_k_hand_computed_block() {
        let mut b = vec![0u8; 210];
        b[0] = 0x5 | (0x3 << 4); // ql[0]: element 0 low 4 bits = 5, element 64 low bits = 3
        b[32] = 0x9 << 4; // ql[32] high nibble: element 96 low bits = 9
        b[128] = 0b10_00_00_01; // qh[0]: element 0 high bits 1, element 96 high bits 2
        b[192] = 2; // scale of elements 0..16
        b[196] = (-1i8) as u8; // scale of elements 64..80
        b[198] = 4; // scale of elements 96..112
        b[208..210].copy_from_slice(&h(0.5));
        let w = dequantize(GgmlType::Q6K, &b).unwrap();
        assert_eq!(w[0], 0.5 * 2.0 * ((5 | 1 << 4) - 32) as f32); // −11
        assert_eq!(w[64], -0.5 * (3 - 32) as f32); // d · scale −1 · q: 14.5
        assert_eq!(w[96], 0.5 * 4.0 * ((9 | 2 << 4) - 32) as f32); // 18
        assert_eq!(w[1], 0.5 * 2.0 * -32.0);
    }

    #[test]
    fn q5_1_fifth_bit() {
        let mut b = Vec::new();
        b.extend(h(1.0));
        b.extend(h(0.0));
        b.extend((1u32 | 1 << 17).to_le_bytes()); // element 0 and element 17 get +16
        b.extend([0x21u8; 16]);
        let w = dequantize(GgmlType::Q5_1, &b).unwrap();
        assert_eq!(w[0], 17.0);
        assert_eq!(w[1], 1.0);
        assert_eq!(w[16], 2.0);
        assert_eq!(w[17], 18.0);
    }

    #[test]
    fn unsupported_types_are_refused() {
        assert!(dequantize(GgmlType::Iq2Xxs, &[0u8; 66]).is_none());
        assert!(!can_dequantize(GgmlType::Q2K));
        assert_eq!(
            repack_affine(GgmlType::Q4K, &[0u8; 144]),
            Err(RepackError::NotAffine)
        );
    }
}
