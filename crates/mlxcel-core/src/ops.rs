//! The ops whose signatures do not fit the table-driven families of `ops.table`: shape and
//! indexing ops, quantized matmuls, fused `fast` kernels and random sampling. Element-wise and
//! reduction ops are methods on [`Array`] generated from `ops.table`.

use std::ptr;

use crate::array::{check_shape, ArrayList};
use crate::ffi::bridge::{self, MlxArray};
use crate::{Array, Dtype, Error, Result};

fn wrap(raw: cxx::UniquePtr<MlxArray>) -> Array {
    Array::from_raw(raw)
}

fn opt_ptr(a: Option<&Array>) -> *const MlxArray {
    a.map_or(ptr::null(), Array::as_ptr)
}

/// MLX's quantization formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantMode {
    /// Per-group scale and bias, 1–8 bits (`w ≈ scale * q + bias`).
    Affine,
    /// OCP microscaling FP4 (E2M1), 32-element groups, E8M0 scales.
    Mxfp4,
    /// OCP microscaling FP8 (E4M3), 32-element groups, E8M0 scales.
    Mxfp8,
    /// NVIDIA FP4 (E2M1), 16-element groups, FP8 (E4M3) scales.
    Nvfp4,
}

impl QuantMode {
    /// The mode string MLX and mlx-lm's `config.json` use.
    pub fn name(self) -> &'static str {
        match self {
            QuantMode::Affine => "affine",
            QuantMode::Mxfp4 => "mxfp4",
            QuantMode::Mxfp8 => "mxfp8",
            QuantMode::Nvfp4 => "nvfp4",
        }
    }

    /// Parses the mode string MLX and mlx-lm's `config.json` use (the inverse of
    /// [`QuantMode::name`]); `None` for an unknown mode.
    ///
    /// ```
    /// use mlxcel_core::ops::QuantMode;
    ///
    /// assert_eq!(QuantMode::from_name("mxfp4"), Some(QuantMode::Mxfp4));
    /// assert_eq!(QuantMode::Mxfp4.fixed_layout(), Some((32, 4)));
    /// assert_eq!(QuantMode::from_name("int4"), None);
    /// ```
    pub fn from_name(name: &str) -> Option<QuantMode> {
        Some(match name {
            "affine" => QuantMode::Affine,
            "mxfp4" => QuantMode::Mxfp4,
            "mxfp8" => QuantMode::Mxfp8,
            "nvfp4" => QuantMode::Nvfp4,
            _ => return None,
        })
    }

    /// `(group_size, bits)` fixed by the format, or `None` for affine (chosen per tensor).
    pub fn fixed_layout(self) -> Option<(i32, i32)> {
        match self {
            QuantMode::Affine => None,
            QuantMode::Mxfp4 => Some((32, 4)),
            QuantMode::Mxfp8 => Some((32, 8)),
            QuantMode::Nvfp4 => Some((16, 4)),
        }
    }

    /// Whether the format stores a per-group bias plane (only affine does).
    pub fn has_biases(self) -> bool {
        self == QuantMode::Affine
    }
}

impl std::fmt::Display for QuantMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How a matrix is quantized: the parameters every quantized op takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantSpec {
    /// The format.
    pub mode: QuantMode,
    /// Elements of the last axis that share one scale (and bias): 32, 64 or 128 for affine, fixed
    /// by the fp modes.
    pub group_size: i32,
    /// Bits per stored element (affine: up to 8, as the MLX build supports; fixed by the fp
    /// modes).
    pub bits: i32,
}

impl QuantSpec {
    /// An affine spec with the given group size and bit width.
    pub fn affine(group_size: i32, bits: i32) -> QuantSpec {
        QuantSpec {
            mode: QuantMode::Affine,
            group_size,
            bits,
        }
    }

    /// The spec of a fixed-layout mode (mxfp4, mxfp8, nvfp4); `None` for affine.
    pub fn fixed(mode: QuantMode) -> Option<QuantSpec> {
        mode.fixed_layout().map(|(group_size, bits)| QuantSpec {
            mode,
            group_size,
            bits,
        })
    }
}

/// The planes `quantize` produces.
#[derive(Debug, Clone)]
pub struct Quantized {
    /// The packed elements: `uint32` words, `[.., rows, cols * bits / 32]` for a `[.., rows, cols]`
    /// input.
    pub weight: Array,
    /// One scale per group, `[.., rows, cols / group_size]` (the input's dtype for affine, `uint8`
    /// E8M0/E4M3 codes for the fp modes).
    pub scales: Array,
    /// Present for affine only.
    pub biases: Option<Array>,
}

/// How `scaled_dot_product_attention` masks scores.
#[derive(Debug, Clone, Copy)]
pub enum AttentionMask<'a> {
    /// No mask: every query sees every key.
    None,
    /// Causal, aligned to the end: query i sees keys up to `kv_len - q_len + i`.
    Causal,
    /// Boolean (true = keep) or additive float mask broadcastable to `[B, H, Lq, Lk]`.
    Array(&'a Array),
}

/// Rotary embedding parameters for [`Array::rope`].
#[derive(Debug, Clone, Copy)]
pub struct Rope<'a> {
    /// Number of leading feature dims rotated (partial rotary when < head dim).
    pub dims: i32,
    /// Rotate interleaved pairs (GPT-J/llama.cpp style) instead of the two halves.
    pub traditional: bool,
    /// Frequency base; ignored when `freqs` is given.
    pub base: f32,
    /// Position scale (linear rope scaling divides positions by the factor: scale = 1/factor).
    pub scale: f32,
    /// Per-pair frequencies `[dims/2]` (MLX divides positions by them) that replace `base`:
    /// how llama3, yarn and longrope scaling are expressed.
    pub freqs: Option<&'a Array>,
}

