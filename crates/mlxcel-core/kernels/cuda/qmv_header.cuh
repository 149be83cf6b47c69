// qmv_header.cuh: helpers for the `qmv` kernel (qmv.cu) and `dequant` (dequant.cu), after
// prelude.cuh in the module mlxcel compiles (see prelude.cuh).

// ---- scalar conversions (overloads pick the type from the generated signature) ----------

__device__ __forceinline__ float qmv_to_float(mlxcel_bf16 v) {
  return mlxcel_bf16_bits_to_float(v.bits);
}
__device__ __forceinline__ float qmv_to_float(mlxcel_f16 v) {
  return mlxcel_f16_bits_to_float(v.bits);
}
__device__ __forceinline__ float qmv_to_float(float v) {
  return v;
}

__device__ __forceinline__ void qmv_store(mlxcel_bf16* p, float v) {
  p->bits = mlxcel_float_to_bf16_bits(v);
}
__device__ __forceinline__ void qmv_store(mlxcel_f16* p, float v) {
  p->bits = mlxcel_float_to_f16_bits(v);
}
__device__ __forceinline__ void qmv_store(float* p, float v) {
  *p = v;
}

// v rounded to T's precision (the pointer only picks the type), as an op returning T would;
// one conversion instruction each way (sm_80+), since the GEMV's folded ops round every
// activation of every block.
__device__ __forceinline__ float qmv_round(const mlxcel_bf16*, float v) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return mlxcel_bf16_bits_to_float(h);
}
__device__ __forceinline__ float qmv_round(const mlxcel_f16*, float v) {
  return mlxcel_f16_bits_to_float(mlxcel_float_to_f16_bits(v));
}
__device__ __forceinline__ float qmv_round(const float*, float v) {
  return v;
}
// qmv_round of two values; for bf16 in one paired conversion (cvt.rn.bf16x2.f32: conversions
// issue at a fraction of the FMA rate, and the GEMV's folded RMSNorm rounds twice per input).
template <typename T>
__device__ __forceinline__ void qmv_round2(const T* like, float& a, float& b) {
  a = qmv_round(like, a);
  b = qmv_round(like, b);
}
__device__ __forceinline__ void qmv_round2(const mlxcel_bf16*, float& a, float& b) {
  uint32_t p;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(b), "f"(a));  // a in the low half
  a = __uint_as_float(p << 16);
  b = __uint_as_float(p & 0xFFFF0000u);
}

// ---- loads -------------------------------------------------------------------------------

// 16 bytes of packed weights through the read-only path. NOALLOC=1 adds L1::no_allocate so the
// streamed weights do not evict x, which every block re-reads, from L1.
template <int NOALLOC>
__device__ __forceinline__ uint4 qmv_load_w(const uint32_t* p) {
  uint4 r;
  if constexpr (NOALLOC != 0) {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
  } else {
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
  }
  return r;
}

// W consecutive 32-bit words (W * 4 bytes, which must be that aligned) in one or two vector loads.
template <int W>
__device__ __forceinline__ void qmv_load_words(const void* p, uint32_t (&u)[W]) {
  static_assert(W == 2 || W == 4 || W == 8, "qmv: 2, 4 or 8 words");
  if constexpr (W == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    u[0] = v.x;
    u[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < W / 4; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      u[4 * i + 0] = v.x;
      u[4 * i + 1] = v.y;
      u[4 * i + 2] = v.z;
      u[4 * i + 3] = v.w;
    }
  }
}

// N consecutive activations as floats (element 2i is the low half of word i).
template <int N>
__device__ __forceinline__ void qmv_load_x(const mlxcel_bf16* p, float (&xf)[N]) {
  uint32_t u[N / 2];
  qmv_load_words<N / 2>(p, u);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    xf[2 * i] = __uint_as_float(u[i] << 16);
    xf[2 * i + 1] = __uint_as_float(u[i] & 0xFFFF0000u);
  }
}
template <int N>
__device__ __forceinline__ void qmv_load_x(const mlxcel_f16* p, float (&xf)[N]) {
  uint32_t u[N / 2];
  qmv_load_words<N / 2>(p, u);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    xf[2 * i] = mlxcel_f16_bits_to_float((unsigned short)(u[i] & 0xFFFFu));
    xf[2 * i + 1] = mlxcel_f16_bits_to_float((unsigned short)(u[i] >> 16));
  }
}
template <int N>
__device__ __forceinline__ void qmv_load_x(const float* p, float (&xf)[N]) {
  uint32_t u[N];
  qmv_load_words<N>(p, u);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    xf[i] = __uint_as_float(u[i]);
  }
}

template <int N>
__device__ __forceinline__ float qmv_sum(const float (&a)[N]) {
  float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
  for (int i = 0; i < N; i += 2) {
    s0 += a[i];
    if (i + 1 < N) {
      s1 += a[i + 1];
    }
  }
  return s0 + s1;
}

