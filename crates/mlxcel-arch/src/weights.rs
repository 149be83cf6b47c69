//! [`ModelWeights`]: how model code pulls its tensors by name. It checks shapes against what the
//! config implies, builds dense or quantized layers as the checkpoint stores them (per-module
//! quantization overrides, bit widths inferred from shapes), casts float tensors to the compute
//! dtype, records every array the model keeps (for the materialisation policy), and at the end
//! refuses tensors nobody used.
//!
//! Names are relative to the current scope: model code opens scopes the way the checkpoint nests
//! modules (`w.scope("model").scope("layers").scope(i)`, then `w.linear("self_attn.q_proj", ..)`),
//! so the same builder serves a decoder at the checkpoint root and one mounted under a prefix
//! (`language_model.` in a vision-language checkpoint).

use std::collections::BTreeSet;
use std::ops::Range;

use mlxcel_core::{Array, Dtype, WeightMap};
use mlxcel_quant::{QuantConfig, QuantMode, QuantizedWeight, TensorQuant};

use crate::nn::lora::{LoraLayer, RuntimeAdapters};
use crate::nn::{Embedding, Linear, SwitchLinear};
use crate::parallel::{Parallelism, TensorParallel};
use crate::{ModelError, Result};

/// A checkpoint's tensors as model code consumes them: name lookup under scopes, shape checks,
/// dense or quantized layer construction, and a record of what was used (see the module docs).
pub struct ModelWeights {
    map: WeightMap,
    quant: Option<QuantConfig>,
    dtype: Dtype,
    used: BTreeSet<String>,
    kept: Vec<Array>,
    stream: Option<ExpertStreamSetup>,
    /// An external per-layer-embedding table for the model to take (see
    /// [`ModelWeights::external_ple`]); `ple_taken` records that it did.
    ple: Option<std::rc::Rc<mlxcel_stream::ple::PleStore>>,
    ple_taken: bool,
    fuse_projections: bool,
    /// Runtime LoRA adapters not yet attached to a linear layer (see [`ModelWeights::finish`]).
    lora: Option<RuntimeAdapters>,
    /// The open scopes, outermost first.
    scope: Vec<String>,
    /// This rank's part of a tensor-parallel model (see [`crate::parallel`]).
    tensor_parallel: Option<TensorParallel>,
    /// A pipeline-parallel job (see [`crate::parallel`]).
    pipeline: Option<crate::parallel::PipelinePlan>,
    /// Build the multi-token-prediction layers the checkpoint carries (see
    /// [`ModelWeights::wants_mtp`]).
    mtp: bool,
}

/// Which part of a linear layer (or expert stack) this rank loads under tensor parallelism
/// (see [`crate::parallel`]). Only these rows or columns are read from the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Split {
    /// Output rows, concatenated in this order (a range may repeat): the layer computes this
    /// rank's columns of the whole output ("all-to-sharded"). The bias is sliced alike.
    Outputs(Vec<Range<i32>>),
    /// Input columns `range` (on whole quantization groups): the layer reads this rank's part
    /// of its input and its output is a partial sum over the ranks ("sharded-to-all");
    /// `with_bias` says whether this part adds the bias (exactly one rank does).
    Inputs {
        /// The columns.
        range: Range<i32>,
        /// Whether this part adds the bias.
        with_bias: bool,
    },
}

impl Split {
    /// The output rows of one range.
    pub fn rows(range: Range<i32>) -> Split {
        Split::Outputs(vec![range])
    }

    /// The width this part has of a dimension of `outputs` outputs and `inputs` inputs.
    fn local(&self, outputs: i32, inputs: i32) -> (i32, i32) {
        match self {
            Split::Outputs(rows) => (rows.iter().map(|r| r.end - r.start).sum(), inputs),
            Split::Inputs { range, .. } => (outputs, range.end - range.start),
        }
    }
}

/// Where one tensor is cut: `axis` and the ranges of it kept, in order.
#[derive(Debug, Clone)]
struct Cut {
    axis: usize,
    ranges: Vec<Range<i32>>,
}

/// A scope opened by [`ModelWeights::scope`]: dereferences to the weights with names resolved
/// under it, and closes when dropped.
#[derive(Debug)]
pub struct Scoped<'w> {
    weights: &'w mut ModelWeights,
}

impl std::ops::Deref for Scoped<'_> {
    type Target = ModelWeights;
    fn deref(&self) -> &ModelWeights {
        self.weights
    }
}

impl std::ops::DerefMut for Scoped<'_> {
    fn deref_mut(&mut self) -> &mut ModelWeights {
        self.weights
    }
}

impl Drop for Scoped<'_> {
    fn drop(&mut self) {
        self.weights.scope.pop();
    }
}

