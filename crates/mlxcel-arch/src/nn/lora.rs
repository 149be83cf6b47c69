//! Runtime (unfused) LoRA adapters: an adapted linear layer computes
//! `y = x·Wᵀ + Σᵢ cᵢ·(x·Aᵢᵀ)·Bᵢᵀ (+ bias)` over its unchanged (possibly quantized) base, where the
//! sum runs over the adapters of the model's active [`AdapterMix`] and `cᵢ` is the layer's LoRA
//! scale times the adapter's weight in the mix. A DoRA adapter (a magnitude vector `m`) also
//! rescales each output row: `y = m / ‖W + c·B·A‖ ⊙ (x·Wᵀ + c·(x·Aᵀ)·Bᵀ) (+ bias)`, as mlx-lm's
//! `DoRALinear` and PEFT's `use_dora` do; it cannot be blended with other adapters.
//!
//! Several adapters are registered on one model ([`AdapterSet`], shared by every adapted layer);
//! selecting another mix ([`AdapterSet::select`]) costs no reload: each layer rebuilds its
//! combined low-rank pair the first time it runs under the new mix (the `A`s stacked along the
//! rank, the `B`s scaled by `cᵢ`), so any blend is two thin products per layer. With no adapter
//! active (or every weight 0) an adapted layer runs exactly its base layer: one version check.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::rc::Rc;

use mlxcel_core::{ops, Array};

use super::Linear;
use crate::{ModelError, Result};

/// Which registered adapters a request runs with: `(name, weight)` pairs, each adding
/// `weight × scale` times its low-rank term (the adapter's own scale: mlx-lm's `scale`, PEFT's
/// `lora_alpha / r` or its per-module pattern). Empty: the base model. Weight 1 is the adapter
/// as trained; 0 turns it off.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AdapterMix {
    /// `(adapter name, weight)`, in any order; a name may appear once.
    pub entries: Vec<(String, f32)>,
}

impl AdapterMix {
    /// The base model, no adapter.
    pub fn none() -> AdapterMix {
        AdapterMix::default()
    }

    /// One adapter at weight 1 (its trained scale).
    pub fn single(name: impl Into<String>) -> AdapterMix {
        AdapterMix::weighted(name, 1.0)
    }

    /// One adapter with its scale multiplied by `weight`.
    pub fn weighted(name: impl Into<String>, weight: f32) -> AdapterMix {
        AdapterMix {
            entries: vec![(name.into(), weight)],
        }
    }

    /// Several adapters blended: each adds `weight × scale` times its term.
    pub fn blend<S: Into<String>>(entries: impl IntoIterator<Item = (S, f32)>) -> AdapterMix {
        AdapterMix {
            entries: entries.into_iter().map(|(n, w)| (n.into(), w)).collect(),
        }
    }

    /// Whether no adapter contributes (empty, or every weight 0).
    pub fn is_base(&self) -> bool {
        self.entries.iter().all(|(_, w)| *w == 0.0)
    }
}

impl std::fmt::Display for AdapterMix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.entries.is_empty() {
            return f.write_str("base");
        }
        let parts: Vec<String> = self
            .entries
            .iter()
            .map(|(n, w)| {
                if *w == 1.0 {
                    n.clone()
                } else {
                    format!("{n}×{w}")
                }
            })
            .collect();
        f.write_str(&parts.join(" + "))
    }
}

/// The runtime adapters registered on one model and the mix its adapted layers run with.
#[derive(Debug)]
pub struct AdapterSet {
    names: Vec<String>,
    /// Which adapters are DoRA (a magnitude rescaling; never blended).
    dora: Vec<bool>,
    /// `(adapter index, weight)` of the adapters that contribute.
    active: RefCell<Vec<(usize, f64)>>,
    mix: RefCell<AdapterMix>,
    /// Bumped by every selection; layers rebuild their combined pair when it moved.
    version: Cell<u64>,
}

