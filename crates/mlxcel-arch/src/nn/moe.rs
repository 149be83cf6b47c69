//! Mixture-of-experts: routers and the gathered expert MLP. Tokens are routed, their
//! (token, expert) pairs sorted by expert, and each projection runs as one `gather_qmm` /
//! `gather_mm` over the sorted rows — no per-expert loop.

use std::cell::RefCell;
use std::rc::Rc;

use mlxcel_core::{Array, Dtype};

use super::{Activation, Linear, SwitchLinear};
use crate::Result;

/// How router logits become expert weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterScoring {
    /// Softmax over all experts, keep the top-k probabilities (optionally renormalised).
    Softmax,
    /// Sigmoid per expert, keep the top-k (optionally renormalised).
    Sigmoid,
}

/// How a group of experts is scored when routing is limited to the best groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupScore {
    /// The group's best expert score (DeepSeek V2's `group_limited_greedy`).
    Max,
    /// The sum of the group's two best scores (DeepSeek V3).
    TopTwoSum,
}

/// Group-limited routing: experts are split into `groups` equal groups, and only experts of the
/// `keep` best groups can be chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupLimit {
    /// Number of expert groups (`n_group`).
    pub groups: i32,
    /// Groups a token may route to (`topk_group`).
    pub keep: i32,
    /// How a group is scored.
    pub score: GroupScore,
}

/// A mixture-of-experts router: the `gate` projection's logits → each token's `top_k` experts and
/// their weights.
#[derive(Debug, Clone)]
pub struct Router {
    /// The router projection: hidden → experts.
    pub gate: Linear,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: i32,
    /// How logits become expert weights.
    pub scoring: RouterScoring,
    /// Renormalise the kept weights to sum to one (`norm_topk_prob`).
    pub normalize: bool,
    /// Added to the scores when choosing experts, not to the weights (DeepSeek V3's
    /// `e_score_correction_bias`), `[experts]` float32.
    pub correction_bias: Option<Array>,
    /// Group-limited routing (`n_group` / `topk_group`), `None` when all experts compete.
    pub group_limit: Option<GroupLimit>,
    /// Multiplies the final weights (`routed_scaling_factor`).
    pub weight_scale: f32,
}

impl Router {
    /// A router choosing the top `top_k` experts by `scoring`, with no group limit, correction
    /// bias or weight scale.
    pub fn top_k(gate: Linear, top_k: i32, scoring: RouterScoring, normalize: bool) -> Router {
        Router {
            gate,
            top_k,
            scoring,
            normalize,
            correction_bias: None,
            group_limit: None,
            weight_scale: 1.0,
        }
    }

    /// `x` `[T, D]` → (expert ids `[T, k]` uint32, weights `[T, k]` in x's dtype).
    pub fn route(&self, x: &Array) -> Result<(Array, Array)> {
        let logits = self.gate.forward(x)?.astype(Dtype::Float32)?;
        if let Some(routed) = self.route_on_kernel(&logits, x.dtype()?)? {
            return Ok(routed);
        }
        let scores = match self.scoring {
            RouterScoring::Softmax => logits.softmax(&[-1], true)?,
            RouterScoring::Sigmoid => logits.sigmoid()?,
        };
        let mut choice = match &self.correction_bias {
            Some(bias) => scores.add(bias)?,
            None => scores.clone(),
        };
        if let Some(limit) = self.group_limit {
            choice = limit.mask(&choice)?;
        }
        let k = self.top_k;
        let ids = choice
            .negative()?
            .argpartition(k - 1, -1)?
            .slice_axis(-1, 0, k)?;
        let mut weights = mlxcel_core::ops::take_along_rows(&scores, &ids)?;
        if self.normalize {
            // The epsilon transformers adds for sigmoid routers; negligible for softmax ones.
            let sum = weights.sum(&[-1], true)?;
            weights = if self.scoring == RouterScoring::Sigmoid {
                weights.divide(&sum.add_scalar(1e-20)?)?
            } else {
                weights.divide(&sum)?
            };
        }
        if self.weight_scale != 1.0 {
            weights = weights.mul_scalar(self.weight_scale as f64)?;
        }
        Ok((ids.astype(Dtype::Uint32)?, weights.astype(x.dtype()?)?))
    }