impl Array {
    /// Converts the elements to `dtype` (a no-op when the dtype already matches).
    pub fn astype(&self, dtype: Dtype) -> Result<Array> {
        Ok(wrap(bridge::astype(self.as_ref(), dtype)?))
    }

    /// Reinterprets the bytes as another dtype (the last axis scales by the size ratio).
    pub fn view(&self, dtype: Dtype) -> Result<Array> {
        Ok(wrap(bridge::view_as(self.as_ref(), dtype)?))
    }

    /// Reshapes; at most one dimension may be -1 (inferred).
    pub fn reshape(&self, shape: &[i32]) -> Result<Array> {
        Ok(wrap(bridge::reshape(self.as_ref(), shape)?))
    }

    /// Permutes the axes.
    pub fn transpose(&self, axes: &[i32]) -> Result<Array> {
        Ok(wrap(bridge::transpose(self.as_ref(), axes)?))
    }

    /// Swaps the last two axes.
    pub fn t(&self) -> Result<Array> {
        let n = self.ndim() as i32;
        if n < 2 {
            return Err(Error::Invalid(format!(
                "t() needs at least 2 dims, shape is {:?}",
                self.shape()
            )));
        }
        let mut axes: Vec<i32> = (0..n).collect();
        axes.swap((n - 1) as usize, (n - 2) as usize);
        self.transpose(&axes)
    }

    /// Broadcasts to `shape` with NumPy rules (a view, no copy); an error when the shapes are
    /// incompatible or `shape` has a negative dimension.
    pub fn broadcast_to(&self, shape: &[i32]) -> Result<Array> {
        check_shape(shape)?;
        Ok(wrap(bridge::broadcast_to(self.as_ref(), shape)?))
    }

    /// Inserts size-1 axes at `axes` (positions in the result).
    pub fn expand_dims(&self, axes: &[i32]) -> Result<Array> {
        Ok(wrap(bridge::expand_dims(self.as_ref(), axes)?))
    }

    /// Removes the size-1 axes `axes`; an error when one of them is not of size 1.
    pub fn squeeze(&self, axes: &[i32]) -> Result<Array> {
        Ok(wrap(bridge::squeeze(self.as_ref(), axes)?))
    }

    /// A row-major copy of a view (a no-op for arrays that already are).
    pub fn contiguous(&self) -> Result<Array> {
        Ok(wrap(bridge::contiguous(self.as_ref())?))
    }

    /// Strided slice `[start, stop)` with `strides` along every axis.
    pub fn slice(&self, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
        Ok(wrap(bridge::slice(self.as_ref(), start, stop, strides)?))
    }

    /// Slice `[start, stop)` of one axis, the other axes whole.
    pub fn slice_axis(&self, axis: i32, start: i32, stop: i32) -> Result<Array> {
        let shape = self.shape();
        let n = shape.len() as i32;
        let ax = if axis < 0 { axis + n } else { axis };
        if ax < 0 || ax >= n {
            return Err(Error::Invalid(format!(
                "axis {axis} out of range for shape {shape:?}"
            )));
        }
        let mut lo = vec![0; shape.len()];
        let mut hi = shape.clone();
        lo[ax as usize] = start;
        hi[ax as usize] = stop;
        self.slice(&lo, &hi, &vec![1; shape.len()])
    }

    /// Slice whose start is an array (decided at eval time): `sizes` elements along `axes`.
    pub fn slice_dynamic(&self, start: &Array, axes: &[i32], sizes: &[i32]) -> Result<Array> {
        Ok(wrap(bridge::slice_dynamic(
            self.as_ref(),
            start.as_ref(),
            axes,
            sizes,
        )?))
    }

    /// A copy of `self` with `[start, stop)` (strided) replaced by `update`.
    pub fn slice_update(
        &self,
        update: &Array,
        start: &[i32],
        stop: &[i32],
        strides: &[i32],
    ) -> Result<Array> {
        Ok(wrap(bridge::slice_update(
            self.as_ref(),
            update.as_ref(),
            start,
            stop,
            strides,
        )?))
    }

    /// [`Array::slice_update`] with the start given as an array along `axes`.
    pub fn slice_update_dynamic(
        &self,
        update: &Array,
        start: &Array,
        axes: &[i32],
    ) -> Result<Array> {
        Ok(wrap(bridge::slice_update_dynamic(
            self.as_ref(),
            update.as_ref(),
            start.as_ref(),
            axes,
        )?))
    }

    /// Splits at the given indices along `axis`.
    pub fn split_at(&self, indices: &[i32], axis: i32) -> Result<Vec<Array>> {
        ArrayList::from_raw(bridge::split_at(self.as_ref(), indices, axis)?).into_vec()
    }

    /// Splits into `parts` equal pieces along `axis`.
    pub fn split_equal(&self, parts: i32, axis: i32) -> Result<Vec<Array>> {
        ArrayList::from_raw(bridge::split_equal(self.as_ref(), parts, axis)?).into_vec()
    }

    /// Gathers slices along `axis` at `indices` (embedding lookup: `table.take(ids, 0)`).
    pub fn take(&self, indices: &Array, axis: i32) -> Result<Array> {
        Ok(wrap(bridge::take(self.as_ref(), indices.as_ref(), axis)?))
    }

