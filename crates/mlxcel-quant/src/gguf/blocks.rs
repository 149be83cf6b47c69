//! Decoding ggml blocks, and mapping them onto MLX's affine quantization.
//!
//! MLX 0.32.4's affine format stores, per group of `group_size` consecutive elements of a row,
//! one scale and one bias (`w = scale·q + bias`) and `bits`-bit codes `q`; the group sizes it
//! accepts are 32, 64 and 128 (16 is refused by `mx.quantize` and the kernels), the widths 2, 3,
//! 4, 5, 6 and 8. A ggml type maps onto it **losslessly** exactly when its blocks are groups of
//! 32 (or split into sub-blocks of 32) with one affine scale and offset each:
//!
//! | type | MLX | scales/biases | why it is exact |
//! |---|---|---|---|
//! | Q4_0 | 4-bit g32 | f16 | `w = d·(q − 8)`: scale `d`, bias `−8d` (a power-of-two multiple of an f16) |
//! | Q4_1 | 4-bit g32 | f16 | `w = d·q + m`: scale `d`, bias `m` |
//! | Q5_0 | 5-bit g32 | f16 | `w = d·(q − 16)`: scale `d`, bias `−16d` |
//! | Q5_1 | 5-bit g32 | f16 | `w = d·q + m` |
//! | Q8_0 | 8-bit g32 | f16 | `w = d·q`, q ∈ −128..128: code `q + 128`, bias `−128d` |
//! | Q4_K | 4-bit g32 | f32 | 8 sub-blocks of 32: scale `d·sc`, bias `−dmin·m` with 6-bit `sc`, `m` |
//! | Q5_K | 5-bit g32 | f32 | the same with 5-bit codes |
//!
//! For the K-quants the per-sub-block scale `d·sc` is an f16 times a 6-bit integer: at most
//! 11 + 6 significant bits, exact in float32 (as ggml computes it) but not in float16, so their
//! scales and biases are written as float32 (MLX's kernels and mlxcel's CPU kernel read float32
//! scales). Every dequantized weight then equals ggml's `dequantize_row_*` bit for bit.
//!
//! `Q2_K`, `Q3_K` and `Q6_K` use sub-blocks of **16** weights, each with its own scale (and
//! `Q2_K` its own minimum): two of them share any 32-group MLX can express, with two unrelated
//! scales, so no MLX affine format holds them exactly. They are decoded exactly and then
//! **re-quantized** (min/max, round to nearest) to affine **8-bit**, group 32, float32 scales:
//! the closest MLX format to the decoded values (at most 1/510 of a group's range away), at the
//! cost of size (8 bits plus 2 of scales per weight, against 2.6/3.4/6.6 for the source). A
//! narrower target is not close enough: 4-bit for Q2_K moved a tiny test model's logits by half
//! their range. The error is measured per tensor ([`Requantized`]) and reported by the importer.
//!
//! The IQ (lattice/codebook) types, the ternary `TQ*`, `MXFP4` and the dot-product formats
//! `Q8_1`/`Q8_K` are not decoded: importing them is an error naming the tensor and type.
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
//! | Q2_K | 84 | `scales[16] (4-bit scale, 4-bit min), qs[64], d, dmin` |
//! | Q3_K | 110 | `hmask[32], qs[64], scales[12] (6-bit, packed), d` |
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

/// How a ggml type is written into an MLX checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlxMapping {
    /// Kept as a dense float tensor of the same dtype (F32, F16, BF16).
    Dense,
    /// Repacked into MLX affine planes without changing any value.
    Lossless {
        /// Code width.
        bits: i32,
        /// Whether scales and biases need float32 (else float16 holds them exactly).
        f32_scales: bool,
    },
    /// Decoded exactly, then re-quantized to MLX affine (group 32, float32 scales).
    Requantized {
        /// Code width of the MLX format.
        bits: i32,
    },
    /// Not decodable here.
    Unsupported,
}

/// Elements per MLX group for every block type this module writes.
pub const GROUP_SIZE: i32 = 32;

