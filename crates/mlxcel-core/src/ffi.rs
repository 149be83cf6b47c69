//! The `cxx` bridge to MLX's C++ API. Every function is fallible (`Result`), so an MLX exception
//! (a bad shape in a user's checkpoint, an unsupported dtype on a device) reaches Rust as an
//! `Err` with MLX's message instead of `std::terminate`.
//!
//! Element-wise and reduction ops are not declared here one by one: they go through the three
//! dispatchers (`unary_op`, `binary_op`, `reduce_op`) whose name tables are generated from
//! `ops.table`. Ops with other signatures are declared below and implemented in `cpp/shim.cc`.

// MLX's quantized ops take many scalar parameters; the bridge mirrors them one to one.
/// Keeps alive the memory an array borrows (a mapped checkpoint shard): MLX drops it through
/// the array's deleter once no array uses the memory.
pub(crate) struct BorrowedBytesOwner(#[allow(dead_code)] pub(crate) Box<dyn Send + Sync>);

#[allow(clippy::too_many_arguments)]
#[cxx::bridge(namespace = "mlxcel")]
pub(crate) mod bridge {
    extern "Rust" {
        type BorrowedBytesOwner;
    }

    /// Element types MLX arrays can hold.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    #[repr(i32)]
    enum Dtype {
        /// `bool`, one byte per element.
        Bool,
        /// `u8`.
        Uint8,
        /// `u16`.
        Uint16,
        /// `u32` (also the word type of packed quantized weights).
        Uint32,
        /// `u64`.
        Uint64,
        /// `i8`.
        Int8,
        /// `i16`.
        Int16,
        /// `i32`.
        Int32,
        /// `i64`.
        Int64,
        /// IEEE half precision ([`half::f16`]).
        Float16,
        /// bfloat16 ([`half::bf16`]): f32's exponent range with a 7-bit mantissa.
        Bfloat16,
        /// `f32`.
        Float32,
        /// `f64` (CPU only in MLX).
        Float64,
        /// Two `f32`s (real, imaginary); no host element type maps to it.
        Complex64,
    }

    /// Where MLX runs a computation.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    #[repr(i32)]
    enum DeviceKind {
        /// The host CPU.
        Cpu,
        /// The GPU (Metal or CUDA backend).
        Gpu,
    }

    unsafe extern "C++" {
        include!("mlxcel-core/cpp/shim.h");

        /// `mlx::core::array`: a reference-counted node of MLX's lazy graph.
        #[namespace = "mlx::core"]
        #[cxx_name = "array"]
        type MlxArray;
        /// A `std::vector<mlx::core::array>` for ops taking or returning several arrays.
        type ArrayVec;
        /// A compiled custom kernel (`mlx::core::fast::metal_kernel` / `cuda_kernel`).
        type CustomKernel;
        type CudaBinary;
        /// `mlx::core::distributed::Group`: the processes one collective spans.
        type DistGroup;

        // ---- library, devices, memory ----
        fn mlx_version() -> Result<String>;
        fn default_device_kind() -> Result<DeviceKind>;
        fn set_default_device_kind(kind: DeviceKind) -> Result<()>;
        fn device_available(kind: DeviceKind) -> Result<bool>;
        fn device_memory_bytes(kind: DeviceKind) -> Result<usize>;
        fn active_memory() -> Result<usize>;
        fn peak_memory() -> Result<usize>;
        fn reset_peak_memory() -> Result<()>;
        fn cache_memory() -> Result<usize>;
        fn set_cache_limit(bytes: usize) -> Result<usize>;
        fn set_memory_limit(bytes: usize) -> Result<usize>;
        fn clear_cache() -> Result<()>;

        // ---- array handles ----
        fn array_clone(a: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn array_from_bytes(
            data: &[u8],
            shape: &[i32],
            dtype: Dtype,
        ) -> Result<UniquePtr<MlxArray>>;
        /// `nbytes` bytes at byte `offset` of the open file `fd` in a new array in device
        /// memory (MLX's CUDA backend, read by `readers` threads through pinned staging
        /// buffers: cpp/cuda_load.cc); null where the CUDA driver is not in the process.
        fn array_from_file_on_device(
            fd: i32,
            offset: u64,
            nbytes: usize,
            shape: &[i32],
            dtype: Dtype,
            readers: i32,
            pooled: bool,
        ) -> Result<UniquePtr<MlxArray>>;
        /// An array over `data` without a copy where MLX's allocator allows it (the CPU
        /// backend), else a copy; `owner` is dropped when MLX no longer needs `data`.
        /// # Safety
        /// `data` stays valid and unmodified while `owner` lives.
        unsafe fn array_borrowing_bytes(
            data: &[u8],
            shape: &[i32],
            dtype: Dtype,
            owner: Box<BorrowedBytesOwner>,
        ) -> Result<UniquePtr<MlxArray>>;
        /// Address of the array's first element (tests: did a borrow avoid the copy?).
        fn array_data_address(a: &MlxArray) -> Result<usize>;
        /// Whether nothing else holds the array or its buffer (MLX would write into it in place).
        fn array_is_donatable(a: &MlxArray) -> Result<bool>;
        fn array_is_row_contiguous(a: &MlxArray) -> Result<bool>;
        fn array_scalar_f64(value: f64, dtype: Dtype) -> Result<UniquePtr<MlxArray>>;
        fn array_shape(a: &MlxArray) -> Result<Vec<i32>>;
        fn array_dtype(a: &MlxArray) -> Result<Dtype>;
        fn array_size(a: &MlxArray) -> Result<usize>;
        fn array_nbytes(a: &MlxArray) -> Result<usize>;
        fn array_is_available(a: &MlxArray) -> Result<bool>;
        fn array_copy_to_host(a: &MlxArray, out: &mut [u8]) -> Result<()>;
        fn array_eval(a: &MlxArray) -> Result<()>;
        fn array_item_f64(a: &MlxArray) -> Result<f64>;

        fn new_array_vec() -> Result<UniquePtr<ArrayVec>>;
        fn array_vec_push(v: Pin<&mut ArrayVec>, a: &MlxArray) -> Result<()>;
        fn array_vec_len(v: &ArrayVec) -> Result<usize>;
        fn array_vec_get(v: &ArrayVec, index: usize) -> Result<UniquePtr<MlxArray>>;
        fn eval_all(v: &ArrayVec) -> Result<()>;
        fn async_eval_all(v: &ArrayVec) -> Result<()>;
        fn graph_census(v: &ArrayVec) -> Result<String>;

        // ---- table-driven families (names from ops.table) ----
        fn unary_op(name: &str, a: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn binary_op(name: &str, a: &MlxArray, b: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn reduce_op(
            name: &str,
            a: &MlxArray,
            axes: &[i32],
            keepdims: bool,
        ) -> Result<UniquePtr<MlxArray>>;

        // ---- creation ----
        fn zeros(shape: &[i32], dtype: Dtype) -> Result<UniquePtr<MlxArray>>;
        fn ones(shape: &[i32], dtype: Dtype) -> Result<UniquePtr<MlxArray>>;
        fn full(shape: &[i32], value: &MlxArray, dtype: Dtype) -> Result<UniquePtr<MlxArray>>;
        fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<UniquePtr<MlxArray>>;

        // ---- shape and indexing ----
        fn astype(a: &MlxArray, dtype: Dtype) -> Result<UniquePtr<MlxArray>>;
        fn view_as(a: &MlxArray, dtype: Dtype) -> Result<UniquePtr<MlxArray>>;
        fn reshape(a: &MlxArray, shape: &[i32]) -> Result<UniquePtr<MlxArray>>;
        fn transpose(a: &MlxArray, axes: &[i32]) -> Result<UniquePtr<MlxArray>>;
        fn broadcast_to(a: &MlxArray, shape: &[i32]) -> Result<UniquePtr<MlxArray>>;
        fn expand_dims(a: &MlxArray, axes: &[i32]) -> Result<UniquePtr<MlxArray>>;
        fn squeeze(a: &MlxArray, axes: &[i32]) -> Result<UniquePtr<MlxArray>>;
        fn contiguous(a: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn slice(
            a: &MlxArray,
            start: &[i32],
            stop: &[i32],
            strides: &[i32],
        ) -> Result<UniquePtr<MlxArray>>;
        fn slice_dynamic(
            a: &MlxArray,
            start: &MlxArray,
            axes: &[i32],
            sizes: &[i32],
        ) -> Result<UniquePtr<MlxArray>>;
        fn slice_update(
            src: &MlxArray,
            update: &MlxArray,
            start: &[i32],
            stop: &[i32],
            strides: &[i32],
        ) -> Result<UniquePtr<MlxArray>>;
        fn slice_update_dynamic(
            src: &MlxArray,
            update: &MlxArray,
            start: &MlxArray,
            axes: &[i32],
        ) -> Result<UniquePtr<MlxArray>>;
        fn concatenate(arrays: &ArrayVec, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn stack(arrays: &ArrayVec, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn split_at(a: &MlxArray, indices: &[i32], axis: i32) -> Result<UniquePtr<ArrayVec>>;
        fn split_equal(a: &MlxArray, parts: i32, axis: i32) -> Result<UniquePtr<ArrayVec>>;
        fn take(a: &MlxArray, indices: &MlxArray, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn take_along_axis(
            a: &MlxArray,
            indices: &MlxArray,
            axis: i32,
        ) -> Result<UniquePtr<MlxArray>>;
        fn put_along_axis(
            a: &MlxArray,
            indices: &MlxArray,
            values: &MlxArray,
            axis: i32,
        ) -> Result<UniquePtr<MlxArray>>;
        fn where_(cond: &MlxArray, x: &MlxArray, y: &MlxArray) -> Result<UniquePtr<MlxArray>>;

        // ---- math with extra parameters ----
        fn addmm(
            c: &MlxArray,
            a: &MlxArray,
            b: &MlxArray,
            alpha: f32,
            beta: f32,
        ) -> Result<UniquePtr<MlxArray>>;
        fn softmax(a: &MlxArray, axes: &[i32], precise: bool) -> Result<UniquePtr<MlxArray>>;
        fn argmax(a: &MlxArray, axis: i32, keepdims: bool) -> Result<UniquePtr<MlxArray>>;
        fn argmin(a: &MlxArray, axis: i32, keepdims: bool) -> Result<UniquePtr<MlxArray>>;
        fn argpartition(a: &MlxArray, kth: i32, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn topk(a: &MlxArray, k: i32, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn sort(a: &MlxArray, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn argsort(a: &MlxArray, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn cumsum(
            a: &MlxArray,
            axis: i32,
            reverse: bool,
            inclusive: bool,
        ) -> Result<UniquePtr<MlxArray>>;
        /// # Safety
        /// `lo` and `hi` are null or point to live arrays.
        unsafe fn clip(
            a: &MlxArray,
            lo: *const MlxArray,
            hi: *const MlxArray,
        ) -> Result<UniquePtr<MlxArray>>;
        fn conv1d(
            input: &MlxArray,
            weight: &MlxArray,
            stride: i32,
            padding: i32,
            dilation: i32,
            groups: i32,
        ) -> Result<UniquePtr<MlxArray>>;

        // ---- quantization (mode: "affine", "mxfp4", "mxfp8", "nvfp4") ----
        fn quantize(
            w: &MlxArray,
            group_size: i32,
            bits: i32,
            mode: &str,
        ) -> Result<UniquePtr<ArrayVec>>;
        /// # Safety
        /// `biases` is null or points to a live array.
        unsafe fn dequantize(
            w: &MlxArray,
            scales: &MlxArray,
            biases: *const MlxArray,
            group_size: i32,
            bits: i32,
            mode: &str,
            out_dtype: i32,
        ) -> Result<UniquePtr<MlxArray>>;
        /// # Safety
        /// `biases` is null or points to a live array.
        unsafe fn quantized_matmul(
            x: &MlxArray,
            w: &MlxArray,
            scales: &MlxArray,
            biases: *const MlxArray,
            transpose: bool,
            group_size: i32,
            bits: i32,
            mode: &str,
        ) -> Result<UniquePtr<MlxArray>>;
        /// # Safety
        /// `biases`, `lhs_indices` and `rhs_indices` are null or point to live arrays.
        unsafe fn gather_qmm(
            x: &MlxArray,
            w: &MlxArray,
            scales: &MlxArray,
            biases: *const MlxArray,
            lhs_indices: *const MlxArray,
            rhs_indices: *const MlxArray,
            transpose: bool,
            group_size: i32,
            bits: i32,
            mode: &str,
            sorted_indices: bool,
        ) -> Result<UniquePtr<MlxArray>>;
        /// # Safety
        /// `lhs_indices` and `rhs_indices` are null or point to live arrays.
        unsafe fn gather_mm(
            a: &MlxArray,
            b: &MlxArray,
            lhs_indices: *const MlxArray,
            rhs_indices: *const MlxArray,
            sorted_indices: bool,
        ) -> Result<UniquePtr<MlxArray>>;
        /// `act(x @ w^T + bias)` on mlxcel's CPU kernel; `bits == 0`: `w` dense; `activation`:
        /// 0 none, 1 GELU (erf), 2 GELU (tanh), 3 ReLU, 4 SiLU.
        /// # Safety
        /// `scales`, `biases` and `bias` are null or point to live arrays.
        unsafe fn cpu_linear(
            x: &MlxArray,
            w: &MlxArray,
            scales: *const MlxArray,
            biases: *const MlxArray,
            group_size: i32,
            bits: i32,
            bias: *const MlxArray,
            activation: i32,
        ) -> Result<UniquePtr<MlxArray>>;

        /// The CPU decode engine (cpp/cpu_decode.cc).
        type CpuDecoder;
        /// A decoder of `layers` layers; `inv_freq`: the rotated pairs' frequencies.
        fn cpu_decoder_new(
            hidden: i32,
            heads: i32,
            kv_heads: i32,
            head_dim: i32,
            layers: i32,
            eps: f32,
            attn_scale: f32,
            inv_freq: &[f32],
            traditional: bool,
        ) -> Result<UniquePtr<CpuDecoder>>;
        /// Sets projection `role` (0-6: q k v o gate up down; 7 with layer -1: the head).
        ///
        /// # Safety
        /// `scales`, `biases` and `bias` are null or point to live arrays.
        unsafe fn cpu_decoder_set_linear(
            d: Pin<&mut CpuDecoder>,
            layer: i32,
            role: i32,
            w: &MlxArray,
            scales: *const MlxArray,
            biases: *const MlxArray,
            bias: *const MlxArray,
            group_size: i32,
            bits: i32,
        ) -> Result<()>;
        /// Sets norm `role` (0 input, 1 post-attention, 2 query, 3 key; 4 with layer -1: final).
        fn cpu_decoder_set_norm(
            d: Pin<&mut CpuDecoder>,
            layer: i32,
            role: i32,
            w: &MlxArray,
        ) -> Result<()>;
        /// Checks that every part is set with matching shapes and evaluates the weights.
        fn cpu_decoder_finish(d: Pin<&mut CpuDecoder>) -> Result<()>;
        /// Rows of the output head.
        fn cpu_decoder_vocab(d: &CpuDecoder) -> Result<i64>;
        /// One decode step: `x` the embedded token, the caches' buffer addresses.
        fn cpu_decoder_step(
            d: Pin<&mut CpuDecoder>,
            x: &MlxArray,
            keys: &[usize],
            values: &[usize],
            capacity: &[i64],
            position: i64,
            logits: &mut [f32],
        ) -> Result<()>;
        /// The CUDA decode step (cpp/cuda_decode.cc), over the kernels of `binary`.
        type CudaDecoder;
        /// A decoder of `layers` layers on bf16 (`f16`: float16) activations; `shapes`: the
        /// (warps, rows) launch shape of each GEMV kind, then of the tensor-core GEMVs ((0, 0):
        /// none), then the routed-expert GEMVs' lanes per row (8, 16, 32), the attention blocks
        /// a step aims at, 1 to route in the router GEMV's last block (0: a kernel of its own)
        /// and the attention blocks' threads (128 or 256); `overlap`: its kernels joined by
        /// programmatic edges where the driver can.
        #[allow(clippy::too_many_arguments)]
        fn cuda_decoder_new(
            binary: &CudaBinary,
            f16: bool,
            hidden: i32,
            heads: i32,
            kv_heads: i32,
            head_dim: i32,
            layers: i32,
            eps: f32,
            attn_scale: f32,
            inv_freq: &[f32],
            traditional: bool,
            shapes: &[i32],
            overlap: bool,
        ) -> Result<UniquePtr<CudaDecoder>>;
        /// As `cpu_decoder_set_linear` (affine 4/8-bit only; a bias on q/k/v only).
        ///
        /// # Safety
        /// `scales`, `biases` and `bias` are null or point to live arrays.
        #[allow(clippy::too_many_arguments)]
        unsafe fn cuda_decoder_set_linear(
            d: Pin<&mut CudaDecoder>,
            layer: i32,
            role: i32,
            w: &MlxArray,
            scales: *const MlxArray,
            biases: *const MlxArray,
            bias: *const MlxArray,
            group_size: i32,
            bits: i32,
        ) -> Result<()>;
        /// Makes `layer` a routed-expert layer: softmax routing to `top_k` experts
        /// (renormalised when `normalize`), weights times `weight_scale`.
        fn cuda_decoder_set_routing(
            d: Pin<&mut CudaDecoder>,
            layer: i32,
            top_k: i32,
            normalize: bool,
            weight_scale: f32,
        ) -> Result<()>;
        /// As `cpu_decoder_set_norm`.
        fn cuda_decoder_set_norm(
            d: Pin<&mut CudaDecoder>,
            layer: i32,
            role: i32,
            w: &MlxArray,
        ) -> Result<()>;
        /// Checks every part, evaluates the weights and loads the kernels.
        fn cuda_decoder_finish(d: Pin<&mut CudaDecoder>) -> Result<()>;
        /// Whether the finished decoder launches its kernels overlapped.
        fn cuda_decoder_overlapped(d: &CudaDecoder) -> bool;
        /// The logits `[1, 1, vocab]` of one decode step, lazily: `x` the embedded token, the
        /// layers' key/value buffers (row `position` is written in place when it runs).
        fn cuda_decoder_step(
            d: &CudaDecoder,
            x: &MlxArray,
            keys: &ArrayVec,
            values: &ArrayVec,
            position: i64,
        ) -> Result<UniquePtr<MlxArray>>;
        /// `x @ w^T + (x @ lora_a) @ lora_b` on mlxcel's CPU kernel in one node (a runtime LoRA
        /// term: `lora_a` `[in, r]`, `lora_b` `[r, out]`, float32); `bits == 0`: `w` dense.
        /// # Safety
        /// `scales` and `biases` are null or point to live arrays.
        unsafe fn cpu_linear_low_rank(
            x: &MlxArray,
            w: &MlxArray,
            scales: *const MlxArray,
            biases: *const MlxArray,
            group_size: i32,
            bits: i32,
            lora_a: &MlxArray,
            lora_b: &MlxArray,
        ) -> Result<UniquePtr<MlxArray>>;

        /// Routed experts on mlxcel's CPU kernel: x rows against the experts `ids` names.
        fn cpu_gather_linear(
            x: &MlxArray,
            w: &MlxArray,
            scales: &MlxArray,
            biases: &MlxArray,
            ids: &MlxArray,
            group_size: i32,
            bits: i32,
        ) -> Result<UniquePtr<MlxArray>>;

        /// Attention on mlxcel's CPU pool: float32; no mask, the causal mask, or an additive
        /// float `mask` broadcastable to `[B, Hq, L, S]`.
        /// # Safety
        /// `mask` is null or points to a live array.
        unsafe fn cpu_attention(
            q: &MlxArray,
            k: &MlxArray,
            v: &MlxArray,
            mask: *const MlxArray,
            scale: f32,
            causal: bool,
        ) -> Result<UniquePtr<MlxArray>>;

        /// The selective state-space recurrence on mlxcel's CPU pool (Mamba-1 and Mamba-2):
        /// y and the last state, packed per batch row.
        fn cpu_selective_scan(
            x: &MlxArray,
            dt: &MlxArray,
            a: &MlxArray,
            bm: &MlxArray,
            cm: &MlxArray,
            h0: &MlxArray,
            per_head_decay: bool,
        ) -> Result<UniquePtr<MlxArray>>;

        /// RWKV-7's generalised delta rule on mlxcel's CPU pool: y and the last state, packed
        /// per batch row.
        fn cpu_delta_rule_scan(
            r: &MlxArray,
            w: &MlxArray,
            k: &MlxArray,
            v: &MlxArray,
            a: &MlxArray,
            b: &MlxArray,
            s0: &MlxArray,
        ) -> Result<UniquePtr<MlxArray>>;

        // ---- fast (fused) kernels ----
        /// `act(gate) * up` (`kind`: silu, gelu_tanh, gelu); `fused`: one compiled kernel.
        fn gated_activation(
            kind: &str,
            gate: &MlxArray,
            up: &MlxArray,
            fused: bool,
        ) -> Result<UniquePtr<MlxArray>>;
        /// # Safety
        /// `weight` is null or points to a live array.
        unsafe fn rms_norm(
            x: &MlxArray,
            weight: *const MlxArray,
            eps: f32,
        ) -> Result<UniquePtr<MlxArray>>;
        /// # Safety
        /// `weight` and `bias` are null or point to live arrays.
        unsafe fn layer_norm(
            x: &MlxArray,
            weight: *const MlxArray,
            bias: *const MlxArray,
            eps: f32,
        ) -> Result<UniquePtr<MlxArray>>;
        /// # Safety
        /// `freqs` is null or points to a live array.
        unsafe fn rope(
            x: &MlxArray,
            dims: i32,
            traditional: bool,
            base: f32,
            has_base: bool,
            scale: f32,
            offset: i32,
            freqs: *const MlxArray,
        ) -> Result<UniquePtr<MlxArray>>;
        /// # Safety
        /// `freqs` is null or points to a live array.
        unsafe fn rope_offsets(
            x: &MlxArray,
            dims: i32,
            traditional: bool,
            base: f32,
            has_base: bool,
            scale: f32,
            offsets: &MlxArray,
            freqs: *const MlxArray,
        ) -> Result<UniquePtr<MlxArray>>;
        /// # Safety
        /// `mask` and `sinks` are null or point to live arrays.
        unsafe fn scaled_dot_product_attention(
            q: &MlxArray,
            k: &MlxArray,
            v: &MlxArray,
            scale: f32,
            mask_mode: &str,
            mask: *const MlxArray,
            sinks: *const MlxArray,
        ) -> Result<UniquePtr<MlxArray>>;

        // ---- random ----
        fn random_key(seed: u64) -> Result<UniquePtr<MlxArray>>;
        fn random_split(key: &MlxArray, parts: i32) -> Result<UniquePtr<MlxArray>>;
        fn random_categorical(
            logits: &MlxArray,
            axis: i32,
            key: &MlxArray,
        ) -> Result<UniquePtr<MlxArray>>;
        fn random_uniform(
            shape: &[i32],
            dtype: Dtype,
            key: &MlxArray,
        ) -> Result<UniquePtr<MlxArray>>;

        // ---- custom kernels (backend: "metal" or "cuda") ----
        fn custom_kernel_new(
            backend: &str,
            name: &str,
            input_names: &Vec<String>,
            output_names: &Vec<String>,
            source: &str,
            header: &str,
        ) -> Result<UniquePtr<CustomKernel>>;
        // mlxcel's own CUDA kernels: compiled with the process's NVRTC, launched as nodes of
        // an mlxcel primitive (cpp/cuda_launch.cc).
        // The runtime policy's values for the C++ kernels (see `policy::install`).
        fn set_cpu_threads(threads: i32) -> Result<()>;
        fn cpu_pool_check(calls: i32) -> Result<i64>;
        fn set_cpu_int8_activations(on: bool) -> Result<()>;
        fn set_cuda_launch_mlx(through_mlx: bool) -> Result<()>;
        fn write_device_bytes(a: &MlxArray, offset: usize, bytes: &[u8]) -> Result<bool>;
        fn cuda_device_arch() -> Result<i32>;
        fn cuda_compile(source: &str, name: &str, arch: i32) -> Result<Vec<u8>>;
        fn cuda_binary_new(image: &[u8], kernel: &str) -> Result<UniquePtr<CudaBinary>>;
        #[allow(clippy::too_many_arguments)]
        fn cuda_binary_call(
            binary: &CudaBinary,
            inputs: &ArrayVec,
            output_shapes: &[i32],
            output_ndims: &[i32],
            output_dtypes: &[Dtype],
            scalars: &[i32],
            grid: &[i32],
            threadgroup: &[i32],
        ) -> Result<UniquePtr<ArrayVec>>;
        fn custom_kernel_call(
            kernel: &CustomKernel,
            inputs: &ArrayVec,
            output_shapes: &[i32],
            output_ndims: &[i32],
            output_dtypes: &[Dtype],
            grid: &[i32],
            threadgroup: &[i32],
            template_names: &Vec<String>,
            template_values: &[i32],
        ) -> Result<UniquePtr<ArrayVec>>;

        // ---- distributed (mlx::core::distributed) ----
        fn distributed_is_available(backend: &str) -> Result<bool>;
        fn distributed_init(strict: bool, backend: &str) -> Result<UniquePtr<DistGroup>>;
        fn group_clone(g: &DistGroup) -> Result<UniquePtr<DistGroup>>;
        fn group_rank(g: &DistGroup) -> Result<i32>;
        fn group_size(g: &DistGroup) -> Result<i32>;
        fn group_split(g: &DistGroup, color: i32, key: i32) -> Result<UniquePtr<DistGroup>>;
        fn dist_all_sum(x: &MlxArray, g: &DistGroup) -> Result<UniquePtr<MlxArray>>;
        fn dist_all_max(x: &MlxArray, g: &DistGroup) -> Result<UniquePtr<MlxArray>>;
        fn dist_all_gather(x: &MlxArray, g: &DistGroup) -> Result<UniquePtr<MlxArray>>;
        fn dist_send(x: &MlxArray, dst: i32, g: &DistGroup) -> Result<UniquePtr<MlxArray>>;
        fn dist_recv(
            shape: &[i32],
            dtype: Dtype,
            src: i32,
            g: &DistGroup,
        ) -> Result<UniquePtr<MlxArray>>;
        fn depends(inputs: &ArrayVec, dependencies: &ArrayVec) -> Result<UniquePtr<ArrayVec>>;
    }
}

// SAFETY: a `CudaBinary` is a compiled module image and kernel name, immutable after creation,
// plus the loaded functions, which C++ sets once under the struct's own mutex.
unsafe impl Send for bridge::CpuDecoder {}
unsafe impl Send for bridge::CudaBinary {}
unsafe impl Sync for bridge::CudaBinary {}

// SAFETY: a `DistGroup` is a shared pointer to MLX's group implementation, which MLX itself uses
// from its scheduler threads (collectives run on the stream's thread, not the caller's); the
// handle is never mutated after creation.
unsafe impl Send for bridge::DistGroup {}
unsafe impl Sync for bridge::DistGroup {}