    /// Picks, along `axis`, the elements `indices` names (same rank as `self`, broadcast on the
    /// other axes); the result has the shape of `indices` on `axis`.
    pub fn take_along_axis(&self, indices: &Array, axis: i32) -> Result<Array> {
        Ok(wrap(bridge::take_along_axis(
            self.as_ref(),
            indices.as_ref(),
            axis,
        )?))
    }

    /// A copy of `self` with `values` written at `indices` along `axis` (the inverse of
    /// [`Array::take_along_axis`]).
    pub fn put_along_axis(&self, indices: &Array, values: &Array, axis: i32) -> Result<Array> {
        Ok(wrap(bridge::put_along_axis(
            self.as_ref(),
            indices.as_ref(),
            values.as_ref(),
            axis,
        )?))
    }

    /// `beta * self + alpha * (a @ b)`.
    pub fn addmm(&self, a: &Array, b: &Array, alpha: f32, beta: f32) -> Result<Array> {
        Ok(wrap(bridge::addmm(
            self.as_ref(),
            a.as_ref(),
            b.as_ref(),
            alpha,
            beta,
        )?))
    }

    /// Softmax over `axes`; `precise` accumulates in f32 for half-precision inputs.
    pub fn softmax(&self, axes: &[i32], precise: bool) -> Result<Array> {
        Ok(wrap(bridge::softmax(self.as_ref(), axes, precise)?))
    }

    /// Index (`uint32`) of the largest element along `axis`; `keepdims` keeps the axis as size 1.
    pub fn argmax(&self, axis: i32, keepdims: bool) -> Result<Array> {
        Ok(wrap(bridge::argmax(self.as_ref(), axis, keepdims)?))
    }

    /// Index (`uint32`) of the smallest element along `axis`; `keepdims` keeps the axis as size 1.
    pub fn argmin(&self, axis: i32, keepdims: bool) -> Result<Array> {
        Ok(wrap(bridge::argmin(self.as_ref(), axis, keepdims)?))
    }

    /// Indices that partition `axis` around its `kth` smallest element.
    pub fn argpartition(&self, kth: i32, axis: i32) -> Result<Array> {
        Ok(wrap(bridge::argpartition(self.as_ref(), kth, axis)?))
    }

    /// The `k` largest values along `axis` (unordered).
    pub fn topk(&self, k: i32, axis: i32) -> Result<Array> {
        Ok(wrap(bridge::topk(self.as_ref(), k, axis)?))
    }

    /// The elements sorted ascending along `axis`.
    pub fn sort(&self, axis: i32) -> Result<Array> {
        Ok(wrap(bridge::sort(self.as_ref(), axis)?))
    }

    /// Indices (`uint32`) that sort `axis` ascending.
    pub fn argsort(&self, axis: i32) -> Result<Array> {
        Ok(wrap(bridge::argsort(self.as_ref(), axis)?))
    }

    /// Cumulative sum along `axis`; `reverse` sums from the end, `inclusive` includes each
    /// element in its own sum (`false`: shifted by one, starting at 0).
    pub fn cumsum(&self, axis: i32, reverse: bool, inclusive: bool) -> Result<Array> {
        Ok(wrap(bridge::cumsum(
            self.as_ref(),
            axis,
            reverse,
            inclusive,
        )?))
    }

    /// Limits values to `[lo, hi]` (either bound optional).
    pub fn clip(&self, lo: Option<&Array>, hi: Option<&Array>) -> Result<Array> {
        // SAFETY: the pointers are null or borrowed from live arrays for the call's duration.
        Ok(wrap(unsafe {
            bridge::clip(self.as_ref(), opt_ptr(lo), opt_ptr(hi))?
        }))
    }

    /// 1-D convolution, channels last: input `[N, L, C_in]`, weight `[C_out, K, C_in/groups]`.
    pub fn conv1d(
        &self,
        weight: &Array,
        stride: i32,
        padding: i32,
        dilation: i32,
        groups: i32,
    ) -> Result<Array> {
        Ok(wrap(bridge::conv1d(
            self.as_ref(),
            weight.as_ref(),
            stride,
            padding,
            dilation,
            groups,
        )?))
    }

    /// `self + value`, `value` in this array's dtype.
    pub fn add_scalar(&self, value: f64) -> Result<Array> {
        self.add(&self.scalar_like(value)?)
    }

    /// `self * value`, `value` in this array's dtype.
    pub fn mul_scalar(&self, value: f64) -> Result<Array> {
        self.multiply(&self.scalar_like(value)?)
    }

    /// Quantizes the last axis of a matrix (or stack of matrices).
    pub fn quantize(&self, spec: QuantSpec) -> Result<Quantized> {
        let planes = ArrayList::from_raw(bridge::quantize(
            self.as_ref(),
            spec.group_size,
            spec.bits,
            spec.mode.name(),
        )?)
        .into_vec()?;
        let mut planes = planes.into_iter();
        match (planes.next(), planes.next(), planes.next()) {
            (Some(weight), Some(scales), biases) => Ok(Quantized {
                weight,
                scales,
                biases,
            }),
            _ => Err(Error::Mlx("quantize returned fewer than two planes".into())),
        }
    }

    /// Rotary position embedding over the last axis; `offset` is the position of the first row
    /// along axis -2.
    pub fn rope(&self, rope: &Rope<'_>, offset: i32) -> Result<Array> {
        // SAFETY: `freqs` is null or borrowed for the call's duration.
        Ok(wrap(unsafe {
            bridge::rope(
                self.as_ref(),
                rope.dims,
                rope.traditional,
                rope.base,
                rope.freqs.is_none(),
                rope.scale,
                offset,
                opt_ptr(rope.freqs),
            )?
        }))
    }

