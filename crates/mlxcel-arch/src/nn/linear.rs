//! Linear layers and embeddings, dense or quantized as the checkpoint stores them.

use mlxcel_core::cuda_kernels::GemvInput;
use mlxcel_core::ops;
use mlxcel_core::{Array, Dtype};
use mlxcel_quant::QuantizedWeight;

use super::lora::LoraLayer;
use super::prefill_dense::PrefillDense;
use super::{Activation, Norm};
use crate::Result;

/// Rows of activations from which a quantized linear layer runs as dequantize + dense GEMM on
/// a GPU when `MLXCEL_DEQUANT_ROWS` is unset. Measured on an H200 (MLX 0.32.4 CUDA, Llama-8B
/// 4-bit shape, steady state): prefill of 512 rows at 16.5-17k tok/s this way against ~8k
/// through MLX's quantized GEMM (a 4096x14336 projection: 234 us against 529 us). Dequantizing
/// a layer costs about as much as a quantized GEMM over ~150 rows, hence 256.
const GPU_DEQUANT_ROWS: usize = 256;

/// When quantized layers are dequantized and run as dense GEMMs, from the installed runtime
/// policy (`MLXCEL_DEQUANT_ROWS`, see [`mlxcel_core::policy`]).
struct DequantPolicy {
    /// From this many rows of activations (0 = never).
    rows: usize,
    /// Whether routed-expert stacks are included: only when `MLXCEL_DEQUANT_ROWS` is set (a
    /// stack holds every expert of the layer while a prefill chunk uses each for a few rows; on
    /// the 30B-A3B shape it measured slower than MLX's gathered quantized GEMM).
    experts: bool,
}

fn dequant_policy() -> DequantPolicy {
    match mlxcel_core::policy::with(|p| p.dequant_rows) {
        Some(rows) => DequantPolicy {
            rows,
            experts: true,
        },
        None => {
            let gpu = mlxcel_core::default_device().ok() == Some(mlxcel_core::Device::Gpu);
            DequantPolicy {
                rows: if gpu { GPU_DEQUANT_ROWS } else { 0 },
                experts: false,
            }
        }
    }
}

/// From how many rows of activations a quantized linear layer is dequantized and run as a
/// dense GEMM: `MLXCEL_DEQUANT_ROWS` (0 = never), else 256 on a GPU and never on the CPU
/// (mlxcel's CPU kernel reads quantized weights directly).
pub fn dequantize_rows_threshold() -> usize {
    dequant_policy().rows
}

fn dequantize_for(rows: usize) -> bool {
    let threshold = dequantize_rows_threshold();
    threshold > 0 && rows >= threshold
}

/// Whether an expert stack is dequantized for `rows` routed rows: when the policy includes
/// experts, past the threshold and with four rows per expert on average.
fn dequantize_experts_for(rows: usize, experts: usize) -> bool {
    dequant_policy().experts && dequantize_for(rows) && rows >= 4 * experts
}

/// `y = x W^T + b` with `W` `[out, in]`.
#[derive(Debug, Clone)]
pub enum Linear {
    /// A floating-point weight in the compute dtype.
    Dense {
        /// `[out, in]`.
        weight: Array,
        /// `weight.t()`, made once (see `ops::linear`); build with [`Linear::dense`].
        weight_t: Array,
        /// `[out]`, when the layer has one.
        bias: Option<Array>,
    },
    /// A quantized weight (packed planes with scales and, for affine modes, biases).
    Quantized {
        /// The packed `[out, in]` weight.
        weight: QuantizedWeight,
        /// `[out]`, when the layer has one.
        bias: Option<Array>,
        /// The dequantized weight kept for prefill, once one was (see [`PrefillDense`]);
        /// build with [`Linear::quantized`].
        prefill: PrefillDense,
    },
    /// A layer with runtime LoRA adapters over its unchanged base (see [`super::lora`]): with
    /// no adapter active it runs exactly `base`.
    Adapted {
        /// The dense or quantized layer as the checkpoint stores it.
        base: Box<Linear>,
        /// The low-rank terms of the registered adapters.
        lora: Box<LoraLayer>,
    },
}

impl Linear {
    /// A dense layer from `weight` `[out, in]` and an optional `bias` `[out]`.
    pub fn dense(weight: Array, bias: Option<Array>) -> Result<Linear> {
        Ok(Linear::Dense {
            weight_t: weight.t()?,
            weight,
            bias,
        })
    }

    /// A quantized layer from its planes and an optional `bias` `[out]`.
    pub fn quantized(weight: QuantizedWeight, bias: Option<Array>) -> Linear {
        Linear::Quantized {
            weight,
            bias,
            prefill: PrefillDense::default(),
        }
    }