impl AdapterSet {
    /// Adapters `(name, is DoRA)`, indexed in this order by [`RuntimeAdapters::modules`];
    /// none active. Names must be distinct.
    pub fn new(adapters: Vec<(String, bool)>) -> Result<Rc<AdapterSet>> {
        let mut names = Vec::with_capacity(adapters.len());
        let mut dora = Vec::with_capacity(adapters.len());
        for (name, is_dora) in adapters {
            if names.contains(&name) {
                return Err(ModelError::Runtime(format!(
                    "two runtime adapters are named `{name}`"
                )));
            }
            names.push(name);
            dora.push(is_dora);
        }
        Ok(Rc::new(AdapterSet {
            names,
            dora,
            active: RefCell::new(Vec::new()),
            mix: RefCell::new(AdapterMix::none()),
            version: Cell::new(0),
        }))
    }

    /// The registered adapters' names.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The mix the layers run with now.
    pub fn current(&self) -> AdapterMix {
        self.mix.borrow().clone()
    }

    /// Makes `mix` the one the adapted layers run with (from their next forward pass). An
    /// unknown or repeated name or a non-finite weight is an error and changes nothing.
    pub fn select(&self, mix: &AdapterMix) -> Result<()> {
        if *self.mix.borrow() == *mix {
            return Ok(());
        }
        let mut active = Vec::with_capacity(mix.entries.len());
        for (name, weight) in &mix.entries {
            let Some(index) = self.names.iter().position(|n| n == name) else {
                return Err(ModelError::Runtime(format!(
                    "no runtime adapter named `{name}` (loaded: {})",
                    if self.names.is_empty() {
                        "none".to_string()
                    } else {
                        self.names.join(", ")
                    }
                )));
            };
            if !weight.is_finite() {
                return Err(ModelError::Runtime(format!(
                    "adapter `{name}`: weight {weight} is not finite"
                )));
            }
            if active.iter().any(|(i, _)| *i == index) {
                return Err(ModelError::Runtime(format!(
                    "adapter `{name}` appears twice in the mix"
                )));
            }
            if *weight != 0.0 {
                active.push((index, *weight as f64));
            }
        }
        if active.len() > 1 {
            if let Some(&(i, _)) = active.iter().find(|(i, _)| self.dora[*i]) {
                return Err(ModelError::Runtime(format!(
                    "adapter `{}` is DoRA: it rescales the layers' outputs and cannot be blended with other adapters",
                    self.names[i]
                )));
            }
        }
        *self.active.borrow_mut() = active;
        *self.mix.borrow_mut() = mix.clone();
        self.version.set(self.version.get() + 1);
        Ok(())
    }
}

/// One adapter's low-rank pair for one linear layer, in the compute dtype.
#[derive(Debug, Clone)]
pub struct LoraPair {
    /// `A` `[r, in]` (PEFT's `lora_A`; mlx-lm's `lora_a` transposed).
    pub a: Array,
    /// `B` `[out, r]` (PEFT's `lora_B`; mlx-lm's `lora_b` transposed).
    pub b: Array,
    /// This layer's LoRA scale (weight 1 adds `scale·(x·Aᵀ)·Bᵀ`).
    pub scale: f64,
    /// DoRA's magnitude `[out]`, in float32.
    pub magnitude: Option<Array>,
    /// Where it came from, for errors (the adapter file and tensor names).
    pub origin: String,
}

/// The runtime adapters a model is built with: the shared set and, per adapted linear layer
/// (by checkpoint module name, e.g. `model.layers.0.self_attn.q_proj`), one optional pair per
/// adapter of the set, in the set's order.
#[derive(Clone)]
pub struct RuntimeAdapters {
    /// The registered adapters and their active mix.
    pub set: Rc<AdapterSet>,
    /// Module name → the pair of each adapter (`None` where that adapter leaves it alone).
    pub modules: BTreeMap<String, Vec<Option<LoraPair>>>,
}

impl std::fmt::Debug for RuntimeAdapters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeAdapters")
            .field("adapters", &self.set.names)
            .field("modules", &self.modules.len())
            .finish()
    }
}

/// The combined low-rank pair of one layer under one mix.
#[derive(Debug)]
struct Combined {
    /// `Aᵀ` `[in, Σr]`: the active adapters' `A`s stacked along the rank, transposed for a
    /// plain product (expert stacks: `[E, in, Σr]`, the layout `gather_mm` takes).
    a: Array,
    /// `Bᵀ` `[Σr, out]`: their `B`s side by side, each times its coefficient, transposed
    /// (expert stacks: `[E, Σr, out]`).
    b: Array,
    /// DoRA: `m / ‖W + c·B·A‖` per output row, in the compute dtype.
    rescale: Option<Array>,
}