    /// [`Array::rope`] with one offset per batch row: `offsets` `[B]` (int32) gives the position
    /// of row `b`'s first entry along axis -2 (conversations at different positions decoded as
    /// one batch).
    pub fn rope_at_offsets(&self, rope: &Rope<'_>, offsets: &Array) -> Result<Array> {
        // SAFETY: `freqs` is null or borrowed for the call's duration.
        Ok(wrap(unsafe {
            bridge::rope_offsets(
                self.as_ref(),
                rope.dims,
                rope.traditional,
                rope.base,
                rope.freqs.is_none(),
                rope.scale,
                offsets.as_ref(),
                opt_ptr(rope.freqs),
            )?
        }))
    }

    /// RMS normalisation over the last axis, optionally scaled by `weight`.
    pub fn rms_norm(&self, weight: Option<&Array>, eps: f32) -> Result<Array> {
        // SAFETY: `weight` is null or borrowed for the call's duration.
        Ok(wrap(unsafe {
            bridge::rms_norm(self.as_ref(), opt_ptr(weight), eps)?
        }))
    }

    /// Layer normalisation over the last axis with optional affine parameters.
    pub fn layer_norm(
        &self,
        weight: Option<&Array>,
        bias: Option<&Array>,
        eps: f32,
    ) -> Result<Array> {
        // SAFETY: `weight` and `bias` are null or borrowed for the call's duration.
        Ok(wrap(unsafe {
            bridge::layer_norm(self.as_ref(), opt_ptr(weight), opt_ptr(bias), eps)?
        }))
    }
}

/// Dequantizes planes produced by [`Array::quantize`] (or read from an MLX checkpoint).
/// `dtype` defaults to the scales' dtype (float16 for the fp modes' byte scales).
pub fn dequantize(
    weight: &Array,
    scales: &Array,
    biases: Option<&Array>,
    spec: QuantSpec,
    dtype: Option<Dtype>,
) -> Result<Array> {
    if let Some(d) = dtype {
        if crate::cuda_kernels::dequant_applies(weight, scales, biases, spec, d)? {
            let biases = biases.expect("dequant_applies() requires biases");
            return crate::cuda_kernels::dequantize(weight, scales, biases, spec, d);
        }
    }
    let out = dtype.map_or(-1, |d| d.repr);
    // SAFETY: `biases` is null or borrowed for the call's duration.
    Ok(wrap(unsafe {
        bridge::dequantize(
            weight.as_ref(),
            scales.as_ref(),
            opt_ptr(biases),
            spec.group_size,
            spec.bits,
            spec.mode.name(),
            out,
        )?
    }))
}

/// Activations of gated MLPs, `act(gate) * up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatedActivation {
    /// SiLU (`x * sigmoid(x)`), as in SwiGLU.
    Silu,
    /// The tanh approximation of GELU.
    GeluTanh,
    /// The exact (erf) GELU.
    Gelu,
}

/// `act(gate) * up` of `x = [gate | up]` along its last axis (a fused gate/up projection's
/// output), `[.., last / 2]`. SiLU on a GPU runs on mlxcel's kernel (`MLXCEL_CUDA_ROWS`), which
/// ships compiled: MLX would JIT-compile its fused kernel on a machine's first prompt.
pub fn gated_activation_halves(kind: GatedActivation, x: &Array) -> Result<Array> {
    if kind == GatedActivation::Silu && crate::cuda_kernels::silu_halves_applies(x)? {
        return crate::cuda_kernels::silu_halves(x);
    }
    let parts = x.split_at(&[x.dim(-1)? / 2], -1)?;
    gated_activation(kind, &parts[0], &parts[1])
}

/// `table[ids]` along the table's first axis (an embedding lookup), `[..ids, row_len]`. On a GPU
/// a 2-D table runs on mlxcel's kernel (`MLXCEL_CUDA_ROWS`), which ships compiled: MLX would
/// JIT-compile its gather on a machine's first request.
pub fn take_rows(table: &Array, ids: &Array) -> Result<Array> {
    if crate::cuda_kernels::take_rows_applies(table, ids)? {
        return crate::cuda_kernels::take_rows(table, ids);
    }
    table.take(ids, 0)
}

/// `values[r, ids[r, j]]` for 2-D `values` and uint32 `ids` (each row's chosen columns), what
/// `take_along_axis(ids, -1)` gives. On a GPU it runs on mlxcel's kernel (`MLXCEL_CUDA_ROWS`),
/// which ships compiled: MLX would JIT-compile its `gather_axis` on a machine's first prompt.
pub fn take_along_rows(values: &Array, ids: &Array) -> Result<Array> {
    if crate::cuda_kernels::take_along_rows_applies(values, ids)? {
        return crate::cuda_kernels::take_along_rows(values, ids);
    }
    values.take_along_axis(ids, -1)
}

/// `act(gate) * up` for gated MLPs. On a GPU it runs as one kernel: SiLU's on mlxcel's
/// (`MLXCEL_CUDA_ROWS`, shipped compiled), the others a function compiled once with MLX's
/// `compile` (decode is bound by per-kernel dispatch, and SiLU-and-multiply is otherwise three
/// kernels, tanh-GELU-and-multiply nine). On the CPU the same ops run unfused:
/// MLX compiles fused CPU kernels with the system C++ compiler at run time, which a deployed
/// binary cannot count on.
pub fn gated_activation(kind: GatedActivation, gate: &Array, up: &Array) -> Result<Array> {
    if kind == GatedActivation::Silu && crate::cuda_kernels::silu_mul_applies(gate, up)? {
        // mlxcel's kernel, which ships compiled: MLX would JIT-compile the fused function on
        // a machine's first prompt.
        return crate::cuda_kernels::silu_mul(gate, up);
    }
    let fused = crate::default_device()? == crate::Device::Gpu;
    gated_activation_as(kind, gate, up, fused)
}