    /// [`Router::route`]'s choice from float32 `logits` as one mlxcel CUDA kernel
    /// (`cuda_kernels::route_topk`, `MLXCEL_CUDA_ROUTER`): the same scores, choice and weights
    /// without MLX's sort of every token's scores. `None` where it does not apply (group-limited
    /// routers, more than 16 experts a token, not on a GPU).
    fn route_on_kernel(&self, logits: &Array, dtype: Dtype) -> Result<Option<(Array, Array)>> {
        use mlxcel_core::cuda_kernels::{route_topk, route_topk_applies, RouteSpec};
        if self.group_limit.is_some() || !route_topk_applies(logits, self.top_k)? {
            return Ok(None);
        }
        let spec = RouteSpec {
            top_k: self.top_k,
            sigmoid: self.scoring == RouterScoring::Sigmoid,
            normalize: self.normalize,
            scale: self.weight_scale,
        };
        let bias = match &self.correction_bias {
            Some(b) => Some(b.astype(Dtype::Float32)?.reshape(&[-1])?),
            None => None,
        };
        Ok(Some(route_topk(logits, bias.as_ref(), spec, dtype)?))
    }
}

impl GroupLimit {
    /// `choice` `[T, E]` with the experts outside the `keep` best groups set to -inf.
    fn mask(&self, choice: &Array) -> Result<Array> {
        let shape = choice.shape();
        let (t, e) = (shape[0], shape[1]);
        if self.keep >= self.groups {
            return Ok(choice.clone());
        }
        let grouped = choice.reshape(&[t, self.groups, e / self.groups])?;
        let group_scores = match self.score {
            GroupScore::Max => grouped.max(&[-1], false)?,
            GroupScore::TopTwoSum => {
                let best = grouped
                    .negative()?
                    .argpartition(1, -1)?
                    .slice_axis(-1, 0, 2)?;
                grouped.take_along_axis(&best, -1)?.sum(&[-1], false)?
            }
        };
        // The keep-th best group score; groups scoring at least that stay.
        let order = group_scores.negative()?.argpartition(self.keep - 1, -1)?;
        let threshold =
            group_scores.take_along_axis(&order.slice_axis(-1, self.keep - 1, self.keep)?, -1)?;
        let kept = group_scores
            .greater_equal(&threshold)?
            .reshape(&[t, self.groups, 1])?
            .broadcast_to(&[t, self.groups, e / self.groups])?
            .reshape(&[t, e])?;
        Ok(mlxcel_core::ops::where_(
            &kept,
            choice,
            &choice.scalar_like(f64::NEG_INFINITY)?,
        )?)
    }
}

/// The experts' gated MLP: `down(act(gate(x)) * up(x))` with per-row expert choice.
#[derive(Debug, Clone)]
pub struct SwitchGlu {
    /// `switch_mlp.gate_proj`: `[experts, intermediate, hidden]`; `None` for plain experts
    /// `down(act(up(x)))` (Nemotron-H).
    pub gate: Option<SwitchLinear>,
    /// `switch_mlp.up_proj`: `[experts, intermediate, hidden]`.
    pub up: SwitchLinear,
    /// `switch_mlp.down_proj`: `[experts, hidden, intermediate]`.
    pub down: SwitchLinear,
    /// Applied to the gate.
    pub act: Activation,
    /// Per-expert biases of gate, up and down (`[experts, out]` each; gpt-oss), if any.
    pub biases: Option<Box<[Array; 3]>>,
}

/// `y` `[.., 1, out]` plus the bias row `[out]` of each row's expert (`experts` shaped like
/// `y`'s batch shape), or `y` unchanged without biases.
fn add_expert_bias(y: Array, bias: Option<&Array>, experts: &Array) -> Result<Array> {
    Ok(match bias {
        Some(b) => y.add(&take_rows(b, experts)?.expand_dims(&[-2])?)?,
        None => y,
    })
}

/// `table[ids]` along the first axis for uint32 `ids` below 2^31 (expert ids, row orders),
/// through `ops::take_rows`: on a GPU mlxcel's kernel, which ships compiled, where MLX's `take`
/// JIT-compiles a gather module per dtype on a machine's first MoE prompt. The ids are read as
/// int32 in place (a view, no copy).
fn take_rows(table: &Array, ids: &Array) -> Result<Array> {
    Ok(mlxcel_core::ops::take_rows(
        table,
        &ids.view(Dtype::Int32)?,
    )?)
}