/// The low-rank terms of one adapted linear layer.
#[derive(Debug, Clone)]
pub struct LoraLayer {
    set: Rc<AdapterSet>,
    pairs: Vec<Option<LoraPair>>,
    /// The set's version this was built for, and the pair (`None`: nothing active here).
    combined: RefCell<Option<(u64, Option<Rc<Combined>>)>>,
}

impl LoraLayer {
    /// The terms `pairs` (one per adapter of `set`) of one layer.
    pub fn new(set: Rc<AdapterSet>, pairs: Vec<Option<LoraPair>>) -> LoraLayer {
        LoraLayer {
            set,
            pairs,
            combined: RefCell::new(None),
        }
    }

    /// Where the first DoRA pair (one with a magnitude) came from, if any.
    pub fn dora_origin(&self) -> Option<&str> {
        self.pairs
            .iter()
            .flatten()
            .find(|p| p.magnitude.is_some())
            .map(|p| p.origin.as_str())
    }

    /// The arrays it holds.
    pub fn arrays(&self) -> Vec<&Array> {
        self.pairs
            .iter()
            .flatten()
            .flat_map(|p| [Some(&p.a), Some(&p.b), p.magnitude.as_ref()])
            .flatten()
            .collect()
    }

    /// The combined pair under the set's current mix, `None` when no active adapter touches
    /// this layer. `base_weight` gives the layer's own weight in float32 (read for DoRA's norm).
    fn combined(&self, base_weight: &dyn Fn() -> Result<Array>) -> Result<Option<Rc<Combined>>> {
        let version = self.set.version.get();
        if let Some((v, c)) = &*self.combined.borrow() {
            if *v == version {
                return Ok(c.clone());
            }
        }
        let active: Vec<(&LoraPair, f64)> = self
            .set
            .active
            .borrow()
            .iter()
            .filter_map(|&(i, w)| self.pairs[i].as_ref().map(|p| (p, w * p.scale)))
            .collect();
        let combined = if active.is_empty() {
            None
        } else {
            let scaled = active
                .iter()
                .map(|(p, c)| p.b.mul_scalar(*c))
                .collect::<mlxcel_core::Result<Vec<_>>>()?;
            // Along the rank axis: -2 of `A` `[.., r, in]`, -1 of `B` `[.., out, r]`.
            let (a, b) = if active.len() == 1 {
                (active[0].0.a.clone(), scaled[0].contiguous()?)
            } else {
                let a: Vec<Array> = active.iter().map(|(p, _)| p.a.clone()).collect();
                (ops::concatenate(&a, -2)?, ops::concatenate(&scaled, -1)?)
            };
            let rescale = match (active.len(), &active[0].0.magnitude) {
                (1, Some(m)) => {
                    // ‖W + c·B·A‖ per output row, in float32 (a quantized base dequantized).
                    let dtype = a.dtype()?;
                    let f32 = mlxcel_core::Dtype::Float32;
                    let adapted = base_weight()?.add(&b.astype(f32)?.matmul(&a.astype(f32)?)?)?;
                    let norm = adapted.square()?.sum(&[1], false)?.sqrt()?;
                    let r = m.divide(&norm)?.astype(dtype)?;
                    r.eval()?;
                    Some(r)
                }
                _ => None,
            };
            // Transposed once here: the products below then take them as stored.
            let t = |x: &Array| match x.ndim() {
                3 => x.transpose(&[0, 2, 1]).and_then(|t| t.contiguous()),
                _ => x.t().and_then(|t| t.contiguous()),
            };
            let (a, b) = (t(&a)?, t(&b)?);
            // Evaluated once here, not on every forward pass.
            a.eval()?;
            b.eval()?;
            Some(Rc::new(Combined { a, b, rescale }))
        };
        *self.combined.borrow_mut() = Some((version, combined.clone()));
        Ok(combined)
    }

    /// Whether an active adapter touches this layer (`base`: the layer it adapts).
    pub fn is_active(&self, base: &Linear) -> Result<bool> {
        Ok(self
            .combined(&|| base.dense_weight(mlxcel_core::Dtype::Float32))?
            .is_some())
    }