/// [`gated_activation`] with the fusion chosen by the caller (`fused` on the CPU needs a C++
/// compiler at run time).
pub fn gated_activation_as(
    kind: GatedActivation,
    gate: &Array,
    up: &Array,
    fused: bool,
) -> Result<Array> {
    let name = match kind {
        GatedActivation::Silu => "silu",
        GatedActivation::GeluTanh => "gelu_tanh",
        GatedActivation::Gelu => "gelu",
    };
    Ok(wrap(bridge::gated_activation(
        name,
        gate.as_ref(),
        up.as_ref(),
        fused,
    )?))
}

/// Whether mlxcel's own CPU kernel (`cpp/cpu_linear.cc`) computes `x @ W^T` when MLX runs on
/// the CPU: on unless `MLXCEL_CPU_KERNELS=0` (which keeps MLX's kernels, for comparisons).
/// MLX's Linux CPU backend runs quantized matmuls as a scalar loop and dense ones through a
/// reference BLAS; the mlxcel kernel is vectorised and multi-threaded (`MLXCEL_CPU_THREADS`).
/// Read from the installed [`crate::policy`].
pub fn cpu_kernels_enabled() -> bool {
    crate::policy::with(|p| p.cpu_kernels)
}

/// Whether mlxcel's CPU kernels are in use now: enabled and MLX's default device is the CPU.
pub fn cpu_kernels_active() -> Result<bool> {
    Ok(cpu_kernels_enabled() && crate::default_device()? == crate::Device::Cpu)
}

/// Whether mlxcel's CPU kernel reads a quantization format directly: affine 2, 4 or 8 bits in
/// groups of a multiple of 32 (the one rule for linear layers, routed experts and which
/// checkpoint planes loading may keep as stored).
pub fn cpu_kernel_reads(spec: QuantSpec) -> bool {
    spec.mode == QuantMode::Affine && matches!(spec.bits, 2 | 4 | 8) && spec.group_size % 32 == 0
}

fn on_cpu_kernel_path(x: &Array, weight: &Array) -> Result<bool> {
    Ok(weight.ndim() == 2 && x.dtype()? == Dtype::Float32 && cpu_kernels_active()?)
}

fn is_cpu_kernel_float(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
}

/// `x @ weight^T` for a dense weight `[out, in]` (a linear layer), on mlxcel's CPU kernel where
/// it applies (float32 activations on the CPU, float weights read as stored), else MLX's matmul.
/// `weight_t`, when the caller keeps one, is `weight.t()` made once: on a GPU every array of a
/// decode step costs MLX host time, and a fresh transpose per call is one more.
pub fn linear(x: &Array, weight: &Array, weight_t: Option<&Array>) -> Result<Array> {
    if let Some(y) = cpu_linear_fused(x, weight, None, KernelActivation::None)? {
        return Ok(y);
    }
    match weight_t {
        Some(t) => x.matmul(t),
        None => x.matmul(&weight.t()?),
    }
}

/// An element-wise activation mlxcel's CPU linear kernel applies to its outputs as it stores
/// them (see [`cpu_linear_fused`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelActivation {
    /// None: `x @ W^T + bias`.
    None,
    /// GELU, the exact erf form (erf to within 1.5e-7, as torch's CPU kernel computes it).
    Gelu,
    /// GELU, the tanh approximation.
    GeluTanh,
    /// `max(x, 0)`.
    Relu,
    /// `x * sigmoid(x)`.
    Silu,
}

impl KernelActivation {
    fn code(self) -> i32 {
        match self {
            KernelActivation::None => 0,
            KernelActivation::Gelu => 1,
            KernelActivation::GeluTanh => 2,
            KernelActivation::Relu => 3,
            KernelActivation::Silu => 4,
        }
    }
}

/// `act(x @ weight^T + bias)` for a dense weight `[out, in]` as one node on mlxcel's CPU kernel,
/// when it applies (float32 activations on the CPU with the kernels on, float weights read as
/// stored); `Ok(None)` otherwise, for the caller to compose MLX ops. Many rows (an encoder's
/// batch, a prefill) run as a packed GEMM that applies the bias and activation while storing
/// each tile; layers on MLX's CPU ops would each be a single-threaded pass over the output.
pub fn cpu_linear_fused(
    x: &Array,
    weight: &Array,
    bias: Option<&Array>,
    act: KernelActivation,
) -> Result<Option<Array>> {
    if !(on_cpu_kernel_path(x, weight)? && is_cpu_kernel_float(weight.dtype()?)) {
        return Ok(None);
    }
    if let Some(b) = bias {
        if !is_cpu_kernel_float(b.dtype()?) {
            return Ok(None);
        }
    }
    // SAFETY: the optional pointers are null or borrow live arrays for the call's duration.
    Ok(Some(wrap(unsafe {
        bridge::cpu_linear(
            x.as_ref(),
            weight.as_ref(),
            ptr::null(),
            ptr::null(),
            0,
            0,
            opt_ptr(bias),
            act.code(),
        )?
    })))
}