/// Where `ty` goes in an MLX checkpoint (see the module docs for why).
pub fn mlx_mapping(ty: GgmlType) -> MlxMapping {
    use GgmlType::*;
    match ty {
        F32 | F16 | Bf16 => MlxMapping::Dense,
        Q4_0 | Q4_1 => MlxMapping::Lossless {
            bits: 4,
            f32_scales: false,
        },
        Q5_0 | Q5_1 => MlxMapping::Lossless {
            bits: 5,
            f32_scales: false,
        },
        Q8_0 => MlxMapping::Lossless {
            bits: 8,
            f32_scales: false,
        },
        Q4K => MlxMapping::Lossless {
            bits: 4,
            f32_scales: true,
        },
        Q5K => MlxMapping::Lossless {
            bits: 5,
            f32_scales: true,
        },
        Q2K | Q3K | Q6K => MlxMapping::Requantized { bits: 8 },
        _ => MlxMapping::Unsupported,
    }
}

/// Whether [`dequantize`] can decode `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
    mlx_mapping(ty) != MlxMapping::Unsupported
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
        Q2K => blocks.for_each(|b| decode_q2_k(b, &mut out)),
        Q3K => blocks.for_each(|b| decode_q3_k(b, &mut out)),
        Q6K => blocks.for_each(|b| decode_q6_k(b, &mut out)),
        _ => {
            // The affine types decode through their groups: one definition of each layout.
            if !matches!(mlx_mapping(ty), MlxMapping::Lossless { .. }) {
                return None;
            }
            for_each_group(ty, bytes, |g| {
                out.extend(g.codes.iter().map(|q| g.scale * *q as f32 + g.bias))
            });
        }
    }
    Some(out)
}

/// One group of 32 consecutive weights of a losslessly mappable block: `w = scale·q + bias`,
/// computed in f32 exactly as ggml computes it.
struct Group {
    scale: f32,
    bias: f32,
    codes: [u8; 32],
}