impl SwitchGlu {
    fn bias(&self, index: usize) -> Option<&Array> {
        self.biases.as_ref().map(|b| &b[index])
    }

    /// `x` `[T, D]`, `ids` `[T, k]` → `[T, k, D]`: each token through each of its experts.
    pub fn forward(&self, x: &Array, ids: &Array) -> Result<Array> {
        let shape = ids.shape();
        let (t, k) = (shape[0], shape[1]);
        let d = x.dim(-1)?;
        if t * k < SORT_FROM_PAIRS {
            // Decode-sized: each token's row broadcast over its k experts, no sorting.
            let xs = x.reshape(&[t, 1, 1, d])?;
            // The token row each (token, expert) product of gate and up reads, built once for
            // both (MLX would build it in each: on a GPU every array of a decode step costs host
            // time). mlxcel's CPU kernel reads that layout from the shapes instead.
            let rows = if mlxcel_core::ops::cpu_kernels_active()? {
                None
            } else {
                Some(
                    mlxcel_core::ops::arange(0.0, t as f64, 1.0, Dtype::Uint32)?
                        .reshape(&[t, 1])?
                        .broadcast_to(&[t, k])?,
                )
            };
            let u = self.up.forward_rows(&xs, rows.as_ref(), ids, false)?;
            let u = add_expert_bias(u, self.bias(1), ids)?;
            let h = match &self.gate {
                Some(gate) => {
                    let g = gate.forward_rows(&xs, rows.as_ref(), ids, false)?;
                    self.act
                        .gated(&add_expert_bias(g, self.bias(0), ids)?, &u)?
                }
                None => self.act.apply(&u)?,
            };
            let y = add_expert_bias(self.down.forward(&h, ids, false)?, self.bias(2), ids)?;
            return Ok(y.reshape(&[t, k, d])?);
        }
        let flat = ids.reshape(&[t * k])?;
        // Sort (token, expert) pairs by expert so each expert's rows are contiguous.
        let order = flat.argsort(0)?;
        let inverse = order.argsort(0)?;
        let sorted_ids = take_rows(&flat.reshape(&[t * k, 1])?, &order)?.reshape(&[t * k])?;
        let token_of = order.floor_divide(&order.scalar_like(k as f64)?)?;
        let rows = take_rows(&x.reshape(&[t, d])?, &token_of)?.reshape(&[t * k, 1, d])?;
        let u = self.up.forward(&rows, &sorted_ids, true)?;
        let u = add_expert_bias(u, self.bias(1), &sorted_ids)?;
        let h = match &self.gate {
            Some(gate) => {
                let g = gate.forward(&rows, &sorted_ids, true)?;
                self.act
                    .gated(&add_expert_bias(g, self.bias(0), &sorted_ids)?, &u)?
            }
            None => self.act.apply(&u)?,
        };
        let y = self.down.forward(&h, &sorted_ids, true)?;
        let y = add_expert_bias(y, self.bias(2), &sorted_ids)?;
        Ok(take_rows(&y.reshape(&[t * k, d])?, &inverse)?.reshape(&[t, k, d])?)
    }
}

/// From how many (token, expert) pairs sorting them by expert pays off (prefill); below it
/// (decode) the gathered matmuls take the tokens unsorted, as mlx-lm does.
const SORT_FROM_PAIRS: i32 = 64;

/// Routed experts streamed from disk through a slot arena (see `mlxcel_stream`). Per call the
/// router's choices are read on the host, the distinct experts loaded into slots (in waves when
/// a prefill chunk needs more experts than there are slots: each expert is fetched once per
/// chunk for all rows routed to it), and each projection runs as one gathered matmul with slot
/// indices into the arena.
///
/// During decode a layer also starts reading the next streamed layer's experts (see
/// [`NextStreamed`]), so those reads overlap this layer's experts and the next layer's attention.
pub struct StreamedGlu {
    /// The layer's expert stream: its manifest entry, slot arena and statistics (shared with
    /// the previous streamed layer, which reads ahead into it).
    pub layer: Rc<RefCell<mlxcel_stream::LayerStream>>,
    /// The model's next streamed layer, whose experts this one predicts; set once the model's
    /// layers are built ([`link_streamed_layers`]).
    pub next: Option<NextStreamed>,
    /// Whether decode steps predict and read ahead into `next` (`MLXCEL_EXPERT_PREFETCH` at
    /// load: fixed per model, since the installed policy is process-wide).
    pub reads_ahead: bool,
    /// Per projection (gate, up, down): the quantization, `None` for dense expert weights.
    pub specs: [Option<mlxcel_core::ops::QuantSpec>; 3],
    /// Applied to the gate.
    pub act: Activation,
}