/// `x @ weight^T + (x @ a_t) @ b_t` as one node of mlxcel's CPU kernel, where it applies: a
/// runtime LoRA term (`a_t` = `Aᵀ` `[in, r]`, `b_t` = the scaled `Bᵀ` `[r, out]`, float32) over
/// a dense weight (`quant` `None`) or an affine-quantized one (`Some((scales, biases, spec))`)
/// the kernel reads. On a CPU decode step the cost of a layer is its graph nodes as much as its
/// arithmetic, and the term would add four. `None` where the kernel does not apply (the caller
/// builds the term from MLX ops).
pub fn cpu_linear_low_rank(
    x: &Array,
    weight: &Array,
    quant: Option<(&Array, &Array, QuantSpec)>,
    a_t: &Array,
    b_t: &Array,
) -> Result<Option<Array>> {
    if !on_cpu_kernel_path(x, weight)?
        || a_t.dtype()? != Dtype::Float32
        || b_t.dtype()? != Dtype::Float32
    {
        return Ok(None);
    }
    let (scales, biases, group_size, bits) = match quant {
        None if is_cpu_kernel_float(weight.dtype()?) => (ptr::null(), ptr::null(), 0, 0),
        Some((scales, biases, spec))
            if cpu_kernel_reads(spec) && is_cpu_kernel_float(scales.dtype()?) =>
        {
            (scales.as_ptr(), biases.as_ptr(), spec.group_size, spec.bits)
        }
        _ => return Ok(None),
    };
    // SAFETY: `scales` and `biases` are null or borrow live arrays for the call's duration.
    Ok(Some(wrap(unsafe {
        bridge::cpu_linear_low_rank(
            x.as_ref(),
            weight.as_ref(),
            scales,
            biases,
            group_size,
            bits,
            a_t.as_ref(),
            b_t.as_ref(),
        )?
    })))
}

/// `x @ dequantize(w).T` (when `transpose`) without materialising the dense matrix. On the CPU
/// with float32 activations, affine 2/4/8-bit weights run on mlxcel's kernel (see
/// [`cpu_kernels_enabled`]); on CUDA, decode rows can run on mlxcel's GEMV (`MLXCEL_CUDA_QMV`).
pub fn quantized_matmul(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: Option<&Array>,
    transpose: bool,
    spec: QuantSpec,
) -> Result<Array> {
    if let Some(b) = biases {
        if transpose && crate::cuda_kernels::qmv_applies(x, weight, scales, biases, spec)? {
            return crate::cuda_kernels::qmv(x, weight, scales, b, spec);
        }
        if transpose
            && cpu_kernel_reads(spec)
            && is_cpu_kernel_float(scales.dtype()?)
            && on_cpu_kernel_path(x, weight)?
        {
            return Ok(wrap(unsafe {
                // SAFETY: both pointers borrow live arrays for the call's duration.
                bridge::cpu_linear(
                    x.as_ref(),
                    weight.as_ref(),
                    scales.as_ptr(),
                    b.as_ptr(),
                    spec.group_size,
                    spec.bits,
                    ptr::null(),
                    0,
                )?
            }));
        }
    }
    // SAFETY: `biases` is null or borrowed for the call's duration.
    Ok(wrap(unsafe {
        bridge::quantized_matmul(
            x.as_ref(),
            weight.as_ref(),
            scales.as_ref(),
            opt_ptr(biases),
            transpose,
            spec.group_size,
            spec.bits,
            spec.mode.name(),
        )?
    }))
}

/// Batched quantized matmul choosing, per row, the matrix `rhs_indices` names in a stack of
/// quantized matrices (MoE experts). `sorted_indices` promises `rhs_indices` is non-decreasing,
/// which lets MLX process each expert's rows as one block.
#[allow(clippy::too_many_arguments)]
pub fn gather_qmm(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: Option<&Array>,
    lhs_indices: Option<&Array>,
    rhs_indices: Option<&Array>,
    transpose: bool,
    spec: QuantSpec,
    sorted_indices: bool,
) -> Result<Array> {
    if let (None, Some(ids), Some(b), true, true) =
        (lhs_indices, rhs_indices, biases, transpose, sorted_indices)
    {
        if crate::cuda_kernels::gather_qmm_applies(x, weight, scales, biases, spec, ids)? {
            return crate::cuda_kernels::gather_qmm_sorted(x, weight, scales, b, ids, None);
        }
    }
    if let (None, Some(ids), Some(b)) = (lhs_indices, rhs_indices, biases) {
        if transpose && cpu_gather_applies(x, weight, scales, ids, spec)? {
            return Ok(wrap(bridge::cpu_gather_linear(
                x.as_ref(),
                weight.as_ref(),
                scales.as_ref(),
                b.as_ref(),
                ids.as_ref(),
                spec.group_size,
                spec.bits,
            )?));
        }
    }
    // SAFETY: the optional pointers are null or borrowed for the call's duration.
    Ok(wrap(unsafe {
        bridge::gather_qmm(
            x.as_ref(),
            weight.as_ref(),
            scales.as_ref(),
            opt_ptr(biases),
            opt_ptr(lhs_indices),
            opt_ptr(rhs_indices),
            transpose,
            spec.group_size,
            spec.bits,
            spec.mode.name(),
            sorted_indices,
        )?
    }))
}