// xsum += sum(a); with HI also xhi += a[4] + .. + a[7] (the FAST layout, 8 elements).
template <bool HI, int N>
__device__ __forceinline__ void qmv_add_sums(const float (&a)[N], float& xsum, float& xhi) {
  if constexpr (HI) {
    static_assert(N == 8, "qmv: FAST needs 8 elements per word");
    const float h = (a[4] + a[5]) + (a[6] + a[7]);
    xhi += h;
    xsum += ((a[0] + a[1]) + (a[2] + a[3])) + h;
  } else {
    xsum += qmv_sum(a);
  }
}

__device__ __forceinline__ uint32_t qmv_word(const uint4& v, int k) {
  return k == 0 ? v.x : (k == 1 ? v.y : (k == 2 ? v.z : v.w));
}

// ---- dequantize + dot of one packed word -------------------------------------------------

// Element j of a word sits at bits BITS*j .. BITS*j+BITS-1. Instead of shift/and/I2F (the
// int->float convert is quarter rate), the quantized value q is moved into the top of a
// float mantissa under a fixed exponent, which yields the exact float QOFF + q:
//   BITS=4: bits 16..19 under 0x43000000 (128.0, ulp 1 there)  -> 128 + q
//   BITS=8: bits 15..22 under 0x43800000 (256.0, ulp 1 there)  -> 256 + q
// The caller removes QOFF * sum(x) once per 16-byte chunk (shared by all rows of the block).
// Only left shifts (which ptxas may put on the FMA pipe as IMAD.SHL) and one right shift per
// word are used, to spare the integer ALU pipe.
//
// FAST=1 (4 bits only): one LOP3 builds two elements at once, v = (t & 0x000F000F) |
// 0x43004300. Its low half shifted up is exactly 128 + q_lo; v itself read as a float is
// 128 + 0.26171875 + q_hi + q_lo / 65536, i.e. the high element carries an extra constant
// (removed by the caller through the sum of the high-half activations) and a perturbation of
// at most 15/65536 on a value in 0..15 (relative error ~2e-5 on the result, far below bf16's
// 4e-3, but not float32-exact: use FAST=0 for float32 outputs).

// ((w >> 4p) & 0x000F000F) | 0x43004300 (hi) in one LOP3 after the shift, and its low half
// moved up (lo) by a multiply on the FMA pipe. In PTX because NVVM splits the AND-OR into two
// LOP3s (SASS takes one immediate) and rewrites the shifted low half as another shift, AND and
// OR: 4.5 integer-pipe instructions per pair of weights instead of 2, on the pipe that bounds the
// decode GEMV (it runs at half the FMA pipe's rate). `up` is 65536 in a register ptxas cannot
// see through (else it turns the multiply back into an integer-pipe shift): qmv_up().
__device__ __forceinline__ void qmv_pair4(uint32_t w, int p, uint32_t up, uint32_t& lo,
                                          uint32_t& hi) {
  asm("{\n\t.reg .b32 t;\n\t"
      "shr.b32 t, %2, %3;\n\t"
      "lop3.b32 %1, t, 0x000F000F, 0x43004300, 0xEA;\n\t"
      "mul.lo.u32 %0, %1, %4;\n\t}"
      : "=r"(lo), "=r"(hi)
      : "r"(w), "r"(4 * p), "r"(up));
}
// 65536 as qmv_pair4's `up`, from any non-negative kernel argument `n` (the compiler cannot
// prove n >= 0, so it cannot fold the value into an immediate).
__device__ __forceinline__ uint32_t qmv_up(int n) {
  return 65536u | ((uint32_t)n >> 31);
}

// Returns acc + sum_j (offset_j + q_j) * xf[j]; `up`: qmv_up()'s 65536 (FAST only).
template <int BITS, int FAST>
__device__ __forceinline__ float qmv_dot_word(uint32_t w, const float* xf, float acc,
                                              uint32_t up) {
  float a0 = acc, a1 = 0.0f;
  if constexpr (BITS == 4 && FAST != 0) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      uint32_t lo, v;
      qmv_pair4(w, p, up, lo, v);
      a0 = fmaf(__uint_as_float(lo), xf[p], a0);        // element p
      a1 = fmaf(__uint_as_float(v), xf[p + 4], a1);     // element p + 4
    }
  } else if constexpr (BITS == 4) {
    const uint32_t hi = w >> 16;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t t = (j < 4) ? (w << (16 - 4 * j)) : (j == 4 ? w : (hi << (32 - 4 * j)));
      const float f = __uint_as_float((t & 0x000F0000u) | 0x43000000u);
      if (j & 1) {
        a1 = fmaf(f, xf[j], a1);
      } else {
        a0 = fmaf(f, xf[j], a0);
      }
    }
  } else {
    static_assert(BITS == 8, "qmv: BITS must be 4 or 8");
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t t = (j < 2) ? (w << (15 - 8 * j)) : (w >> (8 * j - 15));
      const float f = __uint_as_float((t & 0x007F8000u) | 0x43800000u);
      if (j & 1) {
        a1 = fmaf(f, xf[j], a1);
      } else {
        a0 = fmaf(f, xf[j], a0);
      }
    }
  }
  return a0 + a1;
}