    /// `x·Wᵀ + Σᵢ cᵢ·(x·Aᵢᵀ)·Bᵢᵀ` over `base` without its bias, rescaled per row for DoRA
    /// (the base's product alone when nothing is active here).
    pub fn apply(&self, base: &Linear, x: &Array) -> Result<Array> {
        match self.combined(&|| base.dense_weight(mlxcel_core::Dtype::Float32))? {
            None => base.product(x),
            Some(c) => {
                // On mlxcel's CPU kernel the term rides in the base layer's own node: a CPU
                // decode step is bound by its node count as much as by arithmetic, and the
                // term's arithmetic is a few percent of the base's.
                if c.rescale.is_none() {
                    if let Some(y) = base.low_rank_product(x, &c.a, &c.b)? {
                        return Ok(y);
                    }
                }
                let y = base.product(x)?;
                // Few graph nodes per layer: a decode step on the CPU is bound by their count as
                // much as by the arithmetic (a few percent of the base layer's). A batched
                // product flattens and unflattens its input, so `[1, .., 1, T, in]` goes in as
                // the matrix `[T, in]` and the `[T, out]` result broadcasts into `y`. (`addmm`
                // would flatten and broadcast too.)
                let shape = x.shape();
                let rows = shape[..shape.len() - 1].iter().product::<i32>();
                let single_batch = shape.len() > 2 && rows == shape[shape.len() - 2];
                let x2 = if single_batch {
                    x.reshape(&[rows, shape[shape.len() - 1]])?
                } else {
                    x.clone()
                };
                let y = y.add(&x2.matmul(&c.a)?.matmul(&c.b)?)?;
                match &c.rescale {
                    Some(r) => Ok(y.multiply(r)?),
                    None => Ok(y),
                }
            }
        }
    }

    /// For an embedding table (`A` `[r, vocab]`, `B` `[dim, r]`: PEFT's `lora_embedding_A/B`,
    /// mlx-lm's `LoRAEmbedding` `lora_a`/`lora_b` transposed): `y + Σᵢ cᵢ·Aᵢᵀ[ids]·Bᵢᵀ`, the
    /// rows of the low-rank delta `(B·A)ᵀ` `[vocab, dim]` for the looked-up ids.
    pub fn apply_rows(&self, ids: &Array, y: Array) -> Result<Array> {
        match self.combined(&no_dora("an embedding"))? {
            None => Ok(y),
            Some(c) => Ok(y.add(&c.a.take(ids, 0)?.matmul(&c.b)?)?),
        }
    }

    /// For an embedding table serving as the tied output head: `y + Σᵢ cᵢ·(x·Bᵢ)·Aᵢ`, i.e.
    /// `x` against the delta `(B·A)ᵀ` `[vocab, dim]` as a linear layer (mlx-lm's
    /// `LoRAEmbedding.as_linear`; PEFT's merge changes the shared table the same way).
    pub fn apply_tied_head(&self, x: &Array, y: Array) -> Result<Array> {
        match self.combined(&no_dora("an embedding"))? {
            None => Ok(y),
            Some(c) => Ok(y.add(&x.matmul(&c.b.t()?)?.matmul(&c.a.t()?)?)?),
        }
    }

    /// For a stack of experts (mlx-lm's `LoRASwitchLinear`: `A` `[E, r, in]`, `B`
    /// `[E, out, r]`): `y + Σᵢ cᵢ·(x·A[e]ᵀ)·B[e]ᵀ` for the expert `e` of each row, through the
    /// same gathered products as the base ([`super::SwitchLinear::forward_rows`]'s arguments).
    pub fn apply_experts(
        &self,
        x: &Array,
        rows: Option<&Array>,
        experts: &Array,
        sorted: bool,
        y: Array,
    ) -> Result<Array> {
        match self.combined(&no_dora("expert stacks"))? {
            None => Ok(y),
            Some(c) => {
                let z = ops::gather_mm(x, &c.a, rows, Some(experts), sorted)?;
                let z = ops::gather_mm(&z, &c.b, None, Some(experts), sorted)?;
                Ok(y.add(&z)?)
            }
        }
    }
}

/// The base-weight reader for layers that take no DoRA (refused when the adapters are attached;
/// this only guards the invariant).
fn no_dora(what: &'static str) -> impl Fn() -> Result<Array> {
    move || Err(ModelError::Unsupported(format!("DoRA on {what}")))
}
