//! Gemma 3n (text): transformers' `Gemma3nForCausalLM` (`model_type: gemma3n_text`) and the text
//! decoder of `Gemma3nForConditionalGeneration` (`gemma3n`, the text model under `text_config`,
//! loaded text only: see [`crate::nonstandard::load_gemma3n`]).
//!
//! Gemma 3n is not a decoder of the shared [`super::transformer`] shape; this file composes it
//! from `nn/`:
//!
//! - **AltUp** (alternating updates): the residual stream is `altup_num_inputs` copies
//!   `[N, B, L, hidden]`. The first is the scaled token embedding, the others its projections
//!   (`altup_projections`) rescaled to its RMS magnitude. Each layer *predicts* all copies from
//!   a `tanh` router over the active one (`altup_active_idx`), runs its block on the active
//!   prediction only, then *corrects* every copy with the block's innovation; at the end the
//!   copies are projected back (`altup_unembed_projections`), rescaled and averaged.
//! - **LAuReL** (learned augmented residual): a rank-`laurel_rank` bottleneck of the normed
//!   input, added next to the attention output, the sum scaled by `1/sqrt(2)`.
//! - **Per-layer inputs**: every token has a row of `num_hidden_layers × hidden_size_per_layer_input`
//!   in `embed_tokens_per_layer` (scaled by `sqrt(hidden_size_per_layer_input)`; ids at or past
//!   `vocab_size_per_layer_input` read row 0), added to a projection of the embedding
//!   (`per_layer_model_projection`, scaled by `hidden^-1/2`, RMS-normed per layer) and scaled by
//!   `1/sqrt(2)`. Layer `i` gates its slice into the corrected stream. The table sits behind
//!   [`PerLayerTable`], the seam for storing it outside the model's parameters.
//! - **KV sharing**: the last `num_kv_shared_layers` layers compute queries only and attend over
//!   the keys and values of the last earlier layer of their own type (sliding or full), as that
//!   layer returned them in this forward pass; their caches are [`LayerCache::Shared`].
//! - **Activation sparsity**: the MLPs of layers with `activation_sparsity_pattern[i] > 0` keep
//!   only gate activations above `mean + std · Φ⁻¹(sparsity)` (a Gaussian top-k).
//! - Attention scale 1, per-head RMS norms of queries and keys (weights multiply, not `1 + w`)
//!   and of values (no weight), sliding layers with the local rope base, final logit soft-cap.

use mlxcel_core::ops::{self, AttentionMask};
use mlxcel_core::{Array, Dtype, WeightMap};
use mlxcel_quant::QuantConfig;
use serde::Deserialize;
use serde_json::Value;

use super::common::CommonArgs;
use super::transformer::check_token_ids;
use crate::cache::{LayerCache, Mask};
use crate::model::{Architecture, LanguageModel, LayerKind};
use crate::nn::{Activation, Embedding, Linear, Norm, NormKind, RopeConfig, RotaryEmbedding};
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

fn default_vocab_per_layer() -> i32 {
    262_144
}
fn default_hidden_per_layer() -> i32 {
    256
}
fn default_altup_inputs() -> usize {
    4
}
fn default_true() -> bool {
    true
}
fn default_kv_shared() -> usize {
    15
}
fn default_laurel_rank() -> i32 {
    64
}
fn default_softcap() -> Option<f64> {
    Some(30.0)
}
fn default_window() -> usize {
    512
}
fn default_global_theta() -> f64 {
    1_000_000.0
}
fn default_local_theta() -> f64 {
    10_000.0
}

/// A value given once for every layer or once per layer (`intermediate_size`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PerLayer<T> {
    /// The same value on every layer.
    One(T),
    /// One value per layer.
    List(Vec<T>),
}

impl<T: Copy> PerLayer<T> {
    /// The `n` per-layer values; a list of another length is an error naming `key`.
    fn expand(&self, key: &str, n: usize) -> Result<Vec<T>> {
        match self {
            PerLayer::One(v) => Ok(vec![*v; n]),
            PerLayer::List(l) if l.len() == n => Ok(l.clone()),
            PerLayer::List(l) => Err(ModelError::Config(format!(
                "{key} has {} entries for {n} layers",
                l.len()
            ))),
        }
    }
}

/// A Gemma 3n config: a `gemma3n_text` one as it is, or a `gemma3n` one's `text_config` (with
/// the top level's `tie_word_embeddings` where the text config lacks it), so that the registry's
/// cache schedule and the loader read either.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "Value")]
pub struct Args {
    /// The text model's keys.
    pub text: TextArgs,
    /// Read from a multimodal config's `text_config`.
    pub nested: bool,
}

impl TryFrom<Value> for Args {
    type Error = serde_json::Error;

    fn try_from(config: Value) -> std::result::Result<Args, serde_json::Error> {
        use serde::de::Error;
        let nested = config.get("text_config").is_some();
        let text = crate::nonstandard::text_config(&config).map_err(serde_json::Error::custom)?;
        let place = if nested { "text_config." } else { "" };
        crate::validate::validate_config(&text)
            .map_err(|e| serde_json::Error::custom(format!("{place}{e}")))?;
        let text: TextArgs = serde_json::from_value(text.clone()).map_err(|e| {
            let located = crate::validate::locate_serde_error::<TextArgs>(&text, &e.to_string());
            serde_json::Error::custom(format!("{place}{located}"))
        })?;
        Ok(Args { text, nested })
    }
}