/// Where and how routed experts stream from disk (see `mlxcel_stream`).
#[derive(Debug, Clone)]
pub struct ExpertStreamSetup {
    /// The prepared `expert-stream` folder.
    pub dir: std::path::PathBuf,
    /// The folder's manifest: which layers stream, and where each expert's bytes lie.
    pub manifest: mlxcel_stream::Manifest,
    /// Experts kept resident per streamed layer (the slot arena's size).
    pub slots_per_layer: usize,
    /// Which resident expert gives up its slot on a miss.
    pub policy: mlxcel_stream::CachePolicy,
    /// How expert bytes are read (`O_DIRECT`, page cache dropped after each read, or cached).
    pub io: mlxcel_stream::ExpertIo,
    /// Whether decode steps read the next streamed layer's predicted experts ahead.
    pub prefetch: bool,
    /// Whether experts read from disk are copied straight into their slots (else through MLX).
    pub in_place: bool,
    /// Counters shared by all layers, read by the caller after a run.
    pub stats: std::rc::Rc<std::cell::RefCell<mlxcel_stream::StreamStats>>,
}

impl std::fmt::Debug for ModelWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelWeights")
            .field("tensors", &self.map.names().count())
            .field("used", &self.used.len())
            .field("kept", &self.kept.len())
            .field("quant", &self.quant)
            .field("dtype", &self.dtype)
            .field("stream", &self.stream.is_some())
            .field("external_ple", &self.ple.is_some())
            .field("fuse_projections", &self.fuse_projections)
            .field("scope", &self.scope)
            .finish()
    }
}

impl ModelWeights {
    /// `dtype` is the compute dtype float tensors are cast to (float32 on the CPU backend).
    pub fn new(map: WeightMap, quant: Option<QuantConfig>, dtype: Dtype) -> ModelWeights {
        ModelWeights {
            map,
            quant,
            dtype,
            used: BTreeSet::new(),
            kept: Vec::new(),
            stream: None,
            ple: None,
            ple_taken: false,
            fuse_projections: false,
            lora: None,
            scope: Vec::new(),
            tensor_parallel: None,
            pipeline: None,
            mtp: false,
        }
    }

    /// Builds the checkpoint's multi-token-prediction layers (for self-speculative decoding);
    /// without it they are skipped, never read.
    pub fn with_mtp(mut self, mtp: bool) -> ModelWeights {
        self.mtp = mtp;
        self
    }

    /// Whether the model should build its multi-token-prediction layers.
    pub fn wants_mtp(&self) -> bool {
        self.mtp
    }

    /// Builds this rank's part of a model spread over several processes (see
    /// [`crate::parallel`]).
    pub fn with_parallelism(mut self, parallelism: Option<Parallelism>) -> ModelWeights {
        match parallelism {
            Some(Parallelism::Tensor(tp)) => self.tensor_parallel = Some(tp),
            Some(Parallelism::Pipeline(plan)) => self.pipeline = Some(plan),
            None => {}
        }
        self
    }

    /// The pipeline-parallel job being built (the model picks its stage's layers,
    /// [`crate::parallel::PipelinePlan::stage`]), if any.
    pub fn pipeline_plan(&self) -> Option<&crate::parallel::PipelinePlan> {
        self.pipeline.as_ref()
    }

    /// The tensor-parallel split being built, if any.
    pub fn tensor_parallel(&self) -> Option<&TensorParallel> {
        self.tensor_parallel.as_ref()
    }

    /// Marks every tensor under `prefix` (under the open scopes) as used without loading it:
    /// the layers another pipeline stage holds.
    pub fn skip(&mut self, prefix: &str) {
        let prefix = format!("{}.", self.path(prefix));
        let names: Vec<String> = self
            .map
            .names()
            .filter(|n| n.starts_with(&prefix))
            .map(str::to_string)
            .collect();
        self.used.extend(names);
    }

    /// The width of the quantization groups along the inputs of linear layer `prefix` (under
    /// the open scopes) when it is stored quantized, else 1: the unit a split of its inputs
    /// keeps whole.
    pub fn input_unit(&self, prefix: &str) -> i32 {
        let prefix = self.path(prefix);
        if !self.map.contains(&format!("{prefix}.scales")) {
            return 1;
        }
        match self.quant.as_ref().map(|q| q.for_module(&prefix)) {
            Some(TensorQuant::Quantized {
                mode, group_size, ..
            }) => mode.fixed_layout().map_or(group_size, |(g, _)| g),
            _ => 1,
        }
    }

    /// Attaches runtime LoRA adapters to the linear layers they name (see
    /// [`crate::nn::lora`]); a module no linear layer reads is an error at
    /// [`ModelWeights::finish`].
    pub fn with_runtime_adapters(mut self, adapters: Option<RuntimeAdapters>) -> ModelWeights {
        self.lora = adapters.filter(|a| !a.modules.is_empty());
        self
    }