    /// `x` `[.., in]` → `[.., out]`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        if let Some(y) = self.on_cpu_kernel(x, ops::KernelActivation::None)? {
            return Ok(y);
        }
        let y = self.product(x)?;
        Ok(match self.bias() {
            Some(b) => y.add(b)?,
            None => y,
        })
    }

    /// `act(x W^T + b)`. A dense layer on mlxcel's CPU kernel computes it as one node, the bias
    /// and activation applied as each output tile is stored (on MLX's CPU ops they would be
    /// several single-threaded passes over the output); otherwise the layer, then `act`.
    pub fn forward_activated(&self, x: &Array, act: Activation) -> Result<Array> {
        let kernel_act = match act {
            Activation::Silu => ops::KernelActivation::Silu,
            Activation::GeluTanh => ops::KernelActivation::GeluTanh,
            Activation::Gelu => ops::KernelActivation::Gelu,
            Activation::Relu => ops::KernelActivation::Relu,
            // The kernel's relu, then the square.
            Activation::Relu2 => {
                let y = match self.on_cpu_kernel(x, ops::KernelActivation::Relu)? {
                    Some(y) => y,
                    None => Activation::Relu.apply(&self.forward(x)?)?,
                };
                return Ok(y.square()?);
            }
            // Not in the kernel: the layer, then the activation.
            Activation::XIelu(_) | Activation::OaiSwiglu => {
                return act.apply(&self.forward(x)?);
            }
        };
        match self.on_cpu_kernel(x, kernel_act)? {
            Some(y) => Ok(y),
            None => act.apply(&self.forward(x)?),
        }
    }

    /// A dense layer with a bias or an activation as one node on mlxcel's CPU kernel, when it
    /// applies (see `ops::cpu_linear_fused`); `None` leaves the layer to [`Linear::product`].
    fn on_cpu_kernel(&self, x: &Array, act: ops::KernelActivation) -> Result<Option<Array>> {
        let Linear::Dense { weight, bias, .. } = self else {
            return Ok(None);
        };
        if bias.is_none() && act == ops::KernelActivation::None {
            return Ok(None);
        }
        let y = ops::cpu_linear_fused(x, weight, bias.as_ref(), act)?;
        if y.is_some() {
            super::calibration::observe(weight, x);
        }
        Ok(y)
    }

    /// `x·Wᵀ` without the bias (a DoRA rescaling applies before the bias).
    pub(crate) fn product(&self, x: &Array) -> Result<Array> {
        Ok(match self {
            Linear::Adapted { base, lora } => return lora.apply(base, x),
            Linear::Dense {
                weight, weight_t, ..
            } => {
                super::calibration::observe(weight, x);
                ops::linear(x, weight, Some(weight_t))?
            }
            Linear::Quantized { weight, .. } => match self.prompt_dense_weight_t(x)? {
                Some(w_t) => x.matmul(&w_t)?,
                None => weight.matmul_t(x)?,
            },
        })
    }

    /// `x·Wᵀ + (x·a_t)·b_t` as one node of mlxcel's CPU kernel (see
    /// `ops::cpu_linear_low_rank`), for a runtime adapter's combined term over this base layer;
    /// `None` where the kernel does not read this layer or `x`.
    pub(crate) fn low_rank_product(
        &self,
        x: &Array,
        a_t: &Array,
        b_t: &Array,
    ) -> Result<Option<Array>> {
        let y = match self {
            Linear::Dense { weight, .. } => {
                let y = ops::cpu_linear_low_rank(x, weight, None, a_t, b_t)?;
                if y.is_some() {
                    super::calibration::observe(weight, x);
                }
                y
            }
            Linear::Quantized { weight, .. } => match &weight.biases {
                Some(biases) => ops::cpu_linear_low_rank(
                    x,
                    &weight.weight,
                    Some((&weight.scales, biases, weight.spec)),
                    a_t,
                    b_t,
                )?,
                None => None,
            },
            Linear::Adapted { .. } => None,
        };
        Ok(y)
    }

    /// The weight `[out, in]` as a dense array in `dtype` (dequantized when quantized; the
    /// base's for an adapted layer).
    pub fn dense_weight(&self, dtype: Dtype) -> Result<Array> {
        Ok(match self {
            Linear::Dense { weight, .. } => weight.astype(dtype)?,
            Linear::Quantized { weight, .. } => weight.dequantize(dtype)?,
            Linear::Adapted { base, .. } => base.dense_weight(dtype)?,
        })
    }
}