impl std::fmt::Debug for StreamedGlu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamedGlu")
            .field("prefix", &self.layer.borrow().entry().prefix)
            .finish()
    }
}

/// The next streamed MoE layer as the previous one sees it: its router, applied to the previous
/// layer's input, predicts the experts it will choose (the residual stream changes little from
/// one layer to the next, which is what makes cross-layer prediction work for trained MoEs), and
/// its stream reads the missing ones ahead. A wrong guess costs disk time, never a wrong
/// result: the layer still routes by its own router and loads whatever it then lacks.
#[derive(Clone)]
pub struct NextStreamed {
    /// The next streamed layer's router.
    pub router: Router,
    /// Its expert stream.
    pub stream: Rc<RefCell<mlxcel_stream::LayerStream>>,
}

/// Links each streamed layer of `layers` (in model order: a layer's router and its routed
/// experts) to the next streamed one, so decode steps read ahead (see [`NextStreamed`]).
pub fn link_streamed_layers<'a>(
    layers: impl DoubleEndedIterator<Item = (&'a Router, &'a mut RoutedExperts)>,
) {
    let mut next: Option<NextStreamed> = None;
    for (router, experts) in layers.rev() {
        if let RoutedExperts::Streamed(glu) = experts {
            glu.next = next.take();
            next = Some(NextStreamed {
                router: router.clone(),
                stream: Rc::clone(&glu.layer),
            });
        }
    }
}

impl StreamedGlu {
    fn projection(&self, layer: &mlxcel_stream::LayerStream, index: usize) -> Result<SwitchLinear> {
        let name = mlxcel_stream::manifest::PROJECTIONS[index];
        let plane = |p: &str| layer.plane(&format!("{name}.{p}")).cloned();
        let missing = || {
            crate::ModelError::MissingTensor(format!(
                "{}.switch_mlp.{name}.weight",
                layer.entry().prefix
            ))
        };
        let weight = plane("weight").ok_or_else(missing)?;
        Ok(match self.specs[index] {
            None => SwitchLinear::Dense(weight),
            Some(spec) => SwitchLinear::Quantized(mlxcel_quant::QuantizedWeight {
                weight,
                scales: plane("scales").ok_or_else(missing)?,
                biases: plane("biases"),
                spec,
            }),
        })
    }