    /// Opens scope `name` (a module name or a layer index; `""` opens nothing new): names
    /// passed while it is open resolve to `{scope}.{name}`.
    pub fn scope(&mut self, name: impl std::fmt::Display) -> Scoped<'_> {
        self.scope.push(name.to_string());
        Scoped { weights: self }
    }

    /// The checkpoint name of `name` under the open scopes.
    pub fn path(&self, name: &str) -> String {
        self.scope
            .iter()
            .map(String::as_str)
            .chain(std::iter::once(name))
            .filter(|p| !p.is_empty())
            .collect::<Vec<_>>()
            .join(".")
    }

    /// Fuse linear layers that read the same input where [`ModelWeights::linear_group`] is
    /// asked to (see `BuildOptions::fuse_projections`).
    pub fn with_fused_projections(mut self, fuse: bool) -> ModelWeights {
        self.fuse_projections = fuse;
        self
    }

    /// Streams the routed experts of the layers `setup`'s manifest covers.
    pub fn with_stream(mut self, setup: Option<ExpertStreamSetup>) -> ModelWeights {
        self.stream = setup;
        self
    }

    /// Reads the per-layer-embedding table from `store` (on disk) instead of the checkpoint.
    pub fn with_external_ple(
        mut self,
        store: Option<std::rc::Rc<mlxcel_stream::ple::PleStore>>,
    ) -> ModelWeights {
        self.ple = store;
        self
    }

    /// The external per-layer-embedding table, when `config.json` declares one (`ple_storage`):
    /// a model with such a table takes it here instead of its resident tensor. A table nobody
    /// takes is an error at [`ModelWeights::finish`].
    pub fn external_ple(&mut self) -> Option<std::rc::Rc<mlxcel_stream::ple::PleStore>> {
        self.ple_taken |= self.ple.is_some();
        self.ple.clone()
    }

    /// The compute dtype float tensors are cast to.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Whether the checkpoint has tensor `name` (under the open scopes).
    pub fn contains(&self, name: &str) -> bool {
        self.map.contains(&self.path(name))
    }

    /// The tensor, or only the ranges of `cut` read from the checkpoint (concatenated).
    fn fetch_cut(&mut self, name: &str, cut: Option<&Cut>) -> Result<Array> {
        if !self.map.contains(name) {
            return Err(ModelError::MissingTensor(name.to_string()));
        }
        self.used.insert(name.to_string());
        let Some(cut) = cut else {
            return Ok(self.map.get(name)?);
        };
        let parts = cut
            .ranges
            .iter()
            .map(|r| self.map.get_slice(name, cut.axis, r.start, r.end))
            .collect::<mlxcel_core::Result<Vec<_>>>()?;
        Ok(match parts.len() {
            1 => parts.into_iter().next().expect("one part"),
            _ => mlxcel_core::ops::concatenate(&parts, cut.axis as i32)?,
        })
    }

    /// A float tensor in the compute dtype (other tensors as stored), or only the ranges of
    /// `cut`.
    fn fetch_float_cut(&mut self, name: &str, cut: Option<&Cut>) -> Result<Array> {
        let is_float = self.map.info(name).is_some_and(|i| i.dtype.is_float());
        if !is_float || cut.is_some() {
            let a = self.fetch_cut(name, cut)?;
            return Ok(if is_float && a.dtype()? != self.dtype {
                a.astype(self.dtype)?
            } else {
                a
            });
        }
        if !self.map.contains(name) {
            return Err(ModelError::MissingTensor(name.to_string()));
        }
        self.used.insert(name.to_string());
        Ok(self.map.get_as(name, self.dtype)?)
    }

    fn keep(&mut self, a: Array) -> Array {
        self.kept.push(a.clone());
        a
    }

    fn check_shape(&self, name: &str, expected: &[i32]) -> Result<()> {
        let found = self
            .map
            .info(name)
            .map(|i| i.shape.clone())
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        if found != expected {
            return Err(ModelError::Shape {
                tensor: name.to_string(),
                found,
                expected: expected.to_vec(),
            });
        }
        Ok(())
    }

    /// A float tensor of exactly `shape`, in the compute dtype.
    pub fn tensor(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        let name = self.path(name);
        self.tensor_at(&name, shape)
    }

    /// An error naming `name` unless it is stored as floats (a float tensor relabelled as an
    /// integer dtype of the same size would otherwise be read as garbage numbers).
    fn check_float(&self, name: &str) -> Result<()> {
        match self.map.info(name) {
            Some(info) if !info.dtype.is_float() => Err(ModelError::Dtype {
                tensor: name.to_string(),
                found: info.stored_dtype.clone(),
                expected: "a float dtype (F32, F16 or BF16)".to_string(),
            }),
            _ => Ok(()),
        }
    }

    fn tensor_at(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        self.tensor_cut(name, shape, None)
    }

    fn tensor_cut(&mut self, name: &str, shape: &[i32], cut: Option<&Cut>) -> Result<Array> {
        self.check_shape(name, shape)?;
        self.check_float(name)?;
        let a = self.fetch_float_cut(name, cut)?;
        Ok(self.keep(a))
    }

    /// Rows `ranges` of `axis` of the float tensor `name` of `shape` (concatenated in order):
    /// a tensor-parallel rank's per-head or per-column part (see [`crate::parallel`]).
    pub fn tensor_part(
        &mut self,
        name: &str,
        shape: &[i32],
        axis: usize,
        ranges: &[Range<i32>],
    ) -> Result<Array> {
        let name = self.path(name);
        let cut = Cut {
            axis,
            ranges: ranges.to_vec(),
        };
        self.tensor_cut(&name, shape, Some(&cut))
    }

    /// A dense weight used through `ops::linear` (linear layers, embedding tables that may serve
    /// as tied output heads). Where mlxcel's CPU kernel computes those (float32 compute on the
    /// CPU backend) a half-precision weight is kept as stored: the kernel widens it row by row,
    /// so loading neither converts nor copies it (see `WeightMap::get`) and it stays half the
    /// size in memory. Elsewhere it is cast to the compute dtype like any float tensor.
    fn matmul_weight(&mut self, name: &str, shape: &[i32], cut: Option<&Cut>) -> Result<Array> {
        self.check_shape(name, shape)?;
        let stored = self.map.info(name).map(|i| i.dtype);
        let half = matches!(stored, Some(Dtype::Bfloat16 | Dtype::Float16));
        if half && self.on_cpu_kernel_path()? {
            let a = self.fetch_cut(name, cut)?;
            return Ok(self.keep(a));
        }
        self.tensor_cut(name, shape, cut)
    }

    /// Whether linear layers run on mlxcel's CPU kernel (float32 compute on MLX's CPU backend),
    /// which reads half-precision weights, scales and biases as stored.
    fn on_cpu_kernel_path(&self) -> Result<bool> {
        Ok(self.dtype == Dtype::Float32 && mlxcel_core::ops::cpu_kernels_active()?)
    }

    /// The tensor at checkpoint name `name` when present (see [`ModelWeights::tensor`]),
    /// `None` when the checkpoint lacks it.
    fn optional_at(&mut self, name: &str, shape: &[i32]) -> Result<Option<Array>> {
        if self.map.contains(name) {
            self.tensor_at(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// The quantization of module `prefix`: `None` when stored dense (no `.scales`).
    fn quantized(
        &mut self,
        prefix: &str,
        out_shape: &[i32],
        in_features: i32,
    ) -> Result<Option<QuantizedWeight>> {
        self.quantized_split(prefix, out_shape, in_features, None)
    }

    /// [`ModelWeights::quantized`] of this rank's part `split` of the layer (the last entry of
    /// `out_shape` is the split one): output rows of every plane, or whole quantization groups
    /// of input columns.
    fn quantized_split(
        &mut self,
        prefix: &str,
        out_shape: &[i32],
        in_features: i32,
        split: Option<&Split>,
    ) -> Result<Option<QuantizedWeight>> {
        let scales_name = format!("{prefix}.scales");
        if !self.map.contains(&scales_name) {
            return Ok(None);
        }
        let (mode, group_size, bits) = match self.quant.as_ref().map(|q| q.for_module(prefix)) {
            Some(TensorQuant::Quantized {
                mode,
                group_size,
                bits,
            }) => (mode, group_size, bits),
            Some(TensorQuant::Dense) => {
                return Err(ModelError::Config(format!(
                    "quantization marks `{prefix}` as dense but the checkpoint has `{scales_name}`"
                )))
            }
            None => {
                return Err(ModelError::Config(format!(
                    "`{scales_name}` is quantized but config.json has no `quantization` block"
                )))
            }
        };
        let weight_name = format!("{prefix}.weight");
        let row_axis = out_shape.len() - 1;
        // Where each plane is cut: output rows alike; input columns by their own width per
        // column (packed words for the weight, one scale per group).
        let cut_of = |w: &Self, name: &str| -> Result<Option<Cut>> {
            let Some(split) = split else { return Ok(None) };
            Ok(Some(match split {
                Split::Outputs(rows) => Cut {
                    axis: row_axis,
                    ranges: rows.clone(),
                },
                Split::Inputs { range, .. } => {
                    let stored = w
                        .map
                        .info(name)
                        .and_then(|i| i.shape.last().copied())
                        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
                    // Columns per stored element: in_features / stored width (exact for whole
                    // groups and whole packed words).
                    let aligned = |x: i32| (x as i64 * stored as i64) % in_features as i64 == 0;
                    if !aligned(range.start) || !aligned(range.end) {
                        return Err(ModelError::Unsupported(format!(
                            "tensor parallelism: `{name}` cannot be cut at input columns {range:?} of {in_features} (stored as {stored} per row): a rank's part must be whole quantization groups"
                        )));
                    }
                    let at = |x: i32| (x as i64 * stored as i64 / in_features as i64) as i32;
                    Cut {
                        axis: row_axis + 1,
                        ranges: std::iter::once(at(range.start)..at(range.end)).collect(),
                    }
                }
            }))
        };
        let weight_cut = cut_of(self, &weight_name)?;
        let weight = self.fetch_cut(&weight_name, weight_cut.as_ref())?;
        let (out_shape, in_features) = match split {
            Some(split) => {
                let (o, i) = split.local(out_shape[row_axis], in_features);
                let mut shape = out_shape.to_vec();
                shape[row_axis] = o;
                (shape, i)
            }
            None => (out_shape.to_vec(), in_features),
        };
        let out_shape = &out_shape[..];
        // Layers mlxcel's CPU kernel computes read half-precision scales and biases as stored
        // (no float32 copy at load); everything else gets them in the compute dtype.
        let spec = mlxcel_core::ops::QuantSpec {
            mode,
            group_size,
            bits,
        };
        let stored_planes = out_shape.len() == 1
            && mlxcel_core::ops::cpu_kernel_reads(spec)
            && self.on_cpu_kernel_path()?;
        let plane = |w: &mut Self, name: &str| {
            let cut = cut_of(w, name)?;
            if stored_planes {
                w.fetch_cut(name, cut.as_ref())
            } else {
                w.fetch_float_cut(name, cut.as_ref())
            }
        };
        // Affine scales and every biases plane are floats; the fp4/fp8 modes store scales as
        // bytes.
        if mode == QuantMode::Affine {
            self.check_float(&scales_name)?;
        }
        let scales = plane(self, &scales_name)?;
        let biases_name = format!("{prefix}.biases");
        if self.map.contains(&biases_name) {
            self.check_float(&biases_name)?;
        }
        let biases = if self.map.contains(&biases_name) {
            Some(plane(self, &biases_name)?)
        } else {
            None
        };
        let q = QuantizedWeight::new(&weight_name, weight, scales, biases, mode, group_size, bits)?;
        let mut expected = out_shape.to_vec();
        expected.push(in_features);
        let mut found = q.weight.shape();
        if let Some(last) = found.last_mut() {
            *last = q.in_features();
        }
        if found != expected {
            return Err(ModelError::Shape {
                tensor: weight_name,
                found,
                expected,
            });
        }
        if q.spec.mode == QuantMode::Affine && q.spec.bits == 1 && out_shape.len() > 1 {
            return Err(ModelError::Unsupported(format!(
                "`{weight_name}`: 1-bit affine is supported for dense linears and embeddings only, not expert stacks"
            )));
        }
        let q = if stored_planes {
            q
        } else {
            q.with_float_dtype(self.dtype)?
        };
        for a in q.arrays() {
            self.kept.push(a.clone());
        }
        Ok(Some(q))
    }

    /// A linear layer `prefix.{weight,bias}` mapping `in_features` to `out_features`, dense or
    /// quantized as stored.
    pub fn linear(
        &mut self,
        prefix: &str,
        in_features: i32,
        out_features: i32,
        bias: bool,
    ) -> Result<Linear> {
        self.linear_split(prefix, in_features, out_features, bias, None)
    }

    /// This rank's part `split` of linear layer `prefix` (the whole layer for `None`), reading
    /// only that part from the checkpoint (see [`crate::parallel`]).
    pub fn linear_split(
        &mut self,
        prefix: &str,
        in_features: i32,
        out_features: i32,
        bias: bool,
        split: Option<&Split>,
    ) -> Result<Linear> {
        let prefix = self.path(prefix);
        self.linear_at(&prefix, in_features, out_features, bias, split)
    }

    fn linear_at(
        &mut self,
        prefix: &str,
        in_features: i32,
        out_features: i32,
        bias: bool,
        split: Option<&Split>,
    ) -> Result<Linear> {
        let bias_name = format!("{prefix}.bias");
        let bias = match (bias, split) {
            (false, _) => None,
            (true, None) => Some(self.tensor_at(&bias_name, &[out_features])?),
            (true, Some(Split::Outputs(rows))) => {
                let cut = Cut {
                    axis: 0,
                    ranges: rows.clone(),
                };
                Some(self.tensor_cut(&bias_name, &[out_features], Some(&cut))?)
            }
            (true, Some(Split::Inputs { with_bias, .. })) => {
                if *with_bias {
                    Some(self.tensor_at(&bias_name, &[out_features])?)
                } else {
                    self.check_shape(&bias_name, &[out_features])?;
                    self.used.insert(bias_name);
                    None
                }
            }
        };
        let base = match self.quantized_split(prefix, &[out_features], in_features, split)? {
            Some(q) => Linear::quantized(q, bias),
            None => {
                let cut = split.map(|s| match s {
                    Split::Outputs(rows) => Cut {
                        axis: 0,
                        ranges: rows.clone(),
                    },
                    Split::Inputs { range, .. } => Cut {
                        axis: 1,
                        ranges: std::iter::once(range.clone()).collect(),
                    },
                });
                let weight = self.matmul_weight(
                    &format!("{prefix}.weight"),
                    &[out_features, in_features],
                    cut.as_ref(),
                )?;
                Linear::dense(weight, bias)?
            }
        };
        if split.is_some()
            && self
                .lora
                .as_ref()
                .is_some_and(|l| l.modules.contains_key(prefix))
        {
            return Err(ModelError::Unsupported(format!(
                "runtime adapters on `{prefix}` under tensor parallelism"
            )));
        }
        self.adapt(prefix, base, in_features, out_features)
    }

    /// `base` with the runtime adapters that name module `prefix`, after checking their shapes.
    fn adapt(
        &mut self,
        prefix: &str,
        base: Linear,
        in_features: i32,
        out_features: i32,
    ) -> Result<Linear> {
        match self.take_adapters(prefix, &[], in_features, out_features)? {
            None => Ok(base),
            Some(lora) => Ok(Linear::Adapted {
                base: Box::new(base),
                lora: Box::new(lora),
            }),
        }
    }

    /// The runtime adapters' terms for module `prefix` (`stack`: the leading expert axis of a
    /// stacked layer, empty for a plain one), shapes checked: `A` `[..stack, r, in]`, `B`
    /// `[..stack, out, r]`. `None` when no adapter names it.
    fn take_adapters(
        &mut self,
        prefix: &str,
        stack: &[i32],
        in_features: i32,
        out_features: i32,
    ) -> Result<Option<LoraLayer>> {
        let Some(lora) = self.lora.as_mut() else {
            return Ok(None);
        };
        let Some(pairs) = lora.modules.remove(prefix) else {
            return Ok(None);
        };
        let set = lora.set.clone();
        for pair in pairs.iter().flatten() {
            let (a, b) = (pair.a.shape(), pair.b.shape());
            let n = stack.len();
            let fits = a.len() == n + 2
                && b.len() == n + 2
                && a[..n] == *stack
                && b[..n] == *stack
                && a[n] == b[n + 1]
                && a[n + 1] == in_features
                && b[n] == out_features;
            if !fits {
                return Err(ModelError::Transform(format!(
                    "{}: low-rank pair A {a:?} / B {b:?} does not fit `{prefix}` ({}{in_features} → {out_features}; an adapter for another model?)",
                    pair.origin,
                    if n == 0 { String::new() } else { format!("{stack:?} experts, ") }
                )));
            }
            if n > 0 && pair.magnitude.is_some() {
                return Err(ModelError::Unsupported(format!(
                    "{}: DoRA on the expert stack `{prefix}` (mlx-lm does not define it either)",
                    pair.origin
                )));
            }
            self.kept.extend([pair.a.clone(), pair.b.clone()]);
            self.kept.extend(pair.magnitude.clone());
        }
        Ok(Some(LoraLayer::new(set, pairs)))
    }

    /// Linear layers `prefixes` that read the same input, each mapping `in_features` to its
    /// entry of `out_features`: one fused layer (outputs side by side, in order) when fusing is
    /// on and they share a storage format, else the layers as stored.
    pub fn linear_group(
        &mut self,
        prefixes: &[&str],
        in_features: i32,
        out_features: &[i32],
        bias: bool,
    ) -> Result<Vec<Linear>> {
        let splits = vec![None; prefixes.len()];
        self.linear_group_split(prefixes, in_features, out_features, bias, &splits)
    }

    /// [`ModelWeights::linear_group`] of each layer's part `splits[i]` (see
    /// [`ModelWeights::linear_split`]).
    pub fn linear_group_split(
        &mut self,
        prefixes: &[&str],
        in_features: i32,
        out_features: &[i32],
        bias: bool,
        splits: &[Option<Split>],
    ) -> Result<Vec<Linear>> {
        let kept_before = self.kept.len();
        let parts = prefixes
            .iter()
            .zip(out_features)
            .zip(splits)
            .map(|((prefix, &out), split)| {
                self.linear_split(prefix, in_features, out, bias, split.as_ref())
            })
            .collect::<Result<Vec<_>>>()?;
        if !self.fuse_projections {
            return Ok(parts);
        }
        match Linear::concat_outputs(&parts)? {
            Some(fused) => {
                // Materialise the fused planes instead of the parts, which are then dropped.
                self.kept.truncate(kept_before);
                self.kept.extend(fused.arrays().into_iter().cloned());
                Ok(vec![fused])
            }
            None => Ok(parts),
        }
    }

    /// An embedding table `[vocab, dim]`, dense or quantized, with the runtime adapters that
    /// name it (`A` `[r, vocab]`, `B` `[dim, r]`; not DoRA).
    pub fn embedding(&mut self, prefix: &str, vocab: i32, dim: i32) -> Result<Embedding> {
        let prefix = &self.path(prefix);
        let base = match self.quantized(prefix, &[vocab], dim)? {
            Some(q) => Embedding::Quantized {
                table: q,
                dtype: self.dtype,
            },
            None => Embedding::Dense {
                table: self.matmul_weight(&format!("{prefix}.weight"), &[vocab, dim], None)?,
                dtype: self.dtype,
            },
        };
        match self.take_adapters(prefix, &[], vocab, dim)? {
            None => Ok(base),
            Some(lora) => {
                if let Some(origin) = lora.dora_origin() {
                    return Err(ModelError::Unsupported(format!(
                        "{origin}: DoRA on the embedding `{prefix}`"
                    )));
                }
                Ok(Embedding::Adapted {
                    base: Box::new(base),
                    lora: Box::new(lora),
                })
            }
        }
    }

    /// A stack of `experts` linear layers `[experts, out, in]` (MoE) at checkpoint name
    /// `prefix`, dense or quantized.
    fn switch_linear_at(
        &mut self,
        prefix: &str,
        experts: i32,
        in_features: i32,
        out_features: i32,
        split: Option<&Split>,
    ) -> Result<SwitchLinear> {
        let base =
            match self.quantized_split(prefix, &[experts, out_features], in_features, split)? {
                Some(q) => SwitchLinear::Quantized(q),
                None => {
                    let cut = split.map(|s| match s {
                        Split::Outputs(rows) => Cut {
                            axis: 1,
                            ranges: rows.clone(),
                        },
                        Split::Inputs { range, .. } => Cut {
                            axis: 2,
                            ranges: std::iter::once(range.clone()).collect(),
                        },
                    });
                    SwitchLinear::Dense(self.tensor_cut(
                        &format!("{prefix}.weight"),
                        &[experts, out_features, in_features],
                        cut.as_ref(),
                    )?)
                }
            };
        if split.is_some()
            && self
                .lora
                .as_ref()
                .is_some_and(|l| l.modules.contains_key(prefix))
        {
            return Err(ModelError::Unsupported(format!(
                "runtime adapters on `{prefix}` under tensor parallelism"
            )));
        }
        match self.take_adapters(prefix, &[experts], in_features, out_features)? {
            None => Ok(base),
            Some(lora) => Ok(SwitchLinear::Adapted {
                base: Box::new(base),
                lora: Box::new(lora),
            }),
        }
    }

    /// A stack of per-head matrices `shape` = `[heads, out, in]` as a dense array in the
    /// compute dtype: dequantized at load when stored quantized (small per-head projections
    /// such as latent attention's `embed_q`, which run as batched matmuls).
    pub fn dense_stack(&mut self, prefix: &str, shape: &[i32]) -> Result<Array> {
        self.dense_stack_part(prefix, shape, None)
    }

    /// [`ModelWeights::dense_stack`] of heads `heads` only (a tensor-parallel rank's): a
    /// dense stack reads only those heads; a quantized one is dequantized, then cut.
    pub fn dense_stack_part(
        &mut self,
        prefix: &str,
        shape: &[i32],
        heads: Option<Range<i32>>,
    ) -> Result<Array> {
        let prefix = self.path(prefix);
        let (out, inp) = shape.split_at(shape.len() - 1);
        let kept_before = self.kept.len();
        if let Some(q) = self.quantized(&prefix, out, inp[0])? {
            // Only the dense copy is kept: materialising the packed planes too would hold both.
            self.kept.truncate(kept_before);
            let mut dense = q.dequantize(self.dtype)?;
            if let Some(h) = heads {
                dense = dense.slice_axis(0, h.start, h.end)?;
            }
            return Ok(self.keep(dense));
        }
        let name = format!("{prefix}.weight");
        match heads {
            None => self.tensor_at(&name, shape),
            Some(h) => {
                let cut = Cut {
                    axis: 0,
                    ranges: std::iter::once(h).collect(),
                };
                self.tensor_cut(&name, shape, Some(&cut))
            }
        }
    }

    /// A normalisation layer `prefix.weight` (and `prefix.bias` for LayerNorm when present).
    pub fn norm(
        &mut self,
        prefix: &str,
        kind: crate::nn::NormKind,
        dim: i32,
        eps: f32,
    ) -> Result<crate::nn::Norm> {
        let prefix = self.path(prefix);
        let weight = self.tensor_at(&format!("{prefix}.weight"), &[dim])?;
        let bias = match kind {
            crate::nn::NormKind::Layer => self.optional_at(&format!("{prefix}.bias"), &[dim])?,
            _ => None,
        };
        let norm = crate::nn::Norm::new(kind, weight, bias, eps)?;
        self.keep_all(norm.arrays());
        Ok(norm)
    }

    /// Records arrays built at load from checkpoint tensors (folded norms, rope tables), so the
    /// materialisation policy evaluates them too.
    pub fn keep_all<'a>(&mut self, arrays: impl IntoIterator<Item = &'a Array>) {
        self.kept.extend(arrays.into_iter().cloned());
    }

    /// The routed experts of the MoE block at `prefix` (`{prefix}.switch_mlp.{gate,up,down}_proj`):
    /// streamed when the expert stream covers this layer, else resident.
    pub fn routed_experts(
        &mut self,
        prefix: &str,
        experts: i32,
        hidden: i32,
        intermediate: i32,
        act: crate::nn::Activation,
    ) -> Result<crate::nn::RoutedExperts> {
        self.routed_experts_split(prefix, experts, hidden, intermediate, act, true, None)
    }

    /// Plain routed experts `down(act(up(x)))` at `prefix` (`{prefix}.switch_mlp.{up,down}_proj`,
    /// no gate projection: Nemotron-H), always resident.
    pub fn plain_routed_experts(
        &mut self,
        prefix: &str,
        experts: i32,
        hidden: i32,
        intermediate: i32,
        act: crate::nn::Activation,
    ) -> Result<crate::nn::RoutedExperts> {
        self.routed_experts_split(prefix, experts, hidden, intermediate, act, false, None)
    }

    /// The routed experts at `prefix`, with a gate projection when `gated`
    /// ([`ModelWeights::routed_experts`]) or without ([`ModelWeights::plain_routed_experts`]),
    /// holding only intermediate columns `columns` of every expert when given (a
    /// tensor-parallel rank's part: gate/up output rows, down input columns; its result is a
    /// partial sum over the ranks).
    #[allow(clippy::too_many_arguments)]
    pub fn routed_experts_split(
        &mut self,
        prefix: &str,
        experts: i32,
        hidden: i32,
        intermediate: i32,
        act: crate::nn::Activation,
        gated: bool,
        columns: Option<Range<i32>>,
    ) -> Result<crate::nn::RoutedExperts> {
        let rows = columns.clone().map(Split::rows);
        let inputs = columns.map(|range| Split::Inputs {
            range,
            with_bias: false,
        });
        use crate::nn::{RoutedExperts, StreamedGlu, SwitchGlu};
        let prefix = &self.path(prefix);
        let s = format!("{prefix}.switch_mlp");
        let entry = self
            .stream
            .as_ref()
            .and_then(|st| st.manifest.layer(prefix).cloned());
        let (Some(entry), Some(setup)) = (entry, self.stream.clone()) else {
            let gate = if gated {
                Some(self.switch_linear_at(
                    &format!("{s}.gate_proj"),
                    experts,
                    hidden,
                    intermediate,
                    rows.as_ref(),
                )?)
            } else {
                None
            };
            return Ok(RoutedExperts::Resident(SwitchGlu {
                gate,
                up: self.switch_linear_at(
                    &format!("{s}.up_proj"),
                    experts,
                    hidden,
                    intermediate,
                    rows.as_ref(),
                )?,
                down: self.switch_linear_at(
                    &format!("{s}.down_proj"),
                    experts,
                    intermediate,
                    hidden,
                    inputs.as_ref(),
                )?,
                act,
                biases: None,
            }));
        };
        if rows.is_some() {
            return Err(ModelError::Unsupported(format!(
                "{prefix}: streamed experts under tensor parallelism"
            )));
        }
        if !gated {
            return Err(ModelError::Unsupported(format!(
                "{prefix}: streaming plain (ungated) experts"
            )));
        }
        if entry.experts != experts as usize {
            return Err(ModelError::Config(format!(
                "{prefix}: the expert stream has {} experts, the config {experts}",
                entry.experts
            )));
        }
        let dims = [
            (intermediate, hidden),
            (intermediate, hidden),
            (hidden, intermediate),
        ];
        let mut specs = [None; 3];
        for (i, proj) in mlxcel_stream::manifest::PROJECTIONS.iter().enumerate() {
            let (out, inp) = dims[i];
            let name = format!("{s}.{proj}.weight");
            let weight = entry
                .plane(&format!("{proj}.weight"))
                .ok_or_else(|| ModelError::MissingTensor(name.clone()))?;
            specs[i] = match entry.plane(&format!("{proj}.scales")) {
                None => {
                    if weight.shape != [out, inp] {
                        return Err(ModelError::Shape {
                            tensor: name,
                            found: weight.shape.clone(),
                            expected: vec![out, inp],
                        });
                    }
                    None
                }
                Some(scales) => {
                    let module = format!("{s}.{proj}");
                    let (mode, group, bits) =
                        match self.quant.as_ref().map(|q| q.for_module(&module)) {
                            Some(TensorQuant::Quantized {
                                mode,
                                group_size,
                                bits,
                            }) => (mode, group_size, bits),
                            _ => {
                                return Err(ModelError::Config(format!(
                            "`{module}` is quantized in the expert stream but not in config.json"
                        )))
                            }
                        };
                    let (group, bits) = match mode.fixed_layout() {
                        Some(fixed) => fixed,
                        None => (
                            group,
                            mlxcel_quant::infer_quantization_bits(
                                &name,
                                &weight.shape,
                                &scales.shape,
                                group,
                                bits,
                            )?,
                        ),
                    };
                    let unpacked = weight.shape.last().copied().unwrap_or(0) * 32 / bits;
                    if weight.shape.first() != Some(&out) || unpacked != inp {
                        return Err(ModelError::Shape {
                            tensor: name,
                            found: vec![weight.shape[0], unpacked],
                            expected: vec![out, inp],
                        });
                    }
                    Some(mlxcel_core::ops::QuantSpec {
                        mode,
                        group_size: group,
                        bits,
                    })
                }
            };
        }
        // The stacked tensors stay on disk; they count as used.
        let names: Vec<String> = self
            .map
            .names()
            .filter(|n| n.starts_with(&format!("{s}.")))
            .map(str::to_string)
            .collect();
        self.used.extend(names);
        let mut layer = mlxcel_stream::LayerStream::open(
            &setup.dir,
            &entry,
            setup.slots_per_layer,
            setup.policy,
            setup.io,
            self.dtype,
            setup.stats.clone(),
        )?;
        layer.write_in_place(setup.in_place);
        Ok(RoutedExperts::Streamed(Box::new(StreamedGlu {
            layer: std::rc::Rc::new(std::cell::RefCell::new(layer)),
            next: None,
            reads_ahead: setup.prefetch,
            specs,
            act,
        })))
    }

    /// Ends construction: an error listing the tensors the model did not use; otherwise every
    /// array the model keeps.
    pub fn finish(self, model: &str) -> Result<Vec<Array>> {
        if let Some((module, pairs)) = self.lora.as_ref().and_then(|l| l.modules.iter().next()) {
            let origin = pairs
                .iter()
                .flatten()
                .map(|p| p.origin.as_str())
                .next()
                .unwrap_or("a runtime adapter");
            return Err(ModelError::Transform(format!(
                "{origin}: `{module}` is not a linear layer of {model} that takes runtime adapters (an adapter for another architecture, or a module only a fused adapter can change)"
            )));
        }
        if self.ple.is_some() && !self.ple_taken {
            return Err(ModelError::Config(format!(
                "`ple_storage` in config.json puts a per-layer-embedding table on disk, but {model} has no per-layer embeddings"
            )));
        }
        let unused: Vec<String> = self
            .map
            .names()
            .filter(|n| !self.used.contains(*n))
            .map(str::to_string)
            .collect();
        if !unused.is_empty() {
            return Err(ModelError::UnexpectedTensors {
                model: model.to_string(),
                names: unused,
            });
        }
        Ok(self.kept)
    }
}
