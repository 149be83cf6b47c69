//! ggml tensor types: ids as stored in GGUF, block sizes and bytes per block.

/// A ggml tensor type. Every id the GGUF format has defined is named, so that an unsupported
/// type is reported by name; which ones can be imported is decided in [`super::blocks`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half precision.
    F16,
    /// 4-bit, blocks of 32 with an f16 scale (`w = d * (q - 8)`).
    Q4_0,
    /// 4-bit, blocks of 32 with an f16 scale and minimum (`w = d * q + m`).
    Q4_1,
    /// 5-bit, blocks of 32 with an f16 scale.
    Q5_0,
    /// 5-bit, blocks of 32 with an f16 scale and minimum.
    Q5_1,
    /// 8-bit, blocks of 32 with an f16 scale (`w = d * q`).
    Q8_0,
    /// 8-bit, blocks of 32 with a scale and the block sum (an activation format).
    Q8_1,
    /// `Q2_K`: 2-bit k-quant, super-blocks of 256.
    Q2K,
    /// `Q3_K`: 3-bit k-quant, super-blocks of 256.
    Q3K,
    /// `Q4_K`: 4-bit k-quant, super-blocks of 256 with 6-bit sub-block scales and minimums.
    Q4K,
    /// `Q5_K`: 5-bit k-quant, super-blocks of 256.
    Q5K,
    /// `Q6_K`: 6-bit k-quant, super-blocks of 256 with 8-bit sub-block scales.
    Q6K,
    /// `Q8_K`: 8-bit k-quant (an intermediate format for dot products).
    Q8K,
    /// `IQ2_XXS`: 2.06 bits per weight, lattice codebook.
    Iq2Xxs,
    /// `IQ2_XS`: 2.31 bits per weight, lattice codebook.
    Iq2Xs,
    /// `IQ3_XXS`: 3.06 bits per weight, lattice codebook.
    Iq3Xxs,
    /// `IQ1_S`: 1.56 bits per weight.
    Iq1S,
    /// `IQ4_NL`: 4-bit non-linear codebook, blocks of 32.
    Iq4Nl,
    /// `IQ3_S`: 3.44 bits per weight, lattice codebook.
    Iq3S,
    /// `IQ2_S`: 2.5 bits per weight, lattice codebook.
    Iq2S,
    /// `IQ4_XS`: 4-bit non-linear codebook, super-blocks of 256.
    Iq4Xs,
    /// 8-bit integer.
    I8,
    /// 16-bit integer.
    I16,
    /// 32-bit integer.
    I32,
    /// 64-bit integer.
    I64,
    /// 64-bit float.
    F64,
    /// `IQ1_M`: 1.75 bits per weight.
    Iq1M,
    /// bfloat16.
    Bf16,
    /// `TQ1_0`: ternary, 1.69 bits per weight.
    Tq1_0,
    /// `TQ2_0`: ternary, 2 bits per weight.
    Tq2_0,
    /// `MXFP4`: OCP microscaling FP4 (E2M1), blocks of 32 with an E8M0 scale.
    Mxfp4,
}

/// `(type, id, name, elements per block, bytes per block)`.
const TABLE: &[(GgmlType, u32, &str, usize, usize)] = &[
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q8_1, 9, "Q8_1", 32, 36),
    (GgmlType::Q2K, 10, "Q2_K", 256, 84),
    (GgmlType::Q3K, 11, "Q3_K", 256, 110),
    (GgmlType::Q4K, 12, "Q4_K", 256, 144),
    (GgmlType::Q5K, 13, "Q5_K", 256, 176),
    (GgmlType::Q6K, 14, "Q6_K", 256, 210),
    (GgmlType::Q8K, 15, "Q8_K", 256, 292),
    (GgmlType::Iq2Xxs, 16, "IQ2_XXS", 256, 66),
    (GgmlType::Iq2Xs, 17, "IQ2_XS", 256, 74),
    (GgmlType::Iq3Xxs, 18, "IQ3_XXS", 256, 98),
    (GgmlType::Iq1S, 19, "IQ1_S", 256, 50),
    (GgmlType::Iq4Nl, 20, "IQ4_NL", 32, 18),
    (GgmlType::Iq3S, 21, "IQ3_S", 256, 110),
    (GgmlType::Iq2S, 22, "IQ2_S", 256, 82),
    (GgmlType::Iq4Xs, 23, "IQ4_XS", 256, 136),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::Iq1M, 29, "IQ1_M", 256, 56),
    (GgmlType::Bf16, 30, "BF16", 1, 2),
    (GgmlType::Tq1_0, 34, "TQ1_0", 256, 54),
    (GgmlType::Tq2_0, 35, "TQ2_0", 256, 66),
    (GgmlType::Mxfp4, 39, "MXFP4", 32, 17),
];

impl GgmlType {
    fn row(self) -> &'static (GgmlType, u32, &'static str, usize, usize) {
        // Every variant has exactly one row in TABLE (checked by a unit test).
        TABLE.iter().find(|r| r.0 == self).unwrap_or(&TABLE[0])
    }

    /// The type with GGUF id `id`, or `None` for ids never defined or since removed.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TABLE.iter().find(|r| r.1 == id).map(|r| r.0)
    }

    /// The type's id as stored in a GGUF tensor info (the inverse of [`GgmlType::from_id`]).
    pub fn id(self) -> u32 {
        self.row().1
    }

    /// llama.cpp's name for the type (`Q4_K`, `BF16`, ...).
    pub fn name(self) -> &'static str {
        self.row().2
    }

    /// Elements per block (1 for plain types).
    pub fn block_size(self) -> usize {
        self.row().3
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.row().4
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_consistent() {
        for (i, row) in TABLE.iter().enumerate() {
            assert_eq!(GgmlType::from_id(row.1), Some(row.0));
            assert_eq!(row.0.row().1, row.1, "{}", row.2);
            assert!(TABLE[i + 1..].iter().all(|r| r.0 != row.0 && r.1 != row.1));
        }
        assert_eq!(GgmlType::from_id(4), None, "Q4_2 was removed");
        assert_eq!(GgmlType::Q4_1.type_size(), 2 + 2 + 16);
        assert_eq!(GgmlType::Q8_0.type_size(), 2 + 32);
        assert_eq!(GgmlType::Q4K.type_size(), 2 + 2 + 12 + 128);
        assert_eq!(GgmlType::Q5K.type_size(), 2 + 2 + 12 + 32 + 128);
        assert_eq!(GgmlType::Q6K.type_size(), 128 + 64 + 16 + 2);
    }
}