    /// `x` `[T, D]`, `ids` `[T, k]` → `[T, k, D]`, like [`SwitchGlu::forward`].
    pub fn forward(&self, x: &Array, ids: &Array) -> Result<Array> {
        let shape = ids.shape();
        let (t, k) = (shape[0] as usize, shape[1] as usize);
        let d = x.dim(-1)?;
        // The next streamed layer's choices for the same rows, predicted by its router from
        // this layer's input: decode steps only (a prefill chunk's experts come in waves,
        // pipelined already), and only where they fit that layer's arena.
        let predicted = match &self.next {
            Some(next)
                if self.reads_ahead
                    && next.router.top_k as usize == k
                    && t * k <= next.stream.borrow().capacity() =>
            {
                let p = next.router.route(x)?.0.astype(Dtype::Uint32)?;
                mlxcel_core::ops::async_eval_all([&p])?;
                Some(p)
            }
            _ => None,
        };
        let chosen: Vec<u32> = ids.astype(Dtype::Uint32)?.to_vec::<u32>()?;
        // (token, expert) pairs sorted by expert; the distinct experts in order.
        let mut pairs: Vec<usize> = (0..t * k).collect();
        pairs.sort_by_key(|p| chosen[*p]);
        let mut experts: Vec<usize> = pairs.iter().map(|p| chosen[*p] as usize).collect();
        experts.dedup();
        let mut layer = self.layer.borrow_mut();
        layer.observe(&chosen, k);
        let capacity = layer.capacity();
        let waves: Vec<&[usize]> = experts.chunks(capacity).collect();
        let mut outputs = Vec::with_capacity(waves.len());
        let mut sequence: Vec<usize> = Vec::with_capacity(t * k);
        let mut next = match waves.first() {
            Some(first) => Some(layer.fetch(first)?),
            None => None,
        };
        // This layer's own reads are done: the next layer's start now, and run while this
        // layer's experts and the next layer's attention compute.
        if let (Some(following), Some(p)) = (&self.next, predicted) {
            let guess: Vec<usize> = p.to_vec::<u32>()?.into_iter().map(|e| e as usize).collect();
            following.stream.borrow_mut().prefetch(&guess);
        }
        for (i, wave) in waves.iter().enumerate() {
            let fetched = next.take().expect("fetched before its wave");
            let slots = layer.install(fetched)?;
            let slot_of: std::collections::HashMap<usize, usize> =
                wave.iter().copied().zip(slots).collect();
            let mut rows: Vec<usize> = pairs
                .iter()
                .copied()
                .filter(|p| slot_of.contains_key(&(chosen[*p] as usize)))
                .collect();
            rows.sort_by_key(|p| slot_of[&(chosen[*p] as usize)]);
            let tokens: Vec<i32> = rows.iter().map(|p| (p / k) as i32).collect();
            let slot_ids: Vec<u32> = rows
                .iter()
                .map(|p| slot_of[&(chosen[*p] as usize)] as u32)
                .collect();
            let n = rows.len() as i32;
            let xs = x
                .take(&Array::from_slice(&tokens, &[n])?, 0)?
                .reshape(&[n, 1, d])?;
            let idx = Array::from_slice(&slot_ids, &[n])?;
            let g = self.projection(&layer, 0)?.forward(&xs, &idx, true)?;
            let u = self.projection(&layer, 1)?.forward(&xs, &idx, true)?;
            let h = self.act.gated(&g, &u)?;
            let y = self.projection(&layer, 2)?.forward(&h, &idx, true)?;
            if waves.len() > 1 {
                // Waves are pipelined: this wave computes while the next one's experts are
                // read (into host buffers; the slots they replace are written only after
                // this wave, which reads them, is evaluated).
                mlxcel_core::ops::async_eval_all([&y])?;
                if let Some(following) = waves.get(i + 1) {
                    next = Some(layer.fetch(following)?);
                }
                if let Err(e) = y.eval() {
                    if let Some(pending) = next.take() {
                        layer.abandon(pending);
                    }
                    return Err(e.into());
                }
            }
            outputs.push(y);
            sequence.extend(rows);
        }
        let y = if outputs.len() == 1 {
            outputs.pop().expect("one wave")
        } else {
            mlxcel_core::ops::concatenate(&outputs, 0)?
        };
        let mut position = vec![0i32; t * k];
        for (i, p) in sequence.iter().enumerate() {
            position[*p] = i as i32;
        }
        let back = Array::from_slice(&position, &[(t * k) as i32])?;
        Ok(y.take(&back, 0)?.reshape(&[t as i32, k as i32, d])?)
    }
}

/// A mixture-of-experts layer's routed experts: resident in memory or streamed from disk.
#[derive(Debug)]
pub enum RoutedExperts {
    /// All experts' weights in memory.
    Resident(SwitchGlu),
    /// Experts loaded from the expert-stream folder into slots on demand.
    Streamed(Box<StreamedGlu>),
}

impl RoutedExperts {
    /// Weighted sum over each token's experts: `x` `[T, D]` → `[T, D]`.
    pub fn combine(&self, x: &Array, ids: &Array, weights: &Array) -> Result<Array> {
        let y = match self {
            RoutedExperts::Resident(glu) => glu.forward(x, ids)?,
            RoutedExperts::Streamed(glu) => glu.forward(x, ids)?,
        };
        Ok(y.multiply(&weights.expand_dims(&[-1])?)?.sum(&[1], false)?)
    }

    /// Whether the experts stream from disk.
    pub fn is_streamed(&self) -> bool {
        matches!(self, RoutedExperts::Streamed(_))
    }
}