/// Calls `f` with every 32-weight group of `bytes` (whole `ty` blocks) in element order; `ty` must
/// be [`MlxMapping::Lossless`].
fn for_each_group(ty: GgmlType, bytes: &[u8], mut f: impl FnMut(&Group)) {
    use GgmlType::*;
    for b in bytes.chunks_exact(ty.type_size()) {
        match ty {
            Q4_0 => {
                let d = half(b, 0);
                f(&Group {
                    scale: d,
                    bias: -8.0 * d,
                    codes: nibbles(&b[2..18]),
                })
            }
            Q4_1 => f(&Group {
                scale: half(b, 0),
                bias: half(b, 2),
                codes: nibbles(&b[4..20]),
            }),
            Q5_0 => {
                let d = half(b, 0);
                f(&Group {
                    scale: d,
                    bias: -16.0 * d,
                    codes: five_bit(&b[6..22], &b[2..6]),
                })
            }
            Q5_1 => f(&Group {
                scale: half(b, 0),
                bias: half(b, 2),
                codes: five_bit(&b[8..24], &b[4..8]),
            }),
            Q8_0 => {
                let d = half(b, 0);
                let mut codes = [0u8; 32];
                for (c, q) in codes.iter_mut().zip(&b[2..34]) {
                    // Two's complement q + 128 is the byte with its sign bit flipped.
                    *c = q ^ 0x80;
                }
                f(&Group {
                    scale: d,
                    bias: -128.0 * d,
                    codes,
                })
            }
            Q4K | Q5K => {
                let (d, dmin) = (half(b, 0), half(b, 2));
                let scales = &b[4..16];
                let (qh, qs) = if ty == Q5K {
                    (Some(&b[16..48]), &b[48..176])
                } else {
                    (None, &b[16..144])
                };
                // Four chunks of 64 weights: 32 low nibbles (sub-block 2c), then 32 high (2c + 1);
                // Q5_K's fifth bits of chunk c are bits 2c and 2c + 1 of qh[l].
                for c in 0..4 {
                    let q = &qs[32 * c..32 * c + 32];
                    for half_ in 0..2 {
                        let j = 2 * c + half_;
                        let (sc, m) = scale_min_k4(j, scales);
                        let mut codes = [0u8; 32];
                        for (l, code) in codes.iter_mut().enumerate() {
                            let nibble = if half_ == 0 { q[l] & 0xF } else { q[l] >> 4 };
                            let high = qh.map_or(0, |h| ((h[l] >> j) & 1) << 4);
                            *code = nibble | high;
                        }
                        f(&Group {
                            scale: d * sc as f32,
                            bias: -(dmin * m as f32),
                            codes,
                        });
                    }
                }
            }
            _ => unreachable!("for_each_group is only called for lossless types"),
        }
    }
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

/// Q5_0/Q5_1 codes: the nibbles plus, as fifth bit of element `j`, bit `j` of the u32 `qh`.
fn five_bit(qs: &[u8], qh: &[u8]) -> [u8; 32] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut codes = nibbles(qs);
    for (j, c) in codes.iter_mut().enumerate() {
        *c |= (((qh >> j) & 1) << 4) as u8;
    }
    codes
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

/// Q2_K: 16 sub-blocks of 16, `w = d·sc·q − dmin·m` with 4-bit `sc`/`m` and 2-bit `q`. Each
/// 128-weight half reads 32 bytes of `qs` four times, two bits further each pass; a pass gives
/// 16 weights from bytes 0..16 and 16 from bytes 16..32.
fn decode_q2_k(b: &[u8], out: &mut Vec<f32>) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (half(b, 80), half(b, 82));
    let mut is = 0;
    for q in qs.chunks_exact(32) {
        for shift in [0, 2, 4, 6] {
            for part in [&q[..16], &q[16..]] {
                let sc = scales[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
                out.extend(part.iter().map(|x| dl * ((x >> shift) & 3) as f32 - ml));
            }
        }
    }
}

/// Q3_K: 16 sub-blocks of 16, `w = d·(sc − 32)·(q − 4)` with 6-bit `sc` and 3-bit `q` whose
/// high bit is in `hmask` (a clear bit subtracts 4). The 12 scale bytes hold the low nibbles of
/// scales 0..16 (bytes 0..8, two per byte) and their high two bits (bytes 8..12).
fn decode_q3_k(b: &[u8], out: &mut Vec<f32>) {
    let (hmask, qs, packed) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = half(b, 108);
    let scale = |i: usize| -> i32 {
        let low = (packed[i % 8] >> (4 * (i / 8))) & 0xF;
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        (low | (high << 4)) as i32 - 32
    };
    let mut is = 0;
    let mut m = 1u8;
    for q in qs.chunks_exact(32) {
        for shift in [0, 2, 4, 6] {
            for (offset, part) in [(0, &q[..16]), (16, &q[16..])] {
                let dl = d * scale(is) as f32;
                is += 1;
                out.extend(part.iter().enumerate().map(|(l, x)| {
                    let sub = if hmask[offset + l] & m != 0 { 0 } else { 4 };
                    dl * (((x >> shift) & 3) as i32 - sub) as f32
                }));
            }
            m <<= 1;
        }
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

/// A matrix in MLX's affine layout: `weight` `[rows, cols·bits/32]` u32 words with element `i`
/// of a row at bits `[bits·i, bits·i + bits)` (LSB first, words little-endian; this holds for
/// every width MLX packs), `scales` and `biases` `[rows, cols/group_size]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AffinePlanes {
    /// Bits per element.
    pub bits: i32,
    /// Elements per scale: 32.
    pub group_size: i32,
    /// Packed elements, row-major.
    pub weight: Vec<u32>,
    /// One scale per group, row-major (exact in float16 when `f32_scales` is false).
    pub scales: Vec<f32>,
    /// One bias per group (`w = scale * q + bias`), row-major.
    pub biases: Vec<f32>,
    /// Whether the scales and biases must be stored as float32 to stay exact.
    pub f32_scales: bool,
    /// Set when the values were re-quantized (not an exact repacking).
    pub requantized: Option<Requantized>,
}

/// The error of a re-quantized tensor: the MLX dequantization against ggml's exact decode.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Requantized {
    /// Max |MLX − ggml| over the tensor.
    pub max_abs_error: f32,
    /// Max |ggml| over the tensor (the error's natural scale).
    pub max_abs_weight: f32,
}

impl Requantized {
    /// `max_abs_error / max_abs_weight` (0 for an all-zero tensor).
    pub fn relative(&self) -> f32 {
        if self.max_abs_weight > 0.0 {
            self.max_abs_error / self.max_abs_weight
        } else {
            0.0
        }
    }
}

impl AffinePlanes {
    fn new(bits: i32, f32_scales: bool, n_groups: usize) -> AffinePlanes {
        AffinePlanes {
            bits,
            group_size: GROUP_SIZE,
            weight: Vec::with_capacity(n_groups * bits as usize),
            scales: Vec::with_capacity(n_groups),
            biases: Vec::with_capacity(n_groups),
            f32_scales,
            requantized: None,
        }
    }

    /// Appends one group: 32 codes of `bits` bits are exactly `bits` u32 words.
    fn push(&mut self, scale: f32, bias: f32, codes: &[u8; 32]) {
        let bits = self.bits as u32;
        let mut words = [0u32; 8];
        for (i, c) in codes.iter().enumerate() {
            let at = bits * i as u32;
            let (word, shift) = ((at / 32) as usize, at % 32);
            words[word] |= (*c as u32) << shift;
            if shift + bits > 32 {
                words[word + 1] |= (*c as u32) >> (32 - shift);
            }
        }
        self.weight.extend_from_slice(&words[..bits as usize]);
        self.scales.push(scale);
        self.biases.push(bias);
    }

    /// u32 words per row of `cols` elements.
    pub fn words_per_row(&self, cols: usize) -> usize {
        cols * self.bits as usize / 32
    }

    /// Element `i` (in row-major order over the whole tensor) as MLX dequantizes it.
    pub fn value(&self, i: usize) -> f32 {
        let bits = self.bits as usize;
        let group = i / GROUP_SIZE as usize;
        let at = bits * i;
        let (word, shift) = (at / 32, at % 32);
        let mut code = (self.weight[word] >> shift) as u64;
        if shift + bits > 32 {
            code |= (self.weight[word + 1] as u64) << (32 - shift);
        }
        let code = (code & ((1 << bits) - 1)) as f32;
        self.scales[group] * code + self.biases[group]
    }
}

/// Why a tensor could not be mapped onto MLX affine planes.
#[derive(Debug, Clone, PartialEq)]
pub enum RepackError {
    /// The type has no MLX affine mapping ([`MlxMapping::Dense`] or [`MlxMapping::Unsupported`]).
    NotAffine,
    /// A derived float16 bias does not fit in float16 (a scale beyond f16 range / 128).
    BiasOverflow {
        /// Index of the offending block in the tensor.
        block: usize,
        /// Its scale.
        scale: f32,
    },
}

/// Maps whole blocks of a block-quantized tensor onto MLX affine planes: exactly for
/// [`MlxMapping::Lossless`] types, by re-quantizing the exact decode for
/// [`MlxMapping::Requantized`] ones. Rows are contiguous runs of blocks, so the planes come out
/// row-major for any number of rows.
pub fn repack_affine(ty: GgmlType, bytes: &[u8]) -> Result<AffinePlanes, RepackError> {
    match mlx_mapping(ty) {
        MlxMapping::Lossless { bits, f32_scales } => {
            let n_groups = bytes.len() / ty.type_size() * ty.block_size() / 32;
            let mut planes = AffinePlanes::new(bits, f32_scales, n_groups);
            let mut overflow = None;
            for_each_group(ty, bytes, |g| {
                if !f32_scales && overflow.is_none() && !fits_f16(g.bias) {
                    overflow = Some(RepackError::BiasOverflow {
                        block: planes.scales.len(),
                        scale: g.scale,
                    });
                }
                planes.push(g.scale, g.bias, &g.codes);
            });
            match overflow {
                Some(e) => Err(e),
                None => Ok(planes),
            }
        }
        MlxMapping::Requantized { bits } => {
            let values = dequantize(ty, bytes).ok_or(RepackError::NotAffine)?;
            Ok(requantize(&values, bits))
        }
        MlxMapping::Dense | MlxMapping::Unsupported => Err(RepackError::NotAffine),
    }
}

/// Whether an f32 that came from f16 arithmetic survives the round trip through float16.
fn fits_f16(v: f32) -> bool {
    v.is_nan() || f16::from_f32(v).to_f32() == v
}

/// Affine `bits`-bit, group-32 quantization of `values` (min/max per group, codes rounded to
/// nearest, float32 scales), with the error measured against `values`.
pub fn requantize(values: &[f32], bits: i32) -> AffinePlanes {
    let levels = ((1u32 << bits) - 1) as f32;
    let mut planes = AffinePlanes::new(bits, true, values.len() / 32);
    for group in values.chunks_exact(32) {
        let lo = group.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = group.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let scale = if hi > lo { (hi - lo) / levels } else { 0.0 };
        let mut codes = [0u8; 32];
        if scale > 0.0 {
            for (c, v) in codes.iter_mut().zip(group) {
                *c = ((v - lo) / scale).round().clamp(0.0, levels) as u8;
            }
        }
        planes.push(scale, lo, &codes);
    }
    let mut err = Requantized {
        max_abs_error: 0.0,
        max_abs_weight: 0.0,
    };
    for (i, v) in values.iter().enumerate() {
        err.max_abs_error = err.max_abs_error.max((planes.value(i) - v).abs());
        err.max_abs_weight = err.max_abs_weight.max(v.abs());
    }
    planes.requantized = Some(err);
    planes
}

#[cfg(test)]
pub(crate) mod tests {
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
        assert_eq!((p.bits, p.group_size, p.f32_scales), (4, 32, false));
        assert_eq!(p.scales, vec![0.5]);
        assert_eq!(p.biases, vec![-1.0]);
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
        assert_eq!(p.biases, vec![-32.0]);
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
        assert_eq!(p.biases, vec![-24.0]);
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
        assert!(!can_dequantize(GgmlType::Iq4Nl));
        assert_eq!(
            repack_affine(GgmlType::Iq4Xs, &[0u8; 136]),
            Err(RepackError::NotAffine)
        );
        assert_eq!(
            repack_affine(GgmlType::F16, &[0u8; 2]),
            Err(RepackError::NotAffine)
        );
    }

    /// Deterministic bytes (block payloads for these tests and the importer's).
    pub(crate) fn noise(n: usize, seed: u32) -> Vec<u8> {
        let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x >> 8) as u8
            })
            .collect()
    }

    /// `n` random blocks of `ty` whose f16 fields at `halves` hold small finite values.
    fn random_blocks(ty: GgmlType, n: usize, halves: &[usize]) -> Vec<u8> {
        let size = ty.type_size();
        let mut b = noise(n * size, ty.id());
        for (k, blk) in b.chunks_exact_mut(size).enumerate() {
            for (i, at) in halves.iter().enumerate() {
                let v = f16::from_f32(0.01 * (k % 5 + 1) as f32 * if i == 1 { -0.7 } else { 1.0 });
                blk[*at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        b
    }

    /// (type, f16 field offsets) of every block type this module decodes.
    const BLOCK_TYPES: [(GgmlType, &[usize]); 10] = [
        (GgmlType::Q4_0, &[0]),
        (GgmlType::Q4_1, &[0, 2]),
        (GgmlType::Q5_0, &[0]),
        (GgmlType::Q5_1, &[0, 2]),
        (GgmlType::Q8_0, &[0]),
        (GgmlType::Q2K, &[80, 82]),
        (GgmlType::Q3K, &[108]),
        (GgmlType::Q4K, &[0, 2]),
        (GgmlType::Q5K, &[0, 2]),
        (GgmlType::Q6K, &[208]),
    ];

    #[test]
    fn lossless_types_repack_to_their_exact_decode() {
        for (ty, halves) in BLOCK_TYPES {
            let bytes = random_blocks(ty, 3, halves);
            let want = dequantize(ty, &bytes).unwrap();
            let p = repack_affine(ty, &bytes).unwrap();
            assert_eq!(p.weight.len(), want.len() * p.bits as usize / 32, "{ty}");
            let got: Vec<f32> = (0..want.len()).map(|i| p.value(i)).collect();
            match mlx_mapping(ty) {
                MlxMapping::Lossless { f32_scales, .. } => {
                    assert!(p.requantized.is_none(), "{ty}");
                    // Bit for bit, and the f16 planes survive the cast to float16.
                    assert_eq!(got, want, "{ty}");
                    if !f32_scales {
                        assert!(
                            p.scales.iter().chain(&p.biases).all(|v| fits_f16(*v)),
                            "{ty}"
                        );
                    }
                }
                MlxMapping::Requantized { bits } => {
                    let err = p.requantized.unwrap();
                    let (diff, scale) =
                        got.iter().zip(&want).fold((0f32, 0f32), |(d, s), (g, w)| {
                            (d.max((g - w).abs()), s.max(w.abs()))
                        });
                    assert_eq!(err.max_abs_error, diff, "{ty}");
                    assert_eq!(err.max_abs_weight, scale, "{ty}");
                    // Round to nearest: at most half a step of the group's range.
                    let step = 2.0 * scale / ((1u32 << bits) - 1) as f32;
                    assert!(diff <= step / 2.0 * 1.0001, "{ty}: {diff} > {}", step / 2.0);
                }
                other => panic!("{ty}: {other:?}"),
            }
        }
    }

    /// The K-quants' per-sub-block scales `d·sc` are not representable in float16 in general:
    /// the reason their planes are float32.
    #[test]
    fn k_quant_scales_need_float32() {
        let bytes = random_blocks(GgmlType::Q4K, 8, &[0, 2]);
        let p = repack_affine(GgmlType::Q4K, &bytes).unwrap();
        assert!(p.f32_scales);
        assert!(p.scales.iter().any(|s| !fits_f16(*s)));
    }

    #[test]
    fn q2_k_and_q3_k_hand_computed() {
        // Q2_K: scale byte 0 = (min 3 << 4) | scale 5, d = 0.5, dmin = 0.25; qs[0] = 0b11_10_01_00
        // gives element 0 code 0 (pass 0), element 32 code 1 (pass 1, shift 2), element 64 code
        // 2, element 96 code 3; sub-blocks 2, 4, 6 take scale bytes 2, 4, 6.
        let mut b = vec![0u8; 84];
        b[0] = (3 << 4) | 5;
        b[2] = 1;
        b[4] = 2;
        b[6] = 0x13;
        b[16] = 0b11_10_01_00;
        b[80..82].copy_from_slice(&h(0.5));
        b[82..84].copy_from_slice(&h(0.25));
        let w = dequantize(GgmlType::Q2K, &b).unwrap();
        assert_eq!(w[0], -0.75); // 0.5·5·0 − 0.25·3
        assert_eq!(w[32], 0.5); // 0.5·1·1
        assert_eq!(w[64], 2.0); // 0.5·2·2
        assert_eq!(w[96], 0.5 * 3.0 * 3.0 - 0.25);
        // Q3_K: scale 0 = low nibble of byte 96 | high bits of byte 104 → (4 | 2 << 4) − 32 = 4;
        // scale 9 = high nibble of byte 97 | bits 4..6 of byte 105 → (1 | 3 << 4) − 32 = 17.
        let mut b = vec![0u8; 110];
        b[96] = 4;
        b[104] = 2;
        b[97] = 1 << 4;
        b[105] = 3 << 4;
        b[0] = 1; // hmask bit 0 of element 0 set: no −4
        b[32] = 0b11; // element 0 code 3
        b[108..110].copy_from_slice(&h(0.5));
        let w = dequantize(GgmlType::Q3K, &b).unwrap();
        assert_eq!(w[0], 0.5 * 4.0 * 3.0);
        assert_eq!(w[1], 0.5 * 4.0 * -4.0);
        // Element 144 is in sub-block 9 (second half, pass 0, bytes 16..32), code 0, hmask clear.
        assert_eq!(w[144], 0.5 * 17.0 * -4.0);
    }
}