/// The `config.json` keys of Gemma 3n's text model (`gemma3n_text`, or a `gemma3n` config's
/// `text_config`), with transformers' defaults.
#[derive(Debug, Clone, Deserialize)]
pub struct TextArgs {
    /// The keys every decoder shares (`hidden_size`, heads, `layer_types`, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `intermediate_size`: the MLP width, one for all layers or one per layer (required).
    pub intermediate_size: PerLayer<i32>,
    /// `hidden_activation`: the MLP and per-layer gate activation; default `gelu_pytorch_tanh`.
    #[serde(default)]
    pub hidden_activation: Option<String>,
    /// `sliding_window`: keys per query on sliding layers; default 512.
    #[serde(default = "default_window")]
    pub sliding_window: usize,
    /// `rope_theta`: the rope base of full-attention layers; default `1e6`.
    #[serde(default = "default_global_theta")]
    pub rope_theta: f64,
    /// `rope_local_base_freq` (`rope_parameters.sliding_attention.rope_theta`): the rope base of
    /// sliding layers; default `1e4`.
    #[serde(default = "default_local_theta")]
    pub rope_local_base_freq: f64,
    /// `attention_bias`: biases on the attention projections; default false.
    #[serde(default)]
    pub attention_bias: bool,
    /// `final_logit_softcapping`: `tanh(x / cap) · cap` on the logits; default 30.
    #[serde(default = "default_softcap")]
    pub final_logit_softcapping: Option<f64>,
    /// `vocab_size_per_layer_input`: rows of the per-layer embedding table; default 262144.
    #[serde(default = "default_vocab_per_layer")]
    pub vocab_size_per_layer_input: i32,
    /// `hidden_size_per_layer_input`: width of one layer's slice of a per-layer row; default 256.
    #[serde(default = "default_hidden_per_layer")]
    pub hidden_size_per_layer_input: i32,
    /// `altup_num_inputs`: copies of the residual stream; default 4.
    #[serde(default = "default_altup_inputs")]
    pub altup_num_inputs: usize,
    /// `altup_active_idx`: the copy the blocks run on; default 0.
    #[serde(default)]
    pub altup_active_idx: usize,
    /// `altup_correct_scale`: scale the corrected active copy by `correct_output_scale` before
    /// the per-layer gate; default true.
    #[serde(default = "default_true")]
    pub altup_correct_scale: bool,
    /// `num_kv_shared_layers`: the last this-many layers reuse earlier layers' keys and values;
    /// default 15.
    #[serde(default = "default_kv_shared")]
    pub num_kv_shared_layers: usize,
    /// `laurel_rank`: width of the LAuReL bottleneck; default 64.
    #[serde(default = "default_laurel_rank")]
    pub laurel_rank: i32,
    /// `activation_sparsity_pattern`: per layer, the share of gate activations zeroed (0 for a
    /// dense MLP); default 0.95 on the first 10 layers of models with more than 10, else none.
    #[serde(default)]
    pub activation_sparsity_pattern: Option<PerLayer<f64>>,
}

/// Where a layer's keys and values come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvSource {
    /// Its own projections (written to its own cache).
    Own,
    /// Layer `source`'s, as that layer returned them in the same forward pass.
    Shared(usize),
}

/// Everything [`Args`] implies per layer, checked.
#[derive(Debug, Clone)]
struct Plan {
    windows: Vec<Option<usize>>,
    kv: Vec<KvSource>,
    intermediate: Vec<i32>,
    sparsity: Vec<f64>,
    act: Activation,
}

impl TextArgs {
    fn layers(&self) -> usize {
        self.common.num_hidden_layers
    }

    fn plan(&self) -> Result<Plan> {
        let c = &self.common;
        let n = self.layers();
        for (key, v) in [
            (
                "hidden_size_per_layer_input",
                self.hidden_size_per_layer_input,
            ),
            (
                "vocab_size_per_layer_input",
                self.vocab_size_per_layer_input,
            ),
            ("laurel_rank", self.laurel_rank),
        ] {
            if v <= 0 {
                return Err(ModelError::Config(format!("{key} = {v}: must be positive")));
            }
        }
        if self.altup_num_inputs == 0 || self.altup_active_idx >= self.altup_num_inputs {
            return Err(ModelError::Config(format!(
                "altup_active_idx = {} must be below altup_num_inputs = {}",
                self.altup_active_idx, self.altup_num_inputs
            )));
        }
        if c.num_attention_heads % c.kv_heads() != 0 {
            return Err(ModelError::Config(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                c.num_attention_heads,
                c.kv_heads()
            )));
        }
        // transformers' default pattern: every fifth layer global.
        let sliding: Vec<bool> = match c.layer_type_flags("sliding_attention", "full_attention")? {
            Some(s) => s,
            None => (0..n).map(|i| (i + 1) % 5 != 0).collect(),
        };
        if self.sliding_window == 0 {
            return Err(ModelError::Config(
                "sliding_window = 0: must be positive".into(),
            ));
        }
        let windows = sliding
            .iter()
            .map(|&s| s.then_some(self.sliding_window))
            .collect();
        let kv = kv_sources(&sliding, self.num_kv_shared_layers)?;
        let intermediate = self.intermediate_size.expand("intermediate_size", n)?;
        if let Some(bad) = intermediate.iter().find(|&&v| v <= 0) {
            return Err(ModelError::Config(format!(
                "intermediate_size = {bad}: must be positive"
            )));
        }
        let sparsity = match &self.activation_sparsity_pattern {
            Some(p) => p.expand("activation_sparsity_pattern", n)?,
            None => {
                let sparse = if n > 10 { 10 } else { 0 };
                (0..n)
                    .map(|i| if i < sparse { 0.95 } else { 0.0 })
                    .collect()
            }
        };
        if let Some(bad) = sparsity.iter().find(|&&s| !(0.0..1.0).contains(&s)) {
            return Err(ModelError::Config(format!(
                "activation_sparsity_pattern entry {bad}: must be in [0, 1)"
            )));
        }
        let name = self
            .hidden_activation
            .as_deref()
            .unwrap_or("gelu_pytorch_tanh");
        let act = Activation::from_name(name)
            .ok_or_else(|| ModelError::Unsupported(format!("hidden_activation `{name}`")))?;
        Ok(Plan {
            windows,
            kv,
            intermediate,
            sparsity,
            act,
        })
    }

    fn rope(&self, sliding: bool) -> RopeConfig {
        let c = &self.common;
        RopeConfig {
            base: if sliding {
                self.rope_local_base_freq
            } else {
                self.rope_theta
            },
            head_dim: c.head_dim(),
            dims: c.head_dim(),
            traditional: false,
            // Scaling applies to full-attention layers (transformers' `rope_scaling` updates
            // `rope_parameters.full_attention` only).
            scaling: if sliding {
                None
            } else {
                c.rope_scaling.clone()
            },
            max_position_embeddings: c.max_position_embeddings,
        }
    }

    fn schedule(&self) -> Result<Vec<LayerKind>> {
        let plan = self.plan()?;
        let (kv_heads, head_dim) = (self.common.kv_heads(), self.common.head_dim());
        Ok(plan
            .windows
            .iter()
            .zip(&plan.kv)
            .map(|(window, kv)| match (kv, window) {
                (KvSource::Shared(source), _) => LayerKind::Shared { source: *source },
                (KvSource::Own, Some(w)) => LayerKind::SlidingAttention {
                    window: *w,
                    kv_heads,
                    head_dim,
                },
                (KvSource::Own, None) => LayerKind::GlobalAttention { kv_heads, head_dim },
            })
            .collect())
    }
}