/// What [`Linear::forward_fused`] applies to its input before the product.
#[derive(Debug, Clone, Copy)]
pub enum LinearInput<'a> {
    /// The input as given.
    Plain,
    /// The pre-norm of the block the layer opens.
    Normed(&'a Norm),
    /// `act(gate) * up` of a `[gate | up]` input (a fused gate/up projection's output).
    Gated(Activation),
}

impl Linear {
    /// `residual + self(input(x))`. For decode rows of affine 4/8-bit weights on a GPU this is
    /// one mlxcel kernel with the norm or gate and the residual add folded in
    /// ([`QuantizedWeight::fused_gemv`]): decode there is bound by MLX's host time per graph
    /// node, and this saves up to three nodes per projection. Otherwise the same ops run one by
    /// one.
    pub fn forward_fused(
        &self,
        x: &Array,
        input: LinearInput<'_>,
        residual: Option<&Array>,
    ) -> Result<Array> {
        if let Linear::Adapted { base, lora } = self {
            if !lora.is_active(base)? {
                return base.forward_fused(x, input, residual);
            }
        }
        if let Linear::Quantized {
            weight, bias: None, ..
        } = self
        {
            let kernel_input = match input {
                LinearInput::Plain => Some(GemvInput::Plain),
                LinearInput::Normed(norm) => norm
                    .rms_parts()
                    .map(|(weight, eps)| GemvInput::RmsNorm { weight, eps }),
                LinearInput::Gated(Activation::Silu) => Some(GemvInput::SiluGated),
                LinearInput::Gated(_) => None,
            };
            if let Some(kernel_input) = kernel_input {
                if let Some(y) = weight.fused_gemv(x, kernel_input, residual)? {
                    return Ok(y);
                }
            }
        }
        let x = match input {
            LinearInput::Plain => x.clone(),
            LinearInput::Normed(norm) => norm.forward(x)?,
            LinearInput::Gated(act) => act.gated_halves(x)?,
        };
        if let Some(r) = residual {
            if let Some(y) = self.prefill_product_onto(&x, r)? {
                return Ok(y);
            }
        }
        let y = self.forward(&x)?;
        Ok(match residual {
            Some(r) => r.add(&y)?,
            None => y,
        })
    }

    /// `residual + x·Wᵀ` as one GEMM that adds `residual` (MLX's `addmm`; on a GPU cuBLAS adds
    /// it in its epilogue, where a separate add is one more kernel and graph node per layer),
    /// for a quantized layer without a bias that a prompt runs dequantized
    /// (`MLXCEL_PREFILL_FOLD_RESIDUAL`, off by default until measured). `None` leaves it to
    /// the product and an add.
    fn prefill_product_onto(&self, x: &Array, residual: &Array) -> Result<Option<Array>> {
        if !matches!(self, Linear::Quantized { bias: None, .. })
            || !mlxcel_core::policy::with(|p| p.prefill_fold_residual)
        {
            return Ok(None);
        }
        Ok(match self.prompt_dense_weight_t(x)? {
            Some(w_t) => Some(residual.addmm(x, &w_t, 1.0, 1.0)?),
            None => None,
        })
    }

    /// For a quantized layer that `x`'s rows run as a dense GEMM (many rows, a prompt: on GPUs
    /// one GEMM on the dequantized layer beats the quantized kernels by far), its dense weight
    /// in `x`'s dtype, transposed (`[in, out]`): the copy kept from an earlier prompt, or
    /// dequantized now and kept while the budget allows ([`PrefillDense`]). `None` otherwise.
    fn prompt_dense_weight_t(&self, x: &Array) -> Result<Option<Array>> {
        let Linear::Quantized {
            weight, prefill, ..
        } = self
        else {
            return Ok(None);
        };
        let rows = x.size() / x.dim(-1)?.max(1) as usize;
        if !dequantize_for(rows) {
            return Ok(None);
        }
        let dtype = x.dtype()?;
        Ok(Some(prefill.get_or_dequantize_t(dtype, || {
            Ok(weight.dequantize(dtype)?)
        })?))
    }