// ---- the same for several activation rows ------------------------------------------------
//
// A decode batch multiplies each weight word with several activation rows. Unpacking a word
// once and reusing its floats for every row (instead of qmv_dot_word per row) saves most of
// the integer work, which is what bounds a many-row GEMV. qmv_dot_unpacked accumulates in
// exactly qmv_dot_word's order (two partial sums, the same element split), so each row's
// result is bitwise the one-row kernel's.

// The 32/BITS weights of `w` as the floats qmv_dot_word multiplies.
template <int BITS, int FAST>
__device__ __forceinline__ void qmv_unpack_word(uint32_t w, float (&q)[32 / BITS], uint32_t up) {
  if constexpr (BITS == 4 && FAST != 0) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      uint32_t lo, v;
      qmv_pair4(w, p, up, lo, v);
      q[p] = __uint_as_float(lo);
      q[p + 4] = __uint_as_float(v);
    }
  } else if constexpr (BITS == 4) {
    const uint32_t hi = w >> 16;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t t = (j < 4) ? (w << (16 - 4 * j)) : (j == 4 ? w : (hi << (32 - 4 * j)));
      q[j] = __uint_as_float((t & 0x000F0000u) | 0x43000000u);
    }
  } else {
    static_assert(BITS == 8, "qmv: BITS must be 4 or 8");
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t t = (j < 2) ? (w << (15 - 8 * j)) : (w >> (8 * j - 15));
      q[j] = __uint_as_float((t & 0x007F8000u) | 0x43800000u);
    }
  }
}

// acc + sum_j q[j] * xf[j] for unpacked weights, in qmv_dot_word<BITS, FAST>'s order.
template <int BITS, int FAST>
__device__ __forceinline__ float qmv_dot_unpacked(const float (&q)[32 / BITS], const float* xf,
                                                  float acc) {
  float a0 = acc, a1 = 0.0f;
  if constexpr (BITS == 4 && FAST != 0) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      a0 = fmaf(q[p], xf[p], a0);
      a1 = fmaf(q[p + 4], xf[p + 4], a1);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 32 / BITS; ++j) {
      if (j & 1) {
        a1 = fmaf(q[j], xf[j], a1);
      } else {
        a0 = fmaf(q[j], xf[j], a0);
      }
    }
  }
  return a0 + a1;
}

// ---- tensor-core operands (qmv_mma.cu, qmv_tc.cu) -------------------------------------

// A T value from its bits.
template <typename T>
__device__ __forceinline__ float qmm_to_float(uint32_t bits) {
  T v;
  v.bits = (unsigned short)bits;
  return qmv_to_float(v);
}

// Per-type constants and instructions: the nibble pair as exact T codes, the mma, and ones.
template <typename T>
struct qmm_ops;

template <>
struct qmm_ops<mlxcel_bf16> {
  static constexpr uint32_t ONES = 0x3F803F80u;  // bf16 (1, 1)
  static constexpr float OFF = 128.0f;
  // ((w >> s) & 0x000F000F) | 0x43004300 is bf16 (128 + q_lo, 128 + q_hi), exactly (ulp 1).
  static __device__ __forceinline__ uint32_t pair(uint32_t w, int s) {
    return ((w >> s) & 0x000F000Fu) | 0x43004300u;
  }
  // The same minus 128: the codes q themselves, exactly.
  static __device__ __forceinline__ uint32_t codes(uint32_t w, int s) {
    const uint32_t v = pair(w, s);
    uint32_t q;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(q) : "r"(v), "r"(0x3F803F80u), "r"(0xC300C300u));
    return q;
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct qmm_ops<mlxcel_f16> {
  static constexpr uint32_t ONES = 0x3C003C00u;  // f16 (1, 1)
  static constexpr float OFF = 1024.0f;
  // ((w >> s) & 0x000F000F) | 0x64006400 is f16 (1024 + q_lo, 1024 + q_hi), exactly (ulp 1).
  static __device__ __forceinline__ uint32_t pair(uint32_t w, int s) {
    return ((w >> s) & 0x000F000Fu) | 0x64006400u;
  }
  // The same minus 1024: the codes q themselves, exactly.
  static __device__ __forceinline__ uint32_t codes(uint32_t w, int s) {
    const uint32_t v = pair(w, s);
    uint32_t q;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(q) : "r"(v), "r"(0x3C003C00u), "r"(0xE400E400u));
    return q;
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