/// Whether a routed-expert product runs on mlxcel's CPU kernel: the conditions of
/// [`quantized_matmul`]'s CPU path, a 3-D expert stack, single-row operands (`x` `[.., 1, K]`)
/// whose batch shape is the ids' shape or that shape with the last axis 1 (each row against its
/// k experts), the two layouts MoE blocks use.
fn cpu_gather_applies(
    x: &Array,
    weight: &Array,
    scales: &Array,
    ids: &Array,
    spec: QuantSpec,
) -> Result<bool> {
    if !(cpu_kernel_reads(spec)
        && weight.ndim() == 3
        && x.ndim() >= 2
        && x.dtype()? == Dtype::Float32
        && matches!(ids.dtype()?, Dtype::Uint32 | Dtype::Int32)
        && is_cpu_kernel_float(scales.dtype()?)
        && cpu_kernels_active()?)
    {
        return Ok(false);
    }
    let xs = x.shape();
    if xs[xs.len() - 2] != 1 {
        return Ok(false);
    }
    let batch = &xs[..xs.len() - 2];
    let ids_shape = ids.shape();
    let per_row = match ids_shape.split_last() {
        Some((_, lead)) => [lead, &[1]].concat(),
        None => return Ok(false),
    };
    Ok(batch == ids_shape.as_slice() || batch == per_row.as_slice())
}

/// Whether attention runs on mlxcel's CPU kernel (`cpp/cpu_attention.cc`): float32 `[B, H, L, D]`
/// operands on the CPU with the CPU kernels enabled (MLX's CPU attention is matmuls through a
/// reference BLAS). Boolean masks and attention sinks stay on MLX.
fn cpu_attention_applies(q: &Array, k: &Array, v: &Array) -> Result<bool> {
    Ok(q.ndim() == 4
        && k.ndim() == 4
        && v.ndim() == 4
        && q.dtype()? == Dtype::Float32
        && k.dtype()? == Dtype::Float32
        && v.dtype()? == Dtype::Float32
        && cpu_kernels_active()?)
}

/// Dense counterpart of [`gather_qmm`]: `a[lhs] @ b[rhs]`.
pub fn gather_mm(
    a: &Array,
    b: &Array,
    lhs_indices: Option<&Array>,
    rhs_indices: Option<&Array>,
    sorted_indices: bool,
) -> Result<Array> {
    // SAFETY: the optional pointers are null or borrowed for the call's duration.
    Ok(wrap(unsafe {
        bridge::gather_mm(
            a.as_ref(),
            b.as_ref(),
            opt_ptr(lhs_indices),
            opt_ptr(rhs_indices),
            sorted_indices,
        )?
    }))
}

/// The selective state-space recurrence of Mamba-1 and Mamba-2 on mlxcel's CPU kernel
/// (`cpp/cpu_scan.cc`) or, on a GPU, its CUDA twin (`kernels/cuda/scan.cu`, see
/// [`crate::cuda_kernels::selective_scan`]), position after position: `s = exp(dt · A) ⊙ s + dt · x · Bᵀ`,
/// `y = s · C`, for `x` `[B, L, H, P]`, `dt` `[B, L, H]`, `a` `[H, N]` (`per_head_decay`: one
/// value per head, read from column 0), `bm`, `cm` `[B, L, G, N]` (head `h` reads group
/// `h / (H / G)`) and the initial state `h0` `[B, H, P, N]`, all float32. Returns `y`
/// `[B, L, H, P]` and the last state `[B, H, P, N]`, or `None` where neither kernel is in use
/// (the caller then runs its MLX graph).
pub fn selective_scan(
    x: &Array,
    dt: &Array,
    a: &Array,
    bm: &Array,
    cm: &Array,
    h0: &Array,
    per_head_decay: bool,
) -> Result<Option<(Array, Array)>> {
    for t in [x, dt, a, bm, cm, h0] {
        if t.dtype()? != Dtype::Float32 {
            return Ok(None);
        }
    }
    let packed = if cpu_kernels_active()? {
        wrap(bridge::cpu_selective_scan(
            x.as_ref(),
            dt.as_ref(),
            a.as_ref(),
            bm.as_ref(),
            cm.as_ref(),
            h0.as_ref(),
            per_head_decay,
        )?)
    } else if crate::cuda_kernels::scan_applies(x, bm)? {
        crate::cuda_kernels::selective_scan(x, dt, a, bm, cm, h0, per_head_decay)?
    } else {
        return Ok(None);
    };
    let (b, l, h, p) = (x.dim(0)?, x.dim(1)?, x.dim(2)?, x.dim(3)?);
    let n = bm.dim(3)?;
    let ys = l * h * p;
    let y = packed.slice_axis(1, 0, ys)?.reshape(&[b, l, h, p])?;
    let state = packed
        .slice_axis(1, ys, ys + h * p * n)?
        .reshape(&[b, h, p, n])?;
    Ok(Some((y, state)))
}

/// RWKV-7's generalised delta rule on mlxcel's CPU kernel (`cpp/cpu_scan.cc`), position after
/// position: `S = S · diag(w) + v kᵀ + (S a) bᵀ`, `y = S r`, for `r`, `w`, `k`, `v`, `a`, `b`
/// `[B, L, H, D]` and the state `[B, H, D(v), D(k)]`, all float32. Returns `y` `[B, L, H, D]`
/// and the last state, or `None` where the CPU kernels are not in use.
pub fn cpu_delta_rule_scan(
    r: &Array,
    w: &Array,
    k: &Array,
    v: &Array,
    a: &Array,
    b: &Array,
    state: &Array,
) -> Result<Option<(Array, Array)>> {
    if !cpu_kernels_active()? {
        return Ok(None);
    }
    for t in [r, w, k, v, a, b, state] {
        if t.dtype()? != Dtype::Float32 {
            return Ok(None);
        }
    }
    let packed = wrap(bridge::cpu_delta_rule_scan(
        r.as_ref(),
        w.as_ref(),
        k.as_ref(),
        v.as_ref(),
        a.as_ref(),
        b.as_ref(),
        state.as_ref(),
    )?);
    let (batch, l, h, d) = (r.dim(0)?, r.dim(1)?, r.dim(2)?, r.dim(3)?);
    let ys = l * h * d;
    let y = packed.slice_axis(1, 0, ys)?.reshape(&[batch, l, h, d])?;
    let last = packed
        .slice_axis(1, ys, ys + h * d * d)?
        .reshape(&[batch, h, d, d])?;
    Ok(Some((y, last)))
}