    /// One layer computing `parts` side by side (outputs concatenated in order), when they
    /// share a storage format: all dense in one dtype, or all quantized with one mode, bit
    /// width, group size and scale dtype; and all with or all without a bias. `None` otherwise
    /// (mixed-precision checkpoints keep their layers apart, and so do layers with runtime
    /// adapters).
    pub fn concat_outputs(parts: &[Linear]) -> Result<Option<Linear>> {
        let cat = |arrays: Vec<&Array>| -> Result<Array> {
            let owned: Vec<Array> = arrays.into_iter().cloned().collect();
            Ok(ops::concatenate(&owned, 0)?)
        };
        let with_bias = parts.iter().filter(|p| p.bias().is_some()).count();
        if parts.len() < 2 || (with_bias != 0 && with_bias != parts.len()) {
            return Ok(None);
        }
        let bias = match with_bias {
            0 => None,
            _ => Some(cat(parts.iter().filter_map(Linear::bias).collect())?),
        };
        let dense: Option<Vec<&Array>> = parts
            .iter()
            .map(|p| match p {
                Linear::Dense { weight, .. } => Some(weight),
                _ => None,
            })
            .collect();
        if let Some(weights) = dense {
            let dtype = weights[0].dtype()?;
            for w in &weights {
                if w.dtype()? != dtype || w.dim(1)? != weights[0].dim(1)? {
                    return Ok(None);
                }
            }
            return Ok(Some(Linear::dense(cat(weights)?, bias)?));
        }
        let quantized: Option<Vec<&QuantizedWeight>> = parts
            .iter()
            .map(|p| match p {
                Linear::Quantized { weight, .. } => Some(weight),
                _ => None,
            })
            .collect();
        let Some(qs) = quantized else {
            return Ok(None);
        };
        let first = qs[0];
        for q in &qs {
            let same = q.spec == first.spec
                && q.weight.ndim() == 2
                && q.weight.dim(1)? == first.weight.dim(1)?
                && q.scales.dtype()? == first.scales.dtype()?
                && q.biases.is_some() == first.biases.is_some();
            if !same {
                return Ok(None);
            }
        }
        // All or none have a biases plane (checked above).
        let biases: Option<Vec<&Array>> = qs.iter().map(|q| q.biases.as_ref()).collect();
        Ok(Some(Linear::quantized(
            QuantizedWeight {
                weight: cat(qs.iter().map(|q| &q.weight).collect())?,
                scales: cat(qs.iter().map(|q| &q.scales).collect())?,
                biases: biases.map(cat).transpose()?,
                spec: first.spec,
            },
            bias,
        )))
    }

    /// The bias `[out]`, if any.
    pub fn bias(&self) -> Option<&Array> {
        match self {
            Linear::Dense { bias, .. } | Linear::Quantized { bias, .. } => bias.as_ref(),
            Linear::Adapted { base, .. } => base.bias(),
        }
    }

    /// The arrays this layer holds.
    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            Linear::Dense { weight, bias, .. } => std::iter::once(weight).chain(bias).collect(),
            Linear::Quantized { weight, bias, .. } => {
                weight.arrays().into_iter().chain(bias).collect()
            }
            Linear::Adapted { base, lora } => {
                base.arrays().into_iter().chain(lora.arrays()).collect()
            }
        }
    }
}

/// A token embedding table `[vocab, dim]`.
#[derive(Debug, Clone)]
pub enum Embedding {
    /// `table` may be stored in half precision while the model computes in `dtype` (mlxcel's
    /// CPU kernel reads half-precision tables directly when they serve as output heads); the
    /// rows looked up are cast to `dtype`.
    Dense {
        /// `[vocab, dim]`.
        table: Array,
        /// The compute dtype rows are cast to.
        dtype: Dtype,
    },
    /// Rows are dequantized to `dtype` (the table's scales may be stored in half precision).
    Quantized {
        /// The packed `[vocab, dim]` table.
        table: QuantizedWeight,
        /// The compute dtype rows are dequantized to.
        dtype: Dtype,
    },
    /// A table with runtime LoRA adapters over its unchanged base (PEFT's `lora_embedding_A/B`,
    /// mlx-lm's `LoRAEmbedding`; see [`super::lora`]): looked-up rows and, when the table is
    /// the tied output head, the logits carry the low-rank term.
    Adapted {
        /// The dense or quantized table as the checkpoint stores it.
        base: Box<Embedding>,
        /// The registered adapters' terms (`A` `[r, vocab]`, `B` `[dim, r]`).
        lora: Box<LoraLayer>,
    },
}