/// transformers' `kv_sharing_modes`: the last `shared` layers read the keys and values of the
/// last earlier layer of their own kind (`sliding[i]`); every kind that shares must have one.
fn kv_sources(sliding: &[bool], shared: usize) -> Result<Vec<KvSource>> {
    let n = sliding.len();
    if shared > n {
        return Err(ModelError::Config(format!(
            "num_kv_shared_layers = {shared}: more than the {n} layers"
        )));
    }
    let first_shared = n - shared;
    (0..n)
        .map(|i| {
            if i < first_shared {
                return Ok(KvSource::Own);
            }
            (0..first_shared)
                .rev()
                .find(|&j| sliding[j] == sliding[i])
                .map(KvSource::Shared)
                .ok_or_else(|| {
                    ModelError::Config(format!(
                        "num_kv_shared_layers = {shared}: layer {i} ({}) shares keys and values, but no earlier layer of its kind computes them",
                        if sliding[i] { "sliding_attention" } else { "full_attention" }
                    ))
                })
        })
        .collect()
}

/// Φ⁻¹(p), the standard normal quantile (Acklam's rational approximation, relative error below
/// 1.2e-9: far below the float32 the cutoff is used in), for `0 < p < 1`.
pub fn normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969683028665376e1,
        2.209460984245205e2,
        -2.759285104469687e2,
        1.38357751867269e2,
        -3.066479806614716e1,
        2.506628277459239,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e1,
        1.615858368580409e2,
        -1.556989798598866e2,
        6.680131188771972e1,
        -1.328068155288572e1,
    ];
    const C: [f64; 6] = [
        -7.784894002430293e-3,
        -3.223964580411365e-1,
        -2.400758277161838,
        -2.549732539343734,
        4.374664141464968,
        2.938163982698783,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-3,
        3.224671290700398e-1,
        2.445134137142996,
        3.754408661907416,
    ];
    const LOW: f64 = 0.02425;
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < LOW {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - LOW {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

/// The per-layer embedding table (`embed_tokens_per_layer`, `[vocab_size_per_layer_input,
/// num_hidden_layers × hidden_size_per_layer_input]`): resident, or on disk.
///
/// The model asks it for the **raw** rows of one forward pass — ids already mapped into the
/// table (ids at or past `vocab_size_per_layer_input` become 0), no `sqrt(hidden_size_per_layer_input)`
/// scale, in the compute dtype — through [`PerLayerTable::rows`], given the ids both as the MLX
/// array the pass computes with and, when they are on the host (prompts; not a token sampled on
/// the device and fed straight back), as `&[u32]`. [`PerLayerTable::prefetch`] is the hook for
/// reading ahead: chunked prefill hands the next chunk's ids to it (through
/// [`LanguageModel::prefetch`], or directly through [`Model::per_layer_table`]) before
/// evaluating the current chunk, so a table on disk reads them while the current chunk
/// computes; a resident table (dense or quantized, as the checkpoint stores it) has nothing to
/// do there. The table is built in one place, [`PerLayerTable::load`].
#[derive(Debug)]
pub enum PerLayerTable {
    /// The table as a model parameter: an embedding lookup (dense or affine-quantized rows
    /// dequantized to the compute dtype).
    Resident(Embedding),
    /// The table on disk (`ple_storage` in `config.json`, see `mlxcel_stream::ple`): rows read
    /// per pass through an LRU row cache, gathered ahead during chunked prefill.
    External {
        /// The rows' store (shared with the loader, which reads its counters).
        store: std::rc::Rc<mlxcel_stream::ple::PleStore>,
        /// The compute dtype rows are returned in.
        dtype: Dtype,
    },
}

impl PerLayerTable {
    /// The table on disk when `config.json` declares one (its rows and width checked against
    /// the model's), else the resident `model.embed_tokens_per_layer` (under `w`'s open scope,
    /// which is the `model` scope) of `vocab` rows of `width` values.
    pub fn load(w: &mut ModelWeights, vocab: i32, width: i32) -> Result<PerLayerTable> {
        if let Some(store) = w.external_ple() {
            let layout = store.layout();
            if (layout.row_count, layout.row_width) != (vocab as u64, width as usize) {
                return Err(ModelError::Config(format!(
                    "{}: manifest fields `row_count` × `row_width` are {} × {}, the model's per-layer table is vocab_size_per_layer_input × num_hidden_layers·hidden_size_per_layer_input = {vocab} × {width}",
                    layout.manifest_path.display(),
                    layout.row_count,
                    layout.row_width
                )));
            }
            return Ok(PerLayerTable::External {
                store,
                dtype: w.dtype(),
            });
        }
        Ok(PerLayerTable::Resident(w.embedding(
            "embed_tokens_per_layer",
            vocab,
            width,
        )?))
    }

    /// Raw rows for `ids` (any shape of int32 ids inside the table) → `[..ids, width]` in the
    /// compute dtype. `host_ids` are the same ids on the host when they are there (a table on
    /// disk otherwise reads them from `ids`).
    pub fn rows(&self, ids: &Array, host_ids: Option<&[u32]>) -> Result<Array> {
        match self {
            PerLayerTable::Resident(table) => table.forward(ids),
            PerLayerTable::External { store, dtype } => {
                let fetched;
                let host = match host_ids {
                    Some(h) => h,
                    None => {
                        fetched = ids
                            .astype(Dtype::Int32)?
                            .to_vec::<i32>()?
                            .into_iter()
                            .map(|v| v as u32)
                            .collect::<Vec<u32>>();
                        &fetched
                    }
                };
                let rows = store.rows(host, *dtype)?;
                let mut shape = ids.shape();
                shape.push(rows.dim(-1)?);
                Ok(rows.reshape(&shape)?)
            }
        }
    }

    /// A hint that a later pass will read `next_ids` (mapped into the table): a table on disk
    /// starts reading the rows it does not hold; a resident table has nothing to read.
    pub fn prefetch(&self, next_ids: &[u32]) -> Result<()> {
        match self {
            PerLayerTable::Resident(_) => Ok(()),
            PerLayerTable::External { store, .. } => Ok(store.prefetch(next_ids)?),
        }
    }
}

/// AltUp's per-layer predict/correct parameters (`altup.*`).
#[derive(Debug)]
struct AltUp {
    router_norm: Norm,
    modality_router: Linear,
    prediction_coefs: Linear,
    correction_coefs: Linear,
    /// `correct_output_scale` `[hidden]`, when `altup_correct_scale`.
    correct_output_scale: Option<Array>,
    inputs: i32,
    active: i32,
    /// `1 / hidden` (transformers' `router_input_scale`).
    router_scale: f64,
}

impl AltUp {
    /// `tanh(modality_router(router_norm(x) / hidden))` `[B, L, N]`.
    fn modalities(&self, x: &Array) -> Result<Array> {
        let routed = self
            .modality_router
            .forward(&self.router_norm.forward(x)?.mul_scalar(self.router_scale)?)?;
        Ok(routed.tanh()?)
    }

    fn copy(&self, stream: &Array, i: i32) -> Result<Array> {
        Ok(stream.slice_axis(0, i, i + 1)?.squeeze(&[0])?)
    }

    /// `stream` `[N, B, L, D]` → the predictions: `stream[j] + Σ_i coef[j, i] · stream[i]`, the
    /// coefficients from the router over the active copy.
    fn predict(&self, stream: &Array) -> Result<Array> {
        let n = self.inputs;
        let modalities = self.modalities(&self.copy(stream, self.active)?)?;
        let s = modalities.shape();
        let (b, l) = (s[0], s[1]);
        // [B, L, N(j), N(i)] → [B, L, N(i), N(j)]
        let coefs = self
            .prediction_coefs
            .forward(&modalities)?
            .reshape(&[b, l, n, n])?
            .transpose(&[0, 1, 3, 2])?;
        let mixed = stream
            .transpose(&[1, 2, 3, 0])?
            .matmul(&coefs)?
            .transpose(&[3, 0, 1, 2])?;
        Ok(mixed.add(stream)?)
    }

    /// The predictions corrected by the block's output `activated` `[B, L, D]`: each copy moves
    /// along the innovation `activated - predictions[active]` by `1 + coef`.
    fn correct(&self, predictions: &Array, activated: &Array) -> Result<Array> {
        let modalities = self.modalities(activated)?;
        let innovation = activated.subtract(&self.copy(predictions, self.active)?)?;
        // [B, L, N] → [N, B, L, 1]
        let coefs = self
            .correction_coefs
            .forward(&modalities)?
            .add_scalar(1.0)?
            .transpose(&[2, 0, 1])?
            .expand_dims(&[-1])?;
        Ok(innovation
            .expand_dims(&[0])?
            .multiply(&coefs)?
            .add(predictions)?)
    }
}

/// Attention of one layer (`self_attn.*`): queries always, keys and values only when the layer
/// computes its own.
#[derive(Debug)]
struct SelfAttention {
    q: Linear,
    q_norm: Norm,
    /// `k_proj`, `v_proj`, `k_norm`; `None` on a KV-shared layer (it has none).
    kv: Option<(Linear, Linear, Norm)>,
    o: Linear,
    rope: RotaryEmbedding,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    window: Option<usize>,
    eps: f32,
}

/// The keys, values and mask one layer attended over in the current pass, kept for the layers
/// that share them.
type SharedKv = (Array, Array, Mask);

impl SelfAttention {
    /// `x` `[B, L, D]` (normed) → the attention output `[B, L, D]` (before `o_proj`'s norm).
    /// `shared` holds the keys and values earlier layers attended over in this pass; a layer
    /// that computes its own records them at its index.
    fn forward(
        &self,
        x: &Array,
        cache: &mut LayerCache,
        positions: Option<&Array>,
        layer: usize,
        source: KvSource,
        shared: &mut [Option<SharedKv>],
    ) -> Result<Array> {
        let s = x.shape();
        let (b, l) = (s[0], s[1]);
        let d = self.head_dim;
        let offset = cache.offset();
        let heads = |t: Array, n: i32| -> Result<Array> {
            Ok(t.reshape(&[b, l, n, d])?.transpose(&[0, 2, 1, 3])?)
        };
        let q = heads(self.q.forward(x)?, self.heads)?;
        let q = self
            .rope
            .rotate(&self.q_norm.forward(&q)?, positions, offset)?;
        let (keys, values, mask) = match (source, &self.kv) {
            (KvSource::Own, Some((k_proj, v_proj, k_norm))) => {
                let k = heads(k_proj.forward(x)?, self.kv_heads)?;
                let k = self.rope.rotate(&k_norm.forward(&k)?, positions, offset)?;
                let v = heads(v_proj.forward(x)?, self.kv_heads)?.rms_norm(None, self.eps)?;
                let (keys, values, mask) = cache.update(&k, &v, self.window)?;
                shared[layer] = Some((keys.clone(), values.clone(), mask.clone()));
                (keys, values, mask)
            }
            (KvSource::Shared(from), None) => {
                if !matches!(cache, LayerCache::Shared { .. }) {
                    return Err(ModelError::Runtime(format!(
                        "layer {layer} shares layer {from}'s keys and values but was given a cache of its own (caches must come from the model's make_caches)"
                    )));
                }
                let Some(kv) = shared[from].clone() else {
                    return Err(ModelError::Runtime(format!(
                        "internal: layer {layer} reads layer {from}'s keys and values before that layer ran"
                    )));
                };
                cache.follow(l as usize);
                kv
            }
            _ => {
                return Err(ModelError::Runtime(format!(
                    "internal: layer {layer}'s projections disagree with its KV source"
                )))
            }
        };
        let m = match &mask {
            Mask::None => AttentionMask::None,
            Mask::Causal => AttentionMask::Causal,
            Mask::Array(a) | Mask::Additive(a) => AttentionMask::Array(a),
        };
        let out = ops::scaled_dot_product_attention(&q, &keys, &values, 1.0, m, None)?;
        let out = out
            .transpose(&[0, 2, 1, 3])?
            .reshape(&[b, l, self.heads * d])?;
        self.o.forward(&out)
    }
}

/// The gated MLP with optional activation sparsity (`mlp.*`).
#[derive(Debug)]
struct SparseMlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    act: Activation,
    /// `Φ⁻¹(sparsity)` in float32 (as transformers computes it), when the layer is sparse.
    std_multiplier: Option<f32>,
}

impl SparseMlp {
    fn forward(&self, x: &Array) -> Result<Array> {
        let mut gate = self.gate.forward(x)?;
        if let Some(k) = self.std_multiplier {
            // Keep what lies above mean + k·std (population std) of each row, shifted down.
            let mean = gate.mean(&[-1], true)?;
            let centred = gate.subtract(&mean)?;
            let std = centred.square()?.mean(&[-1], true)?.sqrt()?;
            let cutoff = mean.add(&std.mul_scalar(k as f64)?)?;
            let shifted = gate.subtract(&cutoff)?;
            gate = shifted.maximum(&shifted.scalar_like(0.0)?)?;
        }
        let up = self.up.forward(x)?;
        self.down.forward(&self.act.gated(&gate, &up)?)
    }
}

/// One decoder layer (`model.layers.{i}.*`).
#[derive(Debug)]
struct Layer {
    altup: AltUp,
    input_layernorm: Norm,
    laurel_left: Linear,
    laurel_right: Linear,
    post_laurel_norm: Norm,
    attn: SelfAttention,
    kv: KvSource,
    post_attention_layernorm: Norm,
    pre_feedforward_layernorm: Norm,
    mlp: SparseMlp,
    post_feedforward_layernorm: Norm,
    per_layer_input_gate: Linear,
    per_layer_projection: Linear,
    post_per_layer_input_norm: Norm,
    act: Activation,
}

impl Layer {
    /// `stream` `[N, B, L, D]` and this layer's per-layer input `[B, L, P]` → the next stream.
    fn forward(
        &self,
        stream: &Array,
        per_layer_input: &Array,
        cache: &mut LayerCache,
        positions: Option<&Array>,
        index: usize,
        shared: &mut [Option<SharedKv>],
    ) -> Result<Array> {
        let predictions = self.altup.predict(stream)?;
        let active = self.altup.copy(&predictions, self.altup.active)?;
        let normed = self.input_layernorm.forward(&active)?;
        let laurel = self.post_laurel_norm.forward(
            &self
                .laurel_right
                .forward(&self.laurel_left.forward(&normed)?)?,
        )?;
        let laurel = normed.add(&laurel)?;
        let attn = self
            .attn
            .forward(&normed, cache, positions, index, self.kv, shared)?;
        let attn = active.add(&self.post_attention_layernorm.forward(&attn)?)?;
        let attn_laurel = attn
            .add(&laurel)?
            .mul_scalar(std::f64::consts::FRAC_1_SQRT_2)?;
        let ffw = self
            .mlp
            .forward(&self.pre_feedforward_layernorm.forward(&attn_laurel)?)?;
        let block = attn_laurel.add(&self.post_feedforward_layernorm.forward(&ffw)?)?;
        let corrected = self.altup.correct(&predictions, &block)?;
        let mut first = self.altup.copy(&corrected, self.altup.active)?;
        if let Some(scale) = &self.altup.correct_output_scale {
            first = first.multiply(scale)?;
        }
        let gated = self
            .act
            .apply(&self.per_layer_input_gate.forward(&first)?)?
            .multiply(per_layer_input)?;
        let extra = self
            .post_per_layer_input_norm
            .forward(&self.per_layer_projection.forward(&gated)?)?;
        // transformers adds it to every copy but the first (`corrected[1:]`), whichever is active.
        let n = self.altup.inputs;
        let rest = corrected
            .slice_axis(0, 1, n)?
            .add(&extra.expand_dims(&[0])?)?;
        Ok(ops::concatenate(
            &[corrected.slice_axis(0, 0, 1)?, rest],
            0,
        )?)
    }
}

/// The Gemma 3n text decoder.
#[derive(Debug)]
pub struct Model {
    embed: Embedding,
    per_layer_table: PerLayerTable,
    per_layer_model_projection: Linear,
    per_layer_projection_norm: Norm,
    altup_projections: Vec<Linear>,
    altup_unembed_projections: Vec<Linear>,
    layers: Vec<Layer>,
    norm: Norm,
    lm_head: Option<Linear>,
    hidden: i32,
    per_layer_width: i32,
    vocab: usize,
    vocab_per_layer: i32,
    final_softcap: Option<f64>,
    schedule: Vec<LayerKind>,
}

/// `x` rescaled to the RMS magnitude `target` `[.., 1]` (magnitude floored at `sqrt(1e-5)`, as
/// transformers clamps the mean square).
fn match_magnitude(x: &Array, target: &Array) -> Result<Array> {
    let ms = x.square()?.mean(&[-1], true)?;
    let mag = ms.maximum(&ms.scalar_like(1e-5)?)?.sqrt()?;
    Ok(x.multiply(target)?.divide(&mag)?)
}

fn rms_magnitude(x: &Array) -> Result<Array> {
    Ok(x.square()?.mean(&[-1], true)?.sqrt()?)
}

impl Model {
    /// The per-layer embedding table (see [`PerLayerTable`]).
    pub fn per_layer_table(&self) -> &PerLayerTable {
        &self.per_layer_table
    }

    /// The per-layer inputs of `tokens` `[B, L]` (int32, checked against the vocabulary): the
    /// table's rows scaled by `sqrt(hidden_size_per_layer_input)`, `[B, L, layers · P]`.
    fn per_layer_rows(&self, tokens: &Array) -> Result<Array> {
        // Ids on the host (a prompt) are mapped there, so the table also gets them as a slice;
        // a token still being sampled on the device is mapped on the device.
        let into_table = |t: u32| {
            if t < self.vocab_per_layer as u32 {
                t
            } else {
                0
            }
        };
        let (ids, host) = if tokens.is_available() {
            let host: Vec<u32> = tokens
                .astype(Dtype::Int32)?
                .to_vec::<i32>()?
                .into_iter()
                .map(|t| into_table(t as u32))
                .collect();
            let mapped: Vec<i32> = host.iter().map(|&t| t as i32).collect();
            let ids = Array::from_slice(&mapped, &tokens.shape())?;
            (ids, Some(host))
        } else {
            let tokens = tokens.astype(Dtype::Int32)?;
            let limit = tokens.scalar_like(self.vocab_per_layer as f64)?;
            let ids = ops::where_(&tokens.less(&limit)?, &tokens, &tokens.scalar_like(0.0)?)?;
            (ids, None)
        };
        let rows = self.per_layer_table.rows(&ids, host.as_deref())?;
        Ok(rows.mul_scalar((self.per_layer_width as f64).sqrt())?)
    }

    /// The per-layer inputs `[B, L, layers, P]` of input embeddings `h` `[B, L, D]`, with the
    /// table's rows of the same positions when the ids are known (transformers uses the
    /// projection alone when given only embeddings).
    fn per_layer_inputs(&self, h: &Array, rows: Option<&Array>) -> Result<Array> {
        let s = h.shape();
        let (b, l) = (s[0], s[1]);
        let layers = self.layers.len() as i32;
        let proj = self
            .per_layer_model_projection
            .forward(h)?
            .mul_scalar(1.0 / (self.hidden as f64).sqrt())?
            .reshape(&[b, l, layers, self.per_layer_width])?;
        let proj = self.per_layer_projection_norm.forward(&proj)?;
        Ok(match rows {
            Some(r) => proj
                .add(&r.reshape(&[b, l, layers, self.per_layer_width])?)?
                .mul_scalar(std::f64::consts::FRAC_1_SQRT_2)?,
            None => proj,
        })
    }

    /// Input embeddings → logits, with the per-layer rows when the ids are known.
    fn run(
        &self,
        h0: &Array,
        rows: Option<&Array>,
        positions: Option<&Array>,
        caches: &mut [LayerCache],
        last_only: bool,
    ) -> Result<Array> {
        if caches.len() != self.layers.len() {
            return Err(ModelError::Runtime(format!(
                "{} caches for {} layers",
                caches.len(),
                self.layers.len()
            )));
        }
        let per_layer = self.per_layer_inputs(h0, rows)?;
        let target = rms_magnitude(h0)?;
        let mut copies = vec![h0.clone()];
        for proj in &self.altup_projections {
            copies.push(match_magnitude(&proj.forward(h0)?, &target)?);
        }
        let mut stream = ops::stack(&copies, 0)?;
        let mut shared: Vec<Option<SharedKv>> = vec![None; self.layers.len()];
        for (i, (layer, cache)) in self.layers.iter().zip(caches.iter_mut()).enumerate() {
            let input = per_layer
                .slice_axis(2, i as i32, i as i32 + 1)?
                .squeeze(&[2])?;
            stream = layer.forward(&stream, &input, cache, positions, i, &mut shared)?;
        }
        if last_only {
            let l = stream.dim(2)?;
            stream = stream.slice_axis(2, l - 1, l)?;
        }
        let first = stream.slice_axis(0, 0, 1)?.squeeze(&[0])?;
        let target = rms_magnitude(&first)?;
        let mut copies = vec![first];
        for (i, proj) in self.altup_unembed_projections.iter().enumerate() {
            let copy = stream
                .slice_axis(0, i as i32 + 1, i as i32 + 2)?
                .squeeze(&[0])?;
            copies.push(match_magnitude(&proj.forward(&copy)?, &target)?);
        }
        let h = ops::stack(&copies, 0)?.mean(&[0], false)?;
        let h = self.norm.forward(&h)?;
        let logits = match &self.lm_head {
            Some(head) => head.forward(&h)?,
            None => self.embed.as_linear(&h)?,
        };
        Ok(match self.final_softcap {
            Some(cap) => logits.mul_scalar(1.0 / cap)?.tanh()?.mul_scalar(cap)?,
            None => logits,
        })
    }

    fn forward_tokens(
        &self,
        tokens: &Array,
        caches: &mut [LayerCache],
        last_only: bool,
    ) -> Result<Array> {
        let h0 = self.embed(tokens)?;
        let rows = self.per_layer_rows(tokens)?;
        self.run(&h0, Some(&rows), None, caches, last_only)
    }
}

impl LanguageModel for Model {
    /// `embed_tokens` scaled by `sqrt(hidden)`.
    fn embed(&self, tokens: &Array) -> Result<Array> {
        check_token_ids(tokens, self.vocab)?;
        Ok(self
            .embed
            .forward(tokens)?
            .mul_scalar((self.hidden as f64).sqrt())?)
    }

    /// Input embeddings without their ids: the per-layer inputs are the projection of the
    /// embeddings alone, as transformers computes them from `inputs_embeds`.
    fn forward_embeddings(
        &self,
        embeddings: &Array,
        positions: Option<&Array>,
        caches: &mut [LayerCache],
        last_only: bool,
    ) -> Result<Array> {
        self.run(embeddings, None, positions, caches, last_only)
    }

    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array> {
        self.forward_tokens(tokens, caches, false)
    }

    fn forward_last(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array> {
        self.forward_tokens(tokens, caches, true)
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// The next chunk's ids, mapped into the per-layer table as a pass maps them.
    fn prefetch(&self, next_tokens: &[u32]) -> Result<()> {
        let limit = self.vocab_per_layer.max(0) as u32;
        let ids: Vec<u32> = next_tokens
            .iter()
            .map(|&t| if t < limit { t } else { 0 })
            .collect();
        self.per_layer_table.prefetch(&ids)
    }

    fn layer_schedule(&self) -> Vec<LayerKind> {
        self.schedule.clone()
    }
}

/// Tensor prefixes of the parts of a `Gemma3nForConditionalGeneration` checkpoint a text-only
/// load leaves out: the vision and audio towers and their embedders (transformers' layout and
/// the older `vision_tower.*` one).
const UNUSED_PREFIXES: &[&str] = &[
    "model.vision_tower.",
    "model.audio_tower.",
    "model.embed_vision.",
    "model.embed_audio.",
    "vision_tower.",
    "audio_tower.",
    "embed_vision.",
    "embed_audio.",
];

/// The names of the tensors a text-only load of a Gemma 3n checkpoint leaves out (vision and
/// audio towers and embedders), sorted.
pub fn unused_tensors(weights: &WeightMap) -> Vec<String> {
    let mut names: Vec<String> = weights
        .names()
        .filter(|n| UNUSED_PREFIXES.iter().any(|p| n.starts_with(p)))
        .map(str::to_string)
        .collect();
    names.sort();
    names
}

impl Architecture for Model {
    type Args = Args;

    /// Brings a full checkpoint's text weights to `model.*` (transformers'
    /// `model.language_model.*`, mlx-vlm's `language_model.model.*`), drops the towers, and
    /// drops the key/value projections hub checkpoints still carry on KV-shared layers (which
    /// transformers ignores too).
    fn sanitize(args: &Args, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let args = &args.text;
        for name in unused_tensors(weights) {
            weights.remove(&name);
        }
        weights.rename_prefix("model.language_model.", "model.")?;
        weights.rename_prefix("language_model.", "")?;
        let plan = args.plan()?;
        for (i, kv) in plan.kv.iter().enumerate() {
            if *kv == KvSource::Own {
                continue;
            }
            let unused: Vec<String> = ["k_proj", "v_proj", "k_norm", "v_norm"]
                .iter()
                .flat_map(|m| {
                    let prefix = format!("model.layers.{i}.self_attn.{m}.");
                    weights
                        .names()
                        .filter(|n| n.starts_with(&prefix))
                        .map(str::to_string)
                        .collect::<Vec<_>>()
                })
                .collect();
            for name in unused {
                weights.remove(&name);
            }
        }
        Ok(())
    }

    fn cache_schedule(args: &Args) -> Result<Vec<LayerKind>> {
        args.text.schedule()
    }

    fn build(args: &Args, w: &mut ModelWeights) -> Result<Self> {
        let args = &args.text;
        let plan = args.plan()?;
        let c = &args.common;
        let (h, n) = (c.hidden_size, args.layers());
        let (heads, kv_heads, hd) = (c.num_attention_heads, c.kv_heads(), c.head_dim());
        let (p, eps) = (args.hidden_size_per_layer_input, c.rms_norm_eps);
        let inputs = args.altup_num_inputs as i32;
        let bias = args.attention_bias;
        let mut m = w.scope("model");
        let embed = m.embedding("embed_tokens", c.vocab_size, h)?;
        let per_layer_table =
            PerLayerTable::load(&mut m, args.vocab_size_per_layer_input, n as i32 * p)?;
        let per_layer_model_projection =
            m.linear("per_layer_model_projection", h, n as i32 * p, false)?;
        let per_layer_projection_norm =
            m.norm("per_layer_projection_norm", NormKind::Rms, p, eps)?;
        let projections = |m: &mut ModelWeights, name: &str| -> Result<Vec<Linear>> {
            let mut s = m.scope(name);
            (1..args.altup_num_inputs)
                .map(|i| s.linear(&(i - 1).to_string(), h, h, false))
                .collect()
        };
        let altup_projections = projections(&mut m, "altup_projections")?;
        let altup_unembed_projections = projections(&mut m, "altup_unembed_projections")?;
        let mut layers = Vec::with_capacity(n);
        {
            let mut ls = m.scope("layers");
            for i in 0..n {
                let mut l = ls.scope(i);
                let altup = {
                    let mut a = l.scope("altup");
                    let correct_output_scale = if args.altup_correct_scale {
                        Some(a.tensor("correct_output_scale", &[h])?)
                    } else {
                        None
                    };
                    AltUp {
                        router_norm: a.norm("router_norm", NormKind::Rms, h, eps)?,
                        modality_router: a.linear("modality_router", h, inputs, false)?,
                        prediction_coefs: a.linear(
                            "prediction_coefs",
                            inputs,
                            inputs * inputs,
                            false,
                        )?,
                        correction_coefs: a.linear("correction_coefs", inputs, inputs, false)?,
                        correct_output_scale,
                        inputs,
                        active: args.altup_active_idx as i32,
                        router_scale: 1.0 / h as f64,
                    }
                };
                let attn = {
                    let mut a = l.scope("self_attn");
                    let kv = match plan.kv[i] {
                        KvSource::Own => Some((
                            a.linear("k_proj", h, kv_heads * hd, bias)?,
                            a.linear("v_proj", h, kv_heads * hd, bias)?,
                            a.norm("k_norm", NormKind::Rms, hd, eps)?,
                        )),
                        KvSource::Shared(_) => None,
                    };
                    let rope = RotaryEmbedding::new(&args.rope(plan.windows[i].is_some()))?;
                    a.keep_all(rope.arrays());
                    SelfAttention {
                        q: a.linear("q_proj", h, heads * hd, bias)?,
                        q_norm: a.norm("q_norm", NormKind::Rms, hd, eps)?,
                        kv,
                        o: a.linear("o_proj", heads * hd, h, bias)?,
                        rope,
                        heads,
                        kv_heads,
                        head_dim: hd,
                        window: plan.windows[i],
                        eps,
                    }
                };
                let mlp = {
                    let mut f = l.scope("mlp");
                    let width = plan.intermediate[i];
                    let sparsity = plan.sparsity[i];
                    SparseMlp {
                        gate: f.linear("gate_proj", h, width, false)?,
                        up: f.linear("up_proj", h, width, false)?,
                        down: f.linear("down_proj", width, h, false)?,
                        act: plan.act,
                        std_multiplier: (sparsity > 0.0).then(|| normal_quantile(sparsity) as f32),
                    }
                };
                let norm = |l: &mut ModelWeights, name: &str| l.norm(name, NormKind::Rms, h, eps);
                layers.push(Layer {
                    input_layernorm: norm(&mut l, "input_layernorm")?,
                    laurel_left: l.linear("laurel.linear_left", h, args.laurel_rank, false)?,
                    laurel_right: l.linear("laurel.linear_right", args.laurel_rank, h, false)?,
                    post_laurel_norm: norm(&mut l, "laurel.post_laurel_norm")?,
                    post_attention_layernorm: norm(&mut l, "post_attention_layernorm")?,
                    pre_feedforward_layernorm: norm(&mut l, "pre_feedforward_layernorm")?,
                    post_feedforward_layernorm: norm(&mut l, "post_feedforward_layernorm")?,
                    per_layer_input_gate: l.linear("per_layer_input_gate", h, p, false)?,
                    per_layer_projection: l.linear("per_layer_projection", p, h, false)?,
                    post_per_layer_input_norm: norm(&mut l, "post_per_layer_input_norm")?,
                    altup,
                    attn,
                    kv: plan.kv[i],
                    mlp,
                    act: plan.act,
                });
            }
        }
        let norm = m.norm("norm", NormKind::Rms, h, eps)?;
        drop(m);
        let tie = c.tie_word_embeddings.unwrap_or(true);
        let lm_head = if tie && !w.contains("lm_head.weight") {
            None
        } else {
            Some(w.linear("lm_head", h, c.vocab_size, false)?)
        };
        Ok(Model {
            embed,
            per_layer_table,
            per_layer_model_projection,
            per_layer_projection_norm,
            altup_projections,
            altup_unembed_projections,
            layers,
            norm,
            lm_head,
            hidden: h,
            per_layer_width: p,
            vocab: c.vocab_size as usize,
            vocab_per_layer: args.vocab_size_per_layer_input,
            final_softcap: args.final_logit_softcapping,
            schedule: args.schedule()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_quantile_matches_known_values() {
        // Φ⁻¹(0.95) = 1.6448536269514722; Φ⁻¹(0.5) = 0; symmetry in the tails.
        assert!((normal_quantile(0.95) - 1.644_853_626_951_472_2).abs() < 1e-8);
        assert!(normal_quantile(0.5).abs() < 1e-12);
        assert!((normal_quantile(0.01) + normal_quantile(0.99)).abs() < 1e-8);
        assert!((normal_quantile(0.01) + 2.326_347_874_040_841).abs() < 1e-7);
    }

    #[test]
    fn kv_sharing_reads_the_last_earlier_layer_of_each_kind() {
        // E2B's pattern: 4 sliding + 1 full, repeated; the last 10 of 30 layers share.
        let sliding: Vec<bool> = (0..30).map(|i| (i + 1) % 5 != 0).collect();
        let kv = kv_sources(&sliding, 10).unwrap();
        assert!(kv[..20].iter().all(|k| *k == KvSource::Own));
        assert_eq!(kv[20], KvSource::Shared(18));
        assert_eq!(kv[24], KvSource::Shared(19));
        assert_eq!(kv[29], KvSource::Shared(19));
        // A kind with no producer before the shared range is refused by name.
        let err = kv_sources(&[true, true, false], 1).unwrap_err().to_string();
        assert!(err.contains("layer 2 (full_attention)"), "{err}");
    }
}