/// Fused attention `softmax(q k^T * scale + mask) v` over `[B, H, L, D]` inputs; `k`/`v` may
/// have fewer heads than `q` (grouped-query attention). `sinks` (`[H]`) adds a per-head logit
/// that takes probability mass but contributes no value.
pub fn scaled_dot_product_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: AttentionMask<'_>,
    sinks: Option<&Array>,
) -> Result<Array> {
    if sinks.is_none() && cpu_attention_applies(q, k, v)? {
        let on_kernel = match mask {
            AttentionMask::None => Some((None, false)),
            AttentionMask::Causal => Some((None, true)),
            // Additive float masks (encoders' padding, windows); boolean ones stay on MLX.
            AttentionMask::Array(m) if is_cpu_kernel_float(m.dtype()?) => Some((Some(m), false)),
            AttentionMask::Array(_) => None,
        };
        if let Some((m, causal)) = on_kernel {
            // SAFETY: `m` is null or borrowed for the call's duration.
            return Ok(wrap(unsafe {
                bridge::cpu_attention(
                    q.as_ref(),
                    k.as_ref(),
                    v.as_ref(),
                    opt_ptr(m),
                    scale,
                    causal,
                )?
            }));
        }
    }
    let (mode, arr) = match mask {
        AttentionMask::None => ("", None),
        AttentionMask::Causal => ("causal", None),
        AttentionMask::Array(m) => ("array", Some(m)),
    };
    // SAFETY: the optional pointers are null or borrowed for the call's duration.
    Ok(wrap(unsafe {
        bridge::scaled_dot_product_attention(
            q.as_ref(),
            k.as_ref(),
            v.as_ref(),
            scale,
            mode,
            opt_ptr(arr),
            opt_ptr(sinks),
        )?
    }))
}

/// An array of `shape` filled with zeros.
pub fn zeros(shape: &[i32], dtype: Dtype) -> Result<Array> {
    check_shape(shape)?;
    Ok(wrap(bridge::zeros(shape, dtype)?))
}

/// An array of `shape` filled with ones.
pub fn ones(shape: &[i32], dtype: Dtype) -> Result<Array> {
    check_shape(shape)?;
    Ok(wrap(bridge::ones(shape, dtype)?))
}

/// An array of `shape` filled with `value` converted to `dtype`.
pub fn full(shape: &[i32], value: f64, dtype: Dtype) -> Result<Array> {
    check_shape(shape)?;
    let v = Array::scalar(value, dtype)?;
    Ok(wrap(bridge::full(shape, v.as_ref(), dtype)?))
}

/// `[start, stop)` in steps of `step`.
pub fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<Array> {
    Ok(wrap(bridge::arange(start, stop, step, dtype)?))
}

/// Joins `arrays` along the existing `axis` (the other axes must match).
pub fn concatenate(arrays: &[Array], axis: i32) -> Result<Array> {
    let list = ArrayList::new(arrays)?;
    Ok(wrap(bridge::concatenate(list.as_ref(), axis)?))
}

/// Joins same-shaped `arrays` along a new `axis`.
pub fn stack(arrays: &[Array], axis: i32) -> Result<Array> {
    let list = ArrayList::new(arrays)?;
    Ok(wrap(bridge::stack(list.as_ref(), axis)?))
}

/// Element-wise `cond ? x : y` with broadcasting.
pub fn where_(cond: &Array, x: &Array, y: &Array) -> Result<Array> {
    Ok(wrap(bridge::where_(cond.as_ref(), x.as_ref(), y.as_ref())?))
}

pub use crate::array::{async_eval_all, eval_all, graph_census};

/// Explicit-key random numbers (reproducible with `--seed`).
pub mod random {
    use super::wrap;
    use crate::ffi::bridge;
    use crate::{Array, Dtype, Result};

    /// A PRNG key from a seed.
    pub fn key(seed: u64) -> Result<Array> {
        Ok(wrap(bridge::random_key(seed)?))
    }

    /// `parts` independent keys derived from `key` (shape `[parts, 2]`).
    pub fn split(key: &Array, parts: i32) -> Result<Array> {
        Ok(wrap(bridge::random_split(key.as_ref(), parts)?))
    }

    /// Samples an index along `axis` with probabilities `softmax(logits)`.
    pub fn categorical(logits: &Array, axis: i32, key: &Array) -> Result<Array> {
        Ok(wrap(bridge::random_categorical(
            logits.as_ref(),
            axis,
            key.as_ref(),
        )?))
    }

    /// Uniform samples in `[0, 1)`.
    pub fn uniform(shape: &[i32], dtype: Dtype, key: &Array) -> Result<Array> {
        Ok(wrap(bridge::random_uniform(shape, dtype, key.as_ref())?))
    }
}