impl Embedding {
    /// Rows for `ids` (any shape of int ids) → `[..ids, dim]`.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        match self {
            Embedding::Dense { table, dtype } => {
                let rows = ops::take_rows(table, ids)?;
                Ok(if rows.dtype()? == *dtype {
                    rows
                } else {
                    rows.astype(*dtype)?
                })
            }
            Embedding::Quantized { table: q, dtype } => {
                // MLX dequantizes in the scales' dtype: half-precision planes are widened
                // first (only the looked-up rows), or every value would round to half precision.
                let widen = |a: Array| -> Result<Array> {
                    let half = matches!(a.dtype()?, Dtype::Bfloat16 | Dtype::Float16);
                    Ok(if half && *dtype == Dtype::Float32 {
                        a.astype(Dtype::Float32)?
                    } else {
                        a
                    })
                };
                let w = ops::take_rows(&q.weight, ids)?;
                let s = widen(ops::take_rows(&q.scales, ids)?)?;
                let b = match &q.biases {
                    Some(b) => Some(widen(ops::take_rows(b, ids)?)?),
                    None => None,
                };
                Ok(ops::dequantize(&w, &s, b.as_ref(), q.spec, Some(*dtype))?)
            }
            Embedding::Adapted { base, lora } => lora.apply_rows(ids, base.forward(ids)?),
        }
    }

    /// The table used as an output projection (tied embeddings): `x @ table^T`.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        match self {
            Embedding::Dense { table, .. } => Ok(ops::linear(x, table, None)?),
            Embedding::Quantized { table: q, .. } => Ok(q.matmul_t(x)?),
            Embedding::Adapted { base, lora } => lora.apply_tied_head(x, base.as_linear(x)?),
        }
    }
}

/// Whether `ops::gather_qmm` runs this sorted routed-expert product on mlxcel's CUDA kernel
/// (rows already gathered): then the stack is not dequantized for it.
fn sorted_on_cuda_kernel(
    q: &QuantizedWeight,
    x: &Array,
    rows: Option<&Array>,
    experts: &Array,
) -> Result<bool> {
    Ok(rows.is_none()
        && mlxcel_core::cuda_kernels::gather_qmm_applies(
            x,
            &q.weight,
            &q.scales,
            q.biases.as_ref(),
            q.spec,
            experts,
        )?)
}

/// A stack of per-expert linear layers `[experts, out, in]`, applied with gathered matmuls.
#[derive(Debug, Clone)]
pub enum SwitchLinear {
    /// `[experts, out, in]` in the compute dtype.
    Dense(Array),
    /// `[experts, out, in]` packed.
    Quantized(QuantizedWeight),
    /// A stack with runtime LoRA adapters over its unchanged base (mlx-lm's
    /// `LoRASwitchLinear`; see [`super::lora`]).
    Adapted {
        /// The dense or quantized stack as the checkpoint stores it.
        base: Box<SwitchLinear>,
        /// Per-expert low-rank terms of the registered adapters.
        lora: Box<LoraLayer>,
    },
}

impl SwitchLinear {
    /// `x` `[.., 1, in]` against the experts named by `experts` (`x`'s batch shape broadcast
    /// against it) → `[.., 1, out]`. `sorted` promises `experts` is non-decreasing, which lets MLX
    /// run each expert's rows as one block.
    pub fn forward(&self, x: &Array, experts: &Array, sorted: bool) -> Result<Array> {
        self.forward_rows(x, None, experts, sorted)
    }

    /// [`SwitchLinear::forward`] with the row of `x` each product reads given as `rows` (shaped
    /// like `experts`); `None` lets MLX derive it from `x`'s batch shape, which it does with
    /// three arrays per call.
    pub fn forward_rows(
        &self,
        x: &Array,
        rows: Option<&Array>,
        experts: &Array,
        sorted: bool,
    ) -> Result<Array> {
        match self {
            SwitchLinear::Adapted { base, lora } => {
                let y = base.forward_rows(x, rows, experts, sorted)?;
                lora.apply_experts(x, rows, experts, sorted, y)
            }
            SwitchLinear::Dense(w) => {
                super::calibration::observe(w, x);
                let wt = w.transpose(&[0, 2, 1])?;
                Ok(ops::gather_mm(x, &wt, rows, Some(experts), sorted)?)
            }
            SwitchLinear::Quantized(q)
                if sorted
                    && dequantize_experts_for(x.dim(0)? as usize, q.weight.dim(0)? as usize)
                    && !sorted_on_cuda_kernel(q, x, rows, experts)? =>
            {
                // Prefill with several rows per expert on average: dequantize the stack once and
                // use the dense gathered GEMM (see `dequantize_rows_threshold`).
                let w = q.dequantize(x.dtype()?)?.transpose(&[0, 2, 1])?;
                Ok(ops::gather_mm(x, &w, rows, Some(experts), sorted)?)
            }
            SwitchLinear::Quantized(q) => Ok(ops::gather_qmm(
                x,
                &q.weight,
                &q.scales,
                q.biases.as_ref(),
                rows,
                Some(experts),
                true,
                q.spec,
                sorted,
            )?),
        }
    }
}
